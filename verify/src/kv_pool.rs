//! The physical paged KV cache: per-layer K and V storage cut into blocks of
//! `block_size` token slots, addressed by block ids that the engine's
//! BlockManager hands out. This module holds tensors' memory and the paged
//! attention kernel that reads blocks in place; it does no bookkeeping of
//! which sequence owns which block.
//!
//! Layout per layer and shard: `[block][kv_head][slot][head_dim]`, so one KV
//! head's keys within a block are contiguous for the attention loop. Under
//! tensor parallelism each rank's shard holds only that rank's KV heads.
//!
//! Latent attention models (DeepSeek-V3 family) cache one row per token
//! instead: the compressed KV latent (after its norm) followed by the RoPE'd
//! shared key, `kv_lora_rank + qk_rope_head_dim` floats, stored as a single
//! "head" in `k` (no `v`); heads are expanded from it inside attention.
//! Under tensor parallelism every rank keeps its own full copy (its shard):
//! the latent is shared by all heads, so it cannot be split by heads.
//! Latent rows are stored as f32 or as bf16 ([`CacheDtype`], the model's
//! choice): bf16 halves the cache, each value rounded to nearest-even once
//! when written, so every later read of a row sees the same numbers.
//!
//! Hybrid models (Kimi K3) cache per token only in their attention layers
//! (the others get no per-token storage) and keep, for their recurrent
//! layers, one **state slot** per sequence: a fixed-size float buffer whose
//! layout the model family owns ([`KvPool::for_model`] makes as many as
//! blocks; a server sizes them by its running-sequence limit). Which slot a
//! sequence uses is the caller's ([`crate::SeqInput::state_slot`]). A
//! verification of several rows also keeps the state after each row, so
//! rejecting drafts rolls the slot back by a copy ([`KvPool::keep_rows`]).
//!
//! A verified token tree's rows sit at contiguous slots, one per node; the
//! accepted path is moved to consecutive slots afterwards
//! ([`KvPool::compact_rows`]), and attention over a tree row reads only
//! the slots it may see (`KvShard::attend_group_tree`); both in `tree.rs`.

use crate::error::{Result, VerifyError};
use crate::kernels::vector::{exp, F32Ops};
use half::bf16;

mod latent;
mod states;
mod tree;

pub use latent::CacheDtype;
pub(crate) use latent::LatentRow;
use states::RowStates;

/// Default token slots per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// The paged K/V cache of one model, sharded by KV heads across the
/// model's tensor-parallel ranks: shard `r` holds rank `r`'s KV heads for
/// every layer. The block ids (and so the block tables the engine keeps) are
/// one numbering for all shards: block `b` of a sequence is block `b` in
/// every shard.
///
/// Invariant: every shard has `num_blocks` blocks of `block_size` slots; a
/// latent pool's shards are full copies of the latent cache, one per rank.
pub struct KvPool {
    block_size: usize,
    num_blocks: usize,
    /// Recurrent-state slots (0 for models without recurrent layers).
    num_state_slots: usize,
    shards: Vec<KvShard>,
    /// Set on rank 0 of ranks run as processes: the pool's id among the
    /// leader's pools and the operations on its data since the last
    /// forward, which the next forward ships to the other ranks' pools.
    pub(crate) mirror: Option<(u32, Vec<PoolOp>)>,
}

/// An operation on a pool's data outside a forward, as rank 0 of ranks run
/// as processes records it for the others to replay (in order, before the
/// next forward).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolOp {
    /// [`KvPool::keep_rows`].
    KeepRows { slot: u32, rows: usize },
    /// [`KvPool::release_state`].
    ReleaseState { slot: u32 },
    /// [`KvPool::copy_state`].
    CopyState { from: u32, to: u32 },
    /// [`KvPool::copy_row_state`].
    CopyRowState { slot: u32, row: usize, to: u32 },
}

/// What a [`KvPool`] holds, as a model describes it (`Model::kv_layout`,
/// `ModelConfig::kv_layout`): the pool sizes itself from this and knows
/// nothing else about the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Per layer: whether it caches per token (a recurrent layer does not).
    pub cached: Vec<bool>,
    /// Per shard (tensor-parallel rank): what one cached token is.
    pub rows: Vec<TokenRow>,
    /// Per shard: floats of one recurrent-state slot; empty when no layer
    /// keeps a state.
    pub state_floats: Vec<usize>,
}

