//! The masked-diffusion family (LLaDA, Nie et al., 2025; Dream, Ye et al., 2025): every engine
//! tick runs one step of every active program in a single packed forward.
//!
//! Each program contributes its rows (its canvas, WINO's shadow block, minus SureLock's locked
//! positions; twice with classifier-free guidance), each with its own mask rule and keys, so
//! attention never mixes requests. Then one head call computes the logits of every row any
//! program reads, and each program commits its own slice. Requests in different blocks, with
//! different canvases or schemes share the forward.

use candle_core::Tensor;
use wavefront_engine::{
    Active, Demand, Family, FamilyError, FinishReason, Group, Moved, Phase, Planned, SlotId,
};
use wavefront_models::arena::ArenaPool;
use wavefront_models::transformer::{Keys, KvPool, SeqInput};
use wavefront_models::ModelFamily;

use super::network::MdNetwork;
use super::program::{MdProgram, StepPlan};
use super::surelock::POSTERIOR_ARENA;
use crate::packing::head_rows;
use crate::SchemeError;

/// This family's name.
const FAMILY: &str = ModelFamily::MaskedDiffusion.name();

/// Runs every plan of `plans` (with its program, for SureLock's cached keys) in one packed
/// forward and one head call over every row any plan reads; returns each plan's logits
/// `[logit_rows, head_rows]` in float32, classifier-free guidance applied.
pub(crate) fn run<M: MdNetwork>(
    model: &M,
    work: &mut [Planned<'_, MdProgram, StepPlan>],
) -> Result<Vec<Tensor>, SchemeError> {
    let mut ids = Vec::new();
    for w in work.iter() {
        ids.extend_from_slice(&w.plan.ids);
        if let Some(u) = &w.plan.uncond_ids {
            ids.extend_from_slice(u);
        }
    }
    let hidden = {
        let mut seqs = Vec::with_capacity(work.len() * 2);
        for w in work.iter_mut() {
            let Planned { program, plan: p } = w;
            let keys = match (p.buffer_len, program.kv.as_mut()) {
                (Some(len), Some(cache)) => Keys::Buffer { cache, len },
                _ => Keys::Rows,
            };
            seqs.push(SeqInput {
                index: p.index.clone(),
                positions: p.positions.clone(),
                mask: p.mask,
                keys,
            });
            if p.uncond_ids.is_some() {
                seqs.push(SeqInput {
                    index: p.index.clone(),
                    positions: p.positions.clone(),
                    mask: p.mask,
                    keys: Keys::Rows,
                });
            }
        }
        model.forward(&ids, &mut seqs)?
    };

    // One head call over every row any program reads.
    let mut select = Vec::new();
    let mut offset = 0;
    for w in work.iter() {
        let p = &w.plan;
        let n = p.index.len();
        select.extend(p.logit_rows.iter().map(|&r| (offset + r) as u32));
        offset += n;
        if p.uncond_ids.is_some() {
            select.extend(p.logit_rows.iter().map(|&r| (offset + r) as u32));
            offset += n;
        }
    }
    let logits = head_rows(&hidden, &select, |rows| model.logits(rows))?;

    let mut at = 0;
    let mut outputs = Vec::with_capacity(work.len());
    for w in work.iter() {
        let p = &w.plan;
        let k = p.logit_rows.len();
        let mine = match &logits {
            Some(l) if k > 0 => {
                let cond = l.narrow(0, at, k)?;
                at += k;
                if p.uncond_ids.is_some() {
                    let un = l.narrow(0, at, k)?;
                    at += k;
                    // Upstream: un_logits + (cfg_scale + 1) * (logits - un_logits).
                    let scale = f64::from(w.program.cfg_scale) + 1.0;
                    (&un + ((cond - &un)? * scale)?)?
                } else {
                    cond
                }
            }
            _ => Tensor::zeros(
                (0, model.head_rows()),
                candle_core::DType::F32,
                model.device(),
            )?,
        };
        outputs.push(mine);
    }
    Ok(outputs)
}

/// The family: owns the model on the engine thread, the pool of SureLock's caches (a page is
/// one row's K/V in one layer of one rank, and the slot ids the engine grants a SureLock request
/// are its cache's page ids) and the pool of SureLock's previous posteriors (a slot is one
/// position's; the engine counts them in its own slots). The rest of a request's slots count
/// its step's working set.
pub struct MaskedDiffusionFamily<M> {
    model: M,
    pool: KvPool,
    /// SureLock's previous posteriors: a slot is one position's float32 log-posteriors.
    posteriors: ArenaPool,
}

impl<M: MdNetwork> MaskedDiffusionFamily<M> {
    pub fn model(&self) -> &M {
        &self.model
    }

    pub fn new(model: M) -> Self {
        let posteriors = ArenaPool::new(
            &[model.head_rows()],
            candle_core::DType::F32,
            model.device(),
            POSTERIOR_ARENA,
        );
        Self {
            model,
            pool: KvPool::shared(1),
            posteriors,
        }
    }

    /// Stores the K/V rows of its caches as `kv_dtype` in host memory (`LoadOptions::kv_store`).
    pub fn with_kv_store(mut self, kv_dtype: Option<candle_core::DType>) -> Self {
        self.pool = KvPool::shared_storing(1, kv_dtype);
        self
    }

    /// Hands the slots granted to `a` to its SureLock cache (moved into the pool at its first
    /// tick: programs are built outside the engine thread).
    fn bind(&self, a: &mut Active<MdProgram>) {
        let new = a.take_new_slots();
        if let Some(kv) = &mut a.program.kv {
            crate::paging::bind(kv, &self.pool, new);
        }
        if let Some(sl) = &mut a.program.surelock {
            sl.bind_pool(&self.posteriors);
        }
    }
}

impl<M: MdNetwork> Family for MaskedDiffusionFamily<M> {
    type Program = MdProgram;
    type Plan = StepPlan;
    type Output = Tensor;

    fn export(&mut self, a: &mut Active<MdProgram>) -> Result<Vec<u8>, FamilyError> {
        crate::migrate::export_unless_constrained(&a.program, FAMILY, a.program.constrained)
    }

    fn pool_bytes(&self) -> u64 {
        self.pool.allocated_bytes() + self.posteriors.allocated_bytes()
    }

    fn demand(&self, a: &Active<MdProgram>) -> Demand {
        Demand::Whole(a.program.step_rows())
    }

    fn plan(
        &mut self,
        a: &mut Active<MdProgram>,
        _rows: usize,
    ) -> Result<Option<StepPlan>, FamilyError> {
        self.bind(a);
        Ok(Some(a.program.plan()))
    }

    /// One forward group: every program's step in one packed forward and one head call.
    fn run(&mut self, work: &mut [Planned<'_, MdProgram, StepPlan>]) -> Vec<Group<Tensor>> {
        vec![Group::all(
            work.len(),
            run(&self.model, work).map_err(FamilyError::forward),
        )]
    }

    fn commit(
        &mut self,
        a: &mut Active<MdProgram>,
        plan: StepPlan,
        logits: Tensor,
    ) -> Result<(), FamilyError> {
        let copies: u64 = if plan.uncond_ids.is_some() { 2 } else { 1 };
        let (rows, dense) = (plan.index.len() as u64, plan.dense_rows as u64);
        a.program.account(
            copies * self.model.algorithmic_flops(rows, dense),
            copies * self.model.algorithmic_flops(dense, dense),
        );
        a.program
            .commit(&plan, &logits, &mut a.outbox)
            .map_err(|e| FamilyError::commit(FAMILY, e))
    }

    /// What it holds (its reservation, shrinking after each tick through `reclaim`); for a
    /// preempted or imported request, which holds nothing, what its program needs from now on.
    fn slots_needed(&self, a: &Active<MdProgram>) -> usize {
        a.slots.len().max(a.keeps(a.program.slots_needed()))
    }

    /// SureLock's cache goes to host memory with the previous posteriors; the rest of the
    /// program (canvas, schedule, generator) is host state already.
    fn preempt(&mut self, a: &mut Active<MdProgram>) -> Result<Moved, FamilyError> {
        self.bind(a);
        let mut moved = match &mut a.program.kv {
            Some(kv) => crate::paging::swap_out(kv, FAMILY)?,
            None => Moved::default(),
        };
        if let Some(sl) = &mut a.program.surelock {
            moved.bytes += sl
                .previous_to_host()
                .map_err(|e| FamilyError::program(FAMILY, Phase::Preempt, e))?;
        }
        Ok(moved)
    }

    fn resume(&mut self, a: &mut Active<MdProgram>) -> Result<Moved, FamilyError> {
        self.bind(a);
        let mut moved = match &mut a.program.kv {
            Some(kv) => crate::paging::swap_in(kv, FAMILY)?,
            None => Moved::default(),
        };
        if let Some(sl) = &mut a.program.surelock {
            moved.bytes += sl
                .previous_to_pool()
                .map_err(|e| FamilyError::program(FAMILY, Phase::Resume, e))?;
        }
        Ok(moved)
    }

    fn stop(&mut self, a: &mut Active<MdProgram>) {
        a.program.finish(FinishReason::StopString, &mut a.outbox);
    }

    /// Slots a request no longer needs: all of the rows a stop token cut off, and the
    /// posteriors of rows SureLock locked (whose posterior slots went back as they locked).
    fn reclaim(&mut self, a: &mut Active<MdProgram>) -> Vec<SlotId> {
        let need = a.keeps(a.program.slots_needed());
        let held = a.slots.len();
        if need >= held {
            return Vec::new();
        }
        match &mut a.program.kv {
            // The ids are the cache's pages: give back ones it does not use.
            Some(kv) => crate::paging::reclaim(kv, held, need),
            None => a.slots[need..].to_vec(),
        }
    }
}
