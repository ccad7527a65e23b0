//! Every bound the gateway enforces, in one place. The log enforces its own (see
//! `tokenlog_raftlog::limits`); the gateway checks the same ones early so a client gets a clear
//! error before anything is submitted.

use std::time::Duration;

pub use tokenlog_raftlog::limits::{
    GENERATION_TOKENS_MAX, PROMPT_TEXT_BYTES_MAX, PROMPT_TOKENS_MAX, REQUEST_ID_BYTES_MAX, STOP_STRINGS_MAX,
    STOP_STRING_BYTES_MAX,
};

/// `max_tokens` when a request names none.
pub const MAX_TOKENS_DEFAULT: u32 = 256;
/// Chat messages in one request.
pub const MESSAGES_MAX: usize = 1_024;
/// Streams one gateway serves at once; more are refused with RESOURCE_EXHAUSTED ("overloaded").
pub const STREAMS_MAX: usize = 4_096;
/// Per tenant, per gateway (defaults of `--tenant-streams-max` / `--tenant-submits-max`): streams
/// open at once, and submits waiting for the log at once. More are refused with
/// RESOURCE_EXHAUSTED / HTTP 429, naming the limit, so one tenant cannot take every stream slot.
pub const TENANT_STREAMS_MAX_DEFAULT: usize = 512;
pub const TENANT_SUBMITS_MAX_DEFAULT: usize = 64;
/// Largest HTTP request body (bytes): a full-size prompt plus JSON overhead.
pub const HTTP_BODY_BYTES_MAX: usize = 2 * PROMPT_TEXT_BYTES_MAX;
/// How long the list of registered models is reused before asking the log again.
pub const MODELS_CACHE_TTL: Duration = Duration::from_secs(2);
/// How long a gateway keeps re-opening a broken Watch (log node died) before failing the
/// stream, counted from the first failure since the Watch last delivered a record or stayed
/// open for `WATCH_HEALTHY`.
pub const WATCH_RETRY_BUDGET: Duration = Duration::from_secs(30);
/// A Watch open this long before it broke was healthy: its break starts a new retry budget.
pub const WATCH_HEALTHY: Duration = Duration::from_secs(1);
/// Wait before re-opening a Watch that ended (a log node went away).
pub const WATCH_REOPEN_BACKOFF: Duration = Duration::from_millis(50);
/// Wait before trying again to open a Watch that could not be opened.
pub const WATCH_OPEN_RETRY: Duration = Duration::from_millis(200);
/// An error's message to a client is cut to this many bytes: messages can quote what the
/// client sent (a stop string, a model name), and a long one in gRPC's `grpc-message` trailer
/// overflows the client's header limit, which then sees a reset instead of the error.
pub const ERROR_MESSAGE_BYTES_MAX: usize = 1_024;
/// SSE events buffered per HTTP stream.
pub const SSE_BUFFER_EVENTS: usize = 64;
/// `GatewayClient`: how long it keeps trying gateways without receiving anything, the connect
/// timeout per gateway, the pause between tries, and events buffered for its caller.
pub const CLIENT_RECONNECT_BUDGET: Duration = Duration::from_secs(60);
pub const CLIENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
pub const CLIENT_RETRY_PAUSE: Duration = Duration::from_millis(100);
pub const CLIENT_BUFFER_EVENTS: usize = 256;
/// A client that has received nothing for `CLIENT_QUIET_NOTICE` says so (a warning naming the
/// gateways it tries and the time left), then again every `CLIENT_QUIET_NOTICE` while it tries.
pub const CLIENT_QUIET_NOTICE: Duration = Duration::from_secs(3);
/// Events buffered per stream between the log and a slow client.
pub const STREAM_BUFFER_EVENTS: usize = 256;
/// Temperature, top_p and penalty ranges accepted (OpenAI's).
pub const TEMPERATURE_MAX: f32 = 2.0;
pub const PENALTY_ABS_MAX: f32 = 2.0;
/// Largest repetition penalty a request may ask for (Hugging Face convention: 1 = off).
pub const REPETITION_PENALTY_MAX: f32 = 10.0;
/// Readiness (`health.rs`): the log is asked for its status this often, each ask given this
/// long; a gateway whose last answer is older than `LOG_UNREACHABLE_AFTER` is not ready.
pub const LOG_PROBE_EVERY: Duration = Duration::from_secs(1);
pub const LOG_PROBE_BUDGET: Duration = Duration::from_secs(2);
pub const LOG_UNREACHABLE_AFTER: Duration = Duration::from_secs(5);
/// A gateway told to stop lets its open streams and calls end for this long, then cuts them:
/// their clients resume on another gateway (gRPC `Resume`, `Last-Event-ID`) and see every event
/// once. Waiting for every stream to end could take as long as the longest generation.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
