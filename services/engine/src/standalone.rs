//! Programs driven through a family's ticks without a scheduler: for golden tests that compare
//! every step with an upstream trace, and for benchmarks of the schemes alone. Each tick grants
//! every program the slots its next step needs (from an unbounded supply: no admission, no
//! preemption), runs the same [`run_tick`] the scheduler runs, and takes back what the
//! programs no longer need; events stay in each program's outbox for the caller to read.

use crate::error::EngineError;
use crate::family::Family;
use crate::ids::{RequestId, SlotId};
use crate::request::Active;
use crate::tick::{run_tick, TickOutcome};

/// A family and the programs it runs, outside any engine.
pub struct Standalone<F: Family> {
    family: F,
    active: Vec<Active<F::Program>>,
    /// Slot ids given back, handed out again first (so page ids stay compact).
    free: Vec<SlotId>,
    next_slot: u32,
    max_rows: Option<usize>,
}

impl<F: Family> Standalone<F> {
    pub fn new(family: F) -> Self {
        Self {
            family,
            active: Vec::new(),
            free: Vec::new(),
            next_slot: 0,
            max_rows: None,
        }
    }

    /// Adds a program; returns its index.
    pub fn add(&mut self, program: F::Program) -> usize {
        let i = self.active.len();
        self.active.push(Active::new(RequestId(i as u64), program));
        i
    }

    pub fn family(&self) -> &F {
        &self.family
    }

    pub fn len(&self) -> usize {
        self.active.len()
    }

    pub fn is_empty(&self) -> bool {
        self.active.is_empty()
    }

    /// Program `i` with its outbox, slots and tick count.
    pub fn active(&self, i: usize) -> &Active<F::Program> {
        &self.active[i]
    }

    pub fn program(&self, i: usize) -> &F::Program {
        &self.active[i].program
    }

    /// Whether program `i` ended (finished or failed).
    pub fn is_done(&self, i: usize) -> bool {
        self.active[i].outbox.is_done()
    }

    /// The family and the programs, in the order they were added, as the last tick left them.
    pub fn into_parts(self) -> (F, Vec<F::Program>) {
        (
            self.family,
            self.active.into_iter().map(|a| a.program).collect(),
        )
    }

    fn grant(&mut self, n: usize) -> Vec<SlotId> {
        (0..n)
            .map(|_| {
                self.free.pop().unwrap_or_else(|| {
                    self.next_slot += 1;
                    SlotId(self.next_slot - 1)
                })
            })
            .collect()
    }

    /// One tick of every program that has not ended: slots granted, plan → run → commit,
    /// slots taken back.
    pub fn tick(&mut self) -> TickOutcome {
        let running: Vec<usize> = (0..self.active.len())
            .filter(|&i| !self.active[i].outbox.is_done())
            .collect();
        for &i in &running {
            let need = self.family.slots_needed(&self.active[i]);
            let held = self.active[i].slots.len();
            if need > held {
                let slots = self.grant(need - held);
                let a = &mut self.active[i];
                a.slots.extend(&slots);
                a.new_slots.extend(slots);
            }
        }
        let mut batch: Vec<&mut Active<F::Program>> = self
            .active
            .iter_mut()
            .filter(|a| !a.outbox.is_done())
            .collect();
        for a in batch.iter_mut() {
            a.ticks += 1;
        }
        let outcome = run_tick(&mut self.family, &mut batch, self.max_rows);
        let mut back = Vec::new();
        for a in batch {
            if a.outbox.is_done() {
                continue;
            }
            let given = self.family.reclaim(a);
            a.slots.retain(|s| !given.contains(s));
            back.extend(given);
        }
        self.free.extend(back);
        outcome
    }

    /// Ticks until every program has ended; fails after `max_ticks`. Returns the ticks each
    /// program ran in.
    pub fn run_until_done(&mut self, max_ticks: usize) -> Result<Vec<u64>, EngineError> {
        for _ in 0..max_ticks {
            if self.active.iter().all(|a| a.outbox.is_done()) {
                return Ok(self.active.iter().map(|a| a.ticks).collect());
            }
            self.tick();
        }
        if self.active.iter().all(|a| a.outbox.is_done()) {
            return Ok(self.active.iter().map(|a| a.ticks).collect());
        }
        Err(EngineError::NotFinished { ticks: max_ticks })
    }
}
