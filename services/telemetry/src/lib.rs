//! # wavefront-telemetry
//!
//! Logs and traces for the router and worker:
//! - structured log lines (`text` or `json`) filtered by a `RUST_LOG`-style
//!   directive;
//! - OpenTelemetry spans exported over OTLP/gRPC when an endpoint is given;
//! - W3C trace context (`traceparent`, `tracestate`) carried in gRPC
//!   metadata, so one trace spans client -> router -> worker -> engine ticks.
//!
//! Configuration arrives as a plain struct from `main`; nothing here reads
//! the environment.

pub mod metrics;
pub mod propagation;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

pub use propagation::{extract_parent, inject_current, MetadataExtractor, MetadataInjector};

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid log filter {0:?}: {1}")]
    Filter(String, String),
    #[error("cannot build the OTLP exporter for {0}: {1}")]
    Exporter(String, String),
    #[error("a global subscriber is already installed: {0}")]
    AlreadyInstalled(String),
    #[error("log format must be `text` or `json`, got {0:?}")]
    LogFormat(String),
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: metrics_exporter_prometheus::BuildError,
    },
    #[error("cannot listen for metrics scrapes on {addr}: {source}")]
    MetricsListen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = TelemetryError;
    fn from_str(s: &str) -> Result<Self, TelemetryError> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(TelemetryError::LogFormat(other.to_owned())),
        }
    }
}

/// Telemetry settings of one process.
#[derive(Debug, Clone)]
pub struct TelemetryConfig {
    /// `service.name` of exported spans ("wavefront-router", "wavefront-worker").
    pub service_name: String,
    /// Log filter directive, e.g. "info" or "wavefront_engine=debug,info".
    pub log_filter: String,
    pub log_format: LogFormat,
    /// OTLP/gRPC endpoint (e.g. "http://jaeger:4317"); `None` disables export.
    pub otlp_endpoint: Option<String>,
    /// Fraction of new traces sampled (parent-based: a sampled parent wins).
    pub sampling_ratio: f64,
}

/// Flushes and shuts the exporter down when dropped.
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Exports what is buffered now (tests and graceful shutdown).
    pub fn flush(&self) {
        if let Some(p) = &self.provider {
            let _ = p.force_flush();
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.force_flush();
            let _ = p.shutdown();
        }
    }
}

/// Installs the global subscriber and propagator. Must run inside a tokio
/// runtime when an OTLP endpoint is set (the exporter's channel needs one).
pub fn init(cfg: &TelemetryConfig) -> Result<TelemetryGuard, TelemetryError> {
    let filter = EnvFilter::try_new(&cfg.log_filter)
        .map_err(|e| TelemetryError::Filter(cfg.log_filter.clone(), e.to_string()))?;
    // Logs go to stderr: stdout is reserved for machine-readable output
    // (`wavefront run --json`, the address line of `serve`).
    let fmt_layer = match cfg.log_format {
        // Colour only for a terminal: a log file or collector gets plain text (NO_COLOR, the
        // convention, turns it off on a terminal too).
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(
                std::io::IsTerminal::is_terminal(&std::io::stderr())
                    && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
            )
            .with_target(true)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let (otel_layer, provider) = match &cfg.otlp_endpoint {
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint.clone())
                .build()
                .map_err(|e| TelemetryError::Exporter(endpoint.clone(), e.to_string()))?;
            let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                cfg.sampling_ratio.clamp(0.0, 1.0),
            )));
            let provider = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_sampler(sampler)
                .with_resource(
                    Resource::builder()
                        .with_service_name(cfg.service_name.clone())
                        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                        .build(),
                )
                .build();
            let tracer = provider.tracer(cfg.service_name.clone());
            (
                Some(tracing_opentelemetry::layer().with_tracer(tracer)),
                Some(provider),
            )
        }
        None => (None, None),
    };
    // Logs and traces are filtered separately: a quiet log level must not
    // switch off the request and tick spans that traces are made of.
    let trace_filter =
        tracing_subscriber::filter::Targets::new().with_default(tracing::Level::INFO);
    tracing_subscriber::registry()
        .with(fmt_layer.with_filter(filter))
        .with(otel_layer.map(|l| l.with_filter(trace_filter)))
        .try_init()
        .map_err(|e| TelemetryError::AlreadyInstalled(e.to_string()))?;
    Ok(TelemetryGuard { provider })
}
