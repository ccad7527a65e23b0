//! A key-value store with get / put / append; every key starts as the empty string and keys
//! are independent, so the history is partitioned per key.

use crate::model::Model;
use crate::parse::{EventDecoder, RawEvent, Value};

/// The key-value model. State: one key's value (the checker runs it per key).
#[derive(Debug, Clone, Copy, Default)]
pub struct Kv;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvInput {
    pub key: String,
    pub op: KvOp,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KvOp {
    Get,
    Put(String),
    Append(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvOutput {
    /// What a get returned.
    Value(String),
    /// A put or append completed.
    Ok,
}

impl Model for Kv {
    type State = String;
    type Input = KvInput;
    type Output = KvOutput;

    fn init(&self) -> String {
        String::new()
    }

    fn step(&self, s: &String, input: &KvInput, out: Option<&KvOutput>) -> Option<String> {
        match (&input.op, out) {
            (KvOp::Get, None) => Some(s.clone()),
            (KvOp::Get, Some(KvOutput::Value(v))) => (v == s).then(|| s.clone()),
            (KvOp::Put(v), None | Some(KvOutput::Ok)) => Some(v.clone()),
            (KvOp::Append(v), None | Some(KvOutput::Ok)) => Some(format!("{s}{v}")),
            _ => None,
        }
    }

    fn partition(&self, input: &KvInput) -> String {
        input.key.clone()
    }

    fn describe_op(&self, input: &KvInput, out: Option<&KvOutput>) -> String {
        let k = &input.key;
        match (&input.op, out) {
            (KvOp::Get, Some(KvOutput::Value(v))) => format!("get({k:?}) -> {v:?}"),
            (KvOp::Get, _) => format!("get({k:?}) -> ?"),
            (KvOp::Put(v), out) => format!("put({k:?}, {v:?}){}", unknown_suffix(out)),
            (KvOp::Append(v), out) => format!("append({k:?}, {v:?}){}", unknown_suffix(out)),
        }
    }

    fn describe_state(&self, s: &String) -> String {
        format!("{s:?}")
    }
}

fn unknown_suffix(out: Option<&KvOutput>) -> &'static str {
    if out.is_none() {
        " -> ?"
    } else {
        ""
    }
}

/// Decodes `:get` / `:put` / `:append` events with a string (or integer) `:key`.
impl EventDecoder for Kv {
    type Input = KvInput;
    type Output = KvOutput;

    fn input(&self, ev: &RawEvent) -> Result<KvInput, String> {
        let key = match &ev.key {
            Some(Value::Str(k)) => k.clone(),
            Some(Value::Int(k)) => k.to_string(),
            other => return Err(format!("bad :key {other:?}")),
        };
        let text = || ev.value.as_str().map(str::to_string).ok_or_else(|| bad(ev));
        let op = match ev.f.as_str() {
            "get" => KvOp::Get,
            "put" => KvOp::Put(text()?),
            "append" => KvOp::Append(text()?),
            f => return Err(format!("unknown key-value operation :{f}")),
        };
        Ok(KvInput { key, op })
    }

    fn output(&self, ev: &RawEvent) -> Result<KvOutput, String> {
        match (ev.f.as_str(), &ev.value) {
            ("get", Value::Nil) => Ok(KvOutput::Value(String::new())),
            ("get", Value::Str(v)) => Ok(KvOutput::Value(v.clone())),
            ("put" | "append", _) => Ok(KvOutput::Ok),
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

    const BUDGET: Duration = Duration::from_secs(5);

    fn op(key: &str, op: KvOp) -> KvInput {
        KvInput { key: key.into(), op }
    }

    fn get(v: &str) -> KvOutput {
        KvOutput::Value(v.into())
    }

    #[test]
    fn appends_and_gets_per_key() {
        let ops = vec![
            Operation::returned(0, op("a", KvOp::Append("x".into())), 0, KvOutput::Ok, 1),
            Operation::returned(1, op("b", KvOp::Put("p".into())), 0, KvOutput::Ok, 1),
            Operation::returned(0, op("a", KvOp::Append("y".into())), 2, KvOutput::Ok, 3),
            Operation::returned(1, op("a", KvOp::Get), 4, get("xy"), 5),
            Operation::returned(1, op("b", KvOp::Get), 6, get("p"), 7),
            Operation::returned(1, op("c", KvOp::Get), 8, get(""), 9),
        ];
        assert_eq!(check(&Kv, &ops, BUDGET).verdict(), "linearizable");
    }

    #[test]
    fn reports_the_failing_key() {
        let ops = vec![
            Operation::returned(0, op("a", KvOp::Append("x".into())), 0, KvOutput::Ok, 1),
            Operation::returned(1, op("b", KvOp::Append("y".into())), 0, KvOutput::Ok, 1),
            Operation::returned(1, op("b", KvOp::Get), 2, get("y"), 3),
            Operation::returned(0, op("a", KvOp::Get), 4, get(""), 5),
        ];
        match check(&Kv, &ops, BUDGET) {
            CheckResult::NotLinearizable(v) => assert_eq!(v.partition, "a"),
            other => panic!("expected a violation, got {other:?}"),
        }
    }

    #[test]
    fn indeterminate_append_seen_or_not() {
        let ops = vec![
            Operation::indeterminate(0, op("a", KvOp::Append("x".into())), 0),
            Operation::returned(1, op("a", KvOp::Get), 1, get(""), 2),
            Operation::returned(1, op("a", KvOp::Get), 3, get("x"), 4),
            Operation::returned(1, op("a", KvOp::Append("y".into())), 5, KvOutput::Ok, 6),
            Operation::returned(1, op("a", KvOp::Get), 7, get("xy"), 8),
        ];
        assert_eq!(check(&Kv, &ops, BUDGET).verdict(), "linearizable");
        let mut bad = ops.clone();
        bad[4] = Operation::returned(1, op("a", KvOp::Get), 7, get("y"), 8);
        assert_eq!(check(&Kv, &bad, BUDGET).verdict(), "not-linearizable");
    }
}
