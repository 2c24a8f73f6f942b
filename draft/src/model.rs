//! Small-model draft: a model run on the specgate-verify runtime at world
//! size 1 with its own KV pool, addressed by the SAME block ids as the
//! target's, so one block allocation serves both caches.
//!
//! Per sequence it remembers which tokens its cache holds; each proposal
//! first catches up from the longest prefix that is still valid (tokens the
//! target rejected are simply overwritten, never read), then drafts k tokens
//! autoregressively, all sequences of the batch in one forward per step.
//! Each step's logits are processed by the sequence's sampler with the
//! drafts so far as pending history, exactly as the target's verified rows
//! will be; a sequence whose processing fails (a grammar with nothing left
//! to allow) stops drafting there, and the target reports the error if it
//! is real.
//!
//! A draft with recurrent layers (a small Kimi K3) cannot overwrite what the
//! target rejected: its state has absorbed every token fed. So each
//! sequence gets a state slot of the draft's pool, the draft checkpoints the
//! state after every token it feeds in a proposal (the catch-up, then each
//! draft), and the next proposal restores the checkpoint at the length the
//! target accepted before feeding on; with no checkpoint there, it starts
//! the sequence over from position 0.
//!
//! A sequence whose prompt the target found in its prefix cache shares an
//! earlier sequence's blocks; where the draft wrote its own K/V for the
//! same tokens in those blocks ([`crate::blocks`]), it counts them as held
//! too (not for a recurrent draft, whose state a block cannot restore).
//!
//! Branches: a request allowing branch nodes gets, where the draft is
//! unsure of a chain position (its most likely token there has probability
//! below [`ModelDraft::unsure_below`], whatever token a sampled chain
//! drew: that keeps the q rule exact), the next most likely other tokens there as
//! sibling leaves of that chain token ([`crate::leaves`]). Leaves are never
//! fed to the draft, so its cache and states stay a chain and the catch-up
//! above is unchanged; their q is not given (acceptance treats a position
//! with several children as deterministic candidates).

use crate::blocks::BlockContents;
use crate::leaves::{leaves, Ranked};
use crate::{DraftError, Proposal, ProposeRequest, Proposer};
use specgate_verify::sample::argmax;
use specgate_verify::{KvPool, LogitsWanted, Model, ModelConfig, SeqInput};
use std::collections::HashMap;
use std::sync::Arc;

/// A draft model with its own paged cache.
pub struct ModelDraft {
    model: Arc<Model>,
    pool: KvPool,
    /// Per sequence: the tokens whose K/V this draft's pool holds, in order.
    cached: HashMap<u64, Vec<u32>>,
    /// For a draft with recurrent layers: per sequence, its state slot.
    slots: HashMap<u64, u32>,
    free_slots: Vec<u32>,
    /// Per sequence: how many tokens its state has absorbed, and the state
    /// after each length fed in the last proposal.
    states: HashMap<u64, Checkpoints>,
    /// `(rows, seconds)` of each forward since the last
    /// [`ModelDraft::take_timings`], for the engine's cost model.
    timings: Vec<(usize, f64)>,
    /// Which token prefix the draft's K/V in each full block holds.
    blocks: BlockContents,
    /// A chain position whose most likely token has less probability than
    /// this gets leaves (see [`ModelDraft::set_unsure_below`]).
    unsure_below: f32,
}

/// The default [`ModelDraft::unsure_below`]: below 0.8 the draft's own
/// token misses about one time in five or more, often enough that its
/// runner-up is worth a verify row.
pub const DEFAULT_UNSURE_BELOW: f32 = 0.8;

/// A recurrent draft's states of one sequence: the length its slot holds,
/// and `(length, state per shard)` after each token fed in the last
/// proposal.
type Checkpoints = (usize, Vec<(usize, Vec<Vec<f32>>)>);

