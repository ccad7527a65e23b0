//! Pipeline stages (issue 16) between real processes over a real 3-node log: the bundled model
//! split into 3 `tokenlog stage` processes, driven by a pipeline head (`tokenlog decoder
//! --pipeline ...`) that leases, samples and appends like any decoder. The output equals the
//! whole model's bit for bit (sampled, exact mode); a dead stage fails the head, whose
//! generations a new pipeline continues exactly; a whole decoder continues a pipeline's
//! generation exactly too.

// See tests/decoder_takeover.rs: the serial guard is held across awaits on purpose.
#![allow(clippy::await_holding_lock)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{bin, serial, Cluster, Decoder};
use futures::StreamExt;
use tokenlog_decoder::{generate, Model, SamplingConfig, StopConfig};
use tokenlog_proto::decoder as dpb;
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

const MAX_TOKENS: u32 = 96;

fn sampling(seed: u64) -> SamplingConfig {
    SamplingConfig {
        temperature: 0.8,
        top_p: 0.95,
        seed,
        ..Default::default()
    }
}

fn expected(model: &dyn Model, prompt: &[u32], seed: u64) -> Vec<u32> {
    expected_n(model, prompt, seed, MAX_TOKENS)
}

fn expected_n(model: &dyn Model, prompt: &[u32], seed: u64, max_tokens: u32) -> Vec<u32> {
    let stop = StopConfig {
        max_tokens,
        stop_strings: vec![],
        eos_token_ids: vec![],
    };
    generate(model, prompt, &sampling(seed), &stop).unwrap().tokens
}

async fn submit(client: &LogClient, model: &dyn Model, rid: &str, prompt: &[u32], seed: u64) -> u64 {
    submit_n(client, model, rid, prompt, seed, MAX_TOKENS).await
}

async fn submit_n(client: &LogClient, model: &dyn Model, rid: &str, prompt: &[u32], seed: u64, max_tokens: u32) -> u64 {
    common::submit_binding(
        client,
        rid,
        common::sampled_binding(model, prompt, &sampling(seed), max_tokens),
    )
    .await
}

/// Every committed record of a generation from seq 0 until it is terminal, like a client:
/// each once, in order. The tokens and their epochs.
async fn follow(client: &LogClient, id: u64) -> (Vec<u32>, Vec<u64>) {
    let (mut toks, mut epochs) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let mut stream = client.watch(id, toks.len() as u32).await.unwrap();
        while let Ok(Some(item)) = tokio::time::timeout(Duration::from_secs(30), stream.next()).await {
            let ev = item.unwrap();
            for r in ev.records {
                assert_eq!(r.seq as usize, toks.len(), "gap or duplicate in the committed stream");
                toks.push(r.token_id);
                epochs.push(r.epoch);
            }
            if ev.terminal.is_some() {
                return (toks, epochs);
            }
        }
        assert!(Instant::now() < deadline, "generation {id} did not finish");
    }
}

