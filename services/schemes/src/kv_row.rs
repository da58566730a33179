//! A K/V row: one position's key and value in one layer, over every tensor-parallel rank's
//! cache. The families that cache keys and values per position (masked diffusion, recurrent
//! memory, slot diffusion) size their slots from it (a page is `page size` rows).

use candle_core::DType;
use wavefront_models::transformer::{cached_kv_heads, BlockConfig};

/// Bytes one K/V row takes: `2 · kv heads cached · head_dim · dtype size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KvRow {
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

    /// Bytes of one value of the model dtype.
    pub(crate) fn dtype_size(&self) -> usize {
        self.dtype_size
    }
}
