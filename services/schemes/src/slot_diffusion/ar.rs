//! Plain autoregressive decoding of a slot-diffusion model (ReFusion is a causal Qwen3), with
//! the same KV cache and the same packed forward as plan-and-infill: the baseline the benchmark
//! compares against. The first call runs the prompt, every later call one token at the next
//! position; the next token is the argmax of the last row's logits (computed on the device) or
//! a draw from the request's sampler (temperature, top-k, top-p).

use wavefront_engine::{FinishReason, Outbox, Stats};
use wavefront_models::transformer::KvCache;

use super::call::{CacheUse, Call, CallRow, ReadOut, RowRead};
use crate::sampling::TokenSampler;

/// One autoregressive request.
#[derive(Debug)]
pub struct ArDecode {
    pub(crate) cache: KvCache,
    /// Tokens not yet run (the prompt, then the last generated token).
    pending: Vec<u32>,
    sampler: TokenSampler,
    max_new_tokens: usize,
    stop_token_ids: Vec<u32>,
    generated: usize,
    done: bool,
}

impl ArDecode {
    pub(crate) fn new(
        prompt: Vec<u32>,
        max_new_tokens: usize,
        stop_token_ids: Vec<u32>,
        sampler: TokenSampler,
    ) -> Self {
        Self {
            cache: KvCache::new(),
            pending: prompt,
            sampler,
            max_new_tokens,
            stop_token_ids,
            generated: 0,
            done: false,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// Buffer indices the cache holds after the next call.
    pub(crate) fn rows_after_next_call(&self) -> usize {
        self.cache.len() + self.pending.len()
    }

    pub(crate) fn next_call(&mut self) -> Call {
        let start = self.cache.len() as u32;
        let n = self.pending.len();
        Call {
            rows: vec![CallRow {
                ids: self.pending.clone(),
                positions: (start..start + n as u32).collect(),
                cache: CacheUse::Own,
                reads: vec![RowRead {
                    full: !self.sampler.is_greedy(),
                    ..RowRead::top1(n - 1)
                }],
            }],
        }
    }

    pub(crate) fn commit(
        &mut self,
        outs: &[Vec<ReadOut>],
        stats: &mut Stats,
        outbox: &mut Outbox,
    ) -> Result<(), String> {
        let o = outs
            .first()
            .and_then(|r| r.first())
            .ok_or("the call returned no logits")?;
        let token = match &o.logits {
            Some(logits) => self.sampler.sample(logits),
            None => o.argmax,
        };
        self.generated += 1;
        outbox.tokens(vec![token]);
        let reason = if self.stop_token_ids.contains(&token) {
            Some(FinishReason::StopToken)
        } else if self.generated >= self.max_new_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        match reason {
            Some(r) => {
                outbox.finish(r, std::mem::take(stats));
                self.done = true;
            }
            None => self.pending = vec![token],
        }
        Ok(())
    }
}
