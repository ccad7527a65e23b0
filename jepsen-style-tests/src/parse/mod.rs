//! Parsers for recorded histories, and their conversion into [`Operation`](crate::history::Operation)s.
//!
//! Each format parser produces [`RawEvent`]s (Jepsen's invoke/ok/fail/info events with an
//! untyped EDN-like [`Value`]); an [`EventDecoder`] (implemented by each model) types the
//! inputs and outputs, and [`operations`] pairs invocations with their completions.

pub mod edn;
pub mod jepsen_log;

use crate::history::{ClientId, EventKind, History, HistoryBuilder, HistoryError, Resolution};

/// An EDN value, as far as histories need one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i64),
    Str(String),
    /// A keyword, without its leading `:`.
    Keyword(String),
    Symbol(String),
    Vector(Vec<Value>),
    Map(Vec<(Value, Value)>),
}

impl Value {
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A two-element integer vector such as `[1 4]`.
    pub fn as_int_pair(&self) -> Option<(i64, i64)> {
        match self {
            Value::Vector(v) if v.len() == 2 => Some((v[0].as_int()?, v[1].as_int()?)),
            _ => None,
        }
    }
}

/// One client event of a recorded history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawEvent {
    /// 1-based line number in the source, for errors.
    pub line: usize,
    pub process: ClientId,
    pub kind: EventKind,
    /// The operation's function, without the `:` (`read`, `write`, `cas`, `append`, ...).
    pub f: String,
    pub key: Option<Value>,
    pub value: Value,
}

/// Errors reading a history.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("line {line}: {reason}")]
    Syntax { line: usize, reason: String },
    #[error("line {line}: {reason}")]
    Event { line: usize, reason: String },
    #[error("line {line}: {source}")]
    History { line: usize, source: HistoryError },
}

/// Types a model's inputs and outputs from raw events.
pub trait EventDecoder {
    type Input;
    type Output;

    /// The input of an `:invoke` event.
    fn input(&self, ev: &RawEvent) -> Result<Self::Input, String>;

    /// What an `:ok` event's value says the output was.
    fn output(&self, ev: &RawEvent) -> Result<Self::Output, String>;

    /// How a completion event resolves its operation. By default `:ok` returned
    /// [`EventDecoder::output`], `:fail` did not happen and `:info` is indeterminate.
    fn resolution(&self, ev: &RawEvent) -> Result<Resolution<Self::Output>, String> {
        match ev.kind {
            EventKind::Ok => self.output(ev).map(Resolution::Returned),
            EventKind::Fail => Ok(Resolution::DidNotHappen),
            _ => Ok(Resolution::Indeterminate),
        }
    }
}

/// Pairs invocations with completions. An event's time is its line number, so reports point
/// into the source file.
pub fn operations<D: EventDecoder>(
    decoder: &D,
    events: &[RawEvent],
) -> Result<History<D::Input, D::Output>, ParseError> {
    let mut b = HistoryBuilder::new();
    for ev in events {
        let time = ev.line as u64;
        let event_err = |reason| ParseError::Event { line: ev.line, reason };
        let done = match ev.kind {
            EventKind::Invoke => {
                let input = decoder.input(ev).map_err(event_err)?;
                b.invoke(ev.process, input, time)
            }
            _ => {
                let res = decoder.resolution(ev).map_err(event_err)?;
                b.complete(ev.process, res, time)
            }
        };
        done.map_err(|source| ParseError::History { line: ev.line, source })?;
    }
    Ok(b.finish())
}
