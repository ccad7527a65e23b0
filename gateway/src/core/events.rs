//! A generation's client events, rebuilt from the log's Watch: from seq 0, so the text of each
//! event is a function of the committed prefix, whichever gateway serves it (CONTRACT §3).

use std::sync::Arc;
use std::time::Instant;

use tokenlog_decoder::{IncrementalDetokenizer, StopText, Tokenizer};
use tokenlog_proto::raftlog as pb;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::{finish_reason_str, prompt_tokens, Event, Finish, Gateway};
use crate::error::{GatewayError, Result};
use crate::limits::*;
use crate::tenants::{Held, TenantSlot};

impl Gateway {
    /// Streams the events of `info`'s generation with seq > `after_seq` (-1 = all), ending with
    /// the last event once the generation is terminal. Errors end the stream.
    pub async fn events(
        self: &Arc<Self>,
        info: pb::GenerationInfo,
        after_seq: i64,
    ) -> Result<mpsc::Receiver<Result<Event>>> {
        // No event comes past the last one: its seq is the frontier of a finished generation,
        // at most its max_tokens while it runs. A resume past it (a seq no event can have) used
        // to get a stream that ended without a last event, which a client takes for a broken
        // one and retries; a resume right after the last event gets an empty stream.
        let terminal = super::is_terminal(&info);
        let last_possible = match terminal {
            true => i64::from(info.frontier),
            false => i64::from(
                info.binding
                    .as_ref()
                    .and_then(|b| b.stop.as_ref())
                    .map_or(u32::MAX, |s| s.max_tokens),
            ),
        };
        if after_seq > last_possible {
            return Err(GatewayError::Invalid(format!(
                "no event has seq {after_seq}: the last event of request {:?} is seq {last_possible}{}",
                info.request_id,
                if terminal { "" } else { " at most (its max_tokens)" }
            )));
        }
        let digest = info
            .binding
            .as_ref()
            .and_then(|b| b.model.as_ref())
            .map(|m| m.tokenizer_sha256.clone())
            .unwrap_or_default();
        let tokenizer = self.tokenizer_for(&digest, &info.request_id).await?;
        let slot = self
            .tenant_use
            .take(&info.tenant, Held::Stream, self.tenant_limits.streams)?;
        let permit = self
            .streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| super::overloaded())?;
        let (tx, rx) = mpsc::channel(STREAM_BUFFER_EVENTS);
        let gw = self.clone();
        tokio::spawn(async move { gw.pump(info, after_seq, tokenizer, tx, (permit, slot)).await });
        Ok(rx)
    }

    /// Runs one stream: re-opens the Watch when a log node dies, and stops as soon as the client
    /// goes away (even while the generation is stalled), releasing the stream slot.
    async fn pump(
        self: Arc<Self>,
        info: pb::GenerationInfo,
        after_seq: i64,
        tokenizer: Arc<Tokenizer>,
        tx: mpsc::Sender<Result<Event>>,
        // The gateway-wide and the tenant's stream slot, given back on every exit.
        _slots: (OwnedSemaphorePermit, TenantSlot),
    ) {
        let _active = self.metrics.stream_guard();
        let mut text = EventText::new(&info, &tokenizer, after_seq);
        // Since when the Watch has failed without a healthy stretch between: the budget counts
        // from the failure. (It counted from the generation's last record: a stream quiet for
        // longer than the budget, a queued request, failed at the first failed re-open, and a
        // Watch that opened and broke again at once was re-opened for ever.)
        let mut failing_since: Option<Instant> = None;
        loop {
            let opened = tokio::select! {
                _ = tx.closed() => return,
                w = self.log.watch(text.generation, text.next) => w,
            };
            let mut stream = match opened {
                Ok(s) => s,
                // The log client retried what is worth retrying (a node down, not the leader)
                // for its own budget; a status it returns is the log's answer: NOT_FOUND from
                // the leader after a read index (the generation was pruned since it was looked
                // up), a refused credential. Retrying it only kept the client waiting for
                // `WATCH_RETRY_BUDGET` before the same answer.
                Err(e @ tokenlog_raftlog::client::ClientError::Status(_)) => {
                    let _ = tx.send(Err(e.into())).await;
                    return;
                }
                Err(e) => {
                    if failing_since.get_or_insert_with(Instant::now).elapsed() > WATCH_RETRY_BUDGET {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                    tokio::time::sleep(WATCH_OPEN_RETRY).await;
                    continue;
                }
            };
            let opened = Instant::now();
            loop {
                let message = tokio::select! {
                    _ = tx.closed() => return,
                    m = stream.message() => m,
                };
                let ev = match message {
                    Ok(Some(ev)) => ev,
                    Ok(None) => break,
                    Err(status) if status.code() == tonic::Code::NotFound => {
                        let _ = tx.send(Err(GatewayError::NotFound(status.message().to_string()))).await;
                        return;
                    }
                    Err(status) => {
                        // A Watch that stayed open a while was healthy: this is a new failure.
                        if opened.elapsed() >= WATCH_HEALTHY {
                            failing_since = None;
                        }
                        if failing_since.get_or_insert_with(Instant::now).elapsed() > WATCH_RETRY_BUDGET {
                            let _ = tx
                                .send(Err(tokenlog_raftlog::client::ClientError::Status(status).into()))
                                .await;
                            return;
                        }
                        tracing::debug!(
                            generation = text.generation,
                            "watch broke ({status}); reopening at seq {}",
                            text.next
                        );
                        break;
                    }
                };
                failing_since = None;
                let (events, broken) = text.events(ev);
                for e in events {
                    let token = e.token_id.is_some();
                    if tx.send(Ok(e)).await.is_err() {
                        return;
                    }
                    if token {
                        self.metrics.tokens_streamed.inc();
                    }
                }
                if let Some(e) = broken {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
                if text.done {
                    return;
                }
            }
            tokio::time::sleep(WATCH_REOPEN_BACKOFF).await;
        }
    }
}

/// The client events of one generation, rebuilt record by record from seq 0: the detokenizer
/// and the stop-string cut are fed every record, events are emitted only past `after_seq`.
struct EventText {
    request_id: String,
    generation: u64,
    after_seq: i64,
    /// The next record expected from the log.
    next: u32,
    last_epoch: u64,
    detok: IncrementalDetokenizer,
    stop_text: StopText,
    done: bool,
}

impl EventText {
    fn new(info: &pb::GenerationInfo, tokenizer: &Tokenizer, after_seq: i64) -> Self {
        let stops = info
            .binding
            .as_ref()
            .and_then(|b| b.stop.as_ref())
            .map(|s| s.stop_strings.clone())
            .unwrap_or_default();
        EventText {
            request_id: info.request_id.clone(),
            generation: info.generation_id,
            after_seq,
            next: 0,
            last_epoch: 0,
            detok: tokenizer.detokenizer(true),
            stop_text: StopText::new(stops),
            done: false,
        }
    }

    fn event(&self, seq: u32, epoch: u64, token_id: Option<u32>, text: String, finish: Option<Finish>) -> Event {
        Event {
            request_id: self.request_id.clone(),
            generation: self.generation,
            epoch,
            seq,
            token_id,
            text,
            finish,
        }
    }

    /// The client events of one Watch message (records already seen are skipped); the last
    /// event when the message says the generation is terminal. A gap in the records ends the
    /// stream: the events before it, then the error.
    fn events(&mut self, ev: pb::WatchEvent) -> (Vec<Event>, Option<GatewayError>) {
        let mut out = Vec::new();
        for r in ev.records {
            if r.seq < self.next {
                continue;
            }
            if r.seq > self.next {
                let gap = GatewayError::Internal(format!(
                    "log skipped from seq {} to {} for generation {}",
                    self.next, r.seq, self.generation
                ));
                return (out, Some(gap));
            }
            let text = self.stop_text.push(&self.detok.push(r.token_id));
            self.last_epoch = r.epoch;
            if i64::from(r.seq) > self.after_seq {
                out.push(self.event(r.seq, r.epoch, Some(r.token_id), text, None));
            }
            self.next += 1;
        }
        if let Some(term) = ev.terminal {
            self.done = true;
            // A resume past where the generation ended (it was running when the resume came,
            // bounded only by its max_tokens): the same answer as a resume past the end of a
            // generation that had ended already. It was a stream that ended without a last
            // event and without an error (an empty 200 SSE stream over HTTP).
            if self.after_seq > i64::from(self.next) {
                return (
                    out,
                    Some(GatewayError::Invalid(format!(
                        "no event has seq {}: the last event of request {:?} is seq {}",
                        self.after_seq, self.request_id, self.next
                    ))),
                );
            }
            if i64::from(self.next) > self.after_seq {
                let finish = Finish {
                    reason: finish_reason_str(term.finish_reason),
                    detail: term.finish_detail.clone(),
                    prompt_tokens: prompt_tokens(&term),
                    completion_tokens: term.frontier,
                };
                let epoch = term.lease.as_ref().map_or(self.last_epoch, |l| l.epoch);
                let rest = self.stop_text.finish(&self.detok.finish());
                out.push(self.event(self.next, epoch, None, rest, Some(finish)));
            }
        }
        (out, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gateway whose streams are all open refuses a request before it submits it (the log
    /// here is unreachable: asking it would not answer for the log client's retry budget).
    /// Before, the generation was created first and its stream refused afterwards.
    #[tokio::test]
    async fn a_gateway_with_every_stream_open_refuses_a_request_before_submitting_it() {
        use crate::core::{BindDefaults, GenerateParams, Prompt};
        use crate::tenants::{TenantLimits, Tenants};
        let gw = Gateway::new(
            tokenlog_raftlog::client::LogClient::new(vec!["127.0.0.1:9".into()]).unwrap(),
            Tenants::Open,
            vec![],
            TenantLimits { streams: 8, submits: 8 },
            BindDefaults::default(),
        )
        .unwrap();
        let _all = gw.streams.clone().try_acquire_many_owned(STREAMS_MAX as u32).unwrap();
        let p = GenerateParams::new("r", Prompt::Text("hi".into()));
        let r = tokio::time::timeout(std::time::Duration::from_secs(5), gw.submit("t", &p))
            .await
            .expect("refused at once, without asking the log");
        assert!(matches!(r, Err(GatewayError::Overloaded(_))), "{:?}", r.map(|_| ()));
    }

    /// A Watch the log refuses at open (here NOT_FOUND: a generation pruned between its
    /// lookup and the Watch, or never there) ends the stream with that answer at once. It was
    /// retried every `WATCH_OPEN_RETRY` for `WATCH_RETRY_BUDGET` (30 s), and the client waited
    /// that long for the same answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_watch_the_log_refuses_at_open_ends_the_stream_at_once() {
        use crate::core::BindDefaults;
        use crate::tenants::{TenantLimits, Tenants};
        use tokenlog_raftlog::node::{self, NodeConfig};
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = NodeConfig::new(1, "127.0.0.1:0".parse().unwrap(), dir.path().to_path_buf());
        cfg.initial_members = vec![(1, "127.0.0.1:0".into())];
        let n = node::start(cfg).await.expect("node starts");
        for _ in 0..100 {
            if n.ctx.status().leader_id == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let tok = tokenlog_decoder::fake::fake_tokenizer().unwrap();
        let digest = tokenlog_decoder::identity::tokenizer_sha256(&tok).unwrap();
        let gw = Gateway::new(
            tokenlog_raftlog::client::LogClient::new(vec![n.local_addr.to_string()]).unwrap(),
            Tenants::Open,
            vec![tok],
            TenantLimits { streams: 8, submits: 8 },
            BindDefaults::default(),
        )
        .unwrap();
        let mut gen = info(&[]);
        gen.generation_id = 4242;
        gen.binding.as_mut().unwrap().model = Some(pb::ModelIdentity {
            tokenizer_sha256: digest,
            ..Default::default()
        });
        let mut rx = gw.events(gen, -1).await.expect("the stream starts");
        let first = tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv())
            .await
            .expect("the log's answer, well within WATCH_RETRY_BUDGET");
        match first {
            Some(Err(GatewayError::NotFound(m))) => assert!(m.contains("no generation 4242"), "{m}"),
            e => panic!("{:?}", e.map(|r| r.map(|_| ()))),
        }
        n.shutdown().await;
    }

    fn info(stops: &[&str]) -> pb::GenerationInfo {
        pb::GenerationInfo {
            generation_id: 7,
            request_id: "r".into(),
            binding: Some(pb::Binding {
                stop: Some(pb::StopConfig {
                    stop_strings: stops.iter().map(|s| s.to_string()).collect(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn rec(seq: u32, token_id: u32) -> pb::Record {
        pb::Record {
            seq,
            token_id,
            epoch: 1,
        }
    }

    /// A resume after a seq the generation never reached (it ended at 3, the resume is after
    /// 100) ends with an error naming the last event, as for one that had ended before the
    /// resume; a resume right after the last event gets no event and no error.
    #[test]
    fn a_resume_past_where_the_generation_ended_is_an_error() {
        let tok = tokenlog_decoder::fake::fake_tokenizer().unwrap();
        let end = |after_seq| {
            let mut t = EventText::new(&info(&[]), &tok, after_seq);
            t.events(pb::WatchEvent {
                records: vec![rec(0, 100), rec(1, 101), rec(2, 102)],
                terminal: Some(pb::GenerationInfo {
                    frontier: 3,
                    ..Default::default()
                }),
            })
        };
        let (ev, err) = end(100);
        assert!(ev.is_empty());
        let err = err.expect("an error").to_string();
        assert!(
            err.contains("no event has seq 100") && err.contains("is seq 3"),
            "{err}"
        );
        let (ev, err) = end(3);
        assert!(ev.is_empty() && err.is_none(), "{ev:?} {err:?}");
        let (ev, err) = end(2);
        assert_eq!(ev.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3]);
        assert!(err.is_none());
    }

    #[test]
    fn events_skip_what_was_seen_and_a_gap_ends_after_the_events_before_it() {
        let tok = tokenlog_decoder::fake::fake_tokenizer().unwrap();
        let mut t = EventText::new(&info(&[]), &tok, 0);
        let (ev, err) = t.events(pb::WatchEvent {
            records: vec![rec(0, 100), rec(1, 101)],
            terminal: None,
        });
        assert!(err.is_none());
        assert_eq!(
            ev.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![1],
            "seq 0 is not after after_seq 0"
        );
        let (ev, err) = t.events(pb::WatchEvent {
            records: vec![rec(1, 101), rec(2, 102), rec(4, 104)],
            terminal: None,
        });
        assert_eq!(
            ev.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![2],
            "re-sent seq 1 skipped"
        );
        assert!(matches!(err, Some(GatewayError::Internal(m)) if m.contains("skipped from seq 3 to 4")));
    }

    #[test]
    fn the_terminal_message_ends_with_one_last_event() {
        let tok = tokenlog_decoder::fake::fake_tokenizer().unwrap();
        let mut t = EventText::new(&info(&[]), &tok, -1);
        let terminal = pb::GenerationInfo {
            frontier: 1,
            finish_reason: pb::FinishReason::Length as i32,
            ..info(&[])
        };
        let (ev, err) = t.events(pb::WatchEvent {
            records: vec![rec(0, 100)],
            terminal: Some(terminal),
        });
        assert!(err.is_none() && t.done);
        assert_eq!(ev.len(), 2);
        let last = ev[1].finish.as_ref().unwrap();
        assert_eq!((ev[1].seq, last.reason, last.completion_tokens), (1, "length", 1));
    }
}
