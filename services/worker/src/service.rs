//! The worker's public gRPC service (`Generation`) over the models it serves; the router's
//! `Worker` API is [`crate::worker_api`], the response stream [`crate::stream`].
//!
//! A request's life: extract the caller's trace context, convert and
//! validate (INVALID_ARGUMENT / NOT_FOUND at once), submit to the engine with
//! a bounded per-request channel, and return a stream that reads engine
//! events, assembles text and ends with a `done` message. Dropping the stream
//! (client cancelled, deadline hit, stop string seen) drops the channel's
//! receiver; the engine sees the closed sink and frees the request's slots
//! at its next tick.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use wavefront_telemetry::metrics as m;

use futures::StreamExt;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};
use wavefront_engine::RequestId;
use wavefront_proto::v1 as pb;
use wavefront_proto::worker::v1 as wpb;
use wavefront_schemes::ServedModel;

use crate::convert;
use crate::limits::RequestLimits;
use crate::output::{Assembly, OutputAssembler};
use crate::status::from_engine_error;
use crate::stream::{
    record_outcome, response_stream, EventStream, Exports, StreamState, TokioSink, EVENT_BUFFER,
};

/// The `model` label of requests for a model this worker does not serve.
const UNKNOWN_MODEL: &str = "unknown";

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

    pub(crate) fn limits(&self) -> &crate::limits::RequestLimits {
        &self.inner.limits
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
    pub(crate) async fn start(
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
        let scored_prompt = spec
            .sampling
            .prompt_logprobs
            .map(|_| spec.prompt_ids.clone());
        metrics::counter!(m::PROMPT_TOKENS_TOTAL, "model" => model.info().name.clone(), "scheme" => scheme)
            .increment(spec.prompt_ids.len() as u64);
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let stop = Arc::new(AtomicBool::new(false));
        let abandoned = Arc::new(std::sync::OnceLock::new());
        let sink = TokioSink {
            tx,
            stop: stop.clone(),
            abandoned: abandoned.clone(),
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
            abandoned,
            response: Assembly::new(
                {
                    let out = OutputAssembler::new(
                        req.stop_strings,
                        req.skip_special_tokens.unwrap_or(true),
                    );
                    match scored_prompt {
                        Some(ids) => out.scoring_prompt(ids),
                        None => out,
                    }
                },
                stop,
                seed,
            ),
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
        Some(pb::generate_request::Scheme::EntropyBound(_)) => "entropy-bound",
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
            .map(|m| convert::model_info(m.as_ref()))
            .collect();
        Ok(Response::new(pb::ListModelsResponse { models }))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        self.run_tokenize(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn detokenize(
        &self,
        request: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        self.run_detokenize(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn get_tokenizer(
        &self,
        request: Request<pb::GetTokenizerRequest>,
    ) -> Result<Response<pb::TokenizerInfo>, Status> {
        self.tokenizer_info(request.into_inner()).map(Response::new)
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
                        model: Some(convert::model_info(m.as_ref())),
                        total_slots: l.total_slots as u32,
                        free_slots: l.free_slots as u32,
                        queued_requests: l.queued as u32,
                        active_requests: l.active as u32,
                        queue_capacity: l.queue_capacity as u32,
                        ticks: l.ticks,
                        preempted_requests: l.preempted as u32,
                        preemptions: l.preemptions,
                        max_active: l.max_active as u32,
                        max_chat_messages: u32::try_from(self.inner.limits.max_chat_messages)
                            .unwrap_or(u32::MAX),
                    }
                })
                .collect(),
        }
    }
}
