//! The masked-diffusion family behind the real engine thread: batch invariance across mixed
//! schemes (low-confidence with every option, WINO, SureLock on both), prompt, generation and
//! block lengths, with requests joining at different ticks; slot accounting; early stop; request
//! validation; classifier-free guidance against a hand-computed first step.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use candle_core::{Tensor, D};
use wavefront_engine::FinishReason;
use wavefront_models::transformer::SeqInput;

use super::test_support::*;
use crate::request::{
    GenerateSpec, KvCacheMode, LowConfidenceParams, Remasking, SchemeParams, WinoParams,
};
use crate::served::{Planner, ServedModel};
use crate::test_support::{
    assert_ends_at_first_stop, assert_invalid, assert_joining_requests_match_alone,
    refused_as_too_large, serve, submit, wait_for_free_slots, Outcome,
};

fn lc(p: LowConfidenceParams) -> SchemeParams {
    SchemeParams::LowConfidence(p)
}

fn wn(p: WinoParams) -> SchemeParams {
    SchemeParams::Wino(p)
}

fn sampled(mut s: GenerateSpec, temperature: f32) -> GenerateSpec {
    s.sampling.temperature = temperature;
    s
}

/// Fourteen requests over both schemes and their options, with different prompt, generation
/// and block lengths.
fn mixed_requests() -> Vec<GenerateSpec> {
    vec![
        spec(prompt(5, 0), 16, 1, lc(low_confidence(8, 16))),
        spec(prompt(12, 1), 32, 2, lc(low_confidence(16, 16))),
        spec(
            prompt(3, 2),
            8,
            3,
            lc(LowConfidenceParams {
                remasking: Remasking::Random,
                ..low_confidence(4, 8)
            }),
        ),
        sampled(
            spec(
                prompt(6, 3),
                12,
                42,
                lc(LowConfidenceParams {
                    steps: Some(6),
                    ..LowConfidenceParams::default()
                }),
            ),
            0.8,
        ),
        spec(
            prompt(4, 4),
            8,
            5,
            lc(LowConfidenceParams {
                cfg_scale: 1.5,
                ..low_confidence(8, 8)
            }),
        ),
        spec(
            prompt(9, 5),
            24,
            6,
            lc(LowConfidenceParams {
                surelock: surelock(1e-2, Some(50.0)),
                ..low_confidence(24, 24)
            }),
        ),
        spec(
            prompt(7, 6),
            16,
            7,
            lc(LowConfidenceParams {
                surelock: surelock(5e-2, None),
                ..low_confidence(8, 16)
            }),
        ),
        spec(prompt(7, 7), 16, 8, wn(wino(8))),
        spec(
            prompt(10, 8),
            16,
            9,
            wn(WinoParams {
                surelock: surelock(1e-2, None),
                ..wino(16)
            }),
        ),
        sampled(
            spec(
                prompt(2, 9),
                12,
                10,
                wn(WinoParams {
                    threshold: 0.5,
                    ..wino(4)
                }),
            ),
            0.7,
        ),
        {
            let mut s = spec(prompt(8, 10), 24, 11, lc(low_confidence(8, 12)));
            s.stop_token_ids = vec![183, 222];
            s
        },
        {
            let mut s = spec(prompt(6, 11), 16, 12, wn(wino(8)));
            s.stop_token_ids = vec![183];
            s
        },
        spec(prompt(11, 12), 20, 13, lc(low_confidence(5, 20))),
        spec(
            prompt(5, 13),
            16,
            14,
            wn(WinoParams {
                surelock: surelock(5e-2, Some(50.0)),
                ..wino(8)
            }),
        ),
        // Fast-dLLM: both caches, the threshold rule, upstream's calls, a sampled run.
        spec(
            prompt(6, 14),
            24,
            15,
            lc(LowConfidenceParams {
                kv_cache: KvCacheMode::Prefix,
                threshold: Some(0.5),
                ..low_confidence(8, 3)
            }),
        ),
        spec(
            prompt(9, 15),
            16,
            16,
            lc(LowConfidenceParams {
                kv_cache: KvCacheMode::Dual,
                upstream_calls: true,
                ..low_confidence(4, 16)
            }),
        ),
        spec(
            prompt(3, 16),
            16,
            17,
            lc(LowConfidenceParams {
                threshold: Some(0.9),
                ..low_confidence(16, 1)
            }),
        ),
        spec(
            prompt(7, 18),
            32,
            19,
            lc(LowConfidenceParams {
                kv_cache: KvCacheMode::Prefix,
                surelock: surelock(5e-2, None),
                ..low_confidence(16, 32)
            }),
        ),
        sampled(
            spec(
                prompt(5, 17),
                16,
                18,
                lc(LowConfidenceParams {
                    kv_cache: KvCacheMode::Dual,
                    threshold: Some(0.7),
                    ..low_confidence(8, 2)
                }),
            ),
            0.9,
        ),
    ]
}

