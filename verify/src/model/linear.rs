//! The matrix-product entry of every weight of every family: [`Linear`]
//! over the weight as its file stores it (our tiled block-quantized
//! kernels, BF16, F32 and MXFP4 kernels, or candle's matmul for the other
//! quantized formats), [`forward_many`] (several layers over one input in
//! one kernel pass) and the token [`Embedding`] table. Family-neutral.

use super::ops;
use crate::error::{Result, VerifyError};
use crate::kernels::bf16::{self, Bf16Matrix};
use crate::kernels::f32::{self as f32k, F32Matrix};
use crate::kernels::mxfp4::{self, Mxfp4Matrix};
use crate::kernels::{self, QWeight};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Tensor};
use std::sync::Arc;

/// A linear layer: quantized (GGUF) or dense, with an optional bias.
pub(crate) struct Linear {
    weight: LinearWeight,
    bias: Option<Vec<f32>>,
}

enum LinearWeight {
    /// Our tiled kernels (crate::kernels) for the block formats they
    /// implement.
    Native(QWeight),
    /// candle's matmul: dense candle tensors, other block formats, or when
    /// [`kernels::Backend::Candle`] was chosen.
    Candle(QMatMul),
    /// BF16 as stored, with bf16-rounded activations.
    Bf16(Bf16Matrix),
    /// F32 as stored.
    F32(F32Matrix),
    /// MXFP4 as stored, with Q8_0 activations (ggml's numbers).
    Mxfp4(Mxfp4Matrix),
}

impl LinearWeight {
    /// See [`Linear::from_mxfp4`].
    fn from_mxfp4(w: Mxfp4Matrix) -> Self {
        if !mxfp4::prefers_tiles(kernels::Isa::current()) || w.is_tiled() {
            return LinearWeight::Mxfp4(w);
        }
        let t = w.tiled();
        w.storage().release();
        LinearWeight::Mxfp4(t)
    }
}

impl Linear {
    /// Picks our kernels when the backend is native and the format is one
    /// of theirs, candle otherwise.
    ///
    /// Errors: a bias that cannot be read as f32 values.
    pub(crate) fn new(weight: QMatMul, bias: Option<Tensor>) -> Result<Self> {
        let weight = match &weight {
            QMatMul::QTensor(q) if kernels::backend() == kernels::Backend::Native => {
                match QWeight::new(q.clone()) {
                    Some(w) => LinearWeight::Native(w),
                    None => LinearWeight::Candle(weight),
                }
            }
            _ => LinearWeight::Candle(weight),
        };
        let bias = bias
            .map(|b| {
                b.to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()
            })
            .transpose()?;
        Ok(Self { weight, bias })
    }

    fn of(weight: LinearWeight) -> Self {
        Self { weight, bias: None }
    }

    /// A BF16 matrix, multiplied as stored.
    pub(crate) fn from_bf16(w: Bf16Matrix) -> Self {
        Self::of(LinearWeight::Bf16(w))
    }

    /// An F32 matrix, multiplied as stored.
    pub(crate) fn from_f32(w: F32Matrix) -> Self {
        Self::of(LinearWeight::F32(w))
    }

    /// An MXFP4 matrix, in the layout this CPU's kernel reads best
    /// ([`mxfp4::prefers_tiles`]): tiled, its mapped source pages are
    /// released (nothing reads them again), so resident memory stays the
    /// weights' size.
    pub(crate) fn from_mxfp4(w: Mxfp4Matrix) -> Self {
        Self::of(LinearWeight::from_mxfp4(w))
    }

    /// A block-quantized matrix on our tiled kernels.
    pub(crate) fn from_quantized(w: QWeight) -> Self {
        Self::of(LinearWeight::Native(w))
    }

