//! The packed-call pieces both recurrent-depth schemes run: one core call over the requests
//! still iterating, and the head's verdict on decoded rows.

use candle_core::{DType, Tensor};
use wavefront_models::{Huginn, HuginnCache, SeqRows};

use crate::SchemeError;

/// The head's output for a decoded row.
#[derive(Debug, Clone, PartialEq)]
pub enum NextToken {
    /// The argmax, computed on the device (greedy requests).
    Argmax(u32),
    /// The full logits row, for the request's sampler.
    Logits(Vec<f32>),
}

/// `parts` stacked along the rows (the part itself when there is one).
pub(crate) fn cat_rows(parts: &[Tensor]) -> candle_core::Result<Tensor> {
    if parts.len() == 1 {
        Ok(parts[0].clone())
    } else {
        Tensor::cat(parts, 0)
    }
}

/// Each request's rows `starts[i] .. starts[i] + lens[i]` of its cache, recurrence 0.
pub(crate) fn seq_rows<'a>(
    caches: &'a mut [&mut HuginnCache],
    starts: &[usize],
    lens: &[usize],
) -> Vec<SeqRows<'a>> {
    caches
        .iter_mut()
        .zip(starts.iter().zip(lens))
        .map(|(c, (&s, &n))| SeqRows::new(c, s, n))
        .collect()
}

/// Where each of consecutive runs of `lens` rows starts.
pub(crate) fn offsets(lens: &[usize]) -> Vec<usize> {
    lens.iter()
        .scan(0, |acc, &n| {
            let o = *acc;
            *acc += n;
            Some(o)
        })
        .collect()
}

/// One core call at recurrence `t` over the requests `members` (indices into `caches`,
/// `starts`, `lens`, `states` and `injected`, increasing): their states and injected
/// embeddings packed, each member's rows `starts[i] .. starts[i] + lens[i]` of its cache.
/// Replaces each member's state with its next one; returns the packed states before and after.
#[allow(clippy::too_many_arguments)]
pub(crate) fn core_call(
    model: &Huginn,
    caches: &mut [&mut HuginnCache],
    starts: &[usize],
    lens: &[usize],
    states: &mut [Tensor],
    injected: &[Tensor],
    members: &[usize],
    t: usize,
) -> Result<(Tensor, Tensor), SchemeError> {
    let s = cat_rows(
        &members
            .iter()
            .map(|&i| states[i].clone())
            .collect::<Vec<_>>(),
    )?;
    let e = cat_rows(
        &members
            .iter()
            .map(|&i| injected[i].clone())
            .collect::<Vec<_>>(),
    )?;
    let next = {
        let mut seqs: Vec<SeqRows> = Vec::with_capacity(members.len());
        let mut rest: &mut [&mut HuginnCache] = caches;
        let mut base = 0;
        for &i in members {
            let (_, tail) = rest.split_at_mut(i - base);
            let (head, tail) = tail.split_at_mut(1);
            seqs.push(SeqRows::new(&mut *head[0], starts[i], lens[i]).at_recurrence(t));
            rest = tail;
            base = i + 1;
        }
        model.core_step(&s, &e, &mut seqs)?
    };
    let mut row = 0;
    for &i in members {
        states[i] = next.narrow(0, row, lens[i])?;
        row += lens[i];
    }
    Ok((s, next))
}

/// The head's verdict on every row of `logits` `[rows, vocab]`: argmaxes reduced on the device
/// when every row is greedy (one small copy), else the full rows for the requests' samplers.
pub(crate) fn next_tokens(logits: &Tensor, greedy: bool) -> candle_core::Result<Vec<NextToken>> {
    Ok(if greedy {
        logits
            .argmax(candle_core::D::Minus1)?
            .to_dtype(DType::U32)?
            .to_vec1::<u32>()?
            .into_iter()
            .map(NextToken::Argmax)
            .collect()
    } else {
        logits
            .to_vec2::<f32>()?
            .into_iter()
            .map(NextToken::Logits)
            .collect()
    })
}
