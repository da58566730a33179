//! Per-row posterior statistics the masked-diffusion samplers read (LLaDA, Nie et al., 2025;
//! WINO): `argmax`, the softmax probability of a token, log-posteriors, and temperature draws.
//!
//! Reductions run on the model's device in the precision upstream uses (float32 for LLaDA's
//! confidences, float64 for WINO's) and only the per-row results cross to the host. A
//! temperature draw samples `softmax(logits / temperature)` on the host from the request's own
//! generator: the distribution upstream's float64 Gumbel-max trick
//! (`argmax exp(logits) / (-log U)^temperature`) samples.
//!
//! The mask token is never a prediction. Upstream would commit it where it wins the argmax, and
//! the position would stay masked (WINO would then loop); here the best other token is taken,
//! with its probability under the full softmax. Where the mask does not win, the numbers are
//! upstream's.

use crate::migrate::RequestRng;
use candle_core::{DType, Tensor, D};
use rand::Rng;

/// `argmax` and its softmax probability for every row of `logits` `[M, V]`, computed in
/// `dtype`. The `never` token (the mask) is not a prediction: where it is a row's argmax, the
/// best other token is taken, with its probability under the full softmax (elsewhere this is
/// exactly upstream's `argmax` and `softmax` max).
pub(crate) fn greedy(
    logits: &Tensor,
    dtype: DType,
    never: u32,
) -> candle_core::Result<(Vec<u32>, Vec<f64>)> {
    let (mut argmax, mut conf): (Vec<u32>, Vec<f64>) = match cpu_stats(logits, dtype)? {
        // Float32 on the CPU: the reductions of one threaded pass over each row.
        Some(stats) => stats
            .iter()
            .map(|&(_, at, sum)| (at as u32, f64::from(1.0 / sum)))
            .unzip(),
        None => {
            let l = logits.to_dtype(dtype)?;
            let max = l.max_keepdim(D::Minus1)?;
            let sum = l.broadcast_sub(&max)?.exp()?.sum(D::Minus1)?;
            (
                l.argmax(D::Minus1)?.to_vec1()?,
                sum.recip()?.to_dtype(DType::F64)?.to_vec1()?,
            )
        }
    };
    let bad: Vec<usize> = (0..argmax.len()).filter(|&r| argmax[r] == never).collect();
    if !bad.is_empty() {
        let rows: Vec<u32> = bad.iter().map(|&r| r as u32).collect();
        let sub = logits.index_select(&Tensor::new(rows.as_slice(), logits.device())?, 0)?;
        let host: Vec<Vec<f32>> = sub.to_dtype(DType::F32)?.to_vec2()?;
        let best: Vec<u32> = host
            .iter()
            .map(|row| {
                let mut b = if never == 0 { 1 } else { 0 };
                for (i, &v) in row.iter().enumerate() {
                    if i as u32 != never && v > row[b] {
                        b = i;
                    }
                }
                b as u32
            })
            .collect();
        let p = token_probs(&sub, &best, dtype)?;
        for ((&r, t), p) in bad.iter().zip(best).zip(p) {
            argmax[r] = t;
            conf[r] = p;
        }
    }
    Ok((argmax, conf))
}

/// `softmax(row)[tokens[row]]` of every row of `logits` `[M, V]`, computed in `dtype`.
pub(crate) fn token_probs(
    logits: &Tensor,
    tokens: &[u32],
    dtype: DType,
) -> candle_core::Result<Vec<f64>> {
    let l = logits.to_dtype(dtype)?;
    let max = l.max_keepdim(D::Minus1)?;
    let shifted = l.broadcast_sub(&max)?;
    let sum = shifted.exp()?.sum(D::Minus1)?;
    let idx = Tensor::new(tokens, l.device())?.unsqueeze(1)?;
    let picked = shifted.gather(&idx, 1)?.squeeze(1)?.exp()?;
    (picked / sum)?.to_dtype(DType::F64)?.to_vec1()
}

