//! The OpenAI-compatible HTTP front on a real router (`--http-listen`), over plain HTTP/1.1:
//! the same tokens as the gRPC API, server-sent events ending in `[DONE]`, OpenAI error
//! objects with their statuses, reflection in both versions, and a client that closes its
//! connection frees the request's slots.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::{json, Value};
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;
use wavefront_proto::worker::v1::worker_client::WorkerClient;
use wavefront_proto::worker::v1::LoadRequest;

use crate::harness::{
    channel, spawn_router, spawn_worker, wait_load, wait_serving, wait_whole, Proc,
};
use crate::metrics::free_port;

/// `POST path` with a JSON body; the status and the whole body (the server closes).
fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    let s = TcpStream::connect(addr).expect("http port");
    // Written on a thread of its own while this one reads: a server may answer (413) and
    // close before it has read the whole body, and the answer must not be lost to the reset.
    let mut w = s.try_clone().unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(request.as_bytes());
    });
    let response = read_response(s);
    let _ = writer.join();
    response
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("http port");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    read_response(s)
}

fn read_response(mut s: TcpStream) -> (u16, String) {
    let mut raw = Vec::new();
    // A reset after the answer (the server closed on an unread body) ends the read.
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let status = raw[9..12].parse().expect("status line");
    let (head, body) = raw.split_once("\r\n\r\n").expect("head and body");
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    (status, body)
}

/// The payload of a chunked body.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        body = &rest[n + 2..];
    }
    out
}

/// The `data:` payloads of an SSE body, and the names of other events.
fn sse(body: &str) -> (Vec<String>, Vec<String>) {
    let (mut data, mut events) = (Vec::new(), Vec::new());
    for block in body.split("\n\n") {
        for line in block.lines() {
            if let Some(d) = line.strip_prefix("data: ") {
                data.push(d.to_owned());
            } else if let Some(e) = line.strip_prefix("event: ") {
                events.push(e.to_owned());
            }
        }
    }
    (data, events)
}

struct HttpStack {
    worker: Proc,
    _router: Proc,
    grpc: SocketAddr,
    http: SocketAddr,
}

async fn http_stack(fixture: &str, name: &str) -> HttpStack {
    let worker = spawn_worker(fixture, &["--served-name", name]);
    wait_serving(worker.addr, "wavefront.worker.v1.Worker").await;
    let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let router = spawn_router(
        "127.0.0.1:0",
        &worker.addr.to_string(),
        200,
        &["--http-listen", &http.to_string()],
    );
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    HttpStack {
        grpc: router.addr,
        worker,
        _router: router,
        http,
    }
}

/// POSTs `body` to /v1/completions off the runtime's threads; the answer's text, which must come
/// with 200.
async fn completion_ok(http: SocketAddr, body: Value) -> String {
    let b = body.to_string();
    let (status, text) = tokio::task::spawn_blocking(move || post(http, "/v1/completions", &b))
        .await
        .unwrap();
    assert_eq!(status, 200, "{text}");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_match_the_grpc_api_unary_and_streamed() {
    let s = http_stack("huginn", "huginn-tiny").await;
    let http = s.http;
    let (status, body) = tokio::task::spawn_blocking(move || get(http, "/health"))
        .await
        .unwrap();
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
    let (status, body) = tokio::task::spawn_blocking(move || get(http, "/v1/models"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["data"][0]["id"], "huginn-tiny");
    assert_eq!(models["data"][0]["family"], "recurrent_depth");

    // The same request through gRPC.
    let grpc = GenerationClient::new(channel(s.grpc).await)
        .generate(pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::Text("You may copy".into())),
            max_new_tokens: 8,
            sampling: Some(pb::SamplingParams {
                seed: Some(5),
                ..Default::default()
            }),
            scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
                num_steps: Some(4),
                ..Default::default()
            })),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let body = json!({
        "model": "huginn-tiny", "prompt": "You may copy", "max_tokens": 8, "temperature": 0,
        "seed": 5, "ar": {"num_steps": 4},
    })
    .to_string();
    let b = body.clone();
    let (status, unary) = tokio::task::spawn_blocking(move || post(http, "/v1/completions", &b))
        .await
        .unwrap();
    assert_eq!(status, 200, "{unary}");
    let unary: Value = serde_json::from_str(&unary).unwrap();
    assert_eq!(unary["object"], "text_completion");
    assert_eq!(unary["choices"][0]["text"], grpc.text.as_str());
    assert_eq!(unary["choices"][0]["finish_reason"], "length");
    assert_eq!(unary["usage"]["completion_tokens"], 8);
    assert_eq!(
        unary["usage"]["total_tokens"],
        unary["usage"]["prompt_tokens"].as_u64().unwrap() + 8
    );
    let ids: Vec<u32> = serde_json::from_value(unary["wavefront"]["token_ids"].clone()).unwrap();
    assert_eq!(ids, grpc.token_ids);

    // Streamed: deltas add up to the same text; the finish reason, then usage, then [DONE].
    let mut streamed: Value = serde_json::from_str(&body).unwrap();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let b = streamed.to_string();
    let (status, events) = tokio::task::spawn_blocking(move || post(http, "/v1/completions", &b))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let (data, _) = sse(&events);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{events}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, grpc.text);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 8);
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert!(chunks.iter().all(|c| c["model"] == "huginn-tiny"));
    wait_whole(s.worker.addr, Duration::from_secs(10)).await;
}

