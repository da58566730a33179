//! The block-diffusion family (LLaDA2.0): every engine tick runs one step of every active
//! program in a single packed forward: each program's rows (its uncached blocks), block-causal
//! within the program and over its own cache, one head call over the masked rows of every
//! program's current block; then each program commits. Slot ids granted by the engine are page
//! ids of the family's pool, which holds the finished blocks' K/V.

use candle_core::Tensor;
use wavefront_engine::{Active, Family, FamilyError, FinishReason, Moved, SlotId};
use wavefront_models::transformer::{KvPool, PAGE_SIZE};
use wavefront_models::Llada2;

use super::program::{BdPlan, BdProgram};
use crate::paging;
use crate::tick::{entries, head_rows, to_candle};

pub type Entry<'a> = crate::tick::Entry<'a, BdProgram>;

/// Runs one step of every program in `batch` in one packed forward; returns the rows computed.
/// Under a row budget (`max_batch_rows`), a step whose uncached prompt blocks do not fit runs a
/// chunk of whole prompt blocks instead (see [`BdPlan`]), the others' steps whole.
pub fn tick(
    model: &Llada2,
    batch: &mut [Entry<'_>],
    max_batch_rows: Option<usize>,
) -> candle_core::Result<usize> {
    if batch.is_empty() {
        return Ok(0);
    }
    // Steps with uncached blocks before the current one are prefills that may be chunked.
    let rows: Vec<(usize, usize)> = batch.iter().map(|e| e.program.step_rows()).collect();
    let fixed: usize = rows.iter().filter(|r| r.0 == 0).map(|r| r.1).sum();
    let prefills: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].0 > 0).collect();
    let wants: Vec<usize> = prefills.iter().map(|&i| rows[i].0 + rows[i].1).collect();
    let takes = crate::tick::prefill_rows(max_batch_rows, fixed, &wants);
    let mut plans: Vec<Option<BdPlan>> = batch
        .iter()
        .map(|e| (e.program.step_rows().0 == 0).then(|| e.program.plan()))
        .collect();
    for ((&i, &want), take) in prefills.iter().zip(&wants).zip(takes) {
        let p = &batch[i].program;
        let block = rows[i].1;
        plans[i] = if take >= want {
            Some(p.plan())
        } else if take > 0 {
            // Whole blocks, at least one (a forced single row becomes one block).
            Some(p.plan_chunk(take.max(block)))
        } else {
            None
        };
    }
    let mut batch: Vec<&mut Entry<'_>> = batch
        .iter_mut()
        .zip(&plans)
        .filter(|(_, p)| p.is_some())
        .map(|(e, _)| e)
        .collect();
    let plans: Vec<BdPlan> = plans.into_iter().flatten().collect();
    let ids: Vec<u32> = plans.iter().flat_map(|p| p.ids.iter().copied()).collect();
    let hidden = {
        let mut seqs = Vec::with_capacity(plans.len());
        for (e, p) in batch.iter_mut().zip(&plans) {
            seqs.push(e.program.sequence(p));
        }
        model.forward(&ids, &mut seqs).map_err(to_candle)?
    };
    let mut select = Vec::new();
    let mut offset = 0;
    for p in &plans {
        select.extend(p.logit_rows.iter().map(|&r| (offset + r) as u32));
        offset += p.ids.len();
    }
    let logits = head_rows(&hidden, &select, |rows| model.logits(rows))?;
    let mut at = 0;
    for (e, p) in batch.iter_mut().zip(&plans) {
        let k = p.logit_rows.len();
        let mine = match &logits {
            Some(l) if k > 0 => l.narrow(0, at, k)?,
            _ => Tensor::zeros(
                (0, model.config().vocab_size),
                candle_core::DType::F32,
                model.device(),
            )?,
        };
        at += k;
        if let Err(err) = e.program.commit(p, &mine, e.outbox) {
            e.outbox.fail(FamilyError::commit("block-diffusion", err));
        }
    }
    Ok(ids.len())
}

/// The family: owns the model and the page pool of its requests' caches on the engine thread.
pub struct BlockDiffusionFamily {
    model: Llada2,
    pool: KvPool,
    max_batch_rows: Option<usize>,
    last_rows: Option<usize>,
}

impl BlockDiffusionFamily {
    pub fn new(model: Llada2) -> Self {
        Self {
            model,
            pool: KvPool::shared(PAGE_SIZE),
            max_batch_rows: None,
            last_rows: None,
        }
    }

    /// Caps the rows of a tick: prompts prefill in chunks of whole blocks.
    pub fn with_max_batch_rows(mut self, rows: Option<usize>) -> Self {
        self.max_batch_rows = rows;
        self
    }

    /// Pages of `page` buffer rows (the planner's page size).
    pub fn with_page_size(mut self, page: usize) -> Self {
        self.pool = KvPool::shared(page.max(1));
        self
    }
}

impl paging::OneCache for BdProgram {
    fn cache(&mut self) -> &mut wavefront_models::transformer::KvCache {
        &mut self.cache
    }

    fn pages_needed(&self, page: usize) -> usize {
        BdProgram::pages_needed(self, page)
    }

    fn is_done(&self) -> bool {
        BdProgram::is_done(self)
    }
}

impl Family for BlockDiffusionFamily {
    type Program = BdProgram;

    fn export(&mut self, a: &mut Active<BdProgram>) -> Result<Vec<u8>, FamilyError> {
        crate::migrate::export(&a.program, "block-diffusion")
    }

    fn tick(&mut self, batch: &mut [&mut Active<BdProgram>]) -> Result<(), FamilyError> {
        for a in batch.iter_mut() {
            paging::bind_one(a, &self.pool);
        }
        let mut entries = entries(batch, |p| !p.is_done());
        let rows =
            tick(&self.model, &mut entries, self.max_batch_rows).map_err(FamilyError::forward)?;
        self.last_rows = Some(rows);
        Ok(())
    }

    fn last_tick_rows(&self) -> Option<usize> {
        self.last_rows
    }

    fn slots_needed(&self, a: &Active<BdProgram>) -> usize {
        paging::needed_one(a, &self.pool)
    }

    fn reclaim(&mut self, a: &mut Active<BdProgram>) -> Vec<SlotId> {
        paging::reclaim_one(a, &self.pool)
    }

    fn preempt(&mut self, a: &mut Active<BdProgram>) -> Result<Moved, FamilyError> {
        paging::preempt_one(a, &self.pool, "block-diffusion")
    }

    fn resume(&mut self, a: &mut Active<BdProgram>) -> Result<Moved, FamilyError> {
        paging::resume_one(a, &self.pool, "block-diffusion")
    }

    fn stop(&mut self, a: &mut Active<BdProgram>) {
        a.program.finish(FinishReason::StopString, &mut a.outbox);
    }
}