fn fixture_served(max_active: usize) -> Result<Arc<dyn ServedModel>> {
    serve(fixture_files()?, "llada-fixture", max_active)
}

#[test]
fn requests_joining_at_different_ticks_produce_what_they_produce_alone() -> Result<()> {
    let specs = mixed_requests();
    let served = fixture_served(specs.len())?;
    assert_eq!(served.info().family, "masked_diffusion");
    assert_eq!(served.info().schemes, vec!["low-confidence", "wino"]);
    // Request i joins once request i - 1 has produced an event, so requests enter a batch that
    // is already running, in other blocks and other schemes.
    let alone = assert_joining_requests_match_alone(served.as_ref(), &specs, |_| true)?;
    for (s, o) in specs.iter().zip(&alone) {
        ensure!(
            o.tokens.iter().all(|&t| t != 460),
            "a mask token was streamed"
        );
        // The fixture's eos (449) always stops; the request's stop ids too. A response that ran
        // to its length decoded every block.
        if !assert_ends_at_first_stop(s, o, 449)? {
            let block = match &s.scheme {
                SchemeParams::LowConfidence(p) => p.block_length,
                SchemeParams::Wino(p) => p.block_length,
                _ => None,
            };
            let blocks = s.max_new_tokens / block.unwrap_or(s.max_new_tokens);
            ensure!(o.stats.counters["blocks"] == blocks as u64);
        }
    }
    // SureLock computed fewer rows as it went and reports its FLOPs ratio.
    for (s, o) in specs.iter().zip(&alone) {
        let surelock = match &s.scheme {
            SchemeParams::LowConfidence(p) => p.surelock.is_some(),
            SchemeParams::Wino(p) => p.surelock.is_some(),
            _ => false,
        };
        let rows = &o.stats.series["active_rows"];
        ensure!(rows.len() as u64 == o.stats.forward_passes);
        if surelock {
            let ppm = o.stats.counters["flops_ratio_ppm"];
            ensure!(ppm > 0 && ppm < 1_000_000, "ratio {ppm}");
            ensure!(rows.last() < rows.first(), "{rows:?}");
            ensure!(o.stats.counters["locked"] > 0);
        }
    }
    // Every slot came back.
    wait_for_free_slots(served.as_ref(), Duration::from_secs(10))?;
    served.shutdown();
    Ok(())
}

/// `sampling.top_k` and `top_p` restrict low-confidence and WINO draws (issue 42, N6: they
/// were refused): a filter that leaves one token draws what any other such filter draws, and
/// a nucleus of 0.9 is served.
#[test]
fn top_k_and_top_p_restrict_the_draws() -> Result<()> {
    let served = fixture_served(4)?;
    let golden = Golden::load()?;
    for scheme in [lc(low_confidence(8, 16)), wn(wino(8))] {
        let filtered = |top_k: usize, top_p: f32| -> Result<Vec<u32>> {
            let mut s = sampled(spec(golden.prompt(), 16, 7, scheme.clone()), 1.0);
            s.sampling.top_k = top_k;
            s.sampling.top_p = top_p;
            Ok(collect(&submit(served.as_ref(), s)?, Vec::new())?.tokens)
        };
        let one = filtered(1, 0.0)?;
        ensure!(
            one == filtered(0, 1e-6)?,
            "{}: top-1 against a tiny nucleus",
            scheme.name()
        );
        ensure!(!one.is_empty());
        let nucleus = filtered(0, 0.9)?;
        ensure!(!nucleus.is_empty(), "{}", scheme.name());
    }
    served.shutdown();
    Ok(())
}

