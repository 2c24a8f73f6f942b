//! [`MpiComm`]: the ranks of one model as processes started by `mpirun`, on
//! one host or many; Open MPI does the transport (shared memory inside a
//! host, TCP or RDMA between hosts) and the collective algorithms.
//!
//! Every collective is a non-blocking MPI call polled to completion against
//! a deadline, so a rank that hangs or dies turns into an error on the
//! ranks that wait for it instead of a hang. MPI cannot cancel a
//! collective in flight, so after a miss the group is failed for good:
//! its buffers are leaked (MPI may still write them), later collectives
//! fail at once, and the whole job is brought down with `MPI_Abort` after
//! a grace period in which rank 0 answers `/health` with 503 and ends its
//! requests with an error. A worker that fails (its forward errs, or it
//! misses a deadline) sends rank 0 a failure notice, a point-to-point
//! message that rank 0 looks for while it waits in a collective and when
//! asked for the group's health, so rank 0 fails its requests with the
//! worker's reason and answers 503 before the job ends; the worker aborts
//! the job itself only if rank 0 has not within the grace and 10 s more.
//! A worker killed outright cannot send one: `mpirun` ends the job then.
//!
//! Before serving: every rank joins one barrier once its shard is loaded
//! ([`Communicator::all_loaded`]); rank 0's wait there has its own
//! deadline, the load deadline ([`MpiComm::with_load_deadline`]). (A
//! broadcast cannot serve: its root may complete it as soon as the data is
//! buffered, before any worker has loaded.) A rank that fails before it
//! serves ends the job at once ([`MpiSession::abort`]).
//!
//! Lengths from other ranks (a broadcast's length, the counts of an uneven
//! all-gather, a failure notice's size) are checked before anything is
//! allocated or handed to MPI: a length out of bounds fails the group.
//!
//! Threads: MPI is initialised as `MPI_THREAD_SERIALIZED` (calls from any
//! thread, never two at once); one mutex serialises every call.

use super::{CommStats, Communicator, Tally};
use crate::error::{Result, VerifyError};
use mpi::ffi;
use std::os::raw::{c_int, c_void};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// One process's end of the `MPI_COMM_WORLD` group.
///
/// Invariant: MPI is initialised for as long as this value lives (its
/// [`MpiSession`] finalises MPI only after it is dropped). Dropping it
/// when the group failed aborts the job. At most one exists per process.
pub struct MpiComm {
    rank: usize,
    world: usize,
    /// Longest a collective may wait for the other ranks.
    deadline: Duration,
    /// Longest rank 0 waits for the other ranks to load their shards
    /// ([`Communicator::all_loaded`]).
    load_deadline: Duration,
    /// How long a failed rank 0 keeps serving (503) before it aborts the
    /// job.
    grace: Duration,
    /// Serialises MPI calls; holds the failure once the group failed.
    state: Mutex<State>,
    /// Set when this comm is dropped: MPI may be finalised.
    released: Arc<Released>,
    tally: Tally,
}

/// Above this many bytes received per rank by the gathering all-reduce,
/// a group of 3 or more ranks reduces scattered chunks instead: the
/// gather moves `world - 1` contributions into every rank, the scatter
/// and gather `2 (world - 1) / world` of one, at the price of a second
/// collective's latency. 1 MiB is about 80 us at 100 Gb/s, a few
/// collective latencies between hosts: below it the gather's one latency
/// wins. At 2 ranks both move the same bytes and the gather always wins.
/// (BENCHMARKS.md, "Kimi K3 across processes".)
const GATHER_ALL_REDUCE_MAX: usize = 1 << 20;

/// `out = parts[0] + parts[1] + ...`, element-wise in rank order (the
/// order of [`super::ThreadComm`], so both give the same bits); `parts`
/// holds `out.len()` values per rank, rank by rank.
fn sum_in_rank_order(out: &mut [f32], parts: &[f32]) {
    let n = out.len();
    out.copy_from_slice(&parts[..n]);
    for part in parts.chunks_exact(n).skip(1) {
        out.iter_mut().zip(part).for_each(|(o, p)| *o += p);
    }
}

