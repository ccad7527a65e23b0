//! The crate's error type. Variants are the cases a caller acts on differently; everything from a
//! dependency that only needs reporting is carried as text or as its source.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation or model load failed inside candle.
    #[cfg(feature = "model")]
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),

    /// The tokenizer could not be built, or failed to encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("io on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The model file is not one this crate can run (architecture, missing metadata).
    #[error("unsupported model: {0}")]
    Unsupported(String),

    /// The sequence would grow past the model's context window.
    #[error("context full: {needed} positions needed, model holds {max}")]
    ContextFull { needed: usize, max: usize },

    /// A call that breaks the API's rules (empty prefill, token id out of range, ...).
    #[error("invalid argument: {0}")]
    Invalid(String),

    /// A pipeline stage refused one sequence's part of a pass (the others went on).
    #[error("pipeline stage: {0}")]
    Stage(String),

    /// The pipeline as a whole cannot pass anything: a stage could not be reached or broke its
    /// stream, and no spare took its place.
    #[error("pipeline: {0}")]
    Pipeline(String),

    /// Fetching or verifying the default model failed.
    #[error("fetch: {0}")]
    Fetch(String),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn tokenizer(e: impl std::fmt::Display) -> Self {
        Error::Tokenizer(e.to_string())
    }

    /// Whether the error is one sequence's alone (a stage's refusal of its item, its context,
    /// a bad input of its own), so that the others fed beside it went on; not the model's or
    /// the pipeline's as a whole.
    pub fn is_of_one_sequence(&self) -> bool {
        matches!(self, Error::Stage(_) | Error::ContextFull { .. } | Error::Invalid(_))
    }
}
