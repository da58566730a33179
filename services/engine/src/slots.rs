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
//! A hold may be *kept*: the prefix cache keeps a finished request's holds
//! ([`SlotPool::keep`]), and the pool counts the slots whose every holder is the cache
//! ([`SlotPool::kept_only`]: free once the cache lets go), in constant time per operation.
//!
//! Invariants (property-tested below): a slot is never handed out twice, a failed
//! allocation takes nothing, a slot is free again exactly when every holder released it, and
//! `kept_only` counts exactly the held slots whose holds are all kept.

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
    /// Holds of each slot that the prefix cache keeps (at most its holders).
    kept: Vec<u32>,
    /// Held slots whose every hold is kept.
    kept_only: usize,
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
            kept: vec![0; total],
            kept_only: 0,
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
            let idx = s.0 as usize;
            assert!(self.holders[idx] > 0, "share of {s} which is not held");
            let was = self.is_kept_only(idx);
            if self.holders[idx] == 1 {
                self.shared += 1;
            }
            self.holders[idx] += 1;
            self.recount(idx, was);
        }
    }

    /// One of each of `slots`' holds now belongs to the prefix cache (a finished request's,
    /// handed over); it gives them up with [`SlotPool::release_kept`].
    ///
    /// # Panics
    /// On a slot with no hold that is not kept already.
    pub fn keep(&mut self, slots: &[SlotId]) {
        for s in slots {
            let idx = s.0 as usize;
            assert!(
                self.kept[idx] < self.holders[idx],
                "keep of {s} which has no hold to keep"
            );
            let was = self.is_kept_only(idx);
            self.kept[idx] += 1;
            self.recount(idx, was);
        }
    }

    /// Gives up one kept hold on each of `slots`, as [`SlotPool::release`] does a hold.
    ///
    /// # Panics
    /// On a slot with no kept hold.
    pub fn release_kept(&mut self, slots: impl IntoIterator<Item = SlotId>) {
        for s in slots {
            let idx = s.0 as usize;
            assert!(
                idx < self.total && self.kept[idx] > 0,
                "release of {s} which is not kept"
            );
            let was = self.is_kept_only(idx);
            self.kept[idx] -= 1;
            self.drop_hold(s);
            self.recount(idx, was);
        }
    }

    /// Held slots whose every hold the prefix cache keeps: free once it lets go of them.
    pub fn kept_only(&self) -> usize {
        self.kept_only
    }

    fn is_kept_only(&self, idx: usize) -> bool {
        self.holders[idx] > 0 && self.holders[idx] == self.kept[idx]
    }

    /// Updates `kept_only` for slot `idx`, which was kept-only before a change iff `was`.
    fn recount(&mut self, idx: usize, was: bool) {
        match (was, self.is_kept_only(idx)) {
            (false, true) => self.kept_only += 1,
            (true, false) => self.kept_only -= 1,
            _ => {}
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
                idx < self.total && self.holders[idx] > self.kept[idx],
                "release of {s} which is not held (or only kept)"
            );
            let was = self.is_kept_only(idx);
            self.drop_hold(s);
            self.recount(idx, was);
        }
    }

    fn drop_hold(&mut self, s: SlotId) {
        let idx = s.0 as usize;
        self.holders[idx] -= 1;
        match self.holders[idx] {
            0 => self.free.push(s),
            1 => self.shared -= 1,
            _ => {}
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
        /// A holder's holds are handed to the prefix cache.
        Keep(usize),
        /// The cache gives up one of its entries.
        ReleaseKept(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..12).prop_map(Op::Alloc),
            (0usize..8).prop_map(Op::Release),
            (0usize..8, 0usize..6).prop_map(|(i, n)| Op::Share(i, n)),
            (0usize..8).prop_map(Op::Keep),
            (0usize..8).prop_map(Op::ReleaseKept)
        ]
    }

    proptest! {
        #[test]
        fn never_double_allocates_and_frees_everything(total in 0usize..40, ops in proptest::collection::vec(op(), 0..200)) {
            let mut pool = SlotPool::new(total);
            let mut owners: Vec<Vec<SlotId>> = Vec::new();
            // Holds the cache keeps, entry by entry.
            let mut kept: Vec<Vec<SlotId>> = Vec::new();
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
                    Op::Keep(i) => {
                        if !owners.is_empty() {
                            let s = owners.remove(i % owners.len());
                            pool.keep(&s);
                            kept.push(s);
                        }
                    }
                    Op::ReleaseKept(i) => {
                        if !kept.is_empty() {
                            let s = kept.remove(i % kept.len());
                            pool.release_kept(s);
                        }
                    }
                }
                // The slots whose every hold is kept.
                let mut kept_holds: std::collections::HashMap<SlotId, u32> = Default::default();
                for s in kept.iter().flatten() {
                    *kept_holds.entry(*s).or_default() += 1;
                }
                let running: HashSet<SlotId> = owners.iter().flatten().copied().collect();
                let kept_only = kept_holds.keys().filter(|s| !running.contains(s)).count();
                prop_assert_eq!(pool.kept_only(), kept_only);
                // Every held slot has as many holders as owners list it; free ones none.
                let mut holders: std::collections::HashMap<SlotId, u32> = Default::default();
                for s in owners.iter().chain(&kept).flatten() {
                    *holders.entry(*s).or_default() += 1;
                    prop_assert!(pool.is_held(*s));
                }
                for o in owners.iter().chain(&kept) {
                    let distinct: HashSet<_> = o.iter().collect();
                    prop_assert_eq!(distinct.len(), o.len(), "a holder lists a slot twice");
                }
                prop_assert_eq!(holders.len() + pool.free(), total);
                prop_assert_eq!(holders.values().filter(|&&h| h > 1).count(), pool.shared());
            }
            for s in owners.drain(..) { pool.release(s); }
            for s in kept.drain(..) { pool.release_kept(s); }
            prop_assert_eq!(pool.free(), total);
            prop_assert_eq!(pool.kept_only(), 0);
        }
    }

    #[test]
    #[should_panic(expected = "not held (or only kept)")]
    fn a_kept_hold_is_not_released_as_a_running_one() {
        let mut pool = SlotPool::new(2);
        let s = pool.alloc(1).unwrap();
        pool.keep(&s);
        pool.release(s);
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
