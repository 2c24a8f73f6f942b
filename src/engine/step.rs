//! The engine thread: each step runs in named stages (plan, propose,
//! verify, commit, emit): the scheduler plans, proposers draft for every
//! decode sequence, ONE verifier forward runs over all prefill chunks and
//! decode rows, acceptance decides per sequence, blocks are trimmed and
//! registered, and events are sent.
//!
//! Faults are contained per sequence: a batched stage that fails (an error
//! or a panic in a forward) is retried piece by piece, and only the
//! sequences that fail alone end, with an error event that points at the
//! log; the rest of the batch goes on. A panic outside the stages kills the
//! thread, which [`super::EngineHandle::died`] reports.
//!
//! A request's grammar failing ends that request alone, with the grammar's
//! message as its error event. Prompt chunks of a request that asked for
//! prompt logprobs ask the forward for every row's logits; the logprobs go
//! out as one event before the request's first tokens.

use super::calibrate::{self, Calibration};
use super::scheduler::Scheduler;
use super::sequence::Sequence;
use super::MAX_NGRAM;
use super::{
    Command, EngineConfig, EngineError, EngineStats, Event, Fault, FinishReason, KvSize,
    ProposerKind, SpecMethod, Usage, MAX_SPECULATIVE_TOKENS,
};
use crate::kv::row_states::{fit_rows, row_budget};
use crate::kv::{BlockManager, Checkpoints, SeqId, StateSlots};
use crate::metrics as names;
use crate::spec::{
    propose, round_rows, verify_round, PromptScoring, RoundInput, RoundOutput, Snapshot, SpecError,
    SpecStats,
};
use crate::tokenizer::TextTokenizer;
use metrics as m;
use specgate_draft::{
    guard, plan_widths, BranchSeq, CostModel, DraftChunk, DraftError, DraftPolicy, ModelDraft,
    ModelGuard, NgramProposer, PolicyState, Proposal, ProposeRequest, Proposer, StepLimits,
    StepSeq, SuffixPool, WidthStep,
};
use specgate_verify::accept::Verdict;
use specgate_verify::{KvPool, LogitsWanted, Model, SeqInput, TokenLogprob};
use std::collections::{HashMap, HashSet, VecDeque};
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
    /// Which running sequence holds which recurrent-state slot.
    slots: StateSlots,
    /// Bytes of one block (target and draft) and of one state slot, for
    /// the cache usage ratio.
    block_bytes: usize,
    slot_bytes: usize,
    sched: Scheduler,
    policy: DraftPolicy,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    stats: EngineStats,
    /// What was last exported to the metrics recorder (for deltas).
    exported: EngineStats,
    shared: Arc<Mutex<EngineStats>>,
    /// A fault a test asked for (see [`Fault`]).
    fault: Option<Fault>,
    /// What a step costs here, measured at start and kept current.
    cost: CostModel,
    /// Engine-wide acceptance per draft position, per proposer: where a
    /// sequence has not drafted that deep yet, the policy assumes these.
    priors: Priors,
    /// Steps since the policy last probed a sequence left at k = 0.
    steps_since_probe: u32,
    /// Mean k of the decoding sequences in the last plan (the draft-length
    /// gauge), and whether any of them drafts with the model.
    last_mean_k: f64,
    model_drafting: bool,
    /// The goodput plan's predicted seconds for this step, and the EMA of
    /// measured / predicted step time for plans that ran the draft model
    /// (`[0]`) and plans that did not (`[1]`): how far off the cost model
    /// is where it matters.
    predicted_secs: f64,
    prediction_ratio: [Option<f64>; 2],
    /// What drafting with the model really gained, per batch size, and
    /// where it is vetoed (goodput policy only).
    guard: ModelGuard,
    /// Lookups chained before the method's proposer: the cross-request
    /// pool (with whether it is one pool for all tenants) and the lookup
    /// in a draft-model sequence's own context.
    suffix: Option<SuffixPool>,
    suffix_global: bool,
    /// Branch nodes a sequence may add beside its chain per step (0 when
    /// the config says so or the target cannot verify trees).
    tree_branches: usize,
    /// Rows whose recurrent states one step may keep (`None`: the target
    /// has no recurrent state); drafts and branches shrink to fit.
    row_state_rows: Option<usize>,
    context_lookup: Option<NgramProposer>,
    /// This step's lookup guesses, found while planning (so the policy
    /// knows they cost no model step), by sequence.
    lookups: HashMap<SeqId, Lookup>,
}

/// Whether sequence `s`, given `k` drafts this step, drafts them with the
/// draft model (a draft-model sequence no lookup serves).
fn drafts_with_model(s: &Sequence, k: usize, lookups: &HashMap<SeqId, Lookup>) -> bool {
    k > 0 && s.method == SpecMethod::Draft && !lookups.contains_key(&s.spec.id)
}

/// A guess found by a lookup, and where: a chain, and other matched
/// continuations branching off it (see [`Proposal`]'s node numbering).
#[derive(Debug, Clone)]
struct Lookup {
    tokens: Vec<u32>,
    branches: Vec<(u32, Option<usize>)>,
    from_pool: bool,
}

/// Proposes the guesses found while planning.
struct Lookups<'a>(&'a HashMap<SeqId, Lookup>);

impl Proposer for Lookups<'_> {
    fn propose(&mut self, batch: &mut [ProposeRequest]) -> Result<Vec<Proposal>, DraftError> {
        Ok(batch
            .iter()
            .map(|r| {
                let Some(l) = self.0.get(&r.seq_id) else {
                    return Proposal::default();
                };
                let mut p = Proposal {
                    tokens: l.tokens.clone(),
                    branches: l.branches.clone(),
                    ..Proposal::default()
                };
                p.cut(r.k, r.branches);
                p
            })
            .collect())
    }
}

/// How much better than plain decoding the goodput policy must predict a
/// plan that runs the draft model to be (see `StepLimits::model_margin`):
/// the step cost model's error on such plans, a few percent once its
/// curves have settled, so that a predicted gain smaller than that is not
/// bought with a real loss.
const MODEL_MARGIN: f64 = 0.05;

/// The same for a plan that drafts by lookups only (`StepLimits::
/// lookup_margin`): the verify curve's own error on a step, measured at
/// about 2% here (`specgate_cost_model_prediction_ratio{plan="other"}`
/// settles within 1.00-1.03). Only plans whose whole gain is that small
/// are refused: at a few sequences a confident lookup gains tens of
/// percent.
const LOOKUP_MARGIN: f64 = 0.02;

/// Extra tokens per branch node assumed for a sequence before any of its
/// tree rounds was measured (then its own EMA takes over, see
/// [`specgate_draft::tree_shape`]): a prior, set low enough that a tree
/// is tried only where rows are nearly free.
const INITIAL_BRANCH_GAIN: f64 = 0.25;

/// The draft model's realized-gain check ([`ModelGuard`]): the EMA's
/// weight on the newest scored step, and while the model is vetoed at a
/// batch size, one step in this many may still use it (about 3% of such
/// steps pay for noticing that it pays again).
const GUARD_ALPHA: f64 = 0.1;
const GUARD_EXPLORE_EVERY: u64 = 32;

/// Acceptance priors by proposer: the draft model, lookups in a
/// sequence's own context (the n-gram method's), and the pool.
#[derive(Debug, Default)]
struct Priors {
    ngram: PolicyState,
    draft: PolicyState,
    pool: PolicyState,
}

impl Priors {
    /// The prior of what drafts for a sequence of `method` this step,
    /// given the lookup that serves it, if any.
    fn of(&self, method: SpecMethod, lookup: Option<&Lookup>) -> &PolicyState {
        match (lookup, method) {
            (Some(l), _) if l.from_pool => &self.pool,
            (None, SpecMethod::Draft) => &self.draft,
            _ => &self.ngram,
        }
    }

    fn of_mut(&mut self, method: SpecMethod, lookup: Option<&Lookup>) -> &mut PolicyState {
        match (lookup, method) {
            (Some(l), _) if l.from_pool => &mut self.pool,
            (None, SpecMethod::Draft) => &mut self.draft,
            _ => &mut self.ngram,
        }
    }
}

