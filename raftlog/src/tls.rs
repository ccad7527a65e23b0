//! TLS material of one process of the cluster (a CA, its own certificate and key) and the roles
//! certificates carry.
//!
//! Every certificate `tokenlog certs` makes names its holder's role in the subject's
//! organizational unit (`OU=node`, `OU=decoder`, `OU=gateway`, `OU=admin`) and its name in the
//! common name. Log nodes accept only certificates signed by the cluster's CA; what a client may
//! call then depends on its role ([`crate::auth`]). A node's certificate also carries the DNS
//! name [`NODE_SERVER_NAME`]: clients and peers verify that name, not the address they dialled, so
//! a node may be reached by IP address, service name or load balancer alike.

use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::limits::TLS_HANDSHAKE_TIMEOUT;

/// The DNS name every log node's certificate carries and every client of a node verifies.
pub const NODE_SERVER_NAME: &str = "tokenlog-node";
/// The name every decoder certificate carries for its handoff listener (decoders dial each
/// other by address and verify this name).
pub const DECODER_SERVER_NAME: &str = "tokenlog-decoder";

/// Who a certificate belongs to; decides which calls it may make ([`crate::auth`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A log node: Raft traffic between nodes (`raft.v1`).
    Node,
    /// A decoder: registers, takes work, owns generations and appends their tokens.
    Decoder,
    /// A gateway: submits, reads, watches and cancels generations for clients.
    Gateway,
    /// An operator: membership, verification, status.
    Admin,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Node, Role::Decoder, Role::Gateway, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Node => "node",
            Role::Decoder => "decoder",
            Role::Gateway => "gateway",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Bad { path: PathBuf, what: String },
    #[error("{0}")]
    Config(String),
}

/// What a certificate says about its holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub role: Role,
    /// The certificate's common name.
    pub name: String,
}

/// What ends the name of a pool's certificate (`tokenlog certs --decoder-pool NAME` makes
/// `NAME-*`): every holder of it may act under any id that starts with `NAME-`.
pub const POOL_SUFFIX: &str = "-*";

impl Holder {
    /// Whether this holder may act as the decoder (or stage) `id`: a decoder certificate names
    /// the one id its holder uses, or, for a pool (a name ending in [`POOL_SUFFIX`], for
    /// decoders that share one certificate and take their ids from their pods), every id that
    /// starts with the name before the `*` and has more after it. Holders of other roles act
    /// as no decoder.
    pub fn may_act_as(&self, id: &str) -> bool {
        if self.role != Role::Decoder || id.is_empty() {
            return false;
        }
        match self.name.strip_suffix('*') {
            Some(prefix) if self.name.ends_with(POOL_SUFFIX) => id.len() > prefix.len() && id.starts_with(prefix),
            _ => self.name == id,
        }
    }

    /// An id this holder may act as: its name, or, for a pool, the pool's prefix and `suffix`.
    pub fn id_with(&self, suffix: &str) -> String {
        match self.name.strip_suffix('*') {
            Some(prefix) if self.name.ends_with(POOL_SUFFIX) => format!("{prefix}{suffix}"),
            _ => self.name.clone(),
        }
    }
}

/// Reads role and name out of a DER certificate (already verified by the TLS handshake).
pub fn holder_of(der: &[u8]) -> Result<Holder, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| format!("not an X.509 certificate: {e}"))?;
    let subject = cert.subject();
    let ou = subject
        .iter_organizational_unit()
        .next()
        .ok_or("the certificate names no role (no OU in its subject)")?
        .as_str()
        .map_err(|e| format!("the certificate's OU does not read: {e}"))?;
    let role = Role::parse(ou)
        .ok_or_else(|| format!("the certificate's role {ou:?} is none of node, decoder, gateway, admin"))?;
    let name = subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .unwrap_or("")
        .to_string();
    Ok(Holder { role, name })
}

