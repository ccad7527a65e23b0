//! Pure apply tests: no I/O, no clock. Each test drives `LogState::apply` with stamped commands.
//! Here: the helpers, submit, log time, determinism; `fencing`: ownership and appends;
//! `upkeep`: ticks, retention, pending work, registrations; `handoff`: planned handoff;
//! `pipeline`: pipeline compositions; `standby`: hot standbys.

use super::*;

const LEASE: u64 = 1_000;

fn model() -> ModelIdentity {
    ModelIdentity {
        weights_sha256: "w".into(),
        tokenizer_sha256: "t".into(),
        architecture: "llama".into(),
        dtype_class: "fake".into(),
    }
}

fn binding() -> Binding {
    Binding {
        model: model(),
        prompt_token_ids: vec![1, 2, 3],
        stop: StopConfig {
            max_tokens: 16,
            ..Default::default()
        },
        ..Default::default()
    }
}

struct T {
    s: LogState,
    changes: Changes,
}

impl T {
    fn new() -> Self {
        T {
            s: LogState::default(),
            changes: Changes::default(),
        }
    }
    /// One `Append` of `items` by `dec` at `log_ms`: each item's outcome.
    fn append_items(&mut self, log_ms: u64, dec: &str, items: Vec<AppendItem>) -> Vec<AppendOutcome> {
        let cmd = Command::Append {
            decoder: dec.into(),
            lease_ms: LEASE,
            items,
        };
        match self.at(log_ms, cmd) {
            Response::Appended(out) => out,
            r => panic!("{r:?}"),
        }
    }
    fn at(&mut self, log_ms: u64, cmd: Command) -> Response {
        self.s.apply(&Request::new(log_ms, cmd), &mut self.changes)
    }
    fn submit(&mut self, t: u64, rid: &str) -> GenerationId {
        match self.at(
            t,
            Command::Submit {
                tenant: "a".into(),
                request_id: rid.into(),
                binding: binding(),
            },
        ) {
            Response::Submitted { generation, .. } => generation.id,
            r => panic!("submit failed: {r:?}"),
        }
    }
    fn acquire(&mut self, t: u64, g: GenerationId, dec: &str) -> Result<GenerationView, Rejection> {
        let cmd = Command::Acquire {
            generation: g,
            decoder: dec.into(),
            lease_ms: LEASE,
            model: model(),
            rng_version: 0,
        };
        match self.at(t, cmd) {
            Response::Ownership(r) => r,
            r => panic!("{r:?}"),
        }
    }
    fn append(
        &mut self,
        t: u64,
        g: GenerationId,
        dec: &str,
        epoch: Epoch,
        start: Seq,
        toks: &[u32],
    ) -> Result<AppendedLease, Rejection> {
        let item = AppendItem {
            generation: g,
            epoch,
            start_seq: start,
            token_ids: toks.to_vec(),
            finish: None,
        };
        self.append_items(t, dec, vec![item]).remove(0).result
    }
    fn ownership(&mut self, t: u64, cmd: Command) -> Result<GenerationView, Rejection> {
        match self.at(t, cmd) {
            Response::Ownership(r) => r,
            r => panic!("{r:?}"),
        }
    }
    /// Finishes `g` with `Stop` at `epoch`.
    fn finish(&mut self, t: u64, g: GenerationId, epoch: Epoch) -> Result<GenerationView, Rejection> {
        self.ownership(
            t,
            Command::Finish {
                generation: g,
                epoch,
                reason: FinishReason::Stop,
                detail: String::new(),
            },
        )
    }
    fn gen(&self, g: GenerationId) -> &Generation {
        &self.s.generations[&g]
    }
    /// Registers decoder `dec` for `m` (handoff listener `addr`, empty: none) for 60 s.
    fn register(&mut self, t: u64, dec: &str, addr: &str, m: ModelIdentity) {
        let info = DecoderInfo {
            model_name: "m".into(),
            model: m,
            capacity: 4,
            handoff_addr: addr.into(),
            ..Default::default()
        };
        let r = self.at(
            t,
            Command::RegisterDecoder {
                decoder: dec.into(),
                info,
                ttl_ms: 60_000,
            },
        );
        assert!(matches!(r, Response::Registered(Ok(_))), "{r:?}");
    }
}

