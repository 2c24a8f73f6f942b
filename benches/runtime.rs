//! Whole-model speed of the runtime at batch 1, as `specgate generate` runs
//! it: prefill tokens/s, decode tokens/s, and decode as a fraction of this
//! machine's memory-bandwidth bound (weight bytes streamed per decoded
//! token divided into the measured copy bandwidth).
//!
//! Each model runs twice in the same process, with candle's quantized
//! matmul and with ours (`specgate_verify::kernels`), so the two are side by
//! side; after decoding, one verification pass of r = 1, 2, 4, 8, 16 rows
//! (one sequence, r new tokens, logits for all) is timed in 9 rounds that
//! each run every row count, and its cost is the median ratio to one row.
//!
//! Run: `cargo bench --bench runtime` (models from scripts/fetch-models.sh);
//! `SPECGATE_BENCH_BACKENDS=native` runs only ours;
//! `SPECGATE_BENCH_VERIFY_ROWS=1,4` times only those verify passes (the
//! first must be 1, the ratios' base), e.g. to profile one of them;
//! `cargo bench --bench runtime -- MODEL...` runs those models (a GGUF or an
//! HF directory, any family, e.g. the Kimi K3 slices) instead.

// The workspace's one models-directory lookup (SPECGATE_MODELS_DIR, else
// models/ in the workspace root), shared with the tests.
#[path = "../tests/common/models.rs"]
mod models;

#[path = "common/greedy.rs"]
mod greedy;
use greedy::greedy;

use models::models_dir;
use specgate_verify::kernels::{self, Backend};
use specgate_verify::model::{load_model, read_token_list};
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

/// `head`: restrict the output head to these tokens (the draft option).
fn bench_model(path: &Path, bw: f64, backend: Backend, head: Option<&[u32]>) {
    kernels::set_backend(backend);
    let mut model = load_model(path).expect("load");
    if let Some(h) = head {
        model.restrict_head(h).expect("restrict head");
    }
    model.warm_up().expect("warm up");
    let cfg = model.config().clone();
    let prompt: Vec<u32> = (0..128u32)
        .map(|i| (i * 7919 + 13) % cfg.vocab_size.min(30_000) as u32)
        .collect();
    let decode = 64;
    let max_rows = 16;
    let blocks = (prompt.len() + decode + max_rows).div_ceil(16);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut pool = KvPool::for_model(&model, blocks, 16).unwrap();
    let run = greedy(&model, &mut pool, &table, &prompt, decode);
    let (prefill, dsecs) = (run.prefill_secs, run.decode_secs);
    let tps = decode as f64 / dsecs;
    let bytes = model.weight_bytes_per_step() as f64;
    let bound = bw / bytes;
    println!(
        "{} [{backend:?}{}]: prefill {} tok: {:.1} tok/s | decode: {:.2} tok/s ({:.1} ms/tok) | weights {:.0} MB/token -> bound {:.1} tok/s | {:.0}% of bound",
        path.file_name().unwrap().to_string_lossy(),
        head.map_or(String::new(), |h| format!(", head of {} tokens", h.len())),
        prompt.len(),
        prompt.len() as f64 / prefill,
        tps,
        1e3 / tps,
        bytes / 1e6,
        bound,
        100.0 * tps / bound
    );
    // Verification passes: r new tokens after the 192-token context, logits
    // for every row, as a speculative round with k = r - 1 drafts runs it.
    // Each round times every row count once, in a rotating order, and a
    // row count's ratio to one row is the median of its rounds' ratios:
    // the host's speed drifts by tens of percent over seconds, so only
    // passes run side by side compare.
    let ctx = prompt.len() + decode;
    let rows_list = std::env::var("SPECGATE_BENCH_VERIFY_ROWS").ok();
    let row_counts: Vec<usize> = match rows_list.as_deref() {
        Some(l) => l
            .split(',')
            .map(|r| {
                r.trim()
                    .parse()
                    .expect("SPECGATE_BENCH_VERIFY_ROWS: row counts")
            })
            .collect(),
        None => vec![1, 2, 4, 8, 16],
    };
    assert!(
        row_counts.first() == Some(&1) && row_counts.iter().all(|&r| (1..=max_rows).contains(&r)),
        "verify row counts start at 1 and stay within {max_rows}"
    );
    const ROUNDS: usize = 9;
    let mut times = vec![vec![0f64; row_counts.len()]; ROUNDS];
    for (round, this) in times.iter_mut().enumerate() {
        for i in 0..row_counts.len() {
            let ri = (round + i) % row_counts.len();
            let rows = row_counts[ri];
            let toks: Vec<u32> = (0..rows as u32).map(|i| (i * 31 + 7) % 30_000).collect();
            let t = Instant::now();
            let out = model
                .forward_one(&mut pool, &toks, ctx, &table, LogitsWanted::All)
                .unwrap();
            this[ri] = t.elapsed().as_secs_f64();
            assert_eq!(out.len(), rows);
        }
    }
    for (ri, rows) in row_counts.iter().enumerate() {
        let ms = median(times.iter().map(|t| t[ri]).collect()) * 1e3;
        let ratio = median(times.iter().map(|t| t[ri] / t[0]).collect());
        println!(
            "  verify {rows:>2} rows: {ms:.1} ms = {ratio:.2}x one row (median of {ROUNDS} side-by-side rounds) | weights at {:.1} GB/s, {:.0}% of bound",
            bytes / (ms / 1e3) / 1e9,
            100.0 * bytes / bw / (ms / 1e3)
        );
    }
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
    let backends: Vec<Backend> = match std::env::var("SPECGATE_BENCH_BACKENDS").as_deref() {
        Ok("native") => vec![Backend::Native],
        Ok("candle") => vec![Backend::Candle],
        _ => vec![Backend::Candle, Backend::Native],
    };
    let given: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if !given.is_empty() {
        for p in &given {
            for b in &backends {
                bench_model(Path::new(p), bw, *b, None);
            }
        }
        return;
    }
    let dir = models_dir();
    for name in [
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "smollm2-135m-instruct-q4_1.gguf",
    ] {
        let p = dir.join(name);
        if p.exists() {
            for b in &backends {
                bench_model(&p, bw, *b, None);
            }
            // The draft with its reduced head (configs/draft-head-qwen2.5.txt).
            let list = Path::new("configs/draft-head-qwen2.5.txt");
            if name.starts_with("qwen2.5-coder-0.5b") && list.exists() {
                let ids = read_token_list(list).expect("token list");
                bench_model(&p, bw, Backend::Native, Some(&ids));
            }
        } else {
            println!("{name}: not present, skipped (scripts/fetch-models.sh)");
        }
    }
}
