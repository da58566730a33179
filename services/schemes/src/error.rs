//! Errors of the schemes crate (model loading; per-request problems are
//! [`wavefront_engine::RequestError`]).

#[derive(Debug, thiserror::Error)]
pub enum SchemeError {
    #[error(transparent)]
    Model(#[from] wavefront_models::ModelError),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("invalid option: {0}")]
    InvalidOption(String),
    #[error("engine failed to start: {0}")]
    Engine(String),
}
