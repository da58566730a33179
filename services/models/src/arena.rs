//! Arenas of fixed-shape entries, for request state that is not K/V: ARMT's associative
//! memories and in-flight residual streams, SureLock's previous posteriors.
//!
//! An *arena* is one device allocation of `per_arena` entries of one shape and dtype
//! (`[per_arena, ..shape]`). An [`ArenaPool`] holds the arenas of one shape, made as the number
//! of entries in use grows and reused as they come back; the pool never hands memory back while
//! its model is served. A [`Lease`] is one entry handed to a request; it goes back to the pool
//! when it is dropped, so a request that ends, fails, is cancelled, preempted or moved cannot
//! leak one. [`Pooled`] is a tensor that lives in a leased entry while its request runs, or in
//! storage of its own while the request is preempted, moved, or built by a test; it serializes
//! as its values either way.
//!
//! The engine counts these entries in its own unit, slots (see each family's slot plan); an
//! entry's index is the pool's, not an engine entry id.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};

/// Arenas of entries of one shape (see the module doc). Cloning shares the pool.
#[derive(Clone)]
pub struct ArenaPool {
    inner: Arc<Inner>,
}

struct Inner {
    shape: Vec<usize>,
    dtype: DType,
    device: Device,
    per_arena: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    arenas: Vec<Tensor>,
    free: Vec<usize>,
}

impl std::fmt::Debug for ArenaPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaPool")
            .field("shape", &self.inner.shape)
            .field("entries", &self.entries())
            .field("in_use", &self.in_use())
            .finish()
    }
}

impl ArenaPool {
    /// An empty pool of entries `shape` of `dtype` on `device`, made `per_arena` at a time.
    pub fn new(shape: &[usize], dtype: DType, device: &Device, per_arena: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                shape: shape.to_vec(),
                dtype,
                device: device.clone(),
                per_arena: per_arena.max(1),
                state: Mutex::new(State::default()),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every operation under the lock completes or changes nothing.
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The shape of one entry.
    pub fn shape(&self) -> &[usize] {
        &self.inner.shape
    }

    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Slots made.
    pub fn entries(&self) -> usize {
        self.state().arenas.len() * self.inner.per_arena
    }

    /// Bytes of the arenas made so far (kept for the pool's life).
    pub fn allocated_bytes(&self) -> u64 {
        self.state()
            .arenas
            .iter()
            .map(|a| (a.elem_count() * a.dtype().size_in_bytes()) as u64)
            .sum()
    }

    /// Slots held.
    pub fn in_use(&self) -> usize {
        let s = self.state();
        s.arenas.len() * self.inner.per_arena - s.free.len()
    }

    /// A free entry; it holds its last owner's values (write it before reading it). Makes an
    /// arena when none is free.
    pub fn take(&self) -> Result<Lease> {
        let per = self.inner.per_arena;
        let mut s = self.state();
        if s.free.is_empty() {
            let base = s.arenas.len() * per;
            let mut dims = vec![per];
            dims.extend_from_slice(&self.inner.shape);
            let arena = Tensor::zeros(dims, self.inner.dtype, &self.inner.device)?;
            s.arenas.push(arena);
            s.free.extend((base..base + per).rev());
        }
        let index = s.free.pop().expect("a free entry");
        let arena = s.arenas[index / per].clone();
        drop(s);
        Ok(Lease {
            pool: self.clone(),
            index,
            arena,
        })
    }
}

/// One entry of a [`ArenaPool`]; it goes back to the pool when dropped.
pub struct Lease {
    pool: ArenaPool,
    index: usize,
    arena: Tensor,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease({})", self.index)
    }
}

impl Lease {
    /// The entry's index in its pool.
    pub fn index(&self) -> usize {
        self.index
    }

    fn at(&self) -> usize {
        self.index % self.pool.inner.per_arena
    }

