//! Median time of one `QWeight::matmul` (the kernels' current instruction
//! set, `SPECGATE_KERNEL_ISA` to pick another) on the 1.5B's widest
//! shapes, Q4_K gate/up (8960 x 1536) and Q6_K down (1536 x 8960), at 1,
//! 4, 8 and 16 activation rows: a quick side-by-side of two builds
//! (run each binary in turn) without the root package's benches.
//!
//! Run: `cargo run --release -p specgate-verify --example kernel_rows`.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use specgate_verify::kernels::QWeight;
use std::sync::Arc;
use std::time::Instant;

fn main() {
    for (dt, n, k) in [(GgmlDType::Q4K, 8960, 1536), (GgmlDType::Q6K, 1536, 8960)] {
        let vals: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 2003) as f32 / 1001.0) - 1.0)
            .collect();
        let t = Tensor::from_vec(vals, (n, k), &Device::Cpu).unwrap();
        let q = QWeight::new(Arc::new(QTensor::quantize(&t, dt).unwrap())).unwrap();
        for rows in [1usize, 4, 8, 16] {
            let x: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 31 % 977) as f32 / 500.0) - 1.0)
                .collect();
            let mut out = vec![0f32; rows * n];
            let mut ms: Vec<f64> = (0..41)
                .map(|_| {
                    let t = Instant::now();
                    q.matmul(&x, rows, &mut out);
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            ms.sort_by(|a, b| a.total_cmp(b));
            println!("{dt:?} rows {rows}: median {:.3} ms", ms[20]);
        }
    }
}
