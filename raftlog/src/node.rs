//! A log node: RocksDB storage, the Raft instance, both gRPC services on one port, the leader's
//! clock stamping and housekeeping tick, and graceful shutdown.
//!
//! Write path, in order: a client's command reaches any node; a node that is not the leader
//! answers `NotLeader` with the leader's address (nothing proposed); on the leader the command
//! goes to the proposer, which merges the commands waiting at that moment into one entry
//! (`Command::Batch`, group commit at the proposal level), stamps it with the leader's clock
//! (`log_ms`, never below the last stamp) and proposes it; openraft appends it to the leader's
//! log (fsynced by the log store's flusher) and replicates it; once a quorum has it on disk it is
//! committed and applied (`SmStore::apply`, in memory: the log and the snapshots are what is
//! durable); only then does each command get its own answer, and only then can Watch show its
//! records.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex};

use crate::limits::SHUTDOWN_GRACE;
use openraft::async_runtime::WatchReceiver;
use openraft::error::{ChangeMembershipError, ClientWriteError, RaftError};
use openraft::{ChangeMembers, Config, ReadPolicy, ServerState, SnapshotPolicy};
use tokenlog_proto::raft::raft_transport_server::RaftTransportServer;
use tokenlog_proto::raftlog::log_server::LogServer;
use tokenlog_proto::raftlog::{ClusterStatusResponse, MemberStatus};
use tokio::sync::watch;

use crate::auth::Guarded;
use crate::clock::Clock;
use crate::error::LogError;
use crate::faults::Faults;
use crate::health::{Health, Readiness};
use crate::limits::{
    snapshot_due, COMMAND_BYTES_MAX, COMMIT_STALL_CREDIT, CUT_OFF_AFTER, GRPC_MESSAGE_BYTES_MAX, KEEPALIVE_INTERVAL,
    KEEPALIVE_TIMEOUT, PROPOSALS_IN_FLIGHT_MAX, PROPOSAL_COMMANDS_MAX, PROPOSAL_TOKENS_MAX, PROPOSER_QUEUE_MAX,
    RETENTION_MS_DEFAULT, RETENTION_MS_MIN, TICK_INTERVAL,
};
use crate::raft_types::{Node as RaftNode, NodeId, Raft};
use crate::service::LogService;
use crate::sm_store::SmShared;
use crate::tls::ClientTls;
use crate::transport::{Network, RaftService};
use crate::types::{Command, GenState, Request, Response};

#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub id: NodeId,
    /// Address to listen on for the client API (and for Raft traffic without `peer_listen`).
    pub listen: SocketAddr,
    /// Address clients use to reach this node (defaults to `listen`).
    pub advertise: String,
    /// A listener of its own for `raft.v1` (node-to-node traffic), so that a firewall can keep
    /// peers and clients apart; `None`: both on `listen`.
    pub peer_listen: Option<SocketAddr>,
    /// Address peers use to reach `peer_listen` (defaults to it).
    pub peer_advertise: String,
    pub data_dir: PathBuf,
    /// Initial voters, this node included (its own entry is replaced by its advertised
    /// addresses). The lowest id initializes the cluster if it has never been initialized.
    /// Empty: wait to be added (join).
    pub initial_members: Vec<(NodeId, RaftNode)>,
    pub heartbeat_ms: u64,
    pub election_timeout_ms: (u64, u64),
    /// Build a snapshot (and purge the log before it) every this many applied entries.
    pub snapshot_every: u64,
    /// Log entries kept behind the latest snapshot (the rest are purged).
    pub keep_after_snapshot: u64,
    pub retention_ms: u64,
    /// Planted bugs (fault suite builds only; none by default).
    pub faults: Faults,
    /// Added to this node's wall clock (the fault suite's `clock` nemesis moves it; `None`
    /// outside the suite).
    pub wall_skew_ms: Option<Arc<AtomicI64>>,
    /// TLS for the listener and for connections to peers; `None`: plain text, and every caller
    /// may call everything (`--insecure`). With TLS every call is checked against the caller's
    /// role ([`crate::auth`]).
    pub tls: ClientTls,
}

impl NodeConfig {
    pub fn new(id: NodeId, listen: SocketAddr, data_dir: PathBuf) -> Self {
        NodeConfig {
            id,
            listen,
            advertise: listen.to_string(),
            peer_listen: None,
            peer_advertise: String::new(),
            data_dir,
            initial_members: vec![],
            heartbeat_ms: 100,
            election_timeout_ms: (500, 1000),
            snapshot_every: 20_000,
            keep_after_snapshot: 1_000,
            retention_ms: RETENTION_MS_DEFAULT,
            faults: Faults::default(),
            wall_skew_ms: None,
            tls: None,
        }
    }
}

