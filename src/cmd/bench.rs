//! `tokenlog bench log`: tokenlog's append path against etcd's put path, same machine, same run.
//!
//! Both systems run as 3 processes on loopback with their own data dirs, default fsync
//! behaviour, and the same number of concurrent writers. One tokenlog writer is one "decoder":
//! it owns `generations / writers` generations and, per step, sends one Append carrying
//! `tokens_per_step` tokens for each of them (one Raft entry). The etcd writer sends, per step,
//! one Put whose value has the same bytes (4 per token id); etcd runs in each client mode of
//! `--etcd-connections` (writers sharing 1 connection, as clientv3 does, or spread over more)
//! and its best mode is the baseline. Reported: steps/s (= committed
//! writes/s), tokens/s, p50/p99 commit latency, and tokenlog ÷ etcd.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use tokenlog_proto::etcd;
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

#[derive(clap::Subcommand)]
pub enum BenchCmd {
    /// Append throughput and commit latency of a 3-node log vs a 3-member etcd (Debian's
    /// etcd-server), same payload, same run.
    Log(LogArgs),
    /// Raw candle decode vs the decoder writing to a 3-node log (same model, same run), and
    /// re-prefill time vs prefix length in exact and fast mode.
    Decode(crate::cmd::bench_decoder::DecodeArgs),
    /// A node's resident memory and disk per million committed records, and the time it takes
    /// to serve again after kill -9 with that many records.
    Restart(crate::cmd::bench_restart::RestartArgs),
    /// kill -9 the owning decoder repeatedly with a warm standby; p50/p99 of kill -> next token
    /// visible, split into detection (the victim's session ends; its lease only as a fallback) and re-prefill + first step.
    Failover(crate::cmd::bench_decoder::FailoverArgs),
    /// SIGTERM a decoder running several generations while another decoder takes handoffs: the
    /// longest gap between two visible tokens at any client during the drain, against the
    /// normal gap between tokens just before it (same generations, same run).
    Drain(crate::cmd::bench_drain::DrainArgs),
    /// Committed tokens/s with many concurrent generations (default 1,000) driven by real
    /// decoder processes with the fake model through a 3-node log.
    Decoders(crate::cmd::bench_decoders::DecodersArgs),
    /// kill -9 the log's leader repeatedly while a fake-model decoder writes one generation;
    /// the longest gap between two committed tokens after each kill (p50/p99) against a stretch
    /// without a kill, and whether any election turned into a takeover.
    LeaderKill(crate::cmd::bench_leader::LeaderKillArgs),
    /// Greedy decode through a pipeline of `tokenlog stage` processes (3 by default) against
    /// the whole model, alone and batched; the rate ratio, and whether the tokens are the same.
    Stages(crate::cmd::bench_stages::StagesArgs),
}

#[derive(clap::Args, Clone)]
pub struct LogArgs {
    /// Concurrent writers (decoders) per system; a list runs each in turn, every one on a fresh
    /// cluster of each system.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    pub writers: Vec<usize>,
    /// Generations in all, split across writers.
    #[arg(long, default_value_t = 512)]
    pub generations: usize,
    /// Tokens per generation per step (at most a generation's 32,768: beyond, no write fits
    /// and the bench measured nothing).
    #[arg(long, default_value_t = 1,
          value_parser = crate::cmd::count_up_to::<{ tokenlog_raftlog::limits::GENERATION_TOKENS_MAX as usize }>)]
    pub tokens_per_step: usize,
    /// Measured seconds per system.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub seconds: u64,
    /// First loopback port to use (tokenlog uses 3, etcd 6).
    #[arg(long, default_value_t = 27_100, value_parser = crate::cmd::base_port)]
    pub base_port: u16,
    /// Skip the etcd baseline (no ratio is printed then).
    #[arg(long)]
    pub no_etcd: bool,
    /// tokenlog's writers send on an `AppendStream` each (the decoders' path), still one write
    /// outstanding per writer, instead of one unary `Append` call per write (like etcd's puts).
    #[arg(long)]
    pub stream: bool,
    /// Writes each writer keeps outstanding: pipelined in order on its `AppendStream` (needs
    /// --stream), as a decoder pipelines its appends (up to 4); etcd's writers then keep as many
    /// puts outstanding each (one put loop per outstanding write), so both systems see the same
    /// number of writes in flight.
    #[arg(long, default_value_t = 1)]
    pub depth: usize,
    /// etcd binary.
    #[arg(long, default_value = "etcd")]
    pub etcd: String,
    /// etcd client modes to try: how many gRPC connections the writers share (1 = one client,
    /// as etcd's clientv3 does by default; more spread writers over connections). The best
    /// mode's result is the baseline.
    #[arg(long, value_delimiter = ',', default_value = "1,16", value_parser = crate::cmd::at_least_one)]
    pub etcd_connections: Vec<usize>,
}

