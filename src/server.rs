//! `specgate serve`: loads the models named by the config, starts the
//! engine and the HTTP server, and handles signals: SIGTERM/Ctrl-C drain
//! and exit; SIGHUP (and a change of the config file) re-reads the
//! `[speculative]` section and applies it to the next engine step.

use crate::config::{Config, LatentDtype, SuffixScope};
use crate::engine::scheduler::SchedulerConfig;
use crate::engine::{spawn, EngineConfig, EngineHandle, KvSize, PrefixCaching, SuffixOptions};
use crate::grammar::Grammars;
use crate::http::cors::CorsPolicy;
use crate::http::{serve, AppState, Backend, ConnLimits, HttpSettings};
use crate::tokenizer::TextTokenizer;
use anyhow::{Context, Result};
use specgate_verify::model::{
    load_model_shard, load_model_tp, read_token_list, token_list_vocabulary, vocab_fingerprint,
};
use specgate_verify::{CacheDtype, Model};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

mod speculation;

/// A started server.
pub struct Running {
    pub addr: SocketAddr,
    pub engine: EngineHandle,
    /// Send to begin a graceful shutdown.
    pub shutdown: oneshot::Sender<()>,
    /// Ends when the server has drained.
    pub done: tokio::task::JoinHandle<()>,
    /// How long a server whose engine died keeps answering (/health 503)
    /// before it drains and exits: zero, except for rank 0 of ranks run as
    /// processes, where the job's end is its supervisor's only signal
    /// otherwise, and probes should see why.
    pub linger_on_death: Duration,
}

/// The model name served on /v1/models and expected in requests.
pub fn model_name(cfg: &Config) -> String {
    cfg.server.served_model_name.clone().unwrap_or_else(|| {
        cfg.model
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    })
}

fn tokenizer_for(model: &Path) -> Result<TextTokenizer> {
    crate::generate::load_tokenizer(model)
}

/// The config file a server was started from, for live reloads: its path
/// and its contents as loaded, before command-line overrides (a reload
/// compares the file with what it said, not with the flags).
pub struct ConfigFile {
    pub path: PathBuf,
    pub as_loaded: Config,
}

/// Binds the listener and starts answering (503 while loading), loads the
/// models, starts the engine, and returns once the server is ready.
pub async fn start(cfg: Config, file: Option<ConfigFile>) -> Result<Running> {
    start_with(cfg, file, None).await
}

/// [`start`] as rank 0 of ranks run as processes (`leader`: its end of
/// the group, see `crate::distributed`): the target is this rank's shard,
/// and it leads the other ranks through every step.
pub async fn start_with(
    cfg: Config,
    file: Option<ConfigFile>,
    leader: Option<Box<dyn specgate_verify::Communicator>>,
) -> Result<Running> {
    let distributed = leader.is_some();
    let metrics = crate::metrics::install();
    let s = &cfg.server;
    let settings = HttpSettings {
        model_name: model_name(&cfg),
        api_keys: s.api_keys.clone(),
        max_body_bytes: s.max_body_bytes,
        max_concurrent_requests: s.max_concurrent_requests,
        max_requests_per_client: s.max_requests_per_client,
        max_blocking_jobs: s.max_blocking_jobs,
        max_messages: s.max_messages,
        metrics_auth: s.metrics_auth,
        share_prefix_cache: s.share_prefix_cache,
        request_timeout: Duration::from_secs(s.request_timeout_secs),
        drain_timeout: Duration::from_secs(s.drain_timeout_secs),
        keep_alive: Duration::from_secs(s.keep_alive_secs),
        body_read_timeout: Duration::from_secs(s.body_read_timeout_secs),
        conn: ConnLimits {
            header_read: Duration::from_secs(s.header_read_timeout_secs),
            write_stall: Duration::from_secs(s.stream_write_timeout_secs),
            max_connections: s.max_connections,
            max_per_client: s.max_connections_per_client,
        },
        cors: CorsPolicy::new(&s.cors_allow_origins),
        stored_responses: s.stored_responses_per_key,
        stored_response_bytes: s.stored_responses_mib_per_key << 20,
    };
    // SIGHUP's default action ends the process: take it over before the
    // (long) model load, so a reload signal sent early is only deferred.
    let hangups = hangup_signals();
    let listener = TcpListener::bind((s.host.as_str(), s.port))
        .await
        .with_context(|| format!("binding {}:{}", s.host, s.port))?;
    let addr = listener.local_addr()?;
    // The message keeps the address readable in a text log: scripts and
    // tests find it there (`specgate bound to http://ADDR`).
    tracing::info!(
        %addr,
        "specgate bound to http://{addr} (loading; /health answers 503 until ready)"
    );
    // After the address line: a script reading the log for the first
    // `http://` must not find a URL from the config instead.
    log_config(&cfg);
    let state = AppState::new(settings, metrics);
    let (tx, rx) = oneshot::channel::<()>();
    let serving = state.clone();
    let done = tokio::spawn(async move {
        serve(listener, serving, async {
            let _ = rx.await;
        })
        .await;
    });
    let load_cfg = cfg.clone();
    let (engine, tokenizer, grammars) =
        tokio::task::spawn_blocking(move || load(&load_cfg, leader))
            .await
            .context("the model loader panicked")??;
    state.set_ready(Backend {
        engine: engine.clone(),
        tokenizer,
        grammars,
    });
    match file {
        Some(ConfigFile { path, as_loaded }) => {
            let in_force = cfg.speculative.clone();
            tokio::spawn(watch_config(
                as_loaded,
                in_force,
                path,
                engine.clone(),
                hangups,
            ));
        }
        None => {
            // No file to reload; SIGHUP only re-measures the cost model.
            let engine = engine.clone();
            tokio::spawn(async move {
                let mut hangups = hangups;
                loop {
                    next_hangup(&mut hangups).await;
                    tracing::info!(
                        "SIGHUP: no config file to reload (started without --config); \
                                    re-measuring the cost model"
                    );
                    if let Err(e) = engine.recalibrate() {
                        tracing::warn!(error = %e, "SIGHUP: cannot re-measure the cost model");
                    }
                }
            });
        }
    }
    Ok(Running {
        linger_on_death: if distributed {
            Duration::from_secs(3)
        } else {
            Duration::ZERO
        },
        addr,
        engine,
        shutdown: tx,
        done,
    })
}

