//! Hot standby (issue 15 item 3): a decoder follows running generations it does not own, so
//! that if an owner dies it continues with the next draw instead of a re-prefill.
//!
//! - **Assignment, by the log.** Every [`STANDBY_POLL`] a worker with free standby slots asks
//!   `PendingWork` (standby mode) for running generations of its model owned by others and
//!   without a live standby, and claims each with `Standby`; the log grants at most one live
//!   standby per generation (first come) and, for `STANDBY_PRIORITY_MS` after the owner's lease
//!   ends, lets only that standby acquire it.
//! - **Following.** A claimed generation is resumed from its committed prefix
//!   ([`DecodeState::resume_deferred`]), then a task watches its committed records and hands them
//!   to the worker, which feeds them to the model one position per record
//!   ([`DecodeState::follow`]), batched over every followed generation, as the owner fed them:
//!   the state stays at the committed frontier with the next position's logits at hand. Only
//!   committed records are followed, never a sampled token, so a standby holds nothing the log
//!   does not.
//! - **Takeover.** A standby takes a generation the normal way (pending work, `Acquire`, a new
//!   epoch, fenced as always); when its followed state is at the frontier the log granted, that
//!   state is the owner's (records still queued are followed first), else it re-prefills.
//!
//! A standby writes nothing before it acquired the generation: it has no epoch to write with.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use tokio::time::Instant;

use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;
use tokenlog_raftlog::types::Binding;
use tokio::sync::mpsc;

use crate::limits::{STANDBY_POLL, STANDBY_WATCH_GIVE_UP};
use crate::resume::DecodeState;
use crate::worker::{model_work, WorkerConfig, WorkerError};
use crate::worker_lease::{read_prefix, AbortOnDrop};
use crate::Model;

/// What a watch task tells the worker about a followed generation.
enum Followed {
    /// Record `seq` committed `token`.
    Record { generation: u64, seq: u32, token: u32 },
    /// The generation ended (or cannot be watched any more): stop following it.
    Ended { generation: u64 },
}

/// A generation this decoder follows.
pub(crate) struct Shadow {
    state: DecodeState,
    /// Records received and not yet fed, in seq order.
    queue: VecDeque<u32>,
    /// The task that watches the generation's records; stops when the shadow is dropped.
    _watch: AbortOnDrop,
}

impl Shadow {
    /// Whether the model has something to do for it: a record to feed, a prefill chunk, or the
    /// last record's position (fed eagerly, so that a takeover draws at once).
    fn has_work(&self) -> bool {
        self.state.finished().is_none() && (!self.queue.is_empty() || !self.state.logits_ready())
    }

    /// The seq of the next record it needs: records are consecutive, followed, then queued.
    fn next_seq(&self) -> u32 {
        (self.followed() + self.queue.len()) as u32
    }

    /// Records past those followed and queued that a takeover at `frontier` still needs (to
    /// read from the log); empty when it has them all, or is past `frontier` (then
    /// [`Shadow::into_state`] refuses it).
    pub(crate) fn missing(&self, frontier: u32) -> std::ops::Range<u32> {
        self.next_seq().min(frontier)..frontier
    }

    /// The followed state of a generation granted at `frontier`: the records still queued, then
    /// `read` (the [`Shadow::missing`] ones, read from the log), are followed first, in one call
    /// on a grouping-invariant sequence. `None` when they do not make exactly `frontier`.
    pub(crate) fn into_state(mut self, frontier: u32, read: &[u32]) -> Option<Result<DecodeState, crate::Error>> {
        let followed = self.state.frontiers().committed as u32;
        let queued = (self.queue.len() as u32).min(frontier.checked_sub(followed)?);
        if followed + queued + read.len() as u32 != frontier {
            return None;
        }
        let mut behind: Vec<u32> = self.queue.drain(..queued as usize).collect();
        behind.extend_from_slice(read);
        if let Err(e) = self.state.follow_all(&behind) {
            return Some(Err(e));
        }
        Some(self.state.feed_pending().map(|()| self.state))
    }