/// Float32 log-softmax of every row.
pub(crate) fn log_probs(logits: &Tensor) -> candle_core::Result<Tensor> {
    let l = logits.to_dtype(DType::F32)?;
    if let Some(stats) = cpu_stats(&l, DType::F32)? {
        // `x - max - ln(Σ exp(x - max))`, the statistics from one threaded pass.
        let column = |f: fn(&(f32, usize, f32)) -> f32| {
            let v: Vec<f32> = stats.iter().map(f).collect();
            Tensor::from_vec(v, (stats.len(), 1), l.device())
        };
        let (max, ln_sum) = (column(|s| s.0)?, column(|s| s.2.ln())?);
        return l.broadcast_sub(&max)?.broadcast_sub(&ln_sum);
    }
    wavefront_models::candle_nn::ops::log_softmax(&l, D::Minus1)
}

/// The CPU kernel's row statistics of float32 `logits` on the CPU when reductions run in
/// float32; `None` otherwise (candle's ops).
fn cpu_stats(logits: &Tensor, dtype: DType) -> candle_core::Result<Option<Vec<(f32, usize, f32)>>> {
    if dtype != DType::F32 || logits.dtype() != DType::F32 {
        return Ok(None);
    }
    wavefront_models::transformer::cpu::row_stats(logits)
        .map_err(|e| candle_core::Error::Msg(e.to_string()))
}

/// How a masked position's token is drawn: the argmax at temperature 0; otherwise from
/// `softmax(logits / temperature)` restricted to the `top_k` largest logits (0: all) and to
/// the smallest set of most likely tokens whose mass reaches `top_p` (outside (0, 1): all),
/// renormalised. Upstream LLaDA and WINO have no filter; with none set the draw is theirs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Draw {
    pub(crate) temperature: f32,
    pub(crate) top_k: usize,
    pub(crate) top_p: f32,
}

