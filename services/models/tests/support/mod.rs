//! Tolerance checks shared by the golden tests of every family.

#![allow(dead_code)]

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};

/// Max |a - b| over all elements, in float32 on the CPU (either may be on a GPU, in any float
/// dtype); the shapes must match.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    ensure!(
        a.dims() == b.dims(),
        "shapes {:?} vs {:?}",
        a.dims(),
        b.dims()
    );
    let f32_cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
    Ok((f32_cpu(a)? - f32_cpu(b)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?)
}

/// Fails unless `got` is within `atol` of `want` everywhere; prints the measured max |diff|.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, atol: f32) -> Result<()> {
    let d = max_abs_diff(got, want)?;
    ensure!(d <= atol, "{what}: max |diff| = {d:e} > {atol:e}");
    eprintln!("{what}: max |diff| = {d:e}");
    Ok(())
}
