//! The log's port is closed to strangers: three real `tokenlog node` processes serving mutual TLS
//! with certificates made by `tokenlog certs`. A plain-text client, a client without a
//! certificate, a client whose certificate has the wrong role, and one whose certificate another
//! CA signed are refused on every method of `raftlog.v1` and `raft.v1`, and nothing in the log
//! changes; the right roles work.

// See log_cluster.rs: the serial guard is held across awaits on purpose.
#![allow(clippy::await_holding_lock)]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{bin, free_port, make_certs, serial, tls, Cluster};
use tokenlog_proto::raft::raft_transport_client::RaftTransportClient;
use tokenlog_proto::raft::{RaftPayload, SnapshotChunk};
use tokenlog_proto::raftlog as pb;
use tokenlog_proto::raftlog::log_client::LogClient as PbClient;
use tokenlog_raftlog::client::LogClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::Code;

/// How a test client connects.
enum Cred<'a> {
    /// http:// to a TLS port.
    PlainText,
    /// TLS, verifying the node, presenting no certificate.
    NoCertificate(&'a Path),
    /// TLS with holder `name`'s certificate from the directory.
    Holder(&'a Path, &'a str),
}

fn channel(addr: &str, cred: &Cred) -> Channel {
    let ep = |scheme: &str| {
        Endpoint::from_shared(format!("{scheme}://{addr}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(5))
    };
    match cred {
        Cred::PlainText => ep("http").connect_lazy(),
        Cred::NoCertificate(dir) => {
            let ca = std::fs::read(dir.join("ca.pem")).unwrap();
            let cfg = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(ca))
                .domain_name(tokenlog_raftlog::tls::NODE_SERVER_NAME);
            ep("https").tls_config(cfg).unwrap().connect_lazy()
        }
        Cred::Holder(dir, name) => ep("https")
            .tls_config(tls(dir, name).client_config())
            .unwrap()
            .connect_lazy(),
    }
}

/// Who may call what, written out here independently of the node's own table
/// (`tokenlog_raftlog::auth::allowed`).
const ROLES: &[(&str, &[&str])] = &[
    ("Submit", &["gateway"]),
    ("Cancel", &["gateway"]),
    ("ListModels", &["decoder", "gateway", "admin"]),
    ("Get", &["decoder", "gateway", "admin"]),
    ("Watch", &["decoder", "gateway", "admin"]),
    ("ClusterStatus", &["decoder", "gateway", "admin"]),
    ("Register", &["decoder"]),
    ("PublishTokenizer", &["decoder"]),
    ("GetTokenizer", &["decoder", "gateway", "admin"]),
    ("PendingWork", &["decoder"]),
    ("Acquire", &["decoder"]),
    ("Renew", &["decoder"]),
    ("BindPrompt", &["decoder"]),
    ("Append", &["decoder"]),
    ("AppendStream", &["decoder"]),
    ("Finish", &["decoder"]),
    ("Release", &["decoder"]),
    ("Handoff", &["decoder"]),
    ("Standby", &["decoder"]),
    ("ChangeMembership", &["admin"]),
    ("Verify", &["admin"]),
    ("ChainHeads", &["admin"]),
    ("StateDigest", &["admin"]),
    ("raft.AppendEntries", &["node"]),
    ("raft.AppendStream", &["node"]),
    ("raft.RequestVote", &["node"]),
    ("raft.InstallSnapshot", &["node"]),
];

/// Calls `method` with an empty request (a stream of one for streaming methods); the outcome's
/// code (`Ok` when the call was answered).
async fn call(ch: Channel, method: &str) -> Code {
    let mut log = PbClient::new(ch.clone());
    let mut raft = RaftTransportClient::new(ch);
    macro_rules! code {
        ($e:expr) => {
            match $e.await {
                Ok(_) => Code::Ok,
                Err(s) => s.code(),
            }
        };
    }
    let one = |r: pb::AppendRequest| futures::stream::iter([r]);
    match method {
        "Submit" => code!(log.submit(pb::SubmitRequest::default())),
        "Cancel" => code!(log.cancel(pb::CancelRequest::default())),
        "ListModels" => code!(log.list_models(pb::ListModelsRequest::default())),
        "Get" => code!(log.get(pb::GetRequest::default())),
        "Watch" => code!(log.watch(pb::WatchRequest::default())),
        "ClusterStatus" => code!(log.cluster_status(pb::ClusterStatusRequest::default())),
        "Register" => code!(log.register(pb::RegisterRequest::default())),
        "PublishTokenizer" => code!(log.publish_tokenizer(pb::PublishTokenizerRequest::default())),
        "GetTokenizer" => code!(log.get_tokenizer(pb::GetTokenizerRequest::default())),
        "PendingWork" => code!(log.pending_work(pb::PendingWorkRequest::default())),
        "Acquire" => code!(log.acquire(pb::AcquireRequest::default())),
        "Renew" => code!(log.renew(pb::RenewRequest::default())),
        "BindPrompt" => code!(log.bind_prompt(pb::BindPromptRequest::default())),
        "Append" => code!(log.append(pb::AppendRequest::default())),
        "AppendStream" => code!(log.append_stream(one(pb::AppendRequest::default()))),
        "Finish" => code!(log.finish(pb::FinishRequest::default())),
        "Release" => code!(log.release(pb::ReleaseRequest::default())),
        "Handoff" => code!(log.handoff(pb::HandoffRequest::default())),
        "Standby" => code!(log.standby(pb::StandbyRequest::default())),
        "ChangeMembership" => code!(log.change_membership(pb::ChangeMembershipRequest::default())),
        "Verify" => code!(log.verify(pb::VerifyRequest::default())),
        "ChainHeads" => code!(log.chain_heads(pb::ChainHeadsRequest::default())),
        "StateDigest" => code!(log.state_digest(pb::StateDigestRequest::default())),
        "raft.AppendEntries" => code!(raft.append_entries(RaftPayload::default())),
        "raft.AppendStream" => code!(raft.append_stream(futures::stream::iter([RaftPayload::default()]))),
        "raft.RequestVote" => code!(raft.request_vote(RaftPayload::default())),
        "raft.InstallSnapshot" => code!(raft.install_snapshot(futures::stream::iter([SnapshotChunk::default()]))),
        m => panic!("no such method {m}"),
    }
}

/// What must not change while strangers knock: the term (a vote request that got through would
/// raise it), the leader, the voters, and that no generation exists.
async fn fingerprint(c: &Cluster) -> (u64, u64, Vec<u64>, u64) {
    let s = c.client().cluster_status(true).await.unwrap();
    let voters = s.members.iter().filter(|m| m.voter).map(|m| m.node_id).collect();
    let generations: u64 = s.generations_by_state.values().sum();
    (s.term, s.leader_id, voters, generations)
}

/// A TLS cluster whose certificates (`make_certs` with `extra` too, when given) are in `certs`;
/// the leader's index, and log clients as `gateway-1` and as `decoder-2`.
struct TlsLog {
    certs: tempfile::TempDir,
    c: Cluster,
    leader: usize,
    gateway: LogClient,
    d2: LogClient,
}

async fn tls_log(extra: &[&str]) -> TlsLog {
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path(), &[]);
    if !extra.is_empty() {
        make_certs(certs.path(), extra);
    }
    let c = Cluster::start_tls(certs.path());
    let leader = c.leader().await;
    let client = |name: &str| LogClient::with_tls(c.addrs.clone(), Some(tls(certs.path(), name))).unwrap();
    let (gateway, d2) = (client("gateway-1"), client("decoder-2"));
    TlsLog {
        certs,
        c,
        leader,
        gateway,
        d2,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_and_wrong_roles_are_refused_on_every_method_and_change_nothing() {
    let _g = serial();
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path(), &[]);
    // A certificate with a fine role, signed by somebody else's CA.
    let foreign = tempfile::tempdir().unwrap();
    make_certs(foreign.path(), &["--admin", "admin", "--node", "node-1"]);
    let c = Cluster::start_tls(certs.path());
    let leader = c.leader().await;
    let before = fingerprint(&c).await;
    assert_eq!(before.3, 0, "a new cluster has no generations");
    // Every node, not just the leader: a follower must refuse a vote or an append as well.
    for (client_addr, peer_addr) in c.addrs.iter().zip(&c.peer_addrs) {
        for (method, allowed) in ROLES {
            // Each service on its own listener: raft.v1 for peers, raftlog.v1 for clients.
            let (addr, other) = if method.starts_with("raft.") {
                (peer_addr, client_addr)
            } else {
                (client_addr, peer_addr)
            };
            let holder = match allowed[0] {
                "node" => "node-2",
                "decoder" => "decoder-1",
                "gateway" => "gateway-1",
                _ => "admin",
            };
            let elsewhere = call(channel(other, &Cred::Holder(certs.path(), holder)), method).await;
            assert_eq!(
                elsewhere,
                Code::Unimplemented,
                "{other} serves {method} on the wrong listener"
            );
            let plain = call(channel(addr, &Cred::PlainText), method).await;
            assert_ne!(plain, Code::Ok, "{addr} {method}: a plain-text call was answered");
            let none = call(channel(addr, &Cred::NoCertificate(certs.path())), method).await;
            assert_eq!(none, Code::Unauthenticated, "{addr} {method} without a certificate");
            for (dir, name) in [(foreign.path(), "admin"), (foreign.path(), "node-1")] {
                let got = call(channel(addr, &Cred::Holder(dir, name)), method).await;
                assert!(
                    !matches!(got, Code::Ok | Code::PermissionDenied | Code::InvalidArgument),
                    "{addr} {method}: a certificate of another CA got past the handshake ({got:?})"
                );
            }
            for (role, holder) in [
                ("node", "node-2"),
                ("decoder", "decoder-1"),
                ("gateway", "gateway-1"),
                ("admin", "admin"),
            ] {
                if allowed.contains(&role) {
                    continue;
                }
                let got = call(channel(addr, &Cred::Holder(certs.path(), holder)), method).await;
                assert_eq!(got, Code::PermissionDenied, "{addr} {method} as {role}");
            }
        }
    }
    assert_eq!(fingerprint(&c).await, before, "the refused calls changed the log");
    assert_eq!(c.leader().await, leader);

    // The right roles work, through the same listener.
    let gateway = LogClient::with_tls(c.addrs.clone(), Some(tls(certs.path(), "gateway-1"))).unwrap();
    let decoder = LogClient::with_tls(c.addrs.clone(), Some(tls(certs.path(), "decoder-1"))).unwrap();
    let id = common::submit(&gateway, "r1").await;
    let epoch = common::acquire(&decoder, id, "decoder-1").await;
    common::append_first(&decoder, "decoder-1", id, epoch, &[5, 6, 7]).await;
    let got = gateway
        .get(pb::GetRequest {
            generation_id: id,
            linearizable: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        got.generation.unwrap().frontier,
        3,
        "the gateway reads what the decoder wrote"
    );
    let verify = c
        .client()
        .node(&c.addrs[0])
        .verify(pb::VerifyRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(verify.problems.is_empty(), "{verify:?}");
    assert_eq!(
        c.converged().await.len(),
        1,
        "the nodes replicate to each other over mutual TLS"
    );
    // A node's certificate passes the guard of raft.v1 (the empty payload is then refused as
    // malformed, not as unauthorized).
    let as_node = call(
        channel(&c.peer_addrs[0], &Cred::Holder(certs.path(), "node-3")),
        "raft.AppendEntries",
    )
    .await;
    assert!(
        !matches!(as_node, Code::Ok | Code::PermissionDenied | Code::Unauthenticated),
        "{as_node:?}"
    );
}

/// Runs `cmd` to its end, which must come within `limit` (a node that should have refused to
/// start but serves instead fails the test rather than hanging it).
fn exits_within(mut cmd: Command, limit: Duration) -> std::process::Output {
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn a_node_refuses_plain_text_beyond_loopback_unless_insecure() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut cmd = Command::new(bin());
    cmd.args(["node", "--id", "1", "--listen", &format!("0.0.0.0:{port}")])
        .arg("--data-dir")
        .arg(dir.path().join("d"));
    let out = exits_within(cmd, Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("refusing to serve plain text"), "{err}");
    assert!(!dir.path().join("d").exists(), "nothing was written before refusing");

    let mut child = Command::new(bin())
        .args([
            "node",
            "--id",
            "1",
            "--listen",
            &format!("0.0.0.0:{port}"),
            // On every address a node must say where it is reached.
            "--advertise",
            &format!("127.0.0.1:{port}"),
            "--insecure",
        ])
        .arg("--data-dir")
        .arg(dir.path().join("d"))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the --insecure node did not start listening");
        assert!(child.try_wait().unwrap().is_none(), "the --insecure node exited");
        std::thread::sleep(Duration::from_millis(100));
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A gateway without an API keys file says, as it starts, that it is open, when a listener is
/// beyond loopback: every caller there is one tenant. Before, it started silently (the compose
/// file runs it that way). On loopback it says nothing.
#[test]
fn an_open_gateway_beyond_loopback_warns_that_every_caller_is_one_tenant() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    for (host, warns) in [("0.0.0.0", true), ("127.0.0.1", false)] {
        let (grpc, http) = (free_port(), free_port());
        let err_path = dir.path().join(format!("gateway-{host}.err"));
        let out_path = dir.path().join(format!("gateway-{host}.out"));
        let mut child = Command::new(bin())
            .args(["gateway", "--cluster", "127.0.0.1:9"])
            .args(["--grpc-listen", &format!("127.0.0.1:{grpc}")])
            .args(["--http-listen", &format!("{host}:{http}")])
            .stdout(std::fs::File::create(&out_path).unwrap())
            .stderr(std::fs::File::create(&err_path).unwrap())
            .spawn()
            .unwrap();
        // Its status line ("gateway: gRPC ...") comes out right after the warning.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !std::fs::read_to_string(&out_path).unwrap().contains("gateway: ") {
            assert!(Instant::now() < deadline, "the gateway did not say it serves");
            assert!(child.try_wait().unwrap().is_none(), "the gateway exited");
            std::thread::sleep(Duration::from_millis(100));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let err = std::fs::read_to_string(&err_path).unwrap();
        assert_eq!(
            err.contains("warning: no --keys: the gateway is open on"),
            warns,
            "{host}: {err}"
        );
        if warns {
            assert!(
                err.contains(&format!("0.0.0.0:{http}")) && err.contains("\"default\""),
                "{err}"
            );
        }
    }
}

#[test]
fn tls_material_is_checked_before_a_node_starts() {
    let _g = serial();
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path(), &["--node", "n1", "--decoder", "d1"]);
    // Running `certs` again keeps the CA and the existing holders, and adds new ones under it.
    make_certs(certs.path(), &["--node", "n2"]);
    let other = tempfile::tempdir().unwrap();
    make_certs(other.path(), &["--node", "n1"]);
    let node = |cert: &Path, key: &Path, ca: &Path| {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(bin());
        cmd.args(["node", "--id", "1", "--listen", &format!("127.0.0.1:{}", free_port())])
            .arg("--data-dir")
            .arg(dir.path().join("d"))
            .arg("--tls-ca")
            .arg(ca)
            .arg("--tls-cert")
            .arg(cert)
            .arg("--tls-key")
            .arg(key);
        let out = exits_within(cmd, Duration::from_secs(20));
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let p = |d: &Path, f: &str| d.join(f);
    let c = certs.path();
    let wrong_role = node(&p(c, "d1.pem"), &p(c, "d1.key"), &p(c, "ca.pem"));
    assert!(wrong_role.contains("needs a certificate of role node"), "{wrong_role}");
    let foreign = node(&p(other.path(), "n1.pem"), &p(other.path(), "n1.key"), &p(c, "ca.pem"));
    assert!(foreign.contains("was not issued by the CA"), "{foreign}");
    let missing = node(&p(c, "n9.pem"), &p(c, "n1.key"), &p(c, "ca.pem"));
    assert!(missing.contains("n9.pem"), "{missing}");
    let garbage = node(&p(c, "ca.key"), &p(c, "n1.key"), &p(c, "ca.pem"));
    assert!(garbage.contains("ca.key"), "{garbage}");
    // The second run signed n2 under the first run's CA.
    let n2 = tls(c, "n2");
    assert_eq!(n2.holder.name, "n2");
    assert_eq!(n2.holder.role, tokenlog_raftlog::tls::Role::Node);
}

/// A gateway serving its clients over TLS (`--listen-tls-cert`), over a log that serves mutual
/// TLS: a client that trusts the CA streams a generation over gRPC (the library and
/// `tokenlog generate --gateway-ca`) and lists models over HTTPS; a plain-text client gets
/// nothing; a key that does not go with the certificate stops the gateway before it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_serves_its_clients_over_tls() {
    let _g = serial();
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path(), &[]);
    let c = Cluster::start_tls(certs.path());
    c.leader().await;
    let d = certs.path();
    let arg = |f: &str| d.join(f).display().to_string();
    let mut listen_tls = common::tls_args(d, "gateway-1");
    listen_tls.extend([
        "--listen-tls-cert".into(),
        arg("gateway-1.pem"),
        "--listen-tls-key".into(),
        arg("gateway-1.key"),
    ]);
    let listen_tls: Vec<&str> = listen_tls.iter().map(String::as_str).collect();
    let gw = c.start_gateway("gw-tls", &listen_tls);
    let dec_args = common::tls_args(d, "decoder-1");
    let _dec = c.start_decoder("decoder-1", &dec_args.iter().map(String::as_str).collect::<Vec<_>>());
    common::wait_for_model(&c.client()).await;

    // gRPC over TLS, through the client library.
    let ca = std::fs::read(d.join("ca.pem")).unwrap();
    let client = tokenlog_gateway::client::GatewayClient::with_ca(vec![gw.grpc.clone()], None, Some(&ca)).unwrap();
    let req = tokenlog_proto::tokenlog::GenerateRequest {
        request_id: "tls-1".into(),
        prompt: "hello".into(),
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    };
    let mut stream = Box::pin(client.generate(req));
    let mut seqs = Vec::new();
    while let Some(ev) = futures::StreamExt::next(&mut stream).await {
        let ev = ev.unwrap();
        if ev.last {
            break;
        }
        seqs.push(ev.seq);
    }
    assert_eq!(seqs, (0..8).collect::<Vec<_>>());
    // ... and through the CLI.
    let out = Command::new(bin())
        .args(["generate", "--gateway", &gw.grpc, "--max-tokens", "4", "--raw", "hi"])
        .arg("--gateway-ca")
        .arg(d.join("ca.pem"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // HTTPS, verified against the CA.
    let https = Command::new("curl")
        .args(["-sS", "--fail", "--cacert", &arg("ca.pem")])
        .arg(format!("https://{}/v1/models", gw.http))
        .output()
        .unwrap();
    assert!(https.status.success(), "{}", String::from_utf8_lossy(&https.stderr));
    assert!(String::from_utf8_lossy(&https.stdout).contains("\"id\""));
    // Plain text gets no answer on either port.
    let plain = Command::new("curl")
        .args(["-sS", "--max-time", "5"])
        .arg(format!("http://{}/v1/models", gw.http))
        .output()
        .unwrap();
    assert!(
        !plain.status.success(),
        "plain HTTP answered: {}",
        String::from_utf8_lossy(&plain.stdout)
    );
    let plain = tokio::time::timeout(Duration::from_secs(10), async {
        use tokenlog_proto::tokenlog as tpb;
        let mut c = tpb::generation_client::GenerationClient::connect(format!("http://{}", gw.grpc))
            .await
            .map_err(|e| e.to_string())?;
        c.status(tpb::StatusRequest {
            request_id: "tls-1".into(),
        })
        .await
        .map_err(|e| e.to_string())
    })
    .await;
    assert!(!matches!(plain, Ok(Ok(_))), "plain gRPC answered: {plain:?}");

    // A key that is not the certificate's: refused at start, naming both files.
    let mut cmd = Command::new(bin());
    cmd.args(["gateway", "--cluster", &c.addrs[0]])
        .args(["--grpc-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--http-listen", &format!("127.0.0.1:{}", free_port())])
        .args([
            "--listen-tls-cert",
            &arg("gateway-1.pem"),
            "--listen-tls-key",
            &arg("gateway-2.key"),
        ]);
    let out = exits_within(cmd, Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("gateway-2.key") && err.contains("does not go with"),
        "{err}"
    );
}

/// A call's outcome: `Ok`, or its status code.
fn code<T>(r: Result<tonic::Response<T>, tonic::Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// A streaming call's outcome: its first message's (a stream's handler may refuse after it
/// reads what the caller sent).
async fn stream_code<T>(r: Result<tonic::Response<tonic::Streaming<T>>, tonic::Status>) -> Code {
    match r {
        Ok(resp) => match resp.into_inner().message().await {
            Ok(_) => Code::Ok,
            Err(e) => e.code(),
        },
        Err(s) => s.code(),
    }
}

/// A decoder cannot finish, release or bind a generation under an epoch the log has not
/// granted yet: the call is refused, not proposed. It was proposed for the command's fence to
/// refuse; but when another decoder's Acquire of that epoch was proposed and not yet committed,
/// the grant committed first, and the fence, which checks epochs, not owners, let decoder-1's
/// finish end decoder-2's generation. Here decoder-1 keeps sending finishes under epoch 1 while
/// decoder-2 acquires it, generation after generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_cannot_act_under_an_epoch_granted_to_another_while_it_asked() {
    const ROUNDS: usize = 12;
    const SENDERS: usize = 6;
    let _g = serial();
    let TlsLog {
        certs,
        c,
        leader,
        gateway,
        d2,
    } = tls_log(&[]).await;
    let d1 = PbClient::new(channel(&c.addrs[leader], &Cred::Holder(certs.path(), "decoder-1")));
    let mut sent = 0;
    let mut ended = vec![];
    for round in 0..ROUNDS {
        let id = common::submit(&gateway, &format!("race-{round}")).await;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let senders: Vec<_> = (0..SENDERS)
            .map(|_| {
                let (mut d1, done) = (d1.clone(), done.clone());
                tokio::spawn(async move {
                    let mut n = 0;
                    // Until decoder-2 holds the epoch, and a few more after.
                    let mut after = 0;
                    while after < 3 {
                        if done.load(std::sync::atomic::Ordering::Acquire) {
                            after += 1;
                        }
                        let _ = d1
                            .finish(pb::FinishRequest {
                                generation_id: id,
                                epoch: 1,
                                reason: pb::FinishReason::Stop as i32,
                                detail: "decoder-1 was here".into(),
                            })
                            .await;
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(5 * (round as u64 % 4))).await;
        let epoch = common::acquire(&d2, id, "decoder-2").await;
        assert_eq!(epoch, 1);
        done.store(true, std::sync::atomic::Ordering::Release);
        for s in senders {
            sent += s.await.unwrap();
        }
        let g = gateway.generation(id).await.unwrap();
        if g.state >= pb::GenerationState::Finished as i32 {
            ended.push((id, g.state, g.finish_detail));
        }
    }
    eprintln!("{sent} finishes sent by decoder-1 over {ROUNDS} acquires by decoder-2");
    assert!(
        ended.is_empty(),
        "decoder-1 ended decoder-2's generations ({sent} finishes sent): {ended:?}"
    );
}

/// A decoder certificate speaks for its own decoder id only. With decoder-1's certificate, every
/// call that names (or, by its epoch, belongs to) decoder-2 is refused with PERMISSION_DENIED
/// before anything is proposed: acquiring or renewing decoder-2's generation, writing its
/// tokens, finishing, releasing or re-binding it, holding decoder-2's session (whose end ends
/// its leases), registering as decoder-2, standing by, handing off, and pipeline and stage
/// records; decoder-2's generation is as it was. A pool certificate (`--decoder-pool pool`)
/// acts as `pool-...` ids only. A decoder process whose --decoder-id its certificate does not
/// name stops at start with a message; without --decoder-id it takes the certificate's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_certificate_speaks_only_for_its_own_decoder_id() {
    let _g = serial();
    let TlsLog {
        certs,
        c,
        leader,
        gateway,
        d2,
    } = tls_log(&["--decoder-pool", "pool"]).await;
    let id = common::submit(&gateway, "theirs").await;
    let epoch = common::acquire(&d2, id, "decoder-2").await;
    let before = gateway.generation(id).await.unwrap();

    let ch = channel(&c.addrs[leader], &Cred::Holder(certs.path(), "decoder-1"));
    let mut d1 = PbClient::new(ch);
    let theirs = "decoder-2".to_string();
    let append = pb::AppendRequest {
        decoder_id: theirs.clone(),
        lease_ms: 60_000,
        items: vec![pb::AppendItem {
            generation_id: id,
            epoch,
            start_seq: 0,
            token_ids: vec![9, 9, 9],
            ..Default::default()
        }],
    };
    let register = |decoder_id: &str| pb::RegisterRequest {
        decoder_id: decoder_id.into(),
        model_name: "m".into(),
        model: Some(common::model()),
        capacity: 1,
        ttl_ms: 10_000,
        ..Default::default()
    };
    let mut got: Vec<(&str, Code)> = vec![
        (
            "Acquire",
            code(
                d1.acquire(pb::AcquireRequest {
                    generation_id: id,
                    decoder_id: theirs.clone(),
                    lease_ms: 60_000,
                    model: Some(common::model()),
                    rng_version: 0,
                })
                .await,
            ),
        ),
        (
            "Renew",
            code(
                d1.renew(pb::RenewRequest {
                    generation_id: id,
                    epoch,
                    decoder_id: theirs.clone(),
                    lease_ms: 60_000,
                })
                .await,
            ),
        ),
        ("Append", code(d1.append(append.clone()).await)),
        (
            "AppendStream",
            stream_code(d1.append_stream(futures::stream::iter([append.clone()])).await).await,
        ),
        (
            "Finish",
            code(
                d1.finish(pb::FinishRequest {
                    generation_id: id,
                    epoch,
                    reason: pb::FinishReason::Stop as i32,
                    detail: String::new(),
                })
                .await,
            ),
        ),
        (
            "Release",
            code(
                d1.release(pb::ReleaseRequest {
                    generation_id: id,
                    epoch,
                })
                .await,
            ),
        ),
        (
            "BindPrompt",
            code(
                d1.bind_prompt(pb::BindPromptRequest {
                    generation_id: id,
                    epoch,
                    prompt_token_ids: vec![1, 2, 3],
                })
                .await,
            ),
        ),
        (
            "Session",
            stream_code(
                d1.session(futures::stream::iter([pb::SessionRequest {
                    decoder_id: theirs.clone(),
                    session_id: 7,
                }]))
                .await,
            )
            .await,
        ),
        ("Register", code(d1.register(register("decoder-2")).await)),
        (
            "Standby",
            code(
                d1.standby(pb::StandbyRequest {
                    generation_id: id,
                    decoder_id: theirs.clone(),
                    model: Some(common::model()),
                })
                .await,
            ),
        ),
        (
            "Handoff",
            code(
                d1.handoff(pb::HandoffRequest {
                    generation_id: id,
                    step: Some(pb::handoff_request::Step::Prepare(pb::HandoffPrepare {
                        epoch,
                        source: theirs.clone(),
                        destination: "decoder-1".into(),
                        manifest: None,
                    })),
                })
                .await,
            ),
        ),
        (
            "SetPipeline",
            code(
                d1.set_pipeline(pb::SetPipelineRequest {
                    head: theirs.clone(),
                    expect_epoch: 0,
                    stages: vec![],
                })
                .await,
            ),
        ),
        (
            "RegisterStage",
            code(
                d1.register_stage(pb::RegisterStageRequest {
                    stage: Some(pb::StageRegistration {
                        stage_id: "stage-x".into(),
                        addr: "127.0.0.1:1".into(),
                        ..Default::default()
                    }),
                    ttl_ms: 10_000,
                })
                .await,
            ),
        ),
    ];
    got.retain(|(_, code)| *code != Code::PermissionDenied);
    assert!(
        got.is_empty(),
        "calls for decoder-2 with decoder-1's certificate got through: {got:?}"
    );
    let after = gateway.generation(id).await.unwrap();
    assert_eq!(after, before, "decoder-2's generation changed");
    let models = gateway.list_models().await.unwrap();
    assert!(models.models.is_empty(), "{models:?}");
    // Its own id works (and so its owner's write does).
    assert_eq!(code(d1.register(register("decoder-1")).await), Code::Ok);
    common::append_first(&d2, "decoder-2", id, epoch, &[5, 6]).await;

    // A pool's certificate: ids under its prefix, no others.
    let mut pool = PbClient::new(channel(&c.addrs[leader], &Cred::Holder(certs.path(), "pool")));
    assert_eq!(code(pool.register(register("pool-7f3a")).await), Code::Ok);
    for other in ["pool", "pool-", "decoder-2", "apool-1"] {
        assert_eq!(
            code(pool.register(register(other)).await),
            Code::PermissionDenied,
            "{other}"
        );
    }

    // A decoder process: an id its certificate does not name stops it at start, with the way out.
    let tls_args = common::tls_args(certs.path(), "decoder-1");
    let mut cmd = Command::new(bin());
    cmd.args([
        "decoder",
        "--fake",
        "--cluster",
        &c.addrs.join(","),
        "--decoder-id",
        "decoder-2",
    ])
    .args(&tls_args);
    let out = exits_within(cmd, Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("\"decoder-2\"") && err.contains("--decoder-pool"), "{err}");
    // ... and without --decoder-id it is the certificate's decoder.
    let mut child = Command::new(bin())
        .args(["decoder", "--fake", "--cluster", &c.addrs.join(",")])
        .args(&tls_args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = gateway.list_models().await.unwrap();
        if m.models
            .iter()
            .any(|m| m.name != "m" && m.decoders.iter().any(|d| d == "decoder-1"))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the decoder did not register as decoder-1: {m:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

/// An owner's retried release (its first answer lost) is answered as the log answers any
/// retried release, over TLS too; and a finish after its lease ended (a session lost) gets the
/// log's rejection, not PERMISSION_DENIED. Before, a lease with no owner at the caller's epoch
/// was checked as held by nobody, so its very owner was refused as acting for another decoder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owners_retried_release_over_tls_is_answered_not_denied() {
    let _g = serial();
    let TlsLog {
        certs,
        c,
        leader,
        gateway,
        d2,
    } = tls_log(&[]).await;
    let id = common::submit(&gateway, "released").await;
    let epoch = common::acquire(&d2, id, "decoder-2").await;
    common::append_first(&d2, "decoder-2", id, epoch, &[5, 6]).await;
    let mut raw = PbClient::new(channel(&c.addrs[leader], &Cred::Holder(certs.path(), "decoder-2")));
    let release = pb::ReleaseRequest {
        generation_id: id,
        epoch,
    };
    let first = raw.release(release).await.expect("the release").into_inner();
    assert!(first.ok, "{first:?}");
    let again = raw.release(release).await;
    assert!(
        again.as_ref().is_ok_and(|r| r.get_ref().ok),
        "the retried release: {again:?}"
    );
    let finish = raw
        .finish(pb::FinishRequest {
            generation_id: id,
            epoch,
            reason: pb::FinishReason::Stop as i32,
            detail: String::new(),
        })
        .await;
    match finish {
        Ok(r) => assert!(!r.get_ref().ok && r.get_ref().rejection.is_some(), "{r:?}"),
        Err(s) => panic!("a finish after the release: {s:?}"),
    }
    // Another decoder's release at that epoch is the fence's to judge: the lease is nobody's,
    // and nothing changes.
    let mut other = PbClient::new(channel(&c.addrs[leader], &Cred::Holder(certs.path(), "decoder-1")));
    let r = other
        .release(pb::ReleaseRequest {
            generation_id: id,
            epoch,
        })
        .await;
    assert!(r.is_ok(), "{r:?}");
    let g = gateway.generation(id).await.unwrap();
    assert_eq!(g.frontier, 2);
    assert!(g.lease.is_some_and(|l| l.owner.is_empty() && l.epoch == epoch));
}
