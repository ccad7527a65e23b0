//! Pipeline stages (issue 16): a model too large for one process runs as a pipeline of stage
//! processes (`tokenlog stage`), each holding a contiguous range of its layers, driven by a
//! pipeline head ([`crate::pipeline`]) that samples and appends to the log like any decoder.
//!
//! A stage runs tokenlog's CPU forward pass ([`crate::cpu`]) over its layers only: the first
//! stage also holds the embeddings and takes token ids, the last the final norm and output head
//! and gives logits, every other one takes and gives the rows between layers (`f32`, moved as
//! they are). Every operation of that pass is per row and in a fixed order, so the split model
//! computes the same bits as the whole one: a pipeline's generation equals a whole decoder's,
//! and either can take over the other's (the model identity is the file's, as for a whole
//! model).
//!
//! The service (`decoder.v1.Stage`): `Describe` says which layers of which weights a stage
//! holds; `Forward` is a head's stream, one batched pass per request. The sequences (keys and
//! values of the stage's layers) belong to the stream: a head that dies frees them. Every
//! request is admitted by the stage's [`crate::stage_fence::Fence`] first (the head's pipeline
//! epoch against its composition in the log); a refused one changes nothing and ends the
//! stream.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokenlog_proto::decoder as dpb;
use tonic::{Request, Response, Status};

use crate::cache::{f32s_from_bytes, f32s_to_bytes};
use crate::cpu::{forward_stage, CpuSequence, CpuWeights, Fed, Feed};
use crate::error::{Error, Result};
use crate::gguf_model::LlamaFile;
use crate::limits::{
    STAGE_ITEMS_MAX, STAGE_MESSAGE_BYTES_MAX, STAGE_REGISTRATION_TTL, STAGE_RENEWALS_IN_FLIGHT, STAGE_SEQUENCES_MAX,
};
use crate::model::check_feed;
use crate::stage_fence::Fence;
use tokenlog_raftlog::client::LogClient;

/// Parses a layer range as the command line writes it: `A..B` (B exclusive).
pub fn parse_layers(s: &str) -> std::result::Result<Range<usize>, String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("{s:?} is not a layer range A..B (B exclusive, e.g. 0..10)"))?;
    let num = |x: &str| {
        x.trim()
            .parse::<usize>()
            .map_err(|_| format!("{x:?} in {s:?} is not a layer number"))
    };
    let (a, b) = (num(a)?, num(b)?);
    if a >= b {
        return Err(format!("the layer range {a}..{b} is empty (B is exclusive)"));
    }
    Ok(a..b)
}

/// One stage's weights: a layer range of a llama GGUF model on the CPU.
pub struct StageModel {
    w: Arc<CpuWeights>,
    weights_sha256: String,
    max_context: usize,
}

