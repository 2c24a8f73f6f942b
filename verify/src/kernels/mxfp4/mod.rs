//! MXFP4 (OCP microscaling FP4) weights: 32 E2M1 values share one E8M0
//! power-of-two scale. Two byte layouts carry the same numbers:
//!
//! - compressed-tensors `mxfp4-pack-quantized` (Hugging Face checkpoints):
//!   `weight_packed` `[rows, cols / 2]`, element `2i` in the low nibble of
//!   byte `i` and `2i + 1` in the high one; `weight_scale` `[rows, cols / 32]`.
//! - ggml `block_mxfp4` (GGUF type 39): per 32 values one scale byte, then
//!   16 bytes where byte `j` holds element `j` (low) and `j + 16` (high).
//!
//! [`Mxfp4Matrix`] keeps a weight in ggml's blocks (4.25 bits per value),
//! either as the file's rows, owned or borrowed from a file mapping
//! ([`Bytes`]) with a row stride so a shard or one expert of a stacked
//! tensor is a view, not a copy; or tiled (same size): the rows of each
//! slab of [`SLAB`] interleaved block by block, which is what the AVX2
//! kernel reads (the loader tiles for it, [`prefers_tiles`]). It
//! multiplies the way ggml's CPU backend does: each activation row is
//! quantized to Q8_0 ([`Q8Acts`]: 32 int8 codes and one f16 scale per
//! block) and each block's dot product is an integer sum scaled by the
//! weight's halved E8M0 scale times the activation's scale. So our logits
//! follow llama.cpp's on the same file, rounding of the inputs included.
//!
//! The kernels ([`scalar`], `avx2`, `avx512`) compute a slab of [`SLAB`]
//! weight rows for up to [`GROUP`] activation rows per call: each weight
//! block is decoded once (nibbles to int8 by a 16-entry shuffle) and
//! transposed (by the tiles, or on the fly from rows) so that one vector
//! lane is one weight row; every
//! activation row then advances all lanes with 4 broadcast codes per
//! byte-dot instruction, as the tiled kernels of [`super`] do. A pass of R
//! rows reads the weights once, and a row's extra cost is its multiply-adds.
//!
//! Numbers, bit for bit the same on every [`Isa`]: for weight row `o` and
//! activation row `r`, with `I_b` the exact integer dot of block `b`
//! (doubled E2M1 codes times Q8_0 codes) and `s_b = e8m0_half(e_b) * d_b`
//! rounded to f32, `y = fma(I_b, s_b, y)` over `b` in order from `y = 0`.
//! Every ISA runs exactly these float operations (one lane per weight
//! row), so results do not depend on the instruction set, on the number of
//! rows in a call (batch invariance: row r of the output depends only on
//! row r of the input), or on how rows and slabs are split over threads.

mod scalar;
mod tiles;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;

use super::bytes::Bytes;
use super::{Isa, Path, GROUP};
use crate::team::SharedMut;

/// ggml's GGUF type id of `block_mxfp4`.
pub const GGML_TYPE_MXFP4: u32 = 39;

/// Bytes of one ggml block (32 values).
pub const BLOCK_BYTES: usize = 17;

/// Weight rows one kernel call computes together: one AVX-512 lane each
/// (the AVX2 kernel runs a slab as two halves of 8).
pub const SLAB: usize = 16;

/// ggml's E2M1 codes doubled, as integers (the scale is halved to match).
pub(super) const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// What the kernels add to every [`KVALUES`] code so that it is unsigned
/// (the byte-dot instructions take one unsigned operand); [`Q8Acts`]
/// carries the matching correction, `-BIAS` times each block's code sum.
const BIAS: i32 = 12;

/// [`KVALUES`] plus [`BIAS`], the kernels' shuffle table.
const KVALUES_BIASED: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (KVALUES[i] as i32 + BIAS) as u8;
        i += 1;
    }
    t
};

/// `2^(e - 128)` for every E8M0 byte, as ggml's `ggml_e8m0_to_fp32_half`
/// builds it from bits: `e` of 0 and 1 are the subnormals 2^-128 and
/// 2^-127, 255 is 2^127 (the OCP spec's NaN; no checkpoint writes it).
pub(super) static E8M0_HALF: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut e = 0;
    while e < 256 {
        let bits = if e < 2 {
            0x0020_0000u32 << e
        } else {
            (e as u32 - 1) << 23
        };
        t[e] = f32::from_bits(bits);
        e += 1;
    }
    t
};

