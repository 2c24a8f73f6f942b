//! [`F32Matrix`] on every instruction set this CPU has: against an f64
//! reference, the paths against each other bit for bit, batch invariance,
//! strided and mapped views against contiguous copies, several products
//! in one pass, and the split of columns.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Against exact arithmetic, relative to `sum_i |w_i x_i|` (module docs).
const EXACT_TOL: f64 = 1e-5;

fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni]
        .into_iter()
        .filter(|isa| isa.available())
        .collect()
}

fn values(len: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..len)
        .map(|i| match i % 29 {
            0 => 0.0,
            _ => rng.random_range(-1.0f32..1.0) * (1 << (i % 7)) as f32,
        })
        .collect()
}

fn run(w: &F32Matrix, isa: Isa, x: &[f32], rows: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; rows * w.n()];
    w.matmul_with(isa, x, rows, &mut out);
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn every_isa_matches_an_f64_reference_and_the_others_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(11);
    // k = 96: whole chunks; 70, 33, 1: a padded last chunk.
    for (n, k) in [(37, 96), (20, 70), (9, 33), (5, 1), (11, 512)] {
        let w = values(n * k, &mut rng);
        let m = F32Matrix::from_f32(&w, n, k);
        let rows = 11;
        let x = values(rows * k, &mut rng);
        let base = run(&m, Isa::Scalar, &x, rows);
        for isa in isas() {
            let out = run(&m, isa, &x, rows);
            assert_eq!(bits(&out), bits(&base), "{isa:?} {n}x{k}");
            for r in 0..rows {
                for c in 0..n {
                    let (mut s, mut a) = (0f64, 0f64);
                    for i in 0..k {
                        let p = w[c * k + i] as f64 * x[r * k + i] as f64;
                        s += p;
                        a += p.abs();
                    }
                    let got = out[r * n + c] as f64;
                    assert!((got - s).abs() <= EXACT_TOL * a, "{isa:?} {got} vs {s}");
                }
            }
        }
    }
}

#[test]
fn a_row_gives_the_same_bits_among_any_number_of_rows() {
    let mut rng = StdRng::seed_from_u64(12);
    let (n, k) = (23, 100);
    let m = F32Matrix::from_f32(&values(n * k, &mut rng), n, k);
    let x = values(20 * k, &mut rng);
    for isa in isas() {
        let alone: Vec<Vec<f32>> = (0..20)
            .map(|r| run(&m, isa, &x[r * k..(r + 1) * k], 1))
            .collect();
        for rows in 1..=20 {
            let out = run(&m, isa, &x, rows);
            for (r, want) in alone.iter().enumerate().take(rows) {
                assert_eq!(
                    bits(&out[r * n..(r + 1) * n]),
                    bits(want),
                    "{isa:?}: row {r} of {rows}"
                );
            }
        }
    }
}

#[test]
fn strided_and_mapped_views_equal_contiguous_copies() {
    let mut rng = StdRng::seed_from_u64(13);
    let (n, k, rows) = (24, 160, 5);
    let vals = values(n * k, &mut rng);
    let big = F32Matrix::from_f32(&vals, n, k);
    let copy = |r0: usize, r1: usize, c0: usize, c1: usize| {
        let v: Vec<f32> = (r0..r1)
            .flat_map(|r| vals[r * k + c0..r * k + c1].to_vec())
            .collect();
        F32Matrix::from_f32(&v, r1 - r0, c1 - c0)
    };
    let views = [
        (big.rows(5..17).unwrap(), copy(5, 17, 0, k)),
        (big.columns(16..32).unwrap(), copy(0, n, 16, 32)),
        (big.columns(48..64).unwrap(), copy(0, n, 48, 64)),
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
        for isa in isas() {
            assert_eq!(
                bits(&run(view, isa, &x, rows)),
                bits(&run(contiguous, isa, &x, rows)),
                "{isa:?}"
            );
        }
    }
    let stride = 4 * k + 6;
    let mut file = vec![0xAAu8; 3 + n * stride];
    for r in 0..n {
        let row = &big.bytes()[r * 4 * k..(r + 1) * 4 * k];
        file[3 + r * stride..3 + r * stride + 4 * k].copy_from_slice(row);
    }
    let path = std::env::temp_dir().join(format!("specgate-f32m-{}", std::process::id()));
    std::fs::write(&path, &file).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    // SAFETY: the file is ours and not modified while mapped.
    let map = std::sync::Arc::new(unsafe { memmap2::Mmap::map(&f) }.unwrap());
    std::fs::remove_file(&path).unwrap();
    let m =
        F32Matrix::from_bytes(Bytes::mapped(map, 3..file.len()).unwrap(), n, k, stride).unwrap();
    let mut row = vec![0f32; k];
    m.row_f32(7, &mut row);
    assert_eq!(row, vals[7 * k..8 * k]);
    let x = values(rows * k, &mut rng);
    for isa in isas() {
        assert_eq!(
            bits(&run(&m, isa, &x, rows)),
            bits(&run(&big, isa, &x, rows))
        );
    }
}

#[test]
fn layouts_outside_the_storage_are_refused() {
    let b = Bytes::from(vec![0u8; 200]);
    assert!(F32Matrix::from_bytes(b.clone(), 5, 10, 40).is_ok());
    assert!(F32Matrix::from_bytes(b.clone(), 5, 10, 39).is_err());
    assert!(F32Matrix::from_bytes(b.clone(), 5, 11, 44).is_err());
    let m = F32Matrix::from_bytes(b, 5, 10, 40).unwrap();
    assert!(m.rows(0..6).is_err() && m.columns(9..11).is_err());
}

#[test]
fn products_sharing_an_input_equal_separate_calls_however_split() {
    let mut rng = StdRng::seed_from_u64(14);
    let (k, rows) = (130, 7);
    let ws: Vec<F32Matrix> = [17, 4, 33]
        .iter()
        .map(|&n| F32Matrix::from_f32(&values(n * k, &mut rng), n, k))
        .collect();
    let x = values(rows * k, &mut rng);
    for isa in isas() {
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0; rows * w.n()]).collect();
        let mut products: Vec<Product> = ws
            .iter()
            .zip(outs.iter_mut())
            .map(|(w, out)| Product { w, out })
            .collect();
        matmul_many_with(isa, &x, rows, &mut products);
        for (w, out) in ws.iter().zip(&outs) {
            assert_eq!(bits(out), bits(&run(w, isa, &x, rows)), "{isa:?}");
        }
        // Row shards of the last matrix: other chunk and block boundaries.
        let (w, whole) = (&ws[2], &outs[2]);
        for (lo, hi) in [(0, 3), (3, 33), (1, 30)] {
            let part = run(&w.rows(lo..hi).unwrap(), isa, &x, rows);
            for r in 0..rows {
                assert_eq!(
                    bits(&part[r * (hi - lo)..(r + 1) * (hi - lo)]),
                    bits(&whole[r * 33 + lo..r * 33 + hi]),
                    "{isa:?} rows {lo}..{hi}"
                );
            }
        }
    }
}
