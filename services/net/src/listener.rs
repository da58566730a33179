//! Accepting connections under a cap, with back-off on errors.

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::Stream;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::conn::Conn;
use crate::limits::ServerLimits;
use crate::refusals::{RefusalLayer, RefusalLimiter};

/// How often one listener may log the same kind of warning.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// The longest pause after an accept error.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// A TCP listener that keeps at most `max_connections` connections open (the rest wait in
/// the kernel's backlog) and survives accept errors: it pauses (5 ms, doubling to 1 s) and
/// warns at most once every 10 s, counting what it did not log.
pub struct Listener {
    inner: TcpListener,
    places: Arc<Semaphore>,
    limits: ServerLimits,
    /// The listener's name in logs (`grpc`, `http`, `metrics`).
    name: &'static str,
    full: RateLimited,
    failing: RateLimited,
    /// The budgets of the clients' refusals, `None` when refusals are never held.
    refusals: Option<Arc<RefusalLimiter>>,
}

impl Listener {
    pub fn new(inner: TcpListener, limits: ServerLimits, name: &'static str) -> Self {
        Self {
            inner,
            places: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            limits,
            name,
            full: RateLimited::default(),
            failing: RateLimited::default(),
            refusals: RefusalLimiter::new(limits.refusals),
        }
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    pub fn limits(&self) -> &ServerLimits {
        &self.limits
    }

    /// A layer that holds the refusals of addresses over their budget (`limits().refusals`),
    /// for a gRPC server on this listener.
    pub fn refusal_layer(&self) -> RefusalLayer {
        RefusalLayer::new(self.refusals.clone(), self.name)
    }

    /// This listener with `other`'s refusal budgets instead of its own: a client address then
    /// has one budget across both (the router's gRPC and HTTP listeners).
    pub fn sharing_refusals(mut self, other: &Listener) -> Self {
        self.refusals = other.refusals.clone();
        self
    }

    pub(crate) fn refusal_limiter(&self) -> Option<Arc<RefusalLimiter>> {
        self.refusals.clone()
    }

    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.limits.max_connections.max(1) - self.places.available_permits()
    }

    /// The next connection, once one may be open and the kernel hands one over.
    pub async fn accept(&self) -> (Conn, SocketAddr) {
        let mut backoff = Duration::ZERO;
        loop {
            let place = match self.places.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    if let Some(suppressed) = self.full.allow() {
                        tracing::warn!(
                            listener = self.name,
                            open = self.limits.max_connections,
                            suppressed,
                            "connection cap reached (--max-connections): new connections wait \
                             until one closes"
                        );
                    }
                    self.places
                        .clone()
                        .acquire_owned()
                        .await
                        .expect("the semaphore is never closed")
                }
            };
            match self.inner.accept().await {
                Ok((tcp, peer)) => {
                    let _ = tcp.set_nodelay(true);
                    let conn = Conn::new(
                        tcp,
                        place,
                        self.limits.header_read_timeout,
                        self.limits.idle_timeout,
                    );
                    return (conn, peer);
                }
                // The peer gave up before the accept: nothing wrong here.
                Err(e) if per_connection(&e) => continue,
                Err(e) => {
                    drop(place);
                    backoff = (backoff * 2).clamp(Duration::from_millis(5), MAX_BACKOFF);
                    if let Some(suppressed) = self.failing.allow() {
                        tracing::warn!(
                            listener = self.name,
                            error = %e,
                            suppressed,
                            pause_ms = backoff.as_millis() as u64,
                            "accept failed (descriptors exhausted?); pausing before the next"
                        );
                    }
                    tokio::time::sleep(backoff).await;
                }
            }
        }
    }

    /// The connections as a stream (for tonic's `serve_with_incoming`); it never ends and
    /// never yields an error.
    pub fn incoming(self) -> impl Stream<Item = io::Result<Conn>> + Send + 'static {
        futures::stream::unfold(Arc::new(self), |l| async move {
            let (conn, _) = l.accept().await;
            Some((Ok(conn), l))
        })
    }
}

/// Errors that concern one connection, not the listener.
fn per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// At most one event every [`WARN_EVERY`].
#[derive(Default)]
struct RateLimited(Mutex<(Option<Instant>, u64)>);

impl RateLimited {
    /// `Some(events not let through since the last one)` when this one may be logged.
    fn allow(&self) -> Option<u64> {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if s.0.is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
            s.1 += 1;
            return None;
        }
        s.0 = Some(now);
        Some(std::mem::take(&mut s.1))
    }
}