/// A generation as the leader has it (linearizable).
async fn generation(client: &LogClient, id: u64) -> pb::GenerationInfo {
    client
        .get(pb::GetRequest {
            generation_id: id,
            linearizable: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .generation
        .unwrap()
}

async fn frontier(client: &LogClient, id: u64) -> u32 {
    generation(client, id).await.frontier
}

async fn wait_frontier(client: &LogClient, id: u64, at_least: u32) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while frontier(client, id).await < at_least {
        assert!(
            Instant::now() < deadline,
            "generation {id} never reached {at_least} records"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Issue 16's generation: 64 sampled tokens (exact mode) of the lighthouse prompt with `seed`;
/// `fail` strikes the pipeline after 20 records. All 64 must equal the whole model's, each seen
/// once, every record at epoch 1 (the generation never left its head). The prompt and the
/// generation's id.
async fn decode_64_failing_after_20(
    client: &LogClient,
    model: &dyn Model,
    rid: &str,
    seed: u64,
    fail: impl FnOnce(),
) -> (Vec<u32>, u64) {
    let prompt = model
        .tokenizer()
        .encode_chat(&[tokenlog_decoder::ChatMessage::user("Tell me about lighthouses.")])
        .unwrap();
    let id = submit_n(client, model, rid, &prompt, seed, 64).await;
    let f = {
        let c = client.clone();
        tokio::spawn(async move { follow(&c, id).await })
    };
    wait_frontier(client, id, 20).await;
    fail();
    let (toks, epochs) = f.await.unwrap();
    assert_eq!(
        toks,
        expected_n(model, &prompt, seed, 64),
        "the whole model's 64 tokens"
    );
    assert!(
        epochs.iter().all(|&e| e == 1),
        "the generation never left its head: {epochs:?}"
    );
    (prompt, id)
}

/// A `tokenlog stage` process of `layers` on a free port, and the address it serves on.
fn start_stage(dir: &Path, model: &Path, name: &str, layers: &str) -> (Decoder, String) {
    start_stage_with(dir, model, name, layers, &[])
}

/// `layers` "cold": a cold spare (`--cold`).
fn start_stage_with(dir: &Path, model: &Path, name: &str, layers: &str, extra: &[&str]) -> (Decoder, String) {
    start_stage_env(dir, model, name, layers, extra, &[])
}

/// [`start_stage_with`] with `env` set for the stage process.
fn start_stage_env(
    dir: &Path,
    model: &Path,
    name: &str,
    layers: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Decoder, String) {
    let log = dir.join(format!("{name}.log"));
    let held = match layers {
        "cold" => vec!["--cold"],
        l => vec!["--layers", l],
    };
    let child = Command::new(bin())
        .args(["stage", "--model", model.to_str().unwrap()])
        .args(held)
        .args(["--listen", "127.0.0.1:0", "--stage-id", name, "--threads", "1"])
        .args(extra)
        .envs(env.iter().copied())
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn tokenlog stage");
    let mut stage = Decoder {
        child: Some(child),
        id: name.to_string(),
        log,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = stage.log_text();
        // Whole lines only: one read while the stage wrote its line took "127.0.0." for the
        // address, and the head then failed on it (a CI run of a_paused_stage_...).
        if let Some(addr) = text
            .split_inclusive('\n')
            .filter_map(|l| l.strip_suffix('\n'))
            .find(|l| {
                l.starts_with(&format!("stage {name} serves"))
                    || l.starts_with(&format!("stage {name} is a cold spare"))
            })
            .and_then(|l| l.rsplit(" on ").next())
        {
            return (stage, addr.trim().to_string());
        }
        assert!(
            stage.wait_exit(Duration::ZERO).is_none(),
            "stage {name} exited:\n{text}"
        );
        assert!(Instant::now() < deadline, "stage {name} did not start:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn model_path() -> PathBuf {
    tokenlog_decoder::fetch::ensure_default_model(&tokenlog_decoder::fetch::repo_models_dir()).unwrap()
}

/// The model file, the model loaded here, the log, the stages and their addresses.
type Setup = (PathBuf, std::sync::Arc<dyn Model>, Cluster, Vec<(Decoder, String)>);

/// The bundled model (loaded in this process, for the expected tokens), a fresh 3-node log and
/// stage processes of `ranges` named `s1`, `s2`, ...
fn setup(dir: &Path, ranges: &[&str]) -> Setup {
    setup_stages(dir, ranges, false)
}

/// [`setup`] with stages started with the log's addresses (fenced by and registered in it).
fn fenced_setup(dir: &Path, ranges: &[&str]) -> Setup {
    setup_stages(dir, ranges, true)
}

fn setup_stages(dir: &Path, ranges: &[&str], fenced: bool) -> Setup {
    let path = model_path();
    tokenlog_decoder::threads::init_cpu_threads(1);
    let model = tokenlog_decoder::load_model(&path, tokenlog_decoder::DeviceSpec::Cpu).unwrap();
    let cluster = Cluster::start(20_000);
    let nodes = cluster.addrs.join(",");
    let extra = match fenced {
        true => vec!["--cluster", nodes.as_str()],
        false => vec![],
    };
    let stages = ranges
        .iter()
        .enumerate()
        .map(|(i, r)| start_stage_with(dir, &path, &format!("s{}", i + 1), r, &extra))
        .collect();
    (path, model, cluster, stages)
}

/// A pipeline head over `stages` (their addresses, in order).
fn start_head(cluster: &Cluster, id: &str, model: &Path, stages: &[String]) -> Decoder {
    let list = stages.join(",");
    cluster.start_real_decoder(
        id,
        model,
        &["--pipeline", &list, "--capacity", "2", "--lease-ms", "1500"],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_of_stage_processes_decodes_exactly_and_survives_a_dead_stage() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let ranges = ["0..10", "10..20", "20..30"];
    let (path, model, cluster, mut stages) = setup(dir.path(), &ranges);
    let client = cluster.client();
    let addrs = |stages: &[(Decoder, String)]| stages.iter().map(|s| s.1.clone()).collect::<Vec<_>>();
    let mut h1 = start_head(&cluster, "head-1", &path, &addrs(&stages));
    common::wait_for_model(&client).await;
    let h1_log = h1.log_text();
    for r in ranges {
        assert!(
            h1_log.contains(&format!("layers {}", r)),
            "the head names its stages:\n{h1_log}"
        );
    }
    let chat = |q: &str| {
        model
            .tokenizer()
            .encode_chat(&[tokenlog_decoder::ChatMessage::user(q)])
            .unwrap()
    };
    let prompts = [
        chat("Tell me about lighthouses."),
        chat("Name a few rivers."),
        chat("Write a haiku about snow."),
    ];
    let (g1, g2) = (
        submit(&client, model.as_ref(), "p1", &prompts[0], 11).await,
        submit(&client, model.as_ref(), "p2", &prompts[1], 12).await,
    );
    let follows: Vec<_> = [g1, g2]
        .into_iter()
        .map(|id| {
            let c = client.clone();
            tokio::spawn(async move { follow(&c, id).await })
        })
        .collect();

    // The middle stage dies mid-generation: the head's step fails and the head exits.
    wait_frontier(&client, g1, 20).await;
    stages[1].0.kill9();
    let status = h1
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("the head runs on without its middle stage:\n{}", h1.log_text()));
    assert_eq!(status.code(), Some(1), "an error exit: {}", h1.log_text());
    assert!(h1.log_text().contains("stage"), "{}", h1.log_text());

    // A new middle stage and a new head: both generations continue from their committed
    // prefixes, re-prefilled through the pipeline, exactly.
    stages[1] = start_stage(dir.path(), &path, "s2b", "10..20");
    let mut h2 = start_head(&cluster, "head-2", &path, &addrs(&stages));
    for ((id, f), (p, seed)) in [g1, g2].into_iter().zip(follows).zip(prompts.iter().zip([11, 12])) {
        let (toks, epochs) = f.await.unwrap();
        assert_eq!(
            toks,
            expected(model.as_ref(), p, seed),
            "generation {id}: the whole model's tokens"
        );
        let switch = epochs.iter().position(|&e| e != 1).expect("head-2 wrote the rest");
        assert!(switch >= 20 || id == g2, "generation {id}: {epochs:?}");
        assert!(epochs[switch..].iter().all(|&e| e == 2), "generation {id}: {epochs:?}");
    }

    // A whole decoder continues a pipeline's generation exactly: the head is killed mid-way.
    let g3 = submit(&client, model.as_ref(), "p3", &prompts[2], 13).await;
    let f3 = {
        let c = client.clone();
        tokio::spawn(async move { follow(&c, g3).await })
    };
    wait_frontier(&client, g3, 10).await;
    h2.kill9();
    let whole = cluster.start_real_decoder("whole", &path, &["--lease-ms", "1500"]);
    let (toks, epochs) = f3.await.unwrap();
    assert_eq!(
        toks,
        expected(model.as_ref(), &prompts[2], 13),
        "the whole model's tokens"
    );
    assert!(epochs[0] == 1 && *epochs.last().unwrap() == 2, "{epochs:?}");
    assert!(whole.log_text().contains("generation taken"), "{}", whole.log_text());
}

/// A head whose stages do not make the model (a gap, the wrong order, a missing end) refuses to
/// start and says which layer is missing; it never registers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_refuses_stages_that_do_not_make_the_model() {
    let _serial = serial();
    let path = model_path();
    let dir = tempfile::tempdir().unwrap();
    let (_a, a) = start_stage(dir.path(), &path, "a", "0..10");
    let (_b, b) = start_stage(dir.path(), &path, "b", "10..20");
    let (_c, c) = start_stage(dir.path(), &path, "c", "20..30");
    for (stages, says) in [
        (vec![a.clone(), c.clone()], "needs layer 10 next"),
        (vec![b.clone(), a.clone(), c.clone()], "needs layer 0 next"),
        (vec![a.clone(), b.clone()], "the last stage must end the model"),
    ] {
        let out = Command::new(bin())
            .args(["decoder", "--model", path.to_str().unwrap(), "--cluster", "127.0.0.1:1"])
            .args(["--pipeline", &stages.join(",")])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stages:?}: {err}");
        assert!(err.contains(says), "{stages:?}: {err}");
    }
}

/// Issue 16's first must-show, with a hot spare and only the dead stage's layers rebuilt: a
/// generation of 64 sampled tokens (exact mode) through 3 stage processes; the middle stage is
/// killed after 20 tokens; the head splices the spare of its layers in and goes on.
/// All 64 tokens equal the whole model's run, the client saw each once, and the generation never
/// left its head (one epoch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_spare_replaces_a_killed_middle_stage_and_the_generation_stays_with_its_head() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (path, model, cluster, mut stages) = setup(dir.path(), &["0..10", "10..20", "20..30"]);
    let client = cluster.client();
    let (_spare, spare) = start_stage(dir.path(), &path, "spare", "10..20");
    let list: Vec<String> = stages.iter().map(|s| s.1.clone()).collect();
    let mut head = cluster.start_real_decoder(
        "head",
        &path,
        &[
            "--pipeline",
            &list.join(","),
            "--pipeline-spares",
            &spare,
            "--lease-ms",
            "1500",
        ],
    );
    common::wait_for_model(&client).await;
    decode_64_failing_after_20(&client, model.as_ref(), "spare", 21, || stages[1].0.kill9()).await;
    assert!(
        head.wait_exit(Duration::ZERO).is_none(),
        "the head still runs:\n{}",
        head.log_text()
    );
    let log = head.log_text();
    assert!(log.contains("spliced a spare in its place"), "{log}");
    // Only the dead stage's layers were rebuilt, from the rows the head kept.
    assert!(log.contains("the spare rebuilt its layers"), "{log}");
    assert!(log.contains("sequences=1") && log.contains("in_full=0"), "{log}");
    assert!(!log.contains("feeding the sequence again in full"), "{log}");
}

/// A stage that answers an item one row short (the planted bug `short-stage-rows`, at the
/// prompt's pass) is broken to its head, like a dead one: the head splices the spare of its
/// layers in, and every token is the whole model's. Before, the head passed the short rows on:
/// the later stages fed one position fewer and gave the logits of the prompt's second-to-last
/// position; they refused the next pass ("holds 31 positions ..., fewer than 32"), the head's
/// worker failed on it and the decoder exited, and the generation ended without a token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_that_answers_a_row_short_is_spliced_out_before_a_token_comes_of_it() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (path, model, cluster, stages) = setup(dir.path(), &["10..20", "20..30"]);
    let client = cluster.client();
    let (short, short_addr) = start_stage_env(
        dir.path(),
        &path,
        "short",
        "0..10",
        &[],
        &[("TOKENLOG_PLANT_SHORT_STAGE_ROWS", "1")],
    );
    let (_spare, spare) = start_stage(dir.path(), &path, "spare", "0..10");
    let list = [short_addr.as_str(), &stages[0].1, &stages[1].1].join(",");
    let head = cluster.start_real_decoder(
        "head",
        &path,
        &["--pipeline", &list, "--pipeline-spares", &spare, "--lease-ms", "1500"],
    );
    common::wait_for_model(&client).await;
    let prompt = model
        .tokenizer()
        .encode_chat(&[tokenlog_decoder::ChatMessage::user("Tell me about lighthouses.")])
        .unwrap();
    let id = submit_n(&client, model.as_ref(), "short", &prompt, 5, 16).await;
    let (toks, _) = follow(&client, id).await;
    assert!(
        short
            .log_text()
            .contains("PLANTED: the answer lacks the item's last row"),
        "the planted bug fired:\n{}",
        short.log_text()
    );
    assert_eq!(
        toks,
        expected_n(model.as_ref(), &prompt, 5, 16),
        "the whole model's 16 tokens; the head's log:\n{}",
        head.log_text()
    );
    let log = head.log_text();
    assert!(
        log.contains("bytes of rows for") && log.contains("spliced a spare in its place"),
        "{log}"
    );
}

/// A stage that lost what it held of a sequence (the planted bug `stage-forgets=once`) refuses
/// the sequence's next item ("holds no positions of sequence N: feed it again from 0"). The
/// head feeds that sequence again, from 0 with its history, and every token is the whole
/// model's. Before, the refusal failed the head's whole step: its worker failed, the decoder
/// exited with every generation it held, and this one was never finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_a_stage_forgot_is_fed_again_from_0_and_decodes_on() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (path, model, cluster, stages) = setup(dir.path(), &["10..20", "20..30"]);
    let client = cluster.client();
    let (forgets, forgets_addr) = start_stage_env(
        dir.path(),
        &path,
        "forgets",
        "0..10",
        &[],
        &[("TOKENLOG_PLANT_STAGE_FORGETS", "once")],
    );
    let list = [forgets_addr.as_str(), &stages[0].1, &stages[1].1].join(",");
    let head = cluster.start_real_decoder("head", &path, &["--pipeline", &list]);
    common::wait_for_model(&client).await;
    let prompt = model
        .tokenizer()
        .encode_chat(&[tokenlog_decoder::ChatMessage::user("Tell me about lighthouses.")])
        .unwrap();
    let id = submit_n(&client, model.as_ref(), "forgot", &prompt, 5, 16).await;
    let (toks, epochs) = follow(&client, id).await;
    assert!(
        forgets.log_text().contains("PLANTED: the stage forgot the sequence"),
        "the planted bug fired:\n{}",
        forgets.log_text()
    );
    assert_eq!(
        toks,
        expected_n(model.as_ref(), &prompt, 5, 16),
        "the whole model's 16 tokens; the head's log:\n{}",
        head.log_text()
    );
    assert!(epochs.iter().all(|&e| e == 1), "it never left its head: {epochs:?}");
    assert!(
        head.log_text().contains("feeding the sequence again from 0"),
        "{}",
        head.log_text()
    );
}

/// A stage that refuses every item of one sequence (the planted bug `stage-forgets=always`),
/// from 0 too: that generation ends FAILED, saying why, and the head decodes its other
/// generation to the end, every token the whole model's. Before, the refusal failed the head's
/// whole step: the decoder exited and neither generation was finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_a_stage_keeps_refusing_fails_alone_and_the_head_decodes_the_other() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (path, model, cluster, stages) = setup(dir.path(), &["0..10", "20..30"]);
    let client = cluster.client();
    let (_refuses, refuses_addr) = start_stage_env(
        dir.path(),
        &path,
        "refuses",
        "10..20",
        &[],
        &[("TOKENLOG_PLANT_STAGE_FORGETS", "always")],
    );
    let prompt = model
        .tokenizer()
        .encode_chat(&[tokenlog_decoder::ChatMessage::user("Tell me about lighthouses.")])
        .unwrap();
    let a = submit_n(&client, model.as_ref(), "a", &prompt, 5, 16).await;
    let b = submit_n(&client, model.as_ref(), "b", &prompt, 6, 16).await;
    let list = [stages[0].1.as_str(), &refuses_addr, &stages[1].1].join(",");
    let mut head = cluster.start_real_decoder("head", &path, &["--pipeline", &list]);
    let (ta, _) = follow(&client, a).await;
    let (tb, _) = follow(&client, b).await;
    let (ga, gb) = (generation(&client, a).await, generation(&client, b).await);
    let failed = pb::GenerationState::Failed as i32;
    let (lost, kept, kept_toks, seed) = match (ga.state == failed, gb.state == failed) {
        (true, false) => (ga, gb, tb, 6),
        (false, true) => (gb, ga, ta, 5),
        _ => panic!("one generation fails: {ga:?} {gb:?}\n{}", head.log_text()),
    };
    assert!(
        lost.finish_detail.contains("could not continue it")
            && lost.finish_detail.contains("PLANTED: the stage refuses sequence"),
        "{}",
        lost.finish_detail
    );
    assert_eq!(kept.state, pb::GenerationState::Finished as i32, "{kept:?}");
    assert_eq!(kept_toks, expected_n(model.as_ref(), &prompt, seed, 16));
    assert!(
        head.wait_exit(Duration::ZERO).is_none(),
        "the head runs on:\n{}",
        head.log_text()
    );
}

