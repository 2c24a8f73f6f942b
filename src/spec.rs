//! One speculative round for a batch of sequences: the proposer drafts k_i
//! tokens per sequence, the target scores every sequence's last accepted
//! token plus its drafts in ONE forward (k_i + 1 rows each), and acceptance
//! decides per sequence. k_i = 0 is plain decoding through the same path.
//!
//! Invariant at the start of every round, for every sequence: the target's
//! cache holds K/V for `tokens[..tokens.len() - 1]`. A round writes K/V for
//! the last token and the drafts; the slots of rejected drafts are simply
//! overwritten later and never read, since attention reads positions
//! `0..=pos` only. A recurrent state (Kimi K3's KDA layers) cannot be
//! overwritten that way: the forward keeps its state after every verified
//! row and the round commits the last accepted one
//! ([`KvPool::keep_rows`]).
//!
//! Each sequence's [`Sampler`] carries its logits processing (penalties,
//! bias, min_tokens, grammar): proposals are fitted to its grammar before
//! verification (cut at the first forbidden token, extended with forced
//! ones; a tree's branches kept where the grammar admits their whole path),
//! every verified row is processed with the drafts before it as
//! history, and only the emitted tokens are committed to it.

use candle_core::{Storage, Tensor};
use specgate_draft::{DraftPolicy, PolicyState, Proposal, ProposeRequest, Proposer};
use specgate_verify::accept::{accept_sampled, Verdict};
use specgate_verify::process::rows_logprobs;
use specgate_verify::{
    accept_tree, ConstraintError, KvPool, LogitsWanted, Model, Sampler, SeqInput, TokenLogprob,
    TokenTree, VerifyError,
};

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
    /// Chain drafts wanted (0: plain decoding).
    pub k: usize,
    /// Branch nodes the proposer may add besides the chain; the block
    /// table must cover `seq.tokens.len() + k + branches` slots.
    pub branches: usize,
    /// The sequence's recurrent-state slot in the target's pool (see
    /// [`SeqInput::state_slot`]; ignored by models without recurrent layers).
    pub state_slot: u32,
    /// Where to copy the recurrent state if the accepted rows pass a
    /// given position (a hybrid target's prefix-cache checkpoint).
    pub snapshot: Option<Snapshot>,
}

/// A copy of a sequence's recurrent state as its round passes a position:
/// if the accepted rows absorb token `at - 1` (the state then holds
/// exactly `at` tokens at some row), that row's state is copied into
/// state slot `slot` of the target's pool. Only an accepted row's state is
/// ever copied, never a rejected draft's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    pub at: usize,
    pub slot: u32,
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
    /// Of `draft_tokens`, those of sequences under a grammar (forced ones
    /// included), and how many of them were accepted.
    pub grammar_draft_tokens: u64,
    pub grammar_accepted_tokens: u64,
    /// Tokens a grammar forced into proposals (jump-forward).
    pub grammar_forced_tokens: u64,
    /// Rounds verified as a token tree (a proposal with branches).
    pub tree_rounds: u64,
    /// Of `draft_tokens`, the branch nodes verified besides the chains.
    pub branch_tokens: u64,
    /// Tree rounds whose accepted path left the chain for a branch.
    pub branch_wins: u64,
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

    /// `on_chain`: the accepted drafts that are chain tokens (all of them
    /// unless the path left the chain for a branch).
    /// Grammar-constrained sequences draft chains only.
    fn record(&mut self, p: &Proposal, v: &Verdict, grammar: bool, on_chain: usize) {
        let proposed = p.tokens.len();
        self.rounds += 1;
        self.emitted_tokens += v.tokens.len() as u64;
        if !p.branches.is_empty() {
            self.tree_rounds += 1;
            self.branch_tokens += p.branches.len() as u64;
            self.branch_wins += u64::from(on_chain < v.accepted);
        }
        if proposed == 0 {
            return;
        }
        if grammar {
            self.grammar_draft_tokens += proposed as u64;
            self.grammar_accepted_tokens += v.accepted as u64;
            self.grammar_forced_tokens += p.forced as u64;
        }
        // A tree's every node counts as drafted, its accepted path as
        // accepted: tokens per verify pass stay `1 + accepted / drafts`.
        let (drafted, accepted) = (p.nodes(), v.accepted);
        self.drafts += 1;
        self.draft_tokens += drafted as u64;
        self.accepted_tokens += accepted as u64;
        if self.accepted_per_pos.len() < accepted {
            self.accepted_per_pos.resize(accepted, 0);
        }
        for p in &mut self.accepted_per_pos[..accepted] {
            *p += 1;
        }
    }
}

