//! Decoders over a real 3-node log (fake model, real processes): takeover after a pause past the
//! lease (failure point 9) and after a kill between sampling and commit (failure point 7). The
//! client's view must be continuous and equal to an uninterrupted run.

// The tests hold `common::serial()` (a std mutex) across awaits on purpose: each test runs its
// own runtime on its own thread, and the guard only keeps two multi-process tests from running
// at once on a 2-core machine.
#![allow(clippy::await_holding_lock)]

mod common;

use std::time::{Duration, Instant};

use common::{serial, Cluster};
use futures::StreamExt;
use tokenlog_decoder::worker::identity_to_pb;
use tokenlog_decoder::{generate, FakeConfig, FakeModel, Model, SamplingConfig, StopConfig};
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

const MAX_TOKENS: u32 = 120;

fn fake() -> FakeModel {
    // Must match what `tokenlog decoder --fake` loads (identity is compared by the log).
    FakeModel::new(FakeConfig {
        eos_one_in: 64,
        ..Default::default()
    })
    .unwrap()
}

fn sampling() -> SamplingConfig {
    SamplingConfig {
        temperature: 0.8,
        top_p: 0.95,
        seed: 42,
        ..Default::default()
    }
}

/// What an uninterrupted run produces.
fn expected(prompt: &[u32]) -> Vec<u32> {
    let m = fake();
    let stop = StopConfig {
        max_tokens: MAX_TOKENS,
        stop_strings: vec![],
        eos_token_ids: vec![],
    };
    generate(&m, prompt, &sampling(), &stop).unwrap().tokens
}

async fn submit(client: &LogClient, rid: &str, prompt: &[u32]) -> u64 {
    let m = fake();
    let s = sampling();
    let binding = pb::Binding {
        model: Some(identity_to_pb(m.identity())),
        prompt_token_ids: prompt.to_vec(),
        sampling: Some(pb::SamplingConfig {
            temperature: s.temperature,
            top_p: s.top_p,
            seed: s.seed,
            rng_version: tokenlog_decoder::RNG_VERSION,
            ..Default::default()
        }),
        stop: Some(pb::StopConfig {
            max_tokens: MAX_TOKENS,
            ..Default::default()
        }),
        mode: pb::ResumeMode::Exact as i32,
        ..Default::default()
    };
    let r = client
        .submit(pb::SubmitRequest {
            tenant: "t".into(),
            request_id: rid.into(),
            binding: Some(binding),
        })
        .await
        .unwrap();
    r.generation.unwrap().generation_id
}

/// Follows the generation like a client would, from seq 0, until it is terminal; checks every
/// record arrives once and in order. Returns tokens, epochs and the terminal info.
async fn follow(client: &LogClient, id: u64) -> (Vec<u32>, Vec<u64>, pb::GenerationInfo) {
    let (mut toks, mut epochs) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let mut stream = client.watch(id, toks.len() as u32).await.unwrap();
        while let Ok(Some(item)) = tokio::time::timeout(Duration::from_secs(30), stream.next()).await {
            let ev = item.unwrap();
            for r in ev.records {
                assert_eq!(r.seq as usize, toks.len(), "gap or duplicate in the committed stream");
                toks.push(r.token_id);
                epochs.push(r.epoch);
            }
            if let Some(t) = ev.terminal {
                return (toks, epochs, t);
            }
        }
        assert!(Instant::now() < deadline, "generation {id} did not finish");
    }
}

/// A linearizable read of generation `id`.
async fn get(client: &LogClient, id: u64) -> pb::GetResponse {
    client
        .get(pb::GetRequest {
            generation_id: id,
            linearizable: true,
            ..Default::default()
        })
        .await
        .unwrap()
}

async fn owner(client: &LogClient, id: u64) -> (String, u64, u32) {
    let g = get(client, id).await.generation.unwrap();
    let l = g.lease.unwrap_or_default();
    (l.owner, l.epoch, g.frontier)
}

