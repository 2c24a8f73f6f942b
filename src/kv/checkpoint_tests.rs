//! The block manager with a hybrid target's checkpoints: hits clamped to
//! checkpointed boundaries, save points, tails, eviction with blocks and
//! by LRU, scopes.

use super::*;
use crate::kv::BlockManager;

const BS: usize = 4;

/// A manager of `blocks` blocks with `ckpts` checkpoint slots (numbered
/// from 100).
fn manager(blocks: usize, ckpts: usize) -> BlockManager {
    let mut bm = BlockManager::new(blocks, BS);
    bm.attach_checkpoints(Checkpoints::new(100, ckpts, 64, BS));
    bm
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 3 + salt).collect()
}

/// Runs `seq`'s whole prompt through a prefill as the engine would: chunk
/// ends cut at save points, blocks registered, checkpoints saved. Returns
/// the checkpoint slots saved, in order.
fn prefill(bm: &mut BlockManager, seq: SeqId, tokens: &[u32], from: usize) -> Vec<u32> {
    let mut computed = from;
    let mut saved = Vec::new();
    while computed < tokens.len() - 1 {
        let mut n = (tokens.len() - 1 - computed).min(5);
        if let Some(stop) = bm.next_stop(seq, computed) {
            n = n.min(stop - computed);
        }
        computed += n;
        bm.register(seq, tokens, computed);
        saved.extend(bm.save_point(seq, computed));
    }
    saved
}

fn admit(bm: &mut BlockManager, seq: SeqId, tokens: &[u32], scope: u64) -> (usize, Option<u32>) {
    let hit = bm
        .allocate_scoped(seq, tokens, tokens.len() - 1, scope)
        .unwrap();
    let restore = bm.checkpoints_mut().unwrap().take_restore(seq);
    (hit, restore)
}

#[test]
fn a_hit_needs_a_checkpoint_at_its_boundary() {
    let mut bm = manager(32, 8);
    let a = toks(23, 0);
    assert_eq!(admit(&mut bm, 1, &a, 0), (0, None));
    // The prompt's last full boundary before its last token: 20.
    assert_eq!(bm.next_stop(1, 0), Some(20));
    let saved = prefill(&mut bm, 1, &a, 0);
    assert_eq!(saved.len(), 1);
    bm.free(1);
    // The same prompt and more: resumes at 20 from that checkpoint.
    let mut b = a.clone();
    b.extend(toks(9, 1000));
    assert_eq!(admit(&mut bm, 2, &b, 0), (20, Some(saved[0])));
    assert_eq!(bm.checkpoints_mut().unwrap().take_restore(2), None, "once");
    let s = bm.checkpoints().unwrap().stats();
    assert_eq!((s.hits, s.misses, s.saves), (1, 1, 1));
    bm.check_invariants().unwrap();
}

#[test]
fn blocks_past_the_deepest_checkpoint_are_not_a_hit_and_their_end_is_saved() {
    let mut bm = manager(32, 8);
    let a = toks(23, 0);
    admit(&mut bm, 1, &a, 0);
    // Registered without saving (the checkpoint of a sibling evicted, say).
    bm.register(1, &a, 22);
    bm.free(1);
    let mut b = a[..20].to_vec();
    b.extend(toks(10, 500));
    // 5 blocks match, none has a checkpoint: no hit; the branch point (20)
    // and the prompt end (28) become save points.
    assert_eq!(admit(&mut bm, 2, &b, 0), (0, None));
    assert_eq!(bm.next_stop(2, 0), Some(20));
    assert_eq!(bm.next_stop(2, 20), Some(28));
    let saved = prefill(&mut bm, 2, &b, 0);
    assert_eq!(saved.len(), 2);
    bm.free(2);
    // The next sibling resumes at the branch point.
    let mut c = a[..20].to_vec();
    c.extend(toks(7, 900));
    assert_eq!(admit(&mut bm, 3, &c, 0), (20, Some(saved[0])));
    bm.check_invariants().unwrap();
}

