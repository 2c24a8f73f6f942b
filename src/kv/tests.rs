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
