//! The ragged attention path: every sequence of a packed call attends in one operation
//! (`wavefront_kernels::attention`): one launch of the CUDA kernel on a GPU, the kernel's CPU
//! reference elsewhere. The per-sequence path ([`AttentionKernel::Sdpa`]) runs one
//! `softmax(q kᵀ) v` of candle ops per sequence instead.
//!
//! A call's sequences, mask rules and buffer indices become one [`RaggedPlan`] when its
//! [`super::PackedLayout`] is built, uploaded to the device once and shared by every layer; per
//! layer the sequences' assembled keys and values are concatenated along the key axis and the
//! operation runs over `q` `[H, rows, D]`, `k`/`v` `[H_kv, keys, D]`, the layout the block's
//! activations and caches already have.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};
use wavefront_kernels::attention::{ragged_attention, Mask, RaggedLayout, RaggedSeq};

use super::attention::MaskRule;
use crate::error::{ModelError, Result};

/// How a packed call's attention runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// One scaled-dot-product attention of candle ops per sequence (padding-free, one set of
    /// launches per sequence and layer).
    #[default]
    Sdpa,
    /// All sequences in one ragged attention operation per layer (the `wavefront-kernels` CUDA
    /// kernel on a GPU, its CPU reference on the CPU).
    Ragged,
}

impl AttentionKernel {
    pub const ALL: [AttentionKernel; 2] = [AttentionKernel::Sdpa, AttentionKernel::Ragged];
    pub const NAMES: [&'static str; 2] = ["sdpa", "ragged"];
}

impl fmt::Display for AttentionKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttentionKernel::Sdpa => "sdpa",
            AttentionKernel::Ragged => "ragged",
        })
    }
}

impl FromStr for AttentionKernel {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "sdpa" => Ok(AttentionKernel::Sdpa),
            "ragged" => Ok(AttentionKernel::Ragged),
            other => Err(format!(
                "unknown attention kernel {other:?}: expected one of {}",
                Self::NAMES.join(", ")
            )),
        }
    }
}

/// A model whose attention path can be chosen after loading.
pub trait SelectAttention {
    /// Runs every later call's attention with `kernel`; refused (with the reason) by a model
    /// that cannot.
    fn select_attention(&mut self, kernel: AttentionKernel) -> Result<()>;
}

impl From<MaskRule> for Mask {
    fn from(rule: MaskRule) -> Self {
        match rule {
            MaskRule::Bidirectional => Mask::Bidirectional,
            MaskRule::Causal => Mask::Causal,
            MaskRule::ShadowBlock {
                main_len,
                block_start,
            } => Mask::ShadowBlock {
                main_len: main_len as u32,
                block_start: block_start as u32,
            },
            MaskRule::BlockCausal { block } => Mask::BlockCausal {
                block: block as u32,
            },
        }
    }
}

/// One packed call's sequences for the ragged operation: row and key ranges, mask rules and
/// buffer indices (host), and on a GPU the same tables on the device.
#[derive(Debug)]
pub(crate) struct RaggedPlan {
    layout: RaggedLayout,
    /// `seq_table`, `row_seq`, `row_index`, `key_index` as u32 tensors on a CUDA device; `None`
    /// on the CPU.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    tables: Option<[Tensor; 4]>,
}

impl RaggedPlan {
    /// The plan of sequences whose rows are `rows[s]`, keys' buffer indices `keys[s]` (in the
    /// order the keys are assembled) and mask rules `masks[s]`, on `device`.
    pub(crate) fn new(
        seqs: impl IntoIterator<Item = (Vec<u32>, Vec<u32>, MaskRule)>,
        device: &Device,
    ) -> Result<Self> {
        let mut layout = RaggedLayout {
            // Heads and scale are the call's (a tensor-parallel rank holds some of the heads).
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 0,
            scale: 1.0,
            seqs: Vec::new(),
            row_index: Vec::new(),
            key_index: Vec::new(),
        };
        for (rows, keys, mask) in seqs {
            let (r0, k0) = (layout.row_index.len() as u32, layout.key_index.len() as u32);
            layout.seqs.push(RaggedSeq {
                rows: r0..r0 + rows.len() as u32,
                keys: k0..k0 + keys.len() as u32,
                mask: mask.into(),
            });
            layout.row_index.extend(rows);
            layout.key_index.extend(keys);
        }
        layout
            .validate()
            .map_err(|e| ModelError::Shape(e.to_string()))?;
        let tables = Self::upload(&layout, device)?;
        Ok(Self { layout, tables })
    }

