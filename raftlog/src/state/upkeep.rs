//! Upkeep: decoder registrations, the leader's `Tick` (deadlines, retention), and the queries
//! the leader and decoders ask between entries (`tick_due`, `pending_work`). All served from the
//! indexes: nothing here walks the table.

use super::{check_lease_ms, check_len, reject, terminate, Changes, LogState};
use crate::limits::*;
use crate::types::*;

impl LogState {
    pub(super) fn register(
        &mut self,
        decoder: &str,
        info: &DecoderInfo,
        ttl_ms: u64,
        changes: &mut Changes,
    ) -> Result<u64, Rejection> {
        check_lease_ms(ttl_ms)?;
        check_len("decoder id bytes", decoder.len(), DECODER_ID_BYTES_MAX)?;
        check_len("model name bytes", info.model_name.len(), MODEL_NAME_BYTES_MAX)?;
        check_len("handoff address bytes", info.handoff_addr.len(), HANDOFF_ADDR_BYTES_MAX)?;
        if decoder.is_empty() || info.model_name.is_empty() || info.model.weights_sha256.is_empty() {
            return Err(reject(
                RejectReason::Invalid,
                "decoder id, model name and model identity are required",
            ));
        }
        if !self.decoders.contains_key(decoder) && self.decoders.len() >= DECODERS_MAX {
            return Err(reject(
                RejectReason::Full,
                format!("the log holds {DECODERS_MAX} decoder registrations"),
            ));
        }
        // Planted `diverge` (one node of a fault-suite run): a state no other replica holds.
        let expiry_log_ms = self.log_ms + ttl_ms + u64::from(self.faults.diverge());
        self.decoders.insert(
            decoder.to_string(),
            DecoderInfo {
                expiry_log_ms,
                ..info.clone()
            },
        );
        changes.decoders_changed();
        Ok(expiry_log_ms)
    }

