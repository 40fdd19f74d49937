//! Compiles the protobuf files in `../proto` with a pure-Rust compiler (protox),
//! so building needs no system `protoc`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../proto");
    let files = ["scheduler.proto"];
    for f in &files {
        println!("cargo:rerun-if-changed={}", proto_dir.join(f).display());
    }
    let fds = protox::compile(files, [&proto_dir])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
