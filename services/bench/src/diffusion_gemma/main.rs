//! `bench-diffusion-gemma`: DiffusionGemma's entropy-bounded sampler on a synthetic model
//! (random weights, see [`synthetic`]), served through the real engine, beside LLaDA2.0's
//! block-diffusion forward of the same rows.
//!
//! Every request runs a fixed number of denoising steps per canvas (`--steps`, early stopping
//! off) so the times compare: random weights accept positions at their own rate, which says
//! nothing about the trained model. For each concurrency in `--concurrency`, N requests are
//! served one after another and then all together (the engine packs every request's encoder
//! pass or denoising step into one forward, each MoE layer one product per expert over all the
//! rows routed to it); the table reports forward passes per request, tokens per forward, wall
//! time, canvases and tokens per second of both, and whether every request produced the same
//! tokens both ways.
//!
//! A second table times single forwards: a denoising step (a canvas over a cache of the prompt)
//! and the prompt's encoder pass, and beside them a LLaDA2.0 model of the same width, depth,
//! experts and vocabulary computing the same rows over the same cache (its block-diffusion
//! step), with the ratio.
//!
//! Prints markdown tables on stdout and progress on stderr.

use anyhow::Result;
use clap::Parser;
use wavefront_bench::run;
use wavefront_bench::synthetic::{diffusion_gemma as synthetic, llada2};
use wavefront_bench::table::Align::{Left, Right};
use wavefront_bench::table::{self, mean};
use wavefront_models::diffusion_gemma::DgSeq;
use wavefront_models::transformer::{Keys, KvCache, MaskRule, SeqInput};
use wavefront_schemes::uniform_diffusion::{serve_model, GenerationDefaults};
use wavefront_schemes::{EntropyBoundParams, GenerateSpec, LoadOptions, SchemeParams};

