//! Hot standbys: at most one live standby per running generation, the priority window in which
//! only it may acquire, and when a standby is dropped.

use super::*;

const OWNER: &str = "owner";

impl T {
    /// Registers `dec` for [`model`] and opens its session `session`.
    fn live_decoder(&mut self, t: u64, dec: &str, session: u64) {
        self.register(t, dec, "", model());
        let r = self.at(
            t,
            Command::SessionOpened {
                decoder: dec.into(),
                session,
            },
        );
        assert!(matches!(r, Response::Session(Ok(_))), "{r:?}");
    }

    fn stand_by(&mut self, t: u64, g: GenerationId, dec: &str) -> Result<GenerationView, Rejection> {
        self.ownership(
            t,
            Command::Standby {
                generation: g,
                decoder: dec.into(),
                model: model(),
            },
        )
    }

    /// A generation owned by [`OWNER`] (live, session 1) at epoch 1 with 2 records; `sb1`, `sb2`
    /// and `other` live decoders.
    fn running(&mut self) -> GenerationId {
        let g = self.submit(0, "r");
        for (i, d) in [OWNER, "sb1", "sb2", "other"].into_iter().enumerate() {
            self.live_decoder(0, d, i as u64 + 1);
        }
        self.acquire(1, g, OWNER).unwrap();
        self.append(2, g, OWNER, 1, 0, &[7, 8]).unwrap();
        g
    }

    fn lose_session(&mut self, t: u64, dec: &str, session: u64) {
        self.at(
            t,
            Command::SessionLost {
                decoder: dec.into(),
                session,
            },
        );
    }
}

#[test]
fn a_running_generation_gets_at_most_one_live_standby() {
    let mut t = T::new();
    let g = t.running();
    t.stand_by(3, g, "sb1").unwrap();
    assert_eq!(t.s.standbys[&g].decoder, "sb1");
    assert_eq!(reason(t.stand_by(4, g, "sb2")), RejectReason::LeaseHeld);
    // Asking again is answered the same, and changes nothing.
    t.stand_by(5, g, "sb1").unwrap();
    assert_eq!(t.s.standbys[&g].since_log_ms, 3);
    // Not for itself, not without a registration and session, not for another model.
    assert_eq!(reason(t.stand_by(6, g, OWNER)), RejectReason::Invalid);
    assert_eq!(reason(t.stand_by(6, g, "stranger")), RejectReason::Invalid);
    let mut m = model();
    m.weights_sha256 = "other".into();
    let r = t.ownership(
        6,
        Command::Standby {
            generation: g,
            decoder: "sb2".into(),
            model: m,
        },
    );
    assert_eq!(reason(r), RejectReason::ModelMismatch);
    assert_eq!(reason(t.stand_by(6, 99, "sb2")), RejectReason::NotFound);
    // A standby whose session ended is not live: the next claimant replaces it.
    t.lose_session(7, "sb1", 2);
    t.stand_by(8, g, "sb2").unwrap();
    assert_eq!(t.s.standbys[&g].decoder, "sb2");
    // A standby grants no write.
    assert_eq!(reason(t.append(9, g, "sb2", 2, 2, &[9])), RejectReason::StaleEpoch);
    assert_eq!(t.gen(g).lease.owner, OWNER);
}

#[test]
fn only_the_live_standby_acquires_in_the_priority_window() {
    let mut t = T::new();
    let g = t.running();
    t.stand_by(3, g, "sb1").unwrap();
    // The owner dies: its session's end ends its lease at once.
    t.lose_session(10, OWNER, 1);
    assert!(!t.gen(g).lease_live(10));
    let refused = t.acquire(11, g, "other");
    assert_eq!(reason(refused), RejectReason::LeaseHeld);
    let won = t.acquire(12, g, "sb1").unwrap();
    assert_eq!(won.lease.epoch, 2);
    assert_eq!(t.gen(g).lease.owner, "sb1");
    assert!(!t.s.standbys.contains_key(&g), "the standby is the owner now");
    t.append(13, g, "sb1", 2, 2, &[9]).unwrap();
    // The window is over once the standby has taken it; nothing left to keep.
    assert_eq!(reason(t.acquire(14, g, "other")), RejectReason::LeaseHeld);
}

