//! Diagonal batching's grouped step (Sivtsov et al., 2025, "Diagonal Batching Unlocks
//! Parallelism in Recurrent Memory Transformers for Long Contexts"; upstream
//! `FastGroupedArmtExecutor` and `linear_grouped_sliced_forward.py` of svtdanny/diagonal-batching).
//!
//! Cell (s, l) is segment s at layer l. It needs (s, l - 1) (its input) and (s - 1, l) (the
//! layer-l memory that segment wrote), so every cell with `s + l = i` can run at step i, and a
//! request of N segments takes `N + L - 1` steps instead of `N · L` layer calls. One step here
//! runs every given cell, whatever request it belongs to, as **one** decoder-layer call:
//!
//! * **Layout.** The layers the cells span, `lo..=hi`, form the group axis G. Every cell gets a
//!   block of `P = S + M` rows (shorter cells are padded with zero rows at the end, which causal
//!   attention keeps from reaching real rows); layer g holds its cells' blocks side by side, and
//!   every layer is padded with empty blocks to the most cells any layer has (K). The packed
//!   residual stream is `[G, K·P, d]`. One request has one cell per layer, so K = 1 and there is
//!   no padding but its partial segment's; requests at different diagonals share the layers they
//!   both use, and empty blocks are the price of packing them.
//! * **Grouped matmul.** Weights are stacked once at load, `[L, out, in]` per role (q/k/v fused,
//!   gate, up, o, down, W_mq, and W_mk/W_mv/W_mb fused). A linear layer of the step is one batched
//!   matmul of `[G, K·P, in]` with the contiguous layer range `narrow(0, lo, G)` of its stack,
//!   transposed as a view: no weight is copied or gathered, and the step issues as many
//!   matmuls as a single layer call does, however many cells it holds. (Upstream instead
//!   launches a CUTLASS grouped GEMM over per-row weight pointers; a contiguous layer range
//!   makes a plain strided batched GEMM equivalent, which candle runs on the CPU and through
//!   cuBLAS.) Norm weights are `[L, d]`, applied per group row after a weightless RMSNorm.
//! * **Attention** is one batched causal attention over the `G · K` blocks, positions `0..P` in
//!   every block (RoPE restarts each segment), grouped-query heads, scores and softmax in
//!   float32.
//! * **Tensor parallelism.** The attention and MLP linears are stacked per rank: rank r's
//!   `[L, out_r, in_r]` stacks hold its slice of every layer, cut as the shared block cuts one
//!   layer (its heads' rows of q/k/v and columns of o, its MLP columns of gate/up and down; see
//!   [`crate::transformer::parallel`]). Each rank runs the step's attention and MLP over the
//!   replicated residual stream with one batched matmul per linear, and the collective sums
//!   the ranks' partials once per row-parallel layer (o, down) for all cells of the step. Norms
//!   and the memory projections are whole; reads and writes run once on the summed stream.
//! * **Memory.** Reads come first, for every cell at once, against the memories as they were
//!   when the step began; the step returns each writing cell's [`MemoryUpdate`] instead of
//!   applying it, so the caller applies every write after every read by construction. Each
//!   memory appears at most once per step (one cell per request and layer).
//!
//! Upstream quirk not reproduced: its grouped update forces `gamma = 1` on a layer's first write
//! only while the group is not full and starts at layer 0; the first writes of the other cells use
//! the generic gamma (off by about `1e-5 / |k|²`). Here every first write has `gamma = 1`, the
//! sequential semantics, as the fixture's README recommends.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, D};

use super::memory::{
    dpfp, read_term, updates, write_delta, LayerMemory, MemoryUpdate, WriteInputs,
};
use super::ArmtConfig;
use crate::error::{ModelError, Result};
use crate::transformer::cpu;
use crate::transformer::parallel::{on_rank, reduce, slice, Collective};
use crate::transformer::{gated_mlp, GatedMlp, LinearStack, RopeTable, ShardRange, ShardWeights};

