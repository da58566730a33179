//! Helpers of the recurrent-depth tests: the fixture model and request builders (the event
//! sink, outcome collection and request spec are shared by every family).

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::DType;
use wavefront_engine::{Event, Standalone};
use wavefront_models::device::test_device;
use wavefront_models::{Huginn, HuginnConfig, ModelFiles};

use super::ar::ArProgram;
use super::diffusion::DiffusionProgram;
use super::{HuginnFamily, HuginnPlanner, Program};
use crate::request::{ArParams, DiffusionForcingParams, FreezeTest, SchemeParams};

pub fn fixture_dir() -> PathBuf {
    wavefront_models::device::test_fixture("huginn")
}

pub fn fixture_files() -> Result<ModelFiles> {
    Ok(ModelFiles::from_dir(fixture_dir())?)
}

pub fn fixture_config() -> Result<HuginnConfig> {
    Ok(HuginnConfig::from_json(fixture_files()?.config_json())?)
}

pub fn fixture_model_and_planner() -> Result<(Huginn, HuginnPlanner)> {
    let files = fixture_files()?;
    let cfg = HuginnConfig::from_json(files.config_json())?;
    let model = Huginn::load(files.var_builder(DType::F32, &test_device())?, cfg.clone())?;
    let planner = HuginnPlanner::new(cfg, "fixture".into(), None);
    Ok((model, planner))
}

/// A deterministic prompt of `len` ids below the fixture's vocabulary.
pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + salt * 101 + 11) % 480)
        .collect()
}

pub fn ar_static(num_steps: usize, cache: &str) -> SchemeParams {
    SchemeParams::Ar(ArParams {
        num_steps: Some(num_steps),
        cache_lookup_strategy: Some(cache.into()),
        ..ArParams::default()
    })
}

pub fn ar_adaptive(max_steps: usize, cache: &str, eps: f32) -> SchemeParams {
    SchemeParams::Ar(ArParams {
        num_steps: Some(max_steps),
        cache_lookup_strategy: Some(cache.into()),
        exit_threshold: Some(eps),
        ..ArParams::default()
    })
}

pub fn diffusion(max_wavefront: usize, freeze_test: FreezeTest) -> DiffusionForcingParams {
    DiffusionForcingParams {
        num_steps: Some(8),
        max_wavefront,
        freeze_test,
        ..DiffusionForcingParams::default()
    }
}

pub use crate::test_support::{collect, spec, TestSink};

/// Huginn programs stepped through the family's plan → run → commit without an engine, and
/// looked at between ticks.
pub struct Driver(pub Standalone<HuginnFamily>);

impl Driver {
    pub fn new(model: &Huginn) -> Self {
        Self(Standalone::new(HuginnFamily::new(model.clone())))
    }

    pub fn add(&mut self, p: Program) -> usize {
        self.0.add(p)
    }

    pub fn ar(&self, i: usize) -> &ArProgram {
        match self.0.program(i) {
            Program::Ar(p) => p,
            Program::Diffusion(_) => panic!("program {i} is not an AR program"),
        }
    }

    pub fn df(&self, i: usize) -> &DiffusionProgram {
        match self.0.program(i) {
            Program::Diffusion(p) => p,
            Program::Ar(_) => panic!("program {i} is not a diffusion program"),
        }
    }

    pub fn is_done(&self, i: usize) -> bool {
        self.0.is_done(i)
    }

    pub fn all_done(&self) -> bool {
        (0..self.0.len()).all(|i| self.0.is_done(i))
    }

    /// One tick of every program still running; a request that failed is an error.
    pub fn tick(&mut self) -> Result<()> {
        self.0.tick();
        for i in 0..self.0.len() {
            for e in self.0.active(i).outbox.events() {
                if let Event::Failed(e) = e {
                    bail!("request {i} failed: {e}");
                }
            }
        }
        Ok(())
    }

    /// Up to `ticks` ticks, until every program is done; returns whether they are.
    pub fn run(&mut self, ticks: usize) -> Result<bool> {
        for _ in 0..ticks {
            if self.all_done() {
                break;
            }
            self.tick()?;
        }
        Ok(self.all_done())
    }
}