/// `logprobs` over HTTP: completions' legacy lists (one entry per token, `text_offset` running
/// over the tokens' texts, `top_logprobs` maps of `logprobs` entries) carry the gRPC response's
/// values; streamed, the chunks' lists add up to the unary ones; refusals name the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_match_the_grpc_api_unary_and_streamed() {
    let s = http_stack("huginn", "huginn-tiny").await;
    let http = s.http;
    let grpc = GenerationClient::new(channel(s.grpc).await)
        .generate(pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::Text("You may copy".into())),
            max_new_tokens: 6,
            sampling: Some(pb::SamplingParams {
                seed: Some(5),
                ..Default::default()
            }),
            scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
                num_steps: Some(4),
                ..Default::default()
            })),
            logprobs: Some(3),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grpc.logprobs.len(), grpc.token_ids.len());
    for (lp, &id) in grpc.logprobs.iter().zip(&grpc.token_ids) {
        assert_eq!(lp.token_id, id);
        assert!(lp.logprob <= 0.0 && lp.top_logprobs.len() == 3, "{lp:?}");
        // Greedy: the token is its distribution's most likely.
        assert_eq!(lp.top_logprobs[0].token_id, id);
        assert_eq!(lp.top_logprobs[0].logprob, lp.logprob);
    }
    let body = json!({
        "model": "huginn-tiny", "prompt": "You may copy", "max_tokens": 6, "temperature": 0,
        "seed": 5, "ar": {"num_steps": 4}, "logprobs": 3,
    });
    let b = body.to_string();
    let (status, unary) = tokio::task::spawn_blocking(move || post(http, "/v1/completions", &b))
        .await
        .unwrap();
    assert_eq!(status, 200, "{unary}");
    let unary: Value = serde_json::from_str(&unary).unwrap();
    let lp = &unary["choices"][0]["logprobs"];
    // JSON holds each float32 value's shortest decimal: read back as float32, it is the value.
    let want: Vec<f32> = grpc.logprobs.iter().map(|l| l.logprob).collect();
    let got: Vec<f32> = serde_json::from_value(lp["token_logprobs"].clone()).unwrap();
    assert_eq!(got, want);
    let tokens: Vec<String> = serde_json::from_value(lp["tokens"].clone()).unwrap();
    assert_eq!(
        tokens,
        grpc.logprobs
            .iter()
            .map(|l| l.token.clone())
            .collect::<Vec<_>>()
    );
    let offsets: Vec<usize> = serde_json::from_value(lp["text_offset"].clone()).unwrap();
    assert_eq!(offsets[0], 0);
    assert_eq!(offsets[1], tokens[0].chars().count());
    assert!(lp["top_logprobs"].as_array().unwrap().iter().all(|m| {
        let m = m.as_object().unwrap();
        !m.is_empty() && m.len() <= 3
    }));
    // The extension object does not repeat them.
    assert!(unary["wavefront"].get("logprobs").is_none());

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let b = streamed.to_string();
    let (status, events) = tokio::task::spawn_blocking(move || post(http, "/v1/completions", &b))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let (data, _) = sse(&events);
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let mut streamed_lp = Vec::new();
    let mut streamed_offsets = Vec::new();
    for c in &chunks {
        let l = &c["choices"][0]["logprobs"];
        if l.is_null() {
            continue;
        }
        streamed_lp
            .extend(serde_json::from_value::<Vec<f32>>(l["token_logprobs"].clone()).unwrap());
        streamed_offsets
            .extend(serde_json::from_value::<Vec<usize>>(l["text_offset"].clone()).unwrap());
    }
    assert_eq!(streamed_lp, want);
    assert_eq!(streamed_offsets, offsets);

    // echo: the prompt's entries first (the first token's null), what evaluation harnesses
    // read a continuation's log-likelihood from; max_tokens 0 only scores.
    let scored = GenerationClient::new(channel(s.grpc).await)
        .generate(pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::Text("You may copy".into())),
            max_new_tokens: 0,
            scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
                num_steps: Some(4),
                ..Default::default()
            })),
            sampling: Some(pb::SamplingParams {
                seed: Some(5),
                ..Default::default()
            }),
            prompt_logprobs: Some(1),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(scored.token_ids.is_empty());
    assert!(scored.prompt_logprobs.len() > 1 && scored.prompt_logprobs[0].logprob.is_nan());
    for (max_tokens, extra) in [(0, 0), (1, 1)] {
        let mut b = body.clone();
        b["echo"] = json!(true);
        b["logprobs"] = json!(1);
        b["max_tokens"] = json!(max_tokens);
        let unary = b.to_string();
        let (status, echoed) =
            tokio::task::spawn_blocking(move || post(http, "/v1/completions", &unary))
                .await
                .unwrap();
        assert_eq!(status, 200, "{echoed}");
        let echoed: Value = serde_json::from_str(&echoed).unwrap();
        let choice = &echoed["choices"][0];
        assert!(choice["text"]
            .as_str()
            .unwrap()
            .starts_with(&scored.prompt_text));
        let got = &choice["logprobs"]["token_logprobs"];
        let n = scored.prompt_logprobs.len();
        assert_eq!(got.as_array().unwrap().len(), n + extra, "{choice}");
        assert!(got[0].is_null() && choice["logprobs"]["top_logprobs"][0].is_null());
        let want: Vec<f32> = scored.prompt_logprobs[1..]
            .iter()
            .map(|l| l.logprob)
            .collect();
        let got: Vec<f32> =
            serde_json::from_value(Value::Array(got.as_array().unwrap()[1..n].to_vec())).unwrap();
        assert_eq!(got, want);

        // Streamed, the prompt's text and entries come first, in one chunk; joined, the chunks
        // are the unary answer.
        b["stream"] = json!(true);
        let b = b.to_string();
        let (status, events) =
            tokio::task::spawn_blocking(move || post(http, "/v1/completions", &b))
                .await
                .unwrap();
        assert_eq!(status, 200, "{events}");
        let (data, _) = sse(&events);
        let chunks: Vec<Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        assert_eq!(
            chunks[0]["choices"][0]["text"].as_str().unwrap(),
            scored.prompt_text
        );
        let (mut text, mut entries, mut offsets) = (String::new(), Vec::new(), Vec::new());
        for c in &chunks {
            text.push_str(c["choices"][0]["text"].as_str().unwrap_or(""));
            let l = &c["choices"][0]["logprobs"];
            if !l.is_null() {
                entries.extend(l["token_logprobs"].as_array().unwrap().iter().cloned());
                offsets.extend(l["text_offset"].as_array().unwrap().iter().cloned());
            }
        }
        assert_eq!(text, choice["text"].as_str().unwrap());
        assert_eq!(Value::Array(entries), choice["logprobs"]["token_logprobs"]);
        assert_eq!(Value::Array(offsets), choice["logprobs"]["text_offset"]);
    }

    // Chat's terms on the completions endpoint, and counts past 20, are refused by name.
    for (bad, param) in [
        (json!({"logprobs": 21}), "logprobs"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
    ] {
        let mut b = body.clone();
        b.as_object_mut()
            .unwrap()
            .extend(bad.as_object().unwrap().clone());
        let b = b.to_string();
        let (status, err) = tokio::task::spawn_blocking(move || post(http, "/v1/completions", &b))
            .await
            .unwrap();
        assert_eq!(status, 400, "{err}");
        let err: Value = serde_json::from_str(&err).unwrap();
        assert_eq!(err["error"]["param"], param, "{err}");
    }
    wait_whole(s.worker.addr, Duration::from_secs(10)).await;
}