impl ModelDraft {
    /// A draft whose pool has `num_blocks` blocks of `block_size` slots: the
    /// same geometry as the target's pool, since block ids are shared.
    pub fn new(
        model: Arc<Model>,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, DraftError> {
        let pool = KvPool::for_model(&model, num_blocks, block_size)?;
        Ok(Self {
            free_slots: (0..pool.state_slots() as u32).rev().collect(),
            model,
            pool,
            cached: HashMap::new(),
            slots: HashMap::new(),
            states: HashMap::new(),
            timings: Vec::new(),
            blocks: BlockContents::new(block_size),
            unsure_below: DEFAULT_UNSURE_BELOW,
        })
    }

    /// The probability below which a chain position counts as unsure and
    /// gets leaves: that of the draft's most likely token there under its
    /// processed, warped q (never the drawn token's: see `crate::leaves`
    /// for why), or at greedy params (where q is one-hot and the chain's
    /// token the argmax) under the softmax of the processed logits at
    /// temperature 1, the draft's own confidence. A position keeps taking
    /// leaves, its next most likely tokens, while the tokens it offers
    /// cover less than this (see `crate::leaves`). Default
    /// [`DEFAULT_UNSURE_BELOW`].
    pub fn unsure_below(&self) -> f32 {
        self.unsure_below
    }

    /// Sets [`ModelDraft::unsure_below`]; 0 never branches, above 1 always
    /// may (as far as the branch budget goes). Proposals without branches
    /// do not depend on it.
    pub fn set_unsure_below(&mut self, p: f32) {
        self.unsure_below = p;
    }

    /// `(rows, seconds)` of every proposal forward run since the last
    /// call, oldest first.
    pub fn take_timings(&mut self) -> Vec<(usize, f64)> {
        std::mem::take(&mut self.timings)
    }

    /// Times one forward of `rows` filler tokens at `start_pos` through
    /// `block_table` with every row's logits, as a draft step over `rows`
    /// sequences costs (the output head runs per row): the engine's
    /// calibration. It writes the draft's cache at those blocks and, for a
    /// recurrent draft, a free state slot it then returns, so the caller
    /// must own the blocks.
    ///
    /// Errors: the forward failed, or a recurrent draft has no free slot.
    pub fn time_forward(
        &mut self,
        rows: usize,
        start_pos: usize,
        block_table: &[u32],
    ) -> Result<f64, DraftError> {
        const CALIBRATION: u64 = u64::MAX;
        let slot = self.slot(CALIBRATION)?;
        let vocab = self.model.config().vocab_size.max(1) as u32;
        let tokens: Vec<u32> = (0..rows as u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let input = SeqInput {
            tokens: &tokens,
            start_pos,
            block_table,
            logits: LogitsWanted::All,
            state_slot: slot,
        };
        let t = std::time::Instant::now();
        let out = self.model.forward_rows(&mut self.pool, &[input]);
        let secs = t.elapsed().as_secs_f64();
        self.release(CALIBRATION);
        out?;
        Ok(secs)
    }

    /// `forward_rows` on the draft's pool, timed into `timings`.
    fn timed_forward(&mut self, inputs: &[SeqInput]) -> Result<Vec<Vec<f32>>, DraftError> {
        let rows = inputs.iter().map(|i| i.tokens.len()).sum();
        let t = std::time::Instant::now();
        let out = self.model.forward_rows(&mut self.pool, inputs)?;
        self.timings.push((rows, t.elapsed().as_secs_f64()));
        Ok(out)
    }

    /// Errors unless the draft speaks the target's vocabulary.
    pub fn check_compatible(&self, target: &ModelConfig) -> Result<(), DraftError> {
        let (d, t) = (self.model.config().vocab_size, target.vocab_size);
        if d != t {
            return Err(DraftError::Incompatible(format!(
                "draft vocabulary has {d} tokens, the target's {t}"
            )));
        }
        Ok(())
    }

    /// Positions the draft model can attend to (its context length).
    pub fn max_position(&self) -> usize {
        self.model.config().max_position
    }

    /// Bytes of the draft's KV cache per token.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.pool.bytes_per_token()
    }

    /// The next draft after `pending` from one row of raw draft logits,
    /// with its q (None when greedy); `None` when processing fails. With
    /// `alts > 0`, also how that row ranks the other tokens (up to `alts`
    /// of them), computed after the draw so no random draw changes.
    fn pick(
        logits: &mut [f32],
        req: &mut ProposeRequest,
        pending: &[u32],
        alts: usize,
    ) -> Option<(u32, Option<Vec<f32>>, Option<Ranked>)> {
        req.sampler.process(logits, pending).ok()?;
        let params = *req.sampler.params();
        if params.is_greedy() {
            let tok = argmax(logits);
            let ranked = (alts > 0).then(|| Ranked::from_logits(logits, tok, alts));
            return Some((tok, None, ranked));
        }
        let q = params.warp(logits);
        let tok = req.sampler.draw(&q);
        let ranked = (alts > 0).then(|| Ranked::from_probs(&q, tok, alts));
        Some((tok, Some(q), ranked))
    }
}

/// A prompt chunk the target prefills this step, for [`ModelDraft::prefill`].
pub struct DraftChunk<'a> {
    pub seq_id: u64,
    /// The sequence's tokens so far (at least `start + n`).
    pub tokens: &'a [u32],
    pub start: usize,
    pub n: usize,
    pub block_table: &'a [u32],
}

