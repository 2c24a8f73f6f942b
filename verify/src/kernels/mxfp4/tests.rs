//! The MXFP4 kernels against a reference written from the definition in
//! the module docs (not from the kernels' code), bit for bit, on every
//! instruction set this CPU has: random blocks with extreme scales and
//! all-zero rows, batch invariance over 1..=20 rows, grouped products,
//! strided views, the two storage layouts, and `SPECGATE_KERNEL_ISA`.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Every instruction set this CPU supports.
fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Amx]
        .into_iter()
        .filter(|isa| isa.available())
        .collect()
}

/// Random ggml rows: codes uniform, scales mostly near 1 with the extremes
/// 0, 1, 254 mixed in; every 7th row all-zero codes.
fn random_ggml(out: usize, inp: usize, rng: &mut StdRng) -> Vec<u8> {
    let mut v = Vec::with_capacity(out * row_bytes(inp));
    for o in 0..out {
        for _ in 0..inp / 32 {
            let e = match rng.random_range(0..20) {
                0 => 0,
                1 => 1,
                2 => 254,
                _ => rng.random_range(110u8..135),
            };
            v.push(e);
            v.extend((0..16).map(|_| if o % 7 == 3 { 0 } else { rng.random::<u8>() }));
        }
    }
    v
}

/// Rows of different magnitudes; row 2 all zeros, row 5 tiny values.
fn activations(rows: usize, inp: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..rows * inp)
        .map(|i| match i / inp {
            2 => 0.0,
            5 => rng.random_range(-1e-30f32..1e-30),
            r => rng.random_range(-2.0f32..2.0) * (1.0 + r as f32),
        })
        .collect()
}

/// The module docs' definition, from decoded codes and the Q8_0 values.
fn reference(w: &Mxfp4Matrix, x: &[f32], rows: usize) -> Vec<f32> {
    let a = Q8Acts::new(x, rows, w.inp);
    let nb = w.inp / 32;
    let mut y = vec![0f32; rows * w.out];
    for r in 0..rows {
        for o in 0..w.out {
            let mut acc = 0f32;
            for (b, blk) in w.row(o).chunks_exact(BLOCK_BYTES).enumerate() {
                let q = &a.q[(r * nb + b) * 32..][..32];
                let mut dot = 0i32;
                for j in 0..16 {
                    dot += KVALUES[(blk[1 + j] & 15) as usize] as i32 * q[j] as i32;
                    dot += KVALUES[(blk[1 + j] >> 4) as usize] as i32 * q[j + 16] as i32;
                }
                acc = (dot as f32).mul_add(e8m0_half(blk[0]) * a.d[r * nb + b], acc);
            }
            y[r * w.out + o] = acc;
        }
    }
    y
}

/// Bit-for-bit equality (any NaN equals any NaN: an overflowing extreme
/// scale may give inf - inf, whose NaN's sign bit the ISA picks).
fn assert_same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}: element {i}: {g:e} vs {w:e}"
        );
    }
}

fn product(isa: Isa, w: &Mxfp4Matrix, x: &[f32], rows: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; rows * w.out()];
    w.matmul_with(isa, x, rows, &mut y);
    y
}

#[test]
fn e8m0_scales_are_ggml_bits() {
    assert_eq!(e8m0_half(0).to_bits(), 0x0020_0000);
    assert_eq!(e8m0_half(1).to_bits(), 0x0040_0000);
    for e in 0..=255u8 {
        assert_eq!(e8m0_half(e) as f64, 2f64.powi(e as i32 - 128), "e = {e}");
    }
    assert_eq!(KVALUES_BIASED[0], 12);
    assert_eq!(KVALUES_BIASED[15], 0);
}

