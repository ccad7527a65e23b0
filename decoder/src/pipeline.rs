//! A pipeline head's model (issue 16): a [`Model`] whose layers run in stage processes
//! ([`crate::stage`], `tokenlog stage`). The head holds no weights, only the model file's
//! header (tokenizer, identity); each pass sends the token ids to the first stage, each stage's
//! rows to the next, and takes the logits from the last. The lease worker drives it like any
//! model: a pipeline head is a decoder (`tokenlog decoder --pipeline ...`) that leases, samples
//! and appends through fenced writes; nothing in the log tells it from a whole decoder, and
//! since a split model computes the same bits as the whole one, either continues the other's
//! generation exactly.
//!
//! A stage that cannot be reached, answers late or breaks its stream fails the pass: the head's
//! step fails as a whole decoder's failed model step does (the process ends, its leases end,
//! another decoder takes the generation over). Spares and splicing come later.
//!
//! The stages' streams live on one I/O thread of their own (a small runtime), so the model's
//! calls, which the worker makes on blocking threads, stay synchronous.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokenlog_proto::decoder as dpb;
use tonic::transport::Channel;

use crate::cache::f32s_from_bytes;
use crate::error::{Error, Result};
use crate::gguf_model::LlamaFile;
use crate::identity::ModelIdentity;
use crate::limits::{STAGE_ANSWER_TIMEOUT, STAGE_MESSAGE_BYTES_MAX};
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

/// One pass: per item its sequence, first position and tokens; the sequences to free first.
struct Job {
    items: Vec<(u64, u32, Vec<u32>)>,
    release: Vec<u64>,
    reply: std::sync::mpsc::SyncSender<std::result::Result<Vec<std::result::Result<Logits, String>>, String>>,
}

struct Inner {
    jobs: tokio::sync::mpsc::UnboundedSender<Job>,
    released: Mutex<Vec<u64>>,
    next_id: AtomicU64,
}

impl Inner {
    fn pass(
        &self,
        items: Vec<(u64, u32, Vec<u32>)>,
    ) -> std::result::Result<Vec<std::result::Result<Logits, String>>, String> {
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
}

/// One stage's open stream.
struct Conn {
    info: StageInfo,
    tx: tokio::sync::mpsc::Sender<dpb::ForwardRequest>,
    rx: tonic::Streaming<dpb::ForwardResponse>,
    /// Why the stream is unusable (it broke, or answered out of turn).
    broken: Option<String>,
}

impl PipelineModel {
    /// Reads the model file's header at `path` (a llama GGUF file: the tokenizer and the identity
    /// generations are bound to), asks each stage at `addrs` (in pipeline order) what it holds,
    /// checks that they run the file's weights and cover its layers in order, each layer once,
    /// and opens a stream to each.
    pub fn connect(path: &std::path::Path, addrs: &[String], channel_for: ChannelFor) -> Result<Self> {
        if addrs.is_empty() {
            return Err(Error::Invalid("a pipeline needs at least one stage".into()));
        }
        let LlamaFile {
            tokenizer,
            identity,
            max_context,
            ..
        } = LlamaFile::open(path)?;
        let vocab = tokenizer.vocab_size();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let (jobs, job_rx) = tokio::sync::mpsc::unbounded_channel();
        let want = identity.weights_sha256.clone();
        let addrs = addrs.to_vec();
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
                    let conns = match open_stages(&addrs, &channel_for, &want, vocab).await {
                        Ok(c) => c,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let max = conns.iter().map(|c| c.1).min().unwrap_or(0);
                    let mut conns: Vec<Conn> = conns.into_iter().map(|c| c.0).collect();
                    let _ = ready_tx.send(Ok((conns.iter().map(|c| c.info.clone()).collect::<Vec<_>>(), max)));
                    serve_jobs(&mut conns, job_rx, vocab).await;
                });
            })
            .map_err(|e| Error::Stage(format!("starting the pipeline's I/O thread: {e}")))?;
        let (stages, stage_max) = ready_rx
            .recv()
            .map_err(|_| Error::Stage("the pipeline's I/O thread ended".into()))?
            .map_err(Error::Stage)?;
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
        })
    }

    /// The stages, in pipeline order.
    pub fn stages(&self) -> &[StageInfo] {
        &self.stages
    }
}

