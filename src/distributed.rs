//! `serve --distributed mpi`: the target's ranks as processes under
//! `mpirun`, on one host or many. Every process runs the same command;
//! this module decides each one's part: rank 0 goes on to serve (HTTP,
//! engine, scheduler and its own shard, broadcasting each step), every
//! other rank loads its own shard and follows rank 0's steps
//! ([`specgate_verify::model::serve_worker`]) until rank 0 stops.
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

/// Joins the MPI group this process was started in. A worker rank loads
/// its shard of `cfg`'s model and serves rank 0's steps before this
/// returns [`Part::Done`].
///
/// Errors: a build without the `mpi` feature; MPI cannot start; a worker
/// that cannot load its shard or fails a step (the group is aborted then).
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
    let mut model = load_model_shard(path, Box::new(comm))
        .with_context(|| format!("rank {rank}: loading its shard of {}", path.display()))?;
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
