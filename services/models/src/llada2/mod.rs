//! LLaDA2.0, a mixture-of-experts masked-diffusion language model decoded block by block, with a
//! packed multi-sequence API.
//!
//! inclusionAI, 2025, "LLaDA2.0: Scaling Up Diffusion Language Models to 100B"; checkpoints
//! `inclusionAI/LLaDA2.0-mini` and `-flash`, reference code their remote
//! `modeling_llada2_moe.py` (`LLaDA2MoeModelLM`), whose tensor names (`model.word_embeddings`,
//! `model.layers.N.attention.{query_key_value,dense,query_layernorm,key_layernorm}`,
//! `model.layers.N.mlp.{gate,experts.E,shared_experts}`, `model.norm`, `lm_head`) are mirrored by
//! the `VarBuilder` paths here.
//!
//! The network: `x = word_embeddings[ids]`, then per layer `x += dense(attn(rope(q_norm(q)),
//! rope(k_norm(k)), v))` over `input_layernorm(x)`, with q, k and v from one fused projection,
//! per-head q/k RMSNorm and RoPE on the first `head_dim · partial_rotary_factor` dims of each
//! head only; then `x += ffn(post_attention_layernorm(x))`, a SwiGLU MLP in the first
//! `first_k_dense_replace` layers and a mixture of experts after them
//! ([`crate::transformer::moe`]); finally `lm_head(norm(x))`. Position `i`'s logits predict
//! position `i` (no shift). Attention is whatever the sequence's [`MaskRule`] says: block
//! diffusion uses [`MaskRule::BlockCausal`] over a window, or a current block over the cached
//! K/V of the finished ones (the same numbers, since a finished block never sees later ones).
//!
//! The block is the shared one; tensor parallelism splits heads and dense MLP columns as for
//! the other families, and a MoE layer's experts by contiguous ranges (expert parallelism).
//!
//! [`MaskRule`]: crate::transformer::MaskRule
//! [`MaskRule::BlockCausal`]: crate::transformer::MaskRule::BlockCausal

mod config;

use std::ops::Range;

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

pub use self::config::Llada2Config;
use crate::error::{ModelError, Result};
use crate::transformer::moe::{expert_range, Moe, MoeShard, Routing};
use crate::transformer::parallel::{column_range, slice};
use crate::transformer::{
    get, Block, BlockWeights, EmbedHead, GatedMlp, Linear, RmsNorm, RopeTable, SeqInput,
    ShardWeights, Stack, TensorParallel,
};

/// A loaded LLaDA2.0 model.
#[derive(Debug, Clone)]
pub struct Llada2 {
    cfg: Llada2Config,
    stack: Stack,
}

crate::stack_model!(Llada2, Llada2Config);

/// `[out, in]` weight of a bias-free projection.
fn weight(vb: &VarBuilder, out: usize, inp: usize) -> Result<Tensor> {
    get(vb, &[out, inp], "weight")
}

/// A SwiGLU MLP `prefix.{gate,up,down}_proj`, its hidden columns `cols` only.
fn mlp(vb: &VarBuilder, e: usize, width: usize, cols: &Range<usize>) -> Result<GatedMlp> {
    let (g, u, d) = (
        weight(&vb.pp("gate_proj"), width, e)?,
        weight(&vb.pp("up_proj"), width, e)?,
        weight(&vb.pp("down_proj"), e, width)?,
    );
    let whole = cols.len() == width;
    let (g, u, d) = if whole {
        (g, u, d)
    } else {
        (
            slice(&g, 0, cols, 1)?,
            slice(&u, 0, cols, 1)?,
            slice(&d, 1, cols, 1)?,
        )
    };
    GatedMlp::new((g, None), (u, None), Linear::new(d, None)?)
}

impl Llada2 {
    pub fn load(vb: VarBuilder, cfg: Llada2Config) -> Result<Self> {
        Self::load_parallel(vb, cfg, &TensorParallel::single())
    }

