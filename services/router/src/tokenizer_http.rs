//! The tokenizer over HTTP, in vLLM's shapes (`POST /tokenize`, `POST /detokenize`,
//! `GET /tokenizer_info`), which evaluation harnesses use as a remote tokenizer (lm-eval's
//! `tokenizer_backend=remote`): the same conversions a request's prompt goes through, from the
//! worker serving the model (the public gRPC API's `Tokenize`, `Detokenize`, `GetTokenizer`).
//! A request that names no model gets the router's default model, as a completion does.

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use wavefront_proto::v1 as pb;

use crate::api_error::{
    message_text, refuse_content_encoding, ApiError, ChatMessageJson, JsonBody,
};
use crate::service::RouterService;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TokenizeBody {
    #[serde(default)]
    model: String,
    /// Text, tokenized as a prompt is (vLLM's default adds the special tokens).
    prompt: Option<String>,
    /// Or a conversation, rendered with the chat template.
    messages: Option<Vec<ChatMessageJson>>,
    add_special_tokens: Option<bool>,
}

pub(crate) async fn tokenize(
    State(router): State<RouterService>,
    headers: HeaderMap,
    body: Result<JsonBody, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    refuse_content_encoding(&headers)?;
    let body = body?;
    // A conversation no worker would take is refused from a scan of the body, as a chat
    // completion's is, before its messages are built and forwarded.
    body.refuse_chat(|model, messages| router.chat_refusal(model, messages))?;
    let body: TokenizeBody = body.parse()?;
    let input = match (body.prompt, body.messages) {
        (Some(text), None) => pb::tokenize_request::Input::Text(text),
        (None, Some(messages)) => {
            if body.add_special_tokens.is_some() {
                return Err(ApiError::invalid(
                    "add_special_tokens",
                    "add_special_tokens applies to a `prompt`; a conversation is tokenized \
                     as its chat template writes it",
                ));
            }
            let messages = messages
                .into_iter()
                .enumerate()
                .map(|(i, m)| {
                    Ok(pb::ChatMessage {
                        role: m.role,
                        content: message_text(m.content, i)?,
                    })
                })
                .collect::<Result<Vec<_>, ApiError>>()?;
            pb::tokenize_request::Input::Chat(pb::ChatMessages { messages })
        }
        _ => {
            return Err(ApiError::invalid(
                "prompt",
                "send either `prompt` (text) or `messages` (a conversation)",
            ))
        }
    };
    let req = pb::TokenizeRequest {
        model: body.model,
        input: Some(input),
        // vLLM's default: the special tokens are added.
        add_special_tokens: Some(body.add_special_tokens.unwrap_or(true)),
    };
    let r = router
        .to_worker(&req.model.clone(), |mut c, model| {
            let req = pb::TokenizeRequest {
                model,
                ..req.clone()
            };
            async move { c.tokenize(req).await }
        })
        .await?;
    Ok(Json(json!({
        "model": r.model,
        "tokens": r.token_ids,
        "count": r.token_ids.len(),
        "max_model_len": r.max_context,
    })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DetokenizeBody {
    #[serde(default)]
    model: String,
    tokens: Vec<u32>,
    skip_special_tokens: Option<bool>,
}

pub(crate) async fn detokenize(
    State(router): State<RouterService>,
    headers: HeaderMap,
    body: Result<Json<DetokenizeBody>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    refuse_content_encoding(&headers)?;
    let Json(body) = body?;
    let req = pb::DetokenizeRequest {
        model: body.model,
        token_ids: body.tokens,
        skip_special_tokens: body.skip_special_tokens,
    };
    let r = router
        .to_worker(&req.model.clone(), |mut c, model| {
            let req = pb::DetokenizeRequest {
                model,
                ..req.clone()
            };
            async move { c.detokenize(req).await }
        })
        .await?;
    Ok(Json(json!({"model": r.model, "prompt": r.text})))
}

/// The `model` parameter of a query string (percent-decoded; empty when absent).
fn model_param(uri: &Uri) -> Result<String, ApiError> {
    let Some(q) = uri.query() else {
        return Ok(String::new());
    };
    for pair in q.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == "model" {
            return percent_decode(v).ok_or_else(|| {
                ApiError::invalid("model", "the model parameter is not valid percent-encoding")
            });
        }
    }
    Ok(String::new())
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

pub(crate) async fn tokenizer_info(
    State(router): State<RouterService>,
    uri: Uri,
) -> Result<Json<Value>, ApiError> {
    let model = model_param(&uri)?;
    let r = router
        .to_worker(&model, |mut c, model| async move {
            c.get_tokenizer(pb::GetTokenizerRequest { model }).await
        })
        .await?;
    let text = |s: &str| {
        if s.is_empty() {
            Value::Null
        } else {
            json!(s)
        }
    };
    Ok(Json(json!({
        "model": r.model,
        "bos_token": text(&r.bos_token),
        "eos_token": text(&r.eos_token),
        "pad_token": text(&r.pad_token),
        "chat_template": text(&r.chat_template),
        "model_max_length": r.max_context,
        "vocab_size": r.vocab_size,
        "eos_token_ids": r.eos_token_ids,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_parameter_is_read_from_the_query() {
        let uri = |s: &str| s.parse::<Uri>().unwrap();
        assert_eq!(model_param(&uri("/tokenizer_info")).unwrap(), "");
        assert_eq!(
            model_param(&uri("/tokenizer_info?model=llada")).unwrap(),
            "llada"
        );
        assert_eq!(
            model_param(&uri("/tokenizer_info?x=1&model=a%2Fb+c")).unwrap(),
            "a/b c"
        );
        assert!(model_param(&uri("/tokenizer_info?model=%zz")).is_err());
    }
}