/// Whether the comm was dropped, and whether its group had failed then.
#[derive(Default)]
struct Released {
    done: Mutex<(bool, bool)>,
    cv: Condvar,
}

/// MPI's lifetime in this process: made with the [`MpiComm`] by
/// [`MpiComm::init`] and kept by the thread that called it (MPI wants to
/// be finalised there). Dropping it waits (up to a minute) until the comm
/// is dropped, e.g. with the model that holds it on an engine thread,
/// then finalises MPI (a process that exits without finalising is a
/// failure to `mpirun`), or aborts the job when the group had failed
/// (finalising with collectives in flight would hang).
pub struct MpiSession {
    universe: Option<mpi::environment::Universe>,
    released: Arc<Released>,
    rank: usize,
    world: usize,
}

impl MpiSession {
    /// Ends the whole job now (every rank, `mpirun` exits non-zero), for a
    /// rank that failed before it could serve (a worker that cannot load
    /// its shard, a rank 0 that cannot bind its port): the other ranks may
    /// be waiting for it in a collective that would never start, and MPI's
    /// finalisation would wait for them. `why` goes to stderr first, with
    /// this rank's number.
    pub fn abort(&self, why: &str) -> ! {
        eprintln!(
            "specgate: MPI rank {} of {} failed before serving: {why}; aborting the job",
            self.rank, self.world
        );
        // SAFETY: MPI is initialised for as long as the session lives (its
        // universe is finalised only when it is dropped); MPI_Abort does
        // not return.
        unsafe {
            ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1);
        }
        std::process::exit(1)
    }
}

impl Drop for MpiSession {
    fn drop(&mut self) {
        let mut done = self.released.done.lock().unwrap_or_else(|e| e.into_inner());
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done.0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                eprintln!("specgate: the MPI communicator is still in use at exit");
                break;
            }
            done = self
                .released
                .cv
                .wait_timeout(done, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let failed = done.1;
        drop(done);
        if failed {
            // SAFETY: MPI is initialised; MPI_Abort does not return.
            unsafe {
                ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1);
            }
        }
        // Finalises MPI.
        self.universe.take();
    }
}

#[derive(Default)]
struct State {
    failed: Option<String>,
}

/// The tag of a worker's failure notice to rank 0 (collectives do not
/// match point-to-point messages, so any tag would do; this one is ours).
const NOTICE_TAG: c_int = 0x5eca;

/// Rank 0's wait for the other ranks to load their shards when nobody set
/// one ([`MpiComm::with_load_deadline`]): an hour, the time a full K3
/// shard takes from a slow shared volume.
const DEFAULT_LOAD_DEADLINE: Duration = Duration::from_secs(3600);

/// The largest broadcast message: a step message is a few MB at most (its
/// tokens and block tables); above this a length is taken for corruption,
/// never allocated. Below `c_int::MAX`, so it is always an MPI count.
const MAX_BROADCAST_BYTES: usize = 1 << 30;

/// The largest failure notice a worker sends (longer reasons are cut) and
/// rank 0 receives.
const MAX_NOTICE_BYTES: usize = 64 << 10;

/// Checks a broadcast's length (rank 0's own, or the one it sent): at
/// most [`MAX_BROADCAST_BYTES`].
///
/// Errors: a longer message, as [`VerifyError::BadBatch`].
fn message_len(n: u64) -> Result<usize> {
    usize::try_from(n)
        .ok()
        .filter(|&n| n <= MAX_BROADCAST_BYTES)
        .ok_or_else(|| {
            VerifyError::BadBatch(format!(
                "a broadcast of {n} bytes (at most {MAX_BROADCAST_BYTES})"
            ))
        })
}

