//! Recurrent-state slots of a hybrid model's pool: each slot's live state,
//! the per-row states a multi-row verification records so that rejected
//! drafts roll back by a copy ([`KvPool::keep_rows`]), and copies between
//! slots ([`KvPool::copy_state`], [`KvPool::copy_row_state`]), with which
//! the engine saves and restores prefix-cache checkpoints (a checkpoint is
//! a slot no sequence runs in). Which slot is a sequence's and which a
//! checkpoint's is the caller's bookkeeping (the gateway's `src/kv/`).
//!
//! Per-row states live only while a verification's verdict is pending:
//! [`KvPool::keep_rows`] (or releasing or overwriting the slot) hands the
//! buffer to a small shard-wide spare list, so no sequence holds one
//! between steps, and the next verification reuses a spare instead of
//! allocating and zero-filling one.

use super::{KvPool, KvShard, PoolOp};
use crate::error::{Result, VerifyError};
use std::collections::HashMap;

/// Spare per-row buffers one shard keeps between verifications (the
/// largest ones): what a step of a few verifying sequences reuses. More
/// are freed, so memory between steps is bounded whatever the traffic.
const SPARE_BUFFERS: usize = 4;

/// One shard's per-row states: per slot, those of its pending
/// verification; and spare buffers.
#[derive(Default)]
pub(crate) struct RowStates {
    pending: HashMap<u32, Recorded>,
    spare: Vec<Vec<f32>>,
    /// The most floats of states ever recorded pending at once (what a
    /// step's verifications needed; the spares excluded).
    peak_pending: usize,
}

/// A slot's states after the rows of its pending verification of `rows`
/// rows: row `i < rows - 1` in `buf[i * f..(i + 1) * f]` (the state with
/// rows `0..=i` fed); the last row's is the slot's live state, so it is
/// never copied.
struct Recorded {
    rows: usize,
    /// At least `(rows - 1) * state_floats` floats.
    buf: Vec<f32>,
}

impl RowStates {
    /// Rows of `slot`'s pending verification, if one is recorded.
    fn rows(&self, slot: u32) -> Option<usize> {
        self.pending.get(&slot).map(|r| r.rows).filter(|&r| r > 0)
    }

    /// Forgets `slot`'s pending verification, keeping its buffer as a
    /// spare (the largest [`SPARE_BUFFERS`] are kept).
    fn retire(&mut self, slot: u32) {
        if let Some(r) = self.pending.remove(&slot) {
            self.spare.push(r.buf);
            if self.spare.len() > SPARE_BUFFERS {
                let smallest = (0..self.spare.len())
                    .min_by_key(|&i| self.spare[i].capacity())
                    .expect("not empty");
                self.spare.swap_remove(smallest);
            }
        }
    }

    /// Spare buffers held now, and their floats (for tests and bounds).
    fn spare_floats(&self) -> usize {
        self.spare.iter().map(Vec::capacity).sum()
    }
}

impl KvPool {
    /// Rolls a state slot back to the end of row `rows - 1` of its last
    /// multi-row verification (rows `0..rows` accepted, the rest rejected):
    /// the slot then holds exactly the state of feeding the accepted tokens
    /// only. Free: the forward kept each row's state, nothing is recomputed.
    /// The verification's per-row states are gone afterwards.
    ///
    /// Errors: no recorded rows for `slot` (no verification of two or more
    /// rows ran since the last commit), or `rows` outside `1..=recorded`.
    pub fn keep_rows(&mut self, slot: u32, rows: usize) -> Result<()> {
        if let Some((_, ops)) = &mut self.mirror {
            // Replayed as is: the other ranks' pools fail the same way.
            ops.push(PoolOp::KeepRows { slot, rows });
        }
        // Every shard recorded the same rows: check once, apply to all.
        let Some(n) = self.shards.first().and_then(|s| s.row_states.rows(slot)) else {
            return Err(VerifyError::BadBatch(format!(
                "no per-row states recorded for state slot {slot}"
            )));
        };
        if rows == 0 || rows > n {
            self.release_state(slot);
            return Err(VerifyError::BadBatch(format!(
                "keeping {rows} rows of a verification of {n} in state slot {slot}"
            )));
        }
        for shard in &mut self.shards {
            let f = shard.state_floats;
            if let Some(r) = shard.row_states.pending.get(&slot) {
                if rows < n {
                    let at = slot as usize * f;
                    shard.states[at..at + f].copy_from_slice(&r.buf[(rows - 1) * f..rows * f]);
                }
            }
            shard.row_states.retire(slot);
        }
        Ok(())
    }

