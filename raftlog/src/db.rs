//! Opening the Raft log's RocksDB (`<data dir>/log`): column families `logs` and `meta`.
//!
//! RocksDB runs with `AbsoluteConsistency` WAL recovery and paranoid checks: a corrupted WAL
//! record or table makes the open fail with RocksDB's own message, where the default recovery
//! mode would silently drop every fsynced record after it.

use std::path::Path;
use std::sync::Arc;

use rocksdb::{ColumnFamilyDescriptor, DBRecoveryMode, Options, DB};

use crate::faults::Faults;
use crate::log_store::{CF_LOGS, CF_META};

#[derive(Debug, thiserror::Error)]
#[error("cannot open the Raft log in {path}: {source}")]
pub struct OpenError {
    pub path: String,
    #[source]
    pub source: rocksdb::Error,
}

fn options(faults: Faults) -> Options {
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    opts.set_keep_log_file_num(4);
    opts.set_wal_recovery_mode(DBRecoveryMode::AbsoluteConsistency);
    opts.set_paranoid_checks(true);
    if faults.ack_before_fsync() {
        // The planted ack-before-fsync bug (test only) also keeps written WAL data in this
        // process until a flush, so that kill -9 loses acknowledged entries the way a power cut
        // loses unsynced ones. The fault suite must catch it.
        opts.set_manual_wal_flush(true);
    }
    opts
}

fn descriptors() -> [ColumnFamilyDescriptor; 2] {
    [
        ColumnFamilyDescriptor::new(CF_LOGS, Options::default()),
        ColumnFamilyDescriptor::new(CF_META, Options::default()),
    ]
}

/// Opens (creating) the log's database at `path`.
pub fn open(path: &Path, faults: Faults) -> Result<Arc<DB>, OpenError> {
    DB::open_cf_descriptors(&options(faults), path, descriptors())
        .map(Arc::new)
        .map_err(|source| OpenError {
            path: path.display().to_string(),
            source,
        })
}

/// Opens an existing log read-only (`tokenlog verify --data-dir`): nothing is written, not
/// even a recovered WAL.
pub fn open_read_only(path: &Path) -> Result<DB, OpenError> {
    let mut opts = options(Faults::default());
    opts.create_if_missing(false);
    DB::open_cf_descriptors_read_only(&opts, path, descriptors(), false).map_err(|source| OpenError {
        path: path.display().to_string(),
        source,
    })
}
