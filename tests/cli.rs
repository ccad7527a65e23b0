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
        (&["generate", "--request-id", "r", "--after", "5", "hi"][..], "--resume"),
        (&["generate", "--resume", "--request-id", "r", "hi"][..], "--resume"),
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
