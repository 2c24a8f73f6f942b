//! Pieces the row-major matrices ([`super::Bf16Matrix`] and
//! [`crate::kernels::f32::F32Matrix`]) share: the split of output columns
//! over the thread team, the block of weight rows a task reads together,
//! the 64-byte chunk every kernel step consumes, and the one fixed order
//! in which a dot product's 16 lane sums are added at the end.
//!
//! Why one fixed summation order: every path (scalar, AVX2, AVX-512)
//! keeps 16 f32 lane sums per (output column, activation row), adds each
//! 64-byte chunk's products into them with fused multiply-adds in the same
//! order, and reduces the lanes with the same tree ([`hsum16`]). Fused
//! multiply-adds round once, the same way everywhere, so the widening
//! paths give the same bits on every CPU, and the number of rows in a
//! call, the group a row falls in and the thread a column runs on change
//! nothing.

use crate::team::SharedMut;
use std::ops::Range;

/// Bytes of weights one kernel step reads from each weight row: 32 bf16
/// or 16 f32, one AVX-512 register, one cache line.
pub(in crate::kernels) const CHUNK_BYTES: usize = 64;

/// Lane sums each (column, row) dot product keeps.
pub(in crate::kernels) const LANES: usize = 16;

/// Weight rows (output columns) one task reads together: every activation
/// row group of the pass uses them while they sit in L1/L2, so a pass of
/// any number of rows reads each weight from memory once.
pub(in crate::kernels) const BLOCK: usize = 4;

/// A 64-byte aligned line of prepared activations (aligned so a 64-byte
/// load never splits a cache line).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(in crate::kernels) struct Line(pub [u8; CHUNK_BYTES]);

/// Zeroed activation storage of `lines` lines.
pub(in crate::kernels) fn lines(lines: usize) -> Vec<Line> {
    vec![Line([0; CHUNK_BYTES]); lines]
}

/// Results of one block: `res[c][r]` is column `c` of the block dotted
/// with row `r` of the group.
pub(in crate::kernels) type Res = [[f32; crate::kernels::GROUP]; BLOCK];

/// Up to [`BLOCK`] weight rows seen as a sequence of 64-byte chunks: the
/// first `full` straight from the weights, then, when the row length is
/// not a multiple of 64 bytes, one more from `tail` (the row's last bytes,
/// zero-padded; the activations are zero-padded to match, so the padding
/// adds `0 * 0`).
pub(in crate::kernels) struct Cols<'a> {
    /// The weight rows, each exactly the row's bytes; `n` of them are used.
    pub w: [&'a [u8]; BLOCK],
    pub tail: [[u8; CHUNK_BYTES]; BLOCK],
    pub n: usize,
    pub full: usize,
    pub chunks: usize,
    /// Bytes from a chunk to the one to prefetch: the same place in the
    /// next block's rows, which this task most likely reads next.
    pub ahead: usize,
}

impl<'a> Cols<'a> {
    /// The weight rows `rows` (each `row_bytes` long), up to [`BLOCK`].
    pub fn new(rows: impl Iterator<Item = &'a [u8]>, row_bytes: usize, ahead: usize) -> Self {
        let mut c = Cols {
            w: [&[]; BLOCK],
            tail: [[0; CHUNK_BYTES]; BLOCK],
            n: 0,
            full: row_bytes / CHUNK_BYTES,
            chunks: row_bytes.div_ceil(CHUNK_BYTES),
            ahead,
        };
        for (i, row) in rows.take(BLOCK).enumerate() {
            debug_assert_eq!(row.len(), row_bytes);
            let rest = &row[c.full * CHUNK_BYTES..];
            c.tail[i][..rest.len()].copy_from_slice(rest);
            c.w[i] = row;
            c.n = i + 1;
        }
        c
    }

    /// Chunk `i` of row `c`.
    #[inline(always)]
    pub fn chunk(&self, c: usize, i: usize) -> &[u8; CHUNK_BYTES] {
        if i < self.full {
            self.w[c][i * CHUNK_BYTES..(i + 1) * CHUNK_BYTES]
                .try_into()
                .expect("64 bytes")
        } else {
            &self.tail[c]
        }
    }

