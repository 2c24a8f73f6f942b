//! Model definitions: the config every architecture family is described by,
//! the batch input of a forward pass, and the loaded [`Model`].
//!
//! There is ONE forward implementation per architecture family: `llama.rs`
//! serves both `llama` and `qwen2` (qwen2 is llama with q/k/v biases and
//! neox-style RoPE); `deepseek/` serves the DeepSeek-V3 layout (model
//! types `deepseek_v3` and `kimi_k2`: latent attention + mixture of
//! experts). Loading lives in `loader.rs`, llama-family tensor-parallel
//! sharding in `shard.rs` (the DeepSeek family's sharded safetensors
//! loading in `deepseek/load.rs`).

mod deepseek;
mod llama;
mod loader;
mod ops;
mod ranks;
mod shard;

use crate::error::{Result, VerifyError};
use crate::kernels::{self, QWeight};
use crate::tp::{Communicator, LocalComm, ThreadComm};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Tensor};
use std::ops::Range;
use std::sync::{Arc, Mutex};

pub use deepseek::MlaPrefill;
pub use loader::{
    config_from_hf_json, load_gguf, load_gguf_tp, load_model, load_model_tp, load_safetensors,
    load_safetensors_shard, load_safetensors_tp, read_gguf_content,
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

/// Reads a token list for [`Model::restrict_head`]: one id per line; empty
/// lines and lines starting with `#` are skipped.
///
/// Errors: unreadable file, or a line that is not a token id (named with
/// its line number).
pub fn read_token_list(path: &std::path::Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).map_err(|source| VerifyError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut ids = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        ids.push(line.parse().map_err(|_| {
            VerifyError::BadConfig(format!(
                "{} line {}: '{line}' is not a token id",
                path.display(),
                i + 1
            ))
        })?);
    }
    Ok(ids)
}

/// A linear layer: quantized (GGUF) or dense, with an optional bias.
pub(crate) struct Linear {
    weight: LinearWeight,
    bias: Option<Vec<f32>>,
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
    ///
    /// Errors: a bias that cannot be read as f32 values.
    pub(crate) fn new(weight: QMatMul, bias: Option<Tensor>) -> Result<Self> {
        let weight = match &weight {
            QMatMul::QTensor(q) if kernels::backend() == kernels::Backend::Native => {
                match QWeight::new(q.clone()) {
                    Some(w) => LinearWeight::Native(w),
                    None => LinearWeight::Candle(weight),
                }
            }
            _ => LinearWeight::Candle(weight),
        };
        let bias = bias
            .map(|b| {
                b.to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()
            })
            .transpose()?;
        Ok(Self { weight, bias })
    }

    /// Batch-invariant: row r of the result depends only on row r of `x`,
    /// bit for bit, whatever the other rows and however many there are.
    /// Speculative verification (k+1 rows) then scores tokens exactly as
    /// plain decoding (1 row) does, so greedy output is identical with and
    /// without speculation. Our kernels are so by construction; candle's
    /// are row-independent except its single-row Q6_K kernel, which rounds
    /// differently from the multi-row one, so a single Q6_K row is padded
    /// to two there.
    ///
    /// [`forward_into`](Linear::forward_into) on a `(rows, k)` tensor.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (rows, _) = x.dims2()?;
        let xs = x
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let n = self.out_features()?;
        let mut out = vec![0f32; rows * n];
        self.forward_into(&xs, rows, &mut out)?;
        Ok(Tensor::from_vec(out, (rows, n), x.device())?)
    }
}

/// candle's matmul of `x (rows x k)`, without bias; a single Q6_K row is
/// padded to two (see [`Linear::forward`]).
fn candle_forward(q: &QMatMul, x: &Tensor) -> Result<Tensor> {
    let single_q6k =
        matches!(q, QMatMul::QTensor(t) if t.dtype() == GgmlDType::Q6K) && x.dim(0)? == 1;
    Ok(if single_q6k {
        let padded = Tensor::cat(&[x, x], 0)?;
        q.forward(&padded)?.narrow(0, 0, 1)?
    } else {
        q.forward(x)?
    })
}

impl Linear {
    /// Output features.
    pub(crate) fn out_features(&self) -> Result<usize> {
        Ok(match &self.weight {
            LinearWeight::Native(w) => w.n(),
            LinearWeight::Candle(QMatMul::QTensor(t)) => t.shape().dims()[0],
            LinearWeight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => t.dims2()?.0,
        })
    }