/// One cached token of one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenRow {
    /// K and V of `kv_heads` heads of `head_dim`, in f32.
    Heads { kv_heads: usize, head_dim: usize },
    /// One latent row of `width` values (latent attention), stored as `dtype`.
    Latent { width: usize, dtype: CacheDtype },
}

/// One rank's part of a [`KvPool`]: per-layer K and V storage of its KV heads.
///
/// Invariant: every cached layer's `k` and `v` (a latent shard: `k` alone,
/// or `k16` alone when it stores bf16) hold exactly
/// `num_blocks * num_kv_heads * block_size * head_dim` values; the others
/// are empty.
pub(crate) struct KvShard {
    block_size: usize,
    num_kv_heads: usize,
    head_dim: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Per layer: a bf16 latent shard's rows.
    k16: Vec<Vec<bf16>>,
    /// `Some` for a latent shard: how its rows are stored.
    latent: Option<CacheDtype>,
    /// Floats of one recurrent-state slot on this shard (0: none).
    state_floats: usize,
    /// `num_state_slots * state_floats` floats.
    states: Vec<f32>,
    /// Per slot, the states after the rows of its last multi-row
    /// verification, and spare buffers for the next ([`RowStates`]).
    /// [`KvPool::keep_rows`] commits one.
    row_states: RowStates,
}

impl KvPool {
    /// Allocates a zeroed pool shaped by `layout` (which the model
    /// describes, see `Model::kv_layout`; the pool knows no model): one shard
    /// per entry of `layout.rows`, `state_slots` recurrent-state slots when
    /// `layout.state_floats` is not empty (ignored otherwise).
    ///
    /// Errors: zero blocks or a zero block size; `state_floats` and `rows`
    /// of different lengths.
    pub fn with_layout(
        layout: &KvLayout,
        num_blocks: usize,
        block_size: usize,
        state_slots: usize,
    ) -> Result<Self> {
        if num_blocks == 0 || block_size == 0 {
            return Err(VerifyError::BadConfig(
                "KV pool needs at least one block of at least one slot".into(),
            ));
        }
        if !layout.state_floats.is_empty() && layout.state_floats.len() != layout.rows.len() {
            return Err(VerifyError::BadConfig(
                "a KV layout's state sizes and shards differ in number".into(),
            ));
        }
        let mut shards: Vec<KvShard> = layout
            .rows
            .iter()
            .map(|row| match *row {
                TokenRow::Heads { kv_heads, head_dim } => KvShard::zeroed(
                    &layout.cached,
                    num_blocks,
                    block_size,
                    kv_heads,
                    head_dim,
                    None,
                ),
                TokenRow::Latent { width, dtype } => KvShard::zeroed(
                    &layout.cached,
                    num_blocks,
                    block_size,
                    1,
                    width,
                    Some(dtype),
                ),
            })
            .collect();
        let state_floats = &layout.state_floats;
        let state_slots = if state_floats.is_empty() {
            0
        } else {
            state_slots
        };
        for (shard, &f) in shards.iter_mut().zip(state_floats) {
            shard.state_floats = f;
            shard.states = vec![0.0; f * state_slots];
        }
        Ok(Self {
            block_size,
            num_blocks,
            num_state_slots: state_slots,
            shards,
            mirror: None,
        })
    }

    /// Recurrent-state slots (0 for a model without recurrent layers).
    pub fn state_slots(&self) -> usize {
        self.num_state_slots
    }

