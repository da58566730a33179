//! # Block diffusion (LLaDA2.0)
//!
//! inclusionAI, 2025, LLaDA2.0-mini / -flash: a mixture-of-experts masked-diffusion model decoded
//! block by block (upstream `LLaDA2MoeModelLM.generate()`), served as the scheme
//! `block-diffusion`. Blocks of `block_length` are counted from position 0 (the prompt's own
//! blocks included); attention is block-causal, so a finished block's K/V never change and stay
//! in the request's paged cache ([`program`]); each step computes only the blocks not cached
//! from final tokens, and all requests' steps share one forward per tick ([`family`]).
//!
//! ## Slots
//!
//! A slot is a page: `--kv-page-size` buffer rows' K/V in one layer of one tensor-parallel rank,
//! as for the other paged families. A request takes, before each step, the pages its window
//! (every block up to the current one) reaches, at most `ceil((prompt + gen_length) /
//! block_length) · block_length` rows per layer; it is preempted to host memory and resumed
//! like the others.
//!
//! ## Long prompts
//!
//! Under a row budget (`--max-batch-rows`) a prompt's blocks prefill in chunks of whole blocks,
//! one chunk a tick, beside the other requests' steps: a block sees only earlier blocks, so the
//! chunks cache the same K/V as one call, and the tokens are those without a budget (test
//! `long_prompts_prefill_in_chunks_of_whole_blocks_without_changing_tokens`).

pub mod family;
pub mod program;

#[cfg(test)]
mod golden_tests;

use std::sync::Arc;

use candle_core::{DType, Device};
use wavefront_engine::{Prepared, RequestError};
use wavefront_models::{Llada2, Llada2Config, ModelFiles, TextTokenizer};

pub use self::family::BlockDiffusionFamily;
pub use self::program::{BdProgram, BdStep};
use self::program::{Sampler, Settings};
use crate::kv_row::{PageSizing, PagedPlanner};
use crate::launch::{checked_family, checkpoint_loader, optional_tokenizer, start_served};
use crate::options::LoadOptions;
use crate::request::{bad, BlockDiffusionParams, GenerateSpec, SchemeParams};
use crate::served::{ModelInfo, Planner, ServedModel};
use crate::SchemeError;

/// Upstream `generate()`'s ids when none is named (the real LLaDA2.0 vocabulary's).
const UPSTREAM_EOS: u32 = 156_892;
const UPSTREAM_MASK: u32 = 156_895;

/// Validates requests against a LLaDA2.0 config and builds programs.
pub struct Llada2Planner {
    cfg: Llada2Config,
    info: ModelInfo,
    mask_id: u32,
    eos: Vec<u32>,
    sizing: PageSizing,
}

impl Llada2Planner {
    /// A planner for `cfg` served under `name`; the mask and end-of-sequence ids are the
    /// config's, else `mask` and `eos` (the server reads them from the tokenizer and
    /// `generation_config.json`), else upstream `generate()`'s defaults.
    pub fn new(
        cfg: Llada2Config,
        name: String,
        dtype: DType,
        mask: Option<u32>,
        eos: Option<u32>,
    ) -> Result<Self, SchemeError> {
        let mask_id = cfg.mask_token_id.or(mask).unwrap_or(UPSTREAM_MASK);
        let mut eos_ids = cfg.eos_token_ids();
        if eos_ids.is_empty() {
            eos_ids.push(eos.unwrap_or(UPSTREAM_EOS));
        }
        if mask_id as usize >= cfg.vocab_size {
            return Err(SchemeError::Unsupported(format!(
                "the mask id {mask_id} is outside the vocabulary of {} (name it with \
                 `mask_token_id` in config.json or `<|mask|>` in the tokenizer)",
                cfg.vocab_size
            )));
        }
        let info = ModelInfo {
            name,
            family: wavefront_models::ModelFamily::MaskedDiffusion.name(),
            schemes: vec!["block-diffusion"],
            vocab_size: cfg.vocab_size,
            max_context: cfg.max_position_embeddings,
        };
        Ok(Self {
            sizing: PageSizing::new(&cfg.block_config(), dtype, cfg.num_hidden_layers),
            cfg,
            info,
            mask_id,
            eos: eos_ids,
        })
    }

    pub fn mask_id(&self) -> u32 {
        self.mask_id
    }

