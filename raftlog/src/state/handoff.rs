//! Planned handoff (CONTRACT §7): a generation's ownership moves from a live owner (the
//! source) to a decoder that already holds its cache (the destination), through phases that
//! are each an entry: `Prepared`, `Copying`, `ReceiverReady`, `OwnershipCommitted`,
//! `SourceReleased` (or `Aborted` before the commit).
//!
//! The rules that keep exactly one owner:
//! - Until the ownership commit the source owns the generation as before (its appends, renewals
//!   and finish go through the fence as always, so it goes on decoding while its cache is
//!   copied); the destination owns nothing.
//! - The manifest covers a prefix of the committed records (its frontier is at most the
//!   generation's at `Prepared`); the destination follows the records past it from the log.
//! - The commit grants `handoff_epoch = source_epoch + 1` to the destination only if ownership
//!   did not move since `Prepared`: the epoch is still the source's and the generation is not
//!   terminal. The grant is at the frontier as it is then (the source's records since the
//!   manifest included). After it the source's epoch is stale: its writes are refused by the
//!   fence, so nothing can be appended between what the destination follows and what it writes.
//! - Every step names its attempt and its side; a step of another attempt (an earlier one, or an
//!   earlier incarnation of the destination) is refused, so is a step out of order. A retried
//!   commit or release after it applied gets the same answer: a lost acknowledgment is resolved
//!   by asking the log, never by a second owner.
//! - Anything else that moves ownership while an attempt is in flight (a release, a lost
//!   session, a takeover after the lease, a finish, a cancel) aborts the attempt; so do the
//!   destination's session ending and `Tick` after `HANDOFF_PHASE_MS_MAX` in one phase.

use super::{check_lease_ms, check_len, reject, reject_gen, Changes, LogState};
use crate::limits::*;
use crate::types::*;

fn conflict(message: impl Into<String>, g: &Generation) -> Rejection {
    reject_gen(RejectReason::HandoffConflict, message, g)
}

