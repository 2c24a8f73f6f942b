//! Running one forward step on every tensor-parallel rank of a model held in
//! one process: rank 0 on the caller's thread, the others on scoped threads
//! spawned per call, each with its own KV pool shard. Shared by every
//! architecture family, so rank failure handling lives in one place.
//!
//! Scoped threads may borrow the batch, the pool shards and the weights
//! without `'static` bounds, channels or unsafe code; spawning costs tens of
//! microseconds per rank against milliseconds per forward.

use super::ops::rms_norm;
use super::rows::Rows;
use super::shard::balanced;
use crate::error::{Result, VerifyError};
use crate::kv_pool::KvShard;
use crate::tp::Communicator;
use candle_core::{Device, Tensor};
use std::ops::Range;

/// One rank's weights, with its end of the rank group.
pub(crate) trait Rank: Sync {
    fn comm(&self) -> &dyn Communicator;
}

/// Runs `step` for rank `r` over `kv[r]` for every rank and returns rank
/// 0's result, or the first error of any rank.
///
/// A rank that fails (an error or a panic) aborts the group before it
/// returns, so the other ranks' collectives fail instead of waiting forever.
/// So does the one rank of a larger group that `ranks` holds when its
/// ranks run as processes: rank 0's own forward failing after the step
/// went to the workers must not leave them inside its collectives (a
/// worker's failure is the same, with its reason passed on to rank 0).
///
/// Errors: a pool with another number of shards than `ranks`, or any rank's
/// error ([`VerifyError::RankFailed`] for a panic).
pub(crate) fn run_ranks<W, T, F>(ranks: &[W], kv: &mut [KvShard], step: F) -> Result<T>
where
    W: Rank,
    T: Send,
    F: Fn(&W, &mut KvShard) -> Result<T> + Sync,
{
    if ranks.len() != kv.len() || ranks.is_empty() {
        return Err(VerifyError::BadBatch(format!(
            "KV pool has {} shards for {} tensor-parallel ranks",
            kv.len(),
            ranks.len()
        )));
    }
    if ranks.len() == 1 {
        let (w, kv0) = (&ranks[0], &mut kv[0]);
        if w.comm().world_size() > 1 {
            // One rank of a group its caller drives: it blocks in
            // collectives, so it must not hold one of the pool's workers
            // that the group's other ranks need.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(w, kv0)))
                .unwrap_or_else(|_| {
                    Err(VerifyError::RankFailed(format!(
                        "rank {} panicked in its forward",
                        w.comm().rank()
                    )))
                });
            if let Err(e) = &r {
                w.comm().abort_because(&e.to_string());
            }
            return r;
        }
        // On a pool worker, the step's parallel loops run with this thread
        // taking part; called from outside the pool, each of them (some 140
        // per step) would park the caller and wake it again.
        return rayon::scope(|_| step(w, kv0));
    }
    let guarded = |w: &W, kv: &mut KvShard| -> Result<T> {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(w, kv)))
            .unwrap_or_else(|_| {
                Err(VerifyError::RankFailed(format!(
                    "rank {} panicked",
                    w.comm().rank()
                )))
            });
        if r.is_err() {
            w.comm().abort();
        }
        r
    };
    let guarded = &guarded;
    let (kv0, kv_rest) = kv.split_at_mut(1);
    std::thread::scope(|scope| {
        let others: Vec<_> = ranks[1..]
            .iter()
            .zip(kv_rest)
            .map(|(w, kv)| scope.spawn(move || guarded(w, kv)))
            .collect();
        let mut result = guarded(&ranks[0], &mut kv0[0]);
        for h in others {
            // `guarded` catches panics, so join only fails if that did.
            let r = h
                .join()
                .unwrap_or_else(|_| Err(VerifyError::RankFailed("rank panicked".into())));
            if let (Err(e), Ok(_)) = (r, &result) {
                result = Err(e);
            }
        }
        result
    })
}

