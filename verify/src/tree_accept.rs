//! Lossless acceptance over a token tree: several candidate continuations
//! verified in one pass, the longest surviving branch kept.
//!
//! A [`TokenTree`] holds the drafted nodes of one sequence; a node's parent
//! is an earlier node, or the root (the sequence's last committed token).
//! The verify pass scores one target logit row per *position*: row 0 is the
//! position after the last committed token (it scores the root's children),
//! row `1 + i` the position after node `i` (it scores node i's children, or
//! the bonus token when i is a leaf). A chain of k drafts is the tree where
//! every node has one child, and then these rows are exactly the k+1 rows
//! [`crate::accept`] takes; [`accept_tree`] then gives bit for bit what
//! [`accept_sampled`](crate::accept::accept_sampled) gives (same tokens, same
//! random draws consumed, same rows processed).
//!
//! # Per-node processing
//! Acceptance walks from the root down one path. At each position it
//! visits, the row is first processed in place by the sequence's
//! [`Sampler`] with that node's own path (the tokens from the root to it)
//! as the pending history, so penalties, bias, `min_tokens`, the grammar
//! mask and the reported logprobs are those of a sequence that emitted
//! exactly that path, never a sibling's tokens. Rows the walk does not
//! reach are left as they were. Only the emitted tokens are committed.
//! A proposer that supplies q must process its draft rows the same way
//! (each node's q with that node's path pending) and warp them with the
//! same [`crate::SamplingParams`].
//!
//! # The rule, and why the output is the target's distribution
//! Let p be the target's processed, warped distribution at a visited
//! position, and c_1..c_m the tokens of its children, tried in order.
//! - Greedy: move to the first child whose token is argmax(p); when none
//!   is, emit argmax(p) (a correction, or the bonus at a leaf). Every
//!   emitted token is the target's argmax given the tokens before it, so
//!   the output is the target's greedy sequence; the kept path is the
//!   longest drafted path agreeing with it (with distinct siblings it is
//!   unique).
//! - Sampled, q given (children drawn i.i.d. from the draft's q at that
//!   position, SpecInfer's multi-step speculative sampling, Miao et al.
//!   2023): with residual r = p, accept c_j with probability
//!   min(1, r(c_j) / q(c_j)); on rejection r <- normalize(max(0, r - q)).
//!   One round emits x with probability min(r, q)(x) and rejects with
//!   probability beta = sum max(0, r - q); the next round, by induction,
//!   emits from normalize(max(0, r - q)), so in total
//!   min(r, q)(x) + max(0, r - q)(x) = r(x). Rounds are independent
//!   because the candidates are independent draws from q.
//! - Sampled, q None (deterministic candidates: n-gram matches, the
//!   draft's top-k without replacement): accept c_j with probability
//!   r(c_j); on rejection set r(c_j) = 0 and renormalize. Trying c emits c
//!   with probability r(c), and any other x with probability
//!   (1 - r(c)) * r(x) / (1 - r(c)) = r(x): again r, by induction over the
//!   candidates. This is sampling without replacement from a one-hot q, and
//!   for one candidate it is the chain rule with q one-hot. The argument
//!   holds for any candidate list fixed before the target's coins are
//!   drawn, so this rule is also exact for sampled candidates (merged
//!   repeats, a mix of draft and n-gram children), only less often
//!   accepting than the q rule where that one applies.
//! - When every child is rejected the correction is drawn from the
//!   residual, which by the same induction is what remains of p; at a leaf
//!   the bonus is drawn from p itself.
//!
//! So the first emitted token is distributed exactly as p at the root.
//! Given that it is an accepted child c, the walk continues at c's row,
//! processed with c's path, which is the target's distribution given the
//! sequence emitted c: the joint law of all emitted tokens is the target's
//! processed, warped law, whatever the tree's shape (the shape may depend
//! on the draft, never on the acceptance coins at or below it).
//!
//! A rejection that leaves no residual mass only happens through rounding
//! (p <= q everywhere means p == q, which rejects with probability 0); the
//! residual then restarts from p, as the chain rule does.

use crate::accept::Verdict;
use crate::constraint::ConstraintError;
use crate::process::token_logprob;
use crate::sample::{argmax, Sampler};

#[cfg(test)]
mod tests;