type WriteResult = Result<(Response, u64), LogError>;

/// A command waiting for the proposer, and where its answer goes.
struct Pending {
    cmd: Command,
    /// Tokens the command carries (`NodeMetrics::tokens_of`), counted once.
    tokens: u64,
    /// Its encoded size (checked against `COMMAND_BYTES_MAX` before it was queued).
    bytes: u64,
    answer: tokio::sync::oneshot::Sender<WriteResult>,
}

/// A command queued by [`NodeCtx::propose`].
pub struct Proposed {
    ctx: Arc<NodeCtx>,
    rx: tokio::sync::oneshot::Receiver<WriteResult>,
    tokens: u64,
    started: std::time::Instant,
}

impl Proposed {
    /// Waits until the command is committed and applied: its answer and its entry's log index.
    pub async fn answer(self) -> WriteResult {
        let (response, index) = self
            .rx
            .await
            .map_err(|_| LogError::Raft("the node is shutting down".into()))??;
        self.ctx
            .metrics
            .observe_write(self.tokens, self.started.elapsed().as_secs_f64(), &response);
        Ok((response, index))
    }
}

/// What the services of a node share.
pub struct NodeCtx {
    pub id: NodeId,
    pub addr: String,
    pub raft: Raft,
    pub sm: Arc<SmShared>,
    clock: Arc<Clock>,
    /// To the proposer task, which merges concurrent commands into one entry.
    proposals: tokio::sync::mpsc::Sender<Pending>,
    pub metrics: crate::metrics::NodeMetrics,
    /// Planted bugs (fault suite builds only).
    pub faults: Faults,
    /// Planted bug `early_visibility` only: the records of appends proposed through this node,
    /// per generation `(start_seq, [(token, epoch)])`, which Watch then shows before they are
    /// committed.
    #[cfg(feature = "faults")]
    pub proposed: Mutex<std::collections::HashMap<u64, ProposedRecords>>,
    /// Since when this node has had no quorum behind it as far as its Raft metrics tell
    /// ([`track_quorum`]); `None` while it has one.
    no_quorum_since: Arc<Mutex<Option<tokio::time::Instant>>>,
}

/// Planted bug only: the `(start_seq, [(token, epoch)])` of a generation's last proposed append.
#[cfg(feature = "faults")]
pub type ProposedRecords = (u32, Vec<(u32, u64)>);

fn raft_err<E: std::fmt::Display>(e: RaftError<crate::raft_types::TypeConfig, E>) -> LogError {
    LogError::Raft(e.to_string())
}

impl NodeCtx {
    fn stamp(&self) -> u64 {
        self.clock.stamp(self.sm.log_ms())
    }

    /// Ready to serve: Raft runs, a leader is known, and this node has applied everything it
    /// learned was committed (a node catching up after a restart or a partition is not ready:
    /// its reads would be stale).
    pub fn readiness(&self) -> Result<(), String> {
        let m = self.raft.metrics();
        let m = m.borrow_watched();
        if let Err(e) = &m.running_state {
            return Err(format!("Raft stopped: {e}"));
        }
        if m.current_leader.is_none() {
            return Err(format!("no leader known (term {})", m.current_term));
        }
        let committed = m.cluster_committed.map_or(0, |l| l.index);
        let applied = m.last_applied.map_or(0, |l| l.index);
        if applied < committed {
            return Err(format!(
                "applied {applied} of the {committed} entries it knows are committed"
            ));
        }
        Ok(())
    }

    /// Why this node is cut off from the cluster's quorum, when it has been for longer than
    /// [`CUT_OFF_AFTER`]: a leader that no quorum has acknowledged for that long, or a node that
    /// has known no leader for that long. `None` while it is not.
    pub fn cut_off(&self) -> Option<String> {
        let m = self.raft.metrics();
        let m = m.borrow_watched();
        if leads_alone(&m) {
            // Its own quorum: nobody acknowledges it, and it needs nobody (`tokenlog dev`).
            return None;
        }
        let now = tokio::time::Instant::now();
        let (quiet, what) = match (&m.state, &m.last_quorum_acked) {
            (ServerState::Leader, Some(acked)) => (
                openraft::Instant::elapsed(&**acked),
                "it leads, and no quorum has acknowledged it",
            ),
            _ => {
                let since = (*self.no_quorum_since.lock().expect("lock"))?;
                (now.saturating_duration_since(since), "it has known no leader")
            }
        };
        (quiet > CUT_OFF_AFTER).then(|| {
            format!(
                "node {} is cut off from the cluster's quorum ({what} for {} ms, term {}): what it has applied no longer advances; ask another node",
                self.id,
                quiet.as_millis(),
                m.current_term
            )
        })
    }

