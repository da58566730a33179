//! Autoregressive decoding of a recurrent-depth model, packed across requests.
//!
//! Per token (upstream `generate_minimal` and
//! `generate_with_adaptive_compute`): run the prelude over the positions not
//! yet in the cache (the whole prompt first, then one token), draw a fresh
//! initial state per position, iterate the core block, then coda and head on
//! the last position.
//! - **static**: exactly `num_steps` core iterations;
//! - **adaptive exit**: after each iteration, `v = mean over the processed
//!   positions of ||s_new - s|| / ||s_new||`; stop as soon as `v < exit_threshold`
//!   (at most `num_steps`). A token writes core K/V only for the recurrences
//!   it ran; later tokens read its deepest one (`latest-m4` lookup).
//!
//! **Continuous compute** (upstream `continuous_compute`, "warm-start state /
//! continuous CoT"): the prompt's positions start from fresh draws as usual;
//! every later position starts from the final raw state of the position
//! before it (the state its token was decoded from: after `num_steps`
//! iterations, or at the adaptive exit) instead of a fresh draw, so no draws
//! are consumed after the prompt. This is upstream's intent; its two AR loops
//! disagree on the state copied (`generate_with_adaptive_compute` copies the
//! raw state as here, `generate_minimal` copies `latent_states`, i.e. the
//! state after the final norm `ln_f`); no golden covers either.
//!
//! One tick advances every active request by one token. All requests' rows
//! share each prelude, core and coda call; at core iteration `t` only the
//! requests still iterating take part, so static requests with different
//! `num_steps` and adaptive requests that exit early pack together.

use candle_core::{DType, Device, Tensor};
use wavefront_engine::{FinishReason, Stats};
use wavefront_models::{relative_change, Huginn, HuginnCache, SeqRows};

use super::draws::DrawSource;
use crate::sampling::TokenSampler;
use crate::tick::to_candle;

/// One request's autoregressive decoding state.
#[derive(Debug)]
pub struct ArProgram {
    pub(crate) cache: HuginnCache,
    /// Tokens not yet run through the model (prompt at first, then the last token).
    pub(crate) pending: Vec<u32>,
    pub(crate) num_steps: usize,
    pub(crate) exit_threshold: Option<f32>,
    pub(crate) continuous_compute: bool,
    /// Continuous compute: the last processed position's final state `[1, E]`, the initial
    /// state of the next position.
    pub(crate) warm_state: Option<Tensor>,
    pub(crate) draws: DrawSource,
    pub(crate) sampler: TokenSampler,
    pub(crate) max_new_tokens: usize,
    pub(crate) stop_token_ids: Vec<u32>,
    pub(crate) generated: usize,
    pub(crate) stats: Stats,
}

/// One active AR request as the tick sees it.
pub type Entry<'a> = crate::tick::Entry<'a, ArProgram>;

