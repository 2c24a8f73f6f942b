//! The `specgate` command line: parses arguments and dispatches.

use anyhow::Context;
use clap::{Parser, Subcommand};
use specgate::config::Config;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "specgate",
    version,
    about = "LLM serving gateway built around speculative decoding"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of one prompt and print it on stdout.
    Generate(specgate::generate::GenerateArgs),
    /// Serve the OpenAI-compatible API.
    Serve(ServeArgs),
    /// Front several `serve` replicas with the same API (load + prefix affinity).
    Route(RouteArgs),
}

/// `specgate route`: flags override the config file's `[router]`.
#[derive(clap::Args)]
struct RouteArgs {
    /// TOML config; only its `[router]` section is used.
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    host: Option<String>,
    #[arg(long)]
    port: Option<u16>,
    /// A replica base URL such as http://10.0.0.7:8000 (repeatable; replaces
    /// [router] replicas).
    #[arg(long = "replica")]
    replicas: Vec<String>,
    /// Discover replicas from a DNS name, `name:port` (e.g. a headless Service).
    #[arg(long)]
    discovery_dns: Option<String>,
}

fn route(args: RouteArgs) -> anyhow::Result<()> {
    let mut cfg = match &args.config {
        Some(p) => Config::load(p)?.router,
        None => Default::default(),
    };
    if let Some(h) = args.host {
        cfg.host = h;
    }
    if let Some(p) = args.port {
        cfg.port = p;
    }
    if !args.replicas.is_empty() {
        cfg.replicas = args.replicas;
    }
    if let Some(d) = args.discovery_dns {
        cfg.discovery_dns = Some(d);
    }
    cfg.validate_for_routing()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let running = specgate::router::start(cfg).await?;
        eprintln!(
            "specgate router listening on http://{} ({} of {} replicas healthy)",
            running.addr,
            running.pool.healthy(),
            running.pool.urls().len()
        );
        specgate::server::termination().await;
        eprintln!("shutting down: draining open streams");
        let _ = running.shutdown.send(());
        let _ = running.done.await;
        Ok(())
    })
}

/// `specgate serve`: flags override the config file.
#[derive(clap::Args)]
struct ServeArgs {
    /// TOML config (default: built-in defaults, i.e. configs/default.toml's values).
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    host: Option<String>,
    #[arg(long)]
    port: Option<u16>,
    /// Target model file (overrides [model] path).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Draft model file (overrides [draft] path).
    #[arg(long)]
    draft: Option<PathBuf>,
    /// "draft", "ngram" or "off" (overrides [speculative] method).
    #[arg(long)]
    speculative_method: Option<String>,
    /// An accepted API key (repeatable; overrides [server] api_keys).
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let file = match &args.config {
        Some(p) => Some(specgate::server::ConfigFile {
            path: p.clone(),
            as_loaded: Config::load(p)?,
        }),
        None => None,
    };
    let mut cfg = file
        .as_ref()
        .map_or_else(Config::default, |f| f.as_loaded.clone());
    if let Some(h) = args.host {
        cfg.server.host = h;
    }
    if let Some(p) = args.port {
        cfg.server.port = p;
    }
    if let Some(m) = args.model {
        cfg.model.path = m;
    }
    if let Some(d) = args.draft {
        cfg.draft.path = Some(d);
    }
    if let Some(m) = args.speculative_method {
        cfg.speculative.method = m;
    }
    if !args.api_keys.is_empty() {
        cfg.server.api_keys = args.api_keys;
    }
    cfg.validate()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let running = specgate::server::start(cfg, file).await?;
        eprintln!("specgate listening on http://{}", running.addr);
        specgate::server::serve_until_exit(running, specgate::server::termination()).await
    })
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Generate(args) => specgate::generate::run(&args),
        Command::Serve(args) => serve(args),
        Command::Route(args) => route(args),
    }
}
