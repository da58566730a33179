//! # Uniform-noise block diffusion (DiffusionGemma)
//!
//! `google/diffusiongemma-26B-A4B-it`, served as the scheme `entropy-bound` (upstream
//! `generate()` with its `EntropyBoundSampler`, transformers' `diffusion_gemma`). A request's
//! prompt is encoded (causal) into its paged cache; then canvases of `canvas_length` tokens,
//! each starting as uniform random ids and refined by the denoiser (bidirectional over the cache
//! and the canvas) for at most `max_denoising_steps` steps; a finished canvas's argmax is
//! committed and encoded to extend the cache, and the next canvas starts ([`program`]). Every
//! request's step of the tick — an encoder pass or a denoising step — shares one packed forward
//! ([`family`]).
//!
//! ## Slots
//!
//! A slot is a page: `--kv-page-size` rows' K/V in one layer. A request takes, before each step,
//! the pages of its encoded tokens plus one canvas (the denoiser's canvas rows go through the
//! same pages and are overwritten by the next step, never kept), at most
//! `prompt + canvases · canvas_length` rows per layer. Sliding-attention layers keep every row
//! although they read only the last `sliding_window - 1` (what a windowed cache would save is
//! not saved yet).
//!
//! ## Parameters
//!
//! Named as the model's `generation_config.json` keys; a request's unset field takes the
//! checkpoint's value (upstream's defaults when the file has none). The temperature follows the
//! schedule, so the request's `sampling.temperature` (other than 0, unset, or 1, OpenAI's
//! default, which leave the schedule as it is), `top_k` and `top_p` are refused; its seed seeds
//! the draws.

pub mod family;
pub mod program;

#[cfg(test)]
mod golden_tests;

use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Tensor};
use wavefront_engine::{Prepared, RequestError};
use wavefront_models::transformer::BlockConfig;
use wavefront_models::{DiffusionGemma, DiffusionGemmaConfig, ModelFiles, TextTokenizer};

pub use self::family::UniformDiffusionFamily;
use self::program::Settings;
pub use self::program::{UdProgram, UdStep};
use crate::kv_row::{PageSizing, PagedPlanner};
use crate::launch::{checked_family, checkpoint_loader, optional_tokenizer, start_served};
use crate::options::LoadOptions;
use crate::request::{bad, EntropyBoundParams, GenerateSpec, ReplayDraws, SchemeParams};
use crate::served::{ModelInfo, Planner, ServedModel};
use crate::SchemeError;

/// The sampler's defaults: the checkpoint's `generation_config.json`, else upstream's
/// (`_get_default_generation_params`, equal to the real file's).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationDefaults {
    pub max_denoising_steps: usize,
    pub t_max: f32,
    pub t_min: f32,
    pub entropy_bound: f32,
    /// `None` in the file turns early stopping off.
    pub stability_threshold: Option<usize>,
    pub confidence_threshold: Option<f32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
}

impl Default for GenerationDefaults {
    fn default() -> Self {
        Self {
            max_denoising_steps: 48,
            t_max: 0.8,
            t_min: 0.4,
            entropy_bound: 0.1,
            stability_threshold: Some(1),
            confidence_threshold: Some(0.005),
            eos_token_ids: Vec::new(),
            pad_token_id: None,
        }
    }
}

impl GenerationDefaults {
    /// Reads `generation_config.json`; keys it lacks keep upstream's defaults.
    pub fn from_json(json: &str) -> Self {
        let mut d = Self::default();
        let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
            tracing::warn!("generation_config.json is not JSON; upstream's defaults are used");
            return d;
        };
        let f = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
        if let Some(x) = v.get("max_denoising_steps").and_then(|x| x.as_u64()) {
            d.max_denoising_steps = x as usize;
        }
        if let Some(x) = f("t_max") {
            d.t_max = x as f32;
        }
        if let Some(x) = f("t_min") {
            d.t_min = x as f32;
        }
        if let Some(x) = v
            .get("sampler_config")
            .and_then(|s| s.get("entropy_bound"))
            .and_then(serde_json::Value::as_f64)
        {
            d.entropy_bound = x as f32;
        }
        match v.get("stability_threshold") {
            Some(serde_json::Value::Null) => d.stability_threshold = None,
            Some(x) => d.stability_threshold = x.as_u64().map(|x| x as usize),
            None => {}
        }
        match v.get("confidence_threshold") {
            Some(serde_json::Value::Null) => d.confidence_threshold = None,
            Some(x) => d.confidence_threshold = x.as_f64().map(|x| x as f32),
            None => {}
        }
        d.eos_token_ids = match v.get("eos_token_id") {
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect(),
            Some(x) => x
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .into_iter()
                .collect(),
            None => Vec::new(),
        };
        d.pad_token_id = v
            .get("pad_token_id")
            .and_then(|x| x.as_u64())
            .and_then(|x| u32::try_from(x).ok());
        d
    }
}

