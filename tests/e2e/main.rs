//! End-to-end tests: real `wavefront router` and `wavefront worker`
//! processes on loopback, called through generated gRPC clients.

mod diffusion_gemma;
mod diffusion_models;
mod faults;
mod harness;
mod hostile;
mod http;
mod metrics;
mod migration;
mod operations;
mod paging;
mod recurrent_memory;
mod slot_diffusion;
mod soak;
mod tls;
mod tracing;
mod trained_models;

use std::time::Duration;

use harness::{
    channel, fixture, json_lines, json_result, served_models, spawn, spawn_worker, stack,
    wait_serving, wavefront_run,
};
use tonic::Code;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;
use wavefront_proto::worker::v1::worker_client::WorkerClient;
use wavefront_proto::worker::v1::LoadRequest;

const PROMPT: &str = "You may copy and distribute the Program,";

fn request(
    prompt: pb::generate_request::Prompt,
    max_new_tokens: u32,
    num_steps: u32,
    seed: u64,
) -> pb::GenerateRequest {
    pb::GenerateRequest {
        n: None,
        structured_output: None,
        prompt_logprobs: None,
        likelihood: None,
        logprobs: None,
        model: String::new(),
        prompt: Some(prompt),
        max_new_tokens,
        stop_token_ids: vec![],
        stop_strings: vec![],
        sampling: Some(pb::SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 0.0,
            seed: Some(seed),
        }),
        scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
            num_steps: Some(num_steps),
            cache_lookup_strategy: String::new(),
            init_scale: None,
            exit_threshold: None,
            ..Default::default()
        })),
        stream_canvas: false,
        skip_special_tokens: None,
    }
}

fn text(s: &str) -> pb::generate_request::Prompt {
    pb::generate_request::Prompt::Text(s.into())
}

fn ids(v: Vec<u32>) -> pb::generate_request::Prompt {
    pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: v })
}

/// `wavefront run --json` for the same parameters, offline.
fn offline_run(args: &[&str]) -> serde_json::Value {
    json_result(&wavefront_run("huginn", args))
}