impl Engine {
    pub(crate) fn new(
        target: Model,
        proposer: ProposerKind,
        tokenizer: Option<Arc<TextTokenizer>>,
        cfg: &EngineConfig,
    ) -> Result<Self, EngineError> {
        let invalid = |e: String| EngineError::Invalid(e);
        // A hybrid target holds one recurrent-state slot per running
        // sequence besides its blocks: as many slots as sequences may run.
        let recurrent = target.has_recurrent_state();
        let state_slots = if recurrent {
            cfg.scheduler.max_num_seqs
        } else {
            0
        };
        let slot_bytes: usize =
            target.state_floats_per_rank().iter().sum::<usize>() * std::mem::size_of::<f32>();
        let draft_bytes = match &proposer {
            ProposerKind::Draft(m) => m.kv_bytes_per_token(),
            _ => 0,
        };
        let per_block = cfg.block_size * (target.kv_bytes_per_token() + draft_bytes);
        let num_blocks = match cfg.kv {
            KvSize::Blocks(n) => n,
            KvSize::MemoryBytes(bytes) => {
                bytes.saturating_sub(state_slots * slot_bytes) / per_block.max(1)
            }
        };
        if num_blocks == 0 {
            return Err(invalid(format!(
                "the KV cache setting {:?} leaves no block",
                cfg.kv
            )));
        }
        // A hybrid target's prefix hits need the recurrent state at the
        // boundary they resume from: checkpoint slots follow the
        // sequences' slots in the pool, as many as the budget holds (more
        // than one per block would never be used).
        let checkpoint_slots = if recurrent && cfg.prefix.enabled {
            (cfg.prefix.checkpoint_bytes / slot_bytes.max(1)).min(num_blocks)
        } else {
            0
        };
        let mut pool = KvPool::for_model_with_state_slots(
            &target,
            num_blocks,
            cfg.block_size,
            state_slots + checkpoint_slots,
        )
        .map_err(|e| invalid(e.to_string()))?;
        let mut bm = BlockManager::new(num_blocks, cfg.block_size);
        if !cfg.prefix.enabled {
            bm.disable_prefix_caching();
            tracing::info!("prefix caching off ([kv] prefix_caching = false)");
        } else if recurrent {
            bm.attach_checkpoints(Checkpoints::new(
                state_slots as u32,
                checkpoint_slots,
                slot_bytes,
                cfg.block_size,
            ));
            let budget_mib = cfg.prefix.checkpoint_bytes as f64 / (1 << 20) as f64;
            if checkpoint_slots == 0 {
                tracing::warn!(
                    state_slot_bytes = slot_bytes,
                    checkpoint_budget_mib = budget_mib,
                    "the state checkpoint budget holds no checkpoint of this target: \
                     prefix hits are impossible (raise [kv] state_checkpoint_mib)"
                );
            }
            tracing::info!(
                state_slots,
                state_slot_bytes = slot_bytes,
                checkpoint_slots,
                checkpoint_budget_mib = budget_mib,
                "target has recurrent layers: one state slot per running sequence; \
                 prefix caching with state checkpoints at block boundaries"
            );
        }
        let (default_method, ngram, mut draft) = match proposer {
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
        if let Some(o) = &cfg.suffix {
            o.pool.validate().map_err(invalid)?;
        }
        // A draft-model sequence first looks for a confident guess in its
        // own context (as long a match as the pool wants).
        let context_lookup = match (&cfg.suffix, default_method) {
            (Some(o), SpecMethod::Draft) => Some(
                NgramProposer::new(o.pool.min_match, o.pool.max_match.min(MAX_NGRAM))
                    .map_err(invalid)?,
            ),
            _ => None,
        };
        let max_rows = cfg.scheduler.max_num_batched_tokens;
        let cost = calibrate::measure(Calibration {
            target: &target,
            pool: &mut pool,
            draft: draft.as_mut(),
            bm: &mut bm,
            state_slot: 0,
            max_rows,
            max_seqs: cfg.scheduler.max_num_seqs,
            state_rows: row_budget(cfg.row_state_bytes, slot_bytes),
        })?
        .ok_or_else(|| invalid("the KV pool cannot hold one row to measure the model".into()))?;
        let stats = EngineStats {
            num_blocks,
            kv_bytes: num_blocks * per_block + state_slots * slot_bytes,
            free_blocks: num_blocks,
            prefix_caching: bm.prefix_caching(),
            state_slots,
            checkpoint_slots,
            checkpoint_slot_bytes: if checkpoint_slots > 0 { slot_bytes } else { 0 },
            row_state_rows: row_budget(cfg.row_state_bytes, slot_bytes).unwrap_or(0),
            ..Default::default()
        };
        let tree_branches = if target.supports_trees() {
            cfg.tree_branches
        } else {
            0
        };
        Ok(Self {
            target,
            pool,
            draft,
            ngram,
            default_method,
            tokenizer,
            eos,
            bm,
            slots: StateSlots::new(state_slots),
            block_bytes: per_block,
            slot_bytes,
            sched: Scheduler::new(cfg.scheduler),
            policy: cfg.policy.clone(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            shared: Arc::new(Mutex::new(stats.clone())),
            exported: stats.clone(),
            stats,
            fault: None,
            cost,
            priors: Priors::default(),
            steps_since_probe: 0,
            last_mean_k: 0.0,
            model_drafting: false,
            predicted_secs: 0.0,
            prediction_ratio: [None; 2],
            guard: ModelGuard::new(GUARD_ALPHA, GUARD_EXPLORE_EVERY),
            suffix: cfg.suffix.as_ref().map(|o| SuffixPool::new(o.pool.clone())),
            suffix_global: cfg.suffix.as_ref().is_some_and(|o| o.global),
            tree_branches,
            row_state_rows: row_budget(cfg.row_state_bytes, slot_bytes),
            context_lookup,
            lookups: HashMap::new(),
        })
    }

    /// Measures the cost model again (on demand), on blocks and a state
    /// slot no sequence holds; keeps the current one when none are free.
    fn recalibrate(&mut self) {
        const CALIBRATION: SeqId = SeqId::MAX;
        let slot = if self.slots.enabled {
            match self.slots.assign(CALIBRATION) {
                Some(s) => s,
                None => {
                    tracing::warn!("cost model not re-measured: every state slot is in use");
                    return;
                }
            }
        } else {
            0
        };
        let measured = calibrate::measure(Calibration {
            target: &self.target,
            pool: &mut self.pool,
            draft: self.draft.as_mut(),
            bm: &mut self.bm,
            state_slot: slot,
            max_rows: self.sched.config().max_num_batched_tokens,
            max_seqs: self.sched.config().max_num_seqs,
            state_rows: self.row_state_rows,
        });
        if let Some(s) = self.slots.release(CALIBRATION) {
            self.pool.release_state(s);
        }
        match measured {
            Ok(Some(c)) => self.cost = c,
            Ok(None) => tracing::warn!("cost model not re-measured: no free block"),
            Err(e) => tracing::warn!(error = %e, "cost model not re-measured"),
        }
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

    /// The tokenizer's end-of-sequence ids (none without a tokenizer).
    pub(crate) fn eos(&self) -> &[u32] {
        &self.eos
    }

    pub(crate) fn has_draft(&self) -> bool {
        self.draft.is_some()
    }

    pub(crate) fn default_method(&self) -> SpecMethod {
        self.default_method
    }

    pub(crate) fn shared_stats(&self) -> Arc<Mutex<EngineStats>> {
        self.shared.clone()
    }

    /// The thread body: take submissions, step while there is work, sleep
    /// on the channel while there is none.
    /// Returns `Some(reason)` when it ends because the target's rank group
    /// failed (a rank run as a process died, hung or failed its step):
    /// every request has its error event by then, and nothing can be
    /// served again.
    pub(crate) fn run(mut self, rx: mpsc::Receiver<Command>) -> Option<String> {
        loop {
            let idle = self.running.is_empty() && self.waiting.is_empty();
            let first = if idle {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return None,
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
                    Command::Calibrate => self.recalibrate(),
                    Command::Fault(Fault::EnginePanic) => panic!("injected engine fault"),
                    Command::Fault(f) => self.fault = Some(f),
                    Command::Shutdown => stop = true,
                }
            }
            if stop {
                self.fail_all("the engine is shutting down");
                self.publish();
                return None;
            }
            if let Some(Fault::SlowSteps(ms)) = self.fault {
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
            self.step();
            if let Some(why) = self.target.group_failure() {
                self.fail_all(&group_failed(&why));
                self.publish();
                return Some(why);
            }
            self.publish();
        }
    }

    fn publish(&mut self) {
        self.stats.running = self.running.len();
        self.stats.waiting = self.waiting.len();
        self.stats.free_blocks = self.bm.num_free();
        self.stats.prefix = self.bm.prefix_stats();
        if let Some(c) = self.bm.checkpoints() {
            self.stats.checkpoints = c.stats();
        }
        self.stats.state_slots_used = self.slots.used();
        self.stats.row_state_peak_bytes = self.pool.row_state_peak_bytes();
        let used = (self.bm.num_blocks() - self.bm.num_free()) * self.block_bytes
            + self.slots.used() * self.slot_bytes;
        self.stats.cache_usage = used as f64 / self.stats.kv_bytes.max(1) as f64;
        self.export_metrics();
        *self.shared.lock().unwrap_or_else(|e| e.into_inner()) = self.stats.clone();
    }

    /// Gauges as they are now; counters by what changed since last time.
    fn export_metrics(&mut self) {
        let (s, e) = (&self.stats, &self.exported);
        m::gauge!(names::RUNNING).set(s.running as f64);
        m::gauge!(names::WAITING).set(s.waiting as f64);
        m::gauge!(names::KV_USAGE).set(s.cache_usage);
        m::gauge!(names::PREFIX_ENABLED).set(if s.prefix_caching { 1.0 } else { 0.0 });
        m::gauge!(names::STATE_SLOTS).set(s.state_slots as f64);
        m::gauge!(names::STATE_SLOTS_USED).set(s.state_slots_used as f64);
        m::gauge!(names::SPEC_DRAFT_LENGTH).set(self.last_mean_k);
        for (plan, r) in ["draft_model", "other"]
            .into_iter()
            .zip(self.prediction_ratio)
        {
            if let Some(r) = r {
                m::gauge!(names::COST_PREDICTION_RATIO, "plan" => plan).set(r);
            }
        }
        for (lo, hi, gain, vetoed) in self.guard.scored() {
            let batch = if lo == hi {
                lo.to_string()
            } else {
                format!("{lo}-{hi}")
            };
            m::gauge!(names::SPEC_MODEL_GAIN, "batch" => batch.clone()).set(gain);
            m::gauge!(names::SPEC_MODEL_VETOED, "batch" => batch).set(f64::from(u8::from(vetoed)));
        }
        for &(rows, secs) in self.cost.verify.points() {
            m::gauge!(names::COST_VERIFY_SECONDS, "rows" => rows.to_string()).set(secs);
        }
        m::gauge!(names::COST_PROMPT_ROW_WEIGHT).set(self.cost.prompt_weight);
        if let Some(d) = &self.cost.draft {
            for &(rows, secs) in d.points() {
                m::gauge!(names::COST_DRAFT_STEP_SECONDS, "rows" => rows.to_string()).set(secs);
            }
        }
        m::counter!(names::PREEMPTIONS).increment(s.preemptions - e.preemptions);
        m::counter!(names::PREFIX_HITS).increment(s.prefix.hits - e.prefix.hits);
        m::counter!(names::PREFIX_QUERIES).increment(s.prefix.queries - e.prefix.queries);
        let (c, ce) = (&s.checkpoints, &e.checkpoints);
        m::counter!(names::CHECKPOINT_HITS).increment(c.hits - ce.hits);
        m::counter!(names::CHECKPOINT_MISSES).increment(c.misses - ce.misses);
        m::counter!(names::CHECKPOINT_SAVES).increment(c.saves - ce.saves);
        m::counter!(names::CHECKPOINT_EVICTIONS).increment(c.evictions - ce.evictions);
        m::counter!(names::CHECKPOINT_RESTORED_TOKENS)
            .increment(c.restored_tokens - ce.restored_tokens);
        m::gauge!(names::CHECKPOINTS_HELD).set(c.held as f64);
        m::gauge!(names::CHECKPOINT_BYTES).set((c.held as usize * s.checkpoint_slot_bytes) as f64);
        m::gauge!(names::CHECKPOINT_BUDGET_BYTES)
            .set((s.checkpoint_slots * s.checkpoint_slot_bytes) as f64);
        let (ns, os): (&SpecStats, &SpecStats) = (&s.spec, &e.spec);
        m::counter!(names::SPEC_DRAFTS).increment(ns.drafts - os.drafts);
        m::counter!(names::SPEC_DRAFT_TOKENS).increment(ns.draft_tokens - os.draft_tokens);
        m::counter!(names::SPEC_ACCEPTED_TOKENS).increment(ns.accepted_tokens - os.accepted_tokens);
        m::counter!(names::GENERATION_TOKENS).increment(ns.emitted_tokens - os.emitted_tokens);
        m::counter!(names::SPEC_GRAMMAR_DRAFT_TOKENS)
            .increment(ns.grammar_draft_tokens - os.grammar_draft_tokens);
        m::counter!(names::SPEC_GRAMMAR_ACCEPTED_TOKENS)
            .increment(ns.grammar_accepted_tokens - os.grammar_accepted_tokens);
        m::counter!(names::SPEC_CONTEXT_DRAFT_TOKENS)
            .increment(s.context_draft_tokens - e.context_draft_tokens);
        m::counter!(names::SPEC_POOL_DRAFT_TOKENS)
            .increment(s.pool_draft_tokens - e.pool_draft_tokens);
        m::counter!(names::SPEC_POOL_ACCEPTED_TOKENS)
            .increment(s.pool_accepted_tokens - e.pool_accepted_tokens);
        m::counter!(names::SPEC_GRAMMAR_FORCED_TOKENS)
            .increment(ns.grammar_forced_tokens - os.grammar_forced_tokens);
        m::counter!(names::SPEC_TREE_ROUNDS).increment(ns.tree_rounds - os.tree_rounds);
        m::counter!(names::SPEC_BRANCH_TOKENS).increment(ns.branch_tokens - os.branch_tokens);
        m::counter!(names::SPEC_BRANCH_WINS).increment(ns.branch_wins - os.branch_wins);
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
        if let Some(slot) = self.slots.release(id) {
            self.pool.release_state(slot);
        }
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

    /// Where this step's rows must end: the pool's slots, the target's
    /// context and, for a sequence drafting with the draft model, the
    /// draft's (see [`Room`]).
    fn room(&self) -> Room {
        Room {
            slots: self.bm.num_blocks() * self.bm.block_size(),
            target: self.target.config().max_position,
            draft: self.draft.as_ref().map_or(usize::MAX, |d| d.max_position()),
            pool_only: match self.fault {
                Some(Fault::PoolBoundedDrafts(id)) => Some(id),
                _ => None,
            },
        }
    }

    /// The most this sequence may draft now: 0 without speculation, else
    /// within its token budget and the rows [`Room`] leaves it.
    fn k_cap(room: Room, s: &Sequence) -> usize {
        if s.method == SpecMethod::Off {
            return 0;
        }
        MAX_SPECULATIVE_TOKENS
            .min(s.remaining().saturating_sub(1))
            .min(room.drafts(s))
    }

    /// What sequence `s`'s first draft-model step would feed: its context
    /// the draft has not run yet (at least the last token), spread over
    /// the steps it may still decode, since a catch-up is paid once and
    /// serves every later proposal.
    /// `held`: where its next proposal starts, if known (else nothing is).
    fn draft_rows(held: Option<usize>, s: &Sequence) -> Option<f64> {
        if s.method != SpecMethod::Draft {
            return None;
        }
        let behind = s.spec.tokens.len().saturating_sub(held.unwrap_or(0)).max(1);
        // Later steps emit about two tokens each when drafting pays.
        let steps = (s.remaining() as f64 / 2.0).clamp(1.0, 32.0);
        Some(1.0 + (behind - 1) as f64 / steps)
    }

    /// One step, in stages: plan, propose, verify, commit, emit. A failure
    /// of a batched stage is retried per sequence, so only the sequences
    /// that fail alone are ended (with an error event); the others go on.
    fn step(&mut self) {
        self.drop_cancelled();
        let planning = std::time::Instant::now();
        let Some(work) = self.plan() else {
            return;
        };
        let plan_secs = planning.elapsed().as_secs_f64();
        self.stats.steps += 1;
        let started = std::time::Instant::now();
        let proposals = self.propose_stage(&work.decodes);
        let propose_secs = started.elapsed().as_secs_f64();
        let started = std::time::Instant::now();
        // The verify round records acceptance in `spec.policy_state`: a
        // draft-model sequence a lookup served records it in its lookup
        // state instead (swapped in for the round, out after).
        self.swap_lookup_states(&work.decodes);
        let (decoded, prefilled) = self.verify_stage(&work, &proposals);
        self.swap_lookup_states(&work.decodes);
        let verify_secs = started.elapsed().as_secs_f64();
        let (forwards_secs, first_forward) =
            self.observe_costs(&work, &proposals, verify_secs, propose_secs);
        let started = std::time::Instant::now();
        self.draft_prefill(&work, &prefilled);
        let draft_prefill_secs = started.elapsed().as_secs_f64();
        let step_secs = propose_secs + verify_secs + draft_prefill_secs;
        let prefill_rows: usize = work.prefills.iter().map(|p| p.n).sum();
        let drafts: usize = proposals.iter().map(Proposal::nodes).sum();
        self.check_prediction(
            step_secs,
            [work.decodes.len(), prefill_rows, drafts],
            [
                plan_secs,
                propose_secs,
                forwards_secs,
                verify_secs,
                draft_prefill_secs,
            ],
        );
        self.score_model(
            &work,
            &proposals,
            &decoded,
            [verify_secs, step_secs],
            first_forward,
        );
        let mut ended = HashSet::new();
        for (p, r) in work.prefills.iter().zip(prefilled) {
            match r {
                Ok(lps) => self.commit_prefill(p, lps),
                Err(e) => {
                    self.fail_seq(p.idx, &e);
                    ended.insert(self.running[p.idx].spec.id);
                }
            }
        }
        for ((d, prop), r) in work.decodes.iter().zip(&proposals).zip(decoded) {
            let done = match r {
                Ok(v) => self.commit_decode(d, prop, v),
                Err(e) => {
                    self.fail_seq(d.idx, &e);
                    true
                }
            };
            if done {
                ended.insert(self.running[d.idx].spec.id);
            }
        }
        if !ended.is_empty() {
            self.running.retain(|s| !ended.contains(&s.spec.id));
            for id in ended {
                self.release(id);
            }
        }
    }

    /// Swaps the acceptance state of the draft-model sequences a lookup
    /// serves this step with their lookup state (an involution).
    fn swap_lookup_states(&mut self, decodes: &[Decode]) {
        for d in decodes {
            let s = &mut self.running[d.idx];
            if s.method == SpecMethod::Draft && self.lookups.contains_key(&s.spec.id) {
                std::mem::swap(&mut s.spec.policy_state, &mut s.lookup_state);
            }
        }
    }

    /// The scope of a sequence's cross-request pool.
    fn scope(global: bool, s: &Sequence) -> String {
        if global {
            String::new()
        } else {
            format!("{:016x}", s.req.tenant)
        }
    }

    /// The measured error of draft-model plans against other plans (1
    /// until both were measured), for `StepLimits::model_factor`.
    fn model_factor(&self) -> f64 {
        match self.prediction_ratio {
            [Some(model), Some(other)] if other > 0.0 => (model / other).clamp(0.5, 4.0),
            _ => 1.0,
        }
    }

    /// Whether the goodput plan would draft with the model for anyone if
    /// every running sequence decoded next step, each with its draft
    /// caught up (what prefilling the draft now buys): a burst of prompts
    /// arriving while nothing decodes runs through the draft only then.
    /// At a batch size where the model does not pay (a CPU whose verify
    /// rows are dear, or the guard's veto) the draft's prefill would cost
    /// a third of the target's for nothing; a sequence that drafts later
    /// catches up then, and the policy weighs that catch-up.
    fn batch_would_draft(&self) -> bool {
        let room = self.room();
        let seqs: Vec<StepSeq> = self
            .running
            .iter()
            .map(|s| StepSeq {
                state: &s.spec.policy_state,
                prior: self.priors.of(s.method, None),
                max_k: Self::k_cap(room, s),
                fixed_k: s.req.num_speculative_tokens,
                model_rows: (s.method == SpecMethod::Draft).then_some(1.0),
            })
            .collect();
        let n = seqs.len();
        let limits = StepLimits {
            budget: self.sched.config().max_num_batched_tokens,
            prefill_rows: 0,
            probe: false,
            draft_prefill_rows: 0,
            model_margin: MODEL_MARGIN,
            lookup_margin: LOOKUP_MARGIN,
            model_factor: self.model_factor(),
            no_model: self.guard.vetoed(n),
            no_model_probe: false,
        };
        let plan = self.policy.plan_step(&seqs, &self.cost, limits);
        self.running
            .iter()
            .zip(&plan.ks)
            .any(|(s, &k)| k > 0 && s.method == SpecMethod::Draft)
    }

    /// Finds this step's lookup guesses for the sequences ready to decode:
    /// an n-gram sequence in its own context (its method) and then the
    /// pool; a draft-model sequence in its own context with the pool's
    /// confidence, then the pool. What is found here is drafted instead of
    /// running the method's proposer (the cheapest confident proposer wins).
    fn find_lookups(&mut self) {
        self.lookups.clear();
        for s in &self.running {
            if s.method == SpecMethod::Off || s.computed + 1 != s.spec.tokens.len() {
                continue;
            }
            let ctx = &s.spec.tokens;
            let (k, w) = (MAX_SPECULATIVE_TOKENS, self.tree_branches);
            let own = match s.method {
                SpecMethod::Ngram => self.ngram.lookup_tree(ctx, k, w),
                _ => self
                    .context_lookup
                    .as_ref()
                    .map_or_else(Proposal::default, |n| n.lookup_tree(ctx, k, w)),
            };
            let found = if !own.tokens.is_empty() {
                Some(Lookup {
                    tokens: own.tokens,
                    branches: own.branches,
                    from_pool: false,
                })
            } else {
                let scope = Self::scope(self.suffix_global, s);
                self.suffix.as_mut().and_then(|p| {
                    p.lookup_tree(&scope, ctx, k, w).map(|m| Lookup {
                        tokens: m.tokens,
                        branches: m.branches,
                        from_pool: true,
                    })
                })
            };
            if let Some(l) = found {
                self.lookups.insert(s.spec.id, l);
            }
        }
    }

    /// Compares this step's measured time with what the goodput plan
    /// predicted (the cost model as it stood), per kind of plan: exported
    /// as `specgate_cost_model_prediction_ratio{plan}` and logged at debug.
    /// `stages`: seconds of planning, of the propose stage, of the draft
    /// forwards in it, of the verify stage and of the draft's prompt chunks
    /// (for the log); `rows`: decoding sequences, prompt rows and drafted
    /// tokens (for the log).
    fn check_prediction(&mut self, step_secs: f64, rows: [usize; 3], stages: [f64; 5]) {
        let predicted = std::mem::take(&mut self.predicted_secs);
        if predicted > 0.0 && step_secs > 0.0 {
            let ratio = step_secs / predicted;
            let which = usize::from(!self.model_drafting);
            let r = &mut self.prediction_ratio[which];
            *r = Some(r.map_or(ratio, |prev| prev + 0.05 * (ratio - prev)));
        }
        // Every step is logged, planned or not (predicted 0 where no
        // goodput plan priced it), so a run without speculation can be
        // compared with one with it step by step.
        tracing::debug!(
            predicted_ms = predicted * 1e3,
            measured_ms = step_secs * 1e3,
            plan_ms = stages[0] * 1e3,
            propose_ms = stages[1] * 1e3,
            draft_forwards_ms = stages[2] * 1e3,
            verify_ms = stages[3] * 1e3,
            draft_prefill_ms = stages[4] * 1e3,
            draft_model = self.model_drafting,
            decoding = rows[0],
            prompt_rows = rows[1],
            drafted = rows[2],
            "step time against the cost model"
        );
    }

    /// Scores a step that drafted with the model by its realized gain
    /// ([`guard::realized_gain`]): the tokens it emitted and its prompt
    /// rows per second, against the same step without the model's drafts,
    /// whose time is the measured verify pass less what the model's draft
    /// rows added to it (by the cost curve), without any draft forward.
    /// `secs`: the verify stage's and the whole step's; `first_forward`:
    /// rows and seconds of the proposal's first draft forward.
    ///
    /// While the model is vetoed at this batch size, the draft has not
    /// followed the sequences, so an exploring step's first forward
    /// catches up on all they decoded meanwhile: a one-off, not what
    /// drafting costs once the veto is lifted, so its share beyond one row
    /// per sequence is not counted against the model.
    fn score_model(
        &mut self,
        work: &Work,
        proposals: &[Proposal],
        decoded: &Decoded,
        [verify_secs, step_secs]: [f64; 2],
        first_forward: Option<(usize, f64)>,
    ) {
        let mut tokens = 0usize;
        let mut model_accepted = 0usize;
        let mut model_rows = 0usize;
        let mut model_seqs = 0usize;
        let prefill_rows: usize = work.prefills.iter().map(|p| p.n).sum();
        let mut decode_rows = 0usize;
        for ((d, p), v) in work.decodes.iter().zip(proposals).zip(decoded) {
            decode_rows += p.nodes() + 1;
            let accepted = v.as_ref().map_or(0, |v| v.accepted);
            tokens += 1 + accepted;
            if drafts_with_model(&self.running[d.idx], p.tokens.len(), &self.lookups) {
                model_rows += p.tokens.len();
                model_accepted += accepted;
                model_seqs += 1;
            }
        }
        if model_rows == 0 {
            return;
        }
        let n = work.decodes.len();
        let step_secs = match first_forward {
            Some((rows, secs)) if self.guard.vetoed(n) && rows > model_seqs => {
                step_secs - secs * (rows - model_seqs) as f64 / rows as f64
            }
            _ => step_secs,
        };
        let curve_rows = |decode| self.cost.verify_rows(decode, prefill_rows);
        let added = self.cost.verify.at(curve_rows(decode_rows))
            - self.cost.verify.at(curve_rows(decode_rows - model_rows));
        // The curve may be off for this one step; never credit the plain
        // step with less than half its own verify time.
        let without = (verify_secs - added.max(0.0)).max(verify_secs * 0.5);
        let Some(gain) = guard::realized_gain(
            tokens as f64,
            model_accepted as f64,
            prefill_rows as f64,
            step_secs,
            without,
        ) else {
            return;
        };
        if self.guard.record(n, gain) {
            let ema = self.guard.gain(n).unwrap_or(gain);
            if self.guard.vetoed(n) {
                self.stats.model_vetoes += 1;
            }
            if !self.guard.vetoed(n) {
                tracing::info!(
                    decoding = n,
                    gain = ema,
                    "draft model gains again at this batch size: back on"
                );
            } else {
                tracing::info!(
                    decoding = n,
                    gain = ema,
                    "draft model measured losing at this batch size: off (lookups still draft; \
                     one step in {GUARD_EXPLORE_EVERY} re-checks)"
                );
            }
        }
    }

    /// Keeps the cost model current from this step: the target forward
    /// (with acceptance: a verified row's sampling is part of its cost)
    /// and every draft-model forward of the propose stage, each scaled up
    /// by the stage's time around the forwards (processing and sampling
    /// each drafted row) so the curve prices a draft step whole. Returns
    /// the seconds spent in draft forwards, and the first forward's rows
    /// and seconds.
    fn observe_costs(
        &mut self,
        work: &Work,
        proposals: &[Proposal],
        verify_secs: f64,
        propose_secs: f64,
    ) -> (f64, Option<(usize, f64)>) {
        let prompt_rows: usize = work.prefills.iter().map(|p| p.n).sum();
        let decode_rows: usize = proposals.iter().map(|p| p.nodes() + 1).sum();
        self.cost
            .observe_verify(decode_rows, prompt_rows, verify_secs);
        if let Some(d) = self.draft.as_mut() {
            let forwards = d.take_timings();
            let in_forwards: f64 = forwards.iter().map(|f| f.1).sum();
            let whole = if in_forwards > 0.0 {
                (propose_secs / in_forwards).max(1.0)
            } else {
                1.0
            };
            let first = forwards.first().copied();
            for (rows, secs) in forwards {
                self.cost.observe_draft(rows, secs * whole);
            }
            return (in_forwards, first);
        }
        (0.0, None)
    }

    /// Plan: admission, preemption and this step's rows, by index into
    /// `running` (which stays put until the step ends). `None` when there
    /// is nothing to run.
    fn plan(&mut self) -> Option<Work> {
        let room = self.room();
        self.find_lookups();
        // Where each draft-model sequence's next proposal would start.
        let held: HashMap<SeqId, usize> = match &self.draft {
            Some(d) => self
                .running
                .iter()
                .filter(|s| s.method == SpecMethod::Draft)
                .map(|s| {
                    let table = self.bm.table(s.spec.id).unwrap_or(&[]);
                    (s.spec.id, d.catch_up_from(s.spec.id, &s.spec.tokens, table))
                })
                .collect(),
            None => HashMap::new(),
        };
        let (policy, cost, priors, draft) = (&self.policy, &self.cost, &self.priors, &self.draft);
        let lookups = &self.lookups;
        let model_factor = self.model_factor();
        let probe_every = match policy {
            DraftPolicy::Goodput { probe_every, .. } => *probe_every,
            _ => u32::MAX,
        };
        let probe = self.steps_since_probe + 1 >= probe_every;
        let (guard, step_no) = (&self.guard, self.stats.steps);
        let goodput = matches!(policy, DraftPolicy::Goodput { .. });
        let chosen = std::cell::Cell::new((false, 0.0, false, 0.0));
        let tree_branches = self.tree_branches;
        let row_state_rows = self.row_state_rows;
        // Per sequence: its chain drafts and branch nodes as planned (the
        // scheduler sees their sum, the rows and slots it reserves).
        let shapes = std::cell::RefCell::new(HashMap::new());
        let k_of = |ready: &[&Sequence], budget: usize, prefill_rows: usize| {
            let seqs: Vec<StepSeq> = ready
                .iter()
                .map(|s| {
                    let found = lookups.get(&s.spec.id);
                    let mut max_k = Self::k_cap(room, s);
                    let grammar = s.spec.sampler.processor().has_constraint();
                    if (found.is_some() || s.method == SpecMethod::Ngram) && !grammar {
                        // A lookup drafts what it found, nothing more (under
                        // a grammar, forced tokens may extend it up to k).
                        max_k = max_k.min(found.map_or(0, |l| l.tokens.len()));
                    }
                    StepSeq {
                        state: match (found, s.method) {
                            (Some(_), SpecMethod::Draft) => &s.lookup_state,
                            _ => &s.spec.policy_state,
                        },
                        prior: priors.of(s.method, found),
                        max_k,
                        fixed_k: s.req.num_speculative_tokens,
                        model_rows: match found {
                            Some(_) => None,
                            None => Self::draft_rows(held.get(&s.spec.id).copied(), s),
                        },
                    }
                })
                .collect();
            let limits = StepLimits {
                budget,
                prefill_rows,
                probe,
                draft_prefill_rows: if draft.is_some() { prefill_rows } else { 0 },
                model_margin: MODEL_MARGIN,
                lookup_margin: LOOKUP_MARGIN,
                model_factor,
                no_model: goodput && !guard.allows(ready.len(), step_no),
                no_model_probe: guard.gain(ready.len()).is_some_and(|g| g < 1.0),
            };
            let mut plan = policy.plan_step(&seqs, cost, limits);
            // Branches: where the target verifies trees (under a grammar
            // too: `spec::propose` keeps the paths it admits); a lookup
            // offers what it matched.
            let branch_seqs: Vec<BranchSeq> = ready
                .iter()
                .zip(&seqs)
                .zip(&plan.ks)
                .map(|((s, st), &k)| {
                    let left = room.drafts(s).saturating_sub(k);
                    let offered = match lookups.get(&s.spec.id) {
                        Some(l) => l.branches.len(),
                        None if s.method == SpecMethod::Draft => tree_branches,
                        None => 0,
                    };
                    BranchSeq {
                        k,
                        max: if s.method == SpecMethod::Off {
                            0
                        } else {
                            tree_branches.min(left).min(offered)
                        },
                        state: st.state,
                        prior: st.prior,
                    }
                })
                .collect();
            let decode_rows: usize = plan.ks.iter().map(|k| k + 1).sum();
            let mut widths = if goodput {
                let w = plan_widths(
                    &branch_seqs,
                    cost,
                    WidthStep {
                        decode_rows,
                        prompt_rows: prefill_rows,
                        budget_left: budget.saturating_sub(decode_rows + prefill_rows),
                        expected: plan.expected_tokens,
                        secs: plan.predicted_secs,
                        margin: LOOKUP_MARGIN,
                        initial_gain: INITIAL_BRANCH_GAIN,
                    },
                );
                (plan.expected_tokens, plan.predicted_secs) = (w.expected, w.secs);
                w.widths
            } else {
                branch_seqs
                    .iter()
                    .map(|b| if b.k > 0 { b.max } else { 0 })
                    .collect()
            };
            if let Some(rows) = row_state_rows {
                fit_rows(&mut plan.ks, &mut widths, rows);
            }
            let mut planned = shapes.borrow_mut();
            for ((s, &k), &w) in ready.iter().zip(&plan.ks).zip(&widths) {
                planned.insert(s.spec.id, (k, w));
            }
            let model = ready
                .iter()
                .zip(&plan.ks)
                .any(|(s, &k)| drafts_with_model(s, k, lookups));
            // The gauge: what goodput chose this step; what the other
            // policies set (before any cap), as before.
            let mean = match policy {
                DraftPolicy::Goodput { .. } => {
                    plan.ks.iter().sum::<usize>() as f64 / plan.ks.len().max(1) as f64
                }
                p => p.k(ready.len().max(1), &PolicyState::default()) as f64,
            };
            chosen.set((plan.probed.is_some(), mean, model, plan.predicted_secs));
            plan.ks.iter().zip(&widths).map(|(k, w)| k + w).collect()
        };
        let plan = self
            .sched
            .plan(&mut self.waiting, &mut self.running, &mut self.bm, &k_of);
        let (probed, mean_k, model_drafting, predicted_secs) = chosen.get();
        // The raw cost model's prediction: the error is measured against
        // it, not against the corrected one (which would chase itself).
        self.predicted_secs = if model_drafting {
            predicted_secs / model_factor
        } else {
            predicted_secs
        };
        self.steps_since_probe = if probed {
            0
        } else {
            self.steps_since_probe.saturating_add(1)
        };
        self.last_mean_k = mean_k;
        self.model_drafting = model_drafting;
        for &id in &plan.preempted {
            self.stats.preemptions += 1;
            // Recompute starts the state over from position 0.
            if let Some(slot) = self.slots.release(id) {
                self.pool.release_state(slot);
            }
            if let Some(d) = self.draft.as_mut() {
                d.release(id);
            }
        }
        self.restore_checkpoints();
        for s in self.running.iter_mut().filter(|s| !s.admitted) {
            s.admitted = true;
            s.queued = s.arrived.elapsed();
            m::histogram!(names::QUEUE_TIME).record(s.queued.as_secs_f64());
        }
        if plan.is_empty() {
            return None;
        }
        let prefill: HashMap<SeqId, (usize, usize)> = plan
            .prefill
            .iter()
            .map(|&(id, s, n)| (id, (s, n)))
            .collect();
        let decode: HashMap<SeqId, usize> = plan.decode.iter().copied().collect();
        let mut work = Work::default();
        for (idx, s) in self.running.iter().enumerate() {
            let id = s.spec.id;
            if let Some(&(start, n)) = prefill.get(&id) {
                work.prefills.push(Prefill { idx, start, n });
            } else if let Some(&rows) = decode.get(&id) {
                // The scheduler may have cut the planned shape to fit the
                // budget: the chain keeps its drafts first. Whatever was
                // planned, no row goes past what the sequence has room
                // for (the context's end), so no forward is refused for it.
                let (k, w) = shapes.borrow().get(&id).copied().unwrap_or((rows, 0));
                let left = room.drafts(s);
                let k = k.min(rows).min(left);
                work.decodes.push(Decode {
                    idx,
                    k,
                    branches: w.min(rows - k).min(left - k),
                    old_len: s.spec.tokens.len(),
                });
            }
        }
        Some(work)
    }

    /// Propose: drafts for every decode row: the lookups found while
    /// planning (n-gram sequences, and draft-model sequences a lookup
    /// served), then one draft-model batch for the rest. A draft that
    /// fails on a sequence alone leaves it undrafted from now on (plain
    /// decoding is still exact); the others keep their drafts.
    fn propose_stage(&mut self, decodes: &[Decode]) -> Vec<Proposal> {
        let mut out = vec![Proposal::default(); decodes.len()];
        let looked: Vec<bool> = decodes
            .iter()
            .map(|d| self.lookups.contains_key(&self.running[d.idx].spec.id))
            .collect();
        // n-gram sequences go through the lookup proposer even when it found
        // nothing: shaping may still extend the empty guess with the tokens
        // a grammar forces.
        let by_lookup: Vec<bool> = decodes
            .iter()
            .zip(&looked)
            .map(|(d, &l)| l || self.running[d.idx].method == SpecMethod::Ngram)
            .collect();
        if by_lookup.contains(&true) {
            let (_, _, mut rounds) =
                inputs(&mut self.running, &self.bm, &self.slots, &[], decodes, &[]);
            let mut lookups = Lookups(&self.lookups);
            // Lookups do not fail; a grammar cut is part of shaping.
            if let Err(e) = propose(&mut lookups, &mut rounds, &by_lookup, &mut out) {
                tracing::warn!(error = %e, "lookup drafting failed");
            }
        }
        // The draft model, for the draft-model sequences no lookup served.
        let sel: Vec<bool> = decodes
            .iter()
            .map(|d| drafts_with_model(&self.running[d.idx], d.k, &self.lookups))
            .collect();
        if !sel.contains(&true) {
            return out;
        }
        self.stats.model_steps += 1;
        if let Some(Fault::SlowDraft(ms)) = self.fault {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        let Err(e) = self.try_propose(decodes, &sel, &mut out) else {
            return out;
        };
        tracing::warn!(error = %e, "batched drafting failed; retrying per sequence");
        for (i, d) in decodes.iter().enumerate().filter(|(i, _)| sel[*i]) {
            // The failed batch may have left the draft's view of any of
            // them half-advanced: it starts over from the tokens.
            let id = self.running[d.idx].spec.id;
            if let Some(dm) = self.draft.as_mut() {
                dm.release(id);
            }
            let mut one = vec![false; decodes.len()];
            one[i] = true;
            if let Err(e) = self.try_propose(decodes, &one, &mut out) {
                tracing::warn!(
                    engine_request = id,
                    error = %e,
                    "drafting failed for one sequence; it continues without speculation"
                );
                self.running[d.idx].method = SpecMethod::Off;
                out[i] = Proposal::default();
                if let Some(dm) = self.draft.as_mut() {
                    dm.release(id);
                }
            }
        }
        out
    }

    /// Drafts with the draft model for the decodes `sel` picks.
    fn try_propose(
        &mut self,
        decodes: &[Decode],
        sel: &[bool],
        out: &mut [Proposal],
    ) -> Result<(), StepError> {
        let (_, _, mut rounds) =
            inputs(&mut self.running, &self.bm, &self.slots, &[], decodes, &[]);
        let Some(d) = self.draft.as_mut() else {
            return Ok(());
        };
        contained(|| propose(d, &mut rounds, sel, out))
    }

    /// Verify: each piece is checked alone first (a piece the forward
    /// would refuse ends its own sequence, never its batch: a recurrent
    /// target could not run a failed batch again), then ONE verifier
    /// forward runs over every other prefill chunk and decode row, then
    /// acceptance.
    fn verify_stage(&mut self, work: &Work, proposals: &[Proposal]) -> (Decoded, Prefilled) {
        let (bad_pre, bad_dec) = self.screen(work, proposals);
        if bad_pre.iter().chain(&bad_dec).all(Option::is_none) {
            return self.verify_batch(work, proposals);
        }
        let mut kept = Work::default();
        let mut kept_props = Vec::new();
        for (p, bad) in work.prefills.iter().zip(&bad_pre) {
            if bad.is_none() {
                kept.prefills.push(p.clone());
            }
        }
        for ((d, prop), bad) in work.decodes.iter().zip(proposals).zip(&bad_dec) {
            if bad.is_none() {
                kept.decodes.push(d.clone());
                kept_props.push(prop.clone());
            }
        }
        let (mut decoded, mut prefilled) = if kept.prefills.is_empty() && kept.decodes.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            self.verify_batch(&kept, &kept_props)
        };
        // Back in the step's order: each refused piece's error in its place.
        let (mut dec, mut pre) = (decoded.drain(..), prefilled.drain(..));
        let prefilled = bad_pre
            .into_iter()
            .map(|bad| match bad {
                Some(e) => Err(e),
                None => pre.next().unwrap_or(Err(StepError::Missing)),
            })
            .collect();
        let decoded = bad_dec
            .into_iter()
            .map(|bad| match bad {
                Some(e) => Err(e),
                None => dec.next().unwrap_or(Err(StepError::Missing)),
            })
            .collect();
        (decoded, prefilled)
    }

    /// Checks every piece of the step alone as the forward would
    /// ([`Model::check_input`]): per prompt chunk and per decode (its last
    /// token, chain and branches), the error that would refuse it.
    fn screen(
        &self,
        work: &Work,
        proposals: &[Proposal],
    ) -> (Vec<Option<StepError>>, Vec<Option<StepError>>) {
        let check = |s: &Sequence, tokens: &[u32], start_pos: usize| {
            let input = SeqInput {
                tokens,
                start_pos,
                block_table: self.bm.table(s.spec.id).unwrap_or(&[]),
                logits: LogitsWanted::All,
                state_slot: self.slots.of(s.spec.id).unwrap_or(0),
            };
            let r = self.target.check_input(&self.pool, &input);
            r.err().map(|e| {
                tracing::error!(
                    engine_request = s.spec.id,
                    error = %e,
                    "a piece of the step would fail the forward; ending that sequence alone"
                );
                StepError::Spec(SpecError::Target(e))
            })
        };
        let pre = work
            .prefills
            .iter()
            .map(|p| {
                let s = &self.running[p.idx];
                check(s, &s.spec.tokens[p.start..p.start + p.n], p.start)
            })
            .collect();
        let dec = work
            .decodes
            .iter()
            .zip(proposals)
            .map(|(d, prop)| {
                let s = &self.running[d.idx];
                let rows = round_rows(&s.spec.tokens, prop);
                check(s, &rows, s.spec.tokens.len() - 1)
            })
            .collect();
        (pre, dec)
    }

    /// [`verify_stage`](Self::verify_stage)'s forward over pieces that
    /// passed their checks. If it fails, each piece is run alone so a
    /// fault is pinned on the sequences that have it (a recurrent target,
    /// whose states a failed forward may have advanced, ends them all).
    fn verify_batch(&mut self, work: &Work, proposals: &[Proposal]) -> (Decoded, Prefilled) {
        match self.try_verify(&work.prefills, &work.decodes, proposals) {
            Ok(out) => (
                out.verdicts.into_iter().map(verdict).collect(),
                out.prompt_logprobs.into_iter().map(Ok).collect(),
            ),
            // A forward that failed midway may have advanced some recurrent
            // states already; running those sequences again would feed
            // their tokens twice. (An injected fault fails before any.)
            Err(e) if self.slots.enabled && !matches!(e, StepError::Injected(_)) => {
                tracing::warn!(error = %e, "a batched verifier forward of a recurrent model failed; \
                                            ending its sequences");
                let msg = e.to_string();
                (
                    work.decodes
                        .iter()
                        .map(|_| Err(StepError::Panicked(msg.clone())))
                        .collect(),
                    work.prefills
                        .iter()
                        .map(|_| Err(StepError::Panicked(msg.clone())))
                        .collect(),
                )
            }
            Err(e) => {
                tracing::warn!(error = %e, "a batched verifier forward failed; retrying per sequence");
                let prefilled = work
                    .prefills
                    .iter()
                    .map(|p| {
                        self.try_verify(std::slice::from_ref(p), &[], &[])
                            .map(|mut out| out.prompt_logprobs.pop().unwrap_or_default())
                    })
                    .collect();
                let decoded = work
                    .decodes
                    .iter()
                    .zip(proposals)
                    .map(|(d, prop)| {
                        self.try_verify(&[], std::slice::from_ref(d), std::slice::from_ref(prop))
                            .and_then(|mut out| match out.verdicts.pop() {
                                Some(v) => verdict(v),
                                None => Err(StepError::Missing),
                            })
                    })
                    .collect();
                (decoded, prefilled)
            }
        }
    }

    fn try_verify(
        &mut self,
        prefills: &[Prefill],
        decodes: &[Decode],
        proposals: &[Proposal],
    ) -> Result<RoundOutput, StepError> {
        let fault = self.fault.filter(|f| {
            let carried = |id| {
                prefills
                    .iter()
                    .map(|p| p.idx)
                    .chain(decodes.iter().map(|d| d.idx))
                    .any(|i| self.running[i].spec.id == id)
            };
            matches!(*f, Fault::ForwardError(id) | Fault::ForwardPanic(id) if carried(id))
        });
        for i in prefills
            .iter()
            .map(|p| p.idx)
            .chain(decodes.iter().map(|d| d.idx))
        {
            let id = self.running[i].spec.id;
            if self.slots.assign(id).is_none() {
                // Running sequences never outnumber the slots (both are
                // `max_num_seqs`); this would be a bookkeeping bug.
                return Err(StepError::NoStateSlot(id));
            }
        }
        let shapes: Vec<(SeqId, usize, usize)> = decodes
            .iter()
            .map(|d| {
                let s = &self.running[d.idx];
                (s.spec.id, s.spec.tokens.len(), d.k + d.branches)
            })
            .collect();
        let snaps = self.snapshots(&shapes);
        let slots = &self.slots;
        let (pre, scoring, mut rounds) = inputs(
            &mut self.running,
            &self.bm,
            slots,
            prefills,
            decodes,
            &snaps,
        );
        let (target, pool, policy, spec) = (
            &self.target,
            &mut self.pool,
            &self.policy,
            &mut self.stats.spec,
        );
        let out = contained(|| {
            match fault {
                Some(Fault::ForwardError(id)) => return Err(StepError::Injected(id)),
                Some(Fault::ForwardPanic(id)) => panic!("injected forward panic (request {id})"),
                _ => {}
            }
            Ok(verify_round(
                target,
                pool,
                policy,
                &mut rounds,
                proposals,
                &pre,
                &scoring,
                spec,
            )?)
        })?;
        let saved: Vec<(SeqId, usize)> = shapes
            .iter()
            .zip(&out.snapshots)
            .filter_map(|(&(id, ..), at)| at.map(|at| (id, at)))
            .collect();
        self.snapshots_saved(&saved);
        Ok(out)
    }

    /// The draft model runs the prompt chunks the target just prefilled (for
    /// sequences drafting with it), so their first proposal does not run
    /// the whole prompt through the draft in one go. A failure only costs
    /// that: those sequences' drafts catch up later, as before.
    fn draft_prefill(&mut self, work: &Work, done: &Prefilled) {
        // While the policy drafts with the model for no one (load makes it
        // too dear), prompts skip the draft too: a sequence that drafts
        // later catches up then, and the policy weighs that catch-up. With
        // nothing decoding (a burst of prompts), the plan for the batch
        // they make decides. (The step's decode rows, not the sequences'
        // tokens: verification has already appended this step's tokens.)
        if matches!(self.policy, DraftPolicy::Goodput { .. }) {
            let drafts = if work.decodes.is_empty() {
                self.batch_would_draft()
            } else {
                self.model_drafting
            };
            if !drafts {
                return;
            }
        }
        let prefills = &work.prefills;
        let (Some(draft), running, bm) = (self.draft.as_mut(), &self.running, &self.bm) else {
            return;
        };
        let chunks: Vec<DraftChunk> = prefills
            .iter()
            .zip(done)
            .filter(|(p, r)| r.is_ok() && running[p.idx].method == SpecMethod::Draft)
            .map(|(p, _)| {
                let s = &running[p.idx];
                DraftChunk {
                    seq_id: s.spec.id,
                    tokens: &s.spec.tokens,
                    start: p.start,
                    n: p.n,
                    block_table: bm.table(s.spec.id).unwrap_or(&[]),
                }
            })
            .collect();
        if chunks.is_empty() {
            return;
        }
        let ids: Vec<SeqId> = chunks.iter().map(|c| c.seq_id).collect();
        match contained(|| draft.prefill(&chunks).map_err(SpecError::from)) {
            Ok(rows) => self.stats.draft_prefill_tokens += rows as u64,
            Err(e) => {
                tracing::warn!(error = %e, "draft prefill failed; those drafts catch up later");
                for id in ids {
                    draft.release(id);
                }
            }
        }
    }

    /// Commit a prompt chunk: its K/V is in the cache; full blocks become
    /// shareable. `scored` (the chunk's prompt logprobs, when it asked:
    /// see [`PromptScoring`]) extends the sequence's prompt logprobs.
    fn commit_prefill(&mut self, p: &Prefill, scored: Vec<TokenLogprob>) {
        self.stats.prefill_tokens += p.n as u64;
        let s = &mut self.running[p.idx];
        if let Some(lps) = s.prompt_lps.as_mut() {
            lps.extend(scored);
        }
        s.computed = p.start + p.n;
        self.bm.register(s.spec.id, &s.spec.tokens, s.computed);
        let (id, computed) = (s.spec.id, s.computed);
        self.save_checkpoint(id, computed);
    }

    /// Commit a verified decode row (its new tokens are already appended)
    /// and emit them. Returns whether the sequence has finished.
    fn commit_decode(&mut self, d: &Decode, p: &Proposal, v: Verdict) -> bool {
        let drafted = p.nodes();
        let s = &mut self.running[d.idx];
        s.drafted += drafted as u64;
        s.accepted += v.accepted as u64;
        match self.lookups.get(&s.spec.id) {
            Some(l) if l.from_pool => {
                self.stats.pool_draft_tokens += drafted as u64;
                self.stats.pool_accepted_tokens += v.accepted as u64;
            }
            Some(_) => self.stats.context_draft_tokens += drafted as u64,
            None => {}
        }
        let lookup = self.lookups.get(&s.spec.id);
        // The prior learns chains (a branch's path counts up to its depth
        // on the chain's scale).
        let chain = p.tokens.len();
        self.policy.observe(
            self.priors.of_mut(s.method, lookup),
            chain,
            v.accepted.min(chain),
        );
        s.computed = s.spec.tokens.len() - 1;
        let context = self.target.config().max_position;
        let reason = s.check_finished(d.old_len, &self.eos, context);
        emit(s, self.tokenizer.as_deref(), d.old_len, reason, v.logprobs);
        match reason {
            Some(_) => {
                self.stats.finished += 1;
                // The next turn of a conversation starts where this ends:
                // its blocks and its state at the last boundary it passed.
                self.bm.register(s.spec.id, &s.spec.tokens, s.computed);
                self.bm.commit_tail(s.spec.id);
                if let Some(pool) = self.suffix.as_mut() {
                    let scope = Self::scope(self.suffix_global, s);
                    pool.insert(&scope, &s.spec.tokens);
                }
                true
            }
            None => {
                let id = s.spec.id;
                let _ = self.bm.trim(id, s.spec.tokens.len());
                self.bm.register(id, &s.spec.tokens, s.computed);
                false
            }
        }
    }

    /// Ends one sequence with an error event; the details stay in the log,
    /// except a grammar's message, which is the request's own business.
    fn fail_seq(&mut self, idx: usize, e: &StepError) {
        let s = &self.running[idx];
        let id = s.spec.id;
        self.stats.failed += 1;
        if let StepError::Spec(SpecError::Constraint(c)) = e {
            tracing::warn!(engine_request = id, error = %c, "request ended by its grammar");
            let _ = s.tx.send(Event::Error(c.to_string()));
            return;
        }
        tracing::error!(engine_request = id, error = %e, "request failed in the engine");
        if let Some(why) = self.target.group_failure() {
            let _ = s.tx.send(Event::Error(group_failed(&why)));
            return;
        }
        let _ = s.tx.send(Event::Error(format!(
            "internal error: the server could not process this request (engine request {id}); \
             the server log has the details"
        )));
    }
}

/// What a request hears when the target's rank group failed under it.
fn group_failed(why: &str) -> String {
    format!("the model's rank group failed ({why}); the server is restarting")
}

/// Emit: the prompt logprobs if they are due (once, before any tokens),
/// the tokens a sequence gained since `old_len` (less a final stop token)
/// as text with their `logprobs` (one per token gained, or none), then its
/// finish if it has one.
fn emit(
    s: &mut Sequence,
    tokenizer: Option<&TextTokenizer>,
    old_len: usize,
    reason: Option<FinishReason>,
    mut logprobs: Vec<TokenLogprob>,
) {
    if let Some(lps) = s.prompt_lps.take() {
        let _ = s.tx.send(Event::PromptLogprobs(lps));
    }
    let end = s.spec.tokens.len();
    let upto = if reason == Some(FinishReason::Stop) {
        end - 1
    } else {
        end
    };
    let ids = s.spec.tokens[old_len..upto].to_vec();
    logprobs.truncate(ids.len());
    let mut text = String::new();
    let mut markers = Vec::new();
    if let Some(tok) = tokenizer {
        for &t in &ids {
            // A token the detokenizer rejects yields no text; the ids
            // still go out.
            let (piece, marker) = s.detok.push_marked(tok, t).unwrap_or_default();
            if let Some(at) = marker {
                markers.push((text.len() + at, t));
            }
            text.push_str(&piece);
        }
        if reason.is_some() {
            text.push_str(&s.detok.finish());
        }
    }
    if !ids.is_empty() || !text.is_empty() {
        let _ = s.tx.send(Event::Tokens {
            ids,
            text,
            logprobs,
            markers,
        });
    }
    if let Some(reason) = reason {
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
            method: s.method,
            queue_time: s.queued,
        });
    }
}

/// Where a step's rows must end. A decode feeds a sequence's last token
/// and its drafts at the slots after it (a tree's nodes take one slot
/// each, whatever their depth), and the forward refuses a row past the
/// model's context or the pool: so drafts and branches are bounded here,
/// before any forward, and a sequence near the end drafts fewer.
#[derive(Debug, Clone, Copy)]
struct Room {
    /// Token slots of the KV pool.
    slots: usize,
    /// The target's context (positions).
    target: usize,
    /// The draft model's context (`usize::MAX` without one): a sequence
    /// drafting with it writes its drafts into the draft's cache too.
    draft: usize,
    /// A request planned against the pool alone ([`Fault::PoolBoundedDrafts`]).
    pool_only: Option<SeqId>,
}

impl Room {
    /// Rows the step may add for `s` past its last token (chain drafts
    /// and branch nodes together).
    fn drafts(&self, s: &Sequence) -> usize {
        if self.pool_only == Some(s.spec.id) {
            return self.slots.saturating_sub(s.spec.tokens.len());
        }
        let mut end = self.slots.min(self.target);
        if s.method == SpecMethod::Draft {
            end = end.min(self.draft);
        }
        end.saturating_sub(s.spec.tokens.len())
    }
}

/// A prompt chunk of this step: `tokens[start..start + n]` of `running[idx]`.
#[derive(Clone)]
struct Prefill {
    idx: usize,
    start: usize,
    n: usize,
}

/// A decode row group of this step: `running[idx]` verifies its last token
/// plus up to `k` drafts; it held `old_len` tokens before.
#[derive(Clone)]
struct Decode {
    idx: usize,
    /// Chain drafts.
    k: usize,
    /// Branch nodes besides the chain (a token tree when > 0).
    branches: usize,
    old_len: usize,
}

/// One step's work; `decodes` in ascending `idx` (proposals align with it).
#[derive(Default)]
struct Work {
    prefills: Vec<Prefill>,
    decodes: Vec<Decode>,
}

type Decoded = Vec<Result<Verdict, StepError>>;
/// Per prompt chunk: the raw logits rows it asked for.
type Prefilled = Vec<Result<Vec<TokenLogprob>, StepError>>;

/// A sequence's verdict, or its grammar error as a step error.
fn verdict(v: Result<Verdict, specgate_verify::ConstraintError>) -> Result<Verdict, StepError> {
    v.map_err(|e| StepError::Spec(SpecError::Constraint(e)))
}

/// Why a stage failed for the sequences it carried.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("panic: {0}")]
    Panicked(String),
    #[error("injected fault (request {0})")]
    Injected(u64),
    #[error("the verifier returned no verdict for a sequence")]
    Missing,
    #[error("no recurrent-state slot free for request {0}")]
    NoStateSlot(u64),
}

/// Runs `f`, turning a panic (a kernel's, a world-1 forward's) into an
/// error so it is contained like any other failure of the stage.
fn contained<T, E: Into<StepError>>(f: impl FnOnce() -> Result<T, E>) -> Result<T, StepError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(Into::into),
        Err(p) => Err(StepError::Panicked(
            p.downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown".into()),
        )),
    }
}

