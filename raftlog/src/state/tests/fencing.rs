//! Ownership and appends: grants, the epoch fence, leases in log time, records and finishes.

use super::*;

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
    assert_eq!(gen.chain_head, chain::head(g, &gen.records.as_slice()));
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
    assert!(matches!(t.at(2, cmd.clone()), Response::Appended(ref v) if v[0].result.is_ok() && v[0].frontier == 2));
    // Until it is sealed: then the same retry is refused without a look at the records (a node
    // may keep them on disk only), the same on every replica.
    let sealed_at = 1 + crate::limits::SEAL_AFTER_MS;
    assert!(matches!(t.at(sealed_at - 1, cmd.clone()), Response::Appended(ref v) if v[0].result.is_ok()));
    assert!(t.gen(g).sealed(sealed_at) && !t.gen(g).sealed(sealed_at - 1));
    match t.at(sealed_at, cmd) {
        Response::Appended(v) => {
            let e = v[0].result.clone().unwrap_err();
            assert_eq!((e.reason, v[0].frontier), (RejectReason::Terminal, 2), "{e:?}");
        }
        r => panic!("{r:?}"),
    }
}

/// An append's finish of a generation that already ended otherwise (cancelled, or finished
/// with another reason) is refused, not acknowledged: its owner was told it had ended it so.
#[test]
fn a_finish_of_a_generation_that_ended_otherwise_is_refused() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(0, g, "d1").unwrap();
    t.append(1, g, "d1", 1, 0, &[4, 5]).unwrap();
    let cancel = Command::Cancel {
        tenant: "a".into(),
        request_id: "r".into(),
    };
    assert_eq!(t.ownership(2, cancel).unwrap().state, GenState::Cancelled);
    let finish = |reason| Command::Append {
        decoder: "d1".into(),
        lease_ms: LEASE,
        items: vec![AppendItem {
            generation: g,
            epoch: 1,
            start_seq: 2,
            token_ids: vec![],
            finish: Some((reason, String::new())),
        }],
    };
    for reason in [FinishReason::Stop, FinishReason::Length] {
        match t.at(3, finish(reason)) {
            Response::Appended(v) => {
                let e = v[0].result.clone().expect_err("a finish of a cancelled generation");
                assert_eq!(e.reason, RejectReason::Terminal, "{reason:?}: {e:?}");
            }
            r => panic!("{r:?}"),
        }
    }
    assert_eq!(t.gen(g).finish_reason, Some(FinishReason::Cancelled));
}

