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
        let t = if self.params.is_greedy() {
            1.0
        } else {
            self.params.temperature
        };
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / t))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.params.top_k > 0 && self.params.top_k < cand.len() {
            cand.truncate(self.params.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        let top_p = self.params.top_p;
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
}
