//! The RocksDB-backed state machine. The live state is a [`LogState`] in memory (shared with the
//! read paths); every `apply` call persists the rows it changed in one write batch in column
//! family `sm`:
//!
//! | key                          | value                                        |
//! |------------------------------|----------------------------------------------|
//! | `m/applied`, `m/membership`  | last applied log id, membership (bincode)    |
//! | `m/clock`                    | `(next_generation, log_ms)`                  |
//! | `m/snapshot`                 | the last built or installed snapshot         |
//! | `m/decoders`                 | live decoder registrations                   |
//! | `b/{gen:be64}`               | the generation's binding (written rarely)    |
//! | `g/{gen:be64}`               | its small mutable metadata                   |
//! | `r/{gen:be64}{seq:be32}`     | record: token, epoch, log_ms, chain hash     |
//!
//! The state machine is not fsynced per apply (the Raft log is). Before a snapshot is built the
//! WAL is synced, so everything the snapshot covers (and so every purged entry) is durable here.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use futures::{Stream, TryStreamExt};
use openraft::storage::{EntryResponder, RaftStateMachine};
use openraft::{EntryPayload, OptionalSend, RaftSnapshotBuilder};
use rocksdb::{WriteBatch, DB};
use serde::{Deserialize, Serialize};

use crate::chain::{self, Hash};
use crate::faults::Faults;
use crate::log_store::{decode, encode, io_err};
use crate::raft_types::{LogId, Snapshot, SnapshotData, SnapshotMeta, StoredMembership, TypeConfig};
use crate::state::{Changes, LogState};
use crate::types::*;

pub const CF_SM: &str = "sm";

const KEY_APPLIED: &[u8] = b"m/applied";
const KEY_MEMBERSHIP: &[u8] = b"m/membership";
const KEY_CLOCK: &[u8] = b"m/clock";
const KEY_SNAPSHOT: &[u8] = b"m/snapshot";
const KEY_DECODERS: &[u8] = b"m/decoders";

fn gen_key(prefix: u8, id: GenerationId) -> [u8; 10] {
    let mut k = [0u8; 10];
    k[0] = prefix;
    k[1] = b'/';
    k[2..].copy_from_slice(&id.to_be_bytes());
    k
}

pub(crate) fn record_key(id: GenerationId, seq: Seq) -> [u8; 14] {
    let mut k = [0u8; 14];
    k[..10].copy_from_slice(&gen_key(b'r', id));
    k[10..].copy_from_slice(&seq.to_be_bytes());
    k
}

/// A record row: 4 + 8 + 8 + 32 bytes.
pub(crate) fn encode_record(r: &Record, hash: &Hash) -> [u8; 52] {
    let mut v = [0u8; 52];
    v[0..4].copy_from_slice(&r.token_id.to_be_bytes());
    v[4..12].copy_from_slice(&r.epoch.to_be_bytes());
    v[12..20].copy_from_slice(&r.log_ms.to_be_bytes());
    v[20..52].copy_from_slice(hash);
    v
}

pub(crate) fn decode_record(v: &[u8]) -> io::Result<(Record, Hash)> {
    if v.len() != 52 {
        return Err(io_err(format!("record row has {} bytes, expected 52", v.len())));
    }
    let u32_at = |i: usize| u32::from_be_bytes(v[i..i + 4].try_into().unwrap());
    let u64_at = |i: usize| u64::from_be_bytes(v[i..i + 8].try_into().unwrap());
    let record = Record {
        token_id: u32_at(0),
        epoch: u64_at(4),
        log_ms: u64_at(12),
    };
    Ok((record, v[20..52].try_into().unwrap()))
}

/// The mutable part of a generation (everything but binding and records).
#[derive(Serialize, Deserialize)]
pub(crate) struct GenMeta {
    pub id: GenerationId,
    pub tenant: String,
    pub request_id: String,
    pub state: GenState,
    pub lease: Lease,
    pub frontier: Seq,
    pub chain_head: Hash,
    pub finish_reason: Option<FinishReason>,
    pub finish_detail: String,
    pub submitted_log_ms: u64,
    pub deadline_log_ms: u64,
    pub finished_log_ms: u64,
    pub grants: Vec<Grant>,
}

