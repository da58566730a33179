//! The two settings files of an upstream ARMT checkpoint directory.
//!
//! * `config.json`: the backbone's Hugging Face `LlamaConfig` ([`LlamaConfig`]).
//! * `armt_config.json`: the hyper-parameters upstream passes as script arguments to
//!   `AssociativeMemoryCell` / `AssociativeRecurrentWrapper`, under their upstream names
//!   ([`ArmtSettings`]: `segment_size`, `num_mem_tokens`, `d_mem`, `wrap_pos`, `correction`,
//!   `segment_alignment`, `k2`, `layers_attr`) plus the constants upstream hard-codes
//!   (`_hardcoded`: DPFP with `nu`, eps, ...).
//!
//! Every option value this implementation does not compute is rejected with the key to blame, so
//! a checkpoint either loads with upstream's numerics or fails at start-up.

use serde::Deserialize;
use serde_json::Value;

use crate::config::{
    bad, check_llama_sizes, check_rope, check_size, in_file, parse_json, LlamaSizes, TokenIds,
    MAX_POSITIONS, MAX_WIDTH,
};
use crate::error::{ModelError, Result};
use crate::transformer::{BlockConfig, BlockNames, RopeTable};

fn default_eps() -> f64 {
    1e-6
}

fn default_max_positions() -> usize {
    2048
}

/// The keys of the backbone's `config.json` (transformers' `LlamaConfig`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct LlamaConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// `num_attention_heads` when absent.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// `hidden_size / num_attention_heads` when absent.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "crate::config::default_rope_theta")]
    pub rope_theta: f64,
    /// `null`, or `{"rope_type": "llama3", ...}` (Llama 3.1 / 3.2).
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// Sizes the RoPE table: positions within one segment (memory tokens included) and of the
    /// generation after the context.
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "crate::config::default_silu")]
    pub hidden_act: String,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub bos_token_id: Option<Value>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
}

/// `armt_config.json`: upstream ARMT's hyper-parameters under their upstream names.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ArmtSettings {
    /// Real tokens per segment; memory tokens are not counted.
    pub segment_size: usize,
    /// Memory tokens appended to every segment (M).
    pub num_mem_tokens: usize,
    /// Width of the memory key/query projections; `d_key = 2 · nu · d_mem` after DPFP.
    pub d_mem: usize,
    /// Where upstream found the decoder layers (`model.layers`, or `model.model.layers` under
    /// LoRA); informational, both checkpoint prefixes are accepted.
    #[serde(default)]
    pub layers_attr: Option<String>,
    /// Must be false for Llama (true rewires GPT-2's `wpe`).
    #[serde(default)]
    pub wrap_pos: bool,
    /// Gamma correction of the normaliser update (upstream default true).
    #[serde(default = "crate::config::default_true")]
    pub correction: bool,
    /// `left` (or absent): segments are cut from the start, the last one may be shorter.
    #[serde(default)]
    pub segment_alignment: Option<String>,
    /// A BPTT setting, unused at inference.
    #[serde(default)]
    pub k2: Option<i64>,
    /// Constants upstream hard-codes in `AssociativeLayerWrapper`.
    #[serde(default, rename = "_hardcoded")]
    pub hardcoded: Option<Value>,
}

/// An ARMT: the Llama backbone's config and the memory's settings, validated together.
#[derive(Debug, Clone, PartialEq)]
pub struct ArmtConfig {
    pub llama: LlamaConfig,
    pub armt: ArmtSettings,
    /// DPFP's `nu` (upstream: 3).
    pub nu: usize,
    /// The eps of every memory denominator (upstream: 1e-5).
    pub mem_eps: f64,
}

impl ArmtConfig {
    /// Parses and validates `config.json` and `armt_config.json`.
    pub fn from_json(config_json: &str, armt_json: &str) -> Result<Self> {
        let llama: LlamaConfig = parse_json("config.json", config_json)?;
        let armt: ArmtSettings = parse_json(crate::files::ARMT_CONFIG, armt_json)?;
        let (nu, mem_eps) =
            hardcoded(armt.hardcoded.as_ref()).map_err(in_file(crate::files::ARMT_CONFIG))?;
        let cfg = Self {
            llama,
            armt,
            nu,
            mem_eps,
        };
        cfg.validate().map_err(|e| {
            // Name the file the blamed key lives in.
            let armt_key = matches!(&e, ModelError::Config { key, .. }
                if ARMT_KEYS.contains(&key.as_str()) || key.starts_with("_hardcoded"));
            in_file(if armt_key {
                crate::files::ARMT_CONFIG
            } else {
                "config.json"
            })(e)
        })?;
        Ok(cfg)
    }

