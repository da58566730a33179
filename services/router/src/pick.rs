//! Choosing a worker for a request: a plain function over the worker table,
//! tested without any network.

use crate::discovery::WorkerEntry;

/// Why no worker was picked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoWorker {
    /// Some reachable worker serves other models, none this one.
    UnknownModel { model: String, served: Vec<String> },
    /// No reachable, ready worker serves the model.
    Unreachable { model: String, known: usize },
    /// The request named no model and several are served.
    Ambiguous { served: Vec<String> },
}

/// What the reachable workers report of each model they serve, by name (sorted, one each).
pub fn served_model_infos(workers: &[WorkerEntry]) -> Vec<wavefront_proto::v1::ModelInfo> {
    served_models(workers)
        .iter()
        .filter_map(|n| {
            workers
                .iter()
                .filter(|w| w.up)
                .filter_map(|w| w.report.as_ref())
                .flat_map(|r| r.models.iter())
                .filter_map(|m| m.model.clone())
                .find(|i| &i.name == n)
        })
        .collect()
}

/// Models served by the reachable workers, sorted and deduplicated.
pub fn served_models(workers: &[WorkerEntry]) -> Vec<String> {
    let mut names: Vec<String> = workers
        .iter()
        .filter(|w| w.up)
        .filter_map(|w| w.report.as_ref())
        .flat_map(|r| {
            r.models
                .iter()
                .filter_map(|m| m.model.as_ref().map(|i| i.name.clone()))
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Candidates for `model`, best first: most free slot fraction minus queue
/// pressure; `exclude` are workers that already failed this call.
pub fn rank(
    workers: &[WorkerEntry],
    model: &str,
    exclude: &[std::net::SocketAddr],
) -> Result<Vec<WorkerEntry>, NoWorker> {
    let served = served_models(workers);
    let model = if model.is_empty() {
        match served.as_slice() {
            [only] => only.clone(),
            [] => {
                return Err(NoWorker::Unreachable {
                    model: String::new(),
                    known: workers.len(),
                })
            }
            _ => return Err(NoWorker::Ambiguous { served }),
        }
    } else {
        model.to_owned()
    };
    let mut scored: Vec<(f64, &WorkerEntry)> = workers
        .iter()
        .filter(|w| w.up && !exclude.contains(&w.addr))
        .filter_map(|w| {
            let r = w.report.as_ref()?;
            if !r.ready {
                return None;
            }
            let m = r
                .models
                .iter()
                .find(|m| m.model.as_ref().is_some_and(|i| i.name == model))?;
            let free = f64::from(m.free_slots) / f64::from(m.total_slots.max(1));
            // Preempted requests wait to resume like queued ones: the worker is short of
            // memory, not of places. Requests sent since the report are not in it yet.
            let waiting = m
                .queued_requests
                .saturating_add(m.preempted_requests)
                .saturating_add(w.routed);
            let queue = f64::from(waiting) / f64::from(m.queue_capacity.max(1));
            Some((free - 2.0 * queue, w))
        })
        .collect();
    if scored.is_empty() {
        return Err(if served.is_empty() || served.contains(&model) {
            NoWorker::Unreachable {
                model,
                known: workers.len(),
            }
        } else {
            NoWorker::UnknownModel { model, served }
        });
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.addr.cmp(&b.1.addr)));
    Ok(scored.into_iter().map(|(_, w)| w.clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::transport::Endpoint;
    use wavefront_proto::v1::ModelInfo;
    use wavefront_proto::worker::v1::worker_client::WorkerClient;
    use wavefront_proto::worker::v1::{LoadReport, ModelLoad};

    fn worker(
        port: u16,
        model: &str,
        free: u32,
        queued: u32,
        up: bool,
        ready: bool,
    ) -> WorkerEntry {
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let ch = Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        WorkerEntry {
            addr,
            client: WorkerClient::with_interceptor(ch, Default::default()),
            up,
            last_seen: None,
            routed: 0,
            taken: 0,
            report: Some(LoadReport {
                worker_id: addr.to_string(),
                ready,
                models: vec![ModelLoad {
                    model: Some(ModelInfo {
                        name: model.into(),
                        ..Default::default()
                    }),
                    total_slots: 100,
                    free_slots: free,
                    queued_requests: queued,
                    active_requests: 0,
                    queue_capacity: 10,
                    ticks: 0,
                    ..Default::default()
                }],
            }),
        }
    }

    #[tokio::test]
    async fn least_loaded_ready_worker_first() {
        let ws = vec![
            worker(1, "m", 10, 0, true, true),
            worker(2, "m", 90, 0, true, true),
            worker(3, "m", 100, 0, false, true),
            worker(4, "m", 100, 0, true, false),
            worker(5, "m", 95, 5, true, true),
        ];
        let ranked: Vec<u16> = rank(&ws, "m", &[])
            .unwrap()
            .iter()
            .map(|w| w.addr.port())
            .collect();
        // A queue outweighs free slots: worker 5 (5 queued) ranks below 1.
        assert_eq!(ranked, vec![2, 1, 5]);
        let ranked: Vec<u16> = rank(&ws, "", &[ws[1].addr])
            .unwrap()
            .iter()
            .map(|w| w.addr.port())
            .collect();
        assert_eq!(ranked, vec![1, 5]);
    }

    #[tokio::test]
    async fn preempted_requests_count_as_waiting() {
        let mut pressed = worker(1, "m", 60, 0, true, true);
        if let Some(r) = pressed.report.as_mut() {
            r.models[0].preempted_requests = 3;
        }
        let ws = vec![pressed, worker(2, "m", 40, 0, true, true)];
        let ranked: Vec<u16> = rank(&ws, "m", &[])
            .unwrap()
            .iter()
            .map(|w| w.addr.port())
            .collect();
        // More free slots, but three requests waiting to resume: the other worker first.
        assert_eq!(ranked, vec![2, 1]);
    }

    #[tokio::test]
    async fn a_burst_between_two_reports_alternates_between_equal_workers() {
        // Both idle in their last reports; each pick is counted on the worker it went to, as
        // the router does, until the next report.
        let mut ws = vec![
            worker(1, "m", 100, 0, true, true),
            worker(2, "m", 100, 0, true, true),
        ];
        let mut picks = Vec::new();
        for _ in 0..6 {
            let first = rank(&ws, "m", &[]).unwrap()[0].addr;
            picks.push(first.port());
            ws.iter_mut()
                .find(|w| w.addr == first)
                .expect("ranked worker")
                .routed += 1;
        }
        assert_eq!(picks, vec![1, 2, 1, 2, 1, 2]);
    }

    #[tokio::test]
    async fn unknown_unreachable_and_ambiguous_are_distinguished() {
        let ws = vec![
            worker(1, "a", 10, 0, true, true),
            worker(2, "b", 10, 0, false, true),
        ];
        assert!(matches!(
            rank(&ws, "zzz", &[]),
            Err(NoWorker::UnknownModel { .. })
        ));
        assert!(matches!(
            rank(&ws, "a", &[ws[0].addr]),
            Err(NoWorker::Unreachable { .. })
        ));
        let both = vec![
            worker(1, "a", 10, 0, true, true),
            worker(2, "b", 10, 0, true, true),
        ];
        assert!(matches!(
            rank(&both, "", &[]),
            Err(NoWorker::Ambiguous { .. })
        ));
        assert!(matches!(
            rank(&[], "a", &[]),
            Err(NoWorker::Unreachable { .. })
        ));
    }
}
