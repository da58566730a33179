//! Golden tests of `block-diffusion` against the upstream fixture (tests/fixtures/llada2, see its
//! README): every run's forwards (the canvas each read, the window, the commits with their
//! confidences and the branch that chose them), its stop and its output, alone and all packed
//! into the same ticks; the served engine with continuous batching, stop tokens, canvas frames,
//! preemption under a small pool, and refused parameters.

use std::collections::HashMap;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, IndexOp, Tensor};
use serde_json::Value;
use wavefront_models::device::test_device;
use wavefront_models::{Llada2, Llada2Config, ModelFiles};

use super::{BdProgram, BlockDiffusionFamily, Llada2Planner};
use crate::request::{BlockDiffusionParams, GenerateSpec, SchemeParams};
use crate::served::Planner;
use crate::test_support::{run_to_end, spec};

struct Fixture {
    model: Llada2,
    planner: Llada2Planner,
    json: Value,
    tensors: HashMap<String, Tensor>,
}

fn fixture() -> Result<Fixture> {
    let dir = wavefront_models::device::test_fixture("llada2");
    let files = ModelFiles::from_dir(&dir)?;
    let cfg = Llada2Config::from_json(files.config_json())?;
    let model = Llada2::load(files.var_builder(DType::F32, &test_device())?, cfg.clone())?;
    let tok = files.tokenizer()?;
    let (mask, eos) = super::ids_from_files(&files, Some(&tok));
    Ok(Fixture {
        model,
        planner: Llada2Planner::new(cfg, "llada2".into(), DType::F32, mask, eos)?,
        json: serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json"))?)?,
        tensors: candle_core::safetensors::load(dir.join("golden.safetensors"), &test_device())?,
    })
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("token ids")
}

fn usizes(v: &Value) -> Vec<usize> {
    serde_json::from_value(v.clone()).expect("positions")
}

fn run_spec(run: &Value) -> Result<GenerateSpec> {
    let a = &run["args"];
    let mut s = spec(
        ids(&run["prompt_ids"]),
        a["gen_length"].as_u64().context("gen_length")? as usize,
        0,
        SchemeParams::BlockDiffusion(BlockDiffusionParams {
            block_length: a["block_length"].as_u64().context("block_length")? as usize,
            steps: a["steps"].as_u64().context("steps")? as usize,
            threshold: a["threshold"].as_f64().context("threshold")? as f32,
            minimal_topk: a["minimal_topk"].as_u64().context("minimal_topk")? as usize,
            eos_early_stop: a["eos_early_stop"].as_bool().context("eos_early_stop")?,
            upstream_sampler: run["sampler"].as_str().unwrap_or("").contains("upstream"),
        }),
    );
    if let Some(k) = a["top_k"].as_u64() {
        s.sampling.top_k = k as usize;
    }
    Ok(s)
}

fn program(fx: &Fixture, s: GenerateSpec) -> Result<BdProgram> {
    let mut p = fx.planner.prepare(s)?.program;
    p.record_steps();
    Ok(p)
}

/// The generated tokens a response carries: upstream's return without the prompt.
fn answer(run: &Value) -> Vec<u32> {
    let out = ids(&run["output_ids"]);
    if run["output_includes_prompt"].as_bool() == Some(true) {
        out[ids(&run["prompt_ids"]).len()..].to_vec()
    } else {
        out
    }
}

