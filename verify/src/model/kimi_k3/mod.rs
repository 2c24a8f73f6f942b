//! The Kimi K3 family (config.json `model_type` `kimi_k3`, text model
//! `kimi_linear` under `text_config`; llama.cpp GGUF architecture
//! `kimi-k3`): its config, its loading from a Hugging Face directory or a
//! GGUF (`load.rs`), and its ONE forward pass, sharded over
//! tensor-parallel ranks.
//!
//! A K3 layer is either **KDA** (Kimi Delta Attention, `kda.rs`: fused
//! short convolutions on q/k/v, a per-key-channel decay gate with K3's
//! lower bound, a delta-rule recurrent state per sequence, a per-head
//! norm and a full-rank sigmoid output gate) or **gated NoPE MLA** (latent
//! attention with no rotary embedding, and a sigmoid gate on its output
//! before `o_proj`). The FFN is a dense SiTU MLP for the first layers, then
//! a **latent MoE**: the router scores the full-width input, the routed
//! experts run in a down-projected latent width, their sum is RMS-normed
//! and projected back up, and the shared experts run at full width.
//! **Attention residuals** replace the plain residual stream: every
//! `attn_res_block_size` layers the stream is banked, and each sublayer's
//! input is a softmax-weighted mix of the banked streams and the current
//! one, scored by an RMS-normed dot product with a learned vector.
//!
//! Caches: an MLA layer writes one latent row per token into the pool's
//! latent blocks (as the DeepSeek family does); a KDA layer keeps a
//! recurrent state in the sequence's state slot ([`SeqInput::state_slot`]):
//! the last `kernel - 1` conv inputs of q, k and v, and a `[dk, dv]` state
//! per head. A sequence whose input starts at position 0 starts from a zero
//! state, so a recomputed (preempted) sequence rebuilds it. A token tree's
//! rows each continue from their parent row's state (`tree.rs`).
//!
//! Tensor parallelism: KDA and MLA heads, dense and shared MLP columns and
//! the vocabulary split across ranks; routed experts go to rank
//! `e % world`. Replicated: norms, the decay projection `f_a`, the latent
//! projections of the MLA and of the MoE, the router. Per layer one
//! all-reduce after the mixer; the MoE adds one on the latent sum (the
//! routed norm needs the whole sum) and one on the shared experts.
//!
//! Weights are [`Linear`]s kept in the checkpoint's own format (BF16, F32,
//! the GGUF block formats, MXFP4 experts), on batch-invariant kernels, so a
//! token's logits do not depend on the batch around it or on how its
//! prompt was chunked. The routed experts of one MoE layer run as one
//! grouped MXFP4 pass: each active expert's weights are read once for all
//! the rows routed to it, and experts and their output rows spread over
//! the thread team.

use super::dense::Dense;
use super::linear::{forward_many, Linear};
use super::mla::{attend_rows, MlaDims};
use super::moe::route;
use super::ops::rms_norm;
use super::ranks::{dense_head, run_ranks, Rank};
use super::rows::{flatten, Rows};
use super::tree::TreeAttn;
use super::{LogitsWanted, Model, MoeConfig, SeqInput};
use crate::error::Result;
use crate::kernels::mxfp4::{self, Mxfp4Matrix, Mxfp4Product, Q8Acts};
use crate::kernels::vector::{self, axpy, dot};
use crate::kv_pool::{CacheDtype, KvPool, KvShard};
use crate::team::{self, SharedMut};
use crate::tp::Communicator;
use candle_core::Tensor;
use tree::Span;

mod kda;
mod load;
mod tree;

pub(crate) use load::{config_from_hf_json, load_gguf, load_hf};
pub(crate) use tree::Trees;

/// K3's numerics beyond the core [`super::ModelConfig`] (which holds the
/// widths, the MLA shape and the MoE routing).
#[derive(Debug, Clone, PartialEq)]
pub struct K3Config {
    /// Per layer: `true` for gated MLA, `false` for KDA.
    pub mla_layers: Vec<bool>,
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub conv_kernel: usize,
    /// K3's decay form `lb * sigmoid(exp(A_log) * f)`; `None` is
    /// Kimi-Linear's `-exp(A_log) * softplus(f)`.
    pub gate_lower_bound: Option<f32>,
    /// Width the routed experts run at (`routed_expert_hidden_size`);
    /// `None`: full width.
    pub latent: Option<usize>,
    pub situ_beta: f32,
    /// `<= 0` leaves the up branch linear.
    pub situ_linear_beta: f32,
    /// Layers per attention-residual block; 0 turns attention residuals off.
    pub attn_res_block: usize,
}

