//! Layers of the Huginn sandwich block, run over packed rows of many sequences.
//!
//! `SandwichBlock` (Geiping et al., 2025, recurrent-depth architecture): `h = norm_2(x +
//! attn(norm_1(x)))`, `out = norm_4(h + mlp(norm_3(h)))` with RMSNorm (computed in float32), a
//! gated SiLU MLP, and causal self-attention with a learned q/k bias added before interleaved
//! ("complex-multiplication") rotary embeddings (Su et al., 2021, RoFormer).
//!
//! Rows of all sequences in a call are concatenated along dim 0 (`[N, E]`): projections, norms
//! and the MLP run once over all rows; attention is split per sequence and reads that
//! sequence's own KV cache (see [`RowLayout`]).

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::VarBuilder;

use std::sync::Arc;

use super::cache::{CacheLayer, SeqRows};
use super::config::HuginnConfig;
use crate::error::{ModelError, Result};
use crate::transformer::cpu;
use crate::transformer::parallel::{
    column_range, head_ranges, on_rank, reduce, slice, Collective, TensorParallel,
};
pub(crate) use crate::transformer::{get, linear, Linear, RmsNorm};
use crate::transformer::{GatedMlp, RopeTable};
use wavefront_kernels::attention::Mask;

/// The gated MLP of a sandwich block: `[g | u] = x @ fc^T`, `proj(silu(g) * u)` (the shared
/// [`GatedMlp`] over the checkpoint's fused `fc`); under tensor parallelism one per rank over its
/// columns (its rows of `g` and of `u`, its columns of `proj`).
fn load_mlp(vb: VarBuilder, cfg: &HuginnConfig, tp: &TensorParallel) -> Result<Vec<GatedMlp>> {
    let (e, i) = (cfg.n_embd, cfg.intermediate_size);
    let fc = get(&vb.pp("fc"), &[2 * i, e], "weight")?;
    let proj = get(&vb.pp("proj"), &[e, i], "weight")?;
    if tp.is_single() {
        return Ok(vec![GatedMlp::fused(
            Linear::new(fc, None)?,
            Linear::new(proj, None)?,
            i,
        )]);
    }
    (0..tp.world)
        .map(|rank| {
            let c = column_range(i, tp.world, rank)?;
            let rows = Tensor::cat(
                &[
                    fc.narrow(0, c.start, c.len())?,
                    fc.narrow(0, i + c.start, c.len())?,
                ],
                0,
            )?;
            let proj = slice(&proj, 1, &c, 1)?;
            Ok(GatedMlp::fused(
                Linear::new(on_rank(tp.comm.as_ref(), rank, &rows)?, None)?,
                Linear::new(on_rank(tp.comm.as_ref(), rank, &proj)?, None)?,
                c.len(),
            ))
        })
        .collect()
}

/// Per-call bookkeeping of packed rows: each sequence's row range and RoPE angles per row.
pub(crate) struct RowLayout {
    /// First packed row of each sequence.
    offsets: Vec<usize>,
    /// `cos`, `sin` of every row's absolute position, `[N, head_dim / 2]`, float32.
    cos: Tensor,
    sin: Tensor,
    /// Bottom-right causal mask per sequence for its full key range, `[len, start + len]`
    /// (None for single-row blocks).
    masks: Vec<Option<Tensor>>,
}

impl RowLayout {
    pub(crate) fn new(rope: &RopeTable, rows: usize, seqs: &[SeqRows]) -> Result<Self> {
        let total: usize = seqs.iter().map(|s| s.len).sum();
        if total != rows {
            return Err(ModelError::Shape(format!(
                "sequences cover {total} rows but the packed input has {rows}"
            )));
        }
        let mut offsets = Vec::with_capacity(seqs.len());
        let mut positions = Vec::with_capacity(rows);
        let mut masks = Vec::with_capacity(seqs.len());
        let mut offset = 0;
        for s in seqs {
            if s.len == 0 {
                return Err(ModelError::Shape("a sequence contributes no rows".into()));
            }
            if s.start + s.len > rope.max_positions() {
                return Err(ModelError::Shape(format!(
                    "position {} beyond the RoPE table (block_size {})",
                    s.start + s.len - 1,
                    rope.max_positions()
                )));
            }
            offsets.push(offset);
            offset += s.len;
            positions.extend((s.start..s.start + s.len).map(|p| p as u32));
            masks.push(causal_mask(s.len, s.start + s.len, rope.device())?);
        }
        let (cos, sin) = rope.rows(&positions)?;
        Ok(Self {
            offsets,
            cos,
            sin,
            masks,
        })
    }
}

