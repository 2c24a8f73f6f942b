//! Recurrent-state checkpoints of a hybrid target's prefix cache
//! (bookkeeping only; the states are slots of the target's pool, copied by
//! the engine with `KvPool::copy_state` / `copy_row_state`).
//!
//! A block hit restores the attention rows of a prefix but not the
//! recurrent state after it. So for a hybrid target a prefix hit is the
//! deepest boundary of the matched chain whose blocks are cached AND that
//! has a checkpoint: the whole recurrent state (every layer, every rank)
//! valid after exactly that many tokens. A checkpoint is keyed by the
//! registration of the block that ends at its boundary: registrations are
//! never reused and a block is found only after its whole chain (and
//! scope) matched, so a checkpoint is found only by a prompt with the same
//! tokens before it, in the same cache scope. A hit copies the checkpoint
//! into the sequence's own slot (a checkpoint is never written in place)
//! and the sequence prefills the rest.
//!
//! Checkpoints are taken (see [`Checkpoints::plan_admission`]) where a
//! prompt's prefill ends, aligned down to a block boundary (prefill
//! chunks are cut there), at a branch point (where a lookup matched cached
//! blocks past the deepest checkpoint: the next sibling hits it), and at
//! the end of a request: while a sequence decodes, the state at each block
//! boundary it passes is copied into a slot it holds (its "tail"), keyed
//! when the request ends. Only committed states are saved: a prompt
//! chunk's end, or an accepted row's state.
//!
//! Memory: a fixed number of checkpoint slots (the byte budget over the
//! state size), evicted least recently used; a checkpoint is dropped with
//! the block its key names, so it never outlives its blocks (a block may
//! outlive its checkpoint). At most half of the slots serve as tails, so
//! finished conversations keep the rest.

use super::SeqId;
use std::collections::{BTreeMap, HashMap};

/// Checkpoint counters (monotonic, except `held`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointStats {
    /// Admissions that restored a checkpoint.
    pub hits: u64,
    /// Admissions that looked up at least one block and restored none.
    pub misses: u64,
    /// Checkpoints saved (prompt ends, branch points, request ends).
    pub saves: u64,
    /// Checkpoints dropped for room or with their block.
    pub evictions: u64,
    /// Prompt tokens whose prefill a restored checkpoint skipped.
    pub restored_tokens: u64,
    /// Checkpoints held now (keyed ones, not tails).
    pub held: u64,
}

/// One keyed checkpoint.
#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: u32,
    /// Its key in the LRU order.
    used: u64,
}

/// One admitted sequence's checkpoint plan.
#[derive(Debug, Default)]
struct SeqPlan {
    /// The checkpoint slot to copy into its state slot before its first
    /// forward.
    restore: Option<u32>,
    /// Positions (block boundaries, ascending) where a prefill chunk must
    /// end and a checkpoint be saved.
    stops: Vec<usize>,
    /// The slot holding its decode-time state at a block boundary, and
    /// which boundary it holds (none yet: `None`).
    tail: Option<(u32, Option<usize>)>,
}

/// Checkpoint slots and the checkpoints keyed in them.
///
/// Invariants: every checkpoint slot is in exactly one place: free, keyed
/// (`by_reg`, with its LRU entry), or some sequence's tail.
pub struct Checkpoints {
    block_size: usize,
    slot_bytes: usize,
    total: usize,
    free: Vec<u32>,
    by_reg: HashMap<u64, Entry>,
    lru: BTreeMap<u64, u64>,
    clock: u64,
    plans: HashMap<SeqId, SeqPlan>,
    stats: CheckpointStats,
}

/// Where a lookup's hit is clamped to (see [`Checkpoints::clamp`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clamped {
    /// Matched blocks the sequence may use (a prefix of those matched).
    pub blocks: usize,
    /// The checkpoint slot at their end, if any.
    pub restore: Option<u32>,
}

