//! `config.json` of a Qwen3 checkpoint (`Qwen3Config` of Hugging Face transformers, as ReFusion's
//! `qwen3/configuration_qwen3.py` defines it), plus ReFusion's `mask_token_id` (Li et al., 2025,
//! "ReFusion: A Diffusion Large Language Model with Parallel Autoregressive Decoding": `train.py`
//! adds `<|beginoftext|>` and `<|mask|>` and writes their ids into the config).
//!
//! Every key decoding depends on is read; [`Qwen3Config::validate`] rejects the option values
//! this implementation does not compute (scaled RoPE, sliding-window attention, activations
//! other than SiLU), so a checkpoint either loads with the reference numerics or fails naming
//! the key to blame. `head_dim` is its own key (128 for Qwen3-8B, whose width is 4096 with 32
//! heads), not `hidden_size / num_attention_heads`; only a config without it falls back to
//! that quotient, as transformers does.

use serde::Deserialize;

use crate::config::{
    bad, check_llama_sizes, check_plain_llama_options, check_rope, in_file, parse_json, LlamaSizes,
    TokenIds,
};
use crate::error::Result;
use crate::transformer::{BlockConfig, BlockNames};

fn default_eps() -> f64 {
    1e-6
}

fn default_max_positions() -> usize {
    32_768
}

/// The keys of a Qwen3 `config.json` (ReFusion's adds `mask_token_id`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Qwen3Config {
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Key/value heads (`num_attention_heads` when absent).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Width of one attention head; `hidden_size / num_attention_heads` when absent.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "crate::config::default_silu")]
    pub hidden_act: String,
    /// Sizes the RoPE table: the longest buffer (prompt + generation) accepted.
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "crate::config::default_rope_theta")]
    pub rope_theta: f64,
    /// Must be null: scaled RoPE variants are not implemented.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Biases on the q/k/v/o projections.
    #[serde(default)]
    pub attention_bias: bool,
    /// `true`: the output head is the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub use_sliding_window: bool,
    /// ReFusion's `<|mask|>` id; a Qwen3 checkpoint without it is not a ReFusion model.
    #[serde(default)]
    pub mask_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
}

impl Qwen3Config {
    /// Parses and validates a `config.json` document.
    pub fn from_json(json: &str) -> Result<Self> {
        let cfg: Self = parse_json("config.json", json)?;
        cfg.validate().map_err(in_file("config.json"))?;
        Ok(cfg)
    }

    /// Rejects option values this implementation does not compute.
    pub fn validate(&self) -> Result<()> {
        // Sizes first, so nothing below is computed from (or allocated for) a lying value.
        let file = "config.json";
        check_llama_sizes(
            file,
            LlamaSizes {
                vocab_size: self.vocab_size,
                hidden_size: self.hidden_size,
                intermediate_size: self.intermediate_size,
                num_hidden_layers: self.num_hidden_layers,
                num_attention_heads: self.num_attention_heads,
                num_key_value_heads: self.num_key_value_heads,
                head_dim: self.head_dim,
                rms_norm_eps: self.rms_norm_eps,
                rope_theta: self.rope_theta,
            },
        )?;
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad(
                "head_dim",
                format!(
                    "absent, and {} heads do not divide hidden_size {}",
                    self.num_attention_heads, self.hidden_size
                ),
            );
        }
        check_plain_llama_options(
            &self.hidden_act,
            self.rope_scaling.as_ref(),
            self.use_sliding_window,
        )?;
        self.block_config().validate()?;
        check_rope(
            file,
            "max_position_embeddings",
            self.max_position_embeddings,
            self.head_dim(),
        )?;
        if let Some(m) = self.mask_token_id {
            if m as usize >= self.vocab_size {
                return bad(
                    "mask_token_id",
                    format!("{m} outside the vocabulary of {}", self.vocab_size),
                );
            }
        }
        Ok(())
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// End-of-sequence ids (empty when the config names none).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map_or_else(Vec::new, TokenIds::to_vec)
    }

    /// The shared block's config: Qwen3's per-head q/k RMSNorm, no MLP biases.
    pub fn block_config(&self) -> BlockConfig {
        BlockConfig {
            hidden_size: self.hidden_size,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.kv_heads(),
            head_dim: self.head_dim(),
            intermediate_size: self.intermediate_size,
            norm_eps: self.rms_norm_eps,
            qkv_bias: self.attention_bias,
            out_bias: self.attention_bias,
            mlp_bias: false,
            qk_norm: true,
        }
    }

    /// Every checkpoint tensor with its shape, as `Qwen3ForCausalLM` names them.
    pub fn checkpoint_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (e, v) = (self.hidden_size, self.vocab_size);
        let block = self.block_config();
        let mut out = vec![("model.embed_tokens.weight".to_owned(), vec![v, e])];
        for i in 0..self.num_hidden_layers {
            let p = format!("model.layers.{i}");
            out.extend(block.checkpoint_tensors(&p, &BlockNames::LLAMA));
        }
        out.push(("model.norm.weight".to_owned(), vec![e]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_owned(), vec![v, e]));
        }
        out
    }
}
