//! Tensor-parallel sharding at load time: which rank owns which attention
//! heads, intermediate (MLP) columns and vocabulary rows (the
//! [`ShardPlan`]), and cutting quantized or dense matrices into those parts
//! along whole quantization blocks.
//!
//! Megatron-style layout (the llama family cuts its layers by it in
//! `llama/load.rs`; this module names no family):
//! - q/k/v and gate/up are column-parallel: rank r keeps the output rows of
//!   its heads / its intermediate slice (a row cut of a `[out, in]` matrix,
//!   always possible);
//! - o_proj and down_proj are row-parallel: rank r keeps the input columns of
//!   its heads / its intermediate slice, and the ranks' partial outputs are
//!   summed by an all-reduce. A quantized row is a run of blocks (32 or 256
//!   values), so those cuts must fall on block boundaries;
//! - the output head is vocabulary-parallel (rows), its logits all-gathered;
//! - embeddings and norms are replicated.
//!
//! Every split is balanced: `n` units over `w` ranks gives the first
//! `n % w` ranks one unit more (35 blocks over 2 ranks: 18 + 17).

use crate::error::{Result, VerifyError};
use crate::model::config::ModelConfig;
use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{Device, Tensor};
use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

/// The even split of the families whose ranks must hold equal parts
/// (latent attention's heads, experts' widths): `n` units over `world`
/// ranks, rank `rank`'s range.
///
/// Errors: `n` not a multiple of `world`; the error names the part and the
/// world sizes that work.
pub(crate) fn even_split(name: &str, n: usize, world: usize, rank: usize) -> Result<Range<usize>> {
    if !n.is_multiple_of(world) {
        let ok: Vec<usize> = (1..=n).filter(|w| n.is_multiple_of(*w)).collect();
        return Err(VerifyError::BadConfig(format!(
            "{name}: {n} does not split across {world} tensor-parallel ranks; \
             world sizes that work: {ok:?}"
        )));
    }
    let per = n / world;
    Ok(rank * per..(rank + 1) * per)
}

