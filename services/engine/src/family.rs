//! The contract between the engine and a model family.
//!
//! A *program* is one request's decoding state machine (static
//! autoregression, a diffusion-forcing wavefront, a masked-diffusion canvas,
//! a slot planner, a segment schedule). A *family* owns the model and packs
//! the work of all active programs into batched forwards, once per tick.
//!
//! Programs are built outside the engine thread (validation answers the
//! caller synchronously) and handed in through a [`crate::Submission`]; the
//! engine admits them when their slots fit and calls [`Family::tick`] with
//! every active program until each one finishes through its [`Outbox`].

use crate::ids::{RequestId, SlotId};
use crate::stats::Stats;
use crate::EngineError;
use std::time::Instant;

/// A request rejected before admission, with a message saying what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// A parameter is out of range or inconsistent with another one.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The request needs more than this model or worker can ever give.
    #[error("too large: {0}")]
    TooLarge(String),
}

/// Why a request finished normally.
/// Why a family could not complete a tick, or one request's part of it: the one error type at
/// the engine/family seam (a failed tick fails the requests it names, or the whole batch).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FamilyError {
    /// A model operation failed: a forward, a kernel, device memory.
    #[error("{0}")]
    Forward(String),
    /// A request's program could not apply its outputs of the tick.
    #[error("{scheme} step failed: {message}")]
    Commit {
        scheme: &'static str,
        message: String,
    },
}

impl FamilyError {
    /// A failed model operation, from its error.
    pub fn forward(e: impl std::fmt::Display) -> Self {
        Self::Forward(e.to_string())
    }

    /// A program that could not apply its outputs.
    pub fn commit(scheme: &'static str, e: impl std::fmt::Display) -> Self {
        Self::Commit {
            scheme,
            message: e.to_string(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// A stop token (or the model's end-of-sequence token) was produced.
    StopToken,
    /// A stop string appeared in the text (decided by the transport layer).
    StopString,
    /// The model's context limit was reached.
    ContextLimit,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::StopToken => "stop_token",
            FinishReason::StopString => "stop_string",
            FinishReason::ContextLimit => "context_limit",
        }
    }
}

/// What the engine sends back for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Newly final tokens, in position order.
    Tokens(Vec<u32>),
    /// A view of the request's canvas, for clients that watch the decoding (sent only when the
    /// request asked for it). Positions count from the first generated position.
    Canvas(CanvasFrame),
    /// The request finished; its slots are back in the pool.
    Finished { reason: FinishReason, stats: Stats },
    /// The request failed; its slots are back in the pool.
    Failed(EngineError),
    /// The request stopped at a step boundary to be exported ([`crate::EngineHandle::export`]):
    /// every event before this one was its last on this worker unless the move is called off
    /// ([`crate::EngineHandle::finish_export`]), when its events go on after it. A moved
    /// request ends with `Failed(EngineError::Moved)`.
    Parked,
}

/// What a canvas position holds at the time of a [`CanvasFrame`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CellState {
    /// Still the mask token.
    Masked,
    /// A token that may still change (a WINO draft, which verification can revoke).
    Drafted,
    /// A final token.
    Committed,
    /// A final token whose rows are no longer computed (SureLock).
    Locked,
}

/// Canvas positions with their tokens and states: either the whole generated region (`full`,
/// masked diffusion after every step) or the positions one step made final, in the order the
/// decoder committed them (slot diffusion's out-of-order slots).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CanvasFrame {
    /// Positions relative to the first generated position.
    pub positions: Vec<u32>,
    /// Token at each position (the mask token where masked).
    pub tokens: Vec<u32>,
    pub states: Vec<CellState>,
    /// Whether `positions` covers the whole generated region (a snapshot) rather than an
    /// update.
    pub full: bool,
    /// The request's decoding step (forward passes so far).
    pub step: u32,
}

/// Where a program puts what it produced during a tick.
#[derive(Debug, Default)]
pub struct Outbox {
    pub(crate) events: Vec<Event>,
    pub(crate) done: bool,
}

impl Outbox {
    /// Streams newly final tokens.
    pub fn tokens(&mut self, ids: Vec<u32>) {
        if !ids.is_empty() && !self.done {
            self.events.push(Event::Tokens(ids));
        }
    }

