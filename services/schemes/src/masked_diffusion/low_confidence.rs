//! LLaDA's low-confidence remasking sampler (Nie et al., 2025, "Large Language Diffusion
//! Models", Sec. 2.4 and Algorithm 5; upstream `generate()` of ML-GSAI/LLaDA `generate.py`).
//!
//! The canvas is split into `gen_length / block_length` blocks decoded left to right; each
//! block gets `steps / num_blocks` steps. At a block's start, its `n` masks are spread over
//! the steps (`get_num_transfer_tokens`: `n / steps` each, the first `n % steps` steps one
//! more). Every step is one forward of the whole canvas (bidirectional, later blocks still
//! masked); for every masked position before the block's end, `x0` is the argmax (temperature
//! 0) or a Gumbel-max draw, and its score is `softmax(logits)[x0]` (float32, as upstream since
//! June 2025; `remasking = low_confidence`) or a uniform draw (`random`). The `k` best-scored
//! positions take their `x0`, and a committed token is never changed again.
//!
//! Differences from upstream, none of which changes a greedy run's tokens:
//! - a step whose schedule commits nothing is skipped (upstream still runs its forward), so
//!   `forward_passes` can be lower than upstream's step count when `steps > gen_length`;
//! - random draws (Gumbel noise, random scores) come from the request's own seeded generator,
//!   not torch's, and a temperature draw samples `softmax(logits / temperature)` directly,
//!   which is the distribution Gumbel-max samples;
//! - a committed stop token cuts the canvas (see [`super::canvas`]);
//! - the mask token is never predicted (see [`super::posterior`]).

use crate::migrate::RequestRng;
use candle_core::DType;
use rand::Rng;

use super::canvas::Canvas;
use super::posterior::{decode_rows, Draw};
use super::step::{StepInputs, StepRecord};
use crate::request::{KvCacheMode, Remasking};

/// Tokens committed at each of a block's `steps` steps for `masked` masks (upstream
/// `get_num_transfer_tokens`).
pub(crate) fn transfer_schedule(masked: usize, steps: usize) -> Vec<usize> {
    let (base, rem) = (masked / steps, masked % steps);
    (0..steps).map(|i| base + usize::from(i < rem)).collect()
}

/// The `k` best-scored positions (ties: the lower position first), in score order.
pub(crate) fn top_k(scored: &[(usize, f64)], k: usize) -> Vec<usize> {
    let mut order: Vec<(usize, f64)> = scored.to_vec();
    order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    order.into_iter().take(k).map(|(p, _)| p).collect()
}

/// Fast-dLLM's options (Wu et al., 2025; NVlabs/Fast-dLLM `llada/generate.py`).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub(crate) struct FastDllm {
    pub(crate) cache: KvCacheMode,
    /// Confidence-aware parallel decoding: commit the most confident candidate and every one
    /// at least this confident.
    pub(crate) threshold: Option<f64>,
    /// Make upstream's extra cached forward after a full forward that finished its block.
    pub(crate) upstream_calls: bool,
}

/// Per-request state of the low-confidence sampler.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct LowConfidence {
    pub(crate) steps_per_block: usize,
    pub(crate) remasking: Remasking,
    /// Commits per step of the current block.
    schedule: Vec<usize>,
    /// Next step of the current block.
    step: usize,
    /// Fast-dLLM's block cache (`None`: every step a full forward).
    #[serde(default)]
    pub(crate) cache: KvCacheMode,
    /// Fast-dLLM's threshold rule, when set.
    #[serde(default)]
    pub(crate) threshold: Option<f64>,
    #[serde(default)]
    pub(crate) upstream_calls: bool,
    /// Whether Fast-dLLM's scoring applies (float64 confidences, as its `get_transfer_index`).
    #[serde(default)]
    fast: bool,
    /// Forwards made in the current block (with a cache, the first is the full one).
    #[serde(default)]
    calls: usize,
    /// Replayed Gumbel noise for sampled steps (tests against upstream's own draws): per
    /// forward, `block_length` rows of `ln(-ln U)` over the vocabulary, row `i` for the block's
    /// position `i`; and the forwards made so far.
    #[serde(skip)]
    pub(crate) replay: Option<(std::sync::Arc<crate::ReplayDraws>, usize)>,
}