/// Runs one round for `batch`: drafts with `proposer` (when given and any
/// k > 0), then [`verify_round`]; returns the new tokens per sequence.
///
/// Errors: a failing draft or target forward (nothing is appended then);
/// a sequence's grammar failing (`Constraint`; the other sequences'
/// tokens are appended then).
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
    let out = verify_round(
        target,
        pool,
        policy,
        batch,
        &proposals,
        prefills,
        &[],
        stats,
    )?;
    out.verdicts
        .into_iter()
        .map(|v| v.map(|v| v.tokens).map_err(SpecError::Constraint))
        .collect()
}

/// Drafts with `proposer` for the sequences of `batch` selected by
/// `include` (and k > 0), writing their proposals into `out` (aligned with
/// `batch`); others are left as they are. Each proposal is fitted to its
/// sequence's grammar ([`specgate_verify::process::LogitsProcessor::shape_proposal`]),
/// so a proposal may come back longer (forced tokens, up to k) or shorter.
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
            branches: r.branches,
            sampler: &mut r.seq.sampler,
        })
        .collect();
    let got = proposer.propose(&mut reqs)?;
    drop(reqs);
    for (i, mut p) in idx.into_iter().zip(got) {
        let r = &mut batch[i];
        let processor = r.seq.sampler.processor_mut();
        // Under a grammar the chain is fitted to it, then every branch
        // path is checked whole (acceptance masks each node's row with
        // the grammar along its own path; a path the grammar refuses
        // would only waste its rows).
        if processor.has_constraint() {
            let old_chain = p.tokens.len();
            p.forced = processor.shape_proposal(&mut p.tokens, &mut p.q, r.k);
            let kept = p.tokens.len() - p.forced;
            p.rehang(old_chain, kept, usize::MAX, |path| processor.admits(path));
        }
        // Within what was asked, whatever the proposer answered.
        p.cut(r.k, r.branches);
        out[i] = p;
    }
    Ok(())
}

/// What [`verify_round`] produced.
#[derive(Debug, Default)]
pub struct RoundOutput {
    /// Per sequence of the batch: its verdict (the tokens are appended to
    /// it already), or the grammar error that ends it (nothing appended).
    pub verdicts: Vec<Result<Verdict, ConstraintError>>,
    /// Per prefill chunk, the prompt log-probabilities of the rows its
    /// [`PromptScoring`] named (empty without one).
    pub prompt_logprobs: Vec<Vec<TokenLogprob>>,
    /// Per sequence of the batch: the position its [`Snapshot`] was taken
    /// at, if it was.
    pub snapshots: Vec<Option<usize>>,
}

/// What a prompt chunk wants scored (`echo` with `logprobs`): its row `r`
/// (at position `start_pos + r`) scores the prompt token after it. The
/// chunk asks for `LogitsWanted::Scored`.
#[derive(Debug, Clone, Copy)]
pub struct PromptScoring<'a> {
    /// Rows before this one are not scored (already scored when a chunk
    /// runs again after a preemption).
    pub skip: usize,
    /// The token row `skip + i` scores is `targets[i]`; rows past its end
    /// are not scored.
    pub targets: &'a [u32],
    /// Alternatives reported per token.
    pub top: usize,
}

