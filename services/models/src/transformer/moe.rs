//! A mixture-of-experts feed-forward layer over packed rows (LLaDA2.0, inclusionAI 2025, the
//! `LLaDA2MoeSparseMoeBlock` / `LLaDA2MoeGate` of its remote code; the DeepSeek-V3 routing it
//! follows): a sigmoid router with a selection bias, group-limited top-k, renormalised and
//! scaled weights, routed SwiGLU experts and an always-on shared expert.
//!
//! Per row `h`: `s = sigmoid(h · Wgᵀ)` (float32); selection by the biased scores `b = s + bias`:
//! the experts are cut into `n_group` groups of consecutive ids, a group scores the sum of its
//! two best `b`, the `topk_group` best groups stay, and the `top_k` best experts by `b` among
//! them are chosen (descending `b`); their weights are the **unbiased** scores renormalised to
//! sum to one (when `top_k > 1`), times `routed_scaling_factor`. The output is
//! `Σ w_k · expert_k(h) + shared(h)`, with no capacity limit and no dropped rows.
//!
//! The expert path is batched: the router runs once over every row of the call, rows are grouped
//! by expert on the host, and each expert runs **one** product over all the rows routed to it
//! (every request of the tick together), its outputs scaled by their weights and added back with
//! one index-add. Expert parallelism: with `world` ranks each rank owns a contiguous range of
//! experts (and a column slice of the shared expert), computes the partial sum of its experts,
//! and the collective sums the ranks' partials as it does for the dense block.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::layers::GatedMlp;
use super::parallel::{on_rank, reduce, Collective};
use crate::error::{ModelError, Result};

/// Routing settings of a MoE layer.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeRouting {
    pub n_experts: usize,
    /// Experts per row (`num_experts_per_tok`).
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f32,
}

impl MoeRouting {
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, reason: String| {
            Err(ModelError::Config {
                key: key.into(),
                reason,
            })
        };
        if self.n_experts == 0 || self.top_k == 0 || self.top_k > self.n_experts {
            return bad(
                "num_experts_per_tok",
                format!("{} of {} experts", self.top_k, self.n_experts),
            );
        }
        if self.n_group == 0 || !self.n_experts.is_multiple_of(self.n_group) {
            return bad(
                "n_group",
                format!(
                    "{} groups do not divide {} experts",
                    self.n_group, self.n_experts
                ),
            );
        }
        if self.topk_group == 0 || self.topk_group > self.n_group {
            return bad(
                "topk_group",
                format!("{} of {} groups", self.topk_group, self.n_group),
            );
        }
        if self.topk_group * (self.n_experts / self.n_group) < self.top_k {
            return bad(
                "topk_group",
                format!(
                    "{} groups of {} experts cannot hold {} experts per row",
                    self.topk_group,
                    self.n_experts / self.n_group,
                    self.top_k
                ),
            );
        }
        Ok(())
    }

    /// The experts and weights of one row from its router logits (`n_experts` values).
    pub fn route(&self, logits: &[f32], bias: &[f32]) -> (Vec<usize>, Vec<f32>) {
        let e = self.n_experts;
        let scores: Vec<f32> = logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
        let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
        let per = e / self.n_group;
        // A group's score: the sum of its two best biased scores.
        let group_score = |g: usize| {
            let mut v: Vec<f32> = biased[g * per..(g + 1) * per].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            v.iter().take(2).sum::<f32>()
        };
        let mut groups: Vec<usize> = (0..self.n_group).collect();
        groups.sort_by(|&a, &b| group_score(b).total_cmp(&group_score(a)).then(a.cmp(&b)));
        let kept = &groups[..self.topk_group];
        let mut cands: Vec<usize> = (0..e).filter(|x| kept.contains(&(x / per))).collect();
        cands.sort_by(|&a, &b| biased[b].total_cmp(&biased[a]).then(a.cmp(&b)));
        let idx: Vec<usize> = cands[..self.top_k].to_vec();
        let mut w: Vec<f32> = idx.iter().map(|&i| scores[i]).collect();
        if self.top_k > 1 {
            let sum: f32 = w.iter().sum::<f32>() + 1e-20;
            w.iter_mut().for_each(|x| *x /= sum);
        }
        w.iter_mut().for_each(|x| *x *= self.routed_scaling_factor);
        (idx, w)
    }
}

/// One rank's part of a MoE layer: its experts (by global id) and its slice of the shared one.
#[derive(Debug, Clone)]
pub(crate) struct MoeShard {
    pub experts: Range<usize>,
    /// Expert `experts.start + i` is `routed[i]`.
    pub routed: Vec<GatedMlp>,
    pub shared: Option<GatedMlp>,
}

/// A MoE feed-forward layer, possibly split over expert-parallel ranks.
#[derive(Debug, Clone)]
pub struct Moe {
    pub(crate) routing: MoeRouting,
    /// Router weight `[n_experts, hidden]`, float32.
    gate: Tensor,
    bias: Vec<f32>,
    pub(crate) shards: Vec<MoeShard>,
    comm: Arc<dyn Collective>,
}

/// What the router chose for every row of a call (tests compare it with upstream's).
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Router logits `[rows, n_experts]` (before the sigmoid and the bias).
    pub logits: Vec<Vec<f32>>,
    /// Chosen experts per row, in descending biased score.
    pub experts: Vec<Vec<usize>>,
    pub weights: Vec<Vec<f32>>,
}

/// The rows of a call routed to each expert and their weights: what the grouped expert path
/// runs, one product per expert over its rows.
pub(crate) struct Routed {
    rows: Vec<Vec<u32>>,
    weights: Vec<Vec<f32>>,
}

