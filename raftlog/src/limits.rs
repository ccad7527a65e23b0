//! Every bound the log enforces, in one place. A command that exceeds one is rejected with
//! `RejectReason::Limit` and a message naming the limit; nothing is truncated silently. The
//! log's timing constants and defaults live here too, one definition each.

use std::time::Duration;

/// Longest request id a client may choose (bytes).
pub const REQUEST_ID_BYTES_MAX: usize = 256;
/// Longest tenant name (bytes).
pub const TENANT_BYTES_MAX: usize = 128;
/// Longest decoder id (bytes).
pub const DECODER_ID_BYTES_MAX: usize = 256;
/// Longest model name (bytes), and live decoder registrations.
pub const MODEL_NAME_BYTES_MAX: usize = 256;
pub const DECODERS_MAX: usize = 10_000;
/// Distinct tenants with live (non-pruned) generations.
pub const TENANTS_MAX: usize = 10_000;
/// Prompt length in tokens.
pub const PROMPT_TOKENS_MAX: usize = 32_768;
/// Prompt length in bytes when submitted as text (tokenized by the first owner).
pub const PROMPT_TEXT_BYTES_MAX: usize = 256 * 1024;
/// `max_tokens` of one generation.
pub const GENERATION_TOKENS_MAX: u32 = 32_768;
/// Stop strings per generation, and bytes per stop string.
pub const STOP_STRINGS_MAX: usize = 16;
pub const STOP_STRING_BYTES_MAX: usize = 256;
/// EOS ids per generation.
pub const EOS_IDS_MAX: usize = 16;
/// Records in one append item (one generation, one step), and items in one append command.
pub const RECORDS_PER_APPEND_MAX: usize = 4_096;
pub const ITEMS_PER_APPEND_MAX: usize = 1_024;
/// Generations that are not yet pruned (live and retained) in the whole log.
pub const GENERATIONS_MAX: usize = 1_000_000;
/// Lease length a decoder may ask for, and the one decoders ask for when not told otherwise
/// (`tokenlog decoder --lease-ms`, `dev`, benches, the fault suite): a takeover after a crash waits
/// about this long.
pub const LEASE_MS_DEFAULT: u64 = 800;
pub const LEASE_MS_MIN: u64 = 100;
pub const LEASE_MS_MAX: u64 = 600_000;
/// Deadline for a first record when the submit names none, and the largest one accepted.
pub const DEADLINE_MS_DEFAULT: u64 = 120_000;
pub const DEADLINE_MS_MAX: u64 = 24 * 3_600_000;
/// A generation with records and no owner for this long after its last lease ended fails
/// (`Binding::unowned_ms`): its clients do not wait forever when no compatible decoder is left.
pub const UNOWNED_MS_DEFAULT: u64 = 120_000;
pub const UNOWNED_MS_MAX: u64 = 24 * 3_600_000;
/// How long finished generations are kept before `Tick` prunes them.
pub const RETENTION_MS_DEFAULT: u64 = 24 * 3_600_000;
/// A finished generation is sealed this long (log time) after it finished: an append to it is
/// refused as `Terminal` without comparing records (before, an identical re-send of committed
/// records, a retry whose acknowledgment was lost, is acknowledged). Longer than any decoder's
/// retry of its last append. A node keeps in memory the records of running generations and of
/// those finished less than this long ago, plus what was committed since its last snapshot;
/// a snapshot moves the records of sealed generations to disk (`raftlog::sm_store`).
pub const SEAL_AFTER_MS: u64 = 10_000;
/// A node builds a snapshot once this many tokens were appended since its last one, whatever
/// the entry count (`NodeConfig::snapshot_every`; one entry can carry thousands of tokens), or
/// once as many tokens as the last snapshot's body held records of running generations, if that
/// is more ([`snapshot_due`]). The build moves sealed generations' records to disk, so the
/// records a node holds in memory stay under the larger of the two plus those of running
/// generations and of generations finished less than [`SEAL_AFTER_MS`] before the last
/// snapshot (~100 bytes each in memory: ~100 MiB at this count).
pub const SNAPSHOT_AFTER_TOKENS: u64 = 1 << 20;

