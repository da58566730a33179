//! The router's public `Generation` service.
//!
//! Per call: rank the workers for the model, forward to the best one (the
//! next one if it is unreachable before answering), and relay its stream.
//! The caller's `grpc-timeout` is passed on as the remaining time, and the
//! trace context of the router's span goes into the worker call's metadata.

use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Instant;

use futures::{Stream, StreamExt};
use tonic::{Code, Request, Response, Status};
use tonic_health::ServingStatus;
use wavefront_net::Listener;
use wavefront_proto::limits;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_server::GenerationServer;

use tonic::service::interceptor::InterceptedService;
use wavefront_proto::auth::{RequireSecret, Secrets};
use wavefront_telemetry::metrics as m;

use crate::discovery::Discovery;
use crate::pick::{rank, served_model_infos, NoWorker};
use crate::tls::ServerTls;

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateStreamResponse, Status>> + Send>>;

/// Workers tried per call before giving up.
const MAX_ATTEMPTS: usize = 3;

#[derive(Clone)]
pub struct RouterService {
    discovery: Discovery,
    max_message_bytes: usize,
    api_keys: Secrets,
    tls: Option<ServerTls>,
    rebalance: bool,
    default_model: Option<String>,
}

impl RouterService {
    pub fn new(discovery: Discovery) -> Self {
        Self {
            discovery,
            max_message_bytes: wavefront_proto::limits::DEFAULT_MAX_MESSAGE_BYTES,
            api_keys: Secrets::default(),
            tls: None,
            rebalance: false,
            default_model: None,
        }
    }

    /// The model a request that names none gets while the workers serve several (with one
    /// served, that one; without a default, such a request is INVALID_ARGUMENT).
    pub fn with_default_model(mut self, name: Option<String>) -> Self {
        self.default_model = name.filter(|n| !n.is_empty());
        self
    }

    /// The model a request asking for `asked` is served by: `asked`, or when it is empty the
    /// only model served, else the default model (empty when neither applies).
    pub fn model_for(&self, asked: &str) -> String {
        if !asked.is_empty() {
            return asked.to_owned();
        }
        self.discovery
            .sole_model()
            .or_else(|| self.default_model.clone())
            .unwrap_or_default()
    }

    /// Moves running requests off a worker with a queue onto an idle one ([`crate::relay`]).
    pub fn with_rebalance(mut self, on: bool) -> Self {
        self.rebalance = on;
        self
    }

