//! Golden tests of the plan-and-infill program against upstream `generate_refusion()` (the runs
//! of tests/fixtures/refusion/golden.json, see its README): every run's committed buffer (tokens
//! and position ids, in commit order), every model call (batch rows, cache length, input ids,
//! position ids, and the argmax and softmax maximum of every position the program reads) and the
//! per-iteration trace (plan drafts and confidences, span scores, selection, verification
//! probabilities and prefix, path, every completion step's inputs, outputs, flags and progress,
//! commits, EOS), each run alone and all runs packed into the same ticks. `eos_quirk_b16` is
//! matched with [`EosRule::Upstream`]; with the default rule it differs exactly where upstream's
//! quirk drops a span.

use anyhow::{ensure, Context, Result};
use serde_json::Value;

use super::test_support::*;
use super::SdProgram;
use crate::request::{EosRule, GenerateSpec, PlanInfillParams, SchemeParams};
use crate::served::Planner;

/// Probabilities in the goldens are rounded to 6 decimals; float32 differences are ~1e-6.
const PROB_TOL: f32 = 2e-5;

fn u32s(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("integers")
}

fn f32s(v: &Value) -> Vec<f32> {
    serde_json::from_value(v.clone()).expect("numbers")
}

fn rows_u32(v: &Value) -> Vec<Vec<u32>> {
    serde_json::from_value(v.clone()).expect("integer rows")
}

fn rows_f32(v: &Value) -> Vec<Vec<f32>> {
    serde_json::from_value(v.clone()).expect("number rows")
}

fn close(got: &[f32], want: &[f32]) -> bool {
    got.len() == want.len() && got.iter().zip(want).all(|(a, b)| (a - b).abs() <= PROB_TOL)
}

fn runs(golden: &Value) -> Vec<Value> {
    golden["generate"].as_array().expect("generate").clone()
}

fn run_spec(run: &Value, eos_rule: EosRule) -> GenerateSpec {
    let a = &run["args"];
    let n = |k: &str| a[k].as_u64().expect("integer arg") as usize;
    let f = |k: &str| a[k].as_f64().expect("float arg") as f32;
    assert_eq!(a["temperature"].as_f64(), Some(0.0));
    assert_eq!(a["mask_id"].as_u64(), Some(511));
    spec(
        u32s(&run["prompt_ids"]),
        n("gen_length"),
        SchemeParams::PlanInfill(PlanInfillParams {
            span_size: n("slot_size"),
            serial_num_blocks: n("serial_num_blocks"),
            span_threshold: f("slot_threshold"),
            token_threshold: f("token_threshold"),
            eos_rule,
        }),
    )
}

/// The rule that reproduces a run: upstream's quirk where the run exercises it.
fn rule_for(run: &Value) -> EosRule {
    if run["name"] == "eos_quirk_b16" {
        EosRule::Upstream
    } else {
        EosRule::Aligned
    }
}

fn check_buffer(run: &Value, program: &SdProgram) -> Result<()> {
    let name = run["name"].as_str().unwrap_or("?");
    let p = program.plan_infill().context("plan-infill")?;
    let (ids, pos) = p.buffer();
    // Upstream's x: the buffer sorted by position.
    let mut sorted: Vec<(u32, u32)> = pos.iter().copied().zip(ids.iter().copied()).collect();
    sorted.sort_unstable();
    let x: Vec<u32> = sorted.iter().map(|&(_, t)| t).collect();
    ensure!(
        x == u32s(&run["output_ids"]),
        "{name}: output {x:?}, upstream {:?}",
        u32s(&run["output_ids"])
    );
    let prompt_len = run["prompt_ids"].as_array().map_or(0, Vec::len);
    let generated: Vec<u32> = sorted[prompt_len..].iter().map(|&(p, _)| p).collect();
    ensure!(
        generated == u32s(&run["generated_positions"]),
        "{name}: positions {generated:?}"
    );
    // Commit order: the concatenation of the iterations' commits.
    let committed: Vec<u32> = run["trace"]
        .as_array()
        .context("trace")?
        .iter()
        .flat_map(|t| u32s(&t["committed_pos"]))
        .collect();
    ensure!(
        pos[prompt_len..] == committed[..],
        "{name}: commit order {:?}",
        &pos[prompt_len..]
    );
    Ok(())
}

