//! Tensor parallelism for the shared block (Megatron-style, Shoeybi et al., 2019): each of
//! `world` ranks holds a slice of every block's weights — a contiguous range of attention heads
//! (q, k, v column-parallel, o row-parallel) and of MLP columns (gate, up column-parallel, down
//! row-parallel) — computes its partial output of each row-parallel layer, and a [`Collective`]
//! sums the partials (all-reduce) before the residual add. Norms, embeddings and the head are
//! replicated. Grouped-query attention splits the kv heads with the query heads; when there are
//! fewer kv heads than ranks, each kv head is replicated on the ranks whose query heads read it.
//!
//! The controller is single: one thread drives every rank's shard and the collective combines
//! their partials, which is how one process drives several GPUs through NCCL group calls
//! ([`NcclCollective`] under the `cuda` feature: rank `r`'s shard, its RoPE rows, masks and
//! key/value caches live on GPU `r`, the replicated residual stream on rank 0's), and how the
//! in-process CPU implementation ([`LocalCollective`]: every rank on the model's device) runs the
//! same code in tests. Results equal the one-rank results up to float summation order (the
//! partials are summed in rank order, so every run of a given world size is deterministic).

use std::fmt::Debug;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{Device, Tensor};

pub(crate) use super::collective::on_rank;
pub use super::collective::Collective;
use crate::error::{ModelError, Result};

#[cfg(feature = "cuda")]
pub use super::nccl::NcclCollective;

/// The in-process implementation: every rank's shard on the same device, partials summed in
/// rank order.
#[derive(Debug, Clone, Copy)]
pub struct LocalCollective {
    world: usize,
}

impl LocalCollective {
    pub fn new(world: usize) -> Self {
        Self { world }
    }
}

impl Collective for LocalCollective {
    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, partials: Vec<Tensor>) -> Result<Tensor> {
        if partials.len() != self.world {
            return Err(ModelError::Shape(format!(
                "all-reduce over {} partials in a world of {}",
                partials.len(),
                self.world
            )));
        }
        let mut it = partials.into_iter();
        let first = it
            .next()
            .ok_or_else(|| ModelError::Shape("all-reduce of nothing".into()))?;
        it.try_fold(first, |acc, p| Ok((acc + p)?))
    }
}

/// Which collective joins a model's tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CollectiveKind {
    /// NCCL with one GPU per rank when the model is on a GPU and split, else in-process.
    #[default]
    Auto,
    /// Every rank in this process on the model's device ([`LocalCollective`]).
    Local,
    /// NCCL, one GPU per rank from the model's GPU on (`cuda` feature); with one rank the sums
    /// still go through the library.
    Nccl,
}

impl CollectiveKind {
    /// Whether `world` ranks of a model on `device` are joined by NCCL.
    pub fn uses_nccl(self, world: usize, device: &Device) -> bool {
        match self {
            Self::Local => false,
            Self::Auto => device.is_cuda() && world > 1,
            Self::Nccl => true,
        }
    }
}

impl std::str::FromStr for CollectiveKind {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "local" => Ok(Self::Local),
            "nccl" => Ok(Self::Nccl),
            _ => Err(ModelError::Config {
                key: "collective".into(),
                reason: format!("must be auto, local or nccl, got {s:?}"),
            }),
        }
    }
}

/// How a model is split across ranks.
#[derive(Debug, Clone)]
pub struct TensorParallel {
    pub world: usize,
    pub comm: Arc<dyn Collective>,
}

impl TensorParallel {
    /// One rank: no split.
    pub fn single() -> Self {
        Self::local(1)
    }

    /// `world` ranks in this process ([`LocalCollective`]).
    pub fn local(world: usize) -> Self {
        Self::with(Arc::new(LocalCollective::new(world.max(1))))
    }

    /// Ranks as `comm` has them.
    pub fn with(comm: Arc<dyn Collective>) -> Self {
        Self {
            world: comm.world(),
            comm,
        }
    }

    /// One rank per device of `devices` (in rank order; rank 0's is the model's device, where
    /// the residual stream, embeddings and head stay) over NCCL.
    #[cfg(feature = "cuda")]
    pub fn nccl(devices: Vec<Device>) -> Result<Self> {
        Ok(Self::with(Arc::new(NcclCollective::new(devices)?)))
    }

    /// `world` ranks for a model on `device` joined by `kind`: NCCL ranks take GPUs
    /// `N, N+1, …` from the model's `cuda:N` (rank 0 is the model's device itself).
    pub fn for_device(kind: CollectiveKind, world: usize, device: &Device) -> Result<Self> {
        let world = world.max(1);
        if !kind.uses_nccl(world, device) {
            return Ok(Self::local(world));
        }
        let candle_core::DeviceLocation::Cuda { gpu_id } = device.location() else {
            return Err(ModelError::Device(format!(
                "the NCCL collective needs the model on a GPU (cuda:N), not {:?}",
                device.location()
            )));
        };
        Self::nccl_from(device, gpu_id, world)
    }

    #[cfg(feature = "cuda")]
    fn nccl_from(device: &Device, gpu_id: usize, world: usize) -> Result<Self> {
        let mut devices = vec![device.clone()];
        for r in 1..world {
            let d = Device::new_cuda(gpu_id + r).map_err(|e| {
                ModelError::Device(format!(
                    "tensor-parallel rank {r} needs cuda:{} ({e}); {world} ranks from cuda:{gpu_id} \
                     need {world} GPUs",
                    gpu_id + r
                ))
            })?;
            crate::gpu_memory::keep_freed_memory(&d)?;
            devices.push(d);
        }
        Self::nccl(devices)
    }

