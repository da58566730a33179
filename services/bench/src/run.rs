//! Requests through a served model's engine: submitting one, waiting for its outcome, serving a
//! set together or one after another, and the prompts, flags and load options every bench
//! shares.

use std::ops::Range;
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use wavefront_engine::{Event, Stats};
use wavefront_models::candle_core::{DType, Device};
use wavefront_models::device::{check_weight_dtype, parse_device, parse_dtype, parse_weight_dtype};
use wavefront_models::ModelError;
use wavefront_schemes::{GenerateSpec, KvCacheDtype, LoadOptions, SchemeParams, ServedModel};

/// How long a request may go without an event before the engine counts as stalled.
const STALL_TIMEOUT: Duration = Duration::from_secs(3600);

/// What one request produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The generated tokens, in order.
    pub tokens: Vec<u32>,
    /// The engine's statistics of the request.
    pub stats: Stats,
    /// From the instant given to [`wait`] to the request's end.
    pub latency: Duration,
}

impl Outcome {
    /// The mean of the request's statistic series `name`; `None` when it recorded no values.
    pub fn mean_series(&self, name: &str) -> Option<f64> {
        let v = self.stats.series.get(name)?;
        (!v.is_empty()).then(|| v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64)
    }
}

/// Submits `spec`; its events arrive on the returned channel.
pub fn submit(served: &dyn ServedModel, spec: GenerateSpec) -> Result<Receiver<Event>> {
    let (tx, rx) = mpsc::sync_channel(4096);
    served.submit(spec, Box::new(tx), None, tracing::Span::none())?;
    Ok(rx)
}

/// Reads a request's events until it finishes; its latency counts from `started`.
pub fn wait(rx: &Receiver<Event>, started: Instant) -> Result<Outcome> {
    let mut tokens = Vec::new();
    loop {
        match rx.recv_timeout(STALL_TIMEOUT).context("engine stalled")? {
            Event::Tokens(t) => tokens.extend(t),
            Event::Canvas(_) | Event::Logprobs(_) | Event::PromptLogprobs(_) | Event::Parked => {}
            Event::Finished { stats, .. } => {
                return Ok(Outcome {
                    tokens,
                    stats,
                    latency: started.elapsed(),
                })
            }
            Event::Failed(e) => bail!("request failed: {e}"),
        }
    }
}

/// Serves one request and waits for it; its latency counts from its submission.
pub fn serve(served: &dyn ServedModel, spec: GenerateSpec) -> Result<Outcome> {
    let started = Instant::now();
    wait(&submit(served, spec)?, started)
}

/// Submits every request at once (the engine packs them into shared forwards), then waits for
/// all of them; returns their outcomes, latencies counted from the start, and the wall time.
pub fn together(
    served: &dyn ServedModel,
    specs: impl IntoIterator<Item = GenerateSpec>,
) -> Result<(Vec<Outcome>, Duration)> {
    let started = Instant::now();
    let receivers = specs
        .into_iter()
        .map(|spec| submit(served, spec))
        .collect::<Result<Vec<_>>>()?;
    let outs = receivers
        .iter()
        .map(|rx| wait(rx, started))
        .collect::<Result<Vec<_>>>()?;
    Ok((outs, started.elapsed()))
}

/// Serves the requests one after another; returns their outcomes, each latency counted from its
/// own submission, and the wall time.
pub fn one_after_another(
    served: &dyn ServedModel,
    specs: impl IntoIterator<Item = GenerateSpec>,
) -> Result<(Vec<Outcome>, Duration)> {
    let started = Instant::now();
    let outs = specs
        .into_iter()
        .map(|spec| serve(served, spec))
        .collect::<Result<Vec<_>>>()?;
    Ok((outs, started.elapsed()))
}

/// Median seconds of `f` over `n` runs after one warm-up, each ending when `device` has run
/// the work `f` queued.
pub fn median_secs(device: &Device, n: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    device.synchronize()?;
    let mut t = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        f()?;
        // A GPU's work is queued: the time counts until it has run.
        device.synchronize()?;
        t.push(start.elapsed().as_secs_f64());
    }
    Ok(median(&t))
}

/// The median of `v` (the upper of the middle two for an even count).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// [`GenerateSpec::greedy`], the request benchmarks and tests send.
pub fn spec(
    prompt_ids: Vec<u32>,
    max_new_tokens: usize,
    seed: u64,
    scheme: SchemeParams,
) -> GenerateSpec {
    GenerateSpec::greedy(prompt_ids, max_new_tokens, seed, scheme)
}

/// The prompt of request `i` of a run seeded with `seed`: `len` token ids drawn uniformly from
/// `ids`.
pub fn random_prompt(seed: u64, i: u64, len: usize, ids: Range<u32>) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed ^ (i + 1).wrapping_mul(0x9e37_79b9));
    (0..len).map(|_| rng.random_range(ids.clone())).collect()
}

