//! Quantized matmul kernels side by side: candle's `QMatMul` against ours
//! (`specgate_verify::kernels::QWeight`: `specgate` with the detected
//! instruction set, and `specgate-avx2` with AVX2 when that is not the
//! detected one, so an AVX-512 machine measures both paths in one run), on
//! random weights of the shapes the Qwen2.5-Coder models use, for 1 to 128
//! activation rows. Where the detected set is AMX, `specgate-avx512` runs
//! the same products without tiles, so the tiles' gain is measured in one
//! run (`SPECGATE_AMX_MIN_ROWS=1` puts every row count on tiles; by
//! default the thresholds measured at start-up pick).
//! Throughput is weight bytes per second (each matrix is read once per
//! call), comparable to the machine's memory bandwidth (BENCHMARKS.md).
//!
//! Run: `cargo bench --bench kernels` (filter e.g. `-- q4k`).

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use specgate_verify::kernels::{Isa, QWeight};
use std::sync::Arc;
use std::time::Duration;

#[path = "common/random.rs"]
mod random;
use random::random;

/// (label, format, output rows n, inputs k).
const SHAPES: &[(&str, GgmlDType, usize, usize)] = &[
    ("q4k_8960x1536", GgmlDType::Q4K, 8960, 1536),
    ("q6k_1536x8960", GgmlDType::Q6K, 1536, 8960),
    ("q8_0_4864x896", GgmlDType::Q8_0, 4864, 896),
    ("q5_0_4864x896", GgmlDType::Q5_0, 4864, 896),
    ("q4_1_1536x576", GgmlDType::Q4_1, 1536, 576),
];

fn kernels(c: &mut Criterion) {
    let dev = Device::Cpu;
    for &(label, dtype, n, k) in SHAPES {
        let w = Tensor::from_vec(random(n * k, 1), (n, k), &dev).unwrap();
        let q = Arc::new(QTensor::quantize(&w, dtype).unwrap());
        let bytes = q.storage_size_in_bytes() as u64;
        let ours = QWeight::new(q.clone()).expect("supported format");
        let candle = QMatMul::from_arc(q).unwrap();
        let mut g = c.benchmark_group(label);
        g.throughput(Throughput::Bytes(bytes))
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for rows in [1usize, 2, 4, 8, 16, 32, 64, 128] {
            let x = random(rows * k, rows as u32 + 7);
            let xt = Tensor::from_vec(x.clone(), (rows, k), &dev).unwrap();
            g.bench_with_input(BenchmarkId::new("candle", rows), &rows, |b, _| {
                b.iter(|| candle.forward(&xt).unwrap())
            });
            let mut out = vec![0f32; rows * n];
            g.bench_with_input(BenchmarkId::new("specgate", rows), &rows, |b, _| {
                b.iter(|| ours.matmul(&x, rows, &mut out))
            });
            if Isa::current() == Isa::Amx {
                g.bench_with_input(BenchmarkId::new("specgate-avx512", rows), &rows, |b, _| {
                    b.iter(|| ours.matmul_with(Isa::Avx512Vnni, &x, rows, &mut out))
                });
            }
            if Isa::Avx2.available() && Isa::current() != Isa::Avx2 {
                g.bench_with_input(BenchmarkId::new("specgate-avx2", rows), &rows, |b, _| {
                    b.iter(|| ours.matmul_with(Isa::Avx2, &x, rows, &mut out))
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, kernels);
criterion_main!(benches);
