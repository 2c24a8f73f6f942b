//! [`Bf16Matrix`] on every path this CPU has: against an f64 reference,
//! the widening paths against each other bit for bit (and `vdpbf16ps`
//! within `PATH_TOL`), batch invariance, strided and mapped views against
//! contiguous copies, several products in one pass, the split of columns,
//! the rounding of activations, and `SPECGATE_KERNEL_ISA`.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Against exact arithmetic on unrounded activations (module docs).
const EXACT_TOL: f64 = 1.0 / 256.0;
/// `vdpbf16ps` against the widening paths (module docs).
const PATH_TOL: f64 = 1.0 / 65536.0;

fn paths() -> Vec<Path> {
    [Path::Scalar, Path::Avx2, Path::Avx512, Path::Avx512Bf16]
        .into_iter()
        .filter(|p| p.available())
        .collect()
}

/// Values of mixed sign and a spread of magnitudes, with a few exact
/// zeros.
fn values(len: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..len)
        .map(|i| match i % 29 {
            0 => 0.0,
            _ => rng.random_range(-1.0f32..1.0) * (1 << (i % 7)) as f32,
        })
        .collect()
}

/// `(sum_i w[c][i] x[r][i], sum_i |w[c][i] x[r][i]|)` in f64.
fn reference(w: &[f32], x: &[f32], n: usize, k: usize, r: usize, c: usize) -> (f64, f64) {
    let (mut s, mut a) = (0f64, 0f64);
    for i in 0..k {
        let p = w[c * k + i] as f64 * x[r * k + i] as f64;
        s += p;
        a += p.abs();
    }
    debug_assert!(c < n);
    (s, a)
}

fn run(w: &Bf16Matrix, path: Path, x: &[f32], rows: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; rows * w.n()];
    w.matmul_on(path, x, rows, &mut out);
    out
}

/// Weights as the matrix holds them (rounded to bf16).
fn widened(w: &Bf16Matrix) -> Vec<f32> {
    let mut v = vec![0f32; w.n() * w.k()];
    for r in 0..w.n() {
        w.row_f32(r, &mut v[r * w.k()..(r + 1) * w.k()]);
    }
    v
}

#[test]
fn every_path_matches_an_f64_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    // k = 96: whole chunks; 70, 33, 1: a padded last chunk.
    for (n, k) in [(37, 96), (20, 70), (9, 33), (5, 1), (11, 512)] {
        let w = Bf16Matrix::from_f32(&values(n * k, &mut rng), n, k);
        let wf = widened(&w);
        let rows = 11;
        let x = values(rows * k, &mut rng);
        let xr: Vec<f32> = x.iter().map(|&v| from_bf16(to_bf16(v))).collect();
        for path in paths() {
            let out = run(&w, path, &x, rows);
            for r in 0..rows {
                for c in 0..n {
                    let got = out[r * n + c] as f64;
                    let (exact, abs) = reference(&wf, &x, n, k, r, c);
                    assert!(
                        (got - exact).abs() <= EXACT_TOL * abs,
                        "{path:?} {n}x{k} row {r} col {c}: {got} vs {exact}"
                    );
                    let (rounded, _) = reference(&wf, &xr, n, k, r, c);
                    assert!(
                        (got - rounded).abs() <= 1e-5 * abs,
                        "{path:?} {n}x{k} row {r} col {c}: {got} vs {rounded} (bf16 x)"
                    );
                }
            }
        }
    }
}

