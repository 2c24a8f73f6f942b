//! The bf16 and f32 row-major matrix kernels (`kernels::bf16`,
//! `kernels::f32`) streaming their weights from memory, as decoding does,
//! against the f32 `Dense::forward` they replace (one `dot` per output
//! element and activation row, so every row re-reads the weights; copied
//! here because `Dense` is crate-private, with the thread team standing in
//! for rayon's pool over chunks of 64 outputs).
//!
//! A 7168 x 2048 matrix (a K3/DeepSeek-V3 attention projection shape) in
//! enough copies (~235 MB) that no cache holds them, multiplied one copy
//! after another by the same 1, 4 and 8 activation rows, `PASSES` passes.
//! Prints per matrix the median time and the stored bytes per second, and
//! each row count's time against one row's. `Dense` reads f32 (a bf16
//! file is widened to it at load), so its GB/s count 4 bytes a weight.
//!
//! Run: `cargo bench --bench dense_stream` (`PASSES=n` to change 15).

use specgate_verify::kernels::bf16::{self, Bf16Matrix};
use specgate_verify::kernels::f32::F32Matrix;
use specgate_verify::kernels::vector::F32Ops;
use specgate_verify::kernels::Isa;
use std::time::Instant;

#[path = "common/random.rs"]
mod random;
use random::random;

const N: usize = 7168;
const K: usize = 2048;
const ROWS: [usize; 3] = [1, 4, 8];

/// What one measurement runs.
#[derive(Clone, Copy)]
enum Kernel {
    Bf16(bf16::Path),
    F32(Isa),
    Dense,
}

impl Kernel {
    fn name(self) -> String {
        match self {
            Kernel::Bf16(p) => format!("bf16 {}", p.name()),
            Kernel::F32(isa) => format!("f32 {}", isa.name()),
            Kernel::Dense => "f32 Dense::forward (old)".into(),
        }
    }
}

/// The old `Dense::forward`: output element `i` of `rows x n` is one dot
/// of an activation row with a weight row.
fn dense_forward(w: &[f32], x: &[f32], rows: usize, out: &mut [f32]) {
    let ops = F32Ops::current();
    let total = rows * N;
    let out_ptr = out.as_mut_ptr() as usize;
    specgate_verify::team::for_each(total.div_ceil(64), |t| {
        for i in t * 64..((t + 1) * 64).min(total) {
            let (r, o) = (i / N, i % N);
            let v = ops.dot(&x[r * K..(r + 1) * K], &w[o * K..(o + 1) * K]);
            // SAFETY: each index writes its own element of `out`, which
            // outlives the loop.
            unsafe { *(out_ptr as *mut f32).add(i) = v };
        }
    });
}

fn main() {
    let passes: usize = std::env::var("PASSES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15)
        .max(1);
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpu
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("?")
        .trim()
        .to_string();
    #[cfg(target_arch = "x86_64")]
    let bf16_flag = is_x86_feature_detected!("avx512bf16");
    #[cfg(not(target_arch = "x86_64"))]
    let bf16_flag = false;
    println!(
        "dense_stream: {model}, {} threads, avx512_bf16 {bf16_flag}, {N}x{K}, median of {passes} passes",
        specgate_verify::team::threads()
    );
    let vals = random(N * K, 3);
    let bf16s: Vec<Bf16Matrix> = (0..8).map(|_| Bf16Matrix::from_f32(&vals, N, K)).collect();
    let f32s: Vec<F32Matrix> = (0..4).map(|_| F32Matrix::from_f32(&vals, N, K)).collect();
    let dense: Vec<Vec<f32>> = (0..4).map(|_| vals.clone()).collect();
    let mut kernels: Vec<Kernel> = [bf16::Path::Avx512Bf16, bf16::Path::Avx512, bf16::Path::Avx2]
        .into_iter()
        .filter(|p| p.available())
        .map(Kernel::Bf16)
        .collect();
    for isa in [Isa::Avx512Vnni, Isa::Avx2] {
        if isa.available() {
            kernels.push(Kernel::F32(isa));
        }
    }
    kernels.push(Kernel::Dense);
    let x = random(8 * K, 7);
    let mut out = vec![0f32; 8 * N];
    for kernel in kernels {
        let mut one_row = 0.0;
        for rows in ROWS {
            let (copies, bytes) = match kernel {
                Kernel::Bf16(_) => (bf16s.len(), 2 * N * K),
                _ => (f32s.len(), 4 * N * K),
            };
            let mut times = Vec::with_capacity(passes);
            for _ in 0..passes + 1 {
                let t = Instant::now();
                for c in 0..copies {
                    match kernel {
                        Kernel::Bf16(p) => bf16s[c].matmul_on(p, &x, rows, &mut out),
                        Kernel::F32(isa) => f32s[c].matmul_with(isa, &x, rows, &mut out),
                        Kernel::Dense => dense_forward(&dense[c], &x, rows, &mut out),
                    }
                }
                times.push(t.elapsed().as_secs_f64() / copies as f64);
            }
            // The first pass warms the pages and the team.
            times.remove(0);
            times.sort_by(|a, b| a.total_cmp(b));
            let t = times[passes / 2];
            if rows == 1 {
                one_row = t;
            }
            println!(
                "{:28} rows {rows}: {:7.3} ms/matrix, {:6.1} GB/s, {:.2}x one row's time",
                kernel.name(),
                t * 1e3,
                bytes as f64 / t / 1e9,
                t / one_row
            );
        }
    }
}
