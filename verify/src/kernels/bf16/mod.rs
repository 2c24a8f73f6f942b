//! [`Bf16Matrix`]: a bf16 weight matrix kept exactly as its file stores
//! it (owned or memory-mapped bytes, any row stride, so a tensor-parallel
//! shard of rows or columns is a view), multiplied by 1 to a few hundred
//! activation rows in one pass that reads each weight from memory once.
//!
//! Arithmetic: on the default paths each bf16 weight is widened (exactly:
//! a bf16 is the top half of an f32) and multiplied with the unrounded f32
//! activation, every product added into 16 f32 lane sums, lane `j` of
//! each 32-value chunk taking values `2j + 1` then `2j` (the order AVX-512
//! BF16's `vdpbf16ps` defines), the lanes then added in
//! [`common::hsum16`]'s fixed order. So a bf16 checkpoint scores tokens as
//! its f32 conversion does (up to summation order), and the HF directory
//! and its f32 GGUF are the same model; memory traffic, the cost of a
//! decode step, is the bf16 bytes either way.
//!
//! Paths ([`Path`]): widening loads (mask or shift) and FMA on AVX-512F
//! and AVX2, plain Rust otherwise, all giving the same bits. AVX-512
//! BF16's `vdpbf16ps` (`SPECGATE_KERNEL_ISA=avx512-bf16`, opt-in) pairs the
//! weights with bf16-rounded activations, as llama.cpp does on a bf16
//! GGUF: half the multiply work per extra row, at the activations'
//! rounding, `|err| <= 2^-8 * sum_i |w_i x_i|` (`EXACT_TOL`, a bf16
//! rounding is at most 2^-9 relative, plus f32 sums), which a deep random
//! model can amplify into different greedy tokens.
//!
//! Invariants: row r of the output depends only on row r of the input,
//! bit for bit, whatever the number of rows (each (column, row) sum runs
//! the same instructions in the same order in any group), and on no split
//! of columns over threads.

pub(in crate::kernels) mod common;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
pub(in crate::kernels) mod x86;

use super::bytes::Bytes;
use super::{Isa, GROUP};
use crate::team::SharedMut;
use common::{Cols, Line, Res, BLOCK, CHUNK_BYTES, LANES};
use std::ops::Range;
use std::sync::OnceLock;

/// Values per 64-byte chunk.
const CHUNK: usize = CHUNK_BYTES / 2;

/// How a bf16 product runs on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Plain Rust (`f32::mul_add`), any CPU.
    Scalar,
    /// AVX2 + FMA, widening bf16 to f32.
    Avx2,
    /// AVX-512F + FMA, widening bf16 to f32.
    Avx512,
    /// AVX-512 BF16's `vdpbf16ps` (Cooper Lake, Sapphire Rapids, Zen 4),
    /// with bf16-rounded activations; opt-in (see the module docs).
    Avx512Bf16,
}

impl Path {
    /// Whether this CPU can run `self` (run-time detection).
    pub fn available(self) -> bool {
        match self {
            Path::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => Path::Avx2.available() && is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Path::Avx512Bf16 => Path::Avx512.available() && is_x86_feature_detected!("avx512bf16"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// A short stable name: `scalar`, `avx2`, `avx512`, `avx512-bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Path::Scalar => "scalar",
            Path::Avx2 => "avx2",
            Path::Avx512 => "avx512",
            Path::Avx512Bf16 => "avx512-bf16",
        }
    }

    /// The widening path of an instruction set.
    pub fn for_isa(isa: Isa) -> Path {
        match isa {
            Isa::Scalar => Path::Scalar,
            Isa::Avx2 => Path::Avx2,
            Isa::Avx512Vnni | Isa::Amx => Path::Avx512,
        }
    }

    /// [`Path::for_isa`] of [`Isa::current`], except that
    /// `SPECGATE_KERNEL_ISA=avx512-bf16` picks `vdpbf16ps` where the CPU
    /// has it (llama.cpp's bf16 arithmetic). Read once.
    pub fn current() -> Path {
        static PATH: OnceLock<Path> = OnceLock::new();
        *PATH.get_or_init(|| {
            let asked = std::env::var("SPECGATE_KERNEL_ISA").is_ok_and(|v| v == "avx512-bf16");
            if asked && Path::Avx512Bf16.available() {
                Path::Avx512Bf16
            } else {
                Path::for_isa(Isa::current())
            }
        })
    }

    /// Activation rows one kernel call keeps sums for: AVX2 has 16
    /// registers, and a row's 16 lane sums take two of them per column.
    fn group(self) -> usize {
        match self {
            Path::Avx2 => 4,
            _ => GROUP,
        }
    }
}

/// An `n x k` bf16 matrix (`n` output features, `k` inputs) in its file's
/// bytes: row `r` is the `2 * k` little-endian bytes at `start + r *
/// row_stride` of `bytes`.
///
/// Invariant: every row lies inside `bytes` and `row_stride >= 2 * k`
/// (checked by the constructors).
#[derive(Clone)]
pub struct Bf16Matrix {
    bytes: Bytes,
    start: usize,
    n: usize,
    k: usize,
    row_stride: usize,
}

impl Bf16Matrix {
    /// The matrix whose row `r` is the `2 * k` bytes at `r * row_stride`
    /// of `bytes` (no copy, no alignment needed).
    ///
    /// Errors: `row_stride < 2 * k`, or the last row ends past `bytes`.
    pub fn from_bytes(bytes: Bytes, n: usize, k: usize, row_stride: usize) -> Result<Self, String> {
        common::check_layout(bytes.len(), 0, n, 2 * k, row_stride)?;
        Ok(Bf16Matrix {
            bytes,
            start: 0,
            n,
            k,
            row_stride,
        })
    }

