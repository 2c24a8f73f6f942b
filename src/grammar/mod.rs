//! Grammar-constrained decoding: compiles a request's structured-output spec
//! (`response_format` JSON schema or `json_object`, tool-call grammars) into a
//! [`ConstraintSource`] that the engine applies at every decoding position,
//! drafts and verified rows included, through the
//! [`TokenConstraint`](specgate_verify::TokenConstraint) seam.
//!
//! The grammar engine is llguidance. [`Grammars`] is built once per served
//! model: it turns the model's [`TextTokenizer`] into llguidance's token trie
//! (`tokenv`) and holds the parser factory; [`Grammars::compile`] builds one
//! grammar (`build`) and checks that it can start; each request then gets its
//! own matcher from the returned source (`constraint`).
//!
//! Every spec is measured against [`limits`] before llguidance sees it and
//! compiled on a thread of its own under a time budget, behind a bounded
//! queue of its own ([`worker`]), so no request's schema can overflow a
//! stack, exhaust memory, hold the caller without a bound, or keep other
//! requests from templating and tokenizing.
//!
//! Output layout is deterministic so that jump-forward has something to
//! force: JSON is written with `", "` between items, `": "` between keys and
//! values and no other whitespace (what Python's `json.dumps` writes and what
//! Qwen-style tool calls use), unless a schema carries its own llguidance
//! `x-guidance` options.

mod build;
mod constraint;
pub mod limits;
mod tokenv;
pub mod worker;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::ParserFactory;
use specgate_verify::ConstraintSource;

use crate::chat_format::ChatFormat;
use crate::tokenizer::TextTokenizer;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type":"json_object"}`).
    JsonObject,
    /// JSON valid against this schema (`json_schema.schema`). The schema must
    /// be an object or `true`.
    JsonSchema(serde_json::Value),
    /// Tool-call blocks in the Qwen2.5/Hermes format, exactly:
    /// `"<tool_call>\n" + {"name": NAME, "arguments": ARGS} + "\n</tool_call>"`
    /// where (NAME, ARGS's JSON schema) is one of `tools` (a named
    /// `tool_choice` passes one tool); `parallel`: one or more blocks
    /// separated by `"\n"`, else exactly one. A schema of `null`, `true` or
    /// `{}` (a tool without `parameters`) takes any JSON object. Names must
    /// be distinct and non-empty; any text is safe in a name (it is written
    /// as a JSON string).
    ToolCalls {
        tools: Vec<(String, serde_json::Value)>,
        parallel: bool,
    },
    /// Calls in a model family's own markup (Kimi K3's tags), as
    /// [`ChatFormat::forced_calls_lark`] writes them: the same tools and
    /// `parallel` as [`GrammarSpec::ToolCalls`]; `thinking` when the
    /// prompt left the think channel open (free reasoning first).
    MarkupCalls {
        format: ChatFormat,
        tools: Vec<(String, serde_json::Value)>,
        parallel: bool,
        thinking: bool,
    },
    /// A JSON answer valid against `schema` written as the response text
    /// of a family's markup ([`ChatFormat::json_answer_lark`]); `thinking`
    /// as for [`GrammarSpec::MarkupCalls`].
    MarkupJson {
        format: ChatFormat,
        schema: serde_json::Value,
        thinking: bool,
    },
}

impl GrammarSpec {
    /// The spec for a JSON answer valid against `schema` (`None`: any
    /// object), in `format`'s markup when the family wraps its answers
    /// (Kimi K3's response channel, after thinking).
    pub fn json_answer(
        format: ChatFormat,
        schema: Option<serde_json::Value>,
        thinking: bool,
    ) -> Self {
        match (format, schema) {
            (ChatFormat::Hermes(_), None) => Self::JsonObject,
            (ChatFormat::Hermes(_), Some(s)) => Self::JsonSchema(s),
            (ChatFormat::KimiK3(_), schema) => Self::MarkupJson {
                format,
                schema: schema.unwrap_or_else(|| serde_json::json!({"type": "object"})),
                thinking,
            },
        }
    }

    /// The spec forcing calls of `tools` in `format`'s markup.
    pub fn forced_calls(
        format: ChatFormat,
        tools: Vec<(String, serde_json::Value)>,
        parallel: bool,
        thinking: bool,
    ) -> Self {
        match format {
            ChatFormat::Hermes(_) => Self::ToolCalls { tools, parallel },
            ChatFormat::KimiK3(_) => Self::MarkupCalls {
                format,
                tools,
                parallel,
                thinking,
            },
        }
    }
}

