//! Pure apply tests: no I/O, no clock. Each test drives `LogState::apply` with stamped commands.

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
    fn at(&mut self, log_ms: u64, cmd: Command) -> Response {
        self.s.apply(&Request { log_ms, cmd }, &mut self.changes)
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
    ) -> Result<Lease, Rejection> {
        let item = AppendItem {
            generation: g,
            epoch,
            start_seq: start,
            token_ids: toks.to_vec(),
            finish: None,
        };
        match self.at(
            t,
            Command::Append {
                decoder: dec.into(),
                lease_ms: LEASE,
                items: vec![item],
            },
        ) {
            Response::Appended(mut v) => v.remove(0).result,
            r => panic!("{r:?}"),
        }
    }
    fn ownership(&mut self, t: u64, cmd: Command) -> Result<GenerationView, Rejection> {
        match self.at(t, cmd) {
            Response::Ownership(r) => r,
            r => panic!("{r:?}"),
        }
    }
    fn gen(&self, g: GenerationId) -> &Generation {
        &self.s.generations[&g]
    }
}

fn reason<T: std::fmt::Debug>(r: Result<T, Rejection>) -> RejectReason {
    r.expect_err("expected a rejection").reason
}

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
fn acquire_grants_next_epoch_and_refuses_held_lease() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    let v = t.acquire(100, g, "d1").unwrap();
    assert_eq!(
        (v.lease.epoch, v.lease.expiry_log_ms, v.state),
        (1, 1_100, GenState::Running)
    );
    // Same owner retrying: same epoch.
    assert_eq!(t.acquire(200, g, "d1").unwrap().lease.epoch, 1);
    assert_eq!(reason(t.acquire(200, g, "d2")), RejectReason::LeaseHeld);
    // Expiry is by log time: at 1_100 the lease is over.
    let v = t.acquire(1_100, g, "d2").unwrap();
    assert_eq!((v.lease.epoch, v.lease.owner.as_str(), v.takeovers), (2, "d2", 1));
}

#[test]
fn acquire_refuses_other_model_or_rng() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    let mut other = model();
    other.tokenizer_sha256 = "other".into();
    let cmd = Command::Acquire {
        generation: g,
        decoder: "d".into(),
        lease_ms: LEASE,
        model: other,
        rng_version: 0,
    };
    assert_eq!(reason(t.ownership(1, cmd)), RejectReason::ModelMismatch);
    let cmd = Command::Acquire {
        generation: g,
        decoder: "d".into(),
        lease_ms: LEASE,
        model: model(),
        rng_version: 7,
    };
    assert_eq!(reason(t.ownership(1, cmd)), RejectReason::ModelMismatch);
    assert_eq!(reason(t.acquire(1, 999, "d")), RejectReason::NotFound);
}

#[test]
fn append_extends_frontier_and_chain() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(10, g, "d1").unwrap();
    let lease = t.append(20, g, "d1", 1, 0, &[5, 6]).unwrap();
    assert_eq!(lease.expiry_log_ms, 1_020, "append renews the lease");
    t.append(30, g, "d1", 1, 2, &[7]).unwrap();
    let gen = t.gen(g);
    assert_eq!(
        gen.records.iter().map(|r| r.token_id).collect::<Vec<_>>(),
        vec![5, 6, 7]
    );
    assert_eq!(gen.chain_head, chain::head(g, &gen.records));
    assert_eq!(t.changes.new_records.len(), 3);
    assert_eq!(t.changes.new_records[2].2, gen.chain_head);
}

#[test]
fn append_with_gap_is_rejected() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(10, g, "d1").unwrap();
    t.append(20, g, "d1", 1, 0, &[5]).unwrap();
    let e = t.append(30, g, "d1", 1, 2, &[7]).unwrap_err();
    assert_eq!(
        (e.reason, e.frontier, e.current_epoch),
        (RejectReason::SeqMismatch, 1, 1)
    );
}

