//! Golden tests of the masked-diffusion programs against the upstream fixtures
//! (tests/fixtures/llada, see its README): the four `generate()` runs (tokens, forward passes and
//! the positions and tokens committed at every step), the `decoding_wino()` run (tokens, forward
//! passes, per-step drafts, revocations and branches), each alone and all packed into the same
//! ticks (with both attention kernels); and SureLock against the per-step trace of `generate.bl32.steps32` (lock decisions for
//! several `eps` and gate percentiles, eps = 0 reproducing the plain runs).

use std::collections::BTreeSet;

use anyhow::{ensure, Context, Result};
use candle_core::DType;
use serde_json::Value;
use wavefront_models::transformer::{AttentionKernel, SelectAttention};

use super::step::StepRecord;
use super::surelock::percentile;
use super::test_support::*;
use super::MdProgram;
use crate::request::{GenerateSpec, LowConfidenceParams, SchemeParams, WinoParams};

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("token ids")
}

fn usizes(v: &Value) -> Vec<usize> {
    serde_json::from_value(v.clone()).expect("positions")
}

fn generate_spec(
    golden: &Golden,
    run: &Value,
    surelock: Option<crate::SureLockParams>,
) -> GenerateSpec {
    let bl = run["block_length"].as_u64().expect("block_length") as usize;
    let steps = run["steps"].as_u64().expect("steps") as usize;
    spec(
        golden.prompt(),
        run["gen_length"].as_u64().expect("gen_length") as usize,
        0,
        SchemeParams::LowConfidence(LowConfidenceParams {
            surelock,
            ..low_confidence(bl, steps)
        }),
    )
}

fn wino_spec(golden: &Golden, surelock: Option<crate::SureLockParams>) -> GenerateSpec {
    let w = &golden.json["wino"];
    spec(
        ids(&w["prompt_ids"]),
        w["gen_length"].as_u64().expect("gen_length") as usize,
        0,
        SchemeParams::Wino(WinoParams {
            threshold: w["tau1"].as_f64().expect("tau1") as f32,
            threshold_back: w["tau2"].as_f64().expect("tau2") as f32,
            surelock,
            ..wino(w["block_length"].as_u64().expect("block_length") as usize)
        }),
    )
}

/// (position, token) pairs of a step, sorted by position.
fn pairs(positions: &[usize], tokens: &[u32]) -> Vec<(usize, u32)> {
    let mut p: Vec<(usize, u32)> = positions
        .iter()
        .copied()
        .zip(tokens.iter().copied())
        .collect();
    p.sort_unstable();
    p
}

fn check_generate(run: &Value, program: &MdProgram) -> Result<()> {
    let name = run["name"].as_str().unwrap_or("?");
    ensure!(
        program.tokens() == ids(&run["output_ids"]).as_slice(),
        "{name}: tokens {:?}, upstream {:?}",
        program.tokens(),
        ids(&run["output_ids"])
    );
    let trace = run["trace"].as_array().context("trace")?;
    let steps = program.steps();
    ensure!(
        steps.len() as u64 == run["n_forward_calls"].as_u64().context("n_forward_calls")?,
        "{name}: {} steps",
        steps.len()
    );
    for (t, (got, want)) in steps.iter().zip(trace).enumerate() {
        let want = pairs(&usizes(&want["unmasked_positions"]), &ids(&want["tokens"]));
        ensure!(
            pairs(&got.committed, &got.tokens) == want,
            "{name} step {t}: committed {:?}, upstream {want:?}",
            pairs(&got.committed, &got.tokens)
        );
    }
    Ok(())
}