/// Why a grammar could not be built.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The request's schema or tools are unusable (the API answers 400): a
    /// schema that is not an object, uses a feature llguidance does not
    /// support, or can match nothing; an empty or duplicate tool name.
    /// Also a spec beyond [`limits`], or one whose compile took longer
    /// than [`worker::BUDGET`] or failed inside the compiler.
    #[error("{0}")]
    Invalid(String),
    /// The compile queue (or the tenant's share of it) was full, or every
    /// compile slot stayed taken for the whole budget (the API answers 503
    /// with `Retry-After`: [`worker::RETRY_AFTER_SECS`]).
    #[error("{0}")]
    Busy(String),
    /// Building for the tokenizer failed (at startup): a vocabulary wider
    /// than the model's logits, no end-of-sequence id, a token without bytes.
    #[error("grammar setup: {0}")]
    Setup(String),
}

/// The grammar engine for one served model: the tokenizer's token trie and
/// llguidance's parser factory. Cheap to clone (an `Arc` inside), `Send +
/// Sync`.
///
/// Invariant: every mask a compiled grammar produces is `vocab_size` wide
/// (the model's logits width); ids past the tokenizer's vocabulary and
/// control tokens (e.g. `<|im_start|>`) are never allowed, except the
/// tokenizer's end-of-sequence ids, which are allowed exactly where the
/// grammar is complete. Added tokens that are not control tokens (Qwen's
/// `<tool_call>`) stand for their text.
#[derive(Clone)]
pub struct Grammars {
    inner: Arc<Inner>,
    /// Whether constraints offer forced tokens as drafts (jump-forward).
    jump_forward: bool,
}

struct Inner {
    factory: ParserFactory,
    /// The Hermes tags' ids where they are tokens of their own: tool-call
    /// grammars write them as those tokens.
    tags: Option<(u32, u32)>,
    vocab_size: usize,
    eos: Arc<[u32]>,
    queue: worker::Queue,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab_size", &self.inner.vocab_size)
            .field("eos", &self.inner.eos)
            .field("jump_forward", &self.jump_forward)
            .finish_non_exhaustive()
    }
}

impl Grammars {
    /// Builds the grammar engine for `tok`, with masks `vocab_size` wide (the
    /// model's logits width; it may exceed the tokenizer's vocabulary, the
    /// extra ids are never allowed). Takes about half a second for a 152k
    /// vocabulary.
    ///
    /// The engine keeps its own copy of the tokenizer (to tokenize forced
    /// text canonically), made through a temporary `tokenizer.json` file;
    /// [`from_shared`](Self::from_shared) shares an `Arc` instead.
    ///
    /// Errors: [`GrammarError::Setup`] when `vocab_size` is below the
    /// tokenizer's vocabulary, the tokenizer has no end-of-sequence id, or
    /// the copy cannot be written or read back.
    pub fn new(tok: &TextTokenizer, vocab_size: usize) -> Result<Self, GrammarError> {
        Self::build(tok, Arc::new(tokenv::copy_tokenizer(tok)?), vocab_size)
    }

    /// As [`new`](Self::new), sharing `tok` instead of copying it.
    pub fn from_shared(tok: Arc<TextTokenizer>, vocab_size: usize) -> Result<Self, GrammarError> {
        Self::build(&tok, tok.clone(), vocab_size)
    }