/// The device and dtype that the `--device` (`cpu` or `cuda:N`) and `--dtype` (`f32` or `bf16`)
/// flags name.
pub fn device_and_dtype(device: &str, dtype: &str) -> Result<(Device, DType)> {
    let flag = |e: ModelError| anyhow!("--{e}");
    Ok((
        parse_device(device).map_err(flag)?,
        parse_dtype(dtype).map_err(flag)?,
    ))
}

/// Where and how a bench's model runs: the `--device`, `--dtype` and `--attention` flags every
/// bench takes.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// `cpu` or `cuda:N` (cuda needs a build with the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute dtype: `f32` or `bf16`.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// How packed calls attend: `sdpa` (candle ops per sequence) or `ragged` (one operation
    /// over every sequence; not for the recurrent-depth model).
    #[arg(long, default_value = "sdpa")]
    pub attention: String,
    /// How CPU weights are stored: `f32`, or `bf16` (float32 arithmetic).
    #[arg(long, default_value = "f32")]
    pub weight_dtype: String,
    /// What the CPU K/V cache stores: `auto` (bf16 with bf16-dot weights), `float32` or
    /// `bf16`.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    /// Threads of the CPU kernels (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Finished requests kept for their prompt pages (the prefix cache), as `wavefront
    /// serve`'s flag. Off (0) unless asked, unlike `serve`: the benches serve the same requests
    /// more than once to compare ways of serving them (together and one after another, one
    /// scheme and another), and a cache would let a later run read an earlier run's prompts
    /// (ARMT's 8 x 8192 together-run read the memories the one-after-another run had left).
    #[arg(long, default_value_t = 0)]
    pub prefix_cache_entries: usize,
}

impl Target {
    /// Sets the process up as `wavefront` does (call once, first): the allocator
    /// ([`wavefront_models::tune_allocator`]) and the CPU kernels' thread pool (`--threads`).
    pub fn init_threads(&self) -> Result<()> {
        let n = match self.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        // As `wavefront` does: candle's own spinning pool would compete with the kernels'.
        if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
            std::env::set_var("CANDLE_NUM_THREADS", "1");
        }
        wavefront_models::tune_allocator();
        wavefront_models::init_cpu_threads(n).map_err(|e| anyhow!(e))
    }

    /// Load options of the synthetic model `name` on the flags' device, dtype and attention,
    /// queueing 64 requests at most; each bench sets its memory budget and concurrency.
    pub fn load_options(&self, name: &str) -> Result<LoadOptions> {
        let (device, dtype) = device_and_dtype(&self.device, &self.dtype)?;
        let flag = |e: ModelError| anyhow!("--{e}");
        let weight_dtype = parse_weight_dtype(&self.weight_dtype).map_err(flag)?;
        check_weight_dtype(weight_dtype, &device, dtype).map_err(flag)?;
        let attention = self
            .attention
            .parse()
            .map_err(|e| anyhow!("--attention: {e}"))?;
        let kv_cache_dtype = KvCacheDtype::parse(&self.kv_cache_dtype).map_err(|e| anyhow!(e))?;
        Ok(LoadOptions {
            name: name.into(),
            device,
            dtype,
            queue_capacity: 64,
            attention,
            weight_dtype,
            kv_cache_dtype,
            prefix_cache_entries: self.prefix_cache_entries,
            ..LoadOptions::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wavefront_models::transformer::AttentionKernel;

    #[test]
    fn random_prompts_are_reproducible_per_request_and_stay_in_range() {
        let a = random_prompt(7, 0, 64, 3..40);
        assert_eq!(a, random_prompt(7, 0, 64, 3..40));
        assert_ne!(a, random_prompt(7, 1, 64, 3..40));
        assert_ne!(a, random_prompt(8, 0, 64, 3..40));
        assert!(a.iter().all(|id| (3..40).contains(id)));
    }

    #[test]
    fn flags_name_the_device_and_dtype_or_say_which_flag_is_wrong() {
        let target = Target {
            device: "cpu".into(),
            dtype: "bf16".into(),
            attention: "ragged".into(),
            weight_dtype: "f32".into(),
            kv_cache_dtype: "auto".into(),
            threads: 0,
            prefix_cache_entries: 0,
        };
        let opts = target.load_options("synthetic").unwrap();
        assert_eq!(opts.prefix_cache_entries, 0);
        assert_eq!(opts.attention, AttentionKernel::Ragged);
        assert_eq!(opts.name, "synthetic");
        assert!(matches!(opts.device, Device::Cpu));
        assert_eq!(opts.dtype, DType::BF16);
        assert_eq!(opts.queue_capacity, 64);
        let err = device_and_dtype("gpu", "f32").unwrap_err().to_string();
        assert!(err.starts_with("--device "), "{err}");
        let err = device_and_dtype("cpu", "f16").unwrap_err().to_string();
        assert!(err.starts_with("--dtype "), "{err}");
        let bad = Target {
            attention: "flash".into(),
            ..target
        };
        let err = bad.load_options("synthetic").unwrap_err().to_string();
        assert!(
            err.starts_with("--attention: unknown attention kernel"),
            "{err}"
        );
    }
}
