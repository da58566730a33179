//! Careless and hostile clients against `serve` (the four embedded models, HTTP on): work that
//! grows with a request's size is refused before it is done, and costs the other models'
//! requests nothing.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use tonic::Code;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{channel, served_models, spawn, wait_serving};
use crate::metrics::{free_port, scrape};

/// A process's peak resident memory so far (VmHWM), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// CPU seconds (user and system) that process `pid`'s threads outside the engines have used:
/// the network side (the runtime's workers, the main thread), without the engines' and the CPU
/// kernels' threads (named `wavefront-…`), from /proc (0 where unreadable).
fn network_cpu_seconds(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0.0;
    };
    let mut total = 0.0;
    for task in tasks.flatten() {
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let name = head.split_once('(').map_or("", |(_, n)| n);
        if name.starts_with("wavefront-") {
            continue;
        }
        // Fields after the name: the state (a letter) first, then utime and stime as the 12th
        // and 13th, in clock ticks (100 a second on Linux).
        let f: Vec<&str> = rest.split_whitespace().collect();
        let field = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
        if let Some((u, s)) = field(11).zip(field(12)) {
            total += (u + s) / 100.0;
        }
    }
    total
}

/// Requests for `model` the workers refused as invalid (`wavefront_requests_total`, every
/// scheme), from a scrape.
fn worker_refusals(metrics: &str, model: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("wavefront_requests_total{"))
        .filter(|l| l.contains(&format!("model=\"{model}\"")))
        .filter(|l| l.contains("status=\"INVALID_ARGUMENT\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Refusals the `listener` held for their address's budget, from a scrape.
fn held(metrics: &str, listener: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("wavefront_refusal_hold_seconds_count{"))
        .filter(|l| l.contains(&format!("listener=\"{listener}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A chat of `n` empty user messages for `model`.
fn empty_chat(model: &str, n: usize) -> pb::GenerateRequest {
    pb::GenerateRequest {
        model: model.into(),
        prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatMessages {
            messages: (0..n)
                .map(|_| pb::ChatMessage {
                    role: "user".into(),
                    content: String::new(),
                })
                .collect(),
        })),
        max_new_tokens: 4,
        ..Default::default()
    }
}

/// A short request for the model the flood does not touch.
fn small(seed: u64) -> pb::GenerateRequest {
    pb::GenerateRequest {
        model: "huginn".into(),
        prompt: Some(pb::generate_request::Prompt::Text(
            "And the king said to".into(),
        )),
        max_new_tokens: 8,
        sampling: Some(pb::SamplingParams {
            seed: Some(seed),
            ..Default::default()
        }),
        scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
            num_steps: Some(4),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// The 99th percentile (the largest of fewer than a hundred).
fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

/// Latencies of `n` small requests, one after another.
async fn latencies(
    client: &mut GenerationClient<tonic::transport::Channel>,
    n: u64,
) -> Vec<Duration> {
    let mut out = Vec::new();
    for i in 0..n {
        let t = Instant::now();
        client.generate(small(i)).await.expect("a small request");
        out.push(t.elapsed());
    }
    out
}

/// A `/v1/chat/completions` body of `messages` empty messages for llada.
fn chat_body(messages: usize) -> String {
    format!(
        "{{\"model\": \"llada\", \"max_tokens\": 4, \"messages\": [{}]}}",
        vec!["{\"role\": \"user\", \"content\": \"\"}"; messages].join(",")
    )
}

/// A chat of many empty messages is refused before it is rendered or tokenized: beyond
/// `--max-chat-messages` by its count (the finding's 380,000 messages in a 3 MB message), under
/// it by the template's tokens per message against the context. Sixteen clients sending the
/// worst chat under the limit, over gRPC and HTTP, for three seconds leave the process's peak
/// memory within 64 MiB and another model's p99 latency within twice its own (release, alone;
/// see below).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chats_of_many_empty_messages_are_refused_before_they_are_rendered() {
    let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let metrics_port = free_port();
    let serve = spawn(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        &http.to_string(),
        "--metrics-listen",
        &format!("127.0.0.1:{metrics_port}"),
    ]);
    wait_serving(serve.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(serve.addr).await)
        .max_decoding_message_size(8 << 20)
        .max_encoding_message_size(8 << 20);
    // The router refuses from what the workers report (their --max-chat-messages, the chat
    // template's tokens per message, the context): wait for the report naming llada, which
    // the models' list publishes.
    let t = Instant::now();
    loop {
        let models = served_models(&mut client).await;
        if let Some(m) = models.iter().find(|m| m.name == "llada") {
            assert!(m.chat_tokens_per_message > 0, "{m:?}");
            assert!(m.chat_tokens_fixed > 0, "{m:?}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no report names llada"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let refused_by_workers = || worker_refusals(&scrape(metrics_port), "llada");
    let at_start = refused_by_workers();
    // The finding: 380,000 empty messages, refused by their count, at once.
    let t = Instant::now();
    let err = client
        .generate(empty_chat("llada", 380_000))
        .await
        .expect_err("refused");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("--max-chat-messages"),
        "{}",
        err.message()
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // Under the count: the template's tokens per message make it longer than the context.
    let err = client
        .generate(empty_chat("llada", 1024))
        .await
        .expect_err("refused");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("at least"), "{}", err.message());
    assert_eq!(refused_by_workers(), at_start, "refused by the router");
    // The tokenizer's endpoints take a conversation too, and refuse it the same way.
    let many = match empty_chat("llada", 1024).prompt {
        Some(pb::generate_request::Prompt::Chat(c)) => c,
        _ => unreachable!("a chat"),
    };
    let err = client
        .tokenize(pb::TokenizeRequest {
            model: "llada".into(),
            input: Some(pb::tokenize_request::Input::Chat(many)),
            add_special_tokens: None,
        })
        .await
        .expect_err("refused");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("at least"), "{}", err.message());
    let body = chat_body(1024).replace("\"max_tokens\": 4, ", "");
    let (status, body) =
        tokio::task::spawn_blocking(move || http_post(http, "/tokenize", "", &body))
            .await
            .expect("posted");
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("at least"), "{body}");
    // One message whose content alone is too long: the router cannot tell without the
    // tokenizer, so the worker refuses it (also before rendering), and counts it.
    let mut long = empty_chat("llada", 1);
    if let Some(pb::generate_request::Prompt::Chat(c)) = &mut long.prompt {
        c.messages[0].content = "a".repeat(1 << 20);
    }
    let err = client.generate(long).await.expect_err("refused");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("at least"), "{}", err.message());
    assert_eq!(
        refused_by_workers(),
        at_start + 1.0,
        "refused by the worker"
    );
    let at_start = refused_by_workers();

    // Unloaded, then under a flood of the worst chats under the limit. What must hold: each
    // refusal costs the server little CPU (rendering and tokenizing a 1,024-message chat costs
    // about 16 ms of it, from the finding's 6 s for 380,000 messages; a refusal from the count
    // and the template's per-message estimate well under 1 ms), checked in every round; the
    // flood's refusals past its address's budget (`--refusals-per-second`, `--refusal-burst`)
    // are held, so the sixteen clients, which resend as soon as they are answered, get at most
    // the budget's refusals a second across the two listeners (one budget per address); and
    // another model's p99 keeps within
    // 2x of its unloaded one. Other tests share these two cores, so the unloaded p99 is taken
    // before and after each flood and the larger kept, and a round spoiled by them is run
    // again (three at most). docs/reliability.md has the rounds with and without the budget.
    let max_ratio: f64 = std::env::var("WAVEFRONT_FLOOD_MAX_RATIO")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2.0);
    // The budget the server runs with (the environment may set it, as for the measurements
    // without one).
    let budget = |var: &str, default: u32| -> f64 {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default) as f64
    };
    let per_second = budget(
        "WAVEFRONT_REFUSALS_PER_SECOND",
        wavefront_net::DEFAULT_REFUSALS_PER_SECOND,
    );
    let burst = budget(
        "WAVEFRONT_REFUSAL_BURST",
        wavefront_net::DEFAULT_REFUSAL_BURST,
    );
    latencies(&mut client, 5).await;
    let peak = peak_rss_kib(serve.child.id());
    let mut rounds = Vec::new();
    for _ in 0..3 {
        // The timed requests' own network CPU, unloaded: taken off the flood's below.
        let cpu = network_cpu_seconds(serve.child.id());
        let before = p99(latencies(&mut client, SAMPLES).await);
        let timed_cpu = network_cpu_seconds(serve.child.id()) - cpu;
        let cpu = network_cpu_seconds(serve.child.id());
        let t = Instant::now();
        let (loaded, refused) = flood(&mut client, serve.addr, http).await;
        let secs = t.elapsed().as_secs_f64();
        let cpu = network_cpu_seconds(serve.child.id()) - cpu;
        let after = p99(latencies(&mut client, SAMPLES).await);
        let base = before.max(after);
        let grew = peak_rss_kib(serve.child.id()).saturating_sub(peak);
        // The server's network CPU during the flood (its refusals and the timed requests'
        // handling; the engines' compute apart), less what the same timed requests took
        // unloaded: the refusals' (within /proc's 10 ms ticks). The flooding clients, in this
        // process, share the same cores.
        let refusals_cpu = (cpu - timed_cpu).max(0.0);
        let per_refusal = refusals_cpu / refused.max(1) as f64;
        println!(
            "{refused} oversized chats refused in {secs:.1} s; huginn p99 {base:?} unloaded, \
             {loaded:?} under the flood ({:.2}x); server network CPU {cpu:.2} s in the flood, \
             {timed_cpu:.2} s for the timed requests alone ({:.0} us per refusal); peak memory \
             grew {grew} KiB",
            loaded.as_secs_f64() / base.as_secs_f64(),
            per_refusal * 1e6
        );
        assert!(refused >= 16, "the flood sent {refused}");
        if per_second > 0.0 {
            // The address's one budget, on the gRPC and HTTP listeners together, answers at
            // most its burst and its rate over the round at once; every client counts one more,
            // answered after the flood stopped.
            let most = burst + per_second * secs + 1.0 + 16.0;
            assert!(
                refused as f64 <= most,
                "{refused} refusals in {secs:.2} s, over the budget's {most}"
            );
            let metrics = scrape(metrics_port);
            for listener in ["grpc", "http"] {
                assert!(
                    held(&metrics, listener) > 0.0,
                    "no refusal held on the {listener} listener"
                );
            }
        }
        assert!(grew < 64 << 10, "peak memory grew {grew} KiB");
        assert!(
            per_refusal < 2e-3,
            "{:.2} ms of server CPU per refusal: the chats are rendered",
            per_refusal * 1e3
        );
        // Every refusal was the router's (gRPC) or the HTTP front's: no chat reached a worker
        // to be decoded a second time there.
        assert_eq!(
            refused_by_workers(),
            at_start,
            "chats refused by the workers, not before them"
        );
        let held = loaded.as_secs_f64() <= base.as_secs_f64() * max_ratio;
        rounds.push((base, loaded));
        if held {
            return;
        }
    }
    panic!("p99 under the flood against alone, three rounds (bound {max_ratio}x): {rounds:?}");
}

