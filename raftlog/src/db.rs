//! Opening the Raft log's RocksDB (`<data dir>/log`): column families `logs` and `meta`.
//!
//! RocksDB runs with `TolerateCorruptedTailRecords` WAL recovery and paranoid checks: a
//! corrupted WAL record or table makes the open fail with RocksDB's own message, where the
//! default recovery mode (point in time) would silently drop every fsynced record after it; an
//! incomplete last record (a crash while it was being written: never fsynced, never
//! acknowledged) is dropped. `AbsoluteConsistency` took that torn tail for corruption too, and a
//! node killed in the middle of writing a large batch could not start again.

use std::path::Path;
use std::sync::Arc;

use rocksdb::{ColumnFamilyDescriptor, DBRecoveryMode, Options, DB};

use crate::log_store::{CF_LOGS, CF_META};

#[derive(Debug, thiserror::Error)]
#[error("cannot open the Raft log in {path}: {source}")]
pub struct OpenError {
    pub path: String,
    #[source]
    pub source: rocksdb::Error,
}

fn options() -> Options {
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    opts.set_keep_log_file_num(4);
    opts.set_wal_recovery_mode(DBRecoveryMode::TolerateCorruptedTailRecords);
    opts.set_paranoid_checks(true);
    // Written WAL data stays in this process until the log store's flush (one write and one
    // fsync per group of appends, not a write per append); nothing is acknowledged before
    // that flush. (So the planted ack-before-fsync bug, which acknowledges first, loses
    // acknowledged entries at kill -9 the way a power cut loses unsynced ones, and the fault
    // suite must catch it.)
    opts.set_manual_wal_flush(true);
    opts
}

fn descriptors() -> [ColumnFamilyDescriptor; 2] {
    [
        ColumnFamilyDescriptor::new(CF_LOGS, Options::default()),
        ColumnFamilyDescriptor::new(CF_META, Options::default()),
    ]
}

/// Opens (creating) the log's database at `path`.
pub fn open(path: &Path) -> Result<Arc<DB>, OpenError> {
    DB::open_cf_descriptors(&options(), path, descriptors())
        .map(Arc::new)
        .map_err(|source| OpenError {
            path: path.display().to_string(),
            source,
        })
}

/// Opens an existing log read-only (`tokenlog verify --data-dir`): nothing is written, not
/// even a recovered WAL.
pub fn open_read_only(path: &Path) -> Result<DB, OpenError> {
    let mut opts = options();
    opts.create_if_missing(false);
    DB::open_cf_descriptors_read_only(&opts, path, descriptors(), false).map_err(|source| OpenError {
        path: path.display().to_string(),
        source,
    })
}
