//! The state machine of a node: a [`LogState`] in memory, made durable by snapshot files
//! ([`crate::snapshot`]) together with the Raft log after them. `apply` does no I/O.
//!
//! - The last applied log id and membership live with the state, under the same lock
//!   ([`Machine`]): a snapshot, built from a copy taken under that lock, always holds exactly the
//!   entries up to the index it claims.
//! - A snapshot is encoded and written from that copy, outside the lock apply needs, and put in
//!   place atomically; Raft purges log entries only up to a snapshot already on disk.
//! - Restart loads the newest snapshot (checksum verified first), recomputes every generation's
//!   hash chain and compares it with the snapshot's chain head; openraft then re-applies the
//!   committed log after it (apply is pure, so the state comes out the same). Any mismatch is a
//!   problem in the [`LoadReport`], and a node with problems does not serve.

use std::io;
use std::ops::Deref;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use futures::{Stream, TryStreamExt};
use openraft::storage::{EntryResponder, RaftStateMachine};
use openraft::{EntryPayload, OptionalSend, RaftSnapshotBuilder};
use serde::{Deserialize, Serialize};

use crate::chain;
use crate::faults::Faults;
use crate::raft_types::{LogId, Snapshot, SnapshotData, SnapshotMeta, StoredMembership, TypeConfig};
use crate::snapshot::{PartialSnapshot, SnapshotDir, SnapshotFile};
use crate::state::{Changes, LogState};
use crate::types::*;

/// The applied state and the Raft metadata that goes with it, always changed together.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Machine {
    pub log: LogState,
    applied: Option<LogId>,
    membership: StoredMembership,
    /// The snapshot file that holds the records of the generations kept on disk only
    /// ([`Generation::cold`]): the newest one this state was loaded from or written to.
    #[serde(skip)]
    cold_file: Option<SnapshotFile>,
}

/// A snapshot body of format 9: the machine (generations on disk with no records in it), then
/// where in the file each of those generations' records are.
#[derive(Serialize, Deserialize)]
struct Body {
    machine: Machine,
    cold: Vec<(GenerationId, ColdRef)>,
}

/// Why the records of a generation kept on disk cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ColdReadError {
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error("generation {0}: its records on disk do not hash to its chain head")]
    Chain(GenerationId),
    #[error("generation {0}: its records are on disk, and no snapshot file is open")]
    NoFile(GenerationId),
}

impl Deref for Machine {
    type Target = LogState;
    fn deref(&self) -> &LogState {
        &self.log
    }
}

impl Machine {
    pub fn applied(&self) -> Option<LogId> {
        self.applied
    }

    /// Applies one committed entry in log order: the step every replica takes, the same on all
    /// of them (the deterministic simulation runs this too). A membership entry becomes the
    /// stored membership; a normal one goes to [`LogState::apply`].
    pub fn apply_entry(
        &mut self,
        log_id: LogId,
        payload: EntryPayload<Request, u64, crate::raft_types::Node>,
        changes: &mut Changes,
    ) -> Response {
        let response = match payload {
            EntryPayload::Blank => Response::None,
            EntryPayload::Membership(mem) => {
                self.membership = StoredMembership::new(Some(log_id), mem);
                Response::None
            }
            EntryPayload::Normal(req) => self.log.apply(&req, changes),
        };
        self.applied = Some(log_id);
        response
    }

    /// A generation's records, from memory or, when it is kept on disk only, read from the
    /// snapshot file and checked against its chain head.
    pub fn records_of<'a>(&'a self, g: &'a Generation) -> Result<std::borrow::Cow<'a, [Record]>, ColdReadError> {
        match g.cold {
            None => Ok(std::borrow::Cow::Borrowed(&g.records)),
            Some(r) => {
                let file = self.cold_file.as_ref().ok_or(ColdReadError::NoFile(g.id))?;
                read_cold(file, g, &r).map(std::borrow::Cow::Owned)
            }
        }
    }

    /// The snapshot file holding the records of the generations kept on disk (cheap to clone:
    /// read from it without the state lock).
    pub fn cold_file(&self) -> Option<&SnapshotFile> {
        self.cold_file.as_ref()
    }

    /// The snapshot meta of this applied state: the last applied log id and the membership.
    pub fn meta(&self) -> SnapshotMeta {
        SnapshotMeta {
            last_log_id: self.applied,
            last_membership: self.membership.clone(),
        }
    }
}

/// Shared between the Raft state machine task and the read paths (Watch, Get, PendingWork).
pub struct SmShared {
    state: RwLock<Machine>,
    snapshots: SnapshotDir,
    /// The log time of the last applied entry (also in the state; here for lock-free stamping).
    log_ms: AtomicU64,
    /// Bumped after every apply batch and snapshot install; readers wait on it.
    applied_tx: tokio::sync::watch::Sender<u64>,
    faults: Faults,
    /// One snapshot build at a time (the cold records of one go into the next).
    building: tokio::sync::Mutex<()>,
}

#[derive(Clone)]
pub struct SmStore {
    shared: Arc<SmShared>,
}

/// A node's applied state as a digest ([`SmShared::digest`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateDigest {
    pub applied_index: u64,
    pub digest: [u8; 32],
    pub generations: u64,
    pub records: u64,
}

/// What loading or verifying found.
#[derive(Debug, Default)]
pub struct LoadReport {
    pub generations: u64,
    pub records: u64,
    /// The snapshot loaded (0: none).
    pub snapshot_index: u64,
    /// Integrity problems, each naming what is broken. A node with any does not serve.
    pub problems: Vec<String>,
}

