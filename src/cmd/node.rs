//! `tokenlog node`: one node of the replicated log, until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context};
use tokenlog_raftlog::node::{start, NodeConfig};
use tokenlog_raftlog::raft_types::Node as RaftNode;

#[derive(clap::Args)]
pub struct NodeArgs {
    /// This node's id (a positive integer, unique in the cluster).
    #[arg(
        long,
        required_unless_present = "id_from_ordinal",
        conflicts_with = "id_from_ordinal"
    )]
    pub id: Option<u64>,
    /// Take the id from a name ending in `-K` (a StatefulSet's pod name, `tokenlog-node-K`):
    /// id K+1.
    #[arg(long, value_name = "NAME")]
    pub id_from_ordinal: Option<String>,
    /// Address to listen on for the client API (raftlog.v1), and for Raft traffic between
    /// nodes too unless --peer-listen is given.
    #[arg(long, default_value = "127.0.0.1:7001")]
    pub listen: SocketAddr,
    /// Address clients use to reach this node, if not the listen address.
    #[arg(long)]
    pub advertise: Option<String>,
    /// A listener of its own for Raft traffic between nodes (raft.v1), so that a firewall can
    /// let only nodes reach it. Peers then name both addresses: --peers ID=ADDR/PEER_ADDR.
    #[arg(long)]
    pub peer_listen: Option<SocketAddr>,
    /// Address peers use to reach --peer-listen, if not that address.
    #[arg(long, requires = "peer_listen")]
    pub peer_advertise: Option<String>,
    /// Where RocksDB keeps the log and the state machine.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Initial voters as `id=host:port,...` (this node included), or `id=host:port/host:peerport`
    /// for nodes with a peer listener of their own. The lowest id initializes a new cluster.
    /// Omit (or give an empty list) to start empty and be added later with `tokenlog members add`.
    #[arg(long, value_delimiter = ',')]
    pub peers: Vec<String>,
    /// Raft heartbeat interval (ms).
    #[arg(long, default_value_t = 100)]
    pub heartbeat_ms: u64,
    /// Raft election timeout range (ms).
    #[arg(long, default_value_t = 500)]
    pub election_min_ms: u64,
    #[arg(long, default_value_t = 1000)]
    pub election_max_ms: u64,
    /// Build a snapshot and purge the log every this many applied entries.
    #[arg(long, default_value_t = 20_000)]
    pub snapshot_every: u64,
    /// Log entries kept behind the latest snapshot; older ones are purged.
    #[arg(long, default_value_t = 1_000)]
    pub keep_after_snapshot: u64,
    /// How long finished generations are kept before they are pruned (ms; at least 500, so a
    /// client that reconnects right after its generation finished still finds it).
    #[arg(long, default_value_t = tokenlog_raftlog::limits::RETENTION_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(tokenlog_raftlog::limits::RETENTION_MS_MIN..))]
    pub retention_ms: u64,
    /// Serve plain HTTP on ADDR for probes and scrapers: /metrics (commit latency, tokens, fence
    /// rejections, generations by state, takeovers, Raft indexes), /livez, /readyz (a leader
    /// known and everything known committed applied) and grpc.health.v1.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    #[command(flatten)]
    pub tls: crate::process::TlsArgs,
    /// Serve plain text, with no authentication and no roles, on an address other machines can
    /// reach. Without TLS a node listens on loopback addresses only, unless this is given.
    #[arg(long, conflicts_with = "tls_ca")]
    pub insecure: bool,
}

/// A node without TLS serves anyone who reaches it: every call of every role. That is only
/// acceptable on loopback, or when the operator says so.
fn check_plain_text(listen: SocketAddr, tls: bool, insecure: bool) -> anyhow::Result<()> {
    if tls || insecure || listen.ip().is_loopback() {
        return Ok(());
    }
    bail!(
        "refusing to serve plain text on {listen}: anyone who reaches it could submit, append and change membership. \
         Give --tls-ca, --tls-cert and --tls-key (make them with `tokenlog certs`), \
         or --insecure to run without authentication anyway"
    )
}

