//! N-gram prompt lookup: find the most recent earlier occurrence of the
//! sequence's last n tokens (longest n first, from `max_n` down to `min_n`)
//! and propose the tokens that followed it. No model, no allocation beyond
//! the returned tokens; cost is a backwards scan of the context.
//!
//! [`NgramProposer::lookup_tree`] offers the other earlier matches too: the
//! same chain, plus the continuations of further matches as a trie of
//! branches where they diverge from it (a deterministic token tree).

use crate::trie::Trie;
use crate::Proposal;

/// Prompt-lookup proposer.
///
/// Invariant: `1 <= min_n <= max_n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramProposer {
    min_n: usize,
    max_n: usize,
}

impl NgramProposer {
    /// Errors when `min_n` is 0 or greater than `max_n`.
    pub fn new(min_n: usize, max_n: usize) -> Result<Self, String> {
        if min_n == 0 || min_n > max_n {
            return Err(format!(
                "n-gram sizes need 1 <= min ({min_n}) <= max ({max_n})"
            ));
        }
        Ok(Self { min_n, max_n })
    }

    /// The tokens that followed the latest earlier match of the context's
    /// suffix, at most `k` of them.
    pub fn lookup<'a>(&self, context: &'a [u32], k: usize) -> &'a [u32] {
        if k == 0 {
            return &[];
        }
        let len = context.len();
        for n in (self.min_n..=self.max_n.min(len.saturating_sub(1))).rev() {
            let suffix = &context[len - n..];
            // Latest match first; a match must end before the suffix starts
            // so that at least one token follows it.
            for start in (0..len - n).rev() {
                if &context[start..start + n] == suffix {
                    let from = start + n;
                    return &context[from..(from + k).min(len)];
                }
            }
        }
        &[]
    }

    /// The tree of continuations of the context's earlier suffix matches:
    /// the chain is exactly [`lookup`](Self::lookup)`(context, k)`, and up
    /// to `branches` branch nodes come from the continuations (at most `k`
    /// tokens each, so no node is deeper than `k`) of the other matches, in
    /// lookup's order (longest n first, then most recent first), each
    /// inserted as a trie path under the node where it diverges from what
    /// is already there. A continuation may run past the chain's end (the
    /// chain stops at the context's end, an older match's need not). Q is
    /// `None`. With `branches == 0` this is `lookup` as a chain.
    ///
    /// Cost: without branches that of `lookup`; with them, the scan goes on
    /// over every n and start until the budget is spent (at worst
    /// `O(len * max_n^2)` comparisons, the same bound as a failed lookup),
    /// plus a trie walk of at most `k * (k + branches)` steps per match.
    pub fn lookup_tree(&self, context: &[u32], k: usize, branches: usize) -> Proposal {
        let chain = self.lookup(context, k).to_vec();
        if branches == 0 || chain.is_empty() {
            return Proposal::chain(chain, None);
        }
        let len = context.len();
        let mut trie = Trie::new(chain, branches);
        // Continuation starts already inserted: a shorter n matching at the
        // same place as a longer one continues identically.
        let mut seen: Vec<usize> = Vec::new();
        for n in (self.min_n..=self.max_n.min(len.saturating_sub(1))).rev() {
            let suffix = &context[len - n..];
            for start in (0..len - n).rev() {
                let from = start + n;
                if &context[start..from] != suffix || seen.contains(&from) {
                    continue;
                }
                seen.push(from);
                trie.insert(&context[from..(from + k).min(len)]);
                if trie.is_full() {
                    return trie.into_proposal();
                }
            }
        }
        trie.into_proposal()
    }
}

