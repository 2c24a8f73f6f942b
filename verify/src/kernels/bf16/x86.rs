//! The x86 kernels of [`super::Bf16Matrix`]: `vdpbf16ps` (AVX-512 BF16)
//! and widening loads with FMA (AVX-512F, AVX2), each over a block of up
//! to [`BLOCK`] weight rows and a group of activation rows.
//!
//! Shapes: a kernel keeps `C` columns x `R` rows of lane sums in
//! registers. One row gets 4 (AVX-512) or 2 (AVX2) columns at once so
//! enough independent sums are in flight to hide the FMA latency; more
//! rows get one column each, and every weight chunk loaded serves all `R`
//! rows. The shape never changes a (column, row) sum's instructions.
//!
//! Widening: a 32-bit lane of a bf16 chunk holds values `2j` (low half)
//! and `2j + 1` (high half); masking the low half off gives the odd value
//! as f32, shifting left by 16 the even one, with no shuffle.
//!
//! Every function here requires the CPU features its `target_feature`
//! names; callers check them ([`super::Path::available`]).

// The loops index several register arrays of const-generic length at
// once (weights by column, sums by row and column); the compiler unrolls
// them, and iterator chains over them would hide that pairing.
#![allow(clippy::needless_range_loop)]

use super::common::{Cols, Res};
use std::arch::x86_64::*;

/// Calls `f::<C, R>(args..)` for the runtime shape `(c, r)`.
macro_rules! shapes {
    ($f:ident, $c:expr, $r:expr, $($arg:expr),*) => {
        match ($c, $r) {
            (4, 1) => $f::<4, 1>($($arg),*),
            (2, 1) => $f::<2, 1>($($arg),*),
            (2, 2) => $f::<2, 2>($($arg),*),
            (1, 1) => $f::<1, 1>($($arg),*),
            (1, 2) => $f::<1, 2>($($arg),*),
            (1, 3) => $f::<1, 3>($($arg),*),
            (1, 4) => $f::<1, 4>($($arg),*),
            (1, 5) => $f::<1, 5>($($arg),*),
            (1, 6) => $f::<1, 6>($($arg),*),
            (1, 7) => $f::<1, 7>($($arg),*),
            (1, 8) => $f::<1, 8>($($arg),*),
            (c, r) => unreachable!("no kernel of {c} columns x {r} rows"),
        }
    };
}
pub(in crate::kernels) use shapes;

/// Runs `kernel(c0, cols)` over the block's columns in runs of `per`
/// (fewer for the last ones).
#[inline(always)]
pub(in crate::kernels) fn by_columns(b: &Cols, per: usize, mut kernel: impl FnMut(usize, usize)) {
    let mut c = 0;
    while c < b.n {
        let cc = if b.n - c >= per { per } else { 1 };
        kernel(c, cc);
        c += cc;
    }
}

/// Lane sums `lo` (lanes 0-7) and `hi` (8-15) added in
/// [`super::common::hsum16`]'s order.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(in crate::kernels) fn hsum256x2(lo: __m256, hi: __m256) -> f32 {
    let s8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
}

/// 16 lane sums added in [`super::common::hsum16`]'s order.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(in crate::kernels) fn hsum512(v: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    hsum256x2(_mm512_castps512_ps256(v), hi)
}

/// Columns per kernel call for a group of `rows` rows (AVX-512).
fn per512(rows: usize) -> usize {
    match rows {
        1 => 4,
        2 => 2,
        _ => 1,
    }
}

/// The block dotted with `rows` (1..=8) bf16 activation rows of `lines`
/// lines each at `x`, by `vdpbf16ps`.
///
/// # Safety
/// The CPU has avx512f, avx512bf16, avx2 and fma; `x` holds `rows` rows
/// of `lines >= b.chunks` 64-byte aligned lines.
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
pub(super) unsafe fn dp_block(b: &Cols, x: *const u16, lines: usize, rows: usize, res: &mut Res) {
    by_columns(b, per512(rows), |c0, cc| {
        // SAFETY: the caller's promises, passed on.
        unsafe { shapes!(dp, cc, rows, b, c0, x, lines, res) }
    })
}

#[inline]
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
unsafe fn dp<const C: usize, const R: usize>(
    b: &Cols,
    c0: usize,
    x: *const u16,
    lines: usize,
    res: &mut Res,
) {
    let mut acc = [[_mm512_setzero_ps(); R]; C];
    for i in 0..b.chunks {
        let mut w = [_mm512_setzero_si512(); C];
        for c in 0..C {
            // SAFETY: a chunk is 64 readable bytes.
            w[c] = unsafe { _mm512_loadu_si512(b.chunk_ptr(c0 + c, i).cast()) };
        }
        for r in 0..R {
            // SAFETY: line `i < lines` of row `r < rows`, 64-byte aligned.
            let xv = unsafe { _mm512_load_si512(x.add((r * lines + i) * 32).cast()) };
            for c in 0..C {
                // SAFETY: same size; every bit pattern is a valid __m512bh.
                let (wc, xc) = unsafe {
                    (
                        std::mem::transmute::<__m512i, __m512bh>(w[c]),
                        std::mem::transmute::<__m512i, __m512bh>(xv),
                    )
                };
                acc[c][r] = _mm512_dpbf16_ps(acc[c][r], wc, xc);
            }
        }
    }
    for c in 0..C {
        for r in 0..R {
            res[c0 + c][r] = hsum512(acc[c][r]);
        }
    }
}

