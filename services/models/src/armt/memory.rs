//! The associative memory of one layer and its read and write (Rodkin et al., 2024, "Associative
//! Recurrent Memory Transformer"; upstream `AssociativeLayerWrapper` in
//! `modeling_amt/language_modeling.py`).
//!
//! Layer l keeps `A_l` `[d_key, d]` and `z_l` `[d_key]`, both zero until its first write.
//! With `phi` = DPFP (`u = [relu(x), relu(-x)]`, `phi(x) = [u·roll(u,1), ..., u·roll(u,nu)]`):
//!
//! * **read**, before the layer, on every row h of the residual stream:
//!   `h += phi(h W_mq) A / (phi(h W_mq) · z + eps)`;
//! * **write**, after the layer, from its output o at the M memory rows, every row against the
//!   *old* state (a parallel delta rule): `k = phi(o W_mk)`, `v = o W_mv`,
//!   `beta = sigmoid(o W_mb + b)`; on the first write `v_prev = 0` and `gamma = 1`, afterwards
//!   `den = k · z + eps`, `v_prev = k A / den`, `gamma = clip(1 - den / (|k|² + eps), 0, 1)`
//!   (`gamma = 1` without `correction`); then `A += Σ_j beta_j k_jᵀ (v_j - v_prev_j)` and
//!   `z += Σ_j gamma_j k_j`.
//!
//! State and memory arithmetic are float32 whatever the model dtype (the projections run in the
//! model dtype and are cast). Every function takes a leading batch of cells `[C, rows, ...]`, so
//! the sequential path (one cell) and a grouped diagonal step (all cells of the step) share the
//! same arithmetic.

use candle_core::{DType, Device, Tensor, D};

use crate::arena::{ArenaPool, Pooled};
use crate::error::Result;
use crate::transformer::cpu::matmul;

/// Memory entries per arena (one `A` and one `z` arena of that many entries per layer).
const ARENA_ENTRIES: usize = 8;

/// A model's memory entries: per layer, a [`ArenaPool`] of `A` `[d_key, d]` and one of `z`
/// `[d_key]` (float32, on the model's device), made [`ARENA_ENTRIES`] at a time as the number of
/// requests holding memories grows and reused as they end. A request's memory of a layer is one
/// entry of each ([`MemoryPool::take`]); the entries go back when the last handle to them is
/// dropped (the request ended, failed, was cancelled or preempted), so none can leak.
#[derive(Clone, Debug)]
pub struct MemoryPool {
    layers: Vec<(ArenaPool, ArenaPool)>,
}

impl MemoryPool {
    /// Bytes of the arenas made so far, every layer's memories and normalisers.
    pub fn allocated_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|(a, z)| a.allocated_bytes() + z.allocated_bytes())
            .sum()
    }

    /// An empty pool for `layers` layers of memories `[d_key, d]` on `device`.
    pub fn new(layers: usize, d_key: usize, d: usize, device: &Device) -> Self {
        let pool = |shape: &[usize]| ArenaPool::new(shape, DType::F32, device, ARENA_ENTRIES);
        Self {
            layers: (0..layers)
                .map(|_| (pool(&[d_key, d]), pool(&[d_key])))
                .collect(),
        }
    }

    /// Slots made, over every layer.
    pub fn entries(&self) -> usize {
        self.layers.iter().map(|(a, _)| a.entries()).sum()
    }

    /// Slots held by memories, over every layer.
    pub fn in_use(&self) -> usize {
        self.layers.iter().map(|(a, _)| a.in_use()).sum()
    }

    fn layer(&self, layer: usize) -> Result<&(ArenaPool, ArenaPool)> {
        self.layers
            .get(layer)
            .ok_or_else(|| crate::error::ModelError::Shape(format!("no memory layer {layer}")))
    }

    /// A never-written memory of `layer` in an entry of this pool (zeroed).
    pub fn take(&self, layer: usize) -> Result<LayerMemory> {
        let (a, z) = self.layer(layer)?;
        Ok(LayerMemory {
            a: Pooled::zeros_in(a)?,
            z: Pooled::zeros_in(z)?,
            written: false,
        })
    }

    /// `memory` (held anywhere: host memory after a preemption or a move) copied into an entry of
    /// this pool for `layer`.
    pub fn adopt(&self, layer: usize, memory: &LayerMemory) -> Result<LayerMemory> {
        let (a, z) = self.layer(layer)?;
        Ok(LayerMemory {
            a: Pooled::new_in(a, memory.a())?,
            z: Pooled::new_in(z, memory.z())?,
            written: memory.written,
        })
    }

    /// A copy of `memory`, which is in this pool's entries (another request's), in new entries.
    pub fn copy(&self, layer: usize, memory: &LayerMemory) -> Result<LayerMemory> {
        let (a, z) = self.layer(layer)?;
        // Through fresh tensors: an entry is a view of the arena the new one is made in.
        Ok(LayerMemory {
            a: Pooled::new_in(a, &memory.a().copy()?)?,
            z: Pooled::new_in(z, &memory.z().copy()?)?,
            written: memory.written,
        })
    }
}