fn reason<T: std::fmt::Debug>(r: Result<T, Rejection>) -> RejectReason {
    r.expect_err("expected a rejection").reason
}

mod fencing;
mod handoff;
mod pipeline;
mod standby;
mod upkeep;

#[test]
fn submit_is_idempotent_and_conflicts_on_other_binding() {
    let mut t = T::new();
    let g = t.submit(10, "r1");
    let again = t.at(
        20,
        Command::Submit {
            tenant: "a".into(),
            request_id: "r1".into(),
            binding: binding(),
        },
    );
    assert!(matches!(again, Response::Submitted { created: false, ref generation } if generation.id == g));
    assert_eq!(t.s.generations.len(), 1);

    let mut other = binding();
    other.sampling.seed = 9;
    let conflict = t.at(
        30,
        Command::Submit {
            tenant: "a".into(),
            request_id: "r1".into(),
            binding: other.clone(),
        },
    );
    assert!(matches!(
        conflict,
        Response::Ownership(Err(Rejection {
            reason: RejectReason::BindingConflict,
            ..
        }))
    ));
    // Another tenant may use the same request id.
    let b = t.at(
        40,
        Command::Submit {
            tenant: "b".into(),
            request_id: "r1".into(),
            binding: other,
        },
    );
    assert!(matches!(b, Response::Submitted { created: true, ref generation } if generation.id != g));
}

#[test]
fn submit_validates_limits_and_input() {
    let mut t = T::new();
    let mut big = binding();
    big.prompt_token_ids = vec![0; PROMPT_TOKENS_MAX + 1];
    let long_id = "x".repeat(REQUEST_ID_BYTES_MAX + 1);
    let mut both = binding();
    both.prompt_text = "hi".into();
    let mut zero = binding();
    zero.stop.max_tokens = 0;
    let mut nan = binding();
    nan.sampling.temperature = f32::NAN;
    for (rid, b, want) in [
        ("r", big, RejectReason::Limit),
        (long_id.as_str(), binding(), RejectReason::Limit),
        ("r", both, RejectReason::Invalid),
        ("r", zero, RejectReason::Limit),
        ("r", nan, RejectReason::Invalid),
        ("", binding(), RejectReason::Invalid),
    ] {
        let r = t.at(
            1,
            Command::Submit {
                tenant: "a".into(),
                request_id: rid.into(),
                binding: b,
            },
        );
        assert!(
            matches!(r, Response::Ownership(Err(ref e)) if e.reason == want),
            "{r:?}"
        );
    }
    assert!(t.s.generations.is_empty());
}

#[test]
fn log_time_never_goes_backwards() {
    let mut t = T::new();
    let g = t.submit(5_000, "r");
    t.acquire(5_000, g, "d1").unwrap(); // lease to 6_000
                                        // A new leader with a slow clock stamps 100: log time stays at 5_000, so the lease is live.
    assert_eq!(reason(t.acquire(100, g, "d2")), RejectReason::LeaseHeld);
    assert_eq!(t.s.log_ms, 5_000);
}

#[test]
fn apply_is_deterministic() {
    let script = |t: &mut T| {
        let g = t.submit(3, "x");
        t.acquire(4, g, "d").unwrap();
        t.append(5, g, "d", 1, 0, &[1, 2, 3]).unwrap();
        t.acquire(2_000, g, "e").unwrap();
        t.append(2_001, g, "e", 2, 3, &[4]).unwrap();
    };
    let (mut a, mut b) = (T::new(), T::new());
    script(&mut a);
    script(&mut b);
    assert_eq!(a.s, b.s);
    assert_eq!(a.changes, b.changes);
}

