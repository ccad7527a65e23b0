//! A llama-family forward pass over GGUF weights, on candle's quantized kernels, with a KV cache
//! this crate owns: a planned handoff exports it from one decoder and imports it into another
//! ([`crate::cache`]), which candle-transformers' `quantized_llama` (whose cache is private) does
//! not allow.
//!
//! The block is the standard one: RMS norm → attention (Q, K, V projections; interleaved rotary
//! embedding; the cache appended along positions; grouped K/V heads repeated; scaled dot
//! product with a causal mask over a batch; output projection) → residual → RMS norm → SwiGLU
//! MLP → residual; then the final norm and the output projection of the last position. The
//! operations and their order are those of `quantized_llama`, so the logits are the same
//! numbers to the bit (`tests/real_model.rs` checks this against it), and everything said about
//! exact resume holds unchanged.

use std::io::{Read, Seek};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{DType, Device, IndexOp, Module, Tensor};
use candle_nn::Embedding;
use candle_transformers::models::quantized_llama::MAX_SEQ_LEN;
use candle_transformers::quantized_nn::RmsNorm;
use candle_transformers::utils::{build_causal_mask, repeat_kv};

use crate::cache::{f32s_from_bytes, f32s_to_bytes, BlockKind, CacheBlock};
use crate::error::{Error, Result};
use crate::kv::Forward;

struct Layer {
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    attn_norm: RmsNorm,
    ffn_norm: RmsNorm,
    /// SwiGLU: down(silu(gate(x)) * up(x)).
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
}

/// The weights of a loaded model, shared by all its sequences.
pub(crate) struct LlamaWeights {
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    output: QMatMul,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    /// Rotary tables, one row per position up to `MAX_SEQ_LEN`.
    cos: Tensor,
    sin: Tensor,
    neg_inf: Tensor,
    device: Device,
}

fn meta<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value> {
    ct.metadata
        .get(key)
        .ok_or_else(|| Error::Unsupported(format!("the GGUF file has no {key}")))
}

fn meta_usize(ct: &gguf_file::Content, key: &str) -> Result<usize> {
    Ok(meta(ct, key)?.to_u32()? as usize)
}

/// The hyper-parameters of a `llama` GGUF file, checked; both engines read them here.
pub(crate) struct LlamaShape {
    pub(crate) n_head: usize,
    pub(crate) n_kv_head: usize,
    pub(crate) n_layers: usize,
    pub(crate) hidden: usize,
    pub(crate) ffn: usize,
    pub(crate) rope_dim: usize,
    pub(crate) eps: f32,
    pub(crate) rope_base: f32,
}

impl LlamaShape {
    pub(crate) fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let experts = ct
            .metadata
            .get("llama.expert_count")
            .and_then(|v| v.to_u32().ok())
            .unwrap_or(0);
        if experts > 1 {
            return Err(Error::Unsupported(format!(
                "mixture-of-experts models ({experts} experts) are not supported"
            )));
        }
        let shape = LlamaShape {
            n_head: meta_usize(ct, "llama.attention.head_count")?,
            n_kv_head: meta_usize(ct, "llama.attention.head_count_kv")?,
            n_layers: meta_usize(ct, "llama.block_count")?,
            hidden: meta_usize(ct, "llama.embedding_length")?,
            ffn: meta_usize(ct, "llama.feed_forward_length")?,
            rope_dim: meta_usize(ct, "llama.rope.dimension_count")?,
            eps: meta(ct, "llama.attention.layer_norm_rms_epsilon")?.to_f32()?,
            rope_base: ct
                .metadata
                .get("llama.rope.freq_base")
                .and_then(|v| v.to_f32().ok())
                .unwrap_or(10_000.0),
        };
        let (h, kv, hidden) = (shape.n_head, shape.n_kv_head, shape.hidden);
        if h == 0 || kv == 0 || h % kv != 0 || hidden % h != 0 {
            return Err(Error::Unsupported(format!(
                "head counts {h} / {kv} do not fit a hidden size of {hidden}"
            )));
        }
        Ok(shape)
    }
}

impl LlamaWeights {
    /// The bytes of one position of an exported cache: keys and values of every layer, f32.
    pub(crate) fn cache_position_bytes(&self) -> usize {
        2 * self.layers.len() * self.n_kv_head * self.head_dim * std::mem::size_of::<f32>()
    }