#[derive(Debug, Parser)]
#[command(about = "DiffusionGemma's entropy-bound sampler on a synthetic model")]
struct Args {
    /// The real google/diffusiongemma-26B-A4B-it shape (the size flags below are ignored).
    #[arg(long)]
    real: bool,
    #[arg(long, default_value_t = 512)]
    hidden_size: usize,
    #[arg(long, default_value_t = 384)]
    intermediate_size: usize,
    #[arg(long, default_value_t = 128)]
    moe_intermediate_size: usize,
    #[arg(long, default_value_t = 32)]
    experts: usize,
    #[arg(long, default_value_t = 4)]
    experts_per_token: usize,
    #[arg(long, default_value_t = 6)]
    layers: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    sliding_window: usize,
    #[arg(long, default_value_t = 32768)]
    vocab_size: usize,
    #[arg(long, default_value_t = 64)]
    canvas_length: usize,
    /// Scale of the embedding (the tied head) over the init.
    #[arg(long, default_value_t = 8.0)]
    head_scale: f64,
    #[arg(long, default_value_t = 64)]
    prompt_len: usize,
    /// Canvases per request.
    #[arg(long, default_value_t = 2)]
    canvases: usize,
    /// Denoising steps per canvas (all run).
    #[arg(long, default_value_t = 16)]
    steps: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    concurrency: Vec<usize>,
    /// Skip the serving table (forwards only).
    #[arg(long)]
    forwards_only: bool,
    /// Skip the LLaDA2.0 model beside it (with `--real` it is always skipped: two models of
    /// that size do not fit one device).
    #[arg(long)]
    no_llada2: bool,
    #[command(flatten)]
    target: run::Target,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

fn shape(a: &Args) -> synthetic::Shape {
    if a.real {
        return synthetic::Shape::real();
    }
    synthetic::Shape {
        hidden_size: a.hidden_size,
        intermediate_size: a.intermediate_size,
        moe_intermediate_size: a.moe_intermediate_size,
        num_experts: a.experts,
        top_k_experts: a.experts_per_token,
        num_hidden_layers: a.layers,
        full_every: 6,
        num_attention_heads: a.heads,
        head_dim: a.head_dim,
        num_key_value_heads: a.kv_heads,
        global_head_dim: 2 * a.head_dim,
        num_global_key_value_heads: 1.max(a.kv_heads / 4),
        sliding_window: a.sliding_window,
        vocab_size: a.vocab_size,
        canvas_length: a.canvas_length,
    }
}

fn request(a: &Args, s: &synthetic::Shape, i: u64) -> GenerateSpec {
    let prompt = run::random_prompt(a.seed, i, a.prompt_len, 0..s.vocab_size as u32);
    run::spec(
        prompt,
        a.canvases * s.canvas_length,
        i,
        SchemeParams::EntropyBound(EntropyBoundParams {
            max_denoising_steps: Some(a.steps),
            no_early_stop: true,
            ..EntropyBoundParams::default()
        }),
    )
}

fn main() -> Result<()> {
    let a = Args::parse();
    a.target.init_threads()?;
    let s = shape(&a);
    if !a.forwards_only {
        serving_table(&a, &s)?;
    }
    forward_table(&a, &s)
}

fn serving_table(a: &Args, s: &synthetic::Shape) -> Result<()> {
    let cfg = s.config()?;
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
    let opts = LoadOptions {
        memory_budget_bytes: 8 << 30,
        max_active: max_c,
        ..a.target.load_options("synthetic-diffusion-gemma")?
    };
    let (seed, head) = (a.seed, a.head_scale);
    let model_cfg = cfg.clone();
    let served = serve_model(
        cfg,
        GenerationDefaults::default(),
        None,
        opts,
        move |device, dtype| synthetic::random_model(&model_cfg, seed, head, device, dtype),
    )?;
    let mut warm = request(a, s, 999);
    warm.max_new_tokens = s.canvas_length;
    run::serve(served.as_ref(), warm)?;
    table::print_header(&[
        ("concurrent requests", Right),
        ("forward passes per request", Right),
        ("tokens per denoising step", Right),
        ("one after another s", Right),
        ("together s", Right),
        ("canvases/s one after another", Right),
        ("canvases/s together", Right),
        ("tokens/s together", Right),
        ("speed-up", Right),
        ("same tokens", Left),
    ]);
    for &c in &a.concurrency {
        eprintln!("x{c}...");
        let specs: Vec<GenerateSpec> = (0..c as u64).map(|i| request(a, s, i)).collect();
        let started = std::time::Instant::now();
        let alone = specs
            .iter()
            .map(|sp| run::serve(served.as_ref(), sp.clone()))
            .collect::<Result<Vec<_>>>()?;
        let serial = started.elapsed().as_secs_f64();
        let (outs, wall) = run::together(served.as_ref(), specs)?;
        let wall = wall.as_secs_f64();
        let tokens = table::total_tokens(&outs) as f64;
        let canvases = outs
            .iter()
            .map(|o| o.stats.counters.get("canvases").copied().unwrap_or(0))
            .sum::<u64>() as f64;
        let steps = outs
            .iter()
            .map(|o| {
                o.stats
                    .counters
                    .get("denoising_steps")
                    .copied()
                    .unwrap_or(0)
            })
            .sum::<u64>() as f64;
        let same = alone.iter().zip(&outs).all(|(x, y)| x.tokens == y.tokens);
        println!(
            "| {c} | {:.1} | {:.2} | {serial:.2} | {wall:.2} | {:.2} | {:.2} | {:.1} | {:.2}x | {} |",
            mean(outs.iter().map(|o| o.stats.forward_passes as f64)),
            tokens / steps.max(1.0),
            canvases / serial,
            canvases / wall,
            tokens / wall,
            serial / wall,
            if same { "yes" } else { "no" },
        );
    }
    served.shutdown();
    println!();
    Ok(())
}

fn forward_table(a: &Args, s: &synthetic::Shape) -> Result<()> {
    let (device, dtype) = run::device_and_dtype(&a.target.device, &a.target.dtype)?;
    let cfg = s.config()?;
    let model = synthetic::random_model(&cfg, a.seed, a.head_scale, &device, dtype)?;
    let (p, l) = (a.prompt_len, s.canvas_length);
    let prompt = run::random_prompt(a.seed, 0, p, 0..s.vocab_size as u32);
    let canvas = run::random_prompt(a.seed, 1, l, 0..s.vocab_size as u32);
    let mut cache = KvCache::new();
    let encode = run::median_secs(&device, 5, || {
        cache.clear();
        model.forward(&mut [DgSeq::encode(prompt.clone(), 0, &mut cache)])?;
        Ok(())
    })?;
    let soft = model.soft_embedding(&wavefront_models::candle_core::Tensor::zeros(
        (l, s.vocab_size),
        wavefront_models::candle_core::DType::F32,
        &device,
    )?)?;
    let denoise = run::median_secs(&device, 9, || {
        let h = model.forward(&mut [DgSeq::denoise(
            canvas.clone(),
            p,
            Some(soft.clone()),
            &mut cache,
        )])?;
        model.logits(&h)?;
        Ok(())
    })?;
    // LLaDA2.0 of the same width, depth, experts and vocabulary: its block-diffusion step (a
    // block of `l` rows over a cache of the prompt).
    let step2 = if a.real || a.no_llada2 {
        None
    } else {
        Some(llada2_step(a, s, &device, dtype)?)
    };
    table::print_header(&[
        ("forward", Left),
        ("rows", Right),
        ("cached rows", Right),
        ("DiffusionGemma ms", Right),
        ("LLaDA2.0 ms", Right),
        ("ratio", Right),
    ]);
    match step2 {
        Some(step2) => println!(
            "| denoising step / block step (with the head) | {l} | {p} | {:.2} | {:.2} | {:.2}x |",
            denoise * 1e3,
            step2 * 1e3,
            denoise / step2
        ),
        None => println!(
            "| denoising step (with the head) | {l} | {p} | {:.2} | | |",
            denoise * 1e3
        ),
    }
    println!(
        "| encoder pass (prompt) | {p} | 0 | {:.2} | | |",
        encode * 1e3
    );
    // The step's work besides the forward: the sampler's row statistics and the next step's
    // self-conditioning input (`softmax(logits / T) · E`).
    let logits = {
        let h = model.forward(&mut [DgSeq::denoise(canvas.clone(), p, None, &mut cache)])?;
        model.logits(&h)?
    };
    let host: Vec<f32> = logits.flatten_all()?.to_vec1()?;
    let stats = run::median_secs(&device, 9, || {
        wavefront_models::transformer::cpu::row_entropy(&host, s.vocab_size)?;
        Ok(())
    })?;
    let sc = run::median_secs(&device, 9, || {
        model.soft_embedding(&logits)?;
        Ok(())
    })?;
    println!(
        "| sampler: entropies, argmax, sums over the vocabulary | {l} | | {:.2} | | |",
        stats * 1e3
    );
    println!(
        "| self-conditioning input (softmax · embedding table) | {l} | | {:.2} | | |",
        sc * 1e3
    );
    Ok(())
}

/// LLaDA2.0's block-diffusion step at DiffusionGemma's width, depth, experts and vocabulary: a
/// block of `canvas_length` rows over a cached prompt, with the head (median seconds).
fn llada2_step(
    a: &Args,
    s: &synthetic::Shape,
    device: &wavefront_models::candle_core::Device,
    dtype: wavefront_models::candle_core::DType,
) -> Result<f64> {
    let (p, l) = (a.prompt_len, s.canvas_length);
    let l2 = llada2::Shape {
        hidden_size: s.hidden_size,
        num_attention_heads: s.num_attention_heads,
        num_key_value_heads: s.num_key_value_heads,
        num_hidden_layers: s.num_hidden_layers,
        intermediate_size: s.intermediate_size,
        moe_intermediate_size: s.moe_intermediate_size,
        num_experts: s.num_experts,
        num_experts_per_tok: s.top_k_experts,
        n_group: 8.min(s.num_experts),
        topk_group: 4.min(s.num_experts),
        vocab_size: s.vocab_size,
    };
    let other = llada2::random_model(&l2.config()?, a.seed, 24.0, device, dtype)?;
    let mut c2 = KvCache::new();
    let block = |start: usize, n: usize| -> SeqInput<'static> {
        let index: Vec<u32> = (start as u32..(start + n) as u32).collect();
        SeqInput {
            positions: index.clone(),
            index,
            mask: MaskRule::BlockCausal { block: l },
            keys: Keys::Rows,
        }
    };
    let prefix = p / l * l;
    let ids2 = run::random_prompt(a.seed, 2, prefix + l, 0..s.vocab_size as u32 - 1);
    if prefix > 0 {
        let mut seq = block(0, prefix);
        seq.keys = Keys::Buffer {
            cache: &mut c2,
            len: prefix,
        };
        other.forward(&ids2[..prefix], &mut [seq])?;
    }
    run::median_secs(device, 9, || {
        c2.truncate(prefix)?;
        let mut seq = block(prefix, l);
        seq.keys = Keys::Buffer {
            cache: &mut c2,
            len: prefix + l,
        };
        let h = other.forward(&ids2[prefix..], &mut [seq])?;
        other.logits(&h)?;
        Ok(())
    })
}
