//! `config.json` of a LLaDA2.0 checkpoint (`LLaDA2MoeConfig` of inclusionAI/LLaDA2.0-mini's remote
//! code `configuration_llada2_moe.py`, `model_type` `llada2_moe`).
//!
//! Every key the forward depends on is read; [`Llada2Config::validate`] refuses what this
//! implementation does not compute (scaled RoPE, biases, activations other than SiLU, a score
//! function other than sigmoid), naming the key. Keys the upstream code reads but ignores
//! (`norm_topk_prob`, `moe_router_enable_expert_bias`, `router_dtype`, `rotary_dim`, the
//! sliding-window keys) are accepted and ignored as upstream does: the router always adds its
//! bias, always renormalises with more than one expert per row, and runs in float32, and the
//! rotary width is `head_dim · partial_rotary_factor`.
//!
//! The real config names no end-of-sequence or mask id (upstream `generate()` takes them as
//! arguments, defaulting to 156892 and 156895); `eos_token_id` and `mask_token_id` are read here
//! when present, and the server fills them from `generation_config.json` and the tokenizer's
//! `<|mask|>` otherwise.

use serde::Deserialize;

use crate::config::{
    bad, check_llama_sizes, check_plain_llama_options, check_rope, in_file, parse_json, LlamaSizes,
    TokenIds,
};
use crate::error::Result;
use crate::transformer::moe::MoeRouting;
use crate::transformer::BlockConfig;

fn default_eps() -> f64 {
    1e-6
}

fn default_max_positions() -> usize {
    16_384
}

fn default_one() -> f64 {
    1.0
}

fn default_sigmoid() -> String {
    "sigmoid".into()
}

/// The keys of a LLaDA2.0 `config.json`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Llada2Config {
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Width of the dense layers' MLP.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Width of one head (its own key; `hidden_size / num_attention_heads` when absent).
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "crate::config::default_silu")]
    pub hidden_act: String,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "crate::config::default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// RoPE rotates the first `head_dim · partial_rotary_factor` dims of every head.
    #[serde(default = "default_one")]
    pub partial_rotary_factor: f64,
    #[serde(default)]
    pub use_qk_norm: bool,
    #[serde(default)]
    pub use_qkv_bias: bool,
    #[serde(default)]
    pub use_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Layers below this index are dense, the rest mixture-of-experts.
    #[serde(default)]
    pub first_k_dense_replace: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    /// Width of every routed expert and of each shared expert.
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub num_shared_experts: usize,
    #[serde(default = "default_one_usize")]
    pub n_group: usize,
    #[serde(default = "default_one_usize")]
    pub topk_group: usize,
    #[serde(default = "default_one")]
    pub routed_scaling_factor: f64,
    #[serde(default = "default_sigmoid")]
    pub score_function: String,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub mask_token_id: Option<u32>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
}

fn default_one_usize() -> usize {
    1
}

