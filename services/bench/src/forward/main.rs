//! `bench-forward`: the operations an engine tick is made of, timed at the mid-size shapes of
//! docs/benchmarks.md on synthetic weights, against this machine's measured ceilings.
//!
//! In one run it measures the machine's peaks (streaming read bandwidth over a buffer far larger
//! than the last-level cache, and the fused multiply-add rate with operands in registers, both
//! on every pool thread, three times before and three times after the shapes, medians kept;
//! plus the rate of a large square product through the same kernel the models use), times
//! every shape and prints, per shape, the bytes of weights and cache it
//! must read and the FLOPs it must do, the rates reached and the fraction of its roofline:
//! `max(bytes / bandwidth, flops / peak) / time`, i.e. how close the shape runs to the ceiling
//! that binds it.
//!
//! Shapes (mid-size configs; f32 unless `--weight-dtype bf16`):
//! - `decode-kv{32,512,4096}`: a one-row forward of ReFusion's Qwen3 (hidden 512, 8 layers,
//!   8/4 heads of 64, MLP 1536, vocab 32768) over a K/V cache of that many positions, head
//!   included (the step of autoregressive decoding), its cache in pages of 16 positions;
//!   `decode-kv*-contiguous`: the same over one contiguous buffer per layer (before paging);
//!   `decode-kv4096-interleaved`: pages whose ids interleave the layers (no two pages of a
//!   layer adjacent, as a served request's cache grows);
//! - `huginn-core-{1,20}`: one recurrence of Huginn's core (width 1024, 8 heads, MLP 3456, 4
//!   core blocks and the adapter) over 1 row and over a 20-row wavefront, after a 32-token prompt;
//!   `huginn-core-16x1`: the same over one decode row of each of 16 requests (continuous
//!   batching), each over its own cache; `huginn-core-1-kv{32,512,4096}` (and `-contiguous`):
//!   one recurrence over one decode row whose core slots hold that many positions;
//! - `llada-{160,288}`: LLaDA's bidirectional stack (d_model 512, 8 layers, 8 heads, MLP 1536)
//!   over a 160- and a 288-row canvas, without the head;
//! - `armt-segment-272`: one ARMT segment (Llama 512 x 8 layers, 8/2 heads, MLP 1536, 256 tokens
//!   + 16 memory tokens) through every layer with memory reads and writes;
//! - `head-{1,32}`: Huginn's output head (1024 x 32768) over 1 and 32 rows.

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use serde_json::json;
use wavefront_bench::run::Target;
use wavefront_bench::synthetic::{armt, huginn, llada, qwen3};
use wavefront_models::armt::SeqMemory;
use wavefront_models::candle_core::{DType, Device, Tensor};
use wavefront_models::transformer::{
    Keys, KvCache, KvPool, MaskRule, SeqInput, StoreWeights, PAGE_SIZE,
};
use wavefront_models::{cpu_peaks, CacheStrategy, HuginnCache, SeqRows};

/// A page longer than any cache of the bench: one contiguous buffer per layer (slot), how the
/// caches were stored before paging.
const CONTIGUOUS: usize = 8192;
/// Pages of 16 whose ids interleave the layers (page i of layer l is id `i · layers + l`), as a
/// served request's pages are when it grows one page per layer at a time.
const INTERLEAVED: usize = 0;

/// A cache over a shared pool of pages granted so that each layer's pages interleave with the
/// other layers' (the worst layout a served request's cache has: no two pages of a layer
/// adjacent).
fn interleaved_cache(layers: usize, positions: usize, page: usize, kv: Option<DType>) -> KvCache {
    let mut cache = KvCache::in_pool(KvPool::shared_storing(page, kv));
    let pages = positions.div_ceil(page);
    let order: Vec<u32> = (0..layers)
        .flat_map(|l| (0..pages).map(move |i| (i * layers + l) as u32))
        .collect();
    // Taken from the end of the grant: hand it in reverse.
    cache.grant(order.into_iter().rev());
    cache
}

