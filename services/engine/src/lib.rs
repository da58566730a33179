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
//!    each tick ([`Family::reclaim`]).
//! 3. **Ticks** ([`engine`]): a dedicated thread, fed by a bounded channel,
//!    hands all active programs to the family's [`Family::tick`], which packs
//!    their rows into batched forwards and commits the results.
//! 4. **Events**: programs emit tokens and a final result through an
//!    [`EventSink`]; a sink whose receiver is gone cancels its request, and its
//!    slots return to the pool before the next tick runs.
//!
//! The crate knows no gRPC, no async runtime and no tensors: families plug in
//! through the [`Family`] trait, and transports plug in through [`EventSink`].

// Rejections hand the rejected item back by value (like `TrySendError`),
// which makes some `Err` variants large on purpose.
#![allow(clippy::result_large_err)]

pub mod engine;
pub mod error;
pub mod family;
pub mod ids;
pub mod metrics;
pub mod queue;
pub mod scheduler;
pub mod slots;
pub mod stats;

pub use engine::{
    Engine, EngineConfig, EngineHandle, EngineLoad, EventSink, ExportReply, SinkError, Submission,
};
pub use error::EngineError;
pub use family::{
    Active, CanvasFrame, Carried, CellState, Event, Exported, Family, FamilyError, FinishReason,
    Moved, Outbox, Prepared, RequestError,
};
pub use ids::{RequestId, SlotId};
pub use queue::AdmissionQueue;
pub use slots::SlotPool;
pub use stats::Stats;
