//! Generates the Rust types of `proto/wasmrelay.proto` with prost, parsing
//! the schema with protox (pure Rust), so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let schema = "proto/wasmrelay.proto";
    println!("cargo:rerun-if-changed={schema}");
    let descriptors = protox::compile([schema], ["proto"])?;
    prost_build::Config::new()
        .bytes(["."])
        .compile_fds(descriptors)?;
    Ok(())
}
