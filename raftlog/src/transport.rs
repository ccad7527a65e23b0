//! Raft transport over tonic gRPC (`raft.v1.RaftTransport`). openraft's messages travel as
//! bincode payloads (their schema is openraft's, versioned by `PAYLOAD_VERSION`); snapshots are
//! streamed in chunks.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use openraft::error::{NetworkError, RPCError, ReplicationClosed, StreamingError, Timeout, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory};
use openraft::raft::StreamAppendResult;
use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse};
use openraft::RaftNetworkV2;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokenlog_proto::raft::raft_transport_client::RaftTransportClient;
use tokenlog_proto::raft::raft_transport_server::RaftTransport;
use tokenlog_proto::raft::{RaftPayload, SnapshotChunk};
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status, Streaming};

use crate::error::{LogError, PayloadError};
use crate::limits::{GRPC_MESSAGE_BYTES_MAX, REPLICATION_MESSAGE_BYTES_MAX, SNAPSHOT_BYTES_MAX, SNAPSHOT_CHUNK_BYTES};
use crate::raft_types::{Entry, Node, NodeId, Raft, Snapshot, SnapshotData, SnapshotMeta, TypeConfig, Vote};
use crate::sm_store::SmShared;
use crate::tls::{scheme, ClientTls};

const PAYLOAD_VERSION: u32 = 1;

fn pack<T: Serialize>(v: &T) -> Result<RaftPayload, PayloadError> {
    Ok(RaftPayload {
        version: PAYLOAD_VERSION,
        data: bincode::serialize(v)?,
    })
}

fn unpack<T: DeserializeOwned>(p: &RaftPayload) -> Result<T, PayloadError> {
    if p.version != PAYLOAD_VERSION {
        return Err(PayloadError::Version {
            got: p.version,
            expected: PAYLOAD_VERSION,
        });
    }
    Ok(bincode::deserialize(&p.data)?)
}

/// Room left in a replication message for the request around its entries (vote, log ids,
/// lengths): far more than they take.
const REQUEST_FRAME_BYTES: usize = 64 * 1024;

/// Packs one replication request for the wire: as it is, or, when its encoding is larger than
/// `REPLICATION_MESSAGE_BYTES_MAX`, as the consecutive requests of [`split_append`]. The
/// follower answers each in order, and openraft takes each answer's log id as progress.
fn pack_append(req: AppendEntriesRequest<TypeConfig>) -> Vec<Result<RaftPayload, PayloadError>> {
    match pack(&req) {
        Ok(p) if p.data.len() <= REPLICATION_MESSAGE_BYTES_MAX => vec![Ok(p)],
        Ok(_) => split_append(req, REPLICATION_MESSAGE_BYTES_MAX - REQUEST_FRAME_BYTES)
            .iter()
            .map(pack)
            .collect(),
        Err(e) => vec![Err(e)],
    }
}

/// `req` as consecutive requests whose entries take at most `budget` encoded bytes each (an
/// entry larger than that alone goes alone): each starts after the last entry of the one before
/// (its `prev_log_id`), and all carry the leader's vote and commit, as openraft's own batches
/// of fewer entries than the leader holds do.
fn split_append(req: AppendEntriesRequest<TypeConfig>, budget: usize) -> Vec<AppendEntriesRequest<TypeConfig>> {
    let AppendEntriesRequest {
        vote,
        mut prev_log_id,
        entries,
        leader_commit,
    } = req;
    let mut parts = Vec::new();
    let mut part: Vec<Entry> = Vec::new();
    let mut bytes = 0usize;
    for e in entries {
        let size = bincode::serialized_size(&e).map_or(usize::MAX, |n| n as usize);
        if let Some(last) = part.last().filter(|_| bytes.saturating_add(size) > budget) {
            let next_prev = Some(last.log_id);
            parts.push(AppendEntriesRequest {
                vote,
                prev_log_id,
                entries: std::mem::take(&mut part),
                leader_commit,
            });
            prev_log_id = next_prev;
            bytes = 0;
        }
        bytes = bytes.saturating_add(size);
        part.push(e);
    }
    parts.push(AppendEntriesRequest {
        vote,
        prev_log_id,
        entries: part,
        leader_commit,
    });
    parts
}

