//! Log-probabilities across every family and scheme, sampled and greedy, served: asking for
//! them changes no token and no statistic, each token's value is finite and at most 0, the
//! alternatives are sorted, hold at most the request's count and only what the filtered
//! distribution can produce (at most `top_k` for a draw), and their probabilities sum to at
//! most 1. The values themselves are checked against upstream in each family's golden tests.

use anyhow::{ensure, Result};
use wavefront_models::device::test_fixture;
use wavefront_models::ModelFiles;

use crate::request::{
    ArParams, BlockDiffusionParams, DiffusionForcingParams, DiffusionGenerateParams,
    EntropyBoundParams, GenerateSpec, KvCacheMode, LowConfidenceParams, PlanInfillParams,
    SchemeParams, SureLockParams, WinoParams,
};
use crate::test_support::{served_outcomes, spec, Outcome};
use crate::LoadOptions;

/// The requests of one fixture, sampled (temperature, top_k 5, top_p 0.9, seeded) and greedy.
/// (Entropy-bound takes no sampling parameters: it draws at its own temperatures, and runs
/// with two seeds instead.)
fn requests(prompt: &[u32], max_new: usize, schemes: &[SchemeParams]) -> Vec<GenerateSpec> {
    let mut out = Vec::new();
    for (i, scheme) in schemes.iter().enumerate() {
        let mut sampled = spec(prompt.to_vec(), max_new, 40 + i as u64, scheme.clone());
        if !matches!(scheme, SchemeParams::EntropyBound(_)) {
            sampled.sampling.temperature = 0.8;
            sampled.sampling.top_k = 5;
            sampled.sampling.top_p = 0.9;
        }
        out.push(sampled);
        out.push(spec(prompt.to_vec(), max_new, 7, scheme.clone()));
    }
    out
}

fn check(fixture: &str, prompt: &[u32], max_new: usize, schemes: &[SchemeParams]) -> Result<()> {
    let plain = requests(prompt, max_new, schemes);
    let scored: Vec<GenerateSpec> = plain
        .iter()
        .map(|s| {
            let mut s = s.clone();
            s.sampling.logprobs = Some(8);
            s
        })
        .collect();
    let files = || ModelFiles::from_dir(test_fixture(fixture));
    let opts = || LoadOptions {
        max_active: plain.len(),
        ..LoadOptions::default()
    };
    let without = served_outcomes(files()?, opts(), &plain)?;
    let with = served_outcomes(files()?, opts(), &scored)?;
    for ((spec, a), b) in scored.iter().zip(&without).zip(&with) {
        let name = format!(
            "{fixture} {} at temperature {}",
            spec.scheme.name(),
            spec.sampling.temperature
        );
        check_one(&name, spec, a, b)?;
    }
    Ok(())
}

fn check_one(name: &str, spec: &GenerateSpec, without: &Outcome, with: &Outcome) -> Result<()> {
    ensure!(
        with.work() == without.work() && without.logprobs.is_empty(),
        "{name}: asking for log-probabilities changed the response: {:?} vs {:?}",
        with.tokens,
        without.tokens
    );
    ensure!(
        !with.tokens.is_empty() && with.logprobs.len() == with.tokens.len(),
        "{name}: {} log-probabilities for {} tokens",
        with.logprobs.len(),
        with.tokens.len()
    );
    let sampled = spec.sampling.temperature > 0.0;
    // A draw's distribution holds at most top_k tokens; plan-infill's verifier and
    // entropy-bound's steps are the model's own distributions.
    let own = matches!(
        spec.scheme,
        SchemeParams::PlanInfill(_) | SchemeParams::EntropyBound(_)
    );
    let most = if sampled && !own { 5 } else { 8 };
    for (i, lp) in with.logprobs.iter().enumerate() {
        ensure!(
            lp.logprob.is_finite() && lp.logprob <= 0.0,
            "{name} token {i}: logprob {}",
            lp.logprob
        );
        ensure!(
            !lp.top.is_empty()
                && lp.top.len() <= most
                && lp.top.windows(2).all(|w| w[0].1 >= w[1].1),
            "{name} token {i}: alternatives {:?}",
            lp.top
        );
        ensure!(
            lp.top[0].1 >= lp.logprob,
            "{name} token {i}: {} above the most likely {:?}",
            lp.logprob,
            lp.top
        );
        let mass: f64 = lp.top.iter().map(|t| f64::from(t.1).exp()).sum();
        ensure!(
            mass <= 1.0 + 1e-5,
            "{name} token {i}: alternatives' mass {mass}"
        );
        // A greedy token is its distribution's most likely, except under plan-infill, where it
        // is the verifier's distribution and the planner chose the token.
        if !sampled && !matches!(spec.scheme, SchemeParams::PlanInfill(_)) {
            ensure!(
                lp.top[0].1 == lp.logprob,
                "{name} token {i}: greedy {} below {:?}",
                lp.logprob,
                lp.top
            );
        }
    }
    Ok(())
}

