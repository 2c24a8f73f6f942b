//! The TOML configuration file: server, target model, draft, KV pool,
//! scheduler and speculation sections (and `[router]` for `specgate
//! route`). Unknown keys and bad values fail at start with a message naming
//! the key and its allowed range; every field has a default so a file only
//! says what it changes. Every number is bounded (see [`Config::validate`]):
//! a typo such as a draft length of 300 is refused at start instead of
//! collapsing throughput. `[speculative]` can be re-read while running (see
//! [`Config::reload`]), and only a file that parsed whole and
//! changed nothing else is applied.

use serde::Deserialize;
use specgate_draft::policy::{MAX_DRAFT_COST, MAX_DRAFT_TOKENS, MAX_PROBE_EVERY};
use specgate_draft::DraftPolicy;
use std::path::{Path, PathBuf};

mod check;

pub use check::ConfigError;
use check::{in_range, invalid, text_ok};

// The draft crate cannot see the engine, so it states its own cap on k; the
// two must agree or a reload could set a k that the engine refuses.
const _: () = assert!(MAX_DRAFT_TOKENS == crate::engine::MAX_SPECULATIVE_TOKENS);

/// The engine's cap on `ngram_max` (its owner is the engine, which builds
/// the prompt-lookup proposer); the config only checks against it.
pub use crate::engine::MAX_NGRAM;

/// The largest `model.max_model_len` accepted before the model is known
/// (2^24 tokens, above any model's context); the model's own context length
/// is the real bound, checked when it is loaded.
pub const MAX_MODEL_LEN: usize = 1 << 24;

/// The whole file.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub model: ModelConfig,
    pub draft: DraftConfig,
    pub kv: KvConfig,
    pub scheduler: SchedulerSection,
    pub speculative: SpeculativeConfig,
    /// `[router]`: only `specgate route` reads it.
    pub router: crate::router::RouterConfig,
}

/// `[server]`
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Bearer keys accepted; empty = no authentication.
    pub api_keys: Vec<String>,
    /// Model name served on /v1/models (default: the target file's stem).
    pub served_model_name: Option<String>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Requests admitted at once, running or queued (429 beyond).
    pub max_concurrent_requests: usize,
    /// A request still unfinished after this long is ended.
    pub request_timeout_secs: u64,
    /// On SIGTERM/Ctrl-C, how long in-flight requests may take to finish.
    pub drain_timeout_secs: u64,
    /// Seconds between SSE keep-alive comments while a stream waits.
    pub keep_alive_secs: u64,
    /// A request's head must arrive whole within this long (slowloris). The
    /// wait for the next request on an idle keep-alive connection counts
    /// too, so idle sockets are closed after it.
    pub header_read_timeout_secs: u64,
    /// A request's body must arrive whole within this long (408 beyond).
    pub body_read_timeout_secs: u64,
    /// Open connections at most; further clients wait in the OS backlog.
    pub max_connections: usize,
    /// Open connections at most from one client address; more are closed
    /// at once, so one client cannot hold every slot (and starve /health).
    pub max_connections_per_client: usize,
    /// Requests admitted at once from one client address, and at once with
    /// one API key (429 beyond); capped by `max_concurrent_requests`.
    pub max_requests_per_client: usize,
    /// Blocking jobs (templating, tokenizing) running at once; the rest
    /// wait their turn, holding their admission. Grammars compile apart,
    /// in a queue of their own (`grammar::worker`).
    pub max_blocking_jobs: usize,
    /// Messages one chat request (or `/tokenize` of messages) may hold
    /// (400 beyond): a template's time grows with them, for some
    /// templates (Kimi K3's tool runs) quadratically.
    pub max_messages: usize,
    /// Require an API key on `/metrics` too (when `api_keys` are set).
    pub metrics_auth: bool,
    /// With `api_keys` set, one prefix cache for every key; by default
    /// each key's prompts are cached apart, so hit counters and time to
    /// first token tell no tenant what another sent.
    pub share_prefix_cache: bool,
    /// A response write (one SSE event) the client does not take within this
    /// long ends the request and frees its sequence (slow readers).
    pub stream_write_timeout_secs: u64,
    /// Browser origins allowed to call the API (CORS), such as
    /// `"https://app.example.com"`, or `["*"]` for any; empty (the
    /// default) turns CORS off.
    pub cors_allow_origins: Vec<String>,
    /// Responses kept for the Responses API (`store`, `previous_response_id`,
    /// `GET /v1/responses/{id}`), per API key (one scope without keys);
    /// the oldest is evicted first. 0 keeps none.
    pub stored_responses_per_key: usize,
    /// Bytes of stored responses per API key, in MiB (oldest evicted first).
    pub stored_responses_mib_per_key: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            api_keys: Vec::new(),
            served_model_name: None,
            max_body_bytes: 1 << 20,
            max_concurrent_requests: 256,
            request_timeout_secs: 600,
            drain_timeout_secs: 30,
            keep_alive_secs: 15,
            header_read_timeout_secs: 10,
            body_read_timeout_secs: 30,
            max_connections: 1024,
            max_connections_per_client: 256,
            max_requests_per_client: 128,
            max_blocking_jobs: 16,
            max_messages: 2048,
            metrics_auth: false,
            share_prefix_cache: false,
            stream_write_timeout_secs: 30,
            cors_allow_origins: Vec::new(),
            stored_responses_per_key: 256,
            stored_responses_mib_per_key: 64,
        }
    }
}

