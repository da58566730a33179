//! bf16 weight storage (`--weight-dtype bf16`: weights rounded once to bfloat16, arithmetic in
//! float32) and bf16 products (`--weight-dtype bf16-dot`: activations rounded to bfloat16 at
//! every product too, float32 accumulation) against float32 weights on every family's fixture:
//! the logits' largest difference, absolute and relative to the largest logit; and int8
//! weights (`--weight-dtype int8`: per-channel scales) and q4 weights (`--weight-dtype q4`:
//! 4 bits, a scale per channel and group of 32), float32 arithmetic; and the GGUF block formats
//! (`export_gguf` in F16, Q8_0, Q6_K, Q4_K, Q4_0, read back into float32). Run with `--nocapture` to see the figures
//! (docs/benchmarks.md quotes them).

mod support;

use anyhow::Result;
use candle_core::{DType, Tensor};
use support::max_abs_diff;
use wavefront_models::device::test_device;
use wavefront_models::diffusion_gemma::DgSeq;
use wavefront_models::gguf::GgufQuant;
use wavefront_models::transformer::{MaskRule, SeqInput, StoreWeights, WeightDtype};
use wavefront_models::{
    Armt, ArmtConfig, CacheStrategy, DiffusionGemma, DiffusionGemmaConfig, Huginn, HuginnCache,
    HuginnConfig, Llada, LladaConfig, ModelFiles, Qwen3, Qwen3Config, SeqRows,
};

/// bf16 keeps 8 bits of mantissa; through the fixtures' few layers the logits move by well
/// under this fraction of their range with bf16 weights, and under twice it with the
/// activations rounded at every product too (`bf16-dot`).
const MAX_RELATIVE: f32 = 0.03;

fn files(name: &str) -> Result<ModelFiles> {
    Ok(ModelFiles::from_dir(
        wavefront_models::device::test_fixture(name),
    )?)
}

/// How many [`MAX_RELATIVE`]s a storage may move the logits: bf16 weights 1; bf16 products 2
/// (the activations rounded too); int8 weights 5 (a channel's small weights quantised against
/// its largest: LLaDA's fixture, the most sensitive, moves 9% where bf16 weights move 2%);
/// int8 products 8 (each row's activations quantised too).
fn allowance(family: &str) -> f32 {
    if family.contains("GGUF-Q8_0") || family.contains("GGUF-Q6_K") {
        // ggml's blocks of 32 (Q8_0) and 16 (Q6_K) values with a scale each: like int8.
        5.0
    } else if family.contains("GGUF-F16") {
        1.0
    } else if family.contains("Q4") {
        // 4 bits: a step 18 times int8's (groups of 32 recover some of it). These random-weight
        // fixtures amplify it through their layers (24-64% of the largest logit); the bound
        // only catches a broken path (NaN, a wrong scale).
        50.0
    } else if family.contains("Int8Dot") {
        // The activations quantised to 8 bits per row too (LLaDA's fixture moves 15.5%).
        8.0
    } else if family.contains("Int8") {
        5.0
    } else if family.contains("Dot") {
        2.0
    } else {
        1.0
    }
}

/// Every storage compared with float32.
const STORAGES: [WeightDtype; 6] = [
    WeightDtype::Bf16,
    WeightDtype::Bf16Dot,
    WeightDtype::Int8,
    WeightDtype::Int8Dot,
    WeightDtype::Q4,
    WeightDtype::Q4Dot,
];

/// The GGUF block formats compared with float32: the model exported with
/// `ModelFiles::export_gguf` and read back into float32 storage. The k-quants are left out:
/// the fixtures' rows (64 and 128 inputs) do not split into their 256-value blocks, so they
/// would be written as Q8_0 (the trained models have them, docs/benchmarks.md).
const GGUF_FORMATS: [GgufQuant; 3] = [GgufQuant::F16, GgufQuant::Q8_0, GgufQuant::Q4_0];

