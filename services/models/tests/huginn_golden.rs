//! Golden tests of the Huginn model against outputs of the upstream PyTorch code
//! (tests/fixtures/huginn, see its README).

mod common;

use std::collections::HashMap;

use anyhow::{Context, Result};
use candle_core::{DType, IndexOp, Tensor};
use common::{assert_close, fixture_dir, load_model, Golden};
use wavefront_models::device::{test_device, test_parallel};
use wavefront_models::{
    detect_family, CacheStrategy, Huginn, HuginnCache, HuginnConfig, ModelFamily, ModelFiles,
    SeqRows, TextTokenizer,
};

/// The upstream forward, also with every block split over 2 and 4 in-process tensor-parallel
/// ranks (heads and MLP columns; partials summed), within the same tolerance.
#[test]
fn forward_matches_upstream() -> Result<()> {
    let golden = Golden::load()?;
    let files = ModelFiles::from_dir(fixture_dir())?;
    check_forward(&golden, &load_model(&files)?)?;
    // One rank through the collective (NCCL under WAVEFRONT_TEST_COLLECTIVE=nccl), 2 and 4 split.
    for world in [1, 2, 4] {
        let Some(tp) = test_parallel(world) else {
            continue;
        };
        let cfg = HuginnConfig::from_json(files.config_json())?;
        let vb = files.var_builder(DType::F32, &test_device())?;
        let model = Huginn::load_parallel(vb, cfg, &tp)?;
        check_forward(&golden, &model).with_context(|| format!("{world} ranks"))?;
    }
    Ok(())
}

fn check_forward(golden: &Golden, model: &Huginn) -> Result<()> {
    let ids = golden.prompt_ids();
    let n = ids.len();
    let mut cache = HuginnCache::new(CacheStrategy::Full);

    let emb = model.embed(&ids)?;
    let e = model.prelude(&emb, &mut [SeqRows::new(&mut cache, 0, n)])?;
    assert_close(
        "prelude_out",
        &e,
        golden.tensor("forward.prelude_out")?,
        1e-4,
    )?;

    let core_states = golden.tensor("forward.core_states_steps1to4")?;
    let mut state = golden.tensor("forward.init_state")?.clone();
    for step in 1..=16usize {
        let mut seqs = [SeqRows::new(&mut cache, 0, n).at_recurrence(step - 1)];
        state = model.core_step(&state, &e, &mut seqs)?;
        if step <= 4 {
            assert_close(
                &format!("core state {step}"),
                &state,
                &core_states.i(step - 1)?,
                1e-4,
            )?;
        }
        if [1, 4, 16].contains(&step) {
            let latent = model.latent(&state)?;
            assert_close(
                &format!("steps{step}.latent"),
                &latent,
                golden.tensor(&format!("forward.steps{step}.latent"))?,
                1e-4,
            )?;
            let logits =
                model.predict_from_latents(&state, &mut [SeqRows::new(&mut cache, 0, n)])?;
            assert_close(
                &format!("steps{step}.logits"),
                &logits,
                golden.tensor(&format!("forward.steps{step}.logits"))?,
                1e-4,
            )?;
            let argmax: Vec<u32> = logits.argmax(1)?.to_vec1()?;
            let want: Vec<u32> = serde_json::from_value(
                golden.json["cases"]["forward"][format!("steps{step}")]["argmax"].clone(),
            )?;
            assert_eq!(argmax, want, "steps{step} argmax");
        }
    }
    Ok(())
}

#[test]
fn zero_state_forward_matches_upstream() -> Result<()> {
    let golden = Golden::load()?;
    let model = load_model(&ModelFiles::from_dir(fixture_dir())?)?;
    let ids = golden.prompt_ids();
    let n = ids.len();
    let mut cache = HuginnCache::new(CacheStrategy::Full);
    let e = model.prelude(&model.embed(&ids)?, &mut [SeqRows::new(&mut cache, 0, n)])?;
    let mut state = Tensor::zeros((n, model.config().n_embd), DType::F32, &test_device())?;
    for r in 0..4 {
        state = model.core_step(
            &state,
            &e,
            &mut [SeqRows::new(&mut cache, 0, n).at_recurrence(r)],
        )?;
    }
    let logits = model.predict_from_latents(&state, &mut [SeqRows::new(&mut cache, 0, n)])?;
    assert_close(
        "zero_state.steps4.logits",
        &logits,
        golden.tensor("forward.zero_state.steps4.logits")?,
        1e-4,
    )
}

