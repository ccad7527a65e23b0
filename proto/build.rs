//! Compiles `proto/*.proto` with a vendored `protoc`, so a build needs no system protobuf install.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/tokenlog.proto",
        "proto/raftlog.proto",
        "proto/raft.proto",
        "proto/etcd_kv.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?)
    };
    tonic_prost_build::configure().compile_protos(&protos, &["proto"])?;
    Ok(())
}
