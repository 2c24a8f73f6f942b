//! Model definitions: the config every architecture family is described by,
//! the batch input of a forward pass, and the loaded [`Model`].
//!
//! There is ONE forward implementation per architecture family: `llama.rs`
//! serves both `llama` and `qwen2` (qwen2 is llama with q/k/v biases and
//! neox-style RoPE). Loading lives in `loader.rs`.

mod llama;
mod loader;

use crate::error::{Result, VerifyError};
use crate::kernels::{self, QWeight};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Tensor};
use std::sync::Arc;

pub use loader::{config_from_hf_json, load_gguf, load_model, load_safetensors, read_gguf_content};

/// Architecture family of a model; decides the tensor layout and forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
}

impl Arch {
    /// Parses the GGUF `general.architecture` / HF `model_type` name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            other => Err(VerifyError::UnknownArchitecture(other.to_string())),
        }
    }
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs (2i, 2i+1): llama weights as converted to GGUF by llama.cpp.
    Interleaved,
    /// Pairs (i, i + d/2): Hugging Face layout and qwen2 everywhere.
    Neox,
}

/// Shape and numerics of a llama-family model.
///
/// Invariants (checked by [`ModelConfig::validate`]): `num_heads` is a
/// multiple of `num_kv_heads`, `head_dim` is even, all sizes are non-zero.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    /// Longest sequence (prompt + output) the model was trained for.
    pub max_position: usize,
}

impl ModelConfig {
    /// Rejects configs the forward pass cannot run.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(VerifyError::BadConfig(m));
        if [
            self.vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.max_position,
        ]
        .contains(&0)
        {
            return bad(format!("zero-sized dimension in {self:?}"));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} attention heads are not a multiple of {} KV heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} is odd", self.head_dim));
        }
        Ok(())
    }

    /// Bytes of K plus V one token occupies in a [`crate::KvPool`], all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.num_layers * 2 * self.num_kv_heads * self.head_dim * std::mem::size_of::<f32>()
    }
}

/// Which logit rows a sequence wants back from a forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the prompt's end).
    None,
    /// Only the last new token's (plain decoding, end of prefill).
    Last,
    /// Every new token's (speculative verification: k+1 rows).
    All,
}

impl LogitsWanted {
    fn rows(self, n: usize) -> std::ops::Range<usize> {
        match self {
            LogitsWanted::None => 0..0,
            LogitsWanted::Last => n.saturating_sub(1)..n,
            LogitsWanted::All => 0..n,
        }
    }
}

/// One sequence's part of a forward batch: a run of new tokens at
/// consecutive positions `start_pos..start_pos + tokens.len()`.
///
/// Invariants the caller keeps (checked, an error otherwise): the positions
/// `0..start_pos` of this sequence are already in the pool through the same
/// block table, and `block_table` holds enough blocks for every new position.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub block_table: &'a [u32],
    pub logits: LogitsWanted,
}

/// A linear layer: quantized (GGUF) or dense, with an optional bias.
pub(crate) struct Linear {
    weight: LinearWeight,
    bias: Option<Tensor>,
}

enum LinearWeight {
    /// Our kernels (crate::kernels) for the formats they implement.
    Native(QWeight),
    /// candle's matmul: dense weights, other formats, or when
    /// [`kernels::Backend::Candle`] was chosen.
    Candle(QMatMul),
}

impl Linear {
    /// Picks our kernels when the backend is native and the format is one
    /// of theirs, candle otherwise.
    pub(crate) fn new(weight: QMatMul, bias: Option<Tensor>) -> Self {
        let weight = match &weight {
            QMatMul::QTensor(q) if kernels::backend() == kernels::Backend::Native => {
                match QWeight::new(q.clone()) {
                    Some(w) => LinearWeight::Native(w),
                    None => LinearWeight::Candle(weight),
                }
            }
            _ => LinearWeight::Candle(weight),
        };
        Self { weight, bias }
    }

    /// Batch-invariant: row r of the result depends only on row r of `x`,
    /// bit for bit, whatever the other rows and however many there are.
    /// Speculative verification (k+1 rows) then scores tokens exactly as
    /// plain decoding (1 row) does, so greedy output is identical with and
    /// without speculation. Our kernels are so by construction; candle's
    /// are row-independent except its single-row Q6_K kernel, which rounds
    /// differently from the multi-row one, so a single Q6_K row is padded
    /// to two there.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.weight {
            LinearWeight::Native(w) => native_forward(w, x)?,
            LinearWeight::Candle(q) => {
                let single_q6k = matches!(q, QMatMul::QTensor(t) if t.dtype() == GgmlDType::Q6K)
                    && x.dim(0)? == 1;
                if single_q6k {
                    let padded = Tensor::cat(&[x, x], 0)?;
                    q.forward(&padded)?.narrow(0, 0, 1)?
                } else {
                    q.forward(x)?
                }
            }
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// `x (rows x k) @ w^T` through our kernels, reading `x` in place.
fn native_forward(w: &QWeight, x: &Tensor) -> Result<Tensor> {
    let (rows, k) = x.dims2()?;
    if k != w.k() {
        return Err(VerifyError::BadBatch(format!(
            "linear layer of {} inputs fed rows of {k}",
            w.k()
        )));
    }
    let x = x.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let mut out = vec![0f32; rows * w.n()];
    {
        let (storage, layout) = x.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Err(candle_core::Error::Msg("quantized linear needs CPU tensors".into()).into());
        };
        let data = &cpu.as_slice::<f32>()?[layout.start_offset()..][..rows * k];
        w.matmul(data, rows, &mut out);
    }
    Ok(Tensor::from_vec(out, (rows, w.n()), x.device())?)
}

/// Token embedding table, kept quantized when the file stores it so.
pub(crate) enum Embedding {
    Quantized(Arc<QTensor>),
    Dense(Tensor),
}

impl Embedding {
    pub(crate) fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Embedding::Quantized(q) => q.embedding(ids)?,
            Embedding::Dense(t) => t.index_select(ids, 0)?,
        })
    }
}

/// One transformer block's weights.
pub(crate) struct Layer {
    pub(crate) attn_norm: Tensor,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) ffn_norm: Tensor,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// A loaded model: config plus weights. Immutable once loaded, so one model
/// can serve many sequences; all per-sequence state lives in a [`crate::KvPool`].
pub struct Model {
    pub(crate) cfg: ModelConfig,
    pub(crate) embed: Embedding,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: Linear,
    /// Bytes of weights a single decode step reads (for bandwidth figures).
    pub(crate) weight_bytes: usize,
}

impl Model {
    /// The model's shape and numerics.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Bytes of weights one decode step streams from memory: every matrix
    /// once, plus one embedding row.
    pub fn weight_bytes_per_step(&self) -> usize {
        self.weight_bytes
    }
}
