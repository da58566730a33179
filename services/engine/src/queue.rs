//! The bounded admission queue.
//!
//! Requests wait here, in arrival order, until the slot pool can hold them.
//! The queue never grows past its capacity: a push onto a full queue hands
//! the item back so the caller can answer "resource exhausted" at once.
//! Admission is strictly FIFO (no overtaking): a large request at the head is
//! not starved by a stream of small ones behind it.

use std::collections::VecDeque;

#[derive(Debug)]
pub struct AdmissionQueue<T> {
    items: VecDeque<T>,
    capacity: usize,
}

impl<T> AdmissionQueue<T> {
    pub fn new(capacity: usize) -> Self {
        Self {
            items: VecDeque::with_capacity(capacity.min(1024)),
            capacity,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Appends `item`, or returns it when the queue is full.
    pub fn push(&mut self, item: T) -> Result<(), T> {
        self.push_within(item, self.capacity)
    }

    /// Appends `item` unless the queue already holds `limit` items (a limit above the capacity
    /// counts items that start at once, never waiting).
    pub fn push_within(&mut self, item: T, limit: usize) -> Result<(), T> {
        if self.items.len() >= limit {
            return Err(item);
        }
        self.items.push_back(item);
        Ok(())
    }

    /// Pops the head if `fits` accepts it.
    pub fn pop_if(&mut self, fits: impl FnOnce(&T) -> bool) -> Option<T> {
        if self.items.front().is_some_and(fits) {
            self.items.pop_front()
        } else {
            None
        }
    }

    /// The first item `held` does not hold back, removed if `fits` accepts it. `Err(true)`: that
    /// item does not fit (it stays, and so does everything after it); `Err(false)`: every item
    /// is held back (or there is none).
    pub fn pop_first_unheld(
        &mut self,
        held: impl Fn(&T) -> bool,
        fits: impl FnOnce(&T) -> bool,
    ) -> Result<T, bool> {
        let Some(i) = self.items.iter().position(|t| !held(t)) else {
            return Err(false);
        };
        if fits(&self.items[i]) {
            Ok(self.items.remove(i).expect("a position in the queue"))
        } else {
            Err(true)
        }
    }

    /// Removes every item matching `pred` (cancelled or expired while waiting).
    pub fn drain_where(&mut self, mut pred: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut removed = Vec::new();
        let mut kept = VecDeque::with_capacity(self.items.len());
        for it in self.items.drain(..) {
            if pred(&it) {
                removed.push(it);
            } else {
                kept.push_back(it);
            }
        }
        self.items = kept;
        removed
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.items.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_items_keep_their_place_and_the_first_other_one_pops_if_it_fits() {
        let mut q = AdmissionQueue::new(8);
        for x in [1, 2, 30, 4] {
            assert!(q.push(x).is_ok());
        }
        let held = |x: &i32| *x < 3;
        // 1 and 2 are held back; 30 is the first other one and does not fit: nothing pops.
        assert_eq!(q.pop_first_unheld(held, |&x| x < 10), Err(true));
        assert_eq!(q.pop_first_unheld(held, |&x| x < 100), Ok(30));
        assert_eq!(q.pop_first_unheld(held, |_| true), Ok(4));
        assert_eq!(q.pop_first_unheld(held, |_| true), Err(false));
        assert_eq!(q.pop_first_unheld(|_| false, |_| true), Ok(1));
    }

    #[test]
    fn full_queue_hands_the_item_back() {
        let mut q = AdmissionQueue::new(2);
        assert!(q.push(1).is_ok());
        assert!(q.push(2).is_ok());
        assert_eq!(q.push(3), Err(3));
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn admission_is_fifo_without_overtaking() {
        let mut q = AdmissionQueue::new(4);
        for x in [10, 1, 1] {
            q.push(x).unwrap();
        }
        // The head (10) does not fit: nothing behind it is admitted either.
        assert_eq!(q.pop_if(|&x| x <= 5), None);
        assert_eq!(q.pop_if(|&x| x <= 10), Some(10));
        assert_eq!(q.pop_if(|&x| x <= 5), Some(1));
    }

    #[test]
    fn drain_where_keeps_order_of_the_rest() {
        let mut q = AdmissionQueue::new(8);
        for x in 0..6 {
            q.push(x).unwrap();
        }
        assert_eq!(q.drain_where(|x| x % 2 == 0), vec![0, 2, 4]);
        assert_eq!(q.iter().copied().collect::<Vec<_>>(), vec![1, 3, 5]);
    }
}
