//! `bench-paging`: requests that may generate many tokens but stop early, at one memory budget,
//! with each request's worst case reserved at admission against K/V pages taken as it grows.
//!
//! Every request asks for `--max-new` tokens (1024) and stops after about `--stop-after` (64):
//! its stop token is the token it produces at that step (seeded sampling at temperature 1,
//! found by serving it alone first, so the run itself stops there exactly). Both reservations
//! serve the same requests, all submitted at once, on the same model and budget, in one run:
//! worst-case reservation (`--kv-reserve worst-case`, what the engine did before pages) holds
//! as many requests as their worst cases fit; pages on demand hold what they use, and preempt
//! (to host memory) when growth outruns the pool. The table gives, side by side, the most
//! requests held at once, the time-weighted mean held, preemptions, wall time and aggregate
//! tokens per second; tokens are checked identical between the two.
//!
//! Families: `refusion` (ReFusion's Qwen3 decoding with the `ar` scheme, the plain decoder) and
//! `huginn` (static `ar` at `--num-steps` recurrences with the `full` cache).
//!
//! Prints a markdown table on stdout and progress on stderr.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use clap::Parser;
use wavefront_bench::run;
use wavefront_bench::synthetic::{huginn, qwen3};
use wavefront_bench::table;
use wavefront_bench::table::Align::{Left, Right};
use wavefront_engine::Event;
use wavefront_schemes::{
    ArParams, GenerateSpec, KvReserve, LoadOptions, SamplingParams, SchemeParams, ServedModel,
};

#[derive(Debug, Clone, Parser)]
#[command(about = "Worst-case K/V reservation against pages on demand, at one memory budget")]
struct Args {
    /// `refusion` (Qwen3 `ar`) or `huginn` (static `ar`).
    #[arg(long, value_delimiter = ',', default_value = "refusion,huginn")]
    families: Vec<String>,
    /// Requests submitted at once (and the engine's `max_active`).
    #[arg(long, default_value_t = 32)]
    requests: usize,
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// max_new_tokens of every request.
    #[arg(long, default_value_t = 1024)]
    max_new: usize,
    /// Tokens after which each request produces its stop token.
    #[arg(long, default_value_t = 64)]
    stop_after: usize,
    /// Memory budget of the slot pool, MiB, for `refusion`.
    #[arg(long, default_value_t = 64)]
    refusion_budget_mb: u64,
    /// Memory budget of the slot pool, MiB, for `huginn`.
    #[arg(long, default_value_t = 512)]
    huginn_budget_mb: u64,
    /// Positions a K/V page holds.
    #[arg(long, default_value_t = wavefront_models::transformer::PAGE_SIZE)]
    page_size: usize,
    /// Huginn: recurrences per token.
    #[arg(long, default_value_t = 4)]
    num_steps: usize,
    #[command(flatten)]
    target: run::Target,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// What one reservation did with the requests.
struct Measured {
    tokens: Vec<Vec<u32>>,
    wall: Duration,
    most_held: usize,
    mean_held: f64,
    preemptions: u64,
    pages_total: usize,
}

/// Serves every request at once, sampling the engine's load as events arrive.
fn serve_all(served: &dyn ServedModel, specs: &[GenerateSpec]) -> Result<Measured> {
    let started = Instant::now();
    let before = served.load().preemptions;
    let receivers = specs
        .iter()
        .map(|s| run::submit(served, s.clone()))
        .collect::<Result<Vec<_>>>()?;
    let mut tokens = vec![Vec::new(); specs.len()];
    let mut done = vec![false; specs.len()];
    let (mut most, mut weighted, mut last) = (0usize, 0.0f64, Instant::now());
    while done.iter().any(|d| !d) {
        let mut progressed = false;
        for (i, rx) in receivers.iter().enumerate() {
            while !done[i] {
                match rx.try_recv() {
                    Ok(Event::Tokens(t)) => tokens[i].extend(t),
                    Ok(
                        Event::Canvas(_)
                        | Event::Logprobs(_)
                        | Event::PromptLogprobs(_)
                        | Event::Parked,
                    ) => {}
                    Ok(Event::Finished { .. }) => done[i] = true,
                    Ok(Event::Failed(e)) => bail!("request {i} failed: {e}"),
                    Err(_) => break,
                }
                progressed = true;
            }
        }
        let load = served.load();
        let held = load.active - load.preempted;
        most = most.max(held);
        let now = Instant::now();
        weighted += held as f64 * now.duration_since(last).as_secs_f64();
        last = now;
        if !progressed {
            std::thread::sleep(Duration::from_micros(200));
        }
        ensure!(started.elapsed() < Duration::from_secs(3600), "stalled");
    }
    let wall = started.elapsed();
    let load = served.load();
    Ok(Measured {
        tokens,
        wall,
        most_held: most,
        mean_held: weighted / wall.as_secs_f64(),
        preemptions: load.preemptions - before,
        pages_total: load.total_slots,
    })
}

/// Request `i`: a random prompt, seeded sampling at temperature 1, `max_new` tokens.
fn request(a: &Args, vocab: usize, i: u64, max_new: usize) -> GenerateSpec {
    let prompt = run::random_prompt(a.seed, i, a.prompt_len, 0..(vocab - 2) as u32);
    let scheme = SchemeParams::Ar(ArParams::default());
    let mut s = run::spec(prompt, max_new, a.seed + i, scheme);
    s.sampling = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: a.seed + i,
        ..SamplingParams::default()
    };
    s
}

fn huginn_ar(num_steps: usize) -> SchemeParams {
    SchemeParams::Ar(ArParams {
        num_steps: Some(num_steps),
        cache_lookup_strategy: Some("full".into()),
        ..ArParams::default()
    })
}

