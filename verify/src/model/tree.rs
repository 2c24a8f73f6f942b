//! Token-tree verification in one forward: the family-neutral part. A
//! sequence whose new rows are a [`TokenTree`] (row 0 its last committed
//! token, row `1 + i` tree node `i`) gets, per row, the cache slot its K/V
//! goes to, its RoPE position, and the slots it may attend
//! ([`TreeAttn`]); a family's forward then reads those instead of "slot ==
//! position, attend everything before". The llama family and Kimi K3
//! implement it; the others refuse with a typed error.
//!
//! Slots versus positions: the rows of a tree sit at distinct, contiguous
//! cache slots `start_pos + row` (so the block table the chain path
//! reserves fits), while node `i`'s position is `start_pos + depth(i)`
//! (siblings share one). A row attends the sequence's cached slots
//! `0..start_pos`, row 0, its ancestors' rows and itself, in that (slot)
//! order, never a sibling or a cousin. For a chain every row's slot is its
//! position and its visible slots are `0..=position`, in the same order:
//! the same operations as the plain forward, so the same bits.
//!
//! Kimi K3 (ranks as threads only) reads the same slots in its MLA layers,
//! and each KDA row continues from its parent row's recurrent state
//! (`kimi_k3/tree.rs`), so committing the accepted leaf is
//! `KvPool::keep_rows(slot, last_kept_row + 1)`.

use super::rows::{flatten, LogitsWanted, Rows, SeqInput};
use super::{kimi_k3, llama, Body, Model};
use crate::error::{Result, VerifyError};
use crate::kv_pool::KvPool;
use crate::tree_accept::TokenTree;
use candle_core::Tensor;

/// Per flattened row of a forward with trees: where its K/V is written
/// and which slots it attends. Rows of sequences without a tree keep the
/// plain rule (slot == position, visible `0..=position`).
///
/// Invariant: `extra[r]` is ascending and every entry is `>= prefix[r]`.
pub(crate) struct TreeAttn {
    /// The cache slot row `r`'s K/V is written to.
    pub(crate) slot: Vec<usize>,
    /// Row `r` attends slots `0..prefix[r]` ...
    pub(crate) prefix: Vec<usize>,
    /// ... and then these slots (its tree ancestors' and its own).
    pub(crate) extra: Vec<Vec<usize>>,
}

impl TreeAttn {
    /// Lays out `rows` (flattened from `seqs`) for `trees` (aligned with
    /// `seqs`), rewriting the positions of tree rows to their RoPE
    /// positions.
    ///
    /// Errors ([`VerifyError::BadBatch`]): `trees` and `seqs` of different
    /// lengths; for a sequence with a tree, tokens other than
    /// `1 + tree.len()`, a token other than its node's, or logits other
    /// than [`LogitsWanted::All`].
    fn build(rows: &mut Rows, seqs: &[SeqInput], trees: &[Option<&TokenTree>]) -> Result<Self> {
        if trees.len() != seqs.len() {
            return Err(VerifyError::BadBatch(format!(
                "{} trees for a batch of {} sequences",
                trees.len(),
                seqs.len()
            )));
        }
        let n = rows.tokens.len();
        let mut attn = TreeAttn {
            slot: rows.positions.clone(),
            prefix: rows.positions.iter().map(|p| p + 1).collect(),
            extra: vec![Vec::new(); n],
        };
        let mut base = 0;
        for (si, (s, tree)) in seqs.iter().zip(trees).enumerate() {
            let here = base;
            base += s.tokens.len();
            let Some(tree) = tree else { continue };
            if s.tokens.len() != tree.len() + 1 {
                return Err(VerifyError::BadBatch(format!(
                    "sequence {si}: {} tokens for a tree of {} nodes (need the last committed \
                     token and one per node)",
                    s.tokens.len(),
                    tree.len()
                )));
            }
            if let Some(i) = (0..tree.len()).find(|&i| s.tokens[1 + i] != tree.token(i)) {
                return Err(VerifyError::BadBatch(format!(
                    "sequence {si}: row {} holds token {}, tree node {i} is {}",
                    1 + i,
                    s.tokens[1 + i],
                    tree.token(i)
                )));
            }
            if s.logits != LogitsWanted::All {
                return Err(VerifyError::BadBatch(format!(
                    "sequence {si}: a tree's rows are verified together, so it must ask for \
                     every row's logits"
                )));
            }
            let start = s.start_pos;
            attn.prefix[here] = start;
            attn.extra[here] = vec![start];
            for i in 0..tree.len() {
                let r = here + 1 + i;
                rows.positions[r] = start + tree.depth(i);
                attn.prefix[r] = start;
                attn.extra[r] = std::iter::once(start)
                    .chain(tree.path(i).into_iter().map(|a| start + 1 + a))
                    .collect();
            }
        }
        Ok(attn)
    }
}