/// The halved E8M0 scale `2^(e - 128)` (see [`E8M0_HALF`]), which pairs
/// with the doubled E2M1 codes.
pub fn e8m0_half(e: u8) -> f32 {
    E8M0_HALF[e as usize]
}

/// One value: doubled code times halved scale (exact: a small integer
/// times a power of two).
fn value(code: u8, e: u8) -> f32 {
    KVALUES[code as usize] as f32 * e8m0_half(e)
}

/// The compressed-tensors layout's length check: the message of a
/// mismatch, or `None`.
fn packed_mismatch(packed: usize, scales: usize, rows: usize, cols: usize) -> Option<String> {
    if cols.is_multiple_of(32) && packed == rows * cols / 2 && scales == rows * cols / 32 {
        return None;
    }
    Some(format!(
        "MXFP4 [{rows}, {cols}] needs {} packed and {} scale bytes, got {packed} and {scales}",
        rows * cols / 2,
        rows * cols / 32,
    ))
}

/// Decodes compressed-tensors packing: `packed` `[rows, cols / 2]`,
/// `scales` `[rows, cols / 32]` -> `[rows, cols]` row-major.
///
/// Errors (as a message): lengths that do not match `rows` x `cols`, or
/// `cols` not a multiple of 32.
pub fn decode_packed(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, String> {
    if let Some(m) = packed_mismatch(packed.len(), scales.len(), rows, cols) {
        return Err(m);
    }
    let mut out = Vec::with_capacity(rows * cols);
    for (i, &b) in packed.iter().enumerate() {
        let e = scales[i * 2 / 32];
        out.push(value(b & 15, e));
        out.push(value(b >> 4, e));
    }
    Ok(out)
}

/// Decodes ggml `block_mxfp4` data of `n` values (a multiple of 32).
///
/// Errors (as a message): a byte length that is not `n / 32` blocks.
pub fn decode_ggml(blocks: &[u8], n: usize) -> Result<Vec<f32>, String> {
    if !n.is_multiple_of(32) || blocks.len() != n / 32 * BLOCK_BYTES {
        return Err(format!(
            "MXFP4 tensor of {n} values needs {} bytes, got {}",
            n / 32 * BLOCK_BYTES,
            blocks.len()
        ));
    }
    let mut out = vec![0f32; n];
    for (b, o) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(32))
    {
        for j in 0..16 {
            o[j] = value(b[1 + j] & 15, b[0]);
            o[j + 16] = value(b[1 + j] >> 4, b[0]);
        }
    }
    Ok(out)
}

/// A `[out, inp]` matrix of ggml `block_mxfp4` blocks (`inp / 32` per
/// row), in one of two layouts ([`Layout`]).
///
/// Invariant (checked at construction): `inp` is a multiple of 32; in the
/// row layout the stride is at least a row's bytes and the storage holds
/// every row; a tiled matrix's storage holds every slab's tile.
#[derive(Clone)]
pub struct Mxfp4Matrix {
    bytes: Bytes,
    out: usize,
    inp: usize,
    layout: Layout,
}

/// Where a matrix's blocks sit in its storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// ggml rows as the file stores them, row `o` at `o * stride` (a view
    /// of a mapping: no copy at load).
    Rows { stride: usize },
    /// [`TILE_BLOCK`]-byte tile blocks: slab `s` (rows `SLAB * s..`), block
    /// `b` at `(s * nb + b) * TILE_BLOCK` (see [`Mxfp4Matrix::tiled`]).
    Tiled,
}

/// Bytes of one tile block: a slab's [`SLAB`] blocks, same size as in rows.
pub const TILE_BLOCK: usize = SLAB * BLOCK_BYTES;

