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

use std::collections::{BTreeMap, BTreeSet};
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
use crate::snapshot::{PartialSnapshot, Segment, SnapshotDir, SnapshotFile};
use crate::state::{Changes, LogState};
use crate::types::*;

/// The applied state and the Raft metadata that goes with it, always changed together.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Machine {
    pub log: LogState,
    applied: Option<LogId>,
    membership: StoredMembership,
    /// The files that hold the records of the generations kept on disk only
    /// ([`Generation::cold`]): those of the newest snapshot this state was loaded from or
    /// written to.
    #[serde(skip)]
    cold: ColdFiles,
}

/// Where the records of the generations kept on disk are: the cold section of a snapshot file
/// (segment 0: a snapshot installed from a peer, or written by format 9) and the cold segments
/// the snapshot names ([`crate::snapshot`]). Cheap to clone; read without the state lock.
#[derive(Clone, Debug, Default)]
pub struct ColdFiles {
    own: Option<SnapshotFile>,
    segments: Arc<BTreeMap<u64, Segment>>,
}

impl ColdFiles {
    /// The bytes of frame `r` of generation `id`, checked against its CRC.
    pub fn read_frame(&self, id: GenerationId, r: &ColdRef) -> Result<Vec<u8>, ColdReadError> {
        Ok(match r.segment {
            0 => self.own.as_ref().ok_or(ColdReadError::NoFile(id))?.read_frame(r)?,
            s => self
                .segments
                .get(&s)
                .ok_or(ColdReadError::NoSegment(id, s))?
                .read_frame(r)?,
        })
    }

    /// The records frame `r` of generation `id` holds (not checked against the chain head).
    fn read_records(&self, id: GenerationId, r: &ColdRef) -> Result<Vec<Record>, ColdReadError> {
        let bytes = self.read_frame(id, r)?;
        crate::snapshot::decode_frame(&bytes, r).map_err(|what| {
            let path = self.path_of(r).map(|p| p.display().to_string()).unwrap_or_default();
            crate::snapshot::SnapshotError::Corrupt { path, what }.into()
        })
    }

    /// The file frame `r` is in (tests damage it).
    pub fn path_of(&self, r: &ColdRef) -> Option<&Path> {
        match r.segment {
            0 => self.own.as_ref().map(|f| f.path()),
            s => self.segments.get(&s).map(|f| f.path()),
        }
    }

    /// The ids of the cold segments.
    pub fn segment_ids(&self) -> BTreeSet<u64> {
        self.segments.keys().copied().collect()
    }

    /// The cold segments, by id.
    pub fn segments(&self) -> impl Iterator<Item = &Segment> {
        self.segments.values()
    }

    /// Whether both are the same open files (not merely the same paths).
    fn same(&self, other: &ColdFiles) -> bool {
        let own = match (&self.own, &other.own) {
            (None, None) => true,
            (Some(a), Some(b)) => a.same_file(b),
            _ => false,
        };
        own && Arc::ptr_eq(&self.segments, &other.segments)
    }
}

/// A snapshot body of format 10: the machine (generations on disk with no records in it), where
/// each of those generations' records are, and the cold segments (id, length) they are in.
#[derive(Serialize, Deserialize)]
struct Body {
    machine: Machine,
    cold: Vec<(GenerationId, ColdRef)>,
    segments: Vec<(u64, u64)>,
}

/// A snapshot body of format 9: no segments, every record in the file's own cold section.
#[derive(Deserialize)]
struct BodyV9 {
    machine: Machine,
    cold: Vec<(GenerationId, ColdRefV9)>,
}

/// A [`ColdRef`] as format 9 wrote it (no segment: the file's own cold section).
#[derive(Deserialize)]
struct ColdRefV9 {
    offset: u64,
    bytes: u64,
    crc: u32,
    records: Seq,
}

