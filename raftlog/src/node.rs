//! A log node: RocksDB storage, the Raft instance, both gRPC services on one port, the leader's
//! clock stamping and housekeeping tick, and graceful shutdown.
//!
//! Write path, in order: a client's command reaches any node; a node that is not the leader
//! answers `NotLeader` with the leader's address (nothing proposed); the leader stamps it with its
//! clock (`log_ms`, never below the last stamp) and proposes it; openraft appends it to the
//! leader's log (fsynced by the log store's flusher) and replicates it; once a quorum has it on
//! disk it is committed and applied (`SmStore::apply`, which persists the changed rows and then
//! answers); only then does the client get its answer, and only then can Watch show its records.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use openraft::async_runtime::WatchReceiver;
use openraft::error::{ClientWriteError, RaftError};
use openraft::{ChangeMembers, Config, ReadPolicy, ServerState, SnapshotPolicy};
use tokenlog_proto::raft::raft_transport_server::RaftTransportServer;
use tokenlog_proto::raftlog::log_server::LogServer;
use tokenlog_proto::raftlog::{ClusterStatusResponse, MemberStatus};
use tokio::sync::watch;

use crate::error::LogError;
use crate::limits::{GRPC_MESSAGE_BYTES_MAX, RETENTION_MS_DEFAULT};
use crate::log_store::LogStore;
use crate::raft_types::{Node as RaftNode, NodeId, Raft};
use crate::service::LogService;
use crate::sm_store::{SmShared, SmStore};
use crate::transport::{Network, RaftService};
use crate::types::{Command, Request, Response};

/// How often the leader considers proposing a `Tick`.
const TICK_INTERVAL: Duration = Duration::from_millis(500);

#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub id: NodeId,
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Address peers and clients use to reach this node (defaults to `listen`).
    pub advertise: String,
    pub data_dir: PathBuf,
    /// Initial voters `(id, address)`, this node included. The lowest id initializes the
    /// cluster if it has never been initialized. Empty: wait to be added (join).
    pub initial_members: Vec<(NodeId, String)>,
    pub heartbeat_ms: u64,
    pub election_timeout_ms: (u64, u64),
    /// Build a snapshot (and purge the log before it) every this many applied entries.
    pub snapshot_every: u64,
    /// Log entries kept behind the latest snapshot (the rest are purged).
    pub keep_after_snapshot: u64,
    pub retention_ms: u64,
}

impl NodeConfig {
    pub fn new(id: NodeId, listen: SocketAddr, data_dir: PathBuf) -> Self {
        NodeConfig {
            id,
            listen,
            advertise: listen.to_string(),
            data_dir,
            initial_members: vec![],
            heartbeat_ms: 100,
            election_timeout_ms: (500, 1000),
            snapshot_every: 20_000,
            keep_after_snapshot: 1_000,
            retention_ms: RETENTION_MS_DEFAULT,
        }
    }
}

/// What the services of a node share.
pub struct NodeCtx {
    pub id: NodeId,
    pub addr: String,
    pub raft: Raft,
    pub sm: Arc<SmShared>,
    /// The last log time this node stamped; stamps never go backwards.
    last_stamp_ms: Mutex<u64>,
    pub metrics: crate::metrics::NodeMetrics,
    /// Planted bug only (`TOKENLOG_PLANT_EARLY_VISIBILITY=1`): the records of appends proposed
    /// through this node, per generation `(start_seq, [(token, epoch)])`, which Watch then
    /// shows before they are committed. Empty otherwise.
    pub proposed: Mutex<std::collections::HashMap<u64, (u32, Vec<(u32, u64)>)>>,
}

/// Planted bug for the fault suite (test-only): Watch shows records of proposed, uncommitted
/// appends. Set once at node start from `TOKENLOG_PLANT_EARLY_VISIBILITY=1`.
static PLANT_EARLY_VISIBILITY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn planted_early_visibility() -> bool {
    PLANT_EARLY_VISIBILITY.load(std::sync::atomic::Ordering::Relaxed)
}