/// The records `r` names in `file`, checked against `g`'s chain head.
pub fn read_cold(file: &SnapshotFile, g: &Generation, r: &ColdRef) -> Result<Vec<Record>, ColdReadError> {
    let records = file.read_records(r)?;
    if chain::head(g.id, &records) != g.chain_head {
        return Err(ColdReadError::Chain(g.id));
    }
    Ok(records)
}

/// Recomputes every generation's hash chain from its records (read from the snapshot file for
/// generations kept on disk, one at a time) and compares it with the stored chain head.
/// Returns the record count; mismatches go to `problems`.
pub fn check_chains(m: &Machine, problems: &mut Vec<String>) -> u64 {
    let mut records = 0;
    for g in m.generations.values() {
        records += g.frontier() as u64;
        let ok = match m.records_of(g) {
            Ok(r) => chain::head(g.id, &r) == g.chain_head,
            Err(e) => {
                problems.push(format!("request {:?} (generation {}): {e}", g.request_id, g.id));
                continue;
            }
        };
        if !ok {
            problems.push(format!(
                "request {:?} (generation {}): its {} records do not hash to its chain head",
                g.request_id,
                g.id,
                g.frontier()
            ));
        }
    }
    records
}

type DecodersV4 = std::collections::BTreeMap<String, DecoderInfoV4>;

fn decoders_from(d: DecodersV4) -> std::collections::BTreeMap<String, DecoderInfo> {
    d.into_iter().map(|(k, v)| (k, v.into())).collect()
}

/// A [`Machine`] as snapshot format 3 encoded it: the state without its tokenizer, session and
/// handoff tables.
#[derive(Deserialize)]
struct MachineV3 {
    log: LogStateV3,
    applied: Option<LogId>,
    membership: StoredMembership,
}

/// The serialized fields of [`LogState`] in format 3, in their order.
#[derive(Deserialize)]
struct LogStateV3 {
    generations: std::collections::BTreeMap<GenerationId, Generation>,
    next_generation: GenerationId,
    log_ms: u64,
    decoders: DecodersV4,
}

impl From<MachineV3> for Machine {
    fn from(m: MachineV3) -> Machine {
        Machine {
            log: LogState {
                generations: m.log.generations,
                next_generation: m.log.next_generation,
                log_ms: m.log.log_ms,
                decoders: decoders_from(m.log.decoders),
                ..LogState::default()
            },
            applied: m.applied,
            membership: m.membership,
            cold_file: None,
        }
    }
}

/// A [`Machine`] as snapshot format 4 encoded it: without the handoff table.
#[derive(Deserialize)]
struct MachineV4 {
    log: LogStateV4,
    applied: Option<LogId>,
    membership: StoredMembership,
}

/// The serialized fields of [`LogState`] in format 4, in their order.
#[derive(Deserialize)]
struct LogStateV4 {
    generations: std::collections::BTreeMap<GenerationId, Generation>,
    next_generation: GenerationId,
    log_ms: u64,
    decoders: DecodersV4,
    tokenizers: std::collections::BTreeMap<String, TokenizerPackage>,
    sessions: std::collections::BTreeMap<String, u64>,
}

impl From<MachineV4> for Machine {
    fn from(m: MachineV4) -> Machine {
        Machine {
            log: LogState {
                generations: m.log.generations,
                next_generation: m.log.next_generation,
                log_ms: m.log.log_ms,
                decoders: decoders_from(m.log.decoders),
                tokenizers: m.log.tokenizers,
                sessions: m.log.sessions,
                ..LogState::default()
            },
            applied: m.applied,
            membership: m.membership,
            cold_file: None,
        }
    }
}

/// A [`Machine`] as snapshot format 5 encoded it: without the pipeline compositions.
#[derive(Deserialize)]
struct MachineV5 {
    log: LogStateV5,
    applied: Option<LogId>,
    membership: StoredMembership,
}

/// The serialized fields of [`LogState`] in format 5, in their order.
#[derive(Deserialize)]
struct LogStateV5 {
    generations: std::collections::BTreeMap<GenerationId, Generation>,
    next_generation: GenerationId,
    log_ms: u64,
    decoders: std::collections::BTreeMap<String, DecoderInfo>,
    tokenizers: std::collections::BTreeMap<String, TokenizerPackage>,
    sessions: std::collections::BTreeMap<String, u64>,
    handoffs: std::collections::BTreeMap<GenerationId, Handoff>,
    next_handoff: u64,
}

impl From<MachineV5> for Machine {
    fn from(m: MachineV5) -> Machine {
        Machine {
            log: LogState {
                generations: m.log.generations,
                next_generation: m.log.next_generation,
                log_ms: m.log.log_ms,
                decoders: m.log.decoders,
                tokenizers: m.log.tokenizers,
                sessions: m.log.sessions,
                handoffs: m.log.handoffs,
                next_handoff: m.log.next_handoff,
                ..LogState::default()
            },
            applied: m.applied,
            membership: m.membership,
            cold_file: None,
        }
    }
}

/// A [`Machine`] as snapshot format 6 encoded it: without the stage registrations.
#[derive(Deserialize)]
struct MachineV6 {
    log: LogStateV6,
    applied: Option<LogId>,
    membership: StoredMembership,
}

