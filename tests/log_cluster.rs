//! Real multi-process tests of the replicated log: three `tokenlog node` processes with real
//! RocksDB data dirs and real gRPC between them, killed with SIGKILL.

// The tests hold `common::serial()` (a std mutex) across awaits on purpose: each test runs its
// own runtime on its own thread, and the guard only keeps two multi-process tests from running
// at once on a 2-core machine.
#![allow(clippy::await_holding_lock)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{owned_generations, serial, Cluster};

use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

/// Appends one token per generation per step until `stop`; retries each step (unchanged) until
/// acknowledged. Returns the acknowledged frontier.
async fn writer(
    client: LogClient,
    gens: Vec<(u64, u64)>,
    decoder: String,
    stop: tokio::sync::watch::Receiver<bool>,
    min_writes: u32,
) -> u32 {
    let mut seq = 0u32;
    while !*stop.borrow() || seq < min_writes {
        let items: Vec<pb::AppendItem> = gens
            .iter()
            .map(|&(id, epoch)| pb::AppendItem {
                generation_id: id,
                epoch,
                start_seq: seq,
                token_ids: vec![seq * 7 + id as u32],
                ..Default::default()
            })
            .collect();
        let req = pb::AppendRequest {
            decoder_id: decoder.clone(),
            lease_ms: 60_000,
            items,
        };
        loop {
            match client.append(req.clone()).await {
                Ok(r) => {
                    assert!(r.results.iter().all(|x| x.accepted), "append rejected: {r:?}");
                    break;
                }
                Err(e) => eprintln!("append retry after: {e}"),
            }
        }
        seq += 1;
    }
    seq
}

