//! The continuous-batching engine: one thread owns every piece of mutable
//! engine state (sequences, block tables, KV pools, proposer) and advances
//! all running requests together, one step at a time. The rest of the
//! program talks to it through an [`EngineHandle`]: submit a validated
//! request, receive a stream of [`Event`]s.
//!
//! A dropped receiver cancels its sequence at the next step and frees its
//! blocks; EOS, a stop token or the token limit end a sequence and free its
//! blocks at once.

mod calibrate;
pub mod scheduler;
mod sequence;
mod step;

use crate::kv::PrefixStats;
use crate::spec::SpecStats;
use crate::tokenizer::TextTokenizer;
use scheduler::SchedulerConfig;
use sequence::Sequence;
use specgate_draft::DraftPolicy;
use specgate_verify::{ConstraintSource, Controls, Model, SamplingParams, TokenLogprob};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// A request the engine can run: already tokenized and validated for the
/// wire format; the engine checks what depends on the model.
#[derive(Debug, Clone, Default)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end the sequence (besides EOS).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Per-request proposer; `None` = the server's.
    pub method: Option<SpecMethod>,
    /// Per-request draft length; `Some(0)` turns speculation off.
    pub num_speculative_tokens: Option<usize>,
    /// Penalties, `logit_bias` and `min_tokens`, applied to every verified
    /// row and to the draft's q alike (`min_tokens_ban` is filled in by the
    /// engine from EOS and `stop_token_ids`).
    pub controls: Controls,
    /// Log-probabilities of each output token: `Some(n)` asks for the
    /// chosen token's and the `n` most likely (`n <= MAX_TOP_LOGPROBS`).
    pub logprobs: Option<usize>,
    /// The same for every prompt token after the first (`echo`), sent as
    /// one [`Event::PromptLogprobs`] before any output.
    pub prompt_logprobs: Option<usize>,
    /// A grammar the output must follow (JSON schema, tool calls): the
    /// engine starts one constraint per sequence from it.
    pub grammar: Option<Arc<dyn ConstraintSource>>,
    /// Who sent it, for the cross-request proposer's scope: an opaque
    /// hash of the API key (0 when the server has none).
    pub tenant: u64,
    /// The prefix-cache scope: only requests of the same scope share cached
    /// blocks (0 = the shared scope). Set from the API key (unless the
    /// server shares its cache) and the request's `cache_salt`.
    pub cache_scope: u64,
    /// Control tokens whose text the output shows (a chat format's
    /// markers, for its parser); every other control token decodes to
    /// nothing.
    pub shown_special_ids: Vec<u32>,
}

/// Most alternatives a request may ask for per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How a sequence drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecMethod {
    Off,
    Ngram,
    Draft,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop token.
    Stop,
    /// The token limit.
    Length,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// What a request's stream carries, in order: `Tokens` any number of times,
/// then exactly one `Finished` or `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New output tokens and the text they complete (never a broken UTF-8
    /// character; empty without a tokenizer).
    Tokens {
        ids: Vec<u32>,
        text: String,
        /// One per id when the request asked for `logprobs`, else empty.
        logprobs: Vec<TokenLogprob>,
        /// Where the request's shown control tokens
        /// ([`GenRequest::shown_special_ids`]: a chat format's markers) are
        /// in `text`: the byte offset their text starts at, and their id,
        /// ascending. Text that spells a marker with other tokens has no
        /// entry, which is how a parser tells markup from text.
        markers: Vec<(usize, u32)>,
    },
    /// The prompt's log-probabilities (`prompt_logprobs`): one per prompt
    /// token after the first, before any `Tokens`.
    PromptLogprobs(Vec<TokenLogprob>),
    Finished {
        reason: FinishReason,
        usage: Usage,
        /// Drafted and accepted tokens of this request.
        drafted: u64,
        accepted: u64,
        /// How it drafted at the end (the request's or the server's
        /// proposer; `Off` if drafting failed for it and was turned off).
        method: SpecMethod,
        /// From submission to its first admission into a batch.
        queue_time: std::time::Duration,
    },
    Error(String),
}

