//! Planned handoff, the decoders' side (CONTRACT §7): a generation moves from a live owner (the
//! source) to another decoder of the same model and cache format (the destination) with its
//! cache, so the destination continues at once, with the numbers the source would have used.
//!
//! The log decides; the decoders only move bytes:
//!
//! | source                                   | log                  | destination                      |
//! |------------------------------------------|----------------------|----------------------------------|
//! | pauses the generation, every token acked |                      |                                  |
//! | copies cache + logits at that frontier F |                      |                                  |
//! | decodes on; checksums the copy           |                      |                                  |
//! | `Prepare` (manifest of F, destination)   | `prepared`           |                                  |
//! | `Copying`                                | `copying`            |                                  |
//! | streams header + blocks (`Transfer`)     |                      | checks model, format, checksum   |
//! | (appends records F.. at its epoch)       |                      | reads the committed prefix       |
//! | streams the rows it feeds (`Rows`)       |                      | keeps them by position           |
//! |                                          |                      | builds the state from the cache  |
//! |                                          |                      | follows records F.. from the log |
//! |                                          | `receiver_ready`     | `ReceiverReady` (process memory) |
//! |                                          |                      | follows the records since        |
//! | (its next append is fenced)              | `ownership_committed`| `Commit`: epoch + 1 at frontier G|
//! |                                          |                      | follows what is left up to G     |
//! | answer: committed → `SourceReleased`     | `source_released`    | decodes from G                   |
//!
//! The generation's client waits only while the cache is copied (a few ms) and from the commit
//! to the destination's first draw: the commit fences the source at whatever frontier G it
//! reached, and the destination's state is exact at G (`DecodeState::follow` feeds each record
//! as the source fed it). On a grouping-invariant engine (the CPU engine, the fake model) the
//! source copies while it decodes on (no pause at all), and streams, after the cache, the keys
//! and values of each position it feeds (`KvRow`s with their tokens and the logits it drew
//! from, on a `Rows` call beside the attempt's `Transfer`):
//! the destination appends those whose tokens are the log's committed records instead of
//! computing them (the same bits) and draws from the last one's logits, so that following the
//! records costs it no forward pass (before its commit it follows only as far as the rows go;
//! after it, it waits a little for the last ones, then computes what is missing).
//!
//! Whatever fails, nobody guesses: a source whose transfer broke or timed out asks the log
//! (`Get` shows the attempt's phase): committed means moved (the acknowledgment was lost), else
//! it aborts the attempt and goes on decoding. A destination that fails before its commit aborts
//! the attempt; its leases and sessions end as any decoder's would. Only the log's commit makes
//! the destination an owner, and only at the handoff epoch, so a late message of an earlier
//! attempt (or an earlier incarnation of the destination) changes nothing.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::time::Instant;

use tokenlog_proto::decoder as dpb;
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::{ClientError, LogClient};
use tokenlog_raftlog::types::Binding;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use crate::cache::{f32s_from_bytes, f32s_to_bytes, BlockKind, CacheBlock, CacheCopy, CacheExport};
use crate::history::{Answer, Call, DecoderEvent, History};
use crate::limits::{
    HANDOFF_CACHE_BLOCKS_MAX, HANDOFF_CACHE_BYTES_MAX, HANDOFF_CHUNK_BYTES, HANDOFF_ROWS_BYTES_MAX, HANDOFF_ROWS_FIND,
    HANDOFF_ROWS_LAG_MAX, HANDOFF_ROWS_QUEUE, HANDOFF_ROWS_WAIT, HANDOFF_TRANSFER_TIMEOUT,
};
use crate::resume::{DecodeState, Row};
use crate::worker::{model_work, HandoffPoint, StepHooks, WorkerError};
use crate::worker_lease::{read_prefix, read_records, Held};
use crate::Model;

/// Where a handoff's time went, for its log line: the milliseconds of each part in order.
pub(crate) struct Laps {
    at: Instant,
    parts: Vec<(&'static str, u128)>,
}

impl Laps {
    pub(crate) fn start() -> Self {
        Laps {
            at: Instant::now(),
            parts: Vec::new(),
        }
    }

    /// Ends the part `name` now.
    pub(crate) fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        self.parts.push((name, (now - self.at).as_millis()));
        self.at = now;
    }
}

impl std::fmt::Display for Laps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (name, ms)) in self.parts.iter().enumerate() {
            write!(f, "{}{name} {ms}", if i == 0 { "" } else { ", " })?;
        }
        Ok(())
    }
}

/// A generation that arrived with its cache and is now ours (the log committed it).
pub(crate) struct Received {
    pub id: u64,
    pub epoch: u64,
    pub committed: u32,
    pub state: DecodeState,
}

/// What the worker and its handoff listener share.
pub(crate) struct PortShared {
    pub decoder_id: String,
    pub model: Arc<dyn Model>,
    pub identity: pb::ModelIdentity,
    /// This model's cache format (`None`: it cannot take a handed-over cache).
    pub cache_format: Option<String>,
    pub client: LogClient,
    pub lease_ms: u64,
    pub capacity: usize,
    /// The decoder's `capacity` slots, taken by the worker's generations and by transfers.
    pub slots: Slots,
    /// Off while the worker drains or stops: transfers are refused.
    pub accepting: AtomicBool,
    pub incoming: mpsc::UnboundedSender<Received>,
    pub held: Held,
    pub history: Option<Arc<History>>,
    pub hooks: Option<Arc<dyn StepHooks>>,
    /// Planted bug `early-handoff-write` (see `WorkerConfig::plant_early_handoff_write`).
    pub plant_early_write: bool,
    /// Planted bug `false-commit` (see `WorkerConfig::plant_false_commit`).
    pub plant_false_commit: bool,
    /// Wakes the worker's idle loop when a generation arrives.
    pub wake: Arc<tokio::sync::Notify>,
    /// The rows of each attempt being received, by (generation, attempt, the source's key), for
    /// its `Rows` call.
    pub rows_in: Mutex<HashMap<(u64, u64, u64), RowsFound>>,
}

/// A decoder's generation slots, counted in one place for its worker and its handoff port:
/// looking at what is free and taking it is one step under one lock, so the two never both
/// take the last slot. (They were two counters, the worker's published after its steps: a
/// transfer that arrived while the worker took generations from the log, or took in a received
/// one, found a slot the worker had just filled, and the decoder held one over its capacity.)
pub(crate) struct Slots {
    capacity: usize,
    count: Mutex<SlotCount>,
}

#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
struct SlotCount {
    /// The worker's: active (those being handed out included), being copied, being taken.
    held: usize,
    /// Transfers being received, or received and not yet taken in by the worker.
    reserved: usize,
}

impl Slots {
    pub fn new(capacity: usize) -> Self {
        Slots {
            capacity,
            count: Default::default(),
        }
    }

    fn count(&self) -> std::sync::MutexGuard<'_, SlotCount> {
        self.count.lock().expect("slots lock")
    }

    /// Takes one slot for a transfer, unless every slot is taken.
    pub fn reserve(&self) -> bool {
        let mut c = self.count();
        if c.held + c.reserved >= self.capacity {
            return false;
        }
        c.reserved += 1;
        true
    }

    /// Gives a transfer's slot back (refused, failed, or released after its commit).
    pub fn unreserve(&self) {
        let mut c = self.count();
        assert!(c.reserved > 0, "a slot given back that no transfer held");
        c.reserved -= 1;
    }

    /// A received generation is in the worker's hands, which now hold `held`: its slot passes
    /// from the transfer to the worker in the same step.
    pub fn admit(&self, held: usize) {
        let mut c = self.count();
        assert!(c.reserved > 0, "a generation taken in that no transfer reserved");
        c.reserved -= 1;
        c.held = held;
    }

    /// The worker holds `held` generations.
    pub fn hold(&self, held: usize) {
        self.count().held = held;
    }

    /// How many generations the worker, holding `held`, could take now; nothing is claimed.
    pub fn free(&self, held: usize) -> usize {
        let c = self.count();
        self.capacity.saturating_sub(held + c.reserved)
    }

    /// The worker, holding `held`, takes up to `want` generations the log listed: how many it
    /// may take. They count as taken until its next [`Slots::hold`]. Claimed only once the log
    /// has named them: a claim of every free slot, made before the worker asked the log and
    /// held for the round trip, refused each transfer arriving meanwhile though the query most
    /// often found nothing.
    pub fn claim(&self, held: usize, want: usize) -> usize {
        let mut c = self.count();
        let n = self.capacity.saturating_sub(held + c.reserved).min(want);
        c.held = held + n;
        n
    }

    /// Slots of transfers not yet in the worker's hands.
    pub fn reserved(&self) -> usize {
        self.count().reserved
    }
}

/// The `decoder.v1.Handoff` service of a decoder: receives caches (`tokenlog decoder
/// --handoff-listen` serves it).
#[derive(Clone)]
pub struct HandoffPort {
    pub(crate) shared: Arc<PortShared>,
}

type Refusal = String;

