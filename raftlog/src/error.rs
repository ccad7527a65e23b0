//! The log's errors, and the one place that maps them (and typed rejections) to `tonic::Status`.

use tonic::{Code, Status};

use crate::types::{RejectReason, Rejection};

/// gRPC metadata key naming the leader's address on a `NotLeader` answer.
pub const LEADER_ADDR_HEADER: &str = "x-tokenlog-leader-addr";

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// This node cannot serve the call; the client should retry at the leader (nothing was
    /// proposed here).
    #[error("node is not the leader (leader: {})", leader_addr.as_deref().unwrap_or("unknown"))]
    NotLeader { leader_addr: Option<String> },
    /// Raft could not finish the call; it may or may not have been committed. Retrying the same
    /// command is safe: every command is idempotent.
    #[error("raft: {0}")]
    Raft(String),
    /// This node cannot serve the call now and knows no leader to send it to (cut off from the
    /// cluster's quorum): the client should try another node.
    #[error("{0}")]
    Unavailable(String),
    #[error("{}", .0.message)]
    Rejected(Rejection),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("not found: {0}")]
    NotFound(String),
    /// The node's disk: its data dir, RocksDB, a row that does not decode.
    #[error("storage: {context}: {source}")]
    Storage {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The data dir holds something broken (a checksum that does not match, a hash chain that
    /// breaks, a log with a hole). A node in this state does not serve.
    #[error("{dir}: {} integrity problem(s), refusing to serve: {}. Run `tokenlog verify --data-dir {dir}` for the full report; to recover, move the data dir aside and let the node rebuild from a healthy peer (`tokenlog members replace`, see the README)", problems.len(), problems.iter().take(3).cloned().collect::<Vec<_>>().join("; "))]
    Integrity { dir: String, problems: Vec<String> },
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// TLS material that cannot be used (a file that does not read, a certificate of the wrong
    /// role).
    #[error("tls: {0}")]
    Tls(String),
    /// A `raft.v1` payload that does not decode, or cannot be encoded.
    #[error(transparent)]
    Payload(#[from] PayloadError),
    /// A bug: an answer of the wrong kind, or another broken expectation of this node.
    #[error("internal: {0}")]
    Internal(String),
}

impl LogError {
    pub fn storage(context: impl std::fmt::Display, source: impl Into<std::io::Error>) -> Self {
        LogError::Storage {
            context: context.to_string(),
            source: source.into(),
        }
    }
}

/// A `raft.v1` payload (openraft's messages as versioned bincode) that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    #[error("raft payload version {got} is not {expected}")]
    Version { got: u32, expected: u32 },
    #[error("bad raft payload: {0}")]
    Codec(#[from] bincode::Error),
    #[error("{0}")]
    Malformed(&'static str),
}

fn rejection_code(r: RejectReason) -> Code {
    match r {
        RejectReason::NotFound => Code::NotFound,
        RejectReason::BindingConflict => Code::AlreadyExists,
        RejectReason::Limit => Code::OutOfRange,
        RejectReason::Full => Code::ResourceExhausted,
        RejectReason::Invalid | RejectReason::ModelMismatch => Code::InvalidArgument,
        RejectReason::StaleEpoch
        | RejectReason::LeaseExpired
        | RejectReason::SeqMismatch
        | RejectReason::RecordConflict
        | RejectReason::Terminal
        | RejectReason::LeaseHeld
        | RejectReason::HandoffConflict
        | RejectReason::PipelineConflict => Code::FailedPrecondition,
    }
}

impl From<LogError> for Status {
    fn from(e: LogError) -> Status {
        let msg = e.to_string();
        match e {
            LogError::NotLeader { leader_addr } => {
                let mut s = Status::unavailable(msg);
                if let Some(addr) = leader_addr.and_then(|a| a.parse().ok()) {
                    s.metadata_mut().insert(LEADER_ADDR_HEADER, addr);
                }
                s
            }
            LogError::Raft(_) | LogError::Unavailable(_) => Status::unavailable(msg),
            LogError::Rejected(r) => Status::new(rejection_code(r.reason), msg),
            LogError::Invalid(_) => Status::invalid_argument(msg),
            LogError::NotFound(_) => Status::not_found(msg),
            LogError::Storage { .. } | LogError::Listen { .. } | LogError::Tls(_) | LogError::Internal(_) => {
                Status::internal(msg)
            }
            LogError::Integrity { .. } => Status::data_loss(msg),
            LogError::Payload(_) => Status::invalid_argument(msg),
        }
    }
}

/// The leader address a `NotLeader` status names, if any.
pub fn leader_hint(s: &Status) -> Option<String> {
    s.metadata()
        .get(LEADER_ADDR_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}
