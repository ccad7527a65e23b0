//! An optional JSONL record of a decoder's ownership operations (acquire, append), with
//! invocation and completion times, for the fault suite's checkers (linearizability of
//! ownership and frontier, fencing). One line per operation, flushed as it is written, so a
//! decoder killed with SIGKILL loses at most the line in progress; an operation whose answer never
//! came is written with `"ok": null` (indeterminate).

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

pub struct History {
    out: Mutex<std::fs::File>,
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
        Ok(History { out: Mutex::new(f) })
    }

    pub fn record(&self, v: serde_json::Value) {
        let mut line = v.to_string();
        line.push('\n');
        let mut f = self.out.lock().expect("lock");
        if let Err(e) = f.write_all(line.as_bytes()) {
            tracing::warn!("history write failed: {e}");
        }
    }
}
