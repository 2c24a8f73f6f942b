//! The row count from which AMX tiles beat the AVX-512 path, measured on
//! the CPU at hand, once per process and format (a few milliseconds).
//!
//! Why measured here rather than a constant: the crossing depends on the
//! format (Q6_K's sub-blocks are 16 inputs, a quarter of a tile's depth;
//! the 32-input formats carry little float work per block), on the core
//! and on its memory, and both paths give the same bits, so picking either
//! is only a question of speed.
//!
//! How: a synthetic weight of 64 output columns by 2048 inputs of the
//! format, and random activations; for 1, 2, 4, ... 64 rows, the best of
//! a few single-thread runs of each path over its four tiles. The answer
//! is the smallest measured count from which tiles are no slower at every
//! larger measured count; `usize::MAX` (never) where they always were, or
//! where AMX is not available.

use super::super::act::Acts;
use super::super::layout::{repack, tile_block_bytes, TILE};
use super::super::{Format, Isa, GROUP};
use super::Scratch;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Row counts measured.
const COUNTS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];

/// The measured threshold for `format` (see the module doc).
pub(crate) fn min_rows(format: Format) -> usize {
    static MIN: [OnceLock<usize>; Format::ALL.len()] =
        [const { OnceLock::new() }; Format::ALL.len()];
    let i = Format::ALL.iter().position(|&f| f == format).unwrap_or(0);
    *MIN[i].get_or_init(|| {
        let times = measure(format);
        choose(&times)
    })
}

/// `(rows, vector time, tile time)` for each count of [`COUNTS`], or
/// nothing where AMX is not available.
pub(crate) fn measure(format: Format) -> Vec<(usize, Duration, Duration)> {
    #[cfg(target_arch = "x86_64")]
    if Isa::Amx.available() {
        return measure_x86(format);
    }
    let _ = format;
    Vec::new()
}

/// The smallest count from which tiles are no slower at every larger one.
pub(crate) fn choose(times: &[(usize, Duration, Duration)]) -> usize {
    let mut min = usize::MAX;
    for &(rows, vector, tiles) in times.iter().rev() {
        if tiles > vector {
            break;
        }
        min = rows;
    }
    min
}

/// A weight of `n` columns by `k` inputs in `format`, built from
/// pseudo-random codes and sane scales (no GGUF file needed).
fn synthetic(format: Format, n: usize, k: usize) -> Vec<u8> {
    let nb = k / format.block_len();
    let bb = format.block_bytes();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut gguf: Vec<u8> = (0..n * nb * bb)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    // f16 scales of about 1/64 (and Q4_K's dmin / Q4_1's m) at their
    // offsets, so the float work runs on normal numbers.
    let scale = half::f16::from_f32(1.0 / 64.0).to_bits().to_le_bytes();
    for blk in gguf.chunks_exact_mut(bb) {
        let at: &[usize] = match format {
            Format::Q4K | Format::Q4_1 => &[0, 2],
            Format::Q6K => &[208],
            _ => &[0],
        };
        for &p in at {
            blk[p..p + 2].copy_from_slice(&scale);
        }
    }
    repack(format, &gguf, n, nb)
}

