//! The llama family (llama, and qwen2: llama with q/k/v biases and
//! neox-style RoPE): its weights ([`Layer`], one [`Shard`] per
//! tensor-parallel rank), its loading (`load.rs`), and its ONE forward pass
//! over a paged KV pool.
//!
//! One call takes a flattened batch of rows from many sequences: every row
//! is one new token at its own position. Each layer first writes every new
//! row's K/V into the pool, then each row attends over positions
//! `0..=position` of its own sequence; since rows of one sequence carry
//! consecutive positions, that is causal within the new rows too. A forward
//! with token trees (`tree.rs`, [`Model::forward_trees`]) instead writes
//! each row at the slot the tree layout names and attends only the slots it
//! lists (the cached prefix, its ancestors, itself); without trees that
//! path is not taken at all.
//!
//! Tensor parallelism: the same code runs on every rank over that rank's
//! [`Shard`] (its heads, its MLP slice, its vocabulary rows) and its KV pool
//! shard. Two all-reduces per layer (after o_proj and after down_proj) make
//! every rank's residual stream the full model's; one all-gather assembles
//! the logits. At world size 1 the collectives are skipped, not run as
//! identities, so that path does no extra copies.
//!
//! Threads: a sharded forward runs its ranks through `ranks.rs` (scoped
//! threads per call, rank 0 on the caller's); an unsharded one runs on a
//! rayon worker. Within a rank, q/k/v and gate/up are one kernel pass each
//! (`forward_many`), attention is one task per (row, KV head), both on the
//! thread team (`crate::team`, whose helpers spin between loops), and the
//! norms, activation and residual adds (`ops.rs`) work on buffers reused by
//! every layer.

use super::config::{ModelConfig, RopeStyle};
use super::linear::{forward_many, Embedding, Linear};
use super::ops;
use super::ranks::{assemble_vocab, run_ranks, Rank};
use super::rows::{flatten, Rows, SeqInput};
use super::tree::TreeAttn;
use super::{Body, Model};
use crate::error::{Result, VerifyError};
use crate::kv_pool::{CacheDtype, KvPool, KvShard};
use crate::team;
use crate::tp::{Communicator, LocalComm, ThreadComm};
use candle_core::{Device, Tensor};
use std::ops::Range;

mod load;
pub(crate) use load::{config_from_hf_json, load_gguf, load_safetensors};

/// One transformer block's weights.
pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// One tensor-parallel rank's part of a model: its query and KV heads of
/// every layer, its slice of every MLP, its rows of the output head, and its
/// end of the rank group. At world size 1 the one shard is the whole model.
pub(crate) struct Shard {
    pub(crate) comm: Box<dyn Communicator>,
    pub(crate) embed: Embedding,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    /// The vocabulary rows `vocab` of the output head.
    pub(crate) lm_head: Linear,
    pub(crate) vocab: Range<usize>,
    /// Query heads of this rank.
    pub(crate) num_heads: usize,
    /// KV heads of this rank (its [`crate::KvPool`] shard holds these).
    pub(crate) num_kv_heads: usize,
}

/// What a loader hands [`from_rank_parts`] for one rank.
pub(crate) struct RankParts {
    pub(crate) embed: Embedding,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: Linear,
    pub(crate) vocab: Range<usize>,
    pub(crate) num_kv_heads: usize,
}

/// Assembles a model from per-rank shards in rank order, connecting them
/// with a [`LocalComm`] (one shard) or a [`ThreadComm`] group.
pub(crate) fn from_rank_parts(
    cfg: ModelConfig,
    parts: Vec<RankParts>,
    weight_bytes: usize,
    lm_bytes: usize,
) -> Result<Model> {
    let comms: Vec<Box<dyn Communicator>> = if parts.len() == 1 {
        vec![Box::new(LocalComm)]
    } else {
        ThreadComm::group(parts.len())?
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator>)
            .collect()
    };
    let group = cfg.num_heads / cfg.num_kv_heads;
    let shards = parts
        .into_iter()
        .zip(comms)
        .map(|(p, comm)| Shard {
            comm,
            embed: p.embed,
            layers: p.layers,
            norm: p.norm,
            lm_head: p.lm_head,
            vocab: p.vocab,
            num_heads: p.num_kv_heads * group,
            num_kv_heads: p.num_kv_heads,
        })
        .collect();
    Ok(Model {
        cfg,
        body: Body::Llama(shards),
        weight_bytes,
        head_tokens: None,
        lm_bytes,
        step: std::sync::Mutex::new(()),
        leader: None,
        latent_cache: CacheDtype::F32,
    })
}

