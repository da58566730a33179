//! Prompt scoring for masked diffusion: LLaDA's Monte Carlo likelihood bound (Nie et al., 2025,
//! "Large Language Diffusion Models", Eq. 6 and its Algorithm 3, as the authors'
//! `get_log_likelihood.py` estimates it).
//!
//! For a condition `c` and an answer `a` of `L` tokens, every sample masks `l` of the answer's
//! tokens and each masked token `i` adds `(L / l) · log p(a_i | the masked sequence)`; the
//! estimate is the mean over the samples. `l` is stratified as upstream does within each group
//! of [`GROUP`] samples: one uniform `k` in `1..=L`, then for the group's `B` samples
//! `l_j = 1 + (round(k + j·L/B) − 1) mod L` (halves rounded to even, as `torch.round`); which
//! `l` tokens a sample masks is a uniform draw. A
//! token's entry is its terms averaged over the samples, so the answer's entries sum to the
//! estimate (a token no sample masked contributes 0). Its alternatives are the most likely
//! tokens at its position in the first sample that masked it, with their plain
//! log-probabilities.
//!
//! Without a condition length every token after the first is scored as a one-token answer to
//! the tokens before it: for `L = 1` the bound is exact (the token masked last, one forward),
//! so each entry is `log p(x_i | x_<i, [MASK])` and one forward per token replaces the samples.
//!
//! Random draws come from the request's seed (its own stream), so a seeded score is
//! reproducible; classifier-free guidance does not apply to scoring.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use wavefront_engine::TokenLogprob;

use crate::migrate::RequestRng;
use crate::sampling::{score, Filter};

/// Samples that share one stratified draw of the mask counts (upstream's `batch_size`).
pub(crate) const GROUP: usize = 16;

/// One request's prompt scoring.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Likelihood {
    prompt: Vec<u32>,
    mask_id: u32,
    /// Condition length; `None`: every token a one-token answer.
    context: Option<usize>,
    samples: usize,
    top: usize,
    seed: u64,
    /// Forwards committed so far.
    step: usize,
    /// Each position's summed terms, and its alternatives once a forward masked it.
    sums: Vec<f64>,
    tops: Vec<Option<Vec<(u32, f32)>>>,
}

impl Likelihood {
    pub(crate) fn new(
        prompt: Vec<u32>,
        mask_id: u32,
        context: Option<usize>,
        samples: usize,
        top: usize,
        seed: u64,
    ) -> Self {
        let n = prompt.len();
        Self {
            prompt,
            mask_id,
            context,
            samples,
            top,
            seed: seed ^ 0x4c49_4b45_4c49_4844,
            step: 0,
            sums: vec![0.0; n],
            tops: vec![None; n],
        }
    }

    /// Forwards in all.
    fn steps(&self) -> usize {
        match self.context {
            None => self.prompt.len().saturating_sub(1),
            Some(_) => self.samples,
        }
    }

    pub(crate) fn done(&self) -> bool {
        self.step >= self.steps()
    }

    /// Rows of the next forward.
    pub(crate) fn rows(&self) -> usize {
        match self.context {
            None => self.step + 2,
            Some(_) => self.prompt.len(),
        }
    }

    /// The next forward's length, masked positions and each masked token's weight `L / l`.
    fn masked(&self) -> (usize, Vec<usize>, f64) {
        let Some(c) = self.context else {
            let i = self.step + 1;
            return (i + 1, vec![i], 1.0);
        };
        let len = self.prompt.len() - c;
        let group = self.step / GROUP;
        let b = GROUP.min(self.samples - group * GROUP);
        let mut rng = RequestRng::seed_from_u64(self.seed ^ (group as u64).wrapping_mul(0x9e37));
        let k = rng.random_range(1..=len) as f64;
        let j = (self.step % GROUP) as f64;
        // torch.round: halves to even.
        let x = (k + j * (len as f64 / b as f64)).round_ties_even() as usize;
        let l = (x - 1) % len + 1;
        let mut order: Vec<usize> = (c..self.prompt.len()).collect();
        let mut rng = RequestRng::seed_from_u64(
            self.seed ^ 0x5a5a ^ (self.step as u64).wrapping_mul(0x1000_0000_01b3),
        );
        order.shuffle(&mut rng);
        let mut masked = order[..l].to_vec();
        masked.sort_unstable();
        (self.prompt.len(), masked, len as f64 / l as f64)
    }