/// The serialized fields of [`LogState`] in format 6, in their order.
#[derive(Deserialize)]
struct LogStateV6 {
    generations: std::collections::BTreeMap<GenerationId, Generation>,
    next_generation: GenerationId,
    log_ms: u64,
    decoders: std::collections::BTreeMap<String, DecoderInfo>,
    tokenizers: std::collections::BTreeMap<String, TokenizerPackage>,
    sessions: std::collections::BTreeMap<String, u64>,
    handoffs: std::collections::BTreeMap<GenerationId, Handoff>,
    next_handoff: u64,
    pipelines: std::collections::BTreeMap<String, Pipeline>,
    next_pipeline_epoch: u64,
}

impl From<MachineV6> for Machine {
    fn from(m: MachineV6) -> Machine {
        Machine {
            log: LogState {
                generations: m.log.generations,
                next_generation: m.log.next_generation,
                log_ms: m.log.log_ms,
                decoders: m.log.decoders,
                tokenizers: m.log.tokenizers,
                sessions: m.log.sessions,
                handoffs: m.log.handoffs,
                next_handoff: m.log.next_handoff,
                pipelines: m.log.pipelines,
                next_pipeline_epoch: m.log.next_pipeline_epoch,
                ..LogState::default()
            },
            applied: m.applied,
            membership: m.membership,
            cold_file: None,
        }
    }
}

/// A [`Machine`] as snapshot format 7 encoded it: without the hot standbys.
#[derive(Deserialize)]
struct MachineV7 {
    log: LogStateV7,
    applied: Option<LogId>,
    membership: StoredMembership,
}

/// The serialized fields of [`LogState`] in format 7: format 6's, then the stage registrations
/// (bincode writes a nested struct's fields in place, so this is the same byte layout).
#[derive(Deserialize)]
struct LogStateV7 {
    v6: LogStateV6,
    stages: std::collections::BTreeMap<String, StageRegistration>,
}

impl From<MachineV7> for Machine {
    fn from(m: MachineV7) -> Machine {
        let mut out = Machine::from(MachineV6 {
            log: m.log.v6,
            applied: m.applied,
            membership: m.membership,
        });
        out.log.stages = m.log.stages;
        out
    }
}

/// Loads and checks a snapshot file: checksum, decoding, the meta against the body, every chain.
pub fn load_snapshot(file: &SnapshotFile, problems: &mut Vec<String>) -> Option<(SnapshotMeta, Machine)> {
    let loaded = match file.format() {
        Ok(3) => file.load::<MachineV3>().map(|(meta, m)| (meta, Machine::from(m))),
        Ok(4) => file.load::<MachineV4>().map(|(meta, m)| (meta, Machine::from(m))),
        Ok(5) => file.load::<MachineV5>().map(|(meta, m)| (meta, Machine::from(m))),
        Ok(6) => file.load::<MachineV6>().map(|(meta, m)| (meta, Machine::from(m))),
        Ok(7) => file.load::<MachineV7>().map(|(meta, m)| (meta, Machine::from(m))),
        Ok(8) => file.load::<Machine>(),
        _ => file.load::<Body>().and_then(|(meta, b)| {
            let Body { mut machine, cold } = b;
            for (id, r) in cold {
                match machine.log.generations.get_mut(&id) {
                    Some(g) if g.records.is_empty() && g.cold.is_none() => g.cold = Some(r),
                    _ => {
                        return Err(crate::snapshot::SnapshotError::Corrupt {
                            path: file.path().display().to_string(),
                            what: format!("records on disk for generation {id}, which has none to put there"),
                        })
                    }
                }
            }
            Ok((meta, machine))
        }),
    };
    let (meta, mut m): (SnapshotMeta, Machine) = match loaded {
        Ok(x) => x,
        Err(e) => {
            problems.push(format!("snapshot {e}"));
            return None;
        }
    };
    if meta.last_log_id != m.applied || meta.last_membership != m.membership {
        problems.push(format!(
            "snapshot {}: its meta (log id {:?}) disagrees with its body (log id {:?})",
            file.path().display(),
            meta.last_log_id,
            m.applied
        ));
        return None;
    }
    m.cold_file = Some(file.clone());
    let before = problems.len();
    check_chains(&m, problems);
    if problems.len() > before {
        return None;
    }
    m.log.rebuild_index();
    Some((meta, m))
}

/// Writes `copy` as a snapshot: sealed generations' records go to its cold section (those
/// already on disk are read from the file they are in and checked on the way), everything else
/// to the body. Returns the file and what it holds on disk, with each generation's chain head.
#[allow(clippy::type_complexity)]
fn write_snapshot(
    dir: &SnapshotDir,
    mut copy: Machine,
) -> io::Result<(SnapshotFile, Vec<(GenerationId, ColdRef, chain::Hash)>)> {
    let meta = copy.meta();
    let now = copy.log_ms;
    let mut cold = Vec::new();
    let cold_out = &mut cold;
    let file = dir.write_with_cold(&meta, move |section| {
        let mut refs = Vec::new();
        for g in copy.log.generations.values_mut() {
            let r = match g.cold {
                Some(r) => {
                    // Checked against its chain head when it was loaded or first written, and
                    // by CRC here: copied as it is.
                    let from = copy
                        .cold_file
                        .as_ref()
                        .ok_or(ColdReadError::NoFile(g.id))
                        .map_err(io::Error::other)?;
                    section.copy(from, &r)?
                }
                None if g.sealed(now) && !g.records.is_empty() => {
                    let r = section.put(&g.records)?;
                    g.records = Vec::new();
                    r
                }
                None => continue,
            };
            refs.push((g.id, r));
            cold_out.push((g.id, r, g.chain_head));
        }
        Ok(Body {
            machine: copy,
            cold: refs,
        })
    })?;
    Ok((file, cold))
}