impl HandoffPort {
    /// Receives one transfer; `Err` is a refusal (the attempt is aborted in the log when it
    /// names one).
    async fn receive(
        &self,
        who: Option<tokenlog_raftlog::tls::Holder>,
        mut inbound: tonic::Streaming<dpb::TransferChunk>,
    ) -> Result<dpb::TransferResult, Refusal> {
        let s = &self.shared;
        // A caller that sends nothing is answered, not waited for as long as it keeps the
        // connection open.
        let first = tokio::time::timeout(HANDOFF_TRANSFER_TIMEOUT, inbound.message())
            .await
            .map_err(|_| format!("no header within {HANDOFF_TRANSFER_TIMEOUT:?}"))?;
        let header = match first {
            Ok(Some(dpb::TransferChunk {
                part: Some(dpb::transfer_chunk::Part::Header(h)),
            })) => h,
            Ok(_) => return Err("a transfer starts with its header".into()),
            Err(e) => return Err(format!("the transfer broke before its header: {e}")),
        };
        let manifest = header.manifest.clone().unwrap_or_default();
        // The header is the caller's word. A refusal aborts the attempt in the log under this
        // decoder's id, which the log takes from either side of an attempt: so the caller must
        // hold the certificate of the source it names, and the log's attempt must name that
        // source and this destination, before this decoder aborts it. Any decoder certificate
        // could name another's attempt (readable with Get) in a header this decoder refused,
        // and the genuine handoff was aborted.
        let abort = |why: String| {
            let (client, id, attempt, source, by) = (
                s.client.clone(),
                header.generation_id,
                header.attempt,
                header.source.clone(),
                s.decoder_id.clone(),
            );
            let detail = why.clone();
            async move {
                if names_the_attempt(&client, id, attempt, &source, &by).await {
                    abort(&client, id, attempt, &by, &detail).await;
                }
                why
            }
        };
        if header.destination != s.decoder_id {
            return Err(format!("this is decoder {}, not {}", s.decoder_id, header.destination));
        }
        if let Err(status) = tokenlog_raftlog::auth::acts_as(who.as_ref(), &header.source) {
            return Err(format!(
                "a transfer from {:?} refused: {}",
                header.source,
                status.message()
            ));
        }
        if !s.accepting.load(Ordering::Acquire) {
            return Err(abort("this decoder is draining or stopping".into()).await);
        }
        if manifest.model.as_ref() != Some(&s.identity) {
            return Err(abort("this decoder serves another model".into()).await);
        }
        if s.cache_format.as_deref() != Some(manifest.cache_format.as_str()) {
            return Err(abort(format!(
                "cache format {:?}; this decoder holds {:?}",
                manifest.cache_format, s.cache_format
            ))
            .await);
        }
        if let Err(why) = manifest_fits(&manifest, s.model.as_ref()) {
            return Err(abort(why).await);
        }
        // One slot, taken now and given back unless the commit hands it to the worker.
        if !s.slots.reserve() {
            return Err(abort(format!("this decoder is full ({} generations)", s.capacity)).await);
        }
        let r = self.receive_into_slot(&header, &manifest, inbound).await;
        if r.is_err() {
            s.slots.unreserve();
        }
        match r {
            Ok(done) => Ok(done),
            Err(why) => Err(abort(why).await),
        }
    }

