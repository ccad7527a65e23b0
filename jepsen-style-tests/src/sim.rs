//! A deterministic simulation of the ownership protocol (issue 13, stage 1): the real state
//! machine (`LogState::apply`, every replica), the decoders' and clients' side of the protocol,
//! and a replicated log in between, all on simulated time in one thread, every choice drawn from
//! one seed. It runs thousands of fault schedules in the time the real-process suite runs one,
//! and a failing seed replays bit for bit (`sim --seeds 1 --seed-start S`; the history hash
//! printed is the same).
//!
//! What is real and what is simulated:
//! - Real: `LogState::apply` (fencing, leases, Tick deadlines, cancels, the hash chain), the
//!   checkers of the real-process suite (exactly-once, durability, fencing, linearizability of
//!   ownership with each generation's final state, status, completion, liveness, lease-time)
//!   over histories in the same types (`DecoderOp`, `RequestRecord`).
//! - The replicated log, one of two (`--core`):
//!   - `stand-in` (default, fast: ~30 seeds/s): a small Raft of the simulation's own: leaders
//!     with terms, an election that picks the most up-to-date replica of a reachable majority,
//!     log matching (a follower's conflicting tail is cut), commit by a quorum of fsynced
//!     copies of an entry of the leader's term, followers that learn the commit index. Each
//!     replica has a disk whose un-fsynced tail a crash loses; snapshots every few entries;
//!     restart from the snapshot plus the committed log.
//!   - `openraft` ([`crate::sim_raft`], ~10 seeds/s): the real openraft core with the
//!     production Raft configuration and state machine step, on a paused tokio clock, a
//!     simulated disk (torn tails, fsync latency) and network (delay, loss, partitions, late
//!     duplicated AppendEntries). Its first run found a real divergence (see `node::raft_config`,
//!     `enable_leader_restore`).
//! - Also real: the leader's stamping `Clock` (on simulated wall and monotonic clocks per
//!   replica, new at each restart).
//! - Faults, from the seed: replica crashes (losing what was not fsynced; one in five also its
//!   whole disk, after which it rejoins empty and votes only once caught up), partitions that cut
//!   one replica off or isolate the leader, lossy links (requests and answers lost, so
//!   decoder operations end in doubt; a request now and then delivered twice, or held in
//!   transit for up to 0.6 s and delivered after later ones), wall clocks
//!   jumping by seconds, decoder pauses past their lease (stale writers), decoder crashes and
//!   graceful stops (releasing what they hold), client cancels. Clients watch whichever node
//!   they are connected to (its applied state) and move to another, resuming from the next
//!   seq, when theirs is down, cut off or stalled. Decoders renew their leases;
//!   half the seeds keep finished generations for 3-20 s only, so retention prunes while
//!   clients read (a pruned generation is checked as read right after its last event).
//!
//! Planted bugs (`--plant`): `no-fence` (apply without the epoch fence), `ack-before-fsync`
//! (commit counts copies not yet fsynced), `early-visibility` (clients read their node's log
//! before commit), `snapshot-lag` (a snapshot claims an index below what its state contains, so
//! a restarted replica applies entries twice), `unbounded-clock` (the leader stamps with its
//! wall clock as it is: a jump expires live leases, which lease-time sees), `leader-restore`
//! (openraft only: openraft's default leader restore, which convergence sees).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sha2::{Digest, Sha256};
use tokenlog_decoder::history::{Answer, Call};
use tokenlog_raftlog::clock::{Clock, TimeSource};
use tokenlog_raftlog::state::{Changes, LogState};
use tokenlog_raftlog::types::*;

use crate::harness::checks::{self, FinalGen, Verdict, DUPLICATE_SUFFIX};
use crate::harness::decoder_ops::{DecoderOp, OpKind};
use crate::harness::workload::{RequestRecord, StatusSeen};

/// A planted bug the simulation must catch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum SimPlant {
    NoFence,
    AckBeforeFsync,
    EarlyVisibility,
    SnapshotLag,
    /// The leader stamps log time with its wall clock as it is (the real `Clock` with
    /// `trust_wall`): a clock jump expires live leases (lease-time).
    UnboundedClock,
    /// openraft only: the Raft configuration as it was before the simulation found the bug,
    /// with openraft's default `enable_leader_restore` (a restarted leader resumes its term and
    /// may write other entries under log ids its followers hold: convergence).
    LeaderRestore,
}

/// Which replicated log runs under the workload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum SimCore {
    /// The simulation's own small Raft (fast: thousands of seeds a minute).
    #[default]
    StandIn,
    /// The real openraft core ([`crate::sim_raft`]): slower, production code.
    Openraft,
    /// The real openraft core, and the real decoder workers (fake model) with the production
    /// log client, over gRPC on the simulated wire ([`crate::sim_workers`]), in place of the
    /// stand-in decoders. Decoder pauses become cut-offs from the log (their leases lapse, and
    /// they come back as stale writers); a lossy network breaks connections.
    Workers,
}

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    /// Simulated milliseconds of faults; the healing phase follows.
    pub time_ms: u64,
    pub plant: Option<SimPlant>,
    pub core: SimCore,
}

impl SimConfig {
    pub fn new(seed: u64) -> Self {
        SimConfig {
            seed,
            time_ms: 6_000,
            plant: None,
            core: SimCore::StandIn,
        }
    }
}

/// What one seed drew and found.
#[derive(Clone, Debug, Default)]
pub struct SimOutcome {
    pub seed: u64,
    pub verdicts: BTreeMap<String, Verdict>,
    /// SHA-256 of the whole history (decoder operations, client records, fault records).
    pub history_hash: String,
    pub counts: SimCounts,
}

impl SimOutcome {
    pub fn ok(&self) -> bool {
        self.verdicts.values().all(|v| v.ok)
    }

    /// The first violated invariant: the checker and its first problem.
    pub fn first_violation(&self) -> Option<String> {
        self.verdicts
            .iter()
            .find(|(_, v)| !v.ok)
            .map(|(k, v)| format!("{k}: {}", v.problems.first().cloned().unwrap_or_default()))
    }
}

/// How much the faults bit in one seed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimCounts {
    pub crashes: u64,
    /// Entries written but not fsynced that crashes lost.
    pub lost_unsynced: u64,
    pub partitions: u64,
    pub leader_changes: u64,
    pub takeovers: u64,
    pub decoder_pauses: u64,
    pub decoder_crashes: u64,
    /// Replicas that lost their disk with a crash (and rejoined empty).
    pub disks_lost: u64,
    /// Decoders stopped gracefully (releasing what they held).
    pub decoder_releases: u64,
    /// Generations retention pruned during the run.
    pub pruned: u64,
    /// Replica wall clocks moved by seconds.
    pub clock_jumps: u64,
    /// Requests delivered twice to the leader (and, under openraft, AppendEntries delivered a
    /// second time, late).
    pub duplicates: u64,
    /// Entries written after the last fsync that a crash kept (a torn tail; openraft only).
    pub torn_kept: u64,
    /// Client watches moved to another node, resuming from the next seq.
    pub reconnects: u64,
    /// Disk writes that failed (EIO once, or ENOSPC while a disk was full; openraft only).
    pub write_failures: u64,
    /// Log nodes whose Raft stopped on a storage error, and restarted (openraft only).
    pub storage_exits: u64,
    /// Log nodes whose openraft core panicked (an assertion in openraft), and restarted.
    pub raft_panics: u64,
    /// Real workers that ended on their own and were restarted (`SimCore::Workers`).
    pub worker_exits: u64,
    /// Connections between real workers and nodes a lossy network broke.
    pub connection_resets: u64,
    /// Requests held in transit and delivered late (after later ones).
    pub delayed: u64,
    pub indeterminate_ops: u64,
    pub requests: u64,
    pub tokens: u64,
}

impl SimCounts {
    pub fn add(&mut self, o: &SimCounts) {
        self.crashes += o.crashes;
        self.lost_unsynced += o.lost_unsynced;
        self.partitions += o.partitions;
        self.leader_changes += o.leader_changes;
        self.takeovers += o.takeovers;
        self.decoder_pauses += o.decoder_pauses;
        self.decoder_crashes += o.decoder_crashes;
        self.clock_jumps += o.clock_jumps;
        self.decoder_releases += o.decoder_releases;
        self.disks_lost += o.disks_lost;
        self.pruned += o.pruned;
        self.duplicates += o.duplicates;
        self.torn_kept += o.torn_kept;
        self.reconnects += o.reconnects;
        self.write_failures += o.write_failures;
        self.storage_exits += o.storage_exits;
        self.raft_panics += o.raft_panics;
        self.worker_exits += o.worker_exits;
        self.connection_resets += o.connection_resets;
        self.delayed += o.delayed;
        self.indeterminate_ops += o.indeterminate_ops;
        self.requests += o.requests;
        self.tokens += o.tokens;
    }
}

const REPLICAS: usize = 3;
const DECODERS: usize = 3;
const CLIENTS: usize = 4;
const LEASE_MS: u64 = 400;
const STEP_MS: u64 = 5;
const TICK_EVERY_MS: u64 = 100;
const RETENTION_MS: u64 = 60_000;
const SNAPSHOT_EVERY: usize = 40;
/// A call unanswered this long is in doubt; the caller moves on.
const CALL_TIMEOUT_MS: u64 = 300;
/// The linearizability search's budget per seed, and the retry's when it runs out.
const LIN_BUDGET: Duration = Duration::from_secs(10);
const LIN_BUDGET_RETRY: Duration = Duration::from_secs(120);
/// A client whose watch showed nothing new for this long reconnects to another node.
const WATCH_STALL_MS: u64 = 400;
/// A client whose node is down or unreachable tries another this often.
const RECONNECT_MS: u64 = 50;
/// How long after healing every request must have finished.
const HEAL_MS: u64 = 20_000;
const DECODER_CAPACITY: usize = 3;
/// How long an fsync takes (ms, a range): what a crash may lose meanwhile.
const FSYNC_MS: (u64, u64) = (1, 8);

