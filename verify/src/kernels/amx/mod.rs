//! Intel AMX tile products for the GGUF int8 formats (Q4_K, Q6_K, Q8_0,
//! Q5_0, Q4_1): one weight tile of 16 output columns against every
//! activation row of a call, 16 rows per A tile, for products with rows
//! enough to pay for the tiles ([`super::Isa::Amx`] picks them).
//!
//! Owns: the driver that walks a tile's blocks and sub-blocks, unpacks the
//! weight codes into a B tile, multiplies on a [`tile::TileUnit`] (the
//! `asm!` instructions, or the portable model that tests run on any host),
//! and the float epilogue.
//!
//! What is reused: [`super::layout`]'s tile blocks already hold each run
//! of 4 inputs as 4 bytes per column, 64 bytes for 16 columns: exactly a
//! row of a B tile in the 4-byte-group (VNNI) order `tdpbsud` reads. A B
//! tile is then the layout's 64-byte rows, nibbles split (Q4_K, Q4_1),
//! fifth or high bits merged (Q5_0, Q6_K) or as they are (Q8_0); the
//! unpack is the same `and`/shift the AVX-512 kernel does in registers,
//! written to 0.5 KiB of L1-resident scratch instead. Activations are
//! [`super::act`]'s codes, loaded straight from their rows (row stride =
//! the row's bytes) into A tiles. The weights keep their tiled size
//! (~1.0x the GGUF file): nothing is repacked at load.
//!
//! Exactness: the A x B products are exact i32 sums, the same integers the
//! VNNI kernels form. Each tile product covers exactly one of the
//! format's sub-blocks (Q4_K 32 inputs, Q6_K 16, the 32-input formats
//! their block), so the float epilogue runs the AVX-512 kernel's
//! operations in its order: for Q4_K `blk = fma(I_j, sc_j d, blk)` then
//! `blk = fma(mn_j dmin, fsum_j, blk)` per sub-block and `acc = fma(blk,
//! dx, acc)` per block; for Q6_K `blk = fma(I_s + off_s, sc_s d, blk)`;
//! for the 32-input formats `acc = fma(I, d dx, acc)` (Q4_1 then
//! `acc = fma(m, fsum, acc)`). `f32::mul_add` is IEEE's fused multiply-add
//! on every target, so this code gives the vector paths' bits wherever it
//! runs, on tiles or on the model ([`super::scalar`] runs the same
//! epilogue). Row r's result therefore does not depend on the rows beside
//! it, nor on whether AMX or AVX-512 computed it.

pub(crate) mod calibrate;
pub(crate) mod tile;

use super::act::Acts;
use super::layout::{tile_block_bytes, TILE};
use super::Format;
use tile::{TileConfig, TileUnit};

/// Activation rows per A tile.
pub(super) const AROWS: usize = 16;

/// Buffers one thread reuses across tile products: per-row block sums,
/// the C tiles stored back, the unpacked B tile, and a zero-padded copy
/// of a last A tile with fewer than [`AROWS`] rows (a tile load reads all
/// configured rows, and past the activations there is no memory to read).
pub(crate) struct Scratch {
    blk: Vec<[f32; TILE]>,
    c: Box<[Aligned<[[i32; TILE]; AROWS]>; 2]>,
    pub(super) b: Box<Aligned<[u8; 16 * 64]>>,
    a_tail: Box<Aligned<[u8; AROWS * 64]>>,
}

#[repr(C, align(64))]
pub(super) struct Aligned<T>(pub(super) T);

impl Default for Scratch {
    fn default() -> Scratch {
        Scratch {
            blk: Vec::new(),
            c: Box::new([Aligned([[0; TILE]; AROWS]), Aligned([[0; TILE]; AROWS])]),
            b: Box::new(Aligned([0; 16 * 64])),
            a_tail: Box::new(Aligned([0; AROWS * 64])),
        }
    }
}

/// Bytes of activation codes per tile product (the A tile's row).
fn k_bytes(format: Format) -> usize {
    match format {
        Format::Q6K => 16,
        _ => 32,
    }
}

/// The configuration of products `k` bytes deep: C in tmm0/tmm1, A in
/// tmm2/tmm3 (two row groups in flight), B in tmm4.
pub(super) fn config(k: usize) -> TileConfig {
    TileConfig::new()
        .with(0, AROWS, 64)
        .with(1, AROWS, 64)
        .with(2, AROWS, k)
        .with(3, AROWS, k)
        .with(4, k / 4, 64)
}

