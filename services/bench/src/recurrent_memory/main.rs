//! `bench-recurrent-memory`: prefill of a long context on a synthetic ARMT (random weights, see
//! [`synthetic`]), sequential execution against diagonal batching (Sivtsov et al. 2025,
//! "Diagonal Batching Unlocks Parallelism in Recurrent Memory Transformers for Long Contexts"),
//! served through the real engine.
//!
//! In one run, side by side:
//! 1. one request per input length in `--lengths`, once with `ar.execution = sequential` (one
//!    segment through every layer per engine tick: `segments × layers` layer calls) and once with
//!    `diagonal` (`segments + layers - 1` grouped steps); the time to the first token, which is
//!    the whole prefill (`max_new_tokens` 1), and the first tokens are checked to agree;
//! 2. `--concurrent` requests of `--concurrent-length` tokens submitted together (their
//!    diagonals packed into shared grouped steps) against the same requests run one after
//!    another, with the engine ticks each took; outputs are checked to be identical.
//!
//! Prints markdown tables on stdout and progress on stderr.

use wavefront_bench::synthetic::armt as synthetic;

use anyhow::Result;
use clap::Parser;
use wavefront_bench::run;
use wavefront_bench::table;
use wavefront_bench::table::Align::{Left, Right};
use wavefront_schemes::recurrent_memory::serve_model;
use wavefront_schemes::{ArParams, Execution, GenerateSpec, LoadOptions, SchemeParams};

