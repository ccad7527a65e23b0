//! The tokenizer a model is bound to, built from the model file's own vocabulary (GGUF), or
//! read from the model folder's `tokenizer.json` (safetensors models,
//! [`Tokenizer::from_tokenizer_json`]).
//!
//! GGUF files carry their tokenizer as metadata (`tokenizer.ggml.*`). For byte-level BPE files
//! (`tokenizer.ggml.model = "gpt2"`) we build a `tokenizers` BPE from the file's tokens and
//! merges, with pre-tokenizer `Digits(individual) + ByteLevel(add_prefix_space = false)` and a
//! ByteLevel decoder; every token whose type is not "normal" becomes a special token. This is
//! what SmolLM2's `tokenizer.json` does; candle's own GGUF tokenizer adds a prefix space for
//! `tokenizer.ggml.pre = "smollm"` (shared/gpu/README.md).
//!
//! Prompts for instruct models use ChatML (confirmed against the file's
//! `tokenizer.chat_template`); we render it directly, with no template engine.
//!
//! [`IncrementalDetokenizer`] turns committed token ids into valid UTF-8 text deltas, holding back
//! the bytes of a character split across tokens until it is complete (CONTRACT §3).

pub use crate::detokenizer::IncrementalDetokenizer;
use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use crate::gguf_meta::{GgufMetadata, MetaValue};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::AddedToken;

use crate::error::{Error, Result};

/// GGUF `tokenizer.ggml.token_type` value of an ordinary vocabulary entry.
pub const TOKEN_TYPE_NORMAL: i32 = 1;
const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";
const END_OF_TEXT: &str = "<|endoftext|>";

/// What a model file says about its tokenizer, in the file's own terms.
#[derive(Clone, Debug, Default)]
pub struct TokenizerSpec {
    /// Token strings in byte-level form (`Ġ` for a space), indexed by id.
    pub tokens: Vec<String>,
    /// GGUF token types, parallel to `tokens` (1 = normal, 3 = control, ...).
    pub token_types: Vec<i32>,
    /// BPE merges, highest priority first.
    pub merges: Vec<(String, String)>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// The file's jinja chat template, if any; only used to recognise ChatML and its default
    /// system prompt.
    pub chat_template: Option<String>,
}

/// A message of a chat prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// How prompts for this model are laid out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then `<|im_start|>assistant\n`.
    /// `default_system` is inserted when the first message is not a system message (SmolLM2's
    /// template does this).
    ChatMl { default_system: Option<String> },
    /// No chat format known: messages' contents are joined with newlines.
    Plain,
}

/// A model's tokenizer: the `tokenizers` pipeline plus what the decoder needs beside it (bytes of
/// every token for incremental detokenizing, special ids, chat template).
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same pipeline with special-token strings taken as plain text: what a chat message
    /// says ([`Tokenizer::encode_chat`]). Made on first use (a copy of `inner`: most prompts
    /// never need it).
    inner_text: std::sync::OnceLock<tokenizers::Tokenizer>,
    /// Finds the strings `inner` turns into special tokens (its added special tokens), `None`
    /// without any.
    special_texts: Option<aho_corasick::AhoCorasick>,
    /// Raw bytes of each token id (special tokens: their text), for [`IncrementalDetokenizer`].
    token_bytes: Arc<[Box<[u8]>]>,
    /// `special[id]`: the token is a control/special token (skipped in user-visible text).
    special: Arc<[bool]>,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    chat_template: ChatTemplate,
    /// How a token's text maps to its bytes (kept for [`Tokenizer::to_package`]).
    mapping: TokenBytes,
}

/// The first field of a tokenizer package: its format.
const PACKAGE_FORMAT: &str = "tokenlog-tokenizer/1";

