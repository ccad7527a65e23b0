//! Upkeep: ticks (deadlines, retention), pending work, registrations.

use super::*;

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
    t.finish(1, done, 1).unwrap();
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
fn registrations_live_for_their_ttl_and_are_refreshed() {
    let mut t = T::new();
    let info = DecoderInfo {
        model_name: "m".into(),
        model: model(),
        capacity: 4,
        ..Default::default()
    };
    let reg = |info: &DecoderInfo| Command::RegisterDecoder {
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

/// Retention 0 prunes a generation that the same tick failed (the indexes see the failure at
/// once), and every terminal generation even when the leader's clock is behind its finish.
#[test]
fn retention_zero_prunes_in_the_same_tick() {
    let mut t = T::new();
    let mut b = binding();
    b.deadline_ms = 500;
    t.at(
        0,
        Command::Submit {
            tenant: "a".into(),
            request_id: "late".into(),
            binding: b,
        },
    );
    assert_eq!(
        t.at(500, Command::Tick { retention_ms: 0 }),
        Response::Ticked { failed: 1, pruned: 1 }
    );
    let g = t.submit(600, "done");
    t.acquire(600, g, "d").unwrap();
    t.ownership(
        900,
        Command::Finish {
            generation: g,
            epoch: 1,
            reason: FinishReason::Stop,
            detail: String::new(),
        },
    )
    .unwrap();
    assert!(
        t.s.tick_due(800, 0),
        "a clock behind the finish still prunes with retention 0"
    );
    assert!(!t.s.tick_due(800, 1));
}

#[test]
fn a_new_leader_keeps_every_live_lease_the_time_it_had_left() {
    let mut t = T::new();
    let live = t.submit(0, "live");
    let lapsed = t.submit(0, "lapsed");
    t.acquire(0, lapsed, "d2").unwrap(); // lease ends at 1_000
    t.acquire(500, live, "d1").unwrap();
    t.append(1_200, live, "d1", 1, 0, &[1]).unwrap(); // ends at 2_200; `lapsed` ended at 1_000
                                                      // The leader dies; the next one's first entry comes 10 s of log time later.
    assert_eq!(
        t.at(11_200, Command::NewLeader),
        Response::LeasesExtended {
            leases: 1,
            by_ms: 10_000
        }
    );
    assert_eq!(t.gen(live).lease.expiry_log_ms, 12_200, "1 s was left; 1 s is left");
    assert_eq!(t.gen(lapsed).lease.expiry_log_ms, 1_000, "a lapsed lease stays lapsed");
    // The owner goes on without a takeover; the lapsed generation can be taken over.
    t.append(11_300, live, "d1", 1, 1, &[2]).unwrap();
    assert_eq!(reason(t.acquire(11_300, live, "d3")), RejectReason::LeaseHeld);
    assert_eq!(t.acquire(11_300, lapsed, "d3").unwrap().lease.epoch, 2);
    // A second announcement right after extends by the (zero) gap only.
    assert_eq!(
        t.at(11_300, Command::NewLeader),
        Response::LeasesExtended { leases: 0, by_ms: 0 }
    );
    // Without the announcement the same gap expires the lease: what an election did before.
    let mut u = T::new();
    let g = u.submit(0, "g");
    u.acquire(500, g, "d1").unwrap();
    u.append(1_200, g, "d1", 1, 0, &[1]).unwrap();
    assert_eq!(
        reason(u.append(11_200, g, "d1", 1, 1, &[2])),
        RejectReason::LeaseExpired
    );
}

/// Issue 11 bug 3: a generation with records whose owner is gone, and that no decoder takes,
/// ends FAILED once its unowned deadline passes (bound at submit); its prefix stays readable.
#[test]
fn a_generation_with_records_and_no_live_owner_fails_after_its_unowned_deadline() {
    let mut t = T::new();
    let g = t.submit(0, "orphan");
    t.acquire(0, g, "d").unwrap();
    t.append(10, g, "d", 1, 0, &[7, 8, 9]).unwrap();
    let expiry = t.gen(g).lease.expiry_log_ms;
    // Long after the owner's lease lapsed and every submit deadline passed: nobody took it.
    let late = expiry + 2 * DEADLINE_MS_MAX;
    assert!(t.s.tick_due(late, RETENTION_MS_DEFAULT), "the orphan must be due");
    assert_eq!(
        t.at(
            late,
            Command::Tick {
                retention_ms: RETENTION_MS_DEFAULT
            }
        ),
        Response::Ticked { failed: 1, pruned: 0 }
    );
    let gen = t.gen(g);
    assert_eq!(gen.state, GenState::Failed);
    assert_eq!(gen.finish_reason, Some(FinishReason::Error));
    assert!(gen.finish_detail.contains("no decoder"), "{}", gen.finish_detail);
    assert_eq!(gen.frontier(), 3, "the committed prefix stays");
}
/// The unowned deadline counts from the end of the last lease, not from submit: a generation
/// owned and written for longer than its unowned time stays, and a renewed one is never due.
#[test]
fn the_unowned_deadline_counts_from_the_last_lease_end() {
    let mut t = T::new();
    let mut b = binding();
    b.unowned_ms = 5_000;
    let Response::Submitted { generation, .. } = t.at(
        0,
        Command::Submit {
            tenant: "a".into(),
            request_id: "long".into(),
            binding: b,
        },
    ) else {
        panic!()
    };
    let g = generation.id;
    assert_eq!(t.gen(g).binding.unowned_ms, 5_000);
    t.acquire(0, g, "d").unwrap();
    // Written for 7.5 s (longer than its unowned time), each append renewing the lease.
    for (i, at) in (0..15u32).zip((500..).step_by(500)) {
        t.append(at, g, "d", 1, i, &[i]).unwrap();
    }
    let expiry = t.gen(g).lease.expiry_log_ms;
    assert!(!t.s.tick_due(expiry + 4_999, RETENTION_MS_DEFAULT));
    // Another decoder takes it over in time: the deadline moves with its lease.
    t.acquire(expiry + 4_000, g, "e").unwrap();
    let expiry = t.gen(g).lease.expiry_log_ms;
    assert!(!t.s.tick_due(expiry + 4_999, RETENTION_MS_DEFAULT));
    assert!(t.s.tick_due(expiry + 5_000, RETENTION_MS_DEFAULT));
    // A submit that asks for an unowned time shorter than a lease is refused.
    let mut bad = binding();
    bad.unowned_ms = LEASE_MS_MIN - 1;
    let r = t.at(
        1,
        Command::Submit {
            tenant: "a".into(),
            request_id: "bad".into(),
            binding: bad,
        },
    );
    assert!(
        matches!(r, Response::Ownership(Err(ref j)) if j.reason == RejectReason::Invalid),
        "{r:?}"
    );
}

/// The planted `no_unowned_deadline` is the behaviour before the fix (only generations without
/// a record had a deadline): there the orphan is never due and stays running forever, which is
/// what the regression test above fails on.
#[cfg(feature = "faults")]
#[test]
fn the_planted_missing_unowned_deadline_leaves_the_orphan_forever() {
    let mut t = T::new();
    t.s.faults.no_unowned_deadline = true;
    let g = t.submit(0, "orphan");
    t.acquire(0, g, "d").unwrap();
    t.append(10, g, "d", 1, 0, &[7, 8, 9]).unwrap();
    let late = t.gen(g).lease.expiry_log_ms + 2 * DEADLINE_MS_MAX;
    assert!(!t.s.tick_due(late, RETENTION_MS_DEFAULT));
    t.at(
        late,
        Command::Tick {
            retention_ms: RETENTION_MS_DEFAULT,
        },
    );
    assert!(!t.gen(g).state.is_terminal(), "{:?}", t.gen(g).state);
}

#[test]
fn a_tokenizer_is_published_once_per_digest_and_kept_through_ticks() {
    let mut t = T::new();
    let digest = "ab".repeat(32);
    let publish = |t: &mut T, digest: &str, bytes: &[u8]| match t.at(
        10,
        Command::PublishTokenizer {
            tokenizer_sha256: digest.into(),
            package: TokenizerPackage(bytes.to_vec()),
        },
    ) {
        Response::Published(r) => r,
        r => panic!("{r:?}"),
    };
    assert_eq!(publish(&mut t, &digest, b"pkg"), Ok(true));
    // The same bytes again (a restarted decoder, a retried request): no effect.
    assert_eq!(publish(&mut t, &digest, b"pkg"), Ok(false));
    // Other bytes under a digest already taken (another release's encoding): the first stays.
    assert_eq!(publish(&mut t, &digest, b"other"), Ok(false));
    assert_eq!(t.s.tokenizers[&digest], TokenizerPackage(b"pkg".to_vec()));
    // Malformed: not a digest, empty, too large.
    assert_eq!(publish(&mut t, "t", b"x").unwrap_err().reason, RejectReason::Invalid);
    assert_eq!(
        publish(&mut t, &"AB".repeat(32), b"x").unwrap_err().reason,
        RejectReason::Invalid
    );
    assert_eq!(
        publish(&mut t, &"cd".repeat(32), b"").unwrap_err().reason,
        RejectReason::Invalid
    );
    let huge = vec![0u8; TOKENIZER_PACKAGE_BYTES_MAX + 1];
    assert_eq!(
        publish(&mut t, &"cd".repeat(32), &huge).unwrap_err().reason,
        RejectReason::Limit
    );
    // Up to the limit of distinct tokenizers, then refused.
    for i in 1..TOKENIZERS_MAX {
        assert_eq!(publish(&mut t, &format!("{i:064x}"), b"p"), Ok(true));
    }
    assert_eq!(
        publish(&mut t, &"ef".repeat(32), b"p").unwrap_err().reason,
        RejectReason::Full
    );
    // Ticks prune generations, never tokenizers (an old generation's text still needs one).
    t.at(1_000_000, Command::Tick { retention_ms: 1 });
    assert_eq!(t.s.tokenizers.len(), TOKENIZERS_MAX);
}

/// A `Register` entry as builds before handoff listeners wrote it into the Raft log (bincode,
/// byte for byte) still decodes and applies: an upgraded node replays its old log. New entries
/// are `RegisterDecoder`; the old variant's shape must never change.
#[test]
fn a_register_entry_of_the_previous_release_still_decodes_and_applies() {
    let mut b: Vec<u8> = Vec::new();
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    };
    b.extend(7u64.to_le_bytes()); // Request.log_ms
    b.extend(8u32.to_le_bytes()); // Command::Register, the ninth variant
    s(&mut b, "d1");
    s(&mut b, "m"); // info.model_name
    for f in ["w", "t", "llama", "fake"] {
        s(&mut b, f); // info.model
    }
    b.extend(4u32.to_le_bytes()); // capacity
    s(&mut b, "chatml");
    b.extend(2048u32.to_le_bytes()); // context_tokens
    b.extend(0u64.to_le_bytes()); // expiry_log_ms
    b.extend(5_000u64.to_le_bytes()); // ttl_ms
    let req: Request = bincode::deserialize(&b).expect("an old Register entry decodes");
    let Command::Register { decoder, info, ttl_ms } = &*req.cmd else {
        panic!("{req:?}");
    };
    assert_eq!((decoder.as_str(), info.capacity, *ttl_ms), ("d1", 4, 5_000));
    assert_eq!(info.model, model());
    let mut t = T::new();
    assert_eq!(t.at(7, (*req.cmd).clone()), Response::Registered(Ok(5_007)));
    let d = &t.s.decoders["d1"];
    assert_eq!(
        (d.chat_template.as_str(), d.context_tokens, d.handoff_addr.as_str()),
        ("chatml", 2048, "")
    );
    // And the new variant round-trips with its address.
    let new = Command::RegisterDecoder {
        decoder: "d2".into(),
        info: DecoderInfo {
            handoff_addr: "10.0.0.1:7300".into(),
            ..d.clone()
        },
        ttl_ms: 5_000,
    };
    let back: Command = bincode::deserialize(&bincode::serialize(&new).unwrap()).unwrap();
    assert_eq!(back, new);
}

/// `ListModels` sums the capacities the decoders of one model registered: two that add up past
/// `u32::MAX` read as `u32::MAX`. The sum overflowed before (a panic of the node serving
/// `ListModels` in a debug build, a wrapped number in a release one).
#[test]
fn the_listed_capacity_of_a_model_saturates() {
    let mut t = T::new();
    for (id, capacity) in [("d1", u32::MAX), ("d2", 1)] {
        let info = DecoderInfo {
            model_name: "m".into(),
            model: model(),
            capacity,
            ..Default::default()
        };
        let reg = Command::RegisterDecoder {
            decoder: id.into(),
            info,
            ttl_ms: 1_000,
        };
        assert!(matches!(t.at(0, reg), Response::Registered(Ok(_))));
    }
    let listed = crate::service::models(&t.s);
    assert_eq!(listed.models.len(), 1, "{listed:?}");
    assert_eq!(
        (listed.models[0].capacity, listed.models[0].decoders.len()),
        (u32::MAX, 2)
    );
}
