//! Regression tests of the state machine's snapshots, through openraft's storage traits only:
//! a snapshot's content always equals its index, also while apply runs.

use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine};
use openraft::testing::log_id;
use tempfile::TempDir;
use tokenlog_raftlog::raft_types::{Entry, TypeConfig};
use tokenlog_raftlog::sm_store::{load_snapshot, SmStore};
use tokenlog_raftlog::types::{Binding, Command, ModelIdentity, Request, StopConfig};

fn open_sm(dir: &TempDir) -> SmStore {
    tokenlog_raftlog::data_dir::open(dir.path(), Default::default())
        .expect("open data dir")
        .sm
}

fn model() -> ModelIdentity {
    ModelIdentity {
        weights_sha256: "w".into(),
        tokenizer_sha256: "t".into(),
        architecture: "llama".into(),
        dtype_class: "fake".into(),
    }
}

/// Entry `index` submits request `r{index}`: after applying entries 1..=n the state holds n
/// generations, so a snapshot's generation count must equal its last log index.
fn submit_entry(index: u64) -> Entry {
    let binding = Binding {
        model: model(),
        prompt_token_ids: vec![1, 2, 3],
        stop: StopConfig {
            max_tokens: 4,
            ..Default::default()
        },
        ..Default::default()
    };
    let req = Request::new(
        index,
        Command::Submit {
            tenant: "t".into(),
            request_id: format!("r{index}"),
            binding,
        },
    );
    Entry {
        log_id: log_id::<TypeConfig>(1, 1, index),
        payload: openraft::EntryPayload::Normal(req),
    }
}

async fn apply_one(sm: &mut SmStore, e: Entry) {
    let s = futures::stream::iter([Ok((e, None))]);
    sm.apply(s).await.expect("apply");
}

/// openraft builds snapshots while apply runs. Every snapshot must contain exactly the entries up
/// to the index it claims: one that claims N but holds N+1 is applied twice by a follower that
/// installs it (a second grant, a re-applied tick: divergence).
///
/// The applier may run at most `ENTRIES_PER_SNAPSHOT` entries ahead of the snapshots begun, so
/// the test builds all `SNAPSHOTS` however fast apply is against a build (a free-running applier
/// reached its bound after 8 builds on a machine where apply had become fast); it applies while
/// each build runs, which the test counts and requires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_built_during_apply_has_content_equal_to_its_index() {
    const SNAPSHOTS: u64 = 40;
    const ENTRIES_PER_SNAPSHOT: u64 = 2_000;
    let dir = tempfile::tempdir().unwrap();
    let mut leader = open_sm(&dir);
    // Snapshots begun; u64::MAX once the builder is done.
    let (begun_tx, mut begun) = tokio::sync::watch::channel(0u64);
    let mut builder_sm = leader.clone();
    let snapshots = tokio::spawn(async move {
        let mut bad = Vec::new();
        let mut overlapped = 0u64;
        for n in 1..=SNAPSHOTS {
            begun_tx.send_replace(n);
            let mut b = builder_sm.get_snapshot_builder().await;
            let snap = b.build_snapshot().await.expect("build snapshot");
            let claimed = snap.meta.last_log_id.map_or(0, |l| l.index);
            if count_of(&builder_sm).0 > claimed {
                overlapped += 1;
            }
            let mut problems = Vec::new();
            let (_, m) = load_snapshot(&snap.snapshot, &mut problems).expect("snapshot loads");
            let held = m.generations.len() as u64;
            if held != claimed || m.applied() != snap.meta.last_log_id {
                bad.push((claimed, held));
            }
        }
        begun_tx.send_replace(u64::MAX);
        (overlapped, bad)
    });
    let mut i = 0u64;
    loop {
        let n = *begun.borrow_and_update();
        if n == u64::MAX {
            break;
        }
        if i >= n * ENTRIES_PER_SNAPSHOT {
            begun.changed().await.expect("the builder ends by sending u64::MAX");
            continue;
        }
        i += 1;
        apply_one(&mut leader, submit_entry(i)).await;
        tokio::task::yield_now().await;
    }
    let (overlapped, bad) = snapshots.await.unwrap();
    assert!(
        bad.is_empty(),
        "{} of {SNAPSHOTS} snapshots hold other entries than their index claims: (claimed, held) {:?}",
        bad.len(),
        &bad[..bad.len().min(10)]
    );
    assert!(
        overlapped > 0,
        "no entry was applied while any of the {SNAPSHOTS} snapshots was built ({i} applied)"
    );
}

fn count_of(sm: &SmStore) -> (u64, u64) {
    let m = sm.shared();
    let r = m.read();
    (r.applied().map_or(0, |l| l.index), r.generations.len() as u64)
}

async fn build(sm: &mut SmStore) -> tokenlog_raftlog::raft_types::Snapshot {
    sm.get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .expect("build snapshot")
}