    /// This node's estimate of log time now (a hint: see [`Clock::now`]).
    pub fn log_time_estimate(&self) -> u64 {
        self.clock.now(self.sm.log_ms())
    }

    /// Proposes `cmd` and waits until it is committed and applied. Returns the answer and the
    /// entry's log index.
    pub async fn write(self: &Arc<Self>, cmd: Command) -> Result<(Response, u64), LogError> {
        self.propose(cmd).await?.answer().await
    }

    /// Queues `cmd` for the proposer and returns once it is queued, not committed: commands
    /// queued one after another by one caller enter Raft in that order. The answer comes from
    /// [`Proposed::answer`].
    pub async fn propose(self: &Arc<Self>, cmd: Command) -> Result<Proposed, LogError> {
        // Refused before it is in the log: an entry too large to replicate would hold up every
        // write after it (see `COMMAND_BYTES_MAX`).
        let bytes = crate::state::precheck_sized(&cmd).map_err(LogError::Rejected)?;
        let tokens = crate::metrics::NodeMetrics::tokens_of(&cmd);
        #[cfg(feature = "faults")]
        if self.faults.early_visibility() {
            if let Command::Append { items, .. } = &cmd {
                let mut p = self.proposed.lock().expect("lock");
                for i in items {
                    let recs = i.token_ids.iter().map(|&t| (t, i.epoch)).collect();
                    p.insert(i.generation, (i.start_seq, recs));
                }
            }
        }
        let started = std::time::Instant::now();
        let (answer, rx) = tokio::sync::oneshot::channel();
        self.proposals
            .send(Pending {
                cmd,
                tokens,
                bytes,
                answer,
            })
            .await
            .map_err(|_| LogError::Raft("the node is shutting down".into()))?;
        Ok(Proposed {
            ctx: self.clone(),
            rx,
            tokens,
            started,
        })
    }

    /// `Ok` when this node is the leader, else `NotLeader` with the leader's address if known
    /// (for streams, which cannot be redirected once open).
    pub fn check_leader(&self) -> Result<(), LogError> {
        if self.raft.metrics().borrow_watched().state == ServerState::Leader {
            return Ok(());
        }
        Err(LogError::NotLeader {
            leader_addr: self.leader_addr(),
        })
    }

    /// Resolves when this node is not (or no longer) the leader, or its Raft stopped.
    pub async fn until_not_leader(&self) {
        let mut m = self.raft.metrics();
        loop {
            if m.borrow_watched().state != ServerState::Leader {
                return;
            }
            if m.changed().await.is_err() {
                return;
            }
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
        let takeovers = self.sm.read().index.takeovers();
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
            let by: BTreeMap<String, u64> = GenState::ALL
                .iter()
                .map(|st| (st.name().to_string(), s.index.count(*st)))
                .filter(|(_, n)| *n > 0)
                .collect();
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
                    peer_addr: n.peer().to_string(),
                    voter: voters.contains(id),
                    matched_index: matched.get(id).cloned().flatten().map_or(0, |l| l.index),
                })
                .collect(),
            generations_by_state: by_state.into_iter().collect(),
            log_ms,
            state: format!("{:?}", m.state),
        }
    }

    /// Adds node `id` at `node`'s addresses as a learner: returns once that membership is
    /// committed, without waiting for the learner to catch up (it waited, without a limit: a
    /// learner at a wrong or dead address held the call until the client gave up, with the
    /// learner added all the same). The caller follows its catch-up in `ClusterStatus` (its
    /// `matched_index`; `tokenlog members add` does). A member of that id at other addresses
    /// is refused: openraft keeps a member's addresses as they
    /// are, so the call succeeded and changed nothing (and a replace of a node by itself then
    /// removed it). At the same addresses it is a retry, and succeeds.
    pub async fn add_learner(&self, id: NodeId, node: RaftNode) -> Result<(), LogError> {
        let held = self
            .raft
            .metrics()
            .borrow_watched()
            .membership_config
            .get_node(&id)
            .cloned();
        if let Some(held) = held.filter(|h| *h != node) {
            return Err(LogError::Invalid(format!(
                "node {id} is already a member at {held}: remove it before adding it at {node}, or add the new node under a new id"
            )));
        }
        self.raft
            .add_learner(id, node, false)
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
            // A voter leaves the membership; so does a learner (one that never caught up, at a
            // wrong address: there was no way to take it out); an id that is neither is refused
            // (it was a success that changed nothing).
            let membership = self.raft.metrics().borrow_watched().membership_config.clone();
            let config = membership.membership();
            let voters: BTreeSet<NodeId> = config.voter_ids().collect();
            let strangers: Vec<NodeId> = remove
                .iter()
                .copied()
                .filter(|id| config.get_node(id).is_none())
                .collect();
            if !strangers.is_empty() {
                let members: Vec<String> = config.nodes().map(|(id, _)| id.to_string()).collect();
                return Err(LogError::Invalid(format!(
                    "node(s) {strangers:?} are not members (members: {})",
                    members.join(", ")
                )));
            }
            let (leaving_voters, learners): (BTreeSet<NodeId>, BTreeSet<NodeId>) =
                remove.into_iter().partition(|id| voters.contains(id));
            if !leaving_voters.is_empty() {
                self.raft
                    .change_membership(ChangeMembers::RemoveVoters(leaving_voters), false)
                    .await
                    .map_err(membership_err)?;
            }
            if !learners.is_empty() {
                self.raft
                    .change_membership(ChangeMembers::RemoveNodes(learners), false)
                    .await
                    .map_err(membership_err)?;
            }
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
        // A change that cannot be made as asked (a voter that is not a learner yet, no voter
        // left, ...): retrying it cannot help. It was UNAVAILABLE, which a client retries for
        // its whole budget. A change in progress, or a leader not ready, is worth a retry.
        RaftError::APIError(ClientWriteError::ChangeMembershipError(e))
            if !matches!(
                e,
                ChangeMembershipError::InProgress(_) | ChangeMembershipError::UncommittedLeaderLog(_)
            ) =>
        {
            LogError::Invalid(format!("membership change refused: {e}"))
        }
        e => raft_err(e),
    }
}