/// f16 bits as f32 (exact).
#[inline(always)]
fn f16(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// The 16 f16 values at `p` of a tile block.
#[inline(always)]
fn f16x16(t: &[u8], p: usize) -> [f32; TILE] {
    std::array::from_fn(|c| f16(u16::from_le_bytes([t[p + 2 * c], t[p + 2 * c + 1]])))
}

/// Multiplies one weight tile (its `a.nb` tile blocks, 16 columns) by
/// activation rows `0..rows` of `a`, into `out[..rows]` (each row's 16
/// column results; columns past the matrix are zero weights and give 0).
///
/// Runs the epilogue documented in the module doc on unit `u`, which must
/// be in the initial state; it is configured here and released at the end.
///
/// Panics if `out` is shorter than `rows` or `tile` shorter than `a.nb`
/// tile blocks.
#[inline(always)]
pub(crate) fn tile_product<U: TileUnit>(
    u: &mut U,
    format: Format,
    tile: &[u8],
    a: &Acts,
    rows: usize,
    out: &mut [[f32; TILE]],
    s: &mut Scratch,
) {
    let tb = tile_block_bytes(format);
    assert!(tile.len() >= a.nb * tb && out.len() >= rows);
    assert!(a.d.len() >= rows * a.nb);
    let out = &mut out[..rows];
    out.iter_mut().for_each(|o| *o = [0.0; TILE]);
    if rows == 0 {
        return;
    }
    u.configure(&config(k_bytes(format)));
    if s.blk.len() < rows {
        s.blk.resize(rows, [0.0; TILE]);
    }
    for b in 0..a.nb {
        let t = &tile[b * tb..(b + 1) * tb];
        match format {
            Format::Q4K => q4k(u, t, a, b, out, s),
            Format::Q6K => q6k(u, t, a, b, out, s),
            _ => q32(u, format, t, a, b, out, s),
        }
    }
    u.release();
}

/// Where a product's A rows are: activation codes `q`, row r's `k` bytes
/// at `first + r * stride`.
#[derive(Clone, Copy)]
pub(super) struct ARows<'a> {
    pub(super) q: &'a [i8],
    pub(super) first: usize,
    pub(super) stride: usize,
    pub(super) k: usize,
}

