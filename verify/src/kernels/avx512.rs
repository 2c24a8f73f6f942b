//! AVX-512 (F, BW, VL) + VNNI kernels. Each weight block is loaded and
//! unpacked to unsigned bytes once, then dotted with every activation row
//! of the group while it sits in registers:
//! - K-quants: `vpmaddubsw` (u8 weight x i8 activation -> i16 pairs), then
//!   `vpdpwssd` multiplies by the sub-block scales and accumulates in i32;
//!   one float FMA per 256 weights per row. Mins (Q4_K) and the -32 offset
//!   (Q6_K) go through the activations' 16-value sums.
//! - 32-value formats: `vpdpbusd` (u8 x i8 -> i32) over two blocks per
//!   512-bit register; signed Q8_0 weights are offset by 128 (`xor 0x80`)
//!   and Q5_0's by 16, corrected with the activations' block sums.
//!
//! Every function here requires the features [`super::Isa::Avx512Vnni`]
//! detects; callers check them.

use super::act::Acts;
use super::{f16_at, q4k_scales, Format, MAX_ROWS};
use std::arch::x86_64::*;

/// # Safety
/// The CPU must support avx512f, avx512bw, avx512vl, avx512vnni and fma;
/// `w` holds whole blocks of `format` for `a.nb` blocks and `a` holds rows
/// `r0..r0 + rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(super) unsafe fn dot_rows(
    format: Format,
    w: &[u8],
    a: &Acts,
    r0: usize,
    rows: usize,
    out: &mut [f32; MAX_ROWS],
) {
    debug_assert!(w.len() >= a.nb * format.block_bytes() * a.block / format.block_len());
    debug_assert!(a.d.len() >= (r0 + rows) * a.nb);
    match format {
        Format::Q4K => q4k(w, a, r0, rows, out),
        Format::Q6K => q6k(w, a, r0, rows, out),
        Format::Q8_0 | Format::Q5_0 | Format::Q4_1 => q32(format, w, a, r0, rows, out),
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn hsum256(v: __m256) -> f32 {
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_add_ss(h, _mm_movehdup_ps(h));
    _mm_cvtss_f32(h)
}

/// Two 256-bit halves as one 512-bit register.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// i16 lane indices spreading 4 consecutive scales (from `first`) over 8
/// lanes each; `spread2` does 2 scales over 16 lanes each.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn spread_idx(first: i16, lanes_per: i16) -> __m512i {
    let mut idx = [0i16; 32];
    for (l, v) in idx.iter_mut().enumerate() {
        *v = first + l as i16 / lanes_per;
    }
    // SAFETY: 64 bytes read from a 64-byte array.
    unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn q4k(w: &[u8], a: &Acts, r0: usize, rows: usize, out: &mut [f32; MAX_ROWS]) {
    let nb = a.nb;
    let mut acc = [_mm512_setzero_ps(); MAX_ROWS];
    let mut accm = [_mm256_setzero_ps(); MAX_ROWS];
    let m4 = _mm256_set1_epi8(0x0F);
    let idx: [__m512i; 4] = std::array::from_fn(|j| spread_idx(2 * j as i16, 16));
    for (b, bl) in w.chunks_exact(144).take(nb).enumerate() {
        let d = f16_at(bl, 0);
        let dmin = f16_at(bl, 2);
        let (sc, mn) = q4k_scales(&bl[4..16]);
        let sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(sc.as_ptr().cast())));
        let m8 = _mm_loadl_epi64(mn.as_ptr().cast());
        // Each min applies to two 16-value activation sums.
        let mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        let mut wv = [_mm512_setzero_si512(); 4];
        let mut sv = [_mm512_setzero_si512(); 4];
        for j in 0..4 {
            let v = _mm256_loadu_si256(bl.as_ptr().add(16 + 32 * j).cast());
            let lo = _mm256_and_si256(v, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
            wv[j] = join(lo, hi);
            sv[j] = _mm512_permutexvar_epi16(idx[j], sc16);
        }
        for i in 0..rows {
            let ab = (r0 + i) * nb + b;
            let xp = a.q.as_ptr().add(ab * 256);
            let mut s = _mm512_setzero_si512();
            for j in 0..4 {
                let x = _mm512_loadu_si512(xp.add(64 * j).cast());
                s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wv[j], x), sv[j]);
            }
            let dx = *a.d.get_unchecked(ab);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(d * dx), acc[i]);
            let bs = _mm256_loadu_si256(a.bsums.as_ptr().add(ab * 16).cast());
            let m = _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bs));
            accm[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(dmin * dx), accm[i]);
        }
    }
    for i in 0..rows {
        out[i] = _mm512_reduce_add_ps(acc[i]) - hsum256(accm[i]);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn q6k(w: &[u8], a: &Acts, r0: usize, rows: usize, out: &mut [f32; MAX_ROWS]) {
    let nb = a.nb;
    let mut acc = [_mm512_setzero_ps(); MAX_ROWS];
    let mut accm = [_mm256_setzero_ps(); MAX_ROWS];
    let m4 = _mm512_set1_epi8(0x0F);
    let m3 = _mm512_set1_epi8(3);
    let idx: [__m512i; 4] = std::array::from_fn(|t| spread_idx(4 * t as i16, 8));
    for (b, bl) in w.chunks_exact(210).take(nb).enumerate() {
        let d = f16_at(bl, 208);
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(bl.as_ptr().add(192).cast()));
        let sc512 = _mm512_castsi256_si512(sc16);
        // wv[t] holds values 64t..64t+64 as unsigned 6-bit numbers.
        let mut wv = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let v = _mm512_loadu_si512(bl.as_ptr().add(64 * h).cast());
            let lo = _mm512_and_si512(v, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            let qh = _mm256_loadu_si256(bl.as_ptr().add(128 + 32 * h).cast());
            let qa = join(qh, _mm256_srli_epi16::<2>(qh));
            let qb = join(_mm256_srli_epi16::<4>(qh), _mm256_srli_epi16::<6>(qh));
            wv[2 * h] = _mm512_or_si512(lo, _mm512_slli_epi16::<4>(_mm512_and_si512(qa, m3)));
            wv[2 * h + 1] = _mm512_or_si512(hi, _mm512_slli_epi16::<4>(_mm512_and_si512(qb, m3)));
        }
        let sv: [__m512i; 4] = std::array::from_fn(|t| _mm512_permutexvar_epi16(idx[t], sc512));
        for i in 0..rows {
            let ab = (r0 + i) * nb + b;
            let xp = a.q.as_ptr().add(ab * 256);
            let mut s = _mm512_setzero_si512();
            for t in 0..4 {
                let x = _mm512_loadu_si512(xp.add(64 * t).cast());
                s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wv[t], x), sv[t]);
            }
            let dx = *a.d.get_unchecked(ab);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(d * dx), acc[i]);
            let bs = _mm256_loadu_si256(a.bsums.as_ptr().add(ab * 16).cast());
            let c = _mm256_cvtepi32_ps(_mm256_madd_epi16(sc16, bs));
            accm[i] = _mm256_fmadd_ps(c, _mm256_set1_ps(32.0 * d * dx), accm[i]);
        }
    }
    for i in 0..rows {
        out[i] = _mm512_reduce_add_ps(acc[i]) - hsum256(accm[i]);
    }
}

