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
//!   Event `sequence_number`s are a pure function of the log (see `responses::response_stream`), so a
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

use crate::core::{is_terminal, prompt_tokens, random_request_id, Event, Gateway, GenerateParams, Prompt};
use crate::error::{GatewayError, Result};
use crate::limits::{HTTP_BODY_BYTES_MAX, SSE_BUFFER_EVENTS};

mod chat;
mod parse;
mod responses;

use chat::*;
use parse::*;
use responses::*;

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
        .fallback(|| async { GatewayError::NotFound("no such path: see the README for the API's paths".into()) })
        .layer(DefaultBodyLimit::max(HTTP_BODY_BYTES_MAX))
        .layer(axum::middleware::map_response(openai_errors))
        .with_state(gw)
}

/// Refusals made before a handler runs (axum's: a query string that does not parse, a body over
/// `HTTP_BODY_BYTES_MAX`, a path that does not decode, a method a path does not take) in the
/// OpenAI error form, as every other error: they were text/plain, which an OpenAI client does
/// not read as an error body. Their text becomes the message.
async fn openai_errors(resp: Response) -> Response {
    use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
    let status = resp.status();
    let json = resp
        .headers()
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 64 * 1024).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    let message = match text.is_empty() {
        true => status.canonical_reason().unwrap_or("refused").to_string(),
        false => text,
    };
    let (ty, code) = match status.as_u16() {
        404 => ("invalid_request_error", "not_found"),
        405 => ("invalid_request_error", "method_not_allowed"),
        413 => ("invalid_request_error", "request_too_large"),
        415 => ("invalid_request_error", "unsupported_media_type"),
        s if s < 500 => ("invalid_request_error", "invalid_request"),
        _ => ("server_error", "internal"),
    };
    let body = json!({"error": {"message": message, "type": ty, "code": code, "param": null}});
    parts.headers.remove(CONTENT_LENGTH);
    parts
        .headers
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Response::from_parts(parts, axum::body::Body::from(body.to_string()))
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
    gw.http_request();
    let text = |name: &str| h.get(name).map(|v| v.to_str().map_err(|_| ()));
    gw.tenant_of(text("authorization"), text("x-api-key"))
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
        // OpenAI has no name for it, and "stop" would tell the client that the model ended
        // its answer.
        "cancelled" => "cancelled",
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