#[test]
fn identical_resend_is_acknowledged_and_conflicting_one_rejected() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(10, g, "d1").unwrap();
    t.append(20, g, "d1", 1, 0, &[5, 6]).unwrap();
    let before = t.gen(g).clone();
    t.append(30, g, "d1", 1, 0, &[5, 6]).unwrap();
    t.append(30, g, "d1", 1, 1, &[6]).unwrap();
    assert_eq!(t.gen(g).records, before.records, "a re-send adds nothing");
    assert_eq!(
        reason(t.append(40, g, "d1", 1, 0, &[5, 9])),
        RejectReason::RecordConflict
    );
    // Overlapping re-send with new tail: the overlap must match, the tail is appended.
    t.append(50, g, "d1", 1, 1, &[6, 7]).unwrap();
    assert_eq!(t.gen(g).frontier(), 3);
}

#[test]
fn stale_epoch_after_takeover_is_rejected_everywhere() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(10, g, "old").unwrap();
    t.append(20, g, "old", 1, 0, &[5]).unwrap();
    // The old owner pauses; its lease (till 1_020) expires; a new owner takes over.
    t.acquire(2_000, g, "new").unwrap();
    t.append(2_010, g, "new", 2, 1, &[6]).unwrap();
    // The old owner wakes up: every write it tries is fenced.
    let e = t.append(2_020, g, "old", 1, 1, &[9]).unwrap_err();
    assert_eq!(
        (e.reason, e.current_epoch, e.frontier),
        (RejectReason::StaleEpoch, 2, 2)
    );
    // Even an identical re-send of what it wrote is refused at a stale epoch.
    assert_eq!(reason(t.append(2_020, g, "old", 1, 0, &[5])), RejectReason::StaleEpoch);
    let renew = Command::Renew {
        generation: g,
        epoch: 1,
        decoder: "old".into(),
        lease_ms: LEASE,
    };
    assert_eq!(reason(t.ownership(2_030, renew)), RejectReason::StaleEpoch);
    let fin = Command::Finish {
        generation: g,
        epoch: 1,
        reason: FinishReason::Stop,
        detail: String::new(),
    };
    assert_eq!(reason(t.ownership(2_030, fin)), RejectReason::StaleEpoch);
    assert_eq!(
        reason(t.ownership(
            2_030,
            Command::Release {
                generation: g,
                epoch: 1
            }
        )),
        RejectReason::StaleEpoch
    );
    // Same epoch number but another decoder: also stale.
    assert_eq!(reason(t.append(2_040, g, "old", 2, 2, &[9])), RejectReason::StaleEpoch);
    assert_eq!(
        t.gen(g)
            .records
            .iter()
            .map(|r| (r.token_id, r.epoch))
            .collect::<Vec<_>>(),
        vec![(5, 1), (6, 2)]
    );
}

#[test]
fn lease_expiry_by_log_time_fences_the_owner_even_without_takeover() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(0, g, "d1").unwrap();
    t.append(999, g, "d1", 1, 0, &[1]).unwrap(); // live at 999; renews to 1_999
    assert_eq!(reason(t.append(1_999, g, "d1", 1, 1, &[2])), RejectReason::LeaseExpired);
    let renew = Command::Renew {
        generation: g,
        epoch: 1,
        decoder: "d1".into(),
        lease_ms: LEASE,
    };
    assert_eq!(reason(t.ownership(2_500, renew)), RejectReason::LeaseExpired);
}