#[test]
fn the_window_closes_and_a_dead_standby_keeps_nothing() {
    let mut t = T::new();
    let g = t.running();
    t.stand_by(3, g, "sb1").unwrap();
    t.lose_session(10, OWNER, 1);
    // The standby never comes: after the window anyone acquires.
    assert_eq!(
        reason(t.acquire(10 + STANDBY_PRIORITY_MS - 1, g, "other")),
        RejectReason::LeaseHeld
    );
    assert_eq!(t.acquire(10 + STANDBY_PRIORITY_MS, g, "other").unwrap().lease.epoch, 2);
    // A second generation whose standby dies first: no window at all.
    let h = t.submit(20_000, "r2");
    t.live_decoder(20_000, "owner2", 9);
    t.acquire(20_001, h, "owner2").unwrap();
    t.stand_by(20_002, h, "sb2").unwrap();
    t.lose_session(20_003, "sb2", 3);
    t.lose_session(20_004, "owner2", 9);
    assert_eq!(t.acquire(20_005, h, "other").unwrap().lease.epoch, 2);
}

#[test]
fn a_standby_is_dropped_with_its_generation_and_candidates_are_listed_by_index() {
    let mut t = T::new();
    let g = t.running();
    let h = t.submit(3, "r2");
    t.acquire(4, h, OWNER).unwrap();
    // Unowned: not a candidate; owned by the asker: not a candidate.
    let u = t.submit(5, "r3");
    let ids = |t: &T, dec: &str| -> Vec<GenerationId> {
        t.s.standby_candidates(&model(), dec, 6, 10, &[])
            .iter()
            .map(|g| g.id)
            .collect()
    };
    assert_eq!(ids(&t, "sb1"), vec![g, h]);
    assert!(ids(&t, OWNER).is_empty());
    assert!(!ids(&t, "sb1").contains(&u));
    t.stand_by(6, g, "sb1").unwrap();
    // Taken by a live standby: listed to it still, not to others.
    assert_eq!(ids(&t, "sb1"), vec![g, h]);
    assert_eq!(ids(&t, "sb2"), vec![h]);
    // The generation ends: its standby goes with it.
    t.finish(7, g, 1).unwrap();
    assert!(!t.s.standbys.contains_key(&g));
    assert_eq!(reason(t.stand_by(8, g, "sb2")), RejectReason::Terminal);
    // Likewise at the end of the next one.
    t.stand_by(9, h, "sb2").unwrap();
    t.finish(10, h, 1).unwrap();
    assert!(t.s.standbys.is_empty());
    let copy = t.s.clone();
    assert_eq!(copy, t.s);
}

#[test]
fn a_release_is_not_a_death_and_keeps_no_priority() {
    let mut t = T::new();
    let g = t.running();
    t.stand_by(3, g, "sb1").unwrap();
    t.ownership(
        4,
        Command::Release {
            generation: g,
            epoch: 1,
        },
    )
    .unwrap();
    assert!(!t.s.standbys.contains_key(&g));
    assert_eq!(t.acquire(5, g, "other").unwrap().lease.epoch, 2);
}

#[test]
fn what_is_kept_for_a_standby_is_not_offered_to_others() {
    let mut t = T::new();
    let g = t.running();
    t.stand_by(3, g, "sb1").unwrap();
    t.lose_session(10, OWNER, 1);
    let gen = t.gen(g).clone();
    assert!(t.s.kept_for_standby(&gen, "other", 11));
    assert!(!t.s.kept_for_standby(&gen, "sb1", 11));
    assert!(!t.s.kept_for_standby(&gen, "other", 10 + STANDBY_PRIORITY_MS));
}

