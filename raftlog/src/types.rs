//! Domain types of the log: what a Raft entry carries (`Request`), what the state machine holds
//! (`Generation`), and what it answers (`Response`). Wire (protobuf) forms live in `tokenlog-proto`
//! and are converted in `convert.rs`.

use serde::{Deserialize, Serialize};

use crate::limits::RECORDS_CHUNK;

pub type GenerationId = u64;
pub type Epoch = u64;
pub type Seq = u32;
pub type TokenId = u32;

/// Everything that identifies the model a generation is bound to (CONTRACT §1): a decoder whose
/// identity differs must refuse a generation bound to this one. The one definition for the log,
/// the decoder and the gateway.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// Lowercase hex sha256 of the weights file (or of the shards' `name sha256` lines).
    pub weights_sha256: String,
    /// Lowercase hex sha256 of the tokenizer's canonical JSON.
    pub tokenizer_sha256: String,
    /// Architecture as the model file names it (`llama`), or `fake`.
    pub architecture: String,
    /// Weight number format class (`q4_1`, `q8_0`, `f16`, ...), or `fake`.
    pub dtype_class: String,
}

impl ModelIdentity {
    /// Why a decoder running `self` with sampler scheme `rng_version` must refuse a generation
    /// bound to `bound` and `bound_rng_version`; `None` when it can continue it (CONTRACT §1:
    /// no silent cross-model continuation).
    pub fn refusal(&self, rng_version: u32, bound: &ModelIdentity, bound_rng_version: u32) -> Option<String> {
        let fields = [
            ("weights sha256", &self.weights_sha256, &bound.weights_sha256),
            ("tokenizer sha256", &self.tokenizer_sha256, &bound.tokenizer_sha256),
            ("architecture", &self.architecture, &bound.architecture),
            ("dtype class", &self.dtype_class, &bound.dtype_class),
        ];
        if let Some((name, ours, theirs)) = fields.iter().find(|(_, a, b)| a != b) {
            return Some(format!("{name}: bound to {theirs}, this decoder has {ours}"));
        }
        (rng_version != bound_rng_version)
            .then(|| format!("sampler version: bound to {bound_rng_version}, this decoder has {rng_version}"))
    }
}

/// How tokens are chosen. Field meanings follow the OpenAI / Hugging Face conventions; the "off"
/// values make `Default` (all zero) plain greedy decoding. The one definition for the binding in
/// the log, the gateway's requests and the decoder's sampler.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingConfig {
    /// 0 (or less) = greedy (argmax, ties to the lowest id).
    pub temperature: f32,
    /// Nucleus: keep the smallest set of most likely tokens whose probability reaches `top_p`.
    /// Off when `<= 0` or `>= 1`.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens. Off when 0.
    pub top_k: u32,
    /// Hugging Face repetition penalty over prompt + generated tokens: a seen token's logit is
    /// divided by it when positive, multiplied when negative. Off when 1 or `<= 0`.
    pub repetition_penalty: f32,
    /// OpenAI frequency penalty over generated tokens only: logit -= penalty × count.
    pub frequency_penalty: f32,
    /// OpenAI presence penalty over generated tokens only: logit -= penalty if seen.
    pub presence_penalty: f32,
    pub seed: u64,
    /// The sampling scheme's version (the decoder's `RNG_VERSION`) the generation is bound to.
    pub rng_version: u32,
}

impl SamplingConfig {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    pub fn top_p_on(&self) -> bool {
        self.top_p > 0.0 && self.top_p < 1.0
    }

    pub fn repetition_on(&self) -> bool {
        self.repetition_penalty > 0.0 && self.repetition_penalty != 1.0
    }
}

/// When a generation ends.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopConfig {
    /// Most tokens to generate; 0 = no limit but the model's context (the log requires >= 1).
    pub max_tokens: u32,
    /// Strings in the generated text (special tokens not shown) that end the generation; the
    /// token completing one is the last token.
    pub stop_strings: Vec<String>,
    /// Tokens that end the generation; the EOS token is generated (and committed) as the last
    /// token.
    pub eos_token_ids: Vec<TokenId>,
}

/// How a new owner re-prefills the committed prefix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ResumeMode {
    /// Same calls as the uninterrupted run: same tokens on the same device class and build.
    #[default]
    Exact,
    /// One batch for prompt + prefix: faster, may continue differently.
    Fast,
}