    /// `w` (`n x k`, row-major) rounded to bf16, owned (tests, tiny
    /// models).
    ///
    /// Panics if `w.len() != n * k`.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "a [{n}, {k}] matrix");
        let bytes: Vec<u8> = w.iter().flat_map(|&v| to_bf16(v).to_le_bytes()).collect();
        Self::from_bytes(bytes.into(), n, k, 2 * k).expect("contiguous layout")
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

    /// Bytes a product reads: `2 * n * k`.
    pub fn weight_bytes(&self) -> usize {
        2 * self.n * self.k
    }

    /// Rows `r` as a matrix sharing this one's storage (a shard of output
    /// features). Errors name a range outside the matrix.
    pub fn rows(&self, r: Range<usize>) -> Result<Self, String> {
        if r.start > r.end || r.end > self.n {
            return Err(format!("rows {r:?} outside a matrix of {} rows", self.n));
        }
        Ok(Bf16Matrix {
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
        Ok(Bf16Matrix {
            start: self.start + 2 * c.start,
            k: c.len(),
            ..self.clone()
        })
    }

    /// The bytes of row `r`.
    fn row(&self, r: usize) -> &[u8] {
        let s = self.start + r * self.row_stride;
        &self.bytes[s..s + 2 * self.k]
    }

    /// Row `r` widened to f32 into `out[..k]`.
    ///
    /// Panics if `r >= n` or `out` is shorter than `k`.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.n, "row {r} outside a matrix of {} rows", self.n);
        for (o, b) in out[..self.k].iter_mut().zip(self.row(r).chunks_exact(2)) {
            *o = from_bf16(u16::from_le_bytes([b[0], b[1]]));
        }
    }

    /// `out[r * n + c] = sum_i w[c][i] * x[r * k + i]` for `rows` rows
    /// (activations rounded to bf16, see the module docs); uses
    /// [`Path::current`].
    ///
    /// Panics if `x` or `out` are shorter than `rows * k` / `rows * n`.
    pub fn matmul(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        self.matmul_on(Path::current(), x, rows, out)
    }

    /// [`Bf16Matrix::matmul`] with [`Path::for_isa`]`(isa)`.
    ///
    /// Panics as `matmul`, or if this CPU lacks `isa`.
    pub fn matmul_with(&self, isa: Isa, x: &[f32], rows: usize, out: &mut [f32]) {
        self.matmul_on(Path::for_isa(isa), x, rows, out)
    }

    /// [`Bf16Matrix::matmul`] on an explicit path (tests, benchmarks).
    ///
    /// Panics as `matmul`, or if this CPU lacks `path`.
    pub fn matmul_on(&self, path: Path, x: &[f32], rows: usize, out: &mut [f32]) {
        matmul_many_on(path, x, rows, &mut [Product { w: self, out }])
    }
}

/// One product of [`matmul_many`]: a matrix and where its `rows x n`
/// outputs go (row-major).
pub struct Product<'a> {
    pub w: &'a Bf16Matrix,
    pub out: &'a mut [f32],
}

/// Several matrices applied to the same input `x` (`rows x k`; q/k/v,
/// gate/up) as one pass of the thread team: the input is rounded and laid
/// out once, and the output columns of all matrices are split over the
/// threads together. Each output equals [`Bf16Matrix::matmul`]'s bit for
/// bit. Uses [`Path::current`].
///
/// Panics if the matrices' `k` differ, or `x` or an output is too short.
pub fn matmul_many(x: &[f32], rows: usize, products: &mut [Product]) {
    matmul_many_on(Path::current(), x, rows, products)
}

/// [`matmul_many`] with [`Path::for_isa`]`(isa)`.
pub fn matmul_many_with(isa: Isa, x: &[f32], rows: usize, products: &mut [Product]) {
    matmul_many_on(Path::for_isa(isa), x, rows, products)
}

/// [`matmul_many`] on an explicit path; panics if this CPU lacks it.
pub fn matmul_many_on(path: Path, x: &[f32], rows: usize, products: &mut [Product]) {
    let Some(k) = products.first().map(|p| p.w.k) else {
        return;
    };
    assert!(path.available(), "{path:?} is not available on this CPU");
    assert!(x.len() >= rows * k, "input shorter than {rows} x {k}");
    for p in products.iter() {
        assert!(p.w.k == k, "products of one input share k");
        assert!(p.out.len() >= rows * p.w.n, "output shorter than rows x n");
    }
    if rows == 0 {
        return;
    }
    let acts = Acts::new(path, &x[..rows * k], rows, k);
    let ns: Vec<usize> = products.iter().map(|p| p.w.n).collect();
    let outs: Vec<(&Bf16Matrix, SharedMut<f32>)> = products
        .iter_mut()
        .map(|p| (p.w, SharedMut::new(p.out)))
        .collect();
    let group = path.group();
    common::split_columns(&ns, |p, cols| {
        let (w, out) = (outs[p].0, &outs[p].1);
        let mut res: Res = [[0.0; GROUP]; BLOCK];
        for b0 in cols.clone().step_by(BLOCK) {
            let b1 = (b0 + BLOCK).min(cols.end);
            let block = Cols::new((b0..b1).map(|c| w.row(c)), 2 * k, BLOCK * w.row_stride);
            for r0 in (0..rows).step_by(group) {
                let rr = (rows - r0).min(group);
                run_block(path, &block, &acts, r0, rr, &mut res);
                // SAFETY: this task's columns `b0..b1` of rows below
                // `rows`; outputs hold `rows * n` (asserted above).
                unsafe { common::scatter(out, w.n, (b0, b1 - b0), (r0, rr), &res) };
            }
        }
    });
}

/// Activation rows prepared for one path, each `lines` 64-byte lines,
/// zero-padded past `k`: bf16-rounded values in order for `vdpbf16ps`;
/// for the widening paths, per 32-value chunk the 16 odd-indexed values
/// (f32, unrounded) then the 16 even-indexed ones, matching the lanes of
/// a widened chunk.
struct Acts {
    data: Vec<Line>,
    lines: usize,
}

impl Acts {
    fn new(path: Path, x: &[f32], rows: usize, k: usize) -> Acts {
        let chunks = k.div_ceil(CHUNK);
        let native = path == Path::Avx512Bf16;
        let lines = if native { chunks } else { 2 * chunks };
        let mut data = common::lines(rows * lines);
        for (r, xr) in x.chunks_exact(k).enumerate() {
            let row = &mut data[r * lines..(r + 1) * lines];
            for (i, xc) in xr.chunks(CHUNK).enumerate() {
                if native {
                    for (j, &v) in xc.iter().enumerate() {
                        row[i].0[2 * j..2 * j + 2].copy_from_slice(&to_bf16(v).to_le_bytes());
                    }
                } else {
                    for (j, &v) in xc.iter().enumerate() {
                        // Odd values go to the first line, even to the second.
                        let line = &mut row[2 * i + 1 - j % 2].0;
                        let at = 4 * (j / 2);
                        line[at..at + 4].copy_from_slice(&v.to_ne_bytes());
                    }
                }
            }
        }
        Acts { data, lines }
    }

