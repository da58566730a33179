//! Test helpers shared by every family: an event sink over a bounded std
//! channel that the test can close, collecting a request's events, request
//! builders, serving a fixture behind the real engine, and the checks the
//! families' serving tests share.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use wavefront_engine::{
    CanvasFrame, EngineError, Event, EventSink, Family, FinishReason, RequestError, SinkError,
    Standalone, Stats, TokenLogprob,
};
use wavefront_models::ModelFiles;

use crate::options::LoadOptions;
use crate::registry::load_model;
use crate::request::{GenerateSpec, SchemeParams};
use crate::served::{Planner, ServedModel};

/// A sink over a bounded std channel; `closed` marks the client gone (the engine's reap path),
/// dropping the receiver makes sends fail (the delivery path), `stop` is a transport's stop
/// string.
pub struct TestSink {
    pub tx: SyncSender<Event>,
    pub closed: Arc<AtomicBool>,
    pub stop: Arc<AtomicBool>,
}

impl TestSink {
    pub fn new(capacity: usize) -> (Self, Receiver<Event>, Arc<AtomicBool>) {
        let (tx, rx) = mpsc::sync_channel(capacity);
        let closed = Arc::new(AtomicBool::new(false));
        (
            Self {
                tx,
                closed: closed.clone(),
                stop: Arc::default(),
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

    fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// The float64 log-softmax of a logits row (what tests check log-probabilities against).
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .map(|&v| f64::from(v))
        .fold(f64::NEG_INFINITY, f64::max);
    let lse = max
        + row
            .iter()
            .map(|&v| (f64::from(v) - max).exp())
            .sum::<f64>()
            .ln();
    row.iter().map(|&v| f64::from(v) - lse).collect()
}

/// Checks a served entry against a float64 log-softmax row (`want`, by token id) within `tol`:
/// the token's own log-probability and every alternative's.
pub fn check_entry(
    what: &str,
    token: u32,
    lp: &TokenLogprob,
    want: &[f64],
    tol: f64,
) -> Result<()> {
    for &(id, got) in std::iter::once(&(token, lp.logprob)).chain(&lp.top) {
        let w = want[id as usize];
        ensure!(
            (f64::from(got) - w).abs() < tol,
            "{what}: logprob of {id} {got}, the reference gives {w}"
        );
    }
    Ok(())
}

/// Checks served log-probabilities against upstream's own confidences: each token's
/// `exp(logprob)` is `want[position]`, the probability upstream computed for it from the step
/// that committed it, and its alternatives are that distribution's most likely tokens, the
/// token itself first (a greedy choice).
pub fn check_logprobs_are_confidences(
    name: &str,
    out: &Outcome,
    prompt_len: usize,
    want: &std::collections::HashMap<usize, f64>,
    top: Option<usize>,
) -> Result<()> {
    ensure!(
        !out.tokens.is_empty() && out.logprobs.len() == out.tokens.len(),
        "{name}: {} log-probabilities for {} tokens",
        out.logprobs.len(),
        out.tokens.len()
    );
    for (i, (&token, lp)) in out.tokens.iter().zip(&out.logprobs).enumerate() {
        let p = want
            .get(&(prompt_len + i))
            .with_context(|| format!("{name}: upstream committed nothing at {i}"))?;
        ensure!(
            (f64::from(lp.logprob).exp() - p).abs() < 2e-4,
            "{name} token {i}: logprob {} (p {}), upstream's confidence {p}",
            lp.logprob,
            f64::from(lp.logprob).exp()
        );
        ensure!(
            top.is_none_or(|n| lp.top.len() == n) && lp.top.first() == Some(&(token, lp.logprob)),
            "{name} token {i}: alternatives {:?} for greedy token {token}",
            lp.top
        );
        ensure!(
            lp.top.windows(2).all(|w| w[0].1 >= w[1].1),
            "{name} token {i}: alternatives out of order {:?}",
            lp.top
        );
    }
    Ok(())
}

/// What a finished request produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub reason: FinishReason,
    pub stats: Stats,
    /// Canvas frames, in the order they arrived (only when the request asked for them).
    pub frames: Vec<CanvasFrame>,
    /// One per token, in order (only when the request asked for log-probabilities).
    pub logprobs: Vec<TokenLogprob>,
    /// One per prompt token (only when the request asked to score its prompt).
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
}

impl Outcome {
    /// Tokens, finish reason and every statistic that does not depend on
    /// timing or on what else shared the batch. A request that read `k` prompt rows from
    /// another request's pages (prompt sharing: `shared_prompt_tokens`) computed `k` fewer rows
    /// in its first forward; they are counted back, as if it had computed them.
    pub fn work(&self) -> (Vec<u32>, FinishReason, Stats) {
        let mut stats = Stats {
            queue_time: Default::default(),
            compute_time: Default::default(),
            ticks: 0,
            ..self.stats.clone()
        };
        if let Some(k) = stats.counters.remove("shared_prompt_tokens") {
            for rows in ["active_rows", "rows_per_call"] {
                if let Some(first) = stats.series.get_mut(rows).and_then(|s| s.first_mut()) {
                    *first += k as u32;
                }
            }
        }
        (self.tokens.clone(), self.reason, stats)
    }
}

/// Reads events until the request ends; `first` holds events already taken off the channel.
pub fn collect(rx: &Receiver<Event>, first: Vec<Event>) -> Result<Outcome> {
    let mut tokens = Vec::new();
    let mut frames = Vec::new();
    let mut logprobs = Vec::new();
    let mut prompt_logprobs = None;
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
            Event::Logprobs(lp) => logprobs.extend(lp),
            Event::PromptLogprobs(lp) => {
                ensure!(
                    prompt_logprobs.is_none() && tokens.is_empty(),
                    "the prompt's log-probabilities came twice or after tokens"
                );
                prompt_logprobs = Some(lp);
            }
            Event::Finished { reason, stats } => {
                ensure!(
                    logprobs.is_empty() || logprobs.len() == tokens.len(),
                    "{} log-probabilities for {} tokens",
                    logprobs.len(),
                    tokens.len()
                );
                return Ok(Outcome {
                    tokens,
                    reason,
                    stats,
                    frames,
                    logprobs,
                    prompt_logprobs,
                });
            }
            Event::Failed(e) => bail!("request failed: {e}"),
            Event::Parked => bail!("a request stopped for an export nobody asked for"),
        }
    }
}