fn check_wino(golden: &Golden, program: &MdProgram) -> Result<()> {
    let w = &golden.json["wino"];
    ensure!(
        program.tokens() == ids(&w["output_ids"]).as_slice(),
        "wino: tokens {:?}, upstream {:?}",
        program.tokens(),
        ids(&w["output_ids"])
    );
    let trace = w["trace"].as_array().context("trace")?;
    let steps = program.steps();
    ensure!(
        steps.len() as u64 == w["steps"].as_u64().context("steps")?,
        "wino: {} steps",
        steps.len()
    );
    let (mut drafted_multi, mut revoked) = (0, 0);
    for (t, (got, want)) in steps.iter().zip(trace).enumerate() {
        let drafted = pairs(
            &usizes(&want["drafted_positions"]),
            &ids(&want["drafted_tokens"]),
        );
        ensure!(
            pairs(&got.committed, &got.tokens) == drafted,
            "wino step {t}: drafted {:?}, upstream {drafted:?}",
            got.committed
        );
        let mut got_revoked = got.revoked.clone();
        got_revoked.sort_unstable();
        ensure!(
            got_revoked == usizes(&want["revoked_positions"]),
            "wino step {t}: revoked {got_revoked:?}"
        );
        ensure!(
            got.branch == want["draft_branch"].as_str(),
            "wino step {t}: branch {:?}",
            got.branch
        );
        ensure!(
            Some(got.remask_capped) == want["remask_capped"].as_bool(),
            "wino step {t}: capped"
        );
        ensure!(got.max_accept as u64 == want["max_accept"].as_u64().context("max_accept")?);
        ensure!(got.last_accept as u64 == want["last_accept"].as_u64().context("last_accept")?);
        drafted_multi += usize::from(got.committed.len() > 1);
        revoked += got.revoked.len();
    }
    ensure!(drafted_multi as u64 == w["n_parallel_steps"].as_u64().context("n_parallel_steps")?);
    ensure!(revoked as u64 == w["n_revoked_total"].as_u64().context("n_revoked_total")?);
    Ok(())
}

#[test]
fn generate_runs_match_upstream_alone() -> Result<()> {
    let (model, planner) = fixture()?;
    let golden = Golden::load()?;
    for run in golden.json["generate_runs"].as_array().context("runs")? {
        let mut programs = vec![program(&planner, generate_spec(&golden, run, None))?];
        run_programs(&model, &mut programs)?;
        check_generate(run, &programs[0])?;
    }
    Ok(())
}

#[test]
fn wino_matches_upstream_alone() -> Result<()> {
    let (model, planner) = fixture()?;
    let golden = Golden::load()?;
    let mut programs = vec![program(&planner, wino_spec(&golden, None))?];
    run_programs(&model, &mut programs)?;
    check_wino(&golden, &programs[0])
}

/// With either attention kernel (per-sequence sdpa, or every sequence of a tick in one ragged
/// operation).
#[test]
fn all_goldens_match_packed_into_the_same_ticks() -> Result<()> {
    let golden = Golden::load()?;
    let runs = golden.json["generate_runs"].as_array().context("runs")?;
    for kernel in AttentionKernel::ALL {
        let (mut model, planner) = fixture()?;
        model.select_attention(kernel)?;
        let mut programs = vec![program(&planner, wino_spec(&golden, None))?];
        for run in runs {
            programs.push(program(&planner, generate_spec(&golden, run, None))?);
        }
        run_programs(&model, &mut programs)?;
        check_wino(&golden, &programs[0]).with_context(|| format!("{kernel}"))?;
        for (run, p) in runs.iter().zip(&programs[1..]) {
            check_generate(run, p).with_context(|| format!("{kernel}"))?;
        }
    }
    Ok(())
}

fn run_programs(model: &wavefront_models::Llada, programs: &mut Vec<MdProgram>) -> Result<()> {
    run(model, programs)?;
    Ok(())
}

#[test]
fn surelock_eps_zero_reproduces_the_plain_runs() -> Result<()> {
    let (model, planner) = fixture()?;
    let golden = Golden::load()?;
    let run = &golden.json["generate_runs"][2];
    ensure!(run["name"] == "generate.bl32.steps32");
    let mut programs = vec![
        program(
            &planner,
            generate_spec(&golden, run, surelock(0.0, Some(20.0))),
        )?,
        program(&planner, wino_spec(&golden, surelock(0.0, None)))?,
    ];
    run_programs(&model, &mut programs)?;
    check_generate(run, &programs[0])?;
    check_wino(&golden, &programs[1])?;
    ensure!(programs.iter().all(|p| p.locked().is_empty()));
    Ok(())
}

