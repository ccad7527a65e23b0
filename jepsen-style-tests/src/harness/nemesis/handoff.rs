//! The nemeses of planned handoff and hot standby (issue 15): `drain`, `handoff` and
//! `standby-kill`. A drained decoder exits on its own with status 0 (an expected exit); one
//! that has not exited [`DRAIN_EXIT_WITHIN`] after SIGTERM is killed, and the record says so
//! ([`DRAIN_HUNG`]), which the `processes` checker reports.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::Rng;
use tokenlog_proto::raftlog as pb;

use super::super::{DRAIN_MS, FAILPOINTS_ENV, FAILPOINT_EXIT};
use super::{history_tail, ms, Procs};

/// How long a drained decoder may take to exit: its drain, then releasing what is left.
pub const DRAIN_EXIT_WITHIN: Duration = Duration::from_millis(DRAIN_MS + 7_000);

/// Marks a `drain` or `handoff` record whose drained decoder did not exit in time.
pub const DRAIN_HUNG: &str = "[drain did not end]";

/// The destination's failpoints a `handoff` draws from (failure points 2-5).
const DESTINATION_FAILPOINTS: [&str; 4] = [
    "handoff-exit=destination-before-ready",
    "handoff-exit=destination-after-ready",
    "commit-answer-lost=1",
    "handoff-exit=destination-after-commit",
];

/// Generations looked at (the latest the decoders acquired) to find one with a standby.
const STANDBY_PROBES: usize = 32;

/// The decoders that take handoffs; at least two (one to drain, one to take its work).
fn listeners(procs: &Mutex<Procs>) -> anyhow::Result<usize> {
    let n = procs.lock().expect("lock").handoff_listeners;
    anyhow::ensure!(
        n >= 2,
        "a handoff nemesis needs two decoders that take handoffs (handoff_listeners)"
    );
    Ok(n)
}

/// `drain`: a decoder that takes handoffs is drained (SIGTERM) and restarted after.
pub(super) async fn drain(procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let i = rng.random_range(0..listeners(procs)?);
    let target = drain_one(procs, i).await;
    tokio::time::sleep(ms(rng, 200, 1000)).await;
    procs.lock().expect("lock").decoders[i].start()?;
    Ok(target)
}

/// `handoff`: decoder `dst` is restarted with a destination's failpoint, then another drains
/// (into it, or into another decoder that takes handoffs); both run again after.
pub(super) async fn failing_handoff(procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let n = listeners(procs)?;
    let src = rng.random_range(0..n);
    let dst = (src + 1 + rng.random_range(0..n - 1)) % n;
    let fp = DESTINATION_FAILPOINTS[rng.random_range(0..DESTINATION_FAILPOINTS.len())];
    let fired = |p: &Procs| p.decoders[dst].log_text().matches("failpoint fired").count();
    let (dst_name, before) = {
        let mut p = procs.lock().expect("lock");
        let before = fired(&p);
        p.decoders[dst].start_failing(&[(FAILPOINTS_ENV, fp)], FAILPOINT_EXIT)?;
        (p.decoders[dst].name.clone(), before)
    };
    let registered = wait_listener(procs, dst).await;
    let drained = drain_one(procs, src).await;
    tokio::time::sleep(ms(rng, 200, 1000)).await;
    let mut p = procs.lock().expect("lock");
    let hit = fired(&p) > before;
    p.decoders[src].start()?;
    // Up again if its failpoint ended it; a no-op otherwise.
    p.decoders[dst].start()?;
    Ok(format!(
        "{drained}; destination {dst_name} with {fp}: {}{}",
        if hit {
            "fired"
        } else {
            "did not fire (no handoff reached it)"
        },
        if registered {
            ""
        } else {
            " (its listener was not registered in time)"
        }
    ))
}

