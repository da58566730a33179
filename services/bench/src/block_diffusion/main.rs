//! `bench-block-diffusion`: LLaDA2.0's block diffusion on a synthetic mixture-of-experts model
//! (random weights, see [`synthetic`]), served through the real engine.
//!
//! For each threshold in `--threshold` and each concurrency in `--concurrency`, N requests are
//! served one after another and then all together (the engine packs one step of each into every
//! forward, and each MoE layer runs one product per expert over the rows every request routed
//! to it); the table reports forward passes and rows per step per request, wall time, aggregate
//! tokens per second of both, the speed-up of serving them together, and whether every request
//! produced the same tokens both ways.
//!
//! A second table times the forward itself at `--rows`: N rows in one call (each MoE layer runs
//! one product per expert over the rows routed to it) against the same rows one per call (one
//! product per expert a row chose, the per-token loop the batched path replaces).
//!
//! Prints markdown tables on stdout and progress on stderr.

use wavefront_bench::synthetic::llada2 as synthetic;

use anyhow::Result;
use clap::Parser;
use wavefront_bench::run;
use wavefront_bench::table::Align::{Left, Right};
use wavefront_bench::table::{self, mean, series_mean};
use wavefront_schemes::block_diffusion::serve_model;
use wavefront_schemes::{BlockDiffusionParams, GenerateSpec, LoadOptions, SchemeParams};

#[derive(Debug, Parser)]
#[command(about = "Block diffusion on a synthetic LLaDA2.0 (mixture of experts)")]
struct Args {
    #[arg(long, default_value_t = 512)]
    hidden_size: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// The dense first layer's MLP width.
    #[arg(long, default_value_t = 1536)]
    intermediate_size: usize,
    #[arg(long, default_value_t = 32)]
    experts: usize,
    #[arg(long, default_value_t = 4)]
    experts_per_token: usize,
    #[arg(long, default_value_t = 128)]
    moe_intermediate_size: usize,
    #[arg(long, default_value_t = 32768)]
    vocab_size: usize,
    /// Scale of the output head over the init (peaked posteriors).
    #[arg(long, default_value_t = 24.0)]
    head_scale: f64,
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    gen_length: usize,
    #[arg(long, default_value_t = 32)]
    block_length: usize,
    #[arg(long, default_value_t = 32)]
    steps: usize,
    #[arg(long, value_delimiter = ',', default_value = "0.95,0.7")]
    threshold: Vec<f32>,
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    concurrency: Vec<usize>,
    /// Rows of the forward timing table (`0`: no table).
    #[arg(long, value_delimiter = ',', default_value = "32,256")]
    rows: Vec<usize>,
    #[command(flatten)]
    target: run::Target,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

fn request(a: &Args, threshold: f32, i: u64) -> GenerateSpec {
    let prompt = run::random_prompt(a.seed, i, a.prompt_len, 0..(a.vocab_size - 1) as u32);
    run::spec(
        prompt,
        a.gen_length,
        i,
        SchemeParams::BlockDiffusion(BlockDiffusionParams {
            block_length: a.block_length,
            steps: a.steps,
            threshold,
            ..BlockDiffusionParams::default()
        }),
    )
}

fn main() -> Result<()> {
    let a = Args::parse();
    a.target.init_threads()?;
    let shape = synthetic::Shape {
        hidden_size: a.hidden_size,
        num_attention_heads: a.heads,
        num_key_value_heads: a.kv_heads,
        num_hidden_layers: a.layers,
        intermediate_size: a.intermediate_size,
        moe_intermediate_size: a.moe_intermediate_size,
        num_experts: a.experts,
        num_experts_per_tok: a.experts_per_token,
        n_group: 8.min(a.experts),
        topk_group: 4.min(a.experts),
        vocab_size: a.vocab_size,
    };
    let cfg = shape.config()?;
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
    let opts = LoadOptions {
        memory_budget_bytes: 4 << 30,
        max_active: max_c,
        ..a.target.load_options("synthetic-llada2")?
    };
    let (seed, head) = (a.seed, a.head_scale);
    let model_cfg = cfg.clone();
    let served = serve_model(
        cfg,
        None,
        opts,
        move |device, dtype| synthetic::random_model(&model_cfg, seed, head, device, dtype),
        None,
        None,
    )?;
    let mut warm = request(&a, 0.9, 999);
    warm.max_new_tokens = a.block_length;
    run::serve(served.as_ref(), warm)?;

    table::print_header(&[
        ("threshold", Right),
        ("concurrent requests", Right),
        ("forward passes per request", Right),
        ("rows per step", Right),
        ("one after another s", Right),
        ("together s", Right),
        ("tokens/s one after another", Right),
        ("tokens/s together", Right),
        ("speed-up", Right),
        ("same tokens", Left),
    ]);
    for &t in &a.threshold {
        for &c in &a.concurrency {
            eprintln!("threshold {t} x{c}...");
            let specs: Vec<GenerateSpec> = (0..c as u64).map(|i| request(&a, t, i)).collect();
            let started = std::time::Instant::now();
            let alone = specs
                .iter()
                .map(|s| run::serve(served.as_ref(), s.clone()))
                .collect::<Result<Vec<_>>>()?;
            let serial = started.elapsed().as_secs_f64();
            let (outs, wall) = run::together(served.as_ref(), specs)?;
            let wall = wall.as_secs_f64();
            let tokens = table::total_tokens(&outs) as f64;
            let same = alone.iter().zip(&outs).all(|(x, y)| x.tokens == y.tokens);
            println!(
                "| {t} | {c} | {:.1} | {:.1} | {serial:.2} | {wall:.2} | {:.1} | {:.1} | {:.2}x | {} |",
                mean(outs.iter().map(|o| o.stats.forward_passes as f64)),
                series_mean(&outs, "active_rows").unwrap_or(0.0),
                tokens / serial,
                tokens / wall,
                serial / wall,
                if same { "yes" } else { "no" },
            );
        }
    }
    served.shutdown();
    forward_table(&a, &shape)
}

fn forward_table(a: &Args, shape: &synthetic::Shape) -> Result<()> {
    use wavefront_models::transformer::SeqInput;
    let rows: Vec<usize> = a.rows.iter().copied().filter(|&n| n > 0).collect();
    if rows.is_empty() {
        return Ok(());
    }
    let cfg = shape.config()?;
    let (device, dtype) = run::device_and_dtype(&a.target.device, &a.target.dtype)?;
    let model = synthetic::random_model(&cfg, a.seed, a.head_scale, &device, dtype)?;
    println!();
    table::print_header(&[
        ("rows", Right),
        ("one call ms", Right),
        ("one row per call ms", Right),
        ("speed-up", Right),
    ]);
    for &n in &rows {
        eprintln!("forward of {n} rows...");
        let ids = run::random_prompt(a.seed, n as u64, n, 0..(a.vocab_size - 1) as u32);
        let packed = run::median_secs(&device, 5, || {
            model.forward(&ids, &mut [SeqInput::dense(n)])?;
            Ok(())
        })?;
        let looped = run::median_secs(&device, 3, || {
            for &id in &ids {
                model.forward(&[id], &mut [SeqInput::dense(1)])?;
            }
            Ok(())
        })?;
        println!(
            "| {n} | {:.1} | {:.1} | {:.1}x |",
            packed * 1e3,
            looped * 1e3,
            looped / packed
        );
    }
    Ok(())
}
