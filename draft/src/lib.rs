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
pub mod model;
pub mod ngram;
pub mod policy;
pub mod suffix;

pub use cost::{CostCurve, CostModel};
pub use guard::ModelGuard;
pub use model::{DraftChunk, ModelDraft};
pub use ngram::NgramProposer;
pub use policy::{DraftPolicy, PolicyState, StepLimits, StepPlan, StepSeq};
pub use suffix::{SuffixConfig, SuffixMatch, SuffixPool};

use specgate_verify::{Sampler, VerifyError};

/// Guessed continuation of one sequence.
///
/// Invariant: when `q` is `Some`, it has one distribution per token.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// The proposer's warped distribution for each token; `None` = one-hot.
    pub q: Option<Vec<Vec<f32>>>,
    /// How many of the last `tokens` a grammar forced (jump-forward), added
    /// after the proposer answered; 0 from a proposer itself.
    pub forced: usize,
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
    /// Tokens wanted; 0 asks for none.
    pub k: usize,
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
            .map(|r| Proposal {
                tokens: self.lookup(r.context, r.k).to_vec(),
                q: None,
                forced: 0,
            })
            .collect())
    }
}
