//! Kernels against a straightforward reference (candle's dequantized
//! weights times f32 activations), for every format, 1..=17 rows (two whole
//! row groups and one more), every instruction set this CPU has; batch
//! invariance, bit for bit; every path (scalar, AVX2, AVX-512, AMX tiles
//! and their portable model) against the scalar one bit for bit at 1..=130
//! rows, and at the extreme codes the SIMD paths' 16-bit intermediates are
//! sized for; and the tiled layout's round trip to GGUF.

use super::*;
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Every instruction set this CPU supports.
fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Amx]
        .into_iter()
        .filter(|isa| isa.available())
        .collect()
}

/// A random `n x k` matrix quantized to `dtype`, and its dequantized values.
fn weight(dtype: GgmlDType, n: usize, k: usize, rng: &mut StdRng) -> (QWeight, Vec<f32>) {
    let (qw, deq, _) = weight_and_gguf(dtype, n, k, rng);
    (qw, deq)
}

/// [`weight`] plus the GGUF bytes it was repacked from.
fn weight_and_gguf(
    dtype: GgmlDType,
    n: usize,
    k: usize,
    rng: &mut StdRng,
) -> (QWeight, Vec<f32>, Vec<u8>) {
    // Rows of different magnitudes, some with an offset, so scales and mins vary.
    let vals: Vec<f32> = (0..n * k)
        .map(|i| {
            let row = (i / k) as f32;
            (rng.random_range(-1.0f32..1.0) + (row % 3.0) * 0.3) * (1.0 + row * 0.1)
        })
        .collect();
    let t = Tensor::from_vec(vals, (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, dtype).unwrap();
    let deq = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let bytes = q.data().unwrap().to_vec();
    (QWeight::new(Arc::new(q)).expect("supported"), deq, bytes)
}

fn activations(rows: usize, k: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..rows * k)
        .map(|i| rng.random_range(-2.0f32..2.0) * (1.0 + (i / k) as f32))
        .collect()
}

fn reference(w: &[f32], x: &[f32], n: usize, k: usize, rows: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * n];
    for r in 0..rows {
        for c in 0..n {
            out[r * n + c] = (0..k).map(|i| w[c * k + i] * x[r * k + i]).sum();
        }
    }
    out
}

fn check_format(dtype: GgmlDType, k: usize) {
    let mut rng = StdRng::seed_from_u64(dtype as u64 * 1000 + k as u64);
    let n = 13;
    let (qw, deq) = weight(dtype, n, k, &mut rng);
    assert_eq!((qw.n(), qw.k()), (n, k));
    for rows in 1..=2 * GROUP + 1 {
        let x = activations(rows, k, &mut rng);
        let acts = act::Acts::new(qw.format(), &x, rows, k);
        // Same activation rounding as the kernels: only float order differs.
        let tight = reference(&deq, &acts.dequantize(), n, k, rows);
        let exact = reference(&deq, &x, n, k, rows);
        for isa in isas() {
            let mut out = vec![0f32; rows * n];
            qw.matmul_with(isa, &x, rows, &mut out);
            for r in 0..rows {
                let xmax = x[r * k..(r + 1) * k]
                    .iter()
                    .fold(0f32, |m, v| m.max(v.abs()));
                for c in 0..n {
                    let wabs: f32 = deq[c * k..(c + 1) * k].iter().map(|v| v.abs()).sum();
                    let i = r * n + c;
                    // f32 rounding over k products of magnitude <= |w| xmax.
                    let tol_tight = 3e-5 * wabs * xmax + 1e-4;
                    assert!(
                        (out[i] - tight[i]).abs() <= tol_tight,
                        "{dtype:?} {isa:?} rows {rows} ({r},{c}): {} vs {}",
                        out[i],
                        tight[i]
                    );
                    // 8-bit activations: each value off by at most xmax/254.
                    let tol_exact = wabs * xmax / 250.0 + 1e-4;
                    assert!(
                        (out[i] - exact[i]).abs() <= tol_exact,
                        "{dtype:?} {isa:?} rows {rows} ({r},{c}): {} vs f32 {}",
                        out[i],
                        exact[i]
                    );
                }
                let mut alone = vec![0f32; n];
                qw.matmul_with(isa, &x[r * k..(r + 1) * k], 1, &mut alone);
                assert!(
                    alone
                        .iter()
                        .zip(&out[r * n..(r + 1) * n])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dtype:?} {isa:?}: row {r} of {rows} differs from the row alone"
                );
            }
        }
    }
}