/// A fresh follower's store (and its data dir) that installed `snap` in process.
async fn installed(snap: &tokenlog_raftlog::raft_types::Snapshot) -> (TempDir, SmStore) {
    let dir = tempfile::tempdir().unwrap();
    let mut f = open_sm(&dir);
    f.install_snapshot(&snap.meta, snap.snapshot.clone())
        .await
        .expect("install");
    (dir, f)
}

/// A follower that crashes at any step of installing a snapshot restarts with the old snapshot
/// or the new one, whole: never an empty state under the old index, never a mix.
#[tokio::test]
async fn a_crash_at_every_step_of_install_restarts_to_a_whole_snapshot() {
    use tokenlog_raftlog::snapshot::Step;
    let ldir = tempfile::tempdir().unwrap();
    let mut leader = open_sm(&ldir);
    for i in 1..=30 {
        apply_one(&mut leader, submit_entry(i)).await;
    }
    let new = build(&mut leader).await;
    for step in Step::ALL {
        let fdir = tempfile::tempdir().unwrap();
        {
            let mut f = open_sm(&fdir);
            for i in 1..=10 {
                apply_one(&mut f, submit_entry(i)).await;
            }
            build(&mut f).await;
            assert!(f.crash_install_after(Some(step)), "store is shared");
            let r = f.install_snapshot(&new.meta, new.snapshot.clone()).await;
            assert!(r.is_err(), "no crash after {step:?}");
        }
        let f = open_sm(&fdir);
        let (index, gens) = count_of(&f);
        assert_eq!(
            index, gens,
            "after a crash after {step:?}: index {index} but {gens} generations"
        );
        assert!(index == 10 || index == 30, "after {step:?}: index {index}");
        if step != Step::Written {
            assert_eq!(index, 30, "the new snapshot was in place after {step:?}");
        }
    }
}

/// Records of a generation and its pruning in one apply batch: no panic, and the state (and a
/// restart from its snapshot) holds none of it.
#[tokio::test]
async fn records_and_pruning_in_one_apply_batch() {
    use tokenlog_raftlog::types::{AppendItem, FinishReason};
    let dir = tempfile::tempdir().unwrap();
    let mut sm = open_sm(&dir);
    let mut entries = vec![submit_entry(1)];
    let cmds = vec![
        Command::Acquire {
            generation: 1,
            decoder: "d".into(),
            lease_ms: 1_000,
            model: model(),
            rng_version: 0,
        },
        Command::Append {
            decoder: "d".into(),
            lease_ms: 1_000,
            items: vec![AppendItem {
                generation: 1,
                epoch: 1,
                start_seq: 0,
                token_ids: vec![7, 8, 9],
                finish: None,
            }],
        },
        Command::Finish {
            generation: 1,
            epoch: 1,
            reason: FinishReason::Stop,
            detail: String::new(),
        },
        Command::Tick { retention_ms: 0 },
    ];
    for (i, cmd) in cmds.into_iter().enumerate() {
        let index = i as u64 + 2;
        entries.push(Entry {
            log_id: log_id::<TypeConfig>(1, 1, index),
            payload: openraft::EntryPayload::Normal(Request::new(index * 10, cmd)),
        });
    }
    let s = futures::stream::iter(entries.into_iter().map(|e| Ok((e, None))));
    sm.apply(s).await.expect("apply");
    assert_eq!(count_of(&sm), (5, 0), "the generation was pruned by the tick");
    build(&mut sm).await;
    drop(sm);
    let sm = open_sm(&dir);
    assert_eq!(count_of(&sm), (5, 0));
}

/// A flipped byte anywhere in a stopped node's snapshot makes opening the data dir fail with
/// an integrity error naming the file; the node never serves the state.
#[tokio::test]
async fn a_flipped_byte_in_the_snapshot_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = {
        let mut sm = open_sm(&dir);
        for i in 1..=20 {
            apply_one(&mut sm, submit_entry(i)).await;
        }
        build(&mut sm).await.snapshot.path().to_path_buf()
    };
    let clean = std::fs::read(&path).unwrap();
    for at in [
        0,
        9,
        clean.len() / 3,
        clean.len() / 2,
        clean.len() - 40,
        clean.len() - 1,
    ] {
        let mut bad = clean.clone();
        bad[at] ^= 0x01;
        std::fs::write(&path, &bad).unwrap();
        match tokenlog_raftlog::data_dir::open(dir.path(), Default::default()) {
            Ok(_) => panic!("byte {at} of {} flipped, yet the data dir opened", clean.len()),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("refusing to serve") && msg.contains("snapshot"), "{msg}");
            }
        }
        let report = tokenlog_raftlog::data_dir::verify(dir.path()).expect("verify reads");
        assert!(!report.problems.is_empty(), "verify missed byte {at}");
    }
    std::fs::write(&path, &clean).unwrap();
    let s = tokenlog_raftlog::data_dir::open(dir.path(), Default::default()).expect("clean again");
    assert_eq!(s.report.generations, 20);
}