/// Runs one token for every program in `batch` through `model` in packed calls.
pub fn tick(model: &Huginn, batch: &mut [Entry<'_>]) -> candle_core::Result<()> {
    let rows: Vec<usize> = batch.iter().map(|a| a.program.pending.len()).collect();
    tick_rows(model, batch, &rows)
}

/// Whether `p`'s next call may run in chunks: a prefill at a static recurrence (an adaptive
/// exit averages the latent change over the positions of the call, so it runs whole).
pub(crate) fn chunkable(p: &ArProgram) -> bool {
    p.pending.len() > 1 && p.exit_threshold.is_none()
}

/// [`tick`] over the first `rows[i]` pending positions of program `i` (a chunk of a static
/// prefill when fewer than it has: its K/V are cached, no token is chosen, and the rest runs
/// at a later tick; positions, draws and states are those of the whole prefill).
pub fn tick_rows(
    model: &Huginn,
    batch: &mut [Entry<'_>],
    rows: &[usize],
) -> candle_core::Result<()> {
    if batch.is_empty() {
        return Ok(());
    }
    let device = model.device().clone();
    let dtype = model.dtype();
    let dim = model.config().n_embd;
    let lens: Vec<usize> = rows.to_vec();
    let partial: Vec<bool> = batch
        .iter()
        .zip(&lens)
        .map(|(a, &n)| n < a.program.pending.len())
        .collect();
    let ids: Vec<u32> = batch
        .iter()
        .zip(&lens)
        .flat_map(|(a, &n)| a.program.pending[..n].iter().copied())
        .collect();
    // Absolute position of each request's first pending row (the prelude
    // write advances the cache length, so capture it first).
    let starts: Vec<usize> = batch.iter().map(|a| a.program.cache.len()).collect();

    // Prelude over every pending row of every request.
    let emb = model.embed(&ids).map_err(to_candle)?;
    let injected = {
        let mut seqs = seq_rows(batch, &starts, &lens);
        model.prelude(&emb, &mut seqs).map_err(to_candle)?
    };

    // Initial states: fresh draws, each request from its own source (one host-to-device copy
    // for all of them), or the warm state of a continuous-compute request.
    let mut init = Vec::with_capacity(ids.len() * dim);
    let mut drawn_rows = 0;
    for (a, &n) in batch.iter_mut().zip(&lens) {
        if a.program.warm_state.is_some() {
            continue;
        }
        let rows = a
            .program
            .draws
            .next(n, dim, false)
            .map_err(candle_core::Error::Msg)?;
        init.extend_from_slice(&rows);
        drawn_rows += n;
    }
    let drawn = if drawn_rows > 0 {
        Some(
            Tensor::from_vec(init, (drawn_rows, dim), &Device::Cpu)?
                .to_device(&device)?
                .to_dtype(dtype)?,
        )
    } else {
        None
    };

    // Core iterations: request i takes part while it is still iterating.
    let offsets: Vec<usize> = lens
        .iter()
        .scan(0, |acc, &n| {
            let o = *acc;
            *acc += n;
            Some(o)
        })
        .collect();
    let mut drawn_offset = 0;
    let mut states: Vec<Tensor> = Vec::with_capacity(batch.len());
    for (a, &n) in batch.iter_mut().zip(&lens) {
        match a.program.warm_state.take() {
            Some(w) if n == 1 => states.push(w),
            Some(_) => candle_core::bail!("a warm state seeds exactly one new position"),
            None => {
                let drawn = drawn.as_ref().expect("rows were drawn for this request");
                states.push(drawn.narrow(0, drawn_offset, n)?);
                drawn_offset += n;
            }
        }
    }
    let injs: Vec<Tensor> = offsets
        .iter()
        .zip(&lens)
        .map(|(&o, &n)| injected.narrow(0, o, n))
        .collect::<candle_core::Result<_>>()?;
    let mut steps_run = vec![0usize; batch.len()];
    let mut iterating: Vec<bool> = batch.iter().map(|a| a.program.num_steps > 0).collect();
    let max_steps = batch.iter().map(|a| a.program.num_steps).max().unwrap_or(0);
    for t in 0..max_steps {
        let members: Vec<usize> = (0..batch.len()).filter(|&i| iterating[i]).collect();
        if members.is_empty() {
            break;
        }
        let s = cat_rows(
            &members
                .iter()
                .map(|&i| states[i].clone())
                .collect::<Vec<_>>(),
        )?;
        let e = cat_rows(&members.iter().map(|&i| injs[i].clone()).collect::<Vec<_>>())?;
        let member_lens: Vec<usize> = members.iter().map(|&i| lens[i]).collect();
        let next = {
            let mut seqs: Vec<SeqRows> = Vec::with_capacity(members.len());
            let mut rest: &mut [Entry<'_>] = batch;
            let mut base = 0;
            for &i in &members {
                let (_, tail) = rest.split_at_mut(i - base);
                let (head, tail) = tail.split_at_mut(1);
                seqs.push(
                    SeqRows::new(&mut head[0].program.cache, starts[i], lens[i]).at_recurrence(t),
                );
                rest = tail;
                base = i + 1;
            }
            model.core_step(&s, &e, &mut seqs).map_err(to_candle)?
        };
        // Adaptive members need their exit value: one small host copy.
        let adaptive: Vec<usize> = members
            .iter()
            .copied()
            .filter(|&i| batch[i].program.exit_threshold.is_some())
            .collect();
        let change = if adaptive.is_empty() {
            None
        } else {
            Some(
                relative_change(&next, &s)
                    .map_err(to_candle)?
                    .to_vec1::<f32>()?,
            )
        };
        let mut row = 0;
        for (k, &i) in members.iter().enumerate() {
            let n = member_lens[k];
            states[i] = next.narrow(0, row, n)?;
            steps_run[i] += 1;
            let p = &batch[i].program;
            let done_static = steps_run[i] >= p.num_steps;
            let exited = match (p.exit_threshold, &change) {
                (Some(eps), Some(c)) => {
                    let v: f32 = c[row..row + n].iter().sum::<f32>() / n as f32;
                    v < eps
                }
                _ => false,
            };
            if done_static || exited {
                iterating[i] = false;
            }
            row += n;
        }
    }

    // Continuous compute: the next position starts where this request's last one ended.
    for ((a, (s, &n)), &part) in batch.iter_mut().zip(states.iter().zip(&lens)).zip(&partial) {
        if a.program.continuous_compute && !part {
            a.program.warm_state = Some(s.narrow(0, n - 1, 1)?);
        }
    }

    // Coda over every row (its K/V is needed later), head on the last rows.
    let final_state = cat_rows(&states)?;
    let hidden = {
        let mut seqs = seq_rows(batch, &starts, &lens);
        model.coda(&final_state, &mut seqs).map_err(to_candle)?
    };
    // The head over the last row of every request that ran all its pending positions.
    let whole: Vec<usize> = (0..batch.len()).filter(|&i| !partial[i]).collect();
    let last_rows: Vec<u32> = whole
        .iter()
        .map(|&i| (offsets[i] + lens[i] - 1) as u32)
        .collect();
    let mut next_tokens: Vec<Option<u32>> = vec![None; batch.len()];
    if !whole.is_empty() {
        let last = hidden.index_select(&Tensor::new(last_rows.as_slice(), &device)?, 0)?;
        let logits = model.lm_head(&last).map_err(to_candle)?;
        if whole.iter().all(|&i| batch[i].program.sampler.is_greedy()) {
            let ids = logits
                .argmax(candle_core::D::Minus1)?
                .to_dtype(DType::U32)?
                .to_vec1::<u32>()?;
            for (&i, t) in whole.iter().zip(ids) {
                next_tokens[i] = Some(t);
            }
        } else {
            for (&i, r) in whole.iter().zip(logits.to_vec2::<f32>()?) {
                next_tokens[i] = Some(batch[i].program.sampler.sample(&r));
            }
        }
    }

    // Commit: advance each cache, stream the token, decide whether to stop.
    for (((a, tok), steps), &n) in batch.iter_mut().zip(next_tokens).zip(steps_run).zip(&lens) {
        let p = &mut a.program;
        p.stats.forward_passes += 1;
        let Some(tok) = tok else {
            // A chunk of the prefill: its positions are cached, the rest runs next.
            p.pending.drain(..n);
            continue;
        };
        p.stats.recurrence_steps += steps as u64;
        p.stats.push_series("steps_per_token", steps as u32);
        p.generated += 1;
        p.pending.clear();
        p.pending.push(tok);
        a.outbox.tokens(vec![tok]);
        let reason = if p.stop_token_ids.contains(&tok) {
            Some(FinishReason::StopToken)
        } else if p.generated >= p.max_new_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        if let Some(reason) = reason {
            let stats = std::mem::take(&mut p.stats);
            a.outbox.finish(reason, stats);
        }
    }
    Ok(())
}

fn seq_rows<'a>(batch: &'a mut [Entry<'_>], starts: &[usize], lens: &[usize]) -> Vec<SeqRows<'a>> {
    batch
        .iter_mut()
        .zip(starts.iter().zip(lens))
        .map(|(a, (&s, &n))| SeqRows::new(&mut a.program.cache, s, n))
        .collect()
}

fn cat_rows(parts: &[Tensor]) -> candle_core::Result<Tensor> {
    if parts.len() == 1 {
        Ok(parts[0].clone())
    } else {
        Tensor::cat(parts, 0)
    }
}
