//! Ranks run as processes (one per host or more, started by `mpirun`):
//! rank 0 leads, the others follow.
//!
//! Rank 0 ([`Model::lead`]) runs the server and its own shard; before each
//! forward it broadcasts the step (its batch and the operations on the
//! pool's data since the last forward: kept rows, released state slots),
//! and a pool it makes is announced the same way. Every other rank runs
//! [`serve_worker`]: it receives each message, replays the pool operations
//! on its own pool, runs its shard of the SAME family forward and joins its
//! collectives. The forward code is the one every family has; this module
//! only carries its inputs.
//!
//! Rank 0 checks a batch ([`flatten`]) before it sends it, so a batch that
//! is bad fails on rank 0 alone and is never sent: a forward that then
//! fails on a worker is a fault of that worker, which ends the job.
//!
//! Wire format (little-endian): a tag byte, then
//! `0` Pool: id u32, blocks u64, block size u64, state slots u64, latent
//! dtype u8 (0 none, 1 f32, 2 bf16);
//! `1` Step: pool id u32, ops (count u32; each tag u8 with slot u32, and
//! rows u64 for keep-rows), sequences (count u32; each start u64, state
//! slot u32, logits u8, tokens (count u32, u32 each), block table (count
//! u32, u32 each));
//! `2` Stop.

use super::rows::flatten;
use super::{LogitsWanted, Model, SeqInput};
use crate::error::{Result, VerifyError};
use crate::kv_pool::{CacheDtype, KvPool, PoolOp};
use crate::tp::Communicator;
use std::sync::atomic::{AtomicU32, Ordering};

/// Rank 0's side of a group of ranks run as processes.
#[derive(Default)]
pub(crate) struct Leader {
    /// The id the next pool gets; only the latest pool may run forwards.
    next_pool: AtomicU32,
}

fn bad(msg: &str) -> VerifyError {
    VerifyError::BadBatch(format!("malformed step message: {msg}"))
}

/// Appends little-endian values to a message.
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: usize) {
        self.0.extend_from_slice(&(v as u64).to_le_bytes());
    }
    fn u32s(&mut self, v: &[u32]) {
        self.u32(v.len() as u32);
        v.iter().for_each(|&x| self.u32(x));
    }
}

/// Reads a message written by [`Writer`]; every read is bounds-checked.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            return Err(bad("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<usize> {
        let v = u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes"));
        usize::try_from(v).map_err(|_| bad("value beyond usize"))
    }
    fn u32s(&mut self) -> Result<Vec<u32>> {
        let n = self.u32()? as usize;
        let raw = self.take(n.checked_mul(4).ok_or_else(|| bad("length"))?)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
}

const POOL: u8 = 0;
const STEP: u8 = 1;
const STOP: u8 = 2;

fn logits_code(l: LogitsWanted) -> u8 {
    match l {
        LogitsWanted::None => 0,
        LogitsWanted::Last => 1,
        LogitsWanted::All => 2,
        LogitsWanted::Scored => 3,
    }
}

fn logits_from(code: u8) -> Result<LogitsWanted> {
    Ok(match code {
        0 => LogitsWanted::None,
        1 => LogitsWanted::Last,
        2 => LogitsWanted::All,
        3 => LogitsWanted::Scored,
        _ => return Err(bad("logits code")),
    })
}

/// One sequence of a received step (owned).
struct Seq {
    tokens: Vec<u32>,
    start_pos: usize,
    block_table: Vec<u32>,
    logits: LogitsWanted,
    state_slot: u32,
}