impl K3Config {
    /// Floats of one KDA layer's state for `heads` heads: three conv
    /// histories and the per-head `[dk, dv]` states.
    pub(crate) fn kda_state_floats(&self, heads: usize) -> usize {
        let c = heads * self.kda_head_dim;
        3 * (self.conv_kernel - 1) * c + heads * self.kda_head_dim * self.kda_head_dim
    }
}

/// Switches that remove one K3 feature, so tests can show each one matters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Ablation {
    pub(crate) no_gate_lower_bound: bool,
    pub(crate) no_mla_gate: bool,
    pub(crate) no_attn_res: bool,
    /// Routed experts multiply unrounded activations (not an ablation: the
    /// exact product an f64 reference computes).
    pub(crate) exact_experts: bool,
}

/// A routed expert: `down(situ(gate x, up x))` in the latent width.
struct Expert {
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// `x` through `w` with unrounded activations: the exact product an f64
/// reference computes (the `exact_experts` switch; tests only, slow).
fn exact_product(w: &Linear, x: &[f32]) -> Result<Vec<f32>> {
    let (n, k) = (w.out_features()?, w.in_features()?);
    let mut dense = vec![0f32; n * k];
    for (r, row) in dense.chunks_exact_mut(k).enumerate() {
        w.row_f32(r, row)?;
    }
    Ok(Dense::new(dense, n, k).forward(x))
}

impl Expert {
    fn forward(&self, x: &[f32], k3: &K3Config, exact: bool) -> Result<Vec<f32>> {
        let mul = |w: &Linear, x: &[f32]| {
            if exact {
                exact_product(w, x)
            } else {
                w.apply(x)
            }
        };
        let g = mul(&self.gate, x)?;
        let u = mul(&self.up, x)?;
        let a = situ_all(&g, &u, k3);
        mul(&self.down, &a)
    }
}

/// A SiTU MLP: `down(situ(gate x, up x))`.
struct SituMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct Kda {
    q: Linear,
    k: Linear,
    v: Linear,
    /// `[c, kernel]` each, this rank's channels.
    q_conv: Vec<f32>,
    k_conv: Vec<f32>,
    v_conv: Vec<f32>,
    /// hidden -> head_dim (replicated).
    f_a: Linear,
    /// head_dim -> this rank's channels.
    f_b: Linear,
    /// hidden -> this rank's heads.
    beta: Linear,
    /// `exp(A_log)` of this rank's heads.
    a: Vec<f32>,
    /// This rank's channels.
    dt_bias: Vec<f32>,
    /// hidden -> this rank's channels (full-rank output gate).
    g: Linear,
    /// `[head_dim]`, per-head RMSNorm weight.
    o_norm: Vec<f32>,
    /// Columns of this rank's channels.
    o: Linear,
    heads: usize,
}

enum Query {
    Full(Linear),
    LowRank {
        a: Linear,
        norm: Vec<f32>,
        b: Linear,
    },
}

struct GatedMla {
    q: Query,
    /// hidden -> kv_lora_rank + qk_rope_head_dim (replicated).
    kv_a: Linear,
    kv_a_norm: Vec<f32>,
    /// This rank's heads' rows of kv_b_proj (per head: nope rows of W_UK,
    /// then v rows of W_UV), in f32: the absorbed attention reads it one
    /// weight row at a time, in both directions.
    kv_b: Dense,
    /// hidden -> this rank's heads x v_head_dim.
    gate: Option<Linear>,
    o: Linear,
    heads: usize,
}

enum Mixer {
    Kda(Box<Kda>),
    Mla(Box<GatedMla>),
}

struct LatentMoe {
    router: Linear,
    bias: Vec<f32>,
    /// hidden -> latent (replicated); `None` without a latent width.
    down: Option<Linear>,
    /// The experts this rank holds, ascending by index.
    experts: Vec<(usize, Expert)>,
    norm: Option<Vec<f32>>,
    up: Option<Linear>,
    shared: Option<SituMlp>,
}

enum Ffn {
    Dense(Box<SituMlp>),
    Moe(Box<LatentMoe>),
}

struct K3Layer {
    attn_norm: Vec<f32>,
    mixer: Mixer,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
    /// Fused attention-residual score vectors (`res_norm * res_proj`).
    attn_res: Option<Vec<f32>>,
    ffn_res: Option<Vec<f32>>,
}

/// One rank's shard of a Kimi K3 model.
pub(crate) struct Weights {
    /// `[vocab, hidden]`, as stored; a token's row is widened when used.
    embed: Linear,
    layers: Vec<K3Layer>,
    norm: Vec<f32>,
    out_res: Option<Vec<f32>>,
    lm_head: Linear,
    k3: K3Config,
    /// Offsets of each KDA layer's part of a state slot (this rank's
    /// heads); `None` for MLA layers.
    state_offsets: Vec<Option<usize>>,
    state_floats: usize,
    comm: Box<dyn Communicator>,
    pub(crate) ablation: Ablation,
}

impl Weights {
    /// Floats of one sequence's recurrent state on this rank.
    pub(crate) fn state_floats(&self) -> usize {
        self.state_floats
    }

