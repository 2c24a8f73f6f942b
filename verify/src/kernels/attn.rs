//! Register-tiled kernels for attention over cached rows: the scores of
//! many query vectors against many key rows ([`scores`]), and the
//! probability-weighted sums of value rows ([`weighted_sums`]).
//!
//! Why: a prompt chunk attending a long history is a small matrix product
//! per block of rows (rows x heads query vectors against thousands of
//! cached rows). One dot or one `y += a * x` at a time loads both operands
//! for every multiply-add and reduces every dot across its lanes; a tile
//! of `QT` queries by `TT` keys (or `JT` lane groups) keeps its sums in
//! registers and loads each operand once per tile.
//!
//! Invariant (bit-identical everywhere): every value is accumulated in one
//! fixed order, independent of the instruction set, the tile shape and the
//! other rows. A dot keeps 16 lanes, lane `l` summing the products of
//! elements `l, l + 16, ...` with one fused multiply-add each, then adds
//! lanes pairwise at distances 8, 4, 2, 1; a weighted sum adds each row's
//! term with one fused multiply-add per element, rows in order. AVX-512,
//! AVX2 and the portable code run those same operations, so any tiling on
//! any of them gives the same bits, and a query scored alone equals the
//! same query scored in a tile.

use super::Isa;

/// Lanes of one accumulator.
const LANES: usize = 16;

/// A vector of [`LANES`] f32 lanes. Methods are `unsafe`: an
/// implementation may need CPU features its callers enabled, and pointers
/// must hold the values read or written.
trait Lanes: Copy {
    unsafe fn zero() -> Self;
    /// 16 values at `p`.
    unsafe fn load(p: *const f32) -> Self;
    /// `n < 16` values at `p`, the other lanes zero.
    unsafe fn load_part(p: *const f32, n: usize) -> Self {
        let mut buf = [0f32; LANES];
        std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
        Self::load(buf.as_ptr())
    }
    unsafe fn splat(x: f32) -> Self;
    /// `a * b + c`, rounded once.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    unsafe fn store(self, p: *mut f32);
    /// The first `n < 16` lanes to `p`.
    unsafe fn store_part(self, p: *mut f32, n: usize) {
        let mut buf = [0f32; LANES];
        self.store(buf.as_mut_ptr());
        std::ptr::copy_nonoverlapping(buf.as_ptr(), p, n);
    }
    /// The lanes added pairwise at distances 8, 4, 2, 1.
    unsafe fn sum(self) -> f32;
}

/// The portable lanes (and the reference the others equal).
#[derive(Clone, Copy)]
struct Portable([f32; LANES]);

