//! specgate-draft: proposers that guess the next k tokens of sequences
//! cheaply, for the verifier to check in one forward pass, and the policy
//! that picks k.
//!
//! A proposal carries, per guessed token, the proposer's warped probability
//! distribution q (needed for lossless acceptance at temperature > 0); a
//! proposer without a model (n-gram lookup) proposes deterministically, so
//! its q is one-hot and is represented as `None`. A model proposer processes
//! its logits with the sequence's own [`Sampler`] (penalties, bias,
//! min_tokens, grammar) before warping, so q is the same function of the
//! history as the target's p.

mod blocks;
pub mod cost;
pub mod guard;
mod leaves;
pub mod model;
pub mod ngram;
pub mod policy;
pub mod suffix;
pub mod tree_shape;
mod trie;

pub use cost::{CostCurve, CostModel};
pub use guard::ModelGuard;
pub use model::{DraftChunk, ModelDraft};
pub use ngram::NgramProposer;
pub use policy::{DraftPolicy, PolicyState, StepLimits, StepPlan, StepSeq};
pub use suffix::{SuffixConfig, SuffixMatch, SuffixPool};
pub use tree_shape::{plan_widths, BranchSeq, WidthPlan, WidthStep};

use specgate_verify::tree_accept::{TokenTree, TreeError};
use specgate_verify::{Sampler, VerifyError};

/// Guessed continuation of one sequence: a main chain, and optionally
/// other candidates branching off it (a token tree, verified in the same
/// pass; see [`specgate_verify::tree_accept`]).
///
/// Tree nodes are numbered chain first: node `i < tokens.len()` is
/// `tokens[i]` (its parent the node before it, the root for node 0), and
/// node `tokens.len() + j` is `branches[j]`.
///
/// Invariants: when `q` is `Some`, it has one distribution per chain token
/// (`q[i]` is what `tokens[i]` was drawn from); every branch's parent is
/// an earlier node (`None`: the root, the last committed token).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// The proposer's warped distribution for each chain token; `None` =
    /// one-hot.
    pub q: Option<Vec<Vec<f32>>>,
    /// How many of the last `tokens` a grammar forced (jump-forward), added
    /// after the proposer answered; 0 from a proposer itself.
    pub forced: usize,
    /// Other candidates, `(token, parent node)`: never a duplicate of a
    /// sibling's token. Empty for a chain.
    pub branches: Vec<(u32, Option<usize>)>,
}

impl Proposal {
    /// A chain proposal (no branches).
    pub fn chain(tokens: Vec<u32>, q: Option<Vec<Vec<f32>>>) -> Self {
        Self {
            tokens,
            q,
            forced: 0,
            branches: Vec::new(),
        }
    }

    /// Every drafted node: the chain and the branches.
    pub fn nodes(&self) -> usize {
        self.tokens.len() + self.branches.len()
    }

    /// Cuts the chain to its first `chain_len` tokens (and their q), drops
    /// the branches that hang (directly or not) under a cut chain node or
    /// a dropped branch, and keeps at most `max` of the others (earliest
    /// first), renumbering their parents (see [`Proposal::rehang`]).
    pub fn cut(&mut self, chain_len: usize, max: usize) {
        let old_chain = self.tokens.len();
        let chain_len = chain_len.min(old_chain);
        self.tokens.truncate(chain_len);
        if let Some(q) = self.q.as_mut() {
            q.truncate(chain_len);
        }
        self.rehang(old_chain, chain_len, max, |_| true);
    }

