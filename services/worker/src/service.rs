//! The worker's gRPC services: public `Generation` and the router's `Worker`.
//!
//! A request's life: extract the caller's trace context, convert and
//! validate (INVALID_ARGUMENT / NOT_FOUND at once), submit to the engine with
//! a bounded per-request channel, and return a stream that reads engine
//! events, assembles text and ends with a `done` message. Dropping the stream
//! (client cancelled, deadline hit, stop string seen) drops the channel's
//! receiver; the engine sees the closed sink and frees the request's slots
//! at its next tick.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use wavefront_telemetry::metrics as m;

use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};
use wavefront_engine::{Event, EventSink, FinishReason, RequestId, SinkError, Stats};
use wavefront_proto::v1 as pb;
use wavefront_proto::worker::v1 as wpb;
use wavefront_schemes::ServedModel;

use crate::convert;
use crate::limits::RequestLimits;
use crate::output::{decoder, OutputAssembler};
use crate::status::from_engine_error;

pub(crate) type EventStream =
    Pin<Box<dyn Stream<Item = Result<pb::GenerateStreamResponse, Status>> + Send>>;

/// The `model` label of requests for a model this worker does not serve.
const UNKNOWN_MODEL: &str = "unknown";

/// Events buffered per request before the engine pauses it.
pub(crate) const EVENT_BUFFER: usize = 64;

/// A request's sink: a bounded tokio channel, and the flag the stream sets when a stop string
/// ended the response (the engine then finishes the request and sends its statistics).
pub(crate) struct TokioSink {
    pub(crate) tx: mpsc::Sender<Event>,
    pub(crate) stop: Arc<AtomicBool>,
}

impl EventSink for TokioSink {
    fn try_send(&mut self, event: Event) -> Result<(), (SinkError, Event)> {
        self.tx.try_send(event).map_err(|e| match e {
            mpsc::error::TrySendError::Full(ev) => (SinkError::Full, ev),
            mpsc::error::TrySendError::Closed(ev) => (SinkError::Closed, ev),
        })
    }
    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
    fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// Both gRPC services of a worker, over the models it serves.
#[derive(Clone)]
pub struct WorkerService {
    inner: Arc<Inner>,
}

struct Inner {
    models: Vec<Arc<dyn ServedModel>>,
    worker_id: String,
    ready: AtomicBool,
    limits: RequestLimits,
    exports: Exports,
}

/// Exports waiting for their request's stream to reach the stop ([`Event::Parked`]): the stream
/// hands its output state to the export there, keyed by model name and request id.
pub(crate) type Exports = Arc<
    std::sync::Mutex<
        std::collections::HashMap<
            (String, u64),
            tokio::sync::oneshot::Sender<crate::migrate::Parked>,
        >,
    >,
>;

impl WorkerService {
    pub fn new(models: Vec<Arc<dyn ServedModel>>, worker_id: String) -> Self {
        Self {
            inner: Arc::new(Inner {
                models,
                worker_id,
                ready: AtomicBool::new(true),
                limits: RequestLimits::default(),
                exports: Exports::default(),
            }),
        }
    }

    /// Sets the per-request limits (before the service is shared).
    pub fn with_limits(mut self, limits: RequestLimits) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("limits are set before the service is cloned")
            .limits = limits;
        self
    }

