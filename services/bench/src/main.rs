//! `bench-recurrent-depth`: decoding throughput of the recurrent-depth schemes on a synthetic
//! Huginn-shaped model (random weights, see [`synthetic`]), served through the real engine.
//!
//! In one run, side by side:
//! 1. batch 1: static AR (`num_steps` recurrences per token), adaptive AR (latent-difference
//!    exit), and the diffusion-forcing sampler (Geiping et al. 2025, "Efficient Parallel
//!    Samplers for Recurrent-Depth Models ...", paper defaults) with the aligned and the
//!    upstream freeze test; tokens per second of one request alone;
//! 2. continuous batching: N requests submitted together (the engine packs their rows into
//!    shared forwards) against the same N requests served one after another, as aggregate
//!    tokens per second, for each N in `--concurrency`; outputs are checked to be identical.
//!    With `--rounds R` both are run R times, alternating which goes first, and the speed-up
//!    is the median of the rounds' ratios (a slow phase of a shared machine then hits one
//!    round, not the comparison).
//!
//! Prints markdown tables on stdout and progress on stderr.

use wavefront_bench::synthetic::huginn as synthetic;

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::{Parser, ValueEnum};
use wavefront_bench::run::{self, Outcome};
use wavefront_bench::table;
use wavefront_bench::table::Align::{Left, Right};
use wavefront_schemes::recurrent_depth::serve_model;
use wavefront_schemes::{
    ArParams, DiffusionForcingParams, FreezeTest, GenerateSpec, LoadOptions, SchemeParams,
};

#[derive(Debug, Parser)]
#[command(
    about = "Throughput of static AR, adaptive AR and diffusion forcing on a synthetic Huginn"
)]
struct Args {
    /// Model width.
    #[arg(long, default_value_t = 1024)]
    n_embd: usize,
    #[arg(long, default_value_t = 16)]
    n_heads: usize,
    #[arg(long, default_value_t = 2816)]
    intermediate_size: usize,
    #[arg(long, default_value_t = 32768)]
    vocab_size: usize,
    #[arg(long, default_value_t = 2)]
    prelude: usize,
    #[arg(long, default_value_t = 4)]
    core: usize,
    #[arg(long, default_value_t = 2)]
    coda: usize,
    /// Prompt tokens per request (random ids).
    #[arg(long, default_value_t = 8)]
    prompt_len: usize,
    /// New tokens per request at batch 1.
    #[arg(long, default_value_t = 16)]
    max_new_tokens: usize,
    /// New tokens per request in the concurrency runs.
    #[arg(long, default_value_t = 8)]
    batched_max_new_tokens: usize,
    /// Batch-1 runs per workload; the fastest is reported.
    #[arg(long, default_value_t = 2)]
    repeat: usize,
    /// Recurrences per token (static AR), the maximum (adaptive AR) and of the prefill
    /// (diffusion forcing).
    #[arg(long, default_value_t = 32)]
    num_steps: usize,
    /// Adaptive AR exit threshold on the latent's relative change.
    #[arg(long, default_value_t = 0.03)]
    exit_threshold: f32,
    /// Diffusion forcing: core iterations per sampler step (r').
    #[arg(long, default_value_t = 4)]
    inner_recurrence: usize,
    /// Diffusion forcing: freeze threshold (eps).
    #[arg(long, default_value_t = 0.03)]
    exit_t: f32,
    /// Diffusion forcing: embedding momentum (eta).
    #[arg(long, default_value_t = 0.1)]
    ema_embeds: f32,
    /// Diffusion forcing: noise mixing (beta).
    #[arg(long, default_value_t = 0.0)]
    state_noise_mixing: f32,
    /// Diffusion forcing: wavefront cap (W).
    #[arg(long, default_value_t = 128)]
    max_wavefront: usize,
    /// Workloads measured at batch 1.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["ar-static", "ar-adaptive", "df-aligned", "df-upstream"])]
    single: Vec<Workload>,
    /// Workloads measured with concurrent requests.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["df-aligned", "ar-static"])]
    batched: Vec<Workload>,
    /// Numbers of concurrent requests.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 4, 16])]
    concurrency: Vec<usize>,
    /// Memory given to the slot pool (K/V and latent states).
    #[arg(long, default_value_t = 2048)]
    memory_budget_mb: u64,
    /// Seed of the weights, prompts and initial states.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Skip warming the slot pool before the concurrency runs. By default the largest
    /// concurrency of the first batched workload is served once first, so that the K/V arenas
    /// it needs exist (a served worker's steady state) and the first measured run does not
    /// pay for touching fresh memory that the runs after it reuse.
    #[arg(long)]
    cold_pool: bool,
    /// Time only the continuous-batching runs, not the same requests one after another (for
    /// profiling the batched tick; the speed-up column then reads "-").
    #[arg(long)]
    batched_only: bool,
    /// Rounds of each concurrency comparison: together and one after another, alternating
    /// which goes first; the seconds are the rounds' medians and the speed-up the median of
    /// the rounds' ratios (each round's in brackets).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    #[command(flatten)]
    target: run::Target,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Workload {
    ArStatic,
    ArAdaptive,
    DfAligned,
    DfUpstream,
}

impl Workload {
    fn label(self) -> &'static str {
        match self {
            Workload::ArStatic => "static AR",
            Workload::ArAdaptive => "adaptive AR",
            Workload::DfAligned => "diffusion forcing, aligned freeze test",
            Workload::DfUpstream => "diffusion forcing, upstream freeze test",
        }
    }

