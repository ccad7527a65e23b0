//! A pipeline head's model (issue 16): a [`Model`] whose layers run in stage processes
//! ([`crate::stage`], `tokenlog stage`). The head holds no weights, only the model file's
//! header (tokenizer, identity); each pass sends the token ids to the first stage, each stage's
//! rows to the next, and takes the logits from the last. The lease worker drives it like any
//! model: a pipeline head is a decoder (`tokenlog decoder --pipeline ...`) that leases, samples
//! and appends through fenced writes; nothing in the log tells it from a whole decoder, and
//! since a split model computes the same bits as the whole one, either continues the other's
//! generation exactly.
//!
//! A stage that cannot be reached, answers late, breaks its stream or whose registration in the
//! log lapsed (a watcher reads them every `STAGE_LEASE_POLL`) fails the pass. The head then
//! splices a spare of the dead stage's layer range in its place: one given to it
//! (`--pipeline-spares`: stage processes with their layers loaded, idle), else one registered
//! in the log that no composition names (hot ones of those layers first, then cold ones, which
//! it asks to `Load` the range first), and rebuilds only that stage's layers: the head relays every row between stages, so it keeps what each stage was
//! fed (within `PIPELINE_KEPT_BYTES_MAX`) and feeds the spare that, all positions of a sequence
//! in one prefill, which gives the same bits as the steps did (grouping invariance; the spare's
//! output is checked against what the old stage gave). A sequence not kept is fed again in full
//! from its history. Then the pass goes on: the generations never leave the head, no lease
//! changes hands. Without a spare the head's step fails as a whole decoder's failed model step
//! does (the process ends, its leases end, another decoder takes the generation over).
//!
//! The composition is a record in the log (`SetPipeline`, keyed by the head's decoder id):
//! the head writes it when it connects and again at every splice, each time against the epoch
//! it last wrote, and every write gives a new pipeline epoch. Every request to a stage is
//! stamped with the head and that epoch; a stage serves it only if the log's record is at that
//! epoch and names the stage ([`crate::stage_fence`]), and the head takes answers of its
//! current epoch only. A stage spliced out (paused, cut off, slow) is refused by epoch when it
//! comes back; a splice whose write the log refuses (another incarnation of the head wrote
//! since) or cannot take fails the pass.
//!
//! The stages' streams live on one I/O thread of their own (a small runtime), so the model's
//! calls, which the worker makes on blocking threads, stay synchronous.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokenlog_proto::decoder as dpb;
use tokenlog_proto::raftlog as lpb;
use tokenlog_raftlog::client::{ClientError, LogClient};
use tonic::transport::Channel;

use crate::cache::f32s_from_bytes;
use crate::error::{Error, Result};
use crate::gguf_model::LlamaFile;
use crate::identity::ModelIdentity;
use crate::limits::{
    PIPELINE_KEPT_BYTES_MAX, STAGE_ANSWER_TIMEOUT, STAGE_ITEMS_MAX, STAGE_LEASE_POLL, STAGE_LOAD_TIMEOUT,
    STAGE_MESSAGE_BYTES_MAX, STAGE_SPARE_WAIT, STAGE_SPARE_WAIT_MAX,
};
use crate::model::{check_feed, Logits, Model, Sequence};
use crate::tokenizer::Tokenizer;

/// Makes the channel to a stage at an address (plain or mutual TLS, as the head reaches the
/// log).
pub type ChannelFor = Box<dyn Fn(&str) -> std::result::Result<Channel, String> + Send>;

/// One stage as the head found it.
#[derive(Clone, Debug)]
pub struct StageInfo {
    pub addr: String,
    pub stage_id: String,
    pub layers: std::ops::Range<usize>,
}

/// One item of a pass: a sequence, its first position, its tokens, and what it was fed before
/// (fed again when a splice could not rebuild it).
struct JobItem {
    id: u64,
    start: u32,
    tokens: Vec<u32>,
    history: Vec<u32>,
}

/// Per item its logits or why not.
type PassResult = std::result::Result<Vec<std::result::Result<Logits, String>>, String>;

/// One pass: its items and the sequences to free first.
struct Job {
    items: Vec<JobItem>,
    release: Vec<u64>,
    reply: std::sync::mpsc::SyncSender<PassResult>,
}

struct Inner {
    jobs: tokio::sync::mpsc::UnboundedSender<Job>,
    released: Mutex<Vec<u64>>,
    next_id: AtomicU64,
}

impl Inner {
    fn pass(&self, items: Vec<JobItem>) -> PassResult {
        let release = std::mem::take(&mut *self.released.lock().expect("lock"));
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        self.jobs
            .send(Job { items, release, reply })
            .map_err(|_| "the pipeline's stage connections are gone".to_string())?;
        answer
            .recv()
            .map_err(|_| "the pipeline's stage connections are gone".to_string())?
    }
}

/// A model whose layers run in a pipeline of stage processes.
pub struct PipelineModel {
    inner: Arc<Inner>,
    tokenizer: Tokenizer,
    identity: ModelIdentity,
    max_context: usize,
    vocab: usize,
    stages: Vec<StageInfo>,
    epoch: u64,
}

/// One stage's open stream.
struct Conn {
    info: StageInfo,
    tx: tokio::sync::mpsc::Sender<dpb::ForwardRequest>,
    rx: tonic::Streaming<dpb::ForwardResponse>,
    /// Why the stream is unusable (it broke, answered out of turn, or its registration in the
    /// log lapsed).
    broken: Option<String>,
    /// The bytes of one row the stage gives (its model's hidden size, in f32s).
    row_bytes: usize,
    /// The stages' registrations in the log, as the head's watcher reads them (`None`: no log).
    registry: Option<Registry>,
    /// The log time of a leader's view that listed this stage registered when the head chose
    /// it (0: none): only a later view can say that its registration lapsed. (A stage restarted
    /// under its old id and spliced back in was not dead to the watcher's read of a moment
    /// before, which still had the old incarnation's lapsed registration.)
    live_at_log_ms: u64,
}

/// What the head's watcher last read of the stages' registrations in the log.
#[derive(Debug, Default)]
struct Registered {
    /// The stage ids registered now.
    live: HashSet<String>,
    /// Every stage id seen registered since the head started: a stage that never registered
    /// (one without `--cluster`) is not watched.
    ever: HashSet<String>,
    /// The log time of the view read.
    log_ms: u64,
}

type Registry = tokio::sync::watch::Receiver<Arc<Registered>>;

impl Registered {
    /// Why stage `id` is dead to the log: it was registered and its registration lapsed, in a
    /// view later than `live_at_log_ms` (when a leader's view listed it registered).
    fn lapsed(&self, id: &str, live_at_log_ms: u64) -> bool {
        self.log_ms > live_at_log_ms && self.ever.contains(id) && !self.live.contains(id)
    }
}

