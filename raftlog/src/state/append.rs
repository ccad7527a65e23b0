//! Appends: records of many generations in one entry, each item fenced on its own.

use std::collections::BTreeSet;

use super::{check_lease_ms, check_len, fence, reject, reject_gen, terminate, Changes, LogState};
use crate::chain;
use crate::limits::*;
use crate::types::*;

impl LogState {
    pub(super) fn append(
        &mut self,
        decoder: &str,
        lease_ms: u64,
        items: &[AppendItem],
        changes: &mut Changes,
    ) -> Vec<AppendOutcome> {
        let batch_error = check_lease_ms(lease_ms)
            .and(check_len("append items", items.len(), ITEMS_PER_APPEND_MAX))
            .err();
        // Which items repeat a generation of an earlier one: a sort of the ids, and a set only
        // when some id repeats (never, from a decoder that follows the protocol).
        let mut ids: Vec<GenerationId> = items.iter().map(|i| i.generation).collect();
        ids.sort_unstable();
        let mut seen = ids.windows(2).any(|w| w[0] == w[1]).then(BTreeSet::new);
        items
            .iter()
            .map(|item| {
                let repeated = seen.as_mut().is_some_and(|s| !s.insert(item.generation));
                let (result, frontier) = match (&batch_error, repeated) {
                    (Some(e), _) => (Err(e.clone()), self.frontier_of(item.generation)),
                    (None, true) => (
                        Err(reject(
                            RejectReason::Invalid,
                            "a generation appears twice in one append",
                        )),
                        self.frontier_of(item.generation),
                    ),
                    (None, false) => match self.append_one(decoder, lease_ms, item, changes) {
                        Ok((lease, frontier)) => (Ok(lease), frontier),
                        Err(e) => (Err(e), self.frontier_of(item.generation)),
                    },
                };
                AppendOutcome {
                    generation: item.generation,
                    result,
                    frontier,
                }
            })
            .collect()
    }

    /// A generation's frontier, 0 if it does not exist.
    fn frontier_of(&self, id: GenerationId) -> Seq {
        self.generations.get(&id).map_or(0, |g| g.frontier())
    }

    fn append_one(
        &mut self,
        decoder: &str,
        lease_ms: u64,
        item: &AppendItem,
        changes: &mut Changes,
    ) -> Result<(AppendedLease, Seq), Rejection> {
        check_len("records in one append", item.token_ids.len(), RECORDS_PER_APPEND_MAX)?;
        if let Some((_, detail)) = &item.finish {
            check_len("finish detail bytes", detail.len(), FINISH_DETAIL_BYTES_MAX)?;
        }
        let now = self.log_ms;
        let no_fence = self.faults.no_fence();
        let g = self.get_mut(item.generation)?;
        if !no_fence && (item.epoch != g.lease.epoch || g.lease.owner != decoder) {
            return Err(reject_gen(
                RejectReason::StaleEpoch,
                format!(
                    "epoch {} by {decoder} is not the current epoch {} of {}",
                    item.epoch, g.lease.epoch, g.lease.owner
                ),
                g,
            ));
        }
        if g.sealed(now) {
            // Decided without the records: a node may hold a sealed generation's on disk only.
            return Err(reject_gen(
                RejectReason::Terminal,
                format!("finished {} ms ago: sealed", now - g.finished_log_ms),
                g,
            ));
        }
        debug_assert!(!g.on_disk_only(), "an unsealed generation's records are in memory");
        let start = item.start_seq as usize;
        let end = start + item.token_ids.len();
        let committed = g.records.len();
        let overlap_ok = g
            .records
            .range(start, end)
            .zip(&item.token_ids)
            .all(|(r, t)| r.token_id == *t);
        // An identical re-send of committed records (a retry) is acknowledged without effect; a
        // finish's only if it ended the generation: by the same epoch, with the same reason, at
        // the frontier (as `finish` acknowledges a retried finish). A finish of a generation
        // that ended otherwise (cancelled, failed) was acknowledged too, and its owner believed
        // it had ended it so.
        let retried_finish = |(reason, _): &(FinishReason, String)| {
            g.state.is_terminal() && g.lease.epoch == item.epoch && g.finish_reason == Some(*reason) && end == committed
        };
        if end <= committed && overlap_ok && item.finish.as_ref().is_none_or(retried_finish) {
            return Ok((appended_lease(g), g.frontier()));
        }
        if !no_fence {
            fence(g, item.epoch, now)?;
        } else if g.state.is_terminal() {
            return Err(reject_gen(RejectReason::Terminal, "terminal", g));
        }
        if start > committed {
            return Err(reject_gen(
                RejectReason::SeqMismatch,
                format!("start_seq {start} is past the frontier {committed}"),
                g,
            ));
        }
        if end < committed && overlap_ok {
            // Only a finish gets here (a plain re-send was acknowledged above): it would end the
            // generation behind records already committed.
            return Err(reject_gen(
                RejectReason::SeqMismatch,
                format!("a finish at seq {end} is behind the frontier {committed}"),
                g,
            ));
        }
        if !overlap_ok {
            return Err(reject_gen(
                RejectReason::RecordConflict,
                format!("records from seq {start} differ from the committed ones"),
                g,
            ));
        }
        if end > g.binding.stop.max_tokens as usize {
            return Err(reject_gen(
                RejectReason::Limit,
                format!("frontier would be {end}, past max_tokens {}", g.binding.stop.max_tokens),
                g,
            ));
        }
        if g.binding.prompt_token_ids.is_empty() && end > committed {
            return Err(reject_gen(
                RejectReason::Invalid,
                "the prompt must be bound (BindPrompt) before records",
                g,
            ));
        }
        debug_assert!(start <= committed && committed <= end, "checked above");
        for &token_id in &item.token_ids[committed - start..] {
            let seq = g.frontier();
            let record = Record {
                token_id,
                epoch: item.epoch,
                log_ms: now,
            };
            g.chain_head = chain::next(&g.chain_head, g.id, seq, &record);
            g.records.push(record);
        }
        g.lease.expiry_log_ms = g.lease.expiry_log_ms.max(now + lease_ms);
        if let Some((reason, detail)) = &item.finish {
            terminate(g, *reason, detail, now);
        }
        changes.touch(g.id);
        Ok((appended_lease(g), g.frontier()))
    }
}

fn appended_lease(g: &Generation) -> AppendedLease {
    AppendedLease {
        epoch: g.lease.epoch,
        expiry_log_ms: g.lease.expiry_log_ms,
    }
}