/// Lock sets per step computed from the trace alone: candidates are unlocked positions that
/// held a token in the step's input; lock when `KL <= eps` and, with the gate, the uncertainty
/// is within the `m`-th percentile of the candidates'.
fn trace_locks(golden: &Golden, eps: f64, m: Option<f64>) -> Result<Vec<BTreeSet<usize>>> {
    let kl: Vec<Vec<f32>> = golden.rows("surelock.kl_prev", DType::F32)?;
    let max_prob: Vec<Vec<f32>> = golden.rows("surelock.max_prob", DType::F32)?;
    let is_mask: Vec<Vec<u8>> = golden.rows("surelock.is_mask", DType::U8)?;
    let mut locked: BTreeSet<usize> = BTreeSet::new();
    let mut out = vec![BTreeSet::new()];
    for t in 1..is_mask.len() {
        let cands: Vec<usize> = (0..is_mask[t].len())
            .filter(|&i| !locked.contains(&i) && is_mask[t][i] == 0)
            .collect();
        let u = |i: usize| 1.0 - f64::from(max_prob[t][i]);
        let gate = m
            .filter(|_| !cands.is_empty())
            .map(|m| percentile(&cands.iter().map(|&i| u(i)).collect::<Vec<_>>(), m));
        let new: BTreeSet<usize> = cands
            .into_iter()
            .filter(|&i| f64::from(kl[t - 1][i]) <= eps && gate.is_none_or(|g| u(i) <= g))
            .collect();
        locked.extend(&new);
        out.push(new);
    }
    Ok(out)
}

fn locks_of(steps: &[StepRecord]) -> Vec<BTreeSet<usize>> {
    steps
        .iter()
        .map(|s| s.locked.iter().copied().collect())
        .collect()
}

#[test]
fn surelock_decisions_match_the_trace() -> Result<()> {
    let (model, planner) = fixture()?;
    let golden = Golden::load()?;
    let run = &golden.json["generate_runs"][2];
    let settings = [
        (1e-6, None),
        (1e-5, None),
        (1e-4, Some(20.0)),
        (1e-2, Some(50.0)),
        (5e-2, None),
    ];
    // Observing only: every row is still computed, so the run is the traced one.
    let mut programs = settings
        .iter()
        .map(|&(eps, m)| {
            let mut p = program(
                &planner,
                generate_spec(&golden, run, surelock(eps as f32, m.map(|m: f64| m as f32))),
            )?;
            p.observe_locks_only();
            Ok(p)
        })
        .collect::<Result<Vec<_>>>()?;
    run_programs(&model, &mut programs)?;
    for ((eps, m), p) in settings.iter().zip(&programs) {
        check_generate(run, p)?;
        let want = trace_locks(
            &golden,
            f64::from(*eps as f32),
            m.map(|m| f64::from(m as f32)),
        )?;
        let got = locks_of(p.steps());
        ensure!(
            got == want,
            "eps {eps}, m {m:?}: locks {got:?}, trace {want:?}"
        );
        ensure!(
            want.iter().any(|s| !s.is_empty()),
            "eps {eps}: the trace locks nothing"
        );
    }
    Ok(())
}

#[test]
fn surelock_skips_locked_rows_and_matches_the_trace_until_it_diverges() -> Result<()> {
    let (model, planner) = fixture()?;
    let golden = Golden::load()?;
    let run = &golden.json["generate_runs"][2];
    for (eps, m) in [(1e-5, None), (1e-2, Some(50.0))] {
        let mut programs = vec![program(
            &planner,
            generate_spec(&golden, run, surelock(eps as f32, m)),
        )?];
        run_programs(&model, &mut programs)?;
        let p = &programs[0];
        let want = trace_locks(&golden, f64::from(eps as f32), m.map(f64::from))?;
        let got = locks_of(p.steps());
        // Identical up to and including the first step that locks (rows are skipped after it).
        let first = want.iter().position(|s| !s.is_empty()).context("no lock")?;
        ensure!(
            got[..=first] == want[..=first],
            "eps {eps}: {got:?} vs {want:?}"
        );
        // Every position was decoded and locked rows stopped costing FLOPs.
        let canvas = p.tokens().len();
        ensure!(p.tokens().iter().all(|&t| t != 460), "masks left");
        let locked = p.locked();
        ensure!(!locked.is_empty() && locked.len() < canvas);
        let ratio = p.flops.0 as f64 / p.flops.1 as f64;
        ensure!(ratio < 1.0 && ratio > 0.0, "flops ratio {ratio}");
    }
    Ok(())
}