/// What a generation is bound to at submit; it never changes afterwards, except that a prompt
/// given as text gets its token ids once, before any record (`BindPrompt`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Binding {
    pub model: ModelIdentity,
    pub prompt_token_ids: Vec<TokenId>,
    pub prompt_text: String,
    pub sampling: SamplingConfig,
    pub stop: StopConfig,
    pub mode: ResumeMode,
    /// No record committed within this many ms of log time after submit: the generation fails.
    /// 0 = [`crate::limits::DEADLINE_MS_DEFAULT`].
    pub deadline_ms: u64,
    /// It has records, and no decoder has owned it for this many ms of log time since the last
    /// lease ended: the generation fails (its records stay readable). 0 =
    /// [`crate::limits::UNOWNED_MS_DEFAULT`].
    pub unowned_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum GenState {
    Pending,
    Running,
    Finished,
    Failed,
    Cancelled,
}

impl GenState {
    /// Every state, in declaration order ([`GenState::index`]).
    pub const ALL: [GenState; 5] = [
        GenState::Pending,
        GenState::Running,
        GenState::Finished,
        GenState::Failed,
        GenState::Cancelled,
    ];

    /// Position in [`GenState::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, GenState::Finished | GenState::Failed | GenState::Cancelled)
    }
    pub fn name(self) -> &'static str {
        match self {
            GenState::Pending => "pending",
            GenState::Running => "running",
            GenState::Finished => "finished",
            GenState::Failed => "failed",
            GenState::Cancelled => "cancelled",
        }
    }
}

/// Why a generation ended, as the log records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// An EOS token or a stop string.
    Stop,
    /// `max_tokens`, or the model's context window.
    Length,
    Error,
    Cancelled,
}

impl FinishReason {
    /// The OpenAI name (`stop`, `length`, `error`, `cancelled`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Error => "error",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// The latest ownership grant. Epoch 0 means never granted.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub epoch: Epoch,
    pub owner: String,
    pub expiry_log_ms: u64,
}

/// One committed token. `epoch` names the owner that wrote it; `log_ms` is its entry's log time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub token_id: TokenId,
    pub epoch: Epoch,
    pub log_ms: u64,
}

/// A generation's records in memory, in order: full chunks of [`RECORDS_CHUNK`] shared by
/// reference and the tail being filled. Cloning it (a snapshot's copy of the state, taken while
/// appends wait) shares the chunks and copies the tail only. Serialized as a sequence of
/// records, the same bytes as a `Vec<Record>`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Records {
    chunks: Vec<std::sync::Arc<[Record]>>,
    tail: Vec<Record>,
}

impl Records {
    pub fn len(&self) -> usize {
        self.chunks.len() * RECORDS_CHUNK + self.tail.len()
    }
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.tail.is_empty()
    }
    pub fn push(&mut self, r: Record) {
        self.tail.push(r);
        if self.tail.len() == RECORDS_CHUNK {
            let full = std::mem::take(&mut self.tail);
            self.chunks.push(full.into());
        }
    }
    pub fn get(&self, i: usize) -> Option<&Record> {
        match self.chunks.get(i / RECORDS_CHUNK) {
            Some(c) => c.get(i % RECORDS_CHUNK),
            None => self.tail.get(i - self.chunks.len() * RECORDS_CHUNK),
        }
    }
    /// Every record, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Record> + '_ {
        self.chunks.iter().flat_map(|c| c.iter()).chain(&self.tail)
    }
    /// Records `from..to` (clamped to the length), in order, without walking those before.
    pub fn range(&self, from: usize, to: usize) -> impl Iterator<Item = &Record> + '_ {
        let to = to.min(self.len());
        let from = from.min(to);
        let first = from / RECORDS_CHUNK;
        self.chunks
            .iter()
            .skip(first)
            .flat_map(|c| c.iter())
            .chain(&self.tail)
            .skip(from - first * RECORDS_CHUNK)
            .take(to - from)
    }
    /// The records as one slice: borrowed when they are all in the tail, else copied.
    pub fn as_slice(&self) -> std::borrow::Cow<'_, [Record]> {
        match self.chunks.is_empty() {
            true => std::borrow::Cow::Borrowed(&self.tail),
            false => std::borrow::Cow::Owned(self.iter().copied().collect()),
        }
    }
    pub fn clear(&mut self) {
        *self = Records::default();
    }
}