    fn upload(layout: &RaggedLayout, device: &Device) -> Result<Option<[Tensor; 4]>> {
        if !device.is_cuda() {
            return Ok(None);
        }
        let t = |v: Vec<u32>| -> Result<Tensor> {
            let n = v.len();
            Ok(Tensor::from_vec(v, n, device)?)
        };
        Ok(Some([
            t(layout.seq_table())?,
            t(layout.row_seq())?,
            t(layout.row_index.clone())?,
            t(layout.key_index.clone())?,
        ]))
    }

    /// This plan on `device`.
    pub(crate) fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self {
            layout: self.layout.clone(),
            tables: Self::upload(&self.layout, device)?,
        })
    }

    /// Keys the plan's sequences hold in all.
    pub(crate) fn keys(&self) -> usize {
        self.layout.keys()
    }

    /// Attention of every sequence over its own keys in one operation: `q` `[H, N, D]`,
    /// `keys` the sequences' keys and values (after RoPE) as parts `[H_kv, T_i, D]` that
    /// concatenate, in plan order, to every sequence's keys (a sequence may bring several, e.g.
    /// a shared prefix and its own suffix); returns `[H, N, D]`.
    pub(crate) fn attend(
        self: &Arc<Self>,
        q: &Tensor,
        keys: &[(Tensor, Tensor)],
        scale: f64,
    ) -> Result<Tensor> {
        let (h, n, d) = q.dims3()?;
        let hkv = keys.first().map_or(h, |(k, _)| k.dim(0).unwrap_or(h));
        let cat = |i: usize| -> Result<Tensor> {
            let parts: Vec<&Tensor> = keys
                .iter()
                .map(|kv| if i == 0 { &kv.0 } else { &kv.1 })
                .collect();
            Ok(if parts.len() == 1 {
                parts[0].contiguous()?
            } else {
                Tensor::cat(&parts, 1)?
            })
        };
        let (k, v) = (cat(0)?, cat(1)?);
        if k.dim(1)? != self.keys() {
            return Err(ModelError::Shape(format!(
                "the sequences brought {} keys, the call's layout has {}",
                k.dim(1)?,
                self.keys()
            )));
        }
        let q = q.contiguous()?;
        let op = RaggedOp {
            plan: self.clone(),
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: d,
            scale: scale as f32,
        };
        let dtype = q.dtype();
        let out = if q.device().is_cuda() || dtype == DType::F32 {
            q.apply_op3_no_bwd(&k, &v, &op)?
        } else {
            // The CPU reference computes in float32.
            let f = |t: &Tensor| t.to_dtype(DType::F32);
            f(&q)?
                .apply_op3_no_bwd(&f(&k)?, &f(&v)?, &op)?
                .to_dtype(dtype)?
        };
        debug_assert_eq!(out.dims(), &[h, n, d]);
        Ok(out)
    }
}

/// The ragged operation over contiguous `q` `[H, rows, D]`, `k`/`v` `[H_kv, keys, D]` (the
/// layout the block's activations and caches already have: nothing is transposed).
struct RaggedOp {
    plan: Arc<RaggedPlan>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
}

impl RaggedOp {
    fn layout(&self) -> RaggedLayout {
        RaggedLayout {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            scale: self.scale,
            ..self.plan.layout.clone()
        }
    }

    fn shape(&self) -> Shape {
        Shape::from((self.n_heads, self.plan.layout.rows(), self.head_dim))
    }
}

/// The contiguous values of a CPU tensor.
fn cpu_values<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let (start, end) = l.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg("ragged attention needs contiguous inputs".into())
    })?;
    Ok(&s.as_slice::<f32>()?[start..end])
}