#[test]
fn widening_paths_agree_bit_for_bit_and_bf16_within_tolerance() {
    let mut rng = StdRng::seed_from_u64(2);
    let (n, k, rows) = (29, 200, 9);
    let w = Bf16Matrix::from_f32(&values(n * k, &mut rng), n, k);
    let wf = widened(&w);
    let x = values(rows * k, &mut rng);
    let base = run(&w, Path::Scalar, &x, rows);
    for path in paths() {
        let out = run(&w, path, &x, rows);
        if path != Path::Avx512Bf16 {
            let same = out
                .iter()
                .zip(&base)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{path:?} differs from the scalar path");
            continue;
        }
        let xr: Vec<f32> = x.iter().map(|&v| from_bf16(to_bf16(v))).collect();
        for r in 0..rows {
            for c in 0..n {
                let (_, abs) = reference(&wf, &xr, n, k, r, c);
                let d = (out[r * n + c] as f64 - base[r * n + c] as f64).abs();
                assert!(d <= PATH_TOL * abs, "vdpbf16ps row {r} col {c}: off by {d}");
            }
        }
    }
}

#[test]
fn a_row_gives_the_same_bits_among_any_number_of_rows() {
    let mut rng = StdRng::seed_from_u64(3);
    let (n, k) = (23, 100);
    let w = Bf16Matrix::from_f32(&values(n * k, &mut rng), n, k);
    let x = values(20 * k, &mut rng);
    for path in paths() {
        let alone: Vec<Vec<f32>> = (0..20)
            .map(|r| run(&w, path, &x[r * k..(r + 1) * k], 1))
            .collect();
        for rows in 1..=20 {
            let out = run(&w, path, &x, rows);
            for (r, want) in alone.iter().enumerate().take(rows) {
                let got = &out[r * n..(r + 1) * n];
                let same = got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{path:?}: row {r} of {rows} differs from the row alone"
                );
            }
        }
    }
}

#[test]
fn strided_and_mapped_views_equal_contiguous_copies() {
    let mut rng = StdRng::seed_from_u64(4);
    let (n, k, rows) = (24, 160, 5);
    let vals = values(n * k, &mut rng);
    let big = Bf16Matrix::from_f32(&vals, n, k);
    let copy = |r0: usize, r1: usize, c0: usize, c1: usize| {
        let v: Vec<f32> = (r0..r1)
            .flat_map(|r| vals[r * k + c0..r * k + c1].to_vec())
            .collect();
        Bf16Matrix::from_f32(&v, r1 - r0, c1 - c0)
    };
    // A row shard, a column shard (every other 32-column block's second
    // block), one of both, and one whose width is not whole chunks.
    let views = [
        (big.rows(5..17).unwrap(), copy(5, 17, 0, k)),
        (big.columns(32..64).unwrap(), copy(0, n, 32, 64)),
        (big.columns(96..128).unwrap(), copy(0, n, 96, 128)),
        (
            big.rows(3..20).unwrap().columns(17..150).unwrap(),
            copy(3, 20, 17, 150),
        ),
    ];
    for (view, contiguous) in &views {
        assert_eq!(
            view.bytes().len(),
            big.bytes().len(),
            "a view shares storage"
        );
        let x = values(rows * view.k(), &mut rng);
        for path in paths() {
            assert_eq!(
                run(view, path, &x, rows)
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                run(contiguous, path, &x, rows)
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                "{path:?}"
            );
        }
    }
    // The same matrix read from a file mapping at an odd offset, with
    // 6 bytes of other data between rows.
    let stride = 2 * k + 6;
    let mut file = vec![0xAAu8; 1 + n * stride];
    for r in 0..n {
        let row = &big.bytes()[r * 2 * k..(r + 1) * 2 * k];
        file[1 + r * stride..1 + r * stride + 2 * k].copy_from_slice(row);
    }
    let path = std::env::temp_dir().join(format!("specgate-bf16-{}", std::process::id()));
    std::fs::write(&path, &file).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    // SAFETY: the file is ours and not modified while mapped.
    let map = std::sync::Arc::new(unsafe { memmap2::Mmap::map(&f) }.unwrap());
    std::fs::remove_file(&path).unwrap();
    let mapped = Bytes::mapped(map, 1..file.len()).unwrap();
    let m = Bf16Matrix::from_bytes(mapped, n, k, stride).unwrap();
    let x = values(rows * k, &mut rng);
    for path in paths() {
        assert_eq!(run(&m, path, &x, rows), run(&big, path, &x, rows));
    }
}

