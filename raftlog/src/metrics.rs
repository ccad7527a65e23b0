//! Prometheus metrics of a log node: commit latency, writes, tokens committed, fence rejections
//! (counted where the node proposed them), and, computed at scrape time from the applied state,
//! generations by state, takeovers, and Raft's term and indexes.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::types::{Command, RejectReason, Rejection, Response};

pub struct NodeMetrics {
    registry: Registry,
    /// Seconds from proposing a write to its answer (committed on a quorum and applied here).
    pub commit_seconds: Histogram,
    pub writes: Counter,
    /// Raft entries proposed through this node: `writes / proposals` is how many commands the
    /// proposer merged into one entry on average.
    pub proposals: Counter,
    pub tokens_committed: Counter,
    pub fence_rejections: Counter,
    /// Decoder sessions that ended while this node led (their leases ended at once).
    pub sessions_lost: Counter,
    generations: Family<Vec<(String, String)>, Gauge>,
    takeovers: Gauge,
    term: Gauge,
    commit_index: Gauge,
    applied_index: Gauge,
    is_leader: Gauge,
}

impl Default for NodeMetrics {
    fn default() -> Self {
        let mut r = Registry::with_prefix("tokenlog_node");
        let m = NodeMetrics {
            registry: Registry::default(),
            commit_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            writes: Counter::default(),
            proposals: Counter::default(),
            tokens_committed: Counter::default(),
            fence_rejections: Counter::default(),
            sessions_lost: Counter::default(),
            generations: Family::default(),
            takeovers: Gauge::default(),
            term: Gauge::default(),
            commit_index: Gauge::default(),
            applied_index: Gauge::default(),
            is_leader: Gauge::default(),
        };
        r.register(
            "commit_seconds",
            "Seconds from proposing a write on this node to its answer (quorum-committed and applied)",
            m.commit_seconds.clone(),
        );
        r.register("writes", "Writes proposed through this node", m.writes.clone());
        r.register(
            "proposals",
            "Raft entries proposed through this node (writes / proposals = commands per entry)",
            m.proposals.clone(),
        );
        r.register(
            "tokens_committed",
            "Token records accepted in writes proposed through this node",
            m.tokens_committed.clone(),
        );
        r.register(
            "fence_rejections",
            "Writes of a stale or expired epoch refused (CONTRACT §2), counted where proposed",
            m.fence_rejections.clone(),
        );
        r.register(
            "sessions_lost",
            "Decoder sessions that ended while this node led: each one's live leases ended at once",
            m.sessions_lost.clone(),
        );
        r.register(
            "generations",
            "Generations in the applied state, by state",
            m.generations.clone(),
        );
        r.register(
            "takeovers",
            "Grants after the first, summed over live generations",
            m.takeovers.clone(),
        );
        r.register("raft_term", "Current Raft term", m.term.clone());
        r.register(
            "raft_commit_index",
            "Commit index known to this node",
            m.commit_index.clone(),
        );
        r.register(
            "raft_applied_index",
            "Index applied by this node",
            m.applied_index.clone(),
        );
        r.register("raft_is_leader", "1 when this node is the leader", m.is_leader.clone());
        NodeMetrics { registry: r, ..m }
    }
}

fn fenced(r: &Rejection) -> bool {
    matches!(r.reason, RejectReason::StaleEpoch | RejectReason::LeaseExpired)
}

impl NodeMetrics {
    /// Records one write: its latency and what its answer says.
    pub fn observe_write(&self, cmd_tokens: u64, seconds: f64, resp: &Response) {
        self.writes.inc();
        self.commit_seconds.observe(seconds);
        match resp {
            Response::Appended(outcomes) => {
                let rejected = outcomes.iter().filter(|o| o.result.as_ref().is_err_and(fenced)).count();
                self.fence_rejections.inc_by(rejected as u64);
                if outcomes.iter().all(|o| o.result.is_ok()) {
                    self.tokens_committed.inc_by(cmd_tokens);
                }
            }
            Response::Ownership(Err(r)) if fenced(r) => {
                self.fence_rejections.inc();
            }
            _ => {}
        }
    }

    /// Token records a command carries (for `tokens_committed`).
    pub fn tokens_of(cmd: &Command) -> u64 {
        match cmd {
            Command::Append { items, .. } => items.iter().map(|i| i.token_ids.len() as u64).sum(),
            Command::Batch(cmds) => cmds.iter().map(Self::tokens_of).sum(),
            _ => 0,
        }
    }

    /// Sets the scrape-time gauges and renders everything in the Prometheus text format.
    pub fn render(
        &self,
        by_state: &[(String, u64)],
        takeovers: u64,
        term: u64,
        commit: u64,
        applied: u64,
        leader: bool,
    ) -> String {
        self.generations.clear();
        for (state, n) in by_state {
            self.generations
                .get_or_create(&vec![("state".to_string(), state.clone())])
                .set(*n as i64);
        }
        self.takeovers.set(takeovers as i64);
        self.term.set(term as i64);
        self.commit_index.set(commit as i64);
        self.applied_index.set(applied as i64);
        self.is_leader.set(i64::from(leader));
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}