/// Row `row`'s draws of a recorded run in the order the sampler takes them (see [`program`]):
/// for each of `steps` (indices into the recording), the canvas's initial draw when the step
/// starts a canvas (`canvas_index`), then the step's multinomial sample and renoise draw.
/// `init` is `[canvases, B, L]`, `multinomial` and `renoise` `[steps, B, L]`.
pub fn recorded_draws(
    init: &Tensor,
    multinomial: &Tensor,
    renoise: &Tensor,
    canvas_index: &[u32],
    row: usize,
    steps: &[usize],
) -> Result<ReplayDraws, SchemeError> {
    let ids = |t: &Tensor| -> Result<Vec<f32>, SchemeError> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
    };
    let dim = init.dim(2)?;
    let mut data = Vec::new();
    let mut last = None;
    for &s in steps {
        let c = *canvas_index
            .get(s)
            .ok_or_else(|| SchemeError::Draws(format!("step {s} has no canvas index")))?
            as usize;
        if last != Some(c) {
            data.extend(ids(&init.i((c, row))?)?);
            last = Some(c);
        }
        data.extend(ids(&multinomial.i((s, row))?)?);
        data.extend(ids(&renoise.i((s, row))?)?);
    }
    Ok(ReplayDraws { dim, data })
}

/// The draws of the one-row run `run` recorded in `tensors` as the DiffusionGemma fixture records
/// them: `run.NAME.initial_canvas_draws`, `run.NAME.step.multinomial`,
/// `run.NAME.step.renoise_draw` and `run.NAME.step.canvas_index`, every step.
pub fn run_draws(
    tensors: &std::collections::HashMap<String, Tensor>,
    run: &str,
) -> Result<ReplayDraws, SchemeError> {
    let get = |k: &str| {
        let key = format!("run.{run}.{k}");
        tensors
            .get(&key)
            .ok_or_else(|| SchemeError::Draws(format!("the file holds no tensor {key}")))
    };
    let (init, mult, renoise) = (
        get("initial_canvas_draws")?,
        get("step.multinomial")?,
        get("step.renoise_draw")?,
    );
    let index: Vec<u32> = get("step.canvas_index")?
        .to_dtype(DType::I64)?
        .to_vec1::<i64>()?
        .into_iter()
        .map(|x| x as u32)
        .collect();
    let rows = init.dim(1)?;
    if rows != 1 {
        return Err(SchemeError::Draws(format!(
            "run {run} has {rows} rows; replay runs of one row (one request)"
        )));
    }
    let steps: Vec<usize> = (0..mult.dim(0)?).collect();
    recorded_draws(init, mult, renoise, &index, 0, &steps)
}

/// The most denoising steps per canvas a request may ask for.
const MAX_STEPS: usize = 4096;

/// Validates requests against a DiffusionGemma config and builds programs.
pub struct DiffusionGemmaPlanner {
    cfg: DiffusionGemmaConfig,
    defaults: GenerationDefaults,
    info: ModelInfo,
    eos: Vec<u32>,
    sizing: PageSizing,
}

/// The block shape the page sizing reads: the larger of the two layer kinds' K/V rows.
fn sizing_block(cfg: &DiffusionGemmaConfig) -> BlockConfig {
    let sliding = cfg.num_key_value_heads * cfg.head_dim;
    let full = cfg.num_global_key_value_heads * cfg.global_head_dim;
    let (n_kv_heads, head_dim) = if sliding >= full {
        (cfg.num_key_value_heads, cfg.head_dim)
    } else {
        (cfg.num_global_key_value_heads, cfg.global_head_dim)
    };
    BlockConfig {
        hidden_size: cfg.hidden_size,
        n_heads: cfg.num_attention_heads,
        n_kv_heads,
        head_dim,
        intermediate_size: cfg.intermediate_size,
        norm_eps: cfg.rms_norm_eps,
        qkv_bias: false,
        out_bias: false,
        mlp_bias: false,
        qk_norm: true,
    }
}

