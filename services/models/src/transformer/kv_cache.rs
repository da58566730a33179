//! One sequence's keys and values per layer, in pages.
//!
//! A *page* holds the keys and values of [`KvPool::page_size`] consecutive buffer indices of one
//! layer: two `[n_kv_heads, page_size, head_dim]` tensors. A [`KvCache`] is a page table per
//! layer (page ids in buffer order) over a [`KvPool`]: a call's new rows are written in place
//! into the pages that hold their indices, and attention reads the pages where they are
//! ([`KvCache::layer_runs`]: one run of keys per page, which the CPU kernel reads in place).
//! Nothing is concatenated or copied as the sequence grows.
//!
//! Two kinds of pool:
//! - a *shared* pool ([`KvPool::shared`]), one per model, owned by its family on the engine
//!   thread. Its page ids are the engine's slot ids: the scheduler hands a request slots
//!   ([`KvCache::grant`]) as its next step needs them, and the cache takes pages only from what it
//!   was granted (running out is an error value, never an allocation past the budget). A
//!   request that is preempted moves its pages to host memory ([`KvCache::swap_out`]) and gets
//!   them back, at any free ids, when it resumes ([`KvCache::swap_in`]);
//! - a *private* pool, one per [`KvCache::new`]: pages made as the cache grows, for caches
//!   that live within one tick (a ReFusion slot's scratch copy), tests and tools.
//!
//! A page's storage is made on first use and kept for the next owner of its id, so a pool's
//! memory is the most pages it ever held at once, never more than the budget it was sized for.
//! Pages are kept per row shape (`[H, ·, D]` and dtype): a model whose layers cache K/V of
//! different shapes (DiffusionGemma's sliding and full-attention layers) has one set of arenas
//! per shape, each bounded by the budget, and a page id holds its rows in the set of the shape
//! it was written with.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor};
use wavefront_kernels::pages::{ScatterDims, SKIP_ROW};

use crate::error::{ModelError, Result};
use crate::state::Saved;

/// Buffer indices a page holds, unless a pool says otherwise.
pub const PAGE_SIZE: usize = 16;

/// Pages an arena of a shared pool holds.
const ARENA_PAGES: usize = 256;

/// The storage of consecutive page ids on one device: keys and values
/// `[H, pages · page_size, D]`, the page `first + k` at rows `k · page_size ..`. A shared pool's
/// arenas hold [`ARENA_PAGES`] pages each (made once, reused for the model's life); a private
/// pool's double, 1, 2, 4, ... pages (a cache that lives within a tick takes what it writes).
/// Consecutive pages are adjacent within each head, so a cache whose pages are consecutive
/// ids (the common case: the engine hands out slots in order) reads them as one run, as fast
/// as one buffer.
#[derive(Debug, Clone)]
struct Arena {
    k: Tensor,
    v: Tensor,
}

/// The shape of a page's rows: heads, head width and dtype.
type RowShape = (usize, usize, candle_core::DType);

#[derive(Debug, Default)]
struct PoolState {
    /// Per device and row shape (`[H, ·, D]`, dtype), its arenas by index
    /// ([`KvPool::locate`]), made on first use.
    devices: Vec<(Device, RowShape, Vec<Option<Arena>>)>,
    /// Per page id, the set (index into `devices`) whose arena holds its rows, once written.
    written: Vec<Option<u8>>,
    /// Private pools: ids made so far.
    made: u32,
}

#[derive(Debug)]
struct PoolInner {
    page_size: usize,
    /// Whether page ids are granted from outside (the engine's slots) rather than made here.
    shared: bool,
    /// The dtype host-memory pages store K/V rows in, whatever the rows' own (`None`: theirs).
    kv_dtype: Option<DType>,
    state: Mutex<PoolState>,
}

/// Storage of K/V pages addressed by page id (see the module doc).
#[derive(Debug, Clone)]
pub struct KvPool {
    inner: Arc<PoolInner>,
}

impl KvPool {
    /// Bytes of the arenas made so far, on every device: the pool's high-water mark (an arena
    /// is made when a page in it is first written and kept for the pool's life).
    pub fn allocated_bytes(&self) -> u64 {
        let st = self.state();
        st.devices
            .iter()
            .flat_map(|(_, _, arenas)| arenas.iter().flatten())
            .map(|a| (a.k.elem_count() * a.k.dtype().size_in_bytes()) as u64 * 2)
            .sum()
    }

    /// A model's pool, whose page ids are granted by the engine (its slot ids).
    pub fn shared(page_size: usize) -> Self {
        Self::make(page_size, true, None)
    }

    /// [`Self::shared`] whose pages in host memory store K/V rows as `kv_dtype` (float32 or
    /// bf16: `--kv-cache-dtype`), converting the rows written (`None`: as they come).
    pub fn shared_storing(page_size: usize, kv_dtype: Option<DType>) -> Self {
        Self::make(page_size, true, kv_dtype)
    }

    pub(crate) fn private(page_size: usize) -> Self {
        Self::make(page_size, false, None)
    }

    /// A private pool (pages made as a cache grows: tools and tests) storing K/V rows as
    /// `kv_dtype` in host memory.
    pub fn private_storing(page_size: usize, kv_dtype: Option<DType>) -> Self {
        Self::make(page_size, false, kv_dtype)
    }

    /// A private pool storing K/V rows as `like` does.
    pub(crate) fn private_like(like: &KvPool) -> Self {
        Self::make(like.page_size(), false, like.kv_dtype())
    }

    fn make(page_size: usize, shared: bool, kv_dtype: Option<DType>) -> Self {
        assert!(page_size > 0, "a page holds at least one index");
        Self {
            inner: Arc::new(PoolInner {
                page_size,
                shared,
                kv_dtype,
                state: Mutex::new(PoolState::default()),
            }),
        }
    }

    /// The dtype pages in host memory store K/V rows in (`None`: the rows' own).
    pub fn kv_dtype(&self) -> Option<DType> {
        self.inner.kv_dtype
    }

    /// The dtype rows like `like` are stored in: the pool's in host memory, else their own.
    fn stored_dtype(&self, like: &Tensor) -> DType {
        match self.inner.kv_dtype {
            Some(dt) if like.device().is_cpu() => dt,
            _ => like.dtype(),
        }
    }

    /// Buffer indices a page holds.
    pub fn page_size(&self) -> usize {
        self.inner.page_size
    }

    /// Whether `other` is this pool (clones of one pool are the same pool).
    pub(crate) fn same_as(&self, other: &KvPool) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether this is a model's shared pool.
    pub fn is_shared(&self) -> bool {
        self.inner.shared
    }

    fn state(&self) -> MutexGuard<'_, PoolState> {
        // Every operation under the lock completes or changes nothing: a panic leaves it
        // consistent.
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The arena of page `id`: its index, its first page id and its pages.
    fn locate(&self, id: u32) -> (usize, usize, usize) {
        let id = id as usize;
        if self.inner.shared {
            let a = id / ARENA_PAGES;
            (a, a * ARENA_PAGES, ARENA_PAGES)
        } else {
            // Arena a holds ids 2^a - 1 .. 2^(a+1) - 1.
            let a = (usize::BITS - 1 - (id + 1).leading_zeros()) as usize;
            (a, (1 << a) - 1, 1 << a)
        }
    }

    /// A fresh id of a private pool.
    fn make_id(&self) -> u32 {
        let mut st = self.state();
        st.made += 1;
        st.made - 1
    }

