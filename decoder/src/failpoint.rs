//! Test-only failpoints of the lease worker, for the fault suite's deterministic scenarios
//! (CONTRACT §8). Off unless `TOKENLOG_FAILPOINTS` names them; a production decoder never sets it.
//!
//! Syntax: comma-separated `name=arg` items.
//! - `exit-after-sample=SEQ`: the process exits (as if killed) right after it sampled the token
//!   at `SEQ` of a generation, before that token was sent to the log (failure point 7).
//! - `delay-append=SEQ:MS`: when the append carrying `SEQ` is due, the worker stops renewing
//!   every lease and decoding, holds that append for `MS` milliseconds (a message stuck in the
//!   network), then sends it, records the answer, and exits: the late message of an incarnation
//!   that is gone (failure point 10).
//!
//! Each fired failpoint writes an `"op": "failpoint"` line to the decoder's history first.

use std::time::Duration;

/// The environment variable the `tokenlog decoder` binary reads.
pub const ENV: &str = "TOKENLOG_FAILPOINTS";
/// Exit status of a process ended by a failpoint (137 = 128 + SIGKILL, what a kill -9 shows).
pub const EXIT_CODE: i32 = 137;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Failpoints {
    pub exit_after_sample: Option<u32>,
    pub delay_append: Option<(u32, Duration)>,
}

impl Failpoints {
    /// The failpoints `TOKENLOG_FAILPOINTS` names (none when unset).
    pub fn from_env() -> Result<Self, String> {
        match std::env::var(ENV) {
            Ok(s) => Self::parse(&s).map_err(|e| format!("{ENV}: {e}")),
            Err(_) => Ok(Self::default()),
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        let mut fp = Failpoints::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, arg) = item
                .split_once('=')
                .ok_or_else(|| format!("{item:?}: expected name=arg"))?;
            let num = |x: &str| x.parse::<u64>().map_err(|_| format!("{item:?}: {x:?} is not a number"));
            match name {
                "exit-after-sample" => fp.exit_after_sample = Some(num(arg)? as u32),
                "delay-append" => {
                    let (seq, ms) = arg
                        .split_once(':')
                        .ok_or_else(|| format!("{item:?}: expected delay-append=SEQ:MS"))?;
                    fp.delay_append = Some((num(seq)? as u32, Duration::from_millis(num(ms)?)));
                }
                _ => {
                    return Err(format!(
                        "unknown failpoint {name:?} (known: exit-after-sample, delay-append)"
                    ))
                }
            }
        }
        Ok(fp)
    }

    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_failpoint_and_refuses_garbage() {
        assert_eq!(Failpoints::parse("").unwrap(), Failpoints::default());
        let fp = Failpoints::parse("exit-after-sample=20, delay-append=7:3000").unwrap();
        assert_eq!(fp.exit_after_sample, Some(20));
        assert_eq!(fp.delay_append, Some((7, Duration::from_millis(3000))));
        assert!(fp.any());
        assert!(Failpoints::parse("exit-after-sample").is_err());
        assert!(Failpoints::parse("exit-after-sample=x").is_err());
        assert!(Failpoints::parse("delay-append=3").is_err());
        assert!(Failpoints::parse("nope=1").unwrap_err().contains("unknown failpoint"));
    }
}