impl LogState {
    pub(super) fn handoff(
        &mut self,
        id: GenerationId,
        step: &HandoffStep,
        changes: &mut Changes,
    ) -> Result<(Handoff, GenerationView), Rejection> {
        let now = self.log_ms;
        let next = match step {
            HandoffStep::Prepare {
                epoch,
                source,
                destination,
                manifest,
            } => {
                check_len("decoder id bytes", source.len(), DECODER_ID_BYTES_MAX)?;
                // The same Prepare again (a retry whose first answer was lost, after it
                // applied): the attempt it made, not a conflict that leaves the source without
                // its attempt id and the attempt in flight until it times out (CONTRACT §7: a
                // lost acknowledgment is resolved by asking the log). Nothing moved ownership
                // since: that would have aborted the attempt.
                let same = self.handoffs.get(&id).is_some_and(|h| {
                    h.phase.in_flight()
                        && h.source == *source
                        && h.source_epoch == *epoch
                        && h.destination == *destination
                        && h.manifest == *manifest
                });
                if same {
                    return self.answer(id);
                }
                self.handoff_prepare(id, *epoch, source, destination, manifest)?
            }
            HandoffStep::Copying { attempt, source } => {
                let (g, h) = self.attempt(id, *attempt)?;
                if h.source != *source {
                    return Err(conflict(format!("only the source {} copies", h.source), g));
                }
                match h.phase {
                    HandoffPhase::Copying => return self.answer(id),
                    HandoffPhase::Prepared => {}
                    p => return Err(conflict(format!("attempt {attempt} is {}", p.name()), g)),
                }
                HandoffPhase::Copying
            }
            HandoffStep::ReceiverReady {
                attempt,
                destination,
                handoff_epoch,
                cache_sha256,
            } => {
                let (g, h) = self.attempt(id, *attempt)?;
                check_destination(g, h, destination, *handoff_epoch)?;
                if h.manifest.cache_sha256 != *cache_sha256 {
                    return Err(conflict(
                        format!(
                            "the destination validated cache {cache_sha256}; the manifest names {}",
                            h.manifest.cache_sha256
                        ),
                        g,
                    ));
                }
                match h.phase {
                    HandoffPhase::ReceiverReady => return self.answer(id),
                    HandoffPhase::Prepared | HandoffPhase::Copying => {}
                    p => return Err(conflict(format!("attempt {attempt} is {}", p.name()), g)),
                }
                HandoffPhase::ReceiverReady
            }
            HandoffStep::Commit {
                attempt,
                destination,
                handoff_epoch,
                lease_ms,
            } => {
                check_lease_ms(*lease_ms)?;
                let (g, h) = self.attempt(id, *attempt)?;
                check_destination(g, h, destination, *handoff_epoch)?;
                match h.phase {
                    // A retry after the commit applied: the same grant, while it stands. Once
                    // the destination's lease lapsed and another decoder took the generation,
                    // "ok" would make the destination believe it owns it (it would renew and
                    // decode at an epoch fenced since).
                    HandoffPhase::OwnershipCommitted | HandoffPhase::SourceReleased => {
                        if g.lease.owner != *destination || g.lease.epoch != *handoff_epoch {
                            return Err(reject_gen(
                                RejectReason::StaleEpoch,
                                format!(
                                    "attempt {attempt} committed, but ownership moved on since: epoch {} belongs to {:?}",
                                    g.lease.epoch, g.lease.owner
                                ),
                                g,
                            ));
                        }
                        return self.answer(id);
                    }
                    HandoffPhase::ReceiverReady => {}
                    p => {
                        return Err(conflict(
                            format!("attempt {attempt} is {}; the commit needs receiver_ready", p.name()),
                            g,
                        ))
                    }
                }
                // The aborts in `after_entry` keep an in-flight attempt's source the owner;
                // these are the commit's own conditions, checked again.
                if g.lease.epoch != h.source_epoch || g.lease.owner != h.source || g.state.is_terminal() {
                    return Err(conflict("ownership moved since prepared", g));
                }
                assert!(
                    g.frontier() >= h.manifest.frontier,
                    "a frontier never goes back, and prepare checked the manifest's"
                );
                let g = self.generations.get_mut(&id).expect("checked above");
                g.lease = Lease {
                    epoch: *handoff_epoch,
                    owner: destination.clone(),
                    expiry_log_ms: now + lease_ms,
                };
                g.state = GenState::Running;
                if g.grants.len() >= GRANTS_KEPT_MAX {
                    g.grants.remove(0);
                }
                g.grants.push(Grant {
                    epoch: *handoff_epoch,
                    owner: destination.clone(),
                    log_ms: now,
                    frontier: g.frontier(),
                });
                // Its standby, if the destination stood by for it, owns it now: a standby no more
                // (as after an acquire). Another decoder's standby goes on following it.
                if self.standbys.get(&id).is_some_and(|s| s.decoder == *destination) {
                    self.standbys.remove(&id);
                }
                changes.touch(id);
                HandoffPhase::OwnershipCommitted
            }
            HandoffStep::SourceReleased { attempt, source } => {
                let (g, h) = self.attempt(id, *attempt)?;
                if h.source != *source {
                    return Err(conflict(format!("only the source {} releases", h.source), g));
                }
                match h.phase {
                    HandoffPhase::SourceReleased => return self.answer(id),
                    HandoffPhase::OwnershipCommitted => {}
                    p => {
                        return Err(conflict(
                            format!(
                                "attempt {attempt} is {}; release follows the ownership commit",
                                p.name()
                            ),
                            g,
                        ))
                    }
                }
                HandoffPhase::SourceReleased
            }
            HandoffStep::Abort { attempt, by, detail } => {
                check_len("abort detail bytes", detail.len(), FINISH_DETAIL_BYTES_MAX)?;
                let (g, h) = self.attempt(id, *attempt)?;
                if *by != h.source && *by != h.destination {
                    return Err(conflict(format!("{by:?} is neither side of attempt {attempt}"), g));
                }
                match h.phase {
                    HandoffPhase::Aborted => return self.answer(id),
                    p if p.in_flight() => {}
                    p => {
                        return Err(conflict(
                            format!("attempt {attempt} is {}: ownership already moved", p.name()),
                            g,
                        ))
                    }
                }
                self.abort_handoff(id, &format!("aborted by {by}: {detail}"));
                return self.answer(id);
            }
        };
        self.set_phase(id, next, now);
        self.answer(id)
    }

