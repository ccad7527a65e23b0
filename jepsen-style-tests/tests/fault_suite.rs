//! The short fault suite that CI runs: seeded runs of a real cluster under every nemesis must
//! show no violation (and must have bitten: takeovers, resumes, faults), and each planted bug
//! must be caught by the checker made for it (no epoch fence: fencing and linearizability;
//! ack before fsync: durability; early visibility: exactly-once; an unbounded leader clock:
//! lease-time; a decoder outliving its failed model: processes; a replica whose state differs:
//! convergence; an ownerless generation that never ends: liveness).

use std::path::PathBuf;
use std::time::Duration;

use jepsen_style_tests::harness::{self, Fault, Plant, RunConfig};

fn bin() -> PathBuf {
    // target/<profile>/deps/fault_suite-<hash> -> target/<profile>/tokenlog
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("tokenlog")
}

/// Reports stay under the temp dir (`tokenlog-fault-suite/TEST/seed-N`) for a look after a
/// failure. The test's name keeps two tests of one seed, running at once, out of each other's
/// histories.
fn config(seed: u64) -> RunConfig {
    let test = std::thread::current().name().unwrap_or("test").replace("::", "-");
    let out = std::env::temp_dir()
        .join("tokenlog-fault-suite")
        .join(test)
        .join(format!("seed-{seed}"));
    let _ = std::fs::remove_dir_all(&out);
    let mut cfg = RunConfig::new(bin(), out, seed);
    cfg.time = Duration::from_secs(15);
    cfg.clients = 6;
    cfg
}

/// Runs `seeds` one after another, each configured by `setup`, until `caught` says a checker
/// flagged the planted bug; that run's summary.
async fn first_caught(
    seeds: &[u64],
    setup: impl Fn(&mut RunConfig),
    caught: impl Fn(&harness::RunSummary) -> bool,
) -> Option<harness::RunSummary> {
    for &seed in seeds {
        let mut cfg = config(seed);
        setup(&mut cfg);
        let s = harness::run(&cfg).await.unwrap();
        eprintln!("{}", harness::summary_line(&s));
        if caught(&s) {
            return Some(s);
        }
    }
    None
}

/// Asserts that `checker` failed with a problem that says `what`.
fn assert_flagged(s: &harness::RunSummary, checker: &str, what: &str) {
    let v = &s.verdicts[checker];
    assert!(
        v.problems.iter().any(|p| p.contains(what)),
        "{checker}: {:?}",
        v.problems
    );
}

/// Only the `decoders-down` nemesis, with a lease and an unowned deadline short enough that it
/// keeps every decoder away past both, and generations long enough to be running then.
fn decoders_down(cfg: &mut RunConfig) {
    cfg.time = Duration::from_secs(12);
    cfg.faults = vec![Fault::DecodersDown];
    cfg.lease_ms = 500;
    cfg.unowned_ms = 1_500;
    cfg.max_tokens = (150, 300);
}

