//! The TOML configuration file: server, target model, draft, KV pool,
//! scheduler and speculation sections (and `[router]` for `specgate
//! route`). Unknown keys and bad values fail at start with a message naming
//! the key; every field has a default so a
//! file only says what it changes. `[speculative]` can be re-read while
//! running (see [`Config::reload_speculative`]).

use serde::Deserialize;
use specgate_draft::DraftPolicy;
use std::path::{Path, PathBuf};

/// Errors of reading or checking a config file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        message: message.into(),
    }
}

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
        }
    }
}

/// `[model]`: the target (verifier).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    pub path: PathBuf,
    pub tensor_parallel_size: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: PathBuf::from("models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
            tensor_parallel_size: 1,
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
    pub head_tokens: Option<PathBuf>,
}

impl Default for DraftConfig {
    fn default() -> Self {
        Self {
            path: Some(PathBuf::from(
                "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            )),
            head_tokens: None,
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
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 0,
            memory_mib: 1024,
        }
    }
}

/// `[scheduler]`
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerSection {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

impl Default for SchedulerSection {
    fn default() -> Self {
        Self {
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
        }
    }
}

/// `[speculative]`
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculativeConfig {
    /// "draft", "ngram" or "off".
    pub method: String,
    /// k for policy "fixed"; the largest k for "adaptive".
    pub num_tokens: usize,
    /// "fixed", "table" or "adaptive".
    pub policy: String,
    /// For "table": `[[max_batch_size, k], ...]`, increasing batch sizes.
    pub table: Vec<(usize, usize)>,
    pub ngram_min: usize,
    pub ngram_max: usize,
    pub adaptive: AdaptiveConfig,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            method: "draft".into(),
            num_tokens: 3,
            policy: "table".into(),
            table: vec![(1, 3), (2, 2), (4, 1)],
            ngram_min: 1,
            ngram_max: 4,
            adaptive: AdaptiveConfig::default(),
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

impl SpeculativeConfig {
    /// The draft-length policy this section describes.
    ///
    /// Errors: an unknown method or policy, or bad parameters, naming the key.
    pub fn policy(&self) -> Result<DraftPolicy, ConfigError> {
        if !["draft", "ngram", "off"].contains(&self.method.as_str()) {
            return Err(invalid(
                "speculative.method",
                format!("'{}' is not one of draft, ngram, off", self.method),
            ));
        }
        if self.num_tokens > 16 {
            return Err(invalid("speculative.num_tokens", "at most 16"));
        }
        let p = match self.policy.as_str() {
            _ if self.method == "off" => DraftPolicy::Fixed { k: 0 },
            "fixed" => DraftPolicy::Fixed { k: self.num_tokens },
            "table" => DraftPolicy::BatchTable(self.table.clone()),
            "adaptive" => DraftPolicy::Adaptive {
                min_k: self.adaptive.min_k,
                max_k: self.num_tokens,
                alpha: self.adaptive.alpha,
                draft_cost: self.adaptive.draft_cost,
                initial_acceptance: self.adaptive.initial_acceptance,
                probe_every: self.adaptive.probe_every,
            },
            other => {
                return Err(invalid(
                    "speculative.policy",
                    format!("'{other}' is not one of fixed, table, adaptive"),
                ))
            }
        };
        let key = match self.policy.as_str() {
            "table" => "speculative.table",
            "adaptive" => "speculative.adaptive",
            _ => "speculative",
        };
        p.validate().map_err(|m| invalid(key, m))?;
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max {
            return Err(invalid(
                "speculative.ngram_min",
                "needs 1 <= ngram_min <= ngram_max",
            ));
        }
        Ok(p)
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

    /// Checks values that types cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let s = &self.server;
        if s.max_body_bytes == 0 {
            return Err(invalid("server.max_body_bytes", "must be positive"));
        }
        if s.max_concurrent_requests == 0 {
            return Err(invalid(
                "server.max_concurrent_requests",
                "must be positive",
            ));
        }
        if s.request_timeout_secs == 0 {
            return Err(invalid("server.request_timeout_secs", "must be positive"));
        }
        if s.keep_alive_secs == 0 {
            return Err(invalid("server.keep_alive_secs", "must be positive"));
        }
        if self.model.tensor_parallel_size == 0 {
            return Err(invalid("model.tensor_parallel_size", "must be at least 1"));
        }
        if self.kv.block_size == 0 {
            return Err(invalid("kv.block_size", "must be positive"));
        }
        if self.kv.num_blocks == 0 && self.kv.memory_mib == 0 {
            return Err(invalid(
                "kv.memory_mib",
                "set kv.num_blocks or kv.memory_mib",
            ));
        }
        if self.scheduler.max_num_seqs == 0 {
            return Err(invalid("scheduler.max_num_seqs", "must be positive"));
        }
        if self.scheduler.max_num_batched_tokens == 0 {
            return Err(invalid(
                "scheduler.max_num_batched_tokens",
                "must be positive",
            ));
        }
        self.speculative.policy()?;
        if self.speculative.method == "draft" && self.draft.path.is_none() {
            return Err(invalid(
                "draft.path",
                "speculative.method = \"draft\" needs a draft model",
            ));
        }
        self.router.validate()?;
        Ok(())
    }

    /// Re-reads only `[speculative]` from `path` for live tuning: the new
    /// section must be valid and keep the method (the proposer in memory).
    ///
    /// Errors: unreadable or invalid file, or a changed method; the caller
    /// keeps the old settings then.
    pub fn reload_speculative(&self, path: &Path) -> Result<SpeculativeConfig, ConfigError> {
        let new = Self::load(path)?.speculative;
        if new.method != self.speculative.method {
            return Err(invalid(
                "speculative.method",
                format!(
                    "changing the method ({} -> {}) needs a restart",
                    self.speculative.method, new.method
                ),
            ));
        }
        Ok(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::from_toml(s, Path::new("t.toml"))
    }

    #[test]
    fn defaults_serve_the_real_pair_and_method_draft_needs_a_path() {
        let c = parse("").unwrap();
        assert!(c.draft.path.is_some());
        let mut c2 = c.clone();
        c2.draft.path = None;
        let e = c2.validate().unwrap_err().to_string();
        assert!(e.contains("draft.path"), "{e}");
        assert_eq!(c.server.port, 8000);
        assert_eq!(
            c.speculative.policy().unwrap(),
            DraftPolicy::BatchTable(vec![(1, 3), (2, 2), (4, 1)])
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let e = parse("[server]\nprot = 1").unwrap_err().to_string();
        assert!(e.contains("prot"), "{e}");
        let e = parse("[speculative]\nmethod = \"magic\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("speculative.method"), "{e}");
        let e = parse(
            "[speculative]\nmethod = \"ngram\"\npolicy = \"table\"\ntable = [[4, 1], [2, 3]]",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("speculative.table"), "{e}");
        let e = parse("[server]\nport = \"x\"").unwrap_err().to_string();
        assert!(e.contains("port"), "{e}");
        let e = parse("[speculative]\nmethod = \"off\"\n[scheduler]\nmax_num_seqs = 0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("scheduler.max_num_seqs"), "{e}");
    }

    #[test]
    fn adaptive_policy_from_toml() {
        let c = parse(
            "[speculative]\nmethod = \"ngram\"\npolicy = \"adaptive\"\nnum_tokens = 6\n[speculative.adaptive]\nalpha = 0.5",
        )
        .unwrap();
        match c.speculative.policy().unwrap() {
            DraftPolicy::Adaptive { max_k, alpha, .. } => assert_eq!((max_k, alpha), (6, 0.5)),
            p => panic!("{p:?}"),
        }
    }
}

#[cfg(test)]
mod shipped {
    use super::*;

    /// The configs in configs/ parse and validate.
    #[test]
    fn shipped_configs_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        for name in ["default.toml", "tiny.toml", "example-all.toml"] {
            Config::load(&dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
}