    async fn receive_into_slot(
        &self,
        header: &dpb::TransferHeader,
        manifest: &pb::CacheManifest,
        mut inbound: tonic::Streaming<dpb::TransferChunk>,
    ) -> Result<dpb::TransferResult, Refusal> {
        let s = &self.shared;
        let id = header.generation_id;
        let t0 = Instant::now();
        let mut laps = Laps::start();
        // The generation and its committed prefix, read while the blocks arrive.
        let client = s.client.clone();
        let frontier = manifest.frontier;
        // Its task ends with the transfer: a refused one (a bad block, a checksum) left it
        // reading until its own deadline.
        let (prefix_tx, prefix) = tokio::sync::oneshot::channel();
        let _prefix_read = AbortOnDrop(tokio::spawn(async move {
            let read = async {
                let info = client.generation(id).await?;
                let committed = read_prefix(&client, id, frontier).await?;
                Ok::<_, WorkerError>((info, committed))
            };
            let _ = prefix_tx.send(read.await);
        }));
        // The rows the source streams beside the cache (its `Rows` call), kept by position for
        // the follow passes while this attempt lasts.
        let positions = manifest.kv_positions as usize..s.model.max_context();
        let rows: SharedRows = Arc::new(Mutex::new(RowsIn::new(positions, header.rows_key != 0)));
        let _rows_in = RowsRegistered::new(s, (id, header.attempt, header.rows_key), &rows);
        // The source gives up on its transfer after `HANDOFF_TRANSFER_TIMEOUT`; a source that
        // stops sending holds this slot no longer than that.
        let cache = collect_cache(manifest, &mut inbound, HANDOFF_TRANSFER_TIMEOUT).await?;
        let got = cache.sha256();
        if got != manifest.cache_sha256 {
            return Err(format!(
                "the cache received hashes to {got}; the manifest names {}",
                manifest.cache_sha256
            ));
        }
        laps.lap("blocks");
        let (info, committed) = prefix
            .await
            .map_err(|_| "the committed prefix's read ended without an answer".to_string())?
            .map_err(|e| format!("the committed prefix is not readable: {e}"))?;
        laps.lap("prefix");
        if info.frontier < manifest.frontier {
            return Err(format!(
                "the log's frontier is {}; the cache covers {}",
                info.frontier, manifest.frontier
            ));
        }
        let binding: Binding = info.binding.clone().ok_or("the generation has no binding")?.into();
        // An acquire is refused by the log for a sampler of another version; a handoff never
        // acquires, so the destination checks it: under another sampler the continuation would
        // differ from the source's, silently (CONTRACT §1).
        let rng = crate::worker_hooks::rng_version(&s.hooks);
        if binding.sampling.rng_version != rng {
            return Err(format!(
                "the generation is bound to sampler version {}; this decoder draws with version {rng}",
                binding.sampling.rng_version
            ));
        }
        let prompt = binding.prompt_token_ids.clone();
        if prompt.is_empty() {
            return Err("the generation's prompt is not tokenized".into());
        }
        let model = s.model.clone();
        let c = committed.clone();
        // The copy may end short of the manifest's frontier (a source that copies while it
        // decodes leaves out the last committed position): the rest is prefilled with the
        // first records followed below, in one forward pass (the same bits on a
        // grouping-invariant model), not in one of its own here.
        let state = model_work(move || {
            DecodeState::resume_from_cache_deferred(
                model.as_ref(),
                &prompt,
                &c,
                binding.sampling,
                binding.stop,
                binding.mode,
                &cache,
            )
        })
        .await?
        .map_err(|e| format!("the cache does not load: {e}"))?;
        laps.lap("import");
        // The source decodes on until the commit: follow what it committed since the copy, so
        // that only the last few records are left to follow once the commit fences it.
        let (mut state, mut followed) = follow_log(&s.client, id, state, manifest.frontier, None, &rows).await?;
        laps.lap("follow");
        halt_at(&s.hooks, &s.history, HandoffPoint::DestinationBeforeReady, id);
        pause_at(
            s.hooks.as_ref().and_then(|h| h.ready_delay()),
            id,
            "ready-delay-ms: holding receiver_ready",
        )
        .await;
        let ready = step(
            &s.client,
            id,
            pb::handoff_request::Step::ReceiverReady(pb::HandoffReceiverReady {
                attempt: header.attempt,
                destination: s.decoder_id.clone(),
                handoff_epoch: header.handoff_epoch,
                cache_sha256: manifest.cache_sha256.clone(),
            }),
        )
        .await?;
        if !ready.ok {
            return Err(format!("the log refused receiver_ready: {:?}", ready.rejection));
        }
        laps.lap("receiver_ready");
        halt_at(&s.hooks, &s.history, HandoffPoint::DestinationAfterReady, id);
        // Again right before the commit, until a round finds at most one new record or no
        // fewer than the round before (this decoder follows no faster than the source writes):
        // what is left after the commit is then what the source committed during the last round
        // and the commit's own write (forward passes its client waits for, the source fenced).
        let mut last_round = u32::MAX;
        for _ in 0..crate::limits::HANDOFF_FOLLOW_ROUNDS_MAX {
            let before = followed;
            (state, followed) = follow_log(&s.client, id, state, followed, None, &rows).await?;
            let new = followed - before;
            if new <= 1 || new >= last_round {
                break;
            }
            last_round = new;
        }
        laps.lap("follow");
        let mut state = Some(state);
        if s.plant_early_write {
            tracing::error!(
                generation = id,
                "PLANTED BUG: decoding a handed-over generation before its ownership commit"
            );
            s.held
                .lock()
                .expect("lock")
                .insert(id, (header.handoff_epoch, Instant::now()));
            let _ = s.incoming.send(Received {
                id,
                epoch: header.handoff_epoch,
                committed: followed,
                state: state.take().expect("set above"),
            });
            s.wake.notify_one();
            // Long enough for the worker to write before the commit below.
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
        if !s.accepting.load(Ordering::Acquire) {
            return Err("this decoder began to stop before the commit".into());
        }
        pause_at(
            s.hooks.as_ref().and_then(|h| h.commit_delay()),
            id,
            "commit-delay-ms: holding the commit",
        )
        .await;
        let commit = pb::handoff_request::Step::Commit(pb::HandoffCommit {
            attempt: header.attempt,
            destination: s.decoder_id.clone(),
            handoff_epoch: header.handoff_epoch,
            lease_ms: s.lease_ms,
        });
        let hid = s.history.as_ref().map(|h| {
            h.invoke(Call::HandoffCommit {
                gen: id,
                attempt: header.attempt,
                source_epoch: header.handoff_epoch.saturating_sub(1),
                handoff_epoch: header.handoff_epoch,
            })
        });
        let mut answer = step(&s.client, id, commit).await;
        if answer.is_ok() && s.hooks.as_ref().is_some_and(|h| h.commit_answer_lost()) {
            tracing::error!(
                failpoint = "commit-answer-lost",
                generation = id,
                "failpoint fired: the commit's answer is dropped"
            );
            answer = Err("failpoint commit-answer-lost: the answer was dropped".into());
        }
        if let (Some(h), Some(hid)) = (&s.history, hid) {
            // A lost answer stays in doubt in the history, whatever the log says later.
            h.complete(hid, Answer::of_handoff_commit(answer.as_ref().ok()));
        }
        // The frontier the log granted at (the source's records up to the commit included).
        let granted = match answer {
            Ok(r) if r.ok => r.generation.map(|g| g.frontier),
            Ok(r) => return Err(format!("the log refused the commit: {:?}", r.rejection)),
            // The answer was lost: the log knows.
            Err(e) => {
                tracing::warn!(generation = id, error = %e, "commit answer lost; asking the log");
                if !resolve_lost_commit(&s.client, id, header.attempt, &s.decoder_id, header.handoff_epoch).await {
                    return Err("the commit did not apply".into());
                }
                None
            }
        };
        laps.lap("commit");
        halt_at(&s.hooks, &s.history, HandoffPoint::DestinationAfterCommit, id);
        // Ours from here: renewed at once, decoded by the worker from its next loop. (With the
        // planted early write the worker has had it since receiver_ready, and dropped it when
        // the log refused its early appends: not renewed, its lease lapses and another decoder
        // takes it over, so that a run with the plant still ends.)
        let Some(state) = state else {
            return Ok(dpb::TransferResult {
                committed: true,
                epoch: header.handoff_epoch,
                detail: String::new(),
            });
        };
        s.held
            .lock()
            .expect("lock")
            .insert(id, (header.handoff_epoch, Instant::now()));
        // The records the source committed between our follow and the commit.
        let caught_up = if s.hooks.as_ref().is_some_and(|h| h.catch_up_read_fails()) {
            tracing::error!(
                failpoint = "catch-up-read-fails",
                generation = id,
                "failpoint fired: the catch-up read fails"
            );
            if let Some(h) = &s.history {
                h.event(DecoderEvent::Failpoint {
                    name: "catch-up-read-fails=1".into(),
                    gen: id,
                    epoch: header.handoff_epoch,
                    seq: followed,
                    token: None,
                });
            }
            Err("failpoint catch-up-read-fails: the read failed".to_string())
        } else {
            catch_up(&s.client, id, state, followed, granted, &rows).await
        };
        let (state, frontier) = match caught_up {
            Ok(x) => x,
            Err(why) => {
                // Ours, but without a state to continue it: back to the log for a takeover.
                tracing::error!(
                    generation = id,
                    why,
                    "the records before the commit are not followed: releasing it"
                );
                s.held.lock().expect("lock").remove(&id);
                // The slot taken for it goes back: the worker never takes this one in.
                s.slots.unreserve();
                crate::worker::release(&s.client, s.history.as_deref(), id, header.handoff_epoch).await;
                return Ok(dpb::TransferResult {
                    committed: true,
                    epoch: header.handoff_epoch,
                    detail: format!("committed, then released: {why}"),
                });
            }
        };
        laps.lap("catch_up");
        if let Some(h) = &s.history {
            h.event(DecoderEvent::HandoffReceived {
                gen: id,
                attempt: header.attempt,
                epoch: header.handoff_epoch,
                from: header.source.clone(),
                frontier,
                kv: state.covered_positions() as u32,
            });
        }
        tracing::info!(
            generation = id,
            attempt = header.attempt,
            epoch = header.handoff_epoch,
            from = header.source,
            cache_frontier = manifest.frontier,
            frontier,
            bytes = manifest.bytes,
            rows = state.stats().appended_rows,
            ms = t0.elapsed().as_millis() as u64,
            parts = %laps,
            "generation received with its cache"
        );
        let _ = s.incoming.send(Received {
            id,
            epoch: header.handoff_epoch,
            committed: frontier,
            state,
        });
        s.wake.notify_one();
        Ok(dpb::TransferResult {
            committed: true,
            epoch: header.handoff_epoch,
            detail: String::new(),
        })
    }
}

#[tonic::async_trait]
impl dpb::handoff_server::Handoff for HandoffPort {
    async fn transfer(
        &self,
        req: Request<tonic::Streaming<dpb::TransferChunk>>,
    ) -> Result<Response<dpb::TransferResult>, Status> {
        // In a task of its own: a caller that goes away (its stream reset, its timeout) must not
        // cancel a receive halfway, with its slot taken or its commit proposed.
        let port = self.clone();
        let who = tokenlog_raftlog::auth::caller(&req);
        let inbound = req.into_inner();
        if self.shared.plant_false_commit {
            tracing::warn!("PLANTED: answering a transfer committed without taking it");
            return Ok(Response::new(dpb::TransferResult {
                committed: true,
                epoch: 0,
                detail: "PLANTED false commit".into(),
            }));
        }
        let outcome = tokio::spawn(async move { port.receive(who, inbound).await })
            .await
            .unwrap_or_else(|e| Err(format!("the receive failed: {e}")));
        let result = match outcome {
            Ok(r) => r,
            Err(detail) => {
                tracing::warn!(detail, "handoff refused");
                dpb::TransferResult {
                    committed: false,
                    epoch: 0,
                    detail,
                }
            }
        };
        Ok(Response::new(result))
    }

