//! Where a model draft branches: per chain position, how the draft ranks
//! the tokens it did not choose ([`Ranked`]), and which of them become
//! sibling leaves of the chain under a node budget ([`leaves`]).
//!
//! The rule: a position is unsure when the draft's most likely token there
//! has probability below a threshold. Unsure positions are served one leaf
//! per position per round, each leaf being the position's next most likely
//! token that is not the chain's; a position takes leaves while the tokens
//! it already offers (the chain's and its leaves) cover less than the
//! threshold of its probability.
//!
//! # Why a sampled chain branches on the draft's distribution only
//! Acceptance verifies a position with one child by the q rule (the child
//! was drawn from q) and a position with several by the deterministic rule
//! (exact for any candidate list). The q rule is exact only if the child
//! is a draw from q *unconditionally*: were the choice of rule to depend on
//! the token drawn there (say, branch only where the drawn token is
//! unlikely), the q rule would see a biased draw. Worked case: q(a) = 0.9,
//! target p(a) = 0.5; branching only when the chain did not draw a emits a
//! with probability 0.9 * 0.5/0.9 + 0.1 * 0.5 = 0.55, not 0.5. So for a
//! sampled chain whether a position branches is decided from its q alone
//! (top probability below the threshold) and first leaves go in position
//! order (a later position's draw never takes an earlier one's leaf);
//! after that, how many leaves a position gets and which may depend on
//! anything (the deterministic rule holds for any list). A greedy chain
//! (the walk takes the argmax, no q rule) is served most unsure first,
//! which spends the budget where a miss is likeliest.

/// How one drafted row ranks its tokens.
///
/// Invariant: `alts` is sorted by probability, highest first (equal ones
/// by token id, as [`specgate_verify::sample::argmax`] breaks ties), holds
/// only tokens of probability > 0 and never the chain's token.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Ranked {
    /// Probability of the token the chain took there.
    chosen: f32,
    /// Probability of the row's most likely token: the position is unsure
    /// when this is below the threshold.
    top: f32,
    /// Whether the chain's token was drawn from this row's q (sampled).
    drawn: bool,
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
                top: 1.0,
                drawn: false,
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
            top: prob(max),
            drawn: false,
            alts,
        }
    }

    /// A sampled row: `q` the processed, warped distribution `chosen` was
    /// drawn from. At most `n` alternatives.
    pub(crate) fn from_probs(q: &[f32], chosen: u32, n: usize) -> Self {
        let top = top_n(q, n + 1, 0.0);
        Self {
            chosen: q.get(chosen as usize).copied().unwrap_or(0.0),
            top: top.first().map_or(1.0, |&(_, p)| p),
            drawn: true,
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
/// token). Positions whose most likely token has probability at least
/// `unsure_below` get none.
///
/// Invariant (what keeps a sampled chain's acceptance exact, see the
/// module doc): when the rows were drawn, whether position p gets a leaf
/// depends only on the rows' `top` at positions up to p, never on which
/// tokens were drawn there or later.
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
        .filter(|&p| positions[p].top < unsure_below)
        .collect();
    if !positions.iter().any(|r| r.drawn) {
        // Greedy: most unsure first; stable, so among equally unsure
        // positions the earlier (likelier to be reached) first.
        order.sort_by(|&a, &b| positions[a].top.total_cmp(&positions[b].top));
    }
    for round in 0.. {
        let mut added = false;
        for &p in &order {
            let Some(&(token, prob)) = positions[p].alts.get(round) else {
                continue;
            };
            // The first leaf goes to every unsure position (its alts are
            // not empty: its top is below 1); more while it covers less
            // than the threshold.
            if round > 0 && covered[p] >= unsure_below {
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

    /// A greedy row: the chain took the top token.
    fn ranked(chosen: f32, alts: &[(u32, f32)]) -> Ranked {
        Ranked {
            chosen,
            top: chosen,
            drawn: false,
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
                top: 0.6,
                drawn: true,
                alts: vec![(2, 0.6), (0, 0.1)] // never the zero
            }
        );
        // Covered 0.3 + 0.6 >= 0.8 after the first leaf.
        assert_eq!(leaves(&[r], 5, 0.8), vec![(2, None)]);
        assert_eq!(Ranked::from_probs(&q, 2, 1).alts, vec![(3, 0.3)]);
        // The draft is sure of token 0 (0.9): no leaf, whichever token the
        // chain drew (branching only where the draw was unlikely would
        // bias the q rule, see the module doc).
        for drew in 0..3 {
            let r = Ranked::from_probs(&[0.9, 0.05, 0.05], drew, 2);
            assert!(leaves(&[r], 5, 0.8).is_empty(), "drew {drew}");
        }
    }

    /// Whether each position of a sampled chain gets a leaf, for every
    /// choice of drawn tokens: it must never depend on the draws.
    #[test]
    fn a_sampled_chains_branching_never_depends_on_its_draws() {
        let rows: [&[f32]; 3] = [&[0.5, 0.3, 0.2], &[0.85, 0.1, 0.05], &[0.4, 0.4, 0.2]];
        for budget in 0..6 {
            let mut seen: Option<Vec<bool>> = None;
            for draws in 0..27u32 {
                let ranks: Vec<Ranked> = rows
                    .iter()
                    .enumerate()
                    .map(|(i, q)| Ranked::from_probs(q, draws / 3u32.pow(i as u32) % 3, 2))
                    .collect();
                let got = leaves(&ranks, budget, 0.8);
                let branched: Vec<bool> = (0..rows.len())
                    .map(|p| got.iter().any(|&(_, parent)| parent == p.checked_sub(1)))
                    .collect();
                match &seen {
                    None => seen = Some(branched),
                    Some(s) => assert_eq!(s, &branched, "budget {budget}, draws {draws}"),
                }
            }
            // Position order: with one leaf it goes to position 0 (a
            // greedy chain would serve position 2, the least sure, first).
            if budget == 1 {
                assert_eq!(seen.unwrap(), vec![true, false, false]);
            }
        }
        let greedy = [
            ranked(0.5, &[(1, 0.3)]),
            ranked(0.85, &[(1, 0.1)]),
            ranked(0.4, &[(1, 0.4)]),
        ];
        assert_eq!(leaves(&greedy, 1, 0.8), vec![(1, Some(1))]);
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