/// `files` exported to a GGUF file in `quant` and opened again.
fn through_gguf(name: &str, files: &ModelFiles, quant: GgufQuant) -> Result<ModelFiles> {
    let dir = std::env::temp_dir().join(format!("wavefront-precisions-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{name}-{}.gguf", quant.name()));
    files.export_gguf(&path, quant)?;
    let back = ModelFiles::open(&path)?;
    std::fs::remove_file(&path)?;
    Ok(back)
}

/// Every storage and GGUF format to compare with float32, with its label.
fn variants(name: &str, files: &ModelFiles) -> Result<Vec<(String, ModelFiles, WeightDtype)>> {
    let mut v: Vec<_> = STORAGES
        .iter()
        .map(|&d| (format!("{d:?}"), files.clone(), d))
        .collect();
    for quant in GGUF_FORMATS {
        let label = format!("GGUF-{}", quant.name().to_uppercase());
        v.push((label, through_gguf(name, files, quant)?, WeightDtype::F32));
    }
    Ok(v)
}

/// [`compare`] of `logits` under every storage and GGUF format against float32's.
fn compare_all(
    family: &str,
    files: &ModelFiles,
    logits: impl Fn(&ModelFiles, WeightDtype) -> Result<Tensor>,
) -> Result<()> {
    let exact = logits(files, WeightDtype::F32)?;
    for (label, f, dtype) in variants(family, files)? {
        compare(&format!("{family} {label}"), &exact, &logits(&f, dtype)?)?;
    }
    Ok(())
}

fn compare(family: &str, f32_logits: &Tensor, bf16_logits: &Tensor) -> Result<()> {
    let diff = max_abs_diff(f32_logits, bf16_logits)?;
    let scale = f32_logits.abs()?.max_all()?.to_scalar::<f32>()?;
    eprintln!(
        "{family}: logits max |diff| {diff:.3e} (largest |logit| {scale:.3}, relative {:.2e})",
        diff / scale
    );
    anyhow::ensure!(
        diff <= MAX_RELATIVE * scale * allowance(family),
        "{family}: bf16 weights moved the logits by {diff} of {scale}"
    );

    Ok(())
}