/// Per-layer weights stacked along a leading layer axis, in the checkpoint's `[out, in]` layout.
/// The decoder layers' linears are stacked once per tensor-parallel rank (its slice of every
/// layer); norms and the memory projections are whole (the residual stream is replicated).
#[derive(Debug, Clone)]
pub(crate) struct Stacked {
    /// `input_layernorm` `[L, d]`.
    pub attn_norm: Tensor,
    /// `post_attention_layernorm` `[L, d]`.
    pub ff_norm: Tensor,
    /// `W_mq` `[L, d_mem, d]`.
    pub mq: LinearStack,
    /// `W_mk`, `W_mv`, `W_mb` stacked on the output axis, `[L, d_mem + d + 1, d]`.
    pub mkvb: LinearStack,
    /// `W_mb.bias` `[L, 1]`.
    pub mb_bias: Tensor,
    /// Ones `[d]`: the weight of the weightless RMSNorm.
    pub ones: Tensor,
    /// Each rank's slice of the attention and MLP linears, in rank order (one holding the whole
    /// layers without a split).
    pub ranks: Vec<RankStack>,
    /// Sums the ranks' partial outputs.
    pub comm: Arc<dyn Collective>,
}

/// The decoder layers' attention and MLP linears stacked whole, `[L, out, in]` each: what
/// [`Linears::shard`] cuts into each rank's [`RankStack`].
pub(crate) struct Linears {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub o: Tensor,
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

/// One rank's slice of every layer's attention and MLP linears, stacked: the shared block's
/// split ([`ShardRange`]) applied to the whole stack, so a grouped step still runs one batched
/// matmul per linear on each rank.
#[derive(Debug, Clone)]
pub(crate) struct RankStack {
    /// The rank's rows of `q_proj`, `k_proj`, `v_proj`, stacked on the output axis,
    /// `[L, (h_r + 2 h_kv_r) · hd, d]`.
    pub qkv: LinearStack,
    /// Its columns of `o_proj` `[L, d, h_r · hd]` (row-parallel).
    pub o: LinearStack,
    /// Its rows of `gate_proj` and of `up_proj`, stacked on the output axis, `[L, 2 I_r, d]`.
    pub gate_up: LinearStack,
    /// `I_r`.
    pub hidden: usize,
    /// Its columns of `down_proj` `[L, d, I_r]` (row-parallel).
    pub down: LinearStack,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl Linears {
    /// The slice `r` of every layer (q, k, v, gate, up: output rows; o, down: input columns), as
    /// the shared block cuts one layer. With the whole range only the q/k/v concatenation
    /// copies; the other stacks stay as they are.
    pub(crate) fn shard(&self, r: &ShardRange, head_dim: usize) -> Result<RankStack> {
        let hd = head_dim;
        let qkv = Tensor::cat(
            &[
                slice(&self.q, 1, &r.heads, hd)?,
                slice(&self.k, 1, &r.kv_heads, hd)?,
                slice(&self.v, 1, &r.kv_heads, hd)?,
            ],
            1,
        )?;
        Ok(RankStack {
            qkv: LinearStack::new(qkv)?,
            o: LinearStack::new(slice(&self.o, 2, &r.heads, hd)?)?,
            gate_up: LinearStack::new(Tensor::cat(
                &[
                    slice(&self.gate, 1, &r.columns, 1)?,
                    slice(&self.up, 1, &r.columns, 1)?,
                ],
                1,
            )?)?,
            hidden: r.columns.len(),
            down: LinearStack::new(slice(&self.down, 2, &r.columns, 1)?)?,
            n_heads: r.heads.len(),
            n_kv_heads: r.kv_heads.len(),
            head_dim,
        })
    }
}

impl RankStack {
    /// The stacks on `device` (the rank's own GPU under NCCL).
    pub(crate) fn to_device(&self, device: &candle_core::Device) -> Result<Self> {
        Ok(Self {
            qkv: self.qkv.to_device(device)?,
            o: self.o.to_device(device)?,
            gate_up: self.gate_up.to_device(device)?,
            down: self.down.to_device(device)?,
            ..*self
        })
    }

