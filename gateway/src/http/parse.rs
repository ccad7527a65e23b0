//! Request parsing: JSON bodies, headers, chat messages, and the parameters every endpoint shares,
//! each with a clear 400 for a bad value.

use super::*;

pub(super) fn parse_body(body: &Bytes) -> Result<serde_json::Map<String, Value>> {
    let text = std::str::from_utf8(body)
        .map_err(|e| GatewayError::Invalid(format!("request body is not valid UTF-8: {e}")))?;
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(GatewayError::Invalid("request body must be a JSON object".into())),
        Err(e) => Err(GatewayError::Invalid(format!("request body is not valid JSON: {e}"))),
    }
}

/// The request id: the `Idempotency-Key` header, or a fresh one.
pub(super) fn request_id(h: &HeaderMap) -> Result<String> {
    match h.get("idempotency-key") {
        Some(v) => Ok(v
            .to_str()
            .map_err(|_| GatewayError::Invalid("Idempotency-Key is not visible ASCII".into()))?
            .to_string()),
        None => Ok(random_request_id()),
    }
}

/// The seq in `Last-Event-ID` (-1 when absent).
pub(super) fn last_event_id(h: &HeaderMap) -> Result<i64> {
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

pub(super) fn opt_f32(b: &serde_json::Map<String, Value>, k: &str) -> Result<Option<f32>> {
    match b.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| GatewayError::Invalid(format!("{k} must be a number"))),
    }
}

pub(super) fn opt_u64(b: &serde_json::Map<String, Value>, k: &str) -> Result<Option<u64>> {
    match b.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| GatewayError::Invalid(format!("{k} must be a non-negative integer"))),
    }
}

pub(super) fn opt_bool(b: &serde_json::Map<String, Value>, k: &str) -> Result<bool> {
    match b.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(x)) => Ok(*x),
        Some(_) => Err(GatewayError::Invalid(format!("{k} must be true or false"))),
    }
}

pub(super) fn opt_str<'a>(b: &'a serde_json::Map<String, Value>, k: &str) -> Result<Option<&'a str>> {
    match b.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(GatewayError::Invalid(format!("{k} must be a string"))),
    }
}

/// Text of a message `content`: a string, or an array of `{type: text|input_text|output_text, text}`.
pub(super) fn content_text(v: &Value) -> Result<String> {
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

pub(super) fn messages(v: &Value) -> Result<Vec<ChatMessage>> {
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
pub(super) fn common_params(
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
    p.sampling.temperature = opt_f32(b, "temperature")?.unwrap_or(1.0);
    p.sampling.top_p = opt_f32(b, "top_p")?.unwrap_or(1.0);
    // 0 keeps no token; the binding reads 0 as "off" (gRPC's unset), which would sample from
    // the whole distribution: the opposite of what a client sending 0 means.
    if p.sampling.top_p <= 0.0 {
        return Err(GatewayError::Invalid("top_p must be in (0, 1]".into()));
    }
    p.sampling.frequency_penalty = opt_f32(b, "frequency_penalty")?.unwrap_or(0.0);
    p.sampling.presence_penalty = opt_f32(b, "presence_penalty")?.unwrap_or(0.0);
    p.sampling.repetition_penalty = opt_f32(b, "repetition_penalty")?.unwrap_or(1.0);
    if let Some(k) = opt_u64(b, "top_k")? {
        p.sampling.top_k = k.min(u64::from(u32::MAX)) as u32;
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

/// Which create call a body was sent to: each has fields of its own that ask for what tokenlog
/// does not do.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Endpoint {
    Chat,
    Completion,
    Responses,
}

/// Refuses (400, naming the field) a request that asks for what tokenlog does not do: tools,
/// structured output, log probabilities, logit biases, echo, best_of, a suffix, a previous
/// response or conversation. Ignored, each gave an answer that looked like the one asked for
/// and was not (free text for a JSON schema, no tool call, a response without the
/// conversation before it). The values that ask for nothing (`tools: []`, `logprobs: false`,
/// `response_format: {"type": "text"}`, ...) pass, as do fields that change nothing of the
/// answer (`user`, `metadata`, `store`, ...).
pub(super) fn refuse_unsupported(b: &serde_json::Map<String, Value>, endpoint: Endpoint) -> Result<()> {
    let unsupported = |field: &str, why: &str| {
        Err(GatewayError::Invalid(format!(
            "{field} is not supported: {why}; tokenlog generates plain text"
        )))
    };
    let set = |k: &str| match b.get(k) {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Bool(x)) => *x,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
    };
    for k in ["tools", "functions"] {
        if set(k) {
            return unsupported(k, "tokenlog calls no tools");
        }
    }
    for k in ["tool_choice", "function_call"] {
        match b.get(k) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if matches!(s.as_str(), "none" | "auto") => {}
            Some(_) => return unsupported(k, "tokenlog calls no tools"),
        }
    }
    if set("logit_bias") {
        return unsupported("logit_bias", "token biases are not applied");
    }
    if set("logprobs") || set("top_logprobs") {
        let k = if set("logprobs") { "logprobs" } else { "top_logprobs" };
        return unsupported(k, "tokenlog returns no log probabilities");
    }
    let format = match endpoint {
        Endpoint::Responses => b.get("text").and_then(|t| t.get("format")).map(|f| ("text.format", f)),
        _ => b.get("response_format").map(|f| ("response_format", f)),
    };
    if let Some((k, f)) = format.filter(|(_, f)| !f.is_null()) {
        match f.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some(ty) => return unsupported(&format!("{k} {ty:?}"), "output is not constrained to a format"),
            None => return Err(GatewayError::Invalid(format!("{k} must be an object with a type"))),
        }
    }
    match endpoint {
        Endpoint::Completion => {
            if set("echo") {
                return unsupported("echo", "the prompt is not repeated in the answer");
            }
            if set("suffix") {
                return unsupported("suffix", "tokenlog does not insert text");
            }
            if let Some(n) = opt_u64(b, "best_of")? {
                if n > 1 {
                    return unsupported("best_of", "one sequence is generated per request (best_of 1)");
                }
            }
        }
        Endpoint::Responses => {
            for k in ["previous_response_id", "conversation", "prompt"] {
                if set(k) {
                    return unsupported(k, "send the whole conversation as input");
                }
            }
        }
        Endpoint::Chat => {}
    }
    Ok(())
}