/// Every family's logits with bf16 weights stay close to float32's.
#[test]
fn bf16_weights_stay_close_to_f32_on_every_fixture() -> Result<()> {
    let device = test_device();
    if !device.is_cpu() {
        eprintln!("bf16 weight storage is a CPU option; skipped on {device:?}");
        return Ok(());
    }
    let ids: Vec<u32> = (1..17).collect();

    // Huginn: prelude, 4 recurrences from a zero state, coda and head.
    let f = files("huginn")?;
    let cfg = HuginnConfig::from_json(f.config_json())?;
    let huginn = |f: &ModelFiles, dtype: WeightDtype| -> Result<Tensor> {
        let mut m = Huginn::load(f.var_builder(DType::F32, &device)?, cfg.clone())?;
        m.store_weights(dtype)?;
        let mut cache = HuginnCache::new(CacheStrategy::Full);
        let n = ids.len();
        let e = m.prelude(&m.embed(&ids)?, &mut [SeqRows::new(&mut cache, 0, n)])?;
        let mut s = Tensor::zeros(e.dims(), DType::F32, &device)?;
        for r in 0..4 {
            s = m.core_step(
                &s,
                &e,
                &mut [SeqRows::new(&mut cache, 0, n).at_recurrence(r)],
            )?;
        }
        Ok(m.predict_from_latents(&s, &mut [SeqRows::new(&mut cache, 0, n)])?)
    };
    compare_all("huginn", &f, huginn)?;

    // LLaDA: the bidirectional forward and head.
    let f = files("llada")?;
    let cfg = LladaConfig::from_json(f.config_json())?;
    let llada = |f: &ModelFiles, dtype: WeightDtype| -> Result<Tensor> {
        let mut m = Llada::load(f.var_builder(DType::F32, &device)?, cfg.clone())?;
        m.store_weights(dtype)?;
        let h = m.forward(&ids, &mut [SeqInput::dense(ids.len())])?;
        Ok(m.logits(&h)?)
    };
    compare_all("llada", &f, llada)?;

    // ReFusion's Qwen3: a causal forward and head.
    let f = files("refusion")?;
    let cfg = Qwen3Config::from_json(f.config_json())?;
    let qwen = |f: &ModelFiles, dtype: WeightDtype| -> Result<Tensor> {
        let mut m = Qwen3::load(f.var_builder(DType::F32, &device)?, cfg.clone())?;
        m.store_weights(dtype)?;
        let h = m.forward(
            &ids,
            &mut [SeqInput::dense(ids.len()).with_mask(MaskRule::Causal)],
        )?;
        Ok(m.logits(&h)?)
    };
    compare_all("refusion", &f, qwen)?;

    // ARMT: several segments with memory, sequentially.
    let f = files("armt")?;
    let armt_json = f
        .armt_config_json()
        .ok_or_else(|| anyhow::anyhow!("armt_config.json"))?;
    let cfg = ArmtConfig::from_json(f.config_json(), armt_json)?;
    let long: Vec<u32> = (0..40).map(|i| 1 + i % 60).collect();
    let armt = |f: &ModelFiles, dtype: WeightDtype| -> Result<Tensor> {
        let mut m = Armt::load(f.var_builder(DType::F32, &device)?, cfg.clone())?;
        m.store_weights(dtype)?;
        Ok(m.forward_sequential(&long)?.logits)
    };
    compare_all("armt", &f, armt)?;

    // DiffusionGemma: the encoder over the prompt, then a denoising step over its cache.
    let f = files("diffusion_gemma")?;
    let cfg = DiffusionGemmaConfig::from_json(f.config_json())?;
    let dg = |f: &ModelFiles, dtype: WeightDtype| -> Result<Tensor> {
        let mut m = DiffusionGemma::load(f.var_builder(DType::F32, &device)?, cfg.clone())?;
        m.store_weights(dtype)?;
        let mut cache = wavefront_models::transformer::KvCache::new();
        m.forward(&mut [DgSeq::encode(ids.clone(), 0, &mut cache)])?;
        let h = m.forward(&mut [DgSeq::denoise(
            (20..36).collect(),
            ids.len(),
            None,
            &mut cache,
        )])?;
        Ok(m.logits(&h)?)
    };
    // A mixture of experts routes discontinuously: a rounding can flip a row's expert (under
    // bf16-dot one row of 16 in two of the three layers here, the fixture's smallest router
    // gap being 5e-5), and that row's logits move by whole units. The rows' median is bounded
    // like the dense families' maximum; the maximum is reported.
    let exact = dg(&f, WeightDtype::F32)?;
    let scale = exact.abs()?.max_all()?.to_scalar::<f32>()?;
    for (label, files, dtype) in variants("diffusion_gemma", &f)? {
        let got = dg(&files, dtype)?;
        let mut rows: Vec<f32> = (&exact - &got)?
            .abs()?
            .max_keepdim(1)?
            .flatten_all()?
            .to_vec1()?;
        rows.sort_by(f32::total_cmp);
        let (median, max) = (rows[rows.len() / 2], rows[rows.len() - 1]);
        eprintln!(
            "diffusion_gemma {label}: logits per-row max |diff| median {median:.3e}, max \
             {max:.3e} (largest |logit| {scale:.3}, relative {:.2e} / {:.2e})",
            median / scale,
            max / scale
        );
        anyhow::ensure!(
            median <= 2.0 * MAX_RELATIVE * scale * allowance(&label),
            "diffusion_gemma {label}: the median row moved by {median} of {scale}"
        );
    }
    Ok(())
}

