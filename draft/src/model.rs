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
}

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
            model,
            pool,
            cached: HashMap::new(),
        })
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

    /// Bytes of the draft's KV cache per token.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.pool.bytes_per_token()
    }

    /// The next draft after `pending` from one row of raw draft logits,
    /// with its q (None when greedy); `None` when processing fails.
    fn pick(
        logits: &mut [f32],
        req: &mut ProposeRequest,
        pending: &[u32],
    ) -> Option<(u32, Option<Vec<f32>>)> {
        req.sampler.process(logits, pending).ok()?;
        let params = *req.sampler.params();
        if params.is_greedy() {
            return Some((argmax(logits), None));
        }
        let q = params.warp(logits);
        Some((req.sampler.draw(&q), Some(q)))
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
        let starts: Vec<usize> = active
            .iter()
            .map(|&i| {
                let r = &batch[i];
                let valid = self
                    .cached
                    .get(&r.seq_id)
                    .map_or(0, |c| common_prefix(c, r.context));
                valid.min(r.context.len() - 1)
            })
            .collect();
        let inputs: Vec<SeqInput> = active
            .iter()
            .zip(&starts)
            .map(|(&i, &s)| SeqInput {
                tokens: &batch[i].context[s..],
                start_pos: s,
                block_table: batch[i].block_table,
                logits: LogitsWanted::Last,
                state_slot: 0,
            })
            .collect();
        let mut logits = self.model.forward_rows(&mut self.pool, &inputs)?;
        let mut qs: Vec<Vec<Vec<f32>>> = vec![Vec::new(); batch.len()];
        let mut step = 0;
        let mut live = active.clone();
        loop {
            for (row, &i) in logits.iter_mut().zip(&live) {
                let Some((tok, q)) = Self::pick(row, &mut batch[i], &out[i].tokens) else {
                    continue;
                };
                out[i].tokens.push(tok);
                if let Some(q) = q {
                    qs[i].push(q);
                }
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
                    state_slot: 0,
                })
                .collect();
            logits = self.model.forward_rows(&mut self.pool, &inputs)?;
        }
        for &i in &active {
            let r = &batch[i];
            // The cache now holds the context and every draft but the last.
            let fed = &out[i].tokens[..out[i].tokens.len().saturating_sub(1)];
            let c = self.cached.entry(r.seq_id).or_default();
            c.clear();
            c.extend_from_slice(r.context);
            c.extend_from_slice(fed);
            if !qs[i].is_empty() {
                out[i].q = Some(std::mem::take(&mut qs[i]));
            }
        }
        Ok(out)
    }

    fn release(&mut self, seq_id: u64) {
        self.cached.remove(&seq_id);
    }
}