fn check_calls(run: &Value, program: &SdProgram) -> Result<()> {
    let name = run["name"].as_str().unwrap_or("?");
    let want = run["model_calls"].as_array().context("model_calls")?;
    let got = program.calls();
    ensure!(
        got.len() == want.len(),
        "{name}: {} model calls, upstream {}",
        got.len(),
        want.len()
    );
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        ensure!(
            g.batch as u64 == w["batch"].as_u64().context("batch")?,
            "{name} call {i}: batch {}",
            g.batch
        );
        ensure!(
            g.cache_len_before as u64 == w["cache_len_before"].as_u64().context("cache")?,
            "{name} call {i}: cache length {}",
            g.cache_len_before
        );
        ensure!(
            g.input_ids == rows_u32(&w["input_ids"]),
            "{name} call {i}: ids {:?}",
            g.input_ids
        );
        ensure!(
            g.position_ids == rows_u32(&w["position_ids"]),
            "{name} call {i}: positions {:?}",
            g.position_ids
        );
        let (argmax, max_prob) = (rows_u32(&w["argmax"]), rows_f32(&w["max_prob"]));
        for (r, reads) in g.reads.iter().enumerate() {
            for &(at, a, p) in reads {
                ensure!(
                    a == argmax[r][at],
                    "{name} call {i} row {r} position {at}: argmax {a}, upstream {}",
                    argmax[r][at]
                );
                ensure!(
                    (p - max_prob[r][at]).abs() <= PROB_TOL,
                    "{name} call {i} row {r} position {at}: max prob {p}, upstream {}",
                    max_prob[r][at]
                );
            }
        }
    }
    Ok(())
}

