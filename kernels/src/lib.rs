//! Kernels for the work generic candle ops do poorly in this server, each with a CPU reference
//! implementation that defines its semantics and a CUDA kernel (under the `cuda` feature,
//! compiled to PTX by `build.rs`) that must agree with it:
//!
//! - [`attention`]: **ragged attention** over gathered K/V. The packed rows of many sequences
//!   (requests, slots, segments) attend in one launch, each to its own keys only, under its own
//!   mask rule (bidirectional, causal on buffer indices, WINO's shadow block). Candle would
//!   pad every sequence to the longest or loop over sequences, one launch each.
//! - [`grouped`]: **grouped matmul** over layer-stacked weights. Diagonal batching (ARMT) runs
//!   the cells of one step, each at a different layer, as one launch: every group of rows is
//!   multiplied by its own layer's weight, read in place from the `[L, out, in]` stack.
//! - [`pages`]: **rows into K/V pages**: a call's rows written to the page slots their
//!   buffer indices name, however scattered, one launch per page arena (SureLock's unlocked
//!   positions would otherwise be a copy per run of consecutive indices).
//! - [`softmax_stats`]: **fused per-row softmax statistics** over the vocabulary: top-1
//!   probability and id, log-sum-exp, and the KL divergence to the previous step's
//!   distribution. Lock (SureLock), exit and draft (WINO, ReFusion) decisions then copy a few
//!   numbers per row to the host instead of whole logit rows.
//!
//! Layouts (head-major for attention, row-major elsewhere) are documented on each entry point;
//! the CPU functions take slices so the tests can compare them with independent compositions of
//! candle ops, and the CUDA launchers (`cuda` module) take device slices with the same layouts.

pub mod attention;
pub mod cpu;
pub mod grouped;
pub mod pages;
pub mod softmax_stats;

#[cfg(feature = "cuda")]
pub mod cuda;

/// Why a kernel did not run: an input that does not describe a valid problem, the CPU pool
/// sized twice, or a CUDA error.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("kernel input: {0}")]
    Shape(String),
    #[error("the CPU kernels' thread pool was already started")]
    PoolStarted,
    #[cfg(feature = "cuda")]
    #[error("cuda: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
}

pub(crate) fn check(cond: bool, msg: impl FnOnce() -> String) -> Result<(), KernelError> {
    if cond {
        Ok(())
    } else {
        Err(KernelError::Shape(msg()))
    }
}
