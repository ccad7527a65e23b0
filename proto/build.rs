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
    // `decoder.v1` uses raftlog.v1's messages: they live in this crate's `raftlog` module.
    println!("cargo:rerun-if-changed=proto/handoff.proto");
    println!("cargo:rerun-if-changed=proto/stage.proto");
    // Its own out dir: this run also writes (extern-only) code for the imported raftlog.v1.
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("decoder");
    std::fs::create_dir_all(&out)?;
    tonic_prost_build::configure()
        .extern_path(".raftlog.v1", "crate::raftlog")
        .out_dir(out)
        .compile_protos(&["proto/handoff.proto", "proto/stage.proto"], &["proto"])?;
    Ok(())
}