async fn wait_for(
    client: &LogClient,
    id: u64,
    what: &str,
    f: impl Fn(&(String, u64, u32)) -> bool,
) -> (String, u64, u32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let o = owner(client, id).await;
        if f(&o) {
            return o;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {o:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_owner_is_fenced_after_takeover_and_output_stays_continuous() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    cluster.leader().await;
    let client = cluster.client();
    // Slow steps so the pause lands mid-stream.
    let slow = ["--fake-step-ms", "40", "--lease-ms", "800", "--capacity", "1"];
    let d1 = cluster.start_decoder("dec-a", &slow);
    let prompt = [10, 20, 30, 40];
    let id = submit(&client, "pause", &prompt).await;
    let (first, _, _) = wait_for(&client, id, "a first owner with records", |o| {
        !o.0.is_empty() && o.2 >= 5
    })
    .await;
    assert_eq!(first, "dec-a");
    // A standby decoder; it cannot take the generation while dec-a renews.
    let d2 = cluster.start_decoder("dec-b", &slow);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        owner(&client, id).await.0,
        "dec-a",
        "a live, renewing owner keeps its lease"
    );

    d1.signal("-STOP");
    let (second, epoch, at) = wait_for(&client, id, "takeover", |o| o.0 == "dec-b").await;
    assert_eq!(epoch, 2);
    eprintln!("dec-b took over at frontier {at}");
    d1.signal("-CONT");
    let (toks, epochs, terminal) = follow(&client, id).await;
    assert_eq!(second, "dec-b");
    assert_eq!(
        toks,
        expected(&prompt),
        "the resumed output equals an uninterrupted run"
    );
    assert!(
        epochs.windows(2).all(|w| w[0] <= w[1]),
        "no record from a stale epoch after a newer one"
    );
    assert!(epochs.iter().all(|&e| e == 1 || e == 2));
    assert_eq!(terminal.state, pb::GenerationState::Finished as i32);
    // The paused decoder woke up, tried to write at epoch 1, was rejected, and stopped.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !d1.log_text().contains("dropping the generation") && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        d1.log_text().contains("dropping the generation"),
        "dec-a log:\n{}",
        d1.log_text()
    );
    drop(d2);
}

/// A model step longer than the decoder's registration lives (5 s here) does not unregister
/// the decoder: its registration is kept fresh while the step runs, as its leases are. (A
/// registration that lapsed took the decoder's session with it, and for a pipeline head its
/// composition in the log: every stage then refused the head, and its next splice failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_longer_than_the_registration_keeps_the_decoder_registered() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    cluster.leader().await;
    let client = cluster.client();
    let slow = ["--fake-step-ms", "7000", "--lease-ms", "800", "--capacity", "1"];
    let _d = cluster.start_decoder("dec-slow", &slow);
    let id = submit(&client, "slow-step", &[10, 20, 30]).await;
    wait_for(&client, id, "dec-slow owning the generation", |o| o.0 == "dec-slow").await;
    // A 7 s step begins with its first decoded token; watch through one whole step and more.
    let until = Instant::now() + Duration::from_secs(9);
    while Instant::now() < until {
        let models = client.list_models().await.unwrap().models;
        assert!(
            models.iter().any(|m| m.decoders.iter().any(|d| d == "dec-slow")),
            "dec-slow's registration lapsed during its step: {models:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(owner(&client, id).await.0, "dec-slow", "it still owns the generation");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_owner_is_replaced_and_uncommitted_tokens_are_resampled() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    cluster.leader().await;
    let client = cluster.client();
    let args = ["--fake-step-ms", "20", "--lease-ms", "600", "--capacity", "2"];
    let mut d1 = cluster.start_decoder("dec-a", &args);
    let prompts: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![7, 7, 7, 7]];
    let mut ids = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        ids.push(submit(&client, &format!("kill-{i}"), p).await);
    }
    wait_for(&client, ids[0], "progress", |o| o.2 >= 10).await;
    let d2 = cluster.start_decoder("dec-b", &args);
    // SIGKILL: whatever dec-a sampled but had not committed dies with it.
    d1.kill9();
    for (id, p) in ids.iter().zip(&prompts) {
        let (toks, _, terminal) = follow(&client, *id).await;
        assert_eq!(toks, expected(p), "generation {id} equals an uninterrupted run");
        assert_eq!(terminal.takeovers, 1, "{terminal:?}");
        assert_eq!(terminal.lease.unwrap().owner, "dec-b");
    }
    drop(d2);
}

/// Instant crash detection (issue 15, item 4): a decoder holds a session with the leader, and when
/// its process dies the leader ends its leases at once. With a 20 s lease, a killed owner's
/// generation is taken over in a fraction of the lease (before sessions it waited the whole
/// lease), and the output still equals an uninterrupted run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owner_is_replaced_without_waiting_for_its_lease() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    cluster.leader().await;
    let client = cluster.client();
    let args = ["--fake-step-ms", "20", "--lease-ms", "20000", "--capacity", "2"];
    let mut d1 = cluster.start_decoder("dec-a", &args);
    let prompt = vec![9, 8, 7];
    let id = submit(&client, "instant", &prompt).await;
    wait_for(&client, id, "progress", |o| o.2 >= 10).await;
    let d2 = cluster.start_decoder("dec-b", &args);
    // dec-b is up (registered) before the kill: what is measured is detection, not its start.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !client
        .list_models()
        .await
        .unwrap()
        .models
        .iter()
        .any(|m| m.decoders.iter().any(|d| d == "dec-b"))
    {
        assert!(Instant::now() < deadline, "dec-b did not register");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let killed = Instant::now();
    d1.kill9();
    wait_for(&client, id, "dec-b to own it", |o| o.0 == "dec-b").await;
    let taken_after = killed.elapsed();
    eprintln!("kill -9 -> taken over after {taken_after:?} (lease 20 s)");
    assert!(
        taken_after < Duration::from_secs(5),
        "taken over {taken_after:?} after the kill: the lease (20 s) was waited for"
    );
    let (toks, _, terminal) = follow(&client, id).await;
    assert_eq!(toks, expected(&prompt), "equals an uninterrupted run");
    assert_eq!(terminal.takeovers, 1, "{terminal:?}");
    drop(d2);
}