/// The verifier's inputs for the selected pieces: prompt chunks (with what
/// each wants scored for prompt logprobs), and one round per decode (in
/// `decodes` order, which is `running` order).
fn inputs<'a>(
    running: &'a mut [Sequence],
    bm: &'a BlockManager,
    slots: &StateSlots,
    prefills: &[Prefill],
    decodes: &[Decode],
    snapshots: &[Option<Snapshot>],
) -> (
    Vec<SeqInput<'a>>,
    Vec<Option<PromptScoring<'a>>>,
    Vec<RoundInput<'a>>,
) {
    let mut pre = Vec::with_capacity(prefills.len());
    let mut scoring = Vec::with_capacity(prefills.len());
    let mut rounds = Vec::with_capacity(decodes.len());
    let (mut pi, mut di) = (prefills.iter().peekable(), decodes.iter().peekable());
    let mut snaps = snapshots.iter().copied();
    // A sequence the scheduler planned always holds blocks; an empty table
    // would make the forward fail, and that failure is contained.
    for (idx, s) in running.iter_mut().enumerate() {
        let table = bm.table(s.spec.id).unwrap_or(&[]);
        let state_slot = slots.of(s.spec.id).unwrap_or(0);
        if let Some(p) = pi.next_if(|p| p.idx == idx) {
            let s: &'a Sequence = s;
            // Prompt logprobs still being gathered need the chunk's rows.
            let scored = s.prompt_lps.as_ref().map(Vec::len);
            let score = prompt_scoring(s, p, scored);
            pre.push(SeqInput {
                tokens: &s.spec.tokens[p.start..p.start + p.n],
                start_pos: p.start,
                block_table: table,
                logits: if score.is_some() {
                    LogitsWanted::Scored
                } else {
                    LogitsWanted::None
                },
                state_slot,
            });
            scoring.push(score);
        } else if let Some(d) = di.next_if(|d| d.idx == idx) {
            rounds.push(RoundInput {
                seq: &mut s.spec,
                block_table: table,
                k: d.k,
                branches: d.branches,
                state_slot,
                snapshot: snaps.next().flatten(),
            });
        }
    }
    (pre, scoring, rounds)
}

/// What chunk `p` of `s` scores when `scored` prompt logprobs are already
/// gathered (`None`: not asked): row `r` at position `start + r` scores
/// prompt token `start + r + 1`; positions already scored (a chunk run
/// again after a preemption) are skipped, so each token has one entry.
fn prompt_scoring<'a>(
    s: &'a Sequence,
    p: &Prefill,
    scored: Option<usize>,
) -> Option<PromptScoring<'a>> {
    let scored = scored?;
    if p.start > scored {
        return None;
    }
    let prompt = &s.req.prompt;
    let from = (scored + 1).min(prompt.len());
    let to = (p.start + p.n + 1).min(prompt.len()).max(from);
    Some(PromptScoring {
        skip: scored - p.start,
        targets: &prompt[from..to],
        top: s.req.prompt_logprobs.unwrap_or(0),
    })
}

mod checkpointing;

impl Drop for Engine {
    fn drop(&mut self) {
        self.fail_all("the engine stopped");
    }
}