    /// Marks the worker as draining: load reports say not ready and new
    /// requests get UNAVAILABLE.
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::Acquire)
    }

    pub fn models(&self) -> &[Arc<dyn ServedModel>] {
        &self.inner.models
    }

    /// Requests in flight across all models (for draining).
    pub fn in_flight(&self) -> usize {
        self.inner
            .models
            .iter()
            .map(|m| {
                let l = m.load();
                l.active + l.queued
            })
            .sum()
    }

    pub(crate) fn exports(&self) -> &Exports {
        &self.inner.exports
    }

    pub(crate) fn pick(&self, name: &str) -> Result<Arc<dyn ServedModel>, Status> {
        let models = &self.inner.models;
        if name.is_empty() {
            return match models.as_slice() {
                [only] => Ok(only.clone()),
                _ => Err(Status::invalid_argument(format!(
                    "this worker serves {} models; set `model` to one of: {}",
                    models.len(),
                    self.model_names()
                ))),
            };
        }
        models
            .iter()
            .find(|m| m.info().name == name)
            .cloned()
            .ok_or_else(|| {
                Status::not_found(format!(
                    "model {name:?} is not served here; served: {}",
                    self.model_names()
                ))
            })
    }

    fn model_names(&self) -> String {
        self.inner
            .models
            .iter()
            .map(|m| m.info().name.clone())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Validates and submits; returns the response stream. Rejections are
    /// counted in the request metrics here; outcomes of admitted requests
    /// are counted when their stream ends.
    async fn start(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<(EventStream, RequestId), Status> {
        // A request without a scheme runs the model's first one. The `model` label is a served
        // model's name, or `unknown`: a client's arbitrary names never become series.
        let picked = self.pick(&request.get_ref().model).ok();
        let default_scheme = picked
            .as_ref()
            .and_then(|m| m.info().schemes.first().copied());
        let labels = (
            picked.map_or_else(|| UNKNOWN_MODEL.to_owned(), |m| m.info().name.clone()),
            scheme_label(request.get_ref(), default_scheme),
        );
        self.start_inner(request).await.inspect_err(|s| {
            let (model, scheme) = labels;
            record_outcome(&model, scheme, s.code(), None);
        })
    }

    async fn start_inner(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<(EventStream, RequestId), Status> {
        if !self.is_ready() {
            return Err(Status::unavailable(
                "worker is draining; retry on another worker",
            ));
        }
        let deadline = convert::deadline_from_metadata(request.metadata())?;
        let span = tracing::info_span!(
            "request",
            otel.name = "worker.generate",
            model = tracing::field::Empty,
            scheme = tracing::field::Empty,
            prompt_tokens = tracing::field::Empty,
            output_tokens = tracing::field::Empty,
            finish_reason = tracing::field::Empty,
        );
        wavefront_telemetry::extract_parent(&span, request.metadata());
        let req = request.into_inner();
        let model = self.pick(&req.model)?;
        let limits = self.inner.limits;
        limits.check_fields(&req, model.as_ref())?;
        // A full queue sheds the request before any work proportional to it.
        model.check_room().map_err(|e| from_engine_error(&e))?;
        // Tokenizing and template rendering take time in proportion to the prompt: off the
        // runtime's threads, so no request stalls the others or the load reports.
        let (spec, req) = {
            let model = model.clone();
            tokio::task::spawn_blocking(move || {
                let spec = convert::spec_from_proto(&req, model.as_ref());
                (spec, req)
            })
            .await
            .map_err(|e| Status::internal(format!("request conversion failed: {e}")))?
        };
        let spec = spec?;
        limits.check_prompt(spec.prompt_ids.len())?;
        span.record("model", model.info().name.as_str());
        span.record("scheme", spec.scheme.name());
        span.record("prompt_tokens", spec.prompt_ids.len());
        let seed = spec.sampling.seed;
        let scheme = spec.scheme.name();
        metrics::counter!(m::PROMPT_TOKENS_TOTAL, "model" => model.info().name.clone(), "scheme" => scheme)
            .increment(spec.prompt_ids.len() as u64);
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let stop = Arc::new(AtomicBool::new(false));
        let sink = TokioSink {
            tx,
            stop: stop.clone(),
        };
        let id = model
            .submit(spec, Box::new(sink), deadline, span.clone())
            .map_err(|e| from_engine_error(&e))?;
        tracing::debug!(parent: &span, request = %id, "submitted");
        let state = StreamState {
            key: (model.info().name.clone(), id.0),
            exports: self.inner.exports.clone(),
            messages: 0,
            model,
            rx: Some(rx),
            stop,
            out: OutputAssembler::new(req.stop_strings),
            pending: VecDeque::new(),
            seed,
            scheme,
            started: Instant::now(),
            deadline,
            first_token: false,
            last_tokens: Instant::now(),
            recorded: false,
            span,
        };
        Ok((
            wavefront_proto::timeout::with_deadline(response_stream(state), deadline),
            id,
        ))
    }
}

pub(crate) struct StreamState {
    /// The served model's name and the request's engine id.
    pub(crate) key: (String, u64),
    pub(crate) exports: Exports,
    /// Messages yielded for tokens and canvas frames (an export reports how many).
    pub(crate) messages: u64,
    pub(crate) model: Arc<dyn ServedModel>,
    pub(crate) rx: Option<mpsc::Receiver<Event>>,
    /// Set once a stop string ended the response: the engine finishes the request.
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) out: OutputAssembler,
    pub(crate) pending: VecDeque<Result<pb::GenerateStreamResponse, Status>>,
    pub(crate) seed: u64,
    pub(crate) scheme: &'static str,
    pub(crate) started: Instant,
    /// The request's deadline: the timer around the stream drops it when this passes.
    pub(crate) deadline: Option<Instant>,
    pub(crate) first_token: bool,
    /// When the last tokens were streamed (inter-token latency).
    pub(crate) last_tokens: Instant,
    /// The outcome was counted (a stream dropped before that was cancelled or timed out).
    pub(crate) recorded: bool,
    pub(crate) span: tracing::Span,
}

impl StreamState {
    fn record(&mut self, code: tonic::Code, stats: Option<&Stats>) {
        if self.recorded {
            return;
        }
        self.recorded = true;
        let model = self.model.info().name.clone();
        metrics::histogram!(m::REQUEST_DURATION, "model" => model.clone(), "scheme" => self.scheme, "status" => m::code_name(code))
            .record(self.started.elapsed().as_secs_f64());
        record_outcome(&model, self.scheme, code, stats);
        metrics::counter!(m::GENERATED_TOKENS_TOTAL, "model" => model, "scheme" => self.scheme)
            .increment(self.out.token_ids().len() as u64);
    }
}

impl Drop for StreamState {
    fn drop(&mut self) {
        // Dropped before its outcome: the deadline timer cut it (the client got
        // DEADLINE_EXCEEDED), or the client went away.
        let code = if self.deadline.is_some_and(|d| Instant::now() >= d) {
            tonic::Code::DeadlineExceeded
        } else {
            tonic::Code::Cancelled
        };
        self.record(code, None);
    }
}

/// Counts one request outcome (and its per-scheme work, when it ran).
fn record_outcome(model: &str, scheme: &'static str, code: tonic::Code, stats: Option<&Stats>) {
    let model = model.to_owned();
    metrics::counter!(m::REQUESTS_TOTAL, "model" => model.clone(), "scheme" => scheme, "status" => m::code_name(code)).increment(1);
    if let Some(stats) = stats {
        metrics::counter!(m::FORWARD_PASSES_TOTAL, "model" => model.clone(), "scheme" => scheme)
            .increment(stats.forward_passes);
        for (event, n) in &stats.counters {
            metrics::counter!(m::SCHEME_EVENTS_TOTAL, "model" => model.clone(), "scheme" => scheme, "event" => event.clone())
                .increment(*n);
        }
    }
}

/// The `scheme` label of a request (`default` when it names none).
fn scheme_label(req: &pb::GenerateRequest, default: Option<&'static str>) -> &'static str {
    match &req.scheme {
        None => default.unwrap_or("unspecified"),
        Some(pb::generate_request::Scheme::Ar(_)) => "ar",
        Some(pb::generate_request::Scheme::DiffusionForcing(_)) => "diffusion-forcing",
        Some(pb::generate_request::Scheme::LowConfidence(_)) => "low-confidence",
        Some(pb::generate_request::Scheme::Wino(_)) => "wino",
        Some(pb::generate_request::Scheme::PlanInfill(_)) => "plan-infill",
        Some(pb::generate_request::Scheme::DiffusionGenerate(_)) => "diffusion-generate",
        Some(pb::generate_request::Scheme::BlockDiffusion(_)) => "block-diffusion",
    }
}

/// Reads engine events and yields protobuf stream messages; ends after `done`.
pub(crate) fn response_stream(state: StreamState) -> EventStream {
    Box::pin(futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(item) = st.pending.pop_front() {
                return Some((item, st));
            }
            let event = st.rx.as_mut()?.recv().await;
            st.on_event(event);
        }
    }))
}