/// A tokenizer as a self-contained document ([`Tokenizer::to_package`]): what a gateway needs to
/// produce a model's text without its files. JSON; `tokenizer` is the canonical `tokenizers`
/// JSON the tokenizer digest is computed over.
#[derive(serde::Serialize, serde::Deserialize)]
struct Package {
    format: String,
    tokenizer: String,
    /// `byte_level` or `sentencepiece`.
    token_bytes: String,
    special: Vec<u32>,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    /// `chatml` or `plain`.
    chat_format: String,
    /// ChatML's default system prompt, if it has one.
    default_system: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos_token_ids", &self.eos_token_ids)
            .field("chat_template", &self.chat_template)
            .finish()
    }
}

impl Tokenizer {
    /// Reads the tokenizer out of a GGUF file's metadata. Only byte-level BPE (`gpt2`) files are
    /// supported.
    pub fn from_gguf(md: &GgufMetadata) -> Result<Self> {
        Self::from_spec(spec_from_gguf(md)?)
    }

    /// Reads only the tokenizer of a GGUF file (metadata; no weights).
    pub fn from_gguf_file(path: &std::path::Path) -> Result<Self> {
        Self::from_gguf(&GgufMetadata::read_file(path)?)
    }

    /// The tokenizer of a model path as [`crate::load_model`] takes it: a folder's
    /// `tokenizer.json`, or a GGUF file's metadata.
    pub fn from_model_path(path: &Path) -> Result<Self> {
        if path.is_dir() {
            Self::from_tokenizer_json(&path.join("tokenizer.json"))
        } else {
            Self::from_gguf_file(path)
        }
    }