/// Runs prefill + `steps` recurrences + head for several sequences in one packed call each.
/// `seqs`: (cache, start, ids, init state rows, recurrences).
fn run_packed(
    model: &Huginn,
    seqs: &mut [(&mut HuginnCache, usize, Vec<u32>, Tensor, usize)],
) -> Result<Vec<Tensor>> {
    let ids: Vec<u32> = seqs.iter().flat_map(|s| s.2.clone()).collect();
    let emb = model.embed(&ids)?;
    let mut rows: Vec<SeqRows> = seqs
        .iter_mut()
        .map(|(cache, start, ids, _, _)| SeqRows::new(cache, *start, ids.len()))
        .collect();
    let e = model.prelude(&emb, &mut rows)?;
    drop(rows);
    let lens: Vec<usize> = seqs.iter().map(|s| s.2.len()).collect();
    let offsets: Vec<usize> = lens
        .iter()
        .scan(0, |acc, l| {
            let o = *acc;
            *acc += l;
            Some(o)
        })
        .collect();
    let mut states: Vec<Tensor> = seqs.iter().map(|s| s.3.clone()).collect();
    let max_steps = seqs.iter().map(|s| s.4).max().unwrap_or(0);
    for r in 0..max_steps {
        // Only the sequences that still iterate take part in this call.
        let active: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].4 > r).collect();
        let st = Tensor::cat(
            &active
                .iter()
                .map(|&i| states[i].clone())
                .collect::<Vec<_>>(),
            0,
        )?;
        let inj = Tensor::cat(
            &active
                .iter()
                .map(|&i| e.narrow(0, offsets[i], lens[i]))
                .collect::<Result<Vec<_>, _>>()?,
            0,
        )?;
        let mut rows: Vec<SeqRows> = seqs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| active.contains(i))
            .map(|(_, (cache, start, ids, _, _))| {
                SeqRows::new(cache, *start, ids.len()).at_recurrence(r)
            })
            .collect();
        let out = model.core_step(&st, &inj, &mut rows)?;
        let mut off = 0;
        for &i in &active {
            states[i] = out.narrow(0, off, lens[i])?;
            off += lens[i];
        }
    }
    let st = Tensor::cat(&states, 0)?;
    let mut rows: Vec<SeqRows> = seqs
        .iter_mut()
        .map(|(cache, start, ids, _, _)| SeqRows::new(cache, *start, ids.len()))
        .collect();
    let logits = model.predict_from_latents(&st, &mut rows)?;
    Ok(offsets
        .iter()
        .zip(&lens)
        .map(|(&o, &l)| logits.narrow(0, o, l))
        .collect::<Result<Vec<_>, _>>()?)
}

#[test]
fn packing_is_batch_invariant() -> Result<()> {
    let golden = Golden::load()?;
    let model = load_model(&ModelFiles::from_dir(fixture_dir())?)?;
    let init = golden.tensor("forward.init_state")?;
    let a_ids = golden.prompt_ids();
    let b_ids: Vec<u32> = vec![480, 17, 250, 99, 305, 64, 12];
    let a_init = init.clone();
    let b_init = (init.narrow(0, 2, 7)? * 0.5)?;
    let row = |t: &Tensor, i: usize| t.narrow(0, i, 1);

    for strategy in ["full", "latest-m4-compress-s4"] {
        let strategy: CacheStrategy = strategy.parse()?;
        // Alone.
        let (mut ca, mut cb) = (HuginnCache::new(strategy), HuginnCache::new(strategy));
        let la = run_packed(
            &model,
            &mut [(&mut ca, 0, a_ids.clone(), a_init.clone(), 4)],
        )?;
        let lb = run_packed(
            &model,
            &mut [(&mut cb, 0, b_ids.clone(), b_init.clone(), 2)],
        )?;
        let la2 = run_packed(&model, &mut [(&mut ca, 12, vec![263], row(init, 3)?, 3)])?;
        let lb2 = run_packed(&model, &mut [(&mut cb, 7, vec![44], row(init, 5)?, 5)])?;
        // Packed together (b first, then a).
        let (mut pa, mut pb) = (HuginnCache::new(strategy), HuginnCache::new(strategy));
        let p1 = run_packed(
            &model,
            &mut [
                (&mut pb, 0, b_ids.clone(), b_init.clone(), 2),
                (&mut pa, 0, a_ids.clone(), a_init.clone(), 4),
            ],
        )?;
        let p2 = run_packed(
            &model,
            &mut [
                (&mut pa, 12, vec![263], row(init, 3)?, 3),
                (&mut pb, 7, vec![44], row(init, 5)?, 5),
            ],
        )?;
        assert_close("prefill a", &p1[1], &la[0], 1e-5)?;
        assert_close("prefill b", &p1[0], &lb[0], 1e-5)?;
        assert_close("decode a", &p2[0], &la2[0], 1e-5)?;
        assert_close("decode b", &p2[1], &lb2[0], 1e-5)?;
        assert_eq!((pa.len(), pb.len()), (13, 8));
    }
    Ok(())
}

