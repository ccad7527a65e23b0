//! The deployment on Docker, end to end: the image built from the binary these tests built
//! (`deploy/image/build.sh`), `deploy/compose/up.sh` (3 nodes, 2 decoders, 2 gateways, mutual TLS
//! everywhere), one generation streamed through the published gateways while the container that
//! owns it and the leader node's container are killed, the killed node restarted, and then the
//! new leader cut off both of its networks. The client's output must be complete, gap-free and
//! duplicate-free; `down.sh` must leave no container, network or volume behind.
//!
//! Needs the Docker daemon: without it the test fails and says so (it does not skip).

// See log_cluster.rs: the serial guard is held across awaits on purpose.
#![allow(clippy::await_holding_lock)]

mod common;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{bin, free_port, serial, tls};
use tokenlog_proto::tokenlog as tpb;
use tokenlog_raftlog::client::LogClient;

const TOKENS: usize = 1_500;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The compose project of one test run, and the environment its scripts run with.
struct Deployment {
    project: String,
    env: Vec<(String, String)>,
    certs: tempfile::TempDir,
    grpc: [u16; 2],
    nodes: [u16; 3],
    down: bool,
}

impl Deployment {
    fn new() -> Deployment {
        let project = format!("tltest{}", std::process::id());
        let certs = tempfile::tempdir().unwrap();
        let grpc = [free_port(), free_port()];
        let http = [free_port(), free_port()];
        let nodes = [free_port(), free_port(), free_port()];
        let env = vec![
            ("COMPOSE_PROJECT_NAME", project.clone()),
            ("TOKENLOG_IMAGE", "tokenlog:test".into()),
            ("TOKENLOG_CERTS", certs.path().display().to_string()),
            ("TOKENLOG_GRPC_PORT", grpc[0].to_string()),
            ("TOKENLOG_GRPC_PORT_2", grpc[1].to_string()),
            ("TOKENLOG_HTTP_PORT", http[0].to_string()),
            ("TOKENLOG_HTTP_PORT_2", http[1].to_string()),
            ("TOKENLOG_NODE_1_PORT", nodes[0].to_string()),
            ("TOKENLOG_NODE_2_PORT", nodes[1].to_string()),
            ("TOKENLOG_NODE_3_PORT", nodes[2].to_string()),
            ("TOKENLOG_FAKE_STEP_MS", "20".into()),
        ];
        Deployment {
            project,
            env: env.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            certs,
            grpc,
            nodes,
            down: false,
        }
    }

    fn script(&self, path: &str, args: &[&str]) {
        let out = Command::new(repo().join(path))
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap_or_else(|e| panic!("running {path}: {e}"));
        assert!(
            out.status.success(),
            "{path} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn container(&self, service: &str) -> String {
        format!("{}_{service}_1", self.project)
    }

    fn admin(&self) -> LogClient {
        let addrs = self.nodes.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        LogClient::with_options(addrs, Duration::from_secs(30), Some(tls(self.certs.path(), "admin"))).unwrap()
    }

    fn down(&mut self) {
        self.down = true;
        self.script("deploy/compose/down.sh", &[]);
    }

    /// What of this project is still on the daemon: containers, networks, volumes.
    fn leftovers(&self) -> Vec<String> {
        let label = format!("label=com.docker.compose.project={}", self.project);
        let mut left = Vec::new();
        for kind in [&["ps", "-a"][..], &["network", "ls"], &["volume", "ls"]] {
            let out = Command::new("docker")
                .args(kind)
                .args(["-q", "--filter", &label])
                .output()
                .unwrap();
            left.extend(
                String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .map(|l| format!("{kind:?} {l}")),
            );
        }
        left
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        if !self.down {
            // A failed test: show what the containers said, then clean up anyway.
            let _ = Command::new("docker-compose")
                .args(["-f", "deploy/compose/docker-compose.yml", "logs", "--tail", "30"])
                .current_dir(repo())
                .envs(self.env.iter().map(|(k, v)| (k, v)))
                .status();
            let _ = Command::new(repo().join("deploy/compose/down.sh"))
                .envs(self.env.iter().map(|(k, v)| (k, v)))
                .status();
        }
    }
}

fn docker(args: &[&str]) {
    let out = Command::new("docker").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn wait_for<F: FnMut() -> bool>(what: &str, within: Duration, mut f: F) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_streams_through_an_owner_kill_a_leader_kill_and_a_cut_node() {
    let _g = serial();
    let info = Command::new("docker").arg("info").output();
    assert!(
        matches!(&info, Ok(o) if o.status.success()),
        "this test needs the Docker daemon, which does not answer (`docker info`: {:?}); it does not skip",
        info.map(|o| String::from_utf8_lossy(&o.stderr).to_string())
    );
    let mut d = Deployment::new();
    d.script("deploy/image/build.sh", &["--binary", &bin(), "--tag", "tokenlog:test"]);
    d.script("deploy/compose/up.sh", &[]);

    // One generation, long enough (1,500 tokens at 20 ms) to outlive every fault below.
    let gateways = format!("127.0.0.1:{},127.0.0.1:{}", d.grpc[0], d.grpc[1]);
    let mut client = Command::new(bin())
        .args([
            "generate",
            "--gateway",
            &gateways,
            "--request-id",
            "docker-1",
            "--json",
            "--ignore-eos",
        ])
        .args(["--max-tokens", &TOKENS.to_string(), "Tell me a long story."])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Each event, and when it arrived.
    let lines = Arc::new(Mutex::new(Vec::<serde_json::Value>::new()));
    let arrived = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let reader = {
        let (lines, arrived) = (lines.clone(), arrived.clone());
        let out = client.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(out).lines() {
                let v: serde_json::Value = serde_json::from_str(&l.unwrap()).expect("a JSON event per line");
                lines.lock().unwrap().push(v);
                arrived.lock().unwrap().push(Instant::now());
            }
        })
    };
    // The longest wait between two events from event `from` on (a fault's cost to the client).
    let longest_gap = |from: usize, to: usize| {
        let a = arrived.lock().unwrap();
        a[from.max(1)..to.min(a.len())]
            .iter()
            .zip(&a[from.max(1) - 1..])
            .map(|(later, earlier)| later.duration_since(*earlier))
            .max()
            .unwrap_or_default()
    };
    let seen = || lines.lock().unwrap().len();
    wait_for("the first 50 tokens", Duration::from_secs(60), || seen() >= 50).await;

