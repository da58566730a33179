//! The contract between the engine and a model family: a tick is **plan → run → commit**.
//!
//! A *program* is one request's decoding state machine (static autoregression, a
//! diffusion-forcing wavefront, a masked-diffusion canvas, a span planner, a segment schedule).
//! A *family* owns the model and the storage its programs' state lives in. Every tick, for the
//! programs that run ([`crate::tick::run_tick`], called by the scheduler):
//!
//! 1. **demand**: each program says how many rows its next step computes ([`Demand`]); the
//!    engine shares `--max-batch-rows` between them (prefills that may run in part get what the
//!    whole steps leave);
//! 2. **plan**: each program plans its step under the rows it was given and returns plain data
//!    ([`Family::Plan`]): rows, positions, the pages it reads and writes, its random draws;
//! 3. **run**: the family runs every plan of the tick in packed forwards, split into forward
//!    groups as it likes, and returns one result per group ([`Group`]);
//! 4. **commit**: each program applies its own output and emits events through its
//!    [`crate::Outbox`].
//!
//! A failed group fails only its requests; a failed plan or commit only its own. Plans and
//! outputs are plain values, so a whole tick is tested with fake outputs (the engine's tests)
//! and a program's commit without a model (each scheme's commit tests).
//!
//! Programs are built outside the engine thread (validation answers the caller synchronously)
//! and handed in through a [`crate::Submission`]; the engine admits them when their slots fit.
//! Between ticks the family moves a program's state in and out of its slots (the slot cycle:
//! [`Family::slots_needed`], [`Family::reclaim`], [`Family::preempt`], [`Family::resume`]).

use crate::error::FamilyError;
use crate::event::FinishReason;
use crate::ids::SlotId;
use crate::request::{Active, Moved};
use crate::stats::Stats;

/// Rows a program's next step computes, asked for before the tick is planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Demand {
    /// Nothing to run this tick (a program that finished and waits to be retired).
    Idle,
    /// A step that runs whole: a decoding step, a canvas, a wavefront, a segment, a call. Its
    /// rows count against the row budget whatever it is.
    Whole(usize),
    /// A prefill of this many rows that may run in part: it gets what the row budget leaves
    /// after the whole steps, in tick order, and waits for a later tick when nothing is left.
    Prefill(usize),
}

impl Demand {
    /// The rows asked for.
    pub fn rows(self) -> usize {
        match self {
            Demand::Idle => 0,
            Demand::Whole(n) | Demand::Prefill(n) => n,
        }
    }
}

/// One planned program as [`Family::run`] sees it: its plan, and its state (caches, memories,
/// residual streams) for the forwards to read and write.
pub struct Planned<'a, P, L> {
    pub program: &'a mut P,
    pub plan: L,
}

/// What one forward group of a tick produced: an output for each member (indices into the
/// tick's [`Planned`] slice, in the order of the outputs), or the error that fails them all.
#[derive(Debug)]
pub struct Group<O> {
    pub members: Vec<usize>,
    pub outputs: Result<Vec<O>, FamilyError>,
}

impl<O> Group<O> {
    /// One group holding every one of `n` planned programs, with `outputs` in their order.
    pub fn all(n: usize, outputs: Result<Vec<O>, FamilyError>) -> Self {
        Self {
            members: (0..n).collect(),
            outputs,
        }
    }
}

/// What [`Family::adopt_prompt`] gave a taker: the slots it now reads and holds with the donor,
/// and the prompt rows (tokens) it will not compute. Nothing is shared when `rows` is 0 (a
/// taker that has already computed rows of its own, a donor whose state is swapped out, an ARMT
/// donor whose memories were written in the other execution); ARMT copies memories rather than pages, so its rows come
/// with no slots.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Adopted {
    pub slots: Vec<SlotId>,
    pub rows: usize,
}