/// Runs `cfg`, asserts that every checker passed, and returns the summary and the run's
/// history (JSON lines).
async fn run_clean(cfg: &RunConfig) -> (harness::RunSummary, String) {
    let s = harness::run(cfg).await.unwrap();
    eprintln!("{}", harness::summary_line(&s));
    for (name, v) in &s.verdicts {
        assert!(
            v.ok,
            "seed {}: {name} failed: {:?} (report in {})",
            cfg.seed,
            v.problems,
            cfg.out.display()
        );
    }
    (s, std::fs::read_to_string(cfg.out.join("history.jsonl")).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_runs_with_every_nemesis_show_no_violation() {
    let mut hard = harness::HardPaths::default();
    for seed in [11, 12] {
        let mut cfg = config(seed);
        if seed == 12 {
            // A stress configuration drawn from the seed: frequent snapshots (kills, restarts
            // and wipes meet snapshot builds, installs and restarts from a snapshot all through
            // the run), a short retention (pruning while clients read) and another lease.
            eprintln!("seed {seed}: {}", cfg.stress());
        }
        let (s, _) = run_clean(&cfg).await;
        assert!(
            s.faults.values().sum::<u64>() >= 4,
            "seed {seed}: the nemesis ran: {:?}",
            s.faults
        );
        assert!(s.resumes > 0, "seed {seed}: clients resumed");
        assert!(s.takeovers > 0, "seed {seed}: decoders took over");
        assert!(s.requests > 0 && s.tokens_seen > 0);
        for (name, v) in &s.verdicts {
            assert!(v.checked > 0, "seed {seed}: {name} checked nothing");
        }
        let h = &s.hard_paths;
        hard.indeterminate_ops += h.indeterminate_ops;
        hard.multi_token_appends += h.multi_token_appends;
        hard.overlapping_resends += h.overlapping_resends;
        hard.cancels += h.cancels;
        hard.eos_endings += h.eos_endings;
    }
    // The runs reached the hard paths (issue 12 item 6), the two seeds together.
    assert!(hard.zero().is_empty(), "never reached: {:?} ({hard:?})", hard.zero());
}

/// Issue 16's nemeses: decoder 1 is a pipeline head over 3 stage processes (the real model;
/// 3 cold spares in the log), the other a whole decoder; stages the pipeline uses are killed
/// and paused, the head is killed, log nodes are killed. Every checker passes, and the head
/// spliced spares in (its generations stayed with it through the stage faults).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_run_under_stage_and_head_nemeses_shows_no_violation() {
    let mut cfg = config(31);
    cfg.real_model = true;
    cfg.pipeline = true;
    cfg.clients = 4;
    // Long enough that the head holds generations when it is killed (lease-time judges the
    // takeovers that follow): with 8-24 tokens a CI run once found the head idle at both of
    // its kills (0 takeovers; here 5-6 in four runs of either range).
    cfg.max_tokens = (24, 64);
    cfg.time = Duration::from_secs(20);
    cfg.faults = vec![Fault::KillStage, Fault::PauseStage, Fault::KillHead, Fault::KillNode];
    let (s, _) = run_clean(&cfg).await;
    for f in ["kill-stage", "pause-stage", "kill-head"] {
        assert!(s.faults.get(f).is_some_and(|&n| n > 0), "{f} ran: {:?}", s.faults);
    }
    assert!(s.requests > 0 && s.tokens_seen > 0);
    // lease-time judges the takeovers that follow the head's kills: each kill aims at an append
    // in flight (twice CI found the head idle at both kills when they did not aim).
    for (name, v) in &s.verdicts {
        assert!(v.checked > 0, "{name} checked nothing");
    }
    let head = std::fs::read_to_string(cfg.out.join("decoder1.log")).unwrap();
    assert!(
        head.contains("spliced a spare in its place"),
        "the head spliced a spare in (report in {})",
        cfg.out.display()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_missing_epoch_fence_is_caught() {
    // Whether the continued stale owner's write lands past a newer owner's records (and not
    // only at its frontier, or not at all before its generation moved on) depends on timing:
    // runs seen here flagged it in both checkers, in one, or (a loaded CI machine) in neither.
    // A seed counts when both checkers flag it; up to six seeds are tried.
    let s = first_caught(
        &[21, 22, 23, 24, 25, 26],
        |cfg| {
            cfg.faults = vec![Fault::PauseDecoder];
            cfg.clients = 8;
            cfg.plant = Some(Plant::NoFence);
        },
        |s| !s.verdicts["fencing"].ok && !s.verdicts["linearizability"].ok,
    )
    .await
    .expect("a paused decoder writing without the fence was never flagged by both checkers in 6 seeds");
    // The bug is in fencing; the checks of what clients saw may still pass (the fake model's
    // stale writer produces the same tokens), which is why the fencing checkers exist. Both
    // must see it: a stale write accepted past the frontier puts an older epoch after a newer
    // one (fencing) and is an append the model refuses (linearizability).
    assert!(
        !s.verdicts["fencing"].ok && !s.verdicts["linearizability"].ok,
        "{:?}",
        s.verdicts
    );
}

/// Issue 15's nemeses: 3 decoders that take handoffs and stand by for each other's
/// generations; decoders are drained (SIGTERM: their generations move with their caches),
/// handoffs fail at a destination's failure point (2-5), owners with a hot standby are killed,
/// and a log node is killed. Every checker passes (the handoff commits are grants in the
/// fencing and linearizability models), and each mechanism was used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_under_drain_handoff_and_standby_kill_nemeses_shows_no_violation() {
    // The faults are drawn at random: seeds run until each of the three has (all clean).
    let mut ran: std::collections::BTreeMap<String, u64> = Default::default();
    let (mut received, mut commits) = (0, 0);
    for seed in [51, 52, 53] {
        let mut cfg = config(seed);
        handoff_run(&mut cfg);
        cfg.faults = [Fault::HANDOFF.as_slice(), &[Fault::KillNode]].concat();
        let (s, history) = run_clean(&cfg).await;
        // (lease-time judges takeovers, which a seed of drains and node kills may not have)
        for (name, v) in s.verdicts.iter().filter(|(k, _)| *k != "lease-time") {
            assert!(v.checked > 0, "seed {seed}: {name} checked nothing");
        }
        for (f, n) in &s.faults {
            *ran.entry(f.clone()).or_default() += n;
        }
        let logs: String = (1..=cfg.decoders)
            .map(|i| std::fs::read_to_string(cfg.out.join(format!("decoder{i}.log"))).unwrap_or_default())
            .collect();
        received += logs.matches("generation received with its cache").count();
        commits += history.matches("\"op\":\"handoff_commit\"").count();
        let standby = logs.matches("taken over from the hot standby's state").count();
        eprintln!("seed {seed}: {received} generations received with their caches so far, {standby} standby takeovers");
        if ["drain", "handoff", "standby-kill"]
            .iter()
            .all(|f| ran.contains_key(*f))
        {
            break;
        }
    }
    for f in ["drain", "handoff", "standby-kill"] {
        assert!(ran.get(f).is_some_and(|&n| n > 0), "{f} ran in 3 seeds: {ran:?}");
    }
    assert!(received > 0 && commits > 0, "no generation moved with its cache");
}

/// Three decoders, each taking handoffs and standing by for up to 4 generations of the others.
fn handoff_run(cfg: &mut RunConfig) {
    cfg.decoders = 3;
    cfg.handoff_listeners = 3;
    cfg.standby = 4;
    cfg.time = Duration::from_secs(20);
    cfg.max_tokens = (60, 160);
}

/// A hot standby that appends at its dead owner's epoch without acquiring the generation is
/// caught by `fencing` (an append at an epoch never granted to it), whatever the log answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_standby_writing_without_an_epoch_is_caught_by_fencing() {
    let s = first_caught(
        &[61, 62, 63],
        |cfg| {
            handoff_run(cfg);
            cfg.time = Duration::from_secs(12);
            cfg.faults = vec![Fault::StandbyKill];
            cfg.plant = Some(Plant::StandbyEarlyWrite);
        },
        |s| !s.verdicts["fencing"].ok,
    )
    .await
    .expect("a standby writing without an epoch was never flagged in 3 seeds");
    assert_flagged(&s, "fencing", "before it was granted that epoch");
}

/// Partitions need network namespaces (root, iproute2, iptables: what `deploy/install-deps.sh`
/// sets up and CI has): each node in its own namespace, partitions cut with iptables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_between_nodes_in_network_namespaces_show_no_violation() {
    assert!(
        harness::net::available(),
        "network namespaces are not available here (needs root, iproute2, iptables)"
    );
    // Faults are drawn uniformly from the list, so partitions dominate; a seed that drew none
    // (about 1 in 100) is followed by the next seed.
    let mut partitions = 0;
    for seed in [31, 32, 33] {
        let mut cfg = config(seed);
        cfg.netns = true;
        cfg.faults = vec![
            Fault::Partition,
            Fault::Partition,
            Fault::Partition,
            Fault::KillNode,
            Fault::PauseDecoder,
        ];
        let s = harness::run(&cfg).await.unwrap();
        eprintln!("{}", harness::summary_line(&s));
        for (name, v) in &s.verdicts {
            assert!(
                v.ok,
                "{name} failed: {:?} (report in {})",
                v.problems,
                cfg.out.display()
            );
        }
        partitions = s.faults.get("partition").copied().unwrap_or(0);
        if partitions > 0 {
            break;
        }
    }
    assert!(partitions >= 1, "no partition in 3 seeds");
}

