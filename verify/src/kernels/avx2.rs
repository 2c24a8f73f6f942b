//! AVX2 (+ FMA, F16C) kernels over the tiled layout ([`super::layout`]),
//! for x86-64 CPUs without AVX-512 VNNI (Haswell to Alder Lake, Zen 1-3).
//!
//! A tile's 16 columns are two halves of 8: each 64-byte run of a tile
//! block holds 32 bytes per half, one ymm of 4 codes for each of 8
//! columns. A tile block is walked once per half, so a half's per-row
//! state fits the 16 ymm registers AVX2 has.
//!
//! AVX2 has no `vpdpbusd`; its 4-way unsigned x signed byte dot is
//! `vpmaddubsw` (pairs into saturating i16) then `vpmaddwd` (pairs of i16
//! into i32). Saturation is avoided by bounding every i16 sum, and those
//! bounds let several `vpmaddubsw` results add up in i16 before one
//! `vpmaddwd` (activation codes are in [-127, 127]):
//! - 4-bit codes (Q4_K, Q4_1): a pair is at most 2 * 15 * 127 = 3810,
//!   eight pairs 30480: one `vpmaddwd` per 32 inputs;
//! - 5-bit codes (Q5_0): 2 * 31 * 127 = 7874, four pairs 31496;
//! - 6-bit codes (Q6_K): 2 * 63 * 127 = 16002, two pairs 32004;
//! - Q8_0's signed bytes would reach 2 * 255 * 127 with the +128 offset
//!   the AVX-512 path uses, so they enter as |w| times the activation
//!   given w's sign (`vpsignb`): at most 2 * 128 * 127 = 32512, one
//!   `vpmaddwd` per 4 inputs and no offset correction.
//!
//! The float work after each integer sum is the AVX-512 kernel's, in its
//! order (Q4_K: one `fma` with the sub-block's scale and one with its min
//! per 32 inputs, one with the activation scale per block), so both paths
//! give the same bits. Offsets of unsigned codes (Q6_K's +32, Q5_0's +16)
//! start the integer sums from the activations' code sums (`off`), mins go
//! through `fsum`, as in the AVX-512 path ([`super::act`]).
//!
//! Batch invariance: each (row, column) accumulator runs the same
//! instructions in the same order whatever the group size `R`.
//!
//! Every function here requires the features [`super::Isa::Avx2`]
//! detects; callers check them.

use super::act::Acts;
use super::layout::{tile_block_bytes, TILE};
use super::{prefetch, prefetch_step, Format, GROUP};
use std::arch::x86_64::*;

/// Columns per half of a tile (one ymm of i32 or f32 lanes).
const HALF: usize = 8;

/// Dots one tile (its `a.nb` tile blocks) with activation rows
/// `r0..r0 + rows` (1..=GROUP) into `out[row]`, all 16 columns.
///
/// # Safety
/// The CPU must support avx2, fma and f16c; `tile` holds `a.nb` tile
/// blocks of `format`; `a` holds rows `r0..r0 + rows` quantized for
/// `format`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile_rows(
    format: Format,
    tile: &[u8],
    a: &Acts,
    r0: usize,
    rows: usize,
    out: &mut [[f32; TILE]; GROUP],
) {
    debug_assert!(tile.len() >= a.nb * tile_block_bytes(format));
    debug_assert!(a.d.len() >= (r0 + rows) * a.nb && rows <= GROUP);
    match format {
        Format::Q4K => by_rows!(q4k, rows, tile, a, r0, out),
        Format::Q6K => by_rows!(q6k, rows, tile, a, r0, out),
        Format::Q8_0 => by_rows!(q8_0, rows, tile, a, r0, out),
        Format::Q5_0 => by_rows!(q5_0, rows, tile, a, r0, out),
        Format::Q4_1 => by_rows!(q4_1, rows, tile, a, r0, out),
    }
}

/// 8 f16 values at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
}

/// 8 unsigned bytes at `p` as i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn u8x8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
}

