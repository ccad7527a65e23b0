//! Clients: each runs generations one after another through the gateways, disconnects at random
//! and resumes (on a random gateway) after the last seq it received, and records every event it
//! received, raw, before any deduplication, so the checkers see exactly what a client saw.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokenlog_proto::tokenlog as tpb;
use tokenlog_proto::tokenlog::generation_client::GenerationClient;
use tonic::transport::{Channel, Endpoint};

use super::now_us;

/// Per received event, the chance that the client drops the stream and resumes.
pub const DISCONNECT_CHANCE: f64 = 0.03;
/// How long one request may take, faults included, before the client gives up on it.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// The share of a client's requests that may end at EOS (`ignore_eos` false; the fake model
/// favours EOS about once in 64 tokens); the others run to `max_tokens`.
pub const EOS_SHARE: f64 = 0.25;
/// The share of a client's requests it cancels after a random number of events.
pub const CANCEL_SHARE: f64 = 0.1;

/// What one client saw of one request.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RequestRecord {
    pub client: usize,
    pub request_id: String,
    pub invoke_us: u64,
    pub complete_us: u64,
    pub generation: u64,
    /// When the first event arrived.
    #[serde(default)]
    pub first_event_us: Option<u64>,
    /// Every event received, in order: (seq, token_id, epoch, last).
    pub events: Vec<(u32, u32, u64, bool)>,
    /// Streams opened (1 + resumes).
    pub connections: u32,
    pub finished: bool,
    pub finish_reason: String,
    pub error: Option<String>,
    /// Status read right after the last event.
    pub status_after: Option<StatusSeen>,
    /// Every generation the events named, in order of first sight: one request must see one.
    #[serde(default)]
    pub generations: Vec<u64>,
    /// What the request asked for.
    #[serde(default)]
    pub max_tokens: u32,
    #[serde(default)]
    pub ignore_eos: bool,
    /// The events' text deltas, concatenated as received.
    #[serde(default)]
    pub text: String,
    /// When the client sent a cancel (it may have applied even if the call failed).
    #[serde(default)]
    pub cancel_sent_us: Option<u64>,
}

/// What a gateway's Status said of a request.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StatusSeen {
    pub state: String,
    pub frontier: u32,
    pub generation: u64,
    pub finish_reason: String,
}

/// A lazily connecting channel to a gateway; `call_timeout` bounds each call (not for streams).
pub fn channel(addr: &str, call_timeout: Option<Duration>) -> Channel {
    let mut e = Endpoint::from_shared(format!("http://{addr}"))
        .expect("loopback address")
        .connect_timeout(Duration::from_millis(500))
        .tcp_nodelay(true);
    if let Some(t) = call_timeout {
        e = e.timeout(t);
    }
    e.connect_lazy()
}

/// Errors a client retries: the gateway or the log behind it is down or moving.
pub fn transient(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
            | tonic::Code::Internal
            | tonic::Code::DeadlineExceeded
    )
}

