//! The fungible slot pool.
//!
//! A slot is one unit of device memory: for the families with caches, a K/V page (positions
//! of one layer; the slot id is the page id in the family's page pool), also standing for
//! latent states and memories; for masked diffusion, one canvas row's K/V in one layer. Slots
//! are fungible: any free slot serves any request, so a request's state need not be
//! contiguous, and a preempted request resumes in whatever slots are free. The pool only does
//! the bookkeeping; the family that owns the storage indexes it by [`SlotId`].
//!
//! Invariants (property-tested below): a slot is never held twice, a failed
//! allocation takes nothing, and freeing returns exactly what was taken.

use crate::ids::SlotId;

/// Fixed-size pool of fungible slots.
#[derive(Debug, Clone)]
pub struct SlotPool {
    total: usize,
    free: Vec<SlotId>,
    held: Vec<bool>,
}

impl SlotPool {
    /// A pool of `total` slots, all free.
    pub fn new(total: usize) -> Self {
        let total_u32 = u32::try_from(total).expect("slot pool larger than u32::MAX");
        // Pop from the end: lowest ids are handed out first.
        let free = (0..total_u32).rev().map(SlotId).collect();
        Self {
            total,
            free,
            held: vec![false; total],
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn free(&self) -> usize {
        self.free.len()
    }

    pub fn used(&self) -> usize {
        self.total - self.free.len()
    }

    /// Takes `n` slots, or none at all if fewer than `n` are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<SlotId>> {
        if n > self.free.len() {
            return None;
        }
        let taken = self.free.split_off(self.free.len() - n);
        for s in &taken {
            debug_assert!(!self.held[s.0 as usize], "{s} handed out twice");
            self.held[s.0 as usize] = true;
        }
        Some(taken)
    }

    /// Returns slots to the pool.
    ///
    /// # Panics
    /// On a slot that is not currently held: that is a double free, a bug in
    /// the caller that would otherwise let two rows share memory.
    pub fn release(&mut self, slots: impl IntoIterator<Item = SlotId>) {
        for s in slots {
            let idx = s.0 as usize;
            assert!(
                idx < self.total && self.held[idx],
                "release of {s} which is not held"
            );
            self.held[idx] = false;
            self.free.push(s);
        }
    }

    /// Whether `slot` is currently handed out.
    pub fn is_held(&self, slot: SlotId) -> bool {
        self.held.get(slot.0 as usize).copied().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        Release(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..12).prop_map(Op::Alloc),
            (0usize..8).prop_map(Op::Release)
        ]
    }

    proptest! {
        #[test]
        fn never_double_allocates_and_frees_everything(total in 0usize..40, ops in proptest::collection::vec(op(), 0..200)) {
            let mut pool = SlotPool::new(total);
            let mut owners: Vec<Vec<SlotId>> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        let before = pool.free();
                        match pool.alloc(n) {
                            Some(s) => { prop_assert_eq!(s.len(), n); prop_assert_eq!(pool.free(), before - n); owners.push(s); }
                            None => { prop_assert!(n > before); prop_assert_eq!(pool.free(), before); }
                        }
                    }
                    Op::Release(i) => {
                        if !owners.is_empty() {
                            let s = owners.remove(i % owners.len());
                            pool.release(s);
                        }
                    }
                }
                let mut seen = HashSet::new();
                for s in owners.iter().flatten() {
                    prop_assert!(seen.insert(*s), "slot {} held twice", s);
                    prop_assert!(pool.is_held(*s));
                }
                prop_assert_eq!(seen.len() + pool.free(), total);
            }
            for s in owners.drain(..) { pool.release(s); }
            prop_assert_eq!(pool.free(), total);
        }
    }

    #[test]
    #[should_panic(expected = "not held")]
    fn double_free_is_caught() {
        let mut pool = SlotPool::new(2);
        let s = pool.alloc(1).unwrap();
        pool.release(s.clone());
        pool.release(s);
    }
}