#[test]
fn slow_but_renewing_owner_keeps_its_lease() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(0, g, "slow").unwrap();
    for i in 1..20u64 {
        let renew = Command::Renew {
            generation: g,
            epoch: 1,
            decoder: "slow".into(),
            lease_ms: LEASE,
        };
        t.ownership(i * 900, renew).unwrap();
        assert_eq!(reason(t.acquire(i * 900 + 1, g, "thief")), RejectReason::LeaseHeld);
    }
    t.append(18_000, g, "slow", 1, 0, &[3]).unwrap();
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
fn finish_release_cancel() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(0, g, "d1").unwrap();
    let v = t
        .ownership(
            10,
            Command::Release {
                generation: g,
                epoch: 1,
            },
        )
        .unwrap();
    assert_eq!(v.state, GenState::Pending);
    assert_eq!(
        t.ownership(
            11,
            Command::Release {
                generation: g,
                epoch: 1
            }
        )
        .unwrap()
        .state,
        GenState::Pending,
        "retried release"
    );
    assert_eq!(
        t.acquire(12, g, "d2").unwrap().lease.epoch,
        2,
        "released: taken at once"
    );
    let fin = Command::Finish {
        generation: g,
        epoch: 2,
        reason: FinishReason::Length,
        detail: String::new(),
    };
    assert_eq!(t.ownership(20, fin.clone()).unwrap().state, GenState::Finished);
    assert_eq!(
        t.ownership(21, fin).unwrap().state,
        GenState::Finished,
        "retried finish"
    );
    assert_eq!(reason(t.append(22, g, "d2", 2, 0, &[1])), RejectReason::Terminal);
    assert_eq!(reason(t.acquire(23, g, "d3")), RejectReason::Terminal);
    let cancel = Command::Cancel {
        tenant: "a".into(),
        request_id: "r".into(),
    };
    assert_eq!(reason(t.ownership(24, cancel)), RejectReason::Terminal);

    let g2 = t.submit(30, "r2");
    t.acquire(30, g2, "d1").unwrap();
    let cancel = Command::Cancel {
        tenant: "a".into(),
        request_id: "r2".into(),
    };
    assert_eq!(t.ownership(31, cancel.clone()).unwrap().state, GenState::Cancelled);
    assert_eq!(
        t.ownership(32, cancel).unwrap().state,
        GenState::Cancelled,
        "idempotent"
    );
    assert_eq!(reason(t.append(33, g2, "d1", 1, 0, &[1])), RejectReason::Terminal);
    let missing = Command::Cancel {
        tenant: "b".into(),
        request_id: "r2".into(),
    };
    assert_eq!(reason(t.ownership(34, missing)), RejectReason::NotFound);
}

#[test]
fn append_with_finish_and_retry_of_it() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(0, g, "d1").unwrap();
    let item = AppendItem {
        generation: g,
        epoch: 1,
        start_seq: 0,
        token_ids: vec![4, 5],
        finish: Some((FinishReason::Stop, String::new())),
    };
    let cmd = Command::Append {
        decoder: "d1".into(),
        lease_ms: LEASE,
        items: vec![item],
    };
    assert!(matches!(t.at(1, cmd.clone()), Response::Appended(ref v) if v[0].result.is_ok()));
    assert_eq!(t.gen(g).state, GenState::Finished);
    assert!(matches!(t.at(2, cmd), Response::Appended(ref v) if v[0].result.is_ok() && v[0].frontier == 2));
}

#[test]
fn max_tokens_is_enforced() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(0, g, "d1").unwrap();
    assert_eq!(reason(t.append(1, g, "d1", 1, 0, &[0; 17])), RejectReason::Limit);
    t.append(1, g, "d1", 1, 0, &[0; 16]).unwrap();
}

#[test]
fn many_generations_in_one_append_are_independent() {
    let mut t = T::new();
    let (a, b) = (t.submit(0, "a"), t.submit(0, "b"));
    t.acquire(0, a, "d1").unwrap();
    t.acquire(0, b, "d2").unwrap();
    let items = vec![
        AppendItem {
            generation: a,
            epoch: 1,
            start_seq: 0,
            token_ids: vec![1],
            finish: None,
        },
        AppendItem {
            generation: b,
            epoch: 1,
            start_seq: 0,
            token_ids: vec![2],
            finish: None,
        },
        AppendItem {
            generation: 77,
            epoch: 1,
            start_seq: 0,
            token_ids: vec![2],
            finish: None,
        },
    ];
    let Response::Appended(out) = t.at(
        5,
        Command::Append {
            decoder: "d1".into(),
            lease_ms: LEASE,
            items,
        },
    ) else {
        panic!()
    };
    assert!(out[0].result.is_ok());
    assert_eq!(
        out[1].result.as_ref().unwrap_err().reason,
        RejectReason::StaleEpoch,
        "b belongs to d2"
    );
    assert_eq!(out[2].result.as_ref().unwrap_err().reason, RejectReason::NotFound);
    let dup = vec![
        AppendItem {
            generation: a,
            epoch: 1,
            start_seq: 1,
            token_ids: vec![1],
            finish: None,
        },
        AppendItem {
            generation: a,
            epoch: 1,
            start_seq: 2,
            token_ids: vec![1],
            finish: None,
        },
    ];
    let Response::Appended(out) = t.at(
        6,
        Command::Append {
            decoder: "d1".into(),
            lease_ms: LEASE,
            items: dup,
        },
    ) else {
        panic!()
    };
    assert!(out[0].result.is_ok());
    assert_eq!(out[1].result.as_ref().unwrap_err().reason, RejectReason::Invalid);
}