    pub(super) fn publish_tokenizer(&mut self, digest: &str, package: &TokenizerPackage) -> Result<bool, Rejection> {
        if digest.len() != 64 || !digest.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(reject(
                RejectReason::Invalid,
                "a tokenizer digest is 64 lowercase hex digits (the SHA-256 of its canonical JSON)",
            ));
        }
        if package.0.is_empty() {
            return Err(reject(RejectReason::Invalid, "the tokenizer package is empty"));
        }
        check_len("tokenizer package bytes", package.0.len(), TOKENIZER_PACKAGE_BYTES_MAX)?;
        // The digest names the tokenizer: whoever published first, the package stays (a
        // decoder of another release may encode the same tokenizer in other bytes).
        if self.tokenizers.contains_key(digest) {
            return Ok(false);
        }
        if self.tokenizers.len() >= TOKENIZERS_MAX {
            return Err(reject(
                RejectReason::Full,
                format!("the log holds {TOKENIZERS_MAX} tokenizers (its limit)"),
            ));
        }
        self.tokenizers.insert(digest.to_string(), package.clone());
        Ok(true)
    }

    pub(super) fn session_opened(&mut self, decoder: &str, session: u64) -> Result<(), Rejection> {
        check_len("decoder id bytes", decoder.len(), DECODER_ID_BYTES_MAX)?;
        if decoder.is_empty() || session == 0 {
            return Err(reject(
                RejectReason::Invalid,
                "a session names its decoder and a non-zero id",
            ));
        }
        if !self.sessions.contains_key(decoder) && self.sessions.len() >= DECODERS_MAX {
            return Err(reject(
                RejectReason::Full,
                format!("the log holds {DECODERS_MAX} decoder sessions"),
            ));
        }
        self.sessions.insert(decoder.to_string(), session);
        Ok(())
    }

    /// Ends every live lease of `decoder` if `session` is its current session; how many.
    pub(super) fn session_lost(&mut self, decoder: &str, session: u64, changes: &mut Changes) -> u32 {
        if self.sessions.get(decoder) != Some(&session) {
            return 0;
        }
        self.sessions.remove(decoder);
        // A destination that is gone will not become ready (its own leases end below, which
        // aborts the attempts it is the source of).
        self.abort_handoffs_to(decoder);
        let now = self.log_ms;
        let mut ended = 0;
        for id in self.index.owned_by(decoder) {
            let Some(g) = self.generations.get_mut(&id) else {
                continue;
            };
            if g.state.is_terminal() || g.lease.owner != decoder || g.lease.expiry_log_ms <= now {
                continue;
            }
            super::ownership::end_lease(g, now);
            changes.touch(id);
            ended += 1;
        }
        ended
    }

    pub(super) fn tick(&mut self, retention_ms: u64, changes: &mut Changes) -> Response {
        let now = self.log_ms;
        let lapsed: Vec<String> = self
            .index
            .decoder_expiry
            .range(..(now + 1, String::new()))
            .map(|(_, d)| d.clone())
            .collect();
        for d in &lapsed {
            self.decoders.remove(d);
            // A decoder that stopped registering is gone (or cut off, and then its stream broke
            // too); what it still holds ends by its leases. Keeps the table bounded.
            self.sessions.remove(d);
            // A head gone: its stages serve nobody under its name any more.
            self.pipelines.remove(d);
        }
        if !lapsed.is_empty() {
            changes.decoders_changed();
        }
        while let Some((t, s)) = self.index.stage_expiry.first().cloned() {
            if t > now {
                break;
            }
            self.index.stage_expiry.pop_first();
            self.stages.remove(&s);
        }
        for id in self.abort_stalled_handoffs(now) {
            changes.touch(id);
        }
        let mut failed = 0;
        for id in self.deadline_due(now) {
            let g = self.generations.get_mut(&id).expect("indexed generations exist");
            terminate(
                g,
                FinishReason::Error,
                "no compatible decoder produced a record before the deadline",
                now,
            );
            // Filed as finished now, so retention (0 included) sees it in this same tick.
            self.index.refile(g);
            changes.touch(id);
            failed += 1;
        }
        for id in self.unowned_due(now) {
            let g = self.generations.get_mut(&id).expect("indexed generations exist");
            let detail = format!(
                "no decoder owned it for {} ms after the lease of epoch {} ended at log time {}; \
                 its {} committed records stay readable",
                g.unowned_ms,
                g.lease.epoch,
                g.lease.expiry_log_ms,
                g.frontier()
            );
            terminate(g, FinishReason::Error, &detail, now);
            self.index.refile(g);
            changes.touch(id);
            failed += 1;
        }
        let expired: Vec<GenerationId> = self.retention_due(now, retention_ms).collect();
        let mut gone = Vec::with_capacity(expired.len());
        for id in &expired {
            if let Some(g) = self.generations.remove(id) {
                self.index.remove(&g);
                self.requests.remove(&(g.tenant.clone(), g.request_id.clone()));
                if let Some(n) = self.tenants.get_mut(&g.tenant) {
                    *n -= 1;
                    if *n == 0 {
                        self.tenants.remove(&g.tenant);
                    }
                }
                self.handoffs.remove(id);
                self.handoffs_in_flight.remove(id);
                self.standbys.remove(id);
                gone.push((g.id, g.tenant, g.request_id));
            }
        }
        changes.prune(gone);
        Response::Ticked {
            failed,
            pruned: expired.len() as u32,
        }
    }

    /// [`Command::NewLeader`]: every lease live at `before` (the previous entry's log time)
    /// keeps the time it had left then. Walks only the claimable index from just below `before`
    /// (running leases), not the whole table.
    pub(super) fn new_leader(&mut self, before: u64, changes: &mut Changes) -> Response {
        let by_ms = self.log_ms - before;
        if by_ms == 0 {
            return Response::LeasesExtended { leases: 0, by_ms };
        }
        let from = (before.saturating_sub(super::index::CLAIMABLE_LAG_MS_MAX), 0);
        let live: Vec<GenerationId> = self
            .index
            .claimable
            .values()
            .flat_map(|set| set.range(from..).map(|&(_, id)| id))
            .collect();
        let mut leases = 0;
        for id in live {
            let Some(g) = self.generations.get_mut(&id) else {
                continue;
            };
            let owned = g.lease.epoch > 0 && !g.lease.owner.is_empty();
            if owned && !g.state.is_terminal() && g.lease.expiry_log_ms > before {
                g.lease.expiry_log_ms += by_ms;
                changes.touch(id);
                leases += 1;
            }
        }
        Response::LeasesExtended { leases, by_ms }
    }

    /// Generations without a record whose deadline has passed at `now` and that no live lease
    /// holds (a decoder that owns one is about to write its first record).
    fn deadline_due(&self, now: u64) -> Vec<GenerationId> {
        self.index
            .deadlines
            .range(..(now + 1, 0))
            .map(|&(_, id)| id)
            .filter(|id| !self.generations[id].lease_live(now))
            .collect()
    }

    /// Generations with records that nobody has owned for their `unowned_ms` at `now` (the
    /// index entry may come up early by the claimable lag: the exact deadline decides).
    fn unowned_due(&self, now: u64) -> Vec<GenerationId> {
        if self.faults.no_unowned_deadline() {
            return Vec::new();
        }
        self.index
            .unowned
            .range(..(now + 1, 0))
            .map(|&(_, id)| id)
            // The exact deadline is past the lease's end, so a due one has no live owner.
            .filter(|id| self.generations[id].unowned_deadline_log_ms().is_some_and(|d| d <= now))
            .collect()
    }

    /// Terminal generations finished at least `retention_ms` before `now`, oldest first.
    fn retention_due(&self, now: u64, retention_ms: u64) -> impl Iterator<Item = GenerationId> + '_ {
        // Retention 0 prunes every terminal generation, even one finished at a log time past
        // `now` (a leader clock behind the log).
        let end = match retention_ms {
            0 => u64::MAX,
            r if now >= r => now - r + 1,
            _ => 0,
        };
        self.index.finished.range(..(end, 0)).map(|&(_, id)| id)
    }

    /// Whether a `Tick` would change anything at `now` (the leader asks before proposing one).
    pub fn tick_due(&self, now: u64, retention_ms: u64) -> bool {
        self.index.decoder_expiry.first().is_some_and(|(t, _)| *t <= now)
            || self.index.stage_expiry.first().is_some_and(|(t, _)| *t <= now)
            || !self.deadline_due(now).is_empty()
            || !self.unowned_due(now).is_empty()
            || self.retention_due(now, retention_ms).next().is_some()
            || self.handoff_tick_due(now)
    }

    /// Generations a decoder serving `model` could take at `now`: orphaned ones first (an owner
    /// whose lease ran out: clients are waiting on their streams), the longest orphaned first;
    /// then unowned ones (new or released), oldest first.
    pub fn pending_work(&self, model: &ModelIdentity, now: u64, limit: usize) -> Vec<&Generation> {
        self.claimable(model, now).take(limit).collect()
    }

    /// [`LogState::pending_work`] as `decoder` may take it: first those of `standing_by` (the
    /// generations it follows as a hot standby) that it may acquire now and is the standby of;
    /// then the rest, none kept for another decoder's standby (its acquire would be refused),
    /// left out before the list is cut to `limit`. Cut first, the generations kept for others
    /// could fill the whole list, and a decoder got nothing while others were free. The walk
    /// past `limit` is bounded by the generations in a standby's priority window. (Its own came
    /// in the index's order: a standby with one free slot was offered another orphan first,
    /// re-prefilled it, and the one it followed waited out its priority window.)
    pub fn pending_work_for(
        &self,
        model: &ModelIdentity,
        decoder: &str,
        now: u64,
        limit: usize,
        standing_by: &[GenerationId],
    ) -> Vec<&Generation> {
        let mut own: Vec<&Generation> = Vec::new();
        let mut listed: rustc_hash::FxHashSet<GenerationId> = Default::default();
        for id in standing_by {
            let Some(g) = self.generations.get(id) else {
                continue;
            };
            let mine = self.standbys.get(id).is_some_and(|s| s.decoder == decoder);
            let takeable = !g.state.is_terminal() && !g.lease_live(now) && g.binding.model == *model;
            if mine && takeable && own.len() < limit && listed.insert(*id) {
                own.push(g);
            }
        }
        let rest = limit - own.len();
        let others: Vec<&Generation> = self
            .claimable(model, now)
            .filter(|g| !listed.contains(&g.id) && !self.kept_for_standby(g, decoder, now))
            .take(rest)
            .collect();
        own.extend(others);
        own
    }

    /// The claimable index of `model` in [`LogState::pending_work`]'s order.
    fn claimable(&self, model: &ModelIdentity, now: u64) -> impl Iterator<Item = &Generation> {
        let set = self.index.claimable.get(model);
        let orphaned = set
            .into_iter()
            .flat_map(move |s| s.range((1, 0)..(now.saturating_add(1), 0)));
        let unowned = set.into_iter().flat_map(|s| s.range(..(1, 0)));
        orphaned
            .chain(unowned)
            .map(|(_, id)| &self.generations[id])
            .filter(move |g| !g.lease_live(now))
    }
}
