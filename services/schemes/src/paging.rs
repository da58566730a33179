//! What every family with paged caches does with the engine's slots: hand a request's newly
//! granted slots to its cache (the slot ids are page ids of the family's pool), and move the
//! cache's pages to host memory and back when the engine preempts and resumes the request.

use wavefront_engine::{Active, FamilyError, Moved, SlotId};
use wavefront_models::transformer::{KvCache, KvPool, PagedCache};

/// A program whose paged state is one K/V cache (slot diffusion, block diffusion): its family's
/// part of the engine's slot cycle is the same for all of them ([`bind_one`], [`needed_one`],
/// [`reclaim_one`], [`preempt_one`], [`resume_one`]).
pub(crate) trait OneCache {
    fn cache(&mut self) -> &mut KvCache;
    /// Pages the cache holds after the next step at most, in pages of `page` rows.
    fn pages_needed(&self, page: usize) -> usize;
    fn is_done(&self) -> bool;
}

/// Hands the slots granted to `a` since the last look to its cache (moved into `pool` on first
/// sight: programs are built outside the engine thread).
pub(crate) fn bind_one<P: OneCache>(a: &mut Active<P>, pool: &KvPool) {
    let new = a.take_new_slots();
    bind(a.program.cache(), pool, new);
}

/// `Family::slots_needed`: what the next step's pages reach (a finished program keeps what it
/// holds until the engine retires it).
pub(crate) fn needed_one<P: OneCache>(a: &Active<P>, pool: &KvPool) -> usize {
    if a.program.is_done() {
        return a.slots.len();
    }
    a.program.pages_needed(pool.page_size()).max(a.slots.len())
}

/// `Family::reclaim`: the granted pages the next step will not use.
pub(crate) fn reclaim_one<P: OneCache>(a: &mut Active<P>, pool: &KvPool) -> Vec<SlotId> {
    let need = a.keeps(a.program.pages_needed(pool.page_size()));
    let held = a.slots.len();
    reclaim(a.program.cache(), held, need)
}

/// `Family::preempt`: the cache's pages to host memory (a request preempted before its first
/// tick moves its empty cache into the pool first).
pub(crate) fn preempt_one<P: OneCache>(
    a: &mut Active<P>,
    pool: &KvPool,
    scheme: &'static str,
) -> Result<Moved, FamilyError> {
    bind_one(a, pool);
    swap_out(a.program.cache(), scheme)
}

/// `Family::resume`: the pages back into the slots granted now.
pub(crate) fn resume_one<P: OneCache>(
    a: &mut Active<P>,
    pool: &KvPool,
    scheme: &'static str,
) -> Result<Moved, FamilyError> {
    bind_one(a, pool);
    swap_in(a.program.cache(), scheme)
}

/// Gives `cache` the slots `new` as pages of `pool`. A cache still in the private pool it was
/// built with (programs are built outside the engine thread) and empty moves into `pool`
/// first, as does a swapped-out one imported from another worker.
pub(crate) fn bind<C: PagedCache>(cache: &mut C, pool: &KvPool, new: Vec<SlotId>) {
    if !cache.pool().is_shared() {
        if cache.is_swapped() {
            // Moved here from another worker: its pages go into this pool when it resumes.
            cache.adopt(pool.clone());
        } else if cache.is_empty() {
            *cache = cache.empty_in(pool.clone());
        }
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