/// Logs the configuration in force (after flags), API keys masked: a log
/// is read by more people than may hold a key.
fn log_config(cfg: &Config) {
    let mut shown = cfg.clone();
    for k in &mut shown.server.api_keys {
        *k = "<redacted>".into();
    }
    tracing::info!(config = ?shown, "effective configuration");
}

/// This process's resident and peak resident memory in MiB (`VmRSS`,
/// `VmHWM` of /proc/self/status; 0 where the system has no such file).
fn memory_mib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb / 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Applies `kv.latent_dtype` (`--kv-latent-dtype`) to `model`: `auto`
/// keeps the model's own choice ([`Model::latent_cache`]).
///
/// Errors: an explicit dtype for a model without latent attention, or
/// bf16 for a family that does not implement it.
pub(crate) fn apply_latent_dtype(model: &mut Model, dtype: LatentDtype) -> Result<()> {
    let d = match dtype {
        LatentDtype::Auto => return Ok(()),
        LatentDtype::F32 => CacheDtype::F32,
        LatentDtype::Bf16 => CacheDtype::Bf16,
    };
    model
        .set_latent_cache(d)
        .with_context(|| format!("kv.latent_dtype = \"{dtype}\""))
}

/// Loads the target, the draft and the tokenizer, builds the grammar
/// engine (`None`, with a warning, when the tokenizer does not allow one:
/// structured output is then refused per request), and starts the engine.
fn load(
    cfg: &Config,
    leader: Option<Box<dyn specgate_verify::Communicator>>,
) -> Result<(EngineHandle, Arc<TextTokenizer>, Option<Grammars>)> {
    tracing::info!(model = %cfg.model.path.display(), "loading the target model");
    let started = std::time::Instant::now();
    let mut target = match leader {
        // Rank 0 of ranks run as processes: its own shard only.
        Some(comm) => {
            let mut m = load_model_shard(&cfg.model.path, comm).with_context(|| {
                format!("loading rank 0's shard of {}", cfg.model.path.display())
            })?;
            m.lead()?;
            m
        }
        None => load_model_tp(&cfg.model.path, cfg.model.tensor_parallel_size)
            .with_context(|| format!("loading model {}", cfg.model.path.display()))?,
    };
    let load_secs = started.elapsed().as_secs_f64();
    apply_latent_dtype(&mut target, cfg.kv.latent_dtype)?;
    let (rss, peak) = memory_mib();
    target.warm_up()?;
    let kernels = specgate_verify::kernels::backend();
    tracing::info!(
        model = %cfg.model.path.display(),
        load_secs = format!("{load_secs:.2}"),
        rss_mib = rss,
        peak_rss_mib = peak,
        served_model_name = %model_name(cfg),
        tensor_parallel_size = cfg.model.tensor_parallel_size,
        kernels = ?kernels,
        kernels_isa = specgate_verify::kernels::Isa::current().name(),
        amx = %specgate_verify::kernels::amx_status(),
        latent_cache = target.latent_cache().map_or("none", |d| d.name()),
        "target model loaded"
    );
    let mut tokenizer = tokenizer_for(&cfg.model.path)?;
    if let Some(file) = &cfg.model.chat_template {
        let source = std::fs::read_to_string(file)
            .with_context(|| format!("reading model.chat_template {}", file.display()))?;
        tokenizer = tokenizer
            .with_chat_template(source)
            .with_context(|| format!("model.chat_template {}", file.display()))?;
    }
    let tokenizer = Arc::new(tokenizer);
    let grammars = match Grammars::from_shared(tokenizer.clone(), target.config().vocab_size) {
        Ok(g) => Some(g.with_jump_forward(cfg.speculative.jump_forward)),
        Err(e) => {
            tracing::warn!(error = %e, "no grammar engine: response_format and forced tool calls are refused");
            None
        }
    };
    let sp = &cfg.speculative;
    // The one place the config's method becomes the engine's proposer.
    let choice = speculation::choose(cfg, &target, &tokenizer)?;
    tracing::info!(
        model = %cfg.model.path.display(),
        method = %choice.method,
        reason = %choice.reason,
        "speculative method in force: {}",
        choice.method
    );
    let proposer = choice.proposer;
    let kv = if cfg.kv.num_blocks > 0 {
        KvSize::Blocks(cfg.kv.num_blocks)
    } else {
        KvSize::MemoryBytes(cfg.kv.memory_mib << 20)
    };
    let engine_cfg = EngineConfig {
        kv,
        block_size: cfg.kv.block_size,
        scheduler: SchedulerConfig {
            max_num_seqs: cfg.scheduler.max_num_seqs,
            max_num_batched_tokens: cfg.scheduler.max_num_batched_tokens,
        },
        policy: sp.policy()?,
        suffix: sp.suffix.enabled.then(|| SuffixOptions {
            pool: sp.suffix.pool_config(),
            global: sp.suffix.scope == SuffixScope::Global,
        }),
        tree_branches: sp.tree_branches,
        prefix: PrefixCaching {
            enabled: cfg.kv.prefix_caching,
            checkpoint_bytes: cfg.kv.state_checkpoint_mib << 20,
        },
        row_state_bytes: cfg.kv.row_state_mib << 20,
    };
    let (engine, _join) = spawn(target, proposer, Some(tokenizer.clone()), engine_cfg)?;
    let stats = engine.stats();
    let kv_bytes = stats.kv_bytes;
    tracing::info!(
        kv_blocks = stats.num_blocks,
        kv_block_size = cfg.kv.block_size,
        kv_bytes,
        kv_mib = kv_bytes as f64 / (1u64 << 20) as f64,
        "KV pool allocated"
    );
    let engine = match cfg.model.max_model_len {
        Some(n) => engine
            .with_max_model_len(n)
            .context("model.max_model_len")?,
        None => engine,
    };
    let engine = engine.with_max_prompt_logprobs(cfg.scheduler.max_echo_prompt_tokens);
    if engine.pool_below_context() {
        tracing::warn!(
            context = engine.max_position(),
            kv_tokens = engine.kv_slots(),
            max_request_tokens = engine.max_request_tokens(),
            "the KV pool holds less than one full context: one request may hold at most \
             max_request_tokens tokens (raise kv.memory_mib or kv.num_blocks, or lower \
             model.max_model_len)"
        );
    }
    Ok((engine, tokenizer, grammars))
}

