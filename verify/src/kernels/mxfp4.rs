//! MXFP4 (OCP microscaling FP4) decoding: 32 E2M1 values share one E8M0
//! power-of-two scale. Two byte layouts carry the same numbers:
//!
//! - compressed-tensors `mxfp4-pack-quantized` (Hugging Face checkpoints):
//!   `weight_packed` `[rows, cols / 2]`, element `2i` in the low nibble of
//!   byte `i` and `2i + 1` in the high one; `weight_scale` `[rows, cols / 32]`.
//! - ggml `block_mxfp4` (GGUF type 39): per 32 values one scale byte, then
//!   16 bytes where byte `j` holds element `j` (low) and `j + 16` (high).
//!
//! [`Mxfp4Matrix`] keeps a weight packed (4.25 bits per value) and
//! multiplies it the way ggml's CPU backend does: each activation row is
//! quantized to Q8_0 (32 int8 values and one f16 scale per block) and
//! every block's dot product is an integer sum scaled by both scales. So
//! our logits follow llama.cpp's on the same file, rounding included.

/// E2M1 code -> value.
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// ggml's GGUF type id of `block_mxfp4`.
pub const GGML_TYPE_MXFP4: u32 = 39;

/// Bytes of one ggml block (32 values).
pub const BLOCK_BYTES: usize = 17;

/// The E8M0 scale `2^(e - 127)`. (`e = 255` is NaN in the OCP spec; no
/// checkpoint writes it, and it decodes to a huge finite power here.)
fn scale(e: u8) -> f32 {
    (2f64).powi(e as i32 - 127) as f32
}

/// Decodes compressed-tensors packing: `packed` `[rows, cols / 2]`,
/// `scales` `[rows, cols / 32]` -> `[rows, cols]` row-major.
///
/// Errors (as a message): lengths that do not match `rows` x `cols`, or
/// `cols` not a multiple of 32.
pub fn decode_packed(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, String> {
    if !cols.is_multiple_of(32)
        || packed.len() != rows * cols / 2
        || scales.len() != rows * cols / 32
    {
        return Err(format!(
            "MXFP4 [{rows}, {cols}] needs {} packed and {} scale bytes, got {} and {}",
            rows * cols / 2,
            rows * cols / 32,
            packed.len(),
            scales.len()
        ));
    }
    let mut out = Vec::with_capacity(rows * cols);
    for (i, &b) in packed.iter().enumerate() {
        let s = scale(scales[i * 2 / 32]);
        out.push(E2M1[(b & 15) as usize] * s);
        out.push(E2M1[(b >> 4) as usize] * s);
    }
    Ok(out)
}

/// Decodes ggml `block_mxfp4` data of `n` values (a multiple of 32).
///
/// Errors (as a message): a byte length that is not `n / 32` blocks.
pub fn decode_ggml(blocks: &[u8], n: usize) -> Result<Vec<f32>, String> {
    if !n.is_multiple_of(32) || blocks.len() != n / 32 * BLOCK_BYTES {
        return Err(format!(
            "MXFP4 tensor of {n} values needs {} bytes, got {}",
            n / 32 * BLOCK_BYTES,
            blocks.len()
        ));
    }
    let mut out = vec![0f32; n];
    for (b, o) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(32))
    {
        let s = scale(b[0]);
        for j in 0..16 {
            o[j] = E2M1[(b[1 + j] & 15) as usize] * s;
            o[j + 16] = E2M1[(b[1 + j] >> 4) as usize] * s;
        }
    }
    Ok(out)
}

/// ggml's E2M1 codes doubled, as integers (the scale is halved to match).
const KVALUES: [i32; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `2^(e - 128)`: the E8M0 scale halved, pairing with [`KVALUES`].
fn half_scale(e: u8) -> f32 {
    (2f64).powi(e as i32 - 128) as f32
}

/// A `[out, inp]` matrix kept as ggml `block_mxfp4` rows (`inp / 32`
/// blocks per row).
pub struct Mxfp4Matrix {
    blocks: Vec<u8>,
    out: usize,
    inp: usize,
}

/// One activation row as Q8_0: per 32 values, int8 codes and a scale.
struct Q8Row {
    q: Vec<i8>,
    d: Vec<f32>,
}

/// Q8_0 as ggml's x86 `quantize_row_q8_0`: scale `amax / 127` stored as
/// f16, codes `round_ties_even(x * 127 / amax)`.
fn quantize_q8_0(x: &[f32]) -> Q8Row {
    let mut q = Vec::with_capacity(x.len());
    let mut d = Vec::with_capacity(x.len() / 32);
    for b in x.chunks_exact(32) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        d.push(half::f16::from_f32(amax / 127.0).to_f32());
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        q.extend(b.iter().map(|v| (v * id).round_ties_even() as i8));
    }
    Q8Row { q, d }
}

