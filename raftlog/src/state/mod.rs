//! The pure state machine. `LogState::apply` takes one stamped command and returns the answer
//! and what it changed; it reads no clock (time is the entry's `log_ms`, made monotone here),
//! does no I/O, and is deterministic, so every replica that applies the same entries holds the
//! same state. Durability is `sm_store`'s job (snapshots plus the log), not apply's.
//!
//! Fencing (CONTRACT §2): every write that names an epoch is checked, in this order, against
//! the generation's current epoch, its terminal state, its lease at the entry's log time, and
//! (for appends) the frontier.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use crate::chain;
use crate::faults::Faults;
use crate::limits::*;
use crate::types::*;

mod append;
mod handoff;
mod index;
mod ownership;
mod pipeline;
mod standby;
mod upkeep;

use index::check_generation;
pub use index::Indexes;

/// What applied entries changed. Apply uses the per-entry part to keep its indexes; the rest
/// (rare events) accumulates over a batch for tests and metrics. Nothing per record or per
/// append lives here: the hot path pays only for the per-entry list of touched generations.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Changes {
    /// Generations removed by retention, with their request keys.
    pub pruned: Vec<(GenerationId, String, String)>,
    /// The decoder registrations changed.
    pub decoders: bool,
    /// What the entry being applied touched (cleared by every `apply`): the generations to
    /// re-file in the indexes and check.
    entry_touched: Vec<GenerationId>,
    entry_decoders: bool,
}

impl Changes {
    /// Generation `id` changed (or was created).
    pub(crate) fn touch(&mut self, id: GenerationId) {
        // Re-filing is idempotent: an id touched twice in one entry is filed twice.
        self.entry_touched.push(id);
    }

    pub(crate) fn decoders_changed(&mut self) {
        self.decoders = true;
        self.entry_decoders = true;
    }

    /// Generations `gone` (with their request keys) were pruned: the entry does not re-file
    /// them. One pass over the entry's touched list for all.
    pub(crate) fn prune(&mut self, gone: Vec<(GenerationId, String, String)>) {
        if gone.is_empty() {
            return;
        }
        let ids: BTreeSet<GenerationId> = gone.iter().map(|(id, _, _)| *id).collect();
        self.entry_touched.retain(|id| !ids.contains(id));
        self.pruned.extend(gone);
    }
}

/// The whole replicated state, without Raft metadata.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LogState {
    pub generations: BTreeMap<GenerationId, Generation>,
    /// `(tenant, request_id)` -> generation. Derived from `generations`; not serialized.
    #[serde(skip)]
    pub requests: HashMap<(String, String), GenerationId>,
    /// Generations per tenant. Derived; not serialized.
    #[serde(skip)]
    pub tenants: HashMap<String, u64>,
    pub next_generation: GenerationId,
    /// The log time of the last applied entry; never goes backwards.
    pub log_ms: u64,
    /// Live decoder registrations by decoder id (expired ones are dropped by `Tick`).
    pub decoders: BTreeMap<String, DecoderInfo>,
    /// Tokenizer packages by tokenizer digest ([`Command::PublishTokenizer`]), kept for good.
    pub tokenizers: BTreeMap<String, TokenizerPackage>,
    /// Each decoder's current session ([`Command::SessionOpened`]); dropped when it is lost or
    /// when the decoder's registration lapses.
    pub sessions: BTreeMap<String, u64>,
    /// The latest planned-handoff attempt of each generation that had one ([`Command::Handoff`]);
    /// dropped with its generation.
    pub handoffs: BTreeMap<GenerationId, Handoff>,
    /// Handoff attempts so far: the next attempt's id is one more.
    pub next_handoff: u64,
    /// Each pipeline head's composition ([`Command::SetPipeline`]), by the head's decoder id;
    /// dropped when the head's registration lapses.
    pub pipelines: BTreeMap<String, Pipeline>,
    /// Pipeline epochs given so far (to every head): the next composition's epoch is one more.
    pub next_pipeline_epoch: u64,
    /// Live stage registrations by stage id ([`Command::RegisterStage`]); lapsed ones are
    /// dropped by `Tick`.
    pub stages: BTreeMap<String, StageRegistration>,
    /// Each running generation's hot standby, if one claimed it ([`Command::Standby`]); dropped
    /// when the generation ends or is pruned and when the standby acquires it.
    pub standbys: BTreeMap<GenerationId, Standby>,
    /// The generations whose attempt is in flight (before its ownership commit, not aborted).
    /// Derived from `handoffs`; not serialized.
    #[serde(skip)]
    pub handoffs_in_flight: BTreeSet<GenerationId>,
    /// Ordered indexes over `generations` and `decoders`. Derived; not serialized.
    #[serde(skip)]
    pub index: Indexes,
    /// Planted bugs (fault suite builds only); set by the storage layer, not replicated.
    #[serde(skip)]
    pub faults: Faults,
}

