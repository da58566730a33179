//! The plumbing every family's tick shares: the entries a tick works on (a program and its
//! outbox), the one head call over the rows programs read, and model errors as candle errors.

use candle_core::Tensor;
use wavefront_engine::{Active, FinishReason, Outbox};
use wavefront_models::ModelError;

/// One active program as a tick sees it: the program and the outbox its events go to.
pub struct Entry<'a, P> {
    pub program: &'a mut P,
    pub outbox: &'a mut Outbox,
}

/// The entries of the programs in `batch` that `keep` selects, in batch order.
pub(crate) fn entries<'a, P>(
    batch: &'a mut [&mut Active<P>],
    keep: impl Fn(&P) -> bool,
) -> Vec<Entry<'a, P>> {
    batch
        .iter_mut()
        .filter(|a| keep(&a.program))
        .map(|a| {
            let Active {
                program, outbox, ..
            } = &mut **a;
            Entry { program, outbox }
        })
        .collect()
}

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

/// Rows each prefill may run this tick under a row budget (`--max-batch-rows`): `fixed` rows
/// of the tick are spoken for (decoding steps, canvases, segments, wavefronts: work that runs
/// whole), and each prefill in `wants` gets what is left, in order, at most what it wants.
/// Without a budget every prefill runs whole. A prefill may get 0 (it waits for a later tick),
/// except that when nothing else runs the first one always gets at least one row.
pub(crate) fn prefill_rows(budget: Option<usize>, fixed: usize, wants: &[usize]) -> Vec<usize> {
    let Some(budget) = budget else {
        return wants.to_vec();
    };
    let mut left = budget.saturating_sub(fixed);
    let mut out = Vec::with_capacity(wants.len());
    for &want in wants {
        let mut take = want.min(left);
        if take == 0 && fixed == 0 && out.iter().all(|&t| t == 0) && want > 0 {
            take = 1;
        }
        left -= take.min(left);
        out.push(take);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::prefill_rows;

    #[test]
    fn prefills_share_what_the_fixed_rows_leave() {
        assert_eq!(prefill_rows(None, 5, &[100, 3]), [100, 3]);
        assert_eq!(prefill_rows(Some(64), 4, &[100, 3]), [60, 0]);
        assert_eq!(prefill_rows(Some(64), 4, &[10, 100]), [10, 50]);
        // Decoding alone over the budget: prefills wait.
        assert_eq!(prefill_rows(Some(8), 9, &[100]), [0]);
        // Nothing else runs: a prefill always moves.
        assert_eq!(prefill_rows(Some(0), 0, &[100]), [1]);
    }
}
