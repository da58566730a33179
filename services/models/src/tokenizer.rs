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
    /// The most bytes of counted text one token can stand for: the longest vocabulary entry
    /// in UTF-8 bytes (byte and sentencepiece alphabets spell a byte with at least one byte),
    /// times what the normalizer may shrink text by; `usize::MAX` when no bound holds
    /// ([`TokenBound`]).
    max_token_bytes: usize,
    /// The bytes of text that count towards the bound (`None`: every byte).
    counted: Option<Arc<[bool; 256]>>,
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
        // The parsed document also says what bounds the token count ([`token_bound`]).
        let config: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|e| ModelError::Tokenizer(format!("not valid JSON: {e}")))?;
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(tok_err)?;
        let vocab = inner.get_vocab(true);
        let longest = vocab.keys().map(String::len).max().unwrap_or(1).max(1);
        let (max_token_bytes, counted) = match token_bound(&config, &vocab) {
            Some(TokenBound { factor, counted }) => (longest.saturating_mul(factor), counted),
            None => (usize::MAX, None),
        };
        Ok(Self {
            inner,
            chat: None,
            chat_overhead: ChatOverhead::default(),
            max_token_bytes,
            counted: counted.map(Arc::new),
        })
    }

    /// The fewest tokens `text` can become (each token covers at most the longest vocabulary
    /// entry): a bound checked before tokenizing, so an oversized prompt is refused without
    /// the work of tokenizing it (a pass over its bytes at most). Where the tokenizer drops the
    /// characters its vocabulary cannot spell (a BPE without an unknown token) or folds a run
    /// of them into one unknown token, only the bytes it surely spells count; where a
    /// normalizer or pre-tokenizer may delete text, nothing but one token is bounded.
    pub fn min_tokens(&self, text: &str) -> usize {
        if self.max_token_bytes == usize::MAX {
            return 0;
        }
        let bytes = match &self.counted {
            None => text.len(),
            Some(counted) => text.bytes().filter(|&b| counted[usize::from(b)]).count(),
        };
        bytes.div_ceil(self.max_token_bytes)
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

    /// The fewest tokens a conversation of messages with these contents can become through the
    /// chat template, known without rendering it: the template's fixed and per-message tokens,
    /// and each content's [`Self::min_tokens`]. A bound checked before the work of rendering
    /// and tokenizing, which grows with the number of messages.
    pub fn min_chat_tokens<'a>(&self, contents: impl ExactSizeIterator<Item = &'a str>) -> usize {
        let n = contents.len();
        let contents: usize = contents.map(|c| self.min_tokens(c)).sum();
        self.chat_overhead.fixed + n * self.chat_overhead.per_message + contents
    }

    /// The fewest tokens the chat template adds: once per conversation and per message (0
    /// and 0 without a template), as [`Self::min_chat_tokens`] counts them.
    pub fn chat_overhead(&self) -> (usize, usize) {
        (self.chat_overhead.fixed, self.chat_overhead.per_message)
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

/// What bounds a tokenizer's token count from below ([`TextTokenizer::min_tokens`]): no token
/// spells more than the longest vocabulary entry of the counted bytes times `factor`.
struct TokenBound {
    /// What the normalizer may shrink text by (Unicode normal forms and case folding: at most
    /// 3, Hangul jamo composing into a syllable, a full-width letter becoming ASCII), times 4
    /// where an unknown token stands for a character the vocabulary cannot spell.
    factor: usize,
    /// The bytes that count (`None`: all): where the model drops what its vocabulary cannot
    /// spell (a BPE without an unknown token) or folds a run of it into one unknown token,
    /// only the bytes it surely spells.
    counted: Option<[bool; 256]>,
}

/// The bound of a `tokenizer.json`'s pipeline, or `None` where none holds (a model other than
/// BPE, a pre-tokenizer or normalizer that may delete text, or dropped characters behind a
/// normalizer).
fn token_bound(
    config: &serde_json::Value,
    vocab: &std::collections::HashMap<String, u32>,
) -> Option<TokenBound> {
    use serde_json::Value;
    let model = &config["model"];
    if model["type"].as_str() != Some("BPE") {
        return None;
    }
    fn pre_keeps_text(p: &Value, byte_level: &mut bool) -> bool {
        match p["type"].as_str() {
            None if p.is_null() => true,
            Some("Sequence") => p["pretokenizers"]
                .as_array()
                .is_some_and(|all| all.iter().all(|p| pre_keeps_text(p, byte_level))),
            Some("ByteLevel") => {
                *byte_level = true;
                true
            }
            Some("Split") => p["behavior"].as_str() != Some("Removed"),
            Some("Digits" | "Metaspace" | "Punctuation" | "UnicodeScripts") => true,
            _ => false,
        }
    }
    fn shrink(n: &Value) -> Option<usize> {
        match n["type"].as_str() {
            None if n.is_null() => Some(1),
            Some("Sequence") => n["normalizers"]
                .as_array()?
                .iter()
                .try_fold(1usize, |f, n| Some(f * shrink(n)?)),
            Some("NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase") => Some(3),
            _ => None,
        }
    }
    let mut byte_level = false;
    if !pre_keeps_text(&config["pre_tokenizer"], &mut byte_level) {
        return None;
    }
    let shrink = shrink(&config["normalizer"])?;
    // Which bytes the vocabulary spells on their own: under a byte-level alphabet (GPT-2's
    // map: printable Latin-1 bytes stand for themselves, the rest for 256, 257, ... in byte
    // order) every byte; otherwise the ASCII characters (a longer character's bytes are not
    // counted).
    let mut spelled = [false; 256];
    let mut next = 256u32;
    for (b, spelled) in spelled.iter_mut().enumerate() {
        let b = b as u32;
        let c = if !byte_level || matches!(b, 33..=126 | 161..=172 | 174..=255) {
            b
        } else {
            next += 1;
            next - 1
        };
        *spelled = (byte_level || b < 128)
            && char::from_u32(c).is_some_and(|c| vocab.contains_key(c.encode_utf8(&mut [0; 4])));
    }
    // Bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5 and above) need no entry.
    let every_byte = byte_level
        && spelled
            .iter()
            .enumerate()
            .all(|(b, &s)| s || matches!(b, 0xC0 | 0xC1 | 0xF5..));
    let fallback = model["byte_fallback"].as_bool() == Some(true)
        && (0..256).all(|b| vocab.contains_key(&format!("<0x{b:02X}>")));
    let unknown = !model["unk_token"].is_null() && model["fuse_unk"].as_bool() != Some(true);
    if every_byte || fallback || unknown {
        // Every character reaches tokens: an unknown one stands for up to 4 bytes.
        return Some(TokenBound {
            factor: shrink
                * if unknown && !(every_byte || fallback) {
                    4
                } else {
                    1
                },
            counted: None,
        });
    }
    // Characters are dropped or folded: count the bytes spelled, where no normalizer can turn
    // a spelled character into one that is not.
    (shrink == 1).then_some(TokenBound {
        factor: 1,
        counted: Some(spelled),
    })
}

#[cfg(test)]
mod token_bytes_tests {
    use super::*;

    /// The pre-tokenizing bound never exceeds the real count, on every fixture's tokenizer,
    /// for text its pipeline keeps and text it does not: the Huginn fixture's pre-tokenizer
    /// (upstream's layout) deletes what its pattern does not match, so 17 bytes of rare
    /// characters became one token where the bound said two.
    #[test]
    fn the_bound_holds_where_a_tokenizer_drops_or_folds_text() {
        let texts = [
            "\u{14647}\u{18cd6}{\u{1005e}\u{2ee5e}",
            "plain words and spaces, then digits 0123456789",
            "\u{1100}\u{1161}\u{11a8}\u{1100}\u{1161}\u{11a8} ＡＢＣ e\u{301}",
            "\u{0}\u{7}\u{7f}\u{80}\u{ff}\u{fffd}",
            "          ",
            "\0",
        ];
        // Every fixture with a tokenizer (ARMT's has none).
        let fixtures = std::fs::read_dir(crate::device::test_fixture("")).expect("fixtures");
        let mut tested = 0;
        for dir in fixtures {
            let path = dir.expect("fixture").path().join("tokenizer.json");
            if !path.exists() {
                continue;
            }
            tested += 1;
            let fixture = path.display();
            let tok = TextTokenizer::from_file(&path).expect("tokenizer");
            for text in texts {
                let ids = tok.encode(text, false).expect("encodes");
                assert!(
                    tok.min_tokens(text) <= ids.len(),
                    "{fixture}: bound {} above {} tokens for {text:?}",
                    tok.min_tokens(text),
                    ids.len()
                );
            }
        }
        assert!(tested >= 6, "{tested} fixtures with a tokenizer");
        // The Huginn fixture's pre-tokenizer removes what its pattern does not match ("\0"
        // becomes no token): no bound from the text; LLaDA's byte-level BPE keeps one.
        let huginn = crate::device::test_fixture("huginn").join("tokenizer.json");
        let huginn = TextTokenizer::from_file(&huginn).unwrap();
        assert_eq!(huginn.min_tokens(&"word ".repeat(200)), 0);
        let llada = crate::device::test_fixture("llada").join("tokenizer.json");
        let llada = TextTokenizer::from_file(&llada).unwrap();
        assert!(llada.min_tokens(&"word ".repeat(200)) > 0);
    }

    /// What the bound's reading of `tokenizer.json` makes of pipelines that drop or fold
    /// text, and of ones that do not: `(factor, whether only spelled bytes count)`.
    #[test]
    fn pipelines_that_drop_or_fold_text_count_only_what_they_spell() {
        let vocab: std::collections::HashMap<String, u32> = [("a", 0u32), ("b", 1), ("<unk>", 2)]
            .iter()
            .map(|&(k, v)| (k.to_string(), v))
            .collect();
        let bound = |model: serde_json::Value, pre: serde_json::Value, norm: serde_json::Value| {
            let config =
                serde_json::json!({"model": model, "pre_tokenizer": pre, "normalizer": norm});
            token_bound(&config, &vocab).map(|b| {
                (
                    b.factor,
                    b.counted
                        .map(|c| c[usize::from(b'a')] && !c[usize::from(b'c')]),
                )
            })
        };
        let bpe = |unk: Option<&str>, fuse: bool| serde_json::json!({"type": "BPE", "unk_token": unk, "fuse_unk": fuse, "byte_fallback": false});
        let null = serde_json::Value::Null;
        // Unknown characters dropped (no unknown token) or a run of them one token: only the
        // spelled bytes count ('a' does, 'c' does not).
        assert_eq!(
            bound(bpe(None, false), null.clone(), null.clone()),
            Some((1, Some(true)))
        );
        assert_eq!(
            bound(bpe(Some("<unk>"), true), null.clone(), null.clone()),
            Some((1, Some(true)))
        );
        // One unknown token per character: every byte counts, up to 4 to a token.
        assert_eq!(
            bound(bpe(Some("<unk>"), false), null.clone(), null.clone()),
            Some((4, None))
        );
        // Whitespace removed by the pre-tokenizer, text deleted by a replacing normalizer.
        let ws = serde_json::json!({"type": "WhitespaceSplit"});
        assert_eq!(bound(bpe(Some("<unk>"), false), ws, null.clone()), None);
        let replace =
            serde_json::json!({"type": "Replace", "pattern": {"String": " "}, "content": ""});
        assert_eq!(
            bound(bpe(Some("<unk>"), false), null.clone(), replace),
            None
        );
        // Normal forms shrink text by at most 3; behind one, dropped characters bound nothing.
        let nfc = serde_json::json!({"type": "NFC"});
        assert_eq!(
            bound(bpe(Some("<unk>"), false), null.clone(), nfc.clone()),
            Some((12, None))
        );
        assert_eq!(bound(bpe(None, false), null.clone(), nfc), None);
        // A byte-level alphabet with gaps counts the bytes it has.
        let byte_level = serde_json::json!({"type": "ByteLevel"});
        assert_eq!(
            bound(bpe(None, false), byte_level, null.clone()),
            Some((1, Some(true)))
        );
        // Other models are not read.
        let wordpiece = serde_json::json!({"type": "WordPiece", "unk_token": "<unk>"});
        assert_eq!(bound(wordpiece, null.clone(), null), None);
    }

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