#[test]
fn q4k_matches_reference_and_is_batch_invariant() {
    check_format(GgmlDType::Q4K, 512);
    check_format(GgmlDType::Q4K, 768); // an odd block count, as TP shards have
}

#[test]
fn q6k_matches_reference_and_is_batch_invariant() {
    check_format(GgmlDType::Q6K, 512);
    check_format(GgmlDType::Q6K, 768);
}

#[test]
fn q8_0_matches_reference_and_is_batch_invariant() {
    check_format(GgmlDType::Q8_0, 128);
    check_format(GgmlDType::Q8_0, 96); // odd block count: the unpaired tail
}

#[test]
fn q5_0_matches_reference_and_is_batch_invariant() {
    check_format(GgmlDType::Q5_0, 128);
    check_format(GgmlDType::Q5_0, 96);
}

#[test]
fn q4_1_matches_reference_and_is_batch_invariant() {
    check_format(GgmlDType::Q4_1, 128);
    check_format(GgmlDType::Q4_1, 96);
}

#[test]
fn unsupported_formats_and_shapes_are_refused() {
    let t = Tensor::zeros((4, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
    let f32q = QTensor::quantize(&t, GgmlDType::F32).unwrap();
    assert!(QWeight::new(Arc::new(f32q)).is_none());
    let t = Tensor::zeros(256, candle_core::DType::F32, &Device::Cpu).unwrap();
    let one_d = QTensor::quantize(&t, GgmlDType::Q4K).unwrap();
    assert!(QWeight::new(Arc::new(one_d)).is_none());
}

#[test]
fn zero_rows_and_zero_activations() {
    let mut rng = StdRng::seed_from_u64(7);
    let (qw, _) = weight(GgmlDType::Q4K, 5, 256, &mut rng);
    qw.matmul(&[], 0, &mut []);
    let mut out = vec![1f32; 5];
    qw.matmul(&[0.0; 256], 1, &mut out);
    assert!(out.iter().all(|&v| v == 0.0), "{out:?}");
}

#[test]
fn tiles_read_back_as_the_gguf_bytes() {
    let mut rng = StdRng::seed_from_u64(11);
    for (dtype, k) in [
        (GgmlDType::Q4K, 512),
        (GgmlDType::Q6K, 512),
        (GgmlDType::Q8_0, 96),
        (GgmlDType::Q5_0, 96),
        (GgmlDType::Q4_1, 96),
    ] {
        // 37 rows: two whole tiles and a partial one.
        let (qw, _, gguf) = weight_and_gguf(dtype, 37, k, &mut rng);
        let all: Vec<u32> = (0..37).collect();
        assert!(qw.gguf_rows(&all).unwrap() == gguf, "{dtype:?}");
        let row_bytes = gguf.len() / 37;
        let picked = qw.gguf_rows(&[36, 0, 17]).unwrap();
        let want: Vec<u8> = [36, 0, 17]
            .iter()
            .flat_map(|&r| gguf[r * row_bytes..(r + 1) * row_bytes].to_vec())
            .collect();
        assert!(picked == want, "{dtype:?}");
        assert!(qw.gguf_rows(&[37]).is_err());
        let tiled_row = match dtype {
            GgmlDType::Q4K => row_bytes / 144 * 148,
            _ => row_bytes,
        };
        assert_eq!(qw.bytes(), 37usize.div_ceil(TILE) * TILE * tiled_row);
    }
}

/// Two float orders of the same integer sums: `a[r][c]` and `b[r][c]`
/// within 1e-5 of the sum of |w| |x| over the column.
fn assert_close(what: &str, a: &[f32], b: &[f32], deq: &[f32], x: &[f32], n: usize, k: usize) {
    for (i, (va, vb)) in a.iter().zip(b).enumerate() {
        let (r, c) = (i / n, i % n);
        let mag: f32 = (0..k).map(|j| (deq[c * k + j] * x[r * k + j]).abs()).sum();
        assert!(
            (va - vb).abs() <= 1e-5 * mag + 1e-5,
            "{what} ({r},{c}): {va} vs {vb}"
        );
    }
}

/// `w` times the first `rows` rows of `x` on the portable model of the
/// AMX tile instructions, and where this CPU has AMX, on the tiles
/// themselves, every row count on tiles (no threshold).
fn tile_paths(w: &QWeight, x: &[f32], rows: usize) -> Vec<(&'static str, Vec<f32>)> {
    let mut outs = Vec::new();
    let mut out = vec![f32::NAN; rows * w.n()];
    matmul_many_tile_model(x, rows, &mut [Product { w, out: &mut out }]);
    outs.push(("tile model", out));
    if Isa::Amx.available() {
        let mut out = vec![f32::NAN; rows * w.n()];
        matmul_many_tiles(x, rows, &mut [Product { w, out: &mut out }]);
        outs.push(("amx tiles", out));
    }
    outs
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The scalar path, every SIMD path this CPU has (AMX with its measured
/// threshold), the AMX tiles (where present) and their portable model give
/// the same bits for every int8 format at every row count 1..=130 (tile
/// groups of 16 with every tail, vector groups of 8), on a partial last
/// tile of columns; and row r of each call equals row r computed alone.
#[test]
fn every_path_gives_the_same_bits_at_1_to_130_rows() {
    if !Isa::Amx.available() {
        println!(
            "AMX tiles not tested on this host: {}",
            Isa::amx_refusal().unwrap_or("?")
        );
    }
    let mut rng = StdRng::seed_from_u64(41);
    for (dtype, k) in [
        (GgmlDType::Q4K, 512),
        (GgmlDType::Q6K, 512),
        (GgmlDType::Q8_0, 96),
        (GgmlDType::Q5_0, 96),
        (GgmlDType::Q4_1, 96),
    ] {
        let (n, most) = (21, 130);
        let (qw, _) = weight(dtype, n, k, &mut rng);
        let x = activations(most, k, &mut rng);
        // Each row alone, on the scalar reference.
        let mut alone = vec![0f32; most * n];
        for r in 0..most {
            let out = &mut alone[r * n..(r + 1) * n];
            qw.matmul_with(Isa::Scalar, &x[r * k..(r + 1) * k], 1, out);
        }
        for rows in 1..=most {
            let want = &alone[..rows * n];
            let mut outs: Vec<(String, Vec<f32>)> = isas()
                .into_iter()
                .map(|isa| {
                    let mut out = vec![f32::NAN; rows * n];
                    qw.matmul_with(isa, &x, rows, &mut out);
                    (isa.name().to_string(), out)
                })
                .collect();
            outs.extend(
                tile_paths(&qw, &x, rows)
                    .into_iter()
                    .map(|(w, o)| (w.to_string(), o)),
            );
            for (what, got) in &outs {
                if !same_bits(got, want) {
                    let i = got
                        .iter()
                        .zip(want)
                        .position(|(a, b)| a.to_bits() != b.to_bits())
                        .unwrap_or(0);
                    panic!(
                        "{dtype:?} {what} rows {rows}: ({}, {}) is {} where scalar alone gives {}",
                        i / n,
                        i % n,
                        got[i],
                        want[i]
                    );
                }
            }
        }
    }
}

/// GGUF bytes of an `n x k` matrix whose codes and scales all sit at their
/// format's extremes (`high`: largest codes; else smallest, the most
/// negative for Q6_K, Q8_0 and Q5_0; Q6_K's scales follow), so integer sums reach the bounds the SIMD
/// paths' 16-bit intermediates are sized for.
fn extreme_gguf(format: Format, n: usize, k: usize, high: bool) -> Vec<u8> {
    let bb = format.block_bytes();
    let mut blk = vec![0xFFu8; bb];
    let d = half::f16::from_f32(1.0 / 64.0).to_bits().to_le_bytes();
    match format {
        // d, dmin, scales and mins 63, codes 15 or 0.
        Format::Q4K => {
            blk[0..2].copy_from_slice(&d);
            blk[2..4].copy_from_slice(&d);
            blk[16..].fill(if high { 0xFF } else { 0 });
        }
        // Codes 63 or 0 (-32 after the offset), scales 127 or -128.
        Format::Q6K => {
            blk[..192].fill(if high { 0xFF } else { 0 });
            blk[192..208].fill(if high { 0x7F } else { 0x80 });
            blk[208..210].copy_from_slice(&d);
        }
        Format::Q8_0 => {
            blk[0..2].copy_from_slice(&d);
            blk[2..].fill(if high { 0x7F } else { 0x80 });
        }
        // Codes 31 or 0 (-16 after the offset).
        Format::Q5_0 => {
            blk[0..2].copy_from_slice(&d);
            blk[2..].fill(if high { 0xFF } else { 0 });
        }
        // Codes 15 or 0.
        Format::Q4_1 => {
            blk[0..2].copy_from_slice(&d);
            blk[2..4].copy_from_slice(&d);
            blk[4..].fill(if high { 0xFF } else { 0 });
        }
    }
    blk.repeat(n * k / format.block_len())
}

#[test]
fn extreme_codes_do_not_saturate() {
    for format in [
        Format::Q4K,
        Format::Q6K,
        Format::Q8_0,
        Format::Q5_0,
        Format::Q4_1,
    ] {
        let (n, k, rows) = (16, 512, 2);
        for high in [true, false] {
            let bytes = extreme_gguf(format, n, k, high);
            let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
                format.dtype(),
                &bytes,
                vec![n, k],
                &Device::Cpu,
            )
            .unwrap();
            let deq: Vec<f32> = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let qw = QWeight::new(Arc::new(q)).unwrap();
            // Every activation code at +127 in row 0, -127 in row 1.
            let x: Vec<f32> = (0..rows * k)
                .map(|i| if i < k { 1.0 } else { -1.0 })
                .collect();
            let want = reference(&deq, &x, n, k, rows);
            let mut scalar = vec![0f32; rows * n];
            qw.matmul_with(Isa::Scalar, &x, rows, &mut scalar);
            for isa in isas() {
                let mut out = vec![0f32; rows * n];
                qw.matmul_with(isa, &x, rows, &mut out);
                let what = format!("{format:?} high {high} {isa:?}");
                assert_close(&what, &out, &want, &deq, &x, n, k);
                assert!(same_bits(&out, &scalar), "{what}: bits differ from scalar");
            }
            for (what, out) in tile_paths(&qw, &x, rows) {
                let what = format!("{format:?} high {high} {what}");
                assert!(same_bits(&out, &scalar), "{what}: bits differ from scalar");
            }
        }
    }
}

#[test]
fn fused_products_equal_separate_ones_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(13);
    let k = 512;
    let ws: Vec<QWeight> = [
        (GgmlDType::Q4K, 37),
        (GgmlDType::Q6K, 16),
        (GgmlDType::Q8_0, 5),
        (GgmlDType::Q5_0, 21),
    ]
    .into_iter()
    .map(|(dt, n)| weight(dt, n, k, &mut rng).0)
    .collect();
    for rows in [1, 3, 9] {
        let x = activations(rows, k, &mut rng);
        for isa in isas() {
            let mut fused: Vec<Vec<f32>> =
                ws.iter().map(|w| vec![f32::NAN; rows * w.n()]).collect();
            let mut products: Vec<Product> = ws
                .iter()
                .zip(fused.iter_mut())
                .map(|(w, out)| Product { w, out })
                .collect();
            matmul_many_with(isa, &x, rows, &mut products);
            for (w, got) in ws.iter().zip(&fused) {
                let mut alone = vec![0f32; rows * w.n()];
                w.matmul_with(isa, &x, rows, &mut alone);
                assert!(
                    got.iter()
                        .zip(&alone)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{:?} {isa:?} rows {rows}",
                    w.format()
                );
            }
        }
    }
}

#[test]
fn many_rows_quantize_in_parallel_as_each_row_alone() {
    let mut rng = StdRng::seed_from_u64(17);
    let (rows, k) = (40, 2048);
    let x = activations(rows, k, &mut rng);
    for format in [Format::Q4K, Format::Q8_0] {
        let all = act::Acts::new(format, &x, rows, k);
        for r in [0, 17, rows - 1] {
            let one = act::Acts::new(format, &x[r * k..(r + 1) * k], 1, k);
            let span = |len: usize| r * len..(r + 1) * len;
            assert_eq!(all.q[span(k)], one.q[..]);
            assert_eq!(all.d[span(all.nb)], one.d[..]);
            assert_eq!(all.off[span(one.off.len())], one.off[..]);
            assert_eq!(all.fsum[span(one.fsum.len())], one.fsum[..]);
        }
    }
}