impl Lanes for Portable {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Portable([0.0; LANES])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Portable(std::ptr::read_unaligned(p as *const [f32; LANES]))
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Portable([x; LANES])
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Portable(std::array::from_fn(|l| a.0[l].mul_add(b.0[l], c.0[l])))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        std::ptr::write_unaligned(p as *mut [f32; LANES], self.0)
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        let mut a = self.0;
        let mut h = LANES / 2;
        while h > 0 {
            for l in 0..h {
                a[l] += a[l + h];
            }
            h /= 2;
        }
        a[0]
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Lanes, LANES};
    use std::arch::x86_64::*;

    /// Lanes 8 apart in the two halves of a 256-bit pair added, then the
    /// rest of the tree on 128 bits.
    #[inline(always)]
    unsafe fn sum8(s8: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s1)
    }

    /// One 512-bit register (AVX-512 F).
    #[derive(Clone, Copy)]
    pub(super) struct Z(__m512);

    impl Lanes for Z {
        #[inline(always)]
        unsafe fn zero() -> Self {
            Z(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Z(_mm512_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn load_part(p: *const f32, n: usize) -> Self {
            Z(_mm512_maskz_loadu_ps(((1u32 << n) - 1) as __mmask16, p))
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Z(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            Z(_mm512_fmadd_ps(a.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn store_part(self, p: *mut f32, n: usize) {
            _mm512_mask_storeu_ps(p, ((1u32 << n) - 1) as __mmask16, self.0)
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            let lo = _mm512_castps512_ps256(self.0);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(self.0), 1));
            sum8(_mm256_add_ps(lo, hi))
        }
    }

    /// Two 256-bit registers, lanes 0..8 and 8..16 (AVX2 + FMA).
    #[derive(Clone, Copy)]
    pub(super) struct Y(__m256, __m256);

    impl Lanes for Y {
        #[inline(always)]
        unsafe fn zero() -> Self {
            Y(_mm256_setzero_ps(), _mm256_setzero_ps())
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Y(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(LANES / 2)))
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            let v = _mm256_set1_ps(x);
            Y(v, v)
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            Y(
                _mm256_fmadd_ps(a.0, b.0, c.0),
                _mm256_fmadd_ps(a.1, b.1, c.1),
            )
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm256_storeu_ps(p, self.0);
            _mm256_storeu_ps(p.add(LANES / 2), self.1);
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            sum8(_mm256_add_ps(self.0, self.1))
        }
    }
}

/// Dots of `QT` queries with `TT` keys over their first `d` values.
#[inline(always)]
unsafe fn score_tile<L: Lanes, const QT: usize, const TT: usize>(
    q: [*const f32; QT],
    k: [*const f32; TT],
    d: usize,
) -> [[f32; TT]; QT] {
    let mut acc = [[L::zero(); TT]; QT];
    let mut c = 0;
    while c + LANES <= d {
        let kv: [L; TT] = std::array::from_fn(|t| L::load(k[t].add(c)));
        for i in 0..QT {
            let qv = L::load(q[i].add(c));
            for t in 0..TT {
                acc[i][t] = L::fma(qv, kv[t], acc[i][t]);
            }
        }
        c += LANES;
    }
    if c < d {
        let kv: [L; TT] = std::array::from_fn(|t| L::load_part(k[t].add(c), d - c));
        for i in 0..QT {
            let qv = L::load_part(q[i].add(c), d - c);
            for t in 0..TT {
                acc[i][t] = L::fma(qv, kv[t], acc[i][t]);
            }
        }
    }
    let mut out = [[0f32; TT]; QT];
    for i in 0..QT {
        for t in 0..TT {
            out[i][t] = acc[i][t].sum();
        }
    }
    out
}

/// [`scores`] with lanes `L`, in tiles of `QT` queries by `TT` keys (the
/// edges one query or key at a time).
#[inline(always)]
unsafe fn scores_with<L: Lanes, const QT: usize, const TT: usize>(
    qs: &[&[f32]],
    ks: &[&[f32]],
    d: usize,
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    let (nq, nt) = (qs.len(), ks.len());
    let mut i = 0;
    while i < nq {
        let qn = if i + QT <= nq { QT } else { 1 };
        let mut t = 0;
        while t < nt {
            let tn = if t + TT <= nt { TT } else { 1 };
            match (qn == QT, tn == TT) {
                (true, true) => {
                    let s = score_tile::<L, QT, TT>(
                        std::array::from_fn(|a| qs[i + a].as_ptr()),
                        std::array::from_fn(|b| ks[t + b].as_ptr()),
                        d,
                    );
                    for (a, row) in s.iter().enumerate() {
                        for (b, &v) in row.iter().enumerate() {
                            out[(i + a) * stride + t + b] = v * scale;
                        }
                    }
                }
                (true, false) => {
                    let s = score_tile::<L, QT, 1>(
                        std::array::from_fn(|a| qs[i + a].as_ptr()),
                        [ks[t].as_ptr()],
                        d,
                    );
                    for (a, row) in s.iter().enumerate() {
                        out[(i + a) * stride + t] = row[0] * scale;
                    }
                }
                (false, true) => {
                    let s = score_tile::<L, 1, TT>(
                        [qs[i].as_ptr()],
                        std::array::from_fn(|b| ks[t + b].as_ptr()),
                        d,
                    );
                    for (b, &v) in s[0].iter().enumerate() {
                        out[i * stride + t + b] = v * scale;
                    }
                }
                (false, false) => {
                    let s = score_tile::<L, 1, 1>([qs[i].as_ptr()], [ks[t].as_ptr()], d);
                    out[i * stride + t] = s[0][0] * scale;
                }
            }
            t += tn;
        }
        i += qn;
    }
}

/// `out[i][c..c + JT * 16] += sum_t p[i][t] * v[t][c..]` for `QT` rows
/// (`w` values at `c` when `JT == 1` and `w < 16`).
#[inline(always)]
unsafe fn wsum_tile<L: Lanes, const QT: usize, const JT: usize>(
    p: [*const f32; QT],
    vs: &[&[f32]],
    out: [*mut f32; QT],
    c: usize,
    w: usize,
) {
    let part = w < LANES;
    let load = |ptr: *const f32| {
        if part {
            L::load_part(ptr, w)
        } else {
            L::load(ptr)
        }
    };
    let mut acc: [[L; JT]; QT] =
        std::array::from_fn(|i| std::array::from_fn(|j| load(out[i].add(c + j * LANES))));
    for (t, v) in vs.iter().enumerate() {
        let vv: [L; JT] = std::array::from_fn(|j| load(v.as_ptr().add(c + j * LANES)));
        for i in 0..QT {
            let ps = L::splat(*p[i].add(t));
            for j in 0..JT {
                acc[i][j] = L::fma(ps, vv[j], acc[i][j]);
            }
        }
    }
    for (row, &o) in acc.iter().zip(&out) {
        for (j, a) in row.iter().enumerate() {
            if part {
                a.store_part(o.add(c + j * LANES), w);
            } else {
                a.store(o.add(c + j * LANES));
            }
        }
    }
}

/// [`weighted_sums`] with lanes `L`, in tiles of `QT` rows by `JT` lane
/// groups (the edges one row or one group at a time).
#[inline(always)]
unsafe fn weighted_sums_with<L: Lanes, const QT: usize, const JT: usize>(
    ps: &[&[f32]],
    vs: &[&[f32]],
    d: usize,
    outs: &mut [&mut [f32]],
) {
    let nq = ps.len();
    let mut i = 0;
    while i < nq {
        let full = i + QT <= nq;
        let mut c = 0;
        while c < d {
            let w = (d - c).min(LANES);
            if full && c + JT * LANES <= d {
                wsum_tile::<L, QT, JT>(
                    std::array::from_fn(|a| ps[i + a].as_ptr()),
                    vs,
                    std::array::from_fn(|a| outs[i + a].as_mut_ptr()),
                    c,
                    LANES,
                );
                c += JT * LANES;
            } else if full {
                wsum_tile::<L, QT, 1>(
                    std::array::from_fn(|a| ps[i + a].as_ptr()),
                    vs,
                    std::array::from_fn(|a| outs[i + a].as_mut_ptr()),
                    c,
                    w,
                );
                c += w;
            } else {
                wsum_tile::<L, 1, 1>([ps[i].as_ptr()], vs, [outs[i].as_mut_ptr()], c, w);
                c += w;
            }
        }
        i += if full { QT } else { 1 };
    }
}

/// `out[i * stride + t] = scale * (qs[i][..d] . ks[t][..d])` for every
/// query `i` and key `t`, each dot in the module's one order.
///
/// # Panics
/// If a query or key is shorter than `d`, or `out` is shorter than
/// `(qs.len() - 1) * stride + ks.len()`.
pub fn scores(
    isa: Isa,
    qs: &[&[f32]],
    ks: &[&[f32]],
    d: usize,
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    assert!(qs.iter().chain(ks).all(|r| r.len() >= d));
    assert!(qs.is_empty() || out.len() >= (qs.len() - 1) * stride + ks.len());
    assert!(ks.len() <= stride || qs.len() <= 1);
    // SAFETY: every pointer read is within a row of at least `d` values
    // and every write within `out` (asserted above); the instruction set
    // is checked present.
    unsafe {
        match isa.vector() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni if isa.available() => scores_avx512(qs, ks, d, scale, out, stride),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 if isa.available() => scores_avx2(qs, ks, d, scale, out, stride),
            _ => scores_with::<Portable, 2, 2>(qs, ks, d, scale, out, stride),
        }
    }
}

/// `outs[i][..d] += sum_t ps[i][t] * vs[t][..d]` for every row `i`, `t`
/// over `vs` in order, one fused multiply-add per term and element.
///
/// # Panics
/// If a `ps[i]` is shorter than `vs`, or a value row or output shorter
/// than `d`, or `outs` and `ps` differ in length.
pub fn weighted_sums(isa: Isa, ps: &[&[f32]], vs: &[&[f32]], d: usize, outs: &mut [&mut [f32]]) {
    assert_eq!(ps.len(), outs.len());
    assert!(ps.iter().all(|p| p.len() >= vs.len()));
    assert!(vs.iter().all(|v| v.len() >= d) && outs.iter().all(|o| o.len() >= d));
    // SAFETY: as in `scores`: reads within `ps` rows (`vs.len()` each)
    // and value rows (`d` each), writes within `outs` rows.
    unsafe {
        match isa.vector() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni if isa.available() => weighted_sums_avx512(ps, vs, d, outs),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 if isa.available() => weighted_sums_avx2(ps, vs, d, outs),
            _ => weighted_sums_with::<Portable, 2, 2>(ps, vs, d, outs),
        }
    }
}

// 4 x 4 tiles: 16 accumulators and 8 operands in AVX-512's 32 registers;
// AVX2's 16 hold 2 x 2 tiles of register pairs.

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn scores_avx512(
    qs: &[&[f32]],
    ks: &[&[f32]],
    d: usize,
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    scores_with::<x86::Z, 4, 4>(qs, ks, d, scale, out, stride)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2(
    qs: &[&[f32]],
    ks: &[&[f32]],
    d: usize,
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    scores_with::<x86::Y, 2, 2>(qs, ks, d, scale, out, stride)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn weighted_sums_avx512(ps: &[&[f32]], vs: &[&[f32]], d: usize, outs: &mut [&mut [f32]]) {
    weighted_sums_with::<x86::Z, 4, 4>(ps, vs, d, outs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_sums_avx2(ps: &[&[f32]], vs: &[&[f32]], d: usize, outs: &mut [&mut [f32]]) {
    weighted_sums_with::<x86::Y, 2, 2>(ps, vs, d, outs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, d: usize, seed: u32) -> Vec<Vec<f32>> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                (0..d)
                    .map(|_| {
                        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                        (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
                    })
                    .collect()
            })
            .collect()
    }

    fn refs(v: &[Vec<f32>]) -> Vec<&[f32]> {
        v.iter().map(|r| &r[..]).collect()
    }

    /// The module's order written out plainly, one dot at a time.
    fn reference_dot(a: &[f32], b: &[f32], d: usize) -> f32 {
        let mut acc = [0f32; LANES];
        for (i, (x, y)) in a[..d].iter().zip(&b[..d]).enumerate() {
            acc[i % LANES] = x.mul_add(*y, acc[i % LANES]);
        }
        // SAFETY: portable lanes need no CPU feature.
        unsafe { Portable(acc).sum() }
    }

    fn isas() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    }

    #[test]
    fn scores_equal_the_reference_bit_for_bit_on_every_isa_and_shape() {
        for &(nq, nt, d) in &[(1, 1, 576), (5, 7, 576), (9, 13, 40), (4, 4, 16), (3, 2, 7)] {
            let (q, k) = (rows(nq, d, 1), rows(nt, d + 3, 2));
            for isa in isas() {
                let stride = nt + 2;
                let mut out = vec![f32::NAN; nq * stride];
                scores(isa, &refs(&q), &refs(&k), d, 0.125, &mut out, stride);
                for i in 0..nq {
                    for t in 0..nt {
                        let want = reference_dot(&q[i], &k[t], d) * 0.125;
                        assert_eq!(
                            out[i * stride + t].to_bits(),
                            want.to_bits(),
                            "{isa:?} {nq}x{nt}x{d} ({i},{t})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn weighted_sums_equal_the_reference_bit_for_bit_on_every_isa_and_shape() {
        for &(nq, nt, d) in &[(1, 1, 512), (5, 9, 512), (6, 3, 32), (3, 4, 71), (4, 2, 8)] {
            let (p, v, init) = (rows(nq, nt, 3), rows(nt, d + 5, 4), rows(nq, d, 5));
            let mut want = init.clone();
            for i in 0..nq {
                for (t, vt) in v.iter().enumerate() {
                    for (o, x) in want[i].iter_mut().zip(vt) {
                        *o = p[i][t].mul_add(*x, *o);
                    }
                }
            }
            for isa in isas() {
                let mut got = init.clone();
                let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|r| &mut r[..]).collect();
                weighted_sums(isa, &refs(&p), &refs(&v), d, &mut outs);
                for i in 0..nq {
                    let same = got[i]
                        .iter()
                        .zip(&want[i])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{isa:?} {nq}x{nt}x{d} row {i}");
                }
            }
        }
    }

    #[test]
    fn splitting_the_rows_of_a_weighted_sum_changes_no_bit() {
        let (nq, nt, d) = (6, 11, 64);
        let (p, v) = (rows(nq, nt, 6), rows(nt, d, 7));
        for isa in isas() {
            let mut whole = vec![vec![0f32; d]; nq];
            let mut outs: Vec<&mut [f32]> = whole.iter_mut().map(|r| &mut r[..]).collect();
            weighted_sums(isa, &refs(&p), &refs(&v), d, &mut outs);
            let mut split = vec![vec![0f32; d]; nq];
            for (a, b) in [(0, 4), (4, 11)] {
                let ps: Vec<&[f32]> = p.iter().map(|r| &r[a..b]).collect();
                let mut outs: Vec<&mut [f32]> = split.iter_mut().map(|r| &mut r[..]).collect();
                weighted_sums(isa, &ps, &refs(&v)[a..b], d, &mut outs);
            }
            assert_eq!(whole, split, "{isa:?}");
        }
    }
}