impl Draw {
    /// Sets the logits of `row` that the filters leave out to minus infinity.
    fn filter(&self, row: &mut [f32]) {
        let nucleus = self.top_p > 0.0 && self.top_p < 1.0;
        if self.top_k == 0 && !nucleus {
            return;
        }
        let mut order: Vec<usize> = (0..row.len()).filter(|&i| row[i].is_finite()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let mut keep = order.len();
        if self.top_k > 0 {
            keep = keep.min(self.top_k);
        }
        if nucleus && keep > 0 {
            let t = f64::from(self.temperature);
            let max = f64::from(row[order[0]]);
            let weights: Vec<f64> = order[..keep]
                .iter()
                .map(|&i| ((f64::from(row[i]) - max) / t).exp())
                .collect();
            let total: f64 = weights.iter().sum();
            let mut acc = 0.0;
            for (n, w) in weights.iter().enumerate() {
                acc += w / total;
                if acc >= f64::from(self.top_p) {
                    keep = n + 1;
                    break;
                }
            }
        }
        for &i in &order[keep..] {
            row[i] = f32::NEG_INFINITY;
        }
    }
}

/// `x0` and `softmax(logits)[x0]` of the given rows of `logits`: the argmax (temperature 0,
/// reductions in `dtype`) or a draw (on the host, rows in the given order; the confidence
/// stays the unfiltered softmax probability, as upstream reads it). The mask token `never`
/// is never drawn.
pub(crate) fn decode_rows(
    logits: &Tensor,
    rows: &[u32],
    draw: Draw,
    rng: &mut RequestRng,
    dtype: DType,
    never: u32,
) -> candle_core::Result<(Vec<u32>, Vec<f64>)> {
    if rows.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let sub = logits.index_select(&Tensor::new(rows, logits.device())?, 0)?;
    if draw.temperature == 0.0 {
        return greedy(&sub, dtype, never);
    }
    let host: Vec<Vec<f32>> = sub.to_dtype(DType::F32)?.to_vec2()?;
    Ok(host
        .into_iter()
        .map(|row| {
            let mut allowed = row.clone();
            if let Some(v) = allowed.get_mut(never as usize) {
                *v = f32::NEG_INFINITY;
            }
            draw.filter(&mut allowed);
            let x0 = sample(&allowed, draw.temperature, rng);
            (x0, prob(&row, x0))
        })
        .unzip())
}

/// A draw from `softmax(row / temperature)`.
pub(crate) fn sample(row: &[f32], temperature: f32, rng: &mut RequestRng) -> u32 {
    let t = f64::from(temperature);
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = row
        .iter()
        .map(|&l| ((f64::from(l) - f64::from(max)) / t).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    // Rounding left `u` past the last weight: the last token with any mass.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
}

/// `softmax(row)[token]` in float64.
pub(crate) fn prob(row: &[f32], token: u32) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
    f64::from(row[token as usize] - max).exp() / total
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use rand::SeedableRng;

    #[test]
    fn filters_keep_the_top_k_and_the_nucleus_and_nothing_else() {
        let draw = |top_k, top_p| Draw {
            temperature: 1.0,
            top_k,
            top_p,
        };
        let kept = |d: Draw, row: &[f32]| {
            let mut r = row.to_vec();
            d.filter(&mut r);
            (0..r.len())
                .filter(|&i| r[i].is_finite())
                .collect::<Vec<_>>()
        };
        // Probabilities about 0.64, 0.24, 0.09, 0.03 for tokens 2, 0, 3, 1.
        let row = [1.0f32, -1.0, 2.0, 0.0];
        assert_eq!(kept(draw(0, 0.0), &row), [0, 1, 2, 3]);
        assert_eq!(kept(draw(0, 1.0), &row), [0, 1, 2, 3]);
        assert_eq!(kept(draw(2, 0.0), &row), [0, 2]);
        assert_eq!(kept(draw(0, 0.5), &row), [2]);
        assert_eq!(kept(draw(0, 0.8), &row), [0, 2]);
        assert_eq!(kept(draw(0, 0.95), &row), [0, 2, 3]);
        assert_eq!(kept(draw(1, 0.95), &row), [2]);
        // Tokens already left out (the mask) stay out and count for nothing.
        let masked = [1.0f32, f32::NEG_INFINITY, 2.0, 0.0];
        assert_eq!(kept(draw(3, 0.0), &masked), [0, 2, 3]);
        // A higher temperature flattens the distribution the nucleus is taken from.
        let hot = Draw {
            temperature: 4.0,
            top_k: 0,
            top_p: 0.5,
        };
        assert_eq!(kept(hot, &row), [0, 2]);
    }

    #[test]
    fn greedy_and_token_probs_agree_with_a_host_softmax() -> candle_core::Result<()> {
        let rows = vec![vec![0.5f32, 2.0, -1.0], vec![3.0, 1.0, 2.5]];
        let t = Tensor::new(rows.clone(), &Device::Cpu)?;
        let (argmax, conf) = greedy(&t, DType::F32, 99)?;
        assert_eq!(argmax, vec![1, 0]);
        // The excluded token is replaced by the runner-up, with its full-softmax probability.
        let (never, p_never) = greedy(&t, DType::F32, 1)?;
        assert_eq!(never, vec![0, 0]);
        assert!((p_never[0] - prob(&rows[0], 0)).abs() < 1e-6);
        for (r, (&a, &c)) in rows.iter().zip(argmax.iter().zip(&conf)) {
            assert!((c - prob(r, a)).abs() < 1e-6);
        }
        let p = token_probs(&t, &[2, 2], DType::F64)?;
        assert!((p[0] - prob(&rows[0], 2)).abs() < 1e-12);
        assert!((p[1] - prob(&rows[1], 2)).abs() < 1e-12);
        let lp: Vec<Vec<f32>> = log_probs(&t)?.to_vec2()?;
        assert!((f64::from(lp[1][2]).exp() - prob(&rows[1], 2)).abs() < 1e-6);
        Ok(())
    }

    #[test]
    fn sampling_is_seeded_and_follows_the_temperature() {
        let row = [0.0f32, 3.0, 0.0];
        let draw = |seed, t| {
            let mut rng = RequestRng::seed_from_u64(seed);
            (0..200)
                .map(|_| sample(&row, t, &mut rng))
                .collect::<Vec<u32>>()
        };
        assert_eq!(draw(3, 1.0), draw(3, 1.0));
        let cold = draw(3, 0.05).iter().filter(|&&t| t == 1).count();
        let hot = draw(3, 5.0).iter().filter(|&&t| t == 1).count();
        assert_eq!(cold, 200);
        assert!(hot < 150, "{hot}");
    }
}
