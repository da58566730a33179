//! Golden tests of `entropy-bound` against the upstream fixture (tests/fixtures/diffusion_gemma,
//! see its README): with upstream's random draws replayed, every run's every denoising step (the
//! canvas the denoiser read, the temperature, entropies, argmax, the accepted positions, the next
//! canvas, the stop decision) and its committed canvases, alone and all packed into the same
//! ticks; the batch run's two rows as two requests.

use anyhow::{ensure, Context, Result};
use candle_core::{DType, IndexOp, Tensor};
use serde_json::Value;
use wavefront_models::device::test_device;
use wavefront_models::{DiffusionGemma, DiffusionGemmaConfig, ModelFiles};

use super::{DiffusionGemmaPlanner, GenerationDefaults, UdProgram, UniformDiffusionFamily};
use crate::request::{EntropyBoundParams, GenerateSpec, SchemeParams};
use crate::served::Planner;
use crate::test_support::{run_to_end, spec};

pub(crate) struct Fixture {
    pub(crate) model: DiffusionGemma,
    pub(crate) planner: DiffusionGemmaPlanner,
    pub(crate) json: Value,
    pub(crate) tensors: std::collections::HashMap<String, Tensor>,
}

pub(crate) fn fixture() -> Result<Fixture> {
    let dir = wavefront_models::device::test_fixture("diffusion_gemma");
    let files = ModelFiles::from_dir(&dir)?;
    let cfg = DiffusionGemmaConfig::from_json(files.config_json())?;
    let model = DiffusionGemma::load(files.var_builder(DType::F32, &test_device())?, cfg.clone())?;
    let defaults = GenerationDefaults::from_json(files.generation_config_json().context("gen")?);
    Ok(Fixture {
        model,
        planner: DiffusionGemmaPlanner::new(cfg, defaults, "diffusion_gemma".into(), DType::F32),
        json: serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json"))?)?,
        tensors: candle_core::safetensors::load(dir.join("golden.safetensors"), &test_device())?,
    })
}

/// One request of a recorded run: its row `b`.
pub(crate) struct Case {
    pub(crate) name: String,
    pub(crate) row: usize,
    pub(crate) spec: GenerateSpec,
    /// Upstream's steps of this row up to its canvas's stop, per canvas: global step indices.
    pub(crate) steps: Vec<usize>,
    /// `sequences[b, P:]`.
    pub(crate) committed: Vec<u32>,
}

fn ints(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_dtype(DType::I64)?
        .to_vec1::<i64>()?
        .into_iter()
        .map(|x| x as u32)
        .collect())
}

