//! How many tokens to draft: a fixed k, a table from the current batch size
//! to k (so speculation can turn itself off under load), or adaptive from an
//! exponential moving average of each sequence's acceptance. k = 0 is plain
//! decoding through the same verify path.

/// The draft-length policy.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftPolicy {
    /// Always `k`.
    Fixed { k: usize },
    /// `(max_batch_size, k)` rows sorted by batch size: the first row whose
    /// `max_batch_size >= batch` gives k; past the last row, k = 0.
    BatchTable(Vec<(usize, usize)>),
    /// Per sequence, the k in `min_k..=max_k` that maximizes expected tokens
    /// per unit of work, `E[tokens](k, a) / (1 + draft_cost * k)`, where `a`
    /// is the EMA of the fraction of drafts accepted (weight `alpha` on the
    /// newest round) and `draft_cost` the cost of one more drafted token
    /// (a draft step plus one more verify row) relative to a one-row verify
    /// pass. At k = 0 it probes with k = 1 every `probe_every`
    /// rounds, so a sequence that turns predictable is noticed.
    Adaptive {
        min_k: usize,
        max_k: usize,
        alpha: f64,
        draft_cost: f64,
        initial_acceptance: f64,
        probe_every: u32,
    },
}

/// Per-sequence memory of the adaptive policy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicyState {
    acceptance: Option<f64>,
    rounds_at_zero: u32,
}

impl PolicyState {
    /// The smoothed acceptance fraction, once a round has been observed.
    pub fn acceptance(&self) -> Option<f64> {
        self.acceptance
    }
}

/// Expected tokens emitted by one round with k drafts when each draft is
/// accepted with probability a (the accepted run plus one target token).
fn expected_tokens(k: usize, a: f64) -> f64 {
    if a >= 1.0 {
        return (k + 1) as f64;
    }
    (1.0 - a.powi(k as i32 + 1)) / (1.0 - a)
}

impl DraftPolicy {
    /// Errors naming the bad parameter.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            DraftPolicy::Fixed { .. } => Ok(()),
            DraftPolicy::BatchTable(rows) => {
                if rows.is_empty() {
                    return Err("batch table needs at least one row".into());
                }
                if rows.windows(2).any(|w| w[0].0 >= w[1].0) {
                    return Err("batch table rows must have increasing batch sizes".into());
                }
                Ok(())
            }
            DraftPolicy::Adaptive {
                min_k,
                max_k,
                alpha,
                draft_cost,
                initial_acceptance,
                probe_every,
            } => {
                if min_k > max_k {
                    return Err(format!("min_k {min_k} > max_k {max_k}"));
                }
                if !(*alpha > 0.0 && *alpha <= 1.0) {
                    return Err(format!("alpha {alpha} must be in (0, 1]"));
                }
                if !(*draft_cost >= 0.0 && draft_cost.is_finite()) {
                    return Err(format!("draft_cost {draft_cost} must be >= 0"));
                }
                if !(0.0..=1.0).contains(initial_acceptance) {
                    return Err(format!(
                        "initial_acceptance {initial_acceptance} must be in [0, 1]"
                    ));
                }
                if *probe_every == 0 {
                    return Err("probe_every must be at least 1".into());
                }
                Ok(())
            }
        }
    }

    /// The k for a sequence now, with `batch` sequences decoding this step.
    pub fn k(&self, batch: usize, state: &PolicyState) -> usize {
        match self {
            DraftPolicy::Fixed { k } => *k,
            DraftPolicy::BatchTable(rows) => rows
                .iter()
                .find(|(max_batch, _)| batch <= *max_batch)
                .map_or(0, |(_, k)| *k),
            DraftPolicy::Adaptive {
                min_k,
                max_k,
                draft_cost,
                initial_acceptance,
                probe_every,
                ..
            } => {
                let a = state.acceptance.unwrap_or(*initial_acceptance);
                let score = |k: usize| expected_tokens(k, a) / (1.0 + draft_cost * k as f64);
                let best = (*min_k..=*max_k)
                    .max_by(|&x, &y| score(x).total_cmp(&score(y)).then(y.cmp(&x)))
                    .unwrap_or(*min_k);
                if best == 0 && state.rounds_at_zero + 1 >= *probe_every {
                    1.min(*max_k)
                } else {
                    best
                }
            }
        }
    }

    /// Records a round in which `proposed` drafts were offered and
    /// `accepted` kept.
    pub fn observe(&self, state: &mut PolicyState, proposed: usize, accepted: usize) {
        let DraftPolicy::Adaptive { alpha, .. } = self else {
            return;
        };
        if proposed == 0 {
            state.rounds_at_zero += 1;
            return;
        }
        state.rounds_at_zero = 0;
        let frac = accepted as f64 / proposed as f64;
        state.acceptance = Some(match state.acceptance {
            Some(prev) => prev + alpha * (frac - prev),
            None => frac,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adaptive() -> DraftPolicy {
        DraftPolicy::Adaptive {
            min_k: 0,
            max_k: 8,
            alpha: 0.5,
            draft_cost: 0.1,
            initial_acceptance: 0.6,
            probe_every: 4,
        }
    }

    #[test]
    fn fixed_and_table() {
        let s = PolicyState::default();
        assert_eq!(DraftPolicy::Fixed { k: 3 }.k(99, &s), 3);
        let t = DraftPolicy::BatchTable(vec![(1, 6), (4, 3), (16, 1)]);
        assert!(t.validate().is_ok());
        assert_eq!([1, 2, 4, 5, 16, 17].map(|b| t.k(b, &s)), [6, 3, 3, 1, 1, 0]);
        assert!(DraftPolicy::BatchTable(vec![(4, 1), (2, 1)])
            .validate()
            .is_err());
    }

    #[test]
    fn adaptive_follows_acceptance() {
        let p = adaptive();
        let mut s = PolicyState::default();
        let k0 = p.k(1, &s);
        for _ in 0..10 {
            p.observe(&mut s, 4, 4);
        }
        let high = p.k(1, &s);
        assert!(high > k0 && high == 8, "{k0} -> {high}");
        for _ in 0..10 {
            p.observe(&mut s, high, 0);
        }
        assert_eq!(p.k(1, &s), 0);
        // At k = 0 it probes with 1 every `probe_every` rounds.
        let ks: Vec<usize> = (0..4)
            .map(|_| {
                let k = p.k(1, &s);
                p.observe(&mut s, k, 0);
                k
            })
            .collect();
        assert_eq!(ks, vec![0, 0, 0, 1]);
    }

    #[test]
    fn expected_tokens_matches_geometric_sum() {
        assert_eq!(expected_tokens(3, 1.0), 4.0);
        assert!((expected_tokens(2, 0.5) - 1.75).abs() < 1e-12);
        assert_eq!(expected_tokens(0, 0.3), 1.0);
    }

    #[test]
    fn bad_adaptive_parameters_are_named() {
        let bad = DraftPolicy::Adaptive {
            min_k: 5,
            max_k: 2,
            alpha: 0.5,
            draft_cost: 0.1,
            initial_acceptance: 0.5,
            probe_every: 4,
        };
        assert!(bad.validate().unwrap_err().contains("min_k"));
    }
}