/// Where code byte `k` (0..16) of slab row `i` (0..SLAB) sits in a tile
/// block: after the [`SLAB`] scale bytes, two halves of 8 rows, each four
/// 32-byte vectors `g` whose 4-byte lane `i % 8` holds the row's bytes
/// `4g..4g + 4` (the transpose the AVX2 kernel otherwise builds with
/// unpacks, stored once).
const fn tile_code_at(i: usize, k: usize) -> usize {
    SLAB + 128 * (i / 8) + 32 * (k / 4) + 4 * (i % 8) + k % 4
}

/// Whether matrices built for `isa` should be tiled: the AVX2 kernel reads
/// tiles as one sequential stream with no transposes (measured in
/// `benches/mxfp4_stream.rs`); the AVX-512 kernel transposes full slabs
/// with wide permutes and keeps the file's rows, and the scalar
/// reference reads either.
pub fn prefers_tiles(isa: Isa) -> bool {
    isa == Isa::Avx2
}

/// Bytes of one row of `inp` values.
fn row_bytes(inp: usize) -> usize {
    inp / 32 * BLOCK_BYTES
}

impl Mxfp4Matrix {
    /// Wraps ggml block data of exactly `out` contiguous rows (as GGUF
    /// stores a `[inp, out]` tensor), without copying it.
    ///
    /// Errors (as a message): a length that does not match.
    pub fn from_ggml(bytes: impl Into<Bytes>, out: usize, inp: usize) -> Result<Self, String> {
        let bytes = bytes.into();
        if !inp.is_multiple_of(32) || bytes.len() != out * row_bytes(inp) {
            return Err(format!(
                "MXFP4 [{out}, {inp}] needs {} bytes, got {}",
                out * row_bytes(inp),
                bytes.len()
            ));
        }
        Self::from_ggml_strided(bytes, out, inp, row_bytes(inp))
    }

    /// Wraps ggml block rows that start every `row_stride` bytes (a rank's
    /// column shard of a wider matrix, say), without copying them. The
    /// storage may extend past the last row.
    ///
    /// Errors (as a message): `inp` not a multiple of 32, a stride shorter
    /// than a row, or storage that does not hold every row.
    pub fn from_ggml_strided(
        bytes: impl Into<Bytes>,
        out: usize,
        inp: usize,
        row_stride: usize,
    ) -> Result<Self, String> {
        let bytes = bytes.into();
        let rb = row_bytes(inp);
        if !inp.is_multiple_of(32) || row_stride < rb {
            return Err(format!(
                "MXFP4 [{out}, {inp}]: inputs must be a multiple of 32 and the row \
                 stride ({row_stride}) at least a row's {rb} bytes"
            ));
        }
        let need = if out == 0 {
            0
        } else {
            (out - 1) * row_stride + rb
        };
        if bytes.len() < need {
            return Err(format!(
                "MXFP4 [{out}, {inp}] with row stride {row_stride} needs {need} bytes, got {}",
                bytes.len()
            ));
        }
        Ok(Self {
            bytes,
            out,
            inp,
            layout: Layout::Rows { stride: row_stride },
        })
    }

    /// Repacks compressed-tensors data (see the module docs) into owned
    /// ggml blocks, losslessly; the lengths are checked first, nothing is
    /// decoded.
    ///
    /// Errors (as a message): lengths that do not match.
    pub fn from_packed(
        packed: &[u8],
        scales: &[u8],
        out: usize,
        inp: usize,
    ) -> Result<Self, String> {
        if let Some(m) = packed_mismatch(packed.len(), scales.len(), out, inp) {
            return Err(m);
        }
        let mut blocks = Vec::with_capacity(out * row_bytes(inp));
        for (src, &e) in packed.chunks_exact(16).zip(scales) {
            let code = |i: usize| (src[i / 2] >> (4 * (i % 2))) & 15;
            blocks.push(e);
            blocks.extend((0..16).map(|j| code(j) | (code(j + 16) << 4)));
        }
        Self::from_ggml(blocks, out, inp)
    }

