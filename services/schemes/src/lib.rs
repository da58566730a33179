//! # wavefront-schemes: decoding schemes and the families that pack them
//!
//! Each model family implements [`wavefront_engine::Family`]: it owns the
//! model and, once per engine tick, packs the rows every active program
//! needs into batched forwards and lets each program commit its results.
//! A [`Planner`] validates a request and builds its program before it is
//! queued, so bad input is answered synchronously.
//!
//! | family | module | schemes |
//! |---|---|---|
//! | recurrent depth (Huginn-0125) | [`recurrent_depth`] | `ar` (static, adaptive exit), `diffusion-forcing` |
//! | masked diffusion (LLaDA, Dream) | [`masked_diffusion`] | `low-confidence`, `wino` (both with SureLock; LLaDA), `diffusion-generate` (Dream) |
//! | masked diffusion (LLaDA2.0, mixture of experts) | [`block_diffusion`] | `block-diffusion` |
//! | recurrent memory (ARMT) | [`recurrent_memory`] | `ar` (`execution`: sequential or diagonal batching) |
//! | slot diffusion (ReFusion) | [`slot_diffusion`] | `plan-infill`, `ar` |
//! | uniform diffusion (DiffusionGemma, mixture of experts) | [`uniform_diffusion`] | `entropy-bound` |
//!
//! Everything above this crate sees a model through [`ServedModel`]: submit a
//! [`GenerateSpec`], receive [`wavefront_engine::Event`]s.

pub mod block_diffusion;
pub mod constraint;
#[cfg(test)]
mod constraint_tests;
pub mod error;
#[cfg(test)]
mod fault_tests;
pub mod fingerprint;
mod kv_row;
pub mod launch;
#[cfg(test)]
mod logprob_tests;
pub mod masked_diffusion;
pub mod migrate;
pub mod options;
mod packing;
mod paging;
#[cfg(test)]
mod prompt_sharing_tests;
pub mod recurrent_depth;
pub mod recurrent_memory;
pub mod registry;
pub mod request;
pub mod sampling;
pub mod served;
pub mod slot_diffusion;
#[cfg(test)]
mod test_support;
pub mod uniform_diffusion;

pub use error::SchemeError;
pub use fingerprint::Fingerprint;
pub use kv_row::{PageSizing, PagedPlanner};
pub use launch::Served;
pub use options::{KvCacheDtype, KvReserve, LoadOptions};
pub use registry::load_model;
pub use request::{
    ArParams, BlockDiffusionParams, DiffusionForcingParams, DiffusionGenerateParams, DreamAlg,
    EntropyBoundParams, EosRule, Execution, FreezeTest, GenerateSpec, KvCacheMode,
    LowConfidenceParams, PlanInfillParams, Remasking, ReplayDraws, SamplingParams, SchemeParams,
    SureLockParams, WinoParams,
};
pub use served::{chat_too_long, ModelInfo, Planner, ServedModel};