    /// Copies slot `from`'s state into slot `to` on every shard: a prefix
    /// checkpoint saved (from a sequence's slot) or restored (into one).
    /// `to`'s recorded rows, if any, are forgotten. Checkpoints are never
    /// written in place: a restore copies, so the checkpoint stays as it
    /// was for the next hit.
    ///
    /// Errors ([`VerifyError::BadBatch`], nothing copied): a slot outside
    /// the pool.
    pub fn copy_state(&mut self, from: u32, to: u32) -> Result<()> {
        self.check_state_slot(from)?;
        self.check_state_slot(to)?;
        if let Some((_, ops)) = &mut self.mirror {
            ops.push(PoolOp::CopyState { from, to });
        }
        for shard in &mut self.shards {
            let f = shard.state_floats;
            if from != to {
                let at = from as usize * f;
                shard.states.copy_within(at..at + f, to as usize * f);
            }
            shard.row_states.retire(to);
        }
        Ok(())
    }

    /// Copies into slot `to` the state after row `row` of `slot`'s pending
    /// verification (the state with rows `0..=row` fed; the last row's is
    /// `slot`'s live state). Call it before [`KvPool::keep_rows`] commits
    /// that verification; `slot` itself is not changed.
    ///
    /// Errors ([`VerifyError::BadBatch`], nothing copied): a slot outside
    /// the pool, `to == slot`, no pending verification in `slot`, or `row`
    /// past its rows.
    pub fn copy_row_state(&mut self, slot: u32, row: usize, to: u32) -> Result<()> {
        self.check_state_slot(slot)?;
        self.check_state_slot(to)?;
        let n = self.shards.first().and_then(|s| s.row_states.rows(slot));
        if to == slot || n.is_none_or(|n| row >= n) {
            return Err(VerifyError::BadBatch(format!(
                "no state after row {row} of state slot {slot} to copy into slot {to}"
            )));
        }
        if let Some((_, ops)) = &mut self.mirror {
            ops.push(PoolOp::CopyRowState { slot, row, to });
        }
        let last = n.expect("checked") - 1;
        for shard in &mut self.shards {
            let f = shard.state_floats;
            let dst = to as usize * f;
            if row == last {
                shard
                    .states
                    .copy_within(slot as usize * f..(slot as usize + 1) * f, dst);
            } else if let Some(r) = shard.row_states.pending.get(&slot) {
                shard.states[dst..dst + f].copy_from_slice(&r.buf[row * f..(row + 1) * f]);
            }
            shard.row_states.retire(to);
        }
        Ok(())
    }

    /// A copy of `slot`'s state on every shard (for a caller that
    /// checkpoints states itself, e.g. a draft model feeding one token at
    /// a time).
    ///
    /// Errors: a slot outside the pool.
    pub fn read_state(&self, slot: u32) -> Result<Vec<Vec<f32>>> {
        self.check_state_slot(slot)?;
        Ok(self
            .shards
            .iter()
            .map(|s| {
                let f = s.state_floats;
                s.states[slot as usize * f..(slot as usize + 1) * f].to_vec()
            })
            .collect())
    }

    /// Puts back a state read by [`KvPool::read_state`].
    ///
    /// Errors: a slot outside the pool, a state of another shape, or a
    /// pool of ranks run as processes (whose other shards this process
    /// does not hold).
    pub fn write_state(&mut self, slot: u32, state: &[Vec<f32>]) -> Result<()> {
        self.check_state_slot(slot)?;
        if self.mirror.is_some() {
            return Err(VerifyError::BadBatch(
                "states of a model run as processes cannot be written back".into(),
            ));
        }
        if state.len() != self.shards.len()
            || self
                .shards
                .iter()
                .zip(state)
                .any(|(s, x)| x.len() != s.state_floats)
        {
            return Err(VerifyError::BadBatch(format!(
                "a state of another shape written to state slot {slot}"
            )));
        }
        for (s, x) in self.shards.iter_mut().zip(state) {
            let f = s.state_floats;
            s.states[slot as usize * f..(slot as usize + 1) * f].copy_from_slice(x);
            s.row_states.retire(slot);
        }
        Ok(())
    }