/// A stage told to stop (SIGTERM) while a head holds its stream stops within the grace; the
/// head's stream to it breaks. It waited for the head's stream to end, which a running head
/// never does: only SIGKILL stopped it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_told_to_stop_stops_while_a_head_holds_its_stream() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (path, _model, cluster, mut stages) = setup(dir.path(), &["0..15", "15..30"]);
    let client = cluster.client();
    let list: Vec<String> = stages.iter().map(|s| s.1.clone()).collect();
    let _head = start_head(&cluster, "head", &path, &list);
    common::wait_for_model(&client).await;
    let stage = &mut stages[0].0;
    stage.signal("-TERM");
    let within = tokenlog_raftlog::limits::SHUTDOWN_GRACE + Duration::from_secs(5);
    let status = stage.wait_exit(within);
    assert!(
        status.is_some_and(|s| s.success()),
        "the stage exits cleanly within {within:?}: {status:?}\n{}",
        stage.log_text()
    );
    assert!(stage.log_text().contains("stage stopped"), "{}", stage.log_text());
}

/// A head of a capacity above what a stage takes in one request (`STAGE_ITEMS_MAX`, 256
/// items) decodes every generation: a pass goes to the stages in requests that each fit.
/// Before, a step of its 260 generations went as one request; the stage refused it, the head
/// took the stage for broken, found no spare, and its decoder failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_of_more_generations_than_one_stage_request_takes_decodes_them_all() {
    const N: usize = 260;
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (path, model, cluster, stages) = setup(dir.path(), &["0..15", "15..30"]);
    let client = cluster.client();
    let prompt = model.tokenizer().encode("Lighthouses").unwrap();
    // All pending before the head starts: it takes them at once, and its steps feed them all.
    let ids = futures::future::join_all((0..N).map(|i| {
        let (client, model, prompt) = (client.clone(), model.clone(), prompt.clone());
        async move { submit_n(&client, model.as_ref(), &format!("many-{i}"), &prompt, i as u64, 3).await }
    }))
    .await;
    let list: Vec<String> = stages.iter().map(|s| s.1.clone()).collect();
    let head = cluster.start_real_decoder(
        "head",
        &path,
        &[
            "--pipeline",
            &list.join(","),
            "--capacity",
            "300",
            "--lease-ms",
            "10000",
        ],
    );
    for (i, id) in ids.iter().enumerate() {
        let (toks, _) = follow(&client, *id).await;
        assert_eq!(
            toks.len(),
            3,
            "generation {i}: {toks:?}; the head's log:\n{}",
            head.log_text()
        );
        if i % 100 == 0 {
            assert_eq!(toks, expected_n(model.as_ref(), &prompt, i as u64, 3), "generation {i}");
        }
    }
    let log = head.log_text();
    assert!(!log.contains("spliced") && !log.contains("failed"), "{log}");
}

