//! Weight loading: GGUF files (weights stay quantized as candle `QTensor`s)
//! and Hugging Face safetensors directories + config.json (dense) for the
//! llama family, and the directory reading the DeepSeek-V3 family shares. A
//! missing tensor or metadata key is an error naming it. The llama loaders
//! read a matrix whole and cut it at once into the ranks' shards
//! (`shard.rs`), so at most one unsharded matrix is in memory extra.
//!
//! Safetensors are memory-mapped (`safetensors_weights.rs`): one
//! `model.safetensors`, or the `model-0000x-of-0000y.safetensors` files of
//! `model.safetensors.index.json`. A tensor, or a block of its rows or
//! columns, is copied out of the mapping when a loader asks for it, so no
//! file is read whole and a rank that asks for its shard pages in only that.

use super::shard::{rank_parts, FullLayer, Matrix, ShardPlan, SplitLimits};
use super::{Arch, Embedding, Model, ModelConfig, RopeStyle};
use crate::error::{Result, VerifyError};
use crate::tp::{Communicator, LocalComm, ThreadComm};
use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{Device, Tensor};
use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

mod safetensors_weights;
pub(crate) use safetensors_weights::SafetensorsWeights;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> VerifyError + '_ {
    move |source| VerifyError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads only the metadata and tensor directory of a GGUF file.
pub fn read_gguf_content(path: &Path) -> Result<gguf_file::Content> {
    let mut reader = BufReader::new(File::open(path).map_err(io_err(path))?);
    gguf_file::Content::read(&mut reader).map_err(|e| {
        VerifyError::BadConfig(format!(
            "{} is not a readable GGUF file: {e}",
            path.display()
        ))
    })
}

struct GgufReader<'a> {
    content: &'a gguf_file::Content,
    reader: BufReader<File>,
    prefix: String,
}

impl GgufReader<'_> {
    fn meta(&self, key: &str) -> Result<&gguf_file::Value> {
        let full = format!("{}.{key}", self.prefix);
        self.content
            .metadata
            .get(&full)
            .ok_or(VerifyError::MissingMetadata(full))
    }

    fn meta_usize(&self, key: &str) -> Result<usize> {
        let v = self.meta(key)?;
        v.to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .map(|x| x as usize)
            .map_err(|_| VerifyError::MissingMetadata(format!("{}.{key}", self.prefix)))
    }

    fn meta_f32(&self, key: &str) -> Result<f32> {
        self.meta(key)?
            .to_f32()
            .map_err(|_| VerifyError::MissingMetadata(format!("{}.{key}", self.prefix)))
    }

    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn qtensor(&mut self, name: &str) -> Result<Arc<QTensor>> {
        if !self.has(name) {
            return Err(VerifyError::MissingTensor(name.to_string()));
        }
        Ok(Arc::new(self.content.tensor(
            &mut self.reader,
            name,
            &Device::Cpu,
        )?))
    }

    fn dense(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.qtensor(name)?.dequantize(&Device::Cpu)?)
    }

    fn with_bias(&mut self, name: &str, bias: bool) -> Result<(Matrix, Option<Tensor>)> {
        let w = Matrix::Quant(self.qtensor(&format!("{name}.weight"))?);
        let b = if bias {
            Some(self.dense(&format!("{name}.bias"))?)
        } else {
            None
        };
        Ok((w, b))
    }

    fn matrix(&mut self, name: &str) -> Result<Matrix> {
        Ok(Matrix::Quant(self.qtensor(&format!("{name}.weight"))?))
    }

    /// Largest quantization block size among `blk.*.{suffix}` and the first
    /// tensor that has it.
    fn widest_block(&self, layers: usize, suffix: &str) -> Result<(usize, String)> {
        let mut best = (0, String::new());
        for i in 0..layers {
            let name = format!("blk.{i}.{suffix}");
            let info = self
                .content
                .tensor_infos
                .get(&name)
                .ok_or_else(|| VerifyError::MissingTensor(name.clone()))?;
            let bs = info.ggml_dtype.block_size();
            if bs > best.0 {
                best = (bs, name);
            }
        }
        Ok(best)
    }
}

/// Loads a llama or qwen2 GGUF file unsharded (tensor-parallel size 1).
pub fn load_gguf(path: &Path) -> Result<Model> {
    load_gguf_tp(path, 1)
}

