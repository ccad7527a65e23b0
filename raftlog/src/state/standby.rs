//! Hot standbys (issue 15 item 3): [`Command::Standby`] assigns a running generation at most one
//! live standby, a decoder that follows its committed records so that a takeover costs one decode
//! step instead of a re-prefill; while the owner's lease has just ended only that standby may
//! acquire it ([`STANDBY_PRIORITY_MS`]). A standby writes nothing: it appends only after it
//! acquired the generation, at a new epoch, through the same fence as any owner.

use super::{check_len, reject, reject_gen, LogState};
use crate::limits::*;
use crate::types::*;

impl LogState {
    /// Whether `decoder`, as a standby, would still be there to take over: registered and
    /// holding a session (a dead decoder's session ends at once).
    pub fn standby_live(&self, decoder: &str, now: u64) -> bool {
        self.sessions.contains_key(decoder) && self.decoders.get(decoder).is_some_and(|d| d.expiry_log_ms > now)
    }

    /// [`Command::Standby`].
    pub(super) fn standby(
        &mut self,
        id: GenerationId,
        decoder: &str,
        model: &ModelIdentity,
    ) -> Result<GenerationView, Rejection> {
        check_len("decoder id bytes", decoder.len(), DECODER_ID_BYTES_MAX)?;
        let now = self.log_ms;
        let live = self.standby_live(decoder, now);
        let current = self.standbys.get(&id).cloned();
        let other_live = current
            .as_ref()
            .filter(|s| s.decoder != decoder)
            .is_some_and(|s| self.standby_live(&s.decoder, now));
        let g = self
            .generations
            .get(&id)
            .ok_or_else(|| reject(RejectReason::NotFound, format!("generation {id} not found")))?;
        if g.state.is_terminal() {
            return Err(reject_gen(
                RejectReason::Terminal,
                format!("generation {id} is {}", g.state.name()),
                g,
            ));
        }
        if g.binding.model != *model {
            return Err(reject_gen(
                RejectReason::ModelMismatch,
                format!("generation {id} is bound to model {:?}", g.binding.model),
                g,
            ));
        }
        if !live {
            return Err(reject_gen(
                RejectReason::Invalid,
                format!("decoder {decoder:?} needs a live registration and session to stand by"),
                g,
            ));
        }
        if g.lease.owner == decoder {
            return Err(reject_gen(
                RejectReason::Invalid,
                format!("decoder {decoder:?} owns generation {id}: it cannot stand by for itself"),
                g,
            ));
        }
        // Only a running generation's owner can die and leave it to a standby. One without a
        // live owner (its owner died or released it after the decoder read its candidates) is
        // to be taken, not followed: a standby granted then held the priority window though it
        // had followed nothing, and every other decoder waited it out.
        if g.lease.owner.is_empty() || !g.lease_live(now) {
            return Err(reject_gen(
                RejectReason::Invalid,
                format!("generation {id} has no live owner to stand by for: take it instead"),
                g,
            ));
        }
        if other_live {
            let holder = current.map(|s| s.decoder).unwrap_or_default();
            return Err(reject_gen(
                RejectReason::LeaseHeld,
                format!("generation {id} has a live standby, {holder}"),
                g,
            ));
        }
        let view: GenerationView = g.into();
        if current.as_ref().is_none_or(|s| s.decoder != decoder) {
            self.standbys.insert(
                id,
                Standby {
                    decoder: decoder.to_string(),
                    since_log_ms: now,
                },
            );
        }
        Ok(view)
    }

    /// Whether generation `g` is kept for a live standby other than `decoder` at `now` (its
    /// previous owner's lease ended less than [`STANDBY_PRIORITY_MS`] ago): PendingWork does not
    /// offer it to others.
    pub fn kept_for_standby(&self, g: &Generation, decoder: &str, now: u64) -> bool {
        g.lease.epoch > 0
            && self
                .standby_priority(g.id, decoder, g.lease.expiry_log_ms, now)
                .is_some()
    }

    /// The refusal of an acquire by `decoder` at `now` of a generation whose lease (of a
    /// previous owner) ended at `lease_ended_log_ms`, when another decoder is its live standby
    /// and the priority window is still open; `None` when the acquire may go on.
    pub(super) fn standby_priority(
        &self,
        id: GenerationId,
        decoder: &str,
        lease_ended_log_ms: u64,
        now: u64,
    ) -> Option<Rejection> {
        let s = self.standbys.get(&id)?;
        let until = lease_ended_log_ms.saturating_add(STANDBY_PRIORITY_MS);
        if s.decoder == decoder || now >= until || !self.standby_live(&s.decoder, now) {
            return None;
        }
        let g = &self.generations[&id];
        Some(reject_gen(
            RejectReason::LeaseHeld,
            format!(
                "generation {id} is kept for its standby {} until log time {until}",
                s.decoder
            ),
            g,
        ))
    }

    /// Running generations of `model` that `decoder` could stand by for: owned by another
    /// decoder with a live lease at `now`, without a live standby other than `decoder`, those
    /// whose lease runs out first first; not those of `following` (what `decoder` follows
    /// already) that it holds the standby of. A read: walks the claimable index of the model, at
    /// most [`STANDBY_SCAN_MAX`] entries. (What it followed and held filled its list: a decoder
    /// with a free slot could be offered only generations it followed already, and claimed
    /// nothing new.)
    pub fn standby_candidates(
        &self,
        model: &ModelIdentity,
        decoder: &str,
        now: u64,
        limit: usize,
        following: &[GenerationId],
    ) -> Vec<&Generation> {
        let following: rustc_hash::FxHashSet<GenerationId> = following.iter().copied().collect();
        let Some(set) = self.index.claimable.get(model) else {
            return Vec::new();
        };
        // Owned generations only (0: unowned); an entry may lag below its lease's end, so the
        // lease decides.
        set.range((1, 0)..)
            .take(STANDBY_SCAN_MAX)
            .map(|(_, id)| &self.generations[id])
            .filter(|g| g.lease_live(now) && g.lease.owner != decoder)
            .filter(|g| match self.standbys.get(&g.id) {
                None => true,
                Some(s) if s.decoder == decoder => !following.contains(&g.id),
                Some(s) => !self.standby_live(&s.decoder, now),
            })
            .take(limit)
            .collect()
    }
}
