//! `serve --distributed mpi`: the target's ranks as processes under
//! `mpirun`, on one host or many. Every process runs the same command;
//! this module decides each one's part: rank 0 goes on to serve (HTTP,
//! engine, scheduler and its own shard, broadcasting each step), every
//! other rank loads its own shard and follows rank 0's steps
//! ([`specgate_verify::model::serve_worker`]) until rank 0 stops.
//!
//! A rank that fails before it serves ends the whole job at once with
//! `MPI_Abort` and a line on stderr naming the rank and the cause (a
//! worker that cannot load its shard here, rank 0 that cannot start in
//! `main` through [`abort_group`]): the other ranks may be waiting for it
//! in a collective that would never come, and MPI's finalisation would
//! wait for them in turn. Rank 0's first wait for the workers has a
//! deadline too (`model.load_timeout_secs`), for a worker that hangs in
//! its load instead of failing.
//!
//! A build without the cargo feature `mpi` refuses the mode with an error
//! that says so; the default build needs no MPI library.

use crate::config::Config;
use anyhow::Result;
use specgate_verify::Communicator;

/// What this process does in a distributed serve.
pub enum Part {
    /// Rank 0: serve, leading the group through this communicator. The
    /// session keeps MPI alive: drop it last.
    Lead(Box<dyn Communicator>, Session),
    /// A worker whose loop has ended (rank 0 stopped the group).
    Done,
}

/// MPI's lifetime in this process (see `MpiSession`).
#[cfg(feature = "mpi")]
pub type Session = specgate_verify::tp::MpiSession;
/// MPI's lifetime in this process (none without the `mpi` feature).
#[cfg(not(feature = "mpi"))]
pub type Session = ();

/// Ends the whole group now, from a rank that failed before serving (rank
/// 0's server could not start: its port taken, its shard or tokenizer
/// unreadable): `why` on stderr with the rank, then `MPI_Abort`, so
/// `mpirun` exits non-zero at once instead of every rank waiting for the
/// others.
#[cfg(feature = "mpi")]
pub fn abort_group(session: &Session, why: &str) -> ! {
    session.abort(why)
}

/// Without the `mpi` feature there is no group ([`join`] refuses the
/// mode): this process is all of it, and ends with `why`.
#[cfg(not(feature = "mpi"))]
pub fn abort_group(_session: &Session, why: &str) -> ! {
    eprintln!("specgate: {why}");
    std::process::exit(1)
}

/// Joins the MPI group this process was started in. A worker rank loads
/// its shard of `cfg`'s model and serves rank 0's steps before this
/// returns [`Part::Done`].
///
/// A worker that cannot load its shard does not return: it aborts the
/// job ([`abort_group`]).
///
/// Errors: a build without the `mpi` feature; MPI cannot start; a worker
/// that fails a step (the group is aborted then).
#[cfg(feature = "mpi")]
pub fn join(cfg: &Config) -> Result<Part> {
    use anyhow::Context;
    use specgate_verify::model::{load_model_shard, serve_worker};
    use std::time::Duration;
    let deadline = Duration::from_secs(cfg.model.rank_timeout_secs);
    // Long enough for clients to read their error and a probe to see 503.
    let grace = Duration::from_secs(5);
    let (comm, session) =
        specgate_verify::tp::MpiComm::init(deadline, grace).context("starting MPI")?;
    let comm = comm.with_load_deadline(Duration::from_secs(cfg.model.load_timeout_secs));
    let (rank, world) = (comm.rank(), comm.world_size());
    let pid = std::process::id();
    // Scripts (and tests) find a rank's process in this line.
    tracing::info!(
        rank,
        world,
        pid,
        "rank {rank} of {world} (pid {pid}) joined the MPI group"
    );
    if rank == 0 {
        return Ok(Part::Lead(Box::new(comm), session));
    }
    let path = &cfg.model.path;
    let mut model = match load_model_shard(path, Box::new(comm)) {
        Ok(m) => m,
        // Rank 0 would wait for this rank's first broadcast (up to the load
        // deadline), and this one's MPI finalisation for rank 0.
        Err(e) => abort_group(
            &session,
            &format!("cannot load its shard of {}: {e}", path.display()),
        ),
    };
    tracing::info!(rank, "shard loaded; following rank 0");
    serve_worker(&mut model).with_context(|| format!("rank {rank} of {world}"))?;
    drop(model);
    drop(session);
    tracing::info!(rank, "rank 0 stopped the group");
    Ok(Part::Done)
}

/// Without the `mpi` feature: an error naming the build that has it.
#[cfg(not(feature = "mpi"))]
pub fn join(_cfg: &Config) -> Result<Part> {
    anyhow::bail!(
        "model.distributed = \"mpi\" needs a build with MPI: \
         cargo build --release --features mpi (and Open MPI installed)"
    )
}
