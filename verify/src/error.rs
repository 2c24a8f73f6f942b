//! Errors of the model runtime, one enum for the crate.

use std::path::PathBuf;

/// Everything that can go wrong loading a model or running it.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "unsupported model architecture '{0}' (supported: llama, qwen2, deepseek_v3, kimi_k2)"
    )]
    UnknownArchitecture(String),
    #[error("model metadata key '{0}' is missing or has the wrong type")]
    MissingMetadata(String),
    #[error("model tensor '{0}' is missing")]
    MissingTensor(String),
    #[error("model tensor '{name}' has shape {got:?}, expected {expected:?}")]
    BadTensorShape {
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("invalid model config: {0}")]
    BadConfig(String),
    #[error(
        "cannot split tensor '{tensor}' over {world} tensor-parallel ranks: {reason}; \
         tensor-parallel sizes that work for this model: {working:?}"
    )]
    ImpossibleSplit {
        tensor: String,
        world: usize,
        reason: String,
        working: Vec<usize>,
    },
    #[error("tensor-parallel rank failed: {0}")]
    RankFailed(String),
    #[error("invalid forward batch: {0}")]
    BadBatch(String),
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, VerifyError>;