impl ModelDraft {
    /// Runs the prompt chunks the target prefills this step through the
    /// draft too, in one forward, so a sequence's first proposal catches up
    /// on one token instead of its whole prompt: the draft's prefill is
    /// spread over the steps that carry the target's chunks, under the same
    /// token budget, instead of landing on the sequence's first decode step.
    /// A chunk that does not continue what the draft holds for its sequence
    /// is skipped (its next proposal catches up as before).
    ///
    /// Returns the prompt rows it ran.
    ///
    /// Errors: the draft's forward failed; the sequences of the batch are
    /// then forgotten, so their proposals start over.
    pub fn prefill(&mut self, chunks: &[DraftChunk]) -> Result<usize, DraftError> {
        let recurrent = self.pool.state_slots() > 0;
        let mut run: Vec<(&DraftChunk, u32)> = Vec::new();
        for c in chunks {
            // The draft must hold exactly the tokens before the chunk.
            let held = if c.start == 0 {
                0
            } else {
                match self.cached.get(&c.seq_id) {
                    Some(have)
                        if have.len() == c.start && common_prefix(have, c.tokens) == c.start =>
                    {
                        c.start
                    }
                    // The target's prefix cache skipped these tokens: the
                    // draft may hold them in the same blocks.
                    None if !recurrent => {
                        match self.blocks.extend(c.block_table, c.tokens, 0, c.start) {
                            n if n == c.start => n,
                            _ => usize::MAX,
                        }
                    }
                    _ => usize::MAX,
                }
            };
            let state_ok = !recurrent
                || c.start == 0
                || self
                    .states
                    .get(&c.seq_id)
                    .is_some_and(|(len, _)| *len == c.start);
            if held == c.start && state_ok && c.n > 0 {
                let slot = self.slot(c.seq_id)?;
                run.push((c, slot));
            }
        }
        if run.is_empty() {
            return Ok(0);
        }
        let inputs: Vec<SeqInput> = run
            .iter()
            .map(|(c, slot)| SeqInput {
                tokens: &c.tokens[c.start..c.start + c.n],
                start_pos: c.start,
                block_table: c.block_table,
                logits: LogitsWanted::None,
                state_slot: *slot,
            })
            .collect();
        for (c, _) in &run {
            self.blocks.forget(c.block_table, c.start, c.start + c.n);
        }
        // Not timed: without logits it costs less per row than a draft
        // step, whose cost the timings feed.
        if let Err(e) = self.model.forward(&mut self.pool, &inputs) {
            for (c, _) in &run {
                self.release(c.seq_id);
            }
            return Err(e.into());
        }
        for (c, _) in &run {
            let have = self.cached.entry(c.seq_id).or_default();
            have.clear();
            have.extend_from_slice(&c.tokens[..c.start + c.n]);
            self.blocks.record(c.block_table, have, c.start);
            if recurrent {
                self.states.insert(c.seq_id, (c.start + c.n, Vec::new()));
            }
        }
        Ok(run.iter().map(|(c, _)| c.n).sum())
    }

    /// Tokens the draft has run through its model for `seq_id` and still
    /// holds (what a proposal can skip).
    pub fn held_tokens(&self, seq_id: u64) -> usize {
        self.cached.get(&seq_id).map_or(0, Vec::len)
    }

    /// Where `seq_id`'s next proposal starts feeding `context` (whose
    /// block table is `table`): the prefix the draft holds for it, or
    /// holds in shared blocks, short of the last token (whose logits give
    /// the first draft). A recurrent draft may start earlier still (from
    /// its last checkpoint).
    pub fn catch_up_from(&self, seq_id: u64, context: &[u32], table: &[u32]) -> usize {
        let last = context.len().saturating_sub(1);
        let valid = self
            .cached
            .get(&seq_id)
            .map_or(0, |c| common_prefix(c, context))
            .min(last);
        if self.pool.state_slots() > 0 || valid == last {
            return valid;
        }
        self.blocks.extend(table, context, valid, last)
    }

    /// The sequence's state slot (0 for a draft without recurrent layers).
    fn slot(&mut self, seq_id: u64) -> Result<u32, DraftError> {
        if self.pool.state_slots() == 0 {
            return Ok(0);
        }
        if let Some(&s) = self.slots.get(&seq_id) {
            return Ok(s);
        }
        let s = self
            .free_slots
            .pop()
            .ok_or_else(|| DraftError::Incompatible("the draft has no state slot free".into()))?;
        self.slots.insert(seq_id, s);
        Ok(s)
    }

    /// Where a recurrent draft can resume `seq_id` at `start` tokens: the
    /// state is moved there from a checkpoint; without one, 0 (start over).
    fn resume_at(&mut self, seq_id: u64, slot: u32, start: usize) -> Result<usize, DraftError> {
        let Some((len, snaps)) = self.states.get_mut(&seq_id) else {
            return Ok(0);
        };
        if start == 0 || start == *len {
            return Ok(start);
        }
        match snaps.iter().find(|(l, _)| *l == start) {
            Some((_, st)) => {
                self.pool.write_state(slot, st)?;
                *len = start;
                Ok(start)
            }
            None => Ok(0),
        }
    }

