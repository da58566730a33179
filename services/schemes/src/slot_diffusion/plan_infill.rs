//! One request's plan-and-infill program (ReFusion, Li et al., 2025; upstream
//! `generate_refusion()`), as a state machine that issues one model call per engine tick.
//!
//! An *iteration* is: **plan** (one call over the block's still-masked spans, every token a
//! mask at its true position id, after the committed buffer; the draft of each position is the
//! argmax of its own logits and a span's score is the probability of its first draft token),
//! **select** (every span scoring above `slot_threshold`, or the single best one), **verify**
//! (one call over the selected drafts concatenated in position order; token `j ≥ 1` of a span is
//! accepted when the autoregressive probability from the token before it exceeds
//! `token_threshold`, token 0 always), then either the **whole-span fast path** (the leading
//! accepted run covers a stop token or at least one whole span: commit those spans with the
//! verification K/V) or **parallel iterative completion** (one row per selected span, each over
//! the committed cache and itself only: a draft call re-predicts every unaccepted token from the
//! partly re-masked row, a verify call accepts by threshold with the token after the accepted
//! prefix forced, the common accepted prefix advances, until every row is complete; then the
//! rows are committed row after row). The README of tests/fixtures/refusion spells out every
//! rule; the golden tests replay upstream's calls one by one.
//!
//! State lives in plain fields; the one tensor state is the committed cache (`main`, in the
//! family's page pool, appended in commit order and never cropped below what was committed).
//! Every call writes its rows in place in `main`'s pages after the committed ones, and the
//! commit keeps what it accepts and cuts the rest: planning and verification rows after the
//! committed buffer (the first plan's prompt rows and a verified prefix stay there), and
//! iterative completion's rows each in its own *segment* of `slot_size` indices after the
//! committed buffer, in commit order (row `r` at `committed + r · slot_size`), attending to the
//! committed buffer and its own segment only ([`MaskRule::SegmentCausal`], upstream's batch
//! rows over one shared cache): a step rewrites each segment past its accepted prefix, and the
//! completed segments are the committed rows where they lie. Nothing is copied into the cache
//! and no cache lives outside the pool. [`PlanInfill::commit_spans`] is the one place where
//! spans become final.
//!
//! [`MaskRule::SegmentCausal`]: wavefront_models::transformer::MaskRule::SegmentCausal

use wavefront_engine::{CanvasFrame, CellState, FinishReason, Outbox, Stats, TokenLogprob};
use wavefront_models::transformer::{Keys, KvCache, MaskRule, SeqInput};

use super::call::{CacheUse, Call, CallRow, ReadOut, RowRead};
use super::canvas::Canvas;
use crate::request::EosRule;
use crate::sampling::{score, Filter, TokenSampler};
use crate::SchemeError;

/// The request's fixed settings.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct Settings {
    pub(crate) span_size: usize,
    pub(crate) block_length: usize,
    pub(crate) blocks: usize,
    pub(crate) span_threshold: f32,
    pub(crate) token_threshold: f32,
    pub(crate) mask_id: u32,
    pub(crate) eos_rule: EosRule,
}

/// What one iteration did, kept when recording (tests compare it with upstream's trace).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IterationRecord {
    pub block: usize,
    pub cache_len_before_plan: usize,
    /// Start positions of the block's masked spans at planning.
    pub remaining: Vec<u32>,
    pub plan_draft: Vec<Vec<u32>>,
    pub plan_conf: Vec<Vec<f32>>,
    pub span_scores: Vec<f32>,
    /// Start positions of the selected spans.
    pub selected: Vec<u32>,
    /// Per selected span: token 0 its planning confidence, tokens 1.. the verification call's
    /// autoregressive probabilities.
    pub verify_probs: Vec<Vec<f32>>,
    pub verify_prefix_len: usize,
    /// "prefix" or "iterative".
    pub path: &'static str,
    pub steps: Vec<CompletionRecord>,
    pub committed_tokens: Vec<u32>,
    pub committed_pos: Vec<u32>,
    pub eos: bool,
    /// Iterative path with a stop token: the row it was found in.
    pub eos_row: Option<usize>,
    /// Start positions of undecoded spans left of the stop token that upstream's quirk drops.
    pub dropped: Vec<u32>,
}

/// One draft + verify step of iterative completion.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompletionRecord {
    pub accepted_prefix_len_before: usize,
    pub draft_input: Vec<Vec<u32>>,
    pub draft_out: Vec<Vec<u32>>,
    pub merged: Vec<Vec<u32>>,
    /// Per row, index `t ≥ 1` relative to the step's start: the probability of token `t` from
    /// the logits at `t - 1` (index 0 is not computed and holds NaN).
    pub verify_probs: Vec<Vec<f32>>,
    /// Accepted flags of all span tokens per row after the step.
    pub tags: Vec<Vec<bool>>,
    pub newly_accepted_len: usize,
}

/// The input of one call, recorded for comparison with upstream's `model_calls`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallRecord {
    pub batch: usize,
    pub cache_len_before: usize,
    pub input_ids: Vec<Vec<u32>>,
    pub position_ids: Vec<Vec<u32>>,
    /// Per row: (index in the row, argmax, softmax maximum) of every position read.
    pub reads: Vec<Vec<(usize, u32, f32)>>,
}

#[derive(Debug, Default)]
pub(crate) struct Recorder {
    pub(crate) iterations: Vec<IterationRecord>,
    pub(crate) calls: Vec<CallRecord>,
}

/// The spans selected by a plan, waiting for verification.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Selection {
    /// Pool indices of the selected spans, increasing.
    picked: Vec<usize>,
    /// Their planning drafts, `slot_size` tokens each.
    drafts: Vec<Vec<u32>>,
    /// Their first tokens' planning confidences.
    first_conf: Vec<f32>,
    /// With log-probabilities: each draft token's, from the distribution that drafted it.
    #[serde(default)]
    scores: Vec<Vec<TokenLogprob>>,
}

