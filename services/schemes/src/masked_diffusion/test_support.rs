//! Helpers shared by the masked-diffusion tests: the LLaDA fixture (tests/fixtures/llada), request
//! builders and a family run without an engine (the event sink, outcome collection and request spec are
//! shared by every family).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use serde_json::Value;
use wavefront_models::device::test_device;
use wavefront_models::{Llada, LladaConfig, ModelFiles};

use super::{MaskedDiffusionFamily, MdPlanner, MdProgram};
use crate::request::{GenerateSpec, LowConfidenceParams, SureLockParams, WinoParams};
use crate::served::Planner;
use crate::test_support::run_to_end;

pub fn fixture_dir() -> PathBuf {
    wavefront_models::device::test_fixture("llada")
}

pub fn fixture_files() -> Result<ModelFiles> {
    Ok(ModelFiles::from_dir(fixture_dir())?)
}

pub fn fixture() -> Result<(Llada, MdPlanner)> {
    let files = fixture_files()?;
    let cfg = LladaConfig::from_json(files.config_json())?;
    let model = Llada::load(files.var_builder(DType::F32, &test_device())?, cfg.clone())?;
    Ok((model, MdPlanner::new(cfg, "fixture".into(), DType::F32)))
}

/// `golden.json` and `golden.safetensors`.
pub struct Golden {
    pub json: Value,
    pub tensors: HashMap<String, Tensor>,
}

impl Golden {
    pub fn load() -> Result<Self> {
        let dir = fixture_dir();
        Ok(Self {
            json: serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json"))?)?,
            tensors: candle_core::safetensors::load(
                dir.join("golden.safetensors"),
                &test_device(),
            )?,
        })
    }

    pub fn prompt(&self) -> Vec<u32> {
        serde_json::from_value(self.json["prompt_ids"].clone()).expect("prompt_ids")
    }

    /// A 2-D tensor as rows of `T`.
    pub fn rows<T: candle_core::WithDType>(&self, name: &str, dtype: DType) -> Result<Vec<Vec<T>>> {
        let t = self
            .tensors
            .get(name)
            .with_context(|| format!("tensor {name}"))?;
        Ok(t.to_dtype(dtype)?.to_vec2()?)
    }
}

/// The fixture's deterministic prompts: `len` ids below the BPE range (no special tokens).
pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + salt * 101 + 11) % 448)
        .collect()
}

pub fn low_confidence(block_length: usize, steps: usize) -> LowConfidenceParams {
    LowConfidenceParams {
        block_length: Some(block_length),
        steps: Some(steps),
        ..LowConfidenceParams::default()
    }
}

pub fn wino(block_length: usize) -> WinoParams {
    WinoParams {
        block_length: Some(block_length),
        ..WinoParams::default()
    }
}

pub fn surelock(eps: f32, percentile: Option<f32>) -> Option<SureLockParams> {
    Some(SureLockParams { eps, percentile })
}

pub fn program(planner: &MdPlanner, spec: GenerateSpec) -> Result<MdProgram> {
    let mut p = planner.prepare(spec)?.program;
    p.record_steps();
    Ok(p)
}

/// Runs `programs` packed into the same ticks of a family serving `model` until all finish;
/// returns how many ticks each was part of.
pub fn run<M: super::MdNetwork + Clone>(
    model: &M,
    programs: &mut Vec<MdProgram>,
) -> Result<Vec<usize>> {
    let (_, ticks) = run_to_end(MaskedDiffusionFamily::new(model.clone()), programs)?;
    Ok(ticks)
}

pub use crate::test_support::{collect, spec};
