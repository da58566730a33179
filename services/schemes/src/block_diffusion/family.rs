//! The block-diffusion family (LLaDA2.0): every engine tick runs one step of every active
//! program in a single packed forward: each program's rows (its uncached blocks), block-causal
//! within the program and over its own cache, one head call over the masked rows of every
//! program's current block; then each program commits. Slot ids granted by the engine are page
//! ids of the family's pool, which holds the finished blocks' K/V.

use candle_core::Tensor;
use wavefront_engine::{Demand, FinishReason, Outbox, Planned};
use wavefront_models::{Llada2, ModelFamily};

use super::program::{BdPlan, BdProgram};
use crate::packing::head_rows;
use crate::paging::{self, OneCacheFamily, Stepper};
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

/// This family's name.
const FAMILY: &str = ModelFamily::MaskedDiffusion.name();

/// LLaDA2.0's steps: one packed forward and one head call per tick.
pub struct BlockDiffusion {
    model: Llada2,
}

/// The family: the model's steps, and the page pool of its requests' caches on the engine
/// thread (the slot cycle every one-cache family shares).
pub type BlockDiffusionFamily = OneCacheFamily<BlockDiffusion>;

impl OneCacheFamily<BlockDiffusion> {
    pub fn new(model: Llada2) -> Self {
        Self::with_stepper(BlockDiffusion { model })
    }

    pub fn model(&self) -> &Llada2 {
        &self.stepper().model
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

    fn constrained(&self) -> bool {
        BdProgram::constrained(self)
    }
}

impl Stepper for BlockDiffusion {
    type Program = BdProgram;
    type Plan = BdPlan;
    type Output = Tensor;
    const FAMILY: &'static str = FAMILY;

    /// A step with uncached blocks before the current one is a prefill that may run in chunks of
    /// whole blocks; every other step runs its block whole.
    fn demand(&self, p: &BdProgram) -> Demand {
        match p.step_rows() {
            (0, block) => Demand::Whole(block),
            (before, block) => Demand::Prefill(before + block),
        }
    }

    fn plan(&self, p: &mut BdProgram, rows: usize) -> Result<BdPlan, SchemeError> {
        let (before, block) = p.step_rows();
        Ok(if rows >= before + block {
            p.plan()
        } else {
            // Whole blocks, at least one (a forced single row becomes one block).
            p.plan_chunk(rows.max(block))
        })
    }

    fn run(&self, work: &mut [Planned<'_, BdProgram, BdPlan>]) -> Result<Vec<Tensor>, SchemeError> {
        run(&self.model, work)
    }

    fn commit(
        &self,
        p: &mut BdProgram,
        plan: BdPlan,
        logits: Tensor,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        p.commit(&plan, &logits, outbox)
    }

    fn stop(&self, p: &mut BdProgram, outbox: &mut Outbox) {
        p.finish(FinishReason::StopString, outbox);
    }

    fn share_key(&self, p: &BdProgram, page: usize) -> Option<u64> {
        p.share_key(page)
    }

    fn prompt_pending(&self, p: &BdProgram) -> bool {
        p.prompt_pending()
    }

    fn shareable(&self, donor: &BdProgram, taker: &BdProgram, page: usize) -> usize {
        taker.shareable(donor, page)
    }

    fn skip_prompt(&self, taker: &mut BdProgram, rows: usize) -> Result<(), SchemeError> {
        taker.skip_prompt(rows)
    }
}
