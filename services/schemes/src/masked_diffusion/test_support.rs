//! Helpers shared by the masked-diffusion tests: the LLaDA fixture (tests/fixtures/llada), request
//! builders, a direct tick loop and an event sink over a bounded std channel.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use serde_json::Value;
use wavefront_engine::Outbox;
use wavefront_models::device::test_device;
use wavefront_models::{Llada, LladaConfig, ModelFiles};

use super::{tick, Entry, LladaPlanner, MdProgram};
use crate::request::{
    GenerateSpec, LowConfidenceParams, SamplingParams, SchemeParams, SureLockParams, WinoParams,
};
use crate::served::Planner;

pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llada")
}

pub fn fixture_files() -> Result<ModelFiles> {
    Ok(ModelFiles::from_dir(fixture_dir())?)
}

pub fn fixture() -> Result<(Llada, LladaPlanner)> {
    let files = fixture_files()?;
    let cfg = LladaConfig::from_json(files.config_json())?;
    let model = Llada::load(files.var_builder(DType::F32, &test_device())?, cfg.clone())?;
    Ok((model, LladaPlanner::new(cfg, "fixture".into(), DType::F32)))
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

pub fn spec(prompt_ids: Vec<u32>, gen: usize, seed: u64, scheme: SchemeParams) -> GenerateSpec {
    GenerateSpec {
        prompt_ids,
        max_new_tokens: gen,
        stop_token_ids: Vec::new(),
        sampling: SamplingParams {
            seed,
            ..SamplingParams::default()
        },
        scheme,
        replay_draws: None,
        stream_canvas: false,
    }
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

pub fn program(planner: &LladaPlanner, spec: GenerateSpec) -> Result<MdProgram> {
    let mut p = planner.prepare(spec)?.program;
    p.record_steps();
    Ok(p)
}

/// Runs `programs` packed into the same ticks until all finish; returns how many ticks each
/// was part of.
pub fn run(model: &Llada, programs: &mut [MdProgram]) -> Result<Vec<usize>> {
    let mut outboxes: Vec<Outbox> = programs.iter().map(|_| Outbox::default()).collect();
    let mut ticks = vec![0; programs.len()];
    for _ in 0..10_000 {
        let mut batch: Vec<Entry<'_>> = programs
            .iter_mut()
            .zip(outboxes.iter_mut())
            .zip(ticks.iter_mut())
            .filter(|((_, o), _)| !o.is_done())
            .map(|((program, outbox), t)| {
                *t += 1;
                Entry { program, outbox }
            })
            .collect();
        if batch.is_empty() {
            return Ok(ticks);
        }
        tick(model, &mut batch)?;
    }
    bail!("programs did not finish")
}

pub use crate::test_support::{collect, TestSink};
