//! The Raft log in RocksDB: column family `logs` (big-endian index -> CRC-32 (4 bytes, little
//! endian) + bincode entry) and `meta` (vote, committed, last purged, format). Every read checks
//! the entry's checksum and index; [`check`] reads them all at start-up.
//!
//! Durability rule: `append` writes its batch to RocksDB (memtable and the WAL buffer, which the
//! database keeps in the process: `manual_wal_flush`) and hands the completion callback to one
//! flusher thread. The flusher takes every callback that is waiting, writes out and syncs the
//! WAL once (`flush_wal(true)`: one write and one fsync), and only then fires them: entries are
//! on disk before openraft counts them, and concurrent appends share one write and one fsync
//! (group commit).
//!
//! The newest entries are also kept in memory ([`EntryCache`], bounded by
//! `LOG_CACHE_ENTRIES_MAX` and `LOG_CACHE_BYTES_MAX`): replication to followers and apply read
//! them from there instead of reading, checking and decoding them again from RocksDB. The cache
//! holds exactly what the disk holds for its range: append, truncate and purge change both.

use std::collections::VecDeque;
use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use openraft::storage::{IOFlushed, RaftLogStorage};
use openraft::{LogState, OptionalSend, RaftLogReader};
use rocksdb::{Direction, IteratorMode, WriteBatch, DB};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::faults::Faults;
use crate::limits::{LOG_CACHE_BYTES_MAX, LOG_CACHE_ENTRIES_MAX};
use crate::raft_types::{Entry, LogId, TypeConfig, Vote};

pub const CF_LOGS: &str = "logs";
pub const CF_META: &str = "meta";

const KEY_VOTE: &[u8] = b"vote";
const KEY_COMMITTED: &[u8] = b"committed";
const KEY_PURGED: &[u8] = b"last_purged";

/// An entry row: the CRC-32 of the encoded entry, then the entry.
fn encode_entry(e: &Entry) -> io::Result<Vec<u8>> {
    let body = encode(e)?;
    let mut v = Vec::with_capacity(4 + body.len());
    v.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    v.extend_from_slice(&body);
    Ok(v)
}

