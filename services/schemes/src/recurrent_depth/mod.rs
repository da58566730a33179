//! # Recurrent depth (Huginn-0125)
//!
//! Geiping et al. 2025, "Scaling up Test-Time Compute with Latent Reasoning:
//! A Recurrent Depth Approach": a prelude, a core block iterated `r` times
//! with the prelude output injected at every step, and a coda. Decoding
//! schemes served here:
//! - `ar` static: a fixed number of recurrence steps per token ([`ar`]);
//! - `ar` adaptive exit: iterate until the latent stops moving ([`ar`]);
//! - `diffusion-forcing`: a wavefront of positions iterated together, frozen
//!   as their latents converge ([`diffusion`]; Geiping et al. 2025, "Efficient
//!   Parallel Samplers for Recurrent-Depth Models and Their Connection to
//!   Diffusion Language Models").
//!
//! Both schemes take upstream's `continuous_compute`: a new position starts
//! from the latent state of the position before it instead of a fresh random
//! draw (see each module for the exact state copied).
//!
//! The planner validates a request and builds its program on the caller's
//! thread; the family packs every active program's rows into one prelude,
//! one core call per recurrence and one coda call per tick.
//!
//! ## Slots
//!
//! The slot unit is a page: `--kv-page-size` ([`PAGE_SIZE`] by default) rows of
//! `2 · n_embd` values of the
//! model dtype; the pool holds `memory_budget_bytes / (16 · 2 · n_embd · dtype
//! size)` of them. A page holds either
//! - the keys and values of 16 consecutive positions in one cache layer (a
//!   prelude or coda layer, or a core layer at one recurrence), or
//! - 16 rows of a diffusion-forcing request's wavefront: each position's
//!   latent state in the key half (also the state the freeze test compares the
//!   next step's with) and, with momentum, the step's mixed embeddings in the
//!   value half ([`HuginnCache::write_latents`]).
//!
//! The K/V pages are the family's page pool ([`HuginnFamily`]): slot ids are
//! page ids, and a request's [`HuginnCache`] takes a page when a position in
//! it is first written to a cache layer. Cache layers are the prelude and coda
//! layers plus the core layers its `cache_lookup_strategy` keeps (every
//! recurrence for `full` and `latest-m4`, `N` for `compress-sN`). Before each
//! tick a request is granted the pages its next positions can reach
//! ([`Program::pages_needed`]: a page for every cache layer whose page of a new
//! position it does not hold yet), so an adaptive exit that stops early leaves
//! the deeper slots' pages untaken; admission takes the first step's pages
//! (the prompt's), not the worst case. The worst case (prompt +
//! `max_new_tokens` positions, plus `max_wavefront` for diffusion forcing, in
//! every cache layer) bounds what a request may ever hold: one larger than the
//! pool is refused at once.
//!
//! A diffusion-forcing request also holds latent pages for its wavefront's states:
//! `ceil(rows × occupancy_multiplier / 16)` for the rows the wave has after the
//! next step (one after the prefill, then the wave plus its headway), at most
//! `ceil(max_wavefront × occupancy_multiplier / 16)`
//! ([`LoadOptions::occupancy_multiplier`]; values below 1.0 count as 1.0). Pages
//! are taken as the wave grows and given back as its positions freeze and it
//! shrinks. The states live in those pages, not in request tensors: each step reads
//! them (a copy into the packed rows) and writes the next wave back into the same
//! pages, so preemption, resumption and export move them with the K/V pages.
//! `ar` latent states live only within one tick.
//!
//! When the pool is short the engine preempts the newest request: its pages
//! are copied to host memory with its latent states and given back, and it
//! resumes, in whatever pages are free then, ahead of new arrivals, producing
//! exactly the tokens it would have.

pub mod ar;
pub mod diffusion;
pub mod draws;
mod family;
#[cfg(test)]
mod golden_tests;
mod packed;
mod planner;
#[cfg(test)]
mod scheme_tests;
#[cfg(test)]
mod serving_tests;
#[cfg(test)]
pub(crate) mod test_support;

use std::sync::Arc;

use candle_core::{DType, Device};
use wavefront_engine::Family;
use wavefront_models::{Huginn, HuginnCache, HuginnConfig, ModelFiles, TextTokenizer};

pub use self::family::{HuginnFamily, HuginnOutput, HuginnPlan};
pub use self::planner::{HuginnPlanner, Program, MAX_NUM_STEPS};
use crate::launch::{checked_family, checkpoint_loader, optional_tokenizer, start_served};
use crate::options::LoadOptions;
use crate::served::ServedModel;
use crate::SchemeError;

/// Loads a Huginn checkpoint and starts its engine.
pub fn serve(files: ModelFiles, opts: LoadOptions) -> Result<Arc<dyn ServedModel>, SchemeError> {
    let cfg = HuginnConfig::from_json(files.config_json())?;
    let tokenizer = optional_tokenizer(&files);
    let load = checkpoint_loader(files, cfg.clone(), &opts, Huginn::load_parallel);
    serve_model(cfg, tokenizer, opts, load)
}

/// Starts the engine for the model `load` builds on the engine thread (from a checkpoint, or
/// synthetic weights for benchmarks); `cfg` must be the model's config.
pub fn serve_model<L>(
    cfg: HuginnConfig,
    tokenizer: Option<TextTokenizer>,
    opts: LoadOptions,
    load: L,
) -> Result<Arc<dyn ServedModel>, SchemeError>
where
    L: FnOnce(&Device, DType) -> Result<Huginn, SchemeError> + Send + 'static,
{
    let make = checked_family(cfg.clone(), &opts, load, Huginn::config, HuginnFamily::new);
    let (page, kv) = (opts.kv_page_size, opts.kv_store());
    let make = move |device: &Device, dtype| make(device, dtype).map(|f| f.with_pages(page, kv));
    serve_family(cfg, tokenizer, opts, make)
}

/// Sizes the slot pool from the memory budget and starts the engine with the family `make`
/// builds on the engine thread.
pub(crate) fn serve_family<F, M>(
    cfg: HuginnConfig,
    tokenizer: Option<TextTokenizer>,
    opts: LoadOptions,
    make: M,
) -> Result<Arc<dyn ServedModel>, SchemeError>
where
    F: Family<Program = Program>,
    M: FnOnce(&Device, DType) -> Result<F, SchemeError> + Send + 'static,
{
    let m = opts.occupancy_multiplier;
    if !m.is_finite() || m <= 0.0 {
        return Err(SchemeError::InvalidOption(format!(
            "occupancy multiplier must be a positive number, got {m}"
        )));
    }
    let planner = Arc::new(
        HuginnPlanner::new(cfg.clone(), opts.name.clone(), tokenizer.as_ref())
            .with_occupancy_multiplier(m)
            .with_reserve(opts.kv_reserve)
            .with_page_size(opts.kv_page_size)
            .with_latent_rows(HuginnCache::latent_rows_storing(opts.kv_store())),
    );
    let bytes_per_slot = opts.kv_page_size * 2 * cfg.n_embd * opts.kv_dtype().size_in_bytes();
    // 1% of the pool kept free at admission for running requests to grow into.
    start_served(planner, tokenizer, &opts, bytes_per_slot, 10, make)
}
