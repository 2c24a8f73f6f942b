//! A verified token tree's cache: attention over a tree row's visible
//! slots only, and compaction of the accepted path afterwards.
//!
//! A tree's rows are cached at distinct, contiguous slots (row `i` at
//! `start + i`). A row attends its sequence's cached slots, then its
//! ancestors' and its own ([`KvShard::attend_group_tree`]), never a
//! sibling's. The sequence that goes on is the chain of the kept rows
//! only, which must then sit at consecutive slots from `start` for later
//! forwards (slot == position) to read it: [`KvPool::compact_rows`] moves
//! them there, on every shard and every per-token cached layer, whatever
//! the cache stores (K and V heads in f32, latent rows in f32 or bf16).
//! Recurrent states are not per token and are not touched here.

use super::{KvPool, KvShard};
use crate::error::{Result, VerifyError};

impl KvPool {
    /// Moves the cache entries of slot `start_slot + kept[j]` to slot
    /// `start_slot + j`, for every `j`, in every shard and cached layer
    /// of the sequence with `block_table`. Afterwards slots
    /// `start_slot..start_slot + kept.len()` hold exactly the kept rows in
    /// order (as if that chain had been fed), slots before `start_slot`
    /// are unchanged, and the slots after are stale (the next forward
    /// overwrites what it reads). With a tree verified at `start_slot`,
    /// `kept` is [`crate::TreeVerdict::rows_to_keep`]; the next forward
    /// starts at position `start_slot + kept.len()`.
    ///
    /// Errors ([`VerifyError::BadBatch`], nothing moved): `kept` not
    /// strictly increasing (a row kept twice, or out of position order); a
    /// slot the block table cannot address or a block outside the pool;
    /// a pool of ranks run as processes (the other ranks' shards are not
    /// here, and the move is not yet shipped to them). An empty `kept` is
    /// a no-op.
    pub fn compact_rows(
        &mut self,
        block_table: &[u32],
        start_slot: usize,
        kept: &[usize],
    ) -> Result<()> {
        if self.mirror.is_some() {
            return Err(VerifyError::BadBatch(
                "compacting tree rows is not supported for ranks run as processes yet".into(),
            ));
        }
        if let Some(w) = kept.windows(2).find(|w| w[0] >= w[1]) {
            return Err(VerifyError::BadBatch(format!(
                "kept rows must be strictly increasing, got {} then {}",
                w[0], w[1]
            )));
        }
        let Some(&last) = kept.last() else {
            return Ok(());
        };
        self.check_table(block_table, start_slot + last + 1)?;
        for shard in &mut self.shards {
            shard.compact(block_table, start_slot, kept);
        }
        Ok(())
    }
}

