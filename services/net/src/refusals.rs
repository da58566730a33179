//! A budget of refusals per client address: a client whose requests keep being refused
//! (malformed, oversized, unauthenticated, naming no model) gets its refusals later and later,
//! so that a client that sends the next bad request as soon as the last is refused cannot
//! keep the server's network threads busy refusing it.
//!
//! Each refusal costs the server its parsing and checks (a fraction of a millisecond for the
//! worst chat under the limits, docs/reliability.md); on a small machine, clients that resend
//! at once keep a core busy with them, and the other models' requests wait behind. The budget
//! is a generic cell rate (the leaky bucket as a meter): `per_second` refusals a second per
//! address, `burst` of them at once; past it, the response is held until the address is
//! within its budget again. Only refusals are held: the address's valid requests, and every
//! other client's, are served as they come. A held refusal keeps its stream, its response and
//! a timer: at most 4,096 are held at once (all addresses together), and past that a refusal
//! is answered at once, so that holding cannot grow memory without bound.
//!
//! Addresses are counted whole for IPv4 and by /64 prefix for IPv6 (one host's usual share).
//! Behind a proxy every client shares the proxy's address, and so one budget: its valid
//! requests are still never held.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Refusals counted per address before they are held (flags `--refusals-per-second`,
/// `--refusal-burst`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefusalBudget {
    /// Refusals a second answered at once to one address; 0: no budget, never held.
    pub per_second: u32,
    /// Refusals an address may have at once before its budget holds them.
    pub burst: u32,
}

pub const DEFAULT_REFUSALS_PER_SECOND: u32 = 100;
pub const DEFAULT_REFUSAL_BURST: u32 = 200;
/// The longest a refusal is held, however far over its budget the address is.
pub const MAX_REFUSAL_HOLD: Duration = Duration::from_secs(30);
/// Refusals held at once (all addresses together); past it a refusal is answered at once, so
/// that held refusals cannot grow the server's memory without bound (each keeps its stream,
/// its response and a timer).
pub const MAX_HELD_REFUSALS: usize = 4096;
/// Addresses tracked at once; past it, the addresses last refused longest ago are dropped
/// (they are within their budget again), and if none is, new ones share one budget.
const MAX_ADDRESSES: usize = 1 << 16;
/// How long each refusal held by the budget was held (histogram, by listener; refusals
/// within the budget are not observed).
pub const REFUSAL_HOLD_SECONDS: &str = "wavefront_refusal_hold_seconds";

impl Default for RefusalBudget {
    fn default() -> Self {
        Self {
            per_second: DEFAULT_REFUSALS_PER_SECOND,
            burst: DEFAULT_REFUSAL_BURST,
        }
    }
}

impl RefusalBudget {
    /// No budget: refusals are answered at once.
    pub const OFF: Self = Self {
        per_second: 0,
        burst: 0,
    };
}

/// What a budget is counted by: an IPv4 address, an IPv6 /64, or every address past
/// `MAX_ADDRESSES` together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    V4([u8; 4]),
    V6([u8; 8]),
    Overflow,
}

fn key(ip: IpAddr) -> Key {
    match ip {
        IpAddr::V4(v4) => Key::V4(v4.octets()),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => Key::V4(v4.octets()),
            None => {
                let o = v6.octets();
                Key::V6([o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]])
            }
        },
    }
}

/// The refusal budgets of a server's clients (one for the listeners that share it).
#[derive(Debug)]
pub struct RefusalLimiter {
    /// Time between refusals at the budget's rate.
    interval: Duration,
    /// How far ahead of now an address's next refusal may be before it is held.
    tolerance: Duration,
    /// Per address, when its budget is whole again (the theoretical arrival time).
    whole_at: Mutex<Addresses>,
    /// Refusals being held now, and the most that may be.
    held: AtomicUsize,
    max_held: usize,
}

#[derive(Debug, Default)]
struct Addresses {
    map: HashMap<Key, Instant>,
    swept: Option<Instant>,
}