#[test]
fn prompt_text_is_bound_once_before_records() {
    let mut t = T::new();
    let mut b = binding();
    b.prompt_token_ids.clear();
    b.prompt_text = "hello".into();
    let Response::Submitted { generation, .. } = t.at(
        0,
        Command::Submit {
            tenant: "a".into(),
            request_id: "r".into(),
            binding: b,
        },
    ) else {
        panic!()
    };
    let g = generation.id;
    t.acquire(0, g, "d1").unwrap();
    assert_eq!(
        reason(t.append(1, g, "d1", 1, 0, &[1])),
        RejectReason::Invalid,
        "no records before the prompt is bound"
    );
    let bind = |ids: Vec<u32>| Command::BindPrompt {
        generation: g,
        epoch: 1,
        prompt_token_ids: ids,
    };
    t.ownership(2, bind(vec![9, 9])).unwrap();
    t.ownership(3, bind(vec![9, 9])).unwrap();
    assert_eq!(reason(t.ownership(4, bind(vec![8]))), RejectReason::BindingConflict);
    t.append(5, g, "d1", 1, 0, &[1]).unwrap();
    // A retried submit of the same text request (found by the fault suite: a client that saw no
    // event yet submits again) is the same request, although the prompt is now tokenized.
    let mut same = binding();
    same.prompt_token_ids.clear();
    same.prompt_text = "hello".into();
    let Response::Submitted { generation, created } = t.at(
        6,
        Command::Submit {
            tenant: "a".into(),
            request_id: "r".into(),
            binding: same.clone(),
        },
    ) else {
        panic!("a retried text submit after BindPrompt must be idempotent")
    };
    assert_eq!((generation.id, created), (g, false));
    same.prompt_text = "other".into();
    let r = t.at(
        7,
        Command::Submit {
            tenant: "a".into(),
            request_id: "r".into(),
            binding: same,
        },
    );
    assert!(
        matches!(r, Response::Ownership(Err(ref j)) if j.reason == RejectReason::BindingConflict),
        "{r:?}"
    );
}

#[test]
fn tick_fails_past_deadline_and_prunes_after_retention() {
    let mut t = T::new();
    let mut b = binding();
    b.deadline_ms = 500;
    let Response::Submitted { generation, .. } = t.at(
        0,
        Command::Submit {
            tenant: "a".into(),
            request_id: "late".into(),
            binding: b,
        },
    ) else {
        panic!()
    };
    let late = generation.id;
    let done = t.submit(0, "done");
    t.acquire(0, done, "d").unwrap();
    t.ownership(
        1,
        Command::Finish {
            generation: done,
            epoch: 1,
            reason: FinishReason::Stop,
            detail: String::new(),
        },
    )
    .unwrap();
    assert!(!t.s.tick_due(400, 10_000));
    assert_eq!(
        t.at(400, Command::Tick { retention_ms: 10_000 }),
        Response::Ticked { failed: 0, pruned: 0 }
    );
    assert!(t.s.tick_due(500, 10_000));
    assert_eq!(
        t.at(500, Command::Tick { retention_ms: 10_000 }),
        Response::Ticked { failed: 1, pruned: 0 }
    );
    assert_eq!(t.gen(late).state, GenState::Failed);
    assert_eq!(
        t.at(10_001, Command::Tick { retention_ms: 10_000 }),
        Response::Ticked { failed: 0, pruned: 1 }
    );
    assert!(t.s.by_request("a", "done").is_none());
    assert_eq!(
        t.at(10_500, Command::Tick { retention_ms: 10_000 }),
        Response::Ticked { failed: 0, pruned: 1 }
    );
    assert!(t.s.generations.is_empty() && t.s.requests.is_empty());
}

