//! A compare-and-set register (Jepsen's etcd test): read / write / cas, initially nil.

use crate::model::Model;
use crate::parse::{EventDecoder, RawEvent, Value};

/// The register model. State: `None` (nil) or the value.
#[derive(Debug, Clone, Copy, Default)]
pub struct CasRegister;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RegisterInput {
    Read,
    Write(i64),
    /// If the value is `from`, set it to `to`.
    Cas {
        from: i64,
        to: i64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterOutput {
    /// What a read returned (`None`: nil).
    Read(Option<i64>),
    /// A write, or a cas that swapped.
    Ok,
    /// A cas whose compare failed: the value was not `from`.
    CasFailed,
}

impl Model for CasRegister {
    type State = Option<i64>;
    type Input = RegisterInput;
    type Output = RegisterOutput;

    fn init(&self) -> Option<i64> {
        None
    }

    fn step(&self, s: &Option<i64>, input: &RegisterInput, out: Option<&RegisterOutput>) -> Option<Option<i64>> {
        use RegisterOutput as O;
        match (input, out) {
            (RegisterInput::Read, None) => Some(*s),
            (RegisterInput::Read, Some(O::Read(v))) => (v == s).then_some(*s),
            (RegisterInput::Write(v), None | Some(O::Ok)) => Some(Some(*v)),
            (RegisterInput::Cas { from, to }, None) => Some(if *s == Some(*from) { Some(*to) } else { *s }),
            (RegisterInput::Cas { from, to }, Some(O::Ok)) => (*s == Some(*from)).then_some(Some(*to)),
            (RegisterInput::Cas { from, .. }, Some(O::CasFailed)) => (*s != Some(*from)).then_some(*s),
            _ => None,
        }
    }

    fn describe_op(&self, input: &RegisterInput, out: Option<&RegisterOutput>) -> String {
        let out = match out {
            None => "?".to_string(),
            Some(RegisterOutput::Read(v)) => self.describe_state(v),
            Some(RegisterOutput::Ok) => "ok".to_string(),
            Some(RegisterOutput::CasFailed) => "failed".to_string(),
        };
        match input {
            RegisterInput::Read => format!("read() -> {out}"),
            RegisterInput::Write(v) => format!("write({v}) -> {out}"),
            RegisterInput::Cas { from, to } => format!("cas({from}, {to}) -> {out}"),
        }
    }

    fn describe_state(&self, s: &Option<i64>) -> String {
        s.map_or("nil".to_string(), |v| v.to_string())
    }
}

/// Decodes Jepsen `:read` / `:write` / `:cas` events.
///
/// Following Jepsen (Knossos), every `:fail` operation, a failed cas included, did not happen
/// and is dropped. (Porcupine instead reads a `:fail` cas as an observation that the value was
/// not `from`, i.e. [`RegisterOutput::CasFailed`]; both give the same verdicts on the public
/// etcd histories.) A history that records a failed compare as a completed operation can use
/// `CasFailed` directly.
impl EventDecoder for CasRegister {
    type Input = RegisterInput;
    type Output = RegisterOutput;

    fn input(&self, ev: &RawEvent) -> Result<RegisterInput, String> {
        match ev.f.as_str() {
            "read" => Ok(RegisterInput::Read),
            "write" => ev.value.as_int().map(RegisterInput::Write).ok_or_else(|| bad(ev)),
            "cas" => {
                let (from, to) = ev.value.as_int_pair().ok_or_else(|| bad(ev))?;
                Ok(RegisterInput::Cas { from, to })
            }
            f => Err(format!("unknown register operation :{f}")),
        }
    }

    fn output(&self, ev: &RawEvent) -> Result<RegisterOutput, String> {
        match (ev.f.as_str(), &ev.value) {
            ("read", Value::Nil) => Ok(RegisterOutput::Read(None)),
            ("read", Value::Int(v)) => Ok(RegisterOutput::Read(Some(*v))),
            ("write" | "cas", _) => Ok(RegisterOutput::Ok),
            _ => Err(bad(ev)),
        }
    }
}

fn bad(ev: &RawEvent) -> String {
    format!("bad value {:?} for :{}", ev.value, ev.f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::{check, CheckResult};
    use crate::history::Operation;
    use std::time::Duration;
    use RegisterInput::*;
    use RegisterOutput as O;

    const BUDGET: Duration = Duration::from_secs(5);

    fn verdict(ops: &[Operation<RegisterInput, RegisterOutput>]) -> &'static str {
        check(&CasRegister, ops, BUDGET).verdict()
    }

    #[test]
    fn sequential_history() {
        let ops = vec![
            Operation::returned(0, Read, 0, O::Read(None), 1),
            Operation::returned(0, Write(1), 2, O::Ok, 3),
            Operation::returned(1, Cas { from: 1, to: 2 }, 4, O::Ok, 5),
            Operation::returned(1, Cas { from: 1, to: 3 }, 6, O::CasFailed, 7),
            Operation::returned(0, Read, 8, O::Read(Some(2)), 9),
        ];
        assert_eq!(verdict(&ops), "linearizable");
    }

    #[test]
    fn stale_read_is_not_linearizable() {
        let ops = vec![
            Operation::returned(0, Write(1), 0, O::Ok, 1),
            Operation::returned(0, Write(2), 2, O::Ok, 3),
            Operation::returned(1, Read, 4, O::Read(Some(1)), 5),
        ];
        match check(&CasRegister, &ops, BUDGET) {
            CheckResult::NotLinearizable(v) => {
                assert_eq!(v.linearized.len(), 2);
                assert_eq!(v.stuck.as_ref().map(|o| o.client_id), Some(1));
                let report = v.render(&CasRegister);
                assert!(report.contains("read() -> 1"), "{report}");
            }
            other => panic!("expected a violation, got {other:?}"),
        }
    }

    #[test]
    fn concurrent_ops_may_reorder() {
        let ops = vec![
            Operation::returned(0, Write(1), 0, O::Ok, 10),
            Operation::returned(1, Read, 1, O::Read(None), 2),
            Operation::returned(2, Read, 3, O::Read(Some(1)), 4),
            Operation::returned(3, Read, 5, O::Read(Some(1)), 6),
        ];
        assert_eq!(verdict(&ops), "linearizable");
    }

    #[test]
    fn indeterminate_write_that_must_have_happened() {
        let ops = vec![
            Operation::indeterminate(0, Write(1), 0),
            Operation::returned(1, Read, 5, O::Read(Some(1)), 6),
        ];
        assert_eq!(verdict(&ops), "linearizable");
        // Without the indeterminate write, the read of 1 is impossible.
        assert_eq!(verdict(&ops[1..]), "not-linearizable");
    }

    #[test]
    fn indeterminate_write_that_must_not_have_happened() {
        // The write(1) times out; later reads see nil, then write(2) and reads of 2 forever.
        let ops = vec![
            Operation::indeterminate(0, Write(1), 0),
            Operation::returned(1, Read, 2, O::Read(None), 3),
            Operation::returned(1, Write(2), 4, O::Ok, 5),
            Operation::returned(1, Read, 6, O::Read(Some(2)), 7),
            Operation::returned(2, Read, 8, O::Read(Some(2)), 9),
        ];
        assert_eq!(verdict(&ops), "linearizable");
    }

    #[test]
    fn indeterminate_write_cannot_take_effect_before_its_invocation() {
        let ops = vec![
            Operation::returned(1, Read, 0, O::Read(Some(1)), 1),
            Operation::indeterminate(0, Write(1), 2),
        ];
        assert_eq!(verdict(&ops), "not-linearizable");
    }

    #[test]
    fn indeterminate_write_takes_effect_once() {
        // 1, then 2, then 1 again would need the timed-out write(1) to happen twice.
        let ops = vec![
            Operation::indeterminate(0, Write(1), 0),
            Operation::returned(1, Read, 1, O::Read(Some(1)), 2),
            Operation::returned(1, Write(2), 3, O::Ok, 4),
            Operation::returned(1, Read, 5, O::Read(Some(2)), 6),
            Operation::returned(1, Read, 7, O::Read(Some(1)), 8),
        ];
        assert_eq!(verdict(&ops), "not-linearizable");
    }

    #[test]
    fn jepsen_log_fail_is_dropped_and_info_is_indeterminate() {
        let log = "INFO  jepsen.util - 0\t:invoke\t:write\t1\n\
                   INFO  jepsen.util - 0\t:info\t:write\t:timed-out\n\
                   INFO  jepsen.util - 1\t:invoke\t:cas\t[1 2]\n\
                   INFO  jepsen.util - 1\t:fail\t:cas\t[1 2]\n\
                   INFO  jepsen.util - 2\t:invoke\t:read\tnil\n\
                   INFO  jepsen.util - 2\t:ok\t:read\t1\n";
        let events = crate::parse::jepsen_log::parse(log).unwrap();
        let ops = crate::parse::operations(&CasRegister, &events).unwrap();
        assert_eq!(ops.len(), 2);
        assert!(ops[0].is_indeterminate());
        assert_eq!(ops[1], Operation::returned(2, Read, 5, O::Read(Some(1)), 6));
        assert_eq!(verdict(&ops), "linearizable");
    }

    #[test]
    fn budget_runs_out_on_a_hard_history() {
        // Many concurrent timed-out writes and a read of a value none of them wrote: proving it
        // impossible means trying every subset and order of the writes.
        let mut ops: Vec<_> = (0..40)
            .map(|i| Operation::indeterminate(i, Write(i as i64), i))
            .collect();
        ops.push(Operation::returned(100, Read, 50, O::Read(Some(-1)), 60));
        let start = std::time::Instant::now();
        let res = check(&CasRegister, &ops, Duration::from_millis(50));
        assert_eq!(res.verdict(), "unknown");
        assert!(start.elapsed() < Duration::from_secs(2), "took {:?}", start.elapsed());
    }
}
