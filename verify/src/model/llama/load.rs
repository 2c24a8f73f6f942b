//! The llama family's loading (llama, qwen2): its GGUF tensor and metadata
//! names, its config.json keys and Hugging Face tensor names, and the cut of
//! each layer into the ranks' shards by the core [`ShardPlan`]. The loaders
//! read a matrix whole and cut it at once into the ranks' shards, so at most
//! one unsharded matrix is in memory extra. The core loader (`loader.rs`)
//! reads the files and dispatches here.

use super::{from_rank_parts, Layer, RankParts};
use crate::error::{Result, VerifyError};
use crate::model::config::{Arch, ModelConfig, RopeStyle};
use crate::model::linear::{Embedding, Linear};
use crate::model::loader::{json_usize, GgufReader, SafetensorsWeights};
use crate::model::shard::{slice_bias, Matrix, ShardPlan, SplitLimits};
use crate::model::Model;
use candle_core::Tensor;
use std::ops::Range;

/// Loads a llama or qwen2 GGUF file (`r`, of architecture `arch`) sharded
/// over `world` ranks; matrices stay in their quantized format and are cut
/// along whole quantization blocks. See [`crate::model::load_gguf_tp`].
pub(crate) fn load_gguf(r: &mut GgufReader, arch: Arch, world: usize) -> Result<Model> {
    let hidden_size = r.meta_usize("embedding_length")?;
    let num_heads = r.meta_usize("attention.head_count")?;
    let num_kv_heads = r.meta_usize("attention.head_count_kv")?;
    let head_dim = r
        .meta_usize("attention.key_length")
        .unwrap_or(hidden_size / num_heads.max(1));
    if !r.has("token_embd.weight") {
        return Err(VerifyError::MissingTensor("token_embd.weight".into()));
    }
    let vocab_size = r.content.tensor_infos["token_embd.weight"].shape.dims()[0];
    let cfg = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size: r.meta_usize("feed_forward_length")?,
        num_layers: r.meta_usize("block_count")?,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps: r.meta_f32("attention.layer_norm_rms_epsilon")? as f64,
        rope_theta: r.meta_f32("rope.freq_base").unwrap_or(10_000.0),
        // llama.cpp permutes llama's q/k rows to interleaved pairs at conversion.
        rope_style: if arch == Arch::Llama {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Neox
        },
        max_position: r.meta_usize("context_length")?,
        mla: None,
        moe: None,
        yarn: None,
    };
    cfg.validate()?;
    let bias = arch == Arch::Qwen2;
    let head_name = if r.has("output.weight") {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    let limits = SplitLimits {
        attn_out: r.widest_block(cfg.num_layers, "attn_output.weight")?,
        ffn_down: r.widest_block(cfg.num_layers, "ffn_down.weight")?,
        kv_tensor: "blk.0.attn_k.weight".into(),
        vocab_tensor: head_name.into(),
    };
    let plan = ShardPlan::new(&cfg, &limits, world)?;

    let embed_q = r.qtensor("token_embd.weight")?;
    let mut weight_bytes = embed_q.storage_size_in_bytes() / vocab_size;
    let mut ranks: Vec<Vec<_>> = (0..world).map(|_| Vec::new()).collect();
    for i in 0..cfg.num_layers {
        let p = format!("blk.{i}");
        let full = FullLayer {
            attn_norm: r.dense(&format!("{p}.attn_norm.weight"))?,
            q: r.with_bias(&format!("{p}.attn_q"), bias)?,
            k: r.with_bias(&format!("{p}.attn_k"), bias)?,
            v: r.with_bias(&format!("{p}.attn_v"), bias)?,
            o: r.matrix(&format!("{p}.attn_output"))?,
            ffn_norm: r.dense(&format!("{p}.ffn_norm.weight"))?,
            gate: r.matrix(&format!("{p}.ffn_gate"))?,
            up: r.matrix(&format!("{p}.ffn_up"))?,
            down: r.matrix(&format!("{p}.ffn_down"))?,
            prefix: p,
        };
        weight_bytes += full.bytes();
        for (rank, layer) in full.split(&plan, cfg.head_dim)?.into_iter().enumerate() {
            ranks[rank].push(layer);
        }
    }
    let norm = r.dense("output_norm.weight")?;
    let head = if head_name == "output.weight" {
        r.matrix("output")?
    } else {
        Matrix::Quant(embed_q.clone())
    };
    weight_bytes += head.bytes();
    let parts = rank_parts(&plan, Embedding::Quantized(embed_q), ranks, norm, &head)?;
    from_rank_parts(cfg, parts, weight_bytes, head.bytes())
}

