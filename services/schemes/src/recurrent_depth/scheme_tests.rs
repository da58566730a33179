//! Behaviours of the recurrent-depth programs that no upstream golden covers: how diffusion
//! forcing relates to static AR, continuous compute, headway above one, and the statistics.

use std::sync::Arc;

use anyhow::{bail, ensure, Result};
use wavefront_engine::RequestError;
use wavefront_models::Huginn;

use super::ar::ArProgram;
use super::diffusion::DiffusionProgram;
use super::test_support::*;
use super::{HuginnPlanner, Program};
use crate::options::LoadOptions;
use crate::registry::load_model;
use crate::request::{
    ArParams, DiffusionForcingParams, FreezeTest, GenerateSpec, ReplayDraws, SchemeParams,
};
use crate::served::Planner;

fn ar_program(planner: &HuginnPlanner, spec: GenerateSpec) -> Result<ArProgram> {
    match planner.prepare(spec) {
        Ok(p) => match p.program {
            Program::Ar(p) => Ok(p),
            Program::Diffusion(_) => bail!("not an AR program"),
        },
        Err(e) => bail!("rejected: {e}"),
    }
}

fn df_program(planner: &HuginnPlanner, spec: GenerateSpec) -> Result<DiffusionProgram> {
    match planner.prepare(spec) {
        Ok(p) => match p.program {
            Program::Diffusion(p) => Ok(p),
            Program::Ar(_) => bail!("not a diffusion program"),
        },
        Err(e) => bail!("rejected: {e}"),
    }
}

/// Runs one AR program to the end; returns its tokens.
fn run_ar(model: &Huginn, p: ArProgram) -> Result<Vec<u32>> {
    let mut driver = Driver::new(model);
    driver.add(Program::Ar(p));
    let mut tokens = Vec::new();
    while !driver.all_done() {
        driver.tick()?;
        tokens.push(driver.ar(0).pending[0]);
    }
    Ok(tokens)
}

/// `p` alone in a driver.
fn df_driver(model: &Huginn, p: DiffusionProgram) -> Driver {
    let mut driver = Driver::new(model);
    driver.add(Program::Diffusion(p));
    driver
}

fn run_df(model: &Huginn, p: DiffusionProgram) -> Result<Vec<u32>> {
    let mut driver = df_driver(model, p);
    ensure!(driver.run(2000)?, "no convergence in 2000 ticks");
    let p = driver.df(0);
    Ok(p.generated()[..p.generated().len().min(p.max_new_tokens)].to_vec())
}

/// Diffusion forcing set up as one-token-at-a-time decoding: `r' = num_steps`, headway 1, no
/// momentum or noise.
fn df_as_ar(num_steps: usize, max_wavefront: usize, init_scale: f32) -> SchemeParams {
    SchemeParams::DiffusionForcing(DiffusionForcingParams {
        num_steps: Some(num_steps),
        inner_recurrence: num_steps,
        headway: 1,
        max_wavefront,
        ema_embeds: 0.0,
        state_noise_mixing: 0.0,
        init_scale,
        ..DiffusionForcingParams::default()
    })
}

