//! The engine thread: each step plans (scheduler), drafts for every decode
//! sequence, runs ONE verifier forward over all prefill chunks and decode
//! rows, accepts per sequence, trims and registers blocks, and sends events.

use super::scheduler::Scheduler;
use super::sequence::Sequence;
use super::{
    Command, EngineConfig, EngineError, EngineStats, Event, FinishReason, KvSize, ProposerKind,
    SpecMethod, Usage,
};
use crate::kv::{BlockManager, SeqId};
use crate::metrics as names;
use crate::spec::{propose, verify_round, RoundInput, SpecError, SpecStats};
use crate::tokenizer::TextTokenizer;
use metrics as m;
use specgate_draft::{DraftPolicy, ModelDraft, NgramProposer, PolicyState, Proposal, Proposer};
use specgate_verify::{KvPool, LogitsWanted, Model, SeqInput};
use std::collections::{HashMap, VecDeque};
use std::sync::{mpsc, Arc, Mutex};

pub(crate) struct Engine {
    target: Model,
    pool: KvPool,
    draft: Option<ModelDraft>,
    ngram: NgramProposer,
    default_method: SpecMethod,
    tokenizer: Option<Arc<TextTokenizer>>,
    eos: Vec<u32>,
    bm: BlockManager,
    sched: Scheduler,
    policy: DraftPolicy,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    stats: EngineStats,
    /// What was last exported to the metrics recorder (for deltas).
    exported: EngineStats,
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
            ProposerKind::Draft(m) => m.kv_bytes_per_token(),
            _ => 0,
        };
        let num_blocks = match cfg.kv {
            KvSize::Blocks(n) => n,
            KvSize::MemoryBytes(bytes) => {
                let per_block = cfg.block_size * (target.kv_bytes_per_token() + draft_bytes);
                bytes / per_block.max(1)
            }
        };
        if num_blocks == 0 {
            return Err(invalid(format!(
                "the KV cache setting {:?} leaves no block",
                cfg.kv
            )));
        }
        let pool = KvPool::for_model(&target, num_blocks, cfg.block_size)
            .map_err(|e| invalid(e.to_string()))?;
        let (default_method, ngram, draft) = match proposer {
            ProposerKind::None => (SpecMethod::Off, NgramProposer::default(), None),
            ProposerKind::Ngram { min_n, max_n } => (
                SpecMethod::Ngram,
                NgramProposer::new(min_n, max_n).map_err(invalid)?,
                None,
            ),
            ProposerKind::Draft(m) => {
                let d = ModelDraft::new(Arc::new(m), num_blocks, cfg.block_size)
                    .map_err(|e| invalid(e.to_string()))?;
                d.check_compatible(target.config())
                    .map_err(|e| invalid(e.to_string()))?;
                (SpecMethod::Draft, NgramProposer::default(), Some(d))
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
            draft,
            ngram,
            default_method,
            tokenizer,
            eos,
            bm: BlockManager::new(num_blocks, cfg.block_size),
            sched: Scheduler::new(cfg.scheduler),
            policy: cfg.policy.clone(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            shared: Arc::new(Mutex::new(stats.clone())),
            exported: stats.clone(),
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

    pub(crate) fn has_draft(&self) -> bool {
        self.draft.is_some()
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
                    Command::Submit(mut seq) => {
                        seq.method = seq.req.method.unwrap_or(self.default_method);
                        m::counter!(names::PROMPT_TOKENS).increment(seq.req.prompt.len() as u64);
                        self.waiting.push_back(*seq);
                    }
                    Command::SetPolicy(p) => self.policy = p,
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
        self.export_metrics();
        *self.shared.lock().unwrap_or_else(|e| e.into_inner()) = self.stats.clone();
    }

    /// Gauges as they are now; counters by what changed since last time.
    fn export_metrics(&mut self) {
        let (s, e) = (&self.stats, &self.exported);
        m::gauge!(names::RUNNING).set(s.running as f64);
        m::gauge!(names::WAITING).set(s.waiting as f64);
        m::gauge!(names::KV_USAGE).set(self.bm.usage());
        let k = self.policy.k(s.running.max(1), &PolicyState::default());
        m::gauge!(names::SPEC_DRAFT_LENGTH).set(k as f64);
        m::counter!(names::PREEMPTIONS).increment(s.preemptions - e.preemptions);
        m::counter!(names::PREFIX_HITS).increment(s.prefix.hits - e.prefix.hits);
        m::counter!(names::PREFIX_QUERIES).increment(s.prefix.queries - e.prefix.queries);
        let (ns, os): (&SpecStats, &SpecStats) = (&s.spec, &e.spec);
        m::counter!(names::SPEC_DRAFTS).increment(ns.drafts - os.drafts);
        m::counter!(names::SPEC_DRAFT_TOKENS).increment(ns.draft_tokens - os.draft_tokens);
        m::counter!(names::SPEC_ACCEPTED_TOKENS).increment(ns.accepted_tokens - os.accepted_tokens);
        m::counter!(names::GENERATION_TOKENS).increment(ns.emitted_tokens - os.emitted_tokens);
        for (pos, &n) in ns.accepted_per_pos.iter().enumerate() {
            let before = os.accepted_per_pos.get(pos).copied().unwrap_or(0);
            if n > before {
                m::counter!(names::SPEC_ACCEPTED_PER_POS, "position" => pos.to_string())
                    .increment(n - before);
            }
        }
        self.exported = self.stats.clone();
    }

    fn release(&mut self, id: SeqId) {
        self.bm.free(id);
        if let Some(d) = self.draft.as_mut() {
            d.release(id);
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

    /// The k this sequence drafts now: its override or the policy, within
    /// its token budget and what the pool can hold.
    fn k_for(policy: &DraftPolicy, slots: usize, s: &Sequence, batch: usize) -> usize {
        if s.method == SpecMethod::Off {
            return 0;
        }
        let k = s
            .req
            .num_speculative_tokens
            .unwrap_or_else(|| policy.k(batch, &s.spec.policy_state));
        k.min(s.remaining().saturating_sub(1))
            .min(slots.saturating_sub(s.spec.tokens.len()))
    }

    fn step(&mut self) -> Result<(), SpecError> {
        self.drop_cancelled();
        let slots = self.bm.num_blocks() * self.bm.block_size();
        let policy = &self.policy;
        let k_of = |s: &Sequence, batch: usize| Self::k_for(policy, slots, s, batch);
        let plan = self
            .sched
            .plan(&mut self.waiting, &mut self.running, &mut self.bm, &k_of);
        for &id in &plan.preempted {
            self.stats.preemptions += 1;
            if let Some(d) = self.draft.as_mut() {
                d.release(id);
            }
        }
        for s in self.running.iter_mut().filter(|s| !s.admitted) {
            s.admitted = true;
            m::histogram!(names::QUEUE_TIME).record(s.arrived.elapsed().as_secs_f64());
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
        let mut methods = Vec::new();
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
                methods.push(s.method);
                rounds.push(RoundInput {
                    seq: &mut s.spec,
                    block_table: table,
                    k,
                });
            }
        }
        let mut proposals = vec![Proposal::default(); rounds.len()];
        let is = |want: SpecMethod| -> Vec<bool> { methods.iter().map(|&m| m == want).collect() };
        propose(
            &mut self.ngram,
            &mut rounds,
            &is(SpecMethod::Ngram),
            &mut proposals,
        )?;
        if let Some(d) = self.draft.as_mut() {
            propose(d, &mut rounds, &is(SpecMethod::Draft), &mut proposals)?;
        }
        let new = verify_round(
            &self.target,
            &mut self.pool,
            &self.policy,
            &mut rounds,
            &proposals,
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
                    let label = match reason {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                    };
                    m::counter!(names::REQUEST_SUCCESS, "finished_reason" => label).increment(1);
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
