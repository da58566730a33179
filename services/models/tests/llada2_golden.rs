//! Golden tests of the LLaDA2.0 model against outputs of the upstream PyTorch code
//! (tests/fixtures/llada2, see its README): the block-causal and the unmasked forward (hidden
//! states, logits), every MoE layer's router (input, logits, chosen experts in upstream's order,
//! weights), the K/V cache of finished blocks and a block read over it, tensor and expert
//! parallel ranks against one rank, the checkpoint layout, family detection and the tokenizer.

mod support;

use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, IndexOp, Tensor};
use support::{assert_close, with_each_attention, Golden};
use wavefront_models::device::test_device;
use wavefront_models::transformer::{Keys, KvCache, MaskRule, SeqInput, TensorParallel};
use wavefront_models::{Llada2, Llada2Config, ModelFamily, ModelFiles};

fn fixture_dir() -> PathBuf {
    wavefront_models::device::test_fixture("llada2")
}

fn model_with(tp: &TensorParallel) -> Result<Llada2> {
    let files = ModelFiles::from_dir(fixture_dir())?;
    let cfg = Llada2Config::from_json(files.config_json())?;
    Ok(Llada2::load_parallel(
        files.var_builder(DType::F32, &test_device())?,
        cfg,
        tp,
    )?)
}

fn model() -> Result<Llada2> {
    model_with(&TensorParallel::single())
}

/// The README's tolerances: logits 5e-4, hidden states and K/V 1e-4, router weights 1e-5.
const LOGITS: f32 = 5e-4;
const HIDDEN: f32 = 1e-4;

fn block_causal(n: usize) -> SeqInput<'static> {
    SeqInput::dense(n).with_mask(MaskRule::BlockCausal { block: 8 })
}

#[test]
fn block_causal_forward_and_routers_match_upstream() -> Result<()> {
    let golden = Golden::load("llada2")?;
    // The mask the golden used is the rule's.
    let allowed: Vec<Vec<u8>> = golden.tensor("forward.block_causal_allowed")?.to_vec2()?;
    for (q, row) in allowed.iter().enumerate() {
        for (k, &a) in row.iter().enumerate() {
            ensure!((a == 1) == MaskRule::BlockCausal { block: 8 }.allows(q, k));
        }
    }
    with_each_attention(model, |model| {
        let ids = golden.ids("forward.input_ids")?;
        let n = ids.len();
        let (states, routes) = model.forward_traced(&ids, &mut [block_causal(n)])?;
        ensure!(states.len() == 4);
        for (i, s) in states.iter().enumerate() {
            let want = golden.tensor(&format!("forward.block_causal.hidden_states.{i}"))?;
            assert_close(&format!("hidden_states.{i}"), s, want, HIDDEN)?;
        }
        let logits = model.logits(&states[3])?;
        assert_close(
            "logits",
            &logits,
            golden.tensor("forward.logits_block_causal")?,
            LOGITS,
        )?;
        let argmax: Vec<u32> = logits.argmax(1)?.to_vec1()?;
        let want: Vec<u32> =
            serde_json::from_value(golden.json["forward"]["argmax_block_causal"].clone())?;
        assert_eq!(argmax, want);
        ensure!(routes[0].is_none(), "layer 0 is dense");
        for l in [1usize, 2] {
            let (input, r) = routes[l].as_ref().context("a MoE layer")?;
            let p = format!("router.block_causal.layer{l}");
            assert_close(
                &format!("{p}.gate_input"),
                input,
                golden.tensor(&format!("{p}.gate_input"))?,
                HIDDEN,
            )?;
            let logits = Tensor::new(r.logits.clone(), &test_device())?;
            assert_close(
                &format!("{p}.logits"),
                &logits,
                golden.tensor(&format!("{p}.logits"))?,
                1e-4,
            )?;
            let want: Vec<Vec<i64>> = golden.tensor(&format!("{p}.topk_idx"))?.to_vec2()?;
            let got: Vec<Vec<i64>> = r
                .experts
                .iter()
                .map(|e| e.iter().map(|&x| x as i64).collect())
                .collect();
            ensure!(got == want, "layer {l} experts {got:?}\n upstream {want:?}");
            let w = Tensor::new(r.weights.clone(), &test_device())?;
            assert_close(
                &format!("{p}.topk_weight"),
                &w,
                golden.tensor(&format!("{p}.topk_weight"))?,
                1e-5,
            )?;
        }
        let hidden = model.forward(&ids, &mut [block_causal(n)])?;
        assert_close("forward", &hidden, &states[3], 0.0)?;
        Ok(())
    })
}

#[test]
fn unmasked_forward_matches_upstream() -> Result<()> {
    let golden = Golden::load("llada2")?;
    let model = model()?;
    let ids = golden.ids("forward.input_ids")?;
    let n = ids.len();
    let (states, routes) = model.forward_traced(&ids, &mut [SeqInput::dense(n)])?;
    let logits = model.logits(&states[3])?;
    assert_close(
        "logits_no_mask",
        &logits,
        golden.tensor("forward.logits_no_mask")?,
        LOGITS,
    )?;
    for l in [1usize, 2] {
        let want: Vec<Vec<i64>> = golden
            .tensor(&format!("router.no_mask.layer{l}.topk_idx"))?
            .to_vec2()?;
        let got: Vec<Vec<i64>> = routes[l]
            .as_ref()
            .context("MoE")?
            .1
            .experts
            .iter()
            .map(|e| e.iter().map(|&x| x as i64).collect())
            .collect();
        ensure!(got == want, "layer {l}");
    }
    Ok(())
}