impl std::ops::Index<usize> for Records {
    type Output = Record;
    fn index(&self, i: usize) -> &Record {
        self.get(i).unwrap_or_else(|| panic!("record {i} of {}", self.len()))
    }
}

impl From<Vec<Record>> for Records {
    fn from(v: Vec<Record>) -> Self {
        let mut r = Records::default();
        for x in v {
            r.push(x);
        }
        r
    }
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Serialize for Records {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = s.serialize_seq(Some(self.len()))?;
        for r in self.iter() {
            seq.serialize_element(r)?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for Records {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<Record>::deserialize(d).map(Records::from)
    }
}

/// One past grant, kept for audits ("who wrote seq N, and when").
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub epoch: Epoch,
    pub owner: String,
    pub log_ms: u64,
    pub frontier: Seq,
}

/// A generation as the state machine holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    pub id: GenerationId,
    pub tenant: String,
    pub request_id: String,
    pub binding: Binding,
    pub state: GenState,
    pub lease: Lease,
    pub records: Records,
    pub chain_head: [u8; 32],
    pub finish_reason: Option<FinishReason>,
    pub finish_detail: String,
    pub submitted_log_ms: u64,
    pub deadline_log_ms: u64,
    /// `binding.unowned_ms` with the default applied.
    pub unowned_ms: u64,
    pub finished_log_ms: u64,
    pub grants: Vec<Grant>,
    /// Where the records of a finished generation are on disk, once a snapshot build wrote
    /// them to a cold segment. Until the generation is sealed they stay in `records` too (an
    /// identical re-send is compared with them in `apply`); the build after it is sealed drops
    /// them from memory (`records` is then empty: [`Generation::on_disk_only`]). A node's own
    /// choice, never replicated: the digest and every read see the same records whether they
    /// are here or there.
    #[serde(skip)]
    pub cold: Option<ColdRef>,
}

/// The records of one finished generation on disk ([`crate::snapshot`]): `bytes` at `offset` of
/// cold segment `segment` (0: the cold section of the snapshot file itself) with CRC-32 `crc`,
/// `records` of them. Read back, they must hash to the generation's chain head; a snapshot
/// build leaves them where they are, or copies the bytes as they are after their CRC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColdRef {
    pub segment: u64,
    pub offset: u64,
    pub bytes: u64,
    pub crc: u32,
    pub records: Seq,
}

impl Command {
    /// The tokens its appends carry (a batch's, summed): an upper bound of the records it
    /// commits (a re-send of committed records adds none).
    pub fn appended_tokens(&self) -> u64 {
        match self {
            Command::Append { items, .. } => items.iter().map(|i| i.token_ids.len() as u64).sum(),
            Command::Batch(cmds) => cmds.iter().map(Command::appended_tokens).sum(),
            _ => 0,
        }
    }
}

impl Generation {
    /// Its records are on disk and not in memory (sealed, and a snapshot build moved them).
    pub fn on_disk_only(&self) -> bool {
        self.cold.is_some() && self.records.is_empty()
    }
    pub fn frontier(&self) -> Seq {
        match self.cold {
            Some(c) => c.records,
            None => self.records.len() as Seq,
        }
    }
    /// Terminal, and finished at least [`crate::limits::SEAL_AFTER_MS`] of log time before
    /// `log_ms`: nothing in `apply` reads its records any more (an append to it is refused
    /// without comparing them), so a node may keep them on disk only.
    pub fn sealed(&self, log_ms: u64) -> bool {
        self.state.is_terminal() && log_ms >= self.finished_log_ms.saturating_add(crate::limits::SEAL_AFTER_MS)
    }
    pub fn takeovers(&self) -> u64 {
        // Every grant is a new epoch; `grants` keeps only the newest ones.
        self.lease.epoch.saturating_sub(1)
    }
    /// Owned by someone whose lease is live at `log_ms`.
    pub fn lease_live(&self, log_ms: u64) -> bool {
        self.lease.epoch > 0 && !self.lease.owner.is_empty() && log_ms < self.lease.expiry_log_ms
    }
    /// The log time at which `Tick` fails it for having had no owner too long: non-terminal,
    /// with records (before the first record `deadline_log_ms` applies), `unowned_ms` after the
    /// last lease's end.
    pub fn unowned_deadline_log_ms(&self) -> Option<u64> {
        (!self.state.is_terminal() && self.frontier() > 0)
            .then(|| self.lease.expiry_log_ms.saturating_add(self.unowned_ms))
    }
}