/// The identity the stand-in decoders serve.
fn model() -> ModelIdentity {
    ModelIdentity {
        weights_sha256: "sim".into(),
        tokenizer_sha256: "sim".into(),
        architecture: "sim".into(),
        dtype_class: "sim".into(),
    }
}

/// The token a decoder samples at `seq` of generation `gen`: a pure function, as with the fake
/// model, so every owner writes the same tokens.
fn token(gen: u64, seq: u32) -> u32 {
    let h = gen.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(seq).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    3 + (h >> 40) as u32 % 250
}

#[derive(Clone, Debug)]
struct Entry {
    term: u64,
    req: Request,
    /// Who waits for the answer (none for the leader's own entries).
    caller: Option<u64>,
}

struct Replica {
    /// The real stamping clock, on this replica's simulated clocks (new at every restart).
    clock: Arc<Clock>,
    skew: Arc<AtomicI64>,
    log: Vec<Entry>,
    /// The fsynced prefix of `log`.
    durable: usize,
    /// When the pending fsync completes.
    fsync_at: Option<u64>,
    commit: usize,
    state: LogState,
    applied: usize,
    /// (claimed index, state) of the latest snapshot.
    snapshot: Option<(usize, LogState)>,
    up: bool,
    restart_at: u64,
    /// A replica that lost its disk takes no part in elections (neither votes nor stands) until
    /// it has applied this many entries: it no longer knows what it promised (Raft's rule for
    /// a member that comes back empty).
    rejoin_at: usize,
}

/// A replica's clocks on simulated time: wall = the simulation's epoch + now + this replica's
/// skew (the clock nemesis jumps it); monotonic = time since the process started.
struct SimTime {
    now: Arc<AtomicU64>,
    skew: Arc<AtomicI64>,
    boot: u64,
}

/// The wall clock at simulated time 0 (a plausible Unix time in ms).
const WALL_EPOCH_MS: u64 = 1_790_000_000_000;

impl TimeSource for SimTime {
    fn wall_ms(&self) -> u64 {
        (WALL_EPOCH_MS + self.now.load(Ordering::Relaxed)).saturating_add_signed(self.skew.load(Ordering::Relaxed))
    }
    fn mono_ms(&self) -> u64 {
        self.now.load(Ordering::Relaxed) - self.boot
    }
}

pub(crate) fn clock(now: &Arc<AtomicU64>, skew: &Arc<AtomicI64>, unbounded: bool) -> Arc<Clock> {
    let source = SimTime {
        now: now.clone(),
        skew: skew.clone(),
        boot: now.load(Ordering::Relaxed),
    };
    Arc::new(Clock::new(Arc::new(source), unbounded))
}

impl Replica {
    fn new(faults: tokenlog_raftlog::faults::Faults, now: &Arc<AtomicU64>, unbounded: bool) -> Self {
        let state = LogState {
            faults,
            ..Default::default()
        };
        let skew = Arc::new(AtomicI64::new(0));
        Replica {
            clock: clock(now, &skew, unbounded),
            skew,
            log: vec![],
            durable: 0,
            fsync_at: None,
            commit: 0,
            state,
            applied: 0,
            snapshot: None,
            up: true,
            restart_at: 0,
            rejoin_at: 0,
        }
    }

    /// Whether it may vote or stand in an election.
    fn voter(&self) -> bool {
        self.up && self.applied >= self.rejoin_at
    }

    fn last_term(&self) -> u64 {
        self.log.last().map_or(0, |e| e.term)
    }
}

/// A call in flight: who made it, its history op (if a decoder's), when it gives up.
#[derive(Clone, Debug)]
struct Pending {
    who: Caller,
    /// Indexes into the decoder-op history, one per item (appends carry several).
    ops: Vec<usize>,
    deadline: u64,
    /// The answer, once applied, and when it arrives.
    answer: Option<(u64, Response)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Caller {
    Decoder(usize),
    Client(usize),
}

#[derive(Clone, Debug)]
struct Held {
    epoch: u64,
    /// Acknowledged frontier.
    acked: u32,
    /// Next seq to send.
    next: u32,
    max_tokens: u32,
    finished_sent: bool,
}

#[derive(Clone, Debug)]
struct Decoder {
    incarnation: u32,
    up: bool,
    paused_until: u64,
    restart_at: u64,
    held: BTreeMap<u64, Held>,
    /// Generations being acquired.
    acquiring: BTreeSet<u64>,
    /// The append in flight (one at a time) and the next step.
    append_in_flight: Option<u64>,
    next_step: u64,
    next_poll: u64,
    /// Renewals in flight: call -> (generation, epoch).
    renews: BTreeMap<u64, (u64, u64)>,
    next_renew: u64,
}

impl Decoder {
    fn name(&self, i: usize) -> String {
        format!("d{}-{}", i + 1, self.incarnation)
    }
}

#[derive(Clone, Debug)]
struct Client {
    k: u32,
    rec: Option<RequestRecord>,
    /// The submit in flight, and the generation once known.
    submitting: Option<u64>,
    generation: u64,
    next_seq: u32,
    cancel_after: Option<usize>,
    cancel_in_flight: Option<u64>,
    next_try: u64,
    done: Vec<RequestRecord>,
    /// The node whose Watch the client reads (any node serves one, from its applied state).
    node: usize,
    /// When the client connected or last saw something new.
    progress_at: u64,
}

struct Sim {
    cfg: SimConfig,
    rng: StdRng,
    now: u64,
    /// `now`, for the replicas' clocks.
    clock_now: Arc<AtomicU64>,
    term: u64,
    leader: Option<usize>,
    /// When an election may happen (after the leader is lost).
    election_at: u64,
    replicas: Vec<Replica>,
    /// Cut links between replicas (i < j).
    cut: BTreeSet<(usize, usize)>,
    /// Links cut in one direction only (from, to); openraft only.
    one_way: BTreeSet<(usize, usize)>,
    /// Replicas cut from every decoder and client, until a time.
    isolated_from_clients: BTreeSet<usize>,
    isolated_until: u64,
    /// How long finished generations are kept (drawn per seed: short ones prune during the run).
    retention_ms: u64,
    /// Each generation as read right after its client saw the last event: the final state of
    /// one that retention pruned.
    at_finish: HashMap<u64, FinalGen>,
    /// Chance that a request or an answer is lost, now.
    loss: f64,
    decoders: Vec<Decoder>,
    clients: Vec<Client>,
    calls: BTreeMap<u64, Pending>,
    next_call: u64,
    /// Requests held in transit: (arrival, command, call).
    in_transit: Vec<(u64, Command, u64)>,
    ops: Vec<DecoderOp>,
    faults_log: Vec<String>,
    counts: SimCounts,
    next_tick: u64,
    stop_new: bool,
    /// The real openraft cluster, when it is the log (`SimCore::Openraft`); `replicas` then
    /// only keep each node's up/down, restart time and clock skew.
    real: Option<crate::sim_raft::RealLog>,
    /// The real decoder workers (`SimCore::Workers`); the stand-in decoders' slots then only
    /// keep each one's up/down, incarnation and restart time.
    workers: Option<crate::sim_workers::Workers>,
    /// The nodes the workers' wire isolates now (applied when it changes).
    isolated_applied: BTreeSet<usize>,
    /// What generations are bound to: the fake model's identity when real workers serve them.
    model: ModelIdentity,
    /// Full disks (openraft only): node, when space is freed.
    disk_full: Vec<(usize, u64)>,
}

/// Runs one seed.
pub fn run(cfg: &SimConfig) -> SimOutcome {
    let mut sim = Sim::new(cfg.clone());
    sim.run();
    sim.conclude()
}

impl Sim {
    fn new(cfg: SimConfig) -> Self {
        let mut faults = tokenlog_raftlog::faults::Faults::default();
        if cfg.plant == Some(SimPlant::NoFence) {
            faults = tokenlog_raftlog::faults::Faults::planted_no_fence()
                .expect("the no-fence plant needs a build with the `faults` feature (tokenlog/faults)");
        }
        let mut rng = StdRng::seed_from_u64(cfg.seed);
        // Half the seeds keep finished generations for seconds only: retention prunes them
        // while the run goes on.
        let retention_ms = if rng.random_bool(0.5) {
            rng.random_range(3_000..20_000)
        } else {
            RETENTION_MS
        };
        let clock_now = Arc::new(AtomicU64::new(0));
        let unbounded = cfg.plant == Some(SimPlant::UnboundedClock);
        let replicas: Vec<Replica> = (0..REPLICAS)
            .map(|_| Replica::new(faults, &clock_now, unbounded))
            .collect();
        let real = (cfg.core != SimCore::StandIn).then(|| {
            let skews: Vec<Arc<AtomicI64>> = replicas.iter().map(|r| r.skew.clone()).collect();
            let plants = crate::sim_raft::RealPlants {
                ack_before_fsync: cfg.plant == Some(SimPlant::AckBeforeFsync),
                snapshot_lag: cfg.plant == Some(SimPlant::SnapshotLag),
                unbounded_clock: unbounded,
                leader_restore: cfg.plant == Some(SimPlant::LeaderRestore),
            };
            crate::sim_raft::RealLog::new(cfg.seed, faults, &skews, clock_now.clone(), plants)
        });
        let workers = (cfg.core == SimCore::Workers).then(|| {
            let start = real.as_ref().expect("the openraft core").start();
            crate::sim_workers::Workers::new(REPLICAS, DECODERS, LEASE_MS, DECODER_CAPACITY, cfg.seed, start)
        });
        let model = workers.as_ref().map_or_else(model, |w| w.identity());
        // Real workers start at the first step, as incarnation 1.
        let first_up = workers.is_none();
        Sim {
            rng,
            now: 0,
            term: 1,
            leader: if real.is_some() { None } else { Some(0) },
            election_at: 0,
            replicas,
            real,
            workers,
            isolated_applied: BTreeSet::new(),
            model,
            disk_full: Vec::new(),
            clock_now,
            cut: BTreeSet::new(),
            one_way: BTreeSet::new(),
            isolated_from_clients: BTreeSet::new(),
            isolated_until: 0,
            retention_ms,
            at_finish: HashMap::new(),
            loss: 0.0,
            decoders: (0..DECODERS)
                .map(|_| Decoder {
                    incarnation: if first_up { 1 } else { 0 },
                    up: first_up,
                    paused_until: 0,
                    restart_at: 0,
                    held: BTreeMap::new(),
                    acquiring: BTreeSet::new(),
                    append_in_flight: None,
                    next_step: 0,
                    next_poll: 0,
                    renews: BTreeMap::new(),
                    next_renew: 0,
                })
                .collect(),
            clients: (0..CLIENTS)
                .map(|_| Client {
                    k: 0,
                    node: 0,
                    progress_at: 0,
                    rec: None,
                    submitting: None,
                    generation: 0,
                    next_seq: 0,
                    cancel_after: None,
                    cancel_in_flight: None,
                    next_try: 0,
                    done: vec![],
                })
                .collect(),
            calls: BTreeMap::new(),
            next_call: 0,
            in_transit: Vec::new(),
            ops: vec![],
            faults_log: vec![],
            counts: SimCounts::default(),
            next_tick: TICK_EVERY_MS,
            stop_new: false,
            cfg,
        }
    }

