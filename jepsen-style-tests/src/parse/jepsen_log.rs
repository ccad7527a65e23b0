//! Jepsen log lines: `INFO  jepsen.util - <process>\t<:invoke|:ok|:fail|:info>\t<:f>\t<value>`.
//!
//! Fields may be separated by tabs or spaces; the value is EDN (`nil`, `3`, `[1 4]`,
//! `:timed-out`). Lines that are not client events (other loggers, the nemesis, anything that
//! does not have that shape) are skipped; a line that has the shape but an unparsable value is
//! an error.

use super::{edn, ParseError, RawEvent};
use crate::history::EventKind;

/// What precedes the event fields on an event line.
const EVENT_MARKER: &str = "jepsen.util - ";

/// Parses a whole Jepsen log.
pub fn parse(text: &str) -> Result<Vec<RawEvent>, ParseError> {
    let mut events = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if let Some(ev) = parse_line(i + 1, raw)? {
            events.push(ev);
        }
    }
    Ok(events)
}

/// The event on one line, `None` if the line is not a client event.
fn parse_line(line: usize, raw: &str) -> Result<Option<RawEvent>, ParseError> {
    let Some((_, rest)) = raw.split_once(EVENT_MARKER) else {
        return Ok(None);
    };
    let mut fields = rest.split_whitespace();
    let (Some(process), Some(kind), Some(f)) = (fields.next(), fields.next(), fields.next()) else {
        return Ok(None);
    };
    let (Ok(process), Some(kind)) = (process.parse::<u64>(), EventKind::parse(kind)) else {
        return Ok(None);
    };
    let Some(f) = f.strip_prefix(':') else {
        return Ok(None);
    };
    let value_text = fields.collect::<Vec<_>>().join(" ");
    let value = edn::parse_value(&value_text).map_err(|reason| ParseError::Syntax { line, reason })?;
    Ok(Some(RawEvent {
        line,
        process,
        kind,
        f: f.to_string(),
        key: None,
        value,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::Value;

    #[test]
    fn parses_tabs_and_spaces_and_skips_non_events() {
        let text = "INFO  jepsen.util - 2\t:invoke\t:cas\t[1 4]\n\
                    INFO  jepsen.core - Worker 2 starting\n\
                    INFO  jepsen.util - :nemesis\t:info\t:start\tnil\n\
                    INFO  jepsen.util - 2   :info   :cas    :timed-out\n";
        let evs = parse(text).unwrap();
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].value.as_int_pair(), Some((1, 4)));
        assert_eq!(evs[1].kind, EventKind::Info);
        assert_eq!(evs[1].value, Value::Keyword("timed-out".into()));
        assert_eq!(evs[1].line, 4);
    }

    #[test]
    fn bad_value_is_an_error() {
        assert!(parse("INFO  jepsen.util - 2\t:invoke\t:cas\t[1 4\n").is_err());
    }
}
