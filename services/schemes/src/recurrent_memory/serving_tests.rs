//! The recurrent-memory family behind the engine: batch invariance of requests packed into the
//! same grouped steps (joining at different ticks, mixed executions, sampled and stopped
//! requests), fewer grouped steps for many long prompts than for separate runs, prompts longer
//! than the backbone's context, cancellation freeing slots mid-prefill, slot accounting and
//! request validation.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use candle_core::DType;
use wavefront_engine::{FinishReason, RequestError};

use super::test_support::*;
use super::ArmtPlanner;
use crate::kv_row::PagedPlanner;
use crate::options::LoadOptions;
use crate::registry::load_model;
use crate::request::{ArParams, Execution, GenerateSpec, LowConfidenceParams, SchemeParams};
use crate::served::Planner;
use crate::test_support::{
    assert_invalid, refused_as_too_large, serve, submit, wait_for_free_slots,
};

/// Eight requests: one segment or many, exact multiples of the segment size, every execution,
/// a sampled one and one with a stop token.
fn mixed_requests() -> Vec<GenerateSpec> {
    let mut sampled = spec(prompt(57, 5), 9, Execution::Diagonal);
    sampled.sampling.temperature = 0.8;
    sampled.sampling.top_k = 20;
    sampled.sampling.seed = 11;
    let mut stopped = spec(prompt(30, 6), 12, Execution::Auto);
    stopped.stop_token_ids = vec![79];
    vec![
        spec(prompt(3, 0), 5, Execution::Auto),
        spec(prompt(8, 1), 4, Execution::Diagonal),
        spec(prompt(44, 2), 8, Execution::Diagonal),
        spec(prompt(80, 3), 6, Execution::Sequential),
        spec(prompt(123, 4), 7, Execution::Auto),
        sampled,
        stopped,
        spec(prompt(96, 7), 10, Execution::Diagonal),
    ]
}

#[test]
fn requests_packed_into_shared_grouped_steps_produce_what_they_produce_alone() -> Result<()> {
    let (model, planner) = fixture()?;
    let specs = mixed_requests();
    let alone: Vec<_> = specs
        .iter()
        .map(|s| {
            Ok(run(&model, vec![program(&planner, s.clone())?], &[])?
                .records
                .remove(0))
        })
        .collect::<Result<_>>()?;
    // All at once, then request k joining at tick 3k (mid-way through the others' diagonals).
    for join in [vec![], (0..specs.len()).map(|k| 3 * k).collect::<Vec<_>>()] {
        let programs = specs
            .iter()
            .map(|s| program(&planner, s.clone()))
            .collect::<Result<Vec<_>>>()?;
        let packed = run(&model, programs, &join)?;
        ensure!(
            packed.cells.iter().any(|&c| c > 3),
            "no grouped step held cells of several requests: {:?}",
            packed.cells
        );
        for (k, (got, want)) in packed.records.iter().zip(&alone).enumerate() {
            ensure!(
                got.tokens == want.tokens,
                "request {k}: {:?} vs {:?}",
                got.tokens,
                want.tokens
            );
            ensure!(
                got.finish == want.finish,
                "request {k}: {:?} vs {:?}",
                got.finish,
                want.finish
            );
            // Summation-order noise only: sharing a layer gives the grouped matmul more rows,
            // which changes the CPU GEMM's blocking (about 2e-7 relative per step, see the
            // models crate's `a_cell_does_not_see_the_cells_it_shares_a_step_with`); the
            // recurrence amplifies it to about 1e-4 relative after ten-odd segments with this
            // fixture's random weights (reads divide by q·z + 1e-5), flat with length.
            let rel = rel_fro(&got.logits, &want.logits);
            ensure!(rel < 1e-3, "request {k}: logits differ by {rel:e} relative");
        }
    }
    // The stop token ended its request early; every other ran to max_new_tokens.
    for (s, r) in specs.iter().zip(&alone) {
        let (reason, _) = r.finish.as_ref().context("finished")?;
        if s.stop_token_ids.is_empty() {
            ensure!(*reason == FinishReason::Length && r.tokens.len() == s.max_new_tokens);
        } else {
            ensure!(*reason == FinishReason::StopToken, "{:?}", r.tokens);
            ensure!(r.tokens.last() == Some(&79) && r.tokens.len() < s.max_new_tokens);
        }
    }
    Ok(())
}

/// `||a - b|| / ||b||` over logits rows.
fn rel_fro(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        for (u, v) in x.iter().zip(y) {
            num += f64::from(u - v).powi(2);
            den += f64::from(*v).powi(2);
        }
    }
    (num / den).sqrt()
}

