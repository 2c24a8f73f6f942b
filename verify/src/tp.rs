//! Tensor-parallel communication: the collective operations that tie the
//! ranks of one sharded model together.
//!
//! A [`Communicator`] is one rank's end of a group. [`LocalComm`] is the
//! group of one (every collective is the identity); [`ThreadComm`] is N ranks
//! as N threads of one process exchanging through shared memory; `MpiComm`
//! (behind the cargo feature `mpi`, in `tp/mpi.rs`) is N ranks as N
//! processes started by `mpirun`, on one host or many. An NCCL communicator
//! would implement the same trait behind a `cuda` feature.
//!
//! Determinism: every rank of a [`ThreadComm`] sums the contributions in rank
//! order, so all ranks hold bit-identical results after an all-reduce, and
//! repeated runs are reproducible.

use crate::error::{Result, VerifyError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "mpi")]
pub use self::mpi::{MpiComm, MpiSession};

/// One rank's handle on a communication group.
///
/// Contract: every rank of a group calls the same collectives in the same
/// order (as SPMD code does); a rank that skips one deadlocks the group, so
/// a rank that fails must fail the whole step, never just return early on
/// its own. Buffers passed to one collective have the same length on every
/// rank unless the method says otherwise.
pub trait Communicator: Send + Sync {
    /// This rank's index, `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// Replaces `buf` on every rank by the element-wise sum over all ranks.
    ///
    /// Errors when the ranks' buffers differ in length.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// Returns the concatenation of every rank's `local`, in rank order.
    /// Lengths may differ between ranks (uneven vocabulary shards).
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>>;
    /// Marks the whole group failed, for a rank that cannot finish its step:
    /// ranks waiting in a collective, and every later collective of the
    /// group, return an error instead of waiting forever. Irreversible.
    /// The default (a group of one) has nobody to wake.
    fn abort(&self) {}
    /// [`Communicator::abort`], saying why: a communicator that can tell
    /// the other ranks (ranks run as processes) passes `why` on, so rank 0
    /// reports a worker's own error. The default just aborts.
    fn abort_because(&self, _why: &str) {
        self.abort()
    }
    /// Replaces `buf` on every rank by rank 0's `buf` (lengths may differ
    /// before the call). The step messages of ranks run as processes
    /// ([`crate::model::serve_worker`]) travel this way.
    ///
    /// Errors: a failed group, or a communicator that cannot broadcast
    /// (the default, except for a group of one, where it is the identity).
    fn broadcast_bytes(&self, _buf: &mut Vec<u8>) -> Result<()> {
        if self.world_size() == 1 {
            Ok(())
        } else {
            Err(VerifyError::BadConfig(
                "this communicator cannot broadcast".into(),
            ))
        }
    }
    /// [`Communicator::broadcast_bytes`] whose start waits without a
    /// deadline: a worker waiting for rank 0's next message (rank 0 may be
    /// idle for hours), or rank 0 announcing a pool while workers may still
    /// be loading their shards. A communicator with deadlines applies them
    /// to the message itself only.
    fn receive_broadcast(&self, buf: &mut Vec<u8>) -> Result<()> {
        self.broadcast_bytes(buf)
    }
    /// Waits until every rank of the group has loaded its shard and called
    /// this: once per rank, after its load and before its first broadcast
    /// ([`crate::model::Model::lead`] on rank 0,
    /// [`crate::model::serve_worker`] on the others). A communicator with
    /// deadlines bounds rank 0's wait by its load deadline (a worker stuck
    /// in its load fails the group) and lets a worker wait for rank 0
    /// without one. The default (ranks that load together, in one process)
    /// returns at once.
    ///
    /// Errors: a failed group, or a missed load deadline.
    fn all_loaded(&self) -> Result<()> {
        Ok(())
    }
    /// Why the group can no longer run collectives (a rank that failed,
    /// died or missed a deadline), once it cannot; `None` while healthy.
    /// A server turns unhealthy when this is set.
    fn failure(&self) -> Option<String> {
        None
    }
    /// What this rank's collectives cost so far (zero for a communicator
    /// that does not count, such as the group of one, whose collectives
    /// are free).
    fn stats(&self) -> CommStats {
        CommStats::default()
    }
}