/// The same 32 values through both layouts decode alike.
#[test]
fn both_layouts_agree() {
    let codes: Vec<u8> = (0..32).map(|i| (i * 7 % 16) as u8).collect();
    let e = 126u8; // scale 1/2
    let packed: Vec<u8> = codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
    let a = decode_packed(&packed, &[e], 1, 32).unwrap();
    let mut block = vec![e];
    block.extend((0..16).map(|j| codes[j] | (codes[j + 16] << 4)));
    let b = decode_ggml(&block, 32).unwrap();
    assert_eq!(a, b);
    assert_eq!(a[1], 6.0 * 0.5); // code 7
    assert_eq!(a[2], -4.0 * 0.5); // code 14
    assert!(decode_packed(&packed, &[e, e], 1, 32).is_err());
    assert!(decode_ggml(&block[1..], 32).is_err());
    let m = Mxfp4Matrix::from_packed(&packed, &[e], 1, 32).unwrap();
    assert_eq!(&**m.storage(), &block[..]);
    assert_eq!(m.dequantize(), a);
}

/// `from_packed` checks lengths (without decoding) and gives the same
/// matrix as `from_ggml` on the same numbers.
#[test]
fn packed_and_ggml_constructors_agree() {
    let mut rng = StdRng::seed_from_u64(3);
    let (out, inp) = (19, 96);
    let codes: Vec<u8> = (0..out * inp).map(|_| rng.random_range(0..16)).collect();
    let scales: Vec<u8> = (0..out * inp / 32)
        .map(|_| rng.random_range(100..150))
        .collect();
    let packed: Vec<u8> = codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
    let mut ggml = Vec::new();
    for (c, &e) in codes.chunks(32).zip(&scales) {
        ggml.push(e);
        ggml.extend((0..16).map(|j| c[j] | (c[j + 16] << 4)));
    }
    let a = Mxfp4Matrix::from_packed(&packed, &scales, out, inp).unwrap();
    let b = Mxfp4Matrix::from_ggml(ggml.clone(), out, inp).unwrap();
    assert_eq!(&**a.storage(), &ggml[..]);
    assert_eq!(
        a.dequantize(),
        decode_packed(&packed, &scales, out, inp).unwrap()
    );
    let x = activations(3, inp, &mut rng);
    assert_same("packed vs ggml", &a.forward(&x), &b.forward(&x));
    assert!(Mxfp4Matrix::from_packed(&packed[1..], &scales, out, inp).is_err());
    assert!(Mxfp4Matrix::from_packed(&packed, &scales[1..], out, inp).is_err());
    assert!(Mxfp4Matrix::from_packed(&packed, &scales, out, inp + 1).is_err());
    assert!(Mxfp4Matrix::from_ggml(ggml[1..].to_vec(), out, inp).is_err());
    assert!(Mxfp4Matrix::from_ggml_strided(ggml.clone(), out, inp, 50).is_err());
}

/// Every ISA equals the reference bit for bit, across chunk boundaries
/// (70 blocks), short slabs (37 rows) and 1..=9 rows (a group and one).
#[test]
fn every_isa_matches_the_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    for (out, inp) in [(37, 32 * 70), (16, 32), (5, 32 * 9), (1, 64)] {
        let w = Mxfp4Matrix::from_ggml(random_ggml(out, inp, &mut rng), out, inp).unwrap();
        let t = w.tiled();
        for rows in [1, 2, 3, 8, 9] {
            let x = activations(rows, inp, &mut rng);
            let want = reference(&w, &x, rows);
            for isa in isas() {
                let what = format!("{} [{out}x{inp}] rows {rows}", isa.name());
                assert_same(&what, &product(isa, &w, &x, rows), &want);
                assert_same(&(what + " tiled"), &product(isa, &t, &x, rows), &want);
            }
        }
    }
}