/// `[model]`: the target (verifier).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    pub path: PathBuf,
    pub tensor_parallel_size: usize,
    /// Longest context (prompt + generated tokens) a request may use; `None`
    /// = the model's own context length. Must not exceed the model's (the
    /// server refuses to start otherwise): a smaller cap bounds what one
    /// request can take of the KV pool.
    pub max_model_len: Option<usize>,
    /// A Jinja chat template file that replaces the model's own (for a model
    /// without one, or to change its prompt format). Compiled at start.
    pub chat_template: Option<PathBuf>,
    /// How the target's ranks run: `none` (threads of this process,
    /// `tensor_parallel_size` of them) or `mpi` (one process per rank,
    /// started by `mpirun`; needs a build with the `mpi` feature).
    pub distributed: Distributed,
    /// With `distributed = "mpi"`: the longest a rank waits for the others
    /// in one collective (a step's compute included) before the group is
    /// declared failed (a rank dead or hung).
    pub rank_timeout_secs: u64,
    /// With `distributed = "mpi"`: the longest rank 0, once it has loaded
    /// its own shard, waits for the other ranks to load theirs before the
    /// group is declared failed (the job then ends non-zero instead of
    /// waiting for a rank stuck in its load). Generous: a full K3 shard
    /// read from a slow shared volume takes many minutes.
    pub load_timeout_secs: u64,
}

/// `model.distributed` (and `--distributed`): where the target's ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, clap::ValueEnum)]
#[serde(try_from = "String", rename_all = "lowercase")]
pub enum Distributed {
    /// In this process (threads).
    None,
    /// One process per rank under `mpirun`, on one host or many: rank 0
    /// serves, the others follow its steps.
    Mpi,
}

impl TryFrom<String> for Distributed {
    type Error = String;

    /// Errors: a name that is not a variant's, with the allowed names.
    fn try_from(text: String) -> Result<Self, String> {
        parse_choice("model.distributed", &text)
    }
}

impl std::fmt::Display for Distributed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&choice_name(self))
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: PathBuf::from("models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
            tensor_parallel_size: 1,
            max_model_len: None,
            chat_template: None,
            distributed: Distributed::None,
            rank_timeout_secs: 60,
            load_timeout_secs: 3600,
        }
    }
}

/// `[draft]`: the draft model for method "draft".
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DraftConfig {
    pub path: Option<PathBuf>,
    /// Token list (one id per line, e.g. configs/draft-head-qwen2.5.txt)
    /// restricting the draft's output head to those tokens: a cheaper draft
    /// step, still lossless (the verifier keeps the full vocabulary).
    /// `"auto"` (the default) takes the list under configs/ made for the
    /// draft's vocabulary, if there is one; `"off"` keeps the full head.
    /// See `server::draft_head`.
    pub head_tokens: Option<PathBuf>,
}

impl Default for DraftConfig {
    fn default() -> Self {
        Self {
            path: Some(PathBuf::from(
                "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            )),
            head_tokens: Some(PathBuf::from("auto")),
        }
    }
}

/// `[kv]`: the paged KV pool shared by draft and target.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KvConfig {
    pub block_size: usize,
    /// Explicit block count; 0 = derive from `memory_mib`.
    pub num_blocks: usize,
    /// Memory for target + draft caches together.
    pub memory_mib: usize,
    /// How the target's latent attention rows (Kimi K3's MLA layers) are
    /// stored; the pool's blocks per MiB follow. Fixed while running.
    pub latent_dtype: LatentDtype,
    /// Automatic prefix caching, for every model family (a hybrid target
    /// restores a recurrent-state checkpoint at the hit's boundary).
    pub prefix_caching: bool,
    /// Memory for a hybrid target's recurrent-state checkpoints, in MiB
    /// (their own budget, beside `memory_mib`); whole checkpoints only.
    pub state_checkpoint_mib: usize,
    /// Memory for the per-row recurrent states of one step's verification
    /// rows (a hybrid target keeps one after each drafted row, to roll a
    /// rejection back), in MiB; drafts shrink to fit.
    pub row_state_mib: usize,
}

/// `kv.latent_dtype` (and `--kv-latent-dtype`): the storage of a latent
/// KV cache's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, clap::ValueEnum)]
#[serde(try_from = "String", rename_all = "lowercase")]
pub enum LatentDtype {
    /// The model's own choice: bf16 for a Kimi K3 checkpoint whose weights
    /// are bf16 or quantized, f32 for f32 weights and other families.
    Auto,
    /// 4 bytes a value, as computed.
    F32,
    /// 2 bytes a value (Kimi K3 only): half the cache memory, each value
    /// rounded once when written.
    Bf16,
}

impl TryFrom<String> for LatentDtype {
    type Error = String;

    /// Errors: a name that is not a variant's, with the allowed names.
    fn try_from(text: String) -> Result<Self, String> {
        parse_choice("kv.latent_dtype", &text)
    }
}

impl std::fmt::Display for LatentDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&choice_name(self))
    }
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 0,
            memory_mib: 1024,
            latent_dtype: LatentDtype::Auto,
            prefix_caching: true,
            state_checkpoint_mib: crate::engine::DEFAULT_CHECKPOINT_BYTES >> 20,
            row_state_mib: crate::engine::DEFAULT_ROW_STATE_BYTES >> 20,
        }
    }
}

