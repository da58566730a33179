//! Errors of the engine core: what a request is answered instead of a result
//! ([`EngineError`]), why it was refused before admission ([`RequestError`]), and why a family
//! could not do its part of a tick ([`FamilyError`]).

use std::sync::Arc;

/// A failure from below the engine (a model, a kernel, a device, a codec), kept typed: the
/// engine knows no tensors, so it holds the error behind a shared pointer. The error it wraps
/// is its [`std::error::Error::source`], and [`Cause::downcast_ref`] reaches its type. Cloned
/// cheaply, since a failed forward fails every request in it.
#[derive(Clone)]
pub struct Cause(Arc<dyn std::error::Error + Send + Sync + 'static>);

impl Cause {
    pub fn new(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(error))
    }

    /// The wrapped error as a `T`, if it is one.
    pub fn downcast_ref<T: std::error::Error + 'static>(&self) -> Option<&T> {
        self.0.downcast_ref::<T>()
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Debug for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.0.as_ref())
    }
}

/// Two causes are the same failure when they say the same (events are compared in tests).
impl PartialEq for Cause {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.to_string() == other.to_string()
    }
}

/// A request rejected before admission, with a message saying what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// A parameter is out of range or inconsistent with another one.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The request needs more than this model or worker can ever give.
    #[error("too large: {0}")]
    TooLarge(String),
}

/// The phase of a tick a failure happened in, for messages and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Plan,
    Commit,
    Preempt,
    Resume,
    Export,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Plan => "plan",
            Phase::Commit => "commit",
            Phase::Preempt => "preemption",
            Phase::Resume => "resumption",
            Phase::Export => "export",
        })
    }
}

/// Why a family could not do its part of a tick for some requests: the one error type at the
/// engine/family seam. A failed forward fails the requests of its group; a failed plan, commit,
/// preemption or resumption fails its own request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FamilyError {
    /// A model operation failed: a forward, a kernel, device memory.
    #[error("{0}")]
    Forward(Cause),
    /// A request's program could not plan its step, apply its outputs, or move its state.
    #[error("{family} {phase} failed: {cause}")]
    Program {
        family: &'static str,
        phase: Phase,
        cause: Cause,
    },
    /// The family's run returned no output for a planned request (a family bug, reported
    /// instead of leaving the request waiting forever).
    #[error("the {family} family ran no forward for this request's plan")]
    NoOutput { family: &'static str },
    /// The family does not do this (preempt, move between workers).
    #[error("this model family cannot {0}")]
    Unsupported(&'static str),
    /// The request's next step needs more slots than the whole pool holds.
    #[error("the next step needs {need} slots and the pool holds {total}")]
    PoolTooSmall { need: usize, total: usize },
}

impl FamilyError {
    /// A failed model operation, from its error.
    pub fn forward(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Forward(Cause::new(e))
    }

    /// A program of `family` that failed in `phase`.
    pub fn program(
        family: &'static str,
        phase: Phase,
        e: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Program {
            family,
            phase,
            cause: Cause::new(e),
        }
    }

    /// A program of `family` that could not apply its outputs.
    pub fn commit(family: &'static str, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::program(family, Phase::Commit, e)
    }

    /// The typed error behind a forward or program failure.
    pub fn cause(&self) -> Option<&Cause> {
        match self {
            Self::Forward(c) | Self::Program { cause: c, .. } => Some(c),
            _ => None,
        }
    }
}

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
    /// The client left its response unread for `secs` seconds (`--write-timeout-s`): the
    /// request was cancelled and its memory freed.
    #[error(
        "the response was left unread for {secs} s (--write-timeout-s); the request was cancelled"
    )]
    WriteTimeout { secs: u64 },
    /// The engine did not start: its family failed to build on the engine thread (a model that
    /// does not load), or the thread could not be spawned.
    #[error("the engine failed to start: {0}")]
    Start(Cause),
    /// Programs driven without a scheduler ([`crate::Standalone`]) were still running after
    /// the ticks given them.
    #[error("programs still running after {ticks} ticks")]
    NotFinished { ticks: usize },
}
