//! One masked-diffusion request's program (LLaDA, Nie et al., 2025; WINO; SureLock): it plans
//! the rows of its next step and commits that step's logits.
//!
//! A step is one forward of the request's buffer: the canvas (low-confidence) or the canvas
//! followed by WINO's shadow block. Rows of locked positions (SureLock) are left out and their
//! keys read from the request's cache. After the decoder commits, SureLock decides new locks,
//! a committed stop token cuts the canvas (low-confidence), final tokens are streamed
//! (low-confidence: the committed prefix, since commits are final; WINO: a block once it has no
//! mask left, since drafts can be revoked until then) and the program moves to the next block or
//! finishes.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::migrate::RequestRng;
use candle_core::Tensor;
use rand::SeedableRng;
use wavefront_engine::{CanvasFrame, CellState, FinishReason, Outbox, Stats, TokenLogprob};
use wavefront_models::transformer::{KvCache, MaskRule};

use super::canvas::Canvas;
use super::diffusion_generate::{self, DiffusionGenerate};
use super::likelihood::Likelihood;
use super::low_confidence::{self, LowConfidence};
use super::posterior::{log_probs, Draw};
use super::step::{StepInputs, StepRecord};
use super::surelock::SureLock;
use super::wino::{self, Wino};
use crate::sampling::{score, score_probs, Filter};
use crate::SchemeError;

/// The sampler a program runs.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) enum Decoder {
    LowConfidence(LowConfidence),
    Wino(Wino),
    /// Dream's `diffusion_generate`.
    DiffusionGenerate(DiffusionGenerate),
}

/// What one step computes, as planned before the forward.
#[derive(Debug)]
pub struct StepPlan {
    /// Token of each row.
    pub(crate) ids: Vec<u32>,
    /// Buffer index of each row.
    pub(crate) index: Vec<u32>,
    /// Position id of each row.
    pub(crate) positions: Vec<u32>,
    pub(crate) mask: MaskRule,
    /// `Some(len)`: keys are the whole buffer, read through the SureLock cache.
    pub(crate) buffer_len: Option<usize>,
    /// Rows (indices into `index`) whose logits the step reads, in buffer order.
    pub(crate) logit_rows: Vec<usize>,
    /// Buffer index of each logit row.
    pub(crate) logit_index: Vec<usize>,
    /// Masked positions before the block's end at the step's input (the decoder's candidates).
    pub(crate) candidates: Vec<usize>,
    /// Tokens of the unconditional copy (classifier-free guidance), same rows.
    pub(crate) uncond_ids: Option<Vec<u32>>,
    /// Rows a step without SureLock computes (the whole buffer).
    pub(crate) dense_rows: usize,
}

/// One request's decoding state.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct MdProgram {
    pub(crate) canvas: Canvas,
    pub(crate) decoder: Decoder,
    pub(crate) surelock: Option<SureLock>,
    /// Per-layer K/V of the whole buffer, kept between steps for the rows a step does not
    /// compute (SureLock's locked positions, Fast-dLLM's cached ones).
    pub(crate) kv: Option<KvCache>,
    pub(crate) cfg_scale: f32,
    pub(crate) temperature: f32,
    /// `sampling.top_k` and `sampling.top_p` of low-confidence and WINO draws (0: none).
    #[serde(default)]
    pub(crate) top_k: usize,
    #[serde(default)]
    pub(crate) top_p: f32,
    #[serde(with = "crate::migrate::rng")]
    pub(crate) rng: RequestRng,
    pub(crate) stats: Stats,
    /// Algorithmic FLOPs of the rows computed, and of the dense steps.
    pub(crate) flops: (u64, u64),
    #[serde(skip)]
    pub(crate) record: Option<Vec<StepRecord>>,
    /// Send a snapshot of the generated region after every step.
    pub(crate) stream_canvas: bool,
    /// Position `j`'s prediction is read from the output row of `j - 1` (Dream).
    pub(crate) shifted: bool,
    /// How the request's slots divide over its rows (set by the planner).
    pub(crate) slot_plan: SlotPlan,
    /// Alternatives per token the request asked for with its log-probabilities.
    #[serde(default)]
    pub(crate) logprobs: Option<usize>,
    /// The log-probability of each position's current token, from the step that put it there
    /// (a WINO re-draft replaces it), until it streams.
    #[serde(default)]
    pub(crate) scores: BTreeMap<usize, TokenLogprob>,
    /// With `prompt_logprobs`: the prompt's scoring, run before the first decoding step.
    #[serde(default)]
    pub(crate) likelihood: Option<Likelihood>,
    /// The request only scores its prompt (`max_new_tokens` 0): it ends after the scoring.
    #[serde(default)]
    pub(crate) score_only: bool,
    /// The structured-output constraint, when the request has one (it does not travel to
    /// another worker: `constrained` says it had one).
    #[serde(skip)]
    pub(crate) guide: Option<crate::constraint::Guide>,
    #[serde(default)]
    pub(crate) constrained: bool,
}

