//! `bench-numerics`: how far the float32 forward of a LLaDA-shaped model with sharpened weights
//! (q/k and output head scaled, as the llada fixture does) lands from the same model run in
//! float64, end to end and operation by operation.
//!
//! End to end: the float32 model (the CPU kernels) against the float64 model (candle in float64)
//! on the same canvas: logits, and the confidences WINO and the low-confidence sampler compare
//! with their thresholds (the softmax maximum of every row, computed from each model's logits
//! in float64 as WINO does).
//!
//! Per operation: each op of a block is run on the float64 model's own activations (the input
//! of block 4), in float64 (the reference), in float32 through candle's CPU ops (the
//! implementation before the CPU kernels: the `gemm` crate's products, candle's softmax and
//! RMSNorm) and in float32 through the CPU kernels. The error of an op is
//! `max |y - ref| / max |ref|` over its output; the worst element's relative error over
//! elements with `|ref| > 1% max |ref|` is shown beside it.

use anyhow::Result;
use clap::Parser;
use rand::rngs::StdRng;
use rand::SeedableRng;
use wavefront_bench::synthetic::llada;
use wavefront_bench::weights::uniform_with_std;
use wavefront_kernels::attention::Mask;
use wavefront_kernels::cpu::attention::{attention, Heads, KvBlock, SeqAttention};
use wavefront_kernels::cpu::elementwise;
use wavefront_kernels::cpu::matmul::{linear, PackedWeight, WeightDtype};
use wavefront_models::candle_core::{DType, Device, Tensor, D};
use wavefront_models::candle_nn;
use wavefront_models::transformer::SeqInput;

#[derive(Debug, Parser)]
#[command(about = "Float32 forward error against float64, end to end and per operation")]
struct Args {
    /// Canvas rows (prompt + generated region).
    #[arg(long, default_value_t = 160)]
    rows: usize,
    #[arg(long, default_value_t = 3.0)]
    qk_scale: f64,
    #[arg(long, default_value_t = 24.0)]
    head_scale: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Threads of the CPU kernels (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Also write the weights (`model.safetensors`, checkpoint names), `config.json`, the canvas
    /// and both models' logits (`outputs.safetensors`) here, for `scripts/numerics-torch.py`.
    #[arg(long)]
    export: Option<std::path::PathBuf>,
}

/// `(normwise, worst relative)` error of `y` against `reference`.
fn err(y: &[f32], reference: &[f64]) -> (f64, f64) {
    let scale = reference.iter().fold(0f64, |m, v| m.max(v.abs()));
    let mut normwise = 0f64;
    let mut worst = 0f64;
    for (&a, &r) in y.iter().zip(reference) {
        let d = (f64::from(a) - r).abs();
        normwise = normwise.max(d);
        if r.abs() > 0.01 * scale {
            worst = worst.max(d / r.abs());
        }
    }
    (normwise / scale.max(f64::MIN_POSITIVE), worst)
}

fn f32s(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
}

fn f64s(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?)
}

struct Row {
    op: String,
    before: (f64, f64),
    after: (f64, f64),
}

