//! Activations quantized to 8 bits, once per matmul call, each row alone
//! (so a row's quantization never depends on the other rows of a batch),
//! with the per-block sums the weight format's offsets and mins need.
//!
//! Block sizes match the weight format: 256 values (Q8_K style) for Q4_K
//! and Q6_K, 32 (Q8_0 style) for Q8_0, Q5_0 and Q4_1. The sums every
//! format of a block size needs are kept, so one quantization serves all
//! weights that read the same input (q, k and v; gate and up):
//! - 256: `fsum`, minus the sum of each 32 codes (8 per block), for Q4_K's
//!   sub-block mins; `off`, -32 times the sum of each 16 codes (16 per
//!   block), the starting value of a Q6_K sub-block's integer dot (its
//!   codes are stored +32);
//! - 32: `off`, the block's code sum (Q8_0 and Q5_0 kernels start from
//!   -128 / -16 times it, the offset of their unsigned weight codes);
//!   `fsum`, the block's scale times its code sum, for Q4_1's min.

use super::Format;

/// Quantized activations, `rows` rows of `k` values.
pub struct Acts {
    /// Values per block (256 or 32).
    pub block: usize,
    /// Blocks per row.
    pub nb: usize,
    /// `rows * k` codes in [-127, 127].
    pub q: Vec<i8>,
    /// Scale of each block (`rows * nb`): value = d * q.
    pub d: Vec<f32>,
    /// Integer sums per block or sub-block (see the module doc).
    pub off: Vec<i32>,
    /// Float sums per block or sub-block (see the module doc).
    pub fsum: Vec<f32>,
}

/// Quantizes one block: returns d with `x ~= d * q`, q in [-127, 127].
#[inline]
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() {
        q.fill(0);
        return if amax.is_finite() { 0.0 } else { f32::NAN };
    }
    let d = amax / 127.0;
    let id = 127.0 / amax;
    for (o, v) in q.iter_mut().zip(x) {
        *o = (v * id).round().clamp(-127.0, 127.0) as i8;
    }
    d
}

/// One block's input and the places its codes, scale and sums go.
type BlockOut<'a> = (
    (&'a [f32], &'a mut [i8]),
    (&'a mut f32, (&'a mut [i32], &'a mut [f32])),
);

/// Inputs from which quantization is worth splitting over the thread pool
/// (below, waking the pool costs more than the work).
const PARALLEL_VALUES: usize = 1 << 16;

fn code_sum(q: &[i8]) -> i32 {
    q.iter().map(|&v| v as i32).sum()
}

impl Acts {
    /// Quantizes `rows x k` for weights of `format`, or of any format with
    /// the same block length (k a multiple of it).
    pub fn new(format: Format, x: &[f32], rows: usize, k: usize) -> Acts {
        let block = if format.k_quant() { 256 } else { 32 };
        let nb = k / block;
        let mut q = vec![0i8; rows * k];
        let mut d = vec![0f32; rows * nb];
        let (per_off, per_fsum) = if block == 256 { (16, 8) } else { (1, 1) };
        let mut off = vec![0i32; rows * nb * per_off];
        let mut fsum = vec![0f32; rows * nb * per_fsum];
        // Blocks are independent: many rows (prefill) quantize in parallel,
        // with the same result as in sequence.
        let quantize = |((xb, qb), (db, (ob, fb))): BlockOut| {
            *db = quantize_block(xb, qb);
            if block == 256 {
                for (s, q32) in fb.iter_mut().zip(qb.chunks_exact(32)) {
                    *s = -(code_sum(q32) as f32);
                }
                for (o, q16) in ob.iter_mut().zip(qb.chunks_exact(16)) {
                    *o = -32 * code_sum(q16);
                }
            } else {
                ob[0] = code_sum(qb);
                fb[0] = *db * ob[0] as f32;
            }
        };
        let x = &x[..rows * k];
        if rows * k >= PARALLEL_VALUES {
            use rayon::prelude::*;
            x.par_chunks_exact(block)
                .zip(q.par_chunks_exact_mut(block))
                .zip(
                    d.par_iter_mut().zip(
                        off.par_chunks_exact_mut(per_off)
                            .zip(fsum.par_chunks_exact_mut(per_fsum)),
                    ),
                )
                .for_each(quantize);
        } else {
            x.chunks_exact(block)
                .zip(q.chunks_exact_mut(block))
                .zip(
                    d.iter_mut().zip(
                        off.chunks_exact_mut(per_off)
                            .zip(fsum.chunks_exact_mut(per_fsum)),
                    ),
                )
                .for_each(quantize);
        }
        Acts {
            block,
            nb,
            q,
            d,
            off,
            fsum,
        }
    }

    /// The dequantized values (tests' reference).
    pub fn dequantize(&self) -> Vec<f32> {
        self.q
            .iter()
            .enumerate()
            .map(|(i, &v)| self.d[i / self.block] * v as f32)
            .collect()
    }
}