/// SureLock runs, whose locked rows' keys are read back from the cache, make the same decisions
/// with the ragged attention path (every sequence of a forward in one operation) as with
/// per-sequence sdpa.
#[test]
fn ragged_attention_makes_sdpas_surelock_decisions() -> Result<()> {
    let (sdpa, planner) = fixture()?;
    let (mut ragged, _) = fixture()?;
    ragged.select_attention(AttentionKernel::Ragged)?;
    let golden = Golden::load()?;
    let run = &golden.json["generate_runs"][2];
    let locking = || -> Result<Vec<MdProgram>> {
        Ok(vec![
            program(
                &planner,
                generate_spec(&golden, run, surelock(1e-2, Some(50.0))),
            )?,
            program(&planner, wino_spec(&golden, surelock(1e-3, None)))?,
        ])
    };
    let (mut a, mut b) = (locking()?, locking()?);
    run_programs(&sdpa, &mut a)?;
    run_programs(&ragged, &mut b)?;
    for (a, b) in a.iter().zip(&b) {
        ensure!(a.tokens() == b.tokens(), "tokens differ between kernels");
        ensure!(locks_of(a.steps()) == locks_of(b.steps()), "locks differ");
        ensure!(
            !a.locked().is_empty(),
            "nothing locked: the cache path was not exercised"
        );
        ensure!(a.flops == b.flops, "rows computed differ");
    }
    Ok(())
}

/// `logprobs`, served: every low-confidence run's tokens carry the log of the confidence
/// upstream's `generate()` committed them with (the softmax of that step's logits at the
/// position), and WINO's the log of the confidence of their last draft (a revoked draft's
/// distribution is replaced by the re-draft's); the requests share ticks and decode the
/// goldens' tokens, so asking for log-probabilities changes no decision.
#[test]
fn logprobs_are_upstreams_confidences_at_the_committing_step() -> Result<()> {
    use std::collections::HashMap;
    let golden = Golden::load()?;
    let runs = golden.json["generate_runs"].as_array().context("runs")?;
    let mut specs: Vec<GenerateSpec> = runs
        .iter()
        .map(|run| {
            let mut s = generate_spec(&golden, run, None);
            s.sampling.logprobs = Some(4);
            s
        })
        .collect();
    let mut w = wino_spec(&golden, None);
    w.sampling.logprobs = Some(2);
    specs.push(w);
    let outcomes = crate::test_support::served_outcomes(
        fixture_files()?,
        crate::LoadOptions::default(),
        &specs,
    )?;
    let prompt_len = golden.prompt().len();
    for (run, out) in runs.iter().zip(&outcomes) {
        let name = run["name"].as_str().unwrap_or("?");
        let generated = ids(&run["generated_ids"]);
        ensure!(
            generated.starts_with(&out.tokens),
            "{name}: served {:?}, upstream {generated:?}",
            out.tokens
        );
        let mut conf = HashMap::new();
        for step in run["trace"].as_array().context("trace")? {
            let confs: Vec<f64> = serde_json::from_value(step["confidences"].clone())?;
            for (p, c) in usizes(&step["unmasked_positions"]).into_iter().zip(confs) {
                conf.insert(p, c);
            }
        }
        crate::test_support::check_logprobs_are_confidences(name, out, prompt_len, &conf, Some(4))?;
    }
    let wg = &golden.json["wino"];
    let mut last_draft = HashMap::new();
    for step in wg["trace"].as_array().context("trace")? {
        let confs: Vec<f64> = serde_json::from_value(step["drafted_confidences"].clone())?;
        for (p, c) in usizes(&step["drafted_positions"]).into_iter().zip(confs) {
            last_draft.insert(p, c);
        }
    }
    let wino_prompt = ids(&wg["prompt_ids"]).len();
    crate::test_support::check_logprobs_are_confidences(
        "wino",
        &outcomes[runs.len()],
        wino_prompt,
        &last_draft,
        Some(2),
    )
}