async fn tokens_of(client: &LogClient, id: u64) -> Vec<u32> {
    use futures::StreamExt;
    let mut stream = client.watch(id, 0).await.unwrap();
    let mut out = Vec::new();
    // Not terminal: read what is there, stop when nothing more arrives for a moment.
    while let Ok(Some(Ok(ev))) = tokio::time::timeout(Duration::from_millis(500), stream.next()).await {
        for r in ev.records {
            assert_eq!(r.seq as usize, out.len(), "watch skipped or repeated a record");
            out.push(r.token_id);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_leader_during_appends_loses_no_acknowledged_record() {
    let _serial = serial();
    let mut cluster = Cluster::start(20_000);
    let first_leader = cluster.leader().await;
    let client = cluster.client();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut writers = Vec::new();
    let mut all_gens = Vec::new();
    for w in 0..4 {
        let gens = owned_generations(&client, 4, &format!("dec{w}")).await;
        all_gens.extend(gens.iter().map(|g| g.0));
        writers.push(tokio::spawn(writer(
            cluster.client(),
            gens,
            format!("dec{w}"),
            stop_rx.clone(),
            0,
        )));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    cluster.kill9(first_leader);
    let killed_at = Instant::now();
    let new_leader = cluster.leader().await;
    assert_ne!(new_leader, first_leader);
    eprintln!(
        "leader {} killed; node {} leads after {:?}",
        first_leader + 1,
        new_leader + 1,
        killed_at.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    cluster.start_node(first_leader);
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_tx.send(true).unwrap();
    let mut acked = Vec::new();
    for w in writers {
        acked.push(w.await.unwrap());
    }
    assert!(acked.iter().all(|&n| n > 5), "writers made progress: {acked:?}");

    let heads = cluster.converged().await;
    for (w, &frontier) in acked.iter().enumerate() {
        for &id in &all_gens[w * 4..w * 4 + 4] {
            let (committed, _) = heads[&id];
            assert!(
                committed >= frontier,
                "generation {id}: {frontier} acknowledged, {committed} committed"
            );
            let toks = tokens_of(&client, id).await;
            let expect: Vec<u32> = (0..committed).map(|s| s * 7 + id as u32).collect();
            assert_eq!(toks, expect, "generation {id} records");
        }
    }
    // The audit agrees on every node.
    for i in 0..3 {
        let mut c = client.node(&cluster.addrs[i]);
        let v = c.verify(pb::VerifyRequest {}).await.unwrap().into_inner();
        assert!(v.problems.is_empty(), "node {}: {:?}", i + 1, v.problems);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_all_nodes_at_once_keeps_identical_state_and_wiped_node_catches_up_by_snapshot() {
    let _serial = serial();
    // Snapshot often so that the log before it is purged and a wiped node needs the snapshot.
    let mut cluster = Cluster::start(50);
    cluster.leader().await;
    let client = cluster.client();
    let gens = owned_generations(&client, 8, "dec").await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let w = tokio::spawn(writer(cluster.client(), gens.clone(), "dec".into(), stop_rx, 0));
    tokio::time::sleep(Duration::from_millis(2000)).await;
    stop_tx.send(true).unwrap();
    let frontier = w.await.unwrap();
    assert!(frontier > 20, "enough entries to snapshot: {frontier}");
    let before = cluster.converged().await;

    // All three die at once and come back.
    for i in 0..3 {
        cluster.kill9(i);
    }
    for i in 0..3 {
        cluster.start_node(i);
    }
    cluster.leader().await;
    let after = cluster.converged().await;
    assert_eq!(before, after, "state identical after restarting every node");

    // Node 3 loses its disk and comes back empty.
    // Purging follows snapshots lazily: keep writing (renewals) until the leader has purged.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = cluster.client().cluster_status(true).await.unwrap();
        if status.purged_index > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "log never purged after snapshots: {status:?}"
        );
        for &(id, epoch) in &gens {
            let renew = pb::RenewRequest {
                generation_id: id,
                epoch,
                decoder_id: "dec".into(),
                lease_ms: 60_000,
            };
            assert!(client.renew(renew).await.unwrap().ok);
        }
    }
    let before = cluster.converged().await;
    cluster.kill9(2);
    std::fs::remove_dir_all(cluster.data_dir(2)).unwrap();
    assert!(!Path::new(&cluster.data_dir(2)).exists());
    cluster.start_node(2);
    let healed = cluster.converged().await;
    assert_eq!(before, healed, "wiped node caught up");
    // Its state is installed before Raft's metrics say so (openraft reports the snapshot once
    // its core has processed the install): the status may lag the heads for a moment.
    let mut c = client.node(&cluster.addrs[2]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s3 = c
            .cluster_status(pb::ClusterStatusRequest { linearizable: false })
            .await
            .unwrap()
            .into_inner();
        if s3.snapshot_index > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "node 3 was restored from a snapshot: {s3:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let verify = |dir: &Path| {
        std::process::Command::new(common::bin())
            .args(["verify", "--data-dir"])
            .arg(dir)
            .output()
            .unwrap()
    };
    // On a running node's data dir it refuses: the node changes it while it is read (a
    // snapshot replaced, entries purged), which read as broken chains. It read it anyway.
    let live = verify(&cluster.data_dir(2));
    let live_err = String::from_utf8_lossy(&live.stderr).to_string();
    assert!(!live.status.success(), "{}", String::from_utf8_lossy(&live.stdout));
    assert!(live_err.contains("in use by a running process"), "{live_err}");
    // `tokenlog verify` on the stopped node's data dir: intact.
    cluster.kill9(2);
    let ok = verify(&cluster.data_dir(2));
    let ok_text = String::from_utf8_lossy(&ok.stdout).to_string();
    assert!(ok.status.success(), "{ok_text} {}", String::from_utf8_lossy(&ok.stderr));
    assert!(ok_text.contains("every chain intact"), "{ok_text}");

    // A flipped byte in its snapshot: the node refuses to start, and verify says why.
    let snap = std::fs::read_dir(cluster.data_dir(2).join("snapshots"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.extension().is_some_and(|x| x == "snap")
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("snapshot-"))
        })
        .expect("node 3 has a snapshot file");
    let mut bytes = std::fs::read(&snap).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&snap, &bytes).unwrap();
    cluster.start_node(2);
    let status = cluster
        .wait_exit(2, Duration::from_secs(20))
        .expect("a node with a damaged snapshot must not keep running");
    assert!(!status.success());
    let log = cluster.node_log(2);
    assert!(log.contains("refusing to serve") && log.contains("checksum"), "{log}");
    let bad = verify(&cluster.data_dir(2));
    let bad_text = String::from_utf8_lossy(&bad.stdout).to_string();
    assert!(!bad.status.success(), "{bad_text}");
    assert!(
        bad_text.contains("BROKEN") && bad_text.contains("checksum"),
        "{bad_text}"
    );

    // The documented recovery: move the data dir aside; the node rebuilds from its peers.
    std::fs::rename(cluster.data_dir(2), cluster.dir.path().join("node3-damaged")).unwrap();
    cluster.start_node(2);
    assert_eq!(before, cluster.converged().await, "rebuilt node caught up");
}

/// Generations that finish and are pruned within a second (`--retention-ms 500`, the minimum), snapshots every 50
/// entries, and a follower paused for seconds then continued: it catches up (records and pruning
/// of one generation in one apply batch, or a snapshot) without a crash, and every node agrees.
/// (The code read behind raftlog v2 found this path crash-looping a follower when `persist`
/// indexed a pruned generation; there are no per-apply rows any more.)
/// The README's backup and restore (section "Operating a cluster"): a backup is a copy of a
/// stopped follower's data dir; a cluster that lost every disk, restored from that copy on every
/// node, holds the log exactly as it was when the copy was made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_followers_data_dir_is_a_backup_every_node_can_be_restored_from() {
    let _serial = serial();
    let mut cluster = Cluster::start(50);
    let leader = cluster.leader().await;
    let client = cluster.client();
    let gens = owned_generations(&client, 4, "dec").await;
    // Writes to `gens` (from seq 0, as their owner `dec`) for `ms`, and at least 20 writes: an
    // election on a loaded machine may take most of the `ms`.
    let write_for = |client: LogClient, gens: Vec<(u64, u64)>, dec: &str, ms: u64| {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let w = tokio::spawn(writer(client, gens, dec.into(), stop_rx, 20));
        async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            stop_tx.send(true).unwrap();
            // The writer goes on until its 20th write: a cluster that never serves fails here.
            tokio::time::timeout(Duration::from_secs(30), w)
                .await
                .expect("20 writes within 30 s")
                .unwrap()
        }
    };
    assert!(write_for(cluster.client(), gens, "dec", 1_000).await >= 20);
    let before = cluster.converged().await;

    // The backup: one follower stopped (SIGTERM), its data dir copied, the follower started again.
    let f = (leader + 1) % 3;
    cluster.signal(f, "TERM");
    assert!(
        cluster.wait_exit(f, Duration::from_secs(20)).is_some(),
        "the follower did not stop"
    );
    let backup = cluster.dir.path().join("backup");
    let cp = |from: &Path, to: &Path| {
        let st = std::process::Command::new("cp")
            .arg("-a")
            .arg(from)
            .arg(to)
            .status()
            .unwrap();
        assert!(st.success(), "cp -a {} {}", from.display(), to.display());
    };
    cp(&cluster.data_dir(f), &backup);
    cluster.start_node(f);
    cluster.leader().await;
    assert_eq!(
        cluster.converged().await,
        before,
        "the restarted follower holds the log it stopped with"
    );
    let verify = std::process::Command::new(common::bin())
        .args(["verify", "--data-dir"])
        .arg(&backup)
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "verify of the backup: {}",
        String::from_utf8_lossy(&verify.stderr)
    );

    // The cluster goes on; then every disk is lost and each node gets the backup.
    let more = owned_generations(&client, 4, "dec2").await;
    assert!(write_for(cluster.client(), more, "dec2", 1_000).await >= 20);
    assert_ne!(
        cluster.converged().await,
        before,
        "writes after the backup changed the log"
    );
    for i in 0..3 {
        cluster.kill9(i);
        std::fs::remove_dir_all(cluster.data_dir(i)).unwrap();
        cp(&backup, &cluster.data_dir(i));
    }
    for i in 0..3 {
        cluster.start_node(i);
    }
    cluster.leader().await;
    assert_eq!(
        cluster.converged().await,
        before,
        "the restored log is the backed-up one"
    );
}

