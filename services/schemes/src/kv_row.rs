//! A K/V row: one position's key and value in one layer, over every tensor-parallel rank's
//! cache; and how the planners of the families whose slots are pages of such rows size them
//! ([`PageSizing`], [`PagedPlanner`]: block diffusion, recurrent memory, slot diffusion).

use candle_core::DType;
use wavefront_models::transformer::{cached_kv_heads, BlockConfig, PAGE_SIZE};

use crate::options::KvReserve;

/// Bytes one K/V row takes: `2 · kv heads cached · head_dim · dtype size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvRow {
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    dtype_size: usize,
    /// Key/value heads cached per layer over all tensor-parallel ranks.
    cached_heads: usize,
}

impl KvRow {
    /// The row of a model with blocks `block` in `dtype`, not split.
    pub(crate) fn new(block: &BlockConfig, dtype: DType) -> Self {
        Self {
            n_heads: block.n_heads,
            n_kv_heads: block.n_kv_heads,
            head_dim: block.head_dim,
            dtype_size: dtype.size_in_bytes(),
            cached_heads: block.n_kv_heads,
        }
    }

    /// The row of the model split over `world` tensor-parallel ranks: kv heads replicated on
    /// ranks (when there are fewer of them than ranks) take room in every rank's cache.
    pub(crate) fn with_world(self, world: usize) -> Self {
        Self {
            cached_heads: cached_kv_heads(self.n_heads, self.n_kv_heads, world),
            ..self
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        2 * self.cached_heads * self.head_dim * self.dtype_size
    }
}

/// How the planner of a family whose slots are K/V pages (block diffusion, recurrent memory,
/// slot diffusion) sizes them: a slot is a page of `page` K/V rows of one layer of one
/// tensor-parallel rank, and a request's cache holds a page table per layer and rank.
#[derive(Debug, Clone, Copy)]
pub struct PageSizing {
    pub(crate) kv: KvRow,
    pub(crate) world: usize,
    /// Rows a page holds (`--kv-page-size`).
    pub(crate) page: usize,
    pub(crate) layers: usize,
    /// How requests take their pages.
    pub(crate) reserve: KvReserve,
}

impl PageSizing {
    /// Pages of [`PAGE_SIZE`] rows for a model of `layers` blocks `block` in `dtype`, not split,
    /// taken on demand.
    pub(crate) fn new(block: &BlockConfig, dtype: DType, layers: usize) -> Self {
        Self {
            kv: KvRow::new(block, dtype),
            world: 1,
            page: PAGE_SIZE,
            layers,
            reserve: KvReserve::OnDemand,
        }
    }

    /// Bytes of one slot: a page of rows' K and V in one layer of one rank.
    pub(crate) fn slot_bytes(&self) -> usize {
        self.kv.bytes() * self.page / self.world
    }

    /// Page tables of a request's cache: one per layer and rank.
    pub(crate) fn tables(&self) -> usize {
        self.layers * self.world
    }

    /// Slots (pages) a cache of `rows` rows takes.
    pub(crate) fn pages(&self, rows: usize) -> usize {
        self.tables() * rows.div_ceil(self.page)
    }
}

/// The settings of a planner whose slots are K/V pages, written once for every such family.
pub trait PagedPlanner: Sized {
    fn sizing(&self) -> &PageSizing;
    fn sizing_mut(&mut self) -> &mut PageSizing;

    /// Rows a page holds (default [`PAGE_SIZE`]).
    fn with_page_size(mut self, page: usize) -> Self {
        self.sizing_mut().page = page.max(1);
        self
    }

    /// Sizes slots for the model split over `world` tensor-parallel ranks (kv heads replicated
    /// on ranks when there are fewer than ranks take room in every rank's cache).
    fn with_tensor_parallel(mut self, world: usize) -> Self {
        let s = self.sizing_mut();
        s.kv = s.kv.with_world(world);
        s.world = world.max(1);
        self
    }

    /// Takes each request's worst case at admission instead of pages on demand.
    fn with_reserve(mut self, reserve: KvReserve) -> Self {
        self.sizing_mut().reserve = reserve;
        self
    }

    /// Bytes of one slot (see [`PageSizing`]).
    fn slot_bytes(&self) -> usize {
        self.sizing().slot_bytes()
    }
}
