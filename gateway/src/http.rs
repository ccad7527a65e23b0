//! The OpenAI-compatible HTTP API, on the same [`Gateway`] as the gRPC service.
//!
//! - `GET /v1/models`, `GET /v1/models/{name}`
//! - `POST /v1/chat/completions`, `POST /v1/completions`: streaming (SSE) and not. The
//!   `Idempotency-Key` header is the request id (one is generated when absent and returned in
//!   `x-request-id`). Every SSE event carries `id: <seq>`; the stream resumes at
//!   `GET /v1/chat/completions/{request_id}/stream` (or `/v1/completions/...`) after the seq in
//!   `Last-Event-ID` (the URL is in the `x-tokenlog-stream-url` header). A POST repeated with the
//!   same key and a `Last-Event-ID` resumes too.
//! - `POST /v1/responses` (`background`, `stream`), `GET /v1/responses/{id}` and
//!   `GET /v1/responses/{id}?stream=true&starting_after=N`, `POST /v1/responses/{id}/cancel`.
//!   Event `sequence_number`s are a pure function of the log (see [`response_events`]), so a
//!   stream resumed on any gateway continues exactly after N.
//! - `GET /metrics` (Prometheus), `GET /healthz`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
use serde_json::{json, Value};
use tokenlog_decoder::ChatMessage;
use tokenlog_proto::raftlog as pb;
use tokio::sync::mpsc;

use crate::core::{is_terminal, random_request_id, Event, Gateway, GenerateParams, Prompt};
use crate::error::{GatewayError, Result};
use crate::limits::HTTP_BODY_BYTES_MAX;

type Gw = State<Arc<Gateway>>;

pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{name}", get(get_model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/chat/completions/{rid}/stream", get(chat_resume))
        .route("/v1/completions", post(completions))
        .route("/v1/completions/{rid}/stream", get(completions_resume))
        .route("/v1/responses", post(create_response))
        .route("/v1/responses/{id}", get(get_response))
        .route("/v1/responses/{id}/cancel", post(cancel_response))
        .layer(DefaultBodyLimit::max(HTTP_BODY_BYTES_MAX))
        .with_state(gw)
}

async fn metrics(State(gw): Gw) -> impl IntoResponse {
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        gw.metrics.render(),
    )
}

fn tenant(gw: &Gateway, h: &HeaderMap) -> Result<String> {
    let auth = h.get("authorization").and_then(|v| v.to_str().ok());
    let xkey = h.get("x-api-key").and_then(|v| v.to_str().ok());
    gw.http_request();
    gw.tenant(crate::tenants::key_from_headers(auth, xkey))
}

fn parse_body(body: &Bytes) -> Result<serde_json::Map<String, Value>> {
    let text = std::str::from_utf8(body)
        .map_err(|e| GatewayError::Invalid(format!("request body is not valid UTF-8: {e}")))?;
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(GatewayError::Invalid("request body must be a JSON object".into())),
        Err(e) => Err(GatewayError::Invalid(format!("request body is not valid JSON: {e}"))),
    }
}

/// The request id: the `Idempotency-Key` header, or a fresh one.
fn request_id(h: &HeaderMap) -> Result<String> {
    match h.get("idempotency-key") {
        Some(v) => Ok(v
            .to_str()
            .map_err(|_| GatewayError::Invalid("Idempotency-Key is not visible ASCII".into()))?
            .to_string()),
        None => Ok(random_request_id()),
    }
}

/// The seq in `Last-Event-ID` (-1 when absent).
fn last_event_id(h: &HeaderMap) -> Result<i64> {
    match h.get("last-event-id") {
        None => Ok(-1),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .filter(|n| *n >= -1)
            .ok_or_else(|| GatewayError::Invalid("Last-Event-ID must be the seq of an event (an integer)".into())),
    }
}

fn opt_f32(b: &serde_json::Map<String, Value>, k: &str) -> Result<Option<f32>> {
    match b.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| GatewayError::Invalid(format!("{k} must be a number"))),
    }
}

fn opt_u64(b: &serde_json::Map<String, Value>, k: &str) -> Result<Option<u64>> {
    match b.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| GatewayError::Invalid(format!("{k} must be a non-negative integer"))),
    }
}