impl DiffusionGemmaPlanner {
    pub fn new(
        cfg: DiffusionGemmaConfig,
        defaults: GenerationDefaults,
        name: String,
        dtype: DType,
    ) -> Self {
        let mut eos = cfg.eos_token_ids.clone();
        for &e in &defaults.eos_token_ids {
            if !eos.contains(&e) {
                eos.push(e);
            }
        }
        let info = ModelInfo {
            name,
            family: wavefront_models::ModelFamily::UniformDiffusion.name(),
            schemes: vec!["entropy-bound"],
            vocab_size: cfg.vocab_size,
            max_context: cfg.max_position_embeddings,
        };
        Self {
            sizing: PageSizing::new(&sizing_block(&cfg), dtype, cfg.num_hidden_layers()),
            cfg,
            defaults,
            info,
            eos,
        }
    }

    /// The end-of-sequence ids (the config's, then `generation_config.json`'s).
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    fn prepare_entropy_bound(
        &self,
        spec: GenerateSpec,
        p: &EntropyBoundParams,
    ) -> Result<Prepared<UdProgram>, RequestError> {
        let d = &self.defaults;
        let l = self.cfg.canvas_length;
        if let Some(&id) = spec
            .prompt_ids
            .iter()
            .find(|id| self.cfg.image_token_ids.contains(id))
        {
            return bad(format!(
                "the prompt holds the image token {id}: image inputs are not served (the vision \
                 tower is not loaded); send text only"
            ));
        }
        // 0 (the API's unset) and 1 (OpenAI's default) leave the schedule as it is.
        let s = &spec.sampling;
        let scaled = s.temperature != 0.0 && s.temperature != 1.0;
        if scaled || s.top_k != 0 || (s.top_p > 0.0 && s.top_p < 1.0) {
            return bad(
                "sampling.temperature, top_k and top_p do not apply to entropy-bound: its \
                 temperature falls from entropy_bound.t_max to t_min over the steps and it \
                 samples the whole distribution; set t_max and t_min instead (the seed applies)"
                    .into(),
            );
        }
        let steps = p.max_denoising_steps.unwrap_or(d.max_denoising_steps);
        if !(1..=MAX_STEPS).contains(&steps) {
            return bad(format!(
                "entropy_bound.max_denoising_steps must be in 1..={MAX_STEPS}, got {steps}"
            ));
        }
        let (t_max, t_min) = (p.t_max.unwrap_or(d.t_max), p.t_min.unwrap_or(d.t_min));
        for (name, t) in [("t_max", t_max), ("t_min", t_min)] {
            if !t.is_finite() || t <= 0.0 || t > 100.0 {
                return bad(format!(
                    "entropy_bound.{name} must be in (0, 100] (a temperature), got {t}"
                ));
            }
        }
        let bound = p.entropy_bound.unwrap_or(d.entropy_bound);
        if !bound.is_finite() || bound <= 0.0 {
            return bad(format!(
                "entropy_bound.entropy_bound must be positive and finite, got {bound}"
            ));
        }
        let stop = if p.no_early_stop {
            None
        } else {
            match (
                p.stability_threshold.or(d.stability_threshold),
                p.confidence_threshold.or(d.confidence_threshold),
            ) {
                (Some(k), Some(c)) => {
                    if k > steps {
                        return bad(format!(
                            "entropy_bound.stability_threshold ({k}) exceeds \
                             max_denoising_steps ({steps}): no canvas could stop early; set \
                             no_early_stop instead"
                        ));
                    }
                    if !c.is_finite() {
                        return bad(format!(
                            "entropy_bound.confidence_threshold must be finite, got {c}"
                        ));
                    }
                    Some((k, c))
                }
                _ => None,
            }
        };
        if !p.initial_canvas.is_empty() {
            if p.initial_canvas.len() != l {
                return bad(format!(
                    "entropy_bound.initial_canvas has {} ids; a canvas holds canvas_length = {l}",
                    p.initial_canvas.len()
                ));
            }
            if let Some(&id) = p
                .initial_canvas
                .iter()
                .find(|&&id| id as usize >= self.cfg.vocab_size)
            {
                return bad(format!(
                    "entropy_bound.initial_canvas holds {id}, outside the vocabulary of {}",
                    self.cfg.vocab_size
                ));
            }
        }
        let gen = spec.max_new_tokens;
        let rows = spec.prompt_ids.len() + gen.div_ceil(l) * l;
        if rows > self.cfg.max_position_embeddings {
            return bad(format!(
                "prompt ({}) + max_new_tokens ({gen}) rounded up to whole canvases of {l} is \
                 {rows} positions, beyond the model's {}",
                spec.prompt_ids.len(),
                self.cfg.max_position_embeddings
            ));
        }
        let settings = Settings {
            canvas: l,
            steps,
            t_max,
            t_min,
            entropy_bound: bound,
            stop,
            eos: self.eos.clone(),
            pad: d.pad_token_id.unwrap_or(self.cfg.pad_token_id),
            whole_canvases: p.whole_canvases,
            vocab: self.cfg.vocab_size,
        };
        let max_pages = self.sizing.pages(rows);
        let prompt_tokens = spec.prompt_ids.len();
        let mut program = UdProgram::new(
            settings,
            &spec.prompt_ids,
            gen,
            spec.stop_token_ids.clone(),
            spec.sampling.seed,
            spec.replay_draws.as_deref().cloned(),
            p.initial_canvas.clone(),
            self.sizing.tables(),
            max_pages,
        );
        program.stream_canvas = spec.stream_canvas;
        program.logprobs = spec.sampling.logprobs;
        program.constrained = spec.guide.is_some();
        program.guide = spec.guide.clone();
        let first = program.pages_needed(self.sizing.page);
        Ok(self
            .sizing
            .reserve
            .prepared(program, first, max_pages, prompt_tokens))
    }
}