    /// The entry's first `rows` entries along its first dimension (the whole entry for a
    /// one-dimensional shape and `rows` equal to it), as a view that sees later writes.
    pub fn view(&self, rows: usize) -> Result<Tensor> {
        let whole = self.arena.narrow(0, self.at(), 1)?.squeeze(0)?;
        match self.pool.shape().first() {
            Some(&n) if rows < n => Ok(whole.narrow(0, 0, rows)?),
            _ => Ok(whole),
        }
    }

    /// Overwrites the entry's first `t.dim(0)` entries with `t` (the entry's shape, or fewer
    /// leading entries), converted to the pool's dtype and device.
    pub fn store(&self, t: &Tensor) -> Result<()> {
        let shape = self.pool.shape();
        let fits = t.rank() == shape.len()
            && t.dims()
                .iter()
                .zip(shape)
                .enumerate()
                .all(
                    |(d, (&got, &room))| {
                        if d == 0 {
                            got <= room
                        } else {
                            got == room
                        }
                    },
                );
        if !fits {
            return Err(ModelError::Shape(format!(
                "a {:?} tensor does not fit an entry of {shape:?}",
                t.dims()
            )));
        }
        let t = t
            .to_device(self.pool.device())?
            .to_dtype(self.pool.dtype())?
            .contiguous()?
            .unsqueeze(0)?;
        // The entry as `[1, ..shape]` (contiguous: a run of the arena), written from its start.
        let lease = self.arena.narrow(0, self.at(), 1)?;
        lease.slice_set(&t, usize::from(t.rank() > 1), 0)?;
        Ok(())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pool.state().free.push(self.index);
    }
}

/// A tensor in a pool entry, or in storage of its own (see the module doc). Clones share the
/// entry. Serializes as its values (`crate::state::tensor`).
#[derive(Clone, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Pooled {
    #[serde(with = "crate::state::tensor")]
    tensor: Tensor,
    #[serde(skip)]
    lease: Option<Arc<Lease>>,
}

impl std::fmt::Debug for Pooled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pooled")
            .field("dims", &self.tensor.dims())
            .field("lease", &self.lease.as_ref().map(|s| s.index))
            .finish()
    }
}

impl From<Tensor> for Pooled {
    fn from(tensor: Tensor) -> Self {
        Self::own(tensor)
    }
}

impl Pooled {
    /// `tensor` in storage of its own.
    pub fn own(tensor: Tensor) -> Self {
        Self {
            tensor,
            lease: None,
        }
    }

    /// A copy of `t` in an entry of `pool` (converted to the pool's dtype and device; `t` may
    /// have fewer leading entries than the entry).
    pub fn new_in(pool: &ArenaPool, t: &Tensor) -> Result<Self> {
        let lease = pool.take()?;
        lease.store(t)?;
        let rows = if t.rank() == 0 { 0 } else { t.dim(0)? };
        Ok(Self {
            tensor: lease.view(rows)?,
            lease: Some(Arc::new(lease)),
        })
    }

    /// A entry of `pool` set to zero.
    pub fn zeros_in(pool: &ArenaPool) -> Result<Self> {
        let zeros = Tensor::zeros(pool.shape(), pool.dtype(), pool.device())?;
        Self::new_in(pool, &zeros)
    }

    /// An entry of `pool` that holds its last owner's values until it is written
    /// ([`Self::set_rows`]).
    pub fn leased_in(pool: &ArenaPool) -> Result<Self> {
        let lease = pool.take()?;
        let rows = pool.shape().first().copied().unwrap_or(0);
        Ok(Self {
            tensor: lease.view(rows)?,
            lease: Some(Arc::new(lease)),
        })
    }

