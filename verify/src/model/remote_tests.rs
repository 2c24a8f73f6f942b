//! Rank 0 leading and workers following, as threads over a `ThreadComm`
//! (the same protocol `mpirun` ranks run over MPI): the leader's logits
//! equal one unsharded model's through prefill, verification with
//! rejected rows and released state slots.

use super::*;
use crate::model::{load_safetensors, load_safetensors_shard};
use crate::tp::ThreadComm;
use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

/// A serving-like sequence of pool operations and forwards; every forward's
/// logits, in order.
fn script(model: &Model) -> Vec<Vec<Vec<f32>>> {
    let mut pool = KvPool::for_model(model, 16, 4).unwrap();
    let mut out = Vec::new();
    let mut fwd = |pool: &mut KvPool, seqs: &[SeqInput]| {
        out.push(model.forward_rows(pool, seqs).unwrap());
    };
    let seq = |tokens, start_pos, block_table, logits, state_slot| SeqInput {
        tokens,
        start_pos,
        block_table,
        logits,
        state_slot,
    };
    let (a, b): (&[u32], &[u32]) = (&[0, 1, 2, 3], &[4, 5, 6, 7]);
    fwd(
        &mut pool,
        &[seq(&[1, 5, 9, 20, 33, 7], 0, a, LogitsWanted::Last, 0)],
    );
    // Verify 4 rows, keep 2 (a rejected draft) in slot 0, next to a prefill.
    fwd(
        &mut pool,
        &[
            seq(&[11, 12, 13, 14], 6, a, LogitsWanted::All, 0),
            seq(&[3, 3, 8], 0, b, LogitsWanted::Last, 1),
        ],
    );
    // Only recurrent states roll back; per-token caches are overwritten.
    let recurrent = model.has_recurrent_state();
    if recurrent {
        pool.keep_rows(0, 2).unwrap();
    }
    fwd(
        &mut pool,
        &[
            seq(&[40, 41, 42], 8, a, LogitsWanted::All, 0),
            seq(&[9, 10], 3, b, LogitsWanted::All, 1),
        ],
    );
    if recurrent {
        pool.keep_rows(0, 3).unwrap();
        pool.keep_rows(1, 1).unwrap();
    }
    // Sequence b ends; its slot starts a new sequence from position 0.
    pool.release_state(1);
    fwd(
        &mut pool,
        &[
            seq(&[50], 11, a, LogitsWanted::Last, 0),
            seq(&[2, 4, 6, 8, 12], 0, b, LogitsWanted::All, 1),
        ],
    );
    out
}

fn max_rel_diff(a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let flat =
        |x: &[Vec<Vec<f32>>]| -> Vec<f32> { x.iter().flatten().flatten().copied().collect() };
    let (a, b) = (flat(a), flat(b));
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    d / scale.max(1e-6)
}

/// Runs [`script`] on rank 0 of `world` lone ranks (the rest run
/// [`serve_worker`] on threads) and returns rank 0's logits.
fn led(dir: &Path, world: usize) -> Vec<Vec<Vec<f32>>> {
    let mut comms = ThreadComm::group(world).unwrap().into_iter();
    let c0 = comms.next().unwrap();
    let workers: Vec<_> = comms
        .map(|c| {
            let dir = dir.to_path_buf();
            std::thread::spawn(move || {
                let mut m = load_safetensors_shard(&dir, Box::new(c)).unwrap();
                serve_worker(&mut m)
            })
        })
        .collect();
    let mut m = load_safetensors_shard(dir, Box::new(c0)).unwrap();
    m.lead().unwrap();
    let out = script(&m);
    // Dropping the leader stops the workers.
    drop(m);
    for w in workers {
        w.join().unwrap().unwrap();
    }
    out
}

#[test]
fn led_ranks_equal_world_1_for_k3_and_k2() {
    for dir in [fixture("kimi_k3/tiny-hf"), fixture("tiny-kimi")] {
        let single = script(&load_safetensors(&dir).unwrap());
        for world in [2, 4] {
            let l = led(&dir, world);
            let d = max_rel_diff(&single, &l);
            assert!(d < 1e-4, "{}: world {world} vs 1: {d}", dir.display());
        }
    }
}

#[test]
fn step_messages_round_trip_and_reject_garbage() {
    let seqs = [
        SeqInput {
            tokens: &[1, 2, 3],
            start_pos: 7,
            block_table: &[4, 5],
            logits: LogitsWanted::All,
            state_slot: 3,
        },
        SeqInput {
            tokens: &[9],
            start_pos: 0,
            block_table: &[],
            logits: LogitsWanted::None,
            state_slot: 0,
        },
    ];
    let ops = [
        PoolOp::KeepRows { slot: 3, rows: 2 },
        PoolOp::ReleaseState { slot: 1 },
    ];
    let msg = encode_step(5, &ops, &seqs);
    let mut r = Reader(&msg[1..]);
    let (pool, got_ops, got) = decode_step(&mut r).unwrap();
    assert_eq!((pool, got_ops.as_slice()), (5, &ops[..]));
    assert_eq!(got.len(), 2);
    assert_eq!(
        (
            &got[0].tokens[..],
            got[0].start_pos,
            &got[0].block_table[..]
        ),
        (&[1u32, 2, 3][..], 7, &[4u32, 5][..])
    );
    assert_eq!((got[0].logits, got[0].state_slot), (LogitsWanted::All, 3));
    assert_eq!(
        (got[1].logits, got[1].tokens.len()),
        (LogitsWanted::None, 1)
    );
    // Every truncation is an error, never a panic.
    for cut in 1..msg.len() {
        assert!(
            decode_step(&mut Reader(&msg[1..cut])).is_err(),
            "cut at {cut}"
        );
    }
}

#[test]
fn a_model_that_is_not_a_lone_rank_neither_leads_nor_serves() {
    let dir = fixture("tiny-kimi");
    let mut m = load_safetensors(&dir).unwrap();
    assert!(m.lead().is_err());
    assert!(serve_worker(&mut m).is_err());
}
