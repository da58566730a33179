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
}

#[derive(Debug, Clone, Args)]
pub struct PromptArgs {
    /// Prompt text (tokenized with the model's tokenizer).
    #[arg(long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Raw prompt token ids, comma separated (e.g. 1,2,3).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Model name to address (empty: the only model served).
    #[arg(long, default_value = "")]
    pub model_name: String,
}

#[derive(Debug, Clone, Args)]
pub struct GenerationArgs {
    /// Maximum number of tokens to generate.
    #[arg(long)]
    pub max_new_tokens: u32,
    /// Decoding scheme.
    #[arg(long, value_enum, default_value = "ar")]
    pub scheme: SchemeName,
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
    /// Seed of every random draw of the request.
    #[arg(long)]
    pub seed: Option<u64>,

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
}

impl GenerationArgs {
    /// The API request these flags describe.
    pub fn to_request(&self, prompt: &PromptArgs) -> Result<pb::GenerateRequest> {
        let prompt_oneof = match (&prompt.prompt, &prompt.prompt_ids) {
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
        let scheme = match self.scheme {
            SchemeName::Ar => {
                if let Some((flag, _)) = df_only.iter().find(|(_, set)| *set) {
                    bail!("{flag} belongs to --scheme diffusion-forcing, not ar");
                }
                pb::generate_request::Scheme::Ar(pb::ArScheme {
                    num_steps: self.num_steps,
                    cache_lookup_strategy: self.cache_lookup_strategy.clone().unwrap_or_default(),
                    init_scale: self.init_scale,
                    exit_threshold: self.exit_threshold,
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
                })
            }
        };
        Ok(pb::GenerateRequest {
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
            scheme: Some(scheme),
        })
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
