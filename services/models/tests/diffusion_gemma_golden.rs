//! Golden tests of the DiffusionGemma model against outputs of the upstream transformers code
//! (tests/fixtures/diffusion_gemma, see its README): the encoder's hidden states, routers and
//! the cache it writes (sliding layers' last `sliding_window - 1` positions, full layers'
//! everything), the denoiser's hidden states, routers and soft-capped logits without and with
//! self-conditioning over that cache, expert-parallel ranks against one rank, and packing.

mod support;

use anyhow::{ensure, Result};
use candle_core::{DType, IndexOp, Tensor};
use support::{assert_close, with_each_attention, Golden};
use wavefront_models::device::test_device;
use wavefront_models::diffusion_gemma::{DgSeq, GemmaRouting, LayerType};
use wavefront_models::transformer::{KvCache, TensorParallel};
use wavefront_models::{DiffusionGemma, DiffusionGemmaConfig, ModelFiles};

/// The README's tolerances: logits, hidden states and K/V 1e-4, router weights 1e-5.
const ATOL: f32 = 1e-4;
const ROUTER: f32 = 1e-5;

fn model_with(tp: &TensorParallel) -> Result<DiffusionGemma> {
    let files = ModelFiles::from_dir(wavefront_models::device::test_fixture("diffusion_gemma"))?;
    let cfg = DiffusionGemmaConfig::from_json(files.config_json())?;
    Ok(DiffusionGemma::load_parallel(
        files.var_builder(DType::F32, &test_device())?,
        cfg,
        tp,
    )?)
}

/// A golden tensor without its batch dimension of one (the fixture keeps it on some tensors).
fn unbatch(t: &Tensor) -> Result<Tensor> {
    let lead = t.dims().first().copied();
    Ok(if lead == Some(1) && t.rank() > 2 {
        t.i(0)?
    } else {
        t.clone()
    })
}

fn model() -> Result<DiffusionGemma> {
    model_with(&TensorParallel::single())
}

/// Compares a layer's routing with upstream's `router.<mode>.layer<l>.call<c>` tensors.
fn check_routing(g: &Golden, what: &str, r: &GemmaRouting) -> Result<()> {
    let probs = g.tensor(&format!("router.{what}.probs"))?;
    let dev = probs.device();
    let rows = r.probs.len();
    let ours = Tensor::new(r.probs.concat(), dev)?.reshape(probs.shape())?;
    assert_close(&format!("{what} probs"), &ours, probs, ROUTER)?;
    let idx = g.ids(&format!("router.{what}.topk_index"))?;
    let ours_idx: Vec<u32> = r.experts.iter().flatten().map(|&e| e as u32).collect();
    ensure!(
        idx == ours_idx,
        "{what}: experts {ours_idx:?}, upstream {idx:?}"
    );
    let w = g.tensor(&format!("router.{what}.topk_weights"))?;
    let k = r.weights[0].len();
    let ours_w = Tensor::new(r.weights.concat(), dev)?.reshape((rows, k))?;
    assert_close(
        &format!("{what} weights"),
        &ours_w,
        &w.reshape((rows, k))?,
        ROUTER,
    )
}

