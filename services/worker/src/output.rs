//! From engine events to what a client reads: text deltas and a final result.
//!
//! Text is decoded incrementally (a delta is emitted only once it no longer
//! ends in an incomplete UTF-8 sequence) and checked against the request's
//! stop strings. Text that could still turn into a stop string is held back,
//! so a streamed client never sees text that the final result cuts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use wavefront_engine::{
    CanvasFrame, EngineError, Event, EventSink, FinishReason, SinkError, Stats, TokenLogprob,
};
use wavefront_schemes::{GenerateSpec, ServedModel};

/// What one batch of tokens produced for the client.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Delta {
    pub token_ids: Vec<u32>,
    /// One per token of `token_ids` when the request asked for log-probabilities.
    pub logprobs: Vec<TokenLogprob>,
    pub text: String,
    /// A stop string matched: the request is over.
    pub stopped: bool,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// With prompt scoring: the prompt's ids and their entries (one each).
    pub prompt: Option<(Vec<u32>, Vec<TokenLogprob>)>,
    pub token_ids: Vec<u32>,
    /// One per token of `token_ids` when the request asked for log-probabilities.
    pub logprobs: Vec<TokenLogprob>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub stats: Stats,
    pub seed: u64,
}

/// Accumulates tokens and text for one request.
pub struct OutputAssembler {
    stop_strings: Vec<String>,
    ids: Vec<u32>,
    /// Decoded text of `ids[..read]` that is final.
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
    /// Decoding window: ids from `prefix` on are re-decoded together.
    prefix: usize,
    read: usize,
    stopped: bool,
    hold_back: usize,
    /// The text leaves out special tokens.
    skip_special: bool,
    /// The log-probabilities of `ids` (requests that asked for them).
    logprobs: Vec<TokenLogprob>,
    /// With prompt scoring: the prompt's ids, and their entries once the engine sent them.
    prompt: Option<(Vec<u32>, Vec<TokenLogprob>)>,
}

impl OutputAssembler {
    pub fn new(stop_strings: Vec<String>, skip_special: bool) -> Self {
        let hold_back = stop_strings
            .iter()
            .map(|s| s.len())
            .max()
            .unwrap_or(0)
            .saturating_sub(1);
        Self {
            stop_strings,
            ids: Vec::new(),
            text: String::new(),
            emitted: 0,
            prefix: 0,
            read: 0,
            stopped: false,
            hold_back,
            skip_special,
            logprobs: Vec::new(),
            prompt: None,
        }
    }

    /// Expects the prompt's log-probabilities (the request set `prompt_logprobs`).
    pub fn scoring_prompt(mut self, prompt_ids: Vec<u32>) -> Self {
        self.prompt = Some((prompt_ids, Vec::new()));
        self
    }

