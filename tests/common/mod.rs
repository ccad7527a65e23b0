//! Shared by the multi-process tests: a 3-node log cluster of real `tokenlog node` processes on
//! free loopback ports, killed with SIGKILL; node logs are kept when a test fails.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

/// The `tokenlog` binary the tests run: the one cargo built, or `TOKENLOG_TEST_BIN` (another
/// build, e.g. an older commit's, to show a new test failing on the old code).
pub fn bin() -> String {
    std::env::var("TOKENLOG_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_tokenlog").to_string())
}

/// Cluster tests run one at a time: each runs three nodes, and the machine may have two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Ports for the processes a test starts: below the kernel's ephemeral range, blocks held at
/// once (the fault suite's harness picks its ports the same way).
#[allow(unused_imports)] // Not every test file uses both.
pub use jepsen_style_tests::harness::procs::{free_port, free_ports};

/// `--tls-ca`, `--tls-cert`, `--tls-key` for holder `name` of the certificates in `dir`.
pub fn tls_args(dir: &std::path::Path, name: &str) -> Vec<String> {
    let p = |f: String| dir.join(f).display().to_string();
    vec![
        "--tls-ca".into(),
        p("ca.pem".into()),
        "--tls-cert".into(),
        p(format!("{name}.pem")),
        "--tls-key".into(),
        p(format!("{name}.key")),
    ]
}

/// The TLS material of holder `name` of the certificates in `dir`.
pub fn tls(dir: &std::path::Path, name: &str) -> std::sync::Arc<tokenlog_raftlog::tls::Tls> {
    let files = tokenlog_raftlog::tls::TlsFiles {
        ca: dir.join("ca.pem"),
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}.key")),
    };
    std::sync::Arc::new(tokenlog_raftlog::tls::Tls::load(&files).unwrap())
}

