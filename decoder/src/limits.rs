//! The decoder's timing constants and bounds, one definition each.

use std::time::Duration;

/// How long a new owner waits to read the committed prefix it was told about at acquire.
pub const PREFIX_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause before reading the prefix again after a node could not answer.
pub const PREFIX_READ_RETRY_PAUSE: Duration = Duration::from_millis(50);
/// The renewer renews every held lease each `lease / RENEWS_PER_LEASE` (at least every
/// `RENEW_PERIOD_MIN`), so one or two lost renewals still leave the lease alive.
pub const RENEWS_PER_LEASE: u64 = 3;
pub const RENEW_PERIOD_MIN: Duration = Duration::from_millis(50);
/// A decoder refreshes its registration at least this often (and every lease).
pub const REGISTER_PERIOD_MIN: Duration = Duration::from_secs(1);
/// A registration lives `REGISTRATION_TTL_LEASES` leases, and at least `REGISTRATION_TTL_MIN_MS`.
pub const REGISTRATION_TTL_LEASES: u64 = 5;
pub const REGISTRATION_TTL_MIN_MS: u64 = 5_000;
/// Appends a worker has sent on its `AppendStream` and not yet seen answered; at this many it
/// sends nothing more until an answer arrives (and keeps sampling meanwhile).
pub const APPENDS_IN_FLIGHT_MAX: usize = 4;
/// A worker whose step loop makes no progress this long is stuck (a deadlock, a hung call):
/// it ends with an error, so its leases lapse and another decoder takes over, and its process
/// exits for a supervisor to restart. Slow is not dead: well above any step or re-prefill.
pub const STALL_MS_DEFAULT: u64 = 120_000;
/// The least stall limit a worker accepts (the watchdog looks a few times per limit).
pub const STALL_MS_MIN: u64 = 1_000;
/// A generation stops sampling while this many of its tokens are not yet acknowledged (the log
/// is slow or unreachable); it resumes as answers arrive.
pub const UNACKED_TOKENS_MAX: usize = 256;
/// An append unanswered this long ends its stream (the worker opens another and re-sends from
/// the last acknowledged frontier).
pub const APPEND_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// A worker's append stream that fails again without an answer in between is reopened after
/// this pause, doubling up to the maximum (the first failure reopens at once: a leader change).
pub const STREAM_RETRY_PAUSE_MIN: Duration = Duration::from_millis(10);
pub const STREAM_RETRY_PAUSE_MAX: Duration = Duration::from_millis(200);
/// A decoder's session with the leader (instant crash detection): the pause before opening it
/// again after it ended or could not be opened (doubling up to the max), and how long a
/// starting worker waits for its first session before it takes work anyway (an older log has
/// no sessions; its crashes are then found by lease expiry).
pub const SESSION_RETRY_PAUSE_MIN: Duration = Duration::from_millis(20);
pub const SESSION_RETRY_PAUSE_MAX: Duration = Duration::from_millis(500);
pub const SESSION_WAIT_MAX: Duration = Duration::from_secs(2);
/// Generations a worker acquires and prepares at once when it takes work (the leader merges
/// the acquires into few entries; re-prefills run on blocking threads).
pub const TAKES_AT_ONCE_MAX: usize = 64;

