//! Ownership commands: acquire, renew, bind-prompt, finish, release, cancel. Every write that
//! names an epoch goes through the fence (`super::fence`).

use super::{check_lease_ms, check_len, fence, reject, reject_gen, terminate, Changes, LogState};
use crate::limits::*;
use crate::types::*;

impl LogState {
    pub(super) fn acquire(
        &mut self,
        id: GenerationId,
        decoder: &str,
        lease_ms: u64,
        model: &ModelIdentity,
        rng_version: u32,
        changes: &mut Changes,
    ) -> Result<GenerationView, Rejection> {
        check_lease_ms(lease_ms)?;
        check_len("decoder id bytes", decoder.len(), DECODER_ID_BYTES_MAX)?;
        if decoder.is_empty() {
            return Err(reject(RejectReason::Invalid, "decoder id must not be empty"));
        }
        let now = self.log_ms;
        let g = self.get_mut(id)?;
        if g.state.is_terminal() {
            return Err(reject_gen(
                RejectReason::Terminal,
                format!("generation {id} is {}", g.state.name()),
                g,
            ));
        }
        if g.binding.model != *model || g.binding.sampling.rng_version != rng_version {
            return Err(reject_gen(
                RejectReason::ModelMismatch,
                format!(
                    "generation {id} is bound to model {:?} / rng v{}; decoder serves {:?} / rng v{rng_version}",
                    g.binding.model, g.binding.sampling.rng_version, model
                ),
                g,
            ));
        }
        if g.lease_live(now) {
            if g.lease.owner == decoder {
                // A retried acquire by the current owner: same grant, no new epoch.
                return Ok((&*g).into());
            }
            return Err(reject_gen(
                RejectReason::LeaseHeld,
                format!(
                    "generation {id} is owned by {} until log time {}",
                    g.lease.owner, g.lease.expiry_log_ms
                ),
                g,
            ));
        }
        let lease_ended_log_ms = g.lease.expiry_log_ms;
        let owned_before = g.lease.epoch > 0;
        if owned_before {
            if let Some(r) = self.standby_priority(id, decoder, lease_ended_log_ms, now) {
                return Err(r);
            }
        }
        let g = self.get_mut(id)?;
        let epoch = g.lease.epoch + 1;
        g.lease = Lease {
            epoch,
            owner: decoder.to_string(),
            expiry_log_ms: now + lease_ms,
        };
        g.state = GenState::Running;
        // The audit trail keeps the newest grants only: a generation taken over again and again
        // does not grow without bound (every grant is one epoch, so takeovers = epoch - 1).
        if g.grants.len() >= GRANTS_KEPT_MAX {
            g.grants.remove(0);
        }
        g.grants.push(Grant {
            epoch,
            owner: decoder.to_string(),
            log_ms: now,
            frontier: g.frontier(),
        });
        changes.touch(id);
        let view = (&*g).into();
        // The standby took it: it is the owner now, no longer a standby.
        if self.standbys.get(&id).is_some_and(|s| s.decoder == decoder) {
            self.standbys.remove(&id);
        }
        Ok(view)
    }

    pub(super) fn renew(
        &mut self,
        id: GenerationId,
        epoch: Epoch,
        decoder: &str,
        lease_ms: u64,
        changes: &mut Changes,
    ) -> Result<GenerationView, Rejection> {
        check_lease_ms(lease_ms)?;
        let now = self.log_ms;
        if self.faults.no_fence() {
            // Planted bug: renewals are not fenced either. A superseded owner's renewal is
            // acknowledged without effect, so it goes on appending (unfenced too).
            let g = self.get_mut(id)?;
            if g.lease.epoch != epoch || g.lease.owner != decoder {
                return Ok((&*g).into());
            }
        }
        let g = self.fenced(id, epoch)?;
        if g.lease.owner != decoder {
            return Err(reject_gen(
                RejectReason::StaleEpoch,
                format!("epoch {epoch} belongs to {}", g.lease.owner),
                g,
            ));
        }
        g.lease.expiry_log_ms = g.lease.expiry_log_ms.max(now + lease_ms);
        changes.touch(id);
        Ok((&*g).into())
    }

