//! The Rust client of the log. It knows a list of node addresses, remembers the leader, follows
//! `NotLeader` redirects, and retries on unavailability within a time budget.
//!
//! Retrying is safe by construction: every command is idempotent when re-sent unchanged (same
//! request id and binding for Submit; same epoch and start_seq for Append; same owner for Acquire;
//! Renew, Finish, Release and Cancel repeat to the same result). The client never changes a
//! command between tries.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokenlog_proto::raftlog as pb;
use tokenlog_proto::raftlog::log_client::LogClient as PbClient;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::error::leader_hint;
pub use crate::limits::RETRY_BUDGET_DEFAULT;
use crate::limits::{
    APPEND_STREAM_IN_FLIGHT_MAX, CALL_TIMEOUT, CONNECT_TIMEOUT, GRPC_MESSAGE_BYTES_MAX, KEEPALIVE_INTERVAL,
    KEEPALIVE_TIMEOUT, RETRY_PAUSE_MAX, RETRY_PAUSE_MIN,
};
use crate::tls::{scheme, ClientTls};

/// `e` with the connection settings every long-lived channel of ours uses: connect timeout,
/// no Nagle, HTTP/2 keepalive (a dead peer's streams end instead of hanging).
pub fn with_keepalive(e: Endpoint) -> Endpoint {
    e.connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .tcp_keepalive(Some(KEEPALIVE_INTERVAL))
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
}

/// The endpoint of node `addr` (`host:port`) under `tls`.
fn endpoint(addr: &str, tls: &ClientTls) -> Result<Endpoint, ClientError> {
    let bad = |e: tonic::transport::Error| ClientError::BadAddress(addr.to_string(), e.to_string());
    let e = Endpoint::from_shared(format!("{}://{addr}", scheme(tls))).map_err(bad)?;
    match tls {
        Some(tls) => e.tls_config(tls.client_config()).map_err(bad),
        None => Ok(e),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no node answered within {0:?} (last error: {1})")]
    Exhausted(Duration, String),
    #[error("{0}")]
    Status(#[from] Status),
    #[error("bad node address {0:?}: {1}")]
    BadAddress(String, String),
}

/// A decoder's open session ([`LogClient::open_session`]). Dropping it closes the stream, and
/// the leader then ends the decoder's leases.
pub struct Session {
    _requests: tokio::sync::mpsc::Sender<pb::SessionRequest>,
    events: tonic::Streaming<pb::SessionEvent>,
    client: LogClient,
}

impl Session {
    /// Resolves when the session's stream ended (the leader stepped down, died or was cut off);
    /// the reason. A leader that stepped down names the new one: the next session goes there.
    pub async fn ended(&mut self) -> Status {
        loop {
            match self.events.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return Status::unavailable("the session was closed by the node"),
                Err(s) => {
                    *self.client.inner.leader.lock().expect("lock") = leader_hint(&s);
                    return s;
                }
            }
        }
    }
}

/// An open `AppendStream`: requests go out in order without waiting for each other; the
/// answers come back one per request, in the same order. Dropping it closes the stream.
pub struct AppendStream {
    requests: tokio::sync::mpsc::Sender<pb::AppendRequest>,
    answers: tokio::sync::mpsc::Receiver<Result<pb::AppendResponse, Status>>,
    reader: tokio::task::JoinHandle<()>,
}

impl AppendStream {
    /// Queues a request. An error means the stream is closed (its answers say why).
    pub async fn send(&self, req: pb::AppendRequest) -> Result<(), ClientError> {
        self.requests
            .send(req)
            .await
            .map_err(|_| ClientError::Status(Status::unavailable("the append stream is closed")))
    }

    /// The next answer; an error ends the stream (the requests after it are unanswered).
    pub async fn answer(&mut self) -> Result<pb::AppendResponse, ClientError> {
        match self.answers.recv().await {
            Some(r) => r.map_err(ClientError::Status),
            None => Err(ClientError::Status(Status::unavailable("the append stream is closed"))),
        }
    }

    /// The next answer if one has arrived.
    pub fn try_answer(&mut self) -> Option<Result<pb::AppendResponse, ClientError>> {
        match self.answers.try_recv() {
            Ok(r) => Some(r.map_err(ClientError::Status)),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => None,
            Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => Some(Err(ClientError::Status(
                Status::unavailable("the append stream is closed"),
            ))),
        }
    }
}

impl Drop for AppendStream {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Makes the channel to the node at an address from the endpoint this client configured for it
/// (timeouts, keepalive): how a client reaches nodes over something other than TCP (the
/// simulation's network, `Endpoint::connect_with_connector_lazy`).
pub type Connector = Arc<dyn Fn(&str, Endpoint) -> Channel + Send + Sync>;

#[derive(Clone)]
pub struct LogClient {
    inner: Arc<Inner>,
}

struct Inner {
    addrs: Vec<String>,
    leader: Mutex<Option<String>>,
    channels: Mutex<HashMap<String, Channel>>,
    retry_budget: Duration,
    /// TLS to the nodes (the cluster's CA, this process's certificate); `None`: plain text.
    tls: ClientTls,
    /// `None`: TCP.
    connector: Option<Connector>,
}

fn retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Unknown | Code::DeadlineExceeded | Code::Cancelled | Code::Aborted
    )
}