/// One row of iterative completion: a selected span, whose K/V live in its segment of the
/// committed cache's pages (the accepted prefix, `acc` tokens, kept from step to step).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Row {
    start: u32,
    tokens: Vec<u32>,
    tags: Vec<bool>,
    /// With log-probabilities: each token's (see [`PlanInfill::logprobs`]).
    #[serde(default)]
    scores: Vec<TokenLogprob>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Infill {
    /// Pool indices of every originally selected span.
    picked: Vec<usize>,
    rows: Vec<Row>,
    acc: usize,
    /// The next call is a draft call (otherwise a verify call).
    draft_next: bool,
    eos_row: Option<usize>,
    steps: usize,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Phase {
    Plan,
    Verify(Selection),
    Infill(Infill),
    Done,
}

/// One plan-and-infill request.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct PlanInfill {
    s: Settings,
    prompt: Vec<u32>,
    /// The committed buffer in commit order (`cur_x`, `cur_pos` upstream), prompt first.
    buffer_ids: Vec<u32>,
    buffer_pos: Vec<u32>,
    /// K/V of the committed buffer (empty before the first call), and after it the rows of
    /// the call in flight.
    pub(crate) main: KvCache,
    block: usize,
    /// Start positions of the current block's spans still to decode, increasing.
    pool: Vec<u32>,
    /// A stop token was committed: finish once the current block's pool is empty.
    stop: bool,
    /// The response streamed its first stop token in position order.
    stopped: bool,
    /// The response streamed `max_new_tokens` tokens (the canvas, rounded up to whole blocks,
    /// may be longer).
    #[serde(default)]
    capped: bool,
    phase: Phase,
    canvas: Canvas,
    /// Planning with a temperature (upstream's Gumbel noise): a categorical draw from
    /// `softmax(logits / T)` with the request's own RNG.
    sampler: Option<TokenSampler>,
    #[serde(skip)]
    pub(crate) record: Option<Recorder>,
    #[serde(skip)]
    current: Option<IterationRecord>,
    /// Send every commit as a canvas update (the request's `stream_canvas`).
    pub(crate) stream_canvas: bool,
    /// Alternatives per token when the request asked for log-probabilities. A token's
    /// distribution is the verifier's at its position (the model's next-token distribution
    /// after the tokens before it) in the last verification call that scored it, or, for a
    /// token no verification scored (a span's first token), the distribution that drafted it
    /// (planning: the draw's, or the model's for an argmax; iterative completion: the model's).
    #[serde(default)]
    pub(crate) logprobs: Option<usize>,
    /// The structured-output constraint after the committed tokens, when the request has one
    /// (it does not travel to another worker: `constrained` says it had one). Constrained, a
    /// plan selects the leftmost span only, so spans commit in position order, and every draft
    /// is masked to the grammar after the tokens before it.
    #[serde(skip)]
    pub(crate) guide: Option<crate::constraint::Guide>,
    #[serde(default)]
    pub(crate) constrained: bool,
    /// The prompt-sharing key of the prompt's rows, computed once.
    #[serde(default)]
    key: Option<u64>,
}

impl PlanInfill {
    /// Buffer indices the committed cache holds after the next call's commit, at most: the
    /// committed buffer (the prompt, from the first call on) and one block.
    pub(crate) fn rows_after_next_commit(&self) -> usize {
        self.buffer_ids.len() + self.s.block_length
    }

    /// The prompt's ids.
    pub(crate) fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// The key of the prompt's rows ([`super::call::prompt_key`]).
    pub(crate) fn share_key(&self) -> Option<u64> {
        self.key
    }

    /// Whether the prompt's rows are still to be computed (before the first planning call).
    pub(crate) fn prompt_pending(&self) -> bool {
        self.main.len() < self.prompt.len()
    }

    /// Whether nothing has run yet (a request that may take another's prompt pages).
    pub(crate) fn at_start(&self) -> bool {
        self.main.is_empty() && matches!(self.phase, Phase::Plan) && self.block == 0
    }

    /// A request decoding a canvas of `gen_length` positions whose response holds at most
    /// `max_new_tokens` tokens.
    pub(crate) fn new(
        s: Settings,
        prompt: Vec<u32>,
        (gen_length, max_new_tokens): (usize, usize),
        stop_token_ids: Vec<u32>,
        sampler: Option<TokenSampler>,
    ) -> Self {
        let p = prompt.len();
        let mut me = Self {
            key: (p > 1).then(|| super::call::prompt_key(&prompt)),
            buffer_ids: prompt.clone(),
            buffer_pos: (0..p as u32).collect(),
            prompt,
            main: KvCache::new(),
            block: 0,
            pool: Vec::new(),
            stop: false,
            stopped: false,
            capped: false,
            phase: Phase::Plan,
            canvas: Canvas::new(p, gen_length, stop_token_ids).with_limit(max_new_tokens),
            sampler,
            record: None,
            current: None,
            stream_canvas: false,
            logprobs: None,
            guide: None,
            constrained: false,
            s,
        };
        me.pool = me.block_spans(0);
        me
    }

    fn block_spans(&self, block: usize) -> Vec<u32> {
        let start = self.prompt.len() + block * self.s.block_length;
        (0..self.s.block_length / self.s.span_size)
            .map(|i| (start + i * self.s.span_size) as u32)
            .collect()
    }

    fn span_positions(&self, start: u32) -> impl Iterator<Item = u32> {
        start..start + self.s.span_size as u32
    }

    fn is_stop(&self, token: u32) -> bool {
        self.canvas.is_stop(token)
    }

    /// Generated (position, token) pairs committed so far, in position order.
    pub fn generated(&self) -> Vec<(u32, u32)> {
        self.canvas.tokens()
    }

    /// The committed buffer in commit order: token ids and position ids, prompt first.
    pub fn buffer(&self) -> (&[u32], &[u32]) {
        (&self.buffer_ids, &self.buffer_pos)
    }

