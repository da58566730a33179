//! The canvas of one masked-diffusion request (LLaDA, Nie et al., 2025): the prompt followed by
//! `gen_length` positions that start as the mask token, decoded block by block from left to
//! right (semi-autoregressive remasking), plus what has been streamed so far.
//!
//! Early stop: the request's stop tokens end the response at the first one. Upstream decodes
//! every position of every block whatever it produced; here a committed stop token cuts the
//! canvas after it (the low-confidence sampler, whose commits are final) so later positions stop
//! costing compute, and blocks past the cut are never decoded. See the module doc of
//! [`super`] for what that changes.

use wavefront_engine::FinishReason;

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Canvas {
    /// Prompt and generation positions (possibly cut after a stop token).
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    pub(crate) block_length: usize,
    /// Index of the block being decoded.
    pub(crate) block: usize,
    pub(crate) mask_id: u32,
    stop_token_ids: Vec<u32>,
    /// Generated tokens already streamed.
    streamed: usize,
    /// The most generated tokens the response may hold (`max_new_tokens`), when the canvas was
    /// rounded up to whole blocks past it; `None`: the whole canvas.
    #[serde(default)]
    limit: Option<usize>,
}

impl Canvas {
    pub(crate) fn new(
        prompt: &[u32],
        gen_length: usize,
        block_length: usize,
        mask_id: u32,
        stop_token_ids: Vec<u32>,
    ) -> Self {
        let mut tokens = Vec::with_capacity(prompt.len() + gen_length);
        tokens.extend_from_slice(prompt);
        tokens.resize(prompt.len() + gen_length, mask_id);
        Self {
            tokens,
            prompt_len: prompt.len(),
            block_length,
            block: 0,
            mask_id,
            stop_token_ids,
            streamed: 0,
            limit: None,
        }
    }

    /// Caps the response at `limit` generated tokens (the canvas stays as long as it is: its
    /// blocks are decoded whole, and what lies past the cap is never streamed).
    pub(crate) fn with_limit(mut self, limit: usize) -> Self {
        if limit < self.len() - self.prompt_len {
            self.limit = Some(limit);
        }
        self
    }

    /// End of the positions that may be streamed: the canvas, or the cap.
    fn stream_end(&self) -> usize {
        self.limit
            .map_or(self.len(), |l| (self.prompt_len + l).min(self.len()))
    }

    pub(crate) fn len(&self) -> usize {
        self.tokens.len()
    }

    pub(crate) fn is_mask(&self, i: usize) -> bool {
        self.tokens[i] == self.mask_id
    }

    pub(crate) fn block_start(&self) -> usize {
        self.prompt_len + self.block * self.block_length
    }

    /// End of the current block (clipped to the canvas).
    pub(crate) fn block_end(&self) -> usize {
        (self.block_start() + self.block_length).min(self.len())
    }

    /// Whether the current block has any position left on the canvas.
    pub(crate) fn has_block(&self) -> bool {
        self.block_start() < self.len()
    }

    /// Blocks (as far as the canvas reaches) that hold no mask.
    pub(crate) fn completed_blocks(&self) -> usize {
        let gen = self.len() - self.prompt_len;
        (0..gen.div_ceil(self.block_length))
            .filter(|b| {
                let start = self.prompt_len + b * self.block_length;
                let end = (start + self.block_length).min(self.len());
                (start..end).all(|i| !self.is_mask(i))
            })
            .count()
    }

    /// Masked positions before the current block's end: upstream's candidates (the current
    /// block's masks, and any mask token the prompt itself carries).
    pub(crate) fn candidates(&self) -> Vec<usize> {
        (0..self.block_end()).filter(|&i| self.is_mask(i)).collect()
    }

    /// Masks inside the current block.
    pub(crate) fn masks_in_block(&self) -> usize {
        (self.block_start()..self.block_end())
            .filter(|&i| self.is_mask(i))
            .count()
    }

    /// The unconditional copy of classifier-free guidance: prompt tokens (upstream
    /// `prompt_index`: prompt positions that are not masks) replaced by the mask token.
    pub(crate) fn unconditional(&self, index: &[u32]) -> Vec<u32> {
        index
            .iter()
            .map(|&i| {
                if (i as usize) < self.prompt_len {
                    self.mask_id
                } else {
                    self.tokens[i as usize]
                }
            })
            .collect()
    }

    pub(crate) fn is_stop(&self, token: u32) -> bool {
        self.stop_token_ids.contains(&token)
    }

