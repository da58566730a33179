//! One masked-diffusion step as the samplers see it: the logits of the rows a plan read
//! ([`StepInputs`]), and what the step decided ([`StepRecord`], kept when recording).

use std::collections::HashMap;

use candle_core::Tensor;

/// What one step decided; kept when recording is on (tests compare it with upstream traces).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepRecord {
    /// Positions unmasked (low-confidence) or drafted (WINO), in decision order.
    pub committed: Vec<usize>,
    /// Their tokens.
    pub tokens: Vec<u32>,
    /// Their confidences (low-confidence: the probability that ranked them).
    pub scores: Vec<f64>,
    /// Positions revoked (WINO).
    pub revoked: Vec<usize>,
    /// Positions locked (SureLock).
    pub locked: Vec<usize>,
    /// WINO's draft rule: "threshold", "topk_max_accept" or "argmax_fallback".
    pub branch: Option<&'static str>,
    /// WINO: whether the revocation cap applied.
    pub remask_capped: bool,
    /// WINO: the step's draft cap and `last_accept`.
    pub max_accept: usize,
    pub last_accept: usize,
    /// `diffusion-generate` (confidence algorithms): every candidate's confidence, in position
    /// order.
    pub confidence: Vec<(usize, f32)>,
    /// Buffer indices whose rows the step's forward computed (the others' keys came from the
    /// row cache).
    pub rows: Vec<u32>,
    /// The logits the step read, by buffer index (float32, guidance applied).
    pub logits: Vec<(usize, Vec<f32>)>,
}

/// What a decoder's step reads.
pub(crate) struct StepInputs<'a> {
    /// Logits of the plan's logit rows.
    pub(crate) logits: &'a Tensor,
    /// Logit row of each buffer index.
    pub(crate) row_of: &'a HashMap<usize, usize>,
    /// Masked positions before the block's end at the step's input.
    pub(crate) candidates: &'a [usize],
}

impl StepInputs<'_> {
    /// Logit rows of buffer indices (each must have one).
    pub(crate) fn rows(&self, buffer: impl Iterator<Item = usize>) -> Vec<u32> {
        buffer.map(|b| self.row_of[&b] as u32).collect()
    }

    /// The float32 logits of buffer indices (each must have a row), copied to the host.
    pub(crate) fn host_rows(
        &self,
        buffer: impl Iterator<Item = usize>,
    ) -> candle_core::Result<Vec<Vec<f32>>> {
        let rows = self.rows(buffer);
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.logits
            .index_select(&Tensor::new(rows.as_slice(), self.logits.device())?, 0)?
            .to_dtype(candle_core::DType::F32)?
            .to_vec2()
    }
}