    fn add_bias(&self, out: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in out.chunks_exact_mut(b.len()) {
                ops::add_in_place(row, b);
            }
        }
    }

    /// `out (rows x n) = x (rows x k) @ W^T + b` on plain slices; the same
    /// numbers as [`Linear::forward`].
    ///
    /// Errors: `x` or `out` of the wrong length for `rows`.
    pub(crate) fn forward_into(&self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        forward_many(&[self], x, rows, &mut [out])
    }
}

/// Several layers applied to the same input `x` (`rows x k`) into `outs`
/// (one `rows x n` slice per layer). When every layer runs on our kernels
/// they go through one [`kernels::matmul_many`] pass (one quantization of
/// `x`, one wake-up of the thread pool); otherwise one by one. Results are
/// the same either way, bit for bit.
///
/// Errors: as many outputs as layers not given, or `x` or an output of the
/// wrong length for `rows`.
pub(crate) fn forward_many(
    layers: &[&Linear],
    x: &[f32],
    rows: usize,
    outs: &mut [&mut [f32]],
) -> Result<()> {
    let bad = |what: String| VerifyError::BadBatch(what);
    if layers.len() != outs.len() {
        return Err(bad(format!(
            "{} layers for {} outputs",
            layers.len(),
            outs.len()
        )));
    }
    if rows == 0 && x.is_empty() && outs.iter().all(|o| o.is_empty()) {
        return Ok(());
    }
    if rows == 0 || !x.len().is_multiple_of(rows) {
        return Err(bad(format!("{} inputs for {rows} rows", x.len())));
    }
    for (l, o) in layers.iter().zip(outs.iter()) {
        if o.len() != rows * l.out_features()? {
            return Err(bad(format!("an output of {} for {rows} rows", o.len())));
        }
    }
    let k = x.len() / rows;
    let native: Option<Vec<&QWeight>> = layers
        .iter()
        .map(|l| match &l.weight {
            LinearWeight::Native(w) if w.k() == k => Some(w),
            _ => None,
        })
        .collect();
    match native {
        Some(ws) => {
            let mut products: Vec<kernels::Product> = ws
                .into_iter()
                .zip(outs.iter_mut())
                .map(|(w, out)| kernels::Product { w, out })
                .collect();
            kernels::matmul_many(x, rows, &mut products);
        }
        None => {
            let xt = Tensor::from_slice(x, (rows, k), &candle_core::Device::Cpu)?;
            for (l, o) in layers.iter().zip(outs.iter_mut()) {
                let y = match &l.weight {
                    LinearWeight::Native(w) => {
                        return Err(bad(format!(
                            "linear layer of {} inputs fed rows of {k}",
                            w.k()
                        )))
                    }
                    LinearWeight::Candle(q) => candle_forward(q, &xt)?,
                };
                o.copy_from_slice(&y.flatten_all()?.to_vec1::<f32>()?);
            }
        }
    }
    for (l, o) in layers.iter().zip(outs.iter_mut()) {
        l.add_bias(o);
    }
    Ok(())
}

impl Linear {
    /// A layer computing only output features `rows` (in that order), with
    /// the same backend choice as [`Linear::new`]. Each kept feature's
    /// weights are copied unchanged, so with our kernels (every output
    /// column computed alone) its outputs equal the full layer's bit for bit.
    pub(crate) fn select_rows(&self, rows: &[u32]) -> Result<Linear> {
        let idx = Tensor::new(rows, &candle_core::Device::Cpu)?;
        let outside = |e: String| VerifyError::BadConfig(format!("output head: {e}"));
        let weight = match &self.weight {
            LinearWeight::Native(w) => {
                let bytes = w.gguf_rows(rows).map_err(outside)?;
                quantized_matrix(w.format().dtype(), &bytes, rows.len(), w.k())?
            }
            LinearWeight::Candle(QMatMul::QTensor(t)) => {
                let &[n, k] = t.shape().dims() else {
                    return Err(VerifyError::BadConfig("output head is not a matrix".into()));
                };
                let data = t.data()?;
                let row_bytes = data.len() / n;
                let mut bytes = Vec::with_capacity(rows.len() * row_bytes);
                for &r in rows {
                    let r = r as usize;
                    if r >= n {
                        return Err(outside(format!("row {r} outside a matrix of {n} rows")));
                    }
                    bytes.extend_from_slice(&data[r * row_bytes..(r + 1) * row_bytes]);
                }
                quantized_matrix(t.dtype(), &bytes, rows.len(), k)?
            }
            LinearWeight::Candle(QMatMul::Tensor(t)) => QMatMul::Tensor(t.index_select(&idx, 0)?),
            LinearWeight::Candle(QMatMul::TensorF16(t)) => {
                QMatMul::TensorF16(t.index_select(&idx, 0)?)
            }
        };
        let mut head = Linear::new(weight, None)?;
        // Every row is inside the matrix (the weights' selection checked),
        // and a bias has one value per row.
        head.bias = (self.bias.as_ref()).map(|b| rows.iter().map(|&r| b[r as usize]).collect());
        Ok(head)
    }
}