/// One state-machine command. Decoders and gateways send these; the leader stamps log time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    Submit {
        tenant: String,
        request_id: String,
        binding: Binding,
    },
    Acquire {
        generation: GenerationId,
        decoder: String,
        lease_ms: u64,
        model: ModelIdentity,
        rng_version: u32,
    },
    Renew {
        generation: GenerationId,
        epoch: Epoch,
        decoder: String,
        lease_ms: u64,
    },
    BindPrompt {
        generation: GenerationId,
        epoch: Epoch,
        prompt_token_ids: Vec<TokenId>,
    },
    /// One decoder step: records of many generations in one entry.
    Append {
        decoder: String,
        lease_ms: u64,
        items: Vec<AppendItem>,
    },
    Finish {
        generation: GenerationId,
        epoch: Epoch,
        reason: FinishReason,
        detail: String,
    },
    Release {
        generation: GenerationId,
        epoch: Epoch,
    },
    Cancel {
        tenant: String,
        request_id: String,
    },
    /// A decoder announces the model it serves, for `ttl_ms` of log time, as entries written
    /// before handoff listeners existed encode it (still applied from such logs; new entries
    /// are [`Command::RegisterDecoder`]). Its shape must not change: old entries decode by it.
    Register {
        decoder: String,
        info: DecoderInfoV4,
        ttl_ms: u64,
    },
    /// Leader housekeeping: fail generations past their deadline, prune finished ones past
    /// `retention_ms`. Carries its parameters so every replica decides the same.
    Tick {
        retention_ms: u64,
    },
    /// Commands the leader proposed together as one entry (group commit at the proposal level,
    /// `node::proposer`): applied in order at the entry's log time, each answered on its own in
    /// [`Response::Batch`]. Never nested; fencing stays per command and per item.
    Batch(Vec<Command>),
    /// A new leader's first command in its term (prepended by its proposer to its first
    /// proposal): log time that passed since the previous entry (an election, usually) does not
    /// count against leases. Every lease live at the previous entry's log time keeps the time
    /// it had left then, as etcd's lessor extends leases on promotion: an election no longer
    /// expires every running generation. Leases only get longer: fencing is unaffected.
    NewLeader,
    /// A decoder publishes its model's tokenizer (a package of `tokenlog_decoder::Tokenizer`,
    /// opaque to the log) under the tokenizer digest of its `ModelIdentity`, once per digest,
    /// before it registers: a gateway then detokenizes any model a decoder serves without the
    /// model's files. The first package for a digest stays; publishing it again, in any bytes,
    /// is acknowledged without effect (the reader checks the package against the digest).
    PublishTokenizer {
        tokenizer_sha256: String,
        package: TokenizerPackage,
    },
    /// The leader opened session `session` for `decoder` (`raftlog.v1.Log/Session`: a stream the
    /// decoder holds open to the leader for as long as it lives). It replaces any earlier session
    /// of that decoder.
    SessionOpened {
        decoder: String,
        session: u64,
    },
    /// The leader saw session `session` of `decoder` end (its stream broke: the process died,
    /// or its connection was reset; or it said goodbye). If it is the decoder's current session,
    /// every live lease the decoder holds ends now, as if it had released them (its
    /// generations can be acquired at once: crash detection without waiting for the lease). Its
    /// registration lapses by its TTL, as before. A stale session (the decoder opened another since, on a new
    /// leader or after a reconnect) changes nothing. Fencing is unaffected: a live decoder that
    /// only lost its connection is refused at its old epoch, as after a lease expiry.
    SessionLost {
        decoder: String,
        session: u64,
    },
    /// One step of a planned handoff of `generation` (CONTRACT §7): each phase is its own entry.
    Handoff {
        generation: GenerationId,
        step: HandoffStep,
    },
    /// A decoder announces the model it serves and where it takes handoffs, for `ttl_ms` of log
    /// time.
    RegisterDecoder {
        decoder: String,
        info: DecoderInfo,
        ttl_ms: u64,
    },
    /// A pipeline head (decoder `head`) names its stages (issue 16): which stage process serves
    /// which layer range. Applied only if the head's record is still at `expect_epoch` (0: it
    /// has none): the record then gets a new pipeline epoch, unique in the log. Stages serve
    /// work stamped with their head's current epoch only, so a stage spliced out (paused,
    /// partitioned, replaced) cannot take part in the pipeline again.
    SetPipeline {
        head: String,
        expect_epoch: u64,
        stages: Vec<PipelineStage>,
    },
    /// A stage process (`tokenlog stage --cluster ...`) announces itself for `ttl_ms` of log
    /// time (issue 16): where it is, which weights, and the layers it holds, or none yet (a
    /// cold spare, which loads the range a head asks of it). Renewed while it lives; a stage
    /// whose registration lapses is dead to the heads (they splice it out) and to the spares
    /// list. Registration is liveness only: what a stage serves is fenced by the pipeline
    /// epoch, not by this record.
    RegisterStage {
        stage_id: String,
        info: StageRegistration,
        ttl_ms: u64,
    },
    /// Decoder `decoder` asks to be the hot standby of `generation` (issue 15 item 3): it
    /// follows the committed records with a model of the generation's binding, so that it can
    /// continue with one decode step if the owner dies. The log assigns at most one live
    /// standby per generation, first come first served: granted if the generation is running,
    /// bound to `model`, owned by another decoder, and has no other live standby (a standby is
    /// live while its decoder is registered and holds a session). While the owner's lease has
    /// ended less than `STANDBY_PRIORITY_MS` ago, only a live standby may acquire it. Grants no
    /// write: a standby appends only after it acquired the generation (a new epoch).
    Standby {
        generation: GenerationId,
        decoder: String,
        model: ModelIdentity,
    },
}

