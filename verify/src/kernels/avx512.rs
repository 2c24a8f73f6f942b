//! AVX-512 (F, BW, VL) + VNNI kernels over the tiled layout
//! ([`super::layout`]). One 64-byte load gives 4 weight codes for each of
//! 16 columns; `vpdpbusd` with 4 activation codes broadcast advances all
//! 16 column sums at once, for each activation row of the group while the
//! weights sit in registers. Scales are 16-lane vectors built once per
//! tile block and shared by the rows; a row's float work is one FMA per
//! sub-block plus one per block.
//!
//! Weight codes enter `vpdpbusd` unsigned: Q4_K/Q6_K/Q5_0/Q4_1 codes are
//! already, Q8_0's signed bytes are offset by 128 (`xor 0x80`). The
//! offsets are corrected by starting each integer sum at the offset times
//! the activations' code sums (`off`, [`super::act`]); Q4_K's and Q4_1's
//! mins go through `fsum`.
//!
//! Batch invariance: each (row, column) accumulator runs the same
//! instructions in the same order whatever the group size `R`.
//!
//! Every function here requires the features [`super::Isa::Avx512Vnni`]
//! detects; callers check them.

use super::act::Acts;
use super::layout::{tile_block_bytes, TILE};
use super::{prefetch, prefetch_step, Format, GROUP};
use std::arch::x86_64::*;

/// Dots one tile (its `a.nb` tile blocks) with activation rows
/// `r0..r0 + rows` (1..=GROUP) into `out[row]`.
///
/// # Safety
/// The CPU must support avx512f, avx512bw, avx512vl, avx512vnni and fma;
/// `tile` holds `a.nb` tile blocks of `format`; `a` holds rows
/// `r0..r0 + rows` quantized for `format`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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

/// 16 f16 values at `p` as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn f16x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
}

/// 16 bytes at `p` (unsigned or signed) as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn u8x16(p: *const u8) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn i8x16(p: *const u8) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())))
}

/// The 4 activation codes at `p` broadcast to every lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn x4(p: *const i8) -> __m512i {
    _mm512_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// A nibble group's low and high codes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> (__m512i, __m512i) {
    let v = _mm512_loadu_si512(p.cast());
    let m4 = _mm512_set1_epi8(0x0F);
    (
        _mm512_and_si512(v, m4),
        _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4),
    )
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn store<const R: usize>(acc: &[__m512; R], out: &mut [[f32; TILE]; GROUP]) {
    for r in 0..R {
        _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k<const R: usize>(tile: &[u8], a: &Acts, r0: usize, out: &mut [[f32; TILE]; GROUP]) {
    let nb = a.nb;
    let tb = tile_block_bytes(Format::Q4K);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let p = tile.as_ptr().add(b * tb);
        let (vd, vm) = (f16x16(p), f16x16(p.add(32)));
        let ab: [usize; R] = std::array::from_fn(|r| (r0 + r) * nb + b);
        let mut blk = [_mm512_setzero_ps(); R];
        for j in 0..8 {
            let sc = _mm512_mul_ps(u8x16(p.add(64 + TILE * j)), vd);
            let mn = _mm512_mul_ps(u8x16(p.add(192 + TILE * j)), vm);
            let mut isum = [_mm512_setzero_si512(); R];
            prefetch_step::<2368, 8>(p, j);
            for g in 4 * j..4 * j + 4 {
                let (lo, hi) = nibbles(p.add(320 + 64 * g));
                for r in 0..R {
                    let x = a.q.as_ptr().add(ab[r] * 256 + 8 * g);
                    isum[r] = _mm512_dpbusd_epi32(isum[r], lo, x4(x));
                    isum[r] = _mm512_dpbusd_epi32(isum[r], hi, x4(x.add(4)));
                }
            }
            for r in 0..R {
                blk[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), sc, blk[r]);
                let s = *a.fsum.get_unchecked(ab[r] * 8 + j);
                blk[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(s), blk[r]);
            }
        }
        for r in 0..R {
            let dx = _mm512_set1_ps(*a.d.get_unchecked(ab[r]));
            acc[r] = _mm512_fmadd_ps(blk[r], dx, acc[r]);
        }
    }
    store::<R>(&acc, out)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k<const R: usize>(tile: &[u8], a: &Acts, r0: usize, out: &mut [[f32; TILE]; GROUP]) {
    let nb = a.nb;
    let tb = tile_block_bytes(Format::Q6K);
    let m30 = _mm512_set1_epi8(0x30);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let p = tile.as_ptr().add(b * tb);
        let vd = f16x16(p);
        let ab: [usize; R] = std::array::from_fn(|r| (r0 + r) * nb + b);
        let mut blk = [_mm512_setzero_ps(); R];
        for s in 0..16 {
            prefetch_step::<3360, 16>(p, s);
            let sc = _mm512_mul_ps(i8x16(p.add(32 + TILE * s)), vd);
            let (l0, h0) = nibbles(p.add(288 + 128 * s));
            let (l1, h1) = nibbles(p.add(288 + 128 * s + 64));
            let qh = _mm512_loadu_si512(p.add(288 + 2048 + 64 * s).cast());
            // Bits 2i..2i+2 of each high byte move to bits 4..6 of code i.
            let w = [
                _mm512_or_si512(l0, _mm512_and_si512(_mm512_slli_epi16::<4>(qh), m30)),
                _mm512_or_si512(h0, _mm512_and_si512(_mm512_slli_epi16::<2>(qh), m30)),
                _mm512_or_si512(l1, _mm512_and_si512(qh, m30)),
                _mm512_or_si512(h1, _mm512_and_si512(_mm512_srli_epi16::<2>(qh), m30)),
            ];
            for r in 0..R {
                let x = a.q.as_ptr().add(ab[r] * 256 + 16 * s);
                let mut isum = _mm512_set1_epi32(*a.off.get_unchecked(ab[r] * 16 + s));
                for (i, wi) in w.iter().enumerate() {
                    isum = _mm512_dpbusd_epi32(isum, *wi, x4(x.add(4 * i)));
                }
                blk[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, blk[r]);
            }
        }
        for r in 0..R {
            let dx = _mm512_set1_ps(*a.d.get_unchecked(ab[r]));
            acc[r] = _mm512_fmadd_ps(blk[r], dx, acc[r]);
        }
    }
    store::<R>(&acc, out)
}

