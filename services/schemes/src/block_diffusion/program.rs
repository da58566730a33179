//! One LLaDA2.0 block-diffusion request (upstream `LLaDA2MoeModelLM.generate()`): a canvas of
//! whole blocks counted from position 0, decoded one block at a time, each in at most `steps`
//! forwards; the K/V of finished blocks kept in the request's paged cache.
//!
//! A step plans the rows whose K/V the cache does not hold from final tokens (the whole prompt
//! and the first decoded block at first; then the block just finished, once, and the current
//! block), with the block-causal rule over buffer indices and every other key read from the
//! cache. That is the upstream window forward (`x[:W]` under the block-causal mask) with the
//! finished blocks' rows not recomputed: a finished block never sees a later one, so its K/V
//! are the same in every later forward.
//!
//! Commit, as upstream: the block's masks get `x0` and a confidence (`softmax[x0]`, float32);
//! all those above `threshold` are committed when they are at least the step's share of the
//! block (`B // S`, the first `B % S` steps one more), otherwise the share's most confident.
//! With `eos_early_stop`, a step that commits an end-of-sequence token with no mask before it
//! ends the request; without it, a block holding one ends the request once the block is done.
//! Differences from upstream, none of which changes greedy tokens:
//! - the response is the generated tokens up to the first stop token, never the prompt (upstream's
//!   early-stop return includes the prompt), and the early-stop search starts at the generation
//!   (upstream's scans the prompt too);
//! - temperature 0 is the argmax (LLaDA2.1's fix; `upstream_sampler` draws as LLaDA2.0 does);
//! - the request's stop ids count as end-of-sequence tokens;
//! - the mask token is never a prediction.

use candle_core::{DType, Tensor};
use wavefront_engine::{CanvasFrame, CellState, FinishReason, Outbox, Stats, TokenLogprob};
use wavefront_models::transformer::{Keys, KvCache, MaskRule, SeqInput};

use crate::masked_diffusion::low_confidence_top_k;
use crate::masked_diffusion::posterior_greedy;
use crate::sampling::{score, Filter, TokenSampler};
use crate::SchemeError;

/// The sampler: the request's (temperature, top-k, top-p, its own generator).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Sampler {
    pub(crate) draws: TokenSampler,
    /// Draw at temperature 1 where the request is greedy (upstream LLaDA2.0).
    pub(crate) upstream: bool,
}

/// The block settings, checked by the planner.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct Settings {
    pub(crate) block_length: usize,
    /// Effective steps per block.
    pub(crate) steps: usize,
    pub(crate) threshold: f32,
    pub(crate) eos_early_stop: bool,
    pub(crate) mask_id: u32,
    pub(crate) stop: Vec<u32>,
}

/// What one step computes, as planned before the forward. A plan whose `window` ends before the
/// current block is a prefill chunk: whole blocks of the prompt, cached, with no logits read
/// (blocks see only earlier blocks, so a prompt prefilled in chunks of whole blocks gives the
/// same K/V as in one call).
#[derive(Debug)]
pub struct BdPlan {
    pub(crate) ids: Vec<u32>,
    /// First buffer index of the rows (the rows are `from..window`).
    pub(crate) from: usize,
    pub(crate) window: usize,
    /// Rows (offsets into the plan's rows) whose logits the step reads, and their positions.
    pub(crate) logit_rows: Vec<usize>,
    pub(crate) masked: Vec<usize>,
}

/// One step as recorded (tests compare it with upstream's trace).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BdStep {
    pub block: usize,
    pub step_in_block: usize,
    pub window_end: usize,
    /// The canvas `x[:W]` the step read.
    pub input: Vec<u32>,
    pub num_to_transfer: usize,
    pub above_threshold: usize,
    /// `"threshold"` or `"topk"`.
    pub branch: &'static str,
    pub committed: Vec<usize>,
    pub tokens: Vec<u32>,
    pub confidence: Vec<f32>,
    /// Rows the forward computed.
    pub rows: usize,
}