fn reject(reason: RejectReason, message: impl Into<String>) -> Rejection {
    Rejection {
        reason,
        message: message.into(),
        current_epoch: 0,
        frontier: 0,
        state: None,
    }
}

fn reject_gen(reason: RejectReason, message: impl Into<String>, g: &Generation) -> Rejection {
    Rejection {
        reason,
        message: message.into(),
        current_epoch: g.lease.epoch,
        frontier: g.frontier(),
        state: Some(g.state),
    }
}

pub(crate) fn check_len(what: &str, len: usize, max: usize) -> Result<(), Rejection> {
    if len > max {
        return Err(reject(
            RejectReason::Limit,
            format!("{what} is {len}, the limit is {max}"),
        ));
    }
    Ok(())
}

fn check_lease_ms(lease_ms: u64) -> Result<(), Rejection> {
    if !(LEASE_MS_MIN..=LEASE_MS_MAX).contains(&lease_ms) {
        return Err(reject(
            RejectReason::Limit,
            format!("lease_ms is {lease_ms}, it must be in {LEASE_MS_MIN}..={LEASE_MS_MAX}"),
        ));
    }
    Ok(())
}

/// What is checked of a command before it is proposed, from the command alone (no state):
/// its size (`COMMAND_BYTES_MAX`) and the length of the strings the log would keep for good
/// (a model identity's fields, a chat template). What needs the state is `apply`'s.
pub fn precheck(cmd: &Command) -> Result<(), Rejection> {
    precheck_sized(cmd).map(|_| ())
}

/// [`precheck`], and the command's encoded size (measured once, for the proposer's entry bound).
pub fn precheck_sized(cmd: &Command) -> Result<u64, Rejection> {
    let size = bincode::serialized_size(cmd)
        .map_err(|e| reject(RejectReason::Invalid, format!("the command does not encode: {e}")))?;
    if size > COMMAND_BYTES_MAX {
        return Err(reject(
            RejectReason::Limit,
            format!("a command of {size} bytes; at most {COMMAND_BYTES_MAX}"),
        ));
    }
    check_kept_strings(cmd)?;
    check_submit(cmd)?;
    Ok(size)
}

/// What `apply` would refuse of a `Submit` without looking at the state (a `Batch`'s too):
/// refused before it is proposed, instead of stored by every replica first (a 16 MiB prompt
/// text passes the command bound and is refused by `apply`'s 256 KiB one).
fn check_submit(cmd: &Command) -> Result<(), Rejection> {
    match cmd {
        Command::Submit {
            tenant,
            request_id,
            binding,
        } => submit_fields(tenant, request_id, binding),
        Command::Batch(cmds) => cmds.iter().try_for_each(check_submit),
        _ => Ok(()),
    }
}

/// A submit's tenant, request id and binding, against their bounds ([`validate_binding`]).
fn submit_fields(tenant: &str, request_id: &str, binding: &Binding) -> Result<(), Rejection> {
    if tenant.is_empty() || request_id.is_empty() {
        return Err(reject(RejectReason::Invalid, "tenant and request_id must not be empty"));
    }
    check_len("tenant bytes", tenant.len(), TENANT_BYTES_MAX)
        .and(check_len("request_id bytes", request_id.len(), REQUEST_ID_BYTES_MAX))
        .and(validate_binding(binding))
}

/// The strings of `cmd` the log keeps for good, against their bounds (a `Batch`'s commands too;
/// its size was measured whole).
fn check_kept_strings(cmd: &Command) -> Result<(), Rejection> {
    let identity = |m: &ModelIdentity| -> Result<(), Rejection> {
        for (what, f) in [
            ("weights sha256 bytes", &m.weights_sha256),
            ("tokenizer sha256 bytes", &m.tokenizer_sha256),
            ("architecture bytes", &m.architecture),
            ("dtype class bytes", &m.dtype_class),
        ] {
            check_len(what, f.len(), MODEL_IDENTITY_FIELD_BYTES_MAX)?;
        }
        Ok(())
    };
    match cmd {
        Command::Submit { binding, .. } => identity(&binding.model),
        Command::Acquire { model, .. } => identity(model),
        Command::Register { info, .. } => {
            check_len("chat template bytes", info.chat_template.len(), CHAT_TEMPLATE_BYTES_MAX)?;
            identity(&info.model)
        }
        Command::RegisterDecoder { info, .. } => {
            check_len("chat template bytes", info.chat_template.len(), CHAT_TEMPLATE_BYTES_MAX)?;
            identity(&info.model)
        }
        Command::Batch(cmds) => cmds.iter().try_for_each(check_kept_strings),
        _ => Ok(()),
    }
}