/// 8 signed bytes at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn i8x8f(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
}

/// The 4 activation codes at `p` broadcast to every lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x4(p: *const i8) -> __m256i {
    _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// 32 bytes at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p.cast())
}

/// Half a nibble group's low and high codes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> (__m256i, __m256i) {
    let v = load(p);
    let m4 = _mm256_set1_epi8(0x0F);
    (
        _mm256_and_si256(v, m4),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
    )
}

/// Unsigned codes `w` (4 per column) times the 4 activation codes at `x`,
/// as two i16 sums of pairs per column (the caller bounds them).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot16(w: __m256i, x: *const i8) -> __m256i {
    _mm256_maddubs_epi16(w, x4(x))
}

/// Sums a column's two i16 lanes into its i32 lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum16(v: __m256i) -> __m256i {
    _mm256_madd_epi16(v, _mm256_set1_epi16(1))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store<const R: usize>(acc: &[[__m256; R]; 2], out: &mut [[f32; TILE]; GROUP]) {
    for (h, half) in acc.iter().enumerate() {
        for (v, o) in half.iter().zip(out.iter_mut()) {
            _mm256_storeu_ps(o.as_mut_ptr().add(HALF * h), *v);
        }
    }
}

/// Prefetches a whole tile block of `tb` bytes at `p` (see
/// [`super::AHEAD`]).
#[inline(always)]
fn prefetch_block(p: *const u8, tb: usize) {
    for l in 0..tb.div_ceil(64) {
        prefetch(p, 64 * l);
    }
}

