//! specgate-draft: proposers that guess the next k tokens of a sequence
//! cheaply, for the verifier to check in one forward pass.
//!
//! A proposal carries, per guessed token, the proposer's probability
//! distribution q (needed for lossless acceptance at temperature > 0); a
//! proposer without a model (n-gram lookup) proposes deterministically, so
//! its q is one-hot and is represented as `None`.

pub mod ngram;

pub use ngram::NgramProposer;

/// Guessed continuation of one sequence.
///
/// Invariant: when `q` is `Some`, it has one distribution per token.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// The proposer's warped distribution for each token; `None` = one-hot.
    pub q: Option<Vec<Vec<f32>>>,
}

/// Something that proposes draft tokens for a sequence.
pub trait Proposer {
    /// Proposes at most `k` tokens to follow `context` (prompt + output so
    /// far). May return fewer, or none, when it has no good guess.
    fn propose(&mut self, context: &[u32], k: usize) -> Proposal;
}
