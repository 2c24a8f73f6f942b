//! The AVX2 (+ FMA) kernel: a slab as two halves of 8 weight rows, one
//! ymm lane per row.
//!
//! Per block, the 16 code bytes of the half's 8 rows are loaded two rows
//! per ymm and transposed with in-lane unpacks (4-byte groups), so that
//! vector `g` holds bytes `4g..4g + 4` of every row: their low nibbles are
//! elements `4g..4g + 4`, the high ones `16 + 4g..`. A 16-entry shuffle
//! (`vpshufb`) turns nibbles into biased codes (doubled E2M1 + 12, so
//! unsigned, see [`super::BIAS`]). Each activation row then takes 8
//! `vpmaddubsw` with 4 broadcast codes each: a pair is at most
//! 2 * 24 * 127 = 6096, so four add up in i16 (24384) before one
//! `vpmaddwd` widens them; the integer sum starts at the row's `corr`,
//! which removes the bias exactly. Float work per row and block: one
//! convert, one multiply (the scale), one FMA, as [`super::scalar`] does.
//!
//! Every function here requires the features [`super::Isa::Avx2`]
//! detects; callers check them.

use super::{
    gather_scales, prefetch_rows, Q8Acts, BLOCK_BYTES, CHUNK, GROUP, KVALUES_BIASED, SLAB,
};
use std::arch::x86_64::*;

/// Weight rows per half slab (one ymm of i32 or f32 lanes).
const HALF: usize = 8;

