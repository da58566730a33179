//! Attention on the CPU kernel of `wavefront-kernels`: every sequence of a packed call in one
//! threaded operation, its keys and values read where they live (a cache buffer, a shared
//! prefix, the call's own rows) through [`KvBlock`]s, nothing concatenated.
//!
//! Used for float32 tensors on the CPU; elsewhere the callers keep their candle path.

use std::ops::Deref;

use candle_core::{DType, Device, Layout, Storage, Tensor};
use wavefront_kernels::attention::Mask;
use wavefront_kernels::cpu::attention::{attention_vec, Heads, KvBlock, KvData, SeqAttention};

use crate::error::{ModelError, Result};

/// A buffer of `len` floats for a kernel's output (zeroed: large ones come from fresh pages,
/// which the allocator does not clear again).
pub(crate) fn output(len: usize) -> Vec<f32> {
    vec![0f32; len]
}

/// Whether `t` takes the CPU kernels (float32 on the CPU).
pub(crate) fn on_cpu_f32(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// A read guard on a CPU tensor's storage with its layout.
pub(crate) struct Borrowed<'a> {
    guard: Box<dyn Deref<Target = Storage> + 'a>,
    layout: &'a Layout,
}

impl<'a> Borrowed<'a> {
    /// Borrows `t`, which must be float32 on the CPU.
    pub(crate) fn new(t: &'a Tensor) -> Result<Self> {
        if t.dtype() != DType::F32 {
            return Err(ModelError::Shape(
                "the CPU kernels take float32 tensors on the CPU".into(),
            ));
        }
        Self::kv(t)
    }

    /// Borrows keys or values `t`: float32 or bfloat16 (the bf16 K/V cache) on the CPU.
    pub(crate) fn kv(t: &'a Tensor) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        if !matches!(&*guard, Storage::Cpu(_)) || !matches!(t.dtype(), DType::F32 | DType::BF16) {
            return Err(ModelError::Shape(format!(
                "the CPU attention kernel takes float32 or bf16 keys on the CPU, not {:?} on {:?}",
                t.dtype(),
                t.device()
            )));
        }
        Ok(Self {
            guard: Box::new(guard),
            layout,
        })
    }

    /// The keys or values from the tensor's first element to the end of its storage.
    fn kv_tail(&self) -> Result<KvData<'_>> {
        let Storage::Cpu(cpu) = &**self.guard else {
            unreachable!("checked in kv");
        };
        let at = self.layout.start_offset();
        Ok(match cpu {
            candle_core::CpuStorage::BF16(x) => {
                let x = &x[at..];
                // SAFETY: `half::bf16` is a `repr(transparent)` u16.
                KvData::Bf16(unsafe {
                    std::slice::from_raw_parts(x.as_ptr().cast::<u16>(), x.len())
                })
            }
            _ => KvData::F32(&cpu.as_slice::<f32>()?[at..]),
        })
    }

    /// The values from the tensor's first element to the end of its storage.
    pub(crate) fn tail(&self) -> Result<&[f32]> {
        let Storage::Cpu(cpu) = &**self.guard else {
            unreachable!("checked in new");
        };
        Ok(&cpu.as_slice::<f32>()?[self.layout.start_offset()..])
    }

    /// A run of keys of a `[H_kv, n, D]` tensor whose rows are contiguous within a head
    /// (e.g. a narrow of a contiguous cache buffer).
    pub(crate) fn block(&'a self, values: &'a Borrowed<'a>) -> Result<KvBlock<'a>> {
        let dims = self.layout.shape().dims();
        let [_, n, _] = dims else {
            return Err(ModelError::Shape(format!("keys of shape {dims:?}")));
        };
        let head_stride = self.layout.stride()[0];
        if !kernel_layout(dims, self.layout.stride(), head_stride)
            || values.layout.shape().dims() != dims
            || !kernel_layout(dims, values.layout.stride(), head_stride)
        {
            return Err(ModelError::Shape(
                "keys and values must share a [heads, rows, dim] layout with contiguous rows"
                    .into(),
            ));
        }
        Ok(KvBlock {
            k: self.kv_tail()?,
            v: values.kv_tail()?,
            len: *n,
            head_stride,
        })
    }
}

