//! `AppendStream` on a real single-node log over real gRPC: pipelined appends are proposed in
//! order and answered in order, one answer per request; a gap is refused with the frontier;
//! an overlapping re-send after it is accepted.

use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;
use tokenlog_raftlog::node::{self, NodeConfig};

fn model() -> pb::ModelIdentity {
    pb::ModelIdentity {
        weights_sha256: "w".into(),
        tokenizer_sha256: "t".into(),
        architecture: "llama".into(),
        dtype_class: "fake".into(),
    }
}

fn append(gen: u64, epoch: u64, start_seq: u32, tokens: &[u32]) -> pb::AppendRequest {
    pb::AppendRequest {
        decoder_id: "d1".into(),
        lease_ms: 60_000,
        items: vec![pb::AppendItem {
            generation_id: gen,
            epoch,
            start_seq,
            token_ids: tokens.to_vec(),
            ..Default::default()
        }],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_appends_are_answered_in_order_and_a_gap_is_refused_with_the_frontier() {
    const N: u32 = 200;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = NodeConfig::new(1, "127.0.0.1:0".parse().unwrap(), dir.path().to_path_buf());
    cfg.initial_members = vec![(1, "127.0.0.1:0".into())];
    let n = node::start(cfg).await.expect("node starts");
    let client = LogClient::new(vec![n.local_addr.to_string()]).unwrap();
    for _ in 0..100 {
        if n.ctx.status().leader_id == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let sub = client
        .submit(pb::SubmitRequest {
            tenant: "t".into(),
            request_id: "r".into(),
            binding: Some(pb::Binding {
                model: Some(model()),
                prompt_token_ids: vec![1, 2],
                stop: Some(pb::StopConfig {
                    max_tokens: 1_000,
                    ..Default::default()
                }),
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    let gen = sub.generation.unwrap().generation_id;
    let acq = client
        .acquire(pb::AcquireRequest {
            generation_id: gen,
            decoder_id: "d1".into(),
            lease_ms: 60_000,
            model: Some(model()),
            rng_version: 0,
        })
        .await
        .unwrap();
    assert!(acq.ok, "{acq:?}");
    let epoch = acq.generation.unwrap().lease.unwrap().epoch;

    let mut s = client.append_stream().await.expect("stream opens on the leader");
    // All N go out before any answer is read: each starts where the previous one ends.
    for i in 0..N {
        s.send(append(gen, epoch, i, &[i + 10])).await.unwrap();
    }
    let mut last_index = 0;
    for i in 0..N {
        let a = s.answer().await.expect("answered");
        let r = &a.results[0];
        assert!(r.accepted, "append {i}: {r:?}");
        assert_eq!(r.frontier, i + 1, "answers come in request order");
        assert!(a.log_index >= last_index, "log index went back");
        last_index = a.log_index;
    }

    // A gap (an append of the stream was lost): refused with the frontier, nothing written.
    s.send(append(gen, epoch, N + 5, &[1])).await.unwrap();
    let r = s.answer().await.unwrap().results.remove(0);
    assert!(!r.accepted);
    let rej = r.rejection.expect("a rejection");
    assert_eq!(rej.reason, pb::RejectReason::SeqMismatch as i32);
    assert_eq!(rej.frontier, N);
    // The re-send from an earlier acknowledged frontier overlaps and extends: accepted.
    let mut tail: Vec<u32> = (N - 3..N).map(|i| i + 10).collect();
    tail.extend([7, 8]);
    s.send(append(gen, epoch, N - 3, &tail)).await.unwrap();
    let r = s.answer().await.unwrap().results.remove(0);
    assert!(r.accepted, "{r:?}");
    assert_eq!(r.frontier, N + 2);
    // A different token under a committed seq is a conflict, not an overwrite.
    s.send(append(gen, epoch, 0, &[99])).await.unwrap();
    let r = s.answer().await.unwrap().results.remove(0);
    assert!(!r.accepted);
    assert_eq!(r.rejection.unwrap().reason, pb::RejectReason::RecordConflict as i32);

    // What the stream wrote is what a Get sees.
    let g = client
        .get(pb::GetRequest {
            generation_id: gen,
            linearizable: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .generation
        .unwrap();
    assert_eq!(g.frontier, N + 2);

    // A finish reason the log does not know is refused, not read as none: the records
    // committed and the generation went on, its owner told they were accepted.
    let mut unknown = append(gen, epoch, N + 2, &[5]);
    unknown.items[0].finish = 9;
    let e = client.append(unknown).await.expect_err("an unknown finish reason");
    assert!(e.to_string().contains("unknown finish reason 9"), "{e}");
    let g = client.generation(gen).await.unwrap();
    assert_eq!(
        (g.frontier, g.state),
        (N + 2, pb::GenerationState::Running as i32),
        "nothing was written"
    );
    drop(s);
    n.shutdown().await;
}