/// Parses a Hugging Face config.json of a llama or qwen2 model (`arch`,
/// from its `model_type`).
pub(crate) fn config_from_hf_json(cfg: &serde_json::Value, arch: Arch) -> Result<ModelConfig> {
    let hidden_size = json_usize(cfg, "hidden_size")?;
    let num_heads = json_usize(cfg, "num_attention_heads")?;
    let config = ModelConfig {
        arch,
        vocab_size: json_usize(cfg, "vocab_size")?,
        hidden_size,
        intermediate_size: json_usize(cfg, "intermediate_size")?,
        num_layers: json_usize(cfg, "num_hidden_layers")?,
        num_heads,
        num_kv_heads: json_usize(cfg, "num_key_value_heads").unwrap_or(num_heads),
        head_dim: json_usize(cfg, "head_dim").unwrap_or(hidden_size / num_heads.max(1)),
        rms_norm_eps: cfg
            .get("rms_norm_eps")
            .and_then(|v| v.as_f64())
            .unwrap_or(1e-6),
        rope_theta: cfg
            .get("rope_theta")
            .and_then(|v| v.as_f64())
            .unwrap_or(10_000.0) as f32,
        rope_style: RopeStyle::Neox,
        max_position: json_usize(cfg, "max_position_embeddings")?,
        mla: None,
        moe: None,
        yarn: None,
    };
    config.validate()?;
    Ok(config)
}

