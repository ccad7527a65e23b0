//! `tokenlog bench decode` and `tokenlog bench failover`: the decoder's cost of writing through
//! the log, re-prefill time, and how long a client waits when the owning decoder dies.

use std::process::{Child, Command, Stdio};

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use tokenlog_decoder::worker::{identity_to_pb, Worker, WorkerConfig};
use tokenlog_decoder::{DecodeState, Model, ResumeMode, SamplingConfig, StopConfig};
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

use tokenlog_raftlog::limits::LEASE_MS_DEFAULT;

use crate::cmd::bench::{start_tokenlog, wait_for_leader};
use crate::cmd::decoder::{load_model, DecoderArgs};

#[derive(clap::Args, Clone)]
pub struct DecodeArgs {
    /// Tokens generated per measurement.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub tokens: u32,
    /// Prefix lengths for the re-prefill timings (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "16,64,128,256", value_parser = crate::cmd::at_least_one)]
    pub prefixes: Vec<usize>,
    /// Use the fake model (instant; checks the plumbing, not the ratio).
    #[arg(long)]
    pub fake: bool,
    /// GGUF model (default: the bundled SmolLM2).
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
    /// Model threads.
    #[arg(long, default_value_t = 1, value_parser = crate::cmd::at_least_one)]
    pub threads: usize,
    /// Rounds of a raw run and a run through the log (raw first in even rounds, the log first
    /// in odd ones); the ratio is over all rounds.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub rounds: u64,
    /// First loopback port for the 3 log nodes.
    #[arg(long, default_value_t = 27_300, value_parser = crate::cmd::base_port)]
    pub base_port: u16,
    /// Concurrent generations for the batching table (comma-separated): the model alone
    /// decoding that many at once (one batched forward pass per step) and the same number of
    /// generations through one decoder and the log; aggregate tok/s against concurrency 1.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8", value_parser = crate::cmd::at_least_one)]
    pub concurrency: Vec<usize>,
    /// A Python with the `llama_cpp` package (llama-cpp-python): the same GGUF, prompt and
    /// thread count decoded greedily by llama.cpp in the same run, for the single-sequence
    /// comparison. Without it the bench prints how to install one.
    #[arg(long, value_name = "PYTHON")]
    pub llama_cpp: Option<std::path::PathBuf>,
}

#[derive(clap::Args, Clone)]
pub struct FailoverArgs {
    /// How many times to kill the owning decoder.
    #[arg(long, default_value_t = 20, value_parser = crate::cmd::at_least_one)]
    pub kills: usize,
    /// Lease (ms) of the decoders. A kill is detected when the victim's session with the leader
    /// breaks (at once); the lease bounds detection only if that fails.
    #[arg(long, default_value_t = LEASE_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(tokenlog_raftlog::limits::LEASE_MS_MIN..=tokenlog_raftlog::limits::LEASE_MS_MAX))]
    pub lease_ms: u64,
    /// Records committed before the kill.
    #[arg(long, default_value_t = 8)]
    pub after: u32,
    /// Use the fake model (with --fake-step-ms per step) instead of SmolLM2.
    #[arg(long)]
    pub fake: bool,
    #[arg(long, default_value_t = 20)]
    pub fake_step_ms: u64,
    /// First loopback port for the 3 log nodes.
    #[arg(long, default_value_t = 27_400, value_parser = crate::cmd::base_port)]
    pub base_port: u16,
    /// Hot standby: the decoders run with `--standby 1`, and each kill waits until the log names
    /// the other decoder as the generation's standby and 16 more records were committed (the
    /// standby's first prefill and catch-up); the takeover then continues from the followed
    /// state. Without it the takeover re-prefills (cold).
    #[arg(long)]
    pub standby: bool,
}