/// Additive mask `[q, t]`: query i (of a block ending at key t - 1) sees keys `0..=t - q + i`.
fn causal_mask(q: usize, t: usize, device: &Device) -> Result<Option<Tensor>> {
    if q <= 1 {
        return Ok(None);
    }
    if q > t {
        return Err(ModelError::Cache(format!(
            "{q} queries attend to only {t} keys"
        )));
    }
    let shift = t - q;
    let data: Vec<f32> = (0..q)
        .flat_map(|i| {
            (0..t).map(move |j| {
                if j <= shift + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Some(Tensor::from_vec(data, (q, t), device)?))
}

/// Causal self-attention with q/k bias and interleaved RoPE.
///
/// Under tensor parallelism each rank holds its heads' rows of `Wqkv` (and of the q/k bias) and
/// their columns of `proj`, on its device. The heads are gathered on rank 0 for the cache write
/// and the attention itself, because one cache layer holds every head (the lookup strategies remap
/// layers, not heads); the output projection runs per rank and the collective sums the partials.
#[derive(Debug, Clone)]
struct Attention {
    shards: Vec<AttnShard>,
    comm: Arc<dyn Collective>,
    head_dim: usize,
}

#[derive(Debug, Clone)]
struct AttnShard {
    wqkv: Linear,
    proj: Linear,
    /// `[H_r, 1, D]` biases of q and k.
    qk_bias: Option<(Tensor, Tensor)>,
    n_heads: usize,
}

impl Attention {
    fn load(vb: VarBuilder, cfg: &HuginnConfig, tp: &TensorParallel) -> Result<Self> {
        let (e, h, d) = (cfg.n_embd, cfg.n_heads, cfg.head_dim());
        let qk_bias = if cfg.qk_bias {
            let b = get(&vb, &[2, 1, h, d], "qk_bias")?;
            let q = b.i((0, 0))?.reshape((h, 1, d))?;
            let k = b.i((1, 0))?.reshape((h, 1, d))?;
            Some((q, k))
        } else {
            None
        };
        let wqkv = get(&vb.pp("Wqkv"), &[3 * e, e], "weight")?;
        let proj = get(&vb.pp("proj"), &[e, e], "weight")?;
        let shards = if tp.is_single() {
            vec![AttnShard {
                wqkv: Linear::new(wqkv, None)?,
                proj: Linear::new(proj, None)?,
                qk_bias,
                n_heads: h,
            }]
        } else {
            (0..tp.world)
                .map(|rank| {
                    let (r, _) = head_ranges(h, h, tp.world, rank)?;
                    let (start, len) = (r.start * d, r.len() * d);
                    let rows: Vec<Tensor> = (0..3)
                        .map(|part| wqkv.narrow(0, part * e + start, len))
                        .collect::<candle_core::Result<_>>()?;
                    let bias = match &qk_bias {
                        Some((q, k)) => Some((slice(q, 0, &r, 1)?, slice(k, 0, &r, 1)?)),
                        None => None,
                    };
                    let comm = tp.comm.as_ref();
                    let proj = slice(&proj, 1, &r, d)?;
                    Ok(AttnShard {
                        wqkv: Linear::new(on_rank(comm, rank, &Tensor::cat(&rows, 0)?)?, None)?,
                        proj: Linear::new(on_rank(comm, rank, &proj)?, None)?,
                        qk_bias: bias,
                        n_heads: r.len(),
                    })
                })
                .collect::<Result<_>>()?
        };
        Ok(Self {
            shards,
            comm: tp.comm.clone(),
            head_dim: d,
        })
    }

    /// `x`: normed rows `[N, E]`. Returns `[N, E]`.
    fn forward(
        &self,
        x: &Tensor,
        layout: &RowLayout,
        seqs: &mut [SeqRows],
        layer: &dyn Fn(&SeqRows) -> CacheLayer,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let d = self.head_dim;
        let dtype = x.dtype();
        let comm = self.comm.as_ref();
        let scale = 1.0 / (d as f64).sqrt();
        if let [s] = &self.shards[..] {
            if cpu::on_cpu_f32(x) {
                // One pass from the product to head-major q, k, v: bias, RoPE and the layout
                // (float32, the same operations as the candle path below, so the same bits).
                let qkv = s.wqkv.forward(x)?;
                let prep = cpu::QkPrep {
                    bias: s.qk_bias.as_ref().map(|(q, k)| (q, k)),
                    interleaved: true,
                    ..Default::default()
                };
                let (q, k, v) = cpu::split_heads(
                    &qkv,
                    (s.n_heads, s.n_heads, d),
                    prep,
                    &layout.cos,
                    &layout.sin,
                )?;
                // The kernel writes the rows the output projection reads.
                let y = self.attend_cpu(&q, &k, &v, scale, layout, seqs, layer, true)?;
                return s.proj.forward(&y);
            }
        }
        // Every rank's q, k, v `[H_r, N, D]`, gathered along the heads on rank 0.
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (rank, s) in self.shards.iter().enumerate() {
            let qkv = s.wqkv.forward(&on_rank(comm, rank, x)?)?;
            let qkv = on_rank(comm, 0, &qkv)?.reshape((n, 3, s.n_heads, d))?;
            // [H, N, D] views, made contiguous by the bias add / RoPE.
            let head_major = |i: usize| -> Result<Tensor> { Ok(qkv.i((.., i))?.transpose(0, 1)?) };
            let (mut q, mut k) = (head_major(0)?, head_major(1)?);
            if let Some((qb, kb)) = &s.qk_bias {
                q = q.broadcast_add(qb)?;
                k = k.broadcast_add(kb)?;
            }
            qs.push(self.rope(&q, layout, dtype)?);
            ks.push(self.rope(&k, layout, dtype)?);
            vs.push(head_major(2)?.contiguous()?);
        }
        let gather = |mut t: Vec<Tensor>| -> Result<Tensor> {
            Ok(if t.len() == 1 {
                t.pop().expect("one shard")
            } else {
                Tensor::cat(&t, 0)?
            })
        };
        let (q, k, v) = (gather(qs)?, gather(ks)?, gather(vs)?);

        let y = if cpu::on_cpu_f32(&q) {
            self.attend_cpu(&q, &k, &v, scale, layout, seqs, layer, false)?
        } else {
            self.attend_sdpa(&q, &k, &v, scale, layout, seqs, layer)?
        };
        // Each rank projects its heads; the collective sums the partials.
        let mut partials = Vec::with_capacity(self.shards.len());
        let mut head = 0;
        for (rank, s) in self.shards.iter().enumerate() {
            let y = if self.shards.len() == 1 {
                y.clone()
            } else {
                y.narrow(0, head, s.n_heads)?
            };
            head += s.n_heads;
            let y = y
                .transpose(0, 1)?
                .contiguous()?
                .reshape((n, s.n_heads * d))?;
            partials.push(s.proj.forward(&on_rank(comm, rank, &y)?)?);
        }
        reduce(comm, partials)
    }

    /// Writes every sequence's keys and values `[H, N, D]` to its cache layer and attends with
    /// the CPU kernel over the layer's runs, read in place; returns `[H, N, D]`, or `[N, H · D]`
    /// with `rows_out`. Query `i` of a sequence whose layer
    /// yields `t` keys sees keys `0..=t - len + i` (bottom-right causal, as the sdpa path).
    #[allow(clippy::too_many_arguments)]
    fn attend_cpu(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
        layout: &RowLayout,
        seqs: &mut [SeqRows],
        layer: &dyn Fn(&SeqRows) -> CacheLayer,
        rows_out: bool,
    ) -> Result<Tensor> {
        let mut calls = Vec::with_capacity(seqs.len());
        for (i, seq) in seqs.iter_mut().enumerate() {
            let off = layout.offsets[i];
            // The pages take the sequence's rows from where they lie.
            let (ks, vs) = (k.narrow(1, off, seq.len)?, v.narrow(1, off, seq.len)?);
            let layer = layer(seq);
            let upto = seq.start + seq.len;
            seq.cache.write(layer, seq.start, &ks, &vs)?;
            let runs = seq.cache.read_runs(layer, upto)?;
            let t: usize = runs
                .iter()
                .map(|(k, _)| k.dim(1))
                .sum::<candle_core::Result<_>>()?;
            if t < seq.len {
                return Err(ModelError::Cache(format!(
                    "{} queries attend to only {t} keys",
                    seq.len
                )));
            }
            calls.push(cpu::CpuSeq {
                rows: off..off + seq.len,
                row_index: (t - seq.len..t).map(|r| r as u32).collect(),
                runs,
                key_index: None,
                mask: Mask::Causal,
            });
        }
        let bf16 = self.shards[0].wqkv.bf16_products();
        cpu::attend(q, q.dim(0)?, scale as f32, &calls, rows_out, bf16)
    }

    /// The candle path (GPU, bf16): one attention per sequence.
    #[allow(clippy::too_many_arguments)]
    fn attend_sdpa(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
        layout: &RowLayout,
        seqs: &mut [SeqRows],
        layer: &dyn Fn(&SeqRows) -> CacheLayer,
    ) -> Result<Tensor> {
        let single = seqs.len() == 1;
        let mut outs = Vec::with_capacity(seqs.len());
        for (i, seq) in seqs.iter_mut().enumerate() {
            let off = layout.offsets[i];
            let (qs, ks, vs) = if single {
                (q.clone(), k.clone(), v.clone())
            } else {
                (
                    q.narrow(1, off, seq.len)?,
                    k.narrow(1, off, seq.len)?.contiguous()?,
                    v.narrow(1, off, seq.len)?.contiguous()?,
                )
            };
            let layer = layer(seq);
            let upto = seq.start + seq.len;
            seq.cache.write(layer, seq.start, &ks, &vs)?;
            let (kc, vc) = seq.cache.read(layer, upto)?;
            let (kc, vc) = (kc.to_dtype(qs.dtype())?, vc.to_dtype(qs.dtype())?);
            outs.push(attend(
                &qs,
                &kc,
                &vc,
                scale,
                layout.masks[i].as_ref(),
                upto,
            )?);
        }
        Ok(if single {
            outs.pop().expect("one sequence")
        } else {
            Tensor::cat(&outs, 1)?
        })
    }

    /// Interleaved RoPE on `[H, N, D]`, computed in float32.
    fn rope(&self, x: &Tensor, layout: &RowLayout, dtype: DType) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?.contiguous()?.unsqueeze(0)?;
        let y = candle_nn::rotary_emb::rope_i(&x, &layout.cos, &layout.sin)?.squeeze(0)?;
        Ok(y.to_dtype(dtype)?)
    }
}

/// Softmax attention of `q` `[H, L, D]` over `k`, `v` `[H, T, D]`; softmax in float32.
/// `mask` is the bottom-right causal mask for `T = full_t`; a shorter key range (positions
/// skipped by the `full` strategy) gets its own mask.
fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    full_t: usize,
) -> Result<Tensor> {
    let dtype = q.dtype();
    let (_, l, _) = q.dims3()?;
    let t = k.dim(1)?;
    let scores = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * scale)?;
    let scores = match mask {
        Some(m) if t == full_t => scores.broadcast_add(m)?,
        Some(_) => match causal_mask(l, t, q.device())? {
            Some(m) => scores.broadcast_add(&m)?,
            None => scores,
        },
        None => scores,
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(dtype)?;
    Ok(probs.matmul(v)?)
}

/// One sandwich block.
#[derive(Debug, Clone)]
pub(crate) struct SandwichBlock {
    norm_1: RmsNorm,
    attn: Attention,
    norm_2: RmsNorm,
    mlp: Vec<GatedMlp>,
    comm: Arc<dyn Collective>,
    norm_3: RmsNorm,
    norm_4: RmsNorm,
}

impl crate::transformer::StoreWeights for SandwichBlock {
    fn store_weights(&mut self, dtype: crate::transformer::WeightDtype) -> Result<()> {
        for s in &mut self.attn.shards {
            s.wqkv.store_as(dtype)?;
            s.proj.store_as(dtype)?;
        }
        for m in &mut self.mlp {
            m.store_weights(dtype)?;
        }
        Ok(())
    }
}

impl SandwichBlock {
    pub(crate) fn load(vb: VarBuilder, cfg: &HuginnConfig, tp: &TensorParallel) -> Result<Self> {
        let (e, eps) = (cfg.n_embd, cfg.norm_eps);
        Ok(Self {
            norm_1: RmsNorm::load(vb.pp("norm_1"), e, eps)?,
            attn: Attention::load(vb.pp("attn"), cfg, tp)?,
            norm_2: RmsNorm::load(vb.pp("norm_2"), e, eps)?,
            mlp: load_mlp(vb.pp("mlp"), cfg, tp)?,
            comm: tp.comm.clone(),
            norm_3: RmsNorm::load(vb.pp("norm_3"), e, eps)?,
            norm_4: RmsNorm::load(vb.pp("norm_4"), e, eps)?,
        })
    }

    pub(crate) fn forward(
        &self,
        x: &Tensor,
        layout: &RowLayout,
        seqs: &mut [SeqRows],
        layer: &dyn Fn(&SeqRows) -> CacheLayer,
    ) -> Result<Tensor> {
        let a = self
            .attn
            .forward(&self.norm_1.forward(x)?, layout, seqs, layer)?;
        let (_, h) = self.norm_2.add_forward(&a, x)?;
        let h3 = self.norm_3.forward(&h)?;
        let comm = self.comm.as_ref();
        let partials = self
            .mlp
            .iter()
            .enumerate()
            .map(|(rank, m)| m.forward(&on_rank(comm, rank, &h3)?))
            .collect::<Result<Vec<_>>>()?;
        let m = reduce(comm, partials)?;
        Ok(self.norm_4.add_forward(&m, &h)?.1)
    }
}