    /// Builds the tokenizer from its parts (used for GGUF files and for the fake model).
    pub fn from_spec(spec: TokenizerSpec) -> Result<Self> {
        if spec.tokens.is_empty() || spec.tokens.len() != spec.token_types.len() {
            return Err(Error::Tokenizer(format!(
                "{} tokens but {} token types",
                spec.tokens.len(),
                spec.token_types.len()
            )));
        }
        let vocab: tokenizers::models::bpe::Vocab = spec
            .tokens
            .iter()
            .enumerate()
            .map(|(id, t)| (t.clone(), id as u32))
            .collect();
        if vocab.len() != spec.tokens.len() {
            return Err(Error::Tokenizer("duplicate token strings".into()));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, spec.merges.clone())
            .build()
            .map_err(Error::tokenizer)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(PreSequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])));
        inner.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));

        let special: Vec<bool> = spec.token_types.iter().map(|&t| t != TOKEN_TYPE_NORMAL).collect();
        let added = spec
            .tokens
            .iter()
            .zip(&special)
            .filter(|(_, &s)| s)
            .map(|(t, _)| AddedToken::from(t.clone(), true));
        inner.add_special_tokens(added).map_err(Error::tokenizer)?;
        let tokens: Vec<Option<String>> = spec.tokens.iter().cloned().map(Some).collect();
        Ok(Self::assemble(
            inner,
            &tokens,
            special,
            TokenBytes::ByteLevel,
            spec.bos_token_id,
            spec.eos_token_id.into_iter().collect(),
            spec.chat_template.as_deref(),
        ))
    }

    /// Reads a Hugging Face `tokenizer.json`, with what its model folder says beside it:
    /// `tokenizer_config.json` (`bos_token`, `eos_token`, `chat_template`), `config.json` and
    /// `generation_config.json` (`bos_token_id`, `eos_token_id`: a number or a list). Byte-level BPE (GPT-2, Llama 3, SmolLM) and
    /// SentencePiece-style vocabularies (`▁` for a space, `<0xNN>` byte tokens) are supported.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let inner =
            tokenizers::Tokenizer::from_str(&text).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let mapping = if uses_byte_level(&json["pre_tokenizer"]) || uses_byte_level(&json["decoder"]) {
            TokenBytes::ByteLevel
        } else {
            TokenBytes::SentencePiece
        };
        let tokens = tokens_by_id(&inner).map_err(|what| Error::Tokenizer(format!("{}: {what}", path.display())))?;
        let n = tokens.len();
        let mut special = vec![false; n];
        for (id, t) in inner.get_added_tokens_decoder() {
            if let Some(s) = special.get_mut(id as usize) {
                *s = t.special;
            }
        }
        let dir = path.parent().unwrap_or(Path::new("."));
        let read_json = |name: &str| -> Result<Option<serde_json::Value>> {
            let p = dir.join(name);
            match std::fs::read_to_string(&p) {
                Ok(t) => serde_json::from_str(&t)
                    .map(Some)
                    .map_err(|e| Error::Tokenizer(format!("{}: {e}", p.display()))),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(Error::io(p, e)),
            }
        };
        let tcfg = read_json("tokenizer_config.json")?.unwrap_or_default();
        let mcfg = read_json("config.json")?.unwrap_or_default();
        let gcfg = read_json("generation_config.json")?.unwrap_or_default();
        // `"eos_token": "<|im_end|>"` or `{"content": "<|im_end|>", ...}`.
        let named = |k: &str| {
            let v = &tcfg[k];
            v.as_str()
                .or_else(|| v["content"].as_str())
                .and_then(|t| inner.token_to_id(t))
        };
        // `"eos_token_id": 2` or `[128001, 128009]`.
        let numbered = |v: &serde_json::Value| -> Vec<u32> {
            match v {
                serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
                x => x.as_u64().map(|x| x as u32).into_iter().collect(),
            }
        };
        let bos = named("bos_token").or_else(|| numbered(&mcfg["bos_token_id"]).first().copied());
        // Every source of end-of-sequence ids counts (Llama 3 lists end-of-turn only in some).
        let mut eos: Vec<u32> = named("eos_token").into_iter().collect();
        for id in numbered(&mcfg["eos_token_id"])
            .into_iter()
            .chain(numbered(&gcfg["eos_token_id"]))
        {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let template = tcfg["chat_template"].as_str().map(str::to_string);
        Ok(Self::assemble(
            inner,
            &tokens,
            special,
            mapping,
            bos,
            eos,
            template.as_deref(),
        ))
    }

    /// The parts every constructor shares: token bytes, EOS set, chat template.
    fn assemble(
        inner: tokenizers::Tokenizer,
        tokens: &[Option<String>],
        special: Vec<bool>,
        mapping: TokenBytes,
        bos_token_id: Option<u32>,
        eos: Vec<u32>,
        chat_template: Option<&str>,
    ) -> Self {
        let token_bytes: Vec<Box<[u8]>> = tokens
            .iter()
            .zip(&special)
            .map(|(t, &s)| {
                let t = t.as_deref().unwrap_or("");
                if s {
                    t.as_bytes().into()
                } else {
                    mapping.bytes(t).into()
                }
            })
            .collect();

        let id_of = |s: &str| tokens.iter().position(|t| t.as_deref() == Some(s)).map(|i| i as u32);
        let mut eos_token_ids = eos;
        for extra in [IM_END, END_OF_TEXT] {
            if let Some(id) = id_of(extra) {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        let chat_template = match chat_template {
            Some(t) if t.contains(IM_START) && id_of(IM_START).is_some() => ChatTemplate::ChatMl {
                default_system: chatml_default_system(t),
            },
            _ => ChatTemplate::Plain,
        };
        let texts: Vec<String> = inner
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        let special_texts = match texts.is_empty() {
            true => None,
            false => aho_corasick::AhoCorasick::new(&texts).ok(),
        };
        Tokenizer {
            inner,
            inner_text: std::sync::OnceLock::new(),
            special_texts,
            token_bytes: token_bytes.into(),
            special: special.into(),
            bos_token_id,
            eos_token_ids,
            chat_template,
            mapping,
        }
    }

    /// This tokenizer as a package ([`Tokenizer::from_package`] reads it back): what a decoder
    /// publishes in the log so that gateways need no model files.
    pub fn to_package(&self) -> Result<Vec<u8>> {
        let package = Package {
            format: PACKAGE_FORMAT.into(),
            tokenizer: self.canonical_json()?,
            token_bytes: match self.mapping {
                TokenBytes::ByteLevel => "byte_level",
                TokenBytes::SentencePiece => "sentencepiece",
            }
            .into(),
            special: (0..self.special.len() as u32)
                .filter(|&i| self.special[i as usize])
                .collect(),
            bos_token_id: self.bos_token_id,
            eos_token_ids: self.eos_token_ids.clone(),
            chat_format: match self.chat_template {
                ChatTemplate::ChatMl { .. } => "chatml",
                ChatTemplate::Plain => "plain",
            }
            .into(),
            default_system: match &self.chat_template {
                ChatTemplate::ChatMl { default_system } => default_system.clone(),
                ChatTemplate::Plain => None,
            },
        };
        serde_json::to_vec(&package).map_err(|e| Error::Tokenizer(format!("encoding the tokenizer package: {e}")))
    }

    /// Reads a package made by [`Tokenizer::to_package`], and checks it against the tokenizer
    /// digest it was published under: the result's [`crate::identity::tokenizer_sha256`] must be
    /// `tokenizer_sha256`, or the package is refused.
    pub fn from_package(bytes: &[u8], tokenizer_sha256: &str) -> Result<Self> {
        let bad = |what: String| Error::Tokenizer(format!("tokenizer package {tokenizer_sha256}: {what}"));
        let p: Package = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        if p.format != PACKAGE_FORMAT {
            return Err(bad(format!(
                "format {:?}, this build reads {PACKAGE_FORMAT:?}",
                p.format
            )));
        }
        let digest = crate::identity::sha256_hex(p.tokenizer.as_bytes());
        if digest != tokenizer_sha256 {
            return Err(bad(format!("its tokenizer hashes to {digest}")));
        }
        let mapping = match p.token_bytes.as_str() {
            "byte_level" => TokenBytes::ByteLevel,
            "sentencepiece" => TokenBytes::SentencePiece,
            other => return Err(bad(format!("unknown token bytes mapping {other:?}"))),
        };
        let inner = tokenizers::Tokenizer::from_str(&p.tokenizer).map_err(|e| bad(e.to_string()))?;
        let tokens = tokens_by_id(&inner).map_err(bad)?;
        let n = tokens.len();
        let mut special = vec![false; n];
        for id in p.special {
            *special
                .get_mut(id as usize)
                .ok_or_else(|| bad(format!("special token {id} is outside the vocabulary")))? = true;
        }
        if let Some(id) = p
            .eos_token_ids
            .iter()
            .chain(&p.bos_token_id)
            .find(|&&id| id as usize >= n)
        {
            return Err(bad(format!("token {id} is outside the vocabulary")));
        }
        let chat_template = match p.chat_format.as_str() {
            "chatml" => ChatTemplate::ChatMl {
                default_system: p.default_system,
            },
            "plain" => ChatTemplate::Plain,
            other => return Err(bad(format!("unknown chat format {other:?}"))),
        };
        let mut t = Self::assemble(inner, &tokens, special, mapping, p.bos_token_id, p.eos_token_ids, None);
        t.chat_template = chat_template;
        Ok(t)
    }

    /// The underlying `tokenizers` pipeline.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Ids that end a generation: the model's EOS ids (GGUF: the file's; a folder: the
    /// tokenizer config's, then config.json's and generation_config.json's), plus `<|im_end|>`
    /// and `<|endoftext|>` when the vocabulary has them. First entry is the model's own EOS.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn chat_template(&self) -> &ChatTemplate {
        &self.chat_template
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Raw bytes of one token (special tokens: their literal text).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(|b| &b[..])
    }

    /// Text to ids. Special-token strings inside `text` become their special ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(Error::tokenizer)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids to text; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(Error::tokenizer)
    }

    /// The prompt text for `messages`, ending where the assistant's answer starts.
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> String {
        let mut out = String::new();
        match &self.chat_template {
            ChatTemplate::ChatMl { default_system } => {
                let has_system = messages.first().is_some_and(|m| m.role == "system");
                if let (false, Some(system)) = (has_system, default_system) {
                    push_chatml(&mut out, "system", system);
                }
                for m in messages {
                    push_chatml(&mut out, &m.role, &m.content);
                }
                out.push_str(IM_START);
                out.push_str("assistant\n");
            }
            ChatTemplate::Plain => {
                for m in messages {
                    out.push_str(&m.content);
                    out.push('\n');
                }
            }
        }
        out
    }

    /// Text to ids, special-token strings in `text` as plain text (`<|im_start|>` typed by
    /// someone stays those characters).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let inner_text = self.inner_text.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc = inner_text.encode(text, false).map_err(Error::tokenizer)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Prompt token ids for `messages`: [`Tokenizer::apply_chat_template`]'s text encoded whole,
    /// unless a message contains a special token's text: then the template's own text (turn
    /// markers) is encoded with its special tokens and what the messages say as plain text
    /// ([`Tokenizer::encode_text`]), so that a message cannot close its turn and open one of
    /// another role (`<|im_end|>` + `<|im_start|>system` inside a user's content used to become
    /// those control tokens). Only then: encoded in pieces, a turn marker's newline and the
    /// spaces that start a message are no longer one token, so ordinary prompts keep the ids
    /// they always had.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let text = self.apply_chat_template(messages);
        if !messages.iter().any(|m| self.has_special_text(&m.content)) {
            return self.encode(&text);
        }
        match &self.chat_template {
            ChatTemplate::ChatMl { default_system } => {
                let has_system = messages.first().is_some_and(|m| m.role == "system");
                let default = match (has_system, default_system) {
                    (false, Some(system)) => Some(("system", system.as_str())),
                    _ => None,
                };
                let turns = default
                    .into_iter()
                    .chain(messages.iter().map(|m| (m.role.as_str(), m.content.as_str())));
                let mut ids = Vec::new();
                let mut markup = String::new();
                for (role, content) in turns {
                    markup.push_str(IM_START);
                    markup.push_str(role);
                    markup.push('\n');
                    ids.extend(self.encode(&markup)?);
                    markup.clear();
                    ids.extend(self.encode_text(content)?);
                    markup.push_str(IM_END);
                    markup.push('\n');
                }
                markup.push_str(IM_START);
                markup.push_str("assistant\n");
                ids.extend(self.encode(&markup)?);
                Ok(ids)
            }
            ChatTemplate::Plain => self.encode_text(&text),
        }
    }

    /// Whether `s` contains a string the pipeline turns into a special token (`<|im_start|>`,
    /// ...): one pass over `s` whatever the number of special tokens.
    fn has_special_text(&self, s: &str) -> bool {
        self.special_texts.as_ref().is_some_and(|a| a.is_match(s))
    }

    /// A fresh incremental detokenizer over this vocabulary.
    pub fn detokenizer(&self, skip_special: bool) -> IncrementalDetokenizer {
        IncrementalDetokenizer::new(self.token_bytes.clone(), self.special.clone(), skip_special)
    }

    /// Canonical serialization of the tokenizer (the `tokenizers` JSON, compact), the input of
    /// the tokenizer digest in [`crate::ModelIdentity`].
    pub fn canonical_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(Error::tokenizer)
    }
}

