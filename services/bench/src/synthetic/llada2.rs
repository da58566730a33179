//! A LLaDA2.0-shaped (mixture-of-experts) model with random weights, for timing without a
//! checkpoint.
//!
//! The config is LLaDA2.0-mini's key set with the sizes changed. Weights are drawn uniformly
//! with standard deviation `1 / sqrt(fan_in)`, norm gains 1, router biases 0; the output head is
//! scaled by `head_scale` so that posteriors are peaked and confidences cross the thresholds.
//! How many tokens a step commits with these weights says nothing about the trained model.

use crate::weights::{var_builder_init, Init};
use rand::rngs::StdRng;
use rand::SeedableRng;
use wavefront_models::candle_core::{DType, Device};
use wavefront_models::{Llada2, Llada2Config};
use wavefront_schemes::SchemeError;

/// Sizes of the synthetic model.
#[derive(Debug, Clone)]
pub struct Shape {
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub vocab_size: usize,
}

impl Shape {
    /// The `config.json` a checkpoint of this shape would carry (mask id: the last row; no
    /// end-of-sequence token, so every request decodes all of `gen_length`).
    pub fn config(&self) -> anyhow::Result<Llada2Config> {
        let json = serde_json::json!({
            "architectures": ["LLaDA2MoeModelLM"],
            "first_k_dense_replace": 1,
            "head_dim": self.hidden_size / self.num_attention_heads,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "mask_token_id": self.vocab_size - 1,
            "max_position_embeddings": 16384,
            "model_type": "llada2_moe",
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_group": self.n_group,
            "num_attention_heads": self.num_attention_heads,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_shared_experts": 1,
            "partial_rotary_factor": 0.5,
            "rms_norm_eps": 1e-6,
            "rope_scaling": null,
            "rope_theta": 600000,
            "routed_scaling_factor": 2.5,
            "score_function": "sigmoid",
            "tie_word_embeddings": false,
            "topk_group": self.topk_group,
            "use_qk_norm": true,
            "vocab_size": self.vocab_size,
        });
        Ok(Llada2Config::from_json(&json.to_string())?)
    }
}

/// Builds the model with weights drawn from `seed` on `device` in `dtype`.
pub fn random_model(
    cfg: &Llada2Config,
    seed: u64,
    head_scale: f64,
    device: &Device,
    dtype: DType,
) -> Result<Llada2, SchemeError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let vb = var_builder_init(
        cfg.checkpoint_tensors(),
        device,
        dtype,
        &mut rng,
        |name, shape| {
            if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
                Init::Const(1.0)
            } else if name.ends_with("expert_bias") {
                Init::Const(0.0)
            } else {
                let fan_in = *shape.last().unwrap_or(&1) as f64;
                let scale = if name == "lm_head.weight" {
                    head_scale
                } else {
                    1.0
                };
                Init::Uniform(scale / fan_in.sqrt())
            }
        },
    )?;
    Ok(Llada2::load(vb, cfg.clone())?)
}
