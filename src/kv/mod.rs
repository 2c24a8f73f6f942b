//! KV block bookkeeping for the whole engine: block ids, the free list, and
//! per-sequence block tables. The tables are used by BOTH the draft's and
//! the target's caches (the physical storage lives in
//! `specgate_verify::KvPool`, indexed by these ids). No tensors here.
//!
//! A sequence's table covers its *capacity* in token slots: the committed
//! tokens plus whatever lookahead was reserved for speculation. After
//! verification the table is trimmed back to what was accepted, returning
//! whole blocks to the free list.
//!
//! Automatic prefix caching: once a block is full of computed tokens it is
//! registered under a hash of its whole token chain (parent hash + its own
//! tokens). A new sequence whose prompt starts with registered blocks
//! shares them (reference-counted) and skips that prefill. A registered
//! block whose last reference goes away stays cached, evictable; it is
//! evicted least-recently-released first, and only when the free list is dry.
//!
//! A block's K/V depends on every token before it, so the hash only finds
//! a candidate: a block is handed out only if its own tokens AND its parent
//! (the cached block before it in the chain, by registration) match. By
//! induction from the first block, the whole prefix its K/V was computed
//! from is then the new prompt's, so a hash collision costs a cache miss,
//! never K/V computed from another user's text. The hash is also keyed per
//! manager (std's `RandomState`), so a client cannot craft colliding
//! prompts to make other users miss.
//!
//! Each sequence carries a cache scope (see [`BlockManager::allocate_scoped`]):
//! a block is found only by sequences of the scope that registered it, so
//! neither the hit counters nor the time to first token tell one tenant
//! (API key, or `cache_salt`) which prompts another sent. The scope seeds
//! the chain hash and is compared on every lookup, so even a colliding hash
//! never crosses scopes.
//!
//! A hybrid target (recurrent layers beside attention) also needs the
//! recurrent state at the boundary a hit resumes from: with
//! [`BlockManager::attach_checkpoints`], hits are clamped to boundaries
//! that have a state checkpoint ([`checkpoints`]), and the checkpoint
//! plan of each sequence lives beside its blocks. Which recurrent-state
//! slot each running sequence holds is [`slots::StateSlots`].

pub mod checkpoints;
pub mod row_states;
pub mod slots;

pub use checkpoints::{CheckpointStats, Checkpoints};
pub use slots::StateSlots;

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher, RandomState};

/// Identifies a sequence to the block manager.
pub type SeqId = u64;

/// Errors of block bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("out of KV blocks: need {needed}, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("sequence {0} already has blocks")]
    AlreadyAllocated(SeqId),
    #[error("sequence {0} has no blocks")]
    UnknownSequence(SeqId),
}

/// The registration standing for "no block": the parent of a chain's
/// first block. Real registrations are numbered from 1.
const ROOT: u64 = 0;

/// Where one block of a sequence stands in the prefix cache.
#[derive(Debug, Clone, Copy)]
struct Link {
    /// Chain hash of the sequence's tokens up to the end of this block.
    hash: u64,
    /// The registration holding exactly this chain: this block's own, or an
    /// identical block's that another sequence registered first. `None`
    /// when a colliding block holds the hash: then neither this block nor
    /// any later one of the sequence can be reached, so none is registered.
    reg: Option<u64>,
}

/// One sequence's blocks and the cache links of its registered prefix.
#[derive(Default)]
struct SeqBlocks {
    blocks: Vec<u32>,
    /// `links[i]` for `blocks[i]`, for each block registration has seen.
    links: Vec<Link>,
    /// The cache scope its blocks are found in and registered under.
    scope: u64,
}

/// What a registered block holds.
struct Cached {
    hash: u64,
    tokens: Box<[u32]>,
    /// The registration of the block before it in its chain ([`ROOT`] for
    /// a first block). A registration number rather than a block id: block
    /// ids are reused after eviction, registration numbers never are, so a
    /// parent that was evicted (and its id refilled) matches nothing.
    parent: u64,
    /// This registration's number, unique for the manager's lifetime.
    reg: u64,
    /// The cache scope of the sequence that registered it.
    scope: u64,
}

/// Prefix-cache counters, in tokens (as vLLM counts them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompt tokens looked up in the cache.
    pub queries: u64,
    /// Of those, tokens found cached (their prefill skipped).
    pub hits: u64,
}

