//! What the engine sends back for a request ([`Event`]), and where a program puts it during a
//! tick ([`Outbox`]).

use crate::error::{EngineError, FamilyError};
use crate::stats::Stats;

/// Why a request finished normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// A stop token (or the model's end-of-sequence token) was produced.
    StopToken,
    /// A stop string appeared in the text (decided by the transport layer).
    StopString,
    /// The model's context limit was reached.
    ContextLimit,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::StopToken => "stop_token",
            FinishReason::StopString => "stop_string",
            FinishReason::ContextLimit => "context_limit",
        }
    }
}

/// A final token's log-probability under the distribution it was committed from, with the
/// most likely alternatives under the same distribution (most likely first, ties by id).
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// The entry of a token that has no value (NaN, no alternatives).
    pub fn unscored() -> Self {
        Self {
            logprob: f32::NAN,
            top: Vec::new(),
        }
    }
}

/// What the engine sends back for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Newly final tokens, in position order.
    Tokens(Vec<u32>),
    /// The log-probabilities of the tokens of the `Tokens` event that follows it, one per token
    /// (sent only when the request asked for them).
    Logprobs(Vec<TokenLogprob>),
    /// The prompt's log-probabilities, one per prompt token (NaN where a token has none: the
    /// first; a masked-diffusion condition), sent once, before any token (only when the request
    /// asked for them).
    PromptLogprobs(Vec<TokenLogprob>),
    /// A view of the request's canvas, for clients that watch the decoding (sent only when the
    /// request asked for it). Positions count from the first generated position.
    Canvas(CanvasFrame),
    /// The request finished; its slots are back in the pool.
    Finished { reason: FinishReason, stats: Stats },
    /// The request failed; its slots are back in the pool.
    Failed(EngineError),
    /// The request stopped at a step boundary to be exported ([`crate::EngineHandle::export`]):
    /// every event before this one was its last on this worker unless the move is called off
    /// ([`crate::EngineHandle::finish_export`]), when its events go on after it. A moved
    /// request ends with `Failed(EngineError::Moved)`.
    Parked,
}

/// What a canvas position holds at the time of a [`CanvasFrame`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CellState {
    /// Still the mask token.
    Masked,
    /// A token that may still change (a WINO draft, which verification can revoke).
    Drafted,
    /// A final token.
    Committed,
    /// A final token whose rows are no longer computed (SureLock).
    Locked,
}

/// Canvas positions with their tokens and states: either the whole generated region (`full`,
/// masked diffusion after every step) or the positions one step made final, in the order the
/// decoder committed them (slot diffusion's spans, committed out of order).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CanvasFrame {
    /// Positions relative to the first generated position.
    pub positions: Vec<u32>,
    /// Token at each position (the mask token where masked).
    pub tokens: Vec<u32>,
    pub states: Vec<CellState>,
    /// Whether `positions` covers the whole generated region (a snapshot) rather than an
    /// update.
    pub full: bool,
    /// The request's decoding step (forward passes so far).
    pub step: u32,
}

/// Where a program puts what it produced during a tick.
#[derive(Debug, Default)]
pub struct Outbox {
    pub(crate) events: Vec<Event>,
    pub(crate) done: bool,
}

impl Outbox {
    /// Streams newly final tokens.
    pub fn tokens(&mut self, ids: Vec<u32>) {
        if !ids.is_empty() && !self.done {
            self.events.push(Event::Tokens(ids));
        }
    }

    /// Streams newly final tokens with their log-probabilities (`None`: the request asked for
    /// none). One entry per token.
    pub fn scored_tokens(&mut self, ids: Vec<u32>, logprobs: Option<Vec<TokenLogprob>>) {
        if ids.is_empty() || self.done {
            return;
        }
        if let Some(lp) = logprobs {
            debug_assert_eq!(lp.len(), ids.len(), "one log-probability per token");
            self.events.push(Event::Logprobs(lp));
        }
        self.events.push(Event::Tokens(ids));
    }

    /// Sends the prompt's log-probabilities (one per prompt token).
    pub fn prompt_logprobs(&mut self, scored: Vec<TokenLogprob>) {
        if !self.done {
            self.events.push(Event::PromptLogprobs(scored));
        }
    }

    /// Sends a canvas view (the program decides whether its request asked for one).
    pub fn canvas(&mut self, frame: CanvasFrame) {
        if !frame.positions.is_empty() && !self.done {
            self.events.push(Event::Canvas(frame));
        }
    }

    /// Ends the request normally. The engine fills in the timing fields.
    pub fn finish(&mut self, reason: FinishReason, stats: Stats) {
        if !self.done {
            self.events.push(Event::Finished { reason, stats });
            self.done = true;
        }
    }

    /// Ends the request with an error that concerns only this request.
    pub fn fail(&mut self, error: FamilyError) {
        if !self.done {
            self.events
                .push(Event::Failed(EngineError::StepFailed(error)));
            self.done = true;
        }
    }

    /// Ends a request that moved to another worker: what it had not delivered here is dropped.
    pub(crate) fn moved(&mut self) {
        self.events.clear();
        self.events.push(Event::Failed(EngineError::Moved));
        self.done = true;
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The events put here since the engine last delivered (what a commit produced: for
    /// tests of programs on fake outputs).
    pub fn events(&self) -> &[Event] {
        &self.events
    }
}