    /// Rejects option values this implementation does not compute.
    pub fn validate(&self) -> Result<()> {
        let l = &self.llama;
        // Sizes first, so nothing below is computed from (or allocated for) a lying value.
        check_llama_sizes(
            "config.json",
            LlamaSizes {
                vocab_size: l.vocab_size,
                hidden_size: l.hidden_size,
                intermediate_size: l.intermediate_size,
                num_hidden_layers: l.num_hidden_layers,
                num_attention_heads: l.num_attention_heads,
                num_key_value_heads: l.num_key_value_heads,
                head_dim: l.head_dim,
                rms_norm_eps: l.rms_norm_eps,
                rope_theta: l.rope_theta,
            },
        )?;
        let a = &self.armt;
        let file = crate::files::ARMT_CONFIG;
        check_size(file, "segment_size", a.segment_size, 1, MAX_POSITIONS)?;
        check_size(file, "num_mem_tokens", a.num_mem_tokens, 1, MAX_POSITIONS)?;
        check_size(file, "d_mem", a.d_mem, 1, MAX_WIDTH)?;
        if let Some(t) = l.model_type.as_deref() {
            if t != "llama" {
                return bad(
                    "model_type",
                    format!("the ARMT backbone must be `llama`, got `{t}`"),
                );
            }
        }
        if l.head_dim.is_none() && !l.hidden_size.is_multiple_of(l.num_attention_heads) {
            return bad(
                "num_attention_heads",
                format!(
                    "{} heads do not divide hidden_size {}",
                    l.num_attention_heads, l.hidden_size
                ),
            );
        }
        if l.hidden_act != "silu" {
            return bad("hidden_act", "only `silu` is implemented".into());
        }
        if l.attention_bias {
            return bad(
                "attention_bias",
                "biased attention is not implemented".into(),
            );
        }
        if l.mlp_bias {
            return bad("mlp_bias", "a biased MLP is not implemented".into());
        }
        self.block_config().validate()?;
        check_rope(
            "config.json",
            "max_position_embeddings",
            l.max_position_embeddings,
            self.head_dim(),
        )?;
        // Fails on an unknown rope_scaling.
        self.inv_freq()?;
        if a.wrap_pos {
            return bad(
                "wrap_pos",
                "must be false for a Llama backbone (true rewires GPT-2's wpe)".into(),
            );
        }
        if let Some(align) = a.segment_alignment.as_deref() {
            if align != "left" {
                return bad(
                    "segment_alignment",
                    format!("only `left` (or null) is implemented, got `{align}`"),
                );
            }
        }
        if self.cell_rows() > l.max_position_embeddings {
            return bad(
                "max_position_embeddings",
                format!(
                    "a segment with its memory tokens has {} positions but the backbone has {}",
                    self.cell_rows(),
                    l.max_position_embeddings
                ),
            );
        }
        Ok(())
    }

    pub fn n_layers(&self) -> usize {
        self.llama.num_hidden_layers
    }

    pub fn hidden_size(&self) -> usize {
        self.llama.hidden_size
    }

    pub fn vocab_size(&self) -> usize {
        self.llama.vocab_size
    }

    pub fn kv_heads(&self) -> usize {
        self.llama
            .num_key_value_heads
            .unwrap_or(self.llama.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.llama
            .head_dim
            .unwrap_or(self.llama.hidden_size / self.llama.num_attention_heads)
    }

    /// S: real tokens per segment.
    pub fn segment_size(&self) -> usize {
        self.armt.segment_size
    }

    /// M: memory tokens per segment.
    pub fn num_mem_tokens(&self) -> usize {
        self.armt.num_mem_tokens
    }

    pub fn d_mem(&self) -> usize {
        self.armt.d_mem
    }

    /// Width of phi's output: `2 · nu · d_mem`.
    pub fn d_key(&self) -> usize {
        2 * self.nu * self.armt.d_mem
    }

    /// Rows of a full segment with its memory tokens: `S + M`, the most any cell has.
    pub fn cell_rows(&self) -> usize {
        self.armt.segment_size + self.armt.num_mem_tokens
    }

    /// The shared block's config for one backbone layer.
    pub fn block_config(&self) -> BlockConfig {
        BlockConfig {
            hidden_size: self.llama.hidden_size,
            n_heads: self.llama.num_attention_heads,
            n_kv_heads: self.kv_heads(),
            head_dim: self.head_dim(),
            intermediate_size: self.llama.intermediate_size,
            norm_eps: self.llama.rms_norm_eps,
            qkv_bias: false,
            out_bias: false,
            mlp_bias: false,
            qk_norm: false,
        }
    }

    /// The end-of-sequence ids of `config.json` (an id or a list).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.llama
            .eos_token_id
            .as_ref()
            .map_or_else(Vec::new, TokenIds::to_vec)
    }