async fn append_blank_entries(log: &mut tokenlog_raftlog::log_store::LogStore, n: u64) {
    use openraft::storage::{IOFlushed, RaftLogStorage};
    use openraft::type_config::TypeConfigExt;
    for i in 1..=n {
        let (tx, rx) = TypeConfig::oneshot();
        log.append([submit_entry(i)], IOFlushed::signal(tx))
            .await
            .expect("append");
        rx.await.expect("flushed").expect("fsync");
    }
}

/// A flipped byte in the log's files (RocksDB's WAL or tables) of a stopped node is found when
/// the data dir is opened: RocksDB's own checksums in AbsoluteConsistency mode, or ours.
#[tokio::test]
async fn a_flipped_byte_in_the_log_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut s = tokenlog_raftlog::data_dir::open(dir.path(), Default::default()).unwrap();
        append_blank_entries(&mut s.log, 200).await;
    }
    let log_dir = tokenlog_raftlog::data_dir::log_dir(dir.path());
    // The largest WAL or table file holds the entries.
    let (file, len) = std::fs::read_dir(&log_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "log" || x == "sst"))
        .map(|p| (p.clone(), std::fs::metadata(&p).unwrap().len()))
        .max_by_key(|(_, l)| *l)
        .expect("a WAL or table file");
    let clean = std::fs::read(&file).unwrap();
    for frac in [4, 2] {
        let at = len as usize / frac;
        let mut bad = clean.clone();
        bad[at] ^= 0x40;
        std::fs::write(&file, &bad).unwrap();
        let r = tokenlog_raftlog::data_dir::open(dir.path(), Default::default());
        assert!(
            r.is_err(),
            "byte {at} of {} ({len} bytes) flipped, yet the data dir opened",
            file.display()
        );
        std::fs::write(&file, &clean).unwrap();
    }
    tokenlog_raftlog::data_dir::open(dir.path(), Default::default()).expect("clean again");
}

/// A WAL whose last record is incomplete (a crash in the middle of writing it: a large batch
/// reaches the file in several writes, and nothing of it was fsynced or acknowledged) opens,
/// without that record; everything before it is kept. In AbsoluteConsistency mode RocksDB took
/// the torn tail for corruption, and the node could not start again until its data dir was
/// wiped. (A damaged record anywhere is still refused: the test above.)
#[tokio::test]
async fn a_torn_last_record_of_the_wal_is_dropped_and_the_rest_kept() {
    use openraft::storage::RaftLogStorage;
    let dir = tempfile::tempdir().unwrap();
    {
        let mut s = tokenlog_raftlog::data_dir::open(dir.path(), Default::default()).unwrap();
        append_blank_entries(&mut s.log, 50).await;
    }
    let log_dir = tokenlog_raftlog::data_dir::log_dir(dir.path());
    // The newest WAL file holds the last record.
    let wal = std::fs::read_dir(&log_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .max_by_key(|p| {
            p.file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.parse::<u64>().ok())
        })
        .expect("a WAL file");
    let len = std::fs::metadata(&wal).unwrap().len();
    assert!(len > 100, "{} holds the entries ({len} bytes)", wal.display());
    let f = std::fs::OpenOptions::new().write(true).open(&wal).unwrap();
    f.set_len(len - 5).unwrap();
    drop(f);
    let mut s = match tokenlog_raftlog::data_dir::open(dir.path(), Default::default()) {
        Ok(s) => s,
        Err(e) => panic!("a torn last WAL record kept the node from starting: {e}"),
    };
    let last = s.log.get_log_state().await.unwrap().last_log_id.map(|l| l.index);
    assert_eq!(last, Some(49), "the torn entry 50 is gone, entries 1..=49 are kept");
}

/// A log row whose bytes changed above RocksDB (its own checksums pass) fails ours.
#[tokio::test]
async fn a_log_row_that_fails_its_checksum_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut s = tokenlog_raftlog::data_dir::open(dir.path(), Default::default()).unwrap();
        append_blank_entries(&mut s.log, 5).await;
    }
    {
        let db = tokenlog_raftlog::db::open(&tokenlog_raftlog::data_dir::log_dir(dir.path())).unwrap();
        let cf = db.cf_handle(tokenlog_raftlog::log_store::CF_LOGS).unwrap();
        let mut v = db.get_cf(cf, 3u64.to_be_bytes()).unwrap().unwrap();
        let last = v.len() - 1;
        v[last] ^= 0x01;
        db.put_cf(cf, 3u64.to_be_bytes(), v).unwrap();
    }
    let e = match tokenlog_raftlog::data_dir::open(dir.path(), Default::default()) {
        Ok(_) => panic!("a damaged log row was served"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("log entry 3: checksum mismatch"), "{e}");
}