    /// A block-quantized `(n, k)` matrix from its GGUF bytes, kept
    /// quantized under candle's matmul (formats our kernels lack).
    ///
    /// Errors: bytes that are not `n` rows of `dtype` blocks.
    pub(crate) fn from_candle_quantized(
        dtype: GgmlDType,
        bytes: &[u8],
        n: usize,
        k: usize,
    ) -> Result<Self> {
        Ok(Self::of(LinearWeight::Candle(quantized_matrix(
            dtype, bytes, n, k,
        )?)))
    }

    /// `x` (`rows x in_features`, row-major) times the transpose, plus the
    /// bias: `rows x out_features`. Batch-invariant as
    /// [`Linear::forward`].
    ///
    /// Errors: `x` not whole rows of the input width.
    pub(crate) fn apply(&self, x: &[f32]) -> Result<Vec<f32>> {
        let k = self.in_features()?;
        if !x.len().is_multiple_of(k) {
            return Err(VerifyError::BadBatch(format!(
                "{} inputs for rows of {k}",
                x.len()
            )));
        }
        let rows = x.len() / k;
        let mut out = vec![0f32; rows * self.out_features()?];
        self.forward_into(x, rows, &mut out)?;
        Ok(out)
    }

    /// The MXFP4 matrix, when this layer is one (for grouped expert
    /// passes).
    pub(crate) fn as_mxfp4(&self) -> Option<&Mxfp4Matrix> {
        match &self.weight {
            LinearWeight::Mxfp4(m) if self.bias.is_none() => Some(m),
            _ => None,
        }
    }

    /// Input features.
    pub(crate) fn in_features(&self) -> Result<usize> {
        Ok(match &self.weight {
            LinearWeight::Native(w) => w.k(),
            LinearWeight::Bf16(w) => w.k(),
            LinearWeight::F32(w) => w.k(),
            LinearWeight::Mxfp4(w) => w.inp(),
            LinearWeight::Candle(QMatMul::QTensor(t)) => t.shape().dims()[1],
            LinearWeight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => t.dims2()?.1,
        })
    }

    /// Bytes the weight occupies as kept (what one pass reads).
    pub(crate) fn weight_bytes(&self) -> usize {
        match &self.weight {
            LinearWeight::Native(w) => w.bytes(),
            LinearWeight::Bf16(w) => w.weight_bytes(),
            LinearWeight::F32(w) => w.weight_bytes(),
            LinearWeight::Mxfp4(w) => w.bytes(),
            LinearWeight::Candle(QMatMul::QTensor(t)) => t.storage_size_in_bytes(),
            LinearWeight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        }
    }

    /// Weight row `r` (output feature `r`'s weights) widened to f32.
    ///
    /// Errors: `r` outside the matrix, or `out` not one row long.
    pub(crate) fn row_f32(&self, r: usize, out: &mut [f32]) -> Result<()> {
        let (n, k) = (self.out_features()?, self.in_features()?);
        if r >= n || out.len() != k {
            return Err(VerifyError::BadBatch(format!(
                "row {r} of a [{n}, {k}] matrix into {} values",
                out.len()
            )));
        }
        match &self.weight {
            LinearWeight::Bf16(w) => w.row_f32(r, out),
            LinearWeight::F32(w) => w.row_f32(r, out),
            LinearWeight::Mxfp4(w) => out.copy_from_slice(
                &crate::kernels::mxfp4::decode_ggml(&w.row(r), k)
                    .map_err(VerifyError::BadConfig)?,
            ),
            LinearWeight::Native(w) => {
                let bytes = w.gguf_rows(&[r as u32]).map_err(VerifyError::BadConfig)?;
                let q = quantized_matrix(w.format().dtype(), &bytes, 1, k)?;
                let QMatMul::QTensor(t) = q else {
                    unreachable!("a quantized matrix")
                };
                out.copy_from_slice(
                    &t.dequantize(&candle_core::Device::Cpu)?
                        .flatten_all()?
                        .to_vec1()?,
                );
            }
            LinearWeight::Candle(q) => {
                let t = match q {
                    QMatMul::QTensor(t) => t.dequantize(&candle_core::Device::Cpu)?,
                    QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.clone(),
                };
                out.copy_from_slice(
                    &t.narrow(0, r, 1)?
                        .to_dtype(candle_core::DType::F32)?
                        .flatten_all()?
                        .to_vec1()?,
                );
            }
        }
        Ok(())
    }

