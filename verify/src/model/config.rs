//! The config every architecture family is described by: [`ModelConfig`]
//! (shape and numerics), its family-specific parts ([`MlaConfig`],
//! [`MoeConfig`], [`YarnConfig`]), [`Arch`], [`RopeStyle`], and the token
//! list file format of [`read_token_list`]. Family-neutral: the checks one
//! family adds run through the dispatch in `mod.rs`.

use crate::error::{Result, VerifyError};

/// Architecture family of a model; decides the tensor layout and forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    /// DeepSeek-V3 layout (Kimi K2 ships it as `kimi_k2`): multi-head
    /// latent attention and mixture-of-experts layers; needs
    /// [`ModelConfig::mla`].
    DeepseekV3,
    /// Kimi K3 (`kimi_k3`; llama.cpp's `kimi-k3`): KDA linear-attention
    /// layers with a recurrent state, gated NoPE MLA layers, a latent MoE;
    /// needs [`ModelConfig::mla`] and [`ModelConfig::moe`], its other
    /// numerics live in the family.
    KimiK3,
    /// A test double (`specgate_scripted`) replaying token scripts; no
    /// weights (see `model/scripted.rs`).
    Scripted,
}

impl Arch {
    /// Parses the GGUF `general.architecture` / HF `model_type` name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "deepseek_v3" | "kimi_k2" => Ok(Arch::DeepseekV3),
            "kimi_k3" | "kimi-k3" => Ok(Arch::KimiK3),
            "specgate_scripted" => Ok(Arch::Scripted),
            other => Err(VerifyError::UnknownArchitecture(other.to_string())),
        }
    }
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs (2i, 2i+1): llama weights as converted to GGUF by llama.cpp.
    Interleaved,
    /// Pairs (i, i + d/2): Hugging Face layout and qwen2 everywhere.
    Neox,
}

/// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) shape, in the
/// config.json names.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    /// Rank of the low-rank query (`q_a_proj` -> norm -> `q_b_proj`);
    /// `None` means a full-rank `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Width of the compressed KV latent the cache stores.
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    /// Width of the decoupled RoPE key shared by all heads (cached too).
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

/// Mixture-of-experts layers of the DeepSeek-V3 family (sigmoid router with
/// a selection-only score correction, group-limited top-k).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// Shared experts, run for every token as one MLP of
    /// `n_shared_experts * moe_intermediate_size`.
    pub n_shared_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    /// Layers `0..first_k_dense_replace` use a dense MLP of
    /// `intermediate_size`; the rest are MoE.
    pub first_k_dense_replace: usize,
}

/// YaRN RoPE scaling (`rope_scaling.type = "yarn"`), as transformers
/// computes it: blended inverse frequencies, cos/sin scaled by an attention
/// factor, and the softmax scale multiplied by `mscale(factor,
/// mscale_all_dim)^2`.
#[derive(Debug, Clone, PartialEq)]
pub struct YarnConfig {
    pub factor: f64,
    pub original_max_position: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
    /// Explicit `attention_factor`, overriding the one derived from mscale.
    pub attention_factor: Option<f64>,
}

/// Shape and numerics of a model.
///
/// Invariants (checked by [`ModelConfig::validate`]): `num_heads` is a
/// multiple of `num_kv_heads`, `head_dim` is even, all sizes are non-zero;
/// `mla`, `moe` and `yarn` only for [`Arch::DeepseekV3`], which needs `mla`
/// (and [`Arch::KimiK3`], which needs `mla` and `moe`).
/// For DeepseekV3, `head_dim` is `qk_nope_head_dim + qk_rope_head_dim` and
/// `num_kv_heads == num_heads` (what the latent expands to).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    /// Longest sequence (prompt + output) the model was trained for.
    pub max_position: usize,
    // Boxed: a config is embedded in every `Model` and should stay small.
    /// Latent attention (DeepseekV3 family).
    pub mla: Option<Box<MlaConfig>>,
    /// Mixture of experts (DeepseekV3 family); `None`: every layer dense.
    pub moe: Option<Box<MoeConfig>>,
    /// YaRN RoPE scaling (DeepseekV3 family).
    pub yarn: Option<Box<YarnConfig>>,
}

impl ModelConfig {
    /// Rejects configs the forward pass cannot run.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(VerifyError::BadConfig(m));
        if [
            self.vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.max_position,
        ]
        .contains(&0)
        {
            return bad(format!("zero-sized dimension in {self:?}"));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} attention heads are not a multiple of {} KV heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} is odd", self.head_dim));
        }
        super::validate_family(self)
    }

    /// Bytes one token occupies in a [`crate::KvPool`], all layers: K plus V
    /// per KV head, or for latent attention the compressed latent plus the
    /// RoPE key (`kv_lora_rank + qk_rope_head_dim` values per layer).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.num_layers * self.kv_floats_per_token_layer() * std::mem::size_of::<f32>()
    }

    /// Cached floats per token per layer.
    pub(crate) fn kv_floats_per_token_layer(&self) -> usize {
        match &self.mla {
            Some(m) => m.kv_lora_rank + m.qk_rope_head_dim,
            None => 2 * self.num_kv_heads * self.head_dim,
        }
    }
}

/// A fingerprint of a GGUF file's vocabulary: FNV-1a (64 bits) over its
/// token strings (`tokenizer.ggml.tokens`), each followed by a zero byte,
/// with the count: `fnv1a64:<16 hex digits>:<count>`. Two files with the
/// same fingerprint map every id to the same string, so a token list made
/// for one fits the other. `None` for a path that is not a GGUF file or
/// has no token strings.
///
/// Errors: a GGUF file that cannot be read.
pub fn vocab_fingerprint(path: &std::path::Path) -> Result<Option<String>> {
    use candle_core::quantized::gguf_file::Value;
    if !path.is_file() {
        return Ok(None);
    }
    let g = crate::gguf::Gguf::open(path)?;
    let Some(Value::Array(tokens)) = g.metadata.get("tokenizer.ggml.tokens") else {
        return Ok(None);
    };
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    };
    for t in tokens {
        let Value::String(t) = t else {
            return Ok(None);
        };
        t.bytes().for_each(&mut eat);
        eat(0);
    }
    Ok(Some(format!("fnv1a64:{h:016x}:{}", tokens.len())))
}

/// The vocabulary a token list was made for: its `# vocabulary: <fp>`
/// line ([`vocab_fingerprint`]), if it has one.
///
/// Errors: the file cannot be read.
pub fn token_list_vocabulary(path: &std::path::Path) -> Result<Option<String>> {
    let text = std::fs::read_to_string(path).map_err(|source| VerifyError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(text
        .lines()
        .take_while(|l| l.starts_with('#'))
        .find_map(|l| l.strip_prefix("# vocabulary:"))
        .map(|v| v.trim().to_owned()))
}

/// Reads a token list for [`super::Model::restrict_head`]: one id per line; empty
/// lines and lines starting with `#` are skipped.
///
/// Errors: unreadable file, or a line that is not a token id (named with
/// its line number).
pub fn read_token_list(path: &std::path::Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).map_err(|source| VerifyError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut ids = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        ids.push(line.parse().map_err(|_| {
            VerifyError::BadConfig(format!(
                "{} line {}: '{line}' is not a token id",
                path.display(),
                i + 1
            ))
        })?);
    }
    Ok(ids)
}
