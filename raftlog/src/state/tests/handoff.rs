//! Planned handoff (CONTRACT §7): the phases in order, one owner at every entry, the checks that
//! refuse a step of another attempt, side or epoch, and everything that aborts an attempt.

use super::*;

const SRC: &str = "src";
const DST: &str = "dst";
const SHA: &str = "c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00";

fn manifest(frontier: Seq) -> CacheManifest {
    CacheManifest {
        model: model(),
        cache_format: "kv-f32/cpu".into(),
        frontier,
        kv_positions: 3 + frontier,
        cache_sha256: SHA.into(),
        bytes: 1_000,
    }
}

impl T {
    fn step(&mut self, t: u64, g: GenerationId, step: HandoffStep) -> Result<(Handoff, GenerationView), Rejection> {
        match self.at(t, Command::Handoff { generation: g, step }) {
            Response::Handoff(r) => r,
            r => panic!("{r:?}"),
        }
    }

    /// A generation owned by `src` at epoch 1 with `n` records, `dst` registered.
    fn owned_with_records(&mut self, n: u32) -> GenerationId {
        let g = self.submit(0, "r");
        self.register(0, DST, "127.0.0.1:9", model());
        self.acquire(1, g, SRC).unwrap();
        if n > 0 {
            let toks: Vec<u32> = (0..n).collect();
            self.append(2, g, SRC, 1, 0, &toks).unwrap();
        }
        g
    }

    fn prepare(&mut self, t: u64, g: GenerationId, frontier: Seq) -> Result<(Handoff, GenerationView), Rejection> {
        self.step(
            t,
            g,
            HandoffStep::Prepare {
                epoch: 1,
                source: SRC.into(),
                destination: DST.into(),
                manifest: manifest(frontier),
            },
        )
    }

    /// Prepared, copying and receiver-ready; returns the attempt.
    fn ready(&mut self, t: u64, g: GenerationId, frontier: Seq) -> u64 {
        let attempt = self.prepare(t, g, frontier).unwrap().0.attempt;
        self.copied_and_ready(t, g, attempt);
        attempt
    }

    /// Copying and receiver-ready of a prepared `attempt`.
    fn copied_and_ready(&mut self, t: u64, g: GenerationId, attempt: u64) {
        self.step(
            t + 1,
            g,
            HandoffStep::Copying {
                attempt,
                source: SRC.into(),
            },
        )
        .unwrap();
        let (h, _) = self.step(t + 2, g, ready_step(attempt, 2, SHA)).unwrap();
        assert_eq!(h.phase, HandoffPhase::ReceiverReady);
    }
}

fn ready_step(attempt: u64, handoff_epoch: Epoch, sha: &str) -> HandoffStep {
    HandoffStep::ReceiverReady {
        attempt,
        destination: DST.into(),
        handoff_epoch,
        cache_sha256: sha.into(),
    }
}

fn commit_step(attempt: u64, handoff_epoch: Epoch) -> HandoffStep {
    HandoffStep::Commit {
        attempt,
        destination: DST.into(),
        handoff_epoch,
        lease_ms: LEASE,
    }
}