/// The slots of a masked-diffusion request, per buffer row: its working set (one per row and
/// copy), and with SureLock the row's cached K/V in every layer and its previous posterior.
/// Rows cut after a stop token give all of theirs back; a locked row its posterior.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct SlotPlan {
    /// Working-set slots per row: one per copy (classifier-free guidance) and rank.
    pub(crate) copies: usize,
    /// Rows after the canvas (WINO's shadow block).
    pub(crate) shadow: usize,
    /// SureLock: cache layers per row (a page of one row in every layer and rank).
    pub(crate) cache: usize,
    /// SureLock: posterior slots per row.
    pub(crate) posterior: usize,
}

impl MdProgram {
    pub(crate) fn new(
        canvas: Canvas,
        decoder: Decoder,
        surelock: Option<SureLock>,
        cfg_scale: f32,
        temperature: f32,
        seed: u64,
    ) -> Self {
        let cached = matches!(&decoder, Decoder::LowConfidence(lc) if lc.caches());
        let kv = (cached || surelock.is_some()).then(KvCache::new);
        let mut p = Self {
            canvas,
            decoder,
            surelock,
            kv,
            cfg_scale,
            temperature,
            top_k: 0,
            top_p: 0.0,
            // A distinct stream from other schemes' draws of the same seed.
            rng: RequestRng::seed_from_u64(seed ^ 0x4d44_4946_4655_5345),
            stats: Stats::default(),
            flops: (0, 0),
            record: None,
            stream_canvas: false,
            shifted: false,
            slot_plan: SlotPlan::default(),
            logprobs: None,
            scores: BTreeMap::new(),
            likelihood: None,
            score_only: false,
            guide: None,
            constrained: false,
        };
        match &mut p.decoder {
            Decoder::LowConfidence(lc) => lc.start_block(p.canvas.masks_in_block()),
            Decoder::Wino(w) => w.start_block(&p.canvas),
            Decoder::DiffusionGenerate(_) => {}
        }
        p.skip_empty_steps();
        p
    }

    /// Slots the request needs from now on: every row's working set and SureLock cache, and the
    /// posteriors of the rows not locked.
    pub(crate) fn slots_needed(&self) -> usize {
        let p = self.slot_plan;
        let rows = self.canvas.len() + p.shadow;
        let locked = self.surelock.as_ref().map_or(0, |s| s.locked_count());
        rows * (p.copies + p.cache) + rows.saturating_sub(locked) * p.posterior
    }

    /// Reads every position's prediction from the output row before it (Dream's head).
    pub(crate) fn with_shifted_head(mut self) -> Self {
        self.shifted = true;
        self
    }

    /// Keeps a [`StepRecord`] per step.
    pub fn record_steps(&mut self) {
        self.record = Some(Vec::new());
        self.skip_empty_steps();
    }

