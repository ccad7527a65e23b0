//! tokenlog's gateway: the client-facing side. It turns client requests into log submissions and
//! streams committed records back, over gRPC (`tokenlog.v1`) and OpenAI-compatible HTTP/SSE. It
//! holds no state of its own: any gateway serves any request from the log, so a client may resume
//! on another gateway and see every token exactly once (CONTRACT §1, §3, §5).
//!
//! - [`core`]: [`core::Gateway`]: model resolution, request checks and the binding, submit,
//!   lookup, cancel, and the event stream rebuilt from the log's Watch.
//! - [`grpc`]: the `tokenlog.v1` Generation service.
//! - [`http`]: `/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models`,
//!   `/metrics`.
//! - [`client`]: the Rust client (reconnect across gateways, dedup by seq).
//! - [`tenants`]: API keys to tenants. [`metrics`]: Prometheus metrics. [`limits`]: every bound.
//! - [`error`]: the one place errors become gRPC statuses and HTTP responses.
//! - [`server`]: runs both listeners with a clean shutdown.

pub mod client;
pub mod core;
pub mod error;
pub mod grpc;
pub mod health;
pub mod http;
pub mod limits;
pub mod metrics;
pub mod server;
pub mod tenants;

pub use crate::core::{BindDefaults, Event, Finish, Gateway, GenerateParams, Prompt};
pub use error::GatewayError;