impl Mxfp4Matrix {
    /// Wraps ggml block data (row-major, as GGUF stores a `[inp, out]`
    /// tensor).
    ///
    /// Errors (as a message): a length that does not match.
    pub fn from_ggml(blocks: Vec<u8>, out: usize, inp: usize) -> Result<Self, String> {
        if !inp.is_multiple_of(32) || blocks.len() != out * inp / 32 * BLOCK_BYTES {
            return Err(format!(
                "MXFP4 [{out}, {inp}] needs {} bytes, got {}",
                out * inp / 32 * BLOCK_BYTES,
                blocks.len()
            ));
        }
        Ok(Self { blocks, out, inp })
    }

    /// Repacks compressed-tensors data (see the module docs) losslessly.
    ///
    /// Errors (as a message): lengths that do not match.
    pub fn from_packed(
        packed: &[u8],
        scales: &[u8],
        out: usize,
        inp: usize,
    ) -> Result<Self, String> {
        decode_packed(packed, scales, out, inp)?; // checks the lengths
        let mut blocks = Vec::with_capacity(out * inp / 32 * BLOCK_BYTES);
        for (g, &e) in scales.iter().enumerate() {
            let src = &packed[g * 16..(g + 1) * 16];
            let code = |i: usize| (src[i / 2] >> (4 * (i % 2))) & 15;
            blocks.push(e);
            blocks.extend((0..16).map(|j| code(j) | (code(j + 16) << 4)));
        }
        Ok(Self { blocks, out, inp })
    }

    pub fn out(&self) -> usize {
        self.out
    }

    pub fn inp(&self) -> usize {
        self.inp
    }

    /// Bytes the packed weights occupy.
    pub fn bytes(&self) -> usize {
        self.blocks.len()
    }

    /// The weights as f32 `[out, inp]`.
    pub fn dequantize(&self) -> Vec<f32> {
        decode_ggml(&self.blocks, self.out * self.inp).expect("length checked at construction")
    }

    /// `x` `[n, inp]` times the transpose, `[n, out]`, with Q8_0
    /// activations. Row r of the result depends only on row r of `x`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let per_row = self.inp / 32 * BLOCK_BYTES;
        let mut y = Vec::with_capacity(x.len() / self.inp * self.out);
        for row in x.chunks_exact(self.inp) {
            let a = quantize_q8_0(row);
            for w in self.blocks.chunks_exact(per_row) {
                let mut sum = 0f32;
                for (b, blk) in w.chunks_exact(BLOCK_BYTES).enumerate() {
                    let q = &a.q[b * 32..(b + 1) * 32];
                    let mut si = 0i32;
                    for j in 0..16 {
                        si += KVALUES[(blk[1 + j] & 15) as usize] * q[j] as i32;
                        si += KVALUES[(blk[1 + j] >> 4) as usize] * q[j + 16] as i32;
                    }
                    sum += half_scale(blk[0]) * a.d[b] * si as f32;
                }
                y.push(sum);
            }
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(a[1], E2M1[7] * 0.5);
        assert_eq!(a[2], E2M1[14] * 0.5);
        assert!(decode_packed(&packed, &[e, e], 1, 32).is_err());
        assert!(decode_ggml(&block[1..], 32).is_err());
        let m = Mxfp4Matrix::from_packed(&packed, &[e], 1, 32).unwrap();
        assert_eq!(m.blocks, block);
        assert_eq!(m.dequantize(), a);
    }

    /// The packed product equals the f32 product of the dequantized
    /// weights and the Q8_0-rounded activations, and stays within Q8_0's
    /// rounding of the exact product.
    #[test]
    fn packed_product_is_q8_activations_times_exact_weights() {
        let (out, inp) = (3, 64);
        let packed: Vec<u8> = (0..out * inp / 2).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<u8> = (0..out * inp / 32).map(|i| 120 + (i % 5) as u8).collect();
        let m = Mxfp4Matrix::from_packed(&packed, &scales, out, inp).unwrap();
        let w = m.dequantize();
        let x: Vec<f32> = (0..2 * inp)
            .map(|i| ((i * 7) as f32 * 0.13).sin())
            .collect();
        let y = m.forward(&x);
        for r in 0..2 {
            let a = quantize_q8_0(&x[r * inp..(r + 1) * inp]);
            let xq: Vec<f32> = (0..inp).map(|i| a.q[i] as f32 * a.d[i / 32]).collect();
            for o in 0..out {
                let wrow = &w[o * inp..(o + 1) * inp];
                let want: f32 = wrow.iter().zip(&xq).map(|(a, b)| a * b).sum();
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
}
