//! # wavefront-engine: the engine core
//!
//! Every decoding scheme served here is a loop of "compute some rows, look at
//! the results, decide". This crate runs one such loop for all requests on a
//! device, independent of which model family fills in the rows:
//!
//! 1. **Admission** ([`queue`]): a request enters a bounded FIFO; a full queue
//!    is an error value ([`EngineError::QueueFull`]), never unbounded growth.
//! 2. **Slots** ([`slots`]): fungible units of memory (K/V pages, latent states,
//!    memories, canvas rows), any free one serving any request; the pool size comes
//!    from a memory budget. A request takes its first step's slots at admission and
//!    more before each tick as its program grows ([`Family::slots_needed`]); when the
//!    pool is short the newest request is preempted ([`Family::preempt`]) and resumes
//!    later, ahead of new arrivals; what a program no longer needs goes back after
//!    each tick ([`Family::reclaim`]). Requests with the same prompt read one copy of its
//!    pages ([`Family::adopt_prompt`]), from a running request or from a finished one the
//!    prefix cache keeps until the pool needs its slots.
//! 3. **Ticks** ([`engine`], [`scheduler`], [`tick`]): a dedicated thread, fed by a bounded
//!    channel, runs one tick per iteration: every program that runs says what its next step
//!    computes, the row budget is shared between them, each plans its step as plain data, the
//!    family runs all plans in packed forwards ([`Family::run`]) and each program commits its
//!    output ([`Family::commit`]).
//! 4. **Events** ([`event`], [`sink`]): programs emit tokens and a final result through their
//!    [`Outbox`]; the engine delivers them to each request's [`EventSink`]; a sink whose
//!    receiver is gone cancels its request, and its slots return to the pool before the next
//!    tick runs.
//!
//! The crate knows no gRPC, no async runtime and no tensors: families plug in
//! through the [`Family`] trait, and transports plug in through [`EventSink`].

// Rejections hand the rejected item back by value (like `TrySendError`),
// which makes some `Err` variants large on purpose.
#![allow(clippy::result_large_err)]

pub mod engine;
pub mod error;
pub mod event;
pub mod family;
pub mod ids;
pub mod metrics;
mod prefix_cache;
pub mod queue;
pub mod request;
pub mod scheduler;
pub mod sink;
pub mod slots;
pub mod standalone;
pub mod stats;
pub mod tick;

pub use engine::{Engine, EngineConfig, EngineHandle, EngineLoad, ExportReply, Submission};
pub use error::{Cause, EngineError, FamilyError, Phase, RequestError};
pub use event::{CanvasFrame, CellState, Event, FinishReason, Outbox, TokenLogprob};
pub use family::{Adopted, Demand, Family, Group, Planned};
pub use ids::{RequestId, SlotId};
pub use queue::AdmissionQueue;
pub use request::{Active, Carried, Exported, Moved, Prepared};
pub use sink::{EventSink, SinkError};
pub use slots::SlotPool;
pub use standalone::Standalone;
pub use stats::Stats;
pub use tick::{run_tick, TickOutcome};
