//! What every family's packed forwards share: the one head call over the rows programs read,
//! the autoregressive end test, and model errors as candle errors inside a forward.

use candle_core::Tensor;
use wavefront_engine::FinishReason;
use wavefront_models::ModelError;

/// One head call over the rows programs read: `head` over rows `select` of `hidden`, in that
/// order; `None` when no row is read.
pub(crate) fn head_rows(
    hidden: &Tensor,
    select: &[u32],
    head: impl FnOnce(&Tensor) -> Result<Tensor, ModelError>,
) -> candle_core::Result<Option<Tensor>> {
    if select.is_empty() {
        return Ok(None);
    }
    let rows = hidden.index_select(&Tensor::new(select, hidden.device())?, 0)?;
    head(&rows).map(Some).map_err(to_candle)
}

/// Whether an autoregressive request ends after taking `token` as its `generated`-th new
/// token: on one of its stop tokens, or at `max_new_tokens`.
pub(crate) fn ends_after(
    token: u32,
    stop_token_ids: &[u32],
    generated: usize,
    max_new_tokens: usize,
) -> Option<FinishReason> {
    if stop_token_ids.contains(&token) {
        Some(FinishReason::StopToken)
    } else if generated >= max_new_tokens {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// A model error as a candle error, so a tick's `?` carries both.
pub(crate) fn to_candle(e: ModelError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// A 64-bit key of `value` (prompt sharing: equal prompts, and settings, give equal keys;
/// programs compare the prompts themselves before sharing, so a collision costs nothing).
pub(crate) fn key_of(value: &impl std::hash::Hash) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault};
    BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(value)
}

/// Prompt sharing where a position's rows depend on the ids up to it: the rows of `prompt` a
/// request may read from one with `donor`'s, the whole pages of `page` rows of their longest
/// common prefix before `prompt`'s last index (which the request computes itself); 0 for an
/// empty prompt.
pub(crate) fn common_prompt_rows(prompt: &[u32], donor: &[u32], page: usize) -> usize {
    let common = prompt.iter().zip(donor).take_while(|(a, b)| a == b).count();
    common.min(prompt.len().saturating_sub(1)) / page.max(1) * page
}

#[cfg(test)]
mod prompt_rows_tests {
    use super::common_prompt_rows;

    #[test]
    fn the_common_prefix_counts_in_whole_pages_before_the_last_index() {
        let p: Vec<u32> = (0..40).collect();
        // The same prompt: its whole pages before index 39.
        assert_eq!(common_prompt_rows(&p, &p, 16), 32);
        // 35 ids in common: two pages; 31 in common: one.
        let mut d = p.clone();
        d[35] = 999;
        assert_eq!(common_prompt_rows(&p, &d, 16), 32);
        d[31] = 999;
        assert_eq!(common_prompt_rows(&p, &d, 16), 16);
        // A donor prompt that is a prefix of this one; one that differs from the start.
        assert_eq!(common_prompt_rows(&p, &p[..33], 16), 32);
        assert_eq!(common_prompt_rows(&p, &[7], 16), 0);
        // A prompt of exactly two pages keeps its last index for itself: one page.
        assert_eq!(common_prompt_rows(&p[..32], &p, 16), 16);
        assert_eq!(common_prompt_rows(&[], &p, 16), 0);
    }
}
