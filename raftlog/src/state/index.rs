//! The ordered indexes `apply` keeps over the generations ([`Indexes`]), and the invariants
//! checked after every apply: cheap ones always, full ones in debug and test builds.

use std::collections::{BTreeSet, HashMap};

use rustc_hash::FxHashMap;

use super::LogState;
use crate::chain;
use crate::types::*;

/// How far below a running lease's end its claimable entry may lag. An owner extends its lease
/// on every append; re-filing the generation each time would cost a tree update per token, so the
/// entry moves only when the lease has run ahead of it by more than this. A lagging entry is
/// never later than the lease's end (an orphan is always found) and is filtered by
/// `lease_live` when it comes up early. Below half of `LEASE_MS_MIN`, so an owner that keeps
/// appending never comes up at all.
pub(super) const CLAIMABLE_LAG_MS_MAX: u64 = crate::limits::LEASE_MS_MIN / 2;

/// Where a generation is filed in the [`Indexes`]; derived from the generation (and, for a
/// running lease, the entry it was filed under: see [`CLAIMABLE_LAG_MS_MAX`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct IndexKey {
    state: GenState,
    /// Non-terminal and no record yet: the log time `Tick` fails it at.
    deadline_log_ms: Option<u64>,
    /// Non-terminal with records: the log time `Tick` fails it at if nobody owns it by then,
    /// derived from the (possibly lagging, so never later) claimable entry.
    unowned_log_ms: Option<u64>,
    /// Terminal: when it finished (retention counts from here).
    finished_log_ms: Option<u64>,
    /// Non-terminal: the log time from which it can be acquired (0 = unowned; else the lease's
    /// end).
    claimable_log_ms: Option<u64>,
    epoch: Epoch,
    takeovers: u64,
}

impl IndexKey {
    /// The key of `g`, keeping the claimable entry of `previous` while it is within
    /// [`CLAIMABLE_LAG_MS_MAX`] below the lease's end.
    fn next(g: &Generation, previous: Option<&IndexKey>) -> IndexKey {
        let mut k = IndexKey::of(g);
        if let (Some(new), Some(Some(old))) = (k.claimable_log_ms, previous.map(|p| p.claimable_log_ms)) {
            if old > 0 && old <= new && new - old <= CLAIMABLE_LAG_MS_MAX {
                k.claimable_log_ms = Some(old);
            }
        }
        // Never later than the exact deadline (the claimable entry is never later than the
        // lease's end); `Tick` checks the exact one.
        k.unowned_log_ms = k
            .claimable_log_ms
            .filter(|_| g.frontier() > 0)
            .map(|c| c.saturating_add(g.unowned_ms));
        k
    }

    fn of(g: &Generation) -> IndexKey {
        let live = !g.state.is_terminal();
        let owned = g.lease.epoch > 0 && !g.lease.owner.is_empty();
        IndexKey {
            state: g.state,
            deadline_log_ms: (live && g.frontier() == 0).then_some(g.deadline_log_ms),
            unowned_log_ms: None,
            finished_log_ms: (!live).then_some(g.finished_log_ms),
            claimable_log_ms: live.then_some(if owned { g.lease.expiry_log_ms } else { 0 }),
            epoch: g.lease.epoch,
            takeovers: g.takeovers(),
        }
    }
}

