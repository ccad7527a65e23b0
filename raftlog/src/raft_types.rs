//! openraft type configuration: what a Raft entry carries and what applying it answers.

use crate::types::{Request, Response};

openraft::declare_raft_types!(
    /// tokenlog's Raft types: entries carry a stamped [`Request`], applying one answers a [`Response`].
    pub TypeConfig:
        D = Request,
        R = Response,
        Node = openraft::BasicNode,
);

pub type NodeId = u64;
pub type Node = openraft::BasicNode;
pub type Entry = openraft::alias::EntryOf<TypeConfig>;
pub type LogId = openraft::alias::LogIdOf<TypeConfig>;
pub type Vote = openraft::alias::VoteOf<TypeConfig>;
pub type StoredMembership = openraft::alias::StoredMembershipOf<TypeConfig>;
pub type SnapshotMeta = openraft::alias::SnapshotMetaOf<TypeConfig>;
/// Snapshots are files (see `snapshot`), streamed to followers in chunks.
pub type SnapshotData = crate::snapshot::SnapshotFile;
pub type Snapshot = openraft::alias::SnapshotOf<TypeConfig, SnapshotData>;
pub type Raft = openraft::Raft<TypeConfig, crate::sm_store::SmStore>;