    /// Batch-invariant: row r of the result depends only on row r of `x`,
    /// bit for bit, whatever the other rows and however many there are.
    /// Speculative verification (k+1 rows) then scores tokens exactly as
    /// plain decoding (1 row) does, so greedy output is identical with and
    /// without speculation. Our kernels are so by construction; candle's
    /// are row-independent except its single-row Q6_K kernel, which rounds
    /// differently from the multi-row one, so a single Q6_K row is padded
    /// to two there.
    ///
    /// [`forward_into`](Linear::forward_into) on a `(rows, k)` tensor.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (rows, _) = x.dims2()?;
        let xs = x
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let n = self.out_features()?;
        let mut out = vec![0f32; rows * n];
        self.forward_into(&xs, rows, &mut out)?;
        Ok(Tensor::from_vec(out, (rows, n), x.device())?)
    }
}

/// candle's matmul of `x (rows x k)`, without bias; a single Q6_K row is
/// padded to two (see [`Linear::forward`]).
fn candle_forward(q: &QMatMul, x: &Tensor) -> Result<Tensor> {
    let single_q6k =
        matches!(q, QMatMul::QTensor(t) if t.dtype() == GgmlDType::Q6K) && x.dim(0)? == 1;
    Ok(if single_q6k {
        let padded = Tensor::cat(&[x, x], 0)?;
        q.forward(&padded)?.narrow(0, 0, 1)?
    } else {
        q.forward(x)?
    })
}

impl Linear {
    /// Output features.
    pub(crate) fn out_features(&self) -> Result<usize> {
        Ok(match &self.weight {
            LinearWeight::Native(w) => w.n(),
            LinearWeight::Bf16(w) => w.n(),
            LinearWeight::F32(w) => w.n(),
            LinearWeight::Mxfp4(w) => w.out(),
            LinearWeight::Candle(QMatMul::QTensor(t)) => t.shape().dims()[0],
            LinearWeight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => t.dims2()?.0,
        })
    }

    fn add_bias(&self, out: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in out.chunks_exact_mut(b.len()) {
                ops::add_in_place(row, b);
            }
        }
    }

    /// `out (rows x n) = x (rows x k) @ W^T + b` on plain slices; the same
    /// numbers as [`Linear::forward`].
    ///
    /// Errors: `x` or `out` of the wrong length for `rows`.
    pub(crate) fn forward_into(&self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        forward_many(&[self], x, rows, &mut [out])
    }
}