#[test]
fn a_stop_token_ends_the_response_early() -> Result<()> {
    let served = fixture_served(4)?;
    let golden = Golden::load()?;
    // bl8/steps32 commits 183 at generated index 4 (position 12) at its second step, before
    // the positions ahead of it: the canvas stays whole until they are committed, then is cut,
    // and the response is upstream's prefix up to the stop token.
    let run = golden.json["generate_runs"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["name"] == "generate.bl8.steps32"))
        .context("run generate.bl8.steps32")?;
    let upstream: Vec<u32> = serde_json::from_value(run["generated_ids"].clone())?;
    let stop = upstream
        .iter()
        .position(|&t| t == 183)
        .context("183 in the run")?;
    let mut s = spec(golden.prompt(), 32, 0, lc(low_confidence(8, 32)));
    s.stop_token_ids = vec![183];
    let out = collect(&submit(served.as_ref(), s)?, Vec::new())?;
    ensure!(out.reason == FinishReason::StopToken, "{out:?}");
    ensure!(out.tokens == upstream[..=stop], "{:?}", out.tokens);
    // The stop is in the first block (8 steps): the later blocks are never decoded.
    ensure!(
        out.stats.forward_passes <= 8,
        "{}",
        out.stats.forward_passes
    );

    // WINO stops at block granularity: the first block (15 steps upstream) holds 183 at
    // generated index 11, and the response is upstream's prefix up to it.
    let w = &golden.json["wino"];
    let upstream: Vec<u32> = serde_json::from_value(w["generated_ids"].clone())?;
    let mut s = spec(golden.prompt(), 32, 0, wn(wino(16)));
    s.stop_token_ids = vec![183];
    let out = collect(&submit(served.as_ref(), s)?, Vec::new())?;
    ensure!(out.reason == FinishReason::StopToken);
    ensure!(out.tokens == upstream[..12], "{:?}", out.tokens);
    ensure!(
        out.stats.forward_passes == 15,
        "{}",
        out.stats.forward_passes
    );
    served.shutdown();
    Ok(())
}

/// `max_new_tokens` that whole blocks do not fill is a cap, as OpenAI's `max_tokens` is: the
/// canvas is rounded up to whole blocks, decoded as upstream decodes that canvas, and the
/// response stops at the cap.
#[test]
fn max_new_tokens_is_a_cap_when_blocks_do_not_divide_it() -> Result<()> {
    let served = fixture_served(4)?;
    let golden = Golden::load()?;
    for (scheme, cap) in [
        (lc(low_confidence(8, 32)), 27),
        (lc(low_confidence(8, 32)), 25),
        (wn(wino(16)), 27),
        (wn(wino(16)), 17),
    ] {
        let run = |max| -> Result<Outcome> {
            let mut s = spec(golden.prompt(), max, 0, scheme.clone());
            s.stop_token_ids = Vec::new();
            collect(&submit(served.as_ref(), s)?, Vec::new())
        };
        let whole = run(32)?;
        let capped = run(cap)?;
        let name = scheme.name();
        ensure!(
            whole.tokens.len() > cap,
            "{name}: the whole canvas stopped early"
        );
        ensure!(
            capped.tokens == whole.tokens[..cap],
            "{name} capped at {cap}: {:?}, whole canvas {:?}",
            capped.tokens,
            whole.tokens
        );
        ensure!(capped.reason == FinishReason::Length, "{name}: {capped:?}");
        ensure!(
            capped.stats.generated_tokens as usize == cap,
            "{name}: {:?}",
            capped.stats
        );
    }
    served.shutdown();
    Ok(())
}

