//! The one error type of this crate.
//!
//! Every fallible function in `wavefront-models` returns [`ModelError`]. Variants name the domain
//! problem (a missing checkpoint tensor, an invalid `config.json` key, a cache misuse) rather than
//! wrapping strings, so callers can map them to precise status codes at the service edge.

use std::path::PathBuf;

/// Errors raised while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file of the model directory could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A JSON document (config, tokenizer config, shard index) is not valid JSON or has the wrong shape.
    #[error("invalid JSON in {what}: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },

    /// A device or dtype name that does not parse or cannot be opened.
    #[error("{0}")]
    Device(String),
    /// A `config.json` key is missing or holds a value this implementation cannot use.
    #[error("invalid config key `{key}`: {reason}")]
    Config { key: String, reason: String },

    /// The checkpoint lacks a tensor the architecture needs.
    #[error(
        "checkpoint has no tensor `{name}`: the safetensors weights are not those of the \
         architecture config.json describes (or are incomplete)"
    )]
    MissingTensor { name: String },

    /// Tensor shapes or row counts do not fit together.
    #[error("shape mismatch: {0}")]
    Shape(String),

    /// An error from the tensor library.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// A kernel of `wavefront-kernels` refused its inputs or failed on the device.
    #[error(transparent)]
    Kernel(#[from] wavefront_kernels::KernelError),

    /// The tokenizer files do not describe a usable tokenizer.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The tokenizer library failed to load, encode or decode.
    #[error("tokenizer: {0}")]
    Tokenize(#[source] tokenizers::Error),

    /// A tokenizer file the tokenizer library cannot read.
    #[error(
        "tokenizer: {file}: {source} (the file is truncated or not a Hugging Face tokenizer.json)"
    )]
    TokenizerFile {
        file: &'static str,
        #[source]
        source: tokenizers::Error,
    },

    /// An attention path that does not exist (`--attention`).
    #[error("unknown attention kernel {name:?}: expected one of {expected}")]
    UnknownAttentionKernel { name: String, expected: String },

    /// The checkpoint's chat template does not parse, or does not render these messages.
    #[error("chat template: {0}")]
    ChatTemplate(#[from] minijinja::Error),

    /// The model family, a config flag or a requested feature is not implemented.
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// A cache lookup strategy string could not be parsed.
    #[error(
        "unknown cache strategy `{0}` (expected `full`, `latest-m4`, `compress-sN` or `latest-m4-compress-sN`)"
    )]
    CacheStrategy(String),

    /// A KV cache was used inconsistently (positions out of order, missing entries).
    #[error("kv cache: {0}")]
    Cache(String),
}

/// Shorthand used throughout the crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