    pub(crate) fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// The next model call.
    /// Rows [`Self::next_call`] computes: the planning call's masked spans (and the prompt on
    /// the first call), the verification call's drafts, or every selected span's unaccepted
    /// tokens in iterative completion.
    pub(crate) fn next_call_rows(&self) -> usize {
        let s = self.s.span_size;
        match &self.phase {
            Phase::Plan => {
                // The prompt's rows not in the cache yet (all of them at the first call, unless
                // it read some from another request's pages).
                let prompt = self.prompt.len().saturating_sub(self.main.len());
                prompt + self.pool.len() * s
            }
            Phase::Verify(sel) => sel.drafts.iter().map(Vec::len).sum(),
            Phase::Infill(inf) => inf.rows.len() * (s - inf.acc),
            Phase::Done => 0,
        }
    }

    pub(crate) fn next_call(&mut self) -> Call {
        let s = self.s.span_size;
        let rows = match &self.phase {
            Phase::Plan => {
                let from = self.main.len();
                let (mut ids, mut positions) = if from < self.prompt.len() {
                    (
                        self.prompt[from..].to_vec(),
                        (from as u32..self.prompt.len() as u32).collect(),
                    )
                } else {
                    (Vec::new(), Vec::new())
                };
                let offset = ids.len();
                for &start in &self.pool {
                    ids.extend(std::iter::repeat_n(self.s.mask_id, s));
                    positions.extend(self.span_positions(start));
                }
                let full = self.sampler.is_some() || self.logprobs.is_some() || self.constrained;
                let reads = (offset..ids.len())
                    .map(|at| RowRead {
                        full,
                        ..RowRead::top1(at)
                    })
                    .collect();
                vec![CallRow {
                    ids,
                    positions,
                    cache: CacheUse::Own,
                    reads,
                }]
            }
            Phase::Verify(sel) => {
                let ids: Vec<u32> = sel.drafts.concat();
                let positions: Vec<u32> = sel
                    .picked
                    .iter()
                    .flat_map(|&i| self.span_positions(self.pool[i]))
                    .collect();
                let full = self.logprobs.is_some();
                let reads = (0..ids.len().saturating_sub(1))
                    .filter(|f| (f + 1) % s != 0)
                    .map(|f| RowRead {
                        full,
                        ..RowRead::prob_of(f, ids[f + 1])
                    })
                    .collect();
                vec![CallRow {
                    ids,
                    positions,
                    cache: CacheUse::Own,
                    reads,
                }]
            }
            Phase::Infill(inf) => {
                let acc = inf.acc;
                // Logits only where a decision needs them (all of them when recording, for the
                // trace, or scoring, for every token's distribution): a draft call re-predicts
                // the unaccepted tokens, a verify call scores a token whose predecessor was not
                // accepted before the step.
                let full = self.logprobs.is_some() || self.constrained;
                let all = self.record.is_some() || full;
                let mut rows = Vec::with_capacity(inf.rows.len());
                for (r, row) in inf.rows.iter().enumerate() {
                    let positions: Vec<u32> = self.span_positions(row.start).skip(acc).collect();
                    let (ids, reads): (Vec<u32>, Vec<RowRead>) = if inf.draft_next {
                        let ids = (acc..s)
                            .map(|t| {
                                if row.tags[t] {
                                    row.tokens[t]
                                } else {
                                    self.s.mask_id
                                }
                            })
                            .collect();
                        let reads = (0..s - acc)
                            .filter(|&t| all || !row.tags[acc + t])
                            .map(|t| RowRead {
                                full,
                                ..RowRead::top1(t)
                            })
                            .collect();
                        (ids, reads)
                    } else {
                        let ids = row.tokens[acc..].to_vec();
                        let reads = (0..s - acc - 1)
                            .filter(|&t| all || !row.tags[acc + t])
                            .map(|t| RowRead {
                                full,
                                ..RowRead::prob_of(t, ids[t + 1])
                            })
                            .collect();
                        (ids, reads)
                    };
                    rows.push(CallRow {
                        ids,
                        positions,
                        cache: CacheUse::Segment(r),
                        reads,
                    });
                }
                rows
            }
            Phase::Done => Vec::new(),
        };
        let cache_len_before = self.cache_len_seen();
        if let Some(rec) = &mut self.record {
            rec.calls.push(CallRecord {
                batch: rows.len(),
                cache_len_before,
                input_ids: rows.iter().map(|r| r.ids.clone()).collect(),
                position_ids: rows.iter().map(|r| r.positions.clone()).collect(),
                reads: Vec::new(),
            });
        }
        Call { rows }
    }

    /// Cache positions the next call's rows see before their own (upstream's cache length):
    /// the committed buffer, and in iterative completion a row's accepted prefix too.
    fn cache_len_seen(&self) -> usize {
        match &self.phase {
            Phase::Infill(inf) => self.buffer_ids.len() + inf.acc,
            _ => self.main.len(),
        }
    }

