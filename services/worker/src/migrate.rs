//! Moving a running request between workers (the worker API's `ExportRequest`,
//! `ResumeRequest` and `FinishExport`; never on the public API, and behind the worker token).
//!
//! Export: the engine stops the request at a step boundary, its family moves its state to host
//! memory and encodes it (`Family::export`), and the request stays here, parked. Its Generate
//! stream queues every message made before the stop and then hands its output state (tokens
//! and text so far, the decoder's window) to the export, which streams a header and the
//! state's bytes. The router relays that many messages of the old stream, resumes the request
//! on another worker with the chunks, and settles the export: moved, the request leaves here;
//! refused, it continues here as a preempted request would, and nothing is lost.
//!
//! Resume checks the state's version, the model's name, the checkpoint's fingerprint and the
//! settings that shape the state (`ServedModel::migration_key`), and the state's digest, then
//! queues the program as a preempted request and answers like Generate, from the next token on.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status};
use wavefront_engine::{Carried, EngineError, RequestId};
use wavefront_proto::worker::v1 as wpb;
use wavefront_schemes::migrate::STATE_VERSION;

use crate::output::{Assembly, OutputAssembler};
use crate::service::WorkerService;
use crate::status::from_engine_error;
use crate::stream::{response_stream, EventStream, StreamState, TokioSink, EVENT_BUFFER};

/// The response header that names a request's engine id (what `ExportRequest` takes).
pub const REQUEST_ID_HEADER: &str = "x-wavefront-request-id";

/// Bytes of state per message (well under the 4 MiB default message limit).
const CHUNK_BYTES: usize = 1 << 20;

/// How long an export waits for the request's stream to reach the stop (the router reads it
/// while it waits).
const PARK_TIMEOUT: Duration = Duration::from_secs(30);

pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<wpb::MigrationChunk, Status>> + Send>>;

/// Adds the request's id to a Generate or ResumeRequest response.
pub(crate) fn with_request_id<T>(mut r: Response<T>, id: RequestId) -> Response<T> {
    r.metadata_mut().insert(
        REQUEST_ID_HEADER,
        id.0.to_string().parse().expect("digits are valid metadata"),
    );
    r
}

/// Runs `f` with the engine's answer on a blocking thread (engine commands may wait for the
/// engine's channel) and awaits it.
async fn engine_call<T: Send + 'static>(
    f: impl FnOnce(Box<dyn FnOnce(T) + Send>) + Send + 'static,
) -> Result<T, Status> {
    let (tx, rx) = oneshot::channel();
    tokio::task::spawn_blocking(move || {
        f(Box::new(move |v| {
            let _ = tx.send(v);
        }))
    });
    rx.await
        .map_err(|_| Status::unavailable("the engine stopped before it answered"))
}

/// The model's migration key, computed off the runtime's threads (the first call hashes the
/// checkpoint).
async fn key_of(model: &Arc<dyn wavefront_schemes::ServedModel>) -> Result<String, Status> {
    let m = model.clone();
    tokio::task::spawn_blocking(move || m.migration_key())
        .await
        .map_err(|e| Status::internal(format!("migration key: {e}")))?
        .map_err(|e| crate::status::from_scheme_error(&e))
}

