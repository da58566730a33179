//! Dream's sampler (Ye et al., 2025, "Dream 7B"; upstream `DreamGenerationMixin._sample` of
//! Dream-org/Dream-v0-Instruct-7B's `generation_utils.py`), served as the scheme
//! `diffusion-generate`.
//!
//! The canvas is the prompt followed by `max_new_tokens` masks, decoded as one block in `steps`
//! steps. Every step is one forward of the whole canvas (no cache), and every mask on the canvas,
//! prompt masks included, is a candidate whose prediction is read from the output row before it
//! (Dream's shifted head; [`wavefront_models::Dream::prediction_row`]). With
//! `timesteps = linspace(1, eps, steps + 1)` in float32 and step `i` going from `t = timesteps[i]`
//! to `s = timesteps[i + 1]`:
//! - `origin`: each mask is committed with probability `1 - s/t` (1 at the last step), one
//!   uniform draw per mask in canvas order, taking its argmax (or a temperature draw);
//! - `maskgit_plus`, `topk_margin`, `entropy`: every mask gets `x0` (argmax, or a draw) and a
//!   confidence from its filtered posterior (`p[x0]`, `p1 - p2`, or `Σ p log(p + 1e-10)`); the
//!   `int(n · (1 - s/t))` most confident masks are committed (`int(n)` at the last step), where
//!   `n` counts the canvas's masks (float32); with `alg_temp > 0` they are drawn from
//!   `softmax(confidence / alg_temp)` instead.
//!
//! Posteriors: logits divided by the temperature when it is positive, then upstream's top-p
//! filter (tokens past the cumulative `top_p` removed, the top token always kept), then its top-k
//! filter (logits below the k-th largest removed), then a float32 softmax renormalised over what
//! is kept. Committed tokens are final.
//!
//! Differences from upstream, none of which changes a greedy run's tokens:
//! - a confidence step that commits nothing is not run (upstream still runs its forward and
//!   appends an unchanged canvas): its decision needs no logits. `forward_passes` counts the
//!   forwards run; the step record keeps an empty entry for it;
//! - the response ends at the first stop token (the model's `<|endoftext|>` or a request's stop
//!   ids) once every position before it is committed: what follows is what upstream's caller cuts
//!   (`split(eos_token)[0]`), and nothing before it can change any more;
//! - random draws (the origin draws, temperature draws, `alg_temp` draws) come from the request's
//!   own seeded generator, or from recorded draws ([`crate::ReplayDraws`]) for the origin draws;
//! - the mask token is never a prediction: where it wins the argmax, the best other token is
//!   taken with its probability under the same posterior.

use crate::migrate::RequestRng;
use rand::Rng;

use super::canvas::Canvas;
use super::low_confidence::top_k;
use super::step::{StepInputs, StepRecord};
use crate::request::DreamAlg;

/// `torch.linspace(start, end, n)` in float32, as its CPU kernel computes it: the first half
/// counts up from `start`, the second half down from `end`.
pub(crate) fn linspace(start: f32, end: f32, n: usize) -> Vec<f32> {
    if n == 1 {
        return vec![start];
    }
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(|i| {
            if i < half {
                start + step * i as f32
            } else {
                end - step * (n - i - 1) as f32
            }
        })
        .collect()
}

/// Per-request state of the sampler.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct DiffusionGenerate {
    pub(crate) alg: DreamAlg,
    pub(crate) alg_temp: f32,
    /// Filters of the posterior (`None`: off).
    pub(crate) top_k: Option<usize>,
    pub(crate) top_p: Option<f32>,
    timesteps: Vec<f32>,
    /// The next step.
    step: usize,
    /// Recorded uniform draws of the origin rule, consumed in order.
    replay: Option<(std::sync::Arc<crate::ReplayDraws>, usize)>,
    /// Steps passed over and not yet written to a step record.
    pub(crate) unrecorded: usize,
}

impl DiffusionGenerate {
    pub(crate) fn new(
        alg: DreamAlg,
        steps: usize,
        eps: f32,
        alg_temp: f32,
        top_k: Option<usize>,
        top_p: Option<f32>,
        replay: Option<std::sync::Arc<crate::ReplayDraws>>,
    ) -> Self {
        Self {
            alg,
            alg_temp,
            top_k,
            top_p,
            timesteps: linspace(1.0, eps, steps + 1),
            step: 0,
            replay: replay.map(|r| (r, 0)),
            unrecorded: 0,
        }
    }