    /// Loads the model split over `tp.world` ranks: heads and dense MLP columns as for the
    /// other families, routed experts by contiguous ranges, shared experts by columns.
    pub fn load_parallel(vb: VarBuilder, cfg: Llada2Config, tp: &TensorParallel) -> Result<Self> {
        cfg.validate()?;
        let m = vb.pp("model");
        let (e, v, d) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim());
        let (h, hkv) = (cfg.num_attention_heads, cfg.kv_heads());
        let embed = weight(&m.pp("word_embeddings"), v, e)?;
        let block_cfg = cfg.block_config();
        let ranges = block_cfg.shard_ranges(tp.world)?;
        let world = tp.world;
        let mut blocks = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let lv = m.pp("layers").pp(l);
            let a = lv.pp("attention");
            let qkv = weight(&a.pp("query_key_value"), (h + 2 * hkv) * d, e)?;
            let dense = weight(&a.pp("dense"), e, h * d)?;
            let qk_norm = if cfg.use_qk_norm {
                Some((
                    RmsNorm::load(a.pp("query_layernorm"), d, cfg.rms_norm_eps)?,
                    RmsNorm::load(a.pp("key_layernorm"), d, cfg.rms_norm_eps)?,
                ))
            } else {
                None
            };
            let moe_layer = cfg.is_moe(l);
            let shards = ranges
                .iter()
                .map(|r| {
                    let rows = Tensor::cat(
                        &[
                            &slice(&qkv, 0, &r.heads, d)?,
                            &slice(&qkv, 0, &((h + r.kv_heads.start)..(h + r.kv_heads.end)), d)?,
                            &slice(
                                &qkv,
                                0,
                                &((h + hkv + r.kv_heads.start)..(h + hkv + r.kv_heads.end)),
                                d,
                            )?,
                        ],
                        0,
                    )?;
                    let o = if world == 1 {
                        dense.clone()
                    } else {
                        slice(&dense, 1, &r.heads, d)?
                    };
                    let dense_mlp = if moe_layer {
                        None
                    } else {
                        Some(mlp(&lv.pp("mlp"), e, cfg.intermediate_size, &r.columns)?)
                    };
                    Ok(ShardWeights {
                        qkv: Linear::new(rows, None)?,
                        o: Linear::new(o, None)?,
                        mlp: dense_mlp,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let moe = if moe_layer {
                Some(Self::load_moe(&lv.pp("mlp"), &cfg, tp)?)
            } else {
                None
            };
            let weights = BlockWeights {
                attn_norm: RmsNorm::load(lv.pp("input_layernorm"), e, cfg.rms_norm_eps)?,
                ff_norm: RmsNorm::load(lv.pp("post_attention_layernorm"), e, cfg.rms_norm_eps)?,
                qk_norm,
                o_bias: None,
                down_bias: None,
                shards,
                moe,
            };
            blocks.push(Block::from_weights(
                weights,
                &block_cfg,
                l,
                tp.comm.clone(),
            )?);
        }
        let norm = RmsNorm::load(m.pp("norm"), e, cfg.rms_norm_eps)?;
        let head = if cfg.tie_word_embeddings {
            None
        } else {
            Some((weight(&vb.pp("lm_head"), v, e)?, None))
        };
        let rope = RopeTable::new(
            cfg.rotary_dim(),
            cfg.rope_theta,
            cfg.max_position_embeddings,
            vb.device(),
        )?;
        let stack = Stack::new(EmbedHead::new(embed, head)?, blocks, norm, rope);
        Ok(Self { cfg, stack })
    }

    /// One MoE layer `mlp.*`: the router, every rank's experts and its slice of the shared ones.
    fn load_moe(vb: &VarBuilder, cfg: &Llada2Config, tp: &TensorParallel) -> Result<Moe> {
        let (e, n) = (cfg.hidden_size, cfg.num_experts);
        let gate = weight(&vb.pp("gate"), n, e)?;
        let bias: Vec<f32> = get(&vb.pp("gate"), &[n], "expert_bias")?
            .to_dtype(DType::F32)?
            .to_vec1()?;
        let shared_width = cfg.moe_intermediate_size * cfg.num_shared_experts;
        let shards = (0..tp.world)
            .map(|rank| {
                let experts = expert_range(n, tp.world, rank);
                let routed = experts
                    .clone()
                    .map(|x| {
                        let w = cfg.moe_intermediate_size;
                        mlp(&vb.pp("experts").pp(x), e, w, &(0..w))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let shared = if shared_width == 0 {
                    None
                } else {
                    let cols = column_range(shared_width, tp.world, rank).map_err(|_| {
                        ModelError::Config {
                            key: "tensor_parallel".into(),
                            reason: format!(
                                "{} ranks do not divide the shared experts' width {shared_width}",
                                tp.world
                            ),
                        }
                    })?;
                    Some(mlp(&vb.pp("shared_experts"), e, shared_width, &cols)?)
                };
                Ok(MoeShard {
                    experts,
                    routed,
                    shared,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Moe::new(cfg.routing(), gate, bias, shards, tp.comm.clone())
    }

    /// Upstream's `output_hidden_states`: the embeddings, the input of every layer after the
    /// first, and `norm` of the last layer's output; with every MoE layer's router input and
    /// routing (`None` for dense layers).
    #[allow(clippy::type_complexity)]
    pub fn forward_traced(
        &self,
        ids: &[u32],
        seqs: &mut [SeqInput],
    ) -> Result<(Vec<Tensor>, Vec<Option<(Tensor, Routing)>>)> {
        let mut routes = Vec::with_capacity(self.stack.blocks.len());
        let states = self.stack.hidden_states(ids, seqs, |block, input| {
            routes.push(match block.moe() {
                Some(moe) => Some((input.clone(), moe.route(input)?)),
                None => None,
            });
            Ok(())
        })?;
        Ok((states, routes))
    }

    /// Logits `[N, V]` (float32) of hidden rows from [`Llada2::forward`].
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.stack.logits(hidden)
    }
}
