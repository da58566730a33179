//! A slot-diffusion request's program: plan-and-infill or plain autoregression, behind one
//! interface the family packs: the next call, the attention sequences of its rows (borrowing the
//! program's caches), and the commit of the call's results.

use wavefront_engine::{Outbox, Stats};
use wavefront_models::transformer::{Keys, KvCache, MaskRule, SeqInput};

use super::ar::ArDecode;
use super::call::{Call, CallRow, ReadOut};
use super::plan_infill::{CallRecord, IterationRecord, PlanInfill, Recorder};
use crate::SchemeError;

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) enum Scheme {
    PlanInfill(Box<PlanInfill>),
    Ar(Box<ArDecode>),
}

/// One request's decoding state.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct SdProgram {
    pub(crate) scheme: Scheme,
    pub(crate) stats: Stats,
    /// Page tables of the request's committed cache: one per layer and tensor-parallel rank.
    kv_tables: usize,
    /// Slots (pages) the request may hold at most.
    max_pages: usize,
}

impl SdProgram {
    pub(crate) fn new(scheme: Scheme, kv_tables: usize, max_pages: usize) -> Self {
        let mut stats = Stats::default();
        if matches!(scheme, Scheme::PlanInfill(_)) {
            stats.add_counter("blocks", 1);
        }
        Self {
            scheme,
            stats,
            kv_tables,
            max_pages,
        }
    }

    /// The cache that holds the request's state between ticks (the committed cache of
    /// plan-and-infill, the sequence's cache of `ar`): the one in the family's page pool, and the
    /// only cache a program has.
    pub(crate) fn state_cache(&mut self) -> &mut KvCache {
        match &mut self.scheme {
            Scheme::PlanInfill(p) => &mut p.main,
            Scheme::Ar(a) => &mut a.cache,
        }
    }

    /// Pages the state cache holds after the next call at most: `ar` writes its pending
    /// tokens; a plan-and-infill commit appends at most one block (the first, the prompt too).
    pub(crate) fn pages_needed(&self, page_size: usize) -> usize {
        let rows = match &self.scheme {
            Scheme::PlanInfill(p) => p.rows_after_next_commit(),
            Scheme::Ar(a) => a.rows_after_next_call(),
        };
        (self.kv_tables * rows.div_ceil(page_size)).min(self.max_pages)
    }

    /// Keeps a record of every iteration and model call (plan-and-infill).
    pub fn record(&mut self) {
        if let Scheme::PlanInfill(p) = &mut self.scheme {
            p.record = Some(Recorder::default());
        }
    }

    /// The recorded iterations.
    pub fn iterations(&self) -> &[IterationRecord] {
        match &self.scheme {
            Scheme::PlanInfill(p) => p.record.as_ref().map_or(&[], |r| &r.iterations),
            Scheme::Ar(_) => &[],
        }
    }

    /// The recorded model calls.
    pub fn calls(&self) -> &[CallRecord] {
        match &self.scheme {
            Scheme::PlanInfill(p) => p.record.as_ref().map_or(&[], |r| &r.calls),
            Scheme::Ar(_) => &[],
        }
    }

    /// The plan-and-infill state (`None` for `ar`).
    pub fn plan_infill(&self) -> Option<&PlanInfill> {
        match &self.scheme {
            Scheme::PlanInfill(p) => Some(p),
            Scheme::Ar(_) => None,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        match &self.scheme {
            Scheme::PlanInfill(p) => p.is_done(),
            Scheme::Ar(a) => a.is_done(),
        }
    }

    /// Prompt tokens an `ar` request has still to run (a prefill that may go in chunks);
    /// `None` for every other call (decoding steps and plan-and-infill calls run whole).
    pub(crate) fn prefill_rows(&self) -> Option<usize> {
        match &self.scheme {
            Scheme::Ar(a) if a.pending() > 1 => Some(a.call_rows()),
            _ => None,
        }
    }

    /// Rows the next call computes (an `ar` request's whole pending prefill).
    pub(crate) fn next_call_rows(&self) -> usize {
        match &self.scheme {
            Scheme::PlanInfill(p) => p.next_call_rows(),
            Scheme::Ar(a) => a.pending(),
        }
    }

    /// The next model call; `rows` caps an `ar` prefill's (a chunk of its prompt).
    pub(crate) fn next_call(&mut self, rows: Option<usize>) -> Call {
        let call = match &mut self.scheme {
            Scheme::PlanInfill(p) => p.next_call(),
            Scheme::Ar(a) => a.next_call(rows),
        };
        self.stats.forward_passes += 1;
        self.stats
            .push_series("rows_per_call", call.tokens() as u32);
        call
    }

    /// The attention sequences of `call`'s rows, in row order, written in place in the program's
    /// cache (see [`PlanInfill::sequences`]).
    pub(crate) fn sequences(&mut self, call: &Call) -> Result<Vec<SeqInput<'_>>, SchemeError> {
        match &mut self.scheme {
            Scheme::PlanInfill(p) => p.sequences(call),
            Scheme::Ar(a) => {
                let row = call
                    .rows
                    .first()
                    .ok_or_else(|| SchemeError::inconsistent("an empty call"))?;
                let start = a.cache.len();
                Ok(vec![seq(
                    row,
                    start,
                    Keys::Buffer {
                        len: start + row.ids.len(),
                        cache: &mut a.cache,
                    },
                )])
            }
        }
    }

    pub(crate) fn commit(
        &mut self,
        call: &Call,
        outs: &[Vec<ReadOut>],
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        match &mut self.scheme {
            Scheme::PlanInfill(p) => p.commit(call, outs, &mut self.stats, outbox),
            Scheme::Ar(a) => a.commit(call, outs, &mut self.stats, outbox),
        }
    }
}

/// Row `row` appended at buffer index `start`, causal in buffer order.
fn seq<'a>(row: &CallRow, start: usize, keys: Keys<'a>) -> SeqInput<'a> {
    SeqInput {
        index: (start as u32..(start + row.ids.len()) as u32).collect(),
        positions: row.positions.clone(),
        mask: MaskRule::Causal,
        keys,
    }
}