/// A command too large to replicate is refused before it enters the log, and the log goes on.
/// Before, a `Submit` of 60M prompt tokens (60 MB as gRPC, under the 64 MiB bound; 240 MB as an
/// entry) was proposed: the leader could never send that entry to a follower (the peers'
/// message bound), so it never committed, and neither did any write after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_too_large_for_an_entry_is_refused_and_the_log_goes_on() {
    let _one = serial();
    let cluster = Cluster::start(0);
    let client = cluster.client();
    common::submit(&client, "before").await;
    let huge = pb::Binding {
        model: Some(common::model()),
        prompt_token_ids: vec![1; 60_000_000],
        stop: Some(pb::StopConfig {
            max_tokens: 10,
            ..Default::default()
        }),
        ..Default::default()
    };
    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        client.submit(pb::SubmitRequest {
            tenant: "t".into(),
            request_id: "huge".into(),
            binding: Some(huge),
        }),
    )
    .await
    .expect("the huge submit is answered")
    .expect_err("a 240 MB command is refused");
    let text = refused.to_string();
    assert!(text.contains("a command of") && text.contains("at most"), "{text}");
    // The log still takes writes.
    let after = tokio::time::timeout(Duration::from_secs(20), common::submit(&client, "after"))
        .await
        .expect("a write after the refused one commits");
    assert!(after > 0);
}