pub(crate) fn dargs(fake: bool, model: Option<std::path::PathBuf>, threads: usize) -> DecoderArgs {
    DecoderArgs {
        cluster: vec![],
        model,
        fake,
        pipeline: vec![],
        pipeline_spares: vec![],
        pipeline_keep_mib: 1024,
        fake_step_ms: 0,
        model_name: None,
        device: "cpu".into(),
        capacity: 1,
        lease_ms: LEASE_MS_DEFAULT,
        threads,
        decoder_id: None,
        metrics_listen: None,
        history: None,
        stall_ms: tokenlog_decoder::limits::STALL_MS_DEFAULT,
        handoff_listen: None,
        handoff_advertise: None,
        insecure: false,
        drain_ms: 0,
        rebalance: false,
        standby: 0,
        prefix_cache: false,
        prefix_cache_dir: None,
        tls: Default::default(),
    }
}

pub(crate) fn binding(model: &dyn Model, prompt: &[u32], max_tokens: u32) -> pb::Binding {
    pb::Binding {
        model: Some(identity_to_pb(model.identity())),
        prompt_token_ids: prompt.to_vec(),
        sampling: Some(pb::SamplingConfig {
            temperature: 0.0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            rng_version: tokenlog_decoder::RNG_VERSION,
            ..Default::default()
        }),
        stop: Some(pb::StopConfig {
            max_tokens,
            ..Default::default()
        }),
        mode: pb::ResumeMode::Exact as i32,
        ..Default::default()
    }
}

pub(crate) fn prompt_ids(model: &dyn Model) -> anyhow::Result<Vec<u32>> {
    let t = model.tokenizer();
    Ok(t.encode_chat(&[tokenlog_decoder::ChatMessage::user(
        "Write a long story about a lighthouse keeper and the sea.",
    )])?)
}

fn stop(n: u32) -> StopConfig {
    StopConfig {
        max_tokens: n,
        stop_strings: vec![],
        eos_token_ids: vec![],
    }
}

/// The model alone, one token per step: (tokens, seconds of decoding, prefill excluded).
async fn raw_decode(model: &std::sync::Arc<dyn Model>, prompt: &[u32], n: u32) -> anyhow::Result<(Vec<u32>, f64)> {
    let (m, p) = (model.clone(), prompt.to_vec());
    tokio::task::spawn_blocking(move || -> anyhow::Result<(Vec<u32>, f64)> {
        let mut st = DecodeState::start(m.as_ref(), &p, SamplingConfig::greedy(), stop(n))?;
        let t = Instant::now();
        let mut out = Vec::new();
        while let Some(step) = st.next_token()? {
            out.push(step.token);
        }
        Ok((out, t.elapsed().as_secs_f64()))
    })
    .await?
}

/// llama.cpp (through llama-cpp-python) on the same GGUF, prompt ids and threads: its greedy
/// decode rate (prefill excluded) over `a.rounds` runs and its prefill time, beside tokenlog's
/// raw decode rate and greedy tokens measured above and tokenlog's prefill of the same prompt
/// measured now.
const LLAMA_CPP_SCRIPT: &str = r#"
import sys, time
import llama_cpp
from llama_cpp import Llama
path, threads, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompt = [int(t) for t in sys.argv[5].split(",")]
# Decoding reads each step's logits (logits_all); the prefill is timed on a second instance
# that computes only the last position's logits, as tokenlog's prefill does.
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=len(prompt) + n + 8,
            logits_all=True, verbose=False)
pre = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=len(prompt) + 8,
            verbose=False)
decode_s, prefill_s, out = 0.0, [], []
for r in range(rounds):
    pre.reset()
    t0 = time.perf_counter(); pre.eval(prompt); prefill_s.append(time.perf_counter() - t0)
    llm.reset()
    llm.eval(prompt)
    out = []
    t1 = time.perf_counter()
    for i in range(n):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        out.append(tok)
        if i + 1 < n:
            llm.eval([tok])
    decode_s += time.perf_counter() - t1
