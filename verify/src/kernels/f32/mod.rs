//! [`F32Matrix`]: an f32 weight matrix kept exactly as its file stores it
//! (owned or memory-mapped bytes, any row stride, so a tensor-parallel
//! shard of rows or columns is a view), multiplied by 1 to a few hundred
//! activation rows in one pass that reads each weight from memory once.
//! The counterpart of [`super::bf16`] for files whose matrices are f32.
//!
//! Arithmetic: activations stay f32; each (column, row) dot product keeps
//! 16 lane sums, lane `j` of each 16-value chunk taking value `j` by one
//! fused multiply-add, and adds the lanes in
//! [`super::bf16::common::hsum16`]'s fixed order. Every path (scalar,
//! AVX2, AVX-512F) does exactly this, so all give the same bits; against
//! exact arithmetic the error is that of f32 sums,
//! `|err| <= 2^-24 * (k / 16 + 4) * sum_i |w_i x_i|` (the tests hold it
//! to `1e-5 * sum_i |w_i x_i|` at their sizes).
//!
//! Invariants: row r of the output depends only on row r of the input,
//! bit for bit, whatever the number of rows, and on no split of columns
//! over threads (the same instructions run for each (column, row) sum in
//! any group).

#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use super::bf16::common::{self, Cols, Line, Res, BLOCK, CHUNK_BYTES, LANES};
use super::bytes::Bytes;
use super::{Isa, GROUP};
use crate::team::SharedMut;
use std::ops::Range;

/// Values per 64-byte chunk.
const CHUNK: usize = CHUNK_BYTES / 4;

/// An `n x k` f32 matrix (`n` output features, `k` inputs) in its file's
/// bytes: row `r` is the `4 * k` little-endian bytes at `start + r *
/// row_stride` of `bytes`.
///
/// Invariant: every row lies inside `bytes` and `row_stride >= 4 * k`
/// (checked by the constructors).
#[derive(Clone)]
pub struct F32Matrix {
    bytes: Bytes,
    start: usize,
    n: usize,
    k: usize,
    row_stride: usize,
}

impl F32Matrix {
    /// The matrix whose row `r` is the `4 * k` bytes at `r * row_stride`
    /// of `bytes` (no copy, no alignment needed).
    ///
    /// Errors: `row_stride < 4 * k`, or the last row ends past `bytes`.
    pub fn from_bytes(bytes: Bytes, n: usize, k: usize, row_stride: usize) -> Result<Self, String> {
        common::check_layout(bytes.len(), 0, n, 4 * k, row_stride)?;
        Ok(F32Matrix {
            bytes,
            start: 0,
            n,
            k,
            row_stride,
        })
    }

    /// `w` (`n x k`, row-major), owned.
    ///
    /// Panics if `w.len() != n * k`.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "a [{n}, {k}] matrix");
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::from_bytes(bytes.into(), n, k, 4 * k).expect("contiguous layout")
    }

    /// Output features (rows).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features (columns).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes between the starts of two rows.
    pub fn row_stride(&self) -> usize {
        self.row_stride
    }

    /// The storage the rows are read from (a view shares its parent's).
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// Bytes a product reads: `4 * n * k`.
    pub fn weight_bytes(&self) -> usize {
        4 * self.n * self.k
    }

    /// Rows `r` as a matrix sharing this one's storage (a shard of output
    /// features). Errors name a range outside the matrix.
    pub fn rows(&self, r: Range<usize>) -> Result<Self, String> {
        if r.start > r.end || r.end > self.n {
            return Err(format!("rows {r:?} outside a matrix of {} rows", self.n));
        }
        Ok(F32Matrix {
            start: self.start + r.start * self.row_stride,
            n: r.len(),
            ..self.clone()
        })
    }

    /// Columns `c` as a matrix sharing this one's storage (a shard of
    /// input features; rows keep their stride). Errors name a range
    /// outside the matrix.
    pub fn columns(&self, c: Range<usize>) -> Result<Self, String> {
        if c.start > c.end || c.end > self.k {
            return Err(format!(
                "columns {c:?} outside a matrix of {} columns",
                self.k
            ));
        }
        Ok(F32Matrix {
            start: self.start + 4 * c.start,
            k: c.len(),
            ..self.clone()
        })
    }

    /// The bytes of row `r`.
    fn row(&self, r: usize) -> &[u8] {
        let s = self.start + r * self.row_stride;
        &self.bytes[s..s + 4 * self.k]
    }

    /// Row `r` into `out[..k]`.
    ///
    /// Panics if `r >= n` or `out` is shorter than `k`.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.n, "row {r} outside a matrix of {} rows", self.n);
        for (o, b) in out[..self.k].iter_mut().zip(self.row(r).chunks_exact(4)) {
            *o = f32::from_le_bytes(b.try_into().expect("4 bytes"));
        }
    }

    /// `out[r * n + c] = sum_i w[c][i] * x[r * k + i]` for `rows` rows;
    /// uses [`Isa::current`] (AVX-512F for [`Isa::Avx512Vnni`]).
    ///
    /// Panics if `x` or `out` are shorter than `rows * k` / `rows * n`.
    pub fn matmul(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        self.matmul_with(Isa::current(), x, rows, out)
    }

    /// [`F32Matrix::matmul`] with an explicit instruction set.
    ///
    /// Panics as `matmul`, or if this CPU lacks `isa`.
    pub fn matmul_with(&self, isa: Isa, x: &[f32], rows: usize, out: &mut [f32]) {
        matmul_many_with(isa, x, rows, &mut [Product { w: self, out }])
    }
}