    /// Per layer: whether it is an MLA layer (caches a latent per token).
    pub(crate) fn mla_layer_mask(&self) -> Vec<bool> {
        self.k3.mla_layers.clone()
    }

    /// Bytes of this rank's weights, as stored, that one batch-1 decode
    /// step reads: every matrix but the embedding table, with the routed
    /// experts counted at the share `(top_k, experts)` a token uses.
    pub(crate) fn decode_bytes(&self, (top_k, experts): (usize, usize)) -> usize {
        let b = |l: &Linear| l.weight_bytes();
        let mlp = |m: &SituMlp| b(&m.gate) + b(&m.up) + b(&m.down);
        let mut total = b(&self.lm_head);
        for layer in &self.layers {
            total += match &layer.mixer {
                Mixer::Kda(k) => [&k.q, &k.k, &k.v, &k.f_a, &k.f_b, &k.beta, &k.g, &k.o]
                    .into_iter()
                    .map(b)
                    .sum::<usize>(),
                Mixer::Mla(m) => {
                    let q = match &m.q {
                        Query::Full(p) => b(p),
                        Query::LowRank { a, b: qb, .. } => b(a) + b(qb),
                    };
                    q + b(&m.kv_a) + m.kv_b.w.len() * 4 + m.gate.as_ref().map_or(0, b) + b(&m.o)
                }
            };
            total += match &layer.ffn {
                Ffn::Dense(m) => mlp(m),
                Ffn::Moe(m) => {
                    let routed: usize = m
                        .experts
                        .iter()
                        .map(|(_, e)| b(&e.gate) + b(&e.up) + b(&e.down))
                        .sum();
                    b(&m.router)
                        + m.down.as_ref().map_or(0, b)
                        + m.up.as_ref().map_or(0, b)
                        + m.shared.as_ref().map_or(0, mlp)
                        + routed * top_k / experts.max(1)
                }
            };
        }
        total
    }

    /// The latent cache dtype this checkpoint loads with: f32 when the
    /// matrix that writes the latent (the first MLA layer's `kv_a`) is
    /// stored as f32 (4 bytes a value), bf16 when it is bf16 or quantized
    /// (its values already carry at most bf16's precision; the cache then
    /// takes half the memory).
    pub(crate) fn default_latent_cache(&self) -> CacheDtype {
        let kv_a = self.layers.iter().find_map(|l| match &l.mixer {
            Mixer::Mla(m) => Some(&m.kv_a),
            Mixer::Kda(_) => None,
        });
        let per_value = |l: &Linear| {
            let values = l.out_features().unwrap_or(0) * l.in_features().unwrap_or(0);
            l.weight_bytes() / values.max(1)
        };
        match kv_a {
            Some(w) if per_value(w) < 4 => CacheDtype::Bf16,
            _ => CacheDtype::F32,
        }
    }

