//! Which keys a query row may attend to, decided on buffer indices (not positions: WINO's shadow
//! rows copy their verified positions, ReFusion's slots are not contiguous), for every family on
//! the shared block: bidirectional (LLaDA, Nie et al., 2025), causal in buffer order (Llama /
//! ARMT; ReFusion's committed buffer), WINO's shadow block (Hong et al., "Wide-In, Narrow-Out:
//! Revokable Decoding for Efficient and Effective DLLMs"), LLaDA2.0's block diffusion and
//! ReFusion's parallel completion rows (segments after a shared prefix). The ragged kernel
//! (`wavefront_kernels::attention::Mask`) and the CPU kernel decide the same rules; the
//! per-sequence candle path takes them as an additive mask.

use candle_core::Tensor;

use crate::error::Result;

/// Which keys a query row may attend to, decided on buffer indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskRule {
    /// Every query sees every key (LLaDA).
    Bidirectional,
    /// A query sees the keys whose buffer index is not greater than its own.
    Causal,
    /// WINO: the buffer is `main_len` main positions followed by a shadow block whose row `j`
    /// verifies main position `block_start + j`. Main rows see main keys only; shadow rows see
    /// every key except main position `block_start + j`.
    ShadowBlock { main_len: usize, block_start: usize },
    /// Block diffusion (LLaDA2): buffer indices in blocks of `block` from 0 (the prompt
    /// included); a query sees its own block and every earlier one.
    BlockCausal { block: usize },
    /// Independent rows after a shared prefix, in one buffer (ReFusion's parallel iterative
    /// completion, each row of upstream's batch over the committed cache and itself): buffer
    /// indices from `prefix` on are segments of `segment`; a query in a segment sees the
    /// prefix and its own segment up to itself, never another segment; inside the prefix,
    /// causal.
    SegmentCausal { prefix: usize, segment: usize },
    /// Causal within a sliding window of `window` indices (DiffusionGemma's encoder on its
    /// sliding-attention layers: a query at `q` sees keys `q - window < k <= q`).
    SlidingCausal { window: usize },
    /// The denoiser's view of a sliding-attention layer (DiffusionGemma): every key from
    /// `cached` on (the canvas, bidirectional, no window inside it) and the `window - 1`
    /// cached keys just before it, what upstream's sliding cache keeps.
    RecentCache { cached: usize, window: usize },
}

impl MaskRule {
    /// Whether the row at buffer index `query` may attend to the key at buffer index `key`.
    pub fn allows(self, query: usize, key: usize) -> bool {
        match self {
            MaskRule::Bidirectional => true,
            MaskRule::Causal => key <= query,
            MaskRule::ShadowBlock {
                main_len,
                block_start,
            } => match (query >= main_len, key >= main_len) {
                (false, false) => true,
                (false, true) => false,
                (true, true) => true,
                (true, false) => key != block_start + (query - main_len),
            },
            MaskRule::BlockCausal { block } => key / block.max(1) <= query / block.max(1),
            MaskRule::SegmentCausal { prefix, segment } => {
                key <= query
                    && (key < prefix
                        || (key - prefix) / segment.max(1) == (query - prefix) / segment.max(1))
            }
            MaskRule::SlidingCausal { window } => key <= query && query - key < window,
            MaskRule::RecentCache { cached, window } => key >= cached || cached - key < window,
        }
    }
}

/// The additive mask `[queries, keys]` (float32, 0 or -inf) of `rule` on the given buffer
/// indices; `None` when every key is visible.
pub(crate) fn build_mask(
    rule: MaskRule,
    queries: &[u32],
    keys: &[u32],
    device: &candle_core::Device,
) -> Result<Option<Tensor>> {
    if rule == MaskRule::Bidirectional {
        return Ok(None);
    }
    let mut all = true;
    let data: Vec<f32> = queries
        .iter()
        .flat_map(|&q| {
            keys.iter().map(move |&k| {
                if rule.allows(q as usize, k as usize) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .inspect(|&v| all &= v == 0.0)
        .collect();
    if all {
        return Ok(None);
    }
    Ok(Some(Tensor::from_vec(
        data,
        (queries.len(), keys.len()),
        device,
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shadow_rule_hides_the_verified_position_and_the_shadow_from_main_rows() {
        let rule = MaskRule::ShadowBlock {
            main_len: 6,
            block_start: 2,
        };
        // Main rows: all main keys, no shadow keys.
        assert!(rule.allows(0, 5));
        assert!(!rule.allows(3, 6));
        // Shadow row 7 (j = 1) verifies main position 3.
        assert!(!rule.allows(7, 3));
        assert!(rule.allows(7, 2));
        assert!(rule.allows(7, 4));
        assert!(rule.allows(7, 6));
        assert!(rule.allows(7, 7));
    }

    #[test]
    fn a_segment_row_sees_the_prefix_and_its_own_segment_up_to_itself() {
        // Prefix 0..5, then segments 5..8 and 8..11.
        let rule = MaskRule::SegmentCausal {
            prefix: 5,
            segment: 3,
        };
        assert!(rule.allows(9, 0) && rule.allows(9, 4) && rule.allows(9, 8) && rule.allows(9, 9));
        assert!(!rule.allows(9, 5) && !rule.allows(9, 7) && !rule.allows(9, 10));
        assert!(rule.allows(6, 5) && !rule.allows(6, 8));
        // Inside the prefix: causal.
        assert!(rule.allows(3, 3) && !rule.allows(3, 4));
        let mask = build_mask(
            rule,
            &[6, 9],
            &(0..11).collect::<Vec<_>>(),
            &candle_core::Device::Cpu,
        )
        .unwrap()
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
        let seen = |row: &[f32]| row.iter().map(|&v| v == 0.0).collect::<Vec<_>>();
        let (t, f) = (true, false);
        assert_eq!(seen(&mask[0]), [t, t, t, t, t, t, t, f, f, f, f]);
        assert_eq!(seen(&mask[1]), [t, t, t, t, t, f, f, f, t, t, f]);
    }
}