    /// `diffusion-generate`: passes over the steps that would commit nothing, each an empty
    /// entry of the step record.
    fn skip_empty_steps(&mut self) {
        if let Decoder::DiffusionGenerate(dg) = &mut self.decoder {
            dg.skip_empty(self.canvas.candidates().len());
            if let Some(r) = &mut self.record {
                r.extend((0..dg.unrecorded).map(|_| StepRecord::default()));
                dg.unrecorded = 0;
            }
        }
    }

    /// The recorded steps.
    pub fn steps(&self) -> &[StepRecord] {
        self.record.as_deref().unwrap_or(&[])
    }

    /// The canvas: prompt and generated tokens (mask ids where still masked).
    pub fn tokens(&self) -> &[u32] {
        &self.canvas.tokens
    }

    /// Positions locked so far (SureLock).
    pub fn locked(&self) -> Vec<usize> {
        self.surelock.as_ref().map_or_else(Vec::new, |s| {
            (0..s.locked.len()).filter(|&i| s.locked[i]).collect()
        })
    }

    /// Tests: decide locks without skipping rows, so the run equals one without SureLock.
    #[cfg(test)]
    pub(crate) fn observe_locks_only(&mut self) {
        if let Some(s) = &mut self.surelock {
            s.apply = false;
        }
    }

    /// Rows the next step computes: the canvas less its locked positions, with WINO's shadow
    /// block, twice with classifier-free guidance.
    pub(crate) fn step_rows(&self) -> usize {
        if let Some(l) = &self.likelihood {
            return l.rows();
        }
        let shadow = match &self.decoder {
            Decoder::Wino(_) => self.canvas.block_length,
            Decoder::LowConfidence(_) | Decoder::DiffusionGenerate(_) => 0,
        };
        let skipped = (0..self.canvas.len()).filter(|&i| self.skips(i)).count();
        let copies = if self.cfg_scale > 0.0 { 2 } else { 1 };
        (self.canvas.len() - skipped + shadow) * copies
    }

    /// Whether the next step leaves position `i`'s row out (its keys read from the cache):
    /// SureLock locked it, or Fast-dLLM's cache holds it.
    fn skips(&self, i: usize) -> bool {
        self.surelock.as_ref().is_some_and(|s| s.skips(i))
            || match &self.decoder {
                Decoder::LowConfidence(lc) => {
                    lc.cached(i, self.canvas.block_start()..self.canvas.block_end())
                }
                Decoder::Wino(_) | Decoder::DiffusionGenerate(_) => false,
            }
    }