/// Validates a submitted binding against the named limits.
pub fn validate_binding(b: &Binding) -> Result<(), Rejection> {
    let has_ids = !b.prompt_token_ids.is_empty();
    let has_text = !b.prompt_text.is_empty();
    if has_ids == has_text {
        return Err(reject(
            RejectReason::Invalid,
            "exactly one of prompt_token_ids and prompt_text must be set",
        ));
    }
    check_len("prompt tokens", b.prompt_token_ids.len(), PROMPT_TOKENS_MAX)?;
    check_len("prompt text bytes", b.prompt_text.len(), PROMPT_TEXT_BYTES_MAX)?;
    check_len("stop strings", b.stop.stop_strings.len(), STOP_STRINGS_MAX)?;
    for s in &b.stop.stop_strings {
        check_len("stop string bytes", s.len(), STOP_STRING_BYTES_MAX)?;
        if s.is_empty() {
            return Err(reject(RejectReason::Invalid, "a stop string is empty"));
        }
    }
    check_len("eos ids", b.stop.eos_token_ids.len(), EOS_IDS_MAX)?;
    if b.stop.max_tokens == 0 || b.stop.max_tokens > GENERATION_TOKENS_MAX {
        return Err(reject(
            RejectReason::Limit,
            format!(
                "max_tokens is {}, it must be in 1..={GENERATION_TOKENS_MAX}",
                b.stop.max_tokens
            ),
        ));
    }
    if b.deadline_ms > DEADLINE_MS_MAX {
        return Err(reject(
            RejectReason::Limit,
            format!("deadline_ms is {}, the limit is {DEADLINE_MS_MAX}", b.deadline_ms),
        ));
    }
    if b.unowned_ms != 0 && !(LEASE_MS_MIN..=UNOWNED_MS_MAX).contains(&b.unowned_ms) {
        return Err(reject(
            RejectReason::Invalid,
            format!(
                "unowned_ms is {}, it must be 0 (the default) or in {LEASE_MS_MIN}..={UNOWNED_MS_MAX}",
                b.unowned_ms
            ),
        ));
    }
    let s = &b.sampling;
    let finite = [
        s.temperature,
        s.top_p,
        s.repetition_penalty,
        s.frequency_penalty,
        s.presence_penalty,
    ];
    if finite.iter().any(|x| !x.is_finite()) || s.temperature < 0.0 || !(0.0..=1.0).contains(&s.top_p) {
        return Err(reject(
            RejectReason::Invalid,
            "sampling parameters must be finite, temperature >= 0, top_p in [0, 1]",
        ));
    }
    if b.model.weights_sha256.is_empty() {
        return Err(reject(RejectReason::Invalid, "the binding names no model"));
    }
    Ok(())
}

impl LogState {
    /// Applies one stamped command. Pure: same state + same request = same result. Keeps the
    /// indexes and checks the invariants of every generation it touched.
    pub fn apply(&mut self, req: &Request, changes: &mut Changes) -> Response {
        changes.entry_touched.clear();
        changes.entry_decoders = false;
        let response = self.apply_command(req, changes);
        if !self.handoffs_in_flight.is_empty() {
            for i in 0..changes.entry_touched.len() {
                self.after_entry_handoff(changes.entry_touched[i]);
            }
        }
        for id in &changes.entry_touched {
            if let Some(g) = self.generations.get(id) {
                self.index.refile(g);
                check_generation(g);
                // A standby has nothing to take over once its generation ended.
                if g.state.is_terminal() {
                    self.standbys.remove(id);
                }
            }
        }
        if changes.entry_decoders {
            self.index.decoder_expiry = self
                .decoders
                .iter()
                .map(|(d, i)| (i.expiry_log_ms, d.clone()))
                .collect();
        }
        #[cfg(any(test, debug_assertions))]
        self.check_indexes(&changes.entry_touched);
        response
    }

    fn apply_command(&mut self, req: &Request, changes: &mut Changes) -> Response {
        // Log time is monotone even across leaders whose clocks disagree.
        let before = self.log_ms;
        self.log_ms = self.log_ms.max(req.log_ms);
        match &*req.cmd {
            Command::Batch(cmds) => Response::Batch(
                cmds.iter()
                    .map(|c| match c {
                        Command::Batch(_) => Response::Ownership(Err(reject(
                            RejectReason::Invalid,
                            "a batch inside a batch is not applied",
                        ))),
                        c => self.dispatch(c, before, changes),
                    })
                    .collect(),
            ),
            c => self.dispatch(c, before, changes),
        }
    }