    /// Sets each `(item, row)` to row `row` of `src` `[R, ..shape]`, as [`Self::set`] one by
    /// one would: the rows bound for one arena in one pass
    /// ([`crate::transformer::kv_cache::ScatterRows`]: one launch on a device, not a copy
    /// each).
    pub fn set_rows(items: &mut [(&mut Pooled, usize)], src: &Tensor) -> Result<()> {
        let rows = src.dim(0)?;
        let width = src.elem_count() / rows.max(1);
        // (pool, arena index, arena, each row's entry in it)
        let mut groups: Vec<(ArenaPool, usize, Tensor, Vec<u32>)> = Vec::new();
        for (p, r) in items.iter_mut() {
            let r = *r;
            if r >= rows || p.tensor.dims() != &src.dims()[1..] {
                return Err(ModelError::Shape(format!(
                    "cannot set a {:?} state to row {r} of {:?}",
                    p.tensor.dims(),
                    src.dims()
                )));
            }
            let lease = p.lease.as_ref().filter(|l| {
                l.pool.shape() == p.tensor.dims() && l.arena.device().same_device(src.device())
            });
            let Some(lease) = lease else {
                p.set(src.get(r)?)?;
                continue;
            };
            let a = lease.index / lease.pool.inner.per_arena;
            let at = lease.at() as u32;
            match groups
                .iter_mut()
                .find(|g| Arc::ptr_eq(&g.0.inner, &lease.pool.inner) && g.1 == a)
            {
                Some(g) => g.3[r] = at,
                None => {
                    let mut slots = vec![wavefront_kernels::pages::SKIP_ROW; rows];
                    slots[r] = at;
                    groups.push((lease.pool.clone(), a, lease.arena.clone(), slots));
                }
            }
        }
        let src = src.contiguous()?.reshape((1, rows, width))?;
        for (pool, _, arena, slots) in groups {
            let src = src.to_dtype(pool.dtype())?;
            let dst = arena.reshape((1, pool.inner.per_arena, width))?;
            dst.inplace_op2(&src, &crate::transformer::kv_cache::ScatterRows::new(slots))?;
        }
        Ok(())
    }

    /// The values (a view of the entry when pooled: read it before the entry is written again).
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// Whether it lives in a pool entry.
    pub fn is_pooled(&self) -> bool {
        self.lease.is_some()
    }

    /// Bytes of its values.
    pub fn bytes(&self) -> usize {
        self.tensor.elem_count() * self.tensor.dtype().size_in_bytes()
    }

    /// Replaces the values with `t` of the same shape: in place in the entry when pooled.
    pub fn set(&mut self, t: Tensor) -> Result<()> {
        if t.dims() != self.tensor.dims() {
            return Err(ModelError::Shape(format!(
                "cannot set a {:?} state to {:?}",
                self.tensor.dims(),
                t.dims()
            )));
        }
        match &self.lease {
            Some(lease) => lease.store(&t),
            None => {
                self.tensor = t;
                Ok(())
            }
        }
    }

    /// The same values in storage of their own on `device` (host memory while a request is
    /// preempted): a copy, never a view of the entry, which goes back when `self` is dropped.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self::own(self.tensor.to_device(device)?.copy()?))
    }

    /// Stacks `items` (each of one shape) along a new first dimension: when every item is a
    /// whole entry of one pool, a gather per arena (one gather in the items' order for one
    /// arena), else one concatenation of the items' views.
    pub fn stack(items: &[&Pooled]) -> Result<Tensor> {
        if items.is_empty() {
            return Err(ModelError::Shape("nothing to stack".into()));
        }
        if let Some(t) = Self::stack_by_arena(items)? {
            return Ok(t);
        }
        let views = items
            .iter()
            .map(|p| p.tensor.unsqueeze(0))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&views, 0)?)
    }
}

