//! `nn.Linear` (`y = x Wᵀ + b`, weight `[out, in]`) with the CPU kernel of `wavefront-kernels`.
//!
//! On the CPU with float32 weights the weight is packed once, at load, into the kernel's panel
//! layout and the dense tensor is dropped (no second copy): every product then streams the
//! panels over all cores, one fused multiply-add chain per output, so a row's result does not
//! depend on the rows beside it ([`wavefront_kernels::cpu`]). The packed weight may be stored
//! as bfloat16 ([`Linear::store_as`], the `--weight-dtype bf16` option): half the bytes to
//! read, float32 arithmetic. Elsewhere (CUDA, or bf16 compute) the weight stays a tensor and
//! the product is candle's matmul.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
pub use wavefront_kernels::cpu::matmul::WeightDtype;
use wavefront_kernels::cpu::matmul::{self, PackedWeight};

use crate::error::{ModelError, Result};

#[derive(Debug, Clone)]
enum Weight {
    /// `[out, in]` on any device: candle's matmul.
    Dense(Tensor),
    /// CPU float32 compute over packed panels.
    Packed(Arc<PackedWeight>),
}

/// A linear layer.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
    /// The bias as the CPU kernel adds it (packed weights only).
    bias_f32: Option<Arc<Vec<f32>>>,
}

/// The float32 values of a CPU tensor, borrowed when it is contiguous float32 already.
pub(crate) fn with_cpu_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = if t.dtype() == DType::F32 {
        t.contiguous()?
    } else {
        t.to_dtype(DType::F32)?.contiguous()?
    };
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Err(ModelError::Shape(
            "a CPU kernel was given a tensor on a GPU".into(),
        ));
    };
    let data = cpu.as_slice::<f32>()?;
    let start = layout.start_offset();
    f(&data[start..start + t.elem_count()])
}

impl Linear {
    /// A layer over `weight` `[out, in]` and an optional `bias` `[out]`: packed for the CPU
    /// kernel when it is a float32 CPU tensor, kept as a tensor otherwise.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let (n, k) = weight.dims2()?;
        if let Some(b) = &bias {
            if b.dims() != [n] {
                return Err(ModelError::Shape(format!(
                    "bias of shape {:?} for a weight of {n} outputs",
                    b.dims()
                )));
            }
        }
        let weight = if weight.device().is_cpu() && weight.dtype() == DType::F32 {
            let packed = with_cpu_f32(&weight, |w| {
                PackedWeight::pack(w, n, k, WeightDtype::F32).map_err(ModelError::from)
            })?;
            Weight::Packed(Arc::new(packed))
        } else {
            Weight::Dense(weight)
        };
        let bias_f32 = match (&weight, &bias) {
            (Weight::Packed(_), Some(b)) => {
                Some(Arc::new(b.to_dtype(DType::F32)?.to_vec1::<f32>()?))
            }
            _ => None,
        };
        Ok(Self {
            weight,
            bias,
            bias_f32,
        })
    }

    /// Stores a packed weight as `dtype` (bf16 rounds it once, to nearest even); a dense weight
    /// (GPU, bf16 compute) is left as it is.
    pub fn store_as(&mut self, dtype: WeightDtype) -> Result<()> {
        if let Weight::Packed(p) = &self.weight {
            if p.dtype() != dtype {
                let (n, k) = (p.out_features(), p.in_features());
                let repacked =
                    PackedWeight::pack(&p.unpack(), n, k, dtype).map_err(ModelError::from)?;
                self.weight = Weight::Packed(Arc::new(repacked));
            }
        }
        Ok(())
    }

    /// Whether the layer computes in the CPU's bf16 mode (weights stored as
    /// [`WeightDtype::Bf16Dot`]): the products next to it (attention's) then multiply in
    /// bfloat16 too.
    pub fn bf16_products(&self) -> bool {
        matches!(&self.weight, Weight::Packed(p) if p.dtype() == WeightDtype::Bf16Dot)
    }

    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        match &self.weight {
            Weight::Dense(w) => {
                let d = w.dims();
                (d[0], d[1])
            }
            Weight::Packed(p) => (p.out_features(), p.in_features()),
        }
    }

    /// The weight as a `[out, in]` tensor (a copy when packed; for loading and splitting).
    pub fn weight(&self) -> Result<Tensor> {
        match &self.weight {
            Weight::Dense(w) => Ok(w.clone()),
            Weight::Packed(p) => {
                let (n, k) = (p.out_features(), p.in_features());
                Ok(Tensor::from_vec(p.unpack(), (n, k), &Device::Cpu)?)
            }
        }
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Bytes the weight occupies.
    pub fn weight_bytes(&self) -> usize {
        match &self.weight {
            Weight::Dense(w) => w.elem_count() * w.dtype().size_in_bytes(),
            Weight::Packed(p) => p.bytes(),
        }
    }

    /// The layer with its weight and bias on `device` (no copy of what is already there).
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        let bias = self
            .bias
            .as_ref()
            .map(|b| b.to_device(device))
            .transpose()?;
        match &self.weight {
            Weight::Packed(_) if device.is_cpu() => Ok(Self {
                weight: self.weight.clone(),
                bias,
                bias_f32: self.bias_f32.clone(),
            }),
            _ => Self::new(self.weight()?.to_device(device)?, bias),
        }
    }

    /// `x Wᵀ + b` over the last dim of `x` `[.., in]`.
    /// Whether the weight is packed for the CPU kernel, whose output rows are each computed the
    /// same way whatever other rows share the product.
    pub(crate) fn is_packed(&self) -> bool {
        matches!(self.weight, Weight::Packed(_))
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.weight {
            Weight::Dense(w) => {
                let y = x.broadcast_matmul(&w.t()?)?;
                Ok(match &self.bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            }
            Weight::Packed(p) => {
                let (n, k) = (p.out_features(), p.in_features());
                let dims = x.dims();
                if dims.last() != Some(&k) {
                    return Err(ModelError::Shape(format!(
                        "input of shape {dims:?} to a linear layer of {k} inputs"
                    )));
                }
                let m = x.elem_count() / k.max(1);
                let bias = self.bias_f32.as_deref().map(Vec::as_slice);
                let y = with_cpu_f32(x, |xs| {
                    matmul::linear_vec(xs, m, p, bias).map_err(ModelError::from)
                })?;
                let mut shape = dims.to_vec();
                *shape.last_mut().expect("non-empty") = n;
                let y = Tensor::from_vec(y, shape, x.device())?;
                Ok(if x.dtype() == DType::F32 {
                    y
                } else {
                    y.to_dtype(x.dtype())?
                })
            }
        }
    }

    /// Rows `ids` of the weight `[ids.len(), in]` (an embedding lookup through a head tied to
    /// the embeddings); an id outside the weight is refused.
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let (n, k) = self.dims();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= n) {
            return Err(ModelError::Shape(format!(
                "token id {id} outside the embedding of {n} rows"
            )));
        }
        match &self.weight {
            Weight::Dense(w) => Ok(w.index_select(&Tensor::new(ids, w.device())?, 0)?),
            Weight::Packed(p) => {
                let mut out = vec![0f32; ids.len() * k];
                for (row, &id) in out.chunks_mut(k.max(1)).zip(ids) {
                    p.row_into(id as usize, row).map_err(ModelError::from)?;
                }
                Ok(Tensor::from_vec(out, (ids.len(), k), &Device::Cpu)?)
            }
        }
    }
}