    /// One command at the current log time; `before` is the log time of the previous entry.
    fn dispatch(&mut self, cmd: &Command, before: u64, changes: &mut Changes) -> Response {
        let now = self.log_ms;
        match cmd {
            Command::Submit {
                tenant,
                request_id,
                binding,
            } => self.submit(tenant, request_id, binding, changes),
            Command::Acquire {
                generation,
                decoder,
                lease_ms,
                model,
                rng_version,
            } => Response::Ownership(self.acquire(*generation, decoder, *lease_ms, model, *rng_version, changes)),
            Command::Renew {
                generation,
                epoch,
                decoder,
                lease_ms,
            } => Response::Ownership(self.renew(*generation, *epoch, decoder, *lease_ms, changes)),
            Command::BindPrompt {
                generation,
                epoch,
                prompt_token_ids,
            } => Response::Ownership(self.bind_prompt(*generation, *epoch, prompt_token_ids, changes)),
            Command::Append {
                decoder,
                lease_ms,
                items,
            } => Response::Appended(self.append(decoder, *lease_ms, items, changes)),
            Command::Finish {
                generation,
                epoch,
                reason,
                detail,
            } => Response::Ownership(self.finish(*generation, *epoch, *reason, detail, changes)),
            Command::Release { generation, epoch } => Response::Ownership(self.release(*generation, *epoch, changes)),
            Command::Cancel { tenant, request_id } => {
                Response::Ownership(self.cancel(tenant, request_id, now, changes))
            }
            Command::Register { decoder, info, ttl_ms } => {
                Response::Registered(self.register(decoder, &info.clone().into(), *ttl_ms, changes))
            }
            Command::RegisterDecoder { decoder, info, ttl_ms } => {
                Response::Registered(self.register(decoder, info, *ttl_ms, changes))
            }
            Command::Tick { retention_ms } => self.tick(*retention_ms, changes),
            Command::NewLeader => self.new_leader(before, changes),
            Command::PublishTokenizer {
                tokenizer_sha256,
                package,
            } => Response::Published(self.publish_tokenizer(tokenizer_sha256, package)),
            Command::SessionOpened { decoder, session } => {
                Response::Session(self.session_opened(decoder, *session).map(|()| 0))
            }
            Command::SessionLost { decoder, session } => {
                Response::Session(Ok(self.session_lost(decoder, *session, changes)))
            }
            Command::Handoff { generation, step } => Response::Handoff(self.handoff(*generation, step, changes)),
            Command::SetPipeline {
                head,
                expect_epoch,
                stages,
            } => Response::Pipeline(self.set_pipeline(head, *expect_epoch, stages)),
            Command::RegisterStage { stage_id, info, ttl_ms } => {
                Response::Registered(self.register_stage(stage_id, info, *ttl_ms))
            }
            Command::Standby {
                generation,
                decoder,
                model,
            } => Response::Ownership(self.standby(*generation, decoder, model)),
            Command::Batch(_) => unreachable!("apply_command unpacks batches"),
        }
    }

    /// Rebuilds every derived index (after decoding a snapshot or loading rows).
    pub fn rebuild_index(&mut self) {
        self.requests = self
            .generations
            .values()
            .map(|g| ((g.tenant.clone(), g.request_id.clone()), g.id))
            .collect();
        self.tenants.clear();
        self.index = Indexes::default();
        for g in self.generations.values() {
            *self.tenants.entry(g.tenant.clone()).or_default() += 1;
            self.index.refile(g);
        }
        self.index.decoder_expiry = self
            .decoders
            .iter()
            .map(|(d, i)| (i.expiry_log_ms, d.clone()))
            .collect();
        self.index.stage_expiry = self.stages.iter().map(|(s, r)| (r.expiry_log_ms, s.clone())).collect();
        self.handoffs_in_flight = self
            .handoffs
            .iter()
            .filter(|(_, h)| h.phase.in_flight())
            .map(|(id, _)| *id)
            .collect();
    }

    pub fn by_request(&self, tenant: &str, request_id: &str) -> Option<&Generation> {
        let id = self.requests.get(&(tenant.to_string(), request_id.to_string()))?;
        self.generations.get(id)
    }