fn check(fx: &Fixture, run: &Value, p: &BdProgram) -> Result<()> {
    let name = run["name"].as_str().unwrap_or("?");
    let trace = run["trace"].as_array().context("trace")?;
    let steps = p.steps();
    ensure!(
        steps.len() == trace.len(),
        "{name}: {} forwards, upstream {}",
        steps.len(),
        trace.len()
    );
    let inputs: Vec<Vec<i64>> = fx
        .tensors
        .get(&format!("gen.{name}.step_input_ids"))
        .context("step inputs")?
        .to_vec2()?;
    for (i, (got, want)) in steps.iter().zip(trace).enumerate() {
        let w = want["window_end"].as_u64().context("window")? as usize;
        ensure!(
            got.window_end == w,
            "{name} forward {i}: window {}",
            got.window_end
        );
        ensure!(got.block as u64 == want["block"].as_u64().unwrap_or(u64::MAX));
        ensure!(got.step_in_block as u64 == want["step_in_block"].as_u64().unwrap_or(u64::MAX));
        let input: Vec<u32> = inputs[i][..w].iter().map(|&x| x as u32).collect();
        ensure!(
            got.input == input,
            "{name} forward {i}: canvas read differs"
        );
        ensure!(got.num_to_transfer as u64 == want["num_to_transfer"].as_u64().unwrap_or(0));
        ensure!(
            got.above_threshold as u64 == want["num_above_threshold"].as_u64().unwrap_or(0),
            "{name} forward {i}: {} above the threshold",
            got.above_threshold
        );
        ensure!(
            want["branch"].as_str() == Some(got.branch),
            "{name} forward {i}: branch"
        );
        let mut mine: Vec<(usize, u32, f32)> = got
            .committed
            .iter()
            .zip(&got.tokens)
            .zip(&got.confidence)
            .map(|((&p, &t), &c)| (p, t, c))
            .collect();
        let conf: Vec<f32> = serde_json::from_value(want["committed_confidence"].clone())?;
        let mut theirs: Vec<(usize, u32, f32)> = usizes(&want["committed_positions"])
            .into_iter()
            .zip(ids(&want["committed_tokens"]))
            .zip(conf)
            .map(|((p, t), c)| (p, t, c))
            .collect();
        mine.sort_by_key(|x| x.0);
        theirs.sort_by_key(|x| x.0);
        ensure!(
            mine.len() == theirs.len(),
            "{name} forward {i}: {mine:?} vs {theirs:?}"
        );
        // The README's 1e-5. On a GPU, a forward packed with other runs' rows is summed in
        // another order than alone (cuBLAS picks its kernel by row count): 1.07e-5 was measured
        // on an H200, so the bound there is 5e-5; positions and tokens stay exact.
        let tol = if test_device().is_cuda() { 5e-5 } else { 1e-5 };
        for (a, b) in mine.iter().zip(&theirs) {
            ensure!(
                a.0 == b.0 && a.1 == b.1,
                "{name} forward {i}: {mine:?} vs {theirs:?}"
            );
            ensure!(
                (a.2 - b.2).abs() <= tol,
                "{name} forward {i}: confidence {} vs {}",
                a.2,
                b.2
            );
        }
    }
    let final_canvas: Vec<u32> = fx
        .tensors
        .get(&format!("gen.{name}.final_canvas"))
        .context("final canvas")?
        .to_dtype(DType::U32)?
        .to_vec1()?;
    ensure!(
        p.canvas() == final_canvas.as_slice(),
        "{name}: final canvas differs"
    );
    Ok(())
}

fn runs(fx: &Fixture) -> Result<Vec<(Value, GenerateSpec)>> {
    fx.json["generate_runs"]
        .as_array()
        .context("runs")?
        .iter()
        .map(|r| Ok((r.clone(), run_spec(r)?)))
        .collect()
}

#[test]
fn every_run_matches_upstream_forward_by_forward() -> Result<()> {
    let fx = fixture()?;
    let runs = runs(&fx)?;
    ensure!(runs.len() == 12);
    for (r, s) in &runs {
        let mut p = vec![program(&fx, s.clone())?];
        run_to_end(BlockDiffusionFamily::new(fx.model.clone()), &mut p)?;
        check(&fx, r, &p[0])?;
    }
    Ok(())
}

#[test]
fn every_run_packed_into_the_same_ticks_matches_upstream() -> Result<()> {
    let fx = fixture()?;
    let runs = runs(&fx)?;
    let mut programs = runs
        .iter()
        .map(|(_, s)| program(&fx, s.clone()))
        .collect::<Result<Vec<_>>>()?;
    run_to_end(BlockDiffusionFamily::new(fx.model.clone()), &mut programs)?;
    for ((r, _), p) in runs.iter().zip(&programs) {
        check(&fx, r, p)?;
    }
    Ok(())
}