impl Llada2Config {
    /// Parses and validates a `config.json` document.
    pub fn from_json(json: &str) -> Result<Self> {
        let cfg: Self = parse_json("config.json", json)?;
        cfg.validate().map_err(in_file("config.json"))?;
        Ok(cfg)
    }

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
                head_dim: self.head_dim,
                rms_norm_eps: self.rms_norm_eps,
                rope_theta: self.rope_theta,
            },
        )?;
        // The sliding-window keys are ignored upstream (Q7): never applied there either.
        check_plain_llama_options(&self.hidden_act, self.rope_scaling.as_ref(), false)?;
        if self.score_function != "sigmoid" {
            return bad(
                "score_function",
                format!(
                    "only `sigmoid` is implemented (upstream hard-codes it), got `{}`",
                    self.score_function
                ),
            );
        }
        if self.use_bias || self.use_qkv_bias {
            return bad(
                "use_qkv_bias",
                "biases on the projections are not implemented (LLaDA2.0 has none)".into(),
            );
        }
        let rot = self.rotary_dim();
        if rot == 0 || !rot.is_multiple_of(2) || rot > self.head_dim() {
            return bad(
                "partial_rotary_factor",
                format!(
                    "{} of a {}-dim head gives {rot} rotary dims; they must be even and at \
                     least 2",
                    self.partial_rotary_factor,
                    self.head_dim()
                ),
            );
        }
        if self.moe_intermediate_size == 0 || self.moe_intermediate_size > crate::config::MAX_WIDTH
        {
            return bad(
                "moe_intermediate_size",
                format!("{} is out of range", self.moe_intermediate_size),
            );
        }
        if self.num_experts > 4096 {
            return bad(
                "num_experts",
                format!("{} is out of range", self.num_experts),
            );
        }
        self.routing().validate()?;
        self.block_config().validate()?;
        check_rope(
            file,
            "max_position_embeddings",
            self.max_position_embeddings,
            rot,
        )?;
        for (key, id) in [
            ("mask_token_id", self.mask_token_id),
            ("pad_token_id", self.pad_token_id),
        ] {
            if let Some(id) = id {
                if id as usize >= self.vocab_size {
                    return bad(
                        key,
                        format!("{id} outside the vocabulary of {}", self.vocab_size),
                    );
                }
            }
        }
        Ok(())
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Dims of a head RoPE rotates: `int(head_dim · partial_rotary_factor)`.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim() as f64 * self.partial_rotary_factor) as usize
    }

    /// End-of-sequence ids named by the config (none in the real one).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map_or_else(Vec::new, TokenIds::to_vec)
    }

    /// Whether layer `l` is a mixture of experts.
    pub fn is_moe(&self, l: usize) -> bool {
        l >= self.first_k_dense_replace
    }

    pub fn routing(&self) -> MoeRouting {
        MoeRouting {
            n_experts: self.num_experts,
            top_k: self.num_experts_per_tok,
            n_group: self.n_group,
            topk_group: self.topk_group,
            routed_scaling_factor: self.routed_scaling_factor as f32,
        }
    }

    /// The shared block's config (the dense layers' MLP width).
    pub fn block_config(&self) -> BlockConfig {
        BlockConfig {
            hidden_size: self.hidden_size,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.kv_heads(),
            head_dim: self.head_dim(),
            intermediate_size: self.intermediate_size,
            norm_eps: self.rms_norm_eps,
            qkv_bias: false,
            out_bias: false,
            mlp_bias: false,
            qk_norm: self.use_qk_norm,
        }
    }

    /// GEMM FLOPs of one forward of `queries` rows over `keys` keys (attention, the dense
    /// layers' MLP, and per MoE layer the routed and shared experts a row runs and its router).
    pub fn algorithmic_flops(&self, queries: u64, keys: u64) -> u64 {
        let d = self.hidden_size as u64;
        let (h, hkv, dh) = (
            self.num_attention_heads as u64,
            self.kv_heads() as u64,
            self.head_dim() as u64,
        );
        let attn = 4 * h * queries * keys * dh
            + 2 * queries * d * (h + 2 * hkv) * dh
            + 2 * queries * h * dh * d;
        let dense = 6 * queries * d * self.intermediate_size as u64;
        let experts = (self.num_experts_per_tok + self.num_shared_experts) as u64;
        let moe = 6 * queries * d * self.moe_intermediate_size as u64 * experts
            + 2 * queries * d * self.num_experts as u64;
        (0..self.num_hidden_layers)
            .map(|l| attn + if self.is_moe(l) { moe } else { dense })
            .sum()
    }

    /// Every checkpoint tensor with its shape, as `LLaDA2MoeModelLM` names them.
    pub fn checkpoint_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (e, v, d) = (self.hidden_size, self.vocab_size, self.head_dim());
        let (h, hkv) = (self.num_attention_heads, self.kv_heads());
        let mut out = vec![("model.word_embeddings.weight".to_owned(), vec![v, e])];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            out.push((format!("{p}.input_layernorm.weight"), vec![e]));
            out.push((format!("{p}.post_attention_layernorm.weight"), vec![e]));
            out.push((
                format!("{p}.attention.query_key_value.weight"),
                vec![(h + 2 * hkv) * d, e],
            ));
            out.push((format!("{p}.attention.dense.weight"), vec![e, h * d]));
            if self.use_qk_norm {
                out.push((format!("{p}.attention.query_layernorm.weight"), vec![d]));
                out.push((format!("{p}.attention.key_layernorm.weight"), vec![d]));
            }
            let mlp = |out: &mut Vec<(String, Vec<usize>)>, prefix: String, i: usize| {
                out.push((format!("{prefix}.gate_proj.weight"), vec![i, e]));
                out.push((format!("{prefix}.up_proj.weight"), vec![i, e]));
                out.push((format!("{prefix}.down_proj.weight"), vec![e, i]));
            };
            if self.is_moe(l) {
                let i = self.moe_intermediate_size;
                out.push((format!("{p}.mlp.gate.weight"), vec![self.num_experts, e]));
                out.push((format!("{p}.mlp.gate.expert_bias"), vec![self.num_experts]));
                for x in 0..self.num_experts {
                    mlp(&mut out, format!("{p}.mlp.experts.{x}"), i);
                }
                if self.num_shared_experts > 0 {
                    mlp(
                        &mut out,
                        format!("{p}.mlp.shared_experts"),
                        i * self.num_shared_experts,
                    );
                }
            } else {
                mlp(&mut out, format!("{p}.mlp"), self.intermediate_size);
            }
        }
        out.push(("model.norm.weight".to_owned(), vec![e]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_owned(), vec![v, e]));
        }
        out
    }
}
