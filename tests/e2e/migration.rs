//! Requests that move between workers, on real processes: a router and two workers per family;
//! a request of every family in the middle of its generation on worker A; SIGTERM to A. A exits
//! long before its requests would have finished, and every stream completes on B with the
//! tokens of an uninterrupted run (greedy and seeded), its statistics counting the move. And a
//! request whose only other worker is full stays where it is and finishes there: nothing lost.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;
use wavefront_proto::worker::v1::worker_client::WorkerClient;

use crate::harness::{
    channel, load, spawn_router, spawn_worker, spawn_worker_at, wait_load, wait_serving, Proc,
};

/// Router refresh in these tests: how soon it sees a worker draining.
const REFRESH_MS: u64 = 100;

fn ids(n: usize, salt: u32) -> pb::generate_request::Prompt {
    pb::generate_request::Prompt::TokenIds(pb::TokenIds {
        ids: (0..n as u32)
            .map(|i| (i * 37 + salt * 101 + 11) % 400 + 5)
            .collect(),
    })
}

/// One long request per family (each runs for seconds on the fixtures), seeded where it samples.
fn cases() -> Vec<(&'static str, pb::GenerateRequest)> {
    use pb::generate_request::Scheme;
    let base = |prompt, max_new_tokens, scheme| pb::GenerateRequest {
        prompt: Some(prompt),
        max_new_tokens,
        scheme: Some(scheme),
        ..Default::default()
    };
    let mut sampled = base(
        ids(3, 1),
        250,
        Scheme::Ar(pb::ArScheme {
            num_steps: Some(32),
            ..Default::default()
        }),
    );
    sampled.sampling = Some(pb::SamplingParams {
        temperature: 0.8,
        seed: Some(7),
        ..Default::default()
    });
    let cases = vec![
        ("huginn", sampled),
        (
            "llada",
            base(
                ids(3, 2),
                512,
                Scheme::LowConfidence(pb::LowConfidenceScheme {
                    block_length: Some(32),
                    steps: Some(512),
                    surelock_eps: Some(1e-3),
                    ..Default::default()
                }),
            ),
        ),
        (
            "armt",
            base(ids(20_000, 3), 200, Scheme::Ar(pb::ArScheme::default())),
        ),
        (
            "refusion",
            base(
                ids(3, 4),
                2048,
                Scheme::PlanInfill(pb::PlanInfillScheme {
                    slot_size: Some(8),
                    serial_num_blocks: Some(16),
                    slot_threshold: Some(0.99),
                    ..Default::default()
                }),
            ),
        ),
        (
            "dream",
            base(
                ids(3, 5),
                250,
                Scheme::DiffusionGenerate(pb::DiffusionGenerateScheme {
                    steps: Some(250),
                    ..Default::default()
                }),
            ),
        ),
        (
            "llada2",
            base(
                ids(3, 6),
                2048,
                Scheme::BlockDiffusion(pb::BlockDiffusionScheme {
                    block_length: Some(32),
                    steps: Some(32),
                    threshold: Some(1.0),
                    ..Default::default()
                }),
            ),
        ),
    ];
    cases
        .into_iter()
        .map(|(name, mut r)| {
            r.model = name.to_owned();
            (name, r)
        })
        .collect()
}

/// Every token of a stream, its final message, and when it ended.
struct Run {
    tokens: Vec<u32>,
    done: pb::GenerateResponse,
    ended: Instant,
}

async fn drain(
    mut stream: tonic::Streaming<pb::GenerateStreamResponse>,
    mut tokens: Vec<u32>,
) -> Run {
    loop {
        let m = stream
            .message()
            .await
            .expect("the stream survives the move")
            .expect("a final message");
        match m.event {
            Some(pb::generate_stream_response::Event::Tokens(c)) => tokens.extend(c.token_ids),
            Some(pb::generate_stream_response::Event::Done(done)) => {
                return Run {
                    tokens,
                    done,
                    ended: Instant::now(),
                }
            }
            _ => {}
        }
    }
}

