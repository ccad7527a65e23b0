//! `raftlog.v1.Log`, served by every node. Writes go through `NodeCtx::write` (leader only;
//! others redirect); reads come from this node's applied state, after a read-index round when
//! the caller asks for linearizability.

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokenlog_proto::raftlog as pb;
use tokenlog_proto::raftlog::log_server::Log;
use tokio::sync::mpsc;
use tonic::{Request, Response as TonicResponse, Status};

use crate::auth::{acts_as, caller};
use crate::convert::{append_to_pb, handoff_from_pb, handoff_to_pb, ownership_to_pb, reason_from_pb, record_to_pb};
use crate::error::LogError;
use crate::limits::{
    APPEND_STREAM_IN_FLIGHT_MAX, CUT_OFF_POLL, PENDING_STANDING_BY_MAX, PENDING_WORK_BYTES_MAX, PENDING_WORK_LIMIT_MAX,
    WATCH_BUFFER_EVENTS, WATCH_RECORDS_PER_EVENT_MAX,
};
use crate::node::{NodeCtx, Proposed};
use crate::raft_types::Node as RaftNode;
use crate::state::LogState;
use crate::tls::Holder;
use crate::types::*;

pub struct LogService {
    ctx: Arc<NodeCtx>,
}

impl LogService {
    pub fn new(ctx: Arc<NodeCtx>) -> Self {
        LogService { ctx }
    }

    async fn ownership(&self, cmd: Command) -> Result<TonicResponse<pb::OwnershipResponse>, Status> {
        let (resp, index) = self.ctx.write(cmd).await?;
        Ok(TonicResponse::new(owned(resp, index)?))
    }

    /// For a call fenced by an epoch alone (Finish, Release, BindPrompt): `Ok` when `caller`
    /// may act as the decoder the log granted `epoch` of `generation` to, or nothing is checked
    /// (no certificates), or the epoch is older than the current one (the command's fence
    /// refuses it). An epoch names one owner for ever, so this node's state answers once it
    /// holds that grant; one that does not yet (it has not applied it) first catches up with
    /// the leader's commits. A decoder learns its epoch only from a committed grant, so an
    /// epoch still not held after that, or a generation still unknown, was never granted: the
    /// call is refused here. It was let through for the command to refuse, but a grant of that
    /// epoch to another decoder (its Acquire proposed, not yet committed) could commit first,
    /// and the command then passed the fence, which checks epochs, not owners: a decoder
    /// finished, released or bound another's generation.
    async fn acts_as_owner(
        &self,
        caller: Option<Holder>,
        generation: GenerationId,
        epoch: Epoch,
    ) -> Result<(), Status> {
        let Some(who) = caller else { return Ok(()) };
        enum Grant {
            Current(String),
            Older,
            NotYet(Epoch),
            NoGeneration,
        }
        let grant = |s: &LogState| -> Grant {
            let Some(g) = s.generations.get(&generation) else {
                return Grant::NoGeneration;
            };
            match g.lease.epoch.cmp(&epoch) {
                // Released, or ended with its session: nobody's, and the command's fence
                // answers (a retried release is acknowledged, anything else refused). It was
                // checked as held by "", and the owner's own retry got PERMISSION_DENIED.
                std::cmp::Ordering::Equal if g.lease.owner.is_empty() => Grant::Older,
                std::cmp::Ordering::Equal => Grant::Current(g.lease.owner.clone()),
                std::cmp::Ordering::Greater => Grant::Older,
                std::cmp::Ordering::Less => Grant::NotYet(g.lease.epoch),
            }
        };
        let mut found = grant(&self.ctx.sm.read());
        if matches!(found, Grant::NotYet(_) | Grant::NoGeneration) {
            self.ctx.linearize().await?;
            found = grant(&self.ctx.sm.read());
        }
        match found {
            Grant::Current(owner) => acts_as(Some(&who), &owner),
            Grant::Older => Ok(()),
            Grant::NotYet(current) => Err(Status::permission_denied(format!(
                "epoch {epoch} of generation {generation} was never granted (its epoch is {current}): a decoder \
                 acts only under an epoch the log granted it"
            ))),
            Grant::NoGeneration => Err(LogError::NotFound(format!("no generation {generation}")).into()),
        }
    }
}

/// The decoder a handoff step says it comes from (the source, the destination, or who aborts).
pub fn handoff_actor(r: &pb::HandoffRequest) -> Option<&str> {
    use pb::handoff_request::Step;
    Some(match r.step.as_ref()? {
        Step::Prepare(p) => &p.source,
        Step::Copying(c) => &c.source,
        Step::ReceiverReady(r) => &r.destination,
        Step::Commit(c) => &c.destination,
        Step::SourceReleased(r) => &r.source,
        Step::Abort(a) => &a.by,
    })
}

// What the service answers from a state, shared with the simulation's service
// (`jepsen-style-tests`, `sim_workers`), which serves the real worker from simulated nodes.