/// What an item feeds a stage.
pub enum StageInput<'a> {
    /// Token ids, to a first stage.
    Tokens(&'a [u32]),
    /// The rows the previous stage gave (`positions × hidden`).
    Hidden(&'a [f32]),
}

/// What a stage gives for an item.
#[derive(Debug, PartialEq)]
pub enum StageOutput {
    /// The rows of every fed position after this stage's layers (to the next stage).
    Hidden(Vec<f32>),
    /// The logits of the last fed position (a last stage).
    Logits(Vec<f32>),
}

/// A sequence's keys and values for a stage's layers.
pub struct StageSequence(CpuSequence);

impl StageSequence {
    /// Positions fed so far.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets positions `n..`; the first `n` stay as they were.
    pub fn truncate(&mut self, n: usize) {
        self.0.truncate(n)
    }

    /// Drops its keys and values.
    pub fn reset(&mut self) {
        crate::Sequence::reset(&mut self.0)
    }
}

impl StageModel {
    /// Loads the layers `layers` of the GGUF file at `path` (and the embeddings for a first
    /// stage, the final norm and output head for a last one).
    pub fn load(path: &Path, layers: Range<usize>) -> Result<Self> {
        let LlamaFile {
            mut file,
            content,
            identity,
            max_context,
            ..
        } = LlamaFile::open(path)?;
        let w = CpuWeights::from_gguf_layers(&content, &mut file, max_context, Some(layers))?;
        Ok(StageModel {
            w: Arc::new(w),
            weights_sha256: identity.weights_sha256,
            max_context,
        })
    }

    /// The number of layers of the model in the GGUF file at `path` (its header only).
    pub fn layer_count(path: &Path) -> Result<usize> {
        let f = LlamaFile::open(path)?;
        Ok(crate::llama::LlamaShape::from_gguf(&f.content)?.n_layers)
    }

    pub fn layers(&self) -> Range<usize> {
        self.w.layer_range()
    }

    pub fn total_layers(&self) -> usize {
        self.w.total_layers()
    }

    pub fn hidden(&self) -> usize {
        self.w.hidden()
    }

    pub fn is_first(&self) -> bool {
        self.w.is_first()
    }

    pub fn is_last(&self) -> bool {
        self.w.is_last()
    }

    pub fn weights_sha256(&self) -> &str {
        &self.weights_sha256
    }

    pub fn new_sequence(&self) -> StageSequence {
        StageSequence(CpuSequence::new(self.w.clone(), self.max_context))
    }

    pub fn describe(&self, stage_id: &str) -> dpb::DescribeResponse {
        let r = self.layers();
        dpb::DescribeResponse {
            weights_sha256: self.weights_sha256.clone(),
            first_layer: r.start as u32,
            end_layer: r.end as u32,
            total_layers: self.total_layers() as u32,
            hidden: self.hidden() as u32,
            vocab: self.w.vocab_size() as u32,
            max_positions: self.w.max_positions().min(self.max_context) as u32,
            stage_id: stage_id.to_string(),
            numerics: crate::cpu::NUMERICS.into(),
        }
    }

    /// Why `input` cannot be fed to `seq` (the kind this stage takes, the vocabulary, whole
    /// rows, the context).
    fn check(&self, seq: &StageSequence, input: &StageInput) -> Result<()> {
        match (input, self.is_first()) {
            (StageInput::Tokens(t), true) => check_feed(t, seq.len(), self.max_context, self.w.vocab_size()),
            (StageInput::Hidden(h), false) => {
                let hidden = self.hidden();
                if h.is_empty() || h.len() % hidden != 0 {
                    return Err(Error::Invalid(format!(
                        "{} values are not whole rows of {hidden}",
                        h.len()
                    )));
                }
                let needed = seq.len() + h.len() / hidden;
                if needed > self.max_context {
                    return Err(Error::ContextFull {
                        needed,
                        max: self.max_context,
                    });
                }
                Ok(())
            }
            (StageInput::Tokens(_), false) => Err(Error::Invalid(format!(
                "token ids sent to the stage of layers {:?}, which takes the rows of the stage before it",
                self.layers()
            ))),
            (StageInput::Hidden(_), true) => Err(Error::Invalid(
                "rows sent to a first stage, which takes token ids".into(),
            )),
        }
    }

    /// Feeds every item in one batched pass; per item its output, or why it was refused (that
    /// sequence is then reset; the others go on).
    pub fn forward(&self, items: &mut [(&mut StageSequence, StageInput)]) -> Vec<Result<StageOutput>> {
        let mut results: Vec<Option<Result<StageOutput>>> = Vec::with_capacity(items.len());
        let mut ok: Vec<(&mut CpuSequence, Feed)> = Vec::with_capacity(items.len());
        for (seq, input) in items.iter_mut() {
            match self.check(seq, input) {
                Ok(()) => {
                    results.push(None);
                    let feed = match input {
                        StageInput::Tokens(t) => Feed::Tokens(t),
                        StageInput::Hidden(h) => Feed::Hidden(h),
                    };
                    ok.push((&mut seq.0, feed));
                }
                Err(e) => {
                    seq.reset();
                    results.push(Some(Err(e)));
                }
            }
        }
        let mut out = match ok.is_empty() {
            true => Vec::new(),
            false => forward_stage(&self.w, &mut ok),
        }
        .into_iter();
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Ok(match out.next().expect("one per fed item") {
                        Fed::Hidden(h) => StageOutput::Hidden(h),
                        Fed::Logits(l) => StageOutput::Logits(l),
                    })
                })
            })
            .collect()
    }
}

