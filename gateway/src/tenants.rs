//! API keys and tenants. A key maps to a tenant; every request id lives inside its tenant, so one
//! tenant can neither read, resume, nor cancel another's request (CONTRACT §1).
//!
//! The keys file has one `sha256:<hex of the key's SHA-256> <tenant>` pair per line; `#` starts a
//! comment. It holds hashes, never keys (`tokenlog keys new --tenant T` makes a key and its line):
//! a copy of the file lets nobody in. A presented key is hashed and compared with every listed
//! hash in constant time. Without a keys file the gateway is open and every caller is the tenant
//! [`OPEN_TENANT`] (the `tokenlog dev` default, on localhost).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::error::{GatewayError, Result};

/// The tenant of every caller when no keys file is configured.
pub const OPEN_TENANT: &str = "default";

/// Why a keys file was refused.
#[derive(Debug, thiserror::Error)]
pub enum KeysFileError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("line {line}: {problem}")]
    Line { line: usize, problem: &'static str },
    #[error("the keys file lists no key")]
    Empty,
    #[error("{path}: {source}")]
    In {
        path: String,
        #[source]
        source: Box<KeysFileError>,
    },
}

#[derive(Clone, Debug)]
pub enum Tenants {
    Open,
    /// `(SHA-256 of a key, its tenant)`.
    Keys(Vec<([u8; 32], String)>),
}

/// The SHA-256 of an API key.
pub fn key_hash(key: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes()).into()
}

/// The keys-file line of `key` for `tenant`.
pub fn keys_file_line(key: &str, tenant: &str) -> String {
    let hex: String = key_hash(key).iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex} {tenant}")
}

/// Equal without an early exit: the time taken does not depend on where two hashes differ.
fn same_hash(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn parse_hash(s: &str) -> Option<[u8; 32]> {
    let hex = s.strip_prefix("sha256:")?;
    if hex.len() != 64 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl Tenants {
    pub fn load(path: &Path) -> Result<Tenants, KeysFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeysFileError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text).map_err(|e| KeysFileError::In {
            path: path.display().to_string(),
            source: Box::new(e),
        })
    }

    pub fn parse(text: &str) -> Result<Tenants, KeysFileError> {
        let bad = |n: usize, problem| KeysFileError::Line { line: n + 1, problem };
        let mut keys: Vec<([u8; 32], String)> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(hash), Some(tenant), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad(n, "expected `sha256:<hex> <tenant>`"));
            };
            let Some(hash) = parse_hash(hash) else {
                return Err(bad(
                    n,
                    "expected `sha256:<64 hex digits> <tenant>`: the file holds key hashes, not keys \
                     (`tokenlog keys new --tenant NAME` makes a key and its line)",
                ));
            };
            if tenant.len() > tokenlog_raftlog::limits::TENANT_BYTES_MAX {
                return Err(bad(n, "tenant name longer than the limit"));
            }
            if keys.iter().any(|(h, _)| *h == hash) {
                return Err(bad(n, "key listed twice"));
            }
            keys.push((hash, tenant.to_string()));
        }
        if keys.is_empty() {
            return Err(KeysFileError::Empty);
        }
        Ok(Tenants::Keys(keys))
    }

    /// The tenant of a caller from its `authorization` and `x-api-key` headers (each absent, or
    /// its text: `Err` when it is not visible ASCII, which no API key is; refused by name where
    /// keys are checked).
    pub fn tenant_of(
        &self,
        authorization: Option<Result<&str, ()>>,
        x_api_key: Option<Result<&str, ()>>,
    ) -> Result<String> {
        if let Tenants::Open = self {
            return Ok(OPEN_TENANT.to_string());
        }
        let auth = header_text("authorization", authorization)?;
        let xkey = header_text("x-api-key", x_api_key)?;
        self.tenant(key_from_headers(auth, xkey))
    }

    /// The tenant of a caller that presented `key` (the bearer token or `x-api-key`).
    pub fn tenant(&self, key: Option<&str>) -> Result<String> {
        match self {
            Tenants::Open => Ok(OPEN_TENANT.to_string()),
            Tenants::Keys(keys) => {
                let key = key.ok_or_else(|| {
                    GatewayError::Unauthenticated("missing API key: send `authorization: Bearer <key>`".into())
                })?;
                let presented = key_hash(key);
                // Every listed hash is compared, in constant time, whichever matches.
                let mut found = None;
                for (hash, tenant) in keys {
                    if same_hash(hash, &presented) {
                        found = Some(tenant);
                    }
                }
                found
                    .cloned()
                    .ok_or_else(|| GatewayError::Unauthenticated("unknown API key".into()))
            }
        }
    }
}

