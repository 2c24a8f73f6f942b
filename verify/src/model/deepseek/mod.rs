//! The DeepSeek-V3 family (config.json `model_type` `deepseek_v3`, and
//! `kimi_k2`, which is the same architecture): its config keys, its
//! safetensors loading (one tensor-parallel rank's shard), and its ONE
//! forward pass over a latent paged KV pool.
//!
//! Multi-head latent attention (MLA): the cache holds, per token and layer,
//! the compressed KV latent (after `kv_a_layernorm`) and the RoPE'd key
//! shared by all heads. Attention runs in the latent space with absorbed
//! projections: `q_nope . W_UK^T` is a latent-space query, the softmax
//! weights combine latents, and `W_UV` then `o_proj` map the result out.
//! [`MlaPrefill::ExpandFresh`] instead expands per-head K/V for a prompt
//! chunk that starts at position 0 (fewer FLOPs for long prompts).
//!
//! Mixture of experts: a sigmoid router, `e_score_correction_bias` added for
//! selection only, group-limited top-k, weights from the uncorrected scores
//! (normalized when `norm_topk_prob`) times `routed_scaling_factor`, plus
//! the shared experts; layers `0..first_k_dense_replace` are dense.
//!
//! Tensor parallelism: each rank holds a contiguous slice of the attention
//! heads (q/kv_b rows, o_proj columns), the experts `e` with
//! `e % world == rank`, column slices of the dense and shared MLPs and a
//! slice of the vocabulary. The latent projections and the router are small
//! and replicated, and so is the latent cache (every head reads all of it).
//! Per layer: one all-reduce after attention, one after the MLP (routed and
//! shared experts summed locally first); the logits are all-gathered.
//!
//! Config parsing and the sharded loading live in `load.rs`.
//!
//! Every matrix is a [`Linear`] kept in the checkpoint's format (BF16 stays
//! BF16) on a batch-invariant kernel (the latent `kv_b`, read one weight
//! row at a time by the absorbed attention, is f32): row r of a result
//! depends only on row r of the input, bit for bit, so a token is
//! scored identically in a one-row decode step, a k+1-row verification and
//! any batch around it, and the routed experts, which see a different set
//! of rows in every batch, stay batch-invariant too. Greedy speculative
//! decoding's "identical output" guarantee rests on that.

use super::config::{ModelConfig, MoeConfig, RopeStyle};
use super::dense::Dense;
use super::linear::{forward_many, Linear};
use super::mla::{attend_rows, MlaDims as Dims};
use super::moe::route;
use super::ops::{rms_norm, silu};
use super::ranks::{dense_head, run_ranks, Rank};
use super::rows::{flatten, Rows, SeqInput};
use super::Model;
use crate::error::Result;
use crate::kernels::vector::{axpy, dot};
use crate::kv_pool::{KvPool, KvShard};
use crate::tp::Communicator;
use candle_core::Tensor;
use rayon::prelude::*;

mod load;
pub(crate) use load::{config_from_hf_json, load, validate};

/// How prompt chunks that start at position 0 attend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MlaPrefill {
    /// Every row attends in the latent space (absorbed projections). The
    /// default: a token's result is then bit-identical however the prompt
    /// was chunked and batched.
    #[default]
    Absorbed,
    /// Chunks starting at position 0 expand per-head K/V from their latents
    /// (kv_b_proj once per token instead of the absorbed products per
    /// query-key pair); other rows attend in the latent space. Same logits
    /// up to float rounding.
    ExpandFresh,
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    fn forward(&self, x: &[f32]) -> Result<Vec<f32>> {
        let (n, k) = (self.gate.out_features()?, self.gate.in_features()?);
        let rows = x.len() / k;
        let (mut g, mut u) = (vec![0f32; rows * n], vec![0f32; rows * n]);
        forward_many(&[&self.gate, &self.up], x, rows, &mut [&mut g, &mut u])?;
        let a: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        self.down.apply(&a)
    }
}

enum Query {
    Full(Linear),
    LowRank {
        a: Linear,
        norm: Vec<f32>,
        b: Linear,
    },
}

struct Attention {
    q: Query,
    /// hidden -> kv_lora_rank + qk_rope_head_dim (replicated).
    kv_a: Linear,
    kv_a_norm: Vec<f32>,
    /// This rank's heads' rows of kv_b_proj: per head `qk_nope_head_dim`
    /// rows of W_UK then `v_head_dim` rows of W_UV, each `kv_lora_rank` wide.
    kv_b: Dense,
    /// Columns of this rank's heads.
    o: Linear,
}