impl From<BodyV9> for Body {
    fn from(b: BodyV9) -> Body {
        let cold = b
            .cold
            .into_iter()
            .map(|(id, r)| {
                let r = ColdRef {
                    segment: 0,
                    offset: r.offset,
                    bytes: r.bytes,
                    crc: r.crc,
                    records: r.records,
                };
                (id, r)
            })
            .collect();
        Body {
            machine: b.machine,
            cold,
            segments: Vec::new(),
        }
    }
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
    #[error("generation {0}: its records are in cold segment {1}, which the snapshot does not name")]
    NoSegment(GenerationId, u64),
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
            Some(r) if g.records.is_empty() => read_cold(&self.cold, g, &r).map(std::borrow::Cow::Owned),
            _ => Ok(g.records.as_slice()),
        }
    }

    /// The files holding the records of the generations kept on disk (cheap to clone: read
    /// from them without the state lock).
    pub fn cold_files(&self) -> &ColdFiles {
        &self.cold
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
    /// Tokens appended since the state the last snapshot build copied (changed under the
    /// state's write lock; read for [`crate::limits::snapshot_due`]).
    tokens_since_snapshot: AtomicU64,
    /// Records of running generations in the last snapshot built, installed or loaded (what the
    /// next build writes again at least; see [`crate::limits::snapshot_due`]).
    body_records: AtomicU64,
}

