//! The doubly-linked list of call/return entries the WGL search walks, lifting a call entry
//! and its return entry out when the operation is linearized and putting them back on backtrack.

use crate::history::Operation;

/// "No entry": the end of the list.
pub const NIL: usize = usize::MAX;
/// Node 0 is the list head, a sentinel before the first entry.
pub const HEAD: usize = 0;

/// Entry nodes `1..=2n`; each is the call or the return of one operation of the partition.
pub struct Entries {
    next: Vec<usize>,
    prev: Vec<usize>,
    /// Operation index (within the partition) of each node.
    op: Vec<usize>,
    /// For a call node, its return node; `NIL` for return nodes and the head.
    matching: Vec<usize>,
}

/// Sort key of an entry: time, calls before returns at equal times, then operation index.
/// Indeterminate operations return at +infinity.
fn sort_key<I, O>(ops: &[&Operation<I, O>], op: usize, is_call: bool) -> (u64, bool, usize) {
    let call = ops[op].call_time;
    let time = if is_call {
        call
    } else {
        ops[op].return_time().map_or(u64::MAX, |r| r.max(call))
    };
    (time, !is_call, op)
}

impl Entries {
    pub fn new<I, O>(ops: &[&Operation<I, O>]) -> Self {
        let mut order: Vec<(usize, bool)> = (0..ops.len()).flat_map(|i| [(i, true), (i, false)]).collect();
        order.sort_by_key(|&(op, is_call)| sort_key(ops, op, is_call));
        let nodes = order.len() + 1;
        let mut e = Entries {
            next: (1..=nodes).map(|n| if n == nodes { NIL } else { n }).collect(),
            prev: (0..nodes).map(|n| n.wrapping_sub(1)).collect(),
            op: vec![NIL; nodes],
            matching: vec![NIL; nodes],
        };
        let mut call_node = vec![NIL; ops.len()];
        for (i, &(op, is_call)) in order.iter().enumerate() {
            let node = i + 1;
            e.op[node] = op;
            if is_call {
                call_node[op] = node;
            } else {
                e.matching[call_node[op]] = node;
            }
        }
        e.prev[HEAD] = NIL;
        e
    }

    pub fn next(&self, node: usize) -> usize {
        self.next[node]
    }

    pub fn op(&self, node: usize) -> usize {
        self.op[node]
    }

    pub fn is_call(&self, node: usize) -> bool {
        self.matching[node] != NIL
    }

    /// Removes call `node` and its return from the list.
    pub fn lift(&mut self, node: usize) {
        self.unlink(node);
        self.unlink(self.matching[node]);
    }

    /// Undoes `lift(node)`; lifts must be undone in reverse order.
    pub fn unlift(&mut self, node: usize) {
        self.relink(self.matching[node]);
        self.relink(node);
    }

    fn unlink(&mut self, node: usize) {
        let (p, n) = (self.prev[node], self.next[node]);
        self.next[p] = n;
        if n != NIL {
            self.prev[n] = p;
        }
    }

    fn relink(&mut self, node: usize) {
        let (p, n) = (self.prev[node], self.next[node]);
        self.next[p] = node;
        if n != NIL {
            self.prev[n] = node;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walk(e: &Entries) -> Vec<(usize, bool)> {
        let mut out = vec![];
        let mut n = e.next(HEAD);
        while n != NIL {
            out.push((e.op(n), e.is_call(n)));
            n = e.next(n);
        }
        out
    }

    #[test]
    fn orders_by_time_with_indeterminate_returns_last() {
        let a = Operation::returned(0, (), 0, (), 10);
        let b = Operation::<(), ()>::indeterminate(1, (), 5);
        let c = Operation::returned(2, (), 10, (), 12);
        let ops = vec![&a, &b, &c];
        let mut e = Entries::new(&ops);
        let expect = vec![(0, true), (1, true), (2, true), (0, false), (2, false), (1, false)];
        assert_eq!(walk(&e), expect);
        let b_call = e.next(e.next(HEAD));
        e.lift(b_call);
        assert_eq!(walk(&e), vec![(0, true), (2, true), (0, false), (2, false)]);
        e.unlift(b_call);
        assert_eq!(walk(&e), expect);
    }
}