/// The block dotted with `rows` (1..=8) widening-layout activation rows
/// (odd values' line, then even values' line, per chunk) by AVX-512F.
///
/// # Safety
/// The CPU has avx512f, avx2 and fma; `x` holds `rows` rows of `lines >=
/// 2 * b.chunks` 64-byte aligned lines.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn wide512_block(
    b: &Cols,
    x: *const f32,
    lines: usize,
    rows: usize,
    res: &mut Res,
) {
    by_columns(b, per512(rows), |c0, cc| {
        // SAFETY: the caller's promises, passed on.
        unsafe { shapes!(wide512, cc, rows, b, c0, x, lines, res) }
    })
}

#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn wide512<const C: usize, const R: usize>(
    b: &Cols,
    c0: usize,
    x: *const f32,
    lines: usize,
    res: &mut Res,
) {
    let mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let mut acc = [[_mm512_setzero_ps(); R]; C];
    for i in 0..b.chunks {
        let mut wo = [_mm512_setzero_ps(); C];
        let mut we = [_mm512_setzero_ps(); C];
        for c in 0..C {
            // SAFETY: a chunk is 64 readable bytes.
            let v = unsafe { _mm512_loadu_si512(b.chunk_ptr(c0 + c, i).cast()) };
            wo[c] = _mm512_castsi512_ps(_mm512_and_si512(v, mask));
            we[c] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
        }
        for r in 0..R {
            // SAFETY: lines `2i, 2i + 1 < lines` of row `r < rows`, aligned.
            let (xo, xe) = unsafe {
                let p = x.add((r * lines + 2 * i) * 16);
                (_mm512_load_ps(p), _mm512_load_ps(p.add(16)))
            };
            for c in 0..C {
                acc[c][r] = _mm512_fmadd_ps(wo[c], xo, acc[c][r]);
                acc[c][r] = _mm512_fmadd_ps(we[c], xe, acc[c][r]);
            }
        }
    }
    for c in 0..C {
        for r in 0..R {
            res[c0 + c][r] = hsum512(acc[c][r]);
        }
    }
}

/// The block dotted with `rows` (1..=4) widening-layout activation rows
/// by AVX2 (a 16-lane sum is two registers).
///
/// # Safety
/// The CPU has avx2 and fma; `x` as for [`wide512_block`].
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn wide256_block(
    b: &Cols,
    x: *const f32,
    lines: usize,
    rows: usize,
    res: &mut Res,
) {
    let per = if rows <= 2 { 2 } else { 1 };
    by_columns(b, per, |c0, cc| {
        // SAFETY: the caller's promises, passed on.
        unsafe { shapes!(wide256, cc, rows, b, c0, x, lines, res) }
    })
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn wide256<const C: usize, const R: usize>(
    b: &Cols,
    c0: usize,
    x: *const f32,
    lines: usize,
    res: &mut Res,
) {
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let mut acc = [[[_mm256_setzero_ps(); 2]; R]; C];
    for i in 0..b.chunks {
        let mut wp = [std::ptr::null::<u8>(); C];
        for c in 0..C {
            wp[c] = b.chunk_ptr(c0 + c, i);
        }
        for h in 0..2 {
            let mut wo = [_mm256_setzero_ps(); C];
            let mut we = [_mm256_setzero_ps(); C];
            for c in 0..C {
                // SAFETY: half `h` of a 64-byte chunk.
                let v = unsafe { _mm256_loadu_si256(wp[c].add(32 * h).cast()) };
                wo[c] = _mm256_castsi256_ps(_mm256_and_si256(v, mask));
                we[c] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
            }
            for r in 0..R {
                // SAFETY: lanes `8h..8h + 8` of lines `2i, 2i + 1` of row
                // `r < rows`.
                let (xo, xe) = unsafe {
                    let p = x.add((r * lines + 2 * i) * 16 + 8 * h);
                    (_mm256_load_ps(p), _mm256_load_ps(p.add(16)))
                };
                for c in 0..C {
                    acc[c][r][h] = _mm256_fmadd_ps(wo[c], xo, acc[c][r][h]);
                    acc[c][r][h] = _mm256_fmadd_ps(we[c], xe, acc[c][r][h]);
                }
            }
        }
    }
    for c in 0..C {
        for r in 0..R {
            res[c0 + c][r] = hsum256x2(acc[c][r][0], acc[c][r][1]);
        }
    }
}
