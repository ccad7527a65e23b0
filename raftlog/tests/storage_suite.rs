//! openraft's storage conformance suite against our RocksDB log store and the snapshot-based
//! state machine.

use openraft::testing::log::{StoreBuilder, Suite};
use openraft::StorageError;
use tempfile::TempDir;
use tokenlog_raftlog::log_store::LogStore;
use tokenlog_raftlog::raft_types::TypeConfig;
use tokenlog_raftlog::sm_store::SmStore;

struct RocksBuilder;

impl StoreBuilder<TypeConfig, LogStore, SmStore, TempDir> for RocksBuilder {
    async fn build(&self) -> Result<(TempDir, LogStore, SmStore), StorageError<TypeConfig>> {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = tokenlog_raftlog::data_dir::open(dir.path(), Default::default()).expect("open data dir");
        Ok((dir, s.log, s.sm))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openraft_storage_suite() {
    Suite::test_all(RocksBuilder).await.expect("storage suite");
}