    /// Reads the weights of a `llama` GGUF file onto `device`.
    pub(crate) fn from_gguf<R: Read + Seek>(ct: &gguf_file::Content, r: &mut R, device: &Device) -> Result<Self> {
        let LlamaShape {
            n_head,
            n_kv_head,
            n_layers,
            hidden,
            rope_dim,
            eps,
            rope_base,
            ..
        } = LlamaShape::from_gguf(ct)?;
        let eps = eps as f64;
        let (cos, sin) = rotary_tables(rope_dim, rope_base, device)?;
        let tensor = |r: &mut R, name: &str| ct.tensor(r, name, device);
        let embed_q = tensor(r, "token_embd.weight")?;
        let embed = Embedding::new(embed_q.dequantize(device)?, hidden);
        let norm = RmsNorm::from_qtensor(tensor(r, "output_norm.weight")?, eps)?;
        // Tied embeddings: no output matrix of its own.
        let output = match tensor(r, "output.weight") {
            Ok(t) => t,
            Err(_) => embed_q,
        };
        let mut layers = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            let mut q = |what: &str| -> Result<QMatMul> {
                Ok(QMatMul::from_qtensor(tensor(r, &format!("blk.{i}.{what}.weight"))?)?)
            };
            let (wq, wk, wv, wo) = (q("attn_q")?, q("attn_k")?, q("attn_v")?, q("attn_output")?);
            let (gate, down, up) = (q("ffn_gate")?, q("ffn_down")?, q("ffn_up")?);
            let attn_norm = RmsNorm::from_qtensor(tensor(r, &format!("blk.{i}.attn_norm.weight"))?, eps)?;
            let ffn_norm = RmsNorm::from_qtensor(tensor(r, &format!("blk.{i}.ffn_norm.weight"))?, eps)?;
            layers.push(Layer {
                wq,
                wk,
                wv,
                wo,
                attn_norm,
                ffn_norm,
                gate,
                up,
                down,
            });
        }
        Ok(LlamaWeights {
            embed,
            layers,
            norm,
            output: QMatMul::from_qtensor(output)?,
            n_head,
            n_kv_head,
            head_dim: hidden / n_head,
            cos,
            sin,
            neg_inf: Tensor::new(f32::NEG_INFINITY, device)?,
            device: device.clone(),
        })
    }

    /// The cache layout name: element type, device class and dimensions.
    fn cache_format(&self) -> String {
        let device = if self.device.is_cuda() { "cuda" } else { "cpu" };
        format!(
            "llama-kv/f32/{device}/{}x{}x{}",
            self.layers.len(),
            self.n_kv_head,
            self.head_dim
        )
    }
}