    /// Rows `rows` and inputs `cols` (multiples of 32 at both ends) as a
    /// view sharing this matrix's storage.
    ///
    /// Errors (as a message): a range outside the matrix, or input bounds
    /// not on a block boundary.
    pub fn view(
        &self,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Result<Self, String> {
        if rows.start > rows.end
            || rows.end > self.out
            || cols.start > cols.end
            || cols.end > self.inp
            || !cols.start.is_multiple_of(32)
            || !cols.end.is_multiple_of(32)
        {
            return Err(format!(
                "MXFP4 view [{rows:?}, {cols:?}] outside [{}, {}] or off a 32-block bound",
                self.out, self.inp
            ));
        }
        let Layout::Rows { stride } = self.layout else {
            // Tiles interleave rows: the view's rows are gathered.
            let mut b = Vec::with_capacity(rows.len() * row_bytes(cols.len()));
            for o in rows.clone() {
                b.extend_from_slice(&self.row(o)[row_bytes(cols.start)..row_bytes(cols.end)]);
            }
            return Self::from_ggml(b, rows.len(), cols.len());
        };
        let start = rows.start * stride + row_bytes(cols.start);
        let end = if rows.is_empty() {
            start
        } else {
            (rows.end - 1) * stride + row_bytes(cols.end)
        };
        let bytes = self
            .bytes
            .slice(start..end)
            .ok_or("MXFP4 view outside storage")?;
        Self::from_ggml_strided(bytes, rows.len(), cols.len(), stride)
    }

    /// The same matrix in the tiled layout (a copy; a tiled matrix is
    /// returned as is). Slab rows past `out` repeat the last row, so the
    /// kernels never branch on a short slab (their results are dropped).
    /// Mapped source pages are not released here: the caller knows
    /// whether anything else reads them.
    pub fn tiled(&self) -> Mxfp4Matrix {
        if self.layout == Layout::Tiled || self.out == 0 {
            return self.clone();
        }
        let nb = self.inp / 32;
        let slabs = self.out.div_ceil(SLAB);
        let mut t = vec![0u8; slabs * nb * TILE_BLOCK];
        for (s, tile) in t.chunks_exact_mut(nb * TILE_BLOCK).enumerate() {
            let rows = slab_of(self, SLAB * s);
            write_tile(&std::array::from_fn(|i| &*rows[i]), tile);
        }
        Mxfp4Matrix {
            bytes: t.into(),
            out: self.out,
            inp: self.inp,
            layout: Layout::Tiled,
        }
    }

    /// Whether this matrix is in the tiled layout.
    pub fn is_tiled(&self) -> bool {
        self.layout == Layout::Tiled
    }

    /// Output features (rows).
    pub fn out(&self) -> usize {
        self.out
    }

    /// Input features (columns).
    pub fn inp(&self) -> usize {
        self.inp
    }

    /// Bytes between the starts of consecutive rows; `None` when tiled.
    pub fn row_stride(&self) -> Option<usize> {
        match self.layout {
            Layout::Rows { stride } => Some(stride),
            Layout::Tiled => None,
        }
    }

    /// Bytes the weights occupy (what one pass reads): `out` rows of
    /// `inp / 32` blocks, whatever the stride.
    pub fn bytes(&self) -> usize {
        self.out * row_bytes(self.inp)
    }

    /// The storage (owned or mapped) the rows live in.
    pub fn storage(&self) -> &Bytes {
        &self.bytes
    }

    /// Row `o`'s blocks in ggml's layout: borrowed from the rows, or put
    /// back together from the tiles.
    ///
    /// Panics if `o` is not below [`Mxfp4Matrix::out`].
    pub fn row(&self, o: usize) -> std::borrow::Cow<'_, [u8]> {
        assert!(o < self.out, "MXFP4 row {o} of {}", self.out);
        match self.layout {
            Layout::Rows { stride } => std::borrow::Cow::Borrowed(
                &self.bytes[o * stride..o * stride + row_bytes(self.inp)],
            ),
            Layout::Tiled => {
                let (s, i) = (o / SLAB, o % SLAB);
                let nb = self.inp / 32;
                let tile = &self.bytes[s * nb * TILE_BLOCK..(s + 1) * nb * TILE_BLOCK];
                let mut row = Vec::with_capacity(row_bytes(self.inp));
                for tb in tile.chunks_exact(TILE_BLOCK) {
                    row.push(tb[i]);
                    row.extend((0..16).map(|k| tb[tile_code_at(i, k)]));
                }
                std::borrow::Cow::Owned(row)
            }
        }
    }