/// Owner of every block id of one pool.
///
/// Invariants (checked by [`BlockManager::check_invariants`]): every block
/// is in exactly one state: free (count 0, not registered), evictable
/// (count 0, registered), or owned (count = the number of tables holding
/// it); the hash index points exactly at the registered blocks.
pub struct BlockManager<S = RandomState> {
    hasher: S,
    block_size: usize,
    free: Vec<u32>,
    ref_counts: Vec<u32>,
    tables: HashMap<SeqId, SeqBlocks>,
    cached: Vec<Option<Cached>>,
    by_hash: HashMap<u64, u32>,
    /// Unreferenced registered blocks by release time (oldest first).
    evictable: BTreeMap<u64, u32>,
    released_at: Vec<u64>,
    clock: u64,
    /// The last registration number handed out.
    last_reg: u64,
    stats: PrefixStats,
    /// Off by the user's choice: no lookup matches and nothing is
    /// registered.
    prefix_caching: bool,
    /// For a hybrid target: the recurrent-state checkpoints a hit needs.
    checkpoints: Option<Checkpoints>,
}

impl BlockManager {
    /// A manager of `num_blocks` blocks of `block_size` token slots, its
    /// chain hashes keyed afresh.
    ///
    /// Panics: `block_size` is 0, or `num_blocks` does not fit a u32 block
    /// id.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self::with_hasher(num_blocks, block_size, RandomState::new())
    }
}

impl<S: BuildHasher> BlockManager<S> {
    /// Like [`BlockManager::new`], with `hasher` for the chain hashes.
    /// Sharing stays correct whatever `hasher` is (see the module doc); a
    /// weak or unkeyed one only lets collisions turn hits into misses.
    pub fn with_hasher(num_blocks: usize, block_size: usize, hasher: S) -> Self {
        assert!(block_size > 0, "block size must be positive");
        assert!(
            u32::try_from(num_blocks).is_ok(),
            "{num_blocks} blocks do not fit u32 block ids"
        );
        Self {
            hasher,
            block_size,
            // Reversed so blocks are handed out in ascending order.
            free: (0..num_blocks as u32).rev().collect(),
            ref_counts: vec![0; num_blocks],
            tables: HashMap::new(),
            cached: (0..num_blocks).map(|_| None).collect(),
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            clock: 0,
            last_reg: ROOT,
            stats: PrefixStats::default(),
            prefix_caching: true,
            checkpoints: None,
        }
    }

    /// Makes this the cache of a hybrid target: a prefix hit is clamped to
    /// the deepest matched boundary with a checkpoint in `c`, and each
    /// admitted sequence gets a checkpoint plan (restore, save points,
    /// tail; see [`checkpoints`]).
    pub fn attach_checkpoints(&mut self, c: Checkpoints) {
        self.checkpoints = Some(c);
    }

    /// The checkpoints, for a hybrid target.
    pub fn checkpoints(&self) -> Option<&Checkpoints> {
        self.checkpoints.as_ref()
    }

    /// The checkpoints, for a hybrid target (to take restores, tails).
    pub fn checkpoints_mut(&mut self) -> Option<&mut Checkpoints> {
        self.checkpoints.as_mut()
    }

    /// The first save point of `seq` past `computed` (hybrid targets), where
    /// its prefill chunk must end.
    pub fn next_stop(&self, seq: SeqId, computed: usize) -> Option<usize> {
        self.checkpoints.as_ref()?.next_stop(seq, computed)
    }

    /// The registration of `seq`'s block that ends at token `boundary` (a
    /// multiple of the block size), if registration has linked it.
    pub fn reg_at(&self, seq: SeqId, boundary: usize) -> Option<u64> {
        let i = (boundary / self.block_size).checked_sub(1)?;
        if !boundary.is_multiple_of(self.block_size) {
            return None;
        }
        self.tables.get(&seq)?.links.get(i)?.reg
    }

    /// A checkpoint slot to copy `seq`'s state into, now that it has fed
    /// `computed` tokens: when `computed` is one of its save points and the
    /// block ending there is registered. The key is recorded now; the
    /// caller copies the state in (or drops the slot if it cannot).
    pub fn save_point(&mut self, seq: SeqId, computed: usize) -> Option<u32> {
        let reg = self.reg_at(seq, computed)?;
        let c = self.checkpoints.as_mut()?;
        if !c.is_stop(seq, computed) {
            return None;
        }
        c.save(reg)
    }

    /// At the end of `seq`'s request: keys the state its tail holds at a
    /// block boundary under that block's registration (see
    /// [`Checkpoints::commit_tail`]). Call after registering its blocks.
    pub fn commit_tail(&mut self, seq: SeqId) {
        let Some(at) = self.checkpoints.as_ref().and_then(|c| c.tail_boundary(seq)) else {
            if let Some(c) = self.checkpoints.as_mut() {
                c.commit_tail(seq, None);
            }
            return;
        };
        let reg = self.reg_at(seq, at);
        if let Some(c) = self.checkpoints.as_mut() {
            c.commit_tail(seq, reg);
        }
    }

