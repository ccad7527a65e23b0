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
