//! Helpers shared by the recurrent-memory tests: the ARMT fixture (tests/fixtures/armt), request
//! builders and a direct tick loop.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use wavefront_engine::Standalone;
use wavefront_models::armt::Armt;
use wavefront_models::device::test_device;
use wavefront_models::ModelFiles;

use super::program::Record;
use super::{ArmtPlanner, ArmtProgram, RecurrentMemoryFamily, DEFAULT_MAX_CONTEXT_TOKENS};
use crate::request::{ArParams, Execution, GenerateSpec, SamplingParams, SchemeParams};
use crate::served::Planner;

pub use crate::test_support::{collect, TestSink};

pub fn fixture_dir() -> PathBuf {
    wavefront_models::device::test_fixture("armt")
}

pub fn fixture_files() -> Result<ModelFiles> {
    Ok(ModelFiles::from_dir(fixture_dir())?)
}

pub fn fixture() -> Result<(Armt, ArmtPlanner)> {
    let files = fixture_files()?;
    let cfg = super::config(&files)?;
    let model = Armt::load(files.var_builder(DType::F32, &test_device())?, cfg.clone())?;
    let planner = ArmtPlanner::new(
        cfg,
        "fixture".into(),
        DType::F32,
        DEFAULT_MAX_CONTEXT_TOKENS,
    );
    Ok((model, planner))
}

/// `golden.safetensors`.
pub struct Golden {
    pub tensors: HashMap<String, Tensor>,
}

impl Golden {
    pub fn load() -> Result<Self> {
        let path = fixture_dir().join("golden.safetensors");
        Ok(Self {
            tensors: candle_core::safetensors::load(path, &Device::Cpu)?,
        })
    }

    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("golden {name}"))
    }

    pub fn ids(&self, name: &str) -> Result<Vec<u32>> {
        Ok(self
            .tensor(name)?
            .flatten_all()?
            .to_dtype(DType::U32)?
            .to_vec1()?)
    }
}

/// Deterministic prompt ids of the fixture's vocabulary (512).
pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 131 + salt * 37 + 7) % 509 + 3)
        .collect()
}

pub fn ar(execution: Execution) -> SchemeParams {
    SchemeParams::Ar(ArParams {
        execution,
        ..ArParams::default()
    })
}

/// A greedy `ar` request with the default seed and `execution` (see
/// [`crate::test_support::spec`]).
pub fn spec(prompt_ids: Vec<u32>, max_new_tokens: usize, execution: Execution) -> GenerateSpec {
    crate::test_support::spec(
        prompt_ids,
        max_new_tokens,
        SamplingParams::default().seed,
        ar(execution),
    )
}

pub fn program(planner: &ArmtPlanner, spec: GenerateSpec) -> Result<ArmtProgram> {
    Ok(planner.prepare(spec)?.program)
}

/// The outcome of [`run`].
pub struct Run {
    /// Each program's record.
    pub records: Vec<Record>,
    /// Ticks until every program finished.
    pub ticks: usize,
    /// Ticks that ran a grouped step.
    pub grouped_steps: usize,
    /// Cells of each grouped step.
    pub cells: Vec<usize>,
}

/// Runs `programs` (recording) until every one finishes; program k joins at tick `join[k]`
/// (0 when `join` is shorter).
pub fn run(model: &Armt, programs: Vec<ArmtProgram>, join: &[usize]) -> Result<Run> {
    let mut programs = programs;
    for p in &mut programs {
        p.record();
    }
    let mut waiting: Vec<(usize, ArmtProgram)> = programs
        .into_iter()
        .enumerate()
        .map(|(k, p)| (join.get(k).copied().unwrap_or(0), p))
        .collect();
    waiting.reverse();
    let mut driver = Standalone::new(RecurrentMemoryFamily::new(model.clone()));
    let mut out = Run {
        records: Vec::new(),
        ticks: 0,
        grouped_steps: 0,
        cells: Vec::new(),
    };
    for t in 0..100_000 {
        while waiting.last().is_some_and(|(at, _)| *at <= t) {
            let (_, p) = waiting.pop().context("a waiting program")?;
            driver.add(p);
        }
        if waiting.is_empty() && (0..driver.len()).all(|i| driver.is_done(i)) {
            out.ticks = t;
            let (_, programs) = driver.into_parts();
            out.records = programs
                .iter()
                .map(|p| p.recorded().cloned().context("recorded"))
                .collect::<Result<_>>()?;
            return Ok(out);
        }
        if (0..driver.len()).all(|i| driver.is_done(i)) {
            continue;
        }
        let ran = driver.tick().planned > 0;
        let report = driver.family().last_run();
        // Residual streams waiting between layers live in the model's stream pool, one slot
        // each; a stream that left the top layer gave its slot back.
        let inflight: usize = (0..driver.len())
            .map(|i| driver.program(i).inflight.len())
            .sum();
        ensure!((0..driver.len()).all(|i| driver
            .program(i)
            .inflight
            .values()
            .all(|x| x.is_pooled())));
        ensure!(
            model.stream_pool().in_use() == inflight,
            "{} stream slots held for {inflight} streams",
            model.stream_pool().in_use()
        );
        if let (true, Some(shape)) = (ran, report.grouped) {
            out.grouped_steps += 1;
            out.cells.push(shape.cells);
        }
    }
    bail!("programs did not finish")
}
