//! `/v1/chat/completions` and `/v1/completions`: create (streaming or not), resume by
//! `Last-Event-ID`, and the SSE chunks.

use super::*;

#[derive(Clone, Copy, PartialEq)]
pub(super) enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn id(self, rid: &str) -> String {
        match self {
            Kind::Chat => format!("chatcmpl-{rid}"),
            Kind::Completion => format!("cmpl-{rid}"),
        }
    }
    fn stream_url(self, rid: &str) -> String {
        match self {
            Kind::Chat => format!("/v1/chat/completions/{}/stream", encode_path(rid)),
            Kind::Completion => format!("/v1/completions/{}/stream", encode_path(rid)),
        }
    }
}

pub(super) async fn chat_completions(State(gw): Gw, h: HeaderMap, body: Bytes) -> Result<Response> {
    let tenant = tenant(&gw, &h)?;
    let b = parse_body(&body)?;
    refuse_unsupported(&b, Endpoint::Chat)?;
    let msgs = messages(
        b.get("messages")
            .ok_or_else(|| GatewayError::Invalid("messages is required".into()))?,
    )?;
    let p = common_params(
        &b,
        request_id(&h)?,
        Prompt::Chat(msgs),
        &["max_tokens", "max_completion_tokens"],
    )?;
    let stream = opt_bool(&b, "stream")?;
    let usage = include_usage(&b, stream)?;
    create(gw, h, tenant, p, Streaming { stream, usage }, Kind::Chat).await
}

pub(super) async fn completions(State(gw): Gw, h: HeaderMap, body: Bytes) -> Result<Response> {
    let tenant = tenant(&gw, &h)?;
    let b = parse_body(&body)?;
    refuse_unsupported(&b, Endpoint::Completion)?;
    let prompt = match b.get("prompt") {
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => Prompt::Text(a[0].as_str().unwrap_or("").into()),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => Prompt::Ids(
            a.iter()
                .map(|v| {
                    u32::try_from(v.as_u64().unwrap_or(u64::MAX))
                        .map_err(|_| GatewayError::Invalid("token id too large".into()))
                })
                .collect::<Result<_>>()?,
        ),
        _ => {
            return Err(GatewayError::Invalid(
                "prompt must be a string or an array of token ids".into(),
            ))
        }
    };
    let p = common_params(&b, request_id(&h)?, prompt, &["max_tokens"])?;
    let stream = opt_bool(&b, "stream")?;
    let usage = include_usage(&b, stream)?;
    create(gw, h, tenant, p, Streaming { stream, usage }, Kind::Completion).await
}

/// Whether a create call streams, and whether its stream ends with a usage chunk
/// (`stream_options.include_usage`).
#[derive(Clone, Copy)]
pub(super) struct Streaming {
    pub stream: bool,
    pub usage: bool,
}

pub(super) async fn create(
    gw: Arc<Gateway>,
    h: HeaderMap,
    tenant: String,
    p: GenerateParams,
    Streaming { stream, usage }: Streaming,
    kind: Kind,
) -> Result<Response> {
    let after = last_event_id(&h)?;
    if after >= 0 {
        if !stream {
            // The answer would be the text after it, with the whole generation's usage.
            return Err(GatewayError::Invalid(
                "Last-Event-ID resumes a stream: send it with \"stream\": true, or to GET the request's stream URL"
                    .into(),
            ));
        }
        // A resume: of the request the key names, which must exist (without a key, or with one
        // never used, a new generation was made and its events up to Last-Event-ID skipped).
        if !h.contains_key("idempotency-key") {
            return Err(GatewayError::Invalid(
                "Last-Event-ID resumes the request its Idempotency-Key names: send the key".into(),
            ));
        }
        gw.lookup(&tenant, &p.request_id).await?;
    }
    let (info, model) = gw.submit(&tenant, &p).await?;
    let rid = p.request_id.clone();
    let gid = info.generation_id;
    let url = kind.stream_url(&rid);
    if !stream {
        let rx = gw.events(info.clone(), after).await?;
        let (text, last) = collect(rx).await?;
        let f = last.finish.as_ref().expect("last");
        if f.reason == "error" {
            return Err(GatewayError::Failed(f.detail.clone()));
        }
        let choice = match kind {
            Kind::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": null, "finish_reason": openai_finish(f.reason)}),
            Kind::Completion => json!({"index": 0, "text": text, "logprobs": null,
                                       "finish_reason": openai_finish(f.reason)}),
        };
        let object = if kind == Kind::Chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        let body = json!({"id": kind.id(&rid), "object": object, "created": created_s(&info), "model": model,
                          "choices": [choice], "usage": usage_json(&last), "system_fingerprint": null});
        return Ok(with_headers(Json(body).into_response(), &rid, gid, Some(url)));
    }
    let started = (after < 0).then(Instant::now);
    stream_after(gw, info, after, kind, model, started, usage).await
}

pub(super) async fn chat_resume(State(gw): Gw, h: HeaderMap, Path(rid): Path<String>) -> Result<Response> {
    resume(gw, h, rid, Kind::Chat).await
}

pub(super) async fn completions_resume(State(gw): Gw, h: HeaderMap, Path(rid): Path<String>) -> Result<Response> {
    resume(gw, h, rid, Kind::Completion).await
}

pub(super) async fn resume(gw: Arc<Gateway>, h: HeaderMap, rid: String, kind: Kind) -> Result<Response> {
    let tenant = tenant(&gw, &h)?;
    let after = last_event_id(&h)?;
    let info = gw.lookup(&tenant, &rid).await?;
    gw.metrics.resumes.inc();
    tracing::info!(tenant, request_id = %rid, after, "http resume");
    let model = gw.model_name(&info).await;
    stream_after(gw, info, after, kind, model, None, false).await
}

