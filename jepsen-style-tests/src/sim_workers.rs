//! Real decoder workers in the simulation (`sim --core openraft --decoders real`, issue 13).
//!
//! The stand-in decoders of [`crate::sim`] follow the ownership protocol as the simulation
//! writes it. Here the decoders are the production [`Worker`] (lease loop, renewer, session,
//! append stream, resume) with the fake model, talking to the simulated nodes through the
//! production [`LogClient`] (leader discovery, redirects, retries) over real gRPC: tonic
//! clients and servers, HTTP/2 and all, on in-memory connections instead of TCP. What is
//! simulated:
//! - **The wire** ([`Wires`]): a connection is a tokio duplex pipe whose two ends share a
//!   [`Link`]. A link is open, stalled (a partition: bytes stop moving both ways until it heals,
//!   and calls run into their timeouts) or cut (a reset: both ends fail at once). A node's
//!   crash cuts its links (the process is gone); a node cut off from clients stalls its links
//!   to every decoder; a decoder cut off from the log stalls all of its links; a lossy network
//!   cuts a link now and then (its calls end in doubt). A connection to a node that is down is
//!   refused.
//! - **The service**: each node process serves `raftlog.v1.Log` ([`SimLog`]) from its
//!   simulated state. Reads (Get, PendingWork, ListModels, Watch) are the production service's
//!   own functions (`tokenlog_raftlog::service`) over the node's applied state; writes are
//!   stamped and proposed to the node's real openraft core as the stand-in's calls are
//!   ([`crate::sim_raft::Process::write`]), one command per entry; a follower answers
//!   `NotLeader` naming the leader, as production does. Sessions end the decoder's leases when
//!   their stream breaks, as production's do. Not served: pipelines, stages, handoffs,
//!   membership and the read-index (a linearizable Get reads the leader's applied state).
//! - **The worker's time and model** ([`tokenlog_decoder::simulation`]): model work runs inline
//!   and costs a simulated step; history times are simulated microseconds.
//!
//! A worker that ends on its own (stalled, or an error it does not survive) is restarted as a
//! new incarnation, as the supervisor of a `tokenlog decoder` does.

use std::collections::BTreeSet;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures::Stream;
use tokenlog_decoder::history::{HistoryLine, Lines};
use tokenlog_decoder::worker::{Worker, WorkerConfig, WorkerError};
use tokenlog_decoder::{FakeConfig, FakeModel, Model};
use tokenlog_proto::raftlog as pb;
use tokenlog_proto::raftlog::log_server::{Log, LogServer};
use tokenlog_raftlog::client::{Connector, LogClient};
use tokenlog_raftlog::error::LogError;
use tokenlog_raftlog::service::{
    acquire_cmd, append_cmd, appended, bind_prompt_cmd, cancel_cmd, find, finish_cmd, models, next_event, owned,
    pending, register_cmd, registered, release_cmd, renew_cmd, standby_cmd, submit_cmd, submitted, unexpected,
};
use tokenlog_raftlog::types::{Command, ModelIdentity, Response, TokenizerPackage};
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::sync::mpsc;
use tonic::{Request, Response as TonicResponse, Status};

use crate::sim_raft::{Process, RealLog, WriteError};

type Rt = crate::sim_rt::SimRt;

/// Bytes a connection buffers each way.
const PIPE_BYTES: usize = 64 * 1024;
/// How often a Watch looks at its node's applied state again.
const WATCH_POLL: Duration = Duration::from_millis(2);
/// How often a session checks that its node still leads.
const SESSION_POLL: Duration = Duration::from_millis(5);
/// Simulated cost of one model call.
const STEP: Duration = Duration::from_millis(4);

// ------------------------------------------------------------------------------ the wire

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Open,
    Stalled,
    Cut,
}

/// The state both ends of one connection share.
struct Link {
    state: Mutex<(Phase, Vec<Waker>)>,
    node: usize,
    decoder: String,
}

impl Link {
    fn set(&self, phase: Phase) {
        let mut st = self.state.lock().expect("link");
        if st.0 == Phase::Cut || st.0 == phase {
            return;
        }
        st.0 = phase;
        for w in st.1.drain(..) {
            w.wake();
        }
    }