/// `n` units over `world` ranks, the first `n % world` ranks one unit larger.
pub(crate) fn balanced(n: usize, world: usize) -> Vec<Range<usize>> {
    let (base, extra) = (n / world, n % world);
    let mut start = 0;
    (0..world)
        .map(|r| {
            let len = base + usize::from(r < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

/// What limits the split of a model: the quantization block sizes of the
/// matrices whose input dimension is cut, and the tensors to name in errors.
#[derive(Debug, Clone)]
pub(crate) struct SplitLimits {
    /// Largest block size among the attention output matrices, and one
    /// tensor that has it.
    pub(crate) attn_out: (usize, String),
    /// Largest block size among the MLP down matrices, and one tensor that
    /// has it.
    pub(crate) ffn_down: (usize, String),
    /// The tensor named when there are fewer KV heads than ranks.
    pub(crate) kv_tensor: String,
    /// The tensor named when there are fewer vocabulary rows than ranks.
    pub(crate) vocab_tensor: String,
}

/// Which part of the model each rank owns. All ranges index the unsharded
/// model; `kv_heads[r]`, `heads[r]`, `ff[r]` and `vocab[r]` are rank r's.
///
/// Invariants: each list has one non-empty range per rank, the ranges of a
/// list are consecutive and cover the whole dimension, `heads[r]` is exactly
/// the query heads that read `kv_heads[r]`, and the column cuts of o_proj
/// (`heads[r].start * head_dim`) and down_proj (`ff[r].start`) fall on
/// quantization block boundaries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardPlan {
    pub(crate) kv_heads: Vec<Range<usize>>,
    pub(crate) heads: Vec<Range<usize>>,
    pub(crate) ff: Vec<Range<usize>>,
    pub(crate) vocab: Vec<Range<usize>>,
}

impl ShardPlan {
    /// Plans a split of `cfg` over `world` ranks.
    ///
    /// Errors: `world` is 0 ([`VerifyError::BadConfig`]), or a tensor cannot
    /// be cut into `world` parts ([`VerifyError::ImpossibleSplit`], naming
    /// the tensor and the world sizes that work for this model).
    pub(crate) fn new(cfg: &ModelConfig, limits: &SplitLimits, world: usize) -> Result<Self> {
        if world == 0 {
            return Err(VerifyError::BadConfig(
                "tensor-parallel size must be at least 1".into(),
            ));
        }
        Self::try_new(cfg, limits, world).map_err(|(tensor, reason)| {
            // Every rank needs a KV head, so no larger world can work.
            let working = (1..=cfg.num_kv_heads)
                .filter(|&w| Self::try_new(cfg, limits, w).is_ok())
                .collect();
            VerifyError::ImpossibleSplit {
                tensor,
                world,
                reason,
                working,
            }
        })
    }

    fn try_new(
        cfg: &ModelConfig,
        limits: &SplitLimits,
        world: usize,
    ) -> std::result::Result<Self, (String, String)> {
        let (nkv, hd) = (cfg.num_kv_heads, cfg.head_dim);
        if nkv < world {
            return Err((
                limits.kv_tensor.clone(),
                format!("its {nkv} KV heads cannot give each rank at least one"),
            ));
        }
        let group = cfg.num_heads / nkv;
        let kv_heads = balanced(nkv, world);
        let heads: Vec<Range<usize>> = kv_heads
            .iter()
            .map(|r| r.start * group..r.end * group)
            .collect();
        let (bs, name) = &limits.attn_out;
        if let Some(h) = heads.iter().find(|h| !(h.start * hd).is_multiple_of(*bs)) {
            return Err((
                name.clone(),
                format!(
                    "a rank's attention columns would start at column {} (head {} of \
                     {hd} values), not on a boundary of its {bs}-value quantization blocks",
                    h.start * hd,
                    h.start
                ),
            ));
        }
        let (bs, name) = &limits.ffn_down;
        let ffn = cfg.intermediate_size;
        if !ffn.is_multiple_of(*bs) {
            return Err((
                name.clone(),
                format!("its {ffn} input columns are not whole {bs}-value blocks"),
            ));
        }
        let units = ffn / bs;
        if units < world {
            return Err((
                name.clone(),
                format!(
                    "its {ffn} input columns are {units} quantization blocks of {bs} values, \
                     fewer than the ranks"
                ),
            ));
        }
        let ff = balanced(units, world)
            .into_iter()
            .map(|r| r.start * bs..r.end * bs)
            .collect();
        if cfg.vocab_size < world {
            return Err((
                limits.vocab_tensor.clone(),
                format!("its {} rows are fewer than the ranks", cfg.vocab_size),
            ));
        }
        Ok(Self {
            kv_heads,
            heads,
            ff,
            vocab: balanced(cfg.vocab_size, world),
        })
    }

    /// Number of ranks.
    pub(crate) fn world(&self) -> usize {
        self.kv_heads.len()
    }
}

/// A weight matrix `[out, in]` as loaded: quantized (GGUF) or dense.
#[derive(Clone)]
pub(crate) enum Matrix {
    Quant(Arc<QTensor>),
    Dense(Tensor),
}

impl Matrix {
    pub(crate) fn dims(&self) -> Result<(usize, usize)> {
        Ok(match self {
            Matrix::Quant(q) => q.shape().dims2()?,
            Matrix::Dense(t) => t.dims2()?,
        })
    }

    /// Bytes the matrix occupies (what one forward streams from memory).
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Matrix::Quant(q) => q.storage_size_in_bytes(),
            Matrix::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
        }
    }

    /// Output rows `rows` (a column-parallel shard). The full range returns
    /// the same storage, uncopied.
    pub(crate) fn rows(&self, rows: Range<usize>) -> Result<Matrix> {
        let (n, cols) = self.dims()?;
        if rows == (0..n) {
            return Ok(self.clone());
        }
        match self {
            Matrix::Dense(t) => Ok(Matrix::Dense(t.narrow(0, rows.start, rows.len())?)),
            Matrix::Quant(q) => {
                let row_bytes = cols / q.dtype().block_size() * q.dtype().type_size();
                let data = q.data()?;
                let part = &data[rows.start * row_bytes..rows.end * row_bytes];
                quant_from_bytes(q, part.to_vec(), (rows.len(), cols))
            }
        }
    }

    /// Input columns `cols` (a row-parallel shard). For a quantized matrix
    /// both ends must fall on block boundaries (the [`ShardPlan`] ensures it;
    /// an error otherwise). The full range returns the same storage.
    pub(crate) fn cols(&self, cols: Range<usize>, name: &str) -> Result<Matrix> {
        let (n, width) = self.dims()?;
        if cols == (0..width) {
            return Ok(self.clone());
        }
        match self {
            Matrix::Dense(t) => Ok(Matrix::Dense(
                t.narrow(1, cols.start, cols.len())?.contiguous()?,
            )),
            Matrix::Quant(q) => {
                let bs = q.dtype().block_size();
                if !cols.start.is_multiple_of(bs) || !cols.end.is_multiple_of(bs) {
                    return Err(VerifyError::BadConfig(format!(
                        "tensor '{name}': columns {cols:?} do not fall on {bs}-value blocks"
                    )));
                }
                let ts = q.dtype().type_size();
                let row_bytes = width / bs * ts;
                let (from, len) = (cols.start / bs * ts, cols.len() / bs * ts);
                let data = q.data()?;
                let mut part = Vec::with_capacity(n * len);
                for row in data.chunks_exact(row_bytes) {
                    part.extend_from_slice(&row[from..from + len]);
                }
                quant_from_bytes(q, part, (n, cols.len()))
            }
        }
    }

    /// The matmul candle runs for this matrix (a quantized one is
    /// dequantized when CANDLE_DEQUANTIZE_ALL is set, as candle decides).
    pub(crate) fn into_qmatmul(self) -> Result<QMatMul> {
        Ok(match self {
            Matrix::Quant(q) => QMatMul::from_arc(q)?,
            Matrix::Dense(t) => QMatMul::Tensor(t),
        })
    }
}

/// A new CPU QTensor of `like`'s format from whole blocks. The bytes come in
/// a fresh allocation, which the system allocator aligns for any block type
/// (candle checks the alignment).
fn quant_from_bytes(like: &QTensor, bytes: Vec<u8>, shape: (usize, usize)) -> Result<Matrix> {
    let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, like.dtype())?;
    Ok(Matrix::Quant(Arc::new(QTensor::new(storage, shape)?)))
}