    /// Row `r`'s lines.
    fn row(&self, r: usize) -> &[Line] {
        &self.data[r * self.lines..(r + 1) * self.lines]
    }
}

/// One block of columns dotted with rows `r0..r0 + rows` into `res`.
fn run_block(path: Path, b: &Cols, a: &Acts, r0: usize, rows: usize, res: &mut Res) {
    let x = &a.data[r0 * a.lines..];
    match path {
        // SAFETY: `matmul_many_on` checked `path.available()`; `x` holds
        // `rows` rows of `a.lines` lines laid out for `path`.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512Bf16 => unsafe { x86::dp_block(b, x.as_ptr().cast(), a.lines, rows, res) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { x86::wide512_block(b, x.as_ptr().cast(), a.lines, rows, res) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { x86::wide256_block(b, x.as_ptr().cast(), a.lines, rows, res) },
        _ => {
            for (c, col) in res.iter_mut().enumerate().take(b.n) {
                for (r, v) in col.iter_mut().enumerate().take(rows) {
                    *v = scalar_dot(b, c, a.row(r0 + r));
                }
            }
        }
    }
}

/// Column `c` of `b` dotted with one widening-layout activation row.
fn scalar_dot(b: &Cols, c: usize, x: &[Line]) -> f32 {
    let mut acc = [0f32; LANES];
    for i in 0..b.chunks {
        let w = b.chunk(c, i);
        let (odd, even) = (&x[2 * i].0, &x[2 * i + 1].0);
        for (j, a) in acc.iter_mut().enumerate() {
            let f =
                |l: &[u8; CHUNK_BYTES]| f32::from_ne_bytes(l[4 * j..4 * j + 4].try_into().unwrap());
            let wo = from_bf16(u16::from_le_bytes([w[4 * j + 2], w[4 * j + 3]]));
            let we = from_bf16(u16::from_le_bytes([w[4 * j], w[4 * j + 1]]));
            *a = wo.mul_add(f(odd), *a);
            *a = we.mul_add(f(even), *a);
        }
    }
    common::hsum16(&acc)
}

/// `v` rounded to the nearest bf16, ties to even (a NaN stays a quiet
/// NaN), as llama.cpp rounds activations.
pub fn to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

/// The f32 with the same value as bf16 `b`.
pub fn from_bf16(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}