    /// Records followed so far (the committed prefix the state covers).
    pub(crate) fn followed(&self) -> usize {
        self.state.frontiers().committed
    }
}

/// A worker's followed generations.
pub(crate) struct Standbys {
    shadows: BTreeMap<u64, Shadow>,
    tx: mpsc::UnboundedSender<Followed>,
    rx: mpsc::UnboundedReceiver<Followed>,
    last_poll: Option<Instant>,
    /// Wakes the worker's idle loop when records arrive.
    wake: Arc<tokio::sync::Notify>,
}

impl Standbys {
    pub(crate) fn new(wake: Arc<tokio::sync::Notify>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Standbys {
            shadows: BTreeMap::new(),
            tx,
            rx,
            last_poll: None,
            wake,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.shadows.len()
    }

    /// The generations it follows.
    pub(crate) fn ids(&self) -> Vec<u64> {
        self.shadows.keys().copied().collect()
    }

    /// The shadow of generation `id`, taken out (a takeover); [`Standbys::put_back`] when the
    /// acquire was refused.
    pub(crate) fn take(&mut self, id: u64) -> Option<Shadow> {
        self.shadows.remove(&id)
    }

    pub(crate) fn put_back(&mut self, id: u64, s: Shadow) {
        self.shadows.insert(id, s);
    }

    /// Whether a poll for generations to follow is due.
    pub(crate) fn poll_due(&self, cfg: &WorkerConfig) -> bool {
        self.shadows.len() < cfg.standby && self.last_poll.is_none_or(|t| t.elapsed() >= STANDBY_POLL)
    }

    /// Asks the log for generations to follow and claims them, up to the free slots; `skip`:
    /// generations this worker owns or is taking.
    pub(crate) async fn poll(
        &mut self,
        client: &LogClient,
        cfg: &WorkerConfig,
        model: &Arc<dyn Model>,
        identity: &pb::ModelIdentity,
        skip: impl Fn(u64) -> bool,
    ) {
        self.last_poll = Some(Instant::now());
        let want = cfg.standby.saturating_sub(self.shadows.len());
        let candidates = match client
            .pending_work(pb::PendingWorkRequest {
                model: Some(identity.clone()),
                limit: want as u32,
                standby: true,
                decoder_id: cfg.decoder_id.clone(),
                // Not offered again: only new ones, or one whose claim the log dropped.
                standing_by: self.ids(),
            })
            .await
        {
            Ok(p) => p.generations,
            Err(e) => {
                tracing::debug!(error = %e, "standby candidates not read");
                return;
            }
        };
        for info in candidates {
            let id = info.generation_id;
            if skip(id) {
                continue;
            }
            if self.shadows.contains_key(&id) {
                // Followed, and offered: its claim is gone from the log (its owner released
                // it, the log dropped the claim). Claimed again, the followed state kept; it
                // followed on without the standby's priority.
                let again = ask_standby(client, cfg, identity, id).await;
                let held = pb::RejectReason::LeaseHeld as i32;
                match again {
                    Ok(r) if r.ok => tracing::debug!(generation = id, "standing by again"),
                    // Another decoder is its standby now: following it is of no use.
                    Ok(r) if r.rejection.as_ref().is_some_and(|j| j.reason == held) => {
                        self.shadows.remove(&id);
                        tracing::debug!(generation = id, "no longer standing by: another decoder is its standby");
                    }
                    // Ended, or no answer: its watch ends it, or the next poll asks again.
                    other => tracing::debug!(generation = id, answer = ?other, "not standing by again"),
                }
                continue;
            }
            if self.shadows.len() >= cfg.standby {
                continue;
            }
            // Not `self` across the await: the followed states are not `Sync`.
            let (tx, wake) = (self.tx.clone(), self.wake.clone());
            match claim(client, cfg, model, identity, id, tx, wake).await {
                Ok(Some(s)) => {
                    tracing::info!(generation = id, frontier = s.followed(), "standing by");
                    self.shadows.insert(id, s);
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(generation = id, error = %e, "not standing by"),
            }
        }
    }

    /// Takes in the records the watch tasks delivered; drops generations that ended.
    pub(crate) fn absorb(&mut self) {
        while let Ok(f) = self.rx.try_recv() {
            match f {
                Followed::Record { generation, seq, token } => {
                    if let Some(s) = self.shadows.get_mut(&generation).filter(|s| s.next_seq() == seq) {
                        s.queue.push_back(token);
                    }
                }
                Followed::Ended { generation } => {
                    if self.shadows.remove(&generation).is_some() {
                        tracing::debug!(generation, "no longer standing by: it ended");
                    }
                }
            }
        }
    }

    /// Whether the model has work for a followed generation.
    pub(crate) fn has_work(&self) -> bool {
        self.shadows.values().any(Shadow::has_work)
    }

    /// One batched forward pass over every followed generation with work: each feeds its
    /// pending position (or its next prefill chunk), then takes the records it received
    /// ([`DecodeState::follow_all`]: one more call for all but the last on a grouping-invariant
    /// sequence). A generation that fails is no longer followed (a takeover re-prefills it).
    pub(crate) async fn step(&mut self, model: &Arc<dyn Model>) {
        let ids: Vec<u64> = self
            .shadows
            .iter()
            .filter(|(_, s)| s.has_work())
            .map(|(id, _)| *id)
            .collect();
        if ids.is_empty() {
            return;
        }
        let mut working: Vec<(u64, Shadow)> = ids
            .iter()
            .filter_map(|id| self.shadows.remove(id).map(|s| (*id, s)))
            .collect();
        let m = model.clone();
        let done = model_work(move || {
            let fed = {
                let mut states: Vec<&mut DecodeState> = working.iter_mut().map(|(_, s)| &mut s.state).collect();
                DecodeState::feed_pending_batch(m.as_ref(), &mut states)
            };
            if let Err(e) = fed {
                return (Vec::new(), Some(e.to_string()));
            }
            let mut kept = Vec::with_capacity(working.len());
            for (id, mut s) in working {
                if s.state.prefilling() {
                    kept.push((id, s));
                    continue;
                }
                // Every record received: one call catches up on a grouping-invariant sequence.
                let records: Vec<u32> = s.queue.drain(..).collect();
                match s.state.follow_all(&records) {
                    Err(e) => tracing::warn!(generation = id, error = %e, "no longer standing by"),
                    Ok(()) => kept.push((id, s)),
                }
            }
            (kept, None)
        })
        .await;
        match done {
            Ok((kept, None)) => self.shadows.extend(kept),
            Ok((_, Some(e))) | Err(e) => {
                tracing::warn!(error = %e, generations = ids.len(), "a standby step failed: no longer standing by for them");
            }
        }
    }
}

/// Asks the log to make this decoder generation `id`'s standby (a first claim, or one again).
async fn ask_standby(
    client: &LogClient,
    cfg: &WorkerConfig,
    identity: &pb::ModelIdentity,
    id: u64,
) -> Result<pb::OwnershipResponse, tokenlog_raftlog::client::ClientError> {
    client
        .standby(pb::StandbyRequest {
            generation_id: id,
            decoder_id: cfg.decoder_id.clone(),
            model: Some(identity.clone()),
        })
        .await
}

/// Claims generation `id` in the log and builds its followed state, whose watch task sends on
/// `tx`; `None` when the log gave it to another standby (or it cannot be followed: no prompt ids
/// yet).
async fn claim(
    client: &LogClient,
    cfg: &WorkerConfig,
    model: &Arc<dyn Model>,
    identity: &pb::ModelIdentity,
    id: u64,
    tx: mpsc::UnboundedSender<Followed>,
    wake: Arc<tokio::sync::Notify>,
) -> Result<Option<Shadow>, WorkerError> {
    let r = ask_standby(client, cfg, identity, id).await?;
    let Some(info) = r.generation.filter(|_| r.ok) else {
        return Ok(None);
    };
    let binding: Binding = match info.binding.clone() {
        Some(b) => b.into(),
        None => return Ok(None),
    };
    if binding.prompt_token_ids.is_empty() {
        // The owner has not bound its prompt ids yet: nothing to follow exactly.
        return Ok(None);
    }
    let committed = read_prefix(client, id, info.frontier).await?;
    let from = committed.len() as u32;
    let m = model.clone();
    let state = model_work(move || {
        DecodeState::resume_deferred(
            m.as_ref(),
            &binding.prompt_token_ids,
            &committed,
            binding.sampling,
            binding.stop,
            binding.mode,
        )
    })
    .await
    .map_err(WorkerError::Other)??;
    if state.finished().is_some() {
        return Ok(None);
    }
    let watch = tokio::spawn(watch_records(client.clone(), id, from, tx, wake));
    Ok(Some(Shadow {
        state,
        queue: VecDeque::new(),
        _watch: AbortOnDrop(watch),
    }))
}

/// Watches generation `id`'s committed records from `from` and hands them to the worker, until
/// it ends or cannot be watched for [`STANDBY_WATCH_GIVE_UP`] (then says it ended).
async fn watch_records(
    client: LogClient,
    id: u64,
    from: u32,
    tx: mpsc::UnboundedSender<Followed>,
    wake: Arc<tokio::sync::Notify>,
) {
    let mut next = from;
    let mut health = WatchHealth::default();
    loop {
        match client.watch(id, next).await {
            Ok(mut stream) => {
                health.opened();
                while let Ok(Some(ev)) = stream.message().await {
                    for r in ev.records {
                        if r.seq == next {
                            if tx
                                .send(Followed::Record {
                                    generation: id,
                                    seq: r.seq,
                                    token: r.token_id,
                                })
                                .is_err()
                            {
                                return;
                            }
                            next += 1;
                        }
                    }
                    if ev.terminal.is_some() {
                        let _ = tx.send(Followed::Ended { generation: id });
                        wake.notify_one();
                        return;
                    }
                    wake.notify_one();
                }
            }
            Err(e) => tracing::debug!(generation = id, error = %e, "standby watch failed"),
        }
        if health.broke() {
            let _ = tx.send(Followed::Ended { generation: id });
            wake.notify_one();
            return;
        }
        tokio::time::sleep(crate::limits::PREFIX_READ_RETRY_PAUSE * 4).await;
    }
}

/// When a watch has failed long enough to give up on its generation: [`STANDBY_WATCH_GIVE_UP`]
/// after the first failure with no open stream since. A stream that opened counts as healthy
/// (the node holds the generation and is not cut off: it refuses at open otherwise), though a
/// quiet generation sends nothing on it. Before, only a message counted: a quiet generation
/// whose watch broke twice, 10 s apart, lost a healthy shadow.
#[derive(Default)]
struct WatchHealth {
    failing_since: Option<Instant>,
}

impl WatchHealth {
    fn opened(&mut self) {
        self.failing_since = None;
    }

    /// The stream broke or did not open: whether to give up.
    fn broke(&mut self) -> bool {
        self.failing_since.get_or_insert_with(Instant::now).elapsed() >= STANDBY_WATCH_GIVE_UP
    }
}

#[cfg(test)]
mod tests {
    use super::{WatchHealth, STANDBY_WATCH_GIVE_UP};
    use std::time::Duration;

    /// A watch that broke, opened again and stayed quiet, then broke once more long after is
    /// not given up; one that cannot open for `STANDBY_WATCH_GIVE_UP` is.
    #[tokio::test(start_paused = true)]
    async fn a_quiet_watch_that_reopens_is_never_given_up_and_one_that_cannot_open_is() {
        let mut h = WatchHealth::default();
        assert!(!h.broke());
        h.opened();
        tokio::time::advance(STANDBY_WATCH_GIVE_UP + Duration::from_secs(2)).await;
        assert!(
            !h.broke(),
            "a quiet stream that was open is given up at its first break"
        );
        tokio::time::advance(STANDBY_WATCH_GIVE_UP - Duration::from_millis(1)).await;
        assert!(!h.broke());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(h.broke(), "never open again for the whole time");
    }
}
