//! The Rust client of the gateway's gRPC API: it knows several gateway addresses, and when a
//! stream breaks (the gateway died, the connection dropped) it reconnects to the next one and
//! resumes after the last seq it delivered, so the caller sees every event exactly once: no
//! duplicate (events with seq <= the last delivered one are dropped) and no gap (Resume starts
//! right after it).

use std::time::{Duration, Instant};

use futures::Stream;
use tokenlog_proto::tokenlog as tpb;
use tokenlog_proto::tokenlog::generation_client::GenerationClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};

pub use crate::limits::CLIENT_RECONNECT_BUDGET as RECONNECT_BUDGET;
use crate::limits::{
    CLIENT_BUFFER_EVENTS, CLIENT_CONNECT_TIMEOUT as CONNECT_TIMEOUT, CLIENT_QUIET_NOTICE, CLIENT_RETRY_PAUSE as PAUSE,
};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{}: {}", .0.code(), .0.message())]
    Status(Status),
    #[error("no gateway answered for {0:?} (last error: {1})")]
    Exhausted(Duration, String),
    #[error("bad gateway address {0:?}")]
    BadAddress(String),
    #[error("TLS to the gateway: {0}")]
    Tls(String),
}

#[derive(Clone)]
pub struct GatewayClient {
    channels: Vec<(String, Channel)>,
    api_key: Option<String>,
    /// Counts reconnects, for callers and tests.
    reconnects: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// Statuses after which another try (on the next gateway) may succeed.
fn retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded | Code::Aborted | Code::Internal
    )
}

impl GatewayClient {
    /// `addrs`: `host:port` of gateways (their gRPC address). `api_key`: sent as a bearer token.
    pub fn new(addrs: Vec<String>, api_key: Option<String>) -> Result<Self, ClientError> {
        Self::with_ca(addrs, api_key, None)
    }

    /// Over TLS when `ca_pem` is given: the gateways' certificates must chain to it and name the
    /// host dialled.
    pub fn with_ca(addrs: Vec<String>, api_key: Option<String>, ca_pem: Option<&[u8]>) -> Result<Self, ClientError> {
        if addrs.is_empty() {
            return Err(ClientError::BadAddress(String::new()));
        }
        let scheme = if ca_pem.is_some() { "https" } else { "http" };
        let channels = addrs
            .into_iter()
            .map(|a| {
                let mut ep =
                    Endpoint::from_shared(format!("{scheme}://{a}")).map_err(|_| ClientError::BadAddress(a.clone()))?;
                if let Some(ca) = ca_pem {
                    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
                    ep = ep.tls_config(tls).map_err(|e| ClientError::Tls(e.to_string()))?;
                }
                Ok((
                    a,
                    tokenlog_raftlog::client::with_keepalive(ep)
                        .connect_timeout(CONNECT_TIMEOUT)
                        .connect_lazy(),
                ))
            })
            .collect::<Result<_, ClientError>>()?;
        Ok(GatewayClient {
            channels,
            api_key,
            reconnects: Default::default(),
        })
    }

    /// The gateways' addresses, comma-separated.
    fn addresses(&self) -> String {
        self.channels.iter().map(|c| c.0.as_str()).collect::<Vec<_>>().join(",")
    }

    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn client(&self, i: usize) -> GenerationClient<Channel> {
        GenerationClient::new(self.channels[i % self.channels.len()].1.clone())
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(k) = &self.api_key {
            if let Ok(v) = format!("Bearer {k}").parse() {
                r.metadata_mut().insert("authorization", v);
            }
        }
        r
    }

    /// Starts (or re-attaches to, by request id) a generation and streams its events, surviving
    /// gateway deaths. An empty request id is replaced by a random one.
    pub fn generate(
        &self,
        mut req: tpb::GenerateRequest,
    ) -> impl Stream<Item = Result<tpb::GenerationEvent, ClientError>> {
        if req.request_id.is_empty() {
            req.request_id = format!("cli-{:016x}", rand::random::<u64>());
        }
        self.run(Some(req.clone()), req.request_id, -1)
    }

    /// Streams the events of an existing request after `after_seq` (-1: all), surviving gateway
    /// deaths.
    pub fn resume(
        &self,
        request_id: String,
        after_seq: i64,
    ) -> impl Stream<Item = Result<tpb::GenerationEvent, ClientError>> {
        self.run(None, request_id, after_seq)
    }

