//! Model definitions: the family-neutral core every architecture family is
//! built on, one folder per family, and the loaded [`Model`] that
//! dispatches to its family.
//!
//! Core (names no family): `config.rs` (the config every family is
//! described by), `rows.rs` (the batch input of a forward and its
//! flattening), `linear.rs` (quantized/candle matmul entry, embeddings),
//! `dense.rs` (row-wise f32 matrices), `ops.rs` (per-row operations),
//! `ranks.rs` (running tensor-parallel ranks), `shard.rs` (the ONE
//! tensor-parallel split rule) and `loader.rs` (file reading and the ONE
//! arch -> family loader dispatch).
//!
//! Families, each with its ONE forward, depending only on the core:
//! `llama/` serves both `llama` and `qwen2`; `deepseek/` serves the
//! DeepSeek-V3 layout (model types `deepseek_v3` and `kimi_k2`: latent
//! attention + mixture of experts); `kimi_k3/` serves Kimi K3 (KDA linear
//! attention + gated NoPE MLA, latent MoE, attention residuals); `scripted.rs`
//! is a test double replaying token scripts. This file is the only other place that
//! names them: [`Body`] and the dispatch methods of [`Model`]; and `tree.rs`,
//! token-tree verification in one forward ([`Model::forward_trees`]: the
//! per-row slots and visible slots of a tree, and its dispatch, which only
//! the llama family takes so far).

mod config;
mod deepseek;
mod dense;
mod kimi_k3;
mod linear;
mod llama;
mod loader;
mod mla;
mod moe;
mod ops;
mod pool;
mod ranks;
mod remote;
mod rows;
mod scripted;
mod shard;
mod stored;
mod tree;

use crate::error::{Result, VerifyError};
use crate::kv_pool::{CacheDtype, KvPool};
use candle_core::Tensor;
use std::sync::Mutex;

pub use config::{
    read_token_list, token_list_vocabulary, vocab_fingerprint, Arch, MlaConfig, ModelConfig,
    MoeConfig, RopeStyle, YarnConfig,
};
pub use deepseek::MlaPrefill;
pub use loader::{
    config_from_hf_json, load_gguf, load_gguf_tp, load_model, load_model_shard, load_model_tp,
    load_safetensors, load_safetensors_shard, load_safetensors_tp, read_gguf_content,
};
pub use remote::{serve_worker, FAULT_STEP_ENV};
pub use rows::{LogitsWanted, SeqInput};

/// Family-specific checks of [`ModelConfig::validate`], by architecture.
fn validate_family(cfg: &ModelConfig) -> Result<()> {
    match cfg.arch {
        Arch::Llama | Arch::Qwen2 => llama::validate(cfg),
        Arch::DeepseekV3 => deepseek::validate(cfg),
        // The K3-only numerics live in the family's own config, checked at
        // load (`kimi_k3::validate`).
        Arch::KimiK3 => Ok(()),
        // Checked where its config is read (`scripted::config_from_hf_json`).
        Arch::Scripted => Ok(()),
    }
}

/// The weights of one architecture family; each has its one forward.
pub(crate) enum Body {
    /// One shard per tensor-parallel rank, in rank order; never empty.
    Llama(Vec<llama::Shard>),
    /// One weights shard per tensor-parallel rank, in rank order; never
    /// empty. (A rank loaded alone by [`load_safetensors_shard`] holds one
    /// shard of a group its caller drives.)
    Deepseek(Vec<deepseek::Weights>),
    /// One Kimi K3 shard per tensor-parallel rank, in rank order; never
    /// empty.
    KimiK3(Vec<kimi_k3::Weights>),
    /// A test double: the scripts it replays (unsharded, no weights).
    Scripted(scripted::Scripts),
}

/// A loaded model: config plus weights, as one shard per tensor-parallel
/// rank. Immutable once loaded, so one model can serve many sequences; all
/// per-sequence state lives in a [`crate::KvPool`] built by
/// [`crate::KvPool::for_model`].
///
/// At world size 1 a forward runs inline on the calling thread; at world
/// size N it runs the N shards on N threads (see `ranks.rs`) and returns
/// rank 0's logits, which equal world size 1's up to float summation order.
/// A model loaded as one rank of ranks run as processes
/// ([`load_model_shard`]) holds its shard alone: rank 0 leads
/// ([`Model::lead`]), the others run [`serve_worker`] (see `remote.rs`).
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
    /// How a pool for this model stores latent rows ([`Model::set_latent_cache`];
    /// unused without latent attention).
    pub(crate) latent_cache: CacheDtype,
    /// Set on rank 0 of ranks run as processes ([`Model::lead`]): pools
    /// and forwards are broadcast to the other ranks first.
    pub(crate) leader: Option<remote::Leader>,
}

