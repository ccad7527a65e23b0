//! Apply's cost per appended item, and the cost of a snapshot's copy of the state, in process
//! (no Raft, no I/O), as the library runs in a node (an integration test: without the index
//! checks that unit tests run after every apply).

use tokenlog_raftlog::state::{Changes, LogState};
use tokenlog_raftlog::types::{
    AppendItem, Binding, Command, GenerationId, ModelIdentity, Request, Response, StopConfig,
};

const LEASE_MS: u64 = 1_000;

/// 512 running generations, 16 decoders of 32 each, every entry a `Batch` of one `Append` per
/// decoder with one token for each of its generations (the shape of `tokenlog bench log
/// --writers 16`). Prints ns per item.
/// `cargo test --release -p tokenlog-raftlog --test apply_cost -- --ignored --nocapture`
#[test]
#[ignore = "a timing, not a check: run it by hand, in a release build"]
fn apply_cost_per_item() {
    const GENERATIONS: u64 = 512;
    const DECODERS: u64 = 16;
    const ENTRIES: u64 = 4_000;
    let mut s = LogState::default();
    let mut changes = Changes::default();
    let mut at = |s: &mut LogState, t: u64, cmd: Command| s.apply(&Request::new(t, cmd), &mut changes);
    let binding = Binding {
        model: ModelIdentity {
            weights_sha256: "w".into(),
            tokenizer_sha256: "t".into(),
            architecture: "llama".into(),
            dtype_class: "fake".into(),
        },
        prompt_token_ids: vec![1, 2, 3],
        stop: StopConfig {
            max_tokens: 32_768,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut ids: Vec<GenerationId> = Vec::new();
    for i in 0..GENERATIONS {
        let cmd = Command::Submit {
            tenant: "a".into(),
            request_id: format!("r{i}"),
            binding: binding.clone(),
        };
        match at(&mut s, 1, cmd) {
            Response::Submitted { generation, .. } => ids.push(generation.id),
            r => panic!("{r:?}"),
        }
    }
    for (i, g) in ids.iter().enumerate() {
        let cmd = Command::Acquire {
            generation: *g,
            decoder: format!("d{}", i as u64 % DECODERS),
            lease_ms: LEASE_MS,
            model: binding.model.clone(),
            rng_version: 0,
        };
        assert!(matches!(at(&mut s, 2, cmd), Response::Ownership(Ok(_))));
    }
    let mut spent = std::time::Duration::ZERO;
    for seq in 0..ENTRIES as u32 {
        let cmds = (0..DECODERS)
            .map(|d| Command::Append {
                decoder: format!("d{d}"),
                lease_ms: LEASE_MS,
                items: (d..GENERATIONS)
                    .step_by(DECODERS as usize)
                    .map(|i| AppendItem {
                        generation: ids[i as usize],
                        epoch: 1,
                        start_seq: seq,
                        token_ids: vec![seq % 50_000],
                        finish: None,
                    })
                    .collect(),
            })
            .collect();
        let req = Request::new(3 + seq as u64, Command::Batch(cmds));
        let start = std::time::Instant::now();
        let r = s.apply(&req, &mut changes);
        spent += start.elapsed();
        let Response::Batch(parts) = r else { panic!("{r:?}") };
        assert!(parts
            .iter()
            .all(|p| matches!(p, Response::Appended(v) if v.iter().all(|o| o.result.is_ok()))));
    }
    assert_eq!(s.generations[&ids[0]].frontier(), ENTRIES as u32);
    let items = ENTRIES * GENERATIONS;
    println!(
        "apply: {items} items in {ENTRIES} entries, {:.0} ns per item",
        spent.as_nanos() as f64 / items as f64
    );
    // What a snapshot build's copy of the state costs (appends wait for it): the records' full
    // chunks are shared, the tails copied.
    let start = std::time::Instant::now();
    let copy = s.clone();
    let copy_us = start.elapsed().as_micros();
    assert_eq!(copy.generations.len(), GENERATIONS as usize);
    println!("copy of the state: {GENERATIONS} generations, {items} records, {copy_us} µs");
}