/// The proposer: group commit at the proposal level. At most `PROPOSALS_IN_FLIGHT_MAX` entries
/// are proposed and not yet applied; while that many are in flight, commands queue, and the next
/// proposal takes every command waiting (up to `PROPOSAL_COMMANDS_MAX` commands and
/// `PROPOSAL_TOKENS_MAX` tokens) as one `Batch` entry. Under light load a command is proposed
/// alone at once; under heavy load many decoders' appends share one entry, one stamp, one apply
/// call. Proposals enter Raft in arrival order (queued with `client_write_ff`); their answers are
/// awaited on separate tasks.
async fn proposer(
    raft: Raft,
    clock: Arc<Clock>,
    applied: Arc<SmShared>,
    proposals: prometheus_client::metrics::counter::Counter,
    mut rx: tokio::sync::mpsc::Receiver<Pending>,
) {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(PROPOSALS_IN_FLIGHT_MAX));
    // When each proposal not yet answered was proposed, by proposal number: the oldest says
    // whether the log has stalled (a quiet log has none).
    let waiting: Arc<std::sync::Mutex<BTreeMap<u64, std::time::Instant>>> = Default::default();
    let mut proposal_no = 0u64;
    // When the last proposal was answered; and whether one was answered after nothing had
    // been for `COMMIT_STALL_CREDIT` while proposals waited (a stall ended): the next entry
    // then credits the rest of the stall, up to its stamp.
    let last_answer = Arc::new(std::sync::Mutex::new(std::time::Instant::now()));
    let stall_ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The term whose `NewLeader` this node proposed last (see `Command::NewLeader`).
    let mut announced_term = None;
    // A command taken from the queue that would have made the entry too large: the next
    // entry's first.
    let mut carried: Option<Pending> = None;
    loop {
        let first = match carried.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => break,
            },
        };
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let (mut tokens, mut bytes) = (first.tokens, first.bytes);
        let mut batch = vec![first];
        while batch.len() < PROPOSAL_COMMANDS_MAX && tokens < PROPOSAL_TOKENS_MAX {
            match rx.try_recv() {
                Ok(p) if bytes + p.bytes > COMMAND_BYTES_MAX => {
                    carried = Some(p);
                    break;
                }
                Ok(p) => {
                    tokens += p.tokens;
                    bytes += p.bytes;
                    batch.push(p);
                }
                Err(_) => break,
            }
        }
        let term = {
            let m = raft.metrics();
            let m = m.borrow_watched();
            (m.state == ServerState::Leader).then_some(m.current_term)
        };
        // A leader's first proposal in its term starts with `NewLeader`, applied before anything
        // else of the term can be fenced by a lease the election expired.
        let announce = term.is_some() && term != announced_term;
        if announce {
            clock.lead_anew();
        }
        // Only a leader stamps. A node that has applied nothing yet (just restarted) would
        // anchor its clock to its own wall clock by stamping, and lead later that far ahead
        // (found by the simulation); what a follower proposes is refused anyway, and apply
        // never moves log time back, so it carries the applied time.
        let applied_ms = applied.log_ms();
        let log_ms = match term {
            Some(_) => clock.stamp(applied_ms),
            None => applied_ms,
        };
        // A proposal of this leader has waited for its commit for a while (its followers gone
        // and back without an election, a stalled disk): nobody could renew a lease meanwhile,
        // so that time is credited to the live leases as an election's is (`NewLeader` credits
        // the log time between the entry before it and its own). Without it the first entry
        // stamped after such a stall (a renewal, or the Tick it made due) expired every lease
        // shorter than the stall.
        // A stall, not a slow log: nothing answered for that long while a proposal waited as
        // long (a log that commits slowly but steadily gets no credit: its renewals commit).
        let oldest = waiting
            .lock()
            .expect("lock")
            .first_key_value()
            .map(|(_, t)| t.elapsed());
        let quiet = last_answer.lock().expect("lock").elapsed();
        let stalled = term.is_some()
            && (oldest.is_some_and(|w| w >= COMMIT_STALL_CREDIT && quiet >= COMMIT_STALL_CREDIT)
                || stall_ended.swap(false, std::sync::atomic::Ordering::AcqRel));
        let lead = announce || stalled;
        if stalled && !announce {
            tracing::warn!(
                waited_ms = oldest.unwrap_or_default().as_millis() as u64,
                behind_ms = log_ms.saturating_sub(applied_ms),
                "a proposal waits for its commit: crediting the time to live leases"
            );
        }
        let (cmd, answers): (Command, Vec<_>) = if batch.len() == 1 && !lead {
            let p = batch.pop().expect("one");
            (p.cmd, vec![p.answer])
        } else {
            let (mut cmds, answers): (Vec<_>, Vec<_>) = batch.into_iter().map(|p| (p.cmd, p.answer)).unzip();
            if lead {
                cmds.insert(0, Command::NewLeader);
            }
            (Command::Batch(cmds), answers)
        };
        let req = Request::new(log_ms, cmd);
        proposals.inc();
        let (responder, result) = openraft::impls::ProgressResponder::complete_only();
        if let Err(e) = raft.client_write_ff(req, Some(responder)).await {
            let msg = e.to_string();
            for a in answers {
                let _ = a.send(Err(LogError::Raft(msg.clone())));
            }
            continue;
        }
        if announce {
            announced_term = term;
        }
        let no = proposal_no;
        proposal_no += 1;
        waiting.lock().expect("lock").insert(no, std::time::Instant::now());
        let (waiting, stall_ended, last_answer) = (waiting.clone(), stall_ended.clone(), last_answer.clone());
        tokio::spawn(async move {
            let result = result.await;
            let since = waiting.lock().expect("lock").remove(&no);
            let quiet = std::mem::replace(&mut *last_answer.lock().expect("lock"), std::time::Instant::now()).elapsed();
            if since.is_some_and(|t| t.elapsed() >= COMMIT_STALL_CREDIT) && quiet >= COMMIT_STALL_CREDIT {
                stall_ended.store(true, std::sync::atomic::Ordering::Release);
            }
            let outcome = match result {
                Err(_) => Err(LogError::Raft("raft stopped before answering".into())),
                Ok(Err(ClientWriteError::ForwardToLeader(f))) => Err(LogError::NotLeader {
                    leader_addr: f.leader_node.map(|n| n.addr),
                }),
                Ok(Err(e)) => Err(LogError::Raft(e.to_string())),
                Ok(Ok(resp)) => Ok((resp.response().clone(), resp.log_id().index)),
            };
            // The announcement's own answer goes to nobody.
            let outcome = match outcome {
                Ok((Response::Batch(mut parts), index)) if lead => {
                    parts.remove(0);
                    match parts.len() {
                        1 => Ok((parts.pop().expect("one"), index)),
                        _ => Ok((Response::Batch(parts), index)),
                    }
                }
                o => o,
            };
            answer_all(answers, outcome);
            drop(permit);
        });
    }
}