    /// The first generated position holding a committed stop token.
    pub(crate) fn first_stop(&self) -> Option<usize> {
        (self.prompt_len..self.len()).find(|&i| !self.is_mask(i) && self.is_stop(self.tokens[i]))
    }

    /// Whether every generated position before `p` is committed.
    pub(crate) fn settled_before(&self, p: usize) -> bool {
        (self.prompt_len..p).all(|i| !self.is_mask(i))
    }

    /// Cuts the canvas after position `p`; returns whether it shrank.
    pub(crate) fn cut_after(&mut self, p: usize) -> bool {
        if p + 1 < self.len() {
            self.tokens.truncate(p + 1);
            true
        } else {
            false
        }
    }

    /// End of the leading run of committed generated positions.
    pub(crate) fn committed_prefix_end(&self) -> usize {
        (self.prompt_len..self.len())
            .find(|&i| self.is_mask(i))
            .unwrap_or(self.len())
    }

    /// End of the positions streamed so far.
    pub(crate) fn streamed_end(&self) -> usize {
        self.prompt_len + self.streamed
    }

    /// Takes the final tokens up to position `upto` (exclusive) that were not streamed yet,
    /// with the finish reason once a stop token is among them (it is included, nothing after
    /// it) or the whole canvas has been streamed.
    pub(crate) fn stream(&mut self, upto: usize) -> (Vec<u32>, Option<FinishReason>) {
        let from = self.prompt_len + self.streamed;
        let upto = upto.min(self.stream_end());
        let mut fresh = Vec::new();
        if upto > from {
            fresh.extend_from_slice(&self.tokens[from..upto]);
            if let Some(k) = fresh.iter().position(|&t| self.is_stop(t)) {
                fresh.truncate(k + 1);
                self.streamed += k + 1;
                return (fresh, Some(FinishReason::StopToken));
            }
            self.streamed = upto - self.prompt_len;
        }
        let done = self.prompt_len + self.streamed >= self.stream_end();
        (fresh, done.then_some(FinishReason::Length))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capped_canvas_streams_up_to_its_cap_and_ends_there() {
        let mut c = Canvas::new(&[1], 8, 4, 99, vec![7]).with_limit(5);
        c.tokens[1..5].copy_from_slice(&[2, 3, 4, 5]);
        assert_eq!(c.stream(c.committed_prefix_end()), (vec![2, 3, 4, 5], None));
        c.tokens[5..9].copy_from_slice(&[6, 7, 8, 9]);
        // Position 6 (a stop token) lies past the cap: the response ends at the cap.
        assert_eq!(
            c.stream(c.committed_prefix_end()),
            (vec![6], Some(FinishReason::Length))
        );
        // A cap at or past the canvas is no cap.
        assert_eq!(
            Canvas::new(&[1], 8, 4, 99, vec![]).with_limit(8).limit,
            None
        );
    }

    #[test]
    fn streams_the_committed_prefix_and_stops_at_a_stop_token() {
        let mut c = Canvas::new(&[1, 2], 6, 3, 99, vec![7]);
        c.tokens[3] = 5;
        assert_eq!(c.committed_prefix_end(), 2);
        assert_eq!(c.stream(c.committed_prefix_end()), (vec![], None));
        c.tokens[2] = 4;
        assert_eq!(c.stream(c.committed_prefix_end()), (vec![4, 5], None));
        c.tokens[5] = 7;
        c.tokens[7] = 8;
        assert_eq!(c.first_stop(), Some(5));
        // Position 4 is still masked: the stop at 5 may not cut the canvas yet.
        assert!(!c.settled_before(5));
        assert!(c.settled_before(4));
        assert!(c.cut_after(5));
        assert_eq!(c.len(), 6);
        c.tokens[4] = 6;
        let (fresh, reason) = c.stream(c.committed_prefix_end());
        assert_eq!((fresh, reason), (vec![6, 7], Some(FinishReason::StopToken)));
    }

    #[test]
    fn blocks_clip_to_a_cut_canvas() {
        let mut c = Canvas::new(&[1], 8, 4, 99, vec![]);
        assert_eq!((c.block_start(), c.block_end()), (1, 5));
        c.cut_after(2);
        assert_eq!(c.block_end(), 3);
        c.block = 1;
        assert!(!c.has_block());
        assert_eq!(c.unconditional(&[0, 1, 2]), vec![99, 99, 99]);
    }
}
