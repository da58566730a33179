//! The pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))` (Llama layout, Touvron et
//! al., 2023; LLaDA, Nie et al., 2025; Qwen3 adds per-head q/k RMSNorm), over packed rows.

use candle_core::{Module, Tensor};
use candle_nn::{Linear, VarBuilder};

use super::attention::{attend_packed, PackedLayout, SeqInput};
use super::layers::{apply_rope, linear, GatedMlp, RmsNorm};
use crate::error::{ModelError, Result};

/// Sizes and options of one block.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockConfig {
    pub hidden_size: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub norm_eps: f64,
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub out_bias: bool,
    /// Biases on the MLP projections.
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
}

impl BlockConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, reason: String| {
            Err(ModelError::Config {
                key: key.into(),
                reason,
            })
        };
        if self.n_heads == 0 || self.n_kv_heads == 0 || self.head_dim == 0 {
            return bad("n_heads", "heads and head_dim must be positive".into());
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(
                "n_kv_heads",
                format!(
                    "{} key/value heads do not divide {} heads",
                    self.n_kv_heads, self.n_heads
                ),
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad("head_dim", format!("must be even, got {}", self.head_dim));
        }
        Ok(())
    }
}

/// Tensor names of a block's weights, relative to the block's prefix (each followed by
/// `.weight` / `.bias`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockNames {
    pub attn_norm: &'static str,
    pub q: &'static str,
    pub k: &'static str,
    pub v: &'static str,
    pub o: &'static str,
    pub q_norm: &'static str,
    pub k_norm: &'static str,
    pub ff_norm: &'static str,
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

impl BlockNames {
    /// `model.transformer.blocks.N.*` of LLaDA (`LLaDALlamaBlock`).
    pub const LLADA: Self = Self {
        attn_norm: "attn_norm",
        q: "q_proj",
        k: "k_proj",
        v: "v_proj",
        o: "attn_out",
        q_norm: "q_norm",
        k_norm: "k_norm",
        ff_norm: "ff_norm",
        gate: "ff_proj",
        up: "up_proj",
        down: "ff_out",
    };

    /// `model.layers.N.*` of Hugging Face Llama and Qwen3 checkpoints.
    pub const LLAMA: Self = Self {
        attn_norm: "input_layernorm",
        q: "self_attn.q_proj",
        k: "self_attn.k_proj",
        v: "self_attn.v_proj",
        o: "self_attn.o_proj",
        q_norm: "self_attn.q_norm",
        k_norm: "self_attn.k_norm",
        ff_norm: "post_attention_layernorm",
        gate: "mlp.gate_proj",
        up: "mlp.up_proj",
        down: "mlp.down_proj",
    };
}

/// One pre-norm transformer block.
#[derive(Debug, Clone)]
pub struct Block {
    layer: usize,
    attn_norm: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    ff_norm: RmsNorm,
    mlp: GatedMlp,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl Block {
    /// Loads block `layer` (its index in the stack, which names its slot in every [`KvCache`])
    /// from `vb` rooted at the block's prefix.
    ///
    /// [`KvCache`]: super::KvCache
    pub fn load(
        vb: VarBuilder,
        cfg: &BlockConfig,
        names: &BlockNames,
        layer: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        let (e, h, hkv, d) = (cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let i = cfg.intermediate_size;
        let eps = cfg.norm_eps;
        let qk_norm = if cfg.qk_norm {
            Some((
                RmsNorm::load(vb.pp(names.q_norm), d, eps)?,
                RmsNorm::load(vb.pp(names.k_norm), d, eps)?,
            ))
        } else {
            None
        };
        Ok(Self {
            layer,
            attn_norm: RmsNorm::load(vb.pp(names.attn_norm), e, eps)?,
            q: linear(&vb.pp(names.q), e, h * d, cfg.qkv_bias)?,
            k: linear(&vb.pp(names.k), e, hkv * d, cfg.qkv_bias)?,
            v: linear(&vb.pp(names.v), e, hkv * d, cfg.qkv_bias)?,
            o: linear(&vb.pp(names.o), h * d, e, cfg.out_bias)?,
            qk_norm,
            ff_norm: RmsNorm::load(vb.pp(names.ff_norm), e, eps)?,
            mlp: GatedMlp {
                gate: linear(&vb.pp(names.gate), e, i, cfg.mlp_bias)?,
                up: linear(&vb.pp(names.up), e, i, cfg.mlp_bias)?,
                down: linear(&vb.pp(names.down), i, e, cfg.mlp_bias)?,
            },
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: d,
        })
    }

    /// The block over packed rows `x` `[N, E]`.
    pub fn forward(
        &self,
        x: &Tensor,
        layout: &PackedLayout,
        seqs: &mut [SeqInput],
    ) -> Result<Tensor> {
        let a = self.attention(&self.attn_norm.forward(x)?, layout, seqs)?;
        let x = (x + a)?;
        let m = self.mlp.forward(&self.ff_norm.forward(&x)?)?;
        Ok((x + m)?)
    }

    fn attention(
        &self,
        h: &Tensor,
        layout: &PackedLayout,
        seqs: &mut [SeqInput],
    ) -> Result<Tensor> {
        let n = h.dim(0)?;
        let (nh, nkv, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let mut q = self.q.forward(h)?.reshape((n, nh, d))?;
        let mut k = self.k.forward(h)?.reshape((n, nkv, d))?;
        let v = self.v.forward(h)?.reshape((n, nkv, d))?;
        if let Some((qn, kn)) = &self.qk_norm {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let q = apply_rope(&q.transpose(0, 1)?, &layout.cos, &layout.sin)?;
        let k = apply_rope(&k.transpose(0, 1)?, &layout.cos, &layout.sin)?;
        let v = v.transpose(0, 1)?.contiguous()?;
        let y = attend_packed(&q, &k, &v, layout, seqs, self.layer)?;
        let y = y.transpose(0, 1)?.contiguous()?.reshape((n, nh * d))?;
        Ok(self.o.forward(&y)?)
    }
}