/// Best of a few runs of `f`, after one to warm the caches.
fn best(f: &mut dyn FnMut()) -> Duration {
    f();
    (0..5)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

/// Pseudo-random activations, `rows x k`.
fn activations(rows: usize, k: usize) -> Vec<f32> {
    (0..rows * k)
        .map(|i| ((i * 7919 % 2003) as f32 / 1001.0) - 1.0)
        .collect()
}

#[cfg(target_arch = "x86_64")]
fn measure_x86(format: Format) -> Vec<(usize, Duration, Duration)> {
    let (n, k) = (4 * TILE, 2048);
    let tiles = synthetic(format, n, k);
    let tb = (k / format.block_len()) * tile_block_bytes(format);
    let Some(mut hw) = super::tile::Hardware::new() else {
        return Vec::new();
    };
    let mut scratch = Scratch::default();
    COUNTS
        .iter()
        .map(|&rows| {
            let a = Acts::new(format, &activations(rows, k), rows, k);
            let mut res = [[0f32; TILE]; GROUP];
            let vector = best(&mut || {
                for t in 0..n / TILE {
                    let tile = &tiles[t * tb..(t + 1) * tb];
                    for r0 in (0..rows).step_by(GROUP) {
                        let rr = (rows - r0).min(GROUP);
                        let isa = Isa::Avx512Vnni;
                        super::super::tile_rows(isa, format, tile, &a, r0, rr, TILE, &mut res);
                    }
                }
                std::hint::black_box(&res);
            });
            let mut all = vec![[0f32; TILE]; rows];
            let tiled = best(&mut || {
                for t in 0..n / TILE {
                    let tile = &tiles[t * tb..(t + 1) * tb];
                    // SAFETY: a `Hardware` exists, so AMX and the AVX-512
                    // set are usable.
                    unsafe {
                        super::tile_product_hw(
                            &mut hw,
                            format,
                            tile,
                            &a,
                            rows,
                            &mut all,
                            &mut scratch,
                        )
                    };
                }
                std::hint::black_box(&all);
            });
            (rows, vector, tiled)
        })
        .collect()
}

/// The measured threshold for MXFP4 products (see the module doc): a
/// 64 x 2048 matrix of pseudo-random blocks, through the grouped product
/// on one thread's worth of work per path.
pub(crate) fn min_rows_mxfp4() -> usize {
    static MIN: OnceLock<usize> = OnceLock::new();
    *MIN.get_or_init(|| choose(&measure_mxfp4()))
}

/// `(rows, vector time, tile time)` for MXFP4, or nothing without AMX.
pub(crate) fn measure_mxfp4() -> Vec<(usize, Duration, Duration)> {
    use super::super::mxfp4::{Mxfp4Matrix, Q8Acts};
    if !Isa::Amx.available() {
        return Vec::new();
    }
    let (n, k) = (4 * TILE, 2048);
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let blocks: Vec<u8> = (0..n * k / 32 * 17)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Scale bytes near 2^0, so the float work stays normal.
            if i % 17 == 0 {
                120 + (state % 8) as u8
            } else {
                state as u8
            }
        })
        .collect();
    let Ok(w) = Mxfp4Matrix::from_ggml(blocks, n, k) else {
        return Vec::new();
    };
    COUNTS
        .iter()
        .map(|&rows| {
            let a = Q8Acts::new(&activations(rows, k), rows, k);
            let mut out = vec![0f32; rows * n];
            let mut run = |tiles: bool| {
                best(&mut || {
                    super::super::mxfp4::matmul_one_path(&w, &a, &mut out, tiles);
                    std::hint::black_box(&out);
                })
            };
            (rows, run(false), run(true))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_is_where_tiles_stay_faster() {
        let ms = Duration::from_millis;
        let t = |v: &[(u64, u64)]| -> Vec<(usize, Duration, Duration)> {
            v.iter()
                .enumerate()
                .map(|(i, &(a, b))| (1 << i, ms(a), ms(b)))
                .collect()
        };
        assert_eq!(choose(&t(&[(1, 5), (2, 3), (4, 4), (8, 5)])), 4);
        // A noisy win below a loss does not count.
        assert_eq!(choose(&t(&[(5, 1), (2, 3), (4, 4), (8, 5)])), 4);
        assert_eq!(choose(&t(&[(1, 5), (2, 3)])), usize::MAX);
        assert_eq!(choose(&t(&[(5, 1), (6, 3)])), 1);
        assert_eq!(choose(&[]), usize::MAX);
    }

    /// The synthetic weights repack and multiply (on whatever path this
    /// host has) to finite numbers.
    #[test]
    fn synthetic_weights_are_finite() {
        for format in [
            Format::Q4K,
            Format::Q6K,
            Format::Q8_0,
            Format::Q5_0,
            Format::Q4_1,
        ] {
            let k = 512;
            let tiles = synthetic(format, TILE, k);
            let x: Vec<f32> = (0..k).map(|i| (i % 13) as f32 - 6.0).collect();
            let a = Acts::new(format, &x, 1, k);
            let mut res = [[0f32; TILE]; GROUP];
            super::super::super::tile_rows(Isa::Scalar, format, &tiles, &a, 0, 1, TILE, &mut res);
            assert!(
                res[0].iter().all(|v| v.is_finite()),
                "{format:?}: {:?}",
                res[0]
            );
        }
    }
}