/// `[scheduler]`
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerSection {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Longest prompt whose log-probabilities a request may ask for
    /// (completions' `echo` with `logprobs`): each prompt token costs a
    /// log-softmax and a top-k over the vocabulary inside the forward.
    pub max_echo_prompt_tokens: usize,
}

impl Default for SchedulerSection {
    fn default() -> Self {
        Self {
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
            max_echo_prompt_tokens: 2048,
        }
    }
}

/// The allowed names of a [`clap::ValueEnum`], as `a, b, c` (the names
/// TOML, the command line and error messages all use).
fn choice_names<E: clap::ValueEnum>() -> String {
    E::value_variants()
        .iter()
        .filter_map(|v| v.to_possible_value())
        .map(|p| p.get_name().to_owned())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `text` as one of `E`'s names (exact, lowercase), or an error naming `key`
/// and every allowed name.
fn parse_choice<E: clap::ValueEnum>(key: &str, text: &str) -> Result<E, String> {
    E::from_str(text, false)
        .map_err(|_| format!("`{key}`: '{text}' is not one of {}", choice_names::<E>()))
}

/// The name of `value` as TOML and the command line spell it.
fn choice_name<E: clap::ValueEnum>(value: &E) -> String {
    value
        .to_possible_value()
        .map_or_else(String::new, |p| p.get_name().to_owned())
}

/// `speculative.method` (and `specgate serve --speculative-method`): which
/// proposer the server loads. One type from the TOML file through the
/// command line to `server::load`, which alone turns it into the engine's
/// proposer; the names are the lowercase variant names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, clap::ValueEnum)]
#[serde(try_from = "String", rename_all = "lowercase")]
pub enum SpeculativeMethod {
    /// A small draft model (`[draft] path`) proposes.
    Draft,
    /// Prompt lookup: n-grams of the context propose (no model).
    Ngram,
    /// No speculation: one token per step.
    Off,
    /// The draft model (`[draft] path`) where it fits the target (the same
    /// tokenizer: vocabulary and special tokens, see
    /// `server::speculation`), else prompt lookup as `ngram`; the start-up
    /// log says which and why. What `specgate serve` uses when neither
    /// `--config`, `--draft` nor `--speculative-method` is given, so that
    /// `--model` alone serves any model.
    Auto,
}

/// `speculative.policy` (and `--speculative-policy`): how the draft length k
/// is chosen each step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, clap::ValueEnum)]
#[serde(try_from = "String", rename_all = "lowercase")]
pub enum DraftPolicyKind {
    /// k = `num_tokens` always.
    Fixed,
    /// k from `table` by the running batch size.
    Table,
    /// k from the measured acceptance rate, up to `num_tokens`.
    Adaptive,
    /// Per step, the k of every sequence together that maximise expected
    /// tokens per second from the measured cost model (`[speculative.goodput]`).
    Goodput,
}

impl TryFrom<String> for SpeculativeMethod {
    type Error = String;

    /// Errors: a name that is not a variant's, with the allowed names.
    fn try_from(text: String) -> Result<Self, String> {
        parse_choice("speculative.method", &text)
    }
}

impl TryFrom<String> for DraftPolicyKind {
    type Error = String;

    /// Errors: a name that is not a variant's, with the allowed names.
    fn try_from(text: String) -> Result<Self, String> {
        parse_choice("speculative.policy", &text)
    }
}

impl std::fmt::Display for SpeculativeMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&choice_name(self))
    }
}

impl std::fmt::Display for DraftPolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&choice_name(self))
    }
}

/// `[speculative]`
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculativeConfig {
    /// The proposer; fixed while running (a reload cannot change it).
    pub method: SpeculativeMethod,
    /// k for policy "fixed"; the largest k for "adaptive".
    pub num_tokens: usize,
    /// How k is chosen; the other keys of this section parametrize it.
    pub policy: DraftPolicyKind,
    /// For "table": `[[max_batch_size, k], ...]`, increasing batch sizes.
    pub table: Vec<(usize, usize)>,
    pub ngram_min: usize,
    pub ngram_max: usize,
    pub adaptive: AdaptiveConfig,
    pub goodput: GoodputConfig,
    /// The cross-request proposer. Fixed while running.
    pub suffix: SuffixSection,
    /// Under a grammar (`response_format`, forced tool calls), propose the
    /// tokens the grammar forces as drafts (jump-forward). Outputs are the
    /// same either way; off exists to measure what it is worth. Fixed
    /// while running.
    pub jump_forward: bool,
    /// The most branch nodes a sequence may verify beside its chain in one
    /// step (token trees; 0: chains only). Fixed while running.
    pub tree_branches: usize,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            method: SpeculativeMethod::Draft,
            num_tokens: 3,
            policy: DraftPolicyKind::Goodput,
            table: vec![(1, 3), (2, 2), (4, 1)],
            ngram_min: 1,
            ngram_max: 4,
            adaptive: AdaptiveConfig::default(),
            goodput: GoodputConfig::default(),
            suffix: SuffixSection::default(),
            jump_forward: true,
            tree_branches: crate::engine::DEFAULT_TREE_BRANCHES,
        }
    }
}

