//! [`SafetensorsWeights`]: the memory-mapped safetensors of a Hugging Face
//! directory (one `model.safetensors`, or the sharded files that
//! `model.safetensors.index.json` names), read one tensor, or one rank's
//! rows of it, at a time.

use crate::error::{Result, VerifyError};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::io_err;

/// The single-file weights of a Hugging Face directory.
pub(crate) const SAFETENSORS_FILE: &str = "model.safetensors";
/// The index of sharded weights: its `weight_map` maps each tensor name to
/// the file (in the same directory) that holds it.
pub(crate) const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

/// The memory-mapped safetensors weights of one Hugging Face directory.
///
/// Every read copies exactly the asked-for bytes out of the mapping and
/// converts them to f32; nothing else of the files is touched. Invariant:
/// the mapping is only read while a model loads (the loaders drop this
/// value before returning), so a file replaced afterwards cannot change a
/// loaded model.
pub(crate) struct SafetensorsWeights {
    st: MmapedSafetensors,
    /// The file or index the tensors come from, for errors.
    source: PathBuf,
}

impl SafetensorsWeights {
    /// Maps `dir/model.safetensors.index.json`'s files when the index
    /// exists, else `dir/model.safetensors`.
    ///
    /// Errors: [`VerifyError::Io`] naming a missing or unreadable file,
    /// [`VerifyError::BadConfig`] naming a malformed index or a file that is
    /// not safetensors.
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let index = dir.join(SAFETENSORS_INDEX);
        let (files, source) = match std::fs::read_to_string(&index) {
            Ok(text) => (index_files(dir, &index, &text)?, index),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let single = dir.join(SAFETENSORS_FILE);
                (vec![single.clone()], single)
            }
            Err(e) => return Err(io_err(&index)(e)),
        };
        for f in &files {
            std::fs::metadata(f).map_err(io_err(f))?;
        }
        let bad = |e: candle_core::Error| {
            VerifyError::BadConfig(format!(
                "{}: not readable safetensors: {e}",
                source.display()
            ))
        };
        // SAFETY: the mapping is read-only and read only while loading (see
        // the type's invariant); what memmap2 cannot rule out is another
        // process truncating a file meanwhile, which a model directory being
        // served must not see anyway.
        let st = unsafe {
            if files.len() == 1 {
                MmapedSafetensors::new(&files[0])
            } else {
                MmapedSafetensors::multi(&files)
            }
        }
        .map_err(bad)?;
        Ok(Self { st, source })
    }

    /// The tensor's bytes in the mapping and its dtype, its shape checked
    /// against `shape` (reading the header only).
    pub(crate) fn raw(&self, name: &str, shape: &[usize]) -> Result<(&[u8], DType)> {
        let view = self
            .st
            .get(name)
            .map_err(|_| VerifyError::MissingTensor(name.to_string()))?;
        if view.shape() != shape {
            return Err(VerifyError::BadTensorShape {
                name: name.to_string(),
                got: view.shape().to_vec(),
                expected: shape.to_vec(),
            });
        }
        let dtype = DType::try_from(view.dtype()).map_err(|e| {
            VerifyError::BadConfig(format!(
                "{}: tensor '{name}' has an unsupported dtype: {e}",
                self.source.display()
            ))
        })?;
        Ok((view.data(), dtype))
    }

    /// The bytes of the `u8` tensor `name` of `shape` (packed formats such
    /// as MXFP4), borrowed from the mapping.
    ///
    /// Errors: as [`tensor`](Self::tensor), and another dtype than `u8`.
    pub(crate) fn bytes(&self, name: &str, shape: &[usize]) -> Result<&[u8]> {
        let (data, dtype) = self.raw(name, shape)?;
        if dtype != DType::U8 {
            return Err(VerifyError::BadConfig(format!(
                "{}: tensor '{name}' is {dtype:?}, expected packed u8",
                self.source.display()
            )));
        }
        Ok(data)
    }

    /// Drops this process's resident pages of bytes `range` of tensor
    /// `name`, whose contents the caller has copied out (HF weights are
    /// repacked or sliced into owned memory at load): read pages of the
    /// mapping count in the RSS until unmapped, so a checkpoint loaded as
    /// copies would otherwise peak at twice its size. A missing tensor or a
    /// range past its end releases nothing.
    pub(crate) fn release(&self, name: &str, range: Range<usize>) {
        if let Some(part) = self.st.get(name).ok().and_then(|v| v.data().get(range)) {
            // SAFETY: `part` is a slice of candle's read-only mapping of the
            // safetensors files, which nothing writes.
            unsafe { crate::kernels::bytes::release_file_pages(part) }
        }
    }

    /// The shape of tensor `name`, or `None` when the files lack it.
    pub(crate) fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.st.get(name).ok().map(|v| v.shape().to_vec())
    }

    /// Checks that `name` exists with `shape` without reading its data.
    ///
    /// Errors: [`VerifyError::MissingTensor`], [`VerifyError::BadTensorShape`].
    pub(crate) fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.raw(name, shape).map(|_| ())
    }

    /// The whole tensor `name` as f32.
    ///
    /// Errors: [`VerifyError::MissingTensor`], [`VerifyError::BadTensorShape`],
    /// or a dtype candle cannot convert.
    pub(crate) fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let (data, dtype) = self.raw(name, shape)?;
        let t = to_f32(data, dtype, shape);
        self.release(name, 0..data.len());
        t
    }

    /// Rows `rows` of the `[out, inp]` matrix `name` as an f32
    /// `[rows.len(), inp]` tensor; only those rows' bytes are read.
    ///
    /// Errors: as [`tensor`](Self::tensor), and a range past `out`.
    pub(crate) fn rows(
        &self,
        name: &str,
        (out, inp): (usize, usize),
        rows: Range<usize>,
    ) -> Result<Tensor> {
        let (data, dtype) = self.raw(name, &[out, inp])?;
        check_range(name, &rows, out)?;
        let row = inp * dtype.size_in_bytes();
        let t = to_f32(
            &data[rows.start * row..rows.end * row],
            dtype,
            &[rows.len(), inp],
        );
        self.release(name, rows.start * row..rows.end * row);
        t
    }
}

