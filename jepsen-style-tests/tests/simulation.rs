//! The deterministic simulation in CI (issue 13): a thousand seeds of the real state machine
//! on the stand-in Raft and two hundred on the real openraft core, under seeded faults with no
//! violation, every seed replayable bit for bit, each planted bug caught within a bounded
//! number of seeds by the checker made for it, on both cores, and the divergence the openraft
//! core found (a restarted leader resuming its term) gone. And seeds with the real decoder
//! workers and log client over gRPC on the openraft core (`SimCore::Workers`): no violation,
//! replayable, a planted bug caught, and the seeds that found three bugs of the real code passing.

use jepsen_style_tests::sim::{self, SimConfig, SimCore, SimCounts, SimPlant};

const TIME_MS: u64 = 6_000;

/// Runs seeds 1..=n on `core`: none may show a violation, and every fault in `bites` (plus
/// those both cores draw) must have happened at least once.
fn no_violation_and_the_faults_bite(core: SimCore, n: u64, bites: impl Fn(&SimCounts) -> Vec<(&'static str, u64)>) {
    let mut total = SimCounts::default();
    let mut bad = Vec::new();
    sim::run_seeds(1, n, TIME_MS, None, core, |o| {
        total.add(&o.counts);
        if !o.ok() {
            bad.push(format!("seed {}: {}", o.seed, o.first_violation().unwrap_or_default()));
        }
    });
    assert!(bad.is_empty(), "{} violations: {bad:?}", bad.len());
    eprintln!("{n} seeds of {core:?}: {total:?}");
    let t = &total;
    let mut drawn = vec![
        ("crashes", t.crashes),
        ("unsynced entries lost", t.lost_unsynced),
        ("partitions", t.partitions),
        ("leader changes", t.leader_changes),
        ("takeovers", t.takeovers),
        ("decoder pauses", t.decoder_pauses),
        ("clock jumps", t.clock_jumps),
        ("decoder stops (releases)", t.decoder_releases),
        ("generations pruned", t.pruned),
        ("duplicated requests or messages", t.duplicates),
        ("delayed requests", t.delayed),
        ("watch reconnects", t.reconnects),
        ("indeterminate ops", t.indeterminate_ops),
    ];
    drawn.extend(bites(t));
    for (what, n) in drawn {
        assert!(n > 0, "the faults never drew {what}: {total:?}");
    }
}

#[test]
fn a_thousand_seeds_show_no_violation_and_the_faults_bite() {
    no_violation_and_the_faults_bite(SimCore::StandIn, 1_000, |t| vec![("disks lost", t.disks_lost)]);
}

#[test]
fn a_seed_replays_bit_for_bit_a_failing_one_too() {
    let (failing, _) = first_caught(SimPlant::NoFence, 50, &["fencing", "linearizability"]);
    for (seed, plant) in [(5, None), (failing, Some(SimPlant::NoFence))] {
        let cfg = SimConfig {
            seed,
            time_ms: TIME_MS,
            plant,
            core: SimCore::StandIn,
        };
        let (a, b) = (sim::run(&cfg), sim::run(&cfg));
        assert_eq!(a.history_hash, b.history_hash, "seed {seed}");
        assert_eq!(a.counts, b.counts);
        assert_eq!(a.first_violation(), b.first_violation());
        assert_eq!(a.ok(), plant.is_none(), "seed {seed}: {:?}", a.first_violation());
    }
}

/// Runs seeds 1.. with `plant` until one of `checkers` flags it; that seed and the problem.
fn first_caught(plant: SimPlant, within: u64, checkers: &[&str]) -> (u64, String) {
    first_caught_on(SimCore::StandIn, plant, within, checkers)
}

fn first_caught_on(core: SimCore, plant: SimPlant, within: u64, checkers: &[&str]) -> (u64, String) {
    for seed in 1..=within {
        let o = sim::run(&SimConfig {
            seed,
            time_ms: TIME_MS,
            plant: Some(plant),
            core,
        });
        if let Some((name, v)) = o.verdicts.iter().find(|(k, v)| !v.ok && checkers.contains(&k.as_str())) {
            return (
                seed,
                format!("{name}: {}", v.problems.first().cloned().unwrap_or_default()),
            );
        }
    }
    panic!("{plant:?} was never caught by {checkers:?} in {within} seeds of {core:?}");
}

// Seeds needed (measured: `jepsen-style-tests sim --seeds 100 --plant P`; seeds flagged of 100,
// and the first): no-fence 63 (seed 2), ack-before-fsync 3 (seed 36), early-visibility 15
// (seed 2), snapshot-lag 9 (seed 2), unbounded-clock 34 (seed 1). The bounds below leave room.

#[test]
fn planted_missing_fence_is_caught_by_fencing_or_linearizability() {
    let (seed, v) = first_caught(SimPlant::NoFence, 50, &["fencing", "linearizability"]);
    eprintln!("seed {seed}: {v}");
}

#[test]
fn planted_ack_before_fsync_is_caught() {
    // Acknowledged entries lost with a crash: seen as a lost acknowledged append
    // (durability), an answer the committed history cannot explain (linearizability), an
    // epoch granted twice (fencing) or replicas that differ (convergence).
    let (seed, v) = first_caught(
        SimPlant::AckBeforeFsync,
        300,
        &["durability", "linearizability", "fencing", "convergence"],
    );
    eprintln!("seed {seed}: {v}");
}

#[test]
fn planted_visibility_before_commit_is_caught_by_what_clients_saw() {
    let (seed, v) = first_caught(SimPlant::EarlyVisibility, 300, &["exactly-once", "durability"]);
    eprintln!("seed {seed}: {v}");
}

#[test]
fn planted_unbounded_leader_clock_is_caught_by_lease_time() {
    let (seed, v) = first_caught(SimPlant::UnboundedClock, 300, &["lease-time"]);
    eprintln!("seed {seed}: {v}");
}

#[test]
fn planted_snapshot_index_lag_is_caught_by_convergence() {
    let (seed, v) = first_caught(SimPlant::SnapshotLag, 300, &["convergence"]);
    eprintln!("seed {seed}: {v}");
}

// ------------------------------------------------------------------ the real openraft core

#[test]
fn two_hundred_openraft_seeds_show_no_violation_and_the_faults_bite() {
    no_violation_and_the_faults_bite(SimCore::Openraft, 200, |t| {
        vec![
            ("torn tails kept", t.torn_kept),
            ("disk write failures", t.write_failures),
            ("nodes stopped by a storage error", t.storage_exits),
        ]
    });
}

/// openraft restores a restarted leader in its old term by default; after a power cut that
/// cost the leader a tail its followers held, it wrote different entries under the same log
/// ids and the replicas diverged for ever. The plant `leader-restore` is that old
/// configuration: convergence must catch it, and the same seed must pass with the production
/// configuration (`enable_leader_restore: Some(false)`).
#[test]
fn a_restarted_leader_never_resumes_its_term() {
    let (seed, v) = first_caught_on(SimCore::Openraft, SimPlant::LeaderRestore, 300, &["convergence"]);
    eprintln!("leader restore: seed {seed}: {v}");
    let o = sim::run(&SimConfig {
        seed,
        time_ms: TIME_MS,
        plant: None,
        core: SimCore::Openraft,
    });
    assert!(
        o.ok(),
        "seed {seed} with the production configuration: {:?}",
        o.first_violation()
    );
}

#[test]
fn an_openraft_seed_replays_bit_for_bit_a_failing_one_too() {
    let (failing, _) = first_caught_on(SimCore::Openraft, SimPlant::NoFence, 30, &["fencing", "lease-time"]);
    for (seed, plant) in [(3, None), (failing, Some(SimPlant::NoFence))] {
        let cfg = SimConfig {
            seed,
            time_ms: TIME_MS,
            plant,
            core: SimCore::Openraft,
        };
        let (a, b) = (sim::run(&cfg), sim::run(&cfg));
        assert_eq!(a.history_hash, b.history_hash, "seed {seed}");
        assert_eq!(a.counts, b.counts);
        assert_eq!(a.ok(), plant.is_none(), "seed {seed}: {:?}", a.first_violation());
    }
}

// Planted bugs on the openraft core (measured: `jepsen-style-tests sim --core openraft --seeds
// 100 --plant P`; seeds flagged of 100, and the first): no-fence 91 (seed 2), ack-before-fsync
// 27 (seed 3), early-visibility 21 (seed 2), snapshot-lag 17 (seed 6), unbounded-clock 13 (seed
// 12); leader-restore 2 of 300 (seeds 6 and 231). The bounds leave room.

#[test]
fn openraft_planted_bugs_are_caught() {
    for (plant, checkers) in [
        (SimPlant::NoFence, &["fencing", "linearizability", "lease-time"][..]),
        (
            SimPlant::AckBeforeFsync,
            &["durability", "linearizability", "fencing", "convergence"][..],
        ),
        (SimPlant::EarlyVisibility, &["exactly-once", "durability"][..]),
        (SimPlant::SnapshotLag, &["convergence"][..]),
        (SimPlant::UnboundedClock, &["lease-time"][..]),
    ] {
        let (seed, v) = first_caught_on(SimCore::Openraft, plant, 60, checkers);
        eprintln!("{plant:?}: seed {seed}: {v}");
    }
}

// ------------------------------------------------------------------ the real decoder workers

/// Seeds 1..=n of the real workers: every fault of theirs drawn, no violation.
#[test]
fn worker_seeds_show_no_violation_and_the_faults_bite() {
    no_violation_and_the_faults_bite(SimCore::Workers, 60, |t| {
        vec![
            ("decoder crashes", t.decoder_crashes),
            ("connection resets", t.connection_resets),
        ]
    });
}

#[test]
fn a_worker_seed_replays_bit_for_bit() {
    let cfg = SimConfig {
        seed: 7,
        time_ms: TIME_MS,
        plant: None,
        core: SimCore::Workers,
    };
    let (a, b) = (sim::run(&cfg), sim::run(&cfg));
    assert_eq!(a.history_hash, b.history_hash);
    assert_eq!(a.counts, b.counts);
    assert!(a.ok(), "{:?}", a.first_violation());
    assert!(a.counts.tokens > 0, "{:?}", a.counts);
}

/// Seeds on which the real workers found bugs of the real code (each failed before its fix):
/// - 1: `LogClient` followed redirects between two nodes that named each other as leader
///   without a pause: it spun (for ever on simulated time, where nothing moves meanwhile);
/// - 13: the worker recorded one acquire for all the tries of the client's retry loop, while a
///   retry after the lease of a lost grant ran out is granted again at a newer epoch: the
///   history hid grants (linearizability);
/// - 32: a worker reopened an append stream at once, again and again, on a node whose Raft
///   had stopped (every append failed at once): it spun;
/// - 240: a restarted node's estimate of log time (a PendingWork before it had applied
///   anything) anchored its clock to its wall clock, 3.9 s ahead; as leader it then stamped log
///   time 3.2 s ahead, and retention pruned a generation before its client had read it
///   (durability). The clock's unit test `an_estimate_before_anything_is_applied_...` too.
///
/// Run on a thread of their own with a deadline, so that a spin fails the test instead of
/// hanging it.
#[test]
fn seeds_that_found_bugs_in_the_worker_and_client_pass() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for seed in [1, 13, 32, 240] {
            let o = sim::run(&SimConfig {
                seed,
                time_ms: TIME_MS,
                plant: None,
                core: SimCore::Workers,
            });
            let _ = tx.send((seed, o.first_violation()));
        }
    });
    for _ in 0..4 {
        let (seed, violation) = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("a seed did not finish within 120 s (a task spinning on simulated time?)");
        assert_eq!(violation, None, "seed {seed}");
    }
}

#[test]
fn worker_planted_missing_fence_is_caught() {
    let (seed, v) = first_caught_on(
        SimCore::Workers,
        SimPlant::NoFence,
        40,
        &["fencing", "linearizability", "lease-time", "exactly-once", "durability"],
    );
    eprintln!("no-fence with real workers: seed {seed}: {v}");
}
