//! # wavefront-worker
//!
//! A worker owns one served model (its engine thread, slot pool and family)
//! and exposes it over gRPC:
//! - `wavefront.v1.Generation` (the public API, so a worker can be called
//!   directly) and `wavefront.worker.v1.Worker` (the router's API: a
//!   generate stream and load reports);
//! - standard gRPC health (`grpc.health.v1`) and server reflection.
//!
//! Protobuf types stop here: [`convert`] turns requests into
//! [`wavefront_schemes::GenerateSpec`] and results back, [`status`] is the
//! one mapping from domain errors to gRPC status codes, and [`output`]
//! assembles streamed tokens into text (incremental detokenisation, stop
//! strings). The same [`output::generate_blocking`] path backs the offline
//! `wavefront run` command.

pub mod convert;
pub mod limits;
pub mod migrate;
pub mod output;
pub mod server;
pub mod service;
pub mod status;

pub use limits::RequestLimits;
pub use output::{generate_blocking, Finished, OutputAssembler};
pub use server::{serve, WorkerConfig};
pub use service::WorkerService;