/// Planned handoffs a source runs at once (each pauses its own generation only while its cache
/// is copied; the generation decodes on during the transfer). One: two at once, with both
/// decoders and the log on 2 cores, stalled every generation of the source while two caches
/// were hashed, sent and loaded (`tokenlog bench drain --rounds 3`, SmolLM2: longest gap
/// 2.19-3.53x the normal one with 2, 1.65-2.03x with 1; a drain of 4 takes ~0.9 s, not ~0.5 s).
pub const HANDOFFS_AT_ONCE_MAX: usize = 1;
/// The longest a source waits for a destination's answer to a cache transfer (then it asks the
/// log what happened).
pub const HANDOFF_TRANSFER_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest cache a destination accepts (blocks and logits), whatever its model's cache of
/// the manifest's positions (`Model::cache_bytes`), which bounds it first.
pub const HANDOFF_CACHE_BYTES_MAX: u64 = 4 << 30;
/// The most blocks a received cache holds (a model's cache has two per layer). Messages of no
/// bytes that each opened a block grew a destination's memory with nothing counted against
/// `HANDOFF_CACHE_BYTES_MAX`.
pub const HANDOFF_CACHE_BLOCKS_MAX: usize = 4_096;
/// Bytes of one cache block per transfer message (a block is split along its bytes).
pub const HANDOFF_CHUNK_BYTES: usize = 4 << 20;
/// Rows (`decoder.v1.KvRow`, one position each) a handoff source queues for its transfer while
/// it decodes on; a full queue ends its rows (the destination computes the rest). SmolLM2-135M:
/// 46 KB of keys and values and 197 KB of logits a row, so at most ~16 MB queued.
pub const HANDOFF_ROWS_QUEUE: usize = 64;
/// A destination's follow passes before its commit go only as far as the source's rows and
/// logits (no forward pass) when those end at most this many records short of the log's
/// frontier; further behind, it computes up to the frontier.
pub const HANDOFF_ROWS_LAG_MAX: u32 = 4;
/// How long a destination that committed waits for the rows of the records the source wrote
/// last (its next step sends them) before it computes those positions itself: about one step
/// of a CPU decoder, which is what computing them costs the client too.
pub const HANDOFF_ROWS_WAIT: Duration = Duration::from_millis(25);
/// How long a destination's `Rows` call waits for its attempt's transfer to begin (the two
/// calls start together; one that never begins was refused).
pub const HANDOFF_ROWS_FIND: Duration = Duration::from_secs(1);
/// The most bytes of rows a destination holds before its follow passes take them; more are
/// dropped (and computed).
pub const HANDOFF_ROWS_BYTES_MAX: usize = 64 << 20;
/// The most a handoff source copies between two steps to take a cache without pausing its
/// generation (a memory copy on the step loop's thread, a few ms; the CPU engine copies at
/// most the chunk each layer's keys and values are filling, at the next step, as it shares
/// the others: 2.9 MB for SmolLM2-135M); a cache that needs more is
/// copied on a blocking thread once every sampled token is committed, its generation paused
/// meanwhile.
pub const CACHE_COPY_IN_STEP_BYTES_MAX: usize = 16 << 20;
/// Rounds of following the source's new records a destination runs right before its
/// ownership commit (the source decodes on meanwhile; it stops early once a round finds at
/// most one new record, or no fewer than the round before).
pub const HANDOFF_FOLLOW_ROUNDS_MAX: usize = 6;
/// The longest a worker waits for the last answers of a generation it is about to hand over
/// before stepping the others (the answers usually take a few ms).
pub const MOVE_SETTLE_MAX: Duration = Duration::from_millis(50);
/// How long a draining decoder (SIGTERM with a handoff listener) tries to hand its generations
/// to other decoders before it releases the rest, by default.
pub const DRAIN_MS_DEFAULT: u64 = 10_000;
/// How long a stopping decoder waits for the log to take its releases, all of them together.
pub const RELEASE_ALL_TIMEOUT: Duration = Duration::from_secs(5);
/// A drain whose handoff of a generation a destination refused (full) or failed tries it
/// again after this long, until the drain's time is up.
pub const DRAIN_RETRY_PAUSE: Duration = Duration::from_millis(500);
/// How often a rebalancing decoder (`--rebalance`) compares its load with the other decoders'.
pub const REBALANCE_EVERY: Duration = Duration::from_secs(2);
/// A rebalancing decoder hands a generation to another decoder of its model when it holds at
/// least this many more generations than that one (moving one then narrows the gap, never
/// reverses it).
pub const REBALANCE_SPREAD_MIN: u32 = 2;
/// After a rebalancing handoff did not happen, how long the decoder waits before the next one.
pub const REBALANCE_BACKOFF: Duration = Duration::from_secs(10);
/// The longest a stopping decoder with nothing to drain waits for its last registration (the
/// one without its handoff listener) before it exits anyway.
pub const STOP_REGISTER_TIMEOUT: Duration = Duration::from_secs(2);

/// Positions of a joining generation's prefill (prompt, or prompt and committed prefix) fed per
/// batched step beside the running generations' single tokens: a long prompt costs the others
/// a few short stalls instead of one long one. Only for sequences whose logits do not depend
/// on the grouping ([`crate::Sequence::grouping_invariant`]); others prefill in one call.
pub const PREFILL_CHUNK_TOKENS: usize = 32;

