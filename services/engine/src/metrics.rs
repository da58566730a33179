//! The engine's Prometheus series: names (the single definition; the
//! telemetry crate describes them) and handles registered once per engine,
//! so a tick records without building labels or looking series up.

use metrics::{Counter, Gauge, Histogram};

pub const TICK_DURATION: &str = "wavefront_engine_tick_duration_seconds";
pub const TICK_REQUESTS: &str = "wavefront_engine_tick_requests";
pub const TICK_ROWS: &str = "wavefront_engine_tick_rows";
pub const TICKS_TOTAL: &str = "wavefront_engine_ticks_total";
pub const QUEUE_DEPTH: &str = "wavefront_queue_depth";
pub const ACTIVE_REQUESTS: &str = "wavefront_active_requests";
pub const SLOTS_TOTAL: &str = "wavefront_slots_total";
pub const SLOTS_USED: &str = "wavefront_slots_used";
pub const CACHE_USAGE: &str = "wavefront_cache_usage_ratio";
pub const PREEMPTIONS_TOTAL: &str = "wavefront_engine_preemptions_total";
pub const PREEMPTED_REQUESTS: &str = "wavefront_preempted_requests";
pub const PREEMPT_BYTES_TO_HOST: &str = "wavefront_engine_preempt_bytes_to_host_total";
pub const PREEMPT_BYTES_FROM_HOST: &str = "wavefront_engine_preempt_bytes_from_host_total";
pub const RECOMPUTED_ROWS_TOTAL: &str = "wavefront_engine_recomputed_rows_total";
pub const POOL_ALLOCATED_BYTES: &str = "wavefront_pool_allocated_bytes";
pub const PROMPT_PAGES_SHARED_TOTAL: &str = "wavefront_engine_prompt_pages_shared_total";
pub const SLOTS_SHARED: &str = "wavefront_slots_shared";
pub const SLOTS_CACHED: &str = "wavefront_slots_cached";
pub const PREFIX_CACHE_HITS_TOTAL: &str = "wavefront_engine_prefix_cache_hits_total";
pub const PREFIX_CACHE_HIT_TOKENS_TOTAL: &str = "wavefront_engine_prefix_cache_hit_tokens_total";
pub const PREFIX_CACHE_EVICTIONS_TOTAL: &str = "wavefront_engine_prefix_cache_evictions_total";

/// One engine's series, labelled with its model. Handles taken before a
/// recorder is installed record nothing, so binaries install theirs first.
#[derive(Clone)]
pub(crate) struct EngineMetrics {
    pub tick_duration: Histogram,
    pub tick_requests: Histogram,
    pub tick_rows: Histogram,
    pub ticks: Counter,
    pub queue_depth: Gauge,
    pub active: Gauge,
    pub slots_total: Gauge,
    pub slots_used: Gauge,
    pub cache_usage: Gauge,
    pub preemptions: Counter,
    pub preempted: Gauge,
    pub bytes_to_host: Counter,
    pub bytes_from_host: Counter,
    pub recomputed_rows: Counter,
    pub pool_bytes: Gauge,
    pub prompt_pages_shared: Counter,
    pub slots_shared: Gauge,
    pub slots_cached: Gauge,
    pub prefix_cache_hits: Counter,
    pub prefix_cache_hit_tokens: Counter,
    pub prefix_cache_evictions: Counter,
}

impl EngineMetrics {
    pub fn new(model: &str) -> Self {
        let m = model.to_owned();
        Self {
            tick_duration: metrics::histogram!(TICK_DURATION, "model" => m.clone()),
            tick_requests: metrics::histogram!(TICK_REQUESTS, "model" => m.clone()),
            tick_rows: metrics::histogram!(TICK_ROWS, "model" => m.clone()),
            ticks: metrics::counter!(TICKS_TOTAL, "model" => m.clone()),
            queue_depth: metrics::gauge!(QUEUE_DEPTH, "model" => m.clone()),
            active: metrics::gauge!(ACTIVE_REQUESTS, "model" => m.clone()),
            slots_total: metrics::gauge!(SLOTS_TOTAL, "model" => m.clone()),
            slots_used: metrics::gauge!(SLOTS_USED, "model" => m.clone()),
            cache_usage: metrics::gauge!(CACHE_USAGE, "model" => m.clone()),
            preemptions: metrics::counter!(PREEMPTIONS_TOTAL, "model" => m.clone()),
            preempted: metrics::gauge!(PREEMPTED_REQUESTS, "model" => m.clone()),
            bytes_to_host: metrics::counter!(PREEMPT_BYTES_TO_HOST, "model" => m.clone()),
            bytes_from_host: metrics::counter!(PREEMPT_BYTES_FROM_HOST, "model" => m.clone()),
            recomputed_rows: metrics::counter!(RECOMPUTED_ROWS_TOTAL, "model" => m.clone()),
            pool_bytes: metrics::gauge!(POOL_ALLOCATED_BYTES, "model" => m.clone()),
            prompt_pages_shared: metrics::counter!(PROMPT_PAGES_SHARED_TOTAL, "model" => m.clone()),
            slots_shared: metrics::gauge!(SLOTS_SHARED, "model" => m.clone()),
            slots_cached: metrics::gauge!(SLOTS_CACHED, "model" => m.clone()),
            prefix_cache_hits: metrics::counter!(PREFIX_CACHE_HITS_TOTAL, "model" => m.clone()),
            prefix_cache_hit_tokens: metrics::counter!(PREFIX_CACHE_HIT_TOKENS_TOTAL, "model" => m.clone()),
            prefix_cache_evictions: metrics::counter!(PREFIX_CACHE_EVICTIONS_TOTAL, "model" => m),
        }
    }

    /// Handles that record nothing and register no series (a scheduler before it is given
    /// its model's name).
    pub fn none() -> Self {
        Self {
            tick_duration: Histogram::noop(),
            tick_requests: Histogram::noop(),
            tick_rows: Histogram::noop(),
            ticks: Counter::noop(),
            queue_depth: Gauge::noop(),
            active: Gauge::noop(),
            slots_total: Gauge::noop(),
            slots_used: Gauge::noop(),
            cache_usage: Gauge::noop(),
            preemptions: Counter::noop(),
            preempted: Gauge::noop(),
            bytes_to_host: Counter::noop(),
            bytes_from_host: Counter::noop(),
            recomputed_rows: Counter::noop(),
            pool_bytes: Gauge::noop(),
            prompt_pages_shared: Counter::noop(),
            slots_shared: Gauge::noop(),
            slots_cached: Gauge::noop(),
            prefix_cache_hits: Counter::noop(),
            prefix_cache_hit_tokens: Counter::noop(),
            prefix_cache_evictions: Counter::noop(),
        }
    }
}
