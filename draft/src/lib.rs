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
    /// first), renumbering their parents.
    pub fn cut(&mut self, chain_len: usize, max: usize) {
        let old_chain = self.tokens.len();
        let chain_len = chain_len.min(old_chain);
        self.tokens.truncate(chain_len);
        if let Some(q) = self.q.as_mut() {
            q.truncate(chain_len);
        }
        // New index of each old branch node that survives.
        let mut kept_at: Vec<Option<usize>> = Vec::with_capacity(self.branches.len());
        let mut kept = Vec::new();
        for &(token, parent) in &self.branches {
            let new_parent = match parent {
                None => Some(None),
                Some(p) if p < old_chain => (p < chain_len).then_some(Some(p)),
                Some(p) => kept_at.get(p - old_chain).copied().flatten().map(Some),
            };
            match new_parent {
                Some(np) if kept.len() < max => {
                    kept_at.push(Some(chain_len + kept.len()));
                    kept.push((token, np));
                }
                _ => kept_at.push(None),
            }
        }
        self.branches = kept;
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