    /// Rows and keys of the next step.
    pub(crate) fn plan(&self) -> StepPlan {
        if let Some(l) = &self.likelihood {
            // A scoring forward: the (prefix of the) prompt with its masked tokens.
            let (ids, masked) = l.next();
            let n = ids.len();
            let source = |p: usize| {
                if self.shifted {
                    wavefront_models::Dream::prediction_row(p)
                } else {
                    p
                }
            };
            return StepPlan {
                ids,
                index: (0..n as u32).collect(),
                positions: (0..n as u32).collect(),
                mask: MaskRule::Bidirectional,
                buffer_len: None,
                logit_rows: masked.iter().map(|&p| source(p)).collect(),
                logit_index: masked,
                candidates: Vec::new(),
                uncond_ids: None,
                dense_rows: n,
            };
        }
        let c = &self.canvas;
        let l = c.len();
        let start = c.block_start();
        let (shadow, mask) = match &self.decoder {
            Decoder::LowConfidence(_) | Decoder::DiffusionGenerate(_) => {
                (0, MaskRule::Bidirectional)
            }
            Decoder::Wino(_) => (
                c.block_length,
                MaskRule::ShadowBlock {
                    main_len: l,
                    block_start: start,
                },
            ),
        };
        let buffer = l + shadow;
        let locked = |i: usize| self.surelock.as_ref().is_some_and(|s| s.is_locked(i));
        let mut row_of = vec![usize::MAX; buffer];
        let (mut index, mut positions, mut ids) = (
            Vec::with_capacity(buffer),
            Vec::with_capacity(buffer),
            Vec::with_capacity(buffer),
        );
        for (i, &token) in c.tokens.iter().enumerate() {
            if self.skips(i) {
                continue;
            }
            row_of[i] = index.len();
            index.push(i as u32);
            positions.push(i as u32);
            ids.push(token);
        }
        for j in 0..shadow {
            row_of[l + j] = index.len();
            index.push((l + j) as u32);
            positions.push((start + j) as u32);
            ids.push(c.mask_id);
        }
        let candidates = c.candidates();
        let mut need = candidates.clone();
        if let Decoder::Wino(w) = &self.decoder {
            need.extend(
                (0..w.decoded.len())
                    .filter(|&j| w.decoded[j] && !locked(start + j))
                    .map(|j| l + j),
            );
        }
        if self.surelock.is_some() {
            // The rows this forward computes (a Fast-dLLM cache leaves some out: SureLock
            // compares a position's posteriors between the forwards that compute it).
            need.extend((0..l).filter(|&i| !c.is_mask(i) && !locked(i) && !self.skips(i)));
        }
        need.sort_unstable();
        need.dedup();
        // Dream reads position j's prediction from row j - 1 (SureLock, which leaves rows out,
        // is not offered with a shifted head, so that row is computed).
        let source = |b: usize| {
            if self.shifted {
                wavefront_models::Dream::prediction_row(b)
            } else {
                b
            }
        };
        let logit_rows = need.iter().map(|&b| row_of[source(b)]).collect();
        let uncond_ids = (self.cfg_scale > 0.0).then(|| c.unconditional(&index));
        StepPlan {
            ids,
            index,
            positions,
            mask,
            buffer_len: self.kv.as_ref().map(|_| buffer),
            logit_rows,
            logit_index: need,
            candidates,
            uncond_ids,
            dense_rows: buffer,
        }
    }

    /// Adds one step's algorithmic FLOPs (rows computed, dense rows).
    pub(crate) fn account(&mut self, computed: u64, dense: u64) {
        self.flops.0 += computed;
        self.flops.1 += dense;
    }

