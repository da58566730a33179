//! Token selection from one position's logits.
//!
//! Greedy is `argmax` (the first maximum, as torch's `argmax` on CPU).
//! Otherwise: divide by the temperature, keep the `top_k` largest logits, keep
//! the smallest prefix of the sorted distribution whose mass reaches `top_p`,
//! renormalise, and draw with the request's own RNG. Each request owns its
//! RNG seeded from its seed, so a request's draws do not depend on what else
//! shares its batch.

use crate::migrate::RequestRng;
use rand::{Rng, SeedableRng};

use crate::request::SamplingParams;
use wavefront_engine::TokenLogprob;

/// Index of the first maximum.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

/// A request's token sampler.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TokenSampler {
    params: SamplingParams,
    #[serde(with = "crate::migrate::rng")]
    rng: RequestRng,
}

impl TokenSampler {
    pub fn new(params: SamplingParams) -> Self {
        // A distinct stream from the request's other random draws.
        let rng = RequestRng::seed_from_u64(params.seed ^ 0x5a4d_504c_4552_0001);
        Self { params, rng }
    }

    pub fn is_greedy(&self) -> bool {
        self.params.is_greedy()
    }

    /// The alternatives per token the request asked for with its log-probabilities (`None`:
    /// it asked for none).
    pub fn logprobs(&self) -> Option<usize> {
        self.params.logprobs
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether a step needs the chosen row's logits on the host: to draw, or to score.
    pub fn wants_logits(&self) -> bool {
        !self.is_greedy() || self.params.logprobs.is_some()
    }

    /// `token`'s log-probability from `logits` when the request asked for them.
    pub fn maybe_score(&self, logits: &[f32], token: u32) -> Option<TokenLogprob> {
        self.params.logprobs.map(|n| self.score(logits, token, n))
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() || logits.is_empty() {
            return argmax(logits);
        }
        self.draw(logits).0
    }

    /// A draw (at the temperature, or at 1 for a greedy request: LLaDA2.0's sampler draws even
    /// then) and its probability under the filtered, renormalised distribution it was drawn
    /// from (block diffusion's confidence).
    pub fn sample_with_prob(&mut self, logits: &[f32]) -> (u32, f32) {
        self.draw(logits)
    }

    fn draw(&mut self, logits: &[f32]) -> (u32, f32) {
        let p = &self.params;
        let (cand, probs) = support(logits, draw_temperature(p.temperature), p.top_k, p.top_p);
        let u: f32 = self.rng.random();
        let mut acc = 0.0;
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if u < acc {
                return (cand[i].0, *p);
            }
        }
        let last = probs.len() - 1;
        (cand[last].0, probs[last])
    }

    /// The log-probability of `token`, drawn or chosen by this sampler from `logits`, with
    /// `top` alternatives ([`score`] under this request's parameters).
    pub fn score(&self, logits: &[f32], token: u32, top: usize) -> TokenLogprob {
        let p = &self.params;
        score(
            logits,
            token,
            Filter::new(p.temperature, p.top_k, p.top_p),
            top,
        )
    }
}

/// The next token from a logits `row` under a request's sampler and, when it has one, its
/// structured-output guide: the row masked to what the grammar allows, then the draw (or
/// argmax) and its log-probability under that masked distribution. Returns the token, its entry
/// when the request asked for log-probabilities, and whether the guided output is complete.
pub(crate) fn guided_pick(
    sampler: &mut TokenSampler,
    guide: Option<&mut crate::constraint::Guide>,
    row: &[f32],
) -> Result<(u32, Option<TokenLogprob>, bool), crate::SchemeError> {
    let Some(guide) = guide else {
        let t = sampler.sample(row);
        return Ok((t, sampler.maybe_score(row, t), false));
    };
    let mut masked = row.to_vec();
    guide
        .mask(&mut masked)
        .map_err(crate::SchemeError::inconsistent)?;
    let t = sampler.sample(&masked);
    let scored = sampler.maybe_score(&masked, t);
    let done = guide.advance(t).map_err(crate::SchemeError::inconsistent)?;
    Ok((t, scored, done))
}

/// A draw from `filter`'s distribution over `logits` with uniform `u` in [0, 1): the token and
/// its probability (the argmax and its model probability when `filter` is a greedy choice's).
pub(crate) fn draw_with(logits: &[f32], filter: Filter, greedy: bool, u: f32) -> (u32, f32) {
    if greedy {
        let t = argmax(logits);
        return (t, score(logits, t, Filter::model(), 0).logprob.exp());
    }
    let (cand, probs) = support(logits, filter.temperature, filter.top_k, filter.top_p);
    let mut acc = 0.0;
    for (i, p) in probs.iter().enumerate() {
        acc += p;
        if u < acc {
            return (cand[i].0, *p);
        }
    }
    let last = probs.len() - 1;
    (cand[last].0, probs[last])
}

/// The temperature a draw divides by: a greedy request (0) draws at 1 where a scheme draws
/// for it.
fn draw_temperature(t: f32) -> f32 {
    if t == 0.0 {
        1.0
    } else {
        t
    }
}