fn encode_step(pool: u32, ops: &[PoolOp], seqs: &[SeqInput]) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64 + seqs.len() * 32));
    w.u8(STEP);
    w.u32(pool);
    w.u32(ops.len() as u32);
    for op in ops {
        match *op {
            PoolOp::KeepRows { slot, rows } => {
                w.u8(0);
                w.u32(slot);
                w.u64(rows);
            }
            PoolOp::ReleaseState { slot } => {
                w.u8(1);
                w.u32(slot);
            }
            PoolOp::CopyState { from, to } => {
                w.u8(2);
                w.u32(from);
                w.u32(to);
            }
            PoolOp::CopyRowState { slot, row, to } => {
                w.u8(3);
                w.u32(slot);
                w.u64(row);
                w.u32(to);
            }
        }
    }
    w.u32(seqs.len() as u32);
    for s in seqs {
        w.u64(s.start_pos);
        w.u32(s.state_slot);
        w.u8(logits_code(s.logits));
        w.u32s(s.tokens);
        w.u32s(s.block_table);
    }
    w.0
}

fn decode_step(r: &mut Reader) -> Result<(u32, Vec<PoolOp>, Vec<Seq>)> {
    let pool = r.u32()?;
    let n_ops = r.u32()? as usize;
    let mut ops = Vec::with_capacity(n_ops.min(1 << 16));
    for _ in 0..n_ops {
        ops.push(match r.u8()? {
            0 => PoolOp::KeepRows {
                slot: r.u32()?,
                rows: r.u64()?,
            },
            1 => PoolOp::ReleaseState { slot: r.u32()? },
            2 => PoolOp::CopyState {
                from: r.u32()?,
                to: r.u32()?,
            },
            3 => PoolOp::CopyRowState {
                slot: r.u32()?,
                row: r.u64()?,
                to: r.u32()?,
            },
            _ => return Err(bad("pool operation")),
        });
    }
    let n = r.u32()? as usize;
    let mut seqs = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        let start_pos = r.u64()?;
        let state_slot = r.u32()?;
        let logits = logits_from(r.u8()?)?;
        seqs.push(Seq {
            tokens: r.u32s()?,
            block_table: r.u32s()?,
            start_pos,
            logits,
            state_slot,
        });
    }
    Ok((pool, ops, seqs))
}

fn dtype_code(d: Option<CacheDtype>) -> u8 {
    match d {
        None => 0,
        Some(CacheDtype::F32) => 1,
        Some(CacheDtype::Bf16) => 2,
    }
}

impl Model {
    /// The one rank of a group of processes this model holds: its
    /// communicator, when the model is a lone rank of a larger group.
    fn lone_rank(&self) -> Option<&dyn Communicator> {
        use super::ranks::Rank;
        let comm = match &self.body {
            super::Body::Deepseek(r) if r.len() == 1 => r[0].comm(),
            super::Body::KimiK3(r) if r.len() == 1 => r[0].comm(),
            _ => return None,
        };
        (comm.world_size() > 1).then_some(comm)
    }

    /// Makes this model rank 0 of ranks run as processes, whose other
    /// ranks run [`serve_worker`]: from now on each pool made for it
    /// ([`KvPool::for_model`]) and each forward is broadcast to them
    /// first. Only the latest pool made may run forwards.
    ///
    /// First it waits for every other rank to have loaded its shard
    /// ([`Communicator::all_loaded`]: over MPI, up to the load deadline).
    ///
    /// Errors: a model that is not rank 0 of a larger group (loaded by
    /// [`super::load_model_shard`]); a worker that did not load in time or
    /// a failed group.
    pub fn lead(&mut self) -> Result<()> {
        match self.lone_rank() {
            Some(c) if c.rank() == 0 => {
                c.all_loaded()?;
                self.leader = Some(Leader::default());
                Ok(())
            }
            _ => Err(VerifyError::BadConfig(
                "only rank 0 of a group of processes can lead it".into(),
            )),
        }
    }

