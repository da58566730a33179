//! `bench-slot-diffusion`: ReFusion's plan-and-infill against plain autoregressive decoding of
//! the same synthetic Qwen3-shaped model (random weights, see [`synthetic`]) with the same KV
//! cache, served through the real engine.
//!
//! Plan-and-infill (Li et al. 2025, upstream `generate_refusion()`) drafts a block's masked
//! slots in one call, verifies the confident ones autoregressively in a second, and completes
//! them in parallel (two calls per step); `ar` decodes one token per call. At each concurrency
//! in `--concurrency`, N requests of each scheme are submitted together (the engine packs one
//! call of each request into every forward), and the table reports, side by side, model calls
//! per request, wall time, latency per request, aggregate tokens per second, rows (tokens)
//! computed per call, and plan-and-infill's slots per iteration and verified prefix.
//!
//! Prints a markdown table on stdout and progress on stderr.

mod synthetic;

use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use wavefront_engine::{Event, Stats};
use wavefront_models::candle_core::{DType, Device};
use wavefront_schemes::slot_diffusion::serve_model;
use wavefront_schemes::{
    ArParams, GenerateSpec, LoadOptions, PlanInfillParams, SamplingParams, SchemeParams,
    ServedModel,
};

#[derive(Debug, Parser)]
#[command(about = "ReFusion plan-and-infill against autoregressive decoding on a synthetic Qwen3")]
struct Args {
    #[arg(long, default_value_t = 512)]
    hidden_size: usize,
    #[arg(long, default_value_t = 8)]
    num_attention_heads: usize,
    #[arg(long, default_value_t = 4)]
    num_key_value_heads: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    #[arg(long, default_value_t = 8)]
    num_hidden_layers: usize,
    #[arg(long, default_value_t = 1536)]
    intermediate_size: usize,
    #[arg(long, default_value_t = 32768)]
    vocab_size: usize,
    /// Scale of the q/k projections over the init.
    #[arg(long, default_value_t = 1.0)]
    qk_scale: f64,
    /// Scale of the output head over the init (peaked distributions).
    #[arg(long, default_value_t = 24.0)]
    head_scale: f64,
    /// Shared embedding direction that makes every position lean towards one token, so drafts
    /// verify (0: fully random weights, drafts almost never verify).
    #[arg(long, default_value_t = 0.0)]
    consensus: f64,
    /// Prompt tokens per request (random ids).
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// gen_length (max_new_tokens).
    #[arg(long, default_value_t = 256)]
    gen_length: usize,
    #[arg(long, default_value_t = 4)]
    slot_size: usize,
    /// Number of blocks (block length = gen_length / serial_num_blocks).
    #[arg(long, default_value_t = 8)]
    serial_num_blocks: usize,
    #[arg(long, default_value_t = 0.9)]
    slot_threshold: f32,
    #[arg(long, default_value_t = 0.4)]
    token_threshold: f32,
    /// Concurrent requests per run.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    concurrency: Vec<usize>,
    /// `cpu` or `cuda:N` (needs a build with `--features wavefront-models/cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// `f32` or `bf16`.
    #[arg(long, default_value = "f32")]
    dtype: String,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    PlanInfill,
    Ar,
}

impl Workload {
    const ALL: [Workload; 2] = [Workload::PlanInfill, Workload::Ar];

    fn label(self) -> &'static str {
        match self {
            Workload::PlanInfill => "plan-infill",
            Workload::Ar => "ar (baseline)",
        }
    }

    fn request(self, a: &Args, i: u64) -> GenerateSpec {
        let mut rng = StdRng::seed_from_u64(a.seed ^ (i + 1).wrapping_mul(0x9e37_79b9));
        // Ordinary ids: below the two special rows (bos, mask) at the end of the vocabulary.
        let prompt_ids = (0..a.prompt_len)
            .map(|_| rng.random_range(0..(a.vocab_size - 2) as u32))
            .collect();
        let scheme = match self {
            Workload::PlanInfill => SchemeParams::PlanInfill(PlanInfillParams {
                slot_size: a.slot_size,
                serial_num_blocks: a.serial_num_blocks,
                slot_threshold: a.slot_threshold,
                token_threshold: a.token_threshold,
                ..PlanInfillParams::default()
            }),
            Workload::Ar => SchemeParams::Ar(ArParams::default()),
        };
        GenerateSpec {
            prompt_ids,
            max_new_tokens: a.gen_length,
            stop_token_ids: Vec::new(),
            sampling: SamplingParams {
                seed: i,
                ..SamplingParams::default()
            },
            scheme,
            replay_draws: None,
            stream_canvas: false,
        }
    }
}

struct Outcome {
    tokens: usize,
    stats: Stats,
    latency: Duration,
}