impl GenMeta {
    fn of(g: &Generation) -> Self {
        GenMeta {
            id: g.id,
            tenant: g.tenant.clone(),
            request_id: g.request_id.clone(),
            state: g.state,
            lease: g.lease.clone(),
            frontier: g.frontier(),
            chain_head: g.chain_head,
            finish_reason: g.finish_reason,
            finish_detail: g.finish_detail.clone(),
            submitted_log_ms: g.submitted_log_ms,
            deadline_log_ms: g.deadline_log_ms,
            finished_log_ms: g.finished_log_ms,
            grants: g.grants.clone(),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta,
    data: Vec<u8>,
}

/// Raft metadata of the state machine.
#[derive(Clone, Default)]
struct Applied {
    log_id: Option<LogId>,
    membership: StoredMembership,
}

/// Shared between the Raft state machine task and the read paths (Watch, Get, PendingWork).
pub struct SmShared {
    db: Arc<DB>,
    state: RwLock<LogState>,
    applied: Mutex<Applied>,
    /// Bumped after every apply batch and snapshot install; readers wait on it.
    applied_tx: tokio::sync::watch::Sender<u64>,
}

#[derive(Clone)]
pub struct SmStore {
    shared: Arc<SmShared>,
}

/// Problems found while loading or verifying persisted chains.
#[derive(Debug, Default)]
pub struct LoadReport {
    pub generations: u64,
    pub records: u64,
    pub problems: Vec<String>,
}

impl SmStore {
    /// Opens the state machine from `db`, rebuilding the in-memory state from its rows.
    /// `faults`: planted bugs of the state machine (fault suite builds only).
    pub fn open(db: Arc<DB>, faults: Faults) -> io::Result<(Self, LoadReport)> {
        let (mut state, applied, report) = load(&db)?;
        state.faults = faults;
        let index = applied.log_id.map_or(0, |l| l.index);
        let (applied_tx, _) = tokio::sync::watch::channel(index);
        let shared = SmShared {
            db,
            state: RwLock::new(state),
            applied: Mutex::new(applied),
            applied_tx,
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
}

impl SmShared {
    /// Read access to the applied state. Hold it briefly: apply waits for it.
    pub fn read(&self) -> RwLockReadGuard<'_, LogState> {
        self.state.read().expect("state lock poisoned")
    }

    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.applied_tx.subscribe()
    }

    pub fn applied_index(&self) -> u64 {
        *self.applied_tx.borrow()
    }

    /// Re-reads every record row and checks each chain (the audit behind `tokenlog verify`).
    pub fn verify(&self) -> io::Result<LoadReport> {
        Ok(load(&self.db)?.2)
    }

    fn cf(&self) -> &rocksdb::ColumnFamily {
        self.db.cf_handle(CF_SM).expect("column family exists: created at open")
    }

    fn persist(
        &self,
        state: &LogState,
        changes: &Changes,
        applied: &Applied,
        bound: &[GenerationId],
    ) -> io::Result<()> {
        let cf = self.cf();
        let mut batch = WriteBatch::default();
        for id in bound {
            if let Some(g) = state.generations.get(id) {
                batch.put_cf(cf, gen_key(b'b', *id), encode(&g.binding)?);
            }
        }
        for id in &changes.touched {
            if let Some(g) = state.generations.get(id) {
                batch.put_cf(cf, gen_key(b'g', *id), encode(&GenMeta::of(g))?);
            }
        }
        for (id, seq, hash) in &changes.new_records {
            let r = &state.generations[id].records[*seq as usize];
            batch.put_cf(cf, record_key(*id, *seq), encode_record(r, hash));
        }
        for (id, _, _) in &changes.pruned {
            batch.delete_cf(cf, gen_key(b'b', *id));
            batch.delete_cf(cf, gen_key(b'g', *id));
            batch.delete_range_cf(cf, record_key(*id, 0), record_key(*id + 1, 0));
        }
        if changes.decoders {
            batch.put_cf(cf, KEY_DECODERS, encode(&state.decoders)?);
        }
        batch.put_cf(cf, KEY_APPLIED, encode(&applied.log_id)?);
        batch.put_cf(cf, KEY_MEMBERSHIP, encode(&applied.membership)?);
        batch.put_cf(cf, KEY_CLOCK, encode(&(state.next_generation, state.log_ms))?);
        self.db.write(batch).map_err(io_err)
    }

    /// Replaces every row with `state` (snapshot install).
    fn replace_all(&self, state: &LogState, applied: &Applied) -> io::Result<()> {
        let cf = self.cf();
        let mut batch = WriteBatch::default();
        batch.delete_range_cf(cf, [b'b'], [b'b' + 1]);
        batch.delete_range_cf(cf, [b'g'], [b'g' + 1]);
        batch.delete_range_cf(cf, [b'r'], [b'r' + 1]);
        self.db.write(batch).map_err(io_err)?;
        let mut changes = Changes::default();
        changes.decoders = true;
        let mut bound = Vec::new();
        for g in state.generations.values() {
            changes.touched.insert(g.id);
            bound.push(g.id);
            let mut h = chain::genesis(g.id);
            for (seq, r) in g.records.iter().enumerate() {
                h = chain::next(&h, g.id, seq as Seq, r);
                changes.new_records.push((g.id, seq as Seq, h));
            }
        }
        self.persist(state, &changes, applied, &bound)?;
        self.db.flush_wal(true).map_err(io_err)
    }
}

/// Rebuilds the state from the rows, checking every chain against its stored hashes.
fn load(db: &DB) -> io::Result<(LogState, Applied, LoadReport)> {
    let cf = db.cf_handle(CF_SM).expect("column family exists");
    let get = |k: &[u8]| db.get_cf(cf, k).map_err(io_err);
    let mut applied = Applied::default();
    if let Some(b) = get(KEY_APPLIED)? {
        applied.log_id = decode(&b)?;
    }
    if let Some(b) = get(KEY_MEMBERSHIP)? {
        applied.membership = decode(&b)?;
    }
    let mut state = LogState::default();
    if let Some(b) = get(KEY_CLOCK)? {
        (state.next_generation, state.log_ms) = decode(&b)?;
    }
    if let Some(b) = get(KEY_DECODERS)? {
        state.decoders = decode(&b)?;
    }
    let mut bindings: BTreeMap<GenerationId, Binding> = BTreeMap::new();
    for item in db.prefix_iterator_cf(cf, b"b/") {
        let (k, v) = item.map_err(io_err)?;
        if !k.starts_with(b"b/") {
            break;
        }
        bindings.insert(u64::from_be_bytes(k[2..10].try_into().map_err(io_err)?), decode(&v)?);
    }
    let mut report = LoadReport::default();
    for item in db.prefix_iterator_cf(cf, b"g/") {
        let (k, v) = item.map_err(io_err)?;
        if !k.starts_with(b"g/") {
            break;
        }
        let meta: GenMeta = decode(&v)?;
        let binding = bindings.remove(&meta.id).unwrap_or_default();
        let g = load_generation(db, cf, meta, binding, &mut report)?;
        state.generations.insert(g.id, g);
    }
    state.rebuild_index();
    report.generations = state.generations.len() as u64;
    Ok((state, applied, report))
}

fn load_generation(
    db: &DB,
    cf: &rocksdb::ColumnFamily,
    meta: GenMeta,
    binding: Binding,
    report: &mut LoadReport,
) -> io::Result<Generation> {
    let mut records = Vec::with_capacity(meta.frontier as usize);
    let mut h = chain::genesis(meta.id);
    let prefix = gen_key(b'r', meta.id);
    for item in db.prefix_iterator_cf(cf, prefix) {
        let (k, v) = item.map_err(io_err)?;
        if !k.starts_with(&prefix) {
            break;
        }
        let seq = u32::from_be_bytes(k[10..14].try_into().map_err(io_err)?);
        let (record, stored) = decode_record(&v)?;
        if seq as usize != records.len() {
            report.problems.push(format!(
                "request {:?} (generation {}): record seq {seq} found where seq {} was expected",
                meta.request_id,
                meta.id,
                records.len()
            ));
            break;
        }
        h = chain::next(&h, meta.id, seq, &record);
        if h != stored {
            let owner = meta
                .grants
                .iter()
                .find(|g| g.epoch == record.epoch)
                .map_or("?", |g| g.owner.as_str());
            report.problems.push(format!(
                "request {:?} (generation {}): chain broken at seq {seq} (epoch {}, decoder {owner}, log time {} ms)",
                meta.request_id, meta.id, record.epoch, record.log_ms
            ));
            break;
        }
        records.push(record);
        report.records += 1;
    }
    if records.len() as Seq == meta.frontier && h != meta.chain_head {
        report.problems.push(format!(
            "request {:?} (generation {}): chain head differs from the stored head",
            meta.request_id, meta.id
        ));
    } else if records.len() as Seq != meta.frontier
        && report
            .problems
            .last()
            .is_none_or(|p| !p.contains(&format!("generation {})", meta.id)))
    {
        report.problems.push(format!(
            "request {:?} (generation {}): {} records on disk, frontier says {}",
            meta.request_id,
            meta.id,
            records.len(),
            meta.frontier
        ));
    }
    Ok(Generation {
        id: meta.id,
        tenant: meta.tenant,
        request_id: meta.request_id,
        binding,
        state: meta.state,
        lease: meta.lease,
        records,
        chain_head: h,
        finish_reason: meta.finish_reason,
        finish_detail: meta.finish_detail,
        submitted_log_ms: meta.submitted_log_ms,
        deadline_log_ms: meta.deadline_log_ms,
        finished_log_ms: meta.finished_log_ms,
        grants: meta.grants,
    })
}

impl RaftSnapshotBuilder<TypeConfig> for SmStore {
    type SnapshotData = SnapshotData;

    async fn build_snapshot(&mut self) -> Result<Snapshot, io::Error> {
        let s = &self.shared;
        // Everything this snapshot covers must be durable here before Raft may purge it.
        s.db.flush_wal(true).map_err(io_err)?;
        let (data, applied) = {
            let state = s.read();
            let applied = s.applied.lock().expect("lock").clone();
            (encode(&*state)?, applied)
        };
        let meta = SnapshotMeta {
            last_log_id: applied.log_id,
            last_membership: applied.membership,
        };
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data,
        };
        s.db.put_cf(s.cf(), KEY_SNAPSHOT, encode(&stored)?).map_err(io_err)?;
        s.db.flush_wal(true).map_err(io_err)?;
        Ok(Snapshot {
            meta,
            snapshot: stored.data,
        })
    }
}

impl RaftStateMachine<TypeConfig> for SmStore {
    type SnapshotData = SnapshotData;
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        let a = self.shared.applied.lock().expect("lock").clone();
        Ok((a.log_id, a.membership))
    }