    #[cfg(not(feature = "cuda"))]
    fn nccl_from(_device: &Device, _gpu_id: usize, _world: usize) -> Result<Self> {
        Err(ModelError::Unsupported(
            "the NCCL collective needs a build with the `cuda` feature".into(),
        ))
    }

    pub fn is_single(&self) -> bool {
        self.world == 1
    }
}

/// The query and kv heads of `rank`.
pub(crate) fn head_ranges(
    n_heads: usize,
    n_kv_heads: usize,
    world: usize,
    rank: usize,
) -> Result<(Range<usize>, Range<usize>)> {
    let group = n_heads / n_kv_heads;
    let ok = n_heads.is_multiple_of(world)
        && (n_kv_heads.is_multiple_of(world) || world.is_multiple_of(n_kv_heads));
    if !ok {
        return Err(ModelError::Config {
            key: "tensor_parallel".into(),
            reason: format!(
                "{world} ranks cannot split {n_heads} attention heads with {n_kv_heads} \
                 key/value heads (the ranks must divide the heads, and divide or be a multiple \
                 of the key/value heads)"
            ),
        });
    }
    let per = n_heads / world;
    let q = rank * per..(rank + 1) * per;
    let kv = q.start / group..q.end.div_ceil(group);
    Ok((q, kv))
}

/// Key/value heads the caches hold over all `world` ranks: the model's own when the ranks split
/// them, one per rank when there are fewer of them than ranks (each is replicated on the ranks
/// whose query heads read it). A world that cannot split the heads counts as one rank (loading
/// refuses it).
pub fn cached_kv_heads(n_heads: usize, n_kv_heads: usize, world: usize) -> usize {
    (0..world)
        .map(|rank| head_ranges(n_heads, n_kv_heads, world, rank).map(|(_, kv)| kv.len()))
        .sum::<Result<usize>>()
        .unwrap_or(n_kv_heads)
}

/// The sum of the ranks' partial outputs: the partial itself with one rank (no collective call,
/// no copy).
pub(crate) fn reduce(comm: &dyn Collective, mut partials: Vec<Tensor>) -> Result<Tensor> {
    if partials.len() == 1 && comm.skips_one_rank() {
        return Ok(partials.pop().expect("one partial"));
    }
    comm.all_reduce_sum(partials)
}

/// Indices `range` (in units of `unit`: a head's `head_dim`, or 1) of `t` along `dim`, as its own
/// contiguous tensor: a rank's rows of a column-parallel weight (the output axis) or columns of a
/// row-parallel one (the input axis), of one `[out, in]` weight or of a layer stack
/// `[L, out, in]`. A contiguous slice (the whole range, or rows) is a view, not a copy.
pub(crate) fn slice(t: &Tensor, dim: usize, range: &Range<usize>, unit: usize) -> Result<Tensor> {
    Ok(t.narrow(dim, range.start * unit, range.len() * unit)?
        .contiguous()?)
}

/// The MLP columns of `rank`.
pub(crate) fn column_range(size: usize, world: usize, rank: usize) -> Result<Range<usize>> {
    if !size.is_multiple_of(world) {
        return Err(ModelError::Config {
            key: "tensor_parallel".into(),
            reason: format!("{world} ranks do not divide the MLP width {size}"),
        });
    }
    let per = size / world;
    Ok(rank * per..(rank + 1) * per)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_split_and_kv_heads_replicate_when_fewer_than_ranks() {
        assert_eq!(head_ranges(8, 8, 2, 1).unwrap(), (4..8, 4..8));
        assert_eq!(head_ranges(8, 2, 2, 0).unwrap(), (0..4, 0..1));
        // 4 query heads over 2 kv heads on 4 ranks: each kv head serves two ranks.
        assert_eq!(head_ranges(4, 2, 4, 1).unwrap(), (1..2, 0..1));
        assert_eq!(head_ranges(4, 2, 4, 2).unwrap(), (2..3, 1..2));
        assert!(head_ranges(6, 2, 4, 0).is_err());
        assert_eq!(cached_kv_heads(8, 2, 1), 2);
        assert_eq!(cached_kv_heads(8, 2, 2), 2);
        assert_eq!(cached_kv_heads(8, 2, 4), 4);
        assert_eq!(cached_kv_heads(8, 8, 4), 8);
        assert_eq!(cached_kv_heads(6, 2, 4), 2);
        assert!(column_range(10, 4, 0).is_err());
    }

    #[test]
    fn the_collective_is_chosen_by_name_and_device() {
        let parse = |s: &str| s.parse::<CollectiveKind>();
        assert_eq!(parse("auto").unwrap(), CollectiveKind::Auto);
        assert_eq!(parse("local").unwrap(), CollectiveKind::Local);
        assert_eq!(parse("nccl").unwrap(), CollectiveKind::Nccl);
        assert!(parse("mpi")
            .unwrap_err()
            .to_string()
            .contains("auto, local or nccl"));
        // On the CPU, auto and local are the in-process ranks; NCCL is refused with the reason.
        for kind in [CollectiveKind::Auto, CollectiveKind::Local] {
            let tp = TensorParallel::for_device(kind, 2, &Device::Cpu).unwrap();
            assert_eq!((tp.world, tp.comm.world()), (2, 2));
            assert!(tp.comm.device(1).is_none() && tp.comm.skips_one_rank());
        }
        let err = TensorParallel::for_device(CollectiveKind::Nccl, 1, &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("GPU (cuda:N)"), "{err}");
    }
}
