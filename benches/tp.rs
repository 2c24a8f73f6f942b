//! Tensor parallelism on this machine: greedy decode tokens/s of the real
//! Qwen2.5-Coder-1.5B unsharded (TP 1) and sharded over 2 ranks (TP 2),
//! measured side by side in one process. Both models stay loaded; rounds
//! alternate TP 1 / TP 2 so that load from other processes hits both alike,
//! and each side's median round is reported with the ratio.
//!
//! Run: `cargo bench --bench tp` (models from scripts/fetch-models.sh).
//! `CANDLE_NUM_THREADS=1 cargo bench --bench tp` gives candle's matmuls one
//! thread per rank instead of its shared worker pool (see BENCHMARKS.md).

// The workspace's one models-directory lookup (SPECGATE_MODELS_DIR, else
// models/ in the workspace root), shared with the tests.
#[path = "../tests/common/models.rs"]
mod models;

#[path = "common/greedy.rs"]
mod greedy;
use greedy::greedy;

use models::models_dir;
use specgate_verify::model::load_gguf_tp;
use specgate_verify::{KvPool, Model};

const ROUNDS: usize = 5;
const DECODE: usize = 24;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Prefills `prompt`, then decodes `DECODE` greedy tokens; returns decode
/// tokens/s and the tokens.
fn decode(model: &Model, prompt: &[u32]) -> (f64, Vec<u32>) {
    let blocks = (prompt.len() + DECODE).div_ceil(16);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut pool = KvPool::for_model(model, blocks, 16).unwrap();
    let run = greedy(model, &mut pool, &table, prompt, DECODE);
    (DECODE as f64 / run.decode_secs, run.tokens)
}

fn main() {
    let path = models_dir().join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    if !path.exists() {
        println!("{}: not present, skipped", path.display());
        return;
    }
    let candle_threads = std::env::var("CANDLE_NUM_THREADS").unwrap_or_else(|_| "default".into());
    let models: Vec<(usize, Model)> = [1, 2]
        .into_iter()
        .map(|w| {
            let m = load_gguf_tp(&path, w).expect("load");
            m.warm_up().expect("warm up");
            (w, m)
        })
        .collect();
    let prompt: Vec<u32> = (0..32u32).map(|i| (i * 7919 + 13) % 30_000).collect();
    let mut tps: Vec<Vec<f64>> = vec![Vec::new(); models.len()];
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); models.len()];
    for _ in 0..ROUNDS {
        for (i, (_, m)) in models.iter().enumerate() {
            let (t, out) = decode(m, &prompt);
            tps[i].push(t);
            tokens[i] = out;
        }
    }
    let base = median(tps[0].clone());
    for (i, (w, _)) in models.iter().enumerate() {
        let med = median(tps[i].clone());
        println!(
            "qwen2.5-coder-1.5b TP {w}: decode {med:.2} tok/s ({:.1} ms/tok), median of {ROUNDS} x {DECODE} tokens, x{:.2} of TP 1 | CANDLE_NUM_THREADS={candle_threads}, {} cores",
            1e3 / med,
            med / base,
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        );
    }
    println!(
        "greedy tokens identical across TP sizes: {}",
        tokens.windows(2).all(|w| w[0] == w[1])
    );
}