/// bf16 K/V pages (`--kv-cache-dtype bf16`, the default under `--dtype bf16`) against float32
/// pages, with float32 weights and with bf16 products, on the fixtures whose forwards read a
/// cache: Huginn (a prefill, four recurrences and one decoded position over the per-recurrence
/// caches), ReFusion's Qwen3 (a prefill and one decoded position over its cache) and
/// DiffusionGemma (a denoising step over the encoder's cache).
#[test]
fn bf16_kv_pages_stay_close_to_f32_pages() -> Result<()> {
    use wavefront_models::transformer::{Keys, KvCache, KvPool, PAGE_SIZE};
    let device = test_device();
    if !device.is_cpu() {
        eprintln!("bf16 K/V pages are a CPU option; skipped on {device:?}");
        return Ok(());
    }
    let pool = |bf16: bool| KvPool::private_storing(PAGE_SIZE, bf16.then_some(DType::BF16));
    let ids: Vec<u32> = (1..17).collect();
    let run = |family: &str, logits: &dyn Fn(WeightDtype, bool) -> Result<Tensor>| -> Result<()> {
        for dtype in [WeightDtype::F32, WeightDtype::Bf16Dot] {
            let exact = logits(dtype, false)?;
            let label = format!("{family} {dtype:?} bf16 K/V");
            compare(&label, &exact, &logits(dtype, true)?)?;
        }
        Ok(())
    };

    let f = files("huginn")?;
    let cfg = HuginnConfig::from_json(f.config_json())?;
    let h = Huginn::load(f.var_builder(DType::F32, &device)?, cfg.clone())?;
    let huginn = |dtype: WeightDtype, bf16: bool| -> Result<Tensor> {
        let mut m = h.clone();
        m.store_weights(dtype)?;
        let mut cache = HuginnCache::in_pool(CacheStrategy::Full, pool(bf16));
        let mut out = None;
        // The prompt, then one more position over the cached keys.
        for (start, n) in [(0, ids.len() - 1), (ids.len() - 1, 1)] {
            let e = m.prelude(
                &m.embed(&ids[start..start + n])?,
                &mut [SeqRows::new(&mut cache, start, n)],
            )?;
            let mut s = Tensor::zeros(e.dims(), DType::F32, &device)?;
            for r in 0..4 {
                s = m.core_step(
                    &s,
                    &e,
                    &mut [SeqRows::new(&mut cache, start, n).at_recurrence(r)],
                )?;
            }
            out = Some(m.predict_from_latents(&s, &mut [SeqRows::new(&mut cache, start, n)])?);
        }
        Ok(out.expect("two calls"))
    };
    run("huginn", &huginn)?;

    let f = files("refusion")?;
    let cfg = Qwen3Config::from_json(f.config_json())?;
    let q = Qwen3::load(f.var_builder(DType::F32, &device)?, cfg.clone())?;
    let qwen = |dtype: WeightDtype, bf16: bool| -> Result<Tensor> {
        let mut m = q.clone();
        m.store_weights(dtype)?;
        let mut cache = KvCache::in_pool(pool(bf16));
        // The prompt, then one more position over the cached keys.
        let t = ids.len() - 1;
        let mut h = None;
        for rows in [0..t, t..t + 1] {
            let index: Vec<u32> = rows.clone().map(|r| r as u32).collect();
            let mut seqs = [SeqInput {
                positions: index.clone(),
                index,
                mask: MaskRule::Causal,
                keys: Keys::Buffer {
                    cache: &mut cache,
                    len: rows.end,
                },
            }];
            h = Some(m.forward(&ids[rows], &mut seqs)?);
        }
        Ok(m.logits(&h.expect("two calls"))?)
    };
    run("refusion", &qwen)?;

    let f = files("diffusion_gemma")?;
    let cfg = DiffusionGemmaConfig::from_json(f.config_json())?;
    let g = DiffusionGemma::load(f.var_builder(DType::F32, &device)?, cfg.clone())?;
    let dg = |dtype: WeightDtype, bf16: bool| -> Result<Tensor> {
        let mut m = g.clone();
        m.store_weights(dtype)?;
        let mut cache = KvCache::in_pool(pool(bf16));
        m.forward(&mut [DgSeq::encode(ids.clone(), 0, &mut cache)])?;
        let h = m.forward(&mut [DgSeq::denoise(
            (20..36).collect(),
            ids.len(),
            None,
            &mut cache,
        )])?;
        Ok(m.logits(&h)?)
    };
    run("diffusion_gemma", &dg)?;
    Ok(())
}
