//! The pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))` (Llama layout, Touvron et
//! al., 2023; LLaDA, Nie et al., 2025; Qwen3 adds per-head q/k RMSNorm), over packed rows.

use std::ops::Range;
use std::sync::Arc;

use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::attention::{attend_packed, commit_buffers, PackedLayout, SeqInput};
use super::cpu;
use super::layers::{apply_rope, get, linear_to_device, GatedMlp, RmsNorm, RopeTable};
use super::linear::Linear;
use super::moe::Moe;
use super::parallel::{
    column_range, head_ranges, on_rank, reduce, slice, Collective, TensorParallel,
};
use super::ragged::AttentionKernel;
use crate::config::bad;
use crate::error::{ModelError, Result};

/// A projection's `[out, in]` weight and optional `[out]` bias as the checkpoint holds them.
type Raw = (Tensor, Option<Tensor>);

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
        // The projections' widths are products of these: checked before any is computed.
        let max = crate::config::MAX_WIDTH;
        for (what, n) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
        ] {
            if n == 0 || n > max {
                return bad(what, format!("{n} is out of range 1..={max}"));
            }
        }
        if crate::config::product_within(self.n_heads, self.head_dim, max).is_none() {
            return bad(
                "n_heads",
                format!(
                    "{} heads of width {} exceed a projection width of {max}",
                    self.n_heads, self.head_dim
                ),
            );
        }
        Ok(())
    }
}

/// `blocks` in order over packed rows `x` `[N, E]` of `seqs` (positions from `rope`), then the
/// final `norm`: the hidden rows fed to the head. Buffer sequences' caches hold this call's keys
/// afterwards.
pub(crate) fn forward_stack(
    blocks: &[Block],
    rope: &RopeTable,
    norm: &RmsNorm,
    x: Tensor,
    seqs: &mut [SeqInput],
    kernel: AttentionKernel,
) -> Result<Tensor> {
    let layout = PackedLayout::new(rope, x.dim(0)?, seqs, kernel)?;
    let mut x = x;
    for block in blocks {
        x = block.forward(&x, &layout, seqs)?;
    }
    commit_buffers(seqs);
    norm.forward(&x)
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

impl BlockConfig {
    /// The block's checkpoint tensors under `prefix` (`{prefix}.{name}.weight` / `.bias`) with
    /// their shapes, exactly what [`Block::load`] reads with `names`.
    pub fn checkpoint_tensors(
        &self,
        prefix: &str,
        names: &BlockNames,
    ) -> Vec<(String, Vec<usize>)> {
        let (e, i, d) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let (q, kv) = (self.n_heads * d, self.n_kv_heads * d);
        let mut out = Vec::new();
        let mut push = |name: &str, bias: bool, shape: Vec<usize>| {
            if bias {
                out.push((format!("{prefix}.{name}.bias"), vec![shape[0]]));
            }
            out.push((format!("{prefix}.{name}.weight"), shape));
        };
        push(names.attn_norm, false, vec![e]);
        push(names.q, self.qkv_bias, vec![q, e]);
        push(names.k, self.qkv_bias, vec![kv, e]);
        push(names.v, self.qkv_bias, vec![kv, e]);
        push(names.o, self.out_bias, vec![e, q]);
        if self.qk_norm {
            push(names.q_norm, false, vec![d]);
            push(names.k_norm, false, vec![d]);
        }
        push(names.ff_norm, false, vec![e]);
        push(names.gate, self.mlp_bias, vec![i, e]);
        push(names.up, self.mlp_bias, vec![i, e]);
        push(names.down, self.mlp_bias, vec![e, i]);
        out
    }
}

/// What one tensor-parallel rank holds of a block: a contiguous range of query heads, the
/// key/value heads they read (replicated on several ranks when there are fewer than the ranks)
/// and a contiguous range of MLP columns ([`super::parallel`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardRange {
    pub heads: Range<usize>,
    pub kv_heads: Range<usize>,
    pub columns: Range<usize>,
}

impl BlockConfig {
    /// Every rank's [`ShardRange`] under `world` ranks, in rank order; an error naming
    /// `tensor_parallel` when the ranks cannot split the heads or the MLP width.
    pub(crate) fn shard_ranges(&self, world: usize) -> Result<Vec<ShardRange>> {
        (0..world)
            .map(|rank| {
                let (heads, kv_heads) = head_ranges(self.n_heads, self.n_kv_heads, world, rank)?;
                let columns = column_range(self.intermediate_size, world, rank)?;
                Ok(ShardRange {
                    heads,
                    kv_heads,
                    columns,
                })
            })
            .collect()
    }
}

