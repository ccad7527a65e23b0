//! A supervisor like the ones tokenlog runs under in production (systemd's `Restart=`, a
//! kubelet): a process that ended on its own is started again after a backoff that doubles
//! with each quick failure; a process that keeps failing right after its start is a crash loop,
//! and the supervisor gives up on it and says so (a circuit breaker). Slow is not dead: it acts
//! only on exits, never on a process that is merely slow to become ready.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::procs::Proc;

/// The first restart's delay; doubled for each further quick failure, up to `BACKOFF_MAX`.
pub const BACKOFF_FIRST: Duration = Duration::from_millis(100);
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// An exit within this long of its start is a quick failure.
pub const QUICK_FAILURE: Duration = Duration::from_secs(1);
/// Quick failures in a row after which the supervisor gives up (the breaker opens).
pub const QUICK_FAILURES_MAX: u32 = 3;
/// Marks a supervisor record of a process it gave up on.
pub const CRASH_LOOP: &str = "[crash loop]";

#[derive(Default)]
struct Track {
    /// Quick failures in a row.
    quick: u32,
    /// When the process was first seen down since its last start.
    down_since: Option<Instant>,
    gave_up: bool,
}

/// What the supervisor did to one process in one [`Supervisor::step`].
#[derive(Debug, PartialEq, Eq)]
pub enum Act {
    /// Running (or waiting out its backoff).
    Nothing,
    Restarted {
        after: Duration,
    },
    GaveUp {
        quick_failures: u32,
    },
}

#[derive(Default)]
pub struct Supervisor {
    tracks: HashMap<String, Track>,
}

impl Supervisor {
    /// Looks at one process: restarts it once its backoff has passed if it ended on its own;
    /// gives up on it after `QUICK_FAILURES_MAX` quick failures in a row.
    pub fn step(&mut self, p: &mut Proc) -> anyhow::Result<Act> {
        let t = self.tracks.entry(p.name.clone()).or_default();
        if t.gave_up || p.exited().is_none() {
            if p.uptime().is_some_and(|u| u >= QUICK_FAILURE) {
                t.quick = 0;
            }
            return Ok(Act::Nothing);
        }
        let down = match t.down_since {
            Some(d) => d,
            None => {
                // Newly seen down: was it a quick failure?
                if p.uptime().is_some_and(|u| u < QUICK_FAILURE) {
                    t.quick += 1;
                } else {
                    t.quick = 0;
                }
                *t.down_since.insert(Instant::now())
            }
        };
        if t.quick >= QUICK_FAILURES_MAX {
            t.gave_up = true;
            return Ok(Act::GaveUp {
                quick_failures: t.quick,
            });
        }
        let after = BACKOFF_FIRST.saturating_mul(1 << t.quick.min(5)).min(BACKOFF_MAX);
        if down.elapsed() < after {
            return Ok(Act::Nothing);
        }
        t.down_since = None;
        p.start()?;
        Ok(Act::Restarted { after })
    }

    /// Whether the supervisor gave up on `name`.
    pub fn gave_up(&self, name: &str) -> bool {
        self.tracks.get(name).is_some_and(|t| t.gave_up)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::procs::Role;

    fn proc(dir: &std::path::Path, name: &str, script: &str) -> Proc {
        Proc::new(
            name,
            Role::Decoder,
            std::path::Path::new("sh"),
            vec!["-c".into(), script.into()],
            dir,
        )
    }

    /// Steps `p` every 20 ms until `until` says stop or `within` passed; the acts seen.
    fn drive(s: &mut Supervisor, p: &mut Proc, within: Duration, until: impl Fn(&Act) -> bool) -> Vec<Act> {
        let start = Instant::now();
        let mut acts = vec![];
        while start.elapsed() < within {
            let a = s.step(p).unwrap();
            let stop = until(&a);
            if a != Act::Nothing {
                acts.push(a);
            }
            if stop {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        acts
    }

    #[test]
    fn a_process_that_fails_at_every_start_is_given_up_on() {
        let d = tempfile::tempdir().unwrap();
        let mut p = proc(d.path(), "looper", "exit 3");
        p.start().unwrap();
        let mut s = Supervisor::default();
        let acts = drive(&mut s, &mut p, Duration::from_secs(10), |a| {
            matches!(a, Act::GaveUp { .. })
        });
        assert_eq!(
            acts.last(),
            Some(&Act::GaveUp {
                quick_failures: QUICK_FAILURES_MAX
            }),
            "{acts:?}"
        );
        // Restarted with a doubling backoff before it gave up.
        let afters: Vec<Duration> = acts
            .iter()
            .filter_map(|a| match a {
                Act::Restarted { after } => Some(*after),
                _ => None,
            })
            .collect();
        assert_eq!(afters, vec![BACKOFF_FIRST * 2, BACKOFF_FIRST * 4], "{acts:?}");
        assert!(s.gave_up("looper"));
        p.start().unwrap(); // the run's heal may start it again; nothing breaks
    }

    #[test]
    fn a_crashed_process_that_stays_up_is_restarted_once_and_not_given_up_on() {
        let d = tempfile::tempdir().unwrap();
        let mut p = proc(d.path(), "steady", "sleep 30");
        p.start().unwrap();
        std::thread::sleep(QUICK_FAILURE + Duration::from_millis(100));
        assert!(p.crash());
        let mut s = Supervisor::default();
        let acts = drive(&mut s, &mut p, Duration::from_secs(3), |_| false);
        assert_eq!(acts, vec![Act::Restarted { after: BACKOFF_FIRST }]);
        assert!(!s.gave_up("steady"));
        assert!(p.self_exits.iter().all(|e| e.meant), "{:?}", p.self_exits);
        p.kill9();
    }
}
