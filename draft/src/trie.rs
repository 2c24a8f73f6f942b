//! A token trie grown around a fixed main chain, for the lookup proposers
//! (n-gram and the cross-request pool) that offer several matched
//! continuations as one [`Proposal`] tree.
//!
//! Continuations are inserted best first; each is walked from the root
//! along existing nodes and, where it diverges, the rest becomes new branch
//! nodes, so siblings never repeat a token and every node's path is a
//! prefix of some inserted continuation. The chain itself is never
//! changed, and the branch count never exceeds the budget.

use crate::Proposal;

/// A [`Proposal`] under construction: the chain plus branches added so far.
///
/// Invariants: `branches.len() <= budget`; every branch's parent is an
/// earlier node; no two children of one node (or of the root) share a
/// token.
pub(crate) struct Trie {
    proposal: Proposal,
    budget: usize,
}

impl Trie {
    /// A trie holding only `chain` (deterministic: q `None`), which may
    /// gain at most `budget` branch nodes.
    pub(crate) fn new(chain: Vec<u32>, budget: usize) -> Self {
        Self {
            proposal: Proposal::chain(chain, None),
            budget,
        }
    }

    /// Whether no further branch node fits the budget.
    pub(crate) fn is_full(&self) -> bool {
        self.proposal.branches.len() >= self.budget
    }

    /// The child of `parent` (`None`: the root) holding `token`, if any.
    fn child(&self, parent: Option<usize>, token: u32) -> Option<usize> {
        let p = &self.proposal;
        let chain_next = parent.map_or(0, |n| n + 1);
        let on_chain = parent.is_none_or(|n| n < p.tokens.len());
        if on_chain && p.tokens.get(chain_next) == Some(&token) {
            return Some(chain_next);
        }
        p.branches
            .iter()
            .position(|&(t, par)| t == token && par == parent)
            .map(|j| p.tokens.len() + j)
    }

    /// Adds `path` (a continuation of the root) to the trie: its tokens
    /// follow existing nodes while they match and become new branch nodes
    /// from where it diverges, until the budget is spent (the rest of the
    /// path is then dropped: a node needs its parent).
    pub(crate) fn insert(&mut self, path: &[u32]) {
        let mut at = None;
        for &token in path {
            at = Some(match self.child(at, token) {
                Some(c) => c,
                None if self.is_full() => return,
                None => {
                    self.proposal.branches.push((token, at));
                    self.proposal.nodes() - 1
                }
            });
        }
    }

    /// The finished proposal.
    pub(crate) fn into_proposal(self) -> Proposal {
        self.proposal
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_share_prefixes_and_branch_where_they_diverge() {
        let mut t = Trie::new(vec![1, 2, 3], 10);
        t.insert(&[1, 2, 3]); // the chain itself: nothing new
        t.insert(&[1, 5, 6]); // diverges under node 0
        t.insert(&[1, 5, 7]); // shares 1 -> 5 (node 3), diverges there
        t.insert(&[9]); // a second child of the root
        t.insert(&[1, 2, 3, 4]); // extends the chain's leaf
        let p = t.into_proposal();
        assert_eq!(p.tokens, vec![1, 2, 3]);
        assert_eq!(
            p.branches,
            vec![
                (5, Some(0)),
                (6, Some(3)),
                (7, Some(3)),
                (9, None),
                (4, Some(2))
            ]
        );
        p.tree().unwrap();
    }

    #[test]
    fn the_budget_cuts_a_path_and_keeps_its_prefix() {
        let mut t = Trie::new(vec![1, 2], 2);
        t.insert(&[3, 4, 5]);
        assert!(t.is_full());
        t.insert(&[1, 2]);
        t.insert(&[6]);
        let p = t.into_proposal();
        assert_eq!(p.branches, vec![(3, None), (4, Some(2))]);
        let mut t = Trie::new(vec![1, 2], 0);
        t.insert(&[3]);
        assert!(t.into_proposal().branches.is_empty());
    }
}
