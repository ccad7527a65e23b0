//! Who may call what on a log node: one table from gRPC method to the roles allowed to call it,
//! and [`Guarded`], which checks every call against it before the service sees it.
//!
//! The caller's role comes from its client certificate, verified by the TLS handshake against the
//! cluster's CA ([`crate::tls`]). No certificate: UNAUTHENTICATED. A role the method does not
//! allow, or a method the table does not know: PERMISSION_DENIED. A node started without TLS
//! (`--insecure`, loopback only by default) checks nothing.

use std::convert::Infallible;

use tonic::codegen::http;
use tonic::codegen::{BoxFuture, Context, Poll, Service};
use tonic::server::NamedService;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::Status;

use crate::tls::{holder_of, Holder, Role};

use Role::{Admin, Decoder, Gateway, Node};

/// The roles allowed to call `path` (`/package.Service/Method`); `None` for a method not in the
/// table, which nobody may call.
pub fn allowed(path: &str) -> Option<&'static [Role]> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    let roles: &'static [Role] = match (service, method) {
        // Node to node only.
        ("raft.v1.RaftTransport", "AppendEntries" | "AppendStream" | "RequestVote" | "InstallSnapshot") => &[Node],
        // A decoder's ownership protocol.
        (
            "raftlog.v1.Log",
            "Register" | "Session" | "PublishTokenizer" | "PendingWork" | "Acquire" | "Renew" | "BindPrompt" | "Append"
            | "AppendStream" | "Finish" | "Release" | "Handoff" | "Standby",
        ) => &[Decoder],
        // A pipeline head writes its composition; its stages (decoder certificates too) read it.
        ("raftlog.v1.Log", "SetPipeline") => &[Decoder],
        ("raftlog.v1.Log", "GetPipeline") => &[Decoder, Admin],
        // Stage processes run with decoder certificates; heads and operators read the list.
        ("raftlog.v1.Log", "RegisterStage") => &[Decoder],
        ("raftlog.v1.Log", "ListStages") => &[Decoder, Admin],
        // A planned handoff's cache, decoder to decoder.
        ("decoder.v1.Handoff", "Transfer" | "Rows") => &[Decoder],
        // A pipeline head drives its stages (both run with decoder certificates).
        ("decoder.v1.Stage", "Describe" | "Load" | "Forward") => &[Decoder],
        // What a gateway does for its clients.
        ("raftlog.v1.Log", "Submit" | "Cancel") => &[Gateway],
        // Models and their decoders: a gateway resolves names, a decoder finds handoff peers.
        ("raftlog.v1.Log", "ListModels") => &[Decoder, Gateway, Admin],
        // A gateway's text for a model it has no files of; a decoder checks what is published.
        ("raftlog.v1.Log", "GetTokenizer") => &[Decoder, Gateway, Admin],
        // Reads of generations: decoders resume from them, gateways stream them, operators look.
        ("raftlog.v1.Log", "Get" | "Watch") => &[Decoder, Gateway, Admin],
        ("raftlog.v1.Log", "ClusterStatus") => &[Decoder, Gateway, Admin],
        // Health checks: anyone the cluster's CA vouches for (probes without a certificate use
        // the plain-HTTP status listener, `--metrics-listen`).
        ("grpc.health.v1.Health", "Check" | "Watch") => &[Node, Decoder, Gateway, Admin],
        // Operators only: membership, full scans, digests of the state.
        ("raftlog.v1.Log", "ChangeMembership" | "Verify" | "ChainHeads" | "StateDigest") => &[Admin],
        _ => return None,
    };
    Some(roles)
}

/// The holder of the verified client certificate of this request's connection.
fn holder<B>(req: &http::Request<B>) -> Result<Holder, Status> {
    let certs = req
        .extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(|i| i.peer_certs())
        .ok_or_else(|| Status::unauthenticated("this node requires a client certificate signed by the cluster's CA"))?;
    let leaf = certs
        .first()
        .ok_or_else(|| Status::unauthenticated("this node requires a client certificate signed by the cluster's CA"))?;
    holder_of(leaf).map_err(|e| Status::permission_denied(format!("client certificate: {e}")))
}