/// `[speculative.adaptive]`
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdaptiveConfig {
    pub min_k: usize,
    pub alpha: f64,
    pub draft_cost: f64,
    pub initial_acceptance: f64,
    pub probe_every: u32,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        Self {
            min_k: 0,
            alpha: 0.3,
            draft_cost: 0.7,
            initial_acceptance: 0.7,
            probe_every: 8,
        }
    }
}

/// `[speculative.goodput]`: the default policy's parameters. Its costs are
/// not settings: they are measured (see `specgate_draft::cost`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GoodputConfig {
    /// The longest draft it may choose.
    pub max_k: usize,
    /// Weight of the newest round in the acceptance estimates.
    pub alpha: f64,
    /// Acceptance assumed where nothing was measured yet.
    pub initial_acceptance: f64,
    /// Steps between probes of a sequence left at k = 0.
    pub probe_every: u32,
}

impl Default for GoodputConfig {
    fn default() -> Self {
        Self {
            max_k: 8,
            alpha: 0.3,
            initial_acceptance: 0.6,
            probe_every: 16,
        }
    }
}

/// `speculative.suffix.scope`: whose finished requests a sequence's
/// cross-request proposals may come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, clap::ValueEnum)]
#[serde(try_from = "String", rename_all = "lowercase")]
pub enum SuffixScope {
    /// Only requests made with the same API key (all requests when the
    /// server has no keys): acceptance timing cannot tell one tenant what
    /// another wrote.
    #[value(name = "api_key")]
    ApiKey,
    /// Every request's: for a single-tenant deployment behind keys.
    Global,
}

impl TryFrom<String> for SuffixScope {
    type Error = String;

    /// Errors: a name that is not a variant's, with the allowed names.
    fn try_from(text: String) -> Result<Self, String> {
        parse_choice("speculative.suffix.scope", &text)
    }
}

impl std::fmt::Display for SuffixScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&choice_name(self))
    }
}

/// `[speculative.suffix]`: a model-free proposer that learns from finished
/// requests (prompt + output), chained before the method's own proposer:
/// when the sequence's own context or the pool continues its last
/// `min_match`+ tokens, that guess is drafted (it costs no model step);
/// otherwise the method's proposer drafts.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SuffixSection {
    pub enabled: bool,
    pub scope: SuffixScope,
    /// Shortest matched suffix trusted.
    pub min_match: usize,
    /// Tokens kept per scope (oldest requests dropped first).
    pub max_tokens_per_scope: usize,
    /// Scopes kept (least recently used dropped first).
    pub max_scopes: usize,
}

impl Default for SuffixSection {
    fn default() -> Self {
        Self {
            enabled: true,
            scope: SuffixScope::ApiKey,
            min_match: 3,
            max_tokens_per_scope: 1 << 16,
            max_scopes: 64,
        }
    }
}

impl SuffixSection {
    /// The pool's limits (the rest at their defaults).
    pub fn pool_config(&self) -> specgate_draft::SuffixConfig {
        specgate_draft::SuffixConfig {
            min_match: self.min_match,
            max_match: specgate_draft::SuffixConfig::default()
                .max_match
                .max(self.min_match),
            max_tokens_per_scope: self.max_tokens_per_scope,
            max_scopes: self.max_scopes,
            ..specgate_draft::SuffixConfig::default()
        }
    }
}