/// The generation a Get names in `s`, with its latest handoff attempt.
pub fn find(s: &LogState, req: &pb::GetRequest) -> Result<pb::GetResponse, LogError> {
    let g = if req.generation_id != 0 {
        s.generations.get(&req.generation_id)
    } else {
        s.by_request(&req.tenant, &req.request_id)
    };
    let g = g.ok_or_else(|| LogError::NotFound("no such generation".into()))?;
    Ok(pb::GetResponse {
        generation: Some(g.into()),
        handoff: s.handoffs.get(&g.id).cloned().map(Into::into),
        standby: s.standbys.get(&g.id).map(|b| b.decoder.clone()).unwrap_or_default(),
    })
}

/// The models served by the decoders registered (and not expired) in `s`.
pub fn models(s: &LogState) -> pb::ListModelsResponse {
    let mut models: std::collections::BTreeMap<String, pb::ModelInfo> = Default::default();
    for (id, d) in s.decoders.iter().filter(|(_, d)| d.expiry_log_ms > s.log_ms) {
        let m = models.entry(d.model_name.clone()).or_insert_with(|| pb::ModelInfo {
            name: d.model_name.clone(),
            identity: Some(d.model.clone().into()),
            chat_template: d.chat_template.clone(),
            context_tokens: d.context_tokens,
            ..Default::default()
        });
        m.decoders.push(id.clone());
        // Capacities are the decoders' own numbers: their sum must not overflow (a panic in a debug
        // build, nonsense in a release one).
        m.capacity = m.capacity.saturating_add(d.capacity);
        m.held.insert(id.clone(), s.index.owned_count(id) as u32);
        // Only decoders whose session is open take handoffs: one that died (its session ended,
        // and with it its leases) stays registered until its registration lapses, and a
        // draining decoder that tried it first waited for a connection to a dead host.
        if !d.handoff_addr.is_empty() && s.sessions.contains_key(id) {
            m.handoff_addrs.insert(id.clone(), d.handoff_addr.clone());
        }
    }
    pb::ListModelsResponse {
        models: models.into_values().collect(),
    }
}

/// The generations a decoder could take (or follow, for `r.standby`) in `s`, judging leases at
/// log time `now` (a node's estimate: a hint, the Acquire that follows is fenced as usual).
pub fn pending(s: &LogState, r: pb::PendingWorkRequest, now: u64) -> Result<pb::PendingWorkResponse, LogError> {
    let model: ModelIdentity = r
        .model
        .ok_or_else(|| LogError::Invalid("model is required".into()))?
        .into();
    let limit = r.limit.clamp(1, PENDING_WORK_LIMIT_MAX) as usize;
    crate::state::check_len("standing_by generations", r.standing_by.len(), PENDING_STANDING_BY_MAX)
        .map_err(LogError::Rejected)?;
    let found = if r.standby {
        s.standby_candidates(&model, &r.decoder_id, now, limit, &r.standing_by)
    } else {
        // Not what is kept for another decoder's standby: its acquire would be refused. Its
        // own standbys first.
        s.pending_work_for(&model, &r.decoder_id, now, limit, &r.standing_by)
    };
    // Within a message: cut at PENDING_WORK_BYTES_MAX. A backlog of generations with long
    // prompts made every answer too large for the message bound, and no decoder got any.
    let mut generations = Vec::with_capacity(found.len());
    let mut bytes = 0;
    for g in found {
        let info = pb::GenerationInfo::from(g);
        let n = prost::Message::encoded_len(&info) + 8;
        if !generations.is_empty() && bytes + n > PENDING_WORK_BYTES_MAX {
            break;
        }
        bytes += n;
        generations.push(info);
    }
    Ok(pb::PendingWorkResponse {
        generations,
        log_ms: s.log_ms,
    })
}

