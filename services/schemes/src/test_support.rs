//! Test helpers shared by every family: an event sink over a bounded std
//! channel that the test can close, and collecting a request's events.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use wavefront_engine::{CanvasFrame, Event, EventSink, FinishReason, SinkError, Stats};

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
    /// Canvas frames, in the order they arrived (only when the request asked for them).
    pub frames: Vec<CanvasFrame>,
}

impl Outcome {
    /// Tokens, finish reason and every statistic that does not depend on
    /// timing or on what else shared the batch.
    pub fn work(&self) -> (Vec<u32>, FinishReason, Stats) {
        let stats = Stats {
            queue_time: Default::default(),
            compute_time: Default::default(),
            ticks: 0,
            ..self.stats.clone()
        };
        (self.tokens.clone(), self.reason, stats)
    }
}

/// Reads events until the request ends; `first` holds events already taken off the channel.
pub fn collect(rx: &Receiver<Event>, first: Vec<Event>) -> Result<Outcome> {
    let mut tokens = Vec::new();
    let mut frames = Vec::new();
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
            Event::Canvas(f) => frames.push(f),
            Event::Finished { reason, stats } => {
                return Ok(Outcome {
                    tokens,
                    reason,
                    stats,
                    frames,
                })
            }
            Event::Failed(e) => bail!("request failed: {e}"),
        }
    }
}

/// Loads `files` with `opts`, submits every request at once and collects their outcomes.
pub fn served_outcomes(
    files: wavefront_models::ModelFiles,
    opts: crate::served::LoadOptions,
    requests: &[crate::request::GenerateSpec],
) -> Result<Vec<Outcome>> {
    let served = crate::served::load_model(files, opts)?;
    let receivers = requests
        .iter()
        .map(|spec| {
            let (sink, rx, _) = TestSink::new(1024);
            served.submit(spec.clone(), Box::new(sink), None, tracing::Span::none())?;
            Ok(rx)
        })
        .collect::<Result<Vec<_>>>()?;
    let out = receivers
        .iter()
        .map(|rx| collect(rx, Vec::new()))
        .collect::<Result<Vec<_>>>();
    served.shutdown();
    out
}

/// Serves `requests` on one rank and split over 2 and 4 in-process tensor-parallel ranks:
/// every request decodes the same tokens with the same per-step statistics.
pub fn assert_tensor_parallel_decodes_match(
    files: impl Fn() -> Result<wavefront_models::ModelFiles>,
    requests: &[crate::request::GenerateSpec],
) -> Result<()> {
    let opts = |world| crate::served::LoadOptions {
        tensor_parallel: world,
        ..crate::served::LoadOptions::default()
    };
    let one = served_outcomes(files()?, opts(1), requests)?;
    for world in [2, 4] {
        for (i, (a, b)) in one
            .iter()
            .zip(served_outcomes(files()?, opts(world), requests)?)
            .enumerate()
        {
            anyhow::ensure!(
                a.tokens == b.tokens && a.reason == b.reason && a.stats.series == b.stats.series,
                "{world} ranks, request {i}: {:?} vs {:?}",
                a.tokens,
                b.tokens
            );
        }
    }
    Ok(())
}
