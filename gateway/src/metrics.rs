//! Prometheus metrics of the gateway, served at `/metrics` on its HTTP address.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Renders more metrics in the Prometheus text format (another component in the same process).
pub type Source = std::sync::Arc<dyn Fn() -> String + Send + Sync>;

pub struct Metrics {
    registry: Registry,
    extra: std::sync::Mutex<Vec<Source>>,
    pub submits: Counter,
    pub generations_created: Counter,
    pub resumes: Counter,
    pub tokens_streamed: Counter,
    pub streams_active: Gauge,
    pub stream_errors: Counter,
    /// Seconds from a Generate call to its first token event (time to first token).
    pub first_token_seconds: Histogram,
    pub http_requests: Counter,
    /// Tokenizer packages fetched from the log (models this gateway has no files of).
    pub tokenizers_fetched: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tokenlog_gateway");
        let m = Metrics {
            submits: Counter::default(),
            generations_created: Counter::default(),
            resumes: Counter::default(),
            tokens_streamed: Counter::default(),
            streams_active: Gauge::default(),
            stream_errors: Counter::default(),
            first_token_seconds: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            http_requests: Counter::default(),
            tokenizers_fetched: Counter::default(),
            registry: Registry::default(),
            extra: Default::default(),
        };
        registry.register(
            "submits",
            "Generate / create calls that reached the log",
            m.submits.clone(),
        );
        registry.register(
            "generations_created",
            "Submits that created a new generation (the rest were idempotent repeats)",
            m.generations_created.clone(),
        );
        registry.register(
            "resumes",
            "Resume calls (gRPC Resume, Last-Event-ID, starting_after)",
            m.resumes.clone(),
        );
        registry.register(
            "tokens_streamed",
            "Token events sent to clients",
            m.tokens_streamed.clone(),
        );
        registry.register("streams_active", "Event streams open now", m.streams_active.clone());
        registry.register(
            "stream_errors",
            "Streams that ended with an error",
            m.stream_errors.clone(),
        );
        registry.register(
            "first_token_seconds",
            "Seconds from a generate request to its first token event",
            m.first_token_seconds.clone(),
        );
        registry.register("http_requests", "HTTP requests served", m.http_requests.clone());
        registry.register(
            "tokenizers_fetched",
            "Tokenizers fetched from the log, as decoders published them",
            m.tokenizers_fetched.clone(),
        );
        Metrics { registry, ..m }
    }
}

/// Decrements `streams_active` when dropped.
pub struct ActiveGuard(Gauge);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Metrics {
    pub fn stream_guard(&self) -> ActiveGuard {
        self.streams_active.inc();
        ActiveGuard(self.streams_active.clone())
    }

    /// Adds the metrics of another component of this process (`tokenlog dev`: node, decoder).
    pub fn add_source(&self, s: Source) {
        self.extra.lock().expect("lock").push(s);
    }

    /// The Prometheus text exposition of every metric (this gateway's and the added sources').
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        let mut parts = vec![out];
        parts.extend(self.extra.lock().expect("lock").iter().map(|f| f()));
        join_expositions(&parts)
    }
}

/// Concatenates OpenMetrics expositions: one `# EOF` at the end.
pub fn join_expositions(parts: &[String]) -> String {
    let mut out = String::new();
    for p in parts {
        out.push_str(p.trim_end().strip_suffix("# EOF").unwrap_or(p.trim_end()).trim_end());
        out.push('\n');
    }
    out.push_str("# EOF\n");
    out
}
