//! The unmodified `openai` Python package (from PyPI, in a venv this test makes once under
//! /var/tmp) against `tokenlog dev` with the real SmolLM2 model: a streamed chat completion, and a
//! background response that is dropped mid-stream and resumed with `starting_after` without
//! duplicates or gaps (see py/openai_client.py).

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};

use common::{bin, free_port, serial, wait_for_port};

/// The pinned client version the test installs.
const OPENAI_PIP: &str = "openai==3.57.0";

fn venv_python() -> PathBuf {
    let venv = PathBuf::from(std::env::var("TOKENLOG_TEST_VENV").unwrap_or_else(|_| "/var/tmp/tokenlog-venv".into()));
    let py = venv.join("bin/python");
    let ok = py.exists()
        && Command::new(&py)
            .args([
                "-c",
                "import openai, sys; sys.exit(0 if openai.__version__ == '3.57.0' else 1)",
            ])
            .status()
            .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("making a venv with {OPENAI_PIP} in {} ...", venv.display());
        let s = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("python3 -m venv");
        assert!(
            s.success(),
            "python3 -m venv failed (Debian: apt-get install python3-venv)"
        );
        let s = Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", OPENAI_PIP])
            .status()
            .expect("pip");
        assert!(s.success(), "pip install {OPENAI_PIP} failed");
    }
    py
}

#[test]
fn openai_python_package_streams_and_resumes_against_tokenlog_dev() {
    let _g = serial();
    let py = venv_python();
    let model_dir = tokenlog_decoder::fetch::repo_models_dir();
    tokenlog_decoder::fetch::ensure_default_model(&model_dir).expect("default model");
    let dir = tempfile::tempdir().unwrap();
    let (log, grpc, http) = (free_port(), free_port(), free_port());
    let mut dev = Command::new(bin())
        .args([
            "dev",
            "--data-dir",
            dir.path().join("data").to_str().unwrap(),
            "--listen",
            &format!("127.0.0.1:{log}"),
            "--grpc-listen",
            &format!("127.0.0.1:{grpc}"),
            "--http-listen",
            &format!("127.0.0.1:{http}"),
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("dev.log")).unwrap())
        .spawn()
        .unwrap();
    wait_for_port(&format!("127.0.0.1:{http}"));
    let out = Command::new(&py)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/openai_client.py"))
        .arg(format!("http://127.0.0.1:{http}/v1"))
        .arg("smollm2-135m-instruct")
        .output()
        .unwrap();
    let _ = Command::new("kill").args(["-INT", &dev.id().to_string()]).status();
    let stopped = dev.wait().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}\n{stderr}");
    let devlog = std::fs::read_to_string(dir.path().join("dev.log")).unwrap_or_default();
    assert!(
        out.status.success() && stdout.contains("OPENAI-CLIENT-OK"),
        "python client failed\n--- dev log tail ---\n{}",
        devlog
            .lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(stopped.success(), "tokenlog dev exits cleanly on SIGINT: {stopped:?}");
}
