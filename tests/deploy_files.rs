//! The deployment files that no test here can start (Kubernetes, systemd) are checked offline
//! against the binary these tests built: `deploy/k8s/check.sh` (kustomize, schema validation,
//! flags, peers, certificates, network policy) and `deploy/systemd/check.sh` (systemd-analyze
//! verify and security, flags, environment files).

mod common;

use std::process::Command;

fn check(script: &str) {
    let out = Command::new(format!("{}/{script}", env!("CARGO_MANIFEST_DIR")))
        .arg(common::bin())
        .output()
        .unwrap_or_else(|e| panic!("running {script}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script} failed:\n{text}");
    eprintln!("{text}");
}

#[test]
fn kubernetes_manifests_render_and_validate_for_every_overlay() {
    check("deploy/k8s/check.sh");
}

#[test]
fn systemd_units_verify_and_are_hardened() {
    check("deploy/systemd/check.sh");
}
