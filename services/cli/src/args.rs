//! Command-line flags shared by `run` and `generate`: the prompt, the
//! decoding scheme and every scheme parameter, named after its proto field
//! in kebab-case. They build the same `wavefront.v1.GenerateRequest` the API
//! takes, so offline and served generation go through one conversion.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use wavefront_proto::v1 as pb;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SchemeName {
    /// Autoregressive: recurrent depth static (`--num-steps`) or adaptive
    /// (`--exit-threshold`).
    Ar,
    /// Recurrent-depth diffusion-forcing wavefront sampler.
    DiffusionForcing,
    /// Masked diffusion (LLaDA): low-confidence remasking sampler (`--block-length`,
    /// `--steps`, `--remasking`, `--cfg-scale`, `--surelock-eps`).
    LowConfidence,
    /// Masked diffusion (LLaDA): WINO draft-and-verify sampler (`--block-length`,
    /// `--threshold`, `--threshold-back`, `--surelock-eps`).
    Wino,
    /// Slot diffusion (ReFusion): plan-and-infill (`--slot-size`, `--serial-num-blocks`,
    /// `--slot-threshold`, `--token-threshold`, `--temperature`).
    PlanInfill,
    /// Masked diffusion (Dream): its sampler `diffusion_generate` (`--alg`, `--steps`,
    /// `--eps`, `--alg-temp`, `--upstream-defaults`, with `--temperature`, `--top-k`,
    /// `--top-p`).
    DiffusionGenerate,
    /// Masked diffusion (LLaDA2.0): block diffusion (`--block-length`, `--steps` per block,
    /// `--threshold`, `--minimal-topk`, `--eos-early-stop`, `--upstream-sampler`).
    BlockDiffusion,
    /// Uniform-noise diffusion (DiffusionGemma): the entropy-bounded sampler
    /// (`--max-denoising-steps`, `--t-max`, `--t-min`, `--entropy-bound`,
    /// `--stability-threshold`, `--confidence-threshold`, `--no-early-stop`, `--initial-canvas`,
    /// `--whole-canvases`; unset: the model's generation_config.json).
    EntropyBound,
}

/// `ar.execution` of a recurrent-memory (ARMT) request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExecutionName {
    /// One segment through every layer per step.
    Sequential,
    /// Diagonal batching: every (segment, layer) cell with segment + layer = i in one step.
    Diagonal,
    /// Diagonal when the prompt has at least two segments.
    Auto,
}