/// The run's rows as requests, with upstream's draws of each row replayed.
pub(crate) fn cases(fx: &Fixture) -> Result<Vec<Case>> {
    let mut out = Vec::new();
    for run in fx.json["runs"].as_array().context("runs")? {
        let name = run["name"].as_str().context("name")?.to_owned();
        let t = |k: &str| -> Result<&Tensor> {
            fx.tensors
                .get(&format!("run.{name}.{k}"))
                .with_context(|| format!("{name} {k}"))
        };
        let input = t("input_ids")?;
        let (b_rows, p) = input.dims2()?;
        let eff = &run["effective"];
        let kw = &run["kwargs"];
        let stop_off =
            eff["stability_threshold"].is_null() || eff["confidence_threshold"].is_null();
        let canvas_index = ints(t("step.canvas_index")?)?;
        let trace = run["trace"].as_array().context("trace")?;
        for b in 0..b_rows {
            let row = ints(&input.i(b)?)?;
            let prompt: Vec<u32> = match fx.tensors.get(&format!("run.{name}.attention_mask")) {
                Some(m) => {
                    let mask = ints(&m.i(b)?)?;
                    row.iter()
                        .zip(&mask)
                        .filter(|(_, &m)| m == 1)
                        .map(|(&x, _)| x)
                        .collect()
                }
                None => row,
            };
            // This row's steps: every step of its canvas up to the first that stopped it.
            let mut steps = Vec::new();
            let mut finished_canvas = None;
            for (s, tr) in trace.iter().enumerate() {
                let c = canvas_index[s] as usize;
                if finished_canvas == Some(c) {
                    continue;
                }
                steps.push(s);
                if tr["stop"][b].as_bool() == Some(true) {
                    finished_canvas = Some(c);
                }
            }
            let draws = super::recorded_draws(
                t("initial_canvas_draws")?,
                t("step.multinomial")?,
                t("step.renoise_draw")?,
                &canvas_index,
                b,
                &steps,
            )?;
            let opt_usize = |k: &str| kw.get(k).and_then(Value::as_u64).map(|x| x as usize);
            let opt_f32 = |k: &str| kw.get(k).and_then(Value::as_f64).map(|x| x as f32);
            let params = EntropyBoundParams {
                max_denoising_steps: opt_usize("max_denoising_steps"),
                t_max: opt_f32("t_max"),
                t_min: opt_f32("t_min"),
                entropy_bound: opt_f32("entropy_bound"),
                stability_threshold: opt_usize("stability_threshold"),
                confidence_threshold: opt_f32("confidence_threshold"),
                no_early_stop: stop_off,
                initial_canvas: match &run["initial_canvas_passed"] {
                    Value::Null => Vec::new(),
                    v => serde_json::from_value::<Vec<Vec<u32>>>(v.clone())?[b].clone(),
                },
                whole_canvases: true,
            };
            let mut sp = spec(
                prompt,
                kw["max_new_tokens"].as_u64().context("max_new")? as usize,
                0,
                SchemeParams::EntropyBound(params),
            );
            sp.replay_draws = Some(std::sync::Arc::new(draws));
            let seq = ints(&t("sequences")?.i(b)?)?;
            out.push(Case {
                name: format!("{name}[{b}]"),
                row: b,
                spec: sp,
                steps,
                committed: seq[p..].to_vec(),
            });
        }
    }
    Ok(out)
}

pub(crate) fn program(fx: &Fixture, s: GenerateSpec) -> Result<UdProgram> {
    let mut p = fx.planner.prepare(s)?.program;
    p.record_steps();
    Ok(p)
}

fn check(fx: &Fixture, case: &Case, p: &UdProgram) -> Result<()> {
    let name = case.name.split('[').next().unwrap_or("");
    let n = &case.name;
    let t = |k: &str| -> Result<&Tensor> {
        fx.tensors
            .get(&format!("run.{name}.{k}"))
            .with_context(|| format!("{n} {k}"))
    };
    let run = fx.json["runs"]
        .as_array()
        .context("runs")?
        .iter()
        .find(|r| r["name"] == name)
        .context("run")?;
    let trace = run["trace"].as_array().context("trace")?;
    let got = p.steps();
    ensure!(
        got.len() == case.steps.len(),
        "{n}: {} denoising steps, upstream {}",
        got.len(),
        case.steps.len()
    );
    let b = case.row;
    for (g, &s) in got.iter().zip(&case.steps) {
        let tr = &trace[s];
        let at = |k: &str| -> Result<Vec<u32>> { ints(&t(k)?.i((s, b))?) };
        ensure!(
            g.input == at("step.decoder_input")?,
            "{n} step {s}: the canvas read differs"
        );
        ensure!(
            g.cur_step as u64 == tr["cur_step"].as_u64().context("cur_step")?,
            "{n} step {s}: cur_step {}",
            g.cur_step
        );
        let want_t = tr["temperature"].as_f64().context("T")? as f32;
        ensure!(
            g.temperature == want_t,
            "{n} step {s}: T {} vs {want_t}",
            g.temperature
        );
        ensure!(
            g.argmax == at("step.argmax")?,
            "{n} step {s}: argmax differs"
        );
        let want_h: Vec<f32> = t("step.entropy")?.i((s, b))?.to_vec1()?;
        let dh = g
            .entropy
            .iter()
            .zip(&want_h)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        // The README suggests 1e-5; free-running (self-conditioning carries each step's logits
        // into the next) the 280 steps measure median 5e-6, max 1.8e-5, every decision exact.
        ensure!(dh <= 5e-5, "{n} step {s}: entropies differ by {dh}");
        let accepted: Vec<u32> = g.accepted.iter().map(|&a| u32::from(a)).collect();
        ensure!(
            accepted == at("step.accepted_mask")?,
            "{n} step {s}: accepted positions differ"
        );
        ensure!(
            g.next_canvas == at("step.next_canvas_before_freeze")?,
            "{n} step {s}: next canvas differs"
        );
        if let Some(stop) = tr["stop"][b].as_bool() {
            ensure!(g.stop == stop, "{n} step {s}: stop {} vs {stop}", g.stop);
        }
    }
    ensure!(
        p.committed() == case.committed.as_slice(),
        "{n}: committed {:?}, upstream {:?}",
        p.committed(),
        case.committed
    );
    Ok(())
}

