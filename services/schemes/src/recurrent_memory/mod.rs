//! # Recurrent memory (ARMT)
//!
//! Rodkin et al. 2024, "Associative Recurrent Memory Transformer", served with the execution of
//! Sivtsov et al. 2025, "Diagonal Batching Unlocks Parallelism in Recurrent Memory Transformers
//! for Long Contexts". A prompt of any length is cut into segments of `segment_size` tokens;
//! every layer carries an associative memory from segment to segment
//! ([`wavefront_models::armt`]). Scheme `ar` generates after the context exactly as upstream's
//! `AssociativeRecurrentWrapper.generate`:
//!
//! * every segment but the last runs with its memory tokens, reading and writing each layer's
//!   memory (a *memory segment*);
//! * the last segment (the partial one, or the last full one when the prompt length is a
//!   multiple of `segment_size`) is the *prompt segment*: no memory tokens, no writes, reads of
//!   the memory every earlier segment left, its keys and values kept in a cache;
//! * greedy (or sampled) decoding follows with that cache, positions continuing after the prompt
//!   segment's, reading the frozen memory before every layer.
//!
//! `ar.execution` picks how the prompt's (segment, layer) cells run ([`Execution`]):
//! * `sequential`: one segment through all layers per engine tick;
//! * `diagonal`: one diagonal per tick, every cell with `segment + layer = i` in one grouped
//!   step, `segments + layers - 1` ticks for the whole prompt (the prompt segment is a cell of
//!   the diagonal too, so the first token comes with the last diagonal);
//! * `auto` (or empty): diagonal when the prompt has at least two segments.
//!
//! One tick ([`family`]) runs one grouped step holding the current diagonal of **every**
//! request in diagonal prefill (a request that arrives later joins at its own first diagonal;
//! requests at different diagonals share the layers both touch), plus one pass through the
//! layers of the shared block for every sequential segment and every decoding token, packed.
//!
//! Statistics: counters `segments` (memory segments + the prompt segment) and `grouped_steps`
//! (layer calls the prompt's cells took: one per diagonal, or one per segment and layer when
//! sequential), series `cells_per_step` (this request's cells in each of them).
//!
//! ## Slots
//!
//! The slot unit is a page: `--kv-page-size` ([`PAGE_SIZE`] by default) positions' key and
//! value in one layer of one
//! tensor-parallel rank (`16 · 2 · n_kv_heads · head_dim` values of the model dtype). Cache
//! pages come from the family's page pool (slot ids are page ids). A request holds:
//! - from admission to its end, its memories, `n_layers × ceil(4 · (d_key · d + d_key) / slot
//!   bytes)` (one layer's float32 `A` and `z`), and with diagonal execution the residual
//!   streams of the segments between layers, `ceil(min(n_layers, segments) × (segment_size +
//!   num_mem_tokens) × d · dtype / slot bytes)`. Both live in the model's own slot pools
//!   (`Armt::new_memory`, `Armt::pooled_stream`: one slot per layer's memory, one per waiting
//!   stream), which go back as the request ends or is preempted;
//! - its cache's pages as it needs them: one segment's cell while the prompt runs (a consumed
//!   segment's pages are reused by the next), then the prompt segment and the generated tokens,
//!   a page per layer every 16 tokens.
//!
//! None of it grows with the prompt: a 64k-token context holds what a 2k one does, and the
//! transient activations of a tick are bounded by the cells of one diagonal (at most
//! `n_layers` segments per request). The prompt ids themselves are the only per-token state.
//! A request that finishes, fails or is cancelled drops its memories and cache when the engine
//! retires it, before the next tick, and its slots return to the pool. A preempted request's
//! cache pages, memories and residual streams move to host memory until it resumes.

pub mod family;
pub mod program;

#[cfg(test)]
mod golden_tests;
#[cfg(test)]
mod serving_tests;
#[cfg(test)]
pub(crate) mod test_support;

use std::sync::Arc;

use candle_core::{DType, Device};
use wavefront_engine::{Prepared, RequestError, Stats};
use wavefront_models::armt::{Armt, ArmtConfig};
use wavefront_models::{ModelError, ModelFiles, TextTokenizer};

pub use self::family::{RecurrentMemoryFamily, RunReport};
use self::program::Paging;
pub use self::program::{ArmtOutput, ArmtPlan, ArmtProgram};
use crate::kv_row::{PageSizing, PagedPlanner};
use crate::launch::{checked_family, checkpoint_loader, optional_tokenizer, start_served};
use crate::options::LoadOptions;
use crate::request::{bad, ArParams, Execution, GenerateSpec, SchemeParams};
use crate::sampling::TokenSampler;
use crate::served::{ModelInfo, Planner, ServedModel};
use crate::SchemeError;
use wavefront_models::ModelFamily;