/// Ordered indexes over the generations, kept by `apply` so that no per-tick or per-request path
/// walks the whole table (up to `GENERATIONS_MAX`). Derived: not serialized, rebuilt on load.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Indexes {
    /// The key each generation is filed under now.
    /// (Fx: keyed by generation ids the log assigns, looked up for every appended item.)
    keys: FxHashMap<GenerationId, IndexKey>,
    /// Non-terminal generations without a record, by deadline: what `Tick` may fail.
    pub(super) deadlines: BTreeSet<(u64, GenerationId)>,
    /// Non-terminal generations with records, by the time they fail if nobody owns them.
    pub(super) unowned: BTreeSet<(u64, GenerationId)>,
    /// Terminal generations by finish time: what retention prunes, oldest first.
    pub(super) finished: BTreeSet<(u64, GenerationId)>,
    /// Non-terminal generations per model, by the log time from which they can be acquired.
    pub(super) claimable: HashMap<ModelIdentity, BTreeSet<(u64, GenerationId)>>,
    /// Decoder registrations by expiry.
    pub(super) decoder_expiry: BTreeSet<(u64, String)>,
    /// Stage registrations by expiry.
    pub(super) stage_expiry: BTreeSet<(u64, String)>,
    /// Generations per state, in [`GenState::ALL`] order.
    pub(super) by_state: [u64; GenState::ALL.len()],
    /// Takeovers (grants after the first) summed over the generations in the table.
    pub(super) takeovers: u64,
    /// Non-terminal generations by lease owner (what a lost session ends), and each one's
    /// owner as filed.
    owned: BTreeSet<(String, GenerationId)>,
    owner_of: FxHashMap<GenerationId, String>,
}

impl Indexes {
    fn unfile(&mut self, id: GenerationId, k: IndexKey, model: &ModelIdentity) {
        if let Some(d) = k.deadline_log_ms {
            self.deadlines.remove(&(d, id));
        }
        if let Some(u) = k.unowned_log_ms {
            self.unowned.remove(&(u, id));
        }
        if let Some(f) = k.finished_log_ms {
            self.finished.remove(&(f, id));
        }
        if let Some(c) = k.claimable_log_ms {
            if let Some(set) = self.claimable.get_mut(model) {
                set.remove(&(c, id));
                if set.is_empty() {
                    self.claimable.remove(model);
                }
            }
        }
        self.by_state[k.state.index()] -= 1;
        self.takeovers -= k.takeovers;
    }

    fn file(&mut self, id: GenerationId, k: IndexKey, model: &ModelIdentity) {
        if let Some(d) = k.deadline_log_ms {
            self.deadlines.insert((d, id));
        }
        if let Some(u) = k.unowned_log_ms {
            self.unowned.insert((u, id));
        }
        if let Some(f) = k.finished_log_ms {
            self.finished.insert((f, id));
        }
        if let Some(c) = k.claimable_log_ms {
            match self.claimable.get_mut(model) {
                Some(set) => {
                    set.insert((c, id));
                }
                None => {
                    self.claimable.insert(model.clone(), BTreeSet::from([(c, id)]));
                }
            }
        }
        self.by_state[k.state.index()] += 1;
        self.takeovers += k.takeovers;
    }

    /// Files `g` under its current key (moving it if it was filed elsewhere).
    pub(super) fn refile(&mut self, g: &Generation) {
        self.refile_owner(
            g.id,
            (!g.state.is_terminal() && !g.lease.owner.is_empty()).then_some(&g.lease.owner),
        );
        let old = self.keys.get(&g.id).copied();
        let new = IndexKey::next(g, old.as_ref());
        if old == Some(new) {
            return;
        }
        self.keys.insert(g.id, new);
        if let Some(old) = old {
            // Invariant: epochs only grow.
            assert!(
                new.epoch >= old.epoch,
                "generation {}: epoch went from {} to {}",
                g.id,
                old.epoch,
                new.epoch
            );
            self.unfile(g.id, old, &g.binding.model);
        }
        self.file(g.id, new, &g.binding.model);
    }

    fn refile_owner(&mut self, id: GenerationId, owner: Option<&String>) {
        if self.owner_of.get(&id) == owner {
            return;
        }
        if let Some(old) = self.owner_of.remove(&id) {
            self.owned.remove(&(old, id));
        }
        if let Some(o) = owner {
            self.owned.insert((o.clone(), id));
            self.owner_of.insert(id, o.clone());
        }
    }

    /// The non-terminal generations whose lease names `owner` (live or lapsed).
    pub(super) fn owned_by(&self, owner: &str) -> Vec<GenerationId> {
        self.owned
            .range((owner.to_string(), 0)..)
            .take_while(|(o, _)| o == owner)
            .map(|&(_, id)| id)
            .collect()
    }