    fn submit(&mut self, tenant: &str, request_id: &str, binding: &Binding, changes: &mut Changes) -> Response {
        let fail = |r: Rejection| Response::Ownership(Err(r));
        if let Err(r) = submit_fields(tenant, request_id, binding) {
            return fail(r);
        }
        if let Some(g) = self.by_request(tenant, request_id) {
            if same_submission(&g.binding, binding) {
                return Response::Submitted {
                    generation: g.into(),
                    created: false,
                };
            }
            return fail(reject_gen(
                RejectReason::BindingConflict,
                format!("request {request_id:?} exists with different parameters"),
                g,
            ));
        }
        if self.generations.len() >= GENERATIONS_MAX {
            return fail(reject(
                RejectReason::Full,
                format!("the log holds {GENERATIONS_MAX} generations"),
            ));
        }
        if !self.tenants.contains_key(tenant) && self.tenants.len() >= TENANTS_MAX {
            return fail(reject(
                RejectReason::Full,
                format!("the log holds {TENANTS_MAX} tenants"),
            ));
        }
        self.next_generation += 1;
        let id = self.next_generation;
        let deadline_ms = if binding.deadline_ms == 0 {
            DEADLINE_MS_DEFAULT
        } else {
            binding.deadline_ms
        };
        let g = Generation {
            id,
            tenant: tenant.to_string(),
            request_id: request_id.to_string(),
            binding: binding.clone(),
            state: GenState::Pending,
            lease: Lease::default(),
            records: Records::default(),
            chain_head: chain::genesis(id),
            finish_reason: None,
            finish_detail: String::new(),
            submitted_log_ms: self.log_ms,
            deadline_log_ms: self.log_ms + deadline_ms,
            unowned_ms: match binding.unowned_ms {
                0 => UNOWNED_MS_DEFAULT,
                ms => ms,
            },
            finished_log_ms: 0,
            grants: Vec::new(),
            cold: None,
        };
        let view = (&g).into();
        self.generations.insert(id, g);
        self.requests.insert((tenant.to_string(), request_id.to_string()), id);
        *self.tenants.entry(tenant.to_string()).or_default() += 1;
        changes.touch(id);
        Response::Submitted {
            generation: view,
            created: true,
        }
    }

    fn get_mut(&mut self, id: GenerationId) -> Result<&mut Generation, Rejection> {
        self.generations
            .get_mut(&id)
            .ok_or_else(|| reject(RejectReason::NotFound, format!("generation {id} does not exist")))
    }

    /// The fence shared by renew, bind-prompt, finish and release: current epoch, not terminal,
    /// lease live at the entry's log time.
    fn fenced(&mut self, id: GenerationId, epoch: Epoch) -> Result<&mut Generation, Rejection> {
        let now = self.log_ms;
        let g = self.get_mut(id)?;
        fence(g, epoch, now)?;
        Ok(g)
    }
}

/// Whether `incoming` is the submission that created `stored`. A text prompt is tokenized later
/// (BindPrompt adds the ids to the stored binding), so a retried text submission is compared
/// without them.
fn same_submission(stored: &Binding, incoming: &Binding) -> bool {
    if stored.prompt_text.is_empty() || stored.prompt_token_ids.is_empty() {
        return stored == incoming;
    }
    let mut as_submitted = stored.clone();
    as_submitted.prompt_token_ids.clear();
    as_submitted == *incoming
}

fn fence(g: &Generation, epoch: Epoch, now: u64) -> Result<(), Rejection> {
    if epoch != g.lease.epoch {
        return Err(reject_gen(
            RejectReason::StaleEpoch,
            format!("epoch {epoch} is not the current epoch {}", g.lease.epoch),
            g,
        ));
    }
    if g.state.is_terminal() {
        return Err(reject_gen(
            RejectReason::Terminal,
            format!("generation {} is {}", g.id, g.state.name()),
            g,
        ));
    }
    if !g.lease_live(now) {
        return Err(reject_gen(
            RejectReason::LeaseExpired,
            format!(
                "the lease of epoch {epoch} ended at log time {}; now is {now}",
                g.lease.expiry_log_ms
            ),
            g,
        ));
    }
    Ok(())
}

fn terminate(g: &mut Generation, reason: FinishReason, detail: &str, now: u64) {
    g.state = match reason {
        FinishReason::Stop | FinishReason::Length => GenState::Finished,
        FinishReason::Error => GenState::Failed,
        FinishReason::Cancelled => GenState::Cancelled,
    };
    g.finish_reason = Some(reason);
    g.finish_detail = detail.to_string();
    g.finished_log_ms = now;
    g.lease.expiry_log_ms = g.lease.expiry_log_ms.min(now);
}

#[cfg(test)]
mod tests;
