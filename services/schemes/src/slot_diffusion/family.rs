//! The slot-diffusion family (ReFusion): every engine tick runs the next model call of every
//! active program in one packed forward.
//!
//! A program's call is a planning call (its block's masked spans), a verification call (its
//! selected drafts), a draft or verify call of iterative completion (one row per selected span,
//! each over its own copy of the request's cache), or an autoregressive step. Every row of every
//! call becomes one attention sequence (causal in buffer order, its own position ids, its own
//! keys), so projections, norms and the MLP run once over all rows of the tick while attention
//! never mixes requests or spans. One head call then computes the logits of every row any
//! program reads; argmax, softmax maximum and the probability each read asks for are reduced on
//! the device and copied to the host together (full rows only for sampled rows).

use candle_core::Tensor;
use wavefront_engine::{Demand, FinishReason, Outbox, Planned};
use wavefront_models::ModelFamily;
use wavefront_models::Qwen3;

use super::call::{reduce, Call, ReadOut};
use super::program::{Scheme, SdProgram};
use crate::packing::head_rows;
use crate::paging::{self, OneCacheFamily, Stepper};
use crate::SchemeError;

/// This family's name.
const FAMILY: &str = ModelFamily::SlotDiffusion.name();

/// Runs every call of `work` in one packed forward and one head call over every row any
/// program reads; returns each call's reads, row by row.
pub(crate) fn run(
    model: &Qwen3,
    work: &mut [Planned<'_, SdProgram, Call>],
) -> Result<Vec<Vec<Vec<ReadOut>>>, SchemeError> {
    let ids: Vec<u32> = work
        .iter()
        .flat_map(|w| w.plan.rows.iter().flat_map(|r| r.ids.iter().copied()))
        .collect();
    if ids.is_empty() {
        return Ok(work
            .iter()
            .map(|w| vec![Vec::new(); w.plan.rows.len()])
            .collect());
    }
    let hidden = {
        let mut seqs = Vec::new();
        for w in work.iter_mut() {
            seqs.extend(w.program.sequences(&w.plan)?);
        }
        model.forward(&ids, &mut seqs)?
    };

    // One head call over every row any program reads.
    let (mut select, mut targets, mut full) = (Vec::new(), Vec::new(), Vec::new());
    let mut offset = 0;
    for w in work.iter() {
        for row in &w.plan.rows {
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
    let mut outputs = Vec::with_capacity(work.len());
    for w in work.iter() {
        let mut outs = Vec::with_capacity(w.plan.rows.len());
        for row in &w.plan.rows {
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
        outputs.push(outs);
    }
    debug_assert_eq!(at, work.iter().map(|w| w.plan.reads()).sum::<usize>());
    Ok(outputs)
}

/// ReFusion's calls: one packed forward and one head call per tick.
pub struct SlotDiffusion {
    model: Qwen3,
}

/// The family: the model's calls, and the page pool of its requests' committed caches on the
/// engine thread (the slot cycle every one-cache family shares). Slot ids granted by the engine
/// are page ids of the pool.
pub type SlotDiffusionFamily = OneCacheFamily<SlotDiffusion>;

impl OneCacheFamily<SlotDiffusion> {
    pub fn new(model: Qwen3) -> Self {
        Self::with_stepper(SlotDiffusion { model })
    }

    pub fn model(&self) -> &Qwen3 {
        &self.stepper().model
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

    fn constrained(&self) -> bool {
        matches!(&self.scheme, super::program::Scheme::Ar(a) if a.constrained())
    }
}

impl Stepper for SlotDiffusion {
    type Program = SdProgram;
    type Plan = Call;
    type Output = Vec<Vec<ReadOut>>;
    const FAMILY: &'static str = FAMILY;

    /// An `ar` request's prompt may run in chunks; every other call runs whole.
    fn demand(&self, p: &SdProgram) -> Demand {
        match p.prefill_rows() {
            Some(rows) => Demand::Prefill(rows),
            None => Demand::Whole(p.next_call_rows()),
        }
    }

    fn plan(&self, p: &mut SdProgram, rows: usize) -> Result<Call, SchemeError> {
        let call = match p.prefill_rows() {
            Some(_) => p.next_call(Some(rows)),
            None => p.next_call(None),
        };
        debug_assert_eq!(call.tokens(), rows, "a call of other rows than its demand");
        Ok(call)
    }

    fn run(
        &self,
        work: &mut [Planned<'_, SdProgram, Call>],
    ) -> Result<Vec<Vec<Vec<ReadOut>>>, SchemeError> {
        run(&self.model, work)
    }

    fn commit(
        &self,
        p: &mut SdProgram,
        call: Call,
        outs: Vec<Vec<ReadOut>>,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        p.commit(&call, &outs, outbox)
    }

    fn stop(&self, p: &mut SdProgram, outbox: &mut Outbox) {
        let stats = std::mem::take(&mut p.stats);
        outbox.finish(FinishReason::StopString, stats);
    }

    /// Both schemes write the prompt's rows first, causal in position order, so they depend
    /// on its ids alone: `ar` and plan-and-infill requests share them, with each other too
    /// (a plan's masked spans come after the prompt's rows and do not change them).
    fn share_key(&self, p: &SdProgram, page: usize) -> Option<u64> {
        let (key, prompt) = match &p.scheme {
            Scheme::Ar(a) => (a.share_key(), a.prompt().len()),
            Scheme::PlanInfill(pi) => (pi.share_key(), pi.prompt().len()),
        };
        key.filter(|_| prompt > page)
    }

    fn prompt_pending(&self, p: &SdProgram) -> bool {
        match &p.scheme {
            Scheme::Ar(a) => a.prompt_pending(),
            Scheme::PlanInfill(pi) => pi.prompt_pending(),
        }
    }

    /// The whole pages of the prompts' longest common prefix before the taker's last row (the
    /// whole prompt's pages when they are the same), when the taker has run nothing and the
    /// donor's prompt rows are computed. A plan-and-infill taker reads only a whole prompt's:
    /// its first planning call runs the rows after the prompt's whole pages.
    fn shareable(&self, donor: &SdProgram, taker: &SdProgram, page: usize) -> usize {
        let (prompt, at_start, whole_only) = match &taker.scheme {
            Scheme::Ar(a) => (a.prompt(), a.at_start(), false),
            Scheme::PlanInfill(pi) => (pi.prompt(), pi.at_start(), true),
        };
        let donor_prompt = match &donor.scheme {
            Scheme::Ar(a) => a.prompt(),
            Scheme::PlanInfill(pi) => pi.prompt(),
        };
        if !at_start || self.prompt_pending(donor) || prompt.is_empty() {
            return 0;
        }
        if whole_only && donor_prompt != prompt {
            return 0;
        }
        crate::packing::common_prompt_rows(prompt, donor_prompt, page)
    }

    /// ReFusion's prompt rows depend on the ids before them alone, so an `ar` request reads the
    /// common prefix of another prompt's.
    fn prefix_rows(&self, donor: &SdProgram, taker: &SdProgram, page: usize) -> usize {
        self.shareable(donor, taker, page)
    }

    fn skip_prompt(&self, taker: &mut SdProgram, rows: usize) -> Result<(), SchemeError> {
        match &mut taker.scheme {
            Scheme::Ar(a) => a.skip_prompt(rows)?,
            // Its first planning call starts after the rows its cache holds.
            Scheme::PlanInfill(pi) => {
                if pi.main.len() != rows || rows >= pi.prompt().len() {
                    return Err(SchemeError::inconsistent(
                        "shared prompt rows do not fit the prompt",
                    ));
                }
            }
        }
        taker.stats.add_counter("shared_prompt_tokens", rows as u64);
        Ok(())
    }
}