    fn us(&self) -> u64 {
        self.now * 1_000
    }

    fn linked(&self, a: usize, b: usize) -> bool {
        a == b || !self.cut.contains(&(a.min(b), a.max(b)))
    }

    fn run(&mut self) {
        let mut next_fault = self.rng.random_range(100..600);
        let mut heal_at = None;
        let end_faults = self.cfg.time_ms;
        let end = end_faults + HEAL_MS;
        while self.now < end {
            self.advance();
            if self.now < end_faults && self.now >= next_fault {
                self.inject();
                next_fault = self.now + self.rng.random_range(150..800);
            }
            if self.now >= end_faults && heal_at.is_none() {
                heal_at = Some(self.now);
                self.heal();
                self.stop_new = true;
            }
            self.restarts();
            if self.real.is_some() {
                self.real_step();
            } else {
                self.elect();
                self.replicate();
            }
            self.deliver_answers();
            self.decoders_step();
            self.clients_step();
            if self.stop_new
                && self.clients.iter().all(|c| c.rec.is_none())
                && self.calls.is_empty()
                && self.in_transit.is_empty()
            {
                break;
            }
        }
    }

    // ------------------------------------------------------------ the nemesis

    fn advance(&mut self) {
        self.now += 1;
        self.clock_now.store(self.now, Ordering::Relaxed);
        if self.now >= self.isolated_until {
            self.isolated_from_clients.clear();
        }
    }

    fn inject(&mut self) {
        let what = self.rng.random_range(0..8);
        match what {
            0 | 1 => {
                // Crash a replica (the leader half the time); it restarts later.
                let i = match self.leader {
                    Some(l) if self.rng.random_bool(0.5) => l,
                    _ => self.rng.random_range(0..REPLICAS),
                };
                if self.replicas.iter().filter(|r| r.up).count() < REPLICAS || !self.replicas[i].up {
                    return;
                }
                if let Some(real) = self.real.as_mut() {
                    // One in four: the disk fails instead, once (EIO) or filling up for a
                    // while (ENOSPC until freed); openraft stops on a storage error and the
                    // node restarts, as a supervised `tokenlog node` does.
                    if self.rng.random_bool(0.25) {
                        let full = self.rng.random_bool(0.5);
                        real.fail_writes(i, full);
                        self.counts.write_failures += 1;
                        if full {
                            self.disk_full.push((i, self.now + self.rng.random_range(200..2_000)));
                        }
                        self.faults_log.push(format!(
                            "{} disk n{i} {}",
                            self.now,
                            if full { "full" } else { "fails a write" }
                        ));
                        return;
                    }
                    // One crash in five is a power cut of every node at once (no disk is lost:
                    // a node that rejoins empty under its old id could vote twice in a term).
                    let all = self.rng.random_bool(0.2);
                    let targets: Vec<usize> = if all { (0..REPLICAS).collect() } else { vec![i] };
                    for i in targets {
                        let (lost, kept) = real.crash(i, &mut self.rng);
                        self.counts.crashes += 1;
                        self.counts.lost_unsynced += lost;
                        self.counts.torn_kept += kept;
                        let r = &mut self.replicas[i];
                        r.up = false;
                        r.restart_at = self.now + self.rng.random_range(50..1_500);
                        self.faults_log
                            .push(format!("{} crash n{i} (lost {lost} unsynced, kept {kept})", self.now));
                    }
                    self.leader = None;
                    return;
                }
                let lost = self.replicas[i].log.len() - self.replicas[i].durable;
                self.counts.crashes += 1;
                self.counts.lost_unsynced += lost as u64;
                // One crash in five also loses the disk (not while another replica rejoins).
                let wipe = self.rng.random_bool(0.2) && self.replicas.iter().all(|r| r.voter());
                let commit = self.leader.map_or(0, |l| self.replicas[l].commit);
                let r = &mut self.replicas[i];
                r.up = false;
                r.log.truncate(r.durable);
                r.fsync_at = None;
                r.restart_at = self.now + self.rng.random_range(50..1_500);
                if wipe {
                    r.log.clear();
                    r.durable = 0;
                    r.snapshot = None;
                    r.rejoin_at = commit.max(r.applied);
                    self.counts.disks_lost += 1;
                }
                if self.leader == Some(i) {
                    self.lose_leader();
                }
                self.faults_log.push(format!(
                    "{} crash r{i} (lost {lost} unsynced{})",
                    self.now,
                    if wipe { ", and its disk" } else { "" }
                ));
            }
            2 => {
                // Partition: one replica cut off from the others (maybe the leader).
                if !self.cut.is_empty() || !self.one_way.is_empty() {
                    self.cut.clear();
                    self.one_way.clear();
                    self.faults_log.push(format!("{} heal partition", self.now));
                    return;
                }
                let i = match self.leader {
                    Some(l) if self.rng.random_bool(0.5) => l,
                    _ => self.rng.random_range(0..REPLICAS),
                };
                // Under openraft, two more shapes: what `i` sends is lost while it still hears
                // the others (one way), or only the link from `i` to one other is cut (the
                // third node bridges them).
                let shape = if self.real.is_some() {
                    self.rng.random_range(0..3)
                } else {
                    0
                };
                for j in 0..REPLICAS {
                    if j == i {
                        continue;
                    }
                    match shape {
                        0 => {
                            self.cut.insert((i.min(j), i.max(j)));
                        }
                        1 => {
                            self.one_way.insert((i, j));
                        }
                        _ => {
                            if j == (i + 1) % REPLICAS {
                                self.cut.insert((i.min(j), i.max(j)));
                            }
                        }
                    }
                }
                if shape != 0 {
                    self.faults_log.push(format!(
                        "{} partition shape {}",
                        self.now,
                        if shape == 1 { "one-way" } else { "bridge" }
                    ));
                }
                if self.rng.random_bool(0.3) {
                    self.isolated_from_clients.insert(i);
                    self.isolated_until = self.now + self.rng.random_range(200..1_000);
                }
                self.counts.partitions += 1;
                self.faults_log.push(format!("{} partition r{i}", self.now));
            }
            3 => {
                self.loss = if self.loss > 0.0 {
                    0.0
                } else {
                    self.rng.random_range(0.05..0.4)
                };
                self.faults_log.push(format!("{} loss {:.2}", self.now, self.loss));
            }
            4 => {
                // Pause a decoder past its lease: a stale writer when it wakes.
                let d = self.rng.random_range(0..DECODERS);
                let hold = self.rng.random_range(LEASE_MS / 2..LEASE_MS * 4);
                if let Some(w) = &self.workers {
                    // A real worker cannot be frozen: it is cut off from the log instead, and
                    // comes back with what it sent meanwhile in flight.
                    if !self.decoders[d].up || self.decoders[d].paused_until > self.now {
                        return;
                    }
                    w.cut_off(d, true);
                    self.decoders[d].paused_until = self.now + hold;
                    self.counts.decoder_pauses += 1;
                    self.faults_log
                        .push(format!("{} cut d{} off the log {hold} ms", self.now, d + 1));
                    return;
                }
                self.decoders[d].paused_until = self.now + hold;
                self.counts.decoder_pauses += 1;
                self.faults_log.push(format!("{} pause d{} {hold} ms", self.now, d + 1));
            }
            5 => {
                let d = self.rng.random_range(0..DECODERS);
                if !self.decoders[d].up {
                    return;
                }
                if self.rng.random_bool(0.3) {
                    self.stop_decoder(d);
                } else {
                    self.crash_decoder(d);
                }
            }
            6 => {
                // A replica's wall clock jumps by seconds, or comes back (the leader half the
                // time): log time may not follow it past the bounded lead.
                let i = match self.leader {
                    Some(l) if self.rng.random_bool(0.5) => l,
                    _ => self.rng.random_range(0..REPLICAS),
                };
                let jump = if self.replicas[i].skew.load(Ordering::Relaxed) != 0 {
                    0
                } else {
                    self.rng.random_range(500..5_000) * if self.rng.random_bool(0.5) { 1 } else { -1 }
                };
                self.replicas[i].skew.store(jump, Ordering::Relaxed);
                self.counts.clock_jumps += 1;
                self.faults_log.push(format!("{} clock r{i} {jump:+} ms", self.now));
            }
            _ => {
                self.isolated_from_clients.clear();
            }
        }
    }

