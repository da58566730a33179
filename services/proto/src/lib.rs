//! Protobuf messages and gRPC stubs for `wavefront.v1` (the public API) and
//! `wavefront.worker.v1` (router to worker), generated from `proto/` at build
//! time. The descriptor set feeds server reflection.

#![allow(clippy::all, clippy::pedantic)]

pub mod v1 {
    tonic::include_proto!("wavefront.v1");
}

pub mod worker {
    pub mod v1 {
        tonic::include_proto!("wavefront.worker.v1");
    }
}

/// Encoded `FileDescriptorSet` of every proto file, for tonic-reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("wavefront_descriptor");