    /// Hangs the branches back on a chain that changed under them (a
    /// grammar cut it and appended forced tokens): the branches' parents
    /// are numbered against a chain of `old_chain` tokens, of which the
    /// current chain keeps the first `kept` (what follows them is new).
    /// Drops the branches under an old chain node past `kept`, those that
    /// repeat their chain sibling's token (forced tokens can), those
    /// `admit` refuses (it gets the node's whole path from the root, the
    /// node's token last), and whatever hangs under a dropped one; keeps
    /// at most `max` of the rest, earliest first; renumbers their parents
    /// against the current chain.
    ///
    /// Invariant kept (what keeps sampled acceptance exact whatever the
    /// dropping depended on): a chain position that had siblings and lost
    /// them all gets a one-hot q row at its token, so it is verified as a
    /// deterministic candidate, as it would have been with its siblings,
    /// and never by the q rule.
    pub fn rehang(
        &mut self,
        old_chain: usize,
        kept: usize,
        max: usize,
        mut admit: impl FnMut(&[u32]) -> bool,
    ) {
        let chain_len = self.tokens.len();
        let kept = kept.min(old_chain).min(chain_len);
        // The chain position a branch is a sibling at, if any.
        let sibling_at = |parent: Option<usize>, chain: usize| match parent {
            None if chain > 0 => Some(0),
            Some(p) if p + 1 < chain => Some(p + 1),
            _ => None,
        };
        let old = std::mem::take(&mut self.branches);
        let mut had = vec![false; chain_len];
        for &(_, parent) in &old {
            if let Some(i) = sibling_at(parent, old_chain).filter(|&i| i < kept) {
                had[i] = true;
            }
        }
        // Per old branch node: its new index and path, when kept.
        let mut kept_at: Vec<Option<(usize, Vec<u32>)>> = Vec::with_capacity(old.len());
        for &(token, parent) in &old {
            let placed = match parent {
                None => Some((None, Vec::new())),
                Some(p) if p < old_chain => {
                    (p < kept).then(|| (Some(p), self.tokens[..=p].to_vec()))
                }
                Some(p) => kept_at
                    .get(p - old_chain)
                    .and_then(Option::as_ref)
                    .map(|(at, path)| (Some(*at), path.clone())),
            };
            let node = placed.and_then(|(new_parent, mut path)| {
                path.push(token);
                // Where forced tokens now continue the chain, a branch may
                // repeat its new chain sibling: the same node, dropped.
                let repeats =
                    sibling_at(new_parent, chain_len).is_some_and(|i| self.tokens[i] == token);
                (!repeats && self.branches.len() < max && admit(&path)).then(|| {
                    self.branches.push((token, new_parent));
                    (chain_len + self.branches.len() - 1, path)
                })
            });
            kept_at.push(node);
        }
        if let Some(q) = self.q.as_mut() {
            let mut has = vec![false; chain_len];
            for &(_, parent) in &self.branches {
                if let Some(i) = sibling_at(parent, chain_len) {
                    has[i] = true;
                }
            }
            for (i, row) in q.iter_mut().enumerate() {
                if had[i] && !has[i] {
                    let width = row.len();
                    *row = vec![0.0; width];
                    if let Some(x) = row.get_mut(self.tokens[i] as usize) {
                        *x = 1.0;
                    }
                }
            }
        }
    }

    /// The proposal as a [`TokenTree`] (chain nodes first).
    ///
    /// Errors: a branch whose parent is not an earlier node.
    pub fn tree(&self) -> Result<TokenTree, TreeError> {
        TokenTree::from_nodes(
            self.tokens
                .iter()
                .enumerate()
                .map(|(i, &t)| (t, i.checked_sub(1)))
                .chain(self.branches.iter().copied()),
        )
    }
}

/// One sequence asking for drafts.
pub struct ProposeRequest<'a> {
    /// Stable id of the sequence, for a proposer's per-sequence state.
    pub seq_id: u64,
    /// Every accepted token so far: prompt + output.
    pub context: &'a [u32],
    /// The sequence's KV blocks; a model proposer writes its own cache at
    /// the same block ids. Must cover `context.len() + k` positions.
    pub block_table: &'a [u32],
    /// Chain tokens wanted; 0 asks for none.
    pub k: usize,
    /// Branch nodes the proposer may add besides the chain (0: a chain).
    pub branches: usize,
    /// The sequence's sampler: its processing state and params make q, its
    /// random stream draws. A proposer must not commit to it.
    pub sampler: &'a mut Sampler,
}

/// Errors of proposers.
#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error("draft model failed: {0}")]
    Model(#[from] VerifyError),
    #[error("draft model does not fit the target: {0}")]
    Incompatible(String),
}

/// Something that proposes draft tokens for a batch of sequences.
pub trait Proposer: Send {
    /// Proposes at most `k` tokens for each request, in request order. May
    /// return fewer, or none, when it has no good guess.
    fn propose(&mut self, batch: &mut [ProposeRequest]) -> Result<Vec<Proposal>, DraftError>;