    /// Forgets a slot's recorded rows (its sequence ended or was preempted:
    /// the slot's state is dead until a sequence starts over in it).
    pub fn release_state(&mut self, slot: u32) {
        if let Some((_, ops)) = &mut self.mirror {
            ops.push(PoolOp::ReleaseState { slot });
        }
        for shard in &mut self.shards {
            shard.row_states.retire(slot);
        }
    }

    /// Bytes this process holds in per-row state buffers now, pending and
    /// spare, over its shards: bounded between steps by [`SPARE_BUFFERS`]
    /// per shard once every verification is committed.
    pub fn row_state_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let pending: usize = s
                    .row_states
                    .pending
                    .values()
                    .map(|r| r.buf.capacity())
                    .sum();
                pending + s.row_states.spare_floats()
            })
            .sum::<usize>()
            * std::mem::size_of::<f32>()
    }

    /// The most bytes of per-row states that verifications recorded at
    /// once (the states they needed, not the buffers' spare capacity),
    /// over the shards, since the pool was built or the last
    /// [`KvPool::reset_row_state_peak`]: what `[kv] row_state_mib` bounds.
    pub fn row_state_peak_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.row_states.peak_pending)
            .sum::<usize>()
            * std::mem::size_of::<f32>()
    }

    /// Starts [`KvPool::row_state_peak_bytes`] over from what is recorded
    /// now.
    pub fn reset_row_state_peak(&mut self) {
        for s in &mut self.shards {
            let rs = &mut s.row_states;
            let needed: usize = rs.pending.values().map(|r| r.rows.saturating_sub(1)).sum();
            rs.peak_pending = needed * s.state_floats;
        }
    }

    /// Checks that `slot` names one of this pool's state slots.
    pub(crate) fn check_state_slot(&self, slot: u32) -> Result<()> {
        if (slot as usize) < self.state_slots() {
            Ok(())
        } else {
            Err(VerifyError::BadBatch(format!(
                "state slot {slot} outside a pool of {} slots",
                self.state_slots()
            )))
        }
    }
}

impl KvShard {
    /// The buffer for the states after the first `rows - 1` rows of a
    /// verification of `rows` rows in `slot`: the slot's pending one or a
    /// spare, grown if short (only the growth is zero-filled). Forgets
    /// what the slot's pending verification recorded; hand the buffer back
    /// with [`KvShard::set_row_states`].
    pub(crate) fn take_row_buffer(&mut self, slot: u32, rows: usize) -> Vec<f32> {
        let need = rows.saturating_sub(1) * self.state_floats;
        let rs = &mut self.row_states;
        let mut buf = match rs.pending.remove(&slot) {
            Some(r) => r.buf,
            None => {
                // The smallest spare that fits, else the largest one.
                let fit = (0..rs.spare.len())
                    .filter(|&i| rs.spare[i].len() >= need)
                    .min_by_key(|&i| rs.spare[i].len())
                    .or_else(|| (0..rs.spare.len()).max_by_key(|&i| rs.spare[i].len()));
                fit.map(|i| rs.spare.swap_remove(i)).unwrap_or_default()
            }
        };
        if buf.len() < need {
            buf.resize(need, 0.0);
        }
        buf
    }

    /// Records `buf` (from [`KvShard::take_row_buffer`], the states after
    /// rows `0..rows - 1` written) as `slot`'s pending verification of
    /// `rows` rows (see [`KvPool::keep_rows`]).
    pub(crate) fn set_row_states(&mut self, slot: u32, rows: usize, buf: Vec<f32>) {
        debug_assert!(buf.len() >= rows.saturating_sub(1) * self.state_floats);
        let rs = &mut self.row_states;
        rs.pending.insert(slot, Recorded { rows, buf });
        let needed: usize = rs.pending.values().map(|r| r.rows.saturating_sub(1)).sum();
        rs.peak_pending = rs.peak_pending.max(needed * self.state_floats);
    }

