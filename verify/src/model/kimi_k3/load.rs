//! Loading Kimi K3: its config from a Hugging Face `config.json` (text
//! model under `text_config`) or from llama.cpp `kimi-k3` GGUF metadata,
//! and one rank's shard of its weights from either source.
//!
//! Both sources are read through [`Source`], in the Hugging Face layout
//! (`[out, in]` row-major). Matrices come out as [`Stored`] weights in the
//! file's own format, sliced to the rank's rows, columns or experts
//! without decoding (GGUF: views of the file's mapping; experts are views
//! into the stacked tensors), and become [`Linear`]s on the kernel for
//! that format. Vectors (norms, biases, conv taps) and the small latent
//! `kv_b` of the MLA layers are decoded to f32. The GGUF side undoes
//! llama.cpp's conversions (`ssm_a = -exp(A_log)`, `kv_b` split into `k_b`
//! transposed and `v_b`, experts stacked, attention residual norm and
//! projection fused into one score vector); the HF side fuses the residual
//! pair the same way and keeps MXFP4 experts packed.

use super::{
    Ablation, Expert, Ffn, GatedMla, K3Config, K3Layer, Kda, LatentMoe, Mixer, Query, SituMlp,
    Weights,
};
use crate::error::{Result, VerifyError};
use crate::gguf::Gguf;
use crate::kernels::mxfp4::Mxfp4Matrix;
use crate::model::config::{Arch, MlaConfig, ModelConfig, MoeConfig, RopeStyle};
use crate::model::dense::Dense;
use crate::model::linear::Linear;
use crate::model::loader::SafetensorsWeights;
use crate::model::shard::{balanced, even_split};
use crate::model::stored::{from_safetensors, Stored};
use crate::model::{Body, Model};
use crate::tp::Communicator;
use candle_core::quantized::gguf_file::Value;
use serde_json::Value as Json;
use std::ops::Range;

fn bad(m: String) -> VerifyError {
    VerifyError::BadConfig(m)
}

fn ju(v: &Json, key: &str) -> Result<usize> {
    v.get(key)
        .and_then(Json::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| {
            bad(format!(
                "config.json: text_config.{key} missing or not an integer"
            ))
        })
}

fn jf(v: &Json, key: &str, default: Option<f64>) -> Result<f64> {
    match (v.get(key).and_then(Json::as_f64), default) {
        (Some(x), _) => Ok(x),
        (None, Some(d)) => Ok(d),
        (None, None) => Err(bad(format!(
            "config.json: text_config.{key} missing or not a number"
        ))),
    }
}