    /// Why the model's rank group can no longer run (a rank failed, died
    /// or missed a deadline); `None` while it can, or for a model that
    /// runs its ranks itself in one process and is healthy.
    pub fn group_failure(&self) -> Option<String> {
        use super::ranks::Rank;
        match &self.body {
            super::Body::Deepseek(r) => r[0].comm().failure(),
            super::Body::KimiK3(r) => r[0].comm().failure(),
            super::Body::Llama(s) => s[0].comm().failure(),
            super::Body::Scripted(_) => None,
        }
    }

    /// What this model's rank 0 (the rank this process runs, for ranks run
    /// as processes) has spent in collectives so far; zero for a model of
    /// one rank. Benchmarks read it around a step.
    pub fn comm_stats(&self) -> crate::tp::CommStats {
        use super::ranks::Rank;
        match &self.body {
            super::Body::Deepseek(r) => r[0].comm().stats(),
            super::Body::KimiK3(r) => r[0].comm().stats(),
            super::Body::Llama(s) => s[0].comm().stats(),
            super::Body::Scripted(_) => crate::tp::CommStats::default(),
        }
    }

    /// Rank 0: announces a new pool to the other ranks and marks `pool`
    /// as mirrored to them. A no-op for a model that does not lead.
    pub(crate) fn announce_pool(&self, pool: &mut KvPool) -> Result<()> {
        let (Some(leader), Some(comm)) = (&self.leader, self.lone_rank()) else {
            return Ok(());
        };
        let id = leader.next_pool.fetch_add(1, Ordering::SeqCst) + 1;
        let mut w = Writer(Vec::new());
        w.u8(POOL);
        w.u32(id);
        w.u64(pool.num_blocks());
        w.u64(pool.block_size());
        w.u64(pool.state_slots());
        w.u8(dtype_code(self.latent_cache()));
        // Every worker has loaded its shard ([`Model::lead`] waited for
        // them) and waits for this message; the start of a later one waits
        // without the per-collective deadline, as a worker's wait for rank
        // 0 does.
        comm.receive_broadcast(&mut w.0)?;
        pool.mirror = Some((id, Vec::new()));
        Ok(())
    }

    /// Rank 0: sends the step (the pool's operations since the last
    /// forward, then the batch) to the other ranks. A no-op for a model
    /// that does not lead.
    ///
    /// Errors: a bad batch (checked before anything is sent), a pool that
    /// is not the latest one made for this model, or a failed group.
    pub(crate) fn send_step(&self, pool: &mut KvPool, seqs: &[SeqInput]) -> Result<()> {
        let (Some(leader), Some(comm)) = (&self.leader, self.lone_rank()) else {
            return Ok(());
        };
        flatten(self, pool, seqs)?;
        let latest = leader.next_pool.load(Ordering::SeqCst);
        let id = match &pool.mirror {
            Some((id, _)) if *id == latest => *id,
            _ => {
                return Err(VerifyError::BadBatch(
                    "a forward of a model run as processes over a pool that is not its \
                     latest (one pool at a time)"
                        .into(),
                ))
            }
        };
        let ops = pool.mirror.as_mut().map(|m| std::mem::take(&mut m.1));
        let mut msg = encode_step(id, ops.as_deref().unwrap_or(&[]), seqs);
        comm.broadcast_bytes(&mut msg)
    }

    /// Rank 0: tells the other ranks to end their worker loops (when the
    /// model is dropped).
    fn send_stop(&self) {
        if let (Some(_), Some(comm)) = (&self.leader, self.lone_rank()) {
            if comm.failure().is_none() {
                let _ = comm.broadcast_bytes(&mut vec![STOP]);
            }
        }
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        self.send_stop();
    }
}

