//! `config.json` of a DiffusionGemma checkpoint (`DiffusionGemmaConfig` of transformers'
//! `diffusion_gemma`, `model_type` `diffusion_gemma`): the top level (`canvas_length`, the
//! end-of-sequence ids, the image token ids) and `text_config`, a Gemma 4 text model.
//!
//! `vision_config` is not read: the vision tower is not served (the checkpoint's
//! `vision_tower.*` and `embed_vision.*` tensors are never loaded). The real file names the
//! full-attention layers' head width and key/value heads `global_head_dim` /
//! `num_global_key_value_heads`; transformers 5.23's `save_pretrained` writes them under
//! `per_layer_config.full_attention` instead. Both are read.
//!
//! What the code assumes without a key (the real `text_config` has neither key): full-attention
//! layers take their values from the key projection (`attention_k_eq_v`), and every layer has a
//! mixture of experts beside its dense MLP (`enable_moe_block`); both keys are read when present
//! and refused when false.

use serde::Deserialize;

use crate::config::{bad, check_positive, check_rope, check_size, parse_json, TokenIds, MAX_WIDTH};
use crate::config::{MAX_LAYERS, MAX_VOCAB};
use crate::error::Result;

const FILE: &str = "config.json";

/// The two kinds of layer of a Gemma 4 stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Local attention: a window of `sliding_window` keys in the encoder; in the denoiser the
    /// last `sliding_window - 1` cached keys and the whole canvas.
    SlidingAttention,
    /// Global attention over everything cached, wider heads, values from the key projection.
    FullAttention,
}

/// `rope_parameters` of one layer type.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RopeParameters {
    #[serde(default = "crate::config::default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_type: Option<String>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