    /// Commits a step: `logits` `[plan.logit_rows.len(), V]` (float32, guidance applied).
    pub(crate) fn commit(
        &mut self,
        plan: &StepPlan,
        logits: &Tensor,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        self.stats.forward_passes += 1;
        if let Some(l) = &mut self.likelihood {
            // A scoring forward: its terms, and the prompt's entries once the last is in.
            self.stats
                .push_series("active_rows", plan.index.len() as u32);
            let rows: Vec<Vec<f32>> = logits.to_dtype(candle_core::DType::F32)?.to_vec2()?;
            l.commit(&rows);
            if l.done() {
                outbox.prompt_logprobs(l.entries());
                self.likelihood = None;
                if self.score_only {
                    self.finish(FinishReason::Length, outbox);
                }
            }
            return Ok(());
        }
        let copies = if plan.uncond_ids.is_some() { 2 } else { 1 };
        self.stats
            .push_series("active_rows", (plan.index.len() * copies) as u32);
        let row_of: HashMap<usize, usize> = plan
            .logit_index
            .iter()
            .enumerate()
            .map(|(r, &b)| (b, r))
            .collect();
        let inputs = StepInputs {
            logits,
            row_of: &row_of,
            candidates: &plan.candidates,
        };
        let draw = Draw {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
        };
        if self.constrained && self.guide.is_none() {
            return Err(SchemeError::inconsistent(
                "a structured-output request cannot continue on another worker",
            ));
        }
        let guided = self.guide.is_some();
        let mut record = if let Some(guide) = self.guide.as_mut() {
            let (canvas, rng, top) = (&mut self.canvas, &mut self.rng, self.logprobs);
            let (r, scores, _) = match &mut self.decoder {
                Decoder::LowConfidence(lc) => {
                    low_confidence::guided_step(lc, canvas, rng, draw, &inputs, guide, top)?
                }
                Decoder::Wino(w) => wino::guided_step(w, canvas, rng, draw, &inputs, guide, top)?,
                Decoder::DiffusionGenerate(dg) => diffusion_generate::guided_step(
                    dg,
                    canvas,
                    rng,
                    self.temperature,
                    &inputs,
                    guide,
                    top,
                )?,
            };
            for (&p, s) in r.committed.iter().zip(scores) {
                self.scores.insert(p, s);
            }
            if matches!(self.decoder, Decoder::Wino(_)) {
                self.stats
                    .push_series("drafted_per_step", r.committed.len() as u32);
                self.stats.add_counter("drafted", r.committed.len() as u64);
            } else {
                self.stats
                    .push_series("committed_per_step", r.committed.len() as u32);
            }
            r
        } else {
            match &mut self.decoder {
                Decoder::LowConfidence(lc) => {
                    let r =
                        low_confidence::step(lc, &mut self.canvas, &mut self.rng, draw, &inputs)?;
                    self.stats
                        .push_series("committed_per_step", r.committed.len() as u32);
                    r
                }
                Decoder::Wino(w) => {
                    let surelock = self.surelock.as_ref();
                    let locked = |i: usize| surelock.is_some_and(|s| s.is_locked(i));
                    let r = wino::step(w, &mut self.canvas, &mut self.rng, draw, &locked, &inputs)?;
                    self.stats
                        .push_series("drafted_per_step", r.committed.len() as u32);
                    self.stats
                        .push_series("revoked_per_step", r.revoked.len() as u32);
                    self.stats.add_counter("drafted", r.committed.len() as u64);
                    self.stats.add_counter("revoked", r.revoked.len() as u64);
                    r
                }
                Decoder::DiffusionGenerate(dg) => {
                    let mut r = diffusion_generate::step(
                        dg,
                        &mut self.canvas,
                        &mut self.rng,
                        self.temperature,
                        &inputs,
                    )?;
                    self.stats
                        .push_series("committed_per_step", r.committed.len() as u32);
                    if self.record.is_none() {
                        r.confidence = Vec::new();
                    }
                    r
                }
            }
        };
        if let (Some(top), false) = (self.logprobs, guided) {
            self.score_commits(&record, &inputs, draw, top)?;
        }
        if let Some(sl) = &mut self.surelock {
            let l = self.canvas.len();
            let main: Vec<usize> = (0..plan.logit_index.len())
                .filter(|&r| plan.logit_index[r] < l)
                .collect();
            if !main.is_empty() {
                let rows: Vec<u32> = main.iter().map(|&r| r as u32).collect();
                let sub =
                    logits.index_select(&Tensor::new(rows.as_slice(), logits.device())?, 0)?;
                let lp = log_probs(&sub)?;
                let positions: Vec<usize> = main.iter().map(|&r| plan.logit_index[r]).collect();
                let was_mask: HashSet<usize> = plan.candidates.iter().copied().collect();
                let eligible: Vec<usize> = positions
                    .iter()
                    .copied()
                    .filter(|&p| {
                        !sl.is_locked(p) && !self.canvas.is_mask(p) && !was_mask.contains(&p)
                    })
                    .collect();
                let canvas = &self.canvas;
                record.locked = sl.observe(&lp, &positions, &eligible, |p| !canvas.is_mask(p))?;
            }
            self.stats
                .push_series("locked_per_step", record.locked.len() as u32);
        }
        if let Some(r) = &mut self.record {
            record.rows = plan.index.clone();
            record.logits = plan
                .logit_index
                .iter()
                .copied()
                .zip(logits.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?)
                .collect();
            r.push(record);
        }
        self.skip_empty_steps();
        if self.stream_canvas {
            outbox.canvas(self.snapshot());
        }
        self.advance(outbox)
    }

