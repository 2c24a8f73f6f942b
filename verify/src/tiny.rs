//! Tiny random-weight llama/qwen2 models generated in code, written as GGUF
//! (quantized) or safetensors + config.json, for tests and examples that must
//! not need real weights. Deterministic for a given [`TinySpec`].

use crate::error::{Result, VerifyError};
use crate::model::Arch;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::Path;

/// Shape and seed of a generated model.
///
/// Invariant for quantized GGUF output: `hidden_size`, `intermediate_size`
/// and `num_heads * head_dim` are multiples of the format's block size
/// (256 for k-quants).
#[derive(Debug, Clone)]
pub struct TinySpec {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub max_position: usize,
    pub tied_embeddings: bool,
    pub seed: u64,
    /// Format of the matrices in GGUF output (norms and biases stay f32).
    pub dtype: GgmlDType,
    /// Spread of the output head: larger makes next-token distributions
    /// peakier (fewer greedy ties), smaller flatter (richer sampling tests).
    pub logit_scale: f32,
}

impl TinySpec {
    /// A 2-layer llama with grouped-query attention.
    pub fn llama(seed: u64) -> Self {
        Self {
            arch: Arch::Llama,
            vocab_size: 384,
            hidden_size: 256,
            intermediate_size: 512,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            max_position: 1024,
            tied_embeddings: false,
            seed,
            dtype: GgmlDType::Q4_1,
            logit_scale: 4.0,
        }
    }

    /// A 2-layer qwen2 (q/k/v biases, tied embeddings).
    pub fn qwen2(seed: u64) -> Self {
        Self {
            arch: Arch::Qwen2,
            tied_embeddings: true,
            dtype: GgmlDType::Q4K,
            ..Self::llama(seed)
        }
    }

    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    fn arch_name(&self) -> &'static str {
        match self.arch {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            // Tiny DeepSeek-V3-family checkpoints come from
            // scripts/kimi-reference.py; a TinySpec of this arch has no
            // latent attention and is refused at load.
            Arch::DeepseekV3 => "deepseek_v3",
            // Tiny K3 checkpoints come from scripts/k3/gen_tiny_k3.py.
            Arch::KimiK3 => "kimi_k3",
            Arch::Scripted => "specgate_scripted",
        }
    }

    /// All tensors in Hugging Face names and layout, f32.
    pub fn hf_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut mat = |rows: usize, cols: usize, scale: f32| -> Result<Tensor> {
            let data: Vec<f32> = (0..rows * cols)
                .map(|_| rng.random_range(-scale..scale))
                .collect();
            Ok(Tensor::from_vec(data, (rows, cols), &Device::Cpu)?)
        };
        let (h, ff, hd) = (self.hidden_size, self.intermediate_size, self.head_dim());
        let (qd, kvd) = (self.num_heads * hd, self.num_kv_heads * hd);
        // Uniform(-a, a) has std a/sqrt(3): a = sqrt(3/in) keeps activations O(1).
        let w = |inp: usize| (3.0 / inp as f32).sqrt();
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            mat(self.vocab_size, h, 1.0)?,
        )];
        for i in 0..self.num_layers {
            let p = format!("model.layers.{i}");
            let norm = |m: &mut dyn FnMut(usize, usize, f32) -> Result<Tensor>| -> Result<Tensor> {
                Ok((m(1, h, 0.2)?.squeeze(0)? + 1.0)?)
            };
            out.push((format!("{p}.input_layernorm.weight"), norm(&mut mat)?));
            out.push((format!("{p}.self_attn.q_proj.weight"), mat(qd, h, w(h))?));
            out.push((format!("{p}.self_attn.k_proj.weight"), mat(kvd, h, w(h))?));
            out.push((format!("{p}.self_attn.v_proj.weight"), mat(kvd, h, w(h))?));
            if self.arch == Arch::Qwen2 {
                out.push((
                    format!("{p}.self_attn.q_proj.bias"),
                    mat(1, qd, 0.5)?.squeeze(0)?,
                ));
                out.push((
                    format!("{p}.self_attn.k_proj.bias"),
                    mat(1, kvd, 0.5)?.squeeze(0)?,
                ));
                out.push((
                    format!("{p}.self_attn.v_proj.bias"),
                    mat(1, kvd, 0.5)?.squeeze(0)?,
                ));
            }
            out.push((format!("{p}.self_attn.o_proj.weight"), mat(h, qd, w(qd))?));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                norm(&mut mat)?,
            ));
            out.push((format!("{p}.mlp.gate_proj.weight"), mat(ff, h, w(h))?));
            out.push((format!("{p}.mlp.up_proj.weight"), mat(ff, h, w(h))?));
            out.push((format!("{p}.mlp.down_proj.weight"), mat(h, ff, w(ff))?));
        }
        out.push((
            "model.norm.weight".to_string(),
            (mat(1, h, 0.2)?.squeeze(0)? + 1.0)?,
        ));
        if !self.tied_embeddings {
            let scale = self.logit_scale * w(h);
            out.push((
                "lm_head.weight".to_string(),
                mat(self.vocab_size, h, scale)?,
            ));
        }
        Ok(out)
    }

    /// Hugging Face config.json for [`TinySpec::write_safetensors`].
    pub fn hf_config(&self) -> serde_json::Value {
        serde_json::json!({
            "model_type": self.arch_name(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": self.tied_embeddings,
        })
    }

    /// Writes `config.json` and `model.safetensors` into `dir`.
    pub fn write_safetensors(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let cfg_path = dir.join("config.json");
        std::fs::write(&cfg_path, self.hf_config().to_string()).map_err(|e| io(&cfg_path, e))?;
        let tensors: std::collections::HashMap<String, Tensor> =
            self.hf_tensors()?.into_iter().collect();
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
        Ok(())
    }

    /// Writes `config.json` and the weights split over `files` safetensors
    /// files named as Hugging Face shards them
    /// (`model-00001-of-00002.safetensors`, ...) with the
    /// `model.safetensors.index.json` that maps each tensor to its file.
    ///
    /// Errors: `files` 0 or more than the tensors, or a write failure.
    pub fn write_safetensors_sharded(&self, dir: &Path, files: usize) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let cfg_path = dir.join("config.json");
        std::fs::write(&cfg_path, self.hf_config().to_string()).map_err(|e| io(&cfg_path, e))?;
        write_sharded(dir, self.hf_tensors()?, files)
    }

    /// Writes a GGUF file the way llama.cpp converts the same weights: GGUF
    /// tensor names, llama's q/k rows permuted to interleaved RoPE pairs,
    /// matrices in `self.dtype`. `extra` metadata (e.g. a tokenizer) is added.
    pub fn write_gguf(&self, path: &Path, extra: &[(&str, gguf_file::Value)]) -> Result<()> {
        use gguf_file::Value as V;
        let a = self.arch_name();
        let key = |k: &str| format!("{a}.{k}");
        let mut md: Vec<(String, V)> = vec![
            ("general.architecture".into(), V::String(a.into())),
            (key("embedding_length"), V::U32(self.hidden_size as u32)),
            (
                key("feed_forward_length"),
                V::U32(self.intermediate_size as u32),
            ),
            (key("block_count"), V::U32(self.num_layers as u32)),
            (key("attention.head_count"), V::U32(self.num_heads as u32)),
            (
                key("attention.head_count_kv"),
                V::U32(self.num_kv_heads as u32),
            ),
            (key("attention.layer_norm_rms_epsilon"), V::F32(1e-6)),
            (key("rope.freq_base"), V::F32(10000.0)),
            (key("rope.dimension_count"), V::U32(self.head_dim() as u32)),
            (key("context_length"), V::U32(self.max_position as u32)),
        ];
        md.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        let mut qs: Vec<(String, QTensor)> = Vec::new();
        for (name, t) in self.hf_tensors()? {
            let Some(gname) = gguf_name(&name) else {
                return Err(VerifyError::BadConfig(format!("no GGUF name for {name}")));
            };
            let t = if self.arch == Arch::Llama
                && (name.ends_with("q_proj.weight") || name.ends_with("k_proj.weight"))
            {
                permute_interleaved(&t, self.head_dim())?
            } else {
                t
            };
            let dtype = if t.rank() == 1 {
                GgmlDType::F32
            } else {
                self.dtype
            };
            qs.push((gname, QTensor::quantize(&t, dtype)?));
        }
        let mut file = std::fs::File::create(path).map_err(|e| io(path, e))?;
        let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = qs.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut file, &md_refs, &t_refs)?;
        Ok(())
    }
}

