//! A stage's fence (issue 16): whether a head's request, stamped with the head's pipeline
//! epoch, may be served.
//!
//! The log is the authority: a pipeline head writes its composition (which stage serves which
//! layers) with `SetPipeline`, and every splice gives it a new epoch. With the log's addresses
//! a stage serves a request only if the head's record in the log is at the request's epoch and
//! names this stage for the layers it holds. It reads the record when it meets an epoch it has
//! not verified, and keeps what it read fresh for the heads it serves (a read every
//! `STAGE_FENCE_REFRESH`, trusted for `STAGE_FENCE_FRESH`), so a pass costs no log read, and a
//! stage that was paused or cut off reads the log again before it serves anything: a stage the
//! head spliced out meanwhile is refused by epoch, whatever it still holds.
//!
//! Without the log (a stage for benches and single-machine tests) a stage refuses epochs older
//! than the newest it saw from a head, which fences stale heads only.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokenlog_raftlog::client::{ClientError, LogClient};
use tonic::{Code, Status};

use crate::limits::{STAGE_FENCE_FRESH, STAGE_FENCE_HEADS_MAX, STAGE_FENCE_REFRESH, STAGE_HEAD_BYTES_MAX};

/// What the stage last learned of one head's composition (nothing yet: epoch 0, no member).
#[derive(Clone, Debug, Default)]
struct Known {
    /// The newest epoch of the head's composition the stage knows.
    epoch: u64,
    /// Whether that composition names this stage for its layers.
    member: bool,
    /// When the log said so (`None`: not from the log, or invalidated).
    verified: Option<Instant>,
    /// Streams of this head the stage serves now (the refresher reads their heads only).
    streams: usize,
}

pub struct Fence {
    log: Option<LogClient>,
    stage_id: String,
    layers: Range<u32>,
    known: Mutex<HashMap<String, Known>>,
}

/// Refused: FAILED_PRECONDITION (fenced), UNAVAILABLE (the log cannot say), INVALID_ARGUMENT.
pub type Refusal = Status;

impl Fence {
    /// `log`: the log's client (`None`: fence by the newest epoch seen only). A stage with a
    /// log spawns its refresher on the current runtime.
    pub fn new(log: Option<LogClient>, stage_id: String, layers: Range<usize>) -> Arc<Self> {
        let f = Arc::new(Fence {
            log,
            stage_id,
            layers: layers.start as u32..layers.end as u32,
            known: Mutex::new(HashMap::new()),
        });
        if f.log.is_some() {
            tokio::spawn(refresh(Arc::downgrade(&f)));
        }
        f
    }

    pub fn with_log(&self) -> bool {
        self.log.is_some()
    }