/// `ExportRequest`.
pub(crate) async fn export(
    svc: &WorkerService,
    req: wpb::ExportRequestRequest,
) -> Result<ChunkStream, Status> {
    let model = svc.pick(&req.model)?;
    let key = key_of(&model).await?;
    let name = model.info().name.clone();
    let id = RequestId(req.request_id);
    let slot = (name.clone(), id.0);
    let (otx, orx) = oneshot::channel();
    {
        let mut exports = svc
            .exports()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if exports.contains_key(&slot) {
            return Err(Status::failed_precondition(format!(
                "request {id} is already being exported"
            )));
        }
        exports.insert(slot.clone(), otx);
    }
    let unhook = |svc: &WorkerService| {
        svc.exports()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&slot);
    };
    let m = model.clone();
    let exported = match engine_call(move |reply| m.export(id, reply)).await {
        Ok(Ok(e)) => e,
        Ok(Err(e)) => {
            unhook(svc);
            return Err(from_engine_error(&e));
        }
        Err(s) => {
            unhook(svc);
            return Err(s);
        }
    };
    // Settles the export as "stays here" when it cannot be completed.
    let call_off = |why: Status| {
        let m = model.clone();
        async move {
            let _ = engine_call(move |reply| m.finish_export(id, false, reply)).await;
            why
        }
    };
    let parked = match tokio::time::timeout(PARK_TIMEOUT, orx).await {
        Ok(Ok(p)) => p,
        _ => {
            unhook(svc);
            return Err(call_off(Status::unavailable(
                "the request's stream did not reach the stop (is its caller reading?); it \
                 continues here",
            ))
            .await);
        }
    };
    if parked.stopped {
        return Err(call_off(Status::failed_precondition(format!(
            "request {id} is finishing: a stop string ended its response"
        )))
        .await);
    }
    let header = wpb::MigrationHeader {
        version: STATE_VERSION,
        model: name,
        migration_key: key,
        scheme: parked.scheme.to_owned(),
        seed: parked.seed,
        prompt_tokens: u32::try_from(exported.carried.prompt_tokens).unwrap_or(u32::MAX),
        generated_tokens: exported.carried.generated as u64,
        ticks: exported.carried.ticks,
        queue_time_us: exported.carried.queue_time.as_micros() as u64,
        compute_time_us: exported.carried.compute_time.as_micros() as u64,
        migrations: exported.carried.migrations,
        output: Some(parked.output),
        state_bytes: exported.state.len() as u64,
        state_sha256: Sha256::digest(&exported.state).to_vec(),
    };
    let mut chunks = vec![Ok(wpb::MigrationChunk {
        part: Some(wpb::migration_chunk::Part::Header(header)),
    })];
    chunks.extend(exported.state.chunks(CHUNK_BYTES).map(|c| {
        Ok(wpb::MigrationChunk {
            part: Some(wpb::migration_chunk::Part::State(c.to_vec())),
        })
    }));
    tracing::info!(model = %req.model, request = %id, bytes = exported.state.len(), "request exported");
    Ok(Box::pin(futures::stream::iter(chunks)))
}

/// `FinishExport`.
pub(crate) async fn finish(
    svc: &WorkerService,
    req: wpb::FinishExportRequest,
) -> Result<wpb::FinishExportResponse, Status> {
    let model = svc.pick(&req.model)?;
    let (id, moved) = (RequestId(req.request_id), req.moved);
    engine_call(move |reply| model.finish_export(id, moved, reply))
        .await?
        .map_err(|e| from_engine_error(&e))?;
    tracing::info!(model = %req.model, request = %id, moved, "export settled");
    Ok(wpb::FinishExportResponse {})
}

