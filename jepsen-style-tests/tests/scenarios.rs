//! The deterministic scenario of every failure point of CONTRACT §8 that exists in the code
//! (1-6: a planned handoff; 7-12; 15: a pipeline's stage dies, is paused, its head dies), each
//! on a fresh real cluster, run one after another (they share the 2 cores badly).
//! Each must pass every checker and its own expectations; see `harness::scenario`.

use std::path::PathBuf;

use jepsen_style_tests::harness::{self, scenario, scenario::Scenario, Plant};

fn bin() -> PathBuf {
    // target/<profile>/deps/scenarios-<hash> -> target/<profile>/tokenlog
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("tokenlog")
}

/// What failed in a scenario: its expectations, then its checkers.
fn failures(r: &scenario::ScenarioReport) -> Vec<String> {
    r.expectations
        .iter()
        .filter(|e| !e.ok)
        .map(|e| format!("{}: {}", e.what, e.detail))
        .chain(
            r.summary
                .verdicts
                .iter()
                .filter(|(_, v)| !v.ok)
                .map(|(k, v)| format!("{k}: {:?}", v.problems)),
        )
        .collect()
}

/// The last warnings and errors of every process log of a failed scenario: CI keeps only the
/// test's output, not the scenario's directory.
fn print_warnings(out: &std::path::Path) {
    let Ok(dir) = std::fs::read_dir(out) else {
        return;
    };
    let mut logs: Vec<PathBuf> = dir
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    logs.sort();
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines = harness::procs::last_log_lines(&text, true, 12);
        if lines.is_empty() {
            continue;
        }
        eprintln!("--- {}: its last warnings and errors", log.display());
        for l in &lines {
            eprintln!("  {l}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_point_scenario_holds() {
    assert!(
        harness::net::available(),
        "network namespaces are not available here (needs root, iproute2, iptables)"
    );
    let root = std::env::temp_dir().join("tokenlog-scenarios");
    let mut failed = Vec::new();
    let mut points = std::collections::BTreeSet::new();
    for sc in Scenario::ALL {
        let out = root.join(sc.name());
        let _ = std::fs::remove_dir_all(&out);
        let r = scenario::run(bin(), out.clone(), sc, Default::default()).await.unwrap();
        eprintln!("{}", r.line());
        points.insert(r.point);
        if !r.ok {
            failed.push(format!("{} ({}): {:?}", sc.name(), out.display(), failures(&r)));
            print_warnings(&out);
        }
    }
    assert_eq!(
        points.into_iter().collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15]
    );
    assert!(failed.is_empty(), "failed scenarios: {failed:#?}");
}

/// The scenarios can fail: with the epoch fence switched off in the log nodes, the paused old
/// owner's late write is accepted, and the scenario says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_missing_fence_fails_the_paused_owner_scenario() {
    let sc = Scenario::PausedOwnerWritesAfterTakeover;
    let out = std::env::temp_dir().join("tokenlog-scenarios-planted").join(sc.name());
    let _ = std::fs::remove_dir_all(&out);
    let opts = scenario::Options {
        plant: Some(Plant::NoFence),
        ..Default::default()
    };
    let r = scenario::run(bin(), out, sc, opts).await.unwrap();
    eprintln!("{}", r.line());
    assert!(!r.ok, "the planted bug went unnoticed");
    let failed: Vec<&str> = r
        .expectations
        .iter()
        .filter(|e| !e.ok)
        .map(|e| e.what.as_str())
        .collect();
    assert!(
        failed.contains(&"the continued old owner wrote after the takeover and was rejected"),
        "{failed:?}"
    );
}

/// Runs `sc` with `plant`; the expectations and checkers that failed (the run must fail).
async fn planted(sc: Scenario, plant: Plant) -> (Vec<String>, Vec<(String, Vec<String>)>) {
    let out = std::env::temp_dir().join("tokenlog-scenarios-planted").join(sc.name());
    let _ = std::fs::remove_dir_all(&out);
    let opts = scenario::Options {
        plant: Some(plant),
        ..Default::default()
    };
    let r = scenario::run(bin(), out, sc, opts).await.unwrap();
    eprintln!("{}", r.line());
    assert!(!r.ok, "the planted bug went unnoticed");
    let expectations = r
        .expectations
        .iter()
        .filter(|e| !e.ok)
        .map(|e| e.what.clone())
        .collect();
    let verdicts = r
        .summary
        .verdicts
        .iter()
        .filter(|(_, v)| !v.ok)
        .map(|(k, v)| (k.clone(), v.problems.clone()))
        .collect();
    (expectations, verdicts)
}

/// A handoff source that frees its cache once exported, before the log released the
/// generation: when the attempt aborts (the destination dies after receiver-ready), the source
/// holds a generation without its cache, and its report says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_source_freeing_its_cache_early_fails_an_aborted_handoff() {
    let (failed, _) = planted(Scenario::DestinationDiesAfterReady, Plant::SourceFreesEarly).await;
    assert!(
        failed
            .iter()
            .any(|w| w.starts_with("the cache frontiers are the committed ones")),
        "{failed:?}"
    );
}

/// A handoff destination that decodes before the log committed its ownership: its appends at
/// the handoff epoch were sent before its grant, which `fencing` flags (the log refused them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_destination_writing_before_the_commit_fails_the_handoff_scenario() {
    let (_, verdicts) = planted(Scenario::CommitAnswerLost, Plant::EarlyHandoffWrite).await;
    assert!(
        verdicts
            .iter()
            .any(|(k, p)| k == "fencing" && p.iter().any(|p| p.contains("before it was granted that epoch"))),
        "{verdicts:?}"
    );
}

/// Failure points 1, 3 and 5 with SmolLM2 decoders (exact mode): the source dies while
/// copying, the destination after receiver-ready, the destination after the commit. Every
/// checker and expectation holds, the client's tokens are an uninterrupted run's included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_failure_points_1_3_and_5_hold_with_the_real_model() {
    let root = std::env::temp_dir().join("tokenlog-scenarios-real");
    let opts = scenario::Options {
        real_model: true,
        ..Default::default()
    };
    for sc in [
        Scenario::SourceDiesCopying,
        Scenario::DestinationDiesAfterReady,
        Scenario::DestinationDiesAfterCommit,
    ] {
        let out = root.join(sc.name());
        let _ = std::fs::remove_dir_all(&out);
        let r = scenario::run(bin(), out.clone(), sc, opts).await.unwrap();
        eprintln!("{}", r.line());
        assert!(r.ok, "{} ({}): {:#?}", sc.name(), out.display(), failures(&r));
    }
}

/// Watch showing proposed, uncommitted records: the leader cut off from both followers still
/// takes the owner's appends and (planted) shows them, then loses them; the owner's lease lapses
/// meanwhile, and the generation's next owner writes those seqs at its own epoch. The client
/// saw records that never committed, which `exactly-once` (and `durability`) flags. Under the
/// plant a waiting Watch polls the proposals; before it did, nothing woke it on a leader that
/// could not commit, and this scenario passed with the bug planted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_early_visibility_fails_the_leader_in_minority_scenario() {
    let (failed, verdicts) = planted(Scenario::LeaderInMinorityPartition, Plant::EarlyVisibility).await;
    eprintln!("expectations failed: {failed:?}\nverdicts failed: {verdicts:?}");
    assert!(verdicts.iter().any(|(k, _)| k == "exactly-once"), "{verdicts:?}");
}
