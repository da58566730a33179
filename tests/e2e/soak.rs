//! The soak harness and the overload test: real processes on loopback, a router in front of one
//! worker per family, and clients that behave the way real ones do.
//!
//! The soak sends `WAVEFRONT_SOAK_REQUESTS` requests (default 600, the CI run) over every
//! scheme of the four families and of Dream, LLaDA2.0 and DiffusionGemma from `WAVEFRONT_SOAK_CONCURRENCY` connections (default 64):
//! random client cancellations, deadlines from 10 ms to 10 s, slow readers, readers that stop
//! reading for up to 2 s, stop strings and 10% invalid requests (chats over
//! `--max-chat-messages` among them), within `WAVEFRONT_SOAK_SECONDS` (default 100; past it no new request is
//! sent). It then checks that no process exited, every response was well formed (a finish
//! reason, or a documented status code), the invalid ones were refused as invalid, every
//! worker's slots and queue are back to empty (load reports and Prometheus gauges), and that
//! resident memory grew less than 10% between the first and last tenth of the requests (at most
//! a thousand each), and that the prefix cache still hands a repeated long prompt's pages on
//! (it counts the cache's hits). It prints p50/p99 latency and throughput as one JSON line
//! (`WAVEFRONT_SOAK_REPORT=FILE` writes it there too). `scripts/soak.sh` runs the full 10,000.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;
use tonic::Code;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;
use wavefront_proto::worker::v1::worker_client::WorkerClient;
use wavefront_proto::worker::v1::LoadRequest;

use crate::harness::{channel, spawn_router, spawn_worker, wait_serving, wait_whole, Proc};
use crate::metrics::{free_port, sample, scrape};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A worker process with its metrics port.
struct Served {
    family: &'static str,
    proc: Proc,
    metrics_port: u16,
}

fn worker(fixture: &'static str, family: &'static str) -> Served {
    let metrics_port = free_port();
    let proc = spawn_worker(
        fixture,
        &[
            "--served-name",
            family,
            "--metrics-listen",
            &format!("127.0.0.1:{metrics_port}"),
        ],
    );
    Served {
        family,
        proc,
        metrics_port,
    }
}

/// Resident memory of a process in KiB: `(VmRSS, RssAnon, its slot pools' arenas)`.
type Memory = (u64, u64, u64);

/// [`Memory`] of each process of `pids`; the pools' bytes from the metrics port beside it.
fn memory(pids: &[u32], ports: &[Option<u16>]) -> Vec<Memory> {
    pids.iter()
        .zip(ports)
        .map(|(&pid, port)| {
            let (rss, anon) = rss_kib(pid);
            let pool = port.map_or(0.0, |p| {
                sample(&scrape(p), "wavefront_pool_allocated_bytes{").unwrap_or(0.0)
            });
            (rss, anon, pool as u64 / 1024)
        })
        .collect()
}

/// A process's resident memory in KiB: `(VmRSS, RssAnon)`. RssAnon is what the process
/// allocated (heap, stacks); the rest of VmRSS is mostly the executable's own pages, read in
/// as code paths first run.
fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("RssAnon:"))
}

/// What a request was made to test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Valid,
    /// Must be refused with INVALID_ARGUMENT or NOT_FOUND.
    Invalid,
}

/// How the client reads the answer.
#[derive(Debug, Clone, Copy)]
enum Reader {
    Unary,
    Stream,
    /// Sleeps between messages.
    Slow(Duration),
    /// Reads the first message, then stops reading for this long (its request pauses, and is
    /// the first preempted when others need its memory), then reads the rest.
    Stall(Duration),
    /// Drops the call after this long.
    Cancel(Duration),
}

fn text(s: &str) -> Option<pb::generate_request::Prompt> {
    Some(pb::generate_request::Prompt::Text(s.into()))
}

/// The last one is long enough (several pages, segments and blocks) for its repeats to read
/// the prompt state a finished request left in the prefix cache, under the soak's cancellations,
/// deadlines and preemptions.
const PROMPTS: [&str; 5] = [
    "You may copy and distribute",
    "The quick brown fox",
    "Once upon a time,",
    "In the beginning",
    "You may copy and distribute verbatim copies of the Program's source code as you receive \
     it, in any medium, provided that you conspicuously and appropriately publish on each copy \
     an appropriate copyright notice",
];