/// Huginn requests timed for each p99 (the flood lasts as long as they take).
const SAMPLES: u64 = 100;

/// Sixteen clients, half gRPC and half HTTP, sending the worst chat under the limit while
/// `client` times [`SAMPLES`] small Huginn requests: their p99, and how many were refused.
///
/// The flooding clients run on threads of their own at the lowest CPU priority (nice 19):
/// they stand for clients on other machines. On these two cores, at the priority of the
/// server, they took three quarters of the CPU (the server's refusals a quarter), and the
/// latency measured was the operating system's sharing of the cores with the load generator
/// rather than the server's cost. The server's CPU time during the flood is reported apart.
async fn flood(
    client: &mut GenerationClient<tonic::transport::Channel>,
    addr: SocketAddr,
    http: SocketAddr,
) -> (Duration, usize) {
    // The requests are built once: the flood measures the server's cost, not the test's.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let going =
        |stop: &std::sync::atomic::AtomicBool| !stop.load(std::sync::atomic::Ordering::Relaxed);
    let grpc_chat = empty_chat("llada", 1024);
    let http_body = std::sync::Arc::new(chat_body(1024));
    let mut flood = Vec::new();
    for k in 0..16 {
        let (grpc_chat, http_body, stop) = (grpc_chat.clone(), http_body.clone(), stop.clone());
        flood.push(std::thread::spawn(move || {
            // SAFETY: setpriority on this thread's own id only lowers its scheduling priority.
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19);
            }
            let mut refused = 0usize;
            if k % 2 == 0 {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime");
                rt.block_on(async {
                    let mut c = GenerationClient::new(channel(addr).await);
                    while going(&stop) {
                        let e = c.generate(grpc_chat.clone()).await.expect_err("refused");
                        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
                        refused += 1;
                    }
                });
            } else {
                while going(&stop) {
                    let (status, body) = http_post(http, "/v1/chat/completions", "", &http_body);
                    assert_eq!(status, 400, "{body}");
                    refused += 1;
                }
            }
            refused
        }));
    }
    // Every client sends before the timing starts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let loaded = p99(latencies(client, SAMPLES).await);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut refused = 0;
    for f in flood {
        refused += tokio::task::spawn_blocking(move || f.join().expect("a flooding client"))
            .await
            .expect("joined");
    }
    (loaded, refused)
}