    /// Layer `l`'s shard of the shared block (the sequential path): the stacks' own layers
    /// (shared, not copied).
    pub(crate) fn layer(&self, l: usize) -> Result<ShardWeights> {
        Ok(ShardWeights {
            qkv: self.qkv.layer(l)?.clone(),
            o: self.o.layer(l)?.clone(),
            mlp: Some(GatedMlp {
                gate_up: self.gate_up.layer(l)?.clone(),
                down: self.down.layer(l)?.clone(),
                hidden: self.hidden,
            }),
        })
    }

    /// Stores every packed layer as `dtype`.
    pub(crate) fn store_as(&mut self, dtype: crate::transformer::WeightDtype) -> Result<()> {
        for s in [
            &mut self.qkv,
            &mut self.o,
            &mut self.gate_up,
            &mut self.down,
        ] {
            s.store_as(dtype)?;
        }
        Ok(())
    }

    /// The rank's heads of a grouped step's attention over `hn` `[G, K·P, d]` (blocks of
    /// `P = mask.dim(0)` rows, layers `lo..lo + G`), through its columns of `o_proj`: its partial
    /// output `[G, K·P, d]`, and its keys (after RoPE) and values `[G·K, h_kv_r, P, hd]`.
    fn attention(
        &self,
        hn: &Tensor,
        lo: usize,
        (cos, sin): (&Tensor, &Tensor),
        mask: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (h, hkv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let (g_n, rows, _) = hn.dims3()?;
        let p = mask.dim(0)?;
        let blocks = g_n * rows / p;
        let qkv = grouped_linear(hn, &self.qkv, lo)?;
        let heads = |offset: usize, n_heads: usize| -> Result<Tensor> {
            Ok(qkv
                .narrow(2, offset * hd, n_heads * hd)?
                .reshape((blocks, p, n_heads, hd))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let q = rope(&heads(0, h)?, cos, sin)?;
        let k = rope(&heads(h, hkv)?, cos, sin)?;
        let v = heads(h + hkv, hkv)?;
        let attn = attention(&q, &k, &v, mask, self.qkv.bf16_products())?
            .transpose(1, 2)?
            .reshape((g_n, rows, h * hd))?;
        Ok((grouped_linear(&attn, &self.o, lo)?, k, v))
    }

    /// The rank's columns of a grouped step's MLP over `hn` `[G, R, d]`: its partial output.
    /// With packed CPU weights each group runs through its layer's MLP ([`gated_mlp`]: its
    /// rows in chunks, a packed step of several requests has thousands per group).
    fn mlp(&self, hn: &Tensor, lo: usize) -> Result<Tensor> {
        if !(self.gate_up.is_packed() && self.down.is_packed()) {
            let gu = grouped_linear(hn, &self.gate_up, lo)?;
            let act = cpu::silu_mul(&gu, self.hidden)?;
            return grouped_linear(&act, &self.down, lo);
        }
        let groups = (0..hn.dim(0)?)
            .map(|g| {
                let (gate_up, down) = (self.gate_up.layer(lo + g)?, self.down.layer(lo + g)?);
                gated_mlp(gate_up, down, self.hidden, &hn.get(g)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::stack(&groups, 0)?)
    }
}

/// One cell of a grouped step.
#[derive(Debug, Clone)]
pub struct CellInput<'a> {
    pub layer: usize,
    /// The residual stream entering the layer, `[n, d]` with `n <= S + M`.
    pub hidden: Tensor,
    /// The cell's request's memory of `layer`, as left by its previous segment.
    pub memory: &'a LayerMemory,
    /// A memory segment: write from the last `M` rows of the layer's output.
    pub write: bool,
    /// Return the cell's keys (after RoPE) and values, e.g. a prompt segment whose keys
    /// generation attends to.
    pub keep_kv: bool,
}

/// What a grouped step produced for one cell.
#[derive(Debug, Clone)]
pub struct CellOutput {
    /// The layer's output `[n, d]`.
    pub hidden: Tensor,
    /// The write to apply to the cell's memory (cells with `write`).
    pub update: Option<MemoryUpdate>,
    /// Keys after RoPE and values, `[h_kv_r, n, hd]` each, one pair per tensor-parallel rank
    /// (its key/value heads) in rank order (cells with `keep_kv`); [`super::Armt::store_kv`]
    /// puts them where the shared block's shards read them.
    pub kv: Option<Vec<(Tensor, Tensor)>>,
}

/// The grouped call's shape, for statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Layers spanned (the group axis).
    pub layers: usize,
    /// Cell blocks per layer (the most cells any layer has).
    pub blocks_per_layer: usize,
    /// Cells run.
    pub cells: usize,
}

/// `x` `[G, R, in]` times layers `lo..lo + G` of `w`.
fn grouped_linear(x: &Tensor, w: &LinearStack, lo: usize) -> Result<Tensor> {
    w.grouped(x, lo)
}

/// RMSNorm of `x` `[G, R, d]` with layer `lo + g`'s weight on group row g; the statistic in
/// float32 and the weight applied after casting back (upstream Llama's order).
fn grouped_rms_norm(x: &Tensor, ones: &Tensor, w: &Tensor, lo: usize, eps: f64) -> Result<Tensor> {
    let g = x.dim(0)?;
    let normed = if x.dtype() == DType::F32 {
        candle_nn::ops::rms_norm(&x.contiguous()?, ones, eps as f32)?
    } else {
        let xf = x.to_dtype(DType::F32)?;
        let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
        xf.broadcast_mul(&(ms + eps)?.sqrt()?.recip()?)?
            .to_dtype(x.dtype())?
    };
    Ok(normed.broadcast_mul(&w.narrow(0, lo, g)?.unsqueeze(1)?)?)
}

/// Half-layout RoPE of `x` `[B, H, P, hd]` at positions `0..P`, in float32.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let y = candle_nn::rotary_emb::rope(&x.to_dtype(DType::F32)?.contiguous()?, cos, sin)?;
    Ok(y.to_dtype(dtype)?)
}

/// Where each cell sits in the `[G, K·P, d]` layout.
struct Layout {
    lo: usize,
    groups: usize,
    blocks: usize,
    /// Per cell: `(g, k)`.
    place: Vec<(usize, usize)>,
    /// Per `(g, k)` (row-major): the cell there, if any.
    grid: Vec<Option<usize>>,
}

impl Layout {
    fn new(cells: &[CellInput]) -> Result<Self> {
        let lo = cells.iter().map(|c| c.layer).min().unwrap_or(0);
        let hi = cells.iter().map(|c| c.layer).max().unwrap_or(0);
        let groups = hi - lo + 1;
        let mut count = vec![0usize; groups];
        let mut place = Vec::with_capacity(cells.len());
        for c in cells {
            let g = c.layer - lo;
            place.push((g, count[g]));
            count[g] += 1;
        }
        let blocks = count.iter().copied().max().unwrap_or(0);
        let mut grid = vec![None; groups * blocks];
        for (i, &(g, k)) in place.iter().enumerate() {
            grid[g * blocks + k] = Some(i);
        }
        Ok(Self {
            lo,
            groups,
            blocks,
            place,
            grid,
        })
    }
}

/// The stacked weights plus what a grouped step needs of the model.
pub(crate) struct GroupedContext<'a> {
    pub cfg: &'a ArmtConfig,
    pub stacked: &'a Stacked,
    pub rope: &'a RopeTable,
    pub device: &'a Device,
    pub dtype: DType,
    /// `A = 0` `[d_key, d]` and `z = 0` `[d_key]`, for blocks without a cell.
    pub empty: &'a LayerMemory,
}

impl GroupedContext<'_> {
    /// Runs every cell as one grouped decoder-layer call (see the module doc).
    pub fn step(&self, cells: &[CellInput]) -> Result<(Vec<CellOutput>, StepShape)> {
        if cells.is_empty() {
            return Ok((
                Vec::new(),
                StepShape {
                    layers: 0,
                    blocks_per_layer: 0,
                    cells: 0,
                },
            ));
        }
        let cfg = self.cfg;
        let (p, d, m) = (cfg.cell_rows(), cfg.hidden_size(), cfg.num_mem_tokens());
        let eps = cfg.mem_eps;
        for c in cells {
            let n = c.hidden.dim(0)?;
            if n == 0 || n > p || (c.write && n < m) || c.layer >= cfg.n_layers() {
                return Err(ModelError::Shape(format!(
                    "a cell of {n} rows at layer {} (cells hold 1..={p} rows, writing ones at least {m})",
                    c.layer
                )));
            }
        }
        let lay = Layout::new(cells)?;
        let (g_n, k_n, lo) = (lay.groups, lay.blocks, lay.lo);
        let blocks = g_n * k_n;
        let zeros = Tensor::zeros((p, d), self.dtype, self.device)?;

        // Pack the residual stream: [G, K·P, d].
        let mut pieces = Vec::with_capacity(2 * blocks);
        for slot in &lay.grid {
            match slot {
                Some(c) => {
                    let x = &cells[*c].hidden;
                    let n = x.dim(0)?;
                    pieces.push(x.to_dtype(self.dtype)?);
                    if n < p {
                        pieces.push(zeros.narrow(0, 0, p - n)?);
                    }
                }
                None => pieces.push(zeros.clone()),
            }
        }
        let mut x = Tensor::cat(&pieces, 0)?.reshape((g_n, k_n * p, d))?;

        // Every block's memory, once: [G·K, d_key, d] and [G·K, d_key].
        let needs_memory = cells.iter().any(|c| c.write || c.memory.is_written());
        let mems: Vec<&LayerMemory> = lay
            .grid
            .iter()
            .map(|s| s.map_or(self.empty, |c| cells[c].memory))
            .collect();
        let (a, z) = if needs_memory {
            let a: Vec<&Tensor> = mems.iter().map(|mm| mm.a()).collect();
            let z: Vec<&Tensor> = mems.iter().map(|mm| mm.z()).collect();
            (Some(Tensor::stack(&a, 0)?), Some(Tensor::stack(&z, 0)?))
        } else {
            (None, None)
        };

        // 1. Reads, before the layer, on every row (unwritten memories read exactly 0).
        let any_read = cells.iter().any(|c| c.memory.is_written());
        if let (true, Some(a), Some(z)) = (any_read, &a, &z) {
            let q = grouped_linear(&x, &self.stacked.mq, lo)?.to_dtype(DType::F32)?;
            let q = dpfp(&q, cfg.nu)?.reshape((blocks, p, cfg.d_key()))?;
            let assoc = read_term(&q, a, z, eps, self.stacked.mq.bf16_products())?
                .reshape((g_n, k_n * p, d))?
                .to_dtype(self.dtype)?;
            x = crate::transformer::cpu::add(&x, &assoc)?;
        }

        // 2. The decoder layer, grouped: every rank's heads and MLP columns, the partials summed
        //    (one all-reduce per row-parallel layer for all cells of the step).
        let s = self.stacked;
        let norm_eps = cfg.llama.rms_norm_eps;
        let hn = grouped_rms_norm(&x, &s.ones, &s.attn_norm, lo, norm_eps)?;
        let positions: Vec<u32> = (0..p as u32).collect();
        let (cos, sin) = self.rope.rows(&positions)?;
        let mask = causal_mask(p, self.device)?;
        let comm = s.comm.as_ref();
        let mut kv = Vec::with_capacity(s.ranks.len());
        let mut partials = Vec::with_capacity(s.ranks.len());
        for (rank, r) in s.ranks.iter().enumerate() {
            // On the rank's device (a no-op unless ranks have GPUs of their own).
            let here = |t: &Tensor| on_rank(comm, rank, t);
            let rope = (&here(&cos)?, &here(&sin)?);
            let (y, k, v) = r.attention(&here(&hn)?, lo, rope, &here(&mask)?)?;
            partials.push(y);
            kv.push((k, v));
        }
        let x = crate::transformer::cpu::add(&x, &reduce(comm, partials)?)?;
        let hn = grouped_rms_norm(&x, &s.ones, &s.ff_norm, lo, norm_eps)?;
        let partials = s
            .ranks
            .iter()
            .enumerate()
            .map(|(rank, r)| r.mlp(&on_rank(comm, rank, &hn)?, lo))
            .collect::<Result<Vec<_>>>()?;
        let x = crate::transformer::cpu::add(&x, &reduce(s.comm.as_ref(), partials)?)?;

        // 3. Writes, from the memory rows of the layer's output, against the old memories.
        let mut deltas: Vec<Option<MemoryUpdate>> = vec![None; blocks];
        let any_write = cells.iter().any(|c| c.write);
        if let (true, Some(a), Some(z)) = (any_write, &a, &z) {
            let zeros_m = zeros.narrow(0, 0, m)?;
            let mut rows = Vec::with_capacity(blocks);
            let mut first = Vec::with_capacity(blocks);
            for (slot, mem) in lay.grid.iter().zip(&mems) {
                match slot {
                    Some(c) if cells[*c].write => {
                        let (g, kk) = lay.place[*c];
                        let n = cells[*c].hidden.dim(0)?;
                        rows.push(x.get(g)?.narrow(0, kk * p + n - m, m)?);
                    }
                    _ => rows.push(zeros_m.clone()),
                }
                first.push(if mem.is_written() { 0f32 } else { 1.0 });
            }
            let ym = Tensor::cat(&rows, 0)?.reshape((g_n, k_n * m, d))?;
            let proj = grouped_linear(&ym, &s.mkvb, lo)?.to_dtype(DType::F32)?;
            let dm = cfg.d_mem();
            let bias = s
                .mb_bias
                .narrow(0, lo, g_n)?
                .to_dtype(DType::F32)?
                .unsqueeze(1)?;
            let beta_logit = proj
                .narrow(2, dm + d, 1)?
                .broadcast_add(&bias)?
                .reshape((blocks, m, 1))?;
            let mk = dpfp(&proj.narrow(2, 0, dm)?, cfg.nu)?.reshape((blocks, m, cfg.d_key()))?;
            let mv = proj.narrow(2, dm, d)?.reshape((blocks, m, d))?;
            let first = Tensor::from_vec(first, blocks, self.device)?;
            let (da, dz) = write_delta(&WriteInputs {
                k: &mk,
                v: &mv,
                beta_logit: &beta_logit,
                a,
                z,
                first: &first,
                correction: cfg.armt.correction,
                eps,
                bf16: self.stacked.mkvb.bf16_products(),
            })?;
            for (b, u) in updates(&da, &dz)?.into_iter().enumerate() {
                if matches!(lay.grid[b], Some(c) if cells[c].write) {
                    deltas[b] = Some(u);
                }
            }
        }

        let mut out = Vec::with_capacity(cells.len());
        for (i, c) in cells.iter().enumerate() {
            let (g, kk) = lay.place[i];
            let n = c.hidden.dim(0)?;
            let b = g * k_n + kk;
            let kv = if c.keep_kv {
                let cell =
                    |t: &Tensor| -> Result<Tensor> { Ok(t.get(b)?.narrow(1, 0, n)?.contiguous()?) };
                Some(
                    kv.iter()
                        .map(|(k, v)| Ok((cell(k)?, cell(v)?)))
                        .collect::<Result<Vec<_>>>()?,
                )
            } else {
                None
            };
            out.push(CellOutput {
                hidden: x.get(g)?.narrow(0, kk * p, n)?,
                update: deltas[b].take(),
                kv,
            });
        }
        let shape = StepShape {
            layers: g_n,
            blocks_per_layer: k_n,
            cells: cells.len(),
        };
        Ok((out, shape))
    }
}

/// The causal mask `[P, P]` of a block: 0 on and below the diagonal, `-inf` above.
fn causal_mask(p: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..p)
        .flat_map(|i| (0..p).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(mask, (p, p), device)?)
}

/// Causal attention (`mask` `[P, P]`) of `q` `[B, h, P, hd]` over `k`, `v` `[B, h_kv, P, hd]`
/// (query head j reads key head `j / (h / h_kv)`), scaled by `1 / sqrt(hd)`, scores and softmax
/// in float32; returns `[B, h, P, hd]`. `bf16`: the CPU kernel's products in bfloat16.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, bf16: bool) -> Result<Tensor> {
    let dtype = q.dtype();
    let (b, h, p, hd) = q.dims4()?;
    let hkv = k.dim(1)?;
    if cpu::on_cpu_f32(q) {
        // Every block one causal sequence of the CPU kernel, its keys read in place.
        let seqs = (0..b)
            .map(|i| {
                Ok(cpu::CpuSeq {
                    rows: i * p..(i + 1) * p,
                    row_index: (0..p as u32).collect(),
                    runs: vec![(k.get(i)?, v.get(i)?)],
                    key_index: None,
                    mask: wavefront_kernels::attention::Mask::Causal,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let qh = q.transpose(0, 1)?.reshape((h, b * p, hd))?;
        let y = cpu::attend(
            &qh,
            hkv,
            (1.0 / (hd as f64).sqrt()) as f32,
            &seqs,
            false,
            bf16,
        )?;
        return Ok(y.reshape((h, b, p, hd))?.transpose(0, 1)?.contiguous()?);
    }
    let (k, v) = if h == hkv {
        (k.clone(), v.clone())
    } else {
        let rep = h / hkv;
        let expand = |x: &Tensor| -> Result<Tensor> {
            Ok(x.unsqueeze(2)?
                .expand((b, hkv, rep, p, hd))?
                .contiguous()?
                .reshape((b, h, p, hd))?)
        };
        (expand(k)?, expand(v)?)
    };
    let scale = 1.0 / (hd as f64).sqrt();
    let scores = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * scale)?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(mask)?)?.to_dtype(dtype)?;
    Ok(probs.matmul(&v.contiguous()?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use wavefront_kernels::grouped::{grouped_matmul, Group};

    /// The grouped linear of a step (one batched matmul over a contiguous layer range, every
    /// layer's rows padded to the same count) is the grouped-matmul kernel's semantics
    /// (`wavefront-kernels`, whose CUDA kernel takes ragged groups in place).
    #[test]
    fn grouped_linear_is_the_grouped_matmul_kernels_reference() -> Result<()> {
        let (layers, out, inp, rows, lo, groups) = (5usize, 6usize, 7usize, 4usize, 1usize, 3usize);
        let det = |n: usize, salt: f32| -> Vec<f32> {
            (0..n)
                .map(|i| (i as f32 * 0.37 + salt).sin() * 2.0)
                .collect()
        };
        let w = det(layers * out * inp, 0.5);
        let x = det(groups * rows * inp, 1.5);
        let wt = Tensor::from_vec(w.clone(), (layers, out, inp), &Device::Cpu)?;
        let xt = Tensor::from_vec(x.clone(), (groups, rows, inp), &Device::Cpu)?;
        let got: Vec<f32> = grouped_linear(&xt, &LinearStack::new(wt)?, lo)?
            .flatten_all()?
            .to_vec1()?;
        let spec: Vec<Group> = (0..groups)
            .map(|g| Group {
                rows: (g * rows) as u32..((g + 1) * rows) as u32,
                weight: (lo + g) as u32,
            })
            .collect();
        let want = grouped_matmul(&spec, &x, &w, layers, inp, out)
            .map_err(crate::error::ModelError::from)?;
        assert_eq!(got.len(), want.len());
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
        Ok(())
    }
}