/// What a stage answers to one request of a head stamped `(head, epoch)`: the stream's first
/// message (a stale head's work, as a paused or partitioned old head would send it).
async fn ask_stage(addr: &str, head: &str, epoch: u64) -> Result<dpb::ForwardResponse, tonic::Status> {
    let mut c = dpb::stage_client::StageClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let req = dpb::ForwardRequest {
        items: vec![dpb::StageItem {
            sequence: 1,
            start: 0,
            tokens: vec![1, 2, 3],
            hidden: vec![],
        }],
        release: vec![],
        head: head.into(),
        pipeline_epoch: epoch,
    };
    let mut answers = c.forward(futures::stream::iter(vec![req])).await?.into_inner();
    match answers.message().await {
        Ok(Some(r)) => Ok(r),
        Ok(None) => Err(tonic::Status::unknown("the stage ended its stream without an answer")),
        Err(s) => Err(s),
    }
}

/// A first stage asked for more positions in one request than one message of hidden states
/// holds refuses at once and lives on: 64 items of 500 tokens (~128 KB on the wire) made the
/// stage run all 32,000 positions through its layers, with scratch for all of them (256 items
/// of a whole context: tens of GB), before finding that its answer could not be sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_refuses_a_request_of_more_positions_than_its_answer_can_carry() {
    let dir = tempfile::tempdir().unwrap();
    let (mut stage, addr) = start_stage(dir.path(), &model_path(), "s-big", "0..10");
    let mut c = dpb::stage_client::StageClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let req = dpb::ForwardRequest {
        items: (0..64)
            .map(|i| dpb::StageItem {
                sequence: i,
                start: 0,
                tokens: vec![1; 500],
                hidden: vec![],
            })
            .collect(),
        release: vec![],
        head: "head".into(),
        pipeline_epoch: 1,
    };
    let answered = tokio::time::timeout(Duration::from_secs(30), async {
        let mut answers = c.forward(futures::stream::iter(vec![req])).await?.into_inner();
        answers.message().await
    })
    .await
    .expect("answered at once, not after a pass over every position");
    let e = answered.expect_err("refused");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().contains("32000 positions"), "{e}");
    // The stage still serves.
    let r = ask_stage(&addr, "head", 1).await.unwrap();
    assert_eq!(r.results.len(), 1);
    assert!(stage.wait_exit(Duration::ZERO).is_none(), "{}", stage.log_text());
}