    /// RoPE inverse frequencies (float32, as transformers computes them), with `llama3`
    /// scaling applied when `rope_scaling` asks for it.
    pub fn inv_freq(&self) -> Result<Vec<f32>> {
        let d = self.head_dim();
        let theta = self.llama.rope_theta as f32;
        let base: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / d as f32))
            .collect();
        let Some(scaling) = self.llama.rope_scaling.as_ref().filter(|v| !v.is_null()) else {
            return Ok(base);
        };
        let kind = scaling
            .get("rope_type")
            .or_else(|| scaling.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let num = |key: &str| -> Result<f32> {
            scaling
                .get(key)
                .and_then(Value::as_f64)
                .map(|v| v as f32)
                .ok_or_else(|| ModelError::Config {
                    key: format!("rope_scaling.{key}"),
                    reason: "missing or not a number".into(),
                })
        };
        match kind {
            "default" => Ok(base),
            "llama3" => Ok(llama3_inv_freq(
                &base,
                num("factor")?,
                num("low_freq_factor")?,
                num("high_freq_factor")?,
                num("original_max_position_embeddings")?,
            )),
            other => Err(ModelError::Config {
                key: "rope_scaling".into(),
                reason: format!("only `llama3` scaling is implemented, got `{other}`"),
            }),
        }
    }

    /// The RoPE table of the backbone (`max_position_embeddings` positions).
    pub fn rope_table(&self, device: &candle_core::Device) -> Result<RopeTable> {
        RopeTable::from_inv_freq(
            &self.inv_freq()?,
            self.llama.max_position_embeddings,
            device,
        )
    }

    /// Every checkpoint tensor with its shape, named as upstream's `safetensors.torch.save_model`
    /// writes them (layers under `memory_cell.layers.{i}`).
    pub fn checkpoint_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (d, v) = (self.hidden_size(), self.vocab_size());
        let block = self.block_config();
        let mut out = Vec::new();
        for l in 0..self.n_layers() {
            let p = format!("memory_cell.layers.{l}");
            out.push((format!("{p}.W_mb.bias"), vec![1]));
            out.push((format!("{p}.W_mb.weight"), vec![1, d]));
            out.push((format!("{p}.W_mk.weight"), vec![self.d_mem(), d]));
            out.push((format!("{p}.W_mq.weight"), vec![self.d_mem(), d]));
            out.push((format!("{p}.W_mv.weight"), vec![d, d]));
            out.extend(block.checkpoint_tensors(&format!("{p}.layer"), &BlockNames::LLAMA));
        }
        out.push(("memory_cell.memory".into(), vec![self.num_mem_tokens(), d]));
        out.push((
            "memory_cell.model.model.embed_tokens.weight".into(),
            vec![v, d],
        ));
        out.push(("memory_cell.model.model.norm.weight".into(), vec![d]));
        if !self.llama.tie_word_embeddings {
            out.push(("memory_cell.model.lm_head.weight".into(), vec![v, d]));
        }
        out
    }
}

/// The keys of `armt_config.json` [`ArmtConfig::validate`] may blame.
const ARMT_KEYS: [&str; 5] = [
    "segment_size",
    "num_mem_tokens",
    "d_mem",
    "wrap_pos",
    "segment_alignment",
];

/// The largest DPFP `nu` accepted: the memory is `2 · nu · d_mem` rows per layer.
const MAX_NU: u64 = 64;