/// Why a tree, or a verdict checked against one, is malformed. Always a
/// caller bug (a proposer or the engine), never a request's fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    /// Nodes are stored in topological order: a parent comes first.
    #[error("node {node}: parent {parent} is not an earlier node")]
    ParentOutOfOrder { node: usize, parent: usize },
    /// A path names a node the tree does not have.
    #[error("path step {step}: node {node} is not in a tree of {len} nodes")]
    NodeOutOfRange {
        step: usize,
        node: usize,
        len: usize,
    },
    /// A path's node is not a child of the node before it (or, first, of
    /// the root).
    #[error("path step {step}: node {node} is not a child of {expected:?}")]
    NotAChild {
        step: usize,
        node: usize,
        expected: Option<usize>,
    },
    /// The verdict's emitted token at a path step is not that node's
    /// token (a sibling's node was recorded).
    #[error(
        "path step {step}: node {node} holds token {node_token}, the verdict emitted {emitted}"
    )]
    TokenMismatch {
        step: usize,
        node: usize,
        node_token: u32,
        emitted: u32,
    },
    /// A verdict emits exactly one token more than its path has nodes.
    #[error("a path of {path} nodes with {tokens} emitted tokens")]
    LengthMismatch { path: usize, tokens: usize },
}

/// One sequence's drafted candidates as a tree.
///
/// Invariants: node `i`'s parent, when `Some(j)`, has `j < i` (topological
/// order); `None` is the root, the last committed token. Children keep the
/// order in which they were added, which is the order acceptance tries
/// them. Siblings may repeat a token (i.i.d. draws do); greedy acceptance
/// only ever reaches the first of equal siblings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenTree {
    tokens: Vec<u32>,
    parents: Vec<Option<usize>>,
    /// 1 for the root's children.
    depths: Vec<usize>,
    /// Indexed by position: 0 the root, `1 + i` node i.
    children: Vec<Vec<usize>>,
}

impl TokenTree {
    /// The empty tree (no speculation: one row, one emitted token).
    pub fn new() -> Self {
        Self {
            tokens: Vec::new(),
            parents: Vec::new(),
            depths: Vec::new(),
            children: vec![Vec::new()],
        }
    }

    /// A tree from `(token, parent)` pairs in storage order.
    ///
    /// Errors: [`TreeError::ParentOutOfOrder`] for a parent that is not an
    /// earlier node.
    pub fn from_nodes(
        nodes: impl IntoIterator<Item = (u32, Option<usize>)>,
    ) -> Result<Self, TreeError> {
        let mut t = Self::new();
        for (token, parent) in nodes {
            t.push(token, parent)?;
        }
        Ok(t)
    }

    /// The chain `tokens[0] -> tokens[1] -> ...` (node i is tokens[i]).
    pub fn chain(tokens: &[u32]) -> Self {
        let mut t = Self::new();
        for (i, &tok) in tokens.iter().enumerate() {
            t.push(tok, i.checked_sub(1))
                .expect("a chain's parents come first");
        }
        t
    }

    /// Adds a node under `parent` (`None`: the root) and returns its index.
    ///
    /// Errors: [`TreeError::ParentOutOfOrder`] when `parent` is not an
    /// existing node; the tree is unchanged then.
    pub fn push(&mut self, token: u32, parent: Option<usize>) -> Result<usize, TreeError> {
        let node = self.tokens.len();
        let depth = match parent {
            None => 1,
            Some(p) if p < node => self.depths[p] + 1,
            Some(p) => return Err(TreeError::ParentOutOfOrder { node, parent: p }),
        };
        self.tokens.push(token);
        self.parents.push(parent);
        self.depths.push(depth);
        self.children[position(parent)].push(node);
        self.children.push(Vec::new());
        Ok(node)
    }

    /// How many nodes (drafted tokens) the tree holds; the verify pass
    /// scores `len() + 1` rows.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether nothing was drafted.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Node `i`'s token. Panics if `i >= len()`.
    pub fn token(&self, i: usize) -> u32 {
        self.tokens[i]
    }

    /// Node `i`'s parent (`None`: the root). Panics if `i >= len()`.
    pub fn parent(&self, i: usize) -> Option<usize> {
        self.parents[i]
    }

    /// Node `i`'s depth: 1 for the root's children, so also its offset
    /// from the last committed token's position. Panics if `i >= len()`.
    pub fn depth(&self, i: usize) -> usize {
        self.depths[i]
    }

    /// The deepest node's depth (0 for the empty tree): the most drafted
    /// tokens one pass can accept.
    pub fn max_depth(&self) -> usize {
        self.depths.iter().copied().max().unwrap_or(0)
    }

    /// The children of `node` (`None`: the root's), in the order they are
    /// tried. Panics if `node` is `Some(i)` with `i >= len()`.
    pub fn children(&self, node: Option<usize>) -> &[usize] {
        assert!(node.is_none_or(|i| i < self.len()), "no node {node:?}");
        &self.children[position(node)]
    }

