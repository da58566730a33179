//! `config.json` of a Huginn (raven) recurrent-depth checkpoint.
//!
//! Deserialized straight from the Hugging Face config written by upstream `RavenConfig`
//! (Geiping et al., 2025, "Scaling up Test-Time Compute with Latent Reasoning: A Recurrent Depth
//! Approach"). Only the keys that matter at inference are read; the others (`*_class_name`,
//! `injection_type`, `state_init`, init keys) are hardcoded by the minimal upstream model and
//! ignored here. [`HuginnConfig::validate`] rejects values this implementation cannot honour.

use serde::Deserialize;

use crate::config::{
    check_opt_size, check_positive, check_rope, check_size, in_file, invalid, parse_json,
    MAX_LAYERS, MAX_VOCAB, MAX_WIDTH,
};
use crate::error::Result;

/// The most recurrences a config may ask for by default (`mean_recurrence`).
const MAX_RECURRENCE: usize = 1 << 16;

/// Initial-value block of the config (`init_values`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct InitValues {
    /// Standard deviation of the initial latent state before embedding scaling.
    pub std: f64,
    /// Embedding scale; upstream multiplies embeddings and initial states by it. Defaults to
    /// `sqrt(n_embd)`, which is what upstream writes.
    #[serde(default)]
    pub embed_scale: Option<f64>,
}

/// The inference-relevant keys of a huginn `config.json`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct HuginnConfig {
    /// Always `huginn_raven` for this family.
    #[serde(default)]
    pub model_type: Option<String>,
    /// Model width E.
    pub n_embd: usize,
    /// Attention heads H.
    pub n_heads: usize,
    /// Key/value heads; must equal `n_heads` (no GQA in this family).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head width; must equal `n_embd / n_heads` when present.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Hidden width of the gated MLP.
    pub intermediate_size: usize,
    /// Tokenizer vocabulary size.
    pub vocab_size: usize,
    /// Rows of the embedding / head matrix (`vocab_size` when absent).
    #[serde(default)]
    pub padded_vocab_size: Option<usize>,
    /// Prelude depth P.
    pub n_layers_in_prelude: usize,
    /// Core (recurrent) block depth C.
    pub n_layers_in_recurrent_block: usize,
    /// Coda depth.
    pub n_layers_in_coda: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// RoPE base.
    pub rope_base: f64,
    /// Length of the RoPE table, i.e. the largest supported sequence length.
    pub block_size: usize,
    /// Whether `lm_head` shares `transformer.wte.weight`.
    #[serde(default = "crate::config::default_true")]
    pub tie_embeddings: bool,
    /// Whether attention adds a learned bias to q and k before RoPE.
    #[serde(default = "crate::config::default_true")]
    pub qk_bias: bool,
    /// Whether the adapter has a bias.
    #[serde(default)]
    pub bias: bool,
    /// Default number of recurrences.
    pub mean_recurrence: usize,
    /// Initial-state parameters.
    pub init_values: InitValues,
    /// Test-time noise injected before each core step; only 0 (off) is supported.
    #[serde(default)]
    pub test_time_noise: f64,
    /// Tokens that end a response (upstream generation stops on them), when given.
    #[serde(default)]
    pub eos_token_id: Option<crate::config::TokenIds>,
}