/// Every token's string by id (added tokens too), or what is wrong: an id below the vocabulary
/// size without a token.
fn tokens_by_id(inner: &tokenizers::Tokenizer) -> std::result::Result<Vec<Option<String>>, String> {
    let n = inner.get_vocab_size(true);
    let mut tokens: Vec<Option<String>> = vec![None; n];
    for (t, id) in inner.get_vocab(true) {
        if let Some(slot) = tokens.get_mut(id as usize) {
            *slot = Some(t);
        }
    }
    match tokens.iter().position(Option::is_none) {
        Some(missing) => Err(format!(
            "the vocabulary has no token with id {missing} below its size {n}"
        )),
        None => Ok(tokens),
    }
}

fn push_chatml(out: &mut String, role: &str, content: &str) {
    out.push_str(IM_START);
    out.push_str(role);
    out.push('\n');
    out.push_str(content);
    out.push_str(IM_END);
    out.push('\n');
}

/// The system prompt a ChatML jinja template inserts when none is given, if it has one literal:
/// the text between `<|im_start|>system` + newline and the next `<|im_end|>`.
fn chatml_default_system(template: &str) -> Option<String> {
    let marker = format!("{IM_START}system");
    let start = template.find(&marker)? + marker.len();
    let rest = &template[start..];
    let rest = rest.strip_prefix('\n').or_else(|| rest.strip_prefix("\\n"))?;
    let end = rest.find(IM_END)?;
    Some(rest[..end].to_string())
}

