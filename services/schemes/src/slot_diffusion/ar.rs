//! Plain autoregressive decoding of a slot-diffusion model (ReFusion is a causal Qwen3), with
//! the same KV cache and the same packed forward as plan-and-infill: the baseline the benchmark
//! compares against. The first call runs the prompt, every later call one token at the next
//! position; the next token is the argmax of the last row's logits (computed on the device) or
//! a draw from the request's sampler (temperature, top-k, top-p).

use wavefront_engine::{FinishReason, Outbox, Stats, TokenLogprob};
use wavefront_models::transformer::KvCache;

use super::call::{CacheUse, Call, CallRow, ReadOut, RowRead};
use crate::packing::ends_after;
use crate::sampling::{guided_pick, score, Filter, TokenSampler};
use crate::SchemeError;

/// One autoregressive request.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ArDecode {
    pub(crate) cache: KvCache,
    /// Tokens not yet run (the prompt, then the last generated token).
    pending: Vec<u32>,
    sampler: TokenSampler,
    max_new_tokens: usize,
    stop_token_ids: Vec<u32>,
    generated: usize,
    done: bool,
    /// With `prompt_logprobs`: the prompt's entries so far (position 0's first), until the
    /// prompt has run and they are sent.
    #[serde(default)]
    prompt_scores: Option<Vec<TokenLogprob>>,
    /// The structured-output constraint, when the request has one (it does not travel to
    /// another worker: `constrained` says it had one).
    #[serde(skip)]
    guide: Option<crate::constraint::Guide>,
    #[serde(default)]
    constrained: bool,
    /// The prompt's ids, kept for prompt sharing (a request with the same prompt reads this
    /// one's prompt pages: their rows depend on the ids alone).
    #[serde(default)]
    prompt: Vec<u32>,
    /// [`Self::share_key`], computed once.
    #[serde(default)]
    key: Option<u64>,
}

impl ArDecode {
    pub(crate) fn new(
        prompt: Vec<u32>,
        max_new_tokens: usize,
        stop_token_ids: Vec<u32>,
        sampler: TokenSampler,
    ) -> Self {
        let prompt_scores = sampler
            .params()
            .prompt_logprobs
            .map(|_| vec![TokenLogprob::unscored()]);
        let key =
            (prompt_scores.is_none() && prompt.len() > 1).then(|| super::call::prompt_key(&prompt));
        Self {
            key,
            prompt_scores,
            guide: None,
            constrained: false,
            cache: KvCache::new(),
            prompt: prompt.clone(),
            pending: prompt,
            sampler,
            max_new_tokens,
            stop_token_ids,
            generated: 0,
            done: false,
        }
    }

    /// Whether the request has a structured-output constraint.
    pub(crate) fn constrained(&self) -> bool {
        self.constrained
    }