#[test]
fn the_phases_move_ownership_once_and_fence_the_source() {
    let mut t = T::new();
    let g = t.owned_with_records(3);
    let (h, view) = t.prepare(10, g, 3).unwrap();
    assert_eq!(
        (h.attempt, h.phase, h.source_epoch, h.handoff_epoch),
        (1, HandoffPhase::Prepared, 1, 2)
    );
    assert_eq!(
        (view.lease.owner.as_str(), view.lease.epoch),
        (SRC, 1),
        "the source still owns it"
    );
    // Until the commit the source may renew and the destination may not write.
    t.ownership(
        11,
        Command::Renew {
            generation: g,
            epoch: 1,
            decoder: SRC.into(),
            lease_ms: LEASE,
        },
    )
    .unwrap();
    assert_eq!(reason(t.append(11, g, DST, 2, 3, &[9])), RejectReason::StaleEpoch);
    let attempt = h.attempt;
    t.copied_and_ready(12, g, attempt);
    assert_eq!(
        reason(t.append(15, g, DST, 2, 3, &[9])),
        RejectReason::StaleEpoch,
        "ready is not owning"
    );

    let (h, view) = t.step(20, g, commit_step(attempt, 2)).unwrap();
    assert_eq!(h.phase, HandoffPhase::OwnershipCommitted);
    assert_eq!((view.lease.owner.as_str(), view.lease.epoch), (DST, 2));
    assert_eq!(view.lease.expiry_log_ms, 20 + LEASE);
    let grant = t.gen(g).grants.last().unwrap().clone();
    assert_eq!((grant.epoch, grant.owner.as_str(), grant.frontier), (2, DST, 3));
    // A lost acknowledgment: the retry gets the same grant, no new epoch.
    let (again, view2) = t.step(21, g, commit_step(attempt, 2)).unwrap();
    assert_eq!((again.phase, view2.lease.epoch), (HandoffPhase::OwnershipCommitted, 2));
    assert_eq!(t.gen(g).grants.len(), 2);
    // The source is fenced; the destination writes at the frontier.
    assert_eq!(reason(t.append(22, g, SRC, 1, 3, &[5])), RejectReason::StaleEpoch);
    t.append(23, g, DST, 2, 3, &[5]).unwrap();
    assert_eq!(t.gen(g).records[3].epoch, 2);

    let (h, _) = t
        .step(
            24,
            g,
            HandoffStep::SourceReleased {
                attempt,
                source: SRC.into(),
            },
        )
        .unwrap();
    assert_eq!(h.phase, HandoffPhase::SourceReleased);
    // Too late to abort.
    let abort = HandoffStep::Abort {
        attempt,
        by: SRC.into(),
        detail: "changed my mind".into(),
    };
    assert_eq!(reason(t.step(25, g, abort)), RejectReason::HandoffConflict);
    assert_eq!(t.gen(g).lease.owner, DST);
    // The destination's lease lapses and another decoder takes the generation: a commit retry
    // that arrives now is refused. It was answered "ok", with the new owner's view: the
    // destination took that for its grant.
    t.acquire(23 + LEASE + 1, g, "third").unwrap();
    assert_eq!(
        reason(t.step(23 + LEASE + 2, g, commit_step(attempt, 2))),
        RejectReason::StaleEpoch
    );
}

#[test]
fn steps_of_another_attempt_side_or_epoch_are_refused() {
    let mut t = T::new();
    let g = t.owned_with_records(2);
    // Prepare: by the owner only, at its epoch, with the frontier, to a registered peer.
    let prep = |epoch, source: &str, destination: &str, m: CacheManifest| HandoffStep::Prepare {
        epoch,
        source: source.into(),
        destination: destination.into(),
        manifest: m,
    };
    assert_eq!(
        reason(t.step(5, g, prep(2, SRC, DST, manifest(2)))),
        RejectReason::StaleEpoch
    );
    assert_eq!(
        reason(t.step(5, g, prep(1, DST, DST, manifest(2)))),
        RejectReason::StaleEpoch
    );
    assert_eq!(
        reason(t.step(5, g, prep(1, SRC, SRC, manifest(2)))),
        RejectReason::Invalid
    );
    assert_eq!(
        reason(t.step(5, g, prep(1, SRC, "nobody", manifest(2)))),
        RejectReason::NotFound
    );
    assert_eq!(
        reason(t.step(5, g, prep(1, SRC, DST, manifest(3)))),
        RejectReason::HandoffConflict
    );
    let mut other = manifest(2);
    other.model.weights_sha256 = "other".into();
    assert_eq!(
        reason(t.step(5, g, prep(1, SRC, DST, other))),
        RejectReason::ModelMismatch
    );
    let mut short_sum = manifest(2);
    short_sum.cache_sha256 = "c0ffee".into();
    assert_eq!(
        reason(t.step(5, g, prep(1, SRC, DST, short_sum))),
        RejectReason::Invalid
    );
    let mut other_model = model();
    other_model.weights_sha256 = "x".into();
    t.register(5, "odd", "127.0.0.1:8", other_model);
    assert_eq!(
        reason(t.step(5, g, prep(1, SRC, "odd", manifest(2)))),
        RejectReason::ModelMismatch
    );
    t.register(5, "noaddr", "", model());
    assert_eq!(
        reason(t.step(5, g, prep(1, SRC, "noaddr", manifest(2)))),
        RejectReason::Invalid
    );
    assert!(t.s.handoffs.is_empty(), "nothing refused left a trace");

    let attempt = t.prepare(6, g, 2).unwrap().0.attempt;
    // One attempt at a time: another Prepare is refused...
    assert_eq!(
        reason(t.step(7, g, prep(1, SRC, DST, manifest(1)))),
        RejectReason::HandoffConflict
    );
    // ...and the same one again (its first answer lost) is answered with the attempt it made.
    // It was refused too: the source never learnt the attempt, which stayed in flight until
    // `HANDOFF_PHASE_MS_MAX` aborted it.
    let (again, _) = t.prepare(7, g, 2).unwrap();
    assert_eq!((again.attempt, again.phase), (attempt, HandoffPhase::Prepared));
    // Out of order: no commit before ready, no release before the commit.
    assert_eq!(
        reason(t.step(7, g, commit_step(attempt, 2))),
        RejectReason::HandoffConflict
    );
    let release = HandoffStep::SourceReleased {
        attempt,
        source: SRC.into(),
    };
    assert_eq!(reason(t.step(7, g, release)), RejectReason::HandoffConflict);
    // Wrong side, wrong cache, wrong epoch, wrong attempt.
    let copying_by_dst = HandoffStep::Copying {
        attempt,
        source: DST.into(),
    };
    assert_eq!(reason(t.step(7, g, copying_by_dst)), RejectReason::HandoffConflict);
    assert_eq!(
        reason(t.step(7, g, ready_step(attempt, 2, "bad"))),
        RejectReason::HandoffConflict
    );
    assert_eq!(
        reason(t.step(7, g, ready_step(attempt, 3, SHA))),
        RejectReason::StaleEpoch
    );
    assert_eq!(
        reason(t.step(7, g, ready_step(attempt + 1, 2, SHA))),
        RejectReason::HandoffConflict
    );
    let stranger_abort = HandoffStep::Abort {
        attempt,
        by: "stranger".into(),
        detail: String::new(),
    };
    assert_eq!(reason(t.step(7, g, stranger_abort)), RejectReason::HandoffConflict);
    assert_eq!(
        t.s.handoffs[&g].phase,
        HandoffPhase::Prepared,
        "no refused step moved it"
    );
}