impl Default for NgramProposer {
    fn default() -> Self {
        Self { min_n: 1, max_n: 4 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_longest_latest_match() {
        let p = NgramProposer::new(1, 3).unwrap();
        // suffix [7, 8, 9] occurred at 1..4, followed by 10, 11.
        let ctx = [1, 7, 8, 9, 10, 11, 5, 8, 9, 12, 7, 8, 9];
        assert_eq!(p.lookup(&ctx, 2), &[10, 11]);
        // k longer than what follows: stops at the context end.
        assert_eq!(p.lookup(&ctx, 50), &[10, 11, 5, 8, 9, 12, 7, 8, 9]);
        assert_eq!(p.lookup(&ctx, 0), &[] as &[u32]);
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_latest_occurrence() {
        let p = NgramProposer::new(1, 4).unwrap();
        // Only the 1-gram [3] repeats; its latest earlier occurrence is at 4.
        let ctx = [3, 1, 2, 0, 3, 4, 5, 3];
        assert_eq!(p.lookup(&ctx, 2), &[4, 5]);
        // min_n = 2 refuses the 1-gram.
        assert!(NgramProposer::new(2, 4).unwrap().lookup(&ctx, 2).is_empty());
    }

    #[test]
    fn no_match_and_tiny_contexts_propose_nothing() {
        let p = NgramProposer::default();
        assert!(p.lookup(&[], 4).is_empty());
        assert!(p.lookup(&[1], 4).is_empty());
        assert!(p.lookup(&[1, 2, 3, 4], 4).is_empty());
        assert_eq!(p.lookup(&[1, 1], 4), &[1]);
    }

    /// Depth of every node (1 for the root's children).
    fn depths(p: &Proposal) -> Vec<usize> {
        let t = p.tree().unwrap();
        (0..t.len()).map(|i| t.depth(i)).collect()
    }

    /// No two children of one node share a token.
    fn assert_distinct_siblings(p: &Proposal) {
        let t = p.tree().unwrap();
        for parent in std::iter::once(None).chain((0..t.len()).map(Some)) {
            let mut toks: Vec<u32> = t.children(parent).iter().map(|&c| t.token(c)).collect();
            let n = toks.len();
            toks.sort_unstable();
            toks.dedup();
            assert_eq!(toks.len(), n, "repeated sibling under {parent:?}: {p:?}");
        }
    }

    #[test]
    fn tree_branches_follow_other_matches_in_lookup_order() {
        let p = NgramProposer::new(1, 3).unwrap();
        // Suffix [8, 9] (no 3-gram match): the 2-gram matches, latest
        // first, at 11..13 (-> 20, 21, 40: the chain), at 6..8 (-> 30, 31,
        // 5) and at 1..3 (-> 20, 21, 22); the 1-gram [9] adds the one at 16
        // (-> 50, 3, 8), the others continuing where 2-grams did.
        let ctx = [
            0, 8, 9, 20, 21, 22, 8, 9, 30, 31, 5, 8, 9, 20, 21, 40, 9, 50, 3, 8, 9,
        ];
        assert_eq!(p.lookup(&ctx, 3), &[20, 21, 40]);
        let t = p.lookup_tree(&ctx, 3, 10);
        assert_eq!(t.tokens, vec![20, 21, 40]);
        assert_eq!(t.q, None);
        // 30, 31, 5 branches at the root; 20, 21, 22 shares 20, 21 and
        // branches under node 1; the 1-gram's 50, 3, 8 comes after every
        // 2-gram though it is the most recent.
        let all = vec![
            (30, None),
            (31, Some(3)),
            (5, Some(4)),
            (22, Some(1)),
            (50, None),
            (3, Some(7)),
            (8, Some(8)),
        ];
        assert_eq!(t.branches, all);
        // The budget keeps the first nodes in that order and cuts a path.
        for b in 0..all.len() {
            assert_eq!(p.lookup_tree(&ctx, 3, b).branches, all[..b], "budget {b}");
        }
        // Depth never exceeds k: at k = 1 only the first tokens remain.
        let t1 = p.lookup_tree(&ctx, 1, 10);
        assert_eq!(t1.tokens, vec![20]);
        assert_eq!(t1.branches, vec![(30, None), (50, None)]);
        assert_distinct_siblings(&t);
    }

    #[test]
    fn tree_depth_is_at_most_k_and_the_budget_holds() {
        let p = NgramProposer::new(1, 4).unwrap();
        // A repetitive context: many matches with long continuations.
        let ctx: Vec<u32> = (0..200u32).map(|i| (i * i + 3 * i) % 7).collect();
        for k in 1..6 {
            for b in 0..12 {
                let t = p.lookup_tree(&ctx, k, b);
                assert_eq!(t.tokens, p.lookup(&ctx, k), "k {k} b {b}");
                assert!(t.branches.len() <= b);
                assert!(depths(&t).iter().all(|&d| d <= k), "k {k}: {t:?}");
                assert_distinct_siblings(&t);
                // Every node's path occurs in the context right after an
                // earlier occurrence of the context's last token.
                let tree = t.tree().unwrap();
                for i in 0..tree.len() {
                    let mut w = vec![ctx[ctx.len() - 1]];
                    w.extend(tree.path_tokens(i));
                    assert!(ctx.windows(w.len()).any(|x| x == w), "{w:?}");
                }
            }
        }
    }

    #[test]
    fn zero_branches_is_the_plain_lookup() {
        let p = NgramProposer::default();
        let ctx = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2];
        for k in 0..5 {
            assert_eq!(
                p.lookup_tree(&ctx, k, 0),
                Proposal::chain(p.lookup(&ctx, k).to_vec(), None)
            );
        }
        // No match: nothing, however many branches are allowed.
        assert_eq!(p.lookup_tree(&[1, 2, 3], 4, 8), Proposal::default());
        // With branches the other continuations of [1, 2] appear.
        let t = p.lookup_tree(&ctx, 2, 8);
        assert_eq!(t.tokens, vec![5, 1]);
        assert_eq!(
            t.branches,
            vec![(4, None), (1, Some(2)), (3, None), (1, Some(4))]
        );
    }

    #[test]
    fn the_proposer_trait_passes_the_branch_budget() {
        use crate::{ProposeRequest, Proposer};
        use specgate_verify::{Sampler, SamplingParams};
        let mut p = NgramProposer::default();
        let ctx = [1, 2, 3, 1, 2, 4, 1, 2];
        let mut s = Sampler::new(SamplingParams::default());
        for b in [0, 1, 5] {
            let mut batch = [ProposeRequest {
                seq_id: 1,
                context: &ctx,
                block_table: &[],
                k: 3,
                branches: b,
                sampler: &mut s,
            }];
            let got = p.propose(&mut batch).unwrap();
            assert_eq!(got, vec![p.lookup_tree(&ctx, 3, b)]);
        }
    }

    #[test]
    fn bad_sizes_are_rejected() {
        assert!(NgramProposer::new(0, 3).is_err());
        assert!(NgramProposer::new(4, 3).is_err());
    }
}