/// One request's decoding state.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct BdProgram {
    tokens: Vec<u32>,
    prompt_len: usize,
    gen: usize,
    s: Settings,
    /// Commits per step of a block.
    schedule: Vec<usize>,
    sampler: Sampler,
    /// The block being decoded and its next step.
    block: usize,
    step: usize,
    /// Buffer indices below this hold K/V of final tokens in `cache`.
    final_upto: usize,
    pub(crate) cache: KvCache,
    /// Generated tokens already streamed.
    streamed: usize,
    done: bool,
    pub(crate) stats: Stats,
    #[serde(skip)]
    record: Option<Vec<BdStep>>,
    pub(crate) stream_canvas: bool,
    /// Page tables of the cache (layers × ranks), and the most pages it can hold.
    kv_tables: usize,
    max_pages: usize,
    /// The log-probability of each committed position's token until it streams (requests
    /// that asked for them).
    #[serde(default)]
    scores: std::collections::BTreeMap<usize, TokenLogprob>,
    /// The structured-output constraint, when the request has one (it does not travel to
    /// another worker: `constrained` says it had one).
    #[serde(skip)]
    guide: Option<crate::constraint::Guide>,
    #[serde(default)]
    constrained: bool,
    /// The key of the prompt's whole blocks (prompt sharing), computed once.
    #[serde(default)]
    key: Option<u64>,
}

/// `num_transfer` of every step of a block of `block` tokens in `steps` steps.
pub(crate) fn schedule(block: usize, steps: usize) -> Vec<usize> {
    let (base, extra) = (block / steps, block % steps);
    (0..steps).map(|i| base + usize::from(i < extra)).collect()
}

impl BdProgram {
    pub(crate) fn new(
        prompt: &[u32],
        gen: usize,
        s: Settings,
        sampler: Sampler,
        kv_tables: usize,
        max_pages: usize,
    ) -> Self {
        let b = s.block_length;
        let blocks = (prompt.len() + gen).div_ceil(b);
        // Whole blocks see only themselves and earlier blocks: their K/V depend on their ids
        // and the block length alone.
        let whole = prompt.len() / b * b;
        let key =
            (whole > 0).then(|| crate::packing::key_of(&("llada2-blocks", b, &prompt[..whole])));
        let mut tokens = prompt.to_vec();
        tokens.resize(blocks * b, s.mask_id);
        Self {
            schedule: schedule(b, s.steps),
            block: prompt.len() / b,
            step: 0,
            prompt_len: prompt.len(),
            gen,
            tokens,
            s,
            sampler,
            final_upto: 0,
            cache: KvCache::new(),
            streamed: 0,
            done: false,
            stats: Stats::default(),
            record: None,
            scores: Default::default(),
            guide: None,
            constrained: false,
            stream_canvas: false,
            kv_tables,
            max_pages,
            key,
        }
    }

    /// Rows of the prompt's whole blocks.
    fn prompt_block_rows(&self) -> usize {
        self.prompt_len / self.s.block_length * self.s.block_length
    }

    /// The key of the state the prompt's whole blocks leave in the cache (their ids and the
    /// block length); `None` when they fill no whole page of `page` rows ending on a block
    /// boundary.
    pub(crate) fn share_key(&self, page: usize) -> Option<u64> {
        self.key
            .filter(|_| self.prompt_block_rows() >= self.share_unit(page))
    }

    /// Shared rows come in multiples of this: whole pages ending on a block boundary.
    fn share_unit(&self, page: usize) -> usize {
        let b = self.s.block_length;
        b / gcd(b, page) * page
    }

    /// Whether the prompt's whole blocks are still being computed.
    pub(crate) fn prompt_pending(&self) -> bool {
        self.final_upto < self.prompt_block_rows()
    }

    /// Rows of `donor`'s cache this request, which has computed nothing, may read as its own:
    /// the prompt's whole blocks the two have in common, in whole pages of `page` rows that end
    /// on a block boundary.
    pub(crate) fn shareable(&self, donor: &BdProgram, page: usize) -> usize {
        let b = self.s.block_length;
        let whole = self.prompt_block_rows();
        if self.final_upto > 0
            || !self.cache.is_empty()
            || donor.s.block_length != b
            || donor.final_upto < whole
            || donor.tokens.get(..whole) != self.tokens.get(..whole)
        {
            return 0;
        }
        let unit = self.share_unit(page);
        whole / unit * unit
    }

