//! The deterministic simulation in CI (issue 13): a thousand seeds of the real state machine
//! under seeded faults with no violation, every seed replayable bit for bit, and each planted
//! bug caught within a bounded number of seeds by the checker made for it.

use jepsen_style_tests::sim::{self, SimConfig, SimCounts, SimPlant};

const TIME_MS: u64 = 6_000;

#[test]
fn a_thousand_seeds_show_no_violation_and_the_faults_bite() {
    let mut total = SimCounts::default();
    let mut bad = Vec::new();
    sim::run_seeds(1, 1_000, TIME_MS, None, |o| {
        total.add(&o.counts);
        if !o.ok() {
            bad.push(format!("seed {}: {}", o.seed, o.first_violation().unwrap_or_default()));
        }
    });
    assert!(bad.is_empty(), "{} violations: {bad:?}", bad.len());
    eprintln!("1000 seeds: {total:?}");
    for (what, n) in [
        ("crashes", total.crashes),
        ("unsynced entries lost", total.lost_unsynced),
        ("disks lost", total.disks_lost),
        ("partitions", total.partitions),
        ("leader changes", total.leader_changes),
        ("takeovers", total.takeovers),
        ("decoder pauses", total.decoder_pauses),
        ("clock jumps", total.clock_jumps),
        ("decoder stops (releases)", total.decoder_releases),
        ("generations pruned", total.pruned),
        ("duplicated requests", total.duplicates),
        ("delayed requests", total.delayed),
        ("indeterminate ops", total.indeterminate_ops),
    ] {
        assert!(n > 0, "the faults never drew {what}: {total:?}");
    }
}

#[test]
fn a_seed_replays_bit_for_bit_a_failing_one_too() {
    let (failing, _) = first_caught(SimPlant::NoFence, 50, &["fencing", "linearizability"]);
    for (seed, plant) in [(5, None), (failing, Some(SimPlant::NoFence))] {
        let cfg = SimConfig {
            seed,
            time_ms: TIME_MS,
            plant,
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
    for seed in 1..=within {
        let o = sim::run(&SimConfig {
            seed,
            time_ms: TIME_MS,
            plant: Some(plant),
        });
        if let Some((name, v)) = o.verdicts.iter().find(|(k, v)| !v.ok && checkers.contains(&k.as_str())) {
            return (
                seed,
                format!("{name}: {}", v.problems.first().cloned().unwrap_or_default()),
            );
        }
    }
    panic!("{plant:?} was never caught by {checkers:?} in {within} seeds");
}

// Seeds needed (measured: `jepsen-style-tests sim --seeds 100 --plant P`; the seed where the
// targeted checker first flags it, as these tests find): no-fence 71 of 100 seeds flagged, by
// fencing first at seed 6; ack-before-fsync 1 of 100 (seed 91); early-visibility 10 of 100
// (seed 2); snapshot-lag 3 of 100 (seed 41); unbounded-clock 34 of 100 (seed 2). The bounds
// leave room.

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
