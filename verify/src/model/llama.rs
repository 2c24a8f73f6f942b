//! The forward pass of the llama family (llama, qwen2) over a paged KV pool.
//!
//! One call takes a flattened batch of rows from many sequences: every row
//! is one new token at its own position. Each layer first writes every new
//! row's K/V into the pool, then each row attends over positions
//! `0..=position` of its own sequence; since rows of one sequence carry
//! consecutive positions, that is causal within the new rows too.

use super::{Body, LlamaWeights, LogitsWanted, Model, RopeStyle, SeqInput};
use crate::error::{Result, VerifyError};
use crate::kv_pool::KvPool;
use candle_core::{Device, Tensor};
use rayon::prelude::*;

/// Per-row rotary tables for one forward: cos/sin of `head_dim / 2` angles.
struct RopeRows {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    style: RopeStyle,
}

impl RopeRows {
    fn new(head_dim: usize, theta: f32, style: RopeStyle, positions: &[usize]) -> Self {
        let half = head_dim / 2;
        // f32 throughout, as the reference implementations compute it, so
        // logits agree to float rounding.
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Self {
            cos,
            sin,
            half,
            style,
        }
    }

    /// Rotates every head of every row of `x` (`rows x heads x head_dim`).
    fn apply(&self, x: &mut [f32], heads: usize) {
        let hd = 2 * self.half;
        for (r, row) in x.chunks_exact_mut(heads * hd).enumerate() {
            let cos = &self.cos[r * self.half..(r + 1) * self.half];
            let sin = &self.sin[r * self.half..(r + 1) * self.half];
            for head in row.chunks_exact_mut(hd) {
                for i in 0..self.half {
                    let (a, b) = match self.style {
                        RopeStyle::Neox => (i, i + self.half),
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos[i] - x1 * sin[i];
                    head[b] = x0 * sin[i] + x1 * cos[i];
                }
            }
        }
    }
}

/// The batch flattened into rows.
pub(super) struct Rows {
    pub(super) tokens: Vec<u32>,
    pub(super) positions: Vec<usize>,
    pub(super) seq: Vec<usize>,
    pub(super) logit_rows: Vec<u32>,
}

impl Model {
    pub(super) fn flatten(&self, pool: &KvPool, seqs: &[SeqInput]) -> Result<Rows> {
        if !pool.fits(&self.cfg) {
            return Err(VerifyError::BadBatch(
                "KV pool was built for a different model shape".into(),
            ));
        }
        let mut rows = Rows {
            tokens: Vec::new(),
            positions: Vec::new(),
            seq: Vec::new(),
            logit_rows: Vec::new(),
        };
        for (si, s) in seqs.iter().enumerate() {
            let end = s.start_pos + s.tokens.len();
            if end > self.cfg.max_position {
                return Err(VerifyError::BadBatch(format!(
                    "sequence {si} reaches position {end}, beyond the model's {}",
                    self.cfg.max_position
                )));
            }
            if let Some(t) = s
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.cfg.vocab_size)
            {
                return Err(VerifyError::BadBatch(format!(
                    "token id {t} outside the vocabulary of {}",
                    self.cfg.vocab_size
                )));
            }
            pool.check_table(s.block_table, end)?;
            let base = rows.tokens.len();
            rows.logit_rows
                .extend(s.logits.rows(s.tokens.len()).map(|r| (base + r) as u32));
            rows.tokens.extend_from_slice(s.tokens);
            rows.positions.extend(s.start_pos..end);
            rows.seq.extend(std::iter::repeat_n(si, s.tokens.len()));
        }
        if rows.tokens.is_empty() {
            return Err(VerifyError::BadBatch("no tokens in the batch".into()));
        }
        Ok(rows)
    }

    /// Runs one forward over all new tokens of `seqs`, writing their K/V into
    /// `pool`, and returns logits `[n, vocab]` for the rows each sequence asked
    /// for (see [`LogitsWanted`]), in batch order. `n` may be 0.
    ///
    /// Errors: a token outside the vocabulary, a position beyond the model's
    /// context, a block table too short or naming a block outside the pool,
    /// or a pool built for another model shape.
    pub fn forward(&self, pool: &mut KvPool, seqs: &[SeqInput]) -> Result<Tensor> {
        match &self.body {
            Body::Llama(w) => self.forward_llama(w, pool, seqs),
            Body::Deepseek(w) => super::deepseek::forward(self, w, pool, seqs),
        }
    }