/// The `decoder.v1.Stage` service of a stage process: hot (its layers loaded at start) or
/// cold (a spare that loads the layer range a head asks of it, once, with `Load`).
#[derive(Clone)]
pub struct StageService {
    shared: Arc<Shared>,
}

struct Shared {
    stage_id: String,
    log: Option<LogClient>,
    /// The model file a cold stage loads its layers from.
    path: Option<PathBuf>,
    /// What a cold stage says of itself (no layers).
    cold: dpb::DescribeResponse,
    loaded: std::sync::OnceLock<Loaded>,
    /// One `Load` at a time.
    loading: tokio::sync::Mutex<()>,
    /// Told when the layers are loaded (the registration says so at once).
    installed: tokio::sync::Notify,
}

struct Loaded {
    model: Arc<StageModel>,
    fence: Arc<Fence>,
}

impl StageService {
    /// A hot stage serving `model`. `log`: the log's client, which fences every request by its
    /// head's composition in the log (`None`: by the newest epoch seen from each head only).
    /// Spawns the fence's refresher on the current runtime.
    pub fn new(model: Arc<StageModel>, stage_id: String, log: Option<LogClient>) -> Self {
        let svc = Self::with(model.describe(&stage_id), stage_id, log, None);
        svc.install(model);
        svc
    }

    fn with(cold: dpb::DescribeResponse, stage_id: String, log: Option<LogClient>, path: Option<PathBuf>) -> Self {
        StageService {
            shared: Arc::new(Shared {
                stage_id,
                log,
                path,
                cold,
                loaded: std::sync::OnceLock::new(),
                loading: tokio::sync::Mutex::new(()),
                installed: tokio::sync::Notify::new(),
            }),
        }
    }

    /// A cold stage of the model file at `path` (its header read now, its layers on `Load`).
    pub fn cold(path: &Path, stage_id: String, log: Option<LogClient>) -> Result<Self> {
        let f = LlamaFile::open(path)?;
        let shape = crate::llama::LlamaShape::from_gguf(&f.content)?;
        let cold = dpb::DescribeResponse {
            weights_sha256: f.identity.weights_sha256.clone(),
            first_layer: 0,
            end_layer: 0,
            total_layers: shape.n_layers as u32,
            hidden: shape.hidden as u32,
            vocab: f.tokenizer.vocab_size() as u32,
            max_positions: f.max_context as u32,
            stage_id: stage_id.clone(),
            numerics: crate::cpu::NUMERICS.into(),
        };
        Ok(Self::with(cold, stage_id, log, Some(path.to_path_buf())))
    }

    fn install(&self, model: Arc<StageModel>) {
        let fence = Fence::new(self.shared.log.clone(), self.shared.stage_id.clone(), model.layers());
        if self.shared.loaded.set(Loaded { model, fence }).is_ok() {
            self.shared.installed.notify_one();
        }
    }

    /// The layers it holds (`0..0`: a cold stage that has loaded none yet).
    fn held(&self) -> Range<usize> {
        self.shared.loaded.get().map_or(0..0, |l| l.model.layers())
    }

    fn describe_now(&self) -> dpb::DescribeResponse {
        match self.shared.loaded.get() {
            Some(l) => l.model.describe(&self.shared.stage_id),
            None => self.shared.cold.clone(),
        }
    }