/// A generation handed over (planned handoff) to the decoder that stands by for it: from the
/// commit on that decoder owns it, so it is its standby no more (as after an acquire); a handoff
/// to another decoder keeps the standby. (The standby entry once outlived such a commit, and
/// every replica's invariant check stopped the log: found by the `handoff` nemesis.)
#[test]
fn a_standby_that_receives_its_generation_by_handoff_is_its_standby_no_more() {
    for (dest, kept) in [("sb1", false), ("other", true)] {
        let mut t = T::new();
        let g = t.running();
        t.stand_by(3, g, "sb1").unwrap();
        // Both take handoffs.
        t.register(3, "sb1", "127.0.0.1:9", model());
        t.register(3, "other", "127.0.0.1:10", model());
        let handoff = |t: &mut T, at: u64, step: HandoffStep| match t.at(at, Command::Handoff { generation: g, step }) {
            Response::Handoff(r) => r.unwrap().0,
            r => panic!("{r:?}"),
        };
        let sha = "ab".repeat(32);
        let manifest = CacheManifest {
            model: model(),
            cache_format: "kv-f32/cpu".into(),
            frontier: 2,
            kv_positions: 5,
            cache_sha256: sha.clone(),
            bytes: 1_000,
        };
        let prepare = HandoffStep::Prepare {
            epoch: 1,
            source: OWNER.into(),
            destination: dest.into(),
            manifest,
        };
        let attempt = handoff(&mut t, 4, prepare).attempt;
        handoff(
            &mut t,
            5,
            HandoffStep::Copying {
                attempt,
                source: OWNER.into(),
            },
        );
        let ready = HandoffStep::ReceiverReady {
            attempt,
            destination: dest.into(),
            handoff_epoch: 2,
            cache_sha256: sha,
        };
        handoff(&mut t, 6, ready);
        let commit = HandoffStep::Commit {
            attempt,
            destination: dest.into(),
            handoff_epoch: 2,
            lease_ms: LEASE,
        };
        assert_eq!(handoff(&mut t, 7, commit).phase, HandoffPhase::OwnershipCommitted);
        assert_eq!(t.gen(g).lease.owner, dest);
        assert_eq!(t.s.standbys.contains_key(&g), kept, "handed to {dest}");
    }
}

/// PendingWork never offers a decoder what is kept for another decoder's standby, and leaves
/// it out before the list is cut to its limit. Before, the list was cut first: a decoder asking
/// for one generation got nothing when the first orphan was kept for another's standby, though
/// another orphan was free.
#[test]
fn pending_work_leaves_out_what_is_kept_for_another_standby_before_its_limit() {
    let pending = |t: &T, dec: &str, limit: u32| -> Vec<GenerationId> {
        let r = tokenlog_proto::raftlog::PendingWorkRequest {
            model: Some(model().into()),
            limit,
            standby: false,
            decoder_id: dec.into(),
            standing_by: Vec::new(),
        };
        crate::service::pending(&t.s, r, 11)
            .unwrap()
            .generations
            .iter()
            .map(|g| g.generation_id)
            .collect()
    };
    // Two orphans of one owner; the first is kept for sb1.
    let mut t = T::new();
    let h = t.running();
    let g = t.submit(3, "r2");
    t.acquire(4, g, OWNER).unwrap();
    t.stand_by(5, h, "sb1").unwrap();
    t.lose_session(10, OWNER, 1);
    assert_eq!(pending(&t, "other", 1), vec![g]);
    assert_eq!(pending(&t, "other", 2), vec![g]);
    assert_eq!(pending(&t, "sb1", 1), vec![h]);
    assert_eq!(pending(&t, "sb1", 2), vec![h, g]);
}

/// A standby is granted only for a generation with a live owner: one whose owner died (or that
/// nobody owns) is to be taken. Before, a decoder that read its candidates while the owner
/// lived and asked after it died was granted, and held the priority window without having
/// followed anything.
#[test]
fn a_standby_is_granted_only_while_the_generation_has_a_live_owner() {
    let mut t = T::new();
    let g = t.running();
    t.lose_session(10, OWNER, 1);
    assert_eq!(reason(t.stand_by(11, g, "sb1")), RejectReason::Invalid);
    assert!(!t.s.standbys.contains_key(&g));
    assert_eq!(t.acquire(12, g, "other").unwrap().lease.epoch, 2);
    let u = t.submit(13, "unowned");
    assert_eq!(reason(t.stand_by(14, u, "sb1")), RejectReason::Invalid);
    // Owned again: granted.
    t.stand_by(15, g, "sb1").unwrap();
}