    /// Number of MLA layers.
    pub(crate) fn mla_layers(&self) -> usize {
        self.k3.mla_layers.iter().filter(|m| **m).count()
    }
}

impl Rank for Weights {
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `beta * tanh(g / beta) * sigmoid(g) * linear(u)`, `linear(u) = lb *
/// tanh(u / lb)` when `lb > 0`, else `u`. With the vectorizing `tanh`
/// and `sigmoid` (within 3 ulp of libm's): libm's are a call per value,
/// and two `tanh` and an `exp` a value made SiTU ~16% of a prompt chunk.
#[inline(always)]
fn situ(g: f32, u: f32, beta: f32, lb: f32) -> f32 {
    let a = beta * vector::tanh(g / beta) * vector::sigmoid(g);
    let u = if lb > 0.0 {
        lb * vector::tanh(u / lb)
    } else {
        u
    };
    a * u
}

/// [`situ`] of every `(g, u)` pair, in chunks over the forward's thread
/// team: two `tanh` and an `exp` a value make it the costliest elementwise
/// step (the dense layer's 33792 a row, or 4 rows' routed experts: some
/// 200 000 values a layer, milliseconds on one core).
fn situ_all(g: &[f32], u: &[f32], k3: &K3Config) -> Vec<f32> {
    const CHUNK: usize = 4096;
    let mut a = vec![0f32; g.len().min(u.len())];
    team::for_each_chunk(&mut a, CHUNK, |i, out| {
        situ_into(out, &g[i * CHUNK..], &u[i * CHUNK..], k3)
    });
    a
}

/// [`situ`] of the pairs `(g[i], u[i])` into `out[i]`, on this thread.
fn situ_into(out: &mut [f32], g: &[f32], u: &[f32], k3: &K3Config) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = situ(g, u, k3.situ_beta, k3.situ_linear_beta);
    }
}

impl SituMlp {
    fn forward(&self, x: &[f32], k3: &K3Config) -> Result<Vec<f32>> {
        let (n, k) = (self.gate.out_features()?, self.gate.in_features()?);
        let rows = x.len() / k;
        let (mut g, mut u) = (vec![0f32; rows * n], vec![0f32; rows * n]);
        // gate and up share their input: one pass, one conversion of it.
        forward_many(&[&self.gate, &self.up], x, rows, &mut [&mut g, &mut u])?;
        self.down.apply(&situ_all(&g, &u, k3))
    }
}

/// The attention-residual mix of one sublayer input: per row, a softmax
/// over the banked streams and `cur` of `rms(v) . w`, then the weighted sum
/// of the raw streams.
fn res_mix(stack: &[Vec<f32>], cur: &[f32], w: &[f32], hidden: usize, eps: f32) -> Vec<f32> {
    if stack.is_empty() {
        return cur.to_vec();
    }
    let score = |v: &[f32]| dot(v, w) / (dot(v, v) / hidden as f32 + eps).sqrt();
    let mut out = vec![0f32; cur.len()];
    team::for_each_chunk(&mut out, hidden, |r, o| {
        let span = r * hidden..(r + 1) * hidden;
        let mut s: Vec<f32> = stack.iter().map(|b| score(&b[span.clone()])).collect();
        s.push(score(&cur[span.clone()]));
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = s
            .iter_mut()
            .map(|x| {
                *x = (*x - max).exp();
                *x
            })
            .sum();
        for (b, p) in stack.iter().zip(&s) {
            axpy(p / sum, &b[span.clone()], o);
        }
        axpy(s[stack.len()] / sum, &cur[span], o);
    });
    out
}

