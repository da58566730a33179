//! A request as the engine holds it: built and validated outside ([`Prepared`]), admitted with
//! its slots ([`Active`]), moved between workers ([`Carried`], [`Exported`]).

use crate::event::Outbox;
use crate::ids::{RequestId, SlotId};
use std::time::Instant;

/// A program built and validated outside the engine, waiting for admission.
#[derive(Debug)]
pub struct Prepared<P> {
    pub program: P,
    /// Slots taken at admission: the first tick's needs. A family that reserves the worst case
    /// asks for `max_slots`; one whose programs grow ([`crate::Family::slots_needed`]) asks for less.
    pub slots: usize,
    /// The most slots the request can ever hold: a request whose most exceeds the pool is
    /// refused at submission, since it could never finish.
    pub max_slots: usize,
    /// Slots the request keeps until it ends, whatever its program needs (a worst-case
    /// reservation, `--kv-reserve worst-case`, keeps all of it): [`crate::Family::reclaim`] never
    /// takes it below this ([`Active::keeps`]). 0 for a request reserving as it goes.
    pub floor: usize,
    pub prompt_tokens: usize,
    /// A request that arrived from another worker ([`Carried`]): its program is in the state a
    /// preemption leaves, and it resumes ([`crate::Family::resume`]) instead of starting.
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
    /// The program's bytes ([`crate::Family::export`]).
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
    /// Request `id` running `program`, admitted now, holding no slots yet.
    pub fn new(id: RequestId, program: P) -> Self {
        Self {
            id,
            program,
            slots: Vec::new(),
            new_slots: Vec::new(),
            outbox: Outbox::default(),
            admitted_at: Instant::now(),
            ticks: 0,
            seq: 0,
            floor: 0,
        }
    }

    /// The slots a request whose program needs `need` keeps after a tick: never fewer than its
    /// floor (what [`crate::Family::reclaim`] implementations give back is what it holds beyond this).
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
