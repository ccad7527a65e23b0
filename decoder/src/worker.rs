//! The lease worker: takes generations bound to this decoder's model from the log, decodes them,
//! and writes their tokens only through epoch-fenced appends (CONTRACT §2, §4).
//!
//! One loop, one step at a time:
//! 1. Now and then: refresh the registration; if below capacity, ask for pending or orphaned
//!    generations of our model and `Acquire` them; read each one's committed prefix, bind a text
//!    prompt if needed, and re-prefill (`DecodeState::resume`, exact or fast per the binding).
//! 2. Sample one token for every active generation (the model work runs on a blocking thread).
//! 3. Absorb the append answers that have arrived: accepted ⇒ `mark_committed`; rejected ⇒ drop
//!    that generation at once (another owner has it, or it ended), except a gap (`SEQ_MISMATCH`,
//!    an earlier append was lost), after which its tokens are re-sent from the acknowledged
//!    frontier.
//! 4. Send this step's new tokens of all generations as one `Append` (one Raft entry) on the
//!    decoder's `AppendStream`, without waiting: up to `APPENDS_IN_FLIGHT_MAX` appends are in
//!    flight while the next steps compute; with the window full, steps go on and their tokens
//!    leave together in the next append. Visibility waits for commit; decoding does not. When
//!    the stream fails, the answers still owed are unknown: a new stream re-sends every
//!    unacknowledged token from the acknowledged frontier, which the log accepts idempotently.
//!
//! A separate renewer keeps leases alive while a step is slow (slow is not dead), and stops
//! renewing a generation the moment it is dropped.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

// tokio's clock: the production clock, and the simulated one under the simulation.
use tokio::time::Instant;

use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::{AppendStream, ClientError, LogClient};

use tokenlog_raftlog::convert::reason_to_pb;
use tokenlog_raftlog::types::Binding;

use crate::cache::CacheCopy;
use crate::history::{Answer, Call, DecoderEvent};
use crate::limits::{
    APPENDS_IN_FLIGHT_MAX, APPEND_ANSWER_TIMEOUT, REGISTER_PERIOD_MIN, REGISTRATION_TTL_LEASES,
    REGISTRATION_TTL_MIN_MS, STREAM_RETRY_PAUSE_MAX, STREAM_RETRY_PAUSE_MIN, TAKES_AT_ONCE_MAX, UNACKED_TOKENS_MAX,
};

const _: () = assert!(UNACKED_TOKENS_MAX <= tokenlog_raftlog::limits::RECORDS_PER_APPEND_MAX);
use crate::resume::DecodeState;
use crate::sampler::StopCause;
use crate::standby::Shadow;
pub use crate::worker_hooks::{Fired, Halt, HandoffPoint, StepHooks, StepView, HALT_EXIT_CODE};
use crate::worker_lease::{read_prefix, renew_loop, session_loop, AbortOnDrop, Held, Lost};
use crate::{Model, ModelIdentity};
use tokio::sync::mpsc;

#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Unique per process incarnation (two processes must never share one).
    pub decoder_id: String,
    /// The name clients use for this model.
    pub model_name: String,
    pub chat_template: String,
    /// Generations decoded at once.
    pub capacity: usize,
    /// Lease asked for on acquire and renewed by every append.
    pub lease_ms: u64,
    /// How often to look for work while below capacity.
    pub poll_ms: u64,
    /// A step loop that makes no progress this long is stuck: the worker ends with
    /// [`WorkerError::Stalled`] (its leases lapse).
    pub stall_ms: u64,
    /// Planted bug (fault builds only; issue 11 bug 1): a worker that fails keeps its renewer
    /// running, so its leases never lapse. The fault suite must catch it.
    #[cfg(feature = "faults")]
    pub plant_zombie: bool,
    /// Planted bug (fault builds only; issue 12): after `PLANT_STALL_AFTER_APPENDS` appends the
    /// step loop waits for ever while the renewer keeps its leases. The watchdog (or, without
    /// it, the fault suite's probes and liveness) must catch it.
    #[cfg(feature = "faults")]
    pub plant_stall: bool,
    /// Planted bug (fault builds only; issue 15): a destination starts decoding a handed-over
    /// generation as soon as it said `receiver_ready`, before the log committed its ownership.
    /// A check of the decoder's history must catch it.
    #[cfg(feature = "faults")]
    pub plant_early_handoff_write: bool,
    /// Planted bug (fault builds only): a handoff destination answers a transfer "committed"
    /// at once, without taking the cache or asking the log (a destination that lies, or an
    /// answer meant for another attempt). The source must not take its word for the move.
    #[cfg(feature = "faults")]
    pub plant_false_commit: bool,
    /// Planted bug (fault builds only; issue 15): a hot standby whose generation's owner died
    /// appends at the epoch it last saw, without acquiring the generation. The log's fence
    /// refuses it; a check of the decoder's history must catch the attempt.
    #[cfg(feature = "faults")]
    pub plant_standby_early_write: bool,
    /// Planted bug (fault builds only; issue 15): a handoff source frees its KV cache once it
    /// exported it, before the log released the generation; an attempt that then does not move
    /// it leaves the source holding a generation without its cache. A check of the source's
    /// `handoff_kept` report (and of its output) must catch it.
    #[cfg(feature = "faults")]
    pub plant_source_frees_early: bool,
    /// Where other decoders reach this one's handoff listener (`host:port`, in its
    /// registration); empty: it takes no handoffs and hands none out.
    pub handoff_addr: String,
    /// On stop, how long (ms) to hand generations to other decoders before releasing the rest
    /// (0: release at once). Needs `handoff_addr`.
    pub drain_ms: u64,
    /// Hot standby: running generations of other decoders to follow at most
    /// ([`crate::standby`]); 0: none.
    pub standby: usize,
    /// Rebalance: every `REBALANCE_EVERY`, hand one generation to the least loaded other
    /// decoder of this model that takes handoffs when this one holds `REBALANCE_SPREAD_MIN` or
    /// more generations than it (loads as the log counts leases). Needs `handoff_addr`.
    pub rebalance: bool,
}

/// Appends a worker with the planted stall sends before its step loop stops.
pub const PLANT_STALL_AFTER_APPENDS: u64 = 30;

impl WorkerConfig {
    pub fn new(decoder_id: String, model_name: String) -> Self {
        WorkerConfig {
            decoder_id,
            model_name,
            chat_template: "chatml".into(),
            capacity: 4,
            lease_ms: tokenlog_raftlog::limits::LEASE_MS_DEFAULT,
            poll_ms: 100,
            stall_ms: crate::limits::STALL_MS_DEFAULT,
            #[cfg(feature = "faults")]
            plant_zombie: false,
            #[cfg(feature = "faults")]
            plant_stall: false,
            #[cfg(feature = "faults")]
            plant_early_handoff_write: false,
            #[cfg(feature = "faults")]
            plant_false_commit: false,
            #[cfg(feature = "faults")]
            plant_standby_early_write: false,
            #[cfg(feature = "faults")]
            plant_source_frees_early: false,
            handoff_addr: String::new(),
            drain_ms: crate::limits::DRAIN_MS_DEFAULT,
            standby: 0,
            rebalance: false,
        }
    }

    /// Whether the planted stall is on.
    fn stalls(&self) -> bool {
        #[cfg(feature = "faults")]
        return self.plant_stall;
        #[cfg(not(feature = "faults"))]
        false
    }

    /// Whether the planted bug `early-handoff-write` is on.
    pub fn early_handoff_write(&self) -> bool {
        #[cfg(feature = "faults")]
        return self.plant_early_handoff_write;
        #[cfg(not(feature = "faults"))]
        false
    }

    /// Whether the planted bug `false-commit` is on.
    pub fn false_commit(&self) -> bool {
        #[cfg(feature = "faults")]
        return self.plant_false_commit;
        #[cfg(not(feature = "faults"))]
        false
    }

    /// Whether the planted bug `standby-early-write` is on.
    pub fn standby_early_write(&self) -> bool {
        #[cfg(feature = "faults")]
        return self.plant_standby_early_write;
        #[cfg(not(feature = "faults"))]
        false
    }

    /// Whether the planted bug `source-frees-early` is on.
    pub fn source_frees_early(&self) -> bool {
        #[cfg(feature = "faults")]
        return self.plant_source_frees_early;
        #[cfg(not(feature = "faults"))]
        false
    }

    /// Whether the planted bug `zombie` is on.
    pub fn zombie(&self) -> bool {
        #[cfg(feature = "faults")]
        return self.plant_zombie;
        #[cfg(not(feature = "faults"))]
        false
    }
}

/// Counters a worker exposes (metrics and tests).
#[derive(Debug, Default, Clone)]
pub struct WorkerStats {
    pub acquired: u64,
    pub takeovers: u64,
    pub tokens_committed: u64,
    pub fence_rejections: u64,
    pub finished: u64,
    pub failed: u64,
    /// Generations taken and released again because the log could not be read for now.
    pub released: u64,
    /// Generations handed to another decoder with their cache (planned handoff).
    pub handed_out: u64,
    /// Generations received from another decoder with their cache.
    pub received: u64,
    /// Planned handoffs that did not move the generation (it stayed here).
    pub handoffs_kept: u64,
    /// Generations taken over from a hot standby's followed state (no re-prefill).
    pub standby_takeovers: u64,
    /// Generations followed as a hot standby now.
    pub standing_by: u64,
    /// Generations restored from the prefix cache (the rest prefilled) instead of prefilled cold.
    pub prefix_restores: u64,
    /// The log accepted this decoder's last registration (its readiness: `tokenlog decoder`'s
    /// /readyz and grpc.health.v1).
    pub registered: bool,
}

/// One generation this worker owns.
struct Active {
    id: u64,
    epoch: u64,
    state: DecodeState,
    /// Committed records (our view; equals the log's after each accepted append).
    committed: u32,
    /// Sampled tokens past `committed`, in order, until acknowledged.
    uncommitted: Vec<u32>,
    /// How many of `uncommitted` went out on the current stream (their answers are pending).
    sent: usize,
    /// Whether `finish` went out on the current stream.
    finish_sent: bool,
    finish: Option<StopCause>,
    /// To be handed to another decoder: no sampling until every token is acked; then its cache
    /// is copied and it decodes on.
    moving: bool,
    /// A copy of its cache is on its way to another decoder (a handoff attempt is in flight):
    /// it decodes on, and leaves when the log commits it to the destination.
    out: bool,
    /// While `out`: the rows of the positions it feeds past the copy, streamed to the
    /// destination.
    rows_out: Option<crate::handoff::RowsOut>,
    /// Prompt and committed prefix to store in the prefix cache once prefilled.
    store_prefix: Option<Vec<u32>>,
    /// Planted bug `source-frees-early` struck: its cache was freed once copied. It samples
    /// nothing while its handoff is out (the freed cache would end the process at its next
    /// step, before the attempt reached the log, on a slow machine), so the attempt always
    /// reaches the log and an abort finds the source without its cache.
    cache_freed: bool,
}

impl Active {
    fn new(id: u64, epoch: u64, committed: u32, state: DecodeState) -> Self {
        let finish = state.finished().cloned();
        Active {
            id,
            epoch,
            state,
            committed,
            uncommitted: Vec::new(),
            sent: 0,
            finish_sent: false,
            finish,
            moving: false,
            out: false,
            rows_out: None,
            store_prefix: None,
            cache_freed: false,
        }
    }

    /// Ready to leave for another decoder: moving, unfinished, and either its cache can be
    /// copied while it decodes ([`DecodeState::copies_while_decoding`]) or every sampled token
    /// is committed.
    fn ready_to_move(&self) -> bool {
        self.moving && self.finish.is_none() && (self.uncommitted.is_empty() || self.state.copies_while_decoding())
    }

    /// Tokens sampled so far (committed or not): the seq of the next draw.
    fn sampled(&self) -> u32 {
        self.committed + self.uncommitted.len() as u32
    }

    /// The next append item: the tokens not yet sent on this stream (and the finish once every
    /// token is in), or `None` when there is nothing new.
    fn next_item(&mut self) -> Option<pb::AppendItem> {
        if !self.has_unsent() {
            return None;
        }
        let (finish, detail) = self
            .finish
            .as_ref()
            .map_or((pb::FinishReason::Unspecified, String::new()), finish_to_pb);
        let item = pb::AppendItem {
            generation_id: self.id,
            epoch: self.epoch,
            start_seq: self.committed + self.sent as u32,
            token_ids: self.uncommitted[self.sent..].to_vec(),
            finish: finish as i32,
            finish_detail: detail,
        };
        self.sent = self.uncommitted.len();
        self.finish_sent = self.finish.is_some();
        Some(item)
    }

