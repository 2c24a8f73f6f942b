//! The arguments of `specgate serve` and `specgate route` and how they
//! override the config file: each flag names one config key, a flag given
//! replaces that key's value, a flag left out leaves the file's (or the
//! default's). The binary (src/main.rs) only parses and dispatches; this
//! module is in the library so that tests can check every flag against its
//! key. Flag names follow vLLM's where vLLM has the setting
//! (`--served-model-name`, `--max-model-len`, `--tensor-parallel-size`,
//! `--num-speculative-tokens`, `--max-num-seqs`, `--chat-template`,
//! `--api-key`, `--block-size`), so a vLLM command line mostly carries over.

use crate::config::{Config, ConfigError, DraftPolicyKind, LatentDtype, SpeculativeMethod};
use crate::router::RouterConfig;
use crate::server::ConfigFile;
use std::path::{Path, PathBuf};

/// `specgate serve`: every flag overrides one key of the config file.
///
/// Flags for `[speculative]` keys other than the method hold until the
/// config file is reloaded (SIGHUP or an edit): a reload applies the file's
/// `[speculative]` and logs each value it changes.
#[derive(Debug, Clone, Default, PartialEq, clap::Parser)]
pub struct ServeArgs {
    /// TOML config file (default: built-in defaults, i.e. configs/default.toml's values,
    /// except that without --draft and --speculative-method the method is auto: the
    /// built-in draft where it fits --model, else n-gram lookup). Its [speculative]
    /// section is re-read on SIGHUP and when the file changes.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Address to bind (overrides [server] host).
    #[arg(long)]
    pub host: Option<String>,
    /// Port to bind; 0 picks a free one (overrides [server] port).
    #[arg(long)]
    pub port: Option<u16>,
    /// An accepted bearer key (repeatable; overrides [server] api_keys). Without
    /// --api-key, the environment variable supplies one key.
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = "SPECGATE_API_KEY",
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// A browser origin allowed to call the API, such as
    /// https://app.example.com, or * for any (repeatable; overrides [server]
    /// cors_allow_origins).
    #[arg(long = "cors-allow-origin", value_name = "ORIGIN")]
    pub cors_allow_origins: Vec<String>,
    /// Model name on /v1/models and required in requests (overrides [server]
    /// served_model_name; default: the model file's stem).
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Requests admitted at once, running or queued; more get 429 (overrides
    /// [server] max_concurrent_requests).
    #[arg(long, value_name = "N")]
    pub max_concurrent_requests: Option<usize>,
    /// Seconds after which an unfinished request is ended (overrides [server]
    /// request_timeout_secs).
    #[arg(long, value_name = "SECS")]
    pub request_timeout_secs: Option<u64>,

    /// Target (verifier) model: a .gguf file or a safetensors directory
    /// (overrides [model] path).
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Ranks (threads) the target is sharded over (overrides [model]
    /// tensor_parallel_size).
    #[arg(long, value_name = "N")]
    pub tensor_parallel_size: Option<usize>,
    /// Where the target's ranks run: none (threads of this process) or mpi
    /// (one process per rank under mpirun; rank 0 serves) (overrides [model]
    /// distributed).
    #[arg(long, value_enum, value_name = "MODE")]
    pub distributed: Option<crate::config::Distributed>,
    /// With --distributed mpi: seconds a rank waits for the others in one
    /// collective before the group is declared failed (overrides [model]
    /// rank_timeout_secs).
    #[arg(long, value_name = "SECS")]
    pub rank_timeout_secs: Option<u64>,
    /// With --distributed mpi: seconds rank 0 waits for the other ranks to
    /// load their shards before the group is declared failed (overrides
    /// [model] load_timeout_secs).
    #[arg(long, value_name = "SECS")]
    pub load_timeout_secs: Option<u64>,
    /// Longest context (prompt + output tokens) a request may use; at most the
    /// model's own (overrides [model] max_model_len).
    #[arg(long, value_name = "TOKENS")]
    pub max_model_len: Option<usize>,
    /// Jinja chat template file replacing the model's own (overrides [model]
    /// chat_template).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,

    /// Draft model file for --speculative-method draft (overrides [draft] path).
    #[arg(long, value_name = "PATH")]
    pub draft: Option<PathBuf>,
    /// Token id list restricting the draft's output head: lossless, cheaper
    /// draft steps (overrides [draft] head_tokens).
    #[arg(long, value_name = "FILE")]
    pub draft_head_tokens: Option<PathBuf>,

    /// Tokens per KV block (overrides [kv] block_size).
    #[arg(long, value_name = "TOKENS")]
    pub block_size: Option<usize>,
    /// KV blocks in the pool; 0 derives the count from --kv-memory-mib
    /// (overrides [kv] num_blocks).
    #[arg(long, value_name = "N")]
    pub num_blocks: Option<usize>,
    /// Memory for the target's and the draft's KV caches together, in MiB
    /// (overrides [kv] memory_mib).
    #[arg(long, value_name = "MIB")]
    pub kv_memory_mib: Option<usize>,
    /// Storage of the target's latent KV rows (Kimi K3): auto, f32 or bf16
    /// (overrides [kv] latent_dtype).
    #[arg(long, value_enum, value_name = "DTYPE")]
    pub kv_latent_dtype: Option<LatentDtype>,
    /// Automatic prefix caching on or off, for every model family
    /// (overrides [kv] prefix_caching).
    #[arg(long, value_name = "BOOL", action = clap::ArgAction::Set)]
    pub prefix_caching: Option<bool>,
    /// Memory for a hybrid target's recurrent-state checkpoints, in MiB
    /// (overrides [kv] state_checkpoint_mib).
    #[arg(long, value_name = "MIB")]
    pub state_checkpoint_mib: Option<usize>,
    /// Memory for one step's per-row recurrent states of a hybrid target's
    /// verification rows, in MiB (overrides [kv] row_state_mib).
    #[arg(long, value_name = "MIB")]
    pub row_state_mib: Option<usize>,

    /// Sequences decoding at once (overrides [scheduler] max_num_seqs).
    #[arg(long, value_name = "N")]
    pub max_num_seqs: Option<usize>,
    /// Rows (decode k+1 per sequence + prompt chunks) per step (overrides
    /// [scheduler] max_num_batched_tokens).
    #[arg(long, value_name = "N")]
    pub max_num_batched_tokens: Option<usize>,

    /// The proposer; requests may ask for another (overrides [speculative]
    /// method; without --config and --draft the default is auto).
    #[arg(long, value_enum, value_name = "METHOD")]
    pub speculative_method: Option<SpeculativeMethod>,
    /// How the draft length k is chosen each step (overrides [speculative]
    /// policy).
    #[arg(long, value_enum, value_name = "POLICY")]
    pub speculative_policy: Option<DraftPolicyKind>,
    /// k for policy fixed, the largest k for adaptive (overrides
    /// [speculative] num_tokens).
    #[arg(long, value_name = "K")]
    pub num_speculative_tokens: Option<usize>,
    /// Shortest n-gram prompt lookup matches (overrides [speculative] ngram_min).
    #[arg(long, value_name = "N")]
    pub ngram_min: Option<usize>,
    /// Longest n-gram prompt lookup matches (overrides [speculative] ngram_max).
    #[arg(long, value_name = "N")]
    pub ngram_max: Option<usize>,
}

impl ServeArgs {
    /// Writes every flag that was given over its key in `cfg`; keys without a
    /// flag keep their value. Nothing is checked here: call
    /// [`Config::validate`] on the result (a flag can break a rule that spans
    /// keys, such as `max_num_batched_tokens >= max_num_seqs`).
    pub fn apply(&self, cfg: &mut Config) {
        // Destructured so that a new flag cannot be left out here.
        let ServeArgs {
            config: _,
            host,
            port,
            api_keys,
            cors_allow_origins,
            served_model_name,
            max_concurrent_requests,
            request_timeout_secs,
            model,
            tensor_parallel_size,
            distributed,
            rank_timeout_secs,
            load_timeout_secs,
            max_model_len,
            chat_template,
            draft,
            draft_head_tokens,
            block_size,
            num_blocks,
            kv_memory_mib,
            kv_latent_dtype,
            prefix_caching,
            state_checkpoint_mib,
            row_state_mib,
            max_num_seqs,
            max_num_batched_tokens,
            speculative_method,
            speculative_policy,
            num_speculative_tokens,
            ngram_min,
            ngram_max,
        } = self.clone();
        fn set<T>(key: &mut T, flag: Option<T>) {
            if let Some(v) = flag {
                *key = v;
            }
        }
        let s = &mut cfg.server;
        set(&mut s.host, host);
        set(&mut s.port, port);
        if !api_keys.is_empty() {
            s.api_keys = api_keys;
        }
        if !cors_allow_origins.is_empty() {
            s.cors_allow_origins = cors_allow_origins;
        }
        set(&mut s.served_model_name, served_model_name.map(Some));
        set(&mut s.max_concurrent_requests, max_concurrent_requests);
        set(&mut s.request_timeout_secs, request_timeout_secs);
        let m = &mut cfg.model;
        set(&mut m.path, model);
        set(&mut m.tensor_parallel_size, tensor_parallel_size);
        set(&mut m.distributed, distributed);
        set(&mut m.rank_timeout_secs, rank_timeout_secs);
        set(&mut m.load_timeout_secs, load_timeout_secs);
        set(&mut m.max_model_len, max_model_len.map(Some));
        set(&mut m.chat_template, chat_template.map(Some));
        set(&mut cfg.draft.path, draft.map(Some));
        set(&mut cfg.draft.head_tokens, draft_head_tokens.map(Some));
        set(&mut cfg.kv.block_size, block_size);
        set(&mut cfg.kv.num_blocks, num_blocks);
        set(&mut cfg.kv.memory_mib, kv_memory_mib);
        set(&mut cfg.kv.latent_dtype, kv_latent_dtype);
        set(&mut cfg.kv.prefix_caching, prefix_caching);
        set(&mut cfg.kv.state_checkpoint_mib, state_checkpoint_mib);
        set(&mut cfg.kv.row_state_mib, row_state_mib);
        set(&mut cfg.scheduler.max_num_seqs, max_num_seqs);
        set(
            &mut cfg.scheduler.max_num_batched_tokens,
            max_num_batched_tokens,
        );
        let sp = &mut cfg.speculative;
        set(&mut sp.method, speculative_method);
        set(&mut sp.policy, speculative_policy);
        set(&mut sp.num_tokens, num_speculative_tokens);
        set(&mut sp.ngram_min, ngram_min);
        set(&mut sp.ngram_max, ngram_max);
    }

    /// The config to serve with: `--config`'s file (or the defaults) with
    /// the flags applied and checked; and the file as loaded, before the
    /// flags, for live reloads (a reload compares the file with what the
    /// file said, not with the flags).
    ///
    /// Without `--config`, `--draft` and `--speculative-method`, the method
    /// is [`SpeculativeMethod::Auto`]: the built-in draft is nobody's
    /// choice, so a `--model` it does not fit speculates by n-gram lookup
    /// instead of failing to start. A draft that was asked for (a flag or
    /// the file) keeps the method `draft`, which must fit.
    ///
    /// Errors: the file cannot be read or parsed, or a value (from the file
    /// or a flag) is out of its bounds ([`ConfigError`] names the key).
    pub fn resolve(&self) -> Result<(Config, Option<ConfigFile>), ConfigError> {
        let file = match &self.config {
            Some(p) => Some(ConfigFile {
                path: p.clone(),
                as_loaded: Config::load(p)?,
            }),
            None => None,
        };
        let mut cfg = file
            .as_ref()
            .map_or_else(Config::default, |f| f.as_loaded.clone());
        if self.config.is_none() && self.draft.is_none() && self.speculative_method.is_none() {
            cfg.speculative.method = SpeculativeMethod::Auto;
        }
        self.apply(&mut cfg);
        cfg.validate()?;
        Ok((cfg, file))
    }
}

/// `specgate route`: flags override the config file's `[router]`.
#[derive(Debug, Clone, Default, PartialEq, clap::Parser)]
pub struct RouteArgs {
    /// TOML config file; only its [router] section is used.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to bind (overrides [router] host).
    #[arg(long)]
    pub host: Option<String>,
    /// Port to bind; 0 picks a free one (overrides [router] port).
    #[arg(long)]
    pub port: Option<u16>,
    /// A replica base URL such as http://10.0.0.7:8000 (repeatable; overrides
    /// [router] replicas).
    #[arg(long = "replica", value_name = "URL")]
    pub replicas: Vec<String>,
    /// Discover replicas from a DNS name, `name:port`, e.g. a headless
    /// Service (overrides [router] discovery_dns).
    #[arg(long, value_name = "NAME:PORT")]
    pub discovery_dns: Option<String>,
}

impl RouteArgs {
    /// Writes every flag that was given over its key in `cfg`.
    pub fn apply(&self, cfg: &mut RouterConfig) {
        let RouteArgs {
            config: _,
            host,
            port,
            replicas,
            discovery_dns,
        } = self.clone();
        if let Some(h) = host {
            cfg.host = h;
        }
        if let Some(p) = port {
            cfg.port = p;
        }
        if !replicas.is_empty() {
            cfg.replicas = replicas;
        }
        if let Some(d) = discovery_dns {
            cfg.discovery_dns = Some(d);
        }
    }

    /// The router's settings: `--config`'s `[router]` (or the defaults)
    /// with the flags applied, checked for routing.
    ///
    /// Errors: the file cannot be read, parsed or validated (the whole file
    /// is checked, as `serve` would); a `[router]` value is out of bounds;
    /// no replica and no discovery name is set.
    pub fn resolve(&self) -> Result<RouterConfig, ConfigError> {
        let mut cfg = match &self.config {
            Some(p) => Config::load(Path::new(p))?.router,
            None => RouterConfig::default(),
        };
        self.apply(&mut cfg);
        cfg.validate_for_routing()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests;
