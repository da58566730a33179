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

use wavefront_bench::synthetic::qwen3 as synthetic;

use anyhow::Result;
use clap::Parser;
use wavefront_bench::run;
use wavefront_bench::table::Align::{Left, Right};
use wavefront_bench::table::{self, mean, series_mean};
use wavefront_schemes::slot_diffusion::serve_model;
use wavefront_schemes::{ArParams, GenerateSpec, LoadOptions, PlanInfillParams, SchemeParams};

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
    #[command(flatten)]
    target: run::Target,
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
        // Ordinary ids: below the two special rows (bos, mask) at the end of the vocabulary.
        let prompt_ids = run::random_prompt(a.seed, i, a.prompt_len, 0..(a.vocab_size - 2) as u32);
        let scheme = match self {
            Workload::PlanInfill => SchemeParams::PlanInfill(PlanInfillParams {
                span_size: a.slot_size,
                serial_num_blocks: a.serial_num_blocks,
                span_threshold: a.slot_threshold,
                token_threshold: a.token_threshold,
                ..PlanInfillParams::default()
            }),
            Workload::Ar => SchemeParams::Ar(ArParams::default()),
        };
        run::spec(prompt_ids, a.gen_length, i, scheme)
    }
}

fn main() -> Result<()> {
    let a = Args::parse();
    a.target.init_threads()?;
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
        memory_budget_bytes: 16 << 30,
        max_active: 2 * max_c,
        occupancy_multiplier: 1.0,
        ..a.target.load_options("synthetic-refusion")?
    };
    let (seed, qk, head, consensus) = (a.seed, a.qk_scale, a.head_scale, a.consensus);
    let model_cfg = cfg.clone();
    let served = serve_model(cfg, None, opts, move |device, dtype| {
        synthetic::random_model(&model_cfg, seed, qk, head, consensus, device, dtype)
    })?;

    // Warm up (allocator, kernels) with one short request of each scheme.
    for w in Workload::ALL {
        let mut warm = w.request(&a, 999);
        warm.max_new_tokens = a.gen_length / a.serial_num_blocks;
        if let SchemeParams::PlanInfill(p) = &mut warm.scheme {
            p.serial_num_blocks = 1;
        }
        run::serve(served.as_ref(), warm)?;
    }

    table::print_header(&[
        ("scheme", Left),
        ("concurrent requests", Right),
        ("model calls per request", Right),
        ("wall s", Right),
        ("latency per request s", Right),
        ("tokens/s (all requests)", Right),
        ("tokens computed per call", Right),
        ("slots selected per iteration", Right),
        ("verified prefix per iteration", Right),
        ("iterations (fast path / iterative)", Left),
    ]);
    for &c in &a.concurrency {
        for w in Workload::ALL {
            eprintln!("{} x{c}...", w.label());
            let (outs, wall) =
                run::together(served.as_ref(), (0..c as u64).map(|i| w.request(&a, i)))?;
            let wall = wall.as_secs_f64();
            let tokens = table::total_tokens(&outs);
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
