//! Kimi K3's hybrid cache on the tiny generated checkpoint
//! (tests/fixtures/kimi_k3/tiny-k3.gguf; random weights, so only costs mean
//! something): the verify pass at 1 and k + 1 rows, what keeping every
//! row's recurrent state costs against replaying the accepted rows from a
//! checkpoint (llama.cpp's server's rollback), and the state and latent
//! bytes the pool holds per sequence against the formula.
//!
//! Run: `cargo bench --bench k3`.

use specgate_verify::model::load_model;
use specgate_verify::{KvPool, LogitsWanted, Model, SeqInput};
use std::path::Path;
use std::time::Instant;

const REPS: usize = 200;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn forward(model: &Model, pool: &mut KvPool, tokens: &[u32], start: usize, logits: LogitsWanted) {
    let table: Vec<u32> = (0..8).collect();
    model
        .forward(
            pool,
            &[SeqInput {
                tokens,
                start_pos: start,
                block_table: &table,
                logits,
                state_slot: 0,
            }],
        )
        .unwrap();
}

/// Median microseconds of `f`, the sequence's state put back before each
/// run (outside the timing), so every run starts from the same point.
fn time(pool: &mut KvPool, mut f: impl FnMut(&mut KvPool)) -> f64 {
    let saved = pool.read_state(0).unwrap();
    let mut xs = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        pool.write_state(0, &saved).unwrap();
        let t = Instant::now();
        f(pool);
        xs.push(t.elapsed().as_secs_f64() * 1e6);
    }
    pool.write_state(0, &saved).unwrap();
    median(xs)
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = load_model(&root.join("tests/fixtures/kimi_k3/tiny-k3.gguf")).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 500) as u32 + 3).collect();
    let n = prompt.len();
    let mut pool = KvPool::for_model(&model, 8, 16).unwrap();
    forward(&model, &mut pool, &prompt[..n - 1], 0, LogitsWanted::None);
    let last = prompt[n - 1];
    println!(
        "tiny K3 (8 layers: 6 KDA + 2 MLA, hidden 64), verify pass at position {}",
        n - 1
    );
    println!("| rows | verify, per-row states kept (us) | same rows, no per-row states (us) |");
    println!("|---:|---:|---:|");
    let mut per_row = Vec::new();
    for k in [0usize, 1, 3, 7] {
        let rows: Vec<u32> = std::iter::once(last)
            .chain((0..k as u32).map(|i| 100 + i))
            .collect();
        let kept = time(&mut pool, |p| {
            forward(&model, p, &rows, n - 1, LogitsWanted::All)
        });
        let plain = time(&mut pool, |p| {
            forward(&model, p, &rows, n - 1, LogitsWanted::Last)
        });
        println!("| {} | {kept:.1} | {plain:.1} |", k + 1);
        per_row.push((k, kept, plain));
    }
    // Rollback after a 4-row verify (k = 3) that accepted 1 draft:
    // per-row: the commit is one state copy;
    // replay: restore the checkpoint taken before the verify, then run the
    // 2 accepted rows again.
    let rows: Vec<u32> = vec![last, 100, 101, 102];
    // The verify itself is not timed here: it runs in both schemes.
    let saved = pool.read_state(0).unwrap();
    let mut commit_xs = Vec::new();
    for _ in 0..REPS {
        pool.write_state(0, &saved).unwrap();
        forward(&model, &mut pool, &rows, n - 1, LogitsWanted::All);
        let t = Instant::now();
        pool.keep_rows(0, 2).unwrap();
        commit_xs.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let commit = median(commit_xs);
    let replay = time(&mut pool, |p| {
        p.write_state(0, &saved).unwrap();
        forward(&model, p, &rows[..2], n - 1, LogitsWanted::Last);
    });
    let (_, kept4, plain4) = per_row[2];
    println!();
    println!("rollback after 4 rows verified, 1 draft accepted:");
    println!(
        "  per-row states: {:.1} us recording inside the verify + {commit:.2} us commit = {:.1} us",
        kept4 - plain4,
        kept4 - plain4 + commit
    );
    println!("  replay from a checkpoint: {replay:.1} us (restore + 2-row forward)");
    println!();
    let slot = pool.state_bytes_per_slot();
    let latent = pool.bytes_per_token();
    // The formula from the config: per KDA layer 3 conv histories of
    // (kernel - 1) x heads x head_dim plus heads x head_dim^2; per MLA
    // layer kv_lora_rank + qk_rope_head_dim per token; f32.
    let (kda_layers, heads, hd, kernel, mla_layers, kvr, rope) = (6, 4, 16, 4, 2, 32, 8);
    let formula_state = kda_layers * (3 * (kernel - 1) * heads * hd + heads * hd * hd) * 4;
    let formula_latent = mla_layers * (kvr + rope) * 4;
    println!("| per sequence | counted from the pool | formula |");
    println!("|---|---:|---:|");
    println!("| recurrent-state slot | {slot} B | {formula_state} B |");
    println!("| latent cache per token | {latent} B | {formula_latent} B |");
    assert_eq!(slot, formula_state);
    assert_eq!(latent, formula_latent);
}