    async fn rows(&self, req: Request<tonic::Streaming<dpb::RowsChunk>>) -> Result<Response<dpb::RowsResult>, Status> {
        let kept = self.receive_rows(req.into_inner()).await?;
        Ok(Response::new(dpb::RowsResult { kept }))
    }
}

impl HandoffPort {
    /// The tonic service, with message limits fit for a cache.
    pub fn service(&self) -> dpb::handoff_server::HandoffServer<HandoffPort> {
        dpb::handoff_server::HandoffServer::new(self.clone())
            .max_decoding_message_size(HANDOFF_CHUNK_BYTES * 2)
            .max_encoding_message_size(HANDOFF_CHUNK_BYTES * 2)
    }
}

/// Whether the cache `m` describes fits this model: a frontier within its context, no more
/// positions than its context, and no
/// more bytes than its cache of those positions and one position's logits (and at most
/// `HANDOFF_CACHE_BYTES_MAX`). The destination holds up to the manifest's bytes while it
/// receives: they were bounded by the limit alone, 4 GiB for a model whose whole context takes
/// a few hundred MB.
fn manifest_fits(m: &pb::CacheManifest, model: &dyn Model) -> Result<(), Refusal> {
    // The destination reads that many committed records while the blocks arrive: a frontier
    // past any context (u32::MAX) was an allocation of 16 GiB, before anything was checked.
    if m.frontier as usize > model.max_context() {
        return Err(format!(
            "a cache at frontier {}; this model's context holds {}",
            m.frontier,
            model.max_context()
        ));
    }
    let positions = m.kv_positions as usize;
    if positions > model.max_context() {
        return Err(format!(
            "a cache of {positions} positions; this model's context holds {}",
            model.max_context()
        ));
    }
    let most = model
        .cache_bytes(positions)
        .map_or(HANDOFF_CACHE_BYTES_MAX, |kv| {
            kv.saturating_add(4 * model.vocab_size() as u64)
        })
        .min(HANDOFF_CACHE_BYTES_MAX);
    if m.bytes > most {
        return Err(format!(
            "a cache of {} bytes for {positions} positions; this model's holds at most {most}",
            m.bytes
        ));
    }
    Ok(())
}

/// The blocks and logits of a transfer, reassembled (a block may come in several chunks:
/// consecutive messages of the same layer and kind append to its bytes), all of them within
/// `within`, at most `HANDOFF_CACHE_BLOCKS_MAX` blocks and the manifest's bytes.
async fn collect_cache<S>(
    manifest: &pb::CacheManifest,
    inbound: &mut S,
    within: Duration,
) -> Result<CacheExport, Refusal>
where
    S: futures::Stream<Item = Result<dpb::TransferChunk, Status>> + Unpin,
{
    use futures::StreamExt;
    let deadline = Instant::now() + within;
    let mut blocks: Vec<CacheBlock> = Vec::new();
    let mut logits_bytes: Vec<u8> = Vec::new();
    let mut total = 0u64;
    loop {
        let next = tokio::time::timeout_at(deadline, inbound.next())
            .await
            .map_err(|_| format!("the cache did not arrive within {within:?}"))?;
        let t = match next {
            Some(Ok(dpb::TransferChunk {
                part: Some(dpb::transfer_chunk::Part::Tensor(t)),
            })) => t,
            Some(Ok(_)) => return Err("a second header in one transfer".into()),
            None => break,
            Some(Err(e)) => return Err(format!("the transfer broke: {e}")),
        };
        total += t.data.len() as u64;
        if total > manifest.bytes || total > HANDOFF_CACHE_BYTES_MAX {
            return Err(format!("more bytes than the manifest's {}", manifest.bytes));
        }
        if t.kind == "logits" {
            logits_bytes.extend_from_slice(&t.data);
            continue;
        }
        let kind = BlockKind::parse(&t.kind).ok_or_else(|| format!("unknown tensor kind {:?}", t.kind))?;
        let full = blocks.len() == HANDOFF_CACHE_BLOCKS_MAX;
        match blocks.last_mut() {
            Some(b) if b.layer == t.layer && b.kind == kind && t.shape.is_empty() => b.data.extend_from_slice(&t.data),
            _ if full => return Err(format!("more than {HANDOFF_CACHE_BLOCKS_MAX} cache blocks")),
            _ => blocks.push(CacheBlock {
                layer: t.layer,
                kind,
                dtype: t.dtype,
                shape: t.shape,
                data: t.data,
            }),
        }
    }
    if total != manifest.bytes {
        return Err(format!("{total} bytes received; the manifest names {}", manifest.bytes));
    }
    for b in &blocks {
        b.check().map_err(|e| e.to_string())?;
    }
    Ok(CacheExport {
        format: manifest.cache_format.clone(),
        positions: manifest.kv_positions,
        blocks,
        logits: f32s_from_bytes(&logits_bytes).map_err(|e| e.to_string())?,
    })
}

/// A transfer's messages: the header, each block in chunks of at most `HANDOFF_CHUNK_BYTES`
/// (the first chunk carries the dtype and shape), then the logits.
fn transfer_messages(header: dpb::TransferHeader, cache: &CacheExport) -> Vec<dpb::TransferChunk> {
    use dpb::transfer_chunk::Part;
    let mut out = vec![dpb::TransferChunk {
        part: Some(Part::Header(header)),
    }];
    for b in &cache.blocks {
        for (i, chunk) in b.data.chunks(HANDOFF_CHUNK_BYTES).enumerate() {
            out.push(dpb::TransferChunk {
                part: Some(Part::Tensor(dpb::KvTensor {
                    layer: b.layer,
                    kind: b.kind.name().into(),
                    dtype: if i == 0 { b.dtype.clone() } else { String::new() },
                    shape: if i == 0 { b.shape.clone() } else { Vec::new() },
                    data: chunk.to_vec(),
                })),
            });
        }
    }
    out.push(dpb::TransferChunk {
        part: Some(Part::Tensor(dpb::KvTensor {
            layer: 0,
            kind: "logits".into(),
            dtype: "f32".into(),
            shape: vec![cache.logits.len() as u32],
            data: f32s_to_bytes(&cache.logits),
        })),
    });
    out
}

async fn step(client: &LogClient, id: u64, step: pb::handoff_request::Step) -> Result<pb::HandoffResponse, String> {
    client
        .handoff(pb::HandoffRequest {
            generation_id: id,
            step: Some(step),
        })
        .await
        .map_err(|e| e.to_string())
}

/// Asks the log to give attempt `attempt` up; its answer.
async fn abort_step(
    client: &LogClient,
    id: u64,
    attempt: u64,
    by: &str,
    detail: &str,
) -> Result<pb::HandoffResponse, String> {
    step(
        client,
        id,
        pb::handoff_request::Step::Abort(pb::HandoffAbort {
            attempt,
            by: by.to_string(),
            detail: detail.chars().take(256).collect(),
        }),
    )
    .await
}

/// Whether the log's latest attempt of generation `id` is `attempt`, from `source` to
/// `destination`: what a transfer's header claims, before the destination acts on it. No
/// answer from the log counts as no (the log's phase timeout ends a real attempt anyway).
async fn names_the_attempt(client: &LogClient, id: u64, attempt: u64, source: &str, destination: &str) -> bool {
    if attempt == 0 {
        return false;
    }
    match client
        .get(pb::GetRequest {
            generation_id: id,
            ..Default::default()
        })
        .await
    {
        Ok(r) => r
            .handoff
            .is_some_and(|h| h.attempt == attempt && h.source == source && h.destination == destination),
        Err(e) => {
            tracing::warn!(generation = id, attempt, error = %e, "the log did not say whose attempt this is");
            false
        }
    }
}

/// Best effort: the attempt is given up (a refused abort means it was over already).
async fn abort(client: &LogClient, id: u64, attempt: u64, by: &str, detail: &str) {
    if attempt == 0 {
        return;
    }
    if let Err(e) = abort_step(client, id, attempt, by, detail).await {
        tracing::warn!(generation = id, attempt, error = %e, "abort not recorded (the log's timeout will)");
    }
}

/// A commit whose answer was lost: whether it applied. Our own abort of the attempt settles it
/// (log order decides): applied before the commit it wins and the commit will be refused;
/// after it, it is refused and the generation is ours. Retried until the log answers or the
/// transfer's timeout passes (then: not ours; if the commit did apply, the lease lapses and the
/// generation is taken over like any orphan).
async fn resolve_lost_commit(client: &LogClient, id: u64, attempt: u64, me: &str, epoch: u64) -> bool {
    let deadline = Instant::now() + HANDOFF_TRANSFER_TIMEOUT;
    loop {
        match abort_step(client, id, attempt, me, "the destination's commit answer was lost").await {
            Ok(resp) if resp.ok => return false,
            Ok(_) => {
                if let Ok(g) = client.generation(id).await {
                    return g.lease.is_some_and(|l| l.owner == me && l.epoch == epoch);
                }
            }
            Err(e) => tracing::debug!(generation = id, error = %e, "abort unanswered; retrying"),
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Follows generation `id`'s committed records `from..upto` on `state`, a copy of the cache at
/// `from` records: the state and the frontier it reached. `upto` `None` (before the commit): up
/// to the log's frontier now, or, while the source streams rows, only as far as its rows with
/// logits go when that is at most `HANDOFF_ROWS_LAG_MAX` records short of the frontier
/// (nothing at all, not even a deferred position, when none has come yet). Exact as the source's own feeding (`DecodeState::follow`). The positions a loaded
/// cache left out (a deferred prefill) go into the same forward pass, ahead of the records.
async fn follow_log(
    client: &LogClient,
    id: u64,
    mut state: DecodeState,
    from: u32,
    upto: Option<u32>,
    rows: &SharedRows,
) -> Result<(DecodeState, u32), String> {
    let upto = match upto {
        Some(f) => f,
        None => {
            let frontier = client.generation(id).await.map_err(|e| e.to_string())?.frontier;
            // Before the commit, as far as the source's rows and logits go (no forward pass)
            // when they are not far behind the log; the catch-up after it follows the rest.
            // A source that sends no rows (an engine without them, an older release): up to
            // the frontier, computed.
            let (start, prompt) = (state.kv_positions(), state.frontiers().prompt_len);
            let (streams, by_rows) = {
                let r = rows.lock().expect("lock");
                let by_rows = r.last_with_logits(start).and_then(|q| (q + 1).checked_sub(prompt));
                (r.streams(), by_rows.map(|n| n as u32))
            };
            // No rows past what is followed yet: nothing now, not even a deferred position
            // (they come with the source's next step), unless the log is further ahead.
            if streams && by_rows.is_none() && frontier.saturating_sub(from) <= HANDOFF_ROWS_LAG_MAX {
                return Ok((state, from));
            }
            match by_rows {
                Some(r) if frontier.saturating_sub(r) <= HANDOFF_ROWS_LAG_MAX => r.min(frontier).max(from),
                _ => frontier,
            }
        }
    };
    if upto <= from && !state.prefilling() {
        return Ok((state, from));
    }
    let records = if upto > from {
        read_records(client, id, from, upto)
            .await
            .map_err(|e| format!("records {from}..{upto} are not readable: {e}"))?
    } else {
        // No new record: only the positions the loaded cache left out are fed.
        Vec::new()
    };
    let upto = upto.max(from);
    // The last record fed too: the worker's first draw after the commit is then at once,
    // without a forward pass of its own.
    let rows = rows.clone();
    let take = move |first: usize, n: usize| rows.lock().expect("lock").take(first, n);
    let state = model_work(move || state.follow_all_fed_with(&records, take).map(|()| state))
        .await?
        .map_err(|e| format!("records {from}..{upto} do not follow: {e}"))?;
    Ok((state, upto))
}

/// After the commit: follows the records up to the frontier granted (`None`: the answer was
/// lost, the log's frontier now, which is the same: the source is fenced and this decoder has
/// not written). The source feeds the last records it wrote in its next step and sends their
/// rows with the logits it draws from: waited for a little (`HANDOFF_ROWS_WAIT`), they spare
/// a forward pass that the client would wait for as long.
async fn catch_up(
    client: &LogClient,
    id: u64,
    state: DecodeState,
    followed: u32,
    granted: Option<u32>,
    rows: &SharedRows,
) -> Result<(DecodeState, u32), String> {
    let granted = match granted {
        Some(g) => g,
        None => client.generation(id).await.map_err(|e| e.to_string())?.frontier,
    };
    if granted > followed {
        let (start, prompt) = (state.kv_positions(), state.frontiers().prompt_len);
        wait_for_rows(rows, start, prompt + granted as usize - 1).await;
    }
    follow_log(client, id, state, followed, Some(granted), rows).await
}

/// Waits up to `HANDOFF_ROWS_WAIT` for the rows from `start` to reach position `last` with its
/// logits, while the source sends rows.
async fn wait_for_rows(rows: &SharedRows, start: usize, last: usize) {
    let deadline = Instant::now() + HANDOFF_ROWS_WAIT;
    let missing = || {
        let r = rows.lock().expect("lock");
        // A source that sends none, or sends no more: nothing to wait for.
        r.streams() && r.last_with_logits(start).is_none_or(|q| q < last)
    };
    while missing() && Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Rows a source streamed after the cache ([`dpb::KvRow`]), by position, until a follow pass
/// takes them.
#[derive(Default)]
pub(crate) struct RowsIn {
    rows: BTreeMap<usize, Row>,
    /// Bytes of the rows held (at most `HANDOFF_ROWS_BYTES_MAX`).
    bytes: usize,
    /// Rows received in all, kept or not.
    received: u64,
    /// The source's `Rows` call ended: no more will come.
    ended: bool,
    /// The source said it sends rows.
    expected: bool,
    /// The positions a row may be for: from the cache's end to the model's context.
    positions: std::ops::Range<usize>,
}

type SharedRows = Arc<Mutex<RowsIn>>;
/// An attempt's rows as its `Rows` call finds them: gone once the attempt ends.
pub(crate) type RowsFound = Weak<Mutex<RowsIn>>;

impl RowsIn {
    /// Takes out the rows of positions `first..first + n` that come one after the other from
    /// `first` (none when `first` is missing), and drops those before `first` (never asked
    /// for again: the state is past them).
    fn take(&mut self, first: usize, n: usize) -> Vec<Row> {
        let later = self.rows.split_off(&first);
        let before = std::mem::replace(&mut self.rows, later);
        self.bytes -= before.values().map(row_bytes).sum::<usize>();
        let mut out = Vec::new();
        while out.len() < n {
            let Some(row) = self.rows.remove(&(first + out.len())) else {
                break;
            };
            self.bytes -= row_bytes(&row);
            out.push(row);
        }
        out
    }

    /// `expected`: the source said it sends rows (a `rows_key` in its header).
    fn new(positions: std::ops::Range<usize>, expected: bool) -> Self {
        RowsIn {
            positions,
            expected,
            ..Default::default()
        }
    }

    /// Whether the source sends rows (it said so, and its call has not ended).
    fn streams(&self) -> bool {
        self.expected && !self.ended
    }

    /// The last position of the run of rows from `start` whose row carries logits.
    fn last_with_logits(&self, start: usize) -> Option<usize> {
        self.rows
            .range(start..)
            .enumerate()
            .take_while(|(i, (&q, _))| q == start + i)
            .filter(|(_, (_, r))| r.logits.is_some())
            .map(|(_, (&q, _))| q)
            .last()
    }

    /// Keeps `row` unless it is for a position outside `positions` or would pass
    /// `HANDOFF_ROWS_BYTES_MAX` (then that position is computed); logits of any length but
    /// `vocab` are left out.
    fn keep(&mut self, row: dpb::KvRow, vocab: usize) -> bool {
        self.received += 1;
        let position = row.position as usize;
        if !self.positions.contains(&position) {
            return false;
        }
        let row_in = Row {
            token: row.token,
            data: row.data,
            logits: (row.logits.len() == vocab).then_some(row.logits),
        };
        let replaced = self.rows.get(&position).map_or(0, row_bytes);
        let bytes = row_bytes(&row_in);
        if self.bytes - replaced + bytes > HANDOFF_ROWS_BYTES_MAX {
            return false;
        }
        self.bytes = self.bytes - replaced + bytes;
        self.rows.insert(position, row_in);
        true
    }
}

/// What a row held costs against `HANDOFF_ROWS_BYTES_MAX`: its bytes and logits, and a fixed
/// part for its entry (so that empty rows are not free).
fn row_bytes(r: &Row) -> usize {
    64 + r.data.len() + r.logits.as_ref().map_or(0, |l| l.len() * 4)
}

/// A fresh secret for an attempt's rows ([`dpb::TransferHeader::rows_key`]), never 0.
fn rows_key() -> u64 {
    crate::worker_lease::random_nonzero()
}

/// Aborts a task when dropped (a source's `Rows` call ends with its transfer).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An attempt's rows, findable by its `Rows` call while the attempt is being received.
struct RowsRegistered<'a> {
    shared: &'a PortShared,
    key: (u64, u64, u64),
}

impl<'a> RowsRegistered<'a> {
    fn new(shared: &'a PortShared, key: (u64, u64, u64), rows: &SharedRows) -> Self {
        shared.rows_in.lock().expect("lock").insert(key, Arc::downgrade(rows));
        RowsRegistered { shared, key }
    }
}

impl Drop for RowsRegistered<'_> {
    fn drop(&mut self) {
        self.shared.rows_in.lock().expect("lock").remove(&self.key);
    }
}

impl HandoffPort {
    /// Reads a `Rows` call into its attempt's rows until the call or the attempt ends; the rows
    /// kept. Its transfer may not have begun yet: it is waited for up to `HANDOFF_ROWS_FIND`.
    async fn receive_rows(&self, mut inbound: tonic::Streaming<dpb::RowsChunk>) -> Result<u64, Status> {
        let s = &self.shared;
        let first = tokio::time::timeout(HANDOFF_TRANSFER_TIMEOUT, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded(format!("no header within {HANDOFF_TRANSFER_TIMEOUT:?}")))?;
        let header = match first {
            Ok(Some(dpb::RowsChunk {
                part: Some(dpb::rows_chunk::Part::Header(h)),
            })) => h,
            Ok(_) => return Err(Status::invalid_argument("rows start with their header")),
            Err(e) => return Err(Status::cancelled(format!("the rows broke before their header: {e}"))),
        };
        if header.destination != s.decoder_id {
            return Err(Status::failed_precondition(format!(
                "this is decoder {}, not {}",
                s.decoder_id, header.destination
            )));
        }
        // Only the attempt's source knows its key (a source that sends rows draws it at random).
        let key = (header.generation_id, header.attempt, header.rows_key);
        if header.rows_key == 0 {
            return Err(Status::invalid_argument("rows name their attempt's key"));
        }
        let deadline = Instant::now() + HANDOFF_ROWS_FIND;
        let rows = loop {
            if let Some(r) = s.rows_in.lock().expect("lock").get(&key) {
                break r.clone();
            }
            if Instant::now() >= deadline {
                // Refused, or over already.
                return Ok(0);
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        };
        let vocab = s.model.vocab_size();
        let (mut kept, mut dropped) = (0u64, 0u64);
        // However the call ends, its rows have ended: the follow passes then stop waiting.
        let end = || {
            if let Some(rows) = rows.upgrade() {
                rows.lock().expect("lock").ended = true;
            }
        };
        loop {
            // A silent call ends with its attempt: checked once a second while nothing comes.
            let next = match tokio::time::timeout(std::time::Duration::from_secs(1), inbound.message()).await {
                Ok(next) => next,
                Err(_) if rows.strong_count() == 0 => break,
                Err(_) => continue,
            };
            let row = match next {
                Ok(Some(dpb::RowsChunk {
                    part: Some(dpb::rows_chunk::Part::Row(r)),
                })) => r,
                Ok(Some(other)) => {
                    end();
                    return Err(Status::invalid_argument(match other.part {
                        Some(_) => "a second header in one call",
                        None => "a rows message without a part",
                    }));
                }
                Ok(None) | Err(_) => {
                    end();
                    break;
                }
            };
            // The attempt is over: nothing more to keep.
            let Some(rows) = rows.upgrade() else {
                break;
            };
            if rows.lock().expect("lock").keep(row, vocab) {
                kept += 1;
            } else {
                if dropped == 0 {
                    tracing::debug!(generation = key.0, "rows over the limit held: computing the rest");
                }
                dropped += 1;
            }
        }
        Ok(kept)
    }
}

/// A failpoint's pause of `delay` (none when it is not set) in generation `id`'s handoff, said
/// in the log first as "failpoint {what}" (tests wait for that line).
async fn pause_at(delay: Option<std::time::Duration>, id: u64, what: &str) {
    if let Some(d) = delay {
        tracing::warn!(generation = id, ms = d.as_millis() as u64, "failpoint {what}");
        tokio::time::sleep(d).await;
    }
}

/// Whether the log holds attempt `ours` as committed (or released) now; false when it does not,
/// or cannot be read.
async fn committed_in_log(client: &LogClient, ours: &pb::HandoffInfo) -> bool {
    phase_in_log(client, ours).await.unwrap_or(false)
}

/// Whether the log holds attempt `ours` as committed (or released) now, read linearizably; an
/// error when it cannot be read.
async fn phase_in_log(client: &LogClient, ours: &pb::HandoffInfo) -> Result<bool, String> {
    let r = client
        .get(pb::GetRequest {
            generation_id: ours.generation_id,
            linearizable: true,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    Ok(r.handoff.is_some_and(|now| moved_by(ours, &now)))
}

/// Whether the log's attempt `now` (the latest of the generation: the log holds one) says that
/// attempt `ours` moved the generation. Either it is ours, committed or released; or it is a
/// later one prepared by our destination at our handoff epoch: only the owner prepares, at the
/// epoch it holds, so ownership passed to our destination at that epoch. (Were ours aborted,
/// the same would take a takeover of that epoch by the same decoder, after our lease lapsed
/// while we renewed it; the generation is not ours at our epoch either way.) Before, a later
/// attempt was taken for "not moved": a source slow to release a committed handoff, whose new
/// owner had already handed the generation on, recorded it as aborted and kept decoding it.
fn moved_by(ours: &pb::HandoffInfo, now: &pb::HandoffInfo) -> bool {
    if now.attempt == ours.attempt {
        return matches!(
            pb::HandoffPhase::try_from(now.phase),
            Ok(pb::HandoffPhase::OwnershipCommitted | pb::HandoffPhase::SourceReleased)
        );
    }
    now.attempt > ours.attempt && now.source == ours.destination && now.source_epoch == ours.handoff_epoch
}

/// What the log says became of a handoff attempt whose answer the source did not get.
enum Settled {
    /// Ownership moved: the destination's commit applied.
    Committed,
    /// The attempt is over without moving it (our abort applied, or it ended otherwise).
    Aborted,
    /// The log did not answer in time.
    Unknown,
}

/// What handing a generation out came to.
pub(crate) enum Outcome {
    /// The destination owns it at `epoch`; the source forgets it.
    Moved { to: String, epoch: u64 },
    /// The source still owns it (at its epoch) and goes on decoding it. `again`: a destination
    /// was there but refused or failed (full, unreachable, its transfer broke): a drain tries
    /// once more later; not when no decoder takes handoffs or the cache could not be sent.
    Kept { why: String, again: bool },
}

/// What a source needs to hand generations out.
#[derive(Clone)]
pub(crate) struct Source {
    pub decoder_id: String,
    pub identity: pb::ModelIdentity,
    pub client: LogClient,
    pub history: Option<Arc<History>>,
    pub hooks: Option<Arc<dyn StepHooks>>,
}

/// Ends the process at `point` when a failpoint says so (fault-suite builds): as a kill would,
/// after a `failpoint` line in the history.
fn halt_at(hooks: &Option<Arc<dyn StepHooks>>, history: &Option<Arc<History>>, point: HandoffPoint, gen: u64) {
    if !hooks.as_ref().is_some_and(|h| h.handoff_exit(point)) {
        return;
    }
    tracing::error!(failpoint = point.name(), generation = gen, "failpoint fired: exiting");
    if let Some(h) = history {
        h.event(DecoderEvent::Failpoint {
            name: format!("handoff-exit={}", point.name()),
            gen,
            epoch: 0,
            seq: 0,
            token: None,
        });
    }
    std::process::exit(crate::worker::HALT_EXIT_CODE);
}

impl Source {
    /// The other decoders of our model that take handoffs, in the order to try them for `id`
    /// (only `to` when it is named).
    async fn destinations(&self, id: u64, to: Option<&str>) -> Vec<(String, String)> {
        let Ok(models) = self.client.list_models().await else {
            return Vec::new();
        };
        let mut out: Vec<(String, String)> = models
            .models
            .into_iter()
            .filter(|m| m.identity.as_ref() == Some(&self.identity))
            .flat_map(|m| m.handoff_addrs.into_iter())
            .filter(|(d, _)| *d != self.decoder_id && to.is_none_or(|t| d.as_str() == t))
            .collect();
        out.sort();
        if !out.is_empty() {
            let n = out.len();
            out.rotate_left((id as usize) % n);
        }
        out
    }

    /// Hands generation `id` (ours at `epoch`) to another decoder (`to`, or trying each
    /// candidate until one takes it), with `cache`: a copy of its cache over `committed` records
    /// (all of their positions, or all but the last when it was copied while the generation
    /// decoded on). The generation decodes on at the source meanwhile; the destination
    /// prefills what the copy leaves out and follows the records past `committed` from the log.
    /// `rows`: the rows the source feeds past the copy ([`RowsOut`]), sent after the cache to
    /// each destination tried.
    pub async fn hand_out(
        &self,
        id: u64,
        epoch: u64,
        committed: u32,
        cache: CacheCopy,
        to: Option<String>,
        rows: Option<RowsFeed>,
    ) -> Outcome {
        let mut laps = Laps::start();
        // The copy's blocks are built here, off the generation's steps, then hashed.
        let manifest = model_work(move || {
            let cache = cache.export()?;
            let m = pb::CacheManifest {
                model: None,
                cache_format: cache.format.clone(),
                frontier: committed,
                kv_positions: cache.positions,
                cache_sha256: cache.sha256(),
                bytes: cache.bytes(),
            };
            Ok::<_, crate::Error>((m, cache))
        })
        .await;
        let (mut manifest, cache) = match manifest {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => {
                return Outcome::Kept {
                    why: format!("the cache's blocks were not built: {e}"),
                    again: false,
                }
            }
            Err(_) => {
                return Outcome::Kept {
                    why: "the cache's blocks or checksum were not computed".into(),
                    again: false,
                }
            }
        };
        manifest.model = Some(self.identity.clone());
        laps.lap("checksum");
        let candidates = self.destinations(id, to.as_deref()).await;
        laps.lap("destinations");
        if candidates.is_empty() {
            return Outcome::Kept {
                why: "no other decoder of this model takes handoffs".to_string(),
                again: false,
            };
        }
        let (mut why, mut again) = (String::new(), true);
        for (dest, addr) in candidates {
            match self
                .try_one(
                    id,
                    epoch,
                    &manifest,
                    &cache,
                    &dest,
                    &addr,
                    &mut laps,
                    rows.as_ref().map(RowsFeed::attempt),
                )
                .await
            {
                Ok(new_epoch) => {
                    return Outcome::Moved {
                        to: dest,
                        epoch: new_epoch,
                    }
                }
                Err(Stop::Next(w)) => why = format!("{dest}: {w}"),
                Err(Stop::Done(w)) => {
                    // The log did not answer or took another course: not tried again.
                    (why, again) = (format!("{dest}: {w}"), false);
                    break;
                }
            }
        }
        Outcome::Kept { why, again }
    }

    /// One attempt towards `dest`; the handoff epoch when it moved.
    async fn try_one(
        &self,
        id: u64,
        epoch: u64,
        manifest: &pb::CacheManifest,
        cache: &CacheExport,
        dest: &str,
        addr: &str,
        laps: &mut Laps,
        rows: Option<mpsc::Receiver<dpb::KvRow>>,
    ) -> Result<u64, Stop> {
        let t0 = Instant::now();
        let prepared = step(
            &self.client,
            id,
            pb::handoff_request::Step::Prepare(pb::HandoffPrepare {
                epoch,
                source: self.decoder_id.clone(),
                destination: dest.to_string(),
                manifest: Some(manifest.clone()),
            }),
        )
        .await
        .map_err(Stop::Done)?;
        let Some(h) = prepared.handoff.filter(|_| prepared.ok) else {
            // Not the owner any more (or the generation ended): nothing more to try.
            let rej = prepared.rejection.unwrap_or_default();
            let stop = match pb::RejectReason::try_from(rej.reason) {
                Ok(pb::RejectReason::ModelMismatch | pb::RejectReason::NotFound | pb::RejectReason::Invalid) => {
                    Stop::Next
                }
                _ => Stop::Done,
            };
            return Err(stop(format!("prepare refused: {}", rej.message)));
        };
        let attempt = h.attempt;
        laps.lap("prepare");
        let record = |phase: &str, detail: String| {
            if let Some(hist) = &self.history {
                hist.event(DecoderEvent::HandoffOut {
                    gen: id,
                    attempt,
                    epoch,
                    to: dest.to_string(),
                    phase: phase.to_string(),
                    detail,
                });
            }
        };
        record("prepared", String::new());
        let copying = step(
            &self.client,
            id,
            pb::handoff_request::Step::Copying(pb::HandoffCopying {
                attempt,
                source: self.decoder_id.clone(),
            }),
        )
        .await;
        if !copying.as_ref().is_ok_and(|r| r.ok) {
            let why = format!("copying not recorded: {copying:?}");
            abort(&self.client, id, attempt, &self.decoder_id, &why).await;
            return Err(Stop::Done(why));
        }
        laps.lap("copying");
        halt_at(&self.hooks, &self.history, HandoffPoint::SourceCopying, id);
        let header = dpb::TransferHeader {
            generation_id: id,
            attempt,
            handoff_epoch: h.handoff_epoch,
            source: self.decoder_id.clone(),
            destination: dest.to_string(),
            manifest: Some(manifest.clone()),
            rows_key: if rows.is_some() { rows_key() } else { 0 },
        };
        let sent = self.transfer(addr, header, cache, rows).await;
        laps.lap("transfer");
        let why = match sent {
            Ok(r) if r.committed => return self.released(&h, t0, laps, &record).await,
            Ok(r) => format!("refused: {}", r.detail),
            Err(e) => format!("transfer failed: {e}"),
        };
        // Refused, broken or timed out: the log knows whether the commit happened.
        let blind_until = self.hooks.as_ref().and_then(|h| h.source_blind()).map(|d| {
            tracing::warn!(
                generation = id,
                ms = d.as_millis() as u64,
                "failpoint source-blind-ms: the log is out of reach"
            );
            Instant::now() + d
        });
        match self.settle(&h, &why, blind_until).await {
            Settled::Committed => self.released(&h, t0, laps, &record).await,
            Settled::Aborted => {
                record("aborted", why.clone());
                Err(Stop::Next(why))
            }
            Settled::Unknown => {
                let why = format!("{why}; the log did not say whether attempt {attempt} committed");
                record("unknown", why.clone());
                Err(Stop::Done(why))
            }
        }
    }

    /// What became of attempt `attempt`, whose outcome this source did not hear: settled by its
    /// own abort (log order decides: applied, the attempt is over and a late commit will be
    /// refused; refused, the log's phase says whether ownership moved). Asked again until the
    /// log answers or `HANDOFF_TRANSFER_TIMEOUT` passes: an unanswered question is
    /// [`Settled::Unknown`], never an abort (the source then keeps decoding; had the commit
    /// applied, its next append meets the new epoch's fence). `blind_until`: failpoint
    /// `source-blind-ms`, the log out of reach until then.
    async fn settle(&self, ours: &pb::HandoffInfo, why: &str, blind_until: Option<Instant>) -> Settled {
        let (id, attempt) = (ours.generation_id, ours.attempt);
        let deadline = Instant::now() + HANDOFF_TRANSFER_TIMEOUT;
        loop {
            if blind_until.is_none_or(|t| Instant::now() >= t) {
                match abort_step(&self.client, id, attempt, &self.decoder_id, why).await {
                    Ok(r) if r.ok => return Settled::Aborted,
                    Ok(_) => match phase_in_log(&self.client, ours).await {
                        Ok(true) => return Settled::Committed,
                        // Over otherwise (aborted by the other side, by the log's timeout, or
                        // the generation ended): not moved by this attempt.
                        Ok(false) => return Settled::Aborted,
                        Err(e) => tracing::debug!(generation = id, error = %e, "phase unread; asking again"),
                    },
                    Err(e) => tracing::debug!(generation = id, error = %e, "abort unanswered; asking again"),
                }
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    generation = id,
                    attempt,
                    why,
                    "the log did not say what became of the attempt"
                );
                return Settled::Unknown;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    async fn released(
        &self,
        ours: &pb::HandoffInfo,
        t0: Instant,
        laps: &mut Laps,
        record: &impl Fn(&str, String),
    ) -> Result<u64, Stop> {
        let (id, attempt, handoff_epoch) = (ours.generation_id, ours.attempt, ours.handoff_epoch);
        halt_at(&self.hooks, &self.history, HandoffPoint::SourceBeforeRelease, id);
        pause_at(
            self.hooks.as_ref().and_then(|h| h.release_delay()),
            id,
            "release-delay-ms: holding the release",
        )
        .await;
        let r = step(
            &self.client,
            id,
            pb::handoff_request::Step::SourceReleased(pb::HandoffSourceReleased {
                attempt,
                source: self.decoder_id.clone(),
            }),
        )
        .await;
        // The log takes the release only after it committed the destination's ownership: its
        // word, not the destination's, says the generation moved. A destination's "committed"
        // was taken as the move: the source forgot a generation the log still gave it (and
        // freed its cache), and the generation stalled until its lease lapsed.
        if !r.as_ref().is_ok_and(|r| r.ok) && !committed_in_log(&self.client, ours).await {
            let why = format!("the log holds no commit of attempt {attempt}: {r:?}");
            tracing::warn!(
                generation = id,
                attempt,
                why,
                "the destination said committed; the log did not"
            );
            match self.settle(ours, &why, None).await {
                Settled::Committed => {}
                Settled::Aborted => {
                    record("aborted", why.clone());
                    return Err(Stop::Next(why));
                }
                Settled::Unknown => {
                    record("unknown", why.clone());
                    return Err(Stop::Done(why));
                }
            }
        }
        record("released", String::new());
        laps.lap("release");
        tracing::info!(
            generation = id,
            attempt,
            epoch = handoff_epoch,
            ms = t0.elapsed().as_millis() as u64,
            parts = %laps,
            "generation handed over"
        );
        Ok(handoff_epoch)
    }

    /// Streams the cache to `addr`, then `rows` until the destination answers; the answer.
    async fn transfer(
        &self,
        addr: &str,
        header: dpb::TransferHeader,
        cache: &CacheExport,
        rows: Option<mpsc::Receiver<dpb::KvRow>>,
    ) -> Result<dpb::TransferResult, String> {
        let channel = self.client.peer_channel(addr).map_err(|e: ClientError| e.to_string())?;
        let mut c = dpb::handoff_client::HandoffClient::new(channel)
            .max_decoding_message_size(HANDOFF_CHUNK_BYTES * 2)
            .max_encoding_message_size(HANDOFF_CHUNK_BYTES * 2);
        use futures::StreamExt;
        // The rows on a call of their own beside the transfer, until the destination answers
        // the transfer (one without `Rows` answers UNIMPLEMENTED and computes them).
        let rows_header = dpb::RowsChunk {
            part: Some(dpb::rows_chunk::Part::Header(dpb::RowsHeader {
                generation_id: header.generation_id,
                attempt: header.attempt,
                destination: header.destination.clone(),
                rows_key: header.rows_key,
            })),
        };
        let rows_call = rows.map(|rows| {
            let rows = futures::stream::iter([rows_header]).chain(
                tokio_stream::wrappers::ReceiverStream::new(rows).map(|r| dpb::RowsChunk {
                    part: Some(dpb::rows_chunk::Part::Row(r)),
                }),
            );
            let mut rows_client = c.clone();
            AbortOnDrop(tokio::spawn(async move {
                if let Err(e) = rows_client.rows(rows).await {
                    tracing::debug!(error = %e, "the destination took no rows");
                }
            }))
        });
        let call = c.transfer(futures::stream::iter(transfer_messages(header, cache)));
        let answer = match tokio::time::timeout(HANDOFF_TRANSFER_TIMEOUT, call).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(s.to_string()),
            Err(_) => Err(format!("no answer within {HANDOFF_TRANSFER_TIMEOUT:?}")),
        };
        drop(rows_call);
        answer
    }
}

/// What a handoff's source streams of the positions it feeds past its copy: each one's row
/// ([`DecodeState::export_row`], with the logits it drew from) as a `KvRow` on the transfer of
/// the attempt under way, from the copy's end on, committed or not (the destination takes only
/// those whose tokens are the log's records). Each attempt ([`RowsFeed::attempt`]) gets them
/// from the copy's end again; one whose transfer is over or whose queue is full gets no more.
/// The worker's side; ends when a row cannot be had (the destination computes what it lacks).
pub(crate) struct RowsOut {
    slot: Arc<Mutex<RowsSlot>>,
    first: usize,
    next: usize,
}

/// The queue of the attempt under way, if any; `fresh`: a new attempt, from `first` again.
#[derive(Default)]
struct RowsSlot {
    tx: Option<mpsc::Sender<dpb::KvRow>>,
    fresh: bool,
}

/// [`RowsOut`]'s other side, with the source's attempts: a queue for each.
pub(crate) struct RowsFeed(Arc<Mutex<RowsSlot>>);

impl RowsFeed {
    /// The rows for a new attempt: from the copy's end, as the worker's next steps send them.
    fn attempt(&self) -> mpsc::Receiver<dpb::KvRow> {
        let (tx, rx) = mpsc::channel(HANDOFF_ROWS_QUEUE);
        *self.0.lock().expect("lock") = RowsSlot {
            tx: Some(tx),
            fresh: true,
        };
        rx
    }
}

impl Drop for RowsOut {
    /// The generation left (moved, kept, finished) or its rows ended: the attempt's `Rows` call
    /// ends, so its destination does not wait for more.
    fn drop(&mut self) {
        self.slot.lock().expect("lock").tx = None;
    }
}

impl RowsOut {
    /// Rows past a copy of `positions` positions, and the side that takes them to attempts.
    pub(crate) fn new(positions: usize) -> (Self, RowsFeed) {
        let slot = Arc::new(Mutex::new(RowsSlot::default()));
        let out = RowsOut {
            slot: slot.clone(),
            first: positions,
            next: positions,
        };
        (out, RowsFeed(slot))
    }

    /// Queues the rows of the positions `state` fed since the last call (since the copy's end,
    /// for a new attempt). False: the rows end here.
    pub(crate) fn send(&mut self, state: &DecodeState) -> bool {
        let mut slot = self.slot.lock().expect("lock");
        if std::mem::take(&mut slot.fresh) {
            self.next = self.first;
        }
        let Some(tx) = &slot.tx else {
            return true;
        };
        while self.next < state.kv_positions() {
            let Some(r) = state.export_row(self.next) else {
                return false;
            };
            let row = dpb::KvRow {
                position: self.next as u32,
                token: r.token,
                data: r.data,
                logits: r.logits.unwrap_or_default(),
            };
            if tx.try_send(row).is_err() {
                // Over, or not keeping up: this attempt's destination computes the rest.
                slot.tx = None;
                return true;
            }
            self.next += 1;
        }
        true
    }
}

/// Why an attempt did not move the generation: `Next` tries another destination, `Done` stops.
enum Stop {
    Next(String),
    Done(String),
}

#[cfg(test)]
mod tests {
    use super::{collect_cache, dpb, moved_by, pb, RowsIn, Slots, HANDOFF_CACHE_BLOCKS_MAX, HANDOFF_ROWS_BYTES_MAX};
    use std::time::Duration;

    fn tensor(layer: u32, kind: &str, shape: Vec<u32>, data: Vec<u8>) -> Result<dpb::TransferChunk, tonic::Status> {
        Ok(dpb::TransferChunk {
            part: Some(dpb::transfer_chunk::Part::Tensor(dpb::KvTensor {
                layer,
                kind: kind.into(),
                dtype: "f32".into(),
                shape,
                data,
            })),
        })
    }

    /// Messages of no bytes, each opening a block, are refused past the block limit, while the
    /// stream still runs (before, each was kept, counted against no limit, until the stream
    /// ended); a source that stops sending is refused at the deadline, not waited for.
    #[tokio::test]
    async fn a_transfer_of_endless_empty_blocks_or_of_nothing_is_refused() {
        use futures::StreamExt;
        let manifest = pb::CacheManifest {
            bytes: 1,
            ..Default::default()
        };
        let kinds = ["k", "v"];
        let empty = (0..HANDOFF_CACHE_BLOCKS_MAX as u32 * 4).map(|i| tensor(0, kinds[i as usize % 2], vec![0], vec![]));
        let mut endless = futures::stream::iter(empty).chain(futures::stream::pending());
        let why = tokio::time::timeout(
            Duration::from_secs(20),
            collect_cache(&manifest, &mut endless, Duration::from_secs(30)),
        )
        .await
        .expect("refused while the stream runs")
        .expect_err("refused");
        assert!(why.contains("cache blocks"), "{why}");

        let t0 = std::time::Instant::now();
        let mut silent = futures::stream::iter([tensor(0, "k", vec![1], vec![0; 4])]).chain(futures::stream::pending());
        let more = pb::CacheManifest {
            bytes: 1_000,
            ..Default::default()
        };
        let why = collect_cache(&more, &mut silent, Duration::from_millis(200))
            .await
            .expect_err("refused");
        assert!(why.contains("did not arrive within"), "{why}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    fn row(position: u32, bytes: usize) -> dpb::KvRow {
        dpb::KvRow {
            position,
            token: position + 100,
            data: vec![position as u8; bytes],
            logits: Vec::new(),
        }
    }

    /// A destination's rows: taken in runs of consecutive positions from the one asked for,
    /// those before it dropped, its byte count kept, and rows past its limit refused.
    #[test]
    fn rows_are_taken_in_runs_from_the_position_asked_for() {
        let cost = |bytes: usize| bytes + 64;
        let mut r = RowsIn::new(1..100, true);
        for p in [3, 4, 5, 7, 8] {
            assert!(r.keep(row(p, 10), 4));
        }
        assert_eq!((r.bytes, r.received), (5 * cost(10), 5));
        assert!(r.take(2, 4).is_empty(), "position 2 is missing: nothing");
        let got = r.take(4, 9);
        assert_eq!(
            got.iter().map(|r| r.token).collect::<Vec<_>>(),
            [104, 105],
            "a run ends at a gap"
        );
        assert_eq!((r.rows.len(), r.bytes), (2, 2 * cost(10)), "3 dropped, 4 and 5 taken");
        assert_eq!(r.take(7, 1).len(), 1, "at most n");
        assert_eq!(r.take(8, 1).len(), 1);
        assert_eq!((r.rows.len(), r.bytes), (0, 0));
        // The same position again replaces the row; past the limit, or outside the positions
        // a row may be for, refused; logits count, and are left out unless they are the
        // vocabulary's length.
        assert!(r.keep(row(1, 10), 4) && r.keep(row(1, 20), 4));
        assert_eq!(r.bytes, cost(20));
        assert!(!r.keep(row(2, HANDOFF_ROWS_BYTES_MAX), 4));
        assert!(!r.keep(row(0, 10), 4) && !r.keep(row(100, 10), 4));
        assert_eq!((r.bytes, r.rows.len()), (cost(20), 1));
        let with_logits = |n: usize| dpb::KvRow {
            logits: vec![0.5; n],
            ..row(2, 10)
        };
        assert!(r.keep(with_logits(4), 4));
        assert_eq!(r.bytes, cost(20) + cost(10) + 16);
        assert_eq!(r.last_with_logits(1), Some(2));
        assert!(r.keep(with_logits(3), 4));
        assert_eq!(r.bytes, cost(20) + cost(10), "3 logits for a vocabulary of 4: left out");
        assert_eq!(r.last_with_logits(1), None);
        assert!(r.streams() && !RowsIn::new(1..100, false).streams());
        r.ended = true;
        assert!(!r.streams());
        assert_eq!(r.take(2, 1)[0].logits, None);
    }

    /// The worker's claims and the port's reservations share the capacity: what one took, the
    /// other cannot, and a received generation's slot passes to the worker in one step.
    #[test]
    fn the_worker_and_the_port_never_both_take_the_last_slot() {
        let slots = Slots::new(2);
        assert!(slots.reserve());
        // The worker holds nothing and may take the one slot left, which a transfer then lacks.
        assert_eq!(slots.free(0), 1);
        assert_eq!(slots.claim(0, 3), 1);
        assert!(!slots.reserve());
        // It took nothing after all: the slot is free again.
        slots.hold(0);
        assert!(slots.reserve());
        assert_eq!((slots.free(0), slots.claim(0, 1)), (0, 0));
        // The first transfer's generation is taken in: one held, one reserved, still full.
        slots.admit(1);
        assert_eq!(slots.reserved(), 1);
        assert!(!slots.reserve());
        slots.unreserve();
        assert!(slots.reserve());
    }

    /// A source learns whether its attempt moved the generation from the log's latest attempt:
    /// its own, committed or released; or a later one its destination prepared at its handoff
    /// epoch (the new owner handed it on before the source recorded its release).
    #[test]
    fn an_attempt_moved_the_generation_when_the_log_says_so_or_its_destination_handed_it_on() {
        use pb::HandoffPhase as P;
        let ours = pb::HandoffInfo {
            attempt: 4,
            generation_id: 1,
            source: "a".into(),
            source_epoch: 2,
            destination: "b".into(),
            handoff_epoch: 3,
            ..Default::default()
        };
        let phase = |p: P| pb::HandoffInfo {
            phase: p as i32,
            ..ours.clone()
        };
        for (p, moved) in [
            (P::Prepared, false),
            (P::ReceiverReady, false),
            (P::OwnershipCommitted, true),
            (P::SourceReleased, true),
            (P::Aborted, false),
        ] {
            assert_eq!(moved_by(&ours, &phase(p)), moved, "{p:?}");
        }
        let later = |source: &str, source_epoch| pb::HandoffInfo {
            attempt: 9,
            source: source.into(),
            source_epoch,
            destination: "c".into(),
            handoff_epoch: source_epoch + 1,
            phase: P::Prepared as i32,
            ..ours.clone()
        };
        assert!(moved_by(&ours, &later("b", 3)));
        // Prepared by us again (ours was aborted), or by another decoder at another epoch.
        assert!(!moved_by(&ours, &later("a", 2)));
        assert!(!moved_by(&ours, &later("c", 3)));
        assert!(!moved_by(&ours, &later("b", 4)));
        // An earlier attempt is not a later one.
        assert!(!moved_by(
            &ours,
            &pb::HandoffInfo {
                attempt: 2,
                ..later("b", 3)
            }
        ));
    }

    /// Looking at the free slots claims none: a transfer arriving while the worker asks the
    /// log what is waiting takes a slot, and the worker then claims only what is left of what
    /// the log listed.
    #[test]
    fn the_worker_claims_only_the_slots_of_what_it_takes() {
        let slots = Slots::new(3);
        assert_eq!(slots.free(0), 3);
        assert!(slots.reserve());
        assert_eq!(slots.claim(0, 1), 1);
        // One held by the take, one reserved by the transfer: one free for the next transfer.
        assert!(slots.reserve());
        assert!(!slots.reserve());
        assert_eq!(slots.claim(1, 2), 0);
    }
}
