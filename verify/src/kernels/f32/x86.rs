//! The x86 kernels of [`super::F32Matrix`]: FMA over a block of up to
//! [`super::BLOCK`] weight rows and a group of activation rows, AVX-512F
//! and AVX2, in the shapes [`crate::kernels::bf16`]'s kernels use (one
//! row: several columns at once to hide the FMA latency; more rows: one
//! column, each weight chunk loaded once for all of them).
//!
//! Every function here requires the CPU features its `target_feature`
//! names; callers check them.

// The loops index several register arrays of const-generic length at
// once (weights by column, sums by row and column); the compiler unrolls
// them, and iterator chains over them would hide that pairing.
#![allow(clippy::needless_range_loop)]

use crate::kernels::bf16::common::{Cols, Res};
use crate::kernels::bf16::x86::{by_columns, hsum256x2, hsum512, shapes};
use std::arch::x86_64::*;

/// The block dotted with `rows` (1..=8) activation rows of `lines`
/// 64-byte aligned lines each at `x`, by AVX-512F.
///
/// # Safety
/// The CPU has avx512f, avx2 and fma; `x` holds `rows` rows of `lines >=
/// b.chunks` lines.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn f512_block(b: &Cols, x: *const f32, lines: usize, rows: usize, res: &mut Res) {
    let per = match rows {
        1 => 4,
        2 => 2,
        _ => 1,
    };
    by_columns(b, per, |c0, cc| {
        // SAFETY: the caller's promises, passed on.
        unsafe { shapes!(f512, cc, rows, b, c0, x, lines, res) }
    })
}

#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn f512<const C: usize, const R: usize>(
    b: &Cols,
    c0: usize,
    x: *const f32,
    lines: usize,
    res: &mut Res,
) {
    let mut acc = [[_mm512_setzero_ps(); R]; C];
    for i in 0..b.chunks {
        let mut w = [_mm512_setzero_ps(); C];
        for c in 0..C {
            // SAFETY: a chunk is 64 readable bytes.
            w[c] = unsafe { _mm512_loadu_ps(b.chunk_ptr(c0 + c, i).cast()) };
        }
        for r in 0..R {
            // SAFETY: line `i < lines` of row `r < rows`, aligned.
            let xv = unsafe { _mm512_load_ps(x.add((r * lines + i) * 16)) };
            for c in 0..C {
                acc[c][r] = _mm512_fmadd_ps(w[c], xv, acc[c][r]);
            }
        }
    }
    for c in 0..C {
        for r in 0..R {
            res[c0 + c][r] = hsum512(acc[c][r]);
        }
    }
}

/// The block dotted with `rows` (1..=4) activation rows by AVX2 (a
/// 16-lane sum is two registers).
///
/// # Safety
/// The CPU has avx2 and fma; `x` as for [`f512_block`].
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn f256_block(b: &Cols, x: *const f32, lines: usize, rows: usize, res: &mut Res) {
    let per = if rows <= 2 { 2 } else { 1 };
    by_columns(b, per, |c0, cc| {
        // SAFETY: the caller's promises, passed on.
        unsafe { shapes!(f256, cc, rows, b, c0, x, lines, res) }
    })
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn f256<const C: usize, const R: usize>(
    b: &Cols,
    c0: usize,
    x: *const f32,
    lines: usize,
    res: &mut Res,
) {
    let mut acc = [[[_mm256_setzero_ps(); 2]; R]; C];
    for i in 0..b.chunks {
        let mut wp = [std::ptr::null::<u8>(); C];
        for c in 0..C {
            wp[c] = b.chunk_ptr(c0 + c, i);
        }
        for h in 0..2 {
            let mut w = [_mm256_setzero_ps(); C];
            for c in 0..C {
                // SAFETY: half `h` of a 64-byte chunk.
                w[c] = unsafe { _mm256_loadu_ps(wp[c].add(32 * h).cast()) };
            }
            for r in 0..R {
                // SAFETY: lanes `8h..8h + 8` of line `i` of row `r`.
                let xv = unsafe { _mm256_load_ps(x.add((r * lines + i) * 16 + 8 * h)) };
                for c in 0..C {
                    acc[c][r][h] = _mm256_fmadd_ps(w[c], xv, acc[c][r][h]);
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