#[test]
fn every_run_matches_upstream_step_by_step_with_its_draws_replayed() -> Result<()> {
    let fx = fixture()?;
    let cases = cases(&fx)?;
    ensure!(cases.len() == 9, "8 runs, one of two rows");
    for case in &cases {
        let mut programs = vec![program(&fx, case.spec.clone())?];
        let family = UniformDiffusionFamily::new(fx.model.clone());
        run_to_end(family, &mut programs)?;
        check(&fx, case, &programs[0]).with_context(|| case.name.clone())?;
    }
    Ok(())
}

#[test]
fn every_run_packed_into_the_same_ticks_matches_upstream() -> Result<()> {
    let fx = fixture()?;
    let cases = cases(&fx)?;
    let mut programs = cases
        .iter()
        .map(|c| program(&fx, c.spec.clone()))
        .collect::<Result<Vec<_>>>()?;
    let family = UniformDiffusionFamily::new(fx.model.clone());
    run_to_end(family, &mut programs)?;
    for (case, p) in cases.iter().zip(&programs) {
        check(&fx, case, p).with_context(|| format!("{} packed", case.name))?;
    }
    Ok(())
}

fn eb(steps: usize, stability: usize, confidence: f32, whole: bool) -> SchemeParams {
    SchemeParams::EntropyBound(EntropyBoundParams {
        max_denoising_steps: Some(steps),
        stability_threshold: Some(stability),
        confidence_threshold: Some(confidence),
        whole_canvases: whole,
        ..EntropyBoundParams::default()
    })
}

/// Requests of every kind: chat and raw prompts of different lengths, one to three canvases,
/// early stop or every step, cut or whole canvases, seeds, stop ids, and one replaying
/// upstream's draws.
fn mixed_requests() -> Vec<GenerateSpec> {
    let fx = fixture().expect("fixture");
    let chat = ints(&fx.tensors["run.default.chat.input_ids"]).expect("ids");
    let p = |len: usize, salt: u32| -> Vec<u32> {
        (0..len as u32)
            .map(|i| 21 + (i * 37 + salt * 101) % 419)
            .collect()
    };
    let mut specs = vec![
        spec(chat.clone(), 32, 1, eb(12, 1, 0.6, false)),
        spec(p(5, 1), 16, 2, eb(8, 0, 0.9, false)),
        spec(p(40, 2), 40, 3, eb(6, 2, 0.05, true)),
        spec(p(12, 3), 7, 4, eb(10, 1, 0.8, false)),
        spec(chat, 24, 5, {
            let mut e = eb(9, 1, 0.5, false);
            if let SchemeParams::EntropyBound(p) = &mut e {
                p.no_early_stop = true;
            }
            e
        }),
    ];
    specs[3].stop_token_ids = vec![121, 496];
    let replay = cases(&fx).expect("cases").remove(0);
    specs.push(replay.spec);
    specs
}