/// A valid request for one of the four families (and Dream, LLaDA2.0 and DiffusionGemma), over every scheme
/// each serves.
fn valid(rng: &mut StdRng) -> pb::GenerateRequest {
    use pb::generate_request::Scheme;
    let prompt = text(PROMPTS[rng.random_range(0..PROMPTS.len())]);
    let seed = Some(rng.random_range(0..1000));
    // Sampled requests restrict their draws with top_p and top_k now and then (every scheme
    // that samples takes them).
    let (top_p, top_k) = match rng.random_range(0..4) {
        0 => (0.9, 0),
        1 => (0.0, 20),
        _ => (0.0, 0),
    };
    let sampling = |t: f32| {
        Some(pb::SamplingParams {
            temperature: t,
            seed,
            top_p: if t > 0.0 && top_p > 0.0 { top_p } else { 1.0 },
            top_k: if t > 0.0 { top_k } else { 0 },
        })
    };
    let stop_strings = if rng.random_bool(0.2) {
        vec!["e".into(), "th".into()]
    } else {
        Vec::new()
    };
    let temperature = if rng.random_bool(0.5) { 0.0 } else { 0.8 };
    let mut req = match rng.random_range(0..13) {
        0 => pb::GenerateRequest {
            model: "huginn".into(),
            prompt,
            max_new_tokens: rng.random_range(1..24),
            scheme: Some(Scheme::Ar(pb::ArScheme {
                num_steps: Some(rng.random_range(1..16)),
                ..Default::default()
            })),
            ..Default::default()
        },
        1 => pb::GenerateRequest {
            model: "huginn".into(),
            prompt,
            max_new_tokens: rng.random_range(1..24),
            scheme: Some(Scheme::Ar(pb::ArScheme {
                num_steps: Some(16),
                exit_threshold: Some(5e-4),
                ..Default::default()
            })),
            ..Default::default()
        },
        2 => pb::GenerateRequest {
            model: "huginn".into(),
            prompt,
            max_new_tokens: rng.random_range(1..16),
            scheme: Some(Scheme::DiffusionForcing(pb::DiffusionForcingScheme {
                num_steps: Some(8),
                ..Default::default()
            })),
            ..Default::default()
        },
        // Low-confidence, exact or with Fast-dLLM's caches and threshold rule; lengths that
        // blocks of 8 do not fill are caps.
        3 => {
            let gen = rng.random_range(1..24u32);
            let fast = rng.random_range(0..4);
            pb::GenerateRequest {
                model: "llada".into(),
                prompt,
                max_new_tokens: gen,
                scheme: Some(Scheme::LowConfidence(pb::LowConfidenceScheme {
                    block_length: Some(8),
                    steps: Some(gen.div_ceil(8) * rng.random_range(1..=8)),
                    kv_cache: ["", "prefix", "dual", ""][fast].into(),
                    threshold: (fast == 3 || (fast > 0 && rng.random_bool(0.5))).then_some(0.7),
                    ..Default::default()
                })),
                ..Default::default()
            }
        }
        4 => pb::GenerateRequest {
            model: "llada".into(),
            prompt,
            max_new_tokens: 16,
            scheme: Some(Scheme::Wino(pb::WinoScheme {
                block_length: Some(8),
                ..Default::default()
            })),
            ..Default::default()
        },
        5 => pb::GenerateRequest {
            model: "llada".into(),
            prompt,
            max_new_tokens: 16,
            scheme: Some(Scheme::LowConfidence(pb::LowConfidenceScheme {
                block_length: Some(16),
                steps: Some(16),
                surelock_eps: Some(1e-3),
                ..Default::default()
            })),
            ..Default::default()
        },
        6 | 7 => pb::GenerateRequest {
            model: "armt".into(),
            prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
                ids: (0..rng.random_range(1..120))
                    .map(|_| rng.random_range(3..500))
                    .collect(),
            })),
            max_new_tokens: rng.random_range(1..16),
            scheme: Some(Scheme::Ar(pb::ArScheme {
                execution: ["sequential", "diagonal", "auto"][rng.random_range(0..3)].into(),
                ..Default::default()
            })),
            ..Default::default()
        },
        10 => pb::GenerateRequest {
            model: "dream".into(),
            prompt,
            max_new_tokens: rng.random_range(1..24),
            scheme: Some(Scheme::DiffusionGenerate(pb::DiffusionGenerateScheme {
                alg: ["origin", "maskgit_plus", "topk_margin", "entropy"][rng.random_range(0..4)]
                    .into(),
                steps: Some(rng.random_range(1..12)),
                ..Default::default()
            })),
            ..Default::default()
        },
        11 => pb::GenerateRequest {
            model: "llada2".into(),
            prompt,
            max_new_tokens: rng.random_range(1..40),
            scheme: Some(Scheme::BlockDiffusion(pb::BlockDiffusionScheme {
                block_length: Some([4, 8, 16][rng.random_range(0..3)]),
                steps: Some(rng.random_range(1..9)),
                threshold: Some(0.7),
                eos_early_stop: rng.random_bool(0.5),
                ..Default::default()
            })),
            ..Default::default()
        },
        // DiffusionGemma: whole canvases of 16 or cut answers, early stop or every step; its
        // temperature is the schedule's, so the request's sampling only seeds it.
        12 => {
            let req = pb::GenerateRequest {
                model: "diffusion_gemma".into(),
                prompt,
                max_new_tokens: rng.random_range(1..40),
                scheme: Some(Scheme::EntropyBound(pb::EntropyBoundScheme {
                    max_denoising_steps: Some(rng.random_range(1..12)),
                    no_early_stop: rng.random_bool(0.3),
                    whole_canvases: rng.random_bool(0.3),
                    stability_threshold: Some(rng.random_range(0..2)),
                    confidence_threshold: Some(0.6),
                    ..Default::default()
                })),
                sampling: Some(pb::SamplingParams {
                    seed,
                    ..Default::default()
                }),
                ..Default::default()
            };
            return pb::GenerateRequest {
                stop_strings,
                ..req
            };
        }
        8 => pb::GenerateRequest {
            model: "refusion".into(),
            prompt,
            max_new_tokens: 32,
            scheme: Some(Scheme::PlanInfill(pb::PlanInfillScheme {
                slot_size: Some(4),
                serial_num_blocks: Some(rng.random_range(1..=2)),
                ..Default::default()
            })),
            ..Default::default()
        },
        _ => pb::GenerateRequest {
            model: "refusion".into(),
            prompt,
            max_new_tokens: rng.random_range(1..24),
            scheme: Some(Scheme::Ar(pb::ArScheme::default())),
            ..Default::default()
        },
    };
    req.sampling = sampling(temperature);
    req.stop_strings = stop_strings;
    // Log-probabilities and structured outputs now and then (every family and scheme serves
    // both; a structured output needs a tokenizer and an end-of-sequence id, which the huginn
    // and armt fixtures do not have: those refuse it, as the worker tests check).
    if rng.random_bool(0.2) {
        req.logprobs = Some(rng.random_range(0..4));
    }
    if !matches!(req.model.as_str(), "huginn" | "armt") && rng.random_bool(0.1) {
        use pb::structured_output::Kind;
        let kind = match rng.random_range(0..3) {
            0 => Kind::Regex("[a-z ]{1,12}".into()),
            1 => Kind::Choice(pb::ChoiceList {
                options: vec!["yes".into(), "no".into()],
            }),
            _ => Kind::Json(
                r#"{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":9}},"required":["n"],"additionalProperties":false}"#
                    .into(),
            ),
        };
        req.structured_output = Some(pb::StructuredOutput {
            kind: Some(kind),
            strict: true,
        });
    }
    req
}

