//! One ARMT request's state machine: the prompt's segments (sequential, or one diagonal per
//! tick), then token-by-token generation with the prompt segment's cache and frozen memories.

use std::collections::BTreeMap;

use wavefront_engine::{FinishReason, Outbox, Stats, TokenLogprob};
use wavefront_models::arena::Pooled;
use wavefront_models::armt::{LayerMemory, MemoryUpdate};
use wavefront_models::transformer::KvCache;

use crate::packing::ends_after;
use crate::sampling::{guided_pick, TokenSampler};
use crate::SchemeError;

/// Where a request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Phase {
    /// The prompt's segments are running.
    Prefill,
    /// Generating: `pending` goes through the model next.
    Decode,
    /// Finished; the engine retires it.
    Done,
}

/// One tick's work for one program, planned before the forwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArmtPlan {
    /// Diagonal prefill: the cells `(segment, layer)` of the next diagonal, in grouped order.
    Diagonal { cells: Vec<(usize, usize)> },
    /// Sequential prefill: segment `segment` through every layer; `prompt`: the prompt segment
    /// (its keys kept, a token chosen), else a memory segment (it writes every layer's memory).
    Segment { segment: usize, prompt: bool },
    /// Decoding: `token` at buffer index and position `position`.
    Decode { token: u32, position: usize },
    /// Nothing to run (finished).
    Idle,
}

/// What the forwards produced for one plan; the program applies it in [`ArmtProgram::commit`].
#[derive(Debug, Default)]
pub struct ArmtOutput {
    /// Diagonal: each cell's output residual stream (in a slot of the model's stream pool
    /// when a layer above still reads it) and memory write, in the plan's order.
    pub cells: Vec<(Pooled, Option<MemoryUpdate>)>,
    /// Sequential segment: each layer's memory write (memory segments).
    pub writes: Vec<Option<MemoryUpdate>>,
    /// The token chosen on the device (greedy requests), where the plan chooses one.
    pub token: Option<u32>,
    /// The logits row that chooses it (a sampling request, or one recording its logits).
    pub logits: Option<Vec<f32>>,
    /// With prompt scoring: the entries of each segment that reached the top layer this tick,
    /// by segment (row j's: the token after it, in this segment or the next).
    pub scored: Vec<(usize, Vec<TokenLogprob>)>,
}

/// An ARMT request.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
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
    /// Diagonal: each segment's residual stream between two layers, by segment (in slots of
    /// the model's stream pool while the request runs).
    pub(crate) inflight: BTreeMap<usize, Pooled>,
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
    #[serde(skip)]
    record: Option<Record>,
    /// How the request's slots grow (set by the planner).
    pub(crate) paging: Paging,
    /// With `prompt_logprobs`: each scored prompt position's entry, until the prompt segment
    /// chooses the first token and they are sent.
    #[serde(default)]
    pub(crate) prompt_scores: Option<BTreeMap<usize, TokenLogprob>>,
    /// The structured-output constraint, when the request has one (it does not travel to
    /// another worker: `constrained` says it had one).
    #[serde(skip)]
    pub(crate) guide: Option<crate::constraint::Guide>,
    #[serde(default)]
    pub(crate) constrained: bool,
    /// The prompt-sharing key of the memory segments (their ids, the segment size and the
    /// execution), computed once; `None` with one segment or a scored prompt.
    #[serde(default)]
    key: Option<u64>,
}

