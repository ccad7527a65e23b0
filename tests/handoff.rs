//! Planned handoff between real decoder processes over a real 3-node log (CONTRACT §7): a
//! decoder told to stop (SIGTERM) with a handoff listener hands every generation it owns to
//! another decoder of the same model with its cache, through the log's phases, and exits; the
//! clients' streams go on without a gap, a duplicate or a re-prefill, and the output equals an
//! uninterrupted run's.

// See tests/decoder_takeover.rs: the serial guard is held across awaits on purpose.
#![allow(clippy::await_holding_lock)]

mod common;

use std::time::{Duration, Instant};

use common::{serial, Cluster};
use futures::StreamExt;
use tokenlog_decoder::{generate, FakeConfig, FakeModel, Model, SamplingConfig, StopConfig};
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

const MAX_TOKENS: u32 = 150;
/// Tokens of each real-model generation in the handoff test.
const REAL_MAX_TOKENS: u32 = 128;

fn fake() -> FakeModel {
    // What `tokenlog decoder --fake` loads.
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
        seed: 7,
        ..Default::default()
    }
}

fn expected(model: &dyn Model, prompt: &[u32], max_tokens: u32) -> Vec<u32> {
    let stop = StopConfig {
        max_tokens,
        stop_strings: vec![],
        eos_token_ids: vec![],
    };
    generate(model, prompt, &sampling(), &stop).unwrap().tokens
}

async fn submit(client: &LogClient, model: &dyn Model, rid: &str, prompt: &[u32], max_tokens: u32) -> u64 {
    common::submit_binding(
        client,
        rid,
        common::sampled_binding(model, prompt, &sampling(), max_tokens),
    )
    .await
}

/// Follows a generation from seq 0 until it is terminal, like a client: every record once, in
/// order. Returns the tokens, their epochs, and the longest wait between two records.
async fn follow(client: &LogClient, id: u64) -> Followed {
    let (mut toks, mut epochs) = (Vec::new(), Vec::new());
    let mut longest = Duration::ZERO;
    let mut last: Option<Instant> = None;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut stream = client.watch(id, toks.len() as u32).await.unwrap();
        while let Ok(Some(item)) = tokio::time::timeout(Duration::from_secs(30), stream.next()).await {
            let ev = item.unwrap();
            let now = Instant::now();
            if let (Some(t), false) = (last, ev.records.is_empty()) {
                longest = longest.max(now - t);
            }
            for r in ev.records {
                assert_eq!(r.seq as usize, toks.len(), "gap or duplicate in the committed stream");
                toks.push(r.token_id);
                epochs.push(r.epoch);
                last = Some(now);
            }
            if ev.terminal.is_some() {
                return (toks, epochs, longest);
            }
        }
        assert!(Instant::now() < deadline, "generation {id} did not finish");
    }
}

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

async fn wait_until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A fake-model decoder's flags: a handoff listener, 25 ms steps, `capacity` generations.
fn fake_handoff_flags(capacity: &'static str) -> [&'static str; 6] {
    [
        "--handoff-listen",
        "127.0.0.1:0",
        "--fake-step-ms",
        "25",
        "--capacity",
        capacity,
    ]
}

/// Whether `decoder` is registered with a handoff listener.
async fn takes_handoffs(client: &LogClient, decoder: &str) -> bool {
    client
        .list_models()
        .await
        .is_ok_and(|m| m.models.iter().any(|m| m.handoff_addrs.contains_key(decoder)))
}

/// Submits a generation per prompt (request ids `{prefix}{i}`) through `submitter`; returns
/// their ids once `owner` holds each with a few records.
async fn submit_owned(
    submitter: &LogClient,
    client: &LogClient,
    model: &dyn Model,
    prefix: &str,
    prompts: &[Vec<u32>],
    max_tokens: u32,
    owner: &str,
) -> Vec<u64> {
    let mut ids = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        ids.push(submit(submitter, model, &format!("{prefix}{i}"), p, max_tokens).await);
    }
    for &id in &ids {
        wait_owned(client, id, owner).await;
    }
    ids
}

/// Waits until `owner` holds generation `id` and has committed a few of its records.
async fn wait_owned(client: &LogClient, id: u64, owner: &str) {
    wait_until(
        &format!("{owner} to hold generation {id} with a few records"),
        async || {
            let g = get(client, id).await.generation.unwrap();
            g.lease.is_some_and(|l| l.owner == owner) && g.frontier >= 4
        },
    )
    .await;
}

/// What [`follow`] saw of a generation: its tokens, their epochs, the longest gap.
type Followed = (Vec<u32>, Vec<u64>, Duration);

/// A client following each of `ids` (see [`follow`]).
fn follow_all(client: &LogClient, ids: &[u64]) -> Vec<tokio::task::JoinHandle<Followed>> {
    ids.iter()
        .map(|&id| {
            let c = client.clone();
            tokio::spawn(async move { follow(&c, id).await })
        })
        .collect()
}

/// Drains `a` (SIGTERM) into `b` while every generation of `prompts` runs on `a`; checks the
/// contract and returns the longest gap any client saw and `a`'s log.
async fn drain_and_check(
    cluster: &Cluster,
    model: &dyn Model,
    prompts: &[Vec<u32>],
    max_tokens: u32,
    mut a: common::Decoder,
    start_b: impl FnOnce() -> common::Decoder,
) -> (Duration, common::Decoder) {
    let client = cluster.client();
    // Submitting is a gateway's call: over TLS, with a gateway's certificate.
    let submitter = match &cluster.certs {
        Some(dir) => LogClient::with_tls(cluster.addrs.clone(), Some(common::tls(dir, "gateway-1"))).unwrap(),
        None => client.clone(),
    };
    let ids = submit_owned(&submitter, &client, model, "h", prompts, max_tokens, &a.id).await;
    let b = start_b();
    let b_id = b.id.as_str();
    wait_until("b to register its handoff listener", async || {
        takes_handoffs(&client, b_id).await
    })
    .await;
    let follows = follow_all(&client, &ids);
    a.signal("-TERM");
    let status = a.wait_exit(Duration::from_secs(30)).expect("a exits after draining");
    let a_log = a.log_text();
    assert!(status.success(), "{a_log}");
    // Draining, it re-registered without its listener: nobody picks it as a destination.
    assert!(
        !takes_handoffs(&client, &a.id).await,
        "a drained decoder still offers handoffs"
    );
    let mut longest = Duration::ZERO;
    for ((id, p), f) in ids.iter().zip(prompts).zip(follows) {
        let (toks, epochs, gap) = f.await.unwrap();
        longest = longest.max(gap);
        assert_eq!(
            toks,
            expected(model, p, max_tokens),
            "generation {id}: the uninterrupted run's tokens"
        );
        // Written by a at epoch 1, then by b at the handoff epoch 2, nothing else.
        let switch = epochs.iter().position(|&e| e != 1).expect("b wrote the rest");
        assert!(switch >= 4, "{epochs:?}");
        assert!(epochs[switch..].iter().all(|&e| e == 2), "generation {id}: {epochs:?}");
        let r = get(&client, *id).await;
        let h = r.handoff.expect("the attempt is in the log");
        assert_eq!(h.phase, pb::HandoffPhase::SourceReleased as i32, "{h:?}");
        assert_eq!((h.source.as_str(), h.destination.as_str()), (a.id.as_str(), b_id));
        assert_eq!((h.source_epoch, h.handoff_epoch), (1, 2));
        let m = h.manifest.unwrap();
        // The cache covered the records a had when it copied it; a decoded on until the
        // commit and b followed the rest from the log.
        assert!(
            m.frontier as usize <= switch,
            "manifest {} > switch {switch}",
            m.frontier
        );
        // Copied while a decoded on: every committed position but the last, which b prefilled.
        assert_eq!(m.kv_positions as usize, p.len() + m.frontier as usize - 1);
        assert_eq!(r.generation.unwrap().takeovers, 1);
    }
    assert_eq!(
        a_log.matches("generation handed over").count(),
        prompts.len() * 2,
        "{a_log}"
    );
    assert!(a_log.contains("drained"), "{a_log}");
    (longest, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_decoder_hands_every_generation_over_with_its_cache() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let flags = fake_handoff_flags("4");
    let a = cluster.start_decoder("ho-a", &flags);
    let client = cluster.client();
    common::wait_for_model(&client).await;
    let m = fake();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| m.tokenizer().encode(&format!("prompt number {i}")).unwrap())
        .collect();
    // b starts once a holds everything.
    let (longest, b) = drain_and_check(&cluster, &m, &prompts, MAX_TOKENS, a, || {
        cluster.start_decoder("ho-b", &flags)
    })
    .await;
    eprintln!("longest gap between two records at any client during the drain: {longest:?}");
    let b_log = b.log_text();
    assert_eq!(
        b_log.matches("generation received with its cache").count(),
        4,
        "{b_log}"
    );
    assert!(!b_log.contains("generation taken"), "b re-prefilled nothing: {b_log}");
}

