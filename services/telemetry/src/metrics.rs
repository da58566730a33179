//! Prometheus metrics: names, help texts and the exporter. The engine's own
//! series are named in `wavefront_engine::metrics` and re-exported here.
//!
//! Every series carries a fixed label set: `model` and `scheme` where they
//! apply, `status` (a gRPC code name) on request outcomes, `event` on the
//! per-scheme counters. Rates (tokens/s, requests/s) come from counters.

use std::net::SocketAddr;

pub use wavefront_engine::metrics::{
    ACTIVE_REQUESTS, CACHE_USAGE, POOL_ALLOCATED_BYTES, PREEMPTED_REQUESTS, PREEMPTIONS_TOTAL,
    PREEMPT_BYTES_FROM_HOST, PREEMPT_BYTES_TO_HOST, PREFIX_CACHE_EVICTIONS_TOTAL,
    PREFIX_CACHE_HITS_TOTAL, PREFIX_CACHE_HIT_TOKENS_TOTAL, PROMPT_PAGES_SHARED_TOTAL, QUEUE_DEPTH,
    RECOMPUTED_ROWS_TOTAL, SLOTS_CACHED, SLOTS_SHARED, SLOTS_TOTAL, SLOTS_USED, TICKS_TOTAL,
    TICK_DURATION, TICK_REQUESTS, TICK_ROWS,
};

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

pub const REQUESTS_TOTAL: &str = "wavefront_requests_total";
pub const REQUEST_DURATION: &str = "wavefront_request_duration_seconds";
pub const TIME_TO_FIRST_TOKEN: &str = "wavefront_time_to_first_token_seconds";
pub const INTER_TOKEN_LATENCY: &str = "wavefront_inter_token_latency_seconds";
pub const GENERATED_TOKENS_TOTAL: &str = "wavefront_generated_tokens_total";
pub const PROMPT_TOKENS_TOTAL: &str = "wavefront_prompt_tokens_total";
pub const FORWARD_PASSES_TOTAL: &str = "wavefront_forward_passes_total";
pub const SCHEME_EVENTS_TOTAL: &str = "wavefront_scheme_events_total";
pub const ROUTER_REQUESTS_TOTAL: &str = "wavefront_router_requests_total";
pub const ROUTER_REQUEST_DURATION: &str = "wavefront_router_request_duration_seconds";
pub const ROUTER_WORKERS: &str = "wavefront_router_workers";
pub const ROUTER_MIGRATIONS_TOTAL: &str = "wavefront_router_migrations_total";
pub const HTTP_RESPONSES_TOTAL: &str = "wavefront_http_responses_total";

