//! How wide each sequence's token tree is this step: the branch nodes a
//! proposer may add beside its chain, bought from the cost model the way
//! the goodput policy buys chain drafts.
//!
//! A branch node costs one more verify row and no draft-model step (a
//! proposer's branches are leaves of its forwards, or lookups). What one
//! yields is measured, not assumed: per sequence, the EMA of the extra
//! tokens its tree rounds emitted beyond what their chain alone emitted,
//! per branch node ([`PolicyState::branch_gain`]). So trees widen where
//! branches have been winning and rows are cheap (one sequence on a
//! memory-bound forward), and vanish under load, where every row costs
//! about what it is expected to yield.

use crate::cost::CostModel;
use crate::policy::PolicyState;

/// One decoding sequence's side of the width plan.
#[derive(Debug, Clone, Copy)]
pub struct BranchSeq<'a> {
    /// Chain drafts planned this step (no branches without a chain).
    pub k: usize,
    /// The most branch nodes it may take (its proposer's and the pool's
    /// limits); 0 when it cannot branch (a grammar, a model without tree
    /// verification).
    pub max: usize,
    pub state: &'a PolicyState,
    /// The engine-wide estimate for sequences drafting the same way.
    pub prior: &'a PolicyState,
}

/// The step the widths are bought in: what the chain plan already holds.
#[derive(Debug, Clone, Copy)]
pub struct WidthStep {
    /// Decode rows (last tokens and chain drafts) and prompt rows.
    pub decode_rows: usize,
    pub prompt_rows: usize,
    /// Rows the forward may still take (the token budget's rest).
    pub budget_left: usize,
    /// The chain plan's expected emitted tokens and predicted seconds.
    pub expected: f64,
    pub secs: f64,
    /// The relative gain a width must be predicted to bring (as the
    /// goodput policy's lookup margin).
    pub margin: f64,
    /// Gain per branch node assumed where nothing was measured yet.
    pub initial_gain: f64,
}

/// What [`plan_widths`] chose.
#[derive(Debug, Clone, PartialEq)]
pub struct WidthPlan {
    /// Branch nodes per sequence, in the order given.
    pub widths: Vec<usize>,
    /// The step's expected tokens and predicted seconds with them.
    pub expected: f64,
    pub secs: f64,
}

/// Branch nodes per sequence (aligned with `seqs`), each in `0..=max`,
/// all within the budget: sequences in order of measured gain per node,
/// each bought at the largest width (halving from `max`) that raises the
/// plan's expected tokens per second by more than the margin.
pub fn plan_widths(seqs: &[BranchSeq], cost: &CostModel, step: WidthStep) -> WidthPlan {
    let mut out = vec![0; seqs.len()];
    if step.secs <= 0.0 || step.expected <= 0.0 {
        return WidthPlan {
            widths: out,
            expected: step.expected,
            secs: step.secs,
        };
    }
    let gain = |s: &BranchSeq| {
        s.state
            .branch_gain()
            .or(s.prior.branch_gain())
            .unwrap_or(step.initial_gain)
            .max(0.0)
    };
    let mut order: Vec<usize> = (0..seqs.len())
        .filter(|&i| seqs[i].k > 0 && seqs[i].max > 0)
        .collect();
    order.sort_by(|&a, &b| gain(&seqs[b]).total_cmp(&gain(&seqs[a])));
    let (mut rows, mut left) = (step.decode_rows, step.budget_left);
    let (mut expected, mut secs) = (step.expected, step.secs);
    let verify = |rows: usize| cost.step_secs(cost.verify_rows(rows, step.prompt_rows), &[]);
    for i in order {
        let g = gain(&seqs[i]);
        let mut w = seqs[i].max.min(left);
        while w > 0 {
            let more = verify(rows + w) - verify(rows);
            let (e, t) = (expected + w as f64 * g, secs + more.max(0.0));
            if e / t > expected / secs * (1.0 + step.margin) {
                out[i] = w;
                (expected, secs, rows, left) = (e, t, rows + w, left - w);
                break;
            }
            w /= 2;
        }
    }
    WidthPlan {
        widths: out,
        expected,
        secs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CostCurve;

    fn cost(points: Vec<(usize, f64)>) -> CostModel {
        CostModel::new(CostCurve::new(points).unwrap(), None)
    }

    fn step(decode_rows: usize, expected: f64, secs: f64) -> WidthStep {
        WidthStep {
            decode_rows,
            prompt_rows: 0,
            budget_left: 64,
            expected,
            secs,
            margin: 0.02,
            initial_gain: 0.2,
        }
    }

    #[test]
    fn cheap_rows_buy_width_and_dear_rows_do_not() {
        let state = PolicyState::default();
        let seq = BranchSeq {
            k: 4,
            max: 4,
            state: &state,
            prior: &state,
        };
        // Memory-bound: 5 rows and 9 rows cost nearly the same.
        let flat = cost(vec![(1, 0.050), (16, 0.060)]);
        let got = plan_widths(&[seq], &flat, step(5, 2.5, 0.051));
        assert_eq!(got.widths, vec![4]);
        assert!(got.expected > 2.5 && got.secs > 0.051);
        // Compute-bound: every row costs a full share.
        let steep = cost(vec![(1, 0.010), (64, 0.640)]);
        let many = vec![seq; 16];
        let w = plan_widths(&many, &steep, step(80, 40.0, 0.8));
        assert_eq!(w.widths, vec![0; 16]);
        assert_eq!((w.expected, w.secs), (40.0, 0.8));
    }

    #[test]
    fn measured_gain_decides_and_budget_caps() {
        let mut poor = PolicyState::default();
        for _ in 0..20 {
            poor.record_branches(4, 0, 0.3);
        }
        let mut good = PolicyState::default();
        for _ in 0..20 {
            good.record_branches(4, 2, 0.3);
        }
        let prior = PolicyState::default();
        let mk = |state| BranchSeq {
            k: 3,
            max: 4,
            state,
            prior: &prior,
        };
        let flat = cost(vec![(1, 0.050), (16, 0.070)]);
        let w = plan_widths(&[mk(&poor), mk(&good)], &flat, step(8, 5.0, 0.052));
        assert_eq!(w.widths, vec![0, 4]);
        // No chain, no branches; the budget caps the width.
        let mut st = step(8, 5.0, 0.052);
        st.budget_left = 3;
        let none = BranchSeq { k: 0, ..mk(&good) };
        assert_eq!(
            plan_widths(&[none, mk(&good)], &flat, st).widths,
            vec![0, 3]
        );
    }
}