impl Model {
    /// [`Model::forward`] where some sequences' new rows form a token tree:
    /// `trees[s]` (aligned with `seqs`) is `Some(tree)` for such a
    /// sequence, whose `tokens` are then its last committed token followed
    /// by the tree's node tokens (`1 + tree.len()` rows, all of whose
    /// logits it must ask for). Row 0 is at position `start_pos`, node `i`
    /// at position `start_pos + tree.depth(i)` with its K/V written at
    /// cache slot `start_pos + 1 + i`; every row attends the cached slots
    /// `0..start_pos`, row 0, its ancestors and itself, never a sibling or
    /// a cousin (see this module's doc). Logits come back in batch order,
    /// one row per row. A chain-shaped tree gives exactly the plain
    /// forward's bits; after acceptance, [`KvPool::compact_rows`] moves the
    /// kept rows to consecutive slots.
    ///
    /// Errors ([`VerifyError::BadBatch`]): everything [`Model::forward`]
    /// refuses (a block table must address slots up to
    /// `start_pos + tokens.len()`, and so must the model's context), a
    /// malformed tree input (see `TreeAttn::build`), a family other than
    /// llama/qwen2 and Kimi K3 ("tree verification is not supported for
    /// ... yet"), or a model run as processes.
    ///
    /// A recurrent model (Kimi K3) records each row's state by row index,
    /// each row continuing from its parent row's (row 0 from the slot's):
    /// `KvPool::keep_rows(slot, last + 1)`, `last` the last of
    /// [`crate::TreeVerdict::rows_to_keep`], commits the accepted leaf's.
    pub fn forward_trees(
        &self,
        pool: &mut KvPool,
        seqs: &[SeqInput],
        trees: &[Option<&TokenTree>],
    ) -> Result<Tensor> {
        if let Some(family) = self.tree_refusal() {
            return Err(VerifyError::BadBatch(format!(
                "tree verification is not supported for {family} yet"
            )));
        }
        let mut rows = flatten(self, pool, seqs)?;
        let attn = TreeAttn::build(&mut rows, seqs, trees)?;
        match &self.body {
            Body::Llama(shards) => {
                llama::forward_rows(self, shards, pool, seqs, &rows, Some(&attn))
            }
            Body::KimiK3(ranks) => {
                let trees = kimi_k3::Trees { attn: &attn, trees };
                kimi_k3::forward_rows(self, ranks, pool, seqs, &rows, Some(trees))
            }
            _ => unreachable!("refused above"),
        }
    }

    /// Whether [`Model::forward_trees`] verifies trees for this model (else
    /// it refuses every call, and a caller drafts chains only).
    pub fn supports_trees(&self) -> bool {
        self.tree_refusal().is_none()
    }

