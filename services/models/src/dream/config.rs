//! `config.json` of a Dream checkpoint (`DreamConfig` of Dream-org/Dream-v0-Instruct-7B's remote
//! code `configuration_dream.py`: Qwen2's keys plus `mask_token_id`; Ye et al., 2025, "Dream 7B").
//!
//! Every key the forward depends on is read; [`DreamConfig::validate`] rejects the option values
//! this implementation does not compute (scaled or multimodal RoPE, sliding-window attention,
//! activations other than SiLU), so a checkpoint either loads with the reference numerics or
//! fails naming the key to blame. The config has no `head_dim` key: a head is
//! `hidden_size / num_attention_heads` wide, as upstream computes it.

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

/// The keys of a Dream `config.json`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct DreamConfig {
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
    #[serde(default = "crate::config::default_silu")]
    pub hidden_act: String,
    /// Sizes the RoPE table: the longest canvas (prompt + generation) accepted.
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "crate::config::default_rope_theta")]
    pub rope_theta: f64,
    /// Must be null: scaled RoPE variants are not implemented.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Must be false: multimodal RoPE is not implemented.
    #[serde(default)]
    pub use_mrope: bool,
    /// `true`: the output head is the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub use_sliding_window: bool,
    /// The `<|mask|>` id the sampler fills (the sampler reads it here, not from
    /// `generation_config.json`, whose value is null).
    pub mask_token_id: u32,
    /// `<|endoftext|>`, also the pad token.
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
}

impl DreamConfig {
    /// Parses and validates a `config.json` document.
    pub fn from_json(json: &str) -> Result<Self> {
        let cfg: Self = parse_json("config.json", json)?;
        cfg.validate().map_err(in_file("config.json"))?;
        Ok(cfg)
    }

    /// Rejects option values this implementation does not compute.
    pub fn validate(&self) -> Result<()> {
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
                head_dim: None,
                rms_norm_eps: self.rms_norm_eps,
                rope_theta: self.rope_theta,
            },
        )?;
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad(
                "num_attention_heads",
                format!(
                    "{} heads do not divide hidden_size {}",
                    self.num_attention_heads, self.hidden_size
                ),
            );
        }
        check_plain_llama_options(
            &self.hidden_act,
            self.rope_scaling.as_ref(),
            self.use_sliding_window,
        )?;
        if self.use_mrope {
            return bad("use_mrope", "multimodal RoPE is not implemented".into());
        }
        self.block_config().validate()?;
        check_rope(
            file,
            "max_position_embeddings",
            self.max_position_embeddings,
            self.head_dim(),
        )?;
        if self.mask_token_id as usize >= self.vocab_size {
            return bad(
                "mask_token_id",
                format!(
                    "{} outside the vocabulary of {}",
                    self.mask_token_id, self.vocab_size
                ),
            );
        }
        Ok(())
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// End-of-sequence ids (empty when the config names none).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map_or_else(Vec::new, TokenIds::to_vec)
    }

    /// The shared block's config: Qwen2's q/k/v biases, no q/k norm, no other biases.
    pub fn block_config(&self) -> BlockConfig {
        BlockConfig {
            hidden_size: self.hidden_size,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.kv_heads(),
            head_dim: self.head_dim(),
            intermediate_size: self.intermediate_size,
            norm_eps: self.rms_norm_eps,
            qkv_bias: true,
            out_bias: false,
            mlp_bias: false,
            qk_norm: false,
        }
    }

    /// GEMM FLOPs of one forward of `queries` rows attending over `keys` keys: projections,
    /// attention scores and values, and the gated MLP (multiply-adds count two).
    pub fn algorithmic_flops(&self, queries: u64, keys: u64) -> u64 {
        let d = self.hidden_size as u64;
        let h = self.num_attention_heads as u64;
        let hkv = self.kv_heads() as u64;
        let dh = self.head_dim() as u64;
        let ff = self.intermediate_size as u64;
        let per_layer = 4 * h * queries * keys * dh
            + 2 * queries * d * h * dh
            + 2 * queries * h * dh * d
            + 4 * queries * d * hkv * dh
            + 6 * queries * d * ff;
        self.num_hidden_layers as u64 * per_layer
    }

    /// Every checkpoint tensor with its shape, as `DreamModel` names them.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_json() -> String {
        std::fs::read_to_string(crate::device::test_fixture("dream").join("config.json"))
            .expect("dream fixture config")
    }

    #[test]
    fn the_fixture_config_parses_with_its_derived_sizes() {
        let cfg = DreamConfig::from_json(&fixture_json()).unwrap();
        assert_eq!((cfg.head_dim(), cfg.kv_heads()), (16, 2));
        assert_eq!(cfg.mask_token_id, 479);
        assert_eq!(cfg.eos_token_ids(), vec![456]);
        // 3 top-level tensors and 12 per layer, as the README lists them.
        assert_eq!(cfg.checkpoint_tensors().len(), 3 + 12 * 2);
    }

    #[test]
    fn options_it_does_not_compute_are_refused_by_name() {
        let base: serde_json::Value = serde_json::from_str(&fixture_json()).unwrap();
        for (key, value) in [
            ("use_sliding_window", serde_json::json!(true)),
            ("use_mrope", serde_json::json!(true)),
            (
                "rope_scaling",
                serde_json::json!({"type": "yarn", "factor": 4.0}),
            ),
            ("hidden_act", serde_json::json!("gelu")),
            ("mask_token_id", serde_json::json!(4096)),
            ("num_attention_heads", serde_json::json!(5)),
        ] {
            let mut cfg = base.clone();
            cfg[key] = value;
            let err = DreamConfig::from_json(&cfg.to_string())
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }
}
