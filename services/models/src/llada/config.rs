//! `config.json` of a LLaDA checkpoint (`LLaDAConfig` of GSAI-ML/LLaDA-8B-Instruct's remote
//! code, an OLMo-style config; Nie et al., 2025, "Large Language Diffusion Models").
//!
//! Every key the real config carries is read; [`LladaConfig::validate`] rejects the option values
//! this implementation does not honour (ALiBi, LayerNorm, chunked SwiGLU, q/k LayerNorm, ...), so
//! a checkpoint either loads with the reference numerics or fails with the key to blame.

use serde::Deserialize;

use crate::config::{
    bad, check_opt_size, check_positive, check_rope, check_size, in_file, parse_json,
    product_within, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH,
};
use crate::error::Result;
use crate::transformer::{BlockConfig, BlockNames};

fn default_mlp_ratio() -> usize {
    4
}

fn default_eps() -> f64 {
    1e-5
}

fn default_mask_id() -> u32 {
    126_336
}

fn default_max_seq() -> usize {
    4096
}

fn default_one() -> usize {
    1
}

fn default_rms() -> String {
    "rms".into()
}

fn default_llama() -> String {
    "llama".into()
}

/// The keys of a LLaDA `config.json`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct LladaConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    /// Model width.
    pub d_model: usize,
    pub n_heads: usize,
    /// Key/value heads (`n_heads` when absent).
    #[serde(default)]
    pub n_kv_heads: Option<usize>,
    /// `true`: one key/value head.
    #[serde(default)]
    pub multi_query_attention: Option<bool>,
    pub n_layers: usize,
    /// Hidden width of the gated MLP; takes precedence over `mlp_ratio · d_model`.
    #[serde(default)]
    pub mlp_hidden_size: Option<usize>,
    #[serde(default = "default_mlp_ratio")]
    pub mlp_ratio: usize,
    pub vocab_size: usize,
    /// Rows of the embedding and the output head (`vocab_size` when absent).
    #[serde(default)]
    pub embedding_size: Option<usize>,
    /// The `<|mdm_mask|>` id.
    #[serde(default = "default_mask_id")]
    pub mask_token_id: u32,
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "crate::config::default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "crate::config::default_true")]
    pub rope: bool,
    /// Sizes the RoPE table: the longest canvas (prompt + generation) accepted.
    #[serde(default = "default_max_seq")]
    pub max_sequence_length: usize,
    /// `true`: the output head is the embedding matrix.
    #[serde(default)]
    pub weight_tying: bool,
    /// Biases on every linear layer.
    #[serde(default)]
    pub include_bias: bool,
    /// Biases on the q/k/v projections.
    #[serde(default)]
    pub include_qkv_bias: Option<bool>,
    /// Logits scaled by `1 / sqrt(d_model)`.
    #[serde(default)]
    pub scale_logits: bool,
    #[serde(default = "default_rms")]
    pub layer_norm_type: String,
    #[serde(default = "crate::config::default_true")]
    pub layer_norm_with_affine: bool,
    #[serde(default)]
    pub bias_for_layer_norm: Option<bool>,
    #[serde(default)]
    pub attention_layer_norm: bool,
    #[serde(default = "crate::config::default_silu")]
    pub activation_type: String,
    #[serde(default = "default_llama")]
    pub block_type: String,
    #[serde(default = "default_one")]
    pub block_group_size: usize,
    #[serde(default)]
    pub alibi: bool,
    #[serde(default)]
    pub input_emb_norm: bool,
}

