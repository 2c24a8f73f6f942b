//! Weight loading, the family-neutral part: the public entry points, GGUF
//! reading (weights stay quantized as candle `QTensor`s), Hugging Face
//! directories (config.json + safetensors), and the ONE dispatch from an
//! architecture to its family's loaders ([`family`]). Each family's own
//! tensor names, config keys and sharding live in its folder
//! (`llama/load.rs`, `deepseek/load.rs`). A missing tensor or metadata key
//! is an error naming it.
//!
//! Safetensors are memory-mapped (`safetensors_weights.rs`): one
//! `model.safetensors`, or the `model-0000x-of-0000y.safetensors` files of
//! `model.safetensors.index.json`. A tensor, or a block of its rows or
//! columns, is copied out of the mapping when a loader asks for it, so no
//! file is read whole and a rank that asks for its shard pages in only that.

use super::config::{Arch, ModelConfig};
use super::shard::Matrix;
use super::{deepseek, kimi_k3, llama, scripted, Model};
use crate::error::{Result, VerifyError};
use crate::gguf::Gguf;
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

/// A GGUF file being read: its directory, the open file, and the
/// `general.architecture` prefix of its metadata keys.
pub(crate) struct GgufReader<'a> {
    pub(crate) content: &'a gguf_file::Content,
    reader: BufReader<File>,
    prefix: String,
}

impl GgufReader<'_> {
    pub(crate) fn meta(&self, key: &str) -> Result<&gguf_file::Value> {
        let full = format!("{}.{key}", self.prefix);
        self.content
            .metadata
            .get(&full)
            .ok_or(VerifyError::MissingMetadata(full))
    }

    pub(crate) fn meta_usize(&self, key: &str) -> Result<usize> {
        let v = self.meta(key)?;
        v.to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .map(|x| x as usize)
            .map_err(|_| VerifyError::MissingMetadata(format!("{}.{key}", self.prefix)))
    }

    pub(crate) fn meta_f32(&self, key: &str) -> Result<f32> {
        self.meta(key)?
            .to_f32()
            .map_err(|_| VerifyError::MissingMetadata(format!("{}.{key}", self.prefix)))
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    pub(crate) fn qtensor(&mut self, name: &str) -> Result<Arc<QTensor>> {
        if !self.has(name) {
            return Err(VerifyError::MissingTensor(name.to_string()));
        }
        Ok(Arc::new(self.content.tensor(
            &mut self.reader,
            name,
            &Device::Cpu,
        )?))
    }

    pub(crate) fn dense(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.qtensor(name)?.dequantize(&Device::Cpu)?)
    }

    pub(crate) fn with_bias(&mut self, name: &str, bias: bool) -> Result<(Matrix, Option<Tensor>)> {
        let w = Matrix::Quant(self.qtensor(&format!("{name}.weight"))?);
        let b = if bias {
            Some(self.dense(&format!("{name}.bias"))?)
        } else {
            None
        };
        Ok((w, b))
    }

    pub(crate) fn matrix(&mut self, name: &str) -> Result<Matrix> {
        Ok(Matrix::Quant(self.qtensor(&format!("{name}.weight"))?))
    }

    /// Largest quantization block size among `blk.*.{suffix}` and the first
    /// tensor that has it.
    pub(crate) fn widest_block(&self, layers: usize, suffix: &str) -> Result<(usize, String)> {
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

/// Loads a llama, qwen2 or kimi-k3 GGUF file unsharded (tensor-parallel size 1).
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
    // Our own reader first: candle's rejects files with tensor types it
    // does not know (Kimi K3's MXFP4 experts).
    let raw = Gguf::open(path)?;
    if let Some(gguf_raw) = match raw.metadata.get("general.architecture") {
        Some(gguf_file::Value::String(a)) => family(Arch::from_name(a)?).gguf_raw,
        _ => None,
    } {
        raw.prefault();
        return gguf_raw(&raw, world);
    }
    drop(raw);
    let content = read_gguf_content(path)?;
    let arch_name = content
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .ok_or_else(|| VerifyError::MissingMetadata("general.architecture".into()))?;
    let arch = Arch::from_name(&arch_name)?;
    let family = family(arch);
    let Some(gguf) = family.gguf else {
        return Err(VerifyError::BadConfig(format!(
            "{}: GGUF architecture {arch_name} is not supported for the {} family; \
             load its safetensors directory",
            path.display(),
            family.name
        )));
    };
    let reader = BufReader::new(File::open(path).map_err(io_err(path))?);
    let mut r = GgufReader {
        content: &content,
        reader,
        prefix: arch_name,
    };
    gguf(&mut r, arch, world)
}