/// Embedding rows of `ids` from `table` `[rows, E]`; an id outside the table is refused.
pub(crate) fn embed_tokens(table: &Tensor, ids: &[u32]) -> Result<Tensor> {
    let rows = table.dim(0)?;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= rows) {
        return Err(ModelError::Shape(format!(
            "token id {id} outside the embedding of {rows} rows"
        )));
    }
    let idx = Tensor::new(ids, table.device())?;
    Ok(table.index_select(&idx, 0)?)
}

/// The precision statistics and rotations are computed in: float32, or float64 for a float64
/// model (the reference the numerics are measured against).
pub(crate) fn at_least_f32(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_and_dense_layers_agree_and_keep_the_input_shape() -> Result<()> {
        let w = Tensor::arange(0f32, 35.0, &Device::Cpu)?.reshape((7, 5))?;
        let b = Tensor::arange(0f32, 7.0, &Device::Cpu)?;
        let x = (Tensor::arange(0f32, 30.0, &Device::Cpu)?.reshape((2, 3, 5))? * 0.1)?;
        let packed = Linear::new(w.clone(), Some(b.clone()))?;
        assert!(matches!(packed.weight, Weight::Packed(_)));
        let got = packed.forward(&x)?;
        assert_eq!(got.dims(), &[2, 3, 7]);
        let want = x.broadcast_matmul(&w.t()?)?.broadcast_add(&b)?;
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "{diff}");
        assert_eq!(packed.weight()?.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        assert_eq!(
            packed.rows(&[6, 0])?.to_vec2::<f32>()?,
            w.index_select(&Tensor::new(&[6u32, 0], &Device::Cpu)?, 0)?
                .to_vec2::<f32>()?
        );
        assert!(packed.rows(&[7]).is_err());
        Ok(())
    }

    #[test]
    fn bf16_storage_halves_the_bytes_and_rounds_the_weight() -> Result<()> {
        let w = (Tensor::arange(0f32, 64.0, &Device::Cpu)?.reshape((2, 32))? * 0.013)?;
        let mut l = Linear::new(w.clone(), None)?;
        let before = l.weight_bytes();
        l.store_as(WeightDtype::Bf16)?;
        assert_eq!(l.weight_bytes() * 2, before);
        let rounded = w.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        assert_eq!(l.weight()?.to_vec2::<f32>()?, rounded.to_vec2::<f32>()?);
        Ok(())
    }
}

/// A model whose linear layers' packed weights can be stored in another dtype after loading
/// (`--weight-dtype`, env `WAVEFRONT_WEIGHT_DTYPE`): bf16 halves the bytes a bandwidth-bound
/// forward reads. Weights that are not packed (GPU, bf16 compute) are left as they are.
pub trait StoreWeights {
    fn store_weights(&mut self, dtype: WeightDtype) -> Result<()>;
}

