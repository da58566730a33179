//! Structured outputs on the trained models in models/: every output, greedy and sampled, of
//! every family and scheme that serves them, parses and validates against its constraint (a JSON
//! schema, any JSON object, a regular expression, a choice), ends because the constraint is
//! complete, within the token budget; the schemes that do not serve them refuse them.

use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use serde_json::Value;
use wavefront_engine::FinishReason;
use wavefront_models::ModelFiles;

use crate::constraint::Constraint;
use crate::request::{
    ArParams, GenerateSpec, KvCacheMode, LowConfidenceParams, SchemeParams, WinoParams,
};
use crate::test_support::{collect, spec, submit};
use crate::{load_model, LoadOptions};

fn trained(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name)
}

fn schema() -> Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "answer": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"}
        },
        "required": ["answer", "ok"],
        "additionalProperties": false
    })
}

/// Whether `text` satisfies `c` (checked here apart from the grammar engine).
fn valid(c: &Constraint, text: &str) -> bool {
    match c {
        Constraint::JsonSchema { .. } => {
            let Ok(Value::Object(o)) = serde_json::from_str::<Value>(text) else {
                return false;
            };
            o.len() == 2
                && o.get("answer")
                    .and_then(Value::as_u64)
                    .is_some_and(|a| a <= 999)
                && o.get("ok").is_some_and(Value::is_boolean)
        }
        Constraint::JsonObject => {
            matches!(serde_json::from_str::<Value>(text), Ok(Value::Object(_)))
        }
        // [a-z]{2,6}=[0-9]{1,3}
        Constraint::Regex(_) => text.split_once('=').is_some_and(|(a, b)| {
            (2..=6).contains(&a.len())
                && a.bytes().all(|c| c.is_ascii_lowercase())
                && (1..=3).contains(&b.len())
                && b.bytes().all(|c| c.is_ascii_digit())
        }),
        Constraint::Choice(options) => options.iter().any(|o| o == text),
        Constraint::Grammar(_) => true,
    }
}

fn constraints() -> Vec<Constraint> {
    vec![
        Constraint::JsonSchema {
            schema: schema(),
            strict: true,
        },
        Constraint::JsonObject,
        Constraint::Regex("[a-z]{2,6}=[0-9]{1,3}".into()),
        Constraint::Choice(vec!["yes".into(), "no".into(), "maybe not".into()]),
    ]
}

/// Runs every constraint, greedy and sampled, with `scheme` on the trained model `name`.
fn check(name: &str, prompt: &str, scheme: SchemeParams, max_new: usize) -> Result<()> {
    check_dir(trained(name), name, prompt, scheme, max_new, &constraints())
}

fn check_dir(
    dir: PathBuf,
    name: &str,
    prompt: &str,
    scheme: SchemeParams,
    max_new: usize,
    constraints: &[Constraint],
) -> Result<()> {
    let files = ModelFiles::from_dir(dir)?;
    let tok = files.tokenizer()?;
    let served = load_model(files, LoadOptions::default())?;
    let prompt_ids = served.encode_prompt(prompt)?;
    // Entropy-bound draws at its own temperatures and takes no sampling parameters.
    let temperatures: &[f32] = if matches!(scheme, SchemeParams::EntropyBound(_)) {
        &[0.0]
    } else {
        &[0.0, 0.9]
    };
    for c in constraints.iter().cloned() {
        for &temperature in temperatures {
            let mut s: GenerateSpec = spec(prompt_ids.clone(), max_new, 11, scheme.clone());
            s.sampling.temperature = temperature;
            s.sampling.logprobs = Some(1);
            s.guide = Some(
                served
                    .guide(&c)
                    .map_err(anyhow::Error::msg)
                    .with_context(|| format!("{c:?}"))?,
            );
            let out = collect(&submit(served.as_ref(), s)?, Vec::new())?;
            let text = tok.decode(&out.tokens, true)?;
            let what = format!(
                "{name} {} at temperature {temperature}, {}: {text:?} ({:?})",
                scheme.name(),
                c.name(),
                out.reason
            );
            ensure!(out.tokens.len() <= max_new, "{what}: past the budget");
            if c == Constraint::JsonObject && out.reason == FinishReason::Length {
                // An object's strings are unbounded: the budget can end it first (as in
                // vLLM, the response says `length`); what it holds is a prefix the grammar
                // took token by token.
                let mut g = served.guide(&c).map_err(anyhow::Error::msg)?;
                for &t in &out.tokens {
                    ensure!(
                        g.allows(t).map_err(anyhow::Error::msg)?,
                        "{what}: {t} refused"
                    );
                    g.advance(t).map_err(anyhow::Error::msg)?;
                }
                continue;
            }
            ensure!(valid(&c, &text), "{what}: not valid");
            ensure!(
                out.reason == FinishReason::StopToken,
                "{what}: did not complete"
            );
            // Log-probabilities are under the masked distribution: every token was allowed.
            ensure!(
                out.logprobs.iter().all(|l| l.logprob.is_finite()),
                "{what}: a token outside the grammar"
            );
        }
    }
    served.shutdown();
    Ok(())
}

