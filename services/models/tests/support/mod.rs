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

/// How far packing may move a row's values on `device`: `exact` (the bound on the CPU, whose
/// kernels give a row the same FMA chains whatever rows share its call), or on a GPU `gpu`: cuBLAS
/// chooses its GEMM kernel (tiles, split-K) by the number of rows, so a packed row is summed in
/// another order than alone, as two implementations differ. Measured on an H200 in float32
/// (docs/benchmarks.md): up to 9.9e-5 on the LLaDA fixture's sharpened logits, 1.2e-5 to
/// 3.5e-5 on the others.
pub fn packing_atol(device: &Device, exact: f32, gpu: f32) -> f32 {
    if device.is_cuda() {
        gpu
    } else {
        exact
    }
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

/// A fixture's `golden.json` and `golden.safetensors` (tests/fixtures/<name>).
pub struct Golden {
    pub tensors: std::collections::HashMap<String, Tensor>,
    pub json: serde_json::Value,
}

impl Golden {
    pub fn load(fixture: &str) -> Result<Self> {
        let dir = wavefront_models::device::test_fixture(fixture);
        Ok(Self {
            tensors: candle_core::safetensors::load(
                dir.join("golden.safetensors"),
                &wavefront_models::device::test_device(),
            )?,
            json: serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json"))?)?,
        })
    }

    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("golden tensor {name}"))
    }

    /// An integer tensor's values, flattened.
    pub fn ids(&self, name: &str) -> Result<Vec<u32>> {
        Ok(self
            .tensor(name)?
            .flatten_all()?
            .to_dtype(DType::U32)?
            .to_vec1()?)
    }
}
