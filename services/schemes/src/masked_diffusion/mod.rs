//! # Masked diffusion (LLaDA, Dream)
//!
//! Nie et al. 2025, "Large Language Diffusion Models": a bidirectional transformer predicts
//! every masked position of a canvas at once; a sampler decides which predictions to commit.
//! Two networks are served ([`network`]): LLaDA, and Dream (Ye et al., 2025, "Dream 7B"), a
//! Qwen2.5 run bidirectionally whose prediction for a position is read from the output row
//! before it. Schemes served here:
//! - `low-confidence`: LLaDA's sampler (upstream `generate()`): semi-autoregressive blocks, a
//!   fixed number of commits per step, the most confident (or random) masked positions first,
//!   optional temperature and classifier-free guidance ([`low_confidence`]);
//! - `wino`: Hong et al. 2026, "Wide-In, Narrow-Out: Revokable Decoding for Efficient and
//!   Effective DLLMs" (upstream `decoding_wino()`): draft above `threshold`, verify decoded
//!   tokens through a shadow block in the same forward, revoke below `threshold_back`
//!   ([`wino`]).
//! - `diffusion-generate`: Dream's sampler (upstream `diffusion_generate()`): one block, a
//!   float32 linear timestep schedule, the `origin`, `maskgit_plus`, `topk_margin` or `entropy`
//!   rule over top-k / top-p filtered posteriors ([`diffusion_generate`]).
//!
//! Which scheme serves which network: LLaDA takes `low-confidence` and `wino`; Dream takes
//! `diffusion-generate` (its default) and `low-confidence` (LLaDA's block schedule and
//! confidence rule over Dream's shifted predictions, classifier-free guidance included). WINO
//! and SureLock are refused for Dream: WINO verifies a token through a shadow copy of its own
//! position, and SureLock stops computing a locked position's row, while Dream reads each
//! prediction from the row before it, so neither rule carries over as its paper states it.
//!
//! Both take **SureLock** ("Stopping Computation for Converged Tokens in Masked Diffusion-LM
//! Decoding"): `surelock_eps` locks positions whose posterior stopped moving; a locked position
//! keeps its token and cached K/V and its rows are no longer computed ([`surelock`]).
//!
//! `low-confidence` takes **Fast-dLLM**'s accelerations (Wu et al. 2025, NVlabs/Fast-dLLM
//! `llada/generate.py`), opt-in: `kv_cache` `prefix` or `dual`, a block-wise approximate K/V
//! cache (a block's first forward is full and its K/V are kept; its later forwards compute the
//! block and what follows it, or the block alone, and read the rest from that stale cache), and
//! `threshold`, confidence-aware parallel decoding (the block's most confident masked position
//! and every other at or above the threshold commit each step). Both are served for LLaDA
//! only for now: Dream's shifted head reads a position's prediction from the row before it, so
//! a block's first row's prediction comes from a cached row under `dual`, a case Fast-dLLM's
//! Dream code handles on its own terms that no fixture here pins. They compose with SureLock:
//! one row cache holds both the locked rows and the cached ones (a row is left out of a forward
//! when it is locked or cached), and SureLock compares a position's posteriors between the
//! forwards that compute it; `surelock_eps` 0 reproduces the cached run exactly. WINO takes
//! neither: its draft is already a threshold rule (`threshold`, tau1) whose drafts it verifies
//! and may revoke, and its verification reads a shadow copy of the block next to the whole
//! canvas, which a cache of the canvas would make stale.
//!
//! The planner validates a request and builds its program on the caller's thread; the family
//! packs one step of every active program into one forward per tick ([`family`]).
//!
//! ## Early stop
//!
//! Upstream decodes all `gen_length` positions and leaves it to the caller to cut the text at
//! the end-of-sequence token. Here the model's `eos_token_id` (`<|endoftext|>`, which LLaDA
//! pads its answers with) and the request's `stop_token_ids` end the response at the first one
//! (included), and work after it is skipped:
//! - `low-confidence` commits are final, so once a stop token is committed at position `p` and
//!   every position before it is committed too, the canvas is cut after `p`: later positions
//!   are no longer computed, and later blocks are never decoded. The response is the committed
//!   prefix up to `p`, exactly upstream's tokens. While positions before `p` are still masked the
//!   canvas stays whole, because they attend to every position after `p` in upstream (a model
//!   that pads its answers with EOS, as LLaDA does, often commits the padding first; cutting
//!   then changed the answer: the trained tiny LLaDA copied 95% of held-out strings with the
//!   whole canvas and far fewer with an early cut).
//! - `wino` drafts can be revoked until their block is complete, so the stop applies at block
//!   granularity: when a completed block holds a stop token the response ends there and later
//!   blocks are not decoded (exact with respect to upstream's tokens up to the stop).
//!
//! Tokens stream as they become final: `low-confidence` streams the committed prefix after every
//! step, `wino` a whole block once it has no mask left.
//!
//! ## Slots
//!
//! The slot unit is one buffer row's key and value in one layer of one tensor-parallel rank:
//! `2 · n_kv_heads · head_dim` values of the model dtype (split over the ranks). A request's
//! buffer has `prompt + gen_length` rows (plus `block_length` shadow rows for `wino`), twice
//! with classifier-free guidance. Without SureLock a request reserves one slot per buffer row
//! and rank: its rows' K/V of the layer being computed, the working set of its step (nothing
//! persists between steps but its tokens). With SureLock, or a Fast-dLLM `kv_cache` (the same
//! row cache, without the posteriors), it also reserves the per-layer K/V
//! cache of the whole buffer (`rows · n_layers · ranks`), which lives in the family's pool: the
//! granted slot ids are the cache's page ids (a page holds one row of one layer and rank), and
//! the previous step's float32 log-posteriors (`rows · ceil(4 · vocab / slot bytes)`), which
//! live in the family's posterior pool (a `SlotPool` slot of `vocab` values per position, taken
//! at the position's first step and given back when it locks or is cut). Slots are fungible
//! and admission is all-or-nothing (FIFO), as for the other families. A canvas never grows, but it can shrink: after every tick the request gives
//! back the slots of the rows a committed stop token cut off, and the posterior slots of the
//! rows SureLock locked (their posteriors are no longer kept; `MdProgram::slots_needed`).

