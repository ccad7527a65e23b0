//! The lease side of the worker: reading a taken generation's committed prefix, and the renewer
//! that keeps held leases alive while a step is slow (slow is not dead).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::{ClientError, LogClient};

use crate::worker::{WorkerConfig, WorkerError};

use crate::limits::{
    PREFIX_READ_RETRY_PAUSE, PREFIX_READ_TIMEOUT, RENEWS_PER_LEASE, RENEW_PERIOD_MIN, SESSION_RETRY_PAUSE_MAX,
    SESSION_RETRY_PAUSE_MIN,
};

/// Shared with the renewer: what we hold, and when the log last confirmed it.
pub(crate) type Held = Arc<Mutex<BTreeMap<u64, (u64, Instant)>>>;

/// Filled by the renewer: `(generation, epoch)` whose renewal the log rejected. The worker drops
/// them before it sends anything more (CONTRACT §2).
pub(crate) type Lost = Arc<Mutex<Vec<(u64, u64)>>>;

/// Aborts the renewer on every exit path of [`crate::worker::Worker::run`], so a worker that ends (with an error,
/// a panic, or a halt) stops renewing the leases it held: they lapse and another decoder takes over.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Holds the decoder's session with the leader for as long as the worker runs (instant crash
/// detection: when this process dies, its stream breaks and the leader ends its leases at
/// once), opening a new one, with a fresh id, after a leader change or a lost connection.
/// `open` says whether a session is open now. Ends only when the log has no sessions.
pub(crate) async fn session_loop(
    client: LogClient,
    decoder_id: String,
    open: Arc<AtomicBool>,
    renew: Arc<tokio::sync::Notify>,
    history: Option<Arc<crate::history::History>>,
) {
    let mut pause = SESSION_RETRY_PAUSE_MIN;
    // The session a renewal replaces, held until the new one is open: the log may hold it still
    // (a registration's answer lost made the registration look lapsed), and ending its stream
    // would end every lease of this decoder. Once the new one is the log's, the old one's end
    // ends nothing.
    let mut replaced: Option<tokenlog_raftlog::client::Session> = None;
    loop {
        let id = fresh_session_id();
        match client.open_session(&decoder_id, id).await {
            Ok(mut session) => {
                drop(replaced.take());
                open.store(true, Ordering::Release);
                if let Some(h) = &history {
                    h.event(crate::history::DecoderEvent::SessionOpened { session: id });
                }
                tracing::debug!(session = id, "session with the leader open");
                pause = SESSION_RETRY_PAUSE_MIN;
                tokio::select! {
                    why = session.ended() => {
                        open.store(false, Ordering::Release);
                        tracing::info!(session = id, why = %why.message(), "session with the leader ended; opening another");
                    }
                    // The log may no longer hold this one (the registration lapsed): a new one,
                    // at once; the old one goes once the new one is open.
                    () = renew.notified() => {
                        tracing::info!(session = id, "the session may be dropped by the log; opening another");
                        replaced = Some(session);
                        continue;
                    }
                }
            }
            Err(ClientError::Status(s)) if s.code() == tonic::Code::Unimplemented => {
                tracing::warn!("the log has no decoder sessions (an older release): a crash of this decoder is found by lease expiry");
                open.store(true, Ordering::Release);
                return;
            }
            Err(e) => tracing::debug!(error = %e, "session not opened"),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(SESSION_RETRY_PAUSE_MAX);
    }
}

/// A random non-zero id (std's per-process random hash keys; no id twice in a row); counted
/// under the simulation.
fn fresh_session_id() -> u64 {
    if let Some(id) = crate::simulation::session_id() {
        return id;
    }
    random_nonzero()
}

/// A random non-zero number from std's per-process random hash keys (a session id, a
/// handoff's rows key).
pub(crate) fn random_nonzero() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish().max(1)
}

/// Reads the first `frontier` committed records of a generation.
pub(crate) async fn read_prefix(client: &LogClient, id: u64, frontier: u32) -> Result<Vec<u32>, WorkerError> {
    read_records(client, id, 0, frontier).await
}