impl ExecutionName {
    fn as_str(self) -> &'static str {
        match self {
            ExecutionName::Sequential => "sequential",
            ExecutionName::Diagonal => "diagonal",
            ExecutionName::Auto => "auto",
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct PromptArgs {
    /// Prompt text (tokenized with the model's tokenizer).
    #[arg(long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Raw prompt token ids, comma separated (e.g. 1,2,3).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Send `--prompt` as a user message formatted with the model's chat template.
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// With `--chat`: a system message before the user's.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Model name to address (empty: the only model served, else the router's default model;
    /// `serve` without `--model` serves four and defaults to huginn).
    #[arg(long, default_value = "")]
    pub model_name: String,
}

#[derive(Debug, Clone, Args)]
pub struct GenerationArgs {
    /// Maximum number of tokens to generate.
    #[arg(long)]
    pub max_new_tokens: u32,
    /// Decoding scheme. Unset: the model's default scheme (as over HTTP), or `ar` when a
    /// recurrent-depth or recurrent-memory flag (--num-steps, --execution, ...) is given.
    #[arg(long, value_enum)]
    pub scheme: Option<SchemeName>,
    /// Stop after any of these token ids (comma separated).
    #[arg(long, value_delimiter = ',')]
    pub stop_token_ids: Vec<u32>,
    /// Stop once the text contains this string (repeatable).
    #[arg(long = "stop-string")]
    pub stop_strings: Vec<String>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Top-k filter; 0 disables.
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Nucleus filter; 0 or 1 disables.
    #[arg(long, default_value_t = 0.0)]
    pub top_p: f32,
    /// Also print canvas events (one JSON line each) for watching the decoding: masked
    /// diffusion's whole canvas after every step, slot diffusion's slots as they commit. On
    /// stdout with --json; otherwise on stderr, beside the text on stdout.
    #[arg(long)]
    pub stream_canvas: bool,
    /// Keep special tokens (end of text, chat headers, masks) in the text; token ids always
    /// hold them.
    #[arg(long)]
    pub keep_special_tokens: bool,
    /// Seed of every random draw of the request.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Report each generated token's log-probability with this many most likely alternatives
    /// (0 to 20), under the distribution it was committed from (docs/architecture.md,
    /// "Log-probabilities"); shown with --json.
    #[arg(long, value_name = "N")]
    pub logprobs: Option<u32>,
    /// Score the prompt: each prompt token's log-probability with N alternatives (0 to 20);
    /// with it --max-new-tokens may be 0. Shown with --json.
    #[arg(long, value_name = "N")]
    pub prompt_logprobs: Option<u32>,
    /// Masked diffusion's prompt scoring: the prompt tokens that condition the scored answer
    /// (LLaDA's Monte Carlo bound); unset scores every token as a one-token answer.
    #[arg(long, value_name = "N")]
    pub likelihood_context: Option<u32>,
    /// Masked diffusion's Monte Carlo samples for --likelihood-context (default 64).
    #[arg(long, value_name = "N")]
    pub mc_samples: Option<u32>,
    /// Structured output: a JSON document valid under this JSON schema (its JSON text).
    #[arg(long, value_name = "SCHEMA", group = "structured")]
    pub json_schema: Option<String>,
    /// Structured output: any JSON object.
    #[arg(long, group = "structured")]
    pub json_object: bool,
    /// Structured output: text matching this regular expression, whole.
    #[arg(long, value_name = "REGEX", group = "structured")]
    pub regex: Option<String>,
    /// Structured output: exactly one of these strings (repeat the flag).
    #[arg(long, value_name = "TEXT", group = "structured")]
    pub choice: Vec<String>,
    /// Structured output: a sentence of this Lark grammar.
    #[arg(long, value_name = "LARK", group = "structured")]
    pub grammar: Option<String>,

    // ---- ar / diffusion-forcing (recurrent depth) ----
    /// Recurrence steps per token (ar) or of the prefill (diffusion-forcing).
    #[arg(long)]
    pub num_steps: Option<u32>,
    /// Upstream cache_lookup_strategy: full, latest-m4, latest-m4-compress-s4, compress-sN.
    #[arg(long)]
    pub cache_lookup_strategy: Option<String>,
    /// Scale of the random initial latent state; 0 gives zeros.
    #[arg(long)]
    pub init_scale: Option<f32>,
    /// ar adaptive exit: stop iterating when the latent's relative change is below this.
    #[arg(long)]
    pub exit_threshold: Option<f32>,
    /// diffusion-forcing: core iterations per sampler step (r').
    #[arg(long)]
    pub inner_recurrence: Option<u32>,
    /// diffusion-forcing: freeze threshold (eps).
    #[arg(long)]
    pub exit_t: Option<f32>,
    /// diffusion-forcing: embedding momentum (eta).
    #[arg(long)]
    pub ema_embeds: Option<f32>,
    /// diffusion-forcing: noise mixing (beta).
    #[arg(long)]
    pub state_noise_mixing: Option<f32>,
    /// diffusion-forcing: new positions per step.
    #[arg(long)]
    pub headway: Option<u32>,
    /// diffusion-forcing: wavefront cap.
    #[arg(long)]
    pub max_wavefront: Option<u32>,
    /// diffusion-forcing: `aligned` (paper) or `upstream` (reference code).
    #[arg(long)]
    pub freeze_test: Option<String>,
    /// Upstream continuous_compute: start each new position from the latent state before it
    /// instead of a fresh random draw (ar and diffusion-forcing).
    #[arg(long)]
    pub continuous_compute: bool,
    /// ar on a recurrent-memory (ARMT) model: how the context's segments run: `sequential`,
    /// `diagonal` (diagonal batching) or `auto` (diagonal from two segments on; the default).
    #[arg(long, value_enum)]
    pub execution: Option<ExecutionName>,

    // ---- low-confidence / wino (masked diffusion) ----
    /// low-confidence, wino: block length (default: one block); the canvas is rounded up to whole
    /// blocks and the answer stops at --max-new-tokens.
    #[arg(long)]
    pub block_length: Option<u32>,
    /// low-confidence: sampling steps in all, split across blocks; diffusion-generate: sampling
    /// steps (default: --max-new-tokens).
    #[arg(long)]
    pub steps: Option<u32>,
    /// low-confidence: `low_confidence` (default) or `random`.
    #[arg(long)]
    pub remasking: Option<String>,
    /// low-confidence: classifier-free guidance scale (0 disables).
    #[arg(long)]
    pub cfg_scale: Option<f32>,
    /// wino: draft threshold tau1 (default 0.6); low-confidence: Fast-dLLM's confidence-aware
    /// parallel decoding, committing each step the block's most confident masked position and
    /// every one at least this confident (unset: the fixed commits per step of --steps).
    #[arg(long)]
    pub threshold: Option<f32>,
    /// low-confidence: Fast-dLLM's block cache, `none` (default, exact), `prefix` or `dual`
    /// (approximate: a block's later steps read the positions before it, and with `dual` after
    /// it, from the K/V of its first step).
    #[arg(long)]
    pub kv_cache: Option<String>,
    /// low-confidence with --kv-cache: make Fast-dLLM's extra cached forward after a block's
    /// full forward finished it (it commits nothing; off by default).
    #[arg(long)]
    pub upstream_calls: bool,
    /// wino: verification threshold tau2 (default 0.9).
    #[arg(long)]
    pub threshold_back: Option<f32>,
    /// low-confidence, wino: SureLock's KL threshold; unset disables SureLock.
    #[arg(long)]
    pub surelock_eps: Option<f32>,
    /// low-confidence, wino: SureLock's confidence-gate percentile m in (0, 100].
    #[arg(long)]
    pub surelock_percentile: Option<f32>,

    // ---- plan-infill (slot diffusion) ----
    /// plan-infill: tokens per slot (default 8).
    #[arg(long)]
    pub slot_size: Option<u32>,
    /// plan-infill: number of blocks (not their length; default 2); the canvas is rounded up to
    /// whole blocks of whole slots and the answer stops at --max-new-tokens.
    #[arg(long)]
    pub serial_num_blocks: Option<u32>,
    /// plan-infill: select slots whose first token's probability exceeds this (default 0.9).
    #[arg(long)]
    pub slot_threshold: Option<f32>,
    /// plan-infill: accept drafted tokens whose AR probability exceeds this (default 0.9).
    #[arg(long)]
    pub token_threshold: Option<f32>,

    // ---- diffusion-generate (Dream) ----
    /// diffusion-generate: `origin`, `maskgit_plus`, `topk_margin` or `entropy` (default).
    #[arg(long)]
    pub alg: Option<String>,
    /// diffusion-generate: the schedule's last timestep, in (0, 1) (default 0.001).
    #[arg(long)]
    pub eps: Option<f32>,
    /// diffusion-generate: draw committed positions from softmax(confidence / alg_temp);
    /// 0 (default) commits the most confident.
    #[arg(long)]
    pub alg_temp: Option<f32>,
    /// diffusion-generate: an unset --top-k means 50, as a bare upstream call under
    /// transformers 4.46 really runs.
    #[arg(long)]
    pub upstream_defaults: bool,

    // ---- block-diffusion (LLaDA2.0) ----
    /// block-diffusion: caps the steps per block at --max-new-tokens / minimal_topk (default 1).
    #[arg(long)]
    pub minimal_topk: Option<u32>,
    /// block-diffusion: end once an end-of-sequence token is committed with no mask before it.
    #[arg(long)]
    pub eos_early_stop: bool,
    /// block-diffusion: draw from softmax(logits) even at temperature 0, as LLaDA2.0's sampler
    /// does.
    #[arg(long)]
    pub upstream_sampler: bool,

    // ---- entropy-bound (DiffusionGemma) ----
    /// entropy-bound: denoising steps per canvas at most.
    #[arg(long)]
    pub max_denoising_steps: Option<u32>,
    /// entropy-bound: the first step's temperature (falls linearly towards --t-min).
    #[arg(long)]
    pub t_max: Option<f32>,
    /// entropy-bound: the temperature the schedule falls towards.
    #[arg(long)]
    pub t_min: Option<f32>,
    /// entropy-bound: accept the lowest-entropy positions whose lower-ranked entropies sum to
    /// at most this.
    #[arg(long)]
    pub entropy_bound: Option<f32>,
    /// entropy-bound: steps the argmax must hold before a canvas may stop early (0: none).
    #[arg(long)]
    pub stability_threshold: Option<u32>,
    /// entropy-bound: a canvas stops early once its mean entropy is below this.
    #[arg(long)]
    pub confidence_threshold: Option<f32>,
    /// entropy-bound: run every step of every canvas.
    #[arg(long)]
    pub no_early_stop: bool,
    /// entropy-bound: the first canvas's starting ids instead of noise (comma separated,
    /// canvas_length of them).
    #[arg(long, value_delimiter = ',')]
    pub initial_canvas: Vec<u32>,
    /// entropy-bound: return whole canvases past --max-new-tokens, padded after an end of
    /// sequence, as upstream generate() does.
    #[arg(long)]
    pub whole_canvases: bool,
}

impl GenerationArgs {
    /// The API request these flags describe.
    pub fn to_request(&self, prompt: &PromptArgs) -> Result<pb::GenerateRequest> {
        let prompt_oneof = match (&prompt.prompt, &prompt.prompt_ids) {
            (Some(t), None) if prompt.chat => {
                let mut messages = Vec::new();
                if let Some(system) = &prompt.system {
                    messages.push(pb::ChatMessage {
                        role: "system".into(),
                        content: system.clone(),
                    });
                }
                messages.push(pb::ChatMessage {
                    role: "user".into(),
                    content: t.clone(),
                });
                pb::generate_request::Prompt::Chat(pb::ChatMessages { messages })
            }
            (Some(t), None) => pb::generate_request::Prompt::Text(t.clone()),
            (None, Some(ids)) => {
                pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: ids.clone() })
            }
            (None, None) => bail!("give a prompt: --prompt TEXT or --prompt-ids 1,2,3"),
            (Some(_), Some(_)) => bail!("give either --prompt or --prompt-ids, not both"),
        };
        let df_only = [
            ("--inner-recurrence", self.inner_recurrence.is_some()),
            ("--exit-t", self.exit_t.is_some()),
            ("--ema-embeds", self.ema_embeds.is_some()),
            ("--state-noise-mixing", self.state_noise_mixing.is_some()),
            ("--headway", self.headway.is_some()),
            ("--max-wavefront", self.max_wavefront.is_some()),
            ("--freeze-test", self.freeze_test.is_some()),
        ];
        let masked_diffusion = [
            ("--block-length", self.block_length.is_some()),
            ("--steps", self.steps.is_some()),
            ("--remasking", self.remasking.is_some()),
            ("--cfg-scale", self.cfg_scale.is_some()),
            ("--threshold", self.threshold.is_some()),
            ("--kv-cache", self.kv_cache.is_some()),
            ("--upstream-calls", self.upstream_calls),
            ("--threshold-back", self.threshold_back.is_some()),
            ("--surelock-eps", self.surelock_eps.is_some()),
            ("--surelock-percentile", self.surelock_percentile.is_some()),
        ];
        let recurrent_depth = [
            ("--num-steps", self.num_steps.is_some()),
            (
                "--cache-lookup-strategy",
                self.cache_lookup_strategy.is_some(),
            ),
            ("--init-scale", self.init_scale.is_some()),
            ("--exit-threshold", self.exit_threshold.is_some()),
            ("--continuous-compute", self.continuous_compute),
        ];
        let slot_diffusion = [
            ("--slot-size", self.slot_size.is_some()),
            ("--serial-num-blocks", self.serial_num_blocks.is_some()),
            ("--slot-threshold", self.slot_threshold.is_some()),
            ("--token-threshold", self.token_threshold.is_some()),
        ];
        let dream = [
            ("--alg", self.alg.is_some()),
            ("--eps", self.eps.is_some()),
            ("--alg-temp", self.alg_temp.is_some()),
            ("--upstream-defaults", self.upstream_defaults),
        ];
        let block = [
            ("--minimal-topk", self.minimal_topk.is_some()),
            ("--eos-early-stop", self.eos_early_stop),
            ("--upstream-sampler", self.upstream_sampler),
        ];
        let entropy = [
            ("--max-denoising-steps", self.max_denoising_steps.is_some()),
            ("--t-max", self.t_max.is_some()),
            ("--t-min", self.t_min.is_some()),
            ("--entropy-bound", self.entropy_bound.is_some()),
            ("--stability-threshold", self.stability_threshold.is_some()),
            (
                "--confidence-threshold",
                self.confidence_threshold.is_some(),
            ),
            ("--no-early-stop", self.no_early_stop),
            ("--initial-canvas", !self.initial_canvas.is_empty()),
            ("--whole-canvases", self.whole_canvases),
        ];
        let set = |flags: &[(&'static str, bool)]| flags.iter().find(|(_, set)| *set).map(|f| f.0);
        // The masked-diffusion flags named, in their order above.
        let only = |names: &[&str]| -> Vec<(&'static str, bool)> {
            masked_diffusion
                .iter()
                .copied()
                .filter(|(flag, _)| names.contains(flag))
                .collect()
        };
        // No --scheme: the model's default, unless a scheme's flags were given, which meant
        // `ar` when --scheme defaulted to it (flags of the other schemes are refused by name
        // below, as before).
        let any = [
            &df_only[..],
            &masked_diffusion,
            &recurrent_depth,
            &slot_diffusion,
            &dream,
            &block,
            &entropy,
            &[("--execution", self.execution.is_some())],
        ]
        .iter()
        .any(|flags| set(flags).is_some());
        let Some(name) = self.scheme.or(any.then_some(SchemeName::Ar)) else {
            return Ok(self.request(prompt, prompt_oneof, None));
        };
        if name != SchemeName::EntropyBound {
            if let Some(flag) = set(&entropy) {
                bail!("{flag} belongs to --scheme entropy-bound");
            }
        }
        if name != SchemeName::BlockDiffusion {
            if let Some(flag) = set(&block) {
                bail!("{flag} belongs to --scheme block-diffusion");
            }
        }
        if name != SchemeName::DiffusionGenerate {
            if let Some(flag) = set(&dream) {
                bail!("{flag} belongs to --scheme diffusion-generate");
            }
        }
        if self.execution.is_some() && name != SchemeName::Ar {
            bail!("--execution belongs to --scheme ar (recurrent-memory models)");
        }
        if name != SchemeName::PlanInfill {
            if let Some(flag) = set(&slot_diffusion) {
                bail!("{flag} belongs to --scheme plan-infill");
            }
        }
        match name {
            SchemeName::EntropyBound => {
                if let Some(flag) = set(&masked_diffusion)
                    .or(set(&recurrent_depth))
                    .or(set(&df_only))
                {
                    bail!("{flag} does not apply to --scheme entropy-bound");
                }
            }
            SchemeName::BlockDiffusion => {
                // --block-length, --steps and --threshold apply; the rest of LLaDA's do not.
                let other = only(&[
                    "--remasking",
                    "--cfg-scale",
                    "--kv-cache",
                    "--upstream-calls",
                    "--threshold-back",
                    "--surelock-eps",
                    "--surelock-percentile",
                ]);
                if let Some(flag) = set(&other).or(set(&recurrent_depth)).or(set(&df_only)) {
                    bail!("{flag} does not apply to --scheme block-diffusion");
                }
            }
            SchemeName::DiffusionGenerate => {
                let not_steps: Vec<_> = masked_diffusion
                    .iter()
                    .copied()
                    .filter(|(flag, _)| *flag != "--steps")
                    .collect();
                if let Some(flag) = set(&not_steps).or(set(&recurrent_depth)).or(set(&df_only)) {
                    bail!("{flag} does not apply to --scheme diffusion-generate");
                }
            }
            SchemeName::PlanInfill => {
                if let Some(flag) = set(&masked_diffusion)
                    .or(set(&recurrent_depth))
                    .or(set(&df_only))
                {
                    bail!("{flag} does not apply to --scheme plan-infill");
                }
            }
            SchemeName::Ar | SchemeName::DiffusionForcing => {
                if let Some(flag) = set(&masked_diffusion) {
                    bail!("{flag} belongs to --scheme low-confidence or wino");
                }
            }
            SchemeName::LowConfidence | SchemeName::Wino => {
                if let Some(flag) = set(&recurrent_depth).or(set(&df_only)) {
                    bail!("{flag} belongs to the recurrent-depth schemes (ar, diffusion-forcing)");
                }
                let (name, wrong) = if name == SchemeName::Wino {
                    let lc_only = ["--steps", "--remasking", "--cfg-scale", "--kv-cache"];
                    (
                        "wino",
                        set(&only(&[&lc_only[..], &["--upstream-calls"]].concat())),
                    )
                } else {
                    ("low-confidence", set(&only(&["--threshold-back"])))
                };
                if let Some(flag) = wrong {
                    bail!("{flag} does not apply to --scheme {name}");
                }
            }
        }
        let scheme = match name {
            SchemeName::EntropyBound => {
                pb::generate_request::Scheme::EntropyBound(pb::EntropyBoundScheme {
                    max_denoising_steps: self.max_denoising_steps,
                    t_max: self.t_max,
                    t_min: self.t_min,
                    entropy_bound: self.entropy_bound,
                    stability_threshold: self.stability_threshold,
                    confidence_threshold: self.confidence_threshold,
                    no_early_stop: self.no_early_stop,
                    initial_canvas: self.initial_canvas.clone(),
                    whole_canvases: self.whole_canvases,
                })
            }
            SchemeName::BlockDiffusion => {
                pb::generate_request::Scheme::BlockDiffusion(pb::BlockDiffusionScheme {
                    block_length: self.block_length,
                    steps: self.steps,
                    threshold: self.threshold,
                    minimal_topk: self.minimal_topk,
                    eos_early_stop: self.eos_early_stop,
                    upstream_sampler: self.upstream_sampler,
                })
            }
            SchemeName::DiffusionGenerate => {
                pb::generate_request::Scheme::DiffusionGenerate(pb::DiffusionGenerateScheme {
                    alg: self.alg.clone().unwrap_or_default(),
                    steps: self.steps,
                    eps: self.eps,
                    alg_temp: self.alg_temp,
                    upstream_defaults: self.upstream_defaults,
                })
            }
            SchemeName::PlanInfill => {
                pb::generate_request::Scheme::PlanInfill(pb::PlanInfillScheme {
                    slot_size: self.slot_size,
                    serial_num_blocks: self.serial_num_blocks,
                    slot_threshold: self.slot_threshold,
                    token_threshold: self.token_threshold,
                })
            }
            SchemeName::LowConfidence => {
                pb::generate_request::Scheme::LowConfidence(pb::LowConfidenceScheme {
                    block_length: self.block_length,
                    steps: self.steps,
                    remasking: self.remasking.clone().unwrap_or_default(),
                    cfg_scale: self.cfg_scale.unwrap_or(0.0),
                    surelock_eps: self.surelock_eps,
                    surelock_percentile: self.surelock_percentile,
                    kv_cache: self.kv_cache.clone().unwrap_or_default(),
                    threshold: self.threshold,
                    upstream_calls: self.upstream_calls,
                })
            }
            SchemeName::Wino => pb::generate_request::Scheme::Wino(pb::WinoScheme {
                block_length: self.block_length,
                threshold: self.threshold,
                threshold_back: self.threshold_back,
                surelock_eps: self.surelock_eps,
                surelock_percentile: self.surelock_percentile,
            }),
            SchemeName::Ar => {
                if let Some((flag, _)) = df_only.iter().find(|(_, set)| *set) {
                    bail!("{flag} belongs to --scheme diffusion-forcing, not ar");
                }
                pb::generate_request::Scheme::Ar(pb::ArScheme {
                    num_steps: self.num_steps,
                    cache_lookup_strategy: self.cache_lookup_strategy.clone().unwrap_or_default(),
                    init_scale: self.init_scale,
                    exit_threshold: self.exit_threshold,
                    continuous_compute: self.continuous_compute,
                    execution: self
                        .execution
                        .map(|e| e.as_str().to_owned())
                        .unwrap_or_default(),
                })
            }
            SchemeName::DiffusionForcing => {
                if self.exit_threshold.is_some() {
                    bail!("--exit-threshold belongs to --scheme ar; the diffusion-forcing threshold is --exit-t");
                }
                pb::generate_request::Scheme::DiffusionForcing(pb::DiffusionForcingScheme {
                    num_steps: self.num_steps,
                    inner_recurrence: self.inner_recurrence,
                    exit_t: self.exit_t,
                    ema_embeds: self.ema_embeds,
                    state_noise_mixing: self.state_noise_mixing,
                    headway: self.headway,
                    max_wavefront: self.max_wavefront,
                    init_scale: self.init_scale,
                    cache_lookup_strategy: self.cache_lookup_strategy.clone().unwrap_or_default(),
                    freeze_test: self.freeze_test.clone().unwrap_or_default(),
                    continuous_compute: self.continuous_compute,
                })
            }
        };
        Ok(self.request(prompt, prompt_oneof, Some(scheme)))
    }

    /// The structured-output flag given, as the proto's message.
    fn structured_output(&self) -> Option<pb::StructuredOutput> {
        use pb::structured_output::Kind;
        let kind = if let Some(s) = &self.json_schema {
            Kind::Json(s.clone())
        } else if self.json_object {
            Kind::JsonObject(true)
        } else if let Some(r) = &self.regex {
            Kind::Regex(r.clone())
        } else if !self.choice.is_empty() {
            Kind::Choice(pb::ChoiceList {
                options: self.choice.clone(),
            })
        } else {
            Kind::Grammar(self.grammar.clone()?)
        };
        Some(pb::StructuredOutput {
            kind: Some(kind),
            strict: false,
        })
    }

    fn request(
        &self,
        prompt: &PromptArgs,
        prompt_oneof: pb::generate_request::Prompt,
        scheme: Option<pb::generate_request::Scheme>,
    ) -> pb::GenerateRequest {
        pb::GenerateRequest {
            n: None,
            model: prompt.model_name.clone(),
            prompt: Some(prompt_oneof),
            max_new_tokens: self.max_new_tokens,
            stop_token_ids: self.stop_token_ids.clone(),
            stop_strings: self.stop_strings.clone(),
            sampling: Some(pb::SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                seed: self.seed,
            }),
            scheme,
            stream_canvas: self.stream_canvas,
            skip_special_tokens: self.keep_special_tokens.then_some(false),
            logprobs: self.logprobs,
            prompt_logprobs: self.prompt_logprobs,
            structured_output: self.structured_output(),
            likelihood: (self.likelihood_context.is_some() || self.mc_samples.is_some()).then_some(
                pb::LikelihoodOptions {
                    context_tokens: self.likelihood_context,
                    mc_samples: self.mc_samples,
                },
            ),
        }
    }
}

/// Parses a `HOST:PORT` flag, with a message that says what is expected.
pub fn parse_listen(s: &str) -> Result<std::net::SocketAddr> {
    use std::net::ToSocketAddrs;
    s.to_socket_addrs()
        .with_context(|| format!("--listen must be HOST:PORT (e.g. 127.0.0.1:50051), got {s:?}"))?
        .next()
        .with_context(|| format!("{s:?} resolves to no address"))
}

#[cfg(test)]
mod masked_diffusion_flag_tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        prompt: PromptArgs,
        #[command(flatten)]
        generation: GenerationArgs,
    }

    fn request(flags: &[&str]) -> Result<pb::GenerateRequest> {
        let argv = ["wavefront", "--prompt-ids", "1,2", "--max-new-tokens", "16"];
        let cli = Cli::try_parse_from(argv.iter().chain(flags))?;
        cli.generation.to_request(&cli.prompt)
    }

    #[test]
    fn without_scheme_the_model_default_is_asked_for_unless_ar_flags_are_given() -> Result<()> {
        assert_eq!(request(&[])?.scheme, None);
        let ar = request(&["--num-steps", "8"])?;
        assert!(
            matches!(ar.scheme, Some(pb::generate_request::Scheme::Ar(ref a)) if a.num_steps == Some(8)),
            "{:?}",
            ar.scheme
        );
        let e = request(&["--block-length", "8"]).unwrap_err().to_string();
        assert!(e.contains("--block-length belongs to --scheme"), "{e}");
        Ok(())
    }

    #[test]
    fn masked_diffusion_flags_build_their_schemes() -> Result<()> {
        let lc = request(&[
            "--scheme",
            "low-confidence",
            "--block-length",
            "8",
            "--steps",
            "16",
            "--remasking",
            "random",
            "--cfg-scale",
            "0.5",
            "--surelock-eps",
            "0.001",
            "--surelock-percentile",
            "20",
        ])?;
        assert_eq!(
            lc.scheme,
            Some(pb::generate_request::Scheme::LowConfidence(
                pb::LowConfidenceScheme {
                    block_length: Some(8),
                    steps: Some(16),
                    remasking: "random".into(),
                    cfg_scale: 0.5,
                    surelock_eps: Some(0.001),
                    surelock_percentile: Some(20.0),
                    kv_cache: String::new(),
                    threshold: None,
                    upstream_calls: false,
                }
            ))
        );
        let wino = request(&[
            "--scheme",
            "wino",
            "--threshold",
            "0.5",
            "--threshold-back",
            "0.95",
            "--surelock-eps",
            "0.01",
        ])?;
        assert_eq!(
            wino.scheme,
            Some(pb::generate_request::Scheme::Wino(pb::WinoScheme {
                block_length: None,
                threshold: Some(0.5),
                threshold_back: Some(0.95),
                surelock_eps: Some(0.01),
                surelock_percentile: None,
            }))
        );
        Ok(())
    }

    #[test]
    fn execution_is_an_ar_flag() -> Result<()> {
        let ar = request(&["--scheme", "ar", "--execution", "diagonal"])?;
        let Some(pb::generate_request::Scheme::Ar(a)) = ar.scheme else {
            panic!("not ar");
        };
        assert_eq!(a.execution, "diagonal");
        // Without --scheme, --execution alone still means ar.
        let ar = request(&["--execution", "sequential"])?;
        let Some(pb::generate_request::Scheme::Ar(a)) = ar.scheme else {
            panic!("not ar");
        };
        assert_eq!(a.execution, "sequential");
        for scheme in ["wino", "diffusion-forcing"] {
            let err = request(&["--scheme", scheme, "--execution", "sequential"]).unwrap_err();
            assert!(
                err.to_string()
                    .contains("--execution belongs to --scheme ar"),
                "{err}"
            );
        }
        assert!(request(&["--execution", "pipelined"]).is_err());
        Ok(())
    }

    #[test]
    fn diffusion_generate_flags_build_their_scheme() -> Result<()> {
        let r = request(&[
            "--scheme",
            "diffusion-generate",
            "--alg",
            "maskgit_plus",
            "--steps",
            "16",
            "--eps",
            "0.01",
            "--alg-temp",
            "0.5",
            "--upstream-defaults",
            "--top-p",
            "0.9",
        ])?;
        assert_eq!(
            r.scheme,
            Some(pb::generate_request::Scheme::DiffusionGenerate(
                pb::DiffusionGenerateScheme {
                    alg: "maskgit_plus".into(),
                    steps: Some(16),
                    eps: Some(0.01),
                    alg_temp: Some(0.5),
                    upstream_defaults: true,
                }
            ))
        );
        assert_eq!(r.sampling.map(|s| s.top_p), Some(0.9));
        for (flags, want) in [
            (
                &["--scheme", "low-confidence", "--alg", "origin"][..],
                "--alg",
            ),
            (
                &["--scheme", "diffusion-generate", "--block-length", "8"][..],
                "--block-length",
            ),
            (
                &["--scheme", "diffusion-generate", "--num-steps", "8"][..],
                "--num-steps",
            ),
        ] {
            let err = request(flags).unwrap_err().to_string();
            assert!(err.contains(want), "{flags:?}: {err}");
        }
        Ok(())
    }

    #[test]
    fn block_diffusion_flags_build_their_scheme() -> Result<()> {
        let r = request(&[
            "--scheme",
            "block-diffusion",
            "--block-length",
            "8",
            "--steps",
            "4",
            "--threshold",
            "0.7",
            "--minimal-topk",
            "2",
            "--eos-early-stop",
        ])?;
        assert_eq!(
            r.scheme,
            Some(pb::generate_request::Scheme::BlockDiffusion(
                pb::BlockDiffusionScheme {
                    block_length: Some(8),
                    steps: Some(4),
                    threshold: Some(0.7),
                    minimal_topk: Some(2),
                    eos_early_stop: true,
                    upstream_sampler: false,
                }
            ))
        );
        for (flags, want) in [
            (
                &["--scheme", "wino", "--minimal-topk", "2"][..],
                "--minimal-topk",
            ),
            (
                &["--scheme", "block-diffusion", "--cfg-scale", "1"][..],
                "--cfg-scale",
            ),
            (
                &["--scheme", "block-diffusion", "--alg", "origin"][..],
                "--alg",
            ),
        ] {
            let err = request(flags).unwrap_err().to_string();
            assert!(err.contains(want), "{flags:?}: {err}");
        }
        Ok(())
    }

    #[test]
    fn fast_dllm_flags_build_the_low_confidence_scheme() -> Result<()> {
        let r = request(&[
            "--scheme",
            "low-confidence",
            "--block-length",
            "8",
            "--kv-cache",
            "dual",
            "--threshold",
            "0.9",
            "--upstream-calls",
        ])?;
        match r.scheme {
            Some(pb::generate_request::Scheme::LowConfidence(l)) => {
                assert_eq!(
                    (l.kv_cache.as_str(), l.threshold, l.upstream_calls),
                    ("dual", Some(0.9), true)
                );
            }
            other => panic!("{other:?}"),
        }
        Ok(())
    }

    #[test]
    fn flags_of_other_schemes_are_refused() {
        for (flags, want) in [
            (&["--scheme", "wino", "--steps", "4"][..], "--steps"),
            (
                &["--scheme", "low-confidence", "--threshold-back", "0.5"][..],
                "--threshold-back",
            ),
            (
                &["--scheme", "wino", "--kv-cache", "dual"][..],
                "--kv-cache",
            ),
            (
                &["--scheme", "block-diffusion", "--kv-cache", "dual"][..],
                "--kv-cache",
            ),
            (
                &["--scheme", "low-confidence", "--num-steps", "4"][..],
                "--num-steps",
            ),
            (
                &["--scheme", "ar", "--surelock-eps", "0.1"][..],
                "--surelock-eps",
            ),
        ] {
            let err = request(flags).unwrap_err().to_string();
            assert!(err.contains(want), "{flags:?}: {err}");
        }
    }
}