/// The SSE stream of a request's events after `after` (a GET resume, or a streaming POST,
/// created or repeated); `include_usage`: a chunk with the usage and no choices before
/// `[DONE]`.
async fn stream_after(
    gw: Arc<Gateway>,
    info: pb::GenerationInfo,
    after: i64,
    kind: Kind,
    model: String,
    started: Option<Instant>,
    include_usage: bool,
) -> Result<Response> {
    let rid = info.request_id.clone();
    let gid = info.generation_id;
    let url = Some(kind.stream_url(&rid));
    if is_terminal(&info) && after == i64::from(info.frontier) {
        // The client saw the last event and lost the connection before what ends the stream:
        // only that is left to send, `[DONE]`, or a failed generation's error again (its
        // stream ends with it, without `[DONE]`). A repeated POST used to get an empty stream.
        let (tx, rx) = mpsc::channel(2);
        if info.state == pb::GenerationState::Failed as i32 {
            let _ = tx.try_send(
                SseEvent::default().data(
                    GatewayError::Failed(info.finish_detail.clone())
                        .openai_body()
                        .to_string(),
                ),
            );
        } else {
            if include_usage {
                let (prompt, completion) = (prompt_tokens(&info), info.frontier);
                let chunk = usage_chunk(kind, &rid, created_s(&info), &model, prompt, completion);
                let _ = tx.try_send(SseEvent::default().data(chunk.to_string()));
            }
            let _ = tx.try_send(SseEvent::default().data("[DONE]"));
        }
        return Ok(with_headers(sse(rx).into_response(), &rid, gid, url));
    }
    let created = created_s(&info);
    let rx = gw.events(info, after).await?;
    let resp = chunk_stream(gw, rx, kind, rid.clone(), model, created, started, include_usage).into_response();
    Ok(with_headers(resp, &rid, gid, url))
}

/// The chunk `stream_options.include_usage` asks for: no choices, the whole request's usage
/// (not a log event: no `id:`).
fn usage_chunk(kind: Kind, rid: &str, created: u64, model: &str, prompt: u32, completion: u32) -> Value {
    let object = match kind {
        Kind::Chat => "chat.completion.chunk",
        Kind::Completion => "text_completion",
    };
    json!({"id": kind.id(rid), "object": object, "created": created, "model": model, "choices": [],
           "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})
}

/// SSE of chat.completion.chunk / text_completion objects, `id: <seq>` on each, `[DONE]` last
/// (after a usage chunk with `include_usage`).
#[allow(clippy::too_many_arguments)]
pub(super) fn chunk_stream(
    gw: Arc<Gateway>,
    mut rx: mpsc::Receiver<Result<Event>>,
    kind: Kind,
    rid: String,
    model: String,
    created: u64,
    started: Option<Instant>,
    include_usage: bool,
) -> Sse<impl Stream<Item = std::result::Result<SseEvent, Infallible>>> {
    let (tx, out) = mpsc::channel(SSE_BUFFER_EVENTS);
    tokio::spawn(async move {
        let mut first = started;
        // Until the client leaves: then this task ends and drops `rx`, and the pump behind it
        // gives the stream's slot and its Watch back at once (waiting for the next event to
        // notice held them for as long as the generation stalled, or for ever after a resume
        // past its end).
        while let Some(ev) = tokio::select! {
            ev = rx.recv() => ev,
            () = tx.closed() => None,
        } {
            let ev = match ev {
                Ok(e) => e,
                Err(e) => {
                    gw.metrics.stream_errors.inc();
                    let _ = tx.send(SseEvent::default().data(e.openai_body().to_string())).await;
                    return;
                }
            };
            if let (Some(t), Some(_)) = (first, ev.token_id) {
                gw.metrics.first_token_seconds.observe(t.elapsed().as_secs_f64());
                first = None;
            }
            let finish = ev.finish.as_ref();
            if finish.is_some_and(|f| f.reason == "error") {
                let err = GatewayError::Failed(finish.unwrap().detail.clone());
                let _ = tx
                    .send(
                        SseEvent::default()
                            .id(ev.seq.to_string())
                            .data(err.openai_body().to_string()),
                    )
                    .await;
                return;
            }
            let fr = finish.map(|f| openai_finish(f.reason));
            let mut chunk = match kind {
                Kind::Chat => {
                    let mut delta = json!({"content": ev.text});
                    if ev.seq == 0 {
                        delta["role"] = json!("assistant");
                    }
                    json!({"id": kind.id(&rid), "object": "chat.completion.chunk", "created": created, "model": model,
                           "system_fingerprint": null,
                           "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": fr}]})
                }
                Kind::Completion => json!({"id": kind.id(&rid), "object": "text_completion", "created": created,
                                           "model": model,
                                           "choices": [{"index": 0, "text": ev.text, "logprobs": null, "finish_reason": fr}]}),
            };
            chunk["tokenlog"] =
                json!({"seq": ev.seq, "generation": ev.generation, "epoch": ev.epoch, "token_id": ev.token_id});
            if finish.is_some() {
                chunk["usage"] = usage_json(&ev);
            } else if include_usage {
                chunk["usage"] = Value::Null;
            }
            if tx
                .send(SseEvent::default().id(ev.seq.to_string()).data(chunk.to_string()))
                .await
                .is_err()
            {
                return;
            }
            if let Some(f) = finish {
                if include_usage {
                    let usage = usage_chunk(kind, &rid, created, &model, f.prompt_tokens, f.completion_tokens);
                    if tx.send(SseEvent::default().data(usage.to_string())).await.is_err() {
                        return;
                    }
                }
                let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                return;
            }
        }
    });
    sse(out)
}