/// A `Batch` entry applies its commands in order at one log time: same answers and same state
/// as the same commands applied one by one at that time; fencing stays per command; a nested
/// batch is refused alone.
#[test]
fn a_batch_applies_like_its_commands_one_by_one() {
    let prefix = |t: &mut T| {
        let g = t.submit(10, "r1");
        t.acquire(11, g, "d1").unwrap();
        g
    };
    let append = |g, epoch, start, toks: &[u32]| Command::Append {
        decoder: "d1".into(),
        lease_ms: LEASE,
        items: vec![AppendItem {
            generation: g,
            epoch,
            start_seq: start,
            token_ids: toks.to_vec(),
            finish: None,
        }],
    };
    let cmds = |g| {
        vec![
            append(g, 1, 0, &[5, 6]),
            append(g, 7, 2, &[9]), // stale epoch: rejected, the rest goes on
            Command::Submit {
                tenant: "a".into(),
                request_id: "r2".into(),
                binding: binding(),
            },
            append(g, 1, 2, &[7]),
            Command::Batch(vec![]),
        ]
    };
    let mut one = T::new();
    let g = prefix(&mut one);
    let singles: Vec<Response> = cmds(g)
        .into_iter()
        .map(|c| match c {
            Command::Batch(_) => Response::Ownership(Err(reject(
                RejectReason::Invalid,
                "a batch inside a batch is not applied",
            ))),
            c => one.at(20, c),
        })
        .collect();
    let mut batched = T::new();
    let g2 = prefix(&mut batched);
    assert_eq!(g, g2);
    let r = batched.at(20, Command::Batch(cmds(g)));
    assert_eq!(r, Response::Batch(singles.clone()));
    assert_eq!(one.s, batched.s, "same state");
    assert!(matches!(&singles[1], Response::Appended(v) if v[0].result.is_err()));
    assert_eq!(batched.gen(g).records.len(), 3);
}

/// What is refused before a command is proposed: one too large for an entry, and strings the
/// log would keep for good past their bounds (a model identity's fields, a chat template).
#[test]
fn precheck_refuses_oversized_commands_and_unbounded_strings() {
    let append = |n: usize| Command::Append {
        decoder: "d".into(),
        lease_ms: LEASE,
        items: vec![AppendItem {
            generation: 1,
            epoch: 1,
            start_seq: 0,
            token_ids: vec![7; n],
            finish: None,
        }],
    };
    assert_eq!(precheck(&append(4_096)), Ok(()));
    let e = precheck(&append(5_000_000)).unwrap_err();
    assert_eq!(e.reason, RejectReason::Limit, "{e:?}");
    assert!(e.message.contains("a command of 20000"), "{}", e.message);
    let register = |template: usize, arch: usize| Command::RegisterDecoder {
        decoder: "d".into(),
        info: DecoderInfo {
            model_name: "m".into(),
            model: ModelIdentity {
                architecture: "a".repeat(arch),
                ..model()
            },
            chat_template: "t".repeat(template),
            ..Default::default()
        },
        ttl_ms: 1_000,
    };
    assert_eq!(precheck(&register(CHAT_TEMPLATE_BYTES_MAX, 5)), Ok(()));
    assert_eq!(
        precheck(&register(CHAT_TEMPLATE_BYTES_MAX + 1, 5)).unwrap_err().reason,
        RejectReason::Limit
    );
    assert_eq!(
        precheck(&register(10, MODEL_IDENTITY_FIELD_BYTES_MAX + 1))
            .unwrap_err()
            .reason,
        RejectReason::Limit
    );
    let mut b = binding();
    b.model.dtype_class = "q".repeat(MODEL_IDENTITY_FIELD_BYTES_MAX + 1);
    let submit = Command::Submit {
        tenant: "t".into(),
        request_id: "r".into(),
        binding: b,
    };
    assert_eq!(precheck(&submit).unwrap_err().reason, RejectReason::Limit);
    assert_eq!(
        precheck(&Command::Batch(vec![append(1), submit])).unwrap_err().reason,
        RejectReason::Limit
    );
    // What `apply` refuses of a submit without the state is refused before it is proposed: a
    // prompt text of 16 MiB is within the command bound, and every replica stored it first.
    let mut b = binding();
    b.prompt_token_ids.clear();
    b.prompt_text = "a".repeat(16 << 20);
    let submit = |tenant: &str, binding: Binding| Command::Submit {
        tenant: tenant.into(),
        request_id: "r".into(),
        binding,
    };
    assert_eq!(precheck(&submit("t", b)).unwrap_err().reason, RejectReason::Limit);
    let mut b = binding();
    b.stop.max_tokens = 0;
    assert_eq!(precheck(&submit("t", b)).unwrap_err().reason, RejectReason::Limit);
    assert_eq!(
        precheck(&submit("", binding())).unwrap_err().reason,
        RejectReason::Invalid
    );
    assert_eq!(
        precheck(&Command::Batch(vec![append(1), submit("", binding())]))
            .unwrap_err()
            .reason,
        RejectReason::Invalid
    );
    assert_eq!(precheck(&submit("t", binding())), Ok(()));
}