/// Reads committed records `from..frontier` of a generation.
pub(crate) async fn read_records(
    client: &LogClient,
    id: u64,
    from: u32,
    frontier: u32,
) -> Result<Vec<u32>, WorkerError> {
    use futures::StreamExt;
    let mut out = Vec::with_capacity(frontier.saturating_sub(from) as usize);
    let at = |out: &Vec<u32>| from + out.len() as u32;
    let deadline = Instant::now() + PREFIX_READ_TIMEOUT;
    while at(&out) < frontier {
        // A node that has not applied the submit yet answers NOT_FOUND; a lagging or
        // unreachable one fails: try again (the client moves on to another node) until the
        // deadline. The caller releases the generation if it never becomes readable.
        let mut stream = match client.watch(id, at(&out)).await {
            Ok(s) => s,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(generation = id, error = %e, "prefix read failed; retrying");
                tokio::time::sleep(PREFIX_READ_RETRY_PAUSE).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        while at(&out) < frontier {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(remaining, stream.next()).await {
                Ok(Some(Ok(ev))) => {
                    for r in ev.records {
                        if r.seq == at(&out) && at(&out) < frontier {
                            out.push(r.token_id);
                        }
                    }
                    if ev.terminal.is_some() {
                        if at(&out) < frontier {
                            // It ended short of what was asked: watching again would only
                            // answer the same end, as fast as the log answers, until the
                            // deadline.
                            return Err(WorkerError::Other(format!(
                                "generation {id} ended with {} records; {frontier} were asked for",
                                at(&out)
                            )));
                        }
                        break;
                    }
                }
                Ok(_) => break,
                Err(_) => {
                    return Err(WorkerError::Other(format!(
                        "committed prefix of generation {id} not readable within {PREFIX_READ_TIMEOUT:?}"
                    )))
                }
            }
        }
        if Instant::now() > deadline {
            return Err(WorkerError::Other(format!(
                "committed prefix of generation {id} not readable"
            )));
        }
    }
    Ok(out)
}

/// Takes the log's answer to a renewal of `id` at `epoch` into `held`: accepted, the lease was
/// confirmed `now`; refused, it is no longer renewed. Only the lease the renewal was for: the
/// generation may have been dropped and taken again meanwhile at a newer epoch, which an old
/// epoch's refusal must not take out of the renewals (it then went unrenewed until its first
/// append, and a long prefill outlasted its lease).
fn renewed(held: &mut BTreeMap<u64, (u64, Instant)>, id: u64, epoch: u64, ok: bool, now: Instant) {
    match held.get_mut(&id).filter(|v| v.0 == epoch) {
        Some(v) if ok => v.1 = now,
        Some(_) => {
            held.remove(&id);
        }
        None => {}
    }
}

/// Renews every held lease that the log has not confirmed for a third of the lease.
pub(crate) async fn renew_loop(client: LogClient, cfg: WorkerConfig, held: Held, lost: Lost) {
    let period = Duration::from_millis(cfg.lease_ms / RENEWS_PER_LEASE).max(RENEW_PERIOD_MIN);
    loop {
        tokio::time::sleep(period).await;
        let due: Vec<(u64, u64)> = held
            .lock()
            .expect("lock")
            .iter()
            .filter(|(_, (_, at))| at.elapsed() >= period)
            .map(|(id, (e, _))| (*id, *e))
            .collect();
        for (id, epoch) in due {
            let req = pb::RenewRequest {
                generation_id: id,
                epoch,
                decoder_id: cfg.decoder_id.clone(),
                lease_ms: cfg.lease_ms,
            };
            match client.renew(req).await {
                Ok(r) => {
                    if !r.ok {
                        tracing::warn!(generation = id, epoch, rejection = ?r.rejection, "renew rejected");
                        lost.lock().expect("lock").push((id, epoch));
                    }
                    renewed(&mut held.lock().expect("lock"), id, epoch, r.ok, Instant::now());
                }
                Err(e) => tracing::warn!(generation = id, error = %e, "renew failed"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A renewal's answer touches the lease it was for only: an old epoch's refusal arriving
    /// after the generation was taken again leaves the new lease in the renewals, and an old
    /// epoch's success does not vouch for it.
    #[test]
    fn an_old_epochs_renewal_answer_leaves_the_new_lease_alone() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(1);
        let mut held = BTreeMap::from([(7, (3, t0))]);
        renewed(&mut held, 7, 2, false, later);
        assert_eq!(held.get(&7), Some(&(3, t0)), "refused at epoch 2");
        renewed(&mut held, 7, 2, true, later);
        assert_eq!(held.get(&7), Some(&(3, t0)), "accepted at epoch 2");
        renewed(&mut held, 7, 3, true, later);
        assert_eq!(held.get(&7), Some(&(3, later)));
        renewed(&mut held, 7, 3, false, later);
        assert_eq!(held.get(&7), None);
        renewed(&mut held, 8, 1, false, later);
        assert!(held.is_empty());
    }
}