/// A decoder with `--rebalance` holding 4 generations hands them, one every 2 s, to an idle
/// decoder that joins, with their caches, until the two are within one generation of each
/// other (2 and 2): through the log's handoff phases, epoch 1 to 2; every client's stream is
/// the uninterrupted run's; the source decodes the rest itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loaded_decoder_rebalances_onto_an_idle_one() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let flags = [
        "--handoff-listen",
        "127.0.0.1:0",
        "--fake-step-ms",
        "40",
        "--capacity",
        "4",
    ];
    let a = cluster.start_decoder("rb-a", &[flags.as_slice(), &["--rebalance"]].concat());
    let client = cluster.client();
    common::wait_for_model(&client).await;
    let m = fake();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| m.tokenizer().encode(&format!("rebalanced prompt {i}")).unwrap())
        .collect();
    const LONG: u32 = 400;
    let ids = submit_owned(&client, &client, &m, "rb", &prompts, LONG, &a.id).await;
    let follows = follow_all(&client, &ids);
    let b = cluster.start_decoder("rb-b", &flags);
    let mut moved = 0;
    for ((id, p), f) in ids.iter().zip(&prompts).zip(follows) {
        let (toks, epochs, _) = f.await.unwrap();
        assert_eq!(
            toks,
            expected(&m, p, LONG),
            "generation {id}: the uninterrupted run's tokens"
        );
        let r = get(&client, *id).await;
        if let Some(h) = r.handoff {
            assert_eq!(h.phase, pb::HandoffPhase::SourceReleased as i32, "{h:?}");
            assert_eq!(
                (h.source.as_str(), h.destination.as_str()),
                (a.id.as_str(), b.id.as_str())
            );
            let switch = epochs.iter().position(|&e| e != 1).expect("b wrote the rest");
            assert!(epochs[switch..].iter().all(|&e| e == 2), "generation {id}: {epochs:?}");
            moved += 1;
        } else {
            assert!(epochs.iter().all(|&e| e == 1), "generation {id}: {epochs:?}");
        }
    }
    let (a_log, b_log) = (a.log_text(), b.log_text());
    // 4 and 0 end as 2 and 2: the first two moves. (If b finishes its two before a does, a
    // holding 2 against 0 moves one more: also balancing, at the very end.)
    let rebalances: Vec<&str> = a_log
        .lines()
        .filter(|l| l.contains("rebalancing: handing a generation"))
        .collect();
    assert!(moved >= 2 && moved == rebalances.len(), "{a_log}");
    assert!(rebalances[0].contains("mine=4 theirs=0"), "{a_log}");
    assert!(rebalances[1].contains("mine=3 theirs=1"), "{a_log}");
    assert!(rebalances[2..].iter().all(|l| l.contains("mine=2 theirs=0")), "{a_log}");
    assert_eq!(
        b_log.matches("generation received with its cache").count(),
        moved,
        "{b_log}"
    );
    assert!(
        !b_log.contains("rebalancing"),
        "b holds less: it moves nothing back:\n{b_log}"
    );
}

/// A destination that answers a transfer "committed" without taking it (the planted bug
/// `false-commit`) does not get the generation: the source asks the log, which holds no commit
/// of the attempt, aborts it and decodes on; every client sees the uninterrupted run's tokens,
/// all written by the source at epoch 1. Before, the source took the destination's word: it
/// said "generation handed over" and forgot a generation the log still gave it, which stalled
/// until its lease lapsed and was taken over by a re-prefill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_saying_committed_without_the_log_does_not_get_the_generation() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let flags = [
        "--handoff-listen",
        "127.0.0.1:0",
        "--fake-step-ms",
        "40",
        "--capacity",
        "4",
    ];
    let a = cluster.start_decoder("fc-a", &[flags.as_slice(), &["--rebalance"]].concat());
    let client = cluster.client();
    common::wait_for_model(&client).await;
    let m = fake();
    let prompts: Vec<Vec<u32>> = (0..2)
        .map(|i| m.tokenizer().encode(&format!("falsely committed {i}")).unwrap())
        .collect();
    const LONG: u32 = 200;
    let ids = submit_owned(&client, &client, &m, "fc", &prompts, LONG, &a.id).await;
    let follows = follow_all(&client, &ids);
    let b = cluster.start_decoder_env("fc-b", &flags, &[("TOKENLOG_PLANT_FALSE_COMMIT", "1")]);
    for ((id, p), f) in ids.iter().zip(&prompts).zip(follows) {
        let (toks, epochs, _) = f.await.unwrap();
        assert_eq!(toks, expected(&m, p, LONG), "generation {id}");
        assert!(
            epochs.iter().all(|&e| e == 1),
            "generation {id} never left a: {epochs:?}\n{}",
            a.log_text()
        );
    }
    let (a_log, b_log) = (a.log_text(), b.log_text());
    assert!(
        b_log.contains("PLANTED: answering a transfer committed"),
        "the plant struck:\n{b_log}"
    );
    assert!(a_log.contains("the log did not"), "{a_log}");
    assert!(!a_log.contains("generation handed over"), "{a_log}");
}

/// A decoder with a handoff listener told to stop while it holds nothing re-registers without
/// the listener before it exits, like a draining one: until its registration lapses (5 s or
/// more) no other decoder would pick it as a destination. (It used to exit still offering it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_decoder_holding_nothing_stops_offering_handoffs() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let flags = ["--handoff-listen", "127.0.0.1:0", "--fake-step-ms", "25"];
    let mut a = cluster.start_decoder("idle-ho-a", &flags);
    let client = cluster.client();
    let a_id = a.id.clone();
    wait_until("a to register its handoff listener", async || {
        takes_handoffs(&client, &a_id).await
    })
    .await;
    a.signal("-TERM");
    let status = a.wait_exit(Duration::from_secs(30)).expect("a exits");
    assert!(status.success(), "{}", a.log_text());
    assert!(
        !takes_handoffs(&client, &a.id).await,
        "a stopped decoder still offers handoffs:\n{}",
        a.log_text()
    );
}