/// Hot standby (issue 15 item 3): a decoder with `--standby 1` is assigned a running generation
/// by the log and follows its records; when the owner is kill -9'd the standby takes it over
/// from its followed state (no re-prefill), ahead of a third, idle decoder (the log's priority
/// window), and the output equals an uninterrupted run. Its history shows no write without a
/// grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_standby_takes_over_a_killed_owner_from_its_followed_state() {
    let _serial = serial();
    standby_takeover(false).await;
}

/// Planted bug `standby-early-write`: a standby that appends at the dead owner's epoch instead
/// of acquiring one is refused by the log's fence, and its own history shows the write without
/// a grant; the generation still continues exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_appending_without_an_epoch_is_caught() {
    let _serial = serial();
    standby_takeover(true).await;
}

async fn standby_takeover(plant: bool) {
    let cluster = Cluster::start(20_000);
    cluster.leader().await;
    let client = cluster.client();
    // 50 ms steps: 120 tokens last 6 s, time enough for the standby to claim and follow.
    let args = ["--fake-step-ms", "50", "--lease-ms", "20000", "--capacity", "1"];
    let mut d1 = cluster.start_decoder("dec-a", &args);
    let prompt = vec![3, 1, 4, 1, 5];
    let id = submit(&client, "standby", &prompt).await;
    wait_for(&client, id, "progress", |o| o.2 >= 5).await;
    let history = cluster.dir.path().join("dec-b.jsonl");
    let history_arg = history.display().to_string();
    let standby_args = [&args[..], &["--standby", "1", "--history", &history_arg]].concat();
    let env: Vec<(&str, &str)> = if plant {
        vec![("TOKENLOG_PLANT_STANDBY_EARLY_WRITE", "1")]
    } else {
        vec![]
    };
    let d2 = cluster.start_decoder_env("dec-b", &standby_args, &env);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let g = get(&client, id).await;
        if g.standby == "dec-b" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "dec-b never stood by: {g:?}\n{}",
            d2.log_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // An idle decoder that would re-prefill, polling for work as often as the standby.
    let d3 = cluster.start_decoder("dec-c", &args);
    common::wait_for_model(&client).await;
    let (_, _, at) = owner(&client, id).await;
    wait_for(&client, id, "records the standby follows", |o| o.2 >= at + 5).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    d1.kill9();
    let (who, epoch, _) = wait_for(&client, id, "a new owner", |o| o.1 >= 2).await;
    assert_eq!(
        (who.as_str(), epoch),
        ("dec-b", 2),
        "the standby takes it, once\n{}",
        d2.log_text()
    );
    let (toks, _, terminal) = follow(&client, id).await;
    assert_eq!(toks, expected(&prompt), "equals an uninterrupted run");
    assert_eq!(terminal.takeovers, 1, "{terminal:?}");
    let log = d2.log_text();
    assert!(
        log.contains("taken over from the hot standby's state"),
        "the standby re-prefilled instead of continuing its followed state:\n{log}"
    );
    let bad = common::writes_without_a_grant(&history);
    if plant {
        assert!(
            bad.iter().any(|&(g, e, _)| g == id && e == 1),
            "the planted write at the dead owner's epoch went unnoticed: {bad:?}\n{log}"
        );
    } else {
        assert!(bad.is_empty(), "a standby wrote without a grant: {bad:?}");
    }
    drop((d2, d3));
}

