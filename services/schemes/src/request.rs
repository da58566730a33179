//! The request as the engine's families see it: token ids and typed scheme
//! parameters, with protobuf and command-line types left at the edge.
//!
//! Parameter names follow the upstream research code (see each field).

use std::sync::Arc;
use wavefront_engine::RequestError;

/// One generation request, validated field by field by [`GenerateSpec::validate_common`]
/// and by the family's planner.
#[derive(Debug, Clone)]
pub struct GenerateSpec {
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub sampling: SamplingParams,
    pub scheme: SchemeParams,
    /// Recorded random draws to replay instead of the seeded RNG (tests,
    /// reproduction of reference runs): Huginn's initial states, Dream's uniforms, and for a
    /// sampled low-confidence request with a Fast-dLLM option the Gumbel noise `ln(-ln U)`,
    /// `block_length` rows per forward.
    pub replay_draws: Option<Arc<ReplayDraws>>,
    /// Also send canvas frames (`Event::Canvas`) for clients that watch the decoding.
    pub stream_canvas: bool,
    /// A structured-output constraint, compiled for the model ([`crate::constraint`]).
    pub guide: Option<crate::constraint::Guide>,
}

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 0 or 1 disables.
    pub top_p: f32,
    pub seed: u64,
    /// Report each generated token's log-probability with this many most likely alternatives
    /// (`None`: report none). See [`crate::sampling::score`] for the distribution.
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// Score the prompt with this many alternatives per token (`None`: do not). With it,
    /// `max_new_tokens` may be 0.
    #[serde(default)]
    pub prompt_logprobs: Option<usize>,
    /// Masked diffusion's prompt scoring: the prompt tokens that condition the scored answer
    /// (`None`: every token after the first, each a one-token answer to the tokens before it).
    #[serde(default)]
    pub likelihood_context: Option<usize>,
    /// Masked diffusion's Monte Carlo samples (`None`: [`DEFAULT_MC_SAMPLES`]).
    #[serde(default)]
    pub mc_samples: Option<usize>,
}

/// LLaDA's likelihood samples when the request sets none.
pub const DEFAULT_MC_SAMPLES: usize = 64;
/// The most Monte Carlo samples a request may ask for.
pub const MAX_MC_SAMPLES: usize = 1024;
/// The longest answer masked diffusion's Monte Carlo bound scores (each sample's head reads a
/// row of logits per masked answer token).
pub const MAX_LIKELIHOOD_ANSWER: usize = 256;

/// The most alternatives a request may ask for per token (OpenAI's limit for `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            logprobs: None,
            prompt_logprobs: None,
            likelihood_context: None,
            mc_samples: None,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn validate(&self) -> Result<(), RequestError> {
        let bad = |m: String| Err(RequestError::InvalidArgument(m));
        if !self.temperature.is_finite() || !(0.0..=100.0).contains(&self.temperature) {
            return bad(format!(
                "sampling.temperature must be in [0, 100] (0 is greedy), got {}",
                self.temperature
            ));
        }
        if !self.top_p.is_finite() || !(0.0..=1.0).contains(&self.top_p) {
            return bad(format!(
                "sampling.top_p must be in [0, 1] (0 or 1 disables it), got {}",
                self.top_p
            ));
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return bad(format!(
                "logprobs asks for {n} alternatives per token; at most {MAX_TOP_LOGPROBS}"
            ));
        }
        if let Some(n) = self.prompt_logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return bad(format!(
                "prompt_logprobs asks for {n} alternatives per token; at most {MAX_TOP_LOGPROBS}"
            ));
        }
        if let Some(n) = self.mc_samples.filter(|&n| n == 0 || n > MAX_MC_SAMPLES) {
            return bad(format!(
                "likelihood.mc_samples must be from 1 to {MAX_MC_SAMPLES}, got {n}"
            ));
        }
        if self.prompt_logprobs.is_none()
            && (self.mc_samples.is_some() || self.likelihood_context.is_some())
        {
            return bad("likelihood options score the prompt: set prompt_logprobs too".into());
        }
        Ok(())
    }
}