fn check_trace(run: &Value, program: &SdProgram) -> Result<()> {
    let name = run["name"].as_str().unwrap_or("?");
    let want = run["trace"].as_array().context("trace")?;
    let got = program.iterations();
    ensure!(
        got.len() == want.len(),
        "{name}: {} iterations, upstream {}",
        got.len(),
        want.len()
    );
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let at = format!("{name} iteration {i}");
        ensure!(
            g.block as u64 == w["block"].as_u64().context("block")?,
            "{at}: block"
        );
        ensure!(
            g.cache_len_before_plan as u64 == w["cache_len_before_plan"].as_u64().context("c")?,
            "{at}: cache length {}",
            g.cache_len_before_plan
        );
        ensure!(
            g.remaining == u32s(&w["remaining_slot_start_pos"]),
            "{at}: remaining {:?}",
            g.remaining
        );
        ensure!(
            g.plan_draft == rows_u32(&w["plan_draft"]),
            "{at}: plan draft {:?}",
            g.plan_draft
        );
        let conf = rows_f32(&w["plan_conf"]);
        ensure!(
            g.plan_conf.len() == conf.len()
                && g.plan_conf.iter().zip(&conf).all(|(a, b)| close(a, b)),
            "{at}: plan confidences {:?}",
            g.plan_conf
        );
        ensure!(
            close(&g.span_scores, &f32s(&w["slot_scores"])),
            "{at}: scores {:?}",
            g.span_scores
        );
        ensure!(
            g.selected == u32s(&w["selected_slot_start_pos"]),
            "{at}: selected {:?}",
            g.selected
        );
        let vp = rows_f32(&w["verify_probs"]);
        ensure!(
            g.verify_probs.len() == vp.len()
                && g.verify_probs.iter().zip(&vp).all(|(a, b)| close(a, b)),
            "{at}: verify probabilities {:?}",
            g.verify_probs
        );
        ensure!(
            g.verify_prefix_len as u64 == w["verify_prefix_len"].as_u64().context("prefix")?,
            "{at}: prefix {}",
            g.verify_prefix_len
        );
        ensure!(Some(g.path) == w["path"].as_str(), "{at}: path {}", g.path);
        let steps = w["loop"].as_array().cloned().unwrap_or_default();
        ensure!(
            g.steps.len() == steps.len(),
            "{at}: {} completion steps",
            g.steps.len()
        );
        for (k, (gs, ws)) in g.steps.iter().zip(&steps).enumerate() {
            let at = format!("{at} step {k}");
            ensure!(
                gs.accepted_prefix_len_before as u64
                    == ws["accepted_prefix_len_before"].as_u64().context("acc")?,
                "{at}: acc"
            );
            ensure!(
                gs.draft_input == rows_u32(&ws["draft_input"]),
                "{at}: draft input {:?}",
                gs.draft_input
            );
            ensure!(
                gs.draft_out == rows_u32(&ws["draft_out"]),
                "{at}: draft out {:?}",
                gs.draft_out
            );
            ensure!(
                gs.merged == rows_u32(&ws["merged"]),
                "{at}: merged {:?}",
                gs.merged
            );
            let wp = rows_f32(&ws["verify_probs"]);
            // Index 0 of a step is never read (its token is always accepted).
            ensure!(
                gs.verify_probs.len() == wp.len()
                    && gs
                        .verify_probs
                        .iter()
                        .zip(&wp)
                        .all(|(a, b)| close(&a[1..], &b[1..])),
                "{at}: verify probabilities {:?}",
                gs.verify_probs
            );
            let tags: Vec<Vec<bool>> = rows_u32(&ws["tags"])
                .into_iter()
                .map(|r| r.into_iter().map(|t| t == 1).collect())
                .collect();
            ensure!(gs.tags == tags, "{at}: tags {:?}", gs.tags);
            ensure!(
                gs.newly_accepted_len as u64 == ws["newly_accepted_len"].as_u64().context("new")?,
                "{at}: newly accepted {}",
                gs.newly_accepted_len
            );
        }
        ensure!(
            g.committed_tokens == u32s(&w["committed_tokens"]),
            "{at}: committed {:?}",
            g.committed_tokens
        );
        ensure!(
            g.committed_pos == u32s(&w["committed_pos"]),
            "{at}: committed at {:?}",
            g.committed_pos
        );
        ensure!(Some(g.eos) == w["eos"].as_bool(), "{at}: eos {}", g.eos);
        ensure!(
            g.eos_row.map(|r| r as u64) == w["eos_row"].as_u64(),
            "{at}: eos row {:?}",
            g.eos_row
        );
        let dropped = w
            .get("eos_quirk_dropped_slot_pos")
            .map(u32s)
            .unwrap_or_default();
        ensure!(g.dropped == dropped, "{at}: dropped {:?}", g.dropped);
    }
    Ok(())
}

fn check(run: &Value, program: &SdProgram) -> Result<()> {
    check_buffer(run, program)?;
    check_calls(run, program)?;
    check_trace(run, program)
}

#[test]
fn every_run_matches_upstream_alone_and_packed_together() -> Result<()> {
    let golden = golden()?;
    let (model, planner) = fixture()?;
    let runs = runs(&golden);
    assert_eq!(runs.len(), 8);
    for run in &runs {
        let mut p = vec![program(&planner, run_spec(run, rule_for(run)))?];
        let ticks = run_model(&model, &mut p)?;
        check(run, &p[0])?;
        // One model call per tick.
        ensure!(ticks[0] == p[0].calls().len());
        // Without recording, calls read only the logits their decisions need: same run.
        let mut quiet = vec![planner.prepare(run_spec(run, rule_for(run)))?.program];
        let quiet_ticks = run_model(&model, &mut quiet)?;
        ensure!(quiet_ticks == ticks);
        check_buffer(run, &quiet[0])?;
    }
    let mut packed = runs
        .iter()
        .map(|run| program(&planner, run_spec(run, rule_for(run))))
        .collect::<Result<Vec<_>>>()?;
    run_model(&model, &mut packed)?;
    for (run, p) in runs.iter().zip(&packed) {
        check(run, p).with_context(|| "packed with the other runs")?;
    }
    Ok(())
}