/// Reads the stages' registrations every `STAGE_LEASE_POLL` (any node's view: a stale one
/// only delays a splice, which the pipeline epoch fences anyway) until the head's model is
/// gone.
async fn watch_registrations(log: LogClient, tx: tokio::sync::watch::Sender<Arc<Registered>>) {
    let mut ever = HashSet::new();
    while !tx.is_closed() {
        if let Ok(r) = log.list_stages(false).await {
            let live: HashSet<String> = r
                .stages
                .into_iter()
                .filter(|s| s.expiry_log_ms > r.log_ms)
                .map(|s| s.stage_id)
                .collect();
            ever.extend(live.iter().cloned());
            tx.send_replace(Arc::new(Registered {
                live,
                ever: ever.clone(),
                log_ms: r.log_ms,
            }));
        }
        tokio::time::sleep(STAGE_LEASE_POLL).await;
    }
}

/// How a head connects to its stages ([`PipelineModel::connect`]).
pub struct PipelineConfig {
    /// The stages' addresses, in pipeline order.
    pub stages: Vec<String>,
    /// Hot spare stages, tried in order when a stage of their layer range fails (one that does
    /// not answer now is skipped and stays a spare).
    pub spares: Vec<String>,
    pub channel_for: ChannelFor,
    /// The head's decoder id, which every request to a stage names.
    pub head: String,
    /// Where the head writes its composition (`None`: nowhere; the epoch starts at 1 and grows
    /// at every splice, and only stages without a log accept it).
    pub log: Option<LogClient>,
    /// What the head keeps of its sequences' passes, in all (0: nothing, and a splice feeds
    /// every sequence through the whole pipeline again). At most `PIPELINE_KEPT_BYTES_MAX`.
    pub keep_bytes: usize,
}

impl PipelineConfig {
    /// Stages and spares at these addresses, under `channel_for`, for head `head`: no log, the
    /// most kept.
    pub fn new(stages: &[String], spares: &[String], channel_for: ChannelFor, head: &str) -> Self {
        PipelineConfig {
            stages: stages.to_vec(),
            spares: spares.to_vec(),
            channel_for,
            head: head.to_string(),
            log: None,
            keep_bytes: PIPELINE_KEPT_BYTES_MAX,
        }
    }
}

impl PipelineModel {
    /// Reads the model file's header at `path` (a llama GGUF file: the tokenizer and the identity
    /// generations are bound to), asks each stage of `cfg` (in pipeline order) what it holds,
    /// checks that they run the file's weights and cover its layers in order, each layer once,
    /// opens a stream to each, and records the composition in the log.
    pub fn connect(path: &std::path::Path, cfg: PipelineConfig) -> Result<Self> {
        let PipelineConfig {
            stages: addrs,
            spares,
            channel_for,
            head,
            log,
            keep_bytes,
        } = cfg;
        if addrs.is_empty() {
            return Err(Error::Invalid("a pipeline needs at least one stage".into()));
        }
        let LlamaFile {
            tokenizer,
            identity,
            max_context,
            ..
        } = LlamaFile::open(path)?;
        // The stages run the CPU engine: its generations are bound to its numerics.
        let identity = crate::cpu::identity_of(identity);
        let vocab = tokenizer.vocab_size();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let (jobs, job_rx) = tokio::sync::mpsc::unbounded_channel();
        let want = identity.weights_sha256.clone();
        let keep_bytes = keep_bytes.min(PIPELINE_KEPT_BYTES_MAX);
        std::thread::Builder::new()
            .name("pipeline-io".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("starting the pipeline's I/O runtime: {e}")));
                        return;
                    }
                };
                rt.block_on(async move {
                    // The watcher ends when the pipe (every receiver) is gone.
                    let registry = log.as_ref().map(|log| {
                        let (tx, rx) = tokio::sync::watch::channel(Arc::new(Registered::default()));
                        tokio::spawn(watch_registrations(log.clone(), tx));
                        rx
                    });
                    let conns = match open_stages(&addrs, &channel_for, &want, vocab, &registry).await {
                        Ok(c) => c,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let max = conns.iter().map(|c| c.1).min().unwrap_or(0);
                    let conns: Vec<Conn> = conns.into_iter().map(|c| c.0).collect();
                    let mut pipe = Pipe {
                        conns,
                        spares,
                        channel_for,
                        weights_sha256: want,
                        vocab,
                        live: HashSet::new(),
                        kept: HashMap::new(),
                        kept_bytes: 0,
                        keep_bytes,
                        stale: HashSet::new(),
                        head,
                        log,
                        epoch: 0,
                        registry,
                    };
                    // The composition's first record: against what the log holds for this head
                    // (an earlier incarnation's, when the decoder id is given again).
                    let first = async {
                        if let Some(log) = &pipe.log {
                            pipe.epoch = match log.get_pipeline(&pipe.head, true).await {
                                Ok(p) => p.epoch,
                                Err(ClientError::Status(s)) if s.code() == tonic::Code::NotFound => 0,
                                Err(e) => return Err(format!("reading the head's pipeline in the log: {e}")),
                            };
                        }
                        let stages: Vec<StageInfo> = pipe.conns.iter().map(|c| c.info.clone()).collect();
                        pipe.compose(&stages).await
                    };
                    if let Err(e) = first.await {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                    let infos = pipe.conns.iter().map(|c| c.info.clone()).collect::<Vec<_>>();
                    let _ = ready_tx.send(Ok((infos, max, pipe.epoch)));
                    serve_jobs(&mut pipe, job_rx).await;
                });
            })
            .map_err(|e| Error::Pipeline(format!("starting the pipeline's I/O thread: {e}")))?;
        let (stages, stage_max, epoch) = ready_rx
            .recv()
            .map_err(|_| Error::Pipeline("the pipeline's I/O thread ended".into()))?
            .map_err(Error::Pipeline)?;
        Ok(PipelineModel {
            inner: Arc::new(Inner {
                jobs,
                released: Mutex::new(Vec::new()),
                next_id: AtomicU64::new(1),
            }),
            tokenizer,
            identity,
            max_context: max_context.min(stage_max),
            vocab,
            stages,
            epoch,
        })
    }

    /// The stages, in pipeline order, as connected.
    pub fn stages(&self) -> &[StageInfo] {
        &self.stages
    }

    /// The pipeline epoch of the composition connected (splices move it on).
    pub fn first_epoch(&self) -> u64 {
        self.epoch
    }
}