/// A follower that was down while a few commands near the entry bound were written catches up.
/// openraft sends a lagging follower up to 300 entries in one request: six entries of ~14 MB
/// went as one message past the peers' 64 MiB bound, refused on every try, and the follower
/// never caught up (nor could it have served as a quorum member again). Such a request now goes
/// as several (`transport::split_append`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_behind_entries_too_large_for_one_message_catches_up() {
    let _one = serial();
    // No snapshot in the meantime: the follower must catch up through the entries themselves.
    let mut cluster = Cluster::start(100_000);
    let client = cluster.client();
    common::submit(&client, "before").await;
    let leader = cluster.leader().await;
    let follower = (leader + 1) % 3;
    cluster.kill9(follower);
    for i in 0..6 {
        // 3.5M prompt tokens: ~3.5 MB as gRPC, ~14 MB as an entry (under COMMAND_BYTES_MAX).
        // `apply` refuses the prompt's length, but the entry is in the log all the same.
        let big = pb::Binding {
            model: Some(common::model()),
            prompt_token_ids: vec![1; 3_500_000],
            stop: Some(pb::StopConfig {
                max_tokens: 10,
                ..Default::default()
            }),
            ..Default::default()
        };
        let refused = client
            .submit(pb::SubmitRequest {
                tenant: "t".into(),
                request_id: format!("big{i}"),
                binding: Some(big),
            })
            .await
            .expect_err("apply refuses a prompt that long");
        assert!(refused.to_string().contains("prompt tokens"), "{refused}");
    }
    common::submit(&client, "after").await;
    let target = client.cluster_status(true).await.unwrap().last_log_index;
    cluster.start_node(follower);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut node = client.node(&cluster.addrs[follower]);
    loop {
        let applied = match node.cluster_status(pb::ClusterStatusRequest::default()).await {
            Ok(r) => r.into_inner().applied_index,
            Err(_) => 0,
        };
        if applied >= target {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the follower applied up to {applied} of {target} in 30 s; its log:\n{}\nthe leader's:\n{}",
            cluster.node_log(follower),
            cluster.node_log(leader)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.converged().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_follower_catches_up_through_records_and_pruning_without_crashing() {
    let _serial = serial();
    let mut cluster = Cluster::start_with(50, &["--retention-ms", "500"]);
    let leader = cluster.leader().await;
    let follower = (leader + 1) % 3;
    let client = cluster.client();
    let mut finished = 0;
    let started = Instant::now();
    let mut paused = false;
    let mut continued = false;
    while started.elapsed() < Duration::from_secs(7) {
        if !paused && started.elapsed() > Duration::from_secs(1) {
            cluster.signal(follower, "STOP");
            paused = true;
        }
        if paused && !continued && started.elapsed() > Duration::from_secs(4) {
            cluster.signal(follower, "CONT");
            continued = true;
        }
        let name = format!("p{finished}");
        let gens = owned_generations(&client, 1, &name).await;
        let (id, epoch) = gens[0];
        common::append_first(&client, &name, id, epoch, &[5, 6, 7]).await;
        let f = client
            .finish(pb::FinishRequest {
                generation_id: id,
                epoch,
                reason: pb::FinishReason::Stop as i32,
                detail: String::new(),
            })
            .await
            .unwrap();
        assert!(f.ok, "{f:?}");
        finished += 1;
    }
    assert!(continued && finished > 10, "finished {finished}");
    let heads = cluster.converged().await;
    for i in 0..3 {
        assert!(
            cluster.wait_exit(i, Duration::ZERO).is_none(),
            "node {} exited: {}",
            i + 1,
            cluster.node_log(i)
        );
    }
    // Every finished generation is pruned by now or soon; none is left half-pruned on any node.
    assert!(
        heads.len() <= finished,
        "{} heads for {finished} generations",
        heads.len()
    );
    let log = cluster.node_log(follower);
    assert!(!log.contains("panicked"), "{log}");
}

/// A Watch sent to a node that has not applied the generation yet is not told the generation
/// does not exist. The follower here is killed while the generation is created and written,
/// then restarted while the other two are stopped: it cannot catch up. It used to answer
/// NOT_FOUND at once ("generation N does not exist on this node"), and a gateway or a standby
/// took that for the generation's end. Now only the leader answers NOT_FOUND, after a read
/// index: the follower sends the call on, and once the others run again the Watch opens and
/// shows every committed record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_on_a_follower_behind_the_generation_reaches_it_instead_of_not_found() {
    use futures::StreamExt;
    let _serial = serial();
    let mut cluster = Cluster::start(1_000);
    let leader = cluster.leader().await;
    let behind = (leader + 1) % 3;
    let other = (leader + 2) % 3;
    // Killed, not stopped: a stopped node finds the leader's appends waiting in its socket
    // when it continues.
    cluster.kill9(behind);
    let client = cluster.client();
    let (id, epoch) = owned_generations(&client, 1, "w").await[0];
    common::append_first(&client, "w", id, epoch, &[5, 6, 7]).await;
    cluster.signal(leader, "STOP");
    cluster.signal(other, "STOP");
    cluster.start_node(behind);
    common::wait_for_port(&cluster.addrs[behind]);
    // A client that knows only the node behind: its first call lands there.
    let at_behind = LogClient::with_budget(vec![cluster.addrs[behind].clone()], Duration::from_secs(20)).unwrap();
    let watch = tokio::spawn(async move { at_behind.watch(id, 0).await });
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        !watch.is_finished(),
        "the node behind answered while it could not know: {:?}",
        watch.await.unwrap().map(|_| "a stream")
    );
    cluster.signal(leader, "CONT");
    cluster.signal(other, "CONT");
    let mut stream = watch.await.unwrap().expect("the watch opens once a leader answers");
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let ev = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("the committed records come")
            .expect("the stream runs")
            .unwrap();
        seen.extend(ev.records.iter().map(|r| r.token_id));
    }
    assert_eq!(seen, vec![5, 6, 7]);
}