#[test]
fn eight_long_prompts_take_fewer_grouped_steps_together_than_apart() -> Result<()> {
    let (model, planner) = fixture()?;
    let specs: Vec<GenerateSpec> = (0..8)
        .map(|k| spec(prompt(40 + 13 * k, k as u32), 3, Execution::Diagonal))
        .collect();
    let mut apart = 0;
    let mut alone = Vec::new();
    for s in &specs {
        let r = run(&model, vec![program(&planner, s.clone())?], &[])?;
        let segments = s.prompt_ids.len().div_ceil(8);
        // One request: the minimum, segments + layers - 1.
        ensure!(r.grouped_steps == segments + 3 - 1);
        apart += r.grouped_steps;
        alone.push(r.records[0].clone());
    }
    let programs = specs
        .iter()
        .map(|s| program(&planner, s.clone()))
        .collect::<Result<Vec<_>>>()?;
    let together = run(&model, programs, &[])?;
    ensure!(
        model.stream_pool().in_use() == 0 && model.memory_pool().in_use() == 0,
        "every stream and memory slot came back"
    );
    // Started together, they finish their prompts with the longest one.
    let longest = specs
        .iter()
        .map(|s| s.prompt_ids.len().div_ceil(8))
        .max()
        .unwrap_or(0);
    ensure!(
        together.grouped_steps == longest + 2,
        "{}",
        together.grouped_steps
    );
    ensure!(
        together.grouped_steps * 4 < apart,
        "{} vs {apart}",
        together.grouped_steps
    );
    for (got, want) in together.records.iter().zip(&alone) {
        ensure!(got.tokens == want.tokens && got.finish == want.finish);
    }

    // The same through the engine: eight concurrent requests take fewer ticks than eight runs.
    let served = serve(fixture_files()?, "armt-fixture", 8)?;
    let mut apart_ticks = 0;
    for s in &specs {
        let before = served.load().ticks;
        collect(&submit(served.as_ref(), s.clone())?, Vec::new())?;
        apart_ticks += served.load().ticks - before;
    }
    let before = served.load().ticks;
    let receivers = specs
        .iter()
        .map(|s| submit(served.as_ref(), s.clone()))
        .collect::<Result<Vec<_>>>()?;
    for (rx, want) in receivers.iter().zip(&alone) {
        let got = collect(rx, Vec::new())?;
        ensure!(got.tokens == want.tokens);
        let (_, stats) = want.finish.as_ref().context("finished")?;
        ensure!(got.stats.counters == stats.counters && got.stats.series == stats.series);
    }
    let together_ticks = served.load().ticks - before;
    ensure!(
        together_ticks * 4 < apart_ticks,
        "{together_ticks} vs {apart_ticks}"
    );
    wait_for_free_slots(served.as_ref(), Duration::from_secs(20))?;
    served.shutdown();
    Ok(())
}

#[test]
fn prompts_longer_than_the_backbone_context_run_and_cancelling_one_frees_its_slots() -> Result<()> {
    let opts = LoadOptions {
        max_context_tokens: Some(1 << 20),
        ..LoadOptions::default()
    };
    let served = load_model(fixture_files()?, opts)?;
    let info = served.info().clone();
    ensure!(info.family == "recurrent_memory" && info.schemes == vec!["ar"]);
    ensure!(info.max_context == 1 << 20);
    // 2000 tokens: eight times the backbone's 256 positions.
    let long = prompt(2000, 9);
    for execution in [Execution::Sequential, Execution::Diagonal] {
        let out = collect(
            &submit(served.as_ref(), spec(long.clone(), 2, execution))?,
            Vec::new(),
        )?;
        ensure!(out.tokens.len() == 2 && out.stats.counters["segments"] == 250);
    }
    // Cancel a 4000-token request mid-prefill (its first token needs 500+ ticks).
    let (sink, rx, closed) = TestSink::new(16);
    let before = served.load().ticks;
    served.submit(
        spec(prompt(4000, 10), 4, Execution::Diagonal),
        Box::new(sink),
        None,
        tracing::Span::none(),
    )?;
    let start = Instant::now();
    while served.load().ticks < before + 20 {
        ensure!(start.elapsed() < Duration::from_secs(60), "engine stalled");
        std::thread::sleep(Duration::from_millis(2));
    }
    ensure!(served.load().free_slots < served.load().total_slots);
    closed.store(true, Ordering::Release);
    wait_for_free_slots(served.as_ref(), Duration::from_secs(20))?;
    ensure!(
        rx.try_recv().is_err(),
        "the cancelled request produced a token"
    );
    // The engine goes on serving.
    let out = collect(
        &submit(served.as_ref(), spec(prompt(20, 1), 2, Execution::Auto))?,
        Vec::new(),
    )?;
    ensure!(out.tokens.len() == 2);
    served.shutdown();
    Ok(())
}

