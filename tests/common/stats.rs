//! Goodness of fit for the lossless-sampling tests: a chi-square statistic
//! against an exact distribution, with its critical value.

/// Chi-square statistic of `counts` (of `n` samples) against the exact
/// probabilities `exact`, cells with expected count < 5 pooled, and its
/// critical value at significance 1e-6.
pub fn chi_square(exact: &[f64], counts: &[usize], n: usize) -> (f64, f64) {
    let (mut stat, mut pooled_e, mut pooled_o, mut cells) = (0.0, 0.0, 0.0, 0usize);
    for (&p, &c) in exact.iter().zip(counts) {
        let e = p * n as f64;
        if e >= 5.0 {
            stat += (c as f64 - e).powi(2) / e;
            cells += 1;
        } else {
            pooled_e += e;
            pooled_o += c as f64;
        }
    }
    if pooled_e > 0.0 {
        stat += (pooled_o - pooled_e).powi(2) / pooled_e.max(1e-9);
        cells += 1;
    }
    let df = (cells - 1) as f64;
    // Wilson-Hilferty: chi2 quantile from the normal one (z = 4.753 at 1e-6).
    let z = 4.753;
    let a = 2.0 / (9.0 * df);
    (stat, df * (1.0 - a + z * a.sqrt()).powi(3))
}