/// Reassembles an all-gather of vocabulary-parallel logits: rank r sent its
/// `[rows, ranges[r].len()]` block, the blocks concatenated in rank order;
/// returns `[rows, vocab]` row-major.
pub(crate) fn assemble_vocab(
    gathered: &[f32],
    rows: usize,
    ranges: &[Range<usize>],
    vocab: usize,
) -> Vec<f32> {
    let mut logits = vec![0f32; rows * vocab];
    let mut off = 0;
    for range in ranges {
        let w = range.len();
        for row in 0..rows {
            logits[row * vocab + range.start..row * vocab + range.end]
                .copy_from_slice(&gathered[off + row * w..off + (row + 1) * w]);
        }
        off += rows * w;
    }
    logits
}

/// The output head of the families whose forward runs on f32 slices: the
/// final RMSNorm of the rows that asked for logits (`x` is `[rows,
/// hidden]`), `lm_head` (this rank's vocabulary rows, the [`balanced`]
/// split, as loaded), all-gathered into `[logit rows, vocab]`.
///
/// Errors: a failed all-gather.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dense_head(
    x: &[f32],
    hidden: usize,
    rows: &Rows,
    norm: &[f32],
    lm_head: impl Fn(&[f32]) -> Result<Vec<f32>>,
    eps: f32,
    comm: &dyn Communicator,
    vocab: usize,
) -> Result<Tensor> {
    let m = rows.logit_rows.len();
    let picked: Vec<f32> = rows
        .logit_rows
        .iter()
        .flat_map(|&r| &x[r as usize * hidden..(r as usize + 1) * hidden])
        .copied()
        .collect();
    let local = lm_head(&rms_norm(&picked, norm, eps))?;
    let logits = if comm.world_size() == 1 {
        local
    } else {
        // all_gather concatenates whole shards: regroup them row by row.
        let all = comm.all_gather(&local)?;
        assemble_vocab(&all, m, &balanced(vocab, comm.world_size()), vocab)
    };
    Ok(Tensor::from_vec(logits, (m, vocab), &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_pool::{KvLayout, KvPool, TokenRow};
    use crate::tp::ThreadComm;
    use std::sync::mpsc;
    use std::time::Duration;

    struct One(ThreadComm);

    impl Rank for One {
        fn comm(&self) -> &dyn Communicator {
            &self.0
        }
    }

    fn pool() -> KvPool {
        let layout = KvLayout {
            cached: vec![true],
            rows: vec![TokenRow::Heads {
                kv_heads: 1,
                head_dim: 2,
            }],
            state_floats: Vec::new(),
        };
        KvPool::with_layout(&layout, 1, 1, 0).unwrap()
    }

    /// Rank 0 of a group whose other ranks it does not hold (ranks run as
    /// processes): its forward fails (an error, then a panic) while rank 1
    /// waits in the step's collective. Rank 1 must be released with an
    /// error, as the threaded path's ranks are, not left waiting.
    #[test]
    fn a_lone_rank_whose_forward_fails_aborts_its_group() {
        for panics in [false, true] {
            let mut group = ThreadComm::group(2).unwrap().into_iter();
            let (rank0, rank1) = (One(group.next().unwrap()), group.next().unwrap());
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let mut buf = vec![1.0f32; 4];
                let _ = tx.send(rank1.all_reduce_sum(&mut buf));
            });
            let mut pool = pool();
            let r: Result<()> = run_ranks(&[rank0], pool.shards_mut(), |_, _| {
                if panics {
                    panic!("rank 0 blew up");
                }
                Err(VerifyError::BadBatch("rank 0's own forward failed".into()))
            });
            let e = r.unwrap_err().to_string();
            assert!(
                e.contains(if panics { "panicked" } else { "own forward" }),
                "{e}"
            );
            // Generous: a released rank answers at once; on failure it
            // would wait for ever.
            let waited = rx
                .recv_timeout(Duration::from_secs(30))
                .expect("rank 1 is still waiting in its collective");
            assert!(waited.is_err(), "rank 1's collective must fail");
        }
    }
}
