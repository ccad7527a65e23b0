//! An instant, deterministic twin of the real model, behind the same traits, for tests of
//! everything above the model layer.
//!
//! The logits after a prefix are a hash of the whole prefix (so the output depends on every
//! earlier token, as with a real model), biased toward lowercase letters and spaces so that
//! generated text is readable. Batching does not change them: exact and fast resume agree.
//! The tokenizer is byte-level: ids 0..=2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`,
//! id `3 + b` is byte `b`; no merges. It is a real [`Tokenizer`] (ChatML, detokenizer and all).

use std::time::Duration;

use crate::cache::{BlockKind, CacheBlock};
use crate::error::{Error, Result};
use crate::identity::{self, ModelIdentity};
use crate::model::{check_feed, Logits, Model, Sequence};
use crate::tokenizer::{byte_level_alphabet, Tokenizer, TokenizerSpec, TOKEN_TYPE_NORMAL};

/// Ids of the fake vocabulary's special tokens.
pub const FAKE_END_OF_TEXT: u32 = 0;
pub const FAKE_IM_START: u32 = 1;
pub const FAKE_IM_END: u32 = 2;
/// Id of byte `b` is `FAKE_BYTE_OFFSET + b`.
pub const FAKE_BYTE_OFFSET: u32 = 3;
pub const FAKE_VOCAB_SIZE: usize = 3 + 256;

/// Knobs of the fake model. Every field enters the weights digest except the delays, so two
/// configs that generate differently have different identities.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeConfig {
    /// Changes every logit: a different "model".
    pub variant: u64,
    /// After a prefix, EOS (`<|im_end|>`) is the top token with probability about
    /// `1 / eos_one_in` (decided by the prefix hash); 0 = EOS is never favoured.
    pub eos_one_in: u32,
    pub max_context: usize,
    /// Sleep per `step` call, to make a slow decoder.
    pub step_delay: Duration,
    /// Sleep per token of a `prefill` call.
    pub prefill_delay_per_token: Duration,
}

impl Default for FakeConfig {
    fn default() -> Self {
        FakeConfig {
            variant: 0,
            eos_one_in: 0,
            max_context: 4096,
            step_delay: Duration::ZERO,
            prefill_delay_per_token: Duration::ZERO,
        }
    }
}

/// The fake model.
#[derive(Clone, Debug)]
pub struct FakeModel {
    config: FakeConfig,
    tokenizer: Tokenizer,
    identity: ModelIdentity,
}

impl FakeModel {
    pub fn new(config: FakeConfig) -> Result<Self> {
        let tokenizer = fake_tokenizer()?;
        let identity = ModelIdentity {
            weights_sha256: identity::sha256_hex(
                format!(
                    "tokenlog-fake-model/v1 variant={} eos_one_in={} max_context={}",
                    config.variant, config.eos_one_in, config.max_context
                )
                .as_bytes(),
            ),
            tokenizer_sha256: identity::tokenizer_sha256(&tokenizer)?,
            architecture: "fake".into(),
            dtype_class: "fake".into(),
        };
        Ok(FakeModel {
            config,
            tokenizer,
            identity,
        })
    }

    pub fn config(&self) -> &FakeConfig {
        &self.config
    }
}

/// The fake byte-level tokenizer (see the module doc).
pub fn fake_tokenizer() -> Result<Tokenizer> {
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut tokens: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
    tokens.extend(byte_level_alphabet().iter().map(|c| c.to_string()));
    let mut token_types = vec![3; specials.len()];
    token_types.extend(std::iter::repeat_n(TOKEN_TYPE_NORMAL, 256));
    Tokenizer::from_spec(TokenizerSpec {
        tokens,
        token_types,
        merges: Vec::new(),
        bos_token_id: None,
        eos_token_id: Some(FAKE_IM_END),
        chat_template: Some(
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + \
             message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                .into(),
        ),
    })
}

impl Model for FakeModel {
    fn identity(&self) -> &ModelIdentity {
        &self.identity
    }

    fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn max_context(&self) -> usize {
        self.config.max_context
    }

    fn vocab_size(&self) -> usize {
        FAKE_VOCAB_SIZE
    }

    fn cache_bytes(&self, _positions: usize) -> Option<u64> {
        // One block of the cache's hash, whatever its length.
        Some(8)
    }

    fn new_sequence(&self) -> Result<Box<dyn Sequence>> {
        Ok(Box::new(FakeSequence {
            config: self.config.clone(),
            hash: initial_hash(self.config.variant),
            kv_len: 0,
            prefix_hashes: Vec::new(),
            tokens: Vec::new(),
        }))
    }
}

struct FakeSequence {
    config: FakeConfig,
    /// Hash of every token fed so far (the fake "KV cache").
    hash: u64,
    kv_len: usize,
    /// The hash after each position (`None` before an imported cache's last position): what
    /// a copy of a prefix of the cache holds.
    prefix_hashes: Vec<Option<u64>>,
    /// The token fed at each position, when known (`None`: imported).
    tokens: Vec<Option<u32>>,
}

fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn initial_hash(variant: u64) -> u64 {
    mix(0x746f_6b65_6e6c_6f67 ^ variant) // "tokenlog"
}