    /// Bytes of one state slot across all shards.
    pub fn state_bytes_per_slot(&self) -> usize {
        self.shards.iter().map(|s| s.state_floats).sum::<usize>() * std::mem::size_of::<f32>()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Number of shards (the tensor-parallel world size it was built for).
    pub fn world_size(&self) -> usize {
        self.shards.len()
    }

    /// Bytes of cache one token occupies across all layers and all shards,
    /// counted from the storage itself (K and V, or the latent row as
    /// stored); equals `Model::kv_bytes_per_token` of the model it serves.
    pub fn bytes_per_token(&self) -> usize {
        let slots = self.num_blocks * self.block_size;
        let bytes: usize = self
            .shards
            .iter()
            .map(|s| {
                let f32s: usize = s.k.iter().chain(&s.v).map(Vec::len).sum();
                let bf16s: usize = s.k16.iter().map(Vec::len).sum();
                f32s * 4 + bf16s * 2
            })
            .sum();
        bytes / slots
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Whether this pool was built for `layout`'s layers and token rows
    /// (its state slots are not compared: a slot's size is checked where a
    /// model reads it).
    pub(crate) fn fits(&self, layout: &KvLayout) -> bool {
        self.shards.len() == layout.rows.len()
            && self.shards.iter().zip(&layout.rows).all(|(s, row)| {
                s.k.len() == layout.cached.len()
                    && match *row {
                        TokenRow::Heads { kv_heads, head_dim } => {
                            s.latent.is_none()
                                && s.num_kv_heads == kv_heads
                                && s.head_dim == head_dim
                        }
                        TokenRow::Latent { width, dtype } => {
                            s.latent == Some(dtype) && s.head_dim == width
                        }
                    }
            })
    }

    /// The per-rank shards, in rank order.
    pub(crate) fn shards_mut(&mut self) -> &mut [KvShard] {
        &mut self.shards
    }

    /// Checks that `block_table` can address positions `0..len`.
    pub(crate) fn check_table(&self, block_table: &[u32], len: usize) -> Result<()> {
        let need = self.blocks_for(len);
        if block_table.len() < need {
            return Err(VerifyError::BadBatch(format!(
                "block table has {} blocks, {} tokens need {need}",
                block_table.len(),
                len
            )));
        }
        if let Some(b) = block_table[..need]
            .iter()
            .find(|&&b| b as usize >= self.num_blocks)
        {
            return Err(VerifyError::BadBatch(format!(
                "block id {b} outside a pool of {} blocks",
                self.num_blocks
            )));
        }
        Ok(())
    }
}

impl KvShard {
    /// Stores one token's latent row (latent then RoPE key) of a latent
    /// shard at `position` of the sequence with `block_table`, rounded to
    /// the shard's [`CacheDtype`].
    pub(crate) fn write_latent(
        &mut self,
        layer: usize,
        block_table: &[u32],
        position: usize,
        row: &[f32],
    ) {
        debug_assert!(self.latent.is_some() && row.len() == self.head_dim);
        let off = self.offset(
            block_table[position / self.block_size] as usize,
            0,
            position % self.block_size,
        );
        let w = self.head_dim;
        match self.latent {
            Some(CacheDtype::Bf16) => {
                for (d, &x) in self.k16[layer][off..off + w].iter_mut().zip(row) {
                    *d = bf16::from_f32(x);
                }
            }
            _ => self.k[layer][off..off + w].copy_from_slice(row),
        }
    }

    /// The latent row cached at `position` of a sequence (latent shard).
    pub(crate) fn latent_row(
        &self,
        layer: usize,
        block_table: &[u32],
        position: usize,
    ) -> LatentRow<'_> {
        debug_assert!(self.latent.is_some());
        let off = self.offset(
            block_table[position / self.block_size] as usize,
            0,
            position % self.block_size,
        );
        let w = self.head_dim;
        match self.latent {
            Some(CacheDtype::Bf16) => LatentRow::Bf16(&self.k16[layer][off..off + w]),
            _ => LatentRow::F32(&self.k[layer][off..off + w]),
        }
    }

    /// A shard of zeros; `latent`: a latent shard storing `width`-value
    /// rows as that dtype (`None`: K and V of `heads` heads).
    fn zeroed(
        cached: &[bool],
        num_blocks: usize,
        block_size: usize,
        heads: usize,
        width: usize,
        latent: Option<CacheDtype>,
    ) -> Self {
        let per_layer = num_blocks * heads * block_size * width;
        let bf = latent == Some(CacheDtype::Bf16);
        let len = |c: bool, here: bool| if c && here { per_layer } else { 0 };
        KvShard {
            block_size,
            num_kv_heads: heads,
            head_dim: width,
            k: cached.iter().map(|&c| vec![0.0; len(c, !bf)]).collect(),
            v: cached
                .iter()
                .map(|&c| vec![0.0; len(c, latent.is_none())])
                .collect(),
            k16: cached
                .iter()
                .map(|&c| vec![bf16::ZERO; len(c, bf)])
                .collect(),
            latent,
            state_floats: 0,
            states: Vec::new(),
            row_states: RowStates::default(),
        }
    }

    fn offset(&self, block: usize, kv_head: usize, slot: usize) -> usize {
        ((block * self.num_kv_heads + kv_head) * self.block_size + slot) * self.head_dim
    }

    /// Stores one token's K and V rows (`num_kv_heads * head_dim` floats
    /// each, head-major) at `position` of the sequence with `block_table`.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        block_table: &[u32],
        position: usize,
        k_row: &[f32],
        v_row: &[f32],
    ) {
        let block = block_table[position / self.block_size] as usize;
        let slot = position % self.block_size;
        let hd = self.head_dim;
        for h in 0..self.num_kv_heads {
            let off = self.offset(block, h, slot);
            self.k[layer][off..off + hd].copy_from_slice(&k_row[h * hd..(h + 1) * hd]);
            self.v[layer][off..off + hd].copy_from_slice(&v_row[h * hd..(h + 1) * hd]);
        }
    }