/// Describes the stage at `addr`, checks it runs `weights_sha256` with `vocab` entries, and
/// opens its stream; the stream, its description.
async fn open_stage(
    addr: &str,
    channel_for: &ChannelFor,
    weights_sha256: &str,
    vocab: usize,
    registry: Option<Registry>,
) -> std::result::Result<(Conn, dpb::DescribeResponse), String> {
    let mut c = stage_client(addr, channel_for)?;
    let d = tokio::time::timeout(Duration::from_secs(10), c.describe(dpb::DescribeRequest {}))
        .await
        .map_err(|_| format!("stage {addr} did not answer Describe within 10 s"))?
        .map_err(|s| format!("stage {addr}: {}", s.message()))?
        .into_inner();
    check_description(addr, &d, weights_sha256, vocab)?;
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let rx = c
        .forward(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .map_err(|s| format!("stage {addr}: opening its stream: {}", s.message()))?
        .into_inner();
    let conn = Conn {
        info: StageInfo {
            addr: addr.to_string(),
            stage_id: d.stage_id.clone(),
            layers: d.first_layer as usize..d.end_layer as usize,
        },
        tx,
        rx,
        broken: None,
        row_bytes: d.hidden as usize * 4,
        registry,
        live_at_log_ms: 0,
    };
    Ok((conn, d))
}

/// Whether the stage at `addr`, as its Describe answer `d` says, can serve a head whose model
/// file is `weights_sha256` with `vocab` entries: the same weights, the same vocabulary, the
/// same CPU-engine numerics (a stage of another release computes other bits).
fn check_description(
    addr: &str,
    d: &dpb::DescribeResponse,
    weights_sha256: &str,
    vocab: usize,
) -> std::result::Result<(), String> {
    if d.weights_sha256 != weights_sha256 {
        return Err(format!(
            "stage {addr} runs weights {} and this head's model file is {weights_sha256}",
            d.weights_sha256
        ));
    }
    if d.vocab as usize != vocab {
        return Err(format!(
            "stage {addr} has a vocabulary of {} and the model file's tokenizer {vocab}",
            d.vocab
        ));
    }
    if d.numerics != crate::cpu::NUMERICS {
        return Err(format!(
            "stage {addr} computes the CPU engine's numerics {:?} and this head's are {:?} \
             (another release: run the head and its stages from one)",
            d.numerics,
            crate::cpu::NUMERICS
        ));
    }
    Ok(())
}

fn stage_client(
    addr: &str,
    channel_for: &ChannelFor,
) -> std::result::Result<dpb::stage_client::StageClient<Channel>, String> {
    let channel = channel_for(addr).map_err(|e| format!("stage {addr}: {e}"))?;
    Ok(dpb::stage_client::StageClient::new(channel)
        .max_decoding_message_size(STAGE_MESSAGE_BYTES_MAX)
        .max_encoding_message_size(STAGE_MESSAGE_BYTES_MAX))
}

/// Asks the cold spare at `addr` to load `layers`; how long it took.
async fn load_cold(
    addr: &str,
    channel_for: &ChannelFor,
    layers: &std::ops::Range<usize>,
) -> std::result::Result<Duration, String> {
    let mut c = stage_client(addr, channel_for)?;
    let t0 = Instant::now();
    let req = dpb::LoadRequest {
        first_layer: layers.start as u32,
        end_layer: layers.end as u32,
    };
    tokio::time::timeout(STAGE_LOAD_TIMEOUT, c.load(req))
        .await
        .map_err(|_| format!("the cold spare {addr} did not load layers {layers:?} within {STAGE_LOAD_TIMEOUT:?}"))?
        .map_err(|s| format!("the cold spare {addr}: {}", s.message()))?;
    Ok(t0.elapsed())
}

/// Describes every stage, checks the pipeline and opens the streams; each stage's stream and
/// its most positions.
async fn open_stages(
    addrs: &[String],
    channel_for: &ChannelFor,
    weights_sha256: &str,
    vocab: usize,
    registry: &Option<Registry>,
) -> std::result::Result<Vec<(Conn, usize)>, String> {
    let mut out = Vec::with_capacity(addrs.len());
    let mut next_layer = 0u32;
    let mut shape = None;
    for (i, addr) in addrs.iter().enumerate() {
        let (conn, d) = open_stage(addr, channel_for, weights_sha256, vocab, registry.clone()).await?;
        if d.first_layer != next_layer {
            return Err(format!(
                "stage {} ({addr}) holds layers {}..{}, and the pipeline needs layer {next_layer} next",
                i + 1,
                d.first_layer,
                d.end_layer
            ));
        }
        if *shape.get_or_insert((d.total_layers, d.hidden)) != (d.total_layers, d.hidden) {
            return Err(format!("stage {addr} describes another model's shape"));
        }
        next_layer = d.end_layer;
        out.push((conn, d.max_positions as usize));
    }
    let total = shape.map_or(0, |s| s.0);
    if next_layer != total {
        return Err(format!(
            "the stages cover layers 0..{next_layer} of {total}: the last stage must end the model"
        ));
    }
    Ok(out)
}

/// What the head kept of one sequence's passes: its tokens, and the rows every stage after the
/// first was fed, for all its positions (a spare spliced in for one stage rebuilds that stage's
/// layers from them alone).
struct Kept {
    tokens: Vec<u32>,
    /// Per stage `1..n`: the rows it was fed, as on the wire.
    inputs: Vec<Vec<u8>>,
}

impl Kept {
    fn bytes(&self) -> usize {
        self.tokens.len() * 4 + self.inputs.iter().map(Vec::len).sum::<usize>()
    }
}

/// The I/O thread's pipeline: the stages' streams, the spares not used yet, and what it kept
/// of every sequence to rebuild a spliced stage.
struct Pipe {
    conns: Vec<Conn>,
    spares: Vec<String>,
    channel_for: ChannelFor,
    weights_sha256: String,
    vocab: usize,
    /// Sequences the stages hold (seen at position 0, not released).
    live: HashSet<u64>,
    /// Sequences whose every position is kept (`keep_bytes` in all).
    kept: HashMap<u64, Kept>,
    kept_bytes: usize,
    keep_bytes: usize,
    /// Sequences a splice could not rebuild: fed again in full from their history at their
    /// next pass.
    stale: HashSet<u64>,
    /// The head's decoder id, which every request names.
    head: String,
    /// Where the composition is recorded (`None`: nowhere).
    log: Option<LogClient>,
    /// The current composition's pipeline epoch, which every request carries.
    epoch: u64,
    /// The stages' registrations in the log (`None`: no log).
    registry: Option<Registry>,
}

/// A spare a splice may use: where it is, and whether it must load the layers first.
struct Spare {
    addr: String,
    cold: bool,
    /// Where it was found: given to the head, or registered in the log.
    from_log: bool,
    /// The log time of the leader's view that listed it registered (0: given to the head).
    live_at_log_ms: u64,
}

/// Whether `found`, the head's record read again after SetPipeline `req` failed, is that write's
/// own, applied by an earlier try whose answer was lost: this very composition, at an epoch past
/// the one the write expected. Only this head writes its record, and the log's epochs come from
/// one counter shared by every head: another head composing in between moves it by more than
/// one.
fn written_by_an_earlier_try(req: &lpb::SetPipelineRequest, found: &lpb::PipelineInfo) -> bool {
    found.epoch > req.expect_epoch && found.stages == req.stages
}

impl Pipe {
    /// Records `stages` as the head's composition, against the epoch it last wrote; the new
    /// epoch becomes the current one.
    async fn compose(&mut self, stages: &[StageInfo]) -> std::result::Result<(), String> {
        let Some(log) = &self.log else {
            self.epoch += 1;
            return Ok(());
        };
        let req = lpb::SetPipelineRequest {
            head: self.head.clone(),
            expect_epoch: self.epoch,
            stages: stages
                .iter()
                .map(|s| lpb::PipelineStage {
                    stage_id: s.stage_id.clone(),
                    addr: s.addr.clone(),
                    first_layer: s.layers.start as u32,
                    end_layer: s.layers.end as u32,
                })
                .collect(),
        };
        let p = match log.set_pipeline(req.clone()).await {
            Ok(r) => r.pipeline.ok_or("the log answered SetPipeline without the record")?,
            // A retried write whose first try committed (its answer lost) is refused, its epoch
            // moved on: the record is read again, and if it is this very composition at a
            // later epoch it is ours (the proto's PIPELINE_CONFLICT rule).
            Err(e) => match log.get_pipeline(&self.head, true).await {
                Ok(p) if written_by_an_earlier_try(&req, &p) => {
                    tracing::info!(head = %self.head, epoch = p.epoch, error = %e, "the composition was recorded by an earlier try of the same write");
                    p
                }
                _ => return Err(format!("recording the pipeline's composition in the log: {e}")),
            },
        };
        tracing::info!(
            head = %self.head,
            from = self.epoch,
            epoch = p.epoch,
            stages = ?stages.iter().map(|s| s.stage_id.as_str()).collect::<Vec<_>>(),
            "the pipeline's composition is recorded in the log"
        );
        self.epoch = p.epoch;
        Ok(())
    }

    /// Replaces every broken stage with a spare of its layer range and rebuilds that stage's
    /// layers of every kept sequence; whether it replaced at least one and every broken one.
    /// `resumes_at`: the positions the failed pass would have fed up to (logged: the token it
    /// gives is the first one a bench can wait for).
    async fn splice(&mut self, resumes_at: usize) -> bool {
        let mut replaced = 0;
        for k in 0..self.conns.len() {
            let t0 = Instant::now();
            // When the failure was noticed, on the wall clock (a bench that killed the stage
            // splits its time by it).
            let noticed = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64);
            let Some(why) = self.conns[k].broken.clone() else {
                continue;
            };
            let layers = self.conns[k].info.layers.clone();
            let (found, rounds) = self.find_spare(&layers).await;
            let Some((spare, conn, load_us)) = found else {
                tracing::error!(
                    failed = %self.conns[k].info.addr,
                    why,
                    layers = ?layers,
                    waited_ms = rounds.saturating_sub(1) * STAGE_LEASE_POLL.as_millis() as u64,
                    "a pipeline stage failed and no spare of its layers answers"
                );
                return false;
            };
            // One fenced write: from its answer on, the failed stage is refused.
            let mut stages: Vec<StageInfo> = self.conns.iter().map(|c| c.info.clone()).collect();
            stages[k] = conn.info.clone();
            let from = self.epoch;
            if let Err(e) = self.compose(&stages).await {
                tracing::error!(spare = %spare.addr, error = e, "the log did not take the splice: the pass fails");
                return false;
            }
            tracing::warn!(
                failed = %self.conns[k].info.addr,
                why,
                spare = %spare.addr,
                spare_id = %conn.info.stage_id,
                cold = spare.cold,
                from_log = spare.from_log,
                layers = ?layers,
                from_epoch = from,
                pipeline_epoch = self.epoch,
                ms = t0.elapsed().as_millis() as u64,
                "a pipeline stage failed: spliced a spare in its place"
            );
            self.conns[k] = conn;
            // The one spliced in is a spare no more; the others stay.
            self.spares.retain(|a| *a != spare.addr);
            let t1 = Instant::now();
            let (rebuilt, positions) = self.rebuild(k).await;
            tracing::warn!(
                layers = ?layers,
                sequences = rebuilt,
                positions,
                in_full = self.stale.len(),
                noticed_unix_us = noticed,
                resumes_at,
                load_us,
                splice_us = (t1 - t0).as_micros() as u64,
                rebuild_us = t1.elapsed().as_micros() as u64,
                "the spare rebuilt its layers from the rows kept; the rest is fed again in full"
            );
            replaced += 1;
        }
        replaced > 0
    }

    /// The first spare of `layers` that answers ([`Pipe::spares_for`], in order), with its
    /// stream and how long a cold one took to load (µs). With a log, a spare may register
    /// meanwhile (a supervisor restarting the dead stage, a spare starting): the head looks
    /// again every `STAGE_LEASE_POLL` until `STAGE_SPARE_WAIT` is over. Also the rounds tried.
    async fn find_spare(&self, layers: &std::ops::Range<usize>) -> (Option<(Spare, Conn, u64)>, u64) {
        let wait = if self.log.is_some() {
            STAGE_SPARE_WAIT
        } else {
            Duration::ZERO
        };
        let began = Instant::now();
        let mut until = began + wait;
        let mut rounds = 0;
        loop {
            rounds += 1;
            let round = Instant::now();
            let (spares, answered) = self.spares_for(layers).await;
            for spare in spares {
                if let Some((conn, load_us)) = self.ready_spare(&spare, layers, rounds == 1).await {
                    return (Some((spare, conn, load_us)), rounds);
                }
            }
            // A log that could not say which spares are registered is not an answer that none
            // are: that round's time does not count, up to `STAGE_SPARE_WAIT_MAX` in all.
            if !answered {
                until = (until + round.elapsed() + STAGE_LEASE_POLL).min(began + STAGE_SPARE_WAIT_MAX);
            }
            if Instant::now() >= until {
                return (None, rounds);
            }
            tokio::time::sleep(STAGE_LEASE_POLL).await;
        }
    }

    /// Opens `spare` for `layers` (a cold one loads them first): its stream and the load time
    /// (µs), or `None` if it cannot be used now (why is logged when `say`). A spare of other
    /// layers stays a spare.
    async fn ready_spare(&self, spare: &Spare, layers: &std::ops::Range<usize>, say: bool) -> Option<(Conn, u64)> {
        let mut load_us = 0;
        if spare.cold {
            match load_cold(&spare.addr, &self.channel_for, layers).await {
                Ok(d) => load_us = d.as_micros() as u64,
                Err(e) => {
                    if say {
                        tracing::warn!(spare = %spare.addr, error = e, "a cold spare cannot be used now");
                    }
                    return None;
                }
            }
        }
        match open_stage(
            &spare.addr,
            &self.channel_for,
            &self.weights_sha256,
            self.vocab,
            self.registry.clone(),
        )
        .await
        {
            Ok((mut conn, _)) if conn.info.layers == *layers => {
                conn.live_at_log_ms = spare.live_at_log_ms;
                Some((conn, load_us))
            }
            Ok(_) => None,
            Err(e) => {
                if say {
                    tracing::warn!(spare = %spare.addr, error = e, "a spare stage cannot be used now");
                }
                None
            }
        }
    }

    /// The spares a splice of `layers` tries, in order: those given to the head (each checked
    /// when it is opened), then the stages registered in the log for the same weights that no
    /// composition names: hot ones of exactly these layers first, then cold ones (which load
    /// them first).
    /// Also whether the log answered (without one, only those given to the head).
    async fn spares_for(&self, layers: &std::ops::Range<usize>) -> (Vec<Spare>, bool) {
        let mut out: Vec<Spare> = self
            .spares
            .iter()
            .map(|a| Spare {
                addr: a.clone(),
                cold: false,
                from_log: false,
                live_at_log_ms: 0,
            })
            .collect();
        let Some(log) = &self.log else {
            return (out, true);
        };
        // Through the leader: a spare that lapsed a moment ago is not tried.
        let r = match log.list_stages(true).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "the log cannot list the registered spares now");
                return (out, false);
            }
        };
        // The stages that serve this pipeline now. Not a broken one's id: a stage restarted
        // under it (a supervisor's restart) registers anew and is a spare like any other. It
        // was never chosen, and the head failed with no spare while it was there.
        let mine: HashSet<&str> = self
            .conns
            .iter()
            .filter(|c| c.broken.is_none())
            .map(|c| c.info.stage_id.as_str())
            .collect();
        let others: HashSet<&str> = r
            .pipelines
            .iter()
            .filter(|p| p.head != self.head)
            .flat_map(|p| p.stages.iter().map(|s| s.stage_id.as_str()))
            .collect();
        let mut found: Vec<(u8, &str, Spare)> = r
            .stages
            .iter()
            .filter(|s| {
                s.expiry_log_ms > r.log_ms
                    && s.weights_sha256 == self.weights_sha256
                    && !mine.contains(s.stage_id.as_str())
                    && !self.spares.contains(&s.addr)
            })
            .filter_map(|s| {
                let cold = s.first_layer == s.end_layer;
                let fits = (s.first_layer as usize, s.end_layer as usize) == (layers.start, layers.end);
                let shared = others.contains(s.stage_id.as_str());
                // Hot and idle first; then cold; last a stage of these layers that another
                // head's composition names (a stage serves several heads, each fenced by its
                // own epoch; the composition may be a dead head's that has not lapsed yet).
                let class = match (cold, fits, shared) {
                    (false, true, false) => 0,
                    (true, _, false) => 1,
                    (false, true, true) => 2,
                    _ => return None,
                };
                Some((
                    class,
                    s.stage_id.as_str(),
                    Spare {
                        addr: s.addr.clone(),
                        cold,
                        from_log: true,
                        live_at_log_ms: r.log_ms,
                    },
                ))
            })
            .collect();
        // Then by name: every head tries them in the same order.
        found.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        out.extend(found.into_iter().map(|(_, _, spare)| spare));
        (out, true)
    }

    /// Feeds the new stage `k` what its predecessor fed the old one, for every kept sequence
    /// (in requests of bounded size), and checks that it gives what the old one gave; every
    /// live sequence it could not rebuild so is marked stale. The sequences and positions
    /// rebuilt.
    async fn rebuild(&mut self, k: usize) -> (usize, usize) {
        let last = self.conns.len() - 1;
        // Requests of at most STAGE_ITEMS_MAX sequences and about half the message bound.
        let mut batches: Vec<Vec<u64>> = vec![Vec::new()];
        let mut bytes = 0;
        for (id, kept) in &self.kept {
            let size = kept.bytes();
            let b = batches.last_mut().expect("one");
            if !b.is_empty() && (b.len() >= STAGE_ITEMS_MAX || bytes + size > STAGE_MESSAGE_BYTES_MAX / 2) {
                batches.push(Vec::new());
                bytes = 0;
            }
            batches.last_mut().expect("one").push(*id);
            bytes += size;
        }
        let mut ok: HashSet<u64> = HashSet::new();
        let mut positions = 0;
        for batch in batches.into_iter().filter(|b| !b.is_empty()) {
            let req = dpb::ForwardRequest {
                items: batch
                    .iter()
                    .map(|id| {
                        let kept = &self.kept[id];
                        dpb::StageItem {
                            sequence: *id,
                            start: 0,
                            tokens: if k == 0 { kept.tokens.clone() } else { Vec::new() },
                            hidden: if k == 0 { Vec::new() } else { kept.inputs[k - 1].clone() },
                        }
                    })
                    .collect(),
                release: Vec::new(),
                head: self.head.clone(),
                pipeline_epoch: self.epoch,
            };
            // The spare failing too leaves it broken: the next pass splices again.
            let Ok(answer) = ask(&mut self.conns[k], req).await else {
                break;
            };
            for r in answer.results {
                let kept = &self.kept[&r.sequence];
                // The same bits as the old stage gave: the next stage's kept input.
                if r.error.is_empty() && (k == last || r.hidden == kept.inputs[k]) {
                    positions += kept.tokens.len();
                    ok.insert(r.sequence);
                } else {
                    tracing::error!(
                        sequence = r.sequence,
                        error = r.error,
                        "a rebuilt stage did not give the rows the old one gave: feeding the sequence again in full"
                    );
                }
            }
        }
        for id in &self.live {
            if !ok.contains(id) {
                self.stale.insert(*id);
            }
        }
        (ok.len(), positions)
    }

    /// What a pass fed each item, kept for a later rebuild (within the bound); the failed
    /// ones and the released ones forgotten.
    fn keep(&mut self, items: &[(u64, u32, Vec<u32>)], fed: &[(bool, Vec<Vec<u8>>)], release: &[u64]) {
        for id in release {
            self.live.remove(id);
            self.stale.remove(id);
            if let Some(k) = self.kept.remove(id) {
                self.kept_bytes -= k.bytes();
            }
        }
        let inputs = self.conns.len() - 1;
        for ((id, start, tokens), (ok, rows)) in items.iter().zip(fed) {
            if *start == 0 {
                if let Some(k) = self.kept.remove(id) {
                    self.kept_bytes -= k.bytes();
                }
                self.live.insert(*id);
                self.stale.remove(id);
                self.kept.insert(
                    *id,
                    Kept {
                        tokens: Vec::new(),
                        inputs: vec![Vec::new(); inputs],
                    },
                );
            }
            if !ok {
                // The head resets it: its next feed starts at 0.
                if let Some(k) = self.kept.remove(id) {
                    self.kept_bytes -= k.bytes();
                }
                continue;
            }
            let add = tokens.len() * 4 + rows.iter().map(Vec::len).sum::<usize>();
            if self.kept_bytes + add <= self.keep_bytes {
                if let Some(k) = self.kept.get_mut(id) {
                    k.tokens.extend_from_slice(tokens);
                    for (kept, r) in k.inputs.iter_mut().zip(rows) {
                        kept.extend_from_slice(r);
                    }
                    self.kept_bytes += add;
                }
            } else if let Some(k) = self.kept.remove(id) {
                // Over the bound: not kept any more (a splice feeds it again in full).
                self.kept_bytes -= k.bytes();
            }
        }
    }
}

