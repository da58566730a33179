//! Golden tests of the Dream model against outputs of the upstream PyTorch code
//! (tests/fixtures/dream, see its README): the forward's hidden states and logits (raw, and
//! shifted as the sampler reads them), packing invariance, the checkpoint layout, family
//! detection, and the tokenizer and chat template (each model test with both attention kernels).

mod support;

use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, IndexOp, Tensor};
use support::{assert_close, packing_atol, with_each_attention, Golden};
use wavefront_models::device::test_device;
use wavefront_models::transformer::SeqInput;
use wavefront_models::{detect_family, ChatMessage, Dream, DreamConfig, ModelFamily, ModelFiles};

fn fixture_dir() -> PathBuf {
    wavefront_models::device::test_fixture("dream")
}

fn model() -> Result<Dream> {
    let files = ModelFiles::from_dir(fixture_dir())?;
    let cfg = DreamConfig::from_json(files.config_json())?;
    Ok(Dream::load(
        files.var_builder(DType::F32, &test_device())?,
        cfg,
    )?)
}

/// The README's suggested tolerance for logits and hidden states.
const ATOL: f32 = 1e-4;

/// Logits rows read as the sampler reads them: position `j` from row `j - 1`, 0 from itself.
fn shifted(logits: &Tensor) -> Result<Tensor> {
    let n = logits.dim(0)?;
    let rows: Vec<u32> = (0..n).map(|j| Dream::prediction_row(j) as u32).collect();
    Ok(logits.index_select(&Tensor::new(rows.as_slice(), logits.device())?, 0)?)
}

#[test]
fn forward_matches_upstream() -> Result<()> {
    let golden = Golden::load("dream")?;
    with_each_attention(model, |model| {
        let ids = golden.ids("forward.input_ids")?;
        let n = ids.len();
        let states = model.forward_hidden_states(&ids, &mut [SeqInput::dense(n)])?;
        ensure!(states.len() == 3);
        for (i, s) in states.iter().enumerate() {
            let want = golden.tensor(&format!("forward.hidden_states.{i}"))?.i(0)?;
            assert_close(&format!("hidden_states.{i}"), s, &want, ATOL)?;
        }
        let logits = model.logits(&states[2])?;
        assert_close(
            "logits",
            &logits,
            &golden.tensor("forward.logits")?.i(0)?,
            ATOL,
        )?;
        let want_shifted = golden.tensor("forward.logits_shifted")?.i(0)?;
        assert_close("logits_shifted", &shifted(&logits)?, &want_shifted, ATOL)?;
        let argmax: Vec<u32> = logits.argmax(1)?.to_vec1()?;
        let want: Vec<u32> = serde_json::from_value(golden.json["forward"]["argmax"].clone())?;
        assert_eq!(argmax, want);
        let argmax: Vec<u32> = shifted(&logits)?.argmax(1)?.to_vec1()?;
        let want: Vec<u32> =
            serde_json::from_value(golden.json["forward"]["argmax_shifted"].clone())?;
        assert_eq!(argmax, want);
        let hidden = model.forward(&ids, &mut [SeqInput::dense(n)])?;
        assert_close("forward", &hidden, &states[2], 0.0)?;
        Ok(())
    })
}

/// The logits the sampler saw at the first and last step of a run, from the canvas of that
/// step (the prompt, then the history before the step).
#[test]
fn sampler_logits_match_upstream_at_the_first_and_last_step() -> Result<()> {
    let golden = Golden::load("dream")?;
    let model = model()?;
    let run = "run.entropy.chat.n32.s16";
    let history = golden.tensor(&format!("{run}.history"))?;
    let steps = history.dim(0)?;
    let output: Vec<u32> = golden.ids(&format!("{run}.output_ids"))?;
    let prompt_len = 50;
    let mut first = output[..prompt_len].to_vec();
    first.resize(output.len(), 479);
    let last: Vec<u32> = history.i((steps - 2, 0))?.to_dtype(DType::U32)?.to_vec1()?;
    for (canvas, step) in [(first, 0), (last, steps - 1)] {
        let n = canvas.len();
        let logits = model.logits(&model.forward(&canvas, &mut [SeqInput::dense(n)])?)?;
        let want = golden
            .tensor(&format!("{run}.step{step}.logits_shifted"))?
            .i(0)?;
        assert_close(&format!("step {step}"), &shifted(&logits)?, &want, ATOL)?;
    }
    Ok(())
}

#[test]
fn packed_sequences_match_their_own_forwards() -> Result<()> {
    let golden = Golden::load("dream")?;
    with_each_attention(model, |model| {
        let a = golden.ids("forward.input_ids")?;
        let b: Vec<u32> = golden.ids("run.maskgit_plus.text.n32.s32.output_ids")?;
        let alone_a = model.logits(&model.forward(&a, &mut [SeqInput::dense(a.len())])?)?;
        let alone_b = model.logits(&model.forward(&b, &mut [SeqInput::dense(b.len())])?)?;
        let ids: Vec<u32> = b.iter().chain(&a).copied().collect();
        let mut seqs = [SeqInput::dense(b.len()), SeqInput::dense(a.len())];
        let packed = model.logits(&model.forward(&ids, &mut seqs)?)?;
        // Exact up to 1e-5 on the CPU; on a GPU, the fixture's bound against upstream.
        let atol = packing_atol(&test_device(), 1e-5, ATOL);
        assert_close("b packed", &packed.narrow(0, 0, b.len())?, &alone_b, atol)?;
        assert_close(
            "a packed",
            &packed.narrow(0, b.len(), a.len())?,
            &alone_a,
            atol,
        )?;
        Ok(())
    })
}

#[test]
fn checkpoint_layout_and_family() -> Result<()> {
    let files = ModelFiles::from_dir(fixture_dir())?;
    assert_eq!(files.family()?, ModelFamily::MaskedDiffusion);
    let config: serde_json::Value = serde_json::from_str(files.config_json())?;
    assert_eq!(detect_family(&config)?, ModelFamily::MaskedDiffusion);
    let cfg = DreamConfig::from_json(files.config_json())?;
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
    Ok(())
}

#[test]
fn tokenizer_and_chat_template_match_upstream() -> Result<()> {
    let golden = Golden::load("dream")?;
    let tok = ModelFiles::from_dir(fixture_dir())?.tokenizer()?;
    for case in golden.json["tokenizer"]["cases"]
        .as_array()
        .context("cases")?
    {
        let text = case["text"].as_str().context("text")?;
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone())?;
        assert_eq!(tok.encode(text, false)?, want, "{text:?}");
        assert_eq!(tok.encode(text, true)?, want, "nothing is added: {text:?}");
    }
    for chat in golden.json["tokenizer"]["chat"]
        .as_array()
        .context("chat")?
    {
        let messages: Vec<ChatMessage> = chat["messages"]
            .as_array()
            .context("messages")?
            .iter()
            .map(|m| {
                ChatMessage::new(
                    m["role"].as_str().unwrap_or_default(),
                    m["content"].as_str().unwrap_or_default(),
                )
            })
            .collect();
        let generation = chat["add_generation_prompt"].as_bool().context("flag")?;
        let template = tok.chat_template().context("a chat template")?;
        let rendered = template.render(&messages, generation)?;
        assert_eq!(rendered, chat["rendered"].as_str().context("rendered")?);
        let want: Vec<u32> = serde_json::from_value(chat["ids"].clone())?;
        assert_eq!(tok.encode(&rendered, false)?, want);
        if generation {
            assert_eq!(tok.encode_chat(&messages)?, want);
        }
    }
    Ok(())
}