/// [`GenerateSpec::greedy`], the request benchmarks and tests send.
pub fn spec(
    prompt_ids: Vec<u32>,
    max_new_tokens: usize,
    seed: u64,
    scheme: SchemeParams,
) -> GenerateSpec {
    GenerateSpec::greedy(prompt_ids, max_new_tokens, seed, scheme)
}

/// Loads `files` as model `name`, ticking at most `max_active` requests together, and starts its
/// engine (default options otherwise, but the prefix cache off: the tests that serve this way
/// compare each request's work, statistics included, with its work alone, where a finished
/// request's kept prompt would be read instead of computed; `prompt_sharing_tests` test the
/// cache).
pub fn serve(files: ModelFiles, name: &str, max_active: usize) -> Result<Arc<dyn ServedModel>> {
    let opts = LoadOptions {
        name: name.into(),
        max_active,
        prefix_cache_entries: 0,
        ..LoadOptions::default()
    };
    Ok(load_model(files, opts)?)
}

/// Submits `spec` with a [`TestSink`] of 1024 events; its events arrive on the returned channel.
pub fn submit(served: &dyn ServedModel, spec: GenerateSpec) -> Result<Receiver<Event>> {
    let (sink, rx, _) = TestSink::new(1024);
    served.submit(spec, Box::new(sink), None, tracing::Span::none())?;
    Ok(rx)
}

/// Submits `spec` expecting the engine to refuse it at once; the error it was refused with.
pub fn refusal(served: &dyn ServedModel, spec: GenerateSpec) -> Result<EngineError> {
    let (sink, _rx, _) = TestSink::new(4);
    match served.submit(spec, Box::new(sink), None, tracing::Span::none()) {
        Err(e) => Ok(e),
        Ok(id) => bail!("request {id} was accepted"),
    }
}