    /// Whether `head`'s request at pipeline `epoch` may be served now.
    pub async fn admit(&self, head: &str, epoch: u64) -> Result<(), Refusal> {
        if head.is_empty() || epoch == 0 {
            return Err(Status::invalid_argument(
                "a stage request names its pipeline head and the head's pipeline epoch",
            ));
        }
        if head.len() > STAGE_HEAD_BYTES_MAX {
            return Err(Status::invalid_argument(format!(
                "a head name of {} bytes; at most {STAGE_HEAD_BYTES_MAX}",
                head.len()
            )));
        }
        {
            let mut known = self.known.lock().expect("lock");
            self.make_room(&mut known, head)?;
            let k = known.get(head);
            if let Some(k) = k {
                if epoch < k.epoch {
                    return Err(self.stale(head, epoch, k.epoch));
                }
            }
            match (&self.log, k) {
                (None, _) => {
                    let k = known.entry(head.to_string()).or_default();
                    k.epoch = epoch;
                    k.member = true;
                    return Ok(());
                }
                (Some(_), Some(k))
                    if k.epoch == epoch && k.member && k.verified.is_some_and(|t| t.elapsed() < STAGE_FENCE_FRESH) =>
                {
                    return Ok(());
                }
                _ => {}
            }
        }
        // An epoch not verified, or not lately: ask the log (through the leader).
        let log = self.log.as_ref().expect("checked");
        let read_at = Instant::now();
        let record = match log.get_pipeline(head, true).await {
            Ok(p) => Some(p),
            Err(ClientError::Status(s)) if s.code() == Code::NotFound => None,
            Err(e) => {
                return Err(Status::unavailable(format!(
                    "stage {}: the log cannot say whether epoch {epoch} of head {head:?} is current: {e}",
                    self.stage_id
                )))
            }
        };
        let Some(p) = record else {
            self.learn(head, 0, false, read_at);
            return Err(Status::failed_precondition(format!(
                "stage {}: head {head:?} has no pipeline in the log (its registration lapsed, or it never wrote one)",
                self.stage_id
            )));
        };
        let member = p.stages.iter().any(|s| {
            s.stage_id == self.stage_id && s.first_layer == self.layers.start && s.end_layer == self.layers.end
        });
        self.learn(head, p.epoch, member, read_at);
        if epoch < p.epoch {
            return Err(self.stale(head, epoch, p.epoch));
        }
        if epoch > p.epoch {
            return Err(Status::failed_precondition(format!(
                "stage {}: head {head:?} sent pipeline epoch {epoch}, and its composition in the log is at epoch {}",
                self.stage_id, p.epoch
            )));
        }
        if !member {
            return Err(Status::failed_precondition(format!(
                "stage {}: the composition of head {head:?} at pipeline epoch {epoch} does not name this stage for layers {}..{} (fenced)",
                self.stage_id, self.layers.start, self.layers.end
            )));
        }
        Ok(())
    }

    /// Room for `head` in what the fence remembers: with a log, heads without an open stream
    /// are forgotten when it is full (the log still knows them); without one, they are what
    /// fences stale heads, so a new head is refused instead.
    fn make_room(&self, known: &mut HashMap<String, Known>, head: &str) -> Result<(), Refusal> {
        if known.len() < STAGE_FENCE_HEADS_MAX || known.contains_key(head) {
            return Ok(());
        }
        if self.log.is_some() {
            known.retain(|_, k| k.streams > 0);
        }
        if known.len() < STAGE_FENCE_HEADS_MAX {
            return Ok(());
        }
        Err(Status::resource_exhausted(format!(
            "stage {}: it serves {STAGE_FENCE_HEADS_MAX} pipeline heads, its most",
            self.stage_id
        )))
    }

    /// Whether composition `p` names this stage for the layers it holds.
    fn named_by(&self, p: &tokenlog_proto::raftlog::PipelineInfo) -> bool {
        p.stages.iter().any(|s| {
            s.stage_id == self.stage_id && s.first_layer == self.layers.start && s.end_layer == self.layers.end
        })
    }

    fn stale(&self, head: &str, epoch: u64, current: u64) -> Status {
        Status::failed_precondition(format!(
            "stage {}: pipeline epoch {epoch} of head {head:?} is stale: its composition is at epoch {current} (fenced)",
            self.stage_id
        ))
    }

    /// What a read of the log at `read_at` said (never moves the epoch backwards).
    fn learn(&self, head: &str, epoch: u64, member: bool, read_at: Instant) {
        let mut known = self.known.lock().expect("lock");
        if epoch == 0 && !known.contains_key(head) {
            // No record in the log for a head the stage knew nothing of: nothing to remember.
            return;
        }
        let k = known.entry(head.to_string()).or_default();
        if epoch > k.epoch {
            k.epoch = epoch;
            k.member = member;
            k.verified = Some(read_at);
        } else if epoch == k.epoch && epoch > 0 {
            k.member = member;
            k.verified = Some(read_at);
        } else {
            // The record is gone, or older than what the stage saw: verify at the next request.
            k.verified = None;
        }
    }