/// Several layers applied to the same input `x` (`rows x k`) into `outs`
/// (one `rows x n` slice per layer). When every layer runs on our kernels
/// they go through one [`kernels::matmul_many`] pass (one quantization of
/// `x`, one wake-up of the thread pool); otherwise one by one. Results are
/// the same either way, bit for bit.
///
/// Errors: as many outputs as layers not given, or `x` or an output of the
/// wrong length for `rows`.
pub(crate) fn forward_many(
    layers: &[&Linear],
    x: &[f32],
    rows: usize,
    outs: &mut [&mut [f32]],
) -> Result<()> {
    let bad = |what: String| VerifyError::BadBatch(what);
    if layers.len() != outs.len() {
        return Err(bad(format!(
            "{} layers for {} outputs",
            layers.len(),
            outs.len()
        )));
    }
    if rows == 0 && x.is_empty() && outs.iter().all(|o| o.is_empty()) {
        return Ok(());
    }
    if rows == 0 || !x.len().is_multiple_of(rows) {
        return Err(bad(format!("{} inputs for {rows} rows", x.len())));
    }
    for (l, o) in layers.iter().zip(outs.iter()) {
        if o.len() != rows * l.out_features()? {
            return Err(bad(format!("an output of {} for {rows} rows", o.len())));
        }
    }
    let k = x.len() / rows;
    for l in layers {
        if l.in_features()? != k {
            return Err(bad(format!(
                "linear layer of {} inputs fed rows of {k}",
                l.in_features()?
            )));
        }
    }
    let native: Option<Vec<&QWeight>> = layers
        .iter()
        .map(|l| match &l.weight {
            LinearWeight::Native(w) => Some(w),
            _ => None,
        })
        .collect();
    let wide: Option<Vec<&F32Matrix>> = layers
        .iter()
        .map(|l| match &l.weight {
            LinearWeight::F32(w) => Some(w),
            _ => None,
        })
        .collect();
    let halves: Option<Vec<&Bf16Matrix>> = layers
        .iter()
        .map(|l| match &l.weight {
            LinearWeight::Bf16(w) => Some(w),
            _ => None,
        })
        .collect();
    if let Some(ws) = native {
        let mut products: Vec<kernels::Product> = ws
            .into_iter()
            .zip(outs.iter_mut())
            .map(|(w, out)| kernels::Product { w, out })
            .collect();
        kernels::matmul_many(x, rows, &mut products);
    } else if let Some(ws) = halves {
        // One bf16 rounding of the input for every layer.
        let mut products: Vec<bf16::Product> = ws
            .into_iter()
            .zip(outs.iter_mut())
            .map(|(w, out)| bf16::Product { w, out })
            .collect();
        bf16::matmul_many(x, rows, &mut products);
    } else if let Some(ws) = wide {
        let mut products: Vec<f32k::Product> = ws
            .into_iter()
            .zip(outs.iter_mut())
            .map(|(w, out)| f32k::Product { w, out })
            .collect();
        f32k::matmul_many(x, rows, &mut products);
    } else {
        let mut xt = None;
        for (l, o) in layers.iter().zip(outs.iter_mut()) {
            match &l.weight {
                LinearWeight::Native(w) => w.matmul(x, rows, o),
                LinearWeight::Bf16(w) => w.matmul(x, rows, o),
                LinearWeight::F32(w) => w.matmul(x, rows, o),
                LinearWeight::Mxfp4(w) => w.matmul(x, rows, o),
                LinearWeight::Candle(q) => {
                    let xt = match &xt {
                        Some(t) => t,
                        None => {
                            xt.insert(Tensor::from_slice(x, (rows, k), &candle_core::Device::Cpu)?)
                        }
                    };
                    let y = candle_forward(q, xt)?;
                    o.copy_from_slice(&y.flatten_all()?.to_vec1::<f32>()?);
                }
            }
        }
    }
    for (l, o) in layers.iter().zip(outs.iter_mut()) {
        l.add_bias(o);
    }
    Ok(())
}

impl Linear {
    /// A layer computing only output features `rows` (in that order), with
    /// the same backend choice as [`Linear::new`]. Each kept feature's
    /// weights are copied unchanged, so with our kernels (every output
    /// column computed alone) its outputs equal the full layer's bit for bit.
    pub(crate) fn select_rows(&self, rows: &[u32]) -> Result<Linear> {
        let idx = Tensor::new(rows, &candle_core::Device::Cpu)?;
        let outside = |e: String| VerifyError::BadConfig(format!("output head: {e}"));
        let weight = match &self.weight {
            LinearWeight::Native(w) => {
                let bytes = w.gguf_rows(rows).map_err(outside)?;
                quantized_matrix(w.format().dtype(), &bytes, rows.len(), w.k())?
            }
            LinearWeight::Candle(QMatMul::QTensor(t)) => {
                let &[n, k] = t.shape().dims() else {
                    return Err(VerifyError::BadConfig("output head is not a matrix".into()));
                };
                let data = t.data()?;
                let row_bytes = data.len() / n;
                let mut bytes = Vec::with_capacity(rows.len() * row_bytes);
                for &r in rows {
                    let r = r as usize;
                    if r >= n {
                        return Err(outside(format!("row {r} outside a matrix of {n} rows")));
                    }
                    bytes.extend_from_slice(&data[r * row_bytes..(r + 1) * row_bytes]);
                }
                quantized_matrix(t.dtype(), &bytes, rows.len(), k)?
            }
            LinearWeight::Bf16(_) | LinearWeight::F32(_) | LinearWeight::Mxfp4(_) => {
                let mut head = Linear::of(self.weight.select_rows(rows).map_err(outside)?);
                head.bias = self.select_bias(rows);
                return Ok(head);
            }
            LinearWeight::Candle(QMatMul::Tensor(t)) => QMatMul::Tensor(t.index_select(&idx, 0)?),
            LinearWeight::Candle(QMatMul::TensorF16(t)) => {
                QMatMul::TensorF16(t.index_select(&idx, 0)?)
            }
        };
        let mut head = Linear::new(weight, None)?;
        head.bias = self.select_bias(rows);
        Ok(head)
    }