/// The displacements and total of an uneven all-gather, from every rank's
/// count as gathered (`counts[rank]` must be `mine`, this rank's own).
///
/// Errors: a negative count, this rank's count not echoed back, or a
/// total past an MPI count (2^31 values).
fn gather_layout(counts: &[c_int], rank: usize, mine: c_int) -> Result<(Vec<c_int>, usize)> {
    let bad = |why: String| VerifyError::RankFailed(format!("all-gather lengths: {why}"));
    if counts.get(rank) != Some(&mine) {
        return Err(bad(format!(
            "rank {rank} sent {mine} values, the gathered counts say {:?}",
            counts.get(rank)
        )));
    }
    let mut displs = Vec::with_capacity(counts.len());
    let mut total: c_int = 0;
    for (r, &c) in counts.iter().enumerate() {
        if c < 0 {
            return Err(bad(format!("rank {r} sent a count of {c}")));
        }
        displs.push(total);
        total = total
            .checked_add(c)
            .ok_or_else(|| bad(format!("{counts:?} values in all exceed an MPI count")))?;
    }
    Ok((displs, total as usize))
}

/// The size of a probed failure notice, when it is one rank 0 accepts
/// (0..=[`MAX_NOTICE_BYTES`]; MPI reports an undefined count as negative).
fn notice_len(n: c_int) -> Option<usize> {
    usize::try_from(n).ok().filter(|&n| n <= MAX_NOTICE_BYTES)
}

// SAFETY: MPI is initialised with at least MPI_THREAD_SERIALIZED and every
// MPI call goes through `state`'s mutex, so no two threads call MPI at
// once; the universe holds no thread-affine data.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