/// The slots of an ARMT request: the fixed ones (memories, diagonal residual streams) and the
/// pages of its cache, which holds one segment's cell while the prompt runs and the prompt
/// segment and the generated tokens after.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
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
        let prompt_scores = sampler.params().prompt_logprobs.map(|_| BTreeMap::new());
        // The memories after the prompt depend on its memory segments' ids (all but the last
        // segment) and how they ran.
        let memory_ids = segments.saturating_sub(1) * segment_size;
        let key = (prompt_scores.is_none() && memory_ids > 0).then(|| {
            crate::packing::key_of(&("armt", segment_size, diagonal, &prompt[..memory_ids]))
        });
        Self {
            key,
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
            prompt_scores,
            guide: None,
            constrained: false,
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
        let inflight: usize = self.inflight.values().map(Pooled::bytes).sum();
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
            *x = x
                .to_device(device)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
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
    /// Segment `s`'s scoring targets: each row's next prompt token (in this segment or the next;
    /// none after the prompt's last), and the alternatives asked for.
    pub(crate) fn score_targets(&self, s: usize) -> Option<(Vec<Option<u32>>, usize)> {
        let top = self.sampler.params().prompt_logprobs?;
        self.prompt_scores.as_ref()?;
        let start = s * self.segment_size;
        let n = self.segment_ids(s).len();
        Some((
            (0..n)
                .map(|j| self.prompt.get(start + j + 1).copied())
                .collect(),
            top,
        ))
    }

    pub(crate) fn segment_ids(&self, s: usize) -> &[u32] {
        let start = s * self.segment_size;
        let end = (start + self.segment_size).min(self.prompt.len());
        &self.prompt[start..end]
    }

    /// The prompt-sharing key ([`Self::new`]).
    pub(crate) fn share_key(&self) -> Option<u64> {
        self.key
    }

    /// Whether the prompt's segments are still running (the memories are final after them:
    /// decoding reads them without writing).
    pub(crate) fn prompt_pending(&self) -> bool {
        self.phase == Phase::Prefill
    }

    /// Tokens of the memory segments (every segment but the prompt segment).
    fn memory_ids(&self) -> &[u32] {
        &self.prompt[..self.segments.saturating_sub(1) * self.segment_size]
    }

    /// Whether this request, which has run nothing, may take `donor`'s memories as its own:
    /// the same memory segments, run the same way, and `donor`'s prompt done.
    pub(crate) fn can_take_memories_of(&self, donor: &ArmtProgram) -> bool {
        let fresh = self.phase == Phase::Prefill
            && self.memory.is_none()
            && self.next_segment == 0
            && self.step == 0
            && self.inflight.is_empty()
            && self.cache.is_empty();
        fresh
            && self.key.is_some()
            && !donor.prompt_pending()
            && donor.memory.is_some()
            && donor.segment_size == self.segment_size
            && donor.diagonal == self.diagonal
            && donor.memory_ids() == self.memory_ids()
    }

    /// The memories of a request with the same memory segments (copies in this request's
    /// slots): the memory segments are not run again, the prompt segment runs next, as one
    /// segment through every layer. Returns the prompt tokens skipped.
    pub(crate) fn take_memories(&mut self, memory: Vec<LayerMemory>) -> usize {
        self.memory = Some(memory);
        self.next_segment = self.segments - 1;
        self.diagonal = false;
        let skipped = self.memory_ids().len();
        self.stats
            .add_counter("shared_prompt_tokens", skipped as u64);
        skipped
    }

    /// The donor's memories (for [`Self::take_memories`] of a copy).
    pub(crate) fn memories(&self) -> Option<&[LayerMemory]> {
        self.memory.as_deref()
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

    /// Ends the request with its statistics. Its memories stay until the family releases it:
    /// the prefix cache may keep them for a later request with its memory segments.
    pub(crate) fn finish(&mut self, reason: FinishReason, outbox: &mut Outbox) {
        self.phase = Phase::Done;
        let stats = std::mem::take(&mut self.stats);
        if let Some(r) = &mut self.record {
            r.finish = Some((reason, stats.clone()));
        }
        outbox.finish(reason, stats);
    }

    /// Rows the next step computes: every cell's segment (with `mem_tokens` memory rows for a
    /// memory segment), or one decoding row.
    pub(crate) fn step_rows(&self, n_layers: usize, mem_tokens: usize) -> usize {
        let segment_rows = |s: usize| {
            let extra = if self.is_prompt_segment(s) {
                0
            } else {
                mem_tokens
            };
            self.segment_ids(s).len() + extra
        };
        match self.phase {
            Phase::Done => 0,
            Phase::Decode => 1,
            Phase::Prefill if self.diagonal => self
                .diagonal_cells(n_layers)
                .into_iter()
                .map(|(s, _)| segment_rows(s))
                .sum(),
            Phase::Prefill => segment_rows(self.next_segment),
        }
    }

    /// The work of the next tick.
    pub(crate) fn plan(&self, n_layers: usize) -> ArmtPlan {
        match self.phase {
            Phase::Done => ArmtPlan::Idle,
            Phase::Decode => ArmtPlan::Decode {
                token: self.pending,
                position: self.position,
            },
            Phase::Prefill if self.diagonal => ArmtPlan::Diagonal {
                cells: self.diagonal_cells(n_layers),
            },
            Phase::Prefill => ArmtPlan::Segment {
                segment: self.next_segment,
                prompt: self.is_prompt_segment(self.next_segment),
            },
        }
    }

    /// Applies what `plan`'s forwards produced: memory writes, residual streams moving up a
    /// layer, statistics, and the chosen token (streamed; it finishes the request or is decoded
    /// next).
    pub(crate) fn commit(
        &mut self,
        plan: &ArmtPlan,
        out: ArmtOutput,
        n_layers: usize,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        let no_memories = || SchemeError::inconsistent("no memories");
        match plan {
            ArmtPlan::Idle => return Ok(()),
            ArmtPlan::Diagonal { cells } => {
                if out.cells.len() != cells.len() {
                    return Err(SchemeError::inconsistent(format!(
                        "{} cell outputs for {} cells",
                        out.cells.len(),
                        cells.len()
                    )));
                }
                let memory = self.memory.as_mut().ok_or_else(no_memories)?;
                for (&(s, l), (hidden, update)) in cells.iter().zip(out.cells) {
                    if let Some(u) = update {
                        memory[l].apply(u)?;
                    }
                    if l + 1 < n_layers {
                        self.inflight.insert(s, hidden);
                    } else {
                        self.inflight.remove(&s);
                    }
                }
                self.step += 1;
                self.stats.add_counter("grouped_steps", 1);
                self.stats.push_series("cells_per_step", cells.len() as u32);
            }
            ArmtPlan::Segment { .. } => {
                let memory = self.memory.as_mut().ok_or_else(no_memories)?;
                for (l, u) in out.writes.into_iter().enumerate() {
                    if let Some(u) = u {
                        memory
                            .get_mut(l)
                            .ok_or_else(|| SchemeError::inconsistent("a write past the layers"))?
                            .apply(u)?;
                    }
                }
                self.next_segment += 1;
                self.stats.add_counter("grouped_steps", n_layers as u64);
                for _ in 0..n_layers {
                    self.stats.push_series("cells_per_step", 1);
                }
            }
            ArmtPlan::Decode { .. } => {}
        }
        self.stats.forward_passes += 1;
        if let Some(scores) = &mut self.prompt_scores {
            for (s, entries) in out.scored {
                let start = s * self.segment_size;
                for (j, e) in entries.into_iter().enumerate() {
                    if start + j + 1 < self.prompt.len() {
                        scores.insert(start + j + 1, e);
                    }
                }
            }
        }
        if self.constrained && self.guide.is_none() {
            return Err(SchemeError::inconsistent(
                "a structured-output request cannot continue on another worker",
            ));
        }
        let (token, scored, complete) = match (out.token, &out.logits) {
            (Some(t), _) => (Some(t), None, false),
            (None, Some(row)) => {
                let (t, s, done) = guided_pick(&mut self.sampler, self.guide.as_mut(), row)?;
                (Some(t), s, done)
            }
            (None, None) => (None, None, false),
        };
        if let (Some(row), true) = (out.logits, self.records_logits()) {
            self.record_logits(row);
        }
        if let Some(token) = token {
            // The prompt segment chose the first token: the prompt is scored.
            if let Some(mut scores) = self.prompt_scores.take() {
                let entries = (0..self.prompt.len())
                    .map(|p| scores.remove(&p).unwrap_or_else(TokenLogprob::unscored))
                    .collect();
                outbox.prompt_logprobs(entries);
                if self.max_new_tokens == 0 {
                    self.phase = Phase::Done;
                    outbox.finish(FinishReason::Length, std::mem::take(&mut self.stats));
                    return Ok(());
                }
            }
            self.take_token(token, scored, outbox);
            if complete && !outbox.is_done() {
                // The structured output is complete.
                self.phase = Phase::Done;
                outbox.finish(FinishReason::StopToken, std::mem::take(&mut self.stats));
            }
        }
        Ok(())
    }

    /// Takes a token the model chose: streams it and finishes or moves on to decoding it.
    pub(crate) fn take_token(
        &mut self,
        token: u32,
        scored: Option<TokenLogprob>,
        outbox: &mut Outbox,
    ) {
        self.generated += 1;
        outbox.scored_tokens(vec![token], scored.map(|s| vec![s]));
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

    /// Whether the token can be chosen on the device: a greedy request that asked for no
    /// log-probabilities.
    pub(crate) fn is_greedy(&self) -> bool {
        !self.sampler.wants_logits() && !self.constrained
    }

    /// Drops the device state (memories, cache, in-flight segments).
    pub(crate) fn release(&mut self) {
        self.memory = None;
        self.cache.clear();
        self.inflight.clear();
    }
}

/// The commit of every kind of plan on fake outputs: memory writes land in their layers,
/// residual streams move up a layer or leave at the top, segments and steps advance, and a
/// chosen token is streamed and decoded next or ends the request.
#[cfg(test)]
mod commit_tests {
    use candle_core::{DType, Device, Tensor};
    use wavefront_engine::{Event, FinishReason, Outbox, Stats};
    use wavefront_models::armt::{LayerMemory, MemoryUpdate};

    use super::*;
    use crate::request::SamplingParams;

    const LAYERS: usize = 2;

    /// A program over a 10-token prompt in segments of 4 (3 segments), with empty memories of
    /// a 3-key, 2-wide layer.
    fn program(diagonal: bool, max_new_tokens: usize) -> ArmtProgram {
        let mut p = ArmtProgram::new(
            (1..=10).collect(),
            4,
            diagonal,
            TokenSampler::new(SamplingParams::default()),
            max_new_tokens,
            vec![99],
            Stats::default(),
        );
        p.memory = Some(
            (0..LAYERS)
                .map(|_| LayerMemory::zeros(3, 2, &Device::Cpu).expect("memory"))
                .collect(),
        );
        p
    }

    fn update(v: f32) -> MemoryUpdate {
        MemoryUpdate::new(
            Tensor::full(v, (3, 2), &Device::Cpu).expect("a"),
            Tensor::full(v, 3, &Device::Cpu).expect("z"),
        )
    }

    fn sum_a(p: &ArmtProgram, l: usize) -> f32 {
        p.memory.as_ref().expect("memories")[l]
            .a()
            .sum_all()
            .and_then(|t| t.to_scalar::<f32>())
            .expect("sum")
    }

    fn tokens(outbox: &Outbox) -> Vec<u32> {
        outbox
            .events()
            .iter()
            .filter_map(|e| match e {
                Event::Tokens(t) => Some(t.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn a_memory_segment_writes_every_layer_and_the_prompt_segment_chooses_a_token() {
        let mut p = program(false, 4);
        let mut outbox = Outbox::default();
        let plan = p.plan(LAYERS);
        assert_eq!(
            plan,
            ArmtPlan::Segment {
                segment: 0,
                prompt: false
            }
        );
        let out = ArmtOutput {
            writes: vec![Some(update(1.0)), Some(update(2.0))],
            ..ArmtOutput::default()
        };
        p.commit(&plan, out, LAYERS, &mut outbox).expect("commit");
        assert_eq!((sum_a(&p, 0), sum_a(&p, 1)), (6.0, 12.0));
        assert!(p.memory.as_ref().expect("memories")[1].is_written());
        assert_eq!(
            p.plan(LAYERS),
            ArmtPlan::Segment {
                segment: 1,
                prompt: false
            }
        );
        p.next_segment = 2;
        let plan = p.plan(LAYERS);
        assert_eq!(
            plan,
            ArmtPlan::Segment {
                segment: 2,
                prompt: true
            }
        );
        let out = ArmtOutput {
            writes: vec![None, None],
            token: Some(7),
            ..ArmtOutput::default()
        };
        p.commit(&plan, out, LAYERS, &mut outbox).expect("commit");
        assert_eq!(tokens(&outbox), vec![7]);
        // The prompt segment holds tokens 9 and 10: the new token is decoded at position 2.
        assert_eq!(
            p.plan(LAYERS),
            ArmtPlan::Decode {
                token: 7,
                position: 2
            }
        );
        assert_eq!(p.stats.forward_passes, 2);
        assert_eq!(p.stats.counters["grouped_steps"], 4);
    }

    #[test]
    fn a_diagonal_moves_streams_up_applies_writes_and_drops_the_top() {
        let mut p = program(true, 4);
        let mut outbox = Outbox::default();
        p.step = 1;
        let plan = p.plan(LAYERS);
        // Step 1: segment 1 at layer 0, segment 0 at layer 1 (the oldest last).
        assert_eq!(
            plan,
            ArmtPlan::Diagonal {
                cells: vec![(1, 0), (0, 1)]
            }
        );
        p.inflight.insert(
            0,
            Tensor::zeros((4, 2), DType::F32, &Device::Cpu)
                .expect("h")
                .into(),
        );
        let h1 = Tensor::ones((4, 2), DType::F32, &Device::Cpu).expect("h");
        let out = ArmtOutput {
            cells: vec![
                (h1.into(), Some(update(1.0))),
                (h1_top().into(), Some(update(3.0))),
            ],
            ..ArmtOutput::default()
        };
        p.commit(&plan, out, LAYERS, &mut outbox).expect("commit");
        assert_eq!(p.inflight.keys().copied().collect::<Vec<_>>(), vec![1]);
        assert_eq!((sum_a(&p, 0), sum_a(&p, 1)), (6.0, 18.0));
        assert_eq!(p.step, 2);
        assert_eq!(p.stats.series["cells_per_step"], vec![2]);
        assert!(tokens(&outbox).is_empty());
        // A plan that got the wrong number of cell outputs is refused, not half applied.
        let plan = p.plan(LAYERS);
        let err = p
            .commit(&plan, ArmtOutput::default(), LAYERS, &mut outbox)
            .unwrap_err();
        assert!(err.to_string().contains("cell outputs"), "{err}");
    }

    fn h1_top() -> Tensor {
        Tensor::full(2f32, (4, 2), &Device::Cpu).expect("h")
    }

    #[test]
    fn decoding_streams_tokens_samples_logits_and_ends_at_a_stop_token() {
        let mut p = program(false, 8);
        let mut outbox = Outbox::default();
        p.phase = Phase::Decode;
        p.pending = 5;
        p.position = 2;
        let plan = p.plan(LAYERS);
        // A greedy request given only logits (as when it records them) takes their argmax.
        let out = ArmtOutput {
            logits: Some(vec![0.0, 3.0, 1.0]),
            ..ArmtOutput::default()
        };
        p.commit(&plan, out, LAYERS, &mut outbox).expect("commit");
        assert_eq!(
            p.plan(LAYERS),
            ArmtPlan::Decode {
                token: 1,
                position: 3
            }
        );
        let plan = p.plan(LAYERS);
        let out = ArmtOutput {
            token: Some(99),
            ..ArmtOutput::default()
        };
        p.commit(&plan, out, LAYERS, &mut outbox).expect("commit");
        assert_eq!(tokens(&outbox), vec![1, 99]);
        assert_eq!(p.plan(LAYERS), ArmtPlan::Idle);
        let finished = outbox.events().iter().any(|e| {
            matches!(
                e,
                Event::Finished {
                    reason: FinishReason::StopToken,
                    ..
                }
            )
        });
        assert!(finished);
    }
}