    /// The cache holds the prompt's first `rows` rows (another request's pages, whole blocks):
    /// they are final here too.
    pub(crate) fn skip_prompt(&mut self, rows: usize) -> Result<(), SchemeError> {
        if self.cache.len() != rows
            || rows > self.prompt_block_rows()
            || !rows.is_multiple_of(self.s.block_length)
        {
            return Err(SchemeError::inconsistent(
                "shared prompt rows are not whole blocks of the prompt",
            ));
        }
        self.final_upto = rows;
        self.stats.add_counter("shared_prompt_tokens", rows as u64);
        Ok(())
    }

    /// Keeps a [`BdStep`] per step.
    pub fn record_steps(&mut self) {
        self.record = Some(Vec::new());
    }

    pub fn steps(&self) -> &[BdStep] {
        self.record.as_deref().unwrap_or(&[])
    }

    /// The whole canvas (prompt, generation, the last block's surplus).
    pub fn canvas(&self) -> &[u32] {
        &self.tokens
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    fn window(&self) -> usize {
        (self.block + 1) * self.s.block_length
    }

    /// Whether the request has a structured-output constraint.
    pub(crate) fn constrained(&self) -> bool {
        self.constrained
    }

    /// Constrains the output.
    pub(crate) fn constrain(&mut self, guide: Option<crate::constraint::Guide>) {
        self.constrained = guide.is_some();
        self.guide = guide;
    }

    /// A structured-output step, canvas-aware: the block's masked positions commit in position
    /// order, each token chosen (argmax, or the request's draw) from its row masked to what the
    /// grammar allows after the tokens before it; the schedule's count, then each next one
    /// while its masked confidence exceeds the threshold. When the grammar completes, every
    /// position left in the canvas takes the end-of-sequence token (a point mass), so the
    /// request ends there. Returns the chosen offsets into `plan.masked`, their tokens and
    /// confidences.
    #[allow(clippy::type_complexity)]
    fn guided(
        &mut self,
        plan: &BdPlan,
        logits: &Tensor,
        k: usize,
    ) -> Result<(Vec<usize>, Vec<u32>, Vec<f32>), SchemeError> {
        let rows: Vec<Vec<f32>> = logits.to_dtype(DType::F32)?.to_vec2()?;
        let p = *self.sampler.draws.params();
        let greedy = p.is_greedy() && !self.sampler.upstream;
        let filter = if greedy {
            Filter::model()
        } else {
            Filter {
                temperature: if p.is_greedy() { 1.0 } else { p.temperature },
                top_k: p.top_k,
                top_p: p.top_p,
            }
        };
        let top = p.logprobs;
        let mask = self.s.mask_id;
        let (mut chosen, mut tokens, mut confs) = (Vec::new(), Vec::new(), Vec::new());
        let guide = self.guide.as_mut().expect("a guided step has a guide");
        for (i, row) in rows.iter().enumerate() {
            let mut masked = row.clone();
            if let Some(x) = masked.get_mut(mask as usize) {
                *x = f32::NEG_INFINITY;
            }
            guide.mask(&mut masked).map_err(SchemeError::inconsistent)?;
            let t = if greedy {
                crate::sampling::argmax(&masked)
            } else {
                self.sampler.draws.sample_with_prob(&masked).0
            };
            let conf = score(&masked, t, Filter::model(), 0).logprob.exp();
            if i >= k.max(1) && conf <= self.s.threshold {
                break;
            }
            if let Some(top) = top {
                let mut s = score(&masked, t, filter, top + 1);
                s.top.retain(|&(id, _)| id != mask);
                s.top.truncate(top);
                self.scores.insert(plan.masked[i], s);
            }
            chosen.push(i);
            tokens.push(t);
            confs.push(conf);
            if guide.advance(t).map_err(SchemeError::inconsistent)? {
                let eos = guide.eos();
                for q in plan.masked[i] + 1..self.tokens.len() {
                    if self.is_mask(q) {
                        self.tokens[q] = eos;
                        self.scores.insert(
                            q,
                            TokenLogprob {
                                logprob: 0.0,
                                top: Vec::new(),
                            },
                        );
                    }
                }
                break;
            }
        }
        Ok((chosen, tokens, confs))
    }

    fn is_mask(&self, i: usize) -> bool {
        self.tokens[i] == self.s.mask_id
    }

    fn is_stop(&self, t: u32) -> bool {
        self.s.stop.contains(&t)
    }

    /// Pages the cache holds after the next step: the window's rows.
    pub(crate) fn pages_needed(&self, page: usize) -> usize {
        if self.done {
            return 0;
        }
        (self.kv_tables * self.window().div_ceil(page)).min(self.max_pages)
    }

    /// Rows of uncached whole blocks before the current one (the prompt's at the first step, the
    /// block just finished after each block), and the block itself: what the next step
    /// computes, `(before, block)`.
    pub(crate) fn step_rows(&self) -> (usize, usize) {
        let start = self.window() - self.s.block_length;
        (start - self.final_upto, self.s.block_length)
    }

    /// A prefill chunk of `rows` (whole blocks, fewer than the step's uncached blocks): the
    /// next `rows` rows after the cached ones.
    pub(crate) fn plan_chunk(&self, rows: usize) -> BdPlan {
        let b = self.s.block_length;
        let (before, _) = self.step_rows();
        let rows = (rows / b * b).clamp(b.min(before), before);
        let from = self.final_upto;
        BdPlan {
            ids: self.tokens[from..from + rows].to_vec(),
            from,
            window: from + rows,
            logit_rows: Vec::new(),
            masked: Vec::new(),
        }
    }

    /// Rows of the next step.
    pub(crate) fn plan(&self) -> BdPlan {
        let window = self.window();
        let from = self.final_upto;
        let start = window - self.s.block_length;
        let masked: Vec<usize> = (start..window).filter(|&i| self.is_mask(i)).collect();
        BdPlan {
            ids: self.tokens[from..window].to_vec(),
            from,
            window,
            logit_rows: masked.iter().map(|&p| p - from).collect(),
            masked,
        }
    }

    /// The attention sequence of `plan`'s rows over the cache.
    pub(crate) fn sequence(&mut self, plan: &BdPlan) -> SeqInput<'_> {
        let index: Vec<u32> = (plan.from as u32..plan.window as u32).collect();
        SeqInput {
            positions: index.clone(),
            index,
            mask: MaskRule::BlockCausal {
                block: self.s.block_length,
            },
            keys: Keys::Buffer {
                cache: &mut self.cache,
                len: plan.window,
            },
        }
    }

