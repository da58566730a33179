//! Relaying a worker's stream to the caller, and moving the request when its worker drains.
//!
//! A relay runs as a task per call: it forwards the worker's messages to the caller's stream
//! and, when discovery reports the worker draining (its load report says not ready), or, with
//! `--rebalance`, when the worker has requests queued and another worker of the model has room
//! ([`Discovery::claim_room`]), moves the request there without the caller noticing:
//!
//! 1. `ExportRequest` on the draining worker stops the request at a step boundary and returns
//!    its state; meanwhile its stream keeps being relayed.
//! 2. The relay forwards the old stream up to the message count the export reports (every
//!    message made before the stop), so no message is lost or repeated.
//! 3. `ResumeRequest` on the best other worker; once it answers, `FinishExport` (moved) ends the
//!    request on the old worker and the relay continues with the new stream. If no worker takes
//!    it, `FinishExport` (not moved) lets it continue where it was, and the relay tries again at
//!    the next discovery round while the worker drains.
//!
//! A request that has produced nothing yet (it waits in the worker's queue, so there is no
//! state to export) starts over instead: the relay sends the caller's request to the other
//! worker and drops the old call, which cancels it where it waited.
//!
//! The final message's statistics cover the whole request and count its moves. A caller that
//! goes away drops the relay's channel; the relay ends and drops the worker call, which cancels
//! the request there.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status, Streaming};
use wavefront_proto::auth::AttachSecret;
use wavefront_proto::v1 as pb;
use wavefront_proto::worker::v1 as wpb;
use wavefront_proto::worker::v1::worker_client::WorkerClient;

use crate::discovery::Discovery;
use crate::pick::rank;

/// The response header in which a worker names the request's id (its `ExportRequest` key).
pub const REQUEST_ID_HEADER: &str = "x-wavefront-request-id";

/// The longest wait for a draining worker's export.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(60);

type Client = WorkerClient<InterceptedService<Channel, AttachSecret>>;
type Item = Result<pb::GenerateStreamResponse, Status>;

/// One worker's part of a request.
pub(crate) struct Leg {
    pub(crate) addr: SocketAddr,
    pub(crate) client: Client,
    pub(crate) stream: Streaming<pb::GenerateStreamResponse>,
    /// The worker's id of the request (no id: the worker cannot move it).
    pub(crate) id: Option<u64>,
    /// Messages relayed from this worker.
    pub(crate) relayed: u64,
    /// Messages relayed from the workers the request was on before (it moved with its state).
    pub(crate) before: u64,
    /// Moves of the request no engine counted: restarts of a request that had produced
    /// nothing yet ([`restart`]). Added to the final message's `migrations`.
    pub(crate) restarts: u32,
}

/// The request id a worker's response names, if any.
pub(crate) fn request_id(md: &tonic::metadata::MetadataMap) -> Option<u64> {
    md.get(REQUEST_ID_HEADER)?.to_str().ok()?.parse().ok()
}

/// What the relay needs to move a request.
pub(crate) struct Ctx {
    pub(crate) discovery: Discovery,
    pub(crate) model: String,
    /// The caller's request, sent again to another worker when a request that has produced
    /// nothing yet moves (a queued request has no state to export).
    pub(crate) request: pb::GenerateRequest,
    pub(crate) deadline: Option<Instant>,
    pub(crate) span: tracing::Span,
    /// Turns a broken worker connection into the caller's status (and marks the worker down).
    pub(crate) on_error: fn(&Discovery, SocketAddr, &tracing::Span, Status) -> Status,
    /// Also move the request when its worker has a queue and another worker is idle.
    pub(crate) rebalance: bool,
}

enum Step {
    /// The request continues on this leg.
    Continue,
    /// The caller's stream is over (the request ended, or the caller left).
    End,
}

/// Forwards one message of `leg` to `tx`; `End` when the stream or the caller is done.
async fn forward(
    leg: &mut Leg,
    ctx: &Ctx,
    tx: &mpsc::Sender<Item>,
    item: Result<Option<pb::GenerateStreamResponse>, Status>,
) -> Step {
    match item {
        Ok(Some(mut m)) => {
            leg.relayed += 1;
            if leg.restarts > 0 {
                if let Some(pb::generate_stream_response::Event::Done(done)) = m.event.as_mut() {
                    if let Some(stats) = done.stats.as_mut() {
                        stats.migrations += leg.restarts;
                    }
                }
            }
            if tx.send(Ok(m)).await.is_err() {
                return Step::End;
            }
            Step::Continue
        }
        Ok(None) => Step::End,
        Err(s) => {
            let s = (ctx.on_error)(&ctx.discovery, leg.addr, &ctx.span, s);
            let _ = tx.send(Err(s)).await;
            Step::End
        }
    }
}