    // Kill the owner and the leader at once.
    let mut gw = tpb::generation_client::GenerationClient::connect(format!("http://127.0.0.1:{}", d.grpc[0]))
        .await
        .unwrap();
    let owner = gw
        .status(tpb::StatusRequest {
            request_id: "docker-1".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .owner;
    assert!(owner == "decoder-1" || owner == "decoder-2", "owner {owner:?}");
    let admin = d.admin();
    let leader = admin.cluster_status(true).await.unwrap().leader_id;
    let leader_container = d.container(&format!("node-{leader}"));
    docker(&["kill", &d.container(&owner)]);
    docker(&["kill", &leader_container]);
    let at_kill = seen();
    eprintln!("killed {owner} and node-{leader} after {at_kill} events");
    wait_for("100 more tokens after the kills", Duration::from_secs(60), || {
        seen() >= at_kill + 100
    })
    .await;

    // The killed node comes back (as a supervisor would restart it) and catches up; then the
    // leader of the moment is cut off both networks.
    docker(&["start", &leader_container]);
    let port = d.nodes[leader as usize - 1];
    let restarted = LogClient::with_options(
        vec![format!("127.0.0.1:{port}")],
        Duration::from_secs(2),
        Some(tls(d.certs.path(), "admin")),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut node = restarted.node(&format!("127.0.0.1:{port}"));
        let back = node
            .cluster_status(tokenlog_proto::raftlog::ClusterStatusRequest { linearizable: false })
            .await
            .map(|r| r.into_inner());
        if matches!(&back, Ok(s) if s.leader_id != 0 && s.applied_index > 0) {
            break;
        }
        assert!(Instant::now() < deadline, "node-{leader} did not come back: {back:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let now_leader = admin.cluster_status(true).await.unwrap().leader_id;
    let cut = d.container(&format!("node-{now_leader}"));
    for net in ["peers", "clients"] {
        docker(&["network", "disconnect", &format!("{}_{net}", d.project), &cut]);
    }
    let at_cut = seen();
    eprintln!("cut node-{now_leader} off after {at_cut} events");

    // The client's output: complete, gap-free, duplicate-free.
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(st) = client.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the generation did not finish");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    reader.join().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut client.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "tokenlog generate failed: {err}");
    let events = lines.lock().unwrap().clone();
    let (last, tokens) = events.split_last().expect("events");
    assert_eq!(last["last"], true, "{last}");
    assert_eq!(last["finish_reason"], "length", "{last}");
    let seqs: Vec<u64> = tokens.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (0..TOKENS as u64).collect::<Vec<_>>(), "gaps or duplicates");
    assert!(
        at_cut < TOKENS,
        "the cut came after the generation had ended ({at_cut} events)"
    );
    let epochs: Vec<u64> = tokens.iter().map(|e| e["epoch"].as_u64().unwrap()).collect();
    assert!(
        epochs.windows(2).all(|w| w[0] <= w[1]) && epochs[0] < epochs[TOKENS - 1],
        "another decoder took over (epochs {} .. {})",
        epochs[0],
        epochs[TOKENS - 1]
    );
    let (after_kills, after_cut) = (longest_gap(at_kill, at_cut), longest_gap(at_cut, TOKENS + 1));
    eprintln!(
        "{TOKENS} tokens, epochs {}..{}; longest wait for a token after the kills {after_kills:?}, after the cut {after_cut:?}; {err}",
        epochs[0],
        epochs[TOKENS - 1],
    );
    // An election, a lapsed lease and a dead connection noticed (HTTP/2 keepalive) take a few
    // seconds; a connection to a vanished container waited on for ever does not end at all.
    for (what, gap) in [("the kills", after_kills), ("the cut", after_cut)] {
        assert!(
            gap < Duration::from_secs(15),
            "after {what} the client waited {gap:?} for a token"
        );
    }

    d.down();
    assert_eq!(d.leftovers(), Vec::<String>::new(), "down.sh left these behind");
    assert!(Path::new(d.certs.path()).join("ca.pem").exists());
}
