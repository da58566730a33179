//! One model call of a slot-diffusion program, as the family packs it, and what it reads back.
//!
//! A call has one or more *rows* (upstream's batch rows): each row is its own attention
//! sequence appended after a cache, causal in buffer order. A program names, per row, the
//! positions whose logits it reads and, for each, optionally the token whose probability it
//! needs (autoregressive verification reads the probability of the *next* input token from the
//! logits of the row before it). The family computes, on the device, the argmax, the softmax
//! maximum and that probability for every read row of every program of the tick, and copies
//! only those three numbers per row to the host ([`reduce`]); full logits come back only for
//! rows that sample with a temperature.

use candle_core::{DType, Tensor, D};

/// Which cache a row extends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheUse {
    /// Row `i` of parallel iterative completion: segment `i` after the committed cache (in its
    /// pages), over the committed rows and itself only.
    Segment(usize),
    /// The program's own cache, which the row extends (autoregressive decoding).
    Own,
}

/// A logit row a program reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowRead {
    /// Index of the position within its row's input.
    pub(crate) at: usize,
    /// Token whose softmax probability is read (`None`: only argmax and maximum).
    pub(crate) target: Option<u32>,
    /// Also return the whole row of logits (sampling with a temperature).
    pub(crate) full: bool,
}

impl RowRead {
    pub(crate) fn top1(at: usize) -> Self {
        Self {
            at,
            target: None,
            full: false,
        }
    }

    pub(crate) fn prob_of(at: usize, target: u32) -> Self {
        Self {
            at,
            target: Some(target),
            full: false,
        }
    }
}

/// One row of a call.
#[derive(Debug, Clone)]
pub struct CallRow {
    pub(crate) ids: Vec<u32>,
    pub(crate) positions: Vec<u32>,
    pub(crate) cache: CacheUse,
    pub(crate) reads: Vec<RowRead>,
}

/// A program's next model call.
#[derive(Debug, Clone)]
pub struct Call {
    pub(crate) rows: Vec<CallRow>,
}

impl Call {
    pub(crate) fn tokens(&self) -> usize {
        self.rows.iter().map(|r| r.ids.len()).sum()
    }

    pub(crate) fn reads(&self) -> usize {
        self.rows.iter().map(|r| r.reads.len()).sum()
    }
}

/// What a read row gave.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadOut {
    pub(crate) argmax: u32,
    /// Softmax probability of the argmax.
    pub(crate) max_prob: f32,
    /// Softmax probability of the read's target (of the argmax without one).
    pub(crate) target_prob: f32,
    /// Float32 logits when the read asked for them.
    pub(crate) logits: Option<Vec<f32>>,
}

/// Per row of `logits` `[M, V]` (float32): argmax (first maximum, as torch), softmax maximum and
/// the softmax probability of `targets[r]`, computed on the logits' device; one host copy.
pub(crate) fn reduce(logits: &Tensor, targets: &[u32]) -> candle_core::Result<Vec<[f32; 3]>> {
    let logits = logits.to_dtype(DType::F32)?;
    let max = logits.max_keepdim(D::Minus1)?;
    let argmax = logits.argmax_keepdim(D::Minus1)?.to_dtype(DType::F32)?;
    let sum = logits.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?;
    let idx = Tensor::new(targets, logits.device())?.unsqueeze(1)?;
    let target = (logits.gather(&idx, 1)? - &max)?.exp()?;
    let target = (target / &sum)?;
    let max_prob = sum.recip()?;
    let out = Tensor::cat(&[argmax, max_prob, target], 1)?;
    Ok(out
        .to_vec2::<f32>()?
        .into_iter()
        .map(|r| [r[0], r[1], r[2]])
        .collect())
}

/// The prompt-sharing key of a ReFusion prompt: its rows are written first, causal in position
/// order, by both schemes, so they depend on its ids alone.
pub(crate) fn prompt_key(prompt: &[u32]) -> u64 {
    crate::packing::key_of(&("refusion-prompt", prompt))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_matches_a_host_softmax() -> candle_core::Result<()> {
        let rows = vec![vec![0.5f32, 2.0, -1.0, 2.0], vec![3.0, 0.0, 1.0, -2.0]];
        let t = Tensor::new(rows.clone(), &candle_core::Device::Cpu)?;
        let got = reduce(&t, &[2, 0])?;
        for (r, (row, &target)) in rows.iter().zip(&[2usize, 0]).enumerate() {
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = row.iter().map(|x| (x - m).exp()).sum();
            let argmax = row.iter().position(|&x| x == m).unwrap_or(0);
            assert_eq!(got[r][0] as usize, argmax, "first maximum");
            assert!((got[r][1] - 1.0 / z).abs() < 1e-6);
            assert!((got[r][2] - (row[target] - m).exp() / z).abs() < 1e-6);
        }
        Ok(())
    }
}