#[derive(Debug, Parser)]
#[command(about = "Per-operation forward timings against this machine's roofline")]
struct Args {
    #[command(flatten)]
    target: Target,
    /// Shapes to time (default: all).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Seconds of timed calls per shape (after warm-up).
    #[arg(long, default_value_t = 1.5)]
    seconds: f64,
    /// Buffer streamed for the bandwidth ceiling, in MiB.
    #[arg(long, default_value_t = 512)]
    bandwidth_mib: usize,
    /// Skip measuring the peaks (fractions are then meaningless): for profiling the shapes.
    #[arg(long)]
    no_peaks: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Positions a K/V page holds in the paged shapes.
    #[arg(long, default_value_t = PAGE_SIZE)]
    page_size: usize,
}

/// One timed shape.
struct Shape {
    name: &'static str,
    rows: usize,
    /// Bytes of weights and cache one call must read.
    bytes: f64,
    /// Floating-point operations one call must do.
    flops: f64,
    run: Box<dyn FnMut() -> Result<()>>,
}

/// Median seconds of one call over `seconds` of calls, after two warm-up calls.
fn time(run: &mut dyn FnMut() -> Result<()>, seconds: f64) -> Result<f64> {
    run()?;
    run()?;
    let mut times = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs_f64(seconds) || times.len() < 5 {
        let t = Instant::now();
        run()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Bytes per weight as stored: 4 (f32), 2 (bf16, bf16-dot) or 1 (int8; its per-channel
/// scales are left out).
fn weight_bytes(params: f64, per: f64) -> f64 {
    params * per
}

fn main() -> Result<()> {
    let a = Args::parse();
    a.target.init_threads()?;
    let opts = a.target.load_options("forward")?;
    let (device, dtype, wdt) = (opts.device.clone(), opts.dtype, opts.weight_dtype);
    let kv_store = opts.kv_store();
    use wavefront_models::transformer::WeightDtype;
    // Bytes per weight; with bf16-dot the products run at the bf16 pair-product peak.
    let bytes_per = match wdt {
        WeightDtype::F32 => 4.0,
        WeightDtype::Bf16 | WeightDtype::Bf16Dot => 2.0,
        WeightDtype::Int8 | WeightDtype::Int8Dot => 1.0,
        // Half a byte and a 4-byte scale per 32.
        WeightDtype::Q4 => 0.5 + 4.0 / 32.0,
        // And a 4-byte integer correction per 32.
        WeightDtype::Q4Dot => 0.5 + 8.0 / 32.0,
    };
    let dot = wdt == WeightDtype::Bf16Dot;
    // A shape is timed when `--only` names it or a prefix of it; a model is built when any
    // of its shapes is timed.
    let want =
        |name: &str| a.only.is_empty() || a.only.iter().any(|o| name.starts_with(o.as_str()));
    let want_any = |prefix: &str| {
        a.only.is_empty()
            || a.only
                .iter()
                .any(|o| o.starts_with(prefix) || prefix.starts_with(o.as_str()))
    };

    eprintln!(
        "measuring peaks ({} threads, {}, bf16 pairs on {}, 8-bit quads on {})",
        wavefront_models::cpu_threads(),
        wavefront_models::cpu_isa(),
        wavefront_models::cpu_bf16_unit(),
        wavefront_models::cpu_int8_unit()
    );
    // The peaks are measured before and after the shapes, three times each, and the medians
    // kept: on a shared machine one reading can be far off.
    let mut peak_runs: Vec<[f64; 6]> = Vec::new();
    let measure_peaks = |runs: &mut Vec<[f64; 6]>| {
        if !a.no_peaks {
            for _ in 0..3 {
                runs.push([
                    cpu_peaks::read_bandwidth(a.bandwidth_mib << 20, 3),
                    cpu_peaks::fma_peak(0.5),
                    cpu_peaks::bf16_dot_peak(0.5).unwrap_or(f64::NAN),
                    cpu_peaks::int8_dot_peak(0.5).unwrap_or(f64::NAN),
                    cpu_peaks::amx_bf16_peak(0.5).unwrap_or(f64::NAN),
                    cpu_peaks::amx_int8_peak(0.5).unwrap_or(f64::NAN),
                ]);
            }
        }
    };
    measure_peaks(&mut peak_runs);
    let gemm = if a.no_peaks {
        f64::NAN
    } else {
        gemm_rate(2048, a.seconds)?
    };
    let mut shapes: Vec<Shape> = Vec::new();

    // ReFusion's Qwen3: one-row decode over K/V caches of several lengths.
    if want_any("decode") {
        let shape = qwen3::Shape {
            hidden_size: 512,
            num_attention_heads: 8,
            num_key_value_heads: 4,
            head_dim: 64,
            num_hidden_layers: 8,
            intermediate_size: 1536,
            vocab_size: 32768,
            max_position_embeddings: 8192,
        };
        let cfg = shape.config()?;
        let mut model = qwen3::random_model(&cfg, 1, 1.0, 1.0, 0.0, &device, dtype)?;
        model.store_weights(wdt)?;
        let model = std::sync::Arc::new(model);
        let (e, l, i, v) = (512.0, 8.0, 1536.0, 32768.0);
        let kv = 4.0 * 64.0;
        let params = l * (e * (8.0 * 64.0) * 2.0 + e * kv * 2.0 + 3.0 * e * i) + v * e;
        for (name, t, page) in [
            ("decode-kv32", 32usize, a.page_size),
            ("decode-kv32-contiguous", 32, CONTIGUOUS),
            ("decode-kv512", 512, a.page_size),
            ("decode-kv512-contiguous", 512, CONTIGUOUS),
            ("decode-kv4096", 4096, a.page_size),
            ("decode-kv4096-contiguous", 4096, CONTIGUOUS),
            ("decode-kv4096-interleaved", 4096, INTERLEAVED),
        ] {
            if !want(name) {
                continue;
            }
            // Fill the cache with t positions, then time one row at position t (the cache
            // cut back to t after every call).
            let mut cache = if page == INTERLEAVED {
                interleaved_cache(8, t + 1, a.page_size, kv_store)
            } else {
                KvCache::in_pool(KvPool::private_storing(page, kv_store))
            };
            let ids: Vec<u32> = (0..t as u32).map(|k| k % 30000).collect();
            let mut seqs =
                [SeqInput::dense(t)
                    .with_mask(MaskRule::Causal)
                    .with_keys(Keys::Buffer {
                        cache: &mut cache,
                        len: t,
                    })];
            model.forward(&ids, &mut seqs)?;
            let m = model.clone();
            let cache_bytes = 2.0 * l * kv * t as f64 * 4.0;
            shapes.push(Shape {
                name,
                rows: 1,
                bytes: weight_bytes(params, bytes_per) + cache_bytes,
                flops: 2.0 * params + 4.0 * l * 8.0 * 64.0 * t as f64,
                run: Box::new(move || {
                    let mut seq = SeqInput {
                        index: vec![t as u32],
                        positions: vec![t as u32],
                        mask: MaskRule::Causal,
                        keys: Keys::Buffer {
                            cache: &mut cache,
                            len: t + 1,
                        },
                    };
                    let h = m.forward(&[7], std::slice::from_mut(&mut seq))?;
                    m.logits(&h)?;
                    cache.truncate(t)?;
                    Ok(())
                }),
            });
        }
    }

    // Huginn's core: one recurrence over 1 and 20 rows, and its head.
    if want_any("huginn-core") || want_any("head") {
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
        let mut model = huginn::random_model(&cfg, 1, &device, dtype)?;
        model.store_weights(wdt)?;
        let model = std::sync::Arc::new(model);
        let (e, i) = (1024.0, 3456.0);
        let block = 3.0 * e * e + e * e + 2.0 * i * e + i * e;
        let core_params = 4.0 * block + 2.0 * e * e;
        let prompt = 32usize;
        for (name, rows) in [("huginn-core-1", 1usize), ("huginn-core-20", 20)] {
            if !want(name) {
                continue;
            }
            let mut cache = HuginnCache::new(CacheStrategy::Full);
            let ids: Vec<u32> = (0..(prompt + rows) as u32).collect();
            let emb = model.embed(&ids)?;
            let injected = {
                let mut seqs = [SeqRows::new(&mut cache, 0, prompt + rows)];
                model.prelude(&emb, &mut seqs)?
            };
            let start = prompt;
            let inj = injected.narrow(0, start, rows)?;
            let state = Tensor::randn(0f32, 1.0, (rows, 1024), &device)?.to_dtype(dtype)?;
            let m = model.clone();
            let keys = (start + rows) as f64;
            shapes.push(Shape {
                name,
                rows,
                bytes: weight_bytes(core_params, bytes_per) + 4.0 * 2.0 * e * keys * 4.0,
                flops: 2.0 * rows as f64 * core_params + 4.0 * 4.0 * rows as f64 * keys * e,
                run: Box::new(move || {
                    let mut seqs = [SeqRows::new(&mut cache, start, rows)];
                    m.core_step(&state, &inj, &mut seqs)?;
                    Ok(())
                }),
            });
        }
        // One decode row of one request at recurrence 0 over a core cache of t positions, in
        // pages and in one contiguous buffer per slot.
        for (name, t, page) in [
            ("huginn-core-1-kv32", 32usize, a.page_size),
            ("huginn-core-1-kv32-contiguous", 32, CONTIGUOUS),
            ("huginn-core-1-kv512", 512, a.page_size),
            ("huginn-core-1-kv512-contiguous", 512, CONTIGUOUS),
            ("huginn-core-1-kv4096", 4096, a.page_size),
            ("huginn-core-1-kv4096-contiguous", 4096, CONTIGUOUS),
        ] {
            if !want(name) {
                continue;
            }
            let mut cache =
                HuginnCache::in_pool(CacheStrategy::Full, KvPool::private_storing(page, kv_store));
            let ids: Vec<u32> = (0..=t as u32).map(|k| k * 7 % 32000).collect();
            let emb = model.embed(&ids)?;
            let injected = {
                let mut seqs = [SeqRows::new(&mut cache, 0, t + 1)];
                model.prelude(&emb, &mut seqs)?
            };
            // The core slots of recurrence 0 hold positions 0..t.
            let warm = Tensor::randn(0f32, 1.0, (t, 1024), &device)?.to_dtype(dtype)?;
            model.core_step(
                &warm,
                &injected.narrow(0, 0, t)?,
                &mut [SeqRows::new(&mut cache, 0, t)],
            )?;
            let inj = injected.narrow(0, t, 1)?;
            let state = Tensor::randn(0f32, 1.0, (1, 1024), &device)?.to_dtype(dtype)?;
            let m = model.clone();
            let keys = (t + 1) as f64;
            shapes.push(Shape {
                name,
                rows: 1,
                bytes: weight_bytes(core_params, bytes_per) + 4.0 * 2.0 * e * keys * 4.0,
                flops: 2.0 * core_params + 4.0 * 4.0 * keys * e,
                run: Box::new(move || {
                    let mut seqs = [SeqRows::new(&mut cache, t, 1)];
                    m.core_step(&state, &inj, &mut seqs)?;
                    Ok(())
                }),
            });
        }
        // Continuous batching: 16 requests' one decode row each, every one over its own cache.
        if want("huginn-core-16x1") {
            let n = 16usize;
            let mut caches: Vec<HuginnCache> = (0..n)
                .map(|_| HuginnCache::new(CacheStrategy::Full))
                .collect();
            for (i, cache) in caches.iter_mut().enumerate() {
                let ids: Vec<u32> = (0..=prompt as u32).map(|t| t + i as u32).collect();
                let emb = model.embed(&ids)?;
                let mut seqs = [SeqRows::new(cache, 0, prompt + 1)];
                model.prelude(&emb, &mut seqs)?;
            }
            let state = Tensor::randn(0f32, 1.0, (n, 1024), &device)?.to_dtype(dtype)?;
            let inj = Tensor::randn(0f32, 1.0, (n, 1024), &device)?.to_dtype(dtype)?;
            let m = model.clone();
            let keys = (prompt + 1) as f64;
            shapes.push(Shape {
                name: "huginn-core-16x1",
                rows: n,
                bytes: weight_bytes(core_params, bytes_per) + n as f64 * 4.0 * 2.0 * e * keys * 4.0,
                flops: 2.0 * n as f64 * core_params + n as f64 * 4.0 * 4.0 * keys * e,
                run: Box::new(move || {
                    let mut seqs: Vec<SeqRows> = caches
                        .iter_mut()
                        .map(|c| SeqRows::new(c, prompt, 1))
                        .collect();
                    m.core_step(&state, &inj, &mut seqs)?;
                    Ok(())
                }),
            });
        }
        for (name, rows) in [("head-1", 1usize), ("head-32", 32)] {
            if !want(name) {
                continue;
            }
            let hidden = Tensor::randn(0f32, 1.0, (rows, 1024), &device)?.to_dtype(dtype)?;
            let m = model.clone();
            let params = 32768.0 * e;
            shapes.push(Shape {
                name,
                rows,
                bytes: weight_bytes(params, bytes_per),
                flops: 2.0 * rows as f64 * params,
                run: Box::new(move || {
                    m.lm_head(&hidden)?;
                    Ok(())
                }),
            });
        }
    }

    // LLaDA: the bidirectional stack over whole canvases.
    if want_any("llada") {
        let shape = llada::Shape {
            d_model: 512,
            n_heads: 8,
            n_layers: 8,
            mlp_hidden_size: 1536,
            vocab_size: 32768,
            max_sequence_length: 4096,
        };
        let cfg = shape.config()?;
        let mut model = llada::random_model(&cfg, 1, 3.0, 24.0, &device, dtype)?;
        model.store_weights(wdt)?;
        let model = std::sync::Arc::new(model);
        let (e, l, i) = (512.0, 8.0, 1536.0);
        let params = l * (4.0 * e * e + 3.0 * e * i);
        for (name, rows) in [("llada-160", 160usize), ("llada-288", 288)] {
            if !want(name) {
                continue;
            }
            let ids: Vec<u32> = (0..rows as u32).map(|k| k * 7 % 32000).collect();
            let m = model.clone();
            shapes.push(Shape {
                name,
                rows,
                bytes: weight_bytes(params, bytes_per),
                flops: 2.0 * rows as f64 * params + 4.0 * l * (rows * rows) as f64 * e,
                run: Box::new(move || {
                    m.forward(&ids, &mut [SeqInput::dense(ids.len())])?;
                    Ok(())
                }),
            });
        }
    }

    // ARMT: one 272-row segment through every layer, memories read and written.
    if want_any("armt") {
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
            max_position_embeddings: 4096,
        };
        let cfg = shape.config()?;
        let mut model = armt::random_model(&cfg, 1, &device, dtype)?;
        model.store_weights(wdt)?;
        let (e, l, i, kv, dm) = (512.0, 8.0, 1536.0, 2.0 * 64.0, 64.0);
        let dk = 6.0 * dm;
        let params = l * (2.0 * e * e + 2.0 * e * kv + 3.0 * e * i + dm * e + (dm + e + 1.0) * e);
        let ids: Vec<u32> = (0..256u32).map(|k| k * 13 % 32000).collect();
        let mut memory = model.new_memory()?;
        // One segment first, so every later segment reads written memories.
        let step = move |model: &wavefront_models::Armt, memory: &mut Vec<_>| -> Result<()> {
            let x = model.segment_input(&ids, true)?;
            let n = x.dim(0)?;
            let mut seqs = [SeqInput::dense(n).with_mask(MaskRule::Causal)];
            let mut mems = [SeqMemory {
                layers: memory,
                write: true,
            }];
            model.forward_layers(&x, &mut seqs, &mut mems)?;
            Ok(())
        };
        step(&model, &mut memory)?;
        let rows = 272usize;
        shapes.push(Shape {
            name: "armt-segment-272",
            rows,
            bytes: weight_bytes(params, bytes_per) + l * (dk * e + dk) * 4.0,
            flops: 2.0 * rows as f64 * params
                + 4.0 * l * (rows * rows) as f64 / 2.0 * e
                + 2.0 * l * rows as f64 * dk * e * 2.0,
            run: Box::new(move || step(&model, &mut memory)),
        });
    }

    let mut timed = Vec::new();
    for mut s in shapes {
        eprintln!("timing {}", s.name);
        let secs = time(s.run.as_mut(), a.seconds)?;
        timed.push((s, secs));
    }
    measure_peaks(&mut peak_runs);
    let median = |mut v: Vec<f64>| -> f64 {
        if v.is_empty() {
            return f64::NAN;
        }
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let peak = |i: usize| median(peak_runs.iter().map(|p| p[i]).collect());
    let (bandwidth, fma, bf16_peak, int8_peak) = (peak(0), peak(1), peak(2), peak(3));
    let (amx_peak, amx_int8_peak) = (peak(4), peak(5));
    // The arithmetic ceiling of the products: bf16 pair products with bf16-dot (on AMX tiles
    // where this process uses them) and 8-bit products with int8-dot where the CPU has them,
    // float32 FMAs otherwise.
    let compute = if dot && amx_peak.is_finite() {
        amx_peak
    } else if dot && bf16_peak.is_finite() {
        bf16_peak
    } else if wdt == WeightDtype::Int8Dot && amx_int8_peak.is_finite() {
        amx_int8_peak
    } else if matches!(wdt, WeightDtype::Int8Dot | WeightDtype::Q4Dot) && int8_peak.is_finite() {
        int8_peak
    } else {
        fma
    };
    let mut results = Vec::new();
    for (s, secs) in timed {
        let roof = (s.bytes / bandwidth).max(s.flops / compute);
        let bound = if s.bytes / bandwidth >= s.flops / compute {
            "memory"
        } else {
            "compute"
        };
        results.push(json!({
            "shape": s.name,
            "rows": s.rows,
            "ms": secs * 1e3,
            "gb_per_s": s.bytes / secs / 1e9,
            "gflop_per_s": s.flops / secs / 1e9,
            "bound": bound,
            "roofline_fraction": roof / secs,
        }));
    }
    let report = json!({
        "threads": wavefront_models::cpu_threads(),
        "isa": wavefront_models::cpu_isa(),
        "weight_dtype": wdt.name(),
        "read_bandwidth_gb_per_s": bandwidth / 1e9,
        "fma_peak_gflop_per_s": fma / 1e9,
        "bf16_dot_peak_gflop_per_s": bf16_peak / 1e9,
        "amx_bf16_peak_gflop_per_s": amx_peak / 1e9,
        "amx_int8_peak_gop_per_s": amx_int8_peak / 1e9,
        "bf16_unit": wavefront_models::cpu_bf16_unit(),
        "int8_unit": wavefront_models::cpu_int8_unit(),
        "int8_dot_peak_gop_per_s": int8_peak / 1e9,
        "gemm_2048_gflop_per_s": gemm / 1e9,
        "shapes": results,
    });
    if a.json {
        println!("{report}");
        return Ok(());
    }
    println!(
        "Peaks ({} threads, {}): read bandwidth {:.1} GB/s; FMA {:.1} GFLOP/s; bf16 pair products {:.1} GFLOP/s (AMX tiles {:.1}; bf16-dot runs on {}); 8-bit products {:.1} GOP/s (AMX tiles {:.1}; int8-dot runs on {}); 2048^3 product through the model kernel {:.1} GFLOP/s ({:.0}% of FMA). Weights {}.\n",
        report["threads"],
        report["isa"].as_str().unwrap_or(""),
        bandwidth / 1e9,
        fma / 1e9,
        bf16_peak / 1e9,
        amx_peak / 1e9,
        wavefront_models::cpu_bf16_unit(),
        int8_peak / 1e9,
        amx_int8_peak / 1e9,
        wavefront_models::cpu_int8_unit(),
        gemm / 1e9,
        100.0 * gemm / fma,
        report["weight_dtype"].as_str().unwrap_or(""),
    );
    println!("| shape | rows | ms | GB/s | GFLOP/s | bound | of roofline |");
    println!("|---|---:|---:|---:|---:|---|---:|");
    for r in report["shapes"].as_array().into_iter().flatten() {
        println!(
            "| {} | {} | {:.3} | {:.1} | {:.1} | {} | {:.0}% |",
            r["shape"].as_str().unwrap_or(""),
            r["rows"],
            r["ms"].as_f64().unwrap_or(0.0),
            r["gb_per_s"].as_f64().unwrap_or(0.0),
            r["gflop_per_s"].as_f64().unwrap_or(0.0),
            r["bound"].as_str().unwrap_or(""),
            100.0 * r["roofline_fraction"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(())
}

/// FLOP/s of a `n x n x n` product through the linear layer the models use.
fn gemm_rate(n: usize, seconds: f64) -> Result<f64> {
    let w = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let x = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?.to_dtype(DType::F32)?;
    let layer = wavefront_models::transformer::Linear::new(w, None)?;
    let secs = time(
        &mut || {
            layer.forward(&x)?;
            Ok(())
        },
        seconds,
    )?;
    Ok(2.0 * (n * n * n) as f64 / secs)
}