/// Verifies `proposals` (aligned with `batch`) in ONE target forward that
/// also carries `prefills` (prompt chunks of other sequences; those with a
/// [`PromptScoring`] in `scoring`, aligned with `prefills`, get their
/// prompt log-probabilities back, computed where the logits are: no
/// prompt row is copied out), accepts per sequence, appends the new
/// tokens to each sequence and returns the verdicts.
///
/// Errors: a failing target forward (nothing is appended then). A
/// sequence's grammar error is that sequence's verdict, not an error of
/// the round.
// The round's inputs are separate borrows of the engine's state (the model,
// the pool, the policy, the batch, the prompt chunks): bundling them would
// only move the same list into a struct.
#[allow(clippy::too_many_arguments)]
pub fn verify_round(
    target: &Model,
    pool: &mut KvPool,
    policy: &DraftPolicy,
    batch: &mut [RoundInput],
    proposals: &[Proposal],
    prefills: &[SeqInput],
    scoring: &[Option<PromptScoring>],
    stats: &mut SpecStats,
) -> Result<RoundOutput, SpecError> {
    // A proposal with branches is verified as a token tree (its rows: the
    // last token, the chain, the branches); the others as chains.
    let trees: Vec<Option<TokenTree>> = proposals
        .iter()
        .map(|p| (!p.branches.is_empty()).then(|| p.tree()).transpose())
        .collect::<Result<_, _>>()
        .map_err(|e| VerifyError::BadBatch(format!("malformed draft tree: {e}")))?;
    let rows_in: Vec<Vec<u32>> = batch
        .iter()
        .zip(proposals)
        .map(|(r, p)| round_rows(&r.seq.tokens, p))
        .collect();
    let inputs: Vec<SeqInput> = prefills
        .iter()
        .copied()
        .chain(batch.iter().zip(&rows_in).map(|(r, row)| SeqInput {
            tokens: row,
            start_pos: r.seq.tokens.len() - 1,
            block_table: r.block_table,
            logits: LogitsWanted::All,
            state_slot: r.state_slot,
        }))
        .collect();
    if inputs.is_empty() {
        return Ok(RoundOutput::default());
    }
    let logits = if trees.iter().any(Option::is_some) {
        let shapes: Vec<Option<&TokenTree>> = std::iter::repeat_n(None, prefills.len())
            .chain(trees.iter().map(Option::as_ref))
            .collect();
        target.forward_trees(pool, &inputs, &shapes)?
    } else {
        target.forward(pool, &inputs)?
    };
    let recurrent = target.has_recurrent_state();
    let mut out = RoundOutput::default();
    let mut row = 0;
    for (i, p) in prefills.iter().enumerate() {
        let n = match p.logits {
            LogitsWanted::None => 0,
            LogitsWanted::Last => usize::from(!p.tokens.is_empty()),
            LogitsWanted::All | LogitsWanted::Scored => p.tokens.len(),
        };
        let lps = match scoring.get(i).copied().flatten() {
            Some(sc) if n > sc.skip => {
                let m = sc.targets.len().min(n - sc.skip);
                let targets = &sc.targets[..m];
                with_rows(&logits, row + sc.skip, m, |rows, vocab| {
                    rows_logprobs(rows, vocab, targets, sc.top)
                })?
            }
            _ => Vec::new(),
        };
        out.prompt_logprobs.push(lps);
        row += n;
    }
    // Only the decode rows leave as whole rows: acceptance needs them.
    let total = logits.dim(0).map_err(VerifyError::from)?;
    let decode_rows = match total.checked_sub(row) {
        Some(0) | None => Vec::new(),
        Some(n) => logits
            .narrow(0, row, n)
            .and_then(|t| t.to_vec2::<f32>())
            .map_err(VerifyError::from)?,
    };
    let mut rows = decode_rows.into_iter();
    for ((r, p), tree) in batch.iter_mut().zip(proposals).zip(&trees) {
        let mut mine: Vec<Vec<f32>> = rows.by_ref().take(p.nodes() + 1).collect();
        let grammar = r.seq.sampler.processor().has_constraint();
        // The verdict, how many of its drafts are chain tokens, and the
        // rows of the accepted path (root first; the last one's recurrent
        // state is the accepted leaf's).
        let (v, on_chain, path) = match tree {
            None => {
                let v = accept_sampled(&mut mine, &p.tokens, p.q.as_deref(), &mut r.seq.sampler);
                let leaf = v.as_ref().map_or(0, |v| v.accepted);
                (v, leaf, (0..=leaf).collect::<Vec<_>>())
            }
            Some(tree) => {
                let q = tree_q(p, tree, r.seq.sampler.params().is_greedy());
                match accept_tree(&mut mine, tree, q.as_deref(), &mut r.seq.sampler) {
                    Ok(tv) => {
                        let keep = tv.rows_to_keep(tree).map_err(|e| {
                            VerifyError::BadBatch(format!("tree verdict does not fit: {e}"))
                        })?;
                        // The kept rows' K/V move to the slots their
                        // positions address; siblings' rows are dropped.
                        pool.compact_rows(r.block_table, r.seq.tokens.len() - 1, &keep)?;
                        let on_chain = tv.path.iter().take_while(|&&n| n < p.tokens.len()).count();
                        (Ok(tv.into_verdict()), on_chain, keep)
                    }
                    Err(e) => (Err(e), 0, vec![0]),
                }
            }
        };
        let mut snapped = None;
        if let Ok(v) = &v {
            if let (true, Some(snap)) = (recurrent, r.snapshot) {
                snapped = take_snapshot(pool, r, snap, &path, p.nodes() > 0)?;
            }
            let leaf_row = path.last().copied().unwrap_or(0);
            if recurrent && p.nodes() > 0 {
                // The state after the accepted leaf's row stays (a tree's
                // forward derives each row's state from its parent's, so
                // that row's state has absorbed exactly the kept path); the
                // other rows' are dropped.
                pool.keep_rows(r.state_slot, leaf_row + 1)?;
            }
            stats.record(p, v, grammar, on_chain);
            // The policy learns how far the chain went.
            policy.observe(&mut r.seq.policy_state, p.tokens.len(), on_chain);
            policy.observe_branches(
                &mut r.seq.policy_state,
                p.branches.len(),
                v.accepted - on_chain,
            );
            r.seq.tokens.extend_from_slice(&v.tokens);
        }
        out.verdicts.push(v);
        out.snapshots.push(snapped);
    }
    Ok(out)
}