/// Upstream's docstring says the sampler is "equal to normal generation if max_wavefront=1 and
/// inner_recurrence=32". Its code (reproduced here) does not do that: the wavefront always keeps
/// the last frozen position `c` (it decodes the next token) and the cap cuts the new position
/// `c + 1` off again, so with `max_wavefront = 1` nothing past the prefill token ever freezes
/// (the planner refuses it for that reason). What does hold: the prefill is the first AR step,
/// and one outer step over a one-position wavefront with `r' = num_steps` is exactly the next
/// AR step (same draws, KV and iterations), so its guess is AR's second token. From then on the
/// samplers differ by design: position `c` keeps iterating until its state converges across two
/// steps, and `c + 1` attends to that still-moving state, where AR reads a finished one.
#[test]
fn diffusion_with_a_unit_wavefront_reduces_to_ar_only_for_its_first_steps() -> Result<()> {
    let (model, planner) = fixture_model_and_planner()?;
    let (r, prompt_ids) = (8, prompt(9, 3));
    let l = prompt_ids.len();
    for (seed, init_scale) in [(21u64, 1.0f32), (22, 0.0)] {
        let ar_spec = spec(
            prompt_ids.clone(),
            2,
            seed,
            SchemeParams::Ar(ArParams {
                num_steps: Some(r),
                cache_lookup_strategy: Some("latest-m4-compress-s4".into()),
                init_scale: Some(init_scale),
                ..ArParams::default()
            }),
        );
        let ar_tokens = run_ar(&model, ar_program(&planner, ar_spec)?)?;

        let df_spec = spec(prompt_ids.clone(), 8, seed, df_as_ar(r, 1, init_scale));
        match planner.prepare(df_spec.clone()) {
            Err(RequestError::InvalidArgument(m)) => ensure!(m.contains("never freezes"), "{m}"),
            other => bail!("max_wavefront 1 accepted: {other:?}"),
        }
        // Built anyway (bypassing the planner): only the prefill token is ever produced.
        let mut unit = df_program(
            &planner,
            spec(prompt_ids.clone(), 8, seed, df_as_ar(r, 2, init_scale)),
        )?;
        unit.settings.max_wavefront = 1;
        let mut driver = df_driver(&model, unit);
        ensure!(!driver.run(40)?);
        let unit = driver.df(0);
        ensure!(
            unit.generated() == &ar_tokens[..1],
            "{:?} vs {ar_tokens:?}",
            unit.generated()
        );
        ensure!(
            unit.cache.len() == l,
            "cache advanced to {}",
            unit.cache.len()
        );

        // Two positions: after one outer step the guess for position L + 1 is AR's second token.
        let two = df_program(
            &planner,
            spec(prompt_ids.clone(), 8, seed, df_as_ar(r, 2, init_scale)),
        )?;
        let mut driver = df_driver(&model, two);
        driver.run(2)?;
        let two = driver.df(0);
        ensure!(
            two.frozen[l] == ar_tokens[0] && two.cur.get(l + 1) == Some(&ar_tokens[1]),
            "seed {seed}: frozen {:?}, guesses {:?}, AR {ar_tokens:?}",
            &two.frozen[l..],
            &two.cur[l..]
        );
    }
    Ok(())
}

fn replay(rows: usize, dim: usize, salt: f32) -> Arc<ReplayDraws> {
    let data = (0..rows * dim)
        .map(|i| (i as f32 * 0.7310 + salt).sin() * 0.4)
        .collect();
    Arc::new(ReplayDraws { dim, data })
}

/// With continuous compute, only the prompt's positions (AR) or the prefill and the first
/// wavefront position (diffusion forcing, headway 1, no noise) are drawn: a replay of exactly
/// those rows suffices, where the same request without it runs out of draws. Output is
/// reproducible. (That the flag changes nothing when off is what the goldens check: they all
/// run with it off.)
#[test]
fn continuous_compute_warm_starts_instead_of_drawing() -> Result<()> {
    let (model, planner) = fixture_model_and_planner()?;
    let dim = model.config().n_embd;
    let prompt_ids = prompt(7, 9);
    let l = prompt_ids.len();
    for exit_threshold in [None, Some(0.03)] {
        let ar = |cc| {
            let mut s = spec(
                prompt_ids.clone(),
                10,
                3,
                SchemeParams::Ar(ArParams {
                    num_steps: Some(12),
                    cache_lookup_strategy: Some("latest-m4".into()),
                    exit_threshold,
                    continuous_compute: cc,
                    ..ArParams::default()
                }),
            );
            s.replay_draws = Some(replay(l, dim, 0.3));
            s
        };
        let a = run_ar(&model, ar_program(&planner, ar(true))?)?;
        let b = run_ar(&model, ar_program(&planner, ar(true))?)?;
        ensure!(a.len() == 10 && a == b, "{a:?} vs {b:?}");
        ensure!(
            planner.prepare(ar(false)).is_err(),
            "off: the replay is too short"
        );
    }
    let df = |cc| {
        let mut s = spec(
            prompt_ids.clone(),
            10,
            3,
            SchemeParams::DiffusionForcing(DiffusionForcingParams {
                continuous_compute: cc,
                ..diffusion(16, FreezeTest::Aligned)
            }),
        );
        s.replay_draws = Some(replay(l + 1, dim, 0.9));
        s
    };
    let a = run_df(&model, df_program(&planner, df(true))?)?;
    let b = run_df(&model, df_program(&planner, df(true))?)?;
    ensure!(a.len() == 10 && a == b, "{a:?} vs {b:?}");
    let off = df_program(&planner, df(false))?;
    ensure!(
        df_driver(&model, off).run(2000).is_err(),
        "off: draws a fresh state for every new position"
    );
    Ok(())
}

