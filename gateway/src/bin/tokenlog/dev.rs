//! `tokenlog dev`: the embedded single-machine default. Today it runs a single-node log in one
//! process (RocksDB under `--data-dir`) and prints how to use it. The gateway and the CPU
//! decoder with the bundled model join this command as they are built (issues #3 and #4).

use std::net::SocketAddr;
use std::path::PathBuf;

use tokenlog_raftlog::node::{start, NodeConfig};

#[derive(clap::Args)]
pub struct DevArgs {
    /// Where the single node keeps its data (kept across runs).
    #[arg(long, default_value = "data/dev")]
    pub data_dir: PathBuf,
    /// Log API address.
    #[arg(long, default_value = "127.0.0.1:7001")]
    pub listen: SocketAddr,
}

pub async fn run(a: DevArgs) -> anyhow::Result<()> {
    let mut cfg = NodeConfig::new(1, a.listen, a.data_dir.clone());
    cfg.initial_members = vec![(1, a.listen.to_string())];
    eprintln!("starting a single-node log in {} ...", a.data_dir.display());
    let node = start(cfg).await?;
    let addr = node.local_addr;
    println!("tokenlog dev is up");
    println!("  log API (raftlog.v1, gRPC)  {addr}");
    println!("  data dir                    {}", a.data_dir.display());
    println!("try, in another shell:");
    println!("  tokenlog status --cluster {addr}");
    println!("  tokenlog verify --node {addr}");
    println!("not yet part of dev: the gateway (client streaming) and the CPU decoder; see README.md");
    println!("Ctrl-C stops it cleanly.");
    crate::node::shutdown_signal().await;
    eprintln!("stopping ...");
    node.shutdown().await;
    Ok(())
}