/// Seed 004's reload loop (issue 15 item 6): a prefix cache entry whose restore kills the
/// decoder (failpoint `prefix-restore-exit`, every incarnation) is restored once for the
/// generation at its frontier; the next incarnation's restore of the same entry at the same
/// frontier is refused, the entry discarded (unlinked), and the generation prefilled cold
/// continues exactly, instead of a crash loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_prefix_cache_entry_is_discarded_and_the_generation_continues_exactly() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    cluster.leader().await;
    let client = cluster.client();
    let dir = tempfile::tempdir().unwrap();
    let entries = || {
        std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "tlpc"))
            .count()
    };
    let args = [
        "--fake-step-ms",
        "20",
        "--lease-ms",
        "20000",
        "--capacity",
        "1",
        "--prefix-cache-dir",
        dir.path().to_str().unwrap(),
    ];
    // Incarnation 1 prefills the prompt (and stores it), then dies after sampling seq 10.
    let mut d1 = cluster.start_decoder_env("pc-1", &args, &[("TOKENLOG_FAILPOINTS", "exit-after-sample=10")]);
    let prompt = vec![2, 7, 1, 8, 2, 8];
    let id = submit(&client, "poisoned", &prompt).await;
    let st = d1.wait_exit(Duration::from_secs(30));
    assert!(st.is_some(), "incarnation 1 did not stop:\n{}", d1.log_text());
    assert_eq!(entries(), 1, "the prompt was stored:\n{}", d1.log_text());
    let (_, _, frontier) = owner(&client, id).await;
    // Every later incarnation dies inside any restore.
    let poison = [("TOKENLOG_FAILPOINTS", "prefix-restore-exit=1")];
    let mut d2 = cluster.start_decoder_env("pc-2", &args, &poison);
    let st = d2.wait_exit(Duration::from_secs(30));
    assert!(
        st.is_some(),
        "incarnation 2 did not die in the restore:\n{}",
        d2.log_text()
    );
    assert!(
        d2.log_text().contains("exiting during a prefix cache restore"),
        "{}",
        d2.log_text()
    );
    assert_eq!(owner(&client, id).await.2, frontier, "nothing committed since");
    // Incarnation 3: the same entry, the same generation, the same frontier: discarded.
    let d3 = cluster.start_decoder_env("pc-3", &args, &poison);
    let (toks, _, terminal) = follow(&client, id).await;
    assert_eq!(toks, expected(&prompt), "equals an uninterrupted run");
    assert_eq!(terminal.lease.unwrap().owner, "pc-3");
    let log = d3.log_text();
    assert!(log.contains("prefix cache entry discarded"), "{log}");
    assert!(!log.contains("exiting during a prefix cache restore"), "{log}");
    // Its own cold prefill (prompt and committed records) is the one entry left.
    assert_eq!(entries(), 1, "{log}");
    drop(d3);
}

/// A leader election must not expire the leases of running generations (issue 11, bug 9): the
/// owner keeps its generation through a leader kill -9, with no takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_kill_takes_no_running_generation_from_its_owner() {
    let _serial = serial();
    let mut cluster = Cluster::start(20_000);
    cluster.leader().await;
    let client = cluster.client();
    let args = ["--fake-step-ms", "20", "--lease-ms", "600", "--capacity", "2"];
    let d = cluster.start_decoder("dec-a", &args);
    let prompt = vec![4, 5, 6];
    let id = submit(&client, "election", &prompt).await;
    wait_for(&client, id, "progress", |o| o.2 >= 10).await;
    let leader = cluster.leader().await;
    let started = Instant::now();
    cluster.kill9(leader);
    let (toks, epochs, terminal) = follow(&client, id).await;
    assert_eq!(toks, expected(&prompt), "equals an uninterrupted run");
    assert_eq!(
        terminal.takeovers,
        0,
        "the election took the generation from its live owner ({:?} after the kill): {terminal:?}",
        started.elapsed()
    );
    assert!(epochs.iter().all(|&e| e == 1), "records at a later epoch: {epochs:?}");
    drop(d);
}

/// CONTRACT §2: a rejected renewal stops the generation at once (issue 11, bug 7). The owner is
/// paused in the middle of a long step, another decoder takes over, and the owner continues: its
/// renewer is rejected, and it must send nothing more for the generation, not even one append
/// that the log then rejects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_renewal_drops_the_generation_before_anything_more_is_sent() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    cluster.leader().await;
    let client = cluster.client();
    let history = cluster.dir.path().join("dec-a.jsonl");
    let appends = || {
        std::fs::read_to_string(&history)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"phase\":\"invoke\"") && l.contains("\"op\":\"append\""))
            .count()
    };
    let slow = [
        "--fake-step-ms",
        "6000",
        "--lease-ms",
        "600",
        "--capacity",
        "1",
        "--history",
        history.to_str().unwrap(),
    ];
    let d1 = cluster.start_decoder("dec-a", &slow);
    let prompt = [3, 1, 4];
    let id = submit(&client, "renew-rejected", &prompt).await;
    wait_for(&client, id, "dec-a owns it", |o| o.0 == "dec-a").await;
    // dec-a is in a 6 s step (its first token may have gone out before it); the renewer keeps
    // its lease meanwhile.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(owner(&client, id).await.0, "dec-a", "a renewing owner keeps its lease");
    let before = appends();
    d1.signal("-STOP");
    let fast = ["--fake-step-ms", "5", "--lease-ms", "600", "--capacity", "1"];
    let d2 = cluster.start_decoder("dec-b", &fast);
    wait_for(&client, id, "takeover", |o| o.0 == "dec-b").await;
    d1.signal("-CONT");
    let (toks, _, _) = follow(&client, id).await;
    assert_eq!(toks, expected(&prompt));
    // Wait until dec-a's long step is over and it has acted on the rejection.
    let deadline = Instant::now() + Duration::from_secs(15);
    while !d1.log_text().contains("dropping the generation") && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        d1.log_text().contains("renew rejected: dropping the generation"),
        "dec-a did not drop the generation on the rejected renewal; its log:\n{}",
        d1.log_text()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        appends(),
        before,
        "dec-a sent appends for a generation whose renewal was rejected"
    );
    drop(d2);
}