    fn handoff_prepare(
        &mut self,
        id: GenerationId,
        epoch: Epoch,
        source: &str,
        destination: &str,
        manifest: &CacheManifest,
    ) -> Result<HandoffPhase, Rejection> {
        check_len("decoder id bytes", destination.len(), DECODER_ID_BYTES_MAX)?;
        check_len(
            "cache format bytes",
            manifest.cache_format.len(),
            CACHE_FORMAT_BYTES_MAX,
        )?;
        let now = self.log_ms;
        let g = self.fenced(id, epoch)?;
        if g.lease.owner != source {
            return Err(reject_gen(
                RejectReason::StaleEpoch,
                format!("epoch {epoch} belongs to {}", g.lease.owner),
                g,
            ));
        }
        if destination == source || destination.is_empty() {
            return Err(reject_gen(
                RejectReason::Invalid,
                "the destination must be another decoder",
                g,
            ));
        }
        if manifest.model != g.binding.model {
            return Err(reject_gen(
                RejectReason::ModelMismatch,
                "the manifest's model is not the generation's bound model",
                g,
            ));
        }
        if manifest.frontier > g.frontier() {
            return Err(conflict(
                format!(
                    "the manifest covers {} records; only {} are committed",
                    manifest.frontier,
                    g.frontier()
                ),
                g,
            ));
        }
        let hex64 = |x: &str| x.len() == 64 && x.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !hex64(&manifest.cache_sha256) || manifest.cache_format.is_empty() {
            return Err(reject_gen(
                RejectReason::Invalid,
                "the manifest names its cache format and its SHA-256 (64 lowercase hex digits)",
                g,
            ));
        }
        let source_epoch = g.lease.epoch;
        if let Some(h) = self.handoffs.get(&id).filter(|h| h.phase.in_flight()) {
            let g = &self.generations[&id];
            return Err(conflict(
                format!("attempt {} to {} is {}", h.attempt, h.destination, h.phase.name()),
                g,
            ));
        }
        let g = &self.generations[&id];
        match self.decoders.get(destination) {
            Some(d) if d.model == g.binding.model && !d.handoff_addr.is_empty() => {}
            Some(d) if d.model != g.binding.model => {
                return Err(reject_gen(
                    RejectReason::ModelMismatch,
                    format!("decoder {destination} serves another model"),
                    g,
                ))
            }
            Some(_) => {
                return Err(reject_gen(
                    RejectReason::Invalid,
                    format!("decoder {destination} accepts no handoff (no handoff listener)"),
                    g,
                ))
            }
            None => {
                return Err(reject_gen(
                    RejectReason::NotFound,
                    format!("decoder {destination} is not registered"),
                    g,
                ))
            }
        }
        self.next_handoff += 1;
        self.handoffs.insert(
            id,
            Handoff {
                attempt: self.next_handoff,
                generation: id,
                source: source.to_string(),
                source_epoch,
                destination: destination.to_string(),
                handoff_epoch: source_epoch + 1,
                manifest: manifest.clone(),
                phase: HandoffPhase::Prepared,
                prepared_log_ms: now,
                phase_log_ms: now,
                detail: String::new(),
            },
        );
        self.handoffs_in_flight.insert(id);
        Ok(HandoffPhase::Prepared)
    }

    /// The generation and its attempt `attempt` (the latest one).
    fn attempt(&self, id: GenerationId, attempt: u64) -> Result<(&Generation, &Handoff), Rejection> {
        let g = self
            .generations
            .get(&id)
            .ok_or_else(|| reject(RejectReason::NotFound, format!("generation {id} does not exist")))?;
        match self.handoffs.get(&id) {
            Some(h) if h.attempt == attempt => Ok((g, h)),
            Some(h) => Err(conflict(
                format!(
                    "attempt {attempt} is not the current attempt {} of generation {id}",
                    h.attempt
                ),
                g,
            )),
            None => Err(conflict(format!("generation {id} has no handoff attempt"), g)),
        }
    }