/// The candidates sorted by scaled logit (ties by id), and the filtered, renormalised
/// probabilities of the ones kept: a prefix of the candidates (`top_k` largest logits, then
/// the smallest prefix whose mass reaches `top_p`).
fn support(logits: &[f32], t: f32, top_k: usize, top_p: f32) -> (Vec<(u32, f32)>, Vec<f32>) {
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l / t))
        .collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if top_k > 0 && top_k < cand.len() {
        cand.truncate(top_k);
    }
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    if top_p > 0.0 && top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        let s: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= s);
    }
    (cand, probs)
}

/// The distribution a token is committed from, for its log-probability: the logits divided
/// by the temperature, then, when either filter is set, restricted to the `top_k` largest and
/// to the smallest most likely set whose mass reaches `top_p`, renormalised (exactly the set
/// [`TokenSampler`] draws from). A greedy choice (temperature 0, whose distribution is a point
/// mass) reports the model's own distribution: temperature 1, nothing filtered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Filter {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
}

impl Filter {
    /// A request's draw at `temperature` (0: a greedy choice) with its filters.
    pub fn new(temperature: f32, top_k: usize, top_p: f32) -> Self {
        if temperature == 0.0 {
            return Self::model();
        }
        Self {
            temperature,
            top_k,
            top_p,
        }
    }

    /// The model's own distribution (temperature 1, nothing filtered).
    pub fn model() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        }
    }

    fn filters(&self, vocab: usize) -> bool {
        (self.top_k > 0 && self.top_k < vocab) || (self.top_p > 0.0 && self.top_p < 1.0)
    }
}

/// `token`'s natural log-probability under `filter`'s distribution over `logits`, and the
/// `top` most likely tokens of that distribution (ties by id) with theirs. A token outside the
/// filtered support scores negative infinity. Unfiltered, the sums run in float64 over the
/// whole row; filtered, the probabilities are the sampler's own.
pub fn score(logits: &[f32], token: u32, filter: Filter, top: usize) -> TokenLogprob {
    if logits.is_empty() {
        return TokenLogprob {
            logprob: f32::NEG_INFINITY,
            top: Vec::new(),
        };
    }
    if filter.filters(logits.len()) {
        let (cand, probs) = support(logits, filter.temperature, filter.top_k, filter.top_p);
        let kept = &cand[..probs.len()];
        let logprob = kept
            .iter()
            .position(|&(id, _)| id == token)
            .map_or(f32::NEG_INFINITY, |i| probs[i].ln());
        let top = kept
            .iter()
            .zip(&probs)
            .take(top)
            .map(|(&(id, _), &p)| (id, p.ln()))
            .collect();
        return TokenLogprob { logprob, top };
    }
    let t = f64::from(filter.temperature);
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let max = f64::from(max) / t;
    let sum: f64 = logits.iter().map(|&v| (f64::from(v) / t - max).exp()).sum();
    let lse = max + sum.ln();
    let lp = |id: u32| (f64::from(logits[id as usize]) / t - lse) as f32;
    let logprob = if (token as usize) < logits.len() {
        lp(token)
    } else {
        f32::NEG_INFINITY
    };
    TokenLogprob {
        logprob,
        top: top_ids(logits, top)
            .into_iter()
            .map(|id| (id, lp(id)))
            .collect(),
    }
}

/// Rows of a prompt's logits scored at a time: the head's output for this many rows is the
/// most a scoring request holds at once (`SCORE_CHUNK × vocabulary` floats), however long its
/// prompt.
pub const SCORE_CHUNK: usize = 64;