/// CONTRACT §5: a generation bound to a model no decoder serves is refused by every decoder
/// (model mismatch, with the reason) and fails explicitly at its deadline instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generation_for_a_model_nobody_serves_is_refused_and_fails_at_its_deadline() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let _d = cluster.start_decoder("d1", &[]);
    let client = cluster.client();
    let other = FakeModel::new(FakeConfig {
        variant: 7,
        eos_one_in: 64,
        ..Default::default()
    })
    .unwrap();
    let binding = pb::Binding {
        model: Some(identity_to_pb(other.identity())),
        prompt_token_ids: vec![10, 11, 12],
        sampling: Some(pb::SamplingConfig {
            rng_version: tokenlog_decoder::RNG_VERSION,
            ..Default::default()
        }),
        stop: Some(pb::StopConfig {
            max_tokens: 10,
            ..Default::default()
        }),
        deadline_ms: 1_500,
        ..Default::default()
    };
    let id = client
        .submit(pb::SubmitRequest {
            tenant: "t".into(),
            request_id: "orphan".into(),
            binding: Some(binding),
        })
        .await
        .unwrap()
        .generation
        .unwrap()
        .generation_id;
    // A decoder of another model asking for it is refused, with the reason.
    let refused = client
        .acquire(pb::AcquireRequest {
            generation_id: id,
            decoder_id: "wrong-model".into(),
            lease_ms: 1_000,
            model: Some(identity_to_pb(fake().identity())),
            rng_version: tokenlog_decoder::RNG_VERSION,
        })
        .await
        .unwrap();
    assert!(!refused.ok);
    let rej = refused.rejection.unwrap();
    assert_eq!(rej.reason, pb::RejectReason::ModelMismatch as i32, "{rej:?}");
    assert!(!rej.message.is_empty());
    let started = Instant::now();
    let (toks, _, info) = follow(&client, id).await;
    assert!(toks.is_empty());
    assert_eq!(info.state, pb::GenerationState::Failed as i32);
    assert_eq!(info.finish_reason, pb::FinishReason::Error as i32);
    assert!(info.finish_detail.contains("deadline"), "{}", info.finish_detail);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "failed in {:?}",
        started.elapsed()
    );
    assert_eq!(info.lease.unwrap_or_default().epoch, 0, "no decoder ever owned it");
}