/// Issue 16's second must-show: a paused old stage resumed after the splice is rejected by
/// epoch and changes nothing. Stages started with the log's addresses; the middle stage is
/// paused (SIGSTOP) after 20 of 64 sampled tokens; its registration in the log lapses, the
/// head splices its hot spare in with one write to the log (a new pipeline epoch), and the
/// generation finishes with the whole model's tokens. The old stage is continued (SIGCONT):
/// work stamped with the old epoch, or with the current one (whose composition does not name
/// it), is refused with FAILED_PRECONDITION; a live stage refuses the old epoch too; the
/// composition and the generation are as they were, and the pipeline decodes on exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_stage_spliced_out_is_refused_by_epoch_when_it_resumes_and_changes_nothing() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (path, model, cluster, stages) = fenced_setup(dir.path(), &["0..10", "10..20", "20..30"]);
    let client = cluster.client();
    let nodes = cluster.addrs.join(",");
    let with_log = ["--cluster", nodes.as_str()];
    let (_spare, spare) = start_stage_with(dir.path(), &path, "spare", "10..20", &with_log);
    let list: Vec<String> = stages.iter().map(|s| s.1.clone()).collect();
    // A lease longer than the keepalive's detection: the generation stays with its head.
    let mut head = cluster.start_real_decoder(
        "head",
        &path,
        &[
            "--pipeline",
            &list.join(","),
            "--pipeline-spares",
            &spare,
            "--lease-ms",
            "6000",
        ],
    );
    common::wait_for_model(&client).await;
    let first = client.get_pipeline("head", true).await.unwrap();
    let ids = |p: &pb::PipelineInfo| p.stages.iter().map(|s| s.stage_id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&first), ["s1", "s2", "s3"], "{first:?}");

    let (prompt, id) =
        decode_64_failing_after_20(&client, model.as_ref(), "paused", 31, || stages[1].0.signal("-STOP")).await;
    let log = head.log_text();
    assert!(log.contains("spliced a spare in its place"), "{log}");
    // Detected by its registration in the log lapsing (its stream stayed open).
    assert!(log.contains("its registration in the log lapsed"), "{log}");
    let spliced = client.get_pipeline("head", true).await.unwrap();
    assert!(spliced.epoch > first.epoch, "{first:?} -> {spliced:?}");
    assert_eq!(ids(&spliced), ["s1", "spare", "s3"], "{spliced:?}");

    // The old stage comes back; what a stale head (or a replayed message) would send it.
    stages[1].0.signal("-CONT");
    let gen_before = generation(&client, id).await;
    for (who, addr, epoch, says) in [
        (
            "the resumed stage, old epoch",
            stages[1].1.as_str(),
            first.epoch,
            "is stale",
        ),
        (
            "the resumed stage, current epoch",
            stages[1].1.as_str(),
            spliced.epoch,
            "does not name this stage",
        ),
        ("a live stage, old epoch", stages[0].1.as_str(), first.epoch, "is stale"),
    ] {
        let e = ask_stage(addr, "head", epoch).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{who}: {e:?}");
        assert!(e.message().contains(says), "{who}: {}", e.message());
    }
    assert!(
        stages[1].0.log_text().contains("refused a head's request"),
        "{}",
        stages[1].0.log_text()
    );
    // Nothing changed: the composition, the generation; and the pipeline decodes on exactly.
    assert_eq!(client.get_pipeline("head", true).await.unwrap(), spliced);
    let gen_after = generation(&client, id).await;
    assert_eq!(gen_after, gen_before);
    let id2 = submit_n(&client, model.as_ref(), "after", &prompt, 32, 16).await;
    let (toks, _) = follow(&client, id2).await;
    assert_eq!(
        toks,
        expected_n(model.as_ref(), &prompt, 32, 16),
        "the spliced pipeline decodes on"
    );
    assert!(
        head.wait_exit(Duration::ZERO).is_none(),
        "the head still runs:\n{}",
        head.log_text()
    );
}

