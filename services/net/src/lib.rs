//! The servers' listeners and connections. Every gRPC, HTTP and metrics listener of router and
//! worker goes through a [`Listener`]: it keeps at most `max_connections` open (new ones wait
//! in the kernel's backlog), closes a connection whose client sends nothing
//! (`header_read_timeout` after it opens, `idle_timeout` after its last byte either way), and
//! survives accept errors (descriptors exhausted) with back-off and at most one warning per
//! interval, never a busy loop. [`serve_http`] serves an axum app over it with HTTP/1 header
//! timeouts, HTTP/2 keep-alive pings and a cap on streams per connection. A listener's
//! [`RefusalBudget`] holds the refusals of a client address that keeps sending bad requests
//! (on the HTTP server, and on a gRPC server that adds [`Listener::refusal_layer`]).

mod conn;
mod http;
mod limits;
mod listener;
mod refusals;

pub use conn::Conn;
pub use http::{read_body_within, serve_http, BodyError};
pub use limits::*;
pub use listener::Listener;
pub use refusals::{
    is_refusal, HoldRefusals, RefusalBudget, RefusalLayer, RefusalLimiter,
    DEFAULT_REFUSALS_PER_SECOND, DEFAULT_REFUSAL_BURST, MAX_REFUSAL_HOLD, REFUSAL_HOLD_SECONDS,
};

/// Raises this process's soft limit on open descriptors to its hard limit (as Go's runtime
/// does), so that the connection caps, not the descriptor limit, bound the servers; the new
/// soft and the hard limit.
pub fn raise_descriptor_limit() -> Option<(u64, u64)> {
    // SAFETY: getrlimit and setrlimit only read and write the struct passed to them.
    unsafe {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) != 0 {
            return None;
        }
        if l.rlim_cur < l.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: l.rlim_max,
                rlim_max: l.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                l = raised;
            }
        }
        // rlim_t is u64 on Linux, not everywhere.
        #[allow(clippy::unnecessary_cast)]
        Some((l.rlim_cur as u64, l.rlim_max as u64))
    }
}
