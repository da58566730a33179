//! The GPU memory pool candle allocates from, set up when a device is opened
//! ([`crate::device::parse_device`], tensor-parallel ranks).

use candle_core::Device;

use crate::error::Result;

/// Makes the device's default memory pool keep the memory freed back to it instead of
/// returning it to the driver at every synchronisation (the pool's default release threshold
/// is 0). Candle allocates every op's output from that pool (cudarc's `cuMemAllocAsync`), and a
/// tick synchronises when it reads its decisions, so without this each tick would map its
/// large buffers (a step's logits over the vocabulary) again. The pool grows to the most a
/// tick holds at once, as PyTorch's caching allocator does; the K/V pages are sized apart.
pub(crate) fn keep_freed_memory(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        use cudarc::driver::sys;
        let ctx = d.cuda_stream().context().clone();
        let fail = |e: cudarc::driver::DriverError| {
            crate::error::ModelError::Device(format!(
                "device: cannot keep freed memory in the pool of {device:?}: {e}"
            ))
        };
        ctx.bind_to_thread().map_err(fail)?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut threshold = u64::MAX;
        // SAFETY: `pool` is written by the driver for a device of a live context; the
        // attribute takes a pointer to a u64.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                .result()
                .map_err(fail)?;
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
            .result()
            .map_err(fail)?;
        }
    }
    let _ = device;
    Ok(())
}