impl Kda {
    /// This rank's part of the layer output for normed rows `h`, advancing
    /// each sequence's state (at `state_off` in its slot).
    /// `spans` are the sequences' rows and slots; where `snaps[i]` is set
    /// (at least `(rows - 1) * state_floats` floats), the layer also writes
    /// its part of the state after each of span `i`'s rows but the last
    /// there (the last one's is the slot's live state). A tree span's rows
    /// continue from their parent rows' states (`tree.rs`).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        h: &[f32],
        k3: &K3Config,
        eps: f32,
        ablation: Ablation,
        pool: &mut KvShard,
        spans: &[Span],
        state_off: usize,
        snaps: &mut [Option<Vec<f32>>],
        state_floats: usize,
    ) -> Result<Vec<f32>> {
        let (hd, heads, kernel) = (k3.kda_head_dim, self.heads, k3.conv_kernel);
        let c = heads * hd;
        let n = h.len() / self.f_a.in_features()?;
        let (mut q, mut k, mut v, mut gate) = (
            vec![0f32; n * c],
            vec![0f32; n * c],
            vec![0f32; n * c],
            vec![0f32; n * c],
        );
        let mut fa = vec![0f32; n * hd];
        let mut beta = vec![0f32; n * heads];
        // Every projection of the normed input in one pass over it.
        forward_many(
            &[&self.q, &self.k, &self.v, &self.g, &self.f_a, &self.beta],
            h,
            n,
            &mut [&mut q, &mut k, &mut v, &mut gate, &mut fa, &mut beta],
        )?;
        beta.iter_mut().for_each(|b| *b = sigmoid(*b));
        let mut g = self.f_b.apply(&fa)?;
        for row in g.chunks_exact_mut(c) {
            for (i, x) in row.iter_mut().enumerate() {
                let (a, f) = (self.a[i / hd], *x + self.dt_bias[i]);
                *x = match k3.gate_lower_bound {
                    Some(lb) if !ablation.no_gate_lower_bound => lb * sigmoid(a * f),
                    _ => -a * softplus(f),
                };
            }
        }
        let mut o = vec![0f32; n * c];
        let hist = (kernel - 1) * c;
        for (sp, snap) in spans.iter().zip(snaps.iter_mut()) {
            let span = &sp.rows;
            let st = pool.state_mut(sp.slot)?;
            let st = &mut st[state_off..state_off + 3 * hist + heads * hd * hd];
            let (convs, s) = st.split_at_mut(3 * hist);
            let (cq, rest) = convs.split_at_mut(hist);
            let (ck, cv) = rest.split_at_mut(hist);
            let rows = span.start * c..span.end * c;
            // States after rows 0..keep are kept for rollback; the last
            // row's is the slot's live state (see KvShard::take_row_buffer).
            let keep = span.len().saturating_sub(1);
            let (mut qs, mut ks, vs) = self.span_convs(
                sp,
                (&q[rows.clone()], &k[rows.clone()], &v[rows.clone()]),
                [cq, ck, cv],
                kernel,
                snap.as_deref_mut(),
                (state_floats, state_off),
            );
            qs.chunks_exact_mut(hd)
                .for_each(|x| kda::l2_normalize(x, eps));
            ks.chunks_exact_mut(hd)
                .for_each(|x| kda::l2_normalize(x, eps));
            let out = SharedMut::new(&mut o[rows]);
            let snap = snap.as_mut().map(|b| SharedMut::new(b));
            let sz = hd * hd;
            // Heads are independent: each owns its state, its output lanes
            // and its part of every kept row's state, written in place.
            // On the forward's thread team (see `team`), not rayon's pool.
            team::for_each_chunk(s, sz, |hh, s_h| {
                let mut scratch = Vec::new();
                let mut lane = vec![0f32; hd];
                for t in 0..span.len() {
                    if let (Some(from), Some(p)) = (sp.jump(t), &snap) {
                        // A tree row continues from its parent row's state,
                        // which this head recorded (parents come first).
                        let at = from * state_floats + state_off + 3 * hist + hh * sz;
                        // SAFETY: row `from < t` of head hh, written by this
                        // task above; no other task touches those floats.
                        unsafe { std::ptr::copy_nonoverlapping(p.at(at), s_h.as_mut_ptr(), sz) };
                    }
                    let at = t * c + hh * hd..t * c + (hh + 1) * hd;
                    kda::step(
                        s_h,
                        &qs[at.clone()],
                        &ks[at.clone()],
                        &vs[at.clone()],
                        &g[(span.start + t) * c + hh * hd..][..hd],
                        beta[(span.start + t) * heads + hh],
                        &mut lane,
                        &mut scratch,
                    );
                    // SAFETY: head hh writes only lanes `at` of the span's
                    // output rows and its own `sz` floats of each kept row's
                    // state; both buffers outlive the loop.
                    unsafe {
                        std::ptr::copy_nonoverlapping(lane.as_ptr(), out.at(at.start), hd);
                        if let (Some(p), true) = (&snap, t < keep) {
                            let to = t * state_floats + state_off + 3 * hist + hh * sz;
                            std::ptr::copy_nonoverlapping(s_h.as_ptr(), p.at(to), sz);
                        }
                    }
                }
            });
        }
        for (o_h, g_h) in o.chunks_exact_mut(hd).zip(gate.chunks_exact(hd)) {
            let normed = rms_norm(o_h, &self.o_norm, eps);
            for ((x, nv), gv) in o_h.iter_mut().zip(normed).zip(g_h) {
                *x = nv * sigmoid(*gv);
            }
        }
        self.o.apply(&o)
    }
}