/// The first two forwards' block logits, through the cache of finished blocks.
#[test]
fn block_logits_of_the_first_forwards_match_upstream() -> Result<()> {
    let fx = fixture()?;
    let r = fx.json["generate_runs"]
        .as_array()
        .context("runs")?
        .iter()
        .find(|r| r["name"] == "A_bl8_s8_t0.95")
        .context("run")?;
    let inputs: Vec<Vec<i64>> = fx.tensors["gen.A_bl8_s8_t0.95.step_input_ids"].to_vec2()?;
    // Forward 0 reads x[:16] whole; forward 1 the same window after one commit.
    for step in 0..2 {
        let w = r["trace"][step]["window_end"].as_u64().context("w")? as usize;
        let canvas: Vec<u32> = inputs[step][..w].iter().map(|&x| x as u32).collect();
        let seq = wavefront_models::transformer::SeqInput::dense(w)
            .with_mask(wavefront_models::transformer::MaskRule::BlockCausal { block: 8 });
        let logits = fx.model.logits(&fx.model.forward(&canvas, &mut [seq])?)?;
        let want = &fx.tensors[&format!("gen.A_bl8_s8_t0.95.step{step}.block_logits")];
        let d = (logits.i(w - 8..w)? - want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        ensure!(d <= 5e-4, "forward {step}: logits max |diff| {d}");
    }
    Ok(())
}

#[test]
fn responses_are_upstreams_output_without_the_prompt() -> Result<()> {
    use crate::test_support::{collect, serve, submit};
    let fx = fixture()?;
    let dir = wavefront_models::device::test_fixture("llada2");
    let served = serve(ModelFiles::from_dir(&dir)?, "llada2", 16)?;
    assert_eq!(served.info().schemes, ["block-diffusion"]);
    let runs = runs(&fx)?;
    let receivers = runs
        .iter()
        .map(|(_, s)| submit(served.as_ref(), s.clone()))
        .collect::<Result<Vec<_>>>()?;
    for ((r, _), rx) in runs.iter().zip(receivers) {
        let out = collect(&rx, Vec::new())?;
        let want = answer(r);
        ensure!(
            out.tokens == want,
            "{}: {:?} vs {want:?}",
            r["name"],
            out.tokens
        );
        let forwards = r["n_forward_calls"].as_u64().context("calls")?;
        ensure!(
            out.stats.forward_passes == forwards,
            "{}: forwards",
            r["name"]
        );
        let stop = r["stop_reason"].as_str().unwrap_or("");
        let reason = if stop == "all_blocks" {
            wavefront_engine::FinishReason::Length
        } else {
            wavefront_engine::FinishReason::StopToken
        };
        ensure!(out.reason == reason, "{}: {:?}", r["name"], out.reason);
    }
    served.shutdown();
    Ok(())
}

fn bd(block_length: usize, steps: usize, threshold: f32) -> SchemeParams {
    SchemeParams::BlockDiffusion(BlockDiffusionParams {
        block_length,
        steps,
        threshold,
        ..BlockDiffusionParams::default()
    })
}

/// Sixteen requests with different prompts, lengths, blocks, steps, thresholds, sampling,
/// early stop and stop ids.
fn mixed_requests() -> Vec<GenerateSpec> {
    let p = |len: usize, salt: u32| -> Vec<u32> {
        (0..len as u32)
            .map(|i| (i * 37 + salt * 101 + 11) % 470)
            .collect()
    };
    let mut specs = vec![
        spec(p(11, 0), 32, 1, bd(8, 8, 0.95)),
        spec(p(16, 1), 24, 2, bd(8, 4, 0.7)),
        spec(p(3, 2), 16, 3, bd(16, 16, 0.9)),
        spec(p(30, 3), 20, 4, bd(4, 4, 0.8)),
        spec(p(7, 4), 32, 5, bd(16, 8, 0.5)),
        spec(p(9, 5), 12, 6, bd(8, 8, 1.0)),
        spec(p(20, 6), 40, 7, bd(8, 2, 0.95)),
        spec(p(1, 7), 8, 8, bd(8, 8, 0.6)),
    ];
    for i in 0..8 {
        let mut s = specs[i].clone();
        s.prompt_ids.push(100 + i as u32);
        s.sampling.seed = 50 + i as u64;
        if i % 2 == 0 {
            s.sampling.temperature = 0.8;
            s.sampling.top_k = 20;
        }
        if let SchemeParams::BlockDiffusion(b) = &mut s.scheme {
            b.eos_early_stop = i % 3 == 0;
        }
        if i == 5 {
            s.stop_token_ids = vec![260, 300];
        }
        specs.push(s);
    }
    specs
}

#[test]
fn requests_joining_a_running_batch_produce_what_they_produce_alone() -> Result<()> {
    use crate::test_support::{assert_joining_requests_match_alone, serve, wait_for_free_slots};
    let dir = wavefront_models::device::test_fixture("llada2");
    let served = serve(ModelFiles::from_dir(&dir)?, "llada2", 16)?;
    let mut specs = mixed_requests();
    specs[0].stream_canvas = true;
    let alone = assert_joining_requests_match_alone(served.as_ref(), &specs, |_| true)?;
    for (s, o) in specs.iter().zip(&alone) {
        ensure!(o.tokens.iter().all(|&t| t != 484), "a mask was streamed");
        crate::test_support::assert_ends_at_first_stop(s, o, 481)?;
    }
    ensure!(!alone[0].frames.is_empty());
    wait_for_free_slots(served.as_ref(), std::time::Duration::from_secs(10))?;
    served.shutdown();
    Ok(())
}

/// A pool of a few pages for sixteen requests: requests are preempted (their finished blocks'
/// K/V moved to host memory) and resumed in other pages, and each produces what it produces
/// alone with room to spare.
#[test]
fn requests_preempted_for_pages_produce_what_they_produce_alone() -> Result<()> {
    use crate::test_support::{assert_preempted_requests_match_alone, serve};
    let dir = wavefront_models::device::test_fixture("llada2");
    let roomy = serve(ModelFiles::from_dir(&dir)?, "llada2", 16)?;
    let pages = roomy.load().total_slots;
    let page_bytes = (256 << 20) / pages as u64;
    // The largest request (20 + 1 prompt tokens + 40 new in blocks of 8: 64 rows, 4 pages in
    // each of 3 layers) fits, a few together do not.
    let preemptions = assert_preempted_requests_match_alone(
        ModelFiles::from_dir(&dir)?,
        roomy.as_ref(),
        16 * page_bytes,
        &mixed_requests(),
    )?;
    ensure!(preemptions > 0, "16 pages for 16 requests must preempt");
    roomy.shutdown();
    Ok(())
}

#[test]
fn bad_parameters_are_refused_by_name() -> Result<()> {
    use crate::test_support::assert_invalid;
    let fx = fixture()?;
    let with = |f: fn(&mut BlockDiffusionParams)| {
        let mut p = BlockDiffusionParams::default();
        f(&mut p);
        spec(vec![1, 2, 3], 16, 0, SchemeParams::BlockDiffusion(p))
    };
    assert_invalid(
        &fx.planner,
        vec![
            (with(|p| p.block_length = 0), "block_diffusion.block_length"),
            (with(|p| p.steps = 0), "block_diffusion.steps"),
            (with(|p| p.minimal_topk = 0), "block_diffusion.minimal_topk"),
            (
                with(|p| p.minimal_topk = 17),
                "block_diffusion.minimal_topk",
            ),
            (with(|p| p.threshold = 1.5), "block_diffusion.threshold"),
            (
                with(|p| p.threshold = f32::NAN),
                "block_diffusion.threshold",
            ),
            (
                spec(vec![1], 8, 0, SchemeParams::Wino(Default::default())),
                "use `block-diffusion`",
            ),
        ],
    )?;
    Ok(())
}

/// A row budget of 16 a tick with blocks of 8: prompts of up to 60 tokens prefill in chunks of
/// whole blocks, and every request produces what it produces without a budget (forward passes
/// and rows per step aside: the chunks are forwards of their own). A request decoding when a
/// 200-token prompt arrives keeps streaming through that prompt's chunks.
#[test]
fn long_prompts_prefill_in_chunks_of_whole_blocks_without_changing_tokens() -> Result<()> {
    use crate::test_support::{assert_chunked_prefill_matches, serve};
    let dir = wavefront_models::device::test_fixture("llada2");
    let p = |len: usize, salt: u32| -> Vec<u32> {
        (0..len as u32)
            .map(|i| (i * 37 + salt * 101 + 11) % 470)
            .collect()
    };
    let specs = vec![
        spec(p(40, 0), 16, 1, bd(8, 8, 0.9)),
        spec(p(60, 1), 24, 2, bd(8, 4, 0.7)),
        spec(p(5, 2), 16, 3, bd(8, 8, 0.95)),
        spec(p(33, 3), 8, 4, bd(8, 8, 0.8)),
    ];
    let roomy = serve(ModelFiles::from_dir(&dir)?, "llada2", specs.len())?;
    assert_chunked_prefill_matches(
        ModelFiles::from_dir(&dir)?,
        roomy.as_ref(),
        16,
        &specs,
        (
            spec(p(200, 4), 8, 5, bd(8, 8, 0.9)),
            spec(p(6, 7), 64, 6, bd(8, 8, 1.0)),
            4,
        ),
        &["active_rows"],
    )?;
    roomy.shutdown();
    Ok(())
}

/// Every request of the mix, moved to a second engine of the same checkpoint after its first
/// event and back after its next (stopped at a step boundary, its state exported and resumed in
/// other slots), produces exactly what it produces alone: tokens, finish reason and every
/// statistic but timing, with its moves counted.
#[test]
fn requests_moved_between_workers_produce_what_they_produce_alone() -> Result<()> {
    let specs = mixed_requests();
    let served = crate::test_support::serve(
        ModelFiles::from_dir(wavefront_models::device::test_fixture("llada2"))?,
        "llada2",
        specs.len(),
    )?;
    crate::test_support::assert_moved_requests_match_alone(
        ModelFiles::from_dir(wavefront_models::device::test_fixture("llada2"))?,
        served.as_ref(),
        &specs,
    )?;
    served.shutdown();
    Ok(())
}

/// A fault in one request's plan, forward or commit fails that request only, beside another.
#[test]
fn an_injected_fault_fails_only_its_request() -> Result<()> {
    let fx = fixture()?;
    let runs = runs(&fx)?;
    crate::fault_tests::assert_faults_fail_only_their_request(
        || Ok(BlockDiffusionFamily::new(fx.model.clone())),
        || Ok(fx.planner.prepare(runs[0].1.clone())?.program),
        || Ok(fx.planner.prepare(runs[1].1.clone())?.program),
    )
}

/// `logprobs`, served: every streamed token's `exp(logprob)` is the confidence upstream
/// committed it with (the softmax probability of the argmax under LLaDA2.1's greedy fix; under
/// the unmodified sampler with top_k 1, the filtered draw's 1); the greedy token is its
/// distribution's most likely.
#[test]
fn logprobs_are_the_confidences_upstream_committed_with() -> Result<()> {
    let fx = fixture()?;
    let runs: Vec<(Value, GenerateSpec)> = runs(&fx)?
        .into_iter()
        .map(|(r, mut s)| {
            s.sampling.logprobs = Some(3);
            (r, s)
        })
        .collect();
    let specs: Vec<GenerateSpec> = runs.iter().map(|(_, s)| s.clone()).collect();
    let files = ModelFiles::from_dir(wavefront_models::device::test_fixture("llada2"))?;
    let outcomes =
        crate::test_support::served_outcomes(files, crate::LoadOptions::default(), &specs)?;
    for ((run, spec), out) in runs.iter().zip(&outcomes) {
        let name = run["name"].as_str().unwrap_or("?");
        let mut conf = HashMap::new();
        for call in run["trace"].as_array().context("trace")? {
            let c: Vec<f64> = serde_json::from_value(call["committed_confidence"].clone())?;
            conf.extend(usizes(&call["committed_positions"]).into_iter().zip(c));
        }
        ensure!(
            answer(run).starts_with(&out.tokens),
            "{name}: served {:?}",
            out.tokens
        );
        crate::test_support::check_logprobs_are_confidences(
            name,
            out,
            spec.prompt_ids.len(),
            &conf,
            None,
        )?;
    }
    Ok(())
}
