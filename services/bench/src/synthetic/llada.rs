//! A LLaDA-shaped model with random weights, for timing without a checkpoint.
//!
//! The config is GSAI-ML/LLaDA-8B-Instruct's `config.json` (Nie et al., 2025, "Large Language
//! Diffusion Models") with the sizes changed. Weights are drawn uniformly with the standard
//! deviations of upstream's "mitchell" init (`1 / sqrt(d_model)` for the input projections and
//! the embedding, `1 / sqrt(2 · d · (layer + 1))` for the output projections, norm gains 1),
//! then, as in the tiny test fixture, q/k are scaled by `qk_scale` and the output head by
//! `head_scale` so that posteriors are peaked: WINO then drafts in parallel and revokes, and
//! SureLock sees posteriors settle. How often either happens with these weights says nothing
//! about the trained LLaDA-8B.

use crate::weights::{uniform_with_std, var_builder_init, Init};
use rand::rngs::StdRng;
use rand::SeedableRng;
use wavefront_models::candle_core::{DType, Device};
use wavefront_models::{Llada, LladaConfig};
use wavefront_schemes::SchemeError;

/// Sizes of the synthetic model.
#[derive(Debug, Clone)]
pub struct Shape {
    pub d_model: usize,
    pub n_heads: usize,
    pub n_layers: usize,
    pub mlp_hidden_size: usize,
    pub vocab_size: usize,
    pub max_sequence_length: usize,
}

impl Shape {
    /// The `config.json` a checkpoint of this shape would carry (mask id: the last row).
    pub fn config(&self) -> anyhow::Result<LladaConfig> {
        Ok(LladaConfig::from_json(&self.config_json().to_string())?)
    }

    /// That `config.json` as JSON.
    pub fn config_json(&self) -> serde_json::Value {
        serde_json::json!({
            "model_type": "llada",
            "architectures": ["LLaDAModelLM"],
            "activation_type": "silu",
            "alibi": false,
            "attention_layer_norm": false,
            "block_type": "llama",
            "block_group_size": 1,
            "bias_for_layer_norm": false,
            "d_model": self.d_model,
            "embedding_size": self.vocab_size,
            // No end-of-sequence token: every request decodes all of gen_length, so schemes
            // compare on equal work.
            "eos_token_id": null,
            "include_bias": false,
            "include_qkv_bias": false,
            "input_emb_norm": false,
            "layer_norm_type": "rms",
            "layer_norm_with_affine": true,
            "mask_token_id": self.vocab_size - 1,
            "max_sequence_length": self.max_sequence_length,
            "mlp_hidden_size": self.mlp_hidden_size,
            "mlp_ratio": 4,
            "multi_query_attention": null,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_heads,
            "n_layers": self.n_layers,
            "pad_token_id": null,
            "rms_norm_eps": 1e-5,
            "rope": true,
            "rope_full_precision": true,
            "rope_theta": 500000.0,
            "scale_logits": false,
            "vocab_size": self.vocab_size,
            "weight_tying": false,
        })
    }
}

/// The values of every checkpoint tensor (called in `cfg.checkpoint_tensors()` order), drawn
/// from `seed`: what [`random_model`] loads.
pub fn weights(
    cfg: &LladaConfig,
    seed: u64,
    qk_scale: f64,
    head_scale: f64,
) -> impl FnMut(&str, &[usize]) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rule = init_rule(cfg, qk_scale, head_scale);
    move |name, shape| {
        let n = shape.iter().product();
        match rule(name, shape) {
            Init::Const(c) => vec![c; n],
            Init::Uniform(std) => uniform_with_std(&mut rng, n, std),
        }
    }
}

/// How each checkpoint tensor is filled (what [`weights`] draws, and [`random_model`] on a GPU
/// draws on the device).
fn init_rule(
    cfg: &LladaConfig,
    qk_scale: f64,
    head_scale: f64,
) -> impl FnMut(&str, &[usize]) -> Init {
    let d = cfg.d_model as f64;
    move |name, _| {
        if name.ends_with("norm.weight") || name.ends_with("ln_f.weight") {
            Init::Const(1.0)
        } else {
            let layer = name
                .split('.')
                .nth(3)
                .and_then(|l| l.parse::<f64>().ok())
                .unwrap_or(0.0);
            let std = if name.ends_with("attn_out.weight")
                || name.contains(".ff_out.weight") && name.contains("blocks")
            {
                1.0 / (2.0 * d * (layer + 1.0)).sqrt()
            } else {
                1.0 / d.sqrt()
            };
            let scale = if name.ends_with("q_proj.weight") || name.ends_with("k_proj.weight") {
                qk_scale
            } else if name == "model.transformer.ff_out.weight" {
                head_scale
            } else {
                1.0
            };
            Init::Uniform(std * scale)
        }
    }
}

/// Builds the model with weights drawn from `seed` on `device` in `dtype`.
pub fn random_model(
    cfg: &LladaConfig,
    seed: u64,
    qk_scale: f64,
    head_scale: f64,
    device: &Device,
    dtype: DType,
) -> Result<Llada, SchemeError> {
    let vb = var_builder_init(
        cfg.checkpoint_tensors(),
        device,
        dtype,
        &mut StdRng::seed_from_u64(seed),
        init_rule(cfg, qk_scale, head_scale),
    )?;
    Ok(Llada::load(vb, cfg.clone())?)
}