    /// The attention sequences of `call` (from [`Self::next_call`]), its rows written in place
    /// in the committed cache's pages after the committed rows: planning and verification as
    /// one causal sequence; iterative completion as one sequence of every row's unaccepted
    /// tokens, each in its own segment (row `r` at `committed + r · slot_size`), seeing the
    /// committed buffer and its own segment (the segment's accepted prefix from the cache).
    pub(crate) fn sequences(&mut self, call: &Call) -> Result<Vec<SeqInput<'_>>, SchemeError> {
        let committed = self.buffer_ids.len();
        let s = self.s.span_size;
        match call.rows.as_slice() {
            [row] if row.cache == CacheUse::Own => {
                // The commit keeps what it accepts and cuts the rest.
                let start = self.main.len();
                Ok(vec![SeqInput {
                    index: (start as u32..(start + row.ids.len()) as u32).collect(),
                    positions: row.positions.clone(),
                    mask: MaskRule::Causal,
                    keys: Keys::Buffer {
                        len: start + row.ids.len(),
                        cache: &mut self.main,
                    },
                }])
            }
            rows => {
                let (mut index, mut positions) = (Vec::new(), Vec::new());
                for (r, row) in rows.iter().enumerate() {
                    if row.cache != CacheUse::Segment(r) || row.ids.len() > s {
                        return Err(SchemeError::inconsistent(format!(
                            "row {r} of the call is not segment {r}'s"
                        )));
                    }
                    // The row's tokens are its segment's last ones (past the accepted prefix).
                    let first = committed + r * s + (s - row.ids.len());
                    index.extend((first..first + row.ids.len()).map(|i| i as u32));
                    positions.extend_from_slice(&row.positions);
                }
                Ok(vec![SeqInput {
                    index,
                    positions,
                    mask: MaskRule::SegmentCausal {
                        prefix: committed,
                        segment: s,
                    },
                    keys: Keys::Buffer {
                        len: committed + rows.len() * s,
                        cache: &mut self.main,
                    },
                }])
            }
        }
    }

    /// Applies the results of the call from [`Self::next_call`]: `outs[r]` holds row `r`'s
    /// reads in order.
    pub(crate) fn commit(
        &mut self,
        call: &Call,
        outs: &[Vec<ReadOut>],
        stats: &mut Stats,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        if let Some(rec) = self.record.as_mut().and_then(|r| r.calls.last_mut()) {
            rec.reads = call
                .rows
                .iter()
                .zip(outs)
                .map(|(row, o)| {
                    row.reads
                        .iter()
                        .zip(o)
                        .map(|(rd, o)| (rd.at, o.argmax, o.max_prob))
                        .collect()
                })
                .collect();
        }
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Plan => self.commit_plan(outs, stats)?,
            Phase::Verify(sel) => self.commit_verify(sel, outs, stats, outbox)?,
            Phase::Infill(mut inf) => {
                if inf.draft_next {
                    self.commit_draft(&mut inf, call, outs)?;
                    self.phase = Phase::Infill(inf);
                } else if self.commit_infill_verify(&mut inf, call, outs)? {
                    self.finish_infill(inf, stats, outbox)?;
                } else {
                    self.phase = Phase::Infill(inf);
                }
            }
            Phase::Done => return Err(SchemeError::inconsistent("a finished program was ticked")),
        }
        Ok(())
    }

    /// A draft written under the guide (after the committed tokens): each position's logits
    /// masked to what the grammar allows next, then the sampler's draw (`draw`) or the argmax;
    /// the end-of-sequence token once the grammar is complete. `logits(t)` is position `t`'s
    /// row.
    fn guided_draft<'a>(
        &mut self,
        tokens: &mut [u32],
        logits: impl Fn(usize) -> Option<&'a [f32]>,
        draw: bool,
    ) -> Result<Vec<TokenLogprob>, SchemeError> {
        let Some(guide) = &self.guide else {
            return Ok(Vec::new());
        };
        let mut look = guide.clone();
        let mut done = look.complete();
        let mut scores = Vec::new();
        for (t, tok) in tokens.iter_mut().enumerate() {
            if done {
                *tok = look.eos();
                if self.logprobs.is_some() {
                    scores.push(TokenLogprob {
                        logprob: 0.0,
                        top: Vec::new(),
                    });
                }
                continue;
            }
            let Some(row) = logits(t) else {
                return Err(SchemeError::inconsistent(
                    "a constrained draft without logits",
                ));
            };
            let mut masked = row.to_vec();
            if let Some(x) = masked.get_mut(self.s.mask_id as usize) {
                *x = f32::NEG_INFINITY;
            }
            look.mask(&mut masked).map_err(SchemeError::inconsistent)?;
            *tok = match (&mut self.sampler, draw) {
                (Some(sampler), true) => sampler.sample(&masked),
                _ => crate::sampling::argmax(&masked),
            };
            if let Some(top) = self.logprobs {
                scores.push(match &self.sampler {
                    Some(sampler) if draw => sampler.score(&masked, *tok, top),
                    _ => score(&masked, *tok, Filter::model(), top),
                });
            }
            done = look.advance(*tok).map_err(SchemeError::inconsistent)?;
        }
        Ok(scores)
    }

    fn commit_plan(&mut self, outs: &[Vec<ReadOut>], stats: &mut Stats) -> Result<(), SchemeError> {
        let s = self.s.span_size;
        let outs = &outs[0];
        if self.constrained {
            return self.commit_guided_plan(outs, stats);
        }
        let mut drafts = Vec::with_capacity(self.pool.len());
        let mut conf = Vec::with_capacity(self.pool.len());
        let mut drafted = Vec::new();
        for span in outs.chunks(s) {
            let (d, c): (Vec<u32>, Vec<f32>) = span
                .iter()
                .map(|o| match (&mut self.sampler, &o.logits) {
                    (Some(sampler), Some(logits)) => {
                        let token = sampler.sample(logits);
                        (token, softmax_prob(logits, token))
                    }
                    _ => (o.argmax, o.max_prob),
                })
                .unzip();
            if let Some(top) = self.logprobs {
                let sampler = self.sampler.as_ref();
                drafted.push(
                    span.iter()
                        .zip(&d)
                        .map(|(o, &t)| {
                            let logits = o.logits.as_deref().unwrap_or_default();
                            match sampler {
                                Some(sm) => sm.score(logits, t, top),
                                None => score(logits, t, Filter::model(), top),
                            }
                        })
                        .collect::<Vec<_>>(),
                );
            }
            drafts.push(d);
            conf.push(c);
        }
        let scores: Vec<f32> = conf.iter().map(|c| c[0]).collect();
        let mut picked: Vec<usize> = (0..scores.len())
            .filter(|&i| scores[i] > self.s.span_threshold)
            .collect();
        if picked.is_empty() {
            let best = (0..scores.len()).fold(0, |b, i| if scores[i] > scores[b] { i } else { b });
            picked.push(best);
        }
        // The call wrote its rows after the committed ones: the first call's prompt rows are
        // committed from now on, the masked spans' rows are cut.
        self.main.truncate(self.buffer_ids.len())?;
        stats.add_counter("iterations", 1);
        stats.add_counter("slots_selected", picked.len() as u64);
        stats.push_series("slots_selected_per_iteration", picked.len() as u32);
        if self.record.is_some() {
            self.current = Some(IterationRecord {
                block: self.block,
                cache_len_before_plan: self.buffer_ids.len(),
                remaining: self.pool.clone(),
                plan_draft: drafts.clone(),
                plan_conf: conf.clone(),
                span_scores: scores,
                selected: picked.iter().map(|&i| self.pool[i]).collect(),
                ..IterationRecord::default()
            });
        }
        let first_conf = picked.iter().map(|&i| conf[i][0]).collect();
        let drafts = picked.iter().map(|&i| drafts[i].clone()).collect();
        let scores = if drafted.is_empty() {
            Vec::new()
        } else {
            picked.iter().map(|&i| drafted[i].clone()).collect()
        };
        self.phase = Phase::Verify(Selection {
            picked,
            drafts,
            first_conf,
            scores,
        });
        Ok(())
    }

    /// A constrained plan: the leftmost span only, drafted under the grammar.
    fn commit_guided_plan(
        &mut self,
        outs: &[ReadOut],
        stats: &mut Stats,
    ) -> Result<(), SchemeError> {
        if self.guide.is_none() {
            return Err(SchemeError::inconsistent(
                "a structured-output request cannot continue on another worker",
            ));
        }
        let s = self.s.span_size;
        let span = &outs[..s.min(outs.len())];
        let mut draft = vec![self.s.mask_id; s];
        let drafted = self.guided_draft(&mut draft, |t| span.get(t)?.logits.as_deref(), true)?;
        let first = span
            .first()
            .and_then(|o| o.logits.as_deref())
            .map_or(0.0, |l| softmax_prob(l, draft[0]));
        let scores = if self.logprobs.is_some() {
            vec![drafted]
        } else {
            Vec::new()
        };
        self.main.truncate(self.buffer_ids.len())?;
        stats.add_counter("iterations", 1);
        stats.add_counter("slots_selected", 1);
        stats.push_series("slots_selected_per_iteration", 1);
        self.phase = Phase::Verify(Selection {
            picked: vec![0],
            drafts: vec![draft],
            first_conf: vec![first],
            scores,
        });
        Ok(())
    }

    fn commit_verify(
        &mut self,
        sel: Selection,
        outs: &[Vec<ReadOut>],
        stats: &mut Stats,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        let s = self.s.span_size;
        let k = sel.picked.len();
        let flat: Vec<u32> = sel.drafts.concat();
        let mut probs: Vec<Vec<f32>> = sel
            .first_conf
            .iter()
            .map(|&c| {
                let mut v = vec![0.0; s];
                v[0] = c;
                v
            })
            .collect();
        let mut flat_scores: Vec<TokenLogprob> = sel.scores.concat();
        let mut reads = outs[0].iter();
        for f in 0..k * s - 1 {
            if (f + 1) % s != 0 {
                let o = reads.next().ok_or_else(|| {
                    SchemeError::inconsistent("verify call returned too few rows")
                })?;
                probs[(f + 1) / s][(f + 1) % s] = o.target_prob;
                if let (Some(top), Some(logits)) = (self.logprobs, &o.logits) {
                    flat_scores[f + 1] = score(logits, flat[f + 1], Filter::model(), top);
                }
            }
        }
        let accept: Vec<Vec<bool>> = probs
            .iter()
            .map(|p| {
                (0..s)
                    .map(|j| j == 0 || p[j] > self.s.token_threshold)
                    .collect()
            })
            .collect();
        let prefix_len = accept.concat().iter().take_while(|&&a| a).count();
        stats.push_series("verified_prefix_per_iteration", prefix_len as u32);
        if let Some(cur) = &mut self.current {
            cur.verify_probs = probs;
            cur.verify_prefix_len = prefix_len;
        }
        let eos_at = (0..prefix_len).find(|&f| self.is_stop(flat[f]));
        let commit_len = match eos_at {
            Some(e) => Some(e + 1),
            None if prefix_len >= s => Some(prefix_len / s * s),
            None => None,
        };
        let Some(n) = commit_len else {
            // Iterative completion: one row per selected span, each in its own segment after the
            // committed rows (the verification K/V are cut).
            self.main.truncate(self.buffer_ids.len())?;
            let rows = sel
                .picked
                .iter()
                .zip(sel.drafts)
                .zip(accept)
                .zip(
                    flat_scores
                        .chunks(s)
                        .map(<[TokenLogprob]>::to_vec)
                        .chain(std::iter::repeat(Vec::new())),
                )
                .map(|(((&i, tokens), acc), scores)| Row {
                    start: self.pool[i],
                    scores,
                    tokens,
                    tags: acc
                        .iter()
                        .scan(true, |all, &a| {
                            *all &= a;
                            Some(*all)
                        })
                        .collect(),
                })
                .collect();
            if let Some(cur) = &mut self.current {
                cur.path = "iterative";
            }
            stats.add_counter("iterative_path_iterations", 1);
            self.phase = Phase::Infill(Infill {
                picked: sel.picked,
                rows,
                acc: 0,
                draft_next: true,
                eos_row: None,
                steps: 0,
            });
            return Ok(());
        };
        // Fast path: whole spans of the verified prefix (cut at a stop token), with the K/V of
        // the verification call, computed sequentially over the selected spans.
        if let Some(cur) = &mut self.current {
            cur.path = "prefix";
        }
        stats.add_counter("prefix_path_iterations", 1);
        let spans = n.div_ceil(s);
        let positions: Vec<u32> = sel.picked[..spans]
            .iter()
            .flat_map(|&i| self.span_positions(self.pool[i]))
            .take(n)
            .collect();
        // The verification call's K/V are in place after the committed rows: keep the first n.
        let scores = (!flat_scores.is_empty()).then(|| &flat_scores[..n]);
        self.commit_spans(&positions, &flat[..n], scores, stats, outbox)?;
        let mut remove: Vec<usize> = sel.picked[..spans].to_vec();
        if eos_at.is_some() {
            // Every span from the stop token's span rightwards leaves the pool.
            remove.extend(sel.picked[spans - 1]..self.pool.len());
            self.stop = true;
        }
        self.end_iteration(&remove, stats, outbox);
        Ok(())
    }

    fn commit_draft(
        &mut self,
        inf: &mut Infill,
        call: &Call,
        outs: &[Vec<ReadOut>],
    ) -> Result<(), SchemeError> {
        let acc = inf.acc;
        let mut step = CompletionRecord {
            accepted_prefix_len_before: acc,
            ..CompletionRecord::default()
        };
        for ((row, o), c) in inf.rows.iter_mut().zip(outs).zip(&call.rows) {
            let o = by_position(c, o);
            if self.record.is_some() {
                step.draft_input.push(
                    (acc..row.tokens.len())
                        .map(|t| {
                            if row.tags[t] {
                                row.tokens[t]
                            } else {
                                self.s.mask_id
                            }
                        })
                        .collect(),
                );
                step.draft_out
                    .push(o.iter().map(|o| o.map_or(u32::MAX, |o| o.argmax)).collect());
            }
            if let Some(guide) = &self.guide {
                // Constrained: the unaccepted tokens re-drafted in order under the grammar.
                let from = (acc..row.tokens.len())
                    .find(|&t| !row.tags[t])
                    .unwrap_or(row.tokens.len());
                let mut look = guide.clone();
                let mut done = look.complete();
                for t in 0..row.tokens.len() {
                    if t < from {
                        done = done
                            || look
                                .advance(row.tokens[t])
                                .map_err(SchemeError::inconsistent)?;
                        continue;
                    }
                    if done {
                        row.tokens[t] = look.eos();
                        continue;
                    }
                    let Some(Some(o)) = t.checked_sub(acc).and_then(|u| o.get(u)) else {
                        return Err(SchemeError::inconsistent(
                            "a constrained draft without logits",
                        ));
                    };
                    let Some(logits) = &o.logits else {
                        return Err(SchemeError::inconsistent(
                            "a constrained draft without logits",
                        ));
                    };
                    let mut masked = logits.clone();
                    if let Some(x) = masked.get_mut(self.s.mask_id as usize) {
                        *x = f32::NEG_INFINITY;
                    }
                    look.mask(&mut masked).map_err(SchemeError::inconsistent)?;
                    row.tokens[t] = crate::sampling::argmax(&masked);
                    if let Some(top) = self.logprobs {
                        row.scores[t] = score(&masked, row.tokens[t], Filter::model(), top);
                    }
                    done = look
                        .advance(row.tokens[t])
                        .map_err(SchemeError::inconsistent)?;
                }
            } else {
                for (t, o) in (acc..row.tokens.len()).zip(o) {
                    if let (false, Some(o)) = (row.tags[t], o) {
                        row.tokens[t] = o.argmax;
                        if let (Some(top), Some(logits)) = (self.logprobs, &o.logits) {
                            row.scores[t] = score(logits, o.argmax, Filter::model(), top);
                        }
                    }
                }
            }
            step.merged.push(row.tokens[acc..].to_vec());
        }
        // The draft's K/V past the accepted prefixes are rewritten by the verify call.
        inf.draft_next = false;
        if let Some(cur) = &mut self.current {
            cur.steps.push(step);
        }
        Ok(())
    }

    /// The verify call of a completion step; returns whether the completion is over.
    fn commit_infill_verify(
        &mut self,
        inf: &mut Infill,
        call: &Call,
        outs: &[Vec<ReadOut>],
    ) -> Result<bool, SchemeError> {
        let (s, acc) = (self.s.span_size, inf.acc);
        let mut verify_probs = Vec::with_capacity(inf.rows.len());
        for ((row, o), c) in inf.rows.iter_mut().zip(outs).zip(&call.rows) {
            let o = by_position(c, o);
            let n = s - acc;
            let mut probs = vec![f32::NAN; n];
            let mut all = true;
            let old = row.tags.clone();
            for t in 0..n {
                // Forced: the step's first token and the token after an accepted one.
                let forced = t == 0 || old[acc + t - 1];
                if let Some(Some(o)) = t.checked_sub(1).map(|u| o[u]) {
                    probs[t] = o.target_prob;
                    if let (Some(top), Some(logits)) = (self.logprobs, &o.logits) {
                        row.scores[acc + t] =
                            score(logits, row.tokens[acc + t], Filter::model(), top);
                    }
                }
                let ok = forced || probs[t] > self.s.token_threshold;
                all &= ok;
                row.tags[acc + t] = all;
            }
            verify_probs.push(probs);
        }
        let tags_before_eos: Vec<Vec<bool>> = self
            .current
            .as_ref()
            .map(|_| inf.rows.iter().map(|r| r.tags.clone()).collect())
            .unwrap_or_default();
        // A stop token accepted in some row: that row is complete, later rows are dropped.
        let eos_row = inf
            .rows
            .iter()
            .position(|row| (acc..s).any(|t| row.tags[t] && self.is_stop(row.tokens[t])));
        if let Some(r) = eos_row {
            inf.rows.truncate(r + 1);
            inf.rows[r].tags.iter_mut().for_each(|t| *t = true);
            inf.eos_row = Some(r);
        }
        let newly = inf
            .rows
            .iter()
            .map(|row| row.tags[acc..].iter().filter(|&&t| t).count())
            .min()
            .unwrap_or(0);
        let complete = inf.rows.iter().all(|row| row.tags.iter().all(|&t| t));
        if newly > 0 {
            inf.acc = if complete {
                acc + newly
            } else {
                acc + newly - 1
            };
        }
        // Each segment keeps its accepted prefix in the cache; the next call rewrites the rest.
        inf.steps += 1;
        inf.draft_next = true;
        if let Some(step) = self.current.as_mut().and_then(|c| c.steps.last_mut()) {
            step.verify_probs = verify_probs;
            // Upstream traces the flags before a stop token completes its row.
            step.tags = tags_before_eos;
            step.newly_accepted_len = newly;
        }
        Ok(complete || inf.steps >= s)
    }

    /// Commits the completed rows: their K/V (each over the committed buffer and itself) are in
    /// their segments after the committed rows, row after row, so the commit keeps them where
    /// they lie, cut after the first stop token.
    fn finish_infill(
        &mut self,
        inf: Infill,
        stats: &mut Stats,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        let s = self.s.span_size;
        if inf.acc != s {
            return Err(SchemeError::inconsistent(format!(
                "iterative completion ended with {} of {s} tokens accepted",
                inf.acc
            )));
        }
        stats.add_counter("infill_steps", inf.steps as u64);
        let mut tokens: Vec<u32> = inf.rows.iter().flat_map(|r| r.tokens.clone()).collect();
        let mut scores: Vec<TokenLogprob> =
            inf.rows.iter().flat_map(|r| r.scores.clone()).collect();
        let mut positions: Vec<u32> = inf
            .rows
            .iter()
            .flat_map(|r| self.span_positions(r.start))
            .collect();
        if let Some(e) = tokens.iter().position(|&t| self.is_stop(t)) {
            tokens.truncate(e + 1);
            positions.truncate(e + 1);
        }
        scores.truncate(tokens.len());
        let scores = (self.logprobs.is_some()).then_some(scores.as_slice());
        self.commit_spans(&positions, &tokens, scores, stats, outbox)?;
        let mut remove = inf.picked.clone();
        if let Some(r) = inf.eos_row {
            let from = match self.s.eos_rule {
                EosRule::Aligned => inf.picked[r],
                // Upstream: `range(first_eos_block_idx, n)`, a row index used as a pool index.
                EosRule::Upstream => r,
            };
            let eos_span = self.pool[inf.picked[r]];
            let dropped: Vec<u32> = (from..self.pool.len())
                .filter(|i| !inf.picked.contains(i) && self.pool[*i] < eos_span)
                .map(|i| self.pool[i])
                .collect();
            remove.extend(from..self.pool.len());
            let s = self.s.span_size as u32;
            self.canvas
                .drop_positions(dropped.iter().flat_map(|&p| p..p + s));
            if let Some(cur) = &mut self.current {
                cur.eos_row = Some(r);
                cur.dropped = dropped;
            }
            self.stop = true;
        }
        self.end_iteration(&remove, stats, outbox);
        Ok(())
    }

    /// The one place where spans become final: appends tokens at their positions (in commit
    /// order) to the buffer, keeps their K/V where the call wrote them (right after the
    /// committed rows) and cuts the rest, and streams the tokens that became final in position
    /// order.
    fn commit_spans(
        &mut self,
        positions: &[u32],
        tokens: &[u32],
        scores: Option<&[TokenLogprob]>,
        stats: &mut Stats,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        let keep = self.buffer_ids.len() + tokens.len();
        if self.main.len() < keep {
            return Err(SchemeError::inconsistent(format!(
                "{} rows to commit in place, {} written",
                tokens.len(),
                self.main.len().saturating_sub(self.buffer_ids.len())
            )));
        }
        self.main.truncate(keep)?;
        if let Some(g) = &mut self.guide {
            // Constrained spans commit in position order: the guide follows them.
            for &t in tokens {
                if g.advance(t).map_err(SchemeError::inconsistent)? {
                    break;
                }
            }
        }
        self.buffer_ids.extend_from_slice(tokens);
        self.buffer_pos.extend_from_slice(positions);
        self.canvas.commit(positions, tokens);
        if let Some(scores) = scores {
            self.canvas.commit_scores(positions, scores);
        }
        let spans = positions.len().div_ceil(self.s.span_size);
        stats.add_counter("slots_committed", spans as u64);
        stats.add_counter("tokens_committed", tokens.len() as u64);
        stats.push_series("committed_per_iteration", tokens.len() as u32);
        if let Some(cur) = &mut self.current {
            cur.committed_tokens = tokens.to_vec();
            cur.committed_pos = positions.to_vec();
            cur.eos = tokens.iter().any(|&t| self.canvas.is_stop(t));
        }
        if self.stream_canvas {
            // Out-of-order span events: what this commit made final, in commit order, before
            // the in-order tokens it releases.
            let start = self.prompt.len() as u32;
            outbox.canvas(CanvasFrame {
                positions: positions.iter().map(|&p| p - start).collect(),
                tokens: tokens.to_vec(),
                states: vec![CellState::Committed; tokens.len()],
                full: false,
                step: stats.forward_passes as u32,
            });
        }
        let (fresh, scores, reason) = self.canvas.stream_scored(self.logprobs.is_some());
        outbox.scored_tokens(fresh, scores);
        self.stopped |= reason == Some(FinishReason::StopToken);
        self.capped |= reason == Some(FinishReason::Length);
        Ok(())
    }

    /// Removes spans from the pool, then moves to the next iteration, block or the end.
    fn end_iteration(&mut self, remove: &[usize], stats: &mut Stats, outbox: &mut Outbox) {
        if let (Some(rec), Some(cur)) = (&mut self.record, self.current.take()) {
            rec.iterations.push(cur);
        }
        let pool = std::mem::take(&mut self.pool);
        self.pool = pool
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !remove.contains(i))
            .map(|(_, p)| p)
            .collect();
        if self.stopped {
            // The response reached its first stop token in position order: every position
            // before it is final (the pool holds nothing left of it).
            self.finish(FinishReason::StopToken, stats, outbox);
            return;
        }
        if self.capped {
            // `max_new_tokens` are out; the rest of the rounded-up canvas is not the response's.
            self.finish(FinishReason::Length, stats, outbox);
            return;
        }
        if self.pool.is_empty() {
            self.block += 1;
            if self.stop || self.block == self.s.blocks {
                self.finish(FinishReason::Length, stats, outbox);
                return;
            }
            self.pool = self.block_spans(self.block);
            stats.add_counter("blocks", 1);
        }
        self.phase = Phase::Plan;
    }

    fn finish(&mut self, reason: FinishReason, stats: &mut Stats, outbox: &mut Outbox) {
        outbox.finish(reason, std::mem::take(stats));
        self.phase = Phase::Done;
    }
}