    /// Serves the public gRPC and HTTP endpoints over TLS.
    pub fn with_tls(mut self, tls: ServerTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The public endpoints' TLS, if any.
    pub fn tls(&self) -> Option<&ServerTls> {
        self.tls.as_ref()
    }

    /// Requires one of `keys` on the public API, gRPC and HTTP (health, reflection and the
    /// HTTP `/health` stay open for probes).
    pub fn with_api_keys(mut self, keys: Secrets) -> Self {
        self.api_keys = keys;
        self
    }

    /// The API keys the public endpoints require (none when empty).
    pub fn api_keys(&self) -> &Secrets {
        &self.api_keys
    }

    /// Sets the largest request message decoded (larger: RESOURCE_EXHAUSTED).
    pub fn with_max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// The worker table this router routes over.
    pub fn discovery(&self) -> &Discovery {
        &self.discovery
    }

    /// Largest request message decoded.
    pub fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    /// Routes `request` and returns the worker's event stream: the one path of gRPC and HTTP
    /// calls (the outcome is counted in the router's metrics when the call ends).
    pub async fn stream(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<EventStream, Status> {
        self.forward(request, None).await
    }

    /// [`Self::stream`] for the `n` completions of one request: each a request of its own,
    /// all to the same worker (the best-ranked now) while it can take them, so they share the
    /// prompt's pages there.
    pub async fn stream_choices(
        &self,
        requests: Vec<Request<pb::GenerateRequest>>,
    ) -> Result<Vec<EventStream>, Status> {
        let prefer = requests.first().and_then(|r| {
            let model = self.resolve_model(&r.get_ref().model);
            let workers = self.discovery.snapshot();
            rank(&workers, &model, &[])
                .ok()
                .and_then(|c| c.first().map(|w| w.addr))
        });
        futures::future::try_join_all(requests.into_iter().map(|r| self.forward(r, prefer))).await
    }

    fn no_worker(e: NoWorker) -> Status {
        match e {
            NoWorker::UnknownModel { model, served } => {
                Status::not_found(format!("model {model:?} is not served; served models: {}", served.join(", ")))
            }
            NoWorker::Unreachable { model, known } => Status::unavailable(format!(
                "no worker serving model {model:?} is reachable ({known} workers known); check that workers are running and ready"
            )),
            NoWorker::Ambiguous { served } => {
                Status::invalid_argument(format!("set `model`: several models are served: {}", served.join(", ")))
            }
        }
    }

    /// Forwards and counts the outcome (metrics) once the call ends.
    /// Routes `request` to the best-ranked worker serving its model, or to `prefer` while it
    /// is among the candidates.
    async fn forward(
        &self,
        mut request: Request<pb::GenerateRequest>,
        prefer: Option<SocketAddr>,
    ) -> Result<EventStream, Status> {
        // The `model` label is a served model's name (or empty: none named), else `unknown`:
        // a client's arbitrary names never become series.
        let name = &request.get_ref().model;
        let known = name.is_empty() || self.discovery.serves(name);
        let mut outcome = Outcome {
            model: if known {
                name.clone()
            } else {
                "unknown".to_owned()
            },
            started: Instant::now(),
            done: false,
        };
        // None named while several are served: the default model, when there is one.
        let resolved = self.resolve_model(&request.get_ref().model);
        request.get_mut().model = resolved;
        if let Err(s) = self.check_chat(request.get_ref()) {
            outcome.finish(s.code());
            return Err(s);
        }
        match self.forward_inner(request, prefer).await {
            Err(s) => {
                outcome.finish(s.code());
                Err(s)
            }
            Ok(stream) => Ok(Box::pin(stream.map(move |item| {
                match &item {
                    Err(s) => outcome.finish(s.code()),
                    Ok(pb::GenerateStreamResponse {
                        event: Some(pb::generate_stream_response::Event::Done(_)),
                    }) => outcome.finish(Code::Ok),
                    Ok(_) => {}
                }
                item
            }))),
        }
    }

    /// Refuses a chat that no worker would take, whatever its contents say: more messages than
    /// the workers' `--max-chat-messages`, or more tokens than the model's context from the
    /// chat template's tokens for its messages alone (the workers' reports carry both). A flood
    /// of chats of many empty messages is then answered here, from the message count, before
    /// the chat is copied, encoded for a worker and decoded there; the worker checks the full
    /// bound (with the contents) again.
    fn check_chat(&self, req: &pb::GenerateRequest) -> Result<(), Status> {
        match &req.prompt {
            Some(pb::generate_request::Prompt::Chat(c)) => {
                self.chat_refusal(&req.model, c.messages.len())
            }
            _ => Ok(()),
        }
    }

    /// [`Self::check_chat`] for a chat of `messages` messages to `model` (as the request names
    /// it: empty for the default or sole model), in the workers' own words.
    pub(crate) fn chat_refusal(&self, model: &str, messages: usize) -> Result<(), Status> {
        let mut model = self.resolve_model(model);
        if model.is_empty() {
            match self.discovery.sole_model() {
                Some(sole) => model = sole,
                None => return Ok(()),
            }
        }
        let Some(bound) = self.discovery.chat_bound(&model, messages) else {
            return Ok(());
        };
        if let Some(max) = bound.max_messages.filter(|&max| messages > max) {
            return Err(Status::invalid_argument(limits::too_many_chat_messages(
                messages, max,
            )));
        }
        if bound.at_least > bound.max_context {
            return Err(Status::invalid_argument(limits::chat_too_long(
                messages,
                bound.at_least,
                bound.max_context,
            )));
        }
        Ok(())
    }

    async fn forward_inner(
        &self,
        request: Request<pb::GenerateRequest>,
        prefer: Option<SocketAddr>,
    ) -> Result<EventStream, Status> {
        let deadline = wavefront_proto::timeout::deadline(request.metadata())
            .map_err(Status::invalid_argument)?;
        let span = tracing::info_span!(
            "request",
            otel.name = "router.generate",
            model = tracing::field::Empty,
            worker = tracing::field::Empty,
        );
        wavefront_telemetry::extract_parent(&span, request.metadata());
        let body = request.into_inner();
        span.record("model", body.model.as_str());
        let mut tried: Vec<SocketAddr> = Vec::new();
        let mut last_err = None;
        for _ in 0..MAX_ATTEMPTS {
            let workers = self.discovery.snapshot();
            let candidates = match rank(&workers, &body.model, &tried) {
                Ok(c) => c,
                Err(e) if last_err.is_none() => return Err(Self::no_worker(e)),
                Err(_) => break,
            };
            let at = prefer
                .and_then(|a| candidates.iter().position(|w| w.addr == a))
                .unwrap_or(0);
            let w = candidates
                .into_iter()
                .nth(at)
                .expect("rank returns at least one candidate");
            tried.push(w.addr);
            span.record("worker", w.addr.to_string().as_str());
            let Some(req) = crate::relay::worker_call(deadline, &span, body.clone()) else {
                return Err(Status::deadline_exceeded(
                    "deadline passed before a worker was called",
                ));
            };
            self.discovery.note_routed(w.addr);
            let mut client = w.client.clone();
            // The caller's deadline bounds the wait for the worker's answer too: a worker that
            // hangs (stopped, deadlocked) before answering must not hold the call past it.
            let answer = match deadline {
                Some(d) => match tokio::time::timeout_at(d.into(), client.generate(req)).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        tracing::warn!(parent: &span, worker = %w.addr, "worker did not answer before the deadline");
                        return Err(Status::deadline_exceeded(format!(
                            "deadline passed before worker {} answered",
                            w.addr
                        )));
                    }
                },
                None => client.generate(req).await,
            };
            match answer {
                Ok(resp) => {
                    tracing::debug!(parent: &span, worker = %w.addr, "forwarded");
                    if let Some(id) = crate::relay::request_id(resp.metadata()) {
                        // A request the worker can move: relayed by a task that moves it when
                        // the worker drains.
                        let (tx, rx) = tokio::sync::mpsc::channel(RELAY_BUFFER);
                        let leg = crate::relay::Leg {
                            addr: w.addr,
                            client: w.client.clone(),
                            stream: resp.into_inner(),
                            id: Some(id),
                            relayed: 0,
                            before: 0,
                            restarts: 0,
                        };
                        let ctx = crate::relay::Ctx {
                            discovery: self.discovery.clone(),
                            model: body.model.clone(),
                            request: body,
                            deadline,
                            span: span.clone(),
                            on_error: relay_error,
                            rebalance: self.rebalance,
                        };
                        tokio::spawn(crate::relay::relay(leg, ctx, tx));
                        let relayed: EventStream =
                            Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
                        return Ok(wavefront_proto::timeout::with_deadline(relayed, deadline));
                    }
                    let stream = resp.into_inner();
                    let span2 = span.clone();
                    let (discovery, addr) = (self.discovery.clone(), w.addr);
                    let relayed: EventStream = Box::pin(stream.map(move |item| {
                        item.map_err(|s| {
                            tracing::info!(parent: &span2, code = ?s.code(), error = %s, "worker stream ended with error");
                            match mid_stream(s, addr) {
                                MidStream::Lost(s) => {
                                    discovery.mark_down(addr);
                                    s
                                }
                                MidStream::Relay(s) => s,
                            }
                        })
                    }));
                    return Ok(wavefront_proto::timeout::with_deadline(relayed, deadline));
                }
                Err(s) => match classify(&s, deadline, Instant::now()) {
                    Failure::Retry { mark_down } => {
                        if mark_down {
                            tracing::warn!(parent: &span, worker = %w.addr, error = %s, "worker unreachable or draining; trying another");
                            self.discovery.mark_down(w.addr);
                        } else {
                            // A full worker is routine under load: one line per shed request
                            // at warn would cost a flood more than the shedding itself.
                            tracing::debug!(parent: &span, worker = %w.addr, error = %s, "worker full; trying another");
                        }
                        last_err = Some(match s.code() {
                            Code::Cancelled | Code::Unknown => Status::unavailable(format!(
                                "connection to worker {} failed before it answered: {}",
                                w.addr,
                                s.message()
                            )),
                            _ => s,
                        });
                    }
                    Failure::DeadlineExceeded => {
                        return Err(Status::deadline_exceeded(
                            "deadline passed before the worker answered",
                        ))
                    }
                    Failure::Final => return Err(s),
                },
            }
        }
        Err(last_err.unwrap_or_else(|| Status::unavailable("no worker could take the request")))
    }
}