fn opt_bool(b: &serde_json::Map<String, Value>, k: &str) -> Result<bool> {
    match b.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(x)) => Ok(*x),
        Some(_) => Err(GatewayError::Invalid(format!("{k} must be true or false"))),
    }
}

fn opt_str<'a>(b: &'a serde_json::Map<String, Value>, k: &str) -> Result<Option<&'a str>> {
    match b.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(GatewayError::Invalid(format!("{k} must be a string"))),
    }
}

/// Text of a message `content`: a string, or an array of `{type: text|input_text|output_text, text}`.
fn content_text(v: &Value) -> Result<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                let ty = p.get("type").and_then(Value::as_str).unwrap_or("text");
                if !matches!(ty, "text" | "input_text" | "output_text") {
                    return Err(GatewayError::Invalid(format!(
                        "content part type {ty:?} is not supported (text only)"
                    )));
                }
                out.push_str(
                    p.get("text")
                        .and_then(Value::as_str)
                        .ok_or_else(|| GatewayError::Invalid("content part without text".into()))?,
                );
            }
            Ok(out)
        }
        Value::Null => Ok(String::new()),
        _ => Err(GatewayError::Invalid(
            "message content must be a string or an array of parts".into(),
        )),
    }
}

fn messages(v: &Value) -> Result<Vec<ChatMessage>> {
    let arr = v
        .as_array()
        .ok_or_else(|| GatewayError::Invalid("messages must be an array".into()))?;
    arr.iter()
        .map(|m| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| GatewayError::Invalid("each message needs a role".into()))?;
            Ok(ChatMessage::new(
                role,
                content_text(m.get("content").unwrap_or(&Value::Null))?,
            ))
        })
        .collect()
}

/// Sampling and stop fields shared by the three create calls.
fn common_params(
    b: &serde_json::Map<String, Value>,
    rid: String,
    prompt: Prompt,
    max_keys: &[&str],
) -> Result<GenerateParams> {
    let mut p = GenerateParams::new(rid, prompt);
    p.model = opt_str(b, "model")?.unwrap_or("").to_string();
    for k in max_keys {
        if let Some(n) = opt_u64(b, k)? {
            p.max_tokens = Some(u32::try_from(n).map_err(|_| GatewayError::Invalid(format!("{k} is too large")))?);
        }
    }
    // OpenAI's default temperature is 1.
    p.temperature = opt_f32(b, "temperature")?.unwrap_or(1.0);
    p.top_p = opt_f32(b, "top_p")?.unwrap_or(1.0);
    p.frequency_penalty = opt_f32(b, "frequency_penalty")?.unwrap_or(0.0);
    p.presence_penalty = opt_f32(b, "presence_penalty")?.unwrap_or(0.0);
    p.repetition_penalty = opt_f32(b, "repetition_penalty")?.unwrap_or(1.0);
    if let Some(k) = opt_u64(b, "top_k")? {
        p.top_k = k.min(u64::from(u32::MAX)) as u32;
    }
    p.seed = opt_u64(b, "seed")?;
    p.stop = match b.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| GatewayError::Invalid("stop must be a string or an array of strings".into()))
            })
            .collect::<Result<_>>()?,
        Some(_) => {
            return Err(GatewayError::Invalid(
                "stop must be a string or an array of strings".into(),
            ))
        }
    };
    p.ignore_eos = opt_bool(b, "ignore_eos")?;
    if let Some(n) = opt_u64(b, "n")? {
        if n != 1 {
            return Err(GatewayError::Invalid("n must be 1".into()));
        }
    }
    Ok(p)
}

fn encode_path(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn with_headers(mut r: Response, rid: &str, generation: u64, stream_url: Option<String>) -> Response {
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(rid) {
        h.insert("x-request-id", v);
    }
    h.insert("x-tokenlog-generation", HeaderValue::from(generation));
    if let Some(u) = stream_url.and_then(|u| HeaderValue::from_str(&u).ok()) {
        h.insert("x-tokenlog-stream-url", u);
    }
    r
}

fn created_s(info: &pb::GenerationInfo) -> u64 {
    info.submitted_log_ms / 1000
}

fn sse(rx: mpsc::Receiver<SseEvent>) -> Sse<impl Stream<Item = std::result::Result<SseEvent, Infallible>>> {
    use futures::StreamExt;
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok)).keep_alive(KeepAlive::default())
}