#[derive(Debug, Parser)]
#[command(about = "ARMT prefill: sequential execution against diagonal batching")]
struct Args {
    #[arg(long, default_value_t = 8)]
    layers: usize,
    #[arg(long, default_value_t = 512)]
    hidden_size: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    #[arg(long, default_value_t = 1536)]
    intermediate_size: usize,
    #[arg(long, default_value_t = 32000)]
    vocab_size: usize,
    /// Real tokens per segment (upstream segment_size).
    #[arg(long, default_value_t = 256)]
    segment_size: usize,
    /// Memory tokens per segment (upstream num_mem_tokens).
    #[arg(long, default_value_t = 16)]
    num_mem_tokens: usize,
    /// Upstream d_mem (d_key = 6 · d_mem).
    #[arg(long, default_value_t = 64)]
    d_mem: usize,
    /// Input lengths of the single-request runs.
    #[arg(long, value_delimiter = ',', default_value = "4096,16384,65536")]
    lengths: Vec<usize>,
    /// Requests of the concurrency run (0 skips it).
    #[arg(long, default_value_t = 8)]
    concurrent: usize,
    /// Input length of each request of the concurrency run.
    #[arg(long, default_value_t = 4096)]
    concurrent_length: usize,
    #[command(flatten)]
    target: run::Target,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

fn request(a: &Args, len: usize, execution: Execution, i: u64) -> GenerateSpec {
    let scheme = SchemeParams::Ar(ArParams {
        execution,
        ..ArParams::default()
    });
    run::spec(
        run::random_prompt(a.seed, i, len, 3..a.vocab_size as u32),
        1,
        0,
        scheme,
    )
}

fn main() -> Result<()> {
    let a = Args::parse();
    a.target.init_threads()?;
    let shape = synthetic::Shape {
        hidden_size: a.hidden_size,
        layers: a.layers,
        heads: a.heads,
        kv_heads: a.kv_heads,
        intermediate_size: a.intermediate_size,
        vocab_size: a.vocab_size,
        segment_size: a.segment_size,
        num_mem_tokens: a.num_mem_tokens,
        d_mem: a.d_mem,
        max_position_embeddings: 2048.max(a.segment_size + a.num_mem_tokens),
    };
    let cfg = shape.config()?;
    let longest = a
        .lengths
        .iter()
        .copied()
        .chain([a.concurrent_length])
        .max()
        .unwrap_or(1);
    let opts = LoadOptions {
        memory_budget_bytes: 8 << 30,
        max_active: a.concurrent.max(1),
        max_context_tokens: Some(longest + 1),
        ..a.target.load_options("synthetic-armt")?
    };
    let (model_cfg, seed) = (cfg.clone(), a.seed);
    eprintln!("building the synthetic model ({shape:?})");
    let served = serve_model(cfg, None, opts, move |device, dtype| {
        synthetic::random_model(&model_cfg, seed, device, dtype)
    })?;

    // Warm up both paths (allocator, thread pool) with a short context.
    for execution in [Execution::Sequential, Execution::Diagonal] {
        run::serve(
            served.as_ref(),
            request(&a, 4 * a.segment_size, execution, 999),
        )?;
    }

    println!("### One request: prefill time (time to the first token)\n");
    table::print_header(&[
        ("input tokens", Right),
        ("segments", Right),
        ("sequential: layer calls", Right),
        ("sequential s", Right),
        ("diagonal: grouped steps", Right),
        ("diagonal s", Right),
        ("diagonal speed-up", Right),
        ("cells per grouped step (mean)", Right),
        ("same first token", Left),
    ]);
    for (i, &len) in a.lengths.iter().enumerate() {
        let mut outs = Vec::new();
        for execution in [Execution::Sequential, Execution::Diagonal] {
            eprintln!("{len} tokens, {}...", execution.as_str());
            outs.push(run::serve(
                served.as_ref(),
                request(&a, len, execution, i as u64),
            )?);
        }
        let (seq, diag) = (&outs[0], &outs[1]);
        let mean_cells = diag.mean_series("cells_per_step").unwrap_or(f64::NAN);
        println!(
            "| {len} | {} | {} | {:.2} | {} | {:.2} | {:.2}x | {mean_cells:.2} | {} |",
            diag.stats.counters["segments"],
            seq.stats.counters["grouped_steps"],
            seq.latency.as_secs_f64(),
            diag.stats.counters["grouped_steps"],
            diag.latency.as_secs_f64(),
            seq.latency.as_secs_f64() / diag.latency.as_secs_f64(),
            if seq.tokens == diag.tokens {
                "yes"
            } else {
                "no"
            },
        );
    }

    if a.concurrent > 0 {
        println!(
            "\n### {} requests of {} tokens: packed together against one after another\n",
            a.concurrent, a.concurrent_length
        );
        table::print_header(&[
            ("execution", Left),
            ("together: engine ticks", Right),
            ("together s", Right),
            ("one after another: engine ticks", Right),
            ("one after another s", Right),
            ("speed-up", Right),
            ("same outputs", Left),
        ]);
        for execution in [Execution::Diagonal, Execution::Sequential] {
            let specs: Vec<GenerateSpec> = (0..a.concurrent as u64)
                .map(|i| request(&a, a.concurrent_length, execution, 100 + i))
                .collect();
            eprintln!(
                "{} x{} one after another...",
                execution.as_str(),
                a.concurrent
            );
            let before = served.load().ticks;
            let (apart, apart_s) = run::one_after_another(served.as_ref(), specs.iter().cloned())?;
            let apart_s = apart_s.as_secs_f64();
            let apart_ticks = served.load().ticks - before;
            eprintln!("{} x{} together...", execution.as_str(), a.concurrent);
            let before = served.load().ticks;
            let (together, together_s) = run::together(served.as_ref(), specs.iter().cloned())?;
            let together_s = together_s.as_secs_f64();
            let together_ticks = served.load().ticks - before;
            let same = together
                .iter()
                .zip(&apart)
                .all(|(x, y)| x.tokens == y.tokens);
            println!(
                "| {} | {together_ticks} | {together_s:.2} | {apart_ticks} | {apart_s:.2} | {:.2}x | {} |",
                execution.as_str(),
                apart_s / together_s,
                if same { "yes" } else { "no" },
            );
        }
    }
    served.shutdown();
    Ok(())
}