/// A Watch event never says a generation ended while records before its frontier are not in
/// it: with a sealed generation's records moved to disk (a snapshot build, between a Watch's
/// two reads of the state), `next_event` from seq 1 gave the terminal info with no records, and
/// the client's stream ended two records short.
#[test]
fn a_watch_event_is_terminal_only_at_the_frontier() {
    let mut t = T::new();
    let g = t.submit(10, "r1");
    let epoch = t.acquire(20, g, "d1").unwrap().lease.epoch;
    t.append(30, g, "d1", epoch, 0, &[5, 6, 7]).unwrap();
    t.finish(40, g, epoch).unwrap();
    let (e, next) = crate::service::next_event(t.gen(g), 1);
    let e = e.expect("records 1 and 2, and the end");
    assert_eq!((e.records.len(), next), (2, 3));
    assert!(e.terminal.is_some());
    // The same generation with its records on disk only.
    let mut on_disk = t.gen(g).clone();
    on_disk.cold = Some(ColdRef {
        segment: 1,
        offset: 0,
        bytes: 64,
        crc: 0,
        records: 3,
    });
    on_disk.records.clear();
    assert!(on_disk.on_disk_only());
    let (e, next) = crate::service::next_event(&on_disk, 1);
    assert!(e.is_none(), "{e:?}");
    assert_eq!(next, 1);
}

/// A PendingWork answer fits one message however long the pending generations' prompts are:
/// it is cut at `PENDING_WORK_BYTES_MAX` (at least one listed). Before, 300 generations with a
/// whole prompt's text made an answer of ~79 MB, which no message carries: every
/// decoder's poll failed for as long as the backlog lasted.
#[test]
fn a_pending_work_answer_fits_a_message_however_long_the_prompts() {
    let mut t = T::new();
    let mut b = binding();
    b.prompt_text = "p".repeat(PROMPT_TEXT_BYTES_MAX);
    b.prompt_token_ids = Vec::new();
    for i in 0..300 {
        let r = t.at(
            1,
            Command::Submit {
                tenant: "a".into(),
                request_id: format!("long-{i}"),
                binding: b.clone(),
            },
        );
        assert!(matches!(r, Response::Submitted { .. }), "{r:?}");
    }
    let ask = |limit: u32| {
        let r = tokenlog_proto::raftlog::PendingWorkRequest {
            model: Some(model().into()),
            limit,
            decoder_id: "d".into(),
            ..Default::default()
        };
        crate::service::pending(&t.s, r, 2).unwrap()
    };
    let all = ask(1_024);
    let bytes = prost::Message::encoded_len(&all);
    assert!(bytes <= PENDING_WORK_BYTES_MAX, "{bytes}");
    assert!(
        all.generations.len() >= 10 && all.generations.len() < 300,
        "{}",
        all.generations.len()
    );
    assert_eq!(ask(1).generations.len(), 1);
}