/// This family's name.
pub(crate) const FAMILY: &str = ModelFamily::RecurrentMemory.name();

/// The context limit of a recurrent-memory model when the load options set none. The memory
/// a request holds does not depend on its length; this bounds the work of one request.
pub const DEFAULT_MAX_CONTEXT_TOKENS: usize = 131_072;

/// Validates requests against an ARMT config and builds programs.
pub struct ArmtPlanner {
    cfg: ArmtConfig,
    info: ModelInfo,
    /// The slot unit: one position's K/V in one layer, over all tensor-parallel ranks.
    sizing: PageSizing,
    /// Bytes of one value of the residual streams (the model's dtype).
    act_size: usize,
}

impl ArmtPlanner {
    /// A planner for `cfg` served under `name` with K/V (and, unless
    /// [`Self::with_activation_dtype`] says otherwise, activations) in `dtype`, accepting prompt + `max_new_tokens`
    /// up to `max_context` tokens.
    pub fn new(cfg: ArmtConfig, name: String, dtype: DType, max_context: usize) -> Self {
        let info = ModelInfo {
            name,
            family: FAMILY,
            schemes: vec!["ar"],
            vocab_size: cfg.vocab_size(),
            max_context,
        };
        Self {
            sizing: PageSizing::new(&cfg.block_config(), dtype, cfg.n_layers()),
            act_size: dtype.size_in_bytes(),
            cfg,
            info,
        }
    }

    /// The residual streams between layers are `dtype` (the model's; the K/V pages may store
    /// another, the dtype [`Self::new`] was given).
    pub fn with_activation_dtype(mut self, dtype: DType) -> Self {
        self.act_size = dtype.size_in_bytes();
        self
    }

    /// Slots a request holds from admission to its end whatever it does: its memories and,
    /// with diagonal execution, the residual streams between layers (see the module doc).
    pub fn fixed_slots(&self, segments: usize, diagonal: bool) -> usize {
        let unit = self.slot_bytes();
        let (layers, d) = (self.cfg.n_layers(), self.cfg.hidden_size());
        let memory = layers * (4 * (self.cfg.d_key() * d + self.cfg.d_key())).div_ceil(unit);
        let inflight = if diagonal {
            (layers.min(segments) * self.cfg.cell_rows() * d * self.act_size).div_ceil(unit)
        } else {
            0
        };
        memory + inflight
    }

    /// Slots a request holds at most: the fixed ones and a cache of one segment's cell or of
    /// the prompt segment and every generated token, whichever is longer.
    pub fn slots(
        &self,
        segments: usize,
        prompt_segment: usize,
        max_new: usize,
        diagonal: bool,
    ) -> usize {
        let rows = self.cfg.cell_rows().max(prompt_segment + max_new);
        self.fixed_slots(segments, diagonal) + self.sizing.pages(rows)
    }

    fn prepare_ar(
        &self,
        spec: GenerateSpec,
        a: &ArParams,
    ) -> Result<Prepared<ArmtProgram>, RequestError> {
        let recurrent_depth_only = [
            ("num_steps", a.num_steps.is_some()),
            ("cache_lookup_strategy", a.cache_lookup_strategy.is_some()),
            ("init_scale", a.init_scale.is_some()),
            ("exit_threshold", a.exit_threshold.is_some()),
            ("continuous_compute", a.continuous_compute),
        ];
        if let Some((name, _)) = recurrent_depth_only.iter().find(|(_, set)| *set) {
            return bad(format!(
                "ar.{name} applies to recurrent-depth models; recurrent-memory (ARMT) models \
                 take ar.execution only"
            ));
        }
        if spec.replay_draws.is_some() {
            return bad("replayed draws apply to recurrent-depth models only".into());
        }
        let s = self.cfg.segment_size();
        let t = spec.prompt_ids.len();
        let segments = t.div_ceil(s);
        let prompt_segment = t - (segments - 1) * s;
        let max_positions = self.cfg.llama.max_position_embeddings;
        // Generation feeds positions prompt_segment .. prompt_segment + max_new - 2.
        if prompt_segment + spec.max_new_tokens > max_positions + 1 {
            return bad(format!(
                "the prompt's last segment ({prompt_segment} of its {t} tokens) + max_new_tokens \
                 ({}) exceed the backbone's {max_positions} positions, which generation after the \
                 context continues from; lower max_new_tokens to at most {}",
                spec.max_new_tokens,
                max_positions + 1 - prompt_segment
            ));
        }
        let diagonal = match a.execution {
            Execution::Sequential => false,
            Execution::Diagonal => true,
            Execution::Auto => segments >= 2,
        };
        let max_slots = self.slots(segments, prompt_segment, spec.max_new_tokens, diagonal);
        let mut stats = Stats::default();
        stats.add_counter("segments", segments as u64);
        stats.add_counter("grouped_steps", 0);
        let prompt_tokens = t;
        let guide = spec.guide;
        let mut program = ArmtProgram::new(
            spec.prompt_ids,
            s,
            diagonal,
            TokenSampler::new(spec.sampling),
            spec.max_new_tokens,
            spec.stop_token_ids,
            stats,
        );
        program.constrained = guide.is_some();
        program.guide = guide;
        program.paging = Paging {
            fixed: self.fixed_slots(segments, diagonal),
            tables: self.sizing.tables(),
            cell_rows: self.cfg.cell_rows(),
            max: max_slots,
            page: self.sizing.page,
        };
        let first = program.pages_needed();
        Ok(self
            .sizing
            .reserve
            .prepared(program, first, max_slots, prompt_tokens))
    }
}

