//! Membership changes a cluster cannot make are refused at once, as invalid, on a real
//! single-node log over real gRPC. They were UNAVAILABLE, which the client retries for its
//! whole budget (15 s) before it gives up.

use std::time::{Duration, Instant};

use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::{ClientError, LogClient};
use tokenlog_raftlog::node::{self, NodeConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_membership_change_that_cannot_be_made_is_refused_at_once() {
    use pb::change_membership_request::Op;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = NodeConfig::new(1, "127.0.0.1:0".parse().unwrap(), dir.path().to_path_buf());
    cfg.initial_members = vec![(1, "127.0.0.1:0".into())];
    let n = node::start(cfg).await.expect("node starts");
    let client = LogClient::new(vec![n.local_addr.to_string()]).unwrap();
    for _ in 0..100 {
        if n.ctx.status().leader_id == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let add = |ids: &[u64]| Op::AddVoters(pb::AddVoters { node_ids: ids.to_vec() });
    let remove = |ids: &[u64]| Op::RemoveVoters(pb::RemoveVoters { node_ids: ids.to_vec() });
    for (what, op, want) in [
        ("a voter that is not a learner", add(&[99]), "not found"),
        ("no voter left", remove(&[1]), "empty"),
        ("no node named", add(&[]), "names no node"),
    ] {
        let t0 = Instant::now();
        let e = client
            .change_membership(pb::ChangeMembershipRequest { op: Some(op) })
            .await
            .expect_err(what);
        let ClientError::Status(s) = &e else {
            panic!("{what}: {e}");
        };
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "{what}: {s:?}");
        assert!(s.message().to_lowercase().contains(want), "{what}: {}", s.message());
        assert!(t0.elapsed() < Duration::from_secs(3), "{what}: {:?}", t0.elapsed());
    }
    // A member added again at other addresses: refused, naming where it is (it was acknowledged
    // and changed nothing). At its own address it is a retry, and succeeds.
    let learner = |addr: String| {
        Op::AddLearner(pb::MemberStatus {
            node_id: 1,
            addr,
            ..Default::default()
        })
    };
    let e = client
        .change_membership(pb::ChangeMembershipRequest {
            op: Some(learner("127.0.0.1:9".into())),
        })
        .await
        .expect_err("a member at other addresses");
    let ClientError::Status(s) = &e else { panic!("{e}") };
    assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("already a member"), "{}", s.message());
    let status = client.cluster_status(true).await.unwrap();
    let own = status
        .members
        .iter()
        .find(|m| m.node_id == 1)
        .expect("node 1")
        .addr
        .clone();
    client
        .change_membership(pb::ChangeMembershipRequest {
            op: Some(learner(own.clone())),
        })
        .await
        .expect("the same member at its own address again");
    let after = client.cluster_status(true).await.unwrap();
    assert_eq!(after.members.iter().find(|m| m.node_id == 1).unwrap().addr, own);
    // The leader of a one-node cluster is its own quorum: never cut off, however long no
    // acknowledgment comes (it was, after CUT_OFF_AFTER: every Watch of `tokenlog dev` refused).
    tokio::time::sleep(tokenlog_raftlog::limits::CUT_OFF_AFTER + Duration::from_millis(700)).await;
    assert_eq!(n.ctx.cut_off(), None);
    n.shutdown().await;
}