impl Pooled {
    /// [`Pooled::stack`] of whole entries of one pool in several arenas: a gather per arena,
    /// then one gather into the items' order (`None` when the items are not such entries).
    fn stack_by_arena(items: &[&Pooled]) -> Result<Option<Tensor>> {
        let Some(pool) = items[0].lease.as_ref().map(|l| l.pool.clone()) else {
            return Ok(None);
        };
        let per = pool.inner.per_arena;
        // (arena index, arena, entries in it, items' places in the gathered rows)
        let mut groups: Vec<(usize, Tensor, Vec<u32>)> = Vec::new();
        let mut place = Vec::with_capacity(items.len());
        for p in items {
            let Some(l) = p.lease.as_ref().filter(|l| {
                Arc::ptr_eq(&l.pool.inner, &pool.inner) && l.pool.shape() == p.tensor.dims()
            }) else {
                return Ok(None);
            };
            let a = l.index / per;
            let g = match groups.iter().position(|g| g.0 == a) {
                Some(g) => g,
                None => {
                    groups.push((a, l.arena.clone(), Vec::new()));
                    groups.len() - 1
                }
            };
            groups[g].2.push(l.at() as u32);
            place.push((g, groups[g].2.len() - 1));
        }
        let device = pool.device();
        let mut parts = Vec::with_capacity(groups.len());
        let mut first = Vec::with_capacity(groups.len());
        let mut n = 0u32;
        for (_, arena, at) in &groups {
            first.push(n);
            n += at.len() as u32;
            parts.push(arena.index_select(&Tensor::new(at.as_slice(), device)?, 0)?);
        }
        let gathered = match parts.len() {
            1 => parts.pop().expect("one part"),
            _ => Tensor::cat(&parts, 0)?,
        };
        let order: Vec<u32> = place.iter().map(|&(g, i)| first[g] + i as u32).collect();
        // Items already in arena order (one arena, in particular) need no second gather.
        if order.iter().copied().eq(0..order.len() as u32) {
            return Ok(Some(gathered));
        }
        Ok(Some(gathered.index_select(
            &Tensor::new(order.as_slice(), device)?,
            0,
        )?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Slots come from arenas made as needed and go back when dropped; a stored tensor lands
    /// in place (views see it), a short one fills the leading rows, a host copy is independent,
    /// and stacking gathers from the arenas in the items' order.
    #[test]
    fn entries_are_taken_written_in_place_given_back_and_stacked() -> Result<()> {
        let cpu = Device::Cpu;
        let pool = ArenaPool::new(&[3, 2], DType::F32, &cpu, 4);
        assert_eq!((pool.entries(), pool.in_use()), (0, 0));
        let t = |k: f32| Tensor::arange(k, k + 6.0, &cpu).unwrap().reshape((3, 2));
        let mut a = Pooled::new_in(&pool, &t(0.0)?)?;
        assert!(a.is_pooled());
        assert_eq!((pool.entries(), pool.in_use()), (4, 1));
        let view = a.tensor().clone();
        a.set(t(10.0)?)?;
        assert_eq!(values(&view), values(&t(10.0)?), "written in place");
        assert!(a.set(Tensor::zeros((2, 2), DType::F32, &cpu)?).is_err());
        let host = a.to_device(&cpu)?;
        assert!(!host.is_pooled());
        drop(a);
        assert_eq!(pool.in_use(), 0, "the lease came back");
        let short = Pooled::new_in(&pool, &t(20.0)?.narrow(0, 0, 2)?)?;
        assert_eq!(short.tensor().dims(), &[2, 2]);
        assert_eq!(values(short.tensor()), vec![20.0, 21.0, 22.0, 23.0]);
        assert_eq!(
            values(&host.tensor),
            values(&t(10.0)?),
            "independent of the lease"
        );
        assert!(Pooled::new_in(&pool, &Tensor::zeros((4, 2), DType::F32, &cpu)?).is_err());
        let zero = Pooled::zeros_in(&pool)?;
        assert_eq!(values(zero.tensor()), vec![0.0; 6]);

        // More than an arena: a second one; stacking crosses arenas and own tensors in order.
        let many: Vec<Pooled> = (0..5)
            .map(|k| Pooled::new_in(&pool, &t(100.0 * k as f32)?))
            .collect::<Result<_>>()?;
        assert_eq!((pool.entries(), pool.in_use()), (8, 7));
        let own = Pooled::own(t(7.0)?);
        let items: Vec<&Pooled> = vec![&many[4], &many[0], &many[1], &own, &many[2], &many[3]];
        let stacked = Pooled::stack(&items)?;
        assert_eq!(stacked.dims(), &[6, 3, 2]);
        let expect: Vec<f32> = items.iter().flat_map(|p| values(p.tensor())).collect();
        assert_eq!(values(&stacked), expect);
        drop((many, short, zero));
        assert_eq!(pool.in_use(), 0);
        // Whole entries of one arena, in any order: one gather.
        let one = ArenaPool::new(&[3, 2], DType::F32, &cpu, 8);
        let three: Vec<Pooled> = (0..3)
            .map(|k| Pooled::new_in(&one, &t(10.0 * k as f32)?))
            .collect::<Result<_>>()?;
        let order = [&three[2], &three[0], &three[1]];
        let expect: Vec<f32> = order.iter().flat_map(|p| values(p.tensor())).collect();
        assert_eq!(values(&Pooled::stack(&order)?), expect);
        Ok(())
    }

    #[test]
    fn rows_set_at_once_and_stacked_across_arenas_keep_their_order() -> Result<()> {
        let cpu = Device::Cpu;
        let pool = ArenaPool::new(&[4], DType::F32, &cpu, 2);
        let src = Tensor::arange(0f32, 20.0, &cpu)?.reshape((5, 4))?;
        // Five entries over three arenas, fresh leases and an own tensor, rows in any order.
        let mut items: Vec<Pooled> = (0..4)
            .map(|_| Pooled::leased_in(&pool))
            .collect::<Result<_>>()?;
        items.push(Pooled::own(Tensor::zeros(4, DType::F32, &cpu)?));
        let rows = [3usize, 0, 4, 1, 2];
        let mut pairs: Vec<(&mut Pooled, usize)> = items.iter_mut().zip(rows).collect();
        Pooled::set_rows(&mut pairs, &src)?;
        for (p, r) in items.iter().zip(rows) {
            assert_eq!(values(p.tensor()), values(&src.get(r)?));
        }
        assert!(items[..4].iter().all(Pooled::is_pooled) && !items[4].is_pooled());
        // A gather per arena, then the items' order.
        let order: Vec<&Pooled> = vec![&items[2], &items[0], &items[3], &items[1]];
        let stacked = Pooled::stack(&order)?;
        let expect: Vec<f32> = order.iter().flat_map(|p| values(p.tensor())).collect();
        assert_eq!(values(&stacked), expect);
        // A row past the source, or a row of another shape, is refused.
        let mut bad = [(&mut items[0], 5usize)];
        assert!(Pooled::set_rows(&mut bad, &src).is_err());
        let mut bad = [(&mut items[0], 0usize)];
        assert!(Pooled::set_rows(&mut bad, &src.narrow(1, 0, 3)?).is_err());
        Ok(())
    }

    /// A pooled tensor serializes as its values and comes back as a tensor of its own.
    #[test]
    fn a_pooled_tensor_serializes_as_its_values() -> anyhow::Result<()> {
        let pool = ArenaPool::new(&[4], DType::F32, &Device::Cpu, 2);
        let p = Pooled::new_in(&pool, &Tensor::new(&[1f32, 2.0, 3.0, 4.0], &Device::Cpu)?)?;
        let bytes = postcard::to_allocvec(&p)?;
        let own = Pooled::own(p.tensor().copy()?);
        assert_eq!(bytes, postcard::to_allocvec(&own)?);
        let back: Pooled = postcard::from_bytes(&bytes)?;
        assert!(!back.is_pooled());
        assert_eq!(values(back.tensor()), vec![1.0, 2.0, 3.0, 4.0]);
        Ok(())
    }
}
