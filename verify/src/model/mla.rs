//! Multi-head latent attention over the latent paged cache, shared by the
//! families that use it (DeepSeek-V3 / Kimi K2, and Kimi K3's MLA layers):
//! the absorbed form, where a query is mapped into the latent space once
//! per head and scored against cached latent rows in place (f32 or bf16,
//! as the pool stores them: `kv_pool::LatentRow`). With a token tree
//! ([`TreeAttn`]) a row reads only the slots the tree lets it see.

use super::dense::Dense;
use super::rows::Rows;
use super::tree::TreeAttn;
use crate::kernels::vector::{axpy, dot};
use crate::kv_pool::KvShard;
use crate::team::{self, SharedMut};
use std::cell::RefCell;

/// Dimensions one attention call needs.
#[derive(Clone, Copy)]
pub(crate) struct MlaDims {
    pub(crate) heads: usize,
    pub(crate) nope: usize,
    pub(crate) rope: usize,
    pub(crate) v: usize,
    pub(crate) kvr: usize,
    pub(crate) scale: f32,
}

/// What [`attend_head`] keeps between calls: scores, latent query, latent
/// output, and the latent row being read, widened to f32.
type RowScratch = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// One query's score against a cached latent row (as f32): its latent
/// query against the latent part, its RoPE part against the shared key.
/// Every attention path scores with this, so a row's numbers do not depend
/// on which path or block computed them.
#[inline]
fn score(row: &[f32], q_lat: &[f32], qr: &[f32], d: MlaDims) -> f32 {
    (dot(q_lat, &row[..d.kvr]) + dot(qr, &row[d.kvr..d.kvr + qr.len()])) * d.scale
}

/// Absorbed attention of head `hh` of one query row (`q`: this rank's
/// heads, each `nope + rope`, RoPE applied) over slots `0..prefix` and
/// then `extra` of a sequence's latent cache, in that order; writes the
/// head's `v` floats to `out`. `scratch` holds `(scores, q_lat, o_lat,
/// widened latent row)` between calls. A row whose slots are
/// `0..prefix + extra.len()` gets the bits of `prefix + extra.len()`
/// contiguous slots.
#[allow(clippy::too_many_arguments)]
fn attend_head(
    d: MlaDims,
    kv_b: &Dense,
    pool: &KvShard,
    layer: usize,
    table: &[u32],
    (prefix, extra): (usize, &[usize]),
    q: &[f32],
    hh: usize,
    out: &mut [f32],
    scratch: &mut RowScratch,
) {
    let (scores, q_lat, o_lat, wide) = scratch;
    let qk = d.nope + d.rope;
    let ctx = prefix + extra.len();
    let slot = |t: usize| if t < prefix { t } else { extra[t - prefix] };
    scores.resize(ctx, 0.0);
    let qn = &q[hh * qk..hh * qk + d.nope];
    let qr = &q[hh * qk + d.nope..(hh + 1) * qk];
    let base = hh * (d.nope + d.v);
    // q_lat = W_UK^T q_nope: the query seen from the latent space.
    q_lat.clear();
    q_lat.resize(d.kvr, 0.0);
    for (j, &a) in qn.iter().enumerate() {
        axpy(a, kv_b.row(base + j), q_lat);
    }
    let mut max = f32::NEG_INFINITY;
    for (t, s) in scores.iter_mut().enumerate() {
        let row = pool.latent_row(layer, table, slot(t));
        let row = row.as_f32(wide);
        *s = score(row, q_lat, qr, d);
        max = max.max(*s);
    }
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    o_lat.clear();
    o_lat.resize(d.kvr, 0.0);
    for (t, &s) in scores.iter().enumerate() {
        let row = pool.latent_row(layer, table, slot(t));
        axpy(s * inv, &row.as_f32(wide)[..d.kvr], o_lat);
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot(kv_b.row(base + d.nope + j), o_lat);
    }
}

