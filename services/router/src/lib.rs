//! # wavefront-router
//!
//! A stateless front door: it keeps no request state beyond the life of a
//! call. Workers are learned from configuration (addresses or DNS names; a
//! name that resolves to many addresses, as a Kubernetes headless service
//! does, yields one worker per address) and re-resolved and polled for load
//! every refresh interval ([`discovery`]). A request goes to the least-loaded
//! ready worker serving its model ([`pick`]); the router forwards the call
//! with the caller's deadline and trace context, and dropping the client's
//! stream cancels the worker's call, which frees the request's slots. When a worker drains, its
//! requests move to other workers mid-stream ([`relay`]). [`openai`] serves the same routing
//! over OpenAI-compatible HTTP.

mod api_error;
pub mod discovery;
pub mod json;
pub mod openai;
pub mod pick;
pub mod relay;
pub mod service;
pub mod tls;
mod tokenizer_http;

pub use discovery::{Discovery, DiscoveryConfig, WorkerEntry};
pub use openai::serve_http;
pub use service::{serve, RouterService};
pub use tls::{ServerTls, TlsError, WorkerTls};