async fn serve_jobs(pipe: &mut Pipe, mut jobs: tokio::sync::mpsc::UnboundedReceiver<Job>) {
    while let Some(job) = jobs.recv().await {
        let r = serve_job(pipe, &job).await;
        let _ = job.reply.send(r);
    }
}

/// One job's pass, in groups of items that each fit one stage request and its answer
/// ([`first_group`]): a stage refuses a request of more than `STAGE_ITEMS_MAX` items or of more
/// positions than one message carries, and a head of a larger capacity sent all its items in
/// one (the stage's refusal broke the stream, then every spare's, and the decoder failed).
async fn serve_job(pipe: &mut Pipe, job: &Job) -> PassResult {
    // A sequence a splice could not rebuild is fed again from 0, its history first.
    let again = |pipe: &Pipe, i: &JobItem| i.start > 0 && pipe.stale.contains(&i.id);
    let item = |pipe: &Pipe, i: &JobItem| match again(pipe, i) {
        true => (i.id, 0, [i.history.as_slice(), i.tokens.as_slice()].concat()),
        false => (i.id, i.start, i.tokens.clone()),
    };
    let mut out = Vec::with_capacity(job.items.len());
    let mut release = job.release.clone();
    let mut from = 0;
    while from < job.items.len() {
        // The next group, sized by what each item feeds now: a splice that could not rebuild
        // a sequence has it fed again from 0 with its history, a larger item. (The groups were
        // sized once, before any splice, and a retried group could exceed a stage request.)
        let row_bytes = pipe.conns.first().map_or(1, |c| c.row_bytes);
        let fed = job.items[from..]
            .iter()
            .map(|i| i.tokens.len() + if again(pipe, i) { i.history.len() } else { 0 });
        let group = from..from + first_group(fed, row_bytes, pipe.vocab);
        let logits = {
            let items: Vec<(u64, u32, Vec<u32>)> = job.items[group.clone()].iter().map(|i| item(pipe, i)).collect();
            match run_pass(
                &mut pipe.conns,
                &items,
                release.clone(),
                pipe.vocab,
                (&pipe.head, pipe.epoch),
            )
            .await
            {
                Ok(r) => {
                    let (mut logits, fed): (Vec<_>, Vec<_>) = r
                        .into_iter()
                        .map(|(l, rows)| {
                            let ok = l.is_ok();
                            (l, (ok, rows))
                        })
                        .unzip();
                    pipe.keep(&items, &fed, &release);
                    // An item a stage refused (it lacks the sequence's positions, ...): fed
                    // again once, from 0 with its history, alone. The stages begin it afresh.
                    // It used to come back as that sequence's failure at once.
                    for (k, l) in logits.iter_mut().enumerate() {
                        if let Err(why) = l {
                            let i = &job.items[group.start + k];
                            tracing::warn!(sequence = i.id, error = %why, "a stage refused the sequence's item: feeding the sequence again from 0");
                            if i.start > 0 {
                                pipe.stale.insert(i.id);
                            }
                            *l = refeed(pipe, item(pipe, i)).await;
                        }
                    }
                    logits
                }
                Err(e) => {
                    let resumes_at = job.items[group.clone()]
                        .iter()
                        .map(|i| i.start as usize + i.tokens.len())
                        .max()
                        .unwrap_or(0);
                    if !pipe.splice(resumes_at).await {
                        return Err(e);
                    }
                    // The same items again, grouped anew.
                    continue;
                }
            }
        };
        // The releases went with the first request.
        release.clear();
        out.extend(logits);
        from = group.end;
    }
    Ok(out)
}

