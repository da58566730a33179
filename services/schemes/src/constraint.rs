//! Structured outputs: a request's output constrained to a JSON schema, any JSON object, a
//! regular expression, one of a list of strings, or a Lark grammar, through llguidance (the
//! grammar engine vLLM and SGLang use: an Earley parser over a lexer, with token masks computed
//! from a trie of the vocabulary's bytes, tens of microseconds a token).
//!
//! A [`GrammarEngine`] is built once per served model from its tokenizer's bytes; a request's
//! [`Constraint`] compiles against it into a [`Guide`], which the request's program asks which
//! tokens may come next ([`Guide::mask`]) and tells which one came ([`Guide::advance`]). Where
//! a scheme decodes left to right, every step's distribution is masked; where it fills a canvas,
//! the constrained positions commit in order (docs/architecture.md, "Structured outputs").

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use wavefront_models::TextTokenizer;

/// What a request's output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON document valid under this JSON schema (`strict`: refuse the schema keywords the
    /// engine cannot enforce instead of ignoring them).
    JsonSchema {
        schema: serde_json::Value,
        strict: bool,
    },
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A sentence of this Lark grammar (llguidance's dialect).
    Grammar(String),
}

impl Constraint {
    /// The field that set it, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Constraint::JsonSchema { .. } => "json",
            Constraint::JsonObject => "json_object",
            Constraint::Regex(_) => "regex",
            Constraint::Choice(_) => "choice",
            Constraint::Grammar(_) => "grammar",
        }
    }

    fn grammar(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            Constraint::JsonSchema { schema, strict } => {
                let mut schema = schema.clone();
                if !schema.is_object() {
                    return Err("a JSON schema is an object".into());
                }
                schema["x-guidance"] = json_options(*strict);
                TopLevelGrammar::from_json_schema(schema)
            }
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(
                serde_json::json!({"type": "object", "x-guidance": json_options(false)}),
            ),
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Choice(options) => {
                if options.is_empty() {
                    return Err("choice lists no option".into());
                }
                let alternatives: Vec<String> = options.iter().map(|o| regex_literal(o)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
            Constraint::Grammar(g) => TopLevelGrammar::from_lark(g.clone()),
        })
    }
}

/// How JSON is written: compact (no whitespace between tokens, so an output's length is its
/// content's), and, unless `strict`, schema keywords the engine does not enforce ignored rather
/// than refused.
fn json_options(strict: bool) -> serde_json::Value {
    serde_json::json!({"whitespace_flexible": false, "lenient": !strict})
}

/// `s` as a regular expression matching exactly it.
fn regex_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// One model's vocabulary, as the grammar engine sees it.
pub struct GrammarEngine {
    factory: ParserFactory,
    /// The id that ends a constrained output where the grammar may end.
    eos: u32,
}

impl std::fmt::Debug for GrammarEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarEngine")
            .field("eos", &self.eos)
            .finish()
    }
}

impl GrammarEngine {
    /// The engine over `tokenizer`'s first `vocab_size` ids; `eos` ends an output (the
    /// checkpoint's end-of-sequence id).
    pub fn new(tokenizer: &TextTokenizer, vocab_size: usize, eos: u32) -> Result<Self, String> {
        let words = tokenizer.token_bytes(vocab_size);
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        Ok(Self { factory, eos })
    }

    /// `c` compiled for this vocabulary; the error says what is wrong with it.
    pub fn compile(&self, c: &Constraint) -> Result<Guide, String> {
        let parser = self
            .factory
            .create_parser(c.grammar()?)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Guide {
            matcher: Box::new(matcher),
            eos: self.eos,
            steps: 0,
        })
    }
}

/// A request's constraint as it decodes.
#[derive(Clone)]
pub struct Guide {
    matcher: Box<Matcher>,
    eos: u32,
    /// Tokens consumed.
    steps: usize,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide").field("steps", &self.steps).finish()
    }
}

impl Guide {
    /// Sets every logit the grammar does not allow next to negative infinity (the
    /// end-of-sequence id stays where the output may end here). An error when nothing is
    /// allowed.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        // A complete output takes only the end-of-sequence token.
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        let mut any = false;
        for (id, l) in logits.iter_mut().enumerate() {
            if mask.is_allowed(id as u32) {
                any |= l.is_finite() || *l == f32::INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if !any {
            return Err("the grammar allows no token the model can produce here".into());
        }
        Ok(())
    }

    /// Whether `token` may come next.
    pub fn allows(&mut self, token: u32) -> Result<bool, String> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        Ok(mask.is_allowed(token))
    }

    /// Consumes `token`; `true` once the output is complete (the grammar takes nothing more, or
    /// `token` is the end-of-sequence id it allowed).
    pub fn advance(&mut self, token: u32) -> Result<bool, String> {
        if token == self.eos {
            return Ok(true);
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| e.to_string())?;
        self.steps += 1;
        Ok(self.matcher.is_stopped())
    }

    /// Whether the output is complete (the grammar takes nothing more).
    pub fn complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Whether the output may end here.
    pub fn accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    pub fn eos(&self) -> u32 {
        self.eos
    }
}