/// A request each worker must refuse as invalid.
fn invalid(rng: &mut StdRng) -> pb::GenerateRequest {
    use pb::generate_request::Scheme;
    let base = pb::GenerateRequest {
        model: "huginn".into(),
        prompt: text("hello"),
        max_new_tokens: 4,
        ..Default::default()
    };
    match rng.random_range(0..9) {
        0 => pb::GenerateRequest {
            model: "no-such-model".into(),
            ..base
        },
        8 => pb::GenerateRequest {
            model: "diffusion_gemma".into(),
            scheme: Some(Scheme::EntropyBound(pb::EntropyBoundScheme {
                entropy_bound: Some(-1.0),
                ..Default::default()
            })),
            ..base
        },
        // A chat over --max-chat-messages: refused before it is rendered.
        7 => pb::GenerateRequest {
            model: "llada".into(),
            prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatMessages {
                messages: vec![
                    pb::ChatMessage {
                        role: "user".into(),
                        content: String::new(),
                    };
                    1025
                ],
            })),
            ..base
        },
        1 => pb::GenerateRequest {
            prompt: None,
            ..base
        },
        2 => pb::GenerateRequest {
            max_new_tokens: 0,
            ..base
        },
        3 => pb::GenerateRequest {
            sampling: Some(pb::SamplingParams {
                temperature: -1.0,
                ..Default::default()
            }),
            ..base
        },
        4 => pb::GenerateRequest {
            model: "llada".into(),
            max_new_tokens: 10,
            // Three blocks of 4 (the canvas rounded up): 5 steps do not split evenly.
            scheme: Some(Scheme::LowConfidence(pb::LowConfidenceScheme {
                block_length: Some(4),
                steps: Some(5),
                ..Default::default()
            })),
            ..base
        },
        5 => pb::GenerateRequest {
            model: "armt".into(),
            scheme: Some(Scheme::Ar(pb::ArScheme {
                execution: "pipelined".into(),
                ..Default::default()
            })),
            ..base
        },
        _ => pb::GenerateRequest {
            stop_strings: vec!["x".into(); 100],
            ..base
        },
    }
}

/// One request's outcome as the client saw it.
#[derive(Debug, Clone)]
struct Outcome {
    /// `ok`, `cancelled by client`, or the status code's name.
    result: String,
    latency: Duration,
    tokens: usize,
    /// What was wrong with the answer, if anything.
    malformed: Option<String>,
}

