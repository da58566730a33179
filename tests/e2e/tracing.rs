//! One trace per request across processes: a real OTLP/gRPC receiver on
//! loopback collects the spans that router and worker export.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio_stream::wrappers::TcpListenerStream;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{channel, spawn_with_env, spawn_worker_with_env, wait_serving};

#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<(String, Span)>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref())
                .map(|v| format!("{:?}", v.value))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push((service.clone(), span));
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_client_router_worker_and_engine_ticks() {
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(receiver.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let worker = spawn_worker_with_env("huginn", &[], &env);
    wait_serving(worker.addr, "wavefront.worker.v1.Worker").await;
    let target = worker.addr.to_string();
    let router = spawn_with_env(
        &[
            "router",
            "--listen",
            "127.0.0.1:0",
            "--workers",
            &target,
            "--refresh-ms",
            "200",
        ],
        &env,
    );
    wait_serving(router.addr, "wavefront.v1.Generation").await;

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let mut req = tonic::Request::new(wavefront_proto::v1::GenerateRequest {
        prompt: Some(wavefront_proto::v1::generate_request::Prompt::Text(
            "You may copy".into(),
        )),
        max_new_tokens: 3,
        ..Default::default()
    });
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-{client_span}-01").parse().unwrap(),
    );
    let mut client = GenerationClient::new(channel(router.addr).await);
    client.generate(req).await.expect("generate");

    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let start = Instant::now();
    let (router_span, worker_span, steps) = loop {
        {
            let spans = receiver.spans.lock().unwrap();
            let ours: Vec<&(String, Span)> = spans
                .iter()
                .filter(|(_, s)| hex(&s.trace_id) == trace_id)
                .collect();
            let find = |svc: &str, name: &str| {
                ours.iter()
                    .find(|(s, sp)| s.contains(svc) && sp.name == name)
                    .map(|(_, sp)| sp.clone())
            };
            let r = find("wavefront-router", "router.generate");
            let w = find("wavefront-worker", "worker.generate");
            // Tick spans are linked to the request span (follows_from), not parented.
            let steps: Vec<Span> = spans
                .iter()
                .filter(|(s, sp)| s.contains("wavefront-worker") && sp.name == "tick")
                .filter(|(_, sp)| sp.links.iter().any(|l| hex(&l.trace_id) == trace_id))
                .map(|(_, sp)| sp.clone())
                .collect();
            if let (Some(r), Some(w)) = (r, w) {
                if !steps.is_empty() {
                    break (r, w, steps);
                }
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "spans did not arrive: {:?}",
            receiver.spans.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        hex(&router_span.parent_span_id),
        client_span,
        "router span is a child of the client's span"
    );
    assert_eq!(
        worker_span.parent_span_id, router_span.span_id,
        "worker span is a child of the router span"
    );
    assert!(
        steps
            .iter()
            .any(|s| s.links.iter().any(|l| l.span_id == worker_span.span_id)),
        "a tick links to the request"
    );
    let attr = |s: &Span, k: &str| {
        s.attributes
            .iter()
            .find(|kv| kv.key == k)
            .map(|kv| format!("{:?}", kv.value))
    };
    assert!(attr(&worker_span, "model").is_some_and(|v| v.contains("huginn")));
    assert!(attr(&worker_span, "finish_reason").is_some_and(|v| v.contains("length")));
    assert!(attr(&worker_span, "output_tokens").is_some());
}
