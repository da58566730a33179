//! `bench-migration`: what moving a running request to another worker costs, per family at the
//! mid-size configs of docs/benchmarks.md (synthetic weights).
//!
//! Two engines of one model (the same weights) run in this process. Each request runs alone on
//! the first to give its tokens and wall time; then it runs again, is exported after
//! `--at` of that time (stopped at the next step boundary, its state moved to host memory and
//! encoded), and resumes on the second engine. The table gives the state's bytes, the time the
//! export took (stop, preemption, encoding), the time to take it in (decoding, queueing), the
//! time until the second engine has resumed it (admitted, pages and latent states back in slots;
//! its load report polled), the move's total (export + resumed), and the time to the request's
//! next event there (which includes its next steps: a masked-diffusion block's), against the
//! time the request still needed when it was stopped. Tokens are checked identical to the run
//! alone.
//!
//! In process, so no network: over gRPC the bytes also cross the wire (1 MiB messages).
//! Prints a markdown table on stdout and progress on stderr.

use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use wavefront_bench::run;
use wavefront_bench::synthetic::{armt, huginn, llada, llada2, qwen3};
use wavefront_bench::table;
use wavefront_bench::table::Align::{Left, Right};
use wavefront_engine::{EngineError, Event, Exported};
use wavefront_schemes::{
    ArParams, BlockDiffusionParams, DiffusionForcingParams, Execution, GenerateSpec, LoadOptions,
    LowConfidenceParams, PlanInfillParams, SchemeParams, ServedModel, SureLockParams,
};

#[derive(Debug, Clone, Parser)]
#[command(about = "Moving a running request between two engines: bytes and times per family")]
struct Args {
    /// Cases: huginn-ar, huginn-df, llada, llada-surelock, armt, refusion, llada2.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "huginn-ar,huginn-df,llada,llada-surelock,armt,refusion,llada2"
    )]
    cases: Vec<String>,
    /// When the request is stopped, as a share of its run alone.
    #[arg(long, default_value_t = 0.5)]
    at: f64,
    /// Runs of each case (the table shows each).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    #[command(flatten)]
    target: run::Target,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

type Pair = [Arc<dyn ServedModel>; 2];

