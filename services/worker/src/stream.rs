//! A request's response stream: engine events in, protobuf messages out. The text, stop strings
//! and final response come from [`Assembly`] (the one assembly, shared with the offline run);
//! this sink adds what the gRPC stream needs: time to first token and inter-token latency,
//! outcome metrics, the request span's fields, and the hand-over of the output state to an
//! export when the engine parks the request ([`Parked`]).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use futures::Stream;
use tokio::sync::mpsc;
use tonic::Status;
use wavefront_engine::{EngineError, Event, EventSink, SinkError, Stats};
use wavefront_proto::v1 as pb;
use wavefront_proto::worker::v1 as wpb;
use wavefront_schemes::ServedModel;
use wavefront_telemetry::metrics as m;

use crate::convert;
use crate::output::{decoder, Assembly, Finished, Reply};
use crate::status::from_engine_error;

pub(crate) type EventStream =
    Pin<Box<dyn Stream<Item = Result<pb::GenerateStreamResponse, Status>> + Send>>;

/// Events buffered per request before the engine pauses it.
pub(crate) const EVENT_BUFFER: usize = 64;

/// A request's sink: a bounded tokio channel, and the flag the stream sets when a stop string
/// ended the response (the engine then finishes the request and sends its statistics).
pub(crate) struct TokioSink {
    pub(crate) tx: mpsc::Sender<Event>,
    pub(crate) stop: Arc<AtomicBool>,
    /// Why the engine gave up on the request, for the stream to answer once its reader gets
    /// past the buffered events ([`EventSink::abandon`]).
    pub(crate) abandoned: Arc<OnceLock<EngineError>>,
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
    fn abandon(&mut self, error: EngineError) {
        let _ = self.abandoned.set(error);
    }
}

/// Exports waiting for their request's stream to reach the stop ([`Event::Parked`]): the stream
/// hands its output state to the export there, keyed by model name and request id.
pub(crate) type Exports = Arc<
    std::sync::Mutex<
        std::collections::HashMap<(String, u64), tokio::sync::oneshot::Sender<Parked>>,
    >,
>;

/// What a request's stream hands its export when it reaches the stop.
pub(crate) struct Parked {
    pub(crate) output: wpb::OutputState,
    pub(crate) scheme: &'static str,
    pub(crate) seed: u64,
    /// A stop string already ended the response: the request is finishing, not moving.
    pub(crate) stopped: bool,
}

pub(crate) struct StreamState {
    /// The served model's name and the request's engine id.
    pub(crate) key: (String, u64),
    pub(crate) exports: Exports,
    /// Messages yielded for tokens and canvas frames (an export reports how many).
    pub(crate) messages: u64,
    pub(crate) model: Arc<dyn ServedModel>,
    pub(crate) rx: Option<mpsc::Receiver<Event>>,
    /// Set when the engine gave up on the request (its client left it unread).
    pub(crate) abandoned: Arc<OnceLock<EngineError>>,
    /// Text, stop strings and the final response.
    pub(crate) response: Assembly,
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
            .increment(self.response.output().token_ids().len() as u64);
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
pub(crate) fn record_outcome(
    model: &str,
    scheme: &'static str,
    code: tonic::Code,
    stats: Option<&Stats>,
) {
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
        // The engine gave up on a request its client left unread: its own error, once what
        // was buffered has been read.
        let event = match (event, self.abandoned.get()) {
            (None, Some(e)) => Some(Event::Failed(e.clone())),
            (event, _) => event,
        };
        if event.is_none() && !self.response.output().is_stopped() {
            self.rx = None;
            self.record(tonic::Code::Unavailable, None);
            self.pending.push_back(Err(Status::unavailable(
                "engine stopped before the request finished",
            )));
            return;
        }
        let model = self.model.clone();
        let decode = decoder(model.as_ref(), self.response.output().skip_special());
        for reply in self.response.on_event(event, &decode) {
            match reply {
                Reply::Delta(d) if d.token_ids.is_empty() => {
                    // The text held back until the end.
                    self.pending
                        .push_back(Ok(chunk(Vec::new(), d.text, Vec::new())));
                }
                Reply::Delta(d) => {
                    self.time_tokens(d.token_ids.len());
                    self.messages += 1;
                    let logprobs = convert::logprobs(model.as_ref(), &d.token_ids, &d.logprobs);
                    self.pending
                        .push_back(Ok(chunk(d.token_ids, d.text, logprobs)));
                }
                Reply::Canvas(frame) => {
                    self.messages += 1;
                    self.pending.push_back(Ok(pb::GenerateStreamResponse {
                        event: Some(pb::generate_stream_response::Event::Canvas(
                            convert::canvas_event(&frame),
                        )),
                    }));
                }
                Reply::Prompt(ids, lps) => {
                    self.messages += 1;
                    let text = model.decode_text(&ids, self.response.output().skip_special());
                    self.pending.push_back(Ok(pb::GenerateStreamResponse {
                        event: Some(pb::generate_stream_response::Event::Prompt(
                            pb::PromptChunk {
                                text,
                                logprobs: convert::logprobs(model.as_ref(), &ids, &lps),
                                index: 0,
                            },
                        )),
                    }));
                }
                Reply::Parked => self.park(),
                Reply::Done(finished) => {
                    self.rx = None;
                    let msg = self.done(&finished);
                    self.record(tonic::Code::Ok, Some(&finished.stats));
                    self.pending.push_back(Ok(msg));
                }
                Reply::Failed(e) => {
                    self.rx = None;
                    tracing::info!(parent: &self.span, error = %e, "request failed");
                    let status = from_engine_error(&e);
                    self.record(status.code(), None);
                    self.pending.push_back(Err(status));
                }
            }
        }
    }

