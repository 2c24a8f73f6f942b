//! Kimi K3 over a token tree ([`crate::Model::forward_trees`]): which row's
//! recurrent state each row continues from, and the short convolutions of
//! a tree's rows.
//!
//! A tree's rows are row 0 (the last committed token) and row `1 + i`
//! (node `i`). A KDA layer's state after a row is a function of the state
//! before it and the row's token, so a node must continue from its
//! PARENT's row, never from the row stored before it (a sibling's, or a
//! cousin's): row 0 from the slot's committed state, node `i` from row
//! `1 + parent(i)` (row 0 for the root's children). The conv histories
//! (the last `kernel - 1` inputs) follow the same rule. Each row's state
//! is recorded by row index exactly as for a chain (rows `0..n - 1` in the
//! per-row buffer, row `n - 1` the slot's live state), so committing the
//! accepted leaf is `KvPool::keep_rows(slot, last_kept_row + 1)`. A
//! parent's row always comes before its children's (a [`TokenTree`]
//! stores parents first), so the parent's state is ready when a child
//! needs it; a chain's rows continue from the row before, so a chain is
//! the plain forward's computation, bit for bit.
//!
//! The MLA layers need only the tree's slots and visible slots
//! ([`TreeAttn`]): they are NoPE, so a row's position plays no part.

use super::kda;
use crate::model::rows::SeqInput;
use crate::model::tree::TreeAttn;
use crate::tree_accept::TokenTree;
use std::ops::Range;

/// The token trees of one forward, as the K3 layers read them.
#[derive(Clone, Copy)]
pub(crate) struct Trees<'a> {
    /// Per flattened row: its cache slot and visible slots.
    pub(crate) attn: &'a TreeAttn,
    /// Aligned with the forward's sequences.
    pub(crate) trees: &'a [Option<&'a TokenTree>],
}

/// One sequence's rows in a forward and where its recurrent state lives.
pub(super) struct Span {
    /// Its rows among the forward's flattened rows.
    pub(super) rows: Range<usize>,
    pub(super) slot: u32,
    /// For a sequence verifying a non-empty tree: per row `t >= 1`, the
    /// row (in the span) whose state row `t` continues from (entry 0 is
    /// unused, row 0 continues from the slot). `None`: a chain, each row
    /// after the one before.
    pub(super) parents: Option<Vec<usize>>,
}

impl Span {
    /// The spans of `seqs`, with their trees' parent rows.
    pub(super) fn of(seqs: &[SeqInput], trees: Option<Trees>) -> Vec<Span> {
        let mut start = 0;
        seqs.iter()
            .enumerate()
            .map(|(si, s)| {
                let rows = start..start + s.tokens.len();
                start = rows.end;
                let tree = trees.and_then(|t| t.trees[si]).filter(|t| !t.is_empty());
                let parents = tree.map(|t| {
                    std::iter::once(0)
                        .chain((0..t.len()).map(|i| t.parent(i).map_or(0, |p| 1 + p)))
                        .collect()
                });
                Span {
                    rows,
                    slot: s.state_slot,
                    parents,
                }
            })
            .collect()
    }

    /// The row whose state row `t > 0` continues from, where that is not
    /// row `t - 1` (a tree row whose parent was not stored just before
    /// it); `None` otherwise.
    pub(super) fn jump(&self, t: usize) -> Option<usize> {
        let p = *self.parents.as_ref()?.get(t)?;
        (t > 0 && p + 1 != t).then_some(p)
    }
}

/// The causal conv + SiLU of one tree's rows `x` (`[n, c]`, `n >= 1`): row
/// 0 continues from `now` (the slot's conv history of this projection),
/// row `t >= 1` from row `parents[t]`'s history. Leaves row `n - 1`'s
/// history in `now` and, where `snap` is given, row `t`'s (for
/// `t < n - 1`) at `snap[t * stride + off..]`, as a chain's verification
/// records them. Returns `[n, c]`.
pub(super) fn conv_rows(
    x: &[f32],
    now: &mut [f32],
    w: &[f32],
    kernel: usize,
    parents: &[usize],
    snap: Option<(&mut [f32], usize, usize)>,
) -> Vec<f32> {
    let c = w.len() / kernel;
    let hist = now.len();
    let n = x.len() / c;
    debug_assert!(n >= 1 && parents.len() >= n && hist == (kernel - 1) * c);
    // The history after each row; row t's input window is its parent's.
    let mut hists = vec![0f32; n * hist];
    let mut out = Vec::with_capacity(n * c);
    let mut h = now.to_vec();
    for t in 0..n {
        if t > 0 {
            let p = parents[t];
            debug_assert!(p < t, "a tree stores parents first");
            h.copy_from_slice(&hists[p * hist..(p + 1) * hist]);
        }
        // One row at a time: the same taps in the same order as a whole
        // chain's call (kda's conv test), so a chain keeps its bits.
        out.extend(kda::conv_silu(&x[t * c..(t + 1) * c], &mut h, w, kernel));
        hists[t * hist..(t + 1) * hist].copy_from_slice(&h);
    }
    if let Some((buf, stride, off)) = snap {
        for t in 0..n - 1 {
            buf[t * stride + off..][..hist].copy_from_slice(&hists[t * hist..(t + 1) * hist]);
        }
    }
    now.copy_from_slice(&hists[(n - 1) * hist..]);
    out
}

#[cfg(test)]
#[path = "tree_tests.rs"]
mod tests;