async fn wait_pool_full(worker: std::net::SocketAddr) {
    harness::wait_whole(worker, Duration::from_secs(20)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_tokens_equal_offline_run_unary_and_streamed() {
    let s = stack(&[]).await;
    let mut client = GenerationClient::new(channel(s.router.addr).await);

    let unary = client
        .generate(request(text(PROMPT), 12, 4, 7))
        .await
        .expect("generate")
        .into_inner();
    let offline = offline_run(&[
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "12",
        "--num-steps",
        "4",
        "--seed",
        "7",
    ]);
    let offline_ids: Vec<u32> = serde_json::from_value(offline["token_ids"].clone()).unwrap();
    assert_eq!(unary.token_ids, offline_ids);
    assert_eq!(unary.text, offline["text"].as_str().unwrap());
    assert_eq!(offline["finish_reason"], "length");
    assert_eq!(unary.finish_reason, pb::FinishReason::Length as i32);
    let stats = unary.stats.unwrap();
    assert_eq!(stats.generated_tokens, 12);
    assert_eq!(stats.recurrence_steps, 48);
    assert_eq!(stats.seed, 7);

    let mut stream = client
        .generate_stream(request(text(PROMPT), 12, 4, 7))
        .await
        .unwrap()
        .into_inner();
    let (mut streamed_ids, mut streamed_text, mut done) = (Vec::new(), String::new(), None);
    while let Some(msg) = stream.message().await.unwrap() {
        match msg.event.unwrap() {
            pb::generate_stream_response::Event::Tokens(c) => {
                streamed_ids.extend(c.token_ids);
                streamed_text.push_str(&c.text);
            }
            pb::generate_stream_response::Event::Done(d) => done = Some(d),
            pb::generate_stream_response::Event::Canvas(_) => {
                panic!("canvas events were not asked for")
            }
            pb::generate_stream_response::Event::Prompt(_) => panic!("no prompt scores asked for"),
        }
    }
    let done = done.expect("final message");
    assert_eq!(streamed_ids, offline_ids);
    assert_eq!(done.token_ids, offline_ids);
    assert_eq!(streamed_text, done.text);

    // The model is listed, through the router.
    let models = served_models(&mut client).await;
    assert_eq!(models.len(), 1);
    assert_eq!(models[0].name, "huginn-tiny");
    assert_eq!(models[0].family, "recurrent_depth");
    wait_pool_full(s.worker.addr).await;

    // Server reflection (what grpcurl uses) on both processes.
    assert!(reflected_services(s.router.addr)
        .await
        .contains(&"wavefront.v1.Generation".to_owned()));
    let worker_services = reflected_services(s.worker.addr).await;
    for svc in [
        "wavefront.v1.Generation",
        "wavefront.worker.v1.Worker",
        "grpc.health.v1.Health",
    ] {
        assert!(
            worker_services.contains(&svc.to_owned()),
            "{svc} missing from {worker_services:?}"
        );
    }
}

/// A stop string ends the response where it appears, and the engine (told by the worker)
/// finishes the request with its own figures instead of dropping it as cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_ends_the_response_with_the_engines_stats() {
    let s = stack(&[]).await;
    let mut client = GenerationClient::new(channel(s.worker.addr).await);
    let full = client
        .generate(request(text(PROMPT), 16, 4, 7))
        .await
        .unwrap()
        .into_inner();
    // Two ASCII letters from the second half of the full text.
    let at = (full.text.len() / 2..full.text.len() - 1)
        .find(|&i| {
            full.text.is_char_boundary(i)
                && full.text.as_bytes()[i..i + 2]
                    .iter()
                    .all(u8::is_ascii_alphabetic)
        })
        .expect("two letters in the second half of the text");
    let stop = full.text[at..at + 2].to_owned();
    let cut = full.text.find(&stop).unwrap();
    let mut req = request(text(PROMPT), 16, 4, 7);
    req.stop_strings = vec![stop.clone()];

    let unary = client.generate(req.clone()).await.unwrap().into_inner();
    assert_eq!(unary.finish_reason, pb::FinishReason::StopString as i32);
    assert_eq!(unary.text, full.text[..cut], "cut before {stop:?}");
    assert!(full.token_ids.starts_with(&unary.token_ids));
    assert!(unary.token_ids.len() < full.token_ids.len());
    let stats = unary.stats.unwrap();
    assert_eq!(stats.generated_tokens as usize, unary.token_ids.len());
    assert_eq!(stats.counters.get("stopped_by_string"), Some(&1));
    // The engine's figures: 4 core iterations for every token it made (at least the kept
    // ones), one forward each, and the ticks it ran.
    assert!(
        stats.forward_passes >= unary.token_ids.len() as u64,
        "{stats:?}"
    );
    assert_eq!(
        stats.recurrence_steps,
        4 * stats.forward_passes,
        "{stats:?}"
    );
    assert!(stats.ticks >= stats.forward_passes, "{stats:?}");

    let mut stream = client.generate_stream(req).await.unwrap().into_inner();
    let (mut streamed, mut done) = (String::new(), None);
    while let Some(msg) = stream.message().await.unwrap() {
        match msg.event.unwrap() {
            pb::generate_stream_response::Event::Tokens(c) => streamed.push_str(&c.text),
            pb::generate_stream_response::Event::Done(d) => done = Some(d),
            pb::generate_stream_response::Event::Canvas(_) => panic!("no canvas asked for"),
            pb::generate_stream_response::Event::Prompt(_) => panic!("no prompt scores asked for"),
        }
    }
    let done = done.expect("final message");
    assert_eq!(streamed, unary.text);
    assert_eq!(done.finish_reason, pb::FinishReason::StopString as i32);
    assert!(done.stats.unwrap().forward_passes > 0);

    // Offline: the same cut and the engine's figures.
    let offline = offline_run(&[
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "16",
        "--num-steps",
        "4",
        "--seed",
        "7",
        "--stop-string",
        &stop,
    ]);
    assert_eq!(offline["finish_reason"], "stop_string");
    assert_eq!(offline["text"].as_str().unwrap(), unary.text);
    assert!(offline["stats"]["forward_passes"].as_u64().unwrap() > 0);
    assert_eq!(offline["stats"]["counters"]["stopped_by_string"], 1);
    wait_pool_full(s.worker.addr).await;
}

async fn reflected_services(addr: std::net::SocketAddr) -> Vec<String> {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let mut client = ServerReflectionClient::new(channel(addr).await);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = client
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    match stream
        .message()
        .await
        .unwrap()
        .and_then(|r| r.message_response)
    {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("unexpected reflection answer {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_stream_frees_its_slots() {
    let s = stack(&[]).await;
    let mut client = GenerationClient::new(channel(s.router.addr).await);
    // Connected before the request starts, and a request far longer than the look takes (240
    // tokens of 128 recurrences each): on a loaded machine a 200-token request of 32
    // recurrences once finished while a new channel to the worker was being opened.
    let mut w = WorkerClient::new(channel(s.worker.addr).await);
    let mut stream = client
        .generate_stream(request(text(PROMPT), 240, 128, 1))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().expect("a first chunk");
    assert!(matches!(
        first.event,
        Some(pb::generate_stream_response::Event::Tokens(_))
    ));
    // The engine publishes its load after the step that streamed the first chunk: on a busy
    // machine a look can come between the two, so look until it counts the request.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let load = w
            .get_load(LoadRequest { interval_ms: 0 })
            .await
            .unwrap()
            .into_inner();
        if load.models[0].free_slots < load.models[0].total_slots {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "request holds slots while running"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(stream);
    wait_pool_full(s.worker.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_status_and_leaks_nothing() {
    let s = stack(&[]).await;
    let mut client = GenerationClient::new(channel(s.router.addr).await);
    let base = || request(text(PROMPT), 4, 2, 1);
    let cases: Vec<(&str, pb::GenerateRequest, Code, &str)> = vec![
        (
            "empty prompt",
            pb::GenerateRequest {
                prompt: Some(text("")),
                ..base()
            },
            Code::InvalidArgument,
            "empty",
        ),
        (
            "no prompt",
            pb::GenerateRequest {
                prompt: None,
                ..base()
            },
            Code::InvalidArgument,
            "prompt",
        ),
        (
            "empty ids",
            pb::GenerateRequest {
                prompt: Some(ids(vec![])),
                ..base()
            },
            Code::InvalidArgument,
            "empty",
        ),
        (
            "unknown model",
            pb::GenerateRequest {
                model: "nope".into(),
                ..base()
            },
            Code::NotFound,
            "nope",
        ),
        (
            "zero tokens",
            pb::GenerateRequest {
                max_new_tokens: 0,
                ..base()
            },
            Code::InvalidArgument,
            "max_new_tokens",
        ),
        (
            "beyond the context",
            pb::GenerateRequest {
                max_new_tokens: 1_000,
                ..base()
            },
            Code::InvalidArgument,
            "context limit",
        ),
        (
            "beyond the worker's limit",
            pb::GenerateRequest {
                max_new_tokens: 100_000,
                ..base()
            },
            Code::InvalidArgument,
            "--max-new-tokens-limit",
        ),
        (
            "temperature",
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams {
                    temperature: -1.0,
                    ..Default::default()
                }),
                ..base()
            },
            Code::InvalidArgument,
            "temperature",
        ),
        (
            "top_p",
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                }),
                ..base()
            },
            Code::InvalidArgument,
            "top_p",
        ),
        (
            "id outside vocab",
            pb::GenerateRequest {
                prompt: Some(ids(vec![1, 99_999])),
                ..base()
            },
            Code::InvalidArgument,
            "vocabulary",
        ),
        (
            "prompt too long",
            pb::GenerateRequest {
                prompt: Some(ids(vec![5; 300])),
                ..base()
            },
            Code::InvalidArgument,
            "context limit",
        ),
        (
            "num_steps",
            pb::GenerateRequest {
                scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
                    num_steps: Some(0),
                    ..Default::default()
                })),
                ..base()
            },
            Code::InvalidArgument,
            "num_steps",
        ),
        (
            "exit threshold",
            pb::GenerateRequest {
                scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
                    exit_threshold: Some(2.0),
                    ..Default::default()
                })),
                ..base()
            },
            Code::InvalidArgument,
            "exit_threshold",
        ),
        (
            "cache strategy",
            pb::GenerateRequest {
                scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
                    cache_lookup_strategy: "sideways".into(),
                    ..Default::default()
                })),
                ..base()
            },
            Code::InvalidArgument,
            "cache_lookup_strategy",
        ),
    ];
    for (what, req, code, needle) in cases {
        let err = client.generate(req).await.expect_err(what);
        assert_eq!(err.code(), code, "{what}: {err:?}");
        assert!(
            err.message().contains(needle),
            "{what}: message {:?} should mention {needle:?}",
            err.message()
        );
    }

    // Invalid UTF-8 in the prompt text: send raw bytes for field 2.
    let mut raw = Vec::new();
    raw.extend_from_slice(&[0x12, 3, 0xff, 0xfe, 0x41]); // field 2 (text), 3 bytes, invalid UTF-8
    raw.extend_from_slice(&[0x20, 4]); // max_new_tokens = 4
    let err = raw_generate(s.router.addr, raw).await;
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("UTF-8") || err.message().contains("utf-8"),
        "{err:?}"
    );

    // A deadline that expires mid-generation.
    // The header alone (no client-side timer): the server must answer.
    let mut req = tonic::Request::new(request(text(PROMPT), 240, 32, 3));
    req.metadata_mut()
        .insert("grpc-timeout", "300m".parse().unwrap());
    let err = client.generate(req).await.expect_err("deadline");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    wait_pool_full(s.worker.addr).await;
}

