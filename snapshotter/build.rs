//! Generates the snapshots service (server side only) from containerd's vendored protos with Debian's
//! `protoc` (`protobuf-compiler`, with the well-known types from `libprotobuf-dev`; `scripts/setup`
//! installs both). `PROTOC` overrides where protoc is.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        .build_client(false)
        .compile_protos(
            &["proto/containerd/services/snapshots/v1/snapshots.proto"],
            &["proto"],
        )?;
    Ok(())
}