#[test]
fn huginn_ar_and_diffusion_forcing() -> Result<()> {
    check(
        "huginn",
        &[480, 373, 402, 367, 305, 363, 441, 264],
        8,
        &[
            SchemeParams::Ar(ArParams {
                num_steps: Some(4),
                ..ArParams::default()
            }),
            SchemeParams::Ar(ArParams {
                num_steps: Some(16),
                exit_threshold: Some(0.03),
                ..ArParams::default()
            }),
            SchemeParams::DiffusionForcing(DiffusionForcingParams {
                num_steps: Some(8),
                ..DiffusionForcingParams::default()
            }),
        ],
    )
}

#[test]
fn armt_ar() -> Result<()> {
    let prompt: Vec<u32> = (1..40).map(|i| (i * 7) % 300 + 3).collect();
    check("armt", &prompt, 6, &[SchemeParams::Ar(ArParams::default())])
}

#[test]
fn llada_low_confidence_surelock_fast_dllm_and_wino() -> Result<()> {
    let lc = |f: fn(&mut LowConfidenceParams)| {
        let mut p = LowConfidenceParams {
            block_length: Some(8),
            steps: Some(8),
            ..LowConfidenceParams::default()
        };
        f(&mut p);
        SchemeParams::LowConfidence(p)
    };
    check(
        "llada",
        &[448, 47, 355, 268, 341, 328, 388, 260],
        16,
        &[
            lc(|_| {}),
            lc(|p| {
                p.surelock = Some(SureLockParams {
                    eps: 0.01,
                    percentile: None,
                })
            }),
            lc(|p| {
                p.kv_cache = KvCacheMode::Dual;
                p.threshold = Some(0.9);
            }),
            SchemeParams::Wino(WinoParams {
                block_length: Some(8),
                ..WinoParams::default()
            }),
        ],
    )
}

#[test]
fn dream_diffusion_generate() -> Result<()> {
    check(
        "dream",
        &[457, 82, 88, 337, 68, 76, 198, 379],
        8,
        &[SchemeParams::DiffusionGenerate(DiffusionGenerateParams {
            steps: Some(8),
            ..DiffusionGenerateParams::default()
        })],
    )
}

#[test]
fn llada2_block_diffusion() -> Result<()> {
    check(
        "llada2",
        &[47, 351, 271, 335, 350, 391, 260, 68, 65, 88, 419],
        16,
        &[SchemeParams::BlockDiffusion(BlockDiffusionParams {
            block_length: 8,
            steps: 8,
            ..BlockDiffusionParams::default()
        })],
    )
}

#[test]
fn refusion_plan_infill_and_ar() -> Result<()> {
    check(
        "refusion",
        &[40, 41, 42, 43, 44, 45, 46, 47],
        16,
        &[
            SchemeParams::PlanInfill(PlanInfillParams::default()),
            SchemeParams::Ar(ArParams::default()),
        ],
    )
}