/// A planted ack-before-fsync bug (acknowledged appends still in process memory when every node
/// is killed at once) must be caught by the durability checker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_ack_before_fsync_is_caught_by_durability() {
    let s = first_caught(
        &[41, 42, 43],
        |cfg| {
            cfg.faults = vec![Fault::RestartAll];
            cfg.plant = Some(Plant::AckBeforeFsync);
        },
        |s| !s.verdicts["durability"].ok,
    )
    .await
    .expect("tokens lost with the unsynced WAL were never flagged in 3 seeds");
    assert!(!s.verdicts["durability"].ok);
}

/// A planted visibility bug (Watch shows proposed, uncommitted records) must be caught by the
/// exactly-once checker: clients saw records the log never committed as shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_visibility_before_commit_is_caught_by_exactly_once() {
    let s = first_caught(
        // Caught by chance (records lost with a killed leader, rewritten at a new epoch): in 3
        // seeds it went uncaught in 1 of 4 clean-clone CI runs, so it got 6; in 6 it went
        // uncaught in the clean-clone CI of 8b9b913 (2026-12-04: 0-4 leader changes per seed),
        // so it gets 10 (a caught seed ends the search: the usual cost is one or two seeds).
        &[51, 52, 53, 54, 55, 56, 57, 58, 59, 60],
        |cfg| {
            cfg.faults = vec![Fault::PauseDecoder, Fault::KillNode];
            cfg.clients = 8;
            // Records shown early differ from the final log only when they are lost with their
            // leader and a takeover rewrites their seqs at a new epoch: a short lease makes
            // that likely (the owner's renewal races the standby after an election).
            cfg.lease_ms = 300;
            // Long generations, none ending early: each is running through more leader kills.
            cfg.max_tokens = (100, 200);
            cfg.eos_share = 0.0;
            cfg.cancel_share = 0.0;
            cfg.plant = Some(Plant::EarlyVisibility);
        },
        |s| !s.verdicts["exactly-once"].ok,
    )
    .await
    .expect("tokens shown before commit were never flagged in 10 seeds");
    assert!(!s.verdicts["exactly-once"].ok);
}

