//! The gateway's errors, and the one place they become gRPC statuses and HTTP responses.

use axum::http::StatusCode;
use tokenlog_raftlog::client::ClientError;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// Bad parameters, malformed input, prompt too long.
    #[error("{0}")]
    Invalid(String),
    /// No or unknown API key.
    #[error("{0}")]
    Unauthenticated(String),
    /// Unknown request id (in this tenant), or unknown model.
    #[error("{0}")]
    NotFound(String),
    /// Same request id, different request.
    #[error("{0}")]
    Conflict(String),
    /// The gateway or the log cannot take this now (too many streams, a limit of the log).
    #[error("{0}")]
    Overloaded(String),
    /// The system is not in a state to serve this (no decoder for the model, no tokenizer).
    #[error("{0}")]
    Precondition(String),
    /// The log did not answer.
    #[error("log unavailable: {0}")]
    Unavailable(String),
    /// The generation ended in failure (the log's detail says why: no decoder before its
    /// deadline, none for too long after its owner's lease ended, a decoder's error). The log
    /// answered; retrying the same request id reads the same failure.
    #[error("generation failed: {0}")]
    Failed(String),
    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T, E = GatewayError> = std::result::Result<T, E>;

impl From<ClientError> for GatewayError {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Status(s) => match s.code() {
                Code::InvalidArgument | Code::OutOfRange => GatewayError::Invalid(s.message().to_string()),
                Code::NotFound => GatewayError::NotFound(s.message().to_string()),
                Code::AlreadyExists | Code::Aborted => GatewayError::Conflict(s.message().to_string()),
                Code::ResourceExhausted => GatewayError::Overloaded(s.message().to_string()),
                Code::FailedPrecondition => GatewayError::Precondition(s.message().to_string()),
                _ => GatewayError::Unavailable(s.message().to_string()),
            },
            other => GatewayError::Unavailable(other.to_string()),
        }
    }
}

impl From<GatewayError> for Status {
    fn from(e: GatewayError) -> Status {
        let code = match &e {
            GatewayError::Invalid(_) => Code::InvalidArgument,
            GatewayError::Unauthenticated(_) => Code::Unauthenticated,
            GatewayError::NotFound(_) => Code::NotFound,
            GatewayError::Conflict(_) => Code::AlreadyExists,
            GatewayError::Overloaded(_) => Code::ResourceExhausted,
            GatewayError::Precondition(_) => Code::FailedPrecondition,
            GatewayError::Unavailable(_) => Code::Unavailable,
            GatewayError::Failed(_) | GatewayError::Internal(_) => Code::Internal,
        };
        Status::new(code, e.message())
    }
}

impl GatewayError {
    /// The message a client gets: at most `ERROR_MESSAGE_BYTES_MAX` bytes (cut on a character
    /// boundary, saying so).
    pub fn message(&self) -> String {
        let m = self.to_string();
        let max = crate::limits::ERROR_MESSAGE_BYTES_MAX;
        if m.len() <= max {
            return m;
        }
        let cut = (0..=max).rev().find(|&i| m.is_char_boundary(i)).unwrap_or(0);
        format!("{}... (cut at {cut} of {} bytes)", &m[..cut], m.len())
    }

    /// HTTP status and OpenAI-style error `type` / `code`.
    pub fn http(&self) -> (StatusCode, &'static str, &'static str) {
        match self {
            GatewayError::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_request"),
            GatewayError::Unauthenticated(_) => (StatusCode::UNAUTHORIZED, "authentication_error", "invalid_api_key"),
            GatewayError::NotFound(_) => (StatusCode::NOT_FOUND, "invalid_request_error", "not_found"),
            GatewayError::Conflict(_) => (StatusCode::CONFLICT, "invalid_request_error", "idempotency_conflict"),
            GatewayError::Overloaded(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "overloaded"),
            GatewayError::Precondition(_) => (StatusCode::SERVICE_UNAVAILABLE, "server_error", "no_capacity"),
            GatewayError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "server_error", "unavailable"),
            GatewayError::Failed(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", "generation_failed"),
            GatewayError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal"),
        }
    }

    /// The OpenAI error body: `{"error": {"message", "type", "code", "param"}}`.
    pub fn openai_body(&self) -> serde_json::Value {
        let (_, ty, code) = self.http();
        serde_json::json!({"error": {"message": self.message(), "type": ty, "code": code, "param": null}})
    }
}

impl axum::response::IntoResponse for GatewayError {
    fn into_response(self) -> axum::response::Response {
        let (status, _, _) = self.http();
        (status, axum::Json(self.openai_body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::GatewayError;

    /// A message quoting a long client input (a 20 KB stop string) reaches the client cut, over
    /// gRPC and HTTP: whole, it overflowed the client's header limit in `grpc-message`.
    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let e = GatewayError::Invalid(format!("stop string {:?}: too long", "é".repeat(10_000)));
        let status = tonic::Status::from(e);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        let m = status.message();
        assert!(m.len() <= crate::limits::ERROR_MESSAGE_BYTES_MAX + 40, "{}", m.len());
        assert!(
            m.starts_with("stop string \"éé") && m.ends_with("(cut at 1023 of 20024 bytes)"),
            "{m}"
        );
        let e = GatewayError::Invalid("x".repeat(5_000));
        let body = e.openai_body();
        assert!(body["error"]["message"].as_str().unwrap().len() < 1_100);
        let short = GatewayError::NotFound("unknown model \"m\"".into());
        assert_eq!(tonic::Status::from(short).message(), "unknown model \"m\"");
    }
}
