//! Wire types of tokenlog. This crate depends on nothing of ours; every other crate converts
//! between these generated types and its own domain types at its boundary.
//!
//! - [`tokenlog`]: `tokenlog.v1`, the gateway's client-facing Generation service.
//! - [`raftlog`]: `raftlog.v1`, the client API of the replicated token-and-ownership log, served
//!   by every node.
//! - [`decoder`]: `decoder.v1`, decoder to decoder (a planned handoff's cache transfer) and a
//!   pipeline head to its stages (`Stage`).
//! - [`raft`]: `raft.v1`, node-to-node Raft transport (openraft messages as opaque bytes).
//! - [`etcd`]: the one etcd v3 call (`KV/Put`) that `tokenlog bench log` measures against.

/// `tokenlog.v1`: the gateway's Generation service.
pub mod tokenlog {
    tonic::include_proto!("tokenlog.v1");
}

/// `raftlog.v1`: the log's client API.
pub mod raftlog {
    tonic::include_proto!("raftlog.v1");
}

/// `decoder.v1`: decoder to decoder (a planned handoff's cache transfer), head to stage.
pub mod decoder {
    include!(concat!(env!("OUT_DIR"), "/decoder/decoder.v1.rs"));
}

/// `raft.v1`: the Raft transport between nodes.
pub mod raft {
    tonic::include_proto!("raft.v1");
}

/// `etcdserverpb.KV/Put` only, for the baseline in `tokenlog bench log`.
pub mod etcd {
    tonic::include_proto!("etcdserverpb");
}
