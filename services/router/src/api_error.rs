//! What the HTTP front's endpoints share: OpenAI's error object (with the HTTP status a gRPC
//! status maps to), the refusal of compressed bodies, and chat messages' text.

use axum::body::Bytes;
use axum::extract::rejection::{JsonRejection, MissingJsonContentType};
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::{DeserializeOwned, IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::{json, Value};
use tonic::{Code, Status};

/// An OpenAI error object with its HTTP status.
#[derive(Debug)]
pub struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) param: Option<&'static str>,
    pub(crate) message: String,
}

impl ApiError {
    pub(crate) fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            param: Some(param),
            message: message.into(),
        }
    }

    pub(crate) fn body(&self) -> Value {
        json!({"error": {
            "message": wavefront_proto::limits::clip_message(&self.message),
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16().to_string(),
        }})
    }
}

impl From<Status> for ApiError {
    fn from(s: Status) -> Self {
        let (status, kind) = match s.code() {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                (StatusCode::BAD_REQUEST, "invalid_request_error")
            }
            Code::NotFound => (StatusCode::NOT_FOUND, "not_found_error"),
            Code::Unauthenticated => (StatusCode::UNAUTHORIZED, "authentication_error"),
            Code::PermissionDenied => (StatusCode::FORBIDDEN, "permission_error"),
            Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            Code::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable"),
            Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
            Code::Cancelled => (StatusCode::from_u16(499).unwrap(), "cancelled"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
        };
        Self {
            status,
            kind,
            param: None,
            message: s.message().to_owned(),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        let status = r.status();
        Self {
            status: if status == StatusCode::PAYLOAD_TOO_LARGE {
                status
            } else {
                StatusCode::BAD_REQUEST
            },
            kind: "invalid_request_error",
            param: None,
            message: format!("the request body is not a valid request: {}", r.body_text()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// A JSON request body, taken as axum's `Json` takes one (the same `Content-Type` rule, body
/// limit and rejections) and parsed when the handler asks ([`Self::parse`]): directly with
/// `serde_json`, and only when that fails again through `Json` for its rejection, whose message
/// names the path to the bad field. Tracking that path on every parse doubled the cost of a
/// large body (a chat of 1,024 messages: 400 µs against 240), and a handler can look at the
/// body cheaply before parsing it whole ([`Self::chat_head`]).
pub(crate) struct JsonBody(Bytes);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = JsonRejection;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        if !json_content_type(req.headers()) {
            return Err(MissingJsonContentType::default().into());
        }
        Ok(Self(Bytes::from_request(req, state).await?))
    }
}

/// axum's rule for `Json`: `application/json` or `application/*+json`, parameters allowed.
fn json_content_type(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<mime::Mime>().ok())
        .is_some_and(|m| {
            m.type_() == "application"
                && (m.subtype() == "json" || m.suffix().is_some_and(|s| s == "json"))
        })
}

impl JsonBody {
    /// The body as `T`.
    pub(crate) fn parse<T: DeserializeOwned>(&self) -> Result<T, JsonRejection> {
        serde_json::from_slice(&self.0).or_else(|_| Json::<T>::from_bytes(&self.0).map(|Json(v)| v))
    }

    /// A chat's `model` and its number of `messages`, read without building the messages (a
    /// scan of the body, a fifth of parsing it): what the router's bound on chats needs to
    /// refuse one of many messages before it is parsed. `None` where the body has no
    /// `messages` array or is not a JSON object (the full parse then says what is wrong).
    pub(crate) fn chat_head(&self) -> Option<(String, usize)> {
        #[derive(Deserialize)]
        struct Head {
            #[serde(default)]
            model: String,
            messages: Option<Counted>,
        }
        let head: Head = serde_json::from_slice(&self.0).ok()?;
        Some((head.model, head.messages?.0))
    }

    /// Refuses, from [`Self::chat_head`], a conversation that `refusal` (the router's bound
    /// on chats: the model and the number of messages) says no worker would take, naming
    /// `messages`; before the body is parsed whole, converted and forwarded.
    pub(crate) fn refuse_chat(
        &self,
        refusal: impl FnOnce(&str, usize) -> Result<(), Status>,
    ) -> Result<(), ApiError> {
        match self.chat_head() {
            Some((model, messages)) => refusal(&model, messages).map_err(|s| ApiError {
                param: Some("messages"),
                ..ApiError::from(s)
            }),
            None => Ok(()),
        }
    }
}

/// The number of elements of a JSON array, each skipped unread.
struct Counted(usize);

impl<'de> Deserialize<'de> for Counted {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Count;
        impl<'de> Visitor<'de> for Count {
            type Value = Counted;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Counted, A::Error> {
                let mut n = 0;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(Counted(n))
            }
        }
        d.deserialize_seq(Count)
    }
}

/// Refuses a compressed body: it would be read as JSON and fail with a confusing message, or,
/// worse, parse.
pub(crate) fn refuse_content_encoding(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(v) = headers.get(axum::http::header::CONTENT_ENCODING) else {
        return Ok(());
    };
    let encoding = String::from_utf8_lossy(v.as_bytes())
        .trim()
        .to_ascii_lowercase();
    if encoding.is_empty() || encoding == "identity" {
        return Ok(());
    }
    let clipped: String = encoding.chars().take(64).collect();
    Err(ApiError {
        status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
        kind: "invalid_request_error",
        param: None,
        message: format!(
            "Content-Encoding {clipped:?} is not supported: send the JSON body uncompressed"
        ),
    })
}

#[derive(Debug, Deserialize)]
pub(crate) struct ChatMessageJson {
    pub(crate) role: String,
    pub(crate) content: Option<Value>,
}

/// A chat message's text: a string, or the text parts of a list of parts.
pub(crate) fn message_text(content: Option<Value>, i: usize) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!(
                                "messages[{i}] has a content part of type {:?}; only text parts are served",
                                kind.unwrap_or("?")
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::invalid(
            "messages",
            format!("messages[{i}].content must be a string or a list of text parts"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(content_type: Option<&str>, body: &str) -> Request {
        let mut b = axum::http::Request::builder().method("POST").uri("/");
        if let Some(t) = content_type {
            b = b.header(header::CONTENT_TYPE, t);
        }
        b.body(axum::body::Body::from(body.to_owned())).unwrap()
    }

    async fn take(content_type: Option<&str>, body: &str) -> Result<JsonBody, JsonRejection> {
        JsonBody::from_request(request(content_type, body), &()).await
    }

    /// The body is taken under axum's `Content-Type` rule, counted without being built, and
    /// parsed with axum's rejection (its path to the bad field) when it does not parse.
    #[tokio::test]
    async fn a_json_body_is_taken_as_axum_takes_it_and_a_chat_counted_before_it_is_parsed() {
        for ok in [
            "application/json",
            "application/json; charset=utf-8",
            "application/cloudevents+json",
        ] {
            assert!(take(Some(ok), "{}").await.is_ok(), "{ok}");
        }
        for bad in [None, Some("text/json"), Some("text/plain")] {
            let err = take(bad, "{}").await.err().expect("refused");
            assert!(
                matches!(err, JsonRejection::MissingJsonContentType(_)),
                "{bad:?}: {err:?}"
            );
        }
        let messages = vec![r#"{"role": "user", "content": ""}"#; 300].join(",");
        let chat = format!(r#"{{"max_tokens": 4, "messages": [{messages}], "model": "m"}}"#);
        let body = take(Some("application/json"), &chat).await.unwrap();
        assert_eq!(body.chat_head(), Some(("m".to_owned(), 300)));
        let parsed: serde_json::Value = body.parse().unwrap();
        assert_eq!(parsed["messages"].as_array().map(Vec::len), Some(300));
        // No messages array, or not an object: nothing to count; the parse says what is wrong.
        for other in [r#"{"model": "m"}"#, r#"{"messages": 3}"#, "[1]", "{"] {
            let body = take(Some("application/json"), other).await.unwrap();
            assert_eq!(body.chat_head(), None, "{other}");
        }
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct Typed {
            messages: Vec<ChatMessageJson>,
        }
        let body = take(
            Some("application/json"),
            r#"{"messages": [{"role": "user"}, {"role": 7}]}"#,
        )
        .await
        .unwrap();
        let err = body.parse::<Typed>().unwrap_err();
        assert!(
            err.body_text().contains("messages[1].role"),
            "{}",
            err.body_text()
        );
    }
}