/// Loads `files` with a slot pool of `memory_budget_bytes` and submits `spec`, which the engine
/// must refuse at once as larger than the pool; returns the slots it needed and the pool's.
pub fn refused_as_too_large(
    files: ModelFiles,
    memory_budget_bytes: u64,
    spec: GenerateSpec,
) -> Result<(usize, usize)> {
    let opts = LoadOptions {
        memory_budget_bytes,
        ..LoadOptions::default()
    };
    let served = load_model(files, opts)?;
    let err = refusal(served.as_ref(), spec);
    served.shutdown();
    match err? {
        EngineError::TooLarge { needed, total } => Ok((needed, total)),
        other => bail!("refused with {other:?}, not as too large"),
    }
}

/// Checks that the planner refuses each request as an invalid argument whose message contains
/// the text paired with it.
pub fn assert_invalid<P: Planner>(planner: &P, cases: Vec<(GenerateSpec, &str)>) -> Result<()> {
    for (s, want) in cases {
        match planner.prepare(s) {
            Err(RequestError::InvalidArgument(m)) => {
                ensure!(m.contains(want), "{m:?} lacks {want:?}")
            }
            Err(e) => bail!("{want}: unexpected {e:?}"),
            Ok(_) => bail!("{want}: accepted"),
        }
    }
    Ok(())
}

/// Serves every request alone, one after another, then all of them again with request i
/// submitted once request i - 1 has sent an event that `ready` accepts (or has ended), so that
/// each joins a batch that is already running; checks that each request's [`Outcome::work`] is
/// the same both times. Returns the outcomes of the requests served alone.
pub fn assert_joining_requests_match_alone(
    served: &dyn ServedModel,
    specs: &[GenerateSpec],
    ready: impl Fn(&Event) -> bool,
) -> Result<Vec<Outcome>> {
    let alone = specs
        .iter()
        .map(|s| collect(&submit(served, s.clone())?, Vec::new()))
        .collect::<Result<Vec<_>>>()?;
    let mut receivers: Vec<(Receiver<Event>, Vec<Event>)> = Vec::new();
    for s in specs {
        if let Some((rx, seen)) = receivers.last_mut() {
            loop {
                let ev = rx
                    .recv_timeout(Duration::from_secs(120))
                    .context("engine stalled")?;
                let joins = ready(&ev) || matches!(ev, Event::Finished { .. } | Event::Failed(_));
                seen.push(ev);
                if joins {
                    break;
                }
            }
        }
        receivers.push((submit(served, s.clone())?, Vec::new()));
    }
    for (i, ((rx, seen), want)) in receivers.into_iter().zip(&alone).enumerate() {
        let got = collect(&rx, seen)?;
        ensure!(
            got.work() == want.work(),
            "request {i} ({}): batched {:?}, alone {:?}",
            specs[i].scheme.name(),
            got.work(),
            want.work()
        );
    }
    Ok(alone)
}

/// Checks how a response ends: it is not empty and at most `spec.max_new_tokens` long; it stops
/// right after its first stop token (`eos` or one of the request's) with
/// [`FinishReason::StopToken`], or, without one, runs to `max_new_tokens` with
/// [`FinishReason::Length`]. Returns whether it stopped on a stop token.
pub fn assert_ends_at_first_stop(spec: &GenerateSpec, out: &Outcome, eos: u32) -> Result<bool> {
    ensure!(!out.tokens.is_empty() && out.tokens.len() <= spec.max_new_tokens);
    let stops = |t: &u32| *t == eos || spec.stop_token_ids.contains(t);
    let first_stop = out.tokens.iter().position(stops);
    ensure!(
        first_stop.is_none_or(|k| k + 1 == out.tokens.len()),
        "{:?}",
        out.tokens
    );
    if first_stop.is_some() {
        ensure!(out.reason == FinishReason::StopToken);
    } else {
        ensure!(out.tokens.len() == spec.max_new_tokens && out.reason == FinishReason::Length);
    }
    Ok(first_stop.is_some())
}