    /// Loads `layers` (a cold stage; a hot one, or one loaded before, answers at once for the
    /// layers it holds and refuses others).
    pub async fn load(&self, layers: Range<usize>) -> std::result::Result<dpb::DescribeResponse, Status> {
        let _one = self.shared.loading.lock().await;
        if let Some(l) = self.shared.loaded.get() {
            return match l.model.layers() == layers {
                true => Ok(self.describe_now()),
                false => Err(Status::failed_precondition(format!(
                    "stage {} holds layers {:?}, not {layers:?}",
                    self.shared.stage_id,
                    l.model.layers()
                ))),
            };
        }
        let total = self.shared.cold.total_layers as usize;
        if layers.is_empty() || layers.end > total {
            return Err(Status::invalid_argument(format!(
                "layers {layers:?} are not a non-empty range of the model's {total}"
            )));
        }
        let path = self.shared.path.clone().expect("a stage without layers is cold");
        let t0 = std::time::Instant::now();
        let r = layers.clone();
        let model = tokio::task::spawn_blocking(move || StageModel::load(&path, r))
            .await
            .map_err(|e| Status::internal(format!("loading the layers failed: {e}")))?
            .map_err(|e| Status::internal(format!("loading layers {layers:?}: {e}")))?;
        tracing::info!(
            stage = %self.shared.stage_id,
            layers = ?layers,
            load_us = t0.elapsed().as_micros() as u64,
            "a cold stage loaded its layers"
        );
        self.install(Arc::new(model));
        Ok(self.describe_now())
    }

    /// Registers the stage in the log at `addr` until the process ends: now, every quarter of
    /// `STAGE_REGISTRATION_TTL`, and at once when its layers change (a cold stage that loaded).
    /// A renewal does not wait for the one before to be answered (at most
    /// `STAGE_RENEWALS_IN_FLIGHT` at once): a log slow to answer (a long fsync) delays each
    /// renewal by its latency once, not the next one's start as well, so the registration does
    /// not lapse under a write latency of ~3/4 of its life. A registration the log cannot take
    /// now is retried; the stage serves on meanwhile.
    pub async fn keep_registered(self, log: LogClient, addr: String) {
        let ttl = STAGE_REGISTRATION_TTL;
        let mut failing = false;
        let mut in_flight = tokio::task::JoinSet::new();
        loop {
            if in_flight.len() < STAGE_RENEWALS_IN_FLIGHT {
                let held = self.held();
                let reg = tokenlog_proto::raftlog::StageRegistration {
                    stage_id: self.shared.stage_id.clone(),
                    addr: addr.clone(),
                    weights_sha256: self.shared.cold.weights_sha256.clone(),
                    first_layer: held.start as u32,
                    end_layer: held.end as u32,
                    expiry_log_ms: 0,
                };
                let log = log.clone();
                in_flight.spawn(async move { log.register_stage(reg, ttl.as_millis() as u64).await });
            }
            tokio::select! {
                _ = tokio::time::sleep(ttl / 4) => {}
                _ = self.shared.installed.notified() => {}
            }
            while let Some(done) = in_flight.try_join_next() {
                match done {
                    Ok(Ok(_)) if failing => {
                        failing = false;
                        tracing::info!(stage = %self.shared.stage_id, "the stage is registered in the log again");
                    }
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        if !failing {
                            tracing::warn!(stage = %self.shared.stage_id, error = %e, "the log did not take the stage's registration (retrying)");
                        }
                        failing = true;
                    }
                    Err(e) => tracing::error!(stage = %self.shared.stage_id, error = %e, "a registration task failed"),
                }
            }
        }
    }

    pub fn server(self) -> dpb::stage_server::StageServer<StageService> {
        dpb::stage_server::StageServer::new(self)
            .max_decoding_message_size(STAGE_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(STAGE_MESSAGE_BYTES_MAX)
    }
}