/// Upstream's EOS quirk drops span 25 of `eos_quirk_b16`; the default rule generates it, so the
/// output has no gap, and everything before the EOS iteration is upstream's.
#[test]
fn the_aligned_eos_rule_generates_the_spans_left_of_the_eos() -> Result<()> {
    let golden = golden()?;
    let (model, planner) = fixture()?;
    let runs = runs(&golden);
    let run = runs
        .iter()
        .find(|r| r["name"] == "eos_quirk_b16")
        .context("eos_quirk_b16")?;
    let mut p = vec![program(&planner, run_spec(run, EosRule::Aligned))?];
    run_model(&model, &mut p)?;
    let upstream = run["trace"].as_array().context("trace")?;
    let got = p[0].iterations();
    // The EOS iteration commits the same tokens; only the pool it leaves differs.
    for (g, w) in got.iter().zip(upstream) {
        ensure!(g.committed_pos == u32s(&w["committed_pos"]));
        ensure!(g.committed_tokens == u32s(&w["committed_tokens"]));
    }
    let last = &got[2];
    ensure!(last.eos_row == Some(0) && last.dropped.is_empty());
    ensure!(got.len() > upstream.len(), "slot 25 was never planned");
    ensure!(got[3].remaining == vec![25], "{:?}", got[3].remaining);
    // Every position up to the first EOS in position order is generated.
    let generated = p[0].plan_infill().context("plan-infill")?.generated();
    eprintln!("aligned eos_quirk_b16: {generated:?}");
    let eos = generated
        .iter()
        .position(|&(_, t)| t == 486)
        .context("no EOS")?;
    let positions: Vec<u32> = generated[..=eos].iter().map(|&(p, _)| p).collect();
    ensure!(
        positions == (9..=positions[eos]).collect::<Vec<_>>(),
        "a gap before the EOS: {positions:?}"
    );
    ensure!(positions[eos] >= 25, "{positions:?}");
    // Calls: upstream's 20, plus the iterations that decode span 25.
    let calls = p[0].calls().len();
    ensure!(calls > 20, "{calls} calls");
    // Every other run is identical under both rules.
    for run in runs.iter().filter(|r| r["name"] != "eos_quirk_b16") {
        let mut p = vec![program(&planner, run_spec(run, EosRule::Upstream))?];
        run_model(&model, &mut p)?;
        check(run, &p[0])?;
    }
    Ok(())
}

fn run_model(model: &wavefront_models::Qwen3, programs: &mut Vec<SdProgram>) -> Result<Vec<usize>> {
    run(model, programs)
}

/// What upstream's trace says each position's token was last scored with: a span's first
/// token its planning confidence, every other token the probability the last verification
/// that scored it gave (the selected spans' verification, then each step of iterative
/// completion; a step's first token is not scored, it keeps what the step before gave it).
fn last_scored(run: &Value) -> std::collections::HashMap<u32, f64> {
    let mut want = std::collections::HashMap::new();
    for it in run["trace"].as_array().expect("trace") {
        let starts = u32s(&it["selected_slot_start_pos"]);
        let verify = rows_f32(&it["verify_probs"]);
        for (start, probs) in starts.iter().zip(&verify) {
            // Index 0 is the planning confidence of the span's first token.
            for (j, &p) in probs.iter().enumerate() {
                want.insert(start + j as u32, f64::from(p));
            }
        }
        for step in it["loop"].as_array().into_iter().flatten() {
            let pos = rows_u32(&step["draft_pos"]);
            for (pos, probs) in pos.iter().zip(rows_f32(&step["verify_probs"])) {
                for (t, p) in probs.into_iter().enumerate().skip(1) {
                    want.insert(pos[t], f64::from(p));
                }
            }
        }
    }
    want
}

