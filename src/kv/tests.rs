//! Block manager tests: exact bookkeeping and randomized operation
//! sequences checked against the invariants after every step.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[test]
fn allocate_reserve_trim_free() {
    let mut m = BlockManager::new(8, 4);
    m.allocate(1, 5).unwrap();
    assert_eq!(m.table(1).unwrap(), &[0, 1]);
    m.reserve(1, 5 + 4).unwrap(); // k + 1 = 4 lookahead slots
    assert_eq!(m.capacity(1), 12);
    m.trim(1, 6).unwrap(); // one draft accepted + the correction
    assert_eq!(m.table(1).unwrap().len(), 2);
    assert_eq!(m.num_free(), 6);
    assert_eq!(
        m.allocate(2, 100),
        Err(KvError::OutOfBlocks {
            needed: 25,
            free: 6
        })
    );
    assert_eq!(m.allocate(1, 1), Err(KvError::AlreadyAllocated(1)));
    assert_eq!(m.reserve(9, 1), Err(KvError::UnknownSequence(9)));
    m.free(1);
    m.free(1);
    assert_eq!(m.num_free(), 8);
    m.check_invariants().unwrap();
}

#[test]
fn failed_reserve_changes_nothing() {
    let mut m = BlockManager::new(3, 2);
    m.allocate(1, 4).unwrap();
    assert!(m.reserve(1, 10).is_err());
    assert_eq!(m.table(1).unwrap().len(), 2);
    assert_eq!(m.num_free(), 1);
    m.check_invariants().unwrap();
}

/// Thousands of speculative accept/reject cycles: reserve k + 1 lookahead
/// slots, accept a random prefix, trim; no slot leaks.
#[test]
fn speculation_cycles_leak_nothing() {
    let mut rng = StdRng::seed_from_u64(42);
    let mut m = BlockManager::new(64, 16);
    let mut lens = [0usize; 4];
    for (i, len) in lens.iter_mut().enumerate() {
        *len = rng.random_range(1..40);
        m.allocate(i as u64, *len).unwrap();
    }
    for _ in 0..5000 {
        let s = rng.random_range(0..4);
        let k = rng.random_range(0..=8);
        if lens[s] >= 180 {
            // Long enough: finish the sequence and start another in its place.
            m.free(s as u64);
            lens[s] = rng.random_range(1..40);
            m.allocate(s as u64, lens[s]).unwrap();
        }
        // 4 sequences of < 180 + 9 slots need at most 48 of the 64 blocks.
        m.reserve(s as u64, lens[s] + k + 1).unwrap();
        let accepted = rng.random_range(0..=k);
        lens[s] += accepted + 1;
        m.trim(s as u64, lens[s]).unwrap();
        assert_eq!(m.table(s as u64).unwrap().len(), lens[s].div_ceil(16));
        m.check_invariants().unwrap();
    }
    for s in 0..4 {
        m.free(s);
    }
    assert_eq!(m.num_free(), 64);
    m.check_invariants().unwrap();
}

/// Random admit / append / trim / preempt / cancel / finish, many seeds.
#[test]
fn randomized_operations_keep_invariants() {
    for seed in 0..200 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut m = BlockManager::new(rng.random_range(1..40), rng.random_range(1..9));
        let mut live: Vec<(SeqId, usize)> = Vec::new();
        let mut next_id = 0;
        for _ in 0..300 {
            match rng.random_range(0..6) {
                0 => {
                    let len = rng.random_range(1..50);
                    if m.allocate(next_id, len).is_ok() {
                        live.push((next_id, len));
                    }
                    next_id += 1;
                }
                1 | 2 if !live.is_empty() => {
                    let i = rng.random_range(0..live.len());
                    let (id, len) = live[i];
                    let grow = rng.random_range(1..12);
                    if m.reserve(id, len + grow).is_ok() {
                        let kept = rng.random_range(1..=grow);
                        m.trim(id, len + kept).unwrap();
                        live[i].1 = len + kept;
                    }
                }
                3..=5 if !live.is_empty() => {
                    // finish, cancel or preempt: all free the blocks
                    let i = rng.random_range(0..live.len());
                    m.free(live.swap_remove(i).0);
                }
                _ => {}
            }
            m.check_invariants()
                .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            for &(id, len) in &live {
                assert!(m.capacity(id) >= len, "seed {seed}: table too short");
            }
        }
        for (id, _) in live {
            m.free(id);
        }
        assert_eq!(m.num_free(), m.num_blocks(), "seed {seed}: leaked blocks");
    }
}