/// Loads a llama or qwen2 GGUF file sharded over `world` tensor-parallel
/// ranks; matrices stay in their quantized format and are cut along whole
/// quantization blocks.
///
/// Errors: unreadable file, unknown `general.architecture`, a missing
/// metadata key or tensor (named in the error), `world` 0, or a tensor that
/// cannot be split `world` ways ([`VerifyError::ImpossibleSplit`] names it
/// and the sizes that work).
pub fn load_gguf_tp(path: &Path, world: usize) -> Result<Model> {
    let content = read_gguf_content(path)?;
    let arch_name = content
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .ok_or_else(|| VerifyError::MissingMetadata("general.architecture".into()))?;
    let arch = Arch::from_name(&arch_name)?;
    let reader = BufReader::new(File::open(path).map_err(io_err(path))?);
    let mut r = GgufReader {
        content: &content,
        reader,
        prefix: arch_name.clone(),
    };

    let hidden_size = r.meta_usize("embedding_length")?;
    let num_heads = r.meta_usize("attention.head_count")?;
    let num_kv_heads = r.meta_usize("attention.head_count_kv")?;
    let head_dim = r
        .meta_usize("attention.key_length")
        .unwrap_or(hidden_size / num_heads.max(1));
    if !r.has("token_embd.weight") {
        return Err(VerifyError::MissingTensor("token_embd.weight".into()));
    }
    let vocab_size = content.tensor_infos["token_embd.weight"].shape.dims()[0];
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
        rope_style: match arch {
            Arch::Llama => RopeStyle::Interleaved,
            Arch::Qwen2 => RopeStyle::Neox,
            Arch::DeepseekV3 => {
                return Err(VerifyError::BadConfig(format!(
                "{}: GGUF architecture {arch_name} is not supported for the DeepSeek-V3 family; \
                     load its safetensors directory",
                path.display()
            )))
            }
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
    Model::from_rank_parts(cfg, parts, weight_bytes, head.bytes())
}

pub(super) fn json_usize(cfg: &serde_json::Value, key: &str) -> Result<usize> {
    cfg.get(key)
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .ok_or_else(|| VerifyError::MissingMetadata(format!("config.json: {key}")))
}

/// Parses a Hugging Face config.json of a llama or qwen2 model.
pub fn config_from_hf_json(cfg: &serde_json::Value) -> Result<ModelConfig> {
    let arch_name = cfg
        .get("model_type")
        .and_then(|v| v.as_str())
        .ok_or_else(|| VerifyError::MissingMetadata("config.json: model_type".into()))?;
    let arch = Arch::from_name(arch_name)?;
    if arch == Arch::DeepseekV3 {
        return super::deepseek::config_from_hf_json(cfg);
    }
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

/// Reads `config.json` of a Hugging Face directory and maps its weights.
fn read_hf_dir(dir: &Path) -> Result<(serde_json::Value, ModelConfig, SafetensorsWeights)> {
    let cfg_path = dir.join("config.json");
    let raw = std::fs::read_to_string(&cfg_path).map_err(io_err(&cfg_path))?;
    let json: serde_json::Value = serde_json::from_str(&raw)
        .map_err(|e| VerifyError::BadConfig(format!("{}: {e}", cfg_path.display())))?;
    let cfg = config_from_hf_json(&json)?;
    let weights = SafetensorsWeights::open(dir)?;
    Ok((json, cfg, weights))
}

/// Loads one tensor-parallel rank's shard of a DeepSeek-V3-family model
/// (`deepseek_v3`, `kimi_k2`) from a safetensors directory: this rank's
/// attention heads, its experts (expert `e` lives on rank `e % world`), its
/// slices of the dense and shared MLPs and of the vocabulary. Every rank of
/// `comm`'s group loads its own shard and runs the same forwards; a rank
/// reads only its shard's bytes of the (memory-mapped) files.
///
/// Errors: those of [`load_safetensors`], a shape that does not split
/// across the group (the error names the tensor and the world sizes that
/// work), or a llama/qwen2 directory (not sharded by this loader).
pub fn load_safetensors_shard(dir: &Path, comm: Box<dyn Communicator>) -> Result<Model> {
    let (_, cfg, weights) = read_hf_dir(dir)?;
    if cfg.arch != Arch::DeepseekV3 {
        return Err(VerifyError::BadConfig(format!(
            "sharded safetensors loading serves the DeepSeek-V3 family, not {:?}",
            cfg.arch
        )));
    }
    super::deepseek::load(&weights, cfg, vec![comm])
}

/// Loads a model from a directory holding `config.json` and
/// `model.safetensors` (or `model.safetensors.index.json` and the sharded
/// files it names) in Hugging Face tensor names (llama, qwen2, or the
/// DeepSeek-V3 family), unsharded. Weights become dense f32.
///
/// Errors: missing files, a malformed index, unknown `model_type`, missing
/// or misshapen tensors.
pub fn load_safetensors(dir: &Path) -> Result<Model> {
    load_safetensors_tp(dir, 1)
}

/// [`load_safetensors`] sharded over `world` tensor-parallel ranks run by
/// the returned model (as threads, one forward call runs them all).
///
/// Errors: as [`load_safetensors`], plus `world` 0 or a split that is
/// impossible ([`VerifyError::ImpossibleSplit`], or for the DeepSeek family
/// an error naming the tensor and the world sizes that work).
pub fn load_safetensors_tp(dir: &Path, world: usize) -> Result<Model> {
    let (json, cfg, weights) = read_hf_dir(dir)?;
    if cfg.arch == Arch::DeepseekV3 {
        let comms: Vec<Box<dyn Communicator>> = match world {
            0 => {
                return Err(VerifyError::BadConfig(
                    "tensor-parallel world size 0".into(),
                ))
            }
            1 => vec![Box::new(LocalComm)],
            n => ThreadComm::group(n)?
                .into_iter()
                .map(|c| Box::new(c) as Box<dyn Communicator>)
                .collect(),
        };
        return super::deepseek::load(&weights, cfg, comms);
    }
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
    Model::from_rank_parts(cfg, parts, weight_bytes, head.bytes())
}

/// Loads a model from a `.gguf` file or a safetensors directory, unsharded.
pub fn load_model(path: &Path) -> Result<Model> {
    load_model_tp(path, 1)
}

/// Loads a model from a `.gguf` file or a safetensors directory, sharded
/// over `world` tensor-parallel ranks (1: unsharded).
///
/// Errors: as [`load_gguf_tp`] / [`load_safetensors_tp`].
pub fn load_model_tp(path: &Path, world: usize) -> Result<Model> {
    if path.is_dir() {
        load_safetensors_tp(path, world)
    } else {
        load_gguf_tp(path, world)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LogitsWanted;
    use crate::tiny::{reshard_safetensors_dir, TinySpec};
    use crate::KvPool;
    use std::path::PathBuf;

    const PROMPT: [u32; 7] = [1, 5, 9, 200, 33, 7, 64];

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("specgate-loader-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn logits(m: &Model) -> Vec<Vec<f32>> {
        let mut pool = KvPool::for_model(m, 1, 16).unwrap();
        m.forward_one(&mut pool, &PROMPT, 0, &[0], LogitsWanted::All)
            .unwrap()
    }

    /// Largest |a - b| relative to the largest |a|.
    fn rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
        assert_eq!(a.len(), b.len());
        let scale = a.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
        let d = a
            .iter()
            .flatten()
            .zip(b.iter().flatten())
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        d / scale.max(1e-6)
    }

    fn kimi_fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-kimi")
    }

    fn shard_files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".safetensors"))
            .collect();
        names.sort();
        names
    }

    #[test]
    fn sharded_llama_loads_like_one_file_and_tp_2_matches_tp_1() {
        let spec = TinySpec::qwen2(7); // biases and tied embeddings
        let (one, two) = (tmp("qwen-one"), tmp("qwen-two"));
        spec.write_safetensors(&one).unwrap();
        spec.write_safetensors_sharded(&two, 2).unwrap();
        assert_eq!(
            shard_files(&two),
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        let single = logits(&load_safetensors(&one).unwrap());
        let sharded = load_safetensors(&two).unwrap();
        // The same f32 values from other files: bit-identical logits.
        assert_eq!(logits(&sharded), single);
        let tp2 = load_safetensors_tp(&two, 2).unwrap();
        assert_eq!(tp2.world_size(), 2);
        let d = rel_diff(&single, &logits(&tp2));
        assert!(d < 1e-4, "tp 2 vs 1: {d}");
        std::fs::remove_dir_all(&one).ok();
        std::fs::remove_dir_all(&two).ok();
    }

    #[test]
    fn sharded_kimi_loads_like_one_file_and_each_rank_reads_its_shard() {
        let two = tmp("kimi-two");
        reshard_safetensors_dir(&kimi_fixture(), &two, 2).unwrap();
        assert_eq!(shard_files(&two).len(), 2);
        let single = logits(&load_safetensors(&kimi_fixture()).unwrap());
        assert_eq!(logits(&load_safetensors(&two).unwrap()), single);
        // One Model running both ranks, and each rank loaded on its own
        // (as a process per rank would): both equal world 1.
        let d = rel_diff(&single, &logits(&load_safetensors_tp(&two, 2).unwrap()));
        assert!(d < 1e-4, "in-process tp 2 vs 1: {d}");
        let ranks: Vec<_> = ThreadComm::group(2)
            .unwrap()
            .into_iter()
            .map(|comm| {
                let dir = two.clone();
                std::thread::spawn(move || {
                    logits(&load_safetensors_shard(&dir, Box::new(comm)).unwrap())
                })
            })
            .collect();
        for (rank, h) in ranks.into_iter().enumerate() {
            let d = rel_diff(&single, &h.join().unwrap());
            assert!(d < 1e-4, "rank {rank} of 2 vs world 1: {d}");
        }
        std::fs::remove_dir_all(&two).ok();
    }
}