/// The entries that put generation `g` (submitted by [`submit_entry`]`(g)`) through an owner, 3
/// records and a finish, from log index `first` on, at log time `t`.
fn finish_entries(first: u64, g: u64, t: u64) -> Vec<Entry> {
    use tokenlog_raftlog::types::FinishReason;
    owner_entries(
        first,
        g,
        vec![g as u32, 8, 9],
        Some((FinishReason::Stop, String::new())),
        t,
    )
}

/// Entries `first..`: decoder `d{g}` acquires generation `g` and appends `token_ids` to it, with
/// `finish` if given.
fn owner_entries(
    first: u64,
    g: u64,
    token_ids: Vec<u32>,
    finish: Option<(tokenlog_raftlog::types::FinishReason, String)>,
    t: u64,
) -> Vec<Entry> {
    use tokenlog_raftlog::types::AppendItem;
    let decoder = format!("d{g}");
    let cmds = vec![
        Command::Acquire {
            generation: g,
            decoder: decoder.clone(),
            lease_ms: 1_000,
            model: model(),
            rng_version: 0,
        },
        Command::Append {
            decoder,
            lease_ms: 1_000,
            items: vec![AppendItem {
                generation: g,
                epoch: 1,
                start_seq: 0,
                token_ids,
                finish,
            }],
        },
    ];
    cmds.into_iter()
        .enumerate()
        .map(|(i, cmd)| Entry {
            log_id: log_id::<TypeConfig>(1, 1, first + i as u64),
            payload: openraft::EntryPayload::Normal(Request::new(t, cmd)),
        })
        .collect()
}

fn records_of(sm: &SmStore, g: u64) -> Vec<(u32, u64)> {
    let s = sm.shared();
    let m = s.read();
    m.records_of(&m.generations[&g])
        .expect("records read")
        .iter()
        .map(|r| (r.token_id, r.epoch))
        .collect()
}

fn on_disk(sm: &SmStore, g: u64) -> bool {
    let s = sm.shared();
    let m = s.read();
    m.generations[&g].on_disk_only()
}

/// The memory bound: a snapshot moves the records of sealed generations out of memory, into
/// its own file. They read back the same (checked against the chain head) from the live node,
/// after the next snapshot (which copies them over), and after a restart; running and
/// recently finished generations stay in memory; the state digest does not change.
#[tokio::test]
async fn sealed_generations_leave_memory_at_a_snapshot_and_read_back_the_same() {
    use tokenlog_raftlog::limits::SEAL_AFTER_MS;
    let dir = tempfile::tempdir().unwrap();
    let mut sm = open_sm(&dir);
    for g in 1..=3 {
        apply_one(&mut sm, submit_entry(g)).await;
    }
    // 1 finishes at log time 10, 2 at 20 + SEAL_AFTER_MS; 3 stays pending.
    let mut index = 4;
    for (g, t) in [(1, 10), (2, 20 + SEAL_AFTER_MS)] {
        for e in finish_entries(index, g, t) {
            apply_one(&mut sm, e).await;
        }
        index += 2;
    }
    let digest = sm.shared().digest().unwrap();
    let want1 = vec![(1, 1), (8, 1), (9, 1)];
    assert_eq!(records_of(&sm, 1), want1);
    build(&mut sm).await;
    assert!(on_disk(&sm, 1), "sealed at log time 10 + SEAL_AFTER_MS: on disk");
    assert!(!on_disk(&sm, 2), "finished less than SEAL_AFTER_MS ago: in memory");
    assert!(!on_disk(&sm, 3));
    assert_eq!(records_of(&sm, 1), want1);
    assert_eq!(sm.shared().digest().unwrap(), digest, "where records are is not state");
    let report = sm.shared().verify().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.records, 6);

    // Generation 2 seals later; the next snapshot copies 1 over and adds 2.
    let tick = Entry {
        log_id: log_id::<TypeConfig>(1, 1, index),
        payload: openraft::EntryPayload::Normal(Request::new(
            20 + 2 * SEAL_AFTER_MS,
            Command::Tick {
                retention_ms: tokenlog_raftlog::limits::RETENTION_MS_DEFAULT,
            },
        )),
    };
    apply_one(&mut sm, tick).await;
    let digest = sm.shared().digest().unwrap();
    let snap = build(&mut sm).await;
    assert!(on_disk(&sm, 1) && on_disk(&sm, 2));
    assert_eq!(records_of(&sm, 1), want1);
    assert_eq!(records_of(&sm, 2), vec![(2, 1), (8, 1), (9, 1)]);
    assert_eq!(sm.shared().digest().unwrap(), digest);
    drop(sm);

    // A restart loads them from the snapshot, on disk still.
    let sm = open_sm(&dir);
    assert!(on_disk(&sm, 1) && on_disk(&sm, 2) && !on_disk(&sm, 3));
    assert_eq!(records_of(&sm, 1), want1);
    assert_eq!(sm.shared().digest().unwrap(), digest);
    drop(sm);

    // A follower installing that snapshot reads them from its own copy of the file.
    let (_fdir, f) = installed(&snap).await;
    assert!(on_disk(&f, 1));
    assert_eq!(records_of(&f, 2), vec![(2, 1), (8, 1), (9, 1)]);
    assert_eq!(f.shared().digest().unwrap(), digest);
}

