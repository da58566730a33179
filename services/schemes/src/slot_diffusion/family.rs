//! The slot-diffusion family (ReFusion): every engine tick runs the next model call of every
//! active program in one packed forward.
//!
//! A program's call is a planning call (its block's masked slots), a verification call (its
//! selected drafts), a draft or verify call of iterative completion (one row per selected slot,
//! each over its own copy of the request's cache), or an autoregressive step. Every row of every
//! call becomes one attention sequence (causal in buffer order, its own position ids, its own
//! keys), so projections, norms and the MLP run once over all rows of the tick while attention
//! never mixes requests or slots. One head call then computes the logits of every row any
//! program reads; argmax, softmax maximum and the probability each read asks for are reduced on
//! the device and copied to the host together (full rows only for sampled rows).

use candle_core::Tensor;
use wavefront_engine::{Active, Family, FamilyError, FinishReason, Moved, SlotId};
use wavefront_models::transformer::{KvPool, PAGE_SIZE};
use wavefront_models::Qwen3;

use super::call::{reduce, Call, ReadOut};
use super::program::SdProgram;
use crate::paging;
use crate::tick::{entries, head_rows, to_candle};

/// One active program as a tick sees it.
pub type Entry<'a> = crate::tick::Entry<'a, SdProgram>;

