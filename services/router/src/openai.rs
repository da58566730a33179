//! The OpenAI-compatible HTTP front of the router: `POST /v1/completions`,
//! `POST /v1/chat/completions` (both unary and server-sent events), `GET /v1/models` and
//! `GET /health`.
//!
//! An HTTP request becomes the same `GenerateRequest` a gRPC client sends and takes the same
//! path ([`RouterService::stream`]): ranking, deadlines, retries and cancellation are the
//! router's. OpenAI's parameters map onto the proto's (`max_tokens` / `max_completion_tokens`,
//! `temperature`, `top_p`, `seed`, `stop`; `n` completions are `n` requests, completion `i`
//! seeded with seed + i); each family's scheme and its parameters are
//! extension fields with the proto's names (`"low_confidence": {"block_length": 32}`, what the
//! OpenAI client sends through `extra_body`), as are `top_k`, `stop_token_ids` and
//! `stream_canvas` (canvas events arrive as SSE events named `canvas`). Errors are OpenAI error
//! objects with the HTTP status of the gRPC code. A client that closes the connection drops
//! the call, which frees the request's slots on the worker.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tonic::Status;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generate_request::{Prompt, Scheme};
use wavefront_proto::v1::generate_stream_response::Event as PbEvent;

pub use crate::api_error::ApiError;
use crate::api_error::{message_text, refuse_content_encoding, ChatMessageJson, JsonBody};
use crate::pick::served_model_infos;
use crate::service::RouterService;
use wavefront_net::Listener;

/// `max_tokens` when a completion request sets none (OpenAI's default for completions).
const DEFAULT_COMPLETION_TOKENS: u32 = 16;
/// Most completions one request may ask for (`n`).
const MAX_N: u32 = crate::service::MAX_COMPLETIONS;

/// `max_tokens` when a chat request sets none.
const DEFAULT_CHAT_TOKENS: u32 = 128;

/// The HTTP application over `router`; bodies over `max_body_bytes` get 413.
pub fn app(
    router: RouterService,
    max_body_bytes: usize,
    body_timeout: std::time::Duration,
) -> Router {
    // The key is checked before the body is read.
    let api = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenize", post(crate::tokenizer_http::tokenize))
        .route("/detokenize", post(crate::tokenizer_http::detokenize))
        .route(
            "/tokenizer_info",
            get(crate::tokenizer_http::tokenizer_info),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            (body_timeout, max_body_bytes),
            read_body,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            router.clone(),
            require_api_key,
        ));
    Router::new()
        .route("/health", get(health))
        .merge(api)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::middleware::from_fn(count_response))
        .with_state(router)
}

/// Counts every response by route and status, refusals made before the router sees the
/// request included (`wavefront_http_responses_total`).
async fn count_response(
    route: Option<axum::extract::MatchedPath>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = route.map_or_else(|| "unmatched".to_owned(), |r| r.as_str().to_owned());
    let response = next.run(request).await;
    metrics::counter!(
        wavefront_telemetry::metrics::HTTP_RESPONSES_TOTAL,
        "route" => route,
        "code" => response.status().as_str().to_owned()
    )
    .increment(1);
    response
}

/// 401 unless the request carries one of the router's API keys (`Authorization: Bearer`, as
/// the OpenAI clients send it); open when the router has none. `/health` stays open.
async fn require_api_key(
    State(router): State<RouterService>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let keys = router.api_keys();
    let presented = wavefront_proto::auth::bearer_secret(
        request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .map(|v| v.as_bytes()),
    );
    if keys.is_empty() || presented.is_some_and(|p| keys.accepts(p)) {
        return next.run(request).await;
    }
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        kind: "authentication_error",
        param: None,
        message: "missing or wrong API key: send `Authorization: Bearer <key>`".into(),
    }
    .into_response()
}

/// Serves the HTTP front on `listener` until `shutdown` resolves (in-flight responses finish).
pub async fn serve_http(
    router: RouterService,
    listener: Listener,
    max_body_bytes: usize,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let tls = router.tls().map(|t| t.http());
    let app = app(router, max_body_bytes, listener.limits().body_read_timeout);
    wavefront_net::serve_http(listener, app, tls, shutdown).await;
    Ok(())
}

/// Reads the request body whole within `--body-read-timeout-s` (408 otherwise) and at most
/// the body limit (413), before any handler sees it.
async fn read_body(
    State((timeout, max)): State<(std::time::Duration, usize)>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use wavefront_net::BodyError;
    match wavefront_net::read_body_within(request, timeout, max).await {
        Ok(request) => next.run(request).await,
        Err(e) => {
            let status = match e {
                BodyError::TooSlow(_) => StatusCode::REQUEST_TIMEOUT,
                BodyError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
                BodyError::Failed(_) => StatusCode::BAD_REQUEST,
            };
            ApiError {
                status,
                kind: "invalid_request_error",
                param: None,
                message: e.to_string(),
            }
            .into_response()
        }
    }
}

async fn health(State(router): State<RouterService>) -> Response {
    let workers = router.discovery().snapshot();
    if workers.iter().any(|w| w.up) {
        (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unavailable", "message": "no worker is reachable"})),
        )
            .into_response()
    }
}

