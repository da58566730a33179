//! Faults on real processes: a worker killed mid-stream, a worker that hangs (SIGSTOP), the
//! router restarted under running workers, and clients that leave while their request is
//! queued, in prefill and in decode. Each ends with the worker's pool whole (no slot held, no
//! request active or queued) and the timings a bound in docs/reliability.md states.

use std::process::Command;
use std::time::{Duration, Instant};

use tonic::Code;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{
    channel, load, spawn, spawn_router, spawn_worker, wait_load, wait_serving, wait_whole, Proc,
};

/// Router refresh in these tests; the load poll's timeout is the same (its floor is 200 ms).
const REFRESH_MS: u64 = 200;

fn huginn(max_new_tokens: u32, num_steps: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text("You may copy".into())),
        max_new_tokens,
        scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
            num_steps: Some(num_steps),
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn with_timeout<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

fn signal(p: &Proc, sig: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(p.child.id().to_string())
        .status()
        .expect("kill");
    assert!(ok.success(), "kill -{sig}");
}

fn router(workers: &str) -> Proc {
    router_on("127.0.0.1:0", workers)
}

fn router_on(listen: &str, workers: &str) -> Proc {
    spawn_router(listen, workers, REFRESH_MS, &[])
}

/// Opens `n` long Huginn streams and reads each one's first tokens.
async fn open_streams(
    client: &mut GenerationClient<tonic::transport::Channel>,
    n: usize,
) -> Vec<tonic::Streaming<pb::GenerateStreamResponse>> {
    let mut streams = Vec::new();
    for _ in 0..n {
        let mut s = client
            .generate_stream(huginn(200, 32))
            .await
            .expect("admitted")
            .into_inner();
        first_tokens(&mut s).await;
        streams.push(s);
    }
    streams
}

/// The first message of a stream, which must be tokens.
async fn first_tokens(stream: &mut tonic::Streaming<pb::GenerateStreamResponse>) {
    let first = stream
        .message()
        .await
        .expect("first message")
        .expect("a first chunk");
    assert!(
        matches!(
            first.event,
            Some(pb::generate_stream_response::Event::Tokens(_))
        ),
        "{first:?}"
    );
}