/// The tokenizer over gRPC and HTTP (vLLM's `/tokenize`, `/detokenize`, `/tokenizer_info`, an
/// evaluation harness's remote tokenizer): ids are what a prompt becomes (the gRPC answer's
/// prompt count), text round-trips, and bad input is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tokenizer_is_served_over_grpc_and_http() {
    let s = http_stack("huginn", "huginn-tiny").await;
    let http = s.http;
    let mut grpc = GenerationClient::new(channel(s.grpc).await);
    let ids = grpc
        .tokenize(pb::TokenizeRequest {
            input: Some(pb::tokenize_request::Input::Text("You may copy".into())),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let generated = grpc
        .generate(pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::Text("You may copy".into())),
            max_new_tokens: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        ids.token_ids.len() as u32,
        generated.stats.unwrap().prompt_tokens,
        "Tokenize gives the ids a prompt becomes"
    );
    assert_eq!(ids.model, "huginn-tiny");
    let text = grpc
        .detokenize(pb::DetokenizeRequest {
            token_ids: ids.token_ids.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(text.text.trim_start(), "You may copy");
    let info = grpc
        .get_tokenizer(pb::GetTokenizerRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(info.vocab_size > 0 && info.max_context > 0, "{info:?}");

    let b = json!({"prompt": "You may copy", "add_special_tokens": false}).to_string();
    let (status, body) = tokio::task::spawn_blocking(move || post(http, "/tokenize", &b))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let tok: Value = serde_json::from_str(&body).unwrap();
    let tokens: Vec<u32> = serde_json::from_value(tok["tokens"].clone()).unwrap();
    assert_eq!(tok["count"], tokens.len());
    let b = json!({"tokens": tokens}).to_string();
    let (status, body) = tokio::task::spawn_blocking(move || post(http, "/detokenize", &b))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let de: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(de["prompt"].as_str().unwrap().trim_start(), "You may copy");
    let (status, body) =
        tokio::task::spawn_blocking(move || get(http, "/tokenizer_info?model=huginn-tiny"))
            .await
            .unwrap();
    assert_eq!(status, 200, "{body}");
    let info: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(info["model"], "huginn-tiny");
    assert!(info["model_max_length"].as_u64().unwrap() > 0);
    for (path, body, param) in [
        ("/tokenize", json!({"promt": "x"}), None),
        ("/tokenize", json!({}), Some("prompt")),
        ("/detokenize", json!({"tokens": [u32::MAX]}), None),
    ] {
        let b = body.to_string();
        let (status, err) = tokio::task::spawn_blocking(move || post(http, path, &b))
            .await
            .unwrap();
        assert_eq!(status, 400, "{path} {err}");
        if let Some(param) = param {
            let err: Value = serde_json::from_str(&err).unwrap();
            assert_eq!(err["error"]["param"], param);
        }
    }
    let (status, _) = tokio::task::spawn_blocking(move || get(http, "/tokenizer_info?model=nope"))
        .await
        .unwrap();
    assert_eq!(status, 404);
}

/// `n` over gRPC, through the router: `Generate` answers choice 0 with every choice in
/// `choices` (each indexed, completion i as the request alone with seed + i), the stream's
/// messages carry their choice's index and end with one final message per choice; a worker
/// refuses n > 1, and the router n outside 1..=16.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_completions_over_grpc_are_indexed_and_seeded_apart() {
    use futures::StreamExt;
    let s = http_stack("huginn", "huginn-tiny").await;
    let mut grpc = GenerationClient::new(channel(s.grpc).await);
    let req = |n: Option<u32>, seed: u64| pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text("You may copy".into())),
        max_new_tokens: 8,
        sampling: Some(pb::SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..Default::default()
        }),
        n,
        ..Default::default()
    };
    let r = grpc.generate(req(Some(3), 40)).await.unwrap().into_inner();
    assert_eq!(r.choices.len(), 3);
    for (i, c) in r.choices.iter().enumerate() {
        assert_eq!(c.index, i as u32);
        let alone = grpc
            .generate(req(None, 40 + i as u64))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(c.token_ids, alone.token_ids, "choice {i}");
    }
    assert_eq!(r.token_ids, r.choices[0].token_ids);
    assert!(
        r.choices[0].token_ids != r.choices[1].token_ids
            || r.choices[1].token_ids != r.choices[2].token_ids,
        "three seeds drew the same tokens"
    );
    let mut stream = grpc
        .generate_stream(req(Some(3), 40))
        .await
        .unwrap()
        .into_inner();
    let mut tokens = vec![Vec::new(); 3];
    let mut done = 0;
    while let Some(m) = stream.next().await {
        match m.unwrap().event {
            Some(pb::generate_stream_response::Event::Tokens(t)) => {
                tokens[t.index as usize].extend(t.token_ids)
            }
            Some(pb::generate_stream_response::Event::Done(d)) => {
                assert_eq!(d.token_ids, r.choices[d.index as usize].token_ids);
                done += 1;
            }
            _ => {}
        }
    }
    assert_eq!(done, 3);
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(*t, r.choices[i].token_ids, "streamed choice {i}");
    }
    let err = grpc.generate(req(Some(17), 1)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    let mut worker = GenerationClient::new(channel(s.worker.addr).await);
    let err = worker.generate(req(Some(2), 1)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(err.message().contains("router"), "{err}");
    wait_whole(s.worker.addr, Duration::from_secs(10)).await;
}

/// `n` completions in one request: choice `i` drawn with seed + i, so choice 0 is the request
/// alone, the same request gives the same choices, and they differ from each other; streamed,
/// each choice's deltas carry its index and add up to its unary text, one usage chunk counts
/// the prompt once and every completion's tokens, one `[DONE]` ends it; every slot comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_completions_per_request_are_seeded_apart_and_reproducible() {
    let s = http_stack("huginn", "huginn-tiny").await;
    let http = s.http;
    let ask = |body: Value| async move {
        let b = body.to_string();
        tokio::task::spawn_blocking(move || post(http, "/v1/completions", &b))
            .await
            .unwrap()
    };
    let body = json!({
        "model": "huginn-tiny", "prompt": "You may copy", "max_tokens": 8, "temperature": 1.0,
        "seed": 7, "n": 3, "ar": {"num_steps": 4},
    });
    let (status, unary) = ask(body.clone()).await;
    assert_eq!(status, 200, "{unary}");
    let unary: Value = serde_json::from_str(&unary).unwrap();
    let texts: Vec<String> = (0..3)
        .map(|i| {
            assert_eq!(unary["choices"][i]["index"], i);
            unary["choices"][i]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(unary["choices"].as_array().unwrap().len(), 3);
    assert_eq!(unary["usage"]["completion_tokens"], 24, "{unary}");
    let prompt_tokens = unary["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(unary["usage"]["total_tokens"], prompt_tokens + 24);
    assert_eq!(
        unary["choices"][2]["wavefront"]["stats"]["seed"], 9,
        "{unary}"
    );
    let distinct: std::collections::HashSet<&String> = texts.iter().collect();
    assert!(
        distinct.len() >= 2,
        "three draws at temperature 1 gave {texts:?}"
    );
    // The same request again: the same choices.
    let (_, again) = ask(body.clone()).await;
    let again: Value = serde_json::from_str(&again).unwrap();
    for i in 0..3 {
        for field in ["text", "finish_reason"] {
            assert_eq!(again["choices"][i][field], unary["choices"][i][field]);
        }
        let ids = |v: &Value| v["choices"][i]["wavefront"]["token_ids"].clone();
        assert_eq!(ids(&again), ids(&unary), "choice {i}");
    }
    // Choice 0 is the request alone with its seed; choice 2 the request with seed + 2.
    for (i, seed) in [(0, 7), (2, 9)] {
        let mut one = body.clone();
        one["n"] = json!(1);
        one["seed"] = json!(seed);
        let (_, alone) = ask(one).await;
        let alone: Value = serde_json::from_str(&alone).unwrap();
        assert_eq!(alone["choices"][0]["text"], texts[i].as_str(), "choice {i}");
    }
    // Streamed.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, events) = ask(streamed).await;
    assert_eq!(status, 200);
    let (data, _) = sse(&events);
    assert_eq!(
        data.iter().filter(|d| *d == "[DONE]").count(),
        1,
        "{events}"
    );
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{events}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    for (i, text) in texts.iter().enumerate() {
        let got: String = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == i)
            .filter_map(|c| c["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(&got, text, "choice {i}");
        assert_eq!(
            chunks
                .iter()
                .filter(|c| c["choices"][0]["index"] == i
                    && !c["choices"][0]["finish_reason"].is_null())
                .count(),
            1,
            "one finish chunk for choice {i}"
        );
    }
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 24);
    assert_eq!(usage["usage"]["prompt_tokens"], prompt_tokens);
    // Out of range.
    let mut many = body.clone();
    many["n"] = json!(17);
    let (status, err) = ask(many).await;
    assert_eq!(status, 400, "{err}");
    assert!(err.contains("n must be between 1 and 16"), "{err}");
    wait_whole(s.worker.addr, Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_with_a_scheme_canvas_events_and_openai_errors() {
    let s = http_stack("llada", "llada").await;
    let http = s.http;
    let chat = json!({
        "model": "llada",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        "max_tokens": 16, "temperature": 0, "stream": true, "stream_canvas": true,
        "wino": {"block_length": 8},
    })
    .to_string();
    let (status, events) =
        tokio::task::spawn_blocking(move || post(http, "/v1/chat/completions", &chat))
            .await
            .unwrap();
    assert_eq!(status, 200, "{events}");
    let (data, names) = sse(&events);
    assert!(
        names.iter().any(|n| n == "canvas"),
        "canvas events: {events}"
    );
    // Shaped as `run --stream-canvas` prints them: states by name.
    let canvas: Value = serde_json::from_str(
        data.iter()
            .find(|d| d.contains("\"states\""))
            .expect("a canvas payload"),
    )
    .unwrap();
    let states = canvas["states"].as_array().expect("states");
    assert!(!states.is_empty());
    assert!(
        states.iter().all(|s| matches!(
            s.as_str(),
            Some("masked" | "drafted" | "committed" | "locked")
        )),
        "{canvas}"
    );
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let first: Value = serde_json::from_str(
        data.iter()
            .find(|d| d.contains("chat.completion.chunk"))
            .expect("a chunk"),
    )
    .unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    // The reply's text leaves out special tokens (end of text, end of turn, masks).
    let reply: String = data
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert!(!reply.contains("<|"), "{reply:?}");

    // Errors: OpenAI's error object, the matching status, a message that says what to fix.
    let cases = [
        (
            json!({"model": "llada", "prompt": "x", "n": 0}),
            400,
            "n must be between 1 and 16",
        ),
        (json!({"model": "nope", "prompt": "x"}), 404, "not served"),
        (
            json!({"model": "llada", "prompt": "x", "max_tokens": 10, "low_confidence": {"block_length": 4, "steps": 5}}),
            400,
            "low_confidence.steps (5) must be divisible by the number of blocks",
        ),
        (
            json!({"model": "llada", "prompt": "x", "temperature": -1}),
            400,
            "temperature",
        ),
        (json!({"model": "llada"}), 400, "prompt"),
    ];
    for (body, want, needle) in cases {
        let b = body.to_string();
        let (status, text) = tokio::task::spawn_blocking(move || post(http, "/v1/completions", &b))
            .await
            .unwrap();
        assert_eq!(status, want, "{body}: {text}");
        let err: Value = serde_json::from_str(&text).unwrap();
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{body}: {message}");
    }
    let (status, _) = tokio::task::spawn_blocking(move || {
        post(
            http,
            "/v1/completions",
            &format!("{{\"prompt\": \"{}\"}}", "a".repeat(5 << 20)),
        )
    })
    .await
    .unwrap();
    assert_eq!(status, 413);
    wait_whole(s.worker.addr, Duration::from_secs(10)).await;
}

/// DiffusionGemma through the OpenAI API: a chat with OpenAI's default temperature (which
/// leaves its schedule as it is) and the `entropy_bound` extension, streamed with canvas events;
/// a temperature the schedule would override is refused naming what to set instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diffusion_gemma_over_openai_chat() {
    let s = http_stack("diffusion_gemma", "diffusion_gemma").await;
    let http = s.http;
    let chat = json!({
        "model": "diffusion_gemma",
        "messages": [{"role": "user", "content": "What is free software?"}],
        "max_tokens": 20, "seed": 4, "stream": true, "stream_canvas": true,
        "entropy_bound": {"max_denoising_steps": 8, "t_max": 0.9},
    })
    .to_string();
    let (status, events) =
        tokio::task::spawn_blocking(move || post(http, "/v1/chat/completions", &chat))
            .await
            .unwrap();
    assert_eq!(status, 200, "{events}");
    let (data, names) = sse(&events);
    assert!(
        names.iter().any(|n| n == "canvas"),
        "canvas events: {events}"
    );
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let body = json!({"model": "diffusion_gemma", "prompt": "x", "temperature": 0.5}).to_string();
    let (status, text) = tokio::task::spawn_blocking(move || post(http, "/v1/completions", &body))
        .await
        .unwrap();
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("t_max and t_min"), "{text}");
    wait_whole(s.worker.addr, Duration::from_secs(10)).await;
}

/// A client that closes its connection mid-stream cancels the request: its slots come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_connection_cancels_the_request_and_frees_its_slots() {
    let s = http_stack("huginn", "huginn-tiny").await;
    let http = s.http;
    let body = json!({
        "prompt": "You may copy", "max_tokens": 240, "stream": true, "ar": {"num_steps": 32},
    })
    .to_string();
    let mut conn = TcpStream::connect(http).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 256];
    let n = conn.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    wait_load(s.worker.addr, "running while the client reads", |m| {
        m.active_requests == 1
    })
    .await;
    drop(conn);
    wait_whole(s.worker.addr, Duration::from_secs(10)).await;
}

/// Reflection answers in v1 and v1alpha, and the router lists only its public APIs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_v1alpha_lists_the_public_apis_only() {
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
    let s = http_stack("huginn", "huginn-tiny").await;
    for (addr, worker_api) in [(s.grpc, false), (s.worker.addr, true)] {
        let mut client = ServerReflectionClient::new(channel(addr).await);
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut resp = client
            .server_reflection_info(futures::stream::iter(vec![req]))
            .await
            .expect("v1alpha")
            .into_inner();
        let names: Vec<String> = match resp.message().await.unwrap().unwrap().message_response {
            Some(MessageResponse::ListServicesResponse(l)) => {
                l.service.into_iter().map(|s| s.name).collect()
            }
            other => panic!("{other:?}"),
        };
        assert!(
            names.contains(&"wavefront.v1.Generation".to_owned()),
            "{names:?}"
        );
        assert_eq!(
            names.contains(&"wavefront.worker.v1.Worker".to_owned()),
            worker_api,
            "{addr}: {names:?}"
        );
    }
}

