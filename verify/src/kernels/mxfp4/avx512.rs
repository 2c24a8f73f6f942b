//! The AVX-512 (F, BW) + VNNI kernel: a slab of 16 weight rows, one zmm
//! lane per row.
//!
//! Per block, the 16 code bytes of the 16 rows are loaded four rows per
//! zmm and transposed with in-lane unpacks (4-byte groups), so that
//! vector `g` holds bytes `4g..4g + 4` of every row: their low nibbles are
//! elements `4g..4g + 4`, the high ones `16 + 4g..`. A 16-entry shuffle
//! (`vpshufb`) turns nibbles into biased codes (doubled E2M1 + 12, so
//! unsigned, as `vpdpbusd` wants its first operand, see [`super::BIAS`]).
//! Each activation row then takes 8 `vpdpbusd` with 4 broadcast codes each,
//! starting from the row's `corr`, which removes the bias exactly. Float
//! work per row and block: one convert, one multiply (the scale), one FMA,
//! as [`super::scalar`] does.
//!
//! Every function here requires the features [`super::Isa::Avx512Vnni`]
//! detects; callers check them.

use super::{
    gather_scales, prefetch_rows, Q8Acts, BLOCK_BYTES, CHUNK, GROUP, KVALUES_BIASED, SLAB,
};
use std::arch::x86_64::*;

/// See [`super::scalar::slab`]: the same numbers.
///
/// # Safety
/// The CPU must support avx512f, avx512bw, avx512vl, avx512vnni and fma;
/// every row of `p` holds `a.nb()` blocks; `r0 + rows <= a.rows()` and
/// `rows` is 1..=GROUP.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn slab(
    p: &[&[u8]; SLAB],
    a: &Q8Acts,
    r0: usize,
    rows: usize,
    out: &mut [[f32; SLAB]; GROUP],
) {
    debug_assert!(rows <= GROUP && r0 + rows <= a.rows);
    let ptrs: [*const u8; SLAB] = std::array::from_fn(|i| p[i].as_ptr());
    by_rows!(kernel, rows, &ptrs, a, r0, out)
}

/// 16 bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn load16(p: *const u8) -> __m128i {
    _mm_loadu_si128(p.cast())
}

/// The 4 activation codes at `p` broadcast to every lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn x4(p: *const i8) -> __m512i {
    _mm512_set1_epi32(p.cast::<i32>().read_unaligned())
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn kernel<const R: usize>(
    p: &[*const u8; SLAB],
    a: &Q8Acts,
    r0: usize,
    out: &mut [[f32; SLAB]; GROUP],
) {
    let nb = a.nb();
    let table = _mm512_broadcast_i32x4(load16(KVALUES_BIASED.as_ptr()));
    let m4 = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); R];
    let mut sc = [[0f32; SLAB]; CHUNK];
    for c0 in (0..nb).step_by(CHUNK) {
        let n = CHUNK.min(nb - c0);
        gather_scales::<SLAB>(p, c0, n, &mut sc);
        for (k, sck) in sc[..n].iter().enumerate() {
            let b = c0 + k;
            if k % 3 == 0 {
                prefetch_rows(p, b);
            }
            let off = b * BLOCK_BYTES + 1;
            // Lane l of x[k] holds row k + 4l's 16 code bytes.
            let x: [__m512i; 4] = std::array::from_fn(|k| {
                let v = _mm512_castsi128_si512(load16(p[k].add(off)));
                let v = _mm512_inserti32x4::<1>(v, load16(p[k + 4].add(off)));
                let v = _mm512_inserti32x4::<2>(v, load16(p[k + 8].add(off)));
                _mm512_inserti32x4::<3>(v, load16(p[k + 12].add(off)))
            });
            let l01 = _mm512_unpacklo_epi32(x[0], x[1]);
            let h01 = _mm512_unpackhi_epi32(x[0], x[1]);
            let l23 = _mm512_unpacklo_epi32(x[2], x[3]);
            let h23 = _mm512_unpackhi_epi32(x[2], x[3]);
            // Dword i of t[g]: bytes 4g..4g + 4 of row i.
            let t = [
                _mm512_unpacklo_epi64(l01, l23),
                _mm512_unpackhi_epi64(l01, l23),
                _mm512_unpacklo_epi64(h01, h23),
                _mm512_unpackhi_epi64(h01, h23),
            ];
            let lo: [__m512i; 4] =
                std::array::from_fn(|g| _mm512_shuffle_epi8(table, _mm512_and_si512(t[g], m4)));
            let hi: [__m512i; 4] = std::array::from_fn(|g| {
                let v = _mm512_and_si512(_mm512_srli_epi16::<4>(t[g]), m4);
                _mm512_shuffle_epi8(table, v)
            });
            let sv = _mm512_loadu_ps(sck.as_ptr());
            for (r, acc) in acc.iter_mut().enumerate() {
                let ab = (r0 + r) * nb + b;
                let xq = a.q.as_ptr().add(ab * 32);
                let mut isum = _mm512_set1_epi32(*a.corr.get_unchecked(ab));
                for g in 0..4 {
                    isum = _mm512_dpbusd_epi32(isum, lo[g], x4(xq.add(4 * g)));
                    isum = _mm512_dpbusd_epi32(isum, hi[g], x4(xq.add(16 + 4 * g)));
                }
                let s = _mm512_mul_ps(sv, _mm512_set1_ps(*a.d.get_unchecked(ab)));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, *acc);
            }
        }
    }
    for r in 0..R {
        _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
    }
}