    /// Attention of the query heads that share KV head `kvh` (grouped-query
    /// attention) over positions `0..ctx_len` of a sequence, read in place
    /// from its blocks; each K and V row is loaded once for the whole group.
    /// `q` and `out` hold `heads * head_dim` floats (RoPE applied), `scores`
    /// is scratch that grows to `heads * ctx_len` floats. Each head's result
    /// is computed in the same order whatever the group, so callers may
    /// split work by (row, KV head) with identical results.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend_group(
        &self,
        layer: usize,
        block_table: &[u32],
        ctx_len: usize,
        q: &[f32],
        kvh: usize,
        scale: f32,
        out: &mut [f32],
        scores: &mut Vec<f32>,
    ) {
        self.attend_slots(
            layer,
            block_table,
            ctx_len,
            |t| t,
            q,
            kvh,
            scale,
            out,
            scores,
        )
    }

    /// The attention kernel: context entry `t < ctx_len` is the token at
    /// cache slot `slot(t)`. Generic, so the contiguous case compiles to
    /// the plain loop it always was.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_slots(
        &self,
        layer: usize,
        block_table: &[u32],
        ctx_len: usize,
        slot: impl Fn(usize) -> usize,
        q: &[f32],
        kvh: usize,
        scale: f32,
        out: &mut [f32],
        scores: &mut Vec<f32>,
    ) {
        let hd = self.head_dim;
        let heads = q.len() / hd;
        let (kc, vc) = (&self.k[layer], &self.v[layer]);
        let at = |t: usize| {
            let s = slot(t);
            self.offset(
                block_table[s / self.block_size] as usize,
                kvh,
                s % self.block_size,
            )
        };
        let ops = F32Ops::current();
        scores.clear();
        scores.resize(heads * ctx_len, 0.0);
        for t in 0..ctx_len {
            let o = at(t);
            let k = &kc[o..o + hd];
            for (h, qh) in q.chunks_exact(hd).enumerate() {
                scores[h * ctx_len + t] = ops.dot(qh, k) * scale;
            }
        }
        for s in scores.chunks_exact_mut(ctx_len.max(1)).take(heads) {
            let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            // Separate loops: the exponentials vectorize, the ordered sum
            // cannot.
            for v in s.iter_mut() {
                *v = exp(*v - max);
            }
            let sum: f32 = s.iter().sum();
            let inv = 1.0 / sum;
            for v in s.iter_mut() {
                *v *= inv;
            }
        }
        out.fill(0.0);
        for t in 0..ctx_len {
            let o = at(t);
            let v = &vc[o..o + hd];
            for (h, oh) in out.chunks_exact_mut(hd).enumerate() {
                ops.axpy(scores[h * ctx_len + t], v, oh);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Arch, ModelConfig, RopeStyle};

    fn cfg() -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 8,
            hidden_size: 8,
            intermediate_size: 8,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 4,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_style: RopeStyle::Neox,
            max_position: 64,
            mla: None,
            moe: None,
            yarn: None,
        }
    }

    #[test]
    fn bytes_per_token_counts_layers_heads_and_kv() {
        let pool = KvPool::new(&cfg(), 4, 16).unwrap();
        assert_eq!(pool.bytes_per_token(), 2 * 2 * 2 * 4 * 4);
        assert_eq!(pool.bytes_per_token(), cfg().kv_bytes_per_token());
    }

    #[test]
    fn latent_pool_holds_one_row_per_token() {
        let c = ModelConfig {
            mla: Some(Box::new(crate::model::MlaConfig {
                q_lora_rank: None,
                kv_lora_rank: 6,
                qk_nope_head_dim: 4,
                qk_rope_head_dim: 2,
                v_head_dim: 4,
            })),
            ..cfg()
        };
        let mut pool = KvPool::new(&c, 3, 2).unwrap();
        assert_eq!(pool.bytes_per_token(), 2 * (6 + 2) * 4);
        assert!(
            pool.fits(&c.kv_layout(&[1], None, Vec::new()))
                && !pool.fits(&cfg().kv_layout(&[2], None, Vec::new()))
        );
        let table = [2u32, 0];
        let shard = &mut pool.shards_mut()[0];
        for t in 0..4 {
            shard.write_latent(1, &table, t, &[t as f32; 8]);
        }
        for t in 0..4 {
            let LatentRow::F32(row) = shard.latent_row(1, &table, t) else {
                panic!("an f32 pool")
            };
            assert_eq!(row, &[t as f32; 8]);
        }
    }

    #[test]
    fn bf16_latent_rows_take_half_the_bytes_rounded_once() {
        let layout = |dtype| KvLayout {
            cached: vec![false, true],
            rows: vec![TokenRow::Latent { width: 20, dtype }; 2],
            state_floats: Vec::new(),
        };
        let f = KvPool::with_layout(&layout(CacheDtype::F32), 3, 2, 0).unwrap();
        let mut b = KvPool::with_layout(&layout(CacheDtype::Bf16), 3, 2, 0).unwrap();
        assert_eq!(f.bytes_per_token(), 2 * 20 * 4);
        assert_eq!(b.bytes_per_token(), 2 * 20 * 2);
        assert!(b.fits(&layout(CacheDtype::Bf16)) && !b.fits(&layout(CacheDtype::F32)));
        let table = [2u32, 0];
        // 1 + 2^-9 is halfway between two bf16 values: nearest-even rounds
        // it down to 1; 1 + 3 * 2^-9 rounds up to 1 + 2^-7.
        let row: Vec<f32> = (0..20)
            .map(|i| match i {
                0 => 1.0 + 2f32.powi(-9),
                1 => 1.0 + 3.0 * 2f32.powi(-9),
                _ => (i as f32 * 0.37).sin(),
            })
            .collect();
        let shard = &mut b.shards_mut()[1];
        shard.write_latent(1, &table, 3, &row);
        let got = shard.latent_row(1, &table, 3);
        let LatentRow::Bf16(stored) = got else {
            panic!("a bf16 pool")
        };
        assert_eq!(stored[0].to_f32(), 1.0);
        assert_eq!(stored[1].to_f32(), 1.0 + 2f32.powi(-7));
        let wide: Vec<f32> = stored.iter().map(|v| v.to_f32()).collect();
        assert!(wide
            .iter()
            .zip(&row)
            .all(|(w, r)| (w - r).abs() <= r.abs() / 256.0));
        // Attention reads the rounded values, widened exactly.
        let mut buf = vec![0f32; wide.len()];
        got.widen_into(&mut buf);
        assert_eq!(buf, wide);
    }

    #[test]
    fn attention_over_scattered_blocks_matches_dense() {
        let c = cfg();
        let mut pool = KvPool::new(&c, 6, 2).unwrap();
        let table = [4u32, 1, 5];
        let ctx = 5;
        let kv: Vec<(Vec<f32>, Vec<f32>)> = (0..ctx)
            .map(|t| {
                let k = (0..8).map(|i| ((t * 8 + i) as f32 * 0.37).sin()).collect();
                let v = (0..8).map(|i| ((t * 8 + i) as f32 * 0.11).cos()).collect();
                (k, v)
            })
            .collect();
        for (t, (k, v)) in kv.iter().enumerate() {
            pool.shards[0].write(1, &table, t, k, v);
        }
        let q: Vec<f32> = (0..16).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut out = [0.0; 16];
        let mut scratch = Vec::new();
        pool.check_table(&table, ctx).unwrap();
        // Query heads 0-1 read KV head 0, heads 2-3 KV head 1.
        for (g, og) in out.chunks_exact_mut(8).enumerate() {
            let qg = &q[g * 8..(g + 1) * 8];
            pool.shards[0].attend_group(1, &table, ctx, qg, g, 0.5, og, &mut scratch);
        }
        for h in 0..4 {
            let kvh = h / 2;
            let s: Vec<f32> = (0..ctx)
                .map(|t| {
                    0.5 * (0..4)
                        .map(|d| q[h * 4 + d] * kv[t].0[kvh * 4 + d])
                        .sum::<f32>()
                })
                .collect();
            let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for d in 0..4 {
                let want: f32 = (0..ctx).map(|t| e[t] / z * kv[t].1[kvh * 4 + d]).sum();
                assert!((out[h * 4 + d] - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn short_table_and_foreign_block_are_errors() {
        let pool = KvPool::new(&cfg(), 2, 4).unwrap();
        assert!(pool.check_table(&[0], 5).is_err());
        assert!(pool.check_table(&[0, 7], 5).is_err());
        assert!(pool.check_table(&[1, 0], 8).is_ok());
    }
}
