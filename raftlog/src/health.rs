//! Health, the same way on every process: a readiness check ([`Readiness`]) answered over
//! `grpc.health.v1` ([`Health::service`]) and, on a process's status listener, over HTTP
//! (`/readyz`). What "ready" means is the process's own: a node knows a leader and has applied
//! what it learned was committed ([`crate::node::NodeCtx::readiness`]); a decoder has its model
//! loaded and its registration accepted; a gateway reaches the log.
//!
//! The overall status (service name `""`) follows the check, polled every [`HEALTH_POLL`]; a
//! `Watch` sees each change.

use std::future::Future;
use std::sync::Arc;

use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;

use crate::limits::HEALTH_POLL;

/// Whether the process can do its work now; `Err` says why not.
pub type Readiness = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// The health of one process: its readiness check, and the statuses `grpc.health.v1` serves.
#[derive(Clone)]
pub struct Health {
    ready: Readiness,
    reporter: HealthReporter,
}

impl Health {
    /// Starts following `ready` (until `stop` completes; then the status stays where it was).
    /// The status is the check's from the start: a process is not SERVING before it has said so.
    pub async fn follow(ready: Readiness, stop: impl Future<Output = ()> + Send + 'static) -> Health {
        let reporter = HealthReporter::new();
        let first = status_of(&ready);
        reporter.set_service_status("", first).await;
        let (r, rep) = (ready.clone(), reporter.clone());
        tokio::spawn(async move {
            let follow = async {
                let mut last = first;
                loop {
                    tokio::time::sleep(HEALTH_POLL).await;
                    let now = status_of(&r);
                    if now != last {
                        rep.set_service_status("", now).await;
                        last = now;
                    }
                }
            };
            tokio::select! {
                _ = follow => {}
                _ = stop => {}
            }
        });
        Health { ready, reporter }
    }

    /// The check itself, now (for `/readyz`).
    pub fn check(&self) -> Result<(), String> {
        (self.ready)()
    }

    /// A `grpc.health.v1.Health` service serving these statuses (one per listener).
    pub fn service(&self) -> HealthServer<HealthService> {
        HealthServer::new(HealthService::from_health_reporter(self.reporter.clone()))
    }
}

fn status_of(ready: &Readiness) -> ServingStatus {
    match ready() {
        Ok(()) => ServingStatus::Serving,
        Err(_) => ServingStatus::NotServing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tonic_health::pb::health_server::Health as _;
    use tonic_health::pb::HealthCheckRequest;

    async fn status(h: &Health) -> i32 {
        HealthService::from_health_reporter(h.reporter.clone())
            .check(tonic::Request::new(HealthCheckRequest { service: String::new() }))
            .await
            .unwrap()
            .into_inner()
            .status
    }

    async fn becomes(h: &Health, want: ServingStatus) {
        for _ in 0..100 {
            if status(h).await == want as i32 {
                return;
            }
            tokio::time::sleep(HEALTH_POLL / 2).await;
        }
        panic!("the status never became {want:?}");
    }

    #[tokio::test]
    async fn the_overall_status_follows_the_check_from_the_start() {
        let up = Arc::new(AtomicBool::new(false));
        let flag = up.clone();
        let ready: Readiness = Arc::new(move || {
            if flag.load(Ordering::SeqCst) {
                Ok(())
            } else {
                Err("not yet".into())
            }
        });
        let h = Health::follow(ready, std::future::pending()).await;
        // At once, not after a poll: tonic's reporter starts out SERVING.
        assert_eq!(status(&h).await, ServingStatus::NotServing as i32);
        assert_eq!(h.check(), Err("not yet".to_string()));
        up.store(true, Ordering::SeqCst);
        becomes(&h, ServingStatus::Serving).await;
        up.store(false, Ordering::SeqCst);
        becomes(&h, ServingStatus::NotServing).await;
    }
}