#[test]
fn continuous_compute_changes_the_computation() -> Result<()> {
    let opts = LoadOptions {
        name: "fixture".into(),
        ..LoadOptions::default()
    };
    let served = load_model(fixture_files()?, opts)?;
    let mut differs = 0;
    for seed in 0..4u64 {
        let run = |cc| -> Result<(Vec<u32>, Vec<u32>)> {
            let s = spec(
                prompt(8, seed as u32),
                10,
                seed,
                SchemeParams::Ar(ArParams {
                    num_steps: Some(32),
                    cache_lookup_strategy: Some("latest-m4".into()),
                    exit_threshold: Some(0.03),
                    continuous_compute: cc,
                    ..ArParams::default()
                }),
            );
            let (sink, rx, _) = TestSink::new(64);
            served.submit(s, Box::new(sink), None, tracing::Span::none())?;
            let out = collect(&rx, Vec::new())?;
            let steps = out
                .stats
                .series
                .get("steps_per_token")
                .cloned()
                .unwrap_or_default();
            Ok((out.tokens, steps))
        };
        let (off, on) = (run(false)?, run(true)?);
        // The prompt is computed the same way either way.
        ensure!(
            off.0[0] == on.0[0] && off.1[0] == on.1[0],
            "{off:?} vs {on:?}"
        );
        differs += usize::from(off != on);
    }
    ensure!(
        differs > 0,
        "warm starts never changed tokens or exit steps"
    );
    served.shutdown();
    Ok(())
}

#[test]
fn headway_above_one_fills_placeholders_reproducibly() -> Result<()> {
    let (model, planner) = fixture_model_and_planner()?;
    for headway in [2, 3] {
        let s = spec(
            prompt(6, 4),
            12,
            5,
            SchemeParams::DiffusionForcing(DiffusionForcingParams {
                headway,
                ..diffusion(12, FreezeTest::Aligned)
            }),
        );
        let a = run_df(&model, df_program(&planner, s.clone())?)?;
        let b = run_df(&model, df_program(&planner, s)?)?;
        ensure!(a.len() == 12 && a == b, "headway {headway}: {a:?} vs {b:?}");
    }
    Ok(())
}

#[test]
fn statistics_name_the_work_of_each_scheme() -> Result<()> {
    let opts = LoadOptions {
        name: "fixture".into(),
        ..LoadOptions::default()
    };
    let served = load_model(fixture_files()?, opts)?;
    let run = |s: GenerateSpec| {
        let (sink, rx, _) = TestSink::new(256);
        served.submit(s, Box::new(sink), None, tracing::Span::none())?;
        collect(&rx, Vec::new())
    };
    let (num_steps, inner) = (8u32, 4u32);
    let df = run(spec(
        prompt(9, 1),
        12,
        2,
        SchemeParams::DiffusionForcing(diffusion(16, FreezeTest::Aligned)),
    ))?;
    let st = &df.stats;
    let sampler_steps = st.counters.get("sampler_steps").copied().unwrap_or(0);
    let sizes = st.series.get("wavefront_size").cloned().unwrap_or_default();
    let per_token = st
        .series
        .get("recurrence_steps_per_token")
        .cloned()
        .unwrap_or_default();
    ensure!(sampler_steps > 0 && sizes.len() as u64 == sampler_steps);
    ensure!(sizes.iter().all(|&s| (1..=16).contains(&s)), "{sizes:?}");
    ensure!(st.forward_passes == sampler_steps + 1, "{st:?}");
    ensure!(st.recurrence_steps == u64::from(num_steps) + u64::from(inner) * sampler_steps);
    ensure!(
        per_token.len() == df.tokens.len() && per_token[0] == num_steps,
        "{per_token:?}"
    );
    // Every later token's decoding position took part in at least one outer step.
    ensure!(per_token[1..].iter().all(|&n| n >= inner), "{per_token:?}");
    ensure!(st.series.contains_key("recurrence_per_position"));

    let ar = run(spec(prompt(9, 1), 6, 2, ar_adaptive(16, "latest-m4", 0.03)))?;
    let steps = ar
        .stats
        .series
        .get("steps_per_token")
        .cloned()
        .unwrap_or_default();
    ensure!(
        steps.len() == 6 && steps.iter().all(|&s| (1..=16).contains(&s)),
        "{steps:?}"
    );
    ensure!(ar.stats.recurrence_steps == steps.iter().map(|&s| u64::from(s)).sum::<u64>());
    ensure!(ar.stats.forward_passes == 6);
    served.shutdown();
    Ok(())
}
