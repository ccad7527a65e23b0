//! `/v1/responses`: create (`background`, `stream`), retrieve (and resume its stream at
//! `starting_after`), cancel; event sequence numbers that are a pure function of the log.

use super::*;

pub(super) fn response_id(rid: &str) -> String {
    format!("resp_{rid}")
}

pub(super) fn rid_of(response_id: &str) -> Result<&str> {
    response_id
        .strip_prefix("resp_")
        .ok_or_else(|| GatewayError::NotFound(format!("no response {response_id:?} (ids start with resp_)")))
}

pub(super) async fn create_response(State(gw): Gw, h: HeaderMap, body: Bytes) -> Result<Response> {
    let tenant = tenant(&gw, &h)?;
    let b = parse_body(&body)?;
    refuse_unsupported(&b, Endpoint::Responses)?;
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
        let rx = gw.events(info.clone(), -1).await?;
        response_stream(gw, rx, info, model, background, -1).into_response()
    } else if background {
        // The response as it stands, as a retrieve shows it: a repeat of the POST (the same
        // Idempotency-Key, after a dropped answer) gets the generation the log holds, which
        // may have produced text or ended. It answered with an empty output whatever the
        // status, and a client that saw "completed" had no reason to ask again. A new
        // response has nothing to read yet and costs nothing here.
        let (text, last) = text_so_far(&gw, &info).await?;
        Json(response_json(&info, &model, background, &text, last.as_ref())).into_response()
    } else {
        let rx = gw.events(info.clone(), -1).await?;
        let (text, last) = collect(rx).await?;
        let info = gw.lookup(&tenant, &rid).await.unwrap_or(info);
        Json(response_json(&info, &model, background, &text, Some(&last))).into_response()
    };
    Ok(with_headers(r, &rid, gid, Some(url)))
}

#[derive(serde::Deserialize)]
pub(super) struct RetrieveQuery {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    starting_after: Option<i64>,
}

pub(super) async fn get_response(
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
        // No event comes past the last one: 4 before the text, one per token and one for the
        // held-back rest, 4 after it (see `response_stream`). A resume past that got an empty
        // stream, which a client takes for a broken one.
        let tokens = match is_terminal(&info) {
            true => info.frontier,
            false => info
                .binding
                .as_ref()
                .and_then(|b| b.stop.as_ref())
                .map_or(u32::MAX, |s| s.max_tokens),
        };
        let last_possible = 8 + i64::from(tokens);
        if after > last_possible {
            return Err(GatewayError::Invalid(format!(
                "no event has sequence_number {after}: the last event of response {id:?} is {last_possible} at most"
            )));
        }
        gw.metrics.resumes.inc();
        tracing::info!(tenant, request_id = %rid, starting_after = after, "responses resume");
        let rx = gw.events(info.clone(), -1).await?;
        return Ok(response_stream(gw, rx, info, model, true, after).into_response());
    }
    // Not streaming: the response as it stands (text up to the current frontier).
    let (text, last) = text_so_far(&gw, &info).await?;
    Ok(Json(response_json(&info, &model, true, &text, last.as_ref())).into_response())
}

