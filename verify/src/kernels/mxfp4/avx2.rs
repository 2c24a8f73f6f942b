//! The AVX2 (+ FMA) kernel, over the tiled layout
//! ([`super::Mxfp4Matrix::tiled`]): a slab as two halves of 8 weight rows,
//! one ymm lane per row.
//!
//! A tile block holds, per half, four vectors `g` whose lane `i` is bytes
//! `4g..4g + 4` of row `i`'s 16 code bytes: their low nibbles are
//! elements `4g..4g + 4`, the high ones `16 + 4g..`. A 16-entry shuffle
//! (`vpshufb`) turns nibbles into biased codes (doubled E2M1 + 12, so
//! unsigned, see [`super::BIAS`]). Each activation row then takes 8
//! `vpmaddubsw` with 4 broadcast codes each: a pair is at most
//! 2 * 24 * 127 = 6096, so four add up in i16 (24384) before one
//! `vpmaddwd` widens them; the integer sum starts at the row's `corr`,
//! which removes the bias exactly. Float work per row and block: one
//! convert, one multiply (the scale), one FMA, as [`super::scalar`] does.
//!
//! Measured against the kernels this replaced, which transposed a slab of
//! file-layout rows in registers (unpacks) and read one row at a time for
//! a single activation row (`cargo bench --bench mxfp4_stream`, 3072 x
//! 7168, 2 threads, EPYC): 1 row 16.1 -> 23.0 GB/s, 4 rows 9.4 -> 15.0,
//! 8 rows 6.3 -> 9.6.
//!
//! Every function here requires the features [`super::Isa::Avx2`]
//! detects; callers check them.

use super::{Q8Acts, GROUP, KVALUES_BIASED, SLAB, TILE_BLOCK};
use std::arch::x86_64::*;

/// Weight rows per half slab (one ymm of i32 or f32 lanes).
const HALF: usize = 8;

/// 16 bytes at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load16(p: *const u8) -> __m128i {
    _mm_loadu_si128(p.cast())
}

/// The 4 activation codes at `p` broadcast to every lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x4(p: *const i8) -> __m256i {
    _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// See [`super::scalar::slab`]: the same numbers, from the tiled layout
/// ([`super::Mxfp4Matrix::tiled`]). Each tile block already holds the
/// transposed codes (so a half costs four
/// loads), and the slab is one sequential stream the hardware prefetcher
/// follows. Both halves go in one walk of the tile whatever the number of
/// rows: their accumulators then exceed the 16 registers from 3 rows and
/// some live in L1, which measured faster (4 rows: 15.0 GB/s against
/// 10.8) than walking the tile once per half, the second walk from L2.
///
/// # Safety
/// The CPU must support avx2, fma and f16c; `tile` holds `a.nb()` tile
/// blocks; `r0 + rows <= a.rows()` and `rows` is 1..=GROUP.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile(
    tile: &[u8],
    a: &Q8Acts,
    r0: usize,
    rows: usize,
    out: &mut [[f32; SLAB]; GROUP],
) {
    debug_assert!(rows <= GROUP && r0 + rows <= a.rows);
    debug_assert!(tile.len() >= a.nb() * TILE_BLOCK);
    by_rows!(tile_rows, rows, tile.as_ptr(), a, r0, out);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_rows<const R: usize>(
    p: *const u8,
    a: &Q8Acts,
    r0: usize,
    out: &mut [[f32; SLAB]; GROUP],
) {
    let nb = a.nb();
    let table = _mm256_broadcastsi128_si256(load16(KVALUES_BIASED.as_ptr()));
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let one32 = _mm256_set1_epi32(1);
    let sub_base = _mm256_set1_epi32(0x0020_0000);
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    for b in 0..nb {
        let tb = p.add(b * TILE_BLOCK);
        for (h, acc) in acc.iter_mut().enumerate() {
            // The 8 rows' halved E8M0 scales, built from bits as
            // `E8M0_HALF` is: (e - 1) << 23, and 2^-128 / 2^-127 (the
            // subnormals 0x200000 << e) for e of 0 and 1.
            let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(tb.add(HALF * h).cast()));
            let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, one32));
            let small = _mm256_sllv_epi32(sub_base, e);
            let big = _mm256_cmpgt_epi32(e, one32);
            let sv = _mm256_castsi256_ps(_mm256_blendv_epi8(small, normal, big));
            let v: [__m256i; 4] =
                std::array::from_fn(|g| _mm256_loadu_si256(tb.add(SLAB + 128 * h + 32 * g).cast()));
            let lo: [__m256i; 4] =
                std::array::from_fn(|g| _mm256_shuffle_epi8(table, _mm256_and_si256(v[g], m4)));
            let hi: [__m256i; 4] = std::array::from_fn(|g| {
                let x = _mm256_and_si256(_mm256_srli_epi16::<4>(v[g]), m4);
                _mm256_shuffle_epi8(table, x)
            });
            for (r, acc) in acc.iter_mut().enumerate() {
                let ab = (r0 + r) * nb + b;
                let xq = a.q.as_ptr().add(ab * 32);
                let dot = |w: &[__m256i; 4], x: *const i8| {
                    let s01 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[0], x4(x)),
                        _mm256_maddubs_epi16(w[1], x4(x.add(4))),
                    );
                    let s23 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[2], x4(x.add(8))),
                        _mm256_maddubs_epi16(w[3], x4(x.add(12))),
                    );
                    _mm256_madd_epi16(_mm256_add_epi16(s01, s23), ones)
                };
                let isum = _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_set1_epi32(*a.corr.get_unchecked(ab)), dot(&lo, xq)),
                    dot(&hi, xq.add(16)),
                );
                let s = _mm256_mul_ps(sv, _mm256_set1_ps(*a.d.get_unchecked(ab)));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, *acc);
            }
        }
    }
    for (h, acc) in acc.iter().enumerate() {
        for (r, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(out[r].as_mut_ptr().add(HALF * h), *v);
        }
    }
}