    fn settings(self, a: &Args) -> String {
        match self {
            Workload::ArStatic => format!("r={}, cache full", a.num_steps),
            Workload::ArAdaptive => format!(
                "exit < {}, max {} steps, cache latest-m4",
                a.exit_threshold, a.num_steps
            ),
            Workload::DfAligned | Workload::DfUpstream => format!(
                "r'={}, eps {}, eta {}, beta {}, W {}, prefill r={}",
                a.inner_recurrence,
                a.exit_t,
                a.ema_embeds,
                a.state_noise_mixing,
                a.max_wavefront,
                a.num_steps
            ),
        }
    }

    fn scheme(self, a: &Args) -> SchemeParams {
        let ar = |exit_threshold, cache: &str| {
            SchemeParams::Ar(ArParams {
                num_steps: Some(a.num_steps),
                cache_lookup_strategy: Some(cache.into()),
                exit_threshold,
                ..ArParams::default()
            })
        };
        let df = |freeze_test| {
            SchemeParams::DiffusionForcing(DiffusionForcingParams {
                num_steps: Some(a.num_steps),
                inner_recurrence: a.inner_recurrence,
                exit_t: a.exit_t,
                ema_embeds: a.ema_embeds,
                state_noise_mixing: a.state_noise_mixing,
                max_wavefront: a.max_wavefront,
                freeze_test,
                ..DiffusionForcingParams::default()
            })
        };
        match self {
            Workload::ArStatic => ar(None, "full"),
            Workload::ArAdaptive => ar(Some(a.exit_threshold), "latest-m4"),
            Workload::DfAligned => df(FreezeTest::Aligned),
            Workload::DfUpstream => df(FreezeTest::Upstream),
        }
    }