    /// Time to first token, or the inter-token latency of `n` more (each at its share).
    fn time_tokens(&mut self, n: usize) {
        let now = Instant::now();
        let name = self.model.info().name.clone();
        if !self.first_token {
            self.first_token = true;
            metrics::histogram!(m::TIME_TO_FIRST_TOKEN, "model" => name, "scheme" => self.scheme)
                .record(self.started.elapsed().as_secs_f64());
        } else if n > 0 {
            let share = now.duration_since(self.last_tokens).as_secs_f64() / n as f64;
            let itl = metrics::histogram!(m::INTER_TOKEN_LATENCY, "model" => name, "scheme" => self.scheme);
            for _ in 0..n {
                itl.record(share);
            }
        }
        self.last_tokens = now;
    }

    /// Everything before the stop is queued: the export takes the output state.
    fn park(&mut self) {
        let hook = self
            .exports
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.key);
        if let Some(hook) = hook {
            let out = self.response.output();
            let mut output = out.snapshot();
            output.messages = self.messages;
            let _ = hook.send(Parked {
                output,
                scheme: self.scheme,
                seed: self.seed,
                stopped: out.is_stopped(),
            });
        }
    }

    /// The final message, with the request span's outcome fields.
    fn done(&self, f: &Finished) -> pb::GenerateStreamResponse {
        let (reason, tokens) = (f.finish_reason, f.token_ids.len());
        self.span.record("output_tokens", tokens);
        self.span.record("finish_reason", reason.as_str());
        tracing::info!(parent: &self.span, tokens, finish_reason = reason.as_str(), "request finished");
        pb::GenerateStreamResponse {
            event: Some(pb::generate_stream_response::Event::Done(
                pb::GenerateResponse {
                    index: 0,
                    choices: Vec::new(),
                    model: self.model.info().name.clone(),
                    text: f.text.clone(),
                    token_ids: f.token_ids.clone(),
                    finish_reason: convert::finish_reason(reason) as i32,
                    stats: Some(convert::stats(&f.stats, f.seed)),
                    logprobs: convert::logprobs(self.model.as_ref(), &f.token_ids, &f.logprobs),
                    prompt_logprobs: f
                        .prompt
                        .as_ref()
                        .map(|(ids, lps)| convert::logprobs(self.model.as_ref(), ids, lps))
                        .unwrap_or_default(),
                    prompt_text: f
                        .prompt
                        .as_ref()
                        .map(|(ids, _)| {
                            self.model
                                .decode_text(ids, self.response.output().skip_special())
                        })
                        .unwrap_or_default(),
                },
            )),
        }
    }
}

fn chunk(
    token_ids: Vec<u32>,
    text: String,
    logprobs: Vec<pb::TokenLogprob>,
) -> pb::GenerateStreamResponse {
    pb::GenerateStreamResponse {
        event: Some(pb::generate_stream_response::Event::Tokens(
            pb::TokenChunk {
                index: 0,
                token_ids,
                text,
                logprobs,
            },
        )),
    }
}