/// Reads every event of a stream into (text, last event); fails on a stream error.
async fn collect(mut rx: mpsc::Receiver<Result<Event>>) -> Result<(String, Event)> {
    let mut text = String::new();
    while let Some(e) = rx.recv().await {
        let e = e?;
        text.push_str(&e.text);
        if e.finish.is_some() {
            return Ok((text, e));
        }
    }
    Err(GatewayError::Unavailable(
        "event stream ended before the generation did".into(),
    ))
}

fn openai_finish(reason: &str) -> &'static str {
    match reason {
        "length" => "length",
        _ => "stop",
    }
}

fn usage_json(e: &Event) -> Value {
    let f = e.finish.as_ref().expect("last event");
    json!({"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
           "total_tokens": f.prompt_tokens + f.completion_tokens})
}

// ------------------------------------------------------------------ models

async fn list_models(State(gw): Gw, h: HeaderMap) -> Result<Json<Value>> {
    tenant(&gw, &h)?;
    let models = gw.models().await?;
    let data: Vec<Value> = models.iter().map(model_json).collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

fn model_json(m: &pb::ModelInfo) -> Value {
    json!({"id": m.name, "object": "model", "created": 0, "owned_by": "tokenlog",
           "context_length": m.context_tokens, "decoders": m.decoders.len(),
           "weights_sha256": m.identity.as_ref().map(|i| i.weights_sha256.clone())})
}

async fn get_model(State(gw): Gw, h: HeaderMap, Path(name): Path<String>) -> Result<Json<Value>> {
    tenant(&gw, &h)?;
    let models = gw.models().await?;
    models
        .iter()
        .find(|m| m.name == name)
        .map(|m| Json(model_json(m)))
        .ok_or_else(|| GatewayError::NotFound(format!("unknown model {name:?}")))
}

// ------------------------------------------------------------------ chat + completions

#[derive(Clone, Copy, PartialEq)]
enum Kind {
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

async fn chat_completions(State(gw): Gw, h: HeaderMap, body: Bytes) -> Result<Response> {
    let tenant = tenant(&gw, &h)?;
    let b = parse_body(&body)?;
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
    create(gw, h, tenant, p, opt_bool(&b, "stream")?, Kind::Chat).await
}

async fn completions(State(gw): Gw, h: HeaderMap, body: Bytes) -> Result<Response> {
    let tenant = tenant(&gw, &h)?;
    let b = parse_body(&body)?;
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
    create(gw, h, tenant, p, opt_bool(&b, "stream")?, Kind::Completion).await
}

async fn create(
    gw: Arc<Gateway>,
    h: HeaderMap,
    tenant: String,
    p: GenerateParams,
    stream: bool,
    kind: Kind,
) -> Result<Response> {
    let after = last_event_id(&h)?;
    let (info, model) = gw.submit(&tenant, &p).await?;
    let rid = p.request_id.clone();
    let gid = info.generation_id;
    let url = kind.stream_url(&rid);
    let rx = gw.events(info.clone(), after)?;
    if !stream {
        let (text, last) = collect(rx).await?;
        let f = last.finish.as_ref().expect("last");
        if f.reason == "error" {
            return Err(GatewayError::Unavailable(format!("generation failed: {}", f.detail)));
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
    let started = Instant::now();
    let resp = chunk_stream(gw, rx, kind, rid.clone(), model, created_s(&info), Some(started)).into_response();
    Ok(with_headers(resp, &rid, gid, Some(url)))
}

async fn chat_resume(State(gw): Gw, h: HeaderMap, Path(rid): Path<String>) -> Result<Response> {
    resume(gw, h, rid, Kind::Chat).await
}

async fn completions_resume(State(gw): Gw, h: HeaderMap, Path(rid): Path<String>) -> Result<Response> {
    resume(gw, h, rid, Kind::Completion).await
}

async fn resume(gw: Arc<Gateway>, h: HeaderMap, rid: String, kind: Kind) -> Result<Response> {
    let tenant = tenant(&gw, &h)?;
    let after = last_event_id(&h)?;
    let info = gw.lookup(&tenant, &rid).await?;
    gw.metrics.resumes.inc();
    tracing::info!(tenant, request_id = %rid, after, "http resume");
    let model = gw.model_name(&info).await;
    let gid = info.generation_id;
    let created = created_s(&info);
    let rx = gw.events(info, after)?;
    let resp = chunk_stream(gw, rx, kind, rid.clone(), model, created, None).into_response();
    Ok(with_headers(resp, &rid, gid, Some(kind.stream_url(&rid))))
}

/// SSE of chat.completion.chunk / text_completion objects, `id: <seq>` on each, `[DONE]` last.
fn chunk_stream(
    gw: Arc<Gateway>,
    mut rx: mpsc::Receiver<Result<Event>>,
    kind: Kind,
    rid: String,
    model: String,
    created: u64,
    started: Option<Instant>,
) -> Sse<impl Stream<Item = std::result::Result<SseEvent, Infallible>>> {
    let (tx, out) = mpsc::channel(64);
    tokio::spawn(async move {
        let mut first = started;
        while let Some(ev) = rx.recv().await {
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
                let err = GatewayError::Unavailable(format!("generation failed: {}", finish.unwrap().detail));
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
            }
            if tx
                .send(SseEvent::default().id(ev.seq.to_string()).data(chunk.to_string()))
                .await
                .is_err()
            {
                return;
            }
            if finish.is_some() {
                let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                return;
            }
        }
    });
    sse(out)
}

// ------------------------------------------------------------------ responses

fn response_id(rid: &str) -> String {
    format!("resp_{rid}")
}

fn rid_of(response_id: &str) -> Result<&str> {
    response_id
        .strip_prefix("resp_")
        .ok_or_else(|| GatewayError::NotFound(format!("no response {response_id:?} (ids start with resp_)")))
}

async fn create_response(State(gw): Gw, h: HeaderMap, body: Bytes) -> Result<Response> {
    let tenant = tenant(&gw, &h)?;
    let b = parse_body(&body)?;
    let mut msgs = Vec::new();
    if let Some(i) = opt_str(&b, "instructions")? {
        msgs.push(ChatMessage::system(i));
    }
    match b.get("input") {
        Some(Value::String(s)) => msgs.push(ChatMessage::user(s.clone())),
        Some(Value::Array(items)) => {
            for it in items {
                let ty = it.get("type").and_then(Value::as_str).unwrap_or("message");
                if ty != "message" {
                    return Err(GatewayError::Invalid(format!(
                        "input item type {ty:?} is not supported (messages only)"
                    )));
                }
                let role = it
                    .get("role")
                    .and_then(Value::as_str)
                    .ok_or_else(|| GatewayError::Invalid("each input message needs a role".into()))?;
                msgs.push(ChatMessage::new(
                    role,
                    content_text(it.get("content").unwrap_or(&Value::Null))?,
                ));
            }
        }
        _ => {
            return Err(GatewayError::Invalid(
                "input must be a string or an array of messages".into(),
            ))
        }
    }
    let p = common_params(&b, request_id(&h)?, Prompt::Chat(msgs), &["max_output_tokens"])?;
    let stream = opt_bool(&b, "stream")?;
    let background = opt_bool(&b, "background")?;
    let (info, model) = gw.submit(&tenant, &p).await?;
    let rid = p.request_id.clone();
    let gid = info.generation_id;
    let url = format!(
        "/v1/responses/{}?stream=true&starting_after=",
        encode_path(&response_id(&rid))
    );
    let r = if stream {
        let rx = gw.events(info.clone(), -1)?;
        response_stream(gw, rx, info, model, background, -1).into_response()
    } else if background {
        Json(response_json(&info, &model, background, "", None)).into_response()
    } else {
        let rx = gw.events(info.clone(), -1)?;
        let (text, last) = collect(rx).await?;
        let info = gw.lookup(&tenant, &rid).await.unwrap_or(info);
        Json(response_json(&info, &model, background, &text, Some(&last))).into_response()
    };
    Ok(with_headers(r, &rid, gid, Some(url)))
}

#[derive(serde::Deserialize)]
struct RetrieveQuery {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    starting_after: Option<i64>,
}

async fn get_response(
    State(gw): Gw,
    h: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<RetrieveQuery>,
) -> Result<Response> {
    let tenant = tenant(&gw, &h)?;
    let rid = rid_of(&id)?;
    let info = gw.lookup(&tenant, rid).await?;
    let model = gw.model_name(&info).await;
    if q.stream.unwrap_or(false) {
        let after = q.starting_after.unwrap_or(-1);
        if after < -1 {
            return Err(GatewayError::Invalid("starting_after must be >= -1".into()));
        }
        gw.metrics.resumes.inc();
        tracing::info!(tenant, request_id = %rid, starting_after = after, "responses resume");
        let rx = gw.events(info.clone(), -1)?;
        return Ok(response_stream(gw, rx, info, model, true, after).into_response());
    }
    // Not streaming: the response as it stands (text up to the current frontier).
    let frontier = info.frontier;
    let terminal = is_terminal(&info);
    let mut text = String::new();
    let mut last = None;
    // Nothing committed and not over: there is no text to read (and no event would come yet).
    if terminal || frontier > 0 {
        let mut rx = gw.events(info.clone(), -1)?;
        while let Some(e) = rx.recv().await {
            let e = e?;
            text.push_str(&e.text);
            if e.finish.is_some() {
                last = Some(e);
                break;
            }
            if !terminal && e.seq + 1 >= frontier {
                break;
            }
        }
    }
    Ok(Json(response_json(&info, &model, true, &text, last.as_ref())).into_response())
}

async fn cancel_response(State(gw): Gw, h: HeaderMap, Path(id): Path<String>) -> Result<Json<Value>> {
    let tenant = tenant(&gw, &h)?;
    let rid = rid_of(&id)?;
    let info = gw.cancel(&tenant, rid).await?;
    let model = gw.model_name(&info).await;
    Ok(Json(response_json(&info, &model, true, "", None)))
}

/// `status` of a response object for a generation (and its last event when it has ended).
fn response_status(info: &pb::GenerationInfo, last: Option<&Event>) -> (&'static str, Value, Value) {
    let (reason, detail) = match last.and_then(|e| e.finish.as_ref()) {
        Some(f) => (f.reason, f.detail.clone()),
        None if is_terminal(info) => (
            crate::core::finish_reason_str(info.finish_reason),
            info.finish_detail.clone(),
        ),
        None => {
            let running = info.frontier > 0 || info.lease.as_ref().is_some_and(|l| l.epoch > 0);
            return (if running { "in_progress" } else { "queued" }, Value::Null, Value::Null);
        }
    };
    match reason {
        "stop" => ("completed", Value::Null, Value::Null),
        "length" => ("incomplete", json!({"reason": "max_output_tokens"}), Value::Null),
        "cancelled" => ("cancelled", Value::Null, Value::Null),
        _ => (
            "failed",
            Value::Null,
            json!({"code": "server_error", "message": detail}),
        ),
    }
}

fn message_item(rid: &str, status: &str, text: Option<&str>) -> Value {
    let content = match text {
        Some(t) => json!([{"type": "output_text", "text": t, "annotations": []}]),
        None => json!([]),
    };
    json!({"type": "message", "id": format!("msg_{rid}"), "status": status, "role": "assistant", "content": content})
}

fn response_json(info: &pb::GenerationInfo, model: &str, background: bool, text: &str, last: Option<&Event>) -> Value {
    let (status, incomplete, error) = response_status(info, last);
    let rid = &info.request_id;
    let output = if text.is_empty() && last.is_none() {
        json!([])
    } else {
        let item_status = if last.is_some() { "completed" } else { "in_progress" };
        json!([message_item(rid, item_status, Some(text))])
    };
    let prompt = crate::core::prompt_tokens(info);
    let done = last
        .and_then(|e| e.finish.as_ref())
        .map_or(info.frontier, |f| f.completion_tokens);
    json!({
        "id": response_id(rid), "object": "response", "created_at": created_s(info), "status": status,
        "background": background, "model": model, "output": output, "output_text": text,
        "error": error, "incomplete_details": incomplete, "instructions": null, "metadata": {},
        "parallel_tool_calls": false, "tool_choice": "none", "tools": [], "temperature": null, "top_p": null,
        "usage": {"input_tokens": prompt, "output_tokens": done, "total_tokens": prompt + done,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
    })
}

/// The Responses API event sequence of a generation. Sequence numbers are a pure function of the
/// committed records, so a resumed stream continues exactly after `starting_after`:
/// 0 `response.created`, 1 `response.in_progress`, 2 `response.output_item.added`,
/// 3 `response.content_part.added`, 4+seq one `response.output_text.delta` per token, then (after
/// F tokens) the held-back remainder as one more delta if it is not empty, then
/// `output_text.done`, `content_part.done`, `output_item.done` and `response.completed` (or
/// `incomplete` / `failed` / `cancelled`).
pub const RESPONSE_FIRST_DELTA: i64 = 4;

fn response_stream(
    gw: Arc<Gateway>,
    mut rx: mpsc::Receiver<Result<Event>>,
    info: pb::GenerationInfo,
    model: String,
    background: bool,
    after: i64,
) -> Sse<impl Stream<Item = std::result::Result<SseEvent, Infallible>>> {
    let (tx, out) = mpsc::channel(64);
    tokio::spawn(async move {
        let rid = info.request_id.clone();
        let item_id = format!("msg_{rid}");
        let mut n: i64 = 0;
        // Sends event `n` when it is after `after`; false when the client went away.
        macro_rules! emit {
            ($ty:expr, $body:expr) => {{
                let mut body: Value = $body;
                body["type"] = json!($ty);
                body["sequence_number"] = json!(n);
                let ok = if n > after {
                    tx.send(SseEvent::default().event($ty).data(body.to_string()))
                        .await
                        .is_ok()
                } else {
                    true
                };
                n += 1;
                if !ok {
                    return;
                }
            }};
        }
        let mut start_info = info.clone();
        start_info.state = pb::GenerationState::Running as i32;
        let start = response_json(&start_info, &model, background, "", None);
        emit!("response.created", json!({"response": start.clone()}));
        emit!("response.in_progress", json!({"response": start}));
        emit!(
            "response.output_item.added",
            json!({"output_index": 0, "item": message_item(&rid, "in_progress", None)})
        );
        emit!(
            "response.content_part.added",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                                                     "part": {"type": "output_text", "text": "", "annotations": []}})
        );
        let mut text = String::new();
        while let Some(ev) = rx.recv().await {
            let ev = match ev {
                Ok(e) => e,
                Err(e) => {
                    gw.metrics.stream_errors.inc();
                    let body = json!({"type": "error", "code": e.http().2, "message": e.to_string(), "param": null,
                                      "sequence_number": n});
                    let _ = tx.send(SseEvent::default().event("error").data(body.to_string())).await;
                    return;
                }
            };
            text.push_str(&ev.text);
            if ev.finish.is_none() || !ev.text.is_empty() {
                emit!(
                    "response.output_text.delta",
                    json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                                                            "delta": ev.text, "logprobs": []})
                );
            }
            if ev.finish.is_some() {
                let part = json!({"type": "output_text", "text": text, "annotations": []});
                emit!(
                    "response.output_text.done",
                    json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                                                           "text": text, "logprobs": []})
                );
                emit!(
                    "response.content_part.done",
                    json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                                                            "part": part})
                );
                emit!(
                    "response.output_item.done",
                    json!({"output_index": 0,
                                                           "item": message_item(&rid, "completed", Some(&text))})
                );
                let mut end_info = info.clone();
                end_info.state = pb::GenerationState::Finished as i32;
                let resp = response_json(&end_info, &model, background, &text, Some(&ev));
                let ty = match resp["status"].as_str() {
                    Some("completed") => "response.completed",
                    Some("incomplete") => "response.incomplete",
                    Some("cancelled") => "response.cancelled",
                    _ => "response.failed",
                };
                emit!(ty, json!({"response": resp}));
                let _ = n;
                return;
            }
        }
    });
    sse(out)
}