fn submit(served: &dyn ServedModel, spec: GenerateSpec) -> Result<Receiver<Event>> {
    let (tx, rx) = mpsc::sync_channel(4096);
    served.submit(spec, Box::new(tx), None, tracing::Span::none())?;
    Ok(rx)
}

fn wait(rx: &Receiver<Event>, started: Instant) -> Result<Outcome> {
    let mut tokens = 0;
    loop {
        match rx
            .recv_timeout(Duration::from_secs(3600))
            .context("engine stalled")?
        {
            Event::Tokens(t) => tokens += t.len(),
            Event::Canvas(_) => {}
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

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = values.collect();
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn series_mean(outs: &[Outcome], name: &str) -> Option<f64> {
    let v: Vec<f64> = outs
        .iter()
        .flat_map(|o| o.stats.series.get(name).into_iter().flatten())
        .map(|&x| f64::from(x))
        .collect();
    (!v.is_empty()).then(|| mean(v.into_iter()))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let device = match a.device.as_str() {
        "cpu" => Device::Cpu,
        d => match d.strip_prefix("cuda:") {
            Some(n) => Device::new_cuda(n.parse()?)?,
            None => bail!("--device must be cpu or cuda:N"),
        },
    };
    let dtype = match a.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        d => bail!("--dtype must be f32 or bf16, got {d}"),
    };
    let shape = synthetic::Shape {
        hidden_size: a.hidden_size,
        num_attention_heads: a.num_attention_heads,
        num_key_value_heads: a.num_key_value_heads,
        head_dim: a.head_dim,
        num_hidden_layers: a.num_hidden_layers,
        intermediate_size: a.intermediate_size,
        vocab_size: a.vocab_size,
        max_position_embeddings: 4096,
    };
    let cfg = shape.config()?;
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
    let opts = LoadOptions {
        name: "synthetic-refusion".into(),
        device: device.clone(),
        dtype,
        memory_budget_bytes: 16 << 30,
        queue_capacity: 64,
        max_active: 2 * max_c,
        occupancy_multiplier: 1.0,
        ..LoadOptions::default()
    };
    let (seed, qk, head, consensus) = (a.seed, a.qk_scale, a.head_scale, a.consensus);
    let model_cfg = cfg.clone();
    let served = serve_model(cfg, None, opts, move |device, dtype| {
        synthetic::random_model(&model_cfg, seed, qk, head, consensus, device, dtype)
            .map_err(|e| e.to_string())
    })?;

    // Warm up (allocator, kernels) with one short request of each scheme.
    for w in Workload::ALL {
        let mut warm = w.request(&a, 999);
        warm.max_new_tokens = a.gen_length / a.serial_num_blocks;
        if let SchemeParams::PlanInfill(p) = &mut warm.scheme {
            p.serial_num_blocks = 1;
        }
        wait(&submit(served.as_ref(), warm)?, Instant::now())?;
    }

    println!("| scheme | concurrent requests | model calls per request | wall s | latency per request s | tokens/s (all requests) | tokens computed per call | slots selected per iteration | verified prefix per iteration | iterations (fast path / iterative) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for &c in &a.concurrency {
        for w in Workload::ALL {
            eprintln!("{} x{c}...", w.label());
            let started = Instant::now();
            let rxs = (0..c as u64)
                .map(|i| submit(served.as_ref(), w.request(&a, i)))
                .collect::<Result<Vec<_>>>()?;
            let outs = rxs
                .iter()
                .map(|rx| wait(rx, started))
                .collect::<Result<Vec<_>>>()?;
            let wall = started.elapsed().as_secs_f64();
            let tokens: usize = outs.iter().map(|o| o.tokens).sum();
            let calls = mean(outs.iter().map(|o| o.stats.forward_passes as f64));
            let latency = mean(outs.iter().map(|o| o.latency.as_secs_f64()));
            let rows = series_mean(&outs, "rows_per_call").unwrap_or(0.0);
            let fmt = |x: Option<f64>| x.map_or("-".to_owned(), |x| format!("{x:.2}"));
            let counter = |name: &str| -> f64 {
                mean(
                    outs.iter()
                        .map(|o| o.stats.counters.get(name).copied().unwrap_or(0) as f64),
                )
            };
            let paths = if w == Workload::PlanInfill {
                format!(
                    "{:.1} / {:.1}",
                    counter("prefix_path_iterations"),
                    counter("iterative_path_iterations")
                )
            } else {
                "-".to_owned()
            };
            println!(
                "| {} | {c} | {calls:.1} | {wall:.2} | {latency:.2} | {:.1} | {rows:.1} | {} | {} | {paths} |",
                w.label(),
                tokens as f64 / wall,
                fmt(series_mean(&outs, "slots_selected_per_iteration")),
                fmt(series_mean(&outs, "verified_prefix_per_iteration")),
            );
        }
    }
    served.shutdown();
    Ok(())
}