    /// Turns prefix caching off for good: every allocation starts fresh.
    pub fn disable_prefix_caching(&mut self) {
        self.prefix_caching = false;
    }

    /// Whether prefix caching is on.
    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Prefix-cache counters so far.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.stats
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks available to new work: free plus evictable cached ones.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Fraction of blocks referenced by sequences, in [0, 1].
    pub fn usage(&self) -> f64 {
        if self.num_blocks() == 0 {
            return 0.0;
        }
        1.0 - self.num_free() as f64 / self.num_blocks() as f64
    }

    /// Blocks that hold `tokens` token slots.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// The sequence's block table, if it has one.
    pub fn table(&self, seq: SeqId) -> Option<&[u32]> {
        self.tables.get(&seq).map(|t| t.blocks.as_slice())
    }

    /// Token slots the sequence's table covers.
    pub fn capacity(&self, seq: SeqId) -> usize {
        self.tables
            .get(&seq)
            .map_or(0, |t| t.blocks.len() * self.block_size)
    }

    /// Gives a new sequence a table covering `tokens` slots.
    ///
    /// Errors: the sequence already has blocks, or too few are free (then
    /// nothing changes).
    pub fn allocate(&mut self, seq: SeqId, tokens: usize) -> Result<(), KvError> {
        if self.tables.contains_key(&seq) {
            return Err(KvError::AlreadyAllocated(seq));
        }
        let needed = self.blocks_for(tokens);
        self.ensure_free(needed)?;
        let blocks = (0..needed).map(|_| self.take_free()).collect();
        self.tables.insert(
            seq,
            SeqBlocks {
                blocks,
                links: Vec::new(),
                scope: 0,
            },
        );
        Ok(())
    }