impl MpiComm {
    /// Initialises MPI (the process must have been started by `mpirun`, or
    /// be a lone rank of world size 1) and returns this process's rank of
    /// `MPI_COMM_WORLD`. `deadline` bounds every collective's wait for the
    /// other ranks (a step's compute included): set it above the slowest
    /// forward; `grace` is how long a failed rank 0 keeps answering before
    /// it aborts the job.
    ///
    /// Rank 0's wait for the other ranks to load their shards is an hour
    /// until [`MpiComm::with_load_deadline`] sets another.
    ///
    /// Errors: MPI initialised already, or a library without
    /// `MPI_THREAD_SERIALIZED`.
    pub fn init(deadline: Duration, grace: Duration) -> Result<(MpiComm, MpiSession)> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| {
                VerifyError::BadConfig("MPI is initialised already in this process".into())
            })?;
        if threading < mpi::Threading::Serialized {
            return Err(VerifyError::BadConfig(format!(
                "the MPI library offers {threading:?} threading; MPI_THREAD_SERIALIZED is needed"
            )));
        }
        let (mut rank, mut world) = (0, 0);
        // SAFETY: MPI is initialised; the out-pointers are valid ints.
        unsafe {
            ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank);
            ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut world);
        }
        let released = Arc::new(Released::default());
        let comm = MpiComm {
            rank: rank as usize,
            world: world as usize,
            deadline,
            load_deadline: DEFAULT_LOAD_DEADLINE,
            grace,
            state: Mutex::new(State::default()),
            released: released.clone(),
            tally: Tally::default(),
        };
        let session = MpiSession {
            universe: Some(universe),
            released,
            rank: rank as usize,
            world: world as usize,
        };
        Ok((comm, session))
    }

    /// Sets how long rank 0, its own shard loaded, waits for the other
    /// ranks to load theirs ([`Communicator::all_loaded`]); a miss fails
    /// the group, so a worker that hangs while loading ends the job
    /// instead of holding rank 0 for ever. Workers wait for rank 0 without
    /// a bound.
    pub fn with_load_deadline(mut self, load_deadline: Duration) -> Self {
        self.load_deadline = load_deadline;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the whole job now with a non-zero status (every rank).
    fn abort_job(&self) -> ! {
        // SAFETY: MPI is initialised; MPI_Abort does not return.
        unsafe {
            ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1);
        }
        std::process::exit(1)
    }

    /// Marks the group failed for `why`. A worker tells rank 0 why, then
    /// waits for rank 0 to end the job (aborting it itself after the
    /// grace and 10 s more, should rank 0 not look); rank 0 keeps running
    /// for the grace period (so its server answers 503 and ends its
    /// requests with an error), then aborts the job.
    fn fail(&self, st: &mut State, why: String) -> VerifyError {
        if st.failed.is_none() {
            eprintln!("specgate: MPI rank {} of {}: {why}", self.rank, self.world);
            st.failed = Some(why.clone());
            if self.rank != 0 {
                self.notify_lead(&why);
                // Rank 0 hears it within a poll when it waits in this
                // step's collectives, or at its next /health probe; a rank
                // 0 that hangs itself must not hold the job up for long.
                std::thread::sleep(self.grace + Duration::from_secs(10));
                eprintln!("specgate: rank 0 did not end the job; aborting it");
                self.abort_job();
            }
            let grace = self.grace;
            std::thread::spawn(move || {
                std::thread::sleep(grace);
                eprintln!("specgate: the MPI group failed; aborting the job");
                // SAFETY: MPI is initialised (the comm lives as long as the
                // process serves); no other MPI call is made once the
                // group failed, so this one does not race another.
                unsafe {
                    ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1);
                }
            });
        }
        VerifyError::RankFailed(why)
    }

    /// A worker's failure notice to rank 0: `why`, sent without waiting
    /// for rank 0 to receive it (a small message is buffered), given up
    /// after a second.
    fn notify_lead(&self, why: &str) {
        let mut msg = format!("rank {} failed: {why}", self.rank).into_bytes();
        // Rank 0 refuses longer notices (lossy UTF-8 on its side).
        msg.truncate(MAX_NOTICE_BYTES);
        let Ok(n) = c_int::try_from(msg.len()) else {
            return;
        };
        // SAFETY: the request handle is written by MPI_Isend before use.
        let mut req: ffi::MPI_Request = unsafe { std::mem::zeroed() };
        // SAFETY: `msg` lives until the request completes or is leaked.
        let rc = unsafe {
            ffi::MPI_Isend(
                msg.as_ptr() as *const c_void,
                n,
                ffi::RSMPI_UINT8_T,
                0,
                NOTICE_TAG,
                ffi::RSMPI_COMM_WORLD,
                &mut req,
            )
        };
        let start = Instant::now();
        while rc == 0 && start.elapsed() < Duration::from_secs(1) {
            let mut done: c_int = 0;
            // SAFETY: `req` is a live request of this process.
            unsafe { ffi::MPI_Test(&mut req, &mut done, ffi::RSMPI_STATUS_IGNORE) };
            if done != 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // Not sent yet: MPI may still read the message.
        std::mem::forget(msg);
    }

    /// Rank 0: a worker's failure notice, when one has arrived.
    fn take_notice(&self) -> Option<String> {
        if self.rank != 0 {
            return None;
        }
        let mut flag: c_int = 0;
        // SAFETY: plain out-parameters; MPI is initialised.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        unsafe {
            ffi::MPI_Iprobe(
                ffi::RSMPI_ANY_SOURCE,
                NOTICE_TAG,
                ffi::RSMPI_COMM_WORLD,
                &mut flag,
                &mut status,
            )
        };
        if flag == 0 {
            return None;
        }
        let mut n: c_int = 0;
        // SAFETY: `status` describes the probed message; `buf` holds its
        // `n` bytes.
        unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut n) };
        let Some(len) = notice_len(n) else {
            // Left unreceived: the group fails on this notice anyway.
            return Some(format!(
                "rank {} sent a failure notice of {n} bytes (at most {MAX_NOTICE_BYTES})",
                status.MPI_SOURCE
            ));
        };
        let mut buf = vec![0u8; len];
        unsafe {
            ffi::MPI_Recv(
                buf.as_mut_ptr() as *mut c_void,
                n,
                ffi::RSMPI_UINT8_T,
                status.MPI_SOURCE,
                NOTICE_TAG,
                ffi::RSMPI_COMM_WORLD,
                ffi::RSMPI_STATUS_IGNORE,
            )
        };
        Some(String::from_utf8_lossy(&buf).into_owned())
    }

    /// Polls `req` until it completes. `deadline`: `None` waits without a
    /// bound (a worker idle between steps). A miss fails the group.
    fn wait(
        &self,
        st: &mut State,
        mut req: ffi::MPI_Request,
        deadline: Option<Duration>,
        what: &str,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            let mut done: c_int = 0;
            // SAFETY: `req` is a live request of this process.
            let rc = unsafe { ffi::MPI_Test(&mut req, &mut done, ffi::RSMPI_STATUS_IGNORE) };
            if rc != 0 {
                return Err(self.fail(st, format!("{what} failed with MPI error {rc}")));
            }
            if done != 0 {
                return Ok(());
            }
            if let Some(why) = self.take_notice() {
                return Err(self.fail(st, why));
            }
            let waited = start.elapsed();
            if deadline.is_some_and(|d| waited > d) {
                return Err(self.fail(
                    st,
                    format!(
                        "{what}: another rank did not answer within {:.1} s (dead or hung)",
                        waited.as_secs_f64()
                    ),
                ));
            }
            // MPI progresses a non-blocking collective only inside MPI
            // calls: a collective inside a forward (bounded) is polled
            // without sleeping for as long as another rank's share of a
            // step may take (a sleep between polls stretched a 4 MB
            // all-reduce 3x), while this rank's team has nothing to do; a
            // wait that lasts past that, or an idle worker's unbounded
            // wait for the next step, sleeps, so it costs no core.
            let spin = if deadline.is_some() {
                Duration::from_millis(200)
            } else {
                Duration::from_millis(2)
            };
            if waited < spin {
                std::thread::yield_now();
            } else if waited < Duration::from_millis(50) {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::sleep(Duration::from_micros(500));
            }
        }
    }

    /// Runs one non-blocking collective started by `start` over `keep`
    /// (buffers it reads and writes), polled against `deadline`. On a miss
    /// the buffers are leaked: MPI may still write them.
    fn collective<K>(
        &self,
        keep: K,
        deadline: Option<Duration>,
        what: &str,
        start: impl FnOnce(&K, *mut ffi::MPI_Request) -> c_int,
    ) -> Result<K> {
        let mut st = self.lock();
        if let Some(why) = &st.failed {
            return Err(VerifyError::RankFailed(why.clone()));
        }
        // SAFETY: the request handle is written by `start` before use.
        let mut req: ffi::MPI_Request = unsafe { std::mem::zeroed() };
        let rc = start(&keep, &mut req);
        if rc != 0 {
            std::mem::forget(keep);
            return Err(self.fail(&mut st, format!("{what} failed to start: MPI error {rc}")));
        }
        match self.wait(&mut st, req, deadline, what) {
            Ok(()) => Ok(keep),
            Err(e) => {
                std::mem::forget(keep);
                Err(e)
            }
        }
    }

    /// Broadcasts rank 0's `buf` with the given deadline for its data (the
    /// length travels first, waited for with `len_deadline`; `len_what`
    /// names that wait in the error of a miss).
    ///
    /// Rank 0 refuses a message longer than [`MAX_BROADCAST_BYTES`] before
    /// anything is sent (the other ranks are not involved); a rank that
    /// receives such a length fails the group before allocating it.
    fn broadcast(
        &self,
        buf: &mut Vec<u8>,
        len_deadline: Option<Duration>,
        len_what: &str,
    ) -> Result<()> {
        if self.rank == 0 {
            message_len(buf.len() as u64)?;
        }
        let len = Box::new([buf.len() as u64]);
        let len = self.collective(len, len_deadline, len_what, |k, req| {
            // SAFETY: `k` lives until the request completes (or is leaked).
            unsafe {
                ffi::MPI_Ibcast(
                    k.as_ptr() as *mut c_void,
                    1,
                    ffi::RSMPI_UINT64_T,
                    0,
                    ffi::RSMPI_COMM_WORLD,
                    req,
                )
            }
        })?;
        let n = match message_len(len[0]) {
            Ok(n) => n,
            Err(e) => return Err(self.fail(&mut self.lock(), format!("from rank 0: {e}"))),
        };
        // `n` fits: MAX_BROADCAST_BYTES < c_int::MAX.
        let c = count(n)?;
        let mut data = std::mem::take(buf);
        data.resize(n, 0);
        let data = self.collective(data, Some(self.deadline), "broadcast", |k, req| {
            // SAFETY: as above; `n` bytes are allocated on every rank.
            unsafe {
                ffi::MPI_Ibcast(
                    k.as_ptr() as *mut c_void,
                    c,
                    ffi::RSMPI_UINT8_T,
                    0,
                    ffi::RSMPI_COMM_WORLD,
                    req,
                )
            }
        })?;
        *buf = data;
        Ok(())
    }
}