    /// Whether the text leaves out special tokens.
    pub fn skip_special(&self) -> bool {
        self.skip_special
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Its state, for the worker a request moves to ([`Self::restore`]).
    pub fn snapshot(&self) -> wavefront_proto::worker::v1::OutputState {
        wavefront_proto::worker::v1::OutputState {
            stop_strings: self.stop_strings.clone(),
            token_ids: self.ids.clone(),
            text: self.text.clone(),
            emitted: self.emitted as u64,
            prefix: self.prefix as u64,
            read: self.read as u64,
            messages: 0,
            keep_special_tokens: !self.skip_special,
            logprobs: state_logprobs(&self.ids, &self.logprobs),
            prompt_logprobs: self
                .prompt
                .as_ref()
                .map(|(ids, lps)| state_logprobs(ids, lps))
                .unwrap_or_default(),
        }
    }

    /// An assembler that continues where [`Self::snapshot`] left off; `None` for an
    /// inconsistent state.
    pub fn restore(s: wavefront_proto::worker::v1::OutputState) -> Option<Self> {
        let mut out = Self::new(s.stop_strings, !s.keep_special_tokens);
        if !s.logprobs.is_empty() && s.logprobs.len() != s.token_ids.len() {
            return None;
        }
        out.logprobs = s
            .logprobs
            .into_iter()
            .map(|lp| engine_logprob(lp).1)
            .collect();
        if !s.prompt_logprobs.is_empty() {
            out.prompt = Some(s.prompt_logprobs.into_iter().map(engine_logprob).unzip());
        }
        let (emitted, prefix, read) = (
            usize::try_from(s.emitted).ok()?,
            usize::try_from(s.prefix).ok()?,
            usize::try_from(s.read).ok()?,
        );
        if emitted > s.text.len()
            || !s.text.is_char_boundary(emitted)
            || prefix > read
            || read > s.token_ids.len()
        {
            return None;
        }
        out.ids = s.token_ids;
        out.text = s.text;
        out.emitted = emitted;
        out.prefix = prefix;
        out.read = read;
        Some(out)
    }

    pub fn token_ids(&self) -> &[u32] {
        &self.ids
    }

    /// The log-probabilities of [`Self::token_ids`] (empty when the request asked for none).
    pub fn logprobs(&self) -> &[TokenLogprob] {
        &self.logprobs
    }

    /// Adds the log-probabilities of the tokens [`Self::push`] took next.
    fn push_logprobs(&mut self, lp: &[TokenLogprob]) {
        self.logprobs.extend_from_slice(lp);
    }

    /// Adds newly final tokens; `decode` turns ids into text.
    pub fn push(&mut self, new: &[u32], decode: &dyn Fn(&[u32]) -> String) -> Delta {
        if self.stopped {
            return Delta {
                stopped: true,
                ..Delta::default()
            };
        }
        self.ids.extend_from_slice(new);
        // Decode the window; emit once it does not end mid-character.
        let prev = decode(&self.ids[self.prefix..self.read]);
        let full = decode(&self.ids[self.prefix..]);
        if full.len() > prev.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prev) {
            self.text.push_str(&full[prev.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        let mut search_from = self.emitted.saturating_sub(self.hold_back);
        while !self.text.is_char_boundary(search_from) {
            search_from -= 1;
        }
        let hit = self
            .stop_strings
            .iter()
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|i| i + search_from)
            })
            .min();
        if let Some(cut) = hit {
            self.text.truncate(cut);
            self.stopped = true;
            let text = self.text.get(self.emitted..).unwrap_or("").to_owned();
            self.emitted = self.text.len();
            return Delta {
                token_ids: new.to_vec(),
                text,
                stopped: true,
                ..Delta::default()
            };
        }
        let mut safe = self
            .text
            .len()
            .saturating_sub(self.hold_back)
            .max(self.emitted);
        while !self.text.is_char_boundary(safe) {
            safe -= 1;
        }
        let text = self.text[self.emitted..safe].to_owned();
        self.emitted = safe;
        Delta {
            token_ids: new.to_vec(),
            text,
            ..Delta::default()
        }
    }

    /// At the end: decode whatever is left (even an incomplete character) and
    /// hand out the held-back text.
    pub fn finish(&mut self, decode: &dyn Fn(&[u32]) -> String) -> String {
        if !self.stopped && self.read < self.ids.len() {
            let prev = decode(&self.ids[self.prefix..self.read]);
            let full = decode(&self.ids[self.prefix..]);
            self.text.push_str(full.get(prev.len()..).unwrap_or(&full));
            self.read = self.ids.len();
        }
        let rest = self.text.get(self.emitted..).unwrap_or("").to_owned();
        self.emitted = self.text.len();
        rest
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// Stats of a request a stop string ended, from the engine's figures when it sent them
    /// (`Stats::default()` otherwise): the generated tokens are the ones the response kept
    /// (the engine may have made a few more before it saw the stop).
    pub fn stopped_stats(&self, engine: Stats) -> Stats {
        let mut stats = Stats {
            generated_tokens: self.ids.len() as u32,
            ..engine
        };
        stats.add_counter("stopped_by_string", 1);
        stats
    }
}

/// Entries for an [`wavefront_proto::worker::v1::OutputState`]: ids and values, no texts.
fn state_logprobs(ids: &[u32], lps: &[TokenLogprob]) -> Vec<wavefront_proto::v1::TokenLogprob> {
    lps.iter()
        .zip(ids)
        .map(|(lp, &id)| wavefront_proto::v1::TokenLogprob {
            token_id: id,
            logprob: lp.logprob,
            token: String::new(),
            top_logprobs: lp
                .top
                .iter()
                .map(|&(token_id, logprob)| wavefront_proto::v1::TopLogprob {
                    token_id,
                    logprob,
                    token: String::new(),
                })
                .collect(),
        })
        .collect()
}

/// An entry of an [`wavefront_proto::worker::v1::OutputState`] back as (id, engine entry).
fn engine_logprob(lp: wavefront_proto::v1::TokenLogprob) -> (u32, TokenLogprob) {
    (
        lp.token_id,
        TokenLogprob {
            logprob: lp.logprob,
            top: lp
                .top_logprobs
                .into_iter()
                .map(|t| (t.token_id, t.logprob))
                .collect(),
        },
    )
}

/// Decoder closure for a model, special tokens left out when `skip_special` (no tokenizer:
/// empty text).
pub fn decoder(model: &dyn ServedModel, skip_special: bool) -> impl Fn(&[u32]) -> String + '_ {
    move |ids: &[u32]| model.decode_text(ids, skip_special)
}