impl Routed {
    /// Groups per expert the chosen `experts` and `weights` of every row (row order kept).
    pub(crate) fn new(n_experts: usize, experts: &[Vec<usize>], weights: &[Vec<f32>]) -> Self {
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); n_experts];
        let mut ws: Vec<Vec<f32>> = vec![Vec::new(); n_experts];
        for (r, (es, w)) in experts.iter().zip(weights).enumerate() {
            for (&e, &w) in es.iter().zip(w) {
                rows[e].push(r as u32);
                ws[e].push(w);
            }
        }
        Self { rows, weights: ws }
    }

    /// `y + Σ_e w · expert_e(x[rows of e])` over the experts `first ..` (`mlps[i]` is expert
    /// `first + i`, run by `forward`): one product per expert, added back with one index-add.
    pub(crate) fn add<E>(
        &self,
        mut y: Tensor,
        x: &Tensor,
        first: usize,
        mlps: &[E],
        forward: impl Fn(&E, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        for (i, mlp) in mlps.iter().enumerate() {
            let e = first + i;
            if self.rows[e].is_empty() {
                continue;
            }
            let idx = Tensor::new(self.rows[e].as_slice(), x.device())?;
            let out = forward(mlp, &x.index_select(&idx, 0)?)?;
            let w = Tensor::from_vec(self.weights[e].clone(), (self.rows[e].len(), 1), x.device())?
                .to_dtype(out.dtype())?;
            y = y.index_add(&idx, &out.broadcast_mul(&w)?, 0)?;
        }
        Ok(y)
    }
}

/// The contiguous range of experts rank `rank` of `world` owns (the first `n % world` ranks
/// one more).
pub(crate) fn expert_range(n: usize, world: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (n / world, n % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

impl Moe {
    pub(crate) fn new(
        routing: MoeRouting,
        gate: Tensor,
        bias: Vec<f32>,
        shards: Vec<MoeShard>,
        comm: Arc<dyn Collective>,
    ) -> Result<Self> {
        routing.validate()?;
        if bias.len() != routing.n_experts || gate.dim(0)? != routing.n_experts {
            return Err(ModelError::Shape(format!(
                "router of {} experts with {} bias values",
                gate.dim(0)?,
                bias.len()
            )));
        }
        let shards = shards
            .into_iter()
            .enumerate()
            .map(|(rank, s)| match comm.device(rank) {
                None => Ok(s),
                Some(d) => Ok(MoeShard {
                    routed: s
                        .routed
                        .iter()
                        .map(|m| m.to_device(d))
                        .collect::<Result<_>>()?,
                    shared: s.shared.as_ref().map(|m| m.to_device(d)).transpose()?,
                    experts: s.experts,
                }),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            routing,
            gate: gate.to_dtype(DType::F32)?,
            bias,
            shards,
            comm,
        })
    }

    /// The router's choices for rows `h` `[N, hidden]`.
    pub fn route(&self, h: &Tensor) -> Result<Routing> {
        let logits: Vec<Vec<f32>> = h
            .to_dtype(DType::F32)?
            .to_device(self.gate.device())?
            .matmul(&self.gate.t()?)?
            .to_vec2()?;
        let (experts, weights) = logits
            .iter()
            .map(|l| self.routing.route(l, &self.bias))
            .unzip();
        Ok(Routing {
            logits,
            experts,
            weights,
        })
    }

    /// The layer over rows `h` `[N, hidden]`.
    pub fn forward(&self, h: &Tensor) -> Result<Tensor> {
        let routing = self.route(h)?;
        let n = h.dim(0)?;
        let routed = Routed::new(self.routing.n_experts, &routing.experts, &routing.weights);
        let comm = self.comm.as_ref();
        let partials = self
            .shards
            .iter()
            .enumerate()
            .map(|(rank, s)| {
                let x = on_rank(comm, rank, h)?;
                let y = match &s.shared {
                    Some(m) => m.forward(&x)?,
                    None => x.zeros_like()?,
                };
                routed.add(y, &x, s.experts.start, &s.routed, GatedMlp::forward)
            })
            .collect::<Result<Vec<_>>>()?;
        let y = reduce(comm, partials)?;
        debug_assert_eq!(y.dim(0)?, n);
        Ok(y)
    }

    pub(crate) fn store_weights(&mut self, dtype: super::WeightDtype) -> Result<()> {
        for s in &mut self.shards {
            for m in s.routed.iter_mut().chain(s.shared.as_mut()) {
                m.gate_up.store_as(dtype)?;
                m.down.store_as(dtype)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_limits_groups_renormalises_and_scales() {
        let r = MoeRouting {
            n_experts: 8,
            top_k: 2,
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 2.5,
        };
        r.validate().unwrap();
        // Expert 7 has the best single score, but its group {6, 7} loses to {0, 1} and {2, 3}
        // once the bias is counted.
        let logits = [1.0f32, 0.9, 0.8, 0.7, -3.0, -3.0, -5.0, 2.0];
        let bias = [0.3f32, 0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0];
        let (idx, w) = r.route(&logits, &bias);
        assert_eq!(idx, vec![0, 1]);
        assert!((w.iter().sum::<f32>() - 2.5).abs() < 1e-6);
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        assert!((w[0] / w[1] - s(1.0) / s(0.9)).abs() < 1e-6);
    }

    #[test]
    fn experts_split_into_contiguous_ranges() {
        let ranges: Vec<_> = (0..3).map(|r| expert_range(8, 3, r)).collect();
        assert_eq!(ranges, vec![0..3, 3..6, 6..8]);
    }
}
