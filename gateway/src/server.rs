//! Running a gateway: the gRPC service and the HTTP API on their own listeners, optionally over
//! TLS, with `grpc.health.v1` beside the gRPC service and a clean shutdown. Used by `tokenlog
//! gateway` and `tokenlog dev`.

use std::net::SocketAddr;
use std::sync::Arc;

use tokenlog_raftlog::health::Health;
use tokenlog_raftlog::limits::{KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, TLS_HANDSHAKE_TIMEOUT};
use tokenlog_raftlog::tls::ServingCert;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::core::Gateway;

/// How the listeners serve, beyond their addresses.
#[derive(Clone, Default)]
pub struct ServeOptions {
    /// TLS on both listeners with this certificate; plain text without.
    pub tls: Option<ServingCert>,
    /// Served as `grpc.health.v1` on the gRPC listener.
    pub health: Option<Health>,
}

pub struct Serving {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Serving {
    /// Stops accepting, lets open calls end for up to `SHUTDOWN_GRACE`, then stops both
    /// servers (the streams still open are cut; their clients resume elsewhere). Returns
    /// whether everything ended within the grace.
    pub async fn shutdown(self) -> bool {
        let _ = self.stop.send(true);
        let deadline = tokio::time::Instant::now() + crate::limits::SHUTDOWN_GRACE;
        let mut clean = true;
        for mut t in self.tasks {
            if tokio::time::timeout_at(deadline, &mut t).await.is_err() {
                t.abort();
                clean = false;
            }
        }
        if !clean {
            tracing::warn!(
                grace = ?crate::limits::SHUTDOWN_GRACE,
                "calls still open when the shutdown grace ended are cut: their clients resume on another gateway"
            );
        }
        clean
    }
}

pub async fn serve(gw: Arc<Gateway>, grpc: SocketAddr, http: SocketAddr) -> std::io::Result<Serving> {
    serve_with(gw, grpc, http, ServeOptions::default()).await
}

pub async fn serve_with(
    gw: Arc<Gateway>,
    grpc: SocketAddr,
    http: SocketAddr,
    opts: ServeOptions,
) -> std::io::Result<Serving> {
    // Which listener, on which address: "Address already in use" alone named neither.
    let bind = |what: &'static str, addr: SocketAddr| async move {
        TcpListener::bind(addr)
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("the {what} listener on {addr}: {e}")))
    };
    let grpc_l = bind("gRPC", grpc).await?;
    let http_l = bind("HTTP", http).await?;
    let grpc_addr = grpc_l.local_addr()?;
    let http_addr = http_l.local_addr()?;
    let (stop, stop_rx) = watch::channel(false);
    let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);

    let mut rx = stop_rx.clone();
    let incoming = tonic::transport::server::TcpIncoming::from(grpc_l).with_nodelay(Some(true));
    let svc = crate::grpc::server(gw.clone());
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .tcp_keepalive(Some(KEEPALIVE_INTERVAL));
    if let Some(cert) = &opts.tls {
        builder = builder
            .tls_config(cert.tonic_config())
            .map_err(|e| invalid(format!("the gateway's TLS certificate: {e}")))?;
    }
    let router = builder
        .add_service(svc)
        .add_optional_service(opts.health.as_ref().map(Health::service));
    let grpc_task = tokio::spawn(async move {
        let r = router
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = r {
            tracing::error!("gRPC server: {e}");
        }
    });

    let mut rx = stop_rx;
    let app = crate::http::router(gw);
    let stopped = async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let http_task = match &opts.tls {
        None => tokio::spawn(async move {
            if let Err(e) = axum::serve(http_l, app).with_graceful_shutdown(stopped).await {
                tracing::error!("HTTP server: {e}");
            }
        }),
        Some(cert) => {
            let config = cert
                .rustls_config()
                .map_err(|e| invalid(format!("the gateway's TLS certificate: {e}")))?;
            let l = TlsListener::new(http_l, tokio_rustls::TlsAcceptor::from(config))?;
            tokio::spawn(async move {
                if let Err(e) = axum::serve(l, app).with_graceful_shutdown(stopped).await {
                    tracing::error!("HTTPS server: {e}");
                }
            })
        }
    };
    Ok(Serving {
        grpc_addr,
        http_addr,
        stop,
        tasks: vec![grpc_task, http_task],
    })
}

/// Accepted connections after their TLS handshake, for `axum::serve`. Handshakes run apart from
/// the accept loop (one slow or silent client holds up nobody) and end after
/// `TLS_HANDSHAKE_TIMEOUT`; a failed one is logged and dropped.
struct TlsListener {
    local: SocketAddr,
    ready: mpsc::Receiver<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
    accept_task: JoinHandle<()>,
}

/// Handshaken connections waiting for the server to take them.
const TLS_READY_QUEUE: usize = 64;

impl TlsListener {
    fn new(l: TcpListener, acceptor: tokio_rustls::TlsAcceptor) -> std::io::Result<TlsListener> {
        let local = l.local_addr()?;
        let (tx, ready) = mpsc::channel(TLS_READY_QUEUE);
        let accept_task = tokio::spawn(async move {
            loop {
                let (tcp, peer) = match l.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors and the like: pause rather than spin.
                        tracing::warn!("HTTPS accept: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, "TLS handshake failed: {e}"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener {
            local,
            ready,
            accept_task,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accept task holds the sender until it is aborted, which only Drop does.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}
