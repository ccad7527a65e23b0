//! The binary's refusals of what it cannot do right, each with a message that says why and what
//! to give instead, before anything listens or connects. Each of these used to start (or run)
//! and go wrong later, or silently.

mod common;

use std::process::{Command, Output};

use common::bin;

fn run(args: &[&str]) -> Output {
    Command::new(bin()).args(args).output().expect("run tokenlog")
}

/// Exit code and stderr.
fn refused(args: &[&str]) -> (Option<i32>, String) {
    let out = run(args);
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A node listening on every address must say where it is reached: its membership entry (and
/// every redirect to it as the leader) named 0.0.0.0. Peer id 0 can be no node's, and as the
/// lowest id it was the one to initialize the cluster: nobody did, and the nodes waited.
#[test]
fn a_node_refuses_an_unreachable_address_and_a_peer_of_id_0() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d1");
    let data = data.to_str().unwrap();
    let (code, err) = refused(&[
        "node",
        "--id",
        "1",
        "--listen",
        "0.0.0.0:7001",
        "--insecure",
        "--data-dir",
        data,
        "--peers",
        "1=127.0.0.1:7001",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("listens on every address") && err.contains("--advertise"),
        "{err}"
    );
    let (code, err) = refused(&[
        "node",
        "--id",
        "1",
        "--data-dir",
        data,
        "--peers",
        "0=127.0.0.1:7000,1=127.0.0.1:7001",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("ids are positive"), "{err}");
}

/// `tokenlog dev` serves its log API without TLS or keys: beyond loopback only when told
/// `--insecure` (it served anyone who reached it, append and membership included).
#[test]
fn dev_refuses_to_serve_its_log_api_in_plain_text_beyond_loopback() {
    let (code, err) = refused(&["dev", "--fake", "--listen", "0.0.0.0:7001"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("refusing to serve the log API in plain text") && err.contains("--insecure"),
        "{err}"
    );
}

/// Flags whose values the log or the machine cannot take are refused by clap, naming the flag:
/// a decoder lease the log refuses at every acquire (the decoder registered, said it was ready,
/// and never decoded), a bench base port that overflowed, `--after` without `--resume`
/// (ignored: the whole stream was printed), a prompt with `--resume` (ignored).
#[test]
fn flags_the_command_cannot_honour_are_refused_by_name() {
    for (args, flag) in [
        (&["decoder", "--fake", "--lease-ms", "50"][..], "--lease-ms"),
        (&["decoder", "--fake", "--lease-ms", "700000"][..], "--lease-ms"),
        (&["bench", "log", "--base-port", "65534"][..], "--base-port"),
        (&["bench", "decoders", "--decoders", "65536"][..], "--decoders"),
        // One step's tokens of every generation are one append, of at most 1,024 items: more
        // were refused whole, dropped as lost and taken again, for ever.
        (&["decoder", "--fake", "--capacity", "1025"][..], "--capacity"),
        (&["dev", "--fake", "--capacity", "5000"][..], "--capacity"),
        // Beyond a generation's tokens no write fits: the bench measured nothing, and said 0.
        (&["bench", "log", "--tokens-per-step", "40000"][..], "--tokens-per-step"),
        (&["generate", "--request-id", "r", "--after", "5", "hi"][..], "--resume"),
        (&["generate", "--resume", "--request-id", "r", "hi"][..], "--resume"),
        // A resume submits nothing: the settings of a generation were dropped without a word.
        (
            &["generate", "--resume", "--request-id", "r", "--max-tokens", "5"][..],
            "--max-tokens",
        ),
        (
            &["generate", "--resume", "--request-id", "r", "--seed", "7"][..],
            "--seed",
        ),
        (&["generate", "--raw", "--system", "be terse", "hi"][..], "--system"),
        // Flags that did nothing without another: a drain needs the handoff listener, a keep
        // bound a pipeline, an advertised address the log it is registered in.
        (&["decoder", "--fake", "--drain-ms", "20000"][..], "--handoff-listen"),
        (&["decoder", "--pipeline-keep-mib", "64"][..], "--pipeline"),
        (&["decoder", "--fake", "--device", "bogus"][..], "--device"),
        (&["stage", "--layers", "0..10", "--advertise", "h:1"][..], "--cluster"),
    ] {
        let (code, err) = refused(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

/// `members replace N N ADDR` is refused: the add changed nothing (a member keeps its address)
/// and the remove then took node N out of the cluster.
#[test]
fn replacing_a_member_by_itself_is_refused() {
    let (code, err) = refused(&[
        "members",
        "--cluster",
        "127.0.0.1:1",
        "replace",
        "3",
        "3",
        "127.0.0.1:7005",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("needs an id of its own"), "{err}");
}

/// `certs --force` over a key file others could read leaves the new key readable by its owner
/// only, as its help says (the existing file kept its mode).
#[test]
fn certs_force_leaves_keys_readable_by_their_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    common::make_certs(dir.path(), &["--node", "node-1"]);
    let key = dir.path().join("node-1.key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    common::make_certs(dir.path(), &["--node", "node-1", "--force"]);
    let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{mode:o}");
}

/// `certs --san` takes IP addresses and DNS names only: a space-separated list, an empty name
/// (a trailing comma) or a name with an underscore stop it, naming the value. They went into the
/// certificates as they were (`DNS:10.0.0.1 10.0.0.2`, an empty `DNS:`), and TLS failed later.
#[test]
fn certs_refuses_a_san_that_is_no_name() {
    let certs_with_san = |san: &str| {
        let dir = tempfile::tempdir().unwrap();
        run(&[
            "certs",
            "--out",
            dir.path().to_str().unwrap(),
            "--node",
            "n1",
            "--san",
            san,
        ])
    };
    for bad in ["10.0.0.1 10.0.0.2", "10.0.0.1,", "bad_name.example", "x-.example"] {
        let out = certs_with_san(bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad:?} was taken: {err}");
        assert!(err.contains("neither an IP address nor a DNS name"), "{bad:?}: {err}");
    }
    let out = certs_with_san("10.0.0.1,node-1.example.net,*.tokenlog.svc,::1");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A holder name that is no DNS name (`ops_team`) is refused before anything is written, with
/// a message about holder names. Before, the name check let '_' through: the CA and the holders
/// before it were written, then it failed with the message for a bad `--san`.
#[test]
fn certs_refuses_a_holder_name_that_is_no_dns_name_before_writing_anything() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(&[
        "certs",
        "--out",
        dir.path().to_str().unwrap(),
        "--node",
        "node-1",
        "--admin",
        "ops_team",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot name a certificate holder"), "{err}");
    assert!(!dir.path().join("ca.pem").exists(), "the CA was written");
}

/// `keys hash` refuses a key that no client could send (not visible ASCII: it travels in a
/// header); it printed a keys-file line for it, and the gateway then read the header as no key.
#[test]
fn keys_hash_refuses_a_key_no_header_can_carry() {
    use std::io::Write;
    for (key, ok) in [("clé", false), ("two words", false), ("tlk_0123abc", true)] {
        let mut child = Command::new(bin())
            .args(["keys", "hash", "--tenant", "t"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        writeln!(child.stdin.take().unwrap(), "{key}").unwrap();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), ok, "{key:?}: {err}");
        if !ok {
            assert!(err.contains("visible ASCII"), "{key:?}: {err}");
        }
    }
}

/// A `RUST_LOG` that is not a filter is reported (it was dropped whole, without a word, and the
/// process logged at the default level as if asked to).
#[test]
fn a_bad_log_filter_is_reported() {
    let out = Command::new(bin())
        .args(["verify", "--data-dir", "/nonexistent/tokenlog"])
        .env("RUST_LOG", "debug,openraft=wrn")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not a log filter"), "{err}");
}

/// A closed standard output (a pipe whose reader is gone: `tokenlog dev | head -1`) loses the
/// lines, not the process. `println!` panicked there and the panic aborts the process: a
/// command died with SIGABRT, and a gateway or `dev` that printed its addresses to such a pipe
/// died at start. Now a command that is run for its output ends with an error that says the
/// output was lost, and a server goes on serving.
#[test]
fn a_closed_stdout_is_an_error_for_a_command_and_costs_a_server_nothing() {
    use std::process::Stdio;
    let closed = || {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        writer
    };
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().display().to_string();
    for args in [
        &["keys", "new", "--tenant", "t"][..],
        &["certs", "--out", &out_dir, "--node", "node-1"][..],
    ] {
        let out = Command::new(bin())
            .args(args)
            .stdout(closed())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {:?} {err}", out.status);
        assert!(err.contains("standard output was closed"), "{args:?}: {err}");
    }
    let http = common::free_port();
    let mut gateway = Command::new(bin())
        .args(["gateway", "--cluster", "127.0.0.1:9"])
        .args(["--grpc-listen", &format!("127.0.0.1:{}", common::free_port())])
        .args(["--http-listen", &format!("127.0.0.1:{http}")])
        .stdout(closed())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", http)).is_err() {
        assert!(
            gateway.try_wait().unwrap().is_none(),
            "the gateway exited: {:?}",
            gateway.wait()
        );
        assert!(std::time::Instant::now() < deadline, "the gateway never listened");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // It printed its addresses after it bound them.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let alive = gateway.try_wait().unwrap();
    common::signal_pid(gateway.id(), "TERM");
    let status = gateway.wait().unwrap();
    assert!(alive.is_none(), "the gateway died with a closed stdout: {alive:?}");
    assert!(status.success(), "{status:?}");
}

/// A gateway whose port is taken says which listener, on which address, and by which flag.
/// Before: "binding the gateway's listeners: Address already in use", naming neither.
#[test]
fn a_gateway_whose_port_is_taken_names_the_flag_and_the_address() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap().to_string();
    let (code, err) = refused(&[
        "gateway",
        "--cluster",
        "127.0.0.1:1",
        "--grpc-listen",
        "127.0.0.1:0",
        "--http-listen",
        &addr,
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("the HTTP listener on {addr}")) && err.contains("--http-listen"),
        "{err}"
    );
}

/// Without `--model`, a decoder takes the default model from `./models` of its working
/// directory, as its help says. Before, it looked in the source tree the binary was built from
/// (a path fixed at compile time), wherever it ran.
#[test]
fn a_decoder_without_a_model_takes_the_default_from_its_working_directory() {
    use std::io::BufRead;
    let real = tokenlog_decoder::fetch::ensure_default_model(&tokenlog_decoder::fetch::repo_models_dir()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("models")).unwrap();
    let here = dir.path().join("models").join(real.file_name().unwrap());
    std::os::unix::fs::symlink(&real, &here).unwrap();
    let mut child = Command::new(bin())
        .args(["decoder", "--cluster", "127.0.0.1:1"])
        .current_dir(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.map_while(Result::ok).take(40) {
        let done = line.starts_with("loading ");
        seen.push(line);
        if done {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let loading = seen
        .iter()
        .find(|l| l.starts_with("loading "))
        .cloned()
        .unwrap_or_default();
    let expect = format!("loading models/{} on cpu", real.file_name().unwrap().to_str().unwrap());
    assert!(loading.starts_with(&expect), "{seen:#?}");
}