/// One rank's collective traffic since its communicator was made: what a
/// benchmark reads before and after a step ([`CommStats::since`]).
///
/// Bytes are what the collective's algorithm moves for this rank (its
/// contribution sent once, the others' received), not what the transport
/// adds; time is wall time inside the calls, so it includes waiting for
/// the slowest rank to arrive.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommStats {
    /// Collectives called (all-reduce, all-gather, broadcast).
    pub calls: u64,
    /// Bytes this rank contributed.
    pub bytes_out: u64,
    /// Bytes this rank received from the others.
    pub bytes_in: u64,
    /// Seconds inside the calls.
    pub seconds: f64,
}

impl CommStats {
    /// The traffic between `earlier` and `self`.
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        CommStats {
            calls: self.calls - earlier.calls,
            bytes_out: self.bytes_out - earlier.bytes_out,
            bytes_in: self.bytes_in - earlier.bytes_in,
            seconds: self.seconds - earlier.seconds,
        }
    }
}

/// Running [`CommStats`] a communicator keeps (lock-free: a rank's
/// collectives never overlap, but a reader may be another thread).
#[derive(Debug, Default)]
pub(crate) struct Tally {
    calls: AtomicU64,
    bytes_out: AtomicU64,
    bytes_in: AtomicU64,
    nanos: AtomicU64,
}

impl Tally {
    /// Counts one collective that began at `start`, moving `out` and `in_`
    /// floats-or-bytes already converted to bytes.
    pub(crate) fn record(&self, start: Instant, out: usize, in_: usize) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.bytes_out.fetch_add(out as u64, Ordering::Relaxed);
        self.bytes_in.fetch_add(in_ as u64, Ordering::Relaxed);
        self.nanos
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Counts an all-gather of `local` that returned `result`.
    pub(crate) fn record_gather(&self, start: Instant, local: &[f32], result: &Result<Vec<f32>>) {
        let total = result.as_ref().map_or(0, |v| v.len());
        let others = total.saturating_sub(local.len());
        self.record(start, std::mem::size_of_val(local), others * 4);
    }

    /// Counts a broadcast of `len` bytes: sent by rank 0, received by
    /// the others.
    pub(crate) fn record_broadcast(&self, start: Instant, rank: usize, len: usize) {
        let (out, in_) = if rank == 0 { (len, 0) } else { (0, len) };
        self.record(start, out, in_);
    }