/// One rank's slice of a block's weights, `[out, in]` each: q, k, v and the MLP's gate and up
/// column-parallel (the rank's output rows, with their biases); o and the MLP's down
/// row-parallel (its input columns, no bias: the block adds the biases once after the sum).
#[derive(Debug, Clone)]
pub(crate) struct ShardWeights {
    /// q, k and v fused on the output axis (`[(h_r + 2 h_kv_r) · head_dim, in]`): one product.
    pub qkv: Linear,
    pub o: Linear,
    /// The rank's MLP columns; `None` in a block whose feed-forward is a [`Moe`].
    pub mlp: Option<GatedMlp>,
}

impl ShardWeights {
    /// The shard with every weight on `device` (no copy of what is already there).
    pub(crate) fn to_device(&self, device: &candle_core::Device) -> Result<Self> {
        Ok(Self {
            qkv: linear_to_device(&self.qkv, device)?,
            o: linear_to_device(&self.o, device)?,
            mlp: self.mlp.as_ref().map(|m| m.to_device(device)).transpose()?,
        })
    }
}

/// A block's weights, already split: what every rank shares (norms, the row-parallel biases)
/// and each rank's [`ShardWeights`], in rank order.
#[derive(Debug, Clone)]
pub(crate) struct BlockWeights {
    pub attn_norm: RmsNorm,
    pub ff_norm: RmsNorm,
    /// Per-head q and k RMSNorm (Qwen3).
    pub qk_norm: Option<(RmsNorm, RmsNorm)>,
    pub o_bias: Option<Tensor>,
    pub down_bias: Option<Tensor>,
    pub shards: Vec<ShardWeights>,
    /// A mixture-of-experts feed-forward instead of the shards' MLPs.
    pub moe: Option<Moe>,
}

/// One pre-norm transformer block, possibly split over tensor-parallel ranks
/// ([`super::parallel`]): every rank's [`Shard`] computes its part of the attention and MLP
/// outputs and the collective sums them before each residual add.
#[derive(Debug, Clone)]
pub struct Block {
    attn_norm: RmsNorm,
    ff_norm: RmsNorm,
    shards: Vec<Shard>,
    /// Biases of the row-parallel projections, added once after the sum.
    o_bias: Option<Tensor>,
    down_bias: Option<Tensor>,
    /// The feed-forward when it is a mixture of experts (LLaDA2), split by experts over the
    /// same ranks.
    moe: Option<Moe>,
    comm: Arc<dyn Collective>,
}

