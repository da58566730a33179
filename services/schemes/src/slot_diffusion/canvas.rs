//! The generated positions of one plan-and-infill request in *position* order, and what has been
//! streamed of them.
//!
//! ReFusion commits spans in any order (its buffer is in commit order); a client reads text left
//! to right. A position is *final* once its span is committed (or, reproducing upstream's EOS
//! quirk, dropped). Tokens stream only up to the first position that is not final, so a token is
//! sent once every position before it is final, and the response is cut at the first stop token
//! in position order (included): tokens committed at later positions before it was found are
//! not part of the response. When the canvas is longer than `max_new_tokens` (its length rounded
//! up to whole spans and blocks), the response ends after `max_new_tokens` tokens (`Length`).

use std::collections::BTreeMap;

use wavefront_engine::{FinishReason, TokenLogprob};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum Cell {
    Masked,
    Token(u32),
    /// Never generated (upstream's EOS quirk); streamed as nothing.
    Dropped,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Canvas {
    prompt_len: usize,
    cells: Vec<Cell>,
    stop_token_ids: Vec<u32>,
    /// Generated positions streamed so far (cells before this one are final).
    streamed: usize,
    /// Set once the first stop token in position order was streamed.
    stopped: bool,
    /// Tokens the response may hold (`max_new_tokens`); the canvas may be longer.
    #[serde(default = "unlimited")]
    limit: usize,
    /// Tokens streamed so far (dropped positions are not tokens).
    #[serde(default)]
    released: usize,
    /// The log-probabilities of committed tokens not streamed yet, by cell (requests that
    /// asked for them).
    #[serde(default)]
    scores: BTreeMap<usize, TokenLogprob>,
}

fn unlimited() -> usize {
    usize::MAX
}

impl Canvas {
    pub(crate) fn new(prompt_len: usize, gen_length: usize, stop_token_ids: Vec<u32>) -> Self {
        Self {
            prompt_len,
            cells: vec![Cell::Masked; gen_length],
            stop_token_ids,
            streamed: 0,
            stopped: false,
            limit: gen_length,
            released: 0,
            scores: BTreeMap::new(),
        }
    }

    /// The response ends after `limit` tokens, however long the canvas.
    pub(crate) fn with_limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }

    pub(crate) fn is_stop(&self, token: u32) -> bool {
        self.stop_token_ids.contains(&token)
    }

    /// Records committed tokens at their positions (absolute position ids).
    pub(crate) fn commit(&mut self, positions: &[u32], tokens: &[u32]) {
        for (&p, &t) in positions.iter().zip(tokens) {
            self.cells[p as usize - self.prompt_len] = Cell::Token(t);
        }
    }

    /// Records the log-probabilities of committed tokens at their positions.
    pub(crate) fn commit_scores(&mut self, positions: &[u32], scores: &[TokenLogprob]) {
        for (&p, s) in positions.iter().zip(scores) {
            self.scores.insert(p as usize - self.prompt_len, s.clone());
        }
    }

    /// [`Self::stream`] with the streamed tokens' log-probabilities (one per token) when
    /// `scored`.
    pub(crate) fn stream_scored(
        &mut self,
        scored: bool,
    ) -> (Vec<u32>, Option<Vec<TokenLogprob>>, Option<FinishReason>) {
        let from = self.streamed;
        let (tokens, reason) = self.stream();
        if !scored {
            return (tokens, None, reason);
        }
        let scores = (from..self.streamed)
            .filter(|&i| matches!(self.cells[i], Cell::Token(_)))
            .map(|i| {
                debug_assert!(self.scores.contains_key(&i), "cell {i} streams unscored");
                self.scores.remove(&i).unwrap_or_default()
            })
            .collect();
        (tokens, Some(scores), reason)
    }

    /// Marks positions that will never be generated.
    pub(crate) fn drop_positions(&mut self, positions: impl Iterator<Item = u32>) {
        for p in positions {
            let c = &mut self.cells[p as usize - self.prompt_len];
            if *c == Cell::Masked {
                *c = Cell::Dropped;
            }
        }
    }

    /// Newly final tokens in position order, up to and including the first stop token; with
    /// `StopToken` once that token is among them.
    pub(crate) fn stream(&mut self) -> (Vec<u32>, Option<FinishReason>) {
        let mut out = Vec::new();
        if self.stopped {
            return (out, Some(FinishReason::StopToken));
        }
        if self.released >= self.limit {
            return (out, Some(FinishReason::Length));
        }
        while let Some(&cell) = self.cells.get(self.streamed) {
            match cell {
                Cell::Masked => break,
                Cell::Dropped => self.streamed += 1,
                Cell::Token(t) => {
                    self.streamed += 1;
                    self.released += 1;
                    out.push(t);
                    if self.is_stop(t) {
                        self.stopped = true;
                        return (out, Some(FinishReason::StopToken));
                    }
                    if self.released >= self.limit {
                        return (out, Some(FinishReason::Length));
                    }
                }
            }
        }
        (out, None)
    }

    /// Generated tokens in position order (committed ones only).
    pub(crate) fn tokens(&self) -> Vec<(u32, u32)> {
        self.cells
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match c {
                Cell::Token(t) => Some(((self.prompt_len + i) as u32, *t)),
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_only_behind_the_first_unfinished_position_and_stops_at_a_stop_token() {
        let mut c = Canvas::new(2, 8, vec![9]);
        c.commit(&[6, 7], &[60, 70]);
        assert_eq!(c.stream(), (vec![], None));
        c.commit(&[2, 3], &[20, 30]);
        assert_eq!(c.stream(), (vec![20, 30], None));
        c.drop_positions([4, 5].into_iter());
        assert_eq!(c.stream(), (vec![60, 70], None));
        c.commit(&[8, 9], &[9, 90]);
        assert_eq!(c.stream(), (vec![9], Some(FinishReason::StopToken)));
        assert_eq!(c.stream(), (vec![], Some(FinishReason::StopToken)));
    }

    #[test]
    fn a_canvas_longer_than_the_limit_ends_the_response_at_the_limit() {
        let mut c = Canvas::new(0, 8, vec![9]).with_limit(5);
        c.commit(&[0, 1, 2, 3, 4, 5, 6], &[10, 11, 12, 13, 14, 15, 16]);
        assert_eq!(
            c.stream(),
            (vec![10, 11, 12, 13, 14], Some(FinishReason::Length))
        );
        assert_eq!(c.stream(), (vec![], Some(FinishReason::Length)));
        // A stop token at the limit is a stop.
        let mut c = Canvas::new(0, 8, vec![9]).with_limit(2);
        c.commit(&[0, 1], &[10, 9]);
        assert_eq!(c.stream(), (vec![10, 9], Some(FinishReason::StopToken)));
    }
}