/// An MPI count, refused when it does not fit (2^31 values).
fn count(n: usize) -> Result<c_int> {
    c_int::try_from(n)
        .map_err(|_| VerifyError::BadBatch(format!("{n} values in one MPI collective")))
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        // Every rank sums every contribution in rank order, as `ThreadComm`
        // does: the result is the same bits on every rank and equals the
        // threaded group's, whatever algorithm and transport MPI picks
        // (MPI_Allreduce's order varies with them, and a greedy token can
        // flip on the last bit). Lengths are not exchanged: the step
        // message fixes every shape, so they agree by construction (a
        // mismatch is an MPI truncation error, which aborts the job).
        if self.world == 1 || buf.is_empty() {
            return Ok(());
        }
        let start = Instant::now();
        let (w, bytes) = (self.world, std::mem::size_of_val(buf));
        let (r, out, in_) = if w > 2 && bytes * (w - 1) > GATHER_ALL_REDUCE_MAX && buf.len() >= w {
            let chunk = buf.len().div_ceil(w) * 4;
            let r = self.scatter_sum_gather(buf);
            (r, chunk * w, 2 * chunk * (w - 1))
        } else {
            (self.gather_sum(buf), bytes, bytes * (w - 1))
        };
        self.tally.record(start, out, in_);
        r
    }

    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        let start = Instant::now();
        let r = self.gather_uneven(local);
        self.tally.record_gather(start, local, &r);
        r
    }

    fn abort(&self) {
        self.abort_because("its step failed");
    }

    fn abort_because(&self, why: &str) {
        let mut st = self.lock();
        let _ = self.fail(&mut st, why.to_string());
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>) -> Result<()> {
        self.counted_broadcast(buf, Some(self.deadline), "broadcast (length)")
    }

    fn receive_broadcast(&self, buf: &mut Vec<u8>) -> Result<()> {
        // Unbounded wait for the message (rank 0 may be idle for hours);
        // the message itself keeps the deadline.
        self.counted_broadcast(buf, None, "broadcast (length)")
    }

    fn all_loaded(&self) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        let (deadline, what) = if self.rank == 0 {
            let what = format!(
                "waiting for the other ranks to load their shards \
                 (load deadline {} s)",
                self.load_deadline.as_secs()
            );
            (Some(self.load_deadline), what)
        } else {
            (None, "waiting for rank 0 to load its shard".to_string())
        };
        self.collective((), deadline, &what, |_, req| {
            // SAFETY: a barrier has no buffers; `req` is written by MPI.
            unsafe { ffi::MPI_Ibarrier(ffi::RSMPI_COMM_WORLD, req) }
        })
    }

    fn failure(&self) -> Option<String> {
        // Never waits for a collective in flight (it holds the lock for
        // up to the deadline, and looks for notices itself meanwhile).
        let mut st = match self.state.try_lock() {
            Ok(st) => st,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        if st.failed.is_none() {
            if let Some(why) = self.take_notice() {
                let _ = self.fail(&mut st, why);
            }
        }
        st.failed.clone()
    }

    fn stats(&self) -> CommStats {
        self.tally.get()
    }
}

