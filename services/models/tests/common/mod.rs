//! Fixture loading shared by the golden tests (tests/fixtures/huginn, see its README).

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use wavefront_models::device::test_device;
use wavefront_models::{Huginn, HuginnConfig, ModelFiles};

#[path = "../support/mod.rs"]
mod support;
#[allow(unused_imports)]
pub use support::{assert_close, max_abs_diff, packing_atol};

pub fn fixture_dir() -> PathBuf {
    wavefront_models::device::test_fixture("huginn")
}

pub fn load_model(files: &ModelFiles) -> Result<Huginn> {
    let cfg = HuginnConfig::from_json(files.config_json())?;
    let vb = files.var_builder(DType::F32, &test_device())?;
    Ok(Huginn::load(vb, cfg)?)
}

pub fn fixture_model() -> Result<Huginn> {
    load_model(&ModelFiles::from_dir(fixture_dir())?)
}

pub struct Golden {
    pub tensors: HashMap<String, Tensor>,
    pub json: serde_json::Value,
}

impl Golden {
    pub fn load() -> Result<Self> {
        let dir = fixture_dir();
        let tensors =
            candle_core::safetensors::load(dir.join("golden.safetensors"), &test_device())?;
        let json = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json"))?)?;
        Ok(Self { tensors, json })
    }

    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("golden tensor {name}"))
    }

    pub fn case(&self, name: &str) -> &serde_json::Value {
        &self.json["cases"][name]
    }

    pub fn prompt_ids(&self) -> Vec<u32> {
        serde_json::from_value(self.json["prompt_ids"].clone()).expect("prompt_ids")
    }
}