fn describe() {
    describe_counter!(
        REQUESTS_TOTAL,
        "Requests finished by a worker, by model, scheme and gRPC status."
    );
    describe_histogram!(
        REQUEST_DURATION,
        Unit::Seconds,
        "Request latency at the worker, arrival to last message."
    );
    describe_histogram!(
        TIME_TO_FIRST_TOKEN,
        Unit::Seconds,
        "Arrival to the first streamed token."
    );
    describe_counter!(
        GENERATED_TOKENS_TOTAL,
        "Tokens generated (rate() gives tokens/s)."
    );
    describe_counter!(PROMPT_TOKENS_TOTAL, "Prompt tokens processed.");
    describe_counter!(
        FORWARD_PASSES_TOTAL,
        "Model forward calls summed over finished requests."
    );
    describe_counter!(
        SCHEME_EVENTS_TOTAL,
        "Per-scheme work counters of finished requests (event: frozen positions, standing waves, locked rows, revocations, grouped steps, ...)."
    );
    describe_gauge!(QUEUE_DEPTH, "Requests waiting for admission.");
    describe_gauge!(ACTIVE_REQUESTS, "Requests admitted and running.");
    describe_gauge!(
        SLOTS_TOTAL,
        "Slots in the pool (for paged K/V families, pages: 16 positions of one layer)."
    );
    describe_gauge!(
        SLOTS_USED,
        "Slots (pages) held by running requests (not those only the prefix cache holds)."
    );
    describe_counter!(
        PREEMPTIONS_TOTAL,
        "Running requests preempted because another's next step could not get its slots."
    );
    describe_gauge!(
        PREEMPTED_REQUESTS,
        "Preempted requests waiting to resume (ahead of new arrivals)."
    );
    describe_counter!(
        PREEMPT_BYTES_TO_HOST,
        Unit::Bytes,
        "Bytes of state moved from the slot pool to host memory by preemptions."
    );
    describe_counter!(
        PREEMPT_BYTES_FROM_HOST,
        Unit::Bytes,
        "Bytes of state moved back from host memory when preempted requests resumed."
    );
    describe_counter!(
        RECOMPUTED_ROWS_TOTAL,
        "Rows dropped by preemption and computed again on resumption."
    );
    describe_gauge!(
        POOL_ALLOCATED_BYTES,
        Unit::Bytes,
        "Memory the model's slot pools have allocated so far: arenas are made on first use and \
         kept, so this is the pools' high-water mark, at most what wavefront_slots_total amounts \
         to."
    );
    describe_counter!(
        PROMPT_PAGES_SHARED_TOTAL,
        "Prompt pages (slots) admitted requests read from a running request with the same \
         prompt, or from a finished one the prefix cache keeps, instead of computing them (the \
         choices of a request with n > 1, or identical prompts)."
    );
    describe_gauge!(
        SLOTS_CACHED,
        "Slots only the prefix cache holds now: finished requests' prompt state kept for later \
         requests with the same prompt, given back when the pool needs them (counted as free)."
    );
    describe_counter!(
        PREFIX_CACHE_HITS_TOTAL,
        "Admitted requests that read prompt state (at least one row) from a finished request \
         the prefix cache kept."
    );
    describe_counter!(
        PREFIX_CACHE_HIT_TOKENS_TOTAL,
        "Prompt tokens admitted requests read from the prefix cache's entries instead of \
         computing them."
    );
    describe_counter!(
        PREFIX_CACHE_EVICTIONS_TOTAL,
        "Finished requests the prefix cache let go of (the pool needed their slots, or the \
         cache was full)."
    );
    describe_gauge!(
        SLOTS_SHARED,
        "Slots held by more than one request now (shared prompt pages)."
    );
    describe_gauge!(
        CACHE_USAGE,
        "Fraction of the slot pool (K/V cache and latent states) held by running requests (not \
         counting slots only the prefix cache holds)."
    );
    describe_histogram!(
        INTER_TOKEN_LATENCY,
        Unit::Seconds,
        "Time between streamed tokens of a request (an update of several tokens counts each at \
         its share of the interval)."
    );
    describe_histogram!(
        TICK_DURATION,
        Unit::Seconds,
        "Duration of one engine tick (all packed forwards of the tick)."
    );
    describe_histogram!(TICK_REQUESTS, "Requests packed into one engine tick.");
    describe_histogram!(
        TICK_ROWS,
        "Rows (positions, states, cells) computed in one engine tick."
    );
    describe_counter!(TICKS_TOTAL, "Engine ticks run.");
    describe_counter!(
        ROUTER_REQUESTS_TOTAL,
        "Requests finished at the router, by model and gRPC status."
    );
    describe_counter!(
        HTTP_RESPONSES_TOTAL,
        "Responses of the OpenAI-compatible HTTP front, by route and HTTP status code, refusals \
         before a request reaches the router (bad JSON, unknown fields, missing API key, body \
         too large or too slow) included."
    );
    describe_histogram!(
        wavefront_net::REFUSAL_HOLD_SECONDS,
        Unit::Seconds,
        "How long a refusal was held because its client address was over its refusal budget \
         (--refusals-per-second, --refusal-burst), by listener (grpc, http); refusals within \
         the budget are answered at once and not observed."
    );
    describe_histogram!(
        ROUTER_REQUEST_DURATION,
        Unit::Seconds,
        "Request latency at the router."
    );
    describe_gauge!(
        ROUTER_WORKERS,
        "Workers known to the router, by state (up, down)."
    );
    describe_counter!(
        ROUTER_MIGRATIONS_TOTAL,
        "Requests offered to other workers, by reason (draining: their worker drains; \
         rebalance: their worker had a queue and another was idle) and outcome (moved; stayed: \
         no other worker took it)."
    );
}

/// Installs the global recorder and serves `/metrics` on `addr` (through a
/// [`wavefront_net::Listener`]: at most 64 connections, silent clients closed, accept errors
/// survived with back-off and rate-limited warnings); the bound address. Must run inside a
/// tokio runtime.
pub fn install_prometheus(addr: SocketAddr) -> Result<SocketAddr, crate::TelemetryError> {
    let latency = [
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    ];
    let tick = [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    ];
    let counts = [
        1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0, 16384.0,
    ];
    let listener = std::net::TcpListener::bind(addr)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .and_then(tokio::net::TcpListener::from_std)
        .map_err(|source| crate::TelemetryError::MetricsListen { addr, source })?;
    let bound = listener.local_addr().unwrap_or(addr);
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &latency)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(TICK_DURATION.into()), &tick))
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(TICK_REQUESTS.into()), &counts))
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(TICK_ROWS.into()), &counts))
        .and_then(|b| b.install_recorder())
        .map_err(|source| crate::TelemetryError::Metrics { addr, source })?;
    describe();
    // Histograms' and summaries' old samples are dropped as they age.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let handle = handle.clone();
            async move { handle.render() }
        }),
    );
    let limits = wavefront_net::ServerLimits {
        max_connections: 64,
        ..wavefront_net::ServerLimits::default()
    };
    let listener = wavefront_net::Listener::new(listener, limits, "metrics");
    tokio::spawn(wavefront_net::serve_http(
        listener,
        app,
        None,
        std::future::pending(),
    ));
    Ok(bound)
}

/// The canonical gRPC name of a status code (the `status` label).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}