impl MpiComm {
    /// [`MpiComm::broadcast`], counted in the stats.
    fn counted_broadcast(
        &self,
        buf: &mut Vec<u8>,
        len_deadline: Option<Duration>,
        len_what: &str,
    ) -> Result<()> {
        let start = Instant::now();
        let r = self.broadcast(buf, len_deadline, len_what);
        self.tally.record_broadcast(start, self.rank, buf.len());
        r
    }

    /// Gathers every rank's `send` (the same length on every rank) into
    /// one buffer, rank by rank (one `MPI_Iallgather`).
    fn gather_equal(&self, send: Vec<f32>, what: &str) -> Result<Vec<f32>> {
        let n = count(send.len())?;
        let bufs = (vec![0f32; send.len() * self.world], send);
        let (all, _) = self.collective(bufs, Some(self.deadline), what, |k, req| {
            // SAFETY: `n` floats sent, `world * n` received; both buffers
            // live until the request completes (or are leaked).
            unsafe {
                ffi::MPI_Iallgather(
                    k.1.as_ptr() as *const c_void,
                    n,
                    ffi::RSMPI_FLOAT,
                    k.0.as_ptr() as *mut c_void,
                    n,
                    ffi::RSMPI_FLOAT,
                    ffi::RSMPI_COMM_WORLD,
                    req,
                )
            }
        })?;
        Ok(all)
    }