/// Sixteen requests (every execution, one to sixteen segments, greedy, seeded and stopped) at
/// once on a pool of 64 pages (a request holds 24 to 33 over its life, its cache growing a page
/// per layer every 16 generated tokens): requests are preempted
/// (cache pages, memories and residual streams to host memory) and resumed in other pages, and
/// each produces exactly what it produces alone with room to spare.
#[test]
fn requests_preempted_for_pages_produce_what_they_produce_alone() -> Result<()> {
    let mut specs = mixed_requests();
    for (k, e) in [Execution::Auto, Execution::Sequential, Execution::Diagonal]
        .into_iter()
        .cycle()
        .take(8)
        .enumerate()
    {
        let mut s = spec(prompt(5 + 17 * k, 20 + k as u32), 20 + 6 * k, e);
        if k % 3 == 1 {
            s.sampling.temperature = 0.9;
            s.sampling.seed = k as u64;
        }
        specs.push(s);
    }
    let roomy = serve(fixture_files()?, "armt-fixture", specs.len())?;
    let preemptions = crate::test_support::assert_preempted_requests_match_alone(
        fixture_files()?,
        roomy.as_ref(),
        64 * 4096,
        &specs,
    )?;
    ensure!(preemptions > 0, "16 requests on 64 pages must preempt");
    roomy.shutdown();
    Ok(())
}

#[test]
fn requests_are_validated_and_reserve_flat_slots() -> Result<()> {
    let (_, planner) = fixture()?;
    let base = || spec(prompt(44, 0), 8, Execution::Auto);
    let cases: Vec<(GenerateSpec, &str)> = vec![
        (
            GenerateSpec {
                scheme: SchemeParams::Ar(ArParams {
                    num_steps: Some(4),
                    ..ArParams::default()
                }),
                ..base()
            },
            "ar.num_steps applies to recurrent-depth models",
        ),
        (
            GenerateSpec {
                scheme: SchemeParams::Ar(ArParams {
                    continuous_compute: true,
                    ..ArParams::default()
                }),
                ..base()
            },
            "ar.continuous_compute applies to recurrent-depth models",
        ),
        (
            GenerateSpec {
                scheme: SchemeParams::LowConfidence(LowConfidenceParams::default()),
                ..base()
            },
            "not served by recurrent-memory models",
        ),
        // Last segment 4 tokens: generation may reach 4 + 253 - 1 = 256 positions, not more.
        (
            spec(prompt(44, 0), 254, Execution::Auto),
            "lower max_new_tokens to at most 253",
        ),
    ];
    assert_invalid(&planner, cases)?;
    ensure!(planner
        .prepare(spec(prompt(44, 0), 253, Execution::Auto))
        .is_ok());
    // The configured context limit, not the backbone's, bounds the prompt.
    let cfg = super::config(&fixture_files()?)?;
    let small = ArmtPlanner::new(cfg, "small".into(), DType::F32, 100);
    match small.prepare(spec(prompt(90, 0), 20, Execution::Auto)) {
        Err(RequestError::InvalidArgument(m)) => ensure!(m.contains("context limit of 100"), "{m}"),
        other => bail!("{other:?}"),
    }
    match small.prepare(spec(prompt(100, 0), 1, Execution::Auto)) {
        Err(RequestError::TooLarge(m)) => ensure!(m.contains("context limit is 100"), "{m}"),
        other => bail!("{other:?}"),
    }
    // auto: diagonal from two segments on.
    ensure!(!program(&planner, spec(prompt(8, 0), 2, Execution::Auto))?.is_diagonal());
    ensure!(program(&planner, spec(prompt(9, 0), 2, Execution::Auto))?.is_diagonal());
    ensure!(!program(&planner, spec(prompt(90, 0), 2, Execution::Sequential))?.is_diagonal());
    // Slots: one unit is a page, 16 positions' K/V in one layer (16 · 2 · 2 · 16 · 4 bytes =
    // 4096). Memories 3 × ceil(4 · (96 · 64 + 96) / 4096) = 21; cache: a segment's cell of
    // 8 + 4 rows, or the prompt segment and max_new_tokens (4 + 8), one page per layer: 3;
    // diagonal in-flight streams ceil(3 × 12 × 64 · 4 / 4096) = 3. None of it depends on the
    // prompt's length, and the first step already takes all of it.
    ensure!(planner.slot_bytes() == 4096);
    let slots = |len: usize, e| {
        planner
            .prepare(spec(prompt(len, 0), 8, e))
            .map(|p| (p.slots, p.max_slots))
    };
    ensure!(slots(44, Execution::Sequential)? == (21 + 3, 21 + 3));
    ensure!(slots(44, Execution::Diagonal)? == (21 + 3 + 3, 21 + 3 + 3));
    ensure!(slots(44 + 8 * 1000, Execution::Diagonal)? == slots(44, Execution::Diagonal)?);
    // A pool smaller than one request refuses it at once.
    let (needed, total) = refused_as_too_large(fixture_files()?, 4096 * 20, base())?;
    ensure!((needed, total) == (27, 20), "{needed} of {total}");
    Ok(())
}

