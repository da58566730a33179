//! What joins tensor-parallel ranks: a [`Collective`] sums their partial results and says
//! where each rank computes (in process: [`super::LocalCollective`]; over NCCL:
//! `NcclCollective`, `cuda` feature).

use std::fmt::Debug;

use candle_core::{Device, Tensor};

use crate::error::Result;

/// Sums the ranks' partial results, and says where each rank computes.
pub trait Collective: Send + Sync + Debug {
    fn world(&self) -> usize;
    /// All-reduce (sum) of one partial per rank, in rank order, each on its rank's device; the
    /// result is on rank 0's device.
    fn all_reduce_sum(&self, partials: Vec<Tensor>) -> Result<Tensor>;
    /// The device rank `rank`'s shard lives on; `None`: the model's own device.
    fn device(&self, _rank: usize) -> Option<&Device> {
        None
    }
    /// Whether one rank's partial is taken as the sum without calling the collective (true for
    /// the in-process sum; a library collective says false so one rank still runs through it).
    fn skips_one_rank(&self) -> bool {
        true
    }
}

/// `t` on rank `rank`'s device (the tensor itself, no copy, when it is already there).
pub(crate) fn on_rank(comm: &dyn Collective, rank: usize, t: &Tensor) -> Result<Tensor> {
    match comm.device(rank) {
        Some(d) => Ok(t.to_device(d)?),
        None => Ok(t.clone()),
    }
}