impl CustomOp3 for RaggedOp {
    fn name(&self) -> &'static str {
        "ragged-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = ragged_attention(
            &self.layout(),
            cpu_values(s1, l1)?,
            cpu_values(s2, l2)?,
            cpu_values(s3, l3)?,
        )
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok((CpuStorage::F32(out), self.shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, [(s1, l1), (s2, l2), (s3, l3)])
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA side: the kernels are loaded once per candle device and launched on candle's
    //! stream of it, so they are ordered with candle's own work without a synchronisation.

    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::{CudaDevice, DeviceId};
    use candle_core::{CudaStorage, DType, Layout, Shape, Storage};
    use cudarc::driver::{CudaView, DeviceRepr};
    use half::bf16;
    use wavefront_kernels::cuda::{Elem, Kernels, RaggedDims, RaggedTables};

    use super::RaggedOp;

    fn msg(e: impl std::fmt::Display) -> candle_core::Error {
        candle_core::Error::Msg(format!("ragged attention: {e}"))
    }

    fn kernels(dev: &CudaDevice) -> candle_core::Result<Arc<Kernels>> {
        static LOADED: OnceLock<Mutex<HashMap<DeviceId, Arc<Kernels>>>> = OnceLock::new();
        let mut map = LOADED
            .get_or_init(Mutex::default)
            .lock()
            .map_err(|_| msg("the kernel cache is poisoned"))?;
        if let Some(k) = map.get(&dev.id()) {
            return Ok(k.clone());
        }
        let k = Arc::new(Kernels::on_stream(dev.cuda_stream()).map_err(msg)?);
        map.insert(dev.id(), k.clone());
        Ok(k)
    }

    /// The view of a contiguous tensor's elements.
    fn view<'a, T: candle_core::cuda_backend::CudaDType>(
        s: &'a CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<CudaView<'a, T>> {
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| msg("inputs must be contiguous"))?;
        Ok(s.as_cuda_slice::<T>()?.slice(start..end))
    }

    fn run<T: Elem + candle_core::cuda_backend::CudaDType + DeviceRepr>(
        op: &RaggedOp,
        inputs: [(&CudaStorage, &Layout); 3],
    ) -> candle_core::Result<CudaStorage> {
        let dev = inputs[0].0.device().clone();
        let [q, k, v] = inputs.map(|(s, l)| view::<T>(s, l));
        let (q, k, v) = (q?, k?, v?);
        let tables = op
            .plan
            .tables
            .as_ref()
            .ok_or_else(|| msg("the call's layout was built for another device"))?;
        let guards: Vec<_> = tables.iter().map(|t| t.storage_and_layout()).collect();
        let slices = guards
            .iter()
            .map(|(s, _)| match &**s {
                Storage::Cuda(c) => c.as_cuda_slice::<u32>(),
                _ => Err(msg("the call's layout was built for another device")),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let tables = RaggedTables {
            seq_table: slices[0],
            row_seq: slices[1],
            row_index: slices[2],
            key_index: slices[3],
        };
        let dims = RaggedDims {
            rows: op.plan.layout.rows(),
            keys: op.plan.layout.keys(),
            n_heads: op.n_heads,
            n_kv_heads: op.n_kv_heads,
            head_dim: op.head_dim,
            scale: op.scale,
        };
        // SAFETY: the kernel writes every element of `out` (each (row, head) stores its
        // head_dim values, zeros for a row with no visible key) before anything reads it.
        let mut out = unsafe { dev.alloc::<T>(q.len()) }?;
        kernels(&dev)?
            .ragged_attention_with(&dims, &tables, &q, &k, &v, &mut out)
            .map_err(msg)?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }

    pub(super) fn forward(
        op: &RaggedOp,
        inputs: [(&CudaStorage, &Layout); 3],
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let out = match inputs[0].0.dtype() {
            DType::F32 => run::<f32>(op, inputs)?,
            DType::BF16 => run::<bf16>(op, inputs)?,
            other => return Err(msg(format!("no kernel for {other:?}"))),
        };
        Ok((out, op.shape()))
    }
}