impl LowConfidence {
    pub(crate) fn new(steps_per_block: usize, remasking: Remasking) -> Self {
        Self {
            steps_per_block,
            remasking,
            schedule: Vec::new(),
            step: 0,
            cache: KvCacheMode::None,
            threshold: None,
            upstream_calls: false,
            fast: false,
            calls: 0,
            replay: None,
        }
    }

    /// Fast-dLLM's cache mode and threshold rule, when given.
    pub(crate) fn with_fast_dllm(mut self, fast: Option<FastDllm>) -> Self {
        if let Some(f) = fast {
            self.cache = f.cache;
            self.threshold = f.threshold;
            self.upstream_calls = f.upstream_calls;
            self.fast = true;
        }
        self
    }

    /// Plans a new block holding `masked` masks.
    pub(crate) fn start_block(&mut self, masked: usize) {
        self.schedule = transfer_schedule(masked, self.steps_per_block);
        self.step = 0;
        self.calls = 0;
    }

    /// Skips steps that commit nothing; `None` once the block's steps are used up. With the
    /// threshold rule every step commits (at least one token while the block has a mask), and
    /// the block lasts until it has none.
    pub(crate) fn next_commit(&mut self) -> Option<usize> {
        if self.threshold.is_some() {
            return Some(1);
        }
        while self.step < self.schedule.len() && self.schedule[self.step] == 0 {
            self.step += 1;
        }
        self.schedule.get(self.step).copied()
    }

    /// Marks the current step done.
    pub(crate) fn step_done(&mut self) {
        self.step += 1;
        self.calls += 1;
        if let Some((_, forwards)) = &mut self.replay {
            *forwards += 1;
        }
    }

    /// Whether the next step reads position `i` from the cache instead of computing it: after
    /// the block's first (full) forward, `prefix` reads the positions before the block, `dual`
    /// those before and after it.
    pub(crate) fn cached(&self, i: usize, block: std::ops::Range<usize>) -> bool {
        if self.calls == 0 {
            return false;
        }
        match self.cache {
            KvCacheMode::None => false,
            KvCacheMode::Prefix => i < block.start,
            KvCacheMode::Dual => !block.contains(&i),
        }
    }

    /// Whether a Fast-dLLM cache keeps the block's K/V (the program then has a row cache).
    pub(crate) fn caches(&self) -> bool {
        self.cache != KvCacheMode::None
    }

    /// Upstream's extra cached forward is owed: its block's full forward finished the block.
    pub(crate) fn owes_call(&self) -> bool {
        self.upstream_calls && self.caches() && self.calls == 1
    }
}

/// Upstream's Gumbel-max draw with replayed noise (Fast-dLLM's `add_gumbel_noise`, float64:
/// `argmax exp(l) / (-ln U)^T`, i.e. `argmax l - T ln(-ln U)`), and the float64 softmax of the
/// raw logits at the drawn token, for each candidate; the mask token is never drawn.
fn replayed_draws(
    inputs: &StepInputs,
    cands: &[usize],
    noise: &crate::ReplayDraws,
    first_row: usize,
    block_start: usize,
    temperature: f32,
    mask: u32,
) -> candle_core::Result<(Vec<u32>, Vec<f64>)> {
    let rows = inputs.rows(cands.iter().copied());
    let sub = inputs.logits.index_select(
        &candle_core::Tensor::new(rows.as_slice(), inputs.logits.device())?,
        0,
    )?;
    let logits: Vec<Vec<f32>> = sub.to_dtype(DType::F32)?.to_vec2()?;
    let t = f64::from(temperature);
    let mut out = (
        Vec::with_capacity(cands.len()),
        Vec::with_capacity(cands.len()),
    );
    for (&p, row) in cands.iter().zip(&logits) {
        let at = p
            .checked_sub(block_start)
            .map(|i| (first_row + i) * noise.dim);
        let g = at
            .and_then(|at| noise.data.get(at..at + row.len()))
            .ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "the replayed draws hold no row for position {p} (forward row {first_row})"
                ))
            })?;
        let x0 = (0..row.len())
            .filter(|&v| v != mask as usize)
            .map(|v| (v, f64::from(row[v]) - t * f64::from(g[v])))
            .fold((0, f64::NEG_INFINITY), |b, c| if c.1 > b.1 { c } else { b })
            .0;
        let max = row
            .iter()
            .map(|&l| f64::from(l))
            .fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = row.iter().map(|&l| (f64::from(l) - max).exp()).sum();
        out.0.push(x0 as u32);
        out.1.push((f64::from(row[x0]) - max).exp() / total);
    }
    Ok(out)
}

