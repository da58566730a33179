//! # Slot diffusion (ReFusion)
//!
//! Li, Guan, Wu, Li 2025, "ReFusion: A Diffusion Large Language Model with Parallel
//! Autoregressive Decoding" (arXiv:2512.13586): a causal Qwen3 trained to fill masked *spans*
//! (fixed-length runs of consecutive positions; the paper, the family's name and the API's
//! `slot_size` / `slot_threshold` call them slots, a word this code keeps for the engine's unit
//! of memory) in any order. Decoded spans are moved in front
//! of the still-masked ones, each keeping its true position id (RoPE), so attention stays causal
//! in buffer order and every decoded token's K/V is computed once and reused. Schemes served
//! here:
//! - `plan-infill` (upstream `generate_refusion()`): semi-autoregressive blocks, each decoded
//!   by iterations of *plan* (a diffusion-style draft of all the block's masked spans; select
//!   the spans whose first token is confident) and *infill* (verify the drafts autoregressively;
//!   commit whole verified spans, or complete the selected spans in parallel, each over its own
//!   copy of the cache, and stitch their K/V) ([`plan_infill`]);
//! - `ar`: plain causal decoding of the same model with the same KV cache, one token per step
//!   ([`ar`]), the baseline of `bench-slot-diffusion`.
//!
//! Parameters keep upstream's names: `gen_length` is `max_new_tokens`, `slot_size`,
//! `serial_num_blocks` (the *number* of blocks, not their length), `slot_threshold`,
//! `token_threshold`, and the sampling temperature (Gumbel noise on planning drafts only; the
//! infill loop is always greedy, as upstream). Defaults are upstream's function defaults:
//! `slot_size` 8, `serial_num_blocks` 2, thresholds 0.9 / 0.9. `max_new_tokens` is a cap, as
//! OpenAI's `max_tokens`: the canvas is `gen_length` rounded up to whole blocks of whole spans
//! (upstream rounds up to whole spans), and the response ends after `max_new_tokens` tokens.
//!
//! ## The engine's unit of work
//!
//! One tick runs one *model call* of every active request: its planning call (the block's masked
//! spans, plus the prompt on the first call), its verification call (the selected drafts), one
//! draft or verify call of iterative completion (one row per selected span), or one
//! autoregressive step. Every row of every call is its own attention sequence over its own keys
//! ([`family`]), so the parallel completion of one request's spans and the steps of other
//! requests share one forward, and a request's result does not depend on its batch. The model
//! calls of a request, their inputs and their number are exactly upstream's.
//!
//! ## End of sequence
//!
//! The model's `eos_token_id` and the request's `stop_token_ids` act as upstream's EOS: a stop
//! token in the verified prefix or accepted during iterative completion removes its span's
//! right-hand side from the block and ends decoding after the block. Tokens committed earlier
//! at later positions stay in the buffer, as upstream; the *response* is the generated text in
//! position order cut after the first stop token. Upstream's iterative-completion branch removes
//! `range(first_eos_block_idx, n)` from the block's pool, with a row index among the selected
//! spans used as a pool index, which can drop undecoded spans *left of* the EOS: they are never
//! generated and upstream's output has a gap. Here ([`crate::request::EosRule::Aligned`], the
//! default) only the EOS span and the spans to its right are removed, so the spans to its left
//! are still generated and the output has no gap; [`crate::request::EosRule::Upstream`]
//! reproduces the quirk (the golden `eos_quirk_b16` run) and is not exposed in the API.
//!
//! ## Streaming
//!
//! Spans are committed in any order; a token streams once every position before it is final
//! (committed), and the stream ends at the first stop token in position order ([`canvas`]).
//! [`plan_infill::PlanInfill`]'s `commit_spans` is the one place where spans (positions and
//! tokens, in commit order) become final.
//!
//! ## Slots
//!
//! A slot is a page: `--kv-page-size` buffer rows' keys and values in one layer of one
//! tensor-parallel rank ([`RefusionPlanner::slot_bytes`]). A request takes, before each call,
//! the pages its committed cache can reach after it (the committed buffer plus one block: the
//! planning call's masked spans, the verification call's drafts, or the rows of iterative
//! completion, each in its own segment of the committed cache's pages,
//! `MaskRule::SegmentCausal`), at most `(prompt + gen_length + block_length)` rows per layer;
//! an `ar` request at most `(prompt + max_new_tokens)`. Per-call attention buffers are working
//! memory of the tick.

pub mod family;
pub mod plan_infill;
pub mod program;

mod ar;
mod call;
mod canvas;

#[cfg(test)]
mod golden_tests;
#[cfg(test)]
mod serving_tests;
#[cfg(test)]
pub(crate) mod test_support;

