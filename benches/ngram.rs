//! Cost of one n-gram prompt-lookup proposal (must be microseconds): k = 8
//! drafts from contexts of 512 to 8192 tokens, median of 2001 lookups each,
//! for a context where the suffix repeats (a hit) and one where it never
//! does (the full backwards scan, the worst case).
//!
//! Run: `cargo bench --bench ngram`.

use specgate_draft::NgramProposer;
use std::time::Instant;

fn median_ns(ctx: &[u32], p: &NgramProposer) -> f64 {
    let mut xs: Vec<f64> = (0..2001)
        .map(|_| {
            let t = Instant::now();
            let got = p.lookup(std::hint::black_box(ctx), 8);
            std::hint::black_box(got);
            t.elapsed().as_nanos() as f64
        })
        .collect();
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    let p = NgramProposer::new(1, 4).unwrap();
    println!("| context tokens | hit (us) | miss, full scan (us) |");
    println!("|---|---|---|");
    for len in [512usize, 2048, 8192] {
        // A code-like context: a repeated 40-token pattern ends it (hit).
        let hit: Vec<u32> = (0..len as u32).map(|i| (i * 7919) % 40 + 100).collect();
        // All distinct tokens: no earlier match of any suffix (miss).
        let miss: Vec<u32> = (0..len as u32).collect();
        println!(
            "| {len} | {:.2} | {:.2} |",
            median_ns(&hit, &p) / 1e3,
            median_ns(&miss, &p) / 1e3
        );
    }
}
