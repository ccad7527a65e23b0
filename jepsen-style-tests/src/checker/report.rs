//! Human-readable rendering of a [`Violation`].

use std::fmt::Write;

use super::Violation;
use crate::history::Operation;
use crate::model::Model;

/// At most this many operations of the linearizable prefix are printed (the last ones).
pub const MAX_PREFIX_SHOWN: usize = 20;

impl<I, O, S> Violation<I, O, S> {
    /// A multi-line report naming the failing partition, the tail of the longest linearizable
    /// prefix, the operation that could not be linearized, and the other open operations.
    pub fn render<M: Model<Input = I, Output = O, State = S>>(&self, model: &M) -> String {
        let mut out = String::new();
        let name = if self.partition.is_empty() {
            "the history".to_string()
        } else {
            format!("partition {:?}", self.partition)
        };
        let _ = writeln!(out, "{name} ({} operations) is not linearizable", self.partition_size);
        self.render_prefix(model, &mut out);
        let state = model.describe_state(&self.state);
        match &self.stuck {
            Some(op) => {
                let _ = writeln!(out, "could not linearize next, in state {state}:");
                let _ = writeln!(out, "    {}", describe(model, op));
            }
            None => {
                let _ = writeln!(out, "stuck in state {state}");
            }
        }
        if !self.candidates.is_empty() {
            let _ = writeln!(out, "other operations open at that point (each tried, none led on):");
            for op in &self.candidates {
                let _ = writeln!(out, "    {}", describe(model, op));
            }
        }
        out
    }

    fn render_prefix<M: Model<Input = I, Output = O, State = S>>(&self, model: &M, out: &mut String) {
        let n = self.linearized.len();
        let _ = writeln!(out, "longest linearizable prefix found: {n} operations");
        let skip = n.saturating_sub(MAX_PREFIX_SHOWN);
        if skip > 0 {
            let _ = writeln!(out, "    ... {skip} earlier operations not shown");
        }
        for (i, (op, state)) in self.linearized.iter().enumerate().skip(skip) {
            let after = model.describe_state(state);
            let _ = writeln!(out, "{:>5}. {}  => {after}", i + 1, describe(model, op));
        }
    }
}

/// `[client 3, t 10..14] write(3)`; an indeterminate operation's return time is `inf`.
/// (For parsed history files, times are line numbers.)
fn describe<M: Model>(model: &M, op: &Operation<M::Input, M::Output>) -> String {
    let ret = op.return_time().map_or("inf".to_string(), |t| t.to_string());
    let what = model.describe_op(&op.input, op.output());
    format!("[client {}, t {}..{}] {what}", op.client_id, op.call_time, ret)
}
