//! Model definitions: the config every architecture family is described by,
//! the batch input of a forward pass, and the loaded [`Model`].
//!
//! There is ONE forward implementation per architecture family: `llama.rs`
//! serves both `llama` and `qwen2` (qwen2 is llama with q/k/v biases and
//! neox-style RoPE); `deepseek.rs` serves the DeepSeek-V3 layout (model
//! types `deepseek_v3` and `kimi_k2`: latent attention + mixture of
//! experts). Loading lives in `loader.rs` (the DeepSeek family's sharded
//! safetensors loading in `deepseek.rs`).

mod deepseek;
mod llama;
mod loader;

use crate::error::{Result, VerifyError};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Tensor};
use std::sync::Arc;

pub use deepseek::MlaPrefill;
pub use loader::{
    config_from_hf_json, load_gguf, load_model, load_safetensors, load_safetensors_shard,
    read_gguf_content,
};

/// Architecture family of a model; decides the tensor layout and forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    /// DeepSeek-V3 layout (Kimi K2 ships it as `kimi_k2`): multi-head
    /// latent attention and mixture-of-experts layers; needs
    /// [`ModelConfig::mla`].
    DeepseekV3,
}

impl Arch {
    /// Parses the GGUF `general.architecture` / HF `model_type` name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "deepseek_v3" | "kimi_k2" => Ok(Arch::DeepseekV3),
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

/// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) shape, in the
/// config.json names.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    /// Rank of the low-rank query (`q_a_proj` -> norm -> `q_b_proj`);
    /// `None` means a full-rank `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Width of the compressed KV latent the cache stores.
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    /// Width of the decoupled RoPE key shared by all heads (cached too).
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

/// Mixture-of-experts layers of the DeepSeek-V3 family (sigmoid router with
/// a selection-only score correction, group-limited top-k).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// Shared experts, run for every token as one MLP of
    /// `n_shared_experts * moe_intermediate_size`.
    pub n_shared_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    /// Layers `0..first_k_dense_replace` use a dense MLP of
    /// `intermediate_size`; the rest are MoE.
    pub first_k_dense_replace: usize,
}

/// YaRN RoPE scaling (`rope_scaling.type = "yarn"`), as transformers
/// computes it: blended inverse frequencies, cos/sin scaled by an attention
/// factor, and the softmax scale multiplied by `mscale(factor,
/// mscale_all_dim)^2`.
#[derive(Debug, Clone, PartialEq)]
pub struct YarnConfig {
    pub factor: f64,
    pub original_max_position: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
    /// Explicit `attention_factor`, overriding the one derived from mscale.
    pub attention_factor: Option<f64>,
}

/// Shape and numerics of a model.
///
/// Invariants (checked by [`ModelConfig::validate`]): `num_heads` is a
/// multiple of `num_kv_heads`, `head_dim` is even, all sizes are non-zero;
/// `mla`, `moe` and `yarn` only for [`Arch::DeepseekV3`], which needs `mla`.
/// For DeepseekV3, `head_dim` is `qk_nope_head_dim + qk_rope_head_dim` and
/// `num_kv_heads == num_heads` (what the latent expands to).
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
    // Boxed: a config is embedded in every `Model` and should stay small.
    /// Latent attention (DeepseekV3 family).
    pub mla: Option<Box<MlaConfig>>,
    /// Mixture of experts (DeepseekV3 family); `None`: every layer dense.
    pub moe: Option<Box<MoeConfig>>,
    /// YaRN RoPE scaling (DeepseekV3 family).
    pub yarn: Option<Box<YarnConfig>>,
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
        if self.arch == Arch::DeepseekV3 {
            deepseek::validate(self)
        } else if self.mla.is_some() || self.moe.is_some() || self.yarn.is_some() {
            bad(format!(
                "latent attention, experts and YaRN are DeepseekV3-family only, not {:?}",
                self.arch
            ))
        } else {
            Ok(())
        }
    }

    /// Bytes one token occupies in a [`crate::KvPool`], all layers: K plus V
    /// per KV head, or for latent attention the compressed latent plus the
    /// RoPE key (`kv_lora_rank + qk_rope_head_dim` values per layer).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.num_layers * self.kv_floats_per_token_layer() * std::mem::size_of::<f32>()
    }

    /// Cached floats per token per layer.
    pub(crate) fn kv_floats_per_token_layer(&self) -> usize {
        match &self.mla {
            Some(m) => m.kv_lora_rank + m.qk_rope_head_dim,
            None => 2 * self.num_kv_heads * self.head_dim,
        }
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
    weight: QMatMul,
    bias: Option<Tensor>,
}

impl Linear {
    pub(crate) fn new(weight: QMatMul, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    /// Batch-invariant: row r of the result depends only on row r of `x`,
    /// bit for bit, whatever the other rows and however many there are.
    /// Speculative verification (k+1 rows) then scores tokens exactly as
    /// plain decoding (1 row) does, so greedy output is identical with and
    /// without speculation. candle's kernels are row-independent except its
    /// single-row Q6_K kernel, which rounds differently from the multi-row
    /// one; a single Q6_K row is therefore padded to two.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let single_q6k = matches!(&self.weight, QMatMul::QTensor(q) if q.dtype() == GgmlDType::Q6K)
            && x.dim(0)? == 1;
        let y = if single_q6k {
            let padded = Tensor::cat(&[x, x], 0)?;
            self.weight.forward(&padded)?.narrow(0, 0, 1)?
        } else {
            self.weight.forward(x)?
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
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

/// The llama family's weights.
pub(crate) struct LlamaWeights {
    pub(crate) embed: Embedding,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: Linear,
}

/// The weights of one architecture family; each has its one forward.
pub(crate) enum Body {
    Llama(LlamaWeights),
    Deepseek(Box<deepseek::Weights>),
}

/// A loaded model: config plus weights. Immutable once loaded, so one model
/// can serve many sequences; all per-sequence state lives in a [`crate::KvPool`].
pub struct Model {
    pub(crate) cfg: ModelConfig,
    pub(crate) body: Body,
    /// Bytes of weights a single decode step reads (for bandwidth figures).
    pub(crate) weight_bytes: usize,
}

impl Model {
    /// The model's shape and numerics.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Bytes of weights one decode step streams from memory: every matrix
    /// once (for mixture-of-experts layers: the experts one token uses),
    /// plus one embedding row.
    pub fn weight_bytes_per_step(&self) -> usize {
        self.weight_bytes
    }

    /// Chooses how a latent-attention model attends prompt chunks that
    /// start at position 0 (see [`MlaPrefill`]).
    ///
    /// Errors: the model has no latent attention.
    pub fn set_mla_prefill(&mut self, mode: MlaPrefill) -> Result<()> {
        match &mut self.body {
            Body::Deepseek(w) => {
                w.set_prefill(mode);
                Ok(())
            }
            Body::Llama(_) => Err(VerifyError::BadConfig(
                "MLA prefill mode on a model without latent attention".into(),
            )),
        }
    }
}
