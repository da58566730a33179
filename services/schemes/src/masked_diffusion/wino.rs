//! WINO, "Wide-In, Narrow-Out: Revokable Decoding for Efficient and Effective DLLMs" (Hong et
//! al., ICLR 2026; upstream `decoding_wino()` of Feng-Hong/WINO-DLLM `LLaDA/decoding.py`).
//!
//! Blocks are decoded left to right. The buffer is the canvas followed by a *shadow block* of
//! `block_length` mask tokens whose position ids copy the current block's; main rows never see
//! the shadow rows, and shadow row `j` sees everything except current-block position
//! `block_start + j` ([`wavefront_models::transformer::MaskRule::ShadowBlock`]). One forward per
//! step then both drafts and verifies:
//! - **draft (wide-in)**: masked positions whose `p[x0]` exceeds `tau1` (upstream `threshold`)
//!   take `x0`;
//! - **verify (narrow-out)**: a position decoded before this step is scored by its shadow row on
//!   the token it holds, and goes back to the mask token when that probability is below `tau2`
//!   (upstream `threshold_back`). Revoked positions are draft candidates again.
//!
//! Rules of the upstream code that the paper does not state, reproduced here:
//! - the draft cap `max_accept = min(max(int(0.7 · masked), 5), 20)` (masked positions counted
//!   before the step, the product in float32): above the cap only the `max_accept` most
//!   confident drafts are taken;
//! - when no position passes `tau1`, the single most confident one is drafted;
//! - verification runs only in steps that drafted more than one token, and when at least
//!   `last_accept` tokens fail it (`last_accept`: the previous step's draft count, 30 at each
//!   block's start) only the `last_accept - 1` least confident are revoked;
//! - probabilities are float64 softmaxes of the logits.
//!
//! With SureLock, a locked position keeps its token: it is not verified and cannot be revoked.

use crate::migrate::RequestRng;
use candle_core::{DType, Tensor};

use super::canvas::Canvas;
use super::low_confidence::top_k;
use super::posterior::{decode_rows, token_probs, Draw};
use super::step::{StepInputs, StepRecord};

/// `last_accept` at the start of every block (upstream constant).
pub(crate) const FIRST_LAST_ACCEPT: usize = 30;

/// Which rule chose a step's drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DraftBranch {
    /// Every position above `tau1`.
    Threshold,
    /// More than `max_accept` passed: the `max_accept` most confident.
    TopKMaxAccept,
    /// None passed: the single most confident.
    ArgmaxFallback,
}

impl DraftBranch {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            DraftBranch::Threshold => "threshold",
            DraftBranch::TopKMaxAccept => "topk_max_accept",
            DraftBranch::ArgmaxFallback => "argmax_fallback",
        }
    }
}

/// Upstream's draft cap for `masked` masks: `int(masked * 0.7)` in float32, clamped to 5..=20.
pub(crate) fn max_accept(masked: usize) -> usize {
    ((masked as f32 * 0.7_f32) as usize).clamp(5, 20)
}

/// Wide-in: which of the scored masked positions to draft.
pub(crate) fn draft(
    scored: &[(usize, f64)],
    max_accept: usize,
    tau1: f64,
) -> (Vec<usize>, DraftBranch) {
    let above: Vec<usize> = scored.iter().filter(|s| s.1 > tau1).map(|s| s.0).collect();
    if above.len() > max_accept {
        (top_k(scored, max_accept), DraftBranch::TopKMaxAccept)
    } else if above.is_empty() {
        // torch.argmax: the first maximum in position order.
        let best = scored
            .iter()
            .fold(None::<(usize, f64)>, |best, &(p, c)| match best {
                Some((bp, bc)) if c < bc || (c == bc && p > bp) => Some((bp, bc)),
                _ => Some((p, c)),
            });
        (
            best.map(|b| b.0).into_iter().collect(),
            DraftBranch::ArgmaxFallback,
        )
    } else {
        (above, DraftBranch::Threshold)
    }
}