pub mod family;
pub mod network;
pub mod program;

mod canvas;
mod diffusion_generate;
mod likelihood;
mod low_confidence;
mod posterior;
mod step;
mod surelock;
mod wino;

#[cfg(test)]
mod dream_tests;
#[cfg(test)]
mod fast_dllm_tests;
#[cfg(test)]
mod golden_tests;
#[cfg(test)]
mod serving_tests;
#[cfg(test)]
mod test_support;

use std::sync::Arc;

use candle_core::{DType, Device};
use wavefront_engine::{Prepared, RequestError};
use wavefront_models::{Dream, DreamConfig, Llada, LladaConfig, ModelFiles, TextTokenizer};

use self::canvas::Canvas;
use self::diffusion_generate::DiffusionGenerate;
pub use self::family::MaskedDiffusionFamily;
pub(crate) use self::low_confidence::top_k as low_confidence_top_k;
use self::low_confidence::LowConfidence;
pub use self::network::{MdNetwork, Shape};
pub(crate) use self::posterior::greedy as posterior_greedy;
use self::program::Decoder;
pub use self::program::MdProgram;
pub use self::step::StepRecord;
use self::surelock::SureLock;
use self::wino::Wino;
use crate::kv_row::KvRow;
use crate::launch::{checked_family, checkpoint_loader, optional_tokenizer, start_served};
use crate::options::LoadOptions;
use crate::request::{
    bad, DiffusionGenerateParams, DreamAlg, GenerateSpec, KvCacheMode, LowConfidenceParams,
    Remasking, SchemeParams, SureLockParams, WinoParams,
};
use crate::served::{ModelInfo, Planner, ServedModel};
use crate::SchemeError;
use wavefront_models::ModelFamily;

/// This family's name.
pub(crate) const FAMILY: &str = ModelFamily::MaskedDiffusion.name();

/// Validates requests against a masked-diffusion network's config and builds programs.
pub struct MdPlanner {
    cfg: Shape,
    info: ModelInfo,
    /// One position's K/V in one layer, over all tensor-parallel ranks.
    kv: KvRow,
    /// Tensor-parallel ranks: a slot is one rank's share of a row's K/V in one layer.
    world: usize,
}

impl MdPlanner {
    /// A planner for the LLaDA `cfg` served under `name` with weights (and caches) in `dtype`.
    pub fn new(cfg: LladaConfig, name: String, dtype: DType) -> Self {
        Self::for_shape(Shape::llada(&cfg), name, dtype)
    }

    /// A planner for the Dream `cfg`.
    pub fn dream(cfg: &DreamConfig, name: String, dtype: DType) -> Self {
        Self::for_shape(Shape::dream(cfg), name, dtype)
    }