/// Where a process finds its TLS material.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A process's TLS material, read and checked: the CA every peer must be signed by, this
/// process's certificate chain and key, and what its certificate says about it.
#[derive(Clone)]
pub struct Tls {
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    pub holder: Holder,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("holder", &self.holder)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn certs_of(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Bad {
            path: path.to_path_buf(),
            what: format!("not PEM certificates: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Bad {
            path: path.to_path_buf(),
            what: "holds no certificate".into(),
        });
    }
    Ok(certs)
}

impl Tls {
    /// Reads the three files and checks them: each parses, the certificate carries the CA's
    /// signature, is valid now and names a role. Errors name the file.
    pub fn load(files: &TlsFiles) -> Result<Tls, TlsError> {
        let ca_pem = read(&files.ca)?;
        let cert_pem = read(&files.cert)?;
        let key_pem = read(&files.key)?;
        let cas = certs_of(&files.ca, &ca_pem)?;
        let chain = certs_of(&files.cert, &cert_pem)?;
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Bad {
            path: files.key.clone(),
            what: format!("not a PEM private key: {e}"),
        })?;
        let bad_cert = |what: String| TlsError::Bad {
            path: files.cert.clone(),
            what,
        };
        let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0])
            .map_err(|e| bad_cert(format!("not an X.509 certificate: {e}")))?;
        if !leaf.validity().is_valid() {
            return Err(bad_cert(format!(
                "not valid now (valid from {} to {})",
                leaf.validity().not_before,
                leaf.validity().not_after
            )));
        }
        // The CA's signature on the certificate, not just a matching issuer name: two clusters'
        // CAs may well share a name.
        let issued_by_ca = cas.iter().any(|ca| {
            x509_parser::parse_x509_certificate(ca)
                .map(|(_, ca)| {
                    ca.subject().as_raw() == leaf.issuer().as_raw()
                        && leaf.verify_signature(Some(ca.public_key())).is_ok()
                })
                .unwrap_or(false)
        });
        if !issued_by_ca {
            return Err(bad_cert(format!(
                "was not issued by the CA in {} (issuer {})",
                files.ca.display(),
                leaf.issuer()
            )));
        }
        let holder = holder_of(&chain[0]).map_err(bad_cert)?;
        Ok(Tls {
            ca_pem,
            cert_pem,
            key_pem,
            holder,
        })
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(&self.cert_pem, &self.key_pem)
    }

    /// For a node's listeners: this node's certificate; a client certificate, when one is
    /// presented, must be signed by the CA. A client without one still completes the handshake
    /// so that it can be told UNAUTHENTICATED ([`crate::auth`]) instead of a reset connection.
    pub fn server_config(&self) -> Result<ServerTlsConfig, TlsError> {
        if self.holder.role != Role::Node {
            return Err(TlsError::Config(format!(
                "a log node needs a certificate of role node; this one is of role {} ({})",
                self.holder.role, self.holder.name
            )));
        }
        Ok(self.listener_config())
    }

    /// For a decoder's handoff listener: the decoder's certificate (it carries
    /// [`DECODER_SERVER_NAME`]); callers' certificates checked as on a node.
    pub fn decoder_server_config(&self) -> Result<ServerTlsConfig, TlsError> {
        if self.holder.role != Role::Decoder {
            return Err(TlsError::Config(format!(
                "a handoff listener needs a certificate of role decoder; this one is of role {} ({})",
                self.holder.role, self.holder.name
            )));
        }
        Ok(self.listener_config())
    }

    fn listener_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(Certificate::from_pem(&self.ca_pem))
            .client_auth_optional(true)
            .timeout(TLS_HANDSHAKE_TIMEOUT)
    }

    /// For connections to log nodes: verify the node's certificate (CA and
    /// [`NODE_SERVER_NAME`]) and present ours.
    pub fn client_config(&self) -> ClientTlsConfig {
        self.client_config_for(NODE_SERVER_NAME)
    }

    /// For connections to a server whose certificate carries `server_name` (a decoder's
    /// handoff listener: [`DECODER_SERVER_NAME`]), presenting ours.
    pub fn client_config_for(&self, server_name: &str) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(self.identity())
            .domain_name(server_name)
    }
}

