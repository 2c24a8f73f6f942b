//! The engine thread: each step plans (scheduler), drafts for every decode
//! sequence, runs ONE verifier forward over all prefill chunks and decode
//! rows, accepts per sequence, trims and registers blocks, and sends events.

use super::scheduler::Scheduler;
use super::sequence::Sequence;
use super::{
    Command, EngineConfig, EngineError, EngineStats, Event, FinishReason, KvSize, ProposerKind,
    Usage,
};
use crate::kv::{BlockManager, SeqId};
use crate::spec::{spec_round, RoundInput, SpecError};
use crate::tokenizer::TextTokenizer;
use specgate_draft::{DraftPolicy, ModelDraft, NgramProposer, Proposer};
use specgate_verify::{KvPool, LogitsWanted, Model, SeqInput};
use std::collections::{HashMap, VecDeque};
use std::sync::{mpsc, Arc, Mutex};

pub(crate) struct Engine {
    target: Model,
    pool: KvPool,
    proposer: Option<Box<dyn Proposer>>,
    tokenizer: Option<Arc<TextTokenizer>>,
    eos: Vec<u32>,
    bm: BlockManager,
    sched: Scheduler,
    policy: DraftPolicy,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    stats: EngineStats,
    shared: Arc<Mutex<EngineStats>>,
}