/// Fast-dLLM's threshold rule over scored candidates: the most confident one (ties: the lower
/// position), and every other whose confidence is at least `threshold`; in confidence order.
pub(crate) fn over_threshold(scored: &[(usize, f64)], threshold: f64) -> Vec<usize> {
    let mut order: Vec<(usize, f64)> = scored.to_vec();
    order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    order
        .into_iter()
        .enumerate()
        .filter(|&(rank, (_, c))| rank == 0 || c >= threshold)
        .map(|(_, (p, _))| p)
        .collect()
}

/// One step: score every candidate and commit the best `k` of the block's schedule.
pub(crate) fn step(
    lc: &mut LowConfidence,
    canvas: &mut Canvas,
    rng: &mut RequestRng,
    draw: Draw,
    inputs: &StepInputs,
) -> candle_core::Result<StepRecord> {
    let k = lc.next_commit().unwrap_or(0);
    let cands = inputs.candidates;
    let rows = inputs.rows(cands.iter().copied());
    // Fast-dLLM scores in float64 (its get_transfer_index); LLaDA's generate() in float32.
    let dtype = if lc.fast { DType::F64 } else { DType::F32 };
    let (x0, conf) = match &lc.replay {
        Some((noise, forward)) if draw.temperature > 0.0 => replayed_draws(
            inputs,
            cands,
            noise,
            *forward * canvas.block_length,
            canvas.block_start(),
            draw.temperature,
            canvas.mask_id,
        )?,
        _ => decode_rows(inputs.logits, &rows, draw, rng, dtype, canvas.mask_id)?,
    };
    let scored: Vec<(usize, f64)> = match lc.remasking {
        Remasking::LowConfidence => cands.iter().copied().zip(conf).collect(),
        Remasking::Random => cands.iter().map(|&p| (p, rng.random::<f64>())).collect(),
    };
    let chosen = match lc.threshold {
        Some(t) => over_threshold(&scored, t),
        None => top_k(&scored, k),
    };
    let mut record = StepRecord::default();
    for &p in &chosen {
        let i = cands
            .binary_search(&p)
            .expect("chosen among the candidates");
        canvas.tokens[p] = x0[i];
        record.committed.push(p);
        record.tokens.push(x0[i]);
        // `scored` follows `cands`.
        record.scores.push(scored[i].1);
    }
    lc.step_done();
    Ok(record)
}