impl RefusalLimiter {
    /// `None` for a budget of 0 a second (refusals never held).
    pub fn new(budget: RefusalBudget) -> Option<Arc<Self>> {
        if budget.per_second == 0 {
            return None;
        }
        let interval = Duration::from_secs(1) / budget.per_second;
        Some(Arc::new(Self {
            interval,
            tolerance: interval * budget.burst.max(1),
            whole_at: Mutex::new(Addresses::default()),
            held: AtomicUsize::new(0),
            max_held: MAX_HELD_REFUSALS,
        }))
    }

    /// Counts a refusal to `ip` at `now`: how long to hold it (zero within the budget).
    pub fn charge(&self, ip: IpAddr, now: Instant) -> Duration {
        let mut addrs = self.whole_at.lock().unwrap_or_else(|e| e.into_inner());
        let mut k = key(ip);
        if !addrs.map.contains_key(&k) && addrs.map.len() >= MAX_ADDRESSES {
            // Addresses whose budget is whole again are as good as never seen. Sweep at most
            // once a second, so that a table of busy addresses costs one pass a second.
            if addrs
                .swept
                .is_none_or(|s| now.duration_since(s) >= Duration::from_secs(1))
            {
                addrs.map.retain(|_, whole| *whole > now);
                addrs.swept = Some(now);
            }
            if addrs.map.len() >= MAX_ADDRESSES {
                k = Key::Overflow;
            }
        }
        let whole = addrs.map.entry(k).or_insert(now);
        let next = (*whole).max(now) + self.interval;
        let ahead = next.duration_since(now);
        let hold = ahead.saturating_sub(self.tolerance).min(MAX_REFUSAL_HOLD);
        *whole = next.min(now + self.tolerance + MAX_REFUSAL_HOLD);
        hold
    }

    /// A place to hold one more refusal, if fewer than the most are held.
    fn try_hold(&self) -> Option<Held<'_>> {
        self.held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max_held).then_some(n + 1)
            })
            .ok()
            .map(|_| Held(&self.held))
    }
}

/// A refusal being held; the count goes down when it is dropped (answered, or its client
/// gone).
struct Held<'a>(&'a AtomicUsize);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether `response` refuses its request as the client's fault: HTTP 400, 401, 403, 404,
/// 405, 411, 413, 414, 415, 422 or 431, or a gRPC status (in the headers: tonic answers a
/// refused call with headers only) INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED,
/// OUT_OF_RANGE, UNIMPLEMENTED or UNAUTHENTICATED. Overload (429, RESOURCE_EXHAUSTED),
/// deadlines and cancellations are not the client's fault and are never held.
pub fn is_refusal<B>(response: &http::Response<B>) -> bool {
    let status = response.status().as_u16();
    if matches!(
        status,
        400 | 401 | 403 | 404 | 405 | 411 | 413 | 414 | 415 | 422 | 431
    ) {
        return true;
    }
    let grpc = response
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok());
    matches!(grpc, Some(3 | 5 | 7 | 11 | 12 | 16))
}

/// The client's address a tonic server puts in each request (plain or TLS).
fn peer_of<B>(req: &http::Request<B>) -> Option<IpAddr> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let ext = req.extensions();
    ext.get::<TcpConnectInfo>()
        .and_then(TcpConnectInfo::remote_addr)
        .or_else(|| {
            ext.get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|t| t.get_ref().remote_addr())
        })
        .map(|a| a.ip())
}

/// Holds a service's refusals to each address over its budget (a tower layer, for tonic's
/// `Server::layer`; the HTTP server applies it per connection).
#[derive(Debug, Clone)]
pub struct RefusalLayer {
    limiter: Option<Arc<RefusalLimiter>>,
    listener: &'static str,
}

impl RefusalLayer {
    pub(crate) fn new(limiter: Option<Arc<RefusalLimiter>>, listener: &'static str) -> Self {
        Self { limiter, listener }
    }
}

impl<S> tower::Layer<S> for RefusalLayer {
    type Service = HoldRefusals<S>;

    fn layer(&self, inner: S) -> HoldRefusals<S> {
        HoldRefusals {
            inner,
            limiter: self.limiter.clone(),
            listener: self.listener,
            peer: None,
        }
    }
}