/// Errors of starting, configuring or submitting to the engine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("the engine has stopped")]
    Stopped,
    /// A setting the engine cannot run with (pool size, policy, proposer).
    #[error("{0}")]
    Invalid(String),
    /// A request this model cannot run; `part` says which of its inputs is
    /// at fault, so a front end can name its own field for it.
    #[error("{message}")]
    Rejected { part: RequestPart, message: String },
}

/// The input of a [`GenRequest`] that [`EngineError::Rejected`] refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestPart {
    /// `prompt`: empty, a token outside the vocabulary.
    Prompt,
    /// `max_new_tokens`: zero, or too many for the context or the KV pool
    /// with this prompt.
    MaxNewTokens,
    /// `method`: a proposer this engine has not loaded.
    Method,
    /// `num_speculative_tokens`: above [`MAX_SPECULATIVE_TOKENS`].
    NumSpeculativeTokens,
    /// `controls.logit_bias`: an id outside the vocabulary.
    LogitBias,
    /// `logprobs`: more than [`MAX_TOP_LOGPROBS`] alternatives.
    Logprobs,
    /// `prompt_logprobs`: more than [`MAX_TOP_LOGPROBS`] alternatives.
    PromptLogprobs,
    /// `grammar`: its constraint could not start.
    Grammar,
}

/// Which proposer the engine drafts with.
pub enum ProposerKind {
    None,
    Ngram {
        min_n: usize,
        max_n: usize,
    },
    /// A draft model with the target's vocabulary.
    Draft(Model),
}

/// How big the KV pool is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSize {
    /// This many blocks (each holding `block_size` tokens in the target's
    /// cache and, with a draft model, in the draft's).
    Blocks(usize),
    /// As many blocks as fit in this many bytes of target + draft cache.
    MemoryBytes(usize),
}

/// Engine sizing and policy.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Pool size, shared by the draft's and the target's caches.
    pub kv: KvSize,
    pub block_size: usize,
    pub scheduler: SchedulerConfig,
    pub policy: DraftPolicy,
    /// The cross-request proposer, or `None` for none.
    pub suffix: Option<SuffixOptions>,
    /// The most branch nodes a sequence's proposal may add beside its
    /// chain in one step (a token tree, verified in the same pass); the
    /// goodput policy buys fewer where they do not pay. 0: chains only.
    /// Models whose forward cannot verify trees draft chains whatever
    /// this says.
    pub tree_branches: usize,
    /// Automatic prefix caching, and its state checkpoints for a hybrid
    /// target.
    pub prefix: PrefixCaching,
    /// Bytes of per-row recurrent states one step may keep (a hybrid
    /// target's verification rows; `[kv] row_state_mib`): each step's
    /// drafts and branches shrink to fit ([`crate::kv::row_states`]).
    pub row_state_bytes: usize,
}

/// [`EngineConfig::row_state_bytes`]'s default: 1 GiB (hundreds of rows of
/// a small hybrid model; two of a full Kimi K3 at TP 1, which then drafts
/// two tokens a step in all).
pub const DEFAULT_ROW_STATE_BYTES: usize = 1 << 30;

/// Automatic prefix caching (`[kv] prefix_caching`,
/// `[kv] state_checkpoint_mib`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixCaching {
    /// On: full blocks of computed tokens are shared with later sequences
    /// of the same cache scope that start with the same tokens.
    pub enabled: bool,
    /// Bytes of recurrent-state checkpoints a hybrid target may hold (a
    /// prefix hit needs one at its boundary); their own budget, beside the
    /// KV pool's.
    pub checkpoint_bytes: usize,
}

/// [`PrefixCaching::checkpoint_bytes`]'s default: 1 GiB (thousands of
/// checkpoints of a small hybrid model; two of a full Kimi K3 at TP 1).
pub const DEFAULT_CHECKPOINT_BYTES: usize = 1 << 30;

impl Default for PrefixCaching {
    fn default() -> Self {
        Self {
            enabled: true,
            checkpoint_bytes: DEFAULT_CHECKPOINT_BYTES,
        }
    }
}