/// Relays `leg` (and the legs it moves to) into `tx` until the request ends or the caller
/// leaves.
pub(crate) async fn relay(mut leg: Leg, ctx: Ctx, tx: mpsc::Sender<Item>) {
    let mut rounds = ctx.discovery.rounds();
    let mut movable = leg.id.is_some();
    // Rebalancing moves a request once: a second move would chase the load reports' lag (a
    // request moved to a worker that then queues it could bounce back and forth).
    let mut rebalanced = false;
    loop {
        tokio::select! {
            _ = tx.closed() => return,
            item = leg.stream.message() => {
                if let Step::End = forward(&mut leg, &ctx, &tx, item).await {
                    return;
                }
            }
            changed = rounds.changed(), if movable => {
                if changed.is_err() {
                    movable = false;
                    continue;
                }
                let (targets, why) = if ctx.discovery.is_draining(leg.addr) {
                    let workers = ctx.discovery.snapshot();
                    match rank(&workers, &ctx.model, &[leg.addr]) {
                        Ok(t) => (t, "draining"),
                        Err(_) => {
                            tracing::debug!(parent: &ctx.span, worker = %leg.addr, "worker draining; no other worker for the request yet");
                            continue;
                        }
                    }
                } else if ctx.rebalance && !rebalanced {
                    match ctx.discovery.claim_room(leg.addr, &ctx.model) {
                        Some(room) => (vec![room], "rebalance"),
                        None => continue,
                    }
                } else {
                    continue;
                };
                match migrate(&mut leg, &ctx, &tx, targets, why).await {
                    Ok(Some(next)) => {
                        leg = next;
                        movable = leg.id.is_some();
                        rebalanced |= why == "rebalance";
                    }
                    Ok(None) => {}
                    Err(Step::End) => return,
                    Err(Step::Continue) => movable = false,
                }
            }
        }
    }
}

/// Moves the request of `leg` to another worker. `Ok(Some)`: the new leg; `Ok(None)`: it stays
/// on this worker for now (nobody could take it; tried again at the next round);
/// `Err(End)`: the request ended (or the caller left) meanwhile; `Err(Continue)`: it cannot move
/// (it stays, and no move is tried again).
async fn migrate(
    leg: &mut Leg,
    ctx: &Ctx,
    tx: &mpsc::Sender<Item>,
    targets: Vec<crate::discovery::WorkerEntry>,
    why: &'static str,
) -> Result<Option<Leg>, Step> {
    let Some(id) = leg.id else {
        return Err(Step::Continue);
    };
    let started = Instant::now();
    let mut source = leg.client.clone();
    let export = {
        let mut client = leg.client.clone();
        let req = wpb::ExportRequestRequest {
            model: ctx.model.clone(),
            request_id: id,
        };
        async move {
            let mut s = client.export_request(req).await?.into_inner();
            let mut chunks = Vec::new();
            while let Some(c) = s.message().await? {
                chunks.push(c);
            }
            Ok::<_, Status>(chunks)
        }
    };
    let export = tokio::time::timeout(EXPORT_TIMEOUT, export);
    tokio::pin!(export);
    // The old stream keeps flowing while the worker stops the request.
    let chunks = loop {
        tokio::select! {
            _ = tx.closed() => return Err(Step::End),
            r = &mut export => break r,
            item = leg.stream.message() => {
                if let Step::End = forward(leg, ctx, tx, item).await {
                    return Err(Step::End);
                }
            }
        }
    };
    let chunks = match chunks {
        Ok(Ok(c)) => c,
        Ok(Err(s)) => {
            tracing::info!(parent: &ctx.span, worker = %leg.addr, code = ?s.code(), error = %s.message(), "request not exported");
            let never_sent = leg.relayed == 0 && leg.before == 0;
            return match s.code() {
                // Queued (or not yet past its first step) and nothing reached the caller: the
                // request starts over on the other worker and gives the same messages. Never
                // once anything was relayed: the caller would get those messages twice.
                tonic::Code::NotFound | tonic::Code::FailedPrecondition if never_sent => {
                    restart(leg, ctx, targets, why).await
                }
                // Not running there yet (taken in after a move, still queued) or just finished
                // (its stream ends the relay): asked again at the next round.
                tonic::Code::NotFound => Ok(None),
                // Stopping, or a model that cannot move: it ends where it is.
                tonic::Code::FailedPrecondition => Err(Step::Continue),
                _ => Ok(None),
            };
        }
        Err(_) => {
            tracing::warn!(parent: &ctx.span, worker = %leg.addr, "export timed out; the request stays");
            return Ok(None);
        }
    };
    let header = match chunks.first().and_then(|c| c.part.as_ref()) {
        Some(wpb::migration_chunk::Part::Header(h)) => h.clone(),
        _ => {
            settle(&mut source, ctx, id, false).await;
            return Err(Step::Continue);
        }
    };
    let bytes: usize = chunks
        .iter()
        .map(|c| match &c.part {
            Some(wpb::migration_chunk::Part::State(b)) => b.len(),
            _ => 0,
        })
        .sum();
    // Everything the old worker made before the stop reaches the caller first.
    let made = header.output.as_ref().map_or(0, |o| o.messages);
    while leg.relayed < made {
        let item = tokio::select! {
            _ = tx.closed() => return Err(Step::End),
            item = leg.stream.message() => item,
        };
        if let Step::End = forward(leg, ctx, tx, item).await {
            return Err(Step::End);
        }
    }
    for target in targets {
        let Some(req) = worker_call(
            ctx.deadline,
            &ctx.span,
            futures::stream::iter(chunks.clone()),
        ) else {
            break;
        };
        ctx.discovery.note_routed(target.addr);
        let mut client = target.client.clone();
        match client.resume_request(req).await {
            Ok(resp) => {
                settle(&mut source, ctx, id, true).await;
                let new_id = request_id(resp.metadata());
                metrics::counter!(wavefront_telemetry::metrics::ROUTER_MIGRATIONS_TOTAL, "reason" => why, "outcome" => "moved").increment(1);
                tracing::info!(
                    parent: &ctx.span,
                    from = %leg.addr,
                    to = %target.addr,
                    bytes,
                    migrations = header.migrations,
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    reason = why,
                    "request moved to another worker"
                );
                return Ok(Some(Leg {
                    addr: target.addr,
                    client: target.client.clone(),
                    stream: resp.into_inner(),
                    id: new_id,
                    relayed: 0,
                    before: leg.before + leg.relayed,
                    restarts: leg.restarts,
                }));
            }
            Err(s) => {
                tracing::info!(parent: &ctx.span, worker = %target.addr, code = ?s.code(), error = %s.message(), "worker did not take the request");
            }
        }
    }
    // Nobody took it: it goes on where it is, and is offered again at the next round.
    metrics::counter!(wavefront_telemetry::metrics::ROUTER_MIGRATIONS_TOTAL, "outcome" => "stayed")
        .increment(1);
    settle(&mut source, ctx, id, false).await;
    Ok(None)
}

