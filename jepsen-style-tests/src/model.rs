//! The sequential specification a history is checked against.

use std::fmt::Debug;
use std::hash::Hash;

/// A deterministic sequential model of the system under test.
///
/// `step` gets the output as `None` for an indeterminate operation: the unknown output matches
/// anything, and `step` must return the state after the operation took effect (an outcome that
/// leaves the state unchanged, such as a rejection, is covered by the checker's freedom to leave
/// indeterminate operations out).
pub trait Model {
    type State: Clone + Eq + Hash + Debug;
    /// Equality matters to the checker: indeterminate operations with equal inputs are
    /// interchangeable.
    type Input: Clone + Debug + Eq + Hash;
    type Output: Clone + Debug;

    /// The state before any operation.
    fn init(&self) -> Self::State;

    /// The state after `input` returned `output` in `state`, or `None` if that is impossible.
    fn step(&self, state: &Self::State, input: &Self::Input, output: Option<&Self::Output>) -> Option<Self::State>;

    /// The independent partition (key, generation, ...) an operation touches. Operations in
    /// different partitions must not interact; the checker checks each partition on its own
    /// (P-compositionality), each from `init()`.
    fn partition(&self, _input: &Self::Input) -> String {
        String::new()
    }

    /// A human-readable rendering of an operation, for reports.
    fn describe_op(&self, input: &Self::Input, output: Option<&Self::Output>) -> String {
        match output {
            Some(out) => format!("{input:?} -> {out:?}"),
            None => format!("{input:?} -> ?"),
        }
    }

    /// A human-readable rendering of a state, for reports.
    fn describe_state(&self, state: &Self::State) -> String {
        format!("{state:?}")
    }
}