/// A worker client as the router holds it.
pub(crate) type WorkerClient = wavefront_proto::worker::v1::worker_client::WorkerClient<
    InterceptedService<tonic::transport::Channel, wavefront_proto::auth::AttachSecret>,
>;

impl RouterService {
    /// The model a call names, or the default model when it names none and several are
    /// served.
    fn resolve_model(&self, model: &str) -> String {
        if model.is_empty() && self.discovery.sole_model().is_none() {
            if let Some(default) = &self.default_model {
                return default.clone();
            }
        }
        model.to_owned()
    }

    /// A unary call to a ready worker serving `model` (see [`Self::resolve_model`]); another
    /// worker when one declines before doing anything, as for `Generate`.
    pub(crate) async fn to_worker<T, F, Fut>(&self, model: &str, call: F) -> Result<T, Status>
    where
        F: Fn(WorkerClient, String) -> Fut,
        Fut: std::future::Future<Output = Result<Response<T>, Status>>,
    {
        let model = self.resolve_model(model);
        let mut tried: Vec<SocketAddr> = Vec::new();
        let mut last_err = None;
        for _ in 0..MAX_ATTEMPTS {
            let workers = self.discovery.snapshot();
            let w = match rank(&workers, &model, &tried) {
                Ok(c) => c
                    .into_iter()
                    .next()
                    .expect("rank returns at least one candidate"),
                Err(e) if last_err.is_none() => return Err(Self::no_worker(e)),
                Err(_) => break,
            };
            tried.push(w.addr);
            match call(w.client.clone(), model.clone()).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(s) => match classify(&s, None, Instant::now()) {
                    Failure::Retry { mark_down } => {
                        if mark_down {
                            self.discovery.mark_down(w.addr);
                        }
                        last_err = Some(s);
                    }
                    _ => return Err(s),
                },
            }
        }
        Err(last_err.unwrap_or_else(|| Status::unavailable("no worker could take the request")))
    }
}