/// Tells the old worker whether its exported request moved.
/// Sends the caller's request again to the first of `targets` that takes it, for a request that
/// has relayed nothing yet; the old leg is dropped by the caller, which cancels it on its worker.
/// `Ok(None)`: nobody took it; it stays.
async fn restart(
    leg: &Leg,
    ctx: &Ctx,
    targets: Vec<crate::discovery::WorkerEntry>,
    why: &'static str,
) -> Result<Option<Leg>, Step> {
    for target in targets {
        let Some(req) = worker_call(ctx.deadline, &ctx.span, ctx.request.clone()) else {
            break;
        };
        ctx.discovery.note_routed(target.addr);
        let mut client = target.client.clone();
        match client.generate(req).await {
            Ok(resp) => {
                metrics::counter!(wavefront_telemetry::metrics::ROUTER_MIGRATIONS_TOTAL, "reason" => why, "outcome" => "restarted").increment(1);
                tracing::info!(
                    parent: &ctx.span,
                    from = %leg.addr,
                    to = %target.addr,
                    reason = why,
                    "request had produced nothing yet; started over on another worker"
                );
                return Ok(Some(Leg {
                    addr: target.addr,
                    client: target.client.clone(),
                    id: request_id(resp.metadata()),
                    stream: resp.into_inner(),
                    relayed: 0,
                    before: 0,
                    restarts: leg.restarts + 1,
                }));
            }
            Err(s) => {
                tracing::info!(parent: &ctx.span, worker = %target.addr, code = ?s.code(), error = %s.message(), "worker did not take the request");
            }
        }
    }
    metrics::counter!(wavefront_telemetry::metrics::ROUTER_MIGRATIONS_TOTAL, "outcome" => "stayed")
        .increment(1);
    Ok(None)
}

/// `msg` as a call to a worker, carrying what is left of the caller's `deadline` and the trace
/// context of `span`; `None` when the deadline has passed. The deadline travels as the header
/// alone: the worker enforces it (a client-side timer would answer CANCELLED instead of
/// DEADLINE_EXCEEDED).
pub(crate) fn worker_call<T>(
    deadline: Option<Instant>,
    span: &tracing::Span,
    msg: T,
) -> Option<Request<T>> {
    let mut req = Request::new(msg);
    if let Some(d) = deadline {
        let left = d.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let value = wavefront_proto::timeout::format(left)
            .parse()
            .expect("ascii timeout");
        req.metadata_mut().insert("grpc-timeout", value);
    }
    wavefront_telemetry::inject_current(span, req.metadata_mut());
    Some(req)
}

async fn settle(source: &mut Client, ctx: &Ctx, id: u64, moved: bool) {
    let r = source
        .finish_export(wpb::FinishExportRequest {
            model: ctx.model.clone(),
            request_id: id,
            moved,
        })
        .await;
    if let Err(s) = r {
        tracing::warn!(parent: &ctx.span, code = ?s.code(), error = %s.message(), moved, "could not settle an export");
    }
}