/// A generation's hot standby ([`Command::Standby`]): dropped when the generation ends or is
/// pruned, and when its decoder acquires it; a standby whose decoder lapsed or lost its session
/// is not live and is replaced by the next claimant.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Standby {
    pub decoder: String,
    pub since_log_ms: u64,
}

/// A stage process as its registration describes it ([`Command::RegisterStage`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRegistration {
    /// Where heads reach it (`host:port`).
    pub addr: String,
    /// The weights it serves (of its model file), as a decoder's `ModelIdentity` names them.
    pub weights_sha256: String,
    /// The layers it holds; `0..0`: none yet (a cold spare).
    pub first_layer: u32,
    /// Exclusive.
    pub end_layer: u32,
    /// Set by apply: when the registration lapses.
    pub expiry_log_ms: u64,
}

impl StageRegistration {
    /// Whether it holds no layers yet (a cold spare).
    pub fn is_cold(&self) -> bool {
        self.first_layer == self.end_layer
    }
}

/// One stage of a pipeline's composition.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineStage {
    /// The stage process's name (`tokenlog stage --stage-id`): a stage serves a head only if
    /// the head's current composition names it, for the layers it holds.
    pub stage_id: String,
    /// Where the head reaches it (`host:port`), for operators.
    pub addr: String,
    pub first_layer: u32,
    /// Exclusive.
    pub end_layer: u32,
}

/// A pipeline head's composition as the log holds it ([`Command::SetPipeline`]): dropped when
/// the head's registration lapses.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pipeline {
    pub head: String,
    /// Unique in the log and growing: every composition of every head gets the next one.
    pub epoch: u64,
    /// In pipeline order: the first holds layer 0, each begins where the one before ends.
    pub stages: Vec<PipelineStage>,
    pub set_log_ms: u64,
}

impl Pipeline {
    /// Whether stage `stage_id` holding `layers` is part of this composition.
    pub fn has_stage(&self, stage_id: &str, first_layer: u32, end_layer: u32) -> bool {
        self.stages
            .iter()
            .any(|s| s.stage_id == stage_id && s.first_layer == first_layer && s.end_layer == end_layer)
    }
}

/// A planned handoff's phases (CONTRACT §7) in the order they happen. `Aborted` ends an attempt
/// before its ownership commit (the source stays the owner); after `OwnershipCommitted` nothing
/// aborts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum HandoffPhase {
    /// The source named the destination and an immutable manifest of its cache.
    Prepared,
    /// The source streams the cache; it keeps every block the transfer reads.
    Copying,
    /// The destination holds every block, validated against the manifest (checksum, shape,
    /// dtype), in its process memory (host memory on CPU, device memory on CUDA): ready means
    /// ready to decode, not durable.
    ReceiverReady,
    /// The destination owns the generation at the handoff epoch; the source is fenced.
    OwnershipCommitted,
    /// The source freed its cache.
    SourceReleased,
    /// Given up before the ownership commit (by either side, by a change of ownership, by the
    /// destination's session ending, or by `Tick` after `HANDOFF_PHASE_MS_MAX` in one phase).
    Aborted,
}