#[test]
fn recurrent_depth_models_refuse_an_execution_mode() -> Result<()> {
    let dir = fixture_dir().join("../huginn");
    let files = wavefront_models::ModelFiles::from_dir(dir)?;
    let cfg = wavefront_models::HuginnConfig::from_json(files.config_json())?;
    let planner = crate::recurrent_depth::HuginnPlanner::new(cfg, "huginn".into(), None);
    let s = spec(vec![1, 2, 3], 2, Execution::Diagonal);
    match planner.prepare(s) {
        Err(RequestError::InvalidArgument(m)) => {
            ensure!(
                m.contains("ar.execution `diagonal` applies to recurrent-memory"),
                "{m}"
            )
        }
        other => bail!("{other:?}"),
    }
    ensure!(planner
        .prepare(spec(vec![1, 2, 3], 2, Execution::Auto))
        .is_ok());
    Ok(())
}

/// The served model split over 2 and 4 in-process tensor-parallel ranks decodes what one rank
/// decodes, for every execution and prompt length (diagonal prompt segments keep each rank's
/// keys for decoding), with the requests sharing grouped steps and layer passes.
#[test]
fn tensor_parallel_serving_decodes_what_one_rank_decodes() -> Result<()> {
    crate::test_support::assert_tensor_parallel_decodes_match(fixture_files, &mixed_requests())
}

/// A transport's stop (a stop string) finishes a request with its statistics so far (the
/// segments of its prompt), and its memories leave the pool.
#[test]
fn a_transport_stop_finishes_with_the_programs_stats() -> Result<()> {
    let served = serve(fixture_files()?, "armt-fixture", 2)?;
    for execution in [Execution::Sequential, Execution::Diagonal] {
        crate::test_support::assert_stop_finishes_with_stats(
            served.as_ref(),
            spec(prompt(80, 3), 12, execution),
            |st| {
                // 80 prompt tokens in the fixture's 8-token segments.
                ensure!(st.forward_passes > 0 && st.counters["segments"] == 10);
                Ok(())
            },
        )?;
    }
    Ok(())
}

/// Every request of the mix, moved to a second engine of the same checkpoint after its first
/// event and back after its next (stopped at a step boundary, its state exported and resumed in
/// other slots), produces exactly what it produces alone: tokens, finish reason and every
/// statistic but timing, with its moves counted.
#[test]
fn requests_moved_between_workers_produce_what_they_produce_alone() -> Result<()> {
    let specs = mixed_requests();
    let served = serve(fixture_files()?, "armt-fixture", specs.len())?;
    crate::test_support::assert_moved_requests_match_alone(
        fixture_files()?,
        served.as_ref(),
        &specs,
    )?;
    served.shutdown();
    Ok(())
}

/// A fault in one request's plan, forward or commit fails that request only, beside a request of
/// the other execution.
#[test]
fn an_injected_fault_fails_only_its_request() -> Result<()> {
    let (model, planner) = fixture()?;
    let diag = spec(prompt(40, 0), 4, Execution::Diagonal);
    let seq = spec(prompt(30, 1), 4, Execution::Sequential);
    for (faulty, ok) in [(diag.clone(), seq.clone()), (seq, diag)] {
        crate::fault_tests::assert_faults_fail_only_their_request(
            || Ok(super::RecurrentMemoryFamily::new(model.clone())),
            || Ok(planner.prepare(faulty.clone())?.program),
            || Ok(planner.prepare(ok.clone())?.program),
        )?;
    }
    Ok(())
}