impl StreamState {
    fn on_event(&mut self, event: Option<Event>) {
        let model = self.model.clone();
        let decode = decoder(model.as_ref());
        match event {
            // Tokens and frames the engine made before it saw the stop are not the response's.
            Some(Event::Tokens(_) | Event::Canvas(_)) if self.out.is_stopped() => {}
            Some(Event::Tokens(ids)) => {
                let now = Instant::now();
                if !self.first_token {
                    self.first_token = true;
                    metrics::histogram!(m::TIME_TO_FIRST_TOKEN, "model" => model.info().name.clone(), "scheme" => self.scheme)
                        .record(self.started.elapsed().as_secs_f64());
                } else if !ids.is_empty() {
                    let share =
                        now.duration_since(self.last_tokens).as_secs_f64() / ids.len() as f64;
                    let itl = metrics::histogram!(m::INTER_TOKEN_LATENCY, "model" => model.info().name.clone(), "scheme" => self.scheme);
                    for _ in &ids {
                        itl.record(share);
                    }
                }
                self.last_tokens = now;
                let delta = self.out.push(&ids, &decode);
                self.messages += 1;
                self.pending
                    .push_back(Ok(chunk(delta.token_ids, delta.text)));
                if delta.stopped {
                    // The engine finishes the request at its next step and sends its stats.
                    self.stop.store(true, Ordering::Release);
                }
            }
            Some(Event::Parked) => {
                // Everything before the stop is queued: the export takes the output state.
                let hook = self
                    .exports
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .remove(&self.key);
                if let Some(hook) = hook {
                    let mut output = self.out.snapshot();
                    output.messages = self.messages;
                    let _ = hook.send(crate::migrate::Parked {
                        output,
                        scheme: self.scheme,
                        seed: self.seed,
                        stopped: self.out.is_stopped(),
                    });
                }
            }
            Some(Event::Canvas(frame)) => {
                self.messages += 1;
                self.pending.push_back(Ok(pb::GenerateStreamResponse {
                    event: Some(pb::generate_stream_response::Event::Canvas(
                        convert::canvas_event(&frame),
                    )),
                }));
            }
            Some(Event::Finished { stats, .. }) if self.out.is_stopped() => {
                let stats = self.out.stopped_stats(stats);
                self.end_stopped(stats);
            }
            // The response was complete when the request failed or the engine went away.
            Some(Event::Failed(_)) | None if self.out.is_stopped() => {
                let stats = self.out.stopped_stats(Stats::default());
                self.end_stopped(stats);
            }
            Some(Event::Finished { reason, stats }) => {
                self.rx = None;
                let rest = self.out.finish(&decode);
                if !rest.is_empty() {
                    self.pending.push_back(Ok(chunk(Vec::new(), rest)));
                }
                let msg = done(self, reason, &stats);
                self.record(tonic::Code::Ok, Some(&stats));
                self.pending.push_back(Ok(msg));
            }
            Some(Event::Failed(e)) => {
                self.rx = None;
                tracing::info!(parent: &self.span, error = %e, "request failed");
                let status = from_engine_error(&e);
                self.record(status.code(), None);
                self.pending.push_back(Err(status));
            }
            None => {
                self.rx = None;
                self.record(tonic::Code::Unavailable, None);
                self.pending.push_back(Err(Status::unavailable(
                    "engine stopped before the request finished",
                )));
            }
        }
    }
}