struct Moe {
    /// `[n_routed_experts, hidden]`, replicated so every rank routes alike.
    router: Linear,
    bias: Vec<f32>,
    /// The experts this rank holds, ascending by expert index.
    experts: Vec<(usize, Mlp)>,
    /// This rank's column slice of the shared experts.
    shared: Option<Mlp>,
}

enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

struct DsLayer {
    attn_norm: Vec<f32>,
    attn: Attention,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
}

/// Inverse frequencies and cos/sin scale of the decoupled RoPE.
struct Rope {
    inv_freq: Vec<f32>,
    attention_factor: f32,
    style: RopeStyle,
}

/// One rank's shard of a DeepSeek-V3-family model.
pub(crate) struct Weights {
    embed: Vec<f32>,
    layers: Vec<DsLayer>,
    norm: Vec<f32>,
    /// This rank's vocabulary rows.
    lm_head: Linear,
    rope: Rope,
    softmax_scale: f32,
    local_heads: usize,
    prefill: MlaPrefill,
    comm: Box<dyn Communicator>,
}

fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl Rope {
    /// transformers' default and YaRN RoPE parameters, in f32 like torch.
    fn new(cfg: &ModelConfig, dim: usize) -> Self {
        let base = cfg.rope_theta;
        let pos_freqs: Vec<f32> = (0..dim / 2)
            .map(|i| base.powf((2 * i) as f32 / dim as f32))
            .collect();
        let Some(y) = &cfg.yarn else {
            return Self {
                inv_freq: pos_freqs.iter().map(|p| 1.0 / p).collect(),
                attention_factor: 1.0,
                style: cfg.rope_style,
            };
        };
        let attention_factor = y.attention_factor.unwrap_or_else(|| {
            if y.mscale != 0.0 && y.mscale_all_dim != 0.0 {
                yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
            } else {
                yarn_mscale(y.factor, 1.0)
            }
        });
        let corr = |rot: f64| {
            dim as f64 * (y.original_max_position as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * (base as f64).ln())
        };
        let low = corr(y.beta_fast).floor().max(0.0);
        let mut high = corr(y.beta_slow).ceil().min(dim as f64 - 1.0);
        if low == high {
            high += 0.001;
        }
        let (low, high) = (low as f32, high as f32);
        let factor = y.factor as f32;
        let inv_freq = pos_freqs
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                let (extra, inter) = (1.0 / p, 1.0 / (factor * p));
                inter * (1.0 - extrapolation) + extra * extrapolation
            })
            .collect();
        Self {
            inv_freq,
            attention_factor: attention_factor as f32,
            style: cfg.rope_style,
        }
    }

    /// Rotates one head's RoPE part `x` for position `pos`.
    fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let a = pos as f32 * f;
            let (c, s) = (
                a.cos() * self.attention_factor,
                a.sin() * self.attention_factor,
            );
            let (i0, i1) = match self.style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::Neox => (i, i + half),
            };
            let (x0, x1) = (x[i0], x[i1]);
            x[i0] = x0 * c - x1 * s;
            x[i1] = x1 * c + x0 * s;
        }
    }
}

impl Moe {
    /// This rank's part of the MoE output for rows `x` (`[n, hidden]`).
    fn forward(&self, x: &[f32], hidden: usize, cfg: &MoeConfig) -> Result<Vec<f32>> {
        let n = x.len() / hidden;
        let ne = cfg.n_routed_experts;
        let logits = self.router.apply(x)?;
        let chosen: Vec<Vec<(usize, f32)>> = (0..n)
            .map(|r| route(&logits[r * ne..(r + 1) * ne], &self.bias, cfg))
            .collect();
        let mut out = match &self.shared {
            Some(s) => s.forward(x)?,
            None => vec![0.0; n * hidden],
        };
        // Experts in ascending order, so each row's sum has one fixed order.
        for (xi, mlp) in &self.experts {
            let mut rows = Vec::new();
            let mut wts = Vec::new();
            for (r, c) in chosen.iter().enumerate() {
                if let Some(&(_, w)) = c.iter().find(|p| p.0 == *xi) {
                    rows.push(r);
                    wts.push(w);
                }
            }
            if rows.is_empty() {
                continue;
            }
            let input: Vec<f32> = rows
                .iter()
                .flat_map(|&r| &x[r * hidden..(r + 1) * hidden])
                .copied()
                .collect();
            let y = mlp.forward(&input)?;
            for (j, (&r, &w)) in rows.iter().zip(&wts).enumerate() {
                axpy(
                    w,
                    &y[j * hidden..(j + 1) * hidden],
                    &mut out[r * hidden..(r + 1) * hidden],
                );
            }
        }
        Ok(out)
    }
}