#[test]
fn encoder_and_denoiser_match_upstream_with_and_without_self_conditioning() -> Result<()> {
    let g = Golden::load("diffusion_gemma")?;
    let prompt = g.ids("forward.input_ids")?;
    let canvas = g.ids("forward.canvas")?;
    with_each_attention(model, |m| {
        let cfg = m.config();
        let mut cache = KvCache::new();
        // The encoder over the prompt: hidden states, routers, the cache.
        let (states, routes) =
            m.forward_traced(&mut [DgSeq::encode(prompt.clone(), 0, &mut cache)])?;
        ensure!(states.len() == cfg.num_hidden_layers() + 1);
        for (i, s) in states.iter().enumerate() {
            let want = unbatch(g.tensor(&format!("forward.encoder_hidden_states.{i}"))?)?;
            assert_close(&format!("encoder hidden state {i}"), s, &want, ATOL)?;
        }
        let last = unbatch(g.tensor("forward.encoder_last_hidden_state")?)?;
        assert_close("encoder last hidden state", &states[3], &last, ATOL)?;
        for (l, r) in routes.iter().enumerate() {
            check_routing(&g, &format!("encoder.layer{l}.call0"), r)?;
            check_routing(&g, &format!("encoder.layer{l}.call1"), r)?;
        }
        ensure!(cache.len() == prompt.len());
        for l in 0..cfg.num_hidden_layers() {
            let (k, v) = cache.layer_kv(l)?;
            // `[1, kv heads, len, head_dim]` upstream.
            let as_ours = |t: &Tensor| -> Result<Tensor> {
                let (h, _, d) = k.dims3()?;
                Ok(t.reshape((h, t.elem_count() / (h * d), d))?)
            };
            let want_k = as_ours(g.tensor(&format!("forward.cache.layer{l}.keys"))?)?;
            let want_v = as_ours(g.tensor(&format!("forward.cache.layer{l}.values"))?)?;
            // Upstream's sliding layers keep the last `sliding_window - 1` positions only.
            let n = want_k.dim(1)?;
            if cfg.layer_types[l] == LayerType::SlidingAttention {
                ensure!(n == cfg.sliding_window - 1);
            }
            let from = prompt.len() - n;
            assert_close(
                &format!("layer {l} keys"),
                &k.narrow(1, from, n)?,
                &want_k,
                ATOL,
            )?;
            assert_close(
                &format!("layer {l} values"),
                &v.narrow(1, from, n)?,
                &want_v,
                ATOL,
            )?;
        }
        // The denoiser over the cache, without and with self-conditioning.
        let sc = unbatch(g.tensor("forward.self_conditioning_logits")?)?;
        for (call, soft, states_name, logits_name) in [
            (
                0,
                None,
                "forward.decoder_hidden_states",
                "forward.logits_no_sc",
            ),
            (
                1,
                Some(m.soft_embedding(&sc)?),
                "forward.with_sc.decoder_hidden_states",
                "forward.logits_with_sc",
            ),
        ] {
            let (states, routes) = m.forward_traced(&mut [DgSeq::denoise(
                canvas.clone(),
                prompt.len(),
                soft,
                &mut cache,
            )])?;
            for (i, s) in states.iter().enumerate() {
                let want = unbatch(g.tensor(&format!("{states_name}.{i}"))?)?;
                assert_close(
                    &format!("denoiser call {call} hidden state {i}"),
                    s,
                    &want,
                    ATOL,
                )?;
            }
            for (l, r) in routes.iter().enumerate() {
                check_routing(&g, &format!("decoder.layer{l}.call{call}"), r)?;
            }
            let logits = m.logits(states.last().expect("the final norm"))?;
            let want = unbatch(g.tensor(logits_name)?)?;
            assert_close(logits_name, &logits, &want, ATOL)?;
            let argmax: Vec<u32> = logits.argmax(1)?.to_vec1()?;
            let key = if call == 0 {
                "argmax_no_sc"
            } else {
                "argmax_with_sc"
            };
            let want: Vec<u32> = serde_json::from_value(g.json["forward"][key].clone())?;
            ensure!(argmax == want, "call {call}: argmax {argmax:?} vs {want:?}");
            // The denoiser never writes the encoded part of the cache.
            let (k, _) = cache.layer_kv(2)?;
            let want_k = g.tensor("forward.cache.layer2.keys")?;
            let want_k = want_k.reshape(k.narrow(1, 0, prompt.len())?.shape())?;
            assert_close(
                "full layer keys after the denoiser",
                &k.narrow(1, 0, prompt.len())?,
                &want_k,
                ATOL,
            )?;
        }
        Ok(())
    })
}