/// A CPU quantized `(n, k)` matrix from its GGUF block bytes.
fn quantized_matrix(dtype: GgmlDType, bytes: &[u8], n: usize, k: usize) -> Result<QMatMul> {
    let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
        dtype,
        bytes,
        vec![n, k],
        &candle_core::Device::Cpu,
    )?;
    Ok(QMatMul::from_arc(Arc::new(q))?)
}

/// Token embedding table, kept quantized when the file stores it so.
/// Replicated on every rank (cloning shares the storage).
#[derive(Clone)]
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
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// One tensor-parallel rank's part of a model: its query and KV heads of
/// every layer, its slice of every MLP, its rows of the output head, and its
/// end of the rank group. At world size 1 the one shard is the whole model.
pub(crate) struct Shard {
    pub(crate) comm: Box<dyn Communicator>,
    pub(crate) embed: Embedding,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    /// The vocabulary rows `vocab` of the output head.
    pub(crate) lm_head: Linear,
    pub(crate) vocab: Range<usize>,
    /// Query heads of this rank.
    pub(crate) num_heads: usize,
    /// KV heads of this rank (its [`crate::KvPool`] shard holds these).
    pub(crate) num_kv_heads: usize,
}

/// The weights of one architecture family; each has its one forward.
pub(crate) enum Body {
    /// One shard per tensor-parallel rank, in rank order; never empty.
    Llama(Vec<Shard>),
    /// One weights shard per tensor-parallel rank, in rank order; never
    /// empty. (A rank loaded alone by [`load_safetensors_shard`] holds one
    /// shard of a group its caller drives.)
    Deepseek(Vec<deepseek::Weights>),
}

/// A loaded model: config plus weights, as one shard per tensor-parallel
/// rank. Immutable once loaded, so one model can serve many sequences; all
/// per-sequence state lives in a [`crate::KvPool`] built by
/// [`crate::KvPool::for_model`].
///
/// At world size 1 a forward runs inline on the calling thread; at world
/// size N it runs the N shards on N threads (see `llama.rs`) and returns
/// rank 0's logits, which equal world size 1's up to float summation order.
pub struct Model {
    /// The unsharded model's config; per-rank head counts live in the shards.
    pub(crate) cfg: ModelConfig,
    /// The family's weights.
    pub(crate) body: Body,
    /// Bytes of weights a single decode step reads (for bandwidth figures).
    pub(crate) weight_bytes: usize,
    /// When set, `lm_head` computes only these tokens' logits (in this
    /// order) and every other token's logit is -inf ([`Model::restrict_head`]).
    pub(crate) head_tokens: Option<Vec<u32>>,
    /// Bytes of `lm_head` (part of `weight_bytes`).
    pub(crate) lm_bytes: usize,
    /// Held for a whole sharded forward: two forwards at once would
    /// interleave their collectives on the one rank group.
    pub(crate) step: Mutex<()>,
}

impl Model {
    /// Assembles a model from per-rank shards in rank order, connecting them
    /// with a [`LocalComm`] (one shard) or a [`ThreadComm`] group.
    pub(crate) fn from_rank_parts(
        cfg: ModelConfig,
        parts: Vec<RankParts>,
        weight_bytes: usize,
        lm_bytes: usize,
    ) -> Result<Self> {
        let comms: Vec<Box<dyn Communicator>> = if parts.len() == 1 {
            vec![Box::new(LocalComm)]
        } else {
            ThreadComm::group(parts.len())?
                .into_iter()
                .map(|c| Box::new(c) as Box<dyn Communicator>)
                .collect()
        };
        let group = cfg.num_heads / cfg.num_kv_heads;
        let shards = parts
            .into_iter()
            .zip(comms)
            .map(|(p, comm)| Shard {
                comm,
                embed: p.embed,
                layers: p.layers,
                norm: p.norm,
                lm_head: p.lm_head,
                vocab: p.vocab,
                num_heads: p.num_kv_heads * group,
                num_kv_heads: p.num_kv_heads,
            })
            .collect();
        Ok(Self {
            cfg,
            body: Body::Llama(shards),
            weight_bytes,
            head_tokens: None,
            lm_bytes,
            step: Mutex::new(()),
        })
    }

    /// The model's shape and numerics (of the whole, unsharded model).
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Bytes of weights one decode step streams from memory: every matrix
    /// once (for mixture-of-experts layers: the experts one token uses),
    /// plus one embedding row.
    pub fn weight_bytes_per_step(&self) -> usize {
        self.weight_bytes
    }