/// `logprobs`, served: every plan-and-infill token's probability is what upstream's trace
/// records for its position (the verifier's probability of the token at its last verification,
/// or a span's first token's planning confidence; the trace rounds to 1e-6), and asking for
/// them changes no token.
#[test]
fn plan_infill_logprobs_are_the_verifiers_or_the_planners_probabilities() -> Result<()> {
    let golden = golden()?;
    let runs: Vec<Value> = runs(&golden)
        .into_iter()
        .filter(|r| rule_for(r) == EosRule::Aligned)
        .collect();
    let specs: Vec<GenerateSpec> = runs
        .iter()
        .map(|r| {
            let mut s = run_spec(r, EosRule::Aligned);
            s.sampling.logprobs = Some(2);
            s
        })
        .collect();
    let outcomes = crate::test_support::served_outcomes(
        fixture_files()?,
        crate::LoadOptions::default(),
        &specs,
    )?;
    for ((run, spec), out) in runs.iter().zip(&specs).zip(&outcomes) {
        let name = run["name"].as_str().unwrap_or("?");
        let generated = u32s(&run["generated_ids"]);
        ensure!(
            !out.tokens.is_empty()
                && generated.starts_with(&out.tokens)
                && out.logprobs.len() == out.tokens.len(),
            "{name}: {:?} with {} log-probabilities, upstream {generated:?}",
            out.tokens,
            out.logprobs.len()
        );
        let want = last_scored(run);
        let start = spec.prompt_ids.len() as u32;
        for (i, lp) in out.logprobs.iter().enumerate() {
            let p = want
                .get(&(start + i as u32))
                .with_context(|| format!("{name}: nothing scored at {i}"))?;
            let got = f64::from(lp.logprob).exp();
            ensure!(
                (got - p).abs() < 2e-6 + 1e-4 * p,
                "{name} token {i}: logprob {} (p {got}), upstream's trace {p}",
                lp.logprob
            );
            ensure!(
                lp.top.len() == 2 && lp.top[0].1 >= lp.top[1].1 && lp.top[0].1 >= lp.logprob,
                "{name} token {i}: alternatives {:?}",
                lp.top
            );
        }
    }
    Ok(())
}

/// `logprobs` and `prompt_logprobs` of ReFusion's `ar` scheme: each generated and each prompt
/// token's log-probability and alternatives are the log-softmax of one causal forward over the
/// prompt and the generated tokens, computed apart from the serving path (the prompt's first
/// token has none).
#[test]
fn ar_logprobs_are_an_independent_forwards_log_softmax() -> Result<()> {
    use wavefront_models::transformer::{Keys, KvCache, MaskRule, SeqInput};
    let (model, _) = fixture()?;
    // Longer than a scoring chunk: the prompt is scored over two calls.
    let prompt_ids = prompt(100, 3);
    let mut s = spec(
        prompt_ids.clone(),
        10,
        SchemeParams::Ar(crate::request::ArParams::default()),
    );
    s.sampling.logprobs = Some(4);
    s.sampling.prompt_logprobs = Some(2);
    let out = crate::test_support::served_outcomes(
        fixture_files()?,
        crate::LoadOptions::default(),
        &[s],
    )?
    .remove(0);
    ensure!(!out.tokens.is_empty() && out.logprobs.len() == out.tokens.len());
    let ids: Vec<u32> = prompt_ids.iter().chain(&out.tokens).copied().collect();
    let mut cache = KvCache::new();
    let n = ids.len() as u32;
    let hidden = model.forward(
        &ids,
        &mut [SeqInput {
            index: (0..n).collect(),
            positions: (0..n).collect(),
            mask: MaskRule::Causal,
            keys: Keys::Buffer {
                len: ids.len(),
                cache: &mut cache,
            },
        }],
    )?;
    let rows: Vec<Vec<f32>> = model.logits(&hidden)?.to_vec2()?;
    let prompt_scores = out.prompt_logprobs.as_ref().context("no prompt entries")?;
    ensure!(prompt_scores.len() == prompt_ids.len() && prompt_scores[0].logprob.is_nan());
    for (j, lp) in prompt_scores.iter().enumerate().skip(1) {
        ensure!(lp.top.len() == 2, "position {j}: {:?}", lp.top);
        let want = crate::test_support::log_softmax(&rows[j - 1]);
        let what = format!("prompt position {j}");
        crate::test_support::check_entry(&what, prompt_ids[j], lp, &want, 1e-3)?;
    }
    for (i, (&token, lp)) in out.tokens.iter().zip(&out.logprobs).enumerate() {
        let row = crate::test_support::log_softmax(&rows[prompt_ids.len() + i - 1]);
        ensure!(
            lp.top.len() == 4 && lp.top[0] == (token, lp.logprob),
            "token {i}: {:?}",
            lp.top
        );
        crate::test_support::check_entry(&format!("token {i}"), token, lp, &row, 1e-3)?;
    }
    Ok(())
}