/// One item fed again alone (from 0, with its history); its logits, or why not.
async fn refeed(pipe: &mut Pipe, item: (u64, u32, Vec<u32>)) -> std::result::Result<Logits, String> {
    let items = [item];
    let mut r = run_pass(
        &mut pipe.conns,
        &items,
        Vec::new(),
        pipe.vocab,
        (&pipe.head, pipe.epoch),
    )
    .await?;
    let (l, rows) = r.pop().expect("one item");
    pipe.keep(&items, &[(l.is_ok(), rows)], &[]);
    l
}

/// Splits a pass's items (their positions, in order) into consecutive groups that each fit one
/// stage request and its answer: at most `STAGE_ITEMS_MAX` items, their rows (`row_bytes` a
/// position) within half a message (as a splice's rebuild sends them), and the last stage's
/// answer, their logits (`vocab` f32s an item), within seven eighths of one. An item larger
/// than that alone goes alone.
#[cfg(test)]
fn pass_groups(positions: &[usize], row_bytes: usize, vocab: usize) -> Vec<std::ops::Range<usize>> {
    let mut groups = Vec::new();
    let mut start = 0;
    while start < positions.len() {
        let n = first_group(positions[start..].iter().copied(), row_bytes, vocab);
        groups.push(start..start + n);
        start += n;
    }
    groups
}