    /// Whether tokens, or the finish, have not gone out on this stream yet.
    fn has_unsent(&self) -> bool {
        self.sent < self.uncommitted.len() || (self.finish.is_some() && !self.finish_sent)
    }

    /// Forget what went out on the stream: the next item starts at the acknowledged frontier.
    fn resend_all(&mut self) {
        self.sent = 0;
        self.finish_sent = false;
    }

    /// Whether it can sample another token now.
    fn can_sample(&self) -> bool {
        (!self.moving || self.state.copies_while_decoding())
            && !(self.cache_freed && self.out)
            && self.finish.is_none()
            && self.uncommitted.len() < UNACKED_TOKENS_MAX
    }
}

/// One item of an append on the stream, waiting for its answer: the generation, the epoch it
/// was written at, whether it carried the finish, and its history id.
struct SentItem {
    generation: u64,
    epoch: u64,
    finish: bool,
    history_id: Option<u64>,
}

/// A model identity in the log's wire form (what bindings, acquires and registrations carry).
pub fn identity_to_pb(m: &ModelIdentity) -> pb::ModelIdentity {
    m.clone().into()
}

/// A stop cause as an append item's finish: the log's reason and the detail clients see.
fn finish_to_pb(f: &StopCause) -> (pb::FinishReason, String) {
    (reason_to_pb(Some(f.reason())), finish_detail(f.to_string()))
}

