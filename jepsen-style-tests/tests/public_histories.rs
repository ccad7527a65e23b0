//! Validates the checker against the public histories with known verdicts in
//! `shared/testdata/linearizability` (Porcupine's test data; see its README.md).
//!
//! The shared folder is `$TOKENLOG_SHARED` if set, else `shared/` next to the workspace, else
//! `shared/` inside it. A missing folder fails the test: it must not pass vacuously.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use jepsen_style_tests::checker::{check, DEFAULT_BUDGET};
use jepsen_style_tests::model::Model;
use jepsen_style_tests::models::{CasRegister, Kv};
use jepsen_style_tests::parse::{self, EventDecoder, ParseError, RawEvent};

const TESTDATA: &str = "testdata/linearizability";
/// Each history must be checked within this (release build).
const MAX_TIME_RELEASE: Duration = Duration::from_secs(1);
/// Unoptimised builds get more slack.
const MAX_TIME_DEBUG: Duration = Duration::from_secs(10);

fn testdata_dir() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let candidates: Vec<PathBuf> = match std::env::var_os("TOKENLOG_SHARED") {
        Some(shared) => vec![PathBuf::from(shared)],
        None => vec![manifest.join("../../shared"), manifest.join("../shared")],
    };
    for shared in &candidates {
        let dir = shared.join(TESTDATA);
        if dir.is_dir() {
            return dir;
        }
    }
    panic!(
        "linearizability test data not found: no {TESTDATA} under {candidates:?}; \
         set TOKENLOG_SHARED to the shared folder"
    );
}

/// `(file, expected verdict)` pairs of a folder's EXPECTED file.
fn expected(dir: &Path) -> Vec<(String, String)> {
    let path = dir.join("EXPECTED");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let pairs: Vec<_> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (file, verdict) = l.split_once(char::is_whitespace).expect("FILE VERDICT");
            (file.to_string(), verdict.trim().to_string())
        })
        .collect();
    assert!(!pairs.is_empty(), "{} lists no histories", path.display());
    pairs
}

fn verdict_of<M>(model: &M, events: &[RawEvent]) -> Result<&'static str, ParseError>
where
    M: Model + EventDecoder<Input = <M as Model>::Input, Output = <M as Model>::Output>,
{
    let ops = parse::operations(model, events)?;
    Ok(check(model, &ops, DEFAULT_BUDGET).verdict())
}

/// Checks every history of `folder`; returns the slowest time.
fn check_folder(folder: &str, verdict: impl Fn(&str) -> Result<&'static str, ParseError>) -> Duration {
    let dir = testdata_dir().join(folder);
    let limit = if cfg!(debug_assertions) {
        MAX_TIME_DEBUG
    } else {
        MAX_TIME_RELEASE
    };
    let (mut failures, mut slowest) = (Vec::new(), Duration::ZERO);
    for (file, want) in expected(&dir) {
        let text = std::fs::read_to_string(dir.join(&file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let start = Instant::now();
        let got = verdict(&text).unwrap_or_else(|e| panic!("{folder}/{file}: {e}"));
        let took = start.elapsed();
        slowest = slowest.max(took);
        println!("{folder}/{file}: {got} in {took:?}");
        if got != want {
            failures.push(format!("{file}: expected {want}, got {got}"));
        }
        if took > limit {
            failures.push(format!("{file}: took {took:?}, over {limit:?}"));
        }
    }
    assert!(failures.is_empty(), "{folder}:\n{}", failures.join("\n"));
    println!("{folder}: slowest {slowest:?}");
    slowest
}

#[test]
fn jepsen_etcd_histories() {
    check_folder("jepsen-etcd", |text| {
        verdict_of(&CasRegister, &parse::jepsen_log::parse(text)?)
    });
}

#[test]
fn kv_histories() {
    check_folder("kv", |text| verdict_of(&Kv, &parse::edn::parse(text)?));
}