print("llama.cpp", llama_cpp.__version__, n * rounds / decode_s, min(prefill_s) * 1e3, ",".join(map(str, out)))
"#;

async fn llama_cpp_comparison(
    a: &DecodeArgs,
    model: &std::sync::Arc<dyn Model>,
    prompt: &[u32],
    (raw_rate, ours): (f64, &[u32]),
) -> anyhow::Result<()> {
    let path = match &a.model {
        Some(p) => p.clone(),
        None => tokenlog_decoder::fetch::ensure_default_model(&tokenlog_decoder::fetch::working_models_dir())?,
    };
    let Some(python) = &a.llama_cpp else {
        say!(
            "llama.cpp comparison: python3 -m venv V && V/bin/pip install llama-cpp-python==0.3.36 && \
             tokenlog bench decode --llama-cpp V/bin/python"
        );
        return Ok(());
    };
    // tokenlog's prefill of the same prompt, best of the rounds.
    let (m, p) = (model.clone(), prompt.to_vec());
    let rounds = a.rounds;
    let ours_prefill = tokio::task::spawn_blocking(move || -> anyhow::Result<f64> {
        let mut best = f64::MAX;
        for _ in 0..rounds {
            let mut s = m.new_sequence()?;
            let t = Instant::now();
            s.prefill(&p)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(best)
    })
    .await??;
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let out = Command::new(python)
        .args(["-c", LLAMA_CPP_SCRIPT])
        .arg(&path)
        .args([
            a.threads.to_string(),
            a.tokens.to_string(),
            a.rounds.to_string(),
            ids.join(","),
        ])
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("llama.cpp ")).with_context(|| {
        format!(
            "{} printed no result (is llama-cpp-python installed there?): {}",
            python.display(),
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
        )
    })?;
    let f: Vec<&str> = line.split(' ').collect();
    anyhow::ensure!(f.len() == 5, "unexpected llama.cpp line: {line}");
    let (version, rate, prefill_ms) = (f[1], f[2].parse::<f64>()?, f[3].parse::<f64>()?);
    let theirs: Vec<u32> = f[4].split(',').filter_map(|t| t.parse().ok()).collect();
    let same = ours.iter().zip(&theirs).take_while(|(x, y)| x == y).count();
    say!(
        "llama.cpp {version} raw decode {rate:>8.1} tok/s; tokenlog raw / llama.cpp {:.3}x (goal >= 1)",
        raw_rate / rate
    );
    say!(
        "prefill of the {} prompt tokens: tokenlog {:.1} ms, llama.cpp {prefill_ms:.1} ms (tokenlog / llama.cpp {:.3}x time); \
         greedy tokens the same for the first {same} of {}",
        prompt.len(),
        ours_prefill * 1e3,
        ours_prefill * 1e3 / prefill_ms,
        a.tokens
    );
    Ok(())
}

