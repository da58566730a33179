//! The masked-diffusion family (LLaDA, Nie et al., 2025; Dream, Ye et al., 2025): every engine
//! tick runs one step of every active program in a single packed forward.
//!
//! Each program contributes its rows (its canvas, WINO's shadow block, minus SureLock's locked
//! positions; twice with classifier-free guidance), each with its own mask rule and keys, so
//! attention never mixes requests. Then one head call computes the logits of every row any
//! program reads, and each program commits its own slice. Requests in different blocks, with
//! different canvases or schemes share the forward.

use candle_core::Tensor;
use wavefront_engine::{Active, Family, FamilyError, FinishReason, Moved, SlotId};
use wavefront_models::slot_pool::SlotPool;
use wavefront_models::transformer::{Keys, KvPool, SeqInput};

use super::network::MdNetwork;
use super::program::{MdProgram, StepPlan};
use super::surelock::POSTERIOR_ARENA;
use crate::tick::{entries, head_rows, to_candle};

/// One active program as a tick sees it.
pub type Entry<'a> = crate::tick::Entry<'a, MdProgram>;

/// Runs one step of every program in `batch` through `model` in one packed forward; returns the
/// rows computed. A failure of the forward fails the tick; a program's own failure goes to its
/// outbox.
pub fn tick<M: MdNetwork>(model: &M, batch: &mut [Entry<'_>]) -> candle_core::Result<usize> {
    if batch.is_empty() {
        return Ok(0);
    }
    let plans: Vec<StepPlan> = batch.iter().map(|e| e.program.plan()).collect();
    let mut ids = Vec::new();
    for p in &plans {
        ids.extend_from_slice(&p.ids);
        if let Some(u) = &p.uncond_ids {
            ids.extend_from_slice(u);
        }
    }
    let hidden = {
        let mut seqs = Vec::with_capacity(plans.len() * 2);
        for (e, p) in batch.iter_mut().zip(&plans) {
            let keys = match (p.buffer_len, e.program.surelock.as_mut()) {
                (Some(len), Some(sl)) => Keys::Buffer {
                    cache: &mut sl.cache,
                    len,
                },
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
        model.forward(&ids, &mut seqs).map_err(to_candle)?
    };

    // One head call over every row any program reads.
    let mut select = Vec::new();
    let mut offset = 0;
    for p in &plans {
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
    for (e, p) in batch.iter_mut().zip(&plans) {
        let k = p.logit_rows.len();
        let copies: u64 = if p.uncond_ids.is_some() { 2 } else { 1 };
        let (rows, dense) = (p.index.len() as u64, p.dense_rows as u64);
        e.program.account(
            copies * model.algorithmic_flops(rows, dense),
            copies * model.algorithmic_flops(dense, dense),
        );
        let mine = match &logits {
            Some(l) if k > 0 => {
                let cond = l.narrow(0, at, k)?;
                at += k;
                if p.uncond_ids.is_some() {
                    let un = l.narrow(0, at, k)?;
                    at += k;
                    // Upstream: un_logits + (cfg_scale + 1) * (logits - un_logits).
                    let scale = f64::from(e.program.cfg_scale) + 1.0;
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
        if let Err(err) = e.program.commit(p, &mine, e.outbox) {
            e.outbox.fail(FamilyError::commit("masked-diffusion", err));
        }
    }
    Ok(ids.len())
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
    posteriors: SlotPool,
    last_rows: Option<usize>,
}

impl<M: MdNetwork> MaskedDiffusionFamily<M> {
    pub fn new(model: M) -> Self {
        let posteriors = SlotPool::new(
            &[model.head_rows()],
            candle_core::DType::F32,
            model.device(),
            POSTERIOR_ARENA,
        );
        Self {
            model,
            pool: KvPool::shared(1),
            posteriors,
            last_rows: None,
        }
    }

    /// Hands the slots granted to `a` to its SureLock cache (moved into the pool at its first
    /// tick: programs are built outside the engine thread).
    fn bind(&self, a: &mut Active<MdProgram>) {
        let new = a.take_new_slots();
        if let Some(sl) = &mut a.program.surelock {
            crate::paging::bind(&mut sl.cache, &self.pool, new);
            sl.bind_pool(&self.posteriors);
        }
    }
}

impl<M: MdNetwork> Family for MaskedDiffusionFamily<M> {
    type Program = MdProgram;

    fn export(&mut self, a: &mut Active<MdProgram>) -> Result<Vec<u8>, FamilyError> {
        crate::migrate::export(&a.program, "masked-diffusion")
    }

    fn tick(&mut self, batch: &mut [&mut Active<MdProgram>]) -> Result<(), FamilyError> {
        for a in batch.iter_mut() {
            self.bind(a);
        }
        let mut entries = entries(batch, |_| true);
        let rows = tick(&self.model, &mut entries).map_err(FamilyError::forward)?;
        self.last_rows = Some(rows);
        Ok(())
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
        let Some(sl) = &mut a.program.surelock else {
            return Ok(Moved::default());
        };
        let mut moved = crate::paging::swap_out(&mut sl.cache, "masked-diffusion")?;
        moved.bytes += sl
            .previous_to_host()
            .map_err(|e| FamilyError::commit("masked-diffusion", e))?;
        Ok(moved)
    }

    fn resume(&mut self, a: &mut Active<MdProgram>) -> Result<Moved, FamilyError> {
        self.bind(a);
        let Some(sl) = &mut a.program.surelock else {
            return Ok(Moved::default());
        };
        let mut moved = crate::paging::swap_in(&mut sl.cache, "masked-diffusion")?;
        moved.bytes += sl
            .previous_to_pool()
            .map_err(|e| FamilyError::commit("masked-diffusion", e))?;
        Ok(moved)
    }

    fn stop(&mut self, a: &mut Active<MdProgram>) {
        a.program.finish(FinishReason::StopString, &mut a.outbox);
    }

    fn last_tick_rows(&self) -> Option<usize> {
        self.last_rows
    }

    /// Slots a request no longer needs: all of the rows a stop token cut off, and the
    /// posteriors of rows SureLock locked (whose posterior slots went back as they locked).
    fn reclaim(&mut self, a: &mut Active<MdProgram>) -> Vec<SlotId> {
        let need = a.keeps(a.program.slots_needed());
        let held = a.slots.len();
        if need >= held {
            return Vec::new();
        }
        match &mut a.program.surelock {
            // The ids are the cache's pages: give back ones it does not use.
            Some(sl) => crate::paging::reclaim(&mut sl.cache, held, need),
            None => a.slots[need..].to_vec(),
        }
    }
}