fn corrupt(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Decodes the row at `index`, refusing one whose checksum or index is wrong.
fn decode_entry(index: u64, v: &[u8]) -> io::Result<Entry> {
    if v.len() < 4 {
        return Err(corrupt(format!("log entry {index}: {} bytes, too short", v.len())));
    }
    let (crc, body) = v.split_at(4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err(corrupt(format!("log entry {index}: checksum mismatch")));
    }
    let e: Entry = decode(body).map_err(|err| corrupt(format!("log entry {index}: {err}")))?;
    if e.log_id.index != index {
        return Err(corrupt(format!("log entry {index}: holds index {}", e.log_id.index)));
    }
    Ok(e)
}

fn key_index(k: &[u8]) -> io::Result<u64> {
    Ok(u64::from_be_bytes(
        k.try_into()
            .map_err(|_| corrupt(format!("log key of {} bytes", k.len())))?,
    ))
}

/// What a full read of the log found.
#[derive(Debug, Default)]
pub struct LogCheck {
    pub entries: u64,
    pub first_index: Option<u64>,
    pub last_index: Option<u64>,
    pub last_purged: Option<LogId>,
    pub committed: Option<LogId>,
    /// Entries at or before the purge point: earlier versions recorded the point (synced)
    /// before deleting them, and a crash or power cut between the two left them behind. Not a
    /// problem: they are never read, and [`purge_through`] deletes them at the next open. Not
    /// counted in `entries`, `first_index`, `last_index`, nor passed to `each`.
    pub purge_leftovers: u64,
    pub problems: Vec<String>,
}

/// Reads every entry of the log: checksums, indexes, no holes; entries at or before the purge
/// point are counted apart ([`LogCheck::purge_leftovers`]). Calls `each` with every entry past
/// the purge point that reads back whole, in order.
pub fn check(db: &DB, mut each: impl FnMut(&Entry)) -> io::Result<LogCheck> {
    let meta = db.cf_handle(CF_META).expect("column family exists");
    let get = |k: &[u8]| -> io::Result<Option<Vec<u8>>> { db.get_cf(meta, k).map_err(io_err) };
    let mut c = LogCheck::default();
    match get(KEY_PURGED).and_then(|b| b.map(|b| decode::<LogId>(&b)).transpose()) {
        Ok(p) => c.last_purged = p,
        Err(e) => c.problems.push(format!("the purge point does not read: {e}")),
    }
    match get(KEY_COMMITTED).and_then(|b| b.map(|b| decode::<Option<LogId>>(&b)).transpose()) {
        Ok(p) => c.committed = p.flatten(),
        Err(e) => c.problems.push(format!("the committed index does not read: {e}")),
    }
    if let Err(e) = get(KEY_VOTE).and_then(|b| b.map(|b| decode::<Vote>(&b)).transpose()) {
        c.problems.push(format!("the vote does not read: {e}"));
    }
    let logs = db.cf_handle(CF_LOGS).expect("column family exists");
    let mut expect: Option<u64> = None;
    for item in db.iterator_cf(logs, IteratorMode::Start) {
        let (k, v) = match item {
            Ok(kv) => kv,
            Err(e) => {
                c.problems
                    .push(format!("the log does not read past entry {:?}: {e}", c.last_index));
                break;
            }
        };
        let index = match key_index(&k) {
            Ok(i) => i,
            Err(e) => {
                c.problems.push(e.to_string());
                continue;
            }
        };
        if c.last_purged.is_some_and(|p| index <= p.index) {
            c.purge_leftovers += 1;
            continue;
        }
        if let Some(e) = expect {
            if index != e {
                c.problems
                    .push(format!("the log has a hole: entry {e} is missing before {index}"));
            }
        }
        expect = Some(index + 1);
        c.first_index.get_or_insert(index);
        c.last_index = Some(index);
        c.entries += 1;
        match decode_entry(index, &v) {
            Ok(entry) => each(&entry),
            Err(e) => c.problems.push(e.to_string()),
        }
    }
    if let (Some(p), Some(first)) = (c.last_purged, c.first_index) {
        if first > p.index + 1 {
            c.problems.push(format!(
                "the log has a hole: purged to {}, first entry {first}",
                p.index
            ));
        }
    }
    Ok(c)
}

/// Records `purged` as the purge point and deletes the entries at or before it, in one write
/// batch (atomic in the WAL), synced. A purge, and at open the finish of one that an earlier
/// version cut off between its point and its deletion ([`LogCheck::purge_leftovers`]).
pub fn purge_through(db: &DB, purged: LogId) -> io::Result<()> {
    let mut batch = WriteBatch::default();
    batch.put_cf(
        db.cf_handle(CF_META).expect("column family exists"),
        KEY_PURGED,
        encode(&purged)?,
    );
    batch.delete_range_cf(
        db.cf_handle(CF_LOGS).expect("column family exists"),
        index_key(0),
        index_key(purged.index + 1),
    );
    db.write(batch).map_err(io_err)?;
    db.flush_wal(true).map_err(io_err)
}

pub(crate) fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

pub(crate) fn encode<T: Serialize>(v: &T) -> io::Result<Vec<u8>> {
    bincode::serialize(v).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

pub(crate) fn decode<T: DeserializeOwned>(b: &[u8]) -> io::Result<T> {
    bincode::deserialize(b).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

/// The newest log entries, contiguous by index, with their encoded sizes.
#[derive(Default)]
struct EntryCache {
    entries: VecDeque<(Entry, usize)>,
    bytes: usize,
}

impl EntryCache {
    fn first_index(&self) -> Option<u64> {
        self.entries.front().map(|(e, _)| e.log_id.index)
    }

    fn push(&mut self, e: Entry, size: usize) {
        let next = self.entries.back().map(|(b, _)| b.log_id.index + 1);
        if next.is_some_and(|n| n != e.log_id.index) {
            // Not contiguous (cannot happen after truncate_after; kept safe): start over.
            self.entries.clear();
            self.bytes = 0;
        }
        self.bytes += size;
        self.entries.push_back((e, size));
        while self.entries.len() > LOG_CACHE_ENTRIES_MAX || (self.bytes > LOG_CACHE_BYTES_MAX && self.entries.len() > 1)
        {
            let (_, s) = self.entries.pop_front().expect("non-empty");
            self.bytes -= s;
        }
    }

    /// Drops entries above `last` (None: all).
    fn truncate_after(&mut self, last: Option<u64>) {
        while let Some((b, s)) = self.entries.back() {
            if last.is_some_and(|l| b.log_id.index <= l) {
                break;
            }
            self.bytes -= *s;
            self.entries.pop_back();
        }
    }

    /// Drops entries at or below `upto`.
    fn purge(&mut self, upto: u64) {
        while let Some((f, s)) = self.entries.front() {
            if f.log_id.index > upto {
                break;
            }
            self.bytes -= *s;
            self.entries.pop_front();
        }
    }

    /// Entries `[start, end)` if the cache holds all of them.
    fn get(&self, start: u64, end: u64) -> Option<Vec<Entry>> {
        let first = self.first_index()?;
        let past = first + self.entries.len() as u64;
        if start < first || end > past || start > end {
            return None;
        }
        let from = (start - first) as usize;
        let to = (end - first) as usize;
        Some(self.entries.range(from..to).map(|(e, _)| e.clone()).collect())
    }
}

#[derive(Clone)]
pub struct LogStore {
    db: Arc<DB>,
    cache: Arc<Mutex<EntryCache>>,
    flusher: Arc<Flusher>,
    /// Planted bug (fault suite builds only): acknowledge appends before the fsync.
    faults: Faults,
}

/// The fsync thread and the channel to it. Dropping the last `LogStore` clone closes the channel and
/// joins the thread, so the thread's handle on the database is gone before the store is: a detached
/// thread still closing RocksDB while the process exits aborts it ("pthread lock: Invalid argument").
struct Flusher {
    tx: Option<mpsc::Sender<IOFlushed<TypeConfig>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Flusher {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl LogStore {
    pub fn new(db: Arc<DB>, faults: Faults) -> Self {
        let (tx, rx) = mpsc::channel::<IOFlushed<TypeConfig>>();
        let flush_db = db.clone();
        let thread = std::thread::Builder::new()
            .name("raftlog-fsync".into())
            .spawn(move || flusher(flush_db, rx))
            .expect("spawn fsync thread");
        LogStore {
            db,
            cache: Arc::default(),
            flusher: Arc::new(Flusher {
                tx: Some(tx),
                thread: Some(thread),
            }),
            faults,
        }
    }

    fn cf(&self, name: &str) -> &rocksdb::ColumnFamily {
        self.db.cf_handle(name).expect("column family exists: created at open")
    }

    fn get_meta<T: DeserializeOwned>(&self, key: &[u8]) -> io::Result<Option<T>> {
        match self.db.get_cf(self.cf(CF_META), key).map_err(io_err)? {
            Some(b) => Ok(Some(decode(&b)?)),
            None => Ok(None),
        }
    }

    fn put_meta_synced<T: Serialize>(&self, key: &[u8], v: &T) -> io::Result<()> {
        self.db.put_cf(self.cf(CF_META), key, encode(v)?).map_err(io_err)?;
        self.db.flush_wal(true).map_err(io_err)
    }
}

/// One thread that syncs the WAL for every waiting append at once.
fn flusher(db: Arc<DB>, rx: mpsc::Receiver<IOFlushed<TypeConfig>>) {
    while let Ok(first) = rx.recv() {
        let mut waiting = vec![first];
        waiting.extend(rx.try_iter());
        let result = db.flush_wal(true);
        for cb in waiting {
            cb.io_completed(result.as_ref().map(|_| ()).map_err(io_err));
        }
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        let start = match range.start_bound() {
            Bound::Included(x) => *x,
            Bound::Excluded(x) => *x + 1,
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(x) => Some(*x + 1),
            Bound::Excluded(x) => Some(*x),
            Bound::Unbounded => None,
        };
        if let Some(end) = end {
            if let Some(hit) = self.cache.lock().expect("lock").get(start, end) {
                return Ok(hit);
            }
        }
        let mut out = Vec::new();
        let key = index_key(start);
        for item in self
            .db
            .iterator_cf(self.cf(CF_LOGS), IteratorMode::From(&key, Direction::Forward))
        {
            let (k, v) = item.map_err(io_err)?;
            let index = key_index(&k)?;
            if !range.contains(&index) {
                break;
            }
            out.push(decode_entry(index, &v)?);
        }
        Ok(out)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        self.get_meta(KEY_VOTE)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, io::Error> {
        let last_purged_log_id: Option<LogId> = self.get_meta(KEY_PURGED)?;
        let last = match self.db.iterator_cf(self.cf(CF_LOGS), IteratorMode::End).next() {
            Some(item) => {
                let (k, v) = item.map_err(io_err)?;
                Some(decode_entry(key_index(&k)?, &v)?.log_id)
            }
            None => None,
        };
        Ok(LogState {
            last_log_id: last.or(last_purged_log_id),
            last_purged_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        self.put_meta_synced(KEY_VOTE, vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        // Not synced: a lost committed index is recovered from the log by Raft itself.
        let cf = self.cf(CF_META);
        self.db.put_cf(cf, KEY_COMMITTED, encode(&committed)?).map_err(io_err)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        Ok(self.get_meta::<Option<LogId>>(KEY_COMMITTED)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<TypeConfig>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + Send,
    {
        let mut batch = WriteBatch::default();
        let mut cached = Vec::new();
        for entry in entries {
            let row = encode_entry(&entry)?;
            batch.put_cf(self.cf(CF_LOGS), index_key(entry.log_id.index), &row);
            cached.push((entry, row.len()));
        }
        // Written before returning, so the entries are readable at once; durable only after
        // the flusher's fsync, which is when the callback fires.
        self.db.write(batch).map_err(io_err)?;
        {
            let mut cache = self.cache.lock().expect("lock");
            for (e, size) in cached {
                cache.push(e, size);
            }
        }
        if self.faults.ack_before_fsync() {
            callback.io_completed(Ok(()));
            return Ok(());
        }
        self.flusher
            .tx
            .as_ref()
            .expect("sender lives until drop")
            .send(callback)
            .map_err(|_| io_err("fsync thread stopped"))
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let from = last_log_id.map_or(0, |id| id.index + 1);
        self.cache
            .lock()
            .expect("lock")
            .truncate_after(last_log_id.map(|id| id.index));
        self.db
            .delete_range_cf(self.cf(CF_LOGS), index_key(from), index_key(u64::MAX))
            .map_err(io_err)?;
        // Make the truncation durable before later appends land at the same indexes.
        self.db.flush_wal(true).map_err(io_err)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        purge_through(&self.db, log_id)?;
        self.cache.lock().expect("lock").purge(log_id.index);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::testing::log_id;

    fn blank(index: u64) -> Entry {
        Entry {
            log_id: log_id::<TypeConfig>(1, 1, index),
            payload: openraft::EntryPayload::Blank,
        }
    }

    fn indexes(v: Option<Vec<Entry>>) -> Option<Vec<u64>> {
        v.map(|v| v.iter().map(|e| e.log_id.index).collect())
    }

    /// The command is shared in memory (`Arc`), and its encoding is the command's own: a log
    /// written when `Request` held the command by value decodes the same, and the other way.
    #[test]
    fn a_request_encodes_as_its_command_by_value() {
        #[derive(Serialize, serde::Deserialize, PartialEq, Debug)]
        struct ByValue {
            log_ms: u64,
            cmd: crate::types::Command,
        }
        let cmd = crate::types::Command::Append {
            decoder: "d1".into(),
            lease_ms: 1_000,
            items: vec![crate::types::AppendItem {
                generation: 7,
                epoch: 2,
                start_seq: 3,
                token_ids: vec![4, 5],
                finish: None,
            }],
        };
        let shared = crate::types::Request::new(9, cmd.clone());
        let plain = ByValue { log_ms: 9, cmd };
        let bytes = encode(&plain).unwrap();
        assert_eq!(encode(&shared).unwrap(), bytes);
        assert_eq!(decode::<crate::types::Request>(&bytes).unwrap(), shared);
        assert_eq!(decode::<ByValue>(&encode(&shared).unwrap()).unwrap(), plain);
    }

    #[test]
    fn the_cache_answers_only_ranges_it_holds_whole_and_follows_truncate_and_purge() {
        let mut c = EntryCache::default();
        assert_eq!(indexes(c.get(0, 1)), None);
        for i in 5..15 {
            c.push(blank(i), 10);
        }
        assert_eq!(indexes(c.get(5, 8)), Some(vec![5, 6, 7]));
        assert_eq!(indexes(c.get(12, 15)), Some(vec![12, 13, 14]));
        assert_eq!(indexes(c.get(4, 8)), None, "starts before the cache");
        assert_eq!(indexes(c.get(12, 16)), None, "ends past the cache");
        c.truncate_after(Some(9));
        assert_eq!(indexes(c.get(9, 11)), None, "truncated entries are gone");
        assert_eq!(indexes(c.get(8, 10)), Some(vec![8, 9]));
        c.push(blank(10), 10);
        assert_eq!(indexes(c.get(9, 11)), Some(vec![9, 10]), "re-appended after truncation");
        c.purge(7);
        assert_eq!(indexes(c.get(7, 9)), None, "purged entries are gone");
        assert_eq!(c.bytes, 30, "sizes follow truncate and purge");
        c.push(blank(20), 10);
        assert_eq!(indexes(c.get(8, 9)), None, "a gap starts the cache over");
        assert_eq!(indexes(c.get(20, 21)), Some(vec![20]));
        c.truncate_after(None);
        assert_eq!((c.entries.len(), c.bytes), (0, 0));
    }

    /// A purge cut off between its synced purge point and its deletion (a crash, a power cut,
    /// in versions that did not write both at once) leaves entries at or before the point: the
    /// check counts them apart, not as integrity problems (the node would refuse to start,
    /// again and again), and `purge_through` deletes them.
    #[test]
    fn entries_left_by_an_interrupted_purge_are_not_problems_and_are_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let db = crate::db::open(dir.path()).unwrap();
        let logs = db.cf_handle(CF_LOGS).unwrap();
        for i in 1..=10 {
            db.put_cf(logs, index_key(i), encode_entry(&blank(i)).unwrap()).unwrap();
        }
        let point = log_id::<TypeConfig>(1, 1, 6);
        db.put_cf(db.cf_handle(CF_META).unwrap(), KEY_PURGED, encode(&point).unwrap())
            .unwrap();
        let mut seen = Vec::new();
        let c = check(&db, |e| seen.push(e.log_id.index)).unwrap();
        assert!(c.problems.is_empty(), "{:?}", c.problems);
        assert_eq!(c.purge_leftovers, 6);
        assert_eq!((c.entries, c.first_index, c.last_index), (4, Some(7), Some(10)));
        assert_eq!(seen, vec![7, 8, 9, 10]);
        purge_through(&db, point).unwrap();
        let c = check(&db, |_| {}).unwrap();
        assert!(c.problems.is_empty(), "{:?}", c.problems);
        assert_eq!((c.purge_leftovers, c.entries, c.first_index), (0, 4, Some(7)));
        // A hole past the purge point still is one.
        db.delete_cf(logs, index_key(8)).unwrap();
        let c = check(&db, |_| {}).unwrap();
        assert_eq!(
            c.problems,
            vec!["the log has a hole: entry 8 is missing before 9".to_string()]
        );
    }

    #[test]
    fn the_cache_stays_within_its_limits() {
        let mut c = EntryCache::default();
        for i in 0..(LOG_CACHE_ENTRIES_MAX as u64 + 10) {
            c.push(blank(i), 1);
        }
        assert_eq!(c.entries.len(), LOG_CACHE_ENTRIES_MAX);
        assert_eq!(c.first_index(), Some(10));
        c.push(blank(LOG_CACHE_ENTRIES_MAX as u64 + 10), LOG_CACHE_BYTES_MAX);
        assert_eq!(c.entries.len(), 1, "one huge entry evicts the rest but stays");
        assert_eq!(c.bytes, LOG_CACHE_BYTES_MAX);
    }
}