fn check_range(name: &str, r: &Range<usize>, n: usize) -> Result<()> {
    if r.start > r.end || r.end > n {
        return Err(VerifyError::BadConfig(format!(
            "tensor '{name}': range {r:?} outside its {n} rows or columns"
        )));
    }
    Ok(())
}

/// The files `model.safetensors.index.json` names, sorted, each once.
fn index_files(dir: &Path, index: &Path, text: &str) -> Result<Vec<PathBuf>> {
    let bad = |m: &str| VerifyError::BadConfig(format!("{}: {m}", index.display()));
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(&format!("not valid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object"))?;
    let mut files = std::collections::BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(&format!("`weight_map` entry '{tensor}' is not a file name")))?;
        // The files live beside the index: a path that leaves the directory
        // is refused rather than followed.
        let plain = Path::new(file)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !plain {
            return Err(bad(&format!(
                "`weight_map` file '{file}' is not a plain file name"
            )));
        }
        files.insert(dir.join(file));
    }
    if files.is_empty() {
        return Err(bad("`weight_map` is empty"));
    }
    Ok(files.into_iter().collect())
}

/// `bytes` (`dtype`, row-major `shape`) as an f32 tensor.
fn to_f32(bytes: &[u8], dtype: DType, shape: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_raw_buffer(bytes, dtype, shape, &Device::Cpu)?.to_dtype(DType::F32)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::TinySpec;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("specgate-st-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn rows_and_cols_read_the_slice_in_the_files_dtype() {
        let dir = tmp("slices");
        std::fs::create_dir_all(&dir).unwrap();
        let full = Tensor::arange(0f32, 60., &Device::Cpu)
            .unwrap()
            .reshape((6, 10))
            .unwrap();
        let tensors: std::collections::HashMap<&str, Tensor> = [
            ("w.bf16", full.to_dtype(DType::BF16).unwrap()),
            ("w.f16", full.to_dtype(DType::F16).unwrap()),
            ("w.f32", full.clone()),
        ]
        .into_iter()
        .collect();
        candle_core::safetensors::save(&tensors, dir.join(SAFETENSORS_FILE)).unwrap();
        let st = SafetensorsWeights::open(&dir).unwrap();
        let v2 = |t: Tensor| t.to_vec2::<f32>().unwrap();
        for name in ["w.bf16", "w.f16", "w.f32"] {
            assert_eq!(v2(st.tensor(name, &[6, 10]).unwrap()), v2(full.clone()));
            let r = st.rows(name, (6, 10), 2..5).unwrap();
            assert_eq!(v2(r), v2(full.narrow(0, 2, 3).unwrap()));
        }
        assert!(matches!(
            st.tensor("w.f32", &[10, 6]),
            Err(VerifyError::BadTensorShape { .. })
        ));
        assert!(matches!(
            st.check("nope", &[1]),
            Err(VerifyError::MissingTensor(n)) if n == "nope"
        ));
        assert!(st.rows("w.f32", (6, 10), 4..7).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn broken_index_or_missing_files_name_the_file() {
        let dir = tmp("broken");
        TinySpec::llama(3)
            .write_safetensors_sharded(&dir, 2)
            .unwrap();
        let index = dir.join(SAFETENSORS_INDEX);
        let good = std::fs::read_to_string(&index).unwrap();
        let err = |dir: &Path| match SafetensorsWeights::open(dir) {
            Err(e) => e,
            Ok(_) => panic!("{} opened", dir.display()),
        };
        for bad in [
            "{".to_string(),
            r#"{"weight_map": {}}"#.into(),
            r#"{"weight_map": {"a": "../model.safetensors"}}"#.into(),
            r#"{"weight_map": {"a": 3}}"#.into(),
        ] {
            std::fs::write(&index, &bad).unwrap();
            let e = err(&dir);
            assert!(matches!(e, VerifyError::BadConfig(_)), "{bad}: {e}");
            assert!(e.to_string().contains(SAFETENSORS_INDEX), "{e}");
        }
        std::fs::write(&index, &good).unwrap();
        std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
        let e = err(&dir).to_string();
        assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
        std::fs::remove_file(&index).unwrap();
        let e = err(&dir).to_string();
        assert!(e.contains(SAFETENSORS_FILE), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
