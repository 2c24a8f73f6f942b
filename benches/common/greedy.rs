//! Greedy batch-1 decoding shared by the benches: a prompt, then `n`
//! tokens, each forward timed.

// Each bench includes this file as its own module and reads only some of
// the fields.
#![allow(dead_code)]

use specgate_verify::model::Model;
use specgate_verify::sample::argmax;
use specgate_verify::{KvPool, LogitsWanted};
use std::time::Instant;

/// What [`greedy`] did and how long it took.
pub struct Greedy {
    /// The decoded tokens.
    pub tokens: Vec<u32>,
    /// Milliseconds of each decode forward, in order.
    pub ms: Vec<f64>,
    /// Seconds of the prompt's forward.
    pub prefill_secs: f64,
    /// Seconds of the whole decode loop.
    pub decode_secs: f64,
}

/// Prefills `prompt` at position 0 of the sequence with block table
/// `table` in `pool`, then decodes `n` tokens greedily.
///
/// Panics if a forward fails (the table must hold `prompt.len() + n`
/// positions).
pub fn greedy(model: &Model, pool: &mut KvPool, table: &[u32], prompt: &[u32], n: usize) -> Greedy {
    let t = Instant::now();
    let mut logits = model
        .forward_one(pool, prompt, 0, table, LogitsWanted::Last)
        .expect("prefill")
        .remove(0);
    let prefill_secs = t.elapsed().as_secs_f64();
    let (mut tokens, mut ms) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let start = Instant::now();
    for i in 0..n {
        let next = argmax(&logits);
        tokens.push(next);
        let t = Instant::now();
        logits = model
            .forward_one(pool, &[next], prompt.len() + i, table, LogitsWanted::Last)
            .expect("decode")
            .remove(0);
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Greedy {
        tokens,
        ms,
        prefill_secs,
        decode_secs: start.elapsed().as_secs_f64(),
    }
}