/// See [`super::scalar::slab`]: the same numbers.
///
/// # Safety
/// The CPU must support avx2 and fma; every row of `p` holds `a.nb()`
/// blocks; `r0 + rows <= a.rows()` and `rows` is 1..=GROUP.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn slab(
    p: &[&[u8]; SLAB],
    a: &Q8Acts,
    r0: usize,
    rows: usize,
    out: &mut [[f32; SLAB]; GROUP],
) {
    debug_assert!(rows <= GROUP && r0 + rows <= a.rows);
    for h in 0..SLAB / HALF {
        let ptrs: [*const u8; HALF] = std::array::from_fn(|i| p[HALF * h + i].as_ptr());
        by_rows!(half, rows, &ptrs, a, r0, h, out);
    }
}

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

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half<const R: usize>(
    p: &[*const u8; HALF],
    a: &Q8Acts,
    r0: usize,
    h: usize,
    out: &mut [[f32; SLAB]; GROUP],
) {
    let nb = a.nb();
    let table = _mm256_broadcastsi128_si256(load16(KVALUES_BIASED.as_ptr()));
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut sc = [[0f32; HALF]; CHUNK];
    for c0 in (0..nb).step_by(CHUNK) {
        let n = CHUNK.min(nb - c0);
        gather_scales::<HALF>(p, c0, n, &mut sc);
        for (k, sck) in sc[..n].iter().enumerate() {
            let b = c0 + k;
            if k % 3 == 0 {
                prefetch_rows(p, b);
            }
            let off = b * BLOCK_BYTES + 1;
            // Lane l of x[k] holds row k + 4l's 16 code bytes.
            let x: [__m256i; 4] = std::array::from_fn(|k| {
                let lo = _mm256_castsi128_si256(load16(p[k].add(off)));
                _mm256_inserti128_si256::<1>(lo, load16(p[k + 4].add(off)))
            });
            let l01 = _mm256_unpacklo_epi32(x[0], x[1]);
            let h01 = _mm256_unpackhi_epi32(x[0], x[1]);
            let l23 = _mm256_unpacklo_epi32(x[2], x[3]);
            let h23 = _mm256_unpackhi_epi32(x[2], x[3]);
            // Dword i of t[g]: bytes 4g..4g + 4 of row i.
            let t = [
                _mm256_unpacklo_epi64(l01, l23),
                _mm256_unpackhi_epi64(l01, l23),
                _mm256_unpacklo_epi64(h01, h23),
                _mm256_unpackhi_epi64(h01, h23),
            ];
            let lo: [__m256i; 4] =
                std::array::from_fn(|g| _mm256_shuffle_epi8(table, _mm256_and_si256(t[g], m4)));
            let hi: [__m256i; 4] = std::array::from_fn(|g| {
                let v = _mm256_and_si256(_mm256_srli_epi16::<4>(t[g]), m4);
                _mm256_shuffle_epi8(table, v)
            });
            let sv = _mm256_loadu_ps(sck.as_ptr());
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
    for r in 0..R {
        _mm256_storeu_ps(out[r].as_mut_ptr().add(HALF * h), acc[r]);
    }
}

/// One activation row (`r0`) against each weight row of `p` in turn, each
/// weight row read front to back: a single sequential stream, which the
/// hardware prefetcher follows, where [`slab`]'s 8 interleaved row streams
/// (short ones for a 3072-wide expert `down`: 1.6 KB a row) left it behind
/// (measured 9 GB/s against 16.5). Same numbers as [`super::scalar::slab`]:
/// each block's exact integer dot, then the FMA chain over the blocks in
/// order. A version for 2-4 activation rows measured a tie with [`slab`]
/// at two rows and slower from three (each row reduces each block to a
/// scalar), so [`slab`] keeps every call of more than one row.
///
/// # Safety
/// As [`slab`], with `rows == 1`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn slab_one_row(
    p: &[&[u8]; SLAB],
    a: &Q8Acts,
    r0: usize,
    out: &mut [[f32; SLAB]; GROUP],
) {
    debug_assert!(r0 < a.rows);
    let nb = a.nb();
    let table = _mm256_broadcastsi128_si256(load16(KVALUES_BIASED.as_ptr()));
    let m4 = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let xq = a.q.as_ptr().add(r0 * nb * 32);
    let corr = a.corr.as_ptr().add(r0 * nb);
    let d = a.d.as_ptr().add(r0 * nb);
    // Block `b` of `row` dotted with the activations: 8 i32 partial sums.
    let dot = |row: *const u8, b: usize| {
        let v = load16(row.add(b * BLOCK_BYTES + 1));
        let lo = _mm_and_si128(v, m4);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
        let w = _mm256_shuffle_epi8(table, _mm256_set_m128i(hi, lo));
        let x = _mm256_loadu_si256(xq.add(b * 32).cast());
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones)
    };
    for (i, row) in p.iter().enumerate() {
        let row = row.as_ptr();
        let mut y = 0f32;
        let mut b = 0;
        while b + 8 <= nb {
            crate::kernels::prefetch_l2(row, (b + 16) * BLOCK_BYTES);
            let v: [__m256i; 8] = std::array::from_fn(|k| dot(row, b + k));
            // Lane k of `s`: the whole sum of block b + k.
            let h = [
                _mm256_hadd_epi32(v[0], v[1]),
                _mm256_hadd_epi32(v[2], v[3]),
                _mm256_hadd_epi32(v[4], v[5]),
                _mm256_hadd_epi32(v[6], v[7]),
            ];
            let (h0, h1) = (_mm256_hadd_epi32(h[0], h[1]), _mm256_hadd_epi32(h[2], h[3]));
            let s = _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(h0, h1),
                _mm256_permute2x128_si256::<0x31>(h0, h1),
            );
            let s = _mm256_add_epi32(s, _mm256_loadu_si256(corr.add(b).cast()));
            let mut ints = [0f32; 8];
            _mm256_storeu_ps(ints.as_mut_ptr(), _mm256_cvtepi32_ps(s));
            for (k, iv) in ints.into_iter().enumerate() {
                let ws = super::E8M0_HALF[*row.add((b + k) * BLOCK_BYTES) as usize];
                y = iv.mul_add(ws * *d.add(b + k), y);
            }
            b += 8;
        }
        for b in b..nb {
            let v = dot(row, b);
            let q = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
            let q = _mm_add_epi32(q, _mm_unpackhi_epi64(q, q));
            let q = _mm_add_epi32(q, _mm_shuffle_epi32::<0b01>(q));
            let iv = (_mm_cvtsi128_si32(q) + *corr.add(b)) as f32;
            y = iv.mul_add(
                super::E8M0_HALF[*row.add(b * BLOCK_BYTES) as usize] * *d.add(b),
                y,
            );
        }
        out[0][i] = y;
    }
}
