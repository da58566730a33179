//! Flags that say how a worker (or `run`) loads and sizes its model.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use wavefront_models::candle_core::{DType, Device};
use wavefront_models::transformer::{CollectiveKind, WeightDtype};
use wavefront_models::ModelFiles;
use wavefront_schemes::{KvCacheDtype, KvReserve, LoadOptions};

use crate::embedded;

#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Model directory in the Hugging Face layout (config.json, model.safetensors
    /// or shards + index, tokenizer.json), a GGUF file (llama.cpp's LLaDA or Dream, or one
    /// `wavefront export-gguf` wrote), or the name of an embedded model (huginn, llada,
    /// refusion, armt). Default: the embedded models (`serve`: all four, each under its
    /// family's name; `run` and `worker`: huginn, or for `run` the one --model-name names).
    #[arg(long, env = "WAVEFRONT_MODEL")]
    pub model: Option<PathBuf>,
    /// Name the model is served under (default: the directory name).
    #[arg(long, env = "WAVEFRONT_MODEL_NAME")]
    pub served_name: Option<String>,
    /// Device: cpu or cuda:N (cuda needs a build with the `cuda` feature).
    #[arg(long, env = "WAVEFRONT_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Compute dtype: f32 or bf16 (default: f32 on cpu, bf16 on cuda). On the CPU, bf16 means
    /// bf16 products with float32 accumulation, norms and softmax (the same as
    /// --weight-dtype bf16-dot).
    #[arg(long, env = "WAVEFRONT_DTYPE")]
    pub dtype: Option<String>,
    /// Memory given to the slot pool (K/V cache and latent states), in MiB.
    #[arg(long, env = "WAVEFRONT_MEMORY_BUDGET_MB", default_value_t = 256)]
    pub memory_budget_mb: u64,
    /// Requests allowed to wait for admission; more get RESOURCE_EXHAUSTED.
    #[arg(long, env = "WAVEFRONT_QUEUE_CAPACITY", default_value_t = 64)]
    pub queue_capacity: usize,
    /// Requests batched into one engine tick at most.
    #[arg(long, env = "WAVEFRONT_MAX_ACTIVE", default_value_t = 32)]
    pub max_active: usize,
    /// Diffusion forcing: latent-state slots reserved per request are its
    /// max_wavefront times this.
    #[arg(long, env = "WAVEFRONT_OCCUPANCY_MULTIPLIER", default_value_t = 1.0)]
    pub occupancy_multiplier: f32,
    /// Recurrent-memory (ARMT) models: the longest prompt + max_new_tokens accepted (memory per
    /// request does not grow with it). Default 131072. Other families use their config's limit.
    #[arg(long, env = "WAVEFRONT_MAX_CONTEXT_TOKENS")]
    pub max_context_tokens: Option<usize>,
    /// Tensor-parallel ranks each transformer block is split over (attention heads and MLP
    /// columns; partials summed after the row-parallel layers); every family. Must divide the
    /// model's attention heads and MLP columns.
    #[arg(long, env = "WAVEFRONT_TENSOR_PARALLEL", default_value_t = 1)]
    pub tensor_parallel: usize,
    /// What joins the ranks: auto (NCCL over one GPU per rank, cuda:N, N+1, ..., when the model
    /// is on a GPU and split; else in-process), local (every rank in this process on --device),
    /// nccl (NCCL even at one rank; needs the `cuda` feature).
    #[arg(long, env = "WAVEFRONT_COLLECTIVE", default_value = "auto")]
    pub collective: String,
    /// How a packed forward attends: sdpa (candle ops, one attention per sequence) or ragged
    /// (every sequence of the forward in one operation: the wavefront-kernels CUDA kernel on a
    /// GPU, its CPU reference on the CPU). ragged serves llada, armt and refusion models.
    #[arg(long, env = "WAVEFRONT_ATTENTION", default_value = "sdpa")]
    pub attention: String,
    /// How CPU weights are stored: f32, bf16 (half the bytes each forward reads, arithmetic
    /// still in float32; weights rounded once at load), or bf16-dot (bf16 weights times
    /// activations rounded to bf16 at each product, float32 accumulation: AVX512-BF16 where the
    /// CPU has it), or int8 (8-bit weights with a scale per output channel, a quarter of the
    /// bytes, arithmetic in float32), or int8-dot (the same weights times activations quantised
    /// to 8 bits per row, exact integer products: AVX512-VNNI where the CPU has it), or q4
    /// (4-bit weights with a scale per channel and group of 32 inputs, an eighth of the bytes
    /// plus scales), or q4-dot (those weights times 8-bit activations, integer products per
    /// group). CPU with --dtype f32 only. Default: f32, except for a GGUF file on the CPU,
    /// whose matrices' block format picks it (8-bit and 5-6-bit blocks int8, 2-4-bit blocks q4,
    /// f16 and bf16 bf16; f32 keeps the file's values exactly).
    #[arg(long, env = "WAVEFRONT_WEIGHT_DTYPE")]
    pub weight_dtype: Option<String>,
    /// What the K/V cache stores on the CPU: auto (bf16 with --dtype bf16, float32 otherwise),
    /// float32, or bf16 (half the memory per cached position, so twice the positions in
    /// --memory-budget-mb, and half the bytes decode attention reads; keys and values rounded
    /// to nearest even when written: approximate, see docs/benchmarks.md). On a GPU the cache
    /// holds the model's --dtype.
    #[arg(long, env = "WAVEFRONT_KV_CACHE_DTYPE", default_value = "auto")]
    pub kv_cache_dtype: String,
    /// How a request takes its K/V pages: on-demand (its first step's at admission, more as it
    /// grows, the newest request preempted to host memory when the pool is short) or
    /// worst-case (prompt and every token it may generate at admission; no preemption, fewer
    /// requests at once). Masked-diffusion requests take their whole canvas either way.
    #[arg(long, env = "WAVEFRONT_KV_RESERVE", default_value = "on-demand")]
    pub kv_reserve: String,
    /// Positions a K/V page holds per layer (1..=1024). Smaller pages waste less of each
    /// request's last page; larger ones are read in longer runs (on the CPU, 64 decodes a
    /// 4096-token context about as fast as one buffer; see docs/benchmarks.md).
    #[arg(long, env = "WAVEFRONT_KV_PAGE_SIZE", default_value_t = wavefront_models::transformer::PAGE_SIZE)]
    pub kv_page_size: usize,
    /// Rows one engine tick computes at most (0: no cap). Autoregressive prefills (Huginn
    /// static ar, ReFusion ar) run in chunks of what the tick's other work leaves, so a long
    /// prompt does not stall the others' decoding; decoding steps, canvases, segments,
    /// wavefronts and plan-and-infill calls run whole and count against it.
    #[arg(long, env = "WAVEFRONT_MAX_BATCH_ROWS", default_value_t = 2048)]
    pub max_batch_rows: usize,
    /// Whether requests with the same prompt (the choices of a request with n > 1, or
    /// identical prompts) read one copy of its pages where the family allows it (ReFusion,
    /// LLaDA2.0, DiffusionGemma, Huginn when the initial states agree; ARMT takes a copy of the
    /// memories its memory segments leave): true or false.
    #[arg(long, env = "WAVEFRONT_PROMPT_SHARING", default_value_t = true, action = clap::ArgAction::Set)]
    pub prompt_sharing: bool,
    /// Finished requests kept for their prompt pages (the prefix cache, with prompt sharing
    /// on): a later request with the same prompt reads them instead of computing them. They
    /// are given back, least recently used first, whenever the pool needs their slots, so the
    /// cache never refuses or preempts a request (0: keep none).
    #[arg(long, env = "WAVEFRONT_PREFIX_CACHE_ENTRIES", default_value_t = wavefront_engine::scheduler::DEFAULT_PREFIX_CACHE_ENTRIES)]
    pub prefix_cache_entries: usize,
    /// Seconds a client may leave its response unread before its request is cancelled and its
    /// memory freed (0: never). Until then the request is paused and is the first preempted
    /// (its state moved to host memory) when others need its slots.
    #[arg(long, env = "WAVEFRONT_WRITE_TIMEOUT_S", default_value_t = 30)]
    pub write_timeout_s: u64,
}