/// The text of a response up to its frontier as `info` has it, and its last event when it
/// has ended.
async fn text_so_far(gw: &Arc<Gateway>, info: &pb::GenerationInfo) -> Result<(String, Option<Event>)> {
    let frontier = info.frontier;
    let terminal = is_terminal(info);
    let mut text = String::new();
    let mut last = None;
    // Nothing committed and not over: there is no text to read (and no event would come yet).
    if terminal || frontier > 0 {
        let mut rx = gw.events(info.clone(), -1).await?;
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
    Ok((text, last))
}

/// The response object after the cancel, with its output so far (it answered with an empty
/// output whatever the response had produced, while its usage counted the tokens).
pub(super) async fn cancel_response(State(gw): Gw, h: HeaderMap, Path(id): Path<String>) -> Result<Json<Value>> {
    let tenant = tenant(&gw, &h)?;
    let rid = rid_of(&id)?;
    let info = gw.cancel(&tenant, rid).await?;
    let model = gw.model_name(&info).await;
    let (text, last) = text_so_far(&gw, &info).await?;
    Ok(Json(response_json(&info, &model, true, &text, last.as_ref())))
}

/// `status` of a response object for a generation (and its last event when it has ended).
pub(super) fn response_status(info: &pb::GenerationInfo, last: Option<&Event>) -> (&'static str, Value, Value) {
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

/// The status of the output message of a response whose status is `status`: `completed` only
/// when the response is; `incomplete` when it ended otherwise (max_output_tokens, cancelled,
/// failed), as OpenAI's items say; `in_progress` while it runs.
fn item_status(status: &str) -> &'static str {
    match status {
        "completed" => "completed",
        "queued" | "in_progress" => "in_progress",
        _ => "incomplete",
    }
}

pub(super) fn message_item(rid: &str, status: &str, text: Option<&str>) -> Value {
    let content = match text {
        Some(t) => json!([{"type": "output_text", "text": t, "annotations": []}]),
        None => json!([]),
    };
    json!({"type": "message", "id": format!("msg_{rid}"), "status": status, "role": "assistant", "content": content})
}

pub(super) fn response_json(
    info: &pb::GenerationInfo,
    model: &str,
    background: bool,
    text: &str,
    last: Option<&Event>,
) -> Value {
    let (status, incomplete, error) = response_status(info, last);
    let rid = &info.request_id;
    let output = if text.is_empty() && last.is_none() {
        json!([])
    } else {
        json!([message_item(rid, item_status(status), Some(text))])
    };
    let prompt = crate::core::prompt_tokens(info);
    let done = last
        .and_then(|e| e.finish.as_ref())
        .map_or(info.frontier, |f| f.completion_tokens);
    // What the response was made with, as the log bound it (the same on every gateway).
    let binding = info.binding.as_ref();
    let sampling = binding.and_then(|b| b.sampling.as_ref());
    let temperature = sampling.map(|s| s.temperature);
    let top_p = sampling.map(|s| if s.top_p > 0.0 { s.top_p } else { 1.0 });
    let max_output_tokens = binding.and_then(|b| b.stop.as_ref()).map(|s| s.max_tokens);
    json!({
        "id": response_id(rid), "object": "response", "created_at": created_s(info), "status": status,
        "background": background, "model": model, "output": output, "output_text": text,
        "error": error, "incomplete_details": incomplete, "instructions": null, "metadata": {},
        "parallel_tool_calls": false, "tool_choice": "none", "tools": [], "temperature": temperature, "top_p": top_p,
        "max_output_tokens": max_output_tokens,
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
pub(super) fn response_stream(
    gw: Arc<Gateway>,
    mut rx: mpsc::Receiver<Result<Event>>,
    info: pb::GenerationInfo,
    model: String,
    background: bool,
    after: i64,
) -> Sse<impl Stream<Item = std::result::Result<SseEvent, Infallible>>> {
    let (tx, out) = mpsc::channel(SSE_BUFFER_EVENTS);
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
                    // Not an event of the response (its numbers are the log's): it carries the
                    // number of the last event the client has, so a client that resumes after
                    // the last number it saw gets event `n` next. It carried `n`, which the
                    // next real event takes: a resume after it skipped that event.
                    let body = json!({"type": "error", "code": e.http().2, "message": e.message(), "param": null,
                                      "sequence_number": (n - 1).max(after)});
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
                let mut end_info = info.clone();
                end_info.state = pb::GenerationState::Finished as i32;
                let resp = response_json(&end_info, &model, background, &text, Some(&ev));
                let status = item_status(resp["status"].as_str().unwrap_or("failed"));
                emit!(
                    "response.output_item.done",
                    json!({"output_index": 0, "item": message_item(&rid, status, Some(&text))})
                );
                let ty = match resp["status"].as_str() {
                    Some("completed") => "response.completed",
                    Some("incomplete") => "response.incomplete",
                    Some("cancelled") => "response.cancelled",
                    _ => "response.failed",
                };
                emit!(ty, json!({"response": resp}));
                // A resume past the last event (the generation ended before the most its
                // max_output_tokens allowed, or without a held-back rest) got an empty stream,
                // which a client takes for a finished one with nothing more to say.
                if after >= n {
                    let e = GatewayError::Invalid(format!(
                        "no event has sequence_number {after}: the last event of response {:?} is {}",
                        response_id(&rid),
                        n - 1
                    ));
                    let body = json!({"type": "error", "code": e.http().2, "message": e.message(), "param": null,
                                      "sequence_number": after});
                    let _ = tx.send(SseEvent::default().event("error").data(body.to_string())).await;
                }
                return;
            }
        }
    });
    sse(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u32, text: &str) -> Event {
        Event {
            request_id: "r".into(),
            generation: 1,
            epoch: 1,
            seq,
            token_id: Some(seq),
            text: text.into(),
            finish: None,
        }
    }

    /// An error in the middle of a Responses stream carries the number of the last event sent
    /// (or the one resumed after), not the next one's: a client that resumes after the last
    /// number it saw then gets every event. It carried the next number, and a resume after it
    /// skipped the text delta that took that number.
    #[tokio::test]
    async fn an_error_event_does_not_take_the_next_events_number() {
        let gw = Gateway::new(
            tokenlog_raftlog::client::LogClient::new(vec!["127.0.0.1:9".into()]).unwrap(),
            crate::tenants::Tenants::Open,
            vec![],
            crate::tenants::TenantLimits { streams: 1, submits: 1 },
            crate::core::BindDefaults::default(),
        )
        .unwrap();
        for after in [-1, 4, 9] {
            let (tx, rx) = mpsc::channel(8);
            tx.send(Ok(event(0, "a"))).await.unwrap();
            tx.send(Ok(event(1, "b"))).await.unwrap();
            tx.send(Err(GatewayError::Unavailable("the log is away".into())))
                .await
                .unwrap();
            drop(tx);
            let info = pb::GenerationInfo {
                request_id: "r".into(),
                generation_id: 1,
                ..Default::default()
            };
            let body = response_stream(gw.clone(), rx, info, "m".into(), false, after).into_response();
            let bytes = axum::body::to_bytes(body.into_body(), 1 << 20).await.unwrap();
            let text = String::from_utf8(bytes.to_vec()).unwrap();
            let numbers: Vec<(String, i64)> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .map(|d| {
                    let v: Value = serde_json::from_str(d).unwrap();
                    (
                        v["type"].as_str().unwrap().to_string(),
                        v["sequence_number"].as_i64().unwrap(),
                    )
                })
                .collect();
            let (last_type, error_number) = numbers.last().cloned().unwrap();
            assert_eq!(last_type, "error", "{numbers:?}");
            // Events 0..=3 open the response; the two deltas are 4 and 5.
            let last_sent = numbers[..numbers.len() - 1].iter().map(|(_, n)| *n).max();
            assert_eq!(
                error_number,
                last_sent.unwrap_or(after).max(after),
                "after {after}: {numbers:?}"
            );
            assert_eq!(error_number, 5.max(after), "after {after}: {numbers:?}");
        }
    }
}