/// `POST path` with `body` and extra `headers`; the status and body.
fn http_post(addr: SocketAddr, path: &str, headers: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("http port");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{headers}\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (raw[9..12].parse().expect("status"), body)
}

/// Client strings are quoted clipped (a 1 MB model name gets NOT_FOUND over gRPC, not a
/// transport error, and a 404 of under 2 KB over HTTP); a misspelled top-level field is
/// refused by name instead of running the default scheme, and a compressed body with 415; the
/// HTTP front counts each refusal in `wavefront_http_responses_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoed_input_is_clipped_and_unknown_fields_and_encodings_are_refused() {
    let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let metrics = free_port();
    let serve = spawn(&[
        "--metrics-listen",
        &format!("127.0.0.1:{metrics}"),
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        &http.to_string(),
    ]);
    wait_serving(serve.addr, "wavefront.v1.Generation").await;
    let mut client =
        GenerationClient::new(channel(serve.addr).await).max_encoding_message_size(8 << 20);
    for len in [20_000, 1 << 20] {
        let err = client
            .generate(pb::GenerateRequest {
                model: "m".repeat(len),
                prompt: Some(pb::generate_request::Prompt::Text("hi".into())),
                max_new_tokens: 2,
                ..Default::default()
            })
            .await
            .expect_err("unknown model");
        assert_eq!(err.code(), Code::NotFound, "{len}: {:?}", err.code());
        assert!(err.message().len() <= 1024, "{}", err.message().len());
        assert!(err.message().contains("bytes in all"), "{}", err.message());
    }

    let name = "m".repeat(1 << 20);
    let body = format!(r#"{{"model": "{name}", "prompt": "hi", "max_tokens": 2}}"#);
    let (status, text) =
        tokio::task::spawn_blocking(move || http_post(http, "/v1/completions", "", &body))
            .await
            .unwrap();
    assert_eq!(status, 404, "{text}");
    assert!(text.len() < 2048, "{} bytes", text.len());

    let body = r#"{"model": "llada", "prompt": "hi", "max_tokens": 8,
                   "low_confidance": {"steps": 2}}"#;
    let (status, text) =
        tokio::task::spawn_blocking(move || http_post(http, "/v1/completions", "", body))
            .await
            .unwrap();
    assert_eq!(status, 400, "{text}");
    assert!(
        text.contains(r#"unknown field \"low_confidance\""#),
        "{text}"
    );

    let body = r#"{"model": "llada", "prompt": "hi", "max_tokens": 8}"#;
    let (status, text) = tokio::task::spawn_blocking(move || {
        http_post(http, "/v1/completions", "Content-Encoding: gzip\r\n", body)
    })
    .await
    .unwrap();
    assert_eq!(status, 415, "{text}");
    assert!(text.contains("gzip"), "{text}");

    // The HTTP front's refusals are counted, by route and code.
    let body = crate::metrics::scrape(metrics);
    for (code, at_least) in [("404", 1.0), ("400", 1.0), ("415", 1.0)] {
        let line =
            format!("wavefront_http_responses_total{{route=\"/v1/completions\",code=\"{code}\"}}");
        let n = crate::metrics::sample(&body, &line);
        assert!(n >= Some(at_least), "{line}: {n:?}\n{body}");
    }
}