#[test]
fn requests_joining_a_running_batch_produce_what_they_produce_alone() -> Result<()> {
    use crate::test_support::{assert_joining_requests_match_alone, serve, wait_for_free_slots};
    let dir = wavefront_models::device::test_fixture("diffusion_gemma");
    let served = serve(ModelFiles::from_dir(&dir)?, "diffusion_gemma", 8)?;
    let mut specs = mixed_requests();
    specs[0].stream_canvas = true;
    let alone = assert_joining_requests_match_alone(served.as_ref(), &specs, |_| true)?;
    for (s, o) in specs.iter().zip(&alone) {
        let whole = matches!(&s.scheme, SchemeParams::EntropyBound(p) if p.whole_canvases);
        if !whole {
            crate::test_support::assert_ends_at_first_stop(s, o, 1)
                .or_else(|_| crate::test_support::assert_ends_at_first_stop(s, o, 16))
                .or_else(|_| crate::test_support::assert_ends_at_first_stop(s, o, 9))?;
        } else {
            ensure!(o.tokens.len() % 16 == 0, "whole canvases");
        }
    }
    ensure!(!alone[0].frames.is_empty(), "canvas frames were asked for");
    wait_for_free_slots(served.as_ref(), std::time::Duration::from_secs(10))?;
    served.shutdown();
    Ok(())
}

/// A pool of a few pages for every request: requests are preempted (their caches moved to
/// host memory) and resumed in other pages, and each produces what it produces alone.
#[test]
fn requests_preempted_for_pages_produce_what_they_produce_alone() -> Result<()> {
    use crate::test_support::{assert_preempted_requests_match_alone, serve};
    let dir = wavefront_models::device::test_fixture("diffusion_gemma");
    let roomy = serve(ModelFiles::from_dir(&dir)?, "diffusion_gemma", 8)?;
    let pages = roomy.load().total_slots;
    let page_bytes = (256 << 20) / pages as u64;
    // The largest request (40 prompt tokens + 3 canvases of 16: 88 rows, 6 pages in each of
    // 3 layers) fits, a few together do not.
    let preemptions = assert_preempted_requests_match_alone(
        ModelFiles::from_dir(&dir)?,
        roomy.as_ref(),
        24 * page_bytes,
        &mixed_requests(),
    )?;
    ensure!(preemptions > 0, "24 pages for six requests must preempt");
    roomy.shutdown();
    Ok(())
}

/// Every request, moved to a second engine of the same checkpoint and back at step boundaries,
/// produces exactly what it produces alone.
#[test]
fn requests_moved_between_workers_produce_what_they_produce_alone() -> Result<()> {
    let specs = mixed_requests();
    let dir = wavefront_models::device::test_fixture("diffusion_gemma");
    let served = crate::test_support::serve(ModelFiles::from_dir(&dir)?, "diffusion_gemma", 8)?;
    crate::test_support::assert_moved_requests_match_alone(
        ModelFiles::from_dir(&dir)?,
        served.as_ref(),
        &specs,
    )?;
    served.shutdown();
    Ok(())
}

/// A row budget of 16 a tick: prompts prefill in chunks beside the other requests' steps, and
/// every request produces what it produces without a budget (forward passes and rows per call
/// aside).
#[test]
fn long_prompts_prefill_in_chunks_without_changing_tokens() -> Result<()> {
    use crate::test_support::{assert_chunked_prefill_matches, serve};
    let dir = wavefront_models::device::test_fixture("diffusion_gemma");
    let p = |len: usize, salt: u32| -> Vec<u32> {
        (0..len as u32)
            .map(|i| 21 + (i * 37 + salt * 101) % 419)
            .collect()
    };
    let specs = vec![
        spec(p(40, 0), 16, 1, eb(6, 1, 0.6, false)),
        spec(p(60, 1), 24, 2, eb(5, 0, 0.9, false)),
        spec(p(5, 2), 16, 3, eb(6, 1, 0.6, false)),
    ];
    let roomy = serve(ModelFiles::from_dir(&dir)?, "diffusion_gemma", specs.len())?;
    assert_chunked_prefill_matches(
        ModelFiles::from_dir(&dir)?,
        roomy.as_ref(),
        16,
        &specs,
        (
            spec(p(200, 4), 8, 5, eb(4, 1, 0.6, false)),
            spec(p(6, 7), 64, 6, {
                let mut e = eb(6, 1, 0.6, false);
                if let SchemeParams::EntropyBound(p) = &mut e {
                    p.no_early_stop = true;
                }
                e
            }),
            1,
        ),
        &["active_rows"],
    )?;
    roomy.shutdown();
    Ok(())
}

