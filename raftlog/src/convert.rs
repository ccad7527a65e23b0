//! Conversions between wire types (`tokenlog_proto::raftlog`) and domain types (`types`).
//! The only place that knows both.

use tokenlog_proto::raftlog as pb;

use crate::types::*;

impl From<pb::ModelIdentity> for ModelIdentity {
    fn from(m: pb::ModelIdentity) -> Self {
        ModelIdentity {
            weights_sha256: m.weights_sha256,
            tokenizer_sha256: m.tokenizer_sha256,
            architecture: m.architecture,
            dtype_class: m.dtype_class,
        }
    }
}

impl From<ModelIdentity> for pb::ModelIdentity {
    fn from(m: ModelIdentity) -> Self {
        pb::ModelIdentity {
            weights_sha256: m.weights_sha256,
            tokenizer_sha256: m.tokenizer_sha256,
            architecture: m.architecture,
            dtype_class: m.dtype_class,
        }
    }
}

impl From<pb::Binding> for Binding {
    fn from(b: pb::Binding) -> Self {
        let s = b.sampling.unwrap_or_default();
        let stop = b.stop.unwrap_or_default();
        Binding {
            model: b.model.unwrap_or_default().into(),
            prompt_token_ids: b.prompt_token_ids,
            prompt_text: b.prompt_text,
            sampling: SamplingConfig {
                temperature: s.temperature,
                top_p: s.top_p,
                top_k: s.top_k,
                repetition_penalty: s.repetition_penalty,
                frequency_penalty: s.frequency_penalty,
                presence_penalty: s.presence_penalty,
                seed: s.seed,
                rng_version: s.rng_version,
            },
            stop: StopConfig {
                max_tokens: stop.max_tokens,
                stop_strings: stop.stop_strings,
                eos_token_ids: stop.eos_token_ids,
            },
            mode: match pb::ResumeMode::try_from(b.mode) {
                Ok(pb::ResumeMode::Fast) => ResumeMode::Fast,
                _ => ResumeMode::Exact,
            },
            deadline_ms: b.deadline_ms,
            unowned_ms: b.unowned_ms,
        }
    }
}

impl From<Binding> for pb::Binding {
    fn from(b: Binding) -> Self {
        let s = b.sampling;
        pb::Binding {
            model: Some(b.model.into()),
            prompt_token_ids: b.prompt_token_ids,
            prompt_text: b.prompt_text,
            sampling: Some(pb::SamplingConfig {
                temperature: s.temperature,
                top_p: s.top_p,
                top_k: s.top_k,
                repetition_penalty: s.repetition_penalty,
                frequency_penalty: s.frequency_penalty,
                presence_penalty: s.presence_penalty,
                seed: s.seed,
                rng_version: s.rng_version,
            }),
            stop: Some(pb::StopConfig {
                max_tokens: b.stop.max_tokens,
                stop_strings: b.stop.stop_strings,
                eos_token_ids: b.stop.eos_token_ids,
            }),
            mode: match b.mode {
                ResumeMode::Exact => pb::ResumeMode::Exact,
                ResumeMode::Fast => pb::ResumeMode::Fast,
            } as i32,
            deadline_ms: b.deadline_ms,
            unowned_ms: b.unowned_ms,
        }
    }
}

pub fn state_to_pb(s: GenState) -> pb::GenerationState {
    match s {
        GenState::Pending => pb::GenerationState::Pending,
        GenState::Running => pb::GenerationState::Running,
        GenState::Finished => pb::GenerationState::Finished,
        GenState::Failed => pb::GenerationState::Failed,
        GenState::Cancelled => pb::GenerationState::Cancelled,
    }
}

pub fn state_from_pb(s: i32) -> Option<GenState> {
    Some(match pb::GenerationState::try_from(s).ok()? {
        pb::GenerationState::Pending => GenState::Pending,
        pb::GenerationState::Running => GenState::Running,
        pb::GenerationState::Finished => GenState::Finished,
        pb::GenerationState::Failed => GenState::Failed,
        pb::GenerationState::Cancelled => GenState::Cancelled,
        pb::GenerationState::Unspecified => return None,
    })
}

pub fn reason_to_pb(r: Option<FinishReason>) -> pb::FinishReason {
    match r {
        None => pb::FinishReason::Unspecified,
        Some(FinishReason::Stop) => pb::FinishReason::Stop,
        Some(FinishReason::Length) => pb::FinishReason::Length,
        Some(FinishReason::Error) => pb::FinishReason::Error,
        Some(FinishReason::Cancelled) => pb::FinishReason::Cancelled,
    }
}

pub fn reason_from_pb(r: i32) -> Option<FinishReason> {
    match pb::FinishReason::try_from(r).ok()? {
        pb::FinishReason::Unspecified => None,
        pb::FinishReason::Stop => Some(FinishReason::Stop),
        pb::FinishReason::Length => Some(FinishReason::Length),
        pb::FinishReason::Error => Some(FinishReason::Error),
        pb::FinishReason::Cancelled => Some(FinishReason::Cancelled),
    }
}

