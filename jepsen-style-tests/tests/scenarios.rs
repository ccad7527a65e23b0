//! The deterministic scenario of every failure point of CONTRACT §8 that exists in the code
//! (7-12, and 15: a pipeline's stage dies, is paused, its head dies), each on a fresh real
//! cluster, run one after another (they share the 2 cores badly).
//! Each must pass every checker and its own expectations; see `harness::scenario`.

use std::path::PathBuf;

use jepsen_style_tests::harness::{self, scenario, scenario::Scenario, Plant};

fn bin() -> PathBuf {
    // target/<profile>/deps/scenarios-<hash> -> target/<profile>/tokenlog
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("tokenlog")
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
            let why: Vec<String> = r
                .expectations
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
                .collect();
            failed.push(format!("{} ({}): {why:?}", sc.name(), out.display()));
        }
    }
    assert_eq!(points.into_iter().collect::<Vec<_>>(), vec![7, 8, 9, 10, 12, 15]);
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