/// A channel to `addr` over TLS with `cfg` (a holder's [`tls`] `client_config_for` a server
/// name, or a CA alone).
pub async fn tls_channel(addr: &str, cfg: tonic::transport::ClientTlsConfig) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(cfg)
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// Runs `tokenlog certs --out dir ARGS...` (the default holders when ARGS is empty).
pub fn make_certs(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new(bin())
        .arg("certs")
        .arg("--out")
        .arg(dir)
        .args(args)
        .output()
        .expect("run tokenlog certs");
    assert!(
        out.status.success(),
        "tokenlog certs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub addrs: Vec<String>,
    /// Each node's peer listener (`--peer-listen`), when they have their own; else empty.
    pub peer_addrs: Vec<String>,
    /// Each node's status listener (`--metrics-listen`: metrics, /livez, /readyz,
    /// grpc.health.v1).
    pub status_addrs: Vec<String>,
    procs: Vec<Option<Child>>,
    snapshot_every: u64,
    /// More `tokenlog node` arguments for every node.
    extra: Vec<String>,
    /// Environment of every node (test hooks, planted bugs).
    pub node_env: Vec<(String, String)>,
    /// Certificates made by `tokenlog certs` (node-1..node-3, admin): the nodes serve mutual
    /// TLS, and `client()` is the admin's. `None`: plain text.
    pub certs: Option<PathBuf>,
}

impl Cluster {
    pub fn start(snapshot_every: u64) -> Cluster {
        Self::start_with(snapshot_every, &[])
    }

    /// Three nodes with `env` set for each (test hooks, planted bugs).
    pub fn start_with_env(snapshot_every: u64, env: &[(&str, &str)]) -> Cluster {
        Self::launch(snapshot_every, &[], env)
    }

    pub fn start_with(snapshot_every: u64, extra: &[&str]) -> Cluster {
        Self::launch(snapshot_every, extra, &[])
    }

    /// Three nodes serving mutual TLS with the certificates in `certs` (`tokenlog certs`), each
    /// with a peer listener of its own.
    pub fn start_tls(certs: &std::path::Path) -> Cluster {
        Self::launch_with(1_000, &[], &[], Some(certs.to_path_buf()))
    }

    fn launch(snapshot_every: u64, extra: &[&str], env: &[(&str, &str)]) -> Cluster {
        Self::launch_with(snapshot_every, extra, env, None)
    }

    fn launch_with(snapshot_every: u64, extra: &[&str], env: &[(&str, &str)], certs: Option<PathBuf>) -> Cluster {
        let addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
        let peer_addrs: Vec<String> = match certs {
            Some(_) => (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect(),
            None => vec![],
        };
        let mut c = Cluster {
            dir: tempfile::tempdir().unwrap(),
            addrs,
            peer_addrs,
            status_addrs: (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect(),
            procs: vec![None, None, None],
            snapshot_every,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            node_env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            certs,
        };
        for i in 0..3 {
            c.start_node(i);
        }
        c
    }

    pub fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("node{}", i + 1))
    }

    pub fn start_node(&mut self, i: usize) {
        let peers: Vec<String> = self
            .addrs
            .iter()
            .enumerate()
            .map(|(j, a)| match self.peer_addrs.get(j) {
                Some(p) => format!("{}={a}/{p}", j + 1),
                None => format!("{}={a}", j + 1),
            })
            .collect();
        let log = std::fs::File::create(self.dir.path().join(format!("node{}.log", i + 1))).unwrap();
        let child = Command::new(bin())
            .args(["node", "--id", &(i + 1).to_string(), "--listen", &self.addrs[i]])
            .args(["--metrics-listen", &self.status_addrs[i]])
            .arg("--data-dir")
            .arg(self.data_dir(i))
            .args([
                "--peers",
                &peers.join(","),
                "--snapshot-every",
                &self.snapshot_every.to_string(),
            ])
            .args([
                "--heartbeat-ms",
                "50",
                "--election-min-ms",
                "300",
                "--election-max-ms",
                "600",
            ])
            .args(&self.extra)
            .args(self.certs.iter().flat_map(|d| tls_args(d, &format!("node-{}", i + 1))))
            .args(
                self.peer_addrs
                    .get(i)
                    .iter()
                    .flat_map(|p| ["--peer-listen", p.as_str()]),
            )
            .envs(self.node_env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "info,openraft=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn tokenlog node");
        self.procs[i] = Some(child);
    }

    /// Waits up to `within` for node `i` to exit on its own; its exit status, or None if it runs.
    pub fn wait_exit(&mut self, i: usize, within: Duration) -> Option<std::process::ExitStatus> {
        wait_child(&mut self.procs[i], within)
    }

    /// Sends `sig` (`STOP`, `CONT`, ...) to node `i`.
    pub fn signal(&self, i: usize, sig: &str) {
        signal_pid(self.procs[i].as_ref().expect("node runs").id(), sig);
    }

    pub fn node_log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("node{}.log", i + 1))).unwrap_or_default()
    }

    pub fn kill9(&mut self, i: usize) {
        if let Some(mut c) = self.procs[i].take() {
            c.kill().unwrap(); // SIGKILL
            c.wait().unwrap();
        }
    }

    pub fn client(&self) -> LogClient {
        match &self.certs {
            Some(d) => LogClient::with_tls(self.addrs.clone(), Some(tls(d, "admin"))).unwrap(),
            None => LogClient::new(self.addrs.clone()).unwrap(),
        }
    }

    pub async fn leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(s) = self.client().cluster_status(true).await {
                if s.leader_id != 0 {
                    return s.leader_id as usize - 1;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no leader within 30 s; logs in {}",
                self.dir.path().display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn heads(&self, i: usize) -> Option<BTreeMap<u64, (u32, Vec<u8>)>> {
        let mut c = self.client().node(&self.addrs[i]);
        let r = c.chain_heads(pb::ChainHeadsRequest {}).await.ok()?.into_inner();
        Some(
            r.heads
                .into_iter()
                .map(|h| (h.generation_id, (h.frontier, h.head)))
                .collect(),
        )
    }

    /// Waits until every node reports the same chain heads; returns them.
    pub async fn converged(&self) -> BTreeMap<u64, (u32, Vec<u8>)> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut all = Vec::new();
            for i in 0..3 {
                all.push(self.heads(i).await);
            }
            if all.iter().all(|h| h.is_some() && *h == all[0]) {
                return all[0].clone().unwrap();
            }
            assert!(Instant::now() < deadline, "chain heads did not converge: {all:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..3 {
            self.kill9(i);
        }
        if std::thread::panicking() {
            // Keep the logs of a failed run.
            let kept = self.dir.path().to_path_buf();
            let _ = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap()).keep();
            eprintln!("node logs kept in {}", kept.display());
        }
    }
}

/// A decoder process (`tokenlog decoder --fake ...`) against this cluster.
pub struct Decoder {
    pub child: Option<Child>,
    pub id: String,
    pub log: PathBuf,
}

impl Cluster {
    pub fn start_decoder(&self, id: &str, extra: &[&str]) -> Decoder {
        self.start_decoder_of(id, &["--fake"], extra, &[])
    }

    /// A fake-model decoder with `env` set (failpoints, planted bugs).
    pub fn start_decoder_env(&self, id: &str, extra: &[&str], env: &[(&str, &str)]) -> Decoder {
        self.start_decoder_of(id, &["--fake"], extra, env)
    }

    /// A decoder process on a real model (GGUF file or Hugging Face folder), one model thread.
    pub fn start_real_decoder(&self, id: &str, model: &std::path::Path, extra: &[&str]) -> Decoder {
        self.start_decoder_of(id, &["--model", model.to_str().unwrap(), "--threads", "1"], extra, &[])
    }