/// `POST path` with an `Authorization: Bearer` header when `key` is given.
fn post_with_key(addr: SocketAddr, path: &str, body: &str, key: Option<&str>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("http port");
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{auth}\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    read_response(s)
}

/// API keys on the router's public gRPC and HTTP endpoints, a token on router-to-worker calls;
/// health stays open; a router without the worker's token cannot use it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_and_the_worker_token_are_required_and_health_stays_open() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let worker = spawn_worker(
        "huginn",
        &["--served-name", "huginn-tiny", "--worker-token", "w0rker"],
    );
    // Health needs no token (probes).
    wait_serving(worker.addr, "wavefront.worker.v1.Worker").await;
    let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    // One key on the command line, one from a file of keys.
    let keys_file = std::env::temp_dir().join(format!("wavefront-keys-{}", std::process::id()));
    std::fs::write(&keys_file, "# keys\nkey-two\n").unwrap();
    let router = spawn_router(
        "127.0.0.1:0",
        &worker.addr.to_string(),
        200,
        &[
            "--http-listen",
            &http.to_string(),
            "--api-key",
            "key-one",
            "--api-key-file",
            keys_file.to_str().unwrap(),
            "--worker-token",
            "w0rker",
        ],
    );
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    let _ = std::fs::remove_file(&keys_file); // read at start-up
    let req = || pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text("You may copy".into())),
        max_new_tokens: 2,
        ..Default::default()
    };
    let with_key = |key: &str| {
        let mut r = tonic::Request::new(req());
        r.metadata_mut()
            .insert("authorization", format!("Bearer {key}").parse().unwrap());
        r
    };
    let mut client = GenerationClient::new(channel(router.addr).await);
    let err = client.generate(req()).await.expect_err("no key");
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    assert!(err.message().contains("API key"), "{err:?}");
    let err = client
        .generate(with_key("key-three"))
        .await
        .expect_err("wrong key");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    // The key from the file works, through the worker's token.
    let ok = client
        .generate(with_key("key-two"))
        .await
        .expect("a good key");
    assert_eq!(ok.into_inner().token_ids.len(), 2);
    let mut h = HealthClient::new(channel(router.addr).await);
    h.check(HealthCheckRequest {
        service: String::new(),
    })
    .await
    .expect("health needs no key");

    // HTTP: 401 with OpenAI's error object, 200 with a key; /health open.
    let body = r#"{"prompt": "You may copy", "max_tokens": 2}"#;
    let (status, text) =
        tokio::task::spawn_blocking(move || post_with_key(http, "/v1/completions", body, None))
            .await
            .unwrap();
    assert_eq!(status, 401, "{text}");
    let err: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(err["error"]["type"], "authentication_error");
    let (status, text) = tokio::task::spawn_blocking(move || {
        post_with_key(http, "/v1/completions", body, Some("key-one"))
    })
    .await
    .unwrap();
    assert_eq!(status, 200, "{text}");
    let (status, _) = tokio::task::spawn_blocking(move || get(http, "/health"))
        .await
        .unwrap();
    assert_eq!(status, 200);

    // The worker refuses calls without its token, on both of its APIs.
    let err = GenerationClient::new(channel(worker.addr).await)
        .generate(req())
        .await
        .expect_err("no token");
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    let err = WorkerClient::new(channel(worker.addr).await)
        .get_load(LoadRequest { interval_ms: 0 })
        .await
        .expect_err("no token");
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    // A router with the wrong token never sees the worker up.
    let stranger = spawn_router(
        "127.0.0.1:0",
        &worker.addr.to_string(),
        200,
        &["--worker-token", "guess"],
    );
    wait_serving(stranger.addr, "").await;
    let err = GenerationClient::new(channel(stranger.addr).await)
        .generate(req())
        .await
        .expect_err("worker unreachable without its token");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
}