/// Parses `--peers` (`id=host:port` or `id=host:port/host:peerport`, ...). Two members with one
/// id or one address are refused: a node that is its own peer under another id breaks Raft's
/// elections. Empty entries are none: `--peers ""` (a unit's empty setting) is no peers.
pub fn parse_peers(peers: &[String]) -> anyhow::Result<Vec<(u64, RaftNode)>> {
    let members: Vec<(u64, RaftNode)> = peers
        .iter()
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (id, addrs) = p
                .split_once('=')
                .with_context(|| format!("peer {p:?} is not id=host:port"))?;
            let (addr, peer) = addrs.split_once('/').unwrap_or((addrs, ""));
            // A port is required (without one, port 80 was dialled), and no scheme.
            if !is_host_port(addr) || !(peer.is_empty() || is_host_port(peer)) {
                bail!("peer {p:?} is not id=host:port or id=host:port/host:peerport (no scheme, a port required)");
            }
            let id: u64 = id.parse().with_context(|| format!("peer id {id:?} is not a number"))?;
            if id == 0 {
                // No node can have it (--id is positive), and the lowest id initializes the
                // cluster: nobody would.
                bail!("peer {p:?}: ids are positive integers");
            }
            Ok((id, RaftNode::new(addr, peer)))
        })
        .collect::<anyhow::Result<_>>()?;
    for (i, (id, node)) in members.iter().enumerate() {
        if let Some((other, _)) = members[..i]
            .iter()
            .find(|(o, n)| o == id || n.addr == node.addr || n.peer() == node.peer())
        {
            bail!("--peers names {other} and {id} with the same id or address ({node}); each member needs its own");
        }
    }
    Ok(members)
}

/// `host:port`: a host (a name, an IPv4 address or a bracketed IPv6 one) and a port number.
fn is_host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
    let plain = !host.is_empty() && !host.contains([':', '/', '[', ']', ' ', '@']);
    (bracketed || plain) && port.parse::<u16>().is_ok_and(|p| p > 0)
}

/// The id of the node named `name` by a StatefulSet: `tokenlog-node-K` is node K+1.
fn id_from_ordinal(name: &str) -> anyhow::Result<u64> {
    let ordinal = name
        .rsplit_once('-')
        .and_then(|(_, k)| k.parse::<u64>().ok())
        .with_context(|| format!("--id-from-ordinal {name:?}: the name does not end in -NUMBER"))?;
    ordinal
        .checked_add(1)
        .with_context(|| format!("--id-from-ordinal {name:?}: the ordinal is too large"))
}