/// A row's reads indexed by their position in the row (`None` where nothing was read).
fn by_position<'a>(row: &CallRow, outs: &'a [ReadOut]) -> Vec<Option<&'a ReadOut>> {
    let mut at = vec![None; row.ids.len()];
    for (rd, o) in row.reads.iter().zip(outs) {
        at[rd.at] = Some(o);
    }
    at
}

/// `softmax(logits)[token]` on the host (sampled planning drafts).
fn softmax_prob(logits: &[f32], token: u32) -> f32 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f32 = logits.iter().map(|&l| (l - m).exp()).sum();
    (logits[token as usize] - m).exp() / z
}

#[cfg(test)]
mod tests {
    //! Iterative completion's rows in segments of the committed cache, driven with fake reads
    //! (each call still runs the fixture's forward, so the cache holds what the call wrote).

    use anyhow::{bail, ensure, Result};
    use wavefront_models::Qwen3;

    use super::*;
    use crate::slot_diffusion::test_support::fixture;

    fn read(argmax: u32, p: f32) -> ReadOut {
        ReadOut {
            argmax,
            max_prob: p,
            target_prob: p,
            logits: None,
        }
    }

    /// Runs `call` and returns its one sequence's buffer indices, mask rule and buffer length.
    fn forward(
        model: &Qwen3,
        p: &mut PlanInfill,
        call: &Call,
    ) -> Result<(Vec<u32>, MaskRule, usize)> {
        let ids: Vec<u32> = call.rows.iter().flat_map(|r| r.ids.clone()).collect();
        let mut seqs = p.sequences(call).map_err(anyhow::Error::msg)?;
        ensure!(seqs.len() == 1, "{} sequences", seqs.len());
        let (index, mask) = (seqs[0].index.clone(), seqs[0].mask);
        let Keys::Buffer { len, .. } = &seqs[0].keys else {
            bail!("the call does not extend the committed cache");
        };
        let len = *len;
        model.forward(&ids, &mut seqs)?;
        Ok((index, mask, len))
    }