    /// Restricts the output head to `tokens`: their logits are computed as
    /// before (bit for bit with quantized heads, which our kernels compute
    /// column by column; to float rounding for dense ones), every other token's logit is -inf, so sampling
    /// gives them probability exactly 0. Meant for a draft model: its head
    /// over the full vocabulary is a large part of its step, and the
    /// verifier, which keeps the full vocabulary, keeps decoding lossless
    /// (a token outside the subset is simply never proposed, and the draft
    /// probabilities q are those the draft sampled from, 0 outside).
    ///
    /// Errors: an empty list, a duplicate, a token outside the vocabulary,
    /// or a head restricted already.
    pub fn restrict_head(&mut self, tokens: &[u32]) -> Result<()> {
        let mut seen = vec![false; self.cfg.vocab_size];
        for &t in tokens {
            match seen.get_mut(t as usize) {
                Some(s) if !*s => *s = true,
                Some(_) => return Err(VerifyError::BadConfig(format!("token {t} listed twice"))),
                None => {
                    return Err(VerifyError::BadConfig(format!(
                        "token {t} outside the vocabulary of {}",
                        self.cfg.vocab_size
                    )))
                }
            }
        }
        if tokens.is_empty() {
            return Err(VerifyError::BadConfig("empty head token list".into()));
        }
        if self.head_tokens.is_some() {
            return Err(VerifyError::BadConfig(
                "the head is already restricted".into(),
            ));
        }
        let Body::Llama(shards) = &mut self.body else {
            return Err(VerifyError::BadConfig(
                "a restricted head is implemented for the llama family only".into(),
            ));
        };
        let [shard] = shards.as_mut_slice() else {
            return Err(VerifyError::BadConfig(
                "a restricted head needs an unsharded model (tensor-parallel world size 1)".into(),
            ));
        };
        let head = shard.lm_head.select_rows(tokens)?;
        let per_row = self.lm_bytes / self.cfg.vocab_size;
        self.weight_bytes = self.weight_bytes - self.lm_bytes + per_row * tokens.len();
        self.lm_bytes = per_row * tokens.len();
        shard.lm_head = head;
        self.head_tokens = Some(tokens.to_vec());
        Ok(())
    }

    /// The tokens the head is restricted to, if it is.
    pub fn head_tokens(&self) -> Option<&[u32]> {
        self.head_tokens.as_deref()
    }

    /// Chooses how a latent-attention model attends prompt chunks that
    /// start at position 0 (see [`MlaPrefill`]).
    ///
    /// Errors: the model has no latent attention.
    pub fn set_mla_prefill(&mut self, mode: MlaPrefill) -> Result<()> {
        match &mut self.body {
            Body::Deepseek(ranks) => {
                ranks.iter_mut().for_each(|w| w.set_prefill(mode));
                Ok(())
            }
            Body::Llama(_) => Err(VerifyError::BadConfig(
                "MLA prefill mode on a model without latent attention".into(),
            )),
        }
    }

    /// Number of tensor-parallel ranks this `Model` runs itself (its
    /// shards). A DeepSeek-family rank from [`load_safetensors_shard`] is
    /// one rank of a group its caller drives, so it says 1.
    pub fn world_size(&self) -> usize {
        match &self.body {
            Body::Llama(shards) => shards.len(),
            Body::Deepseek(ranks) => ranks.len(),
        }
    }

    /// Bytes of KV cache one token occupies in a pool from
    /// [`crate::KvPool::for_model`], all ranks together: the model's
    /// [`ModelConfig::kv_bytes_per_token`], once per rank for a latent
    /// cache (every rank keeps its own copy; KV heads split instead).
    pub fn kv_bytes_per_token(&self) -> usize {
        match &self.body {
            Body::Llama(_) => self.cfg.kv_bytes_per_token(),
            Body::Deepseek(ranks) => ranks.len() * self.cfg.kv_bytes_per_token(),
        }
    }

    /// KV heads each rank holds, in rank order (they sum to
    /// `config().num_kv_heads`); the shape of a matching [`crate::KvPool`].
    /// A latent-attention model caches one latent "head" per token on
    /// every rank.
    pub fn kv_heads_per_rank(&self) -> Vec<usize> {
        match &self.body {
            Body::Llama(shards) => shards.iter().map(|s| s.num_kv_heads).collect(),
            Body::Deepseek(ranks) => vec![1; ranks.len()],
        }
    }
}

/// What a loader hands [`Model::from_rank_parts`] for one rank.
pub(crate) struct RankParts {
    pub(crate) embed: Embedding,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: Linear,
    pub(crate) vocab: Range<usize>,
    pub(crate) num_kv_heads: usize,
}