/// A router (no worker reachable: nothing to load) under a descriptor limit of `nofile`, its
/// HTTP and metrics ports, and the file its log goes to.
struct Limited {
    proc: crate::harness::Proc,
    http: SocketAddr,
    metrics: SocketAddr,
    log: std::path::PathBuf,
}

fn limited_router(nofile: u32, extra: &[&str]) -> Limited {
    let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let log = std::env::temp_dir().join(format!(
        "wavefront-limited-{}-{}.log",
        std::process::id(),
        free_port()
    ));
    let (http_s, metrics_s) = (http.to_string(), metrics.to_string());
    let mut args = vec!["-c", r#"ulimit -n "$0" && exec "$@" 2>"$LOG""#];
    let nofile = nofile.to_string();
    args.push(&nofile);
    args.extend([
        crate::harness::bin(),
        "--metrics-listen",
        &metrics_s,
        "router",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "127.0.0.1:9",
        "--http-listen",
        &http_s,
    ]);
    args.extend(extra);
    let proc = crate::harness::spawn_program(
        "sh",
        &args,
        &[("LOG", log.to_str().unwrap()), ("RUST_LOG", "warn")],
    );
    Limited {
        proc,
        http,
        metrics,
        log,
    }
}

/// `GET path` within `within`: the status, or `None` when no answer came in time.
async fn get_within(addr: SocketAddr, path: &'static str, within: Duration) -> Option<u16> {
    tokio::time::timeout(
        within,
        tokio::task::spawn_blocking(move || {
            let mut s = TcpStream::connect(addr).ok()?;
            write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
            )
            .ok()?;
            let mut raw = Vec::new();
            s.read_to_end(&mut raw).ok()?;
            String::from_utf8_lossy(&raw).get(9..12)?.parse().ok()
        }),
    )
    .await
    .ok()?
    .ok()?
}

