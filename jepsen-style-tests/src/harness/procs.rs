//! The processes of a run: 3 log nodes, gateways, decoders and (a pipeline run) stages, each a real `tokenlog` process on
//! loopback, killed with SIGKILL, paused with SIGSTOP, restarted with the same arguments.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// A loopback port that was free just now and that this process has not handed out before: two
/// picks in a row may otherwise get the same ephemeral port (seen: two nodes of one cluster
/// given one address).
pub fn free_port() -> u16 {
    free_ports(1)
}

/// The first of `n` consecutive loopback ports that were all free just now, that this process has
/// not handed out before, and that lie below the kernel's ephemeral range. A port the kernel
/// picked for `127.0.0.1:0` lies inside that range, where any outgoing connection of a parallel
/// test may take it, or the port after it, before our process binds it (seen in CI: a bench's
/// second node port, one above a free port, was taken).
pub fn free_ports(n: u16) -> u16 {
    static GIVEN: std::sync::Mutex<Vec<(u16, u16)>> = std::sync::Mutex::new(Vec::new());
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    assert!((1..=64).contains(&n), "{n} ports");
    // Below the ephemeral range (32768 unless set otherwise), above the well-known ports and the
    // benches' defaults (27100-27800 and the ports above them).
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let (low, high) = (10_000u32, u32::from(ephemeral.min(27_000)) - u32::from(n));
    let span = high - low;
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    // Each process starts somewhere else in the range, so test binaries run one after another
    // (or by two people) do not reach for the same ports first.
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let k = NEXT.fetch_add(u32::from(n), std::sync::atomic::Ordering::Relaxed);
        let base = (low + (start + k) % span) as u16;
        let end = base + n;
        if given.iter().any(|&(b, e)| base < e && b < end) {
            continue;
        }
        // Held all at once, so every port of the block was free at the same moment.
        let held: Result<Vec<_>, _> = (base..end)
            .map(|p| std::net::TcpListener::bind(("127.0.0.1", p)))
            .collect();
        if held.is_ok() {
            given.push((base, end));
            return base;
        }
    }
    panic!("no {n} free consecutive loopback ports in {low}..{high}");
}