fn main() -> Result<()> {
    let a = Args::parse();
    let threads = match a.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    wavefront_models::tune_allocator();
    wavefront_models::init_cpu_threads(threads).map_err(anyhow::Error::msg)?;
    let shape = llada::Shape {
        d_model: 512,
        n_heads: 8,
        n_layers: 8,
        mlp_hidden_size: 1536,
        vocab_size: 32768,
        max_sequence_length: 4096,
    };
    let cfg = shape.config()?;
    let dev = Device::Cpu;
    eprintln!("building the float64 and float32 models");
    let m64 = llada::random_model(&cfg, a.seed, a.qk_scale, a.head_scale, &dev, DType::F64)?;
    let m32 = llada::random_model(&cfg, a.seed, a.qk_scale, a.head_scale, &dev, DType::F32)?;
    let n = a.rows;
    let mask = cfg.mask_token_id;
    let prompt = 32.min(n);
    let ids: Vec<u32> = (0..n as u32)
        .map(|i| {
            if (i as usize) < prompt {
                (i * 7919 + 11) % 30000
            } else {
                mask
            }
        })
        .collect();

    // End to end.
    eprintln!("end to end");
    let states64 = m64.forward_hidden_states(&ids, &mut [SeqInput::dense(n)])?;
    let l64 = m64.logits(states64.last().expect("final state"))?;
    let h32 = m32.forward(&ids, &mut [SeqInput::dense(n)])?;
    let l32 = m32.logits(&h32)?;
    let logits = err(&f32s(&l32)?, &f64s(&l64)?);
    let conf = |l: &Tensor| -> Result<Vec<f64>> {
        let l = l.to_dtype(DType::F64)?;
        let max = l.max_keepdim(D::Minus1)?;
        let sum = l.broadcast_sub(&max)?.exp()?.sum(D::Minus1)?;
        Ok(sum.recip()?.to_vec1()?)
    };
    let (c64, c32) = (conf(&l64)?, conf(&l32)?);
    if let Some(dir) = &a.export {
        std::fs::create_dir_all(dir)?;
        let mut init = llada::weights(&cfg, a.seed, a.qk_scale, a.head_scale);
        let mut tensors = std::collections::HashMap::new();
        for (name, shape) in cfg.checkpoint_tensors() {
            let v = init(&name, &shape);
            tensors.insert(name, Tensor::from_vec(v, shape, &dev)?);
        }
        wavefront_models::candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
        std::fs::write(dir.join("config.json"), shape.config_json().to_string())?;
        let outputs = std::collections::HashMap::from([
            ("ids".to_owned(), Tensor::new(ids.as_slice(), &dev)?),
            ("logits_f64".to_owned(), l64.clone()),
            ("logits_f32".to_owned(), l32.clone()),
        ]);
        wavefront_models::candle_core::safetensors::save(
            &outputs,
            dir.join("outputs.safetensors"),
        )?;
        eprintln!("exported to {}", dir.display());
    }
    let conf_err = c64
        .iter()
        .zip(&c32)
        .map(|(a, b)| (a - b).abs())
        .fold(0f64, f64::max);

    // Per operation, on the float64 model's input of block 4.
    eprintln!("per operation");
    let x64 = &states64[4];
    let x32 = x64.to_dtype(DType::F32)?;
    let xs32 = f32s(&x32)?;
    let d = 512usize;
    let mut rows = Vec::new();

    // RMSNorm (weight 1).
    let ms = x64.sqr()?.mean_keepdim(D::Minus1)?;
    let norm64 = x64.broadcast_mul(&(ms + 1e-5)?.sqrt()?.recip()?)?;
    let ones = Tensor::ones(d, DType::F32, &dev)?;
    let before = candle_nn::ops::rms_norm(&x32, &ones, 1e-5)?;
    let mut after = vec![0f32; n * d];
    elementwise::rms_norm(&xs32, &vec![1.0; d], 1e-5, &mut after).map_err(anyhow::Error::msg)?;
    let r = f64s(&norm64)?;
    rows.push(Row {
        op: format!("RMSNorm [{n} x {d}]"),
        before: err(&f32s(&before)?, &r),
        after: err(&after, &r),
    });

    // A product: reference in float64, candle's float32 matmul, the kernel.
    let product =
        |name: String, x64: &Tensor, k: usize, out: usize, std: f64| -> Result<(Row, Tensor)> {
            let mut rng = StdRng::seed_from_u64(out as u64 * 31 + k as u64);
            let w: Vec<f32> = uniform_with_std(&mut rng, out * k, std);
            let w32 = Tensor::from_vec(w.clone(), (out, k), &dev)?;
            let w64 = w32.to_dtype(DType::F64)?;
            let y64 = x64.matmul(&w64.t()?)?;
            let x32 = x64.to_dtype(DType::F32)?;
            let before = x32.matmul(&w32.t()?)?;
            let rows_n = x64.dim(0)?;
            let mut after = vec![0f32; rows_n * out];
            let p = PackedWeight::pack(&w, out, k, WeightDtype::F32).map_err(anyhow::Error::msg)?;
            linear(&f32s(&x32)?, rows_n, &p, None, &mut after).map_err(anyhow::Error::msg)?;
            let r = f64s(&y64)?;
            Ok((
                Row {
                    op: name,
                    before: err(&f32s(&before)?, &r),
                    after: err(&after, &r),
                },
                y64,
            ))
        };
    let inv = 1.0 / (d as f64).sqrt();
    let (row, qkv64) = product(
        format!("q/k/v product [{n} x {d}] x [{d} x 1536]"),
        &norm64,
        d,
        3 * d,
        inv * a.qk_scale,
    )?;
    rows.push(row);
    let (row, gu64) = product(
        format!("gate/up product [{n} x {d}] x [{d} x 3072]"),
        &norm64,
        d,
        6 * d,
        inv,
    )?;
    rows.push(row);
    let g = gu64.narrow(1, 0, 3 * d)?;
    let u = gu64.narrow(1, 3 * d, 3 * d)?;
    let act64 = ((&g / (g.neg()?.exp()? + 1.0)?)? * &u)?;
    // SiLU gate.
    let gu32 = gu64.to_dtype(DType::F32)?;
    let before = (gu32.narrow(1, 0, 3 * d)?.silu()? * gu32.narrow(1, 3 * d, 3 * d)?)?;
    let mut after = vec![0f32; n * 3 * d];
    elementwise::silu_mul(&f32s(&gu32)?, 3 * d, &mut after).map_err(anyhow::Error::msg)?;
    let r = f64s(&act64)?;
    rows.push(Row {
        op: format!("SiLU gate [{n} x 1536]"),
        before: err(&f32s(&before)?, &r),
        after: err(&after, &r),
    });
    let (row, _) = product(
        format!("down product [{n} x 1536] x [1536 x {d}]"),
        &act64,
        3 * d,
        d,
        1.0 / (2.0 * d as f64 * 5.0).sqrt(),
    )?;
    rows.push(row);
    let final64 = states64.last().expect("final state");
    let (row, _) = product(
        format!("head [{n} x {d}] x [{d} x 32768]"),
        final64,
        d,
        32768,
        inv * a.head_scale,
    )?;
    rows.push(row);

    // Attention: 8 heads of 64 over the canvas, bidirectional, q/k from the product above.
    let (h, hd) = (8usize, 64usize);
    let heads = |t: &Tensor, at: usize| -> Result<Tensor> {
        Ok(t.narrow(1, at * d, d)?
            .reshape((n, h, hd))?
            .transpose(0, 1)?
            .contiguous()?)
    };
    let (q64, k64, v64) = (heads(&qkv64, 0)?, heads(&qkv64, 1)?, heads(&qkv64, 2)?);
    let scale = 1.0 / (hd as f64).sqrt();
    let sdpa = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
        let s = (q.matmul(&k.t()?)? * scale)?;
        Ok(candle_nn::ops::softmax_last_dim(&s)?.matmul(v)?)
    };
    let ref64 = sdpa(&q64, &k64, &v64)?;
    let (q32, k32, v32) = (
        q64.to_dtype(DType::F32)?,
        k64.to_dtype(DType::F32)?,
        v64.to_dtype(DType::F32)?,
    );
    let before = sdpa(&q32, &k32, &v32)?;
    let (qs, ks, vs) = (f32s(&q32)?, f32s(&k32)?, f32s(&v32)?);
    let index: Vec<u32> = (0..n as u32).collect();
    let seqs = [SeqAttention {
        rows: 0..n,
        row_index: &index,
        blocks: vec![KvBlock {
            k: (&ks).into(),
            v: (&vs).into(),
            len: n,
            head_stride: n * hd,
        }],
        key_index: None,
        mask: Mask::Bidirectional,
    }];
    let mut after = vec![0f32; h * n * hd];
    let hh = Heads {
        n_heads: h,
        n_kv_heads: h,
        head_dim: hd,
        scale: scale as f32,
        rows_out: false,
        bf16_products: false,
    };
    attention(hh, &qs, n, &seqs, &mut after).map_err(anyhow::Error::msg)?;
    let r = f64s(&ref64)?;
    rows.push(Row {
        op: format!("attention {h} x [{n} x {hd}], bidirectional"),
        before: err(&f32s(&before)?, &r),
        after: err(&after, &r),
    });

    // The samplers' confidence: softmax maximum over the vocabulary, in float32.
    let lf = l64.to_dtype(DType::F32)?;
    let conf_f32 = |l: &Tensor| -> Result<Vec<f32>> {
        let max = l.max_keepdim(D::Minus1)?;
        Ok(l.broadcast_sub(&max)?
            .exp()?
            .sum(D::Minus1)?
            .recip()?
            .to_vec1()?)
    };
    let before = conf_f32(&lf)?;
    let mut after = Vec::with_capacity(n);
    for row in f32s(&lf)?.chunks(32768) {
        let mut p = row.to_vec();
        elementwise::softmax(&mut p);
        after.push(p.iter().copied().fold(0f32, f32::max));
    }
    rows.push(Row {
        op: format!("confidence: softmax max over 32768 [{n} rows]"),
        before: err(&before, &c64),
        after: err(&after, &c64),
    });

    println!(
        "LLaDA-shaped model (d_model 512, 8 layers, 8 heads, MLP 1536, vocab 32768), q/k x{}, head x{}, {n}-row canvas ({prompt} prompt tokens), seed {}.\n",
        a.qk_scale, a.head_scale, a.seed
    );
    println!(
        "End to end, float32 kernels against float64: logits {:.2e} of their range (worst element {:.2e}); confidences max |diff| {conf_err:.2e}.\n",
        logits.0, logits.1
    );
    println!("| operation | candle f32: error / worst element | CPU kernels f32: error / worst element |");
    println!("|---|---:|---:|");
    for r in rows {
        println!(
            "| {} | {:.2e} / {:.2e} | {:.2e} / {:.2e} |",
            r.op, r.before.0, r.before.1, r.after.0, r.after.1
        );
    }
    Ok(())
}