/// One rank's slice of a block: its attention heads and MLP columns, on the rank's device.
#[derive(Debug, Clone)]
struct Shard {
    rank: usize,
    /// Index of this shard's keys/values in every [`KvCache`](super::KvCache):
    /// `layer · world + rank`.
    cache_slot: usize,
    w: ShardWeights,
    qk_norm: Option<(RmsNorm, RmsNorm)>,
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
        Self::load_parallel(vb, cfg, names, layer, &TensorParallel::single())
    }

    /// Loads block `layer` split over `tp.world` ranks.
    pub fn load_parallel(
        vb: VarBuilder,
        cfg: &BlockConfig,
        names: &BlockNames,
        layer: usize,
        tp: &TensorParallel,
    ) -> Result<Self> {
        cfg.validate()?;
        let ranges = cfg.shard_ranges(tp.world)?;
        let (e, h, hkv, d) = (cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let i = cfg.intermediate_size;
        let eps = cfg.norm_eps;
        // The checkpoint's `[out, in]` weight and optional bias of one projection.
        let full = |name: &str, in_dim: usize, out_dim: usize, bias: bool| -> Result<Raw> {
            let vb = vb.pp(name);
            let b = if bias {
                Some(get(&vb, &[out_dim], "bias")?)
            } else {
                None
            };
            Ok((get(&vb, &[out_dim, in_dim], "weight")?, b))
        };
        let (q, k, v) = (
            full(names.q, e, h * d, cfg.qkv_bias)?,
            full(names.k, e, hkv * d, cfg.qkv_bias)?,
            full(names.v, e, hkv * d, cfg.qkv_bias)?,
        );
        let o = full(names.o, h * d, e, cfg.out_bias)?;
        let (gate, up, down) = (
            full(names.gate, e, i, cfg.mlp_bias)?,
            full(names.up, e, i, cfg.mlp_bias)?,
            full(names.down, i, e, cfg.mlp_bias)?,
        );
        let qk_norm = if cfg.qk_norm {
            Some((
                RmsNorm::load(vb.pp(names.q_norm), d, eps)?,
                RmsNorm::load(vb.pp(names.k_norm), d, eps)?,
            ))
        } else {
            None
        };
        // Column-parallel: rows of the weight (and the bias); row-parallel: columns, no bias.
        let single = tp.is_single();
        let column_raw = |(w, b): &Raw, r: &Range<usize>, unit: usize| -> Result<Raw> {
            if single {
                return Ok((w.clone(), b.clone()));
            }
            let b = b.as_ref().map(|b| slice(b, 0, r, unit)).transpose()?;
            Ok((slice(w, 0, r, unit)?, b))
        };
        // The rank's rows of q, k and v, fused into one product.
        let qkv = |r: &ShardRange| -> Result<Linear> {
            let parts = [
                column_raw(&q, &r.heads, d)?,
                column_raw(&k, &r.kv_heads, d)?,
                column_raw(&v, &r.kv_heads, d)?,
            ];
            let w = Tensor::cat(&[&parts[0].0, &parts[1].0, &parts[2].0], 0)?;
            let b = match (&parts[0].1, &parts[1].1, &parts[2].1) {
                (Some(a), Some(b), Some(c)) => Some(Tensor::cat(&[a, b, c], 0)?),
                _ => None,
            };
            Linear::new(w, b)
        };
        let row = |(w, _): &Raw, r: &Range<usize>, unit: usize| -> Result<Linear> {
            if single {
                return Linear::new(w.clone(), None);
            }
            Linear::new(slice(w, 1, r, unit)?, None)
        };
        let shards = ranges
            .iter()
            .map(|r| {
                Ok(ShardWeights {
                    qkv: qkv(r)?,
                    o: row(&o, &r.heads, d)?,
                    mlp: Some(GatedMlp::new(
                        column_raw(&gate, &r.columns, 1)?,
                        column_raw(&up, &r.columns, 1)?,
                        row(&down, &r.columns, 1)?,
                    )?),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let weights = BlockWeights {
            attn_norm: RmsNorm::load(vb.pp(names.attn_norm), e, eps)?,
            ff_norm: RmsNorm::load(vb.pp(names.ff_norm), e, eps)?,
            qk_norm,
            o_bias: o.1,
            down_bias: down.1,
            shards,
            moe: None,
        };
        Self::from_weights(weights, cfg, layer, tp.comm.clone())
    }

    /// Block `layer` from weights already split over the ranks of `comm`, one
    /// [`ShardWeights`] per rank as [`BlockConfig::shard_ranges`] cuts them (e.g. views of a
    /// model's own layer-stacked weights). Each rank's weights move to its device when the
    /// collective places ranks on devices of their own.
    pub(crate) fn from_weights(
        w: BlockWeights,
        cfg: &BlockConfig,
        layer: usize,
        comm: Arc<dyn Collective>,
    ) -> Result<Self> {
        cfg.validate()?;
        let world = w.shards.len();
        if world == 0 || world != comm.world() {
            return Err(ModelError::Shape(format!(
                "{world} weight shards for a world of {}",
                comm.world()
            )));
        }
        let shards = w
            .shards
            .into_iter()
            .zip(cfg.shard_ranges(world)?)
            .enumerate()
            .map(|(rank, (s, r))| {
                let (s, qk_norm) = match comm.device(rank) {
                    None => (s, w.qk_norm.clone()),
                    Some(d) => (
                        s.to_device(d)?,
                        w.qk_norm
                            .as_ref()
                            .map(|(q, k)| Ok::<_, ModelError>((q.to_device(d)?, k.to_device(d)?)))
                            .transpose()?,
                    ),
                };
                Ok(Shard {
                    rank,
                    cache_slot: layer * world + rank,
                    w: s,
                    qk_norm,
                    n_heads: r.heads.len(),
                    n_kv_heads: r.kv_heads.len(),
                    head_dim: cfg.head_dim,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            attn_norm: w.attn_norm,
            ff_norm: w.ff_norm,
            shards,
            o_bias: w.o_bias,
            down_bias: w.down_bias,
            moe: w.moe,
            comm,
        })
    }

    /// Tensor-parallel ranks this block is split over.
    pub fn world(&self) -> usize {
        self.shards.len()
    }

    /// The block over packed rows `x` `[N, E]`.
    pub fn forward(
        &self,
        x: &Tensor,
        layout: &PackedLayout,
        seqs: &mut [SeqInput],
    ) -> Result<Tensor> {
        Ok(self.forward_traced(x, layout, seqs)?.0)
    }

    /// [`Block::forward`], also returning the feed-forward's input (`ff_norm` of the attention's
    /// residual; a MoE router reads it, and tests compare it with upstream's).
    pub fn forward_traced(
        &self,
        x: &Tensor,
        layout: &PackedLayout,
        seqs: &mut [SeqInput],
    ) -> Result<(Tensor, Tensor)> {
        let comm = self.comm.as_ref();
        let h = self.attn_norm.forward(x)?;
        let partials = self
            .shards
            .iter()
            .map(|s| {
                let replica = layout.replica(comm.device(s.rank))?;
                let layout = replica.as_deref().unwrap_or(layout);
                s.attention(&on_rank(comm, s.rank, &h)?, layout, seqs)
            })
            .collect::<Result<Vec<_>>>()?;
        let a = self.sum_partials(partials, self.o_bias.as_ref())?;
        let (x, h) = self.ff_norm.add_forward(x, &a)?;
        let m = match &self.moe {
            Some(moe) => moe.forward(&h)?,
            None => {
                let partials = self
                    .shards
                    .iter()
                    .map(|s| match &s.w.mlp {
                        Some(mlp) => mlp.forward(&on_rank(comm, s.rank, &h)?),
                        None => Err(ModelError::Shape("a block without a feed-forward".into())),
                    })
                    .collect::<Result<Vec<_>>>()?;
                self.sum_partials(partials, self.down_bias.as_ref())?
            }
        };
        Ok((super::cpu::add(&x, &m)?, h))
    }

    /// The mixture-of-experts feed-forward, if this block has one.
    pub fn moe(&self) -> Option<&Moe> {
        self.moe.as_ref()
    }

    /// Sums the ranks' partial outputs (nothing to sum with one rank) and adds the bias.
    fn sum_partials(&self, partials: Vec<Tensor>, bias: Option<&Tensor>) -> Result<Tensor> {
        let y = reduce(self.comm.as_ref(), partials)?;
        Ok(match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

impl super::StoreWeights for Block {
    fn store_weights(&mut self, dtype: super::WeightDtype) -> Result<()> {
        for s in &mut self.shards {
            s.w.qkv.store_as(dtype)?;
            s.w.o.store_as(dtype)?;
            if let Some(m) = &mut s.w.mlp {
                m.store_weights(dtype)?;
            }
        }
        if let Some(moe) = &mut self.moe {
            moe.store_weights(dtype)?;
        }
        Ok(())
    }
}

/// RoPE over heads `[H, N, D]`: every dim, or under partial rotary embeddings (a table narrower
/// than `D / 2`) only the leading `2 · table width` dims, the rest passed through.
fn rope_heads(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (d, rot) = (x.dim(2)?, 2 * cos.dim(1)?);
    if rot == d {
        return apply_rope(x, cos, sin);
    }
    let rotated = apply_rope(&x.narrow(2, 0, rot)?.contiguous()?, cos, sin)?;
    Ok(Tensor::cat(&[&rotated, &x.narrow(2, rot, d - rot)?], 2)?)
}

impl Shard {
    /// This rank's heads of the attention, through its slice of the output projection.
    fn attention(
        &self,
        h: &Tensor,
        layout: &PackedLayout,
        seqs: &mut [SeqInput],
    ) -> Result<Tensor> {
        let n = h.dim(0)?;
        let (nh, nkv, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let qkv = self.w.qkv.forward(h)?;
        let (q, k, v) = if cpu::on_cpu_f32(&qkv) && cpu::on_cpu_f32(&layout.cos) {
            // One pass: split, per-head norm, RoPE and the head-major layout.
            let prep = cpu::QkPrep {
                norm: self
                    .qk_norm
                    .as_ref()
                    .map(|(qn, kn)| (qn.weight(), kn.weight(), qn.eps() as f32)),
                ..Default::default()
            };
            cpu::split_heads(&qkv, (nh, nkv, d), prep, &layout.cos, &layout.sin)?
        } else {
            let mut q = qkv.narrow(1, 0, nh * d)?.reshape((n, nh, d))?;
            let mut k = qkv.narrow(1, nh * d, nkv * d)?.reshape((n, nkv, d))?;
            let v = qkv
                .narrow(1, (nh + nkv) * d, nkv * d)?
                .reshape((n, nkv, d))?;
            if let Some((qn, kn)) = &self.qk_norm {
                q = qn.forward(&q)?;
                k = kn.forward(&k)?;
            }
            let q = rope_heads(&q.transpose(0, 1)?, &layout.cos, &layout.sin)?;
            let k = rope_heads(&k.transpose(0, 1)?, &layout.cos, &layout.sin)?;
            (q, k, v.transpose(0, 1)?.contiguous()?)
        };
        let bf16 = self.w.qkv.bf16_products();
        let y = attend_packed(&q, &k, &v, layout, seqs, self.cache_slot, bf16)?;
        self.w.o.forward(&y)
    }
}
