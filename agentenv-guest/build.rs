//! Compiles `../proto/process.proto` and `../proto/filesystem.proto` with a
//! pure-Rust compiler (protox, no system `protoc`), generates prost types and
//! serde implementations that follow the protobuf JSON mapping (pbjson), as
//! the Connect JSON codec needs.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../proto");
    let files = ["process.proto", "filesystem.proto"];
    for f in &files {
        println!("cargo:rerun-if-changed={}", proto_dir.join(f).display());
    }
    let fds = protox::compile(files, [&proto_dir])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor_bytes = fds.encode_to_vec();
    std::fs::write(out_dir.join("envd_descriptor.bin"), &descriptor_bytes)?;

    prost_build::Config::new()
        .compile_well_known_types()
        .extern_path(".google.protobuf.Timestamp", "crate::wkt::Timestamp")
        .extern_path(".google.protobuf", "::pbjson_types")
        .compile_fds(fds)?;

    pbjson_build::Builder::new()
        .register_descriptors(&descriptor_bytes)?
        .extern_path(".google.protobuf.Timestamp", "crate::wkt::Timestamp")
        .ignore_unknown_fields()
        .build(&[".process", ".filesystem"])?;
    Ok(())
}
