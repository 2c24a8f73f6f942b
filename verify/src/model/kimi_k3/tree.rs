//! Kimi K3 over a token tree ([`crate::Model::forward_trees`]): which row's
//! recurrent state each row continues from, and the short convolutions of
//! a sequence's rows, a chain's or a tree's.
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

use super::{kda, Kda};
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

/// One span's `(q, k, v)` rows as its short convolutions, per-row
/// histories recorded, see [`Kda::span_convs`].
type Convs = (Vec<f32>, Vec<f32>, Vec<f32>);

impl Kda {
    /// The short convolutions (+ SiLU) of one span's `q`, `k`, `v` rows,
    /// each continuing from its history in `now` (left holding the last
    /// row's); with `snap`, the histories after each row but the last go
    /// to `snap[t * stride + off + which * hist..]` (`which`: 0 q, 1 k,
    /// 2 v). A tree span's rows continue from their parent rows'
    /// histories ([`conv_rows`]), a chain's from the row before.
    pub(super) fn span_convs(
        &self,
        span: &Span,
        (q, k, v): (&[f32], &[f32], &[f32]),
        [cq, ck, cv]: [&mut [f32]; 3],
        kernel: usize,
        mut snap: Option<&mut [f32]>,
        (stride, off): (usize, usize),
    ) -> Convs {
        let hist = cq.len();
        if let Some(parents) = &span.parents {
            let mut conv = |which: usize, x: &[f32], now: &mut [f32], w: &[f32]| {
                let at = snap.as_deref_mut().map(|b| (b, stride, off + which * hist));
                conv_rows(x, now, w, kernel, parents, at)
            };
            return (
                conv(0, q, cq, &self.q_conv),
                conv(1, k, ck, &self.k_conv),
                conv(2, v, cv, &self.v_conv),
            );
        }
        let c = self.q_conv.len() / kernel;
        let keep = (q.len() / c).saturating_sub(1);
        if let Some(snap) = snap {
            // Each row's conv histories: the kernel - 1 inputs up to it.
            for (which, (x, now)) in [(q, &*cq), (k, &*ck), (v, &*cv)].into_iter().enumerate() {
                let mut win = now.to_vec();
                win.extend_from_slice(x);
                for t in 0..keep {
                    let at = t * stride + off + which * hist;
                    snap[at..at + hist].copy_from_slice(&win[(t + 1) * c..(t + kernel) * c]);
                }
            }
        }
        (
            kda::conv_silu(q, cq, &self.q_conv, kernel),
            kda::conv_silu(k, ck, &self.k_conv, kernel),
            kda::conv_silu(v, cv, &self.v_conv, kernel),
        )
    }
}

/// The causal conv + SiLU of one tree's rows `x` (`[n, c]`, `n >= 1`): row
/// 0 continues from `now` (the slot's conv history of this projection),
/// row `t >= 1` from row `parents[t]`'s history. Leaves row `n - 1`'s
/// history in `now` and, where `snap` is given, row `t`'s (for
/// `t < n - 1`) at `snap[t * stride + off..]`, as a chain's verification
/// records them. Returns `[n, c]`.
fn conv_rows(
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