/// One request of a head's stream, against that stream's sequences: the releases first, then
/// one batched pass over the items (on a blocking thread), answered in order.
fn serve_request(
    model: &StageModel,
    seqs: &mut HashMap<u64, StageSequence>,
    req: dpb::ForwardRequest,
) -> std::result::Result<dpb::ForwardResponse, Status> {
    for id in &req.release {
        seqs.remove(id);
    }
    if req.items.len() > STAGE_ITEMS_MAX {
        return Err(Status::invalid_argument(format!(
            "{} items in one request; at most {STAGE_ITEMS_MAX}",
            req.items.len()
        )));
    }
    // Each row a pass computes is a hidden state its answer carries on (a first stage's rows
    // are its tokens, up to a whole context per item): a request of more rows than one message
    // holds is refused before the pass, which would allocate its scratch for all of them (256
    // items of 4,096 tokens: tens of GB) and then could not send its answer. A head batches
    // rows up to half a message.
    let row_bytes = (model.hidden() * 4).max(1);
    let rows_max = STAGE_MESSAGE_BYTES_MAX / row_bytes;
    let rows: usize = req
        .items
        .iter()
        .map(|i| match model.is_first() {
            true => i.tokens.len(),
            false => i.hidden.len() / row_bytes,
        })
        .sum();
    if rows > rows_max {
        return Err(Status::invalid_argument(format!(
            "{rows} positions in one request; at most {rows_max} (their hidden states must fit one message of {STAGE_MESSAGE_BYTES_MAX} bytes)"
        )));
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = req.items.iter().find(|i| !seen.insert(i.sequence)) {
        return Err(Status::invalid_argument(format!(
            "sequence {} twice in one request",
            dup.sequence
        )));
    }
    // Per item: why it is refused before the pass, or its sequence (taken out of the map
    // while the pass runs) and its input.
    let mut refused: Vec<Option<String>> = Vec::with_capacity(req.items.len());
    let mut taken: Vec<(u64, StageSequence, Vec<f32>)> = Vec::new();
    for item in &req.items {
        #[cfg(feature = "faults")]
        if let Some(why) = planted_forget(seqs, item) {
            refused.push(Some(why));
            continue;
        }
        let mut seq = match item.start {
            0 => {
                // A sequence begins (or begins again): whatever the stage held of it goes.
                seqs.remove(&item.sequence);
                if seqs.len() + taken.len() >= STAGE_SEQUENCES_MAX {
                    refused.push(Some(format!(
                        "the stage holds {STAGE_SEQUENCES_MAX} sequences for this head, its most"
                    )));
                    continue;
                }
                model.new_sequence()
            }
            // A start behind what the stage holds rewinds it (a pass that failed at a later
            // stage is sent again: this stage had already fed it).
            start => match seqs.remove(&item.sequence) {
                Some(mut s) if s.len() >= start as usize => {
                    s.truncate(start as usize);
                    s
                }
                Some(s) => {
                    refused.push(Some(format!(
                        "the stage holds {} positions of sequence {}, fewer than {start}: feed it again from 0",
                        s.len(),
                        item.sequence
                    )));
                    continue;
                }
                None => {
                    refused.push(Some(format!(
                        "the stage holds no positions of sequence {} (a new stage, or it was dropped): feed it again from 0",
                        item.sequence
                    )));
                    continue;
                }
            },
        };
        let rows = match (model.is_first(), item.hidden.is_empty()) {
            (true, _) => Vec::new(),
            (false, _) => match f32s_from_bytes(&item.hidden) {
                Ok(r) => r,
                Err(e) => {
                    seq.reset();
                    refused.push(Some(e.to_string()));
                    continue;
                }
            },
        };
        refused.push(None);
        taken.push((item.sequence, seq, rows));
    }
    let outputs = {
        let mut items: Vec<(&mut StageSequence, StageInput)> = Vec::with_capacity(taken.len());
        let tokens: Vec<&[u32]> = req
            .items
            .iter()
            .zip(&refused)
            .filter(|(_, r)| r.is_none())
            .map(|(i, _)| i.tokens.as_slice())
            .collect();
        for ((_, seq, rows), tokens) in taken.iter_mut().zip(tokens) {
            let input = match model.is_first() {
                true => StageInput::Tokens(tokens),
                false => StageInput::Hidden(rows.as_slice()),
            };
            items.push((seq, input));
        }
        model.forward(&mut items)
    };
    let mut outputs = outputs.into_iter();
    let mut taken = taken.into_iter();
    let mut results = Vec::with_capacity(req.items.len());
    for (item, why) in req.items.iter().zip(refused) {
        let mut r = dpb::StageResult {
            sequence: item.sequence,
            ..Default::default()
        };
        match why {
            Some(why) => r.error = why,
            None => {
                let (id, seq, _) = taken.next().expect("one per fed item");
                match outputs.next().expect("one per fed item") {
                    Ok(StageOutput::Hidden(h)) => {
                        r.hidden = f32s_to_bytes(&h);
                        seqs.insert(id, seq);
                    }
                    Ok(StageOutput::Logits(l)) => {
                        r.logits = f32s_to_bytes(&l);
                        seqs.insert(id, seq);
                    }
                    // The sequence was reset: it is dropped here.
                    Err(e) => r.error = e.to_string(),
                }
            }
        }
        results.push(r);
    }
    Ok(dpb::ForwardResponse {
        results,
        pipeline_epoch: req.pipeline_epoch,
    })
}

/// The planted bug `stage-forgets` ([`plant_forget`]): 0 off, 1 once, 2 always.
#[cfg(feature = "faults")]
static PLANT_FORGET: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
/// The sequence it struck (`u64::MAX`: none yet).
#[cfg(feature = "faults")]
static FORGOTTEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);

