//! Activations quantized to 8 bits, once per matmul call, each row alone
//! (so a row's quantization never depends on the other rows of a batch).
//!
//! Two block sizes, matching the weight formats they pair with:
//! - Q8_K style (256 values per block) for Q4_K/Q6_K, with the sums of
//!   each 16 quantized values (the weights' offsets and mins need them);
//! - Q8_0 style (32 values per block) for Q8_0/Q5_0/Q4_1, with each
//!   block's scale times its quantized sum, and the scale spread over 8
//!   lanes for the SIMD kernels.

/// Quantized activations, `rows` rows of `k` values.
pub struct Acts {
    /// Values per block (256 or 32).
    pub block: usize,
    /// Blocks per row.
    pub nb: usize,
    /// `rows * k` quantized values, in [-127, 127].
    pub q: Vec<i8>,
    /// Scale of each block (`rows * nb`): value = d * q.
    pub d: Vec<f32>,
    /// Q8_K: the sum of each 16 quantized values (`rows * nb * 16`).
    pub bsums: Vec<i16>,
    /// Q8_0: d times the block's quantized sum (`rows * nb`).
    pub dsum: Vec<f32>,
    /// Q8_0: d repeated 8 times per block (`rows * nb * 8`).
    pub d8: Vec<f32>,
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

impl Acts {
    /// Q8_K-style quantization of `rows x k` (k a multiple of 256).
    pub fn q8k(x: &[f32], rows: usize, k: usize) -> Acts {
        let nb = k / 256;
        let mut q = vec![0i8; rows * k];
        let mut d = vec![0f32; rows * nb];
        let mut bsums = vec![0i16; rows * nb * 16];
        for (b, ((xb, qb), db)) in x
            .chunks_exact(256)
            .zip(q.chunks_exact_mut(256))
            .zip(d.iter_mut())
            .enumerate()
        {
            *db = quantize_block(xb, qb);
            for (s, q16) in bsums[b * 16..(b + 1) * 16]
                .iter_mut()
                .zip(qb.chunks_exact(16))
            {
                *s = q16.iter().map(|&v| v as i16).sum();
            }
        }
        Acts {
            block: 256,
            nb,
            q,
            d,
            bsums,
            dsum: Vec::new(),
            d8: Vec::new(),
        }
    }

    /// Q8_0-style quantization of `rows x k` (k a multiple of 32).
    pub fn q8_0(x: &[f32], rows: usize, k: usize) -> Acts {
        let nb = k / 32;
        let mut q = vec![0i8; rows * k];
        let mut d = vec![0f32; rows * nb];
        let mut dsum = vec![0f32; rows * nb];
        let mut d8 = vec![0f32; rows * nb * 8];
        for (b, (xb, qb)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
            let db = quantize_block(xb, qb);
            d[b] = db;
            dsum[b] = db * qb.iter().map(|&v| v as i32).sum::<i32>() as f32;
            d8[b * 8..(b + 1) * 8].fill(db);
        }
        Acts {
            block: 32,
            nb,
            q,
            d,
            bsums: Vec::new(),
            dsum,
            d8,
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