/// A decoder killed with -9 stops being offered as a handoff destination as soon as the log ends
/// its session, not when its registration lapses (5 s or more later): a draining decoder that
/// picked it first waited on a connection to a dead process (on another host, a connect
/// timeout). It stays registered meanwhile (its model's decoders still list it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_decoder_is_no_handoff_destination_once_its_session_ends() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let flags = ["--handoff-listen", "127.0.0.1:0", "--fake-step-ms", "25"];
    let mut a = cluster.start_decoder("dead-ho-a", &flags);
    let client = cluster.client();
    let a_id = a.id.clone();
    wait_until("a to register its handoff listener", async || {
        takes_handoffs(&client, &a_id).await
    })
    .await;
    // Its session is open once it takes work: wait for that, so that its end is what is seen.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    a.kill9();
    let killed = Instant::now();
    wait_until("the killed decoder to leave the handoff destinations", async || {
        !takes_handoffs(&client, &a_id).await
    })
    .await;
    let gone_after = killed.elapsed();
    let models = client.list_models().await.unwrap();
    assert!(
        models.models.iter().any(|m| m.decoders.contains(&a_id)),
        "the registration lapsed first ({gone_after:?}): {models:?}"
    );
    assert!(gone_after < Duration::from_secs(3), "{gone_after:?}");
}

/// A decoder whose registration lapsed (its step loop held up past the registration's 5 s: here
/// a take held open 6 s by failpoint `take-delay-ms`) opens a new session once it registers
/// again: the log's housekeeping drops a lapsed decoder's session with its registration, while
/// the session's stream stays open. Before, it stayed without a session in the log for good: no
/// handoff destination (and no standby, and its crash found by lease expiry only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_whose_registration_lapsed_gets_its_session_back() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    let flags = ["--handoff-listen", "127.0.0.1:0", "--fake-step-ms", "25"];
    let b = cluster.start_decoder_env("lapse-b", &flags, &[("TOKENLOG_FAILPOINTS", "take-delay-ms=6000")]);
    let b_id = b.id.clone();
    wait_until("b to take handoffs", async || takes_handoffs(&client, &b_id).await).await;
    let id = submit(&client, &m, "lapse-x", &m.tokenizer().encode("lapse").unwrap(), 400).await;
    wait_until("b to hold its take open", async || {
        b.log_text().contains("failpoint take-delay-ms")
    })
    .await;
    wait_until("b's registration to lapse", async || {
        !client
            .list_models()
            .await
            .is_ok_and(|m| m.models.iter().any(|m| m.decoders.contains(&b_id)))
    })
    .await;
    wait_until("b to own the generation", async || {
        get(&client, id)
            .await
            .generation
            .unwrap()
            .lease
            .is_some_and(|l| l.owner == b_id)
    })
    .await;
    let t0 = Instant::now();
    while !takes_handoffs(&client, &b_id).await {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "b is registered again but has no session in the log:\n{}",
            b.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A registration refresh whose answer is lost after it applied makes the next one look like the
/// registration had lapsed (the decoder heard of no refresh for longer than the registration
/// lives), though the log held it, and the decoder's session, all along. The decoder then opens
/// a new session; the old one goes only once the new one is the log's. Before, it ended the old
/// session's stream first: the leader took that for the decoder's death and ended every lease
/// it held, unless the new session happened to be opened first (a race: three false alarms
/// here; failpoint `register-answers-lost=5`: five refreshes of every six unanswered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_that_only_looks_lapsed_ends_no_lease() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    let d = cluster.start_decoder_env(
        "unheard",
        &["--fake-step-ms", "25"],
        &[("TOKENLOG_FAILPOINTS", "register-answers-lost=5")],
    );
    common::wait_for_model(&client).await;
    let prompt = m.tokenizer().encode("unheard").unwrap();
    let x = submit_owned(&client, &client, &m, "unheard-x", &[prompt], 2_000, &d.id).await[0];
    wait_until("d to take its registration for lapsed three times", async || {
        d.log_text().matches("the registration had lapsed").count() >= 3
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let log = d.log_text();
    // An ended lease keeps its owner and epoch until the generation is taken again: the
    // decoder's refused append says it ended.
    assert!(!log.contains("append rejected"), "x's lease ended:\n{log}");
    let g = get(&client, x).await.generation.unwrap();
    let lease = g.lease.unwrap();
    assert_eq!(
        (lease.owner.as_str(), lease.epoch),
        ("unheard", 1),
        "x's lease never ended:\n{}",
        d.log_text()
    );
}

/// One failure point of a planned handoff (CONTRACT §8, points 1-6), as a scenario: which side
/// dies where (a failpoint ends the process as a kill would), and what the log must show after.
struct Case {
    name: &'static str,
    source_failpoints: &'static str,
    destination_failpoints: &'static str,
    /// The attempt's last phase.
    phase: pb::HandoffPhase,
    /// Whether the source / destination process ends by the failpoint (exit 137).
    source_dies: bool,
    destination_dies: bool,
}

const CASES: [Case; 7] = [
    // The source cannot ask the log at once either: it asks again until the log answers. It
    // took the unanswered questions for an abort, recorded "aborted" for an attempt the log
    // committed, and never released it (the phase stayed `ownership_committed`). First, while
    // no decoder of an earlier case is still registered: its one transfer is to the destination.
    Case {
        name: "5, with the log out of the source's reach for 1 s when the answer is lost",
        source_failpoints: "source-blind-ms=1000",
        destination_failpoints: "handoff-exit=destination-after-commit",
        phase: pb::HandoffPhase::SourceReleased,
        source_dies: false,
        destination_dies: true,
    },
    Case {
        name: "1: the source fails during copying",
        source_failpoints: "handoff-exit=source-copying",
        destination_failpoints: "",
        phase: pb::HandoffPhase::Aborted,
        source_dies: true,
        destination_dies: false,
    },
    Case {
        name: "2: the destination fails before receiver-ready",
        source_failpoints: "",
        destination_failpoints: "handoff-exit=destination-before-ready",
        phase: pb::HandoffPhase::Aborted,
        source_dies: false,
        destination_dies: true,
    },
    Case {
        name: "3: the destination fails after receiver-ready, before the commit",
        source_failpoints: "",
        destination_failpoints: "handoff-exit=destination-after-ready",
        phase: pb::HandoffPhase::Aborted,
        source_dies: false,
        destination_dies: true,
    },
    Case {
        name: "4: the ownership commit's acknowledgment is lost",
        source_failpoints: "",
        destination_failpoints: "commit-answer-lost=1",
        phase: pb::HandoffPhase::SourceReleased,
        source_dies: false,
        destination_dies: false,
    },
    Case {
        name: "5: the destination fails after the commit, before its answer reaches the source",
        source_failpoints: "",
        destination_failpoints: "handoff-exit=destination-after-commit",
        phase: pb::HandoffPhase::SourceReleased,
        source_dies: false,
        destination_dies: true,
    },
    Case {
        name: "6: the source fails during its release",
        source_failpoints: "handoff-exit=source-before-release",
        destination_failpoints: "",
        phase: pb::HandoffPhase::OwnershipCommitted,
        source_dies: true,
        destination_dies: false,
    },
];

/// Failure points 1-6: whoever dies where, the generation has one owner at a time, no stale
/// epoch writes after a newer one did, the attempt ends in the phase the point implies, and the
/// client's stream is the uninterrupted run's, gap- and duplicate-free (a third decoder
/// finishes what nobody holds any more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_handoff_failure_point_keeps_one_owner_and_the_clients_stream() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    let flags = [
        "--handoff-listen",
        "127.0.0.1:0",
        "--fake-step-ms",
        "25",
        "--drain-ms",
        "3000",
    ];
    for (i, case) in CASES.iter().enumerate() {
        let env = |fp: &'static str| {
            if fp.is_empty() {
                vec![]
            } else {
                vec![("TOKENLOG_FAILPOINTS", fp)]
            }
        };
        let mut s = cluster.start_decoder_env(&format!("fp{i}-s"), &flags, &env(case.source_failpoints));
        common::wait_for_model(&client).await;
        let prompt = m.tokenizer().encode(&format!("failure point {i}")).unwrap();
        let id = submit(&client, &m, &format!("fp{i}"), &prompt, MAX_TOKENS).await;
        wait_owned(&client, id, &s.id).await;
        let mut d = cluster.start_decoder_env(&format!("fp{i}-d"), &flags, &env(case.destination_failpoints));
        let d_id = d.id.clone();
        wait_until("the destination to register", async || {
            takes_handoffs(&client, &d_id).await
        })
        .await;
        let follower = {
            let c = client.clone();
            tokio::spawn(async move { follow(&c, id).await })
        };
        s.signal("-TERM");
        let s_status = s.wait_exit(Duration::from_secs(30)).expect("the source exits");
        assert_eq!(
            s_status.code() == Some(137),
            case.source_dies,
            "{}: source {s_status:?}",
            case.name
        );
        if case.destination_dies {
            let st = d.wait_exit(Duration::from_secs(30)).unwrap_or_else(|| {
                panic!(
                    "{}: the destination's failpoint did not fire\nsource:\n{}\ndestination:\n{}",
                    case.name,
                    s.log_text(),
                    d.log_text()
                )
            });
            assert_eq!(st.code(), Some(137), "{}", case.name);
        }
        // Whatever nobody holds any more, a third decoder finishes.
        let c = cluster.start_decoder(&format!("fp{i}-c"), &["--fake-step-ms", "25"]);
        let (toks, epochs, _) = follower.await.unwrap();
        assert_eq!(
            toks,
            expected(&m, &prompt, MAX_TOKENS),
            "{}: the uninterrupted run",
            case.name
        );
        assert!(
            epochs.windows(2).all(|w| w[0] <= w[1]),
            "{}: a stale epoch wrote: {epochs:?}",
            case.name
        );
        let r = get(&client, id).await;
        let h = r.handoff.expect("the attempt is in the log");
        assert_eq!(h.phase, case.phase as i32, "{}: {h:?}", case.name);
        assert_eq!((h.source_epoch, h.handoff_epoch), (1, 2), "{}", case.name);
        if case.phase == pb::HandoffPhase::Aborted {
            assert!(!h.detail.is_empty(), "{}: an abort says why", case.name);
        }
        eprintln!(
            "{}: ok ({} records, epochs {:?}, attempt {} ended in phase {}, detail {:?})",
            case.name,
            toks.len(),
            {
                let mut e = epochs.clone();
                e.dedup();
                e
            },
            h.attempt,
            pb::HandoffPhase::try_from(h.phase).map_or("?", |p| p.as_str_name()),
            h.detail
        );
        drop((s, d, c));
    }
}

