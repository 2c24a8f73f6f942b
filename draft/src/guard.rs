//! The draft model's measured worth, per batch size: a check on the
//! goodput policy's predictions by what drafting with the model really
//! gained.
//!
//! The policy decides from a cost model and acceptance estimates; both can
//! be wrong in ways no curve prices (a catch-up after lookups served a
//! sequence, the draft's bookkeeping, estimates carried over from lookups,
//! another tenant on the host). So every step that ran the draft model is
//! scored by its *realized gain*: the work it did per second against what
//! the same step would have done per second without the model's drafts
//! (see [`realized_gain`]). Per batch-size bucket (1, 2-3, 4-7, ...) an EMA
//! of that gain vetoes the model where it falls below 1 (the model made
//! steps of that size slower than they earn) and lifts the veto when it
//! comes back above `1 + LIFT`. While vetoed, one step in `explore_every`
//! may still use the model, so a gain that recovers (acceptance rises, the
//! host gets quieter) is seen.

/// Scored steps a bucket needs before it may veto: one or two noisy steps
/// must not switch the model off.
pub const MIN_SAMPLES: u32 = 8;

/// How far above 1 a vetoed bucket's gain must come back to lift the veto
/// (hysteresis, so a gain near 1 does not flip every step).
pub const LIFT: f64 = 0.03;

/// The realized gain of one step that drafted with the model: `(tokens +
/// prefill_rows) / step_secs` against `(tokens - model_accepted +
/// prefill_rows) / secs_without`, where `secs_without` is the step's time
/// without the model (its verify time less the rows the model's drafts
/// added, without the draft forwards and the draft's prompt chunks).
/// Prompt rows count as work done, as in the policy's objective: a step
/// that drafts is slower for its prompt chunks too. `None` when the inputs
/// cannot be scored (no time, no work).
pub fn realized_gain(
    tokens: f64,
    model_accepted: f64,
    prefill_rows: f64,
    step_secs: f64,
    secs_without: f64,
) -> Option<f64> {
    let with = tokens + prefill_rows;
    let without = (tokens - model_accepted).max(0.0) + prefill_rows;
    if step_secs <= 0.0 || secs_without <= 0.0 || with <= 0.0 || without <= 0.0 {
        return None;
    }
    Some((with / step_secs) / (without / secs_without))
}

#[derive(Debug, Clone, Default)]
struct Bucket {
    gain: Option<f64>,
    samples: u32,
    vetoed: bool,
}

/// Per batch-size bucket, the EMA of [`realized_gain`] and whether the
/// model is vetoed there.
#[derive(Debug, Clone)]
pub struct ModelGuard {
    buckets: Vec<Bucket>,
    alpha: f64,
    explore_every: u64,
}

/// A batch of `n` decoding sequences' bucket: `floor(log2(n))`.
fn bucket(n: usize) -> usize {
    (usize::BITS - 1 - n.max(1).leading_zeros()) as usize
}

impl ModelGuard {
    /// `alpha`: the EMA's weight on the newest step, in (0, 1];
    /// `explore_every`: while vetoed, one step in this many may still use
    /// the model (at least 1).
    pub fn new(alpha: f64, explore_every: u64) -> Self {
        Self {
            buckets: vec![Bucket::default(); bucket(usize::MAX) + 1],
            alpha: alpha.clamp(f64::MIN_POSITIVE, 1.0),
            explore_every: explore_every.max(1),
        }
    }

    /// Whether a step of `n` decoding sequences, the engine's step number
    /// `step`, may draft with the model.
    pub fn allows(&self, n: usize, step: u64) -> bool {
        !self.vetoed(n) || step.is_multiple_of(self.explore_every)
    }

    /// Whether the model is vetoed for a batch of `n` decoding sequences.
    pub fn vetoed(&self, n: usize) -> bool {
        self.buckets[bucket(n)].vetoed
    }