    /// Slab `s`'s tile blocks (tiled layout only).
    fn tile(&self, s: usize) -> &[u8] {
        debug_assert!(self.is_tiled());
        let n = self.inp / 32 * TILE_BLOCK;
        &self.bytes[s * n..(s + 1) * n]
    }

    /// The weights as f32 `[out, inp]` (tests and the exact reference).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = Vec::with_capacity(self.out * self.inp);
        for o in 0..self.out {
            w.extend(decode_ggml(&self.row(o), self.inp).expect("rows checked at construction"));
        }
        w
    }

    /// `out[r * self.out() + o]` = row `o` of the weights dotted with row
    /// `r` of `x` (`rows x inp`), activations quantized to Q8_0; uses
    /// [`Isa::current`]. Row r of the result depends only on row r of `x`.
    ///
    /// Panics if `x` or `out` are shorter than `rows * inp` / `rows * out`.
    pub fn matmul(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        self.matmul_with(Isa::current(), x, rows, out)
    }

    /// [`Mxfp4Matrix::matmul`] with an explicit instruction set.
    ///
    /// Panics as [`Mxfp4Matrix::matmul`] does, or if this CPU lacks `isa`.
    pub fn matmul_with(&self, isa: Isa, x: &[f32], rows: usize, out: &mut [f32]) {
        let acts = Q8Acts::new(x, rows, self.inp);
        matmul_grouped_with(
            isa,
            &mut [Mxfp4Product {
                w: self,
                acts: &acts,
                out,
            }],
        );
    }

    /// `x` `[n, inp]` times the transpose, `[n, out]` (see
    /// [`Mxfp4Matrix::matmul`]).
    ///
    /// Panics if `x`'s length is not a multiple of `inp`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        assert!(self.inp > 0 && x.len().is_multiple_of(self.inp));
        let rows = x.len() / self.inp;
        let mut y = vec![0f32; rows * self.out];
        self.matmul(x, rows, &mut y);
        y
    }
}

/// Activation rows quantized to Q8_0 once, to feed any number of MXFP4
/// products over the same input (gate and up of an expert, or every
/// expert a row is routed to).
///
/// Each row is quantized alone, as ggml's x86 `quantize_row_q8_0` does:
/// per 32 values `d = amax / 127` rounded to f16, codes
/// `round_ties_even(x * 127 / amax)`.
pub struct Q8Acts {
    rows: usize,
    inp: usize,
    /// `rows * inp` codes in [-127, 127].
    q: Vec<i8>,
    /// Each block's scale (f16 value), `rows * inp / 32`.
    d: Vec<f32>,
    /// Each block's `-BIAS` times its code sum: the integer dot's start,
    /// which cancels [`KVALUES_BIASED`]'s offset.
    corr: Vec<i32>,
}

/// One block's input and where its codes, scale and correction go.
type BlockOut<'a> = ((&'a [f32], &'a mut [i8]), (&'a mut f32, &'a mut i32));

/// Inputs from which quantization is worth splitting over rayon's pool.
const PARALLEL_VALUES: usize = 1 << 16;

impl Q8Acts {
    /// Quantizes `x` `[rows, inp]` (`inp` a multiple of 32).
    ///
    /// Panics if `inp` is not a multiple of 32 or `x` is shorter than
    /// `rows * inp`.
    pub fn new(x: &[f32], rows: usize, inp: usize) -> Q8Acts {
        assert!(
            inp.is_multiple_of(32),
            "MXFP4 inputs {inp} not a multiple of 32"
        );
        let x = &x[..rows * inp];
        let nb = rows * inp / 32;
        let mut q = vec![0i8; rows * inp];
        let mut d = vec![0f32; nb];
        let mut corr = vec![0i32; nb];
        let block = |((xb, qb), (db, cb)): BlockOut| {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            *db = half::f16::from_f32(amax / 127.0).to_f32();
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            for (o, v) in qb.iter_mut().zip(xb) {
                *o = (v * id).round_ties_even() as i8;
            }
            *cb = -BIAS * qb.iter().map(|&v| v as i32).sum::<i32>();
        };
        if rows * inp >= PARALLEL_VALUES {
            use rayon::prelude::*;
            x.par_chunks_exact(32)
                .zip(q.par_chunks_exact_mut(32))
                .zip(d.par_iter_mut().zip(corr.par_iter_mut()))
                .for_each(block);
        } else {
            x.chunks_exact(32)
                .zip(q.chunks_exact_mut(32))
                .zip(d.iter_mut().zip(corr.iter_mut()))
                .for_each(block);
        }
        Q8Acts {
            rows,
            inp,
            q,
            d,
            corr,
        }
    }

