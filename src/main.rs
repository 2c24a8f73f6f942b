//! The `specgate` command line: parses arguments and dispatches.

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "specgate",
    version,
    about = "LLM serving gateway built around speculative decoding"
)]
struct Cli {
    /// Log line format on stderr: `text` (human-readable) or `json` (one
    /// object per line). The level comes from RUST_LOG (default `info`).
    #[arg(
        long,
        global = true,
        value_enum,
        env = "SPECGATE_LOG_FORMAT",
        default_value_t = specgate::logging::LogFormat::Text
    )]
    log_format: specgate::logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

// Built once per process from argv: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of one prompt and print it on stdout.
    Generate(specgate::generate::GenerateArgs),
    /// Serve the OpenAI-compatible API.
    Serve(specgate::cli::ServeArgs),
    /// Front several `serve` replicas with the same API (load + prefix affinity).
    Route(specgate::cli::RouteArgs),
}

/// `specgate route`: the router's settings from the file and the flags,
/// then the router until SIGTERM/Ctrl-C.
fn route(args: specgate::cli::RouteArgs) -> anyhow::Result<()> {
    let cfg = args.resolve()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let running = specgate::router::start(cfg).await?;
        tracing::info!(
            addr = %running.addr,
            healthy = running.pool.healthy(),
            replicas = running.pool.urls().len(),
            "specgate router listening on http://{}",
            running.addr
        );
        specgate::server::termination().await;
        tracing::info!("shutting down: draining open streams");
        let _ = running.shutdown.send(());
        let _ = running.done.await;
        Ok(())
    })
}

/// `specgate serve`: the config from the file and the flags, then the
/// server until SIGTERM/Ctrl-C or the engine's death.
fn serve(args: specgate::cli::ServeArgs) -> anyhow::Result<()> {
    let (cfg, file) = args.resolve()?;
    // Under mpirun every rank runs this command: rank 0 serves, the
    // others follow it and end here.
    let (leader, mpi) = match cfg.model.distributed {
        specgate::config::Distributed::None => (None, None),
        specgate::config::Distributed::Mpi => match specgate::distributed::join(&cfg)? {
            specgate::distributed::Part::Lead(comm, session) => (Some(comm), Some(session)),
            specgate::distributed::Part::Done => return Ok(()),
        },
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let running = match rt.block_on(specgate::server::start_with(cfg, file, leader)) {
        Ok(running) => running,
        // Rank 0 that cannot start (its port taken, its shard unreadable, a
        // worker past the load deadline) ends the group now: the workers
        // would wait for its broadcasts, and MPI's finalisation here for
        // them.
        Err(e) => match &mpi {
            Some(session) => specgate::distributed::abort_group(
                session,
                &format!("rank 0 could not start serving: {e:#}"),
            ),
            None => return Err(e),
        },
    };
    let addr = running.addr;
    tracing::info!(%addr, "specgate listening on http://{addr}");
    // `rt` is dropped before `mpi` (declared after it): MPI is finalised
    // (or the failed group aborted) once the server and the engine that
    // holds the communicator are gone.
    rt.block_on(specgate::server::serve_until_exit(
        running,
        specgate::server::termination(),
    ))
}

fn main() -> anyhow::Result<()> {
    // candle works out its thread count on every matmul, reading
    // /proc/cpuinfo each time, unless RAYON_NUM_THREADS is set (a tiny
    // model's step spent most of its time there). Set it once, to rayon's
    // own default (so rayon's pool and the kernels' team keep their size),
    // while this process has only this thread.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    let cli = Cli::parse();
    specgate::logging::init(cli.log_format)?;
    // A panic, like everything else, is one line in the log's format.
    specgate::logging::log_panics();
    let result = match cli.command {
        Command::Generate(args) => specgate::generate::run(&args),
        Command::Serve(args) => serve(args),
        Command::Route(args) => route(args),
    };
    // A fatal error goes through the log too, so a JSON log stays JSON to
    // its last line (returning it would print plain text on stderr).
    if let Err(e) = result {
        tracing::error!(error = %format!("{e:#}"), "exiting on an error");
        std::process::exit(1);
    }
    Ok(())
}