/// Sends one request and reads it the way `reader` says.
async fn one(
    client: &mut GenerationClient<Channel>,
    req: pb::GenerateRequest,
    kind: Kind,
    reader: Reader,
    deadline: Duration,
) -> Outcome {
    let start = Instant::now();
    let mut request = tonic::Request::new(req.clone());
    request.set_timeout(deadline);
    let mut out = Outcome {
        result: String::new(),
        latency: Duration::ZERO,
        tokens: 0,
        malformed: None,
    };
    let done = match reader {
        Reader::Unary => match client.generate(request).await {
            Ok(r) => Ok(r.into_inner()),
            Err(s) => Err(s),
        },
        Reader::Stream | Reader::Slow(_) | Reader::Stall(_) | Reader::Cancel(_) => {
            let cancel_at = match reader {
                Reader::Cancel(d) => Some(start + d),
                _ => None,
            };
            let read = async {
                let mut stream = client.generate_stream(request).await?.into_inner();
                let mut streamed = Vec::new();
                let mut stalled = false;
                loop {
                    match stream.message().await? {
                        None => {
                            return Err(tonic::Status::unknown(
                                "stream ended without a final message",
                            ))
                        }
                        Some(m) => match m.event {
                            Some(pb::generate_stream_response::Event::Tokens(t)) => {
                                streamed.extend(t.token_ids)
                            }
                            Some(pb::generate_stream_response::Event::Done(d)) => {
                                if d.token_ids != streamed {
                                    return Err(tonic::Status::unknown(
                                        "streamed tokens differ from the final message's",
                                    ));
                                }
                                return Ok(d);
                            }
                            Some(pb::generate_stream_response::Event::Canvas(_))
                            | Some(pb::generate_stream_response::Event::Prompt(_)) => {}
                            None => return Err(tonic::Status::unknown("empty stream message")),
                        },
                    }
                    match reader {
                        Reader::Slow(d) => tokio::time::sleep(d).await,
                        Reader::Stall(d) if !stalled => {
                            stalled = true;
                            tokio::time::sleep(d).await;
                        }
                        _ => {}
                    }
                }
            };
            match cancel_at {
                Some(at) => match tokio::time::timeout_at(at.into(), read).await {
                    Ok(r) => r,
                    Err(_) => {
                        out.result = "cancelled by client".into();
                        out.latency = start.elapsed();
                        return out;
                    }
                },
                None => read.await,
            }
        }
    };
    out.latency = start.elapsed();
    match done {
        Ok(d) => {
            out.result = "ok".into();
            out.tokens = d.token_ids.len();
            let reason = pb::FinishReason::try_from(d.finish_reason);
            if !matches!(
                reason,
                Ok(pb::FinishReason::Length
                    | pb::FinishReason::StopToken
                    | pb::FinishReason::StopString
                    | pb::FinishReason::ContextLimit)
            ) {
                out.malformed = Some(format!("finish reason {:?}", d.finish_reason));
            } else if d.stats.is_none() {
                out.malformed = Some("no statistics".into());
            } else if d.token_ids.len() > token_cap(&req) {
                out.malformed = Some(format!(
                    "{} tokens for max_new_tokens {}",
                    d.token_ids.len(),
                    req.max_new_tokens
                ));
            }
            if kind == Kind::Invalid {
                out.malformed = Some("an invalid request was served".into());
            }
        }
        Err(s) => {
            out.result = format!("{:?}", s.code());
            let documented = matches!(
                s.code(),
                Code::InvalidArgument
                    | Code::NotFound
                    | Code::ResourceExhausted
                    | Code::DeadlineExceeded
                    | Code::Cancelled
            );
            if !documented || s.message().is_empty() {
                out.malformed = Some(format!("status {:?}: {}", s.code(), s.message()));
            } else if kind == Kind::Invalid
                && !matches!(
                    s.code(),
                    Code::InvalidArgument | Code::NotFound | Code::DeadlineExceeded
                )
                // The client's own timer (tonic answers CANCELLED "Timeout expired") can fire
                // before the refusal arrives when the deadline is a few milliseconds.
                && !(s.code() == Code::Cancelled && out.latency >= deadline)
            {
                out.malformed = Some(format!(
                    "invalid request answered {:?}: {}",
                    s.code(),
                    s.message()
                ));
            } else if kind == Kind::Valid
                && matches!(s.code(), Code::InvalidArgument | Code::NotFound)
            {
                out.malformed = Some(format!(
                    "valid request refused {:?}: {}",
                    s.code(),
                    s.message()
                ));
            }
        }
    }
    if let Some(m) = &mut out.malformed {
        *m = format!("{} ({}): {m}", req.model, scheme_name(&req));
    }
    out
}

