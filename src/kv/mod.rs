//! KV block bookkeeping for the whole engine: block ids, the free list, and
//! per-sequence block tables. The tables are used by BOTH the draft's and
//! the target's caches (the physical storage lives in
//! `specgate_verify::KvPool`, indexed by these ids). No tensors here.
//!
//! A sequence's table covers its *capacity* in token slots: the committed
//! tokens plus whatever lookahead was reserved for speculation. After
//! verification the table is trimmed back to what was accepted, returning
//! whole blocks to the free list.

use std::collections::HashMap;

/// Identifies a sequence to the block manager.
pub type SeqId = u64;

/// Errors of block bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("out of KV blocks: need {needed}, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("sequence {0} already has blocks")]
    AlreadyAllocated(SeqId),
    #[error("sequence {0} has no blocks")]
    UnknownSequence(SeqId),
}

/// Owner of every block id of one pool.
///
/// Invariants (checked by [`BlockManager::check_invariants`]): every block
/// is either on the free list with reference count 0, or referenced by
/// tables exactly as many times as its count says; no block is both.
pub struct BlockManager {
    block_size: usize,
    free: Vec<u32>,
    ref_counts: Vec<u32>,
    tables: HashMap<SeqId, Vec<u32>>,
}

impl BlockManager {
    /// A manager of `num_blocks` blocks of `block_size` token slots.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        Self {
            block_size,
            // Reversed so blocks are handed out in ascending order.
            free: (0..num_blocks as u32).rev().collect(),
            ref_counts: vec![0; num_blocks],
            tables: HashMap::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Fraction of blocks in use, in [0, 1].
    pub fn usage(&self) -> f64 {
        if self.num_blocks() == 0 {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.num_blocks() as f64
    }

    /// Blocks that hold `tokens` token slots.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// The sequence's block table, if it has one.
    pub fn table(&self, seq: SeqId) -> Option<&[u32]> {
        self.tables.get(&seq).map(Vec::as_slice)
    }

    /// Token slots the sequence's table covers.
    pub fn capacity(&self, seq: SeqId) -> usize {
        self.tables
            .get(&seq)
            .map_or(0, |t| t.len() * self.block_size)
    }

    /// Gives a new sequence a table covering `tokens` slots.
    ///
    /// Errors: the sequence already has blocks, or too few are free (then
    /// nothing changes).
    pub fn allocate(&mut self, seq: SeqId, tokens: usize) -> Result<(), KvError> {
        if self.tables.contains_key(&seq) {
            return Err(KvError::AlreadyAllocated(seq));
        }
        let needed = self.blocks_for(tokens);
        self.ensure_free(needed)?;
        let table = (0..needed).map(|_| self.take_free()).collect();
        self.tables.insert(seq, table);
        Ok(())
    }

    /// Grows the sequence's table to cover at least `tokens` slots (e.g. the
    /// committed tokens plus k + 1 lookahead slots for speculation).
    ///
    /// Errors: unknown sequence, or too few free blocks (nothing changes).
    pub fn reserve(&mut self, seq: SeqId, tokens: usize) -> Result<(), KvError> {
        let have = self
            .tables
            .get(&seq)
            .ok_or(KvError::UnknownSequence(seq))?
            .len();
        let needed = self.blocks_for(tokens).saturating_sub(have);
        self.ensure_free(needed)?;
        let new: Vec<u32> = (0..needed).map(|_| self.take_free()).collect();
        self.tables.get_mut(&seq).expect("checked").extend(new);
        Ok(())
    }

    /// Shrinks the sequence's table to the blocks that `tokens` slots need,
    /// freeing the rest (e.g. lookahead blocks of rejected drafts).
    pub fn trim(&mut self, seq: SeqId, tokens: usize) -> Result<(), KvError> {
        let keep = self.blocks_for(tokens);
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        if keep >= table.len() {
            return Ok(());
        }
        let dropped: Vec<u32> = table.drain(keep..).collect();
        for b in dropped {
            self.release_block(b);
        }
        Ok(())
    }

    /// Frees every block of a finished, cancelled or preempted sequence.
    /// Freeing an unknown sequence is a no-op (idempotent cleanup).
    pub fn free(&mut self, seq: SeqId) {
        if let Some(table) = self.tables.remove(&seq) {
            for b in table {
                self.release_block(b);
            }
        }
    }

    fn ensure_free(&self, needed: usize) -> Result<(), KvError> {
        if needed > self.free.len() {
            return Err(KvError::OutOfBlocks {
                needed,
                free: self.free.len(),
            });
        }
        Ok(())
    }

    fn take_free(&mut self) -> u32 {
        let b = self.free.pop().expect("ensure_free checked");
        self.ref_counts[b as usize] = 1;
        b
    }

    fn release_block(&mut self, b: u32) {
        let rc = &mut self.ref_counts[b as usize];
        *rc -= 1;
        if *rc == 0 {
            self.free.push(b);
        }
    }

    /// Verifies the invariants; returns a description of the first breach.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut counted = vec![0u32; self.num_blocks()];
        for (seq, table) in &self.tables {
            for &b in table {
                *counted
                    .get_mut(b as usize)
                    .ok_or(format!("sequence {seq} holds block {b} outside the pool"))? += 1;
            }
        }
        let mut on_free = vec![false; self.num_blocks()];
        for &b in &self.free {
            if std::mem::replace(&mut on_free[b as usize], true) {
                return Err(format!("block {b} is on the free list twice"));
            }
        }
        for b in 0..self.num_blocks() {
            let rc = self.ref_counts[b];
            if on_free[b] && (counted[b] > 0 || rc > 0) {
                return Err(format!("block {b} is both free and owned"));
            }
            if rc != counted[b] {
                return Err(format!(
                    "block {b}: reference count {rc}, tables hold it {} times",
                    counted[b]
                ));
            }
            if !on_free[b] && rc == 0 {
                return Err(format!("block {b} is neither free nor owned"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
