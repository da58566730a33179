//! `bench-masked-diffusion`: the masked-diffusion schemes on a synthetic LLaDA-shaped model
//! (random weights, see [`synthetic`]), served through the real engine.
//!
//! For LLaDA's low-confidence sampler (Nie et al. 2025, one token per step), WINO (Hong et al.
//! 2026, draft above `threshold`, revoke below `threshold_back`), and each with SureLock
//! ("Stopping Computation for Converged Tokens in Masked Diffusion-LM Decoding": locked
//! positions are no longer computed), at each concurrency in `--concurrency`: N requests are
//! submitted together (the engine packs one step of each into every forward) and the table
//! reports forward passes per request, wall time, latency per request, aggregate tokens per
//! second, and SureLock's algorithmic FLOPs ratio measured from the rows actually computed.
//!
//! Fast-dLLM's options of the low-confidence sampler run beside them (Wu et al. 2025): the dual
//! cache, and the prefix and dual caches with the threshold rule (`--fast-threshold`).
//!
//! Prints a markdown table on stdout and progress on stderr.

use wavefront_bench::synthetic::llada as synthetic;

use anyhow::Result;
use clap::Parser;
use wavefront_bench::run;
use wavefront_bench::table::Align::{Left, Right};
use wavefront_bench::table::{self, mean, series_mean};
use wavefront_schemes::masked_diffusion::serve_model;
use wavefront_schemes::{
    GenerateSpec, KvCacheMode, LoadOptions, LowConfidenceParams, SchemeParams, SureLockParams,
    WinoParams,
};

#[derive(Debug, Parser)]
#[command(about = "Low-confidence, WINO and SureLock on a synthetic LLaDA")]
struct Args {
    #[arg(long, default_value_t = 512)]
    d_model: usize,
    #[arg(long, default_value_t = 8)]
    n_heads: usize,
    #[arg(long, default_value_t = 8)]
    n_layers: usize,
    #[arg(long, default_value_t = 1536)]
    mlp_hidden_size: usize,
    #[arg(long, default_value_t = 32768)]
    vocab_size: usize,
    /// Scale of the q/k projections over the init (sharper attention).
    #[arg(long, default_value_t = 3.0)]
    qk_scale: f64,
    /// Scale of the output head over the init (peaked posteriors).
    #[arg(long, default_value_t = 24.0)]
    head_scale: f64,
    /// Prompt tokens per request (random ids).
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// gen_length (max_new_tokens).
    #[arg(long, default_value_t = 256)]
    gen_length: usize,
    #[arg(long, default_value_t = 32)]
    block_length: usize,
    /// Low-confidence steps (default: gen_length, one token per step).
    #[arg(long)]
    steps: Option<usize>,
    /// WINO draft threshold (tau1).
    #[arg(long, default_value_t = 0.6)]
    threshold: f32,
    /// WINO verification threshold (tau2).
    #[arg(long, default_value_t = 0.9)]
    threshold_back: f32,
    /// SureLock KL threshold.
    #[arg(long, default_value_t = 5e-3)]
    surelock_eps: f32,
    /// SureLock confidence-gate percentile (0: no gate).
    #[arg(long, default_value_t = 20.0)]
    surelock_percentile: f32,
    /// Fast-dLLM's confidence threshold for the rows that use it.
    #[arg(long, default_value_t = 0.9)]
    fast_threshold: f32,
    /// Concurrent requests per run.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    concurrency: Vec<usize>,
    /// The schemes to run (default: all): low-confidence, wino, surelock, wino-surelock,
    /// dual-cache, prefix-threshold, dual-threshold.
    #[arg(long, value_enum, value_delimiter = ',')]
    schemes: Vec<Workload>,
    #[command(flatten)]
    target: run::Target,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Workload {
    LowConfidence,
    Wino,
    #[value(name = "surelock")]
    LowConfidenceSureLock,
    #[value(name = "wino-surelock")]
    WinoSureLock,
    DualCache,
    PrefixThreshold,
    DualThreshold,
}

impl Workload {
    const ALL: [Workload; 7] = [
        Workload::LowConfidence,
        Workload::Wino,
        Workload::LowConfidenceSureLock,
        Workload::WinoSureLock,
        Workload::DualCache,
        Workload::PrefixThreshold,
        Workload::DualThreshold,
    ];

    fn label(self) -> &'static str {
        match self {
            Workload::LowConfidence => "low-confidence (baseline)",
            Workload::Wino => "WINO",
            Workload::LowConfidenceSureLock => "low-confidence + SureLock",
            Workload::WinoSureLock => "WINO + SureLock",
            Workload::DualCache => "low-confidence + Fast-dLLM dual cache",
            Workload::PrefixThreshold => "low-confidence + prefix cache + threshold",
            Workload::DualThreshold => "low-confidence + dual cache + threshold",
        }
    }

