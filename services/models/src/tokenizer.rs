//! Text tokenization and streaming detokenization.
//!
//! [`TextTokenizer`] is a thin wrapper over a Hugging Face `tokenizers::Tokenizer` loaded from
//! `tokenizer.json`. [`IncrementalDecoder`] turns a stream of token ids into text deltas with the
//! usual prefix-window method: decode a short window of already-emitted ids and the window plus
//! the new ids, and emit the difference only once the longer text does not end in U+FFFD (the
//! replacement character a byte-level decoder produces for an incomplete UTF-8 sequence). A
//! multi-byte character split over several byte-level tokens is therefore emitted whole, once
//! its last byte arrives, and windowed decoding keeps whitespace handling identical to decoding
//! the full sequence.

use std::sync::Arc;

use crate::chat::{ChatMessage, ChatTemplate};
use crate::error::{ModelError, Result};

/// A loaded `tokenizer.json`, with the model's chat template when it has one.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    chat: Option<Arc<ChatTemplate>>,
    /// The fewest tokens the chat template adds: `(once per conversation, per message)`.
    chat_overhead: ChatOverhead,
    /// The longest vocabulary entry in UTF-8 bytes: no token covers more bytes of text (byte
    /// and sentencepiece alphabets spell a byte with at least one byte).
    max_token_bytes: usize,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("chat_template", &self.chat.is_some())
            .finish()
    }
}

/// The fewest tokens a chat template adds (see [`TextTokenizer::min_chat_tokens`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct ChatOverhead {
    fixed: usize,
    per_message: usize,
}

fn tok_err(e: tokenizers::Error) -> ModelError {
    ModelError::Tokenize(e)
}

impl TextTokenizer {
    /// Parses the bytes of a `tokenizer.json`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        // The document must be well-formed JSON before `tokenizers` reads it: its decoder
        // deserializer panics (`expect("Helper")`) on a syntax error, e.g. a truncated file.
        serde_json::from_slice::<serde::de::IgnoredAny>(bytes)
            .map_err(|e| ModelError::Tokenizer(format!("not valid JSON: {e}")))?;
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(tok_err)?;
        let max_token_bytes = inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(Self {
            inner,
            chat: None,
            chat_overhead: ChatOverhead::default(),
            max_token_bytes,
        })
    }

    /// The fewest tokens `text_bytes` bytes of text can become (each token covers at most the
    /// longest vocabulary entry): a bound checked before tokenizing, so an oversized prompt is
    /// refused without the work proportional to its size.
    pub fn min_tokens(&self, text_bytes: usize) -> usize {
        text_bytes.div_ceil(self.max_token_bytes)
    }

    /// Attaches a chat template, and measures the tokens it adds per conversation and per
    /// message ([`Self::min_chat_tokens`]).
    pub fn with_chat_template(mut self, template: Option<ChatTemplate>) -> Self {
        self.chat = template.map(Arc::new);
        self.chat_overhead = self.measure_chat_overhead();
        self
    }

    /// The fewest tokens the template adds: a conversation of one empty user message, and one
    /// of three (user, assistant, user), rendered and tokenized; the difference over the two
    /// extra messages is the per-message bound (rounded down), the rest the fixed part. A
    /// template that refuses these conversations adds nothing to the bound (0, 0).
    fn measure_chat_overhead(&self) -> ChatOverhead {
        let tokens = |roles: &[&str]| -> Option<usize> {
            let messages: Vec<ChatMessage> =
                roles.iter().map(|&r| ChatMessage::new(r, "")).collect();
            self.encode_chat(&messages).ok().map(|ids| ids.len())
        };
        match (tokens(&["user"]), tokens(&["user", "assistant", "user"])) {
            (Some(one), Some(three)) if three >= one => {
                let per_message = (three - one) / 2;
                ChatOverhead {
                    fixed: one.saturating_sub(per_message),
                    per_message,
                }
            }
            _ => ChatOverhead::default(),
        }
    }

    /// The fewest tokens a conversation of messages whose contents are `content_bytes` bytes
    /// each can become through the chat template, known without rendering it: the template's
    /// fixed and per-message tokens, and each content's [`Self::min_tokens`]. A bound checked
    /// before the work of rendering and tokenizing, which grows with the number of messages.
    pub fn min_chat_tokens(&self, content_bytes: impl ExactSizeIterator<Item = usize>) -> usize {
        let n = content_bytes.len();
        let contents: usize = content_bytes.map(|b| self.min_tokens(b)).sum();
        self.chat_overhead.fixed + n * self.chat_overhead.per_message + contents
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_deref()
    }

    /// Token ids of a conversation: the chat template rendered with the generation prompt,
    /// tokenized without adding special tokens (the template wrote them).
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let template = self.chat.as_deref().ok_or_else(|| {
            ModelError::Tokenizer(
                "this model has no chat template (no `chat_template` in its tokenizer_config.json): \
                 send a plain prompt instead (`prompt` on /v1/completions, `text` over gRPC, \
                 `run` without --chat)"
                    .into(),
            )
        })?;
        self.encode(&template.render(messages, true)?, false)
    }

    /// Reads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_bytes(&bytes)
    }

    /// Token ids of `text`; with `add_special_tokens` the post-processor template (e.g.
    /// `<|begin_text|> $A <|end_text|>`) is applied.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(tok_err)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, optionally dropping special tokens.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tok_err)
    }

    /// Number of ids, added (special) tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Every id's bytes, as a byte-level grammar engine sees the vocabulary (`vocab_size` ids;
    /// an id the tokenizer does not know has none): a byte-level BPE token's characters mapped
    /// back to its bytes (GPT-2's byte alphabet), a sentencepiece token's text with `▁` as a
    /// space and `<0xNN>` as that byte, and a special token as its text after the 0xFF marker.
    pub fn token_bytes(&self, vocab_size: usize) -> Vec<Vec<u8>> {
        let byte_level = matches!(
            self.inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        let unbyte = gpt2_unicode_to_byte();
        let special: std::collections::HashSet<u32> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        (0..vocab_size as u32)
            .map(|id| {
                let Some(s) = self.inner.id_to_token(id) else {
                    return Vec::new();
                };
                if special.contains(&id) {
                    let mut b = vec![0xff];
                    b.extend_from_slice(s.as_bytes());
                    return b;
                }
                if byte_level {
                    if let Some(bytes) = s.chars().map(|c| unbyte.get(&c).copied()).collect() {
                        return bytes;
                    }
                    return s.into_bytes();
                }
                if let Some(hex) = s.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
                    if let Ok(b) = u8::from_str_radix(hex, 16) {
                        return vec![b];
                    }
                }
                s.replace('\u{2581}', " ").into_bytes()
            })
            .collect()
    }

    /// The underlying Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// A streaming decoder over this tokenizer.
    pub fn incremental(&self, skip_special_tokens: bool) -> IncrementalDecoder<'_> {
        IncrementalDecoder::new(self, skip_special_tokens)
    }
}