/// One layer's associative memory of one request: in [`MemoryPool`] entries while its request
/// runs, in tensors of its own while it is preempted or moves.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct LayerMemory {
    a: Pooled,
    z: Pooled,
    written: bool,
}

/// What one write adds to a [`LayerMemory`].
#[derive(Debug, Clone)]
pub struct MemoryUpdate {
    delta_a: Tensor,
    delta_z: Tensor,
}

impl MemoryUpdate {
    /// An update of `delta_a` `[d_key, d]` and `delta_z` `[d_key]` (float32): what a write adds
    /// (tests build fake ones).
    pub fn new(delta_a: Tensor, delta_z: Tensor) -> Self {
        Self { delta_a, delta_z }
    }
}

impl LayerMemory {
    /// The empty memory: `A = 0`, `z = 0`, never written.
    pub fn zeros(d_key: usize, d: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            a: Pooled::own(Tensor::zeros((d_key, d), DType::F32, device)?),
            z: Pooled::own(Tensor::zeros(d_key, DType::F32, device)?),
            written: false,
        })
    }

    /// Bytes of `A` and `z`.
    pub fn bytes(&self) -> usize {
        self.a.bytes() + self.z.bytes()
    }

    /// The same memory in tensors of its own on `device` (host memory while its request is
    /// preempted): a copy, never a view of a pool entry (the entry goes back when `self` is
    /// dropped).
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self {
            a: self.a.to_device(device)?,
            z: self.z.to_device(device)?,
            written: self.written,
        })
    }

    /// Whether it lives in a pool entry.
    pub fn is_pooled(&self) -> bool {
        self.a.is_pooled()
    }

    /// A memory with the given state (e.g. upstream's `W_mem[l]`, `z[l]`), marked written.
    pub fn from_state(a: Tensor, z: Tensor) -> Result<Self> {
        Ok(Self {
            a: Pooled::own(a.to_dtype(DType::F32)?),
            z: Pooled::own(z.to_dtype(DType::F32)?),
            written: true,
        })
    }

    /// `A` `[d_key, d]` (the read is `phi(q) A`).
    pub fn a(&self) -> &Tensor {
        self.a.tensor()
    }

    /// `z` `[d_key]`.
    pub fn z(&self) -> &Tensor {
        self.z.tensor()
    }

    /// Whether a segment has written this layer (reads are skipped before that; upstream's
    /// `first_seg`).
    pub fn is_written(&self) -> bool {
        self.written
    }

    /// Adds a write (in its pool entry when it has one).
    pub fn apply(&mut self, u: MemoryUpdate) -> Result<()> {
        // Threaded on the CPU (float32): the add ran on the engine thread alone.
        let a = crate::transformer::cpu::add(self.a(), &u.delta_a)?;
        let z = crate::transformer::cpu::add(self.z(), &u.delta_z)?;
        self.a.set(a)?;
        self.z.set(z)?;
        self.written = true;
        Ok(())
    }
}

/// DPFP over the last dim (float32): `[..., d_mem]` to `[..., 2 · nu · d_mem]`.
pub fn dpfp(x: &Tensor, nu: usize) -> Result<Tensor> {
    let u = Tensor::cat(&[x.relu()?, x.neg()?.relu()?], D::Minus1)?;
    let n = u.dim(D::Minus1)?;
    let mut parts = Vec::with_capacity(nu);
    for j in 1..=nu {
        // torch.roll(u, j)[i] = u[(i - j) mod n].
        let j = j % n;
        let rolled = if j == 0 {
            u.clone()
        } else {
            Tensor::cat(
                &[
                    u.narrow(D::Minus1, n - j, j)?,
                    u.narrow(D::Minus1, 0, n - j)?,
                ],
                D::Minus1,
            )?
        };
        parts.push((&u * rolled)?);
    }
    Ok(Tensor::cat(&parts, D::Minus1)?)
}