    /// The arena holding page `id` for rows like `like` (`[H, n, D]`, on its device), made on
    /// first use, and the page's first row in it; the page counts as written.
    fn arena_for_write(&self, id: u32, like: &Tensor) -> Result<(Arena, usize)> {
        let p = self.inner.page_size;
        let (a, first, pages) = self.locate(id);
        let slot = id as usize - first;
        let dtype = self.stored_dtype(like);
        let mut st = self.state();
        let row: RowShape = (like.dim(0)?, like.dim(2)?, dtype);
        let d = match st
            .devices
            .iter()
            .position(|(dev, shape, _)| dev.same_device(like.device()) && *shape == row)
        {
            Some(d) => d,
            None => {
                st.devices.push((like.device().clone(), row, Vec::new()));
                st.devices.len() - 1
            }
        };
        let arenas = &mut st.devices[d].2;
        if arenas.len() <= a {
            arenas.resize(a + 1, None);
        }
        let shape = (like.dim(0)?, pages * p, like.dim(2)?);
        let arena = match &arenas[a] {
            Some(arena) => {
                if arena.k.dims3()? != shape || arena.k.dtype() != dtype {
                    return Err(ModelError::Cache(format!(
                        "page {id} takes [{}, {p}, {}] {:?} rows; its pool holds {:?} {:?}",
                        shape.0,
                        shape.2,
                        dtype,
                        arena.k.dims(),
                        arena.k.dtype()
                    )));
                }
                arena.clone()
            }
            None => {
                let arena = Arena {
                    k: Tensor::zeros(shape, dtype, like.device())?,
                    v: Tensor::zeros(shape, dtype, like.device())?,
                };
                arenas[a] = Some(arena.clone());
                arena
            }
        };
        if st.written.len() <= id as usize {
            st.written.resize(id as usize + 1, None);
        }
        st.written[id as usize] = Some(u8::try_from(d).expect("fewer than 256 arena sets"));
        Ok((arena, slot * p))
    }

    /// [`Self::arena_for_read`] of every page of `ids`, under one lock.
    fn arenas_for_read(&self, ids: impl Iterator<Item = u32>) -> Result<Vec<(Arena, usize, u8)>> {
        let st = self.state();
        ids.map(|id| self.read_locked(&st, id)).collect()
    }

    /// The arena holding page `id`, which must have been written, and its first row in it.
    fn arena_for_read(&self, id: u32) -> Result<(Arena, usize, u8)> {
        let st = self.state();
        self.read_locked(&st, id)
    }

    fn read_locked(&self, st: &PoolState, id: u32) -> Result<(Arena, usize, u8)> {
        let (a, first, _) = self.locate(id);
        let never = || ModelError::Cache(format!("page {id} was never written"));
        let d = st
            .written
            .get(id as usize)
            .copied()
            .flatten()
            .ok_or_else(never)?;
        let arena = st.devices[d as usize].2[a].clone().ok_or_else(never)?;
        Ok((arena, (id as usize - first) * self.inner.page_size, d))
    }
}

/// The pages one cache may write: a pool, and (shared pool) the page ids granted to the cache
/// and not in use. Shared by every paged cache ([`KvCache`], Huginn's per-recurrence cache).
#[derive(Debug)]
pub(crate) struct PageSupply {
    pool: KvPool,
    spare: Vec<u32>,
    /// Bytes of one page (both tensors), once a page was written.
    page_bytes: usize,
}

impl PageSupply {
    pub(crate) fn new(pool: KvPool) -> Self {
        Self {
            pool,
            spare: Vec::new(),
            page_bytes: 0,
        }
    }

    pub(crate) fn pool(&self) -> &KvPool {
        &self.pool
    }

    pub(crate) fn page_size(&self) -> usize {
        self.pool.page_size()
    }

    pub(crate) fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Granted pages not in use.
    pub(crate) fn spare(&self) -> usize {
        self.spare.len()
    }

    pub(crate) fn grant(&mut self, pages: impl IntoIterator<Item = u32>) {
        self.spare.extend(pages);
    }

    /// A page for new indices: a spare one, or (private pool) a new one. `used` is the pages
    /// the cache holds, for the message when a shared pool's grant is spent.
    pub(crate) fn take(&mut self, used: usize) -> Result<u32> {
        if let Some(id) = self.spare.pop() {
            return Ok(id);
        }
        if self.pool.is_shared() {
            return Err(ModelError::Cache(format!(
                "out of K/V pages: the cache holds {used} and was granted no more"
            )));
        }
        Ok(self.pool.make_id())
    }

    /// Gives pages back to the spare ones (the cache keeps them for its next indices).
    pub(crate) fn give(&mut self, pages: impl IntoIterator<Item = u32>) {
        self.spare.extend(pages);
    }

    /// Gives up to `n` spare pages back (ids the engine takes back).
    pub(crate) fn release_spare(&mut self, n: usize) -> Vec<u32> {
        let keep = self.spare.len().saturating_sub(n);
        self.spare.split_off(keep)
    }

    /// Forgets the spare pages (the engine takes every slot of a preempted request back).
    pub(crate) fn drop_spare(&mut self) {
        self.spare.clear();
    }

    /// The arena page `id`'s rows go to (made on first use) for rows like `like`: its index,
    /// the arena, and the page's first row in it. Keeps the largest page written (layers may
    /// cache rows of different shapes).
    fn arena_for_write(&mut self, id: u32, like: &Tensor) -> Result<(usize, Arena, usize)> {
        let (arena, base) = self.pool.arena_for_write(id, like)?;
        let (h, _, d) = like.dims3()?;
        let bytes = 2 * h * self.page_size() * d * arena.k.dtype().size_in_bytes();
        self.page_bytes = self.page_bytes.max(bytes);
        Ok((self.pool.locate(id).0, arena, base))
    }

    /// Writes `k`/`v` `[H, n, D]` at indices `off..off + n` of page `id`. They may be views
    /// (a sequence's rows of a packed call's `[H, N, D]`): in host memory they are copied row by
    /// row from where they lie, elsewhere made contiguous first.
    pub(crate) fn write(&mut self, id: u32, off: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let (_, arena, base) = self.arena_for_write(id, k)?;
        for (dst, src) in [(&arena.k, k), (&arena.v, v)] {
            if src.device().is_cpu() && dst.device().is_cpu() {
                // Float32 rows into a bf16 page are rounded to nearest even as they are copied.
                dst.inplace_op2(src, &ScatterRows::run(base + off, src.dim(1)?))?;
            } else {
                dst.slice_set(&src.contiguous()?.to_dtype(dst.dtype())?, 1, base + off)?;
            }
        }
        Ok(())
    }

    /// Indices `off..off + n` of page `id`, in place.
    pub(crate) fn view(&self, id: u32, off: usize, n: usize) -> Result<(Tensor, Tensor)> {
        let (arena, base, _) = self.pool.arena_for_read(id)?;
        Ok((
            arena.k.narrow(1, base + off, n)?,
            arena.v.narrow(1, base + off, n)?,
        ))
    }