/// The decoding scheme and its parameters.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum SchemeParams {
    /// `ar`: one token per step.
    Ar(ArParams),
    /// `diffusion-forcing`: the recurrent-depth wavefront sampler.
    DiffusionForcing(DiffusionForcingParams),
    /// `low-confidence`: LLaDA's masked-diffusion sampler (upstream `generate()`).
    LowConfidence(LowConfidenceParams),
    /// `wino`: WINO's draft-and-verify masked-diffusion sampler (upstream `decoding_wino()`).
    Wino(WinoParams),
    /// `plan-infill`: ReFusion's slot planning and parallel infilling (upstream
    /// `generate_refusion()`).
    PlanInfill(PlanInfillParams),
    /// `diffusion-generate`: Dream's sampler (upstream `diffusion_generate()`).
    DiffusionGenerate(DiffusionGenerateParams),
    /// `block-diffusion`: LLaDA2.0's block decoding with a K/V cache of finished blocks
    /// (upstream `generate()`).
    BlockDiffusion(BlockDiffusionParams),
    /// `entropy-bound`: DiffusionGemma's sampler (upstream `generate()` with its
    /// `EntropyBoundSampler`): canvases of uniform noise refined block by block.
    EntropyBound(EntropyBoundParams),
}

impl SchemeParams {
    /// The scheme's command-line / API name.
    pub fn name(&self) -> &'static str {
        match self {
            SchemeParams::Ar(_) => "ar",
            SchemeParams::DiffusionForcing(_) => "diffusion-forcing",
            SchemeParams::LowConfidence(_) => "low-confidence",
            SchemeParams::Wino(_) => "wino",
            SchemeParams::PlanInfill(_) => "plan-infill",
            SchemeParams::DiffusionGenerate(_) => "diffusion-generate",
            SchemeParams::BlockDiffusion(_) => "block-diffusion",
            SchemeParams::EntropyBound(_) => "entropy-bound",
        }
    }
}

/// How the low-confidence sampler scores masked positions (upstream `remasking`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Remasking {
    /// Commit the positions whose predicted token has the highest probability.
    #[default]
    LowConfidence,
    /// Commit uniformly random positions.
    Random,
}

/// Fast-dLLM's block-wise approximate K/V cache for the low-confidence sampler (Wu et al., 2025,
/// "Fast-dLLM", Sec. 3.2; NVlabs/Fast-dLLM `generate_with_prefix_cache` and
/// `generate_with_dual_cache`). A block's first step is a full forward whose K/V are kept; its
/// later steps compute fewer rows and read the rest from that cache, which is stale: the
/// logits are approximate, so the tokens can differ from `None`'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum KvCacheMode {
    /// Every step is a full forward (exact).
    #[default]
    None,
    /// Later steps compute the current block and everything after it; the positions before
    /// the block are read from the cache.
    Prefix,
    /// Later steps compute the current block only; the positions before and after it are read
    /// from the cache.
    Dual,
}

impl KvCacheMode {
    pub fn name(self) -> &'static str {
        match self {
            KvCacheMode::None => "none",
            KvCacheMode::Prefix => "prefix",
            KvCacheMode::Dual => "dual",
        }
    }
}

/// SureLock (an option of both masked-diffusion schemes): lock a position once its posterior
/// stops moving; a locked position keeps its token and cached K/V and is no longer computed.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SureLockParams {
    /// Lock when `KL(p_t || p_(t-1)) <= surelock_eps` (0 locks nothing).
    pub eps: f32,
    /// Optional confidence gate `m`: lock only candidates whose uncertainty `1 - max p` is at
    /// most the `m`-th percentile among the step's candidates (the paper uses 20).
    pub percentile: Option<f32>,
}

/// LLaDA's low-confidence remasking sampler (upstream `generate()`); `gen_length` is the
/// request's `max_new_tokens` rounded up to whole blocks (the response stops at
/// `max_new_tokens`).
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct LowConfidenceParams {
    /// Semi-autoregressive block length. `None`: `max_new_tokens` (one block).
    pub block_length: Option<usize>,
    /// Total sampling steps, split evenly across blocks. `None`: `gen_length`.
    pub steps: Option<usize>,
    pub remasking: Remasking,
    /// Unsupervised classifier-free guidance scale; 0 disables.
    pub cfg_scale: f32,
    pub surelock: Option<SureLockParams>,
    /// Fast-dLLM's block cache (approximate; `None`, the default, is exact).
    #[serde(default)]
    pub kv_cache: KvCacheMode,
    /// Fast-dLLM's confidence-aware parallel decoding: each step commits the current block's
    /// most confident masked position and every other one whose confidence is at least this
    /// (the block ends when it has no mask; `steps` then only has to split evenly over the
    /// blocks). `None`: the fixed number of commits per step of `steps`.
    #[serde(default)]
    pub threshold: Option<f32>,
    /// Reproduce Fast-dLLM's extra cached forward after a block's first (full) forward when that
    /// forward already finished the block: it commits nothing, and costs a forward. Off, that
    /// forward is not made; the tokens are the same. (After the last block the response has
    /// ended, and no forward is made either way.)
    #[serde(default)]
    pub upstream_calls: bool,
}