impl HuginnConfig {
    /// The ids of `eos_token_id` (none when absent).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(crate::config::TokenIds::to_vec)
            .unwrap_or_default()
    }

    /// Parses and validates a `config.json` document.
    pub fn from_json(json: &str) -> Result<Self> {
        let cfg: Self = parse_json("config.json", json)?;
        cfg.validate().map_err(in_file("config.json"))?;
        Ok(cfg)
    }

    /// Checks that the config describes a model this implementation runs exactly.
    pub fn validate(&self) -> Result<()> {
        if let Some(t) = &self.model_type {
            if t != "huginn_raven" {
                return Err(invalid(
                    "model_type",
                    format!("expected `huginn_raven`, got `{t}`"),
                ));
            }
        }
        // Sizes first, so nothing below is computed from (or allocated for) a lying value.
        let file = "config.json";
        check_size(file, "n_embd", self.n_embd, 1, MAX_WIDTH)?;
        check_size(file, "n_heads", self.n_heads, 1, MAX_WIDTH)?;
        check_opt_size(
            file,
            "num_key_value_heads",
            self.num_key_value_heads,
            1,
            MAX_WIDTH,
        )?;
        check_opt_size(file, "head_dim", self.head_dim, 1, MAX_WIDTH)?;
        check_size(
            file,
            "intermediate_size",
            self.intermediate_size,
            1,
            MAX_WIDTH,
        )?;
        check_size(file, "vocab_size", self.vocab_size, 1, MAX_VOCAB)?;
        check_opt_size(
            file,
            "padded_vocab_size",
            self.padded_vocab_size,
            1,
            MAX_VOCAB,
        )?;
        // At least one prelude layer: its slot 0 advances the KV cache.
        for (key, n, min) in [
            ("n_layers_in_prelude", self.n_layers_in_prelude, 1),
            (
                "n_layers_in_recurrent_block",
                self.n_layers_in_recurrent_block,
                1,
            ),
            ("n_layers_in_coda", self.n_layers_in_coda, 0),
        ] {
            check_size(file, key, n, min, MAX_LAYERS)?;
        }
        check_size(
            file,
            "mean_recurrence",
            self.mean_recurrence,
            1,
            MAX_RECURRENCE,
        )?;
        check_positive(file, "norm_eps", self.norm_eps)?;
        check_positive(file, "rope_base", self.rope_base)?;
        if self.n_embd.checked_rem(self.n_heads) != Some(0) {
            return Err(invalid(
                "n_heads",
                format!("must divide n_embd = {}", self.n_embd),
            ));
        }
        let head_dim = self.n_embd / self.n_heads;
        if head_dim & 1 == 1 {
            return Err(invalid("n_heads", "head dimension must be even for RoPE"));
        }
        if let Some(d) = self.head_dim {
            if d != head_dim {
                return Err(invalid(
                    "head_dim",
                    format!("{d} differs from n_embd / n_heads = {head_dim}"),
                ));
            }
        }
        if let Some(kv) = self.num_key_value_heads {
            if kv != self.n_heads {
                return Err(invalid(
                    "num_key_value_heads",
                    format!(
                        "grouped-query attention is not supported ({kv} != n_heads {})",
                        self.n_heads
                    ),
                ));
            }
        }
        if self.padded_vocab() < self.vocab_size || self.vocab_size == 0 {
            return Err(invalid(
                "padded_vocab_size",
                "must be at least vocab_size > 0",
            ));
        }
        check_rope(file, "block_size", self.block_size, head_dim)?;
        let std = self.init_values.std;
        if std.is_nan() || std < 0.0 || !(std as f32).is_finite() {
            return Err(invalid(
                "init_values.std",
                "must be a non-negative number that float32 holds",
            ));
        }
        if let Some(s) = self.init_values.embed_scale {
            check_positive(file, "init_values.embed_scale", s)?;
        }
        if self.test_time_noise != 0.0 {
            return Err(invalid(
                "test_time_noise",
                "test-time noise injection is not supported",
            ));
        }
        Ok(())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_heads
    }

    /// Rows of the embedding matrix and width of the logits.
    pub fn padded_vocab(&self) -> usize {
        self.padded_vocab_size.unwrap_or(self.vocab_size)
    }

    /// Embedding scale (`init_values.embed_scale`, default `sqrt(n_embd)`).
    pub fn embed_scale(&self) -> f64 {
        self.init_values
            .embed_scale
            .unwrap_or_else(|| (self.n_embd as f64).sqrt())
    }

    /// Standard deviation of the initial latent state for `init_scale` (before the embedding
    /// scale is applied): `init_values.std * init_scale`.
    pub fn init_std(&self, init_scale: f64) -> f64 {
        self.init_values.std * init_scale
    }

    /// Name and shape of every checkpoint tensor [`super::Huginn::load`] reads, in load order
    /// (the `freqs_cis` buffer is recomputed and not listed; `lm_head.weight` only when the
    /// embeddings are not tied). Used to build synthetic checkpoints of a given size.
    pub fn checkpoint_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (e, h, d) = (self.n_embd, self.n_heads, self.head_dim());
        let (v, i) = (self.padded_vocab(), self.intermediate_size);
        let mut out = vec![("transformer.wte.weight".to_owned(), vec![v, e])];
        if !self.tie_embeddings {
            out.push(("lm_head.weight".to_owned(), vec![v, e]));
        }
        let blocks = |group: &str, n: usize, out: &mut Vec<(String, Vec<usize>)>| {
            for b in 0..n {
                let p = format!("transformer.{group}.{b}");
                out.push((format!("{p}.attn.Wqkv.weight"), vec![3 * e, e]));
                out.push((format!("{p}.attn.proj.weight"), vec![e, e]));
                if self.qk_bias {
                    out.push((format!("{p}.attn.qk_bias"), vec![2, 1, h, d]));
                }
                out.push((format!("{p}.mlp.fc.weight"), vec![2 * i, e]));
                out.push((format!("{p}.mlp.proj.weight"), vec![e, i]));
                for norm in 1..=4 {
                    out.push((format!("{p}.norm_{norm}.weight"), vec![e]));
                }
            }
        };
        blocks("prelude", self.n_layers_in_prelude, &mut out);
        blocks("core_block", self.n_layers_in_recurrent_block, &mut out);
        blocks("coda", self.n_layers_in_coda, &mut out);
        out.push(("transformer.adapter.weight".to_owned(), vec![e, 2 * e]));
        if self.bias {
            out.push(("transformer.adapter.bias".to_owned(), vec![e]));
        }
        out.push(("transformer.ln_f.weight".to_owned(), vec![e]));
        out
    }
}