impl GatedMla {
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        h: &[f32],
        d: MlaDims,
        eps: f32,
        ablation: Ablation,
        pool: &mut KvShard,
        layer: usize,
        rows: &Rows,
        tables: &[&[u32]],
        tree: Option<&TreeAttn>,
    ) -> Result<Vec<f32>> {
        let n = rows.tokens.len();
        let q = match &self.q {
            Query::Full(p) => p.apply(h)?,
            Query::LowRank { a, norm, b } => b.apply(&rms_norm(&a.apply(h)?, norm, eps))?,
        };
        let lw = d.kvr + d.rope;
        let mut lat = self.kv_a.apply(h)?;
        for r in 0..n {
            let row = &mut lat[r * lw..(r + 1) * lw];
            let normed = rms_norm(&row[..d.kvr], &self.kv_a_norm, eps);
            row[..d.kvr].copy_from_slice(&normed);
            // NoPE: the shared key part is cached as projected, unrotated,
            // so a tree row's position matters only through its slot.
            let slot = tree.map_or(rows.positions[r], |t| t.slot[r]);
            pool.write_latent(layer, tables[rows.seq[r]], slot, row);
        }
        let mut attn = vec![0f32; n * d.heads * d.v];
        attend_rows(
            d,
            &self.kv_b,
            pool,
            layer,
            rows,
            tables,
            &q,
            &mut attn,
            |_| false,
            tree,
        );
        if let (Some(gate), false) = (&self.gate, ablation.no_mla_gate) {
            let g = gate.apply(h)?;
            attn.iter_mut().zip(g).for_each(|(a, g)| *a *= sigmoid(g));
        }
        self.o.apply(&attn)
    }
}

impl LatentMoe {
    /// The whole MoE output (collectives included) for normed rows `x`.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &[f32],
        hidden: usize,
        moe: &MoeConfig,
        k3: &K3Config,
        eps: f32,
        exact: bool,
        comm: &dyn Communicator,
    ) -> Result<Vec<f32>> {
        let n = x.len() / hidden;
        let ne = moe.n_routed_experts;
        let logits = self.router.apply(x)?;
        let chosen: Vec<Vec<(usize, f32)>> = (0..n)
            .map(|r| route(&logits[r * ne..(r + 1) * ne], &self.bias, moe))
            .collect();
        let xl = match &self.down {
            Some(d) => d.apply(x)?,
            None => x.to_vec(),
        };
        let width = xl.len() / n;
        let mut yl = vec![0f32; n * width];
        // Each local expert's routed rows and their weights.
        let mut routed: Vec<(&Expert, Vec<(usize, f32)>)> = Vec::new();
        for (xi, mlp) in &self.experts {
            let picked: Vec<(usize, f32)> = chosen
                .iter()
                .enumerate()
                .filter_map(|(r, c)| c.iter().find(|p| p.0 == *xi).map(|&(_, w)| (r, w)))
                .collect();
            if !picked.is_empty() {
                routed.push((mlp, picked));
            }
        }
        let inputs: Vec<Vec<f32>> = routed
            .iter()
            .map(|(_, picked)| {
                picked
                    .iter()
                    .flat_map(|&(r, _)| &xl[r * width..(r + 1) * width])
                    .copied()
                    .collect()
            })
            .collect();
        let outputs = if exact {
            None
        } else {
            grouped_experts(&routed, &inputs, k3)
        };
        let outputs = match outputs {
            Some(o) => o,
            None => routed
                .iter()
                .zip(&inputs)
                .map(|((mlp, _), x)| mlp.forward(x, k3, exact))
                .collect::<Result<Vec<_>>>()?,
        };
        for ((_, picked), y) in routed.iter().zip(&outputs) {
            for (j, &(r, w)) in picked.iter().enumerate() {
                axpy(
                    w,
                    &y[j * width..(j + 1) * width],
                    &mut yl[r * width..(r + 1) * width],
                );
            }
        }
        let mut shared = match &self.shared {
            Some(s) => s.forward(x, k3)?,
            None => vec![0f32; n * hidden],
        };
        if self.up.is_none() && self.norm.is_none() {
            // Full-width experts: one collective for routed and shared.
            shared.iter_mut().zip(&yl).for_each(|(s, y)| *s += y);
            comm.all_reduce_sum(&mut shared)?;
            return Ok(shared);
        }
        if comm.world_size() > 1 {
            // One collective for both sums: between hosts a collective's
            // latency, not its bytes, dominates a decode step (92 fewer of
            // 280 per step at full size; BENCHMARKS.md, "Kimi K3 across
            // processes"). Element-wise sums: the same bits as two.
            let routed_len = yl.len();
            yl.extend_from_slice(&shared);
            comm.all_reduce_sum(&mut yl)?;
            shared.copy_from_slice(&yl[routed_len..]);
            yl.truncate(routed_len);
        }
        let normed = match &self.norm {
            Some(w) => rms_norm(&yl, w, eps),
            None => yl,
        };
        let mut y = match &self.up {
            Some(u) => u.apply(&normed)?,
            None => normed,
        };
        y.iter_mut().zip(&shared).for_each(|(y, s)| *y += s);
        Ok(y)
    }
}