/// WINO's draft-and-verify sampler (upstream `decoding_wino()`); `gen_length` is the request's
/// `max_new_tokens` rounded up to whole blocks (the response stops at `max_new_tokens`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WinoParams {
    /// Block length. `None`: `max_new_tokens` (one block).
    pub block_length: Option<usize>,
    /// Draft threshold tau1 (upstream `threshold`).
    pub threshold: f32,
    /// Verification threshold tau2 (upstream `threshold_back`).
    pub threshold_back: f32,
    pub surelock: Option<SureLockParams>,
}

impl Default for WinoParams {
    /// The paper's thresholds (WINO's `LLaDA/configs/*.yaml`).
    fn default() -> Self {
        Self {
            block_length: None,
            threshold: 0.6,
            threshold_back: 0.9,
            surelock: None,
        }
    }
}

/// Which masks a step of Dream's sampler commits (upstream `alg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum DreamAlg {
    /// Each mask with probability `1 - s/t` (random even at temperature 0).
    Origin,
    /// The most probable predictions first (`p[x0]`).
    MaskgitPlus,
    /// The largest margins between the two most probable tokens first.
    TopkMargin,
    /// The lowest entropies first (the Dream README's choice, and the default here).
    #[default]
    Entropy,
}

impl DreamAlg {
    /// The API name (upstream's).
    pub fn as_str(self) -> &'static str {
        match self {
            DreamAlg::Origin => "origin",
            DreamAlg::MaskgitPlus => "maskgit_plus",
            DreamAlg::TopkMargin => "topk_margin",
            DreamAlg::Entropy => "entropy",
        }
    }
}

impl std::str::FromStr for DreamAlg {
    type Err = RequestError;

    /// `origin`, `maskgit_plus`, `topk_margin`, `entropy`, or empty (entropy).
    fn from_str(s: &str) -> Result<Self, RequestError> {
        match s {
            "origin" => Ok(DreamAlg::Origin),
            "maskgit_plus" => Ok(DreamAlg::MaskgitPlus),
            "topk_margin" => Ok(DreamAlg::TopkMargin),
            "" | "entropy" => Ok(DreamAlg::Entropy),
            other => Err(RequestError::InvalidArgument(format!(
                "diffusion_generate.alg must be `origin`, `maskgit_plus`, `topk_margin` or \
                 `entropy` (empty is entropy), got {other:?}"
            ))),
        }
    }
}

/// Dream's sampler (upstream `DreamGenerationMixin.diffusion_generate()`); the generation length
/// is the request's `max_new_tokens`, the posterior's temperature, top-k and top-p are the
/// request's sampling parameters.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DiffusionGenerateParams {
    pub alg: DreamAlg,
    /// Sampling steps; `None`: `max_new_tokens` (upstream's bare default is 512).
    pub steps: Option<usize>,
    /// The schedule's last timestep, in (0, 1).
    pub eps: f32,
    /// Confidence algorithms: draw the committed positions from `softmax(confidence /
    /// alg_temp)` instead of taking the best; 0 takes the best.
    pub alg_temp: f32,
    /// Reproduce the defaults a bare upstream call really runs with under transformers 4.46
    /// (`top_k` 50 where the request leaves it unset); off, an unset `top_k` is no filter, as
    /// `DreamGenerationConfig` documents.
    pub upstream_defaults: bool,
}

impl Default for DiffusionGenerateParams {
    fn default() -> Self {
        Self {
            alg: DreamAlg::Entropy,
            steps: None,
            eps: 1e-3,
            alg_temp: 0.0,
            upstream_defaults: false,
        }
    }
}