fn spec_from_gguf(md: &GgufMetadata) -> Result<TokenizerSpec> {
    let get = |k: &str| {
        md.get(k)
            .ok_or_else(|| Error::Unsupported(format!("GGUF metadata has no {k}")))
    };
    let text = |k: &str| -> Result<String> {
        get(k)?
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| Error::Unsupported(format!("GGUF metadata {k} is not a string")))
    };
    let array = |k: &str| -> Result<&[MetaValue]> {
        get(k)?
            .as_array()
            .ok_or_else(|| Error::Unsupported(format!("GGUF metadata {k} is not an array")))
    };
    let model = text("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(Error::Unsupported(format!(
            "tokenizer.ggml.model = {model:?}; only byte-level BPE (gpt2) is supported"
        )));
    }
    let strings = |k: &str| -> Result<Vec<String>> {
        array(k)?
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| Error::Unsupported(format!("GGUF metadata {k} holds a non-string")))
            })
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let token_types = match md.get("tokenizer.ggml.token_type") {
        Some(_) => array("tokenizer.ggml.token_type")?
            .iter()
            .map(|t| {
                t.to_i32()
                    .ok_or_else(|| Error::Unsupported("GGUF token types are not integers".into()))
            })
            .collect::<Result<Vec<i32>>>()?,
        None => vec![TOKEN_TYPE_NORMAL; tokens.len()],
    };
    let merges = strings("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| Error::Tokenizer(format!("merge without a space: {m:?}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let id = |k: &str| md.get(k).and_then(MetaValue::to_u32);
    Ok(TokenizerSpec {
        tokens,
        token_types,
        merges,
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_id: id("tokenizer.ggml.eos_token_id"),
        chat_template: md
            .get("tokenizer.chat_template")
            .and_then(MetaValue::as_str)
            .map(str::to_string),
    })
}

/// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the other 68
/// bytes for the code points 256.. in byte order.
pub fn byte_level_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next_extra = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            b as char
        } else {
            let c = char::from_u32(next_extra).expect("code points 256..324 are chars");
            next_extra += 1;
            c
        };
    }
    table
}

/// Whether a `tokenizer.json` pre-tokenizer or decoder (possibly a `Sequence`) is byte-level.
fn uses_byte_level(v: &serde_json::Value) -> bool {
    v["type"] == "ByteLevel"
        || ["pretokenizers", "decoders"]
            .iter()
            .filter_map(|k| v[*k].as_array())
            .flatten()
            .any(uses_byte_level)
}

/// How a vocabulary spells a token's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenBytes {
    /// GPT-2 byte-level: every byte is one character of [`byte_level_alphabet`].
    ByteLevel,
    /// SentencePiece: text with `▁` for a space; byte-fallback tokens `<0xNN>`.
    SentencePiece,
}

impl TokenBytes {
    fn bytes(self, token: &str) -> Vec<u8> {
        match self {
            TokenBytes::ByteLevel => byte_level_to_bytes(token),
            TokenBytes::SentencePiece => {
                let hex = token
                    .strip_prefix("<0x")
                    .and_then(|r| r.strip_suffix('>'))
                    .filter(|h| h.len() == 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => vec![b],
                    None => token.replace('\u{2581}', " ").into_bytes(),
                }
            }
        }
    }
}