/// A store in `dir` whose generation 1 finished at log time 10 (entries 1 to 3).
async fn one_finished(dir: &TempDir) -> SmStore {
    let mut sm = open_sm(dir);
    apply_one(&mut sm, submit_entry(1)).await;
    for e in finish_entries(2, 1, 10) {
        apply_one(&mut sm, e).await;
    }
    sm
}

/// A byte flipped inside the records kept on disk (a cold segment) of a stopped node is refused
/// at open (the frame's CRC), a missing segment too, and a live node that reads a damaged frame
/// refuses to serve it (its CRC; then the chain head), never a shortened or altered generation.
#[tokio::test]
async fn damaged_records_on_disk_are_refused() {
    use tokenlog_raftlog::limits::SEAL_AFTER_MS;
    let dir = tempfile::tempdir().unwrap();
    let mut sm = one_finished(&dir).await;
    let tick = Entry {
        log_id: log_id::<TypeConfig>(1, 1, 4),
        payload: openraft::EntryPayload::Normal(Request::new(
            10 + SEAL_AFTER_MS,
            Command::Tick {
                retention_ms: tokenlog_raftlog::limits::RETENTION_MS_DEFAULT,
            },
        )),
    };
    apply_one(&mut sm, tick).await;
    build(&mut sm).await;
    assert!(on_disk(&sm, 1));
    let (r, path) = {
        let s = sm.shared();
        let m = s.read();
        let r = m.generations[&1].cold.unwrap();
        (r, m.cold_files().path_of(&r).unwrap().to_path_buf())
    };
    let clean = std::fs::read(&path).unwrap();
    let mut bad = clean.clone();
    // The last record's token id: the frame still decodes, the chain does not match.
    let at = (r.offset + r.bytes - 20) as usize;
    bad[at] ^= 0x01;
    std::fs::write(&path, &bad).unwrap();
    {
        let s = sm.shared();
        let e = {
            let m = s.read();
            m.records_of(&m.generations[&1]).unwrap_err().to_string()
        };
        assert!(e.contains("CRC mismatch"), "{e}");
        let report = s.verify().unwrap();
        assert!(!report.problems.is_empty());
    }
    drop(sm);
    match tokenlog_raftlog::data_dir::open(dir.path(), Default::default()) {
        Ok(_) => panic!("a damaged record on disk, yet the data dir opened"),
        Err(e) => assert!(e.to_string().contains("refusing to serve"), "{e}"),
    }
    // A segment that is gone: refused as well.
    std::fs::rename(&path, path.with_extension("moved")).unwrap();
    match tokenlog_raftlog::data_dir::open(dir.path(), Default::default()) {
        Ok(_) => panic!("a missing cold segment, yet the data dir opened"),
        Err(e) => assert!(e.to_string().contains("refusing to serve"), "{e}"),
    }
    std::fs::rename(path.with_extension("moved"), &path).unwrap();
    std::fs::write(&path, &clean).unwrap();
    let s = tokenlog_raftlog::data_dir::open(dir.path(), Default::default()).expect("clean again");
    assert_eq!(s.report.records, 3);
}

/// A Tick at log time `t` (entry `index`) with retention `retention_ms`.
fn tick_entry(index: u64, t: u64, retention_ms: u64) -> Entry {
    Entry {
        log_id: log_id::<TypeConfig>(1, 1, index),
        payload: openraft::EntryPayload::Normal(Request::new(t, Command::Tick { retention_ms })),
    }
}

/// The cold segments the state's files name: (id, length).
fn segments_of(sm: &SmStore) -> Vec<(u64, u64)> {
    let s = sm.shared();
    let m = s.read();
    m.cold_files().segments().map(|g| (g.id(), g.len())).collect()
}

/// The segment files in a data dir's `snapshots/cold/`, by id.
fn segment_files(dir: &TempDir) -> Vec<u64> {
    let cold = dir.path().join("snapshots").join("cold");
    let mut ids: Vec<u64> = std::fs::read_dir(cold)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.strip_prefix("segment-")?.strip_suffix(".seg")?.parse().ok()
        })
        .collect();
    ids.sort_unstable();
    ids
}

