//! How a latent cache's rows are stored ([`CacheDtype`]) and read in
//! place ([`LatentRow`]): f32 as computed, or bf16 rounded once when
//! written and widened exactly when read.

use crate::kernels::vector::{axpy, dot};
use half::bf16;

/// How a latent cache stores its values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CacheDtype {
    /// 4 bytes a value, exactly as computed.
    #[default]
    F32,
    /// 2 bytes a value, rounded to nearest-even when written.
    Bf16,
}

impl CacheDtype {
    /// Bytes one value takes.
    pub fn bytes(self) -> usize {
        match self {
            CacheDtype::F32 => 4,
            CacheDtype::Bf16 => 2,
        }
    }

    /// The name configs use: `f32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            CacheDtype::F32 => "f32",
            CacheDtype::Bf16 => "bf16",
        }
    }
}

/// A cached latent row as stored (see [`CacheDtype`]).
#[derive(Clone, Copy)]
pub(crate) enum LatentRow<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

/// A bf16 value widened to f32 (exact): its bits are f32's top half.
#[inline(always)]
fn widen(v: bf16) -> f32 {
    f32::from_bits((v.to_bits() as u32) << 16)
}

/// Lanes of the bf16 dot: independent partial sums, so the compiler can
/// keep them in vector registers (the order is fixed, whoever calls).
const LANES: usize = 16;

impl LatentRow<'_> {
    /// Value `i` of the row, widened to f32 (exact).
    pub(crate) fn get(&self, i: usize) -> f32 {
        match self {
            LatentRow::F32(r) => r[i],
            LatentRow::Bf16(r) => widen(r[i]),
        }
    }

    /// `sum(x[i] * row[at + i])` over `x`: the row's values from `at` on.
    pub(crate) fn dot_from(&self, at: usize, x: &[f32]) -> f32 {
        match self {
            LatentRow::F32(r) => dot(x, &r[at..at + x.len()]),
            LatentRow::Bf16(r) => {
                let r = &r[at..at + x.len()];
                let mut acc = [0f32; LANES];
                let (xc, rc) = (x.chunks_exact(LANES), r.chunks_exact(LANES));
                let (xt, rt) = (xc.remainder(), rc.remainder());
                for (a, b) in xc.zip(rc) {
                    for i in 0..LANES {
                        acc[i] += a[i] * widen(b[i]);
                    }
                }
                for (i, (a, &b)) in xt.iter().zip(rt).enumerate() {
                    acc[i] += a * widen(b);
                }
                acc.iter().sum()
            }
        }
    }

    /// `out[i] += a * row[i]` over `out` (the row's first values).
    pub(crate) fn axpy_into(&self, a: f32, out: &mut [f32]) {
        let n = out.len();
        match self {
            LatentRow::F32(r) => axpy(a, &r[..n], out),
            LatentRow::Bf16(r) => {
                for (o, &v) in out.iter_mut().zip(&r[..n]) {
                    *o += a * widen(v);
                }
            }
        }
    }
}