    /// Activation rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn inp(&self) -> usize {
        self.inp
    }

    /// The codes, `rows * inp`, row-major.
    pub fn codes(&self) -> &[i8] {
        &self.q
    }

    /// Each block's scale (an f16 value), `rows * inp / 32`.
    pub fn scales(&self) -> &[f32] {
        &self.d
    }

    /// Blocks per row.
    fn nb(&self) -> usize {
        self.inp / 32
    }

    /// The quantized values as f32 (tests' reference).
    pub fn dequantize(&self) -> Vec<f32> {
        self.q
            .iter()
            .enumerate()
            .map(|(i, &v)| self.d[i / 32] * v as f32)
            .collect()
    }
}

/// One product of [`matmul_grouped`]: `out[r * w.out() + o]` = weight row
/// `o` dotted with activation row `r`, for all `acts.rows()` rows.
pub struct Mxfp4Product<'a> {
    pub w: &'a Mxfp4Matrix,
    pub acts: &'a Q8Acts,
    pub out: &'a mut [f32],
}

/// Several MXFP4 products (the experts of an MoE layer, each with the
/// activation rows routed to it) as one parallel pass: the slabs of
/// [`SLAB`] weight rows of all products are split over the thread team
/// together, and each slab is computed for all of its product's rows, so
/// every active expert's weights are read once. Each output equals
/// [`Mxfp4Matrix::matmul`]'s bit for bit. Uses [`Isa::current`].
///
/// Panics if a product's activations do not have its weight's input size
/// or its output is shorter than `acts.rows() * w.out()`.
pub fn matmul_grouped(products: &mut [Mxfp4Product]) {
    matmul_grouped_with(Isa::current(), products)
}

/// [`matmul_grouped`] with an explicit instruction set.
///
/// Panics as [`matmul_grouped`] does, or if this CPU lacks `isa`.
pub fn matmul_grouped_with(isa: Isa, products: &mut [Mxfp4Product]) {
    assert!(isa.available(), "{isa:?} is not available on this CPU");
    grouped(products, |rows| {
        if isa == Isa::Amx && rows >= super::amx_min_rows_mxfp4() {
            Path::Tiles
        } else {
            Path::Vector(isa.vector())
        }
    })
}

/// [`matmul_grouped`] with every product on the portable model of the
/// AMX tile instructions.
#[cfg(test)]
pub(crate) fn matmul_grouped_tile_model(products: &mut [Mxfp4Product]) {
    grouped(products, |_| Path::TileModel)
}

/// [`matmul_grouped`] with every product on AMX tiles, whatever its rows.
///
/// Panics if [`Isa::Amx`] is not available.
#[cfg(test)]
pub(crate) fn matmul_grouped_tiles(products: &mut [Mxfp4Product]) {
    assert!(Isa::Amx.available());
    grouped(products, |_| Path::Tiles)
}

/// One product on AVX-512 or, with `tiles`, on AMX tiles (the
/// calibration's two candidates; needs [`Isa::Amx`]).
pub(crate) fn matmul_one_path(w: &Mxfp4Matrix, a: &Q8Acts, out: &mut [f32], tiles: bool) {
    let path = if tiles {
        Path::Tiles
    } else {
        Path::Vector(Isa::Avx512Vnni)
    };
    grouped(&mut [Mxfp4Product { w, acts: a, out }], |_| path)
}