    /// Commits a step: `logits` `[plan.logit_rows.len(), V]` (float32).
    pub(crate) fn commit(
        &mut self,
        plan: &BdPlan,
        logits: &Tensor,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        let rows = plan.window - plan.from;
        self.stats.forward_passes += 1;
        self.stats.push_series("active_rows", rows as u32);
        if plan.window < self.window() {
            // A prefill chunk: its blocks are cached from final tokens, nothing is decided.
            self.final_upto = plan.window;
            return Ok(());
        }
        let input = self
            .record
            .as_ref()
            .map(|_| self.tokens[..plan.window].to_vec());
        // Every row before the block was computed from final tokens.
        self.final_upto = plan.window - self.s.block_length;
        if self.constrained && self.guide.is_none() {
            return Err(SchemeError::inconsistent(
                "a structured-output request cannot continue on another worker",
            ));
        }
        let k = self.schedule[self.step];
        let (x0, conf, guided) = if self.guide.is_some() {
            let (chosen, tokens, confs) = self.guided(plan, logits, k)?;
            // Only the chosen offsets are read below: place their tokens there.
            let mut x0 = vec![self.s.mask_id; plan.masked.len()];
            let mut conf = vec![0f32; plan.masked.len()];
            for ((&i, t), c) in chosen.iter().zip(tokens).zip(confs) {
                x0[i] = t;
                conf[i] = c;
            }
            (x0, conf, Some(chosen))
        } else {
            let (x0, conf) = self.decode(logits)?;
            (x0, conf, None)
        };
        let above: Vec<usize> = (0..plan.masked.len())
            .filter(|&i| conf[i] > self.s.threshold)
            .collect();
        let (chosen, branch): (Vec<usize>, _) = if let Some(chosen) = guided {
            (chosen, "guided")
        } else if above.len() >= k {
            (above.clone(), "threshold")
        } else {
            let scored: Vec<(usize, f64)> = (0..plan.masked.len())
                .map(|i| (i, f64::from(conf[i])))
                .collect();
            (
                low_confidence_top_k(&scored, k.min(plan.masked.len())),
                "topk",
            )
        };
        let mut step = BdStep {
            block: self.block,
            step_in_block: self.step,
            window_end: plan.window,
            input: input.unwrap_or_default(),
            num_to_transfer: k,
            above_threshold: above.len(),
            branch,
            rows,
            ..BdStep::default()
        };
        // A guided step scored its tokens under their masked distributions.
        if let (Some(top), false) = (self.sampler.draws.logprobs(), branch == "guided") {
            self.score_commits(logits, &chosen, &x0, plan, top)?;
        }
        let mut stop_committed = false;
        for &i in &chosen {
            let p = plan.masked[i];
            self.tokens[p] = x0[i];
            stop_committed |= self.is_stop(x0[i]);
            step.committed.push(p);
            step.tokens.push(x0[i]);
            step.confidence.push(conf[i]);
        }
        self.stats
            .push_series("committed_per_step", chosen.len() as u32);
        if let Some(r) = &mut self.record {
            r.push(step);
        }
        self.step += 1;
        self.advance(stop_committed, outbox);
        Ok(())
    }