    /// A stream of `head` begins (the refresher keeps its head's record fresh until it ends).
    pub fn stream_opened(self: &Arc<Self>, head: &str) -> StreamGuard {
        let mut known = self.known.lock().expect("lock");
        known.entry(head.to_string()).or_default().streams += 1;
        StreamGuard {
            fence: self.clone(),
            head: head.to_string(),
        }
    }
}

/// Ends a stream's interest in its head's record.
pub struct StreamGuard {
    fence: Arc<Fence>,
    head: String,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let mut known = self.fence.known.lock().expect("lock");
        if let Some(k) = known.get_mut(&self.head) {
            k.streams = k.streams.saturating_sub(1);
        }
    }
}

/// Reads the record of every head the stage serves, every `STAGE_FENCE_REFRESH`, while the
/// fence lives.
async fn refresh(fence: std::sync::Weak<Fence>) {
    let mut tick = tokio::time::interval(STAGE_FENCE_REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(f) = fence.upgrade() else { return };
        let heads: Vec<String> = {
            let known = f.known.lock().expect("lock");
            known
                .iter()
                .filter(|(_, k)| k.streams > 0)
                .map(|(h, _)| h.clone())
                .collect()
        };
        for head in heads {
            let read_at = Instant::now();
            let log = f.log.as_ref().expect("refreshes with a log only");
            match log.get_pipeline(&head, true).await {
                Ok(p) => f.learn(&head, p.epoch, f.named_by(&p), read_at),
                Err(ClientError::Status(s)) if s.code() == Code::NotFound => f.learn(&head, 0, false, read_at),
                // The log does not answer: what the stage knows goes stale by itself.
                Err(e) => tracing::debug!(head, error = %e, "reading a head's pipeline"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without the log a stage refuses what is older than the newest epoch a head sent, per
    /// head, and a request that names no head or epoch.
    #[tokio::test]
    async fn without_the_log_a_stage_refuses_epochs_older_than_the_newest_seen() {
        let f = Fence::new(None, "s".into(), 0..10);
        assert!(!f.with_log());
        f.admit("h", 2).await.unwrap();
        f.admit("h", 2).await.unwrap();
        let e = f.admit("h", 1).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(
            e.message().contains("epoch 1") && e.message().contains("at epoch 2"),
            "{e:?}"
        );
        f.admit("h", 5).await.unwrap();
        assert_eq!(f.admit("h", 4).await.unwrap_err().code(), Code::FailedPrecondition);
        // Another head's epochs are its own.
        f.admit("other", 1).await.unwrap();
        assert_eq!(f.admit("", 3).await.unwrap_err().code(), Code::InvalidArgument);
        assert_eq!(f.admit("h", 0).await.unwrap_err().code(), Code::InvalidArgument);
    }

    /// What the fence remembers is bounded: a head name past the log's bound on decoder ids is
    /// refused, and so is a new head once it remembers its most (without a log each is what
    /// fences a stale head: none is forgotten); those it knows are still served. Before, every
    /// name was kept, of any length (one request could leave ~64 MiB behind).
    #[tokio::test]
    async fn a_fence_remembers_a_bounded_number_of_heads_of_bounded_names() {
        let f = Fence::new(None, "s".into(), 0..10);
        let long = "h".repeat(STAGE_HEAD_BYTES_MAX + 1);
        assert_eq!(f.admit(&long, 1).await.unwrap_err().code(), Code::InvalidArgument);
        for i in 0..STAGE_FENCE_HEADS_MAX {
            f.admit(&format!("head-{i}"), 1).await.unwrap();
        }
        let e = f.admit("one-more", 1).await.unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        f.admit("head-7", 2).await.unwrap();
        assert_eq!(f.admit("head-7", 1).await.unwrap_err().code(), Code::FailedPrecondition);
        assert_eq!(f.known.lock().unwrap().len(), STAGE_FENCE_HEADS_MAX);
    }
}