/// One product of [`matmul_many`]: a matrix and where its `rows x n`
/// outputs go (row-major).
pub struct Product<'a> {
    pub w: &'a F32Matrix,
    pub out: &'a mut [f32],
}

/// Several matrices applied to the same input `x` (`rows x k`; q/k/v,
/// gate/up) as one pass of the thread team: the input is laid out once,
/// and the output columns of all matrices are split over the threads
/// together. Each output equals [`F32Matrix::matmul`]'s bit for bit. Uses
/// [`Isa::current`].
///
/// Panics if the matrices' `k` differ, or `x` or an output is too short.
pub fn matmul_many(x: &[f32], rows: usize, products: &mut [Product]) {
    matmul_many_with(Isa::current(), x, rows, products)
}

/// [`matmul_many`] with an explicit instruction set; panics if this CPU
/// lacks it.
pub fn matmul_many_with(isa: Isa, x: &[f32], rows: usize, products: &mut [Product]) {
    let Some(k) = products.first().map(|p| p.w.k) else {
        return;
    };
    assert!(isa.available(), "{isa:?} is not available on this CPU");
    assert!(x.len() >= rows * k, "input shorter than {rows} x {k}");
    for p in products.iter() {
        assert!(p.w.k == k, "products of one input share k");
        assert!(p.out.len() >= rows * p.w.n, "output shorter than rows x n");
    }
    if rows == 0 {
        return;
    }
    // Rows padded with zeros to whole chunks, 64-byte aligned.
    let lines = k.div_ceil(CHUNK);
    let mut acts = common::lines(rows * lines);
    for (r, xr) in x[..rows * k].chunks_exact(k).enumerate() {
        for (i, xc) in xr.chunks(CHUNK).enumerate() {
            let line = &mut acts[r * lines + i].0;
            for (j, v) in xc.iter().enumerate() {
                line[4 * j..4 * j + 4].copy_from_slice(&v.to_ne_bytes());
            }
        }
    }
    let ns: Vec<usize> = products.iter().map(|p| p.w.n).collect();
    let outs: Vec<(&F32Matrix, SharedMut<f32>)> = products
        .iter_mut()
        .map(|p| (p.w, SharedMut::new(p.out)))
        .collect();
    // AVX2 keeps 2 registers per (column, row) sum and has 16.
    let group = if isa == Isa::Avx2 { 4 } else { GROUP };
    common::split_columns(&ns, |p, cols| {
        let (w, out) = (outs[p].0, &outs[p].1);
        let mut res: Res = [[0.0; GROUP]; BLOCK];
        for b0 in cols.clone().step_by(BLOCK) {
            let b1 = (b0 + BLOCK).min(cols.end);
            let block = Cols::new((b0..b1).map(|c| w.row(c)), 4 * k, BLOCK * w.row_stride);
            for r0 in (0..rows).step_by(group) {
                let rr = (rows - r0).min(group);
                let x = &acts[r0 * lines..(r0 + rr) * lines];
                run_block(isa, &block, x, lines, rr, &mut res);
                // SAFETY: this task's columns `b0..b1` of rows below
                // `rows`; outputs hold `rows * n` (asserted above).
                unsafe { common::scatter(out, w.n, (b0, b1 - b0), (r0, rr), &res) };
            }
        }
    });
}

/// One block of columns dotted with `rows` activation rows (`lines` lines
/// each, from `x`) into `res`.
fn run_block(isa: Isa, b: &Cols, x: &[Line], lines: usize, rows: usize, res: &mut Res) {
    debug_assert!(x.len() >= rows * lines && lines >= b.chunks);
    match isa.vector() {
        // SAFETY: `matmul_many_with` checked `isa.available()` (which
        // implies avx512f, avx2, fma); `x` holds `rows` rows of `lines`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { x86::f512_block(b, x.as_ptr().cast(), lines, rows, res) },
        // SAFETY: as above (avx2, fma).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::f256_block(b, x.as_ptr().cast(), lines, rows, res) },
        _ => {
            for (c, col) in res.iter_mut().enumerate().take(b.n) {
                for (r, v) in col.iter_mut().enumerate().take(rows) {
                    *v = scalar_dot(b, c, &x[r * lines..(r + 1) * lines]);
                }
            }
        }
    }
}

/// Column `c` of `b` dotted with one activation row.
#[allow(clippy::needless_range_loop)] // `i` indexes the weight chunks and `x` together
fn scalar_dot(b: &Cols, c: usize, x: &[Line]) -> f32 {
    let f = |l: &[u8], j: usize| f32::from_ne_bytes(l[4 * j..4 * j + 4].try_into().unwrap());
    let mut acc = [0f32; LANES];
    for i in 0..b.chunks {
        let w = b.chunk(c, i);
        for (j, a) in acc.iter_mut().enumerate() {
            let wj = f32::from_le_bytes(w[4 * j..4 * j + 4].try_into().unwrap());
            *a = wj.mul_add(f(&x[i].0, j), *a);
        }
    }
    common::hsum16(&acc)
}