/// Experts split over 2 and 3 in-process ranks give the one-rank logits (up to summation
/// order), and a packed call of an encoder and a denoiser sequence gives each its alone rows.
#[test]
fn expert_parallel_ranks_and_packing_match_one_rank_alone() -> Result<()> {
    let g = Golden::load("diffusion_gemma")?;
    let prompt = g.ids("forward.input_ids")?;
    let canvas = g.ids("forward.canvas")?;
    let sc = unbatch(g.tensor("forward.self_conditioning_logits")?)?;
    let run = |m: &DiffusionGemma| -> Result<(Tensor, Tensor)> {
        let mut cache = KvCache::new();
        let enc = m.forward(&mut [DgSeq::encode(prompt.clone(), 0, &mut cache)])?;
        let h = m.forward(&mut [DgSeq::denoise(
            canvas.clone(),
            prompt.len(),
            Some(m.soft_embedding(&sc)?),
            &mut cache,
        )])?;
        Ok((enc, m.logits(&h)?))
    };
    let one = model()?;
    let (enc1, logits1) = run(&one)?;
    for world in [2, 3] {
        let m = model_with(&TensorParallel::local(world))?;
        let (enc, logits) = run(&m)?;
        assert_close(&format!("{world} ranks encoder"), &enc, &enc1, 1e-5)?;
        assert_close(&format!("{world} ranks logits"), &logits, &logits1, 1e-4)?;
    }
    // Packed: one request denoising its canvas over its cache while another encodes its prompt.
    let mut a = KvCache::new();
    one.forward(&mut [DgSeq::encode(prompt.clone(), 0, &mut a)])?;
    let mut b = KvCache::new();
    let soft = one.soft_embedding(&sc)?;
    let h = one.forward(&mut [
        DgSeq::denoise(canvas.clone(), prompt.len(), Some(soft), &mut a),
        DgSeq::encode(prompt.clone(), 0, &mut b),
    ])?;
    let logits = one.logits(&h.narrow(0, 0, canvas.len())?)?;
    assert_close("packed denoiser logits", &logits, &logits1, 1e-4)?;
    assert_close(
        "packed encoder rows",
        &h.narrow(0, canvas.len(), prompt.len())?,
        &enc1,
        1e-4,
    )?;
    Ok(())
}

/// The tokenizer's cases and the Gemma 4 chat template (`chat_template.jinja`, the
/// transformers-5 layout) give upstream's ids and rendering; the family is detected.
#[test]
fn tokenizer_chat_template_and_family_match_upstream() -> Result<()> {
    use wavefront_models::{Architecture, ChatMessage, ModelFamily};
    let files = ModelFiles::from_dir(wavefront_models::device::test_fixture("diffusion_gemma"))?;
    ensure!(files.architecture()? == Architecture::DiffusionGemma);
    ensure!(files.architecture()?.family() == ModelFamily::UniformDiffusion);
    let tok = files.tokenizer()?;
    let g = Golden::load("diffusion_gemma")?;
    let t = &g.json["tokenizer"];
    for case in t["cases"].as_array().expect("cases") {
        let text = case["text"].as_str().expect("text");
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone())?;
        ensure!(tok.encode(text, true)? == want, "{text:?}");
        let plain: Vec<u32> = serde_json::from_value(case["ids_no_special"].clone())?;
        ensure!(
            tok.encode(text, false)? == plain,
            "{text:?} without special tokens"
        );
    }
    let template = tok.chat_template().expect("chat_template.jinja is read");
    for chat in t["chat"].as_array().expect("chats") {
        let messages: Vec<ChatMessage> = chat["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| {
                ChatMessage::new(
                    m["role"].as_str().unwrap_or(""),
                    m["content"].as_str().unwrap_or(""),
                )
            })
            .collect();
        let rendered = template.render(&messages, true)?;
        ensure!(
            rendered == chat["rendered"].as_str().unwrap_or(""),
            "{rendered:?}"
        );
        let want: Vec<u32> = serde_json::from_value(chat["ids"].clone())?;
        ensure!(tok.encode_chat(&messages)? == want, "chat ids");
    }
    Ok(())
}

/// `checkpoint_tensors` lists exactly the fixture's tensors with their shapes (what the
/// benchmarks' random models are built from).
#[test]
fn checkpoint_tensors_are_the_checkpoints() -> Result<()> {
    let dir = wavefront_models::device::test_fixture("diffusion_gemma");
    let files = ModelFiles::from_dir(&dir)?;
    let cfg = DiffusionGemmaConfig::from_json(files.config_json())?;
    let weights =
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)?;
    let mut want: Vec<(String, Vec<usize>)> = weights
        .iter()
        .map(|(k, t)| (k.clone(), t.dims().to_vec()))
        .collect();
    want.sort();
    let mut got = cfg.checkpoint_tensors();
    got.sort();
    ensure!(got == want, "{got:?}\nvs\n{want:?}");
    Ok(())
}
