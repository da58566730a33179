//! What the HTTP front's endpoints share: OpenAI's error object (with the HTTP status a gRPC
//! status maps to), the refusal of compressed bodies, and chat messages' text.

use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
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