/// Plants the bug `stage-forgets` (fault builds). `always == false`: the stage loses what it
/// holds of the first sequence it is asked to extend, once, and refuses that item as it
/// refuses any sequence it lacks. `always`: it refuses every item of that sequence from then
/// on, from 0 too.
#[cfg(feature = "faults")]
pub fn plant_forget(always: bool) {
    PLANT_FORGET.store(if always { 2 } else { 1 }, std::sync::atomic::Ordering::SeqCst);
}

/// What the plant `stage-forgets` does to one item: `Some(why)` refuses it.
#[cfg(feature = "faults")]
fn planted_forget(seqs: &mut HashMap<u64, StageSequence>, item: &dpb::StageItem) -> Option<String> {
    use std::sync::atomic::Ordering;
    let mode = PLANT_FORGET.load(Ordering::SeqCst);
    if mode == 0 {
        return None;
    }
    let struck = FORGOTTEN.load(Ordering::SeqCst);
    if struck == u64::MAX && item.start > 0 && seqs.contains_key(&item.sequence) {
        FORGOTTEN.store(item.sequence, Ordering::SeqCst);
        seqs.remove(&item.sequence);
        tracing::warn!(sequence = item.sequence, "PLANTED: the stage forgot the sequence");
        if mode == 1 {
            PLANT_FORGET.store(0, Ordering::SeqCst);
            return None;
        }
    }
    (mode == 2 && FORGOTTEN.load(Ordering::SeqCst) == item.sequence).then(|| {
        seqs.remove(&item.sequence);
        format!("PLANTED: the stage refuses sequence {}", item.sequence)
    })
}

/// The planted bug `short-stage-rows` ([`plant_short_rows`]).
#[cfg(feature = "faults")]
static PLANT_SHORT_ROWS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Plants the bug `short-stage-rows` (fault builds): this process's first answer that carries
/// an item of two or more rows drops that item's last row, as a buggy stage would.
#[cfg(feature = "faults")]
pub fn plant_short_rows() {
    PLANT_SHORT_ROWS.store(true, std::sync::atomic::Ordering::SeqCst);
}

#[cfg(feature = "faults")]
fn planted_short_rows(mut a: dpb::ForwardResponse, row_bytes: usize) -> dpb::ForwardResponse {
    use std::sync::atomic::Ordering;
    if PLANT_SHORT_ROWS.load(Ordering::SeqCst) {
        if let Some(r) = a.results.iter_mut().find(|r| r.hidden.len() >= 2 * row_bytes) {
            if PLANT_SHORT_ROWS.swap(false, Ordering::SeqCst) {
                r.hidden.truncate(r.hidden.len() - row_bytes);
                tracing::warn!(sequence = r.sequence, "PLANTED: the answer lacks the item's last row");
            }
        }
    }
    a
}

type ForwardStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = std::result::Result<dpb::ForwardResponse, Status>> + Send>>;

#[tonic::async_trait]
impl dpb::stage_server::Stage for StageService {
    async fn describe(
        &self,
        _req: Request<dpb::DescribeRequest>,
    ) -> std::result::Result<Response<dpb::DescribeResponse>, Status> {
        Ok(Response::new(self.describe_now()))
    }