use std::sync::Arc;

use candle_core::{DType, Device};
use wavefront_engine::{Prepared, RequestError};
use wavefront_models::{ModelFiles, Qwen3, Qwen3Config, TextTokenizer};

use self::ar::ArDecode;
pub use self::family::SlotDiffusionFamily;
pub use self::plan_infill::{CallRecord, CompletionRecord, IterationRecord};
use self::plan_infill::{PlanInfill, Settings};
use self::program::Scheme;
pub use self::program::SdProgram;
use crate::kv_row::{PageSizing, PagedPlanner};
use crate::launch::{checked_family, checkpoint_loader, optional_tokenizer, start_served};
use crate::options::LoadOptions;
use crate::request::{bad, ArParams, GenerateSpec, PlanInfillParams, SchemeParams};
use crate::sampling::TokenSampler;
use crate::served::{ModelInfo, Planner, ServedModel};
use crate::SchemeError;
use wavefront_models::ModelFamily;

/// This family's name.
pub(crate) const FAMILY: &str = ModelFamily::SlotDiffusion.name();
/// Validates requests against a ReFusion config and builds programs.
pub struct RefusionPlanner {
    cfg: Qwen3Config,
    mask_id: u32,
    info: ModelInfo,
    /// One position's K/V in one layer, over all tensor-parallel ranks.
    sizing: PageSizing,
}

impl RefusionPlanner {
    /// A planner for `cfg` (which must name a `mask_token_id`) served under `name` with weights
    /// and caches in `dtype`.
    pub fn new(cfg: Qwen3Config, name: String, dtype: DType) -> Result<Self, SchemeError> {
        let mask_id = cfg.mask_token_id.ok_or_else(|| {
            SchemeError::Unsupported(
                "a Qwen3 config without mask_token_id is not a ReFusion checkpoint".into(),
            )
        })?;
        let info = ModelInfo {
            name,
            family: FAMILY,
            schemes: vec!["plan-infill", "ar"],
            vocab_size: cfg.vocab_size,
            max_context: cfg.max_position_embeddings,
        };
        Ok(Self {
            sizing: PageSizing::new(&cfg.block_config(), dtype, cfg.num_hidden_layers),
            cfg,
            mask_id,
            info,
        })
    }

    /// Slots (pages) a cache of `rows` buffer rows takes.
    pub fn slots(&self, rows: usize) -> usize {
        self.sizing.pages(rows)
    }

    /// The request of `scheme`, its caches at most `max_rows` rows: its first step's pages at
    /// admission, or its worst case.
    fn prepared(
        &self,
        scheme: Scheme,
        max_rows: usize,
        prompt_tokens: usize,
    ) -> Prepared<SdProgram> {
        let max_slots = self.slots(max_rows);
        let program = SdProgram::new(scheme, self.sizing.tables(), max_slots);
        let first = program.pages_needed(self.sizing.page);
        self.sizing
            .reserve
            .prepared(program, first, max_slots, prompt_tokens)
    }

    fn stop_ids(&self, spec: &GenerateSpec) -> Vec<u32> {
        let mut stop = spec.stop_token_ids.clone();
        stop.extend(self.cfg.eos_token_ids());
        stop
    }

    fn prepare_plan_infill(
        &self,
        spec: GenerateSpec,
        p: &PlanInfillParams,
    ) -> Result<Prepared<SdProgram>, RequestError> {
        // Upstream generate_refusion() draws its plan at the temperature only; top_k and top_p,
        // when set, restrict the draw as they do for every other scheme (greedy ignores them).
        let s = &spec.sampling;
        let gen = spec.max_new_tokens;
        let (span, blocks) = (p.span_size, p.serial_num_blocks);
        if span == 0 {
            return bad("plan_infill.slot_size must be at least 1".into());
        }
        if blocks == 0 {
            return bad("plan_infill.serial_num_blocks must be at least 1".into());
        }
        for (name, t) in [
            ("slot_threshold", p.span_threshold),
            ("token_threshold", p.token_threshold),
        ] {
            if !t.is_finite() || t <= 0.0 || t > 1.0 {
                return bad(format!("plan_infill.{name} must be in (0, 1], got {t}"));
            }
        }
        // max_new_tokens is a cap: the canvas (upstream's gen_length) is rounded up to whole
        // blocks of whole spans, and the response ends after max_new_tokens tokens. A length
        // that is already whole decodes exactly upstream's canvas.
        let cap = gen;
        let Some(gen) = blocks
            .checked_mul(span)
            .and_then(|unit| gen.checked_next_multiple_of(unit))
        else {
            return bad(format!(
                "plan_infill.serial_num_blocks ({blocks}) times slot_size ({span}) is too large"
            ));
        };
        let block_length = gen / blocks;
        let settings = Settings {
            span_size: span,
            block_length,
            blocks,
            span_threshold: p.span_threshold,
            token_threshold: p.token_threshold,
            mask_id: self.mask_id,
            eos_rule: p.eos_rule,
        };
        let sampler = (!s.is_greedy()).then(|| TokenSampler::new(*s));
        let max_rows = spec.prompt_ids.len() + gen + block_length;
        let prompt_tokens = spec.prompt_ids.len();
        let stop = self.stop_ids(&spec);
        let mut program = PlanInfill::new(settings, spec.prompt_ids, (gen, cap), stop, sampler);
        program.stream_canvas = spec.stream_canvas;
        program.logprobs = spec.sampling.logprobs;
        program.constrained = spec.guide.is_some();
        program.guide = spec.guide;
        Ok(self.prepared(
            Scheme::PlanInfill(Box::new(program)),
            max_rows,
            prompt_tokens,
        ))
    }