struct PerLayerRopes {
    sliding_attention: RopeParameters,
    full_attention: RopeParameters,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
struct FullLayerKeys {
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
struct PerLayerConfig {
    #[serde(default)]
    full_attention: Option<FullLayerKeys>,
}

fn default_eps() -> f64 {
    1e-6
}

fn default_gelu() -> String {
    "gelu_pytorch_tanh".into()
}

/// `text_config`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
struct TextConfig {
    hidden_size: usize,
    intermediate_size: usize,
    moe_intermediate_size: usize,
    num_experts: usize,
    top_k_experts: usize,
    num_hidden_layers: usize,
    layer_types: Vec<LayerType>,
    num_attention_heads: usize,
    head_dim: usize,
    num_key_value_heads: usize,
    #[serde(default)]
    global_head_dim: Option<usize>,
    #[serde(default)]
    num_global_key_value_heads: Option<usize>,
    #[serde(default)]
    per_layer_config: Option<PerLayerConfig>,
    sliding_window: usize,
    vocab_size: usize,
    max_position_embeddings: usize,
    rope_parameters: PerLayerRopes,
    #[serde(default)]
    final_logit_softcapping: Option<f64>,
    #[serde(default = "default_gelu")]
    hidden_activation: String,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    pad_token_id: Option<u32>,
    #[serde(default)]
    bos_token_id: Option<u32>,
    #[serde(default)]
    attention_k_eq_v: Option<bool>,
    #[serde(default)]
    enable_moe_block: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
struct TopConfig {
    #[serde(default)]
    model_type: Option<String>,
    canvas_length: usize,
    #[serde(default)]
    eos_token_id: Option<TokenIds>,
    #[serde(default)]
    image_token_id: Option<u32>,
    #[serde(default)]
    boi_token_id: Option<u32>,
    #[serde(default)]
    vision_config: Option<serde_json::Value>,
    #[serde(default = "crate::config::default_true")]
    tie_word_embeddings: bool,
    text_config: TextConfig,
}

/// The settings of a DiffusionGemma text model, resolved from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct DiffusionGemmaConfig {
    /// Tokens of one canvas (the denoiser's block).
    pub canvas_length: usize,
    /// End-of-sequence ids of the top level (`eos_token_id`).
    pub eos_token_ids: Vec<u32>,
    /// The image placeholder ids (`image_token_id`, `boi_token_id`): a prompt holding one is an
    /// image request, which is not served.
    pub image_token_ids: Vec<u32>,
    /// A `vision_config` is present (its tower is not loaded).
    pub has_vision_config: bool,
    pub hidden_size: usize,
    /// The dense MLP's width.
    pub intermediate_size: usize,
    /// One expert's width.
    pub moe_intermediate_size: usize,
    pub num_experts: usize,
    pub top_k_experts: usize,
    pub layer_types: Vec<LayerType>,
    pub num_attention_heads: usize,
    /// Sliding layers' head width and key/value heads.
    pub head_dim: usize,
    pub num_key_value_heads: usize,
    /// Full layers' head width and key/value heads.
    pub global_head_dim: usize,
    pub num_global_key_value_heads: usize,
    pub sliding_window: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub sliding_rope_theta: f64,
    pub full_rope_theta: f64,
    /// Share of a full layer's head dims RoPE rotates (`proportional`).
    pub full_partial_rotary_factor: f64,
    pub final_logit_softcapping: Option<f64>,
    pub rms_norm_eps: f64,
    pub pad_token_id: u32,
    pub bos_token_id: u32,
}

impl DiffusionGemmaConfig {
    /// Parses and checks `config.json`.
    pub fn from_json(json: &str) -> Result<Self> {
        let top: TopConfig = parse_json(FILE, json)?;
        let t = top.text_config;
        let full = t
            .per_layer_config
            .as_ref()
            .and_then(|p| p.full_attention.clone());
        let global_head_dim = t
            .global_head_dim
            .or(full.as_ref().and_then(|f| f.head_dim))
            .unwrap_or(t.head_dim);
        let num_global_key_value_heads = t
            .num_global_key_value_heads
            .or(full.as_ref().and_then(|f| f.num_key_value_heads))
            .unwrap_or(t.num_key_value_heads);
        if t.hidden_activation != "gelu_pytorch_tanh" {
            return bad(
                "hidden_activation",
                format!(
                    "only `gelu_pytorch_tanh` is implemented, got `{}`",
                    t.hidden_activation
                ),
            );
        }
        if t.attention_bias {
            return bad(
                "attention_bias",
                "attention biases are not implemented".into(),
            );
        }
        if t.attention_k_eq_v == Some(false) {
            return bad(
                "attention_k_eq_v",
                "full-attention layers with their own value projection are not implemented".into(),
            );
        }
        if t.enable_moe_block == Some(false) {
            return bad(
                "enable_moe_block",
                "layers without a mixture of experts are not implemented".into(),
            );
        }
        if !top.tie_word_embeddings {
            return bad(
                "tie_word_embeddings",
                "DiffusionGemma's output head is its embedding table; untied heads are not \
                 implemented"
                    .into(),
            );
        }
        if t.layer_types.len() != t.num_hidden_layers {
            return bad(
                "layer_types",
                format!(
                    "{} layer types for num_hidden_layers = {}; give one per layer",
                    t.layer_types.len(),
                    t.num_hidden_layers
                ),
            );
        }
        let full_rope = &t.rope_parameters.full_attention;
        let sliding_rope = &t.rope_parameters.sliding_attention;
        for (key, r, allowed) in [
            (
                "rope_parameters.full_attention.rope_type",
                full_rope,
                &["proportional", "default"][..],
            ),
            (
                "rope_parameters.sliding_attention.rope_type",
                sliding_rope,
                &["default"][..],
            ),
        ] {
            let ty = r.rope_type.as_deref().unwrap_or("default");
            if !allowed.contains(&ty) {
                return bad(
                    key,
                    format!("RoPE type `{ty}` is not implemented (only {allowed:?})"),
                );
            }
        }
        let cfg = Self {
            canvas_length: top.canvas_length,
            eos_token_ids: top
                .eos_token_id
                .map(|e| e.to_vec())
                .unwrap_or_else(|| vec![1]),
            image_token_ids: top
                .image_token_id
                .into_iter()
                .chain(top.boi_token_id)
                .collect(),
            has_vision_config: top.vision_config.is_some_and(|v| !v.is_null()),
            hidden_size: t.hidden_size,
            intermediate_size: t.intermediate_size,
            moe_intermediate_size: t.moe_intermediate_size,
            num_experts: t.num_experts,
            top_k_experts: t.top_k_experts,
            layer_types: t.layer_types,
            num_attention_heads: t.num_attention_heads,
            head_dim: t.head_dim,
            num_key_value_heads: t.num_key_value_heads,
            global_head_dim,
            num_global_key_value_heads,
            sliding_window: t.sliding_window,
            vocab_size: t.vocab_size,
            max_position_embeddings: t.max_position_embeddings,
            sliding_rope_theta: sliding_rope.rope_theta,
            full_rope_theta: full_rope.rope_theta,
            full_partial_rotary_factor: match full_rope.rope_type.as_deref() {
                Some("proportional") => full_rope.partial_rotary_factor.unwrap_or(1.0),
                _ => 1.0,
            },
            final_logit_softcapping: t.final_logit_softcapping,
            rms_norm_eps: t.rms_norm_eps,
            pad_token_id: t.pad_token_id.unwrap_or(0),
            bos_token_id: t.bos_token_id.unwrap_or(2),
        };
        cfg.validate()?;
        let _ = top.model_type;
        Ok(cfg)
    }