/// Runs the next call of every program in `batch` through `model` in one packed forward;
/// returns the rows computed. A failure of the forward fails the tick; a program's own failure
/// goes to its outbox. With a row budget (`max_batch_rows`), `ar` prefills run in chunks of
/// what the other calls leave, and one that gets no row waits for the next tick.
pub fn tick(
    model: &Qwen3,
    batch: &mut [Entry<'_>],
    max_batch_rows: Option<usize>,
) -> candle_core::Result<usize> {
    let prefills: Vec<(usize, usize)> = batch
        .iter()
        .enumerate()
        .filter_map(|(i, e)| e.program.prefill_rows().map(|n| (i, n)))
        .collect();
    let mut calls: Vec<Option<Call>> = batch
        .iter_mut()
        .map(|e| (e.program.prefill_rows().is_none()).then(|| e.program.next_call(None)))
        .collect();
    let fixed: usize = calls.iter().flatten().map(Call::tokens).sum();
    let wants: Vec<usize> = prefills.iter().map(|p| p.1).collect();
    for (&(i, _), take) in
        prefills
            .iter()
            .zip(crate::tick::prefill_rows(max_batch_rows, fixed, &wants))
    {
        if take > 0 {
            calls[i] = Some(batch[i].program.next_call(Some(take)));
        }
    }
    let mut batch: Vec<&mut Entry<'_>> = batch
        .iter_mut()
        .zip(&calls)
        .filter(|(_, c)| c.is_some())
        .map(|(e, _)| e)
        .collect();
    let calls: Vec<Call> = calls.into_iter().flatten().collect();
    let ids: Vec<u32> = calls
        .iter()
        .flat_map(|c| c.rows.iter().flat_map(|r| r.ids.iter().copied()))
        .collect();
    if ids.is_empty() {
        return Ok(0);
    }
    let hidden = {
        let mut seqs = Vec::new();
        for (e, c) in batch.iter_mut().zip(&calls) {
            seqs.extend(e.program.sequences(c).map_err(candle_core::Error::Msg)?);
        }
        model.forward(&ids, &mut seqs).map_err(to_candle)?
    };

    // One head call over every row any program reads.
    let (mut select, mut targets, mut full) = (Vec::new(), Vec::new(), Vec::new());
    let mut offset = 0;
    for c in &calls {
        for row in &c.rows {
            for rd in &row.reads {
                if rd.full {
                    full.push(select.len() as u32);
                }
                select.push((offset + rd.at) as u32);
                targets.push(rd.target.unwrap_or(0));
            }
            offset += row.ids.len();
        }
    }
    let (reduced, mut full_rows) = match head_rows(&hidden, &select, |rows| model.logits(rows))? {
        None => (Vec::new(), Vec::new()),
        Some(logits) => {
            let reduced = reduce(&logits, &targets)?;
            let full_rows = if full.is_empty() {
                Vec::new()
            } else {
                logits
                    .index_select(&Tensor::new(full.as_slice(), logits.device())?, 0)?
                    .to_vec2::<f32>()?
            };
            (reduced, full_rows)
        }
    };
    full_rows.reverse();

    let mut at = 0;
    for (e, c) in batch.iter_mut().zip(&calls) {
        let mut outs = Vec::with_capacity(c.rows.len());
        for row in &c.rows {
            let mut mine = Vec::with_capacity(row.reads.len());
            for rd in &row.reads {
                let [argmax, max_prob, target_prob] = reduced[at];
                at += 1;
                mine.push(ReadOut {
                    argmax: argmax as u32,
                    max_prob,
                    target_prob: if rd.target.is_some() {
                        target_prob
                    } else {
                        max_prob
                    },
                    logits: if rd.full { full_rows.pop() } else { None },
                });
            }
            outs.push(mine);
        }
        if let Err(err) = e.program.commit(c, &outs, e.outbox) {
            e.outbox.fail(FamilyError::commit("slot-diffusion", err));
        }
    }
    debug_assert_eq!(at, calls.iter().map(Call::reads).sum::<usize>());
    Ok(ids.len())
}

/// The family: owns the model and the page pool of its requests' committed caches on the
/// engine thread. Slot ids granted by the engine are page ids of the pool.
pub struct SlotDiffusionFamily {
    model: Qwen3,
    pool: KvPool,
    max_batch_rows: Option<usize>,
    last_rows: Option<usize>,
}

impl SlotDiffusionFamily {
    pub fn new(model: Qwen3) -> Self {
        Self {
            model,
            pool: KvPool::shared(PAGE_SIZE),
            max_batch_rows: None,
            last_rows: None,
        }
    }

    /// Pages of `page` buffer rows (the planner's page size).
    pub fn with_page_size(mut self, page: usize) -> Self {
        self.pool = KvPool::shared(page.max(1));
        self
    }

    /// Caps the rows of a tick: `ar` prefills run in chunks of what the rest leaves.
    pub fn with_max_batch_rows(mut self, rows: Option<usize>) -> Self {
        self.max_batch_rows = rows;
        self
    }
}

impl paging::OneCache for SdProgram {
    fn cache(&mut self) -> &mut wavefront_models::transformer::KvCache {
        self.state_cache()
    }

    fn pages_needed(&self, page: usize) -> usize {
        SdProgram::pages_needed(self, page)
    }

    fn is_done(&self) -> bool {
        SdProgram::is_done(self)
    }
}

impl Family for SlotDiffusionFamily {
    type Program = SdProgram;

    fn export(&mut self, a: &mut Active<SdProgram>) -> Result<Vec<u8>, FamilyError> {
        crate::migrate::export(&a.program, "slot-diffusion")
    }

    fn tick(&mut self, batch: &mut [&mut Active<SdProgram>]) -> Result<(), FamilyError> {
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

    fn slots_needed(&self, a: &Active<SdProgram>) -> usize {
        paging::needed_one(a, &self.pool)
    }

    fn reclaim(&mut self, a: &mut Active<SdProgram>) -> Vec<SlotId> {
        paging::reclaim_one(a, &self.pool)
    }

    fn preempt(&mut self, a: &mut Active<SdProgram>) -> Result<Moved, FamilyError> {
        paging::preempt_one(a, &self.pool, "slot-diffusion")
    }

    fn resume(&mut self, a: &mut Active<SdProgram>) -> Result<Moved, FamilyError> {
        paging::resume_one(a, &self.pool, "slot-diffusion")
    }

    fn stop(&mut self, a: &mut Active<SdProgram>) {
        let stats = std::mem::take(&mut a.program.stats);
        a.outbox.finish(FinishReason::StopString, stats);
    }
}
