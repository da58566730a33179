//! What every family with paged caches does with the engine's slots: hand a request's newly
//! granted slots to its cache (the slot ids are page ids of the family's pool), and move the
//! cache's pages to host memory and back when the engine preempts and resumes the request.

use wavefront_engine::{FamilyError, Moved, SlotId};
use wavefront_models::transformer::{KvPool, PagedCache};

/// Gives `cache` the slots `new` as pages of `pool`. A cache still in the private pool it was
/// built with (programs are built outside the engine thread) and empty moves into `pool`
/// first.
pub(crate) fn bind<C: PagedCache>(cache: &mut C, pool: &KvPool, new: Vec<SlotId>) {
    if !cache.pool().is_shared() && cache.is_empty() && !cache.is_swapped() {
        *cache = cache.empty_in(pool.clone());
    }
    cache.grant_pages(new.into_iter().map(|s| s.0).collect());
}

/// Moves `cache`'s pages to host memory (preemption); `scheme` names the failure.
pub(crate) fn swap_out<C: PagedCache>(
    cache: &mut C,
    scheme: &'static str,
) -> Result<Moved, FamilyError> {
    let bytes = cache
        .swap_out()
        .map_err(|e| FamilyError::commit(scheme, e))?;
    Ok(Moved {
        bytes: bytes as u64,
        recomputed_rows: 0,
    })
}

/// Moves `cache`'s pages back into the pages it was granted (resumption).
pub(crate) fn swap_in<C: PagedCache>(
    cache: &mut C,
    scheme: &'static str,
) -> Result<Moved, FamilyError> {
    let bytes = cache
        .swap_in()
        .map_err(|e| FamilyError::commit(scheme, e))?;
    Ok(Moved {
        bytes: bytes as u64,
        recomputed_rows: 0,
    })
}