/// The products, each on the path `pick` gives for its row count.
fn grouped(products: &mut [Mxfp4Product], pick: impl Fn(usize) -> Path + Sync) {
    struct Job<'a> {
        w: &'a Mxfp4Matrix,
        a: &'a Q8Acts,
        out: SharedMut<f32>,
        first: usize,
        slabs: usize,
        path: Path,
    }
    let mut jobs = Vec::with_capacity(products.len());
    let mut total = 0;
    for p in products.iter_mut() {
        assert_eq!(p.acts.inp, p.w.inp, "MXFP4 product input sizes differ");
        assert!(
            p.out.len() >= p.acts.rows * p.w.out,
            "MXFP4 output too short"
        );
        if p.acts.rows == 0 || p.w.out == 0 || p.w.inp == 0 {
            p.out[..p.acts.rows * p.w.out].fill(0.0);
            continue;
        }
        let slabs = p.w.out.div_ceil(SLAB);
        jobs.push(Job {
            w: p.w,
            a: p.acts,
            out: SharedMut::new(p.out),
            first: total,
            slabs,
            path: pick(p.acts.rows),
        });
        total += slabs;
    }
    if total == 0 {
        return;
    }
    // Several chunks per thread so a slow core does not hold up the call.
    let chunk = total.div_ceil(crate::team::threads() * 4).max(1);
    crate::team::for_each(total.div_ceil(chunk), |ci| {
        let mut res = [[0f32; SLAB]; GROUP];
        let mut all: Vec<[f32; SLAB]> = Vec::new();
        let mut scratch: Option<super::amx::Scratch> = None;
        let mine = ci * chunk..((ci + 1) * chunk).min(total);
        for job in jobs.iter() {
            let (w, a) = (job.w, job.a);
            let own = job.first..job.first + job.slabs;
            for s in mine.start.max(own.start)..mine.end.min(own.end) {
                let o0 = (s - job.first) * SLAB;
                let n = SLAB.min(w.out - o0);
                let Path::Vector(isa) = job.path else {
                    all.resize(a.rows, [0.0; SLAB]);
                    let s = scratch.get_or_insert_with(Default::default);
                    slab_tiles(job.path, w, o0, a, &mut all, s);
                    for (r, v) in all.iter().enumerate() {
                        // SAFETY: as below.
                        unsafe {
                            let dst = job.out.at(r * w.out + o0);
                            std::ptr::copy_nonoverlapping(v.as_ptr(), dst, n);
                        }
                    }
                    continue;
                };
                for r0 in (0..a.rows).step_by(GROUP) {
                    let rr = (a.rows - r0).min(GROUP);
                    slab_rows(isa, w, o0, a, r0, rr, &mut res);
                    for (i, v) in res[..rr].iter().enumerate() {
                        // SAFETY: each task writes only its own slabs'
                        // outputs of rows below `a.rows`, and the output
                        // holds `a.rows * w.out` (asserted above).
                        unsafe {
                            let dst = job.out.at((r0 + i) * w.out + o0);
                            std::ptr::copy_nonoverlapping(v.as_ptr(), dst, n);
                        }
                    }
                }
            }
        }
    });
}

/// The slab at `o0` times all of `a`'s rows on a tile path.
fn slab_tiles(
    path: Path,
    w: &Mxfp4Matrix,
    o0: usize,
    a: &Q8Acts,
    out: &mut [[f32; SLAB]],
    s: &mut super::amx::Scratch,
) {
    let rows = slab_of(w, o0);
    let p: [&[u8]; SLAB] = std::array::from_fn(|i| &*rows[i]);
    // Which arms exist depends on the target and on cfg(test).
    #[allow(unreachable_patterns)]
    match path {
        #[cfg(target_arch = "x86_64")]
        Path::Tiles => {
            let mut hw = super::amx::tile::Hardware::new().expect("Isa::Amx is available");
            // SAFETY: AMX is available, which includes the AVX-512 set.
            unsafe { tiles::slab_product_hw(&mut hw, &p, a, a.rows, out, s) }
        }
        #[cfg(test)]
        Path::TileModel => {
            let mut model = super::amx::tile::Model::default();
            tiles::slab_product(&mut model, &p, a, a.rows, out, s)
        }
        _ => unreachable!("slab_tiles takes a tile path this target has"),
    }
}