/// LLaDA2.0's block diffusion (upstream `LLaDA2MoeModelLM.generate()`); `gen_length` is the
/// request's `max_new_tokens`, the sampler's temperature, top-k and top-p the request's.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BlockDiffusionParams {
    /// Tokens per block; blocks are counted from position 0, the prompt included.
    pub block_length: usize,
    /// Steps per block (not in all), capped at `gen_length / minimal_topk`.
    pub steps: usize,
    /// Commit every mask whose confidence exceeds this (when they are at least the step's
    /// share); otherwise the step's share of the most confident.
    pub threshold: f32,
    /// Caps the steps per block at `gen_length / minimal_topk`.
    pub minimal_topk: usize,
    /// End as soon as an end-of-sequence token is committed with no mask before it, instead of
    /// at the end of its block.
    pub eos_early_stop: bool,
    /// Reproduce upstream's sampler, which draws from `softmax(logits)` even at temperature 0
    /// (a bug its maintainers fixed in LLaDA2.1); off, temperature 0 is the argmax.
    pub upstream_sampler: bool,
}

impl Default for BlockDiffusionParams {
    /// Upstream `generate()`'s defaults.
    fn default() -> Self {
        Self {
            block_length: 32,
            steps: 32,
            threshold: 0.95,
            minimal_topk: 1,
            eos_early_stop: false,
            upstream_sampler: false,
        }
    }
}

/// DiffusionGemma's entropy-bounded sampler; every field the request leaves unset takes the
/// model's `generation_config.json` value (then upstream's defaults, which equal the real
/// file's). The canvas length is the model's `canvas_length`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EntropyBoundParams {
    /// Denoising steps per canvas at most (`max_denoising_steps`).
    pub max_denoising_steps: Option<usize>,
    /// The temperature of the first step (`t_max`); it falls linearly towards `t_min`.
    pub t_max: Option<f32>,
    pub t_min: Option<f32>,
    /// Accept, lowest entropy first, the positions whose lower-entropy positions' entropies
    /// sum to at most this (`entropy_bound`; the lowest is always accepted).
    pub entropy_bound: Option<f32>,
    /// Steps the argmax canvas must stay unchanged before a canvas may stop early
    /// (`stability_threshold`; 0: no stability condition).
    pub stability_threshold: Option<usize>,
    /// A canvas stops early once its mean entropy is below this (`confidence_threshold`).
    pub confidence_threshold: Option<f32>,
    /// Run every step of every canvas (upstream `stability_threshold=None`).
    pub no_early_stop: bool,
    /// The first canvas's starting tokens instead of uniform noise (upstream
    /// `decoder_input_ids`); `canvas_length` ids.
    pub initial_canvas: Vec<u32>,
    /// Return whole canvases past `max_new_tokens`, end-of-sequence tokens followed by padding,
    /// as upstream `generate()` does; off, the response stops at `max_new_tokens` or the first
    /// stop token.
    pub whole_canvases: bool,
}

/// Which slots an end-of-sequence token found during iterative completion removes from the
/// block's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum EosRule {
    /// The slot holding the EOS and every slot to its right (what upstream means; the slots to
    /// its left are still generated, so the output has no gaps).
    #[default]
    Aligned,
    /// Reproduce upstream `generate_refusion()`, which removes `range(first_eos_block_idx, n)`
    /// with a *row* index among the selected spans used as an index into the pool, so
    /// undecoded spans left of the EOS can be dropped and never generated (tests only).
    Upstream,
}

/// ReFusion's plan-and-infill decoding (upstream `generate_refusion()`); `gen_length` is the
/// request's `max_new_tokens`, the sampling temperature is `SamplingParams::temperature`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PlanInfillParams {
    /// Tokens per span (the API's `slot_size`).
    pub span_size: usize,
    /// Number of semi-autoregressive blocks (not their length); `gen_length` is
    /// `max_new_tokens` rounded up to whole blocks of whole spans.
    pub serial_num_blocks: usize,
    /// A span is selected when the probability of its first drafted token exceeds this (the
    /// API's `slot_threshold`), in (0, 1]; when none does, the single most confident span is.
    pub span_threshold: f32,
    /// A drafted token is accepted when its autoregressive probability exceeds this, in (0, 1].
    pub token_threshold: f32,
    pub eos_rule: EosRule,
}

impl Default for PlanInfillParams {
    /// Upstream `generate_refusion()`'s defaults.
    fn default() -> Self {
        Self {
            span_size: 8,
            serial_num_blocks: 2,
            span_threshold: 0.9,
            token_threshold: 0.9,
            eos_rule: EosRule::Aligned,
        }
    }
}