/// Failure point 10: a delayed append from a previous owner incarnation arrives after the
/// takeover. It must not change anything: the old epoch is refused, whether the message would
/// extend the prefix or only repeat committed records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_append_from_a_previous_owner_incarnation_changes_nothing() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    // No decoder runs: the test plays both owners.
    let id = submit(&client, "delayed", &[5, 6, 7]).await;
    let m = identity_to_pb(fake().identity());
    let acquire = |who: &'static str| {
        let (client, m) = (client.clone(), m.clone());
        async move {
            client
                .acquire(pb::AcquireRequest {
                    generation_id: id,
                    decoder_id: who.into(),
                    lease_ms: 200,
                    model: Some(m),
                    rng_version: tokenlog_decoder::RNG_VERSION,
                })
                .await
                .unwrap()
        }
    };
    let append = |who: &'static str, epoch: u64, start_seq: u32, tokens: Vec<u32>| {
        let client = client.clone();
        async move {
            let r = client
                .append(pb::AppendRequest {
                    decoder_id: who.into(),
                    lease_ms: 200,
                    items: vec![pb::AppendItem {
                        generation_id: id,
                        epoch,
                        start_seq,
                        token_ids: tokens,
                        ..Default::default()
                    }],
                })
                .await
                .unwrap();
            r.results.into_iter().next().unwrap()
        }
    };
    assert!(acquire("old").await.ok);
    assert!(append("old", 1, 0, vec![40, 41]).await.accepted);
    // The old incarnation goes silent; its lease runs out; a new owner takes over.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let new = acquire("new").await;
    assert!(new.ok, "{:?}", new.rejection);
    assert_eq!(new.generation.unwrap().lease.unwrap().epoch, 2);
    assert!(append("new", 2, 2, vec![42]).await.accepted);
    // The old incarnation's delayed messages arrive now.
    let late = append("old", 1, 2, vec![99]).await;
    assert!(!late.accepted);
    assert_eq!(late.rejection.unwrap().reason, pb::RejectReason::StaleEpoch as i32);
    let repeat = append("old", 1, 0, vec![40, 41]).await;
    assert!(!repeat.accepted);
    let rej = repeat.rejection.unwrap();
    assert_eq!(rej.reason, pb::RejectReason::StaleEpoch as i32);
    assert_eq!((rej.current_epoch, rej.frontier), (2, 3));
    let (_, epoch, frontier) = owner(&client, id).await;
    assert_eq!((epoch, frontier), (2, 3), "nothing changed");
    let mut s = client.watch(id, 0).await.unwrap();
    let ev = s.next().await.unwrap().unwrap();
    let got: Vec<(u32, u64)> = ev.records.iter().map(|r| (r.token_id, r.epoch)).collect();
    assert_eq!(got, vec![(40, 1), (41, 1), (42, 2)]);
}

/// The real SmolLM2 model across processes: three generations (sampled, exact mode) decoded
/// together in one batch by a decoder that is killed with SIGKILL after 10 records of each; a
/// second decoder process re-prefills each from its committed prefix and, batching them too,
/// continues each one bit for bit as its uninterrupted run alone in this process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_takeover_after_kill_continues_the_uninterrupted_sequence() {
    let _serial = serial();
    let path = tokenlog_decoder::fetch::ensure_default_model(&tokenlog_decoder::fetch::repo_models_dir()).unwrap();
    real_takeover(&path, "real", 3).await;
}

/// The same with the model as a Hugging Face folder (safetensors + tokenizer.json, exported from
/// the GGUF file): the decoder processes run it through the safetensors path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn safetensors_model_takeover_after_kill_continues_the_uninterrupted_sequence() {
    let _serial = serial();
    let models = tokenlog_decoder::fetch::repo_models_dir();
    let gguf = tokenlog_decoder::fetch::ensure_default_model(&models).unwrap();
    let dir = tokenlog_decoder::export::ensure_exported(&gguf, &models).unwrap();
    real_takeover(&dir, "folder", 1).await;
}

async fn real_takeover(path: &std::path::Path, rid: &str, gens: usize) {
    tokenlog_decoder::threads::init_cpu_threads(1);
    let model = tokenlog_decoder::load_model(path, tokenlog_decoder::DeviceSpec::Cpu).unwrap();
    let model = model.as_ref();
    let questions = [
        "Tell me about lighthouses.",
        "Write a short story about a fox.",
        "Explain how bread is made.",
    ];
    const N: u32 = 40;
    let stop = StopConfig {
        max_tokens: N,
        stop_strings: vec![],
        eos_token_ids: vec![],
    };
    // Generation i: its own prompt and seed, and its uninterrupted run alone.
    let runs: Vec<(Vec<u32>, SamplingConfig, Vec<u32>)> = (0..gens)
        .map(|i| {
            let prompt = model
                .tokenizer()
                .encode_chat(&[tokenlog_decoder::ChatMessage::user(questions[i % questions.len()])])
                .unwrap();
            let params = SamplingConfig {
                seed: sampling().seed + i as u64,
                ..sampling()
            };
            let expected = generate(model, &prompt, &params, &stop).unwrap().tokens;
            (prompt, params, expected)
        })
        .collect();

    let capacity = gens.to_string();
    let cluster = Cluster::start(20_000);
    let mut a = cluster.start_real_decoder("real-a", path, &["--capacity", &capacity]);
    let client = cluster.client();
    // Only a is up: it takes every generation (and decodes them in one batch).
    let mut ids = Vec::new();
    for (i, (prompt, params, _)) in runs.iter().enumerate() {
        let binding = common::sampled_binding(model, prompt, params, N);
        let id = common::submit_binding(&client, &format!("{rid}-{i}"), binding).await;
        ids.push(id);
    }
    for &id in &ids {
        let (owner_a, _, _) = wait_for(&client, id, "a to commit 10 records", |(o, _, f)| {
            o == "real-a" && *f >= 10
        })
        .await;
        assert_eq!(owner_a, "real-a");
    }
    let _b = cluster.start_real_decoder("real-b", path, &["--capacity", &capacity]);
    a.kill9();
    for (&id, (_, _, expected)) in ids.iter().zip(&runs) {
        let (toks, epochs, info) = follow(&client, id).await;
        assert_eq!(info.finish_reason, pb::FinishReason::Length as i32);
        assert!(epochs.iter().any(|&e| e > 1), "real-b took over: {epochs:?}");
        assert_eq!(
            &toks, expected,
            "generation {id}: the committed sequence equals its uninterrupted run alone"
        );
    }
}

