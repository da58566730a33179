//! The fungible slot pool.
//!
//! A slot is one unit of device memory: for the families with caches, a K/V page (positions
//! of one layer; the slot id is the page id in the family's page pool), also standing for
//! latent states and memories; for masked diffusion, one canvas row's K/V in one layer. Slots
//! are fungible: any free slot serves any request, so a request's state need not be
//! contiguous, and a preempted request resumes in whatever slots are free. The pool only does
//! the bookkeeping; the family that owns the storage indexes it by [`SlotId`].
//!
//! A slot may be *shared*: requests whose prompts are the same read the same prompt pages
//! ([`SlotPool::share`]); the pool counts its holders and frees it when the last one releases
//! it. Only the family knows that a shared slot is never written again.
//!
//! Invariants (property-tested below): a slot is never handed out twice, a failed
//! allocation takes nothing, and a slot is free again exactly when every holder released it.

use crate::ids::SlotId;

/// Fixed-size pool of fungible slots.
#[derive(Debug, Clone)]
pub struct SlotPool {
    total: usize,
    free: Vec<SlotId>,
    /// Holders of each slot (0: free).
    holders: Vec<u32>,
    /// Slots held by more than one request now.
    shared: usize,
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
            holders: vec![0; total],
            shared: 0,
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
            debug_assert!(self.holders[s.0 as usize] == 0, "{s} handed out twice");
            self.holders[s.0 as usize] = 1;
        }
        Some(taken)
    }

    /// One more holder for each of `slots`, which are held now: a request that reads another's
    /// prompt pages. Each holder releases it once.
    ///
    /// # Panics
    /// On a slot that is not held: sharing a free slot would let it be handed out while read.
    pub fn share(&mut self, slots: &[SlotId]) {
        for s in slots {
            let h = &mut self.holders[s.0 as usize];
            assert!(*h > 0, "share of {s} which is not held");
            if *h == 1 {
                self.shared += 1;
            }
            *h += 1;
        }
    }

    /// Slots held by more than one request now.
    pub fn shared(&self) -> usize {
        self.shared
    }

    /// Gives up one holder's hold on each slot; a slot whose last holder released it is free.
    ///
    /// # Panics
    /// On a slot that is not currently held: that is a double free, a bug in
    /// the caller that would otherwise let two rows share memory.
    pub fn release(&mut self, slots: impl IntoIterator<Item = SlotId>) {
        for s in slots {
            let idx = s.0 as usize;
            assert!(
                idx < self.total && self.holders[idx] > 0,
                "release of {s} which is not held"
            );
            self.holders[idx] -= 1;
            match self.holders[idx] {
                0 => self.free.push(s),
                1 => self.shared -= 1,
                _ => {}
            }
        }
    }

    /// Whether `slot` is currently handed out.
    pub fn is_held(&self, slot: SlotId) -> bool {
        self.holders.get(slot.0 as usize).is_some_and(|&h| h > 0)
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
        /// A new holder takes the first `n` slots of an existing holder's.
        Share(usize, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..12).prop_map(Op::Alloc),
            (0usize..8).prop_map(Op::Release),
            (0usize..8, 0usize..6).prop_map(|(i, n)| Op::Share(i, n))
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
                    Op::Share(i, n) => {
                        if !owners.is_empty() {
                            let from = &owners[i % owners.len()];
                            let taken: Vec<SlotId> = from.iter().copied().take(n).collect();
                            let before = pool.free();
                            pool.share(&taken);
                            prop_assert_eq!(pool.free(), before);
                            owners.push(taken);
                        }
                    }
                }
                // Every held slot has as many holders as owners list it; free ones none.
                let mut holders: std::collections::HashMap<SlotId, u32> = Default::default();
                for s in owners.iter().flatten() {
                    *holders.entry(*s).or_default() += 1;
                    prop_assert!(pool.is_held(*s));
                }
                for o in &owners {
                    let distinct: HashSet<_> = o.iter().collect();
                    prop_assert_eq!(distinct.len(), o.len(), "a holder lists a slot twice");
                }
                prop_assert_eq!(holders.len() + pool.free(), total);
                prop_assert_eq!(holders.values().filter(|&&h| h > 1).count(), pool.shared());
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