impl Weights {
    /// Sets how fresh prompt chunks attend (see [`MlaPrefill`]).
    pub(crate) fn set_prefill(&mut self, mode: MlaPrefill) {
        self.prefill = mode;
    }
}

/// Expanded causal attention of a fresh chunk (positions `0..m`): per-head
/// K/V from the chunk's own latent rows `lat` (`[m, kvr + rope]`).
fn attend_expanded(d: Dims, kv_b: &Dense, lat: &[f32], q: &[f32], out: &mut [f32]) {
    let w = d.kvr + d.rope;
    let latents: Vec<f32> = lat
        .chunks_exact(w)
        .flat_map(|r| &r[..d.kvr])
        .copied()
        .collect();
    let kv = kv_b.forward(&latents); // [m, heads * (nope + v)]
    let (qk, hw) = (d.nope + d.rope, d.heads * (d.nope + d.v));
    let qd = d.heads * qk;
    out.par_chunks_mut(d.heads * d.v)
        .enumerate()
        .for_each(|(i, o)| {
            let mut scores = vec![0.0f32; i + 1];
            for hh in 0..d.heads {
                let qn = &q[i * qd + hh * qk..i * qd + hh * qk + d.nope];
                let qr = &q[i * qd + hh * qk + d.nope..i * qd + (hh + 1) * qk];
                let mut max = f32::NEG_INFINITY;
                for (t, s) in scores.iter_mut().enumerate() {
                    let kn = &kv[t * hw + hh * (d.nope + d.v)..][..d.nope];
                    *s = (dot(qn, kn) + dot(qr, &lat[t * w + d.kvr..(t + 1) * w])) * d.scale;
                    max = max.max(*s);
                }
                let mut sum = 0.0;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let oh = &mut o[hh * d.v..(hh + 1) * d.v];
                oh.fill(0.0);
                for (t, &s) in scores.iter().enumerate() {
                    let vt = &kv[t * hw + hh * (d.nope + d.v) + d.nope..][..d.v];
                    axpy(s / sum, vt, oh);
                }
            }
        });
}

/// The family's forward over `ranks` (one per tensor-parallel rank this
/// model runs, each with its full copy of the latent cache in its pool
/// shard): see [`Model::forward`] for the contract. A rank loaded alone by
/// [`super::load_safetensors_shard`] is one rank of a group its caller
/// drives; every rank of such a group must be called with the same batch.
pub(crate) fn forward(
    model: &Model,
    ranks: &[Weights],
    pool: &mut KvPool,
    seqs: &[SeqInput],
) -> Result<Tensor> {
    let rows = flatten(model, pool, seqs)?;
    // Two sharded forwards at once would interleave their collectives.
    let _one_step = (ranks.len() > 1).then(|| model.step.lock().unwrap_or_else(|e| e.into_inner()));
    run_ranks(ranks, pool.shards_mut(), |w, kv| {
        forward_rank(&model.cfg, w, kv, &rows, seqs)
    })
}

impl Rank for Weights {
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
}

