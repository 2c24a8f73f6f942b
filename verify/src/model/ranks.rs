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
            return step(w, kv0);
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