// ------------------------------------------------------------------------------------ client

/// Creates connections to peers; channels are shared per address.
#[derive(Clone, Default)]
pub struct Network {
    /// This node's id (named in timeout errors).
    pub self_id: NodeId,
    channels: Arc<Mutex<HashMap<String, Channel>>>,
    /// TLS to peers (this node's certificate, the cluster's CA); `None`: plain text.
    tls: ClientTls,
}

impl Network {
    pub fn new(self_id: NodeId, tls: ClientTls) -> Self {
        Network {
            self_id,
            channels: Default::default(),
            tls,
        }
    }

    fn channel(&self, addr: &str) -> Result<Channel, String> {
        let mut map = self.channels.lock().expect("lock");
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let mut endpoint = Endpoint::from_shared(format!("{}://{addr}", scheme(&self.tls)))
            .map_err(|e| format!("bad peer address {addr:?}: {e}"))?;
        endpoint = crate::client::with_keepalive(endpoint);
        if let Some(tls) = &self.tls {
            endpoint = endpoint
                .tls_config(tls.client_config())
                .map_err(|e| format!("TLS to peer {addr}: {e}"))?;
        }
        let c = endpoint.connect_lazy();
        map.insert(addr.to_string(), c.clone());
        Ok(c)
    }
}

pub struct Connection {
    self_id: NodeId,
    target: NodeId,
    client: Result<RaftTransportClient<Channel>, String>,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Connection;

