//! The simulation's second log (issue 13, stage 2): the real openraft core, three nodes in one
//! thread on simulated time, behind the same workload, faults and checkers as the stand-in Raft
//! of [`crate::sim`] (`sim --core openraft`).
//!
//! What runs here is production code: openraft's `Raft` (elections, replication, commit,
//! snapshots, log reversion) with the production Raft configuration (`node::raft_config`), and
//! each node's state machine step [`Machine::apply_entry`]. What is simulated:
//! - **Time and scheduling**: a current-thread tokio runtime on a paused clock (`test-util`):
//!   time moves only when every task waits, to the next timer. openraft's own randomness
//!   (election timeouts) comes from `DeterministicRng`, seeded from the seed; its selects are
//!   biased. So a seed replays bit for bit.
//! - **The disk** ([`Disk`]): what a read sees, and the part an fsync made durable. Appends are
//!   acknowledged (`IOFlushed`) by one fsync task per node, in order, 1-8 ms later; the vote,
//!   truncations and purges are synced at once, as the RocksDB store does. A crash keeps the
//!   synced part and a random prefix of what was written after it (a torn tail: some writes
//!   reached the platter, the rest did not). Snapshots are written whole (the real store renames
//!   a finished file into place). A disk can fail one write (EIO) or be full for a while
//!   (ENOSPC): openraft stops on a storage error, and the node's process exits and restarts
//!   (what it wrote reaches the disk: a process exit is not a power cut).
//! - **The network** ([`Net`]): every Raft message (AppendEntries, votes, whole snapshots) goes
//!   through a delay of 0.2-3 ms each way, cut links (both ways, one way, or one link of three
//!   with the third node bridging) fail after a connect timeout, lossy links
//!   lose requests or answers, and an AppendEntries now and then arrives a second time, late,
//!   after newer ones (reordering and duplication).
//! - **Proposals**: each node stamps a command with the real `Clock` on its simulated wall and
//!   monotonic clocks and proposes it alone (the production proposer also batches), announcing
//!   a new term with `NewLeader` first, as the production proposer does.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::io;
use std::ops::RangeBounds;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, TryStreamExt};
use openraft::async_runtime::WatchReceiver;
use openraft::error::{NetworkError, RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory};
use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse};
use openraft::storage::{EntryResponder, IOFlushed, RaftLogStorage, RaftStateMachine};
use openraft::{
    AsyncRuntime, EntryPayload, OptionalSend, RaftLogReader, RaftNetworkV2, RaftSnapshotBuilder, ServerState,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokenlog_raftlog::clock::Clock;
use tokenlog_raftlog::faults::Faults;
use tokenlog_raftlog::sm_store::Machine;
use tokenlog_raftlog::state::{Changes, LogState};
use tokenlog_raftlog::types::{Command, Request, Response};

type Rt = crate::sim_rt::SimRt;

openraft::declare_raft_types!(
    /// The production types (entries carry a stamped `Request`, applying one answers a
    /// `Response`, the same log ids and votes) on the deterministic runtime.
    pub SimTypeConfig:
        D = Request,
        R = Response,
        Node = tokenlog_raftlog::raft_types::Node,
        AsyncRuntime = Rt,
);

type Entry = openraft::alias::EntryOf<SimTypeConfig>;
type LogId = openraft::alias::LogIdOf<SimTypeConfig>;
type Vote = openraft::alias::VoteOf<SimTypeConfig>;
type SnapshotMeta = openraft::alias::SnapshotMetaOf<SimTypeConfig>;
type Snapshot = openraft::alias::SnapshotOf<SimTypeConfig, Machine>;
type SimRaft = openraft::Raft<SimTypeConfig, SimSm>;

/// How long a message to a cut-off or dead node takes to fail (a connect timeout).
const UNREACHABLE_MS: (u64, u64) = (5, 30);
/// One-way network delay, in microseconds.
const NET_DELAY_US: (u64, u64) = (200, 3_000);
const FSYNC_MS: (u64, u64) = (1, 8);
/// Snapshots this often and few entries kept after one, so that lagging and restarted nodes
/// catch up by snapshot (install) as often as by log.
const SNAPSHOT_EVERY: u64 = 40;
const KEEP_AFTER_SNAPSHOT: u64 = 5;

/// What openraft's storage traits write, split into what a read sees and what survives a crash.
#[derive(Default)]
struct Disk {
    /// Bumped by every crash: an fsync of an earlier process has nothing left to sync.
    incarnation: u64,
    log: BTreeMap<u64, Entry>,
    /// The part of `log` an fsync made durable.
    synced: BTreeMap<u64, Entry>,
    committed: Option<LogId>,
    synced_committed: Option<LogId>,
    vote: Option<Vote>,
    purged: Option<LogId>,
    snapshot: Option<(SnapshotMeta, Machine)>,
    /// Full: every append fails (ENOSPC) until the simulation frees space.
    full: bool,
    /// The next append fails (EIO), once.
    fail_next: bool,
}

impl Disk {
    /// A power cut: the synced part survives, and of what was written after the last fsync, a
    /// prefix drawn from `rng` (a torn tail). Returns (entries lost, entries kept unsynced).
    fn crash(&mut self, rng: &mut StdRng) -> (u64, u64) {
        self.incarnation += 1;
        let synced_last = self.synced.keys().next_back().copied();
        let unsynced: Vec<u64> = self
            .log
            .keys()
            .copied()
            .filter(|&i| synced_last.is_none_or(|s| i > s))
            .collect();
        let keep = if unsynced.is_empty() {
            0
        } else {
            rng.random_range(0..=unsynced.len())
        };
        let mut log = std::mem::take(&mut self.synced);
        for &i in &unsynced[..keep] {
            log.insert(i, self.log[&i].clone());
        }
        self.log = log.clone();
        self.synced = log;
        self.committed = self.synced_committed;
        ((unsynced.len() - keep) as u64, keep as u64)
    }

    /// The process exited (its Raft stopped on a storage error): what it wrote is in the page
    /// cache and reaches the disk; an fsync it still waited for has nothing left to do.
    fn process_exit(&mut self) {
        self.incarnation += 1;
        self.sync();
    }

    fn sync(&mut self) {
        self.synced = self.log.clone();
        self.synced_committed = self.committed;
    }
}

// ------------------------------------------------------------------------------ log storage

/// openraft's log storage over a [`Disk`].
#[derive(Clone)]
struct SimLogStore {
    disk: Arc<Mutex<Disk>>,
    /// To this node's fsync task: callbacks that wait for the next fsync.
    fsync: tokio::sync::mpsc::UnboundedSender<IOFlushed<SimTypeConfig>>,
    /// Planted: acknowledge an append before its fsync.
    ack_before_fsync: bool,
}

impl SimLogStore {
    /// Starts the node's fsync task: it takes every waiting callback, sleeps for the fsync,
    /// makes the disk durable and acknowledges them in order (the RocksDB store's flusher).
    fn new(disk: Arc<Mutex<Disk>>, rng: Arc<Mutex<StdRng>>, ack_before_fsync: bool) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<IOFlushed<SimTypeConfig>>();
        let incarnation = disk.lock().expect("disk").incarnation;
        let d = disk.clone();
        Rt::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut waiting = vec![first];
                while let Ok(cb) = rx.try_recv() {
                    waiting.push(cb);
                }
                let ms = rng.lock().expect("rng").random_range(FSYNC_MS.0..=FSYNC_MS.1);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                {
                    let mut disk = d.lock().expect("disk");
                    if disk.incarnation != incarnation {
                        return;
                    }
                    disk.sync();
                }
                for cb in waiting {
                    cb.io_completed(Ok(()));
                }
            }
        });
        SimLogStore {
            disk,
            fsync: tx,
            ack_before_fsync,
        }
    }
}

