//! One ARMT request's state machine: the prompt's segments (sequential, or one diagonal per
//! tick), then token-by-token generation with the prompt segment's cache and frozen memories.

use std::collections::BTreeMap;

use candle_core::Tensor;
use wavefront_engine::{FinishReason, Outbox, Stats};
use wavefront_models::armt::LayerMemory;
use wavefront_models::transformer::KvCache;

use crate::sampling::TokenSampler;
use crate::tick::ends_after;

/// Where a request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The prompt's segments are running.
    Prefill,
    /// Generating: `pending` goes through the model next.
    Decode,
    /// Finished; the engine retires it.
    Done,
}

/// An ARMT request.
#[derive(Debug)]
pub struct ArmtProgram {
    prompt: Vec<u32>,
    segment_size: usize,
    segments: usize,
    diagonal: bool,
    pub(crate) phase: Phase,
    /// Every layer's memory, created on the engine thread at the first tick.
    pub(crate) memory: Option<Vec<LayerMemory>>,
    /// The prompt segment's keys and values, then the generated tokens'.
    pub(crate) cache: KvCache,
    /// Diagonal: the step (diagonal index) to run next.
    pub(crate) step: usize,
    /// Diagonal: each segment's residual stream between two layers, by segment.
    pub(crate) inflight: BTreeMap<usize, Tensor>,
    /// Sequential: the segment to run next.
    pub(crate) next_segment: usize,
    /// Decode: the token to feed next, at buffer index (and position) `position`.
    pub(crate) pending: u32,
    pub(crate) position: usize,
    sampler: TokenSampler,
    max_new_tokens: usize,
    stop_token_ids: Vec<u32>,
    generated: usize,
    pub(crate) stats: Stats,
    record: Option<Record>,
    /// How the request's slots grow (set by the planner).
    pub(crate) paging: Paging,
}

/// The slots of an ARMT request: the fixed ones (memories, diagonal residual streams) and the
/// pages of its cache, which holds one segment's cell while the prompt runs and the prompt
/// segment and the generated tokens after.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Paging {
    pub fixed: usize,
    /// Page tables of the cache: one per layer and tensor-parallel rank.
    pub tables: usize,
    /// Rows of one segment's cell (segment and memory tokens).
    pub cell_rows: usize,
    /// The most slots the request may hold.
    pub max: usize,
    /// Positions a page holds.
    pub page: usize,
}

/// What a program produced, kept when [`ArmtProgram::record`] asked for it (tests, checks).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Record {
    pub tokens: Vec<u32>,
    /// The logits row that chose each token.
    pub logits: Vec<Vec<f32>>,
    pub finish: Option<(FinishReason, Stats)>,
}

impl ArmtProgram {
    pub(crate) fn new(
        prompt: Vec<u32>,
        segment_size: usize,
        diagonal: bool,
        sampler: TokenSampler,
        max_new_tokens: usize,
        stop_token_ids: Vec<u32>,
        stats: Stats,
    ) -> Self {
        let segments = prompt.len().div_ceil(segment_size);
        Self {
            prompt,
            segment_size,
            segments,
            diagonal,
            phase: Phase::Prefill,
            memory: None,
            cache: KvCache::new(),
            step: 0,
            inflight: BTreeMap::new(),
            next_segment: 0,
            pending: 0,
            position: 0,
            sampler,
            max_new_tokens,
            stop_token_ids,
            generated: 0,
            stats,
            record: None,
            paging: Paging::default(),
        }
    }

    /// Slots the request holds after its next tick at most: the fixed ones and the cache's
    /// pages (a segment's cell while the prompt runs; one more row per decoding step).
    pub(crate) fn pages_needed(&self) -> usize {
        let p = self.paging;
        let rows = match self.phase {
            Phase::Prefill => p.cell_rows.max(self.cache.len()),
            Phase::Decode => self.cache.len() + 1,
            Phase::Done => self.cache.len(),
        };
        (p.fixed + p.tables * rows.div_ceil(p.page.max(1))).min(p.max.max(p.fixed))
    }

