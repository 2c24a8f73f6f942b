//! Multi-head latent attention over the latent paged cache, shared by the
//! families that use it (DeepSeek-V3 / Kimi K2, and Kimi K3's MLA layers):
//! the absorbed form, where a query is mapped into the latent space once
//! per head and scored against cached latent rows in place (f32 or bf16,
//! as the pool stores them: `kv_pool::LatentRow`). With a token tree
//! ([`TreeAttn`]) a row reads only the slots the tree lets it see.
//!
//! Work comes in blocks: query rows of one sequence that read the same
//! list of slots (a prompt chunk's or a verify chain's rows, each its own
//! prefix of it; a tree row alone, with its own list), times a group of
//! heads. A block is two small matrix products over the cached rows, in
//! tiles of [`TILE`] slots: the scores of every (row, head) query, then
//! the probability-weighted sums of the latent rows, both with the
//! register-tiled kernels of [`crate::kernels::attn`]. Those accumulate
//! each value in one order whatever the tiling, so a row's numbers do not
//! depend on the block, the head group or the path that computed them:
//! chunked, whole and token-by-token prefill agree bit for bit, as do a
//! tree and the chain it contains.

use super::dense::Dense;
use super::rows::Rows;
use super::tree::TreeAttn;
use crate::kernels::attn::{scores, weighted_sums};
use crate::kernels::vector::{axpy, dot, exp};
use crate::kernels::Isa;
use crate::kv_pool::{KvShard, LatentRow};
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

/// Query rows of one sequence in one block, at most: each cached latent
/// row is read once for all of them (from cache for all but the first
/// query), where row by row the whole latent cache streams from memory
/// again for every query row (a prompt chunk over a long history:
/// hundreds of rows times the cache).
const BLOCK_ROWS: usize = 16;

/// Heads one task takes: its queries share each latent row read, and
/// enough groups remain to spread a single decode row over the cores.
const HEAD_GROUP: usize = 4;

/// Cached rows read per tile: widened to f32 (a bf16 cache), they stay in
/// L2 while every query of the block reads them (64 x 576 floats at K3's
/// widths: 147 KB).
const TILE: usize = 64;

/// Rows that read one list of slots: slots `0..prefix`, then `extra`.
/// Row `i` (batch row `rows[i]`) attends the first `ctxs[i]` of them.
struct Block<'a> {
    rows: Vec<usize>,
    ctxs: Vec<usize>,
    prefix: usize,
    extra: &'a [usize],
    table: &'a [u32],
}

impl Block<'_> {
    fn slot(&self, t: usize) -> usize {
        if t < self.prefix {
            t
        } else {
            self.extra[t - self.prefix]
        }
    }
}

/// What a task keeps between blocks (per thread).
#[derive(Default)]
struct Scratch {
    /// Per query (row-major over rows, then heads): its latent query, then
    /// its RoPE part (`kvr + rope` floats).
    q: Vec<f32>,
    /// Per query, its scores over the block's slots, then probabilities.
    s: Vec<f32>,
    /// Per query, its latent output (`kvr` floats).
    o: Vec<f32>,
    /// A tile of cached rows widened to f32.
    tile: Vec<f32>,
}

/// The cached rows `t0..t1` of `block`'s slot list, as f32: borrowed
/// where the pool stores f32, else widened (exactly) into `buf`.
fn tile_rows<'a>(
    pool: &'a KvShard,
    layer: usize,
    block: &Block,
    (t0, t1): (usize, usize),
    width: usize,
    buf: &'a mut Vec<f32>,
) -> Vec<&'a [f32]> {
    let rows: Vec<LatentRow<'a>> = (t0..t1)
        .map(|t| pool.latent_row(layer, block.table, block.slot(t)))
        .collect();
    if rows.iter().all(|r| matches!(r, LatentRow::F32(_))) {
        return rows
            .into_iter()
            .map(|r| match r {
                LatentRow::F32(r) => &r[..width],
                LatentRow::Bf16(_) => unreachable!("checked f32 above"),
            })
            .collect();
    }
    buf.clear();
    buf.resize(rows.len() * width, 0.0);
    for (row, dst) in rows.iter().zip(buf.chunks_exact_mut(width)) {
        row.widen_into(dst);
    }
    buf.chunks_exact(width).collect()
}

