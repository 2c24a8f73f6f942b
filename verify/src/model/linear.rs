//! The matrix-product entry of every quantized or candle-backed weight:
//! [`Linear`] (our kernels when they implement the format, candle's matmul
//! otherwise), [`forward_many`] (several layers over one input in one
//! kernel pass) and the token [`Embedding`] table. Family-neutral.

use super::ops;
use crate::error::{Result, VerifyError};
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
    /// Our kernels (crate::kernels) for the formats they implement.
    Native(QWeight),
    /// candle's matmul: dense weights, other formats, or when
    /// [`kernels::Backend::Candle`] was chosen.
    Candle(QMatMul),
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
    let native: Option<Vec<&QWeight>> = layers
        .iter()
        .map(|l| match &l.weight {
            LinearWeight::Native(w) if w.k() == k => Some(w),
            _ => None,
        })
        .collect();
    match native {
        Some(ws) => {
            let mut products: Vec<kernels::Product> = ws
                .into_iter()
                .zip(outs.iter_mut())
                .map(|(w, out)| kernels::Product { w, out })
                .collect();
            kernels::matmul_many(x, rows, &mut products);
        }
        None => {
            let xt = Tensor::from_slice(x, (rows, k), &candle_core::Device::Cpu)?;
            for (l, o) in layers.iter().zip(outs.iter_mut()) {
                let y = match &l.weight {
                    LinearWeight::Native(w) => {
                        return Err(bad(format!(
                            "linear layer of {} inputs fed rows of {k}",
                            w.k()
                        )))
                    }
                    LinearWeight::Candle(q) => candle_forward(q, &xt)?,
                };
                o.copy_from_slice(&y.flatten_all()?.to_vec1::<f32>()?);
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
            LinearWeight::Candle(QMatMul::Tensor(t)) => QMatMul::Tensor(t.index_select(&idx, 0)?),
            LinearWeight::Candle(QMatMul::TensorF16(t)) => {
                QMatMul::TensorF16(t.index_select(&idx, 0)?)
            }
        };
        let mut head = Linear::new(weight, None)?;
        // Every row is inside the matrix (the weights' selection checked),
        // and a bias has one value per row.
        head.bias = (self.bias.as_ref()).map(|b| rows.iter().map(|&r| b[r as usize]).collect());
        Ok(head)
    }
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
