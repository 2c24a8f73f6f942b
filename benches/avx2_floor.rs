//! How far the AVX2 Q4_K kernel is from what AVX2 allows, in cycles of
//! this core, to tell whether a verify pass of 4 rows can cost close to
//! one row's on an AVX2 CPU (issue 19 asks for <= 1.3x).
//!
//! AVX2 has no 4-way byte dot (`vpdpbusd`): every 32 weight codes times
//! one activation row take a `vpmaddubsw` and a `vpaddw` to accumulate it,
//! whatever the layout, so R rows of Q4_K need at least 2R such pairs per
//! 32 weight bytes (64 codes). The bench measures:
//! 1. the core's clock, from a chain of dependent `vpaddw` (latency 1 on
//!    every AVX2 core), then the throughput of `vpmaddubsw` alone and of
//!    independent `vpmaddubsw` + `vpaddw` pairs (with and without a
//!    broadcast load of the activation), in cycles;
//! 2. our AVX2 Q4_K kernel (`Isa::Avx2`) on a 1024x1536 matrix (in L2),
//!    an 8960x1536 one (L3) and 24 copies of that (streaming from memory),
//!    for 1 and 4 rows in alternating passes: cycles per 32 weight bytes
//!    per core, and the median of each round's 4-row / 1-row ratio;
//! 3. the floor that the pairs alone put on the 4-row pass, against the
//!    1-row pass as measured.
//!
//! Build it as AVX2 code for the numbers to mean AVX2: a native build on
//! an AVX-512 CPU compiles our AVX2 path with EVEX encodings and 32
//! registers. Run:
//! `RUSTFLAGS="-C target-cpu=x86-64-v3" CARGO_TARGET_DIR=target/v3 cargo bench --bench avx2_floor`.