/// Parses a K3 `config.json` (the whole file; the text model sits under
/// `text_config`).
///
/// Errors: a missing key (named), an activation other than SiTU, a router
/// other than sigmoid, tied embeddings, or an inconsistent layer schedule.
pub(crate) fn config_from_hf_json(v: &Json) -> Result<(ModelConfig, K3Config)> {
    let t = v.get("text_config").unwrap_or(v);
    if t.get("hidden_act").and_then(Json::as_str) != Some("situ") {
        return Err(bad("config.json: Kimi K3 needs hidden_act \"situ\"".into()));
    }
    if t.get("moe_router_activation_func")
        .and_then(Json::as_str)
        .unwrap_or("sigmoid")
        != "sigmoid"
    {
        return Err(bad("config.json: Kimi K3's router must be sigmoid".into()));
    }
    if t.get("tie_word_embeddings").and_then(Json::as_bool) == Some(true) {
        return Err(bad(
            "config.json: tied embeddings in a Kimi K3 config".into()
        ));
    }
    let lin = t
        .get("linear_attn_config")
        .ok_or_else(|| bad("config.json: text_config.linear_attn_config missing".into()))?;
    let layers = ju(t, "num_hidden_layers")?;
    let full: Vec<usize> = lin
        .get("full_attn_layers")
        .and_then(Json::as_array)
        .ok_or_else(|| bad("config.json: linear_attn_config.full_attn_layers missing".into()))?
        .iter()
        .map(|x| x.as_u64().map(|x| x as usize))
        .collect::<Option<_>>()
        .ok_or_else(|| bad("config.json: full_attn_layers must be integers".into()))?;
    // 1-indexed, as KimiLinearConfig reads them.
    let mla_layers: Vec<bool> = (0..layers).map(|l| full.contains(&(l + 1))).collect();
    let heads = ju(t, "num_attention_heads")?;
    let mla = MlaConfig {
        q_lora_rank: t
            .get("q_lora_rank")
            .and_then(Json::as_u64)
            .map(|x| x as usize),
        kv_lora_rank: ju(t, "kv_lora_rank")?,
        qk_nope_head_dim: ju(t, "qk_nope_head_dim")?,
        qk_rope_head_dim: ju(t, "qk_rope_head_dim")?,
        v_head_dim: ju(t, "v_head_dim")?,
    };
    let moe = MoeConfig {
        n_routed_experts: ju(t, "num_experts")?,
        num_experts_per_tok: ju(t, "num_experts_per_token")?,
        moe_intermediate_size: ju(t, "moe_intermediate_size")?,
        n_shared_experts: ju(t, "num_shared_experts")?,
        n_group: t
            .get("num_expert_group")
            .and_then(Json::as_u64)
            .unwrap_or(1) as usize,
        topk_group: t.get("topk_group").and_then(Json::as_u64).unwrap_or(1) as usize,
        norm_topk_prob: t
            .get("moe_renormalize")
            .and_then(Json::as_bool)
            .unwrap_or(true),
        routed_scaling_factor: jf(t, "routed_scaling_factor", Some(1.0))? as f32,
        first_k_dense_replace: ju(t, "first_k_dense_replace")?,
    };
    let k3 = K3Config {
        mla_layers,
        kda_heads: ju(lin, "num_heads")?,
        kda_head_dim: ju(lin, "head_dim")?,
        conv_kernel: ju(lin, "short_conv_kernel_size")?,
        gate_lower_bound: lin
            .get("gate_lower_bound")
            .and_then(Json::as_f64)
            .map(|x| x as f32),
        latent: t
            .get("routed_expert_hidden_size")
            .and_then(Json::as_u64)
            .map(|x| x as usize),
        situ_beta: jf(t, "activation_situ_beta", None)? as f32,
        situ_linear_beta: jf(t, "activation_situ_linear_beta", Some(0.0))? as f32,
        attn_res_block: t
            .get("attn_res_block_size")
            .and_then(Json::as_u64)
            .unwrap_or(0) as usize,
    };
    let cfg = ModelConfig {
        arch: Arch::KimiK3,
        vocab_size: ju(t, "vocab_size")?,
        hidden_size: ju(t, "hidden_size")?,
        intermediate_size: ju(t, "intermediate_size")?,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: heads,
        head_dim: mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        rms_norm_eps: jf(t, "rms_norm_eps", Some(1e-5))?,
        rope_theta: 10000.0,
        rope_style: RopeStyle::Neox,
        max_position: t
            .get("max_position_embeddings")
            .and_then(Json::as_u64)
            .unwrap_or(131072) as usize,
        mla: Some(Box::new(mla)),
        moe: Some(Box::new(moe)),
        yarn: None,
    };
    validate(&cfg, &k3)?;
    Ok((cfg, k3))
}

/// Checks what the forward relies on.
pub(crate) fn validate(cfg: &ModelConfig, k3: &K3Config) -> Result<()> {
    if k3.mla_layers.len() != cfg.num_layers {
        return Err(bad(format!(
            "layer schedule has {} entries for {} layers",
            k3.mla_layers.len(),
            cfg.num_layers
        )));
    }
    if k3.kda_heads == 0 || k3.kda_head_dim == 0 || k3.conv_kernel < 2 || k3.situ_beta <= 0.0 {
        return Err(bad(format!(
            "degenerate Kimi K3 linear-attention settings {k3:?}"
        )));
    }
    if cfg.mla.is_none() || cfg.moe.is_none() {
        return Err(bad("a Kimi K3 config needs MLA and MoE settings".into()));
    }
    let moe = cfg.moe.as_ref().expect("checked");
    if moe.n_group == 0
        || !moe.n_routed_experts.is_multiple_of(moe.n_group)
        || moe.topk_group > moe.n_group
    {
        return Err(bad(format!(
            "expert groups {moe:?} do not divide the experts"
        )));
    }
    Ok(())
}

fn meta<'a>(g: &'a Gguf, key: &str) -> Result<&'a Value> {
    g.metadata
        .get(&format!("kimi-k3.{key}"))
        .ok_or_else(|| VerifyError::MissingMetadata(format!("kimi-k3.{key}")))
}

fn as_usize(v: &Value, key: &str) -> Result<usize> {
    Ok(match v {
        Value::U8(x) => *x as usize,
        Value::U16(x) => *x as usize,
        Value::U32(x) => *x as usize,
        Value::U64(x) => *x as usize,
        Value::I32(x) if *x >= 0 => *x as usize,
        Value::I64(x) if *x >= 0 => *x as usize,
        _ => return Err(bad(format!("GGUF kimi-k3.{key} is not a count: {v:?}"))),
    })
}

fn as_f32(v: &Value, key: &str) -> Result<f32> {
    Ok(match v {
        Value::F32(x) => *x,
        Value::F64(x) => *x as f32,
        _ => return Err(bad(format!("GGUF kimi-k3.{key} is not a number: {v:?}"))),
    })
}