/// Incremental cold segments: each snapshot build writes only the records sealed since the
/// last one, into a new segment, and names the older segments as they are (their files are not
/// rewritten); the records read back the same from the live node, after a restart and at a
/// follower, which receives them inside the snapshot.
#[tokio::test]
async fn a_snapshot_build_writes_only_the_records_sealed_since_the_last_one() {
    use tokenlog_raftlog::limits::{RETENTION_MS_DEFAULT, SEAL_AFTER_MS};
    let dir = tempfile::tempdir().unwrap();
    let mut sm = open_sm(&dir);
    for g in 1..=3 {
        apply_one(&mut sm, submit_entry(g)).await;
    }
    let mut index = 4;
    for (g, t) in [(1, 10), (2, 10)] {
        for e in finish_entries(index, g, t) {
            apply_one(&mut sm, e).await;
        }
        index += 2;
    }
    apply_one(&mut sm, tick_entry(index, 10 + SEAL_AFTER_MS, RETENTION_MS_DEFAULT)).await;
    index += 1;
    let first = build(&mut sm).await;
    let segs = segments_of(&sm);
    assert_eq!(segs.len(), 1, "one segment with generations 1 and 2: {segs:?}");
    let (a, a_len) = segs[0];
    let a_path = dir.path().join(format!("snapshots/cold/segment-{a:020}.seg"));
    let a_bytes = std::fs::read(&a_path).unwrap();
    assert!(on_disk(&sm, 1) && on_disk(&sm, 2) && !on_disk(&sm, 3));

    // Generation 3 finishes and seals: the next build adds a segment with it alone.
    for e in finish_entries(index, 3, 20 + SEAL_AFTER_MS) {
        apply_one(&mut sm, e).await;
    }
    index += 2;
    apply_one(&mut sm, tick_entry(index, 20 + 2 * SEAL_AFTER_MS, RETENTION_MS_DEFAULT)).await;
    let digest = sm.shared().digest().unwrap();
    let second = build(&mut sm).await;
    let segs = segments_of(&sm);
    assert_eq!(segs.len(), 2, "{segs:?}");
    assert_eq!(segs[0], (a, a_len), "the first segment is named as it is");
    let (b, b_len) = segs[1];
    assert!(b > a);
    assert!(
        b_len - 8 < a_len - 8,
        "the new segment holds one generation's frame ({} bytes), the old one two ({} bytes)",
        b_len - 8,
        a_len - 8
    );
    assert_eq!(
        std::fs::read(&a_path).unwrap(),
        a_bytes,
        "the first segment was not rewritten"
    );
    assert!(
        second.snapshot.len() < first.snapshot.len() + 200,
        "the snapshot file itself holds no records: {} then {} bytes",
        first.snapshot.len(),
        second.snapshot.len()
    );
    assert_eq!(segment_files(&dir), vec![a, b]);
    let want3 = vec![(3, 1), (8, 1), (9, 1)];
    assert_eq!(records_of(&sm, 3), want3);
    assert_eq!(records_of(&sm, 1), vec![(1, 1), (8, 1), (9, 1)]);
    assert_eq!(sm.shared().digest().unwrap(), digest);
    let report = sm.shared().verify().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    drop(sm);

    let sm = open_sm(&dir);
    assert!(on_disk(&sm, 1) && on_disk(&sm, 3));
    assert_eq!(records_of(&sm, 3), want3);
    assert_eq!(sm.shared().digest().unwrap(), digest);
    drop(sm);

    // What a follower is sent: one self-contained file, the records inside it.
    let sent = tokenlog_raftlog::sm_store::self_contained(&second.snapshot).unwrap();
    assert_ne!(sent.path(), second.snapshot.path());
    assert!(sent.len() > second.snapshot.len());
    let fdir = tempfile::tempdir().unwrap();
    let mut f = open_sm(&fdir);
    f.install_snapshot(&second.meta, sent).await.expect("install");
    assert!(on_disk(&f, 1) && on_disk(&f, 3));
    assert_eq!(records_of(&f, 3), want3);
    assert_eq!(f.shared().digest().unwrap(), digest);
    assert!(
        segments_of(&f).is_empty(),
        "an installed file keeps its records in itself"
    );
    // Its next build moves them into a segment of its own.
    build(&mut f).await;
    assert_eq!(segments_of(&f).len(), 1);
    assert_eq!(records_of(&f, 1), vec![(1, 1), (8, 1), (9, 1)]);
    assert_eq!(f.shared().digest().unwrap(), digest);
}