    /// Checks every size before anything is built from it.
    pub fn validate(&self) -> Result<()> {
        check_size(FILE, "canvas_length", self.canvas_length, 1, 1 << 16)?;
        check_size(FILE, "vocab_size", self.vocab_size, 2, MAX_VOCAB)?;
        check_size(FILE, "hidden_size", self.hidden_size, 1, MAX_WIDTH)?;
        check_size(
            FILE,
            "intermediate_size",
            self.intermediate_size,
            1,
            MAX_WIDTH,
        )?;
        check_size(
            FILE,
            "moe_intermediate_size",
            self.moe_intermediate_size,
            1,
            MAX_WIDTH,
        )?;
        check_size(FILE, "num_experts", self.num_experts, 1, 1 << 12)?;
        check_size(
            FILE,
            "top_k_experts",
            self.top_k_experts,
            1,
            self.num_experts,
        )?;
        check_size(
            FILE,
            "num_hidden_layers",
            self.layer_types.len(),
            1,
            MAX_LAYERS,
        )?;
        check_size(FILE, "sliding_window", self.sliding_window, 1, 1 << 24)?;
        for (key, heads, kv, d) in [
            (
                "num_key_value_heads",
                self.num_attention_heads,
                self.num_key_value_heads,
                self.head_dim,
            ),
            (
                "num_global_key_value_heads",
                self.num_attention_heads,
                self.num_global_key_value_heads,
                self.global_head_dim,
            ),
        ] {
            check_size(FILE, "num_attention_heads", heads, 1, MAX_WIDTH)?;
            check_size(FILE, key, kv, 1, heads)?;
            if !heads.is_multiple_of(kv) {
                return bad(
                    key,
                    format!("{kv} key/value heads do not divide {heads} heads"),
                );
            }
            if d == 0 || !d.is_multiple_of(2) || heads.checked_mul(d).is_none_or(|w| w > MAX_WIDTH)
            {
                return bad(
                    "head_dim",
                    format!("heads of width {d} (even, {heads} of them at most {MAX_WIDTH} wide)"),
                );
            }
        }
        check_rope(
            FILE,
            "max_position_embeddings",
            self.max_position_embeddings,
            self.head_dim.max(self.global_head_dim),
        )?;
        check_positive(FILE, "rms_norm_eps", self.rms_norm_eps)?;
        check_positive(FILE, "rope_theta", self.sliding_rope_theta)?;
        check_positive(FILE, "rope_theta", self.full_rope_theta)?;
        if !(0.0..=1.0).contains(&self.full_partial_rotary_factor) {
            return bad(
                "partial_rotary_factor",
                format!("must be in [0, 1], got {}", self.full_partial_rotary_factor),
            );
        }
        if let Some(c) = self.final_logit_softcapping {
            check_positive(FILE, "final_logit_softcapping", c)?;
        }
        if self.canvas_length > self.max_position_embeddings {
            return bad(
                "canvas_length",
                format!(
                    "{} exceeds max_position_embeddings {}",
                    self.canvas_length, self.max_position_embeddings
                ),
            );
        }
        Ok(())
    }

