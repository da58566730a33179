//! Request state as plain values, for moving a request to another worker.
//!
//! A request's state is exported after its family preempted it: its caches' pages and its
//! latent tensors are host copies then (see `PagedCache::swap_out`). The schemes crate encodes
//! that state with serde; this module gives tensors and host pages their serde form:
//! a dtype tag, the shape and the values (float tensors as their float32 values, which every
//! float dtype here converts to and back exactly).
//!
//! Imported tensors are made in host memory, as a preempted request's are, and move to the
//! model's device when the request resumes. Host pages remember the device their rows go back
//! to: an imported page takes the device given to [`with_target`] (the importing model's).

use std::cell::RefCell;
use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use serde::de::Error as _;
use serde::ser::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

thread_local! {
    static TARGET: RefCell<Device> = const { RefCell::new(Device::Cpu) };
}

/// Runs `f` (a deserialization) with `device` as the device imported host pages go back to.
pub fn with_target<R>(device: &Device, f: impl FnOnce() -> R) -> R {
    let before = TARGET.with(|t| t.replace(device.clone()));
    let out = f();
    TARGET.with(|t| *t.borrow_mut() = before);
    out
}

/// The device imported host pages go back to ([`with_target`]; the host otherwise).
pub(crate) fn target() -> Device {
    TARGET.with(|t| t.borrow().clone())
}

#[derive(Serialize, Deserialize)]
enum Values {
    F32(Vec<f32>),
    U32(Vec<u32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

#[derive(Serialize, Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<usize>,
    values: Values,
}

fn raw(t: &Tensor) -> candle_core::Result<RawTensor> {
    let flat = t.to_device(&Device::Cpu)?.flatten_all()?;
    let values = match t.dtype() {
        DType::U32 => Values::U32(flat.to_vec1()?),
        DType::I64 => Values::I64(flat.to_vec1()?),
        DType::U8 => Values::U8(flat.to_vec1()?),
        d if d.is_float() => Values::F32(flat.to_dtype(DType::F32)?.to_vec1()?),
        d => candle_core::bail!("cannot export a {d:?} tensor"),
    };
    Ok(RawTensor {
        dtype: t.dtype().as_str().to_owned(),
        shape: t.dims().to_vec(),
        values,
    })
}

fn cooked(r: RawTensor) -> candle_core::Result<Tensor> {
    let dtype: DType = r
        .dtype
        .parse()
        .map_err(|_| candle_core::Error::Msg(format!("unknown dtype {:?}", r.dtype)))?;
    let cpu = Device::Cpu;
    let t = match r.values {
        Values::F32(v) => Tensor::from_vec(v, r.shape.as_slice(), &cpu)?.to_dtype(dtype)?,
        Values::U32(v) => Tensor::from_vec(v, r.shape.as_slice(), &cpu)?,
        Values::I64(v) => Tensor::from_vec(v, r.shape.as_slice(), &cpu)?,
        Values::U8(v) => Tensor::from_vec(v, r.shape.as_slice(), &cpu)?,
    };
    if t.dtype() != dtype {
        candle_core::bail!("a {dtype:?} tensor stored as {:?} values", t.dtype());
    }
    Ok(t)
}

/// `#[serde(with = "wavefront_models::state::tensor")]` for a [`Tensor`] field.
pub mod tensor {
    use super::*;

    pub fn serialize<S: Serializer>(t: &Tensor, s: S) -> Result<S::Ok, S::Error> {
        raw(t).map_err(S::Error::custom)?.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Tensor, D::Error> {
        cooked(RawTensor::deserialize(d)?).map_err(D::Error::custom)
    }
}

/// A tensor with a serde form, for tensors inside collections.
#[derive(Debug, Clone)]
pub struct Saved(pub Tensor);

impl Serialize for Saved {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        tensor::serialize(&self.0, s)
    }
}

impl<'de> Deserialize<'de> for Saved {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        tensor::deserialize(d).map(Saved)
    }
}

/// `#[serde(with = "wavefront_models::state::opt_tensor")]` for an `Option<Tensor>` field.
pub mod opt_tensor {
    use super::*;

    pub fn serialize<S: Serializer>(t: &Option<Tensor>, s: S) -> Result<S::Ok, S::Error> {
        t.clone().map(Saved).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Tensor>, D::Error> {
        Ok(Option::<Saved>::deserialize(d)?.map(|s| s.0))
    }
}

/// `#[serde(with = "wavefront_models::state::tensor_map")]` for a `BTreeMap<usize, Tensor>`.
pub mod tensor_map {
    use super::*;

    pub fn serialize<S: Serializer>(m: &BTreeMap<usize, Tensor>, s: S) -> Result<S::Ok, S::Error> {
        let v: Vec<(usize, Saved)> = m.iter().map(|(k, t)| (*k, Saved(t.clone()))).collect();
        v.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<usize, Tensor>, D::Error> {
        Ok(Vec::<(usize, Saved)>::deserialize(d)?
            .into_iter()
            .map(|(k, t)| (k, t.0))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_of_every_exported_dtype_come_back_bit_exactly() -> anyhow::Result<()> {
        let f = Tensor::new(
            &[[1.5f32, -0.0, f32::MIN_POSITIVE], [3.25, 1e-30, -7.0]],
            &Device::Cpu,
        )?;
        for t in [
            f.clone(),
            f.to_dtype(DType::BF16)?,
            f.to_dtype(DType::F16)?,
            Tensor::new(&[7u32, 0, u32::MAX], &Device::Cpu)?,
        ] {
            let bytes = postcard::to_stdvec(&Saved(t.clone()))?;
            let back: Saved = postcard::from_bytes(&bytes)?;
            assert_eq!(back.0.dtype(), t.dtype());
            assert_eq!(back.0.dims(), t.dims());
            let (a, b) = (
                t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
                back.0
                    .to_dtype(DType::F64)?
                    .flatten_all()?
                    .to_vec1::<f64>()?,
            );
            assert_eq!(
                a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
        Ok(())
    }
}