    /// The keys and values of `(page id, first index, indices)` pieces in order, read in place
    /// as runs: pieces that continue each other in one arena (a page read to its end, then the
    /// next id from its start) are one run.
    pub(crate) fn views(&self, pieces: &[(u32, usize, usize)]) -> Result<Vec<(Tensor, Tensor)>> {
        let p = self.page_size();
        let mut runs: Vec<(Arena, usize, usize, u32, u8)> = Vec::with_capacity(pieces.len());
        let located = self
            .pool
            .arenas_for_read(pieces.iter().map(|piece| piece.0))?;
        for (&(id, off, n), (arena, base, dev)) in pieces.iter().zip(located) {
            if let Some(last) = runs.last_mut() {
                let (_, start, len, last_id, last_dev) = last;
                let continues = id == *last_id + 1
                    && self.pool.locate(id).0 == self.pool.locate(*last_id).0
                    && dev == *last_dev
                    && off == 0
                    && (*start + *len).is_multiple_of(p);
                if continues {
                    *len += n;
                    *last_id = id;
                    continue;
                }
            }
            runs.push((arena, base + off, n, id, dev));
        }
        runs.into_iter()
            .map(|(a, start, n, _, _)| Ok((a.k.narrow(1, start, n)?, a.v.narrow(1, start, n)?)))
            .collect()
    }

    /// A host-memory copy of page `id` (its rows go to the page's next owner).
    pub(crate) fn copy_out(&self, id: u32) -> Result<HostPage> {
        let (k, v) = self.view(id, 0, self.page_size())?;
        let host = |t: &Tensor| -> Result<Tensor> {
            // A fresh buffer, never a view of the arena.
            let out = Tensor::zeros(t.dims3()?, t.dtype(), &Device::Cpu)?;
            out.slice_set(&t.to_device(&Device::Cpu)?.contiguous()?, 1, 0)?;
            Ok(out)
        };
        Ok(HostPage {
            device: k.device().clone(),
            k: host(&k)?,
            v: host(&v)?,
        })
    }

    /// Takes a page and fills it with `host`; returns its id.
    pub(crate) fn copy_in(&mut self, host: &HostPage, used: usize) -> Result<u32> {
        if let Some(dt) = self.pool.kv_dtype() {
            if host.k.dtype() != dt && host.device.is_cpu() {
                return Err(ModelError::Cache(format!(
                    "the cache's pages hold {:?} K/V rows and this pool stores {dt:?} \
                     (--kv-cache-dtype): a request moves only between workers that store K/V \
                     alike",
                    host.k.dtype()
                )));
            }
        }
        let id = self.take(used)?;
        let k = host.k.to_device(&host.device)?;
        let v = host.v.to_device(&host.device)?;
        self.write(id, 0, &k, &v)?;
        Ok(id)
    }
}

/// Row `r` of `src` `[H, n, D]` (any head and row strides, a row's values consecutive) into
/// row `slots[r]` of a contiguous `[H, T, D]`, in place; a slot of [`SKIP_ROW`] leaves its row
/// out. On a device one launch ([`wavefront_kernels::cuda::Kernels::scatter_rows`]); in host
/// memory row by row from where the rows lie, never gathered first (the kernels' reference;
/// float32 rows into a bf16 page are rounded to nearest even as they are copied).
pub(crate) struct ScatterRows {
    slots: Vec<u32>,
}

impl ScatterRows {
    pub(crate) fn new(slots: Vec<u32>) -> Self {
        Self { slots }
    }

    /// Rows `at..at + n` in order (a page write).
    fn run(at: usize, n: usize) -> Self {
        Self::new((at as u32..(at + n) as u32).collect())
    }

    fn dims(
        &self,
        dl: &candle_core::Layout,
        sl: &candle_core::Layout,
    ) -> candle_core::Result<ScatterDims> {
        let (h, t, d) = dl.shape().dims3()?;
        let (sh, n, sd) = sl.shape().dims3()?;
        let ss = sl.stride();
        if !dl.is_contiguous()
            || sh != h
            || sd != d
            || n != self.slots.len()
            || (d > 1 && ss[2] != 1)
        {
            candle_core::bail!(
                "scatter-rows: [{sh}, {n}, {sd}] (strides {ss:?}) with {} slots into [{h}, {t}, {d}]",
                self.slots.len()
            );
        }
        Ok(ScatterDims {
            heads: h,
            n,
            head_dim: d,
            dst_rows: t,
            src_head_stride: ss[0],
            src_row_stride: ss[1],
        })
    }

    fn copy<T: Copy>(
        &self,
        dst: &mut [T],
        dl: &candle_core::Layout,
        src: &[T],
        sl: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let dims = self.dims(dl, sl)?;
        let (d0, s0) = (dl.start_offset(), sl.start_offset());
        let t = dims.heads * dims.dst_rows * dims.head_dim;
        wavefront_kernels::pages::scatter_rows(&mut dst[d0..d0 + t], &src[s0..], &dims, &self.slots)
            .map_err(|e| candle_core::Error::Msg(format!("scatter-rows: {e}")))
    }

    /// [`Self::copy`] of float32 rows into a bf16 page, each value rounded to nearest even.
    fn convert(
        &self,
        dst: &mut [half::bf16],
        dl: &candle_core::Layout,
        src: &[f32],
        sl: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let dims = self.dims(dl, sl)?;
        let (dst, src) = (&mut dst[dl.start_offset()..], &src[sl.start_offset()..]);
        dims.check(dst.len(), src.len(), &self.slots)
            .map_err(|e| candle_core::Error::Msg(format!("scatter-rows: {e}")))?;
        let d = dims.head_dim;
        for h in 0..dims.heads {
            for (r, &slot) in self.slots.iter().enumerate() {
                if slot == SKIP_ROW {
                    continue;
                }
                let to = (h * dims.dst_rows + slot as usize) * d;
                let from = h * dims.src_head_stride + r * dims.src_row_stride;
                // SAFETY: `half::bf16` is a `repr(transparent)` u16.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(dst[to..to + d].as_mut_ptr().cast::<u16>(), d)
                };
                wavefront_kernels::cpu::round_to_bf16(&src[from..from + d], out);
            }
        }
        Ok(())
    }
}

impl candle_core::InplaceOp2 for ScatterRows {
    fn name(&self) -> &'static str {
        "scatter-rows"
    }

    fn cpu_fwd(
        &self,
        dst: &mut candle_core::CpuStorage,
        dl: &candle_core::Layout,
        src: &candle_core::CpuStorage,
        sl: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::CpuStorage as S;
        match (dst, src) {
            (S::F32(d), S::F32(s)) => self.copy(d, dl, s, sl),
            (S::BF16(d), S::BF16(s)) => self.copy(d, dl, s, sl),
            (S::F16(d), S::F16(s)) => self.copy(d, dl, s, sl),
            (S::BF16(d), S::F32(s)) => self.convert(d, dl, s, sl),
            (d, s) => candle_core::bail!(
                "scatter-rows: {:?} rows into a {:?} page",
                candle_core::backend::BackendStorage::dtype(s),
                candle_core::backend::BackendStorage::dtype(d)
            ),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &candle_core::Layout,
        src: &candle_core::CudaStorage,
        sl: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::backend::BackendStorage;
        let dims = self.dims(dl, sl)?;
        match (dst.dtype(), src.dtype()) {
            (DType::F32, DType::F32) => scatter_cuda::<f32>(dst, dl, src, sl, &dims, &self.slots),
            (DType::BF16, DType::BF16) => {
                scatter_cuda::<half::bf16>(dst, dl, src, sl, &dims, &self.slots)
            }
            (d, s) => candle_core::bail!("scatter-rows: {s:?} rows into a {d:?} page on the GPU"),
        }
    }
}