/// OpenAI's `usage.prompt_tokens_details.cached_tokens`: a prompt's second request reads the
/// pages the first left in the prefix cache (40 tokens: two whole pages before the last one),
/// unary and streamed; a prompt that only begins like it reads their common pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_reports_the_tokens_it_read_from_the_prefix_cache() {
    let s = http_stack("refusion", "refusion").await;
    let ask = |body: Value| completion_ok(s.http, body);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 480).collect();
    let body = json!({
        "model": "refusion", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ar": {},
    });
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    let first: Value = serde_json::from_str(&ask(body.clone()).await).unwrap();
    assert_eq!(cached(&first), 0, "{first}");
    let second: Value = serde_json::from_str(&ask(body.clone()).await).unwrap();
    assert_eq!(cached(&second), 32, "{second}");
    assert_eq!(
        second["wavefront"]["token_ids"],
        first["wavefront"]["token_ids"]
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = ask(streamed).await;
    let (data, _) = sse(&events);
    let usage: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(cached(&usage), 32, "{events}");
    // The same 40 tokens and 8 of its own: the common prefix's two pages.
    let mut longer = body.clone();
    longer["prompt"] = json!(prompt
        .iter()
        .copied()
        .chain((0..8).map(|i| 400 + i))
        .collect::<Vec<u32>>());
    let third: Value = serde_json::from_str(&ask(longer).await).unwrap();
    assert_eq!(cached(&third), 32, "{third}");
    wait_whole(s.worker.addr, Duration::from_secs(10)).await;
}