/// How many of the items (their positions, in order) go in the first group of
/// [`pass_groups`]: at least one when there is one; reads no further than the group.
fn first_group(positions: impl Iterator<Item = usize>, row_bytes: usize, vocab: usize) -> usize {
    let (budget, logits_budget) = (STAGE_MESSAGE_BYTES_MAX / 2, STAGE_MESSAGE_BYTES_MAX / 8 * 7);
    let (mut n, mut rows, mut logits) = (0, 0usize, 0usize);
    for p in positions {
        let (r, l) = (p.saturating_mul(row_bytes), vocab.saturating_mul(4));
        if n > 0 && (n >= STAGE_ITEMS_MAX || rows + r > budget || logits + l > logits_budget) {
            break;
        }
        n += 1;
        rows = rows.saturating_add(r);
        logits = logits.saturating_add(l);
    }
    n
}

/// Sends one request to a stage and takes its answer, which must name the same sequences in
/// the same order.
async fn ask(conn: &mut Conn, req: dpb::ForwardRequest) -> std::result::Result<dpb::ForwardResponse, String> {
    if let Some(why) = &conn.broken {
        return Err(why.clone());
    }
    let ids: Vec<u64> = req.items.iter().map(|i| i.sequence).collect();
    let epoch = req.pipeline_epoch;
    let addr = conn.info.addr.clone();
    let stage_id = conn.info.stage_id.clone();
    let mut registry = conn.registry.clone();
    let live_at = conn.live_at_log_ms;
    // A stage whose registration in the log lapsed is dead to the head: the pass fails at once
    // (the splice follows) instead of waiting out the stream's timeouts.
    let lapsed = async {
        let Some(r) = registry.as_mut() else {
            return std::future::pending().await;
        };
        loop {
            if r.borrow_and_update().lapsed(&stage_id, live_at) {
                return;
            }
            if r.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    };
    let answer = async {
        conn.tx
            .send(req)
            .await
            .map_err(|_| format!("stage {addr}: its stream is closed"))?;
        match tokio::time::timeout(STAGE_ANSWER_TIMEOUT, conn.rx.message()).await {
            Err(_) => Err(format!("stage {addr} did not answer within {STAGE_ANSWER_TIMEOUT:?}")),
            Ok(Err(s)) => Err(format!("stage {addr}: {}", s.message())),
            Ok(Ok(None)) => Err(format!("stage {addr} ended its stream")),
            Ok(Ok(Some(r))) if r.pipeline_epoch != epoch => Err(format!(
                "stage {addr} answered for pipeline epoch {}, and the request was of epoch {epoch}",
                r.pipeline_epoch
            )),
            Ok(Ok(Some(r))) if r.results.iter().map(|r| r.sequence).eq(ids.iter().copied()) => Ok(r),
            Ok(Ok(Some(_))) => Err(format!("stage {addr} answered for other sequences than it was asked")),
        }
    };
    let answer = tokio::select! {
        a = answer => a,
        () = lapsed => Err(format!("stage {addr} ({stage_id}): its registration in the log lapsed")),
    };
    if let Err(e) = &answer {
        conn.broken = Some(e.clone());
    }
    answer
}

/// Per item of a pass: its logits or why not, and the rows each stage after the first was fed.
type PassItems = Vec<(std::result::Result<Logits, String>, Vec<Vec<u8>>)>;

/// One pass through every stage. An item a stage refuses drops out (its error names the
/// stage); the others go on.
async fn run_pass(
    conns: &mut [Conn],
    items: &[(u64, u32, Vec<u32>)],
    release: Vec<u64>,
    vocab: usize,
    (head, epoch): (&str, u64),
) -> std::result::Result<PassItems, String> {
    let mut results: Vec<Option<std::result::Result<Logits, String>>> = vec![None; items.len()];
    let mut fed: Vec<Vec<Vec<u8>>> = vec![Vec::new(); items.len()];
    // The items still going, with the rows the last stage gave each.
    let mut going: Vec<(usize, Vec<u8>)> = (0..items.len()).map(|i| (i, Vec::new())).collect();
    let last = conns.len() - 1;
    for (k, conn) in conns.iter_mut().enumerate() {
        if going.is_empty() {
            break;
        }
        let req = dpb::ForwardRequest {
            items: going
                .iter()
                .map(|(i, rows)| {
                    let (sequence, start, tokens) = &items[*i];
                    if k > 0 {
                        fed[*i].push(rows.clone());
                    }
                    dpb::StageItem {
                        sequence: *sequence,
                        start: *start,
                        tokens: if k == 0 { tokens.clone() } else { Vec::new() },
                        hidden: rows.clone(),
                    }
                })
                .collect(),
            release: release.clone(),
            head: head.to_string(),
            pipeline_epoch: epoch,
        };
        let answer = ask(conn, req).await?;
        // A stage before the last gives one row per position it was fed: one row more or
        // fewer would shift every later stage's positions (their keys and values, and the
        // logits the token is sampled from), unseen. Such a stage is broken, like a dead one.
        if k < last {
            let short = going.iter().zip(&answer.results).find(|((i, _), r)| {
                r.error.is_empty() && !r.hidden.is_empty() && r.hidden.len() != items[*i].2.len() * conn.row_bytes
            });
            if let Some(((i, _), r)) = short {
                let why = format!(
                    "stage {} (layers {:?}) gave {} bytes of rows for {} positions of {} bytes",
                    conn.info.addr,
                    conn.info.layers,
                    r.hidden.len(),
                    items[*i].2.len(),
                    conn.row_bytes
                );
                conn.broken = Some(why.clone());
                return Err(why);
            }
        }
        let mut next = Vec::with_capacity(going.len());
        for ((i, _), r) in going.into_iter().zip(answer.results) {
            let stage = || format!("stage {} (layers {:?})", conn.info.addr, conn.info.layers);
            if !r.error.is_empty() {
                results[i] = Some(Err(format!("{}: {}", stage(), r.error)));
            } else if k == last {
                results[i] = Some(match f32s_from_bytes(&r.logits) {
                    Ok(l) if l.len() == vocab => Ok(l),
                    Ok(l) => Err(format!(
                        "{} gave {} logits for a vocabulary of {vocab}",
                        stage(),
                        l.len()
                    )),
                    Err(e) => Err(format!("{}: {e}", stage())),
                });
            } else if r.hidden.is_empty() {
                results[i] = Some(Err(format!("{} gave no rows", stage())));
            } else {
                next.push((i, r.hidden));
            }
        }
        going = next;
    }
    Ok(results
        .into_iter()
        .zip(fed)
        .map(|(r, rows)| (r.unwrap_or_else(|| Err("no stage answered for it".into())), rows))
        .collect())
}

/// One generation's sequence on the pipeline: its id on the stages and its length.
struct PipelineSequence {
    inner: Arc<Inner>,
    id: u64,
    len: usize,
    /// The tokens fed so far (fed again when a splice could not rebuild it).
    history: Vec<u32>,
    max_context: usize,
    vocab: usize,
}

impl Drop for PipelineSequence {
    fn drop(&mut self) {
        // Freed on the stages with the next pass.
        self.inner.released.lock().expect("lock").push(self.id);
    }
}

impl PipelineSequence {
    fn job_item(&self, tokens: &[u32]) -> JobItem {
        JobItem {
            id: self.id,
            start: self.len as u32,
            tokens: tokens.to_vec(),
            history: self.history.clone(),
        }
    }

    fn fed(&mut self, tokens: &[u32]) {
        self.len += tokens.len();
        self.history.extend_from_slice(tokens);
    }
}

impl Sequence for PipelineSequence {
    fn prefill(&mut self, tokens: &[u32]) -> Result<Logits> {
        if let Err(e) = check_feed(tokens, self.len, self.max_context, self.vocab) {
            self.reset();
            return Err(e);
        }
        let r = match self.inner.pass(vec![self.job_item(tokens)]) {
            Ok(mut r) => r.pop().expect("one item").map_err(Error::Stage),
            Err(e) => Err(Error::Pipeline(e)),
        };
        match r {
            Ok(l) => {
                self.fed(tokens);
                Ok(l)
            }
            Err(e) => {
                self.reset();
                Err(e)
            }
        }
    }

    fn kv_len(&self) -> usize {
        self.len
    }

    /// The stages begin it afresh at its next feed (from position 0).
    fn reset(&mut self) {
        self.len = 0;
        self.history.clear();
    }

    fn grouping_invariant(&self) -> bool {
        true
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

impl Model for PipelineModel {
    fn identity(&self) -> &ModelIdentity {
        &self.identity
    }

    fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn max_context(&self) -> usize {
        self.max_context
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn new_sequence(&self) -> Result<Box<dyn Sequence>> {
        Ok(Box::new(PipelineSequence {
            inner: self.inner.clone(),
            id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
            len: 0,
            history: Vec::new(),
            max_context: self.max_context,
            vocab: self.vocab,
        }))
    }

    /// One pass through the pipeline for all of them (each stage batches them).
    fn prefill_batch(&self, items: &mut [(&mut dyn Sequence, &[u32])]) -> Vec<Result<Logits>> {
        let mut seqs: Vec<(&mut PipelineSequence, &[u32])> = Vec::with_capacity(items.len());
        for (s, t) in items.iter_mut() {
            match s.as_any_mut().and_then(|a| a.downcast_mut::<PipelineSequence>()) {
                Some(p) if Arc::ptr_eq(&p.inner, &self.inner) => seqs.push((p, *t)),
                _ => return items.iter_mut().map(|(s, t)| s.prefill(t)).collect(),
            }
        }
        let mut results: Vec<Option<Result<Logits>>> = Vec::with_capacity(seqs.len());
        let mut fed = Vec::new();
        for (s, t) in seqs.iter_mut() {
            match check_feed(t, s.len, s.max_context, s.vocab) {
                Ok(()) => {
                    results.push(None);
                    fed.push(s.job_item(t));
                }
                Err(e) => {
                    s.reset();
                    results.push(Some(Err(e)));
                }
            }
        }
        let n = fed.len();
        let mut answers: Box<dyn Iterator<Item = Result<Logits>>> = match fed.is_empty() {
            true => Box::new(std::iter::empty()),
            false => match self.inner.pass(fed) {
                Ok(r) => Box::new(r.into_iter().map(|r| r.map_err(Error::Stage))),
                Err(e) => Box::new((0..n).map(move |_| Err(Error::Pipeline(e.clone())))),
            },
        };
        seqs.iter_mut()
            .zip(results)
            .map(|((s, t), r)| {
                r.unwrap_or_else(|| match answers.next().expect("one per fed item") {
                    Ok(l) => {
                        s.fed(t);
                        Ok(l)
                    }
                    Err(e) => {
                        s.reset();
                        Err(e)
                    }
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SetPipeline whose answer was lost after it applied is recognised as applied when its
    /// retry is refused, whatever epoch the log's one counter (shared by every head) gave it:
    /// with another head composing in between, h1's write from epoch 1 gets epoch 3. Only this
    /// head writes its record. Before, only epoch `expect + 1` counted: the head took its own
    /// splice for a failure and exited (its generations taken over).
    #[test]
    fn a_composition_applied_by_a_lost_try_is_ours_at_any_later_epoch() {
        let stage = |id: &str| lpb::PipelineStage {
            stage_id: id.into(),
            addr: format!("{id}:1"),
            first_layer: 0,
            end_layer: 30,
        };
        let req = lpb::SetPipelineRequest {
            head: "h1".into(),
            expect_epoch: 1,
            stages: vec![stage("spare")],
        };
        let found = |epoch, id: &str| lpb::PipelineInfo {
            head: "h1".into(),
            epoch,
            stages: vec![stage(id)],
            ..Default::default()
        };
        assert!(written_by_an_earlier_try(&req, &found(2, "spare")));
        assert!(
            written_by_an_earlier_try(&req, &found(3, "spare")),
            "another head composed at 2"
        );
        assert!(!written_by_an_earlier_try(&req, &found(1, "old")), "not applied");
        assert!(
            !written_by_an_earlier_try(&req, &found(3, "other")),
            "another composition"
        );
    }

    /// A pass's items go in groups of at most `STAGE_ITEMS_MAX` items whose rows and logits fit
    /// half a message; together the items in order; one item too large for a group goes alone.
    #[test]
    fn a_pass_goes_in_groups_that_each_fit_one_stage_request() {
        let half = STAGE_MESSAGE_BYTES_MAX / 2;
        let cover = |groups: &[std::ops::Range<usize>], n: usize| {
            let flat: Vec<usize> = groups.iter().flat_map(|g| g.clone()).collect();
            assert_eq!(flat, (0..n).collect::<Vec<_>>());
            assert!(groups.iter().all(|g| !g.is_empty()));
        };
        assert!(pass_groups(&[], 2304, 49_152).is_empty());
        assert_eq!(pass_groups(&[30, 1, 1], 2304, 49_152), vec![0..3]);
        // 300 items of one position: 256 and 44.
        let g = pass_groups(&[1; 300], 2304, 49_152);
        assert_eq!(g, vec![0..STAGE_ITEMS_MAX, STAGE_ITEMS_MAX..300]);
        // Rows: prompts of 4,000 positions of 2,304 bytes (9.2 MB): three to a group.
        let g = pass_groups(&[4_000; 7], 2304, 49_152);
        cover(&g, 7);
        assert!(g.iter().all(|g| g.len() * 4_000 * 2304 <= half), "{g:?}");
        assert_eq!(g.len(), 3, "{g:?}");
        // Logits: a vocabulary of 128k (512 KiB an item) lets 112 items in a group.
        let g = pass_groups(&[1; 200], 2304, 128 * 1024);
        assert_eq!(g, vec![0..112, 112..200]);
        // An item past the budget alone goes alone, and the others still group.
        let g = pass_groups(&[1, half, 1, 1], 1, 16);
        assert_eq!(g, vec![0..1, 1..2, 2..4]);
    }

    /// The groups of a pass are sized by what each item feeds at the time it is sent: after a
    /// splice that rebuilt nothing, every sequence goes again from 0 with its history, and the
    /// items left regroup into requests that fit. Before, the group sized before the splice
    /// was sent again: 256 sequences of 200 positions each, ~118 MB, in one request.
    #[test]
    fn a_pass_regroups_what_is_left_when_a_splice_makes_its_sequences_fed_in_full() {
        let (row_bytes, vocab) = (2304, 49_152);
        let before = vec![1usize; 256];
        assert_eq!(first_group(before.iter().copied(), row_bytes, vocab), 256);
        let after = vec![201usize; 256];
        let n = first_group(after.iter().copied(), row_bytes, vocab);
        assert!(n * 201 * row_bytes <= STAGE_MESSAGE_BYTES_MAX / 2, "{n}");
        assert!((n + 1) * 201 * row_bytes > STAGE_MESSAGE_BYTES_MAX / 2, "{n}");
        assert_eq!(pass_groups(&after, row_bytes, vocab).len(), 256usize.div_ceil(n));
        // It reads no further than its group.
        let mut read = 0;
        let n = first_group(
            (0..1_000).map(|_| {
                read += 1;
                1
            }),
            row_bytes,
            vocab,
        );
        assert_eq!((n, read), (STAGE_ITEMS_MAX, STAGE_ITEMS_MAX + 1));
    }

    /// A stage that agrees with the head on everything; each case changes one thing.
    fn described() -> dpb::DescribeResponse {
        dpb::DescribeResponse {
            weights_sha256: "ab12".into(),
            vocab: 100,
            numerics: crate::cpu::NUMERICS.into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_stage_is_dead_only_to_a_view_later_than_the_one_that_chose_it() {
        let view = |live: &[&str], log_ms| Registered {
            live: live.iter().map(|s| s.to_string()).collect(),
            ever: ["s1", "s2"].iter().map(|s| s.to_string()).collect(),
            log_ms,
        };
        // s2 died (its registration lapsed at log time 1,000) and came back under its old id;
        // a leader's view at 1,500 listed it registered, and the head spliced it back in.
        let before_it_came_back = view(&["s1"], 1_200);
        assert!(!before_it_came_back.lapsed("s2", 1_500), "an older view says nothing");
        assert!(before_it_came_back.lapsed("s2", 0), "a stage chosen without a view");
        assert!(view(&["s1"], 2_600).lapsed("s2", 1_500), "it lapsed again later");
        assert!(!view(&["s1", "s2"], 2_600).lapsed("s2", 1_500));
        // A stage never registered (no --cluster) is not watched.
        assert!(!view(&["s1"], 2_600).lapsed("s3", 0));
    }

    #[test]
    fn a_stage_of_other_weights_vocabulary_or_numerics_is_refused() {
        assert_eq!(check_description("s1", &described(), "ab12", 100), Ok(()));
        let refused = |d: dpb::DescribeResponse| check_description("s1", &d, "ab12", 100).unwrap_err();
        let e = refused(dpb::DescribeResponse {
            weights_sha256: "cd34".into(),
            ..described()
        });
        assert!(e.contains("runs weights cd34"), "{e}");
        let e = refused(dpb::DescribeResponse {
            vocab: 99,
            ..described()
        });
        assert!(e.contains("vocabulary of 99"), "{e}");
        // A release before the numerics field sends "": it computes other bits (cpu1).
        for numerics in ["", "cpu1", "cpu2", "cpu3", "cpu5"] {
            let e = refused(dpb::DescribeResponse {
                numerics: numerics.into(),
                ..described()
            });
            assert!(e.contains(&format!("numerics {numerics:?}")), "{e}");
        }
    }
}