    /// Records that `seq_id`'s state now holds `len` tokens, checkpointed.
    fn checkpoint(&mut self, seq_id: u64, slot: u32, len: usize) -> Result<(), DraftError> {
        let st = self.pool.read_state(slot)?;
        let e = self.states.entry(seq_id).or_default();
        e.0 = len;
        e.1.push((len, st));
        Ok(())
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Proposer for ModelDraft {
    fn propose(&mut self, batch: &mut [ProposeRequest]) -> Result<Vec<Proposal>, DraftError> {
        let mut out = vec![Proposal::default(); batch.len()];
        let active: Vec<usize> = (0..batch.len())
            .filter(|&i| batch[i].k > 0 && !batch[i].context.is_empty())
            .collect();
        if active.is_empty() {
            return Ok(out);
        }
        // Step 0: catch up on every token not yet in the draft cache (at
        // least the last one, whose logits give the first draft).
        let recurrent = self.pool.state_slots() > 0;
        let mut starts = Vec::with_capacity(active.len());
        let mut slots = vec![0u32; batch.len()];
        for &i in &active {
            let r = &batch[i];
            let mut start = self.catch_up_from(r.seq_id, r.context, r.block_table);
            // What this proposal writes: the catch-up and up to k - 1 drafts.
            self.blocks
                .forget(r.block_table, start, r.context.len() + r.k - 1);
            slots[i] = self.slot(r.seq_id)?;
            if recurrent {
                start = self.resume_at(r.seq_id, slots[i], start)?;
                if let Some(e) = self.states.get_mut(&r.seq_id) {
                    e.1.clear();
                }
            }
            starts.push(start);
        }
        let inputs: Vec<SeqInput> = active
            .iter()
            .zip(&starts)
            .map(|(&i, &s)| SeqInput {
                tokens: &batch[i].context[s..],
                start_pos: s,
                block_table: batch[i].block_table,
                logits: LogitsWanted::Last,
                state_slot: slots[i],
            })
            .collect();
        let mut logits = self.timed_forward(&inputs)?;
        if recurrent {
            for &i in &active {
                self.checkpoint(batch[i].seq_id, slots[i], batch[i].context.len())?;
            }
        }
        let mut qs: Vec<Vec<Vec<f32>>> = vec![Vec::new(); batch.len()];
        let mut ranks: Vec<Vec<Ranked>> = vec![Vec::new(); batch.len()];
        let mut step = 0;
        let mut live = active.clone();
        loop {
            for (row, &i) in logits.iter_mut().zip(&live) {
                let alts = batch[i].branches;
                let Some((tok, q, ranked)) = Self::pick(row, &mut batch[i], &out[i].tokens, alts)
                else {
                    continue;
                };
                out[i].tokens.push(tok);
                if let Some(q) = q {
                    qs[i].push(q);
                }
                ranks[i].extend(ranked);
            }
            step += 1;
            // A sequence that could not draft this step stops here.
            live.retain(|&i| out[i].tokens.len() == step && batch[i].k > step);
            if live.is_empty() {
                break;
            }
            // Feed each live sequence its newest draft to get the next one.
            let inputs: Vec<SeqInput> = live
                .iter()
                .map(|&i| SeqInput {
                    tokens: &out[i].tokens[step - 1..step],
                    start_pos: batch[i].context.len() + step - 1,
                    block_table: batch[i].block_table,
                    logits: LogitsWanted::Last,
                    state_slot: slots[i],
                })
                .collect();
            logits = self.timed_forward(&inputs)?;
            if recurrent {
                for &i in &live {
                    self.checkpoint(batch[i].seq_id, slots[i], batch[i].context.len() + step)?;
                }
            }
        }
        for (&i, &start) in active.iter().zip(&starts) {
            let r = &batch[i];
            // The cache now holds the context and every draft but the last.
            let fed = &out[i].tokens[..out[i].tokens.len().saturating_sub(1)];
            let c = self.cached.entry(r.seq_id).or_default();
            c.clear();
            c.extend_from_slice(r.context);
            c.extend_from_slice(fed);
            self.blocks.record(r.block_table, c, start);
            if !qs[i].is_empty() {
                out[i].q = Some(std::mem::take(&mut qs[i]));
            }
            out[i].branches = leaves(&ranks[i], r.branches, self.unsure_below);
        }
        Ok(out)
    }

    fn release(&mut self, seq_id: u64) {
        self.cached.remove(&seq_id);
        self.states.remove(&seq_id);
        if let Some(s) = self.slots.remove(&seq_id) {
            self.pool.release_state(s);
            self.free_slots.push(s);
        }
    }
}

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;