/// Query rows of one sequence scored together by [`attend_head_block`]:
/// each cached latent row is read once for all of them (from L1 for all
/// but the first), where row by row the whole latent cache streams from
/// memory again for every query row and head (a prompt chunk over a long
/// history: hundreds of rows times the cache).
const BLOCK_ROWS: usize = 16;

/// What [`attend_head_block`] keeps between calls: scores (`rows * ctx`),
/// and per row its latent query and output (`rows * kvr` each).
#[derive(Default)]
struct BlockScratch {
    scores: Vec<f32>,
    q_lat: Vec<f32>,
    o_lat: Vec<f32>,
    /// The latent row being read, widened to f32 (a bf16 cache).
    wide: Vec<f32>,
}

/// [`attend_head`] for several query rows of one sequence at once: row `i`
/// (query `qs[i]`) attends slots `0..ctxs[i]` and writes `outs[i]`. Every
/// row's numbers are [`attend_head`]'s bit for bit: each one's dot
/// products, softmax and sums run in the same order; only the loops over
/// slots are shared, so a latent row is read once for the whole block.
#[allow(clippy::too_many_arguments)]
fn attend_head_block(
    d: MlaDims,
    kv_b: &Dense,
    pool: &KvShard,
    layer: usize,
    table: &[u32],
    ctxs: &[usize],
    qs: &[&[f32]],
    hh: usize,
    outs: &mut [&mut [f32]],
    scratch: &mut BlockScratch,
) {
    let n = ctxs.len();
    let qk = d.nope + d.rope;
    let ctx = ctxs.iter().copied().max().unwrap_or(0);
    let base = hh * (d.nope + d.v);
    let BlockScratch {
        scores,
        q_lat,
        o_lat,
        wide,
    } = scratch;
    scores.clear();
    scores.resize(n * ctx, 0.0);
    q_lat.clear();
    q_lat.resize(n * d.kvr, 0.0);
    for (i, q) in qs.iter().enumerate() {
        let ql = &mut q_lat[i * d.kvr..(i + 1) * d.kvr];
        for (j, &a) in q[hh * qk..hh * qk + d.nope].iter().enumerate() {
            axpy(a, kv_b.row(base + j), ql);
        }
    }
    for t in 0..ctx {
        let row = pool.latent_row(layer, table, t);
        let row = row.as_f32(wide);
        for i in (0..n).filter(|&i| t < ctxs[i]) {
            let qr = &qs[i][hh * qk + d.nope..(hh + 1) * qk];
            let ql = &q_lat[i * d.kvr..(i + 1) * d.kvr];
            scores[i * ctx + t] = score(row, ql, qr, d);
        }
    }
    let mut inv = [0f32; BLOCK_ROWS];
    for i in 0..n {
        let s = &mut scores[i * ctx..i * ctx + ctxs[i]];
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0.0;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        inv[i] = 1.0 / sum;
    }
    o_lat.clear();
    o_lat.resize(n * d.kvr, 0.0);
    for t in 0..ctx {
        let row = pool.latent_row(layer, table, t);
        let row = &row.as_f32(wide)[..d.kvr];
        for i in (0..n).filter(|&i| t < ctxs[i]) {
            axpy(
                scores[i * ctx + t] * inv[i],
                row,
                &mut o_lat[i * d.kvr..(i + 1) * d.kvr],
            );
        }
    }
    for (i, out) in outs.iter_mut().enumerate() {
        let ol = &o_lat[i * d.kvr..(i + 1) * d.kvr];
        for (j, o) in out.iter_mut().enumerate() {
            *o = dot(kv_b.row(base + d.nope + j), ol);
        }
    }
}

