//! Wing–Gong–Lowe search, with Lowe's memoization, over one partition of a history.
//!
//! The search walks the entry list from the head. At a call entry it tries to linearize that
//! operation next: if the model accepts it and the pair (set of linearized operations, new
//! state) has not been seen before, the operation is lifted out of the list, pushed on the
//! stack, and the walk restarts from the head. Reaching a return entry means its operation
//! should have been linearized already: backtrack (pop, unlift, continue after that call).
//!
//! Indeterminate operations return at +infinity, so their return entries sit after every
//! determinate one and never force a backtrack; the search succeeds as soon as every
//! determinate operation is linearized, which leaves the remaining indeterminate ones out
//! (they never happened). An indeterminate operation is thus linearized anywhere after its
//! invocation, or not at all.
//!
//! Two refinements keep histories with many timed-out operations tractable, without changing
//! the verdict:
//! - an indeterminate operation is never linearized where it would not change the state (that
//!   is dominated by leaving it open, to be linearized later or never);
//! - indeterminate operations with equal inputs are interchangeable once invoked, so they are
//!   linearized in invocation order only (an operation waits for its earlier "twin").

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::bitset::{Bitset, FxBuildHasher};
use super::entries::{Entries, HEAD, NIL};
use crate::history::Operation;
use crate::model::Model;

/// How many search steps run between two looks at the clock.
const BUDGET_CHECK_INTERVAL: u64 = 1024;

/// The deepest dead end the search met: where the best attempt got stuck.
pub struct Failure<S> {
    /// Linearized operations (partition indices) in order, each with the state after it.
    pub linearized: Vec<(usize, S)>,
    /// The operation whose return was reached before it could be linearized.
    pub stuck: Option<usize>,
    /// The other operations still open (invoked, not linearized) before that return.
    pub candidates: Vec<usize>,
    /// The state after `linearized`.
    pub state: S,
}

pub enum Outcome<S> {
    Linearizable,
    NotLinearizable(Failure<S>),
    OutOfTime,
}

struct Search<'a, M: Model> {
    model: &'a M,
    ops: &'a [&'a Operation<M::Input, M::Output>],
    entries: Entries,
    linearized: Bitset,
    cache: HashSet<(Bitset, M::State), FxBuildHasher>,
    /// Linearized call entries, each with the state before it.
    stack: Vec<(usize, M::State)>,
    state: M::State,
    /// Determinate operations not linearized yet.
    open_determinate: usize,
    /// For an indeterminate operation, the previous indeterminate one with an equal input.
    prev_twin: Vec<usize>,
    best: Option<Failure<M::State>>,
}

/// Checks one partition's operations, giving up at `deadline`.
pub fn search<M: Model>(model: &M, ops: &[&Operation<M::Input, M::Output>], deadline: Instant) -> Outcome<M::State> {
    let mut s = Search {
        model,
        ops,
        entries: Entries::new(ops),
        linearized: Bitset::new(ops.len()),
        cache: HashSet::default(),
        stack: Vec::with_capacity(ops.len()),
        state: model.init(),
        open_determinate: ops.iter().filter(|op| !op.is_indeterminate()).count(),
        prev_twin: prev_twins(ops),
        best: None,
    };
    s.run(deadline)
}

impl<M: Model> Search<'_, M> {
    fn run(&mut self, deadline: Instant) -> Outcome<M::State> {
        let mut node = self.entries.next(HEAD);
        let mut until_clock_check: u64 = 0;
        while self.open_determinate > 0 {
            if until_clock_check == 0 {
                if Instant::now() >= deadline {
                    return Outcome::OutOfTime;
                }
                until_clock_check = BUDGET_CHECK_INTERVAL;
            }
            until_clock_check -= 1;
            if node != NIL && self.entries.is_call(node) {
                node = self.try_linearize(node);
                continue;
            }
            self.note_failure(node);
            match self.backtrack() {
                Some(next) => node = next,
                None => return Outcome::NotLinearizable(self.best.take().expect("noted")),
            }
        }
        Outcome::Linearizable
    }

    /// Tries to linearize call `node` next; returns the node to visit after.
    fn try_linearize(&mut self, node: usize) -> usize {
        let id = self.entries.op(node);
        let op = self.ops[id];
        if op.is_indeterminate() && self.twin_open(id) {
            return self.entries.next(node);
        }
        let Some(next_state) = self.model.step(&self.state, &op.input, op.output()) else {
            return self.entries.next(node);
        };
        if op.is_indeterminate() && next_state == self.state {
            return self.entries.next(node);
        }
        self.linearized.set(id);
        if !self.cache.insert((self.linearized.clone(), next_state.clone())) {
            self.linearized.clear(id);
            return self.entries.next(node);
        }
        let before = std::mem::replace(&mut self.state, next_state);
        self.stack.push((node, before));
        self.entries.lift(node);
        if !op.is_indeterminate() {
            self.open_determinate -= 1;
        }
        self.entries.next(HEAD)
    }

    /// Whether an earlier indeterminate operation with the same input is not linearized yet.
    fn twin_open(&self, id: usize) -> bool {
        let twin = self.prev_twin[id];
        twin != NIL && !self.linearized.get(twin)
    }

    /// Undoes the last linearization; returns the node after it, or `None` if nothing is left.
    fn backtrack(&mut self) -> Option<usize> {
        let (node, before) = self.stack.pop()?;
        let id = self.entries.op(node);
        self.state = before;
        self.linearized.clear(id);
        self.entries.unlift(node);
        if !self.ops[id].is_indeterminate() {
            self.open_determinate += 1;
        }
        Some(self.entries.next(node))
    }

    /// Records the dead end at return `node` if it is the deepest so far.
    fn note_failure(&mut self, node: usize) {
        if self
            .best
            .as_ref()
            .is_some_and(|b| b.linearized.len() >= self.stack.len())
        {
            return;
        }
        let states_after = self.stack.iter().skip(1).map(|(_, s)| s).chain([&self.state]);
        let linearized = self
            .stack
            .iter()
            .zip(states_after)
            .map(|((n, _), s)| (self.entries.op(*n), s.clone()));
        let stuck = (node != NIL).then(|| self.entries.op(node));
        let mut candidates = Vec::new();
        let mut n = self.entries.next(HEAD);
        while n != node && n != NIL {
            if Some(self.entries.op(n)) != stuck {
                candidates.push(self.entries.op(n));
            }
            n = self.entries.next(n);
        }
        self.best = Some(Failure {
            linearized: linearized.collect(),
            stuck,
            candidates,
            state: self.state.clone(),
        });
    }
}

/// For each indeterminate operation, the previous indeterminate operation (by invocation time,
/// then index) with an equal input; `NIL` for none and for determinate operations.
fn prev_twins<I: Eq + std::hash::Hash, O>(ops: &[&Operation<I, O>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..ops.len()).filter(|&i| ops[i].is_indeterminate()).collect();
    order.sort_by_key(|&i| (ops[i].call_time, i));
    let mut last: HashMap<&I, usize> = HashMap::new();
    let mut twins = vec![NIL; ops.len()];
    for i in order {
        if let Some(prev) = last.insert(&ops[i].input, i) {
            twins[i] = prev;
        }
    }
    twins
}