/// Per-layer linear layers stacked along a leading layer axis (`[L, out, in]` in the
/// checkpoints' layout), for ARMT's diagonal step, whose cells each need their own layer's
/// product. On the CPU every layer is packed on its own and a grouped product runs each
/// group's rows through its layer; elsewhere the stack stays one tensor and a grouped product
/// over a contiguous layer range is one batched matmul.
#[derive(Debug, Clone)]
pub(crate) struct LinearStack {
    layers: Vec<Linear>,
    /// The whole stack, kept for the batched product when the layers are not packed.
    stacked: Option<Tensor>,
}

impl LinearStack {
    /// The stack of `w` `[L, out, in]` (no bias).
    pub(crate) fn new(w: Tensor) -> Result<Self> {
        let n_layers = w.dim(0)?;
        let layers = (0..n_layers)
            .map(|l| Linear::new(w.get(l)?, None))
            .collect::<Result<Vec<_>>>()?;
        let packed = layers.iter().all(|l| matches!(l.weight, Weight::Packed(_)));
        Ok(Self {
            layers,
            stacked: (!packed).then_some(w),
        })
    }

    /// Whether every layer is packed for the CPU kernel (then the stack is not kept whole).
    pub(crate) fn is_packed(&self) -> bool {
        self.stacked.is_none()
    }

    /// Layer `l`.
    pub(crate) fn layer(&self, l: usize) -> Result<&Linear> {
        self.layers.get(l).ok_or_else(|| {
            ModelError::Shape(format!("layer {l} of a stack of {}", self.layers.len()))
        })
    }

    /// The stack on `device`.
    pub(crate) fn to_device(&self, device: &Device) -> Result<Self> {
        match &self.stacked {
            Some(w) => Self::new(w.to_device(device)?),
            None if device.is_cpu() => Ok(self.clone()),
            None => {
                let ws = self
                    .layers
                    .iter()
                    .map(Linear::weight)
                    .collect::<Result<Vec<_>>>()?;
                Self::new(Tensor::stack(&ws, 0)?.to_device(device)?)
            }
        }
    }

    /// Stores every packed layer as `dtype`.
    pub(crate) fn store_as(&mut self, dtype: WeightDtype) -> Result<()> {
        self.layers.iter_mut().try_for_each(|l| l.store_as(dtype))
    }

    /// [`Linear::bf16_products`] of the stack's layers.
    pub(crate) fn bf16_products(&self) -> bool {
        self.layers.first().is_some_and(Linear::bf16_products)
    }

    /// `x` `[G, R, in]`, group `g` through layer `lo + g`: `[G, R, out]`.
    pub(crate) fn grouped(&self, x: &Tensor, lo: usize) -> Result<Tensor> {
        let g = x.dim(0)?;
        if lo + g > self.layers.len() {
            return Err(ModelError::Shape(format!(
                "layers {lo}..{} of a stack of {}",
                lo + g,
                self.layers.len()
            )));
        }
        match &self.stacked {
            Some(w) => Ok(x.matmul(&w.narrow(0, lo, g)?.t()?)?),
            None => {
                let ys = (0..g)
                    .map(|i| self.layers[lo + i].forward(&x.get(i)?))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::stack(&ys, 0)?)
            }
        }
    }
}

/// A model's token embeddings and output head, one weight when they are tied. A tied weight
/// packed for the CPU serves embedding rows from its panels, so it is held once.
#[derive(Debug, Clone)]
pub(crate) struct EmbedHead {
    /// The embedding table `[V, E]`, unless the head (packed) serves it.
    table: Option<Tensor>,
    head: Linear,
    device: Device,
    dtype: DType,
}

impl EmbedHead {
    /// `embed` `[V, E]` and the head's weight and bias (`None`: tied to `embed`).
    pub(crate) fn new(embed: Tensor, head: Option<(Tensor, Option<Tensor>)>) -> Result<Self> {
        let (device, dtype) = (embed.device().clone(), embed.dtype());
        let (table, head) = match head {
            Some((w, b)) => (Some(embed), Linear::new(w, b)?),
            None => {
                let head = Linear::new(embed.clone(), None)?;
                let table = matches!(head.weight, Weight::Dense(_)).then_some(embed);
                (table, head)
            }
        };
        Ok(Self {
            table,
            head,
            device,
            dtype,
        })
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// Embedding rows of `ids` `[ids.len(), E]`; an id outside the table is refused.
    pub(crate) fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        match &self.table {
            Some(t) => embed_tokens(t, ids),
            None => Ok(self.head.rows(ids)?.to_dtype(self.dtype)?),
        }
    }

    /// The head over hidden rows `[N, E]`: logits `[N, V]` in float32 (float64 for a float64
    /// model, the numerics reference).
    pub(crate) fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let y = self.head.forward(hidden)?;
        Ok(y.to_dtype(at_least_f32(y.dtype()))?)
    }

    /// Stores the head (and a tied table with it) as `dtype` when packed.
    pub(crate) fn store_as(&mut self, dtype: WeightDtype) -> Result<()> {
        self.head.store_as(dtype)
    }
}
