//! openraft type configuration: what a Raft entry carries and what applying it answers.

use crate::types::{Request, Response};

openraft::declare_raft_types!(
    /// tokenlog's Raft types: entries carry a stamped [`Request`], applying one answers a [`Response`].
    pub TypeConfig:
        D = Request,
        R = Response,
        Node = Node,
);

pub type NodeId = u64;
pub type Entry = openraft::alias::EntryOf<TypeConfig>;
pub type LogId = openraft::alias::LogIdOf<TypeConfig>;
pub type Vote = openraft::alias::VoteOf<TypeConfig>;
pub type StoredMembership = openraft::alias::StoredMembershipOf<TypeConfig>;
pub type SnapshotMeta = openraft::alias::SnapshotMetaOf<TypeConfig>;
/// Snapshots are files (see `snapshot`), streamed to followers in chunks.
pub type SnapshotData = crate::snapshot::SnapshotFile;
pub type Snapshot = openraft::alias::SnapshotOf<TypeConfig, SnapshotData>;
pub type Raft = openraft::Raft<TypeConfig, crate::sm_store::SmStore>;

/// A member of the cluster, as membership records it: where clients reach its `raftlog.v1` API
/// (redirects name it) and where peers reach its `raft.v1` transport.
///
/// On disk and on the wire it is one string, `ADDR` when both are the same listener and
/// `ADDR PEER_ADDR` otherwise: exactly what openraft's `BasicNode { addr }` wrote before nodes
/// had two listeners, so data dirs of that time read unchanged (every member: one listener).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Node {
    /// The client API (`raftlog.v1`), `host:port`.
    pub addr: String,
    /// The Raft transport (`raft.v1`), `host:port`; empty: `addr` serves both.
    pub peer_addr: String,
}

impl Node {
    pub fn new(addr: impl Into<String>, peer_addr: impl Into<String>) -> Node {
        let (addr, peer_addr) = (addr.into(), peer_addr.into());
        let peer_addr = if peer_addr == addr { String::new() } else { peer_addr };
        Node { addr, peer_addr }
    }

    /// Where peers send Raft traffic.
    pub fn peer(&self) -> &str {
        if self.peer_addr.is_empty() {
            &self.addr
        } else {
            &self.peer_addr
        }
    }

    fn encoded(&self) -> String {
        if self.peer_addr.is_empty() {
            self.addr.clone()
        } else {
            format!("{} {}", self.addr, self.peer_addr)
        }
    }
}

/// One listener for both: `"host:port".into()`.
impl From<&str> for Node {
    fn from(addr: &str) -> Node {
        Node::new(addr, "")
    }
}

impl From<String> for Node {
    fn from(addr: String) -> Node {
        Node::new(addr, "")
    }
}

impl std::fmt::Display for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.peer_addr.is_empty() {
            write!(f, "{}", self.addr)
        } else {
            write!(f, "{} (peers: {})", self.addr, self.peer_addr)
        }
    }
}

impl serde::Serialize for Node {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.encoded())
    }
}

impl<'de> serde::Deserialize<'de> for Node {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Node, D::Error> {
        let s = String::deserialize(d)?;
        Ok(match s.split_once(' ') {
            Some((addr, peer)) => Node::new(addr, peer),
            None => Node::new(s, ""),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Node;

    #[test]
    fn a_node_reads_what_basic_node_wrote_and_round_trips() {
        let old = bincode::serialize(&openraft::BasicNode::new("10.0.0.1:7001")).unwrap();
        let n: Node = bincode::deserialize(&old).unwrap();
        assert_eq!(n, Node::new("10.0.0.1:7001", ""));
        assert_eq!(n.peer(), "10.0.0.1:7001");
        assert_eq!(
            bincode::serialize(&n).unwrap(),
            old,
            "one listener: the same bytes as before"
        );
        let two = Node::new("10.0.0.1:7001", "10.0.0.1:7002");
        let back: Node = bincode::deserialize(&bincode::serialize(&two).unwrap()).unwrap();
        assert_eq!(back, two);
        assert_eq!(back.peer(), "10.0.0.1:7002");
        assert_eq!(
            Node::new("a:1", "a:1").peer_addr,
            "",
            "one listener named twice is one listener"
        );
    }
}
