//! The MXFP4 expert kernels streaming their weights from memory, as MoE
//! decoding does: random `block_mxfp4` matrices of a Kimi-expert-like
//! shape (3072 x 7168) in enough copies (about 190 MB) that no cache holds
//! them, multiplied one copy after another by the same 1, 4 or 8
//! activation rows (quantized once per pass, as one expert's gate and up
//! share them). Prints weight bytes per second (median and best of the
//! passes) for every instruction set this CPU has, each in the layout the
//! loader gives it (tiled for AVX2, `tiled` in the label), the kernel this one
//! replaced (scalar, rows as the outer loop: a copy of it is kept below
//! for the comparison), and our Q4_K kernel on a matrix of similar bytes
//! for scale.
//!
//! Run: `cargo bench --bench mxfp4_stream`.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use specgate_verify::kernels::mxfp4::{
    matmul_grouped_with, prefers_tiles, Mxfp4Matrix, Mxfp4Product, Q8Acts, BLOCK_BYTES,
};
use specgate_verify::kernels::{matmul_many_with, Isa, Product, QWeight};
use std::sync::Arc;
use std::time::Instant;

#[path = "common/random.rs"]
mod random;
use random::random;

const OUT: usize = 3072;
const INP: usize = 7168;
const COPIES: usize = 16;
const PASSES: usize = 15;

/// Random ggml blocks: scales near 1, codes from the generator's bits.
fn weights(seed: u32) -> Vec<u8> {
    let r = random(OUT * INP / 32 * BLOCK_BYTES, seed);
    r.iter()
        .enumerate()
        .map(|(i, v)| {
            let byte = ((v + 1.0) * 127.5) as u8;
            if i % BLOCK_BYTES == 0 {
                118 + byte % 16
            } else {
                byte
            }
        })
        .collect()
}

/// (median, best) seconds of `f` over `passes` runs.
fn time(passes: usize, mut f: impl FnMut()) -> (f64, f64) {
    let mut t: Vec<f64> = (0..passes)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    (t[passes / 2], t[0])
}

fn main() {
    // `cargo bench --bench mxfp4_stream -- routed` (or `in-cache`): that
    // part alone.
    if std::env::args().any(|a| a == "routed") {
        routed();
        return;
    }
    if std::env::args().any(|a| a == "in-cache") {
        in_cache();
        return;
    }
    println!(
        "mxfp4_stream: {OUT}x{INP} x{COPIES}, {} threads, median / best of {PASSES} passes",
        specgate_verify::team::threads()
    );
    let ws: Vec<Mxfp4Matrix> = (0..COPIES)
        .map(|c| Mxfp4Matrix::from_ggml(weights(c as u32 + 1), OUT, INP).unwrap())
        .collect();
    let bytes: usize = ws.iter().map(|w| w.bytes()).sum();
    // The same matrices in the tiled layout (what the loader builds for
    // the ISAs that prefer it).
    let tws: Vec<Mxfp4Matrix> = ws.iter().map(|w| w.tiled()).collect();
    // (instruction set, tiled?): the layout the loader picks for each.
    let runs: Vec<(Isa, bool)> = [Isa::Avx512Vnni, Isa::Avx2, Isa::Scalar]
        .into_iter()
        .filter(|i| i.available())
        .map(|i| (i, prefers_tiles(i)))
        .collect();
    // Q4_K of about the same bytes per copy (8960 x 2560 x 144 / 256).
    let (qn, qk) = (8960, 2560);
    let qt = Tensor::from_vec(random(qn * qk, 9), (qn, qk), &Device::Cpu).unwrap();
    let q = Arc::new(QTensor::quantize(&qt, GgmlDType::Q4K).unwrap());
    let qws: Vec<QWeight> = (0..COPIES)
        .map(|_| QWeight::new(q.clone()).unwrap())
        .collect();
    let qbytes: usize = qws.iter().map(|w| w.bytes()).sum();
    // Each run's 1-row time, for the multi-row ratios.
    let mut single = vec![0f64; runs.len()];
    for rows in [1, 4, 8] {
        let x = random(rows * INP.max(qk), 7);
        let mut out = vec![0f32; rows * OUT.max(qn)];
        for (ri, &(isa, tiled)) in runs.iter().enumerate() {
            let ws = if tiled { &tws } else { &ws };
            let name = format!("{}{}", isa.name(), if tiled { " tiled" } else { "" });
            // The scalar path is slow: fewer copies and passes.
            let (copies, passes) = if isa == Isa::Scalar {
                (2, 3)
            } else {
                (COPIES, PASSES)
            };
            let b: usize = ws[..copies].iter().map(|w| w.bytes()).sum();
            let (med, best) = time(passes, || {
                let acts = Q8Acts::new(&x, rows, INP);
                for w in &ws[..copies] {
                    let mut p = [Mxfp4Product {
                        w,
                        acts: &acts,
                        out: &mut out[..rows * OUT],
                    }];
                    matmul_grouped_with(isa, &mut p);
                }
            });
            let note = match (isa, rows) {
                (Isa::Scalar, _) => String::new(),
                (_, 1) => {
                    single[ri] = med;
                    String::new()
                }
                _ => format!(", {:.2}x the 1-row time", med / single[ri]),
            };
            println!(
                "mxfp4 {rows} rows {name}: median {:.1} GB/s, best {:.1} GB/s{note}",
                b as f64 / med / 1e9,
                b as f64 / best / 1e9,
            );
        }
        let w = &ws[0];
        assert!(!w.is_tiled());
        let (med, _) = time(1, || {
            old_forward(&w.storage()[..], OUT, INP, &x[..rows * INP]);
        });
        println!(
            "mxfp4 {rows} rows old scalar (one copy, one pass): {:.2} GB/s",
            w.bytes() as f64 / med / 1e9
        );
        let (med, best) = time(PASSES, || {
            for w in &qws {
                let mut p = [Product {
                    w,
                    out: &mut out[..rows * qn],
                }];
                matmul_many_with(Isa::current(), &x[..rows * qk], rows, &mut p);
            }
        });
        println!(
            "q4k {qn}x{qk} x{COPIES} {rows} rows {}: median {:.1} GB/s, best {:.1} GB/s",
            Isa::current().name(),
            qbytes as f64 / med / 1e9,
            qbytes as f64 / best / 1e9
        );
    }
    println!("({} MB of MXFP4 weights per pass)", bytes / 1_000_000);
    routed();
    in_cache();
}