pub async fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Log(a) => bench_log(a).await,
        BenchCmd::Decode(a) => crate::cmd::bench_decoder::decode(a).await,
        BenchCmd::Failover(a) => crate::cmd::bench_decoder::failover(a).await,
        BenchCmd::Drain(a) => crate::cmd::bench_drain::drain(a).await,
        BenchCmd::Restart(a) => crate::cmd::bench_restart::restart(a).await,
        BenchCmd::Decoders(a) => crate::cmd::bench_decoders::decoders(a).await,
        BenchCmd::LeaderKill(a) => crate::cmd::bench_leader::leader_kill(a).await,
        BenchCmd::Stages(a) => crate::cmd::bench_stages::stages(a).await,
    }
}

/// Child processes killed on drop.
pub struct Procs(pub Vec<Child>);

impl Procs {
    /// User + system CPU time of all of them so far, in clock ticks.
    fn cpu_ticks(&self) -> u64 {
        self.0.iter().map(|c| cpu_ticks(c.id())).sum()
    }
}

/// Clock ticks per second of `/proc/PID/stat` (`USER_HZ`, 100 on every Linux this runs on).
pub const TICKS_PER_S: f64 = 100.0;

/// User + system CPU time of a running process, in clock ticks (`/proc/PID/stat`); 0 when it
/// cannot be read.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) end at the last ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(vec![], |(_, f)| f.split_whitespace().collect());
    // utime and stime are fields 14 and 15; the first after ')' is field 3.
    let at = |i: usize| fields.get(i - 3).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    at(14) + at(15)
}

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[derive(Default)]
struct Outcome {
    steps: u64,
    tokens: u64,
    elapsed: Duration,
    latency_us: Option<Histogram<u64>>,
    /// CPU time of the 3 server processes over the measured window, in clock ticks.
    server_cpu_ticks: u64,
    /// tokenlog only: the Raft entries the leader committed over the measured window (its
    /// commit index before and after, from `ClusterStatus`; a few housekeeping entries
    /// included). How many writes the proposer merged into each entry.
    entries: Option<u64>,
}

impl Outcome {
    fn steps_per_s(&self) -> f64 {
        self.steps as f64 / self.elapsed.as_secs_f64()
    }
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.elapsed.as_secs_f64()
    }
    /// CPU time of the servers (all 3 together) per write, in µs.
    fn cpu_us_per_write(&self) -> f64 {
        self.server_cpu_ticks as f64 / TICKS_PER_S * 1e6 / self.steps.max(1) as f64
    }
    fn print(&self, name: &str) {
        let h = self.latency_us.as_ref().expect("measured");
        say!(
            "{name:<15} {:>10.0} writes/s {:>10.0} tokens/s   commit latency p50 {:>7.2} ms  p99 {:>7.2} ms   \
             server CPU {:>6.0} us/write ({:.2} cores)",
            self.steps_per_s(),
            self.tokens_per_s(),
            h.value_at_quantile(0.5) as f64 / 1000.0,
            h.value_at_quantile(0.99) as f64 / 1000.0,
            self.cpu_us_per_write(),
            self.server_cpu_ticks as f64 / TICKS_PER_S / self.elapsed.as_secs_f64()
        );
        if let Some(entries) = self.entries {
            say!(
                "{:<15} {:>10.0} entries/s {:>8.1} writes per entry   server CPU {:>6.0} us/entry",
                "",
                entries as f64 / self.elapsed.as_secs_f64(),
                self.steps as f64 / entries.max(1) as f64,
                self.server_cpu_ticks as f64 / TICKS_PER_S * 1e6 / entries.max(1) as f64
            );
        }
    }
}

