//! Ragged attention: the query rows of many sequences, packed along one axis, each attending
//! to its own range of gathered keys under its own mask rule.
//!
//! Layouts (head-major, the layout of the model crate's activations and K/V caches, so a
//! caller passes them without transposing): queries `[n_heads, rows, head_dim]`, keys and
//! values `[n_kv_heads, keys, head_dim]` (keys after RoPE), output `[n_heads, rows, head_dim]`.
//! Sequence `s` owns query rows `seqs[s].rows` and key rows `seqs[s].keys`; every query row and
//! key row also carries its *buffer index* (`row_index`, `key_index`), on which the mask is
//! decided, so a sequence's rows may sit anywhere in its buffer (a KV cache plus new rows,
//! ReFusion's reordered slots, WINO's shadow block). Grouped-query heads: query head `h` reads
//! kv head `h / (n_heads / n_kv_heads)`. Scores are scaled by `scale`, the softmax runs in
//! float32 with the running-maximum (online) formulation; a row that may attend to no key
//! gets zeros.

use std::ops::Range;

use crate::{check, KernelError};

/// Which keys a query may attend to, on buffer indices (the same rules as the model crate's
/// `MaskRule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mask {
    /// Every key (LLaDA).
    Bidirectional,
    /// Keys whose buffer index is not greater than the query's (Llama, ARMT, ReFusion's buffer
    /// order).
    Causal,
    /// WINO: main rows (`index < main_len`) see main keys; shadow row `main_len + j` sees every
    /// key but main position `block_start + j`.
    ShadowBlock { main_len: u32, block_start: u32 },
    /// Block diffusion (LLaDA2): buffer indices in blocks of `block` from 0; a query sees the
    /// keys of its own block and of every earlier one.
    BlockCausal { block: u32 },
    /// Independent rows after a shared prefix (ReFusion's parallel iterative completion): buffer
    /// indices from `prefix` on are segments of `segment`; a query in a segment sees the prefix
    /// and the keys of its own segment up to itself, never another segment. A query inside the
    /// prefix is causal.
    SegmentCausal { prefix: u32, segment: u32 },
    /// Causal within a sliding window (DiffusionGemma's encoder on its sliding layers): keys
    /// not after the query and fewer than `window` indices before it.
    SlidingCausal { window: u32 },
    /// The most recent cached keys and every key after them (DiffusionGemma's denoiser on its
    /// sliding layers): keys from `cached` on, and the `window - 1` keys just before `cached`.
    RecentCache { cached: u32, window: u32 },
}

impl Mask {
    pub fn allows(self, query: u32, key: u32) -> bool {
        match self {
            Mask::Bidirectional => true,
            Mask::Causal => key <= query,
            Mask::ShadowBlock {
                main_len,
                block_start,
            } => match (query >= main_len, key >= main_len) {
                (false, false) | (true, true) => true,
                (false, true) => false,
                (true, false) => key != block_start + (query - main_len),
            },
            Mask::BlockCausal { block } => key / block.max(1) <= query / block.max(1),
            Mask::SegmentCausal { prefix, segment } => {
                key <= query
                    && (key < prefix
                        || (key - prefix) / segment.max(1) == (query - prefix) / segment.max(1))
            }
            Mask::SlidingCausal { window } => key <= query && query - key < window,
            Mask::RecentCache { cached, window } => key >= cached || cached - key < window,
        }
    }

    /// The keys `query` sees when they are one run of indices (`None` for the rules whose
    /// visible keys can have gaps): what [`Mask::allows`] says of every key, computed once.
    pub fn visible(self, query: u32) -> Option<Range<u32>> {
        match self {
            Mask::Bidirectional => Some(0..u32::MAX),
            Mask::Causal => Some(0..query.saturating_add(1)),
            Mask::BlockCausal { block } => {
                let b = block.max(1);
                Some(0..(query / b).saturating_add(1).saturating_mul(b))
            }
            Mask::SlidingCausal { window } => {
                Some((query + 1).saturating_sub(window)..query.saturating_add(1))
            }
            _ => None,
        }
    }

