//! An ARMT with random weights in the upstream checkpoint layout, for timing without a
//! checkpoint.
//!
//! The backbone config is a Llama `config.json` with the sizes changed; the ARMT settings use
//! upstream's names. Weights are uniform with standard deviation `1 / sqrt(fan-in)` (embeddings
//! and memory tokens 1, norm gains 1, `W_mb.bias` 0). Upstream zero-initialises `W_mv`, which
//! would keep every memory at zero; here it is random like the rest, so reads and writes do
//! real work. The timings say nothing about a trained model's outputs.

use crate::weights::{var_builder_init, Init};
use rand::rngs::StdRng;
use rand::SeedableRng;
use wavefront_models::armt::{Armt, ArmtConfig};
use wavefront_models::candle_core::{DType, Device};
use wavefront_schemes::SchemeError;

/// Sizes of the synthetic model.
#[derive(Debug, Clone)]
pub struct Shape {
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub segment_size: usize,
    pub num_mem_tokens: usize,
    pub d_mem: usize,
    pub max_position_embeddings: usize,
}

impl Shape {
    /// `config.json` and `armt_config.json` of a checkpoint of this shape.
    pub fn config(&self) -> anyhow::Result<ArmtConfig> {
        let llama = serde_json::json!({
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": null,
            "tie_word_embeddings": false,
            "hidden_act": "silu",
        });
        let armt = serde_json::json!({
            "segment_size": self.segment_size,
            "num_mem_tokens": self.num_mem_tokens,
            "d_mem": self.d_mem,
            "layers_attr": "model.layers",
            "wrap_pos": false,
            "correction": true,
            "segment_alignment": "left",
            "k2": -1,
        });
        Ok(ArmtConfig::from_json(
            &llama.to_string(),
            &armt.to_string(),
        )?)
    }
}

/// The model with random weights drawn from `seed`, in `dtype` on `device`.
pub fn random_model(
    cfg: &ArmtConfig,
    seed: u64,
    device: &Device,
    dtype: DType,
) -> Result<Armt, SchemeError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let vb = var_builder_init(
        cfg.checkpoint_tensors(),
        device,
        dtype,
        &mut rng,
        |name, shape| {
            if name.ends_with("norm.weight") {
                Init::Const(1.0)
            } else if name.ends_with("W_mb.bias") {
                Init::Const(0.0)
            } else if name.contains("embed_tokens") || name.ends_with("memory") {
                Init::Uniform(1.0)
            } else {
                Init::Uniform(1.0 / (shape[1] as f64).sqrt())
            }
        },
    )?;
    Ok(Armt::load(vb, cfg.clone())?)
}