/// The requests, each with the stop token it produces at `stop_after` (found serving it alone
/// on `probe`, which must decode as the measured models do).
fn requests(
    a: &Args,
    probe: &dyn ServedModel,
    vocab: usize,
    scheme: &SchemeParams,
) -> Result<Vec<GenerateSpec>> {
    let mut specs = Vec::with_capacity(a.requests);
    for i in 0..a.requests as u64 {
        let mut short = request(a, vocab, i, a.stop_after);
        short.scheme = scheme.clone();
        let out = run::serve(probe, short.clone())?;
        let stop = *out.tokens.last().expect("at least one token");
        let first = out.tokens.iter().position(|&t| t == stop).unwrap_or(0) + 1;
        let mut s = short;
        s.max_new_tokens = a.max_new;
        s.stop_token_ids = vec![stop];
        eprintln!("  request {i}: stops after {first} tokens");
        specs.push(s);
    }
    Ok(specs)
}

type Loader = Box<dyn Fn(KvReserve) -> Result<Arc<dyn ServedModel>>>;

/// Load options of a bench model: `budget_mib`, a place for every request, `reserve`, the
/// page size of the flags.
fn options(a: &Args, name: &str, budget_mib: u64, reserve: KvReserve) -> Result<LoadOptions> {
    Ok(LoadOptions {
        memory_budget_bytes: budget_mib << 20,
        max_active: a.requests,
        kv_reserve: reserve,
        kv_page_size: a.page_size,
        ..a.target.load_options(name)?
    })
}

fn family(a: &Args, name: &str) -> Result<(Loader, usize, SchemeParams, u64)> {
    let args = a.clone();
    match name {
        "refusion" => {
            let shape = qwen3::Shape {
                hidden_size: 512,
                num_attention_heads: 8,
                num_key_value_heads: 4,
                head_dim: 64,
                num_hidden_layers: 8,
                intermediate_size: 1536,
                vocab_size: 32768,
                max_position_embeddings: 4096,
            };
            let cfg = shape.config()?;
            let (budget, seed) = (a.refusion_budget_mb, a.seed);
            let load: Loader = Box::new(move |reserve| {
                let opts = options(&args, "synthetic-refusion", budget, reserve)?;
                let c = cfg.clone();
                Ok(wavefront_schemes::slot_diffusion::serve_model(
                    cfg.clone(),
                    None,
                    opts,
                    move |device, dtype| {
                        qwen3::random_model(&c, seed, 1.0, 1.0, 0.0, device, dtype)
                    },
                )?)
            });
            Ok((
                load,
                shape.vocab_size,
                SchemeParams::Ar(ArParams::default()),
                a.refusion_budget_mb,
            ))
        }
        "huginn" => {
            let shape = huginn::Shape {
                n_embd: 1024,
                n_heads: 8,
                intermediate_size: 3456,
                vocab_size: 32768,
                prelude: 2,
                core: 4,
                coda: 2,
                mean_recurrence: a.num_steps,
            };
            let cfg = shape.config()?;
            let (budget, seed) = (a.huginn_budget_mb, a.seed);
            let load: Loader = Box::new(move |reserve| {
                let opts = options(&args, "synthetic-huginn", budget, reserve)?;
                let c = cfg.clone();
                Ok(wavefront_schemes::recurrent_depth::serve_model(
                    cfg.clone(),
                    None,
                    opts,
                    move |device, dtype| huginn::random_model(&c, seed, device, dtype),
                )?)
            });
            Ok((
                load,
                shape.vocab_size,
                huginn_ar(a.num_steps),
                a.huginn_budget_mb,
            ))
        }
        other => bail!("unknown family {other:?}: refusion or huginn"),
    }
}

fn main() -> Result<()> {
    let a = Args::parse();
    a.target.init_threads()?;
    let mut rows = Vec::new();
    for name in &a.families {
        let (load, vocab, scheme, budget) = family(&a, name)?;
        eprintln!("{name}: finding each request's stop token");
        let probe = load(KvReserve::OnDemand)?;
        let specs = requests(&a, probe.as_ref(), vocab, &scheme)?;
        probe.shutdown();
        let mut results = Vec::new();
        for (label, reserve) in [
            ("worst case at admission", KvReserve::WorstCase),
            ("pages on demand", KvReserve::OnDemand),
        ] {
            eprintln!("{name}: {label}");
            let served = load(reserve)?;
            // Warm-up: one short request.
            let mut warm = specs[0].clone();
            warm.max_new_tokens = 4;
            run::serve(served.as_ref(), warm)?;
            let m = serve_all(served.as_ref(), &specs)?;
            served.shutdown();
            results.push((label, m));
        }
        ensure!(
            results[0].1.tokens == results[1].1.tokens,
            "{name}: the two reservations produced different tokens"
        );
        let base = results[0].1.wall.as_secs_f64();
        for (label, m) in &results {
            let generated: usize = m.tokens.iter().map(Vec::len).sum();
            let secs = m.wall.as_secs_f64();
            rows.push(vec![
                name.clone(),
                label.to_string(),
                format!("{budget} MiB ({} pages)", m.pages_total),
                m.most_held.to_string(),
                format!("{:.1}", m.mean_held),
                m.preemptions.to_string(),
                generated.to_string(),
                format!("{secs:.2}"),
                format!("{:.1}", generated as f64 / secs),
                format!("{:.2}x", base / secs),
            ]);
        }
    }
    table::print_header(&[
        ("family", Left),
        ("reservation", Left),
        ("budget", Left),
        ("held at most", Right),
        ("held, mean", Right),
        ("preemptions", Right),
        ("tokens", Right),
        ("wall s", Right),
        ("tok/s", Right),
        ("speed-up", Right),
    ]);
    for r in rows {
        println!("| {} |", r.join(" | "));
    }
    Ok(())
}