    /// Sends a canvas view (the program decides whether its request asked for one).
    pub fn canvas(&mut self, frame: CanvasFrame) {
        if !frame.positions.is_empty() && !self.done {
            self.events.push(Event::Canvas(frame));
        }
    }

    /// Ends the request normally. The engine fills in the timing fields.
    pub fn finish(&mut self, reason: FinishReason, stats: Stats) {
        if !self.done {
            self.events.push(Event::Finished { reason, stats });
            self.done = true;
        }
    }

    /// Ends the request with an error that concerns only this request.
    pub fn fail(&mut self, error: FamilyError) {
        if !self.done {
            self.events
                .push(Event::Failed(EngineError::StepFailed(error)));
            self.done = true;
        }
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The events put here since the engine last delivered (what a commit produced: for
    /// tests of programs on fake outputs).
    pub fn events(&self) -> &[Event] {
        &self.events
    }
}

/// A program built and validated outside the engine, waiting for admission.
#[derive(Debug)]
pub struct Prepared<P> {
    pub program: P,
    /// Slots taken at admission: the first tick's needs. A family that reserves the worst case
    /// asks for `max_slots`; one whose programs grow ([`Family::slots_needed`]) asks for less.
    pub slots: usize,
    /// The most slots the request can ever hold: a request whose most exceeds the pool is
    /// refused at submission, since it could never finish.
    pub max_slots: usize,
    /// Slots the request keeps until it ends, whatever its program needs (a worst-case
    /// reservation, `--kv-reserve worst-case`, keeps all of it): [`Family::reclaim`] never
    /// takes it below this ([`Active::keeps`]). 0 for a request reserving as it goes.
    pub floor: usize,
    pub prompt_tokens: usize,
    /// A request that arrived from another worker ([`Carried`]): its program is in the state a
    /// preemption leaves, and it resumes ([`Family::resume`]) instead of starting.
    pub carried: Option<Carried>,
}

impl<P> Prepared<P> {
    /// A request that takes its whole reservation, `slots`, at admission.
    pub fn reserved(program: P, slots: usize, prompt_tokens: usize) -> Self {
        Self {
            program,
            slots,
            max_slots: slots,
            floor: 0,
            prompt_tokens,
            carried: None,
        }
    }

    /// A request exported by another worker, to resume here: `program` as a preemption leaves
    /// it, with what the engine counted there.
    pub fn imported(program: P, carried: Carried) -> Self {
        Self {
            program,
            slots: 0,
            max_slots: 0,
            floor: 0,
            prompt_tokens: carried.prompt_tokens,
            carried: Some(carried),
        }
    }
}

/// What an engine counted for a request before it moved: the figures its final statistics
/// add up, so they cover the whole request.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Carried {
    pub prompt_tokens: usize,
    /// Tokens streamed before the move.
    pub generated: usize,
    /// Ticks the request ran in before the move.
    pub ticks: u64,
    /// From submission to its first admission.
    pub queue_time: std::time::Duration,
    /// Compute time before the move (from each admission to the export).
    pub compute_time: std::time::Duration,
    /// Moves before this one.
    pub migrations: u32,
}

/// A request's state as it leaves an engine ([`crate::EngineHandle::export`]).
#[derive(Debug, Clone)]
pub struct Exported {
    /// The program's bytes ([`Family::export`]).
    pub state: Vec<u8>,
    pub carried: Carried,
}

/// An admitted program with the slots it holds.
#[derive(Debug)]
pub struct Active<P> {
    pub id: RequestId,
    pub program: P,
    /// Every slot the request holds, in the order they were granted.
    pub slots: Vec<SlotId>,
    /// Slots granted since the family last took them ([`Active::take_new_slots`]): at
    /// admission, as the program grows, and when a preempted request resumes.
    pub new_slots: Vec<SlotId>,
    pub outbox: Outbox,
    pub admitted_at: Instant,
    pub ticks: u64,
    /// Admission order (preemption takes the most recently admitted first).
    pub seq: u64,
    /// Slots kept until the request ends ([`Prepared::floor`]).
    pub floor: usize,
}

impl<P> Active<P> {
    /// The slots a request whose program needs `need` keeps after a tick: never fewer than its
    /// floor (what [`Family::reclaim`] implementations give back is what it holds beyond this).
    pub fn keeps(&self, need: usize) -> usize {
        need.max(self.floor)
    }