/// Reads a stream to its end: the status it ended with, if any.
async fn drain(mut stream: tonic::Streaming<pb::GenerateStreamResponse>) -> Option<tonic::Status> {
    loop {
        match stream.message().await {
            Ok(Some(_)) => {}
            Ok(None) => return None,
            Err(s) => return Some(s),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_stream_ends_its_streams_unavailable_and_is_readded_when_back() {
    let worker = spawn_worker("huginn", &[]);
    wait_serving(worker.addr, "wavefront.worker.v1.Worker").await;
    let addr = worker.addr;
    let router = router(&addr.to_string());
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(router.addr).await);
    let streams = open_streams(&mut client, 3).await;
    drop(worker); // SIGKILL
    let killed = Instant::now();
    for s in streams {
        let status = drain(s)
            .await
            .expect("a killed worker's stream ends with a status");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(
            status.message().contains("lost the connection to worker"),
            "{status:?}"
        );
    }
    let ended_in = killed.elapsed();
    assert!(
        ended_in < Duration::from_secs(2),
        "streams ended after {ended_in:?}"
    );
    // Out of rotation: new calls are UNAVAILABLE at once, never sent to the dead address.
    let err = client.generate(huginn(2, 4)).await.expect_err("no worker");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    // Back on the same address: re-added by the next polls.
    let back = spawn(&[
        "worker",
        "--listen",
        &addr.to_string(),
        "--model",
        crate::harness::fixture("huginn").to_str().unwrap(),
    ]);
    wait_serving(back.addr, "wavefront.worker.v1.Worker").await;
    let start = Instant::now();
    loop {
        match client.generate(huginn(2, 4)).await {
            Ok(r) => {
                assert_eq!(r.into_inner().token_ids.len(), 2);
                break;
            }
            Err(e) => assert_eq!(e.code(), Code::Unavailable, "{e:?}"),
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "not re-added within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "killed mid-stream: 3 streams ended UNAVAILABLE {ended_in:?} after SIGKILL; re-added {:?} after the worker was back",
        start.elapsed()
    );
    wait_whole(back.addr, Duration::from_secs(10)).await;
}

/// A stopped worker accepts connections but never answers: the router's load poll times out
/// and routes around it within one refresh plus one poll timeout; calls already there end at
/// their deadline; once it runs again it frees what those calls held and is routed to again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_worker_is_routed_around_within_a_refresh_and_a_poll_timeout() {
    let a = spawn_worker("huginn", &[]);
    let b = spawn_worker("huginn", &[]);
    wait_serving(a.addr, "wavefront.worker.v1.Worker").await;
    wait_serving(b.addr, "wavefront.worker.v1.Worker").await;
    let mport = crate::metrics::free_port();
    let router = spawn_router(
        "127.0.0.1:0",
        &format!("{},{}", a.addr, b.addr),
        REFRESH_MS,
        &["--metrics-listen", &format!("127.0.0.1:{mport}")],
    );
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    let down = || {
        crate::metrics::sample(
            &crate::metrics::scrape(mport),
            "wavefront_router_workers{state=\"down\"}",
        )
    };
    assert_eq!(down(), Some(0.0));
    // A call in flight on A when it stops.
    let mut direct = GenerationClient::new(channel(a.addr).await);
    let on_a_deadline = Instant::now() + Duration::from_secs(2);
    let mut on_a = direct
        .generate_stream(with_timeout(huginn(200, 32), Duration::from_secs(2)))
        .await
        .expect("admitted")
        .into_inner();
    first_tokens(&mut on_a).await;
    signal(&a, "STOP");
    let stopped = Instant::now();
    // The router's poll of A times out: A is marked down.
    while down() != Some(1.0) {
        assert!(
            stopped.elapsed() < Duration::from_secs(10),
            "A never marked down"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let detected = stopped.elapsed();
    // Calls through the router succeed once A is out of rotation; until then some may wait
    // for their (short) deadline on A.
    let mut client = GenerationClient::new(channel(router.addr).await);
    let mut ok_in_a_row = 0;
    let mut routed_around = None;
    let stopped = Instant::now();
    while ok_in_a_row < 10 {
        match client
            .generate(with_timeout(huginn(2, 4), Duration::from_millis(300)))
            .await
        {
            Ok(_) => {
                ok_in_a_row += 1;
                if ok_in_a_row == 1 {
                    routed_around = Some(stopped.elapsed());
                }
            }
            Err(e) => {
                assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
                ok_in_a_row = 0;
            }
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(10),
            "never routed around A"
        );
    }
    let routed_around = routed_around.unwrap();
    // Bound: one refresh interval plus one poll timeout (200 ms each here), with 300 ms of slack
    // for a loaded machine.
    let bound = Duration::from_millis(2 * REFRESH_MS + 300);
    assert!(
        detected < bound,
        "A marked down after {detected:?} (bound {bound:?})"
    );
    // Stopped past that call's deadline; running again, A's timer ends it.
    tokio::time::sleep_until((on_a_deadline + Duration::from_millis(100)).into()).await;
    signal(&a, "CONT");
    let mut last = None;
    let status = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match on_a.message().await {
                Ok(Some(m)) => last = Some(m),
                Ok(None) => return None,
                Err(s) => return Some(s),
            }
        }
    })
    .await
    .expect("the call on A ends once A runs")
    .unwrap_or_else(|| panic!("ended without a status after {last:?}"));
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    wait_whole(a.addr, Duration::from_secs(10)).await;
    wait_whole(b.addr, Duration::from_secs(10)).await;
    eprintln!(
        "hung worker: marked down {detected:?} after SIGSTOP (bound {bound:?}); 10 calls in a row served {routed_around:?} after it"
    );
}

/// The router holds no state: killed with calls in flight and started again on its address,
/// it serves again from its first poll, and the worker frees what the cut calls held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_restarted_under_running_workers_serves_again_and_leaks_nothing() {
    let worker = spawn_worker("huginn", &[]);
    wait_serving(worker.addr, "wavefront.worker.v1.Worker").await;
    let workers = worker.addr.to_string();
    let first = router(&workers);
    wait_serving(first.addr, "wavefront.v1.Generation").await;
    let addr = first.addr;
    let mut client = GenerationClient::new(channel(addr).await);
    let streams = open_streams(&mut client, 2).await;
    drop(first); // SIGKILL
    for s in streams {
        let status = drain(s).await.expect("the cut call ends with a status");
        assert!(
            matches!(
                status.code(),
                Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled
            ),
            "{status:?}"
        );
    }
    let freed = wait_whole(worker.addr, Duration::from_secs(10)).await;
    let restarted = Instant::now();
    let second = router_on(&addr.to_string(), &workers);
    wait_serving(second.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(addr).await);
    let r = client
        .generate(huginn(4, 8))
        .await
        .expect("served after the restart");
    assert_eq!(r.into_inner().token_ids.len(), 4);
    eprintln!(
        "router restart: worker freed the cut calls' slots in {freed:?}; serving again {:?} after the new router started",
        restarted.elapsed()
    );
    wait_whole(worker.addr, Duration::from_secs(10)).await;
}

