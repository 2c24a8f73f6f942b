//! How a model shapes the KV pool it runs over: the [`KvLayout`] it
//! describes (per-token rows per rank, which layers cache per token, the
//! recurrent-state size), and the [`KvPool`] constructors that take a model
//! or its config. The pool itself (`kv_pool.rs`) sizes itself from the
//! layout alone and knows no model.

use super::{Model, ModelConfig};
use crate::error::{Result, VerifyError};
use crate::kv_pool::{CacheDtype, KvLayout, KvPool, TokenRow};

impl ModelConfig {
    /// The layout of a pool for this config with `kv_heads[r]` KV heads on
    /// rank `r` (ignored for latent attention, where every rank keeps the
    /// whole latent row, in f32), per-token storage in the layers `cached`
    /// marks (`None`: all), and `state_floats[r]` floats of recurrent state
    /// per slot on rank `r` (empty: none).
    pub fn kv_layout(
        &self,
        kv_heads: &[usize],
        cached: Option<Vec<bool>>,
        state_floats: Vec<usize>,
    ) -> KvLayout {
        let rows = kv_heads
            .iter()
            .map(|&h| match &self.mla {
                Some(m) => TokenRow::Latent {
                    width: m.kv_lora_rank + m.qk_rope_head_dim,
                    dtype: CacheDtype::F32,
                },
                None => TokenRow::Heads {
                    kv_heads: h,
                    head_dim: self.head_dim,
                },
            })
            .collect();
        KvLayout {
            cached: cached.unwrap_or_else(|| vec![true; self.num_layers]),
            rows,
            state_floats,
        }
    }
}

impl Model {
    /// The layout of the pool this model runs over: one shard per
    /// tensor-parallel rank with that rank's KV heads, per-token storage
    /// only in the layers that attend, latent rows stored as
    /// [`Model::latent_cache`] says, its recurrent-state size.
    pub fn kv_layout(&self) -> KvLayout {
        let mut layout = self.cfg.kv_layout(
            &self.kv_heads_per_rank(),
            self.per_token_cache_layers(),
            self.state_floats_per_rank(),
        );
        for row in &mut layout.rows {
            if let TokenRow::Latent { dtype, .. } = row {
                *dtype = self.latent_cache;
            }
        }
        layout
    }
}

impl KvPool {
    /// Allocates a zeroed unsharded pool (tensor-parallel world size 1) for
    /// `cfg`'s layers and KV heads. A pool for a sharded model comes from
    /// [`KvPool::for_model`].
    ///
    /// Errors: zero blocks or a zero block size.
    pub fn new(cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> Result<Self> {
        Self::with_layout(
            &cfg.kv_layout(&[cfg.num_kv_heads], None, Vec::new()),
            num_blocks,
            block_size,
            0,
        )
    }

    /// Allocates a zeroed pool shaped for `model` ([`Model::kv_layout`]),
    /// and for a model with recurrent layers `num_blocks` state slots
    /// (every sequence holds a block, so slots never run out first).
    ///
    /// Errors: zero blocks or a zero block size.
    pub fn for_model(model: &Model, num_blocks: usize, block_size: usize) -> Result<Self> {
        Self::for_model_with_state_slots(model, num_blocks, block_size, num_blocks)
    }

    /// [`KvPool::for_model`] with `state_slots` recurrent-state slots (for
    /// a model without recurrent layers: none, whatever is asked). A
    /// server sizes them by its running-sequence limit: a state slot of a
    /// full-size hybrid model is hundreds of megabytes.
    ///
    /// Errors: zero blocks or a zero block size, or no slot for a model
    /// with recurrent layers.
    pub fn for_model_with_state_slots(
        model: &Model,
        num_blocks: usize,
        block_size: usize,
        state_slots: usize,
    ) -> Result<Self> {
        let layout = model.kv_layout();
        if !layout.state_floats.is_empty() && state_slots == 0 {
            return Err(VerifyError::BadConfig(
                "a model with recurrent layers needs at least one state slot".into(),
            ));
        }
        let mut pool = Self::with_layout(&layout, num_blocks, block_size, state_slots)?;
        // Rank 0 of ranks run as processes: the others make theirs too.
        model.announce_pool(&mut pool)?;
        Ok(pool)
    }
}
