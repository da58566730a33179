//! Worker discovery and load polling.
//!
//! Every `refresh` the configured targets are resolved; each resulting
//! address gets a lazily connected channel and is asked for its load report
//! with a short timeout. A worker that fails to answer is marked down at
//! once (no traffic) and forgotten after `forget_after` of silence; one that
//! answers again is back on the next refresh.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use wavefront_proto::auth::{AttachSecret, Secrets};

use crate::tls::WorkerTls;
use wavefront_proto::worker::v1 as wpb;
use wavefront_proto::worker::v1::worker_client::WorkerClient;

#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    /// `host:port` targets; DNS names may resolve to many workers.
    pub targets: Vec<String>,
    pub refresh: Duration,
    /// Timeout of one load poll.
    pub poll_timeout: Duration,
    /// A worker silent this long is dropped from the table.
    pub forget_after: Duration,
    /// The credential every call to a worker carries (`--worker-token`; none when empty).
    pub worker_token: Secrets,
    /// Reach workers over TLS (verified by a CA; with a client identity for mTLS).
    pub worker_tls: Option<WorkerTls>,
}

/// What a router knows of a chat before forwarding it, from a worker's report: enough to refuse
/// one that no worker would take, whatever its messages say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatBound {
    /// The worker's `--max-chat-messages` (`None`: its report predates the field).
    pub max_messages: Option<usize>,
    /// The fewest tokens the chat template makes of the messages, contents aside.
    pub at_least: usize,
    /// The model's context (prompt plus `max_new_tokens`).
    pub max_context: usize,
}

/// One known worker.
#[derive(Debug, Clone)]
pub struct WorkerEntry {
    pub addr: SocketAddr,
    pub client: WorkerClient<InterceptedService<Channel, AttachSecret>>,
    /// Last report; `None` until the first successful poll.
    pub report: Option<wpb::LoadReport>,
    /// Answered the last poll.
    pub up: bool,
    pub last_seen: Option<Instant>,
    /// Requests this router sent the worker since the poll its report answers: not in the
    /// report yet. Ranking counts them as waiting, so a burst that arrives between two polls
    /// spreads over the workers instead of all going to the one that looked least loaded.
    pub routed: u32,
    /// Requests a rebalancing move claimed away from this worker's queue since the poll its
    /// report answers ([`Discovery::claim_room`]).
    pub taken: u32,
}

/// The shared worker table (soft state, rebuilt from the workers themselves).
#[derive(Clone)]
pub struct Discovery {
    table: Arc<RwLock<HashMap<SocketAddr, WorkerEntry>>>,
    /// Counts discovery rounds: relays watch it to notice a worker that started draining.
    rounds: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Default for Discovery {
    fn default() -> Self {
        Self {
            table: Arc::default(),
            rounds: Arc::new(tokio::sync::watch::channel(0).0),
        }
    }
}

impl Discovery {
    /// A receiver that changes after every discovery round.
    pub fn rounds(&self) -> tokio::sync::watch::Receiver<u64> {
        self.rounds.subscribe()
    }