/// Streams text deltas for a growing sequence of token ids.
#[derive(Debug)]
pub struct IncrementalDecoder<'t> {
    tokenizer: &'t TextTokenizer,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the window decoded as context for the next delta.
    prefix_offset: usize,
    /// End of the ids whose text has been emitted.
    read_offset: usize,
}

impl<'t> IncrementalDecoder<'t> {
    /// A decoder with nothing emitted yet.
    pub fn new(tokenizer: &'t TextTokenizer, skip_special_tokens: bool) -> Self {
        Self {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds one id; returns the newly completed text, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        self.step(false)
    }

    /// Adds several ids; returns the newly completed text, if any.
    pub fn extend(&mut self, ids: &[u32]) -> Result<Option<String>> {
        self.ids.extend_from_slice(ids);
        self.step(false)
    }

    /// Emits whatever is still pending, even an incomplete character (as U+FFFD).
    pub fn flush(&mut self) -> Result<Option<String>> {
        self.step(true)
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn step(&mut self, force: bool) -> Result<Option<String>> {
        if self.read_offset == self.ids.len() {
            return Ok(None);
        }
        let skip = self.skip_special_tokens;
        let prefix = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let full = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], skip)?;
        if !force && full.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let delta = if full.len() >= prefix.len()
            && full.is_char_boundary(prefix.len())
            && full.starts_with(&prefix)
        {
            full[prefix.len()..].to_owned()
        } else {
            // The window's text changed retroactively (unusual decoders); emit the whole new
            // window rather than lose text.
            full
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok((!delta.is_empty()).then_some(delta))
    }
}

/// GPT-2's byte alphabet backwards: the character byte-level BPE writes for each byte (printable
/// bytes as themselves, the others as U+0100 onwards, in byte order) to the byte.
fn gpt2_unicode_to_byte() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                let c = char::from_u32(next).expect("U+0100 onwards are characters");
                next += 1;
                c
            };
            (c, b)
        })
        .collect()
}

#[cfg(test)]
mod token_bytes_tests {
    use super::*;

    /// Every ordinary token's bytes are what decoding it alone writes (where that is whole
    /// UTF-8), special tokens carry the marker, and ids past the tokenizer have none: for a
    /// byte-level BPE (LLaDA's fixture) and a sentencepiece-style one (DiffusionGemma's).
    #[test]
    fn token_bytes_are_what_each_token_decodes_to() {
        for fixture in ["llada", "diffusion_gemma"] {
            let path = crate::device::test_fixture(fixture).join("tokenizer.json");
            let tok = TextTokenizer::from_file(&path).expect("tokenizer");
            let n = tok.vocab_size();
            let bytes = tok.token_bytes(n + 3);
            assert_eq!(bytes.len(), n + 3);
            assert!(bytes[n..].iter().all(Vec::is_empty));
            let mut checked = 0;
            for id in 0..n as u32 {
                let b = &bytes[id as usize];
                if b.first() == Some(&0xff) {
                    continue;
                }
                let text = tok.decode(&[id], false).expect("decodes");
                if text.contains('\u{FFFD}') {
                    // A partial character.
                    continue;
                }
                // Decoding a piece alone may strip its leading space.
                assert_eq!(
                    String::from_utf8_lossy(b).trim(),
                    text.trim(),
                    "{fixture}: token {id} {:?}",
                    tok.id_to_token(id)
                );
                checked += 1;
            }
            assert!(checked > n / 2, "{fixture}: {checked} of {n} checked");
        }
    }
}