    /// The sequence ended: drop whatever state was kept for it.
    fn release(&mut self, _seq_id: u64) {}
}

impl Proposer for NgramProposer {
    fn propose(&mut self, batch: &mut [ProposeRequest]) -> Result<Vec<Proposal>, DraftError> {
        Ok(batch
            .iter()
            .map(|r| self.lookup_tree(r.context, r.k, r.branches))
            .collect())
    }
}

#[cfg(test)]
mod proposal_tests {
    use super::*;

    /// Chain 10 11 12; branches: 20 beside 10 (node 3), 21 under 20 (node
    /// 4), 22 beside 12 (node 5), 23 under chain node 12 (node 6, a leaf
    /// below the chain's end).
    fn sample(q: bool) -> Proposal {
        Proposal {
            tokens: vec![10, 11, 12],
            q: q.then(|| vec![vec![1.0 / 32.0; 32]; 3]),
            forced: 0,
            branches: vec![(20, None), (21, Some(3)), (22, Some(1)), (23, Some(2))],
        }
    }

    #[test]
    fn cut_drops_what_hangs_under_cut_nodes_and_renumbers() {
        let mut p = sample(false);
        p.cut(2, 10);
        assert_eq!(p.tokens, vec![10, 11]);
        // 21's parent was node 3 of a 3-chain: now node 2 of a 2-chain.
        assert_eq!(p.branches, vec![(20, None), (21, Some(2)), (22, Some(1))]);
        assert!(p.tree().is_ok());
        let mut p = sample(false);
        p.cut(3, 1);
        assert_eq!(p.branches, vec![(20, None)]);
        let mut p = sample(false);
        p.cut(0, 10);
        // Only what hangs under the root survives.
        assert_eq!(p.branches, vec![(20, None), (21, Some(0))]);
    }

    #[test]
    fn rehang_sees_whole_paths_and_drops_subtrees_of_refused_nodes() {
        let mut p = sample(false);
        let mut seen = Vec::new();
        p.rehang(3, 3, 10, |path| {
            seen.push(path.to_vec());
            path.last() != Some(&20)
        });
        // 20 refused: 21 (under it) is never asked about.
        assert_eq!(seen, vec![vec![20], vec![10, 11, 22], vec![10, 11, 12, 23]]);
        assert_eq!(p.branches, vec![(22, Some(1)), (23, Some(2))]);
        assert!(p.tree().is_ok());
    }

    #[test]
    fn rehang_on_a_chain_with_forced_tokens_renumbers_branch_parents() {
        // A grammar kept 10 11, dropped 12 and forced 30 31 after them.
        let mut p = sample(false);
        p.tokens = vec![10, 11, 30, 31];
        p.rehang(3, 2, 10, |_| true);
        // 23 hung under the dropped 12; 21 under 20, now node 4.
        assert_eq!(p.branches, vec![(20, None), (21, Some(4)), (22, Some(1))]);
        let t = p.tree().unwrap();
        assert_eq!(t.len(), 7);
        // A forced token equal to a branch beside it: the branch goes.
        let mut p = sample(false);
        p.tokens = vec![10, 11, 22];
        p.rehang(3, 2, 10, |_| true);
        assert_eq!(p.branches, vec![(20, None), (21, Some(3))]);
        assert!(p.tree().is_ok());
    }

    #[test]
    fn a_position_that_loses_every_sibling_gets_a_one_hot_q() {
        let mut p = sample(true);
        // Refuse 20 (position 0's only sibling); keep 22 (position 2's).
        p.rehang(3, 3, 10, |path| path.last() != Some(&20));
        let q = p.q.as_ref().unwrap();
        let mut one_hot = vec![0.0; 32];
        one_hot[10] = 1.0;
        assert_eq!(q[0], one_hot);
        assert_eq!(q[1], vec![1.0 / 32.0; 32], "never had a sibling: q kept");
        assert_eq!(q[2], vec![1.0 / 32.0; 32], "still has its sibling: q kept");
        let mut p = Proposal {
            tokens: vec![1, 2],
            q: Some(vec![vec![0.25; 4]; 2]),
            forced: 0,
            branches: vec![(3, Some(0))],
        };
        p.cut(2, 0);
        assert_eq!(p.q.unwrap()[1], vec![0.0, 0.0, 1.0, 0.0]);
    }
}