#[test]
fn diffusion_gemma_entropy_bound() -> Result<()> {
    check(
        "diffusion_gemma",
        &[2, 15, 353, 351, 364, 281, 327, 340],
        16,
        &[SchemeParams::EntropyBound(EntropyBoundParams::default())],
    )
}

/// `prompt_logprobs` next to generation: every scheme that scores its prompt sends one entry
/// per prompt token (the first without a value, the rest finite and at most 0) before any
/// token, and decodes the same tokens as without it; the schemes that do not score a prompt
/// refuse the field by name.
#[test]
fn prompt_scoring_changes_no_token_and_other_schemes_refuse_it() -> Result<()> {
    let lc = SchemeParams::LowConfidence(LowConfidenceParams {
        block_length: Some(4),
        steps: Some(4),
        ..LowConfidenceParams::default()
    });
    let cases: Vec<(&str, Vec<u32>, SchemeParams)> = vec![
        (
            "huginn",
            vec![480, 373, 402, 367, 305],
            SchemeParams::Ar(ArParams::default()),
        ),
        (
            "armt",
            (1..40).map(|i| i * 5 + 3).collect(),
            SchemeParams::Ar(ArParams::default()),
        ),
        ("llada", vec![448, 47, 355, 268, 341], lc),
        (
            "llada",
            vec![448, 47, 355, 268, 341],
            SchemeParams::Wino(WinoParams {
                block_length: Some(4),
                ..WinoParams::default()
            }),
        ),
        (
            "dream",
            vec![457, 82, 88, 337, 68],
            SchemeParams::DiffusionGenerate(DiffusionGenerateParams {
                steps: Some(4),
                ..DiffusionGenerateParams::default()
            }),
        ),
        (
            "refusion",
            vec![40, 41, 42, 43, 44],
            SchemeParams::Ar(ArParams::default()),
        ),
    ];
    for (fixture, prompt, scheme) in cases {
        let plain = spec(prompt.clone(), 4, 9, scheme.clone());
        let mut scored = plain.clone();
        scored.sampling.prompt_logprobs = Some(1);
        let files = || ModelFiles::from_dir(test_fixture(fixture));
        let a = served_outcomes(files()?, LoadOptions::default(), &[plain])?.remove(0);
        let b = served_outcomes(files()?, LoadOptions::default(), &[scored])?.remove(0);
        let name = format!("{fixture} {}", scheme.name());
        ensure!(
            a.tokens == b.tokens && a.prompt_logprobs.is_none(),
            "{name}: scoring the prompt changed the tokens: {:?} vs {:?}",
            b.tokens,
            a.tokens
        );
        let entries = b.prompt_logprobs.as_ref().map_or(0, Vec::len);
        ensure!(entries == prompt.len(), "{name}: {entries} prompt entries");
        let e = b.prompt_logprobs.unwrap_or_default();
        ensure!(
            e[0].logprob.is_nan()
                && e[1..]
                    .iter()
                    .all(|l| l.logprob.is_finite() && l.logprob <= 0.0 && l.top.len() == 1),
            "{name}: {e:?}"
        );
    }
    for (fixture, prompt, scheme) in [
        (
            "huginn",
            vec![480u32, 373, 402],
            SchemeParams::DiffusionForcing(DiffusionForcingParams::default()),
        ),
        (
            "refusion",
            vec![40, 41, 42],
            SchemeParams::PlanInfill(PlanInfillParams::default()),
        ),
        (
            "llada2",
            vec![47, 351, 271],
            SchemeParams::BlockDiffusion(BlockDiffusionParams::default()),
        ),
        (
            "diffusion_gemma",
            vec![2, 15, 353],
            SchemeParams::EntropyBound(EntropyBoundParams::default()),
        ),
    ] {
        let mut s = spec(prompt, 4, 9, scheme);
        s.sampling.prompt_logprobs = Some(0);
        let err = served_outcomes(
            ModelFiles::from_dir(test_fixture(fixture))?,
            LoadOptions::default(),
            &[s],
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        ensure!(err.contains("prompt_logprobs"), "{fixture}: {err:?}");
    }
    Ok(())
}