impl Model {
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
        match &mut self.body {
            Body::Llama(shards) => llama::restrict_head(shards, tokens)?,
            Body::Deepseek(_) | Body::KimiK3(_) | Body::Scripted(_) => {
                return Err(VerifyError::BadConfig(
                    "a restricted head is implemented for the llama family only".into(),
                ))
            }
        }
        let per_row = self.lm_bytes / self.cfg.vocab_size;
        self.weight_bytes = self.weight_bytes - self.lm_bytes + per_row * tokens.len();
        self.lm_bytes = per_row * tokens.len();
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
            // K3's MLA layers always attend in the latent space.
            Body::KimiK3(_) => Err(VerifyError::BadConfig(
                "MLA prefill modes are for the DeepSeek family; Kimi K3 attends absorbed".into(),
            )),
            Body::Scripted(_) => Err(VerifyError::BadConfig(
                "MLA prefill mode on the scripted model".into(),
            )),
        }
    }

    /// How a pool from [`crate::KvPool::for_model`] stores this model's
    /// latent rows; `None` for a model without latent attention. Kimi K3
    /// loads with bf16 when the matrix that writes the latent is stored
    /// as bf16 or quantized, f32 when it is f32; DeepSeek-family models
    /// keep f32.
    pub fn latent_cache(&self) -> Option<CacheDtype> {
        self.cfg.mla.as_ref().map(|_| self.latent_cache)
    }

    /// Chooses how latent rows are stored (see [`Model::latent_cache`]);
    /// pools made before keep theirs, and a forward refuses them.
    ///
    /// Errors: a model without latent attention; bf16 for the DeepSeek
    /// family, whose expanded prefill reads a chunk's latents unrounded
    /// while later chunks would read them rounded.
    pub fn set_latent_cache(&mut self, dtype: CacheDtype) -> Result<()> {
        match (&self.body, dtype) {
            (Body::Llama(_), _) => Err(VerifyError::BadConfig(
                "a latent cache dtype for a model without latent attention".into(),
            )),
            (Body::Deepseek(_) | Body::Scripted(_), CacheDtype::Bf16) => {
                Err(VerifyError::BadConfig(
                    "a bf16 latent cache is implemented for Kimi K3 only".into(),
                ))
            }
            _ => {
                self.latent_cache = dtype;
                Ok(())
            }
        }
    }

    /// Number of tensor-parallel ranks this `Model` runs itself (its
    /// shards). A DeepSeek-family rank from [`load_safetensors_shard`] is
    /// one rank of a group its caller drives, so it says 1.
    pub fn world_size(&self) -> usize {
        match &self.body {
            Body::Llama(shards) => shards.len(),
            Body::Deepseek(ranks) => ranks.len(),
            Body::KimiK3(ranks) => ranks.len(),
            Body::Scripted(_) => 1,
        }
    }

    /// Bytes of KV cache one token occupies in a pool from
    /// [`crate::KvPool::for_model`], all ranks together: the model's
    /// [`ModelConfig::kv_bytes_per_token`] (f32 values), once per rank for
    /// a latent cache (every rank keeps its own copy; KV heads split
    /// instead), with latent values at their stored size
    /// ([`Model::latent_cache`]).
    pub fn kv_bytes_per_token(&self) -> usize {
        let latent = |f32_bytes: usize| f32_bytes / 4 * self.latent_cache.bytes();
        match &self.body {
            Body::Llama(_) | Body::Scripted(_) => self.cfg.kv_bytes_per_token(),
            Body::Deepseek(ranks) => ranks.len() * latent(self.cfg.kv_bytes_per_token()),
            // Only the MLA layers cache per token.
            Body::KimiK3(ranks) => {
                let per_layer = self.cfg.kv_bytes_per_token() / self.cfg.num_layers;
                ranks.len() * latent(per_layer) * ranks[0].mla_layers()
            }
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
            Body::KimiK3(ranks) => vec![1; ranks.len()],
            Body::Scripted(_) => vec![1],
        }
    }

    /// Runs one forward over all new tokens of `seqs`, writing their K/V into
    /// `pool`, and returns logits `[n, vocab]` for the rows each sequence asked
    /// for (see [`LogitsWanted`]), in batch order. `n` may be 0.
    ///
    /// Errors: a token outside the vocabulary, a position beyond the model's
    /// context, a block table too short or naming a block outside the pool,
    /// a pool built for another model shape or world size, or (sharded) a
    /// rank that failed ([`VerifyError::RankFailed`]).
    pub fn forward(&self, pool: &mut KvPool, seqs: &[SeqInput]) -> Result<Tensor> {
        // Rank 0 of ranks run as processes: the others run the same step.
        self.send_step(pool, seqs)?;
        match &self.body {
            Body::Llama(shards) => llama::forward(self, shards, pool, seqs),
            Body::Deepseek(ranks) => deepseek::forward(self, ranks, pool, seqs),
            Body::KimiK3(ranks) => kimi_k3::forward(self, ranks, pool, seqs),
            Body::Scripted(scripts) => scripted::forward(self, scripts, pool, seqs),
        }
    }

    /// Checks one sequence's part of a forward batch as [`Model::forward`]
    /// would, without running anything: a caller validates each sequence
    /// first, so one that cannot run is refused alone instead of failing
    /// (and, for a model with recurrent layers, possibly half-advancing)
    /// the whole batch. What only a whole batch can break (two sequences
    /// sharing a state slot, a pool of another shape) is not checked.
    ///
    /// Errors: as [`Model::forward`] for this sequence: a position beyond
    /// the model's context, a token outside the vocabulary, a block table
    /// too short or naming a block outside the pool, a state slot outside
    /// the pool.
    pub fn check_input(&self, pool: &KvPool, seq: &SeqInput) -> Result<()> {
        rows::check_seq(self, pool, 0, seq)
    }

    /// Narrows the context this model accepts to `max_position` positions
    /// (a deployment's `max_model_len`): forwards refuse rows past it, and
    /// [`Model::config`] reports it, so everything sized by the context
    /// (admission, drafting near the end) follows.
    ///
    /// Errors: [`VerifyError::BadConfig`] when `max_position` is 0 or above
    /// the context the model was loaded with.
    pub fn limit_context(&mut self, max_position: usize) -> Result<()> {
        if max_position == 0 || max_position > self.cfg.max_position {
            return Err(VerifyError::BadConfig(format!(
                "context limit {max_position} is out of range; allowed 1..={}",
                self.cfg.max_position
            )));
        }
        self.cfg.max_position = max_position;
        Ok(())
    }

    /// Floats of one sequence's recurrent state on each rank, in rank
    /// order: the size of a [`crate::KvPool`] state slot. Empty for models
    /// without recurrent layers (every cache is per token).
    pub fn state_floats_per_rank(&self) -> Vec<usize> {
        match &self.body {
            Body::KimiK3(ranks) => ranks.iter().map(|w| w.state_floats()).collect(),
            Body::Llama(_) | Body::Deepseek(_) | Body::Scripted(_) => Vec::new(),
        }
    }

    /// Which layers cache per token (`None`: all of them).
    pub(crate) fn per_token_cache_layers(&self) -> Option<Vec<bool>> {
        match &self.body {
            Body::KimiK3(ranks) => Some(ranks[0].mla_layer_mask()),
            Body::Llama(_) | Body::Deepseek(_) | Body::Scripted(_) => None,
        }
    }

    /// Whether some layers keep a recurrent state per sequence (which a
    /// rejected draft cannot be trimmed out of).
    pub fn has_recurrent_state(&self) -> bool {
        !self.state_floats_per_rank().is_empty()
    }

    /// Runs a throwaway two-row forward so that candle packs every weight
    /// into its kernel layout now (it does so lazily, on first use: about
    /// 1.5 s for the 1.5B model) rather than inside the first request.
    pub fn warm_up(&self) -> Result<()> {
        let mut pool = KvPool::for_model(self, 1, 2)?;
        self.forward(
            &mut pool,
            &[SeqInput {
                tokens: &[0, 0],
                start_pos: 0,
                block_table: &[0],
                logits: LogitsWanted::Last,
                state_slot: 0,
            }],
        )?;
        Ok(())
    }

    /// [`Model::forward`] with the logits as one `Vec<f32>` per row.
    pub fn forward_rows(&self, pool: &mut KvPool, seqs: &[SeqInput]) -> Result<Vec<Vec<f32>>> {
        Ok(self.forward(pool, seqs)?.to_vec2::<f32>()?)
    }

    /// Convenience for one sequence (in state slot 0): logits rows as
    /// `Vec<Vec<f32>>`.
    pub fn forward_one(
        &self,
        pool: &mut KvPool,
        tokens: &[u32],
        start_pos: usize,
        block_table: &[u32],
        logits: LogitsWanted,
    ) -> Result<Vec<Vec<f32>>> {
        self.forward_rows(
            pool,
            &[SeqInput {
                tokens,
                start_pos,
                block_table,
                logits,
                state_slot: 0,
            }],
        )
    }
}