/// cos and sin of position × frequency, for every position below `MAX_SEQ_LEN`.
fn rotary_tables(dim: usize, base: f32, device: &Device) -> Result<(Tensor, Tensor)> {
    let freqs: Vec<f32> = (0..dim)
        .step_by(2)
        .map(|i| 1f32 / base.powf(i as f32 / dim as f32))
        .collect();
    let n = freqs.len();
    let freqs = Tensor::new(freqs.as_slice(), device)?.reshape((1, n))?;
    let positions = Tensor::arange(0, MAX_SEQ_LEN as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((MAX_SEQ_LEN, 1))?;
    let angles = positions.matmul(&freqs)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// One sequence: the shared weights and its own cache (per layer: keys and values, each
/// `[1, kv_heads, positions, head_dim]`).
pub(crate) struct LlamaSequence {
    w: Arc<LlamaWeights>,
    cache: Vec<Option<(Tensor, Tensor)>>,
}

impl LlamaSequence {
    pub(crate) fn new(w: Arc<LlamaWeights>) -> Self {
        let n = w.layers.len();
        LlamaSequence {
            w,
            cache: vec![None; n],
        }
    }

    fn rotate(&self, x: &Tensor, pos: usize) -> candle_core::Result<Tensor> {
        let (_, _, n, _) = x.dims4()?;
        let cos = self.w.cos.narrow(0, pos, n)?;
        let sin = self.w.sin.narrow(0, pos, n)?;
        candle_nn::rotary_emb::rope_i(&x.contiguous()?, &cos, &sin)
    }

    fn attention(&mut self, i: usize, x: &Tensor, mask: Option<&Tensor>, pos: usize) -> candle_core::Result<Tensor> {
        let w = self.w.clone();
        let l = &w.layers[i];
        let (b, n, hidden) = x.dims3()?;
        let heads = |m: &QMatMul, h: usize| -> candle_core::Result<Tensor> {
            m.forward(x)?.reshape((b, n, h, w.head_dim))?.transpose(1, 2)
        };
        let q = heads(&l.wq, w.n_head)?;
        let k = heads(&l.wk, w.n_kv_head)?;
        let v = heads(&l.wv, w.n_kv_head)?.contiguous()?;
        let q = self.rotate(&q, pos)?;
        let k = self.rotate(&k, pos)?;
        let (k, v) = match &self.cache[i] {
            Some((kc, vc)) if pos > 0 => (Tensor::cat(&[kc, &k], 2)?, Tensor::cat(&[vc, &v], 2)?),
            _ => (k, v),
        };
        self.cache[i] = Some((k.clone(), v.clone()));
        let rep = w.n_head / w.n_kv_head;
        let k = repeat_kv(k, rep)?;
        let v = repeat_kv(v, rep)?;
        let scores = (q.matmul(&k.t()?)? / (w.head_dim as f64).sqrt())?;
        let scores = match mask {
            None => scores,
            Some(m) => {
                let m = m.broadcast_as(scores.shape())?;
                m.where_cond(&w.neg_inf.broadcast_as(m.shape().dims())?, &scores)?
            }
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let y = probs.matmul(&v.contiguous()?)?;
        let y = y.transpose(1, 2)?.reshape(&[b, n, hidden])?;
        l.wo.forward(&y)
    }
}

impl Forward for LlamaSequence {
    fn run(&mut self, input: &Tensor, pos: usize) -> candle_core::Result<Tensor> {
        let w = self.w.clone();
        let (_, n) = input.dims2()?;
        let mask = if n == 1 {
            None
        } else {
            Some(build_causal_mask(n, pos, input.device())?)
        };
        let mut h = w.embed.forward(input)?;
        for (i, l) in w.layers.iter().enumerate() {
            let attn = self.attention(i, &l.attn_norm.forward(&h)?, mask.as_ref(), pos)?;
            let x = (attn + &h)?;
            let y = l.ffn_norm.forward(&x)?;
            let gate = l.gate.forward(&y)?;
            let up = l.up.forward(&y)?;
            let y = l.down.forward(&(candle_nn::ops::silu(&gate)? * up)?)?;
            h = (y + &x)?;
        }
        let last = w.norm.forward(&h)?.i((.., n - 1, ..))?;
        w.output.forward(&last)
    }

    fn clear(&mut self) {
        self.cache.iter_mut().for_each(|c| *c = None);
    }

    fn cache_format(&self) -> Option<String> {
        Some(self.w.cache_format())
    }

    fn export_cache(&self) -> Result<Vec<CacheBlock>> {
        let mut out = Vec::with_capacity(2 * self.cache.len());
        for (i, c) in self.cache.iter().enumerate() {
            let Some((k, v)) = c else {
                return Err(Error::Invalid(format!("layer {i} has no cache to export")));
            };
            for (kind, t) in [(BlockKind::Keys, k), (BlockKind::Values, v)] {
                if t.dtype() != DType::F32 {
                    return Err(Error::Unsupported(format!(
                        "a cache of {:?} cannot be exported",
                        t.dtype()
                    )));
                }
                let data: Vec<f32> = t.flatten_all()?.to_vec1()?;
                out.push(CacheBlock {
                    layer: i as u32,
                    kind,
                    dtype: "f32".into(),
                    shape: t.dims().iter().map(|&d| d as u32).collect(),
                    data: f32s_to_bytes(&data),
                });
            }
        }
        Ok(out)
    }

    fn import_cache(&mut self, blocks: &[CacheBlock], positions: usize) -> Result<()> {
        let w = &self.w;
        if blocks.len() != 2 * w.layers.len() {
            return Err(Error::Invalid(format!(
                "{} cache blocks for a model of {} layers",
                blocks.len(),
                w.layers.len()
            )));
        }
        let want = [1, w.n_kv_head as u32, positions as u32, w.head_dim as u32];
        let mut cache = Vec::with_capacity(w.layers.len());
        for (i, pair) in blocks.chunks(2).enumerate() {
            let mut kv = Vec::with_capacity(2);
            for (b, kind) in pair.iter().zip([BlockKind::Keys, BlockKind::Values]) {
                b.check()?;
                if b.layer as usize != i || b.kind != kind || b.dtype != "f32" || b.shape != want {
                    return Err(Error::Invalid(format!(
                        "cache block {} of layer {} ({}, {:?}) where layer {i} {} of shape {want:?} in f32 belongs",
                        b.kind.name(),
                        b.layer,
                        b.dtype,
                        b.shape,
                        kind.name()
                    )));
                }
                let data = f32s_from_bytes(&b.data)?;
                let shape: Vec<usize> = want.iter().map(|&d| d as usize).collect();
                kv.push(Tensor::from_vec(data, shape, &w.device)?);
            }
            let v = kv.pop().expect("two");
            let k = kv.pop().expect("two");
            cache.push(Some((k, v)));
        }
        self.cache = cache;
        Ok(())
    }
}