#[test]
fn bad_parameters_are_refused_by_name() -> Result<()> {
    use crate::test_support::assert_invalid;
    let fx = fixture()?;
    let with = |f: fn(&mut EntropyBoundParams)| {
        let mut p = EntropyBoundParams::default();
        f(&mut p);
        spec(vec![2, 15, 30], 16, 0, SchemeParams::EntropyBound(p))
    };
    let mut hot = with(|_| {});
    hot.sampling.temperature = 0.7;
    let mut image = with(|_| {});
    image.prompt_ids = vec![2, 17, 19, 18];
    assert_invalid(
        &fx.planner,
        vec![
            (
                with(|p| p.max_denoising_steps = Some(0)),
                "entropy_bound.max_denoising_steps",
            ),
            (with(|p| p.t_max = Some(0.0)), "entropy_bound.t_max"),
            (with(|p| p.t_min = Some(f32::NAN)), "entropy_bound.t_min"),
            (
                with(|p| p.entropy_bound = Some(0.0)),
                "entropy_bound.entropy_bound",
            ),
            (
                with(|p| p.confidence_threshold = Some(f32::INFINITY)),
                "entropy_bound.confidence_threshold",
            ),
            (
                with(|p| {
                    p.max_denoising_steps = Some(4);
                    p.stability_threshold = Some(5)
                }),
                "entropy_bound.stability_threshold",
            ),
            (
                with(|p| p.initial_canvas = vec![3; 5]),
                "entropy_bound.initial_canvas",
            ),
            (
                with(|p| p.initial_canvas = vec![600; 16]),
                "entropy_bound.initial_canvas",
            ),
            (hot, "t_max and t_min"),
            (image, "image"),
            (
                spec(vec![1], 8, 0, SchemeParams::Wino(Default::default())),
                "use `entropy-bound`",
            ),
        ],
    )?;
    Ok(())
}

/// A fault in one request's plan, forward or commit fails that request only, beside another.
#[test]
fn an_injected_fault_fails_only_its_request() -> Result<()> {
    let fx = fixture()?;
    let cases = cases(&fx)?;
    crate::fault_tests::assert_faults_fail_only_their_request(
        || Ok(UniformDiffusionFamily::new(fx.model.clone())),
        || Ok(fx.planner.prepare(cases[0].spec.clone())?.program),
        || Ok(fx.planner.prepare(cases[1].spec.clone())?.program),
    )
}

/// The experts split over 2 and 4 in-process expert-parallel ranks: every request decodes the
/// same tokens with the same per-step statistics as on one rank.
#[test]
fn expert_parallel_ranks_decode_what_one_rank_decodes() -> Result<()> {
    let dir = wavefront_models::device::test_fixture("diffusion_gemma");
    crate::test_support::assert_tensor_parallel_decodes_match(
        || Ok(ModelFiles::from_dir(&dir)?),
        &mixed_requests(),
    )
}