    async fn new_client(&mut self, target: NodeId, node: &Node) -> Connection {
        let client = self.channel(node.peer()).map(|c| {
            RaftTransportClient::new(c)
                .max_decoding_message_size(GRPC_MESSAGE_BYTES_MAX)
                .max_encoding_message_size(GRPC_MESSAGE_BYTES_MAX)
        });
        Connection {
            self_id: self.self_id,
            target,
            client,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Msg(String);

fn net_err(e: impl std::fmt::Display) -> NetworkError<TypeConfig> {
    NetworkError::new(&Msg(e.to_string()))
}

fn status_err(s: Status) -> RPCError<TypeConfig> {
    match s.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown => RPCError::Unreachable(Unreachable::new(&Msg(s.to_string()))),
        _ => RPCError::Network(net_err(s)),
    }
}

impl Connection {
    fn client(&self) -> Result<RaftTransportClient<Channel>, RPCError<TypeConfig>> {
        self.client
            .clone()
            .map_err(|e| RPCError::Unreachable(Unreachable::new(&Msg(e))))
    }

    async fn call<Req: Serialize, Resp: DeserializeOwned>(
        &mut self,
        req: &Req,
        option: &RPCOption,
        vote: bool,
    ) -> Result<Resp, RPCError<TypeConfig>> {
        let mut client = self.client()?;
        let payload = pack(req).map_err(|e| RPCError::Network(net_err(e)))?;
        let ttl = option.hard_ttl();
        let fut = async {
            if vote {
                client.request_vote(payload).await
            } else {
                client.append_entries(payload).await
            }
        };
        let resp = match tokio::time::timeout(ttl, fut).await {
            Err(_) => {
                let action = if vote {
                    openraft::RPCTypes::Vote
                } else {
                    openraft::RPCTypes::AppendEntries
                };
                return Err(RPCError::Timeout(Timeout {
                    action,
                    id: self.self_id,
                    target: self.target,
                    timeout: ttl,
                }));
            }
            Ok(r) => r.map_err(status_err)?,
        };
        unpack(&resp.into_inner()).map_err(|e| RPCError::Network(net_err(e)))
    }
}

impl RaftNetworkV2<TypeConfig> for Connection {
    type SnapshotData = SnapshotData;

    /// Pipelined: every request goes out on one gRPC stream as openraft produces it, without
    /// waiting for the previous answer; the follower answers each in order on the same stream.
    /// (openraft's default sends one request and waits for its answer before the next.)
    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        _option: RPCOption,
    ) -> BoxFuture<
        's,
        Result<BoxStream<'s, Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>>, RPCError<TypeConfig>>,
    >
    where
        S: Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
    {
        Box::pin(async move {
            let mut client = self.client()?;
            // A request that cannot be encoded ends the stream (the follower then answers what
            // it got, and openraft starts a new stream from there). One too large for a peer's
            // message bound goes as several.
            let requests = input
                .flat_map(|r| futures::stream::iter(pack_append(r)))
                .take_while(|p| futures::future::ready(p.is_ok()))
                .filter_map(|p| futures::future::ready(p.ok()));
            let answers = client.append_stream(requests).await.map_err(status_err)?.into_inner();
            let out = answers.map(|item| match item {
                Ok(p) => unpack::<StreamAppendResult<TypeConfig>>(&p).map_err(|e| RPCError::Network(net_err(e))),
                Err(s) => Err(status_err(s)),
            });
            Ok(out.boxed())
        })
    }

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(&rpc, &option, false).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(&rpc, &option, true).await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let mut client = self.client().map_err(StreamingError::from)?;
        let meta = pack(&(vote, snapshot.meta)).map_err(|e| StreamingError::Network(net_err(e)))?;
        // What a follower receives carries every record it names: a snapshot whose records
        // are in this node's cold segments goes as its self-contained export.
        let local = snapshot.snapshot;
        let file = tokio::task::spawn_blocking(move || crate::sm_store::self_contained(&local))
            .await
            .map_err(|e| StreamingError::Network(net_err(e)))?
            .map_err(|e| StreamingError::Network(net_err(e)))?;
        // The file is read one chunk at a time as the stream is polled: a sender holds at most
        // a few chunks in memory whatever the snapshot's size.
        let first = futures::stream::once(async move {
            SnapshotChunk {
                meta: Some(meta),
                data: Vec::new(),
            }
        });
        let rest = futures::stream::unfold((file, 0u64), |(file, off)| async move {
            if off >= file.len() {
                return None;
            }
            let want = (SNAPSHOT_CHUNK_BYTES as u64).min(file.len() - off) as usize;
            let mut data = vec![0u8; want];
            let (data, file) = tokio::task::spawn_blocking(move || {
                let n = file.read_at(off, &mut data);
                (
                    n.map(|n| {
                        data.truncate(n);
                        data
                    }),
                    file,
                )
            })
            .await
            .ok()?;
            match data {
                Ok(d) if !d.is_empty() => {
                    let next = off + d.len() as u64;
                    Some((SnapshotChunk { meta: None, data: d }, (file, next)))
                }
                Ok(_) => None,
                Err(e) => {
                    // A read error ends the stream short; the receiver's checksum refuses it.
                    tracing::warn!(error = %e, path = %file.path().display(), "reading a snapshot to send");
                    None
                }
            }
        });
        let send = client.install_snapshot(first.chain(rest));
        tokio::select! {
            closed = cancel => Err(StreamingError::Closed(closed)),
            r = send => {
                let resp = r.map_err(|s| StreamingError::from(status_err(s)))?;
                let vote: Vote = unpack(&resp.into_inner()).map_err(|e| StreamingError::Network(net_err(e)))?;
                Ok(SnapshotResponse::new(vote))
            }
        }
    }
}

// ------------------------------------------------------------------------------------ server

/// Serves the Raft transport of one node.
pub struct RaftService {
    raft: Raft,
    sm: Arc<SmShared>,
}

impl RaftService {
    pub fn new(raft: Raft, sm: Arc<SmShared>) -> Self {
        RaftService { raft, sm }
    }
}

fn reply<T: Serialize>(v: &T) -> Result<Response<RaftPayload>, Status> {
    Ok(Response::new(pack(v).map_err(LogError::from)?))
}

fn raft_failed(e: impl std::fmt::Display) -> Status {
    LogError::Raft(e.to_string()).into()
}

