//! Helpers shared by the recurrent-depth tests: the fixture model, request builders and an
//! event sink backed by a bounded std channel that can be closed from the test.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use wavefront_engine::{Event, EventSink, FinishReason, SinkError, Stats};
use wavefront_models::{Huginn, HuginnConfig, ModelFiles};

use super::HuginnPlanner;
use crate::request::{
    ArParams, DiffusionForcingParams, FreezeTest, GenerateSpec, SamplingParams, SchemeParams,
};

pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/huginn")
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
    let model = Huginn::load(files.var_builder(DType::F32, &Device::Cpu)?, cfg.clone())?;
    let planner = HuginnPlanner::new(cfg, "fixture".into(), None);
    Ok((model, planner))
}

/// A deterministic prompt of `len` ids below the fixture's vocabulary.
pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + salt * 101 + 11) % 480)
        .collect()
}

pub fn spec(
    prompt_ids: Vec<u32>,
    max_new_tokens: usize,
    seed: u64,
    scheme: SchemeParams,
) -> GenerateSpec {
    GenerateSpec {
        prompt_ids,
        max_new_tokens,
        stop_token_ids: Vec::new(),
        sampling: SamplingParams {
            seed,
            ..SamplingParams::default()
        },
        scheme,
        replay_draws: None,
    }
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

/// A sink over a bounded std channel; `closed` marks the client gone (the engine's reap path),
/// dropping the receiver makes sends fail (the delivery path).
pub struct TestSink {
    pub tx: SyncSender<Event>,
    pub closed: Arc<AtomicBool>,
}

impl TestSink {
    pub fn new(capacity: usize) -> (Self, Receiver<Event>, Arc<AtomicBool>) {
        let (tx, rx) = mpsc::sync_channel(capacity);
        let closed = Arc::new(AtomicBool::new(false));
        (
            Self {
                tx,
                closed: closed.clone(),
            },
            rx,
            closed,
        )
    }
}

impl EventSink for TestSink {
    fn try_send(&mut self, event: Event) -> Result<(), (SinkError, Event)> {
        self.tx.try_send(event).map_err(|e| match e {
            TrySendError::Full(ev) => (SinkError::Full, ev),
            TrySendError::Disconnected(ev) => (SinkError::Closed, ev),
        })
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

/// What a finished request produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub reason: FinishReason,
    pub stats: Stats,
}

impl Outcome {
    /// Tokens and the statistics that do not depend on timing.
    pub fn work(&self) -> (Vec<u32>, Stats) {
        let stats = Stats {
            queue_time: Default::default(),
            compute_time: Default::default(),
            ticks: 0,
            ..self.stats.clone()
        };
        (self.tokens.clone(), stats)
    }
}

/// Reads events until the request ends; `first` holds events already taken off the channel.
pub fn collect(rx: &Receiver<Event>, first: Vec<Event>) -> Result<Outcome> {
    let mut tokens = Vec::new();
    let mut pending = first.into_iter();
    loop {
        let ev = match pending.next() {
            Some(ev) => ev,
            None => rx
                .recv_timeout(Duration::from_secs(120))
                .context("engine stalled")?,
        };
        match ev {
            Event::Tokens(t) => tokens.extend(t),
            Event::Finished { reason, stats } => {
                return Ok(Outcome {
                    tokens,
                    reason,
                    stats,
                })
            }
            Event::Failed(e) => bail!("request failed: {e}"),
        }
    }
}