    /// Bytes of the memories and the in-flight residual streams.
    pub(crate) fn state_bytes(&self) -> usize {
        let memory: usize = self.memory.iter().flatten().map(LayerMemory::bytes).sum();
        let inflight: usize = self
            .inflight
            .values()
            .map(|x| x.elem_count() * x.dtype().size_in_bytes())
            .sum();
        memory + inflight
    }

    /// Moves the memories and the in-flight residual streams to `device` (host memory while
    /// the request is preempted, back on resume).
    pub(crate) fn move_state(&mut self, device: &candle_core::Device) -> candle_core::Result<()> {
        if let Some(memory) = &mut self.memory {
            for m in memory.iter_mut() {
                *m = m
                    .to_device(device)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            }
        }
        for x in self.inflight.values_mut() {
            *x = x.to_device(device)?;
        }
        Ok(())
    }

    /// Keeps every token, the logits that chose it and the final stats (one host copy of a
    /// logits row per token).
    pub fn record(&mut self) {
        self.record = Some(Record::default());
    }

    pub fn recorded(&self) -> Option<&Record> {
        self.record.as_ref()
    }

    pub(crate) fn records_logits(&self) -> bool {
        self.record.is_some()
    }

    pub(crate) fn record_logits(&mut self, row: Vec<f32>) {
        if let Some(r) = &mut self.record {
            r.logits.push(row);
        }
    }

    /// Segments of the prompt: memory segments and the prompt segment.
    pub fn segments(&self) -> usize {
        self.segments
    }

    /// Whether the prompt runs with diagonal batching.
    pub fn is_diagonal(&self) -> bool {
        self.diagonal
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The ids of segment `s`.
    pub(crate) fn segment_ids(&self, s: usize) -> &[u32] {
        let start = s * self.segment_size;
        let end = (start + self.segment_size).min(self.prompt.len());
        &self.prompt[start..end]
    }

    /// The last segment: run without memory tokens and without writes, its keys cached.
    pub(crate) fn is_prompt_segment(&self, s: usize) -> bool {
        s + 1 == self.segments
    }

    /// Diagonal prefill: the cells `(segment, layer)` of the next step, `segment + layer = step`,
    /// oldest segment (highest layer) last.
    pub(crate) fn diagonal_cells(&self, n_layers: usize) -> Vec<(usize, usize)> {
        let i = self.step;
        let first = i.saturating_sub(n_layers - 1);
        let last = i.min(self.segments - 1);
        (first..=last).rev().map(|s| (s, i - s)).collect()
    }

    /// Ends the request with its statistics and lets go of its memories.
    pub(crate) fn finish(&mut self, reason: FinishReason, outbox: &mut Outbox) {
        self.phase = Phase::Done;
        self.release();
        let stats = std::mem::take(&mut self.stats);
        if let Some(r) = &mut self.record {
            r.finish = Some((reason, stats.clone()));
        }
        outbox.finish(reason, stats);
    }

    /// Takes a token the model chose: streams it and finishes or moves on to decoding it.
    pub(crate) fn commit(&mut self, token: u32, outbox: &mut Outbox) {
        self.generated += 1;
        outbox.tokens(vec![token]);
        if let Some(r) = &mut self.record {
            r.tokens.push(token);
        }
        let reason = ends_after(
            token,
            &self.stop_token_ids,
            self.generated,
            self.max_new_tokens,
        );
        if let Some(reason) = reason {
            self.finish(reason, outbox);
            return;
        }
        if self.phase == Phase::Prefill {
            self.phase = Phase::Decode;
            self.position = self.segment_ids(self.segments - 1).len();
        } else {
            self.position += 1;
        }
        self.pending = token;
    }

    /// Chooses the next token from its logits row.
    pub(crate) fn sample(&mut self, logits: &[f32]) -> u32 {
        self.sampler.sample(logits)
    }

    pub(crate) fn is_greedy(&self) -> bool {
        self.sampler.is_greedy()
    }

    /// Drops the device state (memories, cache, in-flight segments).
    pub(crate) fn release(&mut self) {
        self.memory = None;
        self.cache.clear();
        self.inflight.clear();
    }
}
