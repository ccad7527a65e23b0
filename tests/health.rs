//! Health on every process (issue 14, item 5): each node, decoder and gateway answers `/livez`,
//! `/readyz` and `grpc.health.v1` on its status listener (`--metrics-listen`), the gateway also
//! on its gRPC port, a node also on its client port (over mutual TLS, for any role). Ready
//! means: a node knows a leader and has applied what it knows is committed; a decoder's
//! registration was accepted; a gateway reaches the log. Each goes NOT_SERVING when that stops
//! being true, and back.

// See log_cluster.rs: the serial guard is held across awaits on purpose.
#![allow(clippy::await_holding_lock)]

mod common;

use std::time::{Duration, Instant};

use common::{free_port, http, serial, tls, Cluster};
use tonic::transport::Endpoint;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// The overall status over grpc.health.v1 at `addr` (plain text, or mutual TLS as `holder` of
/// the certificates in `certs`).
async fn grpc_status(addr: &str, certs: Option<(&std::path::Path, &str)>) -> Result<i32, tonic::Status> {
    let scheme = if certs.is_some() { "https" } else { "http" };
    let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}")).unwrap();
    if let Some((dir, holder)) = certs {
        ep = ep.tls_config(tls(dir, holder).client_config()).unwrap();
    }
    let ch = ep
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let r = HealthClient::new(ch)
        .check(HealthCheckRequest { service: String::new() })
        .await?;
    Ok(r.into_inner().status)
}

/// `/readyz` of a status listener: (HTTP status, body).
fn readyz(addr: &str) -> (u16, String) {
    http(addr, "GET", "/readyz", &[], "")
}

/// Waits until the status listener at `addr` says `ready` over both HTTP and gRPC.
async fn becomes(what: &str, addr: &str, ready: bool, within: Duration) {
    let (code, want) = if ready {
        (200, ServingStatus::Serving)
    } else {
        (503, ServingStatus::NotServing)
    };
    let deadline = Instant::now() + within;
    loop {
        // The listener of a process that is still starting (or restarting) is not there yet.
        if std::net::TcpStream::connect(addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "{what}: nothing listens on {addr} after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let h = readyz(addr);
        let g = grpc_status(addr, None).await;
        if h.0 == code && g.as_ref().ok() == Some(&(want as i32)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} ({addr}) did not become {} within {within:?}: /readyz {h:?}, grpc.health.v1 {g:?}",
            if ready { "ready" } else { "not ready" }
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_decoders_and_gateways_say_when_they_can_work() {
    let _g = serial();
    let mut c = Cluster::start(1_000);
    for (i, a) in c.status_addrs.clone().iter().enumerate() {
        becomes(&format!("node {}", i + 1), a, true, Duration::from_secs(20)).await;
        assert_eq!(http(a, "GET", "/livez", &[], "").0, 200);
    }
    let gw_status = format!("127.0.0.1:{}", free_port());
    let gw = c.start_gateway("gw", &["--metrics-listen", &gw_status]);
    becomes("the gateway", &gw_status, true, Duration::from_secs(20)).await;
    // The gateway's own gRPC port answers health too (for load balancers).
    assert_eq!(
        grpc_status(&gw.grpc, None).await.unwrap(),
        ServingStatus::Serving as i32
    );
    let dec_status = format!("127.0.0.1:{}", free_port());
    let mut dec = c.start_decoder("d1", &["--metrics-listen", &dec_status]);
    becomes("the decoder", &dec_status, true, Duration::from_secs(20)).await;

    // Two of three nodes gone: the third knows no leader, the gateway no longer reaches a log
    // that can work, and a decoder started now cannot register.
    let leader = c.leader().await;
    let others: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    c.kill9(leader);
    c.kill9(others[0]);
    let lone = &c.status_addrs[others[1]];
    becomes("the node left alone", lone, false, Duration::from_secs(15)).await;
    let (_, why) = readyz(lone);
    assert!(why.contains("no leader known"), "{why}");
    becomes("the gateway", &gw_status, false, Duration::from_secs(20)).await;
    let (_, why) = readyz(&gw_status);
    assert!(why.contains("leader") || why.contains("answer"), "{why}");
    assert_eq!(
        grpc_status(&gw.grpc, None).await.unwrap(),
        ServingStatus::NotServing as i32
    );
    let late_status = format!("127.0.0.1:{}", free_port());
    let _late = c.start_decoder("d2", &["--metrics-listen", &late_status]);
    common::wait_for_port(&late_status);
    let (code, why) = readyz(&late_status);
    assert_eq!(
        code, 503,
        "a decoder whose registration no log accepted is not ready: {why}"
    );
    assert!(why.contains("registration"), "{why}");
    // Liveness is not readiness: every process still lives.
    for a in [lone, &gw_status, &dec_status, &late_status] {
        assert_eq!(http(a, "GET", "/livez", &[], "").0, 200, "{a}");
    }

    // The nodes come back: everything is ready again.
    c.start_node(leader);
    c.start_node(others[0]);
    for a in c.status_addrs.clone() {
        becomes("a node", &a, true, Duration::from_secs(30)).await;
    }
    becomes("the gateway", &gw_status, true, Duration::from_secs(20)).await;
    becomes(
        "the decoder started during the outage",
        &late_status,
        true,
        Duration::from_secs(40),
    )
    .await;
    dec.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_answers_health_over_mutual_tls_to_every_role_and_only_to_them() {
    let _g = serial();
    let certs = tempfile::tempdir().unwrap();
    common::make_certs(certs.path(), &[]);
    let c = Cluster::start_tls(certs.path());
    let addr = c.addrs[0].clone();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = grpc_status(&addr, Some((certs.path(), "admin"))).await;
        if s.as_ref().ok() == Some(&(ServingStatus::Serving as i32)) {
            break;
        }
        assert!(Instant::now() < deadline, "node 1 never SERVING over TLS: {s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for holder in ["decoder-1", "gateway-1", "node-2"] {
        assert_eq!(
            grpc_status(&addr, Some((certs.path(), holder))).await.unwrap(),
            ServingStatus::Serving as i32,
            "{holder}"
        );
    }
    // No certificate: refused, as every other call on this port.
    let ep = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(
                    std::fs::read(certs.path().join("ca.pem")).unwrap(),
                ))
                .domain_name(tokenlog_raftlog::tls::NODE_SERVER_NAME),
        )
        .unwrap();
    let refused = HealthClient::new(ep.connect().await.unwrap())
        .check(HealthCheckRequest { service: String::new() })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    // The plain status listener answers anyone (probes carry no certificate).
    becomes(
        "node 1's status listener",
        &c.status_addrs[0],
        true,
        Duration::from_secs(5),
    )
    .await;
}
