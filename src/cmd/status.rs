//! `tokenlog status`, `tokenlog verify`, `tokenlog members`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

#[derive(clap::Args)]
pub struct StatusArgs {
    /// Addresses of any nodes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1:7001")]
    pub cluster: Vec<String>,
    #[command(flatten)]
    pub tls: crate::process::TlsArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub async fn status(a: StatusArgs) -> anyhow::Result<()> {
    let client = LogClient::with_tls(a.cluster, a.tls.load()?)?;
    let s = client.cluster_status(true).await.context("no leader answered")?;
    // Ask every member for its own view (lag is seen from each node's applied index).
    let mut views = Vec::new();
    for m in &s.members {
        let mut c = client.node(&m.addr);
        views.push((
            m.clone(),
            c.cluster_status(pb::ClusterStatusRequest { linearizable: false })
                .await
                .ok()
                .map(|r| r.into_inner()),
        ));
    }
    // Pipelines and stage processes (issue 16); an empty view when the log cannot list them.
    let stages = client.list_stages(true).await.unwrap_or_default();
    let layers = |a: u32, b: u32| match a == b {
        true => "cold".to_string(),
        false => format!("{a}..{b}"),
    };
    if a.json {
        let pipelines: Vec<_> = stages
            .pipelines
            .iter()
            .map(|p| {
                serde_json::json!({
                    "head": p.head, "epoch": p.epoch, "set_log_ms": p.set_log_ms,
                    "stages": p.stages.iter().map(|s| serde_json::json!({
                        "stage_id": s.stage_id, "addr": s.addr, "first_layer": s.first_layer, "end_layer": s.end_layer,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        let registered: Vec<_> = stages
            .stages
            .iter()
            .map(|s| {
                serde_json::json!({
                    "stage_id": s.stage_id, "addr": s.addr, "weights_sha256": s.weights_sha256,
                    "first_layer": s.first_layer, "end_layer": s.end_layer, "cold": s.first_layer == s.end_layer,
                    "expiry_log_ms": s.expiry_log_ms,
                })
            })
            .collect();
        let members: Vec<_> = views
            .iter()
            .map(|(m, v)| {
                serde_json::json!({
                    "id": m.node_id, "addr": m.addr, "voter": m.voter, "matched_index": m.matched_index,
                    "reachable": v.is_some(),
                    "state": v.as_ref().map(|v| v.state.clone()),
                    "applied_index": v.as_ref().map(|v| v.applied_index),
                    "lag": v.as_ref().map(|v| s.commit_index.saturating_sub(v.applied_index)),
                })
            })
            .collect();
        let out = serde_json::json!({
            "leader_id": s.leader_id, "leader_addr": s.leader_addr, "term": s.term,
            "last_log_index": s.last_log_index, "commit_index": s.commit_index, "applied_index": s.applied_index,
            "snapshot_index": s.snapshot_index, "purged_index": s.purged_index, "log_ms": s.log_ms,
            "generations_by_state": s.generations_by_state, "members": members,
            "pipelines": pipelines, "stages": registered,
        });
        say!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    say!("leader     node {} at {} (term {})", s.leader_id, s.leader_addr, s.term);
    say!(
        "log        last {}  committed {}  applied {}  snapshot {}  purged {}",
        s.last_log_index,
        s.commit_index,
        s.applied_index,
        s.snapshot_index,
        s.purged_index
    );
    say!("members");
    for (m, v) in &views {
        let role = if m.voter { "voter" } else { "learner" };
        match v {
            Some(v) => say!(
                "  node {:<3} {:<22} {:<8} {:<10} applied {:<8} lag {}",
                m.node_id,
                m.addr,
                role,
                v.state,
                v.applied_index,
                s.commit_index.saturating_sub(v.applied_index)
            ),
            None => say!("  node {:<3} {:<22} {:<8} unreachable", m.node_id, m.addr, role),
        }
    }
    let mut line = String::from("generations");
    if s.generations_by_state.is_empty() {
        line.push_str(" none");
    }
    for (state, n) in &s.generations_by_state {
        line.push_str(&format!("  {state} {n}"));
    }
    say!("{line}");
    if !stages.pipelines.is_empty() {
        say!("pipelines");
        for p in &stages.pipelines {
            let parts: Vec<String> = p
                .stages
                .iter()
                .map(|s| format!("{} {} at {}", s.stage_id, layers(s.first_layer, s.end_layer), s.addr))
                .collect();
            say!("  head {:<20} epoch {:<6} {}", p.head, p.epoch, parts.join(", "));
        }
    }
    if !stages.stages.is_empty() {
        say!("stages");
        let named: std::collections::HashSet<&str> = stages
            .pipelines
            .iter()
            .flat_map(|p| p.stages.iter().map(|s| s.stage_id.as_str()))
            .collect();
        for st in &stages.stages {
            say!(
                "  {:<28} {:<8} {:<22} {:<6} lapses in {} ms",
                st.stage_id,
                layers(st.first_layer, st.end_layer),
                st.addr,
                if named.contains(st.stage_id.as_str()) {
                    "in use"
                } else {
                    "spare"
                },
                st.expiry_log_ms.saturating_sub(stages.log_ms)
            );
        }
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct VerifyArgs {
    /// A stopped node's data dir.
    #[arg(long, conflicts_with = "node")]
    pub data_dir: Option<PathBuf>,
    /// A live node's address (also prints its applied state's digest: replicas at the same
    /// applied index must print the same one).
    #[arg(long)]
    pub node: Option<String>,
    #[command(flatten)]
    pub tls: crate::process::TlsArgs,
}

pub async fn verify(a: VerifyArgs) -> anyhow::Result<()> {
    let report = match (a.data_dir, a.node) {
        (Some(dir), None) => {
            if !dir.exists() {
                bail!("{} does not exist", dir.display());
            }
            let r = tokenlog_raftlog::data_dir::verify(&dir)?;
            pb::VerifyResponse {
                generations: r.generations,
                records: r.records,
                problems: r.problems,
            }
        }
        (None, Some(addr)) => {
            let client = LogClient::with_tls(vec![addr.clone()], a.tls.load()?)?;
            let mut node = client.node(&addr);
            let d = node.state_digest(pb::StateDigestRequest {}).await?.into_inner();
            // Replicas at the same applied index must print the same digest.
            say!(
                "state digest at applied index {}: {}",
                d.applied_index,
                d.digest.iter().map(|b| format!("{b:02x}")).collect::<String>()
            );
            node.verify(pb::VerifyRequest {}).await?.into_inner()
        }
        _ => bail!("give --data-dir DIR or --node HOST:PORT"),
    };
    say!("checked {} generations, {} records", report.generations, report.records);
    for p in &report.problems {
        say!("BROKEN {p}");
    }
    if !report.problems.is_empty() {
        bail!("{} broken chain(s)", report.problems.len());
    }
    say!("every chain intact");
    Ok(())
}

#[derive(clap::Args)]
pub struct MembersArgs {
    #[command(subcommand)]
    pub op: MembersOp,
    /// Addresses of any nodes (comma-separated).
    #[arg(long, global = true, value_delimiter = ',', default_value = "127.0.0.1:7001")]
    pub cluster: Vec<String>,
    #[command(flatten)]
    pub tls: crate::process::TlsArgs,
    /// `add` and `replace`: how long a new learner may go without catching up further (its
    /// matched log index unchanged) before the command gives up. It stays a learner then (not
    /// a voter: the quorum is unchanged); `members remove ID` takes it out.
    #[arg(long, global = true, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub stall_secs: u64,
}

#[derive(clap::Subcommand)]
pub enum MembersOp {
    /// Add a running (empty or lagging) node: it catches up as a learner, then becomes a voter.
    /// ADDR: `host:port`, or `host:port/host:peerport` for a node with --peer-listen.
    Add { id: u64, addr: String },
    /// Remove members: voters, or learners (a node added that never caught up).
    Remove { ids: Vec<u64> },
    /// Replace node OLD with a new node NEW at ADDR (add NEW, then remove OLD).
    Replace { old: u64, new: u64, addr: String },
}

/// Waits until learner `id` has replicated the log up to the commit index the leader had when
/// the wait began, printing its progress; gives up when its matched index does not move for
/// `stall`.
async fn caught_up(client: &LogClient, id: u64, addrs: &str, stall: Duration) -> anyhow::Result<()> {
    let mut target = None;
    let mut best = None;
    let mut moved = std::time::Instant::now();
    let mut told = std::time::Instant::now();
    loop {
        // Linearizable: the leader answers, and only it knows what a learner has matched.
        let st = client.cluster_status(true).await?;
        let target = *target.get_or_insert(st.commit_index);
        let matched = st.members.iter().find(|m| m.node_id == id).map(|m| m.matched_index);
        let Some(matched) = matched else {
            anyhow::bail!("node {id} is no member any more (removed meanwhile?)");
        };
        if matched >= target {
            eprintln!("node {id} has caught up (log index {matched})");
            return Ok(());
        }
        if best.is_none_or(|b| matched > b) {
            best = Some(matched);
            moved = std::time::Instant::now();
        }
        if moved.elapsed() >= stall {
            anyhow::bail!(
                "node {id} at {addrs} has not caught up: it matched log index {matched} of {target} and made no progress for {} s. \
                 Is it running, reachable there, and started without --peers? It was added as a learner and stays one (not a voter: \
                 the quorum is unchanged); `tokenlog members remove {id}` takes it out, or run this again once it runs",
                stall.as_secs()
            );
        }
        if told.elapsed() >= Duration::from_secs(5) {
            eprintln!("node {id} catching up: log index {matched} of {target}");
            told = std::time::Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub async fn members(a: MembersArgs) -> anyhow::Result<()> {
    use pb::change_membership_request::Op;
    let stall_secs = a.stall_secs;
    let client = LogClient::with_tls(a.cluster, a.tls.load()?)?;
    let change = |op| pb::ChangeMembershipRequest { op: Some(op) };
    let add = |id, addrs: String| {
        let client = client.clone();
        async move {
            let (addr, peer_addr) = addrs.split_once('/').unwrap_or((&addrs, ""));
            if addr.is_empty() || addr.contains(' ') || peer_addr.contains(' ') {
                anyhow::bail!("{addrs:?} is not host:port or host:port/host:peerport");
            }
            eprintln!("adding node {id} at {addrs} as a learner");
            client
                .change_membership(change(Op::AddLearner(pb::MemberStatus {
                    node_id: id,
                    addr: addr.to_string(),
                    peer_addr: peer_addr.to_string(),
                    voter: false,
                    matched_index: 0,
                })))
                .await?;
            caught_up(&client, id, &addrs, Duration::from_secs(stall_secs)).await?;
            eprintln!("promoting node {id} to voter");
            client
                .change_membership(change(Op::AddVoters(pb::AddVoters { node_ids: vec![id] })))
                .await?;
            anyhow::Ok(())
        }
    };
    match a.op {
        MembersOp::Add { id, addr } => add(id, addr).await?,
        MembersOp::Remove { ids } => {
            client
                .change_membership(change(Op::RemoveVoters(pb::RemoveVoters { node_ids: ids })))
                .await?;
        }
        MembersOp::Replace { old, new, addr } => {
            if old == new {
                // The add changes nothing (a member keeps its addresses), and the remove then
                // takes the node out of the cluster.
                anyhow::bail!(
                    "replace {old} {new}: the new node needs an id of its own (the remove would take node {old} out)"
                );
            }
            add(new, addr).await?;
            eprintln!("removing node {old}");
            client
                .change_membership(change(Op::RemoveVoters(pb::RemoveVoters { node_ids: vec![old] })))
                .await?;
        }
    }
    status(StatusArgs {
        cluster: client.addrs().to_vec(),
        tls: a.tls,
        json: false,
    })
    .await
}
