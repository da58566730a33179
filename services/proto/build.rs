//! Generates the protobuf types and gRPC stubs from ../../proto at build time
//! (nothing generated is committed). protoc comes from the vendored binary
//! crate, so no system install is needed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let protos = [
        root.join("wavefront/v1/generate.proto"),
        root.join("wavefront/worker/v1/worker.proto"),
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut config = tonic_prost_build::configure().codec_path("crate::codec::StrictCodec");
    // The scheme messages (and the likelihood options) also read from JSON under their proto
    // field names (the HTTP API's extension objects): unset fields keep their defaults, unknown ones are refused.
    for scheme in [
        "ArScheme",
        "DiffusionForcingScheme",
        "LowConfidenceScheme",
        "WinoScheme",
        "PlanInfillScheme",
        "DiffusionGenerateScheme",
        "BlockDiffusionScheme",
        "EntropyBoundScheme",
        "LikelihoodOptions",
    ] {
        config = config.type_attribute(
            format!(".wavefront.v1.{scheme}"),
            "#[derive(serde::Deserialize)] #[serde(default, deny_unknown_fields)]",
        );
    }
    config
        .file_descriptor_set_path(out.join("wavefront_descriptor.bin"))
        .compile_protos(&protos, &[root])?;
    Ok(())
}