    fn for_shape(cfg: Shape, name: String, dtype: DType) -> Self {
        let schemes = if cfg.shifted {
            vec!["diffusion-generate", "low-confidence"]
        } else {
            vec!["low-confidence", "wino"]
        };
        let info = ModelInfo {
            name,
            family: FAMILY,
            schemes,
            vocab_size: cfg.vocab_size,
            max_context: cfg.max_context,
        };
        Self {
            kv: KvRow::new(&cfg.block, dtype),
            cfg,
            info,
            world: 1,
        }
    }

    /// Bytes of one slot: one buffer row's K and V in one layer of one tensor-parallel rank
    /// (SureLock's cache takes one page of one row per slot).
    pub fn slot_bytes(&self) -> usize {
        self.kv.bytes() / self.world
    }

    /// Sizes slots for the model split over `world` tensor-parallel ranks (kv heads replicated
    /// on ranks when there are fewer than ranks take room in every rank's cache).
    pub fn with_tensor_parallel(mut self, world: usize) -> Self {
        self.kv = self.kv.with_world(world);
        self.world = world.max(1);
        self
    }

    /// Slots a request with `rows` buffer rows (per copy) reserves (see the module doc): with a
    /// row cache (SureLock or Fast-dLLM's), its K/V; with SureLock, its previous posteriors.
    pub fn slots(&self, rows: usize, copies: usize, cached: bool, surelock: bool) -> usize {
        let p = self.slot_plan(copies, 0, cached, surelock);
        rows * (p.copies + p.cache + p.posterior)
    }

    /// How a request's slots divide over its rows.
    fn slot_plan(
        &self,
        copies: usize,
        shadow: usize,
        cached: bool,
        surelock: bool,
    ) -> program::SlotPlan {
        let cache = if cached || surelock {
            self.cfg.n_layers * self.world
        } else {
            0
        };
        let posterior = if surelock {
            (4 * self.cfg.head_rows).div_ceil(self.slot_bytes())
        } else {
            0
        };
        program::SlotPlan {
            copies: copies * self.world,
            shadow,
            cache,
            posterior,
        }
    }

    fn prepare_low_confidence(
        &self,
        spec: GenerateSpec,
        p: &LowConfidenceParams,
    ) -> Result<Prepared<MdProgram>, RequestError> {
        let gen = spec.max_new_tokens;
        let (block_length, blocks, canvas) = blocks("low_confidence", gen, p.block_length)?;
        let steps = p.steps.unwrap_or(canvas);
        if steps == 0 {
            return bad("low_confidence.steps must be at least 1".into());
        }
        if !steps.is_multiple_of(blocks) {
            return bad(format!(
                "low_confidence.steps ({steps}) must be divisible by the number of blocks \
                 (max_new_tokens / block_length = {gen} / {block_length}, rounded up: {blocks})"
            ));
        }
        if !p.cfg_scale.is_finite() || p.cfg_scale < 0.0 {
            return bad(format!(
                "low_confidence.cfg_scale must be finite and >= 0 (0 disables guidance), got {}",
                p.cfg_scale
            ));
        }
        let surelock = surelock("low_confidence", p.surelock.as_ref())?;
        if surelock.is_some() && p.cfg_scale > 0.0 {
            return bad(
                "low_confidence.surelock_eps cannot be combined with cfg_scale > 0 \
                 (the unconditional copy has no locks)"
                    .into(),
            );
        }
        let fast = fast_dllm(p)?;
        let mut lc = LowConfidence::new(steps / blocks, p.remasking).with_fast_dllm(fast);
        // Replayed Gumbel noise (tests against upstream's draws) for sampled Fast-dLLM steps.
        if let Some(r) = spec
            .replay_draws
            .clone()
            .filter(|_| lc.threshold.is_some() || lc.caches())
        {
            lc.replay = Some((r, 0));
        }
        let decoder = Decoder::LowConfidence(lc);
        let copies = if p.cfg_scale > 0.0 { 2 } else { 1 };
        self.build(
            spec,
            canvas,
            block_length,
            decoder,
            surelock,
            p.cfg_scale,
            0,
            copies,
        )
    }