    /// The `(kind, p0, p1)` triple the CUDA kernel reads.
    pub fn encode(self) -> [u32; 3] {
        match self {
            Mask::Bidirectional => [0, 0, 0],
            Mask::Causal => [1, 0, 0],
            Mask::ShadowBlock {
                main_len,
                block_start,
            } => [2, main_len, block_start],
            Mask::BlockCausal { block } => [3, block, 0],
            Mask::SegmentCausal { prefix, segment } => [4, prefix, segment],
            Mask::SlidingCausal { window } => [5, window, 0],
            Mask::RecentCache { cached, window } => [6, cached, window],
        }
    }
}

/// One sequence of a ragged call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaggedSeq {
    pub rows: Range<u32>,
    pub keys: Range<u32>,
    pub mask: Mask,
}

/// Shapes and per-row metadata of one ragged attention call.
#[derive(Debug, Clone)]
pub struct RaggedLayout {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub seqs: Vec<RaggedSeq>,
    /// Buffer index of every query row.
    pub row_index: Vec<u32>,
    /// Buffer index of every key row.
    pub key_index: Vec<u32>,
}

impl RaggedLayout {
    pub fn rows(&self) -> usize {
        self.row_index.len()
    }

    pub fn keys(&self) -> usize {
        self.key_index.len()
    }

    /// The most keys any one sequence attends over (its key range's length, masked or not).
    pub fn max_seq_keys(&self) -> usize {
        self.seqs.iter().map(|q| q.keys.len()).max().unwrap_or(0)
    }

    /// Checks that the sequences tile the rows and stay inside the keys.
    pub fn validate(&self) -> Result<(), KernelError> {
        check(
            self.n_kv_heads > 0 && self.n_heads.is_multiple_of(self.n_kv_heads),
            || {
                format!(
                    "{} kv heads do not divide {} heads",
                    self.n_kv_heads, self.n_heads
                )
            },
        )?;
        let mut next = 0u32;
        for (s, q) in self.seqs.iter().enumerate() {
            check(q.rows.start == next, || {
                format!("sequence {s} starts at row {} not {next}", q.rows.start)
            })?;
            check(q.rows.start <= q.rows.end, || format!("sequence {s} rows"))?;
            check(
                q.keys.start <= q.keys.end && q.keys.end as usize <= self.keys(),
                || format!("sequence {s} keys {:?} outside {}", q.keys, self.keys()),
            )?;
            next = q.rows.end;
        }
        check(next as usize == self.rows(), || {
            format!("sequences cover {next} of {} rows", self.rows())
        })
    }

    /// Sequence of every query row (what the CUDA kernel indexes by).
    pub fn row_seq(&self) -> Vec<u32> {
        let mut out = vec![0; self.rows()];
        for (s, q) in self.seqs.iter().enumerate() {
            for r in q.rows.clone() {
                out[r as usize] = s as u32;
            }
        }
        out
    }

    /// Per sequence `[row_start, row_end, key_start, key_end, mask kind, p0, p1]`.
    pub fn seq_table(&self) -> Vec<u32> {
        self.seqs
            .iter()
            .flat_map(|q| {
                let [kind, p0, p1] = q.mask.encode();
                [
                    q.rows.start,
                    q.rows.end,
                    q.keys.start,
                    q.keys.end,
                    kind,
                    p0,
                    p1,
                ]
            })
            .collect()
    }
}

