//! Whole-model speed of the runtime at batch 1, as `specgate generate` runs
//! it: prefill tokens/s, decode tokens/s, and decode as a fraction of this
//! machine's memory-bandwidth bound (weight bytes streamed per decoded
//! token divided into the measured copy bandwidth).
//!
//! Run: `cargo bench --bench runtime` (models from scripts/fetch-models.sh).

use specgate_verify::model::load_gguf;
use specgate_verify::sample::argmax;
use specgate_verify::{KvPool, LogitsWanted};
use std::path::Path;
use std::time::Instant;

/// Bytes per thread per buffer: far beyond any last-level cache (this host's
/// EPYC may carry hundreds of MiB of L3, which inflated 256 MiB runs).
const BUF_BYTES: usize = 3 << 29;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// STREAM-style copy bandwidth: bytes read + bytes written per second, with
/// one thread per core each copying its own 1.5 GiB slice; median of 5.
fn copy_bandwidth() -> f64 {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = BUF_BYTES;
    let mut bufs: Vec<(Vec<u8>, Vec<u8>)> = (0..threads)
        .map(|i| (vec![i as u8 + 1; per], vec![0u8; per]))
        .collect();
    let mut runs = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (src, dst) in bufs.iter_mut() {
                s.spawn(move || dst.copy_from_slice(src));
            }
        });
        let secs = t.elapsed().as_secs_f64();
        runs.push((2 * per * threads) as f64 / secs);
    }
    assert!(bufs.iter().all(|(_, d)| d[per - 1] != 0));
    median(runs)
}

/// Read-only bandwidth (what streaming weights needs): one thread per core
/// summing its own 1.5 GiB slice as u64s; median of 5.
fn read_bandwidth() -> f64 {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let words = BUF_BYTES / 8;
    let bufs: Vec<Vec<u64>> = (0..threads).map(|i| vec![i as u64 + 1; words]).collect();
    let mut runs = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = bufs
                .iter()
                .map(|b| s.spawn(move || b.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        let secs = t.elapsed().as_secs_f64();
        assert!(total > 0);
        runs.push((8 * words * threads) as f64 / secs);
    }
    median(runs)
}

fn bench_model(path: &Path, bw: f64) {
    let model = load_gguf(path).expect("load");
    model.warm_up().expect("warm up");
    let cfg = model.config().clone();
    let prompt: Vec<u32> = (0..128u32).map(|i| (i * 7919 + 13) % 30_000).collect();
    let decode = 64;
    let blocks = (prompt.len() + decode).div_ceil(16);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut pool = KvPool::new(&cfg, blocks, 16).unwrap();
    let t = Instant::now();
    let mut logits = model
        .forward_one(&mut pool, &prompt, 0, &table, LogitsWanted::Last)
        .unwrap()
        .remove(0);
    let prefill = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for i in 0..decode {
        let next = argmax(&logits);
        logits = model
            .forward_one(
                &mut pool,
                &[next],
                prompt.len() + i,
                &table,
                LogitsWanted::Last,
            )
            .unwrap()
            .remove(0);
    }
    let dsecs = t.elapsed().as_secs_f64();
    let tps = decode as f64 / dsecs;
    let bytes = model.weight_bytes_per_step() as f64;
    let bound = bw / bytes;
    println!(
        "{}: prefill {} tok: {:.1} tok/s | decode: {:.2} tok/s ({:.1} ms/tok) | weights {:.0} MB/token -> bound {:.1} tok/s | {:.0}% of bound",
        path.file_name().unwrap().to_string_lossy(),
        prompt.len(),
        prompt.len() as f64 / prefill,
        tps,
        1e3 / tps,
        bytes / 1e6,
        bound,
        100.0 * tps / bound
    );
}

fn main() {
    let copy = copy_bandwidth();
    let read = read_bandwidth();
    println!(
        "memory bandwidth: copy {:.2} GB/s (bytes read + written), read-only {:.2} GB/s; all cores, median of 5",
        copy / 1e9,
        read / 1e9
    );
    // Decoding only reads weights: the bound uses the larger, read-only figure.
    let bw = read.max(copy);
    println!("bound below uses {:.2} GB/s", bw / 1e9);
    let dir = std::env::var("SPECGATE_MODELS_DIR").unwrap_or_else(|_| "models".into());
    for name in [
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "smollm2-135m-instruct-q4_1.gguf",
    ] {
        let p = Path::new(&dir).join(name);
        if p.exists() {
            bench_model(&p, bw);
        } else {
            println!("{name}: not present, skipped (scripts/fetch-models.sh)");
        }
    }
}