/// A destination whose ownership commit applied but whose catch-up read then failed (failpoint
/// `catch-up-read-fails`) gives the generation back to the log and its receive slot back to
/// itself: with capacity 1 and no other decoder alive, it takes the generation over again and
/// finishes it (before the fix the slot leaked and the generation stayed unowned for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_cannot_catch_up_after_its_commit_releases_the_generation_and_its_slot() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    let flags = fake_handoff_flags("1");
    let mut s = cluster.start_decoder("catchup-s", &flags);
    common::wait_for_model(&client).await;
    let prompt = m.tokenizer().encode("catch-up read fails").unwrap();
    let id = submit(&client, &m, "catchup", &prompt, MAX_TOKENS).await;
    wait_owned(&client, id, &s.id).await;
    let d = cluster.start_decoder_env("catchup-d", &flags, &[("TOKENLOG_FAILPOINTS", "catch-up-read-fails=1")]);
    let d_id = d.id.clone();
    wait_until("the destination to register", async || {
        takes_handoffs(&client, &d_id).await
    })
    .await;
    let follower = {
        let c = client.clone();
        tokio::spawn(async move { follow(&c, id).await })
    };
    s.signal("-TERM");
    s.wait_exit(Duration::from_secs(30)).expect("the source exits");
    wait_until("the destination to take the released generation over", async || {
        let g = get(&client, id).await;
        let committed = g
            .handoff
            .is_some_and(|h| h.phase >= pb::HandoffPhase::OwnershipCommitted as i32);
        // The latest grant: still there once the generation has finished.
        let taken_again = g
            .generation
            .unwrap()
            .lease
            .is_some_and(|l| l.owner == d_id && l.epoch > 2);
        committed && taken_again
    })
    .await;
    let (toks, epochs, _) = follower.await.unwrap();
    assert_eq!(toks, expected(&m, &prompt, MAX_TOKENS), "the uninterrupted run");
    assert!(
        epochs.windows(2).all(|w| w[0] <= w[1]),
        "a stale epoch wrote: {epochs:?}"
    );
    let log = d.log_text();
    assert!(log.contains("failpoint fired: the catch-up read fails"), "{log}");
    assert!(log.contains("releasing it"), "{log}");
}

/// A client of the handoff listener at `addr` over TLS, with the certificate of `holder` in
/// `certs` (`None`: without one).
async fn handoff_client(
    certs: &std::path::Path,
    addr: &str,
    holder: Option<&str>,
) -> tokenlog_proto::decoder::handoff_client::HandoffClient<tonic::transport::Channel> {
    let name = tokenlog_raftlog::tls::DECODER_SERVER_NAME;
    let cfg = match holder {
        Some(h) => common::tls(certs, h).client_config_for(name),
        None => tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(
                std::fs::read(certs.join("ca.pem")).unwrap(),
            ))
            .domain_name(name),
    };
    tokenlog_proto::decoder::handoff_client::HandoffClient::new(common::tls_channel(addr, cfg).await)
}

/// Over mutual TLS: decoders hand over to each other with their decoder certificates (which
/// carry `tokenlog-decoder` for their handoff listeners), and a caller with another role, or
/// without a certificate, is refused by the listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoffs_run_over_mutual_tls_and_only_decoders_may_call_a_listener() {
    let _serial = serial();
    let certs = tempfile::tempdir().unwrap();
    common::make_certs(certs.path(), &[]);
    let cluster = Cluster::start_tls(certs.path());
    cluster.leader().await;
    let m = fake();
    let args = |holder: &str| {
        let mut a = common::tls_args(certs.path(), holder);
        a.extend(["--handoff-listen", "127.0.0.1:0", "--fake-step-ms", "25"].map(String::from));
        a
    };
    let a_args = args("decoder-1");
    let b_args = args("decoder-2");
    let a = cluster.start_decoder("decoder-1", &a_args.iter().map(String::as_str).collect::<Vec<_>>());
    let client = cluster.client();
    common::wait_for_model(&client).await;
    let prompts: Vec<Vec<u32>> = (0..2)
        .map(|i| m.tokenizer().encode(&format!("tls {i}")).unwrap())
        .collect();
    let (_, b) = drain_and_check(&cluster, &m, &prompts, MAX_TOKENS, a, || {
        cluster.start_decoder("decoder-2", &b_args.iter().map(String::as_str).collect::<Vec<_>>())
    })
    .await;
    // b's listener, called as a gateway and without a certificate.
    let addr = client.list_models().await.unwrap().models[0].handoff_addrs["decoder-2"].clone();
    for (holder, want) in [
        (Some("gateway-1"), tonic::Code::PermissionDenied),
        (None, tonic::Code::Unauthenticated),
    ] {
        let mut c = handoff_client(certs.path(), &addr, holder).await;
        let got = c
            .transfer(futures::stream::iter(Vec::new()))
            .await
            .map(|_| ())
            .unwrap_err();
        assert_eq!(got.code(), want, "{holder:?}: {got}");
        let got = c.rows(futures::stream::iter(Vec::new())).await.map(|_| ()).unwrap_err();
        assert_eq!(got.code(), want, "rows, {holder:?}: {got}");
    }
    drop(b);
}

