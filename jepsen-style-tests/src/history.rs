//! Histories: client operations with an invocation time and, when known, a completion.
//!
//! An [`Operation`] is model-agnostic: `I` and `O` are the model's input and output types. Times
//! are opaque, monotonically increasing numbers (line numbers for parsed logs, nanoseconds for
//! a live harness); only their order matters. [`HistoryBuilder`] turns a stream of
//! invoke/ok/fail/info events (Jepsen's four event types, also what a JSONL record carries)
//! into operations.

use std::collections::HashMap;

/// A history: operations in invocation order.
pub type History<I, O> = Vec<Operation<I, O>>;

/// Identifies the client (Jepsen "process") that issued an operation.
pub type ClientId = u64;

/// What is known about how an operation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion<O> {
    /// The operation took effect and returned `output` at `return_time`.
    Returned { output: O, return_time: u64 },
    /// Unknown whether it took effect (`:info`, a timeout, a crashed client): it may have taken
    /// effect at any point after its invocation, or never, and its output is unknown.
    Indeterminate,
}

/// One client operation of a history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation<I, O> {
    pub client_id: ClientId,
    pub input: I,
    pub call_time: u64,
    pub completion: Completion<O>,
}

impl<I, O> Operation<I, O> {
    /// An operation that returned `output`.
    pub fn returned(client_id: ClientId, input: I, call: u64, output: O, ret: u64) -> Self {
        let completion = Completion::Returned {
            output,
            return_time: ret,
        };
        Operation {
            client_id,
            input,
            call_time: call,
            completion,
        }
    }

    /// An operation whose effect and output are unknown.
    pub fn indeterminate(client_id: ClientId, input: I, call_time: u64) -> Self {
        Operation {
            client_id,
            input,
            call_time,
            completion: Completion::Indeterminate,
        }
    }

    /// The output, `None` when indeterminate.
    pub fn output(&self) -> Option<&O> {
        match &self.completion {
            Completion::Returned { output, .. } => Some(output),
            Completion::Indeterminate => None,
        }
    }

    /// The return time, `None` (i.e. +infinity) when indeterminate.
    pub fn return_time(&self) -> Option<u64> {
        match &self.completion {
            Completion::Returned { return_time, .. } => Some(*return_time),
            Completion::Indeterminate => None,
        }
    }

    pub fn is_indeterminate(&self) -> bool {
        matches!(self.completion, Completion::Indeterminate)
    }
}

/// Jepsen's event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    Invoke,
    Ok,
    Fail,
    Info,
}

impl EventKind {
    /// Parses `invoke`, `ok`, `fail` or `info` (with or without the leading `:`).
    pub fn parse(s: &str) -> Option<EventKind> {
        match s.trim_start_matches(':') {
            "invoke" => Some(EventKind::Invoke),
            "ok" => Some(EventKind::Ok),
            "fail" => Some(EventKind::Fail),
            "info" => Some(EventKind::Info),
            _ => None,
        }
    }
}

/// How a completion event resolves the pending operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution<O> {
    /// It took effect and returned this output.
    Returned(O),
    /// It certainly did not take effect: the operation is dropped from the history.
    DidNotHappen,
    /// Unknown whether it took effect.
    Indeterminate,
}

/// Errors building a history from events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HistoryError {
    #[error("event {event}: client {client} completes an operation but has none pending")]
    NoPendingOperation { client: ClientId, event: usize },
    #[error("event {event}: client {client} invokes while its previous operation is pending")]
    AlreadyPending { client: ClientId, event: usize },
    #[error("event {event}: time {time} is before the operation's invocation at {call_time}")]
    TimeWentBackwards { event: usize, time: u64, call_time: u64 },
}

struct Pending<I> {
    input: I,
    call_time: u64,
    /// Index in `ops` reserved for it, so operations stay in invocation order.
    slot: usize,
}

/// Builds operations from invoke/completion events, in the order they happened.
pub struct HistoryBuilder<I, O> {
    pending: HashMap<ClientId, Pending<I>>,
    ops: Vec<Option<Operation<I, O>>>,
    events: usize,
}

impl<I, O> Default for HistoryBuilder<I, O> {
    fn default() -> Self {
        HistoryBuilder {
            pending: HashMap::new(),
            ops: Vec::new(),
            events: 0,
        }
    }
}

impl<I, O> HistoryBuilder<I, O> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Client `client` invokes `input` at `time`.
    pub fn invoke(&mut self, client: ClientId, input: I, time: u64) -> Result<(), HistoryError> {
        let event = self.next_event();
        if self.pending.contains_key(&client) {
            return Err(HistoryError::AlreadyPending { client, event });
        }
        let slot = self.ops.len();
        self.ops.push(None);
        self.pending.insert(
            client,
            Pending {
                input,
                call_time: time,
                slot,
            },
        );
        Ok(())
    }

    /// Client `client`'s pending operation completes at `time` as `resolution` says.
    pub fn complete(&mut self, client: ClientId, resolution: Resolution<O>, time: u64) -> Result<(), HistoryError> {
        let event = self.next_event();
        let p = self
            .pending
            .remove(&client)
            .ok_or(HistoryError::NoPendingOperation { client, event })?;
        if time < p.call_time {
            return Err(HistoryError::TimeWentBackwards {
                event,
                time,
                call_time: p.call_time,
            });
        }
        self.ops[p.slot] = match resolution {
            Resolution::Returned(out) => Some(Operation::returned(client, p.input, p.call_time, out, time)),
            Resolution::DidNotHappen => None,
            Resolution::Indeterminate => Some(Operation::indeterminate(client, p.input, p.call_time)),
        };
        Ok(())
    }

    /// The operations, in invocation order; those still pending are indeterminate.
    pub fn finish(mut self) -> Vec<Operation<I, O>> {
        for (client, p) in self.pending.drain() {
            self.ops[p.slot] = Some(Operation::indeterminate(client, p.input, p.call_time));
        }
        self.ops.into_iter().flatten().collect()
    }

    fn next_event(&mut self) -> usize {
        self.events += 1;
        self.events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_matches_completions_and_drops_failures() {
        let mut b = HistoryBuilder::<&str, u8>::new();
        b.invoke(1, "a", 0).unwrap();
        b.invoke(2, "b", 1).unwrap();
        b.invoke(3, "c", 2).unwrap();
        b.complete(2, Resolution::DidNotHappen, 3).unwrap();
        b.complete(1, Resolution::Returned(7), 4).unwrap();
        b.invoke(4, "d", 5).unwrap();
        b.complete(4, Resolution::Indeterminate, 6).unwrap();
        let ops = b.finish();
        assert_eq!(ops.len(), 3);
        assert_eq!(ops[0], Operation::returned(1, "a", 0, 7, 4));
        assert_eq!(ops[1], Operation::indeterminate(3, "c", 2));
        assert_eq!(ops[2], Operation::indeterminate(4, "d", 5));
    }

    #[test]
    fn builder_rejects_unmatched_events() {
        let mut b = HistoryBuilder::<(), ()>::new();
        assert!(b.complete(1, Resolution::Returned(()), 0).is_err());
        b.invoke(1, (), 1).unwrap();
        assert!(b.invoke(1, (), 2).is_err());
    }
}
