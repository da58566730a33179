//! Prometheus exposition on router and worker, scraped over plain HTTP.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{channel, spawn, spawn_worker, wait_serving};

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub(crate) fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("metrics port");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    body
}

/// The value of the first sample whose line starts with `prefix`.
pub(crate) fn sample(body: &str, prefix: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_and_worker_expose_request_engine_and_slot_metrics() {
    let (wport, rport) = (free_port(), free_port());
    let wm = format!("127.0.0.1:{wport}");
    let worker = spawn_worker(
        "huginn",
        &["--served-name", "tiny", "--metrics-listen", &wm],
    );
    wait_serving(worker.addr, "").await;
    let target = worker.addr.to_string();
    let rm = format!("127.0.0.1:{rport}");
    let router = spawn(&[
        "router",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        &target,
        "--metrics-listen",
        &rm,
    ]);
    wait_serving(router.addr, "").await;

    let mut client = GenerationClient::new(channel(router.addr).await);
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text("You may copy".into())),
        max_new_tokens: 5,
        ..Default::default()
    };
    client.generate(req.clone()).await.expect("generate");
    let bad = pb::GenerateRequest {
        max_new_tokens: 0,
        ..req.clone()
    };
    assert!(client.generate(bad).await.is_err());
    // Names nobody serves are counted under `unknown`, never as series of their own.
    let stranger = pb::GenerateRequest {
        model: "no-such-model-4711".into(),
        ..req.clone()
    };
    let err = client
        .generate(stranger.clone())
        .await
        .expect_err("unknown");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    let err = GenerationClient::new(channel(worker.addr).await)
        .generate(stranger)
        .await
        .expect_err("unknown");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    // A deadline that expires mid-generation, straight to the worker: its timer cuts the stream,
    // and the worker counts DEADLINE_EXCEEDED, not a cancellation.
    let mut direct = GenerationClient::new(channel(worker.addr).await);
    let mut slow = tonic::Request::new(pb::GenerateRequest {
        max_new_tokens: 240,
        scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
            num_steps: Some(32),
            ..Default::default()
        })),
        ..req.clone()
    });
    slow.metadata_mut()
        .insert("grpc-timeout", "200m".parse().unwrap());
    let err = direct.generate(slow).await.expect_err("deadline");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");

    let start = Instant::now();
    let body = loop {
        let body = scrape(wport);
        // The engine publishes its slot gauges after the tick that finished the request, which
        // can be just after the worker counted the response.
        if body.contains("wavefront_requests_total{model=\"tiny\",scheme=\"ar\",status=\"OK\"}")
            && body.contains("wavefront_slots_used{model=\"tiny\"} 0")
            && body.contains("status=\"DEADLINE_EXCEEDED\"")
        {
            break body;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        sample(
            &body,
            "wavefront_requests_total{model=\"tiny\",scheme=\"ar\",status=\"OK\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &body,
            "wavefront_requests_total{model=\"tiny\",scheme=\"ar\",status=\"INVALID_ARGUMENT\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &body,
            "wavefront_requests_total{model=\"unknown\",scheme=\"unspecified\",status=\"NOT_FOUND\"}"
        ),
        Some(1.0),
        "{body}"
    );
    assert!(!body.contains("no-such-model-4711"), "{body}");
    assert_eq!(
        sample(
            &body,
            "wavefront_requests_total{model=\"tiny\",scheme=\"ar\",status=\"DEADLINE_EXCEEDED\"}"
        ),
        Some(1.0)
    );
    assert!(!body.contains("status=\"CANCELLED\""), "{body}");
    // The 5 tokens of the finished request and what the cut one had made.
    assert!(
        sample(
            &body,
            "wavefront_generated_tokens_total{model=\"tiny\",scheme=\"ar\"}"
        )
        .is_some_and(|n| n >= 5.0),
        "{body}"
    );
    assert_eq!(
        sample(
            &body,
            "wavefront_forward_passes_total{model=\"tiny\",scheme=\"ar\"}"
        ),
        Some(5.0)
    );
    for family in [
        "wavefront_request_duration_seconds_bucket",
        "wavefront_time_to_first_token_seconds_bucket",
        "wavefront_inter_token_latency_seconds_bucket{model=\"tiny\"",
        "wavefront_cache_usage_ratio{model=\"tiny\"} 0",
        "wavefront_engine_tick_duration_seconds_bucket{model=\"tiny\"",
        "wavefront_engine_tick_requests_bucket{model=\"tiny\"",
        "wavefront_slots_total{model=\"tiny\"}",
        "wavefront_slots_used{model=\"tiny\"} 0",
        "wavefront_preempted_requests{model=\"tiny\"} 0",
        "wavefront_engine_preemptions_total{model=\"tiny\"} 0",
        "# HELP wavefront_engine_preempt_bytes_to_host_total",
        "wavefront_queue_depth{model=\"tiny\"} 0",
        "# HELP wavefront_requests_total",
    ] {
        assert!(body.contains(family), "missing {family}:\n{body}");
    }
    assert!(sample(&body, "wavefront_engine_ticks_total{model=\"tiny\"}").unwrap() >= 5.0);
    // The requests' K/V pages made the pool's first arena.
    assert!(
        sample(&body, "wavefront_pool_allocated_bytes{model=\"tiny\"}").is_some_and(|b| b > 0.0),
        "{body}"
    );
    // Every worker series names its model: none for a scheduler not yet named.
    assert!(
        !body.contains("model=\"\""),
        "a series with an empty model label:\n{body}"
    );

    let body = scrape(rport);
    assert!(
        body.contains("wavefront_router_requests_total{model=\"\",status=\"OK\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("wavefront_router_requests_total{model=\"\",status=\"INVALID_ARGUMENT\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("wavefront_router_requests_total{model=\"unknown\",status=\"NOT_FOUND\"} 1"),
        "{body}"
    );
    assert!(!body.contains("no-such-model-4711"), "{body}");
    assert!(
        body.contains("wavefront_router_workers{state=\"up\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("wavefront_router_request_duration_seconds_bucket"),
        "{body}"
    );
}
