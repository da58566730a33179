//! Chat formatting with the model's own template: the Jinja `chat_template` of
//! `tokenizer_config.json`, rendered the way Hugging Face `apply_chat_template` renders it
//! (`trim_blocks` and `lstrip_blocks` on, `messages`, `add_generation_prompt`, the special-token
//! strings `bos_token` / `eos_token` / ... as variables, `raise_exception`, Python string methods
//! such as `.strip()` through minijinja's pycompat layer). The rendered text is then tokenized
//! without adding special tokens: the template already wrote them, as the upstream chat scripts
//! of LLaDA and ReFusion do (`apply_chat_template(..., tokenize=False)` then
//! `tokenizer(text, add_special_tokens=False)`).

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

use crate::error::{ModelError, Result};

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A parsed `chat_template` with the special-token strings it may refer to.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    /// `bos_token`, `eos_token`, `pad_token`, `unk_token` as strings.
    specials: Vec<(&'static str, String)>,
}

fn err(reason: impl Into<String>) -> ModelError {
    ModelError::Tokenizer(format!("chat template: {}", reason.into()))
}

/// A special token in `tokenizer_config.json`: a string or an `AddedToken` object.
fn token_string(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

impl ChatTemplate {
    /// The template of a `tokenizer_config.json` text; `None` when it has none. A list of named
    /// templates (newer configs) yields the one named `default`.
    pub fn from_tokenizer_config(json: &str) -> Result<Option<Self>> {
        let cfg: serde_json::Value =
            serde_json::from_str(json).map_err(|e| err(format!("bad tokenizer_config: {e}")))?;
        let source = match cfg.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .map(str::to_owned)
                .ok_or_else(|| err("a list of templates without one named `default`"))?,
            Some(_) => return Err(err("`chat_template` is neither a string nor a list")),
        };
        let specials = ["bos_token", "eos_token", "pad_token", "unk_token"]
            .into_iter()
            .filter_map(|k| Some((k, token_string(cfg.get(k)?)?)))
            .collect();
        let t = Self { source, specials };
        // Fail at load time, not on the first request.
        t.environment()?;
        Ok(Some(t))
    }

    fn environment(&self) -> Result<Environment<'_>> {
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template("chat", &self.source)?;
        Ok(env)
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// A special token `tokenizer_config.json` names (`bos_token`, `eos_token`, `pad_token`,
    /// `unk_token`).
    pub fn special(&self, name: &str) -> Option<&str> {
        self.specials
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The prompt text of `messages`, ending with the assistant's header when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        if messages.is_empty() {
            return Err(err("the conversation has no message"));
        }
        let env = self.environment()?;
        let mut ctx: std::collections::BTreeMap<&str, Value> = self
            .specials
            .iter()
            .map(|(k, v)| (*k, Value::from(v.as_str())))
            .collect();
        ctx.insert("messages", Value::from(Serde(messages)));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        Ok(env.get_template("chat").and_then(|t| t.render(ctx))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_with_trimmed_blocks_specials_and_python_methods() {
        let cfg = serde_json::json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": "{{ bos_token }}{% for m in messages %}\n  {{ m.role.upper() }}: {{ m.content.strip() }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
        });
        let t = ChatTemplate::from_tokenizer_config(&cfg.to_string())
            .unwrap()
            .unwrap();
        let text = t
            .render(&[ChatMessage::new("user", "  hi ")], true)
            .unwrap();
        // lstrip_blocks strips only before block tags, trim_blocks the newline after them.
        assert_eq!(text, "<s>  USER: hi</s>\nA:");
        assert!(t.render(&[], true).is_err());
    }

    #[test]
    fn raise_exception_is_an_error_and_missing_templates_are_none() {
        let cfg = serde_json::json!({
            "chat_template": "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
        });
        let t = ChatTemplate::from_tokenizer_config(&cfg.to_string())
            .unwrap()
            .unwrap();
        let e = t
            .render(&[ChatMessage::new("system", "x")], true)
            .unwrap_err();
        assert!(e.to_string().contains("first must be user"), "{e}");
        assert_eq!(
            t.render(&[ChatMessage::new("user", "x")], true).unwrap(),
            "ok"
        );
        assert!(ChatTemplate::from_tokenizer_config("{}").unwrap().is_none());
        assert!(ChatTemplate::from_tokenizer_config(r#"{"chat_template": "{% if %}"}"#).is_err());
    }
}