/// The 32-input formats: `codes(p)` gives a tile block's 4 groups of
/// (low, high) unsigned codes, or 8 single groups for Q8_0.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q32<const R: usize>(
    format: Format,
    tile: &[u8],
    a: &Acts,
    r0: usize,
    out: &mut [[f32; TILE]; GROUP],
) {
    let nb = a.nb;
    let tb = tile_block_bytes(format);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let p = tile.as_ptr().add(b * tb);
        for l in 0..tb.div_ceil(64) {
            prefetch(p, 64 * l);
        }
        let vd = f16x16(p);
        let ab: [usize; R] = std::array::from_fn(|r| (r0 + r) * nb + b);
        // 8 vectors of codes, each for 4 consecutive inputs.
        let w: [__m512i; 8] = match format {
            Format::Q8_0 => std::array::from_fn(|g| {
                let v = _mm512_loadu_si512(p.add(32 + 64 * g).cast());
                _mm512_xor_si512(v, _mm512_set1_epi8(-128))
            }),
            Format::Q5_0 => {
                let qh = _mm512_loadu_si512(p.add(32).cast());
                let m10 = _mm512_set1_epi8(0x10);
                // Bit `b` of each high byte moved to bit 4.
                let hb = [
                    _mm512_slli_epi16::<4>(qh),
                    _mm512_slli_epi16::<3>(qh),
                    _mm512_slli_epi16::<2>(qh),
                    _mm512_slli_epi16::<1>(qh),
                    qh,
                    _mm512_srli_epi16::<1>(qh),
                    _mm512_srli_epi16::<2>(qh),
                    _mm512_srli_epi16::<3>(qh),
                ];
                let mut w = [_mm512_setzero_si512(); 8];
                for g in 0..4 {
                    let (lo, hi) = nibbles(p.add(96 + 64 * g));
                    w[2 * g] = _mm512_or_si512(lo, _mm512_and_si512(hb[2 * g], m10));
                    w[2 * g + 1] = _mm512_or_si512(hi, _mm512_and_si512(hb[2 * g + 1], m10));
                }
                w
            }
            _ => {
                let mut w = [_mm512_setzero_si512(); 8];
                for g in 0..4 {
                    (w[2 * g], w[2 * g + 1]) = nibbles(p.add(64 + 64 * g));
                }
                w
            }
        };
        for r in 0..R {
            let x = a.q.as_ptr().add(ab[r] * 32);
            let mut isum = match format {
                Format::Q8_0 => _mm512_set1_epi32(-128 * *a.off.get_unchecked(ab[r])),
                Format::Q5_0 => _mm512_set1_epi32(-16 * *a.off.get_unchecked(ab[r])),
                _ => _mm512_setzero_si512(),
            };
            for (i, wi) in w.iter().enumerate() {
                // Q8_0's groups are 4 consecutive inputs; the nibble
                // formats' pairs are inputs 8g..8g+4 and 8g+4..8g+8.
                isum = _mm512_dpbusd_epi32(isum, *wi, x4(x.add(4 * i)));
            }
            let dx = _mm512_set1_ps(*a.d.get_unchecked(ab[r]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(vd, dx), acc[r]);
            if format == Format::Q4_1 {
                let vm = f16x16(p.add(32));
                acc[r] = _mm512_fmadd_ps(vm, _mm512_set1_ps(*a.fsum.get_unchecked(ab[r])), acc[r]);
            }
        }
    }
    store::<R>(&acc, out)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0<const R: usize>(tile: &[u8], a: &Acts, r0: usize, out: &mut [[f32; TILE]; GROUP]) {
    q32::<R>(Format::Q8_0, tile, a, r0, out)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_0<const R: usize>(tile: &[u8], a: &Acts, r0: usize, out: &mut [[f32; TILE]; GROUP]) {
    q32::<R>(Format::Q5_0, tile, a, r0, out)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1<const R: usize>(tile: &[u8], a: &Acts, r0: usize, out: &mut [[f32; TILE]; GROUP]) {
    q32::<R>(Format::Q4_1, tile, a, r0, out)
}