impl Checkpoints {
    /// `count` checkpoint slots, pool state slots `first..first + count`,
    /// each `slot_bytes` bytes, for a pool of `block_size`-token blocks.
    pub fn new(first: u32, count: usize, slot_bytes: usize, block_size: usize) -> Self {
        Self {
            block_size,
            slot_bytes,
            total: count,
            free: (first..first + count as u32).rev().collect(),
            by_reg: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            plans: HashMap::new(),
            stats: CheckpointStats::default(),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> CheckpointStats {
        CheckpointStats {
            held: self.by_reg.len() as u64,
            ..self.stats
        }
    }

    /// Bytes the keyed checkpoints and the tails hold now.
    pub fn bytes_in_use(&self) -> usize {
        (self.total - self.free.len()) * self.slot_bytes
    }

    fn touch(&mut self, reg: u64) {
        if let Some(e) = self.by_reg.get_mut(&reg) {
            self.lru.remove(&e.used);
            self.clock += 1;
            e.used = self.clock;
            self.lru.insert(self.clock, reg);
        }
    }

    /// A lookup that matched the blocks registered as `regs` (in chain
    /// order), clamped to the deepest matched boundary with a checkpoint.
    /// Changes nothing (see [`Checkpoints::plan_admission`]).
    pub fn clamp(&self, regs: &[u64]) -> Clamped {
        match regs.iter().rposition(|r| self.by_reg.contains_key(r)) {
            Some(i) => Clamped {
                blocks: i + 1,
                restore: Some(self.by_reg[&regs[i]].slot),
            },
            None => Clamped {
                blocks: 0,
                restore: None,
            },
        }
    }

    /// Records the admission of `seq`, whose lookup matched `regs` and was
    /// clamped to `c` ([`Checkpoints::clamp`]), for a prompt of `len`
    /// tokens: the restore, and the save points of its prefill: the end of
    /// the whole match when it lies past the clamped hit (a branch point),
    /// and the prompt's last full block boundary before its last token.
    /// `queried`: whether the lookup looked at a block at all (for the hit
    /// and miss counters).
    pub fn plan_admission(
        &mut self,
        seq: SeqId,
        regs: &[u64],
        c: Clamped,
        len: usize,
        queried: bool,
    ) {
        let Clamped { blocks, restore } = c;
        if restore.is_some() {
            self.touch(regs[blocks - 1]);
        }
        match restore {
            Some(_) => {
                self.stats.hits += 1;
                self.stats.restored_tokens += (blocks * self.block_size) as u64;
            }
            None if queried => self.stats.misses += 1,
            None => {}
        }
        let hit = blocks * self.block_size;
        let branch = regs.len() * self.block_size;
        let end = len.saturating_sub(1) / self.block_size * self.block_size;
        let mut stops: Vec<usize> = [branch, end].into_iter().filter(|&p| p > hit).collect();
        stops.dedup();
        self.plans.insert(
            seq,
            SeqPlan {
                restore,
                stops,
                tail: None,
            },
        );
    }

    /// The checkpoint slot to copy into `seq`'s state slot before its first
    /// forward, once (then `None`).
    pub fn take_restore(&mut self, seq: SeqId) -> Option<u32> {
        self.plans.get_mut(&seq)?.restore.take()
    }

    /// The first save point of `seq` past `computed`, where its prefill
    /// chunk must end.
    pub fn next_stop(&self, seq: SeqId, computed: usize) -> Option<usize> {
        let p = self.plans.get(&seq)?;
        p.stops.iter().copied().find(|&s| s > computed)
    }

    /// Whether `seq` should save a checkpoint with `computed` tokens fed.
    pub fn is_stop(&self, seq: SeqId, computed: usize) -> bool {
        self.plans
            .get(&seq)
            .is_some_and(|p| p.stops.contains(&computed))
    }

    /// A slot for a new checkpoint keyed by `reg`, its key recorded now
    /// (the caller copies the state in before anything reads it): a free
    /// slot, or the least recently used checkpoint's. `None` when `reg` has
    /// one already or no slot can be had.
    pub fn save(&mut self, reg: u64) -> Option<u32> {
        if self.by_reg.contains_key(&reg) {
            return None;
        }
        let slot = self.take_slot()?;
        self.key(reg, slot);
        Some(slot)
    }

    fn key(&mut self, reg: u64, slot: u32) {
        self.clock += 1;
        self.by_reg.insert(
            reg,
            Entry {
                slot,
                used: self.clock,
            },
        );
        self.lru.insert(self.clock, reg);
        self.stats.saves += 1;
    }

    /// A free slot, evicting the least recently used checkpoint if none is.
    fn take_slot(&mut self) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let (_, reg) = self.lru.pop_first()?;
        let e = self.by_reg.remove(&reg).expect("LRU entries are keyed");
        self.stats.evictions += 1;
        Some(e.slot)
    }

    /// Drops the checkpoint keyed by `reg` (its block was evicted), if any.
    pub fn drop_reg(&mut self, reg: u64) {
        if let Some(e) = self.by_reg.remove(&reg) {
            self.lru.remove(&e.used);
            self.free.push(e.slot);
            self.stats.evictions += 1;
        }
    }

    /// Drops the checkpoint in `slot` (its state could not be copied in).
    pub fn drop_slot(&mut self, slot: u32) {
        if let Some((&reg, _)) = self.by_reg.iter().find(|(_, e)| e.slot == slot) {
            self.drop_reg(reg);
        }
    }

    /// The tail slot `seq` copies its state into at block boundary
    /// `boundary` while decoding, reserved now if it has none (from a free
    /// slot, or the least recently used checkpoint's while fewer than half
    /// the slots are tails). `None`: no slot, or `seq` was not admitted.
    pub fn tail_for(&mut self, seq: SeqId) -> Option<u32> {
        if let Some((slot, _)) = self.plans.get(&seq)?.tail {
            return Some(slot);
        }
        let tails = self.plans.values().filter(|p| p.tail.is_some()).count();
        if tails >= self.total / 2 && self.free.is_empty() {
            return None;
        }
        let slot = self.take_slot()?;
        self.plans.get_mut(&seq).expect("checked").tail = Some((slot, None));
        Some(slot)
    }

    /// Records that `seq`'s tail now holds its state at `boundary`.
    pub fn tail_saved(&mut self, seq: SeqId, boundary: usize) {
        if let Some(p) = self.plans.get_mut(&seq) {
            if let Some((_, at)) = &mut p.tail {
                *at = Some(boundary);
            }
        }
    }

    /// The boundary `seq`'s tail holds, if any.
    pub fn tail_boundary(&self, seq: SeqId) -> Option<usize> {
        self.plans.get(&seq)?.tail?.1
    }

    /// Keys `seq`'s tail under `reg` (the registration of the block ending
    /// at its boundary), at the end of its request; the slot is freed
    /// instead when `reg` has a checkpoint already or is `None`.
    pub fn commit_tail(&mut self, seq: SeqId, reg: Option<u64>) {
        let Some(p) = self.plans.get_mut(&seq) else {
            return;
        };
        let Some((slot, at)) = p.tail.take() else {
            return;
        };
        match reg {
            Some(r) if at.is_some() && !self.by_reg.contains_key(&r) => self.key(r, slot),
            _ => self.free.push(slot),
        }
    }

    /// Forgets `seq` (ended, cancelled or preempted): its tail is freed.
    pub fn forget(&mut self, seq: SeqId) {
        if let Some(p) = self.plans.remove(&seq) {
            if let Some((slot, _)) = p.tail {
                self.free.push(slot);
            }
        }
    }

    /// Verifies the invariants; the first breach, described.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        let tails = self.plans.values().filter_map(|p| p.tail.map(|t| t.0));
        let keyed = self.by_reg.values().map(|e| e.slot);
        for s in self.free.iter().copied().chain(tails).chain(keyed) {
            if !seen.insert(s) {
                return Err(format!("checkpoint slot {s} is in two places"));
            }
        }
        if seen.len() != self.total {
            return Err(format!(
                "{} of {} checkpoint slots accounted for",
                seen.len(),
                self.total
            ));
        }
        if self.lru.len() != self.by_reg.len()
            || self
                .lru
                .iter()
                .any(|(t, r)| self.by_reg.get(r).map(|e| e.used) != Some(*t))
        {
            return Err("the LRU order and the keyed checkpoints disagree".into());
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "checkpoint_tests.rs"]
mod tests;