    /// All-reduce by gathering every rank's whole buffer (one collective).
    fn gather_sum(&self, buf: &mut [f32]) -> Result<()> {
        let all = self.gather_equal(buf.to_vec(), "all-reduce")?;
        sum_in_rank_order(buf, &all);
        Ok(())
    }

    /// All-reduce in two collectives: each rank receives every rank's
    /// values of its own chunk (all-to-all), sums them in rank order, and
    /// the summed chunks are gathered. The buffer is padded to a whole
    /// number of chunks; the padding is dropped.
    fn scatter_sum_gather(&self, buf: &mut [f32]) -> Result<()> {
        let w = self.world;
        let chunk = buf.len().div_ceil(w);
        let c = count(chunk)?;
        let mut send = buf.to_vec();
        send.resize(chunk * w, 0.0);
        let bufs = (send, vec![0f32; chunk * w]);
        let (_, parts) = self.collective(
            bufs,
            Some(self.deadline),
            "all-reduce (scatter)",
            |k, req| {
                // SAFETY: `chunk` floats to and from each of `w` ranks;
                // both buffers hold `chunk * w` and live until completion.
                unsafe {
                    ffi::MPI_Ialltoall(
                        k.0.as_ptr() as *const c_void,
                        c,
                        ffi::RSMPI_FLOAT,
                        k.1.as_ptr() as *mut c_void,
                        c,
                        ffi::RSMPI_FLOAT,
                        ffi::RSMPI_COMM_WORLD,
                        req,
                    )
                }
            },
        )?;
        let mut mine = vec![0f32; chunk];
        sum_in_rank_order(&mut mine, &parts);
        let all = self.gather_equal(mine, "all-reduce (gather)")?;
        let n = buf.len();
        buf.copy_from_slice(&all[..n]);
        Ok(())
    }