/// The rows a round feeds for a sequence holding `tokens` (never empty)
/// with proposal `p`, from position `tokens.len() - 1`: its last token,
/// the chain, then the branch nodes.
pub fn round_rows(tokens: &[u32], p: &Proposal) -> Vec<u32> {
    let mut row = Vec::with_capacity(1 + p.nodes());
    row.extend(tokens.last().copied());
    row.extend_from_slice(&p.tokens);
    row.extend(p.branches.iter().map(|&(t, _)| t));
    row
}

/// Takes `r`'s snapshot if the accepted `path` (its rows, root first)
/// passes it: the state after the path row that absorbs token
/// `snap.at - 1`. `rows_recorded`: whether the forward kept per-row states
/// (several rows); else the one row's state is the slot's live one.
/// Returns the position saved at.
///
/// Errors: the copy failed (a bookkeeping bug: the round fails).
fn take_snapshot(
    pool: &mut KvPool,
    r: &RoundInput,
    snap: Snapshot,
    path: &[usize],
    rows_recorded: bool,
) -> Result<Option<usize>, VerifyError> {
    // The state held `start` tokens before the round; path row `d` has
    // absorbed `start + d + 1`.
    let start = r.seq.tokens.len() - 1;
    let Some(depth) = snap.at.checked_sub(start + 1) else {
        return Ok(None);
    };
    let Some(&row) = path.get(depth) else {
        return Ok(None);
    };
    if rows_recorded {
        pool.copy_row_state(r.state_slot, row, snap.slot)?;
    } else {
        pool.copy_state(r.state_slot, snap.slot)?;
    }
    Ok(Some(snap.at))
}

/// The draft distributions [`accept_tree`] takes for proposal `p` verified
/// as `tree`, per position (row 0 the root's children): a chain token's q
/// where it is its position's only child; an empty row (deterministic
/// candidates, exact for any list fixed before the target's draws) where
/// branches join it or hang below. `None` when greedy (q is not read) or
/// the proposer gave no q.
fn tree_q(p: &Proposal, tree: &TokenTree, greedy: bool) -> Option<Vec<Vec<f32>>> {
    let q = p.q.as_ref().filter(|_| !greedy)?;
    Some(
        (0..=tree.len())
            .map(|pos| {
                let parent = pos.checked_sub(1);
                match q.get(pos) {
                    Some(row) if pos < p.tokens.len() && tree.children(parent).len() == 1 => {
                        row.clone()
                    }
                    _ => Vec::new(),
                }
            })
            .collect(),
    )
}

/// Runs `f(rows, vocab)` on rows `start..start + n` of a `[rows, vocab]`
/// logits tensor as one row-major slice: borrowed in place when the tensor
/// is in host memory and contiguous, else those rows only copied out.
fn with_rows<R>(
    t: &Tensor,
    start: usize,
    n: usize,
    f: impl FnOnce(&[f32], usize) -> R,
) -> Result<R, VerifyError> {
    let vocab = t.dim(1)?;
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((offset, _))) = (&*storage, layout.contiguous_offsets()) {
            if let Ok(data) = cpu.as_slice::<f32>() {
                let from = offset + start * vocab;
                if let Some(rows) = data.get(from..from + n * vocab) {
                    return Ok(f(rows, vocab));
                }
            }
        }
    }
    let copied = t.narrow(0, start, n)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&copied, vocab))
}

/// Errors of a speculative round.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(transparent)]
    Draft(#[from] specgate_draft::DraftError),
    #[error(transparent)]
    Target(#[from] VerifyError),
    /// A sequence's grammar failed (its request cannot go on).
    #[error(transparent)]
    Constraint(#[from] ConstraintError),
}
