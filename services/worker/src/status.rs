//! The one mapping from domain errors to gRPC status codes.

use tonic::Status;
use wavefront_engine::{EngineError, RequestError};
use wavefront_schemes::SchemeError;

pub fn from_request_error(e: &RequestError) -> Status {
    match e {
        RequestError::InvalidArgument(m) => Status::invalid_argument(m.clone()),
        RequestError::TooLarge(m) => Status::invalid_argument(m.clone()),
    }
}

pub fn from_engine_error(e: &EngineError) -> Status {
    match e {
        EngineError::QueueFull { .. } => Status::resource_exhausted(e.to_string()),
        EngineError::TooLarge { .. } => Status::resource_exhausted(e.to_string()),
        EngineError::Invalid(r) => from_request_error(r),
        EngineError::DeadlineExceeded { .. } => Status::deadline_exceeded(e.to_string()),
        EngineError::StepFailed(_) => Status::internal(e.to_string()),
        EngineError::ShutDown => Status::unavailable(format!("{e}; retry on another worker")),
        EngineError::Moved => Status::aborted(e.to_string()),
        EngineError::NotFound(m) => Status::not_found(m.clone()),
        EngineError::CannotMove(m) => Status::failed_precondition(m.clone()),
        EngineError::Start(_) | EngineError::NotFinished { .. } => Status::internal(e.to_string()),
        EngineError::WriteTimeout { .. } => Status::deadline_exceeded(e.to_string()),
    }
}

/// A served model's refusal outside the engine: a prompt it cannot take, or a request state it
/// cannot move.
pub fn from_scheme_error(e: &SchemeError) -> Status {
    match e {
        SchemeError::Prompt(_) | SchemeError::Model(_) | SchemeError::Draws(_) => {
            Status::invalid_argument(e.to_string())
        }
        SchemeError::Unsupported(_)
        | SchemeError::Fingerprint(_)
        | SchemeError::FingerprintThread
        | SchemeError::NoFingerprint => Status::failed_precondition(e.to_string()),
        SchemeError::State { .. } => Status::invalid_argument(e.to_string()),
        SchemeError::Engine(inner) => from_engine_error(inner),
        SchemeError::Tensor(_) | SchemeError::InvalidOption(_) | SchemeError::Inconsistent(_) => {
            Status::internal(e.to_string())
        }
    }
}
