//! Credentials on gRPC and HTTP calls: API keys on the router's public endpoints and a token
//! on router-to-worker calls, both sent as `authorization: Bearer <secret>`.
//!
//! Secrets are compared in constant time (no early exit on the first differing byte, every
//! configured key checked) and never printed: [`Secrets`]' `Debug` shows how many there are.

use std::sync::Arc;

use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// One or more secrets (API keys, or the worker token).
#[derive(Clone, Default)]
pub struct Secrets(Arc<Vec<Vec<u8>>>);

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets({} redacted)", self.0.len())
    }
}

impl Secrets {
    /// Secrets from a comma-separated list and the lines of an optional file (blank lines and
    /// lines starting with `#` skipped). A secret must be visible ASCII, so that it can travel in
    /// a header.
    pub fn parse(list: &[String], file_text: Option<&str>) -> Result<Self, crate::ProtoError> {
        let mut keys = Vec::new();
        let from_file = file_text
            .into_iter()
            .flat_map(str::lines)
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'));
        for k in list.iter().map(|s| s.trim()).chain(from_file) {
            if k.is_empty() {
                continue;
            }
            if !k.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(crate::ProtoError::Secret(
                    "a key holds a space or a character outside visible ASCII",
                ));
            }
            keys.push(k.as_bytes().to_vec());
        }
        Ok(Self(Arc::new(keys)))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `presented` is one of the secrets, in time independent of where it differs.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let mut ok = 0u8;
        for k in self.0.iter() {
            ok |= u8::from(constant_time_eq(k, presented));
        }
        ok == 1
    }

    /// The first secret as a header value (`Bearer <secret>`), for calls this process makes.
    pub fn bearer(&self) -> Option<AsciiMetadataValue> {
        let k = self.0.first()?;
        format!("Bearer {}", std::str::from_utf8(k).ok()?)
            .parse()
            .ok()
    }
}

/// Equality whose time depends on the lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    diff == 0
}

/// The secret of an `authorization: Bearer <secret>` header value.
pub fn bearer_secret(header: Option<&[u8]>) -> Option<&[u8]> {
    let v = header?;
    let (scheme, rest) = v.split_at(v.iter().position(|&b| b == b' ')?);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| rest.trim_ascii())
}

fn presented(md: &MetadataMap) -> Option<&[u8]> {
    bearer_secret(md.get("authorization").map(|v| v.as_bytes()))
}

/// Server side: refuses a call without one of `secrets` with UNAUTHENTICATED (no secrets: every
/// call passes).
#[derive(Clone, Debug)]
pub struct RequireSecret {
    secrets: Secrets,
    /// What the refusal tells the caller to send.
    what: &'static str,
}

impl RequireSecret {
    /// `what` names the credential in the refusal ("an API key", "the worker token").
    pub fn new(secrets: Secrets, what: &'static str) -> Self {
        Self { secrets, what }
    }
}

impl Interceptor for RequireSecret {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        if self.secrets.is_empty()
            || presented(request.metadata()).is_some_and(|p| self.secrets.accepts(p))
        {
            return Ok(request);
        }
        Err(Status::unauthenticated(format!(
            "missing or wrong credential: send {} as `authorization: Bearer <secret>`",
            self.what
        )))
    }
}

/// Client side: adds `authorization: Bearer <secret>` to every call (nothing without one).
#[derive(Clone, Debug, Default)]
pub struct AttachSecret(Option<AsciiMetadataValue>);

impl AttachSecret {
    pub fn new(secrets: &Secrets) -> Self {
        Self(secrets.bearer())
    }
}

impl Interceptor for AttachSecret {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert("authorization", v.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_compare_and_never_print() {
        let s = Secrets::parse(&["k1, k2".into()], None);
        assert!(s.is_err(), "a space inside a key is refused");
        let s = Secrets::parse(&["k1".into(), "k2".into()], Some("# comment\n\nk3\n")).unwrap();
        assert!(s.accepts(b"k1") && s.accepts(b"k2") && s.accepts(b"k3"));
        assert!(!s.accepts(b"k") && !s.accepts(b"k11") && !s.accepts(b""));
        assert_eq!(format!("{s:?}"), "Secrets(3 redacted)");
        assert!(!format!("{s:?}").contains("k1"));
        assert_eq!(bearer_secret(Some(b"Bearer abc")), Some(&b"abc"[..]));
        assert_eq!(bearer_secret(Some(b"bearer  abc ")), Some(&b"abc"[..]));
        assert_eq!(bearer_secret(Some(b"Basic abc")), None);
        assert_eq!(bearer_secret(None), None);
    }

    #[test]
    fn the_interceptors_attach_and_require() {
        let s = Secrets::parse(&["tok".into()], None).unwrap();
        let req = AttachSecret::new(&s).call(Request::new(())).unwrap();
        assert!(RequireSecret::new(s.clone(), "x").call(req).is_ok());
        let err = RequireSecret::new(s, "the worker token")
            .call(Request::new(()))
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        assert!(err.message().contains("the worker token"));
        assert!(RequireSecret::new(Secrets::default(), "x")
            .call(Request::new(()))
            .is_ok());
    }
}