    /// A graceful stop (SIGTERM): the decoder releases what it holds, then restarts as a new
    /// incarnation. The releases' answers are recorded (the ownership model checks them).
    fn stop_decoder(&mut self, d: usize) {
        if let Some(w) = &self.workers {
            // The real worker releases what it holds and records it; it gets until its
            // restart, then is killed if it has not exited.
            w.stop(d);
        }
        if self.workers.is_some() {
            self.take_down(d);
            self.counts.decoder_releases += 1;
            self.faults_log.push(format!("{} stop d{} (releases)", self.now, d + 1));
            return;
        }
        // What it had in flight ends in doubt (it stops waiting); then it releases.
        self.forget_calls(d);
        let name = self.decoders[d].name(d);
        let held: Vec<(u64, u64)> = self.decoders[d].held.iter().map(|(&g, h)| (g, h.epoch)).collect();
        for (g, epoch) in held {
            let op = self.record(&name, Call::Release { gen: g, epoch });
            self.call(Caller::Decoder(d), Command::Release { generation: g, epoch }, vec![op]);
        }
        self.take_down(d);
        self.counts.decoder_releases += 1;
        self.faults_log.push(format!("{} stop d{} (releases)", self.now, d + 1));
    }

    fn crash_decoder(&mut self, d: usize) {
        if let Some(w) = self.workers.as_mut() {
            w.crash(d);
        }
        self.take_down(d);
        self.counts.decoder_crashes += 1;
        // Its calls in flight end in doubt: no answer is recorded.
        self.forget_calls(d);
        self.faults_log.push(format!("{} crash d{}", self.now, d + 1));
    }

    /// Decoder `d` goes down, holding nothing, until a restart drawn now.
    fn take_down(&mut self, d: usize) {
        let dec = &mut self.decoders[d];
        dec.up = false;
        dec.held.clear();
        dec.acquiring.clear();
        dec.append_in_flight = None;
        dec.renews.clear();
        dec.restart_at = self.now + self.rng.random_range(50..800);
    }

    /// Decoder `d`'s calls in flight end in doubt: their answers, if any come, go nowhere.
    fn forget_calls(&mut self, d: usize) {
        self.calls.retain(|_, p| p.who != Caller::Decoder(d));
    }

    fn heal(&mut self) {
        if let Some(real) = &self.real {
            for (i, _) in self.disk_full.drain(..) {
                real.free(i);
            }
        }
        self.cut.clear();
        self.one_way.clear();
        self.isolated_from_clients.clear();
        self.loss = 0.0;
        for d in &mut self.decoders {
            d.paused_until = 0;
        }
        if let Some(w) = &self.workers {
            w.heal();
        }
        self.faults_log.push(format!("{} heal all", self.now));
    }

    fn restarts(&mut self) {
        for i in 0..REPLICAS {
            let r = &mut self.replicas[i];
            if let Some(real) = self.real.as_mut() {
                if !r.up && self.now >= r.restart_at {
                    r.up = true;
                    real.restart(i);
                }
                continue;
            }
            if !r.up && self.now >= r.restart_at {
                // Restart: the snapshot, then the committed log after it as the leader says; a
                // new process, so a new clock.
                r.up = true;
                r.clock = clock(
                    &self.clock_now,
                    &r.skew,
                    self.cfg.plant == Some(SimPlant::UnboundedClock),
                );
                let (idx, st) = r.snapshot.clone().unwrap_or((0, LogState::default()));
                let faults = r.state.faults;
                r.state = st;
                r.state.faults = faults;
                r.state.rebuild_index();
                r.applied = idx;
                r.commit = idx;
            }
        }
        for d in 0..DECODERS {
            let dec = &mut self.decoders[d];
            if !dec.up && self.now >= dec.restart_at {
                dec.up = true;
                dec.incarnation += 1;
                dec.next_poll = self.now;
                if let (Some(w), Some(real)) = (self.workers.as_mut(), self.real.as_ref()) {
                    // A stopped one still releasing by now is killed.
                    w.crash(d);
                    w.start(real, d, dec.name(d));
                }
            }
        }
    }

    // ------------------------------------------------------------ the replicated log

    fn lose_leader(&mut self) {
        self.leader = None;
        self.election_at = self.now + self.rng.random_range(150..300);
        // Proposals waiting at the lost leader get no answer (in doubt), unless they commit
        // under the next one; their callers time out.
    }

    /// A leader that cannot reach a majority is deposed once an election timeout passes; a new
    /// one is the most up-to-date replica of a reachable majority.
    fn elect(&mut self) {
        if let Some(l) = self.leader {
            let reach = (0..REPLICAS)
                .filter(|&j| self.replicas[j].up && self.linked(l, j))
                .count();
            if reach * 2 > REPLICAS {
                return;
            }
            if self.election_at == 0 || self.election_at < self.now.saturating_sub(1_000) {
                self.election_at = self.now + self.rng.random_range(150..300);
            }
            if self.now < self.election_at {
                return;
            }
        } else if self.now < self.election_at {
            return;
        }
        // Candidates in a random order; the first with a majority of voters whose logs are
        // not more up to date than its own wins.
        let mut order: Vec<usize> = (0..REPLICAS).collect();
        for i in (1..order.len()).rev() {
            let j = self.rng.random_range(0..=i);
            order.swap(i, j);
        }
        for c in order {
            if !self.replicas[c].voter() {
                continue;
            }
            let mine = (self.replicas[c].last_term(), self.replicas[c].log.len());
            let votes = (0..REPLICAS)
                .filter(|&v| {
                    self.replicas[v].voter()
                        && self.linked(c, v)
                        && (self.replicas[v].last_term(), self.replicas[v].log.len()) <= mine
                })
                .count();
            if votes * 2 > REPLICAS {
                self.term += 1;
                if self.leader != Some(c) {
                    self.counts.leader_changes += 1;
                }
                self.leader = Some(c);
                self.election_at = 0;
                self.propose(Command::NewLeader, None);
                return;
            }
        }
        self.election_at = self.now + self.rng.random_range(150..300);
    }

    /// The leader appends a stamped command to its log; `caller` waits for the answer.
    fn propose(&mut self, cmd: Command, caller: Option<u64>) -> bool {
        let Some(l) = self.leader else { return false };
        if let Some(real) = self.real.as_mut() {
            real.propose(l, cmd, caller);
            return true;
        }
        let r = &self.replicas[l];
        let log_ms = r.clock.stamp(r.state.log_ms);
        let term = self.term;
        self.replicas[l].log.push(Entry {
            term,
            req: Request::new(log_ms, cmd),
            caller,
        });
        true
    }

    /// Requests held in transit that arrive now go to the leader (in the order they were held:
    /// deterministic), and the leader's housekeeping `Tick` is due every `TICK_EVERY_MS`.
    fn arrivals(&mut self) {
        if self.in_transit.iter().any(|(at, _, _)| *at <= self.now) {
            let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.in_transit)
                .into_iter()
                .partition(|(at, _, _)| *at <= self.now);
            self.in_transit = later;
            for (_, cmd, id) in due {
                self.propose(cmd, Some(id));
            }
        }
        if self.now >= self.next_tick {
            self.next_tick = self.now + TICK_EVERY_MS;
            self.propose(
                Command::Tick {
                    retention_ms: self.retention_ms,
                },
                None,
            );
        }
    }