/// Submits `spec` and, once its first tokens arrive, stops it the way a transport does when a
/// stop string appears: the request must finish with [`FinishReason::StopString`], before its
/// natural end, with statistics the family filled in (`check` looks at them), and give every
/// slot back.
pub fn assert_stop_finishes_with_stats(
    served: &dyn ServedModel,
    spec: GenerateSpec,
    check: impl FnOnce(&Stats) -> Result<()>,
) -> Result<Outcome> {
    let max = spec.max_new_tokens;
    // A one-event buffer: the engine pauses the request until the test reads, so it cannot
    // run to its natural end before the stop is raised, however fast it decodes.
    let (sink, rx, _) = TestSink::new(1);
    let stop = sink.stop.clone();
    served.submit(spec, Box::new(sink), None, tracing::Span::none())?;
    let first = loop {
        match rx
            .recv_timeout(Duration::from_secs(120))
            .context("engine stalled")?
        {
            ev @ Event::Tokens(_) => break ev,
            Event::Canvas(_) => {}
            other => bail!("ended before its first tokens: {other:?}"),
        }
    };
    stop.store(true, Ordering::Release);
    let out = collect(&rx, vec![first])?;
    ensure!(
        out.reason == FinishReason::StopString,
        "finished with {:?}",
        out.reason
    );
    ensure!(out.tokens.len() < max, "ran to its natural end");
    ensure!(out.stats.ticks > 0 && out.stats.generated_tokens as usize == out.tokens.len());
    check(&out.stats).with_context(|| format!("stats {:?}", out.stats))?;
    wait_for_free_slots(served, Duration::from_secs(30))?;
    Ok(out)
}