    /// Request `i` of this workload: its own random prompt and seed.
    fn request(self, a: &Args, i: u64, max_new_tokens: usize) -> GenerateSpec {
        let mut x = a
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(i.wrapping_mul(1442695040888963407).wrapping_add(1));
        let prompt_ids = (0..a.prompt_len)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % a.vocab_size as u64) as u32
            })
            .collect();
        run::spec(prompt_ids, max_new_tokens, a.seed + i, self.scheme(a))
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    args.target.init_threads()?;
    let total = Instant::now();
    let shape = synthetic::Shape {
        n_embd: args.n_embd,
        n_heads: args.n_heads,
        intermediate_size: args.intermediate_size,
        vocab_size: args.vocab_size,
        prelude: args.prelude,
        core: args.core,
        coda: args.coda,
        mean_recurrence: args.num_steps,
    };
    let cfg = shape.config()?;
    let opts = LoadOptions {
        memory_budget_bytes: args.memory_budget_mb << 20,
        max_active: args.concurrency.iter().copied().max().unwrap_or(1).max(1),
        ..args.target.load_options("synthetic-huginn")?
    };
    eprintln!("device {:?}, dtype {:?}", opts.device, opts.dtype);
    let (model_cfg, seed) = (cfg.clone(), args.seed);
    eprintln!("building the synthetic model ({shape:?})");
    let served = serve_model(cfg, None, opts, move |device, dtype| {
        synthetic::random_model(&model_cfg, seed, device, dtype)
    })?;
    eprintln!(
        "model ready after {:.1}s; warming up",
        total.elapsed().as_secs_f64()
    );
    run::serve(served.as_ref(), Workload::ArStatic.request(&args, 999, 2))?;
    if let (false, Some(&w), Some(&n)) = (
        args.cold_pool,
        args.batched.first(),
        args.concurrency.iter().max(),
    ) {
        eprintln!("warming the slot pool: {n} concurrent {}", w.label());
        let specs = (0..n as u64).map(|i| w.request(&args, 900 + i, args.batched_max_new_tokens));
        run::together(served.as_ref(), specs)?;
    }

    println!(
        "Synthetic Huginn: n_embd {}, heads {}, prelude/core/coda {}/{}/{}, intermediate {}, vocab {}; \
         {} on {}; prompts of {} random tokens, greedy; batch 1: {} new tokens, best of {} runs; \
         concurrency: {} new tokens per request, one run.\n",
        args.n_embd,
        args.n_heads,
        args.prelude,
        args.core,
        args.coda,
        args.intermediate_size,
        args.vocab_size,
        args.target.dtype,
        args.target.device,
        args.prompt_len,
        args.max_new_tokens,
        args.repeat,
        args.batched_max_new_tokens,
    );

    // 1. Batch 1.
    table::print_header(&[
        ("workload (batch 1)", Left),
        ("settings", Left),
        ("new tokens", Right),
        ("seconds", Right),
        ("tokens/s", Right),
        ("vs static AR", Right),
        ("core calls", Right),
        ("core iterations per token", Right),
        ("core row-iterations", Right),
        ("mean wavefront", Right),
    ]);
    let mut static_rate = None;
    for &w in &args.single {
        eprintln!("batch 1: {}", w.label());
        let spec = w.request(&args, 0, args.max_new_tokens);
        let mut best: Option<(Outcome, Duration)> = None;
        for _ in 0..args.repeat.max(1) {
            let (mut outs, took) = run::one_after_another(served.as_ref(), [spec.clone()])?;
            if best.as_ref().is_none_or(|(_, t)| took < *t) {
                best = Some((outs.remove(0), took));
            }
        }
        let (o, took) = best.expect("at least one run");
        let o = &o;
        let rate = o.tokens.len() as f64 / took.as_secs_f64();
        if w == Workload::ArStatic {
            static_rate = Some(rate);
        }
        let per_token = o
            .mean_series("steps_per_token")
            .or_else(|| o.mean_series("recurrence_steps_per_token"))
            .unwrap_or(0.0);
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {} | {} | {:.1} | {} | {} |",
            w.label(),
            w.settings(&args),
            o.tokens.len(),
            took.as_secs_f64(),
            rate,
            static_rate.map_or("-".into(), |s| format!("{:.2}x", rate / s)),
            o.stats.recurrence_steps,
            per_token,
            row_iterations(w, &args, o),
            o.mean_series("wavefront_size")
                .map_or("-".into(), |m| format!("{m:.1}")),
        );
    }

    // 2. Continuous batching against one after another.
    println!();
    table::print_header(&[
        ("workload", Left),
        ("concurrent requests", Right),
        ("tokens", Right),
        ("continuous batching: seconds", Right),
        ("tokens/s", Right),
        ("one after another: seconds", Right),
        ("tokens/s", Right),
        ("speed-up", Right),
        ("same outputs", Left),
    ]);
    for &w in &args.batched {
        for &n in &args.concurrency {
            let specs: Vec<GenerateSpec> = (0..n as u64)
                .map(|i| w.request(&args, 100 + i, args.batched_max_new_tokens))
                .collect();
            if args.batched_only {
                eprintln!("{}: {n} concurrent", w.label());
                let (batched, t_batched) = run::together(served.as_ref(), specs.iter().cloned())?;
                let nb = table::total_tokens(&batched);
                println!(
                    "| {} | {n} | {nb} | {:.2} | {:.2} | - | - | - | - |",
                    w.label(),
                    t_batched.as_secs_f64(),
                    nb as f64 / t_batched.as_secs_f64(),
                );
                continue;
            }
            // Each round: both ways of serving the requests, the first one alternating.
            let (mut t_batched, mut t_alone, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            let (mut same, mut tokens) = (true, (0, 0));
            for round in 0..args.rounds {
                let together = || -> Result<_> {
                    eprintln!("{}: {n} concurrent", w.label());
                    run::together(served.as_ref(), specs.iter().cloned())
                };
                let alone = || -> Result<_> {
                    eprintln!("{}: {n} one after another", w.label());
                    run::one_after_another(served.as_ref(), specs.iter().cloned())
                };
                let ((batched, tb), (solo, ta)) = if round % 2 == 0 {
                    let b = together()?;
                    (b, alone()?)
                } else {
                    let a = alone()?;
                    (together()?, a)
                };
                same &= batched.iter().zip(&solo).all(|(a, b)| a.tokens == b.tokens);
                tokens = (table::total_tokens(&batched), table::total_tokens(&solo));
                let (rb, ra) = (
                    tokens.0 as f64 / tb.as_secs_f64(),
                    tokens.1 as f64 / ta.as_secs_f64(),
                );
                t_batched.push(tb.as_secs_f64());
                t_alone.push(ta.as_secs_f64());
                ratios.push(rb / ra);
            }
            let speed_up = if ratios.len() == 1 {
                format!("{:.2}x", ratios[0])
            } else {
                let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
                format!("{:.2}x ({})", run::median(&ratios), each.join(", "))
            };
            let (tb, ta) = (run::median(&t_batched), run::median(&t_alone));
            println!(
                "| {} | {n} | {} | {tb:.2} | {:.2} | {ta:.2} | {:.2} | {speed_up} | {} |",
                w.label(),
                tokens.0,
                tokens.0 as f64 / tb,
                tokens.1 as f64 / ta,
                if same { "yes" } else { "NO" },
            );
        }
    }
    eprintln!("total {:.1}s", total.elapsed().as_secs_f64());
    served.shutdown();
    Ok(())
}

/// Rows times core iterations: the arithmetic the core block did for one request.
fn row_iterations(w: Workload, a: &Args, o: &Outcome) -> u64 {
    let prompt = a.prompt_len as u64;
    match w {
        Workload::ArStatic | Workload::ArAdaptive => {
            let steps = o
                .stats
                .series
                .get("steps_per_token")
                .cloned()
                .unwrap_or_default();
            // The first forward iterates the whole prompt, later ones a single position.
            steps
                .iter()
                .enumerate()
                .map(|(j, &s)| u64::from(s) * if j == 0 { prompt } else { 1 })
                .sum()
        }
        Workload::DfAligned | Workload::DfUpstream => {
            let sizes = o
                .stats
                .series
                .get("wavefront_size")
                .cloned()
                .unwrap_or_default();
            prompt * a.num_steps as u64
                + sizes.iter().map(|&s| u64::from(s)).sum::<u64>() * a.inner_recurrence as u64
        }
    }
}