    /// The next forward: the (prefix of the) prompt with its masked tokens, read bidirectionally
    /// at the masked positions (their logits' rows come in this order).
    pub(crate) fn next(&self) -> (Vec<u32>, Vec<usize>) {
        let (n, masked, _) = self.masked();
        let mut ids = self.prompt[..n].to_vec();
        for &p in &masked {
            ids[p] = self.mask_id;
        }
        (ids, masked)
    }

    /// Adds a forward's terms: `rows[r]` the logits of the plan's `r`-th masked position.
    pub(crate) fn commit(&mut self, rows: &[Vec<f32>]) {
        let (_, masked, weight) = self.masked();
        for (&p, row) in masked.iter().zip(rows) {
            let mut s = score(row, self.prompt[p], Filter::model(), self.top + 1);
            self.sums[p] += weight * f64::from(s.logprob);
            if self.tops[p].is_none() {
                // The mask token is never a prediction.
                s.top.retain(|&(id, _)| id != self.mask_id);
                s.top.truncate(self.top);
                self.tops[p] = Some(s.top);
            }
        }
        self.step += 1;
    }

    /// One entry per prompt token: the scored ones' mean terms, the condition's (and the first
    /// token's) none.
    pub(crate) fn entries(&self) -> Vec<TokenLogprob> {
        let first = self.context.unwrap_or(1);
        let n = match self.context {
            None => 1.0,
            Some(_) => self.samples as f64,
        };
        (0..self.prompt.len())
            .map(|p| {
                if p < first {
                    return TokenLogprob::unscored();
                }
                TokenLogprob {
                    logprob: (self.sums[p] / n) as f32,
                    top: self.tops[p].clone().unwrap_or_default(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stratified mask counts of a group cover 1..=L evenly (upstream's linspace), every
    /// sample masks exactly its count inside the answer, and the draws depend on the seed
    /// alone.
    #[test]
    fn samples_stratify_the_mask_count_over_the_answer() {
        let prompt: Vec<u32> = (10..30).collect();
        let mut lk = Likelihood::new(prompt, 99, Some(4), 32, 1, 5);
        let mut counts = Vec::new();
        for _ in 0..32 {
            let (n, masked, w) = lk.masked();
            assert_eq!(n, 20);
            assert!(masked.iter().all(|&p| (4..20).contains(&p)));
            assert!((w - 16.0 / masked.len() as f64).abs() < 1e-12);
            counts.push(masked.len());
            lk.step += 1;
        }
        // A group of 16 over an answer of 16: every count once.
        let mut first: Vec<usize> = counts[..16].to_vec();
        first.sort_unstable();
        assert_eq!(first, (1..=16).collect::<Vec<_>>());
        let at = |seed: u64, step: usize| {
            let mut l = Likelihood::new((10..30).collect(), 99, Some(4), 32, 1, seed);
            l.step = step;
            l.masked()
        };
        assert_eq!(at(5, 3), at(5, 3));
        assert!((0..8).any(|s| at(5, s) != at(6, s)));
    }

    /// Without a condition, token i is masked last after the tokens before it, one forward
    /// each, weight 1.
    #[test]
    fn one_token_answers_mask_each_token_after_its_prefix() {
        let mut lk = Likelihood::new(vec![5, 6, 7, 8], 99, None, 64, 2, 0);
        assert_eq!(lk.steps(), 3);
        assert_eq!(lk.next(), (vec![5, 99], vec![1]));
        lk.commit(&[vec![0.0; 100]]);
        assert_eq!(lk.next(), (vec![5, 6, 99], vec![2]));
        let row: Vec<f32> = (0..100).map(|i| if i == 7 { 2.0 } else { 0.0 }).collect();
        lk.commit(std::slice::from_ref(&row));
        lk.commit(&[row]);
        assert!(lk.done());
        let e = lk.entries();
        assert!(e[0].logprob.is_nan());
        // Uniform over 100 tokens.
        assert!((f64::from(e[1].logprob) + 100f64.ln()).abs() < 1e-5);
        assert_eq!(e[2].top[0].0, 7);
        assert_eq!(e[2].top.len(), 2);
    }
}