/// Narrow-out: which verified positions to revoke, and whether the revocation cap applied.
/// `verified`: decoded positions with the probability their shadow row gives their token.
pub(crate) fn revoke(
    verified: &[(usize, f64)],
    drafted: usize,
    last_accept: usize,
    tau2: f64,
) -> (Vec<usize>, bool) {
    if drafted <= 1 {
        return (Vec::new(), false);
    }
    let below: Vec<usize> = verified
        .iter()
        .filter(|v| v.1 < tau2)
        .map(|v| v.0)
        .collect();
    if below.len() < last_accept {
        return (below, false);
    }
    let mut order = verified.to_vec();
    order.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    let capped = order
        .into_iter()
        .take(last_accept.saturating_sub(1))
        .map(|v| v.0)
        .collect();
    (capped, true)
}

/// Per-request WINO state.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Wino {
    pub(crate) tau1: f64,
    pub(crate) tau2: f64,
    pub(crate) last_accept: usize,
    /// Current-block offsets holding a token decoded before this step (upstream
    /// `unmask_index_block`), i.e. the ones its shadow rows verify.
    pub(crate) decoded: Vec<bool>,
}

impl Wino {
    pub(crate) fn new(tau1: f64, tau2: f64) -> Self {
        Self {
            tau1,
            tau2,
            last_accept: FIRST_LAST_ACCEPT,
            decoded: Vec::new(),
        }
    }

    /// Resets the per-block state for the canvas's current block.
    pub(crate) fn start_block(&mut self, canvas: &Canvas) {
        self.last_accept = FIRST_LAST_ACCEPT;
        let start = canvas.block_start();
        self.decoded = (start..start + canvas.block_length)
            .map(|i| i < canvas.len() && !canvas.is_mask(i))
            .collect();
    }
}

/// One step: draft masked positions, verify the ones decoded before, revoke.
pub(crate) fn step(
    w: &mut Wino,
    canvas: &mut Canvas,
    rng: &mut RequestRng,
    draw: Draw,
    locked: &dyn Fn(usize) -> bool,
    inputs: &StepInputs,
) -> candle_core::Result<StepRecord> {
    let (l, s) = (canvas.len(), canvas.block_start());
    let cands = inputs.candidates;
    let cap = max_accept(cands.len());
    let rows = inputs.rows(cands.iter().copied());
    let (x0, conf) = decode_rows(inputs.logits, &rows, draw, rng, DType::F64, canvas.mask_id)?;
    let scored: Vec<(usize, f64)> = cands.iter().copied().zip(conf).collect();

    let verify: Vec<usize> = (0..w.decoded.len())
        .filter(|&j| w.decoded[j] && !locked(s + j))
        .collect();
    let verified: Vec<(usize, f64)> = if verify.is_empty() {
        Vec::new()
    } else {
        let rows = inputs.rows(verify.iter().map(|&j| l + j));
        let shadow = inputs
            .logits
            .index_select(&Tensor::new(rows.as_slice(), inputs.logits.device())?, 0)?;
        let held: Vec<u32> = verify.iter().map(|&j| canvas.tokens[s + j]).collect();
        let p = token_probs(&shadow, &held, DType::F64)?;
        verify.iter().map(|&j| s + j).zip(p).collect()
    };

    let (drafted, branch) = draft(&scored, cap, w.tau1);
    let (revoked, capped) = revoke(&verified, drafted.len(), w.last_accept, w.tau2);
    let mut record = StepRecord {
        branch: Some(branch.as_str()),
        remask_capped: capped,
        max_accept: cap,
        last_accept: w.last_accept,
        ..StepRecord::default()
    };
    let block = s..s + w.decoded.len();
    for &p in &drafted {
        let i = cands
            .binary_search(&p)
            .expect("drafted among the candidates");
        canvas.tokens[p] = x0[i];
        if block.contains(&p) {
            w.decoded[p - s] = true;
        }
        record.committed.push(p);
        record.tokens.push(x0[i]);
    }
    for &p in &revoked {
        canvas.tokens[p] = canvas.mask_id;
        w.decoded[p - s] = false;
    }
    record.revoked = revoked;
    w.last_accept = drafted.len();
    Ok(record)
}

