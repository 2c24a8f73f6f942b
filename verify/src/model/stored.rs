//! [`Stored`]: a weight matrix exactly as a checkpoint stores it (its ggml
//! type, its bytes, its row stride), sliced to a rank's rows or columns
//! without decoding, and turned into a [`Linear`] over the kernel for its
//! format. Family-neutral: every family's loader reads its matrices here,
//! so no family keeps an f32 copy of a quantized or bf16 matrix.
//!
//! A GGUF matrix is a view of the file's mapping: F32, BF16 and MXFP4
//! weights are multiplied in place (row and column shards are strided
//! views); the block-quantized formats our tiled kernels implement are
//! repacked once into tiles (same size); other ggml formats stay quantized
//! under candle's matmul. F16 is the one format widened (to f32).

use super::linear::Linear;
use super::loader::SafetensorsWeights;
use crate::error::{Result, VerifyError};
use crate::gguf::{block_layout, candle_dtype, types};
use crate::kernels::bf16::Bf16Matrix;
use crate::kernels::bytes::Bytes;
use crate::kernels::f32::F32Matrix;
use crate::kernels::mxfp4::Mxfp4Matrix;
use crate::kernels::{Format, QWeight};
use std::ops::Range;

/// A `[out, inp]` matrix in its stored format: row `o` starts at byte
/// `o * row_stride` of `bytes` and holds `inp` values of ggml type `dtype`.
///
/// Invariant (checked by [`Stored::new`]): `inp` is whole blocks of the
/// type, and `bytes` holds every row.
#[derive(Clone)]
pub(crate) struct Stored {
    pub(crate) name: String,
    pub(crate) dtype: u32,
    pub(crate) bytes: Bytes,
    pub(crate) out: usize,
    pub(crate) inp: usize,
    pub(crate) row_stride: usize,
}

fn bad(m: String) -> VerifyError {
    VerifyError::BadConfig(m)
}

impl Stored {
    /// A dense row-major matrix (`row_stride` = one row's bytes).
    ///
    /// Errors: a type whose layout is unknown, rows that are not whole
    /// blocks, or too few bytes (each naming `name`).
    pub(crate) fn new(
        name: &str,
        dtype: u32,
        bytes: Bytes,
        out: usize,
        inp: usize,
    ) -> Result<Stored> {
        let (blk, bb) = block_layout(dtype)
            .ok_or_else(|| bad(format!("{name}: ggml type {dtype} is not a known layout")))?;
        if !inp.is_multiple_of(blk) {
            return Err(bad(format!(
                "{name}: rows of {inp} values are not whole blocks of {blk}"
            )));
        }
        let row_stride = inp / blk * bb;
        if bytes.len() < out * row_stride {
            return Err(bad(format!(
                "{name}: [{out}, {inp}] of type {dtype} needs {} bytes, got {}",
                out * row_stride,
                bytes.len()
            )));
        }
        Ok(Stored {
            name: name.to_string(),
            dtype,
            bytes,
            out,
            inp,
            row_stride,
        })
    }

    /// Bytes of `n` values of this matrix's type (whole blocks).
    fn span_bytes(&self, n: usize) -> usize {
        let (blk, bb) = block_layout(self.dtype).expect("checked at construction");
        n / blk * bb
    }

    /// Output rows `r` and input columns `c` of this matrix, as a view (no
    /// bytes copied).
    ///
    /// Errors: ranges outside the matrix, or columns that do not start and
    /// end on the type's blocks (a tensor-parallel split of a quantized
    /// matrix must cut between blocks).
    pub(crate) fn select(&self, r: Range<usize>, c: Range<usize>) -> Result<Stored> {
        let (blk, _) = block_layout(self.dtype).expect("checked at construction");
        if r.start > r.end || r.end > self.out || c.start > c.end || c.end > self.inp {
            return Err(bad(format!(
                "{}: rows {r:?} / columns {c:?} outside [{}, {}]",
                self.name, self.out, self.inp
            )));
        }
        if !c.start.is_multiple_of(blk) || !c.end.is_multiple_of(blk) {
            return Err(bad(format!(
                "{}: columns {c:?} cut a block of {blk} values; choose a tensor-parallel \
                 size that splits this width into whole blocks",
                self.name
            )));
        }
        let from = r.start * self.row_stride + self.span_bytes(c.start);
        let len = if r.is_empty() {
            0
        } else {
            (r.len() - 1) * self.row_stride + self.span_bytes(c.len())
        };
        let bytes = self
            .bytes
            .slice(from..from + len)
            .ok_or_else(|| bad(format!("{}: selection past its bytes", self.name)))?;
        Ok(Stored {
            name: self.name.clone(),
            dtype: self.dtype,
            bytes,
            out: r.len(),
            inp: c.len(),
            row_stride: self.row_stride,
        })
    }

    /// The rows' bytes packed one after another (a copy; rows of a
    /// strided view become contiguous).
    fn packed(&self) -> Vec<u8> {
        let row = self.span_bytes(self.inp);
        let mut v = Vec::with_capacity(self.out * row);
        for o in 0..self.out {
            v.extend_from_slice(&self.bytes[o * self.row_stride..o * self.row_stride + row]);
        }
        v
    }

