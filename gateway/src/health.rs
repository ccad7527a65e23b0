//! A gateway's readiness: it reaches the log. A task asks the log for its status every
//! [`LOG_PROBE_EVERY`]; the gateway is ready while the last answer is younger than
//! [`LOG_UNREACHABLE_AFTER`] and named a leader.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokenlog_raftlog::client::LogClient;
use tokenlog_raftlog::health::Readiness;

use crate::limits::{LOG_PROBE_EVERY, LOG_UNREACHABLE_AFTER};

/// Starts probing the log through `client` (give it a short retry budget, e.g.
/// [`crate::limits::LOG_PROBE_BUDGET`]); the probe ends with the returned check.
pub fn log_readiness(client: LogClient) -> Readiness {
    // When the last probe got an answer with a leader; and the last failure, to report it.
    let last: Arc<Mutex<(Option<Instant>, String)>> = Arc::new(Mutex::new((None, "the log not asked yet".into())));
    let probe = Arc::downgrade(&last);
    tokio::spawn(async move {
        loop {
            let outcome = match client.cluster_status(false).await {
                Ok(s) if s.leader_id != 0 => Ok(()),
                Ok(_) => Err("the log has no leader".to_string()),
                Err(e) => Err(format!("the log does not answer: {e}")),
            };
            let Some(last) = probe.upgrade() else { return };
            {
                let mut l = last.lock().expect("lock");
                match outcome {
                    Ok(()) => l.0 = Some(Instant::now()),
                    Err(why) => l.1 = why,
                }
            }
            drop(last);
            tokio::time::sleep(LOG_PROBE_EVERY).await;
        }
    });
    Arc::new(move || {
        let l = last.lock().expect("lock");
        match l.0 {
            Some(t) if t.elapsed() < LOG_UNREACHABLE_AFTER => Ok(()),
            _ => Err(l.1.clone()),
        }
    })
}