/// Messages a relay task holds for a caller that is slower than the worker.
const RELAY_BUFFER: usize = 16;

/// A relayed worker stream's error as the caller sees it (a lost connection marks the worker
/// down).
fn relay_error(discovery: &Discovery, addr: SocketAddr, span: &tracing::Span, s: Status) -> Status {
    tracing::info!(parent: span, code = ?s.code(), error = %s, "worker stream ended with error");
    match mid_stream(s, addr) {
        MidStream::Lost(s) => {
            discovery.mark_down(addr);
            s
        }
        MidStream::Relay(s) => s,
    }
}

/// What a failed worker call means for the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// Nothing ran on the worker: try another one. `mark_down` when the worker itself is the
    /// problem (the connection failed, or it says it is draining), so no other call picks it
    /// before its next good poll.
    Retry { mark_down: bool },
    /// The caller's own deadline ended the call: the worker is healthy.
    DeadlineExceeded,
    /// The worker answered with a status of its own: relay it.
    Final,
}

/// Classifies a status from a worker call made with `deadline` at `now`.
///
/// A status that carries a source error was made by this process's transport (connect
/// refused, connection reset, stream broken): the worker is unreachable. A status without one
/// is the worker's own answer, and only UNAVAILABLE (draining) or RESOURCE_EXHAUSTED (full)
/// say another worker should take the request. CANCELLED / UNKNOWN answered by the worker, or
/// any failure once the caller's deadline has passed, is the caller's deadline firing there
/// ("Timeout expired"), never a reason to take the worker out of rotation: a client sending
/// short deadlines would otherwise empty the routing table for everyone.
fn classify(s: &Status, deadline: Option<Instant>, now: Instant) -> Failure {
    use std::error::Error as _;
    let transport = s.source().is_some();
    let past_deadline = deadline.is_some_and(|d| d <= now + DEADLINE_SLACK);
    match s.code() {
        Code::ResourceExhausted => Failure::Retry { mark_down: false },
        _ if past_deadline => Failure::DeadlineExceeded,
        Code::Unavailable => Failure::Retry { mark_down: true },
        Code::Cancelled | Code::Unknown if transport => Failure::Retry { mark_down: true },
        _ => Failure::Final,
    }
}