    fn forward_llama(
        &self,
        w: &LlamaWeights,
        pool: &mut KvPool,
        seqs: &[SeqInput],
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let rows = self.flatten(pool, seqs)?;
        let n = rows.tokens.len();
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let eps = cfg.rms_norm_eps as f32;
        let scale = 1.0 / (hd as f32).sqrt();
        let rope = RopeRows::new(hd, cfg.rope_theta, cfg.rope_style, &rows.positions);
        let tables: Vec<&[u32]> = seqs.iter().map(|s| s.block_table).collect();

        let ids = Tensor::new(rows.tokens.as_slice(), &Device::Cpu)?;
        let mut x = w.embed.forward(&ids)?;
        let mut attn = vec![0f32; n * qd];
        for (li, layer) in w.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let mut q = layer.q.forward(&h)?.flatten_all()?.to_vec1::<f32>()?;
            let mut k = layer.k.forward(&h)?.flatten_all()?.to_vec1::<f32>()?;
            let v = layer.v.forward(&h)?.flatten_all()?.to_vec1::<f32>()?;
            rope.apply(&mut q, nh);
            rope.apply(&mut k, nkv);
            for r in 0..n {
                pool.write(
                    li,
                    tables[rows.seq[r]],
                    rows.positions[r],
                    &k[r * kvd..(r + 1) * kvd],
                    &v[r * kvd..(r + 1) * kvd],
                );
            }
            let pool_ref = &*pool;
            attn.par_chunks_mut(qd)
                .enumerate()
                .for_each_init(Vec::new, |scores, (r, out)| {
                    pool_ref.attend(
                        li,
                        tables[rows.seq[r]],
                        rows.positions[r] + 1,
                        &q[r * qd..(r + 1) * qd],
                        nh,
                        scale,
                        out,
                        scores,
                    )
                });
            let a = Tensor::from_slice(&attn, (n, qd), &Device::Cpu)?;
            x = (x + layer.o.forward(&a)?)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let g = candle_nn::ops::silu(&layer.gate.forward(&h)?)?;
            let u = layer.up.forward(&h)?;
            x = (x + layer.down.forward(&(g * u)?)?)?;
        }
        if rows.logit_rows.is_empty() {
            return Ok(Tensor::zeros(
                (0, cfg.vocab_size),
                candle_core::DType::F32,
                &Device::Cpu,
            )?);
        }
        let x = if rows.logit_rows.len() == n {
            x
        } else {
            let idx = Tensor::new(rows.logit_rows.as_slice(), &Device::Cpu)?;
            x.index_select(&idx, 0)?
        };
        let x = candle_nn::ops::rms_norm(&x, &w.norm, eps)?;
        w.lm_head.forward(&x)
    }

    /// Runs a throwaway two-row forward so that candle packs every weight
    /// into its kernel layout now (it does so lazily, on first use: about
    /// 1.5 s for the 1.5B model) rather than inside the first request.
    pub fn warm_up(&self) -> Result<()> {
        let mut pool = KvPool::new(&self.cfg, 1, 2)?;
        self.forward(
            &mut pool,
            &[SeqInput {
                tokens: &[0, 0],
                start_pos: 0,
                block_table: &[0],
                logits: LogitsWanted::Last,
            }],
        )?;
        Ok(())
    }

    /// [`Model::forward`] with the logits as one `Vec<f32>` per row.
    pub fn forward_rows(&self, pool: &mut KvPool, seqs: &[SeqInput]) -> Result<Vec<Vec<f32>>> {
        Ok(self.forward(pool, seqs)?.to_vec2::<f32>()?)
    }

    /// Convenience for one sequence: logits rows as `Vec<Vec<f32>>`.
    pub fn forward_one(
        &self,
        pool: &mut KvPool,
        tokens: &[u32],
        start_pos: usize,
        block_table: &[u32],
        logits: LogitsWanted,
    ) -> Result<Vec<Vec<f32>>> {
        self.forward_rows(
            pool,
            &[SeqInput {
                tokens,
                start_pos,
                block_table,
                logits,
            }],
        )
    }
}