/// Whether a node builds a snapshot now for its token count: `tokens_since` appended since its
/// last one, whose body held `body_records` records of running generations (each build writes
/// every one of those again; sealed records are written once, in a cold segment). Waiting for
/// at least as many new tokens as the body held keeps what the builds write at most about one
/// record per record appended, however long the running generations grow: with 512 generations
/// that never ended (`tokenlog bench log`), a build every 2^20 tokens wrote 1.3M, 2.5M, 3.6M,
/// ... records, a quadratic cost (~10% of the servers' CPU after 20 s). The cost: up to that
/// many more tokens of log to re-apply at a restart, and sealed records leave memory later.
pub fn snapshot_due(tokens_since: u64, body_records: u64) -> bool {
    tokens_since >= SNAPSHOT_AFTER_TOKENS.max(body_records)
}

/// A snapshot's copy of the state (under the read lock: appends wait) that takes this long is
/// reported as a warning, with the generations and records it held.
pub const SNAPSHOT_COPY_WARN_MS: u64 = 20;
/// Records of a generation per shared chunk in memory ([`crate::types::Records`]): a snapshot's
/// copy of the state shares the full chunks and copies at most this many records per generation
/// (the tail being filled), so the copy that appends wait for is O(generations), not O(records).
pub const RECORDS_CHUNK: usize = 256;
/// Grants (epoch, owner, log time, frontier) a generation keeps for audits: the newest ones.
pub const GRANTS_KEPT_MAX: usize = 16;
/// The shortest retention a node accepts (`--retention-ms`): a client that reconnects right
/// after its generation finished must still find it. Short enough for the fault suite's stress
/// configurations, which prune while a run goes on.
pub const RETENTION_MS_MIN: u64 = 500;
/// A model's tokenizer as the log keeps it for gateways (`Command::PublishTokenizer`): the
/// largest package accepted (SmolLM2's is 1.86 MB), and the distinct tokenizers the log holds.
/// Packages are kept for good (a finished generation's text needs its tokenizer as long as
/// the generation is retained); a publish past the count is refused with `Full`.
pub const TOKENIZER_PACKAGE_BYTES_MAX: usize = 16 << 20;
pub const TOKENIZERS_MAX: usize = 64;
/// Pipeline compositions (`Command::SetPipeline`, one per pipeline head): stages per pipeline,
/// bytes of a stage's name and address, and heads with a record in the whole log (at the bound,
/// records of heads without a live registration make room first).
pub const PIPELINE_STAGES_MAX: usize = 64;
pub const STAGE_ID_BYTES_MAX: usize = 256;
pub const STAGE_ADDR_BYTES_MAX: usize = 256;
pub const PIPELINES_MAX: usize = DECODERS_MAX;
/// Stage registrations (`Command::RegisterStage`) the log holds at once; a new stage past it is
/// refused with `Limit` (lapsed ones are dropped by `Tick`).
pub const STAGES_MAX: usize = 1_024;
/// A planned handoff still in one phase before its ownership commit after this much log time is
/// aborted by `Tick` (the source keeps the generation).
pub const HANDOFF_PHASE_MS_MAX: u64 = 10_000;
/// After an owner's lease ends (its session lost, or expired), only the generation's live hot
/// standby may acquire it for this much log time: the standby continues with one decode step,
/// any other decoder would re-prefill. Longer than a standby's poll of pending work (`--poll-ms`)
/// plus an acquire; short, since a standby that does not come delays the takeover this much.
pub const STANDBY_PRIORITY_MS: u64 = 1_500;
/// Claimable-index entries one standby PendingWork answer looks at (generations that already
/// have a live standby are passed over): a read path, bounded.
pub const STANDBY_SCAN_MAX: usize = 4_096;
/// The longest handoff listener address a registration carries.
pub const HANDOFF_ADDR_BYTES_MAX: usize = 256;
/// The longest cache format name in a handoff manifest.
pub const CACHE_FORMAT_BYTES_MAX: usize = 64;
/// Longest finish detail kept (bytes); longer ones are rejected.
pub const FINISH_DETAIL_BYTES_MAX: usize = 1_024;
/// Records per Watch event.
pub const WATCH_RECORDS_PER_EVENT_MAX: usize = 256;
/// Generations listed by one PendingWork answer.
pub const PENDING_WORK_LIMIT_MAX: u32 = 1_024;
/// Encoded bytes of the generations one PendingWork answer lists at most (at least one is
/// listed): each carries its binding, up to ~430 KB with a whole prompt's text and ids, and
/// 1,024 of them would not fit one message. The decoder asks again for the rest.
pub const PENDING_WORK_BYTES_MAX: usize = GRPC_MESSAGE_BYTES_MAX / 4;
/// Generations one PendingWork may name as followed by its decoder's hot standby
/// (`standing_by`; a decoder follows at most 256).
pub const PENDING_STANDING_BY_MAX: usize = 1_024;
/// Events buffered per Watch stream between the state machine and a slow client.
pub const WATCH_BUFFER_EVENTS: usize = 16;
/// How long a node may go without a quorum behind it (a leader no quorum acknowledged, or a
/// node that knows no leader) before it counts as cut off: its applied state no longer moves
/// while the rest of the cluster may go on, so its Watch streams end with UNAVAILABLE and it
/// opens none (the client watches from another node). Well above an election (0.5-1 s of
/// election timeout, ~1.3 s from a leader's kill to the next commit, `bench leader-kill`).
pub const CUT_OFF_AFTER: std::time::Duration = std::time::Duration::from_secs(3);
/// How often a waiting Watch asks whether its node is cut off.
pub const CUT_OFF_POLL: std::time::Duration = std::time::Duration::from_millis(250);
/// Bytes per chunk of a snapshot streamed to a follower.
pub const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;
/// Largest snapshot a follower accepts from the leader (bytes on disk; in memory it holds one
/// chunk at a time).
pub const SNAPSHOT_BYTES_MAX: u64 = 256 << 30;
/// The leader's proposer (group commit at the proposal level): proposals not yet committed at
/// once; while that many are in flight, commands that arrive wait and go out together as one
/// `Batch` entry of at most this many commands and tokens. 8 rather than 4: at 16 writers
/// (`tokenlog bench log --writers 16 --no-etcd`, release, 2 cores, alternated) 4,573 / 4,884
/// writes/s and p99 6.4 / 6.1 ms against 4,176 / 4,434 and 9.9 / 9.2 ms, server CPU per write
/// 301 / 285 µs against 325 / 309; 2 was no better than 4; 64 and 256 writers alike.
pub const PROPOSALS_IN_FLIGHT_MAX: usize = 8;
pub const PROPOSAL_COMMANDS_MAX: usize = 1_024;
pub const PROPOSAL_TOKENS_MAX: u64 = 65_536;
/// The largest command the log takes into an entry (its bincode size, checked before it is
/// proposed, `state::precheck`): a tokenizer package at its bound and then some. Bounds in
/// `apply` come too late for size: an entry is replicated whole before it is applied, and one
/// past the peers' message bound (`GRPC_MESSAGE_BYTES_MAX`) could never reach a follower, so
/// every later write would wait behind it. The proposer merges commands into an entry up to
/// this many bytes too (a larger command alone). A replication message of several such
/// entries is split to `REPLICATION_MESSAGE_BYTES_MAX`.
pub const COMMAND_BYTES_MAX: u64 = TOKENIZER_PACKAGE_BYTES_MAX as u64 + (1 << 20);
/// The most entry bytes one replication request carries to a follower (`transport::split_append`).
/// openraft batches entries by count (up to 300), not bytes: a follower that lagged behind a few
/// entries near `COMMAND_BYTES_MAX` was sent them in one message past the peers' bound, refused
/// on every try, and never caught up. A request over this is sent as several, each starting
/// where the one before ended; an entry larger than this alone goes alone.
pub const REPLICATION_MESSAGE_BYTES_MAX: usize = 32 << 20;
const _: () = assert!(
    COMMAND_BYTES_MAX as usize + (1 << 20) <= REPLICATION_MESSAGE_BYTES_MAX
        && REPLICATION_MESSAGE_BYTES_MAX + (1 << 20) <= GRPC_MESSAGE_BYTES_MAX,
    "one entry of the largest command, with its request around it, fits a replication message, and that a peer's message bound"
);
/// A model identity's fields (hex digests, architecture, number format) and a decoder's chat
/// template, in bytes: stored with every registration and generation, on every replica and in
/// every snapshot.
pub const MODEL_IDENTITY_FIELD_BYTES_MAX: usize = 256;
pub const CHAT_TEMPLATE_BYTES_MAX: usize = 64 * 1024;
/// Commands waiting for the proposer before `write` pushes back (waits for room).
pub const PROPOSER_QUEUE_MAX: usize = 16_384;
/// Appends of one `AppendStream` proposed and not yet answered; the stream reads no further
/// request until the oldest is answered (HTTP/2 flow control then holds the decoder back).
pub const APPEND_STREAM_IN_FLIGHT_MAX: usize = 64;
/// The newest log entries kept in memory for replication and apply (`log_store::EntryCache`):
/// at most this many, and this many encoded bytes (the newest entry stays even if larger).
pub const LOG_CACHE_ENTRIES_MAX: usize = 4_096;
pub const LOG_CACHE_BYTES_MAX: usize = 32 << 20;
/// How far a leader's wall clock may pull log time ahead of its monotonic clock
/// (`clock.rs`): the most a wall clock that jumps, or runs ahead, moves log time. Below half the
/// shortest lease.
pub const STAMP_WALL_LEAD_MS_MAX: u64 = 25;
/// How often the leader considers proposing a `Tick`.
pub const TICK_INTERVAL: Duration = Duration::from_millis(500);
/// A leader that has answered no proposal for this long while one waited as long (a stall:
/// its followers gone and back without an election, a stuck disk) puts a `NewLeader` ahead of
/// its next entries, which credits the stall to the live leases as after an election; and
/// once more at the first entry after the stall. Under `LEASE_MS_DEFAULT`, far over a
/// commit's latency (a slow but steady log gets no credit: its renewals commit).
pub const COMMIT_STALL_CREDIT: Duration = Duration::from_millis(500);
const _: () = assert!((COMMIT_STALL_CREDIT.as_millis() as u64) < LEASE_MS_DEFAULT);
/// How long a stopping node waits for open streams (Watches) to end before it closes them.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// A TLS handshake that takes longer is dropped (a client that connects and says nothing holds
/// no task for long).
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a process's readiness check is re-evaluated for `grpc.health.v1` (`health.rs`).
pub const HEALTH_POLL: Duration = Duration::from_millis(500);
/// HTTP/2 keepalive on every gRPC connection, both ends: a PING every `KEEPALIVE_INTERVAL`, and a
/// connection whose PING is not answered within `KEEPALIVE_TIMEOUT` is closed. A peer that
/// vanished without closing its connections (a container killed or cut off its network, a
/// machine powered off: no FIN, no RST) would otherwise leave a Watch, an AppendStream or a
/// replication stream waiting on it for ever (found by `tests/deploy_docker.rs`).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(2);
/// Connecting to a peer or a node (Raft transport and `LogClient`).
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// One `LogClient` call; and how long a call keeps retrying through leader changes and
/// unreachable nodes, with pauses that double from the minimum to the maximum.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
pub const RETRY_BUDGET_DEFAULT: Duration = Duration::from_secs(15);
pub const RETRY_PAUSE_MIN: Duration = Duration::from_millis(20);
pub const RETRY_PAUSE_MAX: Duration = Duration::from_millis(100);
/// Largest gRPC message a node accepts (bytes).
pub const GRPC_MESSAGE_BYTES_MAX: usize = 64 * 1024 * 1024;