/// What an engine event means to the client once text is assembled and stop strings applied.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Newly final tokens and the text they complete (the held-back text at the end comes as a
    /// delta with no tokens).
    Delta(Delta),
    /// A view of the canvas (requests that asked for one).
    Canvas(CanvasFrame),
    /// The prompt's ids and entries (requests that asked to score it), before any token.
    Prompt(Vec<u32>, Vec<TokenLogprob>),
    /// The request stopped at a step boundary to move to another worker.
    Parked,
    /// The response is complete.
    Done(Finished),
    /// The request failed.
    Failed(EngineError),
}

/// One request's response, assembled from its engine events: the one place text deltas, stop
/// strings and the final response are decided. The gRPC stream ([`crate::stream`]), the unary
/// call (the stream collected) and the offline `wavefront run` ([`generate_blocking`]) are
/// sinks of its [`Reply`]s.
pub struct Assembly {
    pub(crate) out: OutputAssembler,
    /// Raised when a stop string ended the text: the engine finishes the request at its next
    /// step and sends its statistics.
    stop: Arc<AtomicBool>,
    seed: u64,
    ended: bool,
    /// The log-probabilities of the `Tokens` event to come.
    scored: Option<Vec<TokenLogprob>>,
}

impl Assembly {
    pub fn new(out: OutputAssembler, stop: Arc<AtomicBool>, seed: u64) -> Self {
        Self {
            out,
            stop,
            seed,
            ended: false,
            scored: None,
        }
    }

    pub fn output(&self) -> &OutputAssembler {
        &self.out
    }

    fn done(&mut self, finish_reason: FinishReason, stats: Stats) -> Reply {
        self.ended = true;
        Reply::Done(Finished {
            prompt: self.out.prompt.clone(),
            token_ids: self.out.token_ids().to_vec(),
            logprobs: self.out.logprobs().to_vec(),
            text: self.out.text().to_owned(),
            finish_reason,
            stats,
            seed: self.seed,
        })
    }

    /// The replies `event` makes; `None` is an engine that went away.
    pub fn on_event(
        &mut self,
        event: Option<Event>,
        decode: &dyn Fn(&[u32]) -> String,
    ) -> Vec<Reply> {
        if self.ended {
            return Vec::new();
        }
        let stopped = self.out.is_stopped();
        match event {
            // Tokens and frames the engine made before it saw the stop are not the response's.
            Some(Event::Tokens(_) | Event::Canvas(_) | Event::Logprobs(_)) if stopped => Vec::new(),
            Some(Event::PromptLogprobs(lp)) => match &mut self.out.prompt {
                Some((ids, scores)) => {
                    *scores = lp.clone();
                    vec![Reply::Prompt(ids.clone(), lp)]
                }
                None => Vec::new(),
            },
            Some(Event::Logprobs(lp)) => {
                self.scored = Some(lp);
                Vec::new()
            }
            Some(Event::Tokens(ids)) => {
                let mut delta = self.out.push(&ids, decode);
                if let Some(lp) = self.scored.take() {
                    self.out.push_logprobs(&lp);
                    delta.logprobs = lp;
                }
                if delta.stopped {
                    self.stop.store(true, Ordering::Release);
                }
                vec![Reply::Delta(delta)]
            }
            Some(Event::Canvas(frame)) => vec![Reply::Canvas(frame)],
            Some(Event::Parked) => vec![Reply::Parked],
            Some(Event::Finished { stats, .. }) if stopped => {
                let stats = self.out.stopped_stats(stats);
                vec![self.done(FinishReason::StopString, stats)]
            }
            // The response was complete when the request failed or the engine went away.
            Some(Event::Failed(_)) | None if stopped => {
                let stats = self.out.stopped_stats(Stats::default());
                vec![self.done(FinishReason::StopString, stats)]
            }
            Some(Event::Finished { reason, stats }) => {
                let rest = self.out.finish(decode);
                let mut replies = Vec::with_capacity(2);
                if !rest.is_empty() {
                    replies.push(Reply::Delta(Delta {
                        text: rest,
                        ..Delta::default()
                    }));
                }
                replies.push(self.done(reason, stats));
                replies
            }
            Some(Event::Failed(e)) => {
                self.ended = true;
                vec![Reply::Failed(e)]
            }
            None => {
                self.ended = true;
                vec![Reply::Failed(EngineError::ShutDown)]
            }
        }
    }
}