    /// The nodes from the root's child down to `i`, `i` last. Panics if
    /// `i >= len()`.
    pub fn path(&self, i: usize) -> Vec<usize> {
        let mut path = vec![0; self.depths[i]];
        let mut at = Some(i);
        for slot in path.iter_mut().rev() {
            let n = at.expect("depth counts the ancestors");
            *slot = n;
            at = self.parents[n];
        }
        path
    }

    /// The tokens of [`path`](Self::path)`(i)`: the pending history of the
    /// row after node `i`.
    pub fn path_tokens(&self, i: usize) -> Vec<u32> {
        self.path(i).into_iter().map(|n| self.tokens[n]).collect()
    }

    /// Whether every node has at most one child.
    pub fn is_chain(&self) -> bool {
        self.children.iter().all(|c| c.len() <= 1)
    }

    /// Whether `path` is a path from the root: each node a child of the
    /// one before it, the first a child of the root.
    ///
    /// Errors: [`TreeError::NodeOutOfRange`], [`TreeError::NotAChild`].
    pub fn check_path(&self, path: &[usize]) -> Result<(), TreeError> {
        let mut expected = None;
        for (step, &node) in path.iter().enumerate() {
            if node >= self.len() {
                return Err(TreeError::NodeOutOfRange {
                    step,
                    node,
                    len: self.len(),
                });
            }
            if self.parents[node] != expected {
                return Err(TreeError::NotAChild {
                    step,
                    node,
                    expected,
                });
            }
            expected = Some(node);
        }
        Ok(())
    }
}

impl Default for TokenTree {
    fn default() -> Self {
        Self::new()
    }
}

/// The row (position) a node's children are scored at: 0 for the root.
fn position(node: Option<usize>) -> usize {
    node.map_or(0, |i| i + 1)
}

/// The outcome of verifying one sequence's tree.
///
/// Invariants: `path` is a path from the root of the tree it was decided
/// on; `verdict.accepted == path.len()`; `verdict.tokens` is the path's
/// tokens followed by the target's correction or bonus token;
/// `verdict.logprobs` as in [`Verdict`].
#[derive(Debug, Clone, PartialEq)]
pub struct TreeVerdict {
    /// The accepted nodes, root's child first.
    pub path: Vec<usize>,
    pub verdict: Verdict,
}

impl TreeVerdict {
    /// The chain-shaped verdict the engine's commit path takes.
    pub fn into_verdict(self) -> Verdict {
        self.verdict
    }

    /// The verify pass's rows whose cache entries (K/V slots, recurrent
    /// state) the sequence keeps, in position order: row 0 (the last
    /// committed token's) and then row `1 + i` for each accepted node i.
    /// Kept row j belongs at position `last + j`; the last kept row's
    /// recurrent state is the one to commit. Every other row (rejected
    /// siblings and their subtrees, nodes below the first miss) is
    /// dropped. The correction or bonus token has no row yet.
    ///
    /// Errors: the verdict does not fit `tree` (a path that is not one,
    /// a node's token other than the token emitted at its step, a token
    /// count other than path + 1): keeping those rows would commit a
    /// sibling's state. Equal siblings are indistinguishable here, and
    /// harmless: same token, same ancestors, same cache entries.
    pub fn rows_to_keep(&self, tree: &TokenTree) -> Result<Vec<usize>, TreeError> {
        let tokens = &self.verdict.tokens;
        if tokens.len() != self.path.len() + 1 || self.verdict.accepted != self.path.len() {
            return Err(TreeError::LengthMismatch {
                path: self.path.len(),
                tokens: tokens.len(),
            });
        }
        tree.check_path(&self.path)?;
        for (step, (&node, &emitted)) in self.path.iter().zip(tokens).enumerate() {
            let node_token = tree.token(node);
            if node_token != emitted {
                return Err(TreeError::TokenMismatch {
                    step,
                    node,
                    node_token,
                    emitted,
                });
            }
        }
        Ok(std::iter::once(0)
            .chain(self.path.iter().map(|&i| i + 1))
            .collect())
    }
}

impl From<TreeVerdict> for Verdict {
    fn from(v: TreeVerdict) -> Self {
        v.into_verdict()
    }
}

/// Greedy acceptance over a tree, whatever the sampler's params. `rows`
/// as for [`accept_tree`].
///
/// Errors: the sampler's processing fails (a grammar error); nothing is
/// committed then.
pub fn accept_tree_greedy(
    rows: &mut [Vec<f32>],
    tree: &TokenTree,
    sampler: &mut Sampler,
) -> Result<TreeVerdict, ConstraintError> {
    walk(rows, tree, None, sampler, true)
}