    fn prepare_ar(
        &self,
        spec: GenerateSpec,
        a: &ArParams,
    ) -> Result<Prepared<SdProgram>, RequestError> {
        if *a != ArParams::default() {
            return bad(
                "ar on a slot-diffusion model is plain causal decoding: num_steps, \
                 cache_lookup_strategy, init_scale, exit_threshold and continuous_compute are \
                 recurrent-depth options and must be unset"
                    .into(),
            );
        }
        let max_rows = spec.prompt_ids.len() + spec.max_new_tokens;
        let prompt_tokens = spec.prompt_ids.len();
        let stop = self.stop_ids(&spec);
        let mut program = ArDecode::new(
            spec.prompt_ids,
            spec.max_new_tokens,
            stop,
            TokenSampler::new(spec.sampling),
        );
        program.guide(spec.guide);
        Ok(self.prepared(Scheme::Ar(Box::new(program)), max_rows, prompt_tokens))
    }
}

impl Planner for RefusionPlanner {
    type Program = SdProgram;

    fn eos_token_ids(&self) -> Vec<u32> {
        self.cfg.eos_token_ids()
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn prepare(&self, spec: GenerateSpec) -> Result<Prepared<SdProgram>, RequestError> {
        spec.validate_common(self.cfg.vocab_size, self.cfg.max_position_embeddings)?;
        match spec.scheme.clone() {
            SchemeParams::PlanInfill(p) => self.prepare_plan_infill(spec, &p),
            SchemeParams::Ar(a) => self.prepare_ar(spec, &a),
            other => bad(format!(
                "scheme `{}` is not served by slot-diffusion models; use `plan-infill` or `ar`",
                other.name()
            )),
        }
    }
}

/// Loads a ReFusion checkpoint and starts its engine.
pub fn serve(files: ModelFiles, opts: LoadOptions) -> Result<Arc<dyn ServedModel>, SchemeError> {
    let cfg = Qwen3Config::from_json(files.config_json())?;
    let tokenizer = optional_tokenizer(&files);
    let load = checkpoint_loader(files, cfg.clone(), &opts, Qwen3::load_parallel);
    serve_model(cfg, tokenizer, opts, load)
}

/// Starts the engine for the model `load` builds on the engine thread (from a checkpoint, or
/// synthetic weights for benchmarks); `cfg` must be the model's config.
pub fn serve_model<L>(
    cfg: Qwen3Config,
    tokenizer: Option<TextTokenizer>,
    opts: LoadOptions,
    load: L,
) -> Result<Arc<dyn ServedModel>, SchemeError>
where
    L: FnOnce(&Device, DType) -> Result<Qwen3, SchemeError> + Send + 'static,
{
    let planner = Arc::new(
        RefusionPlanner::new(cfg.clone(), opts.name.clone(), opts.kv_dtype())?
            .with_tensor_parallel(opts.tensor_parallel)
            .with_reserve(opts.kv_reserve)
            .with_page_size(opts.kv_page_size),
    );
    let bytes_per_slot = planner.slot_bytes();
    let make = checked_family(cfg, &opts, load, Qwen3::config, SlotDiffusionFamily::new);
    let (page, kv) = (opts.kv_page_size, opts.kv_store());
    let make = move |device: &Device, dtype| make(device, dtype).map(|f| f.with_pages(page, kv));
    // 1% of the pool kept free at admission for running requests to grow into.
    start_served(planner, tokenizer, &opts, bytes_per_slot, 10, make)
}

impl PagedPlanner for RefusionPlanner {
    fn sizing(&self) -> &PageSizing {
        &self.sizing
    }

    fn sizing_mut(&mut self) -> &mut PageSizing {
        &mut self.sizing
    }
}
