//! Errors of the schemes crate: loading and starting a served model, and a program's step that
//! cannot go on (per-request validation errors are [`wavefront_engine::RequestError`]; the
//! engine sees a failed step as a [`wavefront_engine::FamilyError`] whose cause is one of these).

use wavefront_engine::{Cause, EngineError};
use wavefront_models::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum SchemeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A tensor operation of a forward or a commit failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// A program's plan and its output, or its state, do not fit together: a bug in the scheme,
    /// reported on the one request it concerns.
    #[error("inconsistent step: {0}")]
    Inconsistent(String),
    /// A request's replayed random draws do not cover its step.
    #[error("replayed draws {0}")]
    Draws(String),
    /// A request's state does not encode or decode (moving it between workers).
    #[error("{what} the request's state: {source}")]
    State {
        what: &'static str,
        #[source]
        source: postcard::Error,
    },
    /// The checkpoint's fingerprint could not be computed.
    #[error("the checkpoint has no fingerprint: {0}")]
    Fingerprint(Cause),
    /// The thread computing the fingerprint died.
    #[error("the fingerprint computation failed")]
    FingerprintThread,
    /// A model not loaded from a checkpoint (a benchmark's synthetic weights) has no
    /// fingerprint, so its requests cannot move.
    #[error("this model was not loaded from a checkpoint; it has no fingerprint")]
    NoFingerprint,
    /// The prompt cannot be served as sent (too long, no tokenizer).
    #[error("{0}")]
    Prompt(String),
}

impl SchemeError {
    /// A step whose inputs do not fit together.
    pub(crate) fn inconsistent(what: impl Into<String>) -> Self {
        Self::Inconsistent(what.into())
    }
}