impl From<Lease> for pb::Lease {
    fn from(l: Lease) -> Self {
        pb::Lease {
            epoch: l.epoch,
            owner: l.owner,
            expiry_log_ms: l.expiry_log_ms,
        }
    }
}

impl From<GenerationView> for pb::GenerationInfo {
    fn from(g: GenerationView) -> Self {
        pb::GenerationInfo {
            generation_id: g.id,
            tenant: g.tenant,
            request_id: g.request_id,
            binding: Some(g.binding.into()),
            state: state_to_pb(g.state) as i32,
            lease: Some(g.lease.into()),
            frontier: g.frontier,
            finish_reason: reason_to_pb(g.finish_reason) as i32,
            finish_detail: g.finish_detail,
            chain_head: g.chain_head.to_vec(),
            submitted_log_ms: g.submitted_log_ms,
            deadline_log_ms: g.deadline_log_ms,
            unowned_ms: g.unowned_ms,
            takeovers: g.takeovers,
        }
    }
}

impl From<&Generation> for pb::GenerationInfo {
    fn from(g: &Generation) -> Self {
        GenerationView::from(g).into()
    }
}

pub fn reject_reason_to_pb(r: RejectReason) -> pb::RejectReason {
    match r {
        RejectReason::StaleEpoch => pb::RejectReason::StaleEpoch,
        RejectReason::LeaseExpired => pb::RejectReason::LeaseExpired,
        RejectReason::SeqMismatch => pb::RejectReason::SeqMismatch,
        RejectReason::RecordConflict => pb::RejectReason::RecordConflict,
        RejectReason::NotFound => pb::RejectReason::NotFound,
        RejectReason::Terminal => pb::RejectReason::Terminal,
        RejectReason::LeaseHeld => pb::RejectReason::LeaseHeld,
        RejectReason::BindingConflict => pb::RejectReason::BindingConflict,
        RejectReason::Limit => pb::RejectReason::Limit,
        RejectReason::Invalid => pb::RejectReason::Invalid,
        RejectReason::ModelMismatch => pb::RejectReason::ModelMismatch,
        RejectReason::HandoffConflict => pb::RejectReason::HandoffConflict,
        RejectReason::PipelineConflict => pb::RejectReason::PipelineConflict,
        RejectReason::Full => pb::RejectReason::Full,
    }
}

impl From<Pipeline> for pb::PipelineInfo {
    fn from(p: Pipeline) -> Self {
        pb::PipelineInfo {
            head: p.head,
            epoch: p.epoch,
            stages: p.stages.into_iter().map(Into::into).collect(),
            set_log_ms: p.set_log_ms,
        }
    }
}

impl From<PipelineStage> for pb::PipelineStage {
    fn from(s: PipelineStage) -> Self {
        pb::PipelineStage {
            stage_id: s.stage_id,
            addr: s.addr,
            first_layer: s.first_layer,
            end_layer: s.end_layer,
        }
    }
}

impl From<pb::PipelineStage> for PipelineStage {
    fn from(s: pb::PipelineStage) -> Self {
        PipelineStage {
            stage_id: s.stage_id,
            addr: s.addr,
            first_layer: s.first_layer,
            end_layer: s.end_layer,
        }
    }
}

impl StageRegistration {
    /// As the wire carries it, named `stage_id`.
    pub fn to_pb(&self, stage_id: &str) -> pb::StageRegistration {
        pb::StageRegistration {
            stage_id: stage_id.to_string(),
            addr: self.addr.clone(),
            weights_sha256: self.weights_sha256.clone(),
            first_layer: self.first_layer,
            end_layer: self.end_layer,
            expiry_log_ms: self.expiry_log_ms,
        }
    }
}

impl From<pb::StageRegistration> for StageRegistration {
    fn from(s: pb::StageRegistration) -> Self {
        StageRegistration {
            addr: s.addr,
            weights_sha256: s.weights_sha256,
            first_layer: s.first_layer,
            end_layer: s.end_layer,
            expiry_log_ms: 0,
        }
    }
}

impl From<Rejection> for pb::Rejection {
    fn from(r: Rejection) -> Self {
        pb::Rejection {
            reason: reject_reason_to_pb(r.reason) as i32,
            message: r.message,
            current_epoch: r.current_epoch,
            frontier: r.frontier,
            state: r.state.map_or(pb::GenerationState::Unspecified, state_to_pb) as i32,
        }
    }
}

pub fn record_to_pb(seq: Seq, r: &Record) -> pb::Record {
    pb::Record {
        seq,
        token_id: r.token_id,
        epoch: r.epoch,
    }
}

impl From<pb::AppendItem> for AppendItem {
    fn from(i: pb::AppendItem) -> Self {
        AppendItem {
            generation: i.generation_id,
            epoch: i.epoch,
            start_seq: i.start_seq,
            token_ids: i.token_ids,
            finish: reason_from_pb(i.finish).map(|r| (r, i.finish_detail)),
        }
    }
}