impl SpeculativeConfig {
    /// Checks every value of the section, whether the chosen method and
    /// policy use it or not (a bad value waiting in an unused key would
    /// bite at the next edit): `num_tokens` in 0..=[`MAX_DRAFT_TOKENS`] (the engine's cap); every
    /// table row a batch size of at least 1 and a k in 0..=16, at most
    /// [`specgate_draft::policy::MAX_TABLE_ROWS`] rows with increasing batch
    /// sizes; `1 <= ngram_min <= ngram_max <= MAX_NGRAM`; and the adaptive
    /// parameters as [`DraftPolicy::validate`] states, with `adaptive.min_k
    /// <= num_tokens`.
    ///
    /// Errors: the first bad value, naming its key and allowed range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        in_range(
            "speculative.num_tokens",
            self.num_tokens,
            0..=MAX_DRAFT_TOKENS,
        )?;
        in_range("speculative.ngram_min", self.ngram_min, 1..=MAX_NGRAM)?;
        in_range(
            "speculative.ngram_max",
            self.ngram_max,
            self.ngram_min..=MAX_NGRAM,
        )?;
        let a = &self.adaptive;
        in_range("speculative.adaptive.min_k", a.min_k, 0..=self.num_tokens)?;
        if !(a.alpha > 0.0 && a.alpha <= 1.0) {
            return Err(invalid(
                "speculative.adaptive.alpha",
                format!("{} is out of range; allowed (0, 1]", a.alpha),
            ));
        }
        in_range(
            "speculative.adaptive.draft_cost",
            a.draft_cost,
            0.0..=MAX_DRAFT_COST,
        )?;
        in_range(
            "speculative.adaptive.initial_acceptance",
            a.initial_acceptance,
            0.0..=1.0,
        )?;
        in_range(
            "speculative.adaptive.probe_every",
            a.probe_every,
            1..=MAX_PROBE_EVERY,
        )?;
        let x = &self.suffix;
        in_range("speculative.suffix.min_match", x.min_match, 1..=MAX_NGRAM)?;
        in_range(
            "speculative.suffix.max_tokens_per_scope",
            x.max_tokens_per_scope,
            1..=1 << 24,
        )?;
        in_range("speculative.suffix.max_scopes", x.max_scopes, 1..=4096)?;
        let g = &self.goodput;
        in_range("speculative.goodput.max_k", g.max_k, 0..=MAX_DRAFT_TOKENS)?;
        in_range(
            "speculative.tree_branches",
            self.tree_branches,
            0..=MAX_DRAFT_TOKENS,
        )?;
        if !(g.alpha > 0.0 && g.alpha <= 1.0) {
            return Err(invalid(
                "speculative.goodput.alpha",
                format!("{} is out of range; allowed (0, 1]", g.alpha),
            ));
        }
        in_range(
            "speculative.goodput.initial_acceptance",
            g.initial_acceptance,
            0.0..=1.0,
        )?;
        in_range(
            "speculative.goodput.probe_every",
            g.probe_every,
            1..=MAX_PROBE_EVERY,
        )?;
        // The policy's own checks, on every variant the section describes
        // (the table's rows are only checked here).
        for (key, p) in [
            (
                "speculative.num_tokens",
                self.variant(DraftPolicyKind::Fixed),
            ),
            ("speculative.table", self.variant(DraftPolicyKind::Table)),
            (
                "speculative.adaptive",
                self.variant(DraftPolicyKind::Adaptive),
            ),
            (
                "speculative.goodput",
                self.variant(DraftPolicyKind::Goodput),
            ),
        ] {
            p.validate().map_err(|m| invalid(key, m))?;
        }
        Ok(())
    }

    /// The policy named `policy`, from this section's values, unchecked.
    fn variant(&self, policy: DraftPolicyKind) -> DraftPolicy {
        let a = &self.adaptive;
        match policy {
            DraftPolicyKind::Fixed => DraftPolicy::Fixed { k: self.num_tokens },
            DraftPolicyKind::Adaptive => DraftPolicy::Adaptive {
                min_k: a.min_k,
                max_k: self.num_tokens,
                alpha: a.alpha,
                draft_cost: a.draft_cost,
                initial_acceptance: a.initial_acceptance,
                probe_every: a.probe_every,
            },
            DraftPolicyKind::Table => DraftPolicy::BatchTable(self.table.clone()),
            DraftPolicyKind::Goodput => DraftPolicy::Goodput {
                max_k: self.goodput.max_k,
                alpha: self.goodput.alpha,
                initial_acceptance: self.goodput.initial_acceptance,
                probe_every: self.goodput.probe_every,
            },
        }
    }

    /// The draft-length policy this section describes (k = 0 for method
    /// "off").
    ///
    /// Errors: as [`SpeculativeConfig::validate`].
    pub fn policy(&self) -> Result<DraftPolicy, ConfigError> {
        self.validate()?;
        if self.method == SpeculativeMethod::Off {
            return Ok(DraftPolicy::Fixed { k: 0 });
        }
        Ok(self.variant(self.policy))
    }

    /// Every value of the section as `(key, value as TOML would write
    /// it)`, keys relative to `[speculative]`. Destructured field by field
    /// so that a new field cannot be left out of reload checks and logs.
    fn values(&self) -> Vec<(&'static str, String)> {
        let SpeculativeConfig {
            method,
            num_tokens,
            policy,
            table,
            ngram_min,
            ngram_max,
            adaptive,
            goodput,
            suffix,
            jump_forward,
            tree_branches,
        } = self;
        let SuffixSection {
            enabled: x_enabled,
            scope: x_scope,
            min_match: x_min,
            max_tokens_per_scope: x_tokens,
            max_scopes: x_scopes,
        } = suffix;
        let AdaptiveConfig {
            min_k,
            alpha,
            draft_cost,
            initial_acceptance,
            probe_every,
        } = adaptive;
        let GoodputConfig {
            max_k: g_max_k,
            alpha: g_alpha,
            initial_acceptance: g_initial,
            probe_every: g_probe,
        } = goodput;
        let rows: Vec<String> = table.iter().map(|(b, k)| format!("[{b}, {k}]")).collect();
        vec![
            ("method", format!("\"{method}\"")),
            ("num_tokens", num_tokens.to_string()),
            ("policy", format!("\"{policy}\"")),
            ("table", format!("[{}]", rows.join(", "))),
            ("ngram_min", ngram_min.to_string()),
            ("ngram_max", ngram_max.to_string()),
            ("adaptive.min_k", min_k.to_string()),
            ("adaptive.alpha", alpha.to_string()),
            ("adaptive.draft_cost", draft_cost.to_string()),
            (
                "adaptive.initial_acceptance",
                initial_acceptance.to_string(),
            ),
            ("adaptive.probe_every", probe_every.to_string()),
            ("goodput.max_k", g_max_k.to_string()),
            ("goodput.alpha", g_alpha.to_string()),
            ("goodput.initial_acceptance", g_initial.to_string()),
            ("goodput.probe_every", g_probe.to_string()),
            ("suffix.enabled", x_enabled.to_string()),
            ("suffix.scope", format!("\"{x_scope}\"")),
            ("suffix.min_match", x_min.to_string()),
            ("suffix.max_tokens_per_scope", x_tokens.to_string()),
            ("suffix.max_scopes", x_scopes.to_string()),
            ("jump_forward", jump_forward.to_string()),
            ("tree_branches", tree_branches.to_string()),
        ]
    }
}