/// A 1-D bias cut to `range`; the full range returns it unchanged.
pub(crate) fn slice_bias(b: &Tensor, range: Range<usize>) -> Result<Tensor> {
    if range == (0..b.dim(0)?) {
        return Ok(b.clone());
    }
    Ok(b.narrow(0, range.start, range.len())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Arch, RopeStyle};
    use candle_core::quantized::GgmlDType;

    fn cfg(heads: usize, kv: usize, hd: usize, ff: usize) -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen2,
            vocab_size: 100,
            hidden_size: heads * hd,
            intermediate_size: ff,
            num_layers: 1,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: hd,
            rms_norm_eps: 1e-6,
            rope_theta: 1e4,
            rope_style: RopeStyle::Neox,
            max_position: 64,
            mla: None,
            moe: None,
            yarn: None,
        }
    }

    fn limits(attn: usize, down: usize) -> SplitLimits {
        SplitLimits {
            attn_out: (attn, "blk.0.attn_output.weight".into()),
            ffn_down: (down, "blk.0.ffn_down.weight".into()),
            kv_tensor: "blk.0.attn_k.weight".into(),
            vocab_tensor: "output.weight".into(),
        }
    }

    #[test]
    fn balanced_gives_the_first_ranks_the_remainder() {
        assert_eq!(balanced(35, 2), vec![0..18, 18..35]);
        assert_eq!(balanced(5, 4), vec![0..2, 2..3, 3..4, 4..5]);
        assert_eq!(balanced(8, 1), vec![0..8]);
    }

    #[test]
    fn qwen2_5_1_5b_shape_splits_35_blocks_18_17_and_rejects_world_4() {
        // 12 heads, 2 KV heads, head_dim 128, intermediate 8960 (Q4_K/Q6_K).
        let c = cfg(12, 2, 128, 8960);
        let p = ShardPlan::new(&c, &limits(256, 256), 2).unwrap();
        assert_eq!(p.kv_heads, vec![0..1, 1..2]);
        assert_eq!(p.heads, vec![0..6, 6..12]);
        assert_eq!(p.ff, vec![0..18 * 256, 18 * 256..8960]);
        let e = ShardPlan::new(&c, &limits(256, 256), 4).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("blk.0.attn_k.weight"), "{msg}");
        assert!(msg.contains("[1, 2]"), "{msg}");
        assert!(matches!(
            ShardPlan::new(&c, &limits(256, 256), 0),
            Err(VerifyError::BadConfig(_))
        ));
    }

    #[test]
    fn misaligned_attention_columns_and_too_few_blocks_name_the_tensor() {
        // 4 heads of 128 over 4 ranks: o_proj cuts at column 128 of Q4_K's 256.
        let e = ShardPlan::new(&cfg(4, 4, 128, 1024), &limits(256, 256), 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("blk.0.attn_output.weight"), "{e}");
        assert!(e.contains("[1, 2]"), "{e}");
        // One block of intermediate columns cannot be split at all.
        let e = ShardPlan::new(&cfg(4, 4, 64, 256), &limits(32, 256), 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("blk.0.ffn_down.weight"), "{e}");
        assert!(e.contains("[1]"), "{e}");
    }

    #[test]
    fn quantized_row_and_column_cuts_keep_the_blocks() {
        let rows = 6;
        let cols = 5 * 32;
        let data: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let t = Tensor::from_vec(data, (rows, cols), &Device::Cpu).unwrap();
        let q = Arc::new(QTensor::quantize(&t, GgmlDType::Q8_0).unwrap());
        let full = q.dequantize(&Device::Cpu).unwrap();
        let m = Matrix::Quant(q);
        let part = |m: Matrix| match m {
            Matrix::Quant(q) => q.dequantize(&Device::Cpu).unwrap(),
            Matrix::Dense(t) => t,
        };
        let r = part(m.rows(2..5).unwrap());
        assert_eq!(
            r.to_vec2::<f32>().unwrap(),
            full.narrow(0, 2, 3).unwrap().to_vec2::<f32>().unwrap()
        );
        let c = part(m.cols(64..160, "w").unwrap());
        assert_eq!(
            c.to_vec2::<f32>().unwrap(),
            full.narrow(1, 64, 96).unwrap().to_vec2::<f32>().unwrap()
        );
        assert!(m.cols(16..160, "w").is_err());
    }
}