async fn models(State(router): State<RouterService>) -> Json<Value> {
    let data: Vec<Value> = served_model_infos(&router.discovery().snapshot())
        .into_iter()
        .map(|i| {
            json!({
                "id": i.name,
                "object": "model",
                "created": 0,
                "owned_by": "wavefront",
                "family": i.family,
                "schemes": i.schemes,
                "max_context": i.max_context,
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// What completions and chat completions share: OpenAI's parameters and the extensions.
#[derive(Debug, Deserialize)]
struct Common {
    #[serde(default)]
    model: String,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<i64>,
    stop: Option<Stop>,
    n: Option<u32>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    // Parameters OpenAI defines that change the answer and are not served: refused by name.
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    echo: Option<bool>,
    best_of: Option<u32>,
    suffix: Option<String>,
    logit_bias: Option<Value>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    tools: Option<Value>,
    response_format: Option<Value>,
    // Extensions, named as in the proto.
    top_k: Option<u32>,
    stop_token_ids: Option<Vec<u32>>,
    /// vLLM's name: false keeps special tokens in the text.
    skip_special_tokens: Option<bool>,
    #[serde(default)]
    stream_canvas: bool,
    ar: Option<pb::ArScheme>,
    diffusion_forcing: Option<pb::DiffusionForcingScheme>,
    low_confidence: Option<pb::LowConfidenceScheme>,
    wino: Option<pb::WinoScheme>,
    diffusion_generate: Option<pb::DiffusionGenerateScheme>,
    block_diffusion: Option<pb::BlockDiffusionScheme>,
    plan_infill: Option<pb::PlanInfillScheme>,
    entropy_bound: Option<pb::EntropyBoundScheme>,
    /// Masked diffusion's prompt scoring (with `echo` and `logprobs`).
    likelihood: Option<pb::LikelihoodOptions>,
    /// vLLM's structured-output parameters.
    structured_outputs: Option<StructuredOutputsJson>,
}

/// vLLM's `structured_outputs` object: one of `json` (a JSON schema, as an object or as JSON
/// text), `json_object`, `regex`, `choice`, `grammar` (Lark).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StructuredOutputsJson {
    json: Option<Value>,
    #[serde(default)]
    json_object: bool,
    regex: Option<String>,
    choice: Option<Vec<String>>,
    grammar: Option<String>,
}

impl StructuredOutputsJson {
    fn proto(self) -> Result<pb::StructuredOutput, ApiError> {
        use pb::structured_output::Kind;
        let bad = |m: &str| ApiError::invalid("structured_outputs", m.to_owned());
        let mut kinds = Vec::new();
        if let Some(j) = self.json {
            kinds.push(Kind::Json(match j {
                Value::String(s) => s,
                v @ Value::Object(_) => v.to_string(),
                _ => {
                    return Err(bad(
                        "structured_outputs.json is a JSON schema: an object or its JSON text",
                    ))
                }
            }));
        }
        if self.json_object {
            kinds.push(Kind::JsonObject(true));
        }
        if let Some(r) = self.regex {
            kinds.push(Kind::Regex(r));
        }
        if let Some(c) = self.choice {
            kinds.push(Kind::Choice(pb::ChoiceList { options: c }));
        }
        if let Some(g) = self.grammar {
            kinds.push(Kind::Grammar(g));
        }
        match kinds.len() {
            1 => Ok(pb::StructuredOutput {
                kind: kinds.pop(),
                strict: false,
            }),
            0 => Err(bad("structured_outputs sets none of json, json_object, regex, choice, grammar")),
            _ => Err(bad("structured_outputs sets more than one of json, json_object, regex, choice, grammar")),
        }
    }
}

/// OpenAI's `response_format` as a constraint (`text`: none).
fn response_format(v: &Value) -> Result<Option<pb::StructuredOutput>, ApiError> {
    use pb::structured_output::Kind;
    let bad = |m: String| ApiError::invalid("response_format", m);
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(pb::StructuredOutput {
            kind: Some(Kind::JsonObject(true)),
            strict: false,
        })),
        Some("json_schema") => {
            let spec = v.get("json_schema").ok_or_else(|| {
                bad("response_format of type json_schema needs a json_schema object".into())
            })?;
            let schema = spec
                .get("schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| {
                    bad("response_format.json_schema.schema must be a JSON schema object".into())
                })?;
            Ok(Some(pb::StructuredOutput {
                kind: Some(Kind::Json(schema.to_string())),
                strict: spec.get("strict").and_then(Value::as_bool).unwrap_or(false),
            }))
        }
        other => Err(bad(format!(
            "response_format.type must be text, json_object or json_schema, got {other:?}"
        ))),
    }
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: Option<Value>,
    #[serde(flatten)]
    common: Common,
    /// Fields neither OpenAI's nor ours (refused by name).
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Option<Vec<ChatMessageJson>>,
    #[serde(flatten)]
    common: Common,
    /// Fields neither OpenAI's nor ours (refused by name).
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

/// OpenAI parameters that do not change the answer (who asked, what to keep): accepted and
/// ignored.
const IGNORED_FIELDS: [&str; 4] = ["user", "metadata", "store", "service_tier"];

/// Refuses a body with top-level fields that are neither OpenAI's parameters nor this server's
/// extensions: a misspelled scheme object must not silently run the default scheme.
fn refuse_unknown_fields(rest: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    let unknown: Vec<String> = rest
        .keys()
        .filter(|k| !IGNORED_FIELDS.contains(&k.as_str()))
        .map(|k| {
            let clipped: String = k.chars().take(64).collect();
            format!("{clipped:?}")
        })
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    let shown = unknown.len().min(8);
    Err(ApiError {
        status: StatusCode::BAD_REQUEST,
        kind: "invalid_request_error",
        param: None,
        message: format!(
            "unknown field{} {}{}: not an OpenAI parameter this server takes, nor one of its \
             extensions (top_k, stop_token_ids, skip_special_tokens, stream_canvas, likelihood, \
             structured_outputs, \
             and the scheme objects ar, \
             diffusion_forcing, low_confidence, wino, diffusion_generate, block_diffusion, \
             plan_infill, entropy_bound); check the spelling",
            if unknown.len() == 1 { "" } else { "s" },
            unknown[..shown].join(", "),
            if unknown.len() > shown {
                format!(" and {} more", unknown.len() - shown)
            } else {
                String::new()
            },
        ),
    })
}

impl Common {
    /// How many completions the request asks for (`n`, 1 when unset), refused outside
    /// 1..=[`MAX_N`].
    fn completions(&self) -> Result<u32, ApiError> {
        match self.n.unwrap_or(1) {
            n @ 1..=MAX_N => Ok(n),
            n => Err(ApiError::invalid(
                "n",
                format!("n must be between 1 and {MAX_N}, got {n}"),
            )),
        }
    }

    /// The alternatives per token asked for with log-probabilities (`None`: none), in `kind`'s
    /// terms: completions' `logprobs` is a count; chat's `logprobs` a flag with the count in
    /// `top_logprobs`.
    fn logprobs(&self, kind: Kind) -> Result<Option<u32>, ApiError> {
        let count = |name: &'static str, v: &Value| match v.as_u64() {
            Some(n) if n <= MAX_TOP_LOGPROBS => Ok(n as u32),
            _ => Err(ApiError::invalid(
                name,
                format!("{name} must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {v}"),
            )),
        };
        let set = |v: &Option<Value>| v.as_ref().filter(|v| !v.is_null()).cloned();
        match kind {
            Kind::Completion => {
                if set(&self.top_logprobs).is_some() {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        "top_logprobs belongs to chat completions; on /v1/completions \
                         `logprobs` is the number of alternatives",
                    ));
                }
                set(&self.logprobs)
                    .map(|v| count("logprobs", &v))
                    .transpose()
            }
            Kind::Chat => {
                let on = match set(&self.logprobs) {
                    None => false,
                    Some(Value::Bool(b)) => b,
                    Some(v) => {
                        return Err(ApiError::invalid(
                            "logprobs",
                            format!(
                                "on chat completions logprobs is true or false (the number of \
                                 alternatives is top_logprobs), got {v}"
                            ),
                        ))
                    }
                };
                let top = set(&self.top_logprobs)
                    .map(|v| count("top_logprobs", &v))
                    .transpose()?;
                match (on, top) {
                    (false, Some(_)) => Err(ApiError::invalid(
                        "top_logprobs",
                        "top_logprobs needs logprobs: true",
                    )),
                    (false, None) => Ok(None),
                    (true, top) => Ok(Some(top.unwrap_or(0))),
                }
            }
        }
    }

    /// Refuses what is not served, and builds the request around `prompt`.
    fn request(
        self,
        prompt: Prompt,
        default_tokens: u32,
        kind: Kind,
    ) -> Result<pb::GenerateRequest, ApiError> {
        self.completions()?;
        let logprobs = self.logprobs(kind)?;
        let echo = self.echo == Some(true);
        if echo && kind == Kind::Chat {
            return Err(ApiError::invalid(
                "echo",
                "echo repeats a completion's prompt: it applies to /v1/completions",
            ));
        }
        if self.likelihood.is_some() && !echo {
            return Err(ApiError::invalid(
                "likelihood",
                "likelihood sets how masked diffusion scores the prompt: it needs echo and logprobs",
            ));
        }
        // The echoed prompt's entries (its text at least).
        let prompt_logprobs = echo.then(|| logprobs.unwrap_or(0));
        let structured = match (&self.response_format, self.structured_outputs) {
            (Some(rf), Some(_)) if !rf.is_null() => {
                return Err(ApiError::invalid(
                    "structured_outputs",
                    "set either response_format or structured_outputs, not both",
                ))
            }
            (Some(rf), None) if !rf.is_null() => response_format(rf)?,
            (_, Some(so)) => Some(so.proto()?),
            _ => None,
        };
        let unsupported: [(&'static str, bool); 6] = [
            ("best_of", self.best_of.is_some_and(|b| b != 1)),
            (
                "suffix",
                self.suffix.as_ref().is_some_and(|s| !s.is_empty()),
            ),
            (
                "logit_bias",
                self.logit_bias
                    .as_ref()
                    .is_some_and(|v| !v.is_null() && v != &json!({})),
            ),
            (
                "presence_penalty",
                self.presence_penalty.is_some_and(|p| p != 0.0),
            ),
            (
                "frequency_penalty",
                self.frequency_penalty.is_some_and(|p| p != 0.0),
            ),
            ("tools", self.tools.as_ref().is_some_and(|v| !v.is_null())),
        ];
        if let Some((name, _)) = unsupported.iter().find(|(_, set)| *set) {
            return Err(ApiError::invalid(
                name,
                format!("`{name}` is not supported by this server; leave it unset"),
            ));
        }
        let max_new_tokens = self
            .max_completion_tokens
            .or(self.max_tokens)
            .unwrap_or(default_tokens);
        let seed = match self.seed {
            Some(s) if s < 0 => {
                return Err(ApiError::invalid(
                    "seed",
                    format!("seed must be a non-negative integer, got {s}"),
                ))
            }
            s => s.map(|s| s as u64),
        };
        let stop_strings = match self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        // The proto's own messages, read from JSON under their field names.
        let mut schemes: Vec<Scheme> = [
            self.ar.map(Scheme::Ar),
            self.diffusion_forcing.map(Scheme::DiffusionForcing),
            self.low_confidence.map(Scheme::LowConfidence),
            self.wino.map(Scheme::Wino),
            self.plan_infill.map(Scheme::PlanInfill),
            self.diffusion_generate.map(Scheme::DiffusionGenerate),
            self.block_diffusion.map(Scheme::BlockDiffusion),
            self.entropy_bound.map(Scheme::EntropyBound),
        ]
        .into_iter()
        .flatten()
        .collect();
        if schemes.len() > 1 {
            return Err(ApiError::invalid(
                "scheme",
                "set at most one scheme object (ar, diffusion_forcing, low_confidence, wino, \
                 plan_infill, diffusion_generate, block_diffusion, entropy_bound)",
            ));
        }
        Ok(pb::GenerateRequest {
            n: None,
            model: self.model,
            prompt: Some(prompt),
            max_new_tokens,
            stop_token_ids: self.stop_token_ids.unwrap_or_default(),
            stop_strings,
            sampling: Some(pb::SamplingParams {
                // OpenAI's defaults: temperature 1, top_p 1 (no filter).
                temperature: self.temperature.unwrap_or(1.0),
                top_k: self.top_k.unwrap_or(0),
                top_p: self.top_p.unwrap_or(1.0),
                seed,
            }),
            stream_canvas: self.stream_canvas,
            scheme: schemes.pop(),
            skip_special_tokens: self.skip_special_tokens,
            logprobs,
            prompt_logprobs,
            likelihood: self.likelihood,
            structured_output: structured,
        })
    }
}

