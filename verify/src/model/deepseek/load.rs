//! The DeepSeek-V3 family's config.json keys (published DeepSeek-V3 and
//! Kimi K2 naming) and its safetensors loading: one tensor-parallel rank's
//! shard of the weights, cut at load time (see the parent module's docs for
//! what each rank holds).

use super::{yarn_mscale, Attention, DsLayer, Ffn, MlaPrefill, Mlp, Moe, Query, Rope, Weights};
use crate::error::{Result, VerifyError};
use crate::kv_pool::CacheDtype;
use crate::model::config::{Arch, MlaConfig, ModelConfig, MoeConfig, RopeStyle, YarnConfig};
use crate::model::dense::Dense;
use crate::model::linear::Linear;
use crate::model::loader::{json_usize, SafetensorsWeights};
use crate::model::shard::{balanced, even_split};
use crate::model::stored::from_safetensors;
use crate::model::{Body, Model};
use crate::tp::Communicator;
use serde_json::Value;

/// Family-specific checks of [`ModelConfig::validate`].
pub(crate) fn validate(cfg: &ModelConfig) -> Result<()> {
    let bad = |m: String| Err(VerifyError::BadConfig(m));
    let Some(m) = &cfg.mla else {
        return bad("the DeepSeek-V3 family needs its latent attention shape".into());
    };
    if [m.kv_lora_rank, m.qk_rope_head_dim, m.v_head_dim].contains(&0) || m.q_lora_rank == Some(0) {
        return bad(format!("zero-sized latent attention dimension in {m:?}"));
    }
    if !m.qk_rope_head_dim.is_multiple_of(2) {
        return bad(format!("qk_rope_head_dim {} is odd", m.qk_rope_head_dim));
    }
    if cfg.head_dim != m.qk_nope_head_dim + m.qk_rope_head_dim {
        return bad("head_dim must be qk_nope_head_dim + qk_rope_head_dim".into());
    }
    if let Some(e) = &cfg.moe {
        if e.n_group == 0 || !e.n_routed_experts.is_multiple_of(e.n_group) {
            return bad(format!(
                "{} routed experts do not split into {} groups",
                e.n_routed_experts, e.n_group
            ));
        }
        let per_group = e.n_routed_experts / e.n_group;
        if per_group < 2 {
            return bad("expert groups need at least 2 experts (scored by their top 2)".into());
        }
        if e.topk_group == 0 || e.topk_group > e.n_group {
            return bad(format!(
                "topk_group {} outside 1..={}",
                e.topk_group, e.n_group
            ));
        }
        if e.num_experts_per_tok == 0 || e.num_experts_per_tok > e.topk_group * per_group {
            return bad(format!(
                "num_experts_per_tok {} outside 1..={}",
                e.num_experts_per_tok,
                e.topk_group * per_group
            ));
        }
        if e.moe_intermediate_size == 0 {
            return bad("moe_intermediate_size is 0".into());
        }
    }
    if let Some(y) = &cfg.yarn {
        if y.factor.is_nan() || y.factor <= 0.0 || y.original_max_position == 0 {
            return bad(format!("bad YaRN scaling {y:?}"));
        }
    }
    Ok(())
}

fn json_f64(v: &Value, key: &str, default: f64) -> Result<f64> {
    match v.get(key) {
        None => Ok(default),
        Some(x) => x
            .as_f64()
            .ok_or_else(|| VerifyError::MissingMetadata(format!("config.json: {key}"))),
    }
}

fn json_usize_or(v: &Value, key: &str, default: usize) -> Result<usize> {
    match v.get(key) {
        None => Ok(default),
        Some(_) => json_usize(v, key),
    }
}