    /// Scores the tokens a step put on the canvas under the distribution each was committed (or
    /// drafted) from: the step's posterior at the position (guidance applied), at the
    /// request's temperature and filters for LLaDA's and WINO's draws, Dream's filtered
    /// posterior for `diffusion-generate`.
    fn score_commits(
        &mut self,
        record: &StepRecord,
        inputs: &StepInputs,
        draw: Draw,
        top: usize,
    ) -> candle_core::Result<()> {
        if record.committed.is_empty() {
            return Ok(());
        }
        let rows = inputs.rows(record.committed.iter().copied());
        let sub = inputs
            .logits
            .index_select(&Tensor::new(rows.as_slice(), inputs.logits.device())?, 0)?;
        let host: Vec<Vec<f32>> = sub.to_dtype(candle_core::DType::F32)?.to_vec2()?;
        let mask = self.canvas.mask_id;
        for ((&p, &token), row) in record.committed.iter().zip(&record.tokens).zip(&host) {
            let mut s = match &self.decoder {
                Decoder::DiffusionGenerate(dg) => {
                    let probs =
                        diffusion_generate::posterior(row, self.temperature, dg.top_k, dg.top_p);
                    score_probs(&probs, token, top + 1)
                }
                _ => score(
                    row,
                    token,
                    Filter::new(draw.temperature, draw.top_k, draw.top_p),
                    top + 1,
                ),
            };
            // The mask token is never a prediction.
            s.top.retain(|&(id, _)| id != mask);
            s.top.truncate(top);
            self.scores.insert(p, s);
        }
        Ok(())
    }

    /// The generated region as it stands: masked, drafted (WINO's current block, which
    /// verification may still revoke), locked (SureLock) or committed.
    pub(crate) fn snapshot(&self) -> CanvasFrame {
        let c = &self.canvas;
        let revocable_from = match self.decoder {
            Decoder::LowConfidence(_) | Decoder::DiffusionGenerate(_) => usize::MAX,
            Decoder::Wino(_) => c.block_start(),
        };
        let gen = c.prompt_len..c.len();
        let states = gen
            .clone()
            .map(|i| {
                if c.is_mask(i) {
                    CellState::Masked
                } else if self.surelock.as_ref().is_some_and(|s| s.is_locked(i)) {
                    CellState::Locked
                } else if i >= revocable_from {
                    CellState::Drafted
                } else {
                    CellState::Committed
                }
            })
            .collect();
        CanvasFrame {
            positions: (0..gen.len() as u32).collect(),
            tokens: c.tokens[gen].to_vec(),
            states,
            full: true,
            step: u32::try_from(self.stats.forward_passes).unwrap_or(u32::MAX),
        }
    }

