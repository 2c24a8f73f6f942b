//! One speculative round for a batch of sequences: the proposer drafts k_i
//! tokens per sequence, the target scores every sequence's last accepted
//! token plus its drafts in ONE forward (k_i + 1 rows each), and acceptance
//! decides per sequence. k_i = 0 is plain decoding through the same path.
//!
//! Invariant at the start of every round, for every sequence: the target's
//! cache holds K/V for `tokens[..tokens.len() - 1]`. A round writes K/V for
//! the last token and the drafts; the slots of rejected drafts are simply
//! overwritten later and never read, since attention reads positions
//! `0..=pos` only.

use specgate_draft::{DraftPolicy, PolicyState, Proposal, ProposeRequest, Proposer};
use specgate_verify::accept::{accept_sampled, Verdict};
use specgate_verify::{KvPool, LogitsWanted, Model, Sampler, SeqInput, VerifyError};

/// A sequence being decoded speculatively.
pub struct SpecSeq {
    pub id: u64,
    /// Prompt + accepted output.
    pub tokens: Vec<u32>,
    pub sampler: Sampler,
    pub policy_state: PolicyState,
}

/// One sequence's part of a round.
pub struct RoundInput<'a> {
    pub seq: &'a mut SpecSeq,
    /// Must cover `seq.tokens.len() + k` positions.
    pub block_table: &'a [u32],
    /// Drafts wanted (0: plain decoding).
    pub k: usize,
}

/// Counters a dashboard needs, summed over rounds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecStats {
    /// Rounds in which at least one token was drafted.
    pub drafts: u64,
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// `accepted_per_pos[i]`: drafts accepted at position i of a round.
    pub accepted_per_pos: Vec<u64>,
    /// Tokens emitted (accepted drafts + one target token per round).
    pub emitted_tokens: u64,
    pub rounds: u64,
}

impl SpecStats {
    /// Accepted drafts / drafted tokens (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        if self.draft_tokens == 0 {
            0.0
        } else {
            self.accepted_tokens as f64 / self.draft_tokens as f64
        }
    }

    /// Tokens emitted per verify pass (1.0 without speculation).
    pub fn mean_accepted_length(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            self.emitted_tokens as f64 / self.rounds as f64
        }
    }

    fn record(&mut self, proposed: usize, v: &Verdict) {
        self.rounds += 1;
        self.emitted_tokens += v.tokens.len() as u64;
        if proposed == 0 {
            return;
        }
        self.drafts += 1;
        self.draft_tokens += proposed as u64;
        self.accepted_tokens += v.accepted as u64;
        if self.accepted_per_pos.len() < proposed {
            self.accepted_per_pos.resize(proposed, 0);
        }
        for p in &mut self.accepted_per_pos[..v.accepted] {
            *p += 1;
        }
    }
}

/// Runs one round for `batch`: drafts with `proposer` (when given and any
/// k > 0), then [`verify_round`].
///
/// Errors: a failing draft or target forward (nothing is appended then).
pub fn spec_round<P: Proposer + ?Sized>(
    target: &Model,
    pool: &mut KvPool,
    proposer: Option<&mut P>,
    policy: &DraftPolicy,
    batch: &mut [RoundInput],
    prefills: &[SeqInput],
    stats: &mut SpecStats,
) -> Result<Vec<Vec<u32>>, SpecError> {
    let mut proposals = vec![Proposal::default(); batch.len()];
    if let Some(p) = proposer {
        let all = vec![true; batch.len()];
        propose(p, batch, &all, &mut proposals)?;
    }
    verify_round(target, pool, policy, batch, &proposals, prefills, stats)
}

/// Drafts with `proposer` for the sequences of `batch` selected by
/// `include` (and k > 0), writing their proposals into `out` (aligned with
/// `batch`); others are left as they are.
pub fn propose<P: Proposer + ?Sized>(
    proposer: &mut P,
    batch: &mut [RoundInput],
    include: &[bool],
    out: &mut [Proposal],
) -> Result<(), SpecError> {
    let idx: Vec<usize> = (0..batch.len())
        .filter(|&i| include[i] && batch[i].k > 0)
        .collect();
    if idx.is_empty() {
        return Ok(());
    }
    let mut reqs: Vec<ProposeRequest> = batch
        .iter_mut()
        .enumerate()
        .filter(|(i, r)| include[*i] && r.k > 0)
        .map(|(_, r)| ProposeRequest {
            seq_id: r.seq.id,
            context: &r.seq.tokens,
            block_table: r.block_table,
            k: r.k,
            sampler: &mut r.seq.sampler,
        })
        .collect();
    let got = proposer.propose(&mut reqs)?;
    for (i, p) in idx.into_iter().zip(got) {
        out[i] = p;
    }
    Ok(())
}

/// Verifies `proposals` (aligned with `batch`) in ONE target forward that
/// also carries `prefills` (prompt chunks of other sequences, which want no
/// logits), accepts per sequence, appends the new tokens to each sequence
/// and returns them per sequence.
///
/// Errors: a failing target forward (nothing is appended then).
pub fn verify_round(
    target: &Model,
    pool: &mut KvPool,
    policy: &DraftPolicy,
    batch: &mut [RoundInput],
    proposals: &[Proposal],
    prefills: &[SeqInput],
    stats: &mut SpecStats,
) -> Result<Vec<Vec<u32>>, SpecError> {
    let rows_in: Vec<Vec<u32>> = batch
        .iter()
        .zip(proposals)
        .map(|(r, p)| {
            let mut row = vec![*r.seq.tokens.last().expect("a sequence has tokens")];
            row.extend_from_slice(&p.tokens);
            row
        })
        .collect();
    debug_assert!(prefills.iter().all(|p| p.logits == LogitsWanted::None));
    let inputs: Vec<SeqInput> = prefills
        .iter()
        .copied()
        .chain(batch.iter().zip(&rows_in).map(|(r, row)| SeqInput {
            tokens: row,
            start_pos: r.seq.tokens.len() - 1,
            block_table: r.block_table,
            logits: LogitsWanted::All,
        }))
        .collect();
    if inputs.is_empty() {
        return Ok(Vec::new());
    }
    let logits = target.forward_rows(pool, &inputs)?;
    let mut rows = logits.into_iter();
    let mut out = Vec::with_capacity(batch.len());
    for (r, p) in batch.iter_mut().zip(proposals) {
        let mine: Vec<Vec<f32>> = rows.by_ref().take(p.tokens.len() + 1).collect();
        let v = accept_sampled(&mine, &p.tokens, p.q.as_deref(), &mut r.seq.sampler);
        stats.record(p.tokens.len(), &v);
        policy.observe(&mut r.seq.policy_state, p.tokens.len(), v.accepted);
        r.seq.tokens.extend_from_slice(&v.tokens);
        out.push(v.tokens);
    }
    Ok(out)
}

/// Errors of a speculative round.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(transparent)]
    Draft(#[from] specgate_draft::DraftError),
    #[error(transparent)]
    Target(#[from] VerifyError),
}