/// What one tenant may hold at once in one gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TenantLimits {
    /// Streams open (gRPC Generate/Resume, SSE, and the waits of non-streaming HTTP calls).
    pub streams: usize,
    /// Submits waiting for the log's answer.
    pub submits: usize,
}

impl Default for TenantLimits {
    fn default() -> Self {
        TenantLimits {
            streams: crate::limits::TENANT_STREAMS_MAX_DEFAULT,
            submits: crate::limits::TENANT_SUBMITS_MAX_DEFAULT,
        }
    }
}

/// What a tenant holds: see [`TenantLimits`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    Stream,
    Submit,
}

/// Streams and submits each tenant holds now. A slot is a [`TenantSlot`], given back when it
/// drops, so every exit path (client gone, error, end) returns it.
#[derive(Clone, Debug, Default)]
pub struct TenantUse {
    held: Arc<Mutex<HashMap<String, [usize; 2]>>>,
}

impl TenantUse {
    /// Takes a `what` slot for `tenant`, or refuses (`Overloaded`) at `max`.
    pub fn take(&self, tenant: &str, what: Held, max: usize) -> Result<TenantSlot> {
        let mut held = self.held.lock().expect("lock");
        room(&held, tenant, what, max)?;
        held.entry(tenant.to_string()).or_default()[what as usize] += 1;
        Ok(TenantSlot {
            held: self.held.clone(),
            tenant: tenant.to_string(),
            what,
        })
    }

    /// Refuses as [`TenantUse::take`] would at `max`, without taking a slot.
    pub fn check(&self, tenant: &str, what: Held, max: usize) -> Result<()> {
        room(&self.held.lock().expect("lock"), tenant, what, max)
    }

    /// What `tenant` holds now (streams, submits).
    #[cfg(test)]
    fn of(&self, tenant: &str) -> (usize, usize) {
        let held = self.held.lock().expect("lock");
        held.get(tenant).map_or((0, 0), |n| (n[0], n[1]))
    }
}

/// `Overloaded` when `tenant` holds `max` of `what`.
fn room(held: &HashMap<String, [usize; 2]>, tenant: &str, what: Held, max: usize) -> Result<()> {
    if held.get(tenant).map_or(0, |n| n[what as usize]) < max {
        return Ok(());
    }
    let noun = match what {
        Held::Stream => "streams open",
        Held::Submit => "submits in progress",
    };
    Err(GatewayError::Overloaded(format!(
        "tenant {tenant:?} has {max} {noun} on this gateway (its limit); retry when one ends"
    )))
}

/// One stream or submit of a tenant; dropping it gives the slot back.
#[derive(Debug)]
pub struct TenantSlot {
    held: Arc<Mutex<HashMap<String, [usize; 2]>>>,
    tenant: String,
    what: Held,
}

impl Drop for TenantSlot {
    fn drop(&mut self) {
        let mut held = self.held.lock().expect("lock");
        if let Some(n) = held.get_mut(&self.tenant) {
            n[self.what as usize] -= 1;
            if n.iter().all(|&c| c == 0) {
                held.remove(&self.tenant);
            }
        }
    }
}

/// The key in an `authorization: Bearer <key>` or `x-api-key: <key>` header value pair. The
/// scheme is matched in any case (RFC 9110: `BEARER k` is `Bearer k`); an empty bearer leaves
/// the word to `x-api-key`.
pub fn key_from_headers<'a>(authorization: Option<&'a str>, x_api_key: Option<&'a str>) -> Option<&'a str> {
    let bearer = authorization.and_then(|v| {
        let (scheme, rest) = v.trim_start().split_once([' ', '\t'])?;
        scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
    });
    bearer
        .filter(|k| !k.is_empty())
        .or(x_api_key.map(str::trim))
        .filter(|k| !k.is_empty())
}