    fn prepare_block_diffusion(
        &self,
        spec: GenerateSpec,
        p: &BlockDiffusionParams,
    ) -> Result<Prepared<BdProgram>, RequestError> {
        let gen = spec.max_new_tokens;
        if p.block_length == 0 {
            return bad("block_diffusion.block_length must be at least 1".into());
        }
        if p.steps == 0 {
            return bad("block_diffusion.steps must be at least 1 (steps per block)".into());
        }
        if p.minimal_topk == 0 {
            return bad("block_diffusion.minimal_topk must be at least 1".into());
        }
        if !p.threshold.is_finite() || !(0.0..=1.0).contains(&p.threshold) {
            return bad(format!(
                "block_diffusion.threshold must be in [0, 1], got {}",
                p.threshold
            ));
        }
        // Upstream: steps = min(steps, gen_length // minimal_topk).
        let steps = p.steps.min(gen / p.minimal_topk);
        if steps == 0 {
            return bad(format!(
                "block_diffusion.minimal_topk ({}) exceeds max_new_tokens (gen_length, {gen}): \
                 no step would be left",
                p.minimal_topk
            ));
        }
        let rows = (spec.prompt_ids.len() + gen).div_ceil(p.block_length) * p.block_length;
        if rows > self.cfg.max_position_embeddings {
            return bad(format!(
                "prompt ({}) + max_new_tokens ({gen}) rounded up to whole blocks of {} is {rows} \
                 positions, beyond the model's {}",
                spec.prompt_ids.len(),
                p.block_length,
                self.cfg.max_position_embeddings
            ));
        }
        let mut stop = spec.stop_token_ids.clone();
        stop.extend(&self.eos);
        let settings = Settings {
            block_length: p.block_length,
            steps,
            threshold: p.threshold,
            eos_early_stop: p.eos_early_stop,
            mask_id: self.mask_id,
            stop,
        };
        let sampler = Sampler {
            draws: crate::sampling::TokenSampler::new(spec.sampling),
            upstream: p.upstream_sampler,
        };
        let max_pages = self.sizing.pages(rows);
        let prompt_tokens = spec.prompt_ids.len();
        let mut program = BdProgram::new(
            &spec.prompt_ids,
            gen,
            settings,
            sampler,
            self.sizing.tables(),
            max_pages,
        );
        program.stream_canvas = spec.stream_canvas;
        program.constrain(spec.guide);
        let first = program.pages_needed(self.sizing.page);
        Ok(self
            .sizing
            .reserve
            .prepared(program, first, max_pages, prompt_tokens))
    }
}

impl Planner for Llada2Planner {
    type Program = BdProgram;

    fn eos_token_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn prepare(&self, spec: GenerateSpec) -> Result<Prepared<BdProgram>, RequestError> {
        spec.validate_common(self.cfg.vocab_size, self.cfg.max_position_embeddings)?;
        match spec.scheme.clone() {
            SchemeParams::BlockDiffusion(p) => self.prepare_block_diffusion(spec, &p),
            other => bad(format!(
                "scheme `{}` is not served by LLaDA2.0 models; use `block-diffusion`",
                other.name()
            )),
        }
    }
}

/// The `<|mask|>` id of the tokenizer, and `generation_config.json`'s `eos_token_id`.
fn ids_from_files(
    files: &ModelFiles,
    tokenizer: Option<&TextTokenizer>,
) -> (Option<u32>, Option<u32>) {
    let mask = tokenizer.and_then(|t| t.token_to_id("<|mask|>"));
    let eos = files
        .generation_config_json()
        .and_then(|j| serde_json::from_str::<serde_json::Value>(j).ok())
        .and_then(|v| match &v["eos_token_id"] {
            serde_json::Value::Number(n) => n.as_u64(),
            serde_json::Value::Array(a) => a.first().and_then(|x| x.as_u64()),
            _ => None,
        })
        .and_then(|x| u32::try_from(x).ok())
        .or_else(|| tokenizer.and_then(|t| t.token_to_id("<|endoftext|>")));
    (mask, eos)
}

/// Loads a LLaDA2.0 checkpoint and starts its engine.
pub fn serve(files: ModelFiles, opts: LoadOptions) -> Result<Arc<dyn ServedModel>, SchemeError> {
    let cfg = Llada2Config::from_json(files.config_json())?;
    let tokenizer = optional_tokenizer(&files);
    let (mask, eos) = ids_from_files(&files, tokenizer.as_ref());
    let load = checkpoint_loader(files, cfg.clone(), &opts, Llada2::load_parallel);
    serve_model(cfg, tokenizer, opts, load, mask, eos)
}

/// Starts the engine for the model `load` builds on the engine thread.
pub fn serve_model<L>(
    cfg: Llada2Config,
    tokenizer: Option<TextTokenizer>,
    opts: LoadOptions,
    load: L,
    mask: Option<u32>,
    eos: Option<u32>,
) -> Result<Arc<dyn ServedModel>, SchemeError>
where
    L: FnOnce(&Device, DType) -> Result<Llada2, SchemeError> + Send + 'static,
{
    let planner = Arc::new(
        Llada2Planner::new(cfg.clone(), opts.name.clone(), opts.kv_dtype(), mask, eos)?
            .with_tensor_parallel(opts.tensor_parallel)
            .with_reserve(opts.kv_reserve)
            .with_page_size(opts.kv_page_size),
    );
    let bytes_per_slot = planner.slot_bytes();
    let make = checked_family(cfg, &opts, load, Llada2::config, BlockDiffusionFamily::new);
    let (page, kv) = (opts.kv_page_size, opts.kv_store());
    let make = move |device: &Device, dtype| make(device, dtype).map(|f| f.with_pages(page, kv));
    // 1% of the pool kept free at admission for running requests to grow into.
    start_served(planner, tokenizer, &opts, bytes_per_slot, 10, make)
}

impl PagedPlanner for Llada2Planner {
    fn sizing(&self) -> &PageSizing {
        &self.sizing
    }

    fn sizing_mut(&mut self) -> &mut PageSizing {
        &mut self.sizing
    }
}