/// Checks one request: `Ok` when its certificate's role may call its method.
pub fn authorize<B>(req: &http::Request<B>) -> Result<Holder, Status> {
    let path = req.uri().path();
    let holder = holder(req)?;
    let roles = allowed(path).ok_or_else(|| Status::permission_denied(format!("{path}: no role may call this")))?;
    if !roles.contains(&holder.role) {
        let names: Vec<&str> = roles.iter().map(|r| r.as_str()).collect();
        return Err(Status::permission_denied(format!(
            "{path} needs role {}; the certificate of {:?} has role {}",
            names.join(" or "),
            holder.name,
            holder.role
        )));
    }
    Ok(holder)
}

/// A gRPC service that only sees the calls [`authorize`] lets through (when `enforce`).
#[derive(Clone)]
pub struct Guarded<S> {
    inner: S,
    enforce: bool,
}

impl<S> Guarded<S> {
    pub fn new(inner: S, enforce: bool) -> Self {
        Guarded { inner, enforce }
    }
}

impl<S: NamedService> NamedService for Guarded<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<http::Request<B>> for Guarded<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if self.enforce {
            match authorize(&req) {
                // The service reads it to bind decoder ids to their certificate ([`acts_as`]).
                Ok(holder) => {
                    req.extensions_mut().insert(Caller(holder));
                }
                Err(status) => {
                    tracing::debug!(path = req.uri().path(), %status, "call refused");
                    return Box::pin(async move { Ok(status.into_http()) });
                }
            }
        }
        Box::pin(self.inner.call(req))
    }
}

/// The verified holder of a call's certificate, as [`Guarded`] found it.
#[derive(Clone, Debug)]
pub struct Caller(pub Holder);

/// The holder of `req`'s certificate; `None` where nothing is checked (a plain-text node).
pub fn caller<T>(req: &tonic::Request<T>) -> Option<Holder> {
    req.extensions().get::<Caller>().map(|c| c.0.clone())
}

/// `Ok` when `caller` may act as decoder `id` (see [`Holder::may_act_as`]), or nothing is
/// checked (`None`); else PERMISSION_DENIED, before anything is proposed. Which decoder owns
/// a generation, holds a session or takes a handoff is the log's record of a decoder id: a
/// decoder certificate must not speak for another decoder.
pub fn acts_as(caller: Option<&Holder>, id: &str) -> Result<(), Status> {
    match caller {
        Some(h) if !h.may_act_as(id) => Err(Status::permission_denied(format!(
            "the certificate of {:?} (role {}) may not act as decoder {id:?}: a decoder certificate names \
             the decoder id its holder uses (or, for a pool certificate NAME-*, the ids NAME-...)",
            h.name, h.role
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_of_both_services_has_roles_and_only_nodes_speak_raft() {
        let log = [
            "Submit",
            "Acquire",
            "Renew",
            "BindPrompt",
            "Append",
            "AppendStream",
            "Finish",
            "Release",
            "Cancel",
            "Register",
            "Get",
            "Watch",
            "PendingWork",
            "ListModels",
            "ClusterStatus",
            "ChangeMembership",
            "ChainHeads",
            "Verify",
            "StateDigest",
            "SetPipeline",
            "GetPipeline",
            "RegisterStage",
            "ListStages",
            "Standby",
        ];
        for m in log {
            let roles = allowed(&format!("/raftlog.v1.Log/{m}")).unwrap_or_else(|| panic!("{m} has no roles"));
            assert!(
                !roles.contains(&Node),
                "{m}: a node certificate is for Raft traffic only"
            );
        }
        for m in ["AppendEntries", "AppendStream", "RequestVote", "InstallSnapshot"] {
            assert_eq!(allowed(&format!("/raft.v1.RaftTransport/{m}")), Some(&[Node][..]));
        }
        assert_eq!(allowed("/raftlog.v1.Log/Nope"), None);
        assert_eq!(allowed("/raft.v1.RaftTransport"), None);
        assert_eq!(allowed("nonsense"), None);
        assert_eq!(allowed("/raftlog.v1.Log/Append"), Some(&[Decoder][..]));
        assert_eq!(allowed("/raftlog.v1.Log/SetPipeline"), Some(&[Decoder][..]));
        assert_eq!(allowed("/raftlog.v1.Log/Standby"), Some(&[Decoder][..]));
        assert_eq!(allowed("/raftlog.v1.Log/Submit"), Some(&[Gateway][..]));
        assert_eq!(allowed("/raftlog.v1.Log/ChangeMembership"), Some(&[Admin][..]));
        for m in ["Check", "Watch"] {
            assert_eq!(
                allowed(&format!("/grpc.health.v1.Health/{m}")).map(|r| r.len()),
                Some(4),
                "every role may ask a node's health"
            );
        }
    }
}