/// Hands each waiting command its answer: the entry's own, or its part of a batch's.
fn answer_all(answers: Vec<tokio::sync::oneshot::Sender<WriteResult>>, outcome: WriteResult) {
    match outcome {
        Err(e) => {
            let again = |e: &LogError| match e {
                LogError::NotLeader { leader_addr } => LogError::NotLeader {
                    leader_addr: leader_addr.clone(),
                },
                e => LogError::Raft(e.to_string()),
            };
            for a in answers {
                let _ = a.send(Err(again(&e)));
            }
        }
        Ok((Response::Batch(parts), index)) if parts.len() == answers.len() && answers.len() > 1 => {
            for (a, r) in answers.into_iter().zip(parts) {
                let _ = a.send(Ok((r, index)));
            }
        }
        Ok((r, index)) if answers.len() == 1 => {
            let a = answers.into_iter().next().expect("one");
            let _ = a.send(Ok((r, index)));
        }
        Ok((r, _)) => {
            for a in answers {
                let _ = a.send(Err(LogError::Internal(format!(
                    "a batch entry answered {r:?}, not one answer per command"
                ))));
            }
        }
    }
}

/// A running node. Dropping it does not stop it: call [`RunningNode::shutdown`].
pub struct RunningNode {
    pub ctx: Arc<NodeCtx>,
    /// Its readiness, also served as `grpc.health.v1` on the client listener.
    pub health: Health,
    /// The client API's listener (and Raft's, without a peer listener).
    pub local_addr: SocketAddr,
    /// The peer listener (`raft.v1`), when it has its own.
    pub peer_local_addr: Option<SocketAddr>,
    stop_tx: watch::Sender<bool>,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

/// Keeps `since` at the moment this node last lost its quorum as its Raft metrics tell it: a
/// node that knows a leader, or a leader a quorum acknowledged, has one; a node without a
/// leader (a candidate, a follower whose leader went), or a leader not yet acknowledged, does
/// not. How long a leader has gone without acknowledgments since is read from its metrics at
/// the time ([`NodeCtx::cut_off`]).
async fn track_quorum(raft: Raft, since: Arc<Mutex<Option<tokio::time::Instant>>>) {
    let mut m = raft.metrics();
    loop {
        let has = {
            let m = m.borrow_watched();
            match m.state {
                ServerState::Leader => m.last_quorum_acked.is_some() || leads_alone(&m),
                _ => m.current_leader.is_some(),
            }
        };
        {
            let mut s = since.lock().expect("lock");
            if has {
                *s = None;
            } else if s.is_none() {
                *s = Some(tokio::time::Instant::now());
            }
        }
        if m.changed().await.is_err() {
            return;
        }
    }
}

/// Whether this node leads a cluster whose only voter it is (a quorum of one: no acknowledgment
/// ever comes, and none is needed).
fn leads_alone(m: &openraft::RaftMetrics<crate::raft_types::TypeConfig>) -> bool {
    m.state == ServerState::Leader && m.membership_config.membership().voter_ids().eq([m.id])
}

impl RunningNode {
    /// Resolves, with the reason, when Raft stopped on its own: a fatal storage error (a full
    /// disk, a failed write or fsync). Such a node no longer commits or applies, while its
    /// services would go on answering reads from a state that no longer advances (a client
    /// told "not found" for a generation every other node holds: found by the fault suite's
    /// `disk-full` nemesis). Its process must end instead; a supervisor restarts it, and the
    /// restart checks the data dir again.
    pub async fn failed(&self) -> String {
        let mut m = self.ctx.raft.metrics();
        loop {
            let fatal = m.borrow_watched().running_state.as_ref().err().map(|e| e.to_string());
            if let Some(reason) = fatal {
                return reason;
            }
            if m.changed().await.is_err() {
                return "the Raft core stopped".into();
            }
        }
    }