#[tonic::async_trait]
impl RaftTransport for RaftService {
    async fn append_entries(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let rpc: AppendEntriesRequest<TypeConfig> = unpack(req.get_ref()).map_err(LogError::from)?;
        let resp = self.raft.append_entries(rpc).await.map_err(raft_failed)?;
        reply(&resp)
    }

    type AppendStreamStream = BoxStream<'static, Result<RaftPayload, Status>>;

    async fn append_stream(
        &self,
        req: Request<Streaming<RaftPayload>>,
    ) -> Result<Response<Self::AppendStreamStream>, Status> {
        // Requests are decoded as they arrive; one that does not decode ends the input (and so,
        // after the answers to those before it, the stream).
        let requests = futures::stream::unfold(req.into_inner(), |mut s| async move {
            match s.message().await {
                Ok(Some(p)) => match unpack::<AppendEntriesRequest<TypeConfig>>(&p) {
                    Ok(r) => Some((r, s)),
                    Err(e) => {
                        tracing::warn!(error = %e, "append stream: a request does not decode; ending the stream");
                        None
                    }
                },
                Ok(None) => None,
                Err(e) => {
                    tracing::debug!(error = %e, "append stream closed by the leader");
                    None
                }
            }
        });
        let answers = self.raft.stream_append(requests).map(|r| match r {
            Ok(result) => pack(&result).map_err(|e| Status::from(LogError::from(e))),
            Err(fatal) => Err(raft_failed(fatal)),
        });
        Ok(Response::new(answers.boxed()))
    }

    async fn request_vote(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let rpc: VoteRequest<TypeConfig> = unpack(req.get_ref()).map_err(LogError::from)?;
        let resp = self.raft.vote(rpc).await.map_err(raft_failed)?;
        reply(&resp)
    }

    async fn install_snapshot(&self, req: Request<Streaming<SnapshotChunk>>) -> Result<Response<RaftPayload>, Status> {
        let mut stream = req.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| LogError::from(PayloadError::Malformed("empty snapshot stream")))?;
        let meta = first
            .meta
            .ok_or_else(|| LogError::from(PayloadError::Malformed("the first snapshot chunk carries no meta")))?;
        let (vote, meta): (Vote, SnapshotMeta) = unpack(&meta).map_err(LogError::from)?;
        // Chunks go straight to a partial file: one chunk in memory at a time, and no more than
        // `SNAPSHOT_BYTES_MAX` on disk.
        let mut partial = self
            .sm
            .receive_snapshot()
            .map_err(|e| LogError::storage("receiving a snapshot", e))?;
        let mut pending = first.data;
        loop {
            if partial.written() + pending.len() as u64 > SNAPSHOT_BYTES_MAX {
                return Err(LogError::Invalid(format!(
                    "snapshot stream exceeds SNAPSHOT_BYTES_MAX ({SNAPSHOT_BYTES_MAX} bytes)"
                ))
                .into());
            }
            partial
                .write(&pending)
                .map_err(|e| LogError::storage("receiving a snapshot", e))?;
            match stream.message().await? {
                Some(chunk) => {
                    if chunk.meta.is_some() {
                        return Err(
                            LogError::from(PayloadError::Malformed("a later snapshot chunk carries meta")).into(),
                        );
                    }
                    pending = chunk.data;
                }
                None => break,
            }
        }
        let file = partial
            .finish()
            .map_err(|e| LogError::storage("receiving a snapshot", e))?;
        // From here on the received file is this node's to install or remove, whatever becomes
        // of this call: a task does both, and the call only waits for its answer. Done in the
        // call, a leader that stopped waiting (it lost its term, the connection broke) while the
        // file was checked or offered to openraft dropped the call, and the file, up to
        // `SNAPSHOT_BYTES_MAX` of a peer's bytes, stayed on disk until a restart: once for each
        // such cancelled send.
        let raft = self.raft.clone();
        let vote = tokio::spawn(async move { check_and_install(raft, vote, meta, file).await })
            .await
            .map_err(|e| LogError::Internal(format!("installing a received snapshot: {e}")))??;
        reply(&vote)
    }
}