    fn prepare_wino(
        &self,
        spec: GenerateSpec,
        p: &WinoParams,
    ) -> Result<Prepared<MdProgram>, RequestError> {
        let (block_length, _, canvas) = blocks("wino", spec.max_new_tokens, p.block_length)?;
        for (name, t) in [
            ("threshold", p.threshold),
            ("threshold_back", p.threshold_back),
        ] {
            if !t.is_finite() || t <= 0.0 || t > 1.0 {
                return bad(format!("wino.{name} must be in (0, 1], got {t}"));
            }
        }
        if p.threshold > p.threshold_back {
            return bad(format!(
                "wino.threshold ({}) must not exceed wino.threshold_back ({}): drafting (tau1) \
                 is the wide gate and verification (tau2) the narrow one",
                p.threshold, p.threshold_back
            ));
        }
        let surelock = surelock("wino", p.surelock.as_ref())?;
        let decoder = Decoder::Wino(Wino::new(decimal(p.threshold), decimal(p.threshold_back)));
        self.build(
            spec,
            canvas,
            block_length,
            decoder,
            surelock,
            0.0,
            block_length,
            1,
        )
    }

    fn prepare_diffusion_generate(
        &self,
        spec: GenerateSpec,
        p: &DiffusionGenerateParams,
    ) -> Result<Prepared<MdProgram>, RequestError> {
        let gen = spec.max_new_tokens;
        let steps = p.steps.unwrap_or(gen);
        if steps == 0 || steps > MAX_STEPS {
            return bad(format!(
                "diffusion_generate.steps must be in 1..={MAX_STEPS}, got {steps}"
            ));
        }
        if !p.eps.is_finite() || p.eps <= 0.0 || p.eps >= 1.0 {
            return bad(format!(
                "diffusion_generate.eps must be in (0, 1) (the schedule's last timestep), got {}",
                p.eps
            ));
        }
        if !p.alg_temp.is_finite() || p.alg_temp < 0.0 {
            return bad(format!(
                "diffusion_generate.alg_temp must be finite and >= 0 (0 commits the most \
                 confident), got {}",
                p.alg_temp
            ));
        }
        if p.alg == DreamAlg::Origin && p.alg_temp > 0.0 {
            return bad(
                "diffusion_generate.alg_temp applies to the confidence algorithms \
                 (maskgit_plus, topk_margin, entropy), not to alg `origin`"
                    .into(),
            );
        }
        let s = &spec.sampling;
        let top_k = match (s.top_k, p.upstream_defaults) {
            (0, true) => Some(50),
            (0, false) => None,
            (k, _) => Some(k),
        };
        let top_p = (s.top_p > 0.0 && s.top_p < 1.0).then_some(s.top_p);
        let replay = spec.replay_draws.clone();
        let decoder = Decoder::DiffusionGenerate(DiffusionGenerate::new(
            p.alg, steps, p.eps, p.alg_temp, top_k, top_p, replay,
        ));
        self.build(spec, gen, gen, decoder, None, 0.0, 0, 1)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        &self,
        spec: GenerateSpec,
        gen_length: usize,
        block_length: usize,
        decoder: Decoder,
        surelock: Option<SureLockParams>,
        cfg_scale: f32,
        shadow: usize,
        copies: usize,
    ) -> Result<Prepared<MdProgram>, RequestError> {
        let prompt_tokens = spec.prompt_ids.len();
        let mut stop = spec.stop_token_ids;
        stop.extend(&self.cfg.eos_token_ids);
        if gen_length > spec.max_new_tokens
            && spec.prompt_ids.len() + gen_length > self.cfg.max_context
        {
            return bad(format!(
                "prompt ({}) + max_new_tokens ({}) rounded up to whole blocks of {block_length} \
                 is {} positions, beyond the model's context limit of {}: ask for fewer tokens \
                 or a block_length that divides max_new_tokens (max_tokens over HTTP)",
                spec.prompt_ids.len(),
                spec.max_new_tokens,
                spec.prompt_ids.len() + gen_length,
                self.cfg.max_context
            ));
        }
        let canvas = Canvas::new(
            &spec.prompt_ids,
            gen_length,
            block_length,
            self.cfg.mask_token_id,
            stop,
        )
        .with_limit(spec.max_new_tokens);
        let rows = canvas.len() + shadow;
        let cached = matches!(&decoder, Decoder::LowConfidence(lc) if lc.caches());
        let slot_plan = self.slot_plan(copies, shadow, cached, surelock.is_some());
        let slots = self.slots(rows, copies, cached, surelock.is_some());
        let surelock = surelock.map(|s| SureLock::new(&s, canvas.len()));
        let mut program = MdProgram::new(
            canvas,
            decoder,
            surelock,
            cfg_scale,
            spec.sampling.temperature,
            spec.sampling.seed,
        );
        program.stream_canvas = spec.stream_canvas;
        program.slot_plan = slot_plan;
        // Upstream generate() and decoding_wino() have no filters; top_k and top_p restrict
        // their draws when set (diffusion_generate applies its own, as Dream does).
        program.top_k = spec.sampling.top_k;
        program.top_p = spec.sampling.top_p;
        program.logprobs = spec.sampling.logprobs;
        program.constrained = spec.guide.is_some();
        program.guide = spec.guide.clone();
        if let Some(top) = spec.sampling.prompt_logprobs {
            program.likelihood = Some(likelihood::Likelihood::new(
                spec.prompt_ids.clone(),
                self.cfg.mask_token_id,
                spec.sampling.likelihood_context,
                spec.sampling
                    .mc_samples
                    .unwrap_or(crate::request::DEFAULT_MC_SAMPLES),
                top,
                spec.sampling.seed,
            ));
        }
        debug_assert_eq!(program.slots_needed(), slots);
        if self.cfg.shifted {
            program = program.with_shifted_head();
        }
        Ok(Prepared {
            program,
            slots,
            max_slots: slots,
            floor: 0,
            prompt_tokens,
            carried: None,
        })
    }
}

