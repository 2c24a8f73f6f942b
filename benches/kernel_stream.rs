//! Our quantized matmul kernels streaming their weights from memory, as
//! decoding does: for each format, random weights of a Qwen2.5-Coder shape
//! in enough copies (180-225 MB) that no cache holds them, multiplied one
//! copy after another by the same 1 (or `ROWS`) activation rows, 25 passes.
//! Prints the median and best weight bytes per second, to set against the
//! machine's read bandwidth (`cargo bench --bench runtime` prints it).
//! `cargo bench --bench kernels` measures the same kernels on one matrix
//! that fits in L3, which shows what they compute, not what they stream.
//!
//! On a CPU with AVX-512 VNNI each pass also runs the AVX2 path, in
//! alternation, and prints its speed against the first's.
//!
//! Run: `cargo bench --bench kernel_stream` (`ROWS=4` for 4 rows).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use specgate_verify::kernels::{matmul_many_with, Isa, Product, QWeight};
use std::sync::Arc;
use std::time::Instant;

#[path = "common/random.rs"]
mod random;
use random::random;

/// (label, format, output rows n, inputs k, copies).
const SHAPES: &[(&str, GgmlDType, usize, usize, usize)] = &[
    ("q4k_8960x1536", GgmlDType::Q4K, 8960, 1536, 24),
    ("q6k_1536x8960", GgmlDType::Q6K, 1536, 8960, 20),
    ("q8_0_4864x896", GgmlDType::Q8_0, 4864, 896, 40),
    ("q5_0_4864x896", GgmlDType::Q5_0, 4864, 896, 60),
];

const PASSES: usize = 25;

fn main() {
    let rows: usize = std::env::var("ROWS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1);
    println!(
        "kernel_stream: isa {}, {} cores, {rows} rows, median / best of {PASSES} passes",
        Isa::current().name(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    // The detected instruction set and, where that is not AVX2, AVX2 too.
    let mut isas = vec![Isa::current()];
    if isas[0] != Isa::Avx2 && Isa::Avx2.available() {
        isas.push(Isa::Avx2);
    }
    for &(label, dtype, n, k, copies) in SHAPES {
        let w = Tensor::from_vec(random(n * k, 1), (n, k), &Device::Cpu).unwrap();
        let q = Arc::new(QTensor::quantize(&w, dtype).unwrap());
        // Separate copies: the same bytes at different addresses, so each
        // pass reads `copies` matrices from memory.
        let ws: Vec<QWeight> = (0..copies)
            .map(|_| QWeight::new(q.clone()).expect("supported format"))
            .collect();
        let bytes: usize = ws.iter().map(|w| w.bytes()).sum();
        let x = random(rows * k, 7);
        let mut out = vec![0f32; rows * n];
        // Every pass runs each instruction set once, in a rotating order:
        // the host's speed drifts by tens of percent over seconds, so only
        // runs side by side compare (the ratio is the median of the passes').
        let mut times = vec![Vec::with_capacity(PASSES); isas.len()];
        for pass in 0..PASSES {
            for i in 0..isas.len() {
                let v = (pass + i) % isas.len();
                let isa = isas[v];
                let t = Instant::now();
                for w in &ws {
                    matmul_many_with(isa, &x, rows, &mut [Product { w, out: &mut out }]);
                }
                times[v].push(t.elapsed().as_secs_f64());
            }
        }
        for (v, isa) in isas.iter().enumerate() {
            let mut ratios: Vec<f64> = (0..PASSES).map(|p| times[0][p] / times[v][p]).collect();
            ratios.sort_by(|a, b| a.total_cmp(b));
            let t = &mut times[v];
            t.sort_by(|a, b| a.total_cmp(b));
            println!(
                "{label} x{copies} ({} MB) {}: median {:.1} GB/s, best {:.1} GB/s, {:.3}x the first",
                bytes / 1_000_000,
                isa.name(),
                bytes as f64 / t[PASSES / 2] / 1e9,
                bytes as f64 / t[0] / 1e9,
                ratios[PASSES / 2]
            );
        }
    }
}
