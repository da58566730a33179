//! The seam the services use: what clients may know of a served model ([`ModelInfo`]), how a
//! family validates requests ([`Planner`]), and a served model behind its engine whatever its
//! family ([`ServedModel`]). Loading lives in
//! [`crate::registry`], the engine start in [`crate::launch`].

use std::time::Instant;

use wavefront_engine::{
    Carried, EngineError, EngineLoad, EventSink, ExportReply, Prepared, RequestError, RequestId,
};
use wavefront_models::{ChatMessage, TextTokenizer};

use crate::request::GenerateSpec;
use crate::SchemeError;

/// What clients may know about a served model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub name: String,
    /// The family's name ([`wavefront_models::ModelFamily::name`]).
    pub family: &'static str,
    pub schemes: Vec<&'static str>,
    pub vocab_size: usize,
    /// Longest prompt + max_new_tokens accepted.
    pub max_context: usize,
}

/// Validates requests for one model and builds their programs; runs on the
/// caller's thread so bad input is answered before anything is queued.
pub trait Planner: Send + Sync + 'static {
    /// A request's program; its serde form is its state when it moves between workers
    /// ([`crate::migrate`]).
    type Program: Send + serde::de::DeserializeOwned + 'static;
    fn info(&self) -> &ModelInfo;
    fn prepare(&self, spec: GenerateSpec) -> Result<Prepared<Self::Program>, RequestError>;
    /// Turns prompt text into ids the way the model's reference code does.
    fn encode_prompt(
        &self,
        tokenizer: &TextTokenizer,
        text: &str,
    ) -> Result<Vec<u32>, SchemeError> {
        Ok(tokenizer.encode(text, true)?)
    }
    /// The checkpoint's end-of-sequence ids (empty: it names none).
    fn eos_token_ids(&self) -> Vec<u32> {
        Vec::new()
    }
}

/// A model being served, independent of its family.
pub trait ServedModel: Send + Sync {
    fn info(&self) -> &ModelInfo;
    fn tokenizer(&self) -> Option<&TextTokenizer>;
    /// Prompt text to ids (the family's convention for special tokens).
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, SchemeError>;
    /// A conversation to ids through the model's chat template.
    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, SchemeError> {
        Ok(self
            .tokenizer()
            .ok_or_else(no_tokenizer)?
            .encode_chat(messages)?)
    }
    /// The fewest tokens a text prompt can become, known without tokenizing it (0 without a
    /// tokenizer).
    fn min_prompt_tokens(&self, text: &str) -> usize {
        self.tokenizer().map_or(0, |t| t.min_tokens(text))
    }
    /// The fewest tokens a conversation of messages with these contents can become through
    /// the chat template, known without rendering it (0 without a tokenizer).
    fn min_chat_tokens(&self, contents: &[&str]) -> usize {
        self.tokenizer()
            .map_or(0, |t| t.min_chat_tokens(contents.iter().copied()))
    }
    /// The fewest tokens the chat template adds, once per conversation and per message (0 and
    /// 0 without a tokenizer or a template): what a router can bound a chat by without the
    /// tokenizer.
    fn chat_overhead(&self) -> (usize, usize) {
        self.tokenizer().map_or((0, 0), |t| t.chat_overhead())
    }
    /// Ids to text, special tokens kept (empty without a tokenizer).
    fn decode(&self, ids: &[u32]) -> String;
    /// The checkpoint's end-of-sequence ids (empty: it names none).
    fn eos_token_ids(&self) -> Vec<u32> {
        Vec::new()
    }
    /// `c` compiled for this model's vocabulary; the error says why it cannot be.
    fn guide(
        &self,
        _c: &crate::constraint::Constraint,
    ) -> Result<crate::constraint::Guide, String> {
        Err("this model does not serve structured outputs".into())
    }
    /// Ids to text, special tokens left out when `skip_special` (empty without a tokenizer).
    fn decode_text(&self, ids: &[u32], skip_special: bool) -> String {
        self.tokenizer()
            .and_then(|t| t.decode(ids, skip_special).ok())
            .unwrap_or_default()
    }
    /// Validates and queues a request; events arrive through `sink`.
    fn submit(
        &self,
        spec: GenerateSpec,
        sink: Box<dyn EventSink>,
        deadline: Option<Instant>,
        span: tracing::Span,
    ) -> Result<RequestId, EngineError>;
    fn load(&self) -> EngineLoad;
    /// Whether the admission queue has a place now (`Err(QueueFull)` if not): checked before a
    /// request is converted, so shedding a flood costs no tokenizing.
    fn check_room(&self) -> Result<(), EngineError> {
        Ok(())
    }
    /// Fails everything in flight and stops the engine thread.
    fn shutdown(&self);

    /// What a request's state must match to move here from another worker, or to leave for one:
    /// the checkpoint's fingerprint and the settings that shape the state and its numerics
    /// (dtype, weight storage, attention path, tensor parallelism, page size, device kind).
    /// Waits for the fingerprint on first use (it reads every weight byte once).
    fn migration_key(&self) -> Result<String, SchemeError> {
        Err(SchemeError::Unsupported(
            "this model cannot move requests between workers".into(),
        ))
    }

    /// Stops running request `id` at its next step boundary and exports its state
    /// (`EngineHandle::export`); blocks while the engine's command channel is full.
    fn export(&self, _id: RequestId, reply: ExportReply) {
        reply(Err(EngineError::CannotMove(
            "this model cannot move requests between workers".into(),
        )));
    }

    /// Settles the move of exported request `id` (`EngineHandle::finish_export`).
    fn finish_export(
        &self,
        _id: RequestId,
        _moved: bool,
        reply: Box<dyn FnOnce(Result<(), EngineError>) + Send>,
    ) {
        reply(Err(EngineError::CannotMove(
            "this model cannot move requests between workers".into(),
        )));
    }

    /// Queues a request exported by another worker (`state`, what [`ServedModel::export`]
    /// produced there; `carried`, what that engine counted) to resume here; events arrive
    /// through `sink` as for [`ServedModel::submit`].
    fn import(
        &self,
        _state: &[u8],
        _carried: Carried,
        _sink: Box<dyn EventSink>,
        _deadline: Option<Instant>,
        _span: tracing::Span,
    ) -> Result<RequestId, EngineError> {
        Err(EngineError::CannotMove(
            "this model cannot move requests between workers".into(),
        ))
    }
}

/// The refusal of a text prompt by a model without a tokenizer.
pub(crate) fn no_tokenizer() -> SchemeError {
    SchemeError::Prompt("this model has no tokenizer; send token ids".into())
}

/// The refusal of a chat of `messages` messages whose template and contents make at least
/// `at_least` tokens, more than the model's `max_context`, from the model before rendering it:
/// the words of `wavefront_proto::limits::chat_too_long`, which the worker and the router
/// answer with before (this crate does not depend on the proto; the worker's tests hold the
/// two equal).
pub fn chat_too_long(messages: usize, at_least: usize, max_context: usize) -> String {
    format!(
        "the conversation's {messages} messages make at least {at_least} tokens through the chat \
         template, more than the {max_context} this model accepts (prompt plus max_new_tokens); \
         send fewer or shorter messages"
    )
}
