//! tokenlog's Jepsen-style test tooling: histories, sequential models and a linearizability
//! checker.
//!
//! Layout:
//! - [`history`]: the model-agnostic [`history::Operation`] (client, input, output, call time,
//!   return time or indeterminate) and [`history::HistoryBuilder`], which pairs
//!   invoke/ok/fail/info events into operations (`:fail` dropped, `:info` indeterminate).
//! - [`model`]: the [`model::Model`] trait: a sequential specification (init, step, partition).
//! - [`checker`]: Wing–Gong–Lowe search with memoization on (linearized set, state), run per
//!   partition (P-compositionality), under a time budget; [`checker::check`] answers
//!   linearizable, not linearizable (with the smallest failing partition and where the search
//!   got stuck) or unknown.
//! - [`models`]: a compare-and-set register, a key-value store, and tokenlog's per-generation
//!   ownership/frontier model.
//! - [`parse`]: readers for Jepsen log lines and EDN event maps, and
//!   [`parse::EventDecoder`] to type their events for a model.
//!
//! - [`harness`]: the fault suite: a real cluster of `tokenlog` processes, a client workload,
//!   seeded nemeses, the checkers over the recorded history, and a report per run.
//! - [`sim`]: the deterministic simulation: the real state machine on every replica of a
//!   simulated replicated log, simulated decoders and clients, seeded faults on simulated time,
//!   the same checkers; thousands of seeds a minute, each replayable bit for bit.
//!
//! The `jepsen-style-tests` binary (`src/main.rs`) checks a recorded history from the command
//! line (`check-history`), runs the fault suite (`run`) and the simulation (`sim`); `tests/public_histories.rs`
//! validates the checker against histories with known verdicts, `tests/fault_suite.rs` runs
//! short seeded fault runs and a planted bug.

pub mod checker;
pub mod harness;
pub mod history;
pub mod model;
pub mod models;
pub mod parse;
pub mod sim;
pub mod sim_raft;
pub mod sim_rt;
pub mod sim_workers;

pub use checker::{check, CheckResult, Violation};
pub use history::{Completion, History, Operation};
pub use model::Model;
