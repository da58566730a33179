//! The prefix cache: finished requests kept for the prompt state they leave in their slots.
//!
//! Prompt sharing ([`crate::Family::adopt_prompt`]) lets a request read the prompt pages of a
//! running request with its share key, or with a common prefix ([`crate::Family::prefix_rows`]).
//! A request that has finished would otherwise give those pages back at once, so a later
//! request with the same prompt (a choice whose call arrived after its siblings ended, a retry,
//! a benchmark's repeated prompt) or one that begins alike (a chat's next turn) computes them
//! again. The scheduler instead keeps a finished request whose prompt state can be shared here,
//! holding its slots, and later requests adopt from it as from a running donor. Entries are
//! evicted least recently used first: when the pool has fewer free slots than an admission, a
//! resumption or a running request's growth needs (before any running request is preempted),
//! and when the cache holds more entries than its capacity. An entry's holds are the pool's
//! kept holds ([`crate::SlotPool::keep`]), so the slots only the cache holds, which count as
//! free in the engine's load, are counted in constant time per operation.
//!
//! One entry per key: a finished request whose key an entry already has is not kept (its
//! prompt pages are the entry's, read by it, or the same rows again).

use std::collections::VecDeque;

use crate::request::Active;

/// A finished request kept for its prompt state.
pub(crate) struct Cached<P> {
    pub active: Active<P>,
    pub key: u64,
}

/// Entries in least recently used order (front: the next to go).
pub(crate) struct PrefixCache<P> {
    entries: VecDeque<Cached<P>>,
    capacity: usize,
}

impl<P> PrefixCache<P> {
    /// A cache of at most `capacity` entries (0: nothing is kept).
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            capacity,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity;
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn has(&self, key: u64) -> bool {
        self.entries.iter().any(|c| c.key == key)
    }

    /// Keeps `entry` as the most recently used; returns the entries over capacity, for the
    /// caller to release (oldest first).
    pub fn insert(&mut self, entry: Cached<P>) -> Vec<Cached<P>> {
        self.entries.push_back(entry);
        let over = self.entries.len().saturating_sub(self.capacity);
        self.entries.drain(..over).collect()
    }

    /// Makes the entry with `key` the most recently used; `None` when there is none.
    pub fn touch(&mut self, key: u64) -> Option<()> {
        let i = self.entries.iter().position(|c| c.key == key)?;
        self.touch_at(i);
        Some(())
    }

    /// Makes the entry at `i` (in [`PrefixCache::iter`]'s order) the most recently used.
    pub fn touch_at(&mut self, i: usize) {
        if let Some(entry) = self.entries.remove(i) {
            self.entries.push_back(entry);
        }
    }

    /// The most recently used entry.
    pub fn newest_mut(&mut self) -> Option<&mut Cached<P>> {
        self.entries.back_mut()
    }

    /// The entries, least recently used first.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Cached<P>> + ExactSizeIterator {
        self.entries.iter()
    }

    /// Takes the most recently used entry out (one that failed to donate).
    pub fn pop_newest(&mut self) -> Option<Cached<P>> {
        self.entries.pop_back()
    }

    /// Takes the least recently used entry out.
    pub fn pop_oldest(&mut self) -> Option<Cached<P>> {
        self.entries.pop_front()
    }

    /// Takes every entry out.
    pub fn drain(&mut self) -> Vec<Cached<P>> {
        self.entries.drain(..).collect()
    }
}
