//! The batch input of a forward pass, as every family takes it: one
//! [`SeqInput`] per sequence (which logits it wants: [`LogitsWanted`]), and
//! its flattening into [`Rows`], one new token per row, checked against the
//! model and its KV pool ([`flatten`]). Family-neutral.

use super::Model;
use crate::error::{Result, VerifyError};
use crate::kv_pool::KvPool;

/// Which logit rows a sequence wants back from a forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the prompt's end).
    None,
    /// Only the last new token's (plain decoding, end of prefill).
    Last,
    /// Every new token's (speculative verification: k+1 rows). A model
    /// with recurrent layers also keeps the state after each row, so the
    /// verdict can roll rejected rows back ([`crate::KvPool::keep_rows`]).
    All,
    /// Every new token's, for rows that are committed as they are (prompt
    /// rows scored for `echo` + `logprobs`): no per-row state is kept.
    Scored,
}

impl LogitsWanted {
    fn rows(self, n: usize) -> std::ops::Range<usize> {
        match self {
            LogitsWanted::None => 0..0,
            LogitsWanted::Last => n.saturating_sub(1)..n,
            LogitsWanted::All | LogitsWanted::Scored => 0..n,
        }
    }
}

/// One sequence's part of a forward batch: a run of new tokens at
/// consecutive positions `start_pos..start_pos + tokens.len()`.
///
/// Invariants the caller keeps (checked, an error otherwise): the positions
/// `0..start_pos` of this sequence are already in the pool through the same
/// block table, and `block_table` holds enough blocks for every new position.
/// For a model with recurrent layers (see [`Model::has_recurrent_state`]),
/// `state_slot` names the pool slot holding the sequence's state after
/// positions `0..start_pos` (ignored when `start_pos` is 0: the state starts
/// from zero), and no two sequences of a batch share a slot; other models
/// ignore it.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub block_table: &'a [u32],
    pub logits: LogitsWanted,
    pub state_slot: u32,
}

/// The batch flattened into rows: row `i` is token `tokens[i]` of sequence
/// `seq[i]` (its index in the batch) at position `positions[i]`.
/// `logit_rows` are the rows whose logits the batch asked for, in order.
pub(crate) struct Rows {
    pub(crate) tokens: Vec<u32>,
    pub(crate) positions: Vec<usize>,
    pub(crate) seq: Vec<usize>,
    pub(crate) logit_rows: Vec<u32>,
}

/// Flattens `seqs` into [`Rows`] for one forward of `model` over `pool`.
/// Every family calls it first, so the batch checks live in one place.
///
/// Errors: a pool built for another model shape or world size, a sequence
/// reaching beyond the model's context, a token outside the vocabulary, a
/// block table too short or naming a block outside the pool, a state slot
/// outside the pool or shared by two sequences, or no tokens.
pub(crate) fn flatten(model: &Model, pool: &KvPool, seqs: &[SeqInput]) -> Result<Rows> {
    if !pool.fits(&model.kv_layout()) {
        return Err(VerifyError::BadBatch(format!(
            "KV pool was built for a different model shape (a model sharded over {} \
             ranks needs KvPool::for_model)",
            model.world_size()
        )));
    }
    let mut rows = Rows {
        tokens: Vec::new(),
        positions: Vec::new(),
        seq: Vec::new(),
        logit_rows: Vec::new(),
    };
    for (si, s) in seqs.iter().enumerate() {
        check_seq(model, pool, si, s)?;
        let end = s.start_pos + s.tokens.len();
        let base = rows.tokens.len();
        rows.logit_rows
            .extend(s.logits.rows(s.tokens.len()).map(|r| (base + r) as u32));
        rows.tokens.extend_from_slice(s.tokens);
        rows.positions.extend(s.start_pos..end);
        rows.seq.extend(std::iter::repeat_n(si, s.tokens.len()));
    }
    if rows.tokens.is_empty() {
        return Err(VerifyError::BadBatch("no tokens in the batch".into()));
    }
    if model.has_recurrent_state() {
        let mut seen = std::collections::HashSet::new();
        for s in seqs {
            if !seen.insert(s.state_slot) {
                return Err(VerifyError::BadBatch(format!(
                    "two sequences of one batch share state slot {}",
                    s.state_slot
                )));
            }
        }
    }
    Ok(rows)
}

/// The checks of one sequence `s` (number `si` of its batch, for the
/// message) that [`flatten`] runs, alone: so a caller can refuse the one
/// sequence that would fail a batch before the batch runs.
///
/// Errors: `s` reaching beyond the model's context, a token outside the
/// vocabulary, a block table too short or naming a block outside the pool,
/// a state slot outside the pool (models with recurrent layers).
pub(crate) fn check_seq(model: &Model, pool: &KvPool, si: usize, s: &SeqInput) -> Result<()> {
    let cfg = &model.cfg;
    let end = s.start_pos + s.tokens.len();
    if end > cfg.max_position {
        return Err(VerifyError::BadBatch(format!(
            "sequence {si} reaches position {end}, beyond the model's {}",
            cfg.max_position
        )));
    }
    if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(VerifyError::BadBatch(format!(
            "token id {t} outside the vocabulary of {}",
            cfg.vocab_size
        )));
    }
    pool.check_table(s.block_table, end)?;
    if model.has_recurrent_state() {
        pool.check_state_slot(s.state_slot)?;
    }
    Ok(())
}