impl LladaConfig {
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
        check_size(file, "d_model", self.d_model, 1, MAX_WIDTH)?;
        check_size(file, "n_heads", self.n_heads, 1, MAX_WIDTH)?;
        check_opt_size(file, "n_kv_heads", self.n_kv_heads, 1, MAX_WIDTH)?;
        check_size(file, "n_layers", self.n_layers, 1, MAX_LAYERS)?;
        check_opt_size(file, "mlp_hidden_size", self.mlp_hidden_size, 1, MAX_WIDTH)?;
        check_size(file, "mlp_ratio", self.mlp_ratio, 1, MAX_WIDTH)?;
        if self.mlp_hidden_size.is_none()
            && product_within(self.mlp_ratio, self.d_model, MAX_WIDTH).is_none_or(|w| w == 0)
        {
            return bad(
                "mlp_ratio",
                format!(
                    "mlp_ratio {} times d_model {} must be an MLP width in 1..={MAX_WIDTH}; fix \
                     `mlp_ratio` (or set `mlp_hidden_size`) in {file}",
                    self.mlp_ratio, self.d_model
                ),
            );
        }
        check_size(file, "vocab_size", self.vocab_size, 1, MAX_VOCAB)?;
        check_opt_size(file, "embedding_size", self.embedding_size, 1, MAX_VOCAB)?;
        check_positive(file, "rms_norm_eps", self.rms_norm_eps)?;
        check_positive(file, "rope_theta", self.rope_theta)?;
        if self.d_model == 0 || self.n_heads == 0 || !self.d_model.is_multiple_of(self.n_heads) {
            return bad(
                "n_heads",
                format!(
                    "{} heads do not divide d_model {}",
                    self.n_heads, self.d_model
                ),
            );
        }
        if !self.n_heads.is_multiple_of(self.kv_heads()) {
            return bad(
                "n_kv_heads",
                format!(
                    "{} key/value heads do not divide {} heads",
                    self.kv_heads(),
                    self.n_heads
                ),
            );
        }
        if self.embedding_rows() < self.vocab_size {
            return bad(
                "embedding_size",
                format!("smaller than vocab_size {}", self.vocab_size),
            );
        }
        if self.mask_token_id as usize >= self.embedding_rows() {
            return bad(
                "mask_token_id",
                format!("{} outside the embedding", self.mask_token_id),
            );
        }
        let unsupported = [
            (
                "layer_norm_type",
                self.layer_norm_type != "rms",
                "only `rms` is implemented",
            ),
            (
                "activation_type",
                self.activation_type != "silu",
                "only `silu` (gated by up_proj) is implemented",
            ),
            (
                "block_type",
                self.block_type != "llama",
                "only `llama` blocks are implemented",
            ),
            ("block_group_size", self.block_group_size != 1, "must be 1"),
            ("alibi", self.alibi, "ALiBi is not implemented"),
            (
                "rope",
                !self.rope,
                "models without RoPE are not implemented",
            ),
            (
                "attention_layer_norm",
                self.attention_layer_norm,
                "q/k LayerNorm is not implemented",
            ),
            (
                "input_emb_norm",
                self.input_emb_norm,
                "embedding norm is not implemented",
            ),
            (
                "layer_norm_with_affine",
                !self.layer_norm_with_affine,
                "norms without weights are not implemented",
            ),
            (
                "bias_for_layer_norm",
                self.bias_for_layer_norm == Some(true),
                "norm biases are not implemented",
            ),
        ];
        for (key, is_bad, why) in unsupported {
            if is_bad {
                return bad(key, why.into());
            }
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(
                "n_heads",
                format!(
                    "the head width d_model / n_heads = {} must be even for RoPE",
                    self.head_dim()
                ),
            );
        }
        check_rope(
            file,
            "max_sequence_length",
            self.max_sequence_length,
            self.head_dim(),
        )?;
        Ok(())
    }

    /// Key/value heads after `multi_query_attention` and `n_kv_heads`.
    pub fn kv_heads(&self) -> usize {
        if self.multi_query_attention == Some(true) {
            1
        } else {
            self.n_kv_heads.unwrap_or(self.n_heads)
        }
    }

    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Rows of the embedding and of the output head.
    pub fn embedding_rows(&self) -> usize {
        self.embedding_size.unwrap_or(self.vocab_size)
    }

    /// Hidden width of the gated MLP.
    pub fn mlp_hidden(&self) -> usize {
        self.mlp_hidden_size
            .unwrap_or(self.mlp_ratio.saturating_mul(self.d_model))
    }

    /// The shared block's config.
    pub fn block_config(&self) -> BlockConfig {
        BlockConfig {
            hidden_size: self.d_model,
            n_heads: self.n_heads,
            n_kv_heads: self.kv_heads(),
            head_dim: self.head_dim(),
            intermediate_size: self.mlp_hidden(),
            norm_eps: self.rms_norm_eps,
            qkv_bias: self.include_bias || self.include_qkv_bias == Some(true),
            out_bias: self.include_bias,
            mlp_bias: self.include_bias,
            qk_norm: false,
        }
    }

    /// Algorithmic FLOPs of one forward through all blocks for `queries` rows attending to
    /// `keys` keys: GEMMs only (q/k/v/out projections, `QKᵀ` and `AV`, the MLP), as SureLock
    /// (Sec. 2.4) counts them. The output head is not included.
    pub fn algorithmic_flops(&self, queries: u64, keys: u64) -> u64 {
        let d = self.d_model as u64;
        let h = self.n_heads as u64;
        let hkv = self.kv_heads() as u64;
        let dh = self.head_dim() as u64;
        let ff = self.mlp_hidden() as u64;
        let per_layer = 4 * h * queries * keys * dh
            + 2 * queries * d * h * dh
            + 2 * queries * h * dh * d
            + 4 * queries * d * hkv * dh
            + 6 * queries * d * ff;
        self.n_layers as u64 * per_layer
    }

    /// Every checkpoint tensor with its shape, as the real checkpoint names them.
    pub fn checkpoint_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (e, v) = (self.d_model, self.embedding_rows());
        let block = self.block_config();
        let mut out = vec![("model.transformer.wte.weight".to_owned(), vec![v, e])];
        for i in 0..self.n_layers {
            let p = format!("model.transformer.blocks.{i}");
            out.extend(block.checkpoint_tensors(&p, &BlockNames::LLADA));
        }
        out.push(("model.transformer.ln_f.weight".to_owned(), vec![e]));
        if !self.weight_tying {
            out.push(("model.transformer.ff_out.weight".to_owned(), vec![v, e]));
        }
        out
    }
}