/// Absorbed attention for every row of a batch but those `skip` names:
/// row `r` (sequence `rows.seq[r]`, table `tables[..]`) attends slots
/// `0..=rows.positions[r]` (with `tree`: the slots it lists for row `r`)
/// with its query `q[r]` (`heads * (nope + rope)`
/// floats) into `out[r]` (`heads * v` floats). Parallel over heads, each
/// taking every row in turn: a head's slice of `kv_b` (`nope + v` rows of
/// `kvr` floats) is then read from memory once per call and from cache for
/// its other rows, where (row, head) pairs in row order read all of `kv_b`
/// again for every row (33.5 MB at K3's widths, 4 rows of a verify pass:
/// the MLA layer took 2.5x its 1-row time). A single decode row still
/// spreads its heads over the cores; each head's numbers are the same
/// whichever thread computes them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_rows(
    d: MlaDims,
    kv_b: &Dense,
    pool: &KvShard,
    layer: usize,
    rows: &Rows,
    tables: &[&[u32]],
    q: &[f32],
    out: &mut [f32],
    skip: impl Fn(usize) -> bool + Sync,
    tree: Option<&TreeAttn>,
) {
    let qd = d.heads * (d.nope + d.rope);
    let n = rows.tokens.len();
    assert!(out.len() >= n * d.heads * d.v && q.len() >= n * qd);
    // The forward's thread team, not rayon's pool: its helpers spin between
    // loops, and a second pool on the same cores would fight them.
    thread_local! {
        static SCRATCH: RefCell<RowScratch> = const {
            RefCell::new((Vec::new(), Vec::new(), Vec::new(), Vec::new()))
        };
        static BLOCK: RefCell<BlockScratch> = RefCell::new(BlockScratch::default());
    }
    let live: Vec<usize> = (0..n).filter(|&r| !skip(r)).collect();
    // Runs of rows of one sequence (no tree), at most BLOCK_ROWS each: a
    // prompt chunk's rows, a chain's verify rows.
    let mut blocks: Vec<&[usize]> = Vec::new();
    if tree.is_none() {
        let mut rest = &live[..];
        while let Some(&first) = rest.first() {
            let len = rest
                .iter()
                .take(BLOCK_ROWS)
                .take_while(|&&r| rows.seq[r] == rows.seq[first])
                .count();
            blocks.push(&rest[..len]);
            rest = &rest[len..];
        }
    }
    let dst = SharedMut::new(out);
    if !blocks.is_empty() {
        team::for_each(d.heads, |hh| {
            BLOCK.with_borrow_mut(|scratch| {
                for block in &blocks {
                    let ctxs: Vec<usize> = block.iter().map(|&r| rows.positions[r] + 1).collect();
                    let qs: Vec<&[f32]> = block.iter().map(|&r| &q[r * qd..(r + 1) * qd]).collect();
                    // SAFETY: head hh writes only its own `v` floats of
                    // each row of the block, inside `out` (asserted above);
                    // no other task touches them while these slices live.
                    let mut outs: Vec<&mut [f32]> = block
                        .iter()
                        .map(|&r| unsafe {
                            std::slice::from_raw_parts_mut(dst.at((r * d.heads + hh) * d.v), d.v)
                        })
                        .collect();
                    let table = tables[rows.seq[block[0]]];
                    attend_head_block(
                        d, kv_b, pool, layer, table, &ctxs, &qs, hh, &mut outs, scratch,
                    );
                }
            })
        });
        return;
    }
    team::for_each(d.heads, |hh| {
        SCRATCH.with_borrow_mut(|scratch| {
            for r in live.iter().copied() {
                // SAFETY: head hh writes only its own `v` floats of row r,
                // inside `out` (asserted above); no other task touches
                // them while this slice lives.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(dst.at((r * d.heads + hh) * d.v), d.v)
                };
                attend_head(
                    d,
                    kv_b,
                    pool,
                    layer,
                    tables[rows.seq[r]],
                    match tree {
                        Some(t) => (t.prefix[r], &t.extra[r][..]),
                        None => (rows.positions[r] + 1, &[][..]),
                    },
                    &q[r * qd..(r + 1) * qd],
                    hh,
                    o,
                    scratch,
                );
            }
        })
    });
}