impl FakeSequence {
    fn logits(&self) -> Logits {
        let h = self.hash;
        let mut logits: Logits = (0..FAKE_VOCAB_SIZE as u64)
            .map(|i| {
                let noise = (mix(h ^ i.wrapping_mul(0xD6E8_FEB8_6659_FD93)) >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                let id = i as u32;
                let bias = match id.checked_sub(FAKE_BYTE_OFFSET).map(|b| b as u8) {
                    Some(b'a'..=b'z') => 3.0,
                    Some(b' ') => 3.5,
                    Some(b'A'..=b'Z' | b'.' | b',') => 1.0,
                    Some(0x21..=0x7e) => 0.0,
                    Some(_) => -6.0, // control and non-ASCII bytes
                    None => -12.0,   // special tokens
                };
                4.0 * noise + bias
            })
            .collect();
        let eos_one_in = u64::from(self.config.eos_one_in);
        if eos_one_in > 0 && mix(h ^ 0xE05) < u64::MAX / eos_one_in {
            logits[FAKE_IM_END as usize] = 20.0;
        }
        logits
    }
}

impl FakeSequence {
    /// The hash after the first `positions` positions, when known (the whole cache's always).
    fn prefix_hash(&self, positions: usize) -> Option<u64> {
        positions
            .checked_sub(1)
            .and_then(|i| self.prefix_hashes.get(i))
            .copied()
            .flatten()
    }
}

impl Sequence for FakeSequence {
    fn prefill(&mut self, tokens: &[u32]) -> Result<Logits> {
        check_feed(tokens, self.kv_len, self.config.max_context, FAKE_VOCAB_SIZE)?;
        let delay = if tokens.len() == 1 {
            self.config.step_delay
        } else {
            self.config.prefill_delay_per_token * tokens.len() as u32
        };
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        for &t in tokens {
            self.hash = mix(self.hash ^ u64::from(t));
            self.prefix_hashes.push(Some(self.hash));
            self.tokens.push(Some(t));
        }
        self.kv_len += tokens.len();
        Ok(self.logits())
    }

    fn kv_len(&self) -> usize {
        self.kv_len
    }

    fn reset(&mut self) {
        self.hash = initial_hash(self.config.variant);
        self.kv_len = 0;
        self.prefix_hashes.clear();
        self.tokens.clear();
    }

    /// The hash of a prefix does not depend on how it was fed, like the real model's CPU pass.
    fn grouping_invariant(&self) -> bool {
        true
    }

    /// The fake "KV cache" is the prefix hash: one block of one u64.
    fn cache_format(&self) -> Option<String> {
        Some(FAKE_CACHE_FORMAT.into())
    }

    fn export_cache(&self) -> Result<Vec<CacheBlock>> {
        Ok(vec![fake_block(self.hash)])
    }

    fn prefix_export_bytes(&self, positions: usize) -> Option<usize> {
        self.prefix_hash(positions).map(|_| 8)
    }

    fn export_cache_prefix(&self, positions: usize) -> Result<Vec<CacheBlock>> {
        let h = self.prefix_hash(positions).ok_or_else(|| {
            Error::Invalid(format!(
                "no copy of the first {positions} positions of a fake cache of {}",
                self.kv_len
            ))
        })?;
        Ok(vec![fake_block(h)])
    }

    fn import_cache(&mut self, blocks: &[CacheBlock], positions: usize) -> Result<()> {
        let [b] = blocks else {
            return Err(Error::Invalid(format!(
                "a fake cache is one block, not {}",
                blocks.len()
            )));
        };
        b.check()?;
        if (b.layer, b.kind, b.dtype.as_str(), b.shape.as_slice()) != (0, BlockKind::Keys, "u64", &[1][..]) {
            return Err(Error::Invalid(format!("not a fake cache block: {b:?}")));
        }
        if positions > self.config.max_context {
            return Err(Error::ContextFull {
                needed: positions,
                max: self.config.max_context,
            });
        }
        self.hash = u64::from_le_bytes(b.data[..8].try_into().expect("checked"));
        self.kv_len = positions;
        self.prefix_hashes = vec![None; positions];
        if let Some(last) = self.prefix_hashes.last_mut() {
            *last = Some(self.hash);
        }
        self.tokens = vec![None; positions];
        Ok(())
    }

    /// A fake row: the prefix hash after the position.
    fn export_row(&self, p: usize) -> Option<(u32, Vec<u8>)> {
        let token = (*self.tokens.get(p)?)?;
        let hash = (*self.prefix_hashes.get(p)?)?;
        Some((token, hash.to_le_bytes().to_vec()))
    }

    /// Checks each row against the hash chain (a row that is not the hash of the prefix and its
    /// token is refused), and costs no delay: no forward pass.
    fn append_rows(&mut self, rows: &[(u32, &[u8])]) -> Result<()> {
        let tokens: Vec<u32> = rows.iter().map(|&(t, _)| t).collect();
        check_feed(&tokens, self.kv_len, self.config.max_context, FAKE_VOCAB_SIZE)?;
        let mut hash = self.hash;
        let mut hashes = Vec::with_capacity(rows.len());
        for (i, &(t, data)) in rows.iter().enumerate() {
            hash = mix(hash ^ u64::from(t));
            if data != hash.to_le_bytes() {
                return Err(Error::Invalid(format!("row {i} is not the fake cache after token {t}")));
            }
            hashes.push(Some(hash));
        }
        self.hash = hash;
        self.prefix_hashes.extend(hashes);
        self.tokens.extend(tokens.into_iter().map(Some));
        self.kv_len += rows.len();
        Ok(())
    }
}

/// A fake cache: one block holding the prefix hash.
fn fake_block(hash: u64) -> CacheBlock {
    CacheBlock {
        layer: 0,
        kind: BlockKind::Keys,
        dtype: "u64".into(),
        shape: vec![1],
        data: hash.to_le_bytes().to_vec(),
    }
}

/// The fake model's cache format (its blocks are the prefix hash).
pub const FAKE_CACHE_FORMAT: &str = "fake-hash/v1";