    fn replicate(&mut self) {
        self.arrivals();
        // Fsyncs.
        for r in self.replicas.iter_mut().filter(|r| r.up) {
            match r.fsync_at {
                Some(t) if self.now >= t => {
                    r.durable = r.log.len();
                    r.fsync_at = None;
                }
                None if r.durable < r.log.len() => {
                    r.fsync_at = Some(self.now + self.rng.random_range(FSYNC_MS.0..FSYNC_MS.1))
                }
                _ => {}
            }
        }
        let Some(l) = self.leader else { return };
        // The leader's log flows to the followers it reaches (a chance per millisecond).
        for f in 0..REPLICAS {
            if f == l || !self.replicas[f].up || !self.linked(l, f) || !self.rng.random_bool(0.5) {
                continue;
            }
            // Log matching: entries with the same index and term are the same, and so is
            // everything before them; the longest such prefix, found from the end.
            let mut same = self.replicas[f].log.len().min(self.replicas[l].log.len());
            while same > 0 && self.replicas[f].log[same - 1].term != self.replicas[l].log[same - 1].term {
                same -= 1;
            }
            let leader_commit = self.replicas[l].commit;
            let new: Vec<Entry> = self.replicas[l].log[same..].to_vec();
            let fr = &mut self.replicas[f];
            if same < fr.log.len() {
                // A conflicting tail (never committed) is cut, as Raft's log matching does.
                fr.log.truncate(same);
                fr.durable = fr.durable.min(same);
            }
            fr.log.extend(new);
            fr.commit = fr.commit.max(leader_commit.min(fr.durable));
        }
        // Commit: the highest index of the leader's term that a majority holds fsynced (or
        // merely holds, under the planted ack-before-fsync).
        let counted = |r: &Replica| {
            if self.cfg.plant == Some(SimPlant::AckBeforeFsync) {
                r.log.len()
            } else {
                r.durable
            }
        };
        let mut copies: Vec<usize> = (0..REPLICAS)
            .filter(|&j| self.replicas[j].up && self.linked(l, j))
            .map(|j| counted(&self.replicas[j]))
            .collect();
        copies.sort_unstable_by(|a, b| b.cmp(a));
        if copies.len() * 2 > REPLICAS {
            let quorum = copies[REPLICAS / 2];
            let leader = &mut self.replicas[l];
            if quorum > leader.commit && leader.log.get(quorum - 1).is_some_and(|e| e.term == self.term) {
                leader.commit = quorum;
            }
        }
        // Apply what is committed, everywhere; the leader answers its callers.
        for i in 0..REPLICAS {
            if !self.replicas[i].up {
                continue;
            }
            // (`applied` may pass the log's end: a restart from a snapshot of entries its disk
            // lost, which only a planted bug allows; nothing is applied twice then.)
            while self.replicas[i].applied < self.replicas[i].commit.min(self.replicas[i].log.len()) {
                let idx = self.replicas[i].applied;
                let entry = self.replicas[i].log[idx].clone();
                let mut changes = Changes::default();
                let resp = self.replicas[i].state.apply(&entry.req, &mut changes);
                self.replicas[i].applied += 1;
                if self.replicas[i].applied >= self.replicas[i].rejoin_at {
                    // Caught up, with what it holds on disk again: a member like any other
                    // (a later crash without disk loss keeps it one).
                    self.replicas[i].rejoin_at = 0;
                }
                if Some(i) == self.leader {
                    if let Some(call) = entry.caller {
                        let delay = self.rng.random_range(1..5);
                        if let Some(p) = self.calls.get_mut(&call) {
                            if p.answer.is_none() {
                                p.answer = Some((self.now + delay, resp));
                            }
                        }
                    }
                }
                let r = &mut self.replicas[i];
                if r.applied.is_multiple_of(SNAPSHOT_EVERY) {
                    let claimed = if self.cfg.plant == Some(SimPlant::SnapshotLag) {
                        r.applied.saturating_sub(SNAPSHOT_EVERY / 2)
                    } else {
                        r.applied
                    };
                    r.snapshot = Some((claimed, r.state.clone()));
                }
            }
        }
    }

    /// One millisecond of the real openraft cluster: links as the nemesis left them, arrivals,
    /// then the cluster runs up to now; the leader is whoever leads in the highest term, and
    /// the answers it gave go to their callers.
    fn real_step(&mut self) {
        let real = self.real.as_mut().expect("openraft core");
        real.set_links(&self.cut, &self.one_way, self.loss);
        self.arrivals();
        self.workers_step();
        let real = self.real.as_mut().expect("openraft core");
        real.advance_to(self.now);
        let now = self.now;
        self.disk_full.retain(|&(i, until)| {
            if now >= until {
                real.free(i);
            }
            now < until
        });
        for (i, how) in real.reap() {
            let what = match how {
                crate::sim_raft::Stopped::StorageError => {
                    self.counts.storage_exits += 1;
                    "a storage error"
                }
                crate::sim_raft::Stopped::Panic => {
                    self.counts.raft_panics += 1;
                    "a panic in openraft"
                }
            };
            let r = &mut self.replicas[i];
            r.up = false;
            r.restart_at = self.now + self.rng.random_range(50..500);
            self.faults_log.push(format!("{} n{i} stopped on {what}", self.now));
        }
        if let Some(w) = self.workers.as_mut() {
            for (d, name) in w.reap() {
                // Ended on its own (stuck, or a failure it does not survive): the supervisor
                // starts another incarnation. A stopped one was down already.
                let dec = &mut self.decoders[d];
                if dec.up {
                    dec.up = false;
                    dec.restart_at = self.now + self.rng.random_range(50..800);
                    self.counts.worker_exits += 1;
                    self.faults_log.push(format!("{} {name} exited", self.now));
                }
            }
        }
        let real = self.real.as_mut().expect("openraft core");
        let leader = real.leader();
        if leader.is_some() && leader != self.leader {
            self.counts.leader_changes += 1;
        }
        self.leader = leader;
        for (call, resp) in real.take_answers() {
            let delay = self.rng.random_range(1..5);
            if let Some(p) = self.calls.get_mut(&call) {
                if p.answer.is_none() {
                    p.answer = Some((self.now + delay, resp));
                }
            }
        }
    }

    /// The real workers' wire follows the nodes and the nemesis: servers for the nodes up,
    /// isolation, cut-off decoders whose time is up reconnected, and on a lossy network a
    /// connection broken now and then (what was in flight on it ends in doubt).
    fn workers_step(&mut self) {
        let (Some(w), Some(real)) = (self.workers.as_mut(), self.real.as_ref()) else {
            return;
        };
        w.sync_nodes(real);
        if self.isolated_applied != self.isolated_from_clients {
            self.isolated_applied = self.isolated_from_clients.clone();
            w.isolate(&self.isolated_applied);
        }
        for (d, dec) in self.decoders.iter_mut().enumerate() {
            if dec.paused_until != 0 && self.now >= dec.paused_until {
                dec.paused_until = 0;
                w.cut_off(d, false);
            }
        }
        if self.loss > 0.0 && self.rng.random_bool(self.loss / 20.0) {
            let k = self.rng.random_range(0..1_000);
            if w.break_one(k) {
                self.counts.connection_resets += 1;
            }
        }
    }

    /// `f` over replica `i`'s applied state and the log time there now (`None` while a real
    /// node is down).
    fn with_state<R>(&self, i: usize, f: impl FnOnce(&LogState, u64) -> R) -> Option<R> {
        match &self.real {
            Some(real) => {
                let m = real.machine(i)?;
                let now = real.log_now(i, m.log.log_ms);
                Some(f(&m.log, now))
            }
            None => {
                let r = &self.replicas[i];
                Some(f(&r.state, r.clock.now(r.state.log_ms)))
            }
        }
    }

    /// Replica `i`'s state with everything in its log applied, committed or not (the planted
    /// early visibility).
    fn early_state(&self, i: usize) -> Option<LogState> {
        let (mut s, rest) = match &self.real {
            Some(real) => {
                let m = real.machine(i)?;
                let applied = m.applied().map_or(0, |l| l.index);
                let s = m.log.clone();
                drop(m);
                (s, real.unapplied(i, applied))
            }
            None => {
                let r = &self.replicas[i];
                (
                    r.state.clone(),
                    r.log[r.applied.min(r.log.len())..]
                        .iter()
                        .map(|e| e.req.clone())
                        .collect(),
                )
            }
        };
        for req in &rest {
            s.apply(req, &mut Changes::default());
        }
        Some(s)
    }

    // ------------------------------------------------------------ calls

    /// Sends `cmd` to the leader for `who` (lost on the way when no leader is reachable: the
    /// call times out in doubt); the call's id.
    fn call(&mut self, who: Caller, cmd: Command, ops: Vec<usize>) -> u64 {
        let id = self.next_call;
        self.next_call += 1;
        let reachable = self.leader.is_some_and(|l| !self.isolated_from_clients.contains(&l));
        let lost = !reachable || self.rng.random_bool(self.loss);
        if !lost {
            // On a lossy link a request may also arrive twice, or late: held in transit past
            // later requests (its caller may have given up on it and sent them), then
            // delivered to whoever leads then.
            if self.loss > 0.0 && self.rng.random_bool(0.1) {
                self.counts.duplicates += 1;
                // Two deliveries are two effects. For an acquire they can differ (one refused
                // while the lease lives, the other, later, granted: a grant its decoder never
                // hears of), so the second delivery is an operation of its own in the history,
                // in doubt, by the same decoder as a separate client (`DUPLICATE_SUFFIX`).
                // Appends, renewals, releases and finishes carry their epoch and are idempotent.
                let shadows: Vec<(String, Call)> = ops
                    .iter()
                    .filter_map(|&o| match &self.ops[o].kind {
                        OpKind::Call {
                            call: c @ Call::Acquire { .. },
                            ..
                        } => Some((format!("{}{DUPLICATE_SUFFIX}", self.ops[o].decoder), c.clone())),
                        _ => None,
                    })
                    .collect();
                for (name, c) in shadows {
                    self.record(&name, c);
                }
                self.propose(cmd.clone(), Some(id));
            }
            if self.loss > 0.0 && self.rng.random_bool(0.05) {
                self.counts.delayed += 1;
                let at = self.now + self.rng.random_range(20..600);
                self.in_transit.push((at, cmd, id));
            } else {
                self.propose(cmd, Some(id));
            }
        }
        self.calls.insert(
            id,
            Pending {
                who,
                ops,
                deadline: self.now + CALL_TIMEOUT_MS,
                answer: None,
            },
        );
        id
    }

    /// Delivers the answers that arrived (an answer may be lost: the call ends in doubt), and
    /// times out the calls with none.
    fn deliver_answers(&mut self) {
        let due: Vec<u64> = self
            .calls
            .iter()
            .filter(|(_, p)| p.answer.as_ref().is_some_and(|(t, _)| *t <= self.now) || p.deadline <= self.now)
            .map(|(&k, _)| k)
            .collect();
        for k in due {
            let p = self.calls.remove(&k).expect("due");
            let answer = match p.answer {
                Some((t, resp)) if t <= self.now && !self.rng.random_bool(self.loss) => Some(resp),
                _ => None,
            };
            match p.who {
                Caller::Decoder(d) => self.decoder_answer(d, k, &p.ops, answer),
                Caller::Client(c) => self.client_answer(c, k, answer),
            }
        }
    }

