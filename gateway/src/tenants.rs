//! API keys and tenants. A key maps to a tenant; every request id lives inside its tenant, so one
//! tenant can neither read, resume, nor cancel another's request (CONTRACT §1).
//!
//! The keys file has one `<api-key> <tenant>` pair per line; `#` starts a comment. Without a keys
//! file the gateway is open and every caller is the tenant [`OPEN_TENANT`] (the `tokenlog dev`
//! default, on localhost).

use std::collections::HashMap;
use std::path::Path;

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
    Keys(HashMap<String, String>),
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
        let mut keys = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(key), Some(tenant), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad(n, "expected `<api-key> <tenant>`"));
            };
            if tenant.len() > tokenlog_raftlog::limits::TENANT_BYTES_MAX {
                return Err(bad(n, "tenant name longer than the limit"));
            }
            if keys.insert(key.to_string(), tenant.to_string()).is_some() {
                return Err(bad(n, "key listed twice"));
            }
        }
        if keys.is_empty() {
            return Err(KeysFileError::Empty);
        }
        Ok(Tenants::Keys(keys))
    }

    /// The tenant of a caller that presented `key` (the bearer token or `x-api-key`).
    pub fn tenant(&self, key: Option<&str>) -> Result<String> {
        match self {
            Tenants::Open => Ok(OPEN_TENANT.to_string()),
            Tenants::Keys(keys) => {
                let key = key.ok_or_else(|| {
                    GatewayError::Unauthenticated("missing API key: send `authorization: Bearer <key>`".into())
                })?;
                keys.get(key)
                    .cloned()
                    .ok_or_else(|| GatewayError::Unauthenticated("unknown API key".into()))
            }
        }
    }
}

/// The key in an `authorization: Bearer <key>` or `x-api-key: <key>` header value pair.
pub fn key_from_headers<'a>(authorization: Option<&'a str>, x_api_key: Option<&'a str>) -> Option<&'a str> {
    authorization
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
        .or(x_api_key.map(str::trim))
        .filter(|k| !k.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_tenants_and_unknown_keys_are_refused() {
        let t = Tenants::parse("# keys\nk-a alice\nk-b bob # second\n\n").unwrap();
        assert_eq!(t.tenant(Some("k-a")).unwrap(), "alice");
        assert_eq!(t.tenant(Some("k-b")).unwrap(), "bob");
        assert!(matches!(t.tenant(Some("nope")), Err(GatewayError::Unauthenticated(_))));
        assert!(matches!(t.tenant(None), Err(GatewayError::Unauthenticated(_))));
        assert_eq!(Tenants::Open.tenant(None).unwrap(), OPEN_TENANT);
    }

    #[test]
    fn malformed_keys_files_are_rejected() {
        assert!(Tenants::parse("justakey\n").is_err());
        assert!(Tenants::parse("a b c\n").is_err());
        assert!(Tenants::parse("k x\nk y\n").is_err());
        assert!(Tenants::parse("# nothing\n").is_err());
    }

    #[test]
    fn bearer_and_x_api_key() {
        assert_eq!(key_from_headers(Some("Bearer abc"), None), Some("abc"));
        assert_eq!(key_from_headers(None, Some("xyz")), Some("xyz"));
        assert_eq!(key_from_headers(Some("Basic zzz"), Some("xyz")), Some("xyz"));
        assert_eq!(key_from_headers(Some("Bearer "), None), None);
    }
}
