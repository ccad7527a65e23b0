//! Running a gateway: the gRPC service and the HTTP API on their own listeners, with a clean
//! shutdown. Used by `tokenlog gateway` and `tokenlog dev`.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::core::Gateway;

pub struct Serving {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Serving {
    /// Stops accepting, lets open calls end, and waits for both servers.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

pub async fn serve(gw: Arc<Gateway>, grpc: SocketAddr, http: SocketAddr) -> std::io::Result<Serving> {
    let grpc_l = TcpListener::bind(grpc).await?;
    let http_l = TcpListener::bind(http).await?;
    let grpc_addr = grpc_l.local_addr()?;
    let http_addr = http_l.local_addr()?;
    let (stop, stop_rx) = watch::channel(false);

    let mut rx = stop_rx.clone();
    let incoming = tonic::transport::server::TcpIncoming::from(grpc_l).with_nodelay(Some(true));
    let svc = crate::grpc::server(gw.clone());
    let grpc_task = tokio::spawn(async move {
        let r = tonic::transport::Server::builder()
            .add_service(svc)
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
    let http_task = tokio::spawn(async move {
        let r = axum::serve(http_l, app)
            .with_graceful_shutdown(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = r {
            tracing::error!("HTTP server: {e}");
        }
    });
    Ok(Serving {
        grpc_addr,
        http_addr,
        stop,
        tasks: vec![grpc_task, http_task],
    })
}

/// Serves `GET /metrics` (and `/healthz`) on `addr` from `render`, for processes without a
/// gateway (`tokenlog node`, `tokenlog decoder`).
pub async fn serve_metrics(
    addr: SocketAddr,
    render: crate::metrics::Source,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let l = TcpListener::bind(addr).await?;
    let local = l.local_addr()?;
    let app = axum::Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok\n" }))
        .route(
            "/metrics",
            axum::routing::get(move || {
                let render = render.clone();
                async move {
                    (
                        [(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        render(),
                    )
                }
            }),
        );
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(l, app).await {
            tracing::error!("metrics server: {e}");
        }
    });
    Ok((local, task))
}