/// Byte-level token text (`Ġhello`) to its raw bytes (` hello`). Characters outside the
/// alphabet (never in a well-formed vocabulary) keep their UTF-8 bytes.
fn byte_level_to_bytes(token: &str) -> Vec<u8> {
    thread_local! {
        static INVERSE: HashMap<char, u8> = byte_level_alphabet()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
    }
    INVERSE.with(|inv| {
        let mut out = Vec::with_capacity(token.len());
        for c in token.chars() {
            match inv.get(&c) {
                Some(&b) => out.push(b),
                None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection() {
        let t = byte_level_alphabet();
        let set: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(byte_level_to_bytes("Ġhello"), b" hello");
    }

    /// What a tokenizer does, compared field by field.
    fn assert_same(a: &Tokenizer, b: &Tokenizer) {
        assert_eq!(a.canonical_json().unwrap(), b.canonical_json().unwrap());
        assert_eq!(a.token_bytes, b.token_bytes);
        assert_eq!(a.special, b.special);
        assert_eq!(a.bos_token_id, b.bos_token_id);
        assert_eq!(a.eos_token_ids, b.eos_token_ids);
        assert_eq!(a.chat_template, b.chat_template);
        let text = "<|im_start|>user\nHé, 12 ünïcødé 😀<|im_end|>";
        assert_eq!(a.encode(text).unwrap(), b.encode(text).unwrap());
    }

    #[test]
    fn a_package_reads_back_as_the_same_tokenizer_and_is_checked_against_its_digest() {
        let t = crate::fake::fake_tokenizer().unwrap();
        let digest = crate::identity::tokenizer_sha256(&t).unwrap();
        let package = t.to_package().unwrap();
        assert_same(&Tokenizer::from_package(&package, &digest).unwrap(), &t);
        // Another digest, a changed vocabulary, garbage, another format: refused with a reason.
        let e = Tokenizer::from_package(&package, &"0".repeat(64))
            .unwrap_err()
            .to_string();
        assert!(e.contains("hashes to"), "{e}");
        let mut p: Package = serde_json::from_slice(&package).unwrap();
        p.tokenizer = p.tokenizer.replacen("\"a\"", "\"b\"", 1);
        let e = Tokenizer::from_package(&serde_json::to_vec(&p).unwrap(), &digest).unwrap_err();
        assert!(e.to_string().contains("hashes to"), "{e}");
        assert!(Tokenizer::from_package(b"\x00garbage", &digest).is_err());
        let mut p: Package = serde_json::from_slice(&package).unwrap();
        p.format = "tokenlog-tokenizer/9".into();
        let e = Tokenizer::from_package(&serde_json::to_vec(&p).unwrap(), &digest).unwrap_err();
        assert!(e.to_string().contains("this build reads"), "{e}");
        let mut p: Package = serde_json::from_slice(&package).unwrap();
        p.special.push(1_000_000);
        let e = Tokenizer::from_package(&serde_json::to_vec(&p).unwrap(), &digest).unwrap_err();
        assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    }

    #[test]
    fn default_system_is_read_from_template() {
        let t = "{{ '<|im_start|>system\nYou are X<|im_end|>\n' }}";
        assert_eq!(chatml_default_system(t).as_deref(), Some("You are X"));
        let t = "{{ '<|im_start|>system\\nYou are Y<|im_end|>\\n' }}";
        assert_eq!(chatml_default_system(t).as_deref(), Some("You are Y"));
        assert_eq!(chatml_default_system("{{ messages }}"), None);
    }
}
