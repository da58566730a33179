//! A checkpoint's fingerprint: what a request's state must match to move between workers.

use std::sync::{Arc, Mutex, OnceLock};

use wavefront_engine::Cause;
use wavefront_models::{ModelError, ModelFiles};

use crate::SchemeError;

/// A checkpoint's fingerprint ([`ModelFiles::fingerprint`]), computed once on a thread of its
/// own from load on (it reads every weight byte) and waited for by the first move that needs
/// it. A model without files (a benchmark's synthetic weights) has none and moves nothing.
#[derive(Clone, Default)]
pub struct Fingerprint(Option<Arc<FingerprintJob>>);

struct FingerprintJob {
    value: OnceLock<Result<String, Cause>>,
    job: Mutex<Option<std::thread::JoinHandle<Result<String, ModelError>>>>,
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.as_ref().and_then(|j| j.value.get()) {
            Some(Ok(v)) => write!(f, "Fingerprint({v})"),
            Some(Err(e)) => write!(f, "Fingerprint(failed: {e})"),
            None if self.0.is_some() => f.write_str("Fingerprint(computing)"),
            None => f.write_str("Fingerprint(none)"),
        }
    }
}

impl Fingerprint {
    /// Starts computing the fingerprint of `files`.
    pub fn of(files: &ModelFiles) -> Self {
        let files = files.clone();
        let job = std::thread::Builder::new()
            .name("wavefront-fingerprint".into())
            .spawn(move || files.fingerprint());
        let (value, job) = match job {
            Ok(h) => (OnceLock::new(), Some(h)),
            Err(e) => (OnceLock::from(Err(Cause::new(e))), None),
        };
        Self(Some(Arc::new(FingerprintJob {
            value,
            job: Mutex::new(job),
        })))
    }

    /// A fingerprint the caller vouches for: weights with no files behind them (a benchmark's
    /// synthetic weights, made from a seed) named by what makes them.
    pub fn given(value: impl Into<String>) -> Self {
        Self(Some(Arc::new(FingerprintJob {
            value: OnceLock::from(Ok(value.into())),
            job: Mutex::new(None),
        })))
    }

    /// The fingerprint, waiting for it if it is still being computed.
    pub fn get(&self) -> Result<String, SchemeError> {
        let job = self.0.as_ref().ok_or(SchemeError::NoFingerprint)?;
        job.value
            .get_or_init(|| {
                let handle = job
                    .job
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take();
                match handle.map(|h| h.join()) {
                    Some(Ok(r)) => r.map_err(Cause::new),
                    _ => Err(Cause::new(SchemeError::FingerprintThread)),
                }
            })
            .clone()
            .map_err(SchemeError::Fingerprint)
    }
}