/// The CPU reference: `out[h, r, :] = softmax_j(scale · q[h,r]·k[g,j]) v[g,j]` over the allowed
/// keys `j` of row `r`'s sequence, `g` the kv head of `h`.
pub fn ragged_attention(
    layout: &RaggedLayout,
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> Result<Vec<f32>, KernelError> {
    layout.validate()?;
    let (h, hkv, d) = (layout.n_heads, layout.n_kv_heads, layout.head_dim);
    check(q.len() == layout.rows() * h * d, || {
        format!("q has {} values, want {}", q.len(), layout.rows() * h * d)
    })?;
    let kv_len = layout.keys() * hkv * d;
    check(k.len() == kv_len && v.len() == kv_len, || {
        format!("k/v have {}/{} values, want {kv_len}", k.len(), v.len())
    })?;
    let group = h / hkv;
    let (rows, keys) = (layout.rows(), layout.keys());
    let mut out = vec![0f32; q.len()];
    let mut acc = vec![0f32; d];
    for seq in &layout.seqs {
        for r in seq.rows.clone() {
            let qi = layout.row_index[r as usize];
            for head in 0..h {
                let g = head / group;
                let qv = &q[(head * rows + r as usize) * d..][..d];
                let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                acc.iter_mut().for_each(|a| *a = 0.0);
                for j in seq.keys.clone() {
                    if !seq.mask.allows(qi, layout.key_index[j as usize]) {
                        continue;
                    }
                    let kv = &k[(g * keys + j as usize) * d..][..d];
                    let s = layout.scale * qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>();
                    let m_new = m.max(s);
                    let (c_old, c_new) = ((m - m_new).exp(), (s - m_new).exp());
                    let vv = &v[(g * keys + j as usize) * d..][..d];
                    for (a, x) in acc.iter_mut().zip(vv) {
                        *a = *a * c_old + c_new * x;
                    }
                    l = l * c_old + c_new;
                    m = m_new;
                }
                if l > 0.0 {
                    let o = &mut out[(head * rows + r as usize) * d..][..d];
                    for (o, a) in o.iter_mut().zip(&acc) {
                        *o = a / l;
                    }
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run from `visible` is exactly the keys `allows` lets through.
    #[test]
    fn visible_runs_are_what_the_rule_allows() {
        let masks = [
            Mask::Bidirectional,
            Mask::Causal,
            Mask::BlockCausal { block: 4 },
            Mask::BlockCausal { block: 0 },
            Mask::SlidingCausal { window: 3 },
            Mask::SlidingCausal { window: 0 },
            Mask::SlidingCausal { window: 50 },
        ];
        for m in masks {
            for q in 0..40u32 {
                let run = m.visible(q).expect("one run");
                for key in 0..45u32 {
                    assert_eq!(
                        run.contains(&key),
                        m.allows(q, key),
                        "{m:?} q {q} key {key}"
                    );
                }
            }
        }
        let gaps = Mask::ShadowBlock {
            main_len: 4,
            block_start: 1,
        };
        assert_eq!(gaps.visible(5), None);
    }

    #[test]
    fn mask_rules_on_buffer_indices() {
        assert!(Mask::Causal.allows(5, 5) && !Mask::Causal.allows(4, 5));
        let w = Mask::ShadowBlock {
            main_len: 6,
            block_start: 2,
        };
        // Main rows never see the shadow block; shadow row j hides main position 2 + j.
        assert!(w.allows(0, 5) && !w.allows(0, 6));
        assert!(!w.allows(6, 2) && w.allows(6, 3) && !w.allows(7, 3) && w.allows(7, 9));
        // Blocks of 4 from index 0: a row sees its block and the ones before, not later ones.
        let b = Mask::BlockCausal { block: 4 };
        assert!(b.allows(0, 3) && b.allows(5, 7) && b.allows(5, 0) && !b.allows(3, 4));
        assert_eq!(b.encode(), [3, 4, 0]);
        // A prefix of 5, then segments of 3 (5..8, 8..11): each sees the prefix and itself.
        let s = Mask::SegmentCausal {
            prefix: 5,
            segment: 3,
        };
        assert!(s.allows(9, 4) && s.allows(9, 8) && s.allows(9, 9) && !s.allows(9, 10));
        assert!(!s.allows(9, 5) && !s.allows(9, 7) && s.allows(7, 5) && !s.allows(5, 6));
        assert!(s.allows(3, 2) && !s.allows(3, 4));
        assert_eq!(s.encode(), [4, 5, 3]);
    }

    #[test]
    fn layouts_that_do_not_tile_their_rows_are_refused() {
        let layout = RaggedLayout {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 2,
            scale: 1.0,
            seqs: vec![RaggedSeq {
                rows: 1..2,
                keys: 0..1,
                mask: Mask::Causal,
            }],
            row_index: vec![0, 1],
            key_index: vec![0],
        };
        assert!(layout.validate().is_err());
    }
}