/// `nu` and eps from `_hardcoded`, checking the constants this implementation relies on.
fn hardcoded(h: Option<&Value>) -> Result<(usize, f64)> {
    let Some(h) = h else {
        return Ok((3, 1e-5));
    };
    let bad = |key: &str, reason: &str| ModelError::Config {
        key: format!("_hardcoded.{key}"),
        reason: reason.into(),
    };
    if let Some(phi) = h.get("phi").and_then(Value::as_str) {
        if phi != "DPFP" {
            return Err(bad("phi", "only DPFP is implemented"));
        }
    }
    if h.get("use_denom").and_then(Value::as_bool) == Some(false) {
        return Err(bad("use_denom", "the normaliser z is always used"));
    }
    if h.get("gating").and_then(Value::as_bool) == Some(true) {
        return Err(bad("gating", "gated memory is not implemented"));
    }
    for key in ["W_mq_bias", "W_mk_bias", "W_mv_bias"] {
        if h.get(key).and_then(Value::as_bool) == Some(true) {
            return Err(bad(key, "only W_mb has a bias"));
        }
    }
    let nu = match h.get("nu") {
        None => 3,
        Some(v) => v
            .as_u64()
            .filter(|n| (1..=MAX_NU).contains(n))
            .ok_or_else(|| {
                bad(
                    "nu",
                    &format!("must be an integer in 1..={MAX_NU}, got {v}"),
                )
            })? as usize,
    };
    let eps = match h.get("eps") {
        None => 1e-5,
        Some(v) => v
            .as_f64()
            .filter(|e| *e > 0.0 && (*e as f32).is_finite())
            .ok_or_else(|| bad("eps", &format!("must be a positive number, got {v}")))?,
    };
    Ok((nu, eps))
}

/// transformers' `_compute_llama3_parameters`, in float32.
fn llama3_inv_freq(base: &[f32], factor: f32, low: f32, high: f32, old_ctx: f32) -> Vec<f32> {
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    base.iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f32::consts::PI / f;
            let scaled = if wavelen > low_wavelen { f / factor } else { f };
            // Finite wavelengths: "not below high and not above low".
            let medium = (high_wavelen..=low_wavelen).contains(&wavelen);
            if medium {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                (1.0 - smooth) * scaled / factor + smooth * scaled
            } else {
                scaled
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra_llama: Value, extra_armt: Value) -> Result<ArmtConfig> {
        let mut llama = serde_json::json!({
            "model_type": "llama", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "max_position_embeddings": 64,
        });
        let mut armt = serde_json::json!({"segment_size": 8, "num_mem_tokens": 2, "d_mem": 4});
        for (obj, extra) in [(&mut llama, extra_llama), (&mut armt, extra_armt)] {
            if let Value::Object(m) = extra {
                obj.as_object_mut().unwrap().extend(m);
            }
        }
        ArmtConfig::from_json(&llama.to_string(), &armt.to_string())
    }

    #[test]
    fn derived_sizes_follow_upstream() -> Result<()> {
        let c = config(Value::Null, Value::Null)?;
        assert_eq!(
            (c.d_key(), c.cell_rows(), c.head_dim(), c.kv_heads()),
            (24, 10, 8, 2)
        );
        assert!(c.armt.correction);
        Ok(())
    }

    #[test]
    fn unsupported_options_name_their_key() {
        for (llama, armt, key) in [
            (
                serde_json::json!({"hidden_act": "gelu"}),
                Value::Null,
                "hidden_act",
            ),
            (
                Value::Null,
                serde_json::json!({"wrap_pos": true}),
                "wrap_pos",
            ),
            (
                Value::Null,
                serde_json::json!({"segment_alignment": "right"}),
                "segment_alignment",
            ),
            (
                Value::Null,
                serde_json::json!({"num_mem_tokens": 0}),
                "num_mem_tokens",
            ),
            (
                Value::Null,
                serde_json::json!({"_hardcoded": {"phi": "elu"}}),
                "_hardcoded.phi",
            ),
            (
                serde_json::json!({"max_position_embeddings": 9}),
                Value::Null,
                "max_position_embeddings",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "yarn"}}),
                Value::Null,
                "rope_scaling",
            ),
        ] {
            match config(llama, armt) {
                Err(ModelError::Config { key: k, .. }) => assert_eq!(k, key),
                other => panic!("{key}: {other:?}"),
            }
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() -> Result<()> {
        let c = config(
            serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, "rope_theta": 500000.0}),
            Value::Null,
        )?;
        let scaled = c.inv_freq()?;
        let plain = ArmtConfig {
            llama: LlamaConfig {
                rope_scaling: None,
                ..c.llama.clone()
            },
            ..c.clone()
        }
        .inv_freq()?;
        // head_dim 8: wavelengths 2π, ~167, ~4.4e3 and ~1.2e5; high-frequency wavelengths
        // (< 8192 / 4) are kept, low-frequency ones (> 8192) divided by the factor.
        assert_eq!(scaled[0], plain[0]);
        assert_eq!(scaled[1], plain[1]);
        assert_eq!(scaled[3], plain[3] / 32.0);
        assert!(scaled[2] < plain[2] && scaled[2] > plain[2] / 32.0);
        Ok(())
    }
}