/// `c` generations of the model alone, decoded together (one batched forward pass per step):
/// (each one's tokens, seconds of decoding, prefills excluded).
pub(crate) async fn raw_batched(
    model: &std::sync::Arc<dyn Model>,
    prompt: &[u32],
    n: u32,
    c: usize,
) -> anyhow::Result<(Vec<Vec<u32>>, f64)> {
    let (m, p) = (model.clone(), prompt.to_vec());
    tokio::task::spawn_blocking(move || -> anyhow::Result<(Vec<Vec<u32>>, f64)> {
        let mut states = (0..c)
            .map(|_| DecodeState::start(m.as_ref(), &p, SamplingConfig::greedy(), stop(n)))
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = vec![Vec::new(); c];
        let t = Instant::now();
        loop {
            let mut refs: Vec<&mut DecodeState> = states.iter_mut().collect();
            DecodeState::feed_pending_batch(m.as_ref(), &mut refs)?;
            let mut any = false;
            for (s, o) in states.iter_mut().zip(out.iter_mut()) {
                if let Some(step) = s.next_token()? {
                    o.push(step.token);
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        Ok((out, t.elapsed().as_secs_f64()))
    })
    .await?
}

/// `c` generations submitted at once to one decoder through the log: (each one's committed
/// tokens, aggregate tok/s over the records after each one's first visible batch, from the
/// first of those batches to the last record).
async fn logged_batched(
    client: &LogClient,
    model: &dyn Model,
    prompt: &[u32],
    n: u32,
    c: usize,
    tag: &str,
) -> anyhow::Result<(Vec<Vec<u32>>, f64)> {
    let mut tasks = Vec::new();
    for i in 0..c {
        let sub = client
            .submit(pb::SubmitRequest {
                tenant: "bench".into(),
                request_id: format!("{tag}-{i}"),
                binding: Some(binding(model, prompt, n)),
            })
            .await?;
        let gid = sub.generation.context("no generation")?.generation_id;
        let client = client.clone();
        tasks.push(tokio::spawn(async move { watch_to_end(&client, gid).await }));
    }
    let mut runs = Vec::new();
    for t in tasks {
        runs.push(t.await??);
    }
    let start = runs.iter().map(|r| r.1).min().context("no generation")?;
    let end = runs.iter().map(|r| r.3).max().context("no generation")?;
    let visible: usize = runs.iter().map(|r| r.0.len().saturating_sub(r.2)).sum();
    let rate = visible as f64 / (end - start).as_secs_f64().max(1e-9);
    Ok((runs.into_iter().map(|r| r.0).collect(), rate))
}

/// One generation through the worker and the log, watched like a client: (committed tokens,
/// seconds from the first visible batch of records to the last, size of that first batch).
async fn logged_decode(
    client: &LogClient,
    model: &dyn Model,
    prompt: &[u32],
    n: u32,
    request_id: String,
) -> anyhow::Result<(Vec<u32>, f64, usize)> {
    let sub = client
        .submit(pb::SubmitRequest {
            tenant: "bench".into(),
            request_id,
            binding: Some(binding(model, prompt, n)),
        })
        .await?;
    let gid = sub.generation.context("no generation")?.generation_id;
    let (logged, t, first_batch, end) = watch_to_end(client, gid).await?;
    Ok((logged, (end - t).as_secs_f64(), first_batch))
}

/// Follows a generation's committed records to its end, like a client: (its tokens, when the
/// first batch of records became visible, that batch's size, when the generation ended).
async fn watch_to_end(client: &LogClient, gid: u64) -> anyhow::Result<(Vec<u32>, Instant, usize, Instant)> {
    let mut w = client.watch(gid, 0).await?;
    let mut first: Option<(Instant, usize)> = None;
    let mut logged = Vec::new();
    while let Some(ev) = w.message().await? {
        if !ev.records.is_empty() {
            first.get_or_insert((Instant::now(), ev.records.len()));
        }
        logged.extend(ev.records.iter().map(|r| r.token_id));
        if ev.terminal.is_some() {
            break;
        }
    }
    let (t, first_batch) = first.context("no record became visible")?;
    Ok((logged, t, first_batch, Instant::now()))
}

pub async fn decode(a: DecodeArgs) -> anyhow::Result<()> {
    let (model, name) = load_model(&dargs(a.fake, a.model.clone(), a.threads))?;
    let prompt = prompt_ids(model.as_ref())?;
    say!(
        "bench decode: model {name}, {} thread(s), prompt {} tokens, {} tokens per run, {} rounds; CPU kernels: {}",
        a.threads,
        prompt.len(),
        a.tokens,
        a.rounds,
        tokenlog_decoder::cpu_engine_kernels()
    );
    // The 3-node log and the lease worker run through every round, so both measurements share
    // the machine's state; only where the tokens go differs.
    let dir = tempfile::tempdir()?;
    let _procs = start_tokenlog(dir.path(), a.base_port)?;
    let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", a.base_port + i)).collect();
    let client = LogClient::new(addrs.clone())?;
    wait_for_leader(&client).await?;
    let mut cfg = WorkerConfig::new("bench-decoder".into(), name.clone());
    cfg.capacity = a.concurrency.iter().copied().max().unwrap_or(1).max(1);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let worker = tokio::spawn(Worker::new(cfg, LogClient::new(addrs)?, model.clone()).run(stop_rx));

    // Rounds alternate raw candle decode and the same greedy generation through the log.
    let (mut raw_n, mut raw_s, mut log_n, mut log_s) = (0usize, 0f64, 0usize, 0f64);
    let mut raw_tokens = Vec::new();
    for round in 0..a.rounds {
        // ABBA: odd rounds run the log first, so neither side always runs on a warmer machine.
        let raw_first = round % 2 == 0;
        let mut raw_run = None;
        if raw_first {
            raw_run = Some(raw_decode(&model, &prompt, a.tokens).await?);
        }
        let (logged, lsecs, first_batch) =
            logged_decode(&client, model.as_ref(), &prompt, a.tokens, format!("decode-{round}")).await?;
        let (raw, secs) = match raw_run {
            Some(r) => r,
            None => raw_decode(&model, &prompt, a.tokens).await?,
        };
        // The first visible batch's time includes prefill; the rate is over the records after it.
        let visible = logged.len().saturating_sub(first_batch);
        say!(
            "round {round}: raw {:>6.1} tok/s   through the log {:>6.1} tok/s   ratio {:.3}{}",
            raw.len() as f64 / secs,
            visible as f64 / lsecs.max(1e-9),
            (visible as f64 / lsecs.max(1e-9)) / (raw.len() as f64 / secs),
            if raw_first { "" } else { "   (log first)" }
        );
        if logged != raw {
            say!("WARNING: the logged tokens differ from the raw run (same greedy prompt)");
        }
        (raw_n, raw_s, log_n, log_s) = (raw_n + raw.len(), raw_s + secs, log_n + visible, log_s + lsecs);
        raw_tokens = raw;
    }
    let (raw_rate, log_rate) = (raw_n as f64 / raw_s, log_n as f64 / log_s.max(1e-9));
    say!("raw model decode          {raw_rate:>8.1} tok/s  ({raw_n} tokens in {raw_s:.2} s, prefill excluded)");
    say!("decoder -> 3-node log     {log_rate:>8.1} tok/s  ({log_n} tokens committed after the first visible batch, visible at the client)");
    say!(
        "ratio log / raw           {:>8.3}x  (goal >= 0.95)",
        log_rate / raw_rate
    );
    if !a.fake {
        llama_cpp_comparison(&a, &model, &prompt, (raw_rate, &raw_tokens)).await?;
    }

    // Batching: aggregate tok/s with c generations at once, against c = 1 in the same run.
    if !a.concurrency.is_empty() {
        say!(
            "batching ({} tokens each, same greedy prompt; aggregate tok/s):",
            a.tokens
        );
        say!("  concurrency   model alone (x c=1)    through the log (x c=1)   log/alone");
        let (mut raw1, mut log1) = (None, None);
        for &c in a.concurrency.iter().filter(|&&c| c > 0) {
            let (raw_out, secs) = raw_batched(&model, &prompt, a.tokens, c).await?;
            let raw_agg = raw_out.iter().map(Vec::len).sum::<usize>() as f64 / secs.max(1e-9);
            let (log_out, log_agg) =
                logged_batched(&client, model.as_ref(), &prompt, a.tokens, c, &format!("batch-{c}")).await?;
            let (r1, l1) = (*raw1.get_or_insert(raw_agg), *log1.get_or_insert(log_agg));
            say!(
                "  {c:>11}   {raw_agg:>8.1} ({:>5.2}x)       {log_agg:>8.1} ({:>5.2}x)          {:.3}",
                raw_agg / r1,
                log_agg / l1,
                log_agg / raw_agg
            );
            if raw_out.iter().chain(&log_out).any(|t| *t != raw_tokens) {
                say!("  WARNING: a batched generation differs from the generation alone (same greedy prompt)");
            }
        }
        say!("  goal: 8 concurrent generations through the log >= 4x one alone");
    }
    let _ = stop_tx.send(true);
    let _ = worker.await;

    // Re-prefill time vs prefix length, exact and fast.
    say!("re-prefill (prompt {} tokens + committed prefix):", prompt.len());
    say!("  prefix   exact: prefill + replay     fast: one batch");
    for &len in a.prefixes.iter().filter(|&&l| l <= raw_tokens.len()) {
        let (m, p, pre) = (model.clone(), prompt.clone(), raw_tokens[..len].to_vec());
        let (exact, fast) = tokio::task::spawn_blocking(move || -> anyhow::Result<(Duration, Duration)> {
            let time = |mode: ResumeMode| -> anyhow::Result<Duration> {
                let t = Instant::now();
                DecodeState::resume(m.as_ref(), &p, &pre, SamplingConfig::greedy(), stop(u32::MAX / 2), mode)?;
                Ok(t.elapsed())
            };
            Ok((time(ResumeMode::Exact)?, time(ResumeMode::Fast)?))
        })
        .await??;
        say!(
            "  {len:>6}   {:>10.1} ms                {:>8.1} ms   (exact/fast {:.1}x)",
            ms(exact),
            ms(fast),
            ms(exact) / ms(fast).max(1e-9)
        );
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A decoder process a bench started; killed when dropped.
pub(crate) struct Dec {
    pub(crate) child: Option<Child>,
    pub(crate) id: String,
}

impl Drop for Dec {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_decoder(a: &FailoverArgs, cluster: &str, id: &str, log: &std::path::Path) -> anyhow::Result<Dec> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(["decoder", "--cluster", cluster, "--decoder-id", id, "--capacity", "1"])
        .args(["--lease-ms", &a.lease_ms.to_string()]);
    if a.fake {
        cmd.args(["--fake", "--fake-step-ms", &a.fake_step_ms.to_string()]);
    }
    if a.standby {
        cmd.args(["--standby", "1"]);
    }
    let child = cmd
        // The worker's info lines say which takeovers used a standby's state.
        .env("RUST_LOG", "warn,tokenlog_decoder::worker=info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .spawn()
        .context("start decoder")?;
    Ok(Dec {
        child: Some(child),
        id: id.to_string(),
    })
}

async fn info(client: &LogClient, gid: u64, linearizable: bool) -> anyhow::Result<pb::GenerationInfo> {
    client
        .get(pb::GetRequest {
            generation_id: gid,
            linearizable,
            ..Default::default()
        })
        .await?
        .generation
        .context("generation gone")
}

async fn registered(client: &LogClient, id: &str) -> bool {
    client
        .list_models()
        .await
        .is_ok_and(|m| m.models.iter().any(|x| x.decoders.iter().any(|d| d == id)))
}

pub async fn failover(a: FailoverArgs) -> anyhow::Result<()> {
    let (model, name) = load_model(&dargs(a.fake, None, 1))?;
    let mut prompt = prompt_ids(model.as_ref())?;
    if a.fake {
        prompt.truncate(16);
    }
    let dir = tempfile::tempdir()?;
    let _procs = start_tokenlog(dir.path(), a.base_port)?;
    let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", a.base_port + i)).collect();
    let cluster = addrs.join(",");
    let client = LogClient::new(addrs)?;
    wait_for_leader(&client).await?;
    say!(
        "bench failover: model {name}, 2 decoders ({}), lease {} ms, {} kills after {} records each",
        if a.standby {
            "the other one a hot standby of the generation: --standby"
        } else {
            "the other one idle, model loaded: a cold takeover re-prefills"
        },
        a.lease_ms,
        a.kills,
        a.after
    );
    let mut incarnation = 0;
    let mut next_id = |slot: usize| {
        incarnation += 1;
        format!("fo{slot}-{incarnation}")
    };
    let mut decs = vec![];
    for slot in 0..2 {
        let id = next_id(slot);
        decs.push(spawn_decoder(&a, &cluster, &id, &dir.path().join(format!("{id}.log")))?);
    }
    let mut hist = [
        Histogram::<u64>::new(3)?,
        Histogram::<u64>::new(3)?,
        Histogram::<u64>::new(3)?,
    ];
    let mut extra_takeovers = 0u64;
    let (mut owner_cpu, mut other_cpu) = (0u64, 0u64);
    for k in 0..a.kills {
        wait_registered(&client, &decs, dir.path()).await?;
        let (victim, t) = kill_round(&client, model.as_ref(), &prompt, &a, k, &mut decs).await?;
        hist[0].record(t.total.as_micros() as u64)?;
        hist[1].record(t.detect.as_micros() as u64)?;
        hist[2].record(t.rest.as_micros() as u64)?;
        say!(
            "kill {:>2}: next token visible after {:>7.1} ms = detection {:>7.1} ms + {} and first step {:>7.1} ms",
            k + 1,
            ms(t.total),
            ms(t.detect),
            if a.standby { "standby state" } else { "re-prefill" },
            ms(t.rest)
        );
        extra_takeovers += t.extra_takeovers;
        owner_cpu += t.owner_cpu;
        other_cpu += t.other_cpu;
        // The dead slot gets a fresh decoder, which becomes the next standby.
        let id = next_id(victim);
        decs[victim] = spawn_decoder(&a, &cluster, &id, &dir.path().join(format!("{id}.log")))?;
    }
    let q = |h: &Histogram<u64>, p: f64| h.value_at_quantile(p) as f64 / 1e3;
    say!("over {} kills (ms):            p50      p99", a.kills);
    say!(
        "  kill -> next token     {:>8.1} {:>8.1}",
        q(&hist[0], 0.5),
        q(&hist[0], 0.99)
    );
    say!(
        "  detection (session)    {:>8.1} {:>8.1}",
        q(&hist[1], 0.5),
        q(&hist[1], 0.99)
    );
    say!(
        "  {} + 1st step  {:>8.1} {:>8.1}",
        if a.standby { "standby    " } else { "re-prefill " },
        q(&hist[2], 0.5),
        q(&hist[2], 0.99)
    );
    say!("takeovers beyond the kills (of slow-but-renewing owners): {extra_takeovers}");
    say!(
        "CPU of the {} from submit to kill: {:.0}% of the owner's ({other_cpu} / {owner_cpu} ticks)",
        if a.standby { "standby" } else { "idle decoder" },
        100.0 * other_cpu as f64 / owner_cpu.max(1) as f64
    );
    drop(decs);
    let mut from_standby = 0;
    for e in std::fs::read_dir(dir.path())?.flatten() {
        if e.path().extension().is_some_and(|x| x == "log") {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            from_standby += text.matches("taken over from the hot standby's state").count();
            // A takeover that could not use the standby's state says why.
            for line in text.lines().filter(|l| l.contains("re-prefilling")) {
                say!("  {line}");
            }
        }
    }
    say!(
        "takeovers from a standby's followed state (decoder logs): {from_standby} of {}",
        a.kills
    );
    Ok(())
}

/// One kill's timings: kill -> next visible token = detection (the next epoch's grant) + the rest
/// (re-prefill and the first step).
struct KillTimings {
    total: Duration,
    detect: Duration,
    rest: Duration,
    /// Takeovers of this generation beyond the one the kill caused.
    extra_takeovers: u64,
    /// CPU time (clock ticks) of the owner and of the other decoder (the standby, or the idle
    /// one) from the submit to the kill.
    owner_cpu: u64,
    other_cpu: u64,
}

/// [`super::bench::cpu_ticks`] of a decoder; 0 when it is not running.
fn cpu_ticks(d: &Dec) -> u64 {
    d.child.as_ref().map_or(0, |c| super::bench::cpu_ticks(c.id()))
}

/// Waits until both decoders are registered (the standby has its model loaded).
async fn wait_registered(client: &LogClient, decs: &[Dec], dir: &std::path::Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(registered(client, &decs[0].id).await && registered(client, &decs[1].id).await) {
        if Instant::now() > deadline {
            bail!("decoders did not register within 120 s (logs in {})", dir.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Submits generation `k`, kills its owner after `a.after` records, and times the takeover.
/// Returns the killed slot.
async fn kill_round(
    client: &LogClient,
    model: &dyn Model,
    prompt: &[u32],
    a: &FailoverArgs,
    k: usize,
    decs: &mut [Dec],
) -> anyhow::Result<(usize, KillTimings)> {
    let sub = client
        .submit(pb::SubmitRequest {
            tenant: "bench".into(),
            request_id: format!("failover-{k}"),
            binding: Some(binding(model, prompt, a.after + 400)),
        })
        .await?;
    let gid = sub.generation.context("no generation")?.generation_id;
    let cpu_at_submit = [cpu_ticks(&decs[0]), cpu_ticks(&decs[1])];
    let mut w = client.watch(gid, 0).await?;
    let mut seen = 0u32;
    while seen < a.after {
        let ev = w.message().await?.context("watch ended")?;
        seen += ev.records.len() as u32;
    }
    if a.standby {
        // The standby claims the generation at its next poll, prefills what was committed and
        // catches up: 16 more records.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !client
            .get(pb::GetRequest {
                generation_id: gid,
                ..Default::default()
            })
            .await
            .is_ok_and(|r| !r.standby.is_empty())
        {
            if Instant::now() > deadline {
                bail!("no decoder stood by for generation {gid} within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let more = seen + 16;
        while seen < more {
            let ev = w.message().await?.context("watch ended")?;
            seen += ev.records.len() as u32;
        }
    }
    let before = info(client, gid, true).await?;
    let lease = before.lease.unwrap_or_default();
    let Some(victim) = decs.iter().position(|d| d.id == lease.owner) else {
        bail!("owner {} is not one of ours", lease.owner);
    };
    let cpu = |i: usize| cpu_ticks(&decs[i]).saturating_sub(cpu_at_submit[i]);
    let (owner_cpu, other_cpu) = (cpu(victim), cpu(1 - victim));
    let killed = Instant::now();
    if let Some(mut c) = decs[victim].child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
    // Detection: the standby's grant of the next epoch.
    let acquired = loop {
        let g = info(client, gid, false).await?;
        if g.lease.as_ref().is_some_and(|l| l.epoch > lease.epoch) {
            break Instant::now();
        }
        if killed.elapsed() > Duration::from_secs(60) {
            bail!("no takeover within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    // The next record after the ones committed by the dead owner.
    let mut w = client.watch(gid, before.frontier.max(seen)).await?;
    let visible = loop {
        let ev = w.message().await?.context("watch ended")?;
        if ev.records.iter().any(|r| r.epoch > lease.epoch) {
            break Instant::now();
        }
    };
    let _ = client
        .cancel(pb::CancelRequest {
            tenant: "bench".into(),
            request_id: format!("failover-{k}"),
        })
        .await;
    let g = info(client, gid, true).await?;
    Ok((
        victim,
        KillTimings {
            total: visible - killed,
            detect: acquired - killed,
            rest: visible.saturating_duration_since(acquired),
            extra_takeovers: g.takeovers.saturating_sub(1),
            owner_cpu,
            other_cpu,
        },
    ))
}