/// Where `draft.head_tokens = "auto"` looks for token lists.
pub const HEAD_LISTS_DIR: &str = "configs";

/// The reduced output head for the draft at `draft`, as `[draft]
/// head_tokens` says: unset or `"off"`, none; `"auto"` (the default), the
/// first list `configs/draft-head-*.txt` (of the working directory) made
/// for the draft's vocabulary (its `# vocabulary:` line equals the draft
/// file's [`vocab_fingerprint`]), else none; a path, that list.
///
/// Errors: a list that cannot be read, or a named list made for another
/// vocabulary (its ids would point at other tokens: still lossless, but a
/// useless draft).
pub fn draft_head(setting: Option<&Path>, draft: &Path) -> Result<Option<(PathBuf, Vec<u32>)>> {
    let Some(setting) = setting.filter(|s| s.as_os_str() != "off") else {
        return Ok(None);
    };
    let vocab = vocab_fingerprint(draft)
        .with_context(|| format!("reading the vocabulary of {}", draft.display()))?;
    if setting.as_os_str() == "auto" {
        let Some(vocab) = vocab else {
            return Ok(None);
        };
        let mut lists: Vec<PathBuf> = std::fs::read_dir(HEAD_LISTS_DIR)
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        lists.retain(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("draft-head-") && n.ends_with(".txt"))
        });
        lists.sort();
        for list in lists {
            if token_list_vocabulary(&list)?.as_deref() == Some(vocab.as_str()) {
                let ids = read_token_list(&list)?;
                return Ok(Some((list, ids)));
            }
        }
        tracing::info!(draft = %draft.display(), "no reduced-head list for the draft's vocabulary: full head");
        return Ok(None);
    }
    if let (Some(made_for), Some(vocab)) = (token_list_vocabulary(setting)?, vocab) {
        if made_for != vocab {
            anyhow::bail!(
                "draft.head_tokens {} was made for the vocabulary {made_for}, but the draft {} has {vocab}",
                setting.display(),
                draft.display()
            );
        }
    }
    let ids = read_token_list(setting)?;
    Ok(Some((setting.to_path_buf(), ids)))
}