/// Pipeline stages (`crate::stage`, `crate::pipeline`): the largest message on a head's stream
/// to a stage (a prefill's rows: 2048 positions of a 4096-wide model are 32 MiB), the items of
/// one request, and the sequences a stage keeps for one stream of a head (a head holds one
/// stream per stage; one that opens several holds this many on each).
pub const STAGE_MESSAGE_BYTES_MAX: usize = 64 << 20;
pub const STAGE_ITEMS_MAX: usize = 256;
pub const STAGE_SEQUENCES_MAX: usize = 1024;
/// Heads a stage's fence remembers (their newest epoch, what the log said of them), and the
/// longest head name it takes (the log's bound on a decoder id). With a log, heads without an
/// open stream are forgotten first (the log still knows them); a request of a new head past
/// this is refused.
pub const STAGE_FENCE_HEADS_MAX: usize = 10_000;
pub const STAGE_HEAD_BYTES_MAX: usize = tokenlog_raftlog::limits::DECODER_ID_BYTES_MAX;
/// The longest a head waits for a stage's answer to one pass (then the pass fails: the head's
/// step fails, as a whole decoder's failed model step does).
pub const STAGE_ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// A stage's knowledge that a head's composition at an epoch names it (read from the log) is
/// trusted for this long without another read; a stage reads the compositions of the heads it
/// serves every `STAGE_FENCE_REFRESH`, so a busy pipeline reads nothing per pass, and a stage
/// that was paused (or cut off) for longer reads the log again before its next pass.
pub const STAGE_FENCE_FRESH: Duration = Duration::from_millis(500);
pub const STAGE_FENCE_REFRESH: Duration = Duration::from_millis(150);
/// A stage process's registration in the log (`tokenlog stage --cluster`) lives this long
/// from its latest renewal; the stage renews it every quarter of it. A head splices out a
/// stage whose registration lapsed (a paused, cut-off or dead stage) without waiting for its
/// stream to time out; heads read the registrations every `STAGE_LEASE_POLL`.
pub const STAGE_REGISTRATION_TTL: Duration = Duration::from_millis(1_000);
/// A stage's registration renewals unanswered at once (each starts on time, not after the one
/// before is answered).
pub const STAGE_RENEWALS_IN_FLIGHT: usize = 3;
pub const STAGE_LEASE_POLL: Duration = Duration::from_millis(100);
/// How long a head whose stage failed looks for a spare in the log (every `STAGE_LEASE_POLL`)
/// before its step fails: a supervisor that restarts the dead stage, or a spare that starts,
/// is found meanwhile.
pub const STAGE_SPARE_WAIT: Duration = Duration::from_secs(3);
/// The longest that wait grows while the log cannot say which spares are registered (its
/// rounds without an answer do not count toward `STAGE_SPARE_WAIT`).
pub const STAGE_SPARE_WAIT_MAX: Duration = Duration::from_secs(15);
/// The longest a head waits for a cold spare to load the layers it asked for.
pub const STAGE_LOAD_TIMEOUT: Duration = Duration::from_secs(120);
/// What a pipeline head keeps of its sequences' passes (each stage's input rows, the tokens),
/// in all, so that a spare spliced in for one stage rebuilds only that stage; a sequence past
/// the bound is fed again in full instead.
pub const PIPELINE_KEPT_BYTES_MAX: usize = 1 << 30;
/// Generations one decoder follows as a hot standby at most (`--standby`).
pub const STANDBY_MAX: usize = 256;
/// How often a decoder with free standby slots asks the log for generations to follow.
pub const STANDBY_POLL: Duration = Duration::from_millis(250);
/// A followed generation whose records cannot be watched for this long (its node gone, the
/// generation pruned) is dropped by its standby.
pub const STANDBY_WATCH_GIVE_UP: Duration = Duration::from_secs(10);
/// Bytes of KV cache a decoder's prefix cache holds in memory at most (least recently used
/// entries go first).
pub const PREFIX_CACHE_BYTES_MAX: u64 = 512 << 20;
/// Entries a prefix cache holds at most (a restore looks at each: bounded).
pub const PREFIX_CACHE_ENTRIES_MAX: usize = 256;
/// A prefix cache file larger than this is not read (it is not one this build wrote).
pub const PREFIX_CACHE_FILE_BYTES_MAX: u64 = PREFIX_CACHE_BYTES_MAX + (16 << 20);