#[cfg(feature = "cuda")]
fn scatter_cuda<T: wavefront_kernels::cuda::Elem + candle_core::cuda_backend::CudaDType>(
    dst: &mut candle_core::CudaStorage,
    dl: &candle_core::Layout,
    src: &candle_core::CudaStorage,
    sl: &candle_core::Layout,
    dims: &ScatterDims,
    slots: &[u32],
) -> candle_core::Result<()> {
    use candle_core::backend::BackendStorage;
    let msg =
        |e: wavefront_kernels::KernelError| candle_core::Error::Msg(format!("scatter-rows: {e}"));
    let kernels = super::ragged::cuda_kernels(dst.device())?;
    let (d0, d1) = (
        dl.start_offset(),
        dl.start_offset() + dims.heads * dims.dst_rows * dims.head_dim,
    );
    let src_view = src.as_cuda_slice::<T>()?.slice(sl.start_offset()..);
    let mut dst_view = dst.as_cuda_slice_mut::<T>()?.slice_mut(d0..d1);
    kernels
        .scatter_rows(&mut dst_view, &src_view, dims, slots)
        .map_err(msg)
}

/// A request's cache in pages, as the engine's families hand it slots and move it: a
/// [`KvCache`] or a Huginn cache.
pub trait PagedCache {
    /// The pool the cache's pages come from.
    fn pool(&self) -> &KvPool;
    /// Whether it holds no position.
    fn is_empty(&self) -> bool;
    /// Whether its pages are in host memory.
    fn is_swapped(&self) -> bool;
    /// Gives it pages (slot ids of the engine) to take as it grows.
    fn grant_pages(&mut self, pages: Vec<u32>);
    /// Moves every page to host memory and gives up every page id; the bytes moved.
    fn swap_out(&mut self) -> Result<usize>;
    /// Moves the pages back into granted pages (any ids); the bytes moved.
    fn swap_in(&mut self) -> Result<usize>;
    /// Gives up to `n` granted pages it does not use back, for the engine to take.
    fn release_spare(&mut self, n: usize) -> Vec<u32>;
    /// An empty cache like this one (same lookup rules) over `pool`.
    fn empty_in(&self, pool: KvPool) -> Self
    where
        Self: Sized;
    /// Moves a swapped-out cache that arrived from another worker (in a private pool) into
    /// `pool`, whose granted pages it swaps into.
    fn adopt(&mut self, pool: KvPool);
}

impl PagedCache for KvCache {
    fn pool(&self) -> &KvPool {
        KvCache::pool(self)
    }
    fn is_empty(&self) -> bool {
        KvCache::is_empty(self)
    }
    fn is_swapped(&self) -> bool {
        KvCache::is_swapped(self)
    }
    fn grant_pages(&mut self, pages: Vec<u32>) {
        self.grant(pages);
    }
    fn swap_out(&mut self) -> Result<usize> {
        KvCache::swap_out(self)
    }
    fn swap_in(&mut self) -> Result<usize> {
        KvCache::swap_in(self)
    }
    fn release_spare(&mut self, n: usize) -> Vec<u32> {
        self.supply.release_spare(n)
    }
    fn empty_in(&self, pool: KvPool) -> Self {
        KvCache::in_pool(pool)
    }
    fn adopt(&mut self, pool: KvPool) {
        self.supply = PageSupply::new(pool);
    }
}

/// A page copied to host memory, with the device it came from.
#[derive(Debug, Clone)]
pub(crate) struct HostPage {
    device: Device,
    k: Tensor,
    v: Tensor,
}

impl HostPage {
    pub(crate) fn bytes(&self) -> usize {
        2 * self.k.elem_count() * self.k.dtype().size_in_bytes()
    }
}

/// A host page's serde form: its keys and values; an imported page goes back to the device
/// given to [`crate::state::with_target`].
impl serde::Serialize for HostPage {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        (Saved(self.k.clone()), Saved(self.v.clone())).serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for HostPage {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let (k, v) = <(Saved, Saved)>::deserialize(d)?;
        Ok(HostPage {
            device: crate::state::target(),
            k: k.0,
            v: v.0,
        })
    }
}

/// A swapped-out [`KvCache`] as plain values (a request's cache while it moves).
#[derive(serde::Serialize, serde::Deserialize)]
struct SwappedKv {
    page_size: usize,
    shared: bool,
    layer_lens: Vec<usize>,
    len: usize,
    pages: Vec<Vec<HostPage>>,
}

/// A cache's serde form is host copies of its pages. A cache of a model's shared pool is
/// exported swapped out (as after a preemption) and comes back swapped out, in a private pool,
/// until its new family binds it ([`PagedCache::adopt`]); a cache of a private pool (state that
/// lives beside the engine's slots) comes back live in a private pool of its own.
impl serde::Serialize for KvCache {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error;
        let shared = self.pool().is_shared();
        let pages = match &self.swapped {
            Some(pages) => pages.clone(),
            None if shared => {
                return Err(S::Error::custom(
                    "a K/V cache of the model's pool is exported only from host memory \
                     (preempt it first)",
                ))
            }
            None => self
                .tables
                .iter()
                .map(|t| t.iter().map(|&id| self.supply.copy_out(id)).collect())
                .collect::<Result<Vec<Vec<_>>>>()
                .map_err(S::Error::custom)?,
        };
        SwappedKv {
            page_size: self.page_size(),
            shared,
            layer_lens: self.layer_lens.clone(),
            len: self.len,
            pages,
        }
        .serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for KvCache {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error;
        let w = SwappedKv::deserialize(d)?;
        if w.page_size == 0
            || w.layer_lens.len() != w.pages.len()
            || w.pages
                .iter()
                .zip(&w.layer_lens)
                .any(|(p, &l)| p.len() * w.page_size < l)
        {
            return Err(D::Error::custom("an inconsistent K/V cache"));
        }
        let mut c = KvCache::in_pool(KvPool::private(w.page_size));
        c.tables = vec![Vec::new(); w.pages.len()];
        c.layer_lens = w.layer_lens;
        c.len = w.len;
        c.swapped = Some(w.pages);
        if !w.shared {
            let need = c.swapped_pages();
            let ids: Vec<u32> = (0..need).map(|_| c.pool().make_id()).collect();
            c.supply.grant(ids);
            c.swap_in().map_err(D::Error::custom)?;
        }
        Ok(c)
    }
}

/// One sequence's per-layer keys and values `[n_kv_heads, len, head_dim]` (keys after RoPE)
/// for buffer indices `0..len`, in pages. Every layer holds the same `len` between calls.
///
/// A clone is a private copy (its own pages, written once); clones are for caches that live
/// within a tick.
#[derive(Debug)]
pub struct KvCache {
    supply: PageSupply,
    /// Per layer: page ids in buffer order.
    tables: Vec<Vec<u32>>,
    /// Per layer: valid indices (a layer runs ahead of `len` during a forward).
    layer_lens: Vec<usize>,
    len: usize,
    /// Per layer, the pages moved to host memory while swapped out.
    swapped: Option<Vec<Vec<HostPage>>>,
    /// Leading pages of every table that another cache reads too ([`Self::share_prefix`]):
    /// never written again, and never given back as spare pages.
    frozen: usize,
}

impl Default for KvCache {
    fn default() -> Self {
        Self::new()
    }
}

impl Clone for KvCache {
    fn clone(&self) -> Self {
        let mut c = Self::in_pool(KvPool::private_like(self.pool()));
        for l in 0..self.tables.len() {
            if self.layer_lens[l] == 0 {
                continue;
            }
            // Run by run into the copy's pages: nothing concatenated on the way.
            let mut at = 0;
            for (k, v) in self.layer_runs(l).expect("a cache's own valid rows") {
                let n = k.dim(1).expect("a run of keys");
                c.write_rows(l, at, &k, &v)
                    .expect("copying a cache's own valid rows");
                at += n;
            }
        }
        c.len = self.len;
        c.swapped = self.swapped.clone();
        c
    }
}