/// Parses a DeepSeek-V3 / Kimi K2 config.json (published key names; keys a
/// published config may omit take transformers' `DeepseekV3Config` defaults).
///
/// Errors: a missing required key, a softmax-scored router (DeepSeek-V2) or
/// a RoPE scaling other than YaRN, or an inconsistent shape.
pub(crate) fn config_from_hf_json(v: &Value) -> Result<ModelConfig> {
    let bad = |m: String| VerifyError::BadConfig(m);
    if let Some(f) = v.get("scoring_func").and_then(Value::as_str) {
        if f != "sigmoid" {
            return Err(bad(format!(
                "router scoring_func '{f}' (supported: sigmoid)"
            )));
        }
    }
    if let Some(m) = v.get("topk_method").and_then(Value::as_str) {
        if m != "noaux_tc" {
            return Err(bad(format!(
                "router topk_method '{m}' (supported: noaux_tc)"
            )));
        }
    }
    let q_lora_rank = match v.get("q_lora_rank") {
        None | Some(Value::Null) => None,
        Some(_) => Some(json_usize(v, "q_lora_rank")?),
    };
    let mla = MlaConfig {
        q_lora_rank,
        kv_lora_rank: json_usize(v, "kv_lora_rank")?,
        qk_nope_head_dim: json_usize(v, "qk_nope_head_dim")?,
        qk_rope_head_dim: json_usize(v, "qk_rope_head_dim")?,
        v_head_dim: json_usize(v, "v_head_dim")?,
    };
    let num_layers = json_usize(v, "num_hidden_layers")?;
    let moe = match v.get("n_routed_experts") {
        None | Some(Value::Null) => None,
        Some(_) => Some(Box::new(MoeConfig {
            n_routed_experts: json_usize(v, "n_routed_experts")?,
            num_experts_per_tok: json_usize(v, "num_experts_per_tok")?,
            moe_intermediate_size: json_usize(v, "moe_intermediate_size")?,
            n_shared_experts: json_usize_or(v, "n_shared_experts", 1)?,
            n_group: json_usize_or(v, "n_group", 8)?,
            topk_group: json_usize_or(v, "topk_group", 4)?,
            norm_topk_prob: v
                .get("norm_topk_prob")
                .map(|b| b.as_bool().unwrap_or(false))
                .unwrap_or(true),
            routed_scaling_factor: json_f64(v, "routed_scaling_factor", 2.5)? as f32,
            first_k_dense_replace: json_usize_or(v, "first_k_dense_replace", 3)?.min(num_layers),
        })),
    };
    // Published configs carry `rope_scaling` + top-level `rope_theta`;
    // transformers 5 writes `rope_parameters` holding both.
    let params = v
        .get("rope_parameters")
        .filter(|p| !p.is_null())
        .or_else(|| v.get("rope_scaling").filter(|p| !p.is_null()));
    let rope_theta = match params.and_then(|p| p.get("rope_theta")) {
        Some(t) => t.as_f64(),
        None => Some(json_f64(v, "rope_theta", 10_000.0)?),
    }
    .ok_or_else(|| VerifyError::MissingMetadata("config.json: rope_theta".into()))?;
    let max_position = json_usize(v, "max_position_embeddings")?;
    let yarn = match params {
        None => None,
        Some(p) => {
            let kind = p
                .get("rope_type")
                .or_else(|| p.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            match kind {
                "default" => None,
                "yarn" => {
                    let orig = match p.get("original_max_position_embeddings") {
                        Some(_) => json_usize(p, "original_max_position_embeddings")?,
                        None => json_usize_or(v, "original_max_position_embeddings", max_position)?,
                    };
                    let factor = match p.get("factor") {
                        Some(_) => json_f64(p, "factor", 1.0)?,
                        None => max_position as f64 / orig as f64,
                    };
                    // transformers: `get("beta_fast") or 32` (0 means default).
                    let or = |x: f64, d: f64| if x == 0.0 { d } else { x };
                    Some(Box::new(YarnConfig {
                        factor,
                        original_max_position: orig,
                        beta_fast: or(json_f64(p, "beta_fast", 0.0)?, 32.0),
                        beta_slow: or(json_f64(p, "beta_slow", 0.0)?, 1.0),
                        mscale: json_f64(p, "mscale", 0.0)?,
                        mscale_all_dim: json_f64(p, "mscale_all_dim", 0.0)?,
                        attention_factor: p.get("attention_factor").and_then(Value::as_f64),
                    }))
                }
                other => {
                    return Err(bad(format!(
                        "RoPE scaling '{other}' (supported for DeepSeek-V3: yarn)"
                    )))
                }
            }
        }
    };
    let num_heads = json_usize(v, "num_attention_heads")?;
    let interleave = v
        .get("rope_interleave")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let cfg = ModelConfig {
        arch: Arch::DeepseekV3,
        vocab_size: json_usize(v, "vocab_size")?,
        hidden_size: json_usize(v, "hidden_size")?,
        intermediate_size: json_usize(v, "intermediate_size")?,
        num_layers,
        num_heads,
        num_kv_heads: num_heads,
        head_dim: mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        rms_norm_eps: json_f64(v, "rms_norm_eps", 1e-6)?,
        rope_theta: rope_theta as f32,
        // DeepSeek's checkpoints pair RoPE dims (2i, 2i+1); transformers
        // de-interleaves them before its rotate_half, the same rotation.
        rope_style: if interleave {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Neox
        },
        max_position,
        mla: Some(Box::new(mla)),
        moe,
        yarn,
    };
    if v.get("tie_word_embeddings").and_then(Value::as_bool) == Some(true) {
        return Err(bad("tied embeddings in a DeepSeek-V3 config".into()));
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Reads f32 weights (whole, or one rank's rows or columns) out of the
/// memory-mapped files: only the bytes asked for are touched.
struct Tensors<'a> {
    st: &'a SafetensorsWeights,
}

impl Tensors<'_> {
    fn take(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Ok(self
            .st
            .tensor(name, shape)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// Rows `r` and columns `c` of the `[out, inp]` matrix `name`, kept
    /// in the file's format (only those rows' bytes are copied out of the
    /// mapping).
    fn part(
        &self,
        name: &str,
        (out, inp): (usize, usize),
        r: std::ops::Range<usize>,
        c: std::ops::Range<usize>,
    ) -> Result<Linear> {
        let n = r.len();
        from_safetensors(self.st, &format!("{name}.weight"), (out, inp), r)?
            .select(0..n, c)?
            .into_linear()
    }

    /// Rows `r` of the `[out, inp]` matrix `name`.
    fn rows(
        &self,
        name: &str,
        out: usize,
        inp: usize,
        r: std::ops::Range<usize>,
    ) -> Result<Linear> {
        self.part(name, (out, inp), r, 0..inp)
    }

    /// Columns `c` of the `[out, inp]` matrix `name`.
    fn cols(
        &self,
        name: &str,
        out: usize,
        inp: usize,
        c: std::ops::Range<usize>,
    ) -> Result<Linear> {
        self.part(name, (out, inp), 0..out, c)
    }

    /// Rows `r` of the `[out, inp]` matrix `name` in f32 (the latent
    /// `kv_b`, which the absorbed attention reads row by row).
    fn dense_rows(
        &self,
        name: &str,
        out: usize,
        inp: usize,
        r: std::ops::Range<usize>,
    ) -> Result<Dense> {
        let name = format!("{name}.weight");
        let w = self.st.rows(&name, (out, inp), r.clone())?;
        Ok(Dense::new(w.flatten_all()?.to_vec1::<f32>()?, r.len(), inp))
    }

    /// Column-parallel gate/up, row-parallel down, over `f` of `ff`.
    fn mlp(&self, p: &str, h: usize, ff: usize, f: std::ops::Range<usize>) -> Result<Mlp> {
        Ok(Mlp {
            gate: self.rows(&format!("{p}.gate_proj"), ff, h, f.clone())?,
            up: self.rows(&format!("{p}.up_proj"), ff, h, f.clone())?,
            down: self.cols(&format!("{p}.down_proj"), h, ff, f)?,
        })
    }
}

/// Loads a model whose ranks are `comms` (one `Communicator` per rank
/// this model runs, in rank order: the whole group of a model sharded in
/// one process, or a single rank of a group its caller drives). Every rank
/// reads its own shard out of the one mapping of `weights`.
pub(crate) fn load(
    weights: &SafetensorsWeights,
    cfg: ModelConfig,
    comms: Vec<Box<dyn Communicator>>,
) -> Result<Model> {
    let ranks = comms
        .into_iter()
        .map(|c| load_rank(weights, &cfg, c))
        .collect::<Result<Vec<_>>>()?;
    // Values are stored at the checkpoint's width (the head's stands for
    // every matrix: the family's checkpoints use one float type).
    let head = &ranks[0].lm_head;
    let per_value = head.weight_bytes() / (head.out_features()? * head.in_features()?).max(1);
    let weight_bytes = decode_weight_values(&cfg) * per_value.max(1);
    Ok(Model {
        cfg,
        body: Body::Deepseek(ranks),
        weight_bytes,
        // No restricted head for this family (`Model::restrict_head`).
        head_tokens: None,
        lm_bytes: 0,
        step: std::sync::Mutex::new(()),
        leader: None,
        latent_cache: CacheDtype::F32,
    })
}

/// Loads `comm`'s rank's shard (see the module docs) from `weights`.
fn load_rank(
    weights: &SafetensorsWeights,
    cfg: &ModelConfig,
    comm: Box<dyn Communicator>,
) -> Result<Weights> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mla = cfg.mla.clone().expect("validated DeepSeek config has mla");
    let t = Tensors { st: weights };
    let (h, nh) = (cfg.hidden_size, cfg.num_heads);
    let (nope, rope, vd, kvr) = (
        mla.qk_nope_head_dim,
        mla.qk_rope_head_dim,
        mla.v_head_dim,
        mla.kv_lora_rank,
    );
    let qk = nope + rope;
    let heads = even_split("attention heads (num_attention_heads)", nh, world, rank)?;
    let local_heads = heads.len();
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        let q = match mla.q_lora_rank {
            None => Query::Full(t.rows(
                &format!("{a}.q_proj"),
                nh * qk,
                h,
                heads.start * qk..heads.end * qk,
            )?),
            Some(r) => Query::LowRank {
                a: t.rows(&format!("{a}.q_a_proj"), r, h, 0..r)?,
                norm: t.take(&format!("{a}.q_a_layernorm.weight"), &[r])?,
                b: t.rows(
                    &format!("{a}.q_b_proj"),
                    nh * qk,
                    r,
                    heads.start * qk..heads.end * qk,
                )?,
            },
        };
        let attn = Attention {
            q,
            kv_a: t.rows(
                &format!("{a}.kv_a_proj_with_mqa"),
                kvr + rope,
                h,
                0..kvr + rope,
            )?,
            kv_a_norm: t.take(&format!("{a}.kv_a_layernorm.weight"), &[kvr])?,
            kv_b: t.dense_rows(
                &format!("{a}.kv_b_proj"),
                nh * (nope + vd),
                kvr,
                heads.start * (nope + vd)..heads.end * (nope + vd),
            )?,
            o: t.cols(
                &format!("{a}.o_proj"),
                h,
                nh * vd,
                heads.start * vd..heads.end * vd,
            )?,
        };
        let m = format!("{p}.mlp");
        let ffn = match &cfg.moe {
            Some(e) if i >= e.first_k_dense_replace => {
                let ne = e.n_routed_experts;
                let ff = e.moe_intermediate_size;
                let mut experts = Vec::new();
                for x in 0..ne {
                    if x % world == rank {
                        experts.push((x, t.mlp(&format!("{m}.experts.{x}"), h, ff, 0..ff)?));
                    } else {
                        // Another rank's expert: its header must be right
                        // (a broken file fails on every rank alike), its
                        // data is never read here.
                        for (w, shape) in [
                            ("gate_proj", [ff, h]),
                            ("up_proj", [ff, h]),
                            ("down_proj", [h, ff]),
                        ] {
                            t.st.check(&format!("{m}.experts.{x}.{w}.weight"), &shape)?;
                        }
                    }
                }
                let shared = if e.n_shared_experts == 0 {
                    None
                } else {
                    let sff = ff * e.n_shared_experts;
                    let f = even_split(
                        "shared experts (moe_intermediate_size * n_shared_experts)",
                        sff,
                        world,
                        rank,
                    )?;
                    Some(t.mlp(&format!("{m}.shared_experts"), h, sff, f)?)
                };
                Ffn::Moe(Moe {
                    router: t.rows(&format!("{m}.gate"), ne, h, 0..ne)?,
                    bias: t.take(&format!("{m}.gate.e_score_correction_bias"), &[ne])?,
                    experts,
                    shared,
                })
            }
            _ => {
                let ff = cfg.intermediate_size;
                let f = even_split("dense MLP (intermediate_size)", ff, world, rank)?;
                Ffn::Dense(t.mlp(&m, h, ff, f)?)
            }
        };
        layers.push(DsLayer {
            attn_norm: t.take(&format!("{p}.input_layernorm.weight"), &[h])?,
            attn,
            ffn_norm: t.take(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            ffn,
        });
    }
    let vocab = cfg.vocab_size;
    let vrange = balanced(vocab, world)[rank].clone();
    Ok(Weights {
        embed: t.take("model.embed_tokens.weight", &[vocab, h])?,
        layers,
        norm: t.take("model.norm.weight", &[h])?,
        lm_head: t.rows("lm_head", vocab, h, vrange)?,
        rope: Rope::new(cfg, rope),
        softmax_scale: softmax_scale(cfg),
        local_heads,
        prefill: MlaPrefill::default(),
        comm,
    })
}

/// `qk_head_dim^-0.5`, times `mscale(factor, mscale_all_dim)^2` under YaRN.
fn softmax_scale(cfg: &ModelConfig) -> f32 {
    let mut s = 1.0 / (cfg.head_dim as f64).sqrt();
    if let Some(y) = &cfg.yarn {
        if y.mscale_all_dim != 0.0 {
            let m = yarn_mscale(y.factor, y.mscale_all_dim);
            s *= m * m;
        }
    }
    s as f32
}

/// Weights one decode step reads, whole model: every
/// attention and dense matrix, the shared and `num_experts_per_tok` routed
/// experts per MoE layer, the router, the head and one embedding row:
/// their number of values.
fn decode_weight_values(cfg: &ModelConfig) -> usize {
    let m = cfg.mla.as_ref().expect("validated");
    let (h, nh) = (cfg.hidden_size, cfg.num_heads);
    let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
    let q = match m.q_lora_rank {
        None => nh * qk * h,
        Some(r) => r * h + r + nh * qk * r,
    };
    let attn = q
        + (m.kv_lora_rank + m.qk_rope_head_dim) * h
        + m.kv_lora_rank
        + nh * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
        + h * nh * m.v_head_dim
        + 2 * h;
    let ffn: usize = (0..cfg.num_layers)
        .map(|i| match &cfg.moe {
            Some(e) if i >= e.first_k_dense_replace => {
                3 * h * e.moe_intermediate_size * (e.num_experts_per_tok + e.n_shared_experts)
                    + e.n_routed_experts * (h + 1)
            }
            _ => 3 * h * cfg.intermediate_size,
        })
        .sum();
    cfg.num_layers * attn + ffn + cfg.vocab_size * h + 2 * h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kimi_k2_json() -> Value {
        serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "kimi_k2",
            "vocab_size": 163840,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "n_shared_experts": 1,
            "n_routed_experts": 384,
            "routed_scaling_factor": 2.827,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "qk_nope_head_dim": 128,
            "topk_method": "noaux_tc",
            "n_group": 1,
            "topk_group": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 1,
            "norm_topk_prob": true,
            "scoring_func": "sigmoid",
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "rope_theta": 50000.0,
            "rope_scaling": {
                "beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"
            },
            "tie_word_embeddings": false
        })
    }

    #[test]
    fn kimi_k2_config_parses_and_caches_576_floats_per_layer() {
        let cfg = config_from_hf_json(&kimi_k2_json()).unwrap();
        assert_eq!(cfg.arch, Arch::DeepseekV3);
        assert_eq!(cfg.rope_style, RopeStyle::Interleaved);
        let e = cfg.moe.as_ref().unwrap();
        assert_eq!(
            (e.n_routed_experts, e.n_group, e.first_k_dense_replace),
            (384, 1, 1)
        );
        assert_eq!(cfg.yarn.as_ref().unwrap().factor, 32.0);
        assert_eq!(cfg.kv_bytes_per_token(), 61 * (512 + 64) * 4);
        // The attention-scale correction: mscale(32, 1)^2 / sqrt(192).
        let m = 0.1 * 32f64.ln() + 1.0;
        assert!((softmax_scale(&cfg) as f64 - m * m / 192f64.sqrt()).abs() < 1e-6);
    }

    #[test]
    fn unsupported_router_and_scaling_are_errors() {
        let mut v = kimi_k2_json();
        v["scoring_func"] = "softmax".into();
        assert!(config_from_hf_json(&v).is_err());
        let mut v = kimi_k2_json();
        v["rope_scaling"]["type"] = "dynamic".into();
        assert!(config_from_hf_json(&v).is_err());
        let mut v = kimi_k2_json();
        v["n_group"] = 384.into(); // groups of one expert
        assert!(config_from_hf_json(&v).is_err());
    }

    #[test]
    fn uneven_split_names_the_tensor_and_working_world_sizes() {
        let e = even_split("attention heads", 6, 4, 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("attention heads") && e.contains("[1, 2, 3, 6]"),
            "{e}"
        );
        assert_eq!(even_split("x", 8, 4, 3).unwrap(), 6..8);
    }
}