    pub(crate) fn steps(&self) -> usize {
        self.timesteps.len() - 1
    }

    /// Whether every step has run.
    pub(crate) fn done(&self) -> bool {
        self.step >= self.steps()
    }

    /// `1 - s/t` of step `i` in float32, 1 at the last step.
    fn transfer(&self, i: usize) -> f32 {
        if i + 1 < self.steps() {
            1.0 - self.timesteps[i + 1] / self.timesteps[i]
        } else {
            1.0
        }
    }

    /// Positions a confidence step `i` commits among `masks` masks.
    fn commits(&self, i: usize, masks: usize) -> usize {
        let n = masks as f32;
        if i + 1 < self.steps() {
            (n * self.transfer(i)) as usize
        } else {
            n as usize
        }
    }

    /// Passes over the steps that commit nothing (counted in `unrecorded`): with no mask left,
    /// every remaining step; otherwise, for the confidence algorithms, the steps whose share
    /// rounds to zero (the origin rule draws at every step).
    pub(crate) fn skip_empty(&mut self, masks: usize) {
        while !self.done()
            && (masks == 0 || (self.alg != DreamAlg::Origin && self.commits(self.step, masks) == 0))
        {
            self.step += 1;
            self.unrecorded += 1;
        }
    }

    fn uniform(&mut self, rng: &mut RequestRng) -> candle_core::Result<f32> {
        match &mut self.replay {
            None => Ok(rng.random::<f32>()),
            Some((draws, at)) => {
                let u = draws.data.get(*at).copied().ok_or_else(|| {
                    candle_core::Error::Msg(format!("the replayed draws ran out after {at} values"))
                })?;
                *at += 1;
                Ok(u)
            }
        }
    }
}

/// A row's filtered posterior: float32 probabilities over the vocabulary.
pub(crate) fn posterior(
    row: &[f32],
    temperature: f32,
    top_k: Option<usize>,
    top_p: Option<f32>,
) -> Vec<f32> {
    let mut l: Vec<f32> = if temperature > 0.0 {
        row.iter().map(|&x| x / temperature).collect()
    } else {
        row.to_vec()
    };
    let removed = f32::MIN;
    if let Some(p) = top_p.filter(|&p| p < 1.0) {
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        let probs = softmax(&order.iter().map(|&i| l[i]).collect::<Vec<_>>());
        // Remove where the cumulative mass *before* a token already exceeds top_p (the shift
        // right by one that keeps the first token above the threshold).
        let mut cum = 0f32;
        let mut drop = Vec::new();
        for (rank, &i) in order.iter().enumerate() {
            if rank > 0 && cum > p {
                drop.push(i);
            }
            cum += probs[rank];
        }
        for i in drop {
            l[i] = removed;
        }
    }
    if let Some(k) = top_k {
        let k = k.min(l.len()).max(1);
        let mut sorted = l.clone();
        let (_, kth, _) = sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let kth = *kth;
        for x in &mut l {
            if *x < kth {
                *x = removed;
            }
        }
    }
    softmax(&l)
}