pub fn ownership_to_pb(r: Result<GenerationView, Rejection>, log_index: u64) -> pb::OwnershipResponse {
    match r {
        Ok(g) => pb::OwnershipResponse {
            ok: true,
            generation: Some(g.into()),
            rejection: None,
            log_index,
        },
        Err(e) => pb::OwnershipResponse {
            ok: false,
            generation: None,
            rejection: Some(e.into()),
            log_index,
        },
    }
}

pub fn append_to_pb(outcomes: Vec<AppendOutcome>, log_index: u64) -> pb::AppendResponse {
    let results = outcomes
        .into_iter()
        .map(|o| match o.result {
            Ok(lease) => pb::AppendResult {
                generation_id: o.generation,
                accepted: true,
                frontier: o.frontier,
                epoch: lease.epoch,
                lease_expiry_log_ms: lease.expiry_log_ms,
                rejection: None,
            },
            Err(r) => pb::AppendResult {
                generation_id: o.generation,
                accepted: false,
                frontier: o.frontier,
                epoch: r.current_epoch,
                lease_expiry_log_ms: 0,
                rejection: Some(r.into()),
            },
        })
        .collect();
    pb::AppendResponse { results, log_index }
}

impl From<pb::CacheManifest> for CacheManifest {
    fn from(m: pb::CacheManifest) -> Self {
        CacheManifest {
            model: m.model.unwrap_or_default().into(),
            cache_format: m.cache_format,
            frontier: m.frontier,
            kv_positions: m.kv_positions,
            cache_sha256: m.cache_sha256,
            bytes: m.bytes,
        }
    }
}

impl From<CacheManifest> for pb::CacheManifest {
    fn from(m: CacheManifest) -> Self {
        pb::CacheManifest {
            model: Some(m.model.into()),
            cache_format: m.cache_format,
            frontier: m.frontier,
            kv_positions: m.kv_positions,
            cache_sha256: m.cache_sha256,
            bytes: m.bytes,
        }
    }
}

pub fn handoff_phase_to_pb(p: HandoffPhase) -> pb::HandoffPhase {
    match p {
        HandoffPhase::Prepared => pb::HandoffPhase::Prepared,
        HandoffPhase::Copying => pb::HandoffPhase::Copying,
        HandoffPhase::ReceiverReady => pb::HandoffPhase::ReceiverReady,
        HandoffPhase::OwnershipCommitted => pb::HandoffPhase::OwnershipCommitted,
        HandoffPhase::SourceReleased => pb::HandoffPhase::SourceReleased,
        HandoffPhase::Aborted => pb::HandoffPhase::Aborted,
    }
}

impl From<Handoff> for pb::HandoffInfo {
    fn from(h: Handoff) -> Self {
        pb::HandoffInfo {
            attempt: h.attempt,
            generation_id: h.generation,
            source: h.source,
            source_epoch: h.source_epoch,
            destination: h.destination,
            handoff_epoch: h.handoff_epoch,
            manifest: Some(h.manifest.into()),
            phase: handoff_phase_to_pb(h.phase) as i32,
            prepared_log_ms: h.prepared_log_ms,
            phase_log_ms: h.phase_log_ms,
            detail: h.detail,
        }
    }
}

/// A wire handoff request as a command; `None` when it names no step.
pub fn handoff_from_pb(r: pb::HandoffRequest) -> Option<Command> {
    use pb::handoff_request::Step;
    let step = match r.step? {
        Step::Prepare(p) => HandoffStep::Prepare {
            epoch: p.epoch,
            source: p.source,
            destination: p.destination,
            manifest: p.manifest.unwrap_or_default().into(),
        },
        Step::Copying(c) => HandoffStep::Copying {
            attempt: c.attempt,
            source: c.source,
        },
        Step::ReceiverReady(r) => HandoffStep::ReceiverReady {
            attempt: r.attempt,
            destination: r.destination,
            handoff_epoch: r.handoff_epoch,
            cache_sha256: r.cache_sha256,
        },
        Step::Commit(c) => HandoffStep::Commit {
            attempt: c.attempt,
            destination: c.destination,
            handoff_epoch: c.handoff_epoch,
            lease_ms: c.lease_ms,
        },
        Step::SourceReleased(s) => HandoffStep::SourceReleased {
            attempt: s.attempt,
            source: s.source,
        },
        Step::Abort(a) => HandoffStep::Abort {
            attempt: a.attempt,
            by: a.by,
            detail: a.detail,
        },
    };
    Some(Command::Handoff {
        generation: r.generation_id,
        step,
    })
}

pub fn handoff_to_pb(r: Result<(Handoff, GenerationView), Rejection>, log_index: u64) -> pb::HandoffResponse {
    match r {
        Ok((h, g)) => pb::HandoffResponse {
            ok: true,
            handoff: Some(h.into()),
            generation: Some(g.into()),
            rejection: None,
            log_index,
        },
        Err(e) => pb::HandoffResponse {
            ok: false,
            handoff: None,
            generation: None,
            rejection: Some(e.into()),
            log_index,
        },
    }
}