/// The digest of an applied state ([`crate::snapshot::digest`]): the same whether a node keeps
/// a generation's records in memory or on disk. Records enter it through each generation's
/// chain head (their hash) and frontier.
pub fn digest(m: &Machine) -> io::Result<[u8; 32]> {
    let mut normal = m.clone();
    let mut frontiers = Vec::with_capacity(normal.generations.len());
    for g in normal.log.generations.values_mut() {
        frontiers.push((g.id, g.frontier()));
        g.records = Vec::new();
        g.cold = None;
    }
    crate::snapshot::digest(&(&normal, &frontiers))
}

impl SmStore {
    /// Opens the state machine from the snapshots in `dir` (the newest is loaded and checked).
    /// Problems found are in the report; the store then starts empty, and must not serve.
    pub fn open(dir: &Path, faults: Faults) -> io::Result<(Self, LoadReport)> {
        let snapshots = SnapshotDir::open(dir)?;
        let mut report = LoadReport::default();
        let mut machine = Machine::default();
        if let Some(file) = snapshots.newest()? {
            if let Some((meta, m)) = load_snapshot(&file, &mut report.problems) {
                report.snapshot_index = meta.last_log_id.map_or(0, |l| l.index);
                machine = m;
            }
        }
        report.generations = machine.generations.len() as u64;
        report.records = machine.generations.values().map(|g| g.frontier() as u64).sum();
        machine.log.faults = faults;
        let (applied_tx, _) = tokio::sync::watch::channel(machine.applied.map_or(0, |l| l.index));
        let shared = SmShared {
            log_ms: AtomicU64::new(machine.log_ms),
            state: RwLock::new(machine),
            snapshots,
            applied_tx,
            faults,
            building: Default::default(),
        };
        Ok((
            SmStore {
                shared: Arc::new(shared),
            },
            report,
        ))
    }

    pub fn shared(&self) -> Arc<SmShared> {
        self.shared.clone()
    }

    /// Tests only: writing or installing a snapshot stops (as a crash would) after `step`.
    /// False if the store is already shared (set it right after `open`).
    pub fn crash_install_after(&mut self, step: Option<crate::snapshot::Step>) -> bool {
        match Arc::get_mut(&mut self.shared) {
            Some(s) => {
                s.snapshots.crash_after(step);
                true
            }
            None => false,
        }
    }
}

impl SmShared {
    /// Read access to the applied state. Hold it briefly: apply waits for it.
    pub fn read(&self) -> RwLockReadGuard<'_, Machine> {
        self.state.read().expect("state lock poisoned")
    }

    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.applied_tx.subscribe()
    }

    pub fn applied_index(&self) -> u64 {
        *self.applied_tx.borrow()
    }

    /// The log time of the last applied entry, without taking the state lock.
    pub fn log_ms(&self) -> u64 {
        self.log_ms.load(Ordering::Acquire)
    }

    pub fn snapshot_dir(&self) -> &Path {
        self.snapshots.path()
    }

    /// The audit behind `tokenlog verify` on a live node: every chain of the applied state
    /// (from a copy, so apply is not held up), and the newest snapshot file on disk.
    pub fn verify(&self) -> io::Result<LoadReport> {
        let copy = self.read().clone();
        let mut report = LoadReport {
            generations: copy.generations.len() as u64,
            ..Default::default()
        };
        report.records = check_chains(&copy, &mut report.problems);
        if let Some(file) = self.snapshots.newest()? {
            if let Some((meta, _)) = load_snapshot(&file, &mut report.problems) {
                report.snapshot_index = meta.last_log_id.map_or(0, |l| l.index);
            }
        }
        Ok(report)
    }

    /// The applied state's digest ([`crate::snapshot::digest`] of a copy taken under the read
    /// lock, so index and digest belong together), with its applied index and sizes.
    pub fn digest(&self) -> io::Result<StateDigest> {
        let copy = self.read().clone();
        Ok(StateDigest {
            applied_index: copy.applied.map_or(0, |l| l.index),
            digest: digest(&copy)?,
            generations: copy.generations.len() as u64,
            records: copy.generations.values().map(|g| g.frontier() as u64).sum(),
        })
    }

    /// A new partial file for a snapshot streamed from the leader.
    pub fn receive_snapshot(&self) -> io::Result<PartialSnapshot> {
        self.snapshots.partial()
    }

    /// After a snapshot built from a copy whose cold records were in `from` was written to
    /// `file`: the generations it holds on disk (`cold`) drop their records from memory and
    /// read them from `file` from now on. Nothing changes if the state was replaced meanwhile
    /// (a snapshot installed: its records are in the installed file). Returns how many
    /// generations' records left memory.
    fn keep_on_disk(
        &self,
        from: Option<&SnapshotFile>,
        file: &SnapshotFile,
        cold: &[(GenerationId, ColdRef, chain::Hash)],
    ) -> usize {
        let mut m = self.state.write().expect("state lock poisoned");
        let same = match (from, &m.cold_file) {
            (None, None) => true,
            (Some(a), Some(b)) => a.same_file(b),
            _ => false,
        };
        if !same {
            return 0;
        }
        let mut moved = 0;
        for (id, r, head) in cold {
            if let Some(g) = m.log.generations.get_mut(id) {
                // Sealed generations never change: this is the one the copy had.
                assert!(g.frontier() == r.records && g.chain_head == *head && g.state.is_terminal());
                if g.cold.is_none() {
                    moved += 1;
                }
                g.records = Vec::new();
                g.cold = Some(*r);
            }
        }
        // `cold` is in generation order (the copy's map): every generation on disk is in it.
        debug_assert!(m
            .generations
            .values()
            .all(|g| g.cold.is_none() || cold.binary_search_by_key(&g.id, |c| c.0).is_ok()));
        m.cold_file = Some(file.clone());
        moved
    }

    fn publish(&self, m: &Machine) {
        self.log_ms.store(m.log_ms, Ordering::Release);
    }
}