/// A transfer's header is the caller's word: a destination refuses one whose named source the
/// caller's certificate does not speak for, or whose attempt the log gives to another source,
/// and leaves the attempt alone. It aborted the attempt in the log (under its own id, which the
/// log takes from either side) for any header it refused, so any decoder certificate could end
/// other decoders' handoffs with a made-up header (the attempt ids are readable with Get).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_naming_another_decoders_attempt_is_refused_without_aborting_it() {
    let _serial = serial();
    let certs = tempfile::tempdir().unwrap();
    common::make_certs(certs.path(), &[]);
    common::make_certs(certs.path(), &["--decoder", "decoder-3"]);
    let cluster = Cluster::start_tls(certs.path());
    cluster.leader().await;
    let client = cluster.client();
    let m = fake();
    let gateway = LogClient::with_tls(cluster.addrs.clone(), Some(common::tls(certs.path(), "gateway-1"))).unwrap();
    let d1 = LogClient::with_tls(cluster.addrs.clone(), Some(common::tls(certs.path(), "decoder-1"))).unwrap();
    // decoder-1 (a client here) owns a generation before decoder-2 (a process) is there to take it.
    let prompt = m.tokenizer().encode("forged").unwrap();
    let id = submit(&gateway, &m, "forged", &prompt, MAX_TOKENS).await;
    let model = tokenlog_decoder::worker::identity_to_pb(m.identity());
    let owned = d1
        .acquire(pb::AcquireRequest {
            generation_id: id,
            decoder_id: "decoder-1".into(),
            lease_ms: 60_000,
            model: Some(model.clone()),
            rng_version: tokenlog_decoder::RNG_VERSION,
        })
        .await
        .unwrap();
    assert!(owned.ok, "{owned:?}");
    let epoch = owned.generation.unwrap().lease.unwrap().epoch;
    let mut b_args = common::tls_args(certs.path(), "decoder-2");
    b_args.extend(["--handoff-listen", "127.0.0.1:0"].map(String::from));
    let b = cluster.start_decoder("decoder-2", &b_args.iter().map(String::as_str).collect::<Vec<_>>());
    wait_until("decoder-2 to register its handoff listener", async || {
        takes_handoffs(&client, "decoder-2").await
    })
    .await;
    let manifest = pb::CacheManifest {
        model: Some(model),
        frontier: 0,
        cache_format: "never sent".into(),
        cache_sha256: "0".repeat(64),
        ..Default::default()
    };
    let prepared = d1
        .handoff(pb::HandoffRequest {
            generation_id: id,
            step: Some(pb::handoff_request::Step::Prepare(pb::HandoffPrepare {
                epoch,
                source: "decoder-1".into(),
                destination: "decoder-2".into(),
                manifest: Some(manifest),
            })),
        })
        .await
        .unwrap();
    assert!(prepared.ok, "{prepared:?}");
    let attempt = prepared.handoff.unwrap().attempt;
    // decoder-3 calls decoder-2's listener with headers naming that attempt: as decoder-1 (its
    // certificate does not speak for it), and as itself (the log's attempt is decoder-1's).
    let addr = client.list_models().await.unwrap().models[0].handoff_addrs["decoder-2"].clone();
    let mut c = handoff_client(certs.path(), &addr, Some("decoder-3")).await;
    for source in ["decoder-1", "decoder-3"] {
        let header = tokenlog_proto::decoder::TransferHeader {
            generation_id: id,
            attempt,
            handoff_epoch: epoch + 1,
            source: source.into(),
            destination: "decoder-2".into(),
            manifest: None,
            rows_key: 0,
        };
        let chunk = tokenlog_proto::decoder::TransferChunk {
            part: Some(tokenlog_proto::decoder::transfer_chunk::Part::Header(header)),
        };
        let got = c.transfer(futures::stream::iter([chunk])).await.unwrap().into_inner();
        assert!(!got.committed, "{source}: {got:?}");
        let h = get(&client, id).await.handoff.unwrap();
        assert_eq!(
            (h.attempt, h.phase),
            (attempt, pb::HandoffPhase::Prepared as i32),
            "a header naming {source} changed decoder-1's attempt: {h:?} (refused with {:?})",
            got.detail
        );
    }
    drop(b);
}

/// Planted bug `early-handoff-write`: a destination that decodes a handed-over generation
/// before the log committed its ownership is caught by its own history (it appended at the
/// handoff epoch before it was granted); a correct destination's history, in the same run
/// shape, shows no such write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_writing_before_the_ownership_commit_is_caught() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    for (round, plant) in [(0, false), (1, true)] {
        let flags = ["--handoff-listen", "127.0.0.1:0", "--fake-step-ms", "25"];
        let mut a = cluster.start_decoder(&format!("early{round}-a"), &flags);
        common::wait_for_model(&client).await;
        let prompt = m.tokenizer().encode(&format!("early {round}")).unwrap();
        let id = submit(&client, &m, &format!("early{round}"), &prompt, MAX_TOKENS).await;
        wait_owned(&client, id, &a.id).await;
        let history = cluster.dir.path().join(format!("early{round}-b.jsonl"));
        let mut b_flags: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
        b_flags.extend(["--history".into(), history.display().to_string()]);
        let b_flags: Vec<&str> = b_flags.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = if plant {
            vec![("TOKENLOG_PLANT_EARLY_HANDOFF_WRITE", "1")]
        } else {
            vec![]
        };
        let b = cluster.start_decoder_env(&format!("early{round}-b"), &b_flags, &env);
        let b_id = b.id.clone();
        wait_until("b to register", async || takes_handoffs(&client, &b_id).await).await;
        a.signal("-TERM");
        a.wait_exit(Duration::from_secs(30)).expect("a exits");
        wait_until("the attempt to end", async || {
            get(&client, id)
                .await
                .handoff
                .is_some_and(|h| h.phase >= pb::HandoffPhase::OwnershipCommitted as i32)
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let bad = common::writes_without_a_grant(&history);
        if plant {
            assert!(
                !bad.is_empty(),
                "the planted early write went unnoticed: {}",
                b.log_text()
            );
            assert!(bad.iter().all(|&(g, e, _)| g == id && e == 2), "{bad:?}");
        } else {
            assert!(bad.is_empty(), "a correct destination wrote without a grant: {bad:?}");
        }
        // The next round starts with nothing running.
        client
            .cancel(pb::CancelRequest {
                tenant: "t".into(),
                request_id: format!("early{round}"),
            })
            .await
            .unwrap();
        drop(b);
    }
}