/// Two engines of the case's model, and its request.
fn case(a: &Args, name: &str) -> Result<(Pair, GenerateSpec)> {
    let seed = a.seed;
    let opts = |n: &str| -> Result<LoadOptions> {
        Ok(LoadOptions {
            memory_budget_bytes: 8 << 30,
            max_active: 4,
            max_context_tokens: Some(8192),
            ..a.target.load_options(n)?
        })
    };
    let prompt = |len: usize, vocab: usize| run::random_prompt(seed, 0, len, 0..(vocab - 2) as u32);
    let pair = |make: &dyn Fn() -> Result<Arc<dyn ServedModel>>| -> Result<Pair> {
        Ok([make()?, make()?])
    };
    match name {
        "huginn-ar" | "huginn-df" => {
            let shape = huginn::Shape {
                n_embd: 1024,
                n_heads: 8,
                intermediate_size: 3456,
                vocab_size: 32768,
                prelude: 2,
                core: 4,
                coda: 2,
                mean_recurrence: 32,
            };
            let cfg = shape.config()?;
            let served = pair(&|| {
                let c = cfg.clone();
                Ok(wavefront_schemes::recurrent_depth::serve_model(
                    cfg.clone(),
                    None,
                    opts("synthetic-huginn")?,
                    move |device, dtype| huginn::random_model(&c, seed, device, dtype),
                )?)
            })?;
            let scheme = if name == "huginn-ar" {
                SchemeParams::Ar(ArParams {
                    num_steps: Some(32),
                    ..ArParams::default()
                })
            } else {
                SchemeParams::DiffusionForcing(DiffusionForcingParams::default())
            };
            Ok((served, run::spec(prompt(32, 32768), 32, seed, scheme)))
        }
        "llada" | "llada-surelock" => {
            let shape = llada::Shape {
                d_model: 512,
                n_heads: 8,
                n_layers: 8,
                mlp_hidden_size: 1536,
                vocab_size: 32768,
                max_sequence_length: 4096,
            };
            let cfg = shape.config()?;
            let served = pair(&|| {
                let c = cfg.clone();
                Ok(wavefront_schemes::masked_diffusion::serve_model(
                    cfg.clone(),
                    None,
                    opts("synthetic-llada")?,
                    move |device, dtype| llada::random_model(&c, seed, 3.0, 24.0, device, dtype),
                )?)
            })?;
            let surelock = (name == "llada-surelock").then_some(SureLockParams {
                eps: 5e-3,
                percentile: None,
            });
            let scheme = SchemeParams::LowConfidence(LowConfidenceParams {
                block_length: Some(32),
                steps: Some(128),
                surelock,
                ..LowConfidenceParams::default()
            });
            Ok((served, run::spec(prompt(32, 32768), 128, seed, scheme)))
        }
        "armt" => {
            let shape = armt::Shape {
                hidden_size: 512,
                layers: 8,
                heads: 8,
                kv_heads: 2,
                intermediate_size: 1536,
                vocab_size: 32000,
                segment_size: 256,
                num_mem_tokens: 16,
                d_mem: 64,
                max_position_embeddings: 2048,
            };
            let cfg = shape.config()?;
            let served = pair(&|| {
                let c = cfg.clone();
                Ok(wavefront_schemes::recurrent_memory::serve_model(
                    cfg.clone(),
                    None,
                    opts("synthetic-armt")?,
                    move |device, dtype| armt::random_model(&c, seed, device, dtype),
                )?)
            })?;
            let scheme = SchemeParams::Ar(ArParams {
                execution: Execution::Diagonal,
                ..ArParams::default()
            });
            Ok((served, run::spec(prompt(4100, 32000), 16, seed, scheme)))
        }
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
            let served = pair(&|| {
                let c = cfg.clone();
                Ok(wavefront_schemes::slot_diffusion::serve_model(
                    cfg.clone(),
                    None,
                    opts("synthetic-refusion")?,
                    move |device, dtype| {
                        qwen3::random_model(&c, seed, 1.0, 24.0, 0.0, device, dtype)
                    },
                )?)
            })?;
            let scheme = SchemeParams::PlanInfill(PlanInfillParams {
                span_size: 4,
                serial_num_blocks: 4,
                ..PlanInfillParams::default()
            });
            Ok((served, run::spec(prompt(32, 32768), 128, seed, scheme)))
        }
        "llada2" => {
            let shape = llada2::Shape {
                hidden_size: 512,
                num_attention_heads: 8,
                num_key_value_heads: 4,
                num_hidden_layers: 8,
                intermediate_size: 1536,
                moe_intermediate_size: 128,
                num_experts: 32,
                num_experts_per_tok: 4,
                n_group: 8,
                topk_group: 4,
                vocab_size: 32768,
            };
            let cfg = shape.config()?;
            let served = pair(&|| {
                let c = cfg.clone();
                Ok(wavefront_schemes::block_diffusion::serve_model(
                    cfg.clone(),
                    None,
                    opts("synthetic-llada2")?,
                    move |device, dtype| llada2::random_model(&c, seed, 24.0, device, dtype),
                    None,
                    None,
                )?)
            })?;
            let scheme = SchemeParams::BlockDiffusion(BlockDiffusionParams {
                block_length: 32,
                steps: 32,
                threshold: 0.95,
                ..BlockDiffusionParams::default()
            });
            Ok((served, run::spec(prompt(32, 32768), 128, seed, scheme)))
        }
        other => bail!("unknown case {other:?}"),
    }
}

fn submit(
    served: &dyn ServedModel,
    spec: GenerateSpec,
) -> Result<(Receiver<Event>, wavefront_engine::RequestId)> {
    let (tx, rx) = mpsc::sync_channel(1 << 16);
    let id = served.submit(spec, Box::new(tx), None, tracing::Span::none())?;
    Ok((rx, id))
}

fn next(rx: &Receiver<Event>) -> Result<Event> {
    rx.recv_timeout(Duration::from_secs(600))
        .context("engine stalled")
}

/// Reads tokens until the request finishes.
fn finish(rx: &Receiver<Event>, tokens: &mut Vec<u32>) -> Result<()> {
    loop {
        match next(rx)? {
            Event::Tokens(t) => tokens.extend(t),
            Event::Finished { .. } => return Ok(()),
            Event::Failed(e) => bail!("request failed: {e}"),
            Event::Canvas(_) | Event::Logprobs(_) | Event::PromptLogprobs(_) | Event::Parked => {}
        }
    }
}

struct Measured {
    bytes: usize,
    export: Duration,
    import: Duration,
    resumed: Duration,
    next_event: Duration,
    remaining_alone: Duration,
    at_tokens: usize,
}