/// Autoregressive decoding (upstream `generate_minimal` /
/// `generate_with_adaptive_compute` for recurrent depth).
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct ArParams {
    /// Recurrence steps per token (`num_steps`); `None`: the model's default.
    pub num_steps: Option<usize>,
    /// Upstream `cache_lookup_strategy`; `None`: "full".
    pub cache_lookup_strategy: Option<String>,
    /// Upstream `init_scale`; `None`: 1.0.
    pub init_scale: Option<f32>,
    /// Adaptive exit threshold on the latent's relative change (upstream
    /// `exit_threshold` with the "latent-diff" criterion); `None`: static.
    pub exit_threshold: Option<f32>,
    /// Upstream `continuous_compute`: every position after the prompt starts from the previous
    /// position's final latent state instead of a fresh random draw.
    pub continuous_compute: bool,
    /// Recurrent memory (ARMT): how the prompt's segments run. Other families take only
    /// [`Execution::Auto`].
    pub execution: Execution,
}

/// How a recurrent-memory (ARMT) request runs its prompt's (segment, layer) cells
/// (`ar.execution`; empty means `auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Execution {
    /// Diagonal when the prompt has at least two segments, otherwise sequential.
    #[default]
    Auto,
    /// One segment through every layer per step (upstream `AssociativeRecurrentWrapper`).
    Sequential,
    /// Diagonal batching: every cell with segment + layer = i in one grouped step
    /// (upstream `FastGroupedArmtExecutor`).
    Diagonal,
}

impl Execution {
    /// The API name.
    pub fn as_str(self) -> &'static str {
        match self {
            Execution::Auto => "auto",
            Execution::Sequential => "sequential",
            Execution::Diagonal => "diagonal",
        }
    }
}

impl std::str::FromStr for Execution {
    type Err = RequestError;

    /// `sequential`, `diagonal`, `auto` or empty (auto).
    fn from_str(s: &str) -> Result<Self, RequestError> {
        match s {
            "" | "auto" => Ok(Execution::Auto),
            "sequential" => Ok(Execution::Sequential),
            "diagonal" => Ok(Execution::Diagonal),
            other => Err(RequestError::InvalidArgument(format!(
                "ar.execution must be `sequential`, `diagonal` or `auto` (empty is auto), got {other:?}"
            ))),
        }
    }
}

/// Which freeze test the diffusion-forcing sampler applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum FreezeTest {
    /// Compare each position with its own previous state (the paper).
    #[default]
    Aligned,
    /// Reproduce the reference code, which right after a freeze compares
    /// positions with other positions' previous states.
    Upstream,
}

/// Diffusion-forcing sampler parameters (upstream `generate_diffusion_style`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DiffusionForcingParams {
    pub num_steps: Option<usize>,
    pub inner_recurrence: usize,
    pub exit_t: f32,
    pub ema_embeds: f32,
    pub state_noise_mixing: f32,
    pub headway: usize,
    pub max_wavefront: usize,
    pub init_scale: f32,
    /// Empty: `latest-m4-compress-s{C}` for the model's core depth C (upstream's default,
    /// `latest-m4-compress-s4`, on Huginn-0125's 4-layer core).
    pub cache_lookup_strategy: String,
    pub freeze_test: FreezeTest,
    /// Upstream `continuous_compute`: new wavefront positions start from copies of the last
    /// `headway` states of the wavefront instead of fresh random draws.
    pub continuous_compute: bool,
}

impl Default for DiffusionForcingParams {
    /// The paper's conservative settings.
    fn default() -> Self {
        Self {
            num_steps: None,
            inner_recurrence: 4,
            exit_t: 0.03,
            ema_embeds: 0.1,
            state_noise_mixing: 0.0,
            headway: 1,
            max_wavefront: 128,
            init_scale: 1.0,
            cache_lookup_strategy: String::new(),
            freeze_test: FreezeTest::Aligned,
            continuous_compute: false,
        }
    }
}

/// Random draws recorded from a reference run, consumed in call order.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReplayDraws {
    /// Values per row.
    pub dim: usize,
    /// Row-major rows, `rows * dim` values.
    pub data: Vec<f32>,
}

impl ReplayDraws {
    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.dim).unwrap_or(0)
    }
}