    fn run(
        &self,
        generate: Option<tpb::GenerateRequest>,
        request_id: String,
        after_seq: i64,
    ) -> impl Stream<Item = Result<tpb::GenerationEvent, ClientError>> {
        let (tx, rx) = tokio::sync::mpsc::channel(CLIENT_BUFFER_EVENTS);
        let this = self.clone();
        // The caller may drop the stream while nothing arrives (a stalled generation, a
        // reconnect, a pause): the task then ends at once, and with it the gateway's stream and
        // the tenant's slot, instead of when the next event finds nobody to take it.
        let caller = tx.clone();
        let run = async move {
            let mut last = after_seq;
            let mut at = 0usize;
            let mut progress = Instant::now();
            let mut first_try = true;
            // Whether a gateway streamed this request to us: from then on a full gateway
            // (RESOURCE_EXHAUSTED: the tenant's streams are counted per gateway) is one to
            // move past, as a dead one is. Before any stream, it is the caller's answer.
            let mut streamed = false;
            // When the caller was last told that no gateway answers.
            let mut noticed: Option<Instant> = None;
            loop {
                if !first_try {
                    this.reconnects.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                first_try = false;
                let mut c = this.client(at);
                // Until an event has arrived, Generate again (idempotent by request id); after that,
                // Resume after the last delivered seq.
                let opened = match (&generate, last) {
                    (Some(g), -1) => c.generate(this.request(g.clone())).await,
                    _ => {
                        c.resume(this.request(tpb::ResumeRequest {
                            request_id: request_id.clone(),
                            after_seq: last,
                        }))
                        .await
                    }
                };
                let err = match opened {
                    Ok(resp) => {
                        streamed = true;
                        let mut s = resp.into_inner();
                        loop {
                            match s.message().await {
                                Ok(Some(ev)) => {
                                    progress = Instant::now();
                                    noticed = None;
                                    if i64::from(ev.seq) <= last {
                                        continue;
                                    }
                                    last = i64::from(ev.seq);
                                    let end = ev.last;
                                    if tx.send(Ok(ev)).await.is_err() || end {
                                        return;
                                    }
                                }
                                Ok(None) => {
                                    // Cleanly ended: either the gateway went away, or there is
                                    // nothing after `last` (a resume after the last event).
                                    if let Some(end) = this.ended_at_or_before(&request_id, last).await {
                                        let _ = tx
                                            .send(Err(ClientError::Status(Status::out_of_range(format!(
                                                "nothing comes after seq {last}: request {request_id} ended at seq {end}"
                                            )))))
                                            .await;
                                        return;
                                    }
                                    break Status::unavailable("stream ended before the last event");
                                }
                                Err(s) => break s,
                            }
                        }
                    }
                    Err(s) => s,
                };
                if !(retryable(&err) || streamed && err.code() == Code::ResourceExhausted) {
                    let _ = tx.send(Err(ClientError::Status(err))).await;
                    return;
                }
                if progress.elapsed() > RECONNECT_BUDGET {
                    let _ = tx
                        .send(Err(ClientError::Exhausted(RECONNECT_BUDGET, err.to_string())))
                        .await;
                    return;
                }
                tracing::debug!(
                    "gateway {} failed ({err}); resuming after seq {last} on the next",
                    this.channels[at % this.channels.len()].0
                );
                let quiet = progress.elapsed();
                if quiet >= CLIENT_QUIET_NOTICE && noticed.is_none_or(|t| t.elapsed() >= CLIENT_QUIET_NOTICE) {
                    noticed = Some(Instant::now());
                    tracing::warn!(
                        "request {request_id}: nothing received for {}s, the last try failed ({}: {}); trying gateways {} for up to {}s more",
                        quiet.as_secs(),
                        this.channels[at % this.channels.len()].0,
                        err.message(),
                        this.addresses(),
                        RECONNECT_BUDGET.saturating_sub(quiet).as_secs()
                    );
                }
                at += 1;
                tokio::time::sleep(PAUSE).await;
            }
        };
        tokio::spawn(async move {
            tokio::select! {
                () = caller.closed() => {}
                () = run => {}
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }

    /// The seq of the last event of request `request_id` if it has ended at or before `seq`
    /// (`None`: not ended, not that far, or no gateway could say).
    async fn ended_at_or_before(&self, request_id: &str, seq: i64) -> Option<u32> {
        if seq < 0 {
            return None;
        }
        let st = self.status(request_id).await.ok()?;
        let ended = matches!(st.state.as_str(), "finished" | "failed" | "cancelled");
        (ended && i64::from(st.frontier) <= seq).then_some(st.frontier)
    }

    /// Runs a unary call on the first gateway that answers.
    async fn unary<T, F, Fut>(&self, f: F) -> Result<T, ClientError>
    where
        F: Fn(GenerationClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut last = String::new();
        for i in 0..self.channels.len() {
            match f(self.client(i)).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(s) if retryable(&s) => last = s.to_string(),
                Err(s) => return Err(ClientError::Status(s)),
            }
        }
        Err(ClientError::Exhausted(Duration::ZERO, last))
    }

    /// Status of a request, from whichever gateway answers.
    pub async fn status(&self, request_id: &str) -> Result<tpb::StatusResponse, ClientError> {
        let msg = tpb::StatusRequest {
            request_id: request_id.to_string(),
        };
        self.unary(|mut c| {
            let r = self.request(msg.clone());
            async move { c.status(r).await }
        })
        .await
    }

    pub async fn cancel(&self, request_id: &str) -> Result<tpb::CancelResponse, ClientError> {
        let msg = tpb::CancelRequest {
            request_id: request_id.to_string(),
        };
        self.unary(|mut c| {
            let r = self.request(msg.clone());
            async move { c.cancel(r).await }
        })
        .await
    }
}