/// Whether a `[H, n, D]` layout with `strides` has contiguous rows of `D` values, `D` apart,
/// and heads `head_stride` apart (strides of unit dims do not matter).
fn kernel_layout(dims: &[usize], strides: &[usize], head_stride: usize) -> bool {
    let [h, n, d] = dims else { return false };
    (*d <= 1 || strides[2] == 1)
        && (*n <= 1 || strides[1] == *d)
        && (*h <= 1 || strides[0] == head_stride)
}

/// `(k, v)` as they are when the kernel can read them in place, else contiguous copies.
fn readable(k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    let hs = k.stride()[0];
    let ok = k.rank() == 3
        && k.dims() == v.dims()
        && kernel_layout(k.dims(), k.stride(), hs)
        && kernel_layout(v.dims(), v.stride(), hs);
    Ok(if ok {
        (k.clone(), v.clone())
    } else {
        (k.contiguous()?, v.contiguous()?)
    })
}

/// One sequence of [`attend`]: its query rows in the call, the buffer index of each, its keys
/// and values as `[H_kv, n_i, D]` runs in key order with their buffer indices (`None`: key `t`
/// is buffer index `t`), its mask.
pub(crate) struct CpuSeq {
    pub rows: std::ops::Range<usize>,
    pub row_index: Vec<u32>,
    pub runs: Vec<(Tensor, Tensor)>,
    pub key_index: Option<Vec<u32>>,
    pub mask: Mask,
}