/// A finish that ends the generation behind its committed frontier (a re-send of fewer
/// records than were committed, with a finish) is refused. It used to slice past the item's
/// tokens in `apply`: a panic on every replica and, since the entry stays in the log, again
/// at every restart (a crash loop of the whole cluster from one request of an owner).
#[test]
fn a_finish_behind_the_frontier_is_refused_not_a_panic() {
    let mut t = T::new();
    let g = t.submit(0, "r");
    t.acquire(0, g, "d1").unwrap();
    t.append(1, g, "d1", 1, 0, &[4, 5, 6, 7, 8]).unwrap();
    let finish = |start_seq: u32, token_ids: &[u32]| Command::Append {
        decoder: "d1".into(),
        lease_ms: LEASE,
        items: vec![AppendItem {
            generation: g,
            epoch: 1,
            start_seq,
            token_ids: token_ids.to_vec(),
            finish: Some((FinishReason::Stop, String::new())),
        }],
    };
    for (start_seq, token_ids) in [(0, vec![]), (0, vec![4, 5]), (2, vec![6]), (4, vec![])] {
        match t.at(2, finish(start_seq, &token_ids)) {
            Response::Appended(v) => {
                let e = v[0].result.clone().unwrap_err();
                assert_eq!(
                    (e.reason, v[0].frontier),
                    (RejectReason::SeqMismatch, 5),
                    "{start_seq} {token_ids:?}: {e:?}"
                );
            }
            r => panic!("{r:?}"),
        }
        assert_eq!((t.gen(g).state, t.gen(g).frontier()), (GenState::Running, 5));
    }
    // At the frontier it finishes (with or without the last records re-sent).
    assert!(
        matches!(t.at(3, finish(3, &[7, 8])), Response::Appended(ref v) if v[0].result.is_ok() && v[0].frontier == 5)
    );
    assert_eq!(t.gen(g).state, GenState::Finished);
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
    let out = t.append_items(5, "d1", items);
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
    let out = t.append_items(6, "d1", dup);
    assert_eq!(
        out[0].result,
        Ok(AppendedLease {
            epoch: 1,
            expiry_log_ms: 6 + LEASE
        })
    );
    assert_eq!(out[1].result.as_ref().unwrap_err().reason, RejectReason::Invalid);
    assert_eq!(
        (out[0].frontier, out[1].frontier),
        (2, 2),
        "the frontier after the item"
    );
    // A repeat that is not next to its first: only the repeat is refused.
    let item = |generation, start_seq| AppendItem {
        generation,
        epoch: 1,
        start_seq,
        token_ids: vec![3],
        finish: None,
    };
    let out = t.append_items(7, "d1", vec![item(a, 2), item(77, 0), item(a, 3)]);
    assert!(out[0].result.is_ok());
    assert_eq!(out[1].result.as_ref().unwrap_err().reason, RejectReason::NotFound);
    assert_eq!(out[2].result.as_ref().unwrap_err().reason, RejectReason::Invalid);
    assert_eq!((out[0].frontier, out[1].frontier, out[2].frontier), (3, 0, 3));
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

/// Issue 11 bug 8: a generation taken over again and again keeps a bounded audit trail (the
/// newest grants), and its takeover count stays exact.
#[test]
fn grants_are_bounded_and_takeovers_stay_exact() {
    let mut t = T::new();
    let g = t.submit(0, "churn");
    let n = GRANTS_KEPT_MAX as u64 + 5;
    for i in 0..n {
        let v = t.acquire(i * (LEASE + 1), g, &format!("d{i}")).unwrap();
        assert_eq!(v.lease.epoch, i + 1);
    }
    let gen = t.gen(g);
    assert_eq!(gen.grants.len(), GRANTS_KEPT_MAX);
    assert_eq!(gen.takeovers(), n - 1);
    assert_eq!(gen.grants.last().unwrap().epoch, n, "the newest grant is kept");
    assert_eq!(gen.grants[0].epoch, n - GRANTS_KEPT_MAX as u64 + 1);
    assert_eq!(t.s.index.takeovers(), n - 1);
}

/// Instant crash detection: a lost session ends its decoder's live leases at once (another
/// decoder acquires with no wait), and only those; the old owner is fenced; a stale session
/// (the decoder opened another since) changes nothing.
#[test]
fn a_lost_session_ends_only_its_decoders_live_leases_and_a_stale_one_nothing() {
    let mut t = T::new();
    let session = |t: &mut T, at, cmd| match t.at(at, cmd) {
        Response::Session(r) => r,
        r => panic!("{r:?}"),
    };
    let opened = |d: &str, s| Command::SessionOpened {
        decoder: d.into(),
        session: s,
    };
    let lost = |d: &str, s| Command::SessionLost {
        decoder: d.into(),
        session: s,
    };
    let (a1, a2, b, done) = (
        t.submit(0, "a1"),
        t.submit(0, "a2"),
        t.submit(0, "b"),
        t.submit(0, "done"),
    );
    assert_eq!(session(&mut t, 1, opened("a", 7)), Ok(0));
    assert_eq!(session(&mut t, 1, opened("b", 9)), Ok(0));
    for (g, d) in [(a1, "a"), (a2, "a"), (b, "b"), (done, "a")] {
        t.acquire(2, g, d).unwrap();
    }
    t.append(3, a1, "a", 1, 0, &[5, 6]).unwrap();
    t.finish(3, done, 1).unwrap();
    // The lease (1 s) is live: another decoder is refused.
    assert_eq!(reason(t.acquire(10, a1, "c")), RejectReason::LeaseHeld);
    // A stale session of `a` (it reconnected as 7 after 6): nothing happens.
    assert_eq!(session(&mut t, 10, lost("a", 6)), Ok(0));
    assert_eq!(reason(t.acquire(10, a1, "c")), RejectReason::LeaseHeld);
    // Its current session is lost: both its live leases end, not `b`'s, not the finished one.
    assert_eq!(session(&mut t, 11, lost("a", 7)), Ok(2));
    assert!(!t.s.sessions.contains_key("a") && t.s.sessions.contains_key("b"));
    for g in [a1, a2] {
        assert_eq!(t.gen(g).state, GenState::Pending);
        assert!(t.gen(g).lease.owner.is_empty());
    }
    assert_eq!(t.gen(b).lease.owner, "b");
    assert_eq!(t.gen(done).state, GenState::Finished);
    // `a`, still alive behind a broken connection, is fenced at its old epoch.
    assert!(t.append(12, a1, "a", 1, 2, &[7]).is_err());
    // Another decoder takes over at once, with the committed frontier.
    let v = t.acquire(12, a1, "c").unwrap();
    assert_eq!((v.lease.epoch, v.frontier), (2, 2));
    assert_eq!(reason(t.acquire(12, b, "c")), RejectReason::LeaseHeld);
    // The same loss delivered again: the session is gone, nothing more ends.
    assert_eq!(session(&mut t, 13, lost("a", 7)), Ok(0));
    assert_eq!(t.gen(a1).lease.owner, "c");
    // Malformed sessions are refused.
    assert_eq!(reason(session(&mut t, 14, opened("", 1))), RejectReason::Invalid);
    assert_eq!(reason(session(&mut t, 14, opened("x", 0))), RejectReason::Invalid);
}