#[test]
fn invalid_requests_are_refused_with_the_rule_they_break() -> Result<()> {
    let (_, planner) = fixture()?;
    let base = || spec(prompt(4, 0), 16, 0, lc(low_confidence(8, 16)));
    let with = |scheme| GenerateSpec { scheme, ..base() };
    let cases: Vec<(GenerateSpec, &str)> = vec![
        (
            with(lc(low_confidence(0, 12))),
            "block_length must be at least 1",
        ),
        (
            with(lc(low_confidence(8, 15))),
            "steps (15) must be divisible by the number of blocks",
        ),
        (with(lc(low_confidence(8, 0))), "steps must be at least 1"),
        (
            with(lc(LowConfidenceParams {
                cfg_scale: -1.0,
                ..low_confidence(8, 16)
            })),
            "cfg_scale must be finite and >= 0",
        ),
        (
            with(lc(LowConfidenceParams {
                cfg_scale: 1.0,
                surelock: surelock(1e-3, None),
                ..low_confidence(8, 16)
            })),
            "cannot be combined with cfg_scale",
        ),
        (
            with(lc(LowConfidenceParams {
                surelock: surelock(-1.0, None),
                ..low_confidence(8, 16)
            })),
            "surelock_eps must be finite and >= 0",
        ),
        (
            with(wn(WinoParams {
                surelock: surelock(1e-3, Some(0.0)),
                ..wino(8)
            })),
            "surelock_percentile must be in (0, 100]",
        ),
        (
            with(wn(WinoParams {
                threshold: 0.0,
                ..wino(8)
            })),
            "wino.threshold must be in (0, 1]",
        ),
        (
            with(wn(WinoParams {
                threshold_back: 1.5,
                ..wino(8)
            })),
            "wino.threshold_back must be in (0, 1]",
        ),
        (
            with(wn(WinoParams {
                threshold: 0.95,
                threshold_back: 0.9,
                ..wino(8)
            })),
            "must not exceed wino.threshold_back",
        ),
        (
            with(lc(LowConfidenceParams {
                threshold: Some(0.0),
                ..low_confidence(8, 16)
            })),
            "low_confidence.threshold must be in (0, 1]",
        ),
        (
            with(lc(LowConfidenceParams {
                threshold: Some(0.9),
                remasking: Remasking::Random,
                ..low_confidence(8, 16)
            })),
            "needs remasking `low_confidence`",
        ),
        (
            with(lc(LowConfidenceParams {
                kv_cache: KvCacheMode::Prefix,
                cfg_scale: 1.0,
                ..low_confidence(8, 16)
            })),
            "kv_cache `prefix` cannot be combined with cfg_scale",
        ),
        (
            with(lc(LowConfidenceParams {
                upstream_calls: true,
                ..low_confidence(8, 16)
            })),
            "upstream_calls applies to kv_cache `prefix` and `dual`",
        ),
        (
            with(lc(LowConfidenceParams {
                upstream_calls: true,
                threshold: Some(0.9),
                ..low_confidence(8, 16)
            })),
            "upstream_calls applies to kv_cache `prefix` and `dual`",
        ),
        (
            spec(prompt(4, 0), 4090, 0, lc(low_confidence(8, 512))),
            "rounded up to whole blocks of 8 is 4100 positions",
        ),
        (
            with(SchemeParams::Ar(Default::default())),
            "not served by masked-diffusion models",
        ),
        (
            spec(prompt(4, 0), 4093, 0, lc(LowConfidenceParams::default())),
            "context limit",
        ),
    ];
    assert_invalid(&planner, cases)?;
    // Defaults: block_length and steps default to gen_length.
    ensure!(planner
        .prepare(with(lc(LowConfidenceParams::default())))
        .is_ok());
    ensure!(planner.prepare(with(wn(WinoParams::default()))).is_ok());
    // SureLock reserves its cache and posteriors; WINO its shadow rows.
    let slots = |scheme| planner.prepare(with(scheme)).map(|p| p.slots);
    let plain = slots(lc(low_confidence(8, 16)))?;
    ensure!(plain == 20);
    ensure!(slots(wn(wino(8)))? == 28);
    let locked = slots(lc(LowConfidenceParams {
        surelock: surelock(1e-3, None),
        ..low_confidence(8, 16)
    }))?;
    ensure!(locked == 20 + 20 * 2 + 20 * 4, "{locked}");
    // A request larger than the pool is refused at once.
    let (needed, total) = refused_as_too_large(fixture_files()?, 512 * 10, base())?;
    ensure!((needed, total) == (20, 10), "{needed} of {total} slots");
    Ok(())
}