/// The unsigned integer `key` of a config.json, for every family's parser.
pub(crate) fn json_usize(cfg: &serde_json::Value, key: &str) -> Result<usize> {
    cfg.get(key)
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .ok_or_else(|| VerifyError::MissingMetadata(format!("config.json: {key}")))
}

/// Parses a Hugging Face config.json (llama, qwen2 or the DeepSeek-V3
/// family, by its `model_type`).
pub fn config_from_hf_json(cfg: &serde_json::Value) -> Result<ModelConfig> {
    let arch_name = cfg
        .get("model_type")
        .and_then(|v| v.as_str())
        .ok_or_else(|| VerifyError::MissingMetadata("config.json: model_type".into()))?;
    let arch = Arch::from_name(arch_name)?;
    (family(arch).hf_config)(cfg, arch)
}

/// Reads and parses `config.json` of a Hugging Face directory.
fn read_hf_config(dir: &Path) -> Result<(serde_json::Value, ModelConfig)> {
    let cfg_path = dir.join("config.json");
    let raw = std::fs::read_to_string(&cfg_path).map_err(io_err(&cfg_path))?;
    let json: serde_json::Value = serde_json::from_str(&raw)
        .map_err(|e| VerifyError::BadConfig(format!("{}: {e}", cfg_path.display())))?;
    let cfg = config_from_hf_json(&json)?;
    Ok((json, cfg))
}

/// Reads `config.json` of a Hugging Face directory and maps its weights.
fn read_hf_dir(dir: &Path) -> Result<(serde_json::Value, ModelConfig, SafetensorsWeights)> {
    let (json, cfg) = read_hf_config(dir)?;
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
    let (json, cfg, weights) = read_hf_dir(dir)?;
    match family(cfg.arch).safetensors_shard {
        Some(load) => load(&json, &weights, cfg, comm),
        None => Err(VerifyError::BadConfig(format!(
            "sharded safetensors loading serves the DeepSeek-V3 family and Kimi K3, not {:?}",
            cfg.arch
        ))),
    }
}