/// Family-specific checks of [`ModelConfig::validate`]: the llama family
/// has none of the DeepSeek-V3 family's parts.
pub(crate) fn validate(cfg: &ModelConfig) -> Result<()> {
    if cfg.mla.is_some() || cfg.moe.is_some() || cfg.yarn.is_some() {
        Err(VerifyError::BadConfig(format!(
            "latent attention, experts and YaRN are DeepseekV3-family only, not {:?}",
            cfg.arch
        )))
    } else {
        Ok(())
    }
}

/// The family's part of [`Model::restrict_head`]: replaces the one shard's
/// output head by its rows `tokens` (already checked against the
/// vocabulary).
///
/// Errors: a sharded model (world size above 1).
pub(crate) fn restrict_head(shards: &mut [Shard], tokens: &[u32]) -> Result<()> {
    let [shard] = shards else {
        return Err(VerifyError::BadConfig(
            "a restricted head needs an unsharded model (tensor-parallel world size 1)".into(),
        ));
    };
    shard.lm_head = shard.lm_head.select_rows(tokens)?;
    Ok(())
}

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

/// Everything one forward shares across ranks (read-only).
struct Step<'a> {
    rows: &'a Rows,
    /// Per-row slots and visible slots of a forward with token trees.
    tree: Option<&'a TreeAttn>,
    tables: &'a [&'a [u32]],
    rope: &'a RopeRows,
    eps: f32,
    head_dim: usize,
    vocab_size: usize,
    /// Every rank's vocabulary rows, in rank order (to reassemble logits).
    vocab: &'a [Range<usize>],
}

/// The family's forward over `shards` (one per tensor-parallel rank, in
/// rank order): see [`Model::forward`] for the contract.
pub(crate) fn forward(
    model: &Model,
    shards: &[Shard],
    pool: &mut KvPool,
    seqs: &[SeqInput],
) -> Result<Tensor> {
    let rows = flatten(model, pool, seqs)?;
    forward_rows(model, shards, pool, seqs, &rows, None)
}

/// The forward over `rows` (flattened from `seqs`); with `tree`, rows
/// write and attend the slots it names ([`TreeAttn`], positions in `rows`
/// already the RoPE positions), else slot == position and every row
/// attends `0..=position`.
pub(crate) fn forward_rows(
    model: &Model,
    shards: &[Shard],
    pool: &mut KvPool,
    seqs: &[SeqInput],
    rows: &Rows,
    tree: Option<&TreeAttn>,
) -> Result<Tensor> {
    let cfg = &model.cfg;
    let rope = RopeRows::new(
        cfg.head_dim,
        cfg.rope_theta,
        cfg.rope_style,
        &rows.positions,
    );
    let tables: Vec<&[u32]> = seqs.iter().map(|s| s.block_table).collect();
    let vocab: Vec<Range<usize>> = shards.iter().map(|s| s.vocab.clone()).collect();
    let step = Step {
        rows,
        tree,
        tables: &tables,
        rope: &rope,
        eps: cfg.rms_norm_eps as f32,
        head_dim: cfg.head_dim,
        vocab_size: cfg.vocab_size,
        vocab: &vocab,
    };
    // Two sharded forwards at once would interleave their collectives
    // on the one rank group.
    let _one_step =
        (shards.len() > 1).then(|| model.step.lock().unwrap_or_else(|e| e.into_inner()));
    let logits = rank0(run_ranks(shards, pool.shards_mut(), |shard, kv| {
        shard.forward(&step, kv)
    }))?;
    spread_restricted_head(model, logits)
}

/// With a restricted head ([`Model::restrict_head`], world size 1 only)
/// spreads its columns over the full vocabulary, -inf elsewhere, so
/// callers always see `[n, vocab]` logits.
fn spread_restricted_head(model: &Model, logits: Tensor) -> Result<Tensor> {
    let Some(ids) = &model.head_tokens else {
        return Ok(logits);
    };
    let vocab = model.cfg.vocab_size;
    let m = logits.dim(0)?;
    let sub = logits.flatten_all()?.to_vec1::<f32>()?;
    let mut full = vec![f32::NEG_INFINITY; m * vocab];
    for (row, src) in full
        .chunks_exact_mut(vocab)
        .zip(sub.chunks_exact(ids.len()))
    {
        for (&t, &v) in ids.iter().zip(src) {
            row[t as usize] = v;
        }
    }
    Ok(Tensor::from_vec(full, (m, vocab), &Device::Cpu)?)
}

/// Rank 0's result of a forward: its logits.
fn rank0(r: Result<Option<Tensor>>) -> Result<Tensor> {
    r?.ok_or_else(|| VerifyError::RankFailed("rank 0 returned no logits".into()))
}