/// Issue 11 bug 5, planted: the leader stamps log time with its wall clock as it is. The `clock`
/// nemesis jumps a node's wall clock by seconds; a live owner's lease is cut short, which the
/// lease-time checker must flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_unbounded_leader_clock_is_caught_by_lease_time() {
    let s = first_caught(
        &[61, 62, 63],
        |cfg| {
            cfg.faults = vec![Fault::Clock];
            cfg.plant = Some(Plant::UnboundedClock);
        },
        |s| !s.verdicts["lease-time"].ok,
    )
    .await
    .expect("leases cut short by a leader clock jump were never flagged in 3 seeds");
    assert!(!s.verdicts["lease-time"].ok);
}

/// Issue 11 bug 1, planted: a decoder whose model step fails keeps running and renewing its
/// leases. The `model-error` nemesis makes a decoder's model fail; the processes checker must
/// flag the decoder that did not exit (and liveness the generations it holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_zombie_decoder_is_caught_by_processes() {
    let s = first_caught(
        &[71, 72, 73],
        |cfg| {
            cfg.time = Duration::from_secs(10);
            cfg.faults = vec![Fault::ModelError];
            cfg.plant = Some(Plant::Zombie);
        },
        |s| !s.verdicts["processes"].ok,
    )
    .await
    .expect("a decoder outliving its failed model step was never flagged in 3 seeds");
    assert!(!s.verdicts["processes"].ok);
}