/// [`EngineConfig::tree_branches`]'s default (`speculative.tree_branches`).
pub const DEFAULT_TREE_BRANCHES: usize = 4;

/// The cross-request proposer's settings (see [`specgate_draft::suffix`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SuffixOptions {
    pub pool: specgate_draft::SuffixConfig,
    /// One pool for every tenant (else one per [`GenRequest::tenant`]).
    pub global: bool,
}

/// Counters and gauges the engine publishes after every step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub num_blocks: usize,
    /// Bytes of the pool: target's and draft's caches for `num_blocks`.
    pub kv_bytes: usize,
    /// Blocks available (free or evictable cached).
    pub free_blocks: usize,
    pub preemptions: u64,
    pub prefix: PrefixStats,
    /// Whether prefix caching is on.
    pub prefix_caching: bool,
    /// A hybrid target's state checkpoints: counters, the slots the budget
    /// holds and the bytes of one (0 and 0 without checkpoints).
    pub checkpoints: crate::kv::CheckpointStats,
    pub checkpoint_slots: usize,
    pub checkpoint_slot_bytes: usize,
    /// Recurrent-state slots in the pool, and those held by running
    /// sequences (0 and 0 for models without recurrent layers).
    pub state_slots: usize,
    pub state_slots_used: usize,
    /// Rows whose recurrent states one step may keep (`[kv]
    /// row_state_mib` over a state's bytes; 0 without recurrent layers,
    /// where nothing is bounded), and the most bytes of such states any
    /// step needed so far.
    pub row_state_rows: usize,
    pub row_state_peak_bytes: usize,
    /// Fraction of the cache in use, blocks and state slots weighted by
    /// their bytes.
    pub cache_usage: f64,
    /// Prompt tokens actually run through the target (cache hits excluded,
    /// recomputation after preemption included).
    pub prefill_tokens: u64,
    pub spec: SpecStats,
    /// Of `spec.draft_tokens`, those that came from lookups chained before
    /// the method's proposer: in the sequence's own context, and in the
    /// cross-request pool (with how many of the latter were accepted).
    pub context_draft_tokens: u64,
    pub pool_draft_tokens: u64,
    pub pool_accepted_tokens: u64,
    /// Steps that ran the draft model, and how often the draft model was
    /// switched off at a batch size for losing there (goodput policy).
    pub model_steps: u64,
    pub model_vetoes: u64,
    /// Prompt rows the draft model ran alongside the target's chunks.
    pub draft_prefill_tokens: u64,
    pub finished: u64,
    pub cancelled: u64,
    /// Requests ended by an internal error (contained to them).
    pub failed: u64,
    pub steps: u64,
}

enum Command {
    Submit(Box<Sequence>),
    SetPolicy(DraftPolicy),
    Calibrate,
    Fault(Fault),
    Shutdown,
}

/// A failure injected on purpose, so tests can prove the engine contains
/// faults it cannot otherwise be made to have (a kernel panic, a broken
/// forward). Requests are numbered from 1 in the order this engine received
/// them.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Every verifier forward that carries request n returns an error.
    ForwardError(u64),
    /// Every verifier forward that carries request n panics.
    ForwardPanic(u64),
    /// The engine thread itself panics at its next loop turn.
    EnginePanic,
    /// Every step first sleeps this many milliseconds (a slow machine).
    SlowSteps(u64),
    /// Every proposal that runs the draft model also sleeps this many
    /// milliseconds (a draft dearer than the cost model measured).
    SlowDraft(u64),
    /// Every restored state checkpoint is zeroed after its copy (a hybrid
    /// target resuming from a wrong state: what exactness tests must catch).
    CorruptCheckpoints,
    /// Request n's drafts and branches are planned against the KV pool
    /// alone, not the model's context (the planning bug of issue 49), so
    /// near the end its rows reach past the context: the check of each
    /// piece before the forward must end it alone.
    PoolBoundedDrafts(u64),
}