impl RaftSnapshotBuilder<TypeConfig> for SmStore {
    type SnapshotData = SnapshotData;

    async fn build_snapshot(&mut self) -> Result<Snapshot, io::Error> {
        let _one_at_a_time = self.shared.building.lock().await;
        // A copy under the read lock: its meta and content are one applied state.
        let copy = self.shared.read().clone();
        let meta = copy.meta();
        let from = copy.cold_file.clone();
        let shared = self.shared.clone();
        let (file, cold) = tokio::task::spawn_blocking(move || write_snapshot(&shared.snapshots, copy))
            .await
            .map_err(io::Error::other)??;
        let moved = self.shared.keep_on_disk(from.as_ref(), &file, &cold);
        tracing::info!(
            index = meta.last_log_id.map_or(0, |l| l.index),
            bytes = file.len(),
            on_disk = cold.len(),
            moved,
            "snapshot written"
        );
        Ok(Snapshot { meta, snapshot: file })
    }
}

impl RaftStateMachine<TypeConfig> for SmStore {
    type SnapshotData = SnapshotData;
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        let m = self.shared.read();
        Ok((m.applied, m.membership.clone()))
    }

    async fn apply<S>(&mut self, mut entries: S) -> Result<(), io::Error>
    where
        S: Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>> + Unpin + OptionalSend,
    {
        let s = &self.shared;
        let mut batch = Vec::new();
        while let Some(item) = entries.try_next().await? {
            batch.push(item);
        }
        let mut changes = Changes::default();
        let mut responders = Vec::with_capacity(batch.len());
        let applied = {
            let mut m = s.state.write().expect("state lock poisoned");
            for (entry, responder) in batch {
                let response = m.apply_entry(entry.log_id, entry.payload, &mut changes);
                responders.push((responder, response));
            }
            s.publish(&m);
            m.applied
        };
        for (responder, response) in responders {
            if let Some(r) = responder {
                r.send(response);
            }
        }
        s.applied_tx.send_replace(applied.map_or(0, |l| l.index));
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMeta, snapshot: SnapshotData) -> Result<(), io::Error> {
        let shared = self.shared.clone();
        let want = meta.clone();
        let machine = tokio::task::spawn_blocking(move || -> io::Result<Machine> {
            let mut problems = Vec::new();
            let Some((got, m)) = load_snapshot(&snapshot, &mut problems) else {
                return Err(io::Error::new(io::ErrorKind::InvalidData, problems.join("; ")));
            };
            if got != want {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "snapshot {} holds log id {:?}, Raft installs {:?}",
                        snapshot.path().display(),
                        got.last_log_id,
                        want.last_log_id
                    ),
                ));
            }
            let (_, installed) = shared.snapshots.install(&snapshot)?;
            let mut m = m;
            m.cold_file = Some(installed);
            Ok(m)
        })
        .await
        .map_err(io::Error::other)??;
        let s = &self.shared;
        let index = machine.applied.map_or(0, |l| l.index);
        {
            let mut m = s.state.write().expect("state lock poisoned");
            *m = machine;
            m.log.faults = s.faults;
            s.publish(&m);
        }
        s.applied_tx.send_replace(index);
        tracing::info!(index, "snapshot installed");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, io::Error> {
        match self.shared.snapshots.newest()? {
            None => Ok(None),
            Some(file) => Ok(Some(Snapshot {
                meta: file.meta()?,
                snapshot: file,
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    /// The snapshot file at `path` as an older format wrote it: its magic, its checksum.
    fn as_written_by(path: &Path, magic: &[u8; 8]) -> SnapshotFile {
        let mut bytes = std::fs::read(path).unwrap();
        bytes[..8].copy_from_slice(magic);
        let n = bytes.len() - 32;
        let sum = Sha256::digest(&bytes[..n]);
        bytes[n..].copy_from_slice(&sum);
        std::fs::write(path, &bytes).unwrap();
        SnapshotFile::open(path).unwrap()
    }

    /// A data dir written by the previous release (snapshot format 3, no tokenizer table) still
    /// loads: same generations, same applied log id, an empty tokenizer table.
    #[test]
    fn a_format_3_snapshot_still_loads() {
        let mut log = LogState::default();
        let binding = Binding {
            model: ModelIdentity {
                weights_sha256: "w".into(),
                ..Default::default()
            },
            prompt_token_ids: vec![1, 2],
            stop: StopConfig {
                max_tokens: 4,
                ..Default::default()
            },
            ..Default::default()
        };
        let cmd = Command::Submit {
            tenant: "a".into(),
            request_id: "r".into(),
            binding,
        };
        log.apply(&Request { log_ms: 7, cmd }, &mut Changes::default());
        let machine = Machine {
            log,
            applied: Some(LogId::new(
                <openraft::vote::leader_id_adv::LeaderId<u64, u64> as openraft::vote::RaftLeaderIdExt>::new_committed(
                    1, 0,
                ),
                3,
            )),
            membership: StoredMembership::default(),
            cold_file: None,
        };
        #[derive(Serialize)]
        struct V3<'a> {
            generations: &'a std::collections::BTreeMap<GenerationId, Generation>,
            next_generation: GenerationId,
            log_ms: u64,
            decoders: &'a std::collections::BTreeMap<String, DecoderInfo>,
            applied: Option<LogId>,
            membership: &'a StoredMembership,
        }
        let v3 = V3 {
            generations: &machine.log.generations,
            next_generation: machine.log.next_generation,
            log_ms: machine.log.log_ms,
            decoders: &machine.log.decoders,
            applied: machine.applied,
            membership: &machine.membership,
        };
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        let path = dir.write(&machine.meta(), &v3).unwrap().path().to_path_buf();
        let file = as_written_by(&path, b"TLSNAP03");
        assert_eq!(file.format().unwrap(), 3);
        let mut problems = Vec::new();
        let (meta, loaded) = load_snapshot(&file, &mut problems).expect("loads");
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(meta.last_log_id, machine.applied);
        assert_eq!(loaded.log.generations, machine.log.generations);
        assert_eq!(loaded.log.log_ms, 7);
        assert!(loaded.log.tokenizers.is_empty());
        // Written again, it is format 4 and keeps its tokenizers.
        let mut m = loaded;
        m.log.tokenizers.insert("t".into(), TokenizerPackage(vec![1, 2, 3]));
        let f = write_snapshot(&dir, m.clone()).unwrap().0;
        assert_eq!(f.format().unwrap(), crate::snapshot::FORMAT);
        let (_, again) = load_snapshot(&f, &mut problems).expect("loads");
        assert_eq!(again.log.tokenizers, m.log.tokenizers);
    }

    /// A format 4 data dir (no handoff table, registrations without a handoff address) loads:
    /// its decoders, tokenizers and sessions as they were, no handoffs.
    #[test]
    fn a_format_4_snapshot_still_loads() {
        #[derive(Serialize)]
        struct DecoderV4 {
            model_name: String,
            model: ModelIdentity,
            capacity: u32,
            chat_template: String,
            context_tokens: u32,
            expiry_log_ms: u64,
        }
        #[derive(Serialize)]
        struct V4 {
            generations: std::collections::BTreeMap<GenerationId, Generation>,
            next_generation: GenerationId,
            log_ms: u64,
            decoders: std::collections::BTreeMap<String, DecoderV4>,
            tokenizers: std::collections::BTreeMap<String, TokenizerPackage>,
            sessions: std::collections::BTreeMap<String, u64>,
            applied: Option<LogId>,
            membership: StoredMembership,
        }
        let model = ModelIdentity {
            weights_sha256: "w".into(),
            ..Default::default()
        };
        let v4 = V4 {
            generations: Default::default(),
            next_generation: 3,
            log_ms: 9,
            decoders: [(
                "d1".to_string(),
                DecoderV4 {
                    model_name: "m".into(),
                    model: model.clone(),
                    capacity: 4,
                    chat_template: "chatml".into(),
                    context_tokens: 2048,
                    expiry_log_ms: 99,
                },
            )]
            .into(),
            tokenizers: [("t".to_string(), TokenizerPackage(vec![7]))].into(),
            sessions: [("d1".to_string(), 5)].into(),
            applied: None,
            membership: StoredMembership::default(),
        };
        let meta = Machine::default().meta();
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        let path = dir.write(&meta, &v4).unwrap().path().to_path_buf();
        let file = as_written_by(&path, b"TLSNAP04");
        assert_eq!(file.format().unwrap(), 4);
        let mut problems = Vec::new();
        let (_, loaded) = load_snapshot(&file, &mut problems).expect("loads");
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(loaded.log.next_generation, 3);
        let d1 = &loaded.log.decoders["d1"];
        assert_eq!((d1.capacity, d1.expiry_log_ms, d1.handoff_addr.as_str()), (4, 99, ""));
        assert_eq!(d1.model, model);
        assert_eq!(loaded.log.tokenizers["t"], TokenizerPackage(vec![7]));
        assert_eq!(loaded.log.sessions["d1"], 5);
        assert!(loaded.log.handoffs.is_empty());
    }

    /// A format 5 data dir (no pipeline compositions) loads: everything as it was, no pipelines;
    /// written again it is the current format and keeps the compositions added since.
    #[test]
    fn a_format_5_snapshot_still_loads() {
        #[derive(Serialize)]
        struct V5 {
            generations: std::collections::BTreeMap<GenerationId, Generation>,
            next_generation: GenerationId,
            log_ms: u64,
            decoders: std::collections::BTreeMap<String, DecoderInfo>,
            tokenizers: std::collections::BTreeMap<String, TokenizerPackage>,
            sessions: std::collections::BTreeMap<String, u64>,
            handoffs: std::collections::BTreeMap<GenerationId, Handoff>,
            next_handoff: u64,
            applied: Option<LogId>,
            membership: StoredMembership,
        }
        let v5 = V5 {
            generations: Default::default(),
            next_generation: 4,
            log_ms: 11,
            decoders: [(
                "d1".to_string(),
                DecoderInfo {
                    model_name: "m".into(),
                    handoff_addr: "127.0.0.1:9".into(),
                    ..Default::default()
                },
            )]
            .into(),
            tokenizers: Default::default(),
            sessions: [("d1".to_string(), 6)].into(),
            handoffs: Default::default(),
            next_handoff: 8,
            applied: None,
            membership: StoredMembership::default(),
        };
        let meta = Machine::default().meta();
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        let path = dir.write(&meta, &v5).unwrap().path().to_path_buf();
        let file = as_written_by(&path, b"TLSNAP05");
        assert_eq!(file.format().unwrap(), 5);
        let mut problems = Vec::new();
        let (_, loaded) = load_snapshot(&file, &mut problems).expect("loads");
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(
            (loaded.log.next_generation, loaded.log.log_ms, loaded.log.next_handoff),
            (4, 11, 8)
        );
        assert_eq!(loaded.log.decoders["d1"].handoff_addr, "127.0.0.1:9");
        assert_eq!(loaded.log.sessions["d1"], 6);
        assert!(loaded.log.pipelines.is_empty() && loaded.log.next_pipeline_epoch == 0);
        let mut m = loaded;
        m.log.next_pipeline_epoch = 1;
        m.log.pipelines.insert(
            "h".into(),
            Pipeline {
                head: "h".into(),
                epoch: 1,
                stages: vec![PipelineStage {
                    stage_id: "s".into(),
                    addr: "a".into(),
                    first_layer: 0,
                    end_layer: 30,
                }],
                set_log_ms: 11,
            },
        );
        let f = write_snapshot(&dir, m.clone()).unwrap().0;
        assert_eq!(f.format().unwrap(), crate::snapshot::FORMAT);
        let (_, again) = load_snapshot(&f, &mut problems).expect("loads");
        assert_eq!(
            (again.log.pipelines, again.log.next_pipeline_epoch),
            (m.log.pipelines, 1)
        );
    }

    /// A format 6 data dir (no stage registrations) loads: its pipelines as they were, no
    /// stages; written again it is the current format and keeps the stages added since.
    #[test]
    fn a_format_6_snapshot_still_loads() {
        #[derive(Serialize)]
        struct V6 {
            generations: std::collections::BTreeMap<GenerationId, Generation>,
            next_generation: GenerationId,
            log_ms: u64,
            decoders: std::collections::BTreeMap<String, DecoderInfo>,
            tokenizers: std::collections::BTreeMap<String, TokenizerPackage>,
            sessions: std::collections::BTreeMap<String, u64>,
            handoffs: std::collections::BTreeMap<GenerationId, Handoff>,
            next_handoff: u64,
            pipelines: std::collections::BTreeMap<String, Pipeline>,
            next_pipeline_epoch: u64,
            applied: Option<LogId>,
            membership: StoredMembership,
        }
        let pipeline = Pipeline {
            head: "h".into(),
            epoch: 3,
            stages: vec![PipelineStage {
                stage_id: "s".into(),
                addr: "a".into(),
                first_layer: 0,
                end_layer: 30,
            }],
            set_log_ms: 9,
        };
        let v6 = V6 {
            generations: Default::default(),
            next_generation: 5,
            log_ms: 12,
            decoders: Default::default(),
            tokenizers: Default::default(),
            sessions: Default::default(),
            handoffs: Default::default(),
            next_handoff: 2,
            pipelines: [("h".to_string(), pipeline.clone())].into(),
            next_pipeline_epoch: 3,
            applied: None,
            membership: StoredMembership::default(),
        };
        let meta = Machine::default().meta();
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        let path = dir.write(&meta, &v6).unwrap().path().to_path_buf();
        let file = as_written_by(&path, b"TLSNAP06");
        assert_eq!(file.format().unwrap(), 6);
        let mut problems = Vec::new();
        let (_, loaded) = load_snapshot(&file, &mut problems).expect("loads");
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(
            (loaded.log.next_generation, loaded.log.log_ms, loaded.log.next_handoff),
            (5, 12, 2)
        );
        assert_eq!(
            (&loaded.log.pipelines["h"], loaded.log.next_pipeline_epoch),
            (&pipeline, 3)
        );
        assert!(loaded.log.stages.is_empty());
        let mut m = loaded;
        m.log.stages.insert(
            "s2".into(),
            StageRegistration {
                addr: "b".into(),
                weights_sha256: "w".into(),
                first_layer: 10,
                end_layer: 20,
                expiry_log_ms: 99,
            },
        );
        m.log.rebuild_index();
        let f = write_snapshot(&dir, m.clone()).unwrap().0;
        assert_eq!(f.format().unwrap(), crate::snapshot::FORMAT);
        let (_, again) = load_snapshot(&f, &mut problems).expect("loads");
        assert_eq!(again.log.stages, m.log.stages);
        assert!(again.log.tick_due(99, u64::MAX), "the stage's expiry is indexed again");
    }

    /// A format 7 data dir (no hot standbys) loads: its stage registrations as they were, no
    /// standbys; written again it is the current format and keeps the standbys added since.
    #[test]
    fn a_format_7_snapshot_still_loads() {
        /// Format 7's body: the current one without `standbys`, fields in their order.
        #[derive(Serialize)]
        struct V7<'a> {
            generations: &'a std::collections::BTreeMap<GenerationId, Generation>,
            next_generation: GenerationId,
            log_ms: u64,
            decoders: &'a std::collections::BTreeMap<String, DecoderInfo>,
            tokenizers: &'a std::collections::BTreeMap<String, TokenizerPackage>,
            sessions: &'a std::collections::BTreeMap<String, u64>,
            handoffs: &'a std::collections::BTreeMap<GenerationId, Handoff>,
            next_handoff: u64,
            pipelines: &'a std::collections::BTreeMap<String, Pipeline>,
            next_pipeline_epoch: u64,
            stages: &'a std::collections::BTreeMap<String, StageRegistration>,
            applied: Option<LogId>,
            membership: StoredMembership,
        }
        let mut log = LogState {
            next_generation: 7,
            log_ms: 40,
            next_handoff: 3,
            next_pipeline_epoch: 2,
            ..LogState::default()
        };
        log.stages.insert(
            "s".into(),
            StageRegistration {
                addr: "a".into(),
                weights_sha256: "w".into(),
                first_layer: 0,
                end_layer: 30,
                expiry_log_ms: 90,
            },
        );
        let v7 = V7 {
            generations: &log.generations,
            next_generation: log.next_generation,
            log_ms: log.log_ms,
            decoders: &log.decoders,
            tokenizers: &log.tokenizers,
            sessions: &log.sessions,
            handoffs: &log.handoffs,
            next_handoff: log.next_handoff,
            pipelines: &log.pipelines,
            next_pipeline_epoch: log.next_pipeline_epoch,
            stages: &log.stages,
            applied: None,
            membership: StoredMembership::default(),
        };
        let meta = Machine::default().meta();
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        let path = dir.write(&meta, &v7).unwrap().path().to_path_buf();
        let file = as_written_by(&path, b"TLSNAP07");
        assert_eq!(file.format().unwrap(), 7);
        let mut problems = Vec::new();
        let (_, loaded) = load_snapshot(&file, &mut problems).expect("loads");
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(
            (loaded.log.next_generation, loaded.log.log_ms, loaded.log.next_handoff),
            (7, 40, 3)
        );
        assert_eq!(loaded.log.stages, log.stages);
        assert!(loaded.log.standbys.is_empty());
        let mut m = loaded;
        m.log.standbys.insert(
            4,
            Standby {
                decoder: "d2".into(),
                since_log_ms: 41,
            },
        );
        let f = write_snapshot(&dir, m.clone()).unwrap().0;
        assert_eq!(f.format().unwrap(), crate::snapshot::FORMAT);
        let (_, again) = load_snapshot(&f, &mut problems).expect("loads");
        assert_eq!(again.log.standbys, m.log.standbys);
        assert_eq!(again.log.stages, log.stages);
    }

    /// A format 8 data dir (the body is the machine alone, no cold section) loads, and is
    /// written again as format 9.
    #[test]
    fn a_format_8_snapshot_still_loads() {
        let mut m = Machine::default();
        m.log.next_generation = 5;
        m.log.log_ms = 33;
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        // Format 8 wrote the body right after the meta, then the checksum: a format 9 file with
        // an empty cold section is that plus the body offset, which an older reader ignores.
        let path = dir.write(&m.meta(), &m).unwrap().path().to_path_buf();
        let file = as_written_by(&path, b"TLSNAP08");
        assert_eq!(file.format().unwrap(), 8);
        let mut problems = Vec::new();
        let (_, loaded) = load_snapshot(&file, &mut problems).expect("loads");
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!((loaded.log.next_generation, loaded.log.log_ms), (5, 33));
        let f = write_snapshot(&dir, loaded).unwrap().0;
        assert_eq!(f.format().unwrap(), crate::snapshot::FORMAT);
        let (_, again) = load_snapshot(&f, &mut problems).expect("loads");
        assert_eq!((again.log.next_generation, again.log.log_ms), (5, 33));
    }

    /// Records on disk whose frame is intact (its CRC matches) but that are not the generation's
    /// (a bug writing them, or a tampered file with its checksums redone) fail the chain head:
    /// at load, and on every read.
    #[test]
    fn records_on_disk_that_are_not_the_generations_fail_its_chain() {
        let mut m = Machine::default();
        let cmd = Command::Submit {
            tenant: "a".into(),
            request_id: "r".into(),
            binding: Binding {
                model: ModelIdentity {
                    weights_sha256: "w".into(),
                    ..Default::default()
                },
                prompt_token_ids: vec![1],
                stop: StopConfig {
                    max_tokens: 4,
                    ..Default::default()
                },
                ..Default::default()
            },
        };
        m.log.apply(&Request { log_ms: 1, cmd }, &mut Changes::default());
        let id = *m.log.generations.keys().next().unwrap();
        let g = m.log.generations.get_mut(&id).unwrap();
        let rec = Record {
            token_id: 5,
            epoch: 1,
            log_ms: 2,
        };
        g.chain_head = chain::head(id, &[rec]);
        g.records = vec![rec];
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        let other = Record { token_id: 6, ..rec };
        let mut written = None;
        let file = dir
            .write_with_cold(&m.meta(), |section| {
                let r = section.put(&[other])?;
                written = Some(r);
                let mut body = m.clone();
                body.log.generations.get_mut(&id).unwrap().records.clear();
                Ok(Body {
                    machine: body,
                    cold: vec![(id, r)],
                })
            })
            .unwrap();
        let mut problems = Vec::new();
        assert!(load_snapshot(&file, &mut problems).is_none());
        assert!(problems.iter().any(|p| p.contains("chain head")), "{problems:?}");
        let r = written.unwrap();
        let g = &m.log.generations[&id];
        let mut cold = g.clone();
        cold.records.clear();
        cold.cold = Some(r);
        assert!(matches!(read_cold(&file, &cold, &r), Err(ColdReadError::Chain(_))));
    }
}
