//! An optional JSONL record of a decoder's ownership operations (acquire, append), with
//! invocation and completion times, for the fault suite's checkers (linearizability of
//! ownership and frontier, fencing). Two lines per operation: `"phase": "invoke"` before the call
//! (with its input) and `"phase": "complete"` after it (with the answer, `"ok": null` when the
//! answer was lost), joined by `(decoder, id)`. Each line is one `write`, so a decoder killed with
//! SIGKILL leaves whole lines; an operation with no completion line is indeterminate: it may
//! have taken effect. Single `"phase": "event"` lines record instants: a generation resumed
//! (with its four frontiers), a failpoint fired.

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

pub struct History {
    out: Mutex<std::fs::File>,
    next: std::sync::atomic::AtomicU64,
}

/// Wall-clock microseconds; every process of a single-machine run shares the clock.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl History {
    pub fn open(path: &Path) -> std::io::Result<History> {
        let f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(History {
            out: Mutex::new(f),
            next: Default::default(),
        })
    }

    /// Records an operation's invocation (`v` names op, decoder and input); returns its id.
    pub fn invoke(&self, mut v: serde_json::Value) -> u64 {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        v["phase"] = "invoke".into();
        v["id"] = id.into();
        v["invoke_us"] = now_us().into();
        self.record(v);
        id
    }

    /// Records the answer of operation `id` (`v` holds decoder and the outputs).
    pub fn complete(&self, id: u64, mut v: serde_json::Value) {
        v["phase"] = "complete".into();
        v["id"] = id.into();
        v["complete_us"] = now_us().into();
        self.record(v);
    }

    /// Records something that happened at one instant (`"phase": "event"`), e.g. a generation
    /// resumed with its frontiers, or a failpoint fired.
    pub fn event(&self, mut v: serde_json::Value) {
        v["phase"] = "event".into();
        v["at_us"] = now_us().into();
        self.record(v);
    }

    fn record(&self, v: serde_json::Value) {
        let mut line = v.to_string();
        line.push('\n');
        let mut f = self.out.lock().expect("lock");
        if let Err(e) = f.write_all(line.as_bytes()) {
            tracing::warn!("history write failed: {e}");
        }
    }
}