impl Planner for ArmtPlanner {
    type Program = ArmtProgram;

    fn eos_token_ids(&self) -> Vec<u32> {
        self.cfg.eos_token_ids()
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn prepare(&self, spec: GenerateSpec) -> Result<Prepared<ArmtProgram>, RequestError> {
        spec.validate_common(self.cfg.vocab_size(), self.info.max_context)?;
        match spec.scheme.clone() {
            SchemeParams::Ar(a) => self.prepare_ar(spec, &a),
            other => bad(format!(
                "scheme `{}` is not served by recurrent-memory models; use `ar` (with \
                 ar.execution `sequential`, `diagonal` or `auto`)",
                other.name()
            )),
        }
    }
}

/// The ARMT config of a model directory (`config.json` + `armt_config.json`).
pub fn config(files: &ModelFiles) -> Result<ArmtConfig, ModelError> {
    let armt = files.armt_config_json().ok_or_else(|| ModelError::Config {
        key: wavefront_models::files::ARMT_CONFIG.into(),
        reason: "an ARMT directory needs its armt_config.json".into(),
    })?;
    ArmtConfig::from_json(files.config_json(), armt)
}

/// Loads an ARMT checkpoint and starts its engine.
pub fn serve(files: ModelFiles, opts: LoadOptions) -> Result<Arc<dyn ServedModel>, SchemeError> {
    let cfg = config(&files)?;
    let tokenizer = optional_tokenizer(&files);
    let load = checkpoint_loader(files, cfg.clone(), &opts, Armt::load_parallel);
    serve_model(cfg, tokenizer, opts, load)
}

/// Starts the engine for the model `load` builds on the engine thread (from a checkpoint, or
/// synthetic weights for benchmarks); `cfg` must be the model's config.
pub fn serve_model<L>(
    cfg: ArmtConfig,
    tokenizer: Option<TextTokenizer>,
    opts: LoadOptions,
    load: L,
) -> Result<Arc<dyn ServedModel>, SchemeError>
where
    L: FnOnce(&Device, DType) -> Result<Armt, SchemeError> + Send + 'static,
{
    let max_context = opts
        .max_context_tokens
        .unwrap_or(DEFAULT_MAX_CONTEXT_TOKENS);
    if max_context < 2 {
        return Err(SchemeError::InvalidOption(format!(
            "the context limit must be at least 2 tokens, got {max_context}"
        )));
    }
    let planner = Arc::new(
        ArmtPlanner::new(cfg.clone(), opts.name.clone(), opts.kv_dtype(), max_context)
            .with_activation_dtype(opts.dtype)
            .with_tensor_parallel(opts.tensor_parallel)
            .with_reserve(opts.kv_reserve)
            .with_page_size(opts.kv_page_size),
    );
    let bytes_per_slot = planner.slot_bytes();
    let make = checked_family(cfg, &opts, load, Armt::config, RecurrentMemoryFamily::new);
    let (page, kv) = (opts.kv_page_size, opts.kv_store());
    let make = move |device: &Device, dtype| make(device, dtype).map(|f| f.with_pages(page, kv));
    // 1% of the pool kept free at admission for running requests to grow into.
    start_served(planner, tokenizer, &opts, bytes_per_slot, 10, make)
}

impl PagedPlanner for ArmtPlanner {
    fn sizing(&self) -> &PageSizing {
        &self.sizing
    }

    fn sizing_mut(&mut self) -> &mut PageSizing {
        &mut self.sizing
    }
}