impl LogClient {
    /// `addrs`: `host:port` of any nodes of the cluster.
    pub fn new(addrs: Vec<String>) -> Result<Self, ClientError> {
        Self::with_budget(addrs, RETRY_BUDGET_DEFAULT)
    }

    pub fn with_budget(addrs: Vec<String>, retry_budget: Duration) -> Result<Self, ClientError> {
        Self::with_options(addrs, retry_budget, None)
    }

    /// A client that reaches the nodes over `tls` (`None`: plain text).
    pub fn with_tls(addrs: Vec<String>, tls: ClientTls) -> Result<Self, ClientError> {
        Self::with_options(addrs, RETRY_BUDGET_DEFAULT, tls)
    }

    pub fn with_options(addrs: Vec<String>, retry_budget: Duration, tls: ClientTls) -> Result<Self, ClientError> {
        if addrs.is_empty() {
            return Err(ClientError::BadAddress(String::new(), "no addresses given".into()));
        }
        for a in &addrs {
            endpoint(a, &tls)?;
        }
        let inner = Inner {
            addrs,
            leader: Mutex::new(None),
            channels: Mutex::new(HashMap::new()),
            retry_budget,
            tls,
            connector: None,
        };
        Ok(LogClient { inner: Arc::new(inner) })
    }

    /// A plain-text client whose channels `connector` makes (not TCP).
    pub fn with_connector(
        addrs: Vec<String>,
        retry_budget: Duration,
        connector: Connector,
    ) -> Result<Self, ClientError> {
        let mut c = Self::with_options(addrs, retry_budget, None)?;
        Arc::get_mut(&mut c.inner).expect("not shared yet").connector = Some(connector);
        Ok(c)
    }

    pub fn addrs(&self) -> &[String] {
        &self.inner.addrs
    }

