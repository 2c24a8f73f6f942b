//! The engine's side of a hybrid target's state checkpoints: it asks the
//! cache ([`crate::kv::Checkpoints`], through the block manager) what to
//! restore, save and snapshot, and runs the copies on the target's pool
//! (recorded there for ranks run as processes, which replay them in the
//! next step's message). The cache decides; this only carries it out.

use super::Engine;
use crate::kv::SeqId;
use crate::spec::Snapshot;

impl Engine {
    /// Copies the checkpoint each newly admitted sequence resumes from into
    /// its state slot, before its first forward. A sequence whose restore
    /// cannot be carried out ends with an error: going on would prefill
    /// from a wrong state (full speed, wrong text).
    pub(super) fn restore_checkpoints(&mut self) {
        let Some(c) = self.bm.checkpoints_mut() else {
            return;
        };
        let restores: Vec<(usize, SeqId, u32)> = self
            .running
            .iter()
            .enumerate()
            .filter_map(|(i, s)| c.take_restore(s.spec.id).map(|ck| (i, s.spec.id, ck)))
            .collect();
        let mut failed = Vec::new();
        for (idx, id, ck) in restores {
            let copied = match self.slots.assign(id) {
                Some(slot) => self
                    .pool
                    .copy_state(ck, slot)
                    .and_then(|()| self.corrupt(slot))
                    .map_err(|e| e.to_string()),
                None => Err("no state slot free".to_string()),
            };
            if let Err(e) = copied {
                tracing::error!(engine_request = id, error = %e, "a state checkpoint could not be restored");
                failed.push(idx);
            }
        }
        for &idx in failed.iter().rev() {
            let s = self.running.remove(idx);
            self.stats.failed += 1;
            let _ = s.tx.send(super::Event::Error(format!(
                "internal error: the server could not process this request (engine request {}); \
                 the server log has the details",
                s.spec.id
            )));
            self.release(s.spec.id);
        }
    }

    /// Zeroes a restored state under [`super::Fault::CorruptCheckpoints`].
    fn corrupt(&mut self, slot: u32) -> Result<(), specgate_verify::VerifyError> {
        if self.fault != Some(super::Fault::CorruptCheckpoints) {
            return Ok(());
        }
        let zeros: Vec<Vec<f32>> = self
            .pool
            .read_state(slot)?
            .into_iter()
            .map(|s| vec![0.0; s.len()])
            .collect();
        self.pool.write_state(slot, &zeros)
    }

    /// Saves a checkpoint of `id`'s state now that it has fed `computed`
    /// tokens, if the cache planned one there.
    pub(super) fn save_checkpoint(&mut self, id: SeqId, computed: usize) {
        let Some(slot) = self.slots.of(id) else {
            return;
        };
        let Some(ck) = self.bm.save_point(id, computed) else {
            return;
        };
        if let Err(e) = self.pool.copy_state(slot, ck) {
            tracing::warn!(engine_request = id, error = %e, "a state checkpoint was not saved");
            if let Some(c) = self.bm.checkpoints_mut() {
                c.drop_slot(ck);
            }
        }
    }

    /// Where each decoding sequence's verify round copies its state as it
    /// passes its next block boundary (its tail, kept for the end of its
    /// request): for sequences whose rows may reach that boundary.
    /// `rows[i]`: `(sequence, tokens, deepest row)` of decode `i`. Empty
    /// for a target without checkpoints.
    pub(super) fn snapshots(&mut self, rows: &[(SeqId, usize, usize)]) -> Vec<Option<Snapshot>> {
        if self.bm.checkpoints().is_none() {
            return Vec::new();
        }
        let bs = self.bm.block_size();
        rows.iter()
            .map(|&(id, len, depth)| {
                // The state holds `len - 1` tokens; the round may absorb up
                // to `depth + 1` more.
                let absorbed = len.checked_sub(1)?;
                let at = (absorbed / bs + 1) * bs;
                if at > absorbed + depth + 1 {
                    return None;
                }
                let slot = self.bm.checkpoints_mut()?.tail_for(id)?;
                Some(Snapshot { at, slot })
            })
            .collect()
    }

    /// Records the boundaries the round's snapshots saved.
    pub(super) fn snapshots_saved(&mut self, saved: &[(SeqId, usize)]) {
        if let Some(c) = self.bm.checkpoints_mut() {
            for &(id, at) in saved {
                c.tail_saved(id, at);
            }
        }
    }
}
