//! SureLock, "Stopping Computation for Converged Tokens in Masked Diffusion-LM Decoding"
//! (anonymous, under review; no public code: this follows the paper's Algorithm 1 and Sec. 2).
//!
//! After every step, a position is *locked* when its posterior has stopped moving:
//! `D_t = KL(p_t || p_(t-1)) <= eps` on the raw softmax posteriors (before any temperature), and,
//! with the optional confidence gate `m`, its uncertainty `u_t = 1 - max p_t` is at most the
//! `m`-th percentile (linear interpolation) of `u_t` over the step's candidates. A locked
//! position keeps its token; its rows are no longer computed (no query projection, no FFN, no
//! logits), while its per-layer keys and values stay in the program's row cache so every other position still
//! attends to it ([`wavefront_models::transformer::Keys::Buffer`]). Locking is permanent
//! (the paper's optional unlocking is not implemented).
//!
//! Candidates are the active positions that hold a token both in the step's input and after
//! the step's commits. The paper's Algorithm 1 takes every position unmasked *after* the step,
//! which would also lock a token committed in that very step, whose cached K/V were computed
//! from the mask token: such a token would never be seen by the rest of the canvas. Here a
//! committed token is first computed once as a token and can lock from the next step on. The
//! first step has no `p_(t-1)` (`D = inf`), so nothing locks then. `surelock_eps = 0` locks
//! nothing (a step that commits nothing leaves posteriors bit-identical, `D = 0`, and locking
//! then would change later steps), so it reproduces the run without SureLock.
//!
//! Cost accounting (Sec. 2.4): per step, algorithmic FLOPs of the rows actually computed
//! against those of the dense step over the whole buffer; see
//! [`wavefront_models::LladaConfig::algorithmic_flops`].

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Tensor, D};
use wavefront_models::arena::{ArenaPool, Pooled};

use crate::request::SureLockParams;

/// The `m`-th percentile of `values` with linear interpolation between closest ranks (numpy's
/// and `torch.quantile`'s default).
pub(crate) fn percentile(values: &[f64], m: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (m / 100.0).clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}

/// One lock candidate of a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Candidate {
    pub(crate) position: usize,
    /// `KL(p_t || p_(t-1))`.
    pub(crate) kl: f64,
    /// `1 - max p_t`.
    pub(crate) uncertainty: f64,
}

/// The candidates to lock: `kl <= eps` (with `eps > 0`) and, with the gate, uncertainty at most
/// the `percentile`-th percentile over all candidates.
pub(crate) fn decide(cands: &[Candidate], eps: f64, percentile_m: Option<f64>) -> Vec<usize> {
    if eps <= 0.0 || cands.is_empty() {
        return Vec::new();
    }
    let gate = percentile_m.map(|m| {
        let u: Vec<f64> = cands.iter().map(|c| c.uncertainty).collect();
        percentile(&u, m)
    });
    cands
        .iter()
        .filter(|c| c.kl <= eps && gate.is_none_or(|g| c.uncertainty <= g))
        .map(|c| c.position)
        .collect()
}

/// Previous posteriors per slot arena (a slot holds one position's log-posteriors, `vocab`
/// float32 values).
pub(crate) const POSTERIOR_ARENA: usize = 32;

/// Per-request SureLock state.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct SureLock {
    pub(crate) eps: f64,
    pub(crate) percentile: Option<f64>,
    /// Locked canvas positions.
    pub(crate) locked: Vec<bool>,
    /// The previous step's log-posteriors of the positions that may still lock, by position: in
    /// slots of the family's posterior pool while the request runs (a position's slot is
    /// rewritten each step and goes back when it locks or is cut), in tensors of their own
    /// while it is preempted or moved.
    prev: BTreeMap<usize, Pooled>,
    /// The pool `prev` lives in (the family's, bound at the request's first tick; a private
    /// one for programs run without a family).
    #[serde(skip)]
    pool: Option<ArenaPool>,
    /// `false` (tests): decide and record locks but keep computing every row, so the run stays
    /// identical to one without SureLock.
    pub(crate) apply: bool,
}

impl SureLock {
    /// Uses `pool` for the previous posteriors from now on (those already held stay where
    /// they are until the next step rewrites them).
    pub(crate) fn bind_pool(&mut self, pool: &ArenaPool) {
        if self.pool.is_none() {
            self.pool = Some(pool.clone());
        }
    }

    /// Copies the previous posteriors out of their slots into host memory (preemption),
    /// giving the slots back; the bytes moved.
    pub(crate) fn previous_to_host(&mut self) -> wavefront_models::error::Result<u64> {
        let mut bytes = 0;
        for p in self.prev.values_mut() {
            *p = p.to_device(&candle_core::Device::Cpu)?;
            bytes += p.bytes() as u64;
        }
        Ok(bytes)
    }

    /// Copies the previous posteriors (in host memory after a preemption or a move) into slots
    /// of the bound pool; the bytes moved.
    pub(crate) fn previous_to_pool(&mut self) -> wavefront_models::error::Result<u64> {
        let Some(pool) = self.pool.clone() else {
            return Ok(0);
        };
        let mut bytes = 0;
        for p in self.prev.values_mut() {
            *p = Pooled::new_in(&pool, p.tensor())?;
            bytes += p.bytes() as u64;
        }
        Ok(bytes)
    }

    /// Previous posteriors held (rows).
    #[cfg(test)]
    pub(crate) fn previous_rows(&self) -> usize {
        self.prev.len()
    }

    /// The pool the previous posteriors live in, once a step has run or a family bound one.
    #[cfg(test)]
    pub(crate) fn posterior_pool(&self) -> Option<&ArenaPool> {
        self.pool.as_ref()
    }

