//! Fused per-row softmax statistics over the vocabulary.
//!
//! For every row of logits `[rows, vocab]`: the log-sum-exp, the top-1 probability and its id
//! (the lowest id on ties, as `argmax` does), and, when the previous step's log-probabilities
//! of the same rows are given, `KL(p_t || p_(t-1)) = Σ p_t (log p_t − log p_(t-1))` (SureLock's
//! lock test). Optionally the rows' log-probabilities are written out, to be the next step's
//! `prev` without leaving the device. Everything is float32.

use crate::{check, KernelError};

/// What one row reduces to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowStats {
    pub lse: f32,
    pub top_prob: f32,
    pub top_id: u32,
    /// `NaN` when no previous distribution was given.
    pub kl: f32,
}

/// The CPU reference. `prev`, when given, holds log-probabilities `[rows, vocab]`; with
/// `log_probs_out` the rows' log-probabilities are written there.
pub fn softmax_stats(
    logits: &[f32],
    vocab: usize,
    prev: Option<&[f32]>,
    mut log_probs_out: Option<&mut [f32]>,
) -> Result<Vec<RowStats>, KernelError> {
    check(vocab > 0 && logits.len().is_multiple_of(vocab), || {
        format!("{} logits are not rows of {vocab}", logits.len())
    })?;
    if let Some(p) = prev {
        check(p.len() == logits.len(), || "prev has another shape".into())?;
    }
    if let Some(o) = &log_probs_out {
        check(o.len() == logits.len(), || {
            "log_probs_out has another shape".into()
        })?;
    }
    let mut out = Vec::with_capacity(logits.len() / vocab);
    for (r, row) in logits.chunks_exact(vocab).enumerate() {
        let (mut top_id, mut max) = (0u32, f32::NEG_INFINITY);
        for (i, &x) in row.iter().enumerate() {
            if x > max {
                (max, top_id) = (x, i as u32);
            }
        }
        let sum: f32 = row.iter().map(|&x| (x - max).exp()).sum();
        let lse = max + sum.ln();
        let kl = match prev {
            None => f32::NAN,
            Some(p) => row
                .iter()
                .zip(&p[r * vocab..][..vocab])
                .map(|(&x, &q)| {
                    let lp = x - lse;
                    let p = lp.exp();
                    if p > 0.0 {
                        p * (lp - q)
                    } else {
                        0.0
                    }
                })
                .sum(),
        };
        if let Some(o) = log_probs_out.as_deref_mut() {
            for (o, &x) in o[r * vocab..][..vocab].iter_mut().zip(row) {
                *o = x - lse;
            }
        }
        out.push(RowStats {
            lse,
            top_prob: (max - lse).exp(),
            top_id,
            kl,
        });
    }
    Ok(out)
}
