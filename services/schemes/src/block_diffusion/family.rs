//! The block-diffusion family (LLaDA2.0): every engine tick runs one step of every active
//! program in a single packed forward: each program's rows (its uncached blocks), block-causal
//! within the program and over its own cache, one head call over the masked rows of every
//! program's current block; then each program commits. Slot ids granted by the engine are page
//! ids of the family's pool, which holds the finished blocks' K/V.

use candle_core::Tensor;
use wavefront_engine::{
    Active, Demand, Family, FamilyError, FinishReason, Group, Moved, Planned, SlotId,
};
use wavefront_models::transformer::{KvPool, PAGE_SIZE};
use wavefront_models::Llada2;

use super::program::{BdPlan, BdProgram};
use crate::masked_diffusion::FAMILY;
use crate::packing::head_rows;
use crate::paging;
use crate::SchemeError;

/// Runs every plan of `work` in one packed forward and one head call over the masked rows of
/// every current block; returns each plan's logits `[logit_rows, vocab]` in float32.
pub(crate) fn run(
    model: &Llada2,
    work: &mut [Planned<'_, BdProgram, BdPlan>],
) -> Result<Vec<Tensor>, SchemeError> {
    let ids: Vec<u32> = work
        .iter()
        .flat_map(|w| w.plan.ids.iter().copied())
        .collect();
    let hidden = {
        let mut seqs = Vec::with_capacity(work.len());
        for w in work.iter_mut() {
            seqs.push(w.program.sequence(&w.plan));
        }
        model.forward(&ids, &mut seqs)?
    };
    let mut select = Vec::new();
    let mut offset = 0;
    for w in work.iter() {
        select.extend(w.plan.logit_rows.iter().map(|&r| (offset + r) as u32));
        offset += w.plan.ids.len();
    }
    let logits = head_rows(&hidden, &select, |rows| model.logits(rows))?;
    let mut at = 0;
    let mut outputs = Vec::with_capacity(work.len());
    for w in work.iter() {
        let k = w.plan.logit_rows.len();
        let mine = match &logits {
            Some(l) if k > 0 => l.narrow(0, at, k)?,
            _ => Tensor::zeros(
                (0, model.config().vocab_size),
                candle_core::DType::F32,
                model.device(),
            )?,
        };
        at += k;
        outputs.push(mine);
    }
    Ok(outputs)
}

/// The family: owns the model and the page pool of its requests' caches on the engine thread.
pub struct BlockDiffusionFamily {
    model: Llada2,
    pool: KvPool,
}

impl BlockDiffusionFamily {
    pub fn new(model: Llada2) -> Self {
        Self {
            model,
            pool: KvPool::shared(PAGE_SIZE),
        }
    }

    pub fn model(&self) -> &Llada2 {
        &self.model
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
    type Plan = BdPlan;
    type Output = Tensor;

    fn export(&mut self, a: &mut Active<BdProgram>) -> Result<Vec<u8>, FamilyError> {
        crate::migrate::export(&a.program, FAMILY)
    }

    /// A step with uncached blocks before the current one is a prefill that may run in chunks of
    /// whole blocks; every other step runs its block whole.
    fn demand(&self, a: &Active<BdProgram>) -> Demand {
        let p = &a.program;
        if p.is_done() {
            return Demand::Idle;
        }
        match p.step_rows() {
            (0, block) => Demand::Whole(block),
            (before, block) => Demand::Prefill(before + block),
        }
    }

    fn plan(
        &mut self,
        a: &mut Active<BdProgram>,
        rows: usize,
    ) -> Result<Option<BdPlan>, FamilyError> {
        paging::bind_one(a, &self.pool);
        let p = &a.program;
        let (before, block) = p.step_rows();
        Ok(Some(if rows >= before + block {
            p.plan()
        } else {
            // Whole blocks, at least one (a forced single row becomes one block).
            p.plan_chunk(rows.max(block))
        }))
    }

    /// One forward group: every program's step in one packed forward and one head call.
    fn run(&mut self, work: &mut [Planned<'_, BdProgram, BdPlan>]) -> Vec<Group<Tensor>> {
        vec![Group::all(
            work.len(),
            run(&self.model, work).map_err(FamilyError::forward),
        )]
    }

    fn commit(
        &mut self,
        a: &mut Active<BdProgram>,
        plan: BdPlan,
        logits: Tensor,
    ) -> Result<(), FamilyError> {
        a.program
            .commit(&plan, &logits, &mut a.outbox)
            .map_err(|e| FamilyError::commit(FAMILY, e))
    }

    fn slots_needed(&self, a: &Active<BdProgram>) -> usize {
        paging::needed_one(a, &self.pool)
    }

    fn reclaim(&mut self, a: &mut Active<BdProgram>) -> Vec<SlotId> {
        paging::reclaim_one(a, &self.pool)
    }

    fn preempt(&mut self, a: &mut Active<BdProgram>) -> Result<Moved, FamilyError> {
        paging::preempt_one(a, &self.pool, FAMILY)
    }

    fn resume(&mut self, a: &mut Active<BdProgram>) -> Result<Moved, FamilyError> {
        paging::resume_one(a, &self.pool, FAMILY)
    }

    fn stop(&mut self, a: &mut Active<BdProgram>) {
        a.program.finish(FinishReason::StopString, &mut a.outbox);
    }
}
