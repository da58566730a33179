//! The ragged attention path: every sequence of a packed call attends in one operation
//! (`wavefront_kernels::attention`): one launch of the CUDA kernel on a GPU, the kernel's CPU
//! reference elsewhere. The per-sequence path ([`AttentionKernel::Sdpa`]) runs one
//! `softmax(q kᵀ) v` of candle ops per sequence instead.
//!
//! A call's sequences, mask rules and buffer indices become one [`RaggedPlan`] when its
//! [`super::PackedLayout`] is built, uploaded to the device once and shared by every layer; per
//! layer the operation runs over `q` `[H, rows, D]` and the sequences' keys and values as runs
//! `[H_kv, T_i, D]` (a cache's pages, read in place through its page table; a shared prefix's
//! pages; the call's fresh rows), the layout the block's activations and caches already have.
//! On a GPU the kernel reads each run where it lies, from a table of the runs' addresses
//! uploaded per layer; the CPU reference reads them concatenated.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
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
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sdpa" => Ok(AttentionKernel::Sdpa),
            "ragged" => Ok(AttentionKernel::Ragged),
            other => Err(ModelError::UnknownAttentionKernel {
                name: other.to_owned(),
                expected: Self::NAMES.join(", "),
            }),
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
            MaskRule::SegmentCausal { prefix, segment } => Mask::SegmentCausal {
                prefix: prefix as u32,
                segment: segment as u32,
            },
            MaskRule::SlidingCausal { window } => Mask::SlidingCausal {
                window: window as u32,
            },
            MaskRule::RecentCache { cached, window } => Mask::RecentCache {
                cached: cached as u32,
                window: window as u32,
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
        layout.validate().map_err(ModelError::from)?;
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
    /// `keys` the sequences' keys and values (after RoPE) as runs `[H_kv, T_i, D]` that follow
    /// each other, in plan order, along the call's key axis (a sequence may bring several: its
    /// cache's pages read in place, a shared prefix's pages, its own fresh rows); returns
    /// `[H, N, D]`. On a GPU the kernel reads every run where it is (a page arena's slice, the
    /// call's rows): nothing is concatenated. The CPU reference reads them concatenated.
    pub(crate) fn attend(
        self: &Arc<Self>,
        q: &Tensor,
        keys: &[(Tensor, Tensor)],
        scale: f64,
    ) -> Result<Tensor> {
        let (h, n, d) = q.dims3()?;
        let hkv = keys.first().map_or(h, |(k, _)| k.dim(0).unwrap_or(h));
        let mut brought = 0;
        let mut runs = Vec::with_capacity(keys.len());
        for (k, v) in keys {
            let len = k.dim(1)?;
            if v.dims() != k.dims() || k.dim(0)? != hkv || k.dim(2)? != d {
                return Err(ModelError::Shape(format!(
                    "a run of keys {:?} / values {:?} does not fit [{hkv}, _, {d}]",
                    k.dims(),
                    v.dims()
                )));
            }
            brought += len;
            if len > 0 {
                runs.push(Run::of(k, v)?);
            }
        }
        if brought != self.keys() {
            return Err(ModelError::Shape(format!(
                "the sequences brought {brought} keys, the call's layout has {}",
                self.keys()
            )));
        }
        let q = q.contiguous()?;
        let dtype = q.dtype();
        let on_host_in = |t: &Tensor| -> Result<Tensor> {
            Ok(if dtype == DType::F32 {
                t.clone()
            } else {
                t.to_dtype(DType::F32)?
            })
        };
        let op = |runs: Vec<Run>| RaggedOp {
            plan: self.clone(),
            runs,
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: d,
            scale: scale as f32,
        };
        let out = if q.device().is_cuda() {
            q.apply_op1_no_bwd(&op(runs))?
        } else {
            // The CPU reference computes in float32.
            let runs = runs
                .iter()
                .map(|r| {
                    Ok(Run {
                        k: on_host_in(&r.k)?,
                        v: on_host_in(&r.v)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            on_host_in(&q)?
                .apply_op1_no_bwd(&op(runs))?
                .to_dtype(dtype)?
        };
        debug_assert_eq!(out.dims(), &[h, n, d]);
        Ok(out)
    }
}

/// One run of a call's keys and values `[H_kv, T, D]`, each key's `D` values contiguous and
/// its keys `D` apart within a head (a page arena's slice, or any contiguous tensor), with the
/// same layout for keys and values: what the kernel reads in place.
#[derive(Debug)]
struct Run {
    k: Tensor,
    v: Tensor,
}

impl Run {
    fn of(k: &Tensor, v: &Tensor) -> Result<Self> {
        let readable = |t: &Tensor| {
            let st = t.stride();
            st.len() == 3 && st[2] == 1 && st[1] == t.dim(2).unwrap_or(0)
        };
        if readable(k) && readable(v) && k.stride() == v.stride() {
            Ok(Self {
                k: k.clone(),
                v: v.clone(),
            })
        } else {
            Ok(Self {
                k: k.contiguous()?,
                v: v.contiguous()?,
            })
        }
    }
}

/// The ragged operation over contiguous `q` `[H, rows, D]` and the call's runs of keys (the
/// layout the block's activations and caches already have: nothing is transposed).
struct RaggedOp {
    plan: Arc<RaggedPlan>,
    runs: Vec<Run>,
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

impl CustomOp1 for RaggedOp {
    fn name(&self) -> &'static str {
        "ragged-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let layout = self.layout();
        let (hkv, d) = (self.n_kv_heads, self.head_dim);
        let cat = |pick: fn(&Run) -> &Tensor| -> candle_core::Result<Vec<f32>> {
            let parts: Vec<&Tensor> = self.runs.iter().map(pick).collect();
            if parts.is_empty() {
                return Ok(Vec::new());
            }
            Tensor::cat(&parts, 1)?
                .reshape(hkv * layout.keys() * d)?
                .to_vec1::<f32>()
        };
        let (k, v) = (cat(|r| &r.k)?, cat(|r| &r.v)?);
        let out = ragged_attention(&layout, cpu_values(s, l)?, &k, &v)
            .map_err(candle_core::Error::wrap)?;
        Ok((CpuStorage::F32(out), self.shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, s, l)
    }
}

/// The CUDA kernels of `dev`, loaded once per device and launched on candle's stream of it
/// (K/V page writes use them too).
#[cfg(feature = "cuda")]
pub(crate) fn cuda_kernels(
    dev: &candle_core::cuda_backend::CudaDevice,
) -> candle_core::Result<std::sync::Arc<wavefront_kernels::cuda::Kernels>> {
    cuda::kernels(dev)
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA side: the kernels are loaded once per candle device and launched on candle's
    //! stream of it, so they are ordered with candle's own work without a synchronisation. The
    //! keys are read where the runs' tensors hold them (page arenas, the call's rows): the
    //! launch uploads only their table of pointers.

    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::{CudaDevice, DeviceId};
    use candle_core::{CudaStorage, DType, Layout, Shape, Storage, Tensor};
    use cudarc::driver::{CudaView, DeviceRepr};
    use half::bf16;
    use wavefront_kernels::cuda::{Elem, Kernels, KvRun, RaggedDims, RaggedTables};

    use super::RaggedOp;

    fn msg(e: impl std::fmt::Display) -> candle_core::Error {
        candle_core::Error::Msg(format!("ragged attention: {e}"))
    }

    pub(super) fn kernels(dev: &CudaDevice) -> candle_core::Result<Arc<Kernels>> {
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

    /// The elements a run `[H_kv, n, D]` (head stride `hs`, keys `D` apart) spans in its
    /// storage, from its first key of head 0 to the last value of its last head.
    fn run_view<'a, T: candle_core::cuda_backend::CudaDType>(
        s: &'a Storage,
        l: &Layout,
        dev: &CudaDevice,
    ) -> candle_core::Result<CudaView<'a, T>> {
        let Storage::Cuda(c) = s else {
            return Err(msg("a run of keys is not on the GPU"));
        };
        if c.device().id() != dev.id() {
            return Err(msg("a run of keys is on another GPU than the queries"));
        }
        let (hkv, n, d) = l.shape().dims3()?;
        let hs = l.stride()[0];
        let start = l.start_offset();
        Ok(c.as_cuda_slice::<T>()?
            .slice(start..start + (hkv - 1) * hs + n * d))
    }

    fn run<T: Elem + candle_core::cuda_backend::CudaDType + DeviceRepr>(
        op: &RaggedOp,
        s: &CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        let dev = s.device().clone();
        let q = view::<T>(s, l)?;
        let tables = op
            .plan
            .tables
            .as_ref()
            .ok_or_else(|| msg("the call's layout was built for another device"))?;
        let guards: Vec<_> = tables.iter().map(Tensor::storage_and_layout).collect();
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
        let held: Vec<_> = op
            .runs
            .iter()
            .map(|r| (r.k.storage_and_layout(), r.v.storage_and_layout()))
            .collect();
        let runs = held
            .iter()
            .map(|((ks, kl), (vs, vl))| {
                Ok(KvRun {
                    k: run_view::<T>(ks, kl, &dev)?,
                    v: run_view::<T>(vs, vl, &dev)?,
                    keys: kl.dims()[1],
                    head_stride: kl.stride()[0],
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let dims = RaggedDims {
            rows: op.plan.layout.rows(),
            keys: op.plan.layout.keys(),
            n_heads: op.n_heads,
            n_kv_heads: op.n_kv_heads,
            head_dim: op.head_dim,
            scale: op.scale,
            max_seq_keys: op.plan.layout.max_seq_keys(),
        };
        // SAFETY: the kernel writes every element of `out` (each (row, head) stores its
        // head_dim values, zeros for a row with no visible key) before anything reads it.
        let mut out = unsafe { dev.alloc::<T>(q.len()) }?;
        kernels(&dev)?
            .ragged_attention_paged(&dims, &tables, &q, &runs, &mut out)
            .map_err(msg)?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }

    pub(super) fn forward(
        op: &RaggedOp,
        s: &CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let out = match s.dtype() {
            DType::F32 => run::<f32>(op, s, l)?,
            DType::BF16 => run::<bf16>(op, s, l)?,
            other => return Err(msg(format!("no kernel for {other:?}"))),
        };
        Ok((out, op.shape()))
    }
}