    /// Cuts, streams, and moves to the next step, block or the end.
    fn advance(&mut self, outbox: &mut Outbox) -> Result<(), SchemeError> {
        match &mut self.decoder {
            Decoder::LowConfidence(lc) => {
                // Cut only once everything before the stop is committed: until then the
                // masked positions before it attend to the whole canvas, as upstream's do.
                if let Some(p) = self
                    .canvas
                    .first_stop()
                    .filter(|&p| self.canvas.settled_before(p))
                {
                    if self.canvas.cut_after(p) {
                        if let Some(sl) = &mut self.surelock {
                            sl.truncate(p + 1);
                        }
                        if let Some(kv) = &mut self.kv {
                            kv.truncate(p + 1)
                                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                        }
                    }
                }
                let (fresh, reason) = self.canvas.stream(self.canvas.committed_prefix_end());
                emit(&self.canvas, &mut self.scores, self.logprobs, fresh, outbox);
                if let Some(reason) = reason {
                    self.finish(reason, outbox);
                    return Ok(());
                }
                loop {
                    if !self.canvas.has_block() {
                        let (fresh, reason) = self.canvas.stream(self.canvas.len());
                        emit(&self.canvas, &mut self.scores, self.logprobs, fresh, outbox);
                        self.finish(reason.unwrap_or(FinishReason::Length), outbox);
                        return Ok(());
                    }
                    if lc.next_commit().is_some() && !self.canvas.candidates().is_empty() {
                        return Ok(());
                    }
                    // Fast-dLLM's extra cached forward (it commits nothing), when asked for.
                    if lc.owes_call() {
                        return Ok(());
                    }
                    self.canvas.block += 1;
                    if self.canvas.has_block() {
                        lc.start_block(self.canvas.masks_in_block());
                    }
                }
            }
            Decoder::DiffusionGenerate(dg) => {
                // Commits are final: the committed prefix streams, and the response ends at its
                // first stop token, whatever the later positions become.
                let (fresh, reason) = self.canvas.stream(self.canvas.committed_prefix_end());
                emit(&self.canvas, &mut self.scores, self.logprobs, fresh, outbox);
                if let Some(reason) = reason {
                    self.finish(reason, outbox);
                } else if dg.done() {
                    // The last step commits every mask left (`int(n)` of them, or each with
                    // probability 1 under `origin`): the rest of the canvas is final.
                    let (fresh, reason) = self.canvas.stream(self.canvas.len());
                    emit(&self.canvas, &mut self.scores, self.logprobs, fresh, outbox);
                    self.finish(reason.unwrap_or(FinishReason::Length), outbox);
                }
                Ok(())
            }
            Decoder::Wino(w) => {
                if !self.canvas.candidates().is_empty() {
                    return Ok(());
                }
                let (fresh, reason) = self.canvas.stream(self.canvas.block_end());
                emit(&self.canvas, &mut self.scores, self.logprobs, fresh, outbox);
                self.canvas.block += 1;
                if let Some(reason) = reason {
                    self.finish(reason, outbox);
                } else if !self.canvas.has_block() {
                    let (fresh, reason) = self.canvas.stream(self.canvas.len());
                    emit(&self.canvas, &mut self.scores, self.logprobs, fresh, outbox);
                    self.finish(reason.unwrap_or(FinishReason::Length), outbox);
                } else {
                    w.start_block(&self.canvas);
                }
                Ok(())
            }
        }
    }

    /// Ends the request with its statistics (blocks, and SureLock's locks and FLOPs).
    pub(crate) fn finish(&mut self, reason: FinishReason, outbox: &mut Outbox) {
        self.stats
            .add_counter("blocks", self.canvas.completed_blocks() as u64);
        if let Some(sl) = &self.surelock {
            self.stats.add_counter("locked", sl.locked_count() as u64);
            self.stats.add_counter("algorithmic_flops", self.flops.0);
            self.stats
                .add_counter("algorithmic_flops_dense", self.flops.1);
            let ppm = (self.flops.0 as f64 / self.flops.1.max(1) as f64 * 1e6).round() as u64;
            self.stats.add_counter("flops_ratio_ppm", ppm);
        }
        outbox.finish(reason, std::mem::take(&mut self.stats));
    }
}

/// Streams `fresh`, the tokens [`Canvas::stream`] just took, with their log-probabilities when
/// the request asked for them.
fn emit(
    canvas: &Canvas,
    scores: &mut BTreeMap<usize, TokenLogprob>,
    logprobs: Option<usize>,
    fresh: Vec<u32>,
    outbox: &mut Outbox,
) {
    let scored = logprobs.map(|_| {
        let end = canvas.streamed_end();
        (end - fresh.len()..end)
            .map(|p| {
                debug_assert!(scores.contains_key(&p), "position {p} streams unscored");
                scores.remove(&p).unwrap_or_default()
            })
            .collect()
    });
    outbox.scored_tokens(fresh, scored);
}