/// The routed experts of one layer (`routed[i]` fed `inputs[i]`, its rows
/// one after another) as two grouped MXFP4 passes: gate and up of every
/// expert together (each expert's rows quantized once for both), then
/// every down. Each active expert's weights are read once for all its
/// rows, and all experts' output rows spread over the thread team. The
/// numbers are [`Expert::forward`]'s, bit for bit. `None` when an expert
/// is not MXFP4 (the caller runs them one by one).
fn grouped_experts(
    routed: &[(&Expert, Vec<(usize, f32)>)],
    inputs: &[Vec<f32>],
    k3: &K3Config,
) -> Option<Vec<Vec<f32>>> {
    let mats: Vec<[&Mxfp4Matrix; 3]> = routed
        .iter()
        .map(|(e, _)| Some([e.gate.as_mxfp4()?, e.up.as_mxfp4()?, e.down.as_mxfp4()?]))
        .collect::<Option<_>>()?;
    let acts: Vec<Q8Acts> = mats
        .iter()
        .zip(inputs)
        .map(|(m, x)| Q8Acts::new(x, x.len() / m[0].inp(), m[0].inp()))
        .collect();
    let mut gu: Vec<(Vec<f32>, Vec<f32>)> = mats
        .iter()
        .zip(&acts)
        .map(|(m, a)| {
            (
                vec![0f32; a.rows() * m[0].out()],
                vec![0f32; a.rows() * m[1].out()],
            )
        })
        .collect();
    let mut products = Vec::with_capacity(2 * mats.len());
    for ((m, a), (g, u)) in mats.iter().zip(&acts).zip(gu.iter_mut()) {
        products.push(Mxfp4Product {
            w: m[0],
            acts: a,
            out: g,
        });
        products.push(Mxfp4Product {
            w: m[1],
            acts: a,
            out: u,
        });
    }
    mxfp4::matmul_grouped(&mut products);
    // Every expert's activation on the team at once (one expert's few
    // rows are too little to split).
    let mut hidden_acts: Vec<Option<Q8Acts>> = (0..gu.len()).map(|_| None).collect();
    team::for_each_chunk(&mut hidden_acts, 1, |i, slot| {
        let ((g, u), m) = (&gu[i], &mats[i]);
        let mut a = vec![0f32; g.len()];
        situ_into(&mut a, g, u, k3);
        slot[0] = Some(Q8Acts::new(&a, a.len() / m[2].inp(), m[2].inp()));
    });
    let hidden_acts: Vec<Q8Acts> = hidden_acts.into_iter().flatten().collect();
    let mut outs: Vec<Vec<f32>> = mats
        .iter()
        .zip(&hidden_acts)
        .map(|(m, a)| vec![0f32; a.rows() * m[2].out()])
        .collect();
    let mut products: Vec<Mxfp4Product> = mats
        .iter()
        .zip(&hidden_acts)
        .zip(outs.iter_mut())
        .map(|((m, a), out)| Mxfp4Product {
            w: m[2],
            acts: a,
            out,
        })
        .collect();
    mxfp4::matmul_grouped(&mut products);
    Some(outs)
}

/// The family's forward over `ranks` (one per tensor-parallel rank): see
/// [`Model::forward`] for the contract.
pub(crate) fn forward(
    model: &Model,
    ranks: &[Weights],
    pool: &mut KvPool,
    seqs: &[SeqInput],
) -> Result<Tensor> {
    let rows = flatten(model, pool, seqs)?;
    forward_rows(model, ranks, pool, seqs, &rows, None)
}

/// The forward over `rows` (flattened from `seqs`); with `trees`, the rows
/// of a sequence with a tree write and attend the slots its
/// [`TreeAttn`] names and continue their parent rows' recurrent states
/// (`tree.rs`).
pub(crate) fn forward_rows(
    model: &Model,
    ranks: &[Weights],
    pool: &mut KvPool,
    seqs: &[SeqInput],
    rows: &Rows,
    trees: Option<Trees>,
) -> Result<Tensor> {
    let _one_step = (ranks.len() > 1).then(|| model.step.lock().unwrap_or_else(|e| e.into_inner()));
    run_ranks(ranks, pool.shards_mut(), |w, kv| {
        forward_rank(model, w, kv, rows, seqs, trees)
    })
}