/// Issue 11 bug 1: a decoder whose model step fails (an error, or a panic on the blocking
/// thread) exits non-zero at once and stops renewing: its lease lapses and a standby decoder
/// continues the same generation. Under the planted bug `zombie` (the old behaviour: the
/// renewer outlives the worker and the process keeps waiting) the generation never continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_model_step_ends_the_process_and_another_decoder_continues() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    cluster.leader().await;
    let client = cluster.client();
    let args = ["--fake-step-ms", "20", "--lease-ms", "600", "--capacity", "1"];
    for (i, failpoint) in ["model-error=10", "model-panic=10"].into_iter().enumerate() {
        let mut d1 = cluster.start_decoder_env(&format!("dec-a{i}"), &args, &[("TOKENLOG_FAILPOINTS", failpoint)]);
        let prompt = [9, 8, 7, i as u32];
        let id = submit(&client, &format!("model-fails-{i}"), &prompt).await;
        let status = d1.wait_exit(Duration::from_secs(20));
        let status =
            status.unwrap_or_else(|| panic!("{failpoint}: the decoder still runs; its log:\n{}", d1.log_text()));
        assert!(!status.success(), "{failpoint}: exit status {status:?}");
        assert_eq!(status.code(), Some(1), "{failpoint}: an error, not a kill: {status:?}");
        let d2 = cluster.start_decoder(&format!("dec-b{i}"), &args);
        let (toks, _, terminal) = follow(&client, id).await;
        assert_eq!(toks, expected(&prompt), "{failpoint}: equals an uninterrupted run");
        assert_eq!(terminal.lease.unwrap().owner, format!("dec-b{i}"));
        drop(d2);
    }

    // The plant: the failed decoder lingers and its renewer keeps the lease; nobody continues.
    // A longer lease here: the plant is seen when the renewer keeps the lease for 3 s, and a
    // 600 ms lease can lapse on a slow machine's late renewals alone (a commit stalled by the
    // disk), which would look like the fix.
    let env = [
        ("TOKENLOG_FAILPOINTS", "model-error=10"),
        ("TOKENLOG_PLANT_ZOMBIE_DECODER", "1"),
    ];
    let zombie_args = ["--fake-step-ms", "20", "--lease-ms", "3000", "--capacity", "1"];
    let mut zombie = cluster.start_decoder_env("dec-zombie", &zombie_args, &env);
    let prompt = [1, 1, 2, 3];
    let id = submit(&client, "zombie", &prompt).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !zombie.log_text().contains("PLANTED BUG: the worker failed") {
        assert!(
            Instant::now() < deadline,
            "the zombie's model never failed:\n{}",
            zombie.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = owner(&client, id).await;
    let d2 = cluster.start_decoder("dec-c", &args);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(zombie.wait_exit(Duration::ZERO).is_none(), "the planted zombie exited");
    let after = owner(&client, id).await;
    assert_eq!(before.0, "dec-zombie");
    assert_eq!(
        after,
        before,
        "under the plant the lease stays with the failed decoder, nothing moves\nzombie's log:\n{}\ndec-c's log:\n{}",
        zombie.log_text(),
        d2.log_text()
    );
    drop(d2);
}

/// Issue 11 bug 2: a transient failure to read the committed prefix at takeover (a node that
/// has not applied the submit yet, a partition) releases the generation instead of failing it:
/// it finishes normally, equal to an uninterrupted run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_prefix_read_error_at_takeover_does_not_fail_the_generation() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    cluster.leader().await;
    let client = cluster.client();
    let args = ["--fake-step-ms", "20", "--lease-ms", "600", "--capacity", "1"];
    let mut d1 = cluster.start_decoder("dec-a", &args);
    let prompt = [2, 7, 1, 8];
    let id = submit(&client, "prefix-read", &prompt).await;
    wait_for(&client, id, "progress", |o| o.2 >= 10).await;
    d1.kill9();
    let d2 = cluster.start_decoder_env("dec-b", &args, &[("TOKENLOG_FAILPOINTS", "prefix-read-errors=2")]);
    let (toks, _, terminal) = follow(&client, id).await;
    assert_eq!(
        terminal.state,
        pb::GenerationState::Finished as i32,
        "a transient read error ended the generation: {terminal:?}\ndec-b log:\n{}",
        d2.log_text()
    );
    assert_eq!(toks, expected(&prompt), "equals an uninterrupted run");
    assert!(d2.log_text().contains("prefix-read-errors"), "the failpoint fired");
}