/// Dead bytes stay under the live ones: a segment whose generations were mostly pruned is
/// rewritten (its live frames copied into the next segment) and its file removed.
#[tokio::test]
async fn a_segment_mostly_pruned_is_rewritten_and_removed() {
    use tokenlog_raftlog::limits::{RETENTION_MS_DEFAULT, SEAL_AFTER_MS};
    let dir = tempfile::tempdir().unwrap();
    let mut sm = open_sm(&dir);
    for g in 1..=3 {
        apply_one(&mut sm, submit_entry(g)).await;
    }
    let mut index = 4;
    for (g, t) in [(1, 10), (2, 10), (3, 1_000)] {
        for e in finish_entries(index, g, t) {
            apply_one(&mut sm, e).await;
        }
        index += 2;
    }
    apply_one(&mut sm, tick_entry(index, 1_000 + SEAL_AFTER_MS, RETENTION_MS_DEFAULT)).await;
    index += 1;
    build(&mut sm).await;
    let segs = segments_of(&sm);
    assert_eq!(segs.len(), 1);
    let old = segs[0].0;
    // 1 and 2 (finished at 10) pass a retention that 3 (finished at 1,000) does not.
    apply_one(&mut sm, tick_entry(index, 1_000 + SEAL_AFTER_MS, SEAL_AFTER_MS + 500)).await;
    {
        let s = sm.shared();
        let m = s.read();
        assert!(!m.generations.contains_key(&1) && !m.generations.contains_key(&2));
        assert!(m.generations.contains_key(&3));
    }
    build(&mut sm).await;
    let segs = segments_of(&sm);
    assert_eq!(segs.len(), 1, "{segs:?}");
    assert_ne!(segs[0].0, old, "rewritten into a new segment");
    assert_eq!(
        segment_files(&dir),
        vec![segs[0].0],
        "the old segment's file is removed"
    );
    assert_eq!(records_of(&sm, 3), vec![(3, 1), (8, 1), (9, 1)]);
    drop(sm);
    let sm = open_sm(&dir);
    assert_eq!(records_of(&sm, 3), vec![(3, 1), (8, 1), (9, 1)]);
}

/// A crash at any step of putting a build's snapshot in place (its segment written and synced
/// before) restarts to the old snapshot or the new one with every record readable, and the
/// segment no snapshot names is removed at that restart.
#[tokio::test]
async fn a_crash_at_every_step_of_a_build_with_a_segment_restarts_whole() {
    use tokenlog_raftlog::limits::{RETENTION_MS_DEFAULT, SEAL_AFTER_MS};
    use tokenlog_raftlog::snapshot::Step;
    for step in Step::ALL {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut sm = open_sm(&dir);
            apply_one(&mut sm, submit_entry(1)).await;
            for e in finish_entries(2, 1, 10) {
                apply_one(&mut sm, e).await;
            }
            apply_one(&mut sm, tick_entry(4, 10 + SEAL_AFTER_MS, RETENTION_MS_DEFAULT)).await;
            assert!(sm.crash_install_after(Some(step)), "store is shared");
            let r = sm.get_snapshot_builder().await.build_snapshot().await;
            assert!(r.is_err(), "no crash after {step:?}");
            assert_eq!(segment_files(&dir).len(), 1, "the segment is durable first");
        }
        let sm = open_sm(&dir);
        let named = segments_of(&sm);
        let (index, _) = count_of(&sm);
        match step {
            Step::Written => {
                assert_eq!(index, 0, "no snapshot in place after {step:?}");
                assert!(named.is_empty());
                assert!(segment_files(&dir).is_empty(), "the unnamed segment is removed");
            }
            _ => {
                assert_eq!(index, 4, "the new snapshot was in place after {step:?}");
                assert_eq!(named.len(), 1);
                assert_eq!(segment_files(&dir), vec![named[0].0]);
                assert!(on_disk(&sm, 1));
                assert_eq!(records_of(&sm, 1), vec![(1, 1), (8, 1), (9, 1)]);
            }
        }
    }
}

/// A finished generation goes to a cold segment at the first build after its finish, and stays
/// in memory too until it is sealed (an identical re-send is still compared with its records
/// and acknowledged, also after a restart); the build after the seal drops it from memory
/// without writing it again. The snapshot's body never holds a finished generation's records.
#[tokio::test]
async fn a_finished_generation_is_written_once_and_leaves_memory_when_sealed() {
    use tokenlog_raftlog::limits::{RETENTION_MS_DEFAULT, SEAL_AFTER_MS};
    use tokenlog_raftlog::types::{AppendItem, FinishReason, Response};
    let dir = tempfile::tempdir().unwrap();
    let mut sm = one_finished(&dir).await;
    let empty = build(&mut sm).await.snapshot.len();
    let segs = segments_of(&sm);
    assert_eq!(segs.len(), 1, "written at the first build after the finish");
    {
        let s = sm.shared();
        let m = s.read();
        let g = &m.generations[&1];
        assert!(
            g.cold.is_some() && g.records.len() == 3,
            "on disk and, unsealed, in memory"
        );
    }
    drop(sm);
    let mut sm = open_sm(&dir);
    assert!(!on_disk(&sm, 1), "a restart keeps an unsealed generation in memory");
    // The decoder's retry of its finishing append, before the seal: acknowledged.
    let resend = Entry {
        log_id: log_id::<TypeConfig>(1, 1, 4),
        payload: openraft::EntryPayload::Normal(Request::new(
            20,
            Command::Append {
                decoder: "d1".into(),
                lease_ms: 1_000,
                items: vec![AppendItem {
                    generation: 1,
                    epoch: 1,
                    start_seq: 0,
                    token_ids: vec![1, 8, 9],
                    finish: Some((FinishReason::Stop, String::new())),
                }],
            },
        )),
    };
    {
        let mut m = sm.shared().read().clone();
        let r = m.apply_entry(
            resend.log_id,
            resend.payload,
            &mut tokenlog_raftlog::state::Changes::default(),
        );
        match r {
            Response::Appended(o) => assert!(o[0].result.is_ok() && o[0].frontier == 3, "{o:?}"),
            other => panic!("{other:?}"),
        }
    }
    apply_one(&mut sm, tick_entry(5, 10 + SEAL_AFTER_MS, RETENTION_MS_DEFAULT)).await;
    let b = build(&mut sm).await;
    assert!(on_disk(&sm, 1), "sealed: out of memory");
    assert_eq!(segments_of(&sm), segs, "not written again");
    assert_eq!(records_of(&sm, 1), vec![(1, 1), (8, 1), (9, 1)]);
    assert!(
        b.snapshot.len() < empty + 200,
        "{} then {} bytes",
        empty,
        b.snapshot.len()
    );
}

