//! The NCCL [`Collective`] (`cuda` feature): one communicator per GPU, all created in this
//! process (`ncclCommInitAll`), driven by the single controller thread through group calls.
//!
//! The sum lands on rank 0, where the single controller keeps the replicated residual stream
//! (norms, embeddings, the head), so each row-parallel layer ends in one `ncclReduce` to root 0
//! rather than an all-reduce: the other ranks would drop their copies, and the next layer's
//! normed input reaches them by a peer copy ([`super::collective::on_rank`]). With one rank the
//! reduce still runs (a device-to-device copy through the library), which is what a one-GPU
//! machine can check of this path.
//!
//! Every communicator uses its device's candle stream, so the reduce is ordered after the
//! kernels that produced the partials and before the ones that read the sum, with no host sync.

use std::fmt;
use std::sync::Mutex;

use candle_core::cuda::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Storage, Tensor};
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::result::{group_end, group_start};
use cudarc::nccl::{Comm, NcclType, ReduceOp};

use super::collective::Collective;
use crate::error::{ModelError, Result};

/// Sums the ranks' partials with NCCL; rank `r` lives on `devices[r]`.
pub struct NcclCollective {
    devices: Vec<Device>,
    comms: Mutex<Comms>,
}

struct Comms(Vec<Comm>);

// SAFETY: an NCCL communicator may be used from any thread as long as no two calls on it
// overlap; every use goes through the collective's mutex.
unsafe impl Send for Comms {}

impl fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclCollective")
            .field(
                "devices",
                &self
                    .devices
                    .iter()
                    .map(Device::location)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

fn nccl_error(what: &str, e: impl fmt::Debug) -> ModelError {
    ModelError::Device(format!("NCCL {what}: {e:?}"))
}

impl NcclCollective {
    /// One rank per device, in rank order; every device a distinct CUDA device.
    pub fn new(devices: Vec<Device>) -> Result<Self> {
        if devices.is_empty() {
            return Err(ModelError::Device(
                "NCCL needs at least one CUDA device".into(),
            ));
        }
        let mut ordinals = Vec::with_capacity(devices.len());
        let mut streams = Vec::with_capacity(devices.len());
        for d in &devices {
            let cuda = d.as_cuda_device().map_err(|_| {
                ModelError::Device(format!(
                    "NCCL ranks must be CUDA devices, got {:?}",
                    d.location()
                ))
            })?;
            let ordinal = cuda.cuda_stream().context().ordinal();
            if ordinals.contains(&ordinal) {
                return Err(ModelError::Device(format!(
                    "NCCL ranks need distinct GPUs; cuda:{ordinal} appears twice"
                )));
            }
            ordinals.push(ordinal);
            streams.push(cuda.cuda_stream());
        }
        let comms = Comm::from_devices(streams).map_err(|e| nccl_error("init", e))?;
        Ok(Self {
            devices,
            comms: Mutex::new(Comms(comms)),
        })
    }

    fn reduce_typed<T>(&self, partials: &[Tensor]) -> Result<Tensor>
    where
        T: CudaDType + NcclType + DeviceRepr + ValidAsZeroBits,
    {
        let shape = partials[0].shape().clone();
        let n = shape.elem_count();
        let root = self.devices[0].as_cuda_device()?;
        let mut sum = root
            .cuda_stream()
            .alloc_zeros::<T>(n)
            .map_err(|e| nccl_error("alloc", e))?;
        {
            let guards: Vec<_> = partials.iter().map(Tensor::storage_and_layout).collect();
            let mut sends = Vec::with_capacity(partials.len());
            for (storage, layout) in &guards {
                let Storage::Cuda(c) = &**storage else {
                    return Err(ModelError::Device("an NCCL partial is not on a GPU".into()));
                };
                let (start, end) = layout
                    .contiguous_offsets()
                    .ok_or_else(|| ModelError::Shape("an NCCL partial is not contiguous".into()))?;
                sends.push(c.as_cuda_slice::<T>()?.slice(start..end));
            }
            let comms = self
                .comms
                .lock()
                .map_err(|_| ModelError::Device("the NCCL communicators are poisoned".into()))?;
            group_start().map_err(|e| nccl_error("group start", e))?;
            let mut status = Ok(());
            for (rank, (comm, send)) in comms.0.iter().zip(&sends).enumerate() {
                let recv = (rank == 0).then_some(&mut sum);
                if let Err(e) = comm.reduce(send, recv, &ReduceOp::Sum, 0) {
                    status = Err(nccl_error("reduce", e));
                    break;
                }
            }
            // The group is closed whatever happened inside it.
            group_end().map_err(|e| nccl_error("group end", e))?;
            status?;
        }
        let storage = CudaStorage::wrap_cuda_slice(sum, root.clone());
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            shape,
            BackpropOp::none(),
            false,
        ))
    }
}

impl Collective for NcclCollective {
    fn world(&self) -> usize {
        self.devices.len()
    }

    fn device(&self, rank: usize) -> Option<&Device> {
        self.devices.get(rank)
    }

    fn skips_one_rank(&self) -> bool {
        false
    }

    fn all_reduce_sum(&self, partials: Vec<Tensor>) -> Result<Tensor> {
        if partials.len() != self.devices.len() {
            return Err(ModelError::Shape(format!(
                "all-reduce over {} partials in a world of {}",
                partials.len(),
                self.devices.len()
            )));
        }
        let (dtype, shape) = (partials[0].dtype(), partials[0].shape().clone());
        let mut placed = Vec::with_capacity(partials.len());
        for (p, d) in partials.into_iter().zip(&self.devices) {
            if p.dtype() != dtype || p.shape() != &shape {
                return Err(ModelError::Shape(format!(
                    "NCCL partials differ: {:?} {:?} against {dtype:?} {shape:?}",
                    p.dtype(),
                    p.shape()
                )));
            }
            // Each partial on its rank's GPU, in one contiguous block.
            placed.push(p.to_device(d)?.contiguous()?);
        }
        match dtype {
            DType::F32 => self.reduce_typed::<f32>(&placed),
            DType::BF16 => self.reduce_typed::<half::bf16>(&placed),
            DType::F16 => self.reduce_typed::<half::f16>(&placed),
            other => Err(ModelError::Unsupported(format!(
                "NCCL sums of {other:?} tensors"
            ))),
        }
    }
}
