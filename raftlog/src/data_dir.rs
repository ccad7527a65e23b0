//! A node's data dir: the Raft log's RocksDB in `log/`, the state machine's snapshots in
//! `snapshots/`. Opening it checks everything before the node may serve: every log entry's
//! checksum and index, the newest snapshot's checksum and hash chains, and that the log continues
//! where the snapshot ends. [`verify`] does the same read-only for a stopped node, and also
//! re-applies the committed log after the snapshot.

use std::path::{Path, PathBuf};

use openraft::EntryPayload;

use crate::error::LogError;
use crate::faults::Faults;
use crate::log_store::{self, LogStore};
use crate::raft_types::Entry;
use crate::sm_store::{self, LoadReport, SmStore};
use crate::snapshot::SnapshotDir;
use crate::state::Changes;

pub fn log_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("log")
}

pub fn snapshot_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("snapshots")
}

/// The process holding a lock on `lock_file` (RocksDB's `LOCK`, which a running node holds
/// with `fcntl`), from the kernel's table of file locks (`/proc/locks`); `None` when nobody
/// does, or the table cannot be read.
fn lock_holder(lock_file: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(lock_file).ok()?;
    let dev = meta.dev();
    // Linux's dev_t: major in bits 8-19 and 32-63, minor in bits 0-7 and 20-31.
    let (major, minor) = (
        ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff),
        (dev & 0xff) | ((dev >> 12) & !0xff),
    );
    let file = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    let table = std::fs::read_to_string("/proc/locks").ok()?;
    table.lines().find_map(|line| {
        // `1: POSIX  ADVISORY  WRITE 4242 fd:01:1234 0 EOF` (`1: -> ...` for a waiter).
        let fields: Vec<&str> = line.split_whitespace().filter(|f| *f != "->").collect();
        (fields.get(5) == Some(&file.as_str())).then(|| fields.get(4)?.parse().ok())?
    })
}

/// A data dir of tokenlog before raftlog v2 kept its RocksDB (with the state machine's rows)
/// directly in the data dir.
fn refuse_old_layout(data_dir: &Path) -> Result<(), LogError> {
    if data_dir.join("CURRENT").exists() && !log_dir(data_dir).exists() {
        return Err(LogError::Integrity {
            dir: data_dir.display().to_string(),
            problems: vec![
                "this data dir was written by an older tokenlog (state machine rows in RocksDB, format 1), which this version does not read; wipe it and let the node catch up from its peers by snapshot".into(),
            ],
        });
    }
    Ok(())
}

/// The log must continue where the snapshot ends: entries purged past it are lost.
fn purged_past_snapshot(lc: &log_store::LogCheck, snapshot_index: u64) -> Option<String> {
    let p = lc.last_purged?.index;
    (p > snapshot_index).then(|| {
        format!(
            "the log is purged to entry {p} but the newest usable snapshot ends at {snapshot_index}: entries {}..={p} are gone",
            snapshot_index + 1
        )
    })
}

/// Opened storage of a node that passed every check.
pub struct Storage {
    pub log: LogStore,
    pub sm: SmStore,
    pub report: LoadReport,
}

fn storage_err(what: &str, e: impl std::fmt::Display) -> LogError {
    LogError::storage(what, std::io::Error::other(e.to_string()))
}