/// Copies the Hugging Face directory `src` (its `config.json` and
/// `model.safetensors`) to `dst` with the weights split over `files`
/// sharded files and an index, as [`TinySpec::write_safetensors_sharded`]
/// writes them: for checking that any model, e.g. the committed tiny Kimi
/// fixture, loads the same from shards.
///
/// Errors: unreadable `src` files, `files` 0 or more than the tensors, or a
/// write failure.
pub fn reshard_safetensors_dir(src: &Path, dst: &Path, files: usize) -> Result<()> {
    std::fs::create_dir_all(dst).map_err(|e| io(dst, e))?;
    let (from, to) = (src.join("config.json"), dst.join("config.json"));
    std::fs::copy(&from, &to).map_err(|e| io(&from, e))?;
    let tensors = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu)?;
    write_sharded(dst, tensors.into_iter().collect(), files)
}

/// Writes `tensors` (sorted by name, then cut into `files` runs of equal
/// count, give or take one) as `model-0000i-of-0000n.safetensors` plus the index.
fn write_sharded(dir: &Path, mut tensors: Vec<(String, Tensor)>, files: usize) -> Result<()> {
    if files == 0 || files > tensors.len() {
        return Err(VerifyError::BadConfig(format!(
            "cannot split {} tensors into {files} files",
            tensors.len()
        )));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let n = tensors.len();
    let mut weight_map = serde_json::Map::new();
    for i in 0..files {
        let name = format!("model-{:05}-of-{files:05}.safetensors", i + 1);
        let part: std::collections::HashMap<&str, Tensor> = tensors
            [i * n / files..(i + 1) * n / files]
            .iter()
            .map(|(k, v)| {
                weight_map.insert(k.clone(), name.clone().into());
                (k.as_str(), v.clone())
            })
            .collect();
        candle_core::safetensors::save(&part, dir.join(&name))?;
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    let path = dir.join("model.safetensors.index.json");
    std::fs::write(&path, index.to_string()).map_err(|e| io(&path, e))?;
    Ok(())
}

fn io(path: &Path, source: std::io::Error) -> VerifyError {
    VerifyError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// llama.cpp's q/k row permutation: within each head, row `j * d/2 + i`
/// (neox pair layout) moves to row `2 * i + j` (interleaved pairs).
fn permute_interleaved(w: &Tensor, head_dim: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let heads = rows / head_dim;
    Ok(w.reshape((heads, 2, head_dim / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let g = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{kind}"))
}