fn forward_rank(
    model: &Model,
    w: &Weights,
    pool: &mut KvShard,
    rows: &Rows,
    seqs: &[SeqInput],
    trees: Option<Trees>,
) -> Result<Tensor> {
    let cfg = &model.cfg;
    let (k3, hidden) = (&w.k3, cfg.hidden_size);
    let eps = cfg.rms_norm_eps as f32;
    let mla = cfg.mla.as_ref().expect("validated K3 config has mla");
    let moe = cfg.moe.as_ref().expect("validated K3 config has moe");
    let tables: Vec<&[u32]> = seqs.iter().map(|s| s.block_table).collect();
    let spans = Span::of(seqs, trees);
    // A verification (every row's logits, several rows) keeps each row's
    // state, so a rejected draft can be rolled back by a copy.
    let mut snaps: Vec<Option<Vec<f32>>> = seqs
        .iter()
        .map(|s| {
            (s.logits == LogitsWanted::All && s.tokens.len() > 1)
                .then(|| pool.take_row_buffer(s.state_slot, s.tokens.len()))
        })
        .collect();
    for s in seqs.iter().filter(|s| s.start_pos == 0) {
        // A fresh (or recomputed) sequence starts from a zero state.
        pool.state_mut(s.state_slot)?.fill(0.0);
    }
    let res = k3.attn_res_block > 0 && !w.ablation.no_attn_res;
    let mut x = vec![0f32; rows.tokens.len() * hidden];
    for (&t, row) in rows.tokens.iter().zip(x.chunks_exact_mut(hidden)) {
        w.embed.row_f32(t as usize, row)?;
    }
    let mut stack: Vec<Vec<f32>> = Vec::new();
    for (li, layer) in w.layers.iter().enumerate() {
        let cur = match (&layer.attn_res, res) {
            (Some(score), true) => res_mix(&stack, &x, score, hidden, eps),
            _ => x.clone(),
        };
        let banked = res && li % k3.attn_res_block == 0;
        if banked {
            stack.push(x.clone());
        }
        let h = rms_norm(&cur, &layer.attn_norm, eps);
        let mut a = match &layer.mixer {
            Mixer::Kda(kda) => kda.forward(
                &h,
                k3,
                eps,
                w.ablation,
                pool,
                &spans,
                w.state_offsets[li].expect("KDA layer has a state"),
                &mut snaps,
                w.state_floats,
            )?,
            Mixer::Mla(m) => {
                let d = MlaDims {
                    heads: m.heads,
                    nope: mla.qk_nope_head_dim,
                    rope: mla.qk_rope_head_dim,
                    v: mla.v_head_dim,
                    kvr: mla.kv_lora_rank,
                    scale: 1.0 / ((mla.qk_nope_head_dim + mla.qk_rope_head_dim) as f32).sqrt(),
                };
                let tree = trees.map(|t| t.attn);
                m.forward(&h, d, eps, w.ablation, pool, li, rows, &tables, tree)?
            }
        };
        w.comm.all_reduce_sum(&mut a)?;
        if banked {
            // The block's running sum restarts from this attention output.
            x = a;
        } else {
            x.iter_mut().zip(&a).for_each(|(x, a)| *x += a);
        }
        let cur = match (&layer.ffn_res, res) {
            (Some(score), true) => res_mix(&stack, &x, score, hidden, eps),
            _ => x.clone(),
        };
        let h = rms_norm(&cur, &layer.ffn_norm, eps);
        let f = match &layer.ffn {
            Ffn::Dense(m) => {
                let mut f = m.forward(&h, k3)?;
                w.comm.all_reduce_sum(&mut f)?;
                f
            }
            Ffn::Moe(m) => m.forward(
                &h,
                hidden,
                moe,
                k3,
                eps,
                w.ablation.exact_experts,
                w.comm.as_ref(),
            )?,
        };
        x.iter_mut().zip(&f).for_each(|(x, f)| *x += f);
    }
    for (span, snap) in spans.iter().zip(snaps) {
        if let Some(snap) = snap {
            pool.set_row_states(span.slot, span.rows.len(), snap);
        }
    }
    if let (Some(score), true) = (&w.out_res, res) {
        x = res_mix(&stack, &x, score, hidden, eps);
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
mod cache_tests;
#[cfg(test)]
mod format_tests;
#[cfg(test)]
mod tests;