    /// The bias of output features `rows`. Every row is inside the matrix
    /// (the weights' selection checked), and a bias has one value per row.
    fn select_bias(&self, rows: &[u32]) -> Option<Vec<f32>> {
        (self.bias.as_ref()).map(|b| rows.iter().map(|&r| b[r as usize]).collect())
    }
}

impl LinearWeight {
    /// The stored-format weights of output rows `rows`, in that order (a
    /// copy of their bytes, unchanged). Errors name a row outside.
    fn select_rows(&self, rows: &[u32]) -> std::result::Result<LinearWeight, String> {
        let gather =
            |n: usize, row: &dyn Fn(usize) -> Vec<u8>| -> std::result::Result<Vec<u8>, String> {
                let mut v = Vec::new();
                for &r in rows {
                    if r as usize >= n {
                        return Err(format!("row {r} outside a matrix of {n} rows"));
                    }
                    v.extend(row(r as usize));
                }
                Ok(v)
            };
        let n = rows.len();
        Ok(match self {
            LinearWeight::Bf16(w) => {
                let b = gather(w.n(), &|r| row_of(w.bytes(), w.row_stride(), w.k() * 2, r))?;
                LinearWeight::Bf16(Bf16Matrix::from_bytes(b.into(), n, w.k(), w.k() * 2)?)
            }
            LinearWeight::F32(w) => {
                let b = gather(w.n(), &|r| row_of(w.bytes(), w.row_stride(), w.k() * 4, r))?;
                LinearWeight::F32(F32Matrix::from_bytes(b.into(), n, w.k(), w.k() * 4)?)
            }
            LinearWeight::Mxfp4(w) => {
                let b = gather(w.out(), &|r| w.row(r).into_owned())?;
                LinearWeight::from_mxfp4(Mxfp4Matrix::from_ggml(b, n, w.inp())?)
            }
            LinearWeight::Native(_) | LinearWeight::Candle(_) => {
                unreachable!("block formats select through their GGUF bytes")
            }
        })
    }
}

/// Row `r`'s `len` bytes of a matrix whose rows start every `stride`
/// bytes.
fn row_of(bytes: &[u8], stride: usize, len: usize, r: usize) -> Vec<u8> {
    bytes[r * stride..r * stride + len].to_vec()
}

/// A CPU quantized `(n, k)` matrix from its GGUF block bytes.
fn quantized_matrix(dtype: GgmlDType, bytes: &[u8], n: usize, k: usize) -> Result<QMatMul> {
    let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
        dtype,
        bytes,
        vec![n, k],
        &candle_core::Device::Cpu,
    )?;
    Ok(QMatMul::from_arc(Arc::new(q))?)
}

/// Token embedding table, kept quantized when the file stores it so.
/// Replicated on every rank (cloning shares the storage).
#[derive(Clone)]
pub(crate) enum Embedding {
    Quantized(Arc<QTensor>),
    Dense(Tensor),
}

impl Embedding {
    pub(crate) fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Embedding::Quantized(q) => q.embedding(ids)?,
            Embedding::Dense(t) => t.index_select(ids, 0)?,
        })
    }
}