impl HandoffPhase {
    pub fn name(self) -> &'static str {
        match self {
            HandoffPhase::Prepared => "prepared",
            HandoffPhase::Copying => "copying",
            HandoffPhase::ReceiverReady => "receiver_ready",
            HandoffPhase::OwnershipCommitted => "ownership_committed",
            HandoffPhase::SourceReleased => "source_released",
            HandoffPhase::Aborted => "aborted",
        }
    }

    /// Before the ownership commit and not aborted: the attempt may still move ownership.
    pub fn in_flight(self) -> bool {
        self < HandoffPhase::OwnershipCommitted
    }
}

/// What the source's cache holds, fixed at `Prepared`: the destination validates what it
/// receives against it, and every acknowledgment names it (through the attempt).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheManifest {
    /// Must be the generation's bound model; the destination must serve it.
    pub model: ModelIdentity,
    /// The cache layout's identity: the decoder's cache format and device class (e.g.
    /// `kv-f32/cpu`); the destination must produce the same.
    pub cache_format: String,
    /// Committed records the cache covers: the generation's frontier at `Prepared`.
    pub frontier: Seq,
    /// Positions whose keys and values the cache holds (prompt and fed tokens).
    pub kv_positions: u32,
    /// Lowercase hex SHA-256 of the cache as sent (every tensor's header and bytes, in order).
    pub cache_sha256: String,
    pub bytes: u64,
}

/// One handoff attempt of a generation, as the log holds it: the latest per generation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handoff {
    /// Unique in the log (it counts attempts): a message of an earlier attempt, or of an
    /// earlier incarnation of the destination, names another attempt and is refused.
    pub attempt: u64,
    pub generation: GenerationId,
    pub source: String,
    pub source_epoch: Epoch,
    pub destination: String,
    /// The epoch the destination gets at the ownership commit: `source_epoch + 1`.
    pub handoff_epoch: Epoch,
    pub manifest: CacheManifest,
    pub phase: HandoffPhase,
    pub prepared_log_ms: u64,
    /// When the current phase began.
    pub phase_log_ms: u64,
    /// Why it was aborted (empty otherwise).
    pub detail: String,
}

/// A step of [`Command::Handoff`]. Each names the attempt it belongs to (but `Prepare`, which
/// creates it) and the side that takes it; the log checks both and the phase order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum HandoffStep {
    /// By the owner (`source` at `epoch`): a new attempt towards `destination`, a registered
    /// decoder serving the bound model with a handoff listener.
    Prepare {
        epoch: Epoch,
        source: String,
        destination: String,
        manifest: CacheManifest,
    },
    /// By the source, before it streams the cache.
    Copying { attempt: u64, source: String },
    /// By the destination: it holds and validated the cache named by `cache_sha256`.
    ReceiverReady {
        attempt: u64,
        destination: String,
        handoff_epoch: Epoch,
        cache_sha256: String,
    },
    /// By the destination after `ReceiverReady`: the new epoch, owned by it for `lease_ms`. A
    /// retry after it committed gets the same answer (a lost acknowledgment).
    Commit {
        attempt: u64,
        destination: String,
        handoff_epoch: Epoch,
        lease_ms: u64,
    },
    /// By the source after the commit: it freed its cache.
    SourceReleased { attempt: u64, source: String },
    /// By either side before the commit.
    Abort { attempt: u64, by: String, detail: String },
}

/// A tokenizer package as the log stores it: bytes it does not interpret. `Debug` shows the
/// length only (a state printed by a failing test stays readable).
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerPackage(pub Vec<u8>);

impl std::fmt::Debug for TokenizerPackage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenizerPackage({} bytes)", self.0.len())
    }
}

/// A decoder registration as [`Command::Register`] entries and snapshot formats 3 and 4 encode
/// it: without its handoff address.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecoderInfoV4 {
    pub model_name: String,
    pub model: ModelIdentity,
    pub capacity: u32,
    pub chat_template: String,
    pub context_tokens: u32,
    pub expiry_log_ms: u64,
}

impl From<DecoderInfoV4> for DecoderInfo {
    fn from(d: DecoderInfoV4) -> DecoderInfo {
        DecoderInfo {
            model_name: d.model_name,
            model: d.model,
            capacity: d.capacity,
            chat_template: d.chat_template,
            context_tokens: d.context_tokens,
            expiry_log_ms: d.expiry_log_ms,
            handoff_addr: String::new(),
        }
    }
}