/// A checkpoint sharded the Hugging Face way (`model.safetensors.index.json`
/// naming the shard of every tensor) loads to the same model.
#[test]
fn sharded_checkpoint_loads() -> Result<()> {
    let src = fixture_dir();
    let dir = std::env::temp_dir().join(format!("wavefront-sharded-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.join(f))?;
    }
    let tensors = candle_core::safetensors::load(src.join("model.safetensors"), &test_device())?;
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let half = names.len() / 2;
    let mut weight_map = serde_json::Map::new();
    for (shard, part) in [&names[..half], &names[half..]].into_iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", shard + 1);
        let subset: HashMap<String, Tensor> = part
            .iter()
            .map(|n| ((*n).clone(), tensors[*n].clone()))
            .collect();
        candle_core::safetensors::save(&subset, dir.join(&file))?;
        for n in part {
            weight_map.insert((*n).clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string())?;
    let files = ModelFiles::from_dir(&dir)?;
    assert_eq!(files.weight_files().len(), 2);
    let golden = Golden::load()?;
    let model = load_model(&files)?;
    let ids = golden.prompt_ids();
    let mut cache = HuginnCache::new(CacheStrategy::Full);
    let e = model.prelude(
        &model.embed(&ids)?,
        &mut [SeqRows::new(&mut cache, 0, ids.len())],
    )?;
    assert_close(
        "sharded prelude_out",
        &e,
        golden.tensor("forward.prelude_out")?,
        1e-4,
    )?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn embedded_checkpoint_loads() -> Result<()> {
    static CONFIG: &str = include_str!("../../../tests/fixtures/huginn/config.json");
    static WEIGHTS: &[u8] = include_bytes!("../../../tests/fixtures/huginn/model.safetensors");
    static TOKENIZER: &[u8] = include_bytes!("../../../tests/fixtures/huginn/tokenizer.json");
    let files = ModelFiles::from_embedded(CONFIG, WEIGHTS, TOKENIZER);
    assert_eq!(files.family()?, ModelFamily::RecurrentDepth);
    let golden = Golden::load()?;
    let model = load_model(&files)?;
    let ids = golden.prompt_ids();
    let mut cache = HuginnCache::new(CacheStrategy::Full);
    let e = model.prelude(
        &model.embed(&ids)?,
        &mut [SeqRows::new(&mut cache, 0, ids.len())],
    )?;
    assert_close(
        "embedded prelude_out",
        &e,
        golden.tensor("forward.prelude_out")?,
        1e-4,
    )?;
    assert_eq!(files.tokenizer()?.vocab_size(), 512);
    Ok(())
}

#[test]
fn checkpoint_tensor_list_matches_the_fixture() -> Result<()> {
    let files = ModelFiles::from_dir(fixture_dir())?;
    let cfg = wavefront_models::HuginnConfig::from_json(files.config_json())?;
    let stored =
        candle_core::safetensors::load(fixture_dir().join("model.safetensors"), &test_device())?;
    let mut want: Vec<(String, Vec<usize>)> = stored
        .iter()
        .filter(|(name, _)| name.as_str() != "freqs_cis")
        .map(|(name, t)| (name.clone(), t.dims().to_vec()))
        .collect();
    want.sort();
    let mut got = cfg.checkpoint_tensors();
    got.sort();
    assert_eq!(got, want);
    // A checkpoint built from the list loads.
    let tensors = got
        .iter()
        .map(|(name, shape)| {
            Ok((
                name.clone(),
                Tensor::zeros(shape.as_slice(), DType::F32, &test_device())?,
            ))
        })
        .collect::<Result<std::collections::HashMap<_, _>>>()?;
    let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &test_device());
    Huginn::load(vb, cfg)?;
    Ok(())
}

#[test]
fn family_detection() -> Result<()> {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("config.json"))?)?;
    assert_eq!(detect_family(&cfg)?, ModelFamily::RecurrentDepth);
    let llada = serde_json::json!({"model_type": "llada", "architectures": ["LLaDAModelLM"]});
    assert_eq!(detect_family(&llada)?, ModelFamily::MaskedDiffusion);
    assert!(detect_family(&serde_json::json!({"model_type": "gpt2"})).is_err());
    Ok(())
}