impl RaftLogReader<SimTypeConfig> for SimLogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + std::fmt::Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        let disk = self.disk.lock().expect("disk");
        Ok(disk.log.range(range).map(|(_, e)| e.clone()).collect())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(self.disk.lock().expect("disk").vote)
    }
}

impl RaftLogStorage<SimTypeConfig> for SimLogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<openraft::LogState<SimTypeConfig>, io::Error> {
        let disk = self.disk.lock().expect("disk");
        let last = disk.log.values().next_back().map(|e| e.log_id);
        Ok(openraft::LogState {
            last_log_id: last.or(disk.purged),
            last_purged_log_id: disk.purged,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        // Synced at once (the RocksDB store flushes its WAL for the vote).
        self.disk.lock().expect("disk").vote = Some(*vote);
        Ok(())
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        self.disk.lock().expect("disk").committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        Ok(self.disk.lock().expect("disk").committed)
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<SimTypeConfig>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
    {
        {
            let mut disk = self.disk.lock().expect("disk");
            if disk.full {
                return Err(io::Error::new(io::ErrorKind::StorageFull, "no space left on device"));
            }
            if std::mem::take(&mut disk.fail_next) {
                return Err(io::Error::other("input/output error"));
            }
            for e in entries {
                disk.log.insert(e.log_id.index, e);
            }
        }
        if self.ack_before_fsync {
            callback.io_completed(Ok(()));
            return Ok(());
        }
        self.fsync
            .send(callback)
            .map_err(|_| io::Error::other("the fsync task stopped"))
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let from = last_log_id.map_or(0, |l| l.index + 1);
        let mut disk = self.disk.lock().expect("disk");
        disk.log.split_off(&from);
        disk.synced.split_off(&from);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        let mut disk = self.disk.lock().expect("disk");
        disk.purged = Some(log_id);
        disk.log = disk.log.split_off(&(log_id.index + 1));
        disk.synced = disk.synced.split_off(&(log_id.index + 1));
        Ok(())
    }
}

// ------------------------------------------------------------------------------ state machine

/// openraft's state machine: the production [`Machine`], snapshots kept whole on the [`Disk`].
#[derive(Clone)]
struct SimSm {
    machine: Arc<Mutex<Machine>>,
    disk: Arc<Mutex<Disk>>,
    faults: Faults,
    /// Planted: a snapshot claims an index `SNAPSHOT_EVERY / 2` entries below what it holds
    /// (the raftlog v2 race): whoever loads it applies those entries again.
    snapshot_lag: bool,
    /// The log ids applied last (kept only for the planted lag).
    recent: Arc<Mutex<std::collections::VecDeque<LogId>>>,
}

impl SimSm {
    fn loaded(mut m: Machine, faults: Faults) -> Machine {
        m.log.faults = faults;
        m.log.rebuild_index();
        m
    }
}

impl RaftSnapshotBuilder<SimTypeConfig> for SimSm {
    type SnapshotData = Machine;

    async fn build_snapshot(&mut self) -> Result<Snapshot, io::Error> {
        let mut copy = self.machine.lock().expect("machine").clone();
        if self.snapshot_lag {
            let recent = self.recent.lock().expect("recent");
            let lag = (SNAPSHOT_EVERY / 2) as usize;
            if recent.len() > lag {
                let claimed = recent[recent.len() - 1 - lag];
                copy = with_applied(&copy, claimed)?;
            }
        }
        let meta = copy.meta();
        self.disk.lock().expect("disk").snapshot = Some((meta.clone(), copy.clone()));
        Ok(Snapshot { meta, snapshot: copy })
    }
}

/// The planted lag: `m` claiming `applied` (through its serialized form: the field is private
/// to the production code, which never sets it apart from the state).
fn with_applied(m: &Machine, applied: LogId) -> io::Result<Machine> {
    let mut v = serde_json::to_value(m).map_err(io::Error::other)?;
    v["applied"] = serde_json::to_value(applied).map_err(io::Error::other)?;
    serde_json::from_value(v).map_err(io::Error::other)
}

impl RaftStateMachine<SimTypeConfig> for SimSm {
    type SnapshotData = Machine;
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId>, openraft::alias::StoredMembershipOf<SimTypeConfig>), io::Error> {
        let m = self.machine.lock().expect("machine");
        Ok((m.applied(), m.meta().last_membership))
    }

    async fn apply<S>(&mut self, mut entries: S) -> Result<(), io::Error>
    where
        S: Stream<Item = Result<EntryResponder<SimTypeConfig>, io::Error>> + Unpin + OptionalSend,
    {
        let mut changes = Changes::default();
        while let Some((entry, responder)) = entries.try_next().await? {
            let log_id = entry.log_id;
            let response = self
                .machine
                .lock()
                .expect("machine")
                .apply_entry(log_id, entry.payload, &mut changes);
            if self.snapshot_lag {
                let mut recent = self.recent.lock().expect("recent");
                recent.push_back(log_id);
                if recent.len() > SNAPSHOT_EVERY as usize {
                    recent.pop_front();
                }
            }
            if let Some(r) = responder {
                r.send(response);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMeta, snapshot: Machine) -> Result<(), io::Error> {
        *self.machine.lock().expect("machine") = Self::loaded(snapshot.clone(), self.faults);
        self.recent.lock().expect("recent").clear();
        self.disk.lock().expect("disk").snapshot = Some((meta.clone(), snapshot));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, io::Error> {
        Ok(self
            .disk
            .lock()
            .expect("disk")
            .snapshot
            .clone()
            .map(|(meta, snapshot)| Snapshot { meta, snapshot }))
    }
}

// ------------------------------------------------------------------------------ network

/// The nodes' network: who is up, which links are cut, how lossy it is.
struct Net {
    rafts: Mutex<Vec<Option<SimRaft>>>,
    cut: Mutex<BTreeSet<(usize, usize)>>,
    /// Links cut in one direction: (from, to).
    one_way: Mutex<BTreeSet<(usize, usize)>>,
    loss: Mutex<f64>,
    rng: Arc<Mutex<StdRng>>,
    /// AppendEntries delivered a second time, late.
    duplicates: AtomicU64,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Msg(&'static str);

impl Net {
    /// Whether `a` can send to `b`.
    fn linked(&self, a: usize, b: usize) -> bool {
        a == b
            || (!self.cut.lock().expect("cut").contains(&(a.min(b), a.max(b)))
                && !self.one_way.lock().expect("one way").contains(&(a, b)))
    }

    fn draw(&self, range: (u64, u64)) -> u64 {
        self.rng.lock().expect("rng").random_range(range.0..=range.1)
    }

    fn chance(&self, p: f64) -> bool {
        p > 0.0 && self.rng.lock().expect("rng").random_bool(p.min(1.0))
    }

    fn lossy(&self) -> bool {
        let p = *self.loss.lock().expect("loss");
        self.chance(p)
    }

    /// The target's Raft, if the request reaches it (after the delay there).
    async fn reach(&self, from: usize, to: usize) -> Result<SimRaft, RPCError<SimTypeConfig>> {
        tokio::time::sleep(Duration::from_micros(self.draw(NET_DELAY_US))).await;
        let target = self.rafts.lock().expect("rafts")[to].clone();
        match target {
            Some(r) if self.linked(from, to) && !self.lossy() => Ok(r),
            _ => {
                tokio::time::sleep(Duration::from_millis(self.draw(UNREACHABLE_MS))).await;
                Err(RPCError::Unreachable(Unreachable::new(&Msg("unreachable"))))
            }
        }
    }

    /// The answer's way back.
    async fn back<T>(&self, from: usize, to: usize, answer: T) -> Result<T, RPCError<SimTypeConfig>> {
        tokio::time::sleep(Duration::from_micros(self.draw(NET_DELAY_US))).await;
        if self.linked(from, to) && !self.lossy() {
            Ok(answer)
        } else {
            Err(RPCError::Network(NetworkError::new(&Msg("answer lost"))))
        }
    }
}

struct NetFactory {
    from: usize,
    net: Arc<Net>,
}

impl RaftNetworkFactory<SimTypeConfig> for NetFactory {
    type Network = Conn;

    async fn new_client(&mut self, target: u64, _node: &tokenlog_raftlog::raft_types::Node) -> Conn {
        Conn {
            from: self.from,
            to: target as usize,
            net: self.net.clone(),
        }
    }
}

struct Conn {
    from: usize,
    to: usize,
    net: Arc<Net>,
}

fn raft_failed<E: std::fmt::Display>(_: E) -> RPCError<SimTypeConfig> {
    RPCError::Unreachable(Unreachable::new(&Msg("the target stopped")))
}

impl Conn {
    /// One request to the target (`call` on its Raft) and the answer back, through the
    /// network's delays, cut links and losses.
    async fn rpc<T, E, F>(&self, call: impl FnOnce(SimRaft) -> F) -> Result<T, RPCError<SimTypeConfig>>
    where
        E: std::fmt::Display,
        F: Future<Output = Result<T, E>>,
    {
        let raft = self.net.reach(self.from, self.to).await?;
        let resp = call(raft).await.map_err(raft_failed)?;
        self.net.back(self.to, self.from, resp).await
    }
}

impl RaftNetworkV2<SimTypeConfig> for Conn {
    type SnapshotData = Machine;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<SimTypeConfig>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<SimTypeConfig>, RPCError<SimTypeConfig>> {
        let net = self.net.clone();
        self.rpc(move |raft| {
            // Now and then the same request arrives again later, after newer ones.
            if net.chance(0.02) {
                net.duplicates.fetch_add(1, Ordering::Relaxed);
                let (late, again) = (raft.clone(), rpc.clone());
                let delay = net.draw((5, 200));
                Rt::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                    let _ = late.append_entries(again).await;
                });
            }
            async move { raft.append_entries(rpc).await }
        })
        .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<SimTypeConfig>,
        _option: RPCOption,
    ) -> Result<VoteResponse<SimTypeConfig>, RPCError<SimTypeConfig>> {
        self.rpc(move |raft| async move { raft.vote(rpc).await }).await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        _cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<SimTypeConfig>, StreamingError<SimTypeConfig>> {
        Ok(self
            .rpc(move |raft| async move { raft.install_full_snapshot(vote, snapshot).await })
            .await?)
    }
}

// ------------------------------------------------------------------------------ the cluster

/// One node: its disk (kept across crashes) and, while up, its process.
struct SimNode {
    disk: Arc<Mutex<Disk>>,
    skew: Arc<AtomicI64>,
    up: Option<Process>,
}

/// What a node's process holds: gone with a crash. Cloned for the tasks that serve it (the
/// simulated `raftlog.v1.Log` service of [`crate::sim_workers`]).
#[derive(Clone)]
pub(crate) struct Process {
    /// Which boot of the cluster started it (a new process, a new number).
    pub(crate) boot: u64,
    raft: SimRaft,
    pub(crate) machine: Arc<Mutex<Machine>>,
    pub(crate) clock: Arc<Clock>,
    /// The term this process announced with `NewLeader`.
    announced: Arc<Mutex<Option<u64>>>,
}

/// Why a write was not answered.
pub(crate) enum WriteError {
    /// Not the leader (the leader's id, when known).
    NotLeader(Option<u64>),
    /// openraft stopped, or another failure of the write.
    Failed(String),
}

impl Process {
    /// Stamps `cmd` with this node's clock and proposes it, after `NewLeader` when it is the
    /// first proposal of this process in its term (as the production proposer does); returns
    /// its answer and log index once applied. Call inside [`Rt::scope`].
    pub(crate) async fn write(&self, cmd: Command) -> Result<(Response, u64), WriteError> {
        let term = {
            let m = self.raft.metrics();
            let m = m.borrow_watched();
            (m.state == ServerState::Leader).then_some(m.current_term)
        };
        let announce = {
            let mut a = self.announced.lock().expect("announced");
            let announce = term.is_some() && *a != term;
            if announce {
                *a = term;
            }
            announce
        };
        let cmd = if announce {
            Command::Batch(vec![Command::NewLeader, cmd])
        } else {
            cmd
        };
        // Only a leader stamps (as the production proposer): see `tokenlog_raftlog::node`.
        let log_ms = {
            let m = self.machine.lock().expect("machine");
            match term {
                Some(_) => self.clock.stamp(m.log.log_ms),
                None => m.log.log_ms,
            }
        };
        let written = match self.raft.client_write(Request::new(log_ms, cmd)).await {
            Ok(w) => w,
            Err(e) => {
                return Err(match e.forward_to_leader() {
                    Some(f) => WriteError::NotLeader(f.leader_id),
                    None => WriteError::Failed(e.to_string()),
                })
            }
        };
        let index = written.log_id().index;
        let mut resp = written.response().clone();
        if announce {
            if let Response::Batch(mut parts) = resp {
                parts.remove(0);
                resp = parts.pop().unwrap_or(Response::None);
            }
        }
        Ok((resp, index))
    }

    /// The leader this node knows, if any.
    pub(crate) fn leader(&self) -> Option<u64> {
        self.raft.metrics().borrow_watched().current_leader
    }

    /// Whether this node leads now (a Raft stopped on a storage error still says it leads in
    /// its last metrics: not it).
    pub(crate) fn leads(&self) -> bool {
        let m = self.raft.metrics();
        let m = m.borrow_watched();
        m.state == ServerState::Leader && m.running_state.is_ok()
    }
}

/// The real openraft cluster the simulation drives, one simulated millisecond at a time.
pub(crate) struct RealLog {
    rt: tokio::runtime::Runtime,
    start: tokio::time::Instant,
    nodes: Vec<SimNode>,
    net: Arc<Net>,
    /// (call, answer) of the proposals answered since the last `take_answers`.
    answers: Arc<Mutex<Vec<(u64, Response)>>>,
    faults: Faults,
    plants: RealPlants,
    seed: u64,
    boots: u64,
    proposals: u64,
    now_ms: Arc<AtomicU64>,
}

/// Why a node's Raft stopped without being told to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stopped {
    StorageError,
    Panic,
}

/// The planted bugs this log knows about.
pub(crate) struct RealPlants {
    pub ack_before_fsync: bool,
    pub snapshot_lag: bool,
    pub unbounded_clock: bool,
    /// openraft's default `enable_leader_restore` instead of production's `false`.
    pub leader_restore: bool,
}

impl RealLog {
    /// Starts `skews.len()` nodes (their wall clocks skewed by `skews`) and initializes the
    /// cluster at node 0.
    pub fn new(
        seed: u64,
        faults: Faults,
        skews: &[Arc<AtomicI64>],
        now_ms: Arc<AtomicU64>,
        plants: RealPlants,
    ) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a current-thread runtime");
        let start = rt.block_on(async { tokio::time::Instant::now() });
        let net = Arc::new(Net {
            rafts: Mutex::new(vec![None; skews.len()]),
            cut: Mutex::default(),
            one_way: Mutex::default(),
            loss: Mutex::new(0.0),
            rng: Arc::new(Mutex::new(StdRng::seed_from_u64(seed ^ 0x005e_ed0f_0e41_4af7))),
            duplicates: AtomicU64::new(0),
        });
        let mut log = RealLog {
            rt,
            start,
            nodes: skews
                .iter()
                .map(|s| SimNode {
                    disk: Arc::default(),
                    skew: s.clone(),
                    up: None,
                })
                .collect(),
            net,
            answers: Arc::default(),
            faults,
            plants,
            seed,
            boots: 0,
            proposals: 0,
            now_ms,
        };
        for i in 0..log.nodes.len() {
            log.boot(i);
        }
        let raft = log.nodes[0].up.as_ref().expect("booted").raft.clone();
        let members: BTreeMap<u64, tokenlog_raftlog::raft_types::Node> = (0..log.nodes.len() as u64)
            .map(|i| (i, format!("n{i}").into()))
            .collect();
        log.rt
            .block_on(raft.initialize(members))
            .expect("a new cluster initializes");
        log
    }

    /// Starts node `i`'s process on what its disk holds.
    fn boot(&mut self, i: usize) {
        self.boots += 1;
        let node = &self.nodes[i];
        let snapshot = node
            .disk
            .lock()
            .expect("disk")
            .snapshot
            .as_ref()
            .map(|(_, m)| m.clone());
        let machine = SimSm::loaded(snapshot.unwrap_or_default(), self.faults);
        let machine = Arc::new(Mutex::new(machine));
        let clock = crate::sim::clock(&self.now_ms, &node.skew, self.plants.unbounded_clock);
        let mut cfg = tokenlog_raftlog::node::NodeConfig::new(
            i as u64,
            "127.0.0.1:1".parse().expect("addr"),
            "/nonexistent".into(),
        );
        cfg.snapshot_every = SNAPSHOT_EVERY;
        cfg.keep_after_snapshot = KEEP_AFTER_SNAPSHOT;
        let mut config = tokenlog_raftlog::node::raft_config(&cfg).expect("the production raft config is valid");
        if self.plants.leader_restore {
            let mut c = (*config).clone();
            c.enable_leader_restore = None;
            config = Arc::new(c);
        }
        let sm = SimSm {
            machine: machine.clone(),
            disk: node.disk.clone(),
            faults: self.faults,
            snapshot_lag: self.plants.snapshot_lag,
            recent: Arc::default(),
        };
        let (disk, rng, ack) = (node.disk.clone(), self.net.rng.clone(), self.plants.ack_before_fsync);
        let factory = NetFactory {
            from: i,
            net: self.net.clone(),
        };
        // Every task openraft spawns takes its random draws from this seed's tree.
        let seed = self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ self.boots;
        let raft = self
            .rt
            .block_on(Rt::scope(seed, async move {
                let store = SimLogStore::new(disk, rng, ack);
                SimRaft::new(i as u64, config, factory, store, sm).await
            }))
            .expect("openraft starts on a readable disk");
        self.net.rafts.lock().expect("rafts")[i] = Some(raft.clone());
        self.nodes[i].up = Some(Process {
            boot: self.boots,
            raft,
            machine,
            clock,
            announced: Arc::default(),
        });
    }

    /// Node `i`'s process, while it is up.
    pub(crate) fn process(&self, i: usize) -> Option<Process> {
        self.nodes[i].up.clone()
    }

    /// Spawns `f` on the cluster's runtime (it runs as the cluster advances).
    pub(crate) fn spawn<F>(&self, f: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.rt.spawn(f)
    }

    /// Simulated time zero on the runtime's clock.
    pub(crate) fn start(&self) -> tokio::time::Instant {
        self.start
    }

    /// Runs the cluster up to simulated millisecond `now`.
    pub fn advance_to(&mut self, now: u64) {
        let at = self.start + Duration::from_millis(now);
        self.rt.block_on(async move { tokio::time::sleep_until(at).await });
    }

    pub fn set_links(&self, cut: &BTreeSet<(usize, usize)>, one_way: &BTreeSet<(usize, usize)>, loss: f64) {
        *self.net.cut.lock().expect("cut") = cut.clone();
        *self.net.one_way.lock().expect("one way") = one_way.clone();
        *self.net.loss.lock().expect("loss") = loss;
    }

    pub fn duplicates(&self) -> u64 {
        self.net.duplicates.load(Ordering::Relaxed)
    }

    /// The node that leads in the highest term among the live ones (a deposed leader that has
    /// not heard of its successor may still think it leads: not it).
    pub fn leader(&self) -> Option<usize> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                let p = n.up.as_ref()?;
                let m = p.raft.metrics();
                let m = m.borrow_watched();
                (m.state == ServerState::Leader).then_some((m.current_term, i))
            })
            .max()
            .map(|(_, i)| i)
    }