/// 16 bytes of nibbles at `p` as 32 bytes: low nibbles, then high ones.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let v = _mm_loadu_si128(p.cast());
    let m4 = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, m4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
    _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi)
}

/// One 32-value block as unsigned bytes, its scale, and the constant that
/// multiplies the activation block's `d * sum(q)` (offset or min).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn unpack32(format: Format, bl: &[u8]) -> (__m256i, f32, f32) {
    let d = f16_at(bl, 0);
    match format {
        Format::Q8_0 => {
            let v = _mm256_loadu_si256(bl.as_ptr().add(2).cast());
            (_mm256_xor_si256(v, _mm256_set1_epi8(-128)), d, -128.0 * d)
        }
        Format::Q5_0 => {
            let qh = u32::from_le_bytes([bl[2], bl[3], bl[4], bl[5]]);
            let high = _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));
            (
                _mm256_or_si256(nibbles(bl.as_ptr().add(6)), high),
                d,
                -16.0 * d,
            )
        }
        _ => (nibbles(bl.as_ptr().add(4)), d, f16_at(bl, 2)),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn q32(
    format: Format,
    w: &[u8],
    a: &Acts,
    r0: usize,
    rows: usize,
    out: &mut [f32; MAX_ROWS],
) {
    let nb = a.nb;
    let bb = format.block_bytes();
    let mut acc = [_mm512_setzero_ps(); MAX_ROWS];
    let mut corr = [0f32; MAX_ROWS];
    let mut b = 0;
    while b < nb {
        // Two blocks per register; an odd last block pairs with zeros.
        let pair = b + 1 < nb;
        let (w0, d0, c0) = unpack32(format, &w[b * bb..(b + 1) * bb]);
        let (w1, d1, c1) = if pair {
            unpack32(format, &w[(b + 1) * bb..(b + 2) * bb])
        } else {
            (_mm256_setzero_si256(), 0.0, 0.0)
        };
        let wv = join(w0, w1);
        let dw = _mm512_castsi512_ps(join(
            _mm256_castps_si256(_mm256_set1_ps(d0)),
            _mm256_castps_si256(_mm256_set1_ps(d1)),
        ));
        for i in 0..rows {
            let ab = (r0 + i) * nb + b;
            let xp = a.q.as_ptr().add(ab * 32);
            let dp = a.d8.as_ptr().add(ab * 8);
            let (x, dx) = if pair {
                (_mm512_loadu_si512(xp.cast()), _mm512_loadu_ps(dp))
            } else {
                (
                    _mm512_zextsi256_si512(_mm256_loadu_si256(xp.cast())),
                    _mm512_zextps256_ps512(_mm256_loadu_ps(dp)),
                )
            };
            let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, x);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc[i]);
            let ds = a.dsum.get_unchecked(ab..);
            corr[i] += c0 * ds[0];
            if pair {
                corr[i] += c1 * ds[1];
            }
        }
        b += 2;
    }
    for i in 0..rows {
        out[i] = _mm512_reduce_add_ps(acc[i]) + corr[i];
    }
}
