//! The linearizability checker: P-compositional Wing–Gong–Lowe search with memoization.
//!
//! [`check`] splits the history into the model's independent partitions (P-compositionality:
//! a history is linearizable iff each partition is), checks the smallest partitions first, and
//! stops at the first one that is not linearizable, which is then the smallest failing
//! sub-history. A time budget bounds the whole check; past it the answer is
//! [`CheckResult::Unknown`].

mod bitset;
mod entries;
mod report;
mod search;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::history::Operation;
use crate::model::Model;
use search::{Failure, Outcome};

/// The budget the CLI uses when none is given.
pub const DEFAULT_BUDGET: Duration = Duration::from_secs(10);

/// The verdict on a history.
#[derive(Debug, Clone)]
pub enum CheckResult<I, O, S> {
    Linearizable,
    NotLinearizable(Box<Violation<I, O, S>>),
    /// The budget ran out before a verdict.
    Unknown,
}

/// The verdict for model `M`.
pub type ModelResult<M> = CheckResult<<M as Model>::Input, <M as Model>::Output, <M as Model>::State>;

impl<I, O, S> CheckResult<I, O, S> {
    /// `linearizable`, `not-linearizable` or `unknown`.
    pub fn verdict(&self) -> &'static str {
        match self {
            CheckResult::Linearizable => "linearizable",
            CheckResult::NotLinearizable(_) => "not-linearizable",
            CheckResult::Unknown => "unknown",
        }
    }
}

/// The smallest non-linearizable partition, and where the deepest search attempt got stuck.
#[derive(Debug, Clone)]
pub struct Violation<I, O, S> {
    /// The failing partition's key (empty for an unpartitioned model).
    pub partition: String,
    /// Number of operations in the failing partition.
    pub partition_size: usize,
    /// The longest linearizable prefix found, each operation with the state after it.
    pub linearized: Vec<(Operation<I, O>, S)>,
    /// The operation that could not be linearized after that prefix.
    pub stuck: Option<Operation<I, O>>,
    /// Operations open at that point (invoked before `stuck` returned, not in the prefix); the
    /// search tried each of them next and none led to a full linearization.
    pub candidates: Vec<Operation<I, O>>,
    /// The state after the prefix.
    pub state: S,
}

/// Checks `history` against `model` within `budget`.
pub fn check<M: Model>(model: &M, history: &[Operation<M::Input, M::Output>], budget: Duration) -> ModelResult<M> {
    let deadline = Instant::now() + budget;
    let mut out_of_time = false;
    for (key, ops) in partitions(model, history) {
        match search::search(model, &ops, deadline) {
            Outcome::Linearizable => {}
            Outcome::OutOfTime => out_of_time = true,
            Outcome::NotLinearizable(f) => {
                return CheckResult::NotLinearizable(Box::new(violation(key, &ops, f)));
            }
        }
    }
    if out_of_time {
        CheckResult::Unknown
    } else {
        CheckResult::Linearizable
    }
}

type Partition<'a, I, O> = (String, Vec<&'a Operation<I, O>>);

/// The history split by partition key, smallest partitions first.
fn partitions<'a, M: Model>(
    model: &M,
    history: &'a [Operation<M::Input, M::Output>],
) -> Vec<Partition<'a, M::Input, M::Output>> {
    let mut by_key: BTreeMap<String, Vec<_>> = BTreeMap::new();
    for op in history {
        by_key.entry(model.partition(&op.input)).or_default().push(op);
    }
    let mut parts: Vec<_> = by_key.into_iter().collect();
    parts.sort_by_key(|(_, ops)| ops.len());
    parts
}

fn violation<I: Clone, O: Clone, S>(partition: String, ops: &[&Operation<I, O>], f: Failure<S>) -> Violation<I, O, S> {
    let op = |i: usize| ops[i].clone();
    Violation {
        partition,
        partition_size: ops.len(),
        linearized: f.linearized.into_iter().map(|(i, s)| (op(i), s)).collect(),
        stuck: f.stuck.map(op),
        candidates: f.candidates.into_iter().map(op).collect(),
        state: f.state,
    }
}
