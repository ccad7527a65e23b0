//! The model identity a generation is bound to (CONTRACT §1): the log's
//! [`ModelIdentity`], and the digests that fill it (weights, tokenizer).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

pub use tokenlog_raftlog::types::ModelIdentity;

/// Digest of a tokenizer: sha256 of its canonical JSON serialization.
pub fn tokenizer_sha256(tokenizer: &Tokenizer) -> Result<String> {
    Ok(sha256_hex(tokenizer.canonical_json()?.as_bytes()))
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Streamed sha256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// The sidecar file that caches a file's digest: `<file>.sha256`.
pub fn sidecar_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(".sha256");
    PathBuf::from(name)
}

/// sha256 of a (large) weights file, cached in `<file>.sha256` as
/// `<sha256> size=<bytes> mtime_ns=<ns>`. The cache is used only while size and modification
/// time still match; it is rewritten otherwise. A cache that cannot be written (read-only
/// directory) is not an error: the digest is then computed at every start.
pub fn weights_sha256(path: &Path) -> Result<String> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    let mtime_ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let key = format!("size={} mtime_ns={}", meta.len(), mtime_ns);
    let sidecar = sidecar_path(path);
    if let Ok(text) = std::fs::read_to_string(&sidecar) {
        if let Some((digest, cached_key)) = text.trim().split_once(' ') {
            if cached_key == key && is_sha256_hex(digest) {
                return Ok(digest.to_string());
            }
        }
    }
    let digest = sha256_file(path)?;
    let write = || -> std::io::Result<()> {
        let tmp = sidecar_path(&sidecar); // <file>.sha256.sha256, renamed over the sidecar
        let mut f = File::create(&tmp)?;
        writeln!(f, "{digest} {key}")?;
        std::fs::rename(&tmp, &sidecar)
    };
    if let Err(e) = write() {
        tracing::debug!(path = %sidecar.display(), error = %e, "cannot cache weights digest");
    }
    Ok(digest)
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_names_the_first_mismatch() {
        let a = ModelIdentity {
            weights_sha256: "w".into(),
            tokenizer_sha256: "t".into(),
            architecture: "llama".into(),
            dtype_class: "q4_1".into(),
        };
        assert_eq!(a.refusal(1, &a, 1), None);
        let b = ModelIdentity {
            dtype_class: "q8_0".into(),
            ..a.clone()
        };
        assert_eq!(
            a.refusal(1, &b, 1).unwrap(),
            "dtype class: bound to q8_0, this decoder has q4_1"
        );
        assert!(a.refusal(1, &a, 2).unwrap().starts_with("sampler version"));
    }

    #[test]
    fn sidecar_caches_and_invalidates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.bin");
        std::fs::write(&path, b"abc").unwrap();
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(weights_sha256(&path).unwrap(), abc);
        let cached = std::fs::read_to_string(sidecar_path(&path)).unwrap();
        assert!(cached.starts_with(abc) && cached.contains("size=3"));
        // A cache entry is trusted while size and mtime match ...
        let forged = cached.replacen(abc, &"0".repeat(64), 1);
        std::fs::write(sidecar_path(&path), forged).unwrap();
        assert_eq!(weights_sha256(&path).unwrap(), "0".repeat(64));
        // ... and ignored once the file changed size.
        std::fs::write(&path, b"abcd").unwrap();
        assert_eq!(
            weights_sha256(&path).unwrap(),
            "88d4266fd4e6338d13b845fcf289579d209c897823b9217da3e161936f031589"
        );
    }
}
