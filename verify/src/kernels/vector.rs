//! The f32 vector primitives that attention and the element-wise ops run
//! per row: dot products, `y += a * x`, and an `e^x` that vectorizes.
//!
//! Owns: [`F32Ops`], which carries an instruction set known to be present
//! (so its methods are safe to call), with AVX-512 and AVX2 versions of
//! `dot` and `axpy` and a portable one of each.
//!
//! Why written out: the portable dot (32 accumulators) was vectorized by
//! LLVM's SLP pass into sixteen two-lane operations. With these, `perf`
//! still puts attention at ~7% of a batch-1 decode step of the 1.5B model
//! at 128-528 positions (7.7% before): what bounds it now is reading the
//! f32 KV cache, not the arithmetic. `exp` is plain Rust
//! without calls or branches, so the loops that use it vectorize with
//! whatever the build targets; libm's `expf` is a call per element.
//!
//! Invariant (batch invariance): every result depends only on the
//! arguments and the instruction set, never on other rows.

use super::Isa;

/// Vector operations on `f32` slices with one instruction set. Holding
/// one is proof that the CPU supports its set: the only constructors are
/// [`F32Ops::current`] and [`F32Ops::with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct F32Ops {
    isa: Isa,
}

impl F32Ops {
    /// With [`Isa::current`], the kernels' choice (which is always
    /// available on this CPU). Hoist it out of hot loops: it reads a
    /// `OnceLock`.
    pub fn current() -> F32Ops {
        F32Ops {
            isa: Isa::current().vector(),
        }
    }

    /// With `isa`, if this CPU supports it.
    pub fn with(isa: Isa) -> Option<F32Ops> {
        isa.available().then_some(F32Ops { isa: isa.vector() })
    }

    /// `sum_i a[i] * b[i]` over the shorter of the two.
    #[inline]
    pub fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (a, b) = (&a[..n], &b[..n]);
        match self.isa {
            // SAFETY: an `F32Ops` only holds an available instruction set.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => unsafe { x86::dot512(a, b) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::dot256(a, b) },
            _ => dot_portable(a, b),
        }
    }

    /// `y[i] += alpha * x[i]` over the shorter of the two.
    #[inline]
    pub fn axpy(self, alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let (x, y) = (&x[..n], &mut y[..n]);
        match self.isa {
            // SAFETY: an `F32Ops` only holds an available instruction set.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => unsafe { x86::axpy512(alpha, x, y) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::axpy256(alpha, x, y) },
            _ => {
                for (yi, xi) in y.iter_mut().zip(x) {
                    *yi += alpha * xi;
                }
            }
        }
    }
}

/// The portable dot: 16 independent partial sums, so even unvectorized
/// the loop is not one chain of dependent adds.
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    const W: usize = 16;
    let mut acc = [0f32; W];
    let mut ca = a.chunks_exact(W);
    let mut cb = b.chunks_exact(W);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..W {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

/// `sum_i a[i] * b[i]` with [`F32Ops::current`] (callers in hot loops
/// hoist an [`F32Ops`] instead).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    F32Ops::current().dot(a, b)
}

/// `y += a * x` with [`F32Ops::current`].
#[inline]
pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    F32Ops::current().axpy(a, x, y)
}

/// `e^x` within 2 ulp for `x` in [-87.3, 88]; below, the smallest normal
/// float (about 1.2e-38, where e^x is smaller still), above, e^88. A
/// degree-7 polynomial (Cephes' `expf`) on `r = x - n ln 2`, scaled by
/// `2^n` through the exponent bits. No branches or calls, so a loop over
/// a slice vectorizes.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, so that `n * LN2_HI` is exact for |n| < 2^8.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer (ties to even) and leaves
    // that integer in the low bits of the mantissa.
    const SHIFT: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.0);
    let m = x * LOG2E + SHIFT;
    let n = m - SHIFT;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let y = p * r * r + r + 1.0;
    // n + 127 in the exponent field is 2^n (n is in -126..=127 here).
    let n_int = m.to_bits().wrapping_sub(SHIFT.to_bits());
    y * f32::from_bits(n_int.wrapping_add(127) << 23)
}