/// One step of a structured-output request: WINO's wide-in half, in position order. The block's
/// masked positions are drafted from the first on, each token chosen from its posterior masked
/// to what the grammar allows after the tokens before it, while its masked confidence reaches
/// `tau1` (at least one, at most the draft cap); a draft is final (nothing is revoked: a
/// grammar's state cannot follow a revocation in the middle of the output). When the grammar
/// completes, the end-of-sequence token follows, and the block's later positions take it too.
/// Returns the record, the drafts' log-probabilities under their masked posteriors when
/// `logprobs` asks, and whether the output is complete.
pub(crate) fn guided_step(
    w: &mut Wino,
    canvas: &mut Canvas,
    rng: &mut RequestRng,
    draw: Draw,
    inputs: &StepInputs,
    guide: &mut crate::constraint::Guide,
    logprobs: Option<usize>,
) -> Result<(StepRecord, Vec<wavefront_engine::TokenLogprob>, bool), crate::SchemeError> {
    use crate::sampling::{draw_with, score, Filter};
    use rand::Rng;
    let s = canvas.block_start();
    let cands = inputs.candidates;
    let cap = max_accept(cands.len());
    let host = inputs.host_rows(cands.iter().copied().take(cap))?;
    let filter = Filter::new(draw.temperature, draw.top_k, draw.top_p);
    let greedy = draw.temperature == 0.0;
    let mut record = StepRecord {
        branch: Some("guided"),
        max_accept: cap,
        last_accept: w.last_accept,
        ..StepRecord::default()
    };
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
        if i > 0 && conf < w.tau1 {
            break;
        }
        canvas.tokens[p] = token;
        if let Some(d) = w.decoded.get_mut(p - s) {
            *d = true;
        }
        record.committed.push(p);
        record.tokens.push(token);
        record.scores.push(conf);
        if let Some(top) = logprobs {
            let mut sc = score(&masked, token, filter, top + 1);
            sc.top.retain(|&(id, _)| id != canvas.mask_id);
            sc.top.truncate(top);
            scores.push(sc);
        }
        complete = guide
            .advance(token)
            .map_err(crate::SchemeError::inconsistent)?;
        if complete {
            break;
        }
    }
    if complete {
        // The output is over: the block's positions after it end it.
        let eos = guide.eos();
        let end = canvas.block_end();
        let from = record.committed.last().map_or(s, |&p| p + 1);
        for q in from..end {
            if canvas.is_mask(q) {
                canvas.tokens[q] = eos;
                if let Some(d) = w.decoded.get_mut(q - s) {
                    *d = true;
                }
                record.committed.push(q);
                record.tokens.push(eos);
                record.scores.push(1.0);
                if logprobs.is_some() {
                    scores.push(wavefront_engine::TokenLogprob {
                        logprob: 0.0,
                        top: Vec::new(),
                    });
                }
            }
        }
    }
    w.last_accept = record.committed.len();
    Ok((record, scores, complete))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_cap_follows_upstream() {
        assert_eq!(max_accept(16), 11);
        assert_eq!(max_accept(5), 5);
        assert_eq!(max_accept(1), 5);
        assert_eq!(max_accept(40), 20);
        assert_eq!(max_accept(10), 7);
        assert_eq!(max_accept(20), 14);
    }

    #[test]
    fn draft_branches() {
        let scored = [(3, 0.7), (4, 0.5), (6, 0.9), (8, 0.65)];
        assert_eq!(
            draft(&scored, 5, 0.6),
            (vec![3, 6, 8], DraftBranch::Threshold)
        );
        assert_eq!(
            draft(&scored, 2, 0.6),
            (vec![6, 3], DraftBranch::TopKMaxAccept)
        );
        assert_eq!(
            draft(&scored, 5, 0.95),
            (vec![6], DraftBranch::ArgmaxFallback)
        );
        let tied = [(3, 0.2), (4, 0.2)];
        assert_eq!(draft(&tied, 5, 0.95).0, vec![3]);
    }

    #[test]
    fn revocation_needs_a_parallel_draft_and_is_capped() {
        let verified = [(1, 0.95), (2, 0.3), (3, 0.1), (5, 0.5)];
        assert_eq!(revoke(&verified, 1, 30, 0.9), (vec![], false));
        assert_eq!(revoke(&verified, 2, 30, 0.9), (vec![2, 3, 5], false));
        // Three fail and last_accept is 3: only the two least confident go.
        assert_eq!(revoke(&verified, 2, 3, 0.9), (vec![3, 2], true));
        assert_eq!(revoke(&verified, 2, 1, 0.9), (vec![], true));
    }
}