/// A failed message of a stream the worker had already answered.
enum MidStream {
    /// The connection to the worker broke (the worker died or the network failed): the
    /// response is incomplete and the worker is out of rotation until it answers a poll.
    Lost(Status),
    /// The worker's own status (a deadline, an engine failure): relayed as is.
    Relay(Status),
}

/// Tells a broken connection (a status this process's transport made, with its source error)
/// from the worker's own answer, and words the first as UNAVAILABLE: a client sees that the
/// worker was lost, not the transport's UNKNOWN "error reading a body from connection".
fn mid_stream(s: Status, addr: SocketAddr) -> MidStream {
    use std::error::Error as _;
    if s.source().is_none() {
        return MidStream::Relay(s);
    }
    MidStream::Lost(Status::unavailable(format!(
        "lost the connection to worker {addr} during the response ({}); the output is incomplete: \
         retry the request",
        s.message()
    )))
}

/// How close to its deadline a failed call counts as having run out of time (the worker
/// enforces a slightly earlier deadline than the caller's, `wavefront_proto::timeout`).
const DEADLINE_SLACK: std::time::Duration = std::time::Duration::from_millis(50);

/// One call's outcome at the router; a call dropped before it ended (the
/// client went away) counts as CANCELLED.
struct Outcome {
    model: String,
    started: Instant,
    done: bool,
}

impl Outcome {
    fn finish(&mut self, code: Code) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let status = m::code_name(code);
        metrics::counter!(m::ROUTER_REQUESTS_TOTAL, "model" => self.model.clone(), "status" => status).increment(1);
        metrics::histogram!(m::ROUTER_REQUEST_DURATION, "model" => self.model.clone(), "status" => status)
            .record(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        self.finish(Code::Cancelled);
    }
}

/// The most completions one request may ask for (`GenerateRequest.n`, HTTP's `n`).
pub const MAX_COMPLETIONS: u32 = 16;

/// How many completions `req` asks for (1 when unset), refused outside 1..=[`MAX_COMPLETIONS`].
pub fn completions(req: &pb::GenerateRequest) -> Result<u32, Status> {
    match req.n.unwrap_or(1) {
        n @ 1..=MAX_COMPLETIONS => Ok(n),
        n => Err(Status::invalid_argument(format!(
            "n must be between 1 and {MAX_COMPLETIONS}, got {n}"
        ))),
    }
}

/// The `n` completions of `req`, one request each (`n` unset): completion `i` drawn with
/// seed + i when a seed is set, so choice 0 is the request alone and every choice is
/// reproducible and drawn apart. The request itself becomes the last of them, so that one
/// completion (the common case) costs no copy of the prompt.
pub fn completion_requests(mut req: pb::GenerateRequest, n: u32) -> Vec<pb::GenerateRequest> {
    req.n = None;
    let nth = |mut r: pb::GenerateRequest, i: u32| {
        if let Some(seed) = r.sampling.as_mut().and_then(|s| s.seed.as_mut()) {
            *seed = seed.wrapping_add(u64::from(i));
        }
        r
    };
    let Some(last) = n.checked_sub(1) else {
        return Vec::new();
    };
    let mut out: Vec<_> = (0..last).map(|i| nth(req.clone(), i)).collect();
    out.push(nth(req, last));
    out
}

/// A message of choice `i`'s stream, marked with its index.
fn with_index(mut m: pb::GenerateStreamResponse, i: u32) -> pb::GenerateStreamResponse {
    use pb::generate_stream_response::Event;
    match &mut m.event {
        Some(Event::Tokens(t)) => t.index = i,
        Some(Event::Canvas(c)) => c.index = i,
        Some(Event::Done(d)) => d.index = i,
        Some(Event::Prompt(p)) => p.index = i,
        None => {}
    }
    m
}

impl RouterService {
    /// The event streams of `request`'s `n` completions, one request each.
    async fn fan_out(
        &self,
        request: Request<pb::GenerateRequest>,
        n: u32,
    ) -> Result<Vec<EventStream>, Status> {
        let (metadata, _, body) = request.into_parts();
        let requests = completion_requests(body, n)
            .into_iter()
            .map(|body| Request::from_parts(metadata.clone(), Default::default(), body))
            .collect();
        self.stream_choices(requests).await
    }
}