impl StreamState {
    /// Ends a response a stop string completed.
    fn end_stopped(&mut self, stats: Stats) {
        self.rx = None;
        let msg = done(self, FinishReason::StopString, &stats);
        self.record(tonic::Code::Ok, Some(&stats));
        self.pending.push_back(Ok(msg));
    }
}

fn chunk(token_ids: Vec<u32>, text: String) -> pb::GenerateStreamResponse {
    pb::GenerateStreamResponse {
        event: Some(pb::generate_stream_response::Event::Tokens(
            pb::TokenChunk { token_ids, text },
        )),
    }
}

fn done(st: &StreamState, reason: FinishReason, stats: &Stats) -> pb::GenerateStreamResponse {
    st.span.record("output_tokens", st.out.token_ids().len());
    st.span.record("finish_reason", reason.as_str());
    tracing::info!(parent: &st.span, tokens = st.out.token_ids().len(), finish_reason = reason.as_str(), "request finished");
    pb::GenerateStreamResponse {
        event: Some(pb::generate_stream_response::Event::Done(
            pb::GenerateResponse {
                model: st.model.info().name.clone(),
                text: st.out.text().to_owned(),
                token_ids: st.out.token_ids().to_vec(),
                finish_reason: convert::finish_reason(reason) as i32,
                stats: Some(convert::stats(stats, st.seed)),
            },
        )),
    }
}