impl<'a> ARows<'a> {
    /// Bytes `at..at + k` of block `b` of [`Acts`] rows.
    fn of(a: &'a Acts, b: usize, at: usize, k: usize) -> ARows<'a> {
        ARows {
            q: &a.q,
            first: b * a.block + at,
            stride: a.nb * a.block,
            k,
        }
    }
}

/// Multiplies A (`a`'s rows) by the B tile already in tmm4, for every
/// 16-row group, two groups at a time; calls `epi(first_row,
/// rows_in_group, C)` for each group in order. `SIGNED` picks `tdpbssd`
/// (signed weight codes) over `tdpbsud`.
#[inline(always)]
pub(super) fn row_groups<U: TileUnit, const SIGNED: bool>(
    u: &mut U,
    a: ARows,
    rows: usize,
    s: &mut Scratch,
    mut epi: impl FnMut(usize, usize, &[[i32; TILE]; AROWS]),
) {
    let (stride, k) = (a.stride, a.k);
    assert!(rows == 0 || a.first + (rows - 1) * stride + k <= a.q.len());
    let groups = rows.div_ceil(AROWS);
    // Where group g's A rows are read from: the activations themselves,
    // or the zero-padded copy for a last, partial group.
    let a_ptr = |g: usize, tail: &mut Aligned<[u8; AROWS * 64]>| -> (*const u8, usize) {
        let r0 = g * AROWS;
        let n = AROWS.min(rows - r0);
        let first = a.first + r0 * stride;
        if n == AROWS {
            (a.q[first..].as_ptr().cast(), stride)
        } else {
            tail.0.fill(0);
            for i in 0..n {
                let src = &a.q[first + i * stride..first + i * stride + k];
                for (d, &v) in tail.0[64 * i..64 * i + k].iter_mut().zip(src) {
                    *d = v as u8;
                }
            }
            (tail.0.as_ptr(), 64)
        }
    };
    let mut g = 0;
    while g < groups {
        let two = g + 1 < groups;
        let (p, st) = a_ptr(g, &mut s.a_tail);
        // SAFETY: `p` covers AROWS rows of `k` bytes at `st`: whole groups
        // lie inside `a.q` (rows `r0..r0 + 16` exist), a partial one is the
        // 16 x 64 padded copy.
        unsafe { u.load::<2>(p, st) };
        u.zero::<0>();
        if SIGNED {
            u.dp_ss::<0, 2, 4>();
        } else {
            u.dp_su::<0, 2, 4>();
        }
        if two {
            let (p, st) = a_ptr(g + 1, &mut s.a_tail);
            // SAFETY: as above.
            unsafe { u.load::<3>(p, st) };
            u.zero::<1>();
            if SIGNED {
                u.dp_ss::<1, 3, 4>();
            } else {
                u.dp_su::<1, 3, 4>();
            }
        }
        // SAFETY: each C buffer is 16 rows of 64 bytes.
        unsafe { u.store::<0>(s.c[0].0.as_mut_ptr().cast(), 64) };
        if two {
            // SAFETY: as above.
            unsafe { u.store::<1>(s.c[1].0.as_mut_ptr().cast(), 64) };
        }
        epi(g * AROWS, AROWS.min(rows - g * AROWS), &s.c[0].0);
        if two {
            let r0 = (g + 1) * AROWS;
            epi(r0, AROWS.min(rows - r0), &s.c[1].0);
        }
        g += 2;
    }
}

/// Writes B rows `2i`, `2i + 1` as the low and high nibbles of the
/// 64-byte nibble groups at `t[at..]`, `groups` of them.
#[inline(always)]
fn unpack_nibbles(t: &[u8], at: usize, groups: usize, b: &mut [u8]) {
    for g in 0..groups {
        let src = &t[at + 64 * g..at + 64 * g + 64];
        let (lo, hi) = b[128 * g..128 * g + 128].split_at_mut(64);
        for i in 0..64 {
            lo[i] = src[i] & 0xF;
            hi[i] = src[i] >> 4;
        }
    }
}

/// A K-quant block's end: `acc = fma(blk, dx, acc)` for every row, with
/// row r's activation scale of block `b`.
#[inline(always)]
fn fold_block(a: &Acts, b: usize, blk: &[[f32; TILE]], acc: &mut [[f32; TILE]]) {
    for (r, (o, bl)) in acc.iter_mut().zip(blk).enumerate() {
        let dx = a.d[r * a.nb + b];
        for col in 0..TILE {
            o[col] = bl[col].mul_add(dx, o[col]);
        }
    }
}

// Inlined into `tile_product_hw`, so its epilogue gets AVX-512 and FMA.
#[inline(always)]
fn q4k<U: TileUnit>(
    u: &mut U,
    t: &[u8],
    a: &Acts,
    b: usize,
    acc: &mut [[f32; TILE]],
    s: &mut Scratch,
) {
    let rows = acc.len();
    let (d, dmin) = (f16x16(t, 0), f16x16(t, 32));
    let mut blk = std::mem::take(&mut s.blk);
    blk[..rows].iter_mut().for_each(|v| *v = [0.0; TILE]);
    for j in 0..8 {
        let scd: [f32; TILE] = std::array::from_fn(|c| t[64 + TILE * j + c] as f32 * d[c]);
        let mnd: [f32; TILE] = std::array::from_fn(|c| t[192 + TILE * j + c] as f32 * dmin[c]);
        unpack_nibbles(t, 320 + 256 * j, 4, &mut s.b.0[..512]);
        // SAFETY: the B scratch holds 8 rows of 64 bytes.
        unsafe { u.load::<4>(s.b.0.as_ptr(), 64) };
        row_groups::<U, false>(u, ARows::of(a, b, 32 * j, 32), rows, s, |r0, n, c| {
            for (i, ci) in c.iter().enumerate().take(n) {
                let fs = a.fsum[((r0 + i) * a.nb + b) * 8 + j];
                let bl = &mut blk[r0 + i];
                for col in 0..TILE {
                    bl[col] = (ci[col] as f32).mul_add(scd[col], bl[col]);
                    bl[col] = mnd[col].mul_add(fs, bl[col]);
                }
            }
        });
    }
    fold_block(a, b, &blk, acc);
    s.blk = blk;
}

// Inlined into `tile_product_hw`, so its epilogue gets AVX-512 and FMA.
#[inline(always)]
fn q6k<U: TileUnit>(
    u: &mut U,
    t: &[u8],
    a: &Acts,
    b: usize,
    acc: &mut [[f32; TILE]],
    s: &mut Scratch,
) {
    let rows = acc.len();
    let d = f16x16(t, 0);
    let mut blk = std::mem::take(&mut s.blk);
    blk[..rows].iter_mut().for_each(|v| *v = [0.0; TILE]);
    for sb in 0..16 {
        let scd: [f32; TILE] = std::array::from_fn(|c| t[32 + TILE * sb + c] as i8 as f32 * d[c]);
        // Codes of inputs 16sb + 4i.. for i in 0..4: the low nibbles of
        // two nibble groups, each with its 2 high bits (bits 2i, 2i+1 of
        // the high byte) moved to bits 4..6.
        let (lo, qh) = (288 + 128 * sb, 288 + 2048 + 64 * sb);
        let bt = &mut s.b.0[..256];
        for i in 0..64 {
            let (l0, l1, h) = (t[lo + i], t[lo + 64 + i], t[qh + i]);
            bt[i] = (l0 & 0xF) | ((h << 4) & 0x30);
            bt[64 + i] = (l0 >> 4) | ((h << 2) & 0x30);
            bt[128 + i] = (l1 & 0xF) | (h & 0x30);
            bt[192 + i] = (l1 >> 4) | ((h >> 2) & 0x30);
        }
        // SAFETY: the B scratch holds 4 rows of 64 bytes.
        unsafe { u.load::<4>(s.b.0.as_ptr(), 64) };
        row_groups::<U, false>(u, ARows::of(a, b, 16 * sb, 16), rows, s, |r0, n, c| {
            for (i, ci) in c.iter().enumerate().take(n) {
                let off = a.off[((r0 + i) * a.nb + b) * 16 + sb];
                let bl = &mut blk[r0 + i];
                for col in 0..TILE {
                    bl[col] = (ci[col].wrapping_add(off) as f32).mul_add(scd[col], bl[col]);
                }
            }
        });
    }
    fold_block(a, b, &blk, acc);
    s.blk = blk;
}

// Inlined into `tile_product_hw`, so its epilogue gets AVX-512 and FMA.
#[inline(always)]
fn q32<U: TileUnit>(
    u: &mut U,
    format: Format,
    t: &[u8],
    a: &Acts,
    b: usize,
    acc: &mut [[f32; TILE]],
    s: &mut Scratch,
) {
    let rows = acc.len();
    let d = f16x16(t, 0);
    let bt = &mut s.b.0[..512];
    match format {
        Format::Q8_0 => bt.copy_from_slice(&t[32..32 + 512]),
        Format::Q5_0 => {
            unpack_nibbles(t, 96, 4, bt);
            // Row 2g takes bit 2g of the column's high byte, row 2g + 1 bit
            // 2g + 1, as the code's fifth bit.
            for (row, chunk) in bt.chunks_exact_mut(64).enumerate() {
                for (i, v) in chunk.iter_mut().enumerate() {
                    *v |= ((t[32 + i] >> row) & 1) << 4;
                }
            }
        }
        _ => unpack_nibbles(t, 64, 4, bt),
    }
    // SAFETY: the B scratch holds 8 rows of 64 bytes.
    unsafe { u.load::<4>(s.b.0.as_ptr(), 64) };
    let m = (format == Format::Q4_1).then(|| f16x16(t, 32));
    let epi = |r0: usize, n: usize, c: &[[i32; TILE]; AROWS], acc: &mut [[f32; TILE]]| {
        for (i, ci) in c.iter().enumerate().take(n) {
            let ab = (r0 + i) * a.nb + b;
            let dx = a.d[ab];
            let start = if format == Format::Q5_0 {
                -16 * a.off[ab]
            } else {
                0
            };
            let o = &mut acc[r0 + i];
            for col in 0..TILE {
                let isum = ci[col].wrapping_add(start);
                o[col] = (isum as f32).mul_add(d[col] * dx, o[col]);
            }
            if let Some(m) = &m {
                let fs = a.fsum[ab];
                for col in 0..TILE {
                    o[col] = m[col].mul_add(fs, o[col]);
                }
            }
        }
    };
    if format == Format::Q8_0 {
        row_groups::<U, true>(u, ARows::of(a, b, 0, 32), rows, s, |r0, n, c| {
            epi(r0, n, c, acc)
        });
    } else {
        row_groups::<U, false>(u, ARows::of(a, b, 0, 32), rows, s, |r0, n, c| {
            epi(r0, n, c, acc)
        });
    }
}

/// [`tile_product`] on the tile instructions, with the epilogue compiled
/// for AVX-512 (16 columns are one register).
///
/// # Safety
/// The CPU must support the features [`super::Isa::Avx512Vnni`] detects
/// (holding a [`tile::Hardware`] proves AMX).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn tile_product_hw(
    u: &mut tile::Hardware,
    format: Format,
    tile: &[u8],
    a: &Acts,
    rows: usize,
    out: &mut [[f32; TILE]],
    s: &mut Scratch,
) {
    tile_product(u, format, tile, a, rows, out, s)
}