    /// Scores the chosen rows' tokens under the distribution each was committed from: the
    /// model's (the argmax of a greedy request), or the draw's (temperature, 1 where the
    /// request is greedy under `upstream_sampler`, then top-k and top-p; the mask never drawn).
    fn score_commits(
        &mut self,
        logits: &Tensor,
        chosen: &[usize],
        x0: &[u32],
        plan: &BdPlan,
        top: usize,
    ) -> candle_core::Result<()> {
        if chosen.is_empty() {
            return Ok(());
        }
        let rows: Vec<u32> = chosen.iter().map(|&i| i as u32).collect();
        let sub = logits.index_select(&Tensor::new(rows.as_slice(), logits.device())?, 0)?;
        let host: Vec<Vec<f32>> = sub.to_dtype(DType::F32)?.to_vec2()?;
        let p = self.sampler.draws.params();
        let filter = if p.is_greedy() && !self.sampler.upstream {
            Filter::model()
        } else {
            Filter {
                temperature: if p.is_greedy() { 1.0 } else { p.temperature },
                top_k: p.top_k,
                top_p: p.top_p,
            }
        };
        let mask = self.s.mask_id;
        for (&i, mut row) in chosen.iter().zip(host) {
            if filter != Filter::model() {
                if let Some(x) = row.get_mut(mask as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
            let mut s = score(&row, x0[i], filter, top + 1);
            s.top.retain(|&(id, _)| id != mask);
            s.top.truncate(top);
            self.scores.insert(plan.masked[i], s);
        }
        Ok(())
    }

    /// `x0` and its confidence for every logits row.
    fn decode(&mut self, logits: &Tensor) -> candle_core::Result<(Vec<u32>, Vec<f32>)> {
        if logits.dim(0)? == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        if self.sampler.draws.is_greedy() && !self.sampler.upstream {
            let (x0, conf) = posterior_greedy(logits, DType::F32, self.s.mask_id)?;
            return Ok((x0, conf.into_iter().map(|c| c as f32).collect()));
        }
        // Upstream's sampler: temperature (1 where greedy: LLaDA2.0 draws then too), top-k,
        // top-p, a draw; the mask is never drawn.
        let mask = self.s.mask_id as usize;
        Ok(logits
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?
            .into_iter()
            .map(|mut row| {
                if let Some(x) = row.get_mut(mask) {
                    *x = f32::NEG_INFINITY;
                }
                self.sampler.draws.sample_with_prob(&row)
            })
            .unzip())
    }

    /// Streams what became final, then moves to the next step, block or the end.
    fn advance(&mut self, stop_committed: bool, outbox: &mut Outbox) {
        let window = self.window();
        let start = window - self.s.block_length;
        let end = self.prompt_len + self.gen;
        // The committed prefix of the generation.
        let prefix_end = (self.prompt_len..end)
            .find(|&i| self.is_mask(i))
            .unwrap_or(end);
        let first_stop = (self.prompt_len..prefix_end).find(|&i| self.is_stop(self.tokens[i]));
        self.stream(first_stop.map_or(prefix_end, |e| e + 1), outbox);
        if self.stream_canvas {
            outbox.canvas(self.snapshot());
        }
        if self.s.eos_early_stop && stop_committed && first_stop.is_some() {
            return self.finish(FinishReason::StopToken, outbox);
        }
        if (start..window).any(|i| self.is_mask(i)) && self.step < self.s.steps {
            return;
        }
        // The block is done.
        let stop_in = (self.prompt_len..window.min(end)).any(|i| self.is_stop(self.tokens[i]));
        self.block += 1;
        self.step = 0;
        if stop_in {
            // Everything up to the first stop token is committed: stream it and end.
            let first = (self.prompt_len..end).find(|&i| self.is_stop(self.tokens[i]));
            self.stream(first.map_or(end, |e| e + 1), outbox);
            return self.finish(FinishReason::StopToken, outbox);
        }
        if self.block * self.s.block_length >= self.tokens.len() {
            self.stream(end, outbox);
            self.finish(FinishReason::Length, outbox);
        }
    }

    /// Sends generated tokens up to position `upto` (exclusive) not yet sent.
    fn stream(&mut self, upto: usize, outbox: &mut Outbox) {
        let from = self.prompt_len + self.streamed;
        if upto > from {
            let scored = self.sampler.draws.logprobs().map(|_| {
                (from..upto)
                    .map(|p| {
                        debug_assert!(self.scores.contains_key(&p), "position {p} unscored");
                        self.scores.remove(&p).unwrap_or_default()
                    })
                    .collect()
            });
            outbox.scored_tokens(self.tokens[from..upto].to_vec(), scored);
            self.streamed = upto - self.prompt_len;
        }
    }

    /// The generated region as it stands.
    pub(crate) fn snapshot(&self) -> CanvasFrame {
        let gen = self.prompt_len..self.prompt_len + self.gen;
        CanvasFrame {
            positions: (0..self.gen as u32).collect(),
            tokens: self.tokens[gen.clone()].to_vec(),
            states: gen
                .map(|i| {
                    if self.is_mask(i) {
                        CellState::Masked
                    } else {
                        CellState::Committed
                    }
                })
                .collect(),
            full: true,
            step: u32::try_from(self.stats.forward_passes).unwrap_or(u32::MAX),
        }
    }

    pub(crate) fn finish(&mut self, reason: FinishReason, outbox: &mut Outbox) {
        self.done = true;
        let first_decoded = self.prompt_len / self.s.block_length;
        self.stats
            .add_counter("blocks", (self.block - first_decoded) as u64);
        outbox.finish(reason, std::mem::take(&mut self.stats));
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::SamplingParams;

    #[test]
    fn the_schedule_splits_a_block_and_gives_the_remainder_first() {
        assert_eq!(schedule(8, 8), vec![1; 8]);
        assert_eq!(schedule(8, 4), vec![2; 4]);
        assert_eq!(schedule(16, 5), vec![4, 3, 3, 3, 3]);
    }

    /// Upstream's sampler at temperature 0 with `top_k` 1 is deterministic (a one-hot
    /// distribution, confidence 1), and the mask is never drawn, even where it is the best.
    #[test]
    fn a_one_hot_filter_makes_the_upstream_sampler_deterministic() -> candle_core::Result<()> {
        let settings = Settings {
            block_length: 4,
            steps: 4,
            threshold: 0.9,
            eos_early_stop: false,
            mask_id: 1,
            stop: Vec::new(),
        };
        let sampling = SamplingParams {
            top_k: 1,
            ..SamplingParams::default()
        };
        let sampler = Sampler {
            draws: TokenSampler::new(sampling),
            upstream: true,
        };
        let mut p = BdProgram::new(&[5, 6], 4, settings, sampler, 1, 8);
        let logits = candle_core::Tensor::new(
            &[[0.1f32, 2.0, 1.5, -1.0], [3.0, 2.0, 1.0, 0.0]],
            &candle_core::Device::Cpu,
        )?;
        for _ in 0..10 {
            assert_eq!(p.decode(&logits)?, (vec![2, 0], vec![1.0, 1.0]));
        }
        Ok(())
    }
}