fn mu(g: &Gguf, key: &str) -> Result<usize> {
    as_usize(meta(g, key)?, key)
}

fn mu_or(g: &Gguf, key: &str, d: usize) -> Result<usize> {
    match g.metadata.get(&format!("kimi-k3.{key}")) {
        Some(v) => as_usize(v, key),
        None => Ok(d),
    }
}

fn mf_opt(g: &Gguf, key: &str) -> Result<Option<f32>> {
    g.metadata
        .get(&format!("kimi-k3.{key}"))
        .map(|v| as_f32(v, key))
        .transpose()
}

/// Reads the config out of a llama.cpp `kimi-k3` GGUF's metadata.
///
/// Errors: another architecture, or missing/mistyped keys (named).
pub(crate) fn config_from_gguf(g: &Gguf) -> Result<(ModelConfig, K3Config)> {
    match g.metadata.get("general.architecture") {
        Some(Value::String(a)) if a == "kimi-k3" => {}
        other => {
            return Err(bad(format!(
                "{}: not a kimi-k3 GGUF ({other:?})",
                g.path().display()
            )))
        }
    }
    let layers = mu(g, "block_count")?;
    let kv = meta(g, "attention.head_count_kv")?;
    let mla_layers: Vec<bool> = match kv {
        Value::Array(a) => a
            .iter()
            .map(|x| as_usize(x, "attention.head_count_kv").map(|n| n > 0))
            .collect::<Result<_>>()?,
        v => vec![as_usize(v, "attention.head_count_kv")? > 0; layers],
    };
    let rope = mu(g, "rope.dimension_count")?;
    let k_mla = mu(g, "attention.key_length_mla")?;
    let mla = MlaConfig {
        q_lora_rank: match g.metadata.get("kimi-k3.attention.q_lora_rank") {
            Some(v) => Some(as_usize(v, "attention.q_lora_rank")?),
            None => None,
        },
        kv_lora_rank: mu(g, "attention.kv_lora_rank")?,
        qk_nope_head_dim: k_mla - rope,
        qk_rope_head_dim: rope,
        v_head_dim: mu(g, "attention.value_length_mla")?,
    };
    let norm = match g.metadata.get("kimi-k3.expert_weights_norm") {
        Some(Value::Bool(b)) => *b,
        _ => false,
    };
    let moe = MoeConfig {
        n_routed_experts: mu(g, "expert_count")?,
        num_experts_per_tok: mu(g, "expert_used_count")?,
        moe_intermediate_size: mu(g, "expert_feed_forward_length")?,
        n_shared_experts: mu(g, "expert_shared_count")?,
        n_group: mu_or(g, "expert_group_count", 1)?.max(1),
        topk_group: mu_or(g, "expert_group_used_count", 1)?.max(1),
        norm_topk_prob: norm,
        routed_scaling_factor: mf_opt(g, "expert_weights_scale")?.unwrap_or(1.0),
        first_k_dense_replace: mu_or(g, "leading_dense_block_count", 0)?,
    };
    let heads = mu(g, "attention.head_count")?;
    let k3 = K3Config {
        mla_layers,
        kda_heads: heads,
        kda_head_dim: mu(g, "kda.head_dim")?,
        conv_kernel: mu(g, "ssm.conv_kernel")?,
        gate_lower_bound: mf_opt(g, "kda.gate_lower_bound")?.filter(|x| x.is_finite()),
        latent: match mu_or(g, "expert_latent_length", 0)? {
            0 => None,
            l => Some(l),
        },
        situ_beta: mf_opt(g, "activation.situ_beta")?
            .ok_or_else(|| VerifyError::MissingMetadata("kimi-k3.activation.situ_beta".into()))?,
        situ_linear_beta: mf_opt(g, "activation.situ_linear_beta")?.unwrap_or(0.0),
        attn_res_block: mu_or(g, "attn_res.block_size", 0)?,
    };
    let vocab = match g.metadata.get("kimi-k3.vocab_size") {
        Some(v) => as_usize(v, "vocab_size")?,
        None => match g.metadata.get("tokenizer.ggml.tokens") {
            Some(Value::Array(a)) => a.len(),
            _ => return Err(VerifyError::MissingMetadata("kimi-k3.vocab_size".into())),
        },
    };
    let cfg = ModelConfig {
        arch: Arch::KimiK3,
        vocab_size: vocab,
        hidden_size: mu(g, "embedding_length")?,
        intermediate_size: mu(g, "feed_forward_length")?,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: heads,
        head_dim: k_mla,
        rms_norm_eps: mf_opt(g, "attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5) as f64,
        rope_theta: 10000.0,
        rope_style: RopeStyle::Neox,
        max_position: mu_or(g, "context_length", 131072)?,
        mla: Some(Box::new(mla)),
        moe: Some(Box::new(moe)),
        yarn: None,
    };
    validate(&cfg, &k3)?;
    Ok((cfg, k3))
}

/// Where the weights come from, read in the HF layout.
enum Source<'a> {
    Hf(&'a SafetensorsWeights, &'static str),
    Gguf(&'a Gguf),
}

/// A tensor of one layer (`Some(l)`) or of the model, named both ways.
struct Name<'a> {
    layer: Option<usize>,
    hf: &'a str,
    gguf: &'a str,
}