/// The real model (SmolLM2, sampled, exact mode) handed over between two decoder processes:
/// the client's tokens equal the uninterrupted run's, bit for bit, with no re-prefill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_model_hands_over_between_processes_and_stays_exact() {
    let _serial = serial();
    let path = tokenlog_decoder::fetch::ensure_default_model(&tokenlog_decoder::fetch::repo_models_dir()).unwrap();
    tokenlog_decoder::threads::init_cpu_threads(1);
    let model = tokenlog_decoder::load_model(&path, tokenlog_decoder::DeviceSpec::Cpu).unwrap();
    let cluster = Cluster::start(20_000);
    let flags = ["--handoff-listen", "127.0.0.1:0", "--capacity", "2"];
    // a steps no faster than 50 ms (a slower machine's pace; the tokens are the same): its two
    // generations outlast b's start even where SmolLM2 decodes ~100 tokens/s.
    let a = cluster.start_slow_real_decoder("real-ho-a", &path, &flags, 50);
    common::wait_for_model(&cluster.client()).await;
    let prompts: Vec<Vec<u32>> = ["Tell me about lighthouses.", "Name a few rivers."]
        .iter()
        .map(|q| {
            model
                .tokenizer()
                .encode_chat(&[tokenlog_decoder::ChatMessage::user(*q)])
                .unwrap()
        })
        .collect();
    // Long enough that both are still decoding when `a` is stopped: b's start (a process, the
    // model's load, a registration) takes a few seconds, and a batched pair decodes ~20 tok/s
    // each here.
    let (longest, b) = drain_and_check(&cluster, model.as_ref(), &prompts, REAL_MAX_TOKENS, a, || {
        cluster.start_real_decoder("real-ho-b", &path, &flags)
    })
    .await;
    eprintln!("longest gap between two records at any client during the drain: {longest:?}");
    let b_log = b.log_text();
    assert_eq!(
        b_log.matches("generation received with its cache").count(),
        2,
        "{b_log}"
    );
    assert!(!b_log.contains("generation taken"), "b re-prefilled nothing: {b_log}");
    // The positions b followed past each copy: taken as the rows a streamed beside it (its
    // `Rows` call), not computed, for at least one of the two (a decodes on at ~50 ms a step,
    // so each handoff follows a few records).
    let rows: Vec<u64> = b_log
        .lines()
        .filter(|l| l.contains("generation received with its cache"))
        .filter_map(|l| l.split_once(" rows=")?.1.split(' ').next()?.parse().ok())
        .collect();
    eprintln!("positions b took as rows, per generation received: {rows:?}");
    assert_eq!(rows.len(), 2, "{b_log}");
    assert!(rows.iter().sum::<u64>() > 0, "{b_log}");
}

/// `tokenlog bench drain --fake` runs a whole round: the source takes every generation before the
/// destination starts (a fake-model destination is up at once and took some of them first, and
/// the round then waited out its 300 s deadline), the source hands all of them over and exits,
/// and the bench prints the round's gaps. Only that it completes is checked: the ratio is a
/// measurement, not a property.
#[test]
fn the_drain_bench_runs_a_round_with_the_fake_model() {
    let _one = serial();
    let out = std::process::Command::new(common::bin())
        .args(["bench", "drain", "--fake", "--fake-step-ms", "5", "--rounds", "1"])
        .args(["--after", "8", "--then", "4"])
        .args(["--base-port", &common::free_ports(16).to_string()])
        .output()
        .expect("run tokenlog bench drain");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
    let round = text
        .lines()
        .find(|l| l.starts_with("round 1:"))
        .unwrap_or_else(|| panic!("no round line in: {text}"));
    assert!(round.contains("source exited"), "{round}");
    assert!(text.contains("over 1 drains"), "{text}");
}

/// A transfer's manifest is checked against the destination's model before it takes a byte
/// of cache or a slot: a frontier or more positions than the model's context, or more bytes
/// than its cache of those positions and one position's logits, is refused at the header.
/// Before, any manifest of up to 4 GiB was taken, whatever the model, and its bytes awaited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_refuses_a_manifest_bigger_than_its_models_cache_at_the_header() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let _d = cluster.start_decoder("dest", &["--handoff-listen", "127.0.0.1:0"]);
    // Its handoff address is listed once its session is open too (a moment after it registers).
    wait_until("dest to take handoffs", async || takes_handoffs(&client, "dest").await).await;
    let model = client.list_models().await.unwrap().models.remove(0);
    let addr = model.handoff_addrs["dest"].clone();
    let mut c = tokenlog_proto::decoder::handoff_client::HandoffClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let context = model.context_tokens;
    for (positions, bytes, frontier, want) in [
        (4, 1 << 30, 0, "this model's holds at most"),
        (context + 1, 64, 0, "this model's context holds"),
        // A frontier past the context: the committed prefix read for it allocated a vector of
        // that many records at once (16 GiB for u32::MAX) before anything was checked.
        (0, 64, context + 1, "a cache at frontier"),
    ] {
        let header = tokenlog_proto::decoder::TransferHeader {
            generation_id: 1,
            attempt: 1,
            handoff_epoch: 2,
            source: "nobody".into(),
            destination: "dest".into(),
            manifest: Some(pb::CacheManifest {
                model: model.identity.clone(),
                cache_format: tokenlog_decoder::fake::FAKE_CACHE_FORMAT.into(),
                frontier,
                kv_positions: positions,
                cache_sha256: String::new(),
                bytes,
            }),
            rows_key: 0,
        };
        let chunk = tokenlog_proto::decoder::TransferChunk {
            part: Some(tokenlog_proto::decoder::transfer_chunk::Part::Header(header)),
        };
        let r = c
            .transfer(futures::stream::iter(vec![chunk]))
            .await
            .unwrap()
            .into_inner();
        assert!(
            !r.committed && r.detail.contains(want),
            "{positions} positions, {bytes} bytes: {}",
            r.detail
        );
    }
}

/// A planned handoff moves a generation only to a decoder whose sampler draws as the one the
/// generation is bound to: under another sampler version its continuation would differ from the
/// source's, silently (CONTRACT §1). The log refuses an acquire for that; a handoff never
/// acquires. Decoder a claims sampler version `RNG_VERSION + 1` (failpoint `rng-version`, a
/// decoder of another release in a rolling upgrade), b the current one; a is drained. Before, b
/// took the cache, committed, and decoded x on with its own sampler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_never_moves_a_generation_to_a_decoder_with_another_sampler() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    let other = tokenlog_decoder::RNG_VERSION + 1;
    let fp = format!("rng-version={other}");
    let flags = [
        "--handoff-listen",
        "127.0.0.1:0",
        "--fake-step-ms",
        "25",
        "--drain-ms",
        "3000",
    ];
    let mut a = cluster.start_decoder_env("rng-a", &flags, &[("TOKENLOG_FAILPOINTS", fp.as_str())]);
    common::wait_for_model(&client).await;
    let prompt = m.tokenizer().encode("another sampler").unwrap();
    let mut binding = common::sampled_binding(&m, &prompt, &sampling(), 2_000);
    binding.sampling.as_mut().unwrap().rng_version = other;
    let x = common::submit_binding(&client, "rng-x", binding).await;
    wait_owned(&client, x, &a.id).await;
    let b = cluster.start_decoder("rng-b", &flags);
    wait_until("b to register its handoff listener", async || {
        takes_handoffs(&client, "rng-b").await
    })
    .await;
    a.signal("-TERM");
    let status = a.wait_exit(Duration::from_secs(30)).expect("a exits after draining");
    let logs = format!("--- a:\n{}\n--- b:\n{}", a.log_text(), b.log_text());
    assert!(status.success(), "{logs}");
    let g = get(&client, x).await.generation.unwrap();
    assert!(
        g.lease.as_ref().is_none_or(|l| l.owner != b.id),
        "b, of another sampler, owns x: {:?}\n{logs}",
        g.lease
    );
    assert!(
        logs.contains("sampler version"),
        "the refusal names the sampler: {logs}"
    );
}