/// What a live reload of `[speculative]` applies.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeReload {
    /// The new `[speculative]` in force: the file's, with the method in
    /// force kept (it may come from the command line; the method itself
    /// cannot change while running).
    pub speculative: SpeculativeConfig,
    /// The draft-length policy of `speculative`, checked.
    pub policy: DraftPolicy,
    /// The whole file as parsed now: the next reload compares against it.
    pub file: Config,
    /// One `speculative.key: old -> new` line per value that changes in
    /// force; empty when the edit changed nothing.
    pub changes: Vec<String>,
}

impl SpeculativeReload {
    /// The changes for a log line: `"a: 1 -> 2, b: x -> y"`, or `"no
    /// change"`.
    pub fn summary(&self) -> String {
        if self.changes.is_empty() {
            "no change".into()
        } else {
            self.changes.join(", ")
        }
    }
}

impl Config {
    /// Parses TOML text; `path` only names the file in errors.
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and checks a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Checks every value against its bounds; zero is refused wherever it
    /// would mean "never" or "nothing". The ranges (inclusive):
    ///
    /// | key | allowed | why |
    /// |---|---|---|
    /// | `server.host` | 1..=253 bytes, no whitespace | a DNS name's limit |
    /// | `server.port` | 0..=65535 | 0 picks a free port |
    /// | `server.api_keys` | at most 1024 keys, each 1..=512 visible ASCII bytes | a key must fit in a header to ever match |
    /// | `server.served_model_name` | 1..=256 bytes | |
    /// | `server.max_body_bytes` | 1 KiB..=64 MiB | a chat request fits in 1 KiB; 64 MiB is far above any context |
    /// | `server.max_concurrent_requests` | 1..=65536 | |
    /// | `server.max_connections` | 1..=262144 | file descriptors |
    /// | `server.max_connections_per_client` | 1..=262144 | |
    /// | `server.max_requests_per_client` | 1..=65536 (above `max_concurrent_requests` acts as it) | |
    /// | `server.max_blocking_jobs` | 1..=1024 | threads of CPU work at once |
    /// | `server.max_messages` | 1..=65536 | a template's time grows with the messages, for some quadratically |
    /// | `server.request_timeout_secs` | 1..=86400 | |
    /// | `server.drain_timeout_secs` | 0..=3600 | 0 = cut at once |
    /// | `server.keep_alive_secs` | 1..=600 | proxies drop idle streams after about a minute |
    /// | `server.header_read_timeout_secs` | 1..=300 | slowloris |
    /// | `server.body_read_timeout_secs`, `stream_write_timeout_secs` | 1..=3600 | |
    /// | `server.stored_responses_per_key` | 0..=65536 | 0 keeps none |
    /// | `server.stored_responses_mib_per_key` | 1..=65536 | |
    /// | `server.cors_allow_origins` | at most 64; `"*"` alone, or origins `scheme://host[:port]` of at most 256 bytes | a browser's `Origin` is exactly that |
    /// | `model.path`, `draft.path`, `draft.head_tokens` | not empty | |
    /// | `model.tensor_parallel_size` | 1..=64 | |
    /// | `model.rank_timeout_secs` | 1..=86400 | |
    /// | `model.load_timeout_secs` | 1..=86400 | |
    /// | `model.max_model_len` | 1..=16777216 (and at most the model's context, checked at load) | |
    /// | `model.chat_template` | not empty | |
    /// | `kv.block_size` | 1..=256 | |
    /// | `kv.num_blocks` | 0 (derive from memory) or 1..=4194304 | block ids are u32; 2^22 blocks hold 2^22 * block_size tokens |
    /// | `kv.memory_mib` | 1..=1048576 (0 when `num_blocks` is set) | 1 TiB |
    /// | `kv.state_checkpoint_mib` | 0..=1048576 | 1 TiB; 0 keeps no checkpoint (a hybrid target then never hits) |
    /// | `kv.row_state_mib` | 0..=1048576 | 1 TiB; 0: a hybrid target verifies no draft (plain decoding) |
    /// | `scheduler.max_num_seqs` | 1..=4096 | |
    /// | `scheduler.max_num_batched_tokens` | max_num_seqs..=1048576 | every running sequence can decode a row each step (as vLLM requires) |
    /// | `scheduler.max_echo_prompt_tokens` | 1..=16777216 | |
    /// | `[speculative]` | see [`SpeculativeConfig::validate`] | |
    /// | `[router]` | see `RouterConfig::validate` | |
    ///
    /// Errors: the first bad value, naming its key and allowed range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let s = &self.server;
        text_ok("server.host", &s.host, 253, false)?;
        in_range("server.api_keys (count)", s.api_keys.len(), 0..=1024)?;
        for key in &s.api_keys {
            // Bearer tokens travel in a header: visible ASCII only.
            if key.is_empty() || key.len() > 512 || !key.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(invalid(
                    "server.api_keys",
                    "each key must be 1..=512 visible ASCII characters",
                ));
            }
        }
        if let Some(name) = &s.served_model_name {
            text_ok("server.served_model_name", name, 256, true)?;
        }
        in_range(
            "server.max_body_bytes",
            s.max_body_bytes,
            1 << 10..=64 << 20,
        )?;
        in_range(
            "server.max_concurrent_requests",
            s.max_concurrent_requests,
            1..=65_536,
        )?;
        in_range("server.max_connections", s.max_connections, 1..=262_144)?;
        in_range(
            "server.max_connections_per_client",
            s.max_connections_per_client,
            1..=262_144,
        )?;
        in_range(
            "server.max_requests_per_client",
            s.max_requests_per_client,
            1..=65_536,
        )?;
        in_range("server.max_blocking_jobs", s.max_blocking_jobs, 1..=1024)?;
        in_range("server.max_messages", s.max_messages, 1..=65_536)?;
        in_range(
            "server.request_timeout_secs",
            s.request_timeout_secs,
            1..=86_400,
        )?;
        in_range("server.drain_timeout_secs", s.drain_timeout_secs, 0..=3_600)?;
        in_range("server.keep_alive_secs", s.keep_alive_secs, 1..=600)?;
        in_range(
            "server.header_read_timeout_secs",
            s.header_read_timeout_secs,
            1..=300,
        )?;
        in_range(
            "server.body_read_timeout_secs",
            s.body_read_timeout_secs,
            1..=3_600,
        )?;
        in_range(
            "server.stream_write_timeout_secs",
            s.stream_write_timeout_secs,
            1..=3_600,
        )?;
        check_cors_origins(&s.cors_allow_origins)?;
        in_range(
            "server.stored_responses_per_key",
            s.stored_responses_per_key,
            0..=65_536,
        )?;
        in_range(
            "server.stored_responses_mib_per_key",
            s.stored_responses_mib_per_key,
            1..=65_536,
        )?;

        let path_ok = |key: &str, p: &Path| {
            if p.as_os_str().is_empty() {
                Err(invalid(key, "must not be empty"))
            } else {
                Ok(())
            }
        };
        path_ok("model.path", &self.model.path)?;
        in_range(
            "model.tensor_parallel_size",
            self.model.tensor_parallel_size,
            1..=64,
        )?;
        in_range(
            "model.rank_timeout_secs",
            self.model.rank_timeout_secs,
            1..=86400,
        )?;
        in_range(
            "model.load_timeout_secs",
            self.model.load_timeout_secs,
            1..=86400,
        )?;
        if let Some(n) = self.model.max_model_len {
            in_range("model.max_model_len", n, 1..=MAX_MODEL_LEN)?;
        }
        if let Some(p) = &self.model.chat_template {
            path_ok("model.chat_template", p)?;
        }
        if let Some(p) = &self.draft.path {
            path_ok("draft.path", p)?;
        }
        if let Some(p) = &self.draft.head_tokens {
            path_ok("draft.head_tokens", p)?;
        }

        let kv = &self.kv;
        in_range("kv.block_size", kv.block_size, 1..=256)?;
        in_range("kv.num_blocks", kv.num_blocks, 0..=1 << 22)?;
        // The memory budget sizes the pool only when no block count is set.
        let min_mib = usize::from(kv.num_blocks == 0);
        in_range("kv.memory_mib", kv.memory_mib, min_mib..=1 << 20)?;
        in_range(
            "kv.state_checkpoint_mib",
            kv.state_checkpoint_mib,
            0..=1 << 20,
        )?;
        in_range("kv.row_state_mib", kv.row_state_mib, 0..=1 << 20)?;

        let sch = &self.scheduler;
        in_range("scheduler.max_num_seqs", sch.max_num_seqs, 1..=4_096)?;
        in_range(
            "scheduler.max_num_batched_tokens",
            sch.max_num_batched_tokens,
            sch.max_num_seqs..=1 << 20,
        )?;
        in_range(
            "scheduler.max_echo_prompt_tokens",
            sch.max_echo_prompt_tokens,
            1..=MAX_MODEL_LEN,
        )?;

        self.speculative.validate()?;
        if self.speculative.method == SpeculativeMethod::Draft && self.draft.path.is_none() {
            return Err(invalid(
                "draft.path",
                "speculative.method = \"draft\" needs a draft model",
            ));
        }
        self.router.validate().map_err(ConfigError::from)?;
        Ok(())
    }

    /// Re-reads the config file at `path` for live tuning of
    /// `[speculative]`. `self` is the file as last accepted (as
    /// [`Config::load`] read it, WITHOUT command-line overrides: they would
    /// look like edits); `in_force` is the `[speculative]` running now
    /// (which may carry a command-line method).
    ///
    /// Applied only when the new file
    /// - is not empty and ends with a newline: a file cut short while it is
    ///   being written usually ends mid-line, and a number cut there (`12`
    ///   -> `1`) would still parse;
    /// - parses whole and passes [`Config::validate`] (unknown keys too);
    /// - equals the last accepted file in every section but `[speculative]`
    ///   (those need a restart);
    /// - changes no `[speculative]` value by leaving its key out: a key
    ///   that is missing now but changed value fell back to its default,
    ///   which is what a file truncated before or inside `[speculative]`
    ///   looks like. To go back to a default, write it out. (A missing key
    ///   whose value stays the same changes nothing and is accepted.)
    /// - keeps `method` (the proposer in memory).
    ///
    /// Errors: [`ConfigError::Io`], `Parse` or `Invalid` for the file,
    /// [`ConfigError::Reload`] naming the section or key for the rest. The
    /// caller keeps the settings in force then.
    pub fn reload(
        &self,
        path: &Path,
        in_force: &SpeculativeConfig,
    ) -> Result<SpeculativeReload, ConfigError> {
        let refuse = |reason: String| ConfigError::Reload {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if text.is_empty() {
            return Err(refuse("the file is empty (being rewritten?)".into()));
        }
        if !text.ends_with('\n') {
            return Err(refuse(
                "the file does not end with a newline, so it may be cut short \
                 (being written?); end it with a newline to apply it"
                    .into(),
            ));
        }
        let file = Self::from_toml(&text, path)?;

        // Every section but [speculative] must be as it was. Destructured so
        // that a new section cannot be left out.
        let Config {
            server,
            model,
            draft,
            kv,
            scheduler,
            speculative: _,
            router,
        } = &file;
        let changed: Vec<&str> = [
            ("[server]", *server != self.server),
            ("[model]", *model != self.model),
            ("[draft]", *draft != self.draft),
            ("[kv]", *kv != self.kv),
            ("[scheduler]", *scheduler != self.scheduler),
            ("[router]", *router != self.router),
        ]
        .into_iter()
        .filter_map(|(name, differs)| differs.then_some(name))
        .collect();
        if !changed.is_empty() {
            return Err(refuse(format!(
                "{} changed; only [speculative] can change while running \
                 (restart to apply the rest)",
                changed.join(", ")
            )));
        }

        let present = speculative_keys(&text);
        let before = self.speculative.values();
        for ((key, old), (_, new)) in before.iter().zip(file.speculative.values()) {
            if *old != new && !present.iter().any(|k| k == key) {
                return Err(refuse(format!(
                    "speculative.{key} is missing but was {old}, so it would fall back \
                     to its default {new}; a file cut short looks like this. Write \
                     the key out to change it"
                )));
            }
        }
        if file.speculative.method != self.speculative.method {
            return Err(refuse(format!(
                "speculative.method changed (\"{}\" -> \"{}\"); changing the method needs a restart",
                self.speculative.method, file.speculative.method
            )));
        }

        if file.speculative.jump_forward != self.speculative.jump_forward {
            return Err(refuse(format!(
                "speculative.jump_forward changed ({} -> {}); it needs a restart",
                self.speculative.jump_forward, file.speculative.jump_forward
            )));
        }

        if file.speculative.tree_branches != self.speculative.tree_branches {
            return Err(refuse(format!(
                "speculative.tree_branches changed ({} -> {}); it needs a restart",
                self.speculative.tree_branches, file.speculative.tree_branches
            )));
        }

        if file.speculative.suffix != self.speculative.suffix {
            return Err(refuse(
                "[speculative.suffix] changed; the cross-request proposer needs a restart".into(),
            ));
        }

        let speculative = SpeculativeConfig {
            method: in_force.method,
            jump_forward: in_force.jump_forward,
            tree_branches: in_force.tree_branches,
            suffix: in_force.suffix.clone(),
            ..file.speculative.clone()
        };
        let policy = speculative.policy()?;
        let changes = in_force
            .values()
            .into_iter()
            .zip(speculative.values())
            .filter(|((_, old), (_, new))| old != new)
            .map(|((key, old), (_, new))| format!("speculative.{key}: {old} -> {new}"))
            .collect();
        Ok(SpeculativeReload {
            speculative,
            policy,
            file,
            changes,
        })
    }
}

