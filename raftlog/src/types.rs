//! Domain types of the log: what a Raft entry carries (`Request`), what the state machine holds
//! (`Generation`), and what it answers (`Response`). Wire (protobuf) forms live in `tokenlog-proto`
//! and are converted in `convert.rs`.

use serde::{Deserialize, Serialize};

pub type GenerationId = u64;
pub type Epoch = u64;
pub type Seq = u32;
pub type TokenId = u32;

/// Everything that identifies the model a generation is bound to (CONTRACT §1).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelIdentity {
    pub weights_sha256: String,
    pub tokenizer_sha256: String,
    pub architecture: String,
    pub dtype_class: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingConfig {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub seed: u64,
    pub rng_version: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopConfig {
    pub max_tokens: u32,
    pub stop_strings: Vec<String>,
    pub eos_token_ids: Vec<TokenId>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResumeMode {
    #[default]
    Exact,
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
    pub deadline_ms: u64,
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    Stop,
    Length,
    Error,
    Cancelled,
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
    pub records: Vec<Record>,
    pub chain_head: [u8; 32],
    pub finish_reason: Option<FinishReason>,
    pub finish_detail: String,
    pub submitted_log_ms: u64,
    pub deadline_log_ms: u64,
    pub finished_log_ms: u64,
    pub grants: Vec<Grant>,
}

impl Generation {
    pub fn frontier(&self) -> Seq {
        self.records.len() as Seq
    }
    pub fn takeovers(&self) -> u64 {
        self.grants.len().saturating_sub(1) as u64
    }
    /// Owned by someone whose lease is live at `log_ms`.
    pub fn lease_live(&self, log_ms: u64) -> bool {
        self.lease.epoch > 0 && !self.lease.owner.is_empty() && log_ms < self.lease.expiry_log_ms
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
    /// A decoder announces the model it serves, for `ttl_ms` of log time.
    Register {
        decoder: String,
        info: DecoderInfo,
        ttl_ms: u64,
    },
    /// Leader housekeeping: fail generations past their deadline, prune finished ones past
    /// `retention_ms`. Carries its parameters so every replica decides the same.
    Tick {
        retention_ms: u64,
    },
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
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AppendItem {
    pub generation: GenerationId,
    pub epoch: Epoch,
    pub start_seq: Seq,
    pub token_ids: Vec<TokenId>,
    pub finish: Option<(FinishReason, String)>,
}

/// The Raft entry payload: a command stamped with the leader's clock.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub log_ms: u64,
    pub cmd: Command,
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
            takeovers: g.takeovers(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AppendOutcome {
    pub generation: GenerationId,
    pub result: Result<Lease, Rejection>,
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
}

impl std::fmt::Display for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match &self.cmd {
            Command::Submit { .. } => "submit",
            Command::Acquire { .. } => "acquire",
            Command::Renew { .. } => "renew",
            Command::BindPrompt { .. } => "bind-prompt",
            Command::Append { .. } => "append",
            Command::Finish { .. } => "finish",
            Command::Release { .. } => "release",
            Command::Cancel { .. } => "cancel",
            Command::Register { .. } => "register",
            Command::Tick { .. } => "tick",
        };
        write!(f, "{name}@{}", self.log_ms)
    }
}

impl std::fmt::Display for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}