/// The read term `phi(q) A / (phi(q) · z + eps)` `[C, n, d]` (float32) of keys
/// `phi_q` `[C, n, d_key]` against memories `a` `[C, d_key, d]` and `z` `[C, d_key]`. `bf16`
/// (the bf16 compute mode): `phi(q) A` multiplies bfloat16-rounded operands with float32
/// sums; the memory itself and the denominator stay float32.
pub fn read_term(phi_q: &Tensor, a: &Tensor, z: &Tensor, eps: f64, bf16: bool) -> Result<Tensor> {
    let num = matmul(phi_q, a, bf16)?;
    let den = (matmul(phi_q, &z.unsqueeze(D::Minus1)?, false)? + eps)?;
    Ok(num.broadcast_div(&den)?)
}

/// Inputs of a batched write: per cell, the memory rows' projections and the old state.
pub struct WriteInputs<'a> {
    /// `phi(o W_mk)` `[C, M, d_key]`.
    pub k: &'a Tensor,
    /// `o W_mv` `[C, M, d]`.
    pub v: &'a Tensor,
    /// `o W_mb + b` before the sigmoid, `[C, M, 1]`.
    pub beta_logit: &'a Tensor,
    /// Old `A` `[C, d_key, d]` and `z` `[C, d_key]`.
    pub a: &'a Tensor,
    pub z: &'a Tensor,
    /// Per cell: 1.0 on the layer's first write, else 0.0, `[C]`.
    pub first: &'a Tensor,
    pub correction: bool,
    pub eps: f64,
    /// The bf16 compute mode: `k A` and `kᵀ (v - v_prev)` multiply bfloat16-rounded operands
    /// with float32 sums (the memory stays float32).
    pub bf16: bool,
}

/// The updates `(ΔA [C, d_key, d], Δz [C, d_key])` of a batch of writes (all float32).
pub fn write_delta(w: &WriteInputs) -> Result<(Tensor, Tensor)> {
    let beta = candle_nn::ops::sigmoid(w.beta_logit)?;
    let first = w.first.reshape((w.first.elem_count(), 1, 1))?;
    let keep = first.affine(-1.0, 1.0)?;
    // den_j = k_j · z + eps; on a first write z = 0 and A = 0, so v_prev = 0 / eps = 0 exactly.
    let den = (matmul(w.k, &w.z.unsqueeze(D::Minus1)?, false)? + w.eps)?;
    let v_prev = matmul(w.k, w.a, w.bf16)?.broadcast_div(&den)?;
    let delta_a = matmul(
        &w.k.transpose(1, 2)?,
        &(w.v - v_prev)?.broadcast_mul(&beta)?,
        w.bf16,
    )?;
    let k = w.k;
    let delta_z = if w.correction {
        let norm = (k.sqr()?.sum_keepdim(D::Minus1)? + w.eps)?;
        let gamma = (1.0 - den.div(&norm)?)?.clamp(0f32, 1f32)?;
        // gamma = 1 on the first write (the sequential semantics; see the module doc of
        // `grouped` for upstream's diagonal quirk).
        let gamma = (gamma.broadcast_mul(&keep)? + first.broadcast_as(gamma.shape())?)?;
        k.broadcast_mul(&gamma)?.sum(1)?
    } else {
        k.sum(1)?
    };
    Ok((delta_a, delta_z))
}