    /// Stops serving, then stops Raft (which flushes what it has).
    /// Open streams (a Watch of a generation that no longer advances) get `SHUTDOWN_GRACE`
    /// to end; then the server is stopped anyway.
    pub async fn shutdown(mut self) {
        let _ = self.stop_tx.send(true);
        if tokio::time::timeout(SHUTDOWN_GRACE, &mut self.server).await.is_err() {
            self.server.abort();
        }
        let _ = self.ctx.raft.shutdown().await;
    }
}

pub fn raft_config(cfg: &NodeConfig) -> Result<Arc<Config>, LogError> {
    if cfg.retention_ms < RETENTION_MS_MIN {
        return Err(LogError::Invalid(format!(
            "retention {} ms is below the minimum {RETENTION_MS_MIN} ms: a client that reconnects \
             right after its generation finished must still find it",
            cfg.retention_ms
        )));
    }
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
        // A leader that restarts must win a new election, never resume its old term: it sends
        // entries to followers before its own fsync, so a power cut can cost it a tail that
        // followers hold, and resuming the term it would write different entries under the
        // same log ids, which Raft never repairs (replicas diverge for ever). openraft's
        // default restores leadership; the simulation found the divergence
        // (`jepsen-style-tests sim --core openraft`, seed 51: two entries with log id T1-N0/211).
        enable_leader_restore: Some(false),
        ..Default::default()
    };
    config
        .validate()
        .map(Arc::new)
        .map_err(|e| LogError::Invalid(format!("raft config: {e}")))
}