/// SIGHUP, where the platform has it (`None` elsewhere or if the handler
/// cannot be installed).
#[cfg(unix)]
type Hangups = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangups = Option<()>;

fn hangup_signals() -> Hangups {
    #[cfg(unix)]
    {
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok()
    }
    #[cfg(not(unix))]
    None
}

/// The next SIGHUP (never, without a handler).
async fn next_hangup(h: &mut Hangups) {
    #[cfg(unix)]
    if let Some(h) = h.as_mut() {
        h.recv().await;
        return;
    }
    let _ = h;
    std::future::pending::<()>().await
}

/// Re-applies `[speculative]` on SIGHUP and when the file's modification
/// time or contents change (checked every 2 s; see [`FileStamp`]). `file` is the file as last accepted,
/// `in_force` the `[speculative]` running now. An edit that does not parse
/// whole, changes another section or looks truncated is refused and
/// logged; the settings in force stay. An accepted one logs what changed.
async fn watch_config(
    mut file: Config,
    mut in_force: crate::config::SpeculativeConfig,
    path: PathBuf,
    engine: EngineHandle,
    mut hup: Hangups,
) {
    let mut seen = FileStamp::of(&path);
    loop {
        tokio::select! {
            _ = next_hangup(&mut hup) => {
                // SIGHUP also asks for the cost model to be measured
                // again (after a hardware or load change).
                if let Err(e) = engine.recalibrate() {
                    tracing::warn!(error = %e, "SIGHUP: cannot re-measure the cost model");
                }
            }
            _ = tokio::time::sleep(Duration::from_secs(2)) => {
                let now = FileStamp::of(&path);
                if now == seen {
                    continue;
                }
                seen = now;
            }
        }
        match file.reload(&path, &in_force) {
            Ok(r) => match engine.set_policy(r.policy.clone()) {
                Ok(()) => {
                    tracing::info!(
                        file = %path.display(),
                        changes = %r.summary(),
                        "reloaded [speculative]"
                    );
                    in_force = r.speculative;
                    file = r.file;
                }
                Err(e) => tracing::warn!(
                    file = %path.display(),
                    error = %e,
                    "refused the [speculative] edit"
                ),
            },
            Err(e) => tracing::warn!(
                file = %path.display(),
                error = %e,
                "refused the config edit; keeping the settings in force"
            ),
        }
    }
}

/// What the config watcher last saw of the file: its modification time
/// and a hash of its contents (`None` for what could not be read). The
/// contents count because a file written in two parts within one tick of
/// the file system's clock keeps the first part's time: an edit read half
/// written (and refused as cut short) must be read again when the rest
/// lands.
#[derive(Debug, PartialEq, Eq)]
struct FileStamp {
    modified: Option<std::time::SystemTime>,
    contents: Option<u64>,
}

impl FileStamp {
    fn of(path: &Path) -> Self {
        use std::hash::{Hash, Hasher};
        let contents = std::fs::read(path).ok().map(|bytes| {
            // Fixed keys: the same bytes always hash the same.
            let mut h = std::collections::hash_map::DefaultHasher::new();
            bytes.hash(&mut h);
            h.finish()
        });
        Self {
            modified: std::fs::metadata(path).and_then(|m| m.modified()).ok(),
            contents,
        }
    }
}

/// Serves until SIGTERM/Ctrl-C (then drains: `Ok`) or until the engine
/// thread dies (then drains what it can and returns an error, so the
/// process exits non-zero and a supervisor restarts it).
///
/// Errors: the engine died.
pub async fn serve_until_exit(
    running: Running,
    stop: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let died = tokio::select! {
        _ = stop => false,
        _ = running.engine.died() => true,
    };
    if died {
        tracing::error!("the engine died: shutting down so the process can be restarted");
        tokio::time::sleep(running.linger_on_death).await;
    } else {
        tracing::info!("shutting down: draining in-flight requests");
    }
    let _ = running.shutdown.send(());
    let _ = running.done.await;
    running.engine.shutdown();
    if died {
        anyhow::bail!("the engine thread died (see the error above)");
    }
    Ok(())
}

/// Waits for SIGTERM or Ctrl-C.
pub async fn termination() {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}
