//! Helpers shared by the slot-diffusion tests: the ReFusion fixture (tests/fixtures/refusion),
//! request builders and a family run without an engine.

use std::path::PathBuf;

use anyhow::Result;
use candle_core::DType;
use serde_json::Value;
use wavefront_models::device::test_device;
use wavefront_models::{ModelFiles, Qwen3, Qwen3Config};

use super::{RefusionPlanner, SdProgram, SlotDiffusionFamily};
use crate::request::{EosRule, GenerateSpec, PlanInfillParams, SamplingParams, SchemeParams};
use crate::served::Planner;
use crate::test_support::run_to_end;

pub fn fixture_dir() -> PathBuf {
    wavefront_models::device::test_fixture("refusion")
}

pub fn fixture_files() -> Result<ModelFiles> {
    Ok(ModelFiles::from_dir(fixture_dir())?)
}

pub fn fixture() -> Result<(Qwen3, RefusionPlanner)> {
    let files = fixture_files()?;
    let cfg = Qwen3Config::from_json(files.config_json())?;
    let model = Qwen3::load(files.var_builder(DType::F32, &test_device())?, cfg.clone())?;
    Ok((
        model,
        RefusionPlanner::new(cfg, "fixture".into(), DType::F32)?,
    ))
}

/// `golden.json`.
pub fn golden() -> Result<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(
        fixture_dir().join("golden.json"),
    )?)?)
}

/// The fixture's deterministic prompts: `len` ordinary BPE ids (no special tokens).
pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + salt * 101 + 11) % 480)
        .collect()
}

pub fn plan_infill(
    span_size: usize,
    serial_num_blocks: usize,
    span_threshold: f32,
    token_threshold: f32,
) -> SchemeParams {
    SchemeParams::PlanInfill(PlanInfillParams {
        span_size,
        serial_num_blocks,
        span_threshold,
        token_threshold,
        eos_rule: EosRule::Aligned,
    })
}

/// A greedy request with the default seed (see [`crate::test_support::spec`]).
pub fn spec(prompt_ids: Vec<u32>, gen: usize, scheme: SchemeParams) -> GenerateSpec {
    crate::test_support::spec(prompt_ids, gen, SamplingParams::default().seed, scheme)
}

pub fn program(planner: &RefusionPlanner, spec: GenerateSpec) -> Result<SdProgram> {
    let mut p = planner.prepare(spec)?.program;
    p.record();
    Ok(p)
}

/// Runs `programs` packed into the same ticks until all finish; returns how many ticks each
/// was part of.
pub fn run(model: &Qwen3, programs: &mut Vec<SdProgram>) -> Result<Vec<usize>> {
    let (_, ticks) = run_to_end(SlotDiffusionFamily::new(model.clone()), programs)?;
    Ok(ticks)
}

pub use crate::test_support::collect;
