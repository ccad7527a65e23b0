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