    /// The recurrent state in `slot` (its layout is the model family's).
    ///
    /// Errors: a slot outside the pool, or a pool without states.
    pub(crate) fn state_mut(&mut self, slot: u32) -> Result<&mut [f32]> {
        let f = self.state_floats;
        let (a, b) = (slot as usize * f, (slot as usize + 1) * f);
        if f == 0 || b > self.states.len() {
            return Err(VerifyError::BadBatch(format!(
                "state slot {slot} outside a pool of {} slots",
                self.states.len().checked_div(f).unwrap_or(0)
            )));
        }
        Ok(&mut self.states[a..b])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_pool::{KvLayout, TokenRow};

    /// A pool of two shards (3 and 2 state floats), `slots` state slots.
    fn pool(slots: usize) -> KvPool {
        let layout = KvLayout {
            cached: vec![false],
            rows: vec![
                TokenRow::Heads {
                    kv_heads: 1,
                    head_dim: 2
                };
                2
            ],
            state_floats: vec![3, 2],
        };
        KvPool::with_layout(&layout, 2, 4, slots).unwrap()
    }

    fn set(pool: &mut KvPool, slot: u32, v: f32) {
        for s in pool.shards_mut() {
            s.state_mut(slot).unwrap().fill(v);
        }
    }

    /// Records a verification of `rows` rows in `slot` whose row `i` has
    /// state `base + i` (the last one live).
    fn verify(pool: &mut KvPool, slot: u32, rows: usize, base: f32) {
        for s in pool.shards_mut() {
            let f = s.state_floats;
            let mut buf = s.take_row_buffer(slot, rows);
            for i in 0..rows - 1 {
                buf[i * f..(i + 1) * f].fill(base + i as f32);
            }
            s.state_mut(slot).unwrap().fill(base + (rows - 1) as f32);
            s.set_row_states(slot, rows, buf);
        }
    }

    #[test]
    fn copies_move_whole_states_between_slots_on_every_shard() {
        let mut p = pool(4);
        set(&mut p, 0, 7.0);
        p.copy_state(0, 3).unwrap();
        assert_eq!(p.read_state(3).unwrap(), vec![vec![7.0; 3], vec![7.0; 2]]);
        set(&mut p, 0, 1.0);
        // The copy is a copy: the source changing leaves it alone.
        assert_eq!(p.read_state(3).unwrap()[0], vec![7.0; 3]);
        assert!(p.copy_state(0, 4).is_err() && p.copy_state(9, 0).is_err());
    }

    #[test]
    fn a_row_state_is_copied_before_the_verdict_commits() {
        let mut p = pool(3);
        verify(&mut p, 0, 4, 10.0);
        p.copy_row_state(0, 1, 2).unwrap();
        assert_eq!(p.read_state(2).unwrap(), vec![vec![11.0; 3], vec![11.0; 2]]);
        // The last row's is the live state.
        p.copy_row_state(0, 3, 1).unwrap();
        assert_eq!(p.read_state(1).unwrap()[1], vec![13.0; 2]);
        assert!(p.copy_row_state(0, 4, 1).is_err(), "past the rows");
        assert!(p.copy_row_state(0, 0, 0).is_err(), "onto itself");
        p.keep_rows(0, 3).unwrap();
        assert_eq!(p.read_state(0).unwrap()[0], vec![12.0; 3]);
        // Committed: nothing is pending any more.
        assert!(p.copy_row_state(0, 0, 1).is_err());
        assert!(p.keep_rows(0, 1).is_err());
    }

    #[test]
    fn row_buffers_are_not_held_by_slots_between_steps() {
        let mut p = pool(8);
        for round in 0..5 {
            for slot in 0..8 {
                verify(&mut p, slot, 6, round as f32);
            }
            for slot in 0..8 {
                p.keep_rows(slot, 2).unwrap();
            }
            // Committed: at most SPARE_BUFFERS spares per shard remain,
            // none pending.
            let per_buffer = 5 * (3 + 2) * 4;
            assert!(p.row_state_bytes() <= SPARE_BUFFERS * per_buffer);
            assert!(p
                .shards_mut()
                .iter()
                .all(|s| s.row_states.pending.is_empty()));
        }
        // Releasing a slot mid-verification frees its rows too.
        verify(&mut p, 5, 6, 0.0);
        p.release_state(5);
        assert!(p.keep_rows(5, 1).is_err());
    }
}