pub(crate) fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn raft_err<E: std::fmt::Display>(e: RaftError<crate::raft_types::TypeConfig, E>) -> LogError {
    LogError::Raft(e.to_string())
}

impl NodeCtx {
    fn stamp(&self) -> u64 {
        let mut last = self.last_stamp_ms.lock().expect("lock");
        let applied = self.sm.read().log_ms;
        *last = (*last).max(wall_ms()).max(applied);
        *last
    }

    /// Proposes `cmd` and waits until it is committed and applied. Returns the answer and the
    /// entry's log index.
    pub async fn write(&self, cmd: Command) -> Result<(Response, u64), LogError> {
        let tokens = crate::metrics::NodeMetrics::tokens_of(&cmd);
        if planted_early_visibility() {
            if let Command::Append { items, .. } = &cmd {
                let mut p = self.proposed.lock().expect("lock");
                for i in items {
                    let recs = i.token_ids.iter().map(|&t| (t, i.epoch)).collect();
                    p.insert(i.generation, (i.start_seq, recs));
                }
            }
        }
        let req = Request {
            log_ms: self.stamp(),
            cmd,
        };
        let started = std::time::Instant::now();
        match self.raft.client_write(req).await {
            Ok(resp) => {
                self.metrics
                    .observe_write(tokens, started.elapsed().as_secs_f64(), resp.response());
                Ok((resp.response().clone(), resp.log_id().index))
            }
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => Err(LogError::NotLeader {
                leader_addr: f.leader_node.map(|n| n.addr),
            }),
            Err(e) => Err(raft_err(e)),
        }
    }

    /// Returns once this node's applied state includes every write committed before the call
    /// (read-index through the leader). Only the leader can do this; followers redirect.
    pub async fn linearize(&self) -> Result<(), LogError> {
        match self.raft.ensure_linearizable(ReadPolicy::ReadIndex).await {
            Ok(_) => Ok(()),
            Err(e) => match e.forward_to_leader() {
                Some(f) => Err(LogError::NotLeader {
                    leader_addr: f.leader_node.clone().map(|n| n.addr),
                }),
                None => Err(raft_err(e)),
            },
        }
    }

    /// This node's metrics in the Prometheus text format.
    pub fn render_metrics(&self) -> String {
        let st = self.status();
        let takeovers: u64 = self.sm.read().generations.values().map(|g| g.takeovers()).sum();
        let by_state: Vec<(String, u64)> = st.generations_by_state.into_iter().collect();
        self.metrics.render(
            &by_state,
            takeovers,
            st.term,
            st.commit_index,
            st.applied_index,
            st.leader_id == self.id,
        )
    }

    pub fn leader_addr(&self) -> Option<String> {
        let m = self.raft.metrics().borrow_watched().clone();
        let leader = m.current_leader?;
        m.membership_config.get_node(&leader).map(|n| n.addr.clone())
    }

    pub fn status(&self) -> ClusterStatusResponse {
        let m = self.raft.metrics().borrow_watched().clone();
        let members = m.membership_config.membership();
        let voters: BTreeSet<NodeId> = members.voter_ids().collect();
        let matched = m.replication.clone().unwrap_or_default();
        let (by_state, log_ms) = {
            let s = self.sm.read();
            let mut by: BTreeMap<String, u64> = BTreeMap::new();
            for g in s.generations.values() {
                *by.entry(g.state.name().to_string()).or_default() += 1;
            }
            (by, s.log_ms)
        };
        ClusterStatusResponse {
            node_id: self.id,
            leader_id: m.current_leader.unwrap_or(0),
            leader_addr: self.leader_addr().unwrap_or_default(),
            term: m.current_term,
            last_log_index: m.last_log_index.unwrap_or(0),
            commit_index: m.cluster_committed.map_or(0, |l| l.index),
            applied_index: m.last_applied.map_or(0, |l| l.index),
            snapshot_index: m.snapshot.map_or(0, |l| l.index),
            purged_index: m.purged.map_or(0, |l| l.index),
            members: members
                .nodes()
                .map(|(id, n)| MemberStatus {
                    node_id: *id,
                    addr: n.addr.clone(),
                    voter: voters.contains(id),
                    matched_index: matched.get(id).cloned().flatten().map_or(0, |l| l.index),
                })
                .collect(),
            generations_by_state: by_state.into_iter().collect(),
            log_ms,
            state: format!("{:?}", m.state),
        }
    }