    /// The hash of a block holding `tokens` after a chain hashed `parent`.
    fn chain_hash(&self, parent: u64, tokens: &[u32]) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write_u64(parent);
        for &t in tokens {
            h.write_u32(t);
        }
        h.finish()
    }

    /// The registered block under `hash` if it holds `tokens` after the
    /// registration `parent` in `scope`, with its registration.
    fn lookup(&self, hash: u64, tokens: &[u32], parent: u64, scope: u64) -> Option<(u32, u64)> {
        let &b = self.by_hash.get(&hash)?;
        let c = self.cached[b as usize].as_ref()?;
        (*c.tokens == *tokens && c.parent == parent && c.scope == scope).then_some((b, c.reg))
    }

    /// [`BlockManager::allocate_scoped`] in the shared scope 0.
    ///
    /// Errors: as `allocate`; nothing changes then.
    pub fn allocate_cached(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        cacheable: usize,
    ) -> Result<usize, KvError> {
        self.allocate_scoped(seq, tokens, cacheable, 0)
    }

    /// Like [`BlockManager::allocate`] for a sequence whose first tokens are
    /// `tokens`, reusing blocks registered in `scope` for its longest cached
    /// prefix of full blocks within `tokens[..cacheable]`; the blocks it
    /// registers later are found only in `scope` too. Returns how many
    /// tokens that prefix covers (their K/V is already in the pool). Counts
    /// the lookup in [`PrefixStats`].
    ///
    /// Errors: as `allocate`; nothing changes then.
    pub fn allocate_scoped(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        cacheable: usize,
        scope: u64,
    ) -> Result<usize, KvError> {
        if self.tables.contains_key(&seq) {
            return Err(KvError::AlreadyAllocated(seq));
        }
        let bs = self.block_size;
        let cacheable = if self.prefix_caching { cacheable } else { 0 };
        let (mut matched, mut links) = (Vec::new(), Vec::new());
        let (mut parent_hash, mut parent) = (scope, ROOT);
        for chunk in tokens[..cacheable.min(tokens.len())].chunks_exact(bs) {
            let hash = self.chain_hash(parent_hash, chunk);
            let Some((b, reg)) = self.lookup(hash, chunk, parent, scope) else {
                break;
            };
            matched.push(b);
            links.push(Link {
                hash,
                reg: Some(reg),
            });
            (parent_hash, parent) = (hash, reg);
        }
        // A hybrid target's hit stops at the deepest checkpoint.
        let regs: Vec<u64> = links.iter().filter_map(|l| l.reg).collect();
        let clamped = self.checkpoints.as_ref().map(|c| c.clamp(&regs));
        if let Some(c) = clamped {
            matched.truncate(c.blocks);
            links.truncate(c.blocks);
        }
        let fresh = self.blocks_for(tokens.len()).saturating_sub(matched.len());
        let pinned_evictable = matched
            .iter()
            .filter(|&&b| self.ref_counts[b as usize] == 0)
            .count();
        if fresh + pinned_evictable > self.num_free() {
            return Err(KvError::OutOfBlocks {
                needed: fresh,
                free: self.num_free() - pinned_evictable,
            });
        }
        for &b in &matched {
            if self.ref_counts[b as usize] == 0 {
                self.evictable.remove(&self.released_at[b as usize]);
            }
            self.ref_counts[b as usize] += 1;
        }
        if let (Some(cp), Some(c)) = (self.checkpoints.as_mut(), clamped) {
            cp.plan_admission(seq, &regs, c, tokens.len(), cacheable >= bs);
        }
        let mut blocks = matched;
        let hit_tokens = blocks.len() * bs;
        blocks.extend((0..fresh).map(|_| self.take_free()));
        self.tables.insert(
            seq,
            SeqBlocks {
                blocks,
                links,
                scope,
            },
        );
        self.stats.queries += cacheable as u64;
        self.stats.hits += hit_tokens as u64;
        Ok(hit_tokens)
    }

    /// Registers the sequence's full blocks within its first `computed`
    /// tokens (whose K/V the pool now holds) for reuse by later sequences.
    /// `tokens` are the sequence's tokens.
    pub fn register(&mut self, seq: SeqId, tokens: &[u32], computed: usize) {
        if !self.prefix_caching {
            return;
        }
        let bs = self.block_size;
        let Some(t) = self.tables.get_mut(&seq) else {
            return;
        };
        let full = (computed.min(tokens.len()) / bs).min(t.blocks.len());
        if t.links.len() >= full {
            return;
        }
        let mut links = std::mem::take(&mut t.links);
        let scope = t.scope;
        let fresh = t.blocks[links.len()..full].to_vec();
        for b in fresh {
            let i = links.len();
            let chunk = &tokens[i * bs..(i + 1) * bs];
            let (parent_hash, parent) = links
                .last()
                .map_or((scope, Some(ROOT)), |l| (l.hash, l.reg));
            let hash = self.chain_hash(parent_hash, chunk);
            let reg = parent.and_then(|p| self.link(b, hash, chunk, p, scope));
            links.push(Link { hash, reg });
        }
        self.tables.get_mut(&seq).expect("found above").links = links;
    }

    /// The registration standing for block `b` holding `tokens` after the
    /// registration `parent`: its own (registering it now if the hash is
    /// free), or an identical block's registered first (two sequences that
    /// prefilled the same prompt at once). `None` when the hash is held by
    /// a block with other tokens or another parent.
    fn link(&mut self, b: u32, hash: u64, tokens: &[u32], parent: u64, scope: u64) -> Option<u64> {
        if let Some(c) = &self.cached[b as usize] {
            // Already registered: a prefix hit, or this sequence's own.
            let same =
                c.hash == hash && *c.tokens == *tokens && c.parent == parent && c.scope == scope;
            return same.then_some(c.reg);
        }
        if self.by_hash.contains_key(&hash) {
            return self.lookup(hash, tokens, parent, scope).map(|(_, reg)| reg);
        }
        self.last_reg += 1;
        self.cached[b as usize] = Some(Cached {
            hash,
            tokens: tokens.into(),
            parent,
            reg: self.last_reg,
            scope,
        });
        self.by_hash.insert(hash, b);
        Some(self.last_reg)
    }

    /// Grows the sequence's table to cover at least `tokens` slots (e.g. the
    /// committed tokens plus k + 1 lookahead slots for speculation).
    ///
    /// Errors: unknown sequence, or too few free blocks (nothing changes).
    pub fn reserve(&mut self, seq: SeqId, tokens: usize) -> Result<(), KvError> {
        let have = self
            .tables
            .get(&seq)
            .ok_or(KvError::UnknownSequence(seq))?
            .blocks
            .len();
        let needed = self.blocks_for(tokens).saturating_sub(have);
        self.ensure_free(needed)?;
        let new: Vec<u32> = (0..needed).map(|_| self.take_free()).collect();
        self.tables
            .get_mut(&seq)
            .expect("checked")
            .blocks
            .extend(new);
        Ok(())
    }

    /// Shrinks the sequence's table to the blocks that `tokens` slots need,
    /// freeing the rest (e.g. lookahead blocks of rejected drafts).
    pub fn trim(&mut self, seq: SeqId, tokens: usize) -> Result<(), KvError> {
        let keep = self.blocks_for(tokens);
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        if keep >= table.blocks.len() {
            return Ok(());
        }
        table.links.truncate(keep);
        let dropped: Vec<u32> = table.blocks.drain(keep..).collect();
        for b in dropped {
            self.release_block(b);
        }
        Ok(())
    }

    /// Frees every block of a finished, cancelled or preempted sequence.
    /// Freeing an unknown sequence is a no-op (idempotent cleanup).
    pub fn free(&mut self, seq: SeqId) {
        if let Some(c) = self.checkpoints.as_mut() {
            c.forget(seq);
        }
        if let Some(table) = self.tables.remove(&seq) {
            // Last blocks first: they are the least likely to be shared, so
            // they are evicted before the prefix that others can reuse.
            for b in table.blocks.into_iter().rev() {
                self.release_block(b);
            }
        }
    }

    fn ensure_free(&self, needed: usize) -> Result<(), KvError> {
        if needed > self.num_free() {
            return Err(KvError::OutOfBlocks {
                needed,
                free: self.num_free(),
            });
        }
        Ok(())
    }

    /// A free block, evicting the least recently released cached one when
    /// the free list is dry.
    fn take_free(&mut self) -> u32 {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first().expect("ensure_free checked");
                let c = self.cached[b as usize]
                    .take()
                    .expect("evictable blocks are cached");
                self.by_hash.remove(&c.hash);
                if let Some(cp) = self.checkpoints.as_mut() {
                    cp.drop_reg(c.reg);
                }
                b
            }
        };
        self.ref_counts[b as usize] = 1;
        b
    }

    fn release_block(&mut self, b: u32) {
        let rc = &mut self.ref_counts[b as usize];
        *rc -= 1;
        if *rc == 0 {
            if self.cached[b as usize].is_some() {
                self.clock += 1;
                self.released_at[b as usize] = self.clock;
                self.evictable.insert(self.clock, b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// Verifies the invariants; returns a description of the first breach.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut counted = vec![0u32; self.num_blocks()];
        for (seq, table) in &self.tables {
            for &b in &table.blocks {
                *counted
                    .get_mut(b as usize)
                    .ok_or(format!("sequence {seq} holds block {b} outside the pool"))? += 1;
            }
        }
        let mut on_free = vec![false; self.num_blocks()];
        for &b in &self.free {
            if std::mem::replace(&mut on_free[b as usize], true) {
                return Err(format!("block {b} is on the free list twice"));
            }
        }
        let mut on_evictable = vec![false; self.num_blocks()];
        for &b in self.evictable.values() {
            on_evictable[b as usize] = true;
            if self.cached[b as usize].is_none() {
                return Err(format!("evictable block {b} is not registered"));
            }
        }
        for (&h, &b) in &self.by_hash {
            if self.cached[b as usize].as_ref().map(|c| c.hash) != Some(h) {
                return Err(format!(
                    "hash index points at block {b}, which holds another hash"
                ));
            }
        }
        for (b, c) in self.cached.iter().enumerate() {
            if let Some(c) = c {
                // A parent registers before its children.
                if c.reg == ROOT || c.reg > self.last_reg || c.parent >= c.reg {
                    return Err(format!(
                        "block {b}: registration {} with parent {} out of order",
                        c.reg, c.parent
                    ));
                }
            }
        }
        if let Some(c) = &self.checkpoints {
            c.check_invariants()?;
        }
        let registered = self.cached.iter().filter(|c| c.is_some()).count();
        if registered != self.by_hash.len() {
            return Err("registered blocks and hash index disagree".into());
        }
        for b in 0..self.num_blocks() {
            let rc = self.ref_counts[b];
            if on_free[b] && self.cached[b].is_some() {
                return Err(format!("block {b} is free but registered"));
            }
            if (on_free[b] || on_evictable[b]) && (counted[b] > 0 || rc > 0) {
                return Err(format!("block {b} is both free and owned"));
            }
            if on_free[b] && on_evictable[b] {
                return Err(format!("block {b} is both free and evictable"));
            }
            if rc != counted[b] {
                return Err(format!(
                    "block {b}: reference count {rc}, tables hold it {} times",
                    counted[b]
                ));
            }
            if !on_free[b] && !on_evictable[b] && rc == 0 {
                return Err(format!("block {b} is neither free nor owned"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