/// Sends a hand-encoded GenerateRequest to the worker API's generate method.
async fn raw_generate(addr: std::net::SocketAddr, body: Vec<u8>) -> tonic::Status {
    use tonic::codegen::http;
    let mut grpc = tonic::client::Grpc::new(channel(addr).await);
    grpc.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/wavefront.v1.Generation/Generate");
    let codec = RawCodec;
    grpc.unary::<Vec<u8>, Vec<u8>, _>(tonic::Request::new(body), path, codec)
        .await
        .expect_err("malformed message")
}

#[derive(Clone, Copy)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self {
        *self
    }
    fn decoder(&mut self) -> Self {
        *self
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_resource_exhausted() {
    let s = stack(&["--queue-capacity", "1", "--max-active", "1"]).await;
    let mut calls = Vec::new();
    for i in 0..4 {
        let mut c = GenerationClient::new(channel(s.worker.addr).await);
        calls.push(tokio::spawn(async move {
            c.generate(request(text(PROMPT), 40, 32, i)).await
        }));
    }
    let mut exhausted = 0;
    let mut ok = 0;
    for c in calls {
        match c.await.unwrap() {
            Ok(_) => ok += 1,
            Err(e) if e.code() == Code::ResourceExhausted => {
                assert!(e.message().contains("queue is full"), "{e:?}");
                exhausted += 1;
            }
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
    assert!(exhausted >= 1 && ok >= 1, "ok {ok}, exhausted {exhausted}");
    wait_pool_full(s.worker.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_without_reachable_workers_is_unavailable() {
    // Port 9 (discard) on loopback: nothing listens there.
    let router = spawn(&[
        "router",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "127.0.0.1:9",
        "--refresh-ms",
        "200",
    ]);
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(router.addr).await);
    let err = client
        .generate(request(text(PROMPT), 4, 2, 1))
        .await
        .expect_err("no worker");
    assert_eq!(err.code(), Code::Unavailable);
    assert!(err.message().contains("no worker"), "{err:?}");
}

/// Continuous batching through the real server: 8 requests of different
/// lengths and settings join at different ticks, and each gets exactly the
/// tokens it gets alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_invariance_with_requests_joining_at_different_ticks() {
    let s = stack(&[]).await;
    let reqs: Vec<pb::GenerateRequest> = (0..8u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..(3 + 2 * i)).map(|k| (k * 37 + i * 11) % 480).collect();
            // Long enough that each request still runs when the next one joins.
            let mut r = request(ids(prompt), 40 + 4 * i, 2 + (i % 3) * 3, 100 + u64::from(i));
            if i % 4 == 3 {
                r.scheme = Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
                    num_steps: Some(16),
                    exit_threshold: Some(0.05),
                    ..Default::default()
                }));
            }
            if i == 5 {
                r.sampling = Some(pb::SamplingParams {
                    temperature: 0.8,
                    top_k: 20,
                    top_p: 0.9,
                    seed: Some(5),
                });
            }
            r
        })
        .collect();
    // Alone, one after another.
    let mut client = GenerationClient::new(channel(s.router.addr).await);
    let mut w = WorkerClient::new(channel(s.worker.addr).await);
    let mut alone = Vec::new();
    let mut alone_ticks = 0;
    for r in &reqs {
        let resp = client.generate(r.clone()).await.unwrap().into_inner();
        alone_ticks += resp.stats.unwrap().ticks;
        alone.push(resp.token_ids);
    }
    let ticks_before = w
        .get_load(LoadRequest { interval_ms: 0 })
        .await
        .unwrap()
        .into_inner()
        .models[0]
        .ticks;
    // Together: request i starts once request i-1 has streamed its first token.
    let mut tasks = Vec::new();
    for r in reqs.clone() {
        let mut c = GenerationClient::new(channel(s.router.addr).await);
        let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
        tasks.push(tokio::spawn(async move {
            let mut stream = c.generate_stream(r).await.unwrap().into_inner();
            let mut started = Some(started_tx);
            let mut out = Vec::new();
            while let Some(m) = stream.message().await.unwrap() {
                if let Some(tx) = started.take() {
                    let _ = tx.send(());
                }
                if let Some(pb::generate_stream_response::Event::Done(d)) = m.event {
                    out = d.token_ids;
                }
            }
            out
        }));
        let _ = started_rx.await;
    }
    let mut together = Vec::new();
    for t in tasks {
        together.push(t.await.unwrap());
    }
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, b, "request {i} changed when batched");
    }
    // They really shared ticks: fewer engine ticks than run alone.
    let ticks_after = w
        .get_load(LoadRequest { interval_ms: 0 })
        .await
        .unwrap()
        .into_inner()
        .models[0]
        .ticks;
    assert!(
        ticks_after - ticks_before < alone_ticks,
        "{} ticks together vs {alone_ticks} alone",
        ticks_after - ticks_before
    );
    wait_pool_full(s.worker.addr).await;
}