    async fn apply<S>(&mut self, mut entries: S) -> Result<(), io::Error>
    where
        S: Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>> + Unpin + OptionalSend,
    {
        let s = &self.shared;
        let mut changes = Changes::default();
        let mut bound = Vec::new();
        let mut responders = Vec::new();
        let mut applied = s.applied.lock().expect("lock").clone();
        let mut batch = Vec::new();
        while let Some(item) = entries.try_next().await? {
            batch.push(item);
        }
        {
            let mut state = s.state.write().expect("state lock poisoned");
            for (entry, responder) in batch {
                applied.log_id = Some(entry.log_id);
                let response = match entry.payload {
                    EntryPayload::Blank => Response::None,
                    EntryPayload::Membership(m) => {
                        applied.membership = StoredMembership::new(Some(entry.log_id), m);
                        Response::None
                    }
                    EntryPayload::Normal(req) => {
                        let response = state.apply(&req, &mut changes);
                        if let Command::BindPrompt { generation, .. } = &req.cmd {
                            bound.push(*generation);
                        }
                        if let Response::Submitted {
                            created: true,
                            generation,
                        } = &response
                        {
                            bound.push(generation.id);
                        }
                        response
                    }
                };
                responders.push((responder, response));
            }
            s.persist(&state, &changes, &applied, &bound)?;
        }
        *s.applied.lock().expect("lock") = applied.clone();
        // Answer only after the rows are written, so a reader that sees the answer sees the rows.
        for (responder, response) in responders {
            if let Some(r) = responder {
                r.send(response);
            }
        }
        s.applied_tx.send_replace(applied.log_id.map_or(0, |l| l.index));
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMeta, snapshot: SnapshotData) -> Result<(), io::Error> {
        let s = &self.shared;
        let mut new_state: LogState = decode(&snapshot)?;
        new_state.rebuild_index();
        let applied = Applied {
            log_id: meta.last_log_id,
            membership: meta.last_membership.clone(),
        };
        {
            let mut state = s.state.write().expect("state lock poisoned");
            s.replace_all(&new_state, &applied)?;
            new_state.faults = state.faults;
            *state = new_state;
        }
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: snapshot,
        };
        s.db.put_cf(s.cf(), KEY_SNAPSHOT, encode(&stored)?).map_err(io_err)?;
        s.db.flush_wal(true).map_err(io_err)?;
        *s.applied.lock().expect("lock") = applied.clone();
        s.applied_tx.send_replace(applied.log_id.map_or(0, |l| l.index));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, io::Error> {
        let s = &self.shared;
        match s.db.get_cf(s.cf(), KEY_SNAPSHOT).map_err(io_err)? {
            None => Ok(None),
            Some(b) => {
                let stored: StoredSnapshot = decode(&b)?;
                Ok(Some(Snapshot {
                    meta: stored.meta,
                    snapshot: stored.data,
                }))
            }
        }
    }
}