/// A worker rank's loop: tells rank 0 its shard is loaded
/// ([`Communicator::all_loaded`]), then receives each message from rank 0
/// and does its part (makes the announced pool; replays a step's pool operations and
/// runs its shard of the step's forward, joining the collectives) until
/// rank 0 sends stop.
///
/// Errors: a message that does not parse, a step over a pool never
/// announced, a forward that fails here (rank 0 checked the batch, so
/// this is a fault of this rank), or a failed group; the group is aborted
/// first ([`Communicator::abort`]: over MPI that ends the job).
pub fn serve_worker(model: &mut Model) -> Result<()> {
    if model.lone_rank().is_none_or(|c| c.rank() == 0) {
        return Err(VerifyError::BadConfig(
            "a worker loop needs a rank other than 0 of a group of processes".into(),
        ));
    }
    let r = model
        .lone_rank()
        .expect("checked above")
        .all_loaded()
        .and_then(|()| follow(model));
    if let Err(e) = &r {
        // Rank 0 must not wait for this rank in its next collective, and
        // should say why the group failed.
        if let Some(c) = model.lone_rank() {
            c.abort_because(&e.to_string());
        }
    }
    r
}

/// The environment variable that makes a worker fail its Nth step on
/// purpose (1-based), for the fault tests: a forward that errs on a worker
/// only, which no real batch can make happen on demand (rank 0 checks every
/// batch before it sends it). Unset in real use.
pub const FAULT_STEP_ENV: &str = "SPECGATE_FAULT_WORKER_STEP";

/// [`serve_worker`]'s loop.
fn follow(model: &mut Model) -> Result<()> {
    let mut pool: Option<(u32, KvPool)> = None;
    let mut buf = Vec::new();
    let fault_at: Option<u64> = std::env::var(FAULT_STEP_ENV)
        .ok()
        .and_then(|v| v.parse().ok());
    let mut steps = 0u64;
    loop {
        buf.clear();
        model
            .lone_rank()
            .expect("checked above")
            .receive_broadcast(&mut buf)?;
        let mut r = Reader(&buf);
        match r.u8()? {
            POOL => {
                let id = r.u32()?;
                let (blocks, block_size, slots) = (r.u64()?, r.u64()?, r.u64()?);
                match r.u8()? {
                    0 => {}
                    1 => model.set_latent_cache(CacheDtype::F32)?,
                    2 => model.set_latent_cache(CacheDtype::Bf16)?,
                    _ => return Err(bad("latent dtype")),
                }
                // The old pool goes first: only the latest one is used.
                drop(pool.take());
                pool = Some((
                    id,
                    KvPool::for_model_with_state_slots(model, blocks, block_size, slots.max(1))?,
                ));
            }
            STEP => {
                steps += 1;
                if fault_at == Some(steps) {
                    return Err(VerifyError::BadBatch(format!(
                        "step {steps} failed on purpose ({FAULT_STEP_ENV})"
                    )));
                }
                let (id, ops, seqs) = decode_step(&mut r)?;
                let Some((_, p)) = pool.as_mut().filter(|(pid, _)| *pid == id) else {
                    return Err(bad("a step over a pool never announced"));
                };
                for op in ops {
                    // Rank 0 ran the same operation on the same state: an
                    // error there (kept, logged by its caller) is one here.
                    match op {
                        PoolOp::KeepRows { slot, rows } => {
                            let _ = p.keep_rows(slot, rows);
                        }
                        PoolOp::ReleaseState { slot } => p.release_state(slot),
                        PoolOp::CopyState { from, to } => {
                            let _ = p.copy_state(from, to);
                        }
                        PoolOp::CopyRowState { slot, row, to } => {
                            let _ = p.copy_row_state(slot, row, to);
                        }
                    }
                }
                let inputs: Vec<SeqInput> = seqs
                    .iter()
                    .map(|s| SeqInput {
                        tokens: &s.tokens,
                        start_pos: s.start_pos,
                        block_table: &s.block_table,
                        logits: s.logits,
                        state_slot: s.state_slot,
                    })
                    .collect();
                model.forward(p, &inputs)?;
            }
            STOP => return Ok(()),
            _ => return Err(bad("message tag")),
        }
    }
}

#[cfg(test)]
#[path = "remote_tests.rs"]
mod tests;
