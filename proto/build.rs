//! Generates the SPIRE Entry API client from our protos in `proto/` with protox, so a fresh
//! clone builds with `cargo build` alone (no `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["spire/api/server/entry/v1/entry.proto"];
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