/// Lossless acceptance over a tree (see the module doc for the rule and
/// the processing contract). `rows` holds `tree.len() + 1` target logit
/// rows (row 0 after the last committed token, row `1 + i` after node i),
/// processed in place along the accepted path only. `q`, when given, holds
/// the draft's processed, warped distribution per position in the same
/// indexing, from which that position's children were drawn i.i.d.
/// (repeats kept as separate nodes); an empty row means that position's
/// children are deterministic candidates (or any list not drawn i.i.d.
/// from a q), as `None` means for every position. Rows of positions
/// without children are never read. Greedy params take the greedy walk.
///
/// Panics if `rows.len() != tree.len() + 1`, or if `q` lacks a row for a
/// position with children that the walk reaches, or that row is neither
/// empty nor as long as the logit row.
///
/// Errors: the sampler's processing fails (a grammar error, or a token the
/// grammar refuses at commit); the request cannot go on.
pub fn accept_tree(
    rows: &mut [Vec<f32>],
    tree: &TokenTree,
    q: Option<&[Vec<f32>]>,
    sampler: &mut Sampler,
) -> Result<TreeVerdict, ConstraintError> {
    let greedy = sampler.params().is_greedy();
    walk(rows, tree, q, sampler, greedy)
}

fn walk(
    rows: &mut [Vec<f32>],
    tree: &TokenTree,
    q: Option<&[Vec<f32>]>,
    sampler: &mut Sampler,
    greedy: bool,
) -> Result<TreeVerdict, ConstraintError> {
    assert_eq!(
        rows.len(),
        tree.len() + 1,
        "one row per node plus the root's"
    );
    let params = *sampler.params();
    let mut path = Vec::with_capacity(tree.max_depth());
    let mut tokens = Vec::with_capacity(tree.max_depth() + 1);
    let mut logprobs = Vec::new();
    let mut at = None;
    loop {
        let pos = position(at);
        let row = &mut rows[pos];
        // `tokens` is exactly the path to `at`: this row's history.
        sampler.process(row, &tokens)?;
        let kids = tree.children(at);
        let (token, next) = if greedy {
            let best = argmax(row);
            (best, kids.iter().copied().find(|&c| tree.token(c) == best))
        } else if kids.is_empty() {
            (sampler.draw(&params.warp(row)), None)
        } else {
            let qi = q.map(|q| q[pos].as_slice()).filter(|qi| !qi.is_empty());
            if let Some(qi) = qi {
                assert_eq!(qi.len(), row.len(), "q row {pos} is not a full row");
            }
            try_children(row, tree, kids, qi, sampler)
        };
        if let Some(top) = sampler.logprobs() {
            logprobs.push(token_logprob(row, token, top));
        }
        tokens.push(token);
        match next {
            Some(c) => {
                path.push(c);
                at = Some(c);
            }
            None => break,
        }
    }
    sampler.commit(&tokens)?;
    Ok(TreeVerdict {
        verdict: Verdict {
            accepted: path.len(),
            tokens,
            logprobs,
        },
        path,
    })
}

/// Multi-candidate rejection sampling at one position (temperature > 0):
/// `(c's token, Some(c))` for the accepted child c, or the correction drawn
/// from the residual and `None`.
///
/// The residual is kept unnormalized with its mass `z` (1 for p as warped),
/// and draws normalize it; for one candidate every operation is the chain
/// rule's, so a chain consumes the same draws and gets the same bits.
fn try_children(
    row: &[f32],
    tree: &TokenTree,
    kids: &[usize],
    qi: Option<&[f32]>,
    sampler: &mut Sampler,
) -> (u32, Option<usize>) {
    let params = *sampler.params();
    let mut r = params.warp(row);
    let mut z = 1.0f32;
    for &c in kids {
        let t = tree.token(c);
        let i = t as usize;
        let r_t = r.get(i).copied().unwrap_or(0.0);
        let q_t = qi.map_or(1.0, |q| q.get(i).copied().unwrap_or(0.0));
        // q_t == 0 cannot happen for a token the draft sampled; treat it as
        // a rejection rather than divide by zero.
        if q_t > 0.0 && sampler.uniform() < (r_t / z / q_t).min(1.0) {
            return (t, Some(c));
        }
        match qi {
            Some(q) => r
                .iter_mut()
                .zip(q)
                .for_each(|(x, &qv)| *x = (*x / z - qv).max(0.0)),
            None => {
                if let Some(x) = r.get_mut(i) {
                    *x = 0.0;
                }
            }
        }
        z = r.iter().map(|&x| x as f64).sum::<f64>() as f32;
        if z.is_nan() || z <= 0.0 {
            // Only rounding gets here (see the module doc): start over from p.
            r = params.warp(row);
            z = 1.0;
        }
    }
    (sampler.draw(&r), None)
}