/// The keys the TOML `text` spells out in `[speculative]`, as
/// [`SpeculativeConfig::values`] names them (`adaptive.alpha` for
/// `[speculative.adaptive] alpha`). Empty when the section is absent.
fn speculative_keys(text: &str) -> Vec<String> {
    let Ok(root) = toml::from_str::<toml::Table>(text) else {
        return Vec::new();
    };
    let Some(toml::Value::Table(sp)) = root.get("speculative") else {
        return Vec::new();
    };
    let mut keys = Vec::new();
    for (k, v) in sp {
        match (k.as_str(), v) {
            ("adaptive", toml::Value::Table(a)) => {
                keys.extend(a.keys().map(|ak| format!("adaptive.{ak}")));
            }
            _ => keys.push(k.clone()),
        }
    }
    keys
}

#[cfg(test)]
mod tests;

/// `server.cors_allow_origins`: `["*"]`, or up to 64 origins as a browser
/// sends them in `Origin` (`scheme://host[:port]`, no path; a trailing `/`
/// is tolerated). A path or a wildcard inside a name would never match, so
/// it is refused rather than silently ignored.
fn check_cors_origins(origins: &[String]) -> Result<(), ConfigError> {
    const KEY: &str = "server.cors_allow_origins";
    in_range("server.cors_allow_origins (count)", origins.len(), 0..=64)?;
    if origins.iter().any(|o| o == "*") {
        if origins.len() > 1 {
            return Err(invalid(KEY, "\"*\" allows every origin; list it alone"));
        }
        return Ok(());
    }
    for o in origins {
        let bad = |why: &str| invalid(KEY, format!("{o:?} is not an origin: {why}"));
        if o.is_empty() || o.len() > 256 || !o.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad("expected 1..=256 visible ASCII characters"));
        }
        let Some((scheme, rest)) = o.split_once("://") else {
            return Err(bad("expected scheme://host[:port]"));
        };
        let host = rest.strip_suffix('/').unwrap_or(rest);
        let scheme_ok = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
        if !scheme_ok {
            return Err(bad("the scheme is not valid"));
        }
        if host.is_empty() || host.contains(['/', '*', '?', '#', '@']) {
            return Err(bad("expected a host with an optional port and no path"));
        }
    }
    Ok(())
}