    fn answer(&self, id: GenerationId) -> Result<(Handoff, GenerationView), Rejection> {
        Ok((self.handoffs[&id].clone(), (&self.generations[&id]).into()))
    }

    fn set_phase(&mut self, id: GenerationId, phase: HandoffPhase, now: u64) {
        let h = self.handoffs.get_mut(&id).expect("the attempt exists");
        if h.phase != phase {
            h.phase = phase;
            h.phase_log_ms = now;
        }
        if !phase.in_flight() {
            self.handoffs_in_flight.remove(&id);
        }
    }

    /// Aborts `id`'s attempt if it is in flight.
    pub(super) fn abort_handoff(&mut self, id: GenerationId, detail: &str) {
        let now = self.log_ms;
        if let Some(h) = self.handoffs.get_mut(&id).filter(|h| h.phase.in_flight()) {
            h.detail = detail.chars().take(FINISH_DETAIL_BYTES_MAX / 4).collect();
            self.set_phase(id, HandoffPhase::Aborted, now);
        }
    }

    /// After every entry, for each generation it touched: an in-flight attempt whose source no
    /// longer owns the generation at its epoch is aborted (ownership moved another way).
    pub(super) fn after_entry_handoff(&mut self, id: GenerationId) {
        if !self.handoffs_in_flight.contains(&id) {
            return;
        }
        let (Some(g), Some(h)) = (self.generations.get(&id), self.handoffs.get(&id)) else {
            return;
        };
        let why = if g.state.is_terminal() {
            format!("the generation is {}", g.state.name())
        } else if g.lease.epoch != h.source_epoch || g.lease.owner != h.source {
            format!("ownership moved: epoch {} owned by {:?}", g.lease.epoch, g.lease.owner)
        } else {
            return;
        };
        self.abort_handoff(id, &why);
    }

    /// The in-flight attempts towards `decoder` (its session ended) are aborted.
    pub(super) fn abort_handoffs_to(&mut self, decoder: &str) {
        let to: Vec<GenerationId> = self
            .handoffs_in_flight
            .iter()
            .filter(|id| self.handoffs[id].destination == decoder)
            .copied()
            .collect();
        for id in to {
            self.abort_handoff(id, &format!("the destination {decoder}'s session ended"));
        }
    }

    /// `Tick`: in-flight attempts longer than `HANDOFF_PHASE_MS_MAX` in one phase are aborted.
    pub(super) fn abort_stalled_handoffs(&mut self, now: u64) -> Vec<GenerationId> {
        let stalled: Vec<GenerationId> = self.stalled_handoffs(now).collect();
        for &id in &stalled {
            let phase = self.handoffs[&id].phase.name();
            self.abort_handoff(
                id,
                &format!("no progress for {HANDOFF_PHASE_MS_MAX} ms in phase {phase}"),
            );
        }
        stalled
    }

    /// Whether a `Tick` would abort a stalled attempt at `now`.
    pub(super) fn handoff_tick_due(&self, now: u64) -> bool {
        self.stalled_handoffs(now).next().is_some()
    }

    /// The in-flight attempts `HANDOFF_PHASE_MS_MAX` or longer in their phase at `now`.
    fn stalled_handoffs(&self, now: u64) -> impl Iterator<Item = GenerationId> + '_ {
        self.handoffs_in_flight
            .iter()
            .filter(move |id| self.handoffs[id].phase_log_ms.saturating_add(HANDOFF_PHASE_MS_MAX) <= now)
            .copied()
    }
}

/// A destination's step names the attempt's destination and its handoff epoch.
fn check_destination(g: &Generation, h: &Handoff, destination: &str, handoff_epoch: Epoch) -> Result<(), Rejection> {
    if h.destination != destination {
        return Err(conflict(
            format!("attempt {} goes to {}, not {destination}", h.attempt, h.destination),
            g,
        ));
    }
    if h.handoff_epoch != handoff_epoch {
        return Err(reject_gen(
            RejectReason::StaleEpoch,
            format!(
                "attempt {} hands over epoch {}, not {handoff_epoch}",
                h.attempt, h.handoff_epoch
            ),
            g,
        ));
    }
    Ok(())
}
