//! Errors of the engine core.

use crate::family::{FamilyError, RequestError};

/// Everything the engine can answer instead of a result. Transports map each
/// variant to their own status codes (the worker maps them to gRPC codes).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The admission queue is at capacity; the client should retry later.
    #[error("admission queue is full ({capacity} requests waiting); retry later or add workers")]
    QueueFull { capacity: usize },
    /// The request can never fit in this worker's slot pool.
    #[error("request needs {needed} slots but this worker has {total} in total")]
    TooLarge { needed: usize, total: usize },
    /// The request was rejected by its family before admission.
    #[error(transparent)]
    Invalid(#[from] RequestError),
    /// The request's deadline passed before it finished.
    #[error("deadline exceeded after {generated} generated tokens")]
    DeadlineExceeded { generated: usize },
    /// The family failed while computing a tick this request took part in.
    #[error("model step failed: {0}")]
    StepFailed(FamilyError),
    /// The request moved to another worker ([`crate::EngineHandle::finish_export`]); its stream
    /// here ends.
    #[error("the request moved to another worker")]
    Moved,
    /// No running request has this id (it finished, or never ran here).
    #[error("{0}")]
    NotFound(String),
    /// The request cannot be moved now, or its state cannot be taken in: the message says why.
    #[error("{0}")]
    CannotMove(String),
    /// The engine thread is gone (shutting down or crashed).
    #[error("engine is shut down")]
    ShutDown,
}