/// The prompt of a completion request: a string, one string in a list, or token ids.
fn completion_prompt(prompt: Option<Value>) -> Result<Prompt, ApiError> {
    let bad = |m: &str| Err(ApiError::invalid("prompt", m.to_owned()));
    match prompt {
        None | Some(Value::Null) => bad("prompt is missing"),
        Some(Value::String(s)) => Ok(Prompt::Text(s)),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return bad("prompt is an empty list");
            }
            if items.iter().all(Value::is_u64) {
                let ids: Option<Vec<u32>> = items
                    .iter()
                    .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                    .collect();
                return match ids {
                    Some(ids) => Ok(Prompt::TokenIds(pb::TokenIds { ids })),
                    None => bad("a token id does not fit in 32 bits"),
                };
            }
            match items.as_slice() {
                [Value::String(s)] => Ok(Prompt::Text(s.clone())),
                [Value::Array(_)] => completion_prompt(items.into_iter().next()),
                _ => bad("one prompt per request: send a string, a list of one string, or a list of token ids"),
            }
        }
        Some(_) => bad("prompt must be a string or a list of token ids"),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn new_id(prefix: &str) -> String {
    format!(
        "{prefix}-{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    )
}

fn finish_reason(r: i32) -> &'static str {
    match pb::FinishReason::try_from(r) {
        Ok(pb::FinishReason::StopToken | pb::FinishReason::StopString) => "stop",
        _ => "length",
    }
}