/// Describes every stage, checks the pipeline and opens the streams; each stage's stream and
/// its most positions.
async fn open_stages(
    addrs: &[String],
    channel_for: &ChannelFor,
    weights_sha256: &str,
    vocab: usize,
) -> std::result::Result<Vec<(Conn, usize)>, String> {
    let mut out = Vec::with_capacity(addrs.len());
    let mut next_layer = 0u32;
    let mut total = None;
    let mut hidden = None;
    for (i, addr) in addrs.iter().enumerate() {
        let channel = channel_for(addr).map_err(|e| format!("stage {addr}: {e}"))?;
        let mut c = dpb::stage_client::StageClient::new(channel)
            .max_decoding_message_size(STAGE_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(STAGE_MESSAGE_BYTES_MAX);
        let d = tokio::time::timeout(Duration::from_secs(10), c.describe(dpb::DescribeRequest {}))
            .await
            .map_err(|_| format!("stage {addr} did not answer Describe within 10 s"))?
            .map_err(|s| format!("stage {addr}: {}", s.message()))?
            .into_inner();
        if d.weights_sha256 != weights_sha256 {
            return Err(format!(
                "stage {addr} runs weights {} and this head's model file is {weights_sha256}",
                d.weights_sha256
            ));
        }
        if d.first_layer != next_layer {
            return Err(format!(
                "stage {} ({addr}) holds layers {}..{}, and the pipeline needs layer {next_layer} next",
                i + 1,
                d.first_layer,
                d.end_layer
            ));
        }
        if *total.get_or_insert(d.total_layers) != d.total_layers || *hidden.get_or_insert(d.hidden) != d.hidden {
            return Err(format!("stage {addr} describes another model's shape"));
        }
        if d.vocab as usize != vocab {
            return Err(format!(
                "stage {addr} has a vocabulary of {} and the model file's tokenizer {vocab}",
                d.vocab
            ));
        }
        next_layer = d.end_layer;
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let rx = c
            .forward(futures::stream::poll_fn({
                let mut rx: tokio::sync::mpsc::Receiver<dpb::ForwardRequest> = rx;
                move |cx| rx.poll_recv(cx)
            }))
            .await
            .map_err(|s| format!("stage {addr}: opening its stream: {}", s.message()))?
            .into_inner();
        out.push((
            Conn {
                info: StageInfo {
                    addr: addr.clone(),
                    stage_id: d.stage_id,
                    layers: d.first_layer as usize..d.end_layer as usize,
                },
                tx,
                rx,
                broken: None,
            },
            d.max_positions as usize,
        ));
    }
    if Some(next_layer) != total {
        return Err(format!(
            "the stages cover layers 0..{next_layer} of {}: the last stage must end the model",
            total.unwrap_or(0)
        ));
    }
    Ok(out)
}

async fn serve_jobs(conns: &mut [Conn], mut jobs: tokio::sync::mpsc::UnboundedReceiver<Job>, vocab: usize) {
    while let Some(job) = jobs.recv().await {
        let r = run_pass(conns, job.items, job.release, vocab).await;
        let _ = job.reply.send(r);
    }
}

/// Sends one request to a stage and takes its answer, which must name the same sequences in
/// the same order.
async fn ask(conn: &mut Conn, req: dpb::ForwardRequest) -> std::result::Result<dpb::ForwardResponse, String> {
    if let Some(why) = &conn.broken {
        return Err(why.clone());
    }
    let ids: Vec<u64> = req.items.iter().map(|i| i.sequence).collect();
    let addr = conn.info.addr.clone();
    let answer = async {
        conn.tx
            .send(req)
            .await
            .map_err(|_| format!("stage {addr}: its stream is closed"))?;
        match tokio::time::timeout(STAGE_ANSWER_TIMEOUT, conn.rx.message()).await {
            Err(_) => Err(format!("stage {addr} did not answer within {STAGE_ANSWER_TIMEOUT:?}")),
            Ok(Err(s)) => Err(format!("stage {addr}: {}", s.message())),
            Ok(Ok(None)) => Err(format!("stage {addr} ended its stream")),
            Ok(Ok(Some(r))) if r.results.iter().map(|r| r.sequence).eq(ids.iter().copied()) => Ok(r),
            Ok(Ok(Some(_))) => Err(format!("stage {addr} answered for other sequences than it was asked")),
        }
    }
    .await;
    if let Err(e) = &answer {
        conn.broken = Some(e.clone());
    }
    answer
}

/// One pass through every stage. An item a stage refuses drops out (its error names the
/// stage); the others go on.
async fn run_pass(
    conns: &mut [Conn],
    items: Vec<(u64, u32, Vec<u32>)>,
    release: Vec<u64>,
    vocab: usize,
) -> std::result::Result<Vec<std::result::Result<Logits, String>>, String> {
    let mut results: Vec<Option<std::result::Result<Logits, String>>> = vec![None; items.len()];
    // The items still going, with the rows the last stage gave each.
    let mut going: Vec<(usize, Vec<u8>)> = (0..items.len()).map(|i| (i, Vec::new())).collect();
    let last = conns.len() - 1;
    for (k, conn) in conns.iter_mut().enumerate() {
        if going.is_empty() {
            break;
        }
        let req = dpb::ForwardRequest {
            items: going
                .iter_mut()
                .map(|(i, rows)| {
                    let (sequence, start, tokens) = &items[*i];
                    dpb::StageItem {
                        sequence: *sequence,
                        start: *start,
                        tokens: if k == 0 { tokens.clone() } else { Vec::new() },
                        hidden: std::mem::take(rows),
                    }
                })
                .collect(),
            release: release.clone(),
        };
        let answer = ask(conn, req).await?;
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
        .map(|r| r.unwrap_or_else(|| Err("no stage answered for it".into())))
        .collect())
}

/// One generation's sequence on the pipeline: its id on the stages and its length.
struct PipelineSequence {
    inner: Arc<Inner>,
    id: u64,
    len: usize,
    max_context: usize,
    vocab: usize,
}

impl Drop for PipelineSequence {
    fn drop(&mut self) {
        // Freed on the stages with the next pass.
        self.inner.released.lock().expect("lock").push(self.id);
    }
}

impl Sequence for PipelineSequence {
    fn prefill(&mut self, tokens: &[u32]) -> Result<Logits> {
        if let Err(e) = check_feed(tokens, self.len, self.max_context, self.vocab) {
            self.reset();
            return Err(e);
        }
        let r = self
            .inner
            .pass(vec![(self.id, self.len as u32, tokens.to_vec())])
            .and_then(|mut r| r.pop().expect("one item"));
        match r {
            Ok(l) => {
                self.len += tokens.len();
                Ok(l)
            }
            Err(e) => {
                self.reset();
                Err(Error::Stage(e))
            }
        }
    }

    fn kv_len(&self) -> usize {
        self.len
    }

    /// The stages begin it afresh at its next feed (from position 0).
    fn reset(&mut self) {
        self.len = 0;
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
                    fed.push((s.id, s.len as u32, t.to_vec()));
                }
                Err(e) => {
                    s.reset();
                    results.push(Some(Err(e)));
                }
            }
        }
        let mut answers: Box<dyn Iterator<Item = std::result::Result<Logits, String>>> = match fed.is_empty() {
            true => Box::new(std::iter::empty()),
            false => match self.inner.pass(fed.clone()) {
                Ok(r) => Box::new(r.into_iter()),
                Err(e) => Box::new(std::iter::repeat_n(Err(e), fed.len())),
            },
        };
        seqs.iter_mut()
            .zip(results)
            .map(|((s, t), r)| {
                r.unwrap_or_else(|| match answers.next().expect("one per fed item") {
                    Ok(l) => {
                        s.len += t.len();
                        Ok(l)
                    }
                    Err(e) => {
                        s.reset();
                        Err(Error::Stage(e))
                    }
                })
            })
            .collect()
    }
}