impl KvCache {
    /// An empty cache over a private pool.
    pub fn new() -> Self {
        Self::in_pool(KvPool::private(PAGE_SIZE))
    }

    /// An empty cache over a private pool of pages of `page_size` indices (one page as long as
    /// the sequence is one contiguous buffer, as before paging: benchmarks compare the two).
    pub fn with_page_size(page_size: usize) -> Self {
        Self::in_pool(KvPool::private(page_size))
    }

    /// An empty cache over `pool`; over a shared pool it takes only pages it was granted.
    pub fn in_pool(pool: KvPool) -> Self {
        Self {
            supply: PageSupply::new(pool),
            tables: Vec::new(),
            layer_lens: Vec::new(),
            len: 0,
            swapped: None,
            frozen: 0,
        }
    }

    /// Buffer indices held (0 before the first call that writes it).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Buffer indices a page holds.
    pub fn page_size(&self) -> usize {
        self.supply.page_size()
    }

    /// The pool the cache's pages come from.
    pub fn pool(&self) -> &KvPool {
        self.supply.pool()
    }

    /// Pages in the page tables.
    pub fn pages_used(&self) -> usize {
        self.tables.iter().map(Vec::len).sum()
    }

    /// Pages held: in the tables, and granted but not used yet.
    pub fn pages_held(&self) -> usize {
        self.pages_used() + self.supply.spare()
    }

    /// Gives this cache pages (slot ids of the engine) to take as it grows.
    pub fn grant(&mut self, pages: impl IntoIterator<Item = u32>) {
        self.supply.grant(pages);
    }