/// Spares in the log: a cold spare (`tokenlog stage --cold`, registered in the log, no layers
/// loaded) is found there by a head that was given no spares when its middle stage is killed
/// after 20 of 64 sampled tokens; it loads the dead stage's layers, is spliced in and rebuilds
/// them; the 64 tokens equal the whole model's and never left their head. The log then lists
/// the spare with its layers, the dead stage's registration lapses, and `tokenlog status`
/// shows the composition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_spare_registered_in_the_log_replaces_a_killed_middle_stage() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (path, model, cluster, mut stages) = fenced_setup(dir.path(), &["0..10", "10..20", "20..30"]);
    let client = cluster.client();
    let nodes = cluster.addrs.join(",");
    let with_log = ["--cluster", nodes.as_str()];
    let (_cold, cold_addr) = start_stage_with(dir.path(), &path, "cold", "cold", &with_log);
    let registered = |r: &pb::ListStagesResponse, id: &str| r.stages.iter().find(|s| s.stage_id == id).cloned();
    let deadline = Instant::now() + Duration::from_secs(30);
    let cold = loop {
        let r = client.list_stages(true).await.unwrap();
        if let (Some(c), 4) = (registered(&r, "cold"), r.stages.len()) {
            break c;
        }
        assert!(Instant::now() < deadline, "the stages did not register: {r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (cold.first_layer, cold.end_layer, cold.addr.as_str()),
        (0, 0, cold_addr.as_str())
    );
    let list: Vec<String> = stages.iter().map(|s| s.1.clone()).collect();
    let mut head = cluster.start_real_decoder("head", &path, &["--pipeline", &list.join(","), "--lease-ms", "6000"]);
    common::wait_for_model(&client).await;
    decode_64_failing_after_20(&client, model.as_ref(), "cold", 41, || stages[1].0.kill9()).await;
    let log = head.log_text();
    assert!(
        log.contains("spliced a spare in its place") && log.contains("cold=true"),
        "{log}"
    );
    assert!(
        log.contains("in_full=0"),
        "only the dead stage's layers were rebuilt: {log}"
    );
    let p = client.get_pipeline("head", true).await.unwrap();
    let ids: Vec<&str> = p.stages.iter().map(|s| s.stage_id.as_str()).collect();
    assert_eq!(ids, ["s1", "cold", "s3"], "{p:?}");
    // The spare now registers its layers; the dead stage's registration lapses.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = client.list_stages(true).await.unwrap();
        let c = registered(&r, "cold").expect("the spare stays registered");
        if (c.first_layer, c.end_layer) == (10, 20) && registered(&r, "s2").is_none() {
            break;
        }
        assert!(Instant::now() < deadline, "{r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = Command::new(bin())
        .args(["status", "--cluster", &nodes])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("pipelines") && text.contains("head head"), "{text}");
    assert!(text.contains(&format!("cold 10..20 at {cold_addr}")), "{text}");
    assert!(
        head.wait_exit(Duration::ZERO).is_none(),
        "the head still runs:\n{}",
        head.log_text()
    );
}