/// Collects a response stream into the unary response.
async fn collect(mut stream: EventStream) -> Result<pb::GenerateResponse, Status> {
    while let Some(item) = stream.next().await {
        if let Some(pb::generate_stream_response::Event::Done(done)) = item?.event {
            return Ok(done);
        }
    }
    Err(Status::internal(
        "response stream ended without a final message",
    ))
}

#[tonic::async_trait]
impl pb::generation_server::Generation for WorkerService {
    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateResponse>, Status> {
        let (stream, _) = self.start(request).await?;
        collect(stream).await.map(Response::new)
    }

    type GenerateStreamStream = EventStream;

    async fn generate_stream(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStreamStream>, Status> {
        self.start(request).await.map(|(s, _)| Response::new(s))
    }

    async fn list_models(
        &self,
        _request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let models = self
            .inner
            .models
            .iter()
            .map(|m| convert::model_info(m.info()))
            .collect();
        Ok(Response::new(pb::ListModelsResponse { models }))
    }
}

impl WorkerService {
    /// The current load report.
    pub fn load_report(&self) -> wpb::LoadReport {
        wpb::LoadReport {
            worker_id: self.inner.worker_id.clone(),
            ready: self.is_ready(),
            models: self
                .inner
                .models
                .iter()
                .map(|m| {
                    let l = m.load();
                    wpb::ModelLoad {
                        model: Some(convert::model_info(m.info())),
                        total_slots: l.total_slots as u32,
                        free_slots: l.free_slots as u32,
                        queued_requests: l.queued as u32,
                        active_requests: l.active as u32,
                        queue_capacity: l.queue_capacity as u32,
                        ticks: l.ticks,
                        preempted_requests: l.preempted as u32,
                        preemptions: l.preemptions,
                        max_active: l.max_active as u32,
                    }
                })
                .collect(),
        }
    }
}

type LoadStream = Pin<Box<dyn Stream<Item = Result<wpb::LoadReport, Status>> + Send>>;

#[tonic::async_trait]
impl wpb::worker_server::Worker for WorkerService {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let (stream, id) = self.start(request).await?;
        Ok(crate::migrate::with_request_id(Response::new(stream), id))
    }

    type ExportRequestStream = crate::migrate::ChunkStream;

    async fn export_request(
        &self,
        request: Request<wpb::ExportRequestRequest>,
    ) -> Result<Response<Self::ExportRequestStream>, Status> {
        crate::migrate::export(self, request.into_inner())
            .await
            .map(Response::new)
    }

    type ResumeRequestStream = EventStream;

    async fn resume_request(
        &self,
        request: Request<tonic::Streaming<wpb::MigrationChunk>>,
    ) -> Result<Response<Self::ResumeRequestStream>, Status> {
        let (stream, id) = crate::migrate::resume(self, request).await?;
        Ok(crate::migrate::with_request_id(Response::new(stream), id))
    }

    async fn finish_export(
        &self,
        request: Request<wpb::FinishExportRequest>,
    ) -> Result<Response<wpb::FinishExportResponse>, Status> {
        crate::migrate::finish(self, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn get_load(
        &self,
        _request: Request<wpb::LoadRequest>,
    ) -> Result<Response<wpb::LoadReport>, Status> {
        Ok(Response::new(self.load_report()))
    }

    type WatchLoadStream = LoadStream;

    async fn watch_load(
        &self,
        request: Request<wpb::LoadRequest>,
    ) -> Result<Response<Self::WatchLoadStream>, Status> {
        let ms = match request.into_inner().interval_ms {
            0 => 500,
            n => n.clamp(10, 60_000),
        };
        let this = self.clone();
        let ticks = tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(
            Duration::from_millis(u64::from(ms)),
        ));
        Ok(Response::new(Box::pin(
            ticks.map(move |_| Ok(this.load_report())),
        )))
    }
}