/// Makes the entries of directory `dir` durable.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Opens (creating) `data_dir` for a node. Any integrity problem is an error
/// ([`LogError::Integrity`]): the node does not start rather than serve a damaged log.
pub fn open(data_dir: &Path, faults: Faults) -> Result<Storage, LogError> {
    refuse_old_layout(data_dir)?;
    std::fs::create_dir_all(data_dir).map_err(|e| LogError::storage(data_dir.display(), e))?;
    let db = crate::db::open(&log_dir(data_dir)).map_err(|e| storage_err("opening the Raft log", e))?;
    let lc = log_store::check(&db, |_| {}).map_err(|e| LogError::storage("reading the Raft log", e))?;
    if let (Some(purged), 1..) = (lc.last_purged, lc.purge_leftovers) {
        // A purge was cut off after it recorded its point: finish it.
        log_store::purge_through(&db, purged).map_err(|e| LogError::storage("finishing a purge", e))?;
        tracing::warn!(
            entries = lc.purge_leftovers,
            purged_to = purged.index,
            "finished an interrupted purge: deleted the entries left at or before its point"
        );
    }
    let (sm, mut report) =
        SmStore::open(&snapshot_dir(data_dir), faults).map_err(|e| LogError::storage("loading the snapshot", e))?;
    // The directories just made are entries of their parents: durable only once those are
    // synced (a power cut could lose `snapshots/` after the log was purged behind its first
    // snapshot). The data dir holds `log/` and `snapshots/`; `SnapshotDir::open` syncs `cold/`.
    sync_dir(data_dir).map_err(|e| LogError::storage(data_dir.display(), e))?;
    if let Some(parent) = data_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent).map_err(|e| LogError::storage(parent.display(), e))?;
    }
    report.problems.extend(lc.problems.iter().cloned());
    report.problems.extend(purged_past_snapshot(&lc, report.snapshot_index));
    if !report.problems.is_empty() {
        return Err(LogError::Integrity {
            dir: data_dir.display().to_string(),
            problems: report.problems,
        });
    }
    tracing::info!(
        snapshot_index = report.snapshot_index,
        generations = report.generations,
        records = report.records,
        log_entries = lc.entries,
        "storage checked"
    );
    Ok(Storage {
        log: LogStore::new(db, faults),
        sm,
        report,
    })
}

/// `tokenlog verify --data-dir`: reads a stopped node's data dir without writing to it. Checks
/// the log and the newest snapshot, then re-applies the committed entries after the snapshot and
/// counts what a restart would serve.
pub fn verify(data_dir: &Path) -> Result<LoadReport, LogError> {
    refuse_old_layout(data_dir)?;
    if let Some(pid) = lock_holder(&log_dir(data_dir).join("LOCK")) {
        return Err(LogError::Invalid(format!(
            "{} is in use by a running process (pid {pid}), which changes it while it is read \
             (a snapshot replaced, entries purged: they would read as broken chains); stop it \
             first, or verify the running node through its API (`tokenlog verify --node`)",
            data_dir.display()
        )));
    }
    if !log_dir(data_dir).exists() {
        return Err(LogError::Invalid(format!(
            "{} holds no Raft log ({} is missing)",
            data_dir.display(),
            log_dir(data_dir).display()
        )));
    }
    let mut report = LoadReport::default();
    let snapshots = SnapshotDir::open_read_only(&snapshot_dir(data_dir));
    let mut machine = sm_store::Machine::default();
    match snapshots.newest() {
        Ok(None) => {}
        Ok(Some(file)) => {
            if let Some((meta, m)) = sm_store::load_snapshot(&file, &mut report.problems) {
                report.snapshot_index = meta.last_log_id.map_or(0, |l| l.index);
                machine = m;
            }
        }
        Err(e) => report.problems.push(format!("the snapshots do not read: {e}")),
    }
    let db = crate::db::open_read_only(&log_dir(data_dir)).map_err(|e| storage_err("opening the Raft log", e))?;
    let mut entries: Vec<Entry> = Vec::new();
    let lc = log_store::check(&db, |e| {
        if e.log_id.index > report.snapshot_index {
            entries.push(e.clone());
        }
    })
    .map_err(|e| LogError::storage("reading the Raft log", e))?;
    let purged = purged_past_snapshot(&lc, report.snapshot_index);
    report.problems.extend(lc.problems);
    report.problems.extend(purged);
    let committed = lc.committed.map_or(0, |c| c.index);
    let mut changes = Changes::default();
    for e in entries.iter().filter(|e| e.log_id.index <= committed) {
        if let EntryPayload::Normal(req) = &e.payload {
            machine.log.apply(req, &mut changes);
        }
    }
    report.generations = machine.generations.len() as u64;
    report.records = sm_store::check_chains(&machine, &mut report.problems);
    Ok(report)
}