/// What a registered decoder serves.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecoderInfo {
    pub model_name: String,
    pub model: ModelIdentity,
    pub capacity: u32,
    pub chat_template: String,
    pub context_tokens: u32,
    /// Set by apply: when the registration lapses.
    pub expiry_log_ms: u64,
    /// Where other decoders reach its handoff listener (`host:port`); empty: it accepts no
    /// planned handoff.
    pub handoff_addr: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AppendItem {
    pub generation: GenerationId,
    pub epoch: Epoch,
    pub start_seq: Seq,
    pub token_ids: Vec<TokenId>,
    pub finish: Option<(FinishReason, String)>,
}

/// The Raft entry payload: a command stamped with the leader's clock. The command is shared:
/// the log's entry cache hands copies of an entry to replication and to apply, and a copy costs
/// a reference count, not an allocation per item (the encoding is the command's own).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub log_ms: u64,
    pub cmd: std::sync::Arc<Command>,
}

impl Request {
    pub fn new(log_ms: u64, cmd: Command) -> Self {
        Request {
            log_ms,
            cmd: std::sync::Arc::new(cmd),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RejectReason {
    StaleEpoch,
    LeaseExpired,
    SeqMismatch,
    RecordConflict,
    NotFound,
    Terminal,
    LeaseHeld,
    BindingConflict,
    Limit,
    Invalid,
    ModelMismatch,
    /// A handoff step out of order, of another attempt, or by the wrong side.
    HandoffConflict,
    /// A pipeline composition written against an epoch that is not the head's current one.
    PipelineConflict,
    /// The log holds as many of something (generations, tenants, registrations) as it may:
    /// the request is fine, the log is full; try again later. (`Limit` is a request's own
    /// field past a bound.)
    Full,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    pub reason: RejectReason,
    pub message: String,
    pub current_epoch: Epoch,
    pub frontier: Seq,
    pub state: Option<GenState>,
}

/// A summary of a generation without its records, returned by writes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerationView {
    pub id: GenerationId,
    pub tenant: String,
    pub request_id: String,
    pub binding: Binding,
    pub state: GenState,
    pub lease: Lease,
    pub frontier: Seq,
    pub finish_reason: Option<FinishReason>,
    pub finish_detail: String,
    pub chain_head: [u8; 32],
    pub submitted_log_ms: u64,
    pub deadline_log_ms: u64,
    pub unowned_ms: u64,
    pub takeovers: u64,
}

impl From<&Generation> for GenerationView {
    fn from(g: &Generation) -> Self {
        GenerationView {
            id: g.id,
            tenant: g.tenant.clone(),
            request_id: g.request_id.clone(),
            binding: g.binding.clone(),
            state: g.state,
            lease: g.lease.clone(),
            frontier: g.frontier(),
            finish_reason: g.finish_reason,
            finish_detail: g.finish_detail.clone(),
            chain_head: g.chain_head,
            submitted_log_ms: g.submitted_log_ms,
            deadline_log_ms: g.deadline_log_ms,
            unowned_ms: g.unowned_ms,
            takeovers: g.takeovers(),
        }
    }
}

/// What an accepted append item answers: the writer's epoch and its lease's end (the owner is
/// the writer; without its name, the answer costs no allocation per item).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppendedLease {
    pub epoch: Epoch,
    pub expiry_log_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AppendOutcome {
    pub generation: GenerationId,
    pub result: Result<AppendedLease, Rejection>,
    pub frontier: Seq,
}

/// What applying one entry answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Response {
    /// Blank and membership entries.
    None,
    Submitted {
        generation: GenerationView,
        created: bool,
    },
    Ownership(Result<GenerationView, Rejection>),
    Appended(Vec<AppendOutcome>),
    Ticked {
        failed: u32,
        pruned: u32,
    },
    Registered(Result<u64, Rejection>),
    /// One answer per command of a [`Command::Batch`], in order.
    Batch(Vec<Response>),
    /// [`Command::NewLeader`]: how many leases were extended, and by how much log time.
    LeasesExtended {
        leases: u32,
        by_ms: u64,
    },
    /// [`Command::PublishTokenizer`]: `Ok(true)` stored now, `Ok(false)` already there.
    Published(Result<bool, Rejection>),
    /// [`Command::SessionOpened`] (0) and [`Command::SessionLost`]: the leases it ended.
    Session(Result<u32, Rejection>),
    /// [`Command::Handoff`]: the attempt after the step (with the generation after it).
    Handoff(Result<(Handoff, GenerationView), Rejection>),
    /// [`Command::SetPipeline`]: the head's record after it.
    Pipeline(Result<Pipeline, Rejection>),
}

impl std::fmt::Display for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match &*self.cmd {
            Command::Submit { .. } => "submit",
            Command::Acquire { .. } => "acquire",
            Command::Renew { .. } => "renew",
            Command::BindPrompt { .. } => "bind-prompt",
            Command::Append { .. } => "append",
            Command::Finish { .. } => "finish",
            Command::Release { .. } => "release",
            Command::Cancel { .. } => "cancel",
            Command::Register { .. } | Command::RegisterDecoder { .. } => "register",
            Command::Tick { .. } => "tick",
            Command::Batch(_) => "batch",
            Command::NewLeader => "new-leader",
            Command::PublishTokenizer { .. } => "publish-tokenizer",
            Command::SessionOpened { .. } => "session-opened",
            Command::SessionLost { .. } => "session-lost",
            Command::Handoff { .. } => "handoff",
            Command::SetPipeline { .. } => "set-pipeline",
            Command::RegisterStage { .. } => "register-stage",
            Command::Standby { .. } => "standby",
        };
        write!(f, "{name}@{}", self.log_ms)
    }
}