/// A finish detail the log takes: at most `FINISH_DETAIL_BYTES_MAX` bytes, cut at a character
/// with an ellipsis. A longer one (a model error with its whole context, a stage's refusal)
/// got the whole item refused, tokens included, and the generation dropped as if lost, to be
/// taken again and fail the same way, for ever.
pub(crate) fn finish_detail(mut d: String) -> String {
    use tokenlog_raftlog::limits::FINISH_DETAIL_BYTES_MAX;
    if d.len() > FINISH_DETAIL_BYTES_MAX {
        let room = FINISH_DETAIL_BYTES_MAX - '…'.len_utf8();
        let cut = (0..=room).rev().find(|&i| d.is_char_boundary(i)).unwrap_or(0);
        d.truncate(cut);
        d.push('…');
    }
    d
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("log: {0}")]
    Log(#[from] ClientError),
    #[error("model: {0}")]
    Model(#[from] crate::Error),
    #[error("{0}")]
    Other(String),
    /// This decoder cannot serve the generation, wherever the log is (contract §5): the
    /// generation is failed explicitly rather than released to fail again elsewhere.
    #[error("{0}")]
    Incompatible(String),
    /// A [`StepHooks`] stopped the worker (a test failpoint): nothing was released, as after a
    /// kill.
    #[error("halted by failpoint {0}")]
    Halted(&'static str),
    /// The step loop made no progress for the stall limit (`WorkerConfig::stall_ms`).
    #[error("the worker is stuck: {0}")]
    Stalled(String),
}

pub struct Worker {
    cfg: WorkerConfig,
    client: LogClient,
    model: Arc<dyn Model>,
    identity: pb::ModelIdentity,
    active: BTreeMap<u64, Active>,
    /// The decoder's `AppendStream` to the leader, opened when there is something to send.
    stream: Option<AppendStream>,
    /// Streams that failed since the last answer, and when the next may open: a node that
    /// takes a stream and fails every append at once (its Raft stopped) is not hammered.
    stream_failures: u32,
    stream_retry_at: Option<Instant>,
    /// Appends sent on `stream` and not yet answered, oldest first.
    in_flight: VecDeque<Vec<SentItem>>,
    held: Held,
    /// Generations whose renewal the log rejected (filled by the renewer).
    lost: Lost,
    stats: Arc<Mutex<WorkerStats>>,
    history: Option<Arc<crate::history::History>>,
    hooks: Option<Arc<dyn StepHooks>>,
    /// Milliseconds since `origin` when the step loop last went round (the stall watchdog's).
    beat: Arc<std::sync::atomic::AtomicU64>,
    origin: Instant,
    appends_sent: u64,
    /// A session with the leader is open now (`worker_lease::session_loop`).
    session_open: Arc<std::sync::atomic::AtomicBool>,
    /// Tells the session loop to open a new session: the registration had lapsed, and the log
    /// drops a lapsed decoder's session with it while its stream stays open.
    session_renew: Arc<tokio::sync::Notify>,
    /// The log time the last registration lives to (0: none answered yet).
    registered_until: Arc<std::sync::atomic::AtomicU64>,
    /// The model's tokenizer is in the log (published, or refused for good): gateways need it.
    tokenizer_published: bool,
    /// The registration on its way (each waits for the one before: they land in order).
    registering: Option<tokio::task::JoinHandle<()>>,
    /// Whether a registration went out yet (the first one is awaited).
    registered_once: bool,
    /// What this worker shares with its handoff listener.
    port: Arc<crate::handoff::PortShared>,
    incoming: mpsc::UnboundedReceiver<crate::handoff::Received>,
    /// Handoffs out that have ended: the generation, its epoch and committed count, the outcome.
    outcomes_tx: mpsc::UnboundedSender<(u64, u64, crate::handoff::Outcome)>,
    /// Generations back from the copy of their cache for a handoff (id, epoch, the state and
    /// the copy, or why the model failed).
    copies_tx: mpsc::UnboundedSender<Copied>,
    copies: mpsc::UnboundedReceiver<Copied>,
    /// Generations away while their cache is copied (counted in `handing_out` too).
    copying: usize,
    outcomes: mpsc::UnboundedReceiver<(u64, u64, crate::handoff::Outcome)>,
    /// Handoffs out in progress.
    handing_out: usize,
    /// Wakes the idle loop: a generation arrived, or a handoff out ended.
    wake: Arc<tokio::sync::Notify>,
    /// Draining (stopping with handoffs): until when.
    drain_until: Option<Instant>,
    /// Generations a drain tried to hand over and kept for good (no decoder takes handoffs, the
    /// cache could not be sent): not tried again, released at its end.
    drain_kept: std::collections::BTreeSet<u64>,
    /// Generations a drain tried to hand over that a destination refused or failed (full,
    /// unreachable): tried again from the instant given, until the drain's time is up. They
    /// were kept for good: a drain whose destinations were full for a moment ended at once and
    /// released them for a re-prefill, though a slot freed a second later.
    drain_retry: HashMap<u64, Instant>,
    /// Where a generation marked to move must go (a rebalancing move); absent: any decoder.
    move_to: HashMap<u64, String>,
    /// When the rebalancer looks next.
    next_rebalance: Instant,
    /// Stopping (`stop` was seen): registrations from here on name no handoff listener.
    stopping: bool,
    /// The stopping registration (without the handoff listener) went out.
    drain_registered: bool,
    /// Generations of other decoders this one follows as a hot standby (`cfg.standby`).
    standbys: crate::standby::Standbys,
    /// The KV prefix cache (`--prefix-cache`), shared with the takes.
    prefix_cache: Option<SharedPrefixCache>,
}

/// A worker's prefix cache, shared by its step loop and its takes.
pub type SharedPrefixCache = Arc<Mutex<crate::prefix_cache::PrefixCache>>;

impl WorkerError {
    /// Whether a failure to take a generation says it cannot be served (a model error, a bad
    /// binding, a panic while re-prefilling: ended FAILED) rather than that the log could not
    /// be reached or read for now (released, for this or another decoder to take again).
    pub fn is_incompatibility(&self) -> bool {
        matches!(self, WorkerError::Model(_) | WorkerError::Incompatible(_))
    }
}

impl Worker {
    /// Installs step hooks (the fault suite's failpoints).
    pub fn with_hooks(mut self, h: Arc<dyn StepHooks>) -> Self {
        Arc::get_mut(&mut self.port)
            .expect("with_hooks is called before the handoff port is taken")
            .hooks = Some(h.clone());
        self.hooks = Some(h);
        self
    }

    /// Restores takes and new generations from `cache` where it holds a prefix of their token
    /// ids, and stores every prompt this worker prefills in it.
    pub fn with_prefix_cache(mut self, cache: SharedPrefixCache) -> Self {
        self.prefix_cache = Some(cache);
        self
    }

    /// Records every acquire and append (with times and answers) as JSON lines in `h`.
    pub fn with_history(mut self, h: crate::history::History) -> Self {
        let h = Arc::new(h);
        Arc::get_mut(&mut self.port)
            .expect("with_history is called before the handoff port is taken")
            .history = Some(h.clone());
        self.history = Some(h);
        self
    }

    pub fn new(cfg: WorkerConfig, client: LogClient, model: Arc<dyn Model>) -> Self {
        let identity = identity_to_pb(model.identity());
        let (incoming_tx, incoming) = mpsc::unbounded_channel();
        let (outcomes_tx, outcomes) = mpsc::unbounded_channel();
        let (copies_tx, copies) = mpsc::unbounded_channel();
        let held: Held = Default::default();
        let cache_format = model.new_sequence().ok().and_then(|s| s.cache_format());
        let port = Arc::new(crate::handoff::PortShared {
            decoder_id: cfg.decoder_id.clone(),
            model: model.clone(),
            identity: identity.clone(),
            cache_format,
            client: client.clone(),
            lease_ms: cfg.lease_ms,
            capacity: cfg.capacity,
            slots: crate::handoff::Slots::new(cfg.capacity),
            accepting: std::sync::atomic::AtomicBool::new(true),
            incoming: incoming_tx,
            held: held.clone(),
            history: None,
            hooks: None,
            plant_early_write: cfg.early_handoff_write(),
            plant_false_commit: cfg.false_commit(),
            wake: Default::default(),
            rows_in: Default::default(),
        });
        Worker {
            cfg,
            client,
            model,
            identity,
            active: BTreeMap::new(),
            stream: None,
            stream_failures: 0,
            stream_retry_at: None,
            in_flight: VecDeque::new(),
            held,
            lost: Default::default(),
            stats: Default::default(),
            history: None,
            hooks: None,
            beat: Default::default(),
            origin: Instant::now(),
            appends_sent: 0,
            tokenizer_published: false,
            registering: None,
            registered_once: false,
            session_open: Default::default(),
            session_renew: Default::default(),
            registered_until: Default::default(),
            wake: port.wake.clone(),
            standbys: crate::standby::Standbys::new(port.wake.clone()),
            prefix_cache: None,
            port,
            incoming,
            outcomes_tx,
            copies_tx,
            copies,
            copying: 0,
            outcomes,
            handing_out: 0,
            drain_until: None,
            drain_kept: Default::default(),
            drain_retry: Default::default(),
            move_to: HashMap::new(),
            next_rebalance: Instant::now() + crate::limits::REBALANCE_EVERY,
            stopping: false,
            drain_registered: false,
        }
    }

    /// The `decoder.v1.Handoff` service that receives generations for this worker (serve it on
    /// the listener `WorkerConfig::handoff_addr` names).
    pub fn handoff_port(&self) -> crate::handoff::HandoffPort {
        crate::handoff::HandoffPort {
            shared: self.port.clone(),
        }
    }

    /// Marks generation `id` to be handed to another decoder (the drain; a rebalancer later): it
    /// stops sampling and leaves once its tokens are committed. Nothing when it is not held here
    /// or this worker has no handoff listener.
    fn request_move(&mut self, id: u64) {
        if let (false, Some(g)) = (self.cfg.handoff_addr.is_empty(), self.active.get_mut(&id)) {
            g.moving = true;
        }
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.cfg
    }

    pub fn stats(&self) -> Arc<Mutex<WorkerStats>> {
        self.stats.clone()
    }

    /// Runs until `stop` turns true; then waits for the appends in flight and releases every
    /// generation it holds.
    pub async fn run(mut self, stop: tokio::sync::watch::Receiver<bool>) -> Result<(), WorkerError> {
        let renewer = AbortOnDrop(tokio::spawn(renew_loop(
            self.client.clone(),
            self.cfg.clone(),
            self.held.clone(),
            self.lost.clone(),
        )));
        let session = AbortOnDrop(tokio::spawn(session_loop(
            self.client.clone(),
            self.cfg.decoder_id.clone(),
            self.session_open.clone(),
            self.session_renew.clone(),
            self.history.clone(),
        )));
        let stall = Duration::from_millis(self.cfg.stall_ms.max(crate::limits::STALL_MS_MIN));
        let watchdog = stall_watch(self.beat.clone(), self.origin, stall);
        let result = tokio::select! {
            biased;
            r = self.serve(stop) => r,
            why = watchdog => {
                tracing::error!(why, "the worker is stuck: ending it, so that its leases lapse");
                Err(WorkerError::Stalled(why))
            }
        };
        // No transfer is taken in from here on, whatever ended the worker.
        self.port.accepting.store(false, std::sync::atomic::Ordering::Release);
        match &result {
            Ok(()) => {
                // Renewing until the end: handoffs still running need their leases.
                self.release_all().await;
                drop(renewer);
            }
            // Planted bug `zombie`: a worker that failed on its own keeps renewing its leases
            // (and keeps its session open, which would otherwise end them).
            Err(e) if self.cfg.zombie() && !matches!(e, WorkerError::Halted(_)) => {
                std::mem::forget(renewer);
                std::mem::forget(session);
            }
            // Every other exit drops the renewer here: its leases lapse (and the session's end
            // ends them at once).
            Err(_) => {}
        }
        result
    }

    /// The step loop of [`Worker::run`], until `stop` turns true (then the appends in flight are
    /// awaited) or the worker fails.
    async fn serve(&mut self, mut stop: tokio::sync::watch::Receiver<bool>) -> Result<(), WorkerError> {
        // Due at once (an `Instant` an hour back would not exist on a machine up for less).
        let mut last_poll: Option<Instant> = None;
        let mut last_register: Option<Instant> = None;
        let due = |last: Option<Instant>, period: Duration| last.is_none_or(|t| t.elapsed() >= period);
        loop {
            if *stop.borrow() && !self.keep_draining() {
                break;
            }
            self.beat.store(
                self.origin.elapsed().as_millis() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            if self.cfg.stalls() && self.appends_sent >= PLANT_STALL_AFTER_APPENDS {
                tracing::error!("PLANTED BUG: the step loop stalls for ever (its leases are still renewed)");
                std::future::pending::<()>().await;
            }
            // A drain that just began registers at once, without its handoff listener: other
            // decoders stop choosing it as a destination.
            let drain_began = self.stopping && !self.drain_registered;
            if drain_began || due(last_register, self.register_period()) {
                self.drain_registered = self.stopping;
                self.register().await;
                last_register = Some(Instant::now());
            }
            // Work is taken once the session is open (a crash from then on is found at once),
            // or after a while without one.
            let session_ready = self.session_open.load(std::sync::atomic::Ordering::Acquire)
                || self.origin.elapsed() >= crate::limits::SESSION_WAIT_MAX;
            if session_ready
                && self.drain_until.is_none()
                && self.load() < self.cfg.capacity
                && due(last_poll, Duration::from_millis(self.cfg.poll_ms))
            {
                self.take_work().await;
                last_poll = Some(Instant::now());
            }
            // A decoder with no free slot could not take a followed generation over (its
            // priority would only delay another decoder's takeover): it claims none.
            if session_ready && !self.stopping && self.load() < self.cfg.capacity && self.standbys.poll_due(&self.cfg) {
                let skip: std::collections::HashSet<u64> = self
                    .active
                    .keys()
                    .chain(self.held.lock().expect("lock").keys())
                    .copied()
                    .collect();
                self.standbys
                    .poll(&self.client, &self.cfg, &self.model, &self.identity, |id| {
                        skip.contains(&id)
                    })
                    .await;
            }
            self.standbys.absorb();
            if self.standbys.has_work() {
                self.standbys.step(&self.model).await;
            }
            self.stats.lock().expect("lock").standing_by = self.standbys.len() as u64;
            if session_ready && self.rebalance_due() {
                self.rebalance().await;
            }
            self.absorb_handoffs();
            self.drop_lost();
            self.start_handoffs();
            self.settle_moving().await;
            if let Some(fired) = self.sample_ready().await? {
                return self.halt(fired).await;
            }
            let sampling = self.active.values().any(Active::can_sample);
            if sampling {
                let began = Instant::now();
                self.step().await?;
                if let Some(min) = self.hooks.as_ref().and_then(|h| h.min_step()) {
                    tokio::time::sleep(min.saturating_sub(began.elapsed())).await;
                }
                // A step may be slow: a renewal rejected meanwhile stops the generation before
                // anything more is sent for it.
                self.drop_lost();
                if let Some(fired) = self.hooks.as_ref().and_then(|h| h.after_sample(&self.views())) {
                    return self.halt(fired).await;
                }
            }
            // Wait for an answer only when there is nothing to compute. With the window full,
            // sampling goes on (up to `UNACKED_TOKENS_MAX` tokens of a generation ahead of the
            // log) and the tokens sampled meanwhile go out as one append when a slot frees: a
            // slow log gets fewer, larger appends instead of stalling the model.
            self.collect(!sampling).await;
            if let Some(fired) = self.hooks.as_ref().and_then(|h| h.before_send(&self.views())) {
                return self.halt(fired).await;
            }
            let sent = self.in_flight.len() < APPENDS_IN_FLIGHT_MAX && self.send().await;
            self.port.slots.hold(self.active.len() + self.copying);
            if !sent && !sampling && self.in_flight.is_empty() && !self.standbys.has_work() {
                // Idle, or the log is unreachable: do not spin. An arriving generation or an
                // ended handoff wakes it at once.
                let wake = self.wake.clone();
                tokio::select! {
                    biased;
                    _ = stop.changed() => {}
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep(Duration::from_millis(self.cfg.poll_ms)) => {}
                }
            }
        }
        while !self.in_flight.is_empty() && self.stream.is_some() {
            self.collect(true).await;
        }
        // Stopping with nothing to drain (no generation held): the loop ended before the
        // registration without the listener went out. It goes out now, so that no decoder picks
        // this one as a destination until its registration lapses.
        if self.stopping && !self.drain_registered && !self.cfg.handoff_addr.is_empty() {
            self.drain_registered = true;
            self.register().await;
        }
        // The last registration (without the listener, when stopping) is out before the end.
        if let Some(last) = self.registering.take() {
            if tokio::time::timeout(crate::limits::STOP_REGISTER_TIMEOUT, last)
                .await
                .is_err()
            {
                tracing::warn!("the log did not take the stopping registration in time: other decoders may still offer handoffs here until it lapses");
            }
        }
        Ok(())
    }

    /// Generations held or on their way: active (those being handed out included), or being
    /// received (and not yet taken in).
    fn load(&self) -> usize {
        self.active.len() + self.copying + self.port.slots.reserved()
    }

    /// Called while `stop` is set: whether to keep going to hand generations out. The first
    /// call starts the drain (when this decoder hands out at all): every generation is marked
    /// to move, new transfers are refused. Draining ends when nothing is left or its time is up
    /// (what is left is then released). Transfers under way count as left: the generation they
    /// bring is handed on with its cache once it arrives. (They did not: a decoder stopped
    /// while it received its only generation drained nothing, and released what arrived.)
    fn keep_draining(&mut self) -> bool {
        let until = match self.drain_until {
            Some(t) => t,
            None => {
                self.port.accepting.store(false, std::sync::atomic::Ordering::Release);
                self.stopping = true;
                // A transfer under way (its slot reserved) is a generation to hand on once it
                // arrives, not nothing to drain.
                let receiving = self.port.slots.reserved();
                if self.cfg.handoff_addr.is_empty()
                    || self.cfg.drain_ms == 0
                    || self.active.is_empty() && receiving == 0
                {
                    return false;
                }
                let t = Instant::now() + Duration::from_millis(self.cfg.drain_ms);
                self.drain_until = Some(t);
                tracing::info!(
                    generations = self.active.len(),
                    drain_ms = self.cfg.drain_ms,
                    "draining: handing generations to other decoders"
                );
                t
            }
        };
        // A few at a time: the others keep decoding meanwhile (each client's pause is its own
        // generation's handoff only).
        let moving = self.active.values().filter(|g| g.moving || g.out).count() + self.copying;
        let now = Instant::now();
        let next: Vec<u64> = self
            .active
            .values()
            .filter(|g| !g.moving && !g.out && !self.drain_kept.contains(&g.id) && g.finish.is_none())
            .filter(|g| self.drain_retry.get(&g.id).is_none_or(|at| now >= *at))
            .map(|g| g.id)
            .take(crate::limits::HANDOFFS_AT_ONCE_MAX.saturating_sub(moving))
            .collect();
        for id in next {
            self.drain_retry.remove(&id);
            self.request_move(id);
        }
        let left = self
            .active
            .values()
            .filter(|g| !self.drain_kept.contains(&g.id))
            .count()
            + self.copying
            + self.port.slots.reserved();
        if left == 0 {
            tracing::info!("drained");
            return false;
        }
        if Instant::now() >= until {
            tracing::warn!(left, "drain time is up: releasing what is left");
            return false;
        }
        true
    }

    /// Whether the rebalancer looks now: it is on, this decoder takes handoffs and is not
    /// stopping, no handoff of its own is under way, and its time came.
    fn rebalance_due(&self) -> bool {
        self.cfg.rebalance
            && !self.cfg.handoff_addr.is_empty()
            && !self.stopping
            && self.handing_out == 0
            && !self.active.values().any(|g| g.moving)
            && Instant::now() >= self.next_rebalance
    }

    /// One rebalancing round: when this decoder holds `REBALANCE_SPREAD_MIN` or more
    /// generations than the least loaded other decoder of its model that takes handoffs, its
    /// youngest generation (the fewest records: the most left to decode, as far as it knows)
    /// is marked to move there.
    async fn rebalance(&mut self) {
        self.next_rebalance = Instant::now() + crate::limits::REBALANCE_EVERY;
        let Ok(models) = self.client.list_models().await else {
            return;
        };
        let Some(m) = models
            .models
            .iter()
            .find(|m| m.identity.as_ref() == Some(&self.identity))
        else {
            return;
        };
        let Some((dest, theirs)) = m
            .handoff_addrs
            .keys()
            .filter(|d| **d != self.cfg.decoder_id)
            .map(|d| (d, m.held.get(d).copied().unwrap_or(0)))
            .min_by_key(|&(d, held)| (held, d))
        else {
            return;
        };
        let mine = self.active.values().filter(|g| g.finish.is_none()).count() as u32;
        if mine < theirs + crate::limits::REBALANCE_SPREAD_MIN {
            return;
        }
        let Some(id) = self
            .active
            .values()
            .filter(|g| g.finish.is_none() && !g.out && !self.drain_kept.contains(&g.id))
            .min_by_key(|g| (g.committed, g.id))
            .map(|g| g.id)
        else {
            return;
        };
        tracing::info!(
            generation = id,
            to = %dest,
            mine,
            theirs,
            "rebalancing: handing a generation to a less loaded decoder"
        );
        self.move_to.insert(id, dest.clone());
        self.request_move(id);
    }

    /// Starts a handoff for every generation ready to move, up to `HANDOFFS_AT_ONCE_MAX`: copies
    /// its cache and [`Worker::copied`] sends the copy on its way while the generation decodes
    /// on here. The log's commit fences this decoder at whatever frontier it reached, and the
    /// destination follows the records past the copy's. On a grouping-invariant model the copy
    /// is of the committed positions but the last, taken here between two steps without a
    /// model call, so the generation never pauses; on any other, once every sampled token is
    /// committed, the last one is fed and the copy is taken on a blocking thread while the
    /// others step (its client's pause is that copy).
    fn start_handoffs(&mut self) {
        if self.handing_out >= crate::limits::HANDOFFS_AT_ONCE_MAX {
            return;
        }
        let ready: Vec<u64> = self
            .active
            .values()
            .filter(|g| g.ready_to_move())
            .map(|g| g.id)
            .take(crate::limits::HANDOFFS_AT_ONCE_MAX - self.handing_out)
            .collect();
        let forget = self.cfg.source_frees_early();
        for id in ready {
            let g = self.active.get_mut(&id).expect("listed above");
            if g.state.copies_while_decoding() {
                // Its committed prefix, taken here between two steps (the CPU engine shares its
                // cache's chunks; the blocks are built beside the checksum; no model call): it
                // never stops decoding.
                let began = Instant::now();
                let cache = g.state.snapshot_committed_cache();
                tracing::info!(
                    generation = id,
                    committed = g.committed,
                    positions = cache.as_ref().map_or(0, |c| c.positions),
                    copy_ms = began.elapsed().as_millis() as u64,
                    "cache copied for a handoff while it decodes"
                );
                if forget && cache.is_ok() {
                    plant_forget_cache(g);
                }
                let epoch = g.epoch;
                let g = self.active.remove(&id).expect("listed above");
                self.handing_out += 1;
                self.copying += 1;
                self.copied(id, epoch, Ok((g, cache)));
                continue;
            }
            // Away while its cache is copied (on a blocking thread, beside the others' steps).
            let mut g = self.active.remove(&id).expect("listed above");
            let epoch = g.epoch;
            self.handing_out += 1;
            self.copying += 1;
            let (tx, wake) = (self.copies_tx.clone(), self.wake.clone());
            let since_sample = Instant::now();
            tokio::spawn(async move {
                let copied = model_work(move || {
                    let began = Instant::now();
                    let cache = g.state.export_cache().map(CacheCopy::from);
                    tracing::info!(
                        generation = g.id,
                        wait_ms = (began - since_sample).as_millis() as u64,
                        copy_ms = began.elapsed().as_millis() as u64,
                        "cache copied for a handoff"
                    );
                    if forget && cache.is_ok() {
                        plant_forget_cache(&mut g);
                    }
                    (g, cache)
                })
                .await;
                let _ = tx.send((id, epoch, copied));
                wake.notify_one();
            });
        }
    }

    /// A generation back from the copy of its cache: decodes on here, and the copy goes on its
    /// way to another decoder.
    fn copied(&mut self, id: u64, epoch: u64, copied: Result<(Active, crate::Result<CacheCopy>), String>) {
        self.copying -= 1;
        let (mut g, cache) = match copied {
            Ok(c) => c,
            Err(why) => {
                // The state went down with the model: nothing to decode it with here.
                self.handing_out -= 1;
                tracing::error!(generation = id, why, "copying the cache failed: releasing it");
                // Its slot is free at once, and only this epoch's lease goes (as in
                // `drop_generation`; it removed any, and the slot stayed taken for a step).
                self.forget_lease(id, epoch);
                self.port.slots.hold(self.active.len() + self.copying);
                let (client, history) = (self.client.clone(), self.history.clone());
                tokio::spawn(async move { release(&client, history.as_deref(), id, epoch).await });
                return;
            }
        };
        g.moving = false;
        let cache = match cache {
            Ok(c) => c,
            Err(e) => {
                self.handing_out -= 1;
                self.active.insert(id, g);
                self.kept(id, format!("no cache to hand over: {e}"), false);
                return;
            }
        };
        g.out = true;
        let committed = g.committed;
        // The rows it feeds past the copy go to the destination, where its model gives them.
        let rows = g.state.gives_rows().then(|| {
            let (rows_out, feed) = crate::handoff::RowsOut::new(cache.positions as usize);
            g.rows_out = Some(rows_out);
            g.state.keep_logits(true);
            stream_rows(&mut g);
            feed
        });
        self.active.insert(id, g);
        let source = crate::handoff::Source {
            decoder_id: self.cfg.decoder_id.clone(),
            identity: self.identity.clone(),
            client: self.client.clone(),
            history: self.history.clone(),
            hooks: self.hooks.clone(),
        };
        let to = self.move_to.remove(&id);
        let (tx, wake) = (self.outcomes_tx.clone(), self.wake.clone());
        tokio::spawn(async move {
            let outcome = source.hand_out(id, epoch, committed, cache, to, rows).await;
            let _ = tx.send((id, epoch, outcome));
            wake.notify_one();
        });
    }

    /// A generation to be moved stays here (`why`): says so in the history, with what its
    /// state's cache holds; a drain tries it again after `DRAIN_RETRY_PAUSE` when `again` (a
    /// destination refused or failed), else not; a rebalancer waits.
    fn kept(&mut self, id: u64, why: String, again: bool) {
        tracing::warn!(generation = id, why, again, "handoff did not happen: decoding it here");
        self.stats.lock().expect("lock").handoffs_kept += 1;
        if self.drain_until.is_some() {
            if again {
                self.drain_retry
                    .insert(id, Instant::now() + crate::limits::DRAIN_RETRY_PAUSE);
            } else {
                self.drain_kept.insert(id);
            }
        } else {
            self.next_rebalance = Instant::now() + crate::limits::REBALANCE_BACKOFF;
        }
        let Some(g) = self.active.get_mut(&id) else {
            return;
        };
        g.out = false;
        g.rows_out = None;
        g.state.keep_logits(false);
        if let Some(h) = &self.history {
            h.event(crate::history::DecoderEvent::HandoffKept {
                gen: id,
                epoch: g.epoch,
                committed: g.committed,
                kv: g.state.covered_positions() as u32,
                detail: why,
            });
        }
    }

    /// When a generation to be moved only waits for its last answers, waits for them (up to
    /// `MOVE_SETTLE_MAX`; they take a few ms) and starts its handoff, instead of making it wait
    /// for a whole step of the others: its client's pause is the handoff alone.
    async fn settle_moving(&mut self) {
        let waiting = |w: &Self| {
            w.active
                .values()
                .any(|g| g.moving && g.finish.is_none() && !g.ready_to_move())
        };
        if !waiting(self) {
            return;
        }
        if self.in_flight.len() < APPENDS_IN_FLIGHT_MAX {
            self.send().await;
        }
        let deadline = Instant::now() + crate::limits::MOVE_SETTLE_MAX;
        while waiting(self) && !self.in_flight.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(stream) = self.stream.as_mut() else {
                break;
            };
            if left.is_zero() {
                break;
            }
            // Cancel-safe: an answer not yet received stays queued for `collect`.
            match tokio::time::timeout(left, stream.answer()).await {
                Err(_) => break,
                Ok(Ok(resp)) => self.take_answer(resp),
                Ok(Err(e)) => {
                    self.close_stream(&e.to_string());
                    break;
                }
            }
        }
        self.start_handoffs();
    }

    /// Takes in generations received from other decoders and the outcomes of handoffs out.
    fn absorb_handoffs(&mut self) {
        use crate::handoff::Outcome;
        while let Ok(r) = self.incoming.try_recv() {
            tracing::info!(
                generation = r.id,
                epoch = r.epoch,
                frontier = r.committed,
                "received generation joins the step loop"
            );
            self.stats.lock().expect("lock").received += 1;
            // If this decoder stood by for it, the received state replaces the followed one.
            drop(self.standbys.take(r.id));
            self.active
                .insert(r.id, Active::new(r.id, r.epoch, r.committed, r.state));
            self.port.slots.admit(self.active.len() + self.copying);
        }
        while let Ok((id, epoch, copied)) = self.copies.try_recv() {
            self.copied(id, epoch, copied);
        }
        while let Ok((id, epoch, outcome)) = self.outcomes.try_recv() {
            self.handing_out -= 1;
            match outcome {
                Outcome::Moved { to, epoch: new_epoch } => {
                    // Fenced by the commit: what it sampled since is not ours to write (the
                    // destination draws it again). Its answers may have dropped it already.
                    let still_here = self.active.get(&id).is_some_and(|g| g.epoch == epoch);
                    if still_here {
                        self.drop_generation(id);
                    }
                    tracing::info!(generation = id, to, epoch = new_epoch, "generation handed over");
                    // Only the lease of the epoch handed over: the generation may have come
                    // back since (the destination died after its commit, this decoder took it
                    // again), and the lease it holds now is not the one that moved.
                    self.forget_lease(id, epoch);
                    self.stats.lock().expect("lock").handed_out += 1;
                }
                Outcome::Kept { why, again } => self.kept(id, why, again),
            }
        }
    }

    fn views(&self) -> Vec<StepView> {
        self.active
            .values()
            .map(|g| StepView {
                generation: g.id,
                epoch: g.epoch,
                committed: g.committed,
                sent: g.committed + g.sent as u32,
                sampled: g.sampled(),
            })
            .collect()
    }

    /// Stops as a fired hook says: [`WorkerError::Halted`] as after a kill, or the model error
    /// (or panic) it stands for.
    async fn halt(&mut self, fired: Fired) -> Result<(), WorkerError> {
        self.fired(&fired);
        if let Halt::AfterLateAppend(delay) = fired.halt {
            // Gone silent: no renewal (the renewer renews only what is held), no decoding; only
            // the held message arrives late. It carries every unacknowledged token, as a re-send
            // after a lost stream would.
            self.held.lock().expect("lock").clear();
            self.close_stream("halted by a failpoint");
            tokio::time::sleep(delay).await;
            if let Some((req, items)) = self.next_request() {
                let resp = self.client.append(req).await;
                self.record_answers(&items, resp.as_ref().ok());
            }
        }
        Self::halt_as(fired).await
    }

    /// The error a fired hook ends the worker with.
    async fn halt_as(fired: Fired) -> Result<(), WorkerError> {
        match fired.halt {
            // The failures a real model step has, through the worker's ordinary error path.
            Halt::ModelError => Err(WorkerError::Model(crate::Error::Invalid(format!(
                "failpoint {}: the model step failed",
                fired.name
            )))),
            Halt::Panic => {
                let name = fired.name;
                let joined = model_work(move || -> () { panic!("failpoint {name}: the model step panicked") }).await;
                Err(WorkerError::Other(joined.err().unwrap_or_default()))
            }
            Halt::Now | Halt::AfterLateAppend(_) => Err(WorkerError::Halted(fired.name)),
        }
    }

    /// Records a fired hook (before it acts).
    fn fired(&self, f: &Fired) {
        let (name, seq) = (f.name, f.seq);
        tracing::error!(failpoint = name, generation = f.generation, seq, "failpoint fired");
        let Some(g) = self.active.get(&f.generation) else {
            return;
        };
        if let Some(h) = &self.history {
            let token = g.uncommitted.get(seq.saturating_sub(g.committed) as usize);
            h.event(DecoderEvent::Failpoint {
                name: name.to_string(),
                gen: g.id,
                epoch: g.epoch,
                seq,
                token: token.copied(),
            });
        }
    }
    /// Publishes the model's tokenizer in the log (once; the log keeps the first package per
    /// digest), so that a gateway without the model's files can produce its text. Before the
    /// first registration: a gateway that sees the model listed finds its tokenizer.
    async fn publish_tokenizer(&mut self) {
        let package = match self.model.tokenizer().to_package() {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "the tokenizer cannot be packaged: gateways need --model for this model");
                self.tokenizer_published = true;
                return;
            }
        };
        let req = pb::PublishTokenizerRequest {
            tokenizer_sha256: self.identity.tokenizer_sha256.clone(),
            package,
        };
        match self.client.publish_tokenizer(req).await {
            Ok(r) => {
                tracing::info!(stored = r.stored, "tokenizer published in the log");
                self.tokenizer_published = true;
            }
            // Refused (a limit, an old log without the call): say so once, do not resend.
            Err(ClientError::Status(s)) => {
                tracing::error!(error = %s, "the log refused this model's tokenizer: gateways need --model for it");
                self.tokenizer_published = true;
            }
            Err(e) => tracing::warn!(error = %e, "tokenizer not published yet (retried at the next registration)"),
        }
    }

    /// Registers this decoder (its model, capacity and handoff listener, none once stopping)
    /// on a task of its own: the step loop does not wait for the log's write. Registrations
    /// land in the order they were made.
    async fn register(&mut self) {
        if !self.tokenizer_published {
            self.publish_tokenizer().await;
        }
        let ttl_ms = (self.cfg.lease_ms * REGISTRATION_TTL_LEASES).max(REGISTRATION_TTL_MIN_MS);
        let req = pb::RegisterRequest {
            decoder_id: self.cfg.decoder_id.clone(),
            model_name: self.cfg.model_name.clone(),
            model: Some(self.identity.clone()),
            capacity: self.cfg.capacity as u32,
            ttl_ms,
            chat_template: self.cfg.chat_template.clone(),
            context_tokens: self.model.max_context() as u32,
            // None once stopping (nor for a model whose cache cannot move).
            handoff_addr: if self.port.cache_format.is_some() && !self.stopping {
                self.cfg.handoff_addr.clone()
            } else {
                String::new()
            },
        };
        let (client, stats, before) = (self.client.clone(), self.stats.clone(), self.registering.take());
        let (until, renew) = (self.registered_until.clone(), self.session_renew.clone());
        let first = !self.registered_once;
        let hooks = self.hooks.clone();
        self.registered_once = true;
        let task = tokio::spawn(async move {
            if let Some(before) = before {
                let _ = before.await;
            }
            let mut answer = client.register(req).await;
            if !first && answer.is_ok() && hooks.as_ref().is_some_and(|h| h.register_answer_lost()) {
                tracing::warn!(
                    failpoint = "register-answers-lost",
                    "failpoint fired: the registration's answer is dropped"
                );
                answer = Err(ClientError::Status(tonic::Status::unavailable(
                    "failpoint register-answers-lost: the answer was dropped",
                )));
            }
            let registered = match answer {
                Ok(r) => {
                    // Registered at `expiry - ttl`: later than the last registration this
                    // decoder heard of lived, it may have lapsed in between (a step loop held
                    // up, a paused process), and the log's housekeeping then dropped this
                    // decoder's session too, while its stream stayed open. Without a session in
                    // the log it is no standby and no handoff destination, and its crash would
                    // be found by lease expiry only. Or a refresh between applied and its answer
                    // was lost: the session is the log's still. The session loop opens a new
                    // one before it lets the old one go, so neither case ends a lease.
                    let before = until.swap(r.expiry_log_ms, std::sync::atomic::Ordering::AcqRel);
                    if before != 0 && r.expiry_log_ms.saturating_sub(ttl_ms) > before {
                        tracing::warn!(
                            lapsed_ms = r.expiry_log_ms - ttl_ms - before,
                            "the registration had lapsed: opening a new session with the log"
                        );
                        renew.notify_one();
                    }
                    true
                }
                Err(e) => {
                    tracing::warn!(error = %e, "registration not refreshed");
                    false
                }
            };
            stats.lock().expect("lock").registered = registered;
        });
        if first {
            // Work is taken (and standbys claimed) only once the log knows this decoder.
            let _ = task.await;
        } else {
            self.registering = Some(task);
        }
    }

    /// How often the step loop refreshes this decoder's registration.
    fn register_period(&self) -> Duration {
        Duration::from_millis(self.cfg.lease_ms).max(REGISTER_PERIOD_MIN)
    }

    /// Awaits `work` (a model step), refreshing this decoder's registration every
    /// [`Worker::register_period`] meanwhile. A step longer than the registration lives (a slow
    /// model, a pipeline pass that waits for a spare and splices it in) must not unregister the
    /// decoder: a lapsed registration takes its session with it and, for a pipeline head, its
    /// composition in the log, which every stage then refuses. Its leases are renewed meanwhile
    /// by the renewer; the stall watchdog still ends a step loop that is stuck for good.
    async fn registered_while<R>(&mut self, work: impl std::future::Future<Output = R>) -> R {
        let period = self.register_period();
        tokio::pin!(work);
        loop {
            tokio::select! {
                biased;
                r = &mut work => return r,
                () = tokio::time::sleep(period) => {
                    tracing::debug!("a long model step: registration refreshed meanwhile");
                    self.register().await;
                }
            }
        }
    }

    async fn take_work(&mut self) {
        // The slots for what it takes are claimed once the log has listed it (in `take`): a
        // transfer arriving meanwhile finds them taken. Those not filled are free again after.
        let want = self.port.slots.free(self.active.len() + self.copying) as u32;
        if want > 0 {
            self.take(want).await;
        }
        self.port.slots.hold(self.active.len() + self.copying);
    }

    async fn take(&mut self, want: u32) {
        use futures::StreamExt;
        let pending = match self
            .client
            .pending_work(pb::PendingWorkRequest {
                model: Some(self.identity.clone()),
                limit: want,
                standby: false,
                decoder_id: self.cfg.decoder_id.clone(),
                // What it follows, offered first: taken over without a re-prefill.
                standing_by: self.standbys.ids(),
            })
            .await
        {
            Ok(p) => p.generations,
            Err(e) => {
                tracing::warn!(error = %e, "pending work query failed");
                return;
            }
        };
        // PendingWork judges leases by the answering node's clock: it may list a generation this
        // worker is decoding (after a pause, or across an election). Acquiring it again would
        // replace the live state while its appends are in flight: skip it.
        // Nor one held while it is handed out or received (it is in `held`, not `active`).
        let held: std::collections::HashSet<u64> = self.held.lock().expect("lock").keys().copied().collect();
        let mut ids: Vec<u64> = pending
            .iter()
            .map(|g| g.generation_id)
            .filter(|id| !self.active.contains_key(id) && !held.contains(id))
            .take(want as usize)
            .collect();
        // Transfers may have taken slots while the log answered: only what is left is claimed.
        let claimed = self.port.slots.claim(self.active.len() + self.copying, ids.len());
        ids.truncate(claimed);
        if let Some(d) = self
            .hooks
            .as_ref()
            .and_then(|h| h.take_delay())
            .filter(|_| !ids.is_empty())
        {
            tracing::warn!(generations = ?ids, ms = d.as_millis() as u64, "failpoint take-delay-ms: holding the take");
            tokio::time::sleep(d).await;
        }
        // Acquire and prepare several at once: the leader merges the acquires into few entries.
        let taker = Taker {
            cfg: self.cfg.clone(),
            client: self.client.clone(),
            model: self.model.clone(),
            identity: self.identity.clone(),
            held: self.held.clone(),
            stats: self.stats.clone(),
            history: self.history.clone(),
            hooks: self.hooks.clone(),
            prefix_cache: self.prefix_cache.clone(),
        };
        let taker = &taker;
        // A generation this decoder follows as a hot standby is taken with its followed state.
        let takes: Vec<_> = ids.into_iter().map(|id| (id, self.standbys.take(id))).collect();
        let taken: Vec<_> = futures::stream::iter(takes)
            .map(|(id, shadow)| async move { (id, taker.take(id, shadow).await) })
            .buffered(TAKES_AT_ONCE_MAX)
            .collect()
            .await;
        for (id, (r, back)) in taken {
            if let Some(s) = back {
                self.standbys.put_back(id, s);
            }
            match r {
                Ok(Some(active)) => {
                    tracing::info!(
                        generation = id,
                        epoch = active.epoch,
                        frontier = active.committed,
                        "generation taken"
                    );
                    self.active.insert(id, active);
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(generation = id, error = %e, "could not take generation"),
            }
        }
    }

    /// A generation whose next logits are at hand (one just received with its cache, or just
    /// prefilled) draws its token now and sends it, without waiting for a whole step of the
    /// others: no forward pass is needed for it. The step hooks run as around a step; a fired
    /// one is returned.
    async fn sample_ready(&mut self) -> Result<Option<Fired>, WorkerError> {
        let ready: Vec<u64> = self
            .active
            .values()
            .filter(|g| g.can_sample() && g.state.logits_ready())
            .map(|g| g.id)
            .collect();
        if ready.is_empty() {
            return Ok(None);
        }
        let mut gens: Vec<Active> = ready.iter().filter_map(|id| self.active.remove(id)).collect();
        let pc = self.prefix_cache.clone();
        let gens = model_work(move || {
            for g in gens.iter_mut() {
                store_prefix(g, pc.as_ref());
                if let Some(step) = g.state.next_token()? {
                    g.uncommitted.push(step.token);
                    g.finish = step.finish;
                }
            }
            Ok::<_, crate::Error>(gens)
        })
        .await
        .map_err(WorkerError::Other)??;
        self.active.extend(gens.into_iter().map(|g| (g.id, g)));
        self.drop_lost();
        if let Some(fired) = self.hooks.as_ref().and_then(|h| h.after_sample(&self.views())) {
            return Ok(Some(fired));
        }
        self.collect(false).await;
        if let Some(fired) = self.hooks.as_ref().and_then(|h| h.before_send(&self.views())) {
            return Ok(Some(fired));
        }
        if self.in_flight.len() < APPENDS_IN_FLIGHT_MAX {
            self.send().await;
        }
        Ok(None)
    }

    /// Samples one token for every generation that can take one ([`Active::can_sample`]): their
    /// last tokens, and the next prefill chunk of any generation still prefilling, go through
    /// the model in one batched forward pass, then each draws.
    async fn step(&mut self) -> Result<(), WorkerError> {
        let mut gens: Vec<Active> = std::mem::take(&mut self.active).into_values().collect();
        let model = self.model.clone();
        let pc = self.prefix_cache.clone();
        let decoder_id = self.cfg.decoder_id.clone();
        let queued = Instant::now();
        let gens = model_work(move || {
            let began = Instant::now();
            let sched = step_trace().then(thread_schedstat);
            let n = gens.iter().filter(|g| g.can_sample()).count();
            let mut feeding: Vec<&mut DecodeState> = gens
                .iter_mut()
                .filter(|g| g.can_sample())
                .map(|g| &mut g.state)
                .collect();
            let fed = DecodeState::feed_pending_batch_each(&*model, &mut feeding);
            let fail = |g: &mut Active, e: crate::Error| {
                tracing::warn!(generation = g.id, error = %e, "the generation cannot go on here: it is ended as failed");
                g.finish = Some(StopCause::Failed(format!(
                    "decoder {decoder_id} could not continue it: {e}"
                )));
            };
            // A failure of one generation alone (a stage refused its item, ...) ends that
            // generation, explicitly; the others go on. It used to fail the whole step, so the
            // decoder exited with every generation it held, and the next owner of the failing
            // one could fail the same way. A failure of the model or pipeline as a whole still
            // ends the worker: its generations are taken over elsewhere.
            for (g, r) in gens.iter_mut().filter(|g| g.can_sample()).zip(fed) {
                match r {
                    Ok(()) => {}
                    Err(e) if e.is_of_one_sequence() => fail(g, e),
                    Err(e) => return Err(e),
                }
            }
            // A generation still prefilling draws once its last chunk is in.
            for g in gens.iter_mut().filter(|g| g.can_sample() && !g.state.prefilling()) {
                store_prefix(g, pc.as_ref());
                match g.state.next_token() {
                    Ok(Some(step)) => {
                        g.uncommitted.push(step.token);
                        g.finish = step.finish;
                    }
                    Ok(None) => g.finish = g.state.finished().cloned(),
                    Err(e) if e.is_of_one_sequence() => fail(g, e),
                    Err(e) => return Err(e),
                }
            }
            // Where a slow step's time went (`RUST_LOG=tokenlog_decoder::steps=debug`): waiting
            // for a blocking thread, or the forward pass and the draws.
            if let (Some(Some(a)), Some(b)) = (sched, thread_schedstat()) {
                tracing::debug!(
                    target: "tokenlog_decoder::steps",
                    generations = n,
                    // The longest cache: steps where caches grow stand out by it.
                    positions = gens.iter().map(|g| g.state.kv_positions()).max().unwrap_or(0),
                    wait_us = (began - queued).as_micros() as u64,
                    model_us = began.elapsed().as_micros() as u64,
                    on_cpu_us = b.0.saturating_sub(a.0) / 1_000,
                    runnable_us = b.1.saturating_sub(a.1) / 1_000,
                    "step"
                );
            }
            Ok::<_, crate::Error>(gens)
        });
        let gens = self.registered_while(gens).await.map_err(WorkerError::Other)??;
        self.active = gens.into_iter().map(|g| (g.id, g)).collect();
        for g in self.active.values_mut() {
            stream_rows(g);
        }
        Ok(())
    }

    /// The next append: every generation's tokens not yet sent on this stream (and finishes),
    /// with its items recorded as invoked in the history. `None` when there is nothing new.
    fn next_request(&mut self) -> Option<(pb::AppendRequest, Vec<SentItem>)> {
        let items: Vec<pb::AppendItem> = self.active.values_mut().filter_map(Active::next_item).collect();
        if items.is_empty() {
            return None;
        }
        let sent = items
            .iter()
            .map(|i| SentItem {
                generation: i.generation_id,
                epoch: i.epoch,
                finish: i.finish != pb::FinishReason::Unspecified as i32,
                history_id: self.history.as_ref().map(|h| {
                    h.invoke(Call::Append {
                        gen: i.generation_id,
                        epoch: i.epoch,
                        start_seq: i.start_seq,
                        n: i.token_ids.len() as u32,
                        finish: i.finish != 0,
                    })
                }),
            })
            .collect();
        let req = pb::AppendRequest {
            decoder_id: self.cfg.decoder_id.clone(),
            lease_ms: self.cfg.lease_ms,
            items,
        };
        Some((req, sent))
    }

    /// Sends what is new on the stream (opening one if needed), without waiting for the answer.
    /// Returns whether an append went out.
    async fn send(&mut self) -> bool {
        if !self.active.values().any(Active::has_unsent) {
            return false;
        }
        if self.stream.is_none() {
            if self.stream_retry_at.is_some_and(|t| Instant::now() < t) {
                return false;
            }
            match self.client.append_stream().await {
                Ok(s) => self.stream = Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open an append stream; will retry");
                    return false;
                }
            }
        }
        let Some((req, items)) = self.next_request() else {
            return false;
        };
        let stream = self.stream.as_ref().expect("opened above");
        if let Err(e) = stream.send(req).await {
            self.record_answers(&items, None);
            self.close_stream(&e.to_string());
            return false;
        }
        self.in_flight.push_back(items);
        self.appends_sent += 1;
        true
    }

    /// Absorbs the answers that have arrived; with `wait`, first waits for at least one, up to
    /// `APPEND_ANSWER_TIMEOUT` from now. The timeout counts only time spent waiting, never time
    /// since the send: a process that was paused finds its answers waiting, not a timeout.
    async fn collect(&mut self, mut wait: bool) {
        while let (false, Some(stream)) = (self.in_flight.is_empty(), self.stream.as_mut()) {
            let answer = if wait {
                match tokio::time::timeout(APPEND_ANSWER_TIMEOUT, stream.answer()).await {
                    Ok(a) => a.map_err(|e| e.to_string()),
                    Err(_) => Err(format!("no answer to an append within {APPEND_ANSWER_TIMEOUT:?}")),
                }
            } else {
                match stream.try_answer() {
                    Some(a) => a.map_err(|e| e.to_string()),
                    None => return,
                }
            };
            match answer {
                Ok(resp) => {
                    self.take_answer(resp);
                    wait = false;
                }
                Err(e) => {
                    self.close_stream(&e);
                    return;
                }
            }
        }
    }

    /// The answer to the oldest append in flight: recorded and absorbed.
    fn take_answer(&mut self, resp: pb::AppendResponse) {
        self.stream_failures = 0;
        let sent = self
            .in_flight
            .pop_front()
            .expect("an answer comes for an append in flight");
        self.record_answers(&sent, Some(&resp));
        self.absorb(&sent, resp);
    }

    /// Ends the stream: the answers still owed are unknown (the appends may or may not have
    /// committed), so every unacknowledged token is re-sent on the next stream.
    fn close_stream(&mut self, why: &str) {
        if self.stream.is_some() {
            self.stream_failures += 1;
            self.stream_retry_at = (self.stream_failures > 1).then(|| {
                let doublings = (self.stream_failures - 2).min(8);
                Instant::now() + (STREAM_RETRY_PAUSE_MIN * (1 << doublings)).min(STREAM_RETRY_PAUSE_MAX)
            });
        }
        if self.stream.take().is_some() && !self.in_flight.is_empty() {
            tracing::warn!(
                error = why,
                unanswered = self.in_flight.len(),
                "append stream failed; will re-send"
            );
        }
        for f in std::mem::take(&mut self.in_flight) {
            self.record_answers(&f, None);
        }
        for g in self.active.values_mut() {
            g.resend_all();
        }
    }

    /// Completes the items' history operations with the answer (`None`: outcome unknown).
    fn record_answers(&self, items: &[SentItem], resp: Option<&pb::AppendResponse>) {
        let Some(h) = &self.history else {
            return;
        };
        for (i, item) in items.iter().enumerate() {
            let Some(id) = item.history_id else {
                continue;
            };
            let result = resp.and_then(|r| match r.results.get(i) {
                Some(x) if x.generation_id == item.generation => Some(x),
                _ => r.results.iter().find(|x| x.generation_id == item.generation),
            });
            let answer = result.map_or(
                Answer::Append {
                    ok: None,
                    frontier: 0,
                    current_epoch: 0,
                    reason: None,
                    terminal: false,
                },
                append_answer,
            );
            h.complete(id, answer);
        }
    }

    /// Applies an append's answers (one per item, in the items' order).
    fn absorb(&mut self, items: &[SentItem], resp: pb::AppendResponse) {
        let now = Instant::now();
        let (mut newly_total, mut finished, mut fenced) = (0u64, 0u64, 0u64);
        let mut gone = Vec::new();
        let mut held = self.held.lock().expect("lock");
        for (i, r) in resp.results.iter().enumerate() {
            let Some(g) = self.active.get_mut(&r.generation_id) else {
                continue;
            };
            let item = match items.get(i) {
                Some(item) if item.generation == r.generation_id => Some(item),
                _ => items.iter().find(|it| it.generation == r.generation_id),
            };
            if item.is_some_and(|it| it.epoch != g.epoch) {
                // The answer to an append of an earlier epoch: the generation was lost since
                // (fenced, its lease lapsed, its session broke) and taken again, resumed from
                // what the log had committed, this append included. Its rejection dropped the
                // new epoch's state and lease, owned in the log and decoded by nobody until
                // that lease lapsed too; its acceptance counted records the new state has.
                tracing::debug!(
                    generation = g.id,
                    epoch = g.epoch,
                    "an answer to an append of an earlier epoch: ignored"
                );
                continue;
            }
            if !r.accepted {
                let reason = r.rejection.as_ref().map(|x| x.reason);
                if reason == Some(pb::RejectReason::SeqMismatch as i32) {
                    // An earlier append of ours was lost: re-send from the acknowledged frontier.
                    tracing::debug!(generation = g.id, "append past the frontier; re-sending");
                    g.resend_all();
                    continue;
                }
                if g.out {
                    // Its handoff committed: the destination owns it from here.
                    tracing::debug!(
                        generation = g.id,
                        epoch = g.epoch,
                        "append fenced by the handoff's commit"
                    );
                } else {
                    tracing::warn!(generation = g.id, epoch = g.epoch, rejection = ?r.rejection, "append rejected: dropping the generation");
                    fenced += 1;
                }
                gone.push(g.id);
                continue;
            }
            let newly = r.frontier.saturating_sub(g.committed).min(g.uncommitted.len() as u32);
            g.uncommitted.drain(..newly as usize);
            g.committed += newly;
            g.sent = g.sent.saturating_sub(newly as usize);
            g.state.mark_committed(g.committed as usize);
            if let Some(pc) = &self.prefix_cache {
                pc.lock().expect("lock").progress(g.id, g.committed);
            }
            held.insert(g.id, (g.epoch, now));
            newly_total += u64::from(newly);
            let carried_finish = item.is_some_and(|it| it.finish);
            if carried_finish && g.uncommitted.is_empty() {
                finished += 1;
                gone.push(g.id);
            }
        }
        drop(held);
        {
            let mut s = self.stats.lock().expect("lock");
            s.tokens_committed += newly_total;
            s.finished += finished;
            s.fence_rejections += fenced;
        }
        for id in gone {
            self.drop_generation(id);
        }
    }

    /// Drops the generations whose renewal the log rejected, at the epoch we hold them.
    fn drop_lost(&mut self) {
        let lost = std::mem::take(&mut *self.lost.lock().expect("lock"));
        if self.hooks.as_ref().is_some_and(|h| h.deaf_to_lost_renewals()) {
            // Failure point 9's failpoint: the append goes out and the log's fence answers it.
            return;
        }
        for (id, epoch) in lost {
            if let Some(g) = self.active.get(&id).filter(|g| g.epoch == epoch) {
                if g.out {
                    tracing::debug!(generation = id, epoch, "renew fenced by the handoff's commit");
                } else {
                    tracing::warn!(generation = id, epoch, "renew rejected: dropping the generation");
                    self.stats.lock().expect("lock").fence_rejections += 1;
                }
                self.drop_generation(id);
            }
        }
    }

    /// Drops generation `id` from the step loop, with its lease at the epoch it was decoded at
    /// (a lease of a later epoch, received meanwhile, stays to be renewed), and frees its slot
    /// for a transfer at once: the slots were counted again only at the end of the loop's
    /// pass, after a whole step, and a transfer arriving meanwhile found a decoder that had
    /// just finished or handed out a generation still "full".
    fn drop_generation(&mut self, id: u64) {
        if let Some(g) = self.active.remove(&id) {
            self.forget_lease(id, g.epoch);
        }
        self.port.slots.hold(self.active.len() + self.copying);
    }

    /// Stops renewing generation `id`'s lease if it is held at `epoch` (one of a later epoch,
    /// received since, stays).
    fn forget_lease(&self, id: u64, epoch: u64) {
        let mut held = self.held.lock().expect("lock");
        if held.get(&id).is_some_and(|(e, _)| *e == epoch) {
            held.remove(&id);
        }
    }

    async fn release_all(&mut self) {
        self.port.accepting.store(false, std::sync::atomic::Ordering::Release);
        // Not those being handed out: their attempts end below (a release would abort them,
        // and the generation would be taken over with a re-prefill instead).
        self.release_active(false).await;
        // Handoffs out (and receives) still in progress end next: moved, or back here to be
        // released. Their leases are renewed meanwhile.
        let deadline = Instant::now() + crate::limits::HANDOFF_TRANSFER_TIMEOUT * 2;
        let busy = |w: &Self| w.handing_out > 0 || w.port.slots.reserved() > 0;
        while busy(self) && Instant::now() < deadline {
            let wake = self.wake.clone();
            let _ = tokio::time::timeout(Duration::from_millis(50), wake.notified()).await;
            self.absorb_handoffs();
        }
        self.absorb_handoffs();
        self.release_active(true).await;
    }

    /// Releases every active generation; those being handed out only with `out`. All at once,
    /// within `RELEASE_ALL_TIMEOUT` in all: with the log out of reach, each release took its
    /// whole retry budget (~15-20 s), one after the other, and a stop took minutes (a
    /// supervisor kills it after 30 s). What is not released by then ends with this decoder's
    /// session (its stream breaks as the process exits) or with its lease.
    async fn release_active(&mut self, out: bool) {
        let ids: Vec<u64> = self.active.values().filter(|g| out || !g.out).map(|g| g.id).collect();
        let mut leaving = Vec::with_capacity(ids.len());
        for id in ids {
            let g = self.active.remove(&id).expect("listed above");
            self.held.lock().expect("lock").remove(&id);
            leaving.push((id, g.epoch));
        }
        let (client, history) = (&self.client, self.history.as_deref());
        let all = futures::future::join_all(leaving.iter().map(|&(id, epoch)| release(client, history, id, epoch)));
        if tokio::time::timeout(crate::limits::RELEASE_ALL_TIMEOUT, all)
            .await
            .is_err()
        {
            tracing::warn!(
                generations = leaving.len(),
                timeout_ms = crate::limits::RELEASE_ALL_TIMEOUT.as_millis() as u64,
                "the log did not take every release in time: the rest end with this decoder's session or leases"
            );
        }
    }
}