impl ModelArgs {
    /// `serve`'s models: the one `--model` names, or every embedded model under its family's
    /// name.
    pub fn serve_files(&self) -> Result<Vec<(ModelFiles, String)>> {
        if self.model.is_some() {
            return Ok(vec![self.files()?]);
        }
        if self.served_name.is_some() {
            bail!(
                "--served-name names the model of --model; without --model, serve brings up the \
                 embedded models under their own names ({})",
                embedded::MODELS.map(|m| m.name).join(", ")
            );
        }
        Ok(embedded::MODELS
            .iter()
            .map(|m| (m.files(), m.name.to_owned()))
            .collect())
    }

    /// The model of `run` and `worker`: `--model`, or the embedded default.
    pub fn files(&self) -> Result<(ModelFiles, String)> {
        resolve(self.model.as_deref(), self.served_name.clone())
    }

    /// The options of `files`' model served as `name`.
    pub fn load_options(&self, name: String, files: &ModelFiles) -> Result<LoadOptions> {
        let device = parse_device(&self.device)?;
        let dtype = match self.dtype.as_deref() {
            None if device.is_cuda() => DType::BF16,
            None => DType::F32,
            Some(name) => {
                wavefront_models::device::parse_dtype(name).map_err(|e| anyhow::anyhow!("--{e}"))?
            }
        };
        if self.memory_budget_mb == 0 {
            bail!("--memory-budget-mb must be at least 1");
        }
        if self.queue_capacity == 0 || self.max_active == 0 {
            bail!("--queue-capacity and --max-active must be at least 1");
        }
        if self.tensor_parallel == 0 {
            bail!("--tensor-parallel must be at least 1");
        }
        let collective: CollectiveKind = self.collective.parse().map_err(|_| {
            anyhow::anyhow!(
                "--collective must be auto, local or nccl, got {:?}",
                self.collective
            )
        })?;
        if collective == CollectiveKind::Nccl && !device.is_cuda() {
            bail!("--collective nccl needs --device cuda:N");
        }
        let attention = self
            .attention
            .parse()
            .map_err(|e| anyhow::anyhow!("--attention: {e}"))?;
        if !self.occupancy_multiplier.is_finite() || self.occupancy_multiplier <= 0.0 {
            bail!(
                "--occupancy-multiplier must be a positive number, got {}",
                self.occupancy_multiplier
            );
        }
        let weight_dtype = match &self.weight_dtype {
            Some(w) => wavefront_models::device::parse_weight_dtype(w)
                .map_err(|e| anyhow::anyhow!("--{e}"))?,
            None => match files.gguf_weight_dtype() {
                Some(w) if device.is_cpu() && dtype == DType::F32 => {
                    tracing::info!(
                        model = %name,
                        weight_dtype = w.name(),
                        "GGUF weights stored in the format their blocks suggest \
                         (--weight-dtype f32 keeps the file's values exactly)"
                    );
                    w
                }
                _ => WeightDtype::F32,
            },
        };
        // On the CPU, bf16 compute is the kernels' bf16 pair products over float32 tensors
        // (norms, softmax and reductions stay float32): `--weight-dtype bf16-dot`.
        let (dtype, weight_dtype) = if device.is_cpu() && dtype == DType::BF16 {
            if weight_dtype == WeightDtype::Bf16 {
                bail!(
                    "--dtype bf16 on the CPU stores bf16 weights and multiplies in bf16 \
                     (bf16-dot); leave --weight-dtype unset"
                );
            }
            (DType::F32, WeightDtype::Bf16Dot)
        } else {
            (dtype, weight_dtype)
        };
        wavefront_models::device::check_weight_dtype(weight_dtype, &device, dtype)
            .map_err(|e| anyhow::anyhow!("--{e}"))?;
        if self.max_context_tokens.is_some_and(|n| n < 2) {
            bail!("--max-context-tokens must be at least 2");
        }
        if !(1..=1024).contains(&self.kv_page_size) {
            bail!(
                "--kv-page-size must be in 1..=1024, got {}",
                self.kv_page_size
            );
        }
        let kv_cache_dtype =
            KvCacheDtype::parse(&self.kv_cache_dtype).map_err(anyhow::Error::msg)?;
        let kv_reserve = match self.kv_reserve.as_str() {
            "on-demand" => KvReserve::OnDemand,
            "worst-case" => KvReserve::WorstCase,
            other => bail!("--kv-reserve must be on-demand or worst-case, got {other:?}"),
        };
        Ok(LoadOptions {
            name,
            device,
            dtype,
            memory_budget_bytes: self.memory_budget_mb << 20,
            queue_capacity: self.queue_capacity,
            max_active: self.max_active,
            occupancy_multiplier: self.occupancy_multiplier,
            max_context_tokens: self.max_context_tokens,
            tensor_parallel: self.tensor_parallel,
            collective,
            attention,
            weight_dtype,
            kv_cache_dtype,
            kv_reserve,
            kv_page_size: self.kv_page_size,
            max_batch_rows: (self.max_batch_rows > 0).then_some(self.max_batch_rows),
            prompt_sharing: self.prompt_sharing,
            prefix_cache_entries: self.prefix_cache_entries,
            write_timeout: (self.write_timeout_s > 0)
                .then(|| std::time::Duration::from_secs(self.write_timeout_s)),
            // Set by `load_model` from the checkpoint.
            fingerprint: Default::default(),
        })
    }
}