/// One MoE layer's routed experts as a K3 verify pass of 1 and of 4
/// tokens runs them (`matmul_grouped`, each expert's gate and up sharing
/// its rows' quantized activations): 32 experts of 3072 x 3584, each token
/// routed to 16 of them (a fixed pseudo-random choice), so 4 tokens reach
/// most experts with 1-4 rows each. The ratio of the two is what the
/// experts add to a 4-row pass over a 1-row one.
fn routed() {
    const E: usize = 32;
    const TOP: usize = 16;
    let (out_n, inp) = (3072, 3584);
    let mats: Vec<[Mxfp4Matrix; 2]> = (0..E)
        .map(|e| {
            [0, 1].map(|m| {
                let w = Mxfp4Matrix::from_ggml(
                    weights(1000 + 2 * e as u32 + m)[..out_n * inp / 32 * BLOCK_BYTES].to_vec(),
                    out_n,
                    inp,
                )
                .unwrap();
                if prefers_tiles(Isa::current()) {
                    w.tiled()
                } else {
                    w
                }
            })
        })
        .collect();
    let mut t1 = 0f64;
    for tokens in [1usize, 2, 4] {
        // Token t's experts: TOP of E by a multiplicative hash.
        let mut rows_of = vec![0usize; E];
        for t in 0..tokens {
            let mut order: Vec<usize> = (0..E).collect();
            order.sort_by_key(|&e| (e * 2654435761 + t * 40503 + 17) % 4093);
            for &e in &order[..TOP] {
                rows_of[e] += 1;
            }
        }
        let active: Vec<usize> = (0..E).filter(|&e| rows_of[e] > 0).collect();
        let x = random(tokens * inp, 11);
        let acts: Vec<Q8Acts> = active
            .iter()
            .map(|&e| Q8Acts::new(&x[..rows_of[e] * inp], rows_of[e], inp))
            .collect();
        let mut outs: Vec<[Vec<f32>; 2]> = active
            .iter()
            .map(|&e| {
                [
                    vec![0f32; rows_of[e] * out_n],
                    vec![0f32; rows_of[e] * out_n],
                ]
            })
            .collect();
        let (med, _) = time(PASSES, || {
            let mut p: Vec<Mxfp4Product> = Vec::new();
            for ((&e, a), o) in active.iter().zip(&acts).zip(outs.iter_mut()) {
                let [g, u] = o;
                p.push(Mxfp4Product {
                    w: &mats[e][0],
                    acts: a,
                    out: g,
                });
                p.push(Mxfp4Product {
                    w: &mats[e][1],
                    acts: a,
                    out: u,
                });
            }
            matmul_grouped_with(Isa::current(), &mut p);
        });
        if tokens == 1 {
            t1 = med;
        }
        let b: usize = active.iter().map(|&e| 2 * mats[e][0].bytes()).sum();
        println!(
            "routed, {tokens} tokens: {} experts, {:.2} ms, {:.1} GB/s, {:.2}x the 1-token time",
            active.len(),
            med * 1e3,
            b as f64 / med / 1e9,
            med / t1
        );
    }
}