impl Planner for DiffusionGemmaPlanner {
    type Program = UdProgram;

    fn eos_token_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn prepare(&self, spec: GenerateSpec) -> Result<Prepared<UdProgram>, RequestError> {
        spec.validate_common(self.cfg.vocab_size, self.cfg.max_position_embeddings)?;
        match spec.scheme.clone() {
            SchemeParams::EntropyBound(p) => self.prepare_entropy_bound(spec, &p),
            other => bad(format!(
                "scheme `{}` is not served by DiffusionGemma models; use `entropy-bound`",
                other.name()
            )),
        }
    }
}

impl PagedPlanner for DiffusionGemmaPlanner {
    fn sizing(&self) -> &PageSizing {
        &self.sizing
    }

    fn sizing_mut(&mut self) -> &mut PageSizing {
        &mut self.sizing
    }
}

/// Loads a DiffusionGemma checkpoint (its text model; a vision tower is not loaded) and starts
/// its engine.
pub fn serve(files: ModelFiles, opts: LoadOptions) -> Result<Arc<dyn ServedModel>, SchemeError> {
    let cfg = DiffusionGemmaConfig::from_json(files.config_json())?;
    if cfg.has_vision_config {
        tracing::info!(
            model = %opts.name,
            "DiffusionGemma: the vision tower and its config are not loaded; text prompts only \
             (a prompt holding an image token is refused)"
        );
    }
    let tokenizer = optional_tokenizer(&files);
    let defaults = files
        .generation_config_json()
        .map(GenerationDefaults::from_json)
        .unwrap_or_default();
    let load = checkpoint_loader(files, cfg.clone(), &opts, DiffusionGemma::load_parallel);
    serve_model(cfg, defaults, tokenizer, opts, load)
}

/// Starts the engine for the model `load` builds on the engine thread.
pub fn serve_model<L>(
    cfg: DiffusionGemmaConfig,
    defaults: GenerationDefaults,
    tokenizer: Option<TextTokenizer>,
    opts: LoadOptions,
    load: L,
) -> Result<Arc<dyn ServedModel>, SchemeError>
where
    L: FnOnce(&Device, DType) -> Result<DiffusionGemma, SchemeError> + Send + 'static,
{
    let planner = Arc::new(
        DiffusionGemmaPlanner::new(cfg.clone(), defaults, opts.name.clone(), opts.kv_dtype())
            .with_reserve(opts.kv_reserve)
            .with_page_size(opts.kv_page_size),
    );
    let bytes_per_slot = planner.slot_bytes();
    let make = checked_family(
        cfg,
        &opts,
        load,
        DiffusionGemma::config,
        UniformDiffusionFamily::new,
    );
    let (page, kv) = (opts.kv_page_size, opts.kv_store());
    let make = move |device: &Device, dtype| make(device, dtype).map(|f| f.with_pages(page, kv));
    // 1% of the pool kept free at admission for running requests to grow into.
    start_served(planner, tokenizer, &opts, bytes_per_slot, 10, make)
}