impl Rank for Shard {
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
}

impl Shard {
    /// This rank's part of one forward. Returns the logits on rank 0 and
    /// `None` on the others.
    fn forward(&self, step: &Step, kv: &mut KvShard) -> Result<Option<Tensor>> {
        let rows = step.rows;
        let n = rows.tokens.len();
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, step.head_dim);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let eps = step.eps;
        let scale = 1.0 / (hd as f32).sqrt();
        let tables = step.tables;

        let ids = Tensor::new(rows.tokens.as_slice(), &Device::Cpu)?;
        let mut x = self.embed.forward(&ids)?.flatten_all()?.to_vec1::<f32>()?;
        let hidden = x.len() / n.max(1);
        // Buffers reused by every layer: the step allocates nothing per layer.
        let ff = match self.layers.first() {
            Some(l) => l.gate.out_features()?,
            None => 0,
        };
        let mut h = vec![0f32; n * hidden];
        let mut part = vec![0f32; n * hidden];
        let (mut q, mut k, mut v) = (vec![0f32; n * qd], vec![0f32; n * kvd], vec![0f32; n * kvd]);
        let (mut g, mut u) = (vec![0f32; n * ff], vec![0f32; n * ff]);
        let mut attn = vec![0f32; n * qd];
        for (li, layer) in self.layers.iter().enumerate() {
            ops::rms_norm_into(&x, &layer.attn_norm, eps, &mut h);
            forward_many(
                &[&layer.q, &layer.k, &layer.v],
                &h,
                n,
                &mut [&mut q, &mut k, &mut v],
            )?;
            step.rope.apply(&mut q, nh);
            step.rope.apply(&mut k, nkv);
            for r in 0..n {
                kv.write(
                    li,
                    tables[rows.seq[r]],
                    step.tree.map_or(rows.positions[r], |t| t.slot[r]),
                    &k[r * kvd..(r + 1) * kvd],
                    &v[r * kvd..(r + 1) * kvd],
                );
            }
            // One task per (row, KV head): the query heads sharing a KV head
            // read each K/V row once, and a single decoded row still spreads
            // over the cores.
            let kv_ref = &*kv;
            let group = nh / nkv;
            team::for_each_chunk(&mut attn, group * hd, |i, out| {
                let (r, g) = (i / nkv, i % nkv);
                let at = r * qd + g * group * hd;
                let (table, q) = (tables[rows.seq[r]], &q[at..at + group * hd]);
                match step.tree {
                    None => kv_ref.attend_group(
                        li,
                        table,
                        rows.positions[r] + 1,
                        q,
                        g,
                        scale,
                        out,
                        &mut Vec::new(),
                    ),
                    Some(t) => kv_ref.attend_group_tree(
                        li,
                        table,
                        t.prefix[r],
                        &t.extra[r],
                        q,
                        g,
                        scale,
                        out,
                        &mut Vec::new(),
                    ),
                }
            });
            layer.o.forward_into(&attn, n, &mut part)?;
            self.comm.all_reduce_sum(&mut part)?;
            ops::add_in_place(&mut x, &part);
            ops::rms_norm_into(&x, &layer.ffn_norm, eps, &mut h);
            forward_many(&[&layer.gate, &layer.up], &h, n, &mut [&mut g, &mut u])?;
            ops::silu_mul(&mut g, &u);
            layer.down.forward_into(&g, n, &mut part)?;
            self.comm.all_reduce_sum(&mut part)?;
            ops::add_in_place(&mut x, &part);
        }
        let x = Tensor::from_vec(x, (n, hidden), &Device::Cpu)?;
        let m = rows.logit_rows.len();
        if m == 0 {
            return Ok((self.comm.rank() == 0)
                .then(|| Tensor::zeros((0, step.vocab_size), candle_core::DType::F32, &Device::Cpu))
                .transpose()?);
        }
        let x = if m == n {
            x
        } else {
            let idx = Tensor::new(rows.logit_rows.as_slice(), &Device::Cpu)?;
            x.index_select(&idx, 0)?
        };
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        let local = self.lm_head.forward(&x)?;
        if self.comm.world_size() == 1 {
            return Ok(Some(local));
        }
        // Gathered: rank 0's [m, v0] block, then rank 1's [m, v1], ...
        let gathered = self
            .comm
            .all_gather(&local.flatten_all()?.to_vec1::<f32>()?)?;
        if self.comm.rank() != 0 {
            return Ok(None);
        }
        let vocab = step.vocab_size;
        let logits = assemble_vocab(&gathered, m, step.vocab, vocab);
        Ok(Some(Tensor::from_vec(logits, (m, vocab), &Device::Cpu)?))
    }
}