/// LLaDA behind a real worker: a chat prompt is formatted with the checkpoint's template
/// (the fixture's golden rendering), canvas snapshots stream when asked for, and the offline
/// `run --chat --stream-canvas --json` prints the same snapshots as JSON lines before the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masked_diffusion_chat_prompt_and_canvas_stream() {
    let model = fixture("llada");
    let worker = spawn_worker("llada", &[]);
    wait_serving(worker.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(worker.addr).await);
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("golden.json")).unwrap()).unwrap();
    let chat = &golden["tokenizer"]["chat"];
    let content = chat["messages"][0]["content"].as_str().unwrap().to_owned();
    let want_ids: Vec<u32> = serde_json::from_value(chat["ids"].clone()).unwrap();
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: content.clone(),
            }],
        })),
        max_new_tokens: 16,
        sampling: Some(pb::SamplingParams {
            seed: Some(3),
            ..Default::default()
        }),
        scheme: Some(pb::generate_request::Scheme::Wino(pb::WinoScheme {
            block_length: Some(8),
            ..Default::default()
        })),
        stream_canvas: true,
        ..Default::default()
    };
    let mut stream = client
        .generate_stream(req.clone())
        .await
        .unwrap()
        .into_inner();
    let (mut frames, mut tokens, mut done) = (Vec::new(), Vec::new(), None);
    while let Some(msg) = stream.message().await.unwrap() {
        match msg.event.unwrap() {
            pb::generate_stream_response::Event::Canvas(c) => frames.push(c),
            pb::generate_stream_response::Event::Tokens(t) => tokens.extend(t.token_ids),
            pb::generate_stream_response::Event::Done(d) => done = Some(d),
            pb::generate_stream_response::Event::Prompt(_) => panic!("no prompt scores asked for"),
        }
    }
    let done = done.expect("final message");
    let stats = done.stats.unwrap();
    assert_eq!(
        stats.prompt_tokens as usize,
        want_ids.len(),
        "chat template applied"
    );
    assert_eq!(frames.len() as u64, stats.forward_passes);
    let last = frames.last().unwrap();
    assert!(last.full);
    assert_eq!(last.token_ids[..tokens.len()], tokens[..]);
    assert!(frames
        .iter()
        .any(|f| f.states.contains(&(pb::CellState::Drafted as i32))));
    // The unary call ignores the flag and returns the same tokens.
    let unary = client.generate(req).await.unwrap().into_inner();
    assert_eq!(unary.token_ids, done.token_ids);

    // A chat prompt for a model without a template says so.
    let out = wavefront_run(
        "huginn",
        &[
            "--prompt",
            "hi",
            "--chat",
            "--max-new-tokens",
            "2",
            "--num-steps",
            "2",
        ],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no chat template"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Offline: the same request from the command line.
    let lines = json_lines(&wavefront_run(
        "llada",
        &[
            "--prompt",
            &content,
            "--chat",
            "--stream-canvas",
            "--scheme",
            "wino",
            "--block-length",
            "8",
            "--max-new-tokens",
            "16",
            "--seed",
            "3",
        ],
    ));
    let (result, canvas) = lines.split_last().unwrap();
    assert_eq!(canvas.len(), frames.len());
    assert!(canvas.iter().all(|c| c["canvas"]["full"] == true));
    let ids: Vec<u32> = serde_json::from_value(result["token_ids"].clone()).unwrap();
    assert_eq!(ids, done.token_ids);
}
