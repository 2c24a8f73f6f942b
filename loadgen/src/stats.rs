//! The statistics of a run: percentiles of latency samples, rates over a
//! wall-clock window, and the Poisson arrival schedule of the open loop.
//! Pure functions over numbers, so they are tested on synthetic timings.

use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// `p`-th percentile (0..=100) of `samples` by linear interpolation between
/// closest ranks (numpy's default), so p50 of [1, 2, 3, 4] is 2.5.
/// Returns `None` for no samples; NaNs must not be present. Reports use
/// [`Summary`]; this single-figure form serves the tests.
#[cfg(test)]
pub fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    Some(percentile_sorted(&s, p))
}

fn percentile_sorted(s: &[f64], p: f64) -> f64 {
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (s.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    s[lo] + (s[hi] - s[lo]) * (rank - lo as f64)
}

/// Mean and the p50/p90/p99 of a set of samples (seconds in reports).
/// All fields are `None` when there were no samples.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub count: usize,
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Summary {
    pub fn of(samples: &[f64]) -> Summary {
        if samples.is_empty() {
            return Summary::default();
        }
        let mut s = samples.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        Summary {
            count: s.len(),
            mean: Some(s.iter().sum::<f64>() / s.len() as f64),
            p50: Some(percentile_sorted(&s, 50.0)),
            p90: Some(percentile_sorted(&s, 90.0)),
            p99: Some(percentile_sorted(&s, 99.0)),
            max: s.last().copied(),
        }
    }
}

/// `count` per second over `seconds`; 0 for an empty window (nothing ran).
pub fn rate(count: f64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        count / seconds
    } else {
        0.0
    }
}

/// Arrival offsets (seconds from the start) of a Poisson process with
/// `rate` requests per second: exponential gaps with mean 1/rate, drawn
/// from a seeded generator so a run's schedule is reproducible. Returns
/// offsets until `n` arrivals or until the next would pass `horizon`
/// seconds, whichever comes first. `rate` must be positive and finite.
pub fn poisson_arrivals(rate: f64, n: usize, horizon: f64, seed: u64) -> Vec<f64> {
    assert!(rate > 0.0 && rate.is_finite(), "rate must be positive");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0;
    let mut out = Vec::new();
    while out.len() < n {
        // Inverse CDF of Exp(rate); 1 - u is in (0, 1] so ln never sees 0.
        let u: f64 = rng.random();
        t += -(1.0 - u).ln() / rate;
        if t > horizon {
            break;
        }
        out.push(t);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=4).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        // 1..=101: the p-th percentile is exactly 1 + p.
        let v: Vec<f64> = (1..=101).rev().map(f64::from).collect();
        for p in [50.0, 90.0, 99.0] {
            assert!((percentile(&v, p).unwrap() - (1.0 + p)).abs() < 1e-12);
        }
        // 0..10 step 1: p90 = 0.9 * 9 = 8.1.
        let v: Vec<f64> = (0..10).map(f64::from).collect();
        assert!((percentile(&v, 90.0).unwrap() - 8.1).abs() < 1e-12);
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
    }

    #[test]
    fn summary_of_synthetic_latencies() {
        // 100 requests: 99 at 10 ms, one straggler at 1 s.
        let mut v = vec![0.010; 99];
        v.push(1.0);
        let s = Summary::of(&v);
        assert_eq!(s.count, 100);
        assert!((s.mean.unwrap() - (0.99 + 1.0) / 100.0).abs() < 1e-12);
        assert_eq!(s.p50, Some(0.010));
        assert_eq!(s.p90, Some(0.010));
        // rank 0.99 * 99 = 98.01: 1% of the way from 10 ms to 1 s.
        assert!((s.p99.unwrap() - (0.010 + 0.01 * 0.990)).abs() < 1e-12);
        assert_eq!(s.max, Some(1.0));
        assert_eq!(Summary::of(&[]), Summary::default());
    }

    #[test]
    fn rates_over_a_window() {
        assert_eq!(rate(30.0, 10.0), 3.0);
        assert_eq!(rate(640.0, 8.0), 80.0);
        assert_eq!(rate(5.0, 0.0), 0.0);
    }

    #[test]
    fn poisson_arrivals_have_the_asked_mean_rate() {
        let rate_hz = 4.0;
        let a = poisson_arrivals(rate_hz, 20_000, f64::INFINITY, 7);
        assert_eq!(a.len(), 20_000);
        assert!(a.windows(2).all(|w| w[0] <= w[1]), "offsets increase");
        let gaps: Vec<f64> = std::iter::once(a[0])
            .chain(a.windows(2).map(|w| w[1] - w[0]))
            .collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        // Exp(4): mean 0.25, sd 0.25; the mean of 20000 has sd 0.0018, so
        // 0.01 is over five standard deviations.
        assert!((mean - 0.25).abs() < 0.01, "mean gap {mean}");
        // Exponential, not constant: the median gap is ln 2 / rate.
        let med = percentile(&gaps, 50.0).unwrap();
        assert!((med - 2f64.ln() / rate_hz).abs() < 0.01, "median gap {med}");
        // Same seed, same schedule; the horizon cuts it.
        assert_eq!(poisson_arrivals(rate_hz, 50, 1e9, 7), a[..50].to_vec());
        let cut = poisson_arrivals(rate_hz, 20_000, 10.0, 7);
        assert!(cut.iter().all(|&t| t <= 10.0));
        assert_eq!(cut.len(), a.iter().filter(|&&t| t <= 10.0).count());
    }
}