impl GenerateSpec {
    /// A greedy request (seeded with `seed` for the schemes that draw) for `max_new_tokens`
    /// tokens after `prompt_ids`, without stop tokens, replayed draws or canvas frames: what
    /// benchmarks and tests send.
    pub fn greedy(
        prompt_ids: Vec<u32>,
        max_new_tokens: usize,
        seed: u64,
        scheme: SchemeParams,
    ) -> Self {
        Self {
            prompt_ids,
            max_new_tokens,
            stop_token_ids: Vec::new(),
            sampling: SamplingParams {
                seed,
                ..SamplingParams::default()
            },
            scheme,
            replay_draws: None,
            stream_canvas: false,
            guide: None,
        }
    }

    /// Checks every family shares: prompt present, ids in the vocabulary,
    /// lengths within the model's limits, sampling ranges.
    pub fn validate_common(
        &self,
        vocab_size: usize,
        max_context: usize,
    ) -> Result<(), RequestError> {
        let bad = |m: String| Err(RequestError::InvalidArgument(m));
        if self.prompt_ids.is_empty() {
            return bad("prompt is empty: give prompt text or at least one token id".into());
        }
        if let Some((i, id)) = self
            .prompt_ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= vocab_size)
        {
            return bad(format!(
                "prompt token id {id} at index {i} is outside the vocabulary (size {vocab_size})"
            ));
        }
        if let Some(id) = self
            .stop_token_ids
            .iter()
            .find(|&&id| id as usize >= vocab_size)
        {
            return bad(format!(
                "stop token id {id} is outside the vocabulary (size {vocab_size})"
            ));
        }
        if self.max_new_tokens == 0 && self.sampling.prompt_logprobs.is_none() {
            return bad(
                "max_new_tokens must be at least 1 (0 only scores the prompt, with prompt_logprobs)"
                    .into(),
            );
        }
        if let Some(c) = self.sampling.likelihood_context {
            if c == 0 || c >= self.prompt_ids.len() {
                return bad(format!(
                    "likelihood.context_tokens must leave at least one of the prompt's {} tokens \
                     to score and condition on at least one, got {c}",
                    self.prompt_ids.len()
                ));
            }
            let answer = self.prompt_ids.len() - c;
            if answer > MAX_LIKELIHOOD_ANSWER {
                return bad(format!(
                    "the scored answer (the prompt after likelihood.context_tokens) is {answer} \
                     tokens; at most {MAX_LIKELIHOOD_ANSWER} (every sample reads a row of logits \
                     per masked answer token): raise context_tokens"
                ));
            }
        }
        if self.prompt_ids.len() >= max_context {
            return Err(RequestError::TooLarge(format!(
                "prompt has {} tokens but the model's context limit is {max_context}; shorten the prompt",
                self.prompt_ids.len()
            )));
        }
        if self.prompt_ids.len() + self.max_new_tokens > max_context {
            return bad(format!(
                "prompt ({} tokens) + max_new_tokens ({}) exceeds the model's context limit of {max_context}; \
                 lower max_new_tokens to at most {}",
                self.prompt_ids.len(),
                self.max_new_tokens,
                max_context - self.prompt_ids.len()
            ));
        }
        self.sampling.validate()?;
        let masked = matches!(
            self.scheme,
            SchemeParams::LowConfidence(_)
                | SchemeParams::Wino(_)
                | SchemeParams::DiffusionGenerate(_)
        );
        if self.sampling.prompt_logprobs.is_some()
            && !(masked || matches!(self.scheme, SchemeParams::Ar(_)))
        {
            return bad(format!(
                "prompt_logprobs is not served for scheme {}: the prompt is scored by the \
                 autoregressive schemes (ar) and by masked diffusion (low-confidence, wino, \
                 diffusion-generate)",
                self.scheme.name()
            ));
        }
        if masked && self.sampling.prompt_logprobs.is_some() && self.prompt_ids.len() < 2 {
            return bad(
                "prompt_logprobs scores the tokens after the first: a one-token prompt has none"
                    .into(),
            );
        }
        if !masked
            && (self.sampling.mc_samples.is_some() || self.sampling.likelihood_context.is_some())
        {
            return bad(format!(
                "likelihood options apply to masked diffusion's prompt scoring, not to scheme {}",
                self.scheme.name()
            ));
        }
        Ok(())
    }
}

/// Refuses a request as an invalid argument, saying why.
pub(crate) fn bad<T>(message: String) -> Result<T, RequestError> {
    Err(RequestError::InvalidArgument(message))
}