    pub(super) fn bind_prompt(
        &mut self,
        id: GenerationId,
        epoch: Epoch,
        ids: &[TokenId],
        changes: &mut Changes,
    ) -> Result<GenerationView, Rejection> {
        check_len("prompt tokens", ids.len(), PROMPT_TOKENS_MAX)?;
        if ids.is_empty() {
            return Err(reject(RejectReason::Invalid, "prompt token ids must not be empty"));
        }
        let g = self.fenced(id, epoch)?;
        if !g.binding.prompt_token_ids.is_empty() {
            if g.binding.prompt_token_ids == ids {
                return Ok((&*g).into());
            }
            return Err(reject_gen(
                RejectReason::BindingConflict,
                "the prompt is already tokenized differently",
                g,
            ));
        }
        if g.frontier() > 0 {
            return Err(reject_gen(
                RejectReason::Invalid,
                "records exist; the prompt can no longer be bound",
                g,
            ));
        }
        g.binding.prompt_token_ids = ids.to_vec();
        changes.touch(id);
        Ok((&*g).into())
    }

    pub(super) fn finish(
        &mut self,
        id: GenerationId,
        epoch: Epoch,
        reason: FinishReason,
        detail: &str,
        changes: &mut Changes,
    ) -> Result<GenerationView, Rejection> {
        check_len("finish detail bytes", detail.len(), FINISH_DETAIL_BYTES_MAX)?;
        let now = self.log_ms;
        let g = self.get_mut(id)?;
        // A retried finish by the same epoch is acknowledged.
        if g.state.is_terminal() && g.lease.epoch == epoch && g.finish_reason == Some(reason) {
            return Ok((&*g).into());
        }
        fence(g, epoch, now)?;
        terminate(g, reason, detail, now);
        changes.touch(id);
        Ok((&*g).into())
    }

    pub(super) fn release(
        &mut self,
        id: GenerationId,
        epoch: Epoch,
        changes: &mut Changes,
    ) -> Result<GenerationView, Rejection> {
        let now = self.log_ms;
        let g = self.get_mut(id)?;
        if g.lease.epoch == epoch && g.lease.owner.is_empty() && !g.state.is_terminal() {
            return Ok((&*g).into()); // retried release
        }
        fence(g, epoch, now)?;
        end_lease(g, now);
        changes.touch(id);
        let view = (&*g).into();
        // A generation its owner gave back goes to whoever acquires it first: the standby's
        // priority is for an owner that died (a release is not a death).
        self.standbys.remove(&id);
        Ok(view)
    }

    pub(super) fn cancel(
        &mut self,
        tenant: &str,
        request_id: &str,
        now: u64,
        changes: &mut Changes,
    ) -> Result<GenerationView, Rejection> {
        let id = *self
            .requests
            .get(&(tenant.to_string(), request_id.to_string()))
            .ok_or_else(|| reject(RejectReason::NotFound, format!("request {request_id:?} does not exist")))?;
        let g = self.get_mut(id)?;
        if g.state == GenState::Cancelled {
            return Ok((&*g).into());
        }
        if g.state.is_terminal() {
            return Err(reject_gen(
                RejectReason::Terminal,
                format!("generation {id} is already {}", g.state.name()),
                g,
            ));
        }
        terminate(g, FinishReason::Cancelled, "cancelled by the client", now);
        changes.touch(id);
        Ok((&*g).into())
    }
}

/// Ends `g`'s lease at `now` with no owner: back to pending, acquirable at once (a release, or
/// its decoder's session lost).
pub(super) fn end_lease(g: &mut Generation, now: u64) {
    g.lease.owner.clear();
    g.lease.expiry_log_ms = now;
    g.state = GenState::Pending;
}