#[test]
fn classifier_free_guidance_commits_what_the_guided_logits_say() -> Result<()> {
    let (model, planner) = fixture()?;
    let golden = Golden::load()?;
    let prompt_ids = golden.prompt();
    let scale = 0.5f64;
    let s = spec(
        prompt_ids.clone(),
        8,
        0,
        lc(LowConfidenceParams {
            cfg_scale: scale as f32,
            ..low_confidence(8, 8)
        }),
    );
    let mut programs = vec![program(&planner, s)?];
    run(&model, &mut programs)?;
    // First step by hand: guided logits of the masked positions, best confidence first.
    let p = prompt_ids.len();
    let x: Vec<u32> = prompt_ids
        .iter()
        .copied()
        .chain(std::iter::repeat_n(460, 8))
        .collect();
    let un: Vec<u32> = std::iter::repeat_n(460, p + 8).collect();
    let logits = |ids: &[u32]| -> Result<Tensor> {
        Ok(model.logits(&model.forward(ids, &mut [SeqInput::dense(ids.len())])?)?)
    };
    let (cond, uncond) = (logits(&x)?, logits(&un)?);
    let guided = (&uncond + ((cond - &uncond)? * (scale + 1.0))?)?.narrow(0, p, 8)?;
    let argmax: Vec<u32> = guided.argmax(D::Minus1)?.to_vec1()?;
    let conf: Vec<f32> = candle_core::Tensor::ones(8, candle_core::DType::F32, guided.device())?
        .div(
            &(guided
                .broadcast_sub(&guided.max_keepdim(D::Minus1)?)?
                .exp()?
                .sum(D::Minus1)?),
        )?
        .to_vec1()?;
    // The first maximum (no exact ties at this scale).
    let best = (0..8)
        .rev()
        .max_by(|&a, &b| conf[a].total_cmp(&conf[b]))
        .context("best")?;
    let first = &programs[0].steps()[0];
    ensure!(
        first.committed == vec![p + best] && first.tokens == vec![argmax[best]],
        "{first:?} vs {best} {argmax:?} {conf:?}"
    );
    Ok(())
}

#[test]
fn canvas_snapshots_show_every_step_and_change_nothing() -> Result<()> {
    use wavefront_engine::CellState;
    let served = fixture_served(8)?;
    // (request, drafts expected, locks expected)
    let cases = [
        (
            spec(prompt(5, 0), 16, 1, lc(low_confidence(8, 16))),
            false,
            false,
        ),
        (spec(prompt(6, 1), 16, 2, wn(wino(8))), true, false),
        (
            spec(
                prompt(7, 2),
                16,
                3,
                lc(LowConfidenceParams {
                    surelock: surelock(1e-2, None),
                    ..low_confidence(16, 16)
                }),
            ),
            false,
            true,
        ),
    ];
    for (plain, drafts, locks) in cases {
        let want = collect(&submit(served.as_ref(), plain.clone())?, Vec::new())?;
        ensure!(want.frames.is_empty(), "frames were not asked for");
        let watched = GenerateSpec {
            stream_canvas: true,
            ..plain.clone()
        };
        let got = collect(&submit(served.as_ref(), watched)?, Vec::new())?;
        ensure!(got.work() == want.work(), "watching changed the result");
        let scheme = plain.scheme.name();
        // One snapshot per forward pass, numbered by it, each covering the whole region.
        ensure!(
            got.frames.len() as u64 == got.stats.forward_passes,
            "{scheme}"
        );
        for (i, f) in got.frames.iter().enumerate() {
            ensure!(f.full && f.step as usize == i + 1, "{scheme}: frame {i}");
            ensure!(f.positions == (0..16).collect::<Vec<u32>>(), "{scheme}");
            ensure!(f.tokens.len() == 16 && f.states.len() == 16, "{scheme}");
            for (t, s) in f.tokens.iter().zip(&f.states) {
                ensure!((*t == 460) == (*s == CellState::Masked), "{scheme}: {f:?}");
            }
        }
        // The last snapshot is the response.
        let last = got.frames.last().context("frames")?;
        ensure!(last.tokens == got.tokens, "{scheme}: {last:?}");
        ensure!(!last.states.contains(&CellState::Masked), "{scheme}");
        // Final states never change back; drafts and locks appear where the scheme has them.
        let seen = |s: CellState| got.frames.iter().any(|f| f.states.contains(&s));
        for w in got.frames.windows(2) {
            for p in 0..16 {
                if matches!(w[0].states[p], CellState::Committed | CellState::Locked) {
                    ensure!(w[1].tokens[p] == w[0].tokens[p], "{scheme}: position {p}");
                }
            }
        }
        ensure!(seen(CellState::Drafted) == drafts, "{scheme}: drafts");
        ensure!(seen(CellState::Locked) == locks, "{scheme}: locks");
    }
    served.shutdown();
    Ok(())
}