    fn build(
        tok: &TextTokenizer,
        encoder: Arc<TextTokenizer>,
        vocab_size: usize,
    ) -> Result<Self, GrammarError> {
        let eos: Arc<[u32]> = tok.eos_token_ids().into();
        // A chat format's markers count only as their tokens: no grammar
        // may produce them as text (a JSON string holding the token
        // `</tool_call>` would close a call early), only where it names
        // their ids.
        let format = ChatFormat::detect(tok);
        let tags = match format {
            ChatFormat::Hermes(m) => m.call,
            ChatFormat::KimiK3(_) => None,
        };
        let env = tokenv::token_env(tok, encoder, vocab_size, &format.shown_special_ids())?;
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| GrammarError::Setup(format!("llguidance parser factory: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = limits::parser_limits();
        Ok(Self {
            inner: Arc::new(Inner {
                factory,
                tags,
                vocab_size,
                eos,
                queue: Default::default(),
            }),
            jump_forward: true,
        })
    }

    /// These grammars with jump-forward on (the default) or off: when off,
    /// their constraints force nothing ([`TokenConstraint::forced`] is
    /// empty), so drafts are only what the proposer guessed. Off exists to
    /// measure what jump-forward is worth (`[speculative] jump_forward`);
    /// outputs are the same either way.
    pub fn with_jump_forward(mut self, on: bool) -> Self {
        self.jump_forward = on;
        self
    }

    /// The width of every mask (the model's logits width).
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// Compiles `spec` into a source of per-request constraints (cheap to
    /// share; each [`start`](ConstraintSource::start) clones a ready matcher,
    /// ~15 µs). Compiling checks that the grammar builds and that its first
    /// token can be chosen.
    ///
    /// The spec is checked against [`limits`] first, then waits for a
    /// compile slot in the bounded queue (at most [`worker::MAX_WAIT`])
    /// and is compiled on a compile thread (at most [`worker::BUDGET`]);
    /// the future holds no thread while it waits. `tenant` is whose request it is
    /// (0: no API key); one tenant may hold only
    /// [`worker::MAX_QUEUED_PER_TENANT`] of the queue.
    ///
    /// Errors: [`GrammarError::Invalid`] with llguidance's reason for a
    /// schema or tool list it rejects (see [`GrammarSpec`]), or the bound
    /// the spec breaks, or a compile over the budget;
    /// [`GrammarError::Busy`] when the queue is full or no compile slot
    /// frees up in time.
    pub async fn compile_async(
        &self,
        spec: &GrammarSpec,
        tenant: u64,
    ) -> Result<Arc<dyn ConstraintSource>, GrammarError> {
        limits::check(spec)?;
        let (this, owned) = (self.clone(), spec.clone());
        worker::run(
            &self.inner.queue,
            build::label(spec),
            (worker::MAX_WAIT, worker::BUDGET),
            tenant,
            move |deadline| this.compile_here(&owned, deadline),
        )
        .await
    }

    /// [`compile_async`](Self::compile_async) for a caller outside any
    /// async runtime (tools, tests, benches): blocks its thread for at
    /// most [`worker::MAX_WAIT`] and [`worker::BUDGET`], counted as a
    /// request without a key.
    ///
    /// Panics when called from inside an async runtime's task. Errors: as
    /// [`compile_async`](Self::compile_async).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Arc<dyn ConstraintSource>, GrammarError> {
        limits::check(spec)?;
        let (this, owned) = (self.clone(), spec.clone());
        worker::run_blocking(
            &self.inner.queue,
            build::label(spec),
            (worker::MAX_WAIT, worker::BUDGET),
            move |deadline| this.compile_here(&owned, deadline),
        )
    }

    /// Checks `spec` against [`limits`] only (cheap, no compile): what a
    /// caller runs before it spends work on a request whose grammar will
    /// be refused.
    ///
    /// Errors: [`GrammarError::Invalid`] naming the bound `spec` breaks.
    pub fn check(spec: &GrammarSpec) -> Result<(), GrammarError> {
        limits::check(spec)
    }

    /// [`compile`](Self::compile)'s work, on the calling thread; no new
    /// compile starts past `deadline`.
    fn compile_here(
        &self,
        spec: &GrammarSpec,
        deadline: Instant,
    ) -> Result<Arc<dyn ConstraintSource>, GrammarError> {
        let (grammar, label) = build::top_level(spec, self.inner.tags)?;
        match self.source(grammar, label) {
            Ok(source) => Ok(Arc::new(source)),
            Err(e) => Err(self.blame_tool(spec, deadline).unwrap_or(e)),
        }
    }

    fn source(
        &self,
        grammar: TopLevelGrammar,
        label: String,
    ) -> Result<constraint::LlgSource, GrammarError> {
        constraint::LlgSource::new(
            &self.inner.factory,
            grammar,
            label,
            self.inner.vocab_size,
            self.inner.eos.clone(),
            self.jump_forward,
        )
    }

    /// For a tool-call grammar that failed: the error of the first tool
    /// whose argument schema fails on its own (so the message names it).
    /// Each tool is one more compile: none starts past `deadline` (then
    /// the whole grammar's error stands), so the slot is back in time.
    fn blame_tool(&self, spec: &GrammarSpec, deadline: Instant) -> Option<GrammarError> {
        let GrammarSpec::ToolCalls { tools, .. } = spec else {
            return None;
        };
        for (name, schema) in tools {
            if Instant::now() >= deadline {
                return None;
            }
            let failed = match build::arguments_schema(name, schema) {
                Err(e) => Some(e),
                Ok(schema) => self
                    .source(
                        TopLevelGrammar::from_json_schema(schema),
                        build::tool_label(name),
                    )
                    .err(),
            };
            if failed.is_some() {
                return failed;
            }
        }
        None
    }
}