    /// Node `i`'s applied state, while it is up.
    pub fn machine(&self, i: usize) -> Option<std::sync::MutexGuard<'_, Machine>> {
        self.nodes[i].up.as_ref().map(|p| p.machine.lock().expect("machine"))
    }

    /// Node `i`'s idea of log time now.
    pub fn log_now(&self, i: usize, applied_ms: u64) -> u64 {
        self.nodes[i]
            .up
            .as_ref()
            .map_or(applied_ms, |p| p.clock.now(applied_ms))
    }

    /// The entries node `i` holds past what it applied (for the planted early visibility).
    pub fn unapplied(&self, i: usize, applied: u64) -> Vec<Request> {
        let disk = self.nodes[i].disk.lock().expect("disk");
        disk.log
            .range(applied + 1..)
            .filter_map(|(_, e)| match &e.payload {
                EntryPayload::Normal(r) => Some(r.clone()),
                _ => None,
            })
            .collect()
    }

    /// Node `to` gets `cmd` (it arrives now): it stamps and proposes it; when `caller` waits,
    /// the answer goes to `take_answers` once applied.
    pub fn propose(&mut self, to: usize, cmd: Command, caller: Option<u64>) {
        let Some(p) = self.nodes[to].up.clone() else { return };
        let answers = self.answers.clone();
        self.proposals += 1;
        let seed = self.seed ^ self.proposals.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        self.rt.spawn(Rt::scope(seed, async move {
            let Ok((resp, _)) = p.write(cmd).await else {
                return;
            };
            if let Some(call) = caller {
                answers.lock().expect("answers").push((call, resp));
            }
        }));
    }

    pub fn take_answers(&self) -> Vec<(u64, Response)> {
        std::mem::take(&mut *self.answers.lock().expect("answers"))
    }

    /// Power cut at node `i`; returns (entries lost, unsynced entries that survived).
    pub fn crash(&mut self, i: usize, rng: &mut StdRng) -> (u64, u64) {
        if let Some(p) = self.nodes[i].up.take() {
            self.net.rafts.lock().expect("rafts")[i] = None;
            let _ = self.rt.block_on(p.raft.shutdown());
        }
        self.nodes[i].disk.lock().expect("disk").crash(rng)
    }

    /// Node `i`'s disk fails writes: one (EIO) or, when `full`, every one until `free`.
    pub fn fail_writes(&self, i: usize, full: bool) {
        let mut disk = self.nodes[i].disk.lock().expect("disk");
        if full {
            disk.full = true;
        } else {
            disk.fail_next = true;
        }
    }

    /// Node `i`'s disk has space again.
    pub fn free(&self, i: usize) {
        self.nodes[i].disk.lock().expect("disk").full = false;
    }

    /// The nodes whose Raft stopped on its own, and how: a storage error (fatal to openraft)
    /// or a panic in its core (its metrics channel closed). Their processes exit, as
    /// `tokenlog node` does (it aborts on a panic), and the simulation restarts them.
    pub fn reap(&mut self) -> Vec<(usize, Stopped)> {
        let mut gone = Vec::new();
        for i in 0..self.nodes.len() {
            let stopped = self.nodes[i].up.as_ref().and_then(|p| {
                let m = p.raft.metrics();
                // A fatal error is in the last metrics its core sent; a panic sends none.
                let fatal = m.borrow_watched().running_state.is_err();
                if fatal {
                    Some(Stopped::StorageError)
                } else {
                    m.is_closed().then_some(Stopped::Panic)
                }
            });
            if let Some(how) = stopped {
                let p = self.nodes[i].up.take().expect("up");
                self.net.rafts.lock().expect("rafts")[i] = None;
                let _ = self.rt.block_on(p.raft.shutdown());
                self.nodes[i].disk.lock().expect("disk").process_exit();
                gone.push((i, how));
            }
        }
        gone
    }

    pub fn restart(&mut self, i: usize) {
        if self.nodes[i].up.is_none() {
            self.boot(i);
        }
    }

    /// Each live node's (last applied index, its state).
    pub fn applied(&self) -> Vec<Option<(u64, LogState)>> {
        (0..self.nodes.len())
            .map(|i| {
                self.machine(i)
                    .map(|m| (m.applied().map_or(0, |l| l.index), m.log.clone()))
            })
            .collect()
    }

    /// The commit index the leader knows.
    pub fn committed(&self) -> Option<u64> {
        let l = self.leader()?;
        let p = self.nodes[l].up.as_ref()?;
        let m = p.raft.metrics();
        let m = m.borrow_watched();
        m.cluster_committed.map(|c| c.index)
    }
}

impl Drop for RealLog {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(p) = n.up.take() {
                let _ = self.rt.block_on(p.raft.shutdown());
            }
        }
        self.net.rafts.lock().expect("rafts").clear();
    }
}