/// Float32 softmax.
fn softmax(l: &[f32]) -> Vec<f32> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = l.iter().map(|&x| (x - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

/// `x0` of a posterior: the argmax (the mask token excluded) or, at a positive temperature, a
/// draw from it.
fn pick(p: &[f32], temperature: f32, never: u32, rng: &mut RequestRng) -> u32 {
    if temperature > 0.0 {
        let total: f64 = p
            .iter()
            .enumerate()
            .filter(|&(i, _)| i as u32 != never)
            .map(|(_, &x)| f64::from(x))
            .sum();
        let mut u = rng.random::<f64>() * total;
        for (i, &x) in p.iter().enumerate() {
            if i as u32 == never {
                continue;
            }
            if u < f64::from(x) {
                return i as u32;
            }
            u -= f64::from(x);
        }
    }
    let mut best = usize::from(never == 0);
    for (i, &x) in p.iter().enumerate() {
        if i as u32 != never && x > p[best] {
            best = i;
        }
    }
    best as u32
}

/// The confidence of `x0` under `p` for a confidence algorithm.
fn confidence(alg: DreamAlg, p: &[f32], x0: u32) -> f32 {
    match alg {
        DreamAlg::MaskgitPlus | DreamAlg::Origin => p[x0 as usize],
        DreamAlg::TopkMargin => {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &x in p {
                if x > a {
                    b = a;
                    a = x;
                } else if x > b {
                    b = x;
                }
            }
            a - b
        }
        DreamAlg::Entropy => {
            let s: f64 = p
                .iter()
                .map(|&x| f64::from(x) * f64::from((x + 1e-10).ln()))
                .sum();
            s as f32
        }
    }
}

/// One step: decide and commit the canvas's masks.
pub(crate) fn step(
    dg: &mut DiffusionGenerate,
    canvas: &mut Canvas,
    rng: &mut RequestRng,
    temperature: f32,
    inputs: &StepInputs,
) -> candle_core::Result<StepRecord> {
    let i = dg.step;
    let cands = inputs.candidates;
    let host = inputs.host_rows(cands.iter().copied())?;
    let mut record = StepRecord::default();
    if dg.alg == DreamAlg::Origin {
        let p_transfer = dg.transfer(i);
        let mut chosen = Vec::new();
        for &p in cands {
            if dg.uniform(rng)? < p_transfer {
                chosen.push(p);
            }
        }
        for p in chosen {
            let r = cands.binary_search(&p).expect("a candidate");
            let post = posterior(&host[r], temperature, dg.top_k, dg.top_p);
            let x0 = pick(&post, temperature, canvas.mask_id, rng);
            canvas.tokens[p] = x0;
            record.committed.push(p);
            record.tokens.push(x0);
        }
    } else {
        let mut x0 = Vec::with_capacity(cands.len());
        let mut scored = Vec::with_capacity(cands.len());
        for (r, &p) in cands.iter().enumerate() {
            let post = posterior(&host[r], temperature, dg.top_k, dg.top_p);
            let x = pick(&post, temperature, canvas.mask_id, rng);
            x0.push(x);
            let c = confidence(dg.alg, &post, x);
            record.confidence.push((p, c));
            scored.push((p, f64::from(c)));
        }
        let k = dg.commits(i, cands.len());
        let chosen = if dg.alg_temp > 0.0 {
            draw_without_replacement(&scored, k, dg.alg_temp, rng)
        } else {
            top_k(&scored, k)
        };
        for p in chosen {
            let r = cands.binary_search(&p).expect("a candidate");
            canvas.tokens[p] = x0[r];
            record.committed.push(p);
            record.tokens.push(x0[r]);
        }
    }
    dg.step += 1;
    Ok(record)
}

/// A structured-output step, canvas-aware: as many positions as the step would commit (the
/// schedule's share for the confidence algorithms, the origin rule's draws), but the canvas's
/// masked positions in position order, each token chosen from Dream's filtered posterior of its
/// row masked to what the grammar allows after the tokens before it. When the grammar
/// completes, every masked position left takes the end-of-sequence token (a point mass), so the
/// response ends there. Returns the record, the committed tokens' log-probabilities under their
/// masked posteriors when `logprobs` asks, and whether the output is complete.
pub(crate) fn guided_step(
    dg: &mut DiffusionGenerate,
    canvas: &mut Canvas,
    rng: &mut RequestRng,
    temperature: f32,
    inputs: &StepInputs,
    guide: &mut crate::constraint::Guide,
    logprobs: Option<usize>,
) -> Result<(StepRecord, Vec<wavefront_engine::TokenLogprob>, bool), crate::SchemeError> {
    let i = dg.step;
    let cands = inputs.candidates;
    let k = if dg.alg == DreamAlg::Origin {
        let p_transfer = dg.transfer(i);
        let mut n = 0;
        for _ in cands {
            n += usize::from(dg.uniform(rng)? < p_transfer);
        }
        n
    } else {
        dg.commits(i, cands.len())
    };
    let chosen: Vec<usize> = cands.iter().copied().take(k).collect();
    let host = inputs.host_rows(chosen.iter().copied())?;
    let mut record = StepRecord::default();
    let mut scores = Vec::new();
    let mut complete = false;
    for (&p, row) in chosen.iter().zip(&host) {
        let mut masked = row.clone();
        if let Some(x) = masked.get_mut(canvas.mask_id as usize) {
            *x = f32::NEG_INFINITY;
        }
        guide
            .mask(&mut masked)
            .map_err(crate::SchemeError::inconsistent)?;
        let post = posterior(&masked, temperature, dg.top_k, dg.top_p);
        let x0 = pick(&post, temperature, canvas.mask_id, rng);
        canvas.tokens[p] = x0;
        record.committed.push(p);
        record.tokens.push(x0);
        if let Some(top) = logprobs {
            let mut s = crate::sampling::score_probs(&post, x0, top + 1);
            s.top.retain(|&(id, _)| id != canvas.mask_id);
            s.top.truncate(top);
            scores.push(s);
        }
        complete = guide
            .advance(x0)
            .map_err(crate::SchemeError::inconsistent)?;
        if complete {
            let eos = guide.eos();
            for q in p + 1..canvas.len() {
                if canvas.is_mask(q) {
                    canvas.tokens[q] = eos;
                    record.committed.push(q);
                    record.tokens.push(eos);
                    if logprobs.is_some() {
                        scores.push(wavefront_engine::TokenLogprob {
                            logprob: 0.0,
                            top: Vec::new(),
                        });
                    }
                }
            }
            break;
        }
    }
    dg.step += 1;
    Ok((record, scores, complete))
}

/// `k` positions drawn without replacement from `softmax(score / temperature)` (upstream's
/// `multinomial` with `alg_temp`).
fn draw_without_replacement(
    scored: &[(usize, f64)],
    k: usize,
    temperature: f32,
    rng: &mut RequestRng,
) -> Vec<usize> {
    let t = f64::from(temperature);
    let max = scored.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
    let mut pool: Vec<(usize, f64)> = scored
        .iter()
        .map(|&(p, c)| (p, ((c - max) / t).exp()))
        .collect();
    let mut out = Vec::with_capacity(k);
    while out.len() < k && !pool.is_empty() {
        let total: f64 = pool.iter().map(|x| x.1).sum();
        let mut u = rng.random::<f64>() * total;
        let mut at = pool.len() - 1;
        for (j, x) in pool.iter().enumerate() {
            if u < x.1 {
                at = j;
                break;
            }
            u -= x.1;
        }
        out.push(pool.swap_remove(at).0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn the_schedule_commits_just_under_the_even_share() {
        // The README's examples: 16 over 8 steps, 32 over 32, 24 over 10.
        for (n, steps, want) in [
            (16, 8, vec![1, 2, 2, 2, 2, 2, 2, 3]),
            (32, 32, [vec![0], vec![1; 30], vec![2]].concat()),
            (24, 10, vec![2, 2, 2, 2, 2, 2, 2, 3, 3, 4]),
        ] {
            let dg = DiffusionGenerate::new(DreamAlg::Entropy, steps, 1e-3, 0.0, None, None, None);
            let mut left = n;
            let got: Vec<usize> = (0..steps)
                .map(|i| {
                    let k = dg.commits(i, left);
                    left -= k;
                    k
                })
                .collect();
            assert_eq!(got, want, "{n} over {steps}");
        }
    }

    #[test]
    fn filters_keep_what_upstream_keeps() {
        let row = [2.0f32, 1.0, 0.5, 3.0, -1.0];
        let full = posterior(&row, 0.0, None, None);
        assert!((full.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // top-k 2: tokens 3 and 0 renormalised.
        let k2 = posterior(&row, 0.0, Some(2), None);
        assert_eq!(k2.iter().filter(|&&p| p > 0.0).count(), 2);
        assert!((k2[3] + k2[0] - 1.0).abs() < 1e-6);
        // top-p just above the top token's mass keeps exactly two tokens; a tiny top-p keeps one.
        let p2 = posterior(&row, 0.0, None, Some(full[3] + 1e-3));
        assert_eq!(p2.iter().filter(|&&p| p > 0.0).count(), 2);
        let p1 = posterior(&row, 0.0, None, Some(1e-3));
        assert_eq!(p1[3], 1.0);
        // The mask is never the prediction; margins and entropies have upstream's signs.
        let mut rng = RequestRng::seed_from_u64(1);
        assert_eq!(pick(&full, 0.0, 3, &mut rng), 0);
        assert!(confidence(DreamAlg::TopkMargin, &full, 3) > 0.0);
        assert!(confidence(DreamAlg::Entropy, &full, 3) < 0.0);
        assert_eq!(confidence(DreamAlg::Entropy, &p1, 3), 0.0);
    }

    #[test]
    fn alg_temp_draws_distinct_positions() {
        let scored = [(4, 0.1), (9, 0.9), (12, 0.5)];
        let mut rng = RequestRng::seed_from_u64(5);
        let mut got = draw_without_replacement(&scored, 3, 0.5, &mut rng);
        got.sort_unstable();
        assert_eq!(got, vec![4, 9, 12]);
    }
}
