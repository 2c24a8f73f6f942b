//! Batch-1 decode of one model, short enough to run many times in
//! alternation: prompt of P tokens (default 1), then N greedy tokens
//! (default 96), printing tok/s and the median, best and p90 milliseconds
//! per token. For A/B runs of a setting in one build (the host's speed
//! moves by 20% over minutes, so compare alternating runs only), e.g. the
//! thread team against rayon's pool:
//!
//! `for i in 1 2 3 4; do for s in 0 300; do SPECGATE_SPIN_US=$s cargo bench --bench decode; done; done`
//!
//! Arguments after `--`: model file or Hugging Face directory (any family,
//! hybrid Kimi K3 included; default the 1.5B target in the models
//! directory), N, P.

#[path = "../tests/common/models.rs"]
mod models;

#[path = "common/greedy.rs"]
mod greedy;

use greedy::greedy;
use specgate_verify::model::load_model;
use specgate_verify::KvPool;

fn main() {
    // `cargo bench` passes `--bench`; the rest are ours.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let path = args.first().map_or_else(
        || models::models_dir().join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        Into::into,
    );
    let n: usize = args
        .get(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(96)
        .max(1);
    let plen: u32 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1).max(1);
    if !path.exists() {
        println!(
            "{}: not present, skipped (scripts/fetch-models.sh)",
            path.display()
        );
        return;
    }
    let model = load_model(&path).expect("load");
    model.warm_up().expect("warm up");
    let cfg = model.config().clone();
    let prompt: Vec<u32> = (0..plen)
        .map(|i| (i * 7919 + 13) % cfg.vocab_size.min(30_000) as u32)
        .collect();
    let blocks = (prompt.len() + n + 16).div_ceil(16);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut pool = KvPool::for_model(&model, blocks, 16).expect("pool");
    let run = greedy(&model, &mut pool, &table, &prompt, n);
    let (mut ms, secs) = (run.ms, run.decode_secs);
    ms.sort_by(f64::total_cmp);
    println!(
        "{} decode {n} after {plen}: {:.2} tok/s | ms/tok median {:.2} best {:.2} p90 {:.2} | SPECGATE_SPIN_US={}",
        path.file_name().unwrap_or_default().to_string_lossy(),
        n as f64 / secs,
        ms[n / 2],
        ms[0],
        ms[n * 9 / 10],
        std::env::var("SPECGATE_SPIN_US").unwrap_or_else(|_| "default".into())
    );
}