    /// Folds in the gain of a step of `n` decoding sequences that drafted
    /// with the model; returns whether the bucket's veto changed.
    pub fn record(&mut self, n: usize, gain: f64) -> bool {
        let b = &mut self.buckets[bucket(n)];
        b.gain = Some(b.gain.map_or(gain, |g| g + self.alpha * (gain - g)));
        b.samples = b.samples.saturating_add(1);
        let g = b.gain.unwrap_or(1.0);
        let vetoed = if b.vetoed {
            g < 1.0 + LIFT
        } else {
            b.samples >= MIN_SAMPLES && g < 1.0
        };
        let changed = vetoed != b.vetoed;
        b.vetoed = vetoed;
        changed
    }

    /// The gain EMA of `n` sequences' bucket, if scored.
    pub fn gain(&self, n: usize) -> Option<f64> {
        self.buckets[bucket(n)].gain
    }

    /// Every scored bucket: (smallest batch size, largest, gain EMA,
    /// vetoed), for metrics and logs.
    pub fn scored(&self) -> impl Iterator<Item = (usize, usize, f64, bool)> + '_ {
        self.buckets.iter().enumerate().filter_map(|(i, b)| {
            let lo = 1usize << i;
            let hi = lo.saturating_mul(2) - 1;
            b.gain.map(|g| (lo, hi, g, b.vetoed))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two() {
        assert_eq!(
            [1, 2, 3, 4, 7, 8, 31, 32].map(bucket),
            [0, 1, 1, 2, 2, 3, 4, 5]
        );
        assert_eq!(bucket(0), 0);
    }

    #[test]
    fn realized_gain_weighs_time_against_work() {
        // 4 sequences, the model's drafts gave 2 more tokens (6), the step
        // took 1.2 s where it would have taken 1.0 s: 5/1.2 over 4/1.0.
        let g = realized_gain(6.0, 2.0, 0.0, 1.2, 1.0).unwrap();
        assert!((g - 1.25).abs() < 1e-12, "{g}");
        // With 20 prompt rows in the same step the drafts are worth less:
        // the whole step (prompt included) went slower.
        let g = realized_gain(6.0, 2.0, 20.0, 1.2, 1.0).unwrap();
        assert!(g < 1.0, "{g}");
        assert_eq!(realized_gain(0.0, 0.0, 0.0, 1.0, 1.0), None);
        assert_eq!(realized_gain(1.0, 0.0, 0.0, 0.0, 1.0), None);
    }

    #[test]
    fn a_losing_bucket_is_vetoed_and_explored_then_lifted() {
        let mut g = ModelGuard::new(0.2, 16);
        // A few losing steps are not enough.
        for _ in 0..MIN_SAMPLES - 1 {
            assert!(!g.record(4, 0.8));
        }
        assert!((0..64).all(|s| g.allows(5, s)));
        assert!(g.record(6, 0.8), "the eighth losing step vetoes");
        assert!(!g.allows(4, 1) && !g.allows(7, 17));
        // One step in 16 may still draft with the model.
        assert_eq!((0..64).filter(|&s| g.allows(4, s)).count(), 4);
        // Other buckets are not affected.
        assert!(g.allows(8, 1) && g.allows(1, 1));
        // Gains just above 1 keep the veto (hysteresis)...
        for _ in 0..50 {
            assert!(!g.record(4, 1.01));
        }
        assert!(!g.allows(4, 1));
        // ...a clear gain lifts it.
        let lifted = (0..50).any(|_| g.record(4, 1.2));
        assert!(lifted && g.allows(4, 1));
        assert!(g.gain(4).unwrap() > 1.0 + LIFT);
        let scored: Vec<_> = g.scored().collect();
        assert_eq!(scored.len(), 1);
        assert_eq!((scored[0].0, scored[0].1, scored[0].3), (4, 7, false));
    }

    #[test]
    fn a_winning_bucket_is_never_vetoed() {
        let mut g = ModelGuard::new(0.1, 8);
        for i in 0..200 {
            // Noisy, but winning on average.
            let gain = if i % 3 == 0 { 0.9 } else { 1.3 };
            assert!(!g.record(1, gain));
        }
        assert!((0..32).all(|s| g.allows(1, s)));
    }
}