/// Failure point 10: a message of an earlier destination incarnation (an earlier attempt) is
/// refused by the attempt it names, and cannot commit the later attempt's epoch.
#[test]
fn a_delayed_message_of_an_earlier_attempt_is_refused() {
    let mut t = T::new();
    let g = t.owned_with_records(1);
    let first = t.ready(10, g, 1);
    let abort = HandoffStep::Abort {
        attempt: first,
        by: DST.into(),
        detail: "destination restarted".into(),
    };
    let (h, _) = t.step(20, g, abort).unwrap();
    assert_eq!(h.phase, HandoffPhase::Aborted);
    assert!(h.detail.contains("destination restarted"), "{}", h.detail);
    let second = t.ready(30, g, 1);
    assert_ne!(first, second);
    // The first incarnation's late commit names the first attempt.
    assert_eq!(
        reason(t.step(40, g, commit_step(first, 2))),
        RejectReason::HandoffConflict
    );
    assert_eq!(t.gen(g).lease.owner, SRC);
    t.step(41, g, commit_step(second, 2)).unwrap();
    assert_eq!(t.gen(g).lease.owner, DST);
}

#[test]
fn the_source_writes_until_the_commit_and_the_grant_is_at_the_frontier_then() {
    let mut t = T::new();
    let g = t.owned_with_records(2);
    // A manifest of an older prefix is fine: the destination follows the rest from the log.
    let attempt = t.ready(10, g, 1);
    // The source goes on writing while its cache is copied.
    t.append(13, g, SRC, 1, 2, &[7]).unwrap();
    let (h, view) = t.step(14, g, commit_step(attempt, 2)).unwrap();
    assert_eq!(h.phase, HandoffPhase::OwnershipCommitted);
    assert_eq!(view.frontier, 3);
    let grant = t.gen(g).grants.last().unwrap().clone();
    assert_eq!((grant.epoch, grant.owner.as_str(), grant.frontier), (2, DST, 3));
    // From the commit on the source is fenced: nothing lands between the grant and the
    // destination's first write.
    assert!(t.append(15, g, SRC, 1, 3, &[8]).is_err());
    t.append(16, g, DST, 2, 3, &[9]).unwrap();
    assert_eq!(t.gen(g).frontier(), 4);
}

