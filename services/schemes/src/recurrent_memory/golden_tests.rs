//! Generation after a long context against upstream (tests/fixtures/armt): the greedy tokens and
//! the logits that chose them, for `AssociativeRecurrentWrapper.generate` (sequential) and
//! `FastGroupedArmtExecutor.generate` (diagonal), with the statistics each execution reports.

use anyhow::{ensure, Context, Result};
use candle_core::Tensor;
use wavefront_engine::FinishReason;

use super::test_support::*;
use crate::request::Execution;

/// `(max |a - b|, ||a - b|| / ||b||)` of logits rows against a golden `[steps, V]`.
fn diff(rows: &[Vec<f32>], want: &Tensor) -> Result<(f32, f32)> {
    let want: Vec<Vec<f32>> = want.to_vec2()?;
    ensure!(
        rows.len() == want.len(),
        "{} rows vs {}",
        rows.len(),
        want.len()
    );
    let (mut max, mut num, mut den) = (0f32, 0f64, 0f64);
    for (g, w) in rows.iter().zip(&want) {
        for (a, b) in g.iter().zip(w) {
            max = max.max((a - b).abs());
            num += f64::from(a - b).powi(2);
            den += f64::from(*b).powi(2);
        }
    }
    Ok((max, (num / den).sqrt() as f32))
}

#[test]
fn generation_after_the_context_matches_upstream_in_both_executions() -> Result<()> {
    let golden = Golden::load()?;
    let (model, planner) = fixture()?;
    let ids = golden.ids("input_ids")?;
    for (execution, name, steps, cells) in [
        (Execution::Sequential, "seq", 6 * 3, vec![1u32; 18]),
        (
            Execution::Diagonal,
            "diag",
            6 + 3 - 1,
            vec![1, 2, 3, 3, 3, 3, 2, 1],
        ),
    ] {
        let p = program(&planner, spec(ids.clone(), 8, execution))?;
        let run = run(&model, vec![p], &[])?;
        let r = &run.records[0];
        let want = golden.ids(&format!("gen.{name}.tokens"))?;
        ensure!(
            r.tokens == want,
            "{name}: {:?} vs upstream {want:?}",
            r.tokens
        );
        let (max, rel) = diff(
            &r.logits,
            golden.tensor(&format!("gen.{name}.step_logits"))?,
        )?;
        println!("gen.{name}.step_logits: max_abs {max:.3e}, rel_fro {rel:.3e}");
        // The README's tolerances for logits.
        ensure!(max <= 1e-3 && rel <= 1e-4, "{name}: {max:e} {rel:e}");
        let (reason, stats) = r.finish.clone().expect("finished");
        ensure!(reason == FinishReason::Length);
        ensure!(stats.counters["segments"] == 6);
        ensure!(
            stats.counters["grouped_steps"] == steps,
            "{name}: {stats:?}"
        );
        ensure!(stats.series["cells_per_step"] == cells, "{name}: {stats:?}");
        // Prefill (6 segments or 8 diagonals) then 7 decoding steps.
        let prefill = if execution == Execution::Diagonal {
            8
        } else {
            6
        };
        ensure!(stats.forward_passes == prefill + 7, "{name}: {stats:?}");
        ensure!(run.ticks == prefill as usize + 7);
        // The grouped calls of the diagonal run: one per diagonal, each with its cells.
        if execution == Execution::Diagonal {
            ensure!(run.grouped_steps == 8 && run.cells == vec![1, 2, 3, 3, 3, 3, 2, 1]);
        } else {
            ensure!(run.grouped_steps == 0);
        }
    }
    Ok(())
}

#[test]
fn the_first_generated_logits_are_the_forwards_last_position_and_a_full_last_segment_is_the_prompt(
) -> Result<()> {
    let golden = Golden::load()?;
    let (model, planner) = fixture()?;
    let ids = golden.ids("input_ids")?;
    // gen.seq.step_logits[0] equals seq.logits[0, -1] (the prompt segment reads what the five
    // full segments wrote; its own memory tokens never reach its token logits).
    let p = program(&planner, spec(ids.clone(), 1, Execution::Auto))?;
    let r = run(&model, vec![p], &[])?.records.remove(0);
    let last = golden.tensor("seq.logits")?.get(0)?.get(43)?.unsqueeze(0)?;
    let (max, rel) = diff(&r.logits, &last)?;
    ensure!(max <= 1e-3 && rel <= 1e-4, "{max:e} {rel:e}");
    // A prompt of exactly five segments: the fifth is the prompt segment. Its first logits are
    // then the sequential forward's last position over the first four segments plus the fifth
    // read-only, which both executions must agree on.
    let forty = ids[..40].to_vec();
    let mut tokens = Vec::new();
    for execution in [Execution::Sequential, Execution::Diagonal] {
        let p = program(&planner, spec(forty.clone(), 6, execution))?;
        let r = run(&model, vec![p], &[])?.records.remove(0);
        let stats = &r.finish.as_ref().expect("finished").1;
        ensure!(stats.counters["segments"] == 5);
        tokens.push((r.tokens.clone(), r.logits.clone()));
    }
    ensure!(tokens[0].0 == tokens[1].0, "{:?}", tokens);
    let want = Tensor::new(tokens[0].1.clone(), &candle_core::Device::Cpu)?;
    let (max, _) = diff(&tokens[1].1, &want)?;
    ensure!(max < 1e-4, "diagonal vs sequential step logits: {max:e}");
    Ok(())
}

