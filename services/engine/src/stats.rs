//! Per-request statistics reported with every finished request.

use std::collections::BTreeMap;
use std::time::Duration;

/// What a request cost. Common fields are typed; family-specific figures go in
/// `counters` (one number) and `series` (one number per token, per step, ...)
/// under stable snake_case names that the API passes through unchanged.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Stats {
    pub prompt_tokens: u32,
    pub generated_tokens: u32,
    /// Model forward calls this request took part in (a packed call counts once).
    pub forward_passes: u64,
    /// Recurrent-depth families: core-block iterations summed over tokens.
    pub recurrence_steps: u64,
    /// Engine ticks this request was active in.
    pub ticks: u64,
    /// From submission to admission.
    pub queue_time: Duration,
    /// From admission to the final event.
    pub compute_time: Duration,
    pub counters: BTreeMap<String, u64>,
    pub series: BTreeMap<String, Vec<u32>>,
    /// Times the request moved between workers.
    pub migrations: u32,
}

impl Stats {
    /// Generated tokens per second of compute time (0 when nothing ran).
    pub fn tokens_per_second(&self) -> f64 {
        let secs = self.compute_time.as_secs_f64();
        if secs > 0.0 {
            f64::from(self.generated_tokens) / secs
        } else {
            0.0
        }
    }

    pub fn add_counter(&mut self, name: &str, by: u64) {
        *self.counters.entry(name.to_owned()).or_default() += by;
    }

    pub fn push_series(&mut self, name: &str, value: u32) {
        self.series.entry(name.to_owned()).or_default().push(value);
    }
}