/// A stage killed and restarted under its old id (as a supervisor restarts it), registered in
/// the log again at a new address, is spliced back in its own place. Before, the head took the
/// id for one of its own live stages, never tried it, found no spare and failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_restarted_under_its_old_id_is_spliced_back_in() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (path, model, cluster, mut stages) = fenced_setup(dir.path(), &["0..10", "10..20", "20..30"]);
    let client = cluster.client();
    let nodes = cluster.addrs.join(",");
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.list_stages(true).await.unwrap().stages.len() < 3 {
        assert!(Instant::now() < deadline, "the stages did not register");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let list: Vec<String> = stages.iter().map(|s| s.1.clone()).collect();
    let mut head = cluster.start_real_decoder("head", &path, &["--pipeline", &list.join(","), "--lease-ms", "6000"]);
    common::wait_for_model(&client).await;
    let mut restarted = None;
    decode_64_failing_after_20(&client, model.as_ref(), "restart", 43, || {
        stages[1].0.kill9();
        // The same id (and log file), a new port.
        restarted = Some(start_stage_with(
            dir.path(),
            &path,
            "s2",
            "10..20",
            &["--cluster", nodes.as_str()],
        ));
    })
    .await;
    let (_s2, addr) = restarted.expect("restarted");
    let log = head.log_text();
    assert!(log.contains("spliced a spare in its place"), "{log}");
    let p = client.get_pipeline("head", true).await.unwrap();
    let placed: Vec<(&str, &str)> = p
        .stages
        .iter()
        .map(|s| (s.stage_id.as_str(), s.addr.as_str()))
        .collect();
    assert_eq!(placed[1], ("s2", addr.as_str()), "{p:?}");
    assert!(
        head.wait_exit(Duration::ZERO).is_none(),
        "the head still runs:\n{}",
        head.log_text()
    );
}