/// `n` connections to `addr` that send nothing.
fn idle_connections(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n)
        .filter_map(|_| TcpStream::connect(addr).ok())
        .collect()
}

/// Idle and half-open clients (F3): the connection cap keeps them from taking every
/// descriptor, so gRPC and /metrics stay reachable while 96 of them sit on the HTTP port, and
/// the header-read timeout closes them, so HTTP comes back by itself. Descriptors exhausted
/// anyway (F4: a cap above the limit) cost a warning per listener per 10 s, not a log flood,
/// and the server recovers when the idle clients are closed for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_clients_neither_exhaust_descriptors_nor_flood_the_log() {
    // F3: 128 descriptors, 32 connections a listener.
    let r = limited_router(
        128,
        &["--max-connections", "32", "--header-read-timeout-s", "1"],
    );
    wait_serving(r.proc.addr, "wavefront.v1.Generation").await;
    let idle = idle_connections(r.http, 96);
    assert_eq!(idle.len(), 96);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Other listeners answer at once.
    assert_eq!(
        get_within(r.metrics, "/metrics", Duration::from_secs(2)).await,
        Some(200),
        "/metrics while 96 idle clients sit on the HTTP port"
    );
    let models = tokio::time::timeout(
        Duration::from_secs(2),
        GenerationClient::new(channel(r.proc.addr).await)
            .list_models(pb::ListModelsRequest::default()),
    )
    .await;
    assert!(matches!(models, Ok(Ok(_))), "gRPC: {models:?}");
    // HTTP: the idle ones are closed 1 s after they open, 32 at a time, then /health answers
    // (503: no worker is reachable, which is this router's truth).
    let t = Instant::now();
    let health = get_within(r.http, "/health", Duration::from_secs(15)).await;
    assert_eq!(health, Some(503), "after {:?}", t.elapsed());
    println!(
        "F3: /health answered {:?} after 96 idle clients",
        t.elapsed()
    );
    // The server closed the idle connections itself.
    let mut closed = 0;
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut b = [0u8; 1];
        if matches!(s.read(&mut b), Ok(0) | Err(_)) {
            closed += 1;
        }
    }
    assert!(
        closed >= 64,
        "{closed} of 96 idle connections closed by the server"
    );
    drop(r.proc);

    // F4: the cap above what 48 descriptors allow: accepts fail until idle clients go.
    let r = limited_router(
        48,
        &["--max-connections", "200", "--header-read-timeout-s", "2"],
    );
    wait_serving(r.proc.addr, "wavefront.v1.Generation").await;
    let idle = idle_connections(r.http, 80);
    let scrape = get_within(r.metrics, "/metrics", Duration::from_secs(1)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Once the timeout has closed the idle clients, everything answers again.
    let t = Instant::now();
    let mut health = None;
    while health.is_none() && t.elapsed() < Duration::from_secs(20) {
        health = get_within(r.http, "/health", Duration::from_secs(5)).await;
    }
    assert_eq!(health, Some(503), "after {:?}", t.elapsed());
    assert_eq!(
        get_within(r.metrics, "/metrics", Duration::from_secs(5)).await,
        Some(200)
    );
    drop(idle);
    drop(r.proc);
    let log = std::fs::read_to_string(&r.log).unwrap_or_default();
    let _ = std::fs::remove_file(&r.log);
    let failures = log.matches("accept failed").count();
    println!(
        "F4: {failures} accept warnings, log {} bytes; a scrape during exhaustion: {scrape:?}",
        log.len()
    );
    assert!(
        (1..=6).contains(&failures),
        "accept warnings: {failures}\n{}",
        &log[..log.len().min(4000)]
    );
    assert!(log.len() < 64 << 10, "log of {} bytes", log.len());
}