/// `ResumeRequest`.
pub(crate) async fn resume(
    svc: &WorkerService,
    request: Request<tonic::Streaming<wpb::MigrationChunk>>,
) -> Result<(EventStream, RequestId), Status> {
    if !svc.is_ready() {
        return Err(Status::unavailable(
            "worker is draining; resume the request on another worker",
        ));
    }
    let deadline = crate::convert::deadline_from_metadata(request.metadata())?;
    let span = tracing::info_span!(
        "request",
        otel.name = "worker.resume",
        model = tracing::field::Empty,
        scheme = tracing::field::Empty,
        output_tokens = tracing::field::Empty,
        finish_reason = tracing::field::Empty,
    );
    wavefront_telemetry::extract_parent(&span, request.metadata());
    let mut chunks = request.into_inner();
    let header = match chunks.message().await? {
        Some(wpb::MigrationChunk {
            part: Some(wpb::migration_chunk::Part::Header(h)),
        }) => h,
        _ => {
            return Err(Status::invalid_argument(
                "a resumed request's state starts with its header",
            ))
        }
    };
    if header.version != STATE_VERSION {
        return Err(Status::failed_precondition(format!(
            "the state is of version {}; this worker takes version {STATE_VERSION}",
            header.version
        )));
    }
    let model = svc
        .pick(&header.model)
        .map_err(|s| Status::failed_precondition(format!("cannot resume here: {}", s.message())))?;
    let key = key_of(&model).await?;
    if key != header.migration_key {
        return Err(Status::failed_precondition(format!(
            "model {:?} here differs from the one the request ran on (checkpoint or settings): \
             here {key}, there {}",
            header.model, header.migration_key
        )));
    }
    let want = usize::try_from(header.state_bytes)
        .map_err(|_| Status::invalid_argument("state too large"))?;
    let mut state = Vec::with_capacity(want.min(1 << 30));
    while let Some(chunk) = chunks.message().await? {
        match chunk.part {
            Some(wpb::migration_chunk::Part::State(b)) => {
                if state.len() + b.len() > want {
                    return Err(Status::invalid_argument(format!(
                        "the state has more than the {want} bytes its header announces"
                    )));
                }
                state.extend_from_slice(&b);
            }
            _ => {
                return Err(Status::invalid_argument(
                    "a second header in a state stream",
                ))
            }
        }
    }
    if state.len() != want {
        return Err(Status::invalid_argument(format!(
            "the state ended after {} of its {want} bytes",
            state.len()
        )));
    }
    if Sha256::digest(&state).as_slice() != header.state_sha256.as_slice() {
        return Err(Status::invalid_argument(
            "the state's bytes do not match their digest",
        ));
    }
    let output = header
        .output
        .clone()
        .and_then(OutputAssembler::restore)
        .ok_or_else(|| Status::invalid_argument("the state's output part is inconsistent"))?;
    model.check_room().map_err(|e| from_engine_error(&e))?;
    let carried = Carried {
        prompt_tokens: header.prompt_tokens as usize,
        generated: usize::try_from(header.generated_tokens).unwrap_or(usize::MAX),
        ticks: header.ticks,
        queue_time: Duration::from_micros(header.queue_time_us),
        compute_time: Duration::from_micros(header.compute_time_us),
        migrations: header.migrations,
    };
    let scheme = model
        .info()
        .schemes
        .iter()
        .copied()
        .find(|s| *s == header.scheme)
        .unwrap_or("unspecified");
    span.record("model", model.info().name.as_str());
    span.record("scheme", scheme);
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    let stop = Arc::new(AtomicBool::new(false));
    let abandoned = Arc::new(std::sync::OnceLock::new());
    let sink = TokioSink {
        tx,
        stop: stop.clone(),
        abandoned: abandoned.clone(),
    };
    let id = {
        let (m, span) = (model.clone(), span.clone());
        tokio::task::spawn_blocking(move || {
            m.import(&state, carried, Box::new(sink), deadline, span)
        })
        .await
        .map_err(|e| Status::internal(format!("taking in the state failed: {e}")))?
        .map_err(|e: EngineError| from_engine_error(&e))?
    };
    tracing::info!(parent: &span, request = %id, migrations = header.migrations, "request resumed from another worker");
    let st = StreamState {
        key: (model.info().name.clone(), id.0),
        exports: svc.exports().clone(),
        messages: 0,
        model,
        rx: Some(rx),
        abandoned,
        response: Assembly::new(output, stop, header.seed),
        pending: VecDeque::new(),
        seed: header.seed,
        scheme,
        started: Instant::now(),
        deadline,
        first_token: true,
        last_tokens: Instant::now(),
        recorded: false,
        span,
    };
    Ok((
        wavefront_proto::timeout::with_deadline(response_stream(st), deadline),
        id,
    ))
}
