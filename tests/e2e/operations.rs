//! Operations with real processes: graceful drain on SIGTERM, and a worker
//! that dies is routed around and re-added when it comes back.

use std::time::{Duration, Instant};

use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{channel, fixture, spawn, spawn_router, spawn_worker, wait_serving, Proc};

fn long_request(max_new_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text("You may copy".into())),
        max_new_tokens,
        scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
            num_steps: Some(32),
            ..Default::default()
        })),
        ..Default::default()
    }
}

async fn health(addr: std::net::SocketAddr, service: &str) -> i32 {
    let mut h = HealthClient::new(channel(addr).await);
    h.check(HealthCheckRequest {
        service: service.into(),
    })
    .await
    .map(|r| r.into_inner().status)
    .unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_and_refuses_new_ones() {
    let worker = spawn_worker("huginn", &["--drain-timeout-s", "60"]);
    wait_serving(worker.addr, "wavefront.v1.Generation").await;
    let addr = worker.addr;
    let mut client = GenerationClient::new(channel(addr).await);
    let mut stream = client
        .generate_stream(long_request(60))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().expect("first chunk");
    let mut tokens = match first.event {
        Some(pb::generate_stream_response::Event::Tokens(c)) => c.token_ids.len(),
        other => panic!("{other:?}"),
    };
    let waiter = std::thread::spawn(move || worker.terminate());
    // Readiness goes NOT_SERVING while liveness stays SERVING.
    let start = Instant::now();
    while health(addr, "wavefront.v1.Generation").await != ServingStatus::NotServing as i32 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "readiness never dropped"
        );
        tokio::task::yield_now().await;
    }
    assert_eq!(
        health(addr, "").await,
        ServingStatus::Serving as i32,
        "liveness stays up while draining"
    );
    // New work is refused with UNAVAILABLE.
    let err = GenerationClient::new(channel(addr).await)
        .generate(long_request(2))
        .await
        .expect_err("draining");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    // The in-flight request runs to completion.
    let mut done = None;
    while let Some(m) = stream.message().await.expect("stream survives the drain") {
        match m.event {
            Some(pb::generate_stream_response::Event::Tokens(c)) => tokens += c.token_ids.len(),
            Some(pb::generate_stream_response::Event::Done(d)) => done = Some(d),
            Some(
                pb::generate_stream_response::Event::Canvas(_)
                | pb::generate_stream_response::Event::Prompt(_),
            )
            | None => {}
        }
    }
    let done = done.expect("final message");
    assert_eq!(done.finish_reason, pb::FinishReason::Length as i32);
    assert_eq!(tokens, 60);
    let status = waiter.join().unwrap();
    assert!(
        status.success(),
        "worker exits cleanly after draining: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_is_routed_around_and_readded_when_it_returns() {
    let model = fixture("huginn");
    let m = model.to_str().unwrap();
    let a = spawn_worker("huginn", &[]);
    let b = spawn_worker("huginn", &[]);
    wait_serving(a.addr, "wavefront.worker.v1.Worker").await;
    wait_serving(b.addr, "wavefront.worker.v1.Worker").await;
    let (a_addr, b_addr) = (a.addr, b.addr);
    let targets = format!("{a_addr},{b_addr}");
    let router = spawn(&[
        "router",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        &targets,
        "--refresh-ms",
        "200",
    ]);
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(router.addr).await);
    client.generate(long_request(2)).await.expect("both up");

    drop(a); // SIGKILL: no drain.
             // Within a few seconds every request succeeds on the survivor.
    let start = Instant::now();
    let mut ok_in_a_row = 0;
    while ok_in_a_row < 5 {
        match client.generate(long_request(2)).await {
            Ok(_) => ok_in_a_row += 1,
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                ok_in_a_row = 0;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "dead worker not dropped within 5s"
        );
    }

    // Kill the survivor too and bring a worker back on the first address.
    drop(b);
    let back = spawn(&["worker", "--listen", &a_addr.to_string(), "--model", m]);
    wait_serving(back.addr, "wavefront.worker.v1.Worker").await;
    let start = Instant::now();
    loop {
        match client.generate(long_request(2)).await {
            Ok(r) => {
                assert_eq!(r.into_inner().token_ids.len(), 2);
                break;
            }
            Err(e) => assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}"),
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "returning worker not re-added within 5s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A worker behind a router whose refresh is far beyond any test (only its start-up poll runs),
/// once a call has gone through: a worker marked down would stay down.
async fn router_that_never_polls_again() -> (Proc, Proc, tonic::transport::Channel) {
    let worker = spawn_worker("huginn", &[]);
    wait_serving(worker.addr, "wavefront.worker.v1.Worker").await;
    let router = spawn_router("127.0.0.1:0", &worker.addr.to_string(), 600_000, &[]);
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    let chan = channel(router.addr).await;
    let start = Instant::now();
    // The first poll runs at start-up; wait for it to see the worker.
    while GenerationClient::new(chan.clone())
        .generate(long_request(1))
        .await
        .is_err()
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "worker never seen"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (worker, router, chan)
}

/// Short deadlines that fire at the worker (its transport answers CANCELLED "Timeout expired")
/// end those calls with DEADLINE_EXCEEDED and leave the worker in rotation: with a refresh far
/// beyond the test, a worker marked down would refuse every later call with UNAVAILABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_deadlines_do_not_take_a_healthy_worker_out_of_rotation() {
    let (_worker, _router, chan) = router_that_never_polls_again().await;
    let calls = (0..24u64).map(|i| {
        let mut client = GenerationClient::new(chan.clone());
        async move {
            let mut req = tonic::Request::new(long_request(40));
            req.set_timeout(Duration::from_millis(5 + 5 * (i % 6)));
            client.generate(req).await
        }
    });
    for r in futures::future::join_all(calls).await {
        let e = r.expect_err("no request can finish 40 tokens in 30 ms");
        assert!(
            matches!(
                e.code(),
                tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
            ),
            "{e:?}"
        );
        assert!(!e.message().contains("no worker"), "{e:?}");
    }
    // No poll has run since: the worker must still be in rotation.
    let r = GenerationClient::new(chan)
        .generate(long_request(2))
        .await
        .expect("the worker is still routed to");
    assert_eq!(r.into_inner().token_ids.len(), 2);
}

/// Hostile sizes: a 3 MB text prompt is refused from its size alone (INVALID_ARGUMENT, no
/// tokenizing on the request path), a 5 MB message with RESOURCE_EXHAUSTED naming the limit
/// (not the transport's OUT_OF_RANGE), and neither takes the worker out of rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_prompts_and_messages_get_documented_codes_and_keep_the_worker_in_rotation() {
    let (_worker, _router, chan) = router_that_never_polls_again().await;
    let text = |bytes: usize| pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(
            "lorem ipsum ".repeat(bytes / 12),
        )),
        max_new_tokens: 2,
        ..Default::default()
    };
    let mut client = GenerationClient::new(chan.clone()).max_encoding_message_size(64 << 20);
    let t = Instant::now();
    let err = client
        .generate(text(3 << 20))
        .await
        .expect_err("3 MB prompt");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("this model accepts"), "{err:?}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "refused in {:?}",
        t.elapsed()
    );
    let err = client
        .generate(text(5 << 20))
        .await
        .expect_err("5 MB message");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("--max-message-bytes"), "{err:?}");
    // No poll has run since: the worker must still be routed to.
    let r = GenerationClient::new(chan)
        .generate(long_request(2))
        .await
        .expect("the worker is still routed to");
    assert_eq!(r.into_inner().token_ids.len(), 2);
}