    /// The matrix as a [`Linear`] over the kernel for its format.
    ///
    /// Errors: a format no kernel here or in candle multiplies.
    pub(crate) fn into_linear(self) -> Result<Linear> {
        let wrap = |e: String| bad(format!("{}: {e}", self.name));
        let (out, inp) = (self.out, self.inp);
        Ok(match self.dtype {
            types::F32 => Linear::from_f32(
                F32Matrix::from_bytes(self.bytes.clone(), out, inp, self.row_stride)
                    .map_err(wrap)?,
            ),
            types::BF16 => Linear::from_bf16(
                Bf16Matrix::from_bytes(self.bytes.clone(), out, inp, self.row_stride)
                    .map_err(wrap)?,
            ),
            types::F16 => {
                let w: Vec<f32> = self
                    .packed()
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect();
                self.bytes.release();
                Linear::from_f32(F32Matrix::from_f32(&w, out, inp))
            }
            types::MXFP4 => Linear::from_mxfp4(
                Mxfp4Matrix::from_ggml_strided(self.bytes.clone(), out, inp, self.row_stride)
                    .map_err(wrap)?,
            ),
            t => {
                let dtype = candle_dtype(t)
                    .ok_or_else(|| wrap(format!("ggml type {t} has no matrix product here")))?;
                let data = self.packed();
                // Repacked below: the mapped source is not read again.
                self.bytes.release();
                match Format::of(dtype) {
                    Some(f) if crate::kernels::backend() == crate::kernels::Backend::Native => {
                        Linear::from_quantized(
                            QWeight::from_gguf(f, &data, out, inp).map_err(wrap)?,
                        )
                    }
                    _ => Linear::from_candle_quantized(dtype, &data, out, inp)?,
                }
            }
        })
    }
}

/// Rows `rows` of the `[out, inp]` safetensors matrix `name`, as stored
/// (only those rows' bytes are copied out of the mapping).
///
/// Errors: a missing or mis-shaped tensor, a non-float dtype, or rows
/// outside the matrix (each naming `name`).
pub(crate) fn from_safetensors(
    st: &SafetensorsWeights,
    name: &str,
    (out, inp): (usize, usize),
    rows: Range<usize>,
) -> Result<Stored> {
    let (data, dtype) = st.raw(name, &[out, inp])?;
    let t = ggml_type_of(dtype)
        .ok_or_else(|| bad(format!("{name}: {dtype:?} is not a weight type")))?;
    if rows.start > rows.end || rows.end > out {
        return Err(bad(format!("{name}: rows {rows:?} outside {out}")));
    }
    let row = data.len() / out.max(1);
    let part = data[rows.start * row..rows.end * row].to_vec();
    st.release(name, rows.start * row..rows.end * row);
    Stored::new(name, t, part.into(), rows.len(), inp)
}

/// The ggml type id of a safetensors element type this loader keeps as
/// stored (`None`: not a float matrix type).
pub(crate) fn ggml_type_of(dtype: candle_core::DType) -> Option<u32> {
    use candle_core::DType as D;
    Some(match dtype {
        D::F32 => types::F32,
        D::F16 => types::F16,
        D::BF16 => types::BF16,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_bytes(w: &[f32]) -> Vec<u8> {
        w.iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect()
    }

    /// A shard selected from a view multiplies like the same shard built
    /// from a copy of its values, for bf16, f32 and Q8_0.
    #[test]
    fn selections_multiply_as_copies() {
        let (out, inp) = (6, 64);
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let x: Vec<f32> = (0..2 * 32).map(|i| (i as f32 * 0.3).sin()).collect();
        for dtype in [types::BF16, types::F32] {
            let bytes: Vec<u8> = if dtype == types::BF16 {
                bf16_bytes(&w)
            } else {
                w.iter().flat_map(|x| x.to_le_bytes()).collect()
            };
            let full = Stored::new("w", dtype, bytes.into(), out, inp).unwrap();
            let part = full.select(2..5, 32..64).unwrap();
            assert!(part.bytes.len() < full.bytes.len());
            let sub: Vec<f32> = (2..5)
                .flat_map(|o| w[o * inp + 32..o * inp + 64].to_vec())
                .collect();
            let copy_bytes: Vec<u8> = if dtype == types::BF16 {
                bf16_bytes(&sub)
            } else {
                sub.iter().flat_map(|x| x.to_le_bytes()).collect()
            };
            let copy = Stored::new("c", dtype, copy_bytes.into(), 3, 32).unwrap();
            let a = part.into_linear().unwrap().apply(&x).unwrap();
            let b = copy.into_linear().unwrap().apply(&x).unwrap();
            assert_eq!(a, b, "dtype {dtype}");
        }
        let full = Stored::new("w", types::BF16, bf16_bytes(&w).into(), out, inp).unwrap();
        assert!(
            full.select(0..2, 16..48).is_ok(),
            "bf16 blocks are single values"
        );
        let q = Stored::new("q", types::Q8_0, vec![0u8; out * 2 * 34].into(), out, inp).unwrap();
        assert!(q.select(0..2, 16..48).is_err(), "Q8_0 columns cut a block");
        assert!(q.select(0..7, 0..32).is_err());
        assert!(Stored::new("s", types::Q8_0, vec![0u8; 10].into(), out, inp).is_err());
    }
}