/// A drain whose time runs out while a handoff is in flight lets that handoff end: the
/// generation moves to its destination. b says receiver_ready only after 3 s (failpoint
/// `ready-delay-ms`, a slow destination); a drains for 1 s. Before, a released every generation
/// at its deadline, the one being handed out too: the release aborted the attempt, b's commit
/// was refused, and x was taken over with a re-prefill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_whose_time_runs_out_lets_the_handoff_in_flight_end() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    let flags = ["--handoff-listen", "127.0.0.1:0", "--fake-step-ms", "25"];
    let mut a = cluster.start_decoder("late-a", &[&flags[..], &["--drain-ms", "1000"]].concat());
    common::wait_for_model(&client).await;
    let prompt = m.tokenizer().encode("a late destination").unwrap();
    let x = submit_owned(&client, &client, &m, "late-x", &[prompt], 2_000, &a.id).await[0];
    let b = cluster.start_decoder_env("late-b", &flags, &[("TOKENLOG_FAILPOINTS", "ready-delay-ms=3000")]);
    wait_until("b to register its handoff listener", async || {
        takes_handoffs(&client, "late-b").await
    })
    .await;
    a.signal("-TERM");
    let status = a.wait_exit(Duration::from_secs(40)).expect("a exits after draining");
    let logs = format!("--- a:\n{}\n--- b:\n{}", a.log_text(), b.log_text());
    assert!(status.success(), "{logs}");
    assert!(
        logs.contains("drain time is up"),
        "the drain's time ran out before the handoff ended: {logs}"
    );
    assert!(
        logs.contains("generation handed over") && !logs.contains("handoff did not happen"),
        "x was handed over: {logs}"
    );
    let g = get(&client, x).await.generation.unwrap();
    let lease = g.lease.unwrap();
    assert_eq!((lease.owner.as_str(), lease.epoch), ("late-b", 2), "{logs}");
}

/// A decoder stopped while it commits a generation it receives, holding nothing else, hands
/// that generation on with its cache once it arrives. d holds its ownership commit for 6 s
/// after its last check that it is not stopping (failpoint `commit-delay-ms`) and is stopped
/// meanwhile, once e takes handoffs. Before, d's drain found nothing to hand over (the transfer
/// under way was not counted) and ended at once: the generation that arrived was released, and
/// e took it over from the log with a re-prefill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_stopped_while_it_receives_hands_the_generation_on() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    let flags = ["--handoff-listen", "127.0.0.1:0", "--fake-step-ms", "25"];
    let mut a = cluster.start_decoder("recv-a", &flags);
    common::wait_for_model(&client).await;
    let prompt = m.tokenizer().encode("received, then handed on").unwrap();
    let x = submit_owned(&client, &client, &m, "recv-x", &[prompt], 2_000, &a.id).await[0];
    let mut d = cluster.start_decoder_env("recv-d", &flags, &[("TOKENLOG_FAILPOINTS", "commit-delay-ms=6000")]);
    wait_until("d to take handoffs", async || takes_handoffs(&client, "recv-d").await).await;
    a.signal("-TERM");
    wait_until("d to hold its commit", async || {
        d.log_text().contains("failpoint commit-delay-ms")
    })
    .await;
    let e = cluster.start_decoder("recv-e", &flags);
    wait_until("e to take handoffs", async || takes_handoffs(&client, "recv-e").await).await;
    d.signal("-TERM");
    let a_status = a.wait_exit(Duration::from_secs(40)).expect("a exits");
    let d_status = d.wait_exit(Duration::from_secs(40)).expect("d exits");
    let logs = || {
        format!(
            "--- a:\n{}\n--- d:\n{}\n--- e:\n{}",
            a.log_text(),
            d.log_text(),
            e.log_text()
        )
    };
    assert!(a_status.success() && d_status.success(), "{}", logs());
    wait_until("e to own x", async || {
        get(&client, x)
            .await
            .generation
            .unwrap()
            .lease
            .is_some_and(|l| l.owner == "recv-e")
    })
    .await;
    let e_log = e.log_text();
    assert!(
        e_log.contains("generation received with its cache") && !e_log.contains("generation taken"),
        "{}",
        logs()
    );
    let h = get(&client, x).await.handoff.expect("x's attempt is in the log");
    assert_eq!(
        (h.source.as_str(), h.destination.as_str()),
        ("recv-d", "recv-e"),
        "{h:?}"
    );
}

/// A caller that opens a `Transfer` or a `Rows` call and sends nothing is answered within the
/// transfer's timeout, with the reason. Both waited for a header for as long as the caller kept
/// the connection open: each silent call held a task and its buffers in the destination for
/// good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_sends_no_header_is_answered_within_the_transfer_timeout() {
    use tokenlog_decoder::limits::HANDOFF_TRANSFER_TIMEOUT;
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let _d = cluster.start_decoder("dest", &["--handoff-listen", "127.0.0.1:0"]);
    wait_until("dest to take handoffs", async || takes_handoffs(&client, "dest").await).await;
    let addr = client.list_models().await.unwrap().models[0].handoff_addrs["dest"].clone();
    let mut c = tokenlog_proto::decoder::handoff_client::HandoffClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let within = HANDOFF_TRANSFER_TIMEOUT + Duration::from_secs(5);
    let t0 = Instant::now();
    let transfer = tokio::time::timeout(within, c.transfer(futures::stream::pending()))
        .await
        .expect("a transfer without a header is still open")
        .unwrap()
        .into_inner();
    assert!(
        !transfer.committed && transfer.detail.contains("header"),
        "{}",
        transfer.detail
    );
    let rows = tokio::time::timeout(within, c.rows(futures::stream::pending()))
        .await
        .expect("a rows call without a header is still open")
        .map(|_| ())
        .unwrap_err();
    assert_eq!(rows.code(), tonic::Code::DeadlineExceeded, "{rows}");
    eprintln!("both answered after {:?}", t0.elapsed());
}

/// A transfer that arrives while its destination is taking generations from the log finds the
/// slots they will fill taken (failpoint `take-delay-ms` holds the take open). Both decoders
/// have capacity 1: the destination takes y from the log while a is drained towards it. Before,
/// the transfer was admitted against the count the worker had published before its take, and
/// the destination ended up owning x and y, over its capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_arriving_while_the_destination_takes_from_the_log_finds_its_slot_taken() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    let flags = [
        "--handoff-listen",
        "127.0.0.1:0",
        "--fake-step-ms",
        "25",
        "--capacity",
        "1",
        "--drain-ms",
        "2000",
    ];
    let mut a = cluster.start_decoder("cap-a", &flags);
    common::wait_for_model(&client).await;
    let x = submit(
        &client,
        &m,
        "cap-x",
        &m.tokenizer().encode("capacity x").unwrap(),
        2_000,
    )
    .await;
    wait_owned(&client, x, &a.id).await;
    let d = cluster.start_decoder_env("cap-d", &flags, &[("TOKENLOG_FAILPOINTS", "take-delay-ms=3000")]);
    let d_id = d.id.clone();
    wait_until("d to register", async || takes_handoffs(&client, &d_id).await).await;
    let y = submit(
        &client,
        &m,
        "cap-y",
        &m.tokenizer().encode("capacity y").unwrap(),
        2_000,
    )
    .await;
    wait_until("d to hold its take of y open", async || {
        d.log_text().contains("failpoint take-delay-ms")
    })
    .await;
    a.signal("-TERM");
    a.wait_exit(Duration::from_secs(30)).expect("a exits");
    wait_until("d to own y", async || {
        get(&client, y)
            .await
            .generation
            .unwrap()
            .lease
            .is_some_and(|l| l.owner == d_id && l.epoch > 0)
    })
    .await;
    let owner = |g: pb::GetResponse| g.generation.unwrap().lease.map(|l| l.owner);
    let (ox, oy) = (owner(get(&client, x).await), owner(get(&client, y).await));
    assert!(
        !(ox.as_deref() == Some(d_id.as_str()) && oy.as_deref() == Some(d_id.as_str())),
        "d, of capacity 1, owns x and y:\n{}",
        d.log_text()
    );
}