/// Splits batched deltas into one update per cell.
pub fn updates(delta_a: &Tensor, delta_z: &Tensor) -> Result<Vec<MemoryUpdate>> {
    (0..delta_a.dim(0)?)
        .map(|c| {
            Ok(MemoryUpdate {
                delta_a: delta_a.get(c)?,
                delta_z: delta_z.get(c)?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Memories live in pool entries: a write lands in the entry, a dropped memory gives its entry
    /// back, a reused entry starts from zero, a copy to host memory is independent of the entry,
    /// and adopting a copy puts its values (and its written flag) back in an entry.
    #[test]
    fn memories_live_in_pool_entries_that_come_back_clean() -> Result<()> {
        let pool = MemoryPool::new(2, 3, 4, &Device::Cpu);
        let mut m = pool.take(1)?;
        assert!(m.is_pooled() && !m.is_written());
        assert_eq!(
            (pool.entries(), pool.in_use()),
            (ARENA_ENTRIES, 1),
            "made as needed"
        );
        let delta_a = Tensor::arange(0f32, 12.0, &Device::Cpu)?.reshape((3, 4))?;
        let delta_z = Tensor::new(&[1f32, 2.0, 3.0], &Device::Cpu)?;
        m.apply(MemoryUpdate::new(delta_a.clone(), delta_z.clone()))?;
        m.apply(MemoryUpdate::new(delta_a.clone(), delta_z.clone()))?;
        assert!(m.is_written());
        assert_eq!(values(m.a()), values(&(&delta_a * 2.0)?));
        assert_eq!(values(m.z()), vec![2.0, 4.0, 6.0]);
        let host = m.to_device(&Device::Cpu)?;
        assert!(!host.is_pooled());
        drop(m);
        assert_eq!(pool.in_use(), 0, "the slot came back");
        // The same entry again: clean, and writing it leaves the host copy alone.
        let mut again = pool.take(1)?;
        assert_eq!(values(again.a()), vec![0.0; 12]);
        again.apply(MemoryUpdate::new(delta_a.clone(), delta_z.clone()))?;
        assert_eq!(values(host.a()), values(&(&delta_a * 2.0)?));
        // Adopting the host copy into another entry.
        let back = pool.adopt(1, &host)?;
        assert!(back.is_pooled() && back.is_written());
        assert_eq!(values(back.a()), values(host.a()));
        assert_eq!(values(back.z()), values(host.z()));
        assert_eq!(pool.in_use(), 2);
        // More requests than an arena holds: a second arena.
        let many: Vec<LayerMemory> = (0..ARENA_ENTRIES)
            .map(|_| pool.take(0))
            .collect::<Result<_>>()?;
        let extra = pool.take(0)?;
        assert_eq!(pool.entries(), 3 * ARENA_ENTRIES);
        drop((many, extra, again, back));
        assert_eq!(pool.in_use(), 0);
        assert!(pool.take(2).is_err(), "two layers");
        Ok(())
    }

    #[test]
    fn dpfp_matches_torch_roll_semantics() -> Result<()> {
        let x = Tensor::new(&[[1f32, -2.0]], &Device::Cpu)?;
        // u = [1, 0, 0, 2]; roll 1 = [2, 1, 0, 0]; roll 2 = [0, 2, 1, 0].
        let y: Vec<Vec<f32>> = dpfp(&x, 2)?.to_vec2()?;
        assert_eq!(y, vec![vec![2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]);
        let x = Tensor::new(&[[1f32, 3.0]], &Device::Cpu)?;
        // u = [1, 3, 0, 0]; roll 1 = [0, 1, 3, 0]; roll 3 = [3, 0, 0, 1].
        let y: Vec<Vec<f32>> = dpfp(&x, 3)?.to_vec2()?;
        assert_eq!(y[0][..4], [0.0, 3.0, 0.0, 0.0]);
        assert_eq!(y[0][8..], [3.0, 0.0, 0.0, 0.0]);
        Ok(())
    }

    #[test]
    fn first_write_has_unit_gamma_and_no_previous_value() -> Result<()> {
        let dev = Device::Cpu;
        let k = Tensor::new(&[[[0.5f32, 0.0], [0.0, 2.0]]], &dev)?;
        let v = Tensor::new(&[[[1f32], [3.0]]], &dev)?;
        let beta_logit = Tensor::zeros((1, 2, 1), DType::F32, &dev)?;
        let a = Tensor::zeros((1, 2, 1), DType::F32, &dev)?;
        let write = |z: &Tensor, first: &Tensor, bf16: bool| {
            write_delta(&WriteInputs {
                k: &k,
                v: &v,
                beta_logit: &beta_logit,
                a: &a,
                z,
                first,
                correction: true,
                eps: 1e-5,
                bf16,
            })
        };
        let z = Tensor::zeros((1, 2), DType::F32, &dev)?;
        let first = Tensor::ones(1, DType::F32, &dev)?;
        // Every operand is a bfloat16 value: the bf16 products give the same bits.
        for bf16 in [false, true] {
            let (da, dz) = write(&z, &first, bf16)?;
            // beta = 0.5: A = 0.5 · (k0ᵀ v0 + k1ᵀ v1); z = k0 + k1.
            assert_eq!(da.to_vec3::<f32>()?, vec![vec![vec![0.25], vec![3.0]]]);
            assert_eq!(dz.to_vec2::<f32>()?, vec![vec![0.5, 2.0]]);
        }
        // Not first: gamma_j = clip(1 - (k_j · z + eps) / (|k_j|² + eps)).
        let z = Tensor::new(&[[0.5f32, 0.0]], &dev)?;
        let first = Tensor::zeros(1, DType::F32, &dev)?;
        let (_, dz) = write(&z, &first, false)?;
        let dz: Vec<f32> = dz.get(0)?.to_vec1()?;
        let g0 = 1.0 - (0.25f32 + 1e-5) / (0.25 + 1e-5); // 0
        let g1 = 1.0 - 1e-5f32 / (4.0 + 1e-5);
        assert!(
            (dz[0] - 0.5 * g0).abs() < 1e-6 && (dz[1] - 2.0 * g1).abs() < 1e-6,
            "{dz:?}"
        );
        Ok(())
    }
}