/// The most `diffusion_generate.steps` a request may take (each step is a forward of the canvas
/// for `origin`; the schedule holds one float per step).
const MAX_STEPS: usize = 1 << 16;

/// Block length (default: `gen_length`), block count and canvas length, checked: a
/// `max_new_tokens` that is not a multiple of the block length is a cap (OpenAI's `max_tokens`
/// is one), so the canvas is rounded up to whole blocks and the response stops at the cap.
fn blocks(
    scheme: &str,
    gen: usize,
    block_length: Option<usize>,
) -> Result<(usize, usize, usize), RequestError> {
    let bl = block_length.unwrap_or(gen);
    if bl == 0 {
        return bad(format!("{scheme}.block_length must be at least 1"));
    }
    // A block longer than the answer is one block of the answer's length (upstream refuses
    // it; rounding the canvas up to it would decode positions nobody reads).
    let bl = bl.min(gen);
    let blocks = gen.div_ceil(bl);
    Ok((bl, blocks, blocks * bl))
}

/// Fast-dLLM's options of the low-confidence scheme (its cache mode, the threshold rule and the
/// upstream call switch), checked; `None` when none is set.
fn fast_dllm(p: &LowConfidenceParams) -> Result<Option<low_confidence::FastDllm>, RequestError> {
    let cached = p.kv_cache != KvCacheMode::None;
    if p.upstream_calls && !cached {
        return bad(
            "low_confidence.upstream_calls applies to kv_cache `prefix` and `dual` (the extra \
             cached forward Fast-dLLM makes after a block's full forward)"
                .into(),
        );
    }
    if !cached && p.threshold.is_none() {
        return Ok(None);
    }
    if let Some(t) = p.threshold {
        if !t.is_finite() || t <= 0.0 || t > 1.0 {
            return bad(format!(
                "low_confidence.threshold must be in (0, 1] (a confidence), got {t}"
            ));
        }
        if p.remasking == Remasking::Random {
            return bad(
                "low_confidence.threshold ranks positions by confidence: it needs remasking \
                 `low_confidence`, not `random`"
                    .into(),
            );
        }
    }
    if cached && p.cfg_scale > 0.0 {
        return bad(format!(
            "low_confidence.kv_cache `{}` cannot be combined with cfg_scale > 0 (Fast-dLLM's \
             cache has no unconditional copy)",
            p.kv_cache.name()
        ));
    }
    Ok(Some(low_confidence::FastDllm {
        cache: p.kv_cache,
        threshold: p.threshold.map(decimal),
        upstream_calls: p.upstream_calls,
    }))
}

fn surelock(
    scheme: &str,
    p: Option<&SureLockParams>,
) -> Result<Option<SureLockParams>, RequestError> {
    let Some(p) = p else {
        return Ok(None);
    };
    if !p.eps.is_finite() || p.eps < 0.0 {
        return bad(format!(
            "{scheme}.surelock_eps must be finite and >= 0 (0 locks nothing), got {}",
            p.eps
        ));
    }
    if let Some(m) = p.percentile {
        if !m.is_finite() || m <= 0.0 || m > 100.0 {
            return bad(format!(
                "{scheme}.surelock_percentile must be in (0, 100], got {m}"
            ));
        }
    }
    Ok(Some(*p))
}

/// The decimal an `f32` threshold was written as (`0.6f32` is `0.6`, not `0.6000000238`), so
/// float64 comparisons match upstream's Python floats.
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