#[test]
fn prefix_blocks_are_shared_and_evicted_lru_only_when_dry() {
    let mut m = BlockManager::new(6, 4);
    let system: Vec<u32> = (0..8).collect(); // two full blocks
    let a: Vec<u32> = system.iter().copied().chain([100, 101]).collect();
    assert_eq!(m.allocate_cached(1, &a, a.len() - 1).unwrap(), 0);
    m.register(1, &a, a.len() - 1);
    let b: Vec<u32> = system.iter().copied().chain([200]).collect();
    // Both full blocks of the shared prefix are reused.
    assert_eq!(m.allocate_cached(2, &b, b.len() - 1).unwrap(), 8);
    assert_eq!(m.table(2).unwrap()[..2], m.table(1).unwrap()[..2]);
    assert_eq!(
        m.prefix_stats(),
        PrefixStats {
            queries: 9 + 8,
            hits: 8
        }
    );
    m.check_invariants().unwrap();
    // A different second block: only the first is shared.
    let c: Vec<u32> = (0..4).chain(50..55).collect();
    assert_eq!(m.allocate_cached(3, &c, c.len() - 1).unwrap(), 4);
    m.free(1);
    m.free(2);
    m.free(3);
    // Everything is available again, the prefix still cached.
    assert_eq!(m.num_free(), 6);
    m.check_invariants().unwrap();
    assert_eq!(m.allocate_cached(4, &b, b.len() - 1).unwrap(), 8);
    m.free(4);
    // Filling the pool evicts cached blocks; afterwards the prefix is gone.
    m.allocate(5, 24).unwrap();
    m.check_invariants().unwrap();
    m.free(5);
    assert_eq!(m.allocate_cached(6, &b, b.len() - 1).unwrap(), 0);
}

/// A deliberately weak hasher: SipHash with fixed keys cut to 4 bits, so
/// chain hashes collide often and predictably. Stands in for a crafted
/// collision against an unkeyed hash.
#[derive(Clone, Copy)]
struct FourBits;

struct FourBitsHasher(std::hash::DefaultHasher);

impl Hasher for FourBitsHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }
    fn finish(&self) -> u64 {
        self.0.finish() & 0xf
    }
}

impl BuildHasher for FourBits {
    type Hasher = FourBitsHasher;
    fn build_hasher(&self) -> FourBitsHasher {
        FourBitsHasher(std::hash::DefaultHasher::new())
    }
}

/// Block `y` cached after block `x` must not be handed to a prompt that
/// starts with `y`, even when the chain hashes collide: its K/V was computed
/// after `x`. The legitimate chain is still shared.
#[test]
fn a_colliding_block_with_another_parent_is_not_shared() {
    let mut m = BlockManager::with_hasher(8, 1, FourBits);
    let y = 7;
    // A first block x whose chain hash makes [x, y] collide with [y].
    let x = (100..10_000)
        .find(|&x| {
            let hx = m.chain_hash(0, &[x]);
            let hxy = m.chain_hash(hx, &[y]);
            hxy == m.chain_hash(0, &[y]) && hx != hxy
        })
        .expect("4-bit hashes collide");
    m.allocate_cached(1, &[x, y, 1], 2).unwrap();
    m.register(1, &[x, y, 1], 2);
    let y_after_x = m.table(1).unwrap()[1];
    // Same tokens in the block, another parent (none): no hit.
    assert_eq!(m.allocate_cached(2, &[y, 2], 1).unwrap(), 0);
    assert!(!m.table(2).unwrap().contains(&y_after_x));
    // The real chain still hits both blocks.
    assert_eq!(m.allocate_cached(3, &[x, y, 3], 2).unwrap(), 2);
    assert_eq!(m.table(3).unwrap()[1], y_after_x);
    m.check_invariants().unwrap();
}

/// Each manager keys its hash afresh, so a client cannot compute (and
/// collide) chain hashes offline.
#[test]
fn chain_hashes_are_keyed() {
    let (a, b) = (BlockManager::new(1, 4), BlockManager::new(1, 4));
    let block = [1, 2, 3, 4];
    assert_ne!(a.chain_hash(0, &block), b.chain_hash(0, &block));
}

#[test]
fn hash_collisions_cannot_share_wrong_tokens() {
    let mut m = BlockManager::new(4, 2);
    m.allocate_cached(1, &[1, 2, 3], 2).unwrap();
    m.register(1, &[1, 2, 3], 2);
    // Same length, other tokens: no hit.
    assert_eq!(m.allocate_cached(2, &[1, 3, 3], 2).unwrap(), 0);
}