/// Issue 11 bug 5: the leader's wall clock jumps 10 s ahead mid-generation. Log time moves by
/// at most `STAMP_WALL_LEAD_MS_MAX`, so no lease expires and the owner keeps its generation.
/// Under the planted bug `unbounded_clock` (the old stamp: the wall clock as it is) every lease
/// expires at once and the generation is taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_wall_clock_jump_expires_no_lease() {
    let _serial = serial();
    assert_eq!(
        clock_jump_takeovers(false).await,
        0,
        "a clock jump took a generation from its live owner"
    );
    assert!(
        clock_jump_takeovers(true).await >= 1,
        "the planted unbounded clock went unnoticed"
    );
}

/// Runs one generation through a +10 s jump of every node's wall clock; its takeovers.
async fn clock_jump_takeovers(plant: bool) -> u64 {
    let skew = tempfile::NamedTempFile::new().unwrap();
    let path = skew.path().to_str().unwrap().to_string();
    let mut env = vec![("TOKENLOG_CLOCK_SKEW_FILE", path.as_str())];
    if plant {
        env.push(("TOKENLOG_PLANT_UNBOUNDED_CLOCK", "1"));
    }
    let cluster = Cluster::start_with_env(20_000, &env);
    cluster.leader().await;
    let client = cluster.client();
    let args = ["--fake-step-ms", "20", "--lease-ms", "600", "--capacity", "1"];
    let d = cluster.start_decoder("dec-a", &args);
    let prompt = [3, 3, 3, plant as u32];
    let id = submit(&client, "clock", &prompt).await;
    wait_for(&client, id, "progress", |o| o.2 >= 10).await;
    std::fs::write(&path, "10000").unwrap();
    let (toks, epochs, terminal) = follow(&client, id).await;
    assert_eq!(toks, expected(&prompt), "equals an uninterrupted run");
    eprintln!("plant {plant}: epochs {epochs:?}");
    drop(d);
    terminal.takeovers
}

/// A decoder whose stall watchdog gives up on a stuck step exits within seconds, with an error,
/// not when the step returns: the runtime's end waited for the step on its blocking thread
/// without a limit (here a step of 30 s: the process lived on, silent, for 30 s after its
/// leases ended).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_whose_step_is_stuck_exits_once_its_watchdog_fires() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let mut d = cluster.start_decoder("stuck", &["--fake-step-ms", "30000", "--stall-ms", "1000"]);
    common::wait_for_model(&client).await;
    let id = submit(&client, "stuck-1", &[5, 6, 7]).await;
    let t0 = Instant::now();
    let status = d.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| {
        panic!(
            "still running 20 s after generation {id} was submitted:\n{}",
            d.log_text()
        )
    });
    assert!(!status.success(), "{}", d.log_text());
    assert!(d.log_text().contains("the worker is stuck"), "{}", d.log_text());
    assert!(
        t0.elapsed() < Duration::from_secs(12),
        "exited after {:?}",
        t0.elapsed()
    );
}

/// A decoder stopped (SIGTERM) while the log is out of its reach (every node paused) exits
/// within seconds, though it holds generations it cannot release: its releases go out at once
/// and it waits `RELEASE_ALL_TIMEOUT` for them in all. Before, it released one generation after
/// the other, each for its whole retry budget (~15-20 s): four took over a minute, past a
/// supervisor's 30 s stop timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_stopped_while_the_log_is_out_of_reach_exits_within_seconds() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let mut d = cluster.start_decoder("cut-off", &["--capacity", "4", "--fake-step-ms", "200"]);
    common::wait_for_model(&client).await;
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(submit(&client, &format!("cut-off-{i}"), &[1, 2, 3, i]).await);
    }
    for &id in &ids {
        wait_for(&client, id, "the decoder to hold it", |(o, _, f)| {
            o == "cut-off" && *f >= 1
        })
        .await;
    }
    for i in 0..3 {
        cluster.signal(i, "STOP");
    }
    let t0 = Instant::now();
    d.signal("-TERM");
    let status = d.wait_exit(Duration::from_secs(60));
    let took = t0.elapsed();
    for i in 0..3 {
        cluster.signal(i, "CONT");
    }
    let log = d.log_text();
    assert!(status.is_some(), "still running after 60 s:\n{log}");
    assert!(took < Duration::from_secs(15), "{took:?}:\n{log}");
}