    /// What [`Model::forward_trees`] names when it refuses this model.
    fn tree_refusal(&self) -> Option<&'static str> {
        match &self.body {
            Body::Llama(_) | Body::KimiK3(_) if self.leader.is_some() => {
                Some("a model run as processes")
            }
            Body::Llama(_) | Body::KimiK3(_) => None,
            Body::Deepseek(_) => Some("the DeepSeek-V3 family"),
            Body::Scripted(_) => Some("the scripted model"),
        }
    }

    /// [`Model::forward_trees`] for one sequence (its `logits` field is
    /// ignored: every row's come back), as one `Vec<f32>` per row: row 0
    /// after the last committed token, row `1 + i` after node `i`, the
    /// indexing [`crate::accept_tree`] takes.
    ///
    /// Errors: as [`Model::forward_trees`].
    pub fn forward_tree(
        &self,
        pool: &mut KvPool,
        seq: &SeqInput,
        tree: &TokenTree,
    ) -> Result<Vec<Vec<f32>>> {
        let seq = SeqInput {
            logits: LogitsWanted::All,
            ..*seq
        };
        Ok(self
            .forward_trees(pool, &[seq], &[Some(tree)])?
            .to_vec2::<f32>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows_of(seqs: &[SeqInput]) -> Rows {
        let mut rows = Rows {
            tokens: Vec::new(),
            positions: Vec::new(),
            seq: Vec::new(),
            logit_rows: Vec::new(),
        };
        for (si, s) in seqs.iter().enumerate() {
            rows.tokens.extend_from_slice(s.tokens);
            rows.positions
                .extend(s.start_pos..s.start_pos + s.tokens.len());
            rows.seq.extend(std::iter::repeat_n(si, s.tokens.len()));
        }
        rows
    }

    fn seq(tokens: &[u32], start_pos: usize) -> SeqInput<'_> {
        SeqInput {
            tokens,
            start_pos,
            block_table: &[],
            logits: LogitsWanted::All,
            state_slot: 0,
        }
    }

    #[test]
    fn tree_rows_get_depth_positions_distinct_slots_and_ancestors_only() {
        // root -> a(0), b(1); a -> c(2); b -> d(3); c -> e(4)
        let tree = TokenTree::from_nodes([
            (10, None),
            (11, None),
            (12, Some(0)),
            (13, Some(1)),
            (14, Some(2)),
        ])
        .unwrap();
        let plain = [7u32, 8];
        let treed = [9u32, 10, 11, 12, 13, 14];
        let seqs = [seq(&plain, 3), seq(&treed, 20)];
        let mut rows = rows_of(&seqs);
        let a = TreeAttn::build(&mut rows, &seqs, &[None, Some(&tree)]).unwrap();
        assert_eq!(rows.positions, [3, 4, 20, 21, 21, 22, 22, 23]);
        assert_eq!(a.slot, [3, 4, 20, 21, 22, 23, 24, 25]);
        assert_eq!(a.prefix, [4, 5, 20, 20, 20, 20, 20, 20]);
        let extra: Vec<&[usize]> = a.extra.iter().map(Vec::as_slice).collect();
        assert_eq!(
            extra,
            [
                &[][..],
                &[],
                &[20],
                &[20, 21],
                &[20, 22],
                &[20, 21, 23],
                &[20, 22, 24],
                &[20, 21, 23, 25],
            ]
        );
    }

    #[test]
    fn a_chain_keeps_the_plain_rule() {
        let tree = TokenTree::chain(&[5, 6, 7]);
        let toks = [4u32, 5, 6, 7];
        let seqs = [seq(&toks, 9)];
        let mut rows = rows_of(&seqs);
        let a = TreeAttn::build(&mut rows, &seqs, &[Some(&tree)]).unwrap();
        for r in 0..4 {
            assert_eq!(rows.positions[r], 9 + r);
            assert_eq!(a.slot[r], 9 + r);
            let visible: Vec<usize> = (0..a.prefix[r]).chain(a.extra[r].clone()).collect();
            assert_eq!(visible, (0..=9 + r).collect::<Vec<_>>());
        }
    }

    #[test]
    fn malformed_tree_inputs_are_bad_batches() {
        let tree = TokenTree::from_nodes([(5, None), (6, None)]).unwrap();
        let check = |toks: &[u32], logits, trees: &[Option<&TokenTree>], want: &str| {
            let seqs = [SeqInput {
                logits,
                ..seq(toks, 2)
            }];
            let mut rows = rows_of(&seqs);
            let e = TreeAttn::build(&mut rows, &seqs, trees).err().expect(want);
            assert!(
                matches!(&e, VerifyError::BadBatch(m) if m.contains(want)),
                "{e} lacks {want}"
            );
        };
        let all = LogitsWanted::All;
        check(
            &[4, 5],
            all,
            &[Some(&tree)],
            "2 tokens for a tree of 2 nodes",
        );
        check(
            &[4, 5, 7],
            all,
            &[Some(&tree)],
            "row 2 holds token 7, tree node 1 is 6",
        );
        check(
            &[4, 5, 6],
            LogitsWanted::Last,
            &[Some(&tree)],
            "every row's logits",
        );
        check(&[4, 5, 6], all, &[], "0 trees for a batch of 1");
    }
}