/// `log p(ids[at] | ids with ids[at] masked)` from one bidirectional forward of `ids` (the
/// token at `at` replaced by the mask), computed apart from the serving path.
fn masked_logprob(model: &wavefront_models::Llada, ids: &[u32], at: usize) -> Result<f64> {
    use wavefront_models::transformer::{MaskRule, SeqInput};
    let mut input = ids.to_vec();
    input[at] = 460;
    let mut seqs = [SeqInput::dense(input.len()).with_mask(MaskRule::Bidirectional)];
    let hidden = model.forward(&input, &mut seqs)?;
    let row: Vec<f32> = model
        .logits(&hidden.narrow(0, at, 1)?)?
        .to_vec2()?
        .remove(0);
    Ok(crate::test_support::log_softmax(&row)[ids[at] as usize])
}

/// `prompt_logprobs`, served, scoring only, checked against independent forwards:
/// - without a condition length, token i's entry is `log p(x_i | x_<i, [MASK])`, one forward of
///   the prefix with the token masked last (LLaDA's bound for a one-token answer, exact);
/// - with the condition all but the last token (an answer of one), every sample masks that
///   token with weight 1, so the bound is exact and equals the same forward;
/// - with an answer of two tokens and 1024 samples, the estimate (the answer's entries summed)
///   is within five standard errors of the bound's exact expectation over the stratified mask
///   counts (half the samples mask one token, with weight 2; half both, with weight 1).
#[test]
fn prompt_logprobs_are_llada_likelihood_bounds() -> Result<()> {
    let golden = Golden::load()?;
    let (model, _) = fixture()?;
    let prompt = golden.prompt();
    let p = prompt.len();
    let scoring = |context: Option<usize>, samples: Option<usize>| {
        let mut s = generate_spec(&golden, &golden.json["generate_runs"][0], None);
        s.max_new_tokens = 0;
        s.sampling.prompt_logprobs = Some(2);
        s.sampling.likelihood_context = context;
        s.sampling.mc_samples = samples;
        s.sampling.seed = 3;
        s
    };
    let specs = [
        scoring(None, None),
        scoring(Some(p - 1), Some(4)),
        scoring(Some(p - 2), Some(1024)),
    ];
    let outcomes = crate::test_support::served_outcomes(
        fixture_files()?,
        crate::LoadOptions::default(),
        &specs,
    )?;
    for out in &outcomes {
        ensure!(
            out.tokens.is_empty(),
            "scoring only generated {:?}",
            out.tokens
        );
    }
    let entries = |i: usize| {
        outcomes[i]
            .prompt_logprobs
            .clone()
            .context("no prompt entries")
    };
    let chain = entries(0)?;
    ensure!(chain.len() == p && chain[0].logprob.is_nan());
    for (i, e) in chain.iter().enumerate().skip(1) {
        let want = masked_logprob(&model, &prompt[..=i], i)?;
        ensure!(
            (f64::from(e.logprob) - want).abs() < 1e-4,
            "token {i}: {} vs an independent forward's {want}",
            e.logprob
        );
        ensure!(
            e.top.len() == 2 && e.top[0].1 >= e.logprob,
            "token {i}: {:?}",
            e.top
        );
    }
    let last = entries(1)?;
    ensure!(last[..p - 1].iter().all(|e| e.logprob.is_nan()));
    ensure!(
        (last[p - 1].logprob - chain[p - 1].logprob).abs() < 1e-5,
        "a one-token answer: {} vs {}",
        last[p - 1].logprob,
        chain[p - 1].logprob
    );
    let two = entries(2)?;
    let estimate: f64 = two[p - 2..].iter().map(|e| f64::from(e.logprob)).sum();
    let one = |at: usize| -> Result<f64> {
        let mut ids = prompt.clone();
        // The other answer token stays visible.
        ids.truncate(p);
        masked_logprob(&model, &ids, at)
    };
    let (a, b) = (one(p - 2)?, one(p - 1)?);
    let both = {
        let mut ids = prompt.clone();
        ids[p - 1] = 460;
        masked_logprob(&model, &ids, p - 2)? + {
            let mut ids = prompt.clone();
            ids[p - 2] = 460;
            masked_logprob(&model, &ids, p - 1)?
        }
    };
    let exact = 0.5 * (a + b) + 0.5 * both;
    let se = (512f64).sqrt() / 1024.0 * (a - b).abs();
    ensure!(
        (estimate - exact).abs() <= 5.0 * se + 1e-4,
        "the estimate {estimate} is {} standard errors from the bound {exact}",
        (estimate - exact).abs() / se
    );
    Ok(())
}