impl Engine {
    pub(crate) fn new(
        target: Model,
        proposer: ProposerKind,
        tokenizer: Option<Arc<TextTokenizer>>,
        cfg: &EngineConfig,
    ) -> Result<Self, EngineError> {
        let invalid = |e: String| EngineError::Invalid(e);
        let draft_bytes = match &proposer {
            ProposerKind::Draft(m) => m.config().kv_bytes_per_token(),
            _ => 0,
        };
        let num_blocks = match cfg.kv {
            KvSize::Blocks(n) => n,
            KvSize::MemoryBytes(bytes) => {
                let per_block =
                    cfg.block_size * (target.config().kv_bytes_per_token() + draft_bytes);
                bytes / per_block.max(1)
            }
        };
        if num_blocks == 0 {
            return Err(invalid(format!(
                "the KV cache setting {:?} leaves no block",
                cfg.kv
            )));
        }
        let pool = KvPool::new(target.config(), num_blocks, cfg.block_size)
            .map_err(|e| invalid(e.to_string()))?;
        let proposer: Option<Box<dyn Proposer>> = match proposer {
            ProposerKind::None => None,
            ProposerKind::Ngram { min_n, max_n } => {
                Some(Box::new(NgramProposer::new(min_n, max_n).map_err(invalid)?))
            }
            ProposerKind::Draft(m) => {
                let d = ModelDraft::new(Arc::new(m), num_blocks, cfg.block_size)
                    .map_err(|e| invalid(e.to_string()))?;
                d.check_compatible(target.config())
                    .map_err(|e| invalid(e.to_string()))?;
                Some(Box::new(d))
            }
        };
        let eos = tokenizer
            .as_ref()
            .map(|t| t.eos_token_ids().to_vec())
            .unwrap_or_default();
        let stats = EngineStats {
            num_blocks,
            free_blocks: num_blocks,
            ..Default::default()
        };
        Ok(Self {
            target,
            pool,
            proposer,
            tokenizer,
            eos,
            bm: BlockManager::new(num_blocks, cfg.block_size),
            sched: Scheduler::new(cfg.scheduler),
            policy: cfg.policy.clone(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            shared: Arc::new(Mutex::new(stats.clone())),
            stats,
        })
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.bm.num_blocks()
    }

    pub(crate) fn vocab_size(&self) -> usize {
        self.target.config().vocab_size
    }

    pub(crate) fn max_position(&self) -> usize {
        self.target.config().max_position
    }

    /// The largest k any policy setting can ask for.
    pub(crate) fn max_k(&self) -> usize {
        if self.proposer.is_none() {
            return 0;
        }
        match &self.policy {
            DraftPolicy::Fixed { k } => *k,
            DraftPolicy::BatchTable(rows) => rows.iter().map(|r| r.1).max().unwrap_or(0),
            DraftPolicy::Adaptive { max_k, .. } => *max_k,
        }
    }

    pub(crate) fn shared_stats(&self) -> Arc<Mutex<EngineStats>> {
        self.shared.clone()
    }

    /// The thread body: take submissions, step while there is work, sleep
    /// on the channel while there is none.
    pub(crate) fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            let idle = self.running.is_empty() && self.waiting.is_empty();
            let first = if idle {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                None
            };
            let mut stop = false;
            for cmd in first.into_iter().chain(rx.try_iter()) {
                match cmd {
                    Command::Submit(seq) => self.waiting.push_back(*seq),
                    Command::Shutdown => stop = true,
                }
            }
            if stop {
                self.fail_all("the engine is shutting down");
                self.publish();
                return;
            }
            if let Err(e) = self.step() {
                self.fail_all(&format!("engine step failed: {e}"));
            }
            self.publish();
        }
    }

    fn publish(&mut self) {
        self.stats.running = self.running.len();
        self.stats.waiting = self.waiting.len();
        self.stats.free_blocks = self.bm.num_free();
        self.stats.prefix = self.bm.prefix_stats();
        *self.shared.lock().unwrap_or_else(|e| e.into_inner()) = self.stats.clone();
    }

    fn release(&mut self, id: SeqId) {
        self.bm.free(id);
        if let Some(p) = self.proposer.as_mut() {
            p.release(id);
        }
    }

    fn fail_all(&mut self, msg: &str) {
        let all: Vec<Sequence> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        for s in all {
            let _ = s.tx.send(Event::Error(msg.to_string()));
            self.release(s.spec.id);
        }
    }

    /// Drops sequences whose client went away, freeing their blocks.
    fn drop_cancelled(&mut self) {
        let mut gone = Vec::new();
        self.running.retain(|s| {
            let closed = s.tx.is_closed();
            if closed {
                gone.push(s.spec.id);
            }
            !closed
        });
        self.waiting.retain(|s| !s.tx.is_closed());
        for id in gone {
            self.stats.cancelled += 1;
            self.release(id);
        }
    }

    /// The largest k this sequence may draft now.
    fn k_for(policy: &DraftPolicy, has_proposer: bool, s: &Sequence, batch: usize) -> usize {
        if !has_proposer {
            return 0;
        }
        let k = s
            .req
            .num_speculative_tokens
            .unwrap_or_else(|| policy.k(batch, &s.spec.policy_state));
        k.min(s.remaining().saturating_sub(1))
    }

    fn step(&mut self) -> Result<(), SpecError> {
        self.drop_cancelled();
        let has_proposer = self.proposer.is_some();
        let policy = &self.policy;
        let k_of = |s: &Sequence, batch: usize| Self::k_for(policy, has_proposer, s, batch);
        let plan = self
            .sched
            .plan(&mut self.waiting, &mut self.running, &mut self.bm, &k_of);
        for &id in &plan.preempted {
            self.stats.preemptions += 1;
            if let Some(p) = self.proposer.as_mut() {
                p.release(id);
            }
        }
        if plan.is_empty() {
            return Ok(());
        }
        self.stats.steps += 1;
        let prefill: HashMap<SeqId, (usize, usize)> = plan
            .prefill
            .iter()
            .map(|&(id, s, n)| (id, (s, n)))
            .collect();
        let decode: HashMap<SeqId, usize> = plan.decode.iter().copied().collect();

        let mut prefills = Vec::new();
        let mut rounds = Vec::new();
        let mut lens = Vec::new();
        for s in self.running.iter_mut() {
            let id = s.spec.id;
            let table = self.bm.table(id).expect("running sequences hold blocks");
            if let Some(&(start, n)) = prefill.get(&id) {
                prefills.push(SeqInput {
                    tokens: &s.spec.tokens[start..start + n],
                    start_pos: start,
                    block_table: table,
                    logits: LogitsWanted::None,
                });
            } else if let Some(&k) = decode.get(&id) {
                lens.push((id, s.spec.tokens.len()));
                rounds.push(RoundInput {
                    seq: &mut s.spec,
                    block_table: table,
                    k,
                });
            }
        }
        let new = spec_round(
            &self.target,
            &mut self.pool,
            self.proposer.as_deref_mut(),
            &self.policy,
            &mut rounds,
            &prefills,
            &mut self.stats.spec,
        )?;
        drop(rounds);

        for &(id, start, n) in &plan.prefill {
            self.stats.prefill_tokens += n as u64;
            if let Some(s) = self.running.iter_mut().find(|s| s.spec.id == id) {
                s.computed = start + n;
                self.bm.register(id, &s.spec.tokens, s.computed);
            }
        }
        let mut finished = Vec::new();
        for ((id, old_len), toks) in lens.into_iter().zip(new) {
            let s = self
                .running
                .iter_mut()
                .find(|s| s.spec.id == id)
                .expect("decoded sequences are running");
            let k = decode[&id];
            s.drafted += k as u64;
            s.accepted += (toks.len() - 1) as u64;
            s.computed = s.spec.tokens.len() - 1;
            let reason = s.check_finished(old_len, &self.eos);
            let end = s.spec.tokens.len();
            let upto = if reason == Some(FinishReason::Stop) {
                end - 1
            } else {
                end
            };
            let ids = s.spec.tokens[old_len..upto].to_vec();
            let mut text = String::new();
            if let Some(tok) = &self.tokenizer {
                for &t in &ids {
                    // A token the detokenizer rejects yields no text; the
                    // ids still go out.
                    text.push_str(&s.detok.push(tok, t).unwrap_or_default());
                }
                if reason.is_some() {
                    text.push_str(&s.detok.finish());
                }
            }
            if !ids.is_empty() || !text.is_empty() {
                let _ = s.tx.send(Event::Tokens { ids, text });
            }
            match reason {
                Some(reason) => {
                    let _ = s.tx.send(Event::Finished {
                        reason,
                        usage: Usage {
                            prompt_tokens: s.req.prompt.len(),
                            completion_tokens: s.generated(),
                        },
                        drafted: s.drafted,
                        accepted: s.accepted,
                    });
                    finished.push(id);
                }
                None => {
                    let len = s.spec.tokens.len();
                    let _ = self.bm.trim(id, len);
                    self.bm.register(id, &s.spec.tokens, s.computed);
                }
            }
        }
        for id in finished {
            self.running.retain(|s| s.spec.id != id);
            self.stats.finished += 1;
            self.release(id);
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.fail_all("the engine stopped");
    }
}