#[tonic::async_trait]
impl pb::generation_server::Generation for RouterService {
    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateResponse>, Status> {
        let n = completions(request.get_ref())?;
        let streams = self.fan_out(request, n).await?;
        let mut choices =
            futures::future::try_join_all(streams.into_iter().map(|mut stream| async move {
                while let Some(item) = stream.next().await {
                    if let Some(pb::generate_stream_response::Event::Done(done)) = item?.event {
                        return Ok(done);
                    }
                }
                Err(Status::unavailable(
                    "worker stream ended without a final message",
                ))
            }))
            .await?;
        if n == 1 {
            return Ok(Response::new(choices.remove(0)));
        }
        for (i, c) in choices.iter_mut().enumerate() {
            c.index = i as u32;
        }
        let mut first = choices[0].clone();
        first.choices = choices;
        Ok(Response::new(first))
    }

    type GenerateStreamStream = EventStream;

    async fn generate_stream(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let n = completions(request.get_ref())?;
        let mut streams = self.fan_out(request, n).await?;
        if n == 1 {
            return Ok(Response::new(streams.remove(0)));
        }
        // The choices' messages interleaved as they come, each marked with its index; an error
        // ends the merged stream.
        let merged = futures::stream::select_all(
            streams
                .into_iter()
                .enumerate()
                .map(|(i, s)| s.map(move |m| m.map(|m| with_index(m, i as u32)))),
        );
        let mut failed = false;
        let merged: EventStream = Box::pin(merged.take_while(move |item| {
            let go = !failed;
            failed |= item.is_err();
            futures::future::ready(go)
        }));
        Ok(Response::new(merged))
    }

    async fn list_models(
        &self,
        _request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let models = served_model_infos(&self.discovery.snapshot());
        Ok(Response::new(pb::ListModelsResponse { models }))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let req = request.into_inner();
        // A conversation no worker would take is refused here, as a chat prompt is.
        if let Some(pb::tokenize_request::Input::Chat(c)) = &req.input {
            self.chat_refusal(&req.model, c.messages.len())?;
        }
        self.to_worker(&req.model.clone(), |mut c, model| {
            let req = pb::TokenizeRequest {
                model,
                ..req.clone()
            };
            async move { c.tokenize(req).await }
        })
        .await
        .map(Response::new)
    }

    async fn detokenize(
        &self,
        request: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        let req = request.into_inner();
        self.to_worker(&req.model.clone(), |mut c, model| {
            let req = pb::DetokenizeRequest {
                model,
                ..req.clone()
            };
            async move { c.detokenize(req).await }
        })
        .await
        .map(Response::new)
    }

    async fn get_tokenizer(
        &self,
        request: Request<pb::GetTokenizerRequest>,
    ) -> Result<Response<pb::TokenizerInfo>, Status> {
        let req = request.into_inner();
        self.to_worker(&req.model, |mut c, model| async move {
            c.get_tokenizer(pb::GetTokenizerRequest { model }).await
        })
        .await
        .map(Response::new)
    }
}