/// The served model split over 2 and 4 in-process tensor-parallel ranks decodes what one rank
/// decodes, for every scheme and option (SureLock reads each rank's cached keys back), with the
/// requests sharing ticks.
#[test]
fn tensor_parallel_serving_decodes_what_one_rank_decodes() -> Result<()> {
    crate::test_support::assert_tensor_parallel_decodes_match(fixture_files, &mixed_requests())
}

/// A transport's stop (a stop string) finishes low-confidence and WINO requests with their
/// statistics so far: forward passes and the blocks counter.
#[test]
fn a_transport_stop_finishes_with_the_programs_stats() -> Result<()> {
    let served = fixture_served(2)?;
    for s in [
        spec(prompt(5, 0), 32, 1, lc(low_confidence(8, 32))),
        spec(prompt(7, 1), 32, 2, wn(wino(8))),
    ] {
        crate::test_support::assert_stop_finishes_with_stats(served.as_ref(), s, |st| {
            ensure!(st.forward_passes > 0 && st.counters.contains_key("blocks"));
            Ok(())
        })?;
    }
    Ok(())
}

/// Slots come back as a request stops needing them: a SureLock row's posterior once the row
/// locks, every slot of the rows a committed stop token cut off. Run tick by tick on the fixture
/// (20 rows, 2 layers, 4 posterior slots a row), and served: every slot back at the end.
#[test]
fn locked_posteriors_and_cut_rows_give_their_slots_back() -> Result<()> {
    let (model, planner) = fixture()?;
    let s = spec(
        prompt(4, 0),
        16,
        0,
        lc(LowConfidenceParams {
            surelock: surelock(5e-2, None),
            ..low_confidence(16, 16)
        }),
    );
    let p = planner.prepare(s.clone())?.program;
    let start = p.slots_needed();
    ensure!(start == 20 * (1 + 2 + 4), "{start}");
    let mut driver = wavefront_engine::Standalone::new(super::MaskedDiffusionFamily::new(model));
    driver.add(p);
    let mut needs = vec![start];
    while !driver.is_done(0) {
        driver.tick();
        let p = driver.program(0);
        needs.push(p.slots_needed());
        // The previous posteriors are pool slots, one per row that may still lock.
        let sl = p.surelock.as_ref().expect("surelock");
        let pool = sl.posterior_pool().expect("a step ran");
        ensure!(pool.in_use() == sl.previous_rows());
        ensure!(sl.previous_rows() <= p.tokens().len() - sl.locked_count());
    }
    let (_, mut programs) = driver.into_parts();
    let p = programs.remove(0);
    let locked = p.locked().len();
    let pool = p
        .surelock
        .as_ref()
        .and_then(|s| s.posterior_pool().cloned())
        .expect("a pool");
    ensure!(locked > 0, "this eps locks positions on the fixture");
    // Never more than before; at the end, 4 posterior slots fewer per locked row, and nothing
    // of rows cut after a stop token.
    ensure!(needs.windows(2).all(|w| w[1] <= w[0]), "{needs:?}");
    let rows = p.tokens().len();
    ensure!(
        *needs.last().unwrap_or(&0) == rows * (1 + 2) + (rows - locked) * 4,
        "{needs:?} with {locked} of {rows} rows locked"
    );
    ensure!(*needs.last().unwrap_or(&0) < start);
    drop(p);
    ensure!(
        pool.in_use() == 0,
        "an ended request's posterior slots come back"
    );
    // Served, the engine takes them back as they go, and every slot returns.
    let served = serve(fixture_files()?, "fixture", 4)?;
    let out = collect(&submit(served.as_ref(), s)?, Vec::new())?;
    ensure!(!out.tokens.is_empty());
    wait_for_free_slots(served.as_ref(), Duration::from_secs(10))?;
    served.shutdown();
    Ok(())
}