    /// Keeps buffer indices `0..len` only; pages past them go back to the cache's spare ones.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.len {
            return Ok(());
        }
        for l in 0..self.tables.len() {
            self.layer_lens[l] = self.layer_lens[l].min(len);
            self.release_past(l, len);
        }
        self.len = len;
        Ok(())
    }

    /// Drops everything (the pages stay this cache's to reuse).
    pub fn clear(&mut self) {
        for l in 0..self.tables.len() {
            self.release_past(l, 0);
        }
        self.tables.clear();
        self.layer_lens.clear();
        self.len = 0;
        self.frozen = 0;
    }

    /// Pages of layer `l` past the first `len` indices go back to the spare ones (a shared
    /// page is only dropped from the table: its holders give it back to the engine).
    fn release_past(&mut self, l: usize, len: usize) {
        let keep = len.div_ceil(self.page_size());
        if self.tables[l].len() > keep {
            let freed = self.tables[l].split_off(keep);
            let own = freed.len() - self.frozen.saturating_sub(keep);
            self.supply.give(freed.into_iter().rev().take(own));
        }
    }

    /// Makes this empty cache read the first `pages` pages of every table of `donor` (same
    /// pool, same number of tables, each holding at least those pages whole): buffer indices
    /// `0..pages · page_size` without computing them. Neither cache writes those pages again
    /// or hands them out as spare pages; both keep reading them until they drop them. Returns
    /// the page ids now read by both (for the engine to count the new holder).
    pub fn share_prefix(&mut self, donor: &mut KvCache, pages: usize) -> Result<Vec<u32>> {
        let p = self.page_size();
        let rows = pages * p;
        if !self.pool().same_as(donor.pool()) || !self.pool().is_shared() {
            return Err(ModelError::Cache(
                "prompt pages are shared only within a model's pool".into(),
            ));
        }
        if !self.tables.is_empty() || self.len > 0 || self.swapped.is_some() {
            return Err(ModelError::Cache(
                "only an empty cache takes another's prompt pages".into(),
            ));
        }
        if donor.swapped.is_some() || donor.len < rows || donor.layer_lens.iter().any(|&n| n < rows)
        {
            return Err(ModelError::Cache(format!(
                "the cache holds {} indices, not the {rows} to share",
                donor.len
            )));
        }
        let mut ids = Vec::with_capacity(pages * donor.tables.len());
        for table in &donor.tables {
            ids.extend_from_slice(&table[..pages]);
            self.tables.push(table[..pages].to_vec());
            self.layer_lens.push(rows);
        }
        self.len = rows;
        self.frozen = pages;
        donor.frozen = donor.frozen.max(pages);
        Ok(ids)
    }

    /// Leading pages of every table shared with another cache.
    pub fn shared_pages(&self) -> usize {
        self.frozen
    }

    /// Bytes of the pages this cache's tables hold.
    pub fn allocated_bytes(&self) -> usize {
        self.pages_used() * self.supply.page_bytes()
    }

    /// Stores the keys (after RoPE) and values `[n_kv_heads, len, head_dim]` of buffer indices
    /// `0..len` at `layer`, computed outside a [`super::Block`] call (ARMT's grouped diagonal
    /// step runs a segment's layers in different calls); the cache then holds `len` indices.
    pub(crate) fn store_layer(&mut self, layer: usize, k: Tensor, v: Tensor) -> Result<()> {
        let len = k.dim(1)?;
        self.set_layer(layer, k, v)?;
        self.len = len;
        Ok(())
    }

    /// Appends, after its own indices, buffer indices `start..start + len` of each of `parts` in
    /// order (e.g. the K/V of slots computed in other caches, stitched into this one). Keys keep
    /// the RoPE of the positions they were computed at.
    pub fn append(&mut self, parts: &[(&KvCache, usize, usize)]) -> Result<()> {
        let parts: Vec<_> = parts.iter().filter(|p| p.2 > 0).collect();
        let Some(first) = parts.first() else {
            return Ok(());
        };
        let n_layers = first.0.tables.len();
        for (c, start, len) in &parts {
            if start + len > c.len {
                return Err(ModelError::Cache(format!(
                    "cannot take indices {start}..{} of a cache holding {}",
                    start + len,
                    c.len
                )));
            }
            if c.tables.len() != n_layers {
                return Err(ModelError::Cache(
                    "caches with different layer counts cannot be stitched".into(),
                ));
            }
        }
        if self.len > 0 && self.tables.len() != n_layers {
            return Err(ModelError::Cache(
                "caches with different layer counts cannot be stitched".into(),
            ));
        }
        let total: usize = parts.iter().map(|p| p.2).sum();
        for l in 0..n_layers {
            let mut at = self.len;
            for (c, start, len) in &parts {
                let (k, v) = c.rows(l, *start, *len)?;
                self.write_rows(l, at, &k, &v)?;
                at += len;
            }
        }
        self.len += total;
        for n in &mut self.layer_lens {
            *n = self.len;
        }
        Ok(())
    }

    /// Keys and values `[n_kv_heads, n, head_dim]` of indices `start..start + n` of `layer`,
    /// contiguous (a view when they lie in one run of pages, else a copy of those pages' rows).
    fn rows(&self, layer: usize, start: usize, n: usize) -> Result<(Tensor, Tensor)> {
        let p = self.page_size();
        let table = self.table(layer)?;
        let mut pieces = Vec::new();
        let mut at = start;
        while at < start + n {
            let take = (p - at % p).min(start + n - at);
            pieces.push((table[at / p], at % p, take));
            at += take;
        }
        merge_runs(&self.supply.views(&pieces)?)
    }

    fn table(&self, layer: usize) -> Result<&Vec<u32>> {
        self.tables
            .get(layer)
            .filter(|_| self.layer_lens[layer] > 0)
            .ok_or_else(|| ModelError::Cache(format!("layer {layer} holds no keys")))
    }

    /// Keys and values of layer `layer` as runs `[n_kv_heads, n_i, head_dim]` in buffer order,
    /// read in place (each is valid until the next write): one per page, or per run of pages
    /// with consecutive ids.
    pub fn layer_runs(&self, layer: usize) -> Result<Vec<(Tensor, Tensor)>> {
        let p = self.page_size();
        let len = self.layer_len(layer);
        let table = self.table(layer)?;
        let pieces: Vec<(u32, usize, usize)> = (0..len.div_ceil(p))
            .map(|i| (table[i], 0, (len - i * p).min(p)))
            .collect();
        self.supply.views(&pieces)
    }

    /// Keys and values `[n_kv_heads, len, head_dim]` of layer `layer`, contiguous: a view when
    /// they fit in one page, else a copy (for checks and the non-kernel attention paths).
    pub fn layer_kv(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        merge_runs(&self.layer_runs(layer)?)
    }

    /// Rows of `layer` valid now (the cache's length, or more once a forward wrote the layer).
    pub(crate) fn layer_len(&self, layer: usize) -> usize {
        self.layer_lens.get(layer).copied().unwrap_or(0)
    }

    /// Replaces `layer` with `k`/`v` (their rows are its valid rows).
    pub(crate) fn set_layer(&mut self, layer: usize, k: Tensor, v: Tensor) -> Result<()> {
        let n = k.dim(1)?;
        if layer < self.tables.len() {
            self.layer_lens[layer] = 0;
            self.release_past(layer, n);
        }
        self.write_rows(layer, 0, &k, &v)?;
        self.layer_lens[layer] = n;
        Ok(())
    }

    /// Writes `k`/`v` `[H, n, D]` at buffer indices `at..at + n` of `layer`, in place in its
    /// pages (taking pages for indices past the last one); the layer's valid rows extend to
    /// cover them.
    pub(crate) fn write_rows(
        &mut self,
        layer: usize,
        at: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let n = k.dim(1)?;
        let p = self.page_size();
        if !k.device().is_cpu() && n > 0 && (at + n - 1) / p > at / p {
            // Across pages on a device: one launch per arena instead of copies per page.
            let order: Vec<(u32, usize)> = (0..n).map(|r| ((at + r) as u32, r)).collect();
            return self.scatter_rows(layer, &order, k, v);
        }
        if self.tables.len() <= layer {
            self.tables.resize(layer + 1, Vec::new());
            self.layer_lens.resize(layer + 1, 0);
        }
        let held = self.layer_lens[layer];
        self.check_write(layer, at, held)?;
        let mut done = 0;
        while done < n {
            let index = at + done;
            let (pi, off) = (index / p, index % p);
            let take = (p - off).min(n - done);
            if pi == self.tables[layer].len() {
                let id = self.supply.take(self.pages_used())?;
                self.tables[layer].push(id);
            }
            let (ks, vs) = (k.narrow(1, done, take)?, v.narrow(1, done, take)?);
            self.supply.write(self.tables[layer][pi], off, &ks, &vs)?;
            done += take;
        }
        self.layer_lens[layer] = held.max(at + n);
        Ok(())
    }

    /// Writes row `r` of `k`/`v` `[H, n, D]` at buffer index `index[r]` of `layer`. The
    /// indices are distinct; in index order each is within the rows held or continues those
    /// before it (no gap), and none is in the shared prompt's pages. In host memory each run of
    /// consecutive indices is one copy from where the rows lie; on a device every row bound
    /// for one page arena is one launch ([`ScatterRows`]), however the indices scatter.
    pub(crate) fn write_indices(
        &mut self,
        layer: usize,
        index: &[u32],
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        if k.dim(1)? != index.len() || v.dim(1)? != index.len() {
            return Err(ModelError::Shape(format!(
                "{} buffer indices for {} rows",
                index.len(),
                k.dim(1)?
            )));
        }
        let mut order: Vec<(u32, usize)> = index.iter().copied().zip(0..).collect();
        order.sort_unstable();
        if let Some(w) = order.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(ModelError::Shape(format!(
                "buffer index {} appears twice in one write",
                w[0].0
            )));
        }
        if k.device().is_cpu() {
            let mut i = 0;
            while i < order.len() {
                let (b0, r0) = order[i];
                let mut n = 1;
                while i + n < order.len() && order[i + n] == (b0 + n as u32, r0 + n) {
                    n += 1;
                }
                self.write_rows(
                    layer,
                    b0 as usize,
                    &k.narrow(1, r0, n)?,
                    &v.narrow(1, r0, n)?,
                )?;
                i += n;
            }
            return Ok(());
        }
        self.scatter_rows(layer, &order, k, v)
    }

    /// [`Self::write_indices`] as one launch per page arena: `order` holds `(buffer index,
    /// row)` sorted by index, distinct.
    fn scatter_rows(
        &mut self,
        layer: usize,
        order: &[(u32, usize)],
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        if self.tables.len() <= layer {
            self.tables.resize(layer + 1, Vec::new());
            self.layer_lens.resize(layer + 1, 0);
        }
        let p = self.page_size();
        let mut reach = self.layer_lens[layer];
        for &(b, _) in order {
            let b = b as usize;
            self.check_write(layer, b, reach)?;
            reach = reach.max(b + 1);
            if b / p == self.tables[layer].len() {
                let id = self.supply.take(self.pages_used())?;
                self.tables[layer].push(id);
            }
        }
        // Each row's slot in its page's arena, one list of slots per arena.
        let mut arenas: Vec<(usize, Arena, Vec<u32>)> = Vec::new();
        // The last page looked up: its id, its arena's place in `arenas`, its first row.
        let mut page: Option<(u32, usize, usize)> = None;
        for &(b, r) in order {
            let (b, id) = (b as usize, self.tables[layer][b as usize / p]);
            let (g, base) = match page {
                Some((last, g, base)) if last == id => (g, base),
                _ => {
                    let (a, arena, base) = self.supply.arena_for_write(id, k)?;
                    let g = match arenas.iter().position(|g| g.0 == a) {
                        Some(g) => g,
                        None => {
                            arenas.push((a, arena, vec![SKIP_ROW; order.len()]));
                            arenas.len() - 1
                        }
                    };
                    page = Some((id, g, base));
                    (g, base)
                }
            };
            arenas[g].2[r] = (base + b % p) as u32;
        }
        // Once for every arena (they store one dtype): the pages' dtype, and rows of
        // consecutive values, which the kernel reads with any head and row strides (other
        // layouts, a transposed projection's `[H, n, D]` view, are copied into it).
        let Some(dtype) = arenas.first().map(|g| g.1.k.dtype()) else {
            return Ok(());
        };
        let rows = |t: &Tensor| -> Result<Tensor> {
            let t = t.to_dtype(dtype)?;
            Ok(if t.dim(2)? == 1 || t.stride()[2] == 1 {
                t
            } else {
                t.contiguous()?
            })
        };
        let (k, v) = (rows(k)?, rows(v)?);
        for (_, arena, slots) in arenas {
            let op = ScatterRows { slots };
            arena.k.inplace_op2(&k, &op)?;
            arena.v.inplace_op2(&v, &op)?;
        }
        self.layer_lens[layer] = reach;
        Ok(())
    }

    /// Whether rows may be written at index `at` of `layer`, whose valid rows end at `held`:
    /// no gap after them, and not in the shared prompt's pages.
    fn check_write(&self, layer: usize, at: usize, held: usize) -> Result<()> {
        if at > held {
            return Err(ModelError::Cache(if held == 0 {
                format!("layer {layer} holds no keys to write rows at {at} after")
            } else {
                format!("rows written at {at} would leave a gap after the {held} held")
            }));
        }
        let p = self.page_size();
        if at < self.frozen * p {
            return Err(ModelError::Cache(format!(
                "rows at {at} would overwrite the {} shared prompt indices",
                self.frozen * p
            )));
        }
        Ok(())
    }

    /// Makes `layer` hold exactly `len` rows: the rows a call just wrote end there, and rows
    /// left past it by an earlier, longer use are dropped. Fewer valid rows is an error.
    pub(crate) fn fit_layer(&mut self, layer: usize, len: usize) -> Result<()> {
        let held = self.layer_len(layer);
        if held < len {
            return Err(ModelError::Cache(format!(
                "layer {layer} holds {held} rows where the call needs {len}: an index is neither cached nor a row"
            )));
        }
        if layer < self.tables.len() {
            self.layer_lens[layer] = len;
            self.release_past(layer, len);
        }
        Ok(())
    }

    /// Sets the length every layer holds after a forward wrote `len` indices.
    pub(crate) fn commit(&mut self, len: usize) {
        self.len = len;
    }

    /// Whether the cache's pages are in host memory ([`Self::swap_out`]).
    pub fn is_swapped(&self) -> bool {
        self.swapped.is_some()
    }

    /// Moves every page to host memory and gives up every page id (tables and spare ones: the
    /// caller hands them back to the engine). Returns the bytes moved.
    pub fn swap_out(&mut self) -> Result<usize> {
        if self.swapped.is_some() {
            return Err(ModelError::Cache("the cache is already swapped out".into()));
        }
        let mut layers = Vec::with_capacity(self.tables.len());
        let mut bytes = 0;
        for table in &mut self.tables {
            let pages = table
                .drain(..)
                .map(|id| self.supply.copy_out(id))
                .collect::<Result<Vec<_>>>()?;
            bytes += pages.iter().map(HostPage::bytes).sum::<usize>();
            layers.push(pages);
        }
        self.supply.drop_spare();
        self.swapped = Some(layers);
        // The pages come back as this cache's own.
        self.frozen = 0;
        Ok(bytes)
    }

    /// Pages [`Self::swap_in`] needs granted first.
    pub fn swapped_pages(&self) -> usize {
        self.swapped
            .as_ref()
            .map_or(0, |s| s.iter().map(Vec::len).sum())
    }

    /// Moves the pages back from host memory into granted pages (any ids). Returns the bytes
    /// moved.
    pub fn swap_in(&mut self) -> Result<usize> {
        let (need, have) = (self.swapped_pages(), self.supply.spare());
        if need > have {
            return Err(ModelError::Cache(format!(
                "swapping in needs {need} pages; {have} were granted"
            )));
        }
        let Some(layers) = self.swapped.take() else {
            return Ok(0);
        };
        let mut bytes = 0;
        for (l, pages) in layers.iter().enumerate() {
            for host in pages {
                let id = self.supply.copy_in(host, 0)?;
                self.tables[l].push(id);
                bytes += host.bytes();
            }
        }
        Ok(bytes)
    }
}