    /// Ready to move bytes (`Ok`), failed (cut), or pending until the phase changes (stalled).
    /// An open link remembers the waker too, so that a cut or a stall wakes an end waiting on
    /// its pipe.
    fn ready(&self, cx: &Context<'_>) -> Poll<io::Result<()>> {
        let mut st = self.state.lock().expect("link");
        if st.0 == Phase::Cut {
            return Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()));
        }
        if !st.1.iter().any(|w| w.will_wake(cx.waker())) {
            st.1.push(cx.waker().clone());
        }
        match st.0 {
            Phase::Open => Poll::Ready(Ok(())),
            _ => Poll::Pending,
        }
    }
}

/// One end of a simulated connection.
pub(crate) struct SimIo {
    pipe: DuplexStream,
    link: Arc<Link>,
}

impl AsyncRead for SimIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if let Poll::Ready(r) = self.link.ready(cx) {
            r?;
            return Pin::new(&mut self.pipe).poll_read(cx, buf);
        }
        Poll::Pending
    }
}

impl AsyncWrite for SimIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if let Poll::Ready(r) = self.link.ready(cx) {
            r?;
            return Pin::new(&mut self.pipe).poll_write(cx, buf);
        }
        Poll::Pending
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Poll::Ready(r) = self.link.ready(cx) {
            r?;
            return Pin::new(&mut self.pipe).poll_flush(cx);
        }
        Poll::Pending
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.pipe).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for SimIo {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

/// Every connection between decoders and nodes, and what the nemesis did to them.
#[derive(Default)]
pub(crate) struct Wires {
    inner: Mutex<WiresInner>,
}

#[derive(Default)]
struct WiresInner {
    /// Per node, where its server takes new connections (`None`: down).
    accept: Vec<Option<mpsc::UnboundedSender<SimIo>>>,
    links: Vec<Weak<Link>>,
    /// Nodes cut off from every decoder.
    isolated: BTreeSet<usize>,
    /// Decoders cut off from every node.
    cut_off: BTreeSet<String>,
}

impl WiresInner {
    fn phase(&self, node: usize, decoder: &str) -> Phase {
        if self.isolated.contains(&node) || self.cut_off.contains(decoder) {
            Phase::Stalled
        } else {
            Phase::Open
        }
    }

    fn live(&mut self) -> Vec<Arc<Link>> {
        self.links.retain(|l| l.strong_count() > 0);
        self.links.iter().filter_map(Weak::upgrade).collect()
    }
}

impl Wires {
    fn connect(&self, node: usize, decoder: &str) -> io::Result<SimIo> {
        let mut w = self.inner.lock().expect("wires");
        let Some(Some(accept)) = w.accept.get(node) else {
            return Err(io::ErrorKind::ConnectionRefused.into());
        };
        let accept = accept.clone();
        let link = Arc::new(Link {
            state: Mutex::new((w.phase(node, decoder), Vec::new())),
            node,
            decoder: decoder.to_string(),
        });
        w.links.push(Arc::downgrade(&link));
        let (a, b) = tokio::io::duplex(PIPE_BYTES);
        accept
            .send(SimIo {
                pipe: b,
                link: link.clone(),
            })
            .map_err(|_| io::Error::from(io::ErrorKind::ConnectionRefused))?;
        Ok(SimIo { pipe: a, link })
    }

    /// Applies isolation and cut-offs to every live link.
    fn update(&self) {
        let mut w = self.inner.lock().expect("wires");
        for l in w.live() {
            l.set(w.phase(l.node, &l.decoder));
        }
    }

    fn cut_where(&self, f: impl Fn(&Link) -> bool) {
        let mut w = self.inner.lock().expect("wires");
        for l in w.live() {
            if f(&l) {
                l.set(Phase::Cut);
            }
        }
    }

    /// Cuts the `k`-th live link (modulo their number); whether there was one.
    fn cut_one(&self, k: usize) -> bool {
        let mut w = self.inner.lock().expect("wires");
        let live = w.live();
        if live.is_empty() {
            return false;
        }
        live[k % live.len()].set(Phase::Cut);
        true
    }
}

/// A [`Connector`] for decoder `decoder`'s client: addresses `n0`, `n1`, ... name the nodes.
/// Refused once `alive` is false (the process is gone).
fn connector(wires: Arc<Wires>, decoder: String, alive: Arc<AtomicBool>) -> Connector {
    Arc::new(move |addr: &str, endpoint: tonic::transport::Endpoint| {
        let node = addr.strip_prefix('n').and_then(|n| n.parse::<usize>().ok());
        let (wires, decoder, alive) = (wires.clone(), decoder.clone(), alive.clone());
        endpoint.connect_with_connector_lazy(tower::service_fn(move |_: tonic::transport::Uri| {
            let io = match node {
                Some(n) if alive.load(Ordering::Acquire) => wires.connect(n, &decoder),
                _ => Err(io::ErrorKind::ConnectionRefused.into()),
            };
            async move { io.map(hyper_util::rt::TokioIo::new) }
        }))
    })
}

// ------------------------------------------------------------------------------ the service

/// `raftlog.v1.Log` of one simulated node process.
#[derive(Clone)]
struct SimLog {
    p: Process,
    /// Seeds for openraft's deterministic draws in the calls this node serves.
    calls: Arc<AtomicU64>,
    seed: u64,
    /// Sessions this node ended (`SessionLost` applied): decoder, simulated µs.
    lost: Lost,
    origin: tokio::time::Instant,
}

/// Decoder sessions the log ended, and when (simulated µs).
type Lost = Arc<Mutex<Vec<(String, u64)>>>;

fn node_addr(id: u64) -> String {
    format!("n{id}")
}

fn log_err(e: WriteError) -> Status {
    match e {
        WriteError::NotLeader(leader) => LogError::NotLeader {
            leader_addr: leader.map(node_addr),
        }
        .into(),
        WriteError::Failed(why) => LogError::Raft(why).into(),
    }
}

fn unserved(what: &str) -> Status {
    Status::unimplemented(format!("{what} is not served by the simulation"))
}

type Answer<T> = Result<TonicResponse<T>, Status>;
type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl SimLog {
    async fn write(&self, cmd: Command) -> Result<(Response, u64), Status> {
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        let seed = self.seed ^ n.wrapping_mul(0x94d0_49bb_1331_11eb);
        let p = self.p.clone();
        Rt::scope(seed, async move { p.write(cmd).await })
            .await
            .map_err(log_err)
    }

    async fn ownership(&self, cmd: Command) -> Answer<pb::OwnershipResponse> {
        let (resp, index) = self.write(cmd).await?;
        Ok(TonicResponse::new(owned(resp, index)?))
    }

    fn check_leader(&self) -> Result<(), Status> {
        if self.p.leads() {
            return Ok(());
        }
        Err(LogError::NotLeader {
            leader_addr: self.p.leader().map(node_addr),
        }
        .into())
    }

    /// `f` over this node's applied state.
    fn read<R>(&self, f: impl FnOnce(&tokenlog_raftlog::state::LogState) -> R) -> R {
        f(&self.p.machine.lock().expect("machine").log)
    }
}

#[tonic::async_trait]
impl Log for SimLog {
    async fn submit(&self, req: Request<pb::SubmitRequest>) -> Answer<pb::SubmitResponse> {
        let (resp, _) = self.write(submit_cmd(req.into_inner())?).await?;
        Ok(TonicResponse::new(submitted(resp)?))
    }

    async fn acquire(&self, req: Request<pb::AcquireRequest>) -> Answer<pb::OwnershipResponse> {
        self.ownership(acquire_cmd(req.into_inner())?).await
    }

    async fn renew(&self, req: Request<pb::RenewRequest>) -> Answer<pb::OwnershipResponse> {
        self.ownership(renew_cmd(req.into_inner())).await
    }

    async fn bind_prompt(&self, req: Request<pb::BindPromptRequest>) -> Answer<pb::OwnershipResponse> {
        self.ownership(bind_prompt_cmd(req.into_inner())).await
    }

    async fn append(&self, req: Request<pb::AppendRequest>) -> Answer<pb::AppendResponse> {
        let (resp, index) = self.write(append_cmd(req.into_inner())?).await?;
        Ok(TonicResponse::new(appended(resp, index)?))
    }

    type AppendStreamStream = Boxed<pb::AppendResponse>;

    /// Each request is proposed as it arrives and answered in order; the first failure ends
    /// the stream (as production's, which pipelines the proposals; here each waits for the
    /// one before).
    async fn append_stream(
        &self,
        req: Request<tonic::Streaming<pb::AppendRequest>>,
    ) -> Answer<Self::AppendStreamStream> {
        self.check_leader()?;
        let mut inbound = req.into_inner();
        let (out, rx) = mpsc::channel(tokenlog_raftlog::limits::APPEND_STREAM_IN_FLIGHT_MAX);
        let me = self.clone();
        tokio::spawn(async move {
            while let Ok(Some(r)) = inbound.message().await {
                let item = match append_cmd(r) {
                    Ok(cmd) => match me.write(cmd).await {
                        Ok((resp, index)) => appended(resp, index),
                        Err(s) => Err(s),
                    },
                    Err(e) => Err(e.into()),
                };
                let end = item.is_err();
                if out.send(item).await.is_err() || end {
                    return;
                }
            }
        });
        Ok(TonicResponse::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn finish(&self, req: Request<pb::FinishRequest>) -> Answer<pb::OwnershipResponse> {
        self.ownership(finish_cmd(req.into_inner())?).await
    }

    async fn release(&self, req: Request<pb::ReleaseRequest>) -> Answer<pb::OwnershipResponse> {
        self.ownership(release_cmd(req.into_inner())).await
    }

    async fn cancel(&self, req: Request<pb::CancelRequest>) -> Answer<pb::OwnershipResponse> {
        self.ownership(cancel_cmd(req.into_inner())).await
    }

    async fn standby(&self, req: Request<pb::StandbyRequest>) -> Answer<pb::OwnershipResponse> {
        self.ownership(standby_cmd(req.into_inner())?).await
    }

    async fn register(&self, req: Request<pb::RegisterRequest>) -> Answer<pb::RegisterResponse> {
        let (resp, _) = self.write(register_cmd(req.into_inner())?).await?;
        Ok(TonicResponse::new(registered(resp)?))
    }

    type SessionStream = Boxed<pb::SessionEvent>;

    /// As production's: opened once committed; when the decoder's side ends (its process died,
    /// the connection broke) the leader commits `SessionLost`, which ends the decoder's leases;
    /// a leader that stops leading ends the stream instead.
    async fn session(&self, req: Request<tonic::Streaming<pb::SessionRequest>>) -> Answer<Self::SessionStream> {
        self.check_leader()?;
        let mut inbound = req.into_inner();
        let first = inbound.message().await?.ok_or_else(|| {
            Status::from(LogError::Invalid(
                "a session starts with its decoder id and session id".into(),
            ))
        })?;
        let (decoder, session) = (first.decoder_id, first.session_id);
        match self
            .write(Command::SessionOpened {
                decoder: decoder.clone(),
                session,
            })
            .await?
        {
            (Response::Session(Ok(_)), _) => {}
            (Response::Session(Err(rej)), _) => return Err(LogError::Rejected(rej).into()),
            (other, _) => return Err(unexpected(other)),
        }
        let (out, rx) = mpsc::channel(1);
        let _ = out.try_send(Ok(pb::SessionEvent { opened: true }));
        let me = self.clone();
        tokio::spawn(async move {
            let drain = async { while let Ok(Some(_)) = inbound.message().await {} };
            let deposed = async {
                while me.p.leads() {
                    tokio::time::sleep(SESSION_POLL).await;
                }
            };
            let lost = tokio::select! {
                biased;
                _ = drain => true,
                _ = out.closed() => true,
                _ = deposed => false,
            };
            if !lost {
                let status: Status = LogError::NotLeader {
                    leader_addr: me.p.leader().map(node_addr),
                }
                .into();
                let _ = out.send(Err(status)).await;
                return;
            }
            let ended = me
                .write(Command::SessionLost {
                    decoder: decoder.clone(),
                    session,
                })
                .await;
            if ended.is_ok() {
                let at = me.origin.elapsed().as_micros() as u64;
                me.lost.lock().expect("lost").push((decoder, at));
            }
        });
        Ok(TonicResponse::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn handoff(&self, _: Request<pb::HandoffRequest>) -> Answer<pb::HandoffResponse> {
        Err(unserved("Handoff"))
    }

    async fn set_pipeline(&self, _: Request<pb::SetPipelineRequest>) -> Answer<pb::SetPipelineResponse> {
        Err(unserved("SetPipeline"))
    }

    async fn get_pipeline(&self, _: Request<pb::GetPipelineRequest>) -> Answer<pb::GetPipelineResponse> {
        Err(unserved("GetPipeline"))
    }

    async fn register_stage(&self, _: Request<pb::RegisterStageRequest>) -> Answer<pb::RegisterStageResponse> {
        Err(unserved("RegisterStage"))
    }

    async fn list_stages(&self, _: Request<pb::ListStagesRequest>) -> Answer<pb::ListStagesResponse> {
        Err(unserved("ListStages"))
    }

    async fn publish_tokenizer(
        &self,
        req: Request<pb::PublishTokenizerRequest>,
    ) -> Answer<pb::PublishTokenizerResponse> {
        let r = req.into_inner();
        if self.read(|s| s.tokenizers.contains_key(&r.tokenizer_sha256)) {
            return Ok(TonicResponse::new(pb::PublishTokenizerResponse { stored: false }));
        }
        let cmd = Command::PublishTokenizer {
            tokenizer_sha256: r.tokenizer_sha256,
            package: TokenizerPackage(r.package),
        };
        match self.write(cmd).await? {
            (Response::Published(Ok(stored)), _) => Ok(TonicResponse::new(pb::PublishTokenizerResponse { stored })),
            (Response::Published(Err(rej)), _) => Err(LogError::Rejected(rej).into()),
            (other, _) => Err(unexpected(other)),
        }
    }

    async fn get_tokenizer(&self, req: Request<pb::GetTokenizerRequest>) -> Answer<pb::GetTokenizerResponse> {
        let digest = req.into_inner().tokenizer_sha256;
        match self.read(|s| s.tokenizers.get(&digest).map(|p| p.0.clone())) {
            Some(package) => Ok(TonicResponse::new(pb::GetTokenizerResponse { package })),
            None => Err(LogError::NotFound(format!("no decoder has published tokenizer {digest}")).into()),
        }
    }

    async fn get(&self, req: Request<pb::GetRequest>) -> Answer<pb::GetResponse> {
        let r = req.into_inner();
        if r.linearizable {
            self.check_leader()?;
        }
        Ok(TonicResponse::new(self.read(|s| find(s, &r))?))
    }

    type WatchStream = Boxed<pb::WatchEvent>;

    async fn watch(&self, req: Request<pb::WatchRequest>) -> Answer<Self::WatchStream> {
        let r = req.into_inner();
        let id = r.generation_id;
        if !self.read(|s| s.generations.contains_key(&id)) {
            return Err(LogError::NotFound(format!("generation {id} does not exist on this node")).into());
        }
        let (tx, rx) = mpsc::channel(tokenlog_raftlog::limits::WATCH_BUFFER_EVENTS);
        let me = self.clone();
        tokio::spawn(async move {
            let mut seq = r.from_seq;
            loop {
                let next = me.read(|s| s.generations.get(&id).map(|g| next_event(g, seq)));
                match next {
                    None => {
                        let gone = LogError::NotFound(format!("generation {id} was pruned"));
                        let _ = tx.send(Err(gone.into())).await;
                        return;
                    }
                    Some((Some(e), after)) => {
                        seq = after;
                        let last = e.terminal.is_some();
                        if tx.send(Ok(e)).await.is_err() || last {
                            return;
                        }
                    }
                    Some((None, _)) => {
                        if tx.is_closed() {
                            return;
                        }
                        tokio::time::sleep(WATCH_POLL).await;
                    }
                }
            }
        });
        Ok(TonicResponse::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn pending_work(&self, req: Request<pb::PendingWorkRequest>) -> Answer<pb::PendingWorkResponse> {
        let r = req.into_inner();
        let answer = {
            let m = self.p.machine.lock().expect("machine");
            pending(&m.log, r, self.p.clock.now(m.log.log_ms))
        };
        Ok(TonicResponse::new(answer?))
    }

    async fn list_models(&self, _: Request<pb::ListModelsRequest>) -> Answer<pb::ListModelsResponse> {
        Ok(TonicResponse::new(self.read(models)))
    }

    async fn cluster_status(&self, _: Request<pb::ClusterStatusRequest>) -> Answer<pb::ClusterStatusResponse> {
        Err(unserved("ClusterStatus"))
    }

    async fn change_membership(&self, _: Request<pb::ChangeMembershipRequest>) -> Answer<pb::ChangeMembershipResponse> {
        Err(unserved("ChangeMembership"))
    }

    async fn chain_heads(&self, _: Request<pb::ChainHeadsRequest>) -> Answer<pb::ChainHeadsResponse> {
        Err(unserved("ChainHeads"))
    }

    async fn verify(&self, _: Request<pb::VerifyRequest>) -> Answer<pb::VerifyResponse> {
        Err(unserved("Verify"))
    }

    async fn state_digest(&self, _: Request<pb::StateDigestRequest>) -> Answer<pb::StateDigestResponse> {
        Err(unserved("StateDigest"))
    }
}

// ------------------------------------------------------------------------------ the decoders

/// One decoder slot: its incarnation now, and what it runs.
struct Slot {
    name: String,
    alive: Arc<AtomicBool>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), WorkerError>>,
}

/// The real workers, the servers of the nodes, and the wire between them.
pub(crate) struct Workers {
    wires: Arc<Wires>,
    /// Per node: the boot its server serves, and the server.
    servers: Vec<Option<(u64, tokio::task::JoinHandle<()>)>>,
    slots: Vec<Option<Slot>>,
    /// Every incarnation's history, in order of start.
    histories: Vec<Lines>,
    model: Arc<FakeModel>,
    lease_ms: u64,
    capacity: usize,
    seed: u64,
    calls: Arc<AtomicU64>,
    lost: Lost,
    origin: tokio::time::Instant,
}

impl Workers {
    /// `decoders` slots (none started yet), for nodes `0..nodes`; workers ask for leases of
    /// `lease_ms` and take up to `capacity` generations. Enters the worker's simulated mode on
    /// this thread ([`tokenlog_decoder::simulation`]), with `origin` as time zero.
    pub(crate) fn new(
        nodes: usize,
        decoders: usize,
        lease_ms: u64,
        capacity: usize,
        seed: u64,
        origin: tokio::time::Instant,
    ) -> Self {
        tokenlog_decoder::simulation::enter(STEP, origin);
        let wires = Wires::default();
        wires.inner.lock().expect("wires").accept = vec![None; nodes];
        Workers {
            wires: Arc::new(wires),
            servers: (0..nodes).map(|_| None).collect(),
            slots: (0..decoders).map(|_| None).collect(),
            histories: Vec::new(),
            model: Arc::new(FakeModel::new(FakeConfig::default()).expect("the fake model builds")),
            lease_ms,
            capacity,
            seed,
            calls: Arc::default(),
            lost: Lost::default(),
            origin,
        }
    }

    /// The decoder sessions the log ended so far, and when (simulated µs).
    pub(crate) fn sessions_lost(&self) -> Vec<(String, u64)> {
        self.lost.lock().expect("lost").clone()
    }

    /// The model identity generations must be bound to for these workers to take them.
    pub(crate) fn identity(&self) -> ModelIdentity {
        tokenlog_decoder::worker::identity_to_pb(self.model.identity()).into()
    }

    /// Servers follow the nodes: a node that went down loses its server and its connections;
    /// one that (re)booted gets a server for its new process.
    pub(crate) fn sync_nodes(&mut self, log: &RealLog) {
        for i in 0..self.servers.len() {
            let now = log.process(i).map(|p| (p.boot, p));
            let same = matches!((&self.servers[i], &now), (Some((a, _)), Some((b, _))) if a == b);
            if same {
                continue;
            }
            if let Some((_, server)) = self.servers[i].take() {
                server.abort();
                self.wires.inner.lock().expect("wires").accept[i] = None;
                self.wires.cut_where(|l| l.node == i);
            }
            if let Some((boot, p)) = now {
                let (tx, rx) = mpsc::unbounded_channel::<SimIo>();
                self.wires.inner.lock().expect("wires").accept[i] = Some(tx);
                let svc = SimLog {
                    p,
                    calls: self.calls.clone(),
                    seed: self.seed ^ boot.wrapping_mul(0xd6e8_feb8_6659_fd93),
                    lost: self.lost.clone(),
                    origin: self.origin,
                };
                // An accept queue never fails.
                let incoming = futures::StreamExt::map(
                    tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
                    Ok::<SimIo, io::Error>,
                );
                let server = log.spawn(async move {
                    let _ = tonic::transport::Server::builder()
                        .add_service(LogServer::new(svc))
                        .serve_with_incoming(incoming)
                        .await;
                });
                self.servers[i] = Some((boot, server));
            }
        }
    }

    /// Nodes cut off from every decoder now.
    pub(crate) fn isolate(&self, nodes: &BTreeSet<usize>) {
        self.wires.inner.lock().expect("wires").isolated = nodes.clone();
        self.wires.update();
    }

    /// Decoder slot `d` is cut off from every node (`true`) or reconnected.
    pub(crate) fn cut_off(&self, d: usize, cut: bool) {
        let Some(s) = &self.slots[d] else { return };
        {
            let mut w = self.wires.inner.lock().expect("wires");
            if cut {
                w.cut_off.insert(s.name.clone());
            } else {
                w.cut_off.remove(&s.name);
            }
        }
        self.wires.update();
    }

    /// Every decoder reconnected.
    pub(crate) fn heal(&self) {
        self.wires.inner.lock().expect("wires").cut_off.clear();
        self.wires.update();
    }

    /// A lossy network breaks the `k`-th live connection; whether there was one.
    pub(crate) fn break_one(&self, k: usize) -> bool {
        self.wires.cut_one(k)
    }

    /// Starts incarnation `name` in slot `d`.
    pub(crate) fn start(&mut self, log: &RealLog, d: usize, name: String) {
        let alive = Arc::new(AtomicBool::new(true));
        let addrs = (0..self.servers.len() as u64).map(node_addr).collect();
        let client = LogClient::with_connector(
            addrs,
            tokenlog_raftlog::client::RETRY_BUDGET_DEFAULT,
            connector(self.wires.clone(), name.clone(), alive.clone()),
        )
        .expect("node addresses parse");
        let mut cfg = WorkerConfig::new(name.clone(), "fake".into());
        cfg.capacity = self.capacity;
        cfg.lease_ms = self.lease_ms;
        cfg.poll_ms = 50;
        let (history, lines) = tokenlog_decoder::history::History::in_memory(&name);
        self.histories.push(lines);
        let model: Arc<dyn Model> = self.model.clone();
        let worker = Worker::new(cfg, client, model).with_history(history);
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let task = log.spawn(worker.run(stop_rx));
        self.slots[d] = Some(Slot {
            name,
            alive,
            stop,
            task,
        });
    }

    /// Kills slot `d`'s process: its tasks end, its connections break.
    pub(crate) fn crash(&mut self, d: usize) {
        if let Some(s) = self.slots[d].take() {
            s.alive.store(false, Ordering::Release);
            s.task.abort();
            self.wires.cut_where(|l| l.decoder == s.name);
            self.wires.inner.lock().expect("wires").cut_off.remove(&s.name);
        }
    }

    /// Asks slot `d`'s worker to stop (SIGTERM: it releases what it holds, then exits).
    pub(crate) fn stop(&self, d: usize) {
        if let Some(s) = &self.slots[d] {
            let _ = s.stop.send(true);
        }
    }

    /// Slots whose worker ended since the last call (on its own, or stopped), with why; their
    /// processes are gone (connections cut).
    pub(crate) fn reap(&mut self) -> Vec<(usize, String)> {
        let mut ended = Vec::new();
        for d in 0..self.slots.len() {
            if self.slots[d].as_ref().is_some_and(|s| s.task.is_finished()) {
                let name = self.slots[d].as_ref().map(|s| s.name.clone()).unwrap_or_default();
                self.crash(d);
                ended.push((d, name));
            }
        }
        ended
    }

    /// Every incarnation's history lines.
    pub(crate) fn lines(&self) -> Vec<HistoryLine> {
        self.histories
            .iter()
            .flat_map(|l| l.lock().expect("history").clone())
            .collect()
    }

    /// Ends every worker and server (at the end of a run).
    pub(crate) fn shut(&mut self) {
        for d in 0..self.slots.len() {
            self.crash(d);
        }
        for s in self.servers.iter_mut().filter_map(Option::take) {
            s.1.abort();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.shut();
        tokenlog_decoder::simulation::leave();
    }
}