/// `n` choices go to one worker, which shares their prompt's pages: with two workers serving
/// the model, two of the three choices of an `ar` request on ReFusion read the third's prompt
/// pages (their statistics count the shared rows), and each is still the request alone with
/// its seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_choices_of_a_request_share_their_prompt_pages_on_one_worker() {
    let a = spawn_worker("refusion", &["--served-name", "refusion"]);
    let b = spawn_worker("refusion", &["--served-name", "refusion"]);
    wait_serving(a.addr, "wavefront.worker.v1.Worker").await;
    wait_serving(b.addr, "wavefront.worker.v1.Worker").await;
    let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let router = spawn_router(
        "127.0.0.1:0",
        &format!("{},{}", a.addr, b.addr),
        200,
        &["--http-listen", &http.to_string()],
    );
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    let ask = |body: Value| async move {
        serde_json::from_str::<Value>(&completion_ok(http, body).await).unwrap()
    };
    // 40 prompt tokens: two whole pages before the last one. The choices reach the worker as
    // three calls; a choice that arrives after the others have finished reads the pages the
    // prefix cache kept (before the cache it computed them again: seeds 3-5, with 6 tokens,
    // drew 4, 4 and 6, and under a CPU hog the third choice arrived after the first two had
    // finished; seeds 15-17 draw 22, 32 and 25 tokens).
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 480).collect();
    let body = json!({
        "model": "refusion", "prompt": prompt, "max_tokens": 32, "temperature": 0.9,
        "seed": 15, "n": 3, "ar": {},
    });
    let got = ask(body.clone()).await;
    let shared: Vec<u64> = (0..3)
        .map(|i| {
            got["choices"][i]["wavefront"]["stats"]["counters"]["shared_prompt_tokens"]
                .as_u64()
                .unwrap_or(0)
        })
        .collect();
    // Whichever choice the worker admitted first computed the prompt.
    let mut sorted = shared.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, [0, 32, 32], "{got}");
    for i in 0..3u64 {
        let mut one = body.clone();
        one["n"] = json!(1);
        one["seed"] = json!(15 + i);
        let alone = ask(one).await;
        assert_eq!(
            alone["wavefront"]["token_ids"], got["choices"][i as usize]["wavefront"]["token_ids"],
            "choice {i}"
        );
    }
    drop(router);
    wait_whole(a.addr, Duration::from_secs(10)).await;
    wait_whole(b.addr, Duration::from_secs(10)).await;
}