/// Resolves once the step loop's heartbeat (`beat`, ms since `origin`) is older than `stall`;
/// says how old.
async fn stall_watch(beat: Arc<std::sync::atomic::AtomicU64>, origin: Instant, stall: Duration) -> String {
    loop {
        tokio::time::sleep(stall / 4).await;
        let last = Duration::from_millis(beat.load(std::sync::atomic::Ordering::Relaxed));
        let quiet = origin.elapsed().saturating_sub(last);
        if quiet >= stall {
            return format!(
                "its step loop made no progress for {} ms (the limit is {} ms)",
                quiet.as_millis(),
                stall.as_millis()
            );
        }
    }
}

/// Runs model work on a blocking thread. A panic in it (candle's kernels panic on some bad
/// input) is the model's failure, an error here, not a bug of the process: it runs inside
/// [`crate::panics::catch_expected`], which the binary's abort-on-panic hook lets through.
/// Under the simulation ([`crate::simulation`]) it runs inline, then costs a simulated step.
pub(crate) async fn model_work<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> Result<R, String> {
    let done = match crate::simulation::step() {
        Some(step) => {
            let r = crate::panics::catch_expected(f);
            tokio::time::sleep(step).await;
            Ok(r)
        }
        None => tokio::task::spawn_blocking(move || crate::panics::catch_expected(f)).await,
    };
    match done {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(p)) => Err(format!(
            "the model panicked: {}",
            p.downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)")
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Whether steps are traced (`RUST_LOG=tokenlog_decoder::steps=debug`).
fn step_trace() -> bool {
    tracing::enabled!(target: "tokenlog_decoder::steps", tracing::Level::DEBUG)
}

/// This thread's time on a CPU and time runnable but waiting for one, in ns, from the kernel's
/// scheduler statistics (Linux; `None` elsewhere): a slow step either computed longer or waited
/// for a core.
fn thread_schedstat() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let mut f = s.split_whitespace().map(|x| x.parse::<u64>().ok());
    Some((f.next()??, f.next()??))
}

/// A generation back from the copy of its cache: (id, epoch, the state and the copy, or why the
/// model failed).
type Copied = (u64, u64, Result<(Active, crate::Result<CacheCopy>), String>);

/// Sends the rows a generation under handoff fed since the last call to its destination
/// ([`crate::handoff::RowsOut`]); once they end, none more.
fn stream_rows(g: &mut Active) {
    if let Some(rows) = &mut g.rows_out {
        if !rows.send(&g.state) {
            tracing::debug!(generation = g.id, "rows to the handoff's destination end here");
            g.rows_out = None;
            g.state.keep_logits(false);
        }
    }
}

/// Planted bug `source-frees-early`: the source frees the generation's cache once it copied it
/// for a handoff, before the log released it (it samples nothing while the attempt is out, then
/// decodes on an empty cache).
fn plant_forget_cache(g: &mut Active) {
    tracing::error!(
        generation = g.id,
        "PLANTED BUG: the source frees its cache once copied, before the log released it"
    );
    #[cfg(feature = "faults")]
    g.state.forget_cache();
    g.cache_freed = true;
}

/// Gives generation `id` (held at `epoch`) back to the log, recorded in the history.
pub(crate) async fn release(client: &LogClient, history: Option<&crate::history::History>, id: u64, epoch: u64) {
    let call = Call::Release { gen: id, epoch };
    let hid = history.map(|h| h.invoke(call.clone()));
    let done = client
        .release(pb::ReleaseRequest {
            generation_id: id,
            epoch,
        })
        .await;
    if let (Some(h), Some(hid)) = (history, hid) {
        h.complete(hid, Answer::of_ownership(&call, done.as_ref().ok()));
    }
}

/// What taking a generation needs from the worker (shared by the takes that run at once).
struct Taker {
    cfg: WorkerConfig,
    client: LogClient,
    model: Arc<dyn Model>,
    identity: pb::ModelIdentity,
    held: Held,
    stats: Arc<Mutex<WorkerStats>>,
    history: Option<Arc<crate::history::History>>,
    hooks: Option<Arc<dyn StepHooks>>,
    prefix_cache: Option<SharedPrefixCache>,
}

impl Taker {
    /// Acquire → read prefix → bind prompt → re-prefill, or with `shadow` (this decoder is the
    /// generation's hot standby) its followed state instead of the re-prefill when it is at the
    /// granted frontier. `None`: the log refused the acquire; the shadow comes back unless it
    /// was used or the generation was acquired.
    async fn take(&self, id: u64, shadow: Option<Shadow>) -> (Result<Option<Active>, WorkerError>, Option<Shadow>) {
        if shadow.is_some() && self.cfg.standby_early_write() {
            self.plant_standby_write(id).await;
        }
        match self.acquire(id).await {
            Ok(Some((info, epoch))) => (self.take_acquired(info, epoch, shadow).await, None),
            Ok(None) => (Ok(None), shadow),
            Err(e) => (Err(e), shadow),
        }
    }

    /// Planted bug `standby-early-write` (fault builds): a standby that sees its generation's
    /// owner gone appends at the epoch it last saw instead of acquiring a new one. The log's
    /// fence refuses it; the decoder's history shows a write without a grant.
    async fn plant_standby_write(&self, id: u64) {
        tracing::error!(
            generation = id,
            "PLANTED BUG: a standby appends without acquiring the generation"
        );
        let Ok(Some(info)) = self
            .client
            .get(pb::GetRequest {
                generation_id: id,
                ..Default::default()
            })
            .await
            .map(|g| g.generation)
        else {
            return;
        };
        let epoch = info.lease.map_or(0, |l| l.epoch);
        let hid = self.history.as_ref().map(|h| {
            h.invoke(Call::Append {
                gen: id,
                epoch,
                start_seq: info.frontier,
                n: 1,
                finish: false,
            })
        });
        let r = self
            .client
            .append(pb::AppendRequest {
                decoder_id: self.cfg.decoder_id.clone(),
                lease_ms: self.cfg.lease_ms,
                items: vec![pb::AppendItem {
                    generation_id: id,
                    epoch,
                    start_seq: info.frontier,
                    token_ids: vec![0],
                    ..Default::default()
                }],
            })
            .await;
        if let (Some(h), Some(hid), Ok(Some(a))) = (&self.history, hid, r.as_ref().map(|r| r.results.first())) {
            h.complete(hid, append_answer(a));
        }
    }

    /// The acquire of [`Taker::take`]: the granted generation and epoch, `None` if refused.
    async fn acquire(&self, id: u64) -> Result<Option<(pb::GenerationInfo, u64)>, WorkerError> {
        let req = pb::AcquireRequest {
            generation_id: id,
            decoder_id: self.cfg.decoder_id.clone(),
            lease_ms: self.cfg.lease_ms,
            model: Some(self.identity.clone()),
            rng_version: crate::worker_hooks::rng_version(&self.hooks),
        };
        // Every try of the client's is an operation of its own in the history: an acquire is
        // idempotent only while the lease it granted lives, so a retry after a lost grant's
        // lease ran out is granted again, at a newer epoch (found by the simulation).
        let history = self.history.clone();
        let acq = self
            .client
            .call(|mut c| {
                let (req, history) = (req.clone(), history.clone());
                async move {
                    let hid = history.as_ref().map(|h| h.invoke(Call::Acquire { gen: id }));
                    let r = c.acquire(req).await;
                    if let (Some(h), Some(hid)) = (&history, hid) {
                        let answer = r.as_ref().ok().map(|r| r.get_ref());
                        h.complete(hid, Answer::of_ownership(&Call::Acquire { gen: id }, answer));
                    }
                    r
                }
            })
            .await;
        let acq = acq?;
        let Some(info) = acq.generation.filter(|_| acq.ok) else {
            tracing::debug!(generation = id, rejection = ?acq.rejection, "acquire refused");
            return Ok(None);
        };
        let epoch = info.lease.as_ref().map_or(0, |l| l.epoch);
        self.held.lock().expect("lock").insert(id, (epoch, Instant::now()));
        {
            let mut s = self.stats.lock().expect("lock");
            s.acquired += 1;
            s.takeovers += u64::from(epoch > 1);
        }
        Ok(Some((info, epoch)))
    }

    /// The followed state of a hot standby as the new owner's, when it reaches the granted
    /// frontier; `None`: it cannot (a re-prefill follows).
    async fn continue_shadow(&self, info: &pb::GenerationInfo, epoch: u64, shadow: Shadow) -> Option<Active> {
        let (id, frontier) = (info.generation_id, info.frontier);
        let followed = shadow.followed();
        let t0 = Instant::now();
        // What the watch has not delivered yet (it lags the commit a little): read it.
        let missing = shadow.missing(frontier);
        let read = if missing.is_empty() {
            Vec::new()
        } else {
            match crate::worker_lease::read_records(&self.client, id, missing.start, missing.end).await {
                Ok(read) => read,
                Err(e) => {
                    tracing::info!(generation = id, error = %e, "the records the standby lacks are not readable: re-prefilling");
                    return None;
                }
            }
        };
        let lacked = read.len();
        let followed_state = model_work(move || shadow.into_state(frontier, &read).transpose())
            .await
            .and_then(|r| r.map_err(|e| e.to_string()));
        match followed_state {
            Ok(Some(state)) => {
                self.stats.lock().expect("lock").standby_takeovers += 1;
                tracing::info!(
                    generation = id,
                    epoch,
                    frontier,
                    followed,
                    lacked,
                    ms = t0.elapsed().as_secs_f64() * 1e3,
                    "taken over from the hot standby's state: no re-prefill"
                );
                Some(Active::new(id, epoch, frontier, state))
            }
            Ok(None) => {
                tracing::info!(
                    generation = id,
                    frontier,
                    followed,
                    "the standby's state is not at the granted frontier: re-prefilling"
                );
                None
            }
            Err(e) => {
                tracing::warn!(generation = id, error = %e, "the standby's state failed: re-prefilling");
                None
            }
        }
    }

    /// What follows a granted acquire: the standby's state or a re-prefill; a failure releases
    /// the generation (or ends it, for a true incompatibility).
    async fn take_acquired(
        &self,
        info: pb::GenerationInfo,
        epoch: u64,
        shadow: Option<Shadow>,
    ) -> Result<Option<Active>, WorkerError> {
        let id = info.generation_id;
        let followed = match shadow {
            Some(s) => self.continue_shadow(&info, epoch, s).await,
            None => None,
        };
        let prepared = match followed {
            Some(a) => Ok(a),
            None => self.prepare(&info, epoch).await,
        };
        match prepared {
            Ok(active) => {
                if let Some(h) = &self.history {
                    let f = active.state.frontiers();
                    h.event(DecoderEvent::Resumed {
                        gen: id,
                        epoch,
                        prompt_len: f.prompt_len as u64,
                        sampled: f.sampled as u64,
                        fed: f.fed as u64,
                        kv: f.kv as u64,
                        committed: f.committed as u64,
                        deferred: active.state.deferred_prefill() as u64,
                    });
                }
                Ok(Some(active))
            }
            Err(e) => {
                self.held.lock().expect("lock").remove(&id);
                if e.is_incompatibility() {
                    // The binding cannot be served here (prompt too long, bad prompt...): end it
                    // explicitly rather than leave it to time out (CONTRACT §5).
                    let detail = finish_detail(format!("decoder {} cannot continue: {e}", self.cfg.decoder_id));
                    let reason = pb::FinishReason::Error as i32;
                    let call = Call::Finish { gen: id, epoch, reason };
                    let hid = self.history.as_ref().map(|h| h.invoke(call.clone()));
                    let done = self
                        .client
                        .finish(pb::FinishRequest {
                            generation_id: id,
                            epoch,
                            reason,
                            detail,
                        })
                        .await;
                    if let (Some(h), Some(hid)) = (&self.history, hid) {
                        h.complete(hid, Answer::of_ownership(&call, done.as_ref().ok()));
                    }
                    self.stats.lock().expect("lock").failed += 1;
                } else {
                    // The log could not be reached or read for now (a follower that has not
                    // applied the submit yet, a partition, a leader change): not the
                    // generation's fault. Release it, for this or another decoder to take again.
                    release(&self.client, self.history.as_deref(), id, epoch).await;
                    self.stats.lock().expect("lock").released += 1;
                }
                Err(e)
            }
        }
    }

    async fn prepare(&self, info: &pb::GenerationInfo, epoch: u64) -> Result<Active, WorkerError> {
        let id = info.generation_id;
        let binding: Binding = info
            .binding
            .clone()
            .ok_or_else(|| WorkerError::Incompatible("generation has no binding".into()))?
            .into();
        let mut prompt = binding.prompt_token_ids.clone();
        if prompt.is_empty() {
            prompt = self.model.tokenizer().encode(&binding.prompt_text)?;
            let r = self
                .client
                .bind_prompt(pb::BindPromptRequest {
                    generation_id: id,
                    epoch,
                    prompt_token_ids: prompt.clone(),
                })
                .await?;
            if !r.ok {
                let reason = r.rejection.as_ref().map(|j| j.reason());
                let lost = matches!(
                    reason,
                    Some(
                        pb::RejectReason::StaleEpoch
                            | pb::RejectReason::LeaseExpired
                            | pb::RejectReason::Terminal
                            | pb::RejectReason::NotFound
                    )
                );
                let msg = format!("prompt binding refused: {:?}", r.rejection);
                return Err(if lost {
                    WorkerError::Other(msg)
                } else {
                    WorkerError::Incompatible(msg)
                });
            }
        }
        if self.hooks.as_ref().is_some_and(|h| h.prefix_read_fails(id)) {
            return Err(WorkerError::Other(format!(
                "failpoint prefix-read-errors: committed prefix of generation {id} not readable"
            )));
        }
        let committed = read_prefix(&self.client, id, info.frontier).await?;
        let (params, stop, mode) = (binding.sampling, binding.stop, binding.mode);
        let frontier = committed.len() as u32;
        if let Some(state) = self
            .restore_from_cache(id, &prompt, &committed, params.clone(), stop.clone(), mode)
            .await
        {
            return Ok(Active::new(id, epoch, frontier, state));
        }
        // Stored in the prefix cache once prefilled (before its first draw).
        let store: Option<Vec<u32>> = self
            .prefix_cache
            .as_ref()
            .map(|_| prompt.iter().chain(&committed).copied().collect());
        let model = self.model.clone();
        // Deferred where the model allows: the prefill then runs in chunks inside the batched
        // steps, beside the generations already running.
        let state =
            model_work(move || DecodeState::resume_deferred(model.as_ref(), &prompt, &committed, params, stop, mode))
                .await
                .map_err(|e| WorkerError::Incompatible(format!("re-prefill failed: {e}")))??;
        let mut active = Active::new(id, epoch, frontier, state);
        active.store_prefix = store;
        Ok(active)
    }

    /// The state of generation `id` from the prefix cache, when it holds a prefix of its prompt
    /// and committed records (the rest is prefilled): `None` when it holds none, or the entry
    /// cannot be used (a cold prefill follows). The restore is recorded first (the reload-loop
    /// guard), so a restore that kills the process is not repeated for ever.
    async fn restore_from_cache(
        &self,
        id: u64,
        prompt: &[u32],
        committed: &[u32],
        params: crate::SamplingConfig,
        stop: crate::StopConfig,
        mode: crate::ResumeMode,
    ) -> Option<DecodeState> {
        let pc = self.prefix_cache.as_ref()?;
        let all: Vec<u32> = prompt.iter().chain(committed).copied().collect();
        let entry = pc.lock().expect("lock").restore_for(id, &all, committed.len() as u32)?;
        if self.hooks.as_ref().is_some_and(|h| h.prefix_restore_exit()) {
            tracing::error!(
                failpoint = "prefix-restore-exit",
                generation = id,
                entry = %entry.key,
                "failpoint fired: exiting during a prefix cache restore"
            );
            if let Some(h) = &self.history {
                h.event(DecoderEvent::Failpoint {
                    name: "prefix-restore-exit=1".into(),
                    gen: id,
                    epoch: 0,
                    seq: committed.len() as u32,
                    token: None,
                });
            }
            std::process::exit(HALT_EXIT_CODE);
        }
        let (model, p, c, cache) = (
            self.model.clone(),
            prompt.to_vec(),
            committed.to_vec(),
            entry.cache.clone(),
        );
        let t0 = Instant::now();
        let cached = cache.positions;
        let restored =
            model_work(move || DecodeState::resume_from_cache(model.as_ref(), &p, &c, params, stop, mode, &cache))
                .await
                .and_then(|r| r.map_err(|e| e.to_string()));
        match restored {
            Ok(state) => {
                self.stats.lock().expect("lock").prefix_restores += 1;
                tracing::info!(
                    generation = id,
                    cached,
                    positions = all.len(),
                    entry = %entry.key,
                    ms = t0.elapsed().as_secs_f64() * 1e3,
                    "restored from the prefix cache"
                );
                Some(state)
            }
            Err(e) => {
                tracing::warn!(generation = id, entry = %entry.key, error = %e, "prefix cache entry not usable: prefilling cold");
                None
            }
        }
    }
}

/// An append item's answer as the history records it.
fn append_answer(r: &pb::AppendResult) -> Answer {
    let rej = r.rejection.as_ref();
    Answer::Append {
        ok: Some(r.accepted),
        frontier: rej.map_or(r.frontier, |x| x.frontier),
        current_epoch: rej.map_or(r.epoch, |x| x.current_epoch),
        reason: rej.map(|x| x.reason),
        terminal: rej
            .is_some_and(|x| crate::history::terminal_state(x.state) || x.reason == pb::RejectReason::NotFound as i32),
    }
}

/// Stores `g`'s prompt and committed prefix in the prefix cache once they are prefilled (its
/// logits at hand, before its first draw here), once.
fn store_prefix(g: &mut Active, pc: Option<&SharedPrefixCache>) {
    let Some(pc) = pc else {
        return;
    };
    if g.store_prefix.is_none() || !g.state.logits_ready() {
        return;
    }
    let tokens = g.store_prefix.take().expect("checked");
    match g.state.export_cache() {
        Ok(c) => pc.lock().expect("lock").insert(&tokens, c),
        Err(e) => tracing::debug!(generation = g.id, error = %e, "not stored in the prefix cache"),
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::thread_schedstat;
    use std::time::{Duration, Instant};

    /// A worker on the fake model whose log is never called, holding generation 7 at epoch 2.
    fn holding_7_at_epoch_2() -> super::Worker {
        use super::*;
        let model: Arc<dyn Model> = Arc::new(crate::FakeModel::new(crate::FakeConfig::default()).unwrap());
        let client = LogClient::new(vec!["127.0.0.1:9".into()]).unwrap();
        let mut w = Worker::new(WorkerConfig::new("d".into(), "fake".into()), client, model.clone());
        let stop = crate::StopConfig {
            max_tokens: 8,
            stop_strings: vec![],
            eos_token_ids: vec![],
        };
        let state = DecodeState::start(model.as_ref(), &[1, 2, 3], Default::default(), stop).unwrap();
        w.active.insert(7, Active::new(7, 2, 0, state));
        w.held.lock().unwrap().insert(7, (2, tokio::time::Instant::now()));
        w
    }

    fn rejected(generation_id: u64) -> super::pb::AppendResponse {
        use super::pb;
        pb::AppendResponse {
            results: vec![pb::AppendResult {
                generation_id,
                accepted: false,
                rejection: Some(pb::Rejection {
                    reason: pb::RejectReason::StaleEpoch as i32,
                    current_epoch: 2,
                    ..Default::default()
                }),
                ..Default::default()
            }],
            log_index: 0,
        }
    }

    /// The answer to an append of an earlier epoch (sent before the generation was lost and
    /// taken again) leaves the generation as it is held now; it dropped the new epoch's state
    /// and lease, so that nobody decoded or renewed a generation the log said was this
    /// decoder's. An answer at the epoch held is taken as before.
    #[tokio::test]
    async fn an_answer_to_an_append_of_an_earlier_epoch_leaves_the_generation_taken_again() {
        use super::SentItem;
        let mut w = holding_7_at_epoch_2();
        let sent = |epoch| SentItem {
            generation: 7,
            epoch,
            finish: false,
            history_id: None,
        };
        w.absorb(&[sent(1)], rejected(7));
        assert!(w.active.contains_key(&7), "dropped by an answer of epoch 1");
        assert_eq!(w.held.lock().unwrap().get(&7).map(|h| h.0), Some(2));
        w.absorb(&[sent(2)], rejected(7));
        assert!(!w.active.contains_key(&7), "kept after its own epoch's rejection");
        assert!(w.held.lock().unwrap().is_empty());
    }

    /// A handoff that moved epoch 1 of generation 7 leaves the lease of epoch 2 it holds since
    /// (taken again after the destination was lost) to be renewed; it removed it.
    #[tokio::test]
    async fn a_handoff_of_an_earlier_epoch_leaves_the_lease_held_now() {
        let mut w = holding_7_at_epoch_2();
        w.handing_out = 1;
        w.outcomes_tx
            .send((
                7,
                1,
                crate::handoff::Outcome::Moved {
                    to: "b".into(),
                    epoch: 2,
                },
            ))
            .unwrap();
        w.absorb_handoffs();
        assert!(w.active.contains_key(&7));
        assert_eq!(w.held.lock().unwrap().get(&7).map(|h| h.0), Some(2));
    }

    /// A generation that leaves the step loop (handed over, finished, fenced) frees its slot
    /// for a transfer at once, not at the end of the loop's pass (after a whole step).
    #[tokio::test]
    async fn a_generation_handed_over_frees_its_slot_for_a_transfer_at_once() {
        let mut w = holding_7_at_epoch_2();
        let capacity = w.cfg.capacity;
        w.port.slots.hold(capacity);
        assert!(!w.port.slots.reserve(), "full");
        w.handing_out = 1;
        let moved = crate::handoff::Outcome::Moved {
            to: "b".into(),
            epoch: 3,
        };
        w.outcomes_tx.send((7, 2, moved)).unwrap();
        w.absorb_handoffs();
        assert!(!w.active.contains_key(&7));
        assert!(
            w.port.slots.reserve(),
            "the slot of the generation handed over is still taken"
        );
    }

    /// A copy of the cache that failed (the model panicked under it) frees the generation's
    /// slot at once and stops renewing only the lease of the epoch it copied: one of a later
    /// epoch stays. It removed any lease, and the slot stayed taken until the end of the pass.
    #[tokio::test]
    async fn a_failed_copy_frees_its_slot_at_once_and_leaves_a_later_lease() {
        let mut w = holding_7_at_epoch_2();
        let capacity = w.cfg.capacity;
        w.port.slots.hold(capacity);
        w.active.remove(&7);
        (w.copying, w.handing_out) = (1, 1);
        w.held.lock().unwrap().insert(7, (3, tokio::time::Instant::now()));
        w.copied(7, 2, Err("the model panicked: test".into()));
        assert_eq!((w.copying, w.handing_out), (0, 0));
        assert_eq!(w.held.lock().unwrap().get(&7).map(|h| h.0), Some(3));
        assert!(w.port.slots.reserve(), "the failed copy's slot is still taken");
    }

    /// A drain tries a generation again once a destination refused it (full for a moment), not
    /// once none takes handoffs. Before, every kept generation was kept for good: the drain
    /// ended at once and released it for a re-prefill.
    #[tokio::test]
    async fn a_drain_tries_a_refused_generation_again_and_not_one_nobody_can_take() {
        let mut w = holding_7_at_epoch_2();
        w.cfg.handoff_addr = "127.0.0.1:1".into();
        w.cfg.drain_ms = 60_000;
        let stop = crate::StopConfig {
            max_tokens: 8,
            stop_strings: vec![],
            eos_token_ids: vec![],
        };
        let state = super::DecodeState::start(w.model.as_ref(), &[4, 5, 6], Default::default(), stop).unwrap();
        w.active.insert(8, super::Active::new(8, 1, 0, state));
        assert!(w.keep_draining(), "two generations to drain");
        let marked = |w: &super::Worker| -> Vec<u64> { w.active.values().filter(|g| g.moving).map(|g| g.id).collect() };
        assert_eq!(marked(&w).len(), 1, "one at a time");
        let first = marked(&w)[0];
        let other = if first == 7 { 8 } else { 7 };
        w.active.get_mut(&first).unwrap().moving = false;
        w.kept(first, "b: this decoder is full".into(), true);
        assert!(w.keep_draining(), "a refused generation is left to drain");
        assert_eq!(marked(&w), vec![other], "the other goes first");
        w.active.get_mut(&other).unwrap().moving = false;
        w.kept(other, "no other decoder of this model takes handoffs".into(), false);
        w.drain_retry.insert(first, tokio::time::Instant::now());
        assert!(w.keep_draining(), "the refused one is tried again");
        assert_eq!(marked(&w), vec![first]);
        w.active.get_mut(&first).unwrap().moving = false;
        w.kept(first, "no other decoder of this model takes handoffs".into(), false);
        assert!(!w.keep_draining(), "nothing left that a handoff could move");
    }

    /// Generation 7, handed out at epoch 2, came back at epoch 3 (the destination handed it
    /// back at once) while an append of epoch 2 was answered: the fence's answer drops the
    /// state of epoch 2 and leaves the lease of epoch 3 to be renewed; it removed it.
    #[tokio::test]
    async fn a_fenced_append_of_a_generation_received_back_leaves_the_new_lease() {
        use super::SentItem;
        let mut w = holding_7_at_epoch_2();
        w.active.get_mut(&7).unwrap().out = true;
        w.held.lock().unwrap().insert(7, (3, tokio::time::Instant::now()));
        let sent = SentItem {
            generation: 7,
            epoch: 2,
            finish: false,
            history_id: None,
        };
        w.absorb(&[sent], rejected(7));
        assert!(!w.active.contains_key(&7));
        assert_eq!(w.held.lock().unwrap().get(&7).map(|h| h.0), Some(3));
    }

    /// A finish detail over the log's limit is cut to it at a character (the log refused the
    /// whole item before, tokens included); one within it is kept as it is.
    #[test]
    fn a_finish_detail_is_cut_to_what_the_log_takes() {
        use tokenlog_raftlog::limits::FINISH_DETAIL_BYTES_MAX;
        let short = "model error: out of memory".to_string();
        assert_eq!(super::finish_detail(short.clone()), short);
        for long in ["x".repeat(5_000), "é".repeat(3_000), format!("a{}", "🦀".repeat(700))] {
            let d = super::finish_detail(long.clone());
            assert!(d.len() <= FINISH_DETAIL_BYTES_MAX, "{}", d.len());
            assert!(d.len() >= FINISH_DETAIL_BYTES_MAX - 6, "{}", d.len());
            assert!(d.ends_with('…'));
            assert!(long.starts_with(d.trim_end_matches('…')));
        }
    }

    #[test]
    fn a_thread_s_scheduler_statistics_count_its_time_on_a_cpu() {
        let (cpu0, wait0) = thread_schedstat().expect("/proc/thread-self/schedstat is readable");
        let began = Instant::now();
        // Spin until this thread has been on a CPU for 20 ms, however busy the host is.
        let mut x = 0u64;
        let (cpu1, wait1) = loop {
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
            let now = thread_schedstat().expect("readable again");
            if now.0 - cpu0 >= 20_000_000 {
                break now;
            }
            assert!(
                began.elapsed() < Duration::from_secs(20),
                "20 s of spinning counted {} ns on a CPU",
                now.0 - cpu0
            );
        };
        let wall = began.elapsed().as_nanos() as u64;
        // A thread that never sleeps is on a CPU or waiting for one: the two add up to its wall
        // time (less what the kernel had not accounted yet at the last read).
        let (on, waited) = (cpu1 - cpu0, wait1 - wait0);
        assert!(on <= wall + 1_000_000, "on a CPU {on} ns in {wall} ns of wall time");
        assert!(
            on + waited >= wall * 8 / 10,
            "on a CPU {on} ns + runnable {waited} ns of {wall} ns spinning"
        );
    }
}