    fn scheme(self, a: &Args) -> SchemeParams {
        let surelock = matches!(
            self,
            Workload::LowConfidenceSureLock | Workload::WinoSureLock
        )
        .then_some(SureLockParams {
            eps: a.surelock_eps,
            percentile: (a.surelock_percentile > 0.0).then_some(a.surelock_percentile),
        });
        match self {
            Workload::LowConfidence | Workload::LowConfidenceSureLock => {
                SchemeParams::LowConfidence(LowConfidenceParams {
                    block_length: Some(a.block_length),
                    steps: Some(a.steps.unwrap_or(a.gen_length)),
                    surelock,
                    ..LowConfidenceParams::default()
                })
            }
            Workload::DualCache | Workload::PrefixThreshold | Workload::DualThreshold => {
                let (kv_cache, threshold) = match self {
                    Workload::DualCache => (KvCacheMode::Dual, None),
                    Workload::PrefixThreshold => (KvCacheMode::Prefix, Some(a.fast_threshold)),
                    _ => (KvCacheMode::Dual, Some(a.fast_threshold)),
                };
                SchemeParams::LowConfidence(LowConfidenceParams {
                    block_length: Some(a.block_length),
                    steps: Some(a.steps.unwrap_or(a.gen_length)),
                    kv_cache,
                    threshold,
                    ..LowConfidenceParams::default()
                })
            }
            Workload::Wino | Workload::WinoSureLock => SchemeParams::Wino(WinoParams {
                block_length: Some(a.block_length),
                threshold: a.threshold,
                threshold_back: a.threshold_back,
                surelock,
            }),
        }
    }

    fn request(self, a: &Args, i: u64) -> GenerateSpec {
        // Ordinary ids: below the two special rows (eos, mask) at the end of the vocabulary.
        let prompt_ids = run::random_prompt(a.seed, i, a.prompt_len, 0..(a.vocab_size - 2) as u32);
        run::spec(prompt_ids, a.gen_length, i, self.scheme(a))
    }
}

fn main() -> Result<()> {
    let a = Args::parse();
    a.target.init_threads()?;
    let shape = synthetic::Shape {
        d_model: a.d_model,
        n_heads: a.n_heads,
        n_layers: a.n_layers,
        mlp_hidden_size: a.mlp_hidden_size,
        vocab_size: a.vocab_size,
        max_sequence_length: 4096,
    };
    let cfg = shape.config()?;
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
    let opts = LoadOptions {
        memory_budget_bytes: 16 << 30,
        max_active: max_c,
        ..a.target.load_options("synthetic-llada")?
    };
    let (seed, qk, head) = (a.seed, a.qk_scale, a.head_scale);
    let model_cfg = cfg.clone();
    let served = serve_model(cfg, None, opts, move |device, dtype| {
        synthetic::random_model(&model_cfg, seed, qk, head, device, dtype)
    })?;

    // Warm up (kernels, allocator) with one short request.
    let mut warm = Workload::Wino.request(&a, 999);
    warm.max_new_tokens = a.block_length;
    run::serve(served.as_ref(), warm)?;

    table::print_header(&[
        ("scheme", Left),
        ("concurrent requests", Right),
        ("forward passes per request", Right),
        ("wall s", Right),
        ("latency per request s", Right),
        ("tokens/s (all requests)", Right),
        ("rows computed per request per step", Right),
        ("SureLock FLOPs ratio", Right),
    ]);
    let schemes: &[Workload] = if a.schemes.is_empty() {
        &Workload::ALL
    } else {
        &a.schemes
    };
    for &c in &a.concurrency {
        for &w in schemes {
            eprintln!("{} x{c}...", w.label());
            let (outs, wall) =
                run::together(served.as_ref(), (0..c as u64).map(|i| w.request(&a, i)))?;
            let wall = wall.as_secs_f64();
            let tokens = table::total_tokens(&outs);
            let passes = mean(outs.iter().map(|o| o.stats.forward_passes as f64));
            let latency = mean(outs.iter().map(|o| o.latency.as_secs_f64()));
            let rows = series_mean(&outs, "active_rows").unwrap_or(0.0);
            let flops = outs
                .iter()
                .map(|o| {
                    (
                        o.stats.counters.get("algorithmic_flops").copied(),
                        o.stats.counters.get("algorithmic_flops_dense").copied(),
                    )
                })
                .try_fold((0u64, 0u64), |acc, f| match f {
                    (Some(x), Some(y)) => Some((acc.0 + x, acc.1 + y)),
                    _ => None,
                });
            let ratio = flops.map_or("-".to_owned(), |(x, y)| {
                format!("{:.3}", x as f64 / y as f64)
            });
            println!(
                "| {} | {c} | {passes:.1} | {wall:.2} | {latency:.2} | {:.1} | {rows:.1} | {ratio} |",
                w.label(),
                tokens as f64 / wall
            );
        }
    }
    served.shutdown();
    Ok(())
}
