//! The plumbing every family's tick shares: the entries a tick works on (a program and its
//! outbox), the one head call over the rows programs read, and model errors as candle errors.

use candle_core::Tensor;
use wavefront_engine::{Active, Outbox};
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

/// A model error as a candle error, so a tick's `?` carries both.
pub(crate) fn to_candle(e: ModelError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}