/// The records a snapshot of `m` holds in its body: those of running generations (a finished
/// generation's records go to a cold segment, once).
fn body_records(m: &Machine) -> u64 {
    m.generations
        .values()
        .filter(|g| !g.state.is_terminal())
        .map(|g| g.records.len() as u64)
        .sum()
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

/// The records `r` names in `files`, checked against `g`'s chain head.
pub fn read_cold(files: &ColdFiles, g: &Generation, r: &ColdRef) -> Result<Vec<Record>, ColdReadError> {
    let records = files.read_records(g.id, r)?;
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
            cold: ColdFiles::default(),
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
            cold: ColdFiles::default(),
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
            cold: ColdFiles::default(),
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
            cold: ColdFiles::default(),
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
        Ok(9) => file
            .load::<BodyV9>()
            .and_then(|(meta, b)| attach_cold(file, Body::from(b)).map(|m| (meta, m))),
        _ => file
            .load::<Body>()
            .and_then(|(meta, b)| attach_cold(file, b).map(|m| (meta, m))),
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
    if m.cold.own.is_none() {
        m.cold.own = Some(file.clone());
    }
    // Finished but not sealed: `apply` may still compare a re-send with their records, so they
    // are read back into memory (checked against the chain head), before the chains are checked
    // (which then reads only the sealed ones from disk).
    let now = m.log_ms;
    let cold = m.cold.clone();
    for g in m.log.generations.values_mut() {
        if let Some(r) = g.cold.filter(|_| !g.sealed(now)) {
            match read_cold(&cold, g, &r) {
                Ok(records) => g.records = records.into(),
                Err(e) => {
                    problems.push(format!("request {:?} (generation {}): {e}", g.request_id, g.id));
                    return None;
                }
            }
        }
    }
    let before = problems.len();
    check_chains(&m, problems);
    if problems.len() > before {
        return None;
    }
    m.log.rebuild_index();
    Some((meta, m))
}

/// A loaded body's machine with its generations on disk pointed at their records: the file's
/// own cold section (segment 0) or the segments the body names, opened from `cold/` beside the
/// file and checked to be the length the body says.
fn attach_cold(file: &SnapshotFile, b: Body) -> Result<Machine, crate::snapshot::SnapshotError> {
    let corrupt = |what: String| crate::snapshot::SnapshotError::corrupt(file.path(), what);
    let Body {
        mut machine,
        cold,
        segments,
    } = b;
    let dir = file.path().parent().unwrap_or(Path::new("."));
    let mut open = BTreeMap::new();
    for (id, len) in segments {
        if id == 0 {
            return Err(corrupt("it names cold segment 0 (the file's own cold section)".into()));
        }
        let seg = Segment::open(&crate::snapshot::segment_path(dir, id), id)?;
        if seg.len() != len {
            return Err(corrupt(format!(
                "cold segment {id} is {} bytes, the snapshot names {len}",
                seg.len()
            )));
        }
        open.insert(id, seg);
    }
    for (id, r) in cold {
        if r.segment != 0 && !open.contains_key(&r.segment) {
            return Err(corrupt(format!(
                "generation {id}: its records are in cold segment {}, which the snapshot does not name",
                r.segment
            )));
        }
        match machine.log.generations.get_mut(&id) {
            Some(g) if g.records.is_empty() && g.cold.is_none() => g.cold = Some(r),
            _ => {
                return Err(corrupt(format!(
                    "records on disk for generation {id}, which has none to put there"
                )))
            }
        }
    }
    machine.cold = ColdFiles {
        own: Some(file.clone()),
        segments: Arc::new(open),
    };
    Ok(machine)
}

/// What a snapshot build put on disk: for each generation whose records are there, where, its
/// chain head, and whether it is sealed (its records then leave memory); and the files that
/// hold them.
type Written = (SnapshotFile, Vec<OnDisk>, ColdFiles);

/// A generation whose records a snapshot holds on disk ([`write_snapshot`]).
struct OnDisk {
    id: GenerationId,
    at: ColdRef,
    chain_head: chain::Hash,
    sealed: bool,
}

/// Writes `copy` as a snapshot of format 10 (see [`crate::snapshot`]): the records of the
/// generations finished since the last build go to one new cold segment (the body holds no
/// records of a finished generation, only of running ones); those on disk already
/// stay in their segments, except segments less than half live (and the cold section of an
/// installed file), whose live frames are copied into the new one after their CRC. The body
/// names every segment it uses; the new segment is durable before the snapshot is.
fn write_snapshot(dir: &SnapshotDir, mut copy: Machine) -> io::Result<Written> {
    let meta = copy.meta();
    let now = copy.log_ms;
    let from = std::mem::take(&mut copy.cold);
    let mut live: BTreeMap<u64, u64> = BTreeMap::new();
    for r in copy.generations.values().filter_map(|g| g.cold) {
        *live.entry(r.segment).or_default() += r.bytes;
    }
    let keep: BTreeSet<u64> = from
        .segments
        .values()
        .filter(|s| live.get(&s.id()).is_some_and(|&l| l * 2 >= s.frame_bytes()))
        .map(|s| s.id())
        .collect();
    let mut seg = dir.new_segment()?;
    let mut refs = Vec::new();
    let mut cold = Vec::new();
    for g in copy.log.generations.values_mut() {
        let r = match g.cold {
            Some(r) if keep.contains(&r.segment) => r,
            Some(r) => {
                // Checked against its chain head when it was loaded or first written, and by
                // CRC here: copied as it is.
                let bytes = from.read_frame(g.id, &r).map_err(io::Error::other)?;
                seg.put_frame(&bytes, r.records)?
            }
            // Finished: its records never change again.
            None if g.state.is_terminal() && !g.records.is_empty() => seg.put(&g.records.as_slice())?,
            None => continue,
        };
        g.records.clear();
        refs.push((g.id, r));
        cold.push(OnDisk {
            id: g.id,
            at: r,
            chain_head: g.chain_head,
            sealed: g.sealed(now),
        });
    }
    let mut segments: BTreeMap<u64, Segment> = from
        .segments
        .iter()
        .filter(|(id, _)| keep.contains(id))
        .map(|(id, s)| (*id, s.clone()))
        .collect();
    if let Some(new) = seg.finish()? {
        segments.insert(new.id(), new);
    }
    let named = segments.values().map(|s| (s.id(), s.len())).collect();
    let file = dir.write_with_cold(&meta, |_| {
        Ok(Body {
            machine: copy,
            cold: refs,
            segments: named,
        })
    })?;
    let files = ColdFiles {
        own: Some(file.clone()),
        segments: Arc::new(segments),
    };
    Ok((file, cold, files))
}

/// `file` as a follower must receive it: itself when every record it keeps on disk is in its
/// own cold section, else a self-contained export ([`crate::snapshot::write_transfer`]) with
/// the frames of its segments copied in (after their CRC). Blocking I/O.
pub fn self_contained(file: &SnapshotFile) -> io::Result<SnapshotFile> {
    if file.format()? < crate::snapshot::FORMAT {
        return Ok(file.clone());
    }
    let (meta, body) = file.load::<Body>()?;
    if body.segments.is_empty() {
        return Ok(file.clone());
    }
    let machine = attach_cold(file, body)?;
    export(file, &meta, machine)
}

/// Writes the self-contained export of `m`, the state of snapshot `file` at `meta`.
fn export(file: &SnapshotFile, meta: &SnapshotMeta, mut m: Machine) -> io::Result<SnapshotFile> {
    let dir = file.path().parent().unwrap_or(Path::new("."));
    let from = std::mem::take(&mut m.cold);
    crate::snapshot::write_transfer(dir, meta, |section| {
        let mut refs = Vec::new();
        for g in m.log.generations.values_mut() {
            if let Some(r) = g.cold {
                let bytes = from.read_frame(g.id, &r).map_err(io::Error::other)?;
                refs.push((g.id, section.put_frame(&bytes, r.records)?));
                // A finished generation not sealed yet is also in memory (loaded back for
                // `apply`): the body holds its records once, in the cold section.
                g.records.clear();
            }
        }
        Ok(Body {
            machine: m,
            cold: refs,
            segments: Vec::new(),
        })
    })
}

/// The digest of an applied state ([`crate::snapshot::digest`]): the same whether a node keeps
/// a generation's records in memory or on disk. Records enter it through each generation's
/// chain head (their hash) and frontier.
pub fn digest(m: &Machine) -> io::Result<[u8; 32]> {
    let mut normal = m.clone();
    let mut frontiers = Vec::with_capacity(normal.generations.len());
    for g in normal.log.generations.values_mut() {
        frontiers.push((g.id, g.frontier()));
        g.records.clear();
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
        if report.problems.is_empty() {
            // Segments of a build that crashed before its snapshot was in place, or that a
            // crash kept from being removed: no snapshot names them.
            let removed = snapshots.remove_segments_except(&machine.cold.segment_ids())?;
            if removed > 0 {
                tracing::info!(removed, "removed cold segments no snapshot names");
            }
        }
        let body_records = body_records(&machine);
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
            tokens_since_snapshot: AtomicU64::new(0),
            body_records: AtomicU64::new(body_records),
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

    /// Tokens appended since the state the last snapshot build copied.
    pub fn tokens_since_snapshot(&self) -> u64 {
        self.tokens_since_snapshot.load(Ordering::Relaxed)
    }

    /// Records of running generations in the last snapshot this node built, installed or
    /// loaded.
    pub fn body_records(&self) -> u64 {
        self.body_records.load(Ordering::Relaxed)
    }

    /// Whether a snapshot build is under way.
    pub fn building(&self) -> bool {
        self.building.try_lock().is_err()
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

    /// After a snapshot built from a copy whose cold records were in `from` was written: the
    /// generations it holds on disk (`cold`) are found there from now on (`files`), and the
    /// sealed ones drop their records from memory. Returns how many generations' records left
    /// memory. The caller holds `building`, which an install takes too: the state's files are
    /// still the copy's.
    fn keep_on_disk(&self, from: &ColdFiles, files: ColdFiles, cold: &[OnDisk]) -> usize {
        let mut m = self.state.write().expect("state lock poisoned");
        assert!(
            from.same(&m.cold),
            "the state's cold files changed during a snapshot build"
        );
        let mut moved = 0;
        for d in cold {
            if let Some(g) = m.log.generations.get_mut(&d.id) {
                // Finished generations never change: this is the one the copy had.
                assert!(g.frontier() == d.at.records && g.chain_head == d.chain_head && g.state.is_terminal());
                if d.sealed && !g.records.is_empty() {
                    moved += 1;
                    g.records.clear();
                }
                g.cold = Some(d.at);
            }
        }
        // `cold` is in generation order (the copy's map): every generation on disk is in it.
        debug_assert!(m
            .generations
            .values()
            .all(|g| g.cold.is_none() || cold.binary_search_by_key(&g.id, |c| c.id).is_ok()));
        m.cold = files;
        moved
    }

    /// Removes the cold segments the state's files do not name (after the snapshot that names
    /// them is in place), and logs what it could not remove.
    fn remove_unnamed_segments(&self, named: &BTreeSet<u64>) -> usize {
        match self.snapshots.remove_segments_except(named) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "removing cold segments no snapshot names");
                0
            }
        }
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
        let waiting = std::time::Instant::now();
        let (copy, wait_ms, copy_ms) = {
            let m = self.shared.read();
            // Until here the build waited for an apply batch to end (which held nobody back);
            // from here the next apply waits for the copy (which shares the records' full chunks).
            let copying = std::time::Instant::now();
            // Apply adds under the write lock: what it added so far is in this copy.
            self.shared.tokens_since_snapshot.store(0, Ordering::Relaxed);
            let copy = m.clone();
            let wait_ms = (copying - waiting).as_millis() as u64;
            (copy, wait_ms, copying.elapsed().as_millis() as u64)
        };
        let slow_copy = (copy_ms >= crate::limits::SNAPSHOT_COPY_WARN_MS).then(|| {
            let records: usize = copy.log.generations.values().map(|g| g.records.len()).sum();
            (copy.log.generations.len(), records)
        });
        self.shared.body_records.store(body_records(&copy), Ordering::Relaxed);
        let meta = copy.meta();
        let from = copy.cold.clone();
        let shared = self.shared.clone();
        let (file, cold, files) = tokio::task::spawn_blocking(move || write_snapshot(&shared.snapshots, copy))
            .await
            .map_err(io::Error::other)??;
        let named = files.segment_ids();
        let segment_bytes: u64 = files.segments().map(|s| s.len()).sum();
        let moved = self.shared.keep_on_disk(&from, files, &cold);
        // Only the segments the snapshot now in place names are kept.
        let removed = self.shared.remove_unnamed_segments(&named);
        tracing::info!(
            index = meta.last_log_id.map_or(0, |l| l.index),
            bytes = file.len(),
            on_disk = cold.len(),
            moved,
            segments = named.len(),
            segment_bytes,
            segments_removed = removed,
            wait_ms,
            copy_ms,
            "snapshot written"
        );
        if let Some((generations, records_in_memory)) = slow_copy {
            tracing::warn!(
                copy_ms,
                generations,
                records_in_memory,
                wait_ms,
                "the snapshot's copy of the state held appends back this long (copying every \
                 generation under the state's lock; before it, it waited wait_ms for an apply \
                 batch to end)"
            );
        }
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
                if let EntryPayload::Normal(req) = &entry.payload {
                    s.tokens_since_snapshot
                        .fetch_add(req.cmd.appended_tokens(), Ordering::Relaxed);
                }
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
        // Not while a build writes segments: the install decides which ones stay (none).
        let _one_at_a_time = self.shared.building.lock().await;
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
            // A snapshot that names segments (handed over in process, not streamed: a stream is
            // self-contained) is made self-contained first: the records come with the state.
            let (snapshot, m) = if m.cold.segments.is_empty() {
                (snapshot, m)
            } else {
                let exported = export(&snapshot, &got, m)?;
                match load_snapshot(&exported, &mut problems) {
                    Some((_, m)) => (exported, m),
                    None => return Err(io::Error::new(io::ErrorKind::InvalidData, problems.join("; "))),
                }
            };
            let (_, installed) = shared.snapshots.install(&snapshot)?;
            let mut m = m;
            m.cold = ColdFiles {
                own: Some(installed),
                segments: Default::default(),
            };
            Ok(m)
        })
        .await
        .map_err(io::Error::other)??;
        let s = &self.shared;
        let index = machine.applied.map_or(0, |l| l.index);
        {
            s.body_records.store(body_records(&machine), Ordering::Relaxed);
            let mut m = s.state.write().expect("state lock poisoned");
            *m = machine;
            m.log.faults = s.faults;
            s.publish(&m);
        }
        s.applied_tx.send_replace(index);
        let removed = s.remove_unnamed_segments(&BTreeSet::new());
        tracing::info!(index, segments_removed = removed, "snapshot installed");
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
        log.apply(&Request::new(7, cmd), &mut Changes::default());
        let machine = Machine {
            log,
            applied: Some(LogId::new(
                <openraft::vote::leader_id_adv::LeaderId<u64, u64> as openraft::vote::RaftLeaderIdExt>::new_committed(
                    1, 0,
                ),
                3,
            )),
            membership: StoredMembership::default(),
            cold: ColdFiles::default(),
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
    /// written again in the current format.
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

    /// A machine holding one submitted generation (no records), and its id.
    fn one_generation() -> (Machine, GenerationId) {
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
        m.log.apply(&Request::new(1, cmd), &mut Changes::default());
        let id = *m.log.generations.keys().next().unwrap();
        (m, id)
    }

    /// A format 9 data dir (records in the snapshot's own cold section, references without a
    /// segment) loads and serves them; the next build moves them into a cold segment.
    #[test]
    fn a_format_9_snapshot_still_loads() {
        #[derive(Serialize)]
        struct RefV9 {
            offset: u64,
            bytes: u64,
            crc: u32,
            records: Seq,
        }
        #[derive(Serialize)]
        struct BodyV9W<'a> {
            machine: &'a Machine,
            cold: Vec<(GenerationId, RefV9)>,
        }
        let (mut m, id) = one_generation();
        let rec = Record {
            token_id: 5,
            epoch: 1,
            log_ms: 2,
        };
        let g = m.log.generations.get_mut(&id).unwrap();
        g.chain_head = chain::head(id, &[rec]);
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        let path = dir
            .write_with_cold(&m.meta(), |section| {
                let r = section.put(&[rec])?;
                let v9 = RefV9 {
                    offset: r.offset,
                    bytes: r.bytes,
                    crc: r.crc,
                    records: r.records,
                };
                Ok(BodyV9W {
                    machine: &m,
                    cold: vec![(id, v9)],
                })
            })
            .unwrap()
            .path()
            .to_path_buf();
        let file = as_written_by(&path, b"TLSNAP09");
        assert_eq!(file.format().unwrap(), 9);
        let mut problems = Vec::new();
        let (_, loaded) = load_snapshot(&file, &mut problems).expect("loads");
        assert!(problems.is_empty(), "{problems:?}");
        let g = &loaded.generations[&id];
        assert_eq!(g.cold.map(|c| c.segment), Some(0));
        assert_eq!(loaded.records_of(g).unwrap().as_ref(), &[rec]);
        let (f, _, files) = write_snapshot(&dir, loaded).unwrap();
        assert_eq!(files.segment_ids().len(), 1, "moved into a segment");
        let (_, again) = load_snapshot(&f, &mut problems).expect("loads");
        let g = &again.generations[&id];
        assert_ne!(g.cold.map(|c| c.segment), Some(0));
        assert_eq!(again.records_of(g).unwrap().as_ref(), &[rec]);
    }

    /// Records on disk whose frame is intact (its CRC matches) but that are not the generation's
    /// (a bug writing them, or a tampered file with its checksums redone) fail the chain head:
    /// at load, and on every read.
    #[test]
    fn records_on_disk_that_are_not_the_generations_fail_its_chain() {
        let (mut m, id) = one_generation();
        let g = m.log.generations.get_mut(&id).unwrap();
        let rec = Record {
            token_id: 5,
            epoch: 1,
            log_ms: 2,
        };
        g.chain_head = chain::head(id, &[rec]);
        g.records = vec![rec].into();
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
                    segments: Vec::new(),
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
        let files = ColdFiles {
            own: Some(file),
            segments: Default::default(),
        };
        assert!(matches!(read_cold(&files, &cold, &r), Err(ColdReadError::Chain(_))));
    }
}