/// `tanh x` within 2 ulp: Cephes' `tanhf` (an odd polynomial below
/// |x| = 0.625, `1 - 2 / (e^2|x| + 1)` with [`exp`] above), the sign put
/// back after. No branches or calls, so a loop over a slice vectorizes
/// (libm's `tanhf` is a call per element).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = a * a;
    let small =
        ((((-5.704_988_7e-3 * z + 2.063_909e-2) * z - 5.373_971_6e-2) * z + 1.333_144_2e-1) * z
            - 3.333_328e-1)
            * z
            * a
            + a;
    let big = 1.0 - 2.0 / (exp(2.0 * a) + 1.0);
    let t = if a < 0.625 { small } else { big };
    t.copysign(x)
}

/// `1 / (1 + e^-x)` with [`exp`] (within 4 ulp of libm's: `exp`'s 2 and
/// two roundings).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `x / (1 + e^-x)` with [`exp`].
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX-512 F; `a` and `b` of equal length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), s0);
            s1 = _mm512_fmadd_ps(
                _mm512_loadu_ps(pa.add(i + 16)),
                _mm512_loadu_ps(pb.add(i + 16)),
                s1,
            );
            i += 32;
        }
        if i + 16 <= n {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), s0);
            i += 16;
        }
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `a` and `b` of equal length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot256(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut s = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (j, s) in s.iter_mut().enumerate() {
                let o = i + 8 * j;
                *s = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(o)), _mm256_loadu_ps(pb.add(o)), *s);
            }
            i += 32;
        }
        while i + 8 <= n {
            s[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), s[0]);
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3]));
        let v = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        let mut r = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
        while i < n {
            r += a[i] * b[i];
            i += 1;
        }
        r
    }

    /// # Safety
    /// The CPU must support AVX-512 F; `x` and `y` of equal length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy512(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len();
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let a = _mm512_set1_ps(alpha);
        let mut i = 0;
        while i + 16 <= n {
            let v = _mm512_fmadd_ps(a, _mm512_loadu_ps(px.add(i)), _mm512_loadu_ps(py.add(i)));
            _mm512_storeu_ps(py.add(i), v);
            i += 16;
        }
        while i < n {
            y[i] += alpha * x[i];
            i += 1;
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `x` and `y` of equal length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy256(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len();
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let a = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= n {
            let v = _mm256_fmadd_ps(a, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
            _mm256_storeu_ps(py.add(i), v);
            i += 8;
        }
        while i < n {
            y[i] += alpha * x[i];
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn dot_and_axpy_agree_on_every_isa_and_length() {
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni] {
            let Some(ops) = F32Ops::with(isa) else {
                continue;
            };
            for n in [0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 64, 128, 130] {
                let (a, b) = (data(n, 1), data(n, 2));
                let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
                let got = ops.dot(&a, &b) as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * (n as f64 + 1.0),
                    "{isa:?} n={n}"
                );
                let mut y = b.clone();
                ops.axpy(0.75, &a, &mut y);
                for i in 0..n {
                    assert!(
                        (y[i] - (b[i] + 0.75 * a[i])).abs() <= 1e-6,
                        "{isa:?} n={n} i={i}"
                    );
                }
            }
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm_and_clamps() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            let ulp = (want.to_bits() as i64 - got.to_bits() as i64).abs();
            assert!(ulp <= 2, "exp({x}) = {got}, libm {want}");
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) > 0.0 && exp(-1000.0) < 1.3e-38);
        assert!(exp(1000.0).is_finite());
        assert!((silu(2.0) - 2.0 / (1.0 + (-2f32).exp())).abs() < 1e-6);
        assert!(silu(-200.0).abs() < 1e-30);
    }

    #[test]
    fn tanh_and_sigmoid_are_within_4_ulp_of_libm() {
        let ulps = |got: f32, want: f32| (want.to_bits() as i64 - got.to_bits() as i64).abs();
        let mut x = -30.0f32;
        while x < 30.0 {
            let (got, want) = (tanh(x), x.tanh());
            assert!(ulps(got, want) <= 3, "tanh({x}) = {got}, libm {want}");
            let (got, want) = (sigmoid(x), 1.0 / (1.0 + (-x).exp()));
            assert!(ulps(got, want) <= 4, "sigmoid({x}) = {got}, libm {want}");
            x += 0.000_731;
        }
        for x in [0.0f32, -0.0, 1e-30, -1e-30, 1e-8, 100.0, -100.0, 1e30] {
            assert!(ulps(tanh(x), x.tanh()) <= 1, "tanh({x})");
        }
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
    }
}