/// A source that records its release late still learns that its handoff moved the generation,
/// though the new owner has handed it on meanwhile. a hands x to b and holds its release
/// (failpoint `release-delay-ms`); b is stopped and hands x on to c. The log holds only the
/// latest attempt of a generation, and a's release of the first was refused as not current.
/// Before, a then read that attempt's phase, found the log's attempt was another, and took its
/// committed handoff for an aborted one: it recorded "aborted", counted the generation as kept
/// ("handoff did not happen") and, had its state been left, decoded on until the fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_slow_to_release_learns_its_handoff_moved_though_the_new_owner_handed_it_on() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    let flags = fake_handoff_flags("1");
    let mut a = cluster.start_decoder_env(
        "slow-rel-a",
        &flags,
        &[("TOKENLOG_FAILPOINTS", "release-delay-ms=8000")],
    );
    common::wait_for_model(&client).await;
    let x = submit(
        &client,
        &m,
        "slow-rel-x",
        &m.tokenizer().encode("slow release").unwrap(),
        5_000,
    )
    .await;
    wait_owned(&client, x, &a.id).await;
    let mut b = cluster.start_decoder("slow-rel-b", &flags);
    let b_id = b.id.clone();
    wait_until("b to take handoffs", async || takes_handoffs(&client, &b_id).await).await;
    a.signal("-TERM");
    wait_until("a to hold its release", async || {
        a.log_text().contains("failpoint release-delay-ms")
    })
    .await;
    let c = cluster.start_decoder("slow-rel-c", &flags);
    let c_id = c.id.clone();
    wait_until("c to take handoffs", async || takes_handoffs(&client, &c_id).await).await;
    b.signal("-TERM");
    wait_until("b to hand x on to c", async || {
        get(&client, x).await.handoff.is_some_and(|h| {
            (h.source.as_str(), h.destination.as_str(), h.phase)
                == (b_id.as_str(), c_id.as_str(), pb::HandoffPhase::SourceReleased as i32)
        })
    })
    .await;
    assert!(
        !a.log_text().contains("generation handed over"),
        "a released before b handed x on: the case is not made\n{}",
        a.log_text()
    );
    let status = a.wait_exit(Duration::from_secs(40)).expect("a exits");
    let a_log = a.log_text();
    assert!(status.success(), "{a_log}");
    assert!(!a_log.contains("handoff did not happen"), "{a_log}");
    assert_eq!(a_log.matches("generation handed over").count(), 2, "{a_log}");
    b.wait_exit(Duration::from_secs(30)).expect("b exits");
}

/// A take from the log holds only the slots of what it takes: a transfer that arrives while the
/// destination takes one generation finds its other slot free. The destination has capacity 2
/// and takes y from the log (failpoint `take-delay-ms` holds the take open) while a is drained
/// towards it. Before, the worker claimed every free slot before it asked the log what was
/// waiting and kept them until the take ended: the transfer of x was refused ("this decoder is
/// full") and its attempt aborted, though one slot stayed empty. The same claim, held for the
/// query's round trip by a destination that found nothing to take, aborted a handoff of the
/// real-model drain test in CI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_arriving_while_the_destination_takes_one_generation_finds_its_other_slot_free() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    let flags = |capacity| [&fake_handoff_flags(capacity)[..], &["--drain-ms", "20000"]].concat();
    let mut a = cluster.start_decoder("free-a", &flags("1"));
    common::wait_for_model(&client).await;
    let x = submit(&client, &m, "free-x", &m.tokenizer().encode("free x").unwrap(), 2_000).await;
    wait_owned(&client, x, &a.id).await;
    let d = cluster.start_decoder_env("free-d", &flags("2"), &[("TOKENLOG_FAILPOINTS", "take-delay-ms=5000")]);
    let d_id = d.id.clone();
    wait_until("d to register", async || takes_handoffs(&client, &d_id).await).await;
    let y = submit(&client, &m, "free-y", &m.tokenizer().encode("free y").unwrap(), 2_000).await;
    wait_until("d to hold its take of y open", async || {
        d.log_text().contains("failpoint take-delay-ms")
    })
    .await;
    a.signal("-TERM");
    a.wait_exit(Duration::from_secs(30)).expect("a exits");
    let x_now = get(&client, x).await;
    let h = x_now.handoff.expect("x's attempt is in the log");
    assert_eq!(
        (h.phase, h.destination.as_str()),
        (pb::HandoffPhase::SourceReleased as i32, d_id.as_str()),
        "{h:?}\n{}",
        d.log_text()
    );
    wait_until("d to own x and y", async || {
        for g in [x, y] {
            let lease = get(&client, g).await.generation.unwrap().lease;
            if lease.is_none_or(|l| l.owner != d_id) {
                return false;
            }
        }
        true
    })
    .await;
    assert_eq!(
        d.log_text().matches("generation received with its cache").count(),
        1,
        "{}",
        d.log_text()
    );
}

/// A drain tries a generation again when its destination was full: the generation moves with
/// its cache once a slot frees there, before the drain's time is up. a (capacity 1) holds x;
/// b (capacity 1) holds y, which ends a few seconds after a is stopped. Before, the refusal kept
/// x for good: the drain ended at once, a released x, and b took it from the log with a
/// re-prefill once y ended (its attempt: `Aborted`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_hands_a_generation_over_once_its_full_destination_frees_a_slot() {
    let _serial = serial();
    let cluster = Cluster::start(20_000);
    let client = cluster.client();
    let m = fake();
    let flags = [&fake_handoff_flags("1")[..], &["--drain-ms", "20000"]].concat();
    let mut a = cluster.start_decoder("retry-a", &flags);
    common::wait_for_model(&client).await;
    let x = submit(&client, &m, "retry-x", &m.tokenizer().encode("retry x").unwrap(), 2_000).await;
    wait_owned(&client, x, &a.id).await;
    let b = cluster.start_decoder("retry-b", &flags);
    let b_id = b.id.clone();
    wait_until("b to take handoffs", async || takes_handoffs(&client, &b_id).await).await;
    // About 3 s of steps left once b holds it.
    let y = submit(&client, &m, "retry-y", &m.tokenizer().encode("retry y").unwrap(), 130).await;
    wait_owned(&client, y, &b_id).await;
    a.signal("-TERM");
    let status = a.wait_exit(Duration::from_secs(30)).expect("a exits");
    let a_log = a.log_text();
    assert!(status.success(), "{a_log}");
    assert!(
        a_log.contains("handoff did not happen"),
        "b was never found full: the case is not made\n{a_log}"
    );
    let h = get(&client, x).await.handoff.expect("x's attempt is in the log");
    assert_eq!(
        (h.phase, h.source.as_str(), h.destination.as_str()),
        (pb::HandoffPhase::SourceReleased as i32, a.id.as_str(), b_id.as_str()),
        "{h:?}\n{a_log}"
    );
    assert_eq!(a_log.matches("generation handed over").count(), 2, "{a_log}");
}