/// `logprobs`, served in both executions: each generated token's log-probability and its
/// alternatives are the log-softmax of the step logits upstream recorded (within the README's
/// logits tolerance), the greedy token first; asking for them changes no token.
#[test]
fn logprobs_are_the_log_softmax_of_upstreams_step_logits() -> Result<()> {
    let golden = Golden::load()?;
    let ids = golden.ids("input_ids")?;
    let names = ["seq", "diag"];
    let specs: Vec<_> = [Execution::Sequential, Execution::Diagonal]
        .into_iter()
        .map(|e| {
            let mut s = spec(ids.clone(), 8, e);
            s.sampling.logprobs = Some(3);
            s
        })
        .collect();
    let outcomes = crate::test_support::served_outcomes(
        fixture_files()?,
        crate::LoadOptions::default(),
        &specs,
    )?;
    for (name, out) in names.iter().zip(&outcomes) {
        let want_tokens = golden.ids(&format!("gen.{name}.tokens"))?;
        ensure!(
            out.tokens == want_tokens && out.logprobs.len() == out.tokens.len(),
            "{name}: {:?} ({} log-probabilities), upstream {want_tokens:?}",
            out.tokens,
            out.logprobs.len()
        );
        let rows: Vec<Vec<f32>> = golden
            .tensor(&format!("gen.{name}.step_logits"))?
            .to_vec2()?;
        for (i, (&token, lp)) in out.tokens.iter().zip(&out.logprobs).enumerate() {
            let row = crate::test_support::log_softmax(&rows[i]);
            ensure!(
                lp.top.len() == 3 && lp.top[0] == (token, lp.logprob),
                "{name} token {i}: alternatives {:?}",
                lp.top
            );
            let what = format!("{name} token {i}");
            crate::test_support::check_entry(&what, token, lp, &row, 2e-3)?;
        }
    }
    Ok(())
}

/// `prompt_logprobs`, served, scoring only (`max_new_tokens` 0), in both executions: every
/// prompt token's entry is the log-softmax of upstream's forward logits at the position before
/// it, across the segment boundaries (within the README's logits tolerance); the first has none
/// and no token is generated. With one token to generate, the prompt scores the same and the
/// token is upstream's.
#[test]
fn prompt_logprobs_are_the_segmented_forwards_log_softmax() -> Result<()> {
    let golden = Golden::load()?;
    let ids = golden.ids("input_ids")?;
    for (execution, name) in [
        (Execution::Sequential, "seq"),
        (Execution::Diagonal, "diag"),
    ] {
        let rows: Vec<Vec<f32>> = golden
            .tensor(&format!("{name}.logits"))?
            .get(0)?
            .to_vec2()?;
        let specs: Vec<_> = [0, 1]
            .into_iter()
            .map(|max_new| {
                let mut s = spec(ids.clone(), max_new, execution);
                s.sampling.prompt_logprobs = Some(2);
                s
            })
            .collect();
        let outcomes = crate::test_support::served_outcomes(
            fixture_files()?,
            crate::LoadOptions::default(),
            &specs,
        )?;
        ensure!(
            outcomes[0].tokens.is_empty(),
            "{name}: scoring only generated tokens"
        );
        ensure!(outcomes[1].tokens == golden.ids(&format!("gen.{name}.tokens"))?[..1]);
        for out in &outcomes {
            let scored = out.prompt_logprobs.as_ref().context("no prompt entries")?;
            ensure!(scored.len() == ids.len() && scored[0].logprob.is_nan());
            for (j, lp) in scored.iter().enumerate().skip(1) {
                let row = crate::test_support::log_softmax(&rows[j - 1]);
                ensure!(lp.top.len() == 2, "{name} position {j}: {:?}", lp.top);
                let what = format!("{name} position {j}");
                crate::test_support::check_entry(&what, ids[j], lp, &row, 2e-3)?;
            }
        }
    }
    Ok(())
}
