//! The leader's proposer (group commit at the proposal level) on a real single-node log:
//! concurrent commands share entries, and every command gets its own answer.

use std::sync::Arc;

use tokenlog_raftlog::node::{self, NodeConfig};
use tokenlog_raftlog::types::{Binding, Command, ModelIdentity, Response, StopConfig};

fn submit(rid: String) -> Command {
    Command::Submit {
        tenant: "t".into(),
        request_id: rid,
        binding: Binding {
            model: ModelIdentity {
                weights_sha256: "w".into(),
                tokenizer_sha256: "t".into(),
                architecture: "llama".into(),
                dtype_class: "fake".into(),
            },
            prompt_token_ids: vec![1],
            stop: StopConfig {
                max_tokens: 4,
                ..Default::default()
            },
            ..Default::default()
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_share_entries_and_each_gets_its_own_answer() {
    const WRITES: usize = 400;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = NodeConfig::new(1, "127.0.0.1:0".parse().unwrap(), dir.path().to_path_buf());
    cfg.initial_members = vec![(1, "127.0.0.1:0".into())];
    let n = node::start(cfg).await.expect("node starts");
    let ctx = n.ctx.clone();
    // Wait until it leads.
    for _ in 0..100 {
        if ctx.status().leader_id == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let before = ctx.metrics.proposals.get();
    let tasks: Vec<_> = (0..WRITES)
        .map(|i| {
            let ctx: Arc<node::NodeCtx> = ctx.clone();
            tokio::spawn(async move { (i, ctx.write(submit(format!("r{i}"))).await) })
        })
        .collect();
    let mut ids = std::collections::BTreeSet::new();
    for t in tasks {
        let (i, r) = t.await.unwrap();
        let (resp, _) = r.expect("write answered");
        match resp {
            Response::Submitted {
                generation,
                created: true,
            } => {
                assert_eq!(generation.request_id, format!("r{i}"), "answer of another command");
                ids.insert(generation.id);
            }
            r => panic!("write {i}: {r:?}"),
        }
    }
    assert_eq!(ids.len(), WRITES, "one generation per submit");
    let proposals = ctx.metrics.proposals.get() - before;
    eprintln!("{WRITES} concurrent writes in {proposals} entries");
    assert!(
        proposals < WRITES as u64,
        "{WRITES} concurrent writes took {proposals} entries: nothing was merged"
    );
    n.shutdown().await;
}