    /// Constrains the output.
    pub(crate) fn guide(&mut self, guide: Option<crate::constraint::Guide>) {
        self.constrained = guide.is_some();
        self.guide = guide;
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// The key of the prompt's cached rows: its ids. `None` while the prompt is scored (a
    /// request reading shared pages would not compute their rows' logits).
    pub(crate) fn share_key(&self) -> Option<u64> {
        self.key
    }

    /// Whether the prompt's rows are still being computed.
    pub(crate) fn prompt_pending(&self) -> bool {
        self.cache.len() < self.prompt.len()
    }

    /// The prompt's ids.
    pub(crate) fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// Whether nothing has run yet (a request that may take another's prompt pages).
    pub(crate) fn at_start(&self) -> bool {
        self.cache.is_empty() && self.pending == self.prompt
    }

    /// The cache holds the prompt's first `rows` indices (another request's pages): they are
    /// not run again.
    pub(crate) fn skip_prompt(&mut self, rows: usize) -> Result<(), SchemeError> {
        if self.cache.len() != rows || rows >= self.pending.len() {
            return Err(SchemeError::inconsistent(
                "shared prompt rows do not fit the prompt",
            ));
        }
        self.pending.drain(..rows);
        Ok(())
    }

    /// Buffer indices the cache holds after the next call.
    pub(crate) fn rows_after_next_call(&self) -> usize {
        self.cache.len() + self.pending.len()
    }

    /// Tokens not yet run: the prompt (or what is left of it), then the last generated token.
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The most rows the next call runs: every pending one, or while the prompt is scored (its
    /// every row's logits read) a chunk of them.
    pub(crate) fn call_rows(&self) -> usize {
        if self.prompt_scores.is_some() {
            self.pending.len().min(crate::sampling::SCORE_CHUNK)
        } else {
            self.pending.len()
        }
    }

    /// The next call: the first `rows` pending tokens (all by default). A call that leaves
    /// some of the prompt for later (a chunk of a long prefill) reads no logits.
    pub(crate) fn next_call(&mut self, rows: Option<usize>) -> Call {
        let start = self.cache.len() as u32;
        let n = rows.map_or(self.call_rows(), |r| r.min(self.call_rows()));
        let last = n == self.pending.len();
        Call {
            rows: vec![CallRow {
                ids: self.pending[..n].to_vec(),
                positions: (start..start + n as u32).collect(),
                cache: CacheUse::Own,
                reads: if self.prompt_scores.is_some() {
                    // Scoring the prompt: every row's logits.
                    (0..n)
                        .map(|j| RowRead {
                            full: true,
                            ..RowRead::top1(j)
                        })
                        .collect()
                } else if last {
                    vec![RowRead {
                        full: self.sampler.wants_logits() || self.constrained,
                        ..RowRead::top1(n - 1)
                    }]
                } else {
                    Vec::new()
                },
            }],
        }
    }

    pub(crate) fn commit(
        &mut self,
        call: &Call,
        outs: &[Vec<ReadOut>],
        stats: &mut Stats,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        let ran = call.rows.first().map_or(0, |r| r.ids.len());
        if let Some(scores) = &mut self.prompt_scores {
            // Read j predicts the position after it: the chunk's next id, or the first of the
            // prompt's rest; the prompt's last row predicts no prompt token.
            let top = self.sampler.params().prompt_logprobs.unwrap_or(0);
            let reads = outs.first().map_or(&[][..], Vec::as_slice);
            for (j, o) in reads.iter().enumerate().take(ran) {
                if let (Some(&t), Some(logits)) = (self.pending.get(j + 1), &o.logits) {
                    scores.push(score(logits, t, Filter::model(), top));
                }
            }
        }
        if ran < self.pending.len() {
            // A chunk of the prompt: its K/V are cached; the rest runs next.
            self.pending.drain(..ran);
            return Ok(());
        }
        let o = outs
            .first()
            .and_then(|r| r.last())
            .ok_or_else(|| SchemeError::inconsistent("the call returned no logits"))?;
        if let Some(scores) = self.prompt_scores.take() {
            outbox.prompt_logprobs(scores);
            if self.max_new_tokens == 0 {
                // Scored only: no token is chosen.
                outbox.finish(FinishReason::Length, std::mem::take(stats));
                self.done = true;
                return Ok(());
            }
        }
        if self.constrained && self.guide.is_none() {
            return Err(SchemeError::inconsistent(
                "a structured-output request cannot continue on another worker",
            ));
        }
        let (token, scored, complete) = match &o.logits {
            Some(logits) => guided_pick(&mut self.sampler, self.guide.as_mut(), logits)?,
            None => (o.argmax, None, false),
        };
        self.generated += 1;
        outbox.scored_tokens(vec![token], scored.map(|s| vec![s]));
        match ends_after(
            token,
            &self.stop_token_ids,
            self.generated,
            self.max_new_tokens,
        )
        .or(complete.then_some(FinishReason::StopToken))
        {
            Some(r) => {
                outbox.finish(r, std::mem::take(stats));
                self.done = true;
            }
            None => self.pending = vec![token],
        }
        Ok(())
    }
}
