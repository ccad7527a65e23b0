//! tokenlog's replicated token-and-ownership log.
//!
//! Layout:
//! - [`types`], [`limits`], [`chain`]: domain types, named limits, the per-generation hash chain.
//! - [`state`]: the pure, deterministic state machine (`LogState::apply`), tested without I/O.
//! - [`raft_types`]: openraft's type configuration.
//! - [`data_dir`]: a node's data dir, its integrity checks at start and `verify`.
//! - [`db`], [`log_store`]: the Raft log in RocksDB, checksummed entries.
//! - [`sm_store`], [`snapshot`]: the in-memory state machine, durable through snapshot files.
//! - [`transport`]: Raft messages between nodes over gRPC.
//! - [`service`], [`convert`], [`error`]: the `raftlog.v1` client API, wire conversions, and the
//!   one mapping of errors to `tonic::Status`.
//! - [`node`]: a running node (storage + Raft + services + leader tick).
//! - [`client`]: the Rust client that finds the leader and retries idempotent commands.
//! - [`tls`], [`auth`]: TLS material and roles from certificates; who may call which method.
pub mod auth;
pub mod chain;
pub mod client;
pub mod clock;
pub mod convert;
pub mod data_dir;
pub mod db;
pub mod error;
pub mod faults;
pub mod health;
pub mod limits;
pub mod log_store;
pub mod metrics;
pub mod node;
pub mod raft_types;
pub mod service;
pub mod sm_store;
pub mod snapshot;
pub mod state;
pub mod tls;
pub mod transport;
pub mod types;