/// `standby-kill`: the owner of a generation with a hot standby is killed (SIGKILL) and
/// restarted after 0.2-1.5 s; any decoder when no generation has a standby.
pub(super) async fn standby_kill(procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let n = procs.lock().expect("lock").decoders.len();
    let (i, why) = match followed_owner(procs).await {
        Some((i, gen, standby)) => (i, format!("owner of generation {gen}, followed by {standby}")),
        None => (rng.random_range(0..n), "no generation had a live standby".to_string()),
    };
    let name = {
        let mut p = procs.lock().expect("lock");
        p.decoders[i].kill9();
        p.decoders[i].name.clone()
    };
    tokio::time::sleep(ms(rng, 200, 1500)).await;
    procs.lock().expect("lock").decoders[i].start()?;
    Ok(format!("{name} ({why})"))
}

/// SIGTERM to decoder `i`; waits for it to exit. The record's text.
async fn drain_one(procs: &Mutex<Procs>, i: usize) -> String {
    let name = {
        let mut p = procs.lock().expect("lock");
        if p.decoders[i].pid().is_none() {
            return format!("{}: not running", p.decoders[i].name);
        }
        p.decoders[i].terminate();
        p.decoders[i].name.clone()
    };
    let t0 = Instant::now();
    loop {
        {
            let mut p = procs.lock().expect("lock");
            if let Some(st) = p.decoders[i].exited() {
                return format!("{name}: drained, exited in {} ms ({st})", t0.elapsed().as_millis());
            }
            if t0.elapsed() > DRAIN_EXIT_WITHIN {
                p.decoders[i].kill9();
                return format!("{name}: {DRAIN_HUNG} {} ms after SIGTERM", t0.elapsed().as_millis());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (up to 15 s) until decoder `i`'s running incarnation registered its handoff listener.
async fn wait_listener(procs: &Mutex<Procs>, i: usize) -> bool {
    let (log, id) = {
        let p = procs.lock().expect("lock");
        (p.log.clone(), format!("d{}-{}", i + 1, p.decoders[i].incarnation))
    };
    match log {
        Some(log) => wait_takes_handoffs(&log, &id, Duration::from_secs(15)).await,
        None => false,
    }
}

/// Waits (up to `within`) until `decoder` is registered with a handoff listener; whether it is.
pub async fn wait_takes_handoffs(log: &tokenlog_raftlog::client::LogClient, decoder: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        let listed = log
            .list_models()
            .await
            .is_ok_and(|m| m.models.iter().any(|m| m.handoff_addrs.contains_key(decoder)));
        if listed {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A running generation with a standby, among the latest the decoders acquired: its owner's
/// decoder index, the generation and the standby.
async fn followed_owner(procs: &Mutex<Procs>) -> Option<(usize, u64, String)> {
    let (log, dir, n) = {
        let p = procs.lock().expect("lock");
        (p.log.clone()?, p.dir.clone(), p.decoders.len())
    };
    let mut gens: Vec<u64> = (0..n)
        .flat_map(|i| acquired(&dir.join(format!("decoder{}.jsonl", i + 1))))
        .collect();
    gens.sort_unstable();
    gens.dedup();
    for &gen in gens.iter().rev().take(STANDBY_PROBES) {
        let Ok(r) = log
            .get(pb::GetRequest {
                generation_id: gen,
                linearizable: false,
                ..Default::default()
            })
            .await
        else {
            continue;
        };
        let Some(g) = r.generation.filter(|g| g.state == pb::GenerationState::Running as i32) else {
            continue;
        };
        let owner = g.lease.map(|l| l.owner).unwrap_or_default();
        // Decoder ids are `d<i>-<incarnation>`.
        let i = owner
            .strip_prefix('d')
            .and_then(|s| s.split('-').next())
            .and_then(|s| s.parse::<usize>().ok())
            .filter(|&i| (1..=n).contains(&i));
        if let (Some(i), false) = (i, r.standby.is_empty()) {
            return Some((i - 1, gen, r.standby));
        }
    }
    None
}

/// The generations of the acquires in the tail of a decoder's history.
fn acquired(history: &std::path::Path) -> Vec<u64> {
    let Some(tail) = history_tail(history, 16_384) else {
        return Vec::new();
    };
    tail.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["phase"] == "invoke" && v["op"] == "acquire")
        .filter_map(|v| v["gen"].as_u64())
        .collect()
}