/// Every request of the mix, moved to a second engine of the same checkpoint after its first
/// event and back after its next (stopped at a step boundary, its state exported and resumed in
/// other slots), produces exactly what it produces alone: tokens, finish reason and every
/// statistic but timing, with its moves counted.
#[test]
fn requests_moved_between_workers_produce_what_they_produce_alone() -> Result<()> {
    let specs = mixed_requests();
    let served = fixture_served(specs.len())?;
    crate::test_support::assert_moved_requests_match_alone(
        fixture_files()?,
        served.as_ref(),
        &specs,
    )?;
    served.shutdown();
    Ok(())
}

/// A fault in one request's plan, forward or commit fails that request only, beside a request of
/// another scheme: low-confidence, WINO, and low-confidence with SureLock.
#[test]
fn an_injected_fault_fails_only_its_request() -> Result<()> {
    let (model, planner) = fixture()?;
    let lc = spec(
        prompt(5, 0),
        8,
        0,
        SchemeParams::LowConfidence(low_confidence(8, 8)),
    );
    let sl = spec(
        prompt(6, 1),
        8,
        0,
        SchemeParams::LowConfidence(LowConfidenceParams {
            surelock: surelock(5e-2, None),
            ..low_confidence(8, 8)
        }),
    );
    let w = spec(prompt(4, 2), 8, 0, SchemeParams::Wino(wino(8)));
    for (faulty, ok) in [(lc.clone(), w.clone()), (w, sl.clone()), (sl, lc)] {
        crate::fault_tests::assert_faults_fail_only_their_request(
            || Ok(super::MaskedDiffusionFamily::new(model.clone())),
            || Ok(planner.prepare(faulty.clone())?.program),
            || Ok(planner.prepare(ok.clone())?.program),
        )?;
    }
    Ok(())
}

/// Fast-dLLM requests whose clients stop reading hold their row caches until a new request
/// needs the pool: it preempts them (their caches to host memory), and once their clients read
/// again they resume in other pages and end with the tokens they make alone.
#[test]
fn fast_dllm_caches_survive_preemption_with_their_tokens() -> Result<()> {
    use crate::test_support::TestSink;
    let fast = |i: u32, kv_cache| {
        spec(
            prompt(10, 20 + i),
            32,
            u64::from(i),
            lc(LowConfidenceParams {
                kv_cache,
                threshold: Some(0.6),
                ..low_confidence(8, 4)
            }),
        )
    };
    let stalled = [fast(0, KvCacheMode::Dual), fast(1, KvCacheMode::Prefix)];
    let fresh = fast(2, KvCacheMode::Dual);
    let roomy = fixture_served(4)?;
    let alone = stalled
        .iter()
        .chain([&fresh])
        .map(|s| collect(&submit(roomy.as_ref(), s.clone())?, Vec::new()))
        .collect::<Result<Vec<_>>>()?;
    let bytes_per_slot = (256u64 << 20) / roomy.load().total_slots as u64;
    roomy.shutdown();
    let (_, planner) = fixture()?;
    let need = planner.prepare(fresh.clone())?.slots;
    // Room for the two stalled requests and not for a third beside them.
    let served = crate::load_model(
        fixture_files()?,
        crate::LoadOptions {
            name: "llada-fixture".into(),
            memory_budget_bytes: (2 * need + need / 2) as u64 * bytes_per_slot,
            max_active: 4,
            ..crate::LoadOptions::default()
        },
    )?;
    let mut readers = Vec::new();
    for s in &stalled {
        let (sink, rx, _) = TestSink::new(1);
        served.submit(s.clone(), Box::new(sink), None, tracing::Span::none())?;
        readers.push(rx);
    }
    // Both pause (their one-event buffers full) holding their slots.
    std::thread::sleep(Duration::from_millis(200));
    let out = collect(&submit(served.as_ref(), fresh)?, Vec::new())?;
    ensure!(
        out.tokens == alone[2].tokens,
        "the new request: {:?}",
        out.tokens
    );
    ensure!(
        served.load().preemptions > 0,
        "nothing was preempted: {:?}",
        served.load()
    );
    for (i, rx) in readers.iter().enumerate() {
        let got = collect(rx, Vec::new())?;
        ensure!(
            got.tokens == alone[i].tokens,
            "stalled request {i}: {:?}, alone {:?}",
            got.tokens,
            alone[i].tokens
        );
    }
    wait_for_free_slots(served.as_ref(), Duration::from_secs(10))?;
    served.shutdown();
    Ok(())
}
