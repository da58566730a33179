//! Per-request limits a worker enforces before it does work proportional to a request.
//!
//! The message size is the transport's (`WorkerConfig::max_message_bytes`); these bound what a
//! message may ask for. Everything here is checked on the request's fields alone, before
//! tokenizing or rendering a template (the prompt-token bound of a text prompt uses the
//! tokenizer's cheap lower bound, [`ServedModel::min_prompt_tokens`]); the exact prompt length is
//! checked again once the prompt is tokenized. Each refusal is INVALID_ARGUMENT and names the
//! field, the limit and the flag that sets it.

use tonic::Status;
use wavefront_proto::limits;
use wavefront_proto::v1 as pb;
use wavefront_schemes::ServedModel;

/// Default of `--max-new-tokens-limit`.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 4096;
/// Default of `--max-stop-sequences` (stop strings and stop token ids, each).
pub const DEFAULT_MAX_STOP_SEQUENCES: usize = 16;
/// Default of `--max-stop-string-bytes`.
pub const DEFAULT_MAX_STOP_STRING_BYTES: usize = 256;
/// Default of `--max-chat-messages`.
pub const DEFAULT_MAX_CHAT_MESSAGES: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Longest prompt in tokens; `None`: the model's context limit.
    pub max_prompt_tokens: Option<usize>,
    /// Largest `max_new_tokens` a request may ask for.
    pub max_new_tokens: usize,
    /// Most `stop_strings`, and most `stop_token_ids`, in one request.
    pub max_stop_sequences: usize,
    /// Longest stop string in bytes.
    pub max_stop_string_bytes: usize,
    /// Most messages in one chat prompt.
    pub max_chat_messages: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_prompt_tokens: None,
            max_new_tokens: DEFAULT_MAX_NEW_TOKENS,
            max_stop_sequences: DEFAULT_MAX_STOP_SEQUENCES,
            max_stop_string_bytes: DEFAULT_MAX_STOP_STRING_BYTES,
            max_chat_messages: DEFAULT_MAX_CHAT_MESSAGES,
        }
    }
}

impl RequestLimits {
    /// The checks that need no tokenizer: counts and sizes of the request's fields.
    pub fn check_fields(
        &self,
        req: &pb::GenerateRequest,
        model: &dyn ServedModel,
    ) -> Result<(), Status> {
        let bad = |m: String| Err(Status::invalid_argument(m));
        if req.n.is_some_and(|n| n != 1) {
            return bad(format!(
                "n = {} completions are served by the router (each is one request to a \
                 worker); a worker serves one: leave n unset",
                req.n.unwrap_or(1)
            ));
        }
        if req.max_new_tokens as usize > self.max_new_tokens {
            return bad(format!(
                "max_new_tokens {} is above this worker's limit of {} (--max-new-tokens-limit); \
                 ask for fewer",
                req.max_new_tokens, self.max_new_tokens
            ));
        }
        if req.stop_strings.len() > self.max_stop_sequences {
            return bad(format!(
                "{} stop_strings are more than the {} allowed (--max-stop-sequences)",
                req.stop_strings.len(),
                self.max_stop_sequences
            ));
        }
        if req.stop_token_ids.len() > self.max_stop_sequences {
            return bad(format!(
                "{} stop_token_ids are more than the {} allowed (--max-stop-sequences)",
                req.stop_token_ids.len(),
                self.max_stop_sequences
            ));
        }
        if let Some((i, s)) = req
            .stop_strings
            .iter()
            .enumerate()
            .find(|(_, s)| s.len() > self.max_stop_string_bytes)
        {
            return bad(format!(
                "stop_strings[{i}] is {} bytes, more than the {} allowed (--max-stop-string-bytes)",
                s.len(),
                self.max_stop_string_bytes
            ));
        }
        if let Some(i) = req.stop_strings.iter().position(String::is_empty) {
            return bad(format!("stop_strings[{i}] is empty"));
        }
        use pb::generate_request::Prompt;
        // A chat's count, and its lower bound (the template's tokens per message count too)
        // against the model's context: here, before the chat is copied, converted or rendered,
        // so that a conversation of many empty messages costs the server little more than
        // decoding it.
        let chat_at_least = match &req.prompt {
            Some(Prompt::Chat(c)) => {
                if c.messages.len() > self.max_chat_messages {
                    return bad(limits::too_many_chat_messages(
                        c.messages.len(),
                        self.max_chat_messages,
                    ));
                }
                let contents: Vec<&str> = c.messages.iter().map(|m| m.content.as_str()).collect();
                let at_least = model.min_chat_tokens(&contents);
                let max_context = model.info().max_context;
                if at_least > max_context {
                    return bad(limits::chat_too_long(
                        c.messages.len(),
                        at_least,
                        max_context,
                    ));
                }
                at_least
            }
            _ => 0,
        };
        // The model's own context limit for the other prompts is checked by the scheme, also
        // before tokenizing.
        let Some(limit) = self.max_prompt_tokens else {
            return Ok(());
        };
        let at_least = match &req.prompt {
            Some(Prompt::TokenIds(ids)) => ids.ids.len(),
            Some(Prompt::Text(t)) => model.min_prompt_tokens(t),
            Some(Prompt::Chat(_)) => chat_at_least,
            None => 0,
        };
        if at_least > limit {
            return bad(format!(
                "the prompt is at least {at_least} tokens, more than this worker's limit of \
                 {limit} (--max-prompt-tokens); shorten it"
            ));
        }
        Ok(())
    }

    /// A `Tokenize` request's input, before it is tokenized or rendered: a chat's message count,
    /// and a lower bound on its tokens (a chat's with the template's own) against the model's
    /// context, as for a prompt: what cannot be a prompt is not tokenized.
    pub fn check_tokenize(
        &self,
        req: &pb::TokenizeRequest,
        model: &dyn ServedModel,
    ) -> Result<(), Status> {
        use pb::tokenize_request::Input;
        let context = model.info().max_context;
        let at_least = match &req.input {
            Some(Input::Chat(c)) => {
                if c.messages.len() > self.max_chat_messages {
                    return Err(Status::invalid_argument(limits::too_many_chat_messages(
                        c.messages.len(),
                        self.max_chat_messages,
                    )));
                }
                let contents: Vec<&str> = c.messages.iter().map(|m| m.content.as_str()).collect();
                model.min_chat_tokens(&contents)
            }
            Some(Input::Text(t)) => model.min_prompt_tokens(t),
            None => 0,
        };
        if at_least > context {
            return Err(Status::invalid_argument(format!(
                "the input is at least {at_least} tokens, more than the model's context of \
                 {context}: it cannot be a prompt"
            )));
        }
        Ok(())
    }

    /// The exact prompt length, once tokenized.
    pub fn check_prompt(&self, prompt_tokens: usize) -> Result<(), Status> {
        match self.max_prompt_tokens {
            Some(limit) if prompt_tokens > limit => Err(Status::invalid_argument(format!(
                "the prompt is {prompt_tokens} tokens, more than this worker's limit of {limit} \
                 (--max-prompt-tokens); shorten it"
            ))),
            _ => Ok(()),
        }
    }
}