    // ------------------------------------------------------------ decoders

    fn paused(&self, d: usize) -> bool {
        self.now < self.decoders[d].paused_until
    }

    fn decoders_step(&mut self) {
        if self.workers.is_some() {
            return;
        }
        for d in 0..DECODERS {
            if !self.decoders[d].up || self.paused(d) {
                continue;
            }
            if self.now >= self.decoders[d].next_poll {
                self.decoders[d].next_poll = self.now + 50;
                self.take_work(d);
            }
            if self.now >= self.decoders[d].next_renew {
                self.decoders[d].next_renew = self.now + LEASE_MS / 3;
                self.renew(d);
            }
            // Under openraft a decoder's client first finds the leader (as the real client
            // does) and sends nothing while none is known; the stand-in's decoders send blind.
            if self.real.is_some() && self.leader.is_none() {
                continue;
            }
            if self.decoders[d].append_in_flight.is_none() && self.now >= self.decoders[d].next_step {
                self.decoders[d].next_step = self.now + STEP_MS;
                self.send_append(d);
            }
        }
    }

    /// Renews every held lease (the real worker's renewer does, while a step is slow).
    fn renew(&mut self, d: usize) {
        let name = self.decoders[d].name(d);
        let held: Vec<(u64, u64)> = self.decoders[d].held.iter().map(|(&g, h)| (g, h.epoch)).collect();
        for (g, epoch) in held {
            if self.decoders[d].renews.values().any(|&(x, _)| x == g) {
                continue;
            }
            let cmd = Command::Renew {
                generation: g,
                epoch,
                decoder: name.clone(),
                lease_ms: LEASE_MS,
            };
            let id = self.call(Caller::Decoder(d), cmd, vec![]);
            self.decoders[d].renews.insert(id, (g, epoch));
        }
    }

    /// Looks at the leader's applied state for work (a read that may be stale) and acquires.
    fn take_work(&mut self, d: usize) {
        let dec = &self.decoders[d];
        let room = DECODER_CAPACITY.saturating_sub(dec.held.len() + dec.acquiring.len());
        if room == 0 {
            return;
        }
        let Some(l) = self.leader else { return };
        let pending = self
            .with_state(l, |st, now| {
                st.pending_work(&model(), now, 8)
                    .into_iter()
                    .map(|g| g.id)
                    .collect::<Vec<u64>>()
            })
            .unwrap_or_default();
        let want: Vec<u64> = pending
            .into_iter()
            .filter(|id| !dec.held.contains_key(id) && !dec.acquiring.contains(id))
            .take(room)
            .collect();
        for id in want {
            let name = self.decoders[d].name(d);
            let op = self.record(&name, Call::Acquire { gen: id });
            self.decoders[d].acquiring.insert(id);
            self.call(
                Caller::Decoder(d),
                Command::Acquire {
                    generation: id,
                    decoder: name,
                    lease_ms: LEASE_MS,
                    model: model(),
                    rng_version: 0,
                },
                vec![op],
            );
        }
    }

    /// One append carrying every held generation's tokens sampled since the acknowledged
    /// frontier (a re-send after a lost answer overlaps what may have committed).
    fn send_append(&mut self, d: usize) {
        let name = self.decoders[d].name(d);
        let mut items = Vec::new();
        let mut ops = Vec::new();
        let gens: Vec<u64> = self.decoders[d].held.keys().copied().collect();
        for g in gens {
            let h = self.decoders[d].held.get_mut(&g).expect("held");
            if h.finished_sent && h.next >= h.max_tokens {
                continue;
            }
            // Sample up to two tokens a step (several per append while the log is slow).
            let upto = (h.next + 2).min(h.max_tokens);
            let start = h.acked;
            let tokens: Vec<u32> = (start..upto).map(|s| token(g, s)).collect();
            h.next = upto;
            let finish = (upto == h.max_tokens).then(|| (FinishReason::Length, String::new()));
            if finish.is_some() {
                h.finished_sent = true;
            }
            let epoch = h.epoch;
            items.push(AppendItem {
                generation: g,
                epoch,
                start_seq: start,
                token_ids: tokens.clone(),
                finish: finish.clone(),
            });
            let op = self.record(
                &name,
                Call::Append {
                    gen: g,
                    epoch,
                    start_seq: start,
                    n: tokens.len() as u32,
                    finish: finish.is_some(),
                },
            );
            ops.push(op);
        }
        if items.is_empty() {
            return;
        }
        let id = self.call(
            Caller::Decoder(d),
            Command::Append {
                decoder: name,
                lease_ms: LEASE_MS,
                items,
            },
            ops,
        );
        self.decoders[d].append_in_flight = Some(id);
    }

    fn record(&mut self, decoder: &str, call: Call) -> usize {
        self.ops.push(DecoderOp {
            decoder: decoder.to_string(),
            invoke_us: self.us(),
            complete_us: None,
            kind: OpKind::Call { call, answer: None },
        });
        self.ops.len() - 1
    }

    fn complete(&mut self, op: usize, answer: Answer) {
        let now = self.us();
        let o = &mut self.ops[op];
        o.complete_us = Some(now.max(o.invoke_us + 1));
        if let OpKind::Call { answer: a, .. } = &mut o.kind {
            *a = Some(answer);
        }
    }

    fn decoder_answer(&mut self, d: usize, call: u64, ops: &[usize], answer: Option<Response>) {
        if let Some((g, epoch)) = self.decoders[d].renews.remove(&call) {
            // A renewal: a refused one drops the generation before anything more is sent.
            let held_at = self.decoders[d].held.get(&g).map(|h| h.epoch);
            if matches!(answer, Some(Response::Ownership(Err(_)))) && held_at == Some(epoch) {
                self.decoders[d].held.remove(&g);
            }
            return;
        }
        if self.decoders[d].append_in_flight == Some(call) {
            self.decoders[d].append_in_flight = None;
        }
        let stale = ops
            .first()
            .is_some_and(|&o| self.ops[o].decoder != self.decoders[d].name(d));
        match answer {
            None => {
                // In doubt: the ops stay open. An acquire in doubt is given up on; an append's
                // tokens are re-sent from the acknowledged frontier.
                for &o in ops {
                    if let OpKind::Call {
                        call: Call::Acquire { gen },
                        ..
                    } = self.ops[o].kind
                    {
                        self.decoders[d].acquiring.remove(&gen);
                    }
                }
                for h in self.decoders[d].held.values_mut() {
                    h.next = h.acked;
                    h.finished_sent = false;
                }
            }
            Some(Response::Ownership(r)) => {
                let Some(&o) = ops.first() else { return };
                let view = r.as_ref().ok();
                let rej = r.as_ref().err();
                // (A granted acquire never sees a terminal generation: one rule for both.)
                let terminal = view.is_some_and(|v| v.state.is_terminal()) || rej.is_some_and(rejected_terminal);
                let epoch = view.map_or(rej.map_or(0, |x| x.current_epoch), |v| v.lease.epoch);
                let frontier = view.map_or(rej.map_or(0, |x| x.frontier), |v| v.frontier);
                let OpKind::Call {
                    call: Call::Acquire { gen },
                    ..
                } = self.ops[o].kind
                else {
                    // A release.
                    self.complete(
                        o,
                        Answer::Release {
                            ok: Some(view.is_some()),
                            current_epoch: epoch,
                            frontier,
                            terminal,
                        },
                    );
                    return;
                };
                self.complete(
                    o,
                    Answer::Acquire {
                        ok: Some(view.is_some()),
                        epoch,
                        frontier,
                        terminal,
                    },
                );
                if stale {
                    return;
                }
                self.decoders[d].acquiring.remove(&gen);
                if let Some(v) = view {
                    self.counts.takeovers += u64::from(v.lease.epoch > 1);
                    self.decoders[d].held.insert(
                        gen,
                        Held {
                            epoch: v.lease.epoch,
                            acked: v.frontier,
                            next: v.frontier,
                            max_tokens: v.binding.stop.max_tokens,
                            finished_sent: false,
                        },
                    );
                }
            }
            Some(Response::Appended(outcomes)) => {
                for (k, &o) in ops.iter().enumerate() {
                    let Some(out) = outcomes.get(k) else { continue };
                    let (ok, current_epoch, reason, terminal) = match &out.result {
                        Ok(l) => (true, l.epoch, None, false),
                        Err(x) => (false, x.current_epoch, Some(x.reason), rejected_terminal(x)),
                    };
                    let frontier = match &out.result {
                        Err(x) => x.frontier,
                        Ok(_) => out.frontier,
                    };
                    self.complete(
                        o,
                        Answer::Append {
                            ok: Some(ok),
                            frontier,
                            current_epoch,
                            reason: reason.map(|r| tokenlog_raftlog::convert::reject_reason_to_pb(r) as i32),
                            terminal,
                        },
                    );
                    if stale {
                        continue;
                    }
                    let g = out.generation;
                    let Some(h) = self.decoders[d].held.get_mut(&g) else {
                        continue;
                    };
                    match (&out.result, reason) {
                        (Ok(_), _) => {
                            h.acked = h.acked.max(out.frontier.min(h.next));
                            if h.finished_sent && h.acked >= h.max_tokens {
                                self.decoders[d].held.remove(&g);
                            }
                        }
                        (Err(_), Some(RejectReason::SeqMismatch)) => {
                            h.acked = frontier;
                            h.next = frontier;
                            h.finished_sent = false;
                        }
                        // Fenced out, ended, or over: drop it.
                        _ => {
                            self.decoders[d].held.remove(&g);
                        }
                    }
                }
            }
            Some(_) => {}
        }
    }