/// How a process talks to log nodes: plain text (`None`) or TLS.
pub type ClientTls = Option<std::sync::Arc<Tls>>;

/// The URL scheme for a node address under `tls`.
pub fn scheme(tls: &ClientTls) -> &'static str {
    if tls.is_some() {
        "https"
    } else {
        "http"
    }
}

/// A server certificate for a public listener (a gateway's gRPC and HTTP ports): the certificate
/// chain and key clients of the service see; no client certificates (clients authenticate with
/// API keys). Any CA will do: a public one, or the cluster's (`tokenlog certs --san HOST`).
#[derive(Clone)]
pub struct ServingCert {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    chain: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for ServingCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingCert").finish_non_exhaustive()
    }
}

impl ServingCert {
    /// Reads and checks the chain and the key; errors name the file.
    pub fn load(cert: &Path, key: &Path) -> Result<ServingCert, TlsError> {
        let cert_pem = read(cert)?;
        let key_pem = read(key)?;
        let chain = certs_of(cert, &cert_pem)?;
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Bad {
            path: key.to_path_buf(),
            what: format!("not a PEM private key: {e}"),
        })?;
        let served = ServingCert {
            cert_pem,
            key_pem,
            chain,
        };
        // A key that does not belong to the certificate fails here, not at the first client.
        served.rustls_config().map_err(|e| TlsError::Bad {
            path: key.to_path_buf(),
            what: format!("does not go with {}: {e}", cert.display()),
        })?;
        Ok(served)
    }

    /// For a tonic server.
    pub fn tonic_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .timeout(TLS_HANDSHAKE_TIMEOUT)
    }

    /// For any other server (the HTTP API): rustls with the ring provider, ALPN h2 and http/1.1.
    pub fn rustls_config(&self) -> Result<std::sync::Arc<tokio_rustls::rustls::ServerConfig>, TlsError> {
        use tokio_rustls::rustls;
        let key = PrivateKeyDer::from_pem_slice(&self.key_pem).map_err(|e| TlsError::Config(e.to_string()))?;
        let mut config =
            rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| TlsError::Config(e.to_string()))?
                .with_no_client_auth()
                .with_single_cert(self.chain.clone(), key)
                .map_err(|e| TlsError::Config(e.to_string()))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(std::sync::Arc::new(config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(role: Role, name: &str) -> Holder {
        Holder {
            role,
            name: name.into(),
        }
    }

    #[test]
    fn a_decoder_certificate_acts_as_its_own_id_and_a_pools_as_its_prefix() {
        let d1 = holder(Role::Decoder, "decoder-1");
        assert!(d1.may_act_as("decoder-1"));
        for other in ["decoder-2", "decoder-10", "decoder-1-x", "decoder-", "", "DECODER-1"] {
            assert!(!d1.may_act_as(other), "{other}");
        }
        let pool = holder(Role::Decoder, "tokenlog-decoder-*");
        for id in ["tokenlog-decoder-7c9f-x2", "tokenlog-decoder-a"] {
            assert!(pool.may_act_as(id), "{id}");
        }
        for id in [
            "tokenlog-decoder-",
            "tokenlog-decoder",
            "tokenlog-gateway-1",
            "x-tokenlog-decoder-1",
            "",
        ] {
            assert!(!pool.may_act_as(id), "{id}");
        }
        assert_eq!(pool.id_with("h-1"), "tokenlog-decoder-h-1");
        assert_eq!(d1.id_with("h-1"), "decoder-1");
        // A `*` not after a '-' is no pool: the name is taken as it is.
        let star = holder(Role::Decoder, "decoder*");
        assert!(star.may_act_as("decoder*") && !star.may_act_as("decoder1"));
        // Only decoders act as decoders.
        for role in [Role::Gateway, Role::Admin, Role::Node] {
            assert!(!holder(role, "decoder-1").may_act_as("decoder-1"));
        }
    }
}