/// A decoder that names the generations it follows as a standby (`standing_by`) is offered
/// those it may take first, before orphans earlier in the index's order; only its own, of its
/// model, while nobody holds them; no more than its limit; and a request naming too many is
/// refused. Before, the list came in the index's order only: a standby with one free slot took
/// another orphan (a re-prefill), and the one it followed waited out its priority window.
#[test]
fn pending_work_offers_a_standby_the_generations_it_follows_first() {
    let pending = |t: &T, dec: &str, limit: u32, standing_by: Vec<GenerationId>| {
        let r = tokenlog_proto::raftlog::PendingWorkRequest {
            model: Some(model().into()),
            limit,
            standby: false,
            decoder_id: dec.into(),
            standing_by,
        };
        crate::service::pending(&t.s, r, 11).map(|p| p.generations.iter().map(|g| g.generation_id).collect::<Vec<_>>())
    };
    // Three orphans of one owner, in the index's order g, h, k; sb1 follows k, sb2 follows h.
    let mut t = T::new();
    let g = t.running();
    let h = t.submit(3, "r2");
    t.acquire(4, h, OWNER).unwrap();
    let k = t.submit(3, "r3");
    t.acquire(4, k, OWNER).unwrap();
    t.stand_by(5, k, "sb1").unwrap();
    t.stand_by(5, h, "sb2").unwrap();
    // Owned and live: nothing is offered, followed or not.
    assert_eq!(pending(&t, "sb1", 1, vec![k]).unwrap(), Vec::<GenerationId>::new());
    t.lose_session(10, OWNER, 1);
    // Without naming it (as before): another orphan first.
    assert_eq!(pending(&t, "sb1", 1, vec![]).unwrap(), vec![g]);
    assert_eq!(pending(&t, "sb1", 1, vec![k]).unwrap(), vec![k]);
    assert_eq!(pending(&t, "sb1", 3, vec![k, k]).unwrap(), vec![k, g]);
    // Naming one whose standby is another decoder, or one that does not exist, changes nothing.
    assert_eq!(pending(&t, "sb1", 1, vec![h, 999]).unwrap(), vec![g]);
    assert_eq!(pending(&t, "sb2", 2, vec![h]).unwrap(), vec![h, g]);
    // Taken by sb1: no longer offered to anyone.
    t.acquire(12, k, "sb1").unwrap();
    assert_eq!(pending(&t, "sb1", 3, vec![k]).unwrap(), vec![g]);
    let r = pending(&t, "sb1", 1, vec![1; crate::limits::PENDING_STANDING_BY_MAX + 1]);
    assert!(
        matches!(r, Err(crate::error::LogError::Rejected(ref j)) if j.reason == RejectReason::Limit),
        "{r:?}"
    );
}

/// A standby asking for more generations to follow names those it follows (`standing_by`): the
/// ones it holds the standby of are not offered again, so its limit goes to new ones; one it
/// follows whose claim the log dropped (its owner released it) is offered, to be claimed again.
/// Before, its own filled the list: with one slot free it was offered one it followed already,
/// and claimed nothing.
#[test]
fn standby_candidates_leave_out_what_the_standby_follows_and_holds() {
    let mut t = T::new();
    let g = t.running();
    let h = t.submit(3, "r2");
    t.acquire(4, h, OWNER).unwrap();
    let ids = |t: &T, now: u64, limit: usize, following: &[GenerationId]| -> Vec<GenerationId> {
        t.s.standby_candidates(&model(), "sb1", now, limit, following)
            .iter()
            .map(|g| g.id)
            .collect()
    };
    t.stand_by(5, g, "sb1").unwrap();
    // As before (nothing named): its own first, and the limit is spent.
    assert_eq!(ids(&t, 6, 1, &[]), vec![g]);
    assert_eq!(ids(&t, 6, 1, &[g]), vec![h]);
    // g released and taken by another owner: its claim is gone, and it is offered again.
    let r = t.ownership(
        7,
        Command::Release {
            generation: g,
            epoch: 1,
        },
    );
    assert!(r.is_ok(), "{r:?}");
    assert!(!t.s.standbys.contains_key(&g));
    t.acquire(8, g, "other").unwrap();
    assert_eq!(ids(&t, 9, 2, &[g]), vec![h, g]);
    t.stand_by(9, g, "sb1").unwrap();
    assert_eq!(ids(&t, 10, 2, &[g]), vec![h]);
}
