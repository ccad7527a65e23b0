//! The lease worker: takes generations bound to this decoder's model from the log, decodes them,
//! and writes their tokens only through epoch-fenced appends (CONTRACT §2, §4).
//!
//! One loop, one step at a time:
//! 1. Now and then: refresh the registration; if below capacity, ask for pending or orphaned
//!    generations of our model and `Acquire` them; read each one's committed prefix, bind a text
//!    prompt if needed, and re-prefill (`DecodeState::resume`, exact or fast per the binding).
//! 2. Sample one token for every active generation (the model work runs on a blocking thread).
//! 3. Wait for the previous step's append; apply its answers: accepted ⇒ `mark_committed`;
//!    rejected ⇒ drop that generation at once (another owner has it, or it ended).
//! 4. Send this step's tokens of all generations as one `Append` (one Raft entry), without waiting:
//!    the next step computes while it replicates. Visibility waits for commit; decoding does not.
//!
//! A separate renewer keeps leases alive while a step is slow (slow is not dead), and stops
//! renewing a generation the moment it is dropped.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::{ClientError, LogClient};

use tokenlog_raftlog::convert::reason_to_pb;
use tokenlog_raftlog::types::Binding;

use crate::history::{Answer, Call, DecoderEvent};
use crate::limits::{REGISTER_PERIOD_MIN, REGISTRATION_TTL_LEASES, REGISTRATION_TTL_MIN_MS};
use crate::resume::DecodeState;
use crate::sampler::{StopCause, RNG_VERSION};
pub use crate::worker_hooks::{Fired, Halt, StepHooks, StepView, HALT_EXIT_CODE};
use crate::worker_lease::{read_prefix, renew_loop, AbortOnDrop, Held};
use crate::{Model, ModelIdentity};

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
}