/// Opens storage, starts Raft and serves both gRPC services on `cfg.listen`.
pub async fn start(cfg: NodeConfig) -> Result<RunningNode, LogError> {
    #[cfg(feature = "faults")]
    if !cfg.faults.names().is_empty() {
        tracing::error!(faults = ?cfg.faults.names(), "PLANTED BUGS are on: test use only");
    }
    let (raft, shared) = open_raft(&cfg).await?;
    let (listener, local_addr) = bind(cfg.listen).await?;
    let advertise = if cfg.listen.port() == 0 {
        local_addr.to_string()
    } else {
        cfg.advertise.clone()
    };
    let (peer_listener, peer_advertise) = match cfg.peer_listen {
        None => (None, String::new()),
        Some(addr) => {
            let (l, local) = bind(addr).await?;
            let adv = if addr.port() == 0 || cfg.peer_advertise.is_empty() {
                local.to_string()
            } else {
                cfg.peer_advertise.clone()
            };
            (Some((l, local)), adv)
        }
    };
    let me = RaftNode::new(advertise.clone(), peer_advertise);
    let peer_local_addr = peer_listener.as_ref().map(|(_, a)| *a);
    let source = Arc::new(crate::clock::SystemTimeSource::new(cfg.wall_skew_ms.clone()));
    let clock = Arc::new(Clock::new(source, cfg.faults.unbounded_clock()));
    let (proposals, proposals_rx) = tokio::sync::mpsc::channel(PROPOSER_QUEUE_MAX);
    let metrics = crate::metrics::NodeMetrics::default();
    tokio::spawn(proposer(
        raft.clone(),
        clock.clone(),
        shared.clone(),
        metrics.proposals.clone(),
        proposals_rx,
    ));
    let ctx = Arc::new(NodeCtx {
        id: cfg.id,
        addr: advertise.clone(),
        raft: raft.clone(),
        sm: shared,
        clock,
        proposals,
        metrics,
        faults: cfg.faults,
        #[cfg(feature = "faults")]
        proposed: Default::default(),
        no_quorum_since: Arc::new(Mutex::new(Some(tokio::time::Instant::now()))),
    });
    tokio::spawn(track_quorum(raft.clone(), ctx.no_quorum_since.clone()));
    let (stop_tx, stop_rx) = watch::channel(false);
    let health = {
        let ctx = Arc::downgrade(&ctx);
        let ready: Readiness = Arc::new(move || match ctx.upgrade() {
            Some(ctx) => ctx.readiness(),
            None => Err("the node has stopped".into()),
        });
        let mut stop = stop_rx.clone();
        Health::follow(ready, async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await
    };
    let server = serve(
        listener,
        peer_listener.map(|(l, _)| l),
        &ctx,
        &health,
        &cfg.tls,
        stop_rx.clone(),
    )?;
    initialize_if_first(&cfg, &raft, &me).await?;
    spawn_ticker(ctx.clone(), cfg.retention_ms, stop_rx);
    tracing::info!(id = cfg.id, node = %me, "node serving");
    Ok(RunningNode {
        ctx,
        health,
        local_addr,
        peer_local_addr,
        stop_tx,
        server,
    })
}

/// Opens the data dir (refusing one that fails its integrity checks) and Raft.
async fn open_raft(cfg: &NodeConfig) -> Result<(Raft, Arc<SmShared>), LogError> {
    let storage = crate::data_dir::open(&cfg.data_dir, cfg.faults)?;
    let shared = storage.sm.shared();
    let network = Network::new(cfg.id, cfg.tls.clone());
    let raft = Raft::new(cfg.id, raft_config(cfg)?, network, storage.log, storage.sm)
        .await
        .map_err(raft_err_fatal)?;
    Ok((raft, shared))
}

async fn bind(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr), LogError> {
    let listen_err = |source| LogError::Listen { addr, source };
    let l = tokio::net::TcpListener::bind(addr).await.map_err(listen_err)?;
    let local = l.local_addr().map_err(listen_err)?;
    Ok((l, local))
}

/// Serves `raftlog.v1` on `listener`, and `raft.v1` on `peer_listener` (or on `listener` too
/// without one), until `stop` turns true; under TLS, each call only if the caller's role allows
/// it.
fn serve(
    listener: tokio::net::TcpListener,
    peer_listener: Option<tokio::net::TcpListener>,
    ctx: &Arc<NodeCtx>,
    health: &Health,
    tls: &ClientTls,
    stop: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>, LogError> {
    // Accepted connections need TCP_NODELAY too: without it small Raft messages meet delayed
    // ACKs and every commit waits ~40 ms.
    let incoming = |l| tonic::transport::server::TcpIncoming::from(l).with_nodelay(Some(true));
    let log_svc = LogServer::new(LogService::new(ctx.clone()))
        .max_decoding_message_size(GRPC_MESSAGE_BYTES_MAX)
        .max_encoding_message_size(GRPC_MESSAGE_BYTES_MAX);
    let raft_svc = RaftTransportServer::new(RaftService::new(ctx.raft.clone(), ctx.sm.clone()))
        .max_decoding_message_size(GRPC_MESSAGE_BYTES_MAX)
        .max_encoding_message_size(GRPC_MESSAGE_BYTES_MAX);
    let builder = || -> Result<tonic::transport::Server, LogError> {
        let b = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
            .tcp_keepalive(Some(KEEPALIVE_INTERVAL));
        let Some(tls) = tls else { return Ok(b) };
        let config = tls.server_config().map_err(|e| LogError::Tls(e.to_string()))?;
        b.tls_config(config).map_err(|e| LogError::Tls(e.to_string()))
    };
    let enforce = tls.is_some();
    let stopped = |mut stop: watch::Receiver<bool>| async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let log_svc = Guarded::new(log_svc, enforce);
    let raft_svc = Guarded::new(raft_svc, enforce);
    let health_svc = Guarded::new(health.service(), enforce);
    Ok(match peer_listener {
        None => tokio::spawn(
            builder()?
                .add_service(log_svc)
                .add_service(raft_svc)
                .add_service(health_svc)
                .serve_with_incoming_shutdown(incoming(listener), stopped(stop)),
        ),
        Some(peer_listener) => {
            let clients = builder()?
                .add_service(log_svc)
                .add_service(health_svc)
                .serve_with_incoming_shutdown(incoming(listener), stopped(stop.clone()));
            let peers = builder()?
                .add_service(raft_svc)
                .serve_with_incoming_shutdown(incoming(peer_listener), stopped(stop));
            tokio::spawn(async move {
                let (c, p) = tokio::join!(clients, peers);
                c.and(p)
            })
        }
    })
}

/// The lowest id of the initial members initializes a cluster that never was.
async fn initialize_if_first(cfg: &NodeConfig, raft: &Raft, me: &RaftNode) -> Result<(), LogError> {
    let Some(&(lowest, _)) = cfg.initial_members.iter().min_by_key(|(id, _)| *id) else {
        return Ok(());
    };
    if lowest != cfg.id || raft.is_initialized().await.map_err(raft_err_fatal)? {
        return Ok(());
    }
    let members: BTreeMap<NodeId, RaftNode> = cfg
        .initial_members
        .iter()
        .map(|(id, node)| (*id, if *id == cfg.id { me.clone() } else { node.clone() }))
        .collect();
    raft.initialize(members)
        .await
        .map_err(|e| LogError::Raft(e.to_string()))?;
    tracing::info!("cluster initialized");
    Ok(())
}

/// The leader's housekeeping: every `TICK_INTERVAL`, a `Tick` when one would change anything.
fn spawn_ticker(ctx: Arc<NodeCtx>, retention_ms: u64, mut stop: watch::Receiver<bool>) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(TICK_INTERVAL) => {}
            }
            // Every node: enough tokens since its last snapshot, and records leave memory.
            let tokens = ctx.sm.tokens_since_snapshot();
            let body_records = ctx.sm.body_records();
            if snapshot_due(tokens, body_records) && !ctx.sm.building() {
                tracing::info!(
                    tokens,
                    body_records,
                    "snapshot: enough tokens appended since the last one (limits::snapshot_due)"
                );
                if let Err(e) = ctx.raft.trigger().snapshot().await {
                    tracing::warn!(error = %e, "triggering a snapshot");
                }
            }
            let is_leader = ctx.raft.metrics().borrow_watched().state == ServerState::Leader;
            if is_leader && ctx.sm.read().tick_due(ctx.stamp(), retention_ms) {
                if let Err(e) = ctx.write(Command::Tick { retention_ms }).await {
                    tracing::debug!(error = %e, "tick not committed");
                }
            }
        }
    });
}

fn raft_err_fatal(e: impl std::fmt::Display) -> LogError {
    LogError::Raft(e.to_string())
}