/// See [`RefusalLayer`].
#[derive(Debug, Clone)]
pub struct HoldRefusals<S> {
    inner: S,
    limiter: Option<Arc<RefusalLimiter>>,
    /// The listener's name, for the metric.
    listener: &'static str,
    /// The connection's client, where the server knows it per connection (else from the
    /// request's connection info).
    peer: Option<IpAddr>,
}

impl<S> HoldRefusals<S> {
    pub(crate) fn for_peer(
        inner: S,
        limiter: Option<Arc<RefusalLimiter>>,
        listener: &'static str,
        peer: IpAddr,
    ) -> Self {
        Self {
            inner,
            limiter,
            listener,
            peer: Some(peer),
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> tower::Service<http::Request<B>> for HoldRefusals<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let peer = self.peer.or_else(|| peer_of(&req));
        let (limiter, listener) = (self.limiter.clone(), self.listener);
        let answer = self.inner.call(req);
        Box::pin(async move {
            let response = answer.await?;
            if let (Some(limiter), Some(peer)) = (limiter, peer) {
                if is_refusal(&response) {
                    let hold = limiter.charge(peer, Instant::now());
                    if !hold.is_zero() {
                        if let Some(_held) = limiter.try_hold() {
                            metrics::histogram!(REFUSAL_HOLD_SECONDS, "listener" => listener)
                                .record(hold.as_secs_f64());
                            tokio::time::sleep(hold).await;
                        }
                    }
                }
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn limiter(per_second: u32, burst: u32) -> Arc<RefusalLimiter> {
        RefusalLimiter::new(RefusalBudget { per_second, burst }).unwrap()
    }

    #[test]
    fn the_burst_is_answered_at_once_then_refusals_come_at_the_rate() {
        let l = limiter(10, 5);
        let a = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
        let t = Instant::now();
        for _ in 0..5 {
            assert_eq!(l.charge(a, t), Duration::ZERO);
        }
        // Each further refusal at the same instant waits one more interval.
        assert_eq!(l.charge(a, t), Duration::from_millis(100));
        assert_eq!(l.charge(a, t), Duration::from_millis(200));
        // Another address has its own budget.
        let b = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
        assert_eq!(l.charge(b, t), Duration::ZERO);
        // Clients that wait out their hold and resend are held to the rate: 10 a second.
        let mut now = t + Duration::from_millis(200);
        let mut answered = 0;
        while now < t + Duration::from_secs(10) {
            now += l.charge(a, now);
            answered += 1;
        }
        assert!((95..=100).contains(&answered), "{answered} in 10 s");
        // Once the address stops, its budget refills.
        let later = now + Duration::from_secs(1);
        for _ in 0..5 {
            assert_eq!(l.charge(a, later), Duration::ZERO);
        }
    }

    #[test]
    fn holds_are_bounded_and_off_means_never() {
        assert!(RefusalLimiter::new(RefusalBudget::OFF).is_none());
        let l = limiter(1, 1);
        let a = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let t = Instant::now();
        let mut last = Duration::ZERO;
        for _ in 0..100 {
            last = l.charge(a, t);
        }
        assert_eq!(last, MAX_REFUSAL_HOLD);
    }

    #[test]
    fn at_most_so_many_refusals_are_held_at_once() {
        let mut l = limiter(1, 1);
        Arc::get_mut(&mut l).unwrap().max_held = 2;
        let (a, b) = (l.try_hold().unwrap(), l.try_hold().unwrap());
        assert!(l.try_hold().is_none());
        drop(a);
        let c = l.try_hold().expect("a place again");
        drop((b, c));
        assert_eq!(l.held.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn ipv6_is_counted_by_its_64_and_mapped_ipv4_as_ipv4() {
        let l = limiter(1, 1);
        let t = Instant::now();
        let one: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let same_64: IpAddr = "2001:db8:1:2::ffff".parse().unwrap();
        assert_eq!(l.charge(one, t), Duration::ZERO);
        assert!(l.charge(same_64, t) > Duration::ZERO);
        let v4: IpAddr = "192.0.2.7".parse().unwrap();
        let mapped = IpAddr::V6("::ffff:192.0.2.7".parse::<Ipv6Addr>().unwrap());
        assert_eq!(l.charge(v4, t), Duration::ZERO);
        assert!(l.charge(mapped, t) > Duration::ZERO);
    }

    #[test]
    fn many_addresses_share_one_budget_past_the_table_only_while_all_are_busy() {
        let l = limiter(1, 1);
        let t = Instant::now();
        for i in 0..MAX_ADDRESSES as u32 {
            l.charge(IpAddr::V4(Ipv4Addr::from(i)), t);
        }
        let late = IpAddr::V4(Ipv4Addr::from(u32::MAX));
        assert_eq!(l.charge(late, t), Duration::ZERO);
        // The overflow's budget is shared: a second newcomer is held.
        let later = IpAddr::V4(Ipv4Addr::from(u32::MAX - 1));
        assert!(l.charge(later, t) > Duration::ZERO);
        // Once the table's addresses are whole again they are dropped, and a newcomer gets a
        // budget of its own.
        let t2 = t + Duration::from_secs(5);
        let fresh = IpAddr::V4(Ipv4Addr::from(u32::MAX - 2));
        assert_eq!(l.charge(fresh, t2), Duration::ZERO);
        assert_eq!(l.whole_at.lock().unwrap().map.len(), 1);
    }

    /// Through the layer: an address's refusals past its burst wait for the rate, its valid
    /// requests never do.
    #[tokio::test]
    async fn the_layer_holds_refusals_past_the_burst_and_never_an_answer() {
        use tower::{Service, ServiceExt};
        let inner = tower::service_fn(|req: http::Request<()>| async move {
            let status = if req.uri().path() == "/bad" { 400 } else { 200 };
            Ok::<_, std::convert::Infallible>(
                http::Response::builder().status(status).body(()).unwrap(),
            )
        });
        let limiter = RefusalLimiter::new(RefusalBudget {
            per_second: 10,
            burst: 2,
        });
        let mut svc =
            HoldRefusals::for_peer(inner, limiter, "test", IpAddr::V4(Ipv4Addr::LOCALHOST));
        let mut call = |path: &'static str| {
            let req = http::Request::builder().uri(path).body(()).unwrap();
            let fut = svc.ready().now_or_never().unwrap().unwrap().call(req);
            async move {
                let t = Instant::now();
                let r = fut.await.unwrap();
                (r.status().as_u16(), t.elapsed())
            }
        };
        let fast = Duration::from_millis(40);
        for _ in 0..2 {
            let (status, took) = call("/bad").await;
            assert_eq!(status, 400);
            assert!(took < fast, "{took:?}");
        }
        // Over the budget: answers are not held, refusals are (one interval, 100 ms).
        for _ in 0..5 {
            let (status, took) = call("/good").await;
            assert_eq!(status, 200);
            assert!(took < fast, "{took:?}");
        }
        let (status, took) = call("/bad").await;
        assert_eq!(status, 400);
        assert!(took >= Duration::from_millis(60), "{took:?}");
    }

    #[test]
    fn refusals_are_the_clients_fault_only() {
        let http = |s: u16| http::Response::builder().status(s).body(()).unwrap();
        let grpc = |c: &str| {
            http::Response::builder()
                .status(200)
                .header("grpc-status", c)
                .body(())
                .unwrap()
        };
        for s in [400, 401, 404, 413, 415, 422] {
            assert!(is_refusal(&http(s)), "{s}");
        }
        for s in [200, 408, 429, 500, 503, 504] {
            assert!(!is_refusal(&http(s)), "{s}");
        }
        for c in ["3", "5", "7", "16"] {
            assert!(is_refusal(&grpc(c)), "{c}");
        }
        // OK, CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNAVAILABLE, INTERNAL.
        for c in ["0", "1", "4", "8", "14", "13"] {
            assert!(!is_refusal(&grpc(c)), "{c}");
        }
        assert!(!is_refusal(&http::Response::new(())));
    }
}