fn measure(served: &Pair, spec: &GenerateSpec, at: f64) -> Result<Measured> {
    let [a, b] = served;
    // Alone: tokens and wall time.
    let started = Instant::now();
    let (rx, _) = submit(a.as_ref(), spec.clone())?;
    let mut alone = Vec::new();
    finish(&rx, &mut alone)?;
    let whole = started.elapsed();

    // Moved after `at` of it.
    let started = Instant::now();
    let (rx, id) = submit(a.as_ref(), spec.clone())?;
    std::thread::sleep(whole.mul_f64(at));
    let t = Instant::now();
    let (etx, erx) = mpsc::channel::<Result<Exported, EngineError>>();
    a.export(
        id,
        Box::new(move |r| {
            let _ = etx.send(r);
        }),
    );
    let exported = erx.recv()?.map_err(|e| anyhow::anyhow!("export: {e}"))?;
    let export = t.elapsed();
    let stopped_at = started.elapsed();
    let mut tokens = Vec::new();
    loop {
        match next(&rx)? {
            Event::Tokens(t) => tokens.extend(t),
            Event::Parked => break,
            Event::Canvas(_) => {}
            ev => bail!("the request ended before it moved: {ev:?}"),
        }
    }
    let at_tokens = tokens.len();
    let (ftx, frx) = mpsc::channel();
    a.finish_export(
        id,
        true,
        Box::new(move |r| {
            let _ = ftx.send(r);
        }),
    );
    frx.recv()??;
    let t = Instant::now();
    let (tx, rx2) = mpsc::sync_channel(1 << 16);
    b.import(
        &exported.state,
        exported.carried,
        Box::new(tx),
        None,
        tracing::Span::none(),
    )?;
    let import = t.elapsed();
    // Resumed: admitted and its state back in slots (the engine publishes after each step).
    loop {
        let l = b.load();
        if l.active == 1 && l.preempted == 0 {
            break;
        }
        ensure!(t.elapsed() < Duration::from_secs(60), "never resumed");
        std::thread::sleep(Duration::from_micros(50));
    }
    let resumed = t.elapsed();
    let first = next(&rx2)?;
    let next_event = t.elapsed();
    let done = match first {
        Event::Tokens(t) => {
            tokens.extend(t);
            false
        }
        Event::Finished { .. } => true,
        Event::Failed(e) => bail!("resumed request failed: {e}"),
        Event::Canvas(_) | Event::Logprobs(_) | Event::PromptLogprobs(_) | Event::Parked => false,
    };
    if !done {
        finish(&rx2, &mut tokens)?;
    }
    ensure!(
        tokens == alone,
        "tokens after the move differ from the run alone"
    );
    Ok(Measured {
        bytes: exported.state.len(),
        export,
        import,
        resumed,
        next_event,
        remaining_alone: whole.saturating_sub(stopped_at),
        at_tokens,
    })
}

fn main() -> Result<()> {
    let a = Args::parse();
    a.target.init_threads()?;
    let cols = [
        ("case", Left),
        ("tokens before the move", Right),
        ("state MiB", Right),
        ("export ms", Right),
        ("take in ms", Right),
        ("resumed ms", Right),
        ("move total ms", Right),
        ("next event ms", Right),
        ("rest alone ms", Right),
        ("move / rest", Right),
    ];
    table::print_header(&cols);
    for name in &a.cases {
        eprintln!("{name}: building two engines");
        let (served, spec) = case(&a, name)?;
        // Warm both engines (allocator, kernels, thread pool).
        for s in &served {
            let mut warm = spec.clone();
            warm.max_new_tokens = warm.max_new_tokens.min(32);
            run::serve(s.as_ref(), warm)?;
        }
        for _ in 0..a.repeat {
            let m = measure(&served, &spec, a.at)?;
            let total = m.export + m.resumed;
            println!(
                "| {name} | {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.3} |",
                m.at_tokens,
                m.bytes as f64 / (1 << 20) as f64,
                m.export.as_secs_f64() * 1e3,
                m.import.as_secs_f64() * 1e3,
                m.resumed.as_secs_f64() * 1e3,
                total.as_secs_f64() * 1e3,
                m.next_event.as_secs_f64() * 1e3,
                m.remaining_alone.as_secs_f64() * 1e3,
                total.as_secs_f64() / m.remaining_alone.as_secs_f64().max(1e-9),
            );
        }
        for s in served {
            s.shutdown();
        }
    }
    Ok(())
}
