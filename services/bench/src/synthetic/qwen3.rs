//! A ReFusion-shaped (Qwen3) model with random weights, for timing without a checkpoint.
//!
//! The config is Qwen3-8B's `config.json` as ReFusion's `train.py` saves it (Li et al., 2025,
//! "ReFusion": `mask_token_id` added) with the sizes changed. Weights are drawn uniformly with
//! standard deviation `1 / sqrt(hidden)` for the embedding and input projections and
//! `1 / sqrt(2 · hidden · (layer + 1))` for the output projections, norm gains 1; q/k are scaled
//! by `qk_scale` and the output head by `head_scale` so that distributions are peaked and
//! planning confidences cross the thresholds. How often slots are selected and drafts verified
//! with these weights says nothing about the trained ReFusion.

use crate::weights::{tensors_init, uniform, Init};
use rand::rngs::StdRng;
use rand::SeedableRng;
use wavefront_models::candle_core::Tensor;
use wavefront_models::candle_core::{DType, Device};
use wavefront_models::candle_nn::VarBuilder;
use wavefront_models::{Qwen3, Qwen3Config};
use wavefront_schemes::SchemeError;

/// Sizes of the synthetic model.
#[derive(Debug, Clone)]
pub struct Shape {
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
}

impl Shape {
    /// The `config.json` a checkpoint of this shape would carry (mask id: the last row; no
    /// end-of-sequence token, so every request decodes all of `gen_length` and the schemes
    /// compare on equal work).
    pub fn config(&self) -> anyhow::Result<Qwen3Config> {
        let json = serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": self.vocab_size - 2,
            "eos_token_id": null,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "mask_token_id": self.vocab_size - 1,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": 1e-6,
            "rope_scaling": null,
            "rope_theta": 1_000_000.0,
            "sliding_window": null,
            "tie_word_embeddings": false,
            "use_cache": false,
            "use_sliding_window": false,
            "vocab_size": self.vocab_size,
        });
        Ok(Qwen3Config::from_json(&json.to_string())?)
    }
}

/// Builds the model with weights drawn from `seed` on `device` in `dtype`.
///
/// `consensus` > 0 adds `consensus · u` to every embedding row and aligns the head row of
/// token 0 with the same random direction `u`: every position then leans towards predicting
/// token 0 whatever its input, so planning drafts and autoregressive verification agree (the
/// regime of a model whose drafts verify). 0 leaves the weights fully random (drafts and
/// verification almost never agree).
pub fn random_model(
    cfg: &Qwen3Config,
    seed: u64,
    qk_scale: f64,
    head_scale: f64,
    consensus: f64,
    device: &Device,
    dtype: DType,
) -> Result<Qwen3, SchemeError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let d = cfg.hidden_size as f64;
    let a = (3.0 / d).sqrt() as f32;
    let direction = uniform(&mut rng, cfg.hidden_size, a);
    let mut t = tensors_init(
        cfg.checkpoint_tensors(),
        device,
        dtype,
        &mut rng,
        |name, _| {
            if name.ends_with("norm.weight") {
                Init::Const(1.0)
            } else {
                let layer = name
                    .split('.')
                    .nth(2)
                    .and_then(|l| l.parse::<f64>().ok())
                    .unwrap_or(0.0);
                let std = if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                    1.0 / (2.0 * d * (layer + 1.0)).sqrt()
                } else {
                    1.0 / d.sqrt()
                };
                let scale = if name.ends_with("q_proj.weight") || name.ends_with("k_proj.weight") {
                    qk_scale
                } else if name == "lm_head.weight" {
                    head_scale
                } else {
                    1.0
                };
                Init::Uniform(std * scale)
            }
        },
    )?;
    if consensus > 0.0 {
        let u = Tensor::from_vec(direction, (1, cfg.hidden_size), device)?.to_dtype(dtype)?;
        let embed = "model.embed_tokens.weight";
        if let Some(w) = t.remove(embed) {
            t.insert(embed.to_owned(), w.broadcast_add(&(&u * consensus)?)?);
        }
        if let Some(w) = t.remove("lm_head.weight") {
            let rest = w.narrow(0, 1, w.dim(0)? - 1)?;
            let first = (&u * (head_scale * d.sqrt()))?;
            t.insert(
                "lm_head.weight".to_owned(),
                Tensor::cat(&[&first, &rest], 0)?,
            );
        }
    }
    let vb = VarBuilder::from_tensors(t, dtype, device);
    Ok(Qwen3::load(vb, cfg.clone())?)
}