    /// The slots granted since the last call, for the family to hand to the program's state.
    pub fn take_new_slots(&mut self) -> Vec<SlotId> {
        std::mem::take(&mut self.new_slots)
    }
}

/// What a preemption or a resumption moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Moved {
    /// Bytes copied between the slots and host memory.
    pub bytes: u64,
    /// Rows that will be (or were) computed again instead of moved.
    pub recomputed_rows: u64,
}

/// A model family: owns the weights and the per-slot device state, and
/// advances every active program by one unit of work per call.
pub trait Family: Send + 'static {
    type Program: Send + 'static;

    /// Runs one tick over `batch`: each program says which rows it needs, the
    /// family packs them into batched forwards, and each program commits its
    /// results through its [`Outbox`]. An `Err` fails every program of the
    /// batch; a program-specific problem goes to that program's outbox.
    fn tick(&mut self, batch: &mut [&mut Active<Self::Program>]) -> Result<(), FamilyError>;

    /// Called once when a program leaves (finished, failed, cancelled,
    /// expired) so the family can drop any device state it keyed by slot.
    fn release(&mut self, _program: &mut Active<Self::Program>) {}

    /// The transport stopped the request (a stop string): the program finishes now, through
    /// its outbox, with [`FinishReason::StopString`] and the statistics it has gathered. The
    /// default reports none; families that keep statistics pass theirs on.
    fn stop(&mut self, active: &mut Active<Self::Program>) {
        active
            .outbox
            .finish(FinishReason::StopString, Stats::default());
    }

    /// Slots `active` must hold for its next tick: all its state after that tick. The default,
    /// what it holds, is a family that reserves at admission; a family whose programs grow
    /// asks for more as they do (the scheduler grants them before the tick, in
    /// [`Active::new_slots`], preempting other requests when the pool is short), and for a
    /// preempted program, what resuming and its next tick take.
    fn slots_needed(&self, active: &Active<Self::Program>) -> usize {
        active.slots.len()
    }

    /// Moves `active`'s state out of its slots (to host memory, or dropped to be recomputed),
    /// so the scheduler can give them to other requests; the request resumes later
    /// ([`Family::resume`]) in whatever slots are free then, and its tokens and statistics do
    /// not change. A family that cannot preempt says so with an error (the request then fails).
    fn preempt(&mut self, _active: &mut Active<Self::Program>) -> Result<Moved, FamilyError> {
        Err(FamilyError::Forward(
            "this model family cannot preempt a request".into(),
        ))
    }

    /// Slots `active` holds and will not need for its next step (a cache truncated by a
    /// rollback, an ARMT request past its prompt's segments): the family takes them from the
    /// program's state and hands their ids back; the engine returns them to the pool. Called
    /// after every tick the request ran in. The default keeps everything.
    fn reclaim(&mut self, _active: &mut Active<Self::Program>) -> Vec<SlotId> {
        Vec::new()
    }

    /// Encodes the whole state of a request that [`Family::preempt`] just moved out of its
    /// slots (its pages' rows, latent states, memories, counters, schedules and random-number
    /// generators), for another worker's planner to rebuild and this family's
    /// [`Family::resume`] to continue there. A family that cannot move requests says so.
    fn export(&mut self, _active: &mut Active<Self::Program>) -> Result<Vec<u8>, FamilyError> {
        Err(FamilyError::Forward(
            "this model family cannot move a request to another worker".into(),
        ))
    }

    /// Brings a preempted request's state back into the slots it holds now.
    fn resume(&mut self, _active: &mut Active<Self::Program>) -> Result<Moved, FamilyError> {
        Ok(Moved::default())
    }

    /// Rows (positions, states, cells) the last tick computed, for metrics.
    fn last_tick_rows(&self) -> Option<usize> {
        None
    }
}