#[test]
fn layouts_outside_the_storage_are_refused() {
    let b = Bytes::from(vec![0u8; 100]);
    assert!(Bf16Matrix::from_bytes(b.clone(), 5, 10, 20).is_ok());
    assert!(Bf16Matrix::from_bytes(b.clone(), 5, 10, 19).is_err());
    assert!(Bf16Matrix::from_bytes(b.clone(), 5, 11, 22).is_err());
    assert!(Bf16Matrix::from_bytes(b.clone(), usize::MAX / 2, 10, 20).is_err());
    let m = Bf16Matrix::from_bytes(b, 5, 10, 20).unwrap();
    assert!(m.rows(2..6).is_err() && m.columns(3..11).is_err());
    assert_eq!(m.rows(1..3).unwrap().n(), 2);
}

#[test]
fn products_sharing_an_input_equal_separate_calls() {
    let mut rng = StdRng::seed_from_u64(5);
    let (k, rows) = (130, 7);
    let ws: Vec<Bf16Matrix> = [17, 4, 33]
        .iter()
        .map(|&n| Bf16Matrix::from_f32(&values(n * k, &mut rng), n, k))
        .collect();
    let x = values(rows * k, &mut rng);
    for path in paths() {
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0; rows * w.n()]).collect();
        let mut products: Vec<Product> = ws
            .iter()
            .zip(outs.iter_mut())
            .map(|(w, out)| Product { w, out })
            .collect();
        matmul_many_on(path, &x, rows, &mut products);
        for (w, out) in ws.iter().zip(&outs) {
            assert_eq!(out, &run(w, path, &x, rows), "{path:?}");
        }
    }
}

#[test]
fn a_column_gives_the_same_bits_however_columns_are_split() {
    // Row shards start the column numbering (and so the chunks of the
    // team and the blocks of 4) at other places.
    let mut rng = StdRng::seed_from_u64(6);
    let (n, k, rows) = (61, 96, 3);
    let w = Bf16Matrix::from_f32(&values(n * k, &mut rng), n, k);
    let x = values(rows * k, &mut rng);
    for path in paths() {
        let whole = run(&w, path, &x, rows);
        for split in [1, 3, 30, 57] {
            for (lo, hi) in [(0, split), (split, n)] {
                let part = run(&w.rows(lo..hi).unwrap(), path, &x, rows);
                for r in 0..rows {
                    assert_eq!(
                        &part[r * (hi - lo)..(r + 1) * (hi - lo)],
                        &whole[r * n + lo..r * n + hi],
                        "{path:?} split at {split}"
                    );
                }
            }
        }
    }
}

#[test]
fn activations_round_to_nearest_even_like_half() {
    let mut rng = StdRng::seed_from_u64(7);
    let specials = [
        0.0f32,
        -0.0,
        1.0,
        f32::INFINITY,
        -f32::INFINITY,
        f32::MAX,
        1e-40,
    ];
    let ties = [f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000)];
    let random = (0..10_000).map(|_| f32::from_bits(rng.random::<u32>()));
    for v in specials.into_iter().chain(ties).chain(random) {
        let ours = to_bf16(v);
        if v.is_nan() {
            assert!(from_bf16(ours).is_nan(), "{v:e}");
        } else {
            assert_eq!(ours, half::bf16::from_f32(v).to_bits(), "{v:e}");
        }
    }
}

/// Run with `SPECGATE_KERNEL_ISA=scalar|avx2|avx512` to check that the
/// variable picks the path (without it, the best path is picked).
#[test]
fn the_path_follows_specgate_kernel_isa() {
    let want = match std::env::var("SPECGATE_KERNEL_ISA").as_deref() {
        Ok("scalar") => Path::Scalar,
        Ok("avx2") if Path::Avx2.available() => Path::Avx2,
        Ok("avx512") if Path::Avx512.available() => Path::Avx512,
        _ => Path::for_isa(Isa::detect()),
    };
    assert_eq!(Path::current(), want);
    assert!(Path::current().available());
}