fn lay<'a>(l: usize, hf: &'a str, gguf: &'a str) -> Name<'a> {
    Name {
        layer: Some(l),
        hf,
        gguf,
    }
}

impl Source<'_> {
    fn hf_name(&self, n: &Name) -> String {
        let prefix = match self {
            Source::Hf(_, p) => *p,
            Source::Gguf(_) => "",
        };
        match n.layer {
            Some(l) => format!("{prefix}model.layers.{l}.{}", n.hf),
            None => format!("{prefix}{}", n.hf),
        }
    }

    fn gguf_name(n: &Name) -> String {
        match n.layer {
            Some(l) => format!("blk.{l}.{}", n.gguf),
            None => n.gguf.to_string(),
        }
    }

    fn has(&self, n: &Name) -> bool {
        match self {
            Source::Hf(st, _) => st.shape_of(&self.hf_name(n)).is_some(),
            Source::Gguf(g) => g.tensors.contains_key(&Self::gguf_name(n)),
        }
    }

    /// Tensor `n` with `len` elements (its layout as the HF checkpoint has it).
    fn get(&self, n: &Name, len: usize) -> Result<Vec<f32>> {
        let v = match self {
            Source::Hf(st, _) => {
                let name = self.hf_name(n);
                let shape = st
                    .shape_of(&name)
                    .ok_or_else(|| VerifyError::MissingTensor(name.clone()))?;
                st.tensor(&name, &shape)?.flatten_all()?.to_vec1::<f32>()?
            }
            Source::Gguf(g) => g.f32_tensor(&Self::gguf_name(n))?.1,
        };
        if v.len() != len {
            let name = match self {
                Source::Hf(..) => self.hf_name(n),
                Source::Gguf(_) => Self::gguf_name(n),
            };
            return Err(VerifyError::BadTensorShape {
                name,
                got: vec![v.len()],
                expected: vec![len],
            });
        }
        Ok(v)
    }

    fn opt(&self, n: &Name, len: usize) -> Result<Option<Vec<f32>>> {
        if self.has(n) {
            self.get(n, len).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Matrix `n`, `[out, inp]` in the HF layout, as stored; `rows` of it
    /// only (the HF side copies just those rows out of its mapping).
    fn stored(&self, n: &Name, out: usize, inp: usize, rows: Range<usize>) -> Result<Stored> {
        match self {
            Source::Gguf(g) => {
                let name = Self::gguf_name(n);
                let (info, bytes) = g.tensor(&name)?;
                if info.dims != [inp, out] {
                    return Err(VerifyError::BadTensorShape {
                        name,
                        got: info.dims,
                        expected: vec![inp, out],
                    });
                }
                Stored::new(&name, info.dtype, bytes, out, inp)?.select(rows, 0..inp)
            }
            Source::Hf(st, _) => from_safetensors(st, &self.hf_name(n), (out, inp), rows),
        }
    }

    /// Rows `r` and columns `c` of matrix `n` (`[out, inp]`) on the kernel
    /// for its stored format.
    fn mat(
        &self,
        n: &Name,
        (out, inp): (usize, usize),
        r: Range<usize>,
        c: Range<usize>,
    ) -> Result<Linear> {
        let rows = r.len();
        self.stored(n, out, inp, r)?
            .select(0..rows, c)?
            .into_linear()
    }

    /// The whole matrix `n` (`[out, inp]`), as stored.
    fn full(&self, n: &Name, out: usize, inp: usize) -> Result<Linear> {
        self.mat(n, (out, inp), 0..out, 0..inp)
    }

    /// An attention-residual score vector: the GGUF's fused one, or the
    /// checkpoint's `{p}_norm * {p}_proj`.
    fn res_score(
        &self,
        layer: Option<usize>,
        hf_prefix: &str,
        gguf: &str,
        hidden: usize,
    ) -> Result<Option<Vec<f32>>> {
        match self {
            Source::Gguf(_) => self.opt(
                &Name {
                    layer,
                    hf: "",
                    gguf,
                },
                hidden,
            ),
            Source::Hf(..) => {
                let (nn, pn) = (
                    format!("{hf_prefix}_norm.weight"),
                    format!("{hf_prefix}_proj.weight"),
                );
                let norm = Name {
                    layer,
                    hf: &nn,
                    gguf: "",
                };
                let proj = Name {
                    layer,
                    hf: &pn,
                    gguf: "",
                };
                match (self.opt(&norm, hidden)?, self.opt(&proj, hidden)?) {
                    (Some(a), Some(b)) => Ok(Some(a.iter().zip(&b).map(|(a, b)| a * b).collect())),
                    (None, None) => Ok(None),
                    _ => Err(bad(format!(
                        "{hf_prefix}: a residual norm without its projection"
                    ))),
                }
            }
        }
    }

    /// Routed expert `e`'s `which` (w1 gate, w2 down, w3 up), `[out, inp]`,
    /// as stored: MXFP4 stays packed (a view into the GGUF's stacked
    /// tensor; the HF checkpoint's packing is repacked to ggml blocks).
    fn expert(
        &self,
        l: usize,
        e: usize,
        n_exp: usize,
        which: &str,
        out: usize,
        inp: usize,
    ) -> Result<Linear> {
        match self {
            Source::Hf(st, p) => {
                let base = format!("{p}model.layers.{l}.block_sparse_moe.experts.{e}.{which}");
                let packed = format!("{base}.weight_packed");
                if st.shape_of(&packed).is_some() {
                    let pk = st.bytes(&packed, &[out, inp / 2])?;
                    let sc = st.bytes(&format!("{base}.weight_scale"), &[out, inp / 32])?;
                    let m = Mxfp4Matrix::from_packed(pk, sc, out, inp)
                        .map(Linear::from_mxfp4)
                        .map_err(|m| bad(format!("{base}: {m}")));
                    // Repacked to ggml blocks: the mapped source is not read again.
                    st.release(&packed, 0..pk.len());
                    st.release(&format!("{base}.weight_scale"), 0..sc.len());
                    m
                } else {
                    let hf = format!("block_sparse_moe.experts.{e}.{which}.weight");
                    self.full(&lay(l, &hf, ""), out, inp)
                }
            }
            Source::Gguf(g) => {
                let gname = match which {
                    "w1" => "ffn_gate_exps",
                    "w2" => "ffn_down_exps",
                    _ => "ffn_up_exps",
                };
                let name = format!("blk.{l}.{gname}.weight");
                let (info, bytes) = g.tensor(&name)?;
                if info.dims != [inp, out, n_exp] {
                    return Err(VerifyError::BadTensorShape {
                        name,
                        got: info.dims,
                        expected: vec![inp, out, n_exp],
                    });
                }
                Stored::new(&name, info.dtype, bytes, n_exp * out, inp)?
                    .select(e * out..(e + 1) * out, 0..inp)?
                    .into_linear()
            }
        }
    }

    /// The MLA layer's kv_b_proj `[heads * (nope + v), kvr]` (GGUF: rebuilt
    /// from `attn_k_b` `[heads][kvr, nope]` and `attn_v_b` `[heads][v, kvr]`).
    fn kv_b(&self, l: usize, heads: usize, nope: usize, v: usize, kvr: usize) -> Result<Vec<f32>> {
        let whole = lay(l, "self_attn.kv_b_proj.weight", "attn_kv_b.weight");
        if matches!(self, Source::Hf(..)) || self.has(&whole) {
            return self.get(&whole, heads * (nope + v) * kvr);
        }
        let kb = self.get(&lay(l, "", "attn_k_b.weight"), heads * kvr * nope)?;
        let vb = self.get(&lay(l, "", "attn_v_b.weight"), heads * v * kvr)?;
        let mut out = Vec::with_capacity(heads * (nope + v) * kvr);
        for h in 0..heads {
            let k_h = &kb[h * kvr * nope..(h + 1) * kvr * nope];
            for j in 0..nope {
                out.extend((0..kvr).map(|c| k_h[c * nope + j]));
            }
            out.extend_from_slice(&vb[h * v * kvr..(h + 1) * v * kvr]);
        }
        Ok(out)
    }
}

/// A SiTU MLP's column slice `f` of width `ff`.
fn situ_mlp(
    src: &Source,
    l: usize,
    prefix: &str,
    gg: &str,
    h: usize,
    ff: usize,
    f: Range<usize>,
) -> Result<SituMlp> {
    let n = |hf: &str, g: &str| {
        (
            format!("{prefix}.{hf}_proj.weight"),
            format!("ffn_{g}{gg}.weight"),
        )
    };
    let (gh, gq) = n("gate", "gate");
    let (uh, uq) = n("up", "up");
    let (dh, dq) = n("down", "down");
    Ok(SituMlp {
        gate: src.mat(&lay(l, &gh, &gq), (ff, h), f.clone(), 0..h)?,
        up: src.mat(&lay(l, &uh, &uq), (ff, h), f.clone(), 0..h)?,
        down: src.mat(&lay(l, &dh, &dq), (h, ff), 0..h, f)?,
    })
}

/// What one rank holds of the model's widths.
struct Split {
    h: usize,
    /// This rank's KDA heads and their channels.
    kheads: Range<usize>,
    chans: Range<usize>,
    /// This rank's MLA heads.
    mheads: Range<usize>,
}

/// Layer `l`'s gated MLA mixer, this rank's heads.
fn mla_mixer(src: &Source, cfg: &ModelConfig, sp: &Split, l: usize) -> Result<Mixer> {
    let (h, mheads) = (sp.h, sp.mheads.clone());
    let mla = cfg.mla.as_ref().expect("validated");
    let (nope, rope, v, kvr) = (
        mla.qk_nope_head_dim,
        mla.qk_rope_head_dim,
        mla.v_head_dim,
        mla.kv_lora_rank,
    );
    let qk = nope + rope;
    let nh = cfg.num_heads;
    let q = match mla.q_lora_rank {
        Some(r) => Query::LowRank {
            a: src.full(
                &lay(l, "self_attn.q_a_proj.weight", "attn_q_a.weight"),
                r,
                h,
            )?,
            norm: src.get(
                &lay(l, "self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
                r,
            )?,
            b: src.mat(
                &lay(l, "self_attn.q_b_proj.weight", "attn_q_b.weight"),
                (nh * qk, r),
                mheads.start * qk..mheads.end * qk,
                0..r,
            )?,
        },
        None => Query::Full(src.mat(
            &lay(l, "self_attn.q_proj.weight", "attn_q.weight"),
            (nh * qk, h),
            mheads.start * qk..mheads.end * qk,
            0..h,
        )?),
    };
    let kv_b = src.kv_b(l, nh, nope, v, kvr)?;
    let per = nope + v;
    let gate_name = lay(l, "self_attn.g_proj.weight", "attn_gate.weight");
    let gate = if src.has(&gate_name) {
        Some(src.mat(
            &gate_name,
            (nh * v, h),
            mheads.start * v..mheads.end * v,
            0..h,
        )?)
    } else {
        None
    };
    Ok(Mixer::Mla(Box::new(GatedMla {
        q,
        kv_a: src.full(
            &lay(
                l,
                "self_attn.kv_a_proj_with_mqa.weight",
                "attn_kv_a_mqa.weight",
            ),
            kvr + rope,
            h,
        )?,
        kv_a_norm: src.get(
            &lay(
                l,
                "self_attn.kv_a_layernorm.weight",
                "attn_kv_a_norm.weight",
            ),
            kvr,
        )?,
        kv_b: Dense::new(
            kv_b[mheads.start * per * kvr..mheads.end * per * kvr].to_vec(),
            mheads.len() * per,
            kvr,
        ),
        gate,
        o: src.mat(
            &lay(l, "self_attn.o_proj.weight", "attn_output.weight"),
            (h, nh * v),
            0..h,
            mheads.start * v..mheads.end * v,
        )?,
        heads: mheads.len(),
    })))
}

/// Layer `l`'s KDA mixer, this rank's heads.
fn kda_mixer(src: &Source, k3: &K3Config, sp: &Split, l: usize) -> Result<Mixer> {
    let (h, kheads, chans) = (sp.h, sp.kheads.clone(), sp.chans.clone());
    let (hd, kh) = (k3.kda_head_dim, k3.kda_heads);
    let c = kh * hd;
    let kernel = k3.conv_kernel;
    let conv = |hf: &str, g: &str| -> Result<Vec<f32>> {
        let w = src.get(&lay(l, hf, g), c * kernel)?;
        Ok(w[chans.start * kernel..chans.end * kernel].to_vec())
    };
    let a = match src {
        Source::Gguf(_) => src
            .get(&lay(l, "", "ssm_a"), kh)?
            .iter()
            .map(|x| -x)
            .collect::<Vec<_>>(),
        Source::Hf(st, _) => {
            let n = lay(l, "self_attn.A_log", "");
            let name = src.hf_name(&n);
            let len = st.shape_of(&name).map(|s| s.iter().product()).unwrap_or(0);
            let raw = src.get(&n, len)?;
            if raw.len() < kh {
                return Err(bad(format!(
                    "{name} has {} entries for {kh} heads",
                    raw.len()
                )));
            }
            raw[..kh].iter().map(|x| x.exp()).collect()
        }
    };
    let dt = src.get(&lay(l, "self_attn.dt_bias", "ssm_dt.bias"), c)?;
    let chan_rows = |hf: &str, g: &str| src.mat(&lay(l, hf, g), (c, h), chans.clone(), 0..h);
    Ok(Mixer::Kda(Box::new(Kda {
        q: chan_rows("self_attn.q_proj.weight", "attn_q.weight")?,
        k: chan_rows("self_attn.k_proj.weight", "attn_k.weight")?,
        v: chan_rows("self_attn.v_proj.weight", "attn_v.weight")?,
        q_conv: conv("self_attn.q_conv1d.weight", "ssm_conv1d_q.weight")?,
        k_conv: conv("self_attn.k_conv1d.weight", "ssm_conv1d_k.weight")?,
        v_conv: conv("self_attn.v_conv1d.weight", "ssm_conv1d_v.weight")?,
        f_a: src.full(
            &lay(l, "self_attn.f_a_proj.weight", "ssm_f_a.weight"),
            hd,
            h,
        )?,
        f_b: src.mat(
            &lay(l, "self_attn.f_b_proj.weight", "ssm_f_b.weight"),
            (c, hd),
            chans.clone(),
            0..hd,
        )?,
        beta: src.mat(
            &lay(l, "self_attn.b_proj.weight", "ssm_beta.weight"),
            (kh, h),
            kheads.clone(),
            0..h,
        )?,
        a: a[kheads.clone()].to_vec(),
        dt_bias: dt[chans.clone()].to_vec(),
        g: chan_rows("self_attn.g_proj.weight", "ssm_g.weight")?,
        o_norm: src.get(&lay(l, "self_attn.o_norm.weight", "ssm_norm.weight"), hd)?,
        o: src.mat(
            &lay(l, "self_attn.o_proj.weight", "attn_output.weight"),
            (h, c),
            0..h,
            chans.clone(),
        )?,
        heads: kheads.len(),
    })))
}

/// Layer `l`'s latent MoE: this rank's experts (`e % world == rank`) and
/// shared-expert columns; router and latent projections replicated.
fn moe_ffn(
    src: &Source,
    cfg: &ModelConfig,
    k3: &K3Config,
    l: usize,
    (rank, world): (usize, usize),
) -> Result<Ffn> {
    let h = cfg.hidden_size;
    let moe = cfg.moe.as_ref().expect("validated");
    let (ne, mi) = (moe.n_routed_experts, moe.moe_intermediate_size);
    let lat = k3.latent.unwrap_or(h);
    let mut experts = Vec::new();
    for e in (0..ne).filter(|e| e % world == rank) {
        experts.push((
            e,
            Expert {
                gate: src.expert(l, e, ne, "w1", mi, lat)?,
                up: src.expert(l, e, ne, "w3", mi, lat)?,
                down: src.expert(l, e, ne, "w2", lat, mi)?,
            },
        ));
    }
    let sff = mi * moe.n_shared_experts;
    let shared = if moe.n_shared_experts > 0 {
        Some(situ_mlp(
            src,
            l,
            "block_sparse_moe.shared_experts",
            "_shexp",
            h,
            sff,
            even_split("shared experts", sff, world, rank)?,
        )?)
    } else {
        None
    };
    let latent = k3.latent.is_some();
    let down_name = lay(
        l,
        "block_sparse_moe.routed_expert_down_proj.weight",
        "ffn_routed_down.weight",
    );
    let up_name = lay(
        l,
        "block_sparse_moe.routed_expert_up_proj.weight",
        "ffn_routed_up.weight",
    );
    Ok(Ffn::Moe(Box::new(LatentMoe {
        router: src.full(
            &lay(l, "block_sparse_moe.gate.weight", "ffn_gate_inp.weight"),
            ne,
            h,
        )?,
        bias: src.get(
            &lay(
                l,
                "block_sparse_moe.gate.e_score_correction_bias",
                "exp_probs_b.bias",
            ),
            ne,
        )?,
        down: latent.then(|| src.full(&down_name, lat, h)).transpose()?,
        experts,
        norm: if latent {
            src.opt(
                &lay(
                    l,
                    "block_sparse_moe.routed_expert_norm.weight",
                    "ffn_routed_norm.weight",
                ),
                lat,
            )?
        } else {
            None
        },
        up: latent.then(|| src.full(&up_name, h, lat)).transpose()?,
        shared,
    })))
}

fn load_rank(
    src: &Source,
    cfg: &ModelConfig,
    k3: &K3Config,
    comm: Box<dyn Communicator>,
) -> Result<Weights> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let h = cfg.hidden_size;
    let moe = cfg.moe.as_ref().expect("validated");
    let hd = k3.kda_head_dim;
    let kheads = even_split("KDA heads", k3.kda_heads, world, rank)?;
    let sp = Split {
        h,
        chans: kheads.start * hd..kheads.end * hd,
        kheads,
        mheads: even_split("MLA heads", cfg.num_heads, world, rank)?,
    };
    let mut layers = Vec::with_capacity(cfg.num_layers);
    let mut state_offsets = Vec::with_capacity(cfg.num_layers);
    let mut state_floats = 0;
    for l in 0..cfg.num_layers {
        let mixer = if k3.mla_layers[l] {
            state_offsets.push(None);
            mla_mixer(src, cfg, &sp, l)?
        } else {
            state_offsets.push(Some(state_floats));
            state_floats += k3.kda_state_floats(sp.kheads.len());
            kda_mixer(src, k3, &sp, l)?
        };
        let ffn = if l < moe.first_k_dense_replace {
            let ff = cfg.intermediate_size;
            Ffn::Dense(Box::new(situ_mlp(
                src,
                l,
                "mlp",
                "",
                h,
                ff,
                even_split("dense MLP", ff, world, rank)?,
            )?))
        } else {
            moe_ffn(src, cfg, k3, l, (rank, world))?
        };
        let res = k3.attn_res_block > 0;
        layers.push(K3Layer {
            attn_norm: src.get(&lay(l, "input_layernorm.weight", "attn_norm.weight"), h)?,
            mixer,
            ffn_norm: src.get(
                &lay(l, "post_attention_layernorm.weight", "ffn_norm.weight"),
                h,
            )?,
            ffn,
            attn_res: if res {
                src.res_score(Some(l), "self_attention_res", "attn_res_score.weight", h)?
            } else {
                None
            },
            ffn_res: if res {
                src.res_score(Some(l), "mlp_res", "ffn_res_score.weight", h)?
            } else {
                None
            },
        });
    }
    let v = cfg.vocab_size;
    let global = |hf: &'static str, gguf: &'static str| Name {
        layer: None,
        hf,
        gguf,
    };
    let out_res = if k3.attn_res_block > 0 {
        src.res_score(None, "model.output_attn_res", "output_res_score.weight", h)?
    } else {
        None
    };
    Ok(Weights {
        embed: src.full(
            &global("model.embed_tokens.weight", "token_embd.weight"),
            v,
            h,
        )?,
        layers,
        norm: src.get(&global("model.norm.weight", "output_norm.weight"), h)?,
        out_res,
        lm_head: src.mat(
            &global("lm_head.weight", "output.weight"),
            (v, h),
            balanced(v, world)[rank].clone(),
            0..h,
        )?,
        k3: k3.clone(),
        state_offsets,
        state_floats,
        comm,
        ablation: Ablation::default(),
    })
}

/// Every rank of `comms` loaded at once, one thread each (each reads only
/// its own rows, columns and experts, so they share nothing but the
/// source), in rank order; the first error in rank order wins.
fn load_ranks(
    src: &Source,
    cfg: &ModelConfig,
    k3: &K3Config,
    comms: Vec<Box<dyn Communicator>>,
) -> Result<Vec<Weights>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| s.spawn(move || load_rank(src, cfg, k3, c)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

fn assemble(ranks: Vec<Weights>, cfg: ModelConfig) -> Model {
    let moe = cfg.moe.as_ref().expect("validated");
    let share = (moe.num_experts_per_tok, moe.n_routed_experts);
    let weight_bytes = ranks.iter().map(|w| w.decode_bytes(share)).sum();
    let latent_cache = ranks[0].default_latent_cache();
    Model {
        cfg,
        body: Body::KimiK3(ranks),
        weight_bytes,
        head_tokens: None,
        lm_bytes: 0,
        step: std::sync::Mutex::new(()),
        leader: None,
        latent_cache,
    }
}

/// Loads a K3 Hugging Face directory's weights (tensor names with or
/// without the released `language_model.` prefix) for `comms`' ranks.
///
/// Errors: missing or mis-shaped tensors (named), uneven head or width
/// splits (naming the world sizes that work), bad MXFP4 data.
pub(crate) fn load_hf(
    st: &SafetensorsWeights,
    cfg: ModelConfig,
    k3: K3Config,
    comms: Vec<Box<dyn Communicator>>,
) -> Result<Model> {
    let prefix = if st.shape_of("language_model.model.norm.weight").is_some() {
        "language_model."
    } else {
        ""
    };
    let src = Source::Hf(st, prefix);
    let ranks = load_ranks(&src, &cfg, &k3, comms)?;
    Ok(assemble(ranks, cfg))
}

/// Loads a llama.cpp `kimi-k3` GGUF for `comms`' ranks.
///
/// Errors: as [`load_hf`], and metadata errors from [`config_from_gguf`].
pub(crate) fn load_gguf(g: &Gguf, comms: Vec<Box<dyn Communicator>>) -> Result<Model> {
    let (cfg, k3) = config_from_gguf(g)?;
    let src = Source::Gguf(g);
    let ranks = load_ranks(&src, &cfg, &k3, comms)?;
    Ok(assemble(ranks, cfg))
}