pub async fn run(a: NodeArgs) -> anyhow::Result<()> {
    let id = match (a.id, &a.id_from_ordinal) {
        (Some(id), _) => id,
        (None, Some(name)) => id_from_ordinal(name)?,
        (None, None) => bail!("give --id or --id-from-ordinal"),
    };
    if id == 0 {
        bail!("--id must be positive");
    }

    let tls = a.tls.load()?;
    check_plain_text(a.listen, tls.is_some(), a.insecure)?;
    if let Some(p) = a.peer_listen {
        check_plain_text(p, tls.is_some(), a.insecure)?;
    }
    if a.insecure {
        eprintln!(
            "WARNING: --insecure: node {} serves plain text without authentication on {}",
            id, a.listen
        );
    }
    // An address of every interface is no address to reach: the cluster's membership (and
    // every redirect to this node as the leader) would name 0.0.0.0.
    if a.listen.ip().is_unspecified() && a.listen.port() != 0 && a.advertise.is_none() {
        bail!(
            "--listen {} listens on every address: say with --advertise where clients and other nodes reach this node",
            a.listen
        );
    }
    if let Some(p) = a.peer_listen.filter(|p| p.ip().is_unspecified() && p.port() != 0) {
        if a.peer_advertise.is_none() {
            bail!("--peer-listen {p} listens on every address: say with --peer-advertise where other nodes reach it");
        }
    }
    let mut cfg = NodeConfig::new(id, a.listen, a.data_dir);
    cfg.tls = tls;
    cfg.advertise = a.advertise.unwrap_or_else(|| a.listen.to_string());
    cfg.peer_listen = a.peer_listen;
    cfg.peer_advertise = a.peer_advertise.unwrap_or_default();
    cfg.initial_members = parse_peers(&a.peers)?;
    if !cfg.initial_members.is_empty() && !cfg.initial_members.iter().any(|(m, _)| *m == id) {
        bail!("--peers must include this node (id {})", id);
    }
    cfg.heartbeat_ms = a.heartbeat_ms;
    cfg.election_timeout_ms = (a.election_min_ms, a.election_max_ms);
    cfg.snapshot_every = a.snapshot_every;
    cfg.keep_after_snapshot = a.keep_after_snapshot;
    cfg.retention_ms = a.retention_ms;
    cfg.faults = crate::process::planted_faults()?;
    cfg.wall_skew_ms = crate::process::wall_clock_skew()?;
    let node = start(cfg).await?;
    eprintln!(
        "tokenlog node {} serving clients on {}{} ({}; Ctrl-C to stop)",
        id,
        node.local_addr,
        node.peer_local_addr
            .map(|p| format!(", peers on {p}"))
            .unwrap_or_default(),
        if a.tls.tls_ca.is_some() {
            "mutual TLS, roles checked"
        } else {
            "plain text, no authentication"
        }
    );
    if let Some(m) = a.metrics_listen {
        let ctx = node.ctx.clone();
        let render = std::sync::Arc::new(move || ctx.render_metrics());
        let (addr, _) = crate::process::serve_status(m, render, node.health.clone())
            .await
            .context("binding --metrics-listen")?;
        eprintln!("status on http://{addr}: /metrics /livez /readyz, grpc.health.v1");
    }
    let failed = tokio::select! {
        _ = crate::process::shutdown_signal() => None,
        reason = node.failed() => Some(reason),
    };
    match failed {
        None => {
            eprintln!("shutting down node {}", id);
            node.shutdown().await;
            Ok(())
        }
        Some(reason) => {
            // No graceful stop: Raft has stopped already, and every moment more of serving
            // (a Watch that never advances, a read of a frozen state) is wrong.
            bail!(
                "node {}: Raft stopped on its own ({reason}); exiting rather than serving a state that no longer advances. Fix the cause (a full disk: free space) and start it again; the data dir is checked at start",
                id
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{id_from_ordinal, parse_peers};

    /// Peer id 0 is refused: no node can have it, and as the lowest id it was the one that
    /// should initialize the cluster, so none did and the nodes waited for ever.
    #[test]
    fn a_peer_of_id_0_is_refused() {
        let peers = |s: &str| parse_peers(&s.split(',').map(str::to_string).collect::<Vec<_>>());
        let e = peers("0=127.0.0.1:7000,1=127.0.0.1:7001").unwrap_err().to_string();
        assert!(e.contains("ids are positive"), "{e}");
        assert_eq!(peers("1=127.0.0.1:7000,2=127.0.0.1:7001").unwrap().len(), 2);
    }

    /// Every address is host:port: without a port, port 80 was dialled; with a scheme, the
    /// entry split at its `//` into a client address `http:` and a peer address. An empty
    /// `--peers` (a systemd unit's empty setting) is no peers: it was refused, and the README's
    /// "start it with no --peers" could not be done with the unit.
    #[test]
    fn peers_are_host_port_and_an_empty_list_is_none() {
        let peers = |s: &str| parse_peers(&s.split(',').map(str::to_string).collect::<Vec<_>>());
        for bad in [
            "1=node-1,2=node-2",
            "1=http://h:7001",
            "1=h:7001/h",
            "1=h:0",
            "1=h:70001",
            "1=:7001",
            "1=a b:7001",
        ] {
            let e = peers(bad).unwrap_err().to_string();
            assert!(e.contains("is not id=host:port"), "{bad}: {e}");
        }
        assert!(peers("").unwrap().is_empty());
        let ok = peers("1=node-1.example.net:7001/node-1.example.net:7002,2=[::1]:7001,3=10.0.0.3:7001").unwrap();
        assert_eq!(ok.len(), 3);
    }

    #[test]
    fn a_pod_name_gives_its_ordinal_plus_one() {
        assert_eq!(id_from_ordinal("tokenlog-node-0").unwrap(), 1);
        assert_eq!(id_from_ordinal("tokenlog-node-4").unwrap(), 5);
        assert!(id_from_ordinal("tokenlog-node").is_err());
        assert!(id_from_ordinal("node3").is_err());
        assert!(id_from_ordinal(&format!("n-{}", u64::MAX)).is_err());
    }
}