/// A client that leaves while its request waits in the queue, while its long prompt is in
/// prefill, and while it decodes: each time the worker gives everything back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_queued_in_prefill_or_in_decode_frees_everything() {
    // One request at a time, so a second one waits in the queue.
    let worker = spawn_worker("armt", &["--max-active", "1"]);
    wait_serving(worker.addr, "wavefront.worker.v1.Worker").await;
    let addr = worker.addr;
    let mut client = GenerationClient::new(channel(addr).await);
    // 16,000 prompt tokens: 2,000 segments of prefill.
    let long = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
            ids: (0..16_000).map(|i| 5 + (i % 50)).collect(),
        })),
        max_new_tokens: 4,
        ..Default::default()
    };
    let short = |n| pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
            ids: vec![5, 6, 7],
        })),
        max_new_tokens: n,
        ..Default::default()
    };

    // In prefill: active, nothing streamed yet.
    let in_prefill = client
        .generate_stream(long.clone())
        .await
        .unwrap()
        .into_inner();
    wait_load(addr, "active", |m| m.active_requests == 1).await;
    // Queued behind it.
    let queued = client.generate_stream(short(4)).await.unwrap().into_inner();
    wait_load(addr, "queued", |m| m.queued_requests == 1).await;
    drop(queued);
    wait_load(addr, "dequeued", |m| m.queued_requests == 0).await;
    drop(in_prefill);
    let prefill_freed = wait_whole(addr, Duration::from_secs(10)).await;

    // In decode: tokens already streamed.
    // 250 tokens, more than the worker buffers for a client that does not read (64 events):
    // the request is still decoding when its client leaves.
    let mut decoding = client
        .generate_stream(short(250))
        .await
        .unwrap()
        .into_inner();
    first_tokens(&mut decoding).await;
    assert_eq!(load(addr).await.active_requests, 1, "still decoding");
    drop(decoding);
    let decode_freed = wait_whole(addr, Duration::from_secs(10)).await;
    eprintln!("client left: prefill freed in {prefill_freed:?}, decode freed in {decode_freed:?}");
    // Still serving.
    let r = client.generate(short(2)).await.expect("served after");
    assert_eq!(r.into_inner().token_ids.len(), 2);
}

/// Limits on what one request may ask for: each refusal is INVALID_ARGUMENT naming the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_limits_refuse_with_the_flag_that_sets_them() {
    let worker = spawn_worker(
        "huginn",
        &[
            "--max-prompt-tokens",
            "16",
            "--max-new-tokens-limit",
            "64",
            "--max-stop-sequences",
            "2",
            "--max-stop-string-bytes",
            "8",
        ],
    );
    wait_serving(worker.addr, "wavefront.worker.v1.Worker").await;
    let mut client = GenerationClient::new(channel(worker.addr).await);
    let cases: Vec<(pb::GenerateRequest, &str)> = vec![
        (huginn(65, 4), "--max-new-tokens-limit"),
        (
            pb::GenerateRequest {
                stop_strings: vec!["a".into(), "b".into(), "c".into()],
                ..huginn(4, 4)
            },
            "--max-stop-sequences",
        ),
        (
            pb::GenerateRequest {
                stop_token_ids: vec![1, 2, 3],
                ..huginn(4, 4)
            },
            "--max-stop-sequences",
        ),
        (
            pb::GenerateRequest {
                stop_strings: vec!["123456789".into()],
                ..huginn(4, 4)
            },
            "--max-stop-string-bytes",
        ),
        (
            pb::GenerateRequest {
                prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
                    ids: vec![5; 17],
                })),
                ..huginn(4, 4)
            },
            "--max-prompt-tokens",
        ),
        (
            pb::GenerateRequest {
                prompt: Some(pb::generate_request::Prompt::Text("word ".repeat(40))),
                ..huginn(4, 4)
            },
            "--max-prompt-tokens",
        ),
    ];
    for (req, flag) in cases {
        let err = client.generate(req).await.expect_err(flag);
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains(flag), "{flag}: {}", err.message());
    }
    // Within every limit.
    let ok = pb::GenerateRequest {
        stop_strings: vec!["zzzzzzzz".into()],
        ..huginn(64, 2)
    };
    client.generate(ok).await.expect("within the limits");
    wait_whole(worker.addr, Duration::from_secs(10)).await;
}
