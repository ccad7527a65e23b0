//! tokenlog's replicated token-and-ownership log.
//!
//! Layout:
//! - [`types`], [`limits`], [`chain`]: domain types, named limits, the per-generation hash chain.
//! - [`state`]: the pure, deterministic state machine (`LogState::apply`), tested without I/O.
//! - [`raft_types`]: openraft's type configuration.
//! - [`db`], [`log_store`], [`sm_store`]: RocksDB storage of the Raft log and the state machine.
//! - [`transport`]: Raft messages between nodes over gRPC.
//! - [`service`], [`convert`], [`error`]: the `raftlog.v1` client API, wire conversions, and the
//!   one mapping of errors to `tonic::Status`.
//! - [`node`]: a running node (storage + Raft + services + leader tick).
//! - [`client`]: the Rust client that finds the leader and retries idempotent commands.
pub mod chain;
pub mod client;
pub mod convert;
pub mod db;
pub mod error;
pub mod faults;
pub mod limits;
pub mod log_store;
pub mod metrics;
pub mod node;
pub mod raft_types;
pub mod service;
pub mod sm_store;
pub mod state;
pub mod transport;
pub mod types;