/// OpenAI's usage object: the prompt's tokens (counted once) and the completions'.
/// OpenAI's usage object. `cached` is `prompt_tokens_details.cached_tokens`: prompt tokens whose
/// rows were read from another request's pages (a running one's, or one the prefix cache kept)
/// instead of computed; for several choices, the fewest any choice read (the prompt counts once).
fn usage(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// The prompt rows a request read instead of computing them (its `shared_prompt_tokens`).
fn cached_tokens(stats: Option<&pb::GenerationStats>) -> u32 {
    stats
        .and_then(|s| s.counters.get("shared_prompt_tokens"))
        .map_or(0, |&n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// The two response shapes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(
    State(router): State<RouterService>,
    headers: HeaderMap,
    body: Result<JsonBody, JsonRejection>,
) -> Result<Response, ApiError> {
    refuse_content_encoding(&headers)?;
    let body: CompletionRequest = body?.parse()?;
    refuse_unknown_fields(&body.rest)?;
    let prompt = completion_prompt(body.prompt)?;
    let stream = body.common.stream;
    let include_usage = body
        .common
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let n = body.common.completions()?;
    let req = body
        .common
        .request(prompt, DEFAULT_COMPLETION_TOKENS, Kind::Completion)?;
    respond(
        router,
        headers,
        req,
        Kind::Completion,
        Answer {
            n,
            stream,
            include_usage,
        },
    )
    .await
}

async fn chat_completions(
    State(router): State<RouterService>,
    headers: HeaderMap,
    body: Result<JsonBody, JsonRejection>,
) -> Result<Response, ApiError> {
    refuse_content_encoding(&headers)?;
    let body = body?;
    // A chat no worker would take (too many messages, or too many tokens from the template's
    // per-message tokens alone) is refused from a scan of the body, before its messages are
    // built, converted and forwarded.
    body.refuse_chat(|model, messages| router.chat_refusal(model, messages))?;
    let body: ChatRequest = body.parse()?;
    refuse_unknown_fields(&body.rest)?;
    let Some(messages) = body.messages.filter(|m| !m.is_empty()) else {
        return Err(ApiError::invalid(
            "messages",
            "messages is missing or empty",
        ));
    };
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
    let stream = body.common.stream;
    let include_usage = body
        .common
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let n = body.common.completions()?;
    let req = body.common.request(
        Prompt::Chat(pb::ChatMessages { messages }),
        DEFAULT_CHAT_TOKENS,
        Kind::Chat,
    )?;
    let answer = Answer {
        n,
        stream,
        include_usage,
    };
    respond(router, headers, req, Kind::Chat, answer).await
}

/// How a request is answered: `n` completions, streamed or whole, with the usage chunk.
#[derive(Clone, Copy)]
struct Answer {
    n: u32,
    stream: bool,
    include_usage: bool,
}

use crate::service::completion_requests;

/// Sends `req` through the router (`n` times, one request per completion, all to one worker,
/// which shares the prompt's pages between them where the family allows it) and answers in
/// `kind`'s shape.
async fn respond(
    router: RouterService,
    headers: HeaderMap,
    req: pb::GenerateRequest,
    kind: Kind,
    answer: Answer,
) -> Result<Response, ApiError> {
    let asked = req.model.clone();
    let asked_logprobs = req.logprobs.is_some();
    // With echo, the prompt comes first (its text, and its entries before the answer's).
    let echoed = req.prompt_logprobs.is_some();
    let traced = |body: pb::GenerateRequest| {
        let mut request = tonic::Request::new(body);
        // W3C trace context: the HTTP request's span parents the router's.
        for name in ["traceparent", "tracestate"] {
            if let Some(v) = headers.get(name).and_then(|v| v.to_str().ok()) {
                if let Ok(v) = v.parse() {
                    request.metadata_mut().insert(name, v);
                }
            }
        }
        request
    };
    let requests = completion_requests(req, answer.n)
        .into_iter()
        .map(traced)
        .collect();
    let streams = router.stream_choices(requests).await?;
    let (id, created) = match kind {
        Kind::Completion => (new_id("cmpl"), unix_now()),
        Kind::Chat => (new_id("chatcmpl"), unix_now()),
    };
    if answer.stream {
        // Chunks before the final message name the model asked for, or the one that served it.
        let model = router.model_for(&asked);
        let sse = sse_events(
            streams,
            kind,
            id,
            created,
            answer.include_usage,
            model,
            asked_logprobs,
        );
        return Ok(Sse::new(sse)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let dones = futures::future::try_join_all(streams.into_iter().map(collect_done)).await?;
    let several = dones.len() > 1;
    let choices: Vec<Value> = dones
        .iter()
        .enumerate()
        .map(|(i, done)| {
            let reason = finish_reason(done.finish_reason);
            let lps: Vec<pb::TokenLogprob> = if echoed {
                done.prompt_logprobs
                    .iter()
                    .chain(&done.logprobs)
                    .cloned()
                    .collect()
            } else {
                done.logprobs.clone()
            };
            let logprobs = logprobs_json(kind, &lps, asked_logprobs, 0);
            let text = if echoed {
                format!("{}{}", done.prompt_text, done.text)
            } else {
                done.text.clone()
            };
            let mut choice = match kind {
                Kind::Completion => json!({
                    "index": i, "text": text, "finish_reason": reason, "logprobs": logprobs,
                }),
                Kind::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": done.text},
                    "finish_reason": reason,
                    "logprobs": logprobs,
                }),
            };
            if several {
                choice["wavefront"] = wavefront_extension(done);
            }
            choice
        })
        .collect();
    let object = match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion",
    };
    // The prompt counted once, as OpenAI does; the completions' tokens summed.
    let (prompt, completion) = dones.iter().fold((0, 0), |(p, c), d| {
        let s = d.stats.as_ref();
        (
            s.map_or(p, |s| s.prompt_tokens),
            c + s.map_or(0, |s| s.generated_tokens),
        )
    });
    let cached = dones
        .iter()
        .map(|d| cached_tokens(d.stats.as_ref()))
        .min()
        .unwrap_or(0);
    let first = &dones[0];
    Ok(Json(json!({
        "id": id,
        "object": object,
        "created": created,
        "model": first.model,
        "choices": choices,
        "usage": usage(prompt, completion, cached),
        "wavefront": wavefront_extension(first),
    }))
    .into_response())
}

/// The `wavefront` extension object: the response as `run --json` prints it, less the text the
/// choice already holds.
fn wavefront_extension(done: &pb::GenerateResponse) -> Value {
    let mut v = crate::json::response_json(done);
    if let Some(o) = v.as_object_mut() {
        o.remove("text");
        o.remove("logprobs");
        o.remove("prompt_logprobs");
    }
    v
}

type Events =
    std::pin::Pin<Box<dyn Stream<Item = Result<pb::GenerateStreamResponse, Status>> + Send>>;

async fn collect_done(mut events: Events) -> Result<pb::GenerateResponse, ApiError> {
    while let Some(item) = events.next().await {
        if let Some(PbEvent::Done(d)) = item?.event {
            return Ok(d);
        }
    }
    Err(Status::unavailable("the worker's stream ended without a final message").into())
}

/// The most alternatives per token (vLLM's and OpenAI's chat limit).
const MAX_TOP_LOGPROBS: u64 = 20;

/// A choice's `logprobs` object for these tokens (`null` when the request asked for none): for
/// chat, OpenAI's `content` list (token, logprob, UTF-8 bytes, top_logprobs); for completions,
/// the legacy lists (`tokens`, `token_logprobs`, `top_logprobs` as token → logprob maps, and
/// `text_offset`, in characters from `offset` on, over the tokens' own texts).
use crate::json::logprob_value;

fn logprobs_json(kind: Kind, lps: &[pb::TokenLogprob], asked: bool, offset: usize) -> Value {
    if !asked {
        return Value::Null;
    }
    let bytes = |s: &str| json!(s.as_bytes());
    match kind {
        Kind::Chat => json!({
            "content": lps.iter().map(|l| json!({
                "token": l.token,
                "logprob": logprob_value(l.logprob),
                "bytes": bytes(&l.token),
                "top_logprobs": l.top_logprobs.iter().map(|t| json!({
                    "token": t.token,
                    "logprob": logprob_value(t.logprob),
                    "bytes": bytes(&t.token),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "refusal": null,
        }),
        Kind::Completion => {
            // A token with no value (the prompt's first; a masked-diffusion condition) is null,
            // as OpenAI writes the echoed prompt's first token.
            let value = |l: &pb::TokenLogprob| {
                if l.logprob.is_nan() {
                    Value::Null
                } else {
                    logprob_value(l.logprob)
                }
            };
            let mut at = offset;
            let text_offset: Vec<usize> = lps
                .iter()
                .map(|l| {
                    let here = at;
                    at += l.token.chars().count();
                    here
                })
                .collect();
            json!({
                "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
                "token_logprobs": lps.iter().map(value).collect::<Vec<_>>(),
                "top_logprobs": lps.iter().map(|l| {
                    if l.logprob.is_nan() {
                        return Value::Null;
                    }
                    let mut m = serde_json::Map::new();
                    for t in &l.top_logprobs {
                        // Two ids with the same text: the more likely one (listed first) is kept.
                        m.entry(t.token.clone()).or_insert(logprob_value(t.logprob));
                    }
                    Value::Object(m)
                }).collect::<Vec<_>>(),
                "text_offset": text_offset,
            })
        }
    }
}

/// One SSE data event holding `v`.
fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

/// The router's event streams (one per completion) as OpenAI's chunks: text deltas of each
/// choice (its `index`), a chunk with each choice's finish reason, once every choice has
/// finished the usage chunk when asked (the prompt counted once), then `[DONE]`; canvas events
/// as SSE events named `canvas` (with the choice's `index` when there are several); a failure
/// as an error object, then `[DONE]`, and nothing after it.
fn sse_events(
    streams: Vec<Events>,
    kind: Kind,
    id: String,
    created: u64,
    include_usage: bool,
    mut model: String,
    asked_logprobs: bool,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    let object = match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion.chunk",
    };
    let chunk = move |model: &str, choice: Value, usage: Option<Value>| {
        let mut v = json!({
            "id": id, "object": object, "created": created, "model": model, "choices": [choice],
        });
        if include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        v
    };
    let delta = move |i: usize, text: &str, first: bool, reason: Option<&str>, lp: Value| match kind
    {
        Kind::Completion => {
            json!({"index": i, "text": text, "finish_reason": reason, "logprobs": lp})
        }
        Kind::Chat => {
            let mut d = json!({"content": text});
            if first {
                d["role"] = json!("assistant");
            }
            json!({"index": i, "delta": d, "finish_reason": reason, "logprobs": lp})
        }
    };
    // Completions' text offsets run on over a choice's chunks.
    let mut offsets = vec![0usize; streams.len()];
    let n = streams.len();
    let mut first = vec![true; n];
    let mut finished = 0;
    let (mut prompt_tokens, mut completion_tokens) = (0u32, 0u32);
    let mut cached = u32::MAX;
    let mut ended = false;
    futures::stream::select_all(
        streams
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.map(move |item| (i, item))),
    )
    .map(Some)
    .chain(futures::stream::once(async { None }))
    .flat_map(move |item| {
        let out: Vec<Event> = match item {
            _ if ended => Vec::new(),
            Some((
                i,
                Ok(pb::GenerateStreamResponse {
                    event: Some(PbEvent::Tokens(t)),
                }),
            )) => {
                if t.text.is_empty() && !first[i] && t.logprobs.is_empty() {
                    Vec::new()
                } else {
                    let lp = logprobs_json(kind, &t.logprobs, asked_logprobs, offsets[i]);
                    offsets[i] += t
                        .logprobs
                        .iter()
                        .map(|l| l.token.chars().count())
                        .sum::<usize>();
                    let c = chunk(&model, delta(i, &t.text, first[i], None, lp), None);
                    first[i] = false;
                    vec![data(&c)]
                }
            }
            // A streamed echo: the prompt's text and entries first (only completions echo).
            Some((
                i,
                Ok(pb::GenerateStreamResponse {
                    event: Some(PbEvent::Prompt(p)),
                }),
            )) => {
                let lp = logprobs_json(kind, &p.logprobs, asked_logprobs, offsets[i]);
                offsets[i] += p
                    .logprobs
                    .iter()
                    .map(|l| l.token.chars().count())
                    .sum::<usize>();
                let c = chunk(&model, delta(i, &p.text, first[i], None, lp), None);
                first[i] = false;
                vec![data(&c)]
            }
            Some((
                i,
                Ok(pb::GenerateStreamResponse {
                    event: Some(PbEvent::Canvas(c)),
                }),
            )) => {
                // As `run --stream-canvas` prints it (states by name).
                let mut v = crate::json::canvas_json(&c)["canvas"].clone();
                if n > 1 {
                    v["index"] = json!(i);
                }
                vec![Event::default().event("canvas").data(v.to_string())]
            }
            Some((
                i,
                Ok(pb::GenerateStreamResponse {
                    event: Some(PbEvent::Done(d)),
                }),
            )) => {
                model = d.model.clone();
                finished += 1;
                if let Some(s) = d.stats.as_ref() {
                    prompt_tokens = s.prompt_tokens;
                    completion_tokens += s.generated_tokens;
                }
                cached = cached.min(cached_tokens(d.stats.as_ref()));
                let mut out = vec![data(&chunk(
                    &d.model,
                    delta(
                        i,
                        "",
                        first[i],
                        Some(finish_reason(d.finish_reason)),
                        Value::Null,
                    ),
                    None,
                ))];
                if finished == n {
                    if include_usage {
                        let total = usage(prompt_tokens, completion_tokens, cached);
                        let mut u = chunk(&d.model, Value::Null, Some(total));
                        u["choices"] = json!([]);
                        out.push(data(&u));
                    }
                    out.push(Event::default().data("[DONE]"));
                    ended = true;
                }
                out
            }
            Some((_, Ok(pb::GenerateStreamResponse { event: None }))) => Vec::new(),
            Some((_, Err(s))) => {
                ended = true;
                let e = ApiError::from(s);
                vec![data(&e.body()), Event::default().data("[DONE]")]
            }
            // Every stream ended: after the final messages or an error nothing more is sent.
            None => Vec::new(),
        };
        futures::stream::iter(out.into_iter().map(Ok))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn common(v: Value) -> Common {
        serde_json::from_value(v).expect("parses")
    }

    #[test]
    fn unknown_top_level_fields_are_refused_by_name_and_known_ones_are_not() {
        let body: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "low_confidence": {"steps": 4}, "user": "u-1", "metadata": {"k": "v"},
        }))
        .unwrap();
        assert!(body.common.low_confidence.is_some());
        refuse_unknown_fields(&body.rest).expect("every field is known");

        let body: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "low_confidance": {"steps": 4}, "user": "u-1",
        }))
        .unwrap();
        let e = refuse_unknown_fields(&body.rest).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.starts_with("unknown field \"low_confidance\":"),
            "{}",
            e.message
        );

        // A field name as long as the body is quoted clipped; many are counted, not listed.
        let mut many = serde_json::Map::new();
        many.insert("x".repeat(100_000), json!(1));
        for i in 0..20 {
            many.insert(format!("f{i}"), json!(i));
        }
        many.insert("prompt".into(), json!("p"));
        let body: CompletionRequest = serde_json::from_value(Value::Object(many)).unwrap();
        let e = refuse_unknown_fields(&body.rest).unwrap_err();
        assert!(e.message.len() < 1024, "{} bytes", e.message.len());
        assert!(e.message.contains("and 13 more"), "{}", e.message);
    }

    #[test]
    fn compressed_bodies_are_refused_and_identity_is_not() {
        let mut h = HeaderMap::new();
        refuse_content_encoding(&h).expect("no encoding");
        h.insert("content-encoding", "identity".parse().unwrap());
        refuse_content_encoding(&h).expect("identity");
        h.insert("content-encoding", "gzip".parse().unwrap());
        let e = refuse_content_encoding(&h).unwrap_err();
        assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert!(e.message.contains("\"gzip\""), "{}", e.message);
    }

    #[test]
    fn error_bodies_quote_at_most_a_kilobyte() {
        let e = ApiError::invalid(
            "model",
            format!("model {:?} is not served", "m".repeat(1 << 20)),
        );
        let body = e.body().to_string();
        assert!(body.len() < 2048, "{} bytes", body.len());
        assert!(body.contains("bytes in all"), "{body}");
    }

    #[test]
    fn openai_parameters_and_extensions_map_onto_the_proto() {
        let req = common(json!({
            "model": "m", "max_tokens": 7, "temperature": 0.0, "seed": 3, "stop": ["a", "b"],
            "top_k": 5, "stop_token_ids": [2], "stream_canvas": true,
            "low_confidence": {"block_length": 8, "steps": 4, "surelock_eps": 0.01,
                               "kv_cache": "dual", "threshold": 0.9, "upstream_calls": true},
        }))
        .request(Prompt::Text("x".into()), 16, Kind::Completion)
        .unwrap();
        assert_eq!(req.max_new_tokens, 7);
        assert_eq!(req.stop_strings, ["a", "b"]);
        assert_eq!(req.stop_token_ids, [2]);
        let s = req.sampling.unwrap();
        assert_eq!(
            (s.temperature, s.top_k, s.top_p, s.seed),
            (0.0, 5, 1.0, Some(3))
        );
        assert!(req.stream_canvas);
        match req.scheme {
            Some(Scheme::LowConfidence(l)) => {
                assert_eq!(
                    (l.block_length, l.steps, l.surelock_eps),
                    (Some(8), Some(4), Some(0.01))
                );
                assert_eq!(
                    (l.kv_cache.as_str(), l.threshold, l.upstream_calls),
                    ("dual", Some(0.9), true)
                );
            }
            other => panic!("{other:?}"),
        }
        // max_completion_tokens wins; OpenAI's default temperature is 1.
        let req = common(json!({"max_tokens": 7, "max_completion_tokens": 9}))
            .request(Prompt::Text("x".into()), 16, Kind::Completion)
            .unwrap();
        assert_eq!(req.max_new_tokens, 9);
        assert_eq!(req.sampling.unwrap().temperature, 1.0);
    }

    #[test]
    fn what_is_not_served_is_refused_by_name() {
        for (body, param) in [
            (json!({"n": 0}), "n"),
            (json!({"n": 17}), "n"),
            (json!({"logprobs": 21}), "logprobs"),
            (json!({"logprobs": true}), "logprobs"),
            (json!({"top_logprobs": 2}), "top_logprobs"),
            (json!({"presence_penalty": 0.5}), "presence_penalty"),
            (json!({"likelihood": {"mc_samples": 8}}), "likelihood"),
            (json!({"ar": {}, "wino": {}}), "scheme"),
            (json!({"seed": -1}), "seed"),
        ] {
            let e = common(body)
                .request(Prompt::Text("x".into()), 16, Kind::Completion)
                .unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.param, Some(param), "{}", e.message);
        }
        // Chat's logprobs is a flag, its count top_logprobs (which needs the flag); chat has no
        // echo.
        for (body, param) in [
            (json!({"echo": true}), "echo"),
            (json!({"logprobs": 2}), "logprobs"),
            (json!({"top_logprobs": 2}), "top_logprobs"),
            (
                json!({"logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
        ] {
            let e = common(body)
                .request(Prompt::Text("x".into()), 16, Kind::Chat)
                .unwrap_err();
            assert_eq!(e.param, Some(param), "{}", e.message);
        }
        // Unknown fields inside a scheme object are refused by the parser.
        assert!(serde_json::from_value::<Common>(json!({"ar": {"num_stepz": 3}})).is_err());
    }

    #[test]
    fn response_format_and_structured_outputs_map_onto_the_proto() {
        use pb::structured_output::Kind;
        let so = |v: Value| {
            common(v)
                .request(Prompt::Text("x".into()), 16, super::Kind::Completion)
                .map(|r| r.structured_output)
        };
        assert_eq!(
            so(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        assert_eq!(
            so(json!({"response_format": {"type": "json_object"}}))
                .unwrap()
                .unwrap()
                .kind,
            Some(Kind::JsonObject(true))
        );
        let s = so(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}}))
        .unwrap()
        .unwrap();
        assert!(s.strict && matches!(s.kind, Some(Kind::Json(_))));
        assert_eq!(
            so(json!({"structured_outputs": {"choice": ["a", "b"]}}))
                .unwrap()
                .unwrap()
                .kind,
            Some(Kind::Choice(pb::ChoiceList {
                options: vec!["a".into(), "b".into()]
            }))
        );
        for bad in [
            json!({"response_format": {"type": "xml"}}),
            json!({"response_format": {"type": "json_schema"}}),
            json!({"structured_outputs": {}}),
            json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
            json!({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}),
        ] {
            assert!(so(bad.clone()).is_err(), "{bad}");
        }
        // Unknown keys inside structured_outputs are refused by the parser.
        assert!(
            serde_json::from_value::<Common>(json!({"structured_outputs": {"regx": "a"}})).is_err()
        );
    }

    #[test]
    fn logprobs_map_onto_the_proto_in_each_endpoints_terms() {
        let lp = |v: Value, kind| {
            common(v)
                .request(Prompt::Text("x".into()), 16, kind)
                .unwrap()
                .logprobs
        };
        assert_eq!(lp(json!({}), Kind::Completion), None);
        assert_eq!(lp(json!({"logprobs": 0}), Kind::Completion), Some(0));
        assert_eq!(lp(json!({"logprobs": 5}), Kind::Completion), Some(5));
        assert_eq!(lp(json!({"logprobs": false}), Kind::Chat), None);
        assert_eq!(lp(json!({"logprobs": true}), Kind::Chat), Some(0));
        assert_eq!(
            lp(json!({"logprobs": true, "top_logprobs": 3}), Kind::Chat),
            Some(3)
        );
    }

    #[test]
    fn logprobs_render_in_openais_two_shapes() {
        let tok = |token_id: u32, token: &str, logprob: f32| pb::TokenLogprob {
            token_id,
            logprob,
            token: token.into(),
            top_logprobs: vec![
                pb::TopLogprob {
                    token_id,
                    logprob,
                    token: token.into(),
                },
                pb::TopLogprob {
                    token_id: 9,
                    logprob: f32::NEG_INFINITY,
                    token: "é".into(),
                },
            ],
        };
        let lps = [tok(1, "ab", -0.5), tok(2, "c", -1.25)];
        assert_eq!(logprobs_json(Kind::Chat, &lps, false, 0), Value::Null);
        let chat = logprobs_json(Kind::Chat, &lps, true, 0);
        assert_eq!(chat["content"][0]["token"], "ab");
        assert_eq!(chat["content"][0]["logprob"], -0.5);
        assert_eq!(chat["content"][0]["bytes"], json!([97, 98]));
        assert_eq!(
            chat["content"][1]["top_logprobs"][1]["bytes"],
            json!([195, 169])
        );
        // Negative infinity is not JSON: vLLM's stand-in.
        assert_eq!(chat["content"][1]["top_logprobs"][1]["logprob"], -9999.0);
        let cmpl = logprobs_json(Kind::Completion, &lps, true, 3);
        assert_eq!(cmpl["tokens"], json!(["ab", "c"]));
        assert_eq!(cmpl["token_logprobs"], json!([-0.5, -1.25]));
        assert_eq!(cmpl["top_logprobs"][0], json!({"ab": -0.5, "é": -9999.0}));
        assert_eq!(cmpl["text_offset"], json!([3, 5]));
    }

    #[test]
    fn prompts_as_strings_lists_and_token_ids() {
        assert_eq!(
            completion_prompt(Some(json!("hi"))).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            completion_prompt(Some(json!(["hi"]))).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            completion_prompt(Some(json!([1, 2]))).unwrap(),
            Prompt::TokenIds(pb::TokenIds { ids: vec![1, 2] })
        );
        assert_eq!(
            completion_prompt(Some(json!([[1, 2]]))).unwrap(),
            Prompt::TokenIds(pb::TokenIds { ids: vec![1, 2] })
        );
        assert!(completion_prompt(Some(json!(["a", "b"]))).is_err());
        assert!(completion_prompt(None).is_err());
        assert!(completion_prompt(Some(json!([1u64 << 40]))).is_err());
        assert_eq!(
            message_text(
                Some(json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])),
                0
            )
            .unwrap(),
            "ab"
        );
        assert!(message_text(Some(json!([{"type": "image_url"}])), 0).is_err());
    }

    #[test]
    fn grpc_codes_become_the_matching_http_statuses() {
        for (code, status) in [
            (Code::InvalidArgument, 400),
            (Code::Unauthenticated, 401),
            (Code::NotFound, 404),
            (Code::ResourceExhausted, 429),
            (Code::Unavailable, 503),
            (Code::DeadlineExceeded, 504),
        ] {
            assert_eq!(
                ApiError::from(Status::new(code, "m")).status.as_u16(),
                status
            );
        }
    }
}