impl KvShard {
    /// [`KvShard::attend_group`] over the slots `0..prefix` followed by
    /// `extra` (a token tree's row: its sequence's cached slots, then its
    /// ancestors' and its own, ascending), and no other. The context is
    /// read in that order with the same operations, so a row whose slots
    /// are `0..prefix + extra.len()` gets attend_group's bits exactly.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend_group_tree(
        &self,
        layer: usize,
        block_table: &[u32],
        prefix: usize,
        extra: &[usize],
        q: &[f32],
        kvh: usize,
        scale: f32,
        out: &mut [f32],
        scores: &mut Vec<f32>,
    ) {
        let slots = |t: usize| if t < prefix { t } else { extra[t - prefix] };
        let ctx_len = prefix + extra.len();
        self.attend_slots(
            layer,
            block_table,
            ctx_len,
            slots,
            q,
            kvh,
            scale,
            out,
            scores,
        )
    }

    /// This shard's part of [`KvPool::compact_rows`] (checked there).
    fn compact(&mut self, block_table: &[u32], start: usize, kept: &[usize]) {
        let (bs, heads, w) = (self.block_size, self.num_kv_heads, self.head_dim);
        let offset = |slot: usize, h: usize| {
            ((block_table[slot / bs] as usize * heads + h) * bs + slot % bs) * w
        };
        // Ascending j with kept[j] >= j: a destination is never a source
        // still to be read (kept[j'] > kept[j] >= j for j' > j).
        let moves = kept
            .iter()
            .enumerate()
            .filter(|&(j, &r)| r != j)
            .map(|(j, &r)| (start + r, start + j));
        for (from, to) in moves {
            for h in 0..heads {
                let (src, dst) = (offset(from, h), offset(to, h));
                // Empty vectors: a layer without per-token storage, V of a
                // latent shard, the dtype a shard does not store.
                for buf in self.k.iter_mut().chain(&mut self.v) {
                    if !buf.is_empty() {
                        buf.copy_within(src..src + w, dst);
                    }
                }
                for buf in &mut self.k16 {
                    if !buf.is_empty() {
                        buf.copy_within(src..src + w, dst);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{CacheDtype, KvLayout, LatentRow, TokenRow};
    use super::*;

    /// A value unique to (shard, layer, slot, element), exact in bf16
    /// (small integers).
    fn val(shard: usize, layer: usize, slot: usize, e: usize) -> f32 {
        (((shard * 3 + layer) * 64 + slot) * 8 + e) as f32 % 251.0
    }

    fn heads_pool() -> KvPool {
        // Two shards (tensor-parallel ranks) of 2 and 1 KV heads, layer 1
        // without per-token storage (a recurrent layer of a hybrid).
        let layout = KvLayout {
            cached: vec![true, false, true],
            rows: vec![
                TokenRow::Heads {
                    kv_heads: 2,
                    head_dim: 4,
                },
                TokenRow::Heads {
                    kv_heads: 1,
                    head_dim: 4,
                },
            ],
            state_floats: Vec::new(),
        };
        KvPool::with_layout(&layout, 5, 4, 0).unwrap()
    }

    const TABLE: [u32; 4] = [3, 0, 4, 2];

    fn fill_heads(pool: &mut KvPool, slots: usize) {
        for (si, shard) in pool.shards.iter_mut().enumerate() {
            let n = shard.num_kv_heads * 4;
            for layer in [0, 2] {
                for t in 0..slots {
                    let k: Vec<f32> = (0..n).map(|e| val(si, layer, t, e)).collect();
                    let v: Vec<f32> = k.iter().map(|x| -x).collect();
                    shard.write(layer, &TABLE, t, &k, &v);
                }
            }
        }
    }

    fn read_heads(pool: &KvPool, si: usize, layer: usize, t: usize) -> (Vec<f32>, Vec<f32>) {
        let s = &pool.shards[si];
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for h in 0..s.num_kv_heads {
            let o = s.offset(TABLE[t / 4] as usize, h, t % 4);
            k.extend_from_slice(&s.k[layer][o..o + 4]);
            v.extend_from_slice(&s.v[layer][o..o + 4]);
        }
        (k, v)
    }

    #[test]
    fn kept_rows_move_to_consecutive_slots_on_every_shard_and_layer() {
        let mut pool = heads_pool();
        fill_heads(&mut pool, 14);
        // A tree verified at slot 3 with 11 rows; keep rows 0, 2, 5, 9
        // (crossing block boundaries both ways).
        let kept = [0, 2, 5, 9];
        pool.compact_rows(&TABLE, 3, &kept).unwrap();
        let before = {
            let mut p = heads_pool();
            fill_heads(&mut p, 14);
            p
        };
        for si in 0..2 {
            for layer in [0, 2] {
                for t in 0..3 {
                    assert_eq!(
                        read_heads(&pool, si, layer, t),
                        read_heads(&before, si, layer, t)
                    );
                }
                for (j, &r) in kept.iter().enumerate() {
                    assert_eq!(
                        read_heads(&pool, si, layer, 3 + j),
                        read_heads(&before, si, layer, 3 + r),
                        "shard {si} layer {layer} kept row {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_tree_row_attends_exactly_its_listed_slots() {
        let mut pool = heads_pool();
        fill_heads(&mut pool, 12);
        let shard = &pool.shards[0];
        let q: Vec<f32> = (0..8).map(|i| (i as f32 * 0.3).sin() / 50.0).collect();
        let attend = |prefix, extra: &[usize]| {
            let mut out = vec![0f32; 8];
            shard.attend_group_tree(
                0,
                &TABLE,
                prefix,
                extra,
                &q,
                1,
                0.5,
                &mut out,
                &mut Vec::new(),
            );
            out
        };
        let dense = |slots: &[usize]| {
            let mut out = vec![0f32; 8];
            for h in 0..2 {
                let qh = &q[h * 4..h * 4 + 4];
                let key = |t: usize| read_heads(&pool, 0, 0, t);
                let s: Vec<f32> = slots
                    .iter()
                    .map(|&t| 0.5 * (0..4).map(|d| qh[d] * key(t).0[4 + d]).sum::<f32>())
                    .collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
                for (i, &t) in slots.iter().enumerate() {
                    for d in 0..4 {
                        out[h * 4 + d] += (s[i] - m).exp() / z * key(t).1[4 + d];
                    }
                }
            }
            out
        };
        let close = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1.0))
        };
        // Prefix 0..4, then row 0 (slot 4) and the ancestors at 6 and 9.
        let got = attend(4, &[4, 6, 9]);
        assert!(close(&got, &dense(&[0, 1, 2, 3, 4, 6, 9])));
        // The same row seeing a sibling (slot 5) is another result.
        assert!(!close(&got, &dense(&[0, 1, 2, 3, 4, 5, 6, 9])));
        // A contiguous list is attend_group's bits.
        let mut plain = vec![0f32; 8];
        shard.attend_group(0, &TABLE, 7, &q, 1, 0.5, &mut plain, &mut Vec::new());
        assert_eq!(attend(4, &[4, 5, 6]), plain);
    }

    #[test]
    fn bf16_and_f32_latent_rows_move_too() {
        for dtype in [CacheDtype::F32, CacheDtype::Bf16] {
            let layout = KvLayout {
                cached: vec![true, true],
                rows: vec![TokenRow::Latent { width: 6, dtype }; 2],
                state_floats: Vec::new(),
            };
            let mut pool = KvPool::with_layout(&layout, 5, 4, 0).unwrap();
            let row = |si, l, t| -> Vec<f32> { (0..6).map(|e| val(si, l, t, e)).collect() };
            for (si, shard) in pool.shards.iter_mut().enumerate() {
                for l in 0..2 {
                    for t in 0..12 {
                        shard.write_latent(l, &TABLE, t, &row(si, l, t));
                    }
                }
            }
            pool.compact_rows(&TABLE, 2, &[0, 3, 4, 8]).unwrap();
            for (si, shard) in pool.shards.iter().enumerate() {
                for l in 0..2 {
                    let got = |t| match shard.latent_row(l, &TABLE, t) {
                        LatentRow::F32(r) => r.to_vec(),
                        LatentRow::Bf16(r) => r.iter().map(|x| x.to_f32()).collect(),
                    };
                    assert_eq!(got(1), row(si, l, 1), "{dtype:?}");
                    for (j, r) in [0, 3, 4, 8].into_iter().enumerate() {
                        assert_eq!(got(2 + j), row(si, l, 2 + r), "{dtype:?} row {j}");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_kept_rows_and_short_tables_are_errors_that_move_nothing() {
        let mut pool = heads_pool();
        fill_heads(&mut pool, 16);
        let snapshot = |p: &KvPool| read_heads(p, 0, 0, 3);
        let was = snapshot(&pool);
        for kept in [&[0, 2, 2][..], &[0, 3, 1]] {
            let e = pool.compact_rows(&TABLE, 3, kept).unwrap_err();
            assert!(e.to_string().contains("strictly increasing"), "{e}");
        }
        // Slot 3 + 13 = 16 needs a fifth block.
        let e = pool.compact_rows(&TABLE, 3, &[0, 13]).unwrap_err();
        assert!(e.to_string().contains("block table"), "{e}");
        let e = pool.compact_rows(&[3, 9], 3, &[0, 2]).unwrap_err();
        assert!(e.to_string().contains("outside a pool"), "{e}");
        assert_eq!(snapshot(&pool), was);
        pool.compact_rows(&TABLE, 3, &[]).unwrap();
        pool.compact_rows(&TABLE, 3, &[0, 1, 2]).unwrap();
        assert_eq!(snapshot(&pool), was);
    }
}
