//! Identifier newtypes shared by the engine and the families.

use std::fmt;

/// Identifies one request for its whole life in a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// One fungible unit of device memory in the [`crate::SlotPool`] (a *slot*): for the families
/// with caches a K/V page, for masked diffusion one buffer row's K/V in one layer; the state that
/// is not K/V (memories, residual streams, posteriors) is counted in slots too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

impl fmt::Display for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot-{}", self.0)
    }
}