/// The same kernels on one small matrix that stays in L2 (512 x 2048
/// MXFP4, 557 KB, or a Q4_K matrix of the same bytes; each thread reads
/// about half), multiplied over and over: no memory traffic, so the times are
/// the kernels' compute alone. Their R-row / 1-row ratio is the floor a
/// memory-bound pass of R rows approaches once the kernel's compute
/// exceeds the time its bytes take to stream.
fn in_cache() {
    // Calls of PER products each (the same matrix): enough work per call
    // that quantizing the activations and waking the team do not count.
    const REPS: usize = 50;
    const PER: usize = 8;
    let (out_n, inp) = (512, 2048);
    let w = Mxfp4Matrix::from_ggml(
        weights(99)[..out_n * inp / 32 * BLOCK_BYTES].to_vec(),
        out_n,
        inp,
    )
    .unwrap();
    let isa = Isa::current();
    let w = if prefers_tiles(isa) { w.tiled() } else { w };
    let (qn, qk) = (480, 2048);
    let qt = Tensor::from_vec(random(qn * qk, 5), (qn, qk), &Device::Cpu).unwrap();
    let q = QWeight::new(Arc::new(QTensor::quantize(&qt, GgmlDType::Q4K).unwrap())).unwrap();
    let (mut m1, mut q1) = (0f64, 0f64);
    for rows in [1, 2, 3, 4, 8] {
        let x = random(rows * inp.max(qk), 3);
        let mut outs = vec![vec![0f32; rows * out_n.max(qn)]; PER];
        let acts = Q8Acts::new(&x[..rows * inp], rows, inp);
        let (med, _) = time(PASSES, || {
            for _ in 0..REPS {
                let mut p: Vec<Mxfp4Product> = outs
                    .iter_mut()
                    .map(|o| Mxfp4Product {
                        w: &w,
                        acts: &acts,
                        out: &mut o[..rows * out_n],
                    })
                    .collect();
                matmul_grouped_with(isa, &mut p);
            }
        });
        let (qmed, _) = time(PASSES, || {
            for _ in 0..REPS {
                let mut p: Vec<Product> = outs
                    .iter_mut()
                    .map(|o| Product {
                        w: &q,
                        out: &mut o[..rows * qn],
                    })
                    .collect();
                matmul_many_with(isa, &x[..rows * qk], rows, &mut p);
            }
        });
        if rows == 1 {
            (m1, q1) = (med, qmed);
        }
        println!(
            "in cache, {rows} rows {}: mxfp4 {:.1} GB/s ({:.2}x the 1-row time), q4k {:.1} GB/s ({:.2}x)",
            isa.name(),
            (w.bytes() * REPS * PER) as f64 / med / 1e9,
            med / m1,
            (q.bytes() * REPS * PER) as f64 / qmed / 1e9,
            qmed / q1,
        );
    }
}

/// The kernel before the SIMD ones, as it was (for the comparison only):
/// each activation row quantized to Q8_0 (by today's quantizer, the same
/// numbers), then every weight row with a
/// table lookup per nibble and an f64 `powi` per block.
fn old_forward(blocks: &[u8], out: usize, inp: usize, x: &[f32]) -> Vec<f32> {
    const KV: [i32; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
    let half_scale = |e: u8| (2f64).powi(e as i32 - 128) as f32;
    let per_row = inp / 32 * BLOCK_BYTES;
    let mut y = Vec::with_capacity(x.len() / inp * out);
    for row in x.chunks_exact(inp) {
        let a = Q8Acts::new(row, 1, inp);
        let (q, d) = (a.codes(), a.scales());
        for w in blocks[..out * per_row].chunks_exact(per_row) {
            let mut sum = 0f32;
            for (b, blk) in w.chunks_exact(BLOCK_BYTES).enumerate() {
                let qb = &q[b * 32..(b + 1) * 32];
                let mut si = 0i32;
                for j in 0..16 {
                    si += KV[(blk[1 + j] & 15) as usize] * qb[j] as i32;
                    si += KV[(blk[1 + j] >> 4) as usize] * qb[j + 16] as i32;
                }
                sum += half_scale(blk[0]) * d[b] * si as f32;
            }
            y.push(sum);
        }
    }
    std::hint::black_box(y)
}