/// One rank's part of [`forward`]; every rank returns the full logits.
fn forward_rank(
    cfg: &ModelConfig,
    w: &Weights,
    pool: &mut KvShard,
    rows: &Rows,
    seqs: &[SeqInput],
) -> Result<Tensor> {
    let mla = cfg.mla.as_ref().expect("validated");
    let n = rows.tokens.len();
    let hidden = cfg.hidden_size;
    let eps = cfg.rms_norm_eps as f32;
    let d = Dims {
        heads: w.local_heads,
        nope: mla.qk_nope_head_dim,
        rope: mla.qk_rope_head_dim,
        v: mla.v_head_dim,
        kvr: mla.kv_lora_rank,
        scale: w.softmax_scale,
    };
    let (qk, lw) = (d.nope + d.rope, d.kvr + d.rope);
    let tables: Vec<&[u32]> = seqs.iter().map(|s| s.block_table).collect();
    // Row ranges of the sequences whose chunk is expanded.
    let mut expanded: Vec<std::ops::Range<usize>> = Vec::new();
    let mut start = 0;
    for s in seqs {
        if w.prefill == MlaPrefill::ExpandFresh && s.start_pos == 0 {
            expanded.push(start..start + s.tokens.len());
        }
        start += s.tokens.len();
    }
    let in_expanded = |r: usize| expanded.iter().any(|e| e.contains(&r));

    let mut x: Vec<f32> = rows
        .tokens
        .iter()
        .flat_map(|&t| &w.embed[t as usize * hidden..(t as usize + 1) * hidden])
        .copied()
        .collect();
    let mut attn = vec![0f32; n * d.heads * d.v];
    for (li, layer) in w.layers.iter().enumerate() {
        let h = rms_norm(&x, &layer.attn_norm, eps);
        let a = &layer.attn;
        let mut q = match &a.q {
            Query::Full(p) => p.apply(&h)?,
            Query::LowRank { a, norm, b } => b.apply(&rms_norm(&a.apply(&h)?, norm, eps))?,
        };
        let mut lat = a.kv_a.apply(&h)?;
        for r in 0..n {
            let pos = rows.positions[r];
            let row = &mut lat[r * lw..(r + 1) * lw];
            let normed = rms_norm(&row[..d.kvr], &a.kv_a_norm, eps);
            row[..d.kvr].copy_from_slice(&normed);
            w.rope.apply(&mut row[d.kvr..], pos);
            for hh in 0..d.heads {
                let o = r * d.heads * qk + hh * qk + d.nope;
                w.rope.apply(&mut q[o..o + d.rope], pos);
            }
            pool.write_latent(li, tables[rows.seq[r]], pos, row);
        }
        attend_rows(
            d,
            &a.kv_b,
            pool,
            li,
            rows,
            &tables,
            &q,
            &mut attn,
            in_expanded,
            None,
        );
        let qd = d.heads * qk;
        for e in &expanded {
            attend_expanded(
                d,
                &a.kv_b,
                &lat[e.start * lw..e.end * lw],
                &q[e.start * qd..e.end * qd],
                &mut attn[e.start * d.heads * d.v..e.end * d.heads * d.v],
            );
        }
        let mut o = a.o.apply(&attn)?;
        w.comm.all_reduce_sum(&mut o)?;
        x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);

        let h = rms_norm(&x, &layer.ffn_norm, eps);
        let mut f = match &layer.ffn {
            Ffn::Dense(m) => m.forward(&h)?,
            Ffn::Moe(m) => {
                m.forward(&h, hidden, cfg.moe.as_ref().expect("MoE layer has config"))?
            }
        };
        w.comm.all_reduce_sum(&mut f)?;
        x.iter_mut().zip(&f).for_each(|(x, f)| *x += f);
    }
    dense_head(
        &x,
        hidden,
        rows,
        &w.norm,
        |x| w.lm_head.apply(x),
        eps,
        w.comm.as_ref(),
        cfg.vocab_size,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(n_group: usize, topk_group: usize, k: usize, norm: bool) -> MoeConfig {
        MoeConfig {
            n_routed_experts: 8,
            num_experts_per_tok: k,
            moe_intermediate_size: 4,
            n_shared_experts: 1,
            n_group,
            topk_group,
            norm_topk_prob: norm,
            routed_scaling_factor: 2.0,
            first_k_dense_replace: 0,
        }
    }

    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn routing_limits_groups_corrects_selection_only_and_scales() {
        // Scores (sigmoid) per expert, 4 groups of 2.
        let s = [0.9, 0.1, 0.5, 0.5, 0.8, 0.7, 0.2, 0.3];
        let logits: Vec<f32> = s.iter().map(|&p| logit(p)).collect();
        let zero = [0.0; 8];
        // Group sums: 1.0, 1.0, 1.5, 0.5 -> keep groups 2 and 0 (tie with 1
        // goes to the lower index); experts 0, 4, 5 by score.
        let r = route(&logits, &zero, &moe(4, 2, 3, false));
        let ids: Vec<usize> = r.iter().map(|p| p.0).collect();
        assert_eq!(ids, vec![0, 4, 5]);
        for (x, w) in &r {
            assert!((w - 2.0 * s[*x]).abs() < 1e-5, "{x}: {w}");
        }
        // The correction bias lifts group 3 and expert 7 into the choice,
        // but the weights stay the uncorrected scores (normalized here).
        let mut bias = zero;
        bias[7] = 1.0;
        let r = route(&logits, &bias, &moe(4, 2, 3, true));
        let ids: Vec<usize> = r.iter().map(|p| p.0).collect();
        assert_eq!(ids, vec![7, 4, 5]);
        let z = s[7] + s[4] + s[5];
        for (x, w) in &r {
            assert!((w - 2.0 * s[*x] / z).abs() < 1e-5, "{x}: {w}");
        }
        // Without group limits the best three overall win.
        let r = route(&logits, &zero, &moe(1, 1, 3, false));
        let ids: Vec<usize> = r.iter().map(|p| p.0).collect();
        assert_eq!(ids, vec![0, 4, 5]);
    }
}
