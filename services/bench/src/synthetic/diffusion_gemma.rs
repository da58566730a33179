//! A DiffusionGemma-shaped model (Gemma 4 mixture of experts as encoder and denoiser) with
//! random weights, for timing without a checkpoint.
//!
//! The config is the real `config.json`'s key set with the sizes changed (by default a reduced
//! shape; `Shape::real` is google/diffusiongemma-26B-A4B-it's). Weights are drawn uniformly with
//! standard deviation `1 / sqrt(fan_in)`, norm gains and scalars 1; the embedding (which is also
//! the head) is scaled by `head_scale` so that posteriors are peaked. On a GPU the weights are
//! drawn on the device (the real shape's 26 billion parameters never pass through the host). How many positions a step
//! accepts with these weights says nothing about the trained model: benchmarks fix the number of
//! denoising steps so their times compare.

use crate::weights::{var_builder_init, Init};
use rand::rngs::StdRng;
use rand::SeedableRng;
use wavefront_models::candle_core::{DType, Device};
use wavefront_models::{DiffusionGemma, DiffusionGemmaConfig};
use wavefront_schemes::SchemeError;

/// Sizes of the synthetic model.
#[derive(Debug, Clone)]
pub struct Shape {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_experts: usize,
    pub top_k_experts: usize,
    /// Layers, every `full_every`-th of them full attention (the real model: 30, every 6th).
    pub num_hidden_layers: usize,
    pub full_every: usize,
    pub num_attention_heads: usize,
    pub head_dim: usize,
    pub num_key_value_heads: usize,
    pub global_head_dim: usize,
    pub num_global_key_value_heads: usize,
    pub sliding_window: usize,
    pub vocab_size: usize,
    pub canvas_length: usize,
}

impl Shape {
    /// google/diffusiongemma-26B-A4B-it's text model.
    pub fn real() -> Self {
        Self {
            hidden_size: 2816,
            intermediate_size: 2112,
            moe_intermediate_size: 704,
            num_experts: 128,
            top_k_experts: 8,
            num_hidden_layers: 30,
            full_every: 6,
            num_attention_heads: 16,
            head_dim: 256,
            num_key_value_heads: 8,
            global_head_dim: 512,
            num_global_key_value_heads: 2,
            sliding_window: 1024,
            vocab_size: 262_144,
            canvas_length: 256,
        }
    }

    /// The `config.json` a checkpoint of this shape would carry (no end-of-sequence id a random
    /// model would produce: every request decodes all its canvases).
    pub fn config(&self) -> anyhow::Result<DiffusionGemmaConfig> {
        let layer_types: Vec<&str> = (0..self.num_hidden_layers)
            .map(|l| {
                if (l + 1) % self.full_every.max(1) == 0 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect();
        let json = serde_json::json!({
            "architectures": ["DiffusionGemmaForBlockDiffusion"],
            "model_type": "diffusion_gemma",
            "canvas_length": self.canvas_length,
            "eos_token_id": [self.vocab_size + 1],
            "tie_word_embeddings": true,
            "text_config": {
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "moe_intermediate_size": self.moe_intermediate_size,
                "num_experts": self.num_experts,
                "top_k_experts": self.top_k_experts,
                "num_hidden_layers": self.num_hidden_layers,
                "layer_types": layer_types,
                "num_attention_heads": self.num_attention_heads,
                "head_dim": self.head_dim,
                "num_key_value_heads": self.num_key_value_heads,
                "global_head_dim": self.global_head_dim,
                "num_global_key_value_heads": self.num_global_key_value_heads,
                "sliding_window": self.sliding_window,
                "vocab_size": self.vocab_size,
                "max_position_embeddings": 32768,
                "rope_parameters": {
                    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                                       "rope_type": "proportional"},
                    "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}
                },
                "final_logit_softcapping": 30.0,
                "hidden_activation": "gelu_pytorch_tanh",
                "rms_norm_eps": 1e-6,
            }
        });
        Ok(DiffusionGemmaConfig::from_json(&json.to_string())?)
    }
}

/// Builds the model with weights drawn from `seed` on `device` in `dtype`.
pub fn random_model(
    cfg: &DiffusionGemmaConfig,
    seed: u64,
    head_scale: f64,
    device: &Device,
    dtype: DType,
) -> Result<DiffusionGemma, SchemeError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let vb = var_builder_init(
        cfg.checkpoint_tensors(),
        device,
        dtype,
        &mut rng,
        |name, shape| {
            let ones = name.ends_with("norm.weight")
                || name.ends_with("layernorm.weight")
                || name.ends_with("layernorm_1.weight")
                || name.ends_with("layernorm_2.weight")
                || name.ends_with("layer_scalar")
                || name.ends_with("router.scale")
                || name.ends_with("per_expert_scale");
            if ones {
                Init::Const(1.0)
            } else {
                let fan_in = *shape.last().unwrap_or(&1) as f64;
                let scale = if name.ends_with("embed_tokens.weight") {
                    head_scale
                } else {
                    1.0
                };
                Init::Uniform(scale / fan_in.sqrt())
            }
        },
    )?;
    Ok(DiffusionGemma::load(vb, cfg.clone())?)
}