    /// A real-model decoder whose steps take at least `ms` (failpoint `min-step-ms`): on a fast
    /// machine its generations then outlast the start of another decoder.
    pub fn start_slow_real_decoder(&self, id: &str, model: &std::path::Path, extra: &[&str], ms: u64) -> Decoder {
        let fp = format!("min-step-ms={ms}");
        self.start_decoder_of(
            id,
            &["--model", model.to_str().unwrap(), "--threads", "1"],
            extra,
            &[("TOKENLOG_FAILPOINTS", fp.as_str())],
        )
    }

    fn start_decoder_of(&self, id: &str, model: &[&str], extra: &[&str], env: &[(&str, &str)]) -> Decoder {
        let log = self.dir.path().join(format!("{id}.log"));
        let child = Command::new(bin())
            .arg("decoder")
            .args(model)
            .args(["--decoder-id", id, "--cluster", &self.addrs.join(",")])
            .args(extra)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info,openraft=warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn tokenlog decoder");
        Decoder {
            child: Some(child),
            id: id.to_string(),
            log,
        }
    }
}

impl Decoder {
    pub fn pid(&self) -> String {
        self.child.as_ref().expect("running").id().to_string()
    }
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {}", self.pid());
    }
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    /// Waits up to `within` for the process to exit on its own; its status, or None if it runs.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        wait_child(&mut self.child, within)
    }
}

impl Drop for Decoder {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = Command::new("kill").args(["-CONT", &c.id().to_string()]).status();
        }
        self.kill9();
    }
}

/// A gateway process (`tokenlog gateway ...`, no model files) against this cluster.
pub struct GatewayProc {
    pub child: Option<Child>,
    pub grpc: String,
    pub http: String,
    pub log: PathBuf,
}

impl Cluster {
    pub fn start_gateway(&self, name: &str, extra: &[&str]) -> GatewayProc {
        let grpc = format!("127.0.0.1:{}", free_port());
        let http = format!("127.0.0.1:{}", free_port());
        let log = self.dir.path().join(format!("{name}.log"));
        let child = Command::new(bin())
            .args([
                "gateway",
                "--cluster",
                &self.addrs.join(","),
                "--grpc-listen",
                &grpc,
                "--http-listen",
                &http,
            ])
            .args(extra)
            .env("RUST_LOG", "info,openraft=warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn tokenlog gateway");
        wait_for_port(&grpc);
        wait_for_port(&http);
        GatewayProc {
            child: Some(child),
            grpc,
            http,
            log,
        }
    }
}

pub fn wait_for_port(addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {addr}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl GatewayProc {
    /// Sends `sig` (`TERM`, `INT`, ...) to the gateway.
    pub fn signal(&self, sig: &str) {
        signal_pid(self.child.as_ref().expect("the gateway runs").id(), sig);
    }

    /// Waits up to `within` for the gateway to exit on its own; its status, or None if it runs.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        wait_child(&mut self.child, within)
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }
}