/// Loads one rank's shard of a `.gguf` file (Kimi K3) or a safetensors
/// directory (the DeepSeek-V3 family, Kimi K3) for `comm`'s group, whose
/// other ranks load theirs (ranks run as processes: each reads only its
/// own shard's bytes of the memory-mapped files). The model holds one
/// rank: rank 0 leads ([`Model::lead`]), the others serve
/// ([`super::serve_worker`]).
///
/// Errors: those of [`load_safetensors_shard`] and [`load_gguf`], or a
/// family without a lone-rank loader (llama, qwen2).
pub fn load_model_shard(path: &Path, comm: Box<dyn Communicator>) -> Result<Model> {
    if path.is_dir() {
        return load_safetensors_shard(path, comm);
    }
    let raw = Gguf::open(path)?;
    let arch = match raw.metadata.get("general.architecture") {
        Some(gguf_file::Value::String(a)) => Arch::from_name(a)?,
        _ => return Err(VerifyError::MissingMetadata("general.architecture".into())),
    };
    match family(arch).gguf_raw_shard {
        Some(load) => {
            raw.prefault();
            load(&raw, comm)
        }
        None => Err(VerifyError::BadConfig(format!(
            "{}: one rank of a {} GGUF cannot be loaded alone; load a safetensors \
             directory (DeepSeek-V3 family) or a Kimi K3 file",
            path.display(),
            family(arch).name
        ))),
    }
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
    let (json, cfg) = read_hf_config(dir)?;
    if let Some(load) = family(cfg.arch).weightless {
        return load(&json, world);
    }
    let weights = SafetensorsWeights::open(dir)?;
    (family(cfg.arch).safetensors)(&json, &weights, cfg, world)
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

/// Parses a config.json whose `model_type` is the given `Arch`.
type HfConfigFn = fn(&serde_json::Value, Arch) -> Result<ModelConfig>;
/// Loads a safetensors directory (config.json, parsed config, mapped
/// weights) sharded over `world` ranks the model runs itself.
type SafetensorsFn =
    fn(&serde_json::Value, &SafetensorsWeights, ModelConfig, usize) -> Result<Model>;
/// Loads one rank of a group its caller drives (its communicator given).
type SafetensorsShardFn = fn(
    &serde_json::Value,
    &SafetensorsWeights,
    ModelConfig,
    Box<dyn Communicator>,
) -> Result<Model>;
/// Loads one rank of a group its caller drives from a GGUF file.
type GgufRawShardFn = fn(&Gguf, Box<dyn Communicator>) -> Result<Model>;
/// Loads a GGUF file of the given `Arch` sharded over `world` ranks.
type GgufFn = fn(&mut GgufReader, Arch, usize) -> Result<Model>;
/// Loads a GGUF file read by [`Gguf`] (any tensor type) over `world` ranks.
type GgufRawFn = fn(&Gguf, usize) -> Result<Model>;
/// Loads a model that has no weights from its config.json over `world` ranks.
type WeightlessFn = fn(&serde_json::Value, usize) -> Result<Model>;

/// One family's loaders, as [`family`] hands them out.
struct Family {
    /// The family's name in errors.
    name: &'static str,
    hf_config: HfConfigFn,
    safetensors: SafetensorsFn,
    /// `None`: the family loads no lone rank.
    safetensors_shard: Option<SafetensorsShardFn>,
    /// `None`: the family has no GGUF layout.
    gguf: Option<GgufFn>,
    /// The family's GGUF loader over [`Gguf`] instead of candle's reader.
    gguf_raw: Option<GgufRawFn>,
    /// Its lone-rank form (`None`: no lone rank from GGUF).
    gguf_raw_shard: Option<GgufRawShardFn>,
    /// Set for a family without weights: a directory is its config.json
    /// alone (no safetensors are opened).
    weightless: Option<WeightlessFn>,
}

/// The loader's ONE dispatch from an architecture to its family: a new
/// family is one more arm here (and one in `mod.rs`'s `Body`).
fn family(arch: Arch) -> Family {
    match arch {
        Arch::Llama | Arch::Qwen2 => Family {
            name: "llama",
            hf_config: llama::config_from_hf_json,
            safetensors: llama::load_safetensors,
            safetensors_shard: None,
            gguf: Some(llama::load_gguf),
            gguf_raw: None,
            gguf_raw_shard: None,
            weightless: None,
        },
        Arch::DeepseekV3 => Family {
            name: "DeepSeek-V3",
            hf_config: |json, _| deepseek::config_from_hf_json(json),
            safetensors: |_, weights, cfg, world| deepseek::load(weights, cfg, comms(world)?),
            safetensors_shard: Some(|_, weights, cfg, comm| {
                deepseek::load(weights, cfg, vec![comm])
            }),
            gguf: None,
            gguf_raw: None,
            gguf_raw_shard: None,
            weightless: None,
        },
        Arch::KimiK3 => Family {
            name: "Kimi K3",
            hf_config: |json, _| kimi_k3::config_from_hf_json(json).map(|(cfg, _)| cfg),
            safetensors: |json, weights, _, world| {
                let (cfg, k3) = kimi_k3::config_from_hf_json(json)?;
                kimi_k3::load_hf(weights, cfg, k3, comms(world)?)
            },
            safetensors_shard: Some(|json, weights, _, comm| {
                let (cfg, k3) = kimi_k3::config_from_hf_json(json)?;
                kimi_k3::load_hf(weights, cfg, k3, vec![comm])
            }),
            gguf: None,
            gguf_raw: Some(|g, world| kimi_k3::load_gguf(g, comms(world)?)),
            gguf_raw_shard: Some(|g, comm| kimi_k3::load_gguf(g, vec![comm])),
            weightless: None,
        },
        Arch::Scripted => Family {
            name: "scripted",
            hf_config: |json, _| scripted::config_from_hf_json(json).map(|(cfg, _)| cfg),
            safetensors: |json, _, _, world| scripted::load(json, world),
            safetensors_shard: None,
            gguf: None,
            gguf_raw: None,
            gguf_raw_shard: None,
            weightless: Some(scripted::load),
        },
    }
}

/// The communicators of `world` ranks run in this process, in rank order.
///
/// Errors: `world` 0, or a thread group that cannot be made.
fn comms(world: usize) -> Result<Vec<Box<dyn Communicator>>> {
    Ok(match world {
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
    })
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