/// Loads a llama or qwen2 safetensors directory (its config.json `json`,
/// parsed `cfg` and mapped `weights`) sharded over `world` ranks; weights
/// become dense f32. See [`crate::model::load_safetensors_tp`].
pub(crate) fn load_safetensors(
    json: &serde_json::Value,
    weights: &SafetensorsWeights,
    cfg: ModelConfig,
    world: usize,
) -> Result<Model> {
    let tied = json
        .get("tie_word_embeddings")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let head_name = if tied {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    // Dense rows cut anywhere: only head and vocabulary counts limit a split.
    let limits = SplitLimits {
        attn_out: (1, "model.layers.0.self_attn.o_proj.weight".into()),
        ffn_down: (1, "model.layers.0.mlp.down_proj.weight".into()),
        kv_tensor: "model.layers.0.self_attn.k_proj.weight".into(),
        vocab_tensor: head_name.into(),
    };
    let plan = ShardPlan::new(&cfg, &limits, world)?;
    // One matrix at a time out of the mapping, cut into the ranks' shards
    // right away (FullLayer::split): the file is never in memory whole.
    let mut take = |name: &str, shape: &[usize]| weights.tensor(name, shape);
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let (qd, kvd, ff) = (
        cfg.num_heads * hd,
        cfg.num_kv_heads * hd,
        cfg.intermediate_size,
    );
    let bias = cfg.arch == Arch::Qwen2;
    let lin = |take: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
               name: &str,
               out: usize,
               inp: usize,
               with_bias: bool|
     -> Result<(Matrix, Option<Tensor>)> {
        let w = take(&format!("{name}.weight"), &[out, inp])?;
        let b = if with_bias {
            Some(take(&format!("{name}.bias"), &[out])?)
        } else {
            None
        };
        Ok((Matrix::Dense(w), b))
    };
    let embed = take("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
    let mut weight_bytes = h * 4;
    let mut ranks: Vec<Vec<_>> = (0..world).map(|_| Vec::new()).collect();
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let full = FullLayer {
            attn_norm: take(&format!("{p}.input_layernorm.weight"), &[h])?,
            q: lin(&mut take, &format!("{p}.self_attn.q_proj"), qd, h, bias)?,
            k: lin(&mut take, &format!("{p}.self_attn.k_proj"), kvd, h, bias)?,
            v: lin(&mut take, &format!("{p}.self_attn.v_proj"), kvd, h, bias)?,
            o: lin(&mut take, &format!("{p}.self_attn.o_proj"), h, qd, false)?.0,
            ffn_norm: take(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            gate: lin(&mut take, &format!("{p}.mlp.gate_proj"), ff, h, false)?.0,
            up: lin(&mut take, &format!("{p}.mlp.up_proj"), ff, h, false)?.0,
            down: lin(&mut take, &format!("{p}.mlp.down_proj"), h, ff, false)?.0,
            prefix: p,
        };
        weight_bytes += full.bytes();
        for (rank, layer) in full.split(&plan, hd)?.into_iter().enumerate() {
            ranks[rank].push(layer);
        }
    }
    let norm = take("model.norm.weight", &[h])?;
    let head = if tied {
        Matrix::Dense(embed.clone())
    } else {
        lin(&mut take, "lm_head", cfg.vocab_size, h, false)?.0
    };
    weight_bytes += head.bytes();
    let parts = rank_parts(&plan, Embedding::Dense(embed), ranks, norm, &head)?;
    from_rank_parts(cfg, parts, weight_bytes, head.bytes())
}

/// A column-parallel input: weight plus optional bias (both cut by rows).
pub(crate) type WithBias = (Matrix, Option<Tensor>);

/// One transformer block's unsharded weights as read from the file.
pub(crate) struct FullLayer {
    /// Tensor-name prefix of the layer (for errors), e.g. `blk.3`.
    pub(crate) prefix: String,
    pub(crate) attn_norm: Tensor,
    pub(crate) q: WithBias,
    pub(crate) k: WithBias,
    pub(crate) v: WithBias,
    pub(crate) o: Matrix,
    pub(crate) ffn_norm: Tensor,
    pub(crate) gate: Matrix,
    pub(crate) up: Matrix,
    pub(crate) down: Matrix,
}

impl FullLayer {
    /// Bytes of the layer's matrices.
    pub(crate) fn bytes(&self) -> usize {
        [
            &self.q.0, &self.k.0, &self.v.0, &self.o, &self.gate, &self.up, &self.down,
        ]
        .iter()
        .map(|m| m.bytes())
        .sum()
    }

    /// Cuts the layer into one [`Layer`] per rank of `plan`. At world size 1
    /// the one layer shares the loaded storage.
    pub(crate) fn split(self, plan: &ShardPlan, head_dim: usize) -> Result<Vec<Layer>> {
        let col = |(w, b): &WithBias, r: Range<usize>| -> Result<Linear> {
            let bias = b.as_ref().map(|b| slice_bias(b, r.clone())).transpose()?;
            Linear::new(w.rows(r)?.into_qmatmul()?, bias)
        };
        let hd = |r: &Range<usize>| r.start * head_dim..r.end * head_dim;
        let mut out = Vec::with_capacity(plan.world());
        for r in 0..plan.world() {
            let (heads, kv, ff) = (hd(&plan.heads[r]), hd(&plan.kv_heads[r]), &plan.ff[r]);
            let o_name = format!("{}.attn_output.weight", self.prefix);
            let down_name = format!("{}.ffn_down.weight", self.prefix);
            out.push(Layer {
                attn_norm: self.attn_norm.flatten_all()?.to_vec1()?,
                q: col(&self.q, heads.clone())?,
                k: col(&self.k, kv.clone())?,
                v: col(&self.v, kv)?,
                // Row-parallel: the all-reduce sums the ranks' partial
                // outputs (llama-family o/down carry no bias to add once).
                o: Linear::new(self.o.cols(heads, &o_name)?.into_qmatmul()?, None)?,
                ffn_norm: self.ffn_norm.flatten_all()?.to_vec1()?,
                gate: Linear::new(self.gate.rows(ff.clone())?.into_qmatmul()?, None)?,
                up: Linear::new(self.up.rows(ff.clone())?.into_qmatmul()?, None)?,
                down: Linear::new(
                    self.down.cols(ff.clone(), &down_name)?.into_qmatmul()?,
                    None,
                )?,
            });
        }
        Ok(out)
    }
}

/// Per-rank parts of a whole model: `layers[r]` are rank r's layers, the
/// output head is cut into `plan`'s vocabulary rows, embedding and final
/// norm are shared.
pub(crate) fn rank_parts(
    plan: &ShardPlan,
    embed: Embedding,
    layers: Vec<Vec<Layer>>,
    norm: Tensor,
    head: &Matrix,
) -> Result<Vec<RankParts>> {
    layers
        .into_iter()
        .enumerate()
        .map(|(r, layers)| {
            Ok(RankParts {
                embed: embed.clone(),
                layers,
                norm: norm.clone(),
                lm_head: Linear::new(head.rows(plan.vocab[r].clone())?.into_qmatmul()?, None)?,
                vocab: plan.vocab[r].clone(),
                num_kv_heads: plan.kv_heads[r].len(),
            })
        })
        .collect()
}