pub fn wait_for_port(addr: &str, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    while std::net::TcpStream::connect(addr).is_err() {
        if Instant::now() > deadline {
            bail!("nothing listens on {addr} after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A process that ended on its own.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SelfExit {
    pub name: String,
    pub incarnation: u32,
    /// The exit code; `None` when a signal ended it.
    pub code: Option<i32>,
    pub status: String,
    /// A nemesis made this incarnation fail on purpose and expected exactly this exit.
    pub meant: bool,
    /// The last error lines the process logged before it ended (why, for a report that has
    /// only the checker's words, like CI's output).
    pub last_words: Vec<String>,
}

/// The error lines a [`SelfExit`] keeps.
const LAST_WORDS: usize = 3;
/// How much of a log line a report keeps.
const LOG_LINE_CHARS: usize = 400;

/// The last `n` error lines of a process log (tracing's `ERROR` lines, and the `Error: ...` a
/// binary's `main` prints), and its `WARN` lines too with `warnings`, in order, each cut to
/// `LOG_LINE_CHARS`.
pub fn last_log_lines(log: &str, warnings: bool, n: usize) -> Vec<String> {
    let mut lines: Vec<String> = log
        .lines()
        .rev()
        .filter(|l| l.contains(" ERROR ") || l.starts_with("Error: ") || (warnings && l.contains(" WARN ")))
        .take(n)
        .map(|l| l.chars().take(LOG_LINE_CHARS).collect())
        .collect();
    lines.reverse();
    lines
}

pub fn last_words(log: &str) -> Vec<String> {
    last_log_lines(log, false, LAST_WORDS)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Role {
    Node,
    Gateway,
    Decoder,
    /// A pipeline stage (`tokenlog stage`) of decoder 1's pipeline, or a spare.
    Stage,
}

/// One process slot: what to run, and the running child if any.
pub struct Proc {
    pub name: String,
    pub role: Role,
    bin: PathBuf,
    /// Arguments; `{inc}` is replaced by the incarnation number (decoder ids must be unique per
    /// incarnation).
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// Environment of the first incarnation only (a failpoint that must not fire again).
    first_env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
    pub paused: bool,
    pub incarnation: u32,
    /// Every time the process ended on its own (not by [`Proc::kill9`]): a crash unless a
    /// failpoint meant it. The run reports them.
    pub self_exits: Vec<SelfExit>,
    /// The address to wait for after a start (gRPC port).
    pub ready_addr: Option<String>,
    /// `(incarnation, exit code)` a nemesis made fail on purpose (`None`: killed by a signal).
    expected_exits: Vec<(u32, Option<i32>)>,
    /// Environment of the next incarnation only (a nemesis's failpoint).
    next_env: Vec<(String, String)>,
    /// When the running incarnation started.
    started_at: Option<Instant>,
}

impl Proc {
    pub fn new(name: &str, role: Role, bin: &Path, args: Vec<String>, dir: &Path) -> Proc {
        Proc {
            name: name.to_string(),
            role,
            bin: bin.to_path_buf(),
            args,
            env: vec![],
            first_env: vec![],
            log: dir.join(format!("{name}.log")),
            child: None,
            paused: false,
            incarnation: 0,
            self_exits: vec![],
            ready_addr: None,
            expected_exits: vec![],
            next_env: vec![],
            started_at: None,
        }
    }

    /// Starts the next incarnation with `env` added, expecting it to exit on its own with
    /// `code` (a failpoint a nemesis arms).
    pub fn start_failing(&mut self, env: &[(&str, &str)], code: i32) -> Result<()> {
        self.kill9();
        self.next_env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.expected_exits.push((self.incarnation + 1, Some(code)));
        self.start()
    }

    /// The running incarnation may exit on its own with `code` (a fault a nemesis causes that a
    /// clean exit is an acceptable answer to, such as a full disk).
    pub fn allow_exit(&mut self, code: i32) {
        self.expected_exits.push((self.incarnation, Some(code)));
    }

    /// Kills the running incarnation with SIGKILL from outside (as an OOM killer would), and
    /// leaves it down: its end counts as an exit of its own, an expected one. Returns whether
    /// there was a process to kill.
    pub fn crash(&mut self) -> bool {
        if self.child.is_none() || self.exited().is_some() {
            return false;
        }
        self.resume();
        self.expected_exits.push((self.incarnation, None));
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        true
    }

    /// How long the running incarnation has been up (`None` when none runs).
    pub fn uptime(&self) -> Option<Duration> {
        self.started_at.filter(|_| self.child.is_some()).map(|t| t.elapsed())
    }

    pub fn env(mut self, k: &str, v: &str) -> Proc {
        self.env.push((k.into(), v.into()));
        self
    }

    pub fn first_env(mut self, k: &str, v: &str) -> Proc {
        self.first_env.push((k.into(), v.into()));
        self
    }

    /// The first incarnation may end on its own with `code` (its failpoint's exit).
    pub fn first_exit_may_be(mut self, code: i32) -> Proc {
        self.expected_exits.push((1, Some(code)));
        self
    }

    /// Asks the running incarnation to stop (SIGTERM: a decoder drains), which may then exit
    /// on its own with status 0.
    pub fn terminate(&mut self) {
        if self.child.is_some() && self.exited().is_none() {
            self.resume();
            self.expected_exits.push((self.incarnation, Some(0)));
            self.signal("-TERM");
        }
    }

    /// What the process wrote to its log (stderr) so far, all incarnations.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The child's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The exit status, once the process ended on its own (not after [`Proc::kill9`]).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Records the exit of a child that ended on its own, and forgets the child.
    fn note_exit(&mut self) {
        if let Some(st) = self.exited() {
            let meant = self
                .expected_exits
                .iter()
                .any(|&(inc, code)| inc == self.incarnation && st.code() == code);
            self.self_exits.push(SelfExit {
                name: self.name.clone(),
                incarnation: self.incarnation,
                code: st.code(),
                status: st.to_string(),
                meant,
                last_words: last_words(&self.log_text()),
            });
        }
        self.child = None;
    }

    /// Starts the process unless it runs (one that exited on its own is started again).
    pub fn start(&mut self) -> Result<()> {
        if self.child.is_some() {
            if self.exited().is_none() {
                return Ok(());
            }
            self.note_exit();
        }
        self.incarnation += 1;
        let args: Vec<String> = self
            .args
            .iter()
            .map(|a| a.replace("{inc}", &self.incarnation.to_string()))
            .collect();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("{}", self.log.display()))?;
        let first: &[(String, String)] = if self.incarnation == 1 { &self.first_env } else { &[] };
        let once = std::mem::take(&mut self.next_env);
        let child = Command::new(&self.bin)
            .args(&args)
            .envs(
                self.env
                    .iter()
                    .chain(first)
                    .chain(&once)
                    .map(|(k, v)| (k.as_str(), v.as_str())),
            )
            .env("RUST_LOG", "info,openraft=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} ({})", self.name, self.bin.display()))?;
        self.child = Some(child);
        self.started_at = Some(Instant::now());
        self.paused = false;
        Ok(())
    }

    pub fn kill9(&mut self) {
        if self.exited().is_some() {
            self.note_exit();
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.paused = false;
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill").args([sig, &c.id().to_string()]).status();
        }
    }

    pub fn pause(&mut self) {
        if self.child.is_some() && !self.paused {
            self.signal("-STOP");
            self.paused = true;
        }
    }

    pub fn resume(&mut self) {
        if self.paused {
            self.signal("-CONT");
            self.paused = false;
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.resume();
        self.kill9();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_last_words_are_the_last_error_lines_in_order() {
        let log = "2026-12-06T12:00:00Z  INFO x: started\n\
                   2026-12-06T12:00:01Z ERROR tokenlog_decoder::pipeline: no spare answers\n\
                   2026-12-06T12:00:02Z  WARN x: slow\n\
                   2026-12-06T12:00:03Z ERROR tokenlog_decoder::worker: the step failed\n\
                   Error: the decoder's worker failed\n\
                   \n";
        assert_eq!(
            super::last_words(log),
            vec![
                "2026-12-06T12:00:01Z ERROR tokenlog_decoder::pipeline: no spare answers",
                "2026-12-06T12:00:03Z ERROR tokenlog_decoder::worker: the step failed",
                "Error: the decoder's worker failed",
            ]
        );
        assert!(super::last_words("all fine\n").is_empty());
    }
}