fn parse_device(s: &str) -> Result<Device> {
    wavefront_models::device::parse_device(s).map_err(|e| anyhow::anyhow!("--{e}"))
}

/// The model `--model` names (a directory, a GGUF file or an embedded model's name), or the
/// embedded default, and the name it is served under (`served_name`, else the directory's or
/// file's name).
pub fn resolve(model: Option<&Path>, served_name: Option<String>) -> Result<(ModelFiles, String)> {
    match model {
        None => {
            let m = embedded::default_model();
            Ok((
                m.files(),
                served_name.clone().unwrap_or_else(|| m.name.into()),
            ))
        }
        // An embedded model by name, unless a directory of that name is at hand.
        Some(dir) if !dir.exists() => {
            let name = dir.to_string_lossy();
            let Some(m) = embedded::MODELS.iter().find(|m| m.name == name) else {
                let org_slash_name = name.matches('/').count() == 1
                    && !name.starts_with(['/', '.', '~'])
                    && !name.ends_with('/');
                let hint = if org_slash_name {
                    " (a Hugging Face id? wavefront reads local files only: download the \
                     checkpoint, e.g. with `huggingface-cli download`, and pass its \
                     directory)"
                } else {
                    ""
                };
                bail!(
                    "--model {name}: no such directory or file, and not an embedded model ({}){hint}",
                    embedded::MODELS.map(|m| m.name).join(", ")
                );
            };
            Ok((
                m.files(),
                served_name.clone().unwrap_or_else(|| m.name.into()),
            ))
        }
        Some(dir) => {
            let what = if dir.is_file() { "file" } else { "directory" };
            let files = ModelFiles::open(dir)
                .with_context(|| format!("cannot load model {what} {}", dir.display()))?;
            let name = served_name.clone().unwrap_or_else(|| {
                let path = dir.canonicalize().ok();
                let stem = if dir.is_file() {
                    path.as_deref().and_then(Path::file_stem)
                } else {
                    path.as_deref().and_then(Path::file_name)
                };
                stem.map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "model".into())
            });
            Ok((files, name))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use wavefront_models::gguf::GgufQuant;
    use wavefront_models::transformer::WeightDtype;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        model: ModelArgs,
    }

    fn options(flags: &[&str]) -> Result<LoadOptions> {
        let cli = Cli::try_parse_from(["wavefront"].iter().chain(flags))?;
        let (files, _) = resolve(None, None)?;
        cli.model.load_options("m".into(), &files)
    }

    /// A GGUF file on the CPU is stored in the format its blocks suggest unless the flag says
    /// otherwise; a directory stays float32.
    #[test]
    fn gguf_files_pick_their_weight_storage() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("wavefront-cli-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let (files, _) = resolve(None, None)?;
        for (quant, want) in [
            (GgufQuant::Q4K, WeightDtype::Q4),
            (GgufQuant::Q4_0, WeightDtype::Q4),
            (GgufQuant::Q8_0, WeightDtype::Int8),
            (GgufQuant::Q6K, WeightDtype::Int8),
            (GgufQuant::F16, WeightDtype::Bf16),
            (GgufQuant::F32, WeightDtype::F32),
        ] {
            let path = dir.join(format!("{}.gguf", quant.name()));
            files.export_gguf(&path, quant)?;
            let (gguf, name) = resolve(Some(&path), None)?;
            assert_eq!(name, quant.name());
            let cli = Cli::try_parse_from(["wavefront"])?;
            assert_eq!(
                cli.model.load_options(name.clone(), &gguf)?.weight_dtype,
                want
            );
            let cli = Cli::try_parse_from(["wavefront", "--weight-dtype", "f32"])?;
            assert_eq!(
                cli.model.load_options(name, &gguf)?.weight_dtype,
                WeightDtype::F32
            );
        }
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    #[test]
    fn weight_dtype_is_parsed_and_refused_where_it_cannot_apply() -> Result<()> {
        assert_eq!(options(&[])?.weight_dtype, WeightDtype::F32);
        assert_eq!(
            options(&["--weight-dtype", "bf16"])?.weight_dtype,
            WeightDtype::Bf16
        );
        assert_eq!(
            options(&["--weight-dtype", "bf16-dot"])?.weight_dtype,
            WeightDtype::Bf16Dot
        );
        let err = options(&["--weight-dtype", "f16"]).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "--weight-dtype must be f32, bf16, bf16-dot, int8, int8-dot, q4 or q4-dot"
            ),
            "{err}"
        );
        let err = options(&["--weight-dtype", "bf16", "--dtype", "bf16"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("leave --weight-dtype unset"), "{err}");
        // bf16 compute on the CPU: float32 tensors, bf16 pair products.
        let o = options(&["--dtype", "bfloat16"])?;
        assert_eq!(
            (o.dtype, o.weight_dtype),
            (DType::F32, WeightDtype::Bf16Dot)
        );
        // ... and bf16 K/V pages unless asked otherwise; float32 compute keeps float32 pages.
        assert_eq!(o.kv_dtype(), DType::BF16);
        assert_eq!(o.kv_store(), Some(DType::BF16));
        let o = options(&["--dtype", "bf16", "--kv-cache-dtype", "float32"])?;
        assert_eq!(o.kv_dtype(), DType::F32);
        assert_eq!(options(&[])?.kv_dtype(), DType::F32);
        let o = options(&["--kv-cache-dtype", "bf16"])?;
        assert_eq!((o.dtype, o.kv_dtype()), (DType::F32, DType::BF16));
        let err = options(&["--kv-cache-dtype", "fp8"])
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("--kv-cache-dtype must be auto, float32 or bf16, got \"fp8\""),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn paging_flags_are_parsed_and_bad_values_refused() -> Result<()> {
        let o = options(&[])?;
        assert_eq!(o.kv_reserve, KvReserve::OnDemand);
        assert_eq!(o.kv_page_size, wavefront_models::transformer::PAGE_SIZE);
        assert_eq!(o.max_batch_rows, Some(2048));
        let o = options(&[
            "--kv-reserve",
            "worst-case",
            "--kv-page-size",
            "64",
            "--max-batch-rows",
            "0",
        ])?;
        assert_eq!(o.kv_reserve, KvReserve::WorstCase);
        assert_eq!(o.kv_page_size, 64);
        assert_eq!(o.max_batch_rows, None);
        for (flags, want) in [
            (
                ["--kv-reserve", "lazy"],
                "--kv-reserve must be on-demand or worst-case",
            ),
            (
                ["--kv-page-size", "0"],
                "--kv-page-size must be in 1..=1024",
            ),
            (
                ["--kv-page-size", "4096"],
                "--kv-page-size must be in 1..=1024",
            ),
        ] {
            let err = options(&flags).unwrap_err().to_string();
            assert!(err.starts_with(want), "{err}");
        }
        Ok(())
    }
}