/// The rows of the slab at `o0`; rows past the matrix repeat its last row
/// (their results are computed and dropped), so the kernels never branch
/// on a short slab. Tiles are put back into rows, for the kernels that
/// read rows (the scalar reference, AVX-512 on a matrix tiled for AVX2).
fn slab_of(w: &Mxfp4Matrix, o0: usize) -> [std::borrow::Cow<'_, [u8]>; SLAB] {
    std::array::from_fn(|i| w.row((o0 + i).min(w.out - 1)))
}

/// The slab of weight rows `o0..o0 + SLAB` dotted with activation rows
/// `r0..r0 + rows` (1..=GROUP) into `out[row][weight row - o0]`.
fn slab_rows(
    isa: Isa,
    w: &Mxfp4Matrix,
    o0: usize,
    a: &Q8Acts,
    r0: usize,
    rows: usize,
    out: &mut [[f32; SLAB]; GROUP],
) {
    debug_assert!(r0 + rows <= a.rows && rows <= GROUP && o0 < w.out);
    let rows_of = (!(isa == Isa::Avx2 && w.is_tiled())).then(|| slab_of(w, o0));
    let p: Option<[&[u8]; SLAB]> = rows_of.as_ref().map(|r| std::array::from_fn(|i| &*r[i]));
    match (isa.vector(), p) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, None) => {
            // SAFETY: `matmul_grouped_with` checked `Isa::available`; the
            // tile holds `a.nb()` tile blocks (`w.inp == a.inp`).
            unsafe { avx2::tile(w.tile(o0 / SLAB), a, r0, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, Some(p)) => {
            // A matrix kept in rows (not built by the loader for this
            // CPU): its slab is tiled for the call.
            let mut t = vec![0u8; a.nb() * TILE_BLOCK];
            write_tile(&p, &mut t);
            // SAFETY: as above, for the slab just tiled.
            unsafe { avx2::tile(&t, a, r0, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `matmul_grouped_with` checked `Isa::available`; every
        // row holds `a.nb()` blocks (`w.inp == a.inp`).
        (Isa::Avx512Vnni, Some(p)) => unsafe { avx512::slab(&p, a, r0, rows, out) },
        (_, Some(p)) => scalar::slab(&p, a, r0, rows, out),
        (_, None) => unreachable!("only the AVX2 kernel reads tiles"),
    }
}

/// Writes the tile of slab rows `p` (each `nb` ggml blocks) into `dst`
/// (`nb` tile blocks, see [`Layout::Tiled`]).
fn write_tile(p: &[&[u8]; SLAB], dst: &mut [u8]) {
    for (i, row) in p.iter().enumerate() {
        for (blk, tb) in row
            .chunks_exact(BLOCK_BYTES)
            .zip(dst.chunks_exact_mut(TILE_BLOCK))
        {
            tb[i] = blk[0];
            for k in 0..16 {
                tb[tile_code_at(i, k)] = blk[1 + k];
            }
        }
    }
}

/// Blocks whose scales the AVX-512 kernel gathers into a buffer before it
/// computes them (the buffer then stays in L1); also how far ahead, in
/// blocks, it prefetches each row.
#[cfg(target_arch = "x86_64")]
const CHUNK: usize = 32;

/// Fills `sc[k][i]` with the halved scale of block `b0 + k` of row `i`,
/// for `k < n` (a slab's scales, transposed to one vector per block).
///
/// # Safety
/// Every pointer in `p` is a row of at least `b0 + n` blocks.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn gather_scales<const L: usize>(
    p: &[*const u8],
    b0: usize,
    n: usize,
    sc: &mut [[f32; L]; CHUNK],
) {
    for (i, &row) in p[..L].iter().enumerate() {
        for (k, s) in sc[..n].iter_mut().enumerate() {
            s[i] = E8M0_HALF[*row.add((b0 + k) * BLOCK_BYTES) as usize];
        }
    }
}

/// Prefetches, for every row in `p`, the cache line [`CHUNK`] blocks past
/// block `b` (into L2; see [`super::prefetch_l2`]). Called every third
/// block: 51 bytes apart, so no line of a row is skipped.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_rows(p: &[*const u8], b: usize) {
    for &row in p {
        super::prefetch_l2(row, (b + CHUNK) * BLOCK_BYTES);
    }
}