// The K-quant kernels prefetch ahead only for several rows: one row's
// blocks go fast enough for the hardware prefetcher, and the software
// prefetches then only cost (measured on an AVX2 EPYC, K3 real-width
// slice, Q4_K_M decode: 7.97 -> 8.85 tok/s without them for one row,
// medians of 4 alternating runs), while 4 rows streamed 5-15% faster
// with them (`cargo bench --bench mxfp4_stream`, its q4k line).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k<const R: usize>(tile: &[u8], a: &Acts, r0: usize, out: &mut [[f32; TILE]; GROUP]) {
    let nb = a.nb;
    let tb = tile_block_bytes(Format::Q4K);
    debug_assert_eq!(tb, 2368);
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    for b in 0..nb {
        let p = tile.as_ptr().add(b * tb);
        let ab: [usize; R] = std::array::from_fn(|r| (r0 + r) * nb + b);
        for (h, acc) in acc.iter_mut().enumerate() {
            let (vd, vm) = (f16x8(p.add(16 * h)), f16x8(p.add(32 + 16 * h)));
            let mut blk = [_mm256_setzero_ps(); R];
            for j in 0..8 {
                if R > 1 {
                    prefetch_step::<2368, 16>(p, 8 * h + j);
                }
                let sc = _mm256_cvtepi32_ps(u8x8(p.add(64 + TILE * j + HALF * h)));
                let sc = _mm256_mul_ps(sc, vd);
                let mn = _mm256_cvtepi32_ps(u8x8(p.add(192 + TILE * j + HALF * h)));
                let mn = _mm256_mul_ps(mn, vm);
                let mut s16 = [_mm256_setzero_si256(); R];
                for g in 4 * j..4 * j + 4 {
                    let (lo, hi) = nibbles(p.add(320 + 64 * g + 32 * h));
                    for r in 0..R {
                        let x = a.q.as_ptr().add(ab[r] * 256 + 8 * g);
                        s16[r] = _mm256_add_epi16(s16[r], dot16(lo, x));
                        s16[r] = _mm256_add_epi16(s16[r], dot16(hi, x.add(4)));
                    }
                }
                // The AVX-512 kernel's float order (see the module doc).
                for r in 0..R {
                    let isum = _mm256_cvtepi32_ps(hsum16(s16[r]));
                    blk[r] = _mm256_fmadd_ps(isum, sc, blk[r]);
                    let s = *a.fsum.get_unchecked(ab[r] * 8 + j);
                    blk[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(s), blk[r]);
                }
            }
            for r in 0..R {
                let dx = _mm256_set1_ps(*a.d.get_unchecked(ab[r]));
                acc[r] = _mm256_fmadd_ps(blk[r], dx, acc[r]);
            }
        }
    }
    store::<R>(&acc, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k<const R: usize>(tile: &[u8], a: &Acts, r0: usize, out: &mut [[f32; TILE]; GROUP]) {
    let nb = a.nb;
    let tb = tile_block_bytes(Format::Q6K);
    debug_assert_eq!(tb, 3360);
    let m30 = _mm256_set1_epi8(0x30);
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    for b in 0..nb {
        let p = tile.as_ptr().add(b * tb);
        let ab: [usize; R] = std::array::from_fn(|r| (r0 + r) * nb + b);
        for (h, acc) in acc.iter_mut().enumerate() {
            let vd = f16x8(p.add(16 * h));
            let mut blk = [_mm256_setzero_ps(); R];
            for s in 0..16 {
                if R > 1 {
                    prefetch_step::<3360, 32>(p, 16 * h + s);
                }
                let sc = _mm256_mul_ps(i8x8f(p.add(32 + TILE * s + HALF * h)), vd);
                let (l0, h0) = nibbles(p.add(288 + 128 * s + 32 * h));
                let (l1, h1) = nibbles(p.add(288 + 128 * s + 64 + 32 * h));
                let qh = load(p.add(288 + 2048 + 64 * s + 32 * h));
                // Bits 2i..2i+2 of each high byte move to bits 4..6 of code i.
                let w = [
                    _mm256_or_si256(l0, _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m30)),
                    _mm256_or_si256(h0, _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30)),
                    _mm256_or_si256(l1, _mm256_and_si256(qh, m30)),
                    _mm256_or_si256(h1, _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30)),
                ];
                for r in 0..R {
                    let x = a.q.as_ptr().add(ab[r] * 256 + 16 * s);
                    let t0 = _mm256_add_epi16(dot16(w[0], x), dot16(w[1], x.add(4)));
                    let t1 = _mm256_add_epi16(dot16(w[2], x.add(8)), dot16(w[3], x.add(12)));
                    let off = _mm256_set1_epi32(*a.off.get_unchecked(ab[r] * 16 + s));
                    // Exact in any order; this one lets a compiler fuse
                    // each `vpmaddwd` with its add where it may.
                    let isum = _mm256_add_epi32(_mm256_add_epi32(off, hsum16(t0)), hsum16(t1));
                    blk[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, blk[r]);
                }
            }
            for r in 0..R {
                let dx = _mm256_set1_ps(*a.d.get_unchecked(ab[r]));
                acc[r] = _mm256_fmadd_ps(blk[r], dx, acc[r]);
            }
        }
    }
    store::<R>(&acc, out)
}