/// A test's pause before a received snapshot is checked: the window in which its sender gives
/// up on the call.
#[cfg(test)]
static CHECK_PAUSE_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Checks a received snapshot `file` against the stream's `meta`, offers it to openraft, and
/// removes it unless openraft installed it (renamed it into place). Returns the vote to answer.
async fn check_and_install(
    raft: Raft,
    vote: Vote,
    meta: SnapshotMeta,
    file: crate::snapshot::SnapshotFile,
) -> Result<Vote, Status> {
    #[cfg(test)]
    {
        let ms = CHECK_PAUSE_MS.load(std::sync::atomic::Ordering::Relaxed);
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    let received = file.path().to_path_buf();
    // Checked before Raft sees it: a file that fails its checksum (a stream the sender ended
    // early), of a format this release cannot read (a newer peer during an upgrade), or whose
    // meta is not the one sent, is refused here, as one bad RPC. Inside openraft the same
    // refusal is a storage error of the state machine, which stops this node's Raft for good
    // (until a restart).
    let want = meta.clone();
    let checked = tokio::task::spawn_blocking(move || -> Result<crate::snapshot::SnapshotFile, String> {
        let got = file.verify().map_err(|e| e.to_string())?;
        if got != want {
            return Err(format!(
                "its file holds log id {:?}, the stream's meta says {:?}",
                got.last_log_id, want.last_log_id
            ));
        }
        Ok(file)
    })
    .await;
    let file = match checked {
        Ok(Ok(f)) => f,
        Ok(Err(why)) => {
            let _ = std::fs::remove_file(&received);
            tracing::warn!(why, "a received snapshot was refused before installing it");
            return Err(LogError::Invalid(format!("received snapshot refused: {why}")).into());
        }
        Err(e) => {
            let _ = std::fs::remove_file(&received);
            return Err(LogError::Internal(format!("checking a received snapshot: {e}")).into());
        }
    };
    let snapshot = Snapshot { meta, snapshot: file };
    let resp = raft.install_full_snapshot(vote, snapshot).await;
    // Openraft answers once it installed the snapshot (renamed into place), or at once when it
    // ignores it (an older vote, or nothing newer than what this node committed): then the
    // received file is removed here.
    if received.exists() {
        tracing::info!(path = %received.display(), "a received snapshot was not installed: removed");
        let _ = std::fs::remove_file(&received);
    }
    Ok(resp.map_err(raft_failed)?.vote)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{Command, Request, TokenizerPackage};
    use openraft::testing::log_id;

    fn entry(index: u64, bytes: usize) -> Entry {
        let payload = if bytes == 0 {
            openraft::EntryPayload::Blank
        } else {
            openraft::EntryPayload::Normal(Request::new(
                index,
                Command::PublishTokenizer {
                    tokenizer_sha256: format!("{index}"),
                    package: TokenizerPackage(vec![7; bytes]),
                },
            ))
        };
        Entry {
            log_id: log_id::<TypeConfig>(2, 1, index),
            payload,
        }
    }

    fn request(sizes: &[usize]) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(2, 1),
            prev_log_id: Some(log_id::<TypeConfig>(1, 1, 9)),
            entries: sizes
                .iter()
                .enumerate()
                .map(|(i, &b)| entry(10 + i as u64, b))
                .collect(),
            leader_commit: Some(log_id::<TypeConfig>(2, 1, 12)),
        }
    }

    fn size(e: &Entry) -> usize {
        bincode::serialized_size(e).unwrap() as usize
    }

    /// A request over the budget goes as consecutive requests: together the same entries in the
    /// same order, each part within the budget (an entry larger than it alone), each part's
    /// `prev_log_id` the last entry of the part before, the vote and commit on every part.
    #[test]
    fn a_large_replication_request_goes_as_consecutive_parts_within_the_budget() {
        let sizes = [1_000, 1_000, 5_000, 0, 1_000, 300, 300, 300, 2_500, 0];
        let req = request(&sizes);
        let budget = size(&req.entries[0]) * 2 + 16;
        let (vote, first_prev, commit, all) = (req.vote, req.prev_log_id, req.leader_commit, req.entries.clone());
        let parts = split_append(req, budget);
        assert!(parts.len() > 3, "{} parts", parts.len());
        let joined: Vec<Entry> = parts.iter().flat_map(|p| p.entries.clone()).collect();
        assert_eq!(joined, all);
        let mut prev = first_prev;
        for p in &parts {
            assert!(!p.entries.is_empty());
            assert_eq!(p.prev_log_id, prev);
            assert_eq!((p.vote, p.leader_commit), (vote, commit));
            let bytes: usize = p.entries.iter().map(size).sum();
            assert!(bytes <= budget || p.entries.len() == 1, "{bytes} > {budget}");
            prev = p.entries.last().map(|e| e.log_id);
        }
        // Every part but the last was full: adding the next entry would have passed the budget.
        for w in parts.windows(2) {
            let bytes: usize = w[0].entries.iter().map(size).sum();
            assert!(bytes + size(&w[1].entries[0]) > budget);
        }
    }

    /// Within the bound a request is sent as it is, an empty one (a heartbeat) too; past it every
    /// message is within the bound and decodes to a part of it.
    #[test]
    fn only_a_request_past_the_bound_is_split() {
        for sizes in [&[][..], &[0, 100, 0][..]] {
            let whole = pack(&request(sizes)).unwrap();
            let packed = pack_append(request(sizes));
            assert_eq!(packed.len(), 1);
            assert_eq!(packed[0].as_ref().unwrap().data, whole.data);
        }
        let third = REPLICATION_MESSAGE_BYTES_MAX / 3;
        let sizes = [third, third, third, third, 10];
        let packed = pack_append(request(&sizes));
        assert_eq!(
            packed.len(),
            2,
            "two of the large entries a message (the small one with the last two)"
        );
        let mut entries = Vec::new();
        for p in packed {
            let p = p.unwrap();
            assert!(p.data.len() <= REPLICATION_MESSAGE_BYTES_MAX);
            let part: AppendEntriesRequest<TypeConfig> = unpack(&p).unwrap();
            entries.extend(part.entries);
        }
        assert_eq!(entries, request(&sizes).entries);
    }

    /// A node of a one-node cluster, once it leads.
    async fn leader_alone(dir: &std::path::Path) -> crate::node::RunningNode {
        let mut cfg = crate::node::NodeConfig::new(1, "127.0.0.1:0".parse().unwrap(), dir.to_path_buf());
        cfg.initial_members = vec![(1, "127.0.0.1:0".into())];
        let n = crate::node::start(cfg).await.expect("node starts");
        for _ in 0..100 {
            if n.ctx.status().leader_id == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        n
    }

    /// The received snapshot files left in data dir `dir`.
    fn incoming_files(dir: &std::path::Path) -> Vec<String> {
        std::fs::read_dir(crate::data_dir::snapshot_dir(dir))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("incoming-"))
            .collect()
    }

    /// A snapshot stream that ends early, or carries garbage, under a newer leader's vote is
    /// refused as one bad RPC, and the node's Raft goes on. It was handed to openraft as it
    /// was, whose state machine then failed to load it: a storage error, which stopped the
    /// node's Raft core for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_broken_snapshot_from_a_peer_is_refused_and_raft_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let n = leader_alone(dir.path()).await;
        let meta = SnapshotMeta {
            last_log_id: Some(log_id::<TypeConfig>(50, 2, 5_000)),
            last_membership: Default::default(),
        };
        let vote = Vote::new_committed(50, 2);
        let chunk = tokenlog_proto::raft::SnapshotChunk {
            meta: Some(pack(&(vote, meta)).unwrap()),
            data: vec![7; 1 << 16],
        };
        let mut c = RaftTransportClient::connect(format!("http://{}", n.local_addr))
            .await
            .unwrap();
        let answer = c.install_snapshot(futures::stream::iter([chunk])).await;
        let status = answer.expect_err("a snapshot that does not load is refused");
        assert!(status.message().contains("received snapshot refused"), "{status:?}");
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let running = openraft::async_runtime::WatchReceiver::borrow_watched(&n.ctx.raft.metrics())
            .running_state
            .clone();
        assert!(running.is_ok(), "the node's Raft stopped: {running:?}");
        let left = incoming_files(dir.path());
        assert!(left.is_empty(), "received files left: {left:?}");
    }

    /// The node's own newest snapshot as one chunk of a stream sent under `vote`: a snapshot
    /// that loads, so that it reaches openraft.
    async fn own_snapshot_chunk(
        n: &crate::node::RunningNode,
        dir: &std::path::Path,
        vote: Vote,
    ) -> tokenlog_proto::raft::SnapshotChunk {
        n.ctx.raft.trigger().snapshot().await.unwrap();
        let snapshots = crate::snapshot::SnapshotDir::open_read_only(&crate::data_dir::snapshot_dir(dir));
        let mut own = None;
        for _ in 0..100 {
            own = snapshots.newest().unwrap();
            if own.is_some() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let own = own.expect("the node built a snapshot");
        let meta = own.verify().unwrap();
        tokenlog_proto::raft::SnapshotChunk {
            meta: Some(pack(&(vote, meta)).unwrap()),
            data: std::fs::read(own.path()).unwrap(),
        }
    }

    /// A snapshot that openraft does not install (sent with an older vote) leaves nothing on
    /// disk. The received file stayed until a restart: up to `SNAPSHOT_BYTES_MAX` of a peer's
    /// bytes each time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_received_snapshot_that_is_not_installed_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let n = leader_alone(dir.path()).await;
        assert_eq!(n.ctx.status().leader_id, 1, "a leader of term 1 or later");
        let old_vote = Vote::new(0, 2);
        let chunk = own_snapshot_chunk(&n, dir.path(), old_vote).await;
        let mut c = RaftTransportClient::connect(format!("http://{}", n.local_addr))
            .await
            .unwrap();
        let answer = c.install_snapshot(futures::stream::iter([chunk])).await.unwrap();
        let vote: Vote = unpack(answer.get_ref()).unwrap();
        assert!(vote > old_vote, "answered with the node's newer vote: {vote}");
        let left = incoming_files(dir.path());
        assert!(left.is_empty(), "received files left: {left:?}");
    }

    /// A sender that stops waiting while its snapshot is checked (a leader that lost its term,
    /// a broken connection) leaves nothing on disk either: the check, the offer to openraft and
    /// the clean-up go on without the call. The call did them itself, and dropped with it, it
    /// left the whole received file until a restart.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_snapshot_whose_sender_stopped_waiting_leaves_no_file() {
        use std::sync::atomic::Ordering::Relaxed;
        let dir = tempfile::tempdir().unwrap();
        let n = leader_alone(dir.path()).await;
        let chunk = own_snapshot_chunk(&n, dir.path(), Vote::new(0, 2)).await;
        let mut c = RaftTransportClient::connect(format!("http://{}", n.local_addr))
            .await
            .unwrap();
        CHECK_PAUSE_MS.store(1_000, Relaxed);
        let send = c.install_snapshot(futures::stream::iter([chunk]));
        let gave_up = tokio::time::timeout(std::time::Duration::from_millis(400), send).await;
        assert!(gave_up.is_err(), "answered before the pause ended: {gave_up:?}");
        let received = incoming_files(dir.path());
        assert_eq!(received.len(), 1, "the whole stream was received: {received:?}");
        drop(c);
        tokio::time::sleep(std::time::Duration::from_millis(2_000)).await;
        CHECK_PAUSE_MS.store(0, Relaxed);
        let left = incoming_files(dir.path());
        assert!(left.is_empty(), "received files left: {left:?}");
    }
}
