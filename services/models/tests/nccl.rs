//! The NCCL collective on the GPUs this machine has (a `cuda` build run with
//! `WAVEFRONT_TEST_DEVICE=cuda:N`): a one-rank sum is the partial itself in every dtype the
//! models run, and with two GPUs two ranks sum. The families' golden tensor-parallel tests run
//! through NCCL with `WAVEFRONT_TEST_COLLECTIVE=nccl` (one rank per GPU; worlds beyond the GPUs
//! are skipped by name).

#![cfg(feature = "cuda")]

mod support;

use support::max_abs_diff;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use wavefront_models::device::{gpus_from, test_device};
use wavefront_models::transformer::{CollectiveKind, TensorParallel};

#[test]
fn nccl_sums_the_ranks_partials_on_rank_zero() -> Result<()> {
    let device = test_device();
    if !device.is_cuda() {
        eprintln!("WAVEFRONT_TEST_DEVICE is not a GPU: the NCCL test needs one");
        return Ok(());
    }
    let one = TensorParallel::for_device(CollectiveKind::Nccl, 1, &device)?;
    ensure!(!one.comm.skips_one_rank(), "NCCL must run at one rank");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = Tensor::randn(0f32, 1.0, (7, 33), &device)?.to_dtype(dtype)?;
        let y = one.comm.all_reduce_sum(vec![x.clone()])?;
        ensure!(
            y.device().same_device(&device),
            "the sum lands on rank 0's device"
        );
        ensure!(
            max_abs_diff(&y, &x)? == 0.0,
            "{dtype:?}: one rank's sum is its partial"
        );
    }
    if gpus_from(&device) < 2 {
        eprintln!("one GPU only: two NCCL ranks not run");
    } else {
        let two = TensorParallel::for_device(CollectiveKind::Nccl, 2, &device)?;
        let other = two.comm.device(1).expect("rank 1's GPU").clone();
        let a = Tensor::randn(0f32, 1.0, (5, 64), &device)?;
        let b = Tensor::randn(0f32, 1.0, (5, 64), &Device::Cpu)?;
        let want = (a.to_device(&Device::Cpu)? + &b)?;
        let got = two.comm.all_reduce_sum(vec![a, b.to_device(&other)?])?;
        ensure!(max_abs_diff(&got, &want)? <= 1e-6);
    }
    Ok(())
}