    // ------------------------------------------------------------ clients

    fn clients_step(&mut self) {
        for c in 0..CLIENTS {
            if self.clients[c].rec.is_none() {
                if self.stop_new || self.now < self.clients[c].next_try {
                    continue;
                }
                self.start_request(c);
            }
            self.client_read(c);
        }
    }

    fn start_request(&mut self, c: usize) {
        let cl = &mut self.clients[c];
        let rid = format!("c{c}-{}", cl.k);
        cl.k += 1;
        let max_tokens = self.rng.random_range(4..40);
        let cancel_after = self
            .rng
            .random_bool(0.1)
            .then(|| self.rng.random_range(1..=max_tokens as usize / 2));
        let rec = RequestRecord {
            client: c,
            request_id: rid,
            invoke_us: self.us(),
            complete_us: 0,
            generation: 0,
            first_event_us: None,
            events: vec![],
            connections: 1,
            finished: false,
            finish_reason: String::new(),
            error: None,
            status_after: None,
            generations: vec![],
            max_tokens,
            ignore_eos: true,
            text: String::new(),
            cancel_sent_us: None,
        };
        let cl = &mut self.clients[c];
        cl.rec = Some(rec);
        cl.generation = 0;
        cl.next_seq = 0;
        cl.cancel_after = cancel_after;
        cl.cancel_in_flight = None;
        self.submit(c);
    }