/// Random sequences sharing prompt prefixes, registered as they compute,
/// freed in random order: invariants hold after every operation and the
/// pool returns to idle.
#[test]
fn randomized_prefix_caching_keeps_invariants() {
    for seed in 0..100 {
        let mut rng = StdRng::seed_from_u64(1000 + seed);
        let bs = rng.random_range(1..6);
        let mut m = BlockManager::new(rng.random_range(4..30), bs);
        let prefixes: Vec<Vec<u32>> = (0..3)
            .map(|p| (0..rng.random_range(0..20)).map(|i| p * 1000 + i).collect())
            .collect();
        let mut live: Vec<(SeqId, Vec<u32>)> = Vec::new();
        for id in 0..200u64 {
            if rng.random_bool(0.55) || live.is_empty() {
                let mut toks = prefixes[rng.random_range(0..3)].clone();
                toks.extend((0..rng.random_range(1..10)).map(|_| rng.random_range(5000..5010)));
                let n = toks.len();
                if let Ok(hit) = m.allocate_cached(id, &toks, n - 1) {
                    assert!(hit < n && hit % bs == 0);
                    m.register(id, &toks, n - 1);
                    live.push((id, toks));
                }
            } else {
                let i = rng.random_range(0..live.len());
                m.free(live.swap_remove(i).0);
            }
            m.check_invariants()
                .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
        for (id, _) in live {
            m.free(id);
        }
        assert_eq!(m.num_free(), m.num_blocks(), "seed {seed}: leaked blocks");
        m.check_invariants().unwrap();
    }
}

/// With a hash that collides all the time, random prompts from a tiny
/// alphabet (so equal blocks follow different prefixes) never get a block
/// whose K/V was computed from another prefix than their own.
#[test]
fn colliding_hashes_never_share_a_block_computed_from_another_prefix() {
    for seed in 0..100 {
        let mut rng = StdRng::seed_from_u64(5000 + seed);
        let bs = rng.random_range(1..4);
        let n_blocks = rng.random_range(4..40);
        let mut m = BlockManager::with_hasher(n_blocks, bs, FourBits);
        // The tokens each block's K/V was computed from (the whole prefix).
        let mut computed_from: Vec<Vec<u32>> = vec![Vec::new(); n_blocks];
        let mut live: Vec<SeqId> = Vec::new();
        for id in 0..200u64 {
            if rng.random_bool(0.5) || live.is_empty() {
                let len = rng.random_range(2..14);
                let toks: Vec<u32> = (0..len).map(|_| rng.random_range(0..3)).collect();
                let Ok(hit) = m.allocate_cached(id, &toks, len - 1) else {
                    continue;
                };
                let table = m.table(id).unwrap().to_vec();
                for (i, &b) in table.iter().enumerate().take(hit / bs) {
                    assert_eq!(
                        computed_from[b as usize],
                        toks[..(i + 1) * bs],
                        "seed {seed}: block {b} shared with another prefix"
                    );
                }
                for (i, &b) in table.iter().enumerate().take((len - 1) / bs).skip(hit / bs) {
                    computed_from[b as usize] = toks[..(i + 1) * bs].to_vec();
                }
                m.register(id, &toks, len - 1);
                live.push(id);
            } else {
                let i = rng.random_range(0..live.len());
                m.free(live.swap_remove(i));
            }
            m.check_invariants()
                .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
    }
}

/// Blocks registered in one cache scope (an API key, a `cache_salt`) are
/// found only in that scope, even when the two scopes' chain hashes
/// collide; within a scope they are shared as before.
#[test]
fn cache_scopes_share_nothing_across_and_everything_within() {
    let mut m = BlockManager::with_hasher(16, 2, FourBits);
    let prompt: Vec<u32> = (0..7).collect();
    // Two scopes whose first-block hashes collide (4-bit hashes).
    let a = 11;
    let b = (12..10_000)
        .find(|&s| m.chain_hash(s, &prompt[..2]) == m.chain_hash(a, &prompt[..2]))
        .expect("4-bit hashes collide");
    assert_eq!(m.allocate_scoped(1, &prompt, 6, a).unwrap(), 0);
    m.register(1, &prompt, 6);
    assert_eq!(
        m.allocate_scoped(2, &prompt, 6, b).unwrap(),
        0,
        "crossed scopes"
    );
    assert_eq!(
        m.allocate_cached(3, &prompt, 6).unwrap(),
        0,
        "reached scope 0"
    );
    assert_eq!(
        m.allocate_scoped(4, &prompt, 6, a).unwrap(),
        6,
        "same scope"
    );
    m.register(2, &prompt, 6);
    m.check_invariants().unwrap();
    for id in 1..=4 {
        m.free(id);
    }
    m.check_invariants().unwrap();
    // Scope `a`'s blocks stay cached for `a` alone.
    assert_eq!(m.allocate_scoped(5, &prompt, 6, b).unwrap(), 0);
    assert_eq!(m.allocate_scoped(6, &prompt, 6, a).unwrap(), 6);
    m.free(5);
    m.free(6);
    assert_eq!(m.num_free(), m.num_blocks());
}