/// The 32-input formats: per half, 8 vectors of codes (4 inputs each) built
/// once per tile block, then each row's integer dot and one FMA.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q32<const R: usize>(
    format: Format,
    tile: &[u8],
    a: &Acts,
    r0: usize,
    out: &mut [[f32; TILE]; GROUP],
) {
    let nb = a.nb;
    let tb = tile_block_bytes(format);
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    for b in 0..nb {
        let p = tile.as_ptr().add(b * tb);
        prefetch_block(p, tb);
        let ab: [usize; R] = std::array::from_fn(|r| (r0 + r) * nb + b);
        for (h, acc) in acc.iter_mut().enumerate() {
            let vd = f16x8(p.add(16 * h));
            // Q8_0: signed codes; the rest: unsigned. Q8_0's groups are 4
            // consecutive inputs; the nibble formats' pairs are inputs
            // 8g..8g+4 and 8g+4..8g+8, so in both vector i covers inputs
            // 4i..4i+4.
            let w: [__m256i; 8] = match format {
                Format::Q8_0 => std::array::from_fn(|g| load(p.add(32 + 64 * g + 32 * h))),
                Format::Q5_0 => {
                    let qh = load(p.add(32 + 32 * h));
                    let m10 = _mm256_set1_epi8(0x10);
                    // Bit `i` of each high byte moved to bit 4.
                    let hb = [
                        _mm256_slli_epi16::<4>(qh),
                        _mm256_slli_epi16::<3>(qh),
                        _mm256_slli_epi16::<2>(qh),
                        _mm256_slli_epi16::<1>(qh),
                        qh,
                        _mm256_srli_epi16::<1>(qh),
                        _mm256_srli_epi16::<2>(qh),
                        _mm256_srli_epi16::<3>(qh),
                    ];
                    let mut w = [_mm256_setzero_si256(); 8];
                    for g in 0..4 {
                        let (lo, hi) = nibbles(p.add(96 + 64 * g + 32 * h));
                        w[2 * g] = _mm256_or_si256(lo, _mm256_and_si256(hb[2 * g], m10));
                        w[2 * g + 1] = _mm256_or_si256(hi, _mm256_and_si256(hb[2 * g + 1], m10));
                    }
                    w
                }
                _ => {
                    let mut w = [_mm256_setzero_si256(); 8];
                    for g in 0..4 {
                        (w[2 * g], w[2 * g + 1]) = nibbles(p.add(64 + 64 * g + 32 * h));
                    }
                    w
                }
            };
            // Q8_0: |w|, the activations take w's sign.
            let aw: [__m256i; 8] = match format {
                Format::Q8_0 => std::array::from_fn(|g| _mm256_abs_epi8(w[g])),
                _ => w,
            };
            for r in 0..R {
                let x = a.q.as_ptr().add(ab[r] * 32);
                let isum = match format {
                    Format::Q8_0 => {
                        let mut isum = _mm256_setzero_si256();
                        for g in 0..8 {
                            let xs = _mm256_sign_epi8(x4(x.add(4 * g)), w[g]);
                            let t = _mm256_maddubs_epi16(aw[g], xs);
                            isum = _mm256_add_epi32(isum, hsum16(t));
                        }
                        isum
                    }
                    Format::Q5_0 => {
                        let mut t = [_mm256_setzero_si256(); 2];
                        for (i, wi) in w.iter().enumerate() {
                            t[i / 4] = _mm256_add_epi16(t[i / 4], dot16(*wi, x.add(4 * i)));
                        }
                        let off = _mm256_set1_epi32(-16 * *a.off.get_unchecked(ab[r]));
                        _mm256_add_epi32(off, _mm256_add_epi32(hsum16(t[0]), hsum16(t[1])))
                    }
                    _ => {
                        let mut t = _mm256_setzero_si256();
                        for (i, wi) in w.iter().enumerate() {
                            t = _mm256_add_epi16(t, dot16(*wi, x.add(4 * i)));
                        }
                        hsum16(t)
                    }
                };
                let dx = _mm256_set1_ps(*a.d.get_unchecked(ab[r]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(vd, dx), acc[r]);
                if format == Format::Q4_1 {
                    let vm = f16x8(p.add(32 + 16 * h));
                    let s = _mm256_set1_ps(*a.fsum.get_unchecked(ab[r]));
                    acc[r] = _mm256_fmadd_ps(vm, s, acc[r]);
                }
            }
        }
    }
    store::<R>(&acc, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0<const R: usize>(tile: &[u8], a: &Acts, r0: usize, out: &mut [[f32; TILE]; GROUP]) {
    q32::<R>(Format::Q8_0, tile, a, r0, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0<const R: usize>(tile: &[u8], a: &Acts, r0: usize, out: &mut [[f32; TILE]; GROUP]) {
    q32::<R>(Format::Q5_0, tile, a, r0, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1<const R: usize>(tile: &[u8], a: &Acts, r0: usize, out: &mut [[f32; TILE]; GROUP]) {
    q32::<R>(Format::Q4_1, tile, a, r0, out)
}