#[cfg(test)]
mod slot_diffusion_flag_tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        prompt: PromptArgs,
        #[command(flatten)]
        generation: GenerationArgs,
    }

    fn request(flags: &[&str]) -> Result<pb::GenerateRequest> {
        let argv = ["wavefront", "--prompt-ids", "1,2", "--max-new-tokens", "32"];
        let cli = Cli::try_parse_from(argv.iter().chain(flags))?;
        cli.generation.to_request(&cli.prompt)
    }

    #[test]
    fn plan_infill_flags_build_their_scheme() -> Result<()> {
        let r = request(&[
            "--scheme",
            "plan-infill",
            "--slot-size",
            "4",
            "--serial-num-blocks",
            "2",
            "--slot-threshold",
            "0.8",
            "--token-threshold",
            "0.2",
            "--temperature",
            "0.5",
        ])?;
        assert_eq!(
            r.scheme,
            Some(pb::generate_request::Scheme::PlanInfill(
                pb::PlanInfillScheme {
                    slot_size: Some(4),
                    serial_num_blocks: Some(2),
                    slot_threshold: Some(0.8),
                    token_threshold: Some(0.2),
                }
            ))
        );
        assert_eq!(r.sampling.map(|s| s.temperature), Some(0.5));
        Ok(())
    }

    #[test]
    fn flags_of_other_schemes_are_refused() {
        for (flags, want) in [
            (&["--scheme", "ar", "--slot-size", "4"][..], "--slot-size"),
            (
                &["--scheme", "wino", "--token-threshold", "0.5"][..],
                "--token-threshold",
            ),
            (
                &["--scheme", "plan-infill", "--block-length", "8"][..],
                "--block-length",
            ),
            (
                &["--scheme", "plan-infill", "--num-steps", "4"][..],
                "--num-steps",
            ),
        ] {
            let err = request(flags).unwrap_err().to_string();
            assert!(err.contains(want), "{flags:?}: {err}");
        }
    }
}