/// The most tokens a response may carry: `max_new_tokens`, or whole canvases of the fixture's
/// 16 for DiffusionGemma's upstream switch `whole_canvases`.
fn token_cap(req: &pb::GenerateRequest) -> usize {
    let n = req.max_new_tokens as usize;
    match &req.scheme {
        Some(pb::generate_request::Scheme::EntropyBound(e)) if e.whole_canvases => {
            n.div_ceil(16) * 16
        }
        _ => n,
    }
}

/// The request's scheme, for reports.
fn scheme_name(req: &pb::GenerateRequest) -> &'static str {
    use pb::generate_request::Scheme;
    match req.scheme {
        None => "default",
        Some(Scheme::Ar(_)) => "ar",
        Some(Scheme::DiffusionForcing(_)) => "diffusion_forcing",
        Some(Scheme::LowConfidence(_)) => "low_confidence",
        Some(Scheme::Wino(_)) => "wino",
        Some(Scheme::PlanInfill(_)) => "plan_infill",
        Some(Scheme::DiffusionGenerate(_)) => "diffusion_generate",
        Some(Scheme::BlockDiffusion(_)) => "block_diffusion",
        Some(Scheme::EntropyBound(_)) => "entropy_bound",
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_every_family_and_scheme_with_messy_clients_leaks_nothing() {
    let total = env_or("WAVEFRONT_SOAK_REQUESTS", 600) as usize;
    let concurrency = env_or("WAVEFRONT_SOAK_CONCURRENCY", 64) as usize;
    let budget = Duration::from_secs(env_or("WAVEFRONT_SOAK_SECONDS", 100));
    let seed = env_or("WAVEFRONT_SOAK_SEED", 7);

    let mut workers = vec![
        worker("huginn", "huginn"),
        worker("llada", "llada"),
        worker("armt", "armt"),
        worker("refusion", "refusion"),
        worker("dream", "dream"),
        worker("llada2", "llada2"),
        worker("diffusion_gemma", "diffusion_gemma"),
    ];
    for w in &workers {
        wait_serving(w.proc.addr, "wavefront.worker.v1.Worker").await;
    }
    let targets: Vec<String> = workers.iter().map(|w| w.proc.addr.to_string()).collect();
    let mut router = spawn_router("127.0.0.1:0", &targets.join(","), 200, &[]);
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    let mut pids: Vec<u32> = workers.iter().map(|w| w.proc.child.id()).collect();
    pids.push(router.child.id());
    // Each worker's metrics port, for its pools' allocated bytes (the router has none).
    let mut ports: Vec<Option<u16>> = workers.iter().map(|w| Some(w.metrics_port)).collect();
    ports.push(None);

    let window = (total / 10).clamp(1, 1000);
    let next = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(AtomicUsize::new(0));
    let outcomes = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let rss_first = Arc::new(Mutex::new(None::<Vec<Memory>>));
    let rss_mid = Arc::new(Mutex::new(None::<Vec<Memory>>));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for task in 0..concurrency {
        // One connection per client task.
        let ch = channel(router.addr).await;
        let (next, finished, outcomes) = (next.clone(), finished.clone(), outcomes.clone());
        let (rss_first, rss_mid, pids) = (rss_first.clone(), rss_mid.clone(), pids.clone());
        let ports = ports.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = GenerationClient::new(ch);
            let mut rng = StdRng::seed_from_u64(seed * 1000 + task as u64);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total || start.elapsed() > budget {
                    return;
                }
                let (req, kind) = if rng.random_bool(0.1) {
                    (invalid(&mut rng), Kind::Invalid)
                } else {
                    (valid(&mut rng), Kind::Valid)
                };
                let reader = match rng.random_range(0..10) {
                    0..=2 => Reader::Unary,
                    3..=5 => Reader::Stream,
                    6 => Reader::Slow(Duration::from_millis(rng.random_range(1..30))),
                    7 => Reader::Stall(Duration::from_millis(rng.random_range(100..2000))),
                    _ => Reader::Cancel(Duration::from_millis(rng.random_range(1..500))),
                };
                // Log-uniform between 10 ms and 10 s.
                let deadline = Duration::from_secs_f64(10f64.powf(rng.random_range(-2.0..1.0)));
                let o = one(&mut client, req, kind, reader, deadline).await;
                outcomes.lock().unwrap().push(o);
                let n = finished.fetch_add(1, Ordering::Relaxed) + 1;
                if n == window {
                    *rss_first.lock().unwrap() = Some(memory(&pids, &ports));
                }
                if n == total / 2 {
                    *rss_mid.lock().unwrap() = Some(memory(&pids, &ports));
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    let elapsed = start.elapsed();
    let rss_last: Vec<Memory> = memory(&pids, &ports);

    // No process exited (a child that exited is reaped here, so a zombie counts as gone).
    for w in workers.iter_mut() {
        let exited = w.proc.child.try_wait().expect("wait");
        assert!(
            exited.is_none(),
            "the {} worker exited: {exited:?}",
            w.family
        );
    }
    let exited = router.child.try_wait().expect("wait");
    assert!(exited.is_none(), "the router exited: {exited:?}");
    // After the messy clients the cache still works: the long prompt twice on ReFusion, the
    // second reading the pages the first (or an earlier request) left.
    {
        let mut client = GenerationClient::new(channel(router.addr).await);
        let long = pb::GenerateRequest {
            model: "refusion".into(),
            prompt: text(PROMPTS[PROMPTS.len() - 1]),
            max_new_tokens: 4,
            scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme::default())),
            ..Default::default()
        };
        let mut shared = 0;
        for _ in 0..2 {
            let r = client
                .generate(long.clone())
                .await
                .expect("the long prompt after the soak")
                .into_inner();
            shared = r
                .stats
                .and_then(|s| s.counters.get("shared_prompt_tokens").copied())
                .unwrap_or(0);
        }
        assert!(shared > 0, "the repeated long prompt read no kept pages");
    }

    // Nothing held: load reports and gauges back to empty on every worker (none preempted).
    let mut preemptions = Vec::with_capacity(workers.len());
    for w in &workers {
        let start = Instant::now();
        loop {
            let mut c = WorkerClient::new(channel(w.proc.addr).await);
            let m = c
                .get_load(LoadRequest { interval_ms: 0 })
                .await
                .expect("load report")
                .into_inner()
                .models
                .remove(0);
            let body = scrape(w.metrics_port);
            let used = sample(&body, "wavefront_slots_used{");
            let queued = sample(&body, "wavefront_queue_depth{");
            let active = sample(&body, "wavefront_active_requests{");
            if m.free_slots == m.total_slots
                && m.active_requests == 0
                && m.queued_requests == 0
                && m.preempted_requests == 0
                && used == Some(0.0)
                && queued == Some(0.0)
                && active == Some(0.0)
            {
                preemptions.push(m.preemptions);
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "{} leaks: {m:?}, gauges used {used:?} queued {queued:?} active {active:?}",
                w.family
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // The long prompt's repeats read what finished requests left in the prefix cache; a hit
    // reads at least one prompt row (an adoption that shares nothing is not counted).
    let summed = |name: &str| -> f64 {
        workers
            .iter()
            .filter_map(|w| sample(&scrape(w.metrics_port), name))
            .sum()
    };
    let cache_hits = summed("wavefront_engine_prefix_cache_hits_total{");
    let hit_tokens = summed("wavefront_engine_prefix_cache_hit_tokens_total{");
    assert!(cache_hits > 0.0, "no request read the prefix cache");
    assert!(
        hit_tokens >= cache_hits,
        "{cache_hits} prefix-cache hits read only {hit_tokens} prompt tokens"
    );

    let outcomes = outcomes.lock().unwrap().clone();
    let malformed: Vec<&Outcome> = outcomes.iter().filter(|o| o.malformed.is_some()).collect();
    let mut by_result: BTreeMap<String, usize> = BTreeMap::new();
    for o in &outcomes {
        *by_result.entry(o.result.clone()).or_default() += 1;
    }
    let mut ok: Vec<Duration> = outcomes
        .iter()
        .filter(|o| o.result == "ok")
        .map(|o| o.latency)
        .collect();
    ok.sort();
    let tokens: usize = outcomes.iter().map(|o| o.tokens).sum();
    let first = rss_first.lock().unwrap().clone().unwrap_or_default();
    let mid = rss_mid.lock().unwrap().clone().unwrap_or_default();
    let growth = |pick: fn(&Memory) -> u64| -> Vec<f64> {
        first
            .iter()
            .zip(&rss_last)
            .map(|(a, b)| pick(b) as f64 / pick(a).max(1) as f64 - 1.0)
            .collect()
    };
    let (rss_growth, anon_growth) = (growth(|m| m.0), growth(|m| m.1));
    // Resident memory beyond the slot pools' arenas (made on first use and kept: their
    // high-water mark follows the most pages the mix ever had in flight, bounded by the pool).
    let beyond = |m: &Memory| m.0.saturating_sub(m.2);
    let beyond_growth = growth(|m| m.0.saturating_sub(m.2));
    let report = serde_json::json!({
        "requests": outcomes.len(),
        "concurrency": concurrency,
        "seconds": elapsed.as_secs_f64(),
        "requests_per_second": outcomes.len() as f64 / elapsed.as_secs_f64(),
        "tokens_per_second": tokens as f64 / elapsed.as_secs_f64(),
        "latency_ms_ok": {"p50": percentile(&ok, 0.5), "p99": percentile(&ok, 0.99)},
        "results": by_result,
        "prefix_cache_hits": cache_hits,
        "prefix_cache_hit_tokens": hit_tokens,
        "malformed": malformed.len(),
        "rss_kib_first_window": first.iter().map(|m| m.0).collect::<Vec<_>>(),
        "rss_kib_middle": mid.iter().map(|m| m.0).collect::<Vec<_>>(),
        "rss_kib_end": rss_last.iter().map(|m| m.0).collect::<Vec<_>>(),
        "rss_growth": rss_growth,
        "anon_kib_first_window": first.iter().map(|m| m.1).collect::<Vec<_>>(),
        "anon_kib_middle": mid.iter().map(|m| m.1).collect::<Vec<_>>(),
        "anon_kib_end": rss_last.iter().map(|m| m.1).collect::<Vec<_>>(),
        "anon_growth": anon_growth,
        "pool_kib_first_window": first.iter().map(|m| m.2).collect::<Vec<_>>(),
        "pool_kib_middle": mid.iter().map(|m| m.2).collect::<Vec<_>>(),
        "pool_kib_end": rss_last.iter().map(|m| m.2).collect::<Vec<_>>(),
        "rss_beyond_pools_growth": beyond_growth,
        "processes": ["huginn", "llada", "armt", "refusion", "dream", "llada2", "diffusion_gemma", "router"],
        "preemptions": preemptions,
        "window": window,
    });
    println!("soak: {report}");
    if let Ok(path) = std::env::var("WAVEFRONT_SOAK_REPORT") {
        std::fs::write(path, report.to_string()).expect("write the soak report");
    }
    assert!(
        malformed.is_empty(),
        "{} malformed answers, e.g. {:?}",
        malformed.len(),
        &malformed[..malformed.len().min(5)]
    );
    assert!(
        outcomes.len() == total || elapsed >= budget,
        "only {} of {total} requests ran",
        outcomes.len()
    );
    assert!(
        ok.len() * 4 >= outcomes.len(),
        "too few requests served: {by_result:?}"
    );
    // Memory, from 10,000 requests on (a short run, as in CI, measures warm-up; it is reported
    // only): every process's resident memory beyond its slot pools' arenas (a pool's
    // high-water mark, bounded by its size: `wavefront_pool_allocated_bytes`) within 10% of
    // what it was after the first thousand requests, and within 10% over the second half (a
    // leak grows with the requests served). The servers return freed heap to the system every
    // few seconds (`services/cli/src/memory.rs`), so resident memory follows what they hold,
    // not the largest burst of the run.
    if total >= 10_000 && outcomes.len() == total {
        let names = [
            "huginn",
            "llada",
            "armt",
            "refusion",
            "dream",
            "llada2",
            "diffusion_gemma",
            "router",
        ];
        for (((name, g), m), end) in names.iter().zip(&beyond_growth).zip(&mid).zip(&rss_last) {
            assert!(
                *g < 0.10,
                "{name}'s resident memory beyond its pools grew {:.1}% between the first and last \
                 {window} requests",
                g * 100.0
            );
            let second_half = beyond(end) as f64 / beyond(m).max(1) as f64 - 1.0;
            assert!(
                second_half < 0.10,
                "{name}'s resident memory grew {:.1}% over the second half of the run",
                second_half * 100.0
            );
        }
    }
}

/// How long a flooding client waits after a refusal before it sends again.
const FLOOD_BACKOFF: Duration = Duration::from_millis(100);

/// Latencies of `clients` clients sending `req` in a loop for `run`, plus `flood` clients that
/// send the same as fast as they are answered: (admitted latencies, shed count).
async fn load_phase(
    addr: SocketAddr,
    req: &pb::GenerateRequest,
    clients: usize,
    flood: usize,
    run: Duration,
) -> (Vec<Duration>, usize, Vec<(f64, f64)>) {
    let admitted = Arc::new(Mutex::new(Vec::new()));
    let queued = Arc::new(Mutex::new(Vec::new()));
    let shed = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients + flood {
        let ch = channel(addr).await;
        let (admitted, shed, req) = (admitted.clone(), shed.clone(), req.clone());
        let queued = queued.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = GenerationClient::new(ch);
            while start.elapsed() < run {
                let t = Instant::now();
                match client.generate(req.clone()).await {
                    Ok(r) => {
                        let latency = t.elapsed();
                        admitted.lock().unwrap().push(latency);
                        let q = r.get_ref().stats.as_ref().map_or(0.0, |s| s.queue_time_ms);
                        queued
                            .lock()
                            .unwrap()
                            .push((latency.as_secs_f64() * 1e3, q));
                    }
                    Err(s) if s.code() == Code::ResourceExhausted => {
                        shed.fetch_add(1, Ordering::Relaxed);
                        // Retried after a short backoff (gRPC's retry policies start at
                        // 100 ms or more).
                        tokio::time::sleep(FLOOD_BACKOFF).await;
                    }
                    Err(s) => panic!("unexpected status under load: {s:?}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client");
    }
    let mut v = admitted.lock().unwrap().clone();
    v.sort();
    let q = queued.lock().unwrap().clone();
    (v, shed.load(Ordering::Relaxed), q)
}

/// A flood far beyond the queue is shed with RESOURCE_EXHAUSTED; what is admitted waits at most
/// about one request's time for a place (the queue holds one) and, once running, keeps the
/// latency it has at the worker's capacity without the flood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_is_shed_and_admitted_requests_keep_their_latency() {
    let worker = spawn_worker("huginn", &["--max-active", "4", "--queue-capacity", "1"]);
    wait_serving(worker.addr, "wavefront.worker.v1.Worker").await;
    let router = spawn_router("127.0.0.1:0", &worker.addr.to_string(), 200, &[]);
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    let req = pb::GenerateRequest {
        prompt: text("You may copy"),
        max_new_tokens: 16,
        scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
            num_steps: Some(16),
            ..Default::default()
        })),
        ..Default::default()
    };
    // Phases alternate (capacity, flood, capacity, ...) so that whatever else the machine runs
    // meanwhile weighs on both sides alike.
    let run = Duration::from_secs(env_or("WAVEFRONT_OVERLOAD_SECONDS", 5));
    let (mut base, mut base_shed, mut loaded, mut shed) = (Vec::new(), 0, Vec::new(), 0);
    let (mut base_queued, mut loaded_queued) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        // At capacity: as many clients as the worker batches, nothing shed.
        let (b, s, q) = load_phase(router.addr, &req, 4, 0, run).await;
        base.extend(b);
        base_shed += s;
        base_queued.extend(q);
        // The same clients and a flood of 128 more.
        let (l, s, q) = load_phase(router.addr, &req, 4, 128, run).await;
        loaded.extend(l);
        shed += s;
        loaded_queued.extend(q);
    }
    base.sort();
    loaded.sort();
    let (b50, b99) = (percentile(&base, 0.5), percentile(&base, 0.99));
    let (l50, l99) = (percentile(&loaded, 0.5), percentile(&loaded, 0.99));
    // Each admitted request's time in the worker's queue, and the rest of its latency (the
    // flood keeps the queue's one place taken, so a request admitted there waits for a running
    // one to finish: up to one request's time).
    let split = |v: &[(f64, f64)]| {
        let mut queue: Vec<f64> = v.iter().map(|&(_, q)| q).collect();
        let mut rest: Vec<f64> = v.iter().map(|&(l, q)| l - q).collect();
        queue.sort_by(f64::total_cmp);
        rest.sort_by(f64::total_cmp);
        let at = |v: &[f64], p: f64| v[((v.len() as f64 * p) as usize).min(v.len() - 1)];
        (at(&queue, 0.5), at(&queue, 0.99), at(&rest, 0.99))
    };
    let (bq50, bq99, brest99) = split(&base_queued);
    let (lq50, lq99, lrest99) = split(&loaded_queued);
    let report = serde_json::json!({
        "capacity": {"served": base.len(), "shed": base_shed, "p50_ms": b50, "p99_ms": b99,
                     "queue_p50_ms": bq50, "queue_p99_ms": bq99, "after_queue_p99_ms": brest99},
        "flood": {"served": loaded.len(), "shed": shed, "p50_ms": l50, "p99_ms": l99,
                  "queue_p50_ms": lq50, "queue_p99_ms": lq99, "after_queue_p99_ms": lrest99},
        "p99_ratio": l99 / b99,
        "after_queue_p99_ratio": lrest99 / b99,
    });
    println!("overload: {report}");
    assert_eq!(base_shed, 0, "nothing is shed at capacity");
    assert!(
        shed > loaded.len(),
        "the flood was mostly shed: {shed} shed, {} served",
        loaded.len()
    );
    // The bound is 2x, which `scripts/soak.sh` asserts on a release build running alone;
    // `cargo test` runs this beside the other end-to-end tests on the same cores, so it holds a
    // looser bound that still fails if admitted requests queue behind the flood. It applies to
    // what follows admission: the wait for a place in a full worker (queue capacity 1) is up
    // to one request's time by construction, and is bounded on its own.
    let max_ratio = std::env::var("WAVEFRONT_OVERLOAD_MAX_RATIO")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4.0);
    assert!(
        lrest99 <= max_ratio * b99,
        "admitted requests' p99 after the queue {lrest99:.1} ms against {b99:.1} ms at capacity \
         (bound {max_ratio}x)"
    );
    assert!(
        lq99 <= 0.75 * max_ratio * b99,
        "admitted requests waited {lq99:.1} ms in the queue at p99: more than one request's time \
         ({b99:.1} ms at capacity, bound {}x)",
        0.75 * max_ratio
    );
    // Nothing held afterwards.
    wait_whole(worker.addr, Duration::from_secs(10)).await;
}
