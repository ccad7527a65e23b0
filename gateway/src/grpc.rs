//! The `tokenlog.v1` Generation service (gRPC) on top of [`Gateway`].

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::{Stream, StreamExt};
use tokenlog_decoder::ChatMessage;
use tokenlog_proto::tokenlog as tpb;
use tokenlog_proto::tokenlog::generation_server::{Generation, GenerationServer};
use tonic::{Request, Response, Status};

use crate::core::{is_terminal, state_str, Event, Gateway, GenerateParams, Prompt};
use crate::error::GatewayError;

pub type EventStream = Pin<Box<dyn Stream<Item = Result<tpb::GenerationEvent, Status>> + Send>>;

pub struct GenerationService {
    gw: Arc<Gateway>,
}

/// Requests are bounded like HTTP bodies (`HTTP_BODY_BYTES_MAX`), not by tonic's default of
/// 4 MiB: a request of ~2M empty messages decoded to ~100 MB before its own limits were checked.
pub fn server(gw: Arc<Gateway>) -> GenerationServer<GenerationService> {
    GenerationServer::new(GenerationService { gw }).max_decoding_message_size(crate::limits::HTTP_BODY_BYTES_MAX)
}

fn tenant<T>(gw: &Gateway, req: &Request<T>) -> Result<String, Status> {
    let md = req.metadata();
    let text = |name: &str| md.get(name).map(|v| v.to_str().map_err(|_| ()));
    Ok(gw.tenant_of(text("authorization"), text("x-api-key"))?)
}

pub fn to_pb(e: &Event) -> tpb::GenerationEvent {
    let f = e.finish.as_ref();
    tpb::GenerationEvent {
        request_id: e.request_id.clone(),
        generation: e.generation,
        epoch: e.epoch,
        seq: e.seq,
        token_id: e.token_id.unwrap_or(0),
        text_delta: e.text.clone(),
        finish_reason: f.map(|f| f.reason.to_string()).unwrap_or_default(),
        finish_detail: f.map(|f| f.detail.clone()).unwrap_or_default(),
        usage: f.map(|f| tpb::Usage {
            prompt_tokens: f.prompt_tokens,
            completion_tokens: f.completion_tokens,
        }),
        last: f.is_some(),
    }
}

/// Parameters of a `GenerateRequest`, checked.
pub fn params(r: tpb::GenerateRequest) -> Result<GenerateParams, GatewayError> {
    let given = [
        !r.messages.is_empty(),
        !r.prompt.is_empty(),
        !r.prompt_token_ids.is_empty(),
    ];
    let prompt = match given {
        [true, false, false] => Prompt::Chat(
            r.messages
                .into_iter()
                .map(|m| ChatMessage::new(m.role, m.content))
                .collect(),
        ),
        [false, true, false] => Prompt::Text(r.prompt),
        [false, false, true] => Prompt::Ids(r.prompt_token_ids),
        _ => {
            return Err(GatewayError::Invalid(
                "give exactly one of messages, prompt, prompt_token_ids".into(),
            ))
        }
    };
    let fast_resume = match r.resume_mode.as_str() {
        "" | "exact" => false,
        "fast" => true,
        other => {
            return Err(GatewayError::Invalid(format!(
                "resume_mode {other:?}: expected exact or fast"
            )))
        }
    };
    let mut p = GenerateParams::new(r.request_id, prompt);
    p.model = r.model;
    p.max_tokens = (r.max_tokens > 0).then_some(r.max_tokens);
    p.sampling.temperature = r.temperature;
    p.sampling.top_p = r.top_p;
    p.sampling.top_k = r.top_k;
    p.sampling.repetition_penalty = r.repetition_penalty;
    p.sampling.frequency_penalty = r.frequency_penalty;
    p.sampling.presence_penalty = r.presence_penalty;
    p.seed = (r.seed != 0).then_some(r.seed);
    p.stop = r.stop;
    p.fast_resume = fast_resume;
    p.ignore_eos = r.ignore_eos;
    Ok(p)
}

fn stream_of(
    gw: &Arc<Gateway>,
    rx: tokio::sync::mpsc::Receiver<crate::error::Result<Event>>,
    started: Option<Instant>,
) -> EventStream {
    let metrics = gw.metrics.clone();
    let mut first = started;
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx).map(move |r| match r {
        Ok(e) => {
            if let (Some(t), Some(_)) = (first, e.token_id) {
                metrics.first_token_seconds.observe(t.elapsed().as_secs_f64());
                first = None;
            }
            Ok(to_pb(&e))
        }
        Err(e) => {
            metrics.stream_errors.inc();
            Err(Status::from(e))
        }
    }))
}

fn status_pb(info: &tokenlog_proto::raftlog::GenerationInfo) -> tpb::StatusResponse {
    let lease = info.lease.clone().unwrap_or_default();
    tpb::StatusResponse {
        request_id: info.request_id.clone(),
        generation: info.generation_id,
        state: state_str(info.state).to_string(),
        frontier: info.frontier,
        epoch: lease.epoch,
        owner: lease.owner,
        takeovers: info.takeovers,
        finish_reason: if is_terminal(info) {
            crate::core::finish_reason_str(info.finish_reason).to_string()
        } else {
            String::new()
        },
        finish_detail: info.finish_detail.clone(),
    }
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = EventStream;
    type ResumeStream = EventStream;

    async fn generate(&self, req: Request<tpb::GenerateRequest>) -> Result<Response<EventStream>, Status> {
        let started = Instant::now();
        let tenant = tenant(&self.gw, &req)?;
        let p = params(req.into_inner())?;
        let (info, _) = self.gw.submit(&tenant, &p).await?;
        let rx = self.gw.events(info, -1).await?;
        Ok(Response::new(stream_of(&self.gw, rx, Some(started))))
    }

    async fn resume(&self, req: Request<tpb::ResumeRequest>) -> Result<Response<EventStream>, Status> {
        let tenant = tenant(&self.gw, &req)?;
        let r = req.into_inner();
        if r.after_seq < -1 {
            return Err(GatewayError::Invalid(format!("after_seq {}: must be >= -1", r.after_seq)).into());
        }
        let info = self.gw.lookup(&tenant, &r.request_id).await?;
        self.gw.metrics.resumes.inc();
        tracing::info!(tenant, request_id = %r.request_id, after_seq = r.after_seq, "resume");
        let rx = self.gw.events(info, r.after_seq).await?;
        Ok(Response::new(stream_of(&self.gw, rx, None)))
    }

    async fn status(&self, req: Request<tpb::StatusRequest>) -> Result<Response<tpb::StatusResponse>, Status> {
        let tenant = tenant(&self.gw, &req)?;
        let info = self.gw.lookup(&tenant, &req.get_ref().request_id).await?;
        Ok(Response::new(status_pb(&info)))
    }

    async fn cancel(&self, req: Request<tpb::CancelRequest>) -> Result<Response<tpb::CancelResponse>, Status> {
        let tenant = tenant(&self.gw, &req)?;
        let info = self.gw.cancel(&tenant, &req.get_ref().request_id).await?;
        Ok(Response::new(tpb::CancelResponse {
            status: Some(status_pb(&info)),
        }))
    }
}