/// Runs `[H, n_i, D]` concatenated along the index axis (the run itself when there is one).
pub(crate) fn merge_runs(runs: &[(Tensor, Tensor)]) -> Result<(Tensor, Tensor)> {
    match runs {
        [] => Err(ModelError::Cache("no keys to merge".into())),
        [one] => Ok(one.clone()),
        _ => {
            let ks: Vec<&Tensor> = runs.iter().map(|r| &r.0).collect();
            let vs: Vec<&Tensor> = runs.iter().map(|r| &r.1).collect();
            Ok((Tensor::cat(&ks, 1)?, Tensor::cat(&vs, 1)?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn rows(start: usize, n: usize) -> Result<Tensor> {
        Ok(
            Tensor::arange(start as f32, (start + n) as f32, &Device::Cpu)?
                .reshape((1, n, 1))?
                .broadcast_as((2, n, 3))?
                .contiguous()?,
        )
    }

    fn run_lens(c: &KvCache) -> Result<Vec<usize>> {
        Ok(c.layer_runs(0)?
            .iter()
            .map(|r| r.0.dim(1))
            .collect::<candle_core::Result<Vec<_>>>()?)
    }

    fn values(c: &KvCache) -> Result<Vec<f32>> {
        let (k, _) = c.layer_kv(0)?;
        Ok(k.get(1)?.narrow(1, 0, 1)?.flatten_all()?.to_vec1()?)
    }

    #[test]
    fn rows_land_in_pages_and_a_clone_keeps_its_own_rows() -> Result<()> {
        let mut c = KvCache::new();
        c.write_rows(0, 0, &rows(0, 3)?, &rows(0, 3)?)?;
        c.commit(3);
        let before = c.allocated_bytes();
        c.write_rows(0, 3, &rows(3, 2)?, &rows(3, 2)?)?;
        c.commit(5);
        // Room for 16 rows in the first page: no new page.
        assert_eq!(c.allocated_bytes(), before);
        assert_eq!(values(&c)?, [0.0, 1.0, 2.0, 3.0, 4.0]);
        let snapshot = c.clone();
        c.truncate(2)?;
        c.write_rows(0, 2, &rows(9, 2)?, &rows(9, 2)?)?;
        c.commit(4);
        assert_eq!(values(&c)?, [0.0, 1.0, 9.0, 10.0]);
        // The clone is a copy: it still reads what it held.
        assert_eq!(values(&snapshot)?, [0.0, 1.0, 2.0, 3.0, 4.0]);
        // Growth past a page takes pages and keeps the rows; pages of consecutive ids in one
        // arena are read as one run (a private pool's arenas hold 1, 2, 4, ... pages).
        c.write_rows(0, 4, &rows(4, 36)?, &rows(4, 36)?)?;
        c.commit(40);
        assert_eq!(c.pages_used(), 3);
        assert_eq!(run_lens(&c)?, [16, 24]);
        assert_eq!(values(&c)?.len(), 40);
        assert_eq!(values(&c)?[..6], [0.0, 1.0, 9.0, 10.0, 4.0, 5.0]);
        assert!(c.write_rows(0, 50, &rows(0, 1)?, &rows(0, 1)?).is_err());
        // Truncation returns pages, and they are reused.
        c.truncate(10)?;
        assert_eq!(c.pages_used(), 1);
        assert_eq!(c.pages_held(), 3);
        c.write_rows(0, 10, &rows(10, 20)?, &rows(10, 20)?)?;
        assert_eq!(c.pages_held(), 3);
        Ok(())
    }

    #[test]
    fn rows_written_from_a_view_of_a_packed_call_are_the_rows_of_a_copy() -> Result<()> {
        // A packed call's keys `[H, N, D]`; a sequence's rows are a strided view of them.
        let (h, n, d) = (3, 7, 5);
        let packed = Tensor::arange(0f32, (h * n * d) as f32, &Device::Cpu)?.reshape((h, n, d))?;
        for dtype in [candle_core::DType::F32, candle_core::DType::BF16] {
            let packed = packed.to_dtype(dtype)?;
            let (mut viewed, mut copied) = (KvCache::new(), KvCache::new());
            // The last view lands at indices 15..19: across the first page's end.
            viewed.write_rows(0, 0, &packed.narrow(1, 0, 7)?, &packed.narrow(1, 0, 7)?)?;
            copied.write_rows(0, 0, &packed.narrow(1, 0, 7)?.contiguous()?, &packed)?;
            for (at, from) in [(7, 0), (11, 2), (15, 3)] {
                let view = packed.narrow(1, from, 4)?;
                assert!(!view.is_contiguous());
                viewed.write_rows(0, at, &view, &view)?;
                let copy = view.contiguous()?;
                copied.write_rows(0, at, &copy, &copy)?;
            }
            let (vk, vv) = viewed.layer_kv(0)?;
            let (ck, cv) = copied.layer_kv(0)?;
            assert_eq!(vk.dims(), [h, 19, d]);
            let bits = |t: &Tensor| -> Result<Vec<f32>> {
                Ok(t.to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1()?)
            };
            assert_eq!(bits(&vk)?, bits(&ck)?);
            assert_eq!(bits(&vv)?, bits(&cv)?);
            assert_eq!(
                bits(&vk.narrow(1, 15, 4)?)?,
                bits(&packed.narrow(1, 3, 4)?)?
            );
        }
        Ok(())
    }

    #[test]
    fn scattered_rows_land_where_runs_of_them_would() -> Result<()> {
        // A sequence's rows of a packed call `[H, N, D]` (a strided view) at scattered buffer
        // indices over 48 held ones: the host path (a copy per run) against the device path (a
        // scatter per arena, here through the kernels' reference), in a private pool whose
        // arenas double (the rows reach three) and in a shared one.
        let (h, n, d) = (3, 9, 5);
        let packed = Tensor::arange(0f32, (h * n * d) as f32, &Device::Cpu)?.reshape((h, n, d))?;
        let index = [40u32, 3, 17, 18, 2, 33, 19, 48, 49];
        let held = (Tensor::arange(0f32, (h * 48 * d) as f32, &Device::Cpu)? * -1.0)?
            .reshape((h, 48, d))?;
        for dtype in [candle_core::DType::F32, candle_core::DType::BF16] {
            let (packed, held) = (packed.to_dtype(dtype)?, held.to_dtype(dtype)?);
            let rows = packed.narrow(1, 0, n)?;
            let shared = KvPool::shared(16);
            let mut granted = KvCache::in_pool(shared.clone());
            granted.grant(0..8);
            let mut caches = [KvCache::new(), KvCache::new(), granted];
            for c in &mut caches {
                c.write_rows(0, 0, &held, &held)?;
            }
            caches[0].write_indices(0, &index, &rows, &rows)?;
            let mut order: Vec<(u32, usize)> = index.iter().copied().zip(0..).collect();
            order.sort_unstable();
            for c in &mut caches[1..] {
                c.scatter_rows(0, &order, &rows, &rows)?;
            }
            let bits = |c: &KvCache| -> Result<Vec<f32>> {
                let (k, v) = c.layer_kv(0)?;
                Ok(Tensor::cat(&[k, v], 0)?
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1()?)
            };
            let want = bits(&caches[0])?;
            assert_eq!(caches[0].layer_len(0), 50);
            for c in &caches[1..] {
                assert_eq!(c.layer_len(0), 50);
                assert_eq!(bits(c)?, want);
            }
            // Row 2 of the call is buffer index 17.
            let (k, _) = caches[1].layer_kv(0)?;
            assert_eq!(
                k.narrow(1, 17, 1)?
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
                rows.narrow(1, 2, 1)?
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?
            );
            // Rows whose values are not consecutive (a transposed `[H, n, D]` view, as a
            // projection on a GPU can leave them) land as well.
            let dim_major = rows
                .contiguous()?
                .transpose(0, 2)?
                .contiguous()?
                .transpose(0, 2)?;
            assert_ne!(dim_major.stride()[2], 1);
            let mut again = KvCache::new();
            again.write_rows(0, 0, &held, &held)?;
            again.scatter_rows(0, &order, &dim_major, &dim_major)?;
            assert_eq!(bits(&again)?, want);
            // A gap past the rows held, or one index twice, is refused.
            let one = rows.narrow(1, 0, 1)?;
            let gap = caches[1].scatter_rows(0, &[(52, 0)], &one, &one);
            assert!(matches!(gap, Err(ModelError::Cache(m)) if m.contains("gap")));
            let two = rows.narrow(1, 0, 2)?;
            assert!(caches[1].write_indices(0, &[5, 5], &two, &two).is_err());
        }
        Ok(())
    }

    #[test]
    fn stitching_appends_other_caches_rows() -> Result<()> {
        let mut a = KvCache::new();
        a.write_rows(0, 0, &rows(0, 2)?, &rows(0, 2)?)?;
        a.commit(2);
        let mut b = KvCache::new();
        b.write_rows(0, 0, &rows(5, 20)?, &rows(5, 20)?)?;
        b.commit(20);
        a.append(&[(&b, 1, 2), (&b, 14, 4)])?;
        assert_eq!(a.len(), 8);
        assert_eq!(values(&a)?, [0.0, 1.0, 6.0, 7.0, 19.0, 20.0, 21.0, 22.0]);
        assert!(a.append(&[(&b, 19, 2)]).is_err());
        Ok(())
    }

    #[test]
    fn a_shared_pool_cache_takes_only_granted_pages_and_swaps_bit_exactly() -> Result<()> {
        let pool = KvPool::shared(4);
        let mut a = KvCache::in_pool(pool.clone());
        let mut b = KvCache::in_pool(pool.clone());
        a.grant([0, 1]);
        b.grant([2]);
        a.write_rows(0, 0, &rows(0, 6)?, &rows(0, 6)?)?;
        a.commit(6);
        b.write_rows(0, 0, &rows(100, 3)?, &rows(100, 3)?)?;
        b.commit(3);
        // Past its grant: an error, nothing written.
        let err = a.write_rows(0, 6, &rows(6, 4)?, &rows(6, 4)?);
        assert!(matches!(err, Err(ModelError::Cache(m)) if m.contains("out of K/V pages")));
        let want = a.layer_kv(0)?;
        assert_eq!(a.swap_out()?, 2 * 2 * (2 * 4 * 3 * 4));
        assert!(a.is_swapped() && a.pages_held() == 0);
        // Its pages go to b, which overwrites them.
        b.grant([1, 0]);
        b.write_rows(0, 3, &rows(103, 9)?, &rows(103, 9)?)?;
        b.commit(12);
        // a resumes in other pages with the same keys, bit for bit.
        assert!(a.swap_in().is_err());
        a.grant([7, 5]);
        a.swap_in()?;
        let got = a.layer_kv(0)?;
        assert_eq!(
            got.0.flatten_all()?.to_vec1::<f32>()?,
            want.0.flatten_all()?.to_vec1::<f32>()?
        );
        assert_eq!(
            got.1.flatten_all()?.to_vec1::<f32>()?,
            want.1.flatten_all()?.to_vec1::<f32>()?
        );
        assert_eq!(
            values(&b)?,
            (100..112).map(|x| x as f32).collect::<Vec<_>>()
        );
        // b's pages are 2, 0, 1: the last two continue each other.
        assert_eq!(run_lens(&b)?, [4, 8]);
        // a resumed in pages 5 and 7: two runs.
        assert_eq!(run_lens(&a)?, [4, 2]);
        Ok(())
    }
}