    /// The address of chunk `i` of row `c`, prefetching the chunk
    /// [`Cols::ahead`] bytes on (SIMD paths; no bounds check on the
    /// prefetch, which never faults).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub fn chunk_ptr(&self, c: usize, i: usize) -> *const u8 {
        if i < self.full {
            // SAFETY: chunk `i < full` lies inside the row slice.
            let p = unsafe { self.w[c].as_ptr().add(i * CHUNK_BYTES) };
            crate::kernels::prefetch_l2(p, self.ahead);
            p
        } else {
            self.tail[c].as_ptr()
        }
    }
}

/// The lane sums of one dot product added in the fixed order every path
/// uses: lanes `i + 8` onto `i`, then `i + 4`, `i + 2`, `i + 1`.
#[inline(always)]
pub(in crate::kernels) fn hsum16(l: &[f32; LANES]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|i| l[i] + l[i + 8]);
    let s4: [f32; 4] = std::array::from_fn(|i| s8[i] + s8[i + 4]);
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// Runs `f(product, columns)` over every output column of several
/// matrices (`ns[p]` columns each), numbered one after another and split
/// over the team in chunks of whole [`BLOCK`]s, several per thread so a
/// slow core does not hold up the call. Each column is handed out once.
pub(in crate::kernels) fn split_columns(ns: &[usize], f: impl Fn(usize, Range<usize>) + Sync) {
    let total: usize = ns.iter().sum();
    if total == 0 {
        return;
    }
    let threads = crate::team::threads();
    let chunk = total
        .div_ceil(threads * 4)
        .next_multiple_of(BLOCK)
        .max(BLOCK);
    crate::team::for_each(total.div_ceil(chunk), |ci| {
        let span = ci * chunk..((ci + 1) * chunk).min(total);
        let mut first = 0;
        for (p, &n) in ns.iter().enumerate() {
            let own = first..first + n;
            first += n;
            let (s, e) = (span.start.max(own.start), span.end.min(own.end));
            if s < e {
                f(p, s - own.start..e - own.start);
            }
        }
    });
}

/// Writes `res[c][r]` to `out[(r0 + r) * n + col0 + c]` for the block's
/// `cols` columns and the group's `rows` rows.
///
/// # Safety
/// `out` points at a `rows_total x n` output with `r0 + rows <=
/// rows_total` and `col0 + cols <= n`, and no other task writes these
/// elements while this runs.
pub(in crate::kernels) unsafe fn scatter(
    out: &SharedMut<f32>,
    n: usize,
    (col0, cols): (usize, usize),
    (r0, rows): (usize, usize),
    res: &Res,
) {
    for (c, col) in res.iter().enumerate().take(cols) {
        for (r, &v) in col.iter().enumerate().take(rows) {
            // SAFETY: inside the output by the caller's promise, and this
            // task's own column.
            unsafe { *out.at((r0 + r) * n + col0 + c) = v };
        }
    }
}

/// Checks a row-major matrix of `n` rows of `row_bytes` bytes, row `r`
/// starting at `start + r * stride`, against storage of `len` bytes.
pub(in crate::kernels) fn check_layout(
    len: usize,
    start: usize,
    n: usize,
    row_bytes: usize,
    stride: usize,
) -> Result<(), String> {
    if n == 0 || row_bytes == 0 {
        return Ok(());
    }
    if stride < row_bytes {
        return Err(format!(
            "row stride {stride} bytes is shorter than a row of {row_bytes} bytes"
        ));
    }
    let end = (n - 1)
        .checked_mul(stride)
        .and_then(|v| v.checked_add(row_bytes))
        .and_then(|v| v.checked_add(start))
        .ok_or_else(|| format!("{n} rows of stride {stride} overflow"))?;
    if end > len {
        return Err(format!(
            "{n} rows of {row_bytes} bytes at stride {stride} need {end} bytes, storage has {len}"
        ));
    }
    Ok(())
}