async fn bench_log(a: LogArgs) -> anyhow::Result<()> {
    let max = a.writers.iter().copied().max().unwrap_or(0);
    if a.writers.contains(&0) || a.generations < max || a.tokens_per_step == 0 {
        bail!("need writers >= 1, generations >= writers, tokens-per-step >= 1");
    }
    let depth_max = tokenlog_raftlog::limits::APPEND_STREAM_IN_FLIGHT_MAX;
    if a.depth == 0 || a.depth > depth_max {
        bail!("--depth must be 1..={depth_max} (the writes a node takes in flight on one stream)");
    }
    if a.depth > 1 && !a.stream {
        bail!(
            "--depth {} needs --stream: unary appends of one writer sent at once may arrive out of order",
            a.depth
        );
    }
    let mut rows = Vec::new();
    for &writers in &a.writers {
        let dir = tempfile::tempdir()?;
        say!(
            "bench log: {writers} writers, {} generations, {} token(s) per generation per step, {} write(s) \
             outstanding per writer, {} s per system",
            a.generations,
            a.tokens_per_step,
            a.depth,
            a.seconds
        );
        let ours = {
            let procs = start_tokenlog(dir.path(), a.base_port)?;
            let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", a.base_port + i)).collect();
            run_tokenlog(&a, writers, addrs, &procs).await?
        };
        ours.print(&match (a.stream, a.depth) {
            (false, _) => "tokenlog".to_string(),
            (true, 1) => "tokenlog/stream".to_string(),
            (true, d) => format!("tokenlog/stream/d{d}"),
        });
        if a.no_etcd {
            continue;
        }
        let theirs = {
            let procs = start_etcd(&a.etcd, dir.path(), a.base_port + 10)?;
            let mut best: Option<Outcome> = None;
            for &conns in &a.etcd_connections {
                let o = run_etcd(&a, writers, conns, a.base_port + 10, &procs).await?;
                o.print(&format!("etcd/{conns}c"));
                if best.as_ref().is_none_or(|b| o.steps_per_s() > b.steps_per_s()) {
                    best = Some(o);
                }
            }
            best.context("--etcd-connections is empty")?
        };
        let q = |o: &Outcome, at: f64| o.latency_us.as_ref().expect("measured").value_at_quantile(at).max(1) as f64;
        let ratio = (
            ours.steps_per_s() / theirs.steps_per_s(),
            q(&ours, 0.5) / q(&theirs, 0.5),
            q(&ours, 0.99) / q(&theirs, 0.99),
        );
        let cpu = ours.cpu_us_per_write() / theirs.cpu_us_per_write();
        say!(
            "ratio     tokenlog / etcd: {:.2}x writes/s, {:.2}x tokens/s, p50 latency {:.2}x, p99 latency {:.2}x, \
             server CPU per write {cpu:.2}x",
            ratio.0,
            ours.tokens_per_s() / theirs.tokens_per_s(),
            ratio.1,
            ratio.2
        );
        rows.push((writers, ratio, cpu));
    }
    if rows.len() > 1 {
        say!("summary   writers  writes/s vs etcd  p50 vs etcd  p99 vs etcd  CPU/write vs etcd");
        for (w, (t, p50, p99), cpu) in rows {
            say!("          {w:>7}  {t:>15.2}x  {p50:>10.2}x  {p99:>10.2}x  {cpu:>16.2}x");
        }
    }
    Ok(())
}

/// The command that runs node `i` (0-based) of a 3-node loopback cluster on ports `base..base+3`,
/// its data in `dir/tokenlog-{i+1}`; stdout discarded, stderr as the caller sets it.
pub fn node_command(exe: &Path, dir: &Path, base: u16, i: u16) -> Command {
    let peers: Vec<String> = (0..3).map(|k| format!("{}=127.0.0.1:{}", k + 1, base + k)).collect();
    let mut c = Command::new(exe);
    c.args(["node", "--id", &(i + 1).to_string()])
        .args(["--listen", &format!("127.0.0.1:{}", base + i)])
        .arg("--data-dir")
        .arg(dir.join(format!("tokenlog-{}", i + 1)))
        .args(["--peers", &peers.join(",")])
        // openraft warns of every refused connection to a peer the bench already stopped
        // (screens of them at each cluster's end); its errors and our own warnings still show.
        .env("RUST_LOG", "warn,openraft=error")
        .stdout(Stdio::null());
    c
}