pub async fn client_loop(
    id: usize,
    gateways: Vec<String>,
    seed: u64,
    max_tokens: (u32, u32),
    (eos_share, cancel_share): (f64, f64),
    stop_new: tokio::sync::watch::Receiver<bool>,
    out: Arc<Mutex<Vec<RequestRecord>>>,
    read_at_finish: Option<(tokenlog_raftlog::client::LogClient, super::checks::AtFinish)>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ (id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let channels: Vec<Channel> = gateways.iter().map(|a| channel(a, None)).collect();
    let mut k = 0;
    while !*stop_new.borrow() {
        let rid = format!("c{id}-{k}");
        k += 1;
        let n = rng.random_range(max_tokens.0..=max_tokens.1);
        let mut req = request(&rid, n, rng.random());
        req.ignore_eos = !rng.random_bool(eos_share);
        let cancel_after = rng
            .random_bool(cancel_share)
            .then(|| rng.random_range(1..=n.max(2) as usize / 2));
        let mut routing = Routing::Random(StdRng::seed_from_u64(rng.random()));
        let rec = one_request(id, req, &channels, &mut routing, None, cancel_after).await;
        if let (true, Some((log, at_finish))) = (rec.finished && rec.generation != 0, &read_at_finish) {
            // Read now, before retention may prune it (a stress configuration keeps finished
            // generations for seconds only). A read can fail for a while under the nemeses (a
            // watch on a node that restarted and has not caught up answers NOT_FOUND; one on a
            // node that exits breaks): read again, for a second at most. CI once lost this read
            // while a node whose disk had filled came back, and the generation, pruned before
            // the end, was then reported missing from the final log.
            let tried = std::time::Instant::now();
            loop {
                match super::finish::final_gen(log, rec.generation).await {
                    Ok(f) => {
                        at_finish.lock().expect("lock").insert(rec.generation, f);
                        break;
                    }
                    Err(_) if tried.elapsed() < AT_FINISH_READ_FOR => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(_) => break,
                }
            }
        }
        let refused = !rec.finished && rec.events.is_empty();
        out.lock().expect("lock").push(rec);
        if refused {
            // Refused outright (no decoder registered, say): not again at once.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// How long a client tries to read a generation it saw finish (see `client`).
const AT_FINISH_READ_FOR: Duration = Duration::from_secs(1);

/// The request a workload client sends: sampled (temperature 0.8, top-p 0.95), EOS ignored, so
/// it runs to `max_tokens`.
pub fn request(rid: &str, max_tokens: u32, seed: u64) -> tpb::GenerateRequest {
    tpb::GenerateRequest {
        request_id: rid.to_string(),
        prompt: format!("story {rid}: "),
        max_tokens,
        temperature: 0.8,
        top_p: 0.95,
        seed,
        ignore_eos: true,
        ..Default::default()
    }
}

/// How a client picks gateways and when it drops a stream on purpose.
pub enum Routing {
    /// A random gateway per connection; drops the stream after an event with
    /// [`DISCONNECT_CHANCE`].
    Random(StdRng),
    /// Gateway `k % n` for the k-th connection; never drops a stream on purpose (scenarios).
    RoundRobin,
}

impl Routing {
    fn gateway(&mut self, connection: u32, n: usize) -> usize {
        match self {
            Routing::Random(rng) => rng.random_range(0..n),
            Routing::RoundRobin => connection as usize % n,
        }
    }
    fn disconnect(&mut self) -> bool {
        match self {
            Routing::Random(rng) => rng.random_bool(DISCONNECT_CHANCE),
            Routing::RoundRobin => false,
        }
    }
    fn pause(&mut self) -> Duration {
        match self {
            Routing::Random(rng) => Duration::from_millis(rng.random_range(0..50)),
            Routing::RoundRobin => Duration::from_millis(50),
        }
    }
}

/// What a running request has received so far: events, and the gateway of the open stream.
#[derive(Clone, Copy, Debug, Default)]
pub struct Progress {
    pub events: usize,
    pub gateway: usize,
}

/// Runs one request to its end (or [`REQUEST_TIMEOUT`]) through `channels`, resuming after the
/// last seq received whenever a stream breaks; records every event as received. `progress`, if
/// given, is told of every event. With `cancel_after`, the client cancels the request once it
/// has received that many events, and reads on to the last event.
pub async fn one_request(
    client: usize,
    req: tpb::GenerateRequest,
    channels: &[Channel],
    routing: &mut Routing,
    progress: Option<&tokio::sync::watch::Sender<Progress>>,
    cancel_after: Option<usize>,
) -> RequestRecord {
    one_request_within(client, req, channels, routing, progress, cancel_after, REQUEST_TIMEOUT).await
}

/// [`one_request`], giving up (unfinished) after `within` (a stream read may add 15 s).
pub async fn one_request_within(
    client: usize,
    req: tpb::GenerateRequest,
    channels: &[Channel],
    routing: &mut Routing,
    progress: Option<&tokio::sync::watch::Sender<Progress>>,
    cancel_after: Option<usize>,
    within: Duration,
) -> RequestRecord {
    let rid = req.request_id.as_str();
    let mut rec = RequestRecord {
        client,
        request_id: rid.to_string(),
        invoke_us: now_us(),
        complete_us: 0,
        generation: 0,
        first_event_us: None,
        events: vec![],
        connections: 0,
        finished: false,
        finish_reason: String::new(),
        error: None,
        status_after: None,
        generations: vec![],
        max_tokens: req.max_tokens,
        ignore_eos: req.ignore_eos,
        text: String::new(),
        cancel_sent_us: None,
    };
    let started = Instant::now();
    let mut last: i64 = -1;
    'outer: while started.elapsed() < within {
        let gateway = routing.gateway(rec.connections, channels.len());
        let mut c = GenerationClient::new(channels[gateway].clone());
        rec.connections += 1;
        // Generate is idempotent by request id: until an event arrived, submit again; after,
        // resume after the last seq received.
        let opened = if last < 0 {
            c.generate(req.clone()).await
        } else {
            c.resume(tpb::ResumeRequest {
                request_id: rid.to_string(),
                after_seq: last,
            })
            .await
        };
        let mut s = match opened {
            Ok(r) => r.into_inner(),
            Err(e) => {
                rec.error = Some(e.to_string());
                if !transient(e.code()) {
                    break 'outer;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        loop {
            match tokio::time::timeout(Duration::from_secs(15), s.message()).await {
                Ok(Ok(Some(ev))) => {
                    rec.generation = ev.generation;
                    if !rec.generations.contains(&ev.generation) {
                        rec.generations.push(ev.generation);
                    }
                    rec.first_event_us.get_or_insert_with(now_us);
                    rec.events.push((ev.seq, ev.token_id, ev.epoch, ev.last));
                    rec.text.push_str(&ev.text_delta);
                    last = last.max(i64::from(ev.seq));
                    if let Some(p) = progress {
                        p.send_replace(Progress {
                            events: rec.events.len(),
                            gateway,
                        });
                    }
                    if ev.last {
                        rec.finished = true;
                        rec.finish_reason = ev.finish_reason.clone();
                        rec.error = None;
                        break 'outer;
                    }
                    if !ev.last && cancel_after == Some(rec.events.len()) {
                        rec.cancel_sent_us = Some(now_us());
                        let cancel = tpb::CancelRequest {
                            request_id: rid.to_string(),
                        };
                        let mut c = GenerationClient::new(channels[gateway].clone());
                        let _ = tokio::time::timeout(Duration::from_secs(5), c.cancel(cancel)).await;
                    }
                    if routing.disconnect() {
                        break;
                    }
                }
                Ok(Ok(None)) => break,
                Ok(Err(e)) => {
                    rec.error = Some(e.to_string());
                    break;
                }
                Err(_) => {
                    rec.error = Some("no event for 15 s".into());
                    break;
                }
            }
        }
        tokio::time::sleep(routing.pause()).await;
    }
    rec.complete_us = now_us();
    if rec.finished {
        for ch in channels {
            if let Ok(st) = GenerationClient::new(ch.clone())
                .status(tpb::StatusRequest {
                    request_id: rid.to_string(),
                })
                .await
            {
                let st = st.into_inner();
                rec.status_after = Some(StatusSeen {
                    state: st.state,
                    frontier: st.frontier,
                    generation: st.generation,
                    finish_reason: st.finish_reason,
                });
                break;
            }
        }
    }
    rec
}

pub fn to_json(r: &RequestRecord) -> Value {
    let mut v = serde_json::to_value(r).expect("serializable");
    v["op"] = json!("request");
    v
}
