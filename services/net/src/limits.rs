//! What a server allows its clients.

use std::time::Duration;

use crate::refusals::RefusalBudget;

/// What a server allows its clients (flags `--max-connections`, `--header-read-timeout-s`,
/// `--body-read-timeout-s`, `--idle-timeout-s`, `--keepalive-interval-s`,
/// `--max-streams-per-connection`, `--refusals-per-second`, `--refusal-burst`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Connections open at once on one listener; more wait in the backlog.
    pub max_connections: usize,
    /// Time for a new connection's first bytes, and for an HTTP/1 request's headers (also
    /// the wait for the next request on a kept-alive connection).
    pub header_read_timeout: Duration,
    /// Time to receive a whole HTTP request body.
    pub body_read_timeout: Duration,
    /// A connection with no byte read or written for this long is closed. HTTP/2 keep-alive
    /// pings count, so it closes connections whose client is gone or sends nothing, not idle
    /// healthy gRPC channels; an HTTP/1 unary request that computes longer than this with no
    /// byte sent must stream instead.
    pub idle_timeout: Duration,
    /// HTTP/2 (gRPC) keep-alive ping interval; `None`: no pings.
    pub keepalive_interval: Option<Duration>,
    /// Time for a ping's answer before the connection is closed.
    pub keepalive_timeout: Duration,
    /// Concurrent HTTP/2 streams (gRPC calls) on one connection.
    pub max_streams: u32,
    /// Refusals answered at once per client address; past it they are held.
    pub refusals: RefusalBudget,
}

/// Defaults of the limits.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
pub const DEFAULT_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
pub const DEFAULT_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
pub const DEFAULT_MAX_STREAMS: u32 = 256;

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            keepalive_interval: Some(DEFAULT_KEEPALIVE_INTERVAL),
            keepalive_timeout: DEFAULT_KEEPALIVE_TIMEOUT,
            max_streams: DEFAULT_MAX_STREAMS,
            refusals: RefusalBudget::default(),
        }
    }
}

impl ServerLimits {
    /// A tonic server builder with these limits' HTTP/2 settings.
    pub fn grpc_server(&self) -> tonic::transport::Server {
        tonic::transport::Server::builder()
            .http2_keepalive_interval(self.keepalive_interval)
            .http2_keepalive_timeout(Some(self.keepalive_timeout))
            .max_concurrent_streams(self.max_streams)
    }
}