impl Planner for MdPlanner {
    type Program = MdProgram;

    fn eos_token_ids(&self) -> Vec<u32> {
        self.cfg.eos_token_ids.clone()
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn prepare(&self, mut spec: GenerateSpec) -> Result<Prepared<MdProgram>, RequestError> {
        spec.validate_common(self.cfg.vocab_size, self.cfg.max_context)?;
        // Scoring only: the decoding state is built for one token, never decoded.
        let score_only = spec.max_new_tokens == 0;
        if score_only {
            spec.max_new_tokens = 1;
        }
        let mut prepared = self.prepare_scheme(spec)?;
        prepared.program.score_only = score_only;
        Ok(prepared)
    }
}

impl MdPlanner {
    fn prepare_scheme(&self, spec: GenerateSpec) -> Result<Prepared<MdProgram>, RequestError> {
        let served = self.info.schemes.join("`, `");
        let kind = self.cfg.kind;
        match spec.scheme.clone() {
            SchemeParams::LowConfidence(p) => {
                if self.cfg.shifted && p.surelock.is_some() {
                    return bad(format!(
                        "low_confidence.surelock_eps is not served for {kind} models: SureLock \
                         stops computing a locked position's row, and {kind} reads the next \
                         position's prediction from it"
                    ));
                }
                self.prepare_low_confidence(spec, &p)
            }
            SchemeParams::Wino(p) if !self.cfg.shifted => self.prepare_wino(spec, &p),
            SchemeParams::DiffusionGenerate(p) if self.cfg.shifted => {
                self.prepare_diffusion_generate(spec, &p)
            }
            other => bad(format!(
                "scheme `{}` is not served by masked-diffusion models ({kind}); use `{served}`",
                other.name()
            )),
        }
    }
}

/// Loads a LLaDA checkpoint and starts its engine (Dream: [`serve_dream`]; LLaDA2.0:
/// [`crate::block_diffusion::serve`]; [`crate::registry`] picks).
pub fn serve(files: ModelFiles, opts: LoadOptions) -> Result<Arc<dyn ServedModel>, SchemeError> {
    let cfg = LladaConfig::from_json(files.config_json())?;
    let tokenizer = optional_tokenizer(&files);
    let load = checkpoint_loader(files, cfg.clone(), &opts, Llada::load_parallel);
    serve_model(cfg, tokenizer, opts, load)
}

/// Starts the engine for the model `load` builds on the engine thread (from a checkpoint, or
/// synthetic weights for benchmarks); `cfg` must be the model's config.
pub fn serve_model<L>(
    cfg: LladaConfig,
    tokenizer: Option<TextTokenizer>,
    opts: LoadOptions,
    load: L,
) -> Result<Arc<dyn ServedModel>, SchemeError>
where
    L: FnOnce(&Device, DType) -> Result<Llada, SchemeError> + Send + 'static,
{
    let planner = Arc::new(
        MdPlanner::new(cfg.clone(), opts.name.clone(), opts.kv_dtype())
            .with_tensor_parallel(opts.tensor_parallel),
    );
    let bytes_per_slot = planner.slot_bytes();
    let make = checked_family(cfg, &opts, load, Llada::config, MaskedDiffusionFamily::new);
    let kv = opts.kv_store();
    let make = move |device: &Device, dtype| make(device, dtype).map(|f| f.with_kv_store(kv));
    start_served(planner, tokenizer, &opts, bytes_per_slot, 0, make)
}

/// Loads a Dream checkpoint and starts its engine.
pub fn serve_dream(
    files: ModelFiles,
    opts: LoadOptions,
) -> Result<Arc<dyn ServedModel>, SchemeError> {
    let cfg = DreamConfig::from_json(files.config_json())?;
    let tokenizer = optional_tokenizer(&files);
    let load = checkpoint_loader(files, cfg.clone(), &opts, Dream::load_parallel);
    let planner = Arc::new(
        MdPlanner::dream(&cfg, opts.name.clone(), opts.kv_dtype())
            .with_tensor_parallel(opts.tensor_parallel),
    );
    let bytes_per_slot = planner.slot_bytes();
    let make = checked_family(cfg, &opts, load, Dream::config, MaskedDiffusionFamily::new);
    let kv = opts.kv_store();
    let make = move |device: &Device, dtype| make(device, dtype).map(|f| f.with_kv_store(kv));
    start_served(planner, tokenizer, &opts, bytes_per_slot, 0, make)
}
