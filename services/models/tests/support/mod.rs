//! Tolerance checks shared by the golden tests of every family.

#![allow(dead_code)]

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use wavefront_models::transformer::{AttentionKernel, SelectAttention};

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

/// Runs `check` on `load()`'s model once per attention kernel (each golden must hold for both);
/// a failure names the kernel.
pub fn with_each_attention<M: SelectAttention>(
    load: impl Fn() -> Result<M>,
    mut check: impl FnMut(&M) -> Result<()>,
) -> Result<()> {
    for kernel in AttentionKernel::ALL {
        let mut model = load()?;
        model.select_attention(kernel)?;
        check(&model).with_context(|| format!("with --attention {kernel}"))?;
    }
    Ok(())
}