    /// All-gather of buffers whose lengths may differ between ranks.
    fn gather_uneven(&self, local: &[f32]) -> Result<Vec<f32>> {
        // Lengths first (uneven vocabulary shards), then the data.
        let n = count(local.len())?;
        let lens = (Box::new([n]), vec![0 as c_int; self.world]);
        let (_, counts) = self.collective(
            lens,
            Some(self.deadline),
            "all-gather (lengths)",
            |k, req| {
                // SAFETY: one int sent, `world` ints received, both live.
                unsafe {
                    ffi::MPI_Iallgather(
                        k.0.as_ptr() as *const c_void,
                        1,
                        ffi::RSMPI_INT32_T,
                        k.1.as_ptr() as *mut c_void,
                        1,
                        ffi::RSMPI_INT32_T,
                        ffi::RSMPI_COMM_WORLD,
                        req,
                    )
                }
            },
        )?;
        // Other ranks' counts size this rank's buffer: checked first.
        let (displs, total) = match gather_layout(&counts, self.rank, n) {
            Ok(l) => l,
            Err(e) => return Err(self.fail(&mut self.lock(), e.to_string())),
        };
        let bufs = (local.to_vec(), vec![0f32; total], counts, displs);
        let (_, out, _, _) =
            self.collective(bufs, Some(self.deadline), "all-gather", |k, req| {
                // SAFETY: the receive buffer holds the sum of `counts` floats at
                // `displs`; all four buffers live until the request completes.
                unsafe {
                    ffi::MPI_Iallgatherv(
                        k.0.as_ptr() as *const c_void,
                        n,
                        ffi::RSMPI_FLOAT,
                        k.1.as_ptr() as *mut c_void,
                        k.2.as_ptr(),
                        k.3.as_ptr(),
                        ffi::RSMPI_FLOAT,
                        ffi::RSMPI_COMM_WORLD,
                        req,
                    )
                }
            })?;
        Ok(out)
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // A failed group's job ends by MPI_Abort: at once on a worker (it
        // aborted when it failed), on rank 0 by the grace timer or when
        // its session ends, whichever is first, so its server keeps
        // answering 503 until then.
        let failed = self.lock().failed.is_some();
        if failed && self.rank != 0 {
            self.abort_job();
        }
        *self.released.done.lock().unwrap_or_else(|e| e.into_inner()) = (true, failed);
        self.released.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broadcast_length_is_bounded_before_it_is_allocated() {
        assert_eq!(message_len(0).unwrap(), 0);
        assert_eq!(message_len(4096).unwrap(), 4096);
        let max = MAX_BROADCAST_BYTES as u64;
        assert_eq!(message_len(max).unwrap(), MAX_BROADCAST_BYTES);
        // One past the bound, past an MPI count, past usize on 32 bits:
        // each refused, not cast.
        for n in [max + 1, c_int::MAX as u64 + 1, 1 << 40, u64::MAX] {
            let e = message_len(n).unwrap_err().to_string();
            assert!(e.contains(&n.to_string()), "{n}: {e}");
        }
        assert!(MAX_BROADCAST_BYTES <= c_int::MAX as usize);
    }

    #[test]
    fn gather_counts_from_other_ranks_are_checked() {
        let (displs, total) = gather_layout(&[3, 2, 2], 1, 2).unwrap();
        assert_eq!((displs, total), (vec![0, 3, 5], 7));
        assert_eq!(gather_layout(&[0, 0], 0, 0).unwrap(), (vec![0, 0], 0));
        // A negative count (read as a huge usize before).
        let e = gather_layout(&[4, -1], 0, 4).unwrap_err().to_string();
        assert!(e.contains("rank 1 sent a count of -1"), "{e}");
        // A sum past an MPI count (an allocation of 8 GiB before).
        assert!(gather_layout(&[c_int::MAX, 1], 0, c_int::MAX).is_err());
        assert!(gather_layout(&[c_int::MAX / 2 + 1; 2], 0, c_int::MAX / 2 + 1).is_err());
        // This rank's own count not echoed back: the gather is not ours.
        let e = gather_layout(&[5, 5], 1, 4).unwrap_err().to_string();
        assert!(e.contains("rank 1 sent 4"), "{e}");
        assert!(gather_layout(&[5], 1, 5).is_err());
    }

    #[test]
    fn a_failure_notice_size_is_bounded() {
        assert_eq!(notice_len(0), Some(0));
        assert_eq!(notice_len(120), Some(120));
        assert_eq!(
            notice_len(MAX_NOTICE_BYTES as c_int),
            Some(MAX_NOTICE_BYTES)
        );
        assert_eq!(notice_len(MAX_NOTICE_BYTES as c_int + 1), None);
        // MPI_UNDEFINED is negative.
        assert_eq!(notice_len(-32766), None);
        assert_eq!(notice_len(c_int::MAX), None);
    }
}