/// One step of a structured-output request, canvas-aware: the block's masked positions commit
/// in position order (the first masked position of the canvas first), each token chosen from
/// the step's posterior at its position masked to what the grammar allows after the tokens
/// before it (the mask token never), by the request's draw. The step commits the schedule's
/// count (with the threshold rule: the first, then each next one while its masked confidence
/// reaches the threshold), or stops early when the grammar completes, writing the
/// end-of-sequence token after the last one so the canvas is cut there. Returns the record,
/// each committed token's log-probability under its masked distribution when `logprobs` asks,
/// and whether the output is complete.
pub(crate) fn guided_step(
    lc: &mut LowConfidence,
    canvas: &mut Canvas,
    rng: &mut RequestRng,
    draw: Draw,
    inputs: &StepInputs,
    guide: &mut crate::constraint::Guide,
    logprobs: Option<usize>,
) -> Result<(StepRecord, Vec<wavefront_engine::TokenLogprob>, bool), crate::SchemeError> {
    use crate::sampling::{draw_with, score, Filter};
    let k = match lc.threshold {
        Some(_) => inputs.candidates.len(),
        None => lc.next_commit().unwrap_or(0),
    };
    let cands: Vec<usize> = inputs.candidates.iter().copied().take(k).collect();
    let host = inputs.host_rows(cands.iter().copied())?;
    let filter = Filter::new(draw.temperature, draw.top_k, draw.top_p);
    let greedy = draw.temperature == 0.0;
    let mut record = StepRecord::default();
    let mut scores = Vec::new();
    let mut complete = false;
    for (i, (&p, row)) in cands.iter().zip(&host).enumerate() {
        let mut masked = row.clone();
        if let Some(x) = masked.get_mut(canvas.mask_id as usize) {
            *x = f32::NEG_INFINITY;
        }
        guide
            .mask(&mut masked)
            .map_err(crate::SchemeError::inconsistent)?;
        let (token, _) = draw_with(&masked, filter, greedy, rng.random::<f32>());
        let conf = f64::from(score(&masked, token, Filter::model(), 0).logprob.exp());
        if let Some(t) = lc.threshold {
            if i > 0 && conf < t {
                break;
            }
        }
        canvas.tokens[p] = token;
        record.committed.push(p);
        record.tokens.push(token);
        record.scores.push(conf);
        if let Some(top) = logprobs {
            let mut s = score(&masked, token, filter, top + 1);
            s.top.retain(|&(id, _)| id != canvas.mask_id);
            s.top.truncate(top);
            scores.push(s);
        }
        complete = guide
            .advance(token)
            .map_err(crate::SchemeError::inconsistent)?;
        if complete {
            let eos = guide.eos();
            if token != eos && p + 1 < canvas.len() && canvas.is_mask(p + 1) {
                // The completed grammar forces the end: a point mass, log-probability 0.
                canvas.tokens[p + 1] = eos;
                if logprobs.is_some() {
                    record.committed.push(p + 1);
                    record.tokens.push(eos);
                    record.scores.push(1.0);
                    scores.push(wavefront_engine::TokenLogprob {
                        logprob: 0.0,
                        top: Vec::new(),
                    });
                }
            }
            break;
        }
    }
    lc.step_done();
    Ok((record, scores, complete))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_spreads_the_remainder_over_the_first_steps() {
        assert_eq!(transfer_schedule(8, 8), vec![1; 8]);
        assert_eq!(transfer_schedule(8, 4), vec![2; 4]);
        assert_eq!(transfer_schedule(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(transfer_schedule(3, 5), vec![1, 1, 1, 0, 0]);
    }

    #[test]
    fn zero_steps_are_skipped_and_the_block_ends_after_its_steps() {
        let mut s = LowConfidence::new(5, Remasking::LowConfidence);
        s.start_block(2);
        assert_eq!(s.next_commit(), Some(1));
        s.step_done();
        assert_eq!(s.next_commit(), Some(1));
        s.step_done();
        assert_eq!(s.next_commit(), None);
    }

    #[test]
    fn the_threshold_rule_commits_the_best_and_every_one_at_least_as_confident() {
        let scored = [(7, 0.5), (3, 0.9), (5, 0.95), (1, 0.1)];
        assert_eq!(over_threshold(&scored, 0.9), vec![5, 3]);
        // Nothing reaches it: the most confident is committed anyway.
        assert_eq!(over_threshold(&scored, 0.99), vec![5]);
        assert!(over_threshold(&[], 0.5).is_empty());
    }

    #[test]
    fn a_cache_computes_the_whole_canvas_first_then_reads_around_the_block() {
        let mut s =
            LowConfidence::new(4, Remasking::LowConfidence).with_fast_dllm(Some(FastDllm {
                cache: KvCacheMode::Dual,
                threshold: None,
                upstream_calls: true,
            }));
        s.start_block(4);
        assert!(!s.cached(0, 8..12));
        s.step_done();
        assert!(s.owes_call());
        assert!(s.cached(0, 8..12) && !s.cached(8, 8..12) && s.cached(12, 8..12));
        s.cache = KvCacheMode::Prefix;
        assert!(s.cached(7, 8..12) && !s.cached(12, 8..12));
        s.step_done();
        assert!(!s.owes_call());
    }

    #[test]
    fn top_k_breaks_ties_by_position() {
        let scored = [(7, 0.5), (3, 0.9), (5, 0.5), (1, 0.1)];
        assert_eq!(top_k(&scored, 3), vec![3, 5, 7]);
        assert_eq!(top_k(&scored, 10).len(), 4);
    }
}