    pub async fn add_learner(&self, id: NodeId, addr: String) -> Result<(), LogError> {
        self.raft
            .add_learner(id, RaftNode { addr }, true)
            .await
            .map(|_| ())
            .map_err(membership_err)
    }

    pub async fn change_voters(&self, add: BTreeSet<NodeId>, remove: BTreeSet<NodeId>) -> Result<(), LogError> {
        if !add.is_empty() {
            self.raft
                .change_membership(ChangeMembers::AddVoterIds(add), false)
                .await
                .map_err(membership_err)?;
        }
        if !remove.is_empty() {
            self.raft
                .change_membership(ChangeMembers::RemoveVoters(remove), false)
                .await
                .map_err(membership_err)?;
        }
        Ok(())
    }
}

fn membership_err(
    e: RaftError<crate::raft_types::TypeConfig, ClientWriteError<crate::raft_types::TypeConfig>>,
) -> LogError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => LogError::NotLeader {
            leader_addr: f.leader_node.map(|n| n.addr),
        },
        e => raft_err(e),
    }
}

/// A running node. Dropping it does not stop it: call [`RunningNode::shutdown`].
pub struct RunningNode {
    pub ctx: Arc<NodeCtx>,
    pub local_addr: SocketAddr,
    stop_tx: watch::Sender<bool>,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl RunningNode {
    /// Stops serving, then stops Raft (which flushes what it has).
    pub async fn shutdown(self) {
        let _ = self.stop_tx.send(true);
        let _ = self.server.await;
        let _ = self.ctx.raft.shutdown().await;
    }
}

fn raft_config(cfg: &NodeConfig) -> Result<Arc<Config>, LogError> {
    let config = Config {
        cluster_name: "tokenlog".into(),
        heartbeat_interval: cfg.heartbeat_ms,
        election_timeout_min: cfg.election_timeout_ms.0,
        election_timeout_max: cfg.election_timeout_ms.1,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(cfg.snapshot_every),
        max_in_snapshot_log_to_keep: cfg.keep_after_snapshot,
        // A follower that lost its data dir and rejoins under its old id has an empty log where
        // the leader remembers a match; without this the leader's replication panics (found by
        // the fault suite's wipe-node nemesis). The node catches up by snapshot. Caveat: it
        // also lost its vote, so the safe way to replace a disk is `tokenlog members replace`
        // with a new id; rejoining under the old id is tolerated, not recommended.
        allow_log_reversion: Some(true),
        ..Default::default()
    };
    config
        .validate()
        .map(Arc::new)
        .map_err(|e| LogError::Invalid(format!("raft config: {e}")))
}

/// Opens storage, starts Raft and serves both gRPC services on `cfg.listen`.
pub async fn start(cfg: NodeConfig) -> Result<RunningNode, LogError> {
    if std::env::var("TOKENLOG_PLANT_EARLY_VISIBILITY").is_ok_and(|v| v == "1") {
        tracing::error!(
            "PLANTED BUG: Watch shows uncommitted records (TOKENLOG_PLANT_EARLY_VISIBILITY=1); test use only"
        );
        PLANT_EARLY_VISIBILITY.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    if std::env::var("TOKENLOG_PLANT_NO_FENCE").is_ok_and(|v| v == "1") {
        tracing::error!("PLANTED BUG: appends skip the epoch fence (TOKENLOG_PLANT_NO_FENCE=1); test use only");
        crate::state::plant_no_fence(true);
    }
    std::fs::create_dir_all(&cfg.data_dir)
        .map_err(|e| LogError::Storage(format!("{}: {e}", cfg.data_dir.display())))?;
    let db = crate::db::open(&cfg.data_dir).map_err(|e| LogError::Storage(e.to_string()))?;
    let (sm, report) = SmStore::open(db.clone()).map_err(|e| LogError::Storage(e.to_string()))?;
    for p in &report.problems {
        tracing::error!(problem = %p, "integrity problem found while loading the state machine");
    }
    tracing::info!(
        generations = report.generations,
        records = report.records,
        "state machine loaded"
    );
    let shared = sm.shared();
    let network = Network::new(cfg.id);
    let raft = Raft::new(cfg.id, raft_config(&cfg)?, network, LogStore::new(db), sm)
        .await
        .map_err(raft_err_fatal)?;

    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| LogError::Storage(format!("bind {}: {e}", cfg.listen)))?;
    let local_addr = listener.local_addr().map_err(|e| LogError::Storage(e.to_string()))?;
    let advertise = if cfg.listen.port() == 0 {
        local_addr.to_string()
    } else {
        cfg.advertise.clone()
    };
    let ctx = Arc::new(NodeCtx {
        id: cfg.id,
        addr: advertise.clone(),
        raft: raft.clone(),
        sm: shared,
        last_stamp_ms: Mutex::new(0),
        metrics: Default::default(),
        proposed: Default::default(),
    });

    let (stop_tx, mut stop_rx) = watch::channel(false);
    // Accepted connections need TCP_NODELAY too: without it small Raft messages meet delayed
    // ACKs and every commit waits ~40 ms.
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let log_svc = LogServer::new(LogService::new(ctx.clone()))
        .max_decoding_message_size(GRPC_MESSAGE_BYTES_MAX)
        .max_encoding_message_size(GRPC_MESSAGE_BYTES_MAX);
    let raft_svc = RaftTransportServer::new(RaftService::new(raft.clone()))
        .max_decoding_message_size(GRPC_MESSAGE_BYTES_MAX)
        .max_encoding_message_size(GRPC_MESSAGE_BYTES_MAX);
    let mut shutdown_rx = stop_rx.clone();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(log_svc)
            .add_service(raft_svc)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = shutdown_rx.wait_for(|s| *s).await;
            }),
    );

    if let Some(&(lowest, _)) = cfg.initial_members.iter().min_by_key(|(id, _)| *id) {
        if lowest == cfg.id && !raft.is_initialized().await.map_err(raft_err_fatal)? {
            let members: BTreeMap<NodeId, RaftNode> = cfg
                .initial_members
                .iter()
                .map(|(id, addr)| {
                    (
                        *id,
                        RaftNode {
                            addr: if *id == cfg.id { advertise.clone() } else { addr.clone() },
                        },
                    )
                })
                .collect();
            raft.initialize(members)
                .await
                .map_err(|e| LogError::Raft(e.to_string()))?;
            tracing::info!("cluster initialized");
        }
    }

    let tick_ctx = ctx.clone();
    let retention_ms = cfg.retention_ms;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop_rx.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(TICK_INTERVAL) => {}
            }
            let is_leader = tick_ctx.raft.metrics().borrow_watched().state == ServerState::Leader;
            if is_leader && tick_ctx.sm.read().tick_due(tick_ctx.stamp(), retention_ms) {
                if let Err(e) = tick_ctx.write(Command::Tick { retention_ms }).await {
                    tracing::debug!(error = %e, "tick not committed");
                }
            }
        }
    });
    tracing::info!(id = cfg.id, addr = %advertise, "node serving");
    Ok(RunningNode {
        ctx,
        local_addr,
        stop_tx,
        server,
    })
}

fn raft_err_fatal(e: impl std::fmt::Display) -> LogError {
    LogError::Raft(e.to_string())
}