/// A router (with `flags`) over worker `a` and a second address where no worker listens yet,
/// serving; that address.
async fn router_before_b(a: SocketAddr, flags: &[&str]) -> (Proc, SocketAddr) {
    let b = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let router = spawn_router("127.0.0.1:0", &format!("{a},{b}"), REFRESH_MS, flags);
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    (router, b)
}

/// Each of `reqs` streamed through the router at `router`, drained in a task of its own.
async fn stream_all(
    router: SocketAddr,
    reqs: &[pb::GenerateRequest],
) -> Vec<tokio::task::JoinHandle<Run>> {
    let mut runs = Vec::new();
    for r in reqs {
        let mut client = GenerationClient::new(channel(router).await);
        let stream = client
            .generate_stream(r.clone())
            .await
            .expect("routed")
            .into_inner();
        runs.push(tokio::spawn(drain(stream, Vec::new())));
    }
    runs
}

/// The uninterrupted run: straight to worker `addr`, no router.
async fn uninterrupted(addr: SocketAddr, req: pb::GenerateRequest) -> Run {
    let mut w = WorkerClient::new(channel(addr).await);
    let stream = w.generate(req).await.expect("baseline").into_inner();
    drain(stream, Vec::new()).await
}

async fn active(addr: SocketAddr) -> u32 {
    load(addr).await.active_requests
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_moves_every_familys_requests_to_the_other_worker_token_for_token() {
    let cases = cases();
    let pairs: Vec<(Proc, Proc)> = cases
        .iter()
        .map(|(fixture, _)| {
            let a = spawn_worker(fixture, &["--drain-timeout-s", "120"]);
            let b = spawn_worker(fixture, &[]);
            (a, b)
        })
        .collect();
    for (a, b) in &pairs {
        wait_serving(a.addr, "wavefront.worker.v1.Worker").await;
        wait_serving(b.addr, "wavefront.worker.v1.Worker").await;
    }
    let targets = pairs
        .iter()
        .flat_map(|(a, b)| [a.addr.to_string(), b.addr.to_string()])
        .collect::<Vec<_>>()
        .join(",");
    let router = spawn_router("127.0.0.1:0", &targets, REFRESH_MS, &[]);
    wait_serving(router.addr, "wavefront.v1.Generation").await;

    // Every request at once; each is under way once its first tokens arrived (ARMT: once it
    // runs, its long context's segments still going through the layers).
    let mut streams = Vec::new();
    let mut started = Vec::new();
    for (fixture, req) in cases.iter().cloned() {
        let mut client = GenerationClient::new(channel(router.addr).await);
        let (tx, rx) = tokio::sync::oneshot::channel();
        started.push(rx);
        streams.push(tokio::spawn(async move {
            let mut stream = client
                .generate_stream(req)
                .await
                .unwrap_or_else(|e| panic!("{fixture}: {e}"))
                .into_inner();
            if fixture == "armt" {
                let _ = tx.send(());
                return drain(stream, Vec::new()).await;
            }
            let mut first = Vec::new();
            loop {
                let m = stream.message().await.expect("first").expect("first");
                match m.event {
                    Some(pb::generate_stream_response::Event::Tokens(c)) => {
                        first.extend(c.token_ids);
                        break;
                    }
                    Some(pb::generate_stream_response::Event::Done(_)) => {
                        panic!("{fixture}: the request finished before its worker was stopped")
                    }
                    _ => {}
                }
            }
            let _ = tx.send(());
            drain(stream, first).await
        }));
    }
    for rx in started {
        rx.await.expect("every request starts");
    }
    // The worker running each request is the one to stop.
    let mut placed = Vec::new();
    for ((fixture, _), (a, b)) in cases.iter().zip(pairs) {
        let start = Instant::now();
        let on_a = loop {
            let (on_a, on_b) = (active(a.addr).await, active(b.addr).await);
            if on_a + on_b == 1 {
                break on_a == 1;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{fixture}: runs once"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        placed.push(if on_a { (a, b) } else { (b, a) });
    }
    // SIGTERM to every worker running a request, at once; the uninterrupted runs go straight to
    // the others.
    let stopped = Instant::now();
    let mut exits = Vec::new();
    let mut baselines = Vec::new();
    let mut keep = Vec::new();
    for ((_, req), (src, dst)) in cases.iter().zip(placed) {
        exits.push(std::thread::spawn(move || {
            (src.terminate(), Instant::now())
        }));
        baselines.push(tokio::spawn(uninterrupted(dst.addr, req.clone())));
        keep.push(dst);
    }
    let started = Instant::now();
    for (i, ((stream, baseline), exit)) in streams.into_iter().zip(baselines).zip(exits).enumerate()
    {
        let fixture = cases[i].0;
        let moved = stream.await.unwrap();
        let alone = baseline.await.unwrap();
        let (status, exited) = exit.join().unwrap();
        assert!(
            status.success(),
            "{fixture}: the stopped worker exits cleanly: {status:?}"
        );
        assert_eq!(
            moved.tokens, alone.tokens,
            "{fixture}: tokens after the move"
        );
        assert_eq!(moved.done.token_ids, alone.done.token_ids, "{fixture}");
        assert_eq!(moved.done.text, alone.done.text, "{fixture}");
        assert_eq!(
            moved.done.finish_reason, alone.done.finish_reason,
            "{fixture}"
        );
        let (ms, als) = (
            moved.done.stats.clone().expect("stats"),
            alone.done.stats.clone().expect("stats"),
        );
        assert_eq!(ms.migrations, 1, "{fixture}: the request moved once");
        assert_eq!(ms.generated_tokens, als.generated_tokens, "{fixture}");
        assert_eq!(ms.forward_passes, als.forward_passes, "{fixture}");
        assert_eq!(ms.prompt_tokens, als.prompt_tokens, "{fixture}");
        assert_eq!(ms.counters, als.counters, "{fixture}");
        // The stopped worker was gone before the moved request ended, and sooner than a whole
        // run takes.
        let (exit_after, whole) = (exited - stopped, alone.ended - started);
        assert!(
            exited < moved.ended,
            "{fixture}: the worker exited after the request ended"
        );
        assert!(
            exit_after < whole,
            "{fixture}: exit {exit_after:?}, a whole run {whole:?}"
        );
        eprintln!(
            "{fixture}: the stopped worker exited {:.2} s after SIGTERM; the moved request ended \
             {:.2} s after it; a whole run took {:.2} s",
            exit_after.as_secs_f64(),
            (moved.ended - stopped).as_secs_f64(),
            whole.as_secs_f64()
        );
    }
    drop(keep);
    drop(router);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_only_other_worker_is_full_is_not_lost() {
    let (fixture, req) = cases().remove(0);
    let a = spawn_worker(fixture, &["--drain-timeout-s", "120"]);
    // B takes one request and queues none: with its own request running it refuses the move.
    let b = spawn_worker(fixture, &["--max-active", "1", "--queue-capacity", "1"]);
    wait_serving(a.addr, "wavefront.worker.v1.Worker").await;
    wait_serving(b.addr, "wavefront.worker.v1.Worker").await;
    let router = spawn_router(
        "127.0.0.1:0",
        &format!("{},{}", a.addr, b.addr),
        REFRESH_MS,
        &[],
    );
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    // B busy with two requests (one running, one queued): full.
    let b_runs: Vec<_> = (0..2)
        .map(|_| tokio::spawn(uninterrupted(b.addr, req.clone())))
        .collect();
    let start = Instant::now();
    while load(b.addr).await.queued_requests + load(b.addr).await.active_requests < 2 {
        assert!(start.elapsed() < Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(3 * REFRESH_MS)).await;
    let mut client = GenerationClient::new(channel(router.addr).await);
    let stream = client
        .generate_stream(req.clone())
        .await
        .expect("routed to A")
        .into_inner();
    wait_load(a.addr, "running on A", |l| l.active_requests == 1).await;
    let relay = tokio::spawn(drain(stream, Vec::new()));
    let status = a.terminate();
    assert!(status.success(), "A exits cleanly: {status:?}");
    let got = relay.await.unwrap();
    let mut alone = Vec::new();
    for r in b_runs {
        alone.push(r.await.unwrap());
    }
    // Finished on A, or moved to B once B had room: the same tokens either way.
    assert_eq!(got.tokens, alone[0].tokens);
    assert_eq!(got.done.token_ids, alone[0].done.token_ids);
    let migrations = got.done.stats.as_ref().expect("stats").migrations;
    assert!(migrations <= 1, "{migrations}");
    eprintln!("the request moved {migrations} times");
    drop(b);
    drop(router);
}

/// The worker API's export and resume refuse what they cannot take, saying why, and a move
/// that fails loses nothing: the exported request continues where it was. They are behind the
/// worker token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_states_are_refused_and_a_called_off_export_continues_where_it_was() {
    use tonic::Code;
    use wavefront_proto::worker::v1 as wpb;
    let (fixture, mut req) = cases().remove(0);
    req.max_new_tokens = 120;
    let a = spawn_worker(fixture, &[]);
    let b = spawn_worker(fixture, &[]);
    let other = spawn_worker("dream", &[]);
    let locked = spawn_worker(fixture, &["--worker-token", "w0rker"]);
    for w in [&a, &b, &other, &locked] {
        wait_serving(w.addr, "wavefront.worker.v1.Worker").await;
    }
    let alone = uninterrupted(b.addr, req.clone()).await;

    let mut wa = WorkerClient::new(channel(a.addr).await);
    let resp = wa.generate(req.clone()).await.expect("runs on A");
    let id: u64 = resp
        .metadata()
        .get("x-wavefront-request-id")
        .expect("the request's id")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let mut stream = resp.into_inner();
    let mut tokens = Vec::new();
    // Its first tokens; it keeps running while the export is asked for.
    while tokens.is_empty() {
        if let Some(pb::generate_stream_response::Event::Tokens(c)) =
            stream.message().await.unwrap().unwrap().event
        {
            tokens.extend(c.token_ids);
        }
    }
    let export = |id| wpb::ExportRequestRequest {
        model: String::new(),
        request_id: id,
    };
    let missing = wa
        .export_request(export(id + 1000))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");
    let chunks: Vec<wpb::MigrationChunk> = {
        let exporting = tokio::spawn({
            let mut wa = wa.clone();
            async move {
                let mut s = wa.export_request(export(id)).await?.into_inner();
                let mut v = Vec::new();
                while let Some(c) = s.message().await? {
                    v.push(c);
                }
                Ok::<_, tonic::Status>(v)
            }
        });
        // The export waits for the stream to deliver everything before the stop.
        loop {
            tokio::select! {
                done = async { while !exporting.is_finished() { tokio::time::sleep(Duration::from_millis(5)).await } } => {
                    let _: () = done;
                    break;
                }
                m = stream.message() => {
                    if let Some(pb::generate_stream_response::Event::Tokens(c)) = m.unwrap().unwrap().event {
                        tokens.extend(c.token_ids);
                    }
                }
            }
        }
        exporting.await.unwrap().expect("exported")
    };
    let header = match &chunks[0].part {
        Some(wpb::migration_chunk::Part::Header(h)) => h.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(header.migrations, 1);
    let again = wa.export_request(export(id)).await.map(|_| ()).unwrap_err();
    assert_eq!(again.code(), Code::FailedPrecondition, "{again:?}");

    let with_header = |f: &dyn Fn(&mut wpb::MigrationHeader)| {
        let mut c = chunks.clone();
        let mut h = header.clone();
        f(&mut h);
        c[0].part = Some(wpb::migration_chunk::Part::Header(h));
        c
    };
    let state_at = chunks
        .iter()
        .position(|c| matches!(c.part, Some(wpb::migration_chunk::Part::State(_))))
        .expect("state bytes");
    let flipped = {
        let mut c = chunks.clone();
        if let Some(wpb::migration_chunk::Part::State(b)) = &mut c[state_at].part {
            b[0] ^= 1;
        }
        c
    };
    let garbage = {
        let bytes = vec![0xffu8; 64];
        let mut h = header.clone();
        h.state_bytes = 64;
        h.state_sha256 = {
            use sha2::Digest;
            sha2::Sha256::digest(&bytes).to_vec()
        };
        vec![
            wpb::MigrationChunk {
                part: Some(wpb::migration_chunk::Part::Header(h)),
            },
            wpb::MigrationChunk {
                part: Some(wpb::migration_chunk::Part::State(bytes)),
            },
        ]
    };
    let refusals: Vec<(&str, SocketAddr, Vec<wpb::MigrationChunk>, Code)> = vec![
        (
            "another version",
            b.addr,
            with_header(&|h| h.version += 1),
            Code::FailedPrecondition,
        ),
        (
            "another checkpoint",
            b.addr,
            with_header(&|h| h.migration_key.push('x')),
            Code::FailedPrecondition,
        ),
        (
            "a model not served there",
            b.addr,
            with_header(&|h| h.model = "nope".into()),
            Code::FailedPrecondition,
        ),
        (
            "another family's worker",
            other.addr,
            chunks.clone(),
            Code::FailedPrecondition,
        ),
        (
            "bytes that do not match their digest",
            b.addr,
            flipped,
            Code::InvalidArgument,
        ),
        (
            "a truncated state",
            b.addr,
            chunks[..chunks.len() - 1].to_vec(),
            Code::InvalidArgument,
        ),
        (
            "no header",
            b.addr,
            chunks[1..].to_vec(),
            Code::InvalidArgument,
        ),
        (
            "bytes that are no program",
            b.addr,
            garbage,
            Code::InvalidArgument,
        ),
    ];
    for (what, at, c, code) in refusals {
        let mut w = WorkerClient::new(channel(at).await);
        let err = w
            .resume_request(futures::stream::iter(c))
            .await
            .map(|_| ())
            .expect_err(what);
        assert_eq!(err.code(), code, "{what}: {err:?}");
        assert!(!err.message().is_empty(), "{what}: a message says why");
    }
    // Without the worker token, nothing of this API answers.
    let mut wl = WorkerClient::new(channel(locked.addr).await);
    let denied = wl
        .resume_request(futures::stream::iter(chunks.clone()))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(denied.code(), Code::Unauthenticated, "{denied:?}");
    let denied = wl.export_request(export(1)).await.map(|_| ()).unwrap_err();
    assert_eq!(denied.code(), Code::Unauthenticated, "{denied:?}");

    // Nobody took it: the export is called off and the request continues on A, losing nothing.
    wa.finish_export(wpb::FinishExportRequest {
        model: String::new(),
        request_id: id,
        moved: false,
    })
    .await
    .expect("called off");
    let done = drain(stream, tokens).await;
    assert_eq!(done.tokens, alone.tokens);
    assert_eq!(done.done.token_ids, alone.done.token_ids);
    assert_eq!(
        done.done.stats.expect("stats").migrations,
        0,
        "it never moved"
    );
    let settled = wa
        .finish_export(wpb::FinishExportRequest {
            model: String::new(),
            request_id: id,
            moved: true,
        })
        .await
        .unwrap_err();
    assert_eq!(settled.code(), Code::NotFound, "{settled:?}");
}

/// With `--rebalance`, a worker that has requests waiting hands a running one to a worker that
/// joins idle; every request keeps the tokens of an uninterrupted run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_rebalance_a_queued_workers_request_moves_to_a_worker_that_joins_idle() {
    let (fixture, base) = cases().remove(0);
    let reqs: Vec<pb::GenerateRequest> = (0..3u64)
        .map(|i| {
            let mut r = base.clone();
            r.max_new_tokens = 160;
            r.sampling.as_mut().expect("sampled").seed = Some(10 + i);
            r
        })
        .collect();
    let a = spawn_worker(fixture, &["--max-active", "1"]);
    wait_serving(a.addr, "wavefront.worker.v1.Worker").await;
    // B's address is known to the router from the start; B starts once A has a queue.
    let (router, b_addr) = router_before_b(a.addr, &["--rebalance"]).await;
    let runs = stream_all(router.addr, &reqs).await;
    wait_load(a.addr, "queued on A", |l| {
        l.active_requests + l.queued_requests == 3 && l.queued_requests > 0
    })
    .await;
    let b = spawn_worker_at(fixture, b_addr);
    let mut moved = 0;
    let mut got = Vec::new();
    for r in runs {
        let run = r.await.unwrap();
        moved += run.done.stats.as_ref().expect("stats").migrations;
        got.push(run);
    }
    assert!(moved >= 1, "no request moved to the idle worker");
    for (r, run) in reqs.iter().zip(&got) {
        let alone = uninterrupted(b.addr, r.clone()).await;
        assert_eq!(run.tokens, alone.tokens);
        assert_eq!(run.done.token_ids, alone.done.token_ids);
    }
    eprintln!("{moved} of 3 requests moved to the worker that joined");
    drop(router);
}

/// A request still queued on a draining worker has no state to export: it starts over on the
/// other worker (nothing reached its caller yet), while the running one moves with its state.
/// Both finish there with the tokens of an uninterrupted run, each counting one move, and the
/// draining worker exits at once instead of running its queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_on_a_draining_worker_starts_over_on_the_other() {
    let (fixture, base) = cases().remove(0);
    let reqs: Vec<pb::GenerateRequest> = (0..2u64)
        .map(|i| {
            let mut r = base.clone();
            r.sampling.as_mut().expect("sampled").seed = Some(20 + i);
            r
        })
        .collect();
    let a = spawn_worker(fixture, &["--max-active", "1", "--drain-timeout-s", "120"]);
    wait_serving(a.addr, "wavefront.worker.v1.Worker").await;
    // B is known to the router but starts only once both requests are on A.
    let (router, b_addr) = router_before_b(a.addr, &[]).await;
    let runs = stream_all(router.addr, &reqs).await;
    wait_load(a.addr, "one running and one queued on A", |l| {
        l.active_requests == 1 && l.queued_requests == 1
    })
    .await;
    let b = spawn_worker_at(fixture, b_addr);
    wait_serving(b.addr, "wavefront.worker.v1.Worker").await;
    // Once the router has seen B, A drains.
    tokio::time::sleep(Duration::from_millis(REFRESH_MS * 3)).await;
    let stopped = Instant::now();
    let exit = std::thread::spawn(move || (a.terminate(), Instant::now()));
    let mut got = Vec::new();
    for r in runs {
        got.push(r.await.unwrap());
    }
    let (status, exited) = exit.join().unwrap();
    assert!(status.success(), "A exits cleanly: {status:?}");
    let last_done = got.iter().map(|r| r.ended).max().expect("two runs");
    assert!(
        exited < last_done,
        "A exited {:?} after SIGTERM, before its requests ended ({:?}): it did not run its queue",
        exited - stopped,
        last_done - stopped
    );
    for (r, run) in reqs.iter().zip(&got) {
        let alone = uninterrupted(b.addr, r.clone()).await;
        assert_eq!(run.tokens, alone.tokens);
        assert_eq!(run.done.token_ids, alone.done.token_ids);
        assert_eq!(
            run.done.stats.as_ref().expect("stats").migrations,
            1,
            "each request moved once (exported or started over)"
        );
    }
    drop(router);
}
