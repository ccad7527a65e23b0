//! Opening a node's RocksDB: one database, column families for the Raft log (`logs`, `meta`)
//! and the state machine (`sm`).

use std::path::Path;
use std::sync::Arc;

use rocksdb::{ColumnFamilyDescriptor, Options, DB};

use crate::faults::Faults;
use crate::log_store::{CF_LOGS, CF_META};
use crate::sm_store::CF_SM;

#[derive(Debug, thiserror::Error)]
#[error("cannot open the data dir {path}: {source}")]
pub struct OpenError {
    pub path: String,
    #[source]
    pub source: rocksdb::Error,
}

pub fn open(path: &Path, faults: Faults) -> Result<Arc<DB>, OpenError> {
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    opts.set_keep_log_file_num(4);
    if faults.ack_before_fsync() {
        // The planted ack-before-fsync bug (test only) also keeps written WAL data in this
        // process until a flush, so that kill -9 loses acknowledged entries the way a power cut
        // loses unsynced ones. The fault suite must catch it.
        opts.set_manual_wal_flush(true);
    }
    // The state machine's rows are written on every apply (one per committed token) and read
    // only at start-up and for snapshots: a vector memtable makes each insert O(1), where the
    // default skiplist spent a fifth of a node's CPU re-walking its levels under `bench log`.
    // Vector memtables take no concurrent writers.
    opts.set_allow_concurrent_memtable_write(false);
    let mut sm = Options::default();
    sm.set_memtable_factory(rocksdb::MemtableFactory::Vector);
    let cfs = [
        ColumnFamilyDescriptor::new(CF_LOGS, Options::default()),
        ColumnFamilyDescriptor::new(CF_META, Options::default()),
        ColumnFamilyDescriptor::new(CF_SM, sm),
    ];
    DB::open_cf_descriptors(&opts, path, cfs)
        .map(Arc::new)
        .map_err(|source| OpenError {
            path: path.display().to_string(),
            source,
        })
}