#[test]
fn another_scope_never_finds_a_checkpoint() {
    let mut bm = manager(32, 8);
    let a = toks(23, 0);
    admit(&mut bm, 1, &a, 7);
    prefill(&mut bm, 1, &a, 0);
    bm.free(1);
    assert_eq!(admit(&mut bm, 2, &a, 8), (0, None));
    bm.free(2);
    assert_eq!(admit(&mut bm, 3, &a, 7).0, 20);
    bm.check_invariants().unwrap();
}

#[test]
fn a_checkpoint_goes_with_its_block_and_the_least_recent_goes_first() {
    // Two checkpoint slots, few blocks.
    let mut bm = manager(8, 2);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| toks(9, 100 * i)).collect();
    for (i, p) in prompts.iter().enumerate() {
        admit(&mut bm, i as u64, p, 0);
        assert_eq!(prefill(&mut bm, i as u64, p, 0).len(), 1);
        bm.free(i as u64);
    }
    // The third save evicted the first prompt's checkpoint (LRU).
    let s = bm.checkpoints().unwrap().stats();
    assert_eq!((s.saves, s.evictions, s.held), (3, 1, 2));
    assert_eq!(admit(&mut bm, 10, &prompts[0], 0).0, 0);
    bm.free(10);
    assert_eq!(admit(&mut bm, 11, &prompts[2], 0).0, 8);
    bm.free(11);
    // A sequence that needs every block evicts the cached ones, and their
    // checkpoints with them.
    bm.allocate(12, 8 * BS).unwrap();
    assert_eq!(bm.checkpoints().unwrap().stats().held, 0);
    bm.check_invariants().unwrap();
    bm.free(12);
    assert_eq!(admit(&mut bm, 13, &prompts[2], 0).0, 0);
    bm.check_invariants().unwrap();
}

#[test]
fn a_tail_is_keyed_at_the_end_of_its_request() {
    let mut bm = manager(32, 4);
    let mut a = toks(10, 0);
    admit(&mut bm, 1, &a, 0);
    prefill(&mut bm, 1, &a, 0);
    // Decoding: the state passes boundary 12, then 16.
    let tail = bm.checkpoints_mut().unwrap().tail_for(1).unwrap();
    assert_eq!(bm.checkpoints_mut().unwrap().tail_for(1), Some(tail));
    a.extend(toks(9, 50));
    bm.reserve(1, a.len()).unwrap();
    bm.checkpoints_mut().unwrap().tail_saved(1, 12);
    bm.checkpoints_mut().unwrap().tail_saved(1, 16);
    bm.register(1, &a, a.len() - 1);
    bm.commit_tail(1);
    bm.check_invariants().unwrap();
    bm.free(1);
    // The next turn: the answer fed back, then more.
    let mut b = a.clone();
    b.extend(toks(6, 700));
    assert_eq!(admit(&mut bm, 2, &b, 0), (16, Some(tail)));
    bm.check_invariants().unwrap();
}

#[test]
fn a_tail_never_saved_or_of_an_ended_sequence_is_freed() {
    let mut bm = manager(32, 4);
    let a = toks(10, 0);
    admit(&mut bm, 1, &a, 0);
    bm.checkpoints_mut().unwrap().tail_for(1).unwrap();
    bm.commit_tail(1);
    assert_eq!(bm.checkpoints().unwrap().bytes_in_use(), 0);
    bm.checkpoints_mut().unwrap().tail_for(1).unwrap();
    bm.free(1);
    assert_eq!(bm.checkpoints().unwrap().bytes_in_use(), 0);
    // Two keyed checkpoints and two free slots: tails take the free ones,
    // then no more (half the slots stay with finished prompts).
    for seq in 0..2 {
        let p = toks(10, seq as u32 * 100);
        admit(&mut bm, seq, &p, 0);
        assert_eq!(prefill(&mut bm, seq, &p, 0).len(), 1);
        bm.free(seq);
    }
    for seq in 10..13 {
        admit(&mut bm, seq, &toks(10, seq as u32 * 1000), 0);
    }
    let c = bm.checkpoints_mut().unwrap();
    assert!(c.tail_for(10).is_some() && c.tail_for(11).is_some());
    assert_eq!(c.tail_for(12), None);
    assert_eq!(c.stats().held, 2);
    bm.check_invariants().unwrap();
}