    /// The text model's checkpoint tensors with their shapes (`[out, in]`), exactly what
    /// [`super::DiffusionGemma::load`] reads: the decoder's weights (the encoder's are tied to
    /// them) and both modes' `layer_scalar`s.
    pub fn checkpoint_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (e, v) = (self.hidden_size, self.vocab_size);
        let (i, w, n) = (
            self.intermediate_size,
            self.moe_intermediate_size,
            self.num_experts,
        );
        let mut out = vec![
            ("model.decoder.embed_tokens.weight".to_owned(), vec![v, e]),
            ("model.decoder.norm.weight".to_owned(), vec![e]),
        ];
        let sc = "model.decoder.self_conditioning";
        out.push((format!("{sc}.pre_norm.weight"), vec![e]));
        out.push((format!("{sc}.gate_proj.weight"), vec![i, e]));
        out.push((format!("{sc}.up_proj.weight"), vec![i, e]));
        out.push((format!("{sc}.down_proj.weight"), vec![e, i]));
        for l in 0..self.num_hidden_layers() {
            let p = format!("model.decoder.layers.{l}");
            let (h, hkv, d) = self.heads(l);
            for norm in [
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
                "post_feedforward_layernorm_1",
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_2",
            ] {
                out.push((format!("{p}.{norm}.weight"), vec![e]));
            }
            out.push((format!("{p}.layer_scalar"), vec![1]));
            out.push((
                format!("model.encoder.language_model.layers.{l}.layer_scalar"),
                vec![1],
            ));
            out.push((format!("{p}.self_attn.q_proj.weight"), vec![h * d, e]));
            out.push((format!("{p}.self_attn.k_proj.weight"), vec![hkv * d, e]));
            if self.layer_types[l] == LayerType::SlidingAttention {
                out.push((format!("{p}.self_attn.v_proj.weight"), vec![hkv * d, e]));
            }
            out.push((format!("{p}.self_attn.o_proj.weight"), vec![e, h * d]));
            out.push((format!("{p}.self_attn.q_norm.weight"), vec![d]));
            out.push((format!("{p}.self_attn.k_norm.weight"), vec![d]));
            out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, e]));
            out.push((format!("{p}.mlp.up_proj.weight"), vec![i, e]));
            out.push((format!("{p}.mlp.down_proj.weight"), vec![e, i]));
            out.push((format!("{p}.router.proj.weight"), vec![n, e]));
            out.push((format!("{p}.router.scale"), vec![e]));
            out.push((format!("{p}.router.per_expert_scale"), vec![n]));
            out.push((format!("{p}.experts.gate_up_proj"), vec![n, 2 * w, e]));
            out.push((format!("{p}.experts.down_proj"), vec![n, e, w]));
        }
        out
    }

    pub fn num_hidden_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// Heads, key/value heads and head width of layer `l`.
    pub fn heads(&self, l: usize) -> (usize, usize, usize) {
        match self.layer_types[l] {
            LayerType::SlidingAttention => (
                self.num_attention_heads,
                self.num_key_value_heads,
                self.head_dim,
            ),
            LayerType::FullAttention => (
                self.num_attention_heads,
                self.num_global_key_value_heads,
                self.global_head_dim,
            ),
        }
    }

    /// RoPE inverse frequencies of a layer type, over half its head width: the full layers'
    /// `proportional` kind rotates the first `int(factor · head_dim // 2)` frequencies of the
    /// standard table (exponents over the whole head width) and passes the rest through.
    pub fn inv_freq(&self, ty: LayerType) -> Vec<f32> {
        let (d, theta, factor) = match ty {
            LayerType::SlidingAttention => (self.head_dim, self.sliding_rope_theta, 1.0),
            LayerType::FullAttention => (
                self.global_head_dim,
                self.full_rope_theta,
                self.full_partial_rotary_factor,
            ),
        };
        let rotated = (factor * d as f64 / 2.0) as usize;
        let theta = theta as f32;
        (0..d / 2)
            .map(|i| {
                if i < rotated {
                    1.0 / theta.powf((2 * i) as f32 / d as f32)
                } else {
                    0.0
                }
            })
            .collect()
    }
}