/// Refuses a taken port of the 3 log nodes at `base`: an earlier bench's nodes still running,
/// say, would leave the bench talking to whatever holds it.
pub fn check_node_ports_free(base: u16) -> anyhow::Result<()> {
    for port in base..base + 3 {
        if let Err(e) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            bail!("127.0.0.1:{port}, a port of the bench's log nodes, is taken ({e}): another bench's nodes may still run (`pgrep -af 'tokenlog node'`), or pick --base-port");
        }
    }
    Ok(())
}

pub fn start_tokenlog(dir: &Path, base: u16) -> anyhow::Result<Procs> {
    let exe = std::env::current_exe()?;
    check_node_ports_free(base)?;
    let mut procs = Procs(Vec::new());
    for i in 0..3u16 {
        let child = node_command(&exe, dir, base, i)
            .spawn()
            .context("start tokenlog node")?;
        procs.0.push(child);
    }
    Ok(procs)
}

fn start_etcd(etcd: &str, dir: &Path, base: u16) -> anyhow::Result<Procs> {
    let peer = |i: u16| format!("http://127.0.0.1:{}", base + 3 + i);
    let cluster: Vec<String> = (0..3).map(|i| format!("e{i}={}", peer(i))).collect();
    let mut procs = Procs(Vec::new());
    for i in 0..3u16 {
        let client = format!("http://127.0.0.1:{}", base + i);
        let child = Command::new(etcd)
            .args(["--name", &format!("e{i}")])
            .arg("--data-dir")
            .arg(dir.join(format!("etcd-{i}")))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args([
                "--listen-peer-urls",
                &peer(i),
                "--initial-advertise-peer-urls",
                &peer(i),
            ])
            .args([
                "--initial-cluster",
                &cluster.join(","),
                "--initial-cluster-state",
                "new",
            ])
            .args(["--log-level", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("start {etcd} (apt-get install etcd-server)"))?;
        procs.0.push(child);
    }
    Ok(procs)
}

fn model() -> pb::ModelIdentity {
    pb::ModelIdentity {
        weights_sha256: "bench".into(),
        tokenizer_sha256: "bench".into(),
        architecture: "bench".into(),
        dtype_class: "bench".into(),
    }
}

/// Sets up `writers` writers (`bench-decoder-{w}`) of `per_writer` generations each, the writers
/// concurrently.
pub async fn setup_writers(
    client: &LogClient,
    writers: usize,
    per_writer: usize,
) -> anyhow::Result<Vec<Vec<(u64, u64)>>> {
    setup_writers_tagged(client, writers, per_writer, "").await
}

/// [`setup_writers`], with request ids that begin with `tag` (fresh generations each round).
pub async fn setup_writers_tagged(
    client: &LogClient,
    writers: usize,
    per_writer: usize,
    tag: &str,
) -> anyhow::Result<Vec<Vec<(u64, u64)>>> {
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let client = client.clone();
            let tag = tag.to_string();
            tokio::spawn(async move { setup_writer(&client, w, per_writer, &format!("bench-decoder-{w}"), &tag).await })
        })
        .collect();
    let mut owned = Vec::new();
    for t in tasks {
        owned.push(t.await??);
    }
    Ok(owned)
}

/// Submits and acquires this writer's generations; returns `(generation, epoch)` pairs.
async fn setup_writer(
    client: &LogClient,
    writer: usize,
    count: usize,
    decoder: &str,
    tag: &str,
) -> anyhow::Result<Vec<(u64, u64)>> {
    let mut owned = Vec::new();
    for j in 0..count {
        let binding = pb::Binding {
            model: Some(model()),
            prompt_token_ids: vec![1, 2, 3],
            stop: Some(pb::StopConfig {
                max_tokens: tokenlog_raftlog::limits::GENERATION_TOKENS_MAX,
                ..Default::default()
            }),
            ..Default::default()
        };
        let sub = client
            .submit(pb::SubmitRequest {
                tenant: "bench".into(),
                request_id: format!("{tag}w{writer}-g{j}"),
                binding: Some(binding),
            })
            .await?;
        let id = sub.generation.context("no generation")?.generation_id;
        let acq = client
            .acquire(pb::AcquireRequest {
                generation_id: id,
                decoder_id: decoder.into(),
                lease_ms: 60_000,
                model: Some(model()),
                rng_version: 0,
            })
            .await?;
        let epoch = acq
            .generation
            .context("acquire refused")?
            .lease
            .context("no lease")?
            .epoch;
        owned.push((id, epoch));
    }
    Ok(owned)
}