    pub(crate) fn new(params: &SureLockParams, canvas_len: usize) -> Self {
        Self {
            eps: f64::from(params.eps),
            percentile: params.percentile.map(f64::from),
            locked: vec![false; canvas_len],
            prev: BTreeMap::new(),
            pool: None,
            apply: true,
        }
    }

    pub(crate) fn is_locked(&self, i: usize) -> bool {
        self.locked.get(i).copied().unwrap_or(false)
    }

    /// Whether position `i`'s row is left out of the forward.
    pub(crate) fn skips(&self, i: usize) -> bool {
        self.apply && self.is_locked(i)
    }

    pub(crate) fn locked_count(&self) -> usize {
        self.locked.iter().filter(|&&l| l).count()
    }

    /// One step's lock decisions. `log_probs` `[R, V]` (float32) are this step's
    /// log-posteriors of the canvas positions `positions` (one per row); `candidates` are the
    /// positions allowed to lock. Returns the newly locked positions. Keeps, for the next step,
    /// the rows of the positions not locked that hold a token after the step (`holds_token`),
    /// in the slots those positions had: a position still masked is masked when the next step
    /// begins, so it cannot lock then, whatever that step commits.
    pub(crate) fn observe(
        &mut self,
        log_probs: &Tensor,
        positions: &[usize],
        candidates: &[usize],
        holds_token: impl Fn(usize) -> bool,
    ) -> wavefront_models::error::Result<Vec<usize>> {
        let row_of: HashMap<usize, usize> =
            positions.iter().enumerate().map(|(r, &p)| (p, r)).collect();
        let pairs: Vec<(usize, u32)> = candidates
            .iter()
            .filter(|p| self.prev.contains_key(p))
            .filter_map(|&p| row_of.get(&p).map(|&r| (p, r as u32)))
            .collect();
        let mut decided = Vec::new();
        if !pairs.is_empty() {
            let device = log_probs.device();
            let now_idx: Vec<u32> = pairs.iter().map(|p| p.1).collect();
            let now = log_probs.index_select(&Tensor::new(now_idx.as_slice(), device)?, 0)?;
            let before: Vec<&Pooled> = pairs.iter().map(|(p, _)| &self.prev[p]).collect();
            let before = Pooled::stack(&before)?.to_device(device)?;
            let kl: Vec<f32> = (now.exp()? * (&now - &before)?)?
                .sum(D::Minus1)?
                .to_vec1()?;
            let max_p: Vec<f32> = now.max(D::Minus1)?.exp()?.to_vec1()?;
            let cands: Vec<Candidate> = pairs
                .iter()
                .zip(kl.iter().zip(&max_p))
                .map(|(&(position, _), (&kl, &mp))| Candidate {
                    position,
                    kl: f64::from(kl),
                    uncertainty: 1.0 - f64::from(mp),
                })
                .collect();
            decided = decide(&cands, self.eps, self.percentile);
        }
        for &p in &decided {
            self.locked[p] = true;
        }
        // A locked position never compares again, nor does one still masked.
        let pool = match &self.pool {
            Some(pool) => pool.clone(),
            None => {
                let pool = ArenaPool::new(
                    &[log_probs.dim(D::Minus1)?],
                    DType::F32,
                    log_probs.device(),
                    POSTERIOR_ARENA,
                );
                self.pool = Some(pool.clone());
                pool
            }
        };
        let mut before = std::mem::take(&mut self.prev);
        let mut kept = Vec::new();
        for (r, &p) in positions.iter().enumerate() {
            if self.is_locked(p) || !holds_token(p) {
                continue;
            }
            let slot = match before.remove(&p) {
                Some(slot) if slot.is_pooled() => slot,
                _ => Pooled::leased_in(&pool)?,
            };
            kept.push((p, slot, r));
        }
        // Every kept row written at once (one launch per arena on a device).
        let mut rows: Vec<(&mut Pooled, usize)> =
            kept.iter_mut().map(|(_, slot, r)| (slot, *r)).collect();
        Pooled::set_rows(&mut rows, log_probs)?;
        self.prev
            .extend(kept.into_iter().map(|(p, slot, _)| (p, slot)));
        Ok(decided)
    }

    /// Keeps canvas positions `0..len` (the canvas was cut after a stop token; the program
    /// cuts its row cache).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.locked.truncate(len);
        self.prev.retain(|&p, _| p < len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_interpolates_linearly() {
        let v = [0.4, 0.1, 0.3, 0.2];
        assert!((percentile(&v, 0.0) - 0.1).abs() < 1e-12);
        assert!((percentile(&v, 100.0) - 0.4).abs() < 1e-12);
        assert!((percentile(&v, 50.0) - 0.25).abs() < 1e-12);
        assert!((percentile(&v, 20.0) - 0.16).abs() < 1e-12);
    }

    #[test]
    fn locks_need_a_small_kl_and_pass_the_gate() {
        let c = |position, kl, uncertainty| Candidate {
            position,
            kl,
            uncertainty,
        };
        let cands = [
            c(1, 1e-4, 0.01),
            c(2, 1e-2, 0.01),
            c(3, 1e-4, 0.5),
            c(4, 2e-4, 0.02),
        ];
        assert_eq!(decide(&cands, 5e-4, None), vec![1, 3, 4]);
        // The 50th percentile of uncertainties is 0.015: position 3 and 4 are too uncertain.
        assert_eq!(decide(&cands, 5e-4, Some(50.0)), vec![1]);
        assert!(decide(&cands, 0.0, None).is_empty());
    }
}