impl Drop for GatewayProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Waits until some decoder has registered a model with the log.
pub async fn wait_for_model(client: &LogClient) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = client.list_models().await {
            if !r.models.is_empty() {
                return;
            }
        }
        assert!(Instant::now() < deadline, "no decoder registered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every committed record of a generation, read from the log until it is terminal.
pub async fn committed(client: &LogClient, generation: u64) -> (Vec<u32>, pb::GenerationInfo) {
    let mut s = client.watch(generation, 0).await.unwrap();
    let mut out = Vec::new();
    while let Some(ev) = s.message().await.unwrap() {
        for r in ev.records {
            assert_eq!(r.seq as usize, out.len());
            out.push(r.token_id);
        }
        if let Some(t) = ev.terminal {
            return (out, t);
        }
    }
    panic!("watch ended before the generation did");
}

/// A plain HTTP/1.1 request (Connection: close); returns (status, body). For JSON answers only
/// (no chunked bodies).
pub fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Sends `sig` (`STOP`, `TERM`, ...) to process `pid`.
pub fn signal_pid(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
}

/// Appends the first `tokens` of generation `id` as `decoder`, owner at `epoch` (a 60 s lease);
/// asserts the log accepted them.
pub async fn append_first(client: &LogClient, decoder: &str, id: u64, epoch: u64, tokens: &[u32]) {
    let r = client
        .append(pb::AppendRequest {
            decoder_id: decoder.into(),
            lease_ms: 60_000,
            items: vec![pb::AppendItem {
                generation_id: id,
                epoch,
                start_seq: 0,
                token_ids: tokens.to_vec(),
                ..Default::default()
            }],
        })
        .await
        .unwrap();
    assert!(r.results[0].accepted, "{r:?}");
}

/// Waits up to `within` for `child` to exit on its own; its status (and the slot emptied), or
/// None if it still runs (or there is none).
fn wait_child(child: &mut Option<Child>, within: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(st) = child.as_mut()?.try_wait().unwrap() {
            *child = None;
            return Some(st);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The model identity the log-level tests submit and acquire with (no decoder behind it).
pub fn model() -> pb::ModelIdentity {
    pb::ModelIdentity {
        weights_sha256: "w".into(),
        tokenizer_sha256: "t".into(),
        architecture: "test".into(),
        dtype_class: "fake".into(),
    }
}

/// Submits a generation of [`model`] as request `request_id` of tenant `t`; its id.
pub async fn submit(client: &LogClient, request_id: &str) -> u64 {
    let binding = pb::Binding {
        model: Some(model()),
        prompt_token_ids: vec![1, 2, 3],
        stop: Some(pb::StopConfig {
            max_tokens: 10_000,
            ..Default::default()
        }),
        ..Default::default()
    };
    let s = client
        .submit(pb::SubmitRequest {
            tenant: "t".into(),
            request_id: request_id.into(),
            binding: Some(binding),
        })
        .await
        .unwrap();
    s.generation.unwrap().generation_id
}

/// Acquires generation `id` for `decoder` (a 60 s lease); its epoch.
pub async fn acquire(client: &LogClient, id: u64, decoder: &str) -> u64 {
    let a = client
        .acquire(pb::AcquireRequest {
            generation_id: id,
            decoder_id: decoder.into(),
            lease_ms: 60_000,
            model: Some(model()),
            rng_version: 0,
        })
        .await
        .unwrap();
    assert!(a.ok, "{a:?}");
    a.generation.unwrap().lease.unwrap().epoch
}

/// Submits and acquires `n` generations for `decoder`: (id, epoch) of each.
pub async fn owned_generations(client: &LogClient, n: usize, decoder: &str) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for j in 0..n {
        let id = submit(client, &format!("{decoder}-{j}")).await;
        out.push((id, acquire(client, id, decoder).await));
    }
    out
}

/// The binding of a sampled generation of `model` in exact mode (what the real-model process
/// tests submit).
pub fn sampled_binding(
    model: &dyn tokenlog_decoder::Model,
    prompt: &[u32],
    s: &tokenlog_decoder::SamplingConfig,
    max_tokens: u32,
) -> pb::Binding {
    pb::Binding {
        model: Some(tokenlog_decoder::worker::identity_to_pb(model.identity())),
        prompt_token_ids: prompt.to_vec(),
        sampling: Some(pb::SamplingConfig {
            temperature: s.temperature,
            top_p: s.top_p,
            seed: s.seed,
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

/// Submits `binding` as request `rid` of tenant `t`; the generation's id.
pub async fn submit_binding(client: &LogClient, rid: &str, binding: pb::Binding) -> u64 {
    client
        .submit(pb::SubmitRequest {
            tenant: "t".into(),
            request_id: rid.into(),
            binding: Some(binding),
        })
        .await
        .unwrap()
        .generation
        .unwrap()
        .generation_id
}

/// The appends in a decoder's history (`--history`) at an epoch the decoder had not been
/// granted before it sent them: granted by an acquire's answer, or by a handoff it received
/// (`handoff_received`, recorded once the log committed its ownership). Each as
/// `(generation, epoch, start_seq)`.
pub fn writes_without_a_grant(history: &std::path::Path) -> Vec<(u64, u64, u32)> {
    use tokenlog_decoder::history::{Answer, Call, DecoderEvent, HistoryLine};
    let text = std::fs::read_to_string(history).unwrap_or_default();
    let mut granted: std::collections::HashSet<(u64, u64)> = Default::default();
    let mut acquires: std::collections::HashMap<u64, u64> = Default::default();
    let mut bad = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Ok(l) = serde_json::from_str::<HistoryLine>(line) else {
            continue;
        };
        match l {
            HistoryLine::Invoke {
                id,
                call: Call::Acquire { gen },
                ..
            } => {
                acquires.insert(id, gen);
            }
            HistoryLine::Complete {
                id,
                answer: Answer::Acquire {
                    ok: Some(true), epoch, ..
                },
                ..
            } => {
                if let Some(gen) = acquires.get(&id) {
                    granted.insert((*gen, epoch));
                }
            }
            HistoryLine::Event {
                event: DecoderEvent::HandoffReceived { gen, epoch, .. },
                ..
            } => {
                granted.insert((gen, epoch));
            }
            HistoryLine::Invoke {
                call: Call::Append {
                    gen, epoch, start_seq, ..
                },
                ..
            } if !granted.contains(&(gen, epoch)) => bad.push((gen, epoch, start_seq)),
            _ => {}
        }
    }
    bad
}
