//! What every family with paged caches does with the engine's slots: hand a request's newly
//! granted slots to its cache (the slot ids are page ids of the family's pool), and move the
//! cache's pages to host memory and back when the engine preempts and resumes the request.
//! Families whose programs hold one cache (block and slot diffusion) share the whole slot cycle
//! ([`OneCacheFamily`]); Huginn, ARMT and SureLock call the pieces with their own state.

use wavefront_engine::{
    Active, Adopted, Demand, Family, FamilyError, Group, Moved, Outbox, Phase, Planned, SlotId,
};
use wavefront_models::transformer::{KvCache, KvPool, PagedCache, PAGE_SIZE};

use crate::SchemeError;

/// A program whose paged state is one K/V cache (slot diffusion, block diffusion): the slot cycle
/// of its family is [`OneCacheFamily`]'s, the same for all of them.
pub trait OneCache {
    fn cache(&mut self) -> &mut KvCache;
    /// Pages the cache holds after the next step at most, in pages of `page` rows.
    fn pages_needed(&self, page: usize) -> usize;
    fn is_done(&self) -> bool;
    /// Whether the request has a structured-output constraint (it does not move).
    fn constrained(&self) -> bool {
        false
    }
}

/// What a family of one-cache programs does besides the slot cycle: its network's steps.
pub trait Stepper: Send + 'static {
    type Program: OneCache + serde::Serialize + Send + 'static;
    type Plan;
    type Output;
    /// The family's name, for errors.
    const FAMILY: &'static str;

    fn demand(&self, program: &Self::Program) -> Demand;
    fn plan(&self, program: &mut Self::Program, rows: usize) -> Result<Self::Plan, SchemeError>;
    /// Every plan of the tick in one forward group.
    fn run(
        &self,
        work: &mut [Planned<'_, Self::Program, Self::Plan>],
    ) -> Result<Vec<Self::Output>, SchemeError>;
    fn commit(
        &self,
        program: &mut Self::Program,
        plan: Self::Plan,
        output: Self::Output,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError>;
    /// The transport stopped the request: it finishes now with its statistics.
    fn stop(&self, program: &mut Self::Program, outbox: &mut Outbox);

    /// Prompt sharing ([`Family::share_key`]): the key of the state `program`'s prompt leaves
    /// in its cache; `None` (the default) when it is never shared, or when its prompt fills no
    /// whole page of `page` rows to share (a request with its key would wait for nothing).
    fn share_key(&self, _program: &Self::Program, _page: usize) -> Option<u64> {
        None
    }

    /// Whether the program's prompt rows are still being computed.
    fn prompt_pending(&self, _program: &Self::Program) -> bool {
        false
    }

    /// Buffer indices of `donor`'s cache that `taker` (same key, nothing computed yet) may
    /// read as its own prompt's: a multiple of `page` (whole pages), before the prompt's last
    /// index and within what `donor` holds final; 0 for none.
    fn shareable(&self, _donor: &Self::Program, _taker: &Self::Program, _page: usize) -> usize {
        0
    }

    /// [`Family::prefix_rows`]: buffer indices of `donor`'s cache that `taker`, whose prompt
    /// only begins like `donor`'s (another key), may read; the same bounds as
    /// [`Stepper::shareable`], which then gives the same answer. 0 (the default): whole
    /// prompts only.
    fn prefix_rows(&self, _donor: &Self::Program, _taker: &Self::Program, _page: usize) -> usize {
        0
    }

    /// `taker`'s cache now holds its first `rows` prompt indices: it goes on from there.
    fn skip_prompt(&self, _taker: &mut Self::Program, _rows: usize) -> Result<(), SchemeError> {
        Ok(())
    }
}

/// A family whose programs each hold one paged K/V cache: the stepper `S` plans, runs and
/// commits; the family hands granted slots to the caches as pages of its pool, asks for the
/// pages the next step reaches, gives back the ones it will not, and moves the pages to host
/// memory and back when the engine preempts and resumes a request.
pub struct OneCacheFamily<S> {
    stepper: S,
    pool: KvPool,
}

impl<S: Stepper> OneCacheFamily<S> {
    pub(crate) fn with_stepper(stepper: S) -> Self {
        Self {
            stepper,
            pool: KvPool::shared(PAGE_SIZE),
        }
    }

    /// Pages of `page` positions (the planner's page size), storing K/V rows as `kv_dtype` in
    /// host memory (`LoadOptions::kv_store`; `None`: as the model makes them).
    pub fn with_pages(mut self, page: usize, kv_dtype: Option<candle_core::DType>) -> Self {
        self.pool = KvPool::shared_storing(page.max(1), kv_dtype);
        self
    }

    pub(crate) fn stepper(&self) -> &S {
        &self.stepper
    }

    /// Hands the slots granted to `a` since the last look to its cache (moved into the pool on
    /// first sight: programs are built outside the engine thread).
    fn bind(&self, a: &mut Active<S::Program>) {
        let new = a.take_new_slots();
        bind(a.program.cache(), &self.pool, new);
    }
}

impl<S: Stepper> Family for OneCacheFamily<S> {
    type Program = S::Program;
    type Plan = S::Plan;
    type Output = S::Output;

    fn pool_bytes(&self) -> u64 {
        self.pool.allocated_bytes()
    }

    fn demand(&self, a: &Active<S::Program>) -> Demand {
        if a.program.is_done() {
            return Demand::Idle;
        }
        self.stepper.demand(&a.program)
    }

    fn plan(
        &mut self,
        a: &mut Active<S::Program>,
        rows: usize,
    ) -> Result<Option<S::Plan>, FamilyError> {
        self.bind(a);
        self.stepper
            .plan(&mut a.program, rows)
            .map(Some)
            .map_err(|e| FamilyError::program(S::FAMILY, Phase::Plan, e))
    }

    fn run(&mut self, work: &mut [Planned<'_, S::Program, S::Plan>]) -> Vec<Group<S::Output>> {
        vec![Group::all(
            work.len(),
            self.stepper.run(work).map_err(FamilyError::forward),
        )]
    }

    fn commit(
        &mut self,
        a: &mut Active<S::Program>,
        plan: S::Plan,
        output: S::Output,
    ) -> Result<(), FamilyError> {
        self.stepper
            .commit(&mut a.program, plan, output, &mut a.outbox)
            .map_err(|e| FamilyError::commit(S::FAMILY, e))
    }

    fn stop(&mut self, a: &mut Active<S::Program>) {
        self.stepper.stop(&mut a.program, &mut a.outbox);
    }

    fn export(&mut self, a: &mut Active<S::Program>) -> Result<Vec<u8>, FamilyError> {
        crate::migrate::export_unless_constrained(&a.program, S::FAMILY, a.program.constrained())
    }

    /// What the next step's pages reach (a finished program keeps what it holds until the
    /// engine retires it).
    fn slots_needed(&self, a: &Active<S::Program>) -> usize {
        if a.program.is_done() {
            return a.slots.len();
        }
        a.program
            .pages_needed(self.pool.page_size())
            .max(a.slots.len())
    }

    /// The granted pages the next step will not use.
    fn reclaim(&mut self, a: &mut Active<S::Program>) -> Vec<SlotId> {
        let need = a.keeps(a.program.pages_needed(self.pool.page_size()));
        let held = a.slots.len();
        reclaim(a.program.cache(), held, need)
    }

    /// The cache's pages to host memory (a request preempted before its first tick moves its
    /// empty cache into the pool first).
    fn preempt(&mut self, a: &mut Active<S::Program>) -> Result<Moved, FamilyError> {
        self.bind(a);
        swap_out(a.program.cache(), S::FAMILY)
    }

    /// The pages back into the slots granted now.
    fn resume(&mut self, a: &mut Active<S::Program>) -> Result<Moved, FamilyError> {
        self.bind(a);
        swap_in(a.program.cache(), S::FAMILY)
    }

    fn share_key(&self, program: &S::Program) -> Option<u64> {
        self.stepper.share_key(program, self.pool.page_size())
    }

    fn prompt_pending(&self, a: &Active<S::Program>) -> bool {
        self.stepper.prompt_pending(&a.program)
    }

    /// (Donors run or are kept by the prefix cache: their caches are never swapped out.)
    fn prefix_rows(&self, donor: &Active<S::Program>, taker: &Active<S::Program>) -> usize {
        self.stepper
            .prefix_rows(&donor.program, &taker.program, self.pool.page_size())
    }

    /// The donor's whole prompt pages, in every table, become the taker's first pages; the
    /// taker's program skips their rows.
    fn adopt_prompt(
        &mut self,
        donor: &mut Active<S::Program>,
        taker: &mut Active<S::Program>,
    ) -> Result<Adopted, FamilyError> {
        let page = self.pool.page_size();
        let rows = self.stepper.shareable(&donor.program, &taker.program, page);
        if rows == 0 || donor.program.cache().is_swapped() {
            return Ok(Adopted::default());
        }
        // The taker's cache moves into the pool (it has no slots yet).
        self.bind(taker);
        let fail = |e| FamilyError::program(S::FAMILY, Phase::Plan, e);
        let ids = taker
            .program
            .cache()
            .share_prefix(donor.program.cache(), rows / page)
            .map_err(|e| fail(SchemeError::from(e)))?;
        if let Err(e) = self.stepper.skip_prompt(&mut taker.program, rows) {
            // All or nothing: the taker's cache lets go of the pages again.
            taker.program.cache().clear();
            return Err(fail(e));
        }
        Ok(Adopted {
            slots: ids.into_iter().map(SlotId).collect(),
            rows,
        })
    }
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

/// Moves `cache`'s pages to host memory (preemption); `family` names the failure.
pub(crate) fn swap_out<C: PagedCache>(
    cache: &mut C,
    family: &'static str,
) -> Result<Moved, FamilyError> {
    let bytes = cache
        .swap_out()
        .map_err(|e| FamilyError::program(family, Phase::Preempt, e))?;
    Ok(Moved {
        bytes: bytes as u64,
        recomputed_rows: 0,
    })
}

/// Moves `cache`'s pages back into the pages it was granted (resumption).
pub(crate) fn swap_in<C: PagedCache>(
    cache: &mut C,
    family: &'static str,
) -> Result<Moved, FamilyError> {
    let bytes = cache
        .swap_in()
        .map_err(|e| FamilyError::program(family, Phase::Resume, e))?;
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