impl WorkerConfig {
    pub fn new(decoder_id: String, model_name: String) -> Self {
        WorkerConfig {
            decoder_id,
            model_name,
            chat_template: "chatml".into(),
            capacity: 4,
            lease_ms: tokenlog_raftlog::limits::LEASE_MS_DEFAULT,
            poll_ms: 100,
        }
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
}

/// One generation this worker owns.
struct Active {
    id: u64,
    epoch: u64,
    state: DecodeState,
    /// Committed records (our view; equals the log's after each accepted append).
    committed: u32,
    /// Sampled tokens past `committed`, in order; re-sent whole until acknowledged.
    uncommitted: Vec<u32>,
    finish: Option<StopCause>,
}

impl Active {
    /// Tokens sampled so far (committed or not): the seq of the next draw.
    fn sampled(&self) -> u32 {
        self.committed + self.uncommitted.len() as u32
    }
}

/// A model identity in the log's wire form (what bindings, acquires and registrations carry).
pub fn identity_to_pb(m: &ModelIdentity) -> pb::ModelIdentity {
    m.clone().into()
}

/// A stop cause as an append item's finish: the log's reason and the detail clients see.
fn finish_to_pb(f: &StopCause) -> (pb::FinishReason, String) {
    (reason_to_pb(Some(f.reason())), f.to_string())
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("log: {0}")]
    Log(#[from] ClientError),
    #[error("model: {0}")]
    Model(#[from] crate::Error),
    #[error("{0}")]
    Other(String),
    /// A [`StepHooks`] stopped the worker (a test failpoint): nothing was released, as after a
    /// kill.
    #[error("halted by failpoint {0}")]
    Halted(&'static str),
}

pub struct Worker {
    cfg: WorkerConfig,
    client: LogClient,
    model: Arc<dyn Model>,
    identity: pb::ModelIdentity,
    active: BTreeMap<u64, Active>,
    held: Held,
    stats: Arc<Mutex<WorkerStats>>,
    history: Option<Arc<crate::history::History>>,
    hooks: Option<Arc<dyn StepHooks>>,
}

impl Worker {
    /// Installs step hooks (the fault suite's failpoints).
    pub fn with_hooks(mut self, h: Arc<dyn StepHooks>) -> Self {
        self.hooks = Some(h);
        self
    }

    /// Records every acquire and append (with times and answers) as JSON lines in `h`.
    pub fn with_history(mut self, h: crate::history::History) -> Self {
        self.history = Some(Arc::new(h));
        self
    }

    pub fn new(cfg: WorkerConfig, client: LogClient, model: Arc<dyn Model>) -> Self {
        let identity = identity_to_pb(model.identity());
        Worker {
            cfg,
            client,
            model,
            identity,
            active: BTreeMap::new(),
            held: Default::default(),
            stats: Default::default(),
            history: None,
            hooks: None,
        }
    }

    pub fn stats(&self) -> Arc<Mutex<WorkerStats>> {
        self.stats.clone()
    }

    /// Runs until `stop` turns true; then releases every generation it holds.
    pub async fn run(mut self, mut stop: tokio::sync::watch::Receiver<bool>) -> Result<(), WorkerError> {
        let renewer = AbortOnDrop(tokio::spawn(renew_loop(
            self.client.clone(),
            self.cfg.clone(),
            self.held.clone(),
        )));
        let mut inflight: Option<tokio::task::JoinHandle<Result<pb::AppendResponse, ClientError>>> = None;
        let mut last_poll = Instant::now() - Duration::from_secs(3600);
        let mut last_register = last_poll;
        while !*stop.borrow() {
            if last_register.elapsed() >= Duration::from_millis(self.cfg.lease_ms).max(REGISTER_PERIOD_MIN) {
                self.register().await;
                last_register = Instant::now();
            }
            if self.active.len() < self.cfg.capacity && last_poll.elapsed() >= Duration::from_millis(self.cfg.poll_ms) {
                self.take_work().await;
                last_poll = Instant::now();
            }
            if self.active.is_empty() && inflight.is_none() {
                tokio::select! {
                    _ = stop.changed() => {}
                    _ = tokio::time::sleep(Duration::from_millis(self.cfg.poll_ms)) => {}
                }
                continue;
            }
            self.step().await?;
            if let Some(fired) = self.hooks.as_ref().and_then(|h| h.after_sample(&self.views())) {
                return self.halt(fired, renewer).await;
            }
            if let Some(h) = inflight.take() {
                self.absorb(h.await.map_err(|e| WorkerError::Other(e.to_string()))?);
            }
            if let Some(fired) = self.hooks.as_ref().and_then(|h| h.before_send(&self.views())) {
                return self.halt(fired, renewer).await;
            }
            inflight = self.send();
        }
        if let Some(h) = inflight.take() {
            self.absorb(h.await.map_err(|e| WorkerError::Other(e.to_string()))?);
        }
        drop(renewer);
        self.release_all().await;
        Ok(())
    }

    fn views(&self) -> Vec<StepView> {
        self.active
            .values()
            .map(|g| StepView {
                generation: g.id,
                epoch: g.epoch,
                committed: g.committed,
                sampled: g.sampled(),
            })
            .collect()
    }

    /// Stops as a fired hook says; always ends in [`WorkerError::Halted`].
    async fn halt(&mut self, fired: Fired, renewer: AbortOnDrop) -> Result<(), WorkerError> {
        self.fired(&fired);
        if let Halt::AfterLateAppend(delay) = fired.halt {
            // Gone silent: no renewal, no decoding; only the held message arrives late.
            drop(renewer);
            self.held.lock().expect("lock").clear();
            tokio::time::sleep(delay).await;
            if let Some(h) = self.send() {
                let _ = h.await;
            }
        }
        Err(WorkerError::Halted(fired.name))
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

    async fn register(&mut self) {
        let req = pb::RegisterRequest {
            decoder_id: self.cfg.decoder_id.clone(),
            model_name: self.cfg.model_name.clone(),
            model: Some(self.identity.clone()),
            capacity: self.cfg.capacity as u32,
            ttl_ms: (self.cfg.lease_ms * REGISTRATION_TTL_LEASES).max(REGISTRATION_TTL_MIN_MS),
            chat_template: self.cfg.chat_template.clone(),
            context_tokens: self.model.max_context() as u32,
        };
        if let Err(e) = self.client.register(req).await {
            tracing::warn!(error = %e, "registration not refreshed");
        }
    }

    async fn take_work(&mut self) {
        let want = (self.cfg.capacity - self.active.len()) as u32;
        let pending = match self
            .client
            .pending_work(pb::PendingWorkRequest {
                model: Some(self.identity.clone()),
                limit: want,
            })
            .await
        {
            Ok(p) => p.generations,
            Err(e) => {
                tracing::warn!(error = %e, "pending work query failed");
                return;
            }
        };
        for g in pending {
            if self.active.len() >= self.cfg.capacity {
                break;
            }
            if let Err(e) = self.take(g.generation_id).await {
                tracing::warn!(generation = g.generation_id, error = %e, "could not take generation");
            }
        }
    }

    /// Acquire → read prefix → bind prompt → re-prefill.
    async fn take(&mut self, id: u64) -> Result<(), WorkerError> {
        let hid = self.history.as_ref().map(|h| h.invoke(Call::Acquire { gen: id }));
        let acq = self
            .client
            .acquire(pb::AcquireRequest {
                generation_id: id,
                decoder_id: self.cfg.decoder_id.clone(),
                lease_ms: self.cfg.lease_ms,
                model: Some(self.identity.clone()),
                rng_version: RNG_VERSION,
            })
            .await;
        if let (Some(h), Some(hid)) = (&self.history, hid) {
            let (ok, epoch, frontier) = match &acq {
                Ok(a) => (
                    Some(a.ok),
                    a.generation
                        .as_ref()
                        .and_then(|g| g.lease.as_ref())
                        .map_or(0, |l| l.epoch),
                    a.generation.as_ref().map_or(0, |g| g.frontier),
                ),
                Err(_) => (None, 0, 0),
            };
            h.complete(hid, Answer::Acquire { ok, epoch, frontier });
        }
        let acq = acq?;
        let Some(info) = acq.generation.filter(|_| acq.ok) else {
            tracing::debug!(generation = id, rejection = ?acq.rejection, "acquire refused");
            return Ok(());
        };
        let epoch = info.lease.as_ref().map_or(0, |l| l.epoch);
        self.held.lock().expect("lock").insert(id, (epoch, Instant::now()));
        {
            let mut s = self.stats.lock().expect("lock");
            s.acquired += 1;
            s.takeovers += u64::from(epoch > 1);
        }
        match self.prepare(&info, epoch).await {
            Ok(active) => {
                tracing::info!(generation = id, epoch, frontier = active.committed, "generation taken");
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
                    });
                }
                self.active.insert(id, active);
                Ok(())
            }
            Err(e) => {
                self.held.lock().expect("lock").remove(&id);
                // The binding cannot be served here (prompt too long, bad prompt...): end it
                // explicitly rather than leave it to time out (CONTRACT §5).
                let detail = format!("decoder {} cannot continue: {e}", self.cfg.decoder_id);
                let _ = self
                    .client
                    .finish(pb::FinishRequest {
                        generation_id: id,
                        epoch,
                        reason: pb::FinishReason::Error as i32,
                        detail,
                    })
                    .await;
                self.stats.lock().expect("lock").failed += 1;
                Err(e)
            }
        }
    }

    async fn prepare(&mut self, info: &pb::GenerationInfo, epoch: u64) -> Result<Active, WorkerError> {
        let id = info.generation_id;
        let binding: Binding = info
            .binding
            .clone()
            .ok_or_else(|| WorkerError::Other("generation has no binding".into()))?
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
                return Err(WorkerError::Other(format!("prompt binding refused: {:?}", r.rejection)));
            }
        }
        let committed = read_prefix(&self.client, id, info.frontier).await?;
        let (params, stop, mode) = (binding.sampling, binding.stop, binding.mode);
        let model = self.model.clone();
        let c = committed.clone();
        let state =
            tokio::task::spawn_blocking(move || DecodeState::resume(model.as_ref(), &prompt, &c, params, stop, mode))
                .await
                .map_err(|e| WorkerError::Other(e.to_string()))??;
        let finish = state.finished().cloned();
        Ok(Active {
            id,
            epoch,
            state,
            committed: committed.len() as u32,
            uncommitted: Vec::new(),
            finish,
        })
    }

    /// Samples one token for every unfinished generation.
    async fn step(&mut self) -> Result<(), WorkerError> {
        let mut gens: Vec<Active> = std::mem::take(&mut self.active).into_values().collect();
        let gens = tokio::task::spawn_blocking(move || {
            for g in gens.iter_mut().filter(|g| g.finish.is_none()) {
                match g.state.next_token()? {
                    Some(step) => {
                        g.uncommitted.push(step.token);
                        g.finish = step.finish;
                    }
                    None => g.finish = g.state.finished().cloned(),
                }
            }
            Ok::<_, crate::Error>(gens)
        })
        .await
        .map_err(|e| WorkerError::Other(e.to_string()))??;
        self.active = gens.into_iter().map(|g| (g.id, g)).collect();
        Ok(())
    }

    /// Sends every generation's uncommitted tokens (and finish) as one append.
    fn send(&self) -> Option<tokio::task::JoinHandle<Result<pb::AppendResponse, ClientError>>> {
        let items: Vec<pb::AppendItem> = self
            .active
            .values()
            .filter(|g| !g.uncommitted.is_empty() || g.finish.is_some())
            .map(|g| {
                let (finish, detail) = g
                    .finish
                    .as_ref()
                    .map_or((pb::FinishReason::Unspecified, String::new()), finish_to_pb);
                pb::AppendItem {
                    generation_id: g.id,
                    epoch: g.epoch,
                    start_seq: g.committed,
                    token_ids: g.uncommitted.clone(),
                    finish: finish as i32,
                    finish_detail: detail,
                }
            })
            .collect();
        if items.is_empty() {
            return None;
        }
        let client = self.client.clone();
        let req = pb::AppendRequest {
            decoder_id: self.cfg.decoder_id.clone(),
            lease_ms: self.cfg.lease_ms,
            items,
        };
        let history = self.history.clone();
        Some(tokio::spawn(async move {
            let Some(h) = history else {
                return client.append(req).await;
            };
            let ids: Vec<(u64, u64)> = req
                .items
                .iter()
                .map(|i| {
                    let id = h.invoke(Call::Append {
                        gen: i.generation_id,
                        epoch: i.epoch,
                        start_seq: i.start_seq,
                        n: i.token_ids.len() as u32,
                        finish: i.finish != 0,
                    });
                    (id, i.generation_id)
                })
                .collect();
            let resp = client.append(req).await;
            for (id, gen) in ids {
                let answer = resp
                    .as_ref()
                    .ok()
                    .and_then(|r| r.results.iter().find(|x| x.generation_id == gen))
                    .map_or(
                        Answer::Append {
                            ok: None,
                            frontier: 0,
                            current_epoch: 0,
                            reason: None,
                        },
                        |r| {
                            let rej = r.rejection.as_ref();
                            Answer::Append {
                                ok: Some(r.accepted),
                                frontier: rej.map_or(r.frontier, |x| x.frontier),
                                current_epoch: rej.map_or(r.epoch, |x| x.current_epoch),
                                reason: rej.map(|x| x.reason),
                            }
                        },
                    );
                h.complete(id, answer);
            }
            resp
        }))
    }

    /// Applies an append's answers.
    fn absorb(&mut self, resp: Result<pb::AppendResponse, ClientError>) {
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                // Unknown whether it committed: the same tokens are re-sent from `committed`
                // with the next append, which the log acknowledges idempotently.
                tracing::warn!(error = %e, "append failed; will re-send");
                return;
            }
        };
        for r in resp.results {
            let Some(g) = self.active.get_mut(&r.generation_id) else {
                continue;
            };
            if !r.accepted {
                tracing::warn!(generation = g.id, epoch = g.epoch, rejection = ?r.rejection, "append rejected: dropping the generation");
                self.stats.lock().expect("lock").fence_rejections += 1;
                self.drop_generation(r.generation_id);
                continue;
            }
            let sent = g.uncommitted.len() as u32;
            let newly = r.frontier.saturating_sub(g.committed).min(sent);
            g.uncommitted.drain(..newly as usize);
            g.committed += newly;
            g.state.mark_committed(g.committed as usize);
            self.held.lock().expect("lock").insert(g.id, (g.epoch, Instant::now()));
            let mut s = self.stats.lock().expect("lock");
            s.tokens_committed += newly as u64;
            if g.finish.is_some() && g.uncommitted.is_empty() {
                s.finished += 1;
                drop(s);
                self.drop_generation(r.generation_id);
            }
        }
    }

    fn drop_generation(&mut self, id: u64) {
        self.active.remove(&id);
        self.held.lock().expect("lock").remove(&id);
    }

    async fn release_all(&mut self) {
        for (id, g) in std::mem::take(&mut self.active) {
            self.held.lock().expect("lock").remove(&id);
            let _ = self
                .client
                .release(pb::ReleaseRequest {
                    generation_id: id,
                    epoch: g.epoch,
                })
                .await;
        }
    }
}
