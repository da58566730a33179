//! A Huginn-shaped model with random weights, for timing without a checkpoint.
//!
//! The config is huginn-0125's (prelude / core / coda = 2 / 4 / 2, sandwich blocks, tied
//! embeddings, q/k bias, `mean_recurrence` 32) at a chosen width. Weights follow the spirit of
//! upstream's "takase" init, drawn uniformly with the same standard deviations (cheaper than
//! normals, same variance): `std = sqrt(2 / (5 · n_embd))` for embeddings, qkv, MLP input and
//! adapter; `std / sqrt(2 · effective depth)` for the attention and MLP output projections; norm
//! gains 1; q/k biases `0.1 · std`. With these weights the recurrence contracts, as in the tiny
//! fixture checkpoint, so adaptive exits and diffusion freezes happen, but how quickly they
//! happen says nothing about a trained model.

use crate::weights::{var_builder_init, Init};
use rand::rngs::StdRng;
use rand::SeedableRng;
use wavefront_models::candle_core::{DType, Device};
use wavefront_models::{Huginn, HuginnConfig};
use wavefront_schemes::SchemeError;

/// Sizes of the synthetic model.
#[derive(Debug, Clone)]
pub struct Shape {
    pub n_embd: usize,
    pub n_heads: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub prelude: usize,
    pub core: usize,
    pub coda: usize,
    pub mean_recurrence: usize,
}

impl Shape {
    /// The `config.json` a checkpoint of this shape would carry.
    pub fn config(&self) -> anyhow::Result<HuginnConfig> {
        let std = (2.0 / (5.0 * self.n_embd as f64)).sqrt();
        let json = serde_json::json!({
            "model_type": "huginn_raven",
            "architectures": ["RavenForCausalLM"],
            "n_embd": self.n_embd,
            "n_heads": self.n_heads,
            "num_key_value_heads": self.n_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "padded_vocab_size": self.vocab_size,
            "n_layers_in_prelude": self.prelude,
            "n_layers_in_recurrent_block": self.core,
            "n_layers_in_coda": self.coda,
            "norm_eps": 1e-6,
            "rope_base": 50000.0,
            "block_size": 8192,
            "tie_embeddings": true,
            "qk_bias": true,
            "bias": false,
            "mean_recurrence": self.mean_recurrence,
            "init_values": { "std": std },
            "test_time_noise": 0,
        });
        Ok(HuginnConfig::from_json(&json.to_string())?)
    }
}

/// Builds the model with weights drawn from `seed` on `device` in `dtype`.
pub fn random_model(
    cfg: &HuginnConfig,
    seed: u64,
    device: &Device,
    dtype: DType,
) -> Result<Huginn, SchemeError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let std = cfg.init_values.std;
    let depth = cfg.n_layers_in_prelude
        + cfg.n_layers_in_recurrent_block * cfg.mean_recurrence
        + cfg.n_layers_in_coda;
    let out_std = std / (2.0 * depth as f64).sqrt();
    let vb = var_builder_init(
        cfg.checkpoint_tensors(),
        device,
        dtype,
        &mut rng,
        |name, _| {
            if name.contains("norm") || name.ends_with("ln_f.weight") {
                Init::Const(1.0)
            } else {
                let s = if name.ends_with("attn.proj.weight") || name.ends_with("mlp.proj.weight") {
                    out_std
                } else if name.ends_with("qk_bias") {
                    0.1 * std
                } else {
                    std
                };
                Init::Uniform(s)
            }
        },
    )?;
    Ok(Huginn::load(vb, cfg.clone())?)
}
