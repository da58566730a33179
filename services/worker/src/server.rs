//! Binding and running the worker's gRPC server.
//!
//! Health (`grpc.health.v1`) and reflection run beside the two APIs.
//! Liveness is the overall service `""`: SERVING for as long as the process
//! runs. Readiness is `wavefront.v1.Generation` (and
//! `wavefront.worker.v1.Worker`): NOT_SERVING while draining. On shutdown
//! the worker drains: readiness and load reports say not ready, new requests
//! get UNAVAILABLE, in-flight requests get up to `drain_timeout` to finish,
//! then the server stops.

use std::future::Future;
use std::time::{Duration, Instant};

use tonic::service::interceptor::InterceptedService;
use tonic_health::ServingStatus;
use wavefront_net::Listener;
use wavefront_proto::auth::RequireSecret;
use wavefront_proto::v1::generation_server::GenerationServer;
use wavefront_proto::worker::v1::worker_server::WorkerServer;

use crate::service::WorkerService;

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// How long in-flight requests may run after shutdown begins.
    pub drain_timeout: Duration,
    /// Largest request message decoded; a larger one is refused with RESOURCE_EXHAUSTED.
    pub max_message_bytes: usize,
    /// When set, every call but health needs one of these (`authorization: Bearer <token>`):
    /// the router's credential (`--worker-token`).
    pub token: wavefront_proto::auth::Secrets,
    /// Serve over TLS (with a client CA: only clients holding a certificate it signed, mTLS).
    pub tls: Option<tonic::transport::ServerTlsConfig>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            drain_timeout: Duration::from_secs(30),
            max_message_bytes: wavefront_proto::limits::DEFAULT_MAX_MESSAGE_BYTES,
            token: Default::default(),
            tls: None,
        }
    }
}

/// Liveness: the process answers.
pub const LIVENESS: &str = "";
/// Readiness: new requests are taken.
pub const READINESS: [&str; 2] = ["wavefront.v1.Generation", "wavefront.worker.v1.Worker"];

/// Serves `service` on `listener` until `shutdown` resolves and draining ends.
pub async fn serve(
    service: WorkerService,
    listener: Listener,
    config: WorkerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(LIVENESS, ServingStatus::Serving)
        .await;
    for name in READINESS {
        reporter
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(wavefront_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1alpha = reflection().build_v1alpha()?;
    let reflection = reflection().build_v1()?;
    let drain = {
        let service = service.clone();
        async move {
            shutdown.await;
            tracing::info!("shutdown requested: draining");
            service.set_ready(false);
            for name in READINESS {
                reporter
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
            let start = Instant::now();
            while service.in_flight() > 0 && start.elapsed() < config.drain_timeout {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if service.in_flight() > 0 {
                tracing::warn!(
                    in_flight = service.in_flight(),
                    "drain timeout: stopping with requests in flight"
                );
            }
            for m in service.models() {
                m.shutdown();
            }
        }
    };
    let limit = config.max_message_bytes;
    let require = RequireSecret::new(config.token.clone(), "the worker token");
    let mut builder = listener.limits().grpc_server();
    if let Some(tls) = config.tls.clone() {
        builder = builder.tls_config(tls)?;
    }
    builder
        .layer(tower::util::MapResponseLayer::new(
            wavefront_proto::limits::oversize_as_resource_exhausted,
        ))
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(InterceptedService::new(
            GenerationServer::new(service.clone()).max_decoding_message_size(limit),
            require.clone(),
        ))
        .add_service(InterceptedService::new(
            WorkerServer::new(service).max_decoding_message_size(limit),
            require,
        ))
        .serve_with_incoming_shutdown(listener.incoming(), drain)
        .await?;
    Ok(())
}
