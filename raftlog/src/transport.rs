//! Raft transport over tonic gRPC (`raft.v1.RaftTransport`). openraft's messages travel as
//! bincode payloads (their schema is openraft's, versioned by `PAYLOAD_VERSION`); snapshots are
//! streamed in chunks.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use openraft::error::{NetworkError, RPCError, ReplicationClosed, StreamingError, Timeout, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory};
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
use crate::limits::{CONNECT_TIMEOUT, GRPC_MESSAGE_BYTES_MAX, SNAPSHOT_CHUNK_BYTES};
use crate::raft_types::{Node, NodeId, Raft, Snapshot, SnapshotData, SnapshotMeta, TypeConfig, Vote};

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

// ------------------------------------------------------------------------------------ client

/// Creates connections to peers; channels are shared per address.
#[derive(Clone, Default)]
pub struct Network {
    /// This node's id (named in timeout errors).
    pub self_id: NodeId,
    channels: Arc<Mutex<HashMap<String, Channel>>>,
}

impl Network {
    pub fn new(self_id: NodeId) -> Self {
        Network {
            self_id,
            channels: Default::default(),
        }
    }

    fn channel(&self, addr: &str) -> Result<Channel, String> {
        let mut map = self.channels.lock().expect("lock");
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("bad peer address {addr:?}: {e}"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
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
        let client = self.channel(&node.addr).map(|c| {
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
        let data = snapshot.snapshot;
        let mut chunks = vec![SnapshotChunk {
            meta: Some(meta),
            data: Vec::new(),
        }];
        chunks.extend(data.chunks(SNAPSHOT_CHUNK_BYTES).map(|c| SnapshotChunk {
            meta: None,
            data: c.to_vec(),
        }));
        let send = client.install_snapshot(tokio_stream::iter(chunks));
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
}

impl RaftService {
    pub fn new(raft: Raft) -> Self {
        RaftService { raft }
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
        let mut data = first.data;
        while let Some(chunk) = stream.message().await? {
            data.extend_from_slice(&chunk.data);
        }
        let snapshot = Snapshot { meta, snapshot: data };
        let resp = self
            .raft
            .install_full_snapshot(vote, snapshot)
            .await
            .map_err(raft_failed)?;
        reply(&resp.vote)
    }
}