/// A stage without TLS refuses to listen beyond loopback (anyone reaching it could read every
/// generation's rows), unless told `--insecure`; it says what to give instead.
#[test]
fn a_stage_without_tls_refuses_to_listen_beyond_loopback() {
    let out = Command::new(bin())
        .args([
            "stage",
            "--model",
            "/nonexistent.gguf",
            "--layers",
            "0..10",
            "--listen",
            "0.0.0.0:0",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("refusing to serve a stage in plain text") && err.contains("--tls-ca"),
        "{err}"
    );
}

/// The same for a decoder's handoff listener (`--handoff-listen`): without TLS, loopback only,
/// unless `--insecure`. Before, it served plain text on any address given.
#[test]
fn a_decoder_without_tls_refuses_to_serve_handoffs_beyond_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("decoder.log");
    let mut child = Command::new(bin())
        .args(["decoder", "--fake", "--cluster", "127.0.0.1:1"])
        .args(["--handoff-listen", "0.0.0.0:0", "--handoff-advertise", "127.0.0.1:1"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() >= deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.and_then(|s| s.code()), Some(1), "it refuses to start: {err}");
    assert!(
        err.contains("refusing to serve handoffs in plain text") && err.contains("--tls-ca"),
        "{err}"
    );
}

/// A pipeline head of more generations than a stage keeps for one head refuses to start, and
/// says why. It started, and its stages refused the sequences past 1,024, one per step.
#[test]
fn a_head_of_a_capacity_its_stages_cannot_hold_refuses_to_start() {
    let out = Command::new(bin())
        .args(["decoder", "--cluster", "127.0.0.1:1", "--decoder-id", "head"])
        .args(["--pipeline", "127.0.0.1:1", "--capacity", "1025"])
        .args(["--model", "/nonexistent.gguf"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // Refused when the flags are read now, pipeline or not: no decoder takes more than one
    // append's 1,024 items (ITEMS_PER_APPEND_MAX).
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--capacity") && err.contains("at most 1024"), "{err}");
}

/// Over mutual TLS a stage takes from a caller only requests stamped with a head its decoder
/// certificate may act as: decoder-2 stamping decoder-1's name is refused (PERMISSION_DENIED),
/// its own name is served. Before, any decoder certificate could speak as any head (and,
/// without the log, move that head's fence to an epoch its real requests were then refused at).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_serves_a_caller_only_as_the_head_its_certificate_names() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    common::make_certs(dir.path(), &["--decoder", "stage-a,decoder-1,decoder-2"]);
    let tls = common::tls_args(dir.path(), "stage-a");
    let tls: Vec<&str> = tls.iter().map(String::as_str).collect();
    let (_stage, addr) = start_stage_with(dir.path(), &model_path(), "stage-a", "0..30", &tls);
    let cfg = common::tls(dir.path(), "decoder-2").client_config_for(tokenlog_raftlog::tls::DECODER_SERVER_NAME);
    let ch = common::tls_channel(&addr, cfg).await;
    let pass = |head: &str| dpb::ForwardRequest {
        items: vec![dpb::StageItem {
            sequence: 1,
            start: 0,
            tokens: vec![1, 2, 3],
            hidden: Vec::new(),
        }],
        release: Vec::new(),
        head: head.into(),
        pipeline_epoch: 1,
    };
    let mut stage = dpb::stage_client::StageClient::new(ch);
    let mut outcome = Vec::new();
    for head in ["decoder-1", "decoder-2"] {
        let got = match stage.forward(futures::stream::iter([pass(head)])).await {
            Ok(r) => match r.into_inner().next().await {
                Some(Ok(a)) => Ok(a.results.len()),
                Some(Err(s)) => Err(s.code()),
                None => Err(tonic::Code::Unknown),
            },
            Err(s) => Err(s.code()),
        };
        outcome.push((head, got));
    }
    assert_eq!(
        outcome,
        vec![("decoder-1", Err(tonic::Code::PermissionDenied)), ("decoder-2", Ok(1))]
    );
}