/// The model's log-probability of `targets[r]` under `head(rows r)` for every row of `hidden`
/// `[M, H]`, the head run [`SCORE_CHUNK`] rows at a time (see [`score_rows`]).
pub fn score_hidden(
    hidden: &candle_core::Tensor,
    targets: &[Option<u32>],
    top: usize,
    head: impl Fn(&candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>,
) -> candle_core::Result<Vec<TokenLogprob>> {
    let n = hidden.dim(0)?;
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    while at < n {
        let k = SCORE_CHUNK.min(n - at);
        let logits = head(&hidden.narrow(0, at, k)?)?;
        out.extend(score_rows(&logits, &targets[at..at + k], top)?);
        at += k;
    }
    Ok(out)
}

/// The model's log-probability of `targets[r]` under every row `r` of `logits` `[M, V]`, with
/// `top` alternatives (one host copy of the rows; `None` targets give [`TokenLogprob::unscored`]).
pub fn score_rows(
    logits: &candle_core::Tensor,
    targets: &[Option<u32>],
    top: usize,
) -> candle_core::Result<Vec<TokenLogprob>> {
    let rows: Vec<Vec<f32>> = logits.to_dtype(candle_core::DType::F32)?.to_vec2()?;
    Ok(rows
        .iter()
        .zip(targets)
        .map(|(row, t)| match t {
            Some(t) => score(row, *t, Filter::model(), top),
            None => TokenLogprob::unscored(),
        })
        .collect())
}

/// `token`'s log-probability under a distribution given as probabilities (a scheme's own
/// filtered posterior), with the `top` most likely tokens that have any mass.
pub fn score_probs(probs: &[f32], token: u32, top: usize) -> TokenLogprob {
    let lp = |id: u32| probs.get(id as usize).map_or(f32::NEG_INFINITY, |p| p.ln());
    TokenLogprob {
        logprob: lp(token),
        top: top_ids(probs, top)
            .into_iter()
            .filter(|&id| probs[id as usize] > 0.0)
            .map(|id| (id, lp(id)))
            .collect(),
    }
}

/// The ids of the `n` largest values, largest first, ties by id.
fn top_ids(row: &[f32], n: usize) -> Vec<u32> {
    let mut best: Vec<u32> = Vec::with_capacity(n + 1);
    if n == 0 {
        return best;
    }
    let before = |a: u32, b: u32| row[a as usize] > row[b as usize];
    for id in 0..row.len() as u32 {
        if best.len() == n && !before(id, best[n - 1]) {
            continue;
        }
        let at = best.partition_point(|&b| !before(id, b));
        best.insert(at, id);
        best.truncate(n);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = TokenSampler::new(params(0.0, 0, 1.0, 1));
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = TokenSampler::new(params(1.0, 1, 1.0, 7));
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.1, 2.0, 1.9, -1.0]), 1);
        }
        // Drawn at temperature 1 even for a greedy request, with the probability it had.
        let mut s = TokenSampler::new(params(0.0, 1, 1.0, 7));
        assert_eq!(s.sample_with_prob(&[0.1, 2.0, 1.9, -1.0]), (1, 1.0));
        let mut s = TokenSampler::new(params(0.0, 2, 1.0, 7));
        let (t, p) = s.sample_with_prob(&[0.0, 2.0, 2.0, -1.0]);
        assert!((t == 1 || t == 2) && (p - 0.5).abs() < 1e-6);
    }

    #[test]
    fn same_seed_same_draws_and_top_p_restricts_support() {
        let logits = [1.0, 1.0, 1.0, -10.0];
        let a: Vec<u32> = {
            let mut s = TokenSampler::new(params(1.0, 0, 0.5, 42));
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = TokenSampler::new(params(1.0, 0, 0.5, 42));
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        // top_p 0.5 over three equal tokens keeps the first two in sorted order.
        assert!(a.iter().all(|&t| t == 0 || t == 1));
        assert!(a.contains(&0) && a.contains(&1));
    }

    fn log_softmax(row: &[f64]) -> Vec<f64> {
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        row.iter().map(|v| v - lse).collect()
    }

    #[test]
    fn a_greedy_token_scores_under_the_model_distribution() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 1.5];
        let want = log_softmax(&logits.map(f64::from));
        let s = score(&logits, 1, Filter::new(0.0, 0, 1.0), 3);
        assert!((f64::from(s.logprob) - want[1]).abs() < 1e-6);
        // Ties by id: 1 before 3, then 4.
        let ids: Vec<u32> = s.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 4]);
        for (id, lp) in &s.top {
            assert!((f64::from(*lp) - want[*id as usize]).abs() < 1e-6);
        }
        assert!(score(&logits, 0, Filter::model(), 0).top.is_empty());
    }

    #[test]
    fn a_sampled_token_scores_under_the_filtered_distribution_it_was_drawn_from() {
        let logits = [1.0f32, 3.0, 2.0, 0.0, -2.0];
        // Temperature 2: log_softmax(logits / 2).
        let scaled = logits.map(|v| f64::from(v) / 2.0);
        let want = log_softmax(&scaled);
        let s = score(&logits, 2, Filter::new(2.0, 0, 1.0), 0);
        assert!((f64::from(s.logprob) - want[2]).abs() < 1e-6);
        // top_k 2 keeps ids 1 and 2, renormalised; the rest cannot be drawn.
        let kept = log_softmax(&[scaled[1], scaled[2]]);
        let s = score(&logits, 2, Filter::new(2.0, 2, 1.0), 5);
        assert!((f64::from(s.logprob) - kept[1]).abs() < 1e-5);
        assert_eq!(s.top.len(), 2, "only tokens the distribution can produce");
        assert!((f64::from(s.top[0].1) - kept[0]).abs() < 1e-5);
        assert_eq!(
            score(&logits, 0, Filter::new(2.0, 2, 1.0), 0).logprob,
            f32::NEG_INFINITY
        );
        // A greedy choice scores under the model's distribution, filters or not.
        let s = score(&logits, 1, Filter::new(0.0, 2, 0.5), 0);
        assert!((f64::from(s.logprob) - log_softmax(&logits.map(f64::from))[1]).abs() < 1e-6);
        // Every token a sampler draws scores finite, and the draw's probability is the score's.
        let mut sampler = TokenSampler::new(SamplingParams {
            logprobs: Some(2),
            ..params(0.7, 3, 0.9, 11)
        });
        for _ in 0..50 {
            let (t, p) = sampler.sample_with_prob(&logits);
            let s = sampler.score(&logits, t, 2);
            assert!(
                (s.logprob - p.ln()).abs() < 1e-6,
                "{t}: {} vs {}",
                s.logprob,
                p.ln()
            );
        }
    }
}