#[test]
fn huginn_ar_outputs_validate() -> Result<()> {
    check(
        "huginn-tiny",
        "copy a b c =",
        SchemeParams::Ar(ArParams::default()),
        48,
    )
}

/// Diffusion forcing with the bounded constraints (a sampled guess of an unbounded JSON
/// object changes at every step, so its positions are slow to freeze; the sampler's step cap
/// bounds it, as it bounds an unconstrained request).
#[test]
fn huginn_diffusion_forcing_outputs_validate() -> Result<()> {
    let bounded: Vec<Constraint> = constraints()
        .into_iter()
        .filter(|c| *c != Constraint::JsonObject)
        .collect();
    check_dir(
        trained("huginn-tiny"),
        "huginn-tiny",
        "copy a b c =",
        SchemeParams::DiffusionForcing(crate::request::DiffusionForcingParams {
            num_steps: Some(8),
            ..Default::default()
        }),
        48,
        &bounded,
    )
}

#[test]
fn armt_ar_outputs_validate() -> Result<()> {
    check(
        "armt-tiny",
        "copy a b c =",
        SchemeParams::Ar(ArParams::default()),
        48,
    )
}

#[test]
fn refusion_ar_outputs_validate() -> Result<()> {
    check(
        "refusion-tiny",
        "copy a b c =",
        SchemeParams::Ar(ArParams::default()),
        48,
    )
}

#[test]
fn refusion_plan_infill_outputs_validate() -> Result<()> {
    check(
        "refusion-tiny",
        "copy a b c =",
        SchemeParams::PlanInfill(crate::request::PlanInfillParams::default()),
        48,
    )
}

#[test]
fn llada_low_confidence_outputs_validate_with_and_without_fast_dllm() -> Result<()> {
    let lc = |kv_cache, threshold| {
        SchemeParams::LowConfidence(LowConfidenceParams {
            block_length: Some(16),
            steps: Some(48),
            kv_cache,
            threshold,
            ..LowConfidenceParams::default()
        })
    };
    check(
        "llada-tiny",
        "copy a b c =",
        lc(KvCacheMode::None, None),
        48,
    )?;
    check(
        "llada-tiny",
        "copy a b c =",
        lc(KvCacheMode::Prefix, Some(0.9)),
        48,
    )
}

/// LLaDA2.0's block diffusion on its fixture (random weights: the grammar alone makes the
/// outputs valid), with the bounded constraints.
#[test]
fn llada2_block_diffusion_outputs_validate() -> Result<()> {
    let bounded: Vec<Constraint> = constraints()
        .into_iter()
        .filter(|c| *c != Constraint::JsonObject)
        .collect();
    check_dir(
        wavefront_models::device::test_fixture("llada2"),
        "llada2 fixture",
        "copy a b c =",
        SchemeParams::BlockDiffusion(crate::request::BlockDiffusionParams {
            block_length: 8,
            steps: 8,
            ..Default::default()
        }),
        48,
        &bounded,
    )
}