    fn client(&self, addr: &str) -> PbClient<Channel> {
        let mut map = self.inner.channels.lock().expect("lock");
        let ch = map
            .entry(addr.to_string())
            .or_insert_with(|| {
                // A redirect names an address no constructor saw; one that does not parse gets
                // a channel that never connects (its calls fail and are retried elsewhere)
                // instead of a panic.
                let e = endpoint(addr, &self.inner.tls)
                    .unwrap_or_else(|_| Endpoint::from_static("http://invalid.invalid:1"));
                let e = with_keepalive(e).timeout(CALL_TIMEOUT);
                match &self.inner.connector {
                    Some(connect) => connect(addr, e),
                    None => e.connect_lazy(),
                }
            })
            .clone();
        PbClient::new(ch)
            .max_decoding_message_size(GRPC_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(GRPC_MESSAGE_BYTES_MAX)
    }

    /// A channel to another process of the cluster at `addr` (a decoder's handoff listener),
    /// under this client's TLS (the same CA and certificate).
    pub fn peer_channel(&self, addr: &str) -> Result<Channel, ClientError> {
        let bad = |e: tonic::transport::Error| ClientError::BadAddress(addr.to_string(), e.to_string());
        let e = Endpoint::from_shared(format!("{}://{addr}", scheme(&self.inner.tls))).map_err(bad)?;
        let e = match &self.inner.tls {
            Some(tls) => e
                .tls_config(tls.client_config_for(crate::tls::DECODER_SERVER_NAME))
                .map_err(bad)?,
            None => e,
        };
        Ok(with_keepalive(e).connect_lazy())
    }

    /// A client bound to one node's address (for per-node reads such as chain heads).
    pub fn node(&self, addr: &str) -> PbClient<Channel> {
        self.client(addr)
    }

    /// Runs `f` against the leader (or whoever answers), following redirects and retrying
    /// retryable failures until the budget is spent.
    pub async fn call<T, F, Fut>(&self, f: F) -> Result<T, ClientError>
    where
        F: Fn(PbClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let start = tokio::time::Instant::now();
        let mut next = 0usize;
        let mut pause = RETRY_PAUSE_MIN;
        // Redirects followed since the last pause.
        let mut hops = 0usize;
        loop {
            let addr = self.inner.leader.lock().expect("lock").clone().unwrap_or_else(|| {
                let a = self.inner.addrs[next % self.inner.addrs.len()].clone();
                next += 1;
                a
            });
            let status = match f(self.client(&addr)).await {
                Ok(resp) => {
                    *self.inner.leader.lock().expect("lock") = Some(addr);
                    return Ok(resp.into_inner());
                }
                Err(s) if !retryable(&s) => return Err(ClientError::Status(s)),
                Err(s) => s,
            };
            let hint = leader_hint(&status);
            *self.inner.leader.lock().expect("lock") = hint.clone();
            if start.elapsed() >= self.inner.retry_budget {
                return Err(ClientError::Exhausted(self.inner.retry_budget, status.to_string()));
            }
            // A redirect is followed at once, but not for ever: during an election two nodes
            // can name each other as the leader, and following them without a pause would
            // spin until one of them learns better (found by the simulation, where no time
            // passes while a task spins).
            if hint.is_some() && hops < self.inner.addrs.len() {
                hops += 1;
            } else {
                hops = 0;
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(RETRY_PAUSE_MAX);
            }
        }
    }

    pub async fn submit(&self, req: pb::SubmitRequest) -> Result<pb::SubmitResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.submit(r).await }
        })
        .await
    }

    pub async fn acquire(&self, req: pb::AcquireRequest) -> Result<pb::OwnershipResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.acquire(r).await }
        })
        .await
    }

    pub async fn renew(&self, req: pb::RenewRequest) -> Result<pb::OwnershipResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.renew(r).await }
        })
        .await
    }

    pub async fn bind_prompt(&self, req: pb::BindPromptRequest) -> Result<pb::OwnershipResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.bind_prompt(r).await }
        })
        .await
    }

    pub async fn append(&self, req: pb::AppendRequest) -> Result<pb::AppendResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.append(r).await }
        })
        .await
    }

    pub async fn finish(&self, req: pb::FinishRequest) -> Result<pb::OwnershipResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.finish(r).await }
        })
        .await
    }

    pub async fn release(&self, req: pb::ReleaseRequest) -> Result<pb::OwnershipResponse, ClientError> {
        self.call(|mut c| async move { c.release(req).await }).await
    }

    pub async fn cancel(&self, req: pb::CancelRequest) -> Result<pb::OwnershipResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.cancel(r).await }
        })
        .await
    }

    pub async fn register(&self, req: pb::RegisterRequest) -> Result<pb::RegisterResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.register(r).await }
        })
        .await
    }

    /// One step of a planned handoff. Every step is idempotent: a retry after a lost answer
    /// gets the attempt the first try made (a retried commit, only while its grant stands).
    pub async fn handoff(&self, req: pb::HandoffRequest) -> Result<pb::HandoffResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.handoff(r).await }
        })
        .await
    }

    /// Writes a pipeline head's composition against the epoch it last saw (0: none).
    pub async fn set_pipeline(&self, req: pb::SetPipelineRequest) -> Result<pb::SetPipelineResponse, ClientError> {
        self.call(|mut c| {
            let req = req.clone();
            async move { c.set_pipeline(req).await }
        })
        .await
    }

    /// A pipeline head's composition (NOT_FOUND: it has none).
    pub async fn get_pipeline(&self, head: &str, linearizable: bool) -> Result<pb::PipelineInfo, ClientError> {
        let req = pb::GetPipelineRequest {
            head: head.to_string(),
            linearizable,
        };
        let r = self
            .call(|mut c| {
                let req = req.clone();
                async move { c.get_pipeline(req).await }
            })
            .await?;
        r.pipeline
            .ok_or_else(|| ClientError::Status(Status::internal("GetPipeline answered without a pipeline")))
    }

    /// Registers (or renews) a stage process for `ttl_ms` of log time; its expiry.
    /// Each try is given a quarter of the registration's life: a node that holds a call
    /// without answering (a paused leader) would otherwise keep every renewal until its
    /// connection's keepalive gave up, while a new leader's log time runs the registration out.
    pub async fn register_stage(&self, stage: pb::StageRegistration, ttl_ms: u64) -> Result<u64, ClientError> {
        let req = pb::RegisterStageRequest {
            stage: Some(stage),
            ttl_ms,
        };
        let per_try = Duration::from_millis(ttl_ms / 4).max(RETRY_PAUSE_MAX);
        let r = self
            .call(|mut c| {
                let mut req = tonic::Request::new(req.clone());
                req.set_timeout(per_try);
                async move { c.register_stage(req).await }
            })
            .await?;
        Ok(r.expiry_log_ms)
    }

    /// Every live stage registration and every pipeline composition.
    pub async fn list_stages(&self, linearizable: bool) -> Result<pb::ListStagesResponse, ClientError> {
        let req = pb::ListStagesRequest { linearizable };
        self.call(|mut c| async move { c.list_stages(req).await }).await
    }

    pub async fn publish_tokenizer(
        &self,
        req: pb::PublishTokenizerRequest,
    ) -> Result<pb::PublishTokenizerResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.publish_tokenizer(r).await }
        })
        .await
    }

    /// The tokenizer package published under `tokenizer_sha256`; NOT_FOUND when none is.
    pub async fn tokenizer(&self, tokenizer_sha256: &str) -> Result<Vec<u8>, ClientError> {
        let req = pb::GetTokenizerRequest {
            tokenizer_sha256: tokenizer_sha256.to_string(),
        };
        self.call(|mut c| {
            let r = req.clone();
            async move { c.get_tokenizer(r).await }
        })
        .await
        .map(|r| r.package)
    }

    pub async fn list_models(&self) -> Result<pb::ListModelsResponse, ClientError> {
        self.call(|mut c| async move { c.list_models(pb::ListModelsRequest {}).await })
            .await
    }

    /// Generation `id` as the leader holds it now (a linearizable Get by id); NOT_FOUND when
    /// it does not exist (or retention pruned it).
    pub async fn generation(&self, id: u64) -> Result<pb::GenerationInfo, ClientError> {
        let r = self
            .get(pb::GetRequest {
                generation_id: id,
                linearizable: true,
                ..Default::default()
            })
            .await?;
        r.generation
            .ok_or_else(|| ClientError::Status(Status::not_found(format!("generation {id}"))))
    }

    pub async fn get(&self, req: pb::GetRequest) -> Result<pb::GetResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.get(r).await }
        })
        .await
    }

    /// Asks to be the hot standby of a generation ([`pb::StandbyRequest`]).
    pub async fn standby(&self, req: pb::StandbyRequest) -> Result<pb::OwnershipResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.standby(r).await }
        })
        .await
    }

    pub async fn pending_work(&self, req: pb::PendingWorkRequest) -> Result<pb::PendingWorkResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.pending_work(r).await }
        })
        .await
    }

    pub async fn cluster_status(&self, linearizable: bool) -> Result<pb::ClusterStatusResponse, ClientError> {
        self.call(|mut c| async move { c.cluster_status(pb::ClusterStatusRequest { linearizable }).await })
            .await
    }

    pub async fn change_membership(
        &self,
        req: pb::ChangeMembershipRequest,
    ) -> Result<pb::ChangeMembershipResponse, ClientError> {
        self.call(|mut c| {
            let r = req.clone();
            async move { c.change_membership(r).await }
        })
        .await
    }

    /// Opens an `AppendStream` on the leader (following redirects and retrying within the
    /// budget, as [`LogClient::call`] does). Not retried once open: when it fails, the caller
    /// opens another and re-sends from its last acknowledged frontier.
    pub async fn append_stream(&self) -> Result<AppendStream, ClientError> {
        let sender = Mutex::new(None);
        let answers = self
            .call(|mut c| {
                let (tx, rx) = tokio::sync::mpsc::channel(APPEND_STREAM_IN_FLIGHT_MAX);
                *sender.lock().expect("lock") = Some(tx);
                async move { c.append_stream(tokio_stream::wrappers::ReceiverStream::new(rx)).await }
            })
            .await?;
        let requests = sender
            .lock()
            .expect("lock")
            .take()
            .expect("set by the try that answered");
        let (tx, rx) = tokio::sync::mpsc::channel(APPEND_STREAM_IN_FLIGHT_MAX);
        let client = self.clone();
        let reader = tokio::spawn(async move {
            let mut answers = answers;
            loop {
                let item = match answers.message().await {
                    Ok(Some(r)) => Ok(r),
                    Ok(None) => Err(Status::unavailable("the append stream was closed by the node")),
                    Err(s) => {
                        // A node that lost the lead names the new leader: the next stream goes there.
                        *client.inner.leader.lock().expect("lock") = leader_hint(&s);
                        Err(s)
                    }
                };
                let end = item.is_err();
                if tx.send(item).await.is_err() || end {
                    return;
                }
            }
        });
        Ok(AppendStream {
            requests,
            answers: rx,
            reader,
        })
    }

    /// Opens session `session_id` (fresh per call, non-zero) of decoder `decoder_id` on the
    /// leader (`raftlog.v1.Log/Session`) and returns once the leader committed it. Hold the
    /// [`Session`] while the decoder lives: when it ends (dropped, or the process dies) the
    /// leader ends the decoder's leases at once.
    pub async fn open_session(&self, decoder_id: &str, session_id: u64) -> Result<Session, ClientError> {
        let sender = Mutex::new(None);
        let first = pb::SessionRequest {
            decoder_id: decoder_id.to_string(),
            session_id,
        };
        let mut events = self
            .call(|mut c| {
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                let _ = tx.try_send(first.clone());
                *sender.lock().expect("lock") = Some(tx);
                async move { c.session(tokio_stream::wrappers::ReceiverStream::new(rx)).await }
            })
            .await?;
        let requests = sender
            .lock()
            .expect("lock")
            .take()
            .expect("set by the try that answered");
        match events.message().await {
            Ok(Some(e)) if e.opened => Ok(Session {
                _requests: requests,
                events,
                client: self.clone(),
            }),
            Ok(_) => Err(ClientError::Status(Status::unavailable(
                "the session ended before it opened",
            ))),
            Err(s) => {
                *self.inner.leader.lock().expect("lock") = leader_hint(&s);
                Err(ClientError::Status(s))
            }
        }
    }

    /// Opens a Watch stream on whichever node answers (any node that has applied the generation
    /// serves it from applied state; one that has not sends the call on to the leader, which
    /// alone answers NOT_FOUND). A broken stream is not reopened: the caller resumes with
    /// `from_seq` = the next seq it has not seen.
    pub async fn watch(
        &self,
        generation_id: u64,
        from_seq: u32,
    ) -> Result<tonic::Streaming<pb::WatchEvent>, ClientError> {
        self.call(|mut c| async move {
            c.watch(pb::WatchRequest {
                generation_id,
                from_seq,
            })
            .await
        })
        .await
    }
}