/// Issue 12, planted: decoder 1's step loop stops for ever after a few appends while its
/// renewer keeps its leases (a live process with a dead worker). Its stall watchdog must end
/// it (its leases lapse, the other decoder continues), and the processes checker flag the exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_stalled_worker_is_caught_by_processes() {
    let s = first_caught(
        &[75, 76, 77],
        |cfg| {
            cfg.time = Duration::from_secs(8);
            cfg.faults = vec![];
            cfg.stall_ms = 4_000;
            cfg.plant = Some(Plant::StalledWorker);
        },
        |s| !s.verdicts["processes"].ok,
    )
    .await
    .expect("a stalled worker was never flagged in 3 seeds");
    assert_flagged(&s, "processes", "decoder1 (incarnation 1) ended on its own");
    // The watchdog ended it, so its generations moved on: every request finished.
    assert!(s.verdicts["liveness"].ok, "{:?}", s.verdicts["liveness"].problems);
}

/// A planted diverging replica: node 3 applies decoder registrations 1 ms differently from the
/// other nodes. Every hash chain still agrees (the chain-head comparison alone passes); the
/// whole-state digest at one applied index must differ, and convergence must say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_diverging_replica_is_caught_by_convergence() {
    let s = first_caught(
        &[81, 82, 83],
        |cfg| {
            cfg.time = Duration::from_secs(4);
            cfg.faults = vec![];
            cfg.plant = Some(Plant::Diverge);
        },
        |s| !s.verdicts["convergence"].ok,
    )
    .await
    .expect("a replica whose state differs was never flagged in 3 seeds");
    assert_flagged(&s, "convergence", "state digests differ");
    for (name, v) in &s.verdicts {
        if name != "convergence" {
            assert!(v.ok, "only convergence sees the divergence; {name}: {:?}", v.problems);
        }
    }
}

/// Issue 11 bug 3, planted: Tick never fails a generation with records that nobody owns. The
/// `decoders-down` nemesis keeps every decoder away for longer than lease + unowned deadline;
/// a generation with records must then end FAILED within its deadline, and liveness flags the
/// ones that instead waited and continued when the decoders came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_missing_unowned_deadline_is_caught_by_liveness() {
    let s = first_caught(
        &[91, 92, 93],
        |cfg| {
            decoders_down(cfg);
            cfg.plant = Some(Plant::NoUnownedDeadline);
        },
        |s| !s.verdicts["liveness"].ok,
    )
    .await
    .expect("generations outliving their unowned deadline were never flagged in 3 seeds");
    assert_flagged(&s, "liveness", "outlived its unowned deadline");
}

/// The same run without the plant: generations with records fail explicitly when every decoder
/// stays away past their deadline (and only then), the rest continue: no violation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ownerless_generations_end_within_their_deadline() {
    let mut cfg = config(94);
    decoders_down(&mut cfg);
    let (_, history) = run_clean(&cfg).await;
    assert!(
        history.contains("generations with records must fail"),
        "seed 94 keeps every decoder away past the deadline at least once"
    );
}

/// A node whose disk fills (its data dir on a tmpfs squeezed to what it uses) fails a write,
/// and its Raft stops. Before the fix its process lived on and served from a state that no
/// longer advanced: a Watch that never moved, "not found" for generations every other node
/// held (this seed failed durability, exactly-once, linearizability, liveness and
/// convergence). Now the node exits with a clear error, is restarted once space is back, and
/// catches up: no violation. Needs root (mount).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_disk_fills_exits_and_catches_up() {
    let mut cfg = config(202);
    cfg.time = Duration::from_secs(20);
    cfg.faults = vec![Fault::DiskFull];
    eprintln!("seed 202: {}", cfg.stress());
    let (_, history) = run_clean(&cfg).await;
    assert!(
        history.contains("Raft stopped on its own"),
        "a node's disk filled up and it exited (needs root to mount a tmpfs)"
    );
}