#[test]
fn pending_work_lists_unowned_and_orphaned_of_the_model() {
    let mut t = T::new();
    let (a, b, c) = (t.submit(0, "a"), t.submit(0, "b"), t.submit(0, "c"));
    t.acquire(0, b, "d").unwrap();
    t.acquire(0, c, "d").unwrap();
    t.ownership(
        1,
        Command::Finish {
            generation: c,
            epoch: 1,
            reason: FinishReason::Stop,
            detail: String::new(),
        },
    )
    .unwrap();
    let ids = |now| {
        t.s.pending_work(&model(), now, 10)
            .iter()
            .map(|g| g.id)
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(500), vec![a]);
    assert_eq!(
        ids(1_000),
        vec![b, a],
        "b's lease expired: orphaned, listed before unowned work"
    );
    assert!(t.s.pending_work(&ModelIdentity::default(), 0, 10).is_empty());
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

#[test]
fn registrations_live_for_their_ttl_and_are_refreshed() {
    let mut t = T::new();
    let info = DecoderInfo {
        model_name: "m".into(),
        model: model(),
        capacity: 4,
        ..Default::default()
    };
    let reg = |info: &DecoderInfo| Command::Register {
        decoder: "d1".into(),
        info: info.clone(),
        ttl_ms: 1_000,
    };
    assert_eq!(t.at(0, reg(&info)), Response::Registered(Ok(1_000)));
    assert!(t.changes.decoders);
    assert_eq!(t.at(900, reg(&info)), Response::Registered(Ok(1_900)), "refreshed");
    assert!(!t.s.tick_due(1_899, 10_000));
    assert!(t.s.tick_due(1_900, 10_000));
    t.at(1_900, Command::Tick { retention_ms: 10_000 });
    assert!(t.s.decoders.is_empty());
    let bad = DecoderInfo {
        model_name: String::new(),
        ..info
    };
    assert!(matches!(
        t.at(2_000, reg(&bad)),
        Response::Registered(Err(Rejection {
            reason: RejectReason::Invalid,
            ..
        }))
    ));
}

/// Regression (issue: `persist` indexed `generations[id]` for the records of a generation pruned
/// in the same apply batch: a panic under the state lock, then the same panic on every restart).
/// The changes of a batch never name records, or metadata, of a generation the batch pruned.
#[test]
fn records_and_pruning_in_one_batch_leave_no_rows_of_the_pruned_generation() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(0, g, "d").unwrap();
    t.append(1, g, "d", 1, 0, &[5, 6]).unwrap();
    t.ownership(
        2,
        Command::Finish {
            generation: g,
            epoch: 1,
            reason: FinishReason::Stop,
            detail: String::new(),
        },
    )
    .unwrap();
    assert_eq!(
        t.at(2, Command::Tick { retention_ms: 0 }),
        Response::Ticked { failed: 0, pruned: 1 }
    );
    assert!(t.s.generations.is_empty());
    assert_eq!(t.changes.pruned.len(), 1);
    assert!(
        t.changes.new_records.iter().all(|(id, _, _)| *id != g),
        "records of a pruned generation left in the batch's changes: {:?}",
        t.changes.new_records
    );
    assert!(!t.changes.touched.contains(&g));
}

#[test]
fn pending_work_lists_a_generation_whose_owner_stopped_appending() {
    let mut t = T::new();
    let g = t.submit(0, "a");
    t.acquire(0, g, "d1").unwrap();
    t.append(100, g, "d1", 1, 0, &[1]).unwrap();
    t.at(
        150,
        Command::Renew {
            generation: g,
            epoch: 1,
            decoder: "d1".into(),
            lease_ms: LEASE,
        },
    );
    let ids = |t: &T, now| {
        t.s.pending_work(&model(), now, 10)
            .iter()
            .map(|g| g.id)
            .collect::<Vec<_>>()
    };
    assert!(ids(&t, 1_000).is_empty(), "lease live until 1150");
    assert_eq!(ids(&t, 1_150), vec![g]);
    t.acquire(1_200, g, "d2").unwrap();
    assert!(ids(&t, 1_300).is_empty());
}