    /// Fake reads for every read of `call`: argmax `first + i`, probability `prob(row)`.
    fn reads(call: &Call, first: u32, prob: impl Fn(usize) -> f32) -> Vec<Vec<ReadOut>> {
        let mut next = first;
        call.rows
            .iter()
            .enumerate()
            .map(|(r, row)| {
                row.reads
                    .iter()
                    .map(|_| {
                        next += 1;
                        read(next - 1, prob(r))
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn iterative_rows_live_in_segments_of_the_committed_cache_and_are_committed_in_place(
    ) -> Result<()> {
        let (model, _) = fixture()?;
        let s = Settings {
            span_size: 4,
            block_length: 8,
            blocks: 1,
            span_threshold: 0.9,
            token_threshold: 0.5,
            mask_id: 511,
            eos_rule: EosRule::Aligned,
        };
        let prompt = vec![34, 78, 79];
        let mut p = PlanInfill::new(s, prompt.clone(), (8, 8), vec![], None);
        let (mut stats, mut outbox) = (Stats::default(), Outbox::default());
        let committed = prompt.len();

        // Plan: both spans score above the threshold; verify: only each span's first token.
        // One call run and committed with the given reads (first token id, probability by row).
        let step = |p: &mut PlanInfill,
                    stats: &mut Stats,
                    outbox: &mut Outbox,
                    first: u32,
                    prob: &dyn Fn(usize) -> f32| {
            let call = p.next_call();
            forward(&model, p, &call)?;
            p.commit(&call, &reads(&call, first, prob), stats, outbox)
                .map_err(anyhow::Error::msg)
        };
        step(&mut p, &mut stats, &mut outbox, 100, &|_| 0.95)?;
        step(&mut p, &mut stats, &mut outbox, 0, &|_| 0.1)?;
        ensure!(
            matches!(p.phase, Phase::Infill(_)),
            "not in iterative completion"
        );
        ensure!(p.main.len() == committed, "the verification rows are cut");
        ensure!(stats.counters.get("iterative_path_iterations") == Some(&1));

        // Draft: every row whole, row r in segment r, seeing the committed rows and itself.
        let call = p.next_call();
        ensure!(call.rows.len() == 2);
        let (index, mask, len) = forward(&model, &mut p, &call)?;
        let segments = MaskRule::SegmentCausal {
            prefix: committed,
            segment: 4,
        };
        ensure!(index == (3..11).collect::<Vec<u32>>(), "{index:?}");
        ensure!(mask == segments && len == committed + 8);
        ensure!(p.main.len() == committed + 8, "{}", p.main.len());
        p.commit(&call, &reads(&call, 200, |_| 0.9), &mut stats, &mut outbox)
            .map_err(anyhow::Error::msg)?;

        // Verify: row 0 accepts everything, row 1 its forced token only: the common accepted
        // prefix is 1, so the next call rewrites each segment from its second index on.
        step(&mut p, &mut stats, &mut outbox, 0, &|r| {
            if r == 0 {
                0.9
            } else {
                0.1
            }
        })?;
        let call = p.next_call();
        let (index, mask, len) = forward(&model, &mut p, &call)?;
        ensure!(index == vec![4, 5, 6, 8, 9, 10], "{index:?}");
        ensure!(mask == segments && len == committed + 8);
        ensure!(
            p.main.len() == committed + 8,
            "no cache grows past the segments"
        );

        // Draft and verify with everything accepted: the segments are the committed rows.
        p.commit(&call, &reads(&call, 300, |_| 0.9), &mut stats, &mut outbox)
            .map_err(anyhow::Error::msg)?;
        step(&mut p, &mut stats, &mut outbox, 0, &|_| 0.9)?;
        let (ids, positions) = p.buffer();
        ensure!(ids.len() == committed + 8 && p.main.len() == committed + 8);
        ensure!(positions[committed..] == (3..11).collect::<Vec<u32>>()[..]);
        ensure!(p.is_done(), "the one block is decoded");
        Ok(())
    }
}
