//! EDN histories, one event map per line:
//! `{:process 0, :type :invoke, :f :append, :key "0", :value "x 0 0 y"}`.
//!
//! Supports the EDN subset histories use: maps, vectors, lists, strings, integers, keywords,
//! symbols, `nil`, `true`, `false`. Blank lines and `;` comments are skipped, and so are events
//! whose `:process` is not an integer (the nemesis).

use super::{ParseError, RawEvent, Value};
use crate::history::EventKind;

/// Deepest nesting of collections accepted.
pub const MAX_NESTING: usize = 32;

/// Parses a whole EDN history.
pub fn parse(text: &str) -> Result<Vec<RawEvent>, ParseError> {
    let mut events = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with(';') {
            continue;
        }
        let syntax = |reason| ParseError::Syntax { line, reason };
        let value = parse_value(trimmed).map_err(syntax)?;
        if let Some(ev) = event_from_map(line, &value)? {
            events.push(ev);
        }
    }
    Ok(events)
}

/// Parses exactly one EDN value (surrounding whitespace allowed).
pub fn parse_value(s: &str) -> Result<Value, String> {
    let mut c = Cursor {
        s: s.as_bytes(),
        pos: 0,
    };
    let v = c.value(0)?;
    c.skip_ws();
    if c.pos != c.s.len() {
        return Err(format!("unexpected text after value at column {}", c.pos + 1));
    }
    Ok(v)
}

/// The event in an event map; `None` for a non-client (e.g. nemesis) event.
fn event_from_map(line: usize, v: &Value) -> Result<Option<RawEvent>, ParseError> {
    let err = |reason: String| ParseError::Event { line, reason };
    let Value::Map(entries) = v else {
        return Err(err("expected an event map".into()));
    };
    let get = |k: &str| {
        entries
            .iter()
            .find(|(key, _)| matches!(key, Value::Keyword(n) if n == k))
            .map(|e| &e.1)
    };
    let Some(Value::Int(process)) = get("process") else {
        return Ok(None);
    };
    let process = u64::try_from(*process).map_err(|_| err("negative :process".into()))?;
    let kind = match get("type") {
        Some(Value::Keyword(t)) => EventKind::parse(t),
        _ => None,
    };
    let kind = kind.ok_or_else(|| err(":type is not :invoke, :ok, :fail or :info".into()))?;
    let Some(Value::Keyword(f)) = get("f") else {
        return Err(err("missing :f keyword".into()));
    };
    let key = get("key").cloned();
    let value = get("value").cloned().unwrap_or(Value::Nil);
    Ok(Some(RawEvent {
        line,
        process,
        kind,
        f: f.clone(),
        key,
        value,
    }))
}

struct Cursor<'a> {
    s: &'a [u8],
    pos: usize,
}

fn is_symbol_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"._*+!-?$%&=<>/'#".contains(&b)
}

impl Cursor<'_> {
    fn skip_ws(&mut self) {
        while self.pos < self.s.len() && (self.s[self.pos].is_ascii_whitespace() || self.s[self.pos] == b',') {
            self.pos += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn value(&mut self, depth: usize) -> Result<Value, String> {
        if depth > MAX_NESTING {
            return Err(format!("nesting deeper than {MAX_NESTING}"));
        }
        self.skip_ws();
        let Some(b) = self.peek() else {
            return Err("unexpected end of input".into());
        };
        match b {
            b'{' => self.map(depth),
            b'[' => self.seq(b']', depth).map(Value::Vector),
            b'(' => self.seq(b')', depth).map(Value::Vector),
            b'"' => self.string().map(Value::Str),
            b':' => {
                self.pos += 1;
                Ok(Value::Keyword(self.token()?))
            }
            _ => self.atom(),
        }
    }

    fn seq(&mut self, close: u8, depth: usize) -> Result<Vec<Value>, String> {
        self.pos += 1;
        let mut items = Vec::new();
        loop {
            self.skip_ws();
            if self.peek() == Some(close) {
                self.pos += 1;
                return Ok(items);
            }
            items.push(self.value(depth + 1)?);
        }
    }

    fn map(&mut self, depth: usize) -> Result<Value, String> {
        let items = self.seq(b'}', depth)?;
        if items.len() % 2 != 0 {
            return Err("map with an odd number of forms".into());
        }
        let mut it = items.into_iter();
        let mut pairs = Vec::new();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            pairs.push((k, v));
        }
        Ok(Value::Map(pairs))
    }

    fn string(&mut self) -> Result<String, String> {
        self.pos += 1;
        let mut out = Vec::new();
        while let Some(b) = self.peek() {
            self.pos += 1;
            match b {
                b'"' => return String::from_utf8(out).map_err(|e| e.to_string()),
                b'\\' => out.push(self.escape()?),
                _ => out.push(b),
            }
        }
        Err("unterminated string".into())
    }

    fn escape(&mut self) -> Result<u8, String> {
        let b = self.peek().ok_or("unterminated escape")?;
        self.pos += 1;
        Ok(match b {
            b'n' => b'\n',
            b't' => b'\t',
            b'r' => b'\r',
            b'"' | b'\\' => b,
            _ => return Err(format!("unsupported escape \\{}", b as char)),
        })
    }

    fn token(&mut self) -> Result<String, String> {
        let start = self.pos;
        while self.peek().is_some_and(is_symbol_byte) {
            self.pos += 1;
        }
        if start == self.pos {
            return Err(format!("unexpected character at column {}", self.pos + 1));
        }
        Ok(String::from_utf8_lossy(&self.s[start..self.pos]).into_owned())
    }

    fn atom(&mut self) -> Result<Value, String> {
        let tok = self.token()?;
        Ok(match tok.as_str() {
            "nil" => Value::Nil,
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => match tok.parse::<i64>() {
                Ok(i) => Value::Int(i),
                Err(_) if tok.starts_with(|c: char| c.is_ascii_digit()) => {
                    return Err(format!("unsupported number {tok}"));
                }
                Err(_) => Value::Symbol(tok),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_values() {
        assert_eq!(parse_value("nil").unwrap(), Value::Nil);
        assert_eq!(parse_value(" -12 ").unwrap(), Value::Int(-12));
        assert_eq!(parse_value(":timed-out").unwrap(), Value::Keyword("timed-out".into()));
        assert_eq!(parse_value("[1 4]").unwrap().as_int_pair(), Some((1, 4)));
        assert_eq!(parse_value(r#""a \"b\"""#).unwrap(), Value::Str("a \"b\"".into()));
        assert!(parse_value("[1 2").is_err());
        assert!(parse_value("1 2").is_err());
    }

    #[test]
    fn parses_event_lines() {
        let text = "{:process 0, :type :invoke, :f :append, :key \"0\", :value \"x 0 0 y\"}\n\n\
                    {:process :nemesis, :type :info, :f :start, :value nil}\n\
                    {:process 0, :type :ok, :f :get, :key \"0\", :value \"\"}\n";
        let evs = parse(text).unwrap();
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].kind, EventKind::Invoke);
        assert_eq!(evs[0].f, "append");
        assert_eq!(evs[0].key, Some(Value::Str("0".into())));
        assert_eq!(evs[1].line, 4);
        assert_eq!(evs[1].value, Value::Str(String::new()));
    }

    #[test]
    fn rejects_bad_events() {
        assert!(parse("{:process 0, :type :start, :f :get}").is_err());
        assert!(parse("[1 2]").is_err());
    }
}