/// `logprobs`, served with upstream's draws replayed: every token of a run's first canvas is
/// its last step's argmax, and its log-probability and alternatives are the log-softmax of
/// upstream's raw logits of that step divided by the step's temperature (the trace's); the
/// response is upstream's.
#[test]
fn logprobs_are_the_last_steps_tempered_distribution() -> Result<()> {
    let fx = fixture()?;
    let cases: Vec<Case> = cases(&fx)?.into_iter().filter(|c| c.row == 0).collect();
    let specs: Vec<GenerateSpec> = cases
        .iter()
        .map(|c| {
            let mut s = c.spec.clone();
            s.sampling.logprobs = Some(3);
            s
        })
        .collect();
    let files = ModelFiles::from_dir(wavefront_models::device::test_fixture("diffusion_gemma"))?;
    let outcomes =
        crate::test_support::served_outcomes(files, crate::LoadOptions::default(), &specs)?;
    let (mut checked, mut relative) = (0, 0);
    for (case, out) in cases.iter().zip(&outcomes) {
        let name = &case.name;
        ensure!(
            out.tokens == case.committed && out.logprobs.len() == out.tokens.len(),
            "{name}: {:?} with {} log-probabilities, upstream {:?}",
            out.tokens,
            out.logprobs.len(),
            case.committed
        );
        let run = case.name.trim_end_matches("[0]");
        let json = fx.json["runs"]
            .as_array()
            .context("runs")?
            .iter()
            .find(|r| r["name"] == run)
            .context("run")?;
        // Every canvas of a one-row run: its last step's five largest raw logits give the
        // differences between the alternatives' log-probabilities, (l_a - l_b) / T.
        let top_v = fx
            .tensors
            .get(&format!("run.{run}.step.raw_logits_top5_values"));
        let top_i = fx
            .tensors
            .get(&format!("run.{run}.step.raw_logits_top5_indices"));
        if let (Some(v), Some(ix)) = (top_v, top_i) {
            if v.dim(1)? == 1 {
                let canvas_of = |s: usize| json["trace"][s]["canvas"].as_u64();
                for (c, lps) in out.logprobs.chunks(16).enumerate() {
                    let last = *case
                        .steps
                        .iter()
                        .rfind(|&&s| canvas_of(s) == Some(c as u64))
                        .context("canvas steps")?;
                    let t = json["trace"][last]["temperature"].as_f64().context("T")? as f32;
                    let vals: Vec<Vec<f32>> = v.i((last, 0))?.to_vec2()?;
                    let ids: Vec<Vec<i64>> = ix.i((last, 0))?.to_dtype(DType::I64)?.to_vec2()?;
                    for (i, lp) in lps.iter().enumerate() {
                        ensure!(lp.top.len() == 3, "{name}: {:?}", lp.top);
                        for k in 1..3 {
                            // Only where upstream's ranks are the same tokens.
                            if lp.top[k].0 as i64 != ids[i][k] || lp.top[0].0 as i64 != ids[i][0] {
                                continue;
                            }
                            let want = f64::from(vals[i][0] / t) - f64::from(vals[i][k] / t);
                            let got = f64::from(lp.top[0].1) - f64::from(lp.top[k].1);
                            // Two logits within the README's 1e-4 each, divided by T.
                            ensure!(
                                (got - want).abs() < 5e-4 / f64::from(t) + 1e-5 * want.abs(),
                                "{name} canvas {c} token {i}: gap {got}, upstream {want}"
                            );
                            relative += 1;
                        }
                    }
                }
            }
        }
        // A batch's recorded last step is its last row's, not necessarily this row's.
        let Some(raw) = fx
            .tensors
            .get(&format!("run.{run}.canvas0.last_step.raw_logits"))
            .filter(|t| t.dim(0).ok() == Some(1))
        else {
            continue;
        };
        let rows: Vec<Vec<f32>> = raw.i(0)?.to_vec2()?;
        // The first canvas's last step.
        let last = case.steps[0..]
            .iter()
            .take_while(|&&s| json["trace"][s]["canvas"] == 0)
            .last()
            .context("canvas 0 steps")?;
        let t = json["trace"][*last]["temperature"]
            .as_f64()
            .context("temperature")? as f32;
        for (i, (row, lp)) in rows.iter().zip(&out.logprobs).enumerate() {
            let tempered: Vec<f32> = row.iter().map(|&v| v / t).collect();
            let want = crate::test_support::log_softmax(&tempered);
            let what = format!("{name} token {i}");
            crate::test_support::check_entry(&what, out.tokens[i], lp, &want, 1e-3)?;
            checked += 1;
        }
    }
    ensure!(
        checked >= 16 && relative >= 100,
        "{checked} tokens and {relative} gaps checked"
    );
    Ok(())
}