/// Dream's diffusion-generate on its fixture (random weights), every algorithm.
#[test]
fn dream_diffusion_generate_outputs_validate() -> Result<()> {
    let bounded: Vec<Constraint> = constraints()
        .into_iter()
        .filter(|c| *c != Constraint::JsonObject)
        .collect();
    for alg in [
        crate::DreamAlg::MaskgitPlus,
        crate::DreamAlg::Entropy,
        crate::DreamAlg::Origin,
    ] {
        check_dir(
            wavefront_models::device::test_fixture("dream"),
            "dream fixture",
            "copy a b c =",
            SchemeParams::DiffusionGenerate(crate::request::DiffusionGenerateParams {
                alg,
                steps: Some(48),
                ..Default::default()
            }),
            48,
            &bounded,
        )?;
    }
    Ok(())
}

/// DiffusionGemma's entropy-bound sampler on its fixture (random weights): a finished canvas
/// commits in order under the grammar.
#[test]
fn diffusion_gemma_entropy_bound_outputs_validate() -> Result<()> {
    let bounded: Vec<Constraint> = constraints()
        .into_iter()
        .filter(|c| *c != Constraint::JsonObject)
        .collect();
    check_dir(
        wavefront_models::device::test_fixture("diffusion_gemma"),
        "diffusion_gemma fixture",
        "copy a b c =",
        SchemeParams::EntropyBound(crate::request::EntropyBoundParams::default()),
        48,
        &bounded,
    )
}

#[test]
fn llada_wino_outputs_validate() -> Result<()> {
    check(
        "llada-tiny",
        "copy a b c =",
        SchemeParams::Wino(WinoParams {
            block_length: Some(16),
            ..WinoParams::default()
        }),
        48,
    )
}

#[test]
fn bad_constraints_are_refused_with_the_engines_reason() -> Result<()> {
    let files = ModelFiles::from_dir(trained("huginn-tiny"))?;
    let served = load_model(files, LoadOptions::default())?;
    for c in [
        Constraint::Regex("([a-z".into()),
        Constraint::Grammar("start: undefined_rule".into()),
        Constraint::Choice(Vec::new()),
        Constraint::JsonSchema {
            schema: serde_json::json!({"type": "object", "properties": {"a": {"type": "frobnicate"}}}),
            strict: true,
        },
    ] {
        ensure!(served.guide(&c).is_err(), "{c:?} compiled");
    }
    served.shutdown();
    Ok(())
}

/// A constrained request asked to move (a draining worker) stays and finishes where it is: its
/// export is refused, it produces what it produces alone, valid.
#[test]
fn a_constrained_request_finishes_on_its_worker() -> Result<()> {
    let load = || {
        load_model(
            ModelFiles::from_dir(trained("huginn-tiny"))?,
            LoadOptions {
                name: "huginn".into(),
                ..LoadOptions::default()
            },
        )
        .map_err(anyhow::Error::from)
    };
    let (a, b) = (load()?, load()?);
    let tok = ModelFiles::from_dir(trained("huginn-tiny"))?.tokenizer()?;
    let c = Constraint::JsonSchema {
        schema: schema(),
        strict: true,
    };
    let mut s = spec(
        a.encode_prompt("copy a b c =")?,
        48,
        3,
        SchemeParams::Ar(ArParams::default()),
    );
    s.guide = Some(a.guide(&c).map_err(anyhow::Error::msg)?);
    let alone = collect(&submit(a.as_ref(), s.clone())?, Vec::new())?;
    s.guide = Some(a.guide(&c).map_err(anyhow::Error::msg)?);
    let (got, moves) = crate::test_support::run_moving(&[a.as_ref(), b.as_ref()], s, 1, false)?;
    ensure!(moves == 0, "a constrained request moved");
    ensure!(
        got.tokens == alone.tokens,
        "{:?} vs {:?}",
        got.tokens,
        alone.tokens
    );
    ensure!(valid(&c, &tok.decode(&got.tokens, true)?));
    a.shutdown();
    b.shutdown();
    Ok(())
}
