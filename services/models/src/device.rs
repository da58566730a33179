//! Device selection by name (`cpu`, `cuda:N`), shared by the command line, the benches and the
//! golden tests: `WAVEFRONT_TEST_DEVICE=cuda:0` runs every family's golden suite on a GPU
//! (a build with the `cuda` feature), with the same tolerances as on the CPU in float32.

use candle_core::{DType, Device};

use crate::error::{ModelError, Result};

fn bad(reason: String) -> ModelError {
    ModelError::Device(format!("device {reason}"))
}

/// `cpu` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device> {
    if s == "cpu" {
        return Ok(Device::Cpu);
    }
    if let Some(n) = s.strip_prefix("cuda:") {
        let ordinal: usize = n
            .parse()
            .map_err(|_| bad(format!("cuda:N needs a number, got {s:?}")))?;
        let device = Device::new_cuda(ordinal).map_err(|e| {
            bad(format!(
                "cannot open {s} ({e}): this build needs the `cuda` feature and a visible GPU"
            ))
        })?;
        crate::gpu_memory::keep_freed_memory(&device)?;
        return Ok(device);
    }
    Err(bad(format!("must be cpu or cuda:N, got {s:?}")))
}

/// `f32` or `bf16` (also vLLM's `float32` and `bfloat16`).
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        _ => Err(ModelError::Device(format!(
            "dtype must be f32 or bf16, got {s:?}"
        ))),
    }
}

/// How CPU weights are stored, from the name `--weight-dtype` takes (`f32`, `bf16`,
/// `bf16-dot`: bf16 weights times activations rounded to bf16, float32 accumulation, or
/// `int8`: 8-bit weights with per-channel scales, float32 arithmetic, or `int8-dot`: the same
/// weights times activations quantised to 8 bits per row, integer products (VNNI), or `q4`:
/// 4-bit weights with a scale per channel and group of 32 inputs, float32 arithmetic, or
/// `q4-dot`: the same weights times 8-bit activations, integer products per group).
pub fn parse_weight_dtype(s: &str) -> Result<crate::transformer::WeightDtype> {
    use crate::transformer::WeightDtype;
    WeightDtype::ALL
        .into_iter()
        .find(|w| w.name() == s)
        .ok_or_else(|| {
            let names: Vec<&str> = WeightDtype::ALL.iter().map(|w| w.name()).collect();
            let (last, rest) = names.split_last().expect("storages");
            ModelError::Device(format!(
                "weight-dtype must be {} or {last}, got {s:?}",
                rest.join(", ")
            ))
        })
}

/// Refuses a weight storage that the device and compute dtype cannot use: bf16 storage is for
/// float32 arithmetic on the CPU.
pub fn check_weight_dtype(
    weights: crate::transformer::WeightDtype,
    device: &Device,
    dtype: DType,
) -> Result<()> {
    if weights != crate::transformer::WeightDtype::F32 && (!device.is_cpu() || dtype != DType::F32)
    {
        return Err(ModelError::Device(
            "weight-dtype bf16, bf16-dot, int8, int8-dot, q4 or q4-dot stores CPU weights for the CPU kernels; it needs \
             --device cpu and --dtype f32 (on a GPU, --dtype bf16 computes in bf16)"
                .into(),
        ));
    }
    Ok(())
}

/// The device the golden tests run on: `WAVEFRONT_TEST_DEVICE` (default `cpu`), opened once
/// per process. Every caller gets the same device: candle gives each `Device::new_cuda` its
/// own identity, and a K/V pool keeps one arena set per device identity, so rows written
/// through one opening and read through another would read a fresh arena's zeros (what made
/// Huginn's zero-init diffusion case, whose draws were built on a second opening, disagree
/// with upstream on the GPU alone).
///
/// # Panics
/// When the variable names a device that cannot be opened: a test run asked for a GPU must not
/// silently fall back to the CPU.
pub fn test_device() -> Device {
    static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| {
            let name = std::env::var("WAVEFRONT_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
            parse_device(&name).unwrap_or_else(|e| panic!("WAVEFRONT_TEST_DEVICE: {e}"))
        })
        .clone()
}

/// The directory of the test fixture `name` (`tests/fixtures/<name>` of this repository), or
/// `$WAVEFRONT_FIXTURES/<name>` when that variable is set: test binaries carried to another
/// machine (a GPU host) find the fixtures of the tree they run in.
pub fn test_fixture(name: &str) -> std::path::PathBuf {
    std::env::var_os("WAVEFRONT_FIXTURES")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
        })
        .join(name)
}

/// Tensor parallelism for a golden test's `world` ranks on [`test_device`]:
/// `WAVEFRONT_TEST_COLLECTIVE` (`local`, the default: in-process ranks; `nccl`: NCCL over one
/// GPU per rank, in a `cuda` build on a GPU; `auto`). `None` when this machine has fewer GPUs
/// than `world` NCCL ranks need: the test names the world it skips.
///
/// # Panics
/// When the variable does not parse, or the ranks cannot be set up.
pub fn test_parallel(world: usize) -> Option<crate::transformer::TensorParallel> {
    use crate::transformer::{CollectiveKind, TensorParallel};
    let name = std::env::var("WAVEFRONT_TEST_COLLECTIVE").unwrap_or_else(|_| "local".into());
    let kind: CollectiveKind = name
        .parse()
        .unwrap_or_else(|e| panic!("WAVEFRONT_TEST_COLLECTIVE: {e}"));
    let device = test_device();
    if kind.uses_nccl(world, &device) && world > gpus_from(&device) {
        eprintln!(
            "skipping {world} NCCL ranks: this machine has {} GPU(s) from {:?} on",
            gpus_from(&device),
            device.location()
        );
        return None;
    }
    Some(
        TensorParallel::for_device(kind, world, &device)
            .unwrap_or_else(|e| panic!("{world} tensor-parallel ranks: {e}")),
    )
}

/// GPUs visible from `device`'s ordinal on (`cuda:N` counts N, N+1, ...); 0 for the CPU or a
/// build without the `cuda` feature.
pub fn gpus_from(device: &Device) -> usize {
    #[cfg(feature = "cuda")]
    if let candle_core::DeviceLocation::Cuda { gpu_id } = device.location() {
        let count = cudarc::driver::CudaContext::device_count()
            .unwrap_or(0)
            .max(0) as usize;
        return count.saturating_sub(gpu_id);
    }
    let _ = device;
    0
}
