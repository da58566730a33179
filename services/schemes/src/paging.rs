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

/// The granted pages `cache` will not use in the next step: a request holding `held` slots
/// whose next step needs `need` gives the difference back from its unused pages.
pub(crate) fn reclaim<C: PagedCache>(cache: &mut C, held: usize, need: usize) -> Vec<SlotId> {
    if cache.is_swapped() || need >= held {
        return Vec::new();
    }
    cache
        .release_spare(held - need)
        .into_iter()
        .map(SlotId)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use wavefront_models::transformer::KvCache;

    #[test]
    fn a_cache_moves_into_the_pool_takes_its_grant_and_gives_back_what_it_will_not_use(
    ) -> anyhow::Result<()> {
        let pool = KvPool::shared(4);
        let mut cache = KvCache::new();
        bind(&mut cache, &pool, (10..15).map(SlotId).collect());
        assert!(cache.pool().is_shared());
        assert_eq!(cache.pages_held(), 5);
        // Holding 5, needing 3: two unused pages go back; needing more gives nothing.
        let back = reclaim(&mut cache, 5, 3);
        assert_eq!(back.len(), 2);
        assert_eq!(cache.pages_held(), 3);
        assert!(reclaim(&mut cache, 3, 4).is_empty());
        // Swapped out, a cache holds nothing to give.
        swap_out(&mut cache, "test")?;
        assert!(reclaim(&mut cache, 3, 0).is_empty());
        Ok(())
    }
}