/// Attention of `block`'s rows for heads `heads` (queries in `q`, each row
/// `qd` floats), written to their `v` floats of `out`.
///
/// # Safety
/// `out` holds `heads * v` floats per batch row; no other task writes
/// these rows' floats of these heads while this runs.
#[allow(clippy::too_many_arguments)]
unsafe fn attend_block(
    d: MlaDims,
    isa: Isa,
    kv_b: &Dense,
    pool: &KvShard,
    layer: usize,
    block: &Block,
    q: &[f32],
    heads: std::ops::Range<usize>,
    out: &SharedMut<f32>,
    scratch: &mut Scratch,
) {
    let Scratch { q: qv, s, o, tile } = scratch;
    let (qk, w) = (d.nope + d.rope, d.kvr + d.rope);
    let qd = d.heads * qk;
    let nh = heads.len();
    let nq = block.rows.len() * nh;
    let ctx = block.ctxs.iter().copied().max().unwrap_or(0);
    let ctx_of = |j: usize| block.ctxs[j / nh];
    // Queries: W_UK^T q_nope (the query seen from the latent space), then
    // the RoPE part, scored in one dot against a cached row.
    qv.clear();
    qv.resize(nq * w, 0.0);
    for (i, &r) in block.rows.iter().enumerate() {
        for (g, hh) in heads.clone().enumerate() {
            let src = &q[r * qd + hh * qk..r * qd + (hh + 1) * qk];
            let dst = &mut qv[(i * nh + g) * w..(i * nh + g + 1) * w];
            let base = hh * (d.nope + d.v);
            for (j, &a) in src[..d.nope].iter().enumerate() {
                axpy(a, kv_b.row(base + j), &mut dst[..d.kvr]);
            }
            dst[d.kvr..].copy_from_slice(&src[d.nope..]);
        }
    }
    let queries: Vec<&[f32]> = qv.chunks_exact(w).collect();
    s.clear();
    s.resize(nq * ctx, 0.0);
    for t0 in (0..ctx).step_by(TILE) {
        let t1 = (t0 + TILE).min(ctx);
        let keys = tile_rows(pool, layer, block, (t0, t1), w, tile);
        scores(isa, &queries, &keys, w, d.scale, &mut s[t0..], ctx);
    }
    for (j, sj) in s.chunks_exact_mut(ctx.max(1)).enumerate().take(nq) {
        let sj = &mut sj[..ctx_of(j)];
        let max = sj.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0.0;
        for x in sj.iter_mut() {
            *x = exp(*x - max);
            sum += *x;
        }
        let inv = 1.0 / sum;
        sj.iter_mut().for_each(|x| *x *= inv);
    }
    o.clear();
    o.resize(nq * d.kvr, 0.0);
    for t0 in (0..ctx).step_by(TILE) {
        let t1 = (t0 + TILE).min(ctx);
        let vals = tile_rows(pool, layer, block, (t0, t1), w, tile);
        // Queries that read the whole tile go together; a row that ends
        // inside it (the last tile of a prompt chunk's causal mask) adds
        // only its own slots.
        let (mut ps, mut outs, mut ends) = (Vec::new(), Vec::new(), Vec::new());
        for (j, oj) in o.chunks_exact_mut(d.kvr).enumerate() {
            let end = ctx_of(j).clamp(t0, t1);
            if end == t1 {
                ps.push(&s[j * ctx + t0..j * ctx + t1]);
                outs.push(oj);
            } else if end > t0 {
                ends.push((end, &s[j * ctx + t0..j * ctx + end], oj));
            }
        }
        weighted_sums(isa, &ps, &vals, d.kvr, &mut outs);
        for (end, p, oj) in ends {
            weighted_sums(isa, &[p], &vals[..end - t0], d.kvr, &mut [oj]);
        }
    }
    for (i, &r) in block.rows.iter().enumerate() {
        for (g, hh) in heads.clone().enumerate() {
            let ol = &o[(i * nh + g) * d.kvr..(i * nh + g + 1) * d.kvr];
            let base = hh * (d.nope + d.v) + d.nope;
            // SAFETY: row r's floats of head hh, inside `out` and written
            // by this task alone (the caller's contract).
            let dst = std::slice::from_raw_parts_mut(out.at((r * d.heads + hh) * d.v), d.v);
            for (j, x) in dst.iter_mut().enumerate() {
                *x = dot(kv_b.row(base + j), ol);
            }
        }
    }
}

/// Absorbed attention for every row of a batch but those `skip` names:
/// row `r` (sequence `rows.seq[r]`, table `tables[..]`) attends slots
/// `0..=rows.positions[r]` (with `tree`: the slots it lists for row `r`)
/// with its query `q[r]` (`heads * (nope + rope)` floats) into `out[r]`
/// (`heads * v` floats). Parallel over groups of heads, each taking every
/// block in turn: a group's slice of `kv_b` is then read from memory once
/// per call and from cache for its other rows, and each cached latent row
/// is read once per block and group. A single decode row still spreads
/// its heads over the cores; each head's numbers are the same whichever
/// thread, group or block computes them.
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
        static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    }
    let live: Vec<usize> = (0..n).filter(|&r| !skip(r)).collect();
    let mut blocks: Vec<Block> = Vec::new();
    match tree {
        // A tree row reads its own list: the prefix, then its ancestors.
        Some(t) => blocks.extend(live.iter().map(|&r| Block {
            rows: vec![r],
            ctxs: vec![t.prefix[r] + t.extra[r].len()],
            prefix: t.prefix[r],
            extra: &t.extra[r],
            table: tables[rows.seq[r]],
        })),
        // Runs of rows of one sequence: a prompt chunk's, a chain's.
        None => {
            let mut rest = &live[..];
            while let Some(&first) = rest.first() {
                let len = rest
                    .iter()
                    .take(BLOCK_ROWS)
                    .take_while(|&&r| rows.seq[r] == rows.seq[first])
                    .count();
                let ctxs: Vec<usize> = rest[..len].iter().map(|&r| rows.positions[r] + 1).collect();
                blocks.push(Block {
                    rows: rest[..len].to_vec(),
                    prefix: ctxs.iter().copied().max().unwrap_or(0),
                    ctxs,
                    extra: &[],
                    table: tables[rows.seq[first]],
                });
                rest = &rest[len..];
            }
        }
    }
    let isa = Isa::current();
    let dst = SharedMut::new(out);
    team::for_each(d.heads.div_ceil(HEAD_GROUP), |g| {
        let heads = g * HEAD_GROUP..((g + 1) * HEAD_GROUP).min(d.heads);
        SCRATCH.with_borrow_mut(|scratch| {
            for block in &blocks {
                // SAFETY: this task writes only heads `heads` of its
                // blocks' rows, inside `out` (asserted above); every
                // (row, head) belongs to one block and one group.
                unsafe {
                    attend_block(
                        d,
                        isa,
                        kv_b,
                        pool,
                        layer,
                        block,
                        q,
                        heads.clone(),
                        &dst,
                        scratch,
                    )
                };
            }
        })
    });
}