/// A sink over a bounded std channel, for callers without an async runtime, with the flags
/// that say the caller left (`closed`) or that a stop string ended the response (`stop`).
struct StdSink {
    tx: mpsc::SyncSender<Event>,
    closed: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl EventSink for StdSink {
    fn try_send(&mut self, event: Event) -> Result<(), (SinkError, Event)> {
        self.tx.try_send(event).map_err(|e| match e {
            mpsc::TrySendError::Full(ev) => (SinkError::Full, ev),
            mpsc::TrySendError::Disconnected(ev) => (SinkError::Closed, ev),
        })
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
    fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// Runs one request to completion on `model` without any server (the
/// offline `wavefront run` path); `on_delta` sees every streamed delta and `on_canvas` every
/// canvas frame (sent only when `spec.stream_canvas`).
pub fn generate_blocking(
    model: &dyn ServedModel,
    spec: GenerateSpec,
    stop_strings: Vec<String>,
    skip_special: bool,
    timeout: Option<Duration>,
    mut on_delta: impl FnMut(&Delta),
    mut on_canvas: impl FnMut(&CanvasFrame),
) -> Result<Finished, EngineError> {
    let (tx, rx) = mpsc::sync_channel(256);
    let closed = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let seed = spec.sampling.seed;
    let scored_prompt = spec
        .sampling
        .prompt_logprobs
        .map(|_| spec.prompt_ids.clone());
    let deadline = timeout.map(|t| Instant::now() + t);
    let sink = StdSink {
        tx,
        closed: closed.clone(),
        stop: stop.clone(),
    };
    model.submit(spec, Box::new(sink), deadline, tracing::Span::current())?;
    let decode = decoder(model, skip_special);
    let out = OutputAssembler::new(stop_strings, skip_special);
    let out = match scored_prompt {
        Some(ids) => out.scoring_prompt(ids),
        None => out,
    };
    let mut response = Assembly::new(out, stop, seed);
    loop {
        let event = rx.recv().ok();
        if event.is_none() {
            closed.store(true, Ordering::Release);
        }
        for reply in response.on_event(event, &decode) {
            match reply {
                Reply::Delta(d) => on_delta(&d),
                Reply::Canvas(frame) => on_canvas(&frame),
                // The final result carries the prompt's entries.
                Reply::Prompt(..) => {}
                // Nothing offline exports a request.
                Reply::Parked => {}
                Reply::Done(finished) => return Ok(finished),
                Reply::Failed(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A toy "tokenizer": id n decodes to the n-th char of this table; ids
    // 100/101 are the two halves of a multi-byte character.
    fn decode(ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &i in ids {
            match i {
                100 => bytes.extend_from_slice(&[0xC3]),
                101 => bytes.extend_from_slice(&[0xA9]),
                n => bytes.push(b'a' + (n as u8 % 26)),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    #[test]
    fn multibyte_characters_are_not_split() {
        let mut a = OutputAssembler::new(vec![], false);
        let d1 = a.push(&[0], &decode);
        let d2 = a.push(&[100], &decode);
        let d3 = a.push(&[101], &decode);
        assert_eq!(d1.text, "a");
        assert_eq!(d2.text, "");
        assert_eq!(d3.text, "é");
        assert_eq!(a.finish(&decode), "");
        assert_eq!(a.text(), "aé");
    }

    #[test]
    fn stop_strings_cut_the_text_and_held_back_text_is_never_streamed_past_the_cut() {
        let mut a = OutputAssembler::new(vec!["cd".into()], false);
        let mut streamed = String::new();
        for id in [0u32, 1, 2, 3, 4] {
            let d = a.push(&[id], &decode);
            streamed.push_str(&d.text);
            if d.stopped {
                break;
            }
        }
        assert!(a.is_stopped());
        assert_eq!(a.text(), "ab");
        assert_eq!(streamed, "ab");
        assert_eq!(a.token_ids(), &[0, 1, 2, 3]);
    }

    #[test]
    fn streamed_deltas_concatenate_to_the_final_text() {
        let mut a = OutputAssembler::new(vec!["zz".into()], false);
        let mut streamed = String::new();
        for id in [0u32, 1, 100, 101, 2, 3] {
            streamed.push_str(&a.push(&[id], &decode).text);
        }
        streamed.push_str(&a.finish(&decode));
        assert_eq!(streamed, a.text());
        assert_eq!(a.text(), "abécd");
    }

    fn lp(v: f32) -> TokenLogprob {
        TokenLogprob {
            logprob: v,
            top: vec![(1, v), (2, v - 1.0)],
        }
    }

    /// Log-probabilities stay aligned with the token ids: each `Logprobs` event goes with the
    /// `Tokens` event after it, the chunk that completes a stop string keeps its entries as it
    /// keeps its ids, what the engine made after the stop is dropped with its tokens, and a
    /// request moved to another worker continues with its entries.
    #[test]
    fn log_probabilities_follow_their_tokens_through_stops_and_moves() {
        let stop = Arc::new(AtomicBool::new(false));
        let mut a = Assembly::new(OutputAssembler::new(vec!["cd".into()], false), stop, 0);
        let deltas = |r: Vec<Reply>| -> Vec<Delta> {
            r.into_iter()
                .filter_map(|r| match r {
                    Reply::Delta(d) => Some(d),
                    _ => None,
                })
                .collect()
        };
        assert!(a
            .on_event(Some(Event::Logprobs(vec![lp(-0.5), lp(-0.25)])), &decode)
            .is_empty());
        let d = deltas(a.on_event(Some(Event::Tokens(vec![0, 1])), &decode));
        assert_eq!(d[0].logprobs, vec![lp(-0.5), lp(-0.25)]);
        // Moved: the next worker's assembler has the entries so far.
        let moved = OutputAssembler::restore(a.output().snapshot()).expect("restores");
        assert_eq!(moved.logprobs(), &[lp(-0.5), lp(-0.25)]);
        let mut a = Assembly::new(moved, Arc::new(AtomicBool::new(false)), 0);
        a.on_event(Some(Event::Logprobs(vec![lp(-1.0), lp(-2.0)])), &decode);
        // "c" then "d": the stop string completes in this chunk, which keeps both entries.
        let d = deltas(a.on_event(Some(Event::Tokens(vec![2, 3])), &decode));
        assert!(d[0].stopped);
        assert_eq!(d[0].token_ids, vec![2, 3]);
        assert_eq!(d[0].logprobs, vec![lp(-1.0), lp(-2.0)]);
        // After the stop, the engine's late tokens and their entries are not the response's.
        a.on_event(Some(Event::Logprobs(vec![lp(-3.0)])), &decode);
        a.on_event(Some(Event::Tokens(vec![4])), &decode);
        let done = a.on_event(
            Some(Event::Finished {
                reason: FinishReason::Length,
                stats: Stats::default(),
            }),
            &decode,
        );
        let Some(Reply::Done(f)) = done.last() else {
            panic!("{done:?}")
        };
        assert_eq!(f.token_ids, vec![0, 1, 2, 3]);
        assert_eq!(f.logprobs, vec![lp(-0.5), lp(-0.25), lp(-1.0), lp(-2.0)]);
        // A state whose entries do not match its tokens is refused.
        let mut bad = a.output().snapshot();
        bad.logprobs.pop();
        assert!(OutputAssembler::restore(bad).is_none());
    }
}