/// Three finished blocks cached, then the fourth block read over them with every key allowed:
/// the cache holds upstream's K/V, and the block's logits are upstream's cached ones.
#[test]
fn finished_blocks_cached_give_upstreams_cache_and_block_logits() -> Result<()> {
    let golden = Golden::load("llada2")?;
    with_each_attention(model, |model| {
        let ids = golden.ids("forward.input_ids")?;
        let mut cache = KvCache::new();
        let prefix = block_causal(24).with_keys(Keys::Buffer {
            cache: &mut cache,
            len: 24,
        });
        let logits = model.logits(&model.forward(&ids[..24], &mut [prefix])?)?;
        assert_close(
            "prefix",
            &logits,
            golden.tensor("kvcache.logits_prefix")?,
            LOGITS,
        )?;
        for l in 0..3 {
            let (k, v) = cache.layer_kv(l)?;
            assert_close(
                &format!("layer {l} key"),
                &k,
                golden.tensor(&format!("kvcache.layer{l}.key"))?,
                HIDDEN,
            )?;
            assert_close(
                &format!("layer {l} value"),
                &v,
                golden.tensor(&format!("kvcache.layer{l}.value"))?,
                HIDDEN,
            )?;
        }
        let mut block = [SeqInput {
            index: (24..32).collect(),
            positions: (24..32).collect(),
            mask: MaskRule::Bidirectional,
            keys: Keys::Buffer {
                cache: &mut cache,
                len: 32,
            },
        }];
        let logits = model.logits(&model.forward(&ids[24..32], &mut block)?)?;
        assert_close(
            "block",
            &logits,
            golden.tensor("kvcache.logits_block")?,
            LOGITS,
        )?;
        let full = golden.tensor("forward.logits_block_causal")?.i(24..32)?;
        assert_close("block vs one call", &logits, &full, LOGITS)?;
        Ok(())
    })
}

/// Heads and dense columns split over ranks, experts by ranges (expert parallelism), shared
/// experts by columns: the one-rank logits and routes.
#[test]
fn expert_and_tensor_parallel_ranks_give_the_one_rank_logits() -> Result<()> {
    let golden = Golden::load("llada2")?;
    let ids = golden.ids("forward.input_ids")?;
    let n = ids.len();
    let one = model()?;
    let (states, routes) = one.forward_traced(&ids, &mut [block_causal(n)])?;
    let single = one.logits(&states[3])?;
    for world in [2, 4] {
        let Some(parallel) = wavefront_models::device::test_parallel(world) else {
            continue;
        };
        let tp = model_with(&parallel)?;
        let (s, r) = tp.forward_traced(&ids, &mut [block_causal(n)])?;
        assert_close(&format!("{world} ranks"), &tp.logits(&s[3])?, &single, 1e-4)?;
        for l in [1, 2] {
            ensure!(
                r[l].as_ref().map(|x| &x.1.experts) == routes[l].as_ref().map(|x| &x.1.experts),
                "{world} ranks route layer {l} differently"
            );
        }
    }
    // Three ranks split neither the heads nor the shared expert: refused by name.
    let err = model_with(&TensorParallel::local(3))
        .unwrap_err()
        .to_string();
    ensure!(err.contains("tensor_parallel"), "{err}");
    Ok(())
}

#[test]
fn checkpoint_layout_family_and_tokenizer() -> Result<()> {
    let golden = Golden::load("llada2")?;
    let files = ModelFiles::from_dir(fixture_dir())?;
    assert_eq!(files.family()?, ModelFamily::MaskedDiffusion);
    let cfg = Llada2Config::from_json(files.config_json())?;
    assert_eq!((cfg.rotary_dim(), cfg.head_dim()), (8, 16));
    let bytes = std::fs::read(fixture_dir().join("model.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let mut stored: Vec<(String, Vec<usize>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec()))
        .collect();
    stored.sort();
    let mut want = cfg.checkpoint_tensors();
    want.sort();
    assert_eq!(stored, want);
    let tok = files.tokenizer()?;
    for case in golden.json["tokenizer"]["cases"]
        .as_array()
        .context("cases")?
    {
        let text = case["text"].as_str().context("text")?;
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone())?;
        assert_eq!(tok.encode(text, false)?, want, "{text:?}");
    }
    // The chat prompt of the CHAT runs through the checkpoint's template.
    let chat = &golden.json["prompts"]["CHAT"];
    let messages: Vec<wavefront_models::ChatMessage> = chat["chat"]
        .as_array()
        .context("chat")?
        .iter()
        .map(|m| {
            wavefront_models::ChatMessage::new(
                m["role"].as_str().unwrap_or_default(),
                m["content"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    let want: Vec<u32> = serde_json::from_value(chat["ids"].clone())?;
    assert_eq!(tok.encode_chat(&messages)?, want);
    Ok(())
}