/// `stream_options.include_usage` of a create call (false when absent); `stream_options`
/// without `"stream": true` is refused, as OpenAI does.
pub(super) fn include_usage(b: &serde_json::Map<String, Value>, stream: bool) -> Result<bool> {
    match b.get("stream_options") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Object(o)) => {
            if !stream {
                return Err(GatewayError::Invalid(
                    "stream_options is only allowed with \"stream\": true".into(),
                ));
            }
            opt_bool(o, "include_usage")
        }
        Some(_) => Err(GatewayError::Invalid("stream_options must be an object".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(s: &str) -> serde_json::Map<String, Value> {
        parse_body(&Bytes::from(s.to_string())).unwrap()
    }

    fn refused(s: &str, endpoint: Endpoint) -> String {
        match refuse_unsupported(&body(s), endpoint) {
            Err(GatewayError::Invalid(m)) => m,
            other => panic!("{s}: {other:?}"),
        }
    }

    /// What asks for something tokenlog does not do is refused, naming the field; the values
    /// that ask for nothing pass.
    #[test]
    fn fields_asking_for_what_tokenlog_does_not_do_are_refused_by_name() {
        use Endpoint::*;
        for (b, e, field) in [
            (r#"{"tools": [{"type": "function"}]}"#, Chat, "tools"),
            (r#"{"functions": [{"name": "f"}]}"#, Chat, "functions"),
            (r#"{"tool_choice": "required"}"#, Chat, "tool_choice"),
            (r#"{"tool_choice": {"type": "function"}}"#, Responses, "tool_choice"),
            (r#"{"logit_bias": {"50256": -100}}"#, Chat, "logit_bias"),
            (r#"{"logprobs": true}"#, Chat, "logprobs"),
            (r#"{"top_logprobs": 3}"#, Chat, "top_logprobs"),
            (r#"{"logprobs": 2}"#, Completion, "logprobs"),
            (
                r#"{"response_format": {"type": "json_object"}}"#,
                Chat,
                "response_format \"json_object\"",
            ),
            (
                r#"{"text": {"format": {"type": "json_schema"}}}"#,
                Responses,
                "text.format \"json_schema\"",
            ),
            (r#"{"echo": true}"#, Completion, "echo"),
            (r#"{"suffix": "end"}"#, Completion, "suffix"),
            (r#"{"best_of": 3}"#, Completion, "best_of"),
            (
                r#"{"previous_response_id": "resp_x"}"#,
                Responses,
                "previous_response_id",
            ),
            (r#"{"conversation": "conv_1"}"#, Responses, "conversation"),
        ] {
            let m = refused(b, e);
            assert!(m.starts_with(&format!("{field} is not supported")), "{b}: {m}");
        }
        assert!(refused(r#"{"response_format": {}}"#, Chat).contains("must be an object with a type"));
        for (b, e) in [
            (
                r#"{"tools": [], "tool_choice": "none", "logprobs": false, "top_logprobs": 0}"#,
                Chat,
            ),
            (
                r#"{"tools": null, "tool_choice": "auto", "logit_bias": {}, "user": "u", "store": false}"#,
                Chat,
            ),
            (
                r#"{"response_format": {"type": "text"}, "parallel_tool_calls": true}"#,
                Chat,
            ),
            (
                r#"{"logprobs": 0, "echo": false, "suffix": "", "best_of": 1}"#,
                Completion,
            ),
            (r#"{"logprobs": null, "metadata": {"k": "v"}}"#, Completion),
            (
                r#"{"text": {"format": {"type": "text"}}, "previous_response_id": null, "tools": []}"#,
                Responses,
            ),
            // Fields of the other endpoints are theirs: echo means nothing to a chat call.
            (r#"{"echo": true, "previous_response_id": "resp_x"}"#, Chat),
        ] {
            refuse_unsupported(&body(b), e).unwrap_or_else(|err| panic!("{b}: {err}"));
        }
    }

    #[test]
    fn stream_options_need_a_stream() {
        let b = body(r#"{"stream_options": {"include_usage": true}}"#);
        assert!(include_usage(&b, true).unwrap());
        assert!(matches!(include_usage(&b, false), Err(GatewayError::Invalid(m)) if m.contains("only allowed")));
        assert!(!include_usage(&body(r#"{"stream_options": {}}"#), true).unwrap());
        assert!(!include_usage(&body("{}"), false).unwrap());
        assert!(include_usage(&body(r#"{"stream_options": true}"#), true).is_err());
        assert!(include_usage(&body(r#"{"stream_options": {"include_usage": "yes"}}"#), true).is_err());
    }
}