/// A model family: owns the weights and the per-slot device state, plans, runs and commits every
/// active program's steps, and moves programs' state in and out of their slots.
pub trait Family: Send + 'static {
    type Program: Send + 'static;
    /// One program's step as plain data (rows, positions, pages, draws).
    type Plan;
    /// What the forwards produced for one plan.
    type Output;

    /// The rows `active`'s next step computes.
    fn demand(&self, active: &Active<Self::Program>) -> Demand;

    /// Plans `active`'s next step over `rows` rows (its whole demand, or the part of a prefill
    /// the row budget gave it, at least one). The family first hands the program the slots
    /// granted since its last tick ([`Active::take_new_slots`]). `Ok(None)`: the program
    /// finished instead, through its outbox (a context limit).
    fn plan(
        &mut self,
        active: &mut Active<Self::Program>,
        rows: usize,
    ) -> Result<Option<Self::Plan>, FamilyError>;

    /// Runs every plan of the tick in packed forwards, writing what the forwards write (caches)
    /// through each program's state, and returns one [`Group`] per forward group: every
    /// planned program belongs to exactly one.
    fn run(
        &mut self,
        work: &mut [Planned<'_, Self::Program, Self::Plan>],
    ) -> Vec<Group<Self::Output>>;

    /// Applies `output`, the result of `plan`, to `active`'s program: tokens taken, positions
    /// committed, frozen or locked, events emitted through its outbox. An error fails only this
    /// request.
    fn commit(
        &mut self,
        active: &mut Active<Self::Program>,
        plan: Self::Plan,
        output: Self::Output,
    ) -> Result<(), FamilyError>;

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

    /// Bytes of memory the family's slot pools have allocated so far (arenas are made on first
    /// use and kept: the pools' high-water mark, at most what the slots amount to), published
    /// as a gauge. The default: none counted.
    fn pool_bytes(&self) -> u64 {
        0
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
        Err(FamilyError::Unsupported("preempt a request"))
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
        Err(FamilyError::Unsupported("move a request to another worker"))
    }

    /// Brings a preempted request's state back into the slots it holds now.
    fn resume(&mut self, _active: &mut Active<Self::Program>) -> Result<Moved, FamilyError> {
        Ok(Moved::default())
    }

    /// Prompt sharing: a key naming the state `program`'s prompt leaves in its pages (its
    /// token ids and whatever else that state depends on), equal only for programs whose
    /// prompt pages would hold the same rows; `None` (the default) for a program whose prompt
    /// state is never shared. A waiting request whose key a running one has is admitted onto
    /// that one's prompt pages ([`Family::adopt_prompt`]) instead of computing them again.
    fn share_key(&self, _program: &Self::Program) -> Option<u64> {
        None
    }

    /// Whether `active`'s prompt pages are still being computed: a waiting request with the
    /// same [`Family::share_key`] waits for them rather than computing them too.
    fn prompt_pending(&self, _active: &Active<Self::Program>) -> bool {
        false
    }

    /// Prompts that only begin alike (different [`Family::share_key`]s): the rows of `taker`'s
    /// prompt that `donor`'s pages hold, the whole pages of their longest common prefix before
    /// `taker`'s last index, where `donor`'s prompt is computed and `taker` has run nothing; 0
    /// for none, and for a family that shares whole prompts only (the default). A positive
    /// answer promises that [`Family::adopt_prompt`] shares those rows.
    fn prefix_rows(&self, _donor: &Active<Self::Program>, _taker: &Active<Self::Program>) -> usize {
        0
    }

    /// Makes the newly admitted `taker` read the pages that hold `donor`'s prompt (both have
    /// the same [`Family::share_key`], or [`Family::prefix_rows`] says what they have in common,
    /// and `donor`'s prompt is computed): whole pages only, and
    /// never the page of the prompt's last position (the taker computes that position itself,
    /// its first output). Returns the slots `taker` now reads and holds with `donor` (the
    /// engine counts the new holder) and the rows it skips. Neither program writes those pages
    /// again. All or nothing: an error leaves both as they were.
    fn adopt_prompt(
        &mut self,
        _donor: &mut Active<Self::Program>,
        _taker: &mut Active<Self::Program>,
    ) -> Result<Adopted, FamilyError> {
        Ok(Adopted::default())
    }
}