/// The next Watch event of generation `g` from `seq` (at most
/// [`WATCH_RECORDS_PER_EVENT_MAX`] records; the last one carries the terminal info), and the
/// seq after it; `None` when nothing is new. Only the records in memory are given: the terminal
/// info comes with the last record of the frontier, never while some are on disk only (those
/// are read by [`watch_cold`]).
pub fn next_event(g: &Generation, seq: Seq) -> (Option<pb::WatchEvent>, Seq) {
    let end = g.records.len().min(seq as usize + WATCH_RECORDS_PER_EVENT_MAX);
    let records: Vec<pb::Record> = (seq as usize..end)
        .map(|i| record_to_pb(i as Seq, &g.records[i]))
        .collect();
    let done = g.state.is_terminal() && end as Seq >= g.frontier();
    if records.is_empty() && !done {
        return (None, seq);
    }
    let event = pb::WatchEvent {
        records,
        terminal: done.then(|| pb::GenerationInfo::from(g)),
    };
    (Some(event), end.max(seq as usize) as Seq)
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchEvent, Status>> + Send>>;
type AppendStream = Pin<Box<dyn Stream<Item = Result<pb::AppendResponse, Status>> + Send>>;
type SessionStream = Pin<Box<dyn Stream<Item = Result<pb::SessionEvent, Status>> + Send>>;

/// The command of an Append request. An item's finish reason must be one the log knows (or
/// none): an unknown one was read as none, and the records committed while the generation
/// went on, its owner told only that they were accepted.
pub fn append_cmd(r: pb::AppendRequest) -> Result<Command, LogError> {
    if let Some((k, i)) = r
        .items
        .iter()
        .enumerate()
        .find(|(_, i)| i.finish != pb::FinishReason::Unspecified as i32 && reason_from_pb(i.finish).is_none())
    {
        return Err(LogError::Invalid(format!(
            "item {k} (generation {}): unknown finish reason {}",
            i.generation_id, i.finish
        )));
    }
    Ok(Command::Append {
        decoder: r.decoder_id,
        lease_ms: r.lease_ms,
        items: r.items.into_iter().map(AppendItem::from).collect(),
    })
}

/// An Append's answer from the command's.
pub fn appended(resp: Response, index: u64) -> Result<pb::AppendResponse, Status> {
    match resp {
        Response::Appended(outcomes) => Ok(append_to_pb(outcomes, index)),
        other => Err(unexpected(other)),
    }
}

fn required<T>(v: Option<T>, what: &str) -> Result<T, Status> {
    v.ok_or_else(|| Status::from(LogError::Invalid(format!("{what} is required"))))
}

// Each request's command and each answer's reply: the one mapping of the wire to commands,
// used by this service and by the simulation's (`jepsen-style-tests`, `sim_workers`).

pub fn submit_cmd(r: pb::SubmitRequest) -> Result<Command, Status> {
    Ok(Command::Submit {
        tenant: r.tenant,
        request_id: r.request_id,
        binding: required(r.binding, "binding")?.into(),
    })
}

pub fn acquire_cmd(r: pb::AcquireRequest) -> Result<Command, Status> {
    Ok(Command::Acquire {
        generation: r.generation_id,
        decoder: r.decoder_id,
        lease_ms: r.lease_ms,
        model: required(r.model, "model")?.into(),
        rng_version: r.rng_version,
    })
}

pub fn renew_cmd(r: pb::RenewRequest) -> Command {
    Command::Renew {
        generation: r.generation_id,
        epoch: r.epoch,
        decoder: r.decoder_id,
        lease_ms: r.lease_ms,
    }
}

pub fn bind_prompt_cmd(r: pb::BindPromptRequest) -> Command {
    Command::BindPrompt {
        generation: r.generation_id,
        epoch: r.epoch,
        prompt_token_ids: r.prompt_token_ids,
    }
}

pub fn finish_cmd(r: pb::FinishRequest) -> Result<Command, Status> {
    let reason = reason_from_pb(r.reason)
        .ok_or_else(|| Status::from(LogError::Invalid("a finish reason is required".into())))?;
    Ok(Command::Finish {
        generation: r.generation_id,
        epoch: r.epoch,
        reason,
        detail: r.detail,
    })
}

pub fn release_cmd(r: pb::ReleaseRequest) -> Command {
    Command::Release {
        generation: r.generation_id,
        epoch: r.epoch,
    }
}

pub fn cancel_cmd(r: pb::CancelRequest) -> Command {
    Command::Cancel {
        tenant: r.tenant,
        request_id: r.request_id,
    }
}

pub fn standby_cmd(r: pb::StandbyRequest) -> Result<Command, Status> {
    Ok(Command::Standby {
        generation: r.generation_id,
        decoder: r.decoder_id,
        model: required(r.model, "model")?.into(),
    })
}

pub fn register_cmd(r: pb::RegisterRequest) -> Result<Command, Status> {
    let info = DecoderInfo {
        model_name: r.model_name,
        model: required(r.model, "model")?.into(),
        capacity: r.capacity,
        chat_template: r.chat_template,
        context_tokens: r.context_tokens,
        expiry_log_ms: 0,
        handoff_addr: r.handoff_addr,
    };
    Ok(Command::RegisterDecoder {
        decoder: r.decoder_id,
        info,
        ttl_ms: r.ttl_ms,
    })
}

/// An answer of the wrong kind for its command (a bug): internal.
pub fn unexpected(other: Response) -> Status {
    LogError::Internal(format!("unexpected answer {other:?}")).into()
}

/// An ownership command's reply from its answer.
pub fn owned(resp: Response, index: u64) -> Result<pb::OwnershipResponse, Status> {
    match resp {
        Response::Ownership(r) => Ok(ownership_to_pb(r, index)),
        other => Err(unexpected(other)),
    }
}

/// A Submit's reply from its answer.
pub fn submitted(resp: Response) -> Result<pb::SubmitResponse, Status> {
    match resp {
        Response::Submitted { generation, created } => Ok(pb::SubmitResponse {
            generation: Some(generation.into()),
            created,
        }),
        Response::Ownership(Err(rej)) => Err(LogError::Rejected(rej).into()),
        other => Err(unexpected(other)),
    }
}

/// A Register's reply from its answer.
pub fn registered(resp: Response) -> Result<pb::RegisterResponse, Status> {
    match resp {
        Response::Registered(Ok(expiry_log_ms)) => Ok(pb::RegisterResponse { expiry_log_ms }),
        Response::Registered(Err(rej)) => Err(LogError::Rejected(rej).into()),
        other => Err(unexpected(other)),
    }
}

#[tonic::async_trait]
impl Log for LogService {
    async fn submit(&self, req: Request<pb::SubmitRequest>) -> Result<TonicResponse<pb::SubmitResponse>, Status> {
        let (resp, _) = self.ctx.write(submit_cmd(req.into_inner())?).await?;
        Ok(TonicResponse::new(submitted(resp)?))
    }

    async fn acquire(&self, req: Request<pb::AcquireRequest>) -> Result<TonicResponse<pb::OwnershipResponse>, Status> {
        acts_as(caller(&req).as_ref(), &req.get_ref().decoder_id)?;
        self.ownership(acquire_cmd(req.into_inner())?).await
    }

    async fn renew(&self, req: Request<pb::RenewRequest>) -> Result<TonicResponse<pb::OwnershipResponse>, Status> {
        acts_as(caller(&req).as_ref(), &req.get_ref().decoder_id)?;
        self.ownership(renew_cmd(req.into_inner())).await
    }

    async fn bind_prompt(
        &self,
        req: Request<pb::BindPromptRequest>,
    ) -> Result<TonicResponse<pb::OwnershipResponse>, Status> {
        let r = req.get_ref();
        self.acts_as_owner(caller(&req), r.generation_id, r.epoch).await?;
        self.ownership(bind_prompt_cmd(req.into_inner())).await
    }

    async fn append(&self, req: Request<pb::AppendRequest>) -> Result<TonicResponse<pb::AppendResponse>, Status> {
        acts_as(caller(&req).as_ref(), &req.get_ref().decoder_id)?;
        let (resp, index) = self.ctx.write(append_cmd(req.into_inner())?).await?;
        Ok(TonicResponse::new(appended(resp, index)?))
    }

    type AppendStreamStream = AppendStream;

    async fn append_stream(
        &self,
        req: Request<tonic::Streaming<pb::AppendRequest>>,
    ) -> Result<TonicResponse<AppendStream>, Status> {
        self.ctx.check_leader()?;
        let who = caller(&req);
        let mut inbound = req.into_inner();
        let (queued_tx, mut queued) = mpsc::channel::<Result<Proposed, Status>>(APPEND_STREAM_IN_FLIGHT_MAX);
        let (out, out_rx) = mpsc::channel(APPEND_STREAM_IN_FLIGHT_MAX);
        // Proposes each request as it arrives, in order, without waiting for the last to commit.
        let ctx = self.ctx.clone();
        tokio::spawn(async move {
            loop {
                let req = match inbound.message().await {
                    Ok(Some(r)) => r,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(error = %e, "append stream closed by the decoder");
                        break;
                    }
                };
                let proposed = match acts_as(who.as_ref(), &req.decoder_id) {
                    Ok(()) => match append_cmd(req) {
                        Ok(cmd) => ctx.propose(cmd).await.map_err(Status::from),
                        Err(e) => Err(e.into()),
                    },
                    Err(e) => Err(e),
                };
                let failed = proposed.is_err();
                if queued_tx.send(proposed).await.is_err() || failed {
                    break;
                }
            }
        });
        // Answers them in the same order; the first failure ends the stream.
        tokio::spawn(async move {
            while let Some(p) = queued.recv().await {
                let answer = match p {
                    Ok(p) => p.answer().await.map_err(Status::from),
                    Err(e) => Err(e),
                };
                let item = answer.and_then(|(r, i)| appended(r, i));
                let end = item.is_err();
                if out.send(item).await.is_err() || end {
                    break;
                }
            }
        });
        Ok(TonicResponse::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out_rx),
        )))
    }

    async fn finish(&self, req: Request<pb::FinishRequest>) -> Result<TonicResponse<pb::OwnershipResponse>, Status> {
        let r = req.get_ref();
        self.acts_as_owner(caller(&req), r.generation_id, r.epoch).await?;
        self.ownership(finish_cmd(req.into_inner())?).await
    }

    async fn release(&self, req: Request<pb::ReleaseRequest>) -> Result<TonicResponse<pb::OwnershipResponse>, Status> {
        let r = req.get_ref();
        self.acts_as_owner(caller(&req), r.generation_id, r.epoch).await?;
        self.ownership(release_cmd(req.into_inner())).await
    }

    async fn cancel(&self, req: Request<pb::CancelRequest>) -> Result<TonicResponse<pb::OwnershipResponse>, Status> {
        self.ownership(cancel_cmd(req.into_inner())).await
    }

    async fn standby(&self, req: Request<pb::StandbyRequest>) -> Result<TonicResponse<pb::OwnershipResponse>, Status> {
        acts_as(caller(&req).as_ref(), &req.get_ref().decoder_id)?;
        self.ownership(standby_cmd(req.into_inner())?).await
    }

    async fn register(&self, req: Request<pb::RegisterRequest>) -> Result<TonicResponse<pb::RegisterResponse>, Status> {
        acts_as(caller(&req).as_ref(), &req.get_ref().decoder_id)?;
        let (resp, _) = self.ctx.write(register_cmd(req.into_inner())?).await?;
        Ok(TonicResponse::new(registered(resp)?))
    }

    type SessionStream = SessionStream;

    async fn session(
        &self,
        req: Request<tonic::Streaming<pb::SessionRequest>>,
    ) -> Result<TonicResponse<SessionStream>, Status> {
        self.ctx.check_leader()?;
        let who = caller(&req);
        let mut inbound = req.into_inner();
        let first = inbound.message().await?.ok_or_else(|| {
            Status::from(LogError::Invalid(
                "a session starts with its decoder id and session id".into(),
            ))
        })?;
        // Whoever ends a session ends its decoder's leases: only that decoder may hold it.
        acts_as(who.as_ref(), &first.decoder_id)?;
        let (decoder, session) = (first.decoder_id, first.session_id);
        let (resp, _) = self
            .ctx
            .write(Command::SessionOpened {
                decoder: decoder.clone(),
                session,
            })
            .await?;
        match resp {
            Response::Session(Ok(_)) => {}
            Response::Session(Err(rej)) => return Err(LogError::Rejected(rej).into()),
            other => return Err(unexpected(other)),
        }
        let (out, out_rx) = mpsc::channel(1);
        let _ = out.try_send(Ok(pb::SessionEvent { opened: true }));
        let ctx = self.ctx.clone();
        tokio::spawn(async move {
            // Until the decoder's side ends (whatever it sends is ignored), or this node stops
            // leading.
            let drain = async { while let Ok(Some(_)) = inbound.message().await {} };
            let lost = tokio::select! {
                _ = drain => true,
                _ = out.closed() => true,
                _ = ctx.until_not_leader() => false,
            };
            if !lost {
                let _ = out
                    .send(Err(LogError::NotLeader {
                        leader_addr: ctx.leader_addr(),
                    }
                    .into()))
                    .await;
                return;
            }
            match ctx
                .write(Command::SessionLost {
                    decoder: decoder.clone(),
                    session,
                })
                .await
            {
                Ok((Response::Session(Ok(ended)), _)) => {
                    ctx.metrics.sessions_lost.inc();
                    tracing::info!(decoder, session, leases_ended = ended, "decoder session ended");
                }
                Ok((other, _)) => tracing::warn!(decoder, ?other, "unexpected answer to a lost session"),
                // Not the leader any more: the decoder's leases end by expiry.
                Err(e) => tracing::debug!(decoder, error = %e, "a lost session was not committed"),
            }
        });
        Ok(TonicResponse::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out_rx),
        )))
    }

    async fn handoff(&self, req: Request<pb::HandoffRequest>) -> Result<TonicResponse<pb::HandoffResponse>, Status> {
        if let Some(id) = handoff_actor(req.get_ref()) {
            acts_as(caller(&req).as_ref(), id)?;
        }
        let cmd = handoff_from_pb(req.into_inner())
            .ok_or_else(|| Status::from(LogError::Invalid("a handoff request names its step".into())))?;
        let (resp, index) = self.ctx.write(cmd).await?;
        match resp {
            Response::Handoff(r) => Ok(TonicResponse::new(handoff_to_pb(r, index))),
            other => Err(unexpected(other)),
        }
    }

    async fn set_pipeline(
        &self,
        req: Request<pb::SetPipelineRequest>,
    ) -> Result<TonicResponse<pb::SetPipelineResponse>, Status> {
        acts_as(caller(&req).as_ref(), &req.get_ref().head)?;
        let r = req.into_inner();
        let (resp, log_index) = self
            .ctx
            .write(Command::SetPipeline {
                head: r.head,
                expect_epoch: r.expect_epoch,
                stages: r.stages.into_iter().map(Into::into).collect(),
            })
            .await?;
        match resp {
            Response::Pipeline(Ok(p)) => Ok(TonicResponse::new(pb::SetPipelineResponse {
                pipeline: Some(p.into()),
                log_index,
            })),
            Response::Pipeline(Err(rej)) => Err(LogError::Rejected(rej).into()),
            other => Err(unexpected(other)),
        }
    }

    async fn get_pipeline(
        &self,
        req: Request<pb::GetPipelineRequest>,
    ) -> Result<TonicResponse<pb::GetPipelineResponse>, Status> {
        let r = req.into_inner();
        if r.linearizable {
            self.ctx.linearize().await?;
        }
        let p = self.ctx.sm.read().pipelines.get(&r.head).cloned();
        match p {
            Some(p) => Ok(TonicResponse::new(pb::GetPipelineResponse {
                pipeline: Some(p.into()),
            })),
            None => Err(LogError::NotFound(format!("head {:?} has no pipeline in the log", r.head)).into()),
        }
    }

    async fn register_stage(
        &self,
        req: Request<pb::RegisterStageRequest>,
    ) -> Result<TonicResponse<pb::RegisterStageResponse>, Status> {
        let who = caller(&req);
        let r = req.into_inner();
        let stage = r
            .stage
            .ok_or_else(|| Status::from(LogError::Invalid("a stage registration names its stage".into())))?;
        acts_as(who.as_ref(), &stage.stage_id)?;
        let stage_id = stage.stage_id.clone();
        let (resp, log_index) = self
            .ctx
            .write(Command::RegisterStage {
                stage_id,
                info: stage.into(),
                ttl_ms: r.ttl_ms,
            })
            .await?;
        match resp {
            Response::Registered(Ok(expiry_log_ms)) => Ok(TonicResponse::new(pb::RegisterStageResponse {
                expiry_log_ms,
                log_index,
            })),
            Response::Registered(Err(rej)) => Err(LogError::Rejected(rej).into()),
            other => Err(unexpected(other)),
        }
    }

    async fn list_stages(
        &self,
        req: Request<pb::ListStagesRequest>,
    ) -> Result<TonicResponse<pb::ListStagesResponse>, Status> {
        if req.into_inner().linearizable {
            self.ctx.linearize().await?;
        }
        let sm = self.ctx.sm.read();
        Ok(TonicResponse::new(pb::ListStagesResponse {
            stages: sm.stages.iter().map(|(id, r)| r.to_pb(id)).collect(),
            pipelines: sm.pipelines.values().cloned().map(Into::into).collect(),
            log_ms: sm.log_ms,
        }))
    }

    async fn publish_tokenizer(
        &self,
        req: Request<pb::PublishTokenizerRequest>,
    ) -> Result<TonicResponse<pb::PublishTokenizerResponse>, Status> {
        let r = req.into_inner();
        // Already applied here: answered without a write (every decoder start asks).
        if self.ctx.sm.read().tokenizers.contains_key(&r.tokenizer_sha256) {
            return Ok(TonicResponse::new(pb::PublishTokenizerResponse { stored: false }));
        }
        let (resp, _) = self
            .ctx
            .write(Command::PublishTokenizer {
                tokenizer_sha256: r.tokenizer_sha256,
                package: TokenizerPackage(r.package),
            })
            .await?;
        match resp {
            Response::Published(Ok(stored)) => Ok(TonicResponse::new(pb::PublishTokenizerResponse { stored })),
            Response::Published(Err(rej)) => Err(LogError::Rejected(rej).into()),
            other => Err(unexpected(other)),
        }
    }

    async fn get_tokenizer(
        &self,
        req: Request<pb::GetTokenizerRequest>,
    ) -> Result<TonicResponse<pb::GetTokenizerResponse>, Status> {
        let digest = req.into_inner().tokenizer_sha256;
        let package = self.ctx.sm.read().tokenizers.get(&digest).map(|p| p.0.clone());
        match package {
            Some(package) => Ok(TonicResponse::new(pb::GetTokenizerResponse { package })),
            None => Err(LogError::NotFound(format!(
                "no decoder has published tokenizer {digest} (as far as this node has applied)"
            ))
            .into()),
        }
    }

    async fn list_models(
        &self,
        _req: Request<pb::ListModelsRequest>,
    ) -> Result<TonicResponse<pb::ListModelsResponse>, Status> {
        Ok(TonicResponse::new(models(&self.ctx.sm.read())))
    }

    async fn get(&self, req: Request<pb::GetRequest>) -> Result<TonicResponse<pb::GetResponse>, Status> {
        let r = req.into_inner();
        if r.linearizable {
            self.ctx.linearize().await?;
        }
        Ok(TonicResponse::new(find(&self.ctx.sm.read(), &r)?))
    }

    type WatchStream = WatchStream;

    async fn watch(&self, req: Request<pb::WatchRequest>) -> Result<TonicResponse<WatchStream>, Status> {
        let r = req.into_inner();
        // A node cut off from the quorum would serve a stream that stops where its state
        // stopped, without a word, while the generation goes on elsewhere.
        if let Some(why) = self.ctx.cut_off() {
            return Err(LogError::Unavailable(why).into());
        }
        let applied = |ctx: &NodeCtx| ctx.sm.read().generations.contains_key(&r.generation_id);
        if !applied(&self.ctx) {
            // Not here may only mean not here yet: a follower behind the commit (paused, cut
            // off, restarted) answered NOT_FOUND for a generation the cluster holds, and its
            // client, told the generation does not exist, gave up on it. Only the leader may
            // say so, after a read index: a follower answers NOT_LEADER (the client follows
            // it to the leader), and the leader catches up with its own commit first.
            self.ctx.linearize().await?;
            if !applied(&self.ctx) {
                return Err(LogError::NotFound(format!("no generation {}", r.generation_id)).into());
            }
        }
        let (tx, rx) = mpsc::channel(WATCH_BUFFER_EVENTS);
        tokio::spawn(watch_loop(self.ctx.clone(), r.generation_id, r.from_seq, tx));
        Ok(TonicResponse::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn pending_work(
        &self,
        req: Request<pb::PendingWorkRequest>,
    ) -> Result<TonicResponse<pb::PendingWorkResponse>, Status> {
        // A hint, not a decision: judge leases by this node's estimate of log time now (the
        // applied log time on a quiet log only advances with the housekeeping tick). The
        // Acquire that follows is stamped and fenced by the leader as usual.
        let now = self.ctx.log_time_estimate();
        Ok(TonicResponse::new(pending(&self.ctx.sm.read(), req.into_inner(), now)?))
    }

    async fn cluster_status(
        &self,
        req: Request<pb::ClusterStatusRequest>,
    ) -> Result<TonicResponse<pb::ClusterStatusResponse>, Status> {
        if req.into_inner().linearizable {
            self.ctx.linearize().await?;
        }
        Ok(TonicResponse::new(self.ctx.status()))
    }

    async fn change_membership(
        &self,
        req: Request<pb::ChangeMembershipRequest>,
    ) -> Result<TonicResponse<pb::ChangeMembershipResponse>, Status> {
        use pb::change_membership_request::Op;
        match req.into_inner().op {
            Some(Op::AddLearner(m)) => {
                // The addresses go into membership, one string each way (`raft_types::Node`): a
                // space would split them wrongly, an empty one leaves the node unreachable.
                let bad = |a: &str| a.is_empty() || a.len() > 253 + 6 || a.contains(char::is_whitespace);
                if m.node_id == 0 || bad(&m.addr) || (!m.peer_addr.is_empty() && bad(&m.peer_addr)) {
                    return Err(LogError::Invalid(format!(
                        "a learner needs a positive id and host:port addresses (got id {}, addr {:?}, peer_addr {:?})",
                        m.node_id, m.addr, m.peer_addr
                    ))
                    .into());
                }
                self.ctx
                    .add_learner(m.node_id, RaftNode::new(m.addr, m.peer_addr))
                    .await?
            }
            Some(
                Op::AddVoters(pb::AddVoters { node_ids: ids }) | Op::RemoveVoters(pb::RemoveVoters { node_ids: ids }),
            ) if ids.is_empty() => return Err(LogError::Invalid("a membership change names no node".into()).into()),
            Some(Op::AddVoters(v)) => {
                self.ctx
                    .change_voters(v.node_ids.into_iter().collect(), BTreeSet::new())
                    .await?
            }
            Some(Op::RemoveVoters(v)) => {
                self.ctx
                    .change_voters(BTreeSet::new(), v.node_ids.into_iter().collect())
                    .await?
            }
            None => return Err(LogError::Invalid("no membership operation".into()).into()),
        }
        Ok(TonicResponse::new(pb::ChangeMembershipResponse {
            status: Some(self.ctx.status()),
        }))
    }

    async fn chain_heads(
        &self,
        _req: Request<pb::ChainHeadsRequest>,
    ) -> Result<TonicResponse<pb::ChainHeadsResponse>, Status> {
        let s = self.ctx.sm.read();
        let heads = s
            .generations
            .values()
            .map(|g| pb::ChainHead {
                generation_id: g.id,
                frontier: g.frontier(),
                head: g.chain_head.to_vec(),
            })
            .collect();
        Ok(TonicResponse::new(pb::ChainHeadsResponse {
            applied_index: self.ctx.sm.applied_index(),
            heads,
        }))
    }

    async fn state_digest(
        &self,
        _req: Request<pb::StateDigestRequest>,
    ) -> Result<TonicResponse<pb::StateDigestResponse>, Status> {
        let ctx = self.ctx.clone();
        let d = tokio::task::spawn_blocking(move || ctx.sm.digest())
            .await
            .map_err(|e| LogError::storage("state digest", std::io::Error::other(e)))?
            .map_err(|e| LogError::storage("state digest", e))?;
        Ok(TonicResponse::new(pb::StateDigestResponse {
            applied_index: d.applied_index,
            digest: d.digest.to_vec(),
            generations: d.generations,
            records: d.records,
        }))
    }

    async fn verify(&self, _req: Request<pb::VerifyRequest>) -> Result<TonicResponse<pb::VerifyResponse>, Status> {
        let report = self.ctx.sm.verify().map_err(|e| LogError::storage("verify", e))?;
        Ok(TonicResponse::new(pb::VerifyResponse {
            generations: report.generations,
            records: report.records,
            problems: report.problems,
        }))
    }
}

/// Streams committed records of one generation from `seq`, waking on every apply, until the
/// generation is terminal and every record has been sent (or the client goes away).
/// Planted bug `early_visibility` only: proposed, uncommitted records of `id` from `seq` on.
#[cfg(feature = "faults")]
fn early_records(ctx: &NodeCtx, id: GenerationId, seq: Seq) -> Option<Vec<pb::Record>> {
    if !ctx.faults.early_visibility() {
        return None;
    }
    let p = ctx.proposed.lock().expect("lock");
    let (start, recs) = p.get(&id)?;
    let from = seq.checked_sub(*start)? as usize;
    let out: Vec<pb::Record> = recs
        .get(from..)?
        .iter()
        .enumerate()
        .map(|(k, &(token_id, epoch))| pb::Record {
            seq: seq + k as Seq,
            token_id,
            epoch,
        })
        .collect();
    (!out.is_empty()).then_some(out)
}

#[cfg(not(feature = "faults"))]
fn early_records(_: &NodeCtx, _: GenerationId, _: Seq) -> Option<Vec<pb::Record>> {
    None
}

async fn watch_loop(
    ctx: Arc<NodeCtx>,
    id: GenerationId,
    mut seq: Seq,
    tx: mpsc::Sender<Result<pb::WatchEvent, Status>>,
) {
    let mut applied = ctx.sm.subscribe();
    loop {
        // Mark the current apply as seen before reading, so an apply after the read wakes us.
        applied.borrow_and_update();
        // Under one read of the state: a snapshot build may move a sealed generation's records
        // to disk between two reads, and the second then found none in memory and sent the
        // terminal event with the rest of them missing.
        let next = {
            let s = ctx.sm.read();
            match s.generations.get(&id) {
                None => Err(LogError::NotFound(format!("generation {id} was pruned"))),
                // Sealed and on disk: nothing more will come; read it once, outside the lock.
                Some(g) if g.on_disk_only() => Ok(WatchNext::Cold(s.cold_files().clone(), g.clone())),
                Some(g) => match next_event(g, seq) {
                    (Some(e), next) => {
                        seq = next;
                        Ok(WatchNext::Send(e))
                    }
                    // The planted bug: show what was proposed here but is not committed.
                    (None, _) => match early_records(&ctx, id, seq) {
                        Some(early) => {
                            seq += early.len() as Seq;
                            Ok(WatchNext::Send(pb::WatchEvent {
                                records: early,
                                terminal: None,
                            }))
                        }
                        None => Ok(WatchNext::Wait),
                    },
                },
            }
        };
        let next = match next {
            Ok(n) => n,
            Err(e) => {
                let _ = tx.send(Err(e.into())).await;
                return;
            }
        };
        match next {
            WatchNext::Cold(files, g) => return watch_cold(&ctx, files, g, seq, &tx).await,
            WatchNext::Send(e) => {
                let last = e.terminal.is_some();
                if tx.send(Ok(e)).await.is_err() || last {
                    return;
                }
            }
            WatchNext::Wait => {
                tokio::select! {
                    changed = applied.changed() => if changed.is_err() { return },
                    _ = tx.closed() => return,
                    // The planted bug shows proposals, which wake nothing: a leader that can no
                    // longer commit (cut off from its quorum) applies nothing either.
                    _ = early_poll(&ctx) => {}
                    // Nothing applied for a while may be a quiet generation, or a node whose
                    // state stopped: cut off from the quorum, it ends the stream and the
                    // client resumes it at another node.
                    _ = tokio::time::sleep(CUT_OFF_POLL) => {
                        if let Some(why) = ctx.cut_off() {
                            let _ = tx.send(Err(LogError::Unavailable(why).into())).await;
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// What a Watch does next, as one read of the state decided it.
enum WatchNext {
    Send(pb::WatchEvent),
    /// Nothing new: wait for the next apply.
    Wait,
    /// The generation is sealed and its records are on disk only.
    Cold(crate::sm_store::ColdFiles, Generation),
}

/// Planted bug `early_visibility` only: a short wait, so that a waiting Watch looks at the
/// proposals again; otherwise never ready.
async fn early_poll(ctx: &NodeCtx) {
    #[cfg(feature = "faults")]
    if ctx.faults.early_visibility() {
        return tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let _ = ctx;
    std::future::pending().await
}

/// The rest of a Watch on a generation whose records this node keeps on disk only: read them
/// once (checked against the chain head), send them from `seq` in events of at most
/// [`WATCH_RECORDS_PER_EVENT_MAX`], the last with the terminal info.
async fn watch_cold(
    ctx: &NodeCtx,
    files: crate::sm_store::ColdFiles,
    g: Generation,
    mut seq: Seq,
    tx: &mpsc::Sender<Result<pb::WatchEvent, Status>>,
) {
    let id = g.id;
    let read = tokio::task::spawn_blocking(move || {
        let r = g.cold.expect("a generation on disk");
        crate::sm_store::read_cold(&files, &g, &r).map(|records| (g, records))
    })
    .await;
    let (g, records) = match read {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => {
            tracing::error!(generation = id, error = %e, "records on disk cannot be served");
            let e = LogError::Integrity {
                dir: ctx.sm.snapshot_dir().display().to_string(),
                problems: vec![e.to_string()],
            };
            let _ = tx.send(Err(e.into())).await;
            return;
        }
        Err(e) => {
            let _ = tx.send(Err(LogError::Internal(e.to_string()).into())).await;
            return;
        }
    };
    loop {
        let start = (seq as usize).min(records.len());
        let end = records.len().min(start + WATCH_RECORDS_PER_EVENT_MAX);
        let done = end == records.len();
        let event = pb::WatchEvent {
            records: (start..end).map(|i| record_to_pb(i as Seq, &records[i])).collect(),
            terminal: done.then(|| pb::GenerationInfo::from(&g)),
        };
        if tx.send(Ok(event)).await.is_err() || done {
            return;
        }
        seq = end as Seq;
    }
}