    /// How many non-terminal generations name `owner` in their lease (live or lapsed).
    pub fn owned_count(&self, owner: &str) -> usize {
        self.owned
            .range((owner.to_string(), 0)..)
            .take_while(|(o, _)| o == owner)
            .count()
    }

    /// Drops a generation that left the table.
    pub(super) fn remove(&mut self, g: &Generation) {
        self.refile_owner(g.id, None);
        if let Some(old) = self.keys.remove(&g.id) {
            self.unfile(g.id, old, &g.binding.model);
        }
    }

    /// Generations in state `s`.
    pub fn count(&self, s: GenState) -> u64 {
        self.by_state[s.index()]
    }

    /// Takeovers summed over the generations in the table.
    pub fn takeovers(&self) -> u64 {
        self.takeovers
    }
}

/// Up to this many generations, the check after every apply (debug and test builds) walks the
/// whole table; above it, only the generations the entry touched, so that a debug build's apply
/// stays O(1) and a test that fills the table is not quadratic (a 200,000-entry test took minutes
/// of walking on a slow machine).
#[cfg(any(test, debug_assertions))]
pub(super) const INDEX_FULL_CHECK_GENERATIONS_MAX: usize = 4_096;

/// Up to this many records, a generation's chain is walked whole after every apply that touched
/// it (debug and test builds); past it, at powers of two and when it ends.
#[cfg(any(test, debug_assertions))]
const CHAIN_WALK_EVERY_APPLY_MAX: usize = 64;

impl LogState {
    /// Check of the indexes against the table (debug and test builds, after every apply): every
    /// generation filed under its current key, and nothing else filed. Above
    /// [`INDEX_FULL_CHECK_GENERATIONS_MAX`] generations, the sizes and the generations in
    /// `touched` only.
    #[cfg(any(test, debug_assertions))]
    pub(super) fn check_indexes(&self, touched: &[GenerationId]) {
        let ix = &self.index;
        assert_eq!(
            ix.keys.len(),
            self.generations.len(),
            "index and table disagree in size"
        );
        let counted: u64 = ix.by_state.iter().sum();
        assert_eq!(counted, self.generations.len() as u64, "state counts");
        if self.generations.len() > INDEX_FULL_CHECK_GENERATIONS_MAX {
            for g in touched.iter().filter_map(|id| self.generations.get(id)) {
                let current = ix.keys.get(&g.id).copied();
                let k = IndexKey::next(g, current.as_ref());
                assert_eq!(current, Some(k), "generation {} is filed under a stale key", g.id);
                let owner = (!g.state.is_terminal() && !g.lease.owner.is_empty()).then_some(&g.lease.owner);
                assert_eq!(ix.owner_of.get(&g.id), owner, "owner index of generation {}", g.id);
            }
            return;
        }
        let claimable: usize = ix.claimable.values().map(BTreeSet::len).sum();
        let filed = ix.deadlines.len() + ix.unowned.len() + ix.finished.len() + claimable;
        let mut expected = 0;
        for g in self.generations.values() {
            let current = ix.keys.get(&g.id).copied();
            let k = IndexKey::next(g, current.as_ref());
            assert_eq!(current, Some(k), "generation {} is filed under a stale key", g.id);
            expected += usize::from(k.deadline_log_ms.is_some())
                + usize::from(k.unowned_log_ms.is_some())
                + usize::from(k.finished_log_ms.is_some())
                + usize::from(k.claimable_log_ms.is_some());
        }
        assert_eq!(filed, expected, "index entries that name no generation");
        let owned: BTreeSet<(String, GenerationId)> = self
            .generations
            .values()
            .filter(|g| !g.state.is_terminal() && !g.lease.owner.is_empty())
            .map(|g| (g.lease.owner.clone(), g.id))
            .collect();
        assert_eq!(ix.owned, owned, "owner index");
        assert_eq!(ix.owner_of.len(), owned.len(), "owner index");
        assert_eq!(ix.decoder_expiry.len(), self.decoders.len(), "decoder expiry index");
        for (id, s) in &self.standbys {
            let g = self.generations.get(id);
            assert!(
                g.is_some_and(|g| !g.state.is_terminal() && g.lease.owner != s.decoder),
                "standby {} of generation {id}: the generation ended, is gone or is its own",
                s.decoder
            );
        }
        assert!(
            ix.stage_expiry.len() == self.stages.len()
                && self
                    .stages
                    .iter()
                    .all(|(s, r)| ix.stage_expiry.contains(&(r.expiry_log_ms, s.clone()))),
            "stage expiry index"
        );
        let in_flight: BTreeSet<GenerationId> = self
            .handoffs
            .iter()
            .filter(|(_, h)| h.phase.in_flight())
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(self.handoffs_in_flight, in_flight, "in-flight handoffs");
        for (id, h) in &self.handoffs {
            let g = self.generations.get(id).expect("a handoff of a pruned generation");
            // The one-owner rule: an attempt in flight belongs to the owner at its source epoch.
            if h.phase.in_flight() {
                assert!(
                    g.lease.epoch == h.source_epoch && g.lease.owner == h.source && !g.state.is_terminal(),
                    "generation {id}: handoff attempt {} in flight, but the source no longer owns it",
                    h.attempt
                );
            }
            assert!(h.attempt <= self.next_handoff && h.handoff_epoch == h.source_epoch + 1);
        }
        for (head, p) in &self.pipelines {
            assert!(
                *head == p.head && p.epoch >= 1 && p.epoch <= self.next_pipeline_epoch,
                "pipeline of {head}: epoch {} of {} given",
                p.epoch,
                self.next_pipeline_epoch
            );
        }
    }
}

