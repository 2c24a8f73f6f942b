//! Where a model draft branches: per chain position, how the draft ranks
//! the tokens it did not choose ([`Ranked`]), and which of them become
//! sibling leaves of the chain under a node budget ([`leaves`]).
//!
//! The rule: a position is unsure when the chain's token there has
//! probability below a threshold (at greedy params the chain's token is the
//! most likely one, so this is "top-1 below the threshold"; a sampled chain
//! may have drawn an unlikely token where the draft was sure of another,
//! and then that other one is the leaf most worth a verify row). Unsure
//! positions are served most unsure first, one leaf per position per round
//! (so a budget smaller than the unsure positions goes to the least sure
//! ones), each leaf being the position's next most likely token that is not
//! the chain's; a position takes leaves while the tokens it already offers
//! (the chain's and its leaves) cover less than the threshold of its
//! probability.

/// How one drafted row ranks its tokens.
///
/// Invariant: `alts` is sorted by probability, highest first (equal ones
/// by token id, as [`specgate_verify::sample::argmax`] breaks ties), holds
/// only tokens of probability > 0 and never the chain's token.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Ranked {
    /// Probability of the token the chain took there.
    chosen: f32,
    /// The most likely other tokens with their probabilities.
    alts: Vec<(u32, f32)>,
}

impl Ranked {
    /// A greedy row: `logits` processed (its argmax is `chosen`), the
    /// probabilities those of softmax(logits) at temperature 1, the
    /// draft's own confidence (the greedy q is one-hot and says nothing).
    /// At most `n` alternatives. A row without a finite logit has none.
    pub(crate) fn from_logits(logits: &[f32], chosen: u32, n: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return Self {
                chosen: 1.0,
                alts: Vec::new(),
            };
        }
        // One exp per vocabulary entry: f32 exps (a real vocabulary is
        // ~150k rows per position), summed in f64 so the total stays exact
        // enough to compare with a threshold.
        let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
        let prob = |l: f32| (f64::from((l - max).exp()) / sum) as f32;
        let alts = top_n(logits, n + 1, f32::NEG_INFINITY)
            .into_iter()
            .filter(|&(t, _)| t != chosen)
            .map(|(t, l)| (t, prob(l)))
            .filter(|&(_, p)| p > 0.0)
            .take(n)
            .collect();
        Self {
            chosen: logits.get(chosen as usize).map_or(0.0, |&l| prob(l)),
            alts,
        }
    }

    /// A sampled row: `q` the processed, warped distribution `chosen` was
    /// drawn from. At most `n` alternatives.
    pub(crate) fn from_probs(q: &[f32], chosen: u32, n: usize) -> Self {
        let top = top_n(q, n + 1, 0.0);
        Self {
            chosen: q.get(chosen as usize).copied().unwrap_or(0.0),
            alts: top
                .into_iter()
                .filter(|&(t, _)| t != chosen)
                .take(n)
                .collect(),
        }
    }
}

/// The `n` largest values above `floor` with their indices, highest first,
/// equal values by lower index (NaN never counts).
fn top_n(values: &[f32], n: usize, floor: f32) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (i, &v) in values.iter().enumerate() {
        if v.is_nan() || v <= floor || (top.len() == n && v <= top[n - 1].1) {
            continue;
        }
        // After the equal ones: an earlier index keeps its rank.
        let at = top.partition_point(|&(_, w)| w >= v);
        top.insert(at, (i as u32, v));
        top.truncate(n);
    }
    top
}