impl std::fmt::Display for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(i: usize) -> Record {
        Record {
            token_id: i as TokenId,
            epoch: 1 + (i / 100) as Epoch,
            log_ms: 7 * i as u64,
        }
    }

    #[test]
    fn records_in_chunks_read_back_as_the_vector_they_were_pushed_from() {
        for n in [
            0,
            1,
            RECORDS_CHUNK - 1,
            RECORDS_CHUNK,
            RECORDS_CHUNK + 1,
            3 * RECORDS_CHUNK + 17,
        ] {
            let v: Vec<Record> = (0..n).map(rec).collect();
            let r = Records::from(v.clone());
            assert_eq!(r.len(), n);
            assert_eq!(r.is_empty(), n == 0);
            assert_eq!(r.iter().copied().collect::<Vec<_>>(), v);
            assert_eq!(r.as_slice().as_ref(), v.as_slice());
            for i in 0..n {
                assert_eq!(r[i], v[i]);
            }
            assert_eq!(r.get(n), None);
            for (a, b) in [
                (0, n),
                (1, n),
                (n / 2, n / 2 + 3),
                (RECORDS_CHUNK, n + 5),
                (n + 1, n + 9),
                (5, 2),
            ] {
                let want: Vec<Record> = v[a.min(b).min(n)..b.min(n)].to_vec();
                let want = if a > b { Vec::new() } else { want };
                assert_eq!(
                    r.range(a, b).copied().collect::<Vec<_>>(),
                    want,
                    "n {n}, range {a}..{b}"
                );
            }
            // The same bytes as the vector's (snapshots written before and after read alike).
            let opts = bincode::DefaultOptions::new().with_fixint_encoding();
            use bincode::Options;
            let bytes = opts.serialize(&r).unwrap();
            assert_eq!(bytes, opts.serialize(&v).unwrap());
            assert_eq!(opts.deserialize::<Records>(&bytes).unwrap(), r);
        }
    }

    #[test]
    fn a_copy_of_records_shares_the_full_chunks_and_keeps_what_it_held() {
        let mut r = Records::from((0..2 * RECORDS_CHUNK + 5).map(rec).collect::<Vec<_>>());
        let copy = r.clone();
        assert!(
            std::sync::Arc::ptr_eq(&r.chunks[0], &copy.chunks[0]),
            "full chunks are shared"
        );
        for i in 0..RECORDS_CHUNK {
            r.push(rec(10_000 + i));
        }
        assert_eq!(copy.len(), 2 * RECORDS_CHUNK + 5);
        assert_eq!(
            copy.iter().copied().collect::<Vec<_>>(),
            (0..2 * RECORDS_CHUNK + 5).map(rec).collect::<Vec<_>>()
        );
        assert_eq!(r.len(), 3 * RECORDS_CHUNK + 5);
        r.clear();
        assert!(r.is_empty() && !copy.is_empty());
    }
}