    fn binding(&self, max_tokens: u32) -> Binding {
        // The real workers' sampler scheme (the stand-in decoders acquire with 0).
        let rng_version = if self.workers.is_some() {
            tokenlog_decoder::sampler::RNG_VERSION
        } else {
            0
        };
        Binding {
            model: self.model.clone(),
            sampling: tokenlog_raftlog::types::SamplingConfig {
                rng_version,
                ..Default::default()
            },
            prompt_token_ids: vec![1, 2, 3],
            stop: StopConfig {
                max_tokens,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn submit(&mut self, c: usize) {
        let rec = self.clients[c].rec.as_ref().expect("a request");
        let cmd = Command::Submit {
            tenant: "sim".into(),
            request_id: rec.request_id.clone(),
            binding: self.binding(rec.max_tokens),
        };
        let id = self.call(Caller::Client(c), cmd, vec![]);
        self.clients[c].submitting = Some(id);
    }

    fn client_answer(&mut self, c: usize, call: u64, answer: Option<Response>) {
        if self.clients[c].cancel_in_flight == Some(call) {
            self.clients[c].cancel_in_flight = None;
            return;
        }
        if self.clients[c].submitting != Some(call) {
            return;
        }
        self.clients[c].submitting = None;
        match answer {
            Some(Response::Submitted { generation, .. }) => self.clients[c].generation = generation.id,
            // Lost or refused: submit again (idempotent by request id).
            _ => self.submit(c),
        }
    }

    /// The client's stream: committed records of its generation past the last seq it saw, as
    /// the connected node's applied state holds them (or, planted, that node's whole log).
    fn client_read(&mut self, c: usize) {
        let gen = self.clients[c].generation;
        if gen == 0 {
            return;
        }
        // The watch is served by the node the client is connected to, from that node's applied
        // state (a follower may lag: a prefix). The client reconnects, resuming from the next
        // seq it wants, to a node drawn at random when its node is down or cut off from
        // clients, when nothing new came for `WATCH_STALL_MS`, and now and then.
        let l = self.clients[c].node;
        let unusable = !self.replicas[l].up || self.isolated_from_clients.contains(&l);
        let since = self.now - self.clients[c].progress_at;
        if unusable && since < RECONNECT_MS {
            return;
        }
        if unusable || since >= WATCH_STALL_MS || self.rng.random_bool(0.001) {
            let to = self.rng.random_range(0..REPLICAS);
            let cl = &mut self.clients[c];
            cl.node = to;
            cl.progress_at = self.now;
            if let Some(rec) = cl.rec.as_mut() {
                rec.connections += 1;
            }
            self.counts.reconnects += 1;
            return;
        }
        let seen = |st: &LogState| {
            st.generations.get(&gen).map(|g| {
                (
                    g.records.iter().map(|r| (r.token_id, r.epoch)).collect::<Vec<_>>(),
                    g.state.is_terminal(),
                    g.finish_reason.map(|r| r.as_str().to_string()).unwrap_or_default(),
                    g.lease.epoch,
                    g.state.name().to_string(),
                )
            })
        };
        let seen = if self.cfg.plant == Some(SimPlant::EarlyVisibility) {
            // Planted: the leader's log applied past its commit index.
            self.early_state(l).and_then(|st| seen(&st))
        } else {
            self.with_state(l, |st, _| seen(st)).flatten()
        };
        let Some((records, terminal, reason, epoch, state)) = seen else {
            return;
        };
        let now_us = self.us();
        let cl = &mut self.clients[c];
        let rec = cl.rec.as_mut().expect("a request");
        if (cl.next_seq as usize) < records.len() {
            cl.progress_at = self.now;
        }
        while (cl.next_seq as usize) < records.len() {
            let (t, e) = records[cl.next_seq as usize];
            rec.first_event_us.get_or_insert(now_us);
            rec.events.push((cl.next_seq, t, e, false));
            if !rec.generations.contains(&gen) {
                rec.generations.push(gen);
            }
            rec.generation = gen;
            cl.next_seq += 1;
        }
        if terminal && cl.next_seq as usize == records.len() {
            // Read it now, as committed, before retention may prune it.
            let at = (now_us, now_us + 1);
            if let Some(f) = self
                .with_state(l, |st, _| st.generations.get(&gen).map(|g| final_gen(g, at)))
                .flatten()
            {
                self.at_finish.insert(gen, f);
            }
            let cl = &mut self.clients[c];
            let rec = cl.rec.as_mut().expect("a request");
            rec.events.push((cl.next_seq, 0, epoch, true));
            rec.generation = gen;
            if !rec.generations.contains(&gen) {
                rec.generations.push(gen);
            }
            rec.finished = true;
            rec.finish_reason = reason.clone();
            rec.complete_us = now_us;
            rec.status_after = Some(StatusSeen {
                state,
                frontier: cl.next_seq,
                generation: gen,
                finish_reason: reason,
            });
            let done = cl.rec.take().expect("a request");
            cl.done.push(done);
            cl.next_try = self.now + 5;
            return;
        }
        if let Some(k) = cl.cancel_after {
            if rec.events.len() >= k && rec.cancel_sent_us.is_none() {
                rec.cancel_sent_us = Some(now_us);
                let cmd = Command::Cancel {
                    tenant: "sim".into(),
                    request_id: rec.request_id.clone(),
                };
                let id = self.call(Caller::Client(c), cmd, vec![]);
                self.clients[c].cancel_in_flight = Some(id);
            }
        }
    }

    // ------------------------------------------------------------ the end

    fn conclude(mut self) -> SimOutcome {
        let mut reqs: Vec<RequestRecord> = Vec::new();
        for c in &mut self.clients {
            reqs.append(&mut c.done);
            if let Some(r) = c.rec.take() {
                reqs.push(r);
            }
        }
        if let Some(w) = &self.workers {
            // The real workers' histories, as the fault suite reads its decoders' files.
            self.ops = crate::harness::decoder_ops::join(w.lines());
            self.ops.sort_by_key(|o| o.invoke_us);
            self.counts.takeovers = self
                .ops
                .iter()
                .filter(|o| o.op() == "acquire" && o.ok() == Some(true) && o.epoch() > 1)
                .count() as u64;
        }
        self.counts.requests = reqs.len() as u64;
        self.counts.tokens = reqs.iter().map(|r| r.events.len() as u64).sum();
        self.counts.indeterminate_ops = self.ops.iter().filter(|o| o.ok().is_none()).count() as u64;
        // The final read waits for every replica to catch up (convergence): a client may have
        // read a follower whose applied state was ahead of the leader's.
        let convergence = self.convergence();
        let l = self.leader.unwrap_or(0);
        let read = (self.us(), self.us() + 1);
        let (mut finals, log_gens): (HashMap<u64, FinalGen>, Vec<(u64, String)>) = self
            .with_state(l, |st, _| {
                (
                    st.generations.values().map(|g| (g.id, final_gen(g, read))).collect(),
                    st.generations.values().map(|g| (g.id, g.request_id.clone())).collect(),
                )
            })
            .unwrap_or_default();
        for (id, f) in std::mem::take(&mut self.at_finish) {
            if let std::collections::hash_map::Entry::Vacant(e) = finals.entry(id) {
                e.insert(f);
                self.counts.pruned += 1;
            }
        }
        let mut verdicts = BTreeMap::new();
        verdicts.insert("exactly-once".into(), checks::exactly_once(&reqs, &finals, &log_gens));
        verdicts.insert("durability".into(), checks::durability(&reqs, &self.ops, &finals));
        verdicts.insert("fencing".into(), checks::fencing(&self.ops, &finals));
        let (mut lin, _) = checks::linearizability(&self.ops, &finals, LIN_BUDGET);
        if lin.problems.iter().any(|p| p.starts_with("unknown")) {
            // The search ran out of budget (many operations in doubt in one generation): once
            // more with a larger one before calling the seed undecided.
            lin = checks::linearizability(&self.ops, &finals, LIN_BUDGET_RETRY).0;
        }
        verdicts.insert("linearizability".into(), lin);
        verdicts.insert("status".into(), checks::status(&reqs));
        verdicts.insert("completion".into(), checks::completion(&reqs, &finals, None));
        // No decoders-down windows here: every request must finish, none fail.
        verdicts.insert(
            "liveness".into(),
            checks::liveness(&reqs, &[], LEASE_MS, tokenlog_raftlog::limits::UNOWNED_MS_DEFAULT),
        );
        let lost = self.workers.as_ref().map(|w| w.sessions_lost()).unwrap_or_default();
        verdicts.insert(
            "lease-time".into(),
            checks::lease_time_with_sessions_lost(&self.ops, LEASE_MS, &lost),
        );
        verdicts.insert("convergence".into(), convergence);
        if let Some(real) = &self.real {
            self.counts.duplicates += real.duplicates();
        }
        let history_hash = self.history_hash(&reqs);
        if let Ok(dir) = std::env::var("TOKENLOG_SIM_DUMP") {
            self.dump(std::path::Path::new(&dir), &reqs, &finals);
        }
        SimOutcome {
            seed: self.cfg.seed,
            verdicts,
            history_hash,
            counts: self.counts.clone(),
        }
    }

    /// Every replica, caught up, holds the same state (applied index and whole state).
    fn convergence(&mut self) -> Verdict {
        self.catch_up();
        let states: Vec<Option<(u64, LogState)>> = match &self.real {
            Some(real) => real.applied(),
            None => self
                .replicas
                .iter()
                .map(|r| Some((r.applied as u64, r.state.clone())))
                .collect(),
        };
        same_states(&states, if self.real.is_some() { 'n' } else { 'r' })
    }

    /// Runs on without faults until every replica is up and has applied the leader's commit
    /// index (or a bound passes).
    fn catch_up(&mut self) {
        if self.real.is_some() {
            for _ in 0..5_000 {
                self.advance();
                self.restarts();
                self.real_step();
                let real = self.real.as_ref().expect("openraft core");
                let Some(commit) = real.committed() else { continue };
                if real
                    .applied()
                    .iter()
                    .all(|a| a.as_ref().is_some_and(|(i, _)| *i == commit))
                {
                    return;
                }
            }
            return;
        }
        for _ in 0..2_000 {
            self.advance();
            self.restarts();
            self.elect();
            self.replicate();
            let Some(l) = self.leader else { continue };
            let commit = self.replicas[l].commit;
            if self.replicas.iter().all(|r| r.up && r.applied == commit) {
                return;
            }
        }
    }

    /// Writes the seed's history (`TOKENLOG_SIM_DUMP=DIR`): `DIR/seed-S.jsonl`, one JSON object
    /// a line: decoder operations (as the fault suite's `history.jsonl`), client requests, the
    /// fault log, and each generation's final state.
    fn dump(&self, dir: &std::path::Path, reqs: &[RequestRecord], finals: &HashMap<u64, FinalGen>) {
        let mut out = String::new();
        for o in &self.ops {
            out += &format!("{}\n", serde_json::json!({"op": o.to_json()}));
        }
        for r in reqs {
            out += &format!("{}\n", serde_json::json!({"request": r}));
        }
        for f in &self.faults_log {
            out += &format!("{}\n", serde_json::json!({"fault": f}));
        }
        let finals: BTreeMap<_, _> = finals.iter().collect();
        for (g, f) in finals {
            out += &format!(
                "{}\n",
                serde_json::json!({"final": {"generation": g, "epoch": f.epoch, "frontier": f.records.len(),
                    "terminal": f.terminal, "state": f.state, "records": f.records, "read_us": f.read_us}})
            );
        }
        let path = dir.join(format!("seed-{}.jsonl", self.cfg.seed));
        if let Err(e) = std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, out)) {
            eprintln!("sim: cannot write {}: {e}", path.display());
        }
    }

    fn history_hash(&self, reqs: &[RequestRecord]) -> String {
        let mut h = Sha256::new();
        for o in &self.ops {
            h.update(o.to_json().to_string());
        }
        for r in reqs {
            h.update(serde_json::to_string(r).unwrap_or_default());
        }
        for f in &self.faults_log {
            h.update(f);
        }
        hex(&h.finalize())
    }
}

/// `convergence` over each replica's (applied index, state), `None` for one that is down:
/// every replica up, at the same index, with the same state (as a digest; where two differ,
/// the first difference). Replicas are named `{prefix}0`, `{prefix}1`, ...
fn same_states(states: &[Option<(u64, LogState)>], prefix: char) -> Verdict {
    let mut v = Verdict::new();
    v.checked = states.len();
    let digests: Vec<Option<(u64, String)>> = states
        .iter()
        .map(|a| {
            a.as_ref()
                .map(|(i, st)| (*i, hex(&Sha256::digest(serde_json::to_vec(st).unwrap_or_default()))))
        })
        .collect();
    let Some(Some(first)) = digests.first().cloned() else {
        v.fail(format!("replica {prefix}0 is not up after healing"));
        return v;
    };
    for (i, d) in digests.iter().enumerate().skip(1) {
        match d {
            None => v.fail(format!("replica {prefix}{i} is not up after healing")),
            Some(d) if d.0 == first.0 && d.1 != first.1 => {
                let differs = match (&states[0], &states[i]) {
                    (Some((_, a)), Some((_, b))) => first_difference(a, b).unwrap_or_default(),
                    _ => String::new(),
                };
                v.fail(format!(
                    "replicas {prefix}0 and {prefix}{i} applied up to the same index {} but hold different states: {differs}",
                    d.0
                ))
            }
            Some(d) if d.0 != first.0 => v.fail(format!(
                "replica {prefix}{i} applied up to index {}, {prefix}0 {}: never caught up",
                d.0, first.0
            )),
            Some(_) => {}
        }
    }
    v
}

/// Where two states differ first: a generation (both sides' view of it) or a field.
fn first_difference(a: &LogState, b: &LogState) -> Option<String> {
    let ids: BTreeSet<u64> = a.generations.keys().chain(b.generations.keys()).copied().collect();
    for id in ids {
        let (x, y) = (a.generations.get(&id), b.generations.get(&id));
        if x != y {
            let (Some(x), Some(y)) = (x, y) else {
                return Some(format!("generation {id}: present on one side only"));
            };
            // The fields that differ, as JSON (records by count and last).
            let (a, b) = (serde_json::to_value(x).ok()?, serde_json::to_value(y).ok()?);
            let fields: Vec<String> = a
                .as_object()?
                .iter()
                .filter(|(k, v)| b.get(k.as_str()) != Some(v))
                .map(|(k, v)| {
                    let w = &b[k.as_str()];
                    match (v.as_array(), w.as_array()) {
                        (Some(p), Some(q)) => {
                            let at = p
                                .iter()
                                .zip(q)
                                .position(|(e, f)| e != f)
                                .unwrap_or(p.len().min(q.len()));
                            format!(
                                "{k}: {} vs {} items, first difference at {at}: {} vs {}",
                                p.len(),
                                q.len(),
                                p.get(at).cloned().unwrap_or_default(),
                                q.get(at).cloned().unwrap_or_default()
                            )
                        }
                        _ => format!("{k}: {v} vs {w}"),
                    }
                })
                .collect();
            return Some(format!("generation {id} ({}): {}", x.state.name(), fields.join("; ")));
        }
    }
    (serde_json::to_value(a).ok() != serde_json::to_value(b).ok()).then(|| {
        format!(
            "next_generation {} vs {}, log_ms {} vs {}, decoders {} vs {}",
            a.next_generation,
            b.next_generation,
            a.log_ms,
            b.log_ms,
            a.decoders.len(),
            b.decoders.len()
        )
    })
}

/// A generation as a final read sees it.
fn final_gen(g: &Generation, read_us: (u64, u64)) -> FinalGen {
    FinalGen {
        records: g.records.iter().map(|r| (r.token_id, r.epoch)).collect(),
        terminal: g.state.is_terminal(),
        state: g.state.name().to_string(),
        epoch: g.lease.epoch,
        read_us,
    }
}

/// A rejection that says the generation is over (terminal, or pruned: not found).
fn rejected_terminal(x: &Rejection) -> bool {
    x.state.is_some_and(|s| s.is_terminal()) || x.reason == RejectReason::NotFound
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs seeds `start..start + n`; calls `each` with every outcome.
pub fn run_seeds(
    start: u64,
    n: u64,
    time_ms: u64,
    plant: Option<SimPlant>,
    core: SimCore,
    mut each: impl FnMut(&SimOutcome),
) {
    for seed in start..start + n {
        let out = run(&SimConfig {
            seed,
            time_ms,
            plant,
            core,
        });
        each(&out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_bit_for_bit() {
        let a = run(&SimConfig::new(7));
        let b = run(&SimConfig::new(7));
        assert_eq!(a.history_hash, b.history_hash);
        assert_eq!(a.counts, b.counts);
        assert_ne!(a.history_hash, run(&SimConfig::new(8)).history_hash);
    }

    #[test]
    fn an_openraft_seed_replays_bit_for_bit() {
        let cfg = SimConfig {
            core: SimCore::Openraft,
            ..SimConfig::new(1)
        };
        let a = run(&cfg);
        let b = run(&cfg);
        assert_eq!(a.history_hash, b.history_hash);
        assert_eq!(a.counts, b.counts);
    }

    #[test]
    fn seeds_show_no_violation() {
        let mut total = SimCounts::default();
        run_seeds(1, 20, 6_000, None, SimCore::StandIn, |o| {
            assert!(o.ok(), "seed {}: {:?}", o.seed, o.first_violation());
            total.add(&o.counts);
        });
        assert!(
            total.crashes > 0 && total.leader_changes > 0 && total.takeovers > 0,
            "{total:?}"
        );
        assert!(total.requests > 0 && total.tokens > 0, "{total:?}");
    }
}