/// Waits until every slot of the pool is free again; fails after `within`.
pub fn wait_for_free_slots(served: &dyn ServedModel, within: Duration) -> Result<()> {
    let start = Instant::now();
    while served.load().free_slots != served.load().total_slots {
        ensure!(start.elapsed() < within, "slots leaked");
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Runs `programs` packed into the same ticks of `family` until every one is done, through the
/// engine's own plan → run → commit ([`Standalone`]: slots granted as the programs grow, no
/// admission or preemption); the programs are moved in and back out. Returns the family and how
/// many ticks each program was part of; fails after 10 000 ticks.
pub fn run_to_end<F: Family>(family: F, programs: &mut Vec<F::Program>) -> Result<(F, Vec<usize>)> {
    let mut driver = Standalone::new(family);
    for p in programs.drain(..) {
        driver.add(p);
    }
    let ticks = driver.run_until_done(10_000);
    let (family, back) = driver.into_parts();
    programs.extend(back);
    let ticks = ticks?;
    Ok((family, ticks.into_iter().map(|t| t as usize).collect()))
}

/// Loads `files` with `opts`, submits every request at once and collects their outcomes.
pub fn served_outcomes(
    files: ModelFiles,
    opts: LoadOptions,
    requests: &[GenerateSpec],
) -> Result<Vec<Outcome>> {
    let served = load_model(files, opts)?;
    let receivers = requests
        .iter()
        .map(|spec| submit(served.as_ref(), spec.clone()))
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
    files: impl Fn() -> Result<ModelFiles>,
    requests: &[GenerateSpec],
) -> Result<()> {
    let opts = |world| LoadOptions {
        tensor_parallel: world,
        ..LoadOptions::default()
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

/// Serves `specs` all at once from a pool of `memory_budget_bytes` (a few pages: requests are
/// preempted and resumed), and checks that every request's [`Outcome::work`] (tokens, finish
/// reason, every statistic but timing) is what `served` alone, with room to spare, produces.
/// Returns the preemptions the tight engine made.
pub fn assert_preempted_requests_match_alone(
    files: ModelFiles,
    served: &dyn ServedModel,
    memory_budget_bytes: u64,
    specs: &[GenerateSpec],
) -> Result<u64> {
    assert_preempted_requests_match_alone_with(
        files,
        served,
        memory_budget_bytes,
        specs,
        LoadOptions::default(),
    )
}

/// [`assert_preempted_requests_match_alone`] with the tight engine loaded with `base` (its
/// budget and concurrency set here).
pub fn assert_preempted_requests_match_alone_with(
    files: ModelFiles,
    served: &dyn ServedModel,
    memory_budget_bytes: u64,
    specs: &[GenerateSpec],
    base: LoadOptions,
) -> Result<u64> {
    let alone = specs
        .iter()
        .map(|s| collect(&submit(served, s.clone())?, Vec::new()))
        .collect::<Result<Vec<_>>>()?;
    let opts = LoadOptions {
        memory_budget_bytes,
        max_active: specs.len(),
        ..base
    };
    let tight = load_model(files, opts)?;
    let receivers = specs
        .iter()
        .map(|s| submit(tight.as_ref(), s.clone()))
        .collect::<Result<Vec<_>>>()?;
    for (i, (rx, want)) in receivers.iter().zip(&alone).enumerate() {
        let got = collect(rx, Vec::new())?;
        ensure!(
            got.work() == want.work(),
            "request {i} ({}) under pressure: {:?}, alone {:?}",
            specs[i].scheme.name(),
            got.work(),
            want.work()
        );
    }
    wait_for_free_slots(tight.as_ref(), Duration::from_secs(10))?;
    let load = tight.load();
    tight.shutdown();
    ensure!(load.preempted == 0 && load.active == 0);
    Ok(load.preemptions)
}

/// [`Outcome::work`] without what chunking a prefill changes: the number of forward passes and
/// the per-call series named in `per_call`.
fn work_but_calls(o: &Outcome, per_call: &[&str]) -> (Vec<u32>, FinishReason, Stats) {
    let (tokens, reason, mut stats) = o.work();
    stats.forward_passes = 0;
    for name in per_call {
        stats.series.remove(*name);
    }
    (tokens, reason, stats)
}

/// With a row budget of `rows` per tick: every request of `specs` served at once produces what
/// it produces on `roomy` (no budget), forward passes and the series in `per_call` aside; and
/// `short`, decoding when `long` (a prompt of many budgets) arrives, keeps streaming tokens
/// while `long`'s prefill runs in chunks (at least `min_tokens` of them before `long`'s first).
pub fn assert_chunked_prefill_matches(
    files: ModelFiles,
    roomy: &dyn ServedModel,
    rows: usize,
    specs: &[GenerateSpec],
    (long, short, min_tokens): (GenerateSpec, GenerateSpec, usize),
    per_call: &[&str],
) -> Result<()> {
    let opts = LoadOptions {
        max_active: specs.len() + 2,
        max_batch_rows: Some(rows),
        ..LoadOptions::default()
    };
    let chunked = load_model(files, opts)?;
    let alone = specs
        .iter()
        .map(|s| collect(&submit(roomy, s.clone())?, Vec::new()))
        .collect::<Result<Vec<_>>>()?;
    let receivers = specs
        .iter()
        .map(|s| submit(chunked.as_ref(), s.clone()))
        .collect::<Result<Vec<_>>>()?;
    for (i, (rx, want)) in receivers.iter().zip(&alone).enumerate() {
        let got = collect(rx, Vec::new())?;
        ensure!(
            work_but_calls(&got, per_call) == work_but_calls(want, per_call),
            "request {i} ({}) with {rows} rows a tick: {:?}, without: {:?}",
            specs[i].scheme.name(),
            got.work(),
            want.work()
        );
    }
    // The short request decodes; the long one arrives; count the short one's tokens until the
    // long one's first.
    let short_rx = submit(chunked.as_ref(), short)?;
    let mut before = Vec::new();
    while !matches!(before.last(), Some(Event::Tokens(_))) {
        before.push(short_rx.recv_timeout(Duration::from_secs(60))?);
    }
    let long_rx = submit(chunked.as_ref(), long)?;
    let mut long_events = Vec::new();
    loop {
        let ev = long_rx.recv_timeout(Duration::from_secs(60))?;
        let first = matches!(
            ev,
            Event::Tokens(_) | Event::Finished { .. } | Event::Failed(_)
        );
        long_events.push(ev);
        if first {
            break;
        }
    }
    let mut during = 0;
    while let Ok(ev) = short_rx.try_recv() {
        if let Event::Tokens(t) = &ev {
            during += t.len();
        }
        before.push(ev);
    }
    let short_out = collect(&short_rx, before)?;
    ensure!(
        during >= min_tokens,
        "the decoding request streamed {during} tokens during the long prefill, want {min_tokens} \
         (it made {:?}, {:?})",
        short_out.tokens,
        short_out.reason
    );
    collect(&long_rx, long_events)?;
    wait_for_free_slots(chunked.as_ref(), Duration::from_secs(10))?;
    chunked.shutdown();
    Ok(())
}

/// A sink that takes `open` events and then reports itself full until `open` grows: the engine
/// pauses the request there (its next events wait in the engine), so a test stops it at a
/// known point.
pub struct GateSink {
    tx: SyncSender<Event>,
    open: Arc<std::sync::atomic::AtomicUsize>,
    sent: usize,
}

impl EventSink for GateSink {
    fn try_send(&mut self, event: Event) -> Result<(), (SinkError, Event)> {
        if self.sent >= self.open.load(Ordering::Acquire) {
            return Err((SinkError::Full, event));
        }
        self.tx.try_send(event).map_err(|e| match e {
            TrySendError::Full(ev) => (SinkError::Full, ev),
            TrySendError::Disconnected(ev) => (SinkError::Closed, ev),
        })?;
        self.sent += 1;
        Ok(())
    }

    fn is_closed(&self) -> bool {
        false
    }
}

/// A gated sink letting `after` events through, its channel, and its gate.
fn gated(
    after: usize,
) -> (
    GateSink,
    Receiver<Event>,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    let (tx, rx) = mpsc::sync_channel(4096);
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(after));
    (
        GateSink {
            tx,
            open: open.clone(),
            sent: 0,
        },
        rx,
        open,
    )
}

fn recv(rx: &Receiver<Event>) -> Result<Event> {
    rx.recv_timeout(Duration::from_secs(120))
        .context("engine stalled")
}

/// Runs `spec` on `hops[0]` and moves it to the next model of `hops` each time it has sent
/// `after` more events (stopping it at a step boundary, exporting its state, resuming it
/// there); on the last, or once it has ended, it runs to the end. With `call_off`, each export
/// is first called off once (the request continues where it is) and then made again. Returns
/// everything it sent, in order, and the moves made.
pub fn run_moving(
    hops: &[&dyn ServedModel],
    spec: GenerateSpec,
    after: usize,
    call_off: bool,
) -> Result<(Outcome, u32)> {
    use wavefront_engine::{EngineError, Exported};
    let (sink, mut rx, mut gate) = gated(after);
    let mut id = hops[0].submit(spec, Box::new(sink), None, tracing::Span::none())?;
    let mut events: Vec<Event> = Vec::new();
    let mut moves = 0;
    let ended = |ev: &Event| matches!(ev, Event::Finished { .. } | Event::Failed(_));
    let export = |m: &dyn ServedModel, id| -> Result<Result<Exported, EngineError>> {
        let (tx, erx) = mpsc::channel();
        m.export(
            id,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        erx.recv_timeout(Duration::from_secs(60))
            .context("no export answer")
    };
    let settle = |m: &dyn ServedModel, id, moved| -> Result<()> {
        let (tx, frx) = mpsc::channel();
        m.finish_export(
            id,
            moved,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        Ok(frx.recv_timeout(Duration::from_secs(60))??)
    };
    let mut hop = 0;
    'hops: loop {
        let cur = hops[hop];
        if hop + 1 == hops.len() {
            gate.store(usize::MAX, Ordering::Release);
            loop {
                let ev = recv(&rx)?;
                let last = ended(&ev);
                events.push(ev);
                if last {
                    break 'hops;
                }
            }
        }
        // The gate's events (the request is paused behind them), unless it ends first.
        for _ in 0..after {
            let ev = recv(&rx)?;
            let last = ended(&ev);
            events.push(ev);
            if last {
                break 'hops;
            }
        }
        let mut exported = export(cur, id)?;
        if call_off && exported.is_ok() {
            gate.store(usize::MAX, Ordering::Release);
            loop {
                match recv(&rx)? {
                    Event::Parked => break,
                    ev => events.push(ev),
                }
            }
            settle(cur, id, false)?;
            exported = export(cur, id)?;
        }
        let exported = match exported {
            Ok(e) => e,
            // It finished (its last events wait behind the gate): run it out here.
            Err(EngineError::CannotMove(_) | EngineError::NotFound(_)) => {
                gate.store(usize::MAX, Ordering::Release);
                loop {
                    let ev = recv(&rx)?;
                    let last = ended(&ev);
                    events.push(ev);
                    if last {
                        break 'hops;
                    }
                }
            }
            Err(e) => bail!("export failed: {e}"),
        };
        // What it made before the stop, then the stop.
        gate.store(usize::MAX, Ordering::Release);
        loop {
            match recv(&rx)? {
                Event::Parked => break,
                ev => {
                    ensure!(!ended(&ev), "an exported request ended: {ev:?}");
                    events.push(ev);
                }
            }
        }
        settle(cur, id, true)?;
        match recv(&rx)? {
            Event::Failed(EngineError::Moved) => {}
            ev => bail!("a moved request's stream ended with {ev:?}"),
        }
        let next = hops[hop + 1];
        let (sink, nrx, ngate) = gated(after);
        id = next.import(
            &exported.state,
            exported.carried,
            Box::new(sink),
            None,
            tracing::Span::none(),
        )?;
        (rx, gate) = (nrx, ngate);
        moves += 1;
        hop += 1;
    }
    let outcome = collect(&mpsc::channel().1, events)?;
    Ok((outcome, moves))
}

/// Every request of `specs`, moved between `served` and a second engine of the same checkpoint
/// (`files`) after its first event and again after its next (there and back), and once with
/// a called-off export first, produces what it produces alone on `served`: tokens, finish
/// reason and every statistic but timing, its moves counted; at least one move per request.
/// Returns the moves made.
pub fn assert_moved_requests_match_alone(
    files: ModelFiles,
    served: &dyn ServedModel,
    specs: &[GenerateSpec],
) -> Result<u32> {
    let base = LoadOptions {
        prefix_cache_entries: 0,
        ..LoadOptions::default()
    };
    assert_moved_requests_match_alone_with(files, served, specs, base)
}

/// [`assert_moved_requests_match_alone`] with the second engine loaded with `base` (its name
/// and concurrency set here).
pub fn assert_moved_requests_match_alone_with(
    files: ModelFiles,
    served: &dyn ServedModel,
    specs: &[GenerateSpec],
    base: LoadOptions,
) -> Result<u32> {
    let other = load_model(
        files,
        LoadOptions {
            name: served.info().name.clone(),
            max_active: specs.len(),
            ..base
        },
    )?;
    ensure!(
        served.migration_key().map_err(anyhow::Error::msg)?
            == other.migration_key().map_err(anyhow::Error::msg)?,
        "two engines of one checkpoint must take each other's requests"
    );
    let mut total = 0;
    for (i, s) in specs.iter().enumerate() {
        let alone = collect(&submit(served, s.clone())?, Vec::new())?;
        for (after, call_off) in [(1, false), (2, i == 0)] {
            let (got, moves) = run_moving(
                &[served, other.as_ref(), served],
                s.clone(),
                after,
                call_off,
            )?;
            ensure!(
                got.stats.migrations == moves,
                "request {i}: {moves} moves, {} counted",
                got.stats.migrations
            );
            let mut work = got.work();
            work.2.migrations = 0;
            ensure!(
                work == alone.work(),
                "request {i} ({}) moved {moves} times after every {after} events: {:?}, alone {:?}",
                s.scheme.name(),
                work,
                alone.work()
            );
            ensure!(
                got.frames == alone.frames,
                "request {i}: canvas frames differ after moves"
            );
            total += moves;
        }
    }
    other.shutdown();
    ensure!(
        total as usize >= specs.len(),
        "only {total} moves for {} requests",
        specs.len()
    );
    Ok(total)
}