    pub(crate) fn get(&self) -> CommStats {
        CommStats {
            calls: self.calls.load(Ordering::Relaxed),
            bytes_out: self.bytes_out.load(Ordering::Relaxed),
            bytes_in: self.bytes_in.load(Ordering::Relaxed),
            seconds: self.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

/// The group of one: collectives are identities.
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalComm;

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        Ok(local.to_vec())
    }
}

/// A reusable barrier that a failing rank can break (std's cannot be).
struct GroupBarrier {
    n: usize,
    state: Mutex<BarrierState>,
    cv: Condvar,
}

struct BarrierState {
    arrived: usize,
    generation: u64,
    broken: bool,
}

fn aborted() -> VerifyError {
    VerifyError::RankFailed("another rank of the tensor-parallel group failed".into())
}

impl GroupBarrier {
    fn new(n: usize) -> Self {
        Self {
            n,
            state: Mutex::new(BarrierState {
                arrived: 0,
                generation: 0,
                broken: false,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BarrierState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns once all `n` ranks have arrived; an error if the group is
    /// or becomes broken first.
    fn wait(&self) -> Result<()> {
        let mut st = self.lock();
        if st.broken {
            return Err(aborted());
        }
        let generation = st.generation;
        st.arrived += 1;
        if st.arrived == self.n {
            st.arrived = 0;
            st.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while st.generation == generation && !st.broken {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if st.generation != generation {
            Ok(())
        } else {
            Err(aborted())
        }
    }

    fn abort(&self) {
        self.lock().broken = true;
        self.cv.notify_all();
    }
}

struct Shared {
    barrier: GroupBarrier,
    /// Each rank's contribution to the collective in flight.
    slots: Vec<Mutex<Vec<f32>>>,
}

/// One rank of N ranks running as N threads in one process.
///
/// Each collective is two barrier phases: every rank publishes into its own
/// slot, waits, reads all slots, and waits again so no rank overwrites its
/// slot for the next collective while another still reads it. A rank that
/// fails calls [`Communicator::abort`], which breaks the barrier for all.
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    tally: Tally,
}

impl ThreadComm {
    /// Creates the `world_size` connected ranks of one group, in rank order.
    /// Hand each to its own thread.
    ///
    /// Errors when `world_size` is zero.
    pub fn group(world_size: usize) -> Result<Vec<ThreadComm>> {
        if world_size == 0 {
            return Err(VerifyError::BadConfig(
                "tensor-parallel world size 0".into(),
            ));
        }
        let shared = Arc::new(Shared {
            barrier: GroupBarrier::new(world_size),
            slots: (0..world_size).map(|_| Mutex::new(Vec::new())).collect(),
        });
        Ok((0..world_size)
            .map(|rank| ThreadComm {
                rank,
                shared: shared.clone(),
                tally: Tally::default(),
            })
            .collect())
    }

    fn publish(&self, data: &[f32]) {
        let mut slot = self.shared.slots[self.rank]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        slot.clear();
        slot.extend_from_slice(data);
    }

    fn slot(&self, rank: usize) -> std::sync::MutexGuard<'_, Vec<f32>> {
        self.shared.slots[rank]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.slots.len()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let start = Instant::now();
        let bytes = std::mem::size_of_val(buf);
        let r = self.all_reduce_inner(buf);
        self.tally
            .record(start, bytes, bytes * (self.world_size() - 1));
        r
    }

    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        let start = Instant::now();
        let r = self.all_gather_inner(local);
        self.tally.record_gather(start, local, &r);
        r
    }

    fn abort(&self) {
        self.shared.barrier.abort();
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>) -> Result<()> {
        let start = Instant::now();
        let r = self.broadcast_inner(buf);
        self.tally.record_broadcast(start, self.rank, buf.len());
        r
    }

    fn failure(&self) -> Option<String> {
        self.shared
            .barrier
            .lock()
            .broken
            .then(|| "a rank of the thread group failed".to_string())
    }

    fn stats(&self) -> CommStats {
        self.tally.get()
    }
}

impl ThreadComm {
    fn all_reduce_inner(&self, buf: &mut [f32]) -> Result<()> {
        self.publish(buf);
        self.shared.barrier.wait()?;
        // Every rank checks every length, so all agree on the error and none
        // is left waiting at the second barrier.
        let mut mismatch = None;
        for r in 0..self.world_size() {
            let n = self.slot(r).len();
            if n != buf.len() {
                mismatch = Some((r, n));
                break;
            }
        }
        if mismatch.is_none() {
            buf.copy_from_slice(&self.slot(0));
            for r in 1..self.world_size() {
                let other = self.slot(r);
                for (b, o) in buf.iter_mut().zip(other.iter()) {
                    *b += o;
                }
            }
        }
        self.shared.barrier.wait()?;
        match mismatch {
            None => Ok(()),
            Some((r, n)) => Err(VerifyError::BadBatch(format!(
                "all-reduce: rank {r} sent {n} values, rank {} sent {}",
                self.rank,
                buf.len()
            ))),
        }
    }

    fn all_gather_inner(&self, local: &[f32]) -> Result<Vec<f32>> {
        self.publish(local);
        self.shared.barrier.wait()?;
        let mut out = Vec::new();
        for r in 0..self.world_size() {
            out.extend_from_slice(&self.slot(r));
        }
        self.shared.barrier.wait()?;
        Ok(out)
    }

    fn broadcast_inner(&self, buf: &mut Vec<u8>) -> Result<()> {
        // The slots hold f32: bytes travel as their bit patterns, four to a
        // float, after the length (copies keep every bit, NaNs included).
        if self.rank == 0 {
            let mut packed = vec![f32::from_bits(buf.len() as u32)];
            packed.extend(buf.chunks(4).map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                f32::from_bits(u32::from_le_bytes(w))
            }));
            self.publish(&packed);
        }
        self.shared.barrier.wait()?;
        if self.rank != 0 {
            let slot = self.slot(0);
            let n = slot.first().map_or(0, |f| f.to_bits() as usize);
            buf.clear();
            buf.extend(slot[1..].iter().flat_map(|f| f.to_bits().to_le_bytes()));
            buf.truncate(n);
        }
        self.shared.barrier.wait()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_group<T: Send + 'static>(
        n: usize,
        f: impl Fn(ThreadComm) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = ThreadComm::group(n)
            .unwrap()
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_reduce_sums_in_rank_order_on_every_rank() {
        for n in [1, 2, 3, 4] {
            let results = run_group(n, |c| {
                let mut out = Vec::new();
                // Several rounds back to back: slots must not be overwritten
                // while another rank still reads the previous round.
                for round in 0..50 {
                    let mut buf: Vec<f32> = (0..7)
                        .map(|i| (c.rank() * 100 + i + round) as f32)
                        .collect();
                    c.all_reduce_sum(&mut buf).unwrap();
                    out.push(buf);
                }
                out
            });
            for round in 0..50 {
                let expected: Vec<f32> = (0..7)
                    .map(|i| (0..n).map(|r| (r * 100 + i + round) as f32).sum())
                    .collect();
                for per_rank in &results {
                    assert_eq!(per_rank[round], expected, "world {n} round {round}");
                }
            }
        }
    }

    #[test]
    fn all_gather_concatenates_uneven_shards() {
        let results = run_group(3, |c| {
            let local: Vec<f32> = (0..=c.rank()).map(|i| (c.rank() * 10 + i) as f32).collect();
            c.all_gather(&local).unwrap()
        });
        for r in results {
            assert_eq!(r, vec![0.0, 10.0, 11.0, 20.0, 21.0, 22.0]);
        }
    }

    #[test]
    fn mismatched_lengths_fail_on_every_rank_without_deadlock() {
        let results = run_group(2, |c| {
            let mut buf = vec![1.0; 3 + c.rank()];
            c.all_reduce_sum(&mut buf).is_err()
        });
        assert_eq!(results, vec![true, true]);
    }

    #[test]
    fn abort_wakes_waiting_ranks_and_fails_later_collectives() {
        let results = run_group(3, |c| {
            if c.rank() == 2 {
                // This rank gives up instead of joining the collective.
                std::thread::sleep(std::time::Duration::from_millis(20));
                c.abort();
                return (true, true);
            }
            let mut buf = vec![1.0; 4];
            let first = c.all_reduce_sum(&mut buf).is_err();
            let later = c.all_gather(&buf).is_err();
            (first, later)
        });
        assert_eq!(results, vec![(true, true); 3]);
    }

    #[test]
    fn broadcast_bytes_hands_rank_0s_bytes_to_every_rank() {
        let results = run_group(3, |c| {
            let mut out = Vec::new();
            for len in [0usize, 1, 5, 8, 1001] {
                let mut buf: Vec<u8> = if c.rank() == 0 {
                    (0..len).map(|i| (i * 7 + 3) as u8).collect()
                } else {
                    vec![9; c.rank() * 3]
                };
                c.broadcast_bytes(&mut buf).unwrap();
                out.push(buf);
            }
            out
        });
        for per_rank in results {
            for (buf, len) in per_rank.iter().zip([0usize, 1, 5, 8, 1001]) {
                let expected: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
                assert_eq!(buf, &expected);
            }
        }
    }

    #[test]
    fn stats_count_calls_and_bytes_per_rank() {
        let results = run_group(3, |c| {
            let before = c.stats();
            let mut buf = vec![1.0f32; 10];
            c.all_reduce_sum(&mut buf).unwrap();
            c.all_gather(&buf[..c.rank() + 1]).unwrap();
            c.stats().since(&before)
        });
        for (rank, s) in results.iter().enumerate() {
            assert_eq!(s.calls, 2);
            // 40 bytes out and 2 x 40 in for the all-reduce; the gather
            // sends rank + 1 floats and receives the other 6 - (rank + 1).
            assert_eq!(s.bytes_out, 40 + 4 * (rank as u64 + 1));
            assert_eq!(s.bytes_in, 80 + 4 * (5 - rank as u64));
            assert!(s.seconds >= 0.0);
        }
        assert_eq!(LocalComm.stats(), CommStats::default());
    }

    #[test]
    fn local_comm_is_identity() {
        let c = LocalComm;
        let mut b = vec![1.0, 2.0];
        c.all_reduce_sum(&mut b).unwrap();
        assert_eq!(b, vec![1.0, 2.0]);
        assert_eq!(c.all_gather(&b).unwrap(), b);
        assert_eq!((c.rank(), c.world_size()), (0, 1));
        assert!(ThreadComm::group(0).is_err());
    }
}
