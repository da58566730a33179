//! Helpers of the recurrent-depth tests: the fixture model and request builders (the event
//! sink, outcome collection and request spec are shared by every family).

use std::path::PathBuf;

use anyhow::Result;
use candle_core::DType;
use wavefront_models::device::test_device;
use wavefront_models::{Huginn, HuginnConfig, ModelFiles};

use super::HuginnPlanner;
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