/// The HTTP layer's way into the engine. Cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    stats: Arc<Mutex<EngineStats>>,
    next_id: Arc<AtomicU64>,
    limits: Arc<Limits>,
    /// Turns true when the engine thread ends by a panic.
    dead: tokio::sync::watch::Receiver<bool>,
}

#[derive(Clone)]
struct Limits {
    vocab_size: usize,
    /// End-of-sequence ids (the tokenizer's), banned under `min_tokens`.
    eos: Vec<u32>,
    max_position: usize,
    max_slots: usize,
    /// Longest prompt a request may ask log-probabilities of.
    max_prompt_logprobs: usize,
    has_draft: bool,
    default_method: SpecMethod,
}

/// Longest prompt a request may ask log-probabilities of, unless
/// [`EngineHandle::with_max_prompt_logprobs`] says otherwise.
pub const DEFAULT_MAX_PROMPT_LOGPROBS: usize = 2048;

/// The longest n-gram the prompt-lookup proposer may try (`ngram_max`).
/// Each n from `ngram_max` down to `ngram_min` is one more backwards scan of
/// the whole context per sequence and step on the engine thread when nothing
/// matches (the common case), and a suffix longer than a handful of tokens
/// almost always finds the same earlier occurrence a shorter one does; 16
/// leaves room for tuning while bounding that cost to 16 scans.
pub const MAX_NGRAM: usize = 16;

/// Drafts a request may ask for at most.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