pub async fn wait_for_leader(client: &LogClient) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match client.cluster_status(true).await {
            Ok(s) if s.leader_id != 0 => return Ok(()),
            _ if Instant::now() > deadline => bail!("no leader within 30 s"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

async fn run_tokenlog(a: &LogArgs, writers: usize, addrs: Vec<String>, procs: &Procs) -> anyhow::Result<Outcome> {
    let client = LogClient::new(addrs)?;
    wait_for_leader(&client).await?;
    let owned = setup_writers(&client, writers, a.generations / writers).await?;
    // With `--stream`, each writer's stream is open before the clock starts.
    let mut streams = Vec::with_capacity(owned.len());
    for _ in &owned {
        streams.push(match a.stream {
            true => Some(client.append_stream().await?),
            false => None,
        });
    }
    let committed_at_start = leader_commit_index(&client).await?;
    let cpu_at_start = procs.cpu_ticks();
    let start = Instant::now();
    let deadline = start + Duration::from_secs(a.seconds);
    let mut tasks = Vec::new();
    for ((w, gens), mut stream) in owned.into_iter().enumerate().zip(streams) {
        let client = client.clone();
        let (tokens, depth) = (a.tokens_per_step, a.depth);
        tasks.push(tokio::spawn(async move {
            let mut h = Histogram::<u64>::new(3).expect("histogram");
            let (mut steps, mut seq) = (0u64, 0u32);
            let room = |seq: u32| seq as usize + tokens <= tokenlog_raftlog::limits::GENERATION_TOKENS_MAX as usize;
            match &mut stream {
                // Up to `depth` writes in flight, answered in order: each answer lets the next go.
                Some(s) => {
                    let mut sent = std::collections::VecDeque::with_capacity(depth);
                    loop {
                        while sent.len() < depth && Instant::now() < deadline && room(seq) {
                            s.send(append_request(w, &gens, seq, &vec![seq; tokens], false)).await?;
                            sent.push_back(Instant::now());
                            seq += tokens as u32;
                        }
                        let Some(t) = sent.pop_front() else { break };
                        accepted(&s.answer().await?)?;
                        h.record(t.elapsed().as_micros() as u64)?;
                        steps += 1;
                    }
                }
                None => {
                    while Instant::now() < deadline && room(seq) {
                        let t = Instant::now();
                        let req = append_request(w, &gens, seq, &vec![seq; tokens], false);
                        accepted(&client.append(req).await?)?;
                        h.record(t.elapsed().as_micros() as u64)?;
                        steps += 1;
                        seq += tokens as u32;
                    }
                }
            }
            anyhow::Ok((steps, steps * (tokens * gens.len()) as u64, h))
        }));
    }
    let mut out = collect(tasks, start).await?;
    out.server_cpu_ticks = procs.cpu_ticks().saturating_sub(cpu_at_start);
    out.entries = Some(leader_commit_index(&client).await?.saturating_sub(committed_at_start));
    Ok(out)
}

/// The leader's commit index: a linearizable `ClusterStatus` is answered by the leader only
/// (another node answers `NotLeader`, which the client follows).
async fn leader_commit_index(client: &LogClient) -> anyhow::Result<u64> {
    Ok(client.cluster_status(true).await?.commit_index)
}

/// One step of writer `w` (decoder `bench-decoder-{w}`): one Append carrying `token_ids` from
/// `seq` for each of its generations, and with `finish` every generation finishes (`Stop`) after
/// these records; an item refused is an error.
pub async fn append_step_then(
    client: &LogClient,
    w: usize,
    gens: &[(u64, u64)],
    seq: u32,
    token_ids: &[u32],
    finish: bool,
) -> anyhow::Result<()> {
    let resp = client.append(append_request(w, gens, seq, token_ids, finish)).await?;
    accepted(&resp)
}

/// The request of [`append_step_then`].
fn append_request(w: usize, gens: &[(u64, u64)], seq: u32, token_ids: &[u32], finish: bool) -> pb::AppendRequest {
    let items = gens
        .iter()
        .map(|&(id, epoch)| pb::AppendItem {
            generation_id: id,
            epoch,
            start_seq: seq,
            token_ids: token_ids.to_vec(),
            finish: if finish {
                pb::FinishReason::Stop as i32
            } else {
                pb::FinishReason::Unspecified as i32
            },
            ..Default::default()
        })
        .collect();
    pb::AppendRequest {
        decoder_id: format!("bench-decoder-{w}"),
        lease_ms: 60_000,
        items,
    }
}

/// `Ok` when every item of an append was accepted.
fn accepted(resp: &pb::AppendResponse) -> anyhow::Result<()> {
    if let Some(r) = resp.results.iter().find(|r| !r.accepted) {
        bail!("append rejected: {:?}", r.rejection);
    }
    Ok(())
}

/// One writer task's result: writes, tokens, commit latencies (µs).
type WriterResult = anyhow::Result<(u64, u64, Histogram<u64>)>;

async fn collect(tasks: Vec<tokio::task::JoinHandle<WriterResult>>, start: Instant) -> anyhow::Result<Outcome> {
    let mut out = Outcome::default();
    let mut all = Histogram::<u64>::new(3)?;
    for t in tasks {
        let (steps, tokens, h) = t.await??;
        out.steps += steps;
        out.tokens += tokens;
        all.add(&h)?;
    }
    out.elapsed = start.elapsed();
    out.latency_us = Some(all);
    Ok(out)
}

async fn etcd_leader(base: u16) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for i in 0..3 {
            let url = format!("http://127.0.0.1:{}", base + i);
            let Ok(mut c) = etcd::maintenance_client::MaintenanceClient::connect(url.clone()).await else {
                continue;
            };
            if let Ok(s) = c.status(etcd::StatusRequest {}).await {
                let s = s.into_inner();
                if s.leader != 0 && s.header.map(|h| h.member_id) == Some(s.leader) {
                    return Ok(url);
                }
            }
        }
        if Instant::now() > deadline {
            bail!("etcd elected no leader within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// etcd's side: `writers` concurrent writers over `connections` gRPC connections to the leader.
async fn run_etcd(
    a: &LogArgs,
    writers: usize,
    connections: usize,
    base: u16,
    procs: &Procs,
) -> anyhow::Result<Outcome> {
    let leader = etcd_leader(base).await?;
    let mut channels = Vec::new();
    for _ in 0..connections.clamp(1, writers) {
        channels.push(
            tonic::transport::Endpoint::from_shared(leader.clone())?
                .tcp_nodelay(true)
                .connect()
                .await?,
        );
    }
    let per_writer = a.generations / writers;
    let value_bytes = per_writer * a.tokens_per_step * 4;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(a.seconds);
    let value = Arc::new(vec![7u8; value_bytes]);
    let cpu_at_start = procs.cpu_ticks();
    let mut tasks = Vec::new();
    // `depth` put loops per writer: as many puts outstanding as tokenlog's writer has writes.
    for (w, d) in (0..writers).flat_map(|w| (0..a.depth).map(move |d| (w, d))) {
        let mut kv = etcd::kv_client::KvClient::new(channels[w % channels.len()].clone());
        let value = value.clone();
        let tokens_per_put = (per_writer * a.tokens_per_step) as u64;
        tasks.push(tokio::spawn(async move {
            let mut h = Histogram::<u64>::new(3).expect("histogram");
            let mut steps = 0u64;
            while Instant::now() < deadline {
                let key = format!("c{connections}/w{w}.{d}/{steps:010}").into_bytes();
                let t = Instant::now();
                kv.put(etcd::PutRequest {
                    key,
                    value: value.to_vec(),
                    ..Default::default()
                })
                .await?;
                h.record(t.elapsed().as_micros() as u64)?;
                steps += 1;
            }
            anyhow::Ok((steps, steps * tokens_per_put, h))
        }));
    }
    let mut out = collect(tasks, start).await?;
    out.server_cpu_ticks = procs.cpu_ticks().saturating_sub(cpu_at_start);
    Ok(out)
}