/// `softmax(q kᵀ · scale + mask) v` for every sequence, `q` `[H, N, D]` float32 on the CPU;
/// returns `[H, N, D]`, or `[N, H · D]` with `rows_out` (what an output projection reads).
/// `bf16`: the bf16 compute mode ([`Heads::bf16_products`]).
pub(crate) fn attend(
    q: &Tensor,
    n_kv_heads: usize,
    scale: f32,
    seqs: &[CpuSeq],
    rows_out: bool,
    bf16: bool,
) -> Result<Tensor> {
    let (h, n, d) = q.dims3()?;
    let q = q.contiguous()?;
    let qb = Borrowed::new(&q)?;
    let runs: Vec<Vec<(Tensor, Tensor)>> = seqs
        .iter()
        .map(|s| s.runs.iter().map(|(k, v)| readable(k, v)).collect())
        .collect::<Result<_>>()?;
    let held: Vec<Vec<(Borrowed, Borrowed)>> = runs
        .iter()
        .map(|r| {
            r.iter()
                .map(|(k, v)| Ok((Borrowed::kv(k)?, Borrowed::kv(v)?)))
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<_>>()?;
    let calls = seqs
        .iter()
        .zip(&held)
        .map(|(s, runs)| {
            Ok(SeqAttention {
                rows: s.rows.clone(),
                row_index: &s.row_index,
                blocks: runs
                    .iter()
                    .map(|(k, v)| k.block(v))
                    .collect::<Result<Vec<_>>>()?,
                key_index: s.key_index.as_deref(),
                mask: s.mask,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let heads = Heads {
        n_heads: h,
        n_kv_heads,
        head_dim: d,
        scale,
        rows_out,
        bf16_products: bf16,
    };
    let out = attention_vec(heads, &qb.tail()?[..h * n * d], n, &calls)?;
    Ok(if rows_out {
        Tensor::from_vec(out, (n, h * d), &Device::Cpu)?
    } else {
        Tensor::from_vec(out, (h, n, d), &Device::Cpu)?
    })
}

/// `silu(gu[.., :hidden]) · gu[.., hidden:]` of the fused gate and up products `[.., 2·hidden]`:
/// the CPU kernel for float32 on the CPU, candle ops elsewhere.
pub(crate) fn silu_mul(gu: &Tensor, hidden: usize) -> Result<Tensor> {
    gated(
        gu,
        hidden,
        Tensor::silu,
        wavefront_kernels::cpu::elementwise::silu_mul_vec,
    )
}

/// A row-wise CPU kernel over rows `[.., 2·hidden]` into rows `[.., hidden]`.
type RowKernel = fn(&[f32], usize) -> std::result::Result<Vec<f32>, wavefront_kernels::KernelError>;

/// `act(gu[.., :hidden]) · gu[.., hidden:]`: `kernel` for float32 on the CPU, `act` (candle)
/// elsewhere.
fn gated(
    gu: &Tensor,
    hidden: usize,
    act: fn(&Tensor) -> candle_core::Result<Tensor>,
    kernel: RowKernel,
) -> Result<Tensor> {
    let last = gu.rank() - 1;
    if !on_cpu_f32(gu) {
        let g = gu.narrow(last, 0, hidden)?;
        let u = gu.narrow(last, hidden, hidden)?;
        return Ok((act(&g)? * u)?);
    }
    let gu = gu.contiguous()?;
    let out = {
        let b = Borrowed::new(&gu)?;
        kernel(&b.tail()?[..gu.elem_count()], hidden).map_err(ModelError::from)?
    };
    let mut shape = gu.dims().to_vec();
    shape[last] = hidden;
    Ok(Tensor::from_vec(out, shape, &Device::Cpu)?)
}

/// `gelu_tanh(gu[.., :hidden]) · gu[.., hidden:]` of the fused gate and up products
/// `[.., 2·hidden]` (Gemma's gated MLP): the CPU kernel for float32 on the CPU, candle ops
/// elsewhere.
pub(crate) fn gelu_tanh_mul(gu: &Tensor, hidden: usize) -> Result<Tensor> {
    gated(
        gu,
        hidden,
        Tensor::gelu,
        wavefront_kernels::cpu::elementwise::gelu_tanh_mul_vec,
    )
}

/// `cap · tanh(x / cap)` of logits `[rows, V]`: the CPU kernel for float32 on the CPU, candle
/// ops elsewhere.
pub(crate) fn soft_cap(x: &Tensor, cap: f64) -> Result<Tensor> {
    if !on_cpu_f32(x) || x.rank() != 2 {
        return Ok(((x / cap)?.tanh()? * cap)?);
    }
    let mut v = x.flatten_all()?.to_vec1::<f32>()?;
    wavefront_kernels::cpu::elementwise::soft_cap(&mut v, x.dim(1)?, cap as f32)
        .map_err(ModelError::from)?;
    Ok(Tensor::from_vec(v, x.dims(), &Device::Cpu)?)
}

pub use wavefront_kernels::cpu::elementwise::RowEntropy;

/// [`RowEntropy`] of every row of `rows` `[n, width]` (host values), threaded over rows, the
/// same bits on every instruction set.
pub fn row_entropy(rows: &[f32], width: usize) -> Result<Vec<RowEntropy>> {
    Ok(wavefront_kernels::cpu::elementwise::row_entropy(
        rows, width,
    )?)
}

/// The index a uniform `u` in `[0, 1)` draws from `softmax(row)` whose statistics are `stats`.
pub fn sample_row(row: &[f32], stats: &RowEntropy, u: f32) -> usize {
    wavefront_kernels::cpu::elementwise::sample_row(row, stats, u)
}

/// RMSNorm of the rows of `x` `[.., dim]` with `w` `[dim]`, float32 on the CPU.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let x = x.contiguous()?;
    let out = {
        let (b, wb) = (Borrowed::new(&x)?, Borrowed::new(w)?);
        let dim = w.elem_count();
        wavefront_kernels::cpu::elementwise::rms_norm_vec(
            &b.tail()?[..x.elem_count()],
            &wb.tail()?[..dim],
            eps,
        )?
    };
    Ok(Tensor::from_vec(out, x.dims(), &Device::Cpu)?)
}

/// `x + a` and the RMSNorm of the sum with `w` `[dim]`, in one pass threaded over rows (all
/// float32 on the CPU, `x` and `a` of one shape; the callers check): the bits of the add and
/// then [`rms_norm`].
pub(crate) fn add_rms_norm(
    x: &Tensor,
    a: &Tensor,
    w: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    let (x, a) = (x.contiguous()?, a.contiguous()?);
    let [sum, normed] = {
        let (xb, ab, wb) = (Borrowed::new(&x)?, Borrowed::new(&a)?, Borrowed::new(w)?);
        let n = x.elem_count();
        wavefront_kernels::cpu::elementwise::add_rms_norm_vecs(
            &xb.tail()?[..n],
            &ab.tail()?[..a.elem_count()],
            &wb.tail()?[..w.elem_count()],
            eps,
        )?
    };
    Ok((
        Tensor::from_vec(sum, x.dims(), &Device::Cpu)?,
        Tensor::from_vec(normed, x.dims(), &Device::Cpu)?,
    ))
}

/// `x + a` (float32 on the CPU, one shape), threaded over rows; candle's add elsewhere.
pub(crate) fn add(x: &Tensor, a: &Tensor) -> Result<Tensor> {
    if !(on_cpu_f32(x) && on_cpu_f32(a)) || x.dims() != a.dims() || x.rank() == 0 {
        return Ok((x + a)?);
    }
    let (x, a) = (x.contiguous()?, a.contiguous()?);
    let width = x.dim(x.rank() - 1)?;
    if width == 0 {
        return Ok((x + a)?);
    }
    let sum = {
        let (xb, ab) = (Borrowed::new(&x)?, Borrowed::new(&a)?);
        let n = x.elem_count();
        wavefront_kernels::cpu::elementwise::add_vec(&xb.tail()?[..n], &ab.tail()?[..n], width)?
    };
    Ok(Tensor::from_vec(sum, x.dims(), &Device::Cpu)?)
}

/// How [`split_heads`] treats q and k before RoPE, and how RoPE pairs dims.
#[derive(Default, Clone, Copy)]
pub(crate) struct QkPrep<'a> {
    /// Biases of q and k, `H · D` and `H_kv · D` values in any shape (added first).
    pub(crate) bias: Option<(&'a Tensor, &'a Tensor)>,
    /// Per-head RMSNorm weights `[D]` of q and k, and epsilon.
    pub(crate) norm: Option<(&'a Tensor, &'a Tensor, f32)>,
    /// RoPE over dims `2i, 2i + 1` (true) or `i, i + D / 2` (false).
    pub(crate) interleaved: bool,
}

/// q `[H, N, D]`, k and v `[H_kv, N, D]` of the fused product `qkv` `[N, (H + 2 H_kv) · D]`,
/// q and k biased and normed per head as `prep` says and rotated by the rows' RoPE
/// `cos`/`sin` `[N, D / 2]`, in one pass (float32 on the CPU).
pub(crate) fn split_heads(
    qkv: &Tensor,
    (h, hkv, d): (usize, usize, usize),
    prep: QkPrep,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let n = qkv.dim(0)?;
    let qkv = qkv.contiguous()?;
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let bias = match prep.bias {
        Some((qb, kb)) => Some((qb.contiguous()?, kb.contiguous()?)),
        None => None,
    };
    let [q, k, v] = {
        let b = Borrowed::new(&qkv)?;
        let (cb, sb) = (Borrowed::new(&cos)?, Borrowed::new(&sin)?);
        let norms = match prep.norm {
            Some((qw, kw, eps)) => Some((Borrowed::new(qw)?, Borrowed::new(kw)?, eps)),
            None => None,
        };
        let norm_slices = match &norms {
            Some((qw, kw, eps)) => Some((&qw.tail()?[..d], &kw.tail()?[..d], *eps)),
            None => None,
        };
        let biases = match &bias {
            Some((qb, kb)) => Some((
                (Borrowed::new(qb)?, qb.elem_count()),
                (Borrowed::new(kb)?, kb.elem_count()),
            )),
            None => None,
        };
        let bias_slices = match &biases {
            Some(((qb, qn), (kb, kn))) => Some((&qb.tail()?[..*qn], &kb.tail()?[..*kn])),
            None => None,
        };
        // The table's width says how many dims rotate (all, or fewer under partial RoPE).
        let half = cos.dim(1)?;
        let split = wavefront_kernels::cpu::elementwise::HeadSplit {
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: d,
            qk_bias: bias_slices,
            qk_norm: norm_slices,
            interleaved: prep.interleaved,
            rotary_dim: 2 * half,
            cos: &cb.tail()?[..n * half],
            sin: &sb.tail()?[..n * half],
        };
        wavefront_kernels::cpu::elementwise::split_heads_vecs(
            &b.tail()?[..qkv.elem_count()],
            n,
            &split,
        )
        .map_err(ModelError::from)?
    };
    Ok((
        Tensor::from_vec(q, (h, n, d), &Device::Cpu)?,
        Tensor::from_vec(k, (hkv, n, d), &Device::Cpu)?,
        Tensor::from_vec(v, (hkv, n, d), &Device::Cpu)?,
    ))
}

/// `a · b` for `a` `[.., m, k]` and `b` `[.., k, n]` (the same leading dims): the product
/// kernel for float32 on the CPU (`b` packed per call; with `bf16`, the bf16 compute mode,
/// both operands rounded to bfloat16 pairs and summed in float32), candle's matmul elsewhere.
pub(crate) fn matmul(a: &Tensor, b: &Tensor, bf16: bool) -> Result<Tensor> {
    if !(on_cpu_f32(a) && on_cpu_f32(b)) || a.rank() < 2 || a.rank() != b.rank() {
        return Ok(a.matmul(b)?);
    }
    let r = a.rank();
    let (m, k, n) = (a.dim(r - 2)?, a.dim(r - 1)?, b.dim(r - 1)?);
    let batch: usize = a.dims()[..r - 2].iter().product();
    if b.dims()[..r - 2] != a.dims()[..r - 2] || b.dim(r - 2)? != k {
        return Ok(a.matmul(b)?);
    }
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let mut out = output(batch * m * n);
    {
        let (ab, bb) = (Borrowed::new(&a)?, Borrowed::new(&b)?);
        let (av, bv) = (ab.tail()?, bb.tail()?);
        for c in 0..batch {
            use wavefront_kernels::cpu::matmul::PackedWeight;
            let b = &bv[c * k * n..(c + 1) * k * n];
            let w = if bf16 {
                PackedWeight::pack_kn_pairs(b, k, n)
            } else {
                PackedWeight::pack_kn(b, k, n)
            }
            .map_err(ModelError::from)?;
            wavefront_kernels::cpu::matmul::linear(
                &av[c * m * k..(c + 1) * m * k],
                m,
                &w,
                None,
                &mut out[c * m * n..(c + 1) * m * n],
            )
            .map_err(ModelError::from)?;
        }
    }
    let mut shape = a.dims().to_vec();
    shape[r - 1] = n;
    Ok(Tensor::from_vec(out, shape, &Device::Cpu)?)
}

/// Per row of `logits` `[rows, V]` (float32 on the CPU): the maximum, its first index and
/// `Σ exp(x - max)`, threaded over rows; `None` for other tensors (the caller's candle path).
pub fn row_stats(logits: &Tensor) -> Result<Option<Vec<(f32, usize, f32)>>> {
    if !on_cpu_f32(logits) || logits.rank() != 2 {
        return Ok(None);
    }
    let l = logits.contiguous()?;
    let b = Borrowed::new(&l)?;
    let width = l.dim(1)?;
    let stats = wavefront_kernels::cpu::elementwise::row_stats(&b.tail()?[..l.elem_count()], width)
        .map_err(ModelError::from)?;
    Ok(Some(stats))
}