/// A Watch on a node cut off from the cluster's quorum ends with UNAVAILABLE, and that node opens
/// no new one, so that its client resumes at another node: its state no longer advances while
/// the generation may go on elsewhere. Before, the stream stayed open and silent for as long as
/// the node was cut off (a gateway reading from it showed its client nothing). Both ways a node
/// is cut off: a follower whose leader and other follower are stopped (it knows no leader), and
/// a leader whose two followers are stopped (no quorum acknowledges it). Once the others run
/// again, the node serves Watches again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_on_a_node_cut_off_from_the_quorum_ends_and_the_client_is_sent_elsewhere() {
    use tokenlog_proto::raftlog::log_client::LogClient as PbClient;
    let _serial = serial();
    let cluster = Cluster::start(1_000);
    let client = cluster.client();
    let (id, epoch) = owned_generations(&client, 1, "w").await[0];
    common::append_first(&client, "w", id, epoch, &[5, 6, 7]).await;
    let watch_at = |i: usize| {
        let addr = format!("http://{}", cluster.addrs[i]);
        async move {
            let mut c = PbClient::connect(addr).await.unwrap();
            c.watch(pb::WatchRequest {
                generation_id: id,
                from_seq: 0,
            })
            .await
        }
    };
    for leads in [false, true] {
        let leader = cluster.leader().await;
        let cut = if leads { leader } else { (leader + 1) % 3 };
        let others: Vec<usize> = (0..3).filter(|&i| i != cut).collect();
        // Wait until the node has applied the records (a follower may lag a moment).
        let mut stream = watch_at(cut).await.expect("the watch opens").into_inner();
        let first = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("the committed records come")
            .unwrap()
            .unwrap();
        assert_eq!(
            first.records.iter().map(|r| r.token_id).collect::<Vec<_>>(),
            vec![5, 6, 7]
        );
        for &o in &others {
            cluster.signal(o, "STOP");
        }
        let cut_at = Instant::now();
        let ended = tokio::time::timeout(Duration::from_secs(15), stream.message()).await;
        let waited = cut_at.elapsed();
        let status = match ended {
            Ok(Err(s)) => s,
            other => {
                for &o in &others {
                    cluster.signal(o, "CONT");
                }
                panic!(
                    "the watch on node {} (leader: {leads}) did not end with a status after its quorum went: {other:?}",
                    cut + 1
                );
            }
        };
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(status.message().contains("cut off"), "{status:?}");
        assert!(waited < Duration::from_secs(8), "ended after {waited:?}");
        // A new watch there is refused at once, naming why.
        let refused = watch_at(cut).await.map(|_| "a stream");
        assert!(
            matches!(&refused, Err(s) if s.code() == tonic::Code::Unavailable && s.message().contains("cut off")),
            "{refused:?}"
        );
        for &o in &others {
            cluster.signal(o, "CONT");
        }
        // Back in the cluster, it serves again.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = watch_at(cut).await {
                let mut s = r.into_inner();
                if let Ok(Ok(Some(ev))) = tokio::time::timeout(Duration::from_secs(5), s.message()).await {
                    assert_eq!(ev.records.len(), 3);
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "node {} did not serve a watch again",
                cut + 1
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// `tokenlog members add` of a node that is not there (a wrong address, a node not started)
/// fails with what happened and the way out, after `--stall-secs` without progress, and
/// `members remove` takes the learner out; an id that is no member is refused. Before, the add
/// waited without a limit on the leader, the client gave up after its budget with "no node
/// answered" though the learner had been added, and `remove` (voters only) answered success
/// and left it in the membership, where a later add at the right address was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_that_never_catches_up_is_reported_and_can_be_removed() {
    let _serial = serial();
    let cluster = Cluster::start(1_000);
    cluster.leader().await;
    let members = |args: &[&str]| {
        let out = std::process::Command::new(common::bin())
            .args(["members", "--cluster", &cluster.addrs.join(","), "--stall-secs", "2"])
            .args(args)
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let t0 = Instant::now();
    let (code, err) = members(&["add", "9", "127.0.0.1:1"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("node 9 at 127.0.0.1:1 has not caught up") && err.contains("members remove 9"),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(12), "{:?}", t0.elapsed());
    let ids = |st: &pb::ClusterStatusResponse| st.members.iter().map(|m| m.node_id).collect::<Vec<_>>();
    let st = cluster.client().cluster_status(true).await.unwrap();
    assert_eq!(ids(&st), vec![1, 2, 3, 9], "the learner is there until removed");
    let (code, err) = members(&["remove", "9"]);
    assert_eq!(code, Some(0), "{err}");
    let st = cluster.client().cluster_status(true).await.unwrap();
    assert_eq!(ids(&st), vec![1, 2, 3], "{st:?}");
    assert!(st.members.iter().all(|m| m.voter));
    let (code, err) = members(&["remove", "77"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not members"), "{err}");
}

/// Issue 12 item 4: a panic in any task ends the process (SIGABRT, with the panic and why it
/// aborts printed) instead of leaving a live process with a dead task behind it. The planted
/// `TOKENLOG_PLANT_TASK_PANIC` panics a background task of a running node 300 ms after start;
/// without the binary's abort-on-panic hook the node kept serving.
#[cfg(feature = "faults")]
#[test]
fn a_panicked_task_ends_its_process() {
    use std::os::unix::process::ExitStatusExt;
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", common::free_port());
    let mut node = std::process::Command::new(common::bin())
        .args([
            "node",
            "--id",
            "1",
            "--listen",
            &addr,
            "--peers",
            &format!("1={addr}"),
            "--data-dir",
        ])
        .arg(dir.path().join("data"))
        .env("TOKENLOG_PLANT_TASK_PANIC", "1")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = node.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = node.kill();
            panic!("the node kept running after one of its tasks panicked");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut node.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.signal(), Some(6), "SIGABRT: {status:?}\n{err}");
    assert!(
        err.contains("planted: a background task panicked") && err.contains("aborting on the panic above"),
        "{err}"
    );
}

/// `SNAPSHOT_AFTER_TOKENS`: a node snapshots once 2^20 tokens were appended since its last
/// snapshot, whatever its `--snapshot-every` (here a million entries, never reached: 1.1M
/// tokens take ~1,000 entries), so sealed records leave memory at a bounded token count. Run
/// through `tokenlog bench restart`, which prints the snapshot index it finds.
#[test]
fn a_node_snapshots_after_enough_tokens_whatever_its_entry_count() {
    let _one = serial();
    let out = std::process::Command::new(common::bin())
        .args(["bench", "restart", "--records", "1100000", "--generations", "1000"])
        .args([
            "--snapshot-every",
            "1000000",
            "--port",
            &common::free_port().to_string(),
        ])
        .output()
        .expect("run tokenlog bench restart");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
    let index: u64 = text
        .split("(snapshot at entry ")
        .nth(1)
        .and_then(|t| t.split(',').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no snapshot index in: {text}"));
    assert!(index > 0, "no snapshot after 1.1M tokens: {text}");
}

/// A bench whose output is closed (piped into `head`) stops, and the processes it started go
/// with it. Before, the failed write panicked, the panic aborted the process, and its log
/// nodes and decoder kept running (the next bench found their ports taken).
#[test]
fn a_bench_whose_output_is_closed_stops_the_processes_it_started() {
    use std::io::BufRead;
    let _one = serial();
    let base = common::free_ports(16);
    let mut child = std::process::Command::new(common::bin())
        .args(["bench", "leader-kill", "--kills", "2", "--every-s", "2"])
        .args(["--base-port", &base.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run tokenlog bench leader-kill");
    // Its first line comes once its nodes and decoder run; then its reader goes away, before
    // the line of its first kill.
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    assert!(first.starts_with("bench leader-kill:"), "{first}");
    drop(out);
    let ended = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            ended.elapsed() < Duration::from_secs(60),
            "the bench runs on with its output closed"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // Its nodes are gone (a second to let the killed ones close their sockets). Its stderr is
    // not read before: the processes it started hold it open while they run.
    std::thread::sleep(Duration::from_secs(1));
    let listening: Vec<u16> = (base..base + 3)
        .filter(|&p| std::net::TcpListener::bind(("127.0.0.1", p)).is_err())
        .collect();
    if !listening.is_empty() {
        // What the old code left: its nodes (their --peers) and its decoder (its --cluster).
        let _ = std::process::Command::new("pkill")
            .args(["-9", "-f", &format!("127.0.0.1:{base}")])
            .status();
    }
    assert!(
        listening.is_empty(),
        "nodes of the bench still listen on {listening:?} after it ended ({status:?})"
    );
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(
        !status.success() && err.contains("its output was closed"),
        "{status:?}: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// `tokenlog bench log` drives a 3-node cluster through unary `Append` calls, and with
/// `--stream` through one `AppendStream` per writer (the decoders' path). The bench fails on
/// any refused item, so a row with writes measured means every write was accepted.
#[test]
fn the_log_bench_writes_through_unary_calls_and_append_streams() {
    let _one = serial();
    let flags: [(&[&str], &str); 3] = [
        (&[], "tokenlog "),
        (&["--stream"], "tokenlog/stream "),
        // Pipelined: 4 writes in flight per writer, answered in order (a refused one fails the run).
        (&["--stream", "--depth", "4"], "tokenlog/stream/d4 "),
    ];
    for (flags, label) in flags {
        let mut cmd = std::process::Command::new(common::bin());
        cmd.args(["bench", "log", "--writers", "2", "--generations", "4", "--seconds", "1"])
            .args(["--no-etcd", "--base-port", &common::free_ports(16).to_string()])
            .args(flags);
        let out = cmd.output().expect("run tokenlog bench log");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
        let writes: f64 = text
            .lines()
            .filter_map(|l| l.strip_prefix(label))
            .find_map(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {label:?} row in: {text}"));
        assert!(writes > 0.0, "{text}");
        // The row below it: the Raft entries the leader committed meanwhile, and how many
        // writes each carried.
        let entries: Vec<f64> = text
            .lines()
            .skip_while(|l| !l.starts_with(label))
            .nth(1)
            .filter(|l| l.contains("entries/s") && l.contains("writes per entry"))
            .map(|l| l.split_whitespace().filter_map(|w| w.parse().ok()).collect())
            .unwrap_or_else(|| panic!("no entries row under {label:?} in: {text}"));
        assert!(entries.len() >= 2 && entries[0] > 0.0 && entries[1] > 0.0, "{text}");
    }
    // Unary appends sent at once could arrive out of order: refused before any cluster starts.
    let out = std::process::Command::new(common::bin())
        .args(["bench", "log", "--depth", "4", "--no-etcd"])
        .output()
        .expect("run tokenlog bench log");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--depth 4 needs --stream"),
        "{err}"
    );
}

/// Both followers die and come back 3 s later, and the leader stays leader (no election): its
/// entries could not commit meanwhile, and that time is credited to the live leases as an
/// election's is (a `NewLeader` ahead of the first entries stamped while a proposal waited).
/// Before, the first entry stamped after the outage (a renewal, or the Tick that the stamp made
/// due) found an 800 ms lease expired: every decoder lost every generation, though no renewal
/// could have been committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_outlives_a_commit_stall_without_an_election() {
    let _serial = serial();
    let mut cluster = Cluster::start(0);
    let leader = cluster.leader().await;
    let client = cluster.client();
    let id = common::submit(&client, "stall").await;
    let acquired = client
        .acquire(pb::AcquireRequest {
            generation_id: id,
            decoder_id: "dec".into(),
            lease_ms: tokenlog_raftlog::limits::LEASE_MS_DEFAULT,
            model: Some(common::model()),
            rng_version: 0,
        })
        .await
        .unwrap();
    let epoch = acquired.generation.unwrap().lease.unwrap().epoch;
    let renew = move || pb::RenewRequest {
        generation_id: id,
        epoch,
        decoder_id: "dec".into(),
        lease_ms: tokenlog_raftlog::limits::LEASE_MS_DEFAULT,
    };
    assert!(client.renew(renew()).await.unwrap().ok);
    let term = client.cluster_status(true).await.unwrap().term;
    let followers: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    for &i in &followers {
        cluster.kill9(i);
    }
    // A renewal proposed now waits for the followers, as a decoder's would.
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move { client.renew(renew()).await })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    for &i in &followers {
        cluster.start_node(i);
    }
    let first = waiting.await.unwrap().unwrap();
    let second = client.renew(renew()).await.unwrap();
    let after = client.cluster_status(true).await.unwrap().term;
    assert!(
        first.ok && second.ok,
        "the lease expired across the stall (term {term} -> {after}): {first:?} {second:?}"
    );
    let g = client.generation(id).await.unwrap();
    assert_eq!(g.lease.unwrap().epoch, epoch, "still the same owner's lease");
}