#[cfg(target_arch = "x86_64")]
#[path = "common/random.rs"]
mod random;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use specgate_verify::kernels::{Isa, QWeight};
    use std::arch::asm;
    use std::sync::Arc;
    use std::time::Instant;

    use super::random::random;

    /// The MLP's up projection of the 1.5B target.
    const N: usize = 8960;
    /// Output columns of a matrix that fits the L2 caches of two cores.
    const N_L2: usize = 1024;
    const K: usize = 1536;
    const COPIES: usize = 24;
    const ROUNDS: usize = 9;

    /// Best time of 7 runs of `f(iters)`, in seconds per `per_iter` op.
    fn per_op(f: fn(u64), iters: u64, per_iter: u64) -> f64 {
        let mut best = f64::MAX;
        for _ in 0..7 {
            let s = Instant::now();
            f(iters);
            best = best.min(s.elapsed().as_secs_f64());
        }
        best / (iters * per_iter) as f64
    }

    /// 4 dependent `vpaddw` per iteration: 4 cycles.
    fn chain(n: u64) {
        // SAFETY: register-only AVX2 instructions; `main` checked AVX2.
        unsafe {
            asm!("2:",
                "vpaddw ymm0, ymm0, ymm1", "vpaddw ymm0, ymm0, ymm1",
                "vpaddw ymm0, ymm0, ymm1", "vpaddw ymm0, ymm0, ymm1",
                "dec rcx", "jnz 2b",
                inout("rcx") n => _,
                clobber_abi("C"), options(nostack));
        }
    }

    /// 8 independent `vpmaddubsw` per iteration.
    fn maddubs(n: u64) {
        // SAFETY: as in `chain`.
        unsafe {
            asm!("2:",
                "vpmaddubsw ymm8, ymm0, ymm1", "vpmaddubsw ymm9, ymm0, ymm1",
                "vpmaddubsw ymm10, ymm0, ymm1", "vpmaddubsw ymm11, ymm0, ymm1",
                "vpmaddubsw ymm12, ymm0, ymm1", "vpmaddubsw ymm13, ymm0, ymm1",
                "vpmaddubsw ymm14, ymm0, ymm1", "vpmaddubsw ymm15, ymm0, ymm1",
                "dec rcx", "jnz 2b",
                inout("rcx") n => _,
                clobber_abi("C"), options(nostack));
        }
    }

    /// 8 `vpmaddubsw` + `vpaddw` pairs per iteration into 4 accumulators
    /// (chains of 2 adds: never the limit).
    fn pairs(n: u64) {
        // SAFETY: as in `chain`.
        unsafe {
            asm!("2:",
                "vpmaddubsw ymm8, ymm0, ymm1", "vpaddw ymm2, ymm2, ymm8",
                "vpmaddubsw ymm9, ymm0, ymm1", "vpaddw ymm3, ymm3, ymm9",
                "vpmaddubsw ymm10, ymm0, ymm1", "vpaddw ymm4, ymm4, ymm10",
                "vpmaddubsw ymm11, ymm0, ymm1", "vpaddw ymm5, ymm5, ymm11",
                "vpmaddubsw ymm12, ymm0, ymm1", "vpaddw ymm2, ymm2, ymm12",
                "vpmaddubsw ymm13, ymm0, ymm1", "vpaddw ymm3, ymm3, ymm13",
                "vpmaddubsw ymm14, ymm0, ymm1", "vpaddw ymm4, ymm4, ymm14",
                "vpmaddubsw ymm15, ymm0, ymm1", "vpaddw ymm5, ymm5, ymm15",
                "dec rcx", "jnz 2b",
                inout("rcx") n => _,
                clobber_abi("C"), options(nostack));
        }
    }

    /// `pairs`, each with its activation broadcast from memory, as the
    /// kernel does.
    fn pairs_bcast(n: u64) {
        let buf = [0x0101_0101u32; 8];
        // SAFETY: as in `chain`; the loads read `buf`'s 32 bytes.
        unsafe {
            asm!("2:",
                "vpbroadcastd ymm1, [{p}]", "vpmaddubsw ymm8, ymm0, ymm1", "vpaddw ymm2, ymm2, ymm8",
                "vpbroadcastd ymm1, [{p} + 4]", "vpmaddubsw ymm9, ymm0, ymm1", "vpaddw ymm3, ymm3, ymm9",
                "vpbroadcastd ymm1, [{p} + 8]", "vpmaddubsw ymm10, ymm0, ymm1", "vpaddw ymm4, ymm4, ymm10",
                "vpbroadcastd ymm1, [{p} + 12]", "vpmaddubsw ymm11, ymm0, ymm1", "vpaddw ymm5, ymm5, ymm11",
                "vpbroadcastd ymm1, [{p} + 16]", "vpmaddubsw ymm12, ymm0, ymm1", "vpaddw ymm2, ymm2, ymm12",
                "vpbroadcastd ymm1, [{p} + 20]", "vpmaddubsw ymm13, ymm0, ymm1", "vpaddw ymm3, ymm3, ymm13",
                "vpbroadcastd ymm1, [{p} + 24]", "vpmaddubsw ymm14, ymm0, ymm1", "vpaddw ymm4, ymm4, ymm14",
                "vpbroadcastd ymm1, [{p} + 28]", "vpmaddubsw ymm15, ymm0, ymm1", "vpaddw ymm5, ymm5, ymm15",
                "dec rcx", "jnz 2b",
                inout("rcx") n => _, p = in(reg) buf.as_ptr(),
                clobber_abi("C"), options(nostack, readonly));
        }
    }

    fn median(v: &mut [f64]) -> f64 {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    }

    /// Alternating passes of 1 and 4 rows over `ws` (each matrix once per
    /// pass); returns the median seconds per matrix of each and the median
    /// of the rounds' 4-row / 1-row ratios.
    fn rows_1_4(ws: &[QWeight], n: usize, passes_per_round: usize) -> (f64, f64, f64) {
        let xs = [random(K, 8), random(4 * K, 11)];
        let mut out = vec![0f32; 4 * n];
        let (mut t1, mut t4, mut ratio) = (vec![], vec![], vec![]);
        for round in 0..ROUNDS {
            let mut t = [f64::MAX; 2];
            // Which row count runs first alternates by round.
            for i in [round % 2, 1 - round % 2] {
                let rows = [1, 4][i];
                for _ in 0..passes_per_round {
                    let s = Instant::now();
                    for w in ws {
                        w.matmul_with(Isa::Avx2, &xs[i], rows, &mut out);
                    }
                    t[i] = t[i].min(s.elapsed().as_secs_f64() / ws.len() as f64);
                }
            }
            t1.push(t[0]);
            t4.push(t[1]);
            ratio.push(t[1] / t[0]);
        }
        (median(&mut t1), median(&mut t4), median(&mut ratio))
    }

    pub fn main() {
        if !Isa::Avx2.available() {
            println!("avx2_floor: this CPU has no AVX2; nothing to measure");
            return;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cycle = per_op(chain, 20_000_000, 4);
        let ghz = 1e-9 / cycle;
        let c = |f, per| per_op(f, 20_000_000, per) / cycle;
        let (mub, pair, pair_b) = (c(maddubs, 8), c(pairs, 8), c(pairs_bcast, 8));
        println!("avx2_floor: clock {ghz:.2} GHz (dependent vpaddw chain), {cores} cores");
        println!("  vpmaddubsw alone:              {mub:.3} cycles each");
        println!("  vpmaddubsw + vpaddw pair:      {pair:.3} cycles each");
        println!("  the same with a broadcast load: {pair_b:.3} cycles each");

        let quantize = |n: usize| {
            let w = Tensor::from_vec(random(n * K, 1), (n, K), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, GgmlDType::Q4K).unwrap();
            QWeight::new(Arc::new(q)).expect("Q4_K")
        };
        let small = vec![quantize(N_L2)];
        let one = vec![quantize(N)];
        let many: Vec<QWeight> = (0..COPIES).map(|_| quantize(N)).collect();
        let floor4 = 2.0 * 4.0 * pair_b;
        println!("  4 rows need >= 8 pairs per 32 weight bytes: >= {floor4:.2} cycles");
        println!("Q4_K, AVX2 kernel, {ROUNDS} rounds of alternating 1- and 4-row passes:");
        let cases = [
            ("in L2", N_L2, &small, 60),
            ("in L3", N, &one, 15),
            ("streaming", N, &many, 2),
        ];
        for (label, n, ws, passes) in cases {
            let (t1, t4, r) = rows_1_4(ws, n, passes);
            // 32 weight bytes (64 codes) per core.
            let chunks = (n * K / 64) as f64 / cores as f64;
            let cyc = |t: f64| t * ghz * 1e9 / chunks;
            println!(
                "  {label:9} ({n}x{K}): 1 row {:.0} us ({:.2} cycles per 32 B per core), \
                 4 rows {:.0} us ({:.2}); 4 rows / 1 row {r:.2}x, the pairs' floor {:.2}x",
                t1 * 1e6,
                cyc(t1),
                t4 * 1e6,
                cyc(t4),
                floor4 / cyc(t1),
            );
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::main();
    #[cfg(not(target_arch = "x86_64"))]
    println!("avx2_floor: x86-64 only");
}