/// A credential header's text; one that is not visible ASCII (as every API key is) is refused by
/// name instead of read as no key at all ("missing API key").
fn header_text<'a>(name: &str, value: Option<Result<&'a str, ()>>) -> Result<Option<&'a str>, GatewayError> {
    match value {
        None => Ok(None),
        Some(Ok(v)) => Ok(Some(v)),
        Some(Err(())) => Err(GatewayError::Unauthenticated(format!(
            "the {name} header is not visible ASCII: API keys are (`tokenlog keys new` makes them)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_tenants_and_unknown_keys_are_refused() {
        let text = format!(
            "# keys\n{}\n{} # second\n\n",
            keys_file_line("k-a", "alice"),
            keys_file_line("k-b", "bob")
        );
        let t = Tenants::parse(&text).unwrap();
        assert_eq!(t.tenant(Some("k-a")).unwrap(), "alice");
        assert_eq!(t.tenant(Some("k-b")).unwrap(), "bob");
        assert!(matches!(t.tenant(Some("nope")), Err(GatewayError::Unauthenticated(_))));
        assert!(matches!(t.tenant(None), Err(GatewayError::Unauthenticated(_))));
        assert_eq!(Tenants::Open.tenant(None).unwrap(), OPEN_TENANT);
        // From the headers: the bearer in any case, x-api-key behind an empty bearer, and a
        // header that is not ASCII refused by name (it read as no key: "missing API key").
        assert_eq!(t.tenant_of(Some(Ok("BEARER k-a")), None).unwrap(), "alice");
        assert_eq!(t.tenant_of(Some(Ok("Bearer ")), Some(Ok("k-b"))).unwrap(), "bob");
        let e = t.tenant_of(Some(Err(())), None).unwrap_err().to_string();
        assert!(e.contains("authorization header is not visible ASCII"), "{e}");
        assert_eq!(Tenants::Open.tenant_of(Some(Err(())), None).unwrap(), OPEN_TENANT);
    }

    #[test]
    fn malformed_keys_files_are_rejected() {
        assert!(Tenants::parse("justakey\n").is_err());
        assert!(Tenants::parse("a b c\n").is_err());
        let k = keys_file_line("k", "x");
        assert!(Tenants::parse(&format!("{k}\n{k}\n")).is_err(), "a key twice");
        assert!(Tenants::parse("# nothing\n").is_err());
        // A plain key where a hash belongs is refused, saying how to make the line.
        let e = Tenants::parse("key-alice alice\n").unwrap_err().to_string();
        assert!(e.contains("tokenlog keys new"), "{e}");
        assert!(Tenants::parse(&format!("sha256:{} a\n", "0".repeat(63))).is_err());
        assert!(Tenants::parse(&format!("sha256:{} a\n", "g".repeat(64))).is_err());
    }

    #[test]
    fn tenant_slots_are_bounded_per_tenant_and_given_back_on_drop() {
        let u = TenantUse::default();
        let a1 = u.take("a", Held::Stream, 2).unwrap();
        let _a2 = u.take("a", Held::Stream, 2).unwrap();
        let refused = u.take("a", Held::Stream, 2).unwrap_err();
        assert!(matches!(refused, GatewayError::Overloaded(ref m) if m.contains("\"a\" has 2 streams open")));
        let _b = u.take("b", Held::Stream, 2).unwrap();
        let _s = u.take("a", Held::Submit, 1).unwrap();
        assert!(u.take("a", Held::Submit, 1).is_err());
        assert_eq!(u.of("a"), (2, 1));
        drop(a1);
        assert_eq!(u.of("a"), (1, 1));
        let _a3 = u.take("a", Held::Stream, 2).unwrap();
        drop((_a2, _a3, _s));
        assert_eq!(u.of("a"), (0, 0));
        assert!(
            u.held.lock().unwrap().get("a").is_none(),
            "no entry left for an idle tenant"
        );
    }

    #[test]
    fn bearer_and_x_api_key() {
        assert_eq!(key_from_headers(Some("Bearer abc"), None), Some("abc"));
        assert_eq!(key_from_headers(None, Some("xyz")), Some("xyz"));
        assert_eq!(key_from_headers(Some("Basic zzz"), Some("xyz")), Some("xyz"));
        assert_eq!(key_from_headers(Some("Bearer "), None), None);
        // The scheme in any case; an empty bearer does not hide x-api-key.
        assert_eq!(key_from_headers(Some("BEARER abc"), None), Some("abc"));
        assert_eq!(key_from_headers(Some("bEaReR\tabc "), None), Some("abc"));
        assert_eq!(key_from_headers(Some("Bearer "), Some("xyz")), Some("xyz"));
        assert_eq!(key_from_headers(Some("Bearerabc"), None), None);
        assert!(matches!(
            header_text("authorization", Some(Err(()))),
            Err(GatewayError::Unauthenticated(m)) if m.contains("not visible ASCII")
        ));
    }
}