/// Leaves for a chain whose position `p` ranked as `positions[p]`: at most
/// `budget` of them, as `(token, parent)` with parent the chain node before
/// the position (`None` at position 0), in the order the module doc's rule
/// picks them (acceptance tries siblings in this order, after the chain's
/// token). Positions whose chain token has probability at least
/// `unsure_below` get none.
pub(crate) fn leaves(
    positions: &[Ranked],
    budget: usize,
    unsure_below: f32,
) -> Vec<(u32, Option<usize>)> {
    let mut out = Vec::new();
    if budget == 0 {
        return out;
    }
    // What each position offers so far: the chain's token.
    let mut covered: Vec<f32> = positions.iter().map(|r| r.chosen).collect();
    let mut order: Vec<usize> = (0..positions.len())
        .filter(|&p| covered[p] < unsure_below)
        .collect();
    // Stable: among equally unsure positions the earlier (likelier to be
    // reached) first.
    order.sort_by(|&a, &b| covered[a].total_cmp(&covered[b]));
    for round in 0.. {
        let mut added = false;
        for &p in &order {
            let Some(&(token, prob)) = positions[p].alts.get(round) else {
                continue;
            };
            if covered[p] >= unsure_below {
                continue;
            }
            if out.len() == budget {
                return out;
            }
            out.push((token, p.checked_sub(1)));
            covered[p] += prob;
            added = true;
        }
        if !added {
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranked(chosen: f32, alts: &[(u32, f32)]) -> Ranked {
        Ranked {
            chosen,
            alts: alts.to_vec(),
        }
    }

    #[test]
    fn most_unsure_positions_first_one_leaf_per_round() {
        let pos = [
            ranked(0.9, &[(1, 0.05)]),
            ranked(0.5, &[(7, 0.3), (8, 0.1), (9, 0.05)]),
            ranked(0.3, &[(4, 0.25), (5, 0.2), (6, 0.1)]),
        ];
        // Position 2 (0.3) before 1 (0.5); position 1 is covered after one
        // leaf (0.5 + 0.3 >= 0.8), position 2 after three; position 0 is
        // sure and gets none.
        let all = vec![(4, Some(1)), (7, Some(0)), (5, Some(1)), (6, Some(1))];
        assert_eq!(leaves(&pos, 10, 0.8), all);
        for b in 0..all.len() {
            assert_eq!(leaves(&pos, b, 0.8), all[..b], "budget {b}");
        }
        assert!(leaves(&pos, 10, 0.0).is_empty(), "0 never branches");
        // Above 1 every alternative is offered, position 0's too.
        assert_eq!(leaves(&pos, 20, 1.5).len(), 7);
        assert_eq!(leaves(&pos, 20, 1.5)[2], (1, None));
    }

    #[test]
    fn a_sampled_chain_token_that_is_not_the_top_leaves_the_top_as_a_leaf() {
        // q: token 2 is the most likely (0.6), the chain drew token 3.
        let q = [0.1, 0.0, 0.6, 0.3];
        let r = Ranked::from_probs(&q, 3, 3);
        assert_eq!(
            r,
            Ranked {
                chosen: 0.3,
                alts: vec![(2, 0.6), (0, 0.1)] // never the zero
            }
        );
        // Covered 0.3 + 0.6 >= 0.8 after the first leaf.
        assert_eq!(leaves(&[r], 5, 0.8), vec![(2, None)]);
        assert_eq!(Ranked::from_probs(&q, 2, 1).alts, vec![(3, 0.3)]);
        // Sure of token 0 (0.9), but the chain drew token 1: token 0 is
        // offered beside it.
        let r = Ranked::from_probs(&[0.9, 0.05, 0.05], 1, 2);
        assert_eq!(leaves(&[r], 5, 0.8), vec![(0, None)]);
        // The chain drew the sure token: nothing.
        let r = Ranked::from_probs(&[0.9, 0.05, 0.05], 0, 2);
        assert!(leaves(&[r], 5, 0.8).is_empty());
    }

    #[test]
    fn greedy_rows_rank_by_logit_with_softmax_probabilities() {
        let l = [1.0, 3.0, 3.0, f32::NEG_INFINITY, 2.0];
        let r = Ranked::from_logits(&l, 1, 3);
        let z: f32 = [1.0f32, 3.0, 3.0, 2.0]
            .iter()
            .map(|x| (x - 3.0).exp())
            .sum();
        let p = |x: f32| (x - 3.0).exp() / z;
        // Token 2 ties the argmax 1 and ranks next (higher id); -inf
        // (a grammar's mask) is never offered.
        let ids: Vec<u32> = r.alts.iter().map(|a| a.0).collect();
        assert_eq!(ids, vec![2, 4, 0]);
        for (&(_, got), want) in r.alts.iter().zip([p(3.0), p(2.0), p(1.0)]) {
            assert!((got - want).abs() < 1e-6);
        }
        assert!((r.chosen - p(3.0)).abs() < 1e-6);
        assert_eq!(Ranked::from_logits(&l, 1, 1).alts.len(), 1);
        let none = Ranked::from_logits(&[f32::NEG_INFINITY; 3], 0, 2);
        assert!(none.alts.is_empty() && leaves(&[none], 4, 0.8).is_empty());
    }

    #[test]
    fn top_n_keeps_the_first_of_equal_values() {
        let v = [0.5, 0.2, 0.5, f32::NAN, 0.9, 0.2];
        assert_eq!(top_n(&v, 3, 0.0), vec![(4, 0.9), (0, 0.5), (2, 0.5)]);
        assert_eq!(top_n(&v, 5, 0.0)[3..], [(1, 0.2), (5, 0.2)]);
        assert!(top_n(&v, 0, 0.0).is_empty());
    }
}