    /// A worker of `model` with room to take a request from the worker at `addr`, when `addr`
    /// has requests waiting in its admission queue (rebalancing). A worker has room when it
    /// queues nothing and runs fewer than its `max_active` requests, counting what was sent to
    /// it since its report ([`WorkerEntry::routed`]); the one with the most room is claimed
    /// (counted as routed to), and the move is counted against `addr`'s queue
    /// ([`WorkerEntry::taken`]), so one round moves no more requests than the queue holds or
    /// the others can start. `None` when `addr` has no queue left or nobody has room.
    pub fn claim_room(&self, addr: SocketAddr, model: &str) -> Option<WorkerEntry> {
        let mut table = self.table.write().expect("worker table lock");
        let load = |w: &WorkerEntry| {
            let r = w.report.as_ref().filter(|r| r.ready && w.up)?;
            r.models
                .iter()
                .find(|m| {
                    m.model
                        .as_ref()
                        .is_some_and(|i| model.is_empty() || i.name == model)
                })
                .cloned()
        };
        let source = table.get(&addr)?;
        let queued = load(source)?.queued_requests;
        if queued <= source.taken {
            return None;
        }
        let room = |w: &WorkerEntry| -> Option<u32> {
            let m = load(w)?;
            if m.queued_requests > 0 || m.preempted_requests > 0 {
                return None;
            }
            // A worker that does not say how many it runs at once has room only when idle.
            let limit = m.max_active.max(1);
            limit
                .checked_sub(m.active_requests.saturating_add(w.routed))
                .filter(|&n| n > 0)
        };
        let target = table
            .values()
            .filter(|w| w.addr != addr)
            .filter_map(|w| Some((room(w)?, w.addr)))
            .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))?
            .1;
        if let Some(s) = table.get_mut(&addr) {
            s.taken += 1;
        }
        let t = table.get_mut(&target)?;
        t.routed += 1;
        Some(t.clone())
    }

    /// Whether the worker at `addr` answers and says it is draining (not ready): its requests
    /// should move.
    pub fn is_draining(&self, addr: SocketAddr) -> bool {
        self.table
            .read()
            .expect("worker table lock")
            .get(&addr)
            .is_some_and(|w| w.up && w.report.as_ref().is_some_and(|r| !r.ready))
    }

    pub fn snapshot(&self) -> Vec<WorkerEntry> {
        let mut v: Vec<_> = self
            .table
            .read()
            .expect("worker table lock")
            .values()
            .cloned()
            .collect();
        v.sort_by_key(|w| w.addr);
        v
    }

    /// Runs one discovery round: resolve, add, poll, drop.
    pub async fn refresh(&self, cfg: &DiscoveryConfig) {
        // Each address with the host it was found under (the name a worker's certificate
        // carries when workers speak TLS).
        let mut found: Vec<(SocketAddr, &str)> = Vec::new();
        for t in &cfg.targets {
            match tokio::net::lookup_host(t.as_str()).await {
                Ok(addrs) => {
                    let host = t.rsplit_once(':').map_or(t.as_str(), |(h, _)| h);
                    found.extend(addrs.map(|a| (a, host)));
                }
                Err(e) => {
                    tracing::debug!(target = %t, error = %e, "worker target does not resolve")
                }
            }
        }
        found.sort();
        found.dedup_by_key(|(a, _)| *a);
        let resolved: Vec<SocketAddr> = found.iter().map(|(a, _)| *a).collect();
        {
            let mut table = self.table.write().expect("worker table lock");
            for (addr, host) in &found {
                if !table.contains_key(addr) {
                    let scheme = if cfg.worker_tls.is_some() {
                        "https"
                    } else {
                        "http"
                    };
                    let Ok(mut ep) = Endpoint::from_shared(format!("{scheme}://{addr}")) else {
                        continue;
                    };
                    if let Some(tls) = &cfg.worker_tls {
                        ep = match ep.tls_config(tls.client(host)) {
                            Ok(ep) => ep,
                            Err(e) => {
                                tracing::warn!(worker = %addr, error = %e, "cannot set up TLS to the worker");
                                continue;
                            }
                        };
                    }
                    let channel = ep
                        .connect_timeout(cfg.poll_timeout)
                        .tcp_nodelay(true)
                        .connect_lazy();
                    table.insert(
                        *addr,
                        WorkerEntry {
                            addr: *addr,
                            client: WorkerClient::with_interceptor(
                                channel,
                                AttachSecret::new(&cfg.worker_token),
                            ),
                            report: None,
                            up: false,
                            last_seen: None,
                            routed: 0,
                            taken: 0,
                        },
                    );
                    tracing::info!(worker = %addr, "worker discovered");
                }
            }
        }
        let entries = self.snapshot();
        let polls = entries.into_iter().map(|w| {
            let timeout = cfg.poll_timeout;
            // What was routed before the poll is in its answer; what is routed meanwhile is not.
            let (routed_before, taken_before) = (w.routed, w.taken);
            async move {
                let mut client = w.client.clone();
                let res = tokio::time::timeout(
                    timeout,
                    client.get_load(wpb::LoadRequest { interval_ms: 0 }),
                )
                .await;
                (
                    w.addr,
                    routed_before,
                    taken_before,
                    res.ok().and_then(|r| r.ok()).map(|r| r.into_inner()),
                )
            }
        });
        let results = futures::future::join_all(polls).await;
        let now = Instant::now();
        let mut table = self.table.write().expect("worker table lock");
        for (addr, routed_before, taken_before, report) in results {
            let Some(w) = table.get_mut(&addr) else {
                continue;
            };
            match report {
                Some(r) => {
                    if !w.up {
                        tracing::info!(worker = %addr, "worker up");
                    }
                    w.up = true;
                    w.last_seen = Some(now);
                    w.report = Some(r);
                    w.routed = w.routed.saturating_sub(routed_before);
                    w.taken = w.taken.saturating_sub(taken_before);
                }
                None => {
                    if w.up {
                        tracing::warn!(worker = %addr, "worker stopped answering; routing around it");
                    }
                    w.up = false;
                }
            }
        }
        let up = table.values().filter(|w| w.up).count();
        metrics::gauge!(wavefront_telemetry::metrics::ROUTER_WORKERS, "state" => "up")
            .set(up as f64);
        metrics::gauge!(wavefront_telemetry::metrics::ROUTER_WORKERS, "state" => "down")
            .set((table.len() - up) as f64);
        self.rounds.send_modify(|n| *n += 1);
        table.retain(|addr, w| {
            let silent = w
                .last_seen
                .is_none_or(|t| now.duration_since(t) > cfg.forget_after);
            let keep = resolved.contains(addr) || !silent;
            if !keep {
                tracing::info!(worker = %addr, "worker forgotten");
            }
            keep
        });
    }

    /// Whether a reachable worker serves `model` (under the table's read lock, nothing cloned:
    /// asked once per call).
    pub fn serves(&self, model: &str) -> bool {
        self.table
            .read()
            .expect("worker table lock")
            .values()
            .filter(|w| w.up)
            .filter_map(|w| w.report.as_ref())
            .flat_map(|r| r.models.iter())
            .any(|m| m.model.as_ref().is_some_and(|i| i.name == model))
    }

    /// What the reachable workers say of a chat of `messages` messages for `model`: see
    /// [`ChatBound`]. Where their reports differ (workers started with different limits) the
    /// bound is the most lenient of them, so that the router never refuses a chat some worker
    /// would take. `None` where no report names the model.
    pub fn chat_bound(&self, model: &str, messages: usize) -> Option<ChatBound> {
        let table = self.table.read().expect("worker table lock");
        let mut bound: Option<ChatBound> = None;
        for load in table
            .values()
            .filter(|w| w.up)
            .filter_map(|w| w.report.as_ref())
            .flat_map(|r| r.models.iter())
        {
            let Some(info) = load.model.as_ref().filter(|i| i.name == model) else {
                continue;
            };
            let this = ChatBound {
                max_messages: (load.max_chat_messages > 0)
                    .then_some(load.max_chat_messages as usize),
                at_least: (info.chat_tokens_fixed as usize)
                    .saturating_add(messages.saturating_mul(info.chat_tokens_per_message as usize)),
                max_context: info.max_context as usize,
            };
            bound = Some(match bound {
                None => this,
                Some(b) => ChatBound {
                    max_messages: b.max_messages.zip(this.max_messages).map(|(a, b)| a.max(b)),
                    at_least: b.at_least.min(this.at_least),
                    max_context: b.max_context.max(this.max_context),
                },
            });
        }
        bound
    }

    /// The model the reachable workers serve when they serve exactly one (what a request that
    /// names none gets).
    pub fn sole_model(&self) -> Option<String> {
        let table = self.table.read().expect("worker table lock");
        let mut names = table
            .values()
            .filter(|w| w.up)
            .filter_map(|w| w.report.as_ref())
            .flat_map(|r| r.models.iter())
            .filter_map(|m| m.model.as_ref().map(|i| i.name.as_str()));
        let first = names.next()?;
        names.all(|n| n == first).then(|| first.to_owned())
    }

    /// Counts a request this router just sent to the worker at `addr` (see
    /// [`WorkerEntry::routed`]).
    pub fn note_routed(&self, addr: SocketAddr) {
        if let Some(w) = self
            .table
            .write()
            .expect("worker table lock")
            .get_mut(&addr)
        {
            w.routed = w.routed.saturating_add(1);
        }
    }

    /// Marks a worker down after a failed call (until its next good poll).
    pub fn mark_down(&self, addr: SocketAddr) {
        if let Some(w) = self
            .table
            .write()
            .expect("worker table lock")
            .get_mut(&addr)
        {
            w.up = false;
        }
    }

    /// Refreshes forever, every `cfg.refresh`.
    pub async fn run(self, cfg: DiscoveryConfig) {
        let mut tick = tokio::time::interval(cfg.refresh);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.refresh(&cfg).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chat bound comes from the up workers' reports naming the model, the most lenient of
    /// them: their `--max-chat-messages` (none from a report that predates the field) and the
    /// template's tokens for the messages against the context.
    #[tokio::test]
    async fn a_chats_bound_is_read_from_the_workers_reports() {
        use wavefront_proto::v1::ModelInfo;
        use wavefront_proto::worker::v1::ModelLoad;
        let entry = |port: u16, up: bool, max_chat_messages: u32| {
            let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            let ch = tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
            WorkerEntry {
                addr,
                client: WorkerClient::with_interceptor(ch, Default::default()),
                report: Some(wpb::LoadReport {
                    worker_id: addr.to_string(),
                    ready: true,
                    models: vec![ModelLoad {
                        model: Some(ModelInfo {
                            name: "m".into(),
                            max_context: 100,
                            chat_tokens_fixed: 5,
                            chat_tokens_per_message: 7,
                            ..Default::default()
                        }),
                        max_chat_messages,
                        ..Default::default()
                    }],
                }),
                up,
                last_seen: None,
                routed: 0,
                taken: 0,
            }
        };
        let d = Discovery::default();
        d.table
            .write()
            .unwrap()
            .insert(entry(1, false, 3).addr, entry(1, false, 3));
        assert_eq!(d.chat_bound("m", 13), None, "only up workers count");
        d.table
            .write()
            .unwrap()
            .insert(entry(2, true, 10).addr, entry(2, true, 10));
        assert_eq!(
            d.chat_bound("m", 13),
            Some(ChatBound {
                max_messages: Some(10),
                at_least: 5 + 13 * 7,
                max_context: 100,
            })
        );
        assert_eq!(d.chat_bound("other", 13), None);
        // A second worker with a higher limit: the more lenient bound.
        d.table
            .write()
            .unwrap()
            .insert(entry(4, true, 20).addr, entry(4, true, 20));
        assert_eq!(d.chat_bound("m", 13).and_then(|b| b.max_messages), Some(20));
        let d = Discovery::default();
        d.table
            .write()
            .unwrap()
            .insert(entry(3, true, 0).addr, entry(3, true, 0));
        assert_eq!(d.chat_bound("m", 1).and_then(|b| b.max_messages), None);
    }

    /// A name is resolved to every address it has, as a Kubernetes headless
    /// service yields one address per pod; each address is one worker.
    #[tokio::test]
    async fn a_name_resolving_to_many_addresses_yields_one_worker_per_address() {
        let cfg = DiscoveryConfig {
            targets: vec![
                "localhost:1".into(),
                "127.0.0.1:2".into(),
                "127.0.0.1:2".into(),
            ],
            refresh: Duration::from_millis(100),
            poll_timeout: Duration::from_millis(100),
            forget_after: Duration::from_secs(1),
            worker_token: Secrets::default(),
            worker_tls: None,
        };
        let d = Discovery::default();
        d.refresh(&cfg).await;
        let mut expected: Vec<SocketAddr> = tokio::net::lookup_host("localhost:1")
            .await
            .unwrap()
            .collect();
        expected.push("127.0.0.1:2".parse().unwrap());
        expected.sort();
        expected.dedup();
        let got: Vec<SocketAddr> = d.snapshot().iter().map(|w| w.addr).collect();
        assert_eq!(got, expected);
        // Nothing listens there: known, but down (no traffic).
        assert!(d.snapshot().iter().all(|w| !w.up));
    }
}