/// Entries `first..`: decoder `d{g}` acquires generation `g` and appends `tokens` records to it,
/// which keeps running.
fn running_entries(first: u64, g: u64, tokens: u32, t: u64) -> Vec<Entry> {
    owner_entries(first, g, (0..tokens).collect(), None, t)
}

/// Each snapshot body holds every record of the running generations again, so a node waits for
/// at least as many new tokens before the next one (`limits::snapshot_due`): the count of the
/// last body is known after a build, a restart and an install. Before, a node built one every
/// 2^20 tokens whatever the body held: with long running generations each build wrote all of
/// them again (1.3M, 2.5M, 3.6M, ... records in `tokenlog bench log`).
#[tokio::test]
async fn the_next_snapshot_waits_for_as_many_tokens_as_the_last_body_held() {
    use tokenlog_raftlog::limits::{snapshot_due, SNAPSHOT_AFTER_TOKENS};
    assert!(snapshot_due(SNAPSHOT_AFTER_TOKENS, 0));
    assert!(!snapshot_due(SNAPSHOT_AFTER_TOKENS - 1, 0));
    assert!(snapshot_due(SNAPSHOT_AFTER_TOKENS, SNAPSHOT_AFTER_TOKENS));
    assert!(
        !snapshot_due(SNAPSHOT_AFTER_TOKENS, 3 * SNAPSHOT_AFTER_TOKENS),
        "a body of 3 x 2^20 running records is not written again after 2^20 tokens"
    );
    assert!(snapshot_due(3 * SNAPSHOT_AFTER_TOKENS, 3 * SNAPSHOT_AFTER_TOKENS));

    let dir = tempfile::tempdir().unwrap();
    let mut sm = open_sm(&dir);
    assert_eq!(sm.shared().body_records(), 0);
    for g in 1..=3 {
        apply_one(&mut sm, submit_entry(g)).await;
    }
    // 1 runs with 4 records (its max_tokens), 2 finishes with 3, 3 runs with 2.
    let mut index = 4;
    for e in running_entries(index, 1, 4, 10) {
        apply_one(&mut sm, e).await;
    }
    index += 2;
    for e in finish_entries(index, 2, 10) {
        apply_one(&mut sm, e).await;
    }
    index += 2;
    for e in running_entries(index, 3, 2, 10) {
        apply_one(&mut sm, e).await;
    }
    assert_eq!(sm.shared().tokens_since_snapshot(), 9);
    let snap = build(&mut sm).await;
    assert_eq!(sm.shared().tokens_since_snapshot(), 0);
    assert_eq!(sm.shared().body_records(), 6, "the running generations' 4 + 2");
    drop(sm);

    let sm = open_sm(&dir);
    assert_eq!(sm.shared().body_records(), 6, "after a restart");
    drop(sm);

    let (_fdir, f) = installed(&snap).await;
    assert_eq!(f.shared().body_records(), 6, "after an install");
}

/// A snapshot that names segments, installed in process (not streamed), is made self-contained
/// first. A generation finished less than `SEAL_AFTER_MS` before it has its records in a segment
/// and, loaded back for `apply`, in memory too: the export wrote them twice (in its body and in
/// its cold section), and the install refused its own export ("records on disk for generation
/// 2, which has none to put there"). Its records are now once in the export.
#[tokio::test]
async fn a_snapshot_with_a_finished_generation_not_sealed_yet_installs_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let mut sm = one_finished(&dir).await;
    let digest = sm.shared().digest().unwrap();
    let snap = build(&mut sm).await;
    assert!(!on_disk(&sm, 1), "finished, not sealed: in memory too");
    assert!(!segments_of(&sm).is_empty(), "the snapshot names a segment");

    let (_fdir, f) = installed(&snap).await;
    assert_eq!(records_of(&f, 1), vec![(1, 1), (8, 1), (9, 1)]);
    assert_eq!(f.shared().digest().unwrap(), digest);
}