/// Failure points 1-3 as the log sees them: whatever moves ownership another way (the source's
/// session lost or its release, a takeover after its lease, a finish), the destination's session
/// ending, or a phase that stalls aborts the attempt; the commit never happens.
#[test]
fn ownership_moving_another_way_or_a_stall_aborts_the_attempt() {
    type Move = fn(&mut T, GenerationId);
    let cases: Vec<(&str, Move, &str)> = vec![
        (
            "source session lost",
            |t, _| {
                t.at(
                    20,
                    Command::SessionOpened {
                        decoder: SRC.into(),
                        session: 7,
                    },
                );
                t.at(
                    21,
                    Command::SessionLost {
                        decoder: SRC.into(),
                        session: 7,
                    },
                );
            },
            "ownership moved",
        ),
        (
            "source released",
            |t, g| {
                t.ownership(
                    20,
                    Command::Release {
                        generation: g,
                        epoch: 1,
                    },
                )
                .unwrap();
            },
            "ownership moved",
        ),
        (
            "taken over after the lease",
            |t, g| {
                t.acquire(5_000, g, "third").unwrap();
            },
            "ownership moved",
        ),
        (
            "finished",
            |t, g| {
                t.finish(20, g, 1).unwrap();
            },
            "finished",
        ),
        (
            "destination session lost",
            |t, _| {
                t.at(
                    20,
                    Command::SessionOpened {
                        decoder: DST.into(),
                        session: 8,
                    },
                );
                t.at(
                    21,
                    Command::SessionLost {
                        decoder: DST.into(),
                        session: 8,
                    },
                );
            },
            "session ended",
        ),
        (
            "stalled",
            |t, _| {
                // (The source's lease ran out meanwhile; nobody took over, so the attempt
                // stays until the tick.)
                assert!(!t.s.tick_due(11 + HANDOFF_PHASE_MS_MAX, RETENTION_MS_DEFAULT));
                assert!(t.s.tick_due(12 + HANDOFF_PHASE_MS_MAX, RETENTION_MS_DEFAULT));
                t.at(
                    12 + HANDOFF_PHASE_MS_MAX,
                    Command::Tick {
                        retention_ms: RETENTION_MS_DEFAULT,
                    },
                );
            },
            "no progress",
        ),
    ];
    for (name, moved, why) in cases {
        let mut t = T::new();
        let g = t.owned_with_records(1);
        let attempt = t.ready(10, g, 1);
        moved(&mut t, g);
        let h = &t.s.handoffs[&g];
        assert_eq!(h.phase, HandoffPhase::Aborted, "{name}");
        assert!(h.detail.contains(why), "{name}: {}", h.detail);
        assert!(t.s.handoffs_in_flight.is_empty(), "{name}");
        let r = t.step(6_000, g, commit_step(attempt, 2));
        assert_eq!(reason(r), RejectReason::HandoffConflict, "{name}");
        assert_ne!(t.gen(g).lease.owner, DST, "{name}");
    }
}

#[test]
fn a_pruned_generation_takes_its_handoff_with_it_and_a_snapshot_round_trip_keeps_the_rest() {
    let mut t = T::new();
    let g = t.owned_with_records(1);
    let attempt = t.ready(10, g, 1);
    t.step(20, g, commit_step(attempt, 2)).unwrap();
    let h = t.submit(21, "r2");
    t.acquire(22, h, SRC).unwrap();
    let mut ready2 = t.clone_state();
    ready2.s.prepare_other(h);
    // A decoded copy rebuilds the in-flight set.
    let bytes = bincode::serialize(&ready2.s).unwrap();
    let mut copy: LogState = bincode::deserialize(&bytes).unwrap();
    copy.rebuild_index();
    assert_eq!(copy.handoffs, ready2.s.handoffs);
    assert_eq!(copy.handoffs_in_flight, ready2.s.handoffs_in_flight);
    assert_eq!(copy.handoffs_in_flight.len(), 1);

    t.finish(30, g, 2).unwrap();
    t.at(40, Command::Tick { retention_ms: 0 });
    assert!(!t.s.generations.contains_key(&g));
    assert!(!t.s.handoffs.contains_key(&g));
}

impl T {
    fn clone_state(&self) -> T {
        T {
            s: self.s.clone(),
            changes: Changes::default(),
        }
    }
}

impl LogState {
    /// Prepares a handoff of `h` (owned by `src` at epoch 1, no records) to `dst`.
    fn prepare_other(&mut self, h: GenerationId) {
        let r = self.apply(
            &Request::new(
                23,
                Command::Handoff {
                    generation: h,
                    step: HandoffStep::Prepare {
                        epoch: 1,
                        source: SRC.into(),
                        destination: DST.into(),
                        manifest: manifest(0),
                    },
                },
            ),
            &mut Changes::default(),
        );
        assert!(matches!(r, Response::Handoff(Ok(_))), "{r:?}");
    }
}