/// Cheap invariants of one generation, checked after every apply that touched it (always on):
/// a terminal generation has no live lease past its finish; records never exceed `max_tokens`;
/// without records the chain head is the genesis. The full chain walk (the head is the hash of
/// the records) runs in debug and test builds.
pub(super) fn check_generation(g: &Generation) {
    if g.state.is_terminal() {
        assert!(
            g.lease.expiry_log_ms <= g.finished_log_ms,
            "generation {}: terminal with a lease past its finish",
            g.id
        );
    }
    assert!(
        g.frontier() <= g.binding.stop.max_tokens as Seq,
        "generation {}: {} records, max_tokens {}",
        g.id,
        g.frontier(),
        g.binding.stop.max_tokens
    );
    assert!(
        g.cold.is_none() || g.state.is_terminal(),
        "generation {}: a running generation's records on disk",
        g.id
    );
    assert!(
        g.cold
            .is_none_or(|c| g.records.is_empty() || g.records.len() as Seq == c.records),
        "generation {}: records in memory and on disk disagree in number",
        g.id
    );
    if g.frontier() == 0 {
        assert_eq!(
            g.chain_head,
            chain::genesis(g.id),
            "generation {}: no records, chain head moved",
            g.id
        );
    }
    // A generation whose records are on disk was checked when they were read (every cold read
    // compares them with the chain head). The walk is O(records): done at every apply up to
    // `CHAIN_WALK_EVERY_APPLY_MAX` records, then at powers of two and once the generation ends,
    // so that a debug build's apply stays O(1) amortized per record (walking at every apply made
    // `tokenlog bench log` of a debug build quadratic: 2,590 µs of server CPU per write, 58% of
    // it SHA-256, at 16 writers over 6 s).
    #[cfg(any(test, debug_assertions))]
    if !g.on_disk_only()
        && (g.records.len() <= CHAIN_WALK_EVERY_APPLY_MAX || g.records.len().is_power_of_two() || g.state.is_terminal())
    {
        let mut h = chain::genesis(g.id);
        for (seq, r) in g.records.iter().enumerate() {
            h = chain::next(&h, g.id, seq as Seq, r);
        }
        assert_eq!(
            h, g.chain_head,
            "generation {}: chain head is not the hash of its records",
            g.id
        );
    }
}
