//! What the draft's pool holds per block: which token prefix the draft's
//! K/V in a full block was computed for, so a sequence whose prompt the
//! target found in its prefix cache (the same block ids, shared with an
//! earlier sequence) can reuse the draft's K/V there too instead of
//! running the whole cached prompt through the draft on its first
//! proposal.
//!
//! A block is named by the chain hash of every token up to its end (as a
//! prefix cache names it), recorded only for what the draft itself wrote
//! there; a write forgets the blocks it touches first. So an entry is
//! always true of the pool's contents: a block reused for other tokens
//! (by the target or by a sequence that does not draft) keeps its old
//! entry, which still describes the draft K/V there, and the new tokens'
//! hash does not match it. A 64-bit collision could only make a draft
//! worse (proposals are only proposals), never an output wrong.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

/// Block id -> chain hash of the tokens whose draft K/V it holds.
#[derive(Debug, Clone)]
pub(crate) struct BlockContents {
    block_size: usize,
    held: HashMap<u32, u64>,
}

/// The chain hash of each full block of `tokens`, in order.
fn chain(tokens: &[u32], block_size: usize) -> impl Iterator<Item = u64> + '_ {
    let mut prev = 0u64;
    tokens.chunks_exact(block_size).map(move |block| {
        let mut h = DefaultHasher::new();
        prev.hash(&mut h);
        block.hash(&mut h);
        prev = h.finish();
        prev
    })
}

impl BlockContents {
    pub(crate) fn new(block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            held: HashMap::new(),
        }
    }

    /// Before a forward writes positions `from..to` through `table`:
    /// those blocks no longer hold what their entries say.
    pub(crate) fn forget(&mut self, table: &[u32], from: usize, to: usize) {
        if from >= to {
            return;
        }
        let bs = self.block_size;
        for b in table.iter().take(to.div_ceil(bs)).skip(from / bs) {
            self.held.remove(b);
        }
    }

    /// After a forward: the draft's K/V at `table`'s positions
    /// `..tokens.len()` is `tokens`' (it wrote `from..` itself and held the
    /// rest): the full blocks from the one holding `from` on are recorded.
    pub(crate) fn record(&mut self, table: &[u32], tokens: &[u32], from: usize) {
        let first = from / self.block_size;
        for (i, h) in chain(tokens, self.block_size).enumerate().skip(first) {
            match table.get(i) {
                Some(&b) => {
                    self.held.insert(b, h);
                }
                None => break,
            }
        }
    }

    /// How many of `tokens` the draft's pool already holds at `table`,
    /// given that it holds the first `held`: when `held` ends a block,
    /// every following full block whose entry names these tokens, up to
    /// `limit` tokens.
    pub(crate) fn extend(&self, table: &[u32], tokens: &[u32], held: usize, limit: usize) -> usize {
        let bs = self.block_size;
        if !held.is_multiple_of(bs) {
            return held;
        }
        let limit = limit.min(tokens.len());
        let mut len = held;
        for (i, h) in chain(&tokens[..limit], bs).enumerate().skip(held / bs) {
            if table.get(i).and_then(|b| self.held.get(b)) != Some(&h) {
                break;
            }
            len = (i + 1) * bs;
        }
        len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_is_found_and_a_rewritten_block_is_not() {
        let mut c = BlockContents::new(4);
        let a: Vec<u32> = (0..14).collect();
        // Sequence A's draft wrote 0..14 into blocks 7, 3, 9, 5.
        c.forget(&[7, 3, 9, 5], 0, 14);
        c.record(&[7, 3, 9, 5], &a, 0);
        // B shares A's first 12 tokens and (through the prefix cache) its
        // first three blocks; it holds nothing yet.
        let mut b = a[..12].to_vec();
        b.extend([99, 98, 97]);
        assert_eq!(c.extend(&[7, 3, 9, 6], &b, 0, b.len() - 1), 12);
        // Never past the limit, in whole blocks.
        assert_eq!(c.extend(&[7, 3, 9, 6], &b, 0, 10), 8);
        // Only from a block boundary.
        assert_eq!(c.extend(&[7, 3, 9, 6], &b, 3, 14), 3);
        // Other tokens in the same blocks do not match.
        let other: Vec<u32> = (100..115).collect();
        assert_eq!(c.extend(&[7, 3, 9, 6], &other, 0, 14), 0);
        // A tail that differs in block 1 stops there.
        let mut d = a.clone();
        d[5] = 1000;
        assert_eq!(c.extend(&[7, 3, 9, 5], &d, 0, 13), 4);
        // Block 3 is rewritten for other tokens (another sequence drafted
        // there): A's prefix now ends at block 1.
        c.forget(&[1, 3], 4, 6);
        assert_eq!(c.extend(&[7, 3, 9, 6], &b, 0, 14), 4);
        c.record(&[1, 3], &other[..8], 0);
        assert_eq!(c.extend(&[1, 3], &other, 0, 14), 8);
        assert_eq!(c.extend(&[7, 3, 9, 6], &b, 0, 14), 4);
    }

    #[test]
    fn the_same_tokens_in_another_block_order_do_not_match() {
        let mut c = BlockContents::new(2);
        let t = [1, 2, 3, 4];
        c.record(&[0, 1], &t, 0);
        assert_eq!(c.extend(&[0, 1], &t, 0, 4), 4);
        assert_eq!(c.extend(&[1, 0], &t, 0, 4), 0);
        // A prefix hash depends on everything before the block.
        assert_eq!(c.extend(&[5, 1], &[9, 9, 3, 4], 0, 4), 0);
    }
}