/// Serves the router on `listener` until `shutdown` resolves.
pub async fn serve(
    service: RouterService,
    listener: Listener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    reporter
        .set_serving::<GenerationServer<RouterService>>()
        .await;
    // Reflection lists the public APIs only (the descriptor set also holds the worker API),
    // in both protocol versions: v1, and v1alpha for older grpcurl and Python's
    // grpcio-reflection.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(wavefront_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name("wavefront.v1.Generation")
            .with_service_name("grpc.health.v1.Health")
    };
    let reflection_v1alpha = reflection().build_v1alpha()?;
    let reflection = reflection().build_v1()?;
    // Liveness is "" (SERVING while the process runs); readiness is the API
    // service, NOT_SERVING once shutdown starts. tonic then stops accepting
    // and lets in-flight calls finish.
    let drain = async move {
        shutdown.await;
        tracing::info!("shutdown requested: draining");
        reporter
            .set_not_serving::<GenerationServer<RouterService>>()
            .await;
    };
    let limit = service.max_message_bytes;
    let require = RequireSecret::new(service.api_keys.clone(), "an API key");
    let mut builder = listener.limits().grpc_server();
    if let Some(tls) = &service.tls {
        builder = builder.tls_config(tls.grpc())?;
    }
    // Refusals to a client over its budget are held (after the oversize mapping, which turns
    // an over-long message into RESOURCE_EXHAUSTED, not held).
    let refusals = listener.refusal_layer();
    builder
        .layer(refusals)
        .layer(tower::util::MapResponseLayer::new(
            wavefront_proto::limits::oversize_as_resource_exhausted,
        ))
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(InterceptedService::new(
            GenerationServer::new(service).max_decoding_message_size(limit),
            require,
        ))
        .serve_with_incoming_shutdown(listener.incoming(), drain)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn transport(code_of: tonic::ConnectError) -> Status {
        Status::from_error(Box::new(code_of))
    }

    /// Completion `i` is the request with seed + i and `n` unset; the request itself is the
    /// last one.
    #[test]
    fn completions_are_the_request_with_their_seeds_apart() {
        let req = pb::GenerateRequest {
            model: "m".into(),
            n: Some(3),
            sampling: Some(pb::SamplingParams {
                seed: Some(u64::MAX),
                ..Default::default()
            }),
            ..Default::default()
        };
        let all = completion_requests(req.clone(), 3);
        let seeds: Vec<Option<u64>> = all
            .iter()
            .map(|r| r.sampling.as_ref().and_then(|s| s.seed))
            .collect();
        assert_eq!(seeds, vec![Some(u64::MAX), Some(0), Some(1)]);
        assert!(all.iter().all(|r| r.n.is_none() && r.model == "m"));
        let one = completion_requests(req.clone(), 1);
        assert_eq!(
            one,
            vec![pb::GenerateRequest {
                n: None,
                ..req.clone()
            }]
        );
        assert!(completion_requests(req, 0).is_empty());
        // Without a seed, each completion draws its own.
        let unseeded = completion_requests(pb::GenerateRequest::default(), 2);
        assert!(unseeded.iter().all(|r| r.sampling.is_none()));
    }

    #[test]
    fn the_callers_deadline_firing_at_the_worker_keeps_the_worker_in_rotation() {
        let now = Instant::now();
        // What a worker's transport answers when the grpc-timeout it was given runs out.
        let timeout = Status::cancelled("Timeout expired");
        assert_eq!(
            classify(&timeout, Some(now), now),
            Failure::DeadlineExceeded
        );
        assert_eq!(
            classify(&Status::deadline_exceeded("late"), Some(now), now),
            Failure::DeadlineExceeded
        );
        // A worker's own CANCELLED or UNKNOWN with time left is relayed, not held against it.
        let later = Some(now + Duration::from_secs(5));
        assert_eq!(classify(&timeout, later, now), Failure::Final);
        assert_eq!(classify(&Status::unknown("x"), None, now), Failure::Final);
    }

    #[test]
    fn a_broken_connection_mid_stream_is_unavailable_and_a_workers_own_status_is_relayed() {
        let addr: SocketAddr = "127.0.0.1:7".parse().unwrap();
        let broken = transport(tonic::ConnectError("connection reset".into()));
        match mid_stream(broken, addr) {
            MidStream::Lost(s) => {
                assert_eq!(s.code(), Code::Unavailable);
                assert!(s.message().contains("127.0.0.1:7"), "{}", s.message());
            }
            MidStream::Relay(s) => panic!("relayed {s:?}"),
        }
        match mid_stream(Status::deadline_exceeded("late"), addr) {
            MidStream::Relay(s) => assert_eq!(s.code(), Code::DeadlineExceeded),
            MidStream::Lost(s) => panic!("lost {s:?}"),
        }
    }

    #[test]
    fn an_unreachable_or_draining_worker_is_marked_down_and_a_full_one_is_not() {
        let now = Instant::now();
        let later = Some(now + Duration::from_secs(5));
        let refused = transport(tonic::ConnectError("connection refused".into()));
        assert_eq!(refused.code(), Code::Unavailable);
        assert_eq!(
            classify(&refused, later, now),
            Failure::Retry { mark_down: true }
        );
        let draining = Status::unavailable("worker is draining");
        assert_eq!(
            classify(&draining, None, now),
            Failure::Retry { mark_down: true }
        );
        let full = Status::resource_exhausted("queue full");
        assert_eq!(
            classify(&full, Some(now), now),
            Failure::Retry { mark_down: false }
        );
        // Invalid input is the caller's to fix: relayed as is.
        assert_eq!(
            classify(&Status::invalid_argument("bad"), None, now),
            Failure::Final
        );
    }
}