    async fn load(
        &self,
        req: Request<dpb::LoadRequest>,
    ) -> std::result::Result<Response<dpb::DescribeResponse>, Status> {
        let r = req.into_inner();
        self.load(r.first_layer as usize..r.end_layer as usize)
            .await
            .map(Response::new)
    }

    type ForwardStream = ForwardStream;

    async fn forward(
        &self,
        req: Request<tonic::Streaming<dpb::ForwardRequest>>,
    ) -> std::result::Result<Response<ForwardStream>, Status> {
        let Some(loaded) = self.shared.loaded.get() else {
            return Err(Status::failed_precondition(format!(
                "stage {} is a cold spare and holds no layers yet: Load them first",
                self.shared.stage_id
            )));
        };
        // Under TLS, the certificate of the caller: it may speak for its own head only (a
        // decoder that stamped another head's name on its requests moved that head's fence).
        let who = tokenlog_raftlog::auth::caller(&req);
        let mut inbound = req.into_inner();
        let (out, out_rx) = tokio::sync::mpsc::channel(1);
        let model = loaded.model.clone();
        let fence = loaded.fence.clone();
        let stage_id = self.shared.stage_id.clone();
        tokio::spawn(async move {
            let mut seqs: HashMap<u64, StageSequence> = HashMap::new();
            // The stream's head (its first request's) and its interest in the head's record.
            let mut head: Option<(String, crate::stage_fence::StreamGuard)> = None;
            loop {
                let req = match inbound.message().await {
                    Ok(Some(r)) => r,
                    // The head ended its stream (or died): its sequences go with it.
                    Ok(None) => break,
                    Err(s) => {
                        tracing::debug!(status = %s, "a head's stream broke");
                        break;
                    }
                };
                if let Some((h, _)) = &head {
                    if *h != req.head {
                        let _ = out
                            .send(Err(Status::invalid_argument(format!(
                                "this stream belongs to head {h:?}, and a request names head {:?}",
                                req.head
                            ))))
                            .await;
                        break;
                    }
                }
                if let Err(status) = tokenlog_raftlog::auth::acts_as(who.as_ref(), &req.head) {
                    let _ = out.send(Err(status)).await;
                    break;
                }
                // Fenced before anything is touched: a refused request changes nothing, not
                // even its releases; the stream ends and its sequences go.
                if let Err(status) = fence.admit(&req.head, req.pipeline_epoch).await {
                    tracing::warn!(
                        stage = %stage_id,
                        head = %req.head,
                        pipeline_epoch = req.pipeline_epoch,
                        status = %status.message(),
                        "refused a head's request"
                    );
                    let _ = out.send(Err(status)).await;
                    break;
                }
                if head.is_none() {
                    head = Some((req.head.clone(), fence.stream_opened(&req.head)));
                }
                let m = model.clone();
                // A panic here is a bug: the binary's hook ends the process (a head then sees
                // its stream break).
                let mut held = std::mem::take(&mut seqs);
                let answer = tokio::task::spawn_blocking(move || {
                    let r = serve_request(&m, &mut held, req);
                    (r, held)
                })
                .await;
                let answer = match answer {
                    Ok((r, s)) => {
                        seqs = s;
                        r
                    }
                    Err(e) => Err(Status::internal(format!("the stage's pass failed: {e}"))),
                };
                #[cfg(feature = "faults")]
                let answer = answer.map(|a| planted_short_rows(a, model.hidden() * 4));
                let failed = answer.is_err();
                if out.send(answer).await.is_err() || failed {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(
            out_rx,
        ))))
    }
}

#[cfg(test)]
mod tests {
    use super::parse_layers;

    #[test]
    fn layer_ranges_parse_and_bad_ones_say_why() {
        assert_eq!(parse_layers("0..10"), Ok(0..10));
        assert_eq!(parse_layers(" 10 .. 30 "), Ok(10..30));
        for bad in ["10", "3..3", "5..2", "a..4", "0..", "..4"] {
            let e = parse_layers(bad).unwrap_err();
            assert!(e.contains(bad.trim()) || e.contains("empty"), "{bad}: {e}");
        }
    }
}
