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
//! assembles a request's response from its engine events (incremental detokenisation, stop
//! strings, the final response) once, for every sink: the gRPC stream ([`stream`]), the unary
//! call (the stream collected) and the offline `wavefront run` ([`output::generate_blocking`]).

pub mod convert;
pub mod limits;
pub mod migrate;
pub mod output;
pub mod server;
pub mod service;
pub mod status;
pub mod stream;
mod tokenize;
pub mod worker_api;

pub use limits::RequestLimits;
pub use output::{generate_blocking, Assembly, Finished, OutputAssembler, Reply};
pub use server::{serve, WorkerConfig};
pub use service::WorkerService;