/// Ordinary scales: the product is the dequantized weights times the
/// Q8_0-rounded activations, and within Q8_0's rounding of the exact one.
#[test]
fn product_is_q8_activations_times_exact_weights() {
    let (out, inp) = (3, 64);
    let packed: Vec<u8> = (0..out * inp / 2).map(|i| (i * 37 % 256) as u8).collect();
    let scales: Vec<u8> = (0..out * inp / 32).map(|i| 120 + (i % 5) as u8).collect();
    let m = Mxfp4Matrix::from_packed(&packed, &scales, out, inp).unwrap();
    let w = m.dequantize();
    let x: Vec<f32> = (0..2 * inp)
        .map(|i| ((i * 7) as f32 * 0.13).sin())
        .collect();
    let y = m.forward(&x);
    let xq = Q8Acts::new(&x, 2, inp).dequantize();
    for r in 0..2 {
        for o in 0..out {
            let wrow = &w[o * inp..(o + 1) * inp];
            let want: f32 = wrow.iter().zip(&xq[r * inp..]).map(|(a, b)| a * b).sum();
            let exact: f32 = wrow.iter().zip(&x[r * inp..]).map(|(a, b)| a * b).sum();
            let got = y[r * out + o];
            assert!(
                (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                "{got} vs {want}"
            );
            assert!(
                (got - exact).abs() < 0.05 * (1.0 + exact.abs()),
                "{got} vs {exact}"
            );
        }
    }
}

/// Row r alone gives the same bits as row r among 1..=20 rows.
#[test]
fn batch_invariant_on_every_isa() {
    let mut rng = StdRng::seed_from_u64(2);
    let (out, inp) = (40, 32 * 12);
    let w = Mxfp4Matrix::from_ggml(random_ggml(out, inp, &mut rng), out, inp).unwrap();
    let x = activations(20, inp, &mut rng);
    for (isa, w) in isas()
        .into_iter()
        .flat_map(|i| [(i, w.clone()), (i, w.tiled())])
    {
        let alone: Vec<Vec<f32>> = (0..20)
            .map(|r| product(isa, &w, &x[r * inp..(r + 1) * inp], 1))
            .collect();
        for rows in 1..=20 {
            let y = product(isa, &w, &x, rows);
            for (r, want) in alone[..rows].iter().enumerate() {
                let what = format!("{} row {r} of {rows}", isa.name());
                assert_same(&what, &y[r * out..(r + 1) * out], want);
            }
        }
    }
}

/// A grouped product's entry point.
type GroupedFn = fn(&mut [Mxfp4Product]);

/// AMX tiles (where this CPU has them) and their portable model give the
/// definition's bits at every row count 1..=130 (16-row tile groups with
/// every tail), for matrices kept in rows and tiled, with a partial slab.
#[test]
fn tile_paths_match_the_reference_at_1_to_130_rows() {
    let mut rng = StdRng::seed_from_u64(9);
    let (out, inp, most) = (21, 32 * 3, 130);
    let w = Mxfp4Matrix::from_ggml(random_ggml(out, inp, &mut rng), out, inp).unwrap();
    let x = activations(most, inp, &mut rng);
    let want = reference(&w, &x, most);
    for w in [w.clone(), w.tiled()] {
        for rows in 1..=most {
            let acts = Q8Acts::new(&x, rows, inp);
            let mut paths: Vec<(&str, GroupedFn)> = vec![("tile model", matmul_grouped_tile_model)];
            if Isa::Amx.available() {
                paths.push(("amx tiles", matmul_grouped_tiles));
            }
            for (what, f) in paths {
                let mut y = vec![f32::NAN; rows * out];
                f(&mut [Mxfp4Product {
                    w: &w,
                    acts: &acts,
                    out: &mut y,
                }]);
                let what = format!("{what} tiled {} rows {rows}", w.is_tiled());
                assert_same(&what, &y, &want[..rows * out]);
            }
        }
    }
}

/// Several experts with their own routed rows (none, one, many) in one
/// grouped call equal each product computed alone.
#[test]
fn grouped_equals_one_by_one() {
    let mut rng = StdRng::seed_from_u64(4);
    let inp = 32 * 5;
    // Tiled and row matrices mixed in one call.
    let ws: Vec<Mxfp4Matrix> = [21, 16, 3, 50]
        .iter()
        .map(|&out| Mxfp4Matrix::from_ggml(random_ggml(out, inp, &mut rng), out, inp).unwrap())
        .enumerate()
        .map(|(i, w)| if i % 2 == 0 { w.tiled() } else { w })
        .collect();
    let rows = [4, 0, 1, 11];
    let xs: Vec<Vec<f32>> = rows
        .iter()
        .map(|&r| activations(r, inp, &mut rng))
        .collect();
    let acts: Vec<Q8Acts> = xs
        .iter()
        .zip(rows)
        .map(|(x, r)| Q8Acts::new(x, r, inp))
        .collect();
    for isa in isas() {
        let mut outs: Vec<Vec<f32>> = ws
            .iter()
            .zip(rows)
            .map(|(w, r)| vec![f32::NAN; r * w.out()])
            .collect();
        let mut products: Vec<Mxfp4Product> = ws
            .iter()
            .zip(&acts)
            .zip(outs.iter_mut())
            .map(|((w, acts), out)| Mxfp4Product { w, acts, out })
            .collect();
        matmul_grouped_with(isa, &mut products);
        for ((w, x), (r, got)) in ws.iter().zip(&xs).zip(rows.iter().zip(&outs)) {
            assert_same(isa.name(), got, &product(isa, w, x, *r));
        }
    }
}

/// A strided view (a row and column range of a bigger matrix, and rows
/// with padding between them) computes what a contiguous copy does.
#[test]
fn strided_views_equal_contiguous_copies() {
    let mut rng = StdRng::seed_from_u64(5);
    let (out, inp) = (45, 32 * 8);
    let big = Mxfp4Matrix::from_ggml(random_ggml(out, inp, &mut rng), out, inp).unwrap();
    let view = big.view(3..40, 64..192).unwrap();
    assert_eq!(
        (view.out(), view.inp(), view.row_stride().unwrap()),
        (37, 128, big.row_stride().unwrap())
    );
    let mut copy = Vec::new();
    for o in 3..40 {
        copy.extend_from_slice(&big.row(o)[row_bytes(64)..row_bytes(192)]);
    }
    let copy = Mxfp4Matrix::from_ggml(copy, 37, 128).unwrap();
    assert_eq!(view.dequantize(), copy.dequantize());
    let x = activations(6, 128, &mut rng);
    for isa in isas() {
        assert_same(
            isa.name(),
            &product(isa, &view, &x, 6),
            &product(isa, &copy, &x, 6),
        );
    }
    // Padded rows (stride 3 bytes longer than a row), storage ending at
    // the last row's end.
    let rb = row_bytes(128);
    let mut padded = Vec::new();
    for o in 0..37 {
        padded.extend_from_slice(&copy.row(o));
        if o < 36 {
            padded.extend_from_slice(&[0xAB; 3]);
        }
    }
    let p = Mxfp4Matrix::from_ggml_strided(padded.clone(), 37, 128, rb + 3).unwrap();
    assert_same("padded", &p.forward(&x), &copy.forward(&x));
    assert!(Mxfp4Matrix::from_ggml_strided(padded[1..].to_vec(), 37, 128, rb + 3).is_err());
    assert!(big.view(3..46, 0..32).is_err());
    assert!(big.view(0..1, 16..32).is_err());
    assert_eq!(
        big.view(4..4, 0..32).unwrap().forward(&[]),
        Vec::<f32>::new()
    );
}

/// Tiling keeps every row's bytes (put back by `row`), a tiled matrix
/// reports no row stride, and its views equal the row matrix's views.
#[test]
fn tiles_hold_the_rows() {
    let mut rng = StdRng::seed_from_u64(7);
    for (out, inp) in [(37, 32 * 3), (16, 32), (1, 64), (0, 32)] {
        let w = Mxfp4Matrix::from_ggml(random_ggml(out, inp, &mut rng), out, inp).unwrap();
        let t = w.tiled();
        // An empty matrix has nothing to tile and stays as it is.
        assert_eq!((t.is_tiled(), w.is_tiled()), (out > 0, false));
        assert_eq!(t.row_stride().is_none(), out > 0);
        for o in 0..out {
            assert_eq!(t.row(o), w.row(o), "row {o} of [{out}x{inp}]");
        }
        assert_eq!(t.dequantize(), w.dequantize());
        if out > 4 {
            let (a, b) = (
                t.view(2..5, 32..inp).unwrap(),
                w.view(2..5, 32..inp).unwrap(),
            );
            assert_eq!(a.dequantize(), b.dequantize());
        }
    }
}

/// Zero rows of activations, or a matrix without rows, is no work and
/// no panic.
#[test]
fn empty_products() {
    let w = Mxfp4Matrix::from_ggml(vec![0u8; 2 * BLOCK_BYTES], 2, 32).unwrap();
    for isa in isas() {
        let mut y: Vec<f32> = vec![];
        w.matmul_with(isa, &[], 0, &mut y);
    }
    let x = [1f32; 32];
    assert_eq!(w.forward(&x), vec![0.0, 0.0]);
}

/// Child of [`kernel_isa_env_is_respected`]: checks [`Isa::current`]
/// against `SPECGATE_KERNEL_ISA` in a fresh process.
#[test]
#[ignore = "run by kernel_isa_env_is_respected in a child process"]
fn child_isa_from_env() {
    let asked = match std::env::var("SPECGATE_KERNEL_ISA").as_deref() {
        Ok("scalar") => Some(Isa::Scalar),
        Ok("avx2") => Some(Isa::Avx2),
        Ok("avx512") => Some(Isa::Avx512Vnni),
        Ok("amx") => Some(Isa::Amx),
        _ => None,
    };
    let want = asked.filter(|i| i.available()).unwrap_or_else(Isa::detect);
    assert_eq!(Isa::current(), want);
    let mut rng = StdRng::seed_from_u64(6);
    let w = Mxfp4Matrix::from_ggml(random_ggml(20, 64, &mut rng), 20, 64).unwrap();
    let x = activations(3, 64, &mut rng);
    let mut y = vec![0f32; 60];
    w.matmul(&x, 3, &mut y);
    assert_same("current", &y, &product(want, &w, &x, 3));
    println!("MXFP4-ISA {}", want.name());
    println!("AMX-STATUS {}", crate::kernels::amx_status());
}

#[test]
fn kernel_isa_env_is_respected() {
    let exe = std::env::current_exe().unwrap();
    // An ISA this CPU lacks runs the best one it has, and the AMX status
    // says why tiles are off.
    for (env, asked) in [
        ("scalar", Isa::Scalar),
        ("avx2", Isa::Avx2),
        ("avx512", Isa::Avx512Vnni),
        ("amx", Isa::Amx),
    ] {
        let want = if asked.available() {
            asked
        } else {
            Isa::detect()
        };
        let out = std::process::Command::new(&exe)
            .args(["--exact", "kernels::mxfp4::tests::child_isa_from_env"])
            .args(["--ignored", "--nocapture", "--test-threads=1"])
            .env("SPECGATE_KERNEL_ISA", env)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{env}: {stdout}");
        assert!(
            stdout.contains(&format!("MXFP4-ISA {}", want.name())),
            "{env}: {stdout}"
        );
        let amx_on = want == Isa::Amx;
        assert_eq!(
            stdout.contains("AMX-STATUS on, tiles from rows: Q4K"),
            amx_on,
            "{env}: {stdout}"
        );
        if !Isa::Amx.available() {
            let why = Isa::amx_refusal().expect("a reason where AMX is unavailable");
            assert!(
                stdout.contains(&format!("AMX-STATUS off: {why}")),
                "{env}: {stdout}"
            );
        }
    }
}