impl EngineHandle {
    /// Queues a request; its events arrive on the returned receiver.
    /// Dropping the receiver cancels the request.
    ///
    /// Errors: `Rejected` (naming the [`RequestPart`]) for an empty
    /// prompt, a token outside the vocabulary, `max_new_tokens` of 0,
    /// prompt + max_new_tokens beyond the context or the KV pool, a method
    /// not loaded, too many speculative tokens, a `logit_bias` id outside
    /// the vocabulary, more than [`MAX_TOP_LOGPROBS`] logprobs, a grammar
    /// whose constraint cannot start; `Stopped` after shutdown.
    pub fn submit(&self, req: GenRequest) -> Result<UnboundedReceiver<Event>, EngineError> {
        let l = &self.limits;
        let bad = |part, message: String| Err(EngineError::Rejected { part, message });
        if req.prompt.is_empty() {
            return bad(RequestPart::Prompt, "the prompt is empty".into());
        }
        if req.max_new_tokens == 0 {
            return bad(
                RequestPart::MaxNewTokens,
                "max_new_tokens must be at least 1".into(),
            );
        }
        if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= l.vocab_size) {
            return bad(
                RequestPart::Prompt,
                format!("token id {t} is outside the vocabulary of {}", l.vocab_size),
            );
        }
        // Client-supplied sizes: checked, since a wrapped sum would pass.
        let total = req.prompt.len().saturating_add(req.max_new_tokens);
        if total > l.max_position {
            let message = format!(
                "prompt ({} tokens) + max_new_tokens ({}) = {total} exceeds the context length of {}",
                req.prompt.len(),
                req.max_new_tokens,
                l.max_position
            );
            return bad(RequestPart::MaxNewTokens, message);
        }
        if req.method == Some(SpecMethod::Draft) && !l.has_draft {
            return bad(
                RequestPart::Method,
                "speculative method 'draft' needs a draft model, and none is loaded".into(),
            );
        }
        if req
            .num_speculative_tokens
            .is_some_and(|k| k > MAX_SPECULATIVE_TOKENS)
        {
            return bad(
                RequestPart::NumSpeculativeTokens,
                format!("at most {MAX_SPECULATIVE_TOKENS} speculative tokens"),
            );
        }
        // Lookahead is capped by what the pool holds, so only the sequence
        // itself (plus one verify row) must fit.
        if total.saturating_add(1) > l.max_slots {
            return bad(
                RequestPart::MaxNewTokens,
                format!(
                    "prompt + max_new_tokens ({total}) does not fit the KV cache of {} tokens",
                    l.max_slots
                ),
            );
        }
        if let Some(&(t, _)) = req
            .controls
            .logit_bias
            .iter()
            .find(|&&(t, _)| t as usize >= l.vocab_size)
        {
            return bad(
                RequestPart::LogitBias,
                format!(
                    "logit_bias token id {t} is outside the vocabulary of {}",
                    l.vocab_size
                ),
            );
        }
        // Each prompt token scored costs a log-softmax and a top-k over the
        // vocabulary in the forward: bounded like any other cost.
        if req.prompt_logprobs.is_some() && req.prompt.len() > l.max_prompt_logprobs {
            return bad(
                RequestPart::PromptLogprobs,
                format!(
                    "prompt log-probabilities are limited to prompts of {} tokens, and this one has {}",
                    l.max_prompt_logprobs,
                    req.prompt.len()
                ),
            );
        }
        for (n, part) in [
            (req.logprobs, RequestPart::Logprobs),
            (req.prompt_logprobs, RequestPart::PromptLogprobs),
        ] {
            if n.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
                return bad(
                    part,
                    format!("at most {MAX_TOP_LOGPROBS} top logprobs per token"),
                );
            }
        }
        let constraint = match &req.grammar {
            Some(g) => Some(g.start().map_err(|e| EngineError::Rejected {
                part: RequestPart::Grammar,
                message: e.to_string(),
            })?),
            None => None,
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let seq = Sequence::new(id, req, tx, &l.eos, constraint);
        self.tx
            .send(Command::Submit(Box::new(seq)))
            .map_err(|_| EngineError::Stopped)?;
        Ok(rx)
    }

    /// Replaces the draft-length policy from the next step on (live tuning).
    ///
    /// Errors: `Invalid` for a policy that does not validate; `Stopped`.
    pub fn set_policy(&self, policy: DraftPolicy) -> Result<(), EngineError> {
        policy.validate().map_err(EngineError::Invalid)?;
        self.tx
            .send(Command::SetPolicy(policy))
            .map_err(|_| EngineError::Stopped)
    }

    /// Measures the step cost model again, between two steps (on demand:
    /// a config reload does it). Running requests wait while it runs (a
    /// few seconds at most).
    ///
    /// Errors: `Stopped`.
    pub fn recalibrate(&self) -> Result<(), EngineError> {
        self.tx
            .send(Command::Calibrate)
            .map_err(|_| EngineError::Stopped)
    }

    /// Injects `fault` (tests only: see [`Fault`]).
    #[doc(hidden)]
    pub fn inject_fault(&self, fault: Fault) -> Result<(), EngineError> {
        self.tx
            .send(Command::Fault(fault))
            .map_err(|_| EngineError::Stopped)
    }

    /// False once the engine thread has died of a panic or ended because
    /// the target's rank group failed: nothing it held will ever answer
    /// again, so the process should be restarted.
    pub fn is_alive(&self) -> bool {
        !*self.dead.borrow()
    }

    /// Resolves when the engine thread dies of a panic or of a failed rank
    /// group; never after a normal shutdown.
    pub async fn died(&self) {
        let mut rx = self.dead.clone();
        if rx.wait_for(|&dead| dead).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// The context length a request may use (prompt + output): the model's,
    /// or the smaller cap set by [`with_max_model_len`](Self::with_max_model_len).
    pub fn max_position(&self) -> usize {
        self.limits.max_position
    }

    /// The most tokens one request may hold, prompt and output together:
    /// the context ([`max_position`](Self::max_position)), or less when the
    /// KV pool holds less (one slot stays free for the verify row). What
    /// `submit` accepts, and the `max_model_len` clients are shown.
    pub fn max_request_tokens(&self) -> usize {
        let l = &self.limits;
        l.max_position.min(l.max_slots.saturating_sub(1))
    }

    /// Token slots of the KV pool (blocks times block size).
    pub fn kv_slots(&self) -> usize {
        self.limits.max_slots
    }

    /// Whether the KV pool holds less than one full context: then a long
    /// request is refused although the model could take it (startup warns).
    pub fn pool_below_context(&self) -> bool {
        self.max_request_tokens() < self.limits.max_position
    }

    /// How a request drafts when it does not say: the proposer this engine
    /// was started with (fixed for its life; a reload changes only the
    /// draft length).
    pub fn speculative_method(&self) -> SpecMethod {
        self.limits.default_method
    }

    /// This handle with the context a request may use capped at
    /// `max_model_len` (`[model] max_model_len`): `submit` and
    /// [`max_position`](Self::max_position) use it from then on. Call it on
    /// the handle `spawn` returned, before cloning it: clones made earlier
    /// keep the model's length.
    ///
    /// Errors: `Invalid` when `max_model_len` is 0 or above the model's
    /// context length (a longer context than the model was trained for
    /// would be accepted and then fail or degrade in the middle of a
    /// request).
    pub fn with_max_model_len(mut self, max_model_len: usize) -> Result<Self, EngineError> {
        let model = self.limits.max_position;
        if max_model_len == 0 || max_model_len > model {
            return Err(EngineError::Invalid(format!(
                "max_model_len {max_model_len} is out of range; allowed 1..={model} (the model's context length)"
            )));
        }
        self.limits = Arc::new(Limits {
            max_position: max_model_len,
            ..Limits::clone(&self.limits)
        });
        Ok(self)
    }

    /// This handle with prompt log-probabilities allowed for prompts of up
    /// to `n` tokens (`[scheduler] max_echo_prompt_tokens`); as
    /// [`with_max_model_len`](Self::with_max_model_len), call it before
    /// cloning the handle.
    pub fn with_max_prompt_logprobs(mut self, n: usize) -> Self {
        self.limits = Arc::new(Limits {
            max_prompt_logprobs: n,
            ..Limits::clone(&self.limits)
        });
        self
    }

    /// Longest prompt a request may ask log-probabilities of.
    pub fn max_prompt_logprobs(&self) -> usize {
        self.limits.max_prompt_logprobs
    }

    /// The latest published counters.
    pub fn stats(&self) -> EngineStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Asks the engine thread to stop after its current step; in-flight
    /// requests get an error event.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

/// Starts the engine thread. `tokenizer` (optional) turns tokens into text
/// and supplies the EOS ids.
pub fn spawn(
    target: Model,
    proposer: ProposerKind,
    tokenizer: Option<Arc<TextTokenizer>>,
    cfg: EngineConfig,
) -> Result<(EngineHandle, std::thread::JoinHandle<()>), EngineError> {
    cfg.policy.validate().map_err(EngineError::Invalid)?;
    let engine = step::Engine::new(target, proposer, tokenizer, &cfg)?;
    let limits = Arc::new(Limits {
        vocab_size: engine.vocab_size(),
        eos: engine.eos().to_vec(),
        max_position: engine.max_position(),
        max_slots: engine.num_blocks() * cfg.block_size,
        max_prompt_logprobs: DEFAULT_MAX_PROMPT_LOGPROBS,
        has_draft: engine.has_draft(),
        default_method: engine.default_method(),
    });
    let stats = engine.shared_stats();
    let (tx, rx) = mpsc::channel();
    let (dead_tx, dead) = tokio::sync::watch::channel(false);
    let join = std::thread::Builder::new()
        .name("specgate-engine".into())
        .spawn(move || {
            let guard = DeathNotice(dead_tx);
            if let Some(why) = engine.run(rx) {
                tracing::error!(reason = %why, "the target's rank group failed; the server cannot serve any more");
                guard.0.send_replace(true);
            }
        })
        .map_err(|e| EngineError::Invalid(format!("cannot start the engine thread: {e}")))?;
    Ok((
        EngineHandle {
            tx,
            stats,
            next_id: Arc::new(AtomicU64::new(1)),
            limits,
            dead,
        },
        join,
    ))
}

/// Announces the engine thread's death when it unwinds from a panic. The
/// engine itself is dropped first (it is owned by the frame that panicked),
/// so every client has its error event by then.
struct DeathNotice(tokio::sync::watch::Sender<bool>);

impl Drop for DeathNotice {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!("the engine thread panicked; the server cannot serve any more");
            self.0.send_replace(true);
        }
    }
}