#[test]
fn tokenizer_matches_readme() -> Result<()> {
    let golden = Golden::load()?;
    let tok = TextTokenizer::from_file(fixture_dir().join("tokenizer.json"))?;
    let text = golden.json["prompt_text"].as_str().unwrap();
    let mut ids = tok.encode(text, true)?;
    assert_eq!(ids.last(), Some(&481), "trailing <|end_text|>");
    ids.pop();
    assert_eq!(ids, golden.prompt_ids());
    assert_eq!(
        ids,
        vec![480, 373, 402, 367, 305, 363, 441, 264, 337, 294, 407, 11]
    );
    assert_eq!(tok.token_to_id("<|begin_text|>"), Some(480));
    assert_eq!(tok.token_to_id("<|end_text|>"), Some(481));
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.decode(&ids, true)?, text);
    assert_eq!(tok.decode(&ids, false)?, format!("<|begin_text|>{text}"));

    // Streaming decode equals the full decode, including multi-byte characters split over
    // several byte-level tokens.
    for sample in [text, "Grüße, 世界 — ✓ done.", " leading  spaces\nand lines"] {
        let ids = tok.encode(sample, false)?;
        let mut dec = tok.incremental(true);
        let mut streamed = String::new();
        for &id in &ids {
            if let Some(delta) = dec.push(id)? {
                assert!(
                    !delta.contains('\u{FFFD}'),
                    "delta {delta:?} splits a character"
                );
                streamed.push_str(&delta);
            }
        }
        if let Some(rest) = dec.flush()? {
            streamed.push_str(&rest);
        }
        assert_eq!(streamed, tok.decode(&ids, true)?);
        assert_eq!(streamed, sample);
    }
    Ok(())
}

#[test]
fn bf16_forward_tracks_float32() -> Result<()> {
    // bf16 weights and activations (norms, RoPE and softmax in float32): logits stay close to the
    // float32 goldens and greedy choices with a clear margin agree.
    let golden = Golden::load()?;
    let files = ModelFiles::from_dir(fixture_dir())?;
    let cfg = wavefront_models::HuginnConfig::from_json(files.config_json())?;
    let model = Huginn::load(files.var_builder(DType::BF16, &test_device())?, cfg)?;
    assert_eq!(model.dtype(), DType::BF16);
    let ids = golden.prompt_ids();
    let n = ids.len();
    let mut cache = HuginnCache::new(CacheStrategy::Full);
    let e = model.prelude(&model.embed(&ids)?, &mut [SeqRows::new(&mut cache, 0, n)])?;
    let mut state = golden.tensor("forward.init_state")?.to_dtype(DType::BF16)?;
    for r in 0..4 {
        state = model.core_step(
            &state,
            &e,
            &mut [SeqRows::new(&mut cache, 0, n).at_recurrence(r)],
        )?;
    }
    let logits = model.predict_from_latents(&state, &mut [SeqRows::new(&mut cache, 0, n)])?;
    assert_eq!(logits.dtype(), DType::F32);
    let want = golden.tensor("forward.steps4.logits")?;
    let diff = common::max_abs_diff(&logits, want)?;
    let scale = want.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    eprintln!("bf16 steps4 logits: max |diff| {diff} (max |logit| {scale})");
    anyhow::ensure!(
        diff <= 0.05 * scale,
        "bf16 logits drift {diff} vs scale {scale}"
    );
    Ok(())
}
