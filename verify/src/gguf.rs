//! A GGUF container reader that knows every tensor type id: header,
//! metadata (as candle's [`Value`], so metadata consumers share one type)
//! and tensor directory, with tensor bytes served as views of one read-only
//! memory mapping of the file ([`Bytes`]): nothing is copied or decoded
//! until a loader asks, and a weight kept in its file format stays a view.
//!
//! candle's reader rejects a file as soon as one tensor has a type it does
//! not know (MXFP4, id 39, which llama.cpp writes for Kimi K3's routed
//! experts), so families whose files carry such tensors read them here.

use crate::error::{Result, VerifyError};
use crate::kernels::bytes::Bytes;
use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// ggml type ids this crate names.
pub mod types {
    pub const F32: u32 = 0;
    pub const F16: u32 = 1;
    pub const Q4_0: u32 = 2;
    pub const Q4_1: u32 = 3;
    pub const Q5_0: u32 = 6;
    pub const Q5_1: u32 = 7;
    pub const Q8_0: u32 = 8;
    pub const Q2_K: u32 = 10;
    pub const Q3_K: u32 = 11;
    pub const Q4_K: u32 = 12;
    pub const Q5_K: u32 = 13;
    pub const Q6_K: u32 = 14;
    pub const BF16: u32 = 30;
    pub const MXFP4: u32 = 39;
}

/// `(values per block, bytes per block)` of a ggml type id, for the types
/// whose layout this reader knows (ggml's `type_traits` table).
pub fn block_layout(dtype: u32) -> Option<(usize, usize)> {
    use types::*;
    Some(match dtype {
        F32 => (1, 4),
        F16 | BF16 => (1, 2),
        Q4_0 => (32, 18),
        Q4_1 => (32, 20),
        Q5_0 => (32, 22),
        Q5_1 => (32, 24),
        Q8_0 => (32, 34),
        Q2_K => (256, 84),
        Q3_K => (256, 110),
        Q4_K => (256, 144),
        Q5_K => (256, 176),
        Q6_K => (256, 210),
        MXFP4 => (32, 17),
        _ => return None,
    })
}

/// One tensor's directory entry.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Dimensions in ggml order (`dims[0]` varies fastest).
    pub dims: Vec<usize>,
    /// ggml type id (0 F32, 1 F16, 30 BF16, 39 MXFP4, ...).
    pub dtype: u32,
    /// Offset from the start of the data section.
    pub offset: u64,
}

/// candle's dtype for a block-quantized ggml type id (`None`: not one).
pub fn candle_dtype(t: u32) -> Option<candle_core::quantized::GgmlDType> {
    use candle_core::quantized::GgmlDType as G;
    use types::*;
    Some(match t {
        Q4_0 => G::Q4_0,
        Q4_1 => G::Q4_1,
        Q5_0 => G::Q5_0,
        Q5_1 => G::Q5_1,
        Q8_0 => G::Q8_0,
        Q2_K => G::Q2K,
        Q3_K => G::Q3K,
        Q4_K => G::Q4K,
        Q5_K => G::Q5K,
        Q6_K => G::Q6K,
        _ => return None,
    })
}

/// A GGUF file's metadata, tensor directory and read-only mapping.
///
/// Invariant: the mapping is never written; a file replaced or truncated
/// by another process while mapped is outside what a served model may see.
pub struct Gguf {
    path: PathBuf,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    data_start: u64,
    map: Arc<memmap2::Mmap>,
}

fn bad(path: &Path, what: impl std::fmt::Display) -> VerifyError {
    VerifyError::BadConfig(format!(
        "{} is not a readable GGUF file: {what}",
        path.display()
    ))
}

struct Cursor<R> {
    r: R,
}

impl<R: Read> Cursor<R> {
    fn bytes<const N: usize>(&mut self) -> std::io::Result<[u8; N]> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b)?;
        Ok(b)
    }
    fn u32(&mut self) -> std::io::Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> std::io::Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn string(&mut self) -> std::io::Result<String> {
        let n = self.u64()? as usize;
        if n > 1 << 30 {
            return Err(std::io::Error::other(format!("string of {n} bytes")));
        }
        let mut b = vec![0u8; n];
        self.r.read_exact(&mut b)?;
        String::from_utf8(b).map_err(std::io::Error::other)
    }
    fn value(&mut self, ty: u32, depth: usize) -> std::io::Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.bytes::<1>()?[0]),
            1 => Value::I8(self.bytes::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => Value::Bool(self.bytes::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 if depth == 0 => {
                let inner = self.u32()?;
                let n = self.u64()? as usize;
                if n > 1 << 28 {
                    return Err(std::io::Error::other(format!("array of {n} items")));
                }
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            t => return Err(std::io::Error::other(format!("metadata value type {t}"))),
        })
    }
}

impl Gguf {
    /// Reads the header, metadata and tensor directory of `path`.
    ///
    /// Errors: unreadable file, wrong magic, unsupported version (1), or a
    /// malformed header, each naming the file.
    pub fn open(path: &Path) -> Result<Self> {
        let f = File::open(path).map_err(|source| VerifyError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: read-only mapping, never written (see the type's
        // invariant).
        let map =
            Arc::new(
                unsafe { memmap2::Mmap::map(&f) }.map_err(|source| VerifyError::Io {
                    path: path.to_path_buf(),
                    source,
                })?,
            );
        let mut c = Cursor {
            r: BufReader::new(f),
        };
        let e = |x: std::io::Error| bad(path, x);
        if &c.bytes::<4>().map_err(e)? != b"GGUF" {
            return Err(bad(path, "wrong magic"));
        }
        let version = c.u32().map_err(e)?;
        if !(2..=3).contains(&version) {
            return Err(bad(path, format!("version {version}")));
        }
        let n_tensors = c.u64().map_err(e)?;
        let n_kv = c.u64().map_err(e)?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string().map_err(e)?;
            let ty = c.u32().map_err(e)?;
            let v = c.value(ty, 0).map_err(e)?;
            metadata.insert(key, v);
        }
        let mut tensors = HashMap::new();
        for _ in 0..n_tensors {
            let name = c.string().map_err(e)?;
            let nd = c.u32().map_err(e)? as usize;
            if nd > 8 {
                return Err(bad(path, format!("tensor {name} has {nd} dimensions")));
            }
            let dims = (0..nd)
                .map(|_| c.u64().map(|d| d as usize))
                .collect::<std::io::Result<Vec<_>>>()
                .map_err(e)?;
            let dtype = c.u32().map_err(e)?;
            let offset = c.u64().map_err(e)?;
            tensors.insert(
                name,
                TensorInfo {
                    dims,
                    dtype,
                    offset,
                },
            );
        }
        let align = match metadata.get("general.alignment") {
            Some(Value::U32(a)) if *a > 0 => *a as u64,
            _ => 32,
        };
        let pos = c.r.stream_position().map_err(e)?;
        let data_start = pos.div_ceil(align) * align;
        Ok(Self {
            path: path.to_path_buf(),
            metadata,
            tensors,
            data_start,
            map,
        })
    }

    /// The mapping of the whole file (for madvise and accounting).
    pub fn mapping(&self) -> &Arc<memmap2::Mmap> {
        &self.map
    }

    /// Faults the whole file into this process's page tables now, as
    /// llama.cpp's loader does (`MAP_POPULATE`): a model that reads its
    /// weights from the mapping then pays for the pages at load, not in its
    /// first decode steps (each expert's first use otherwise took thousands
    /// of page faults mid-request). Best effort: a kernel without
    /// `MADV_POPULATE_READ` (before Linux 5.14) gets a read-ahead hint.
    pub fn prefault(&self) {
        #[cfg(target_os = "linux")]
        if self.map.advise(memmap2::Advice::PopulateRead).is_ok() {
            return;
        }
        #[cfg(unix)]
        let _ = self.map.advise(memmap2::Advice::WillNeed);
    }

    /// Tensor `name`'s directory entry and its bytes as a view of the
    /// mapping, its length computed from its type and dims.
    ///
    /// Errors: no such tensor, a type whose layout is unknown, a row length
    /// that is not whole blocks, or bytes past the end of the file.
    pub fn tensor(&self, name: &str) -> Result<(TensorInfo, Bytes)> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| VerifyError::MissingTensor(name.to_string()))?;
        let (blk, bb) = block_layout(info.dtype).ok_or_else(|| {
            VerifyError::BadConfig(format!(
                "{}: tensor {name} has ggml type {}, whose layout this reader does not know",
                self.path.display(),
                info.dtype
            ))
        })?;
        let row = info.dims.first().copied().unwrap_or(1);
        if !row.is_multiple_of(blk) {
            return Err(bad(
                &self.path,
                format!("tensor {name}: rows of {row} are not whole blocks of {blk}"),
            ));
        }
        let n: usize = info.dims.iter().product();
        let (_, b) = self.raw(name, n / blk * bb)?;
        Ok((info.clone(), b))
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of tensor `name`, `len` bytes long (the caller knows its
    /// type's size), as a view of the mapping.
    ///
    /// Errors: no such tensor, or bytes past the end of the file.
    pub fn raw(&self, name: &str, len: usize) -> Result<(TensorInfo, Bytes)> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| VerifyError::MissingTensor(name.to_string()))?
            .clone();
        let start = (self.data_start + info.offset) as usize;
        let b = start
            .checked_add(len)
            .and_then(|end| Bytes::mapped(self.map.clone(), start..end))
            .ok_or_else(|| {
                bad(
                    &self.path,
                    format!("tensor {name}: {len} bytes at {start} pass the end of the file"),
                )
            })?;
        Ok((info, b))
    }

    /// Tensor `name` decoded to f32 (F32, F16, BF16, MXFP4 and the ggml
    /// block formats), with its ggml-order dims.
    ///
    /// Errors: no such tensor, another type, or a short file.
    pub fn f32_tensor(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| VerifyError::MissingTensor(name.to_string()))?;
        let n: usize = info.dims.iter().product();
        if let Some(dtype) = candle_dtype(info.dtype) {
            // Small tensors a loader needs whole (a quantized GGUF's k_b / v_b).
            let (info, b) = self.tensor(name)?;
            let dims: Vec<usize> = info.dims.iter().rev().copied().collect();
            let cpu = candle_core::Device::Cpu;
            let q = candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, &b, dims, &cpu)?;
            let v = q.dequantize(&cpu)?.flatten_all()?.to_vec1::<f32>()?;
            return Ok((info.dims, v));
        }
        let len = match info.dtype {
            0 => n * 4,
            1 | 30 => n * 2,
            crate::kernels::mxfp4::GGML_TYPE_MXFP4 => n / 32 * crate::kernels::mxfp4::BLOCK_BYTES,
            t => {
                return Err(VerifyError::BadConfig(format!(
                "{}: tensor {name} has ggml type {t}; this reader decodes F32, F16, BF16, MXFP4 and the ggml block formats",
                self.path.display()
            )))
            }
        };
        let (info, b) = self.raw(name, len)?;
        let v = match info.dtype {
            0 => b
                .chunks_exact(4)
                .map(|x| f32::from_le_bytes(x.try_into().unwrap()))
                .collect(),
            1 => b
                .chunks_exact(2)
                .map(|x| half::f16::from_le_bytes([x[0], x[1]]).to_f32())
                .collect(),
            30 => b
                .chunks_exact(2)
                .map(|x| half::bf16::from_le_bytes([x[0], x[1]]).to_f32())
                .collect(),
            _ => crate::kernels::mxfp4::decode_ggml(&b, n)
                .map_err(|m| VerifyError::BadConfig(format!("{name}: {m}")))?,
        };
        Ok((info.dims, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::mxfp4::{decode_ggml, GGML_TYPE_MXFP4};

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    /// A GGUF v3 file: metadata of several types (an array among them), an
    /// F32 tensor and an MXFP4 one (which candle's reader rejects).
    fn file() -> (PathBuf, Vec<u8>) {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(2u64.to_le_bytes()); // tensors
        b.extend(4u64.to_le_bytes()); // metadata
        string(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        string(&mut b, "kimi-k3");
        string(&mut b, "kimi-k3.block_count");
        b.extend(4u32.to_le_bytes());
        b.extend(8u32.to_le_bytes());
        string(&mut b, "kimi-k3.kda.gate_lower_bound");
        b.extend(6u32.to_le_bytes());
        b.extend((-5f32).to_le_bytes());
        string(&mut b, "kimi-k3.attention.head_count_kv");
        b.extend(9u32.to_le_bytes());
        b.extend(4u32.to_le_bytes()); // of u32
        b.extend(3u64.to_le_bytes());
        for v in [0u32, 0, 1] {
            b.extend(v.to_le_bytes());
        }
        string(&mut b, "w");
        b.extend(2u32.to_le_bytes());
        b.extend(3u64.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(0u64.to_le_bytes());
        string(&mut b, "e");
        b.extend(1u32.to_le_bytes());
        b.extend(32u64.to_le_bytes());
        b.extend(GGML_TYPE_MXFP4.to_le_bytes());
        b.extend(32u64.to_le_bytes()); // after the 24 bytes of `w`, aligned
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        let mut data: Vec<u8> = (0..6)
            .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
            .collect();
        data.resize(32, 0);
        let block: Vec<u8> = std::iter::once(127u8)
            .chain((0..16).map(|j| j as u8 * 17))
            .collect();
        data.extend(&block);
        b.extend(&data);
        let path = std::env::temp_dir().join(format!("specgate-gguf-{}.gguf", std::process::id()));
        std::fs::write(&path, &b).unwrap();
        (path, block)
    }

    #[test]
    fn reads_metadata_and_decodes_f32_and_mxfp4_tensors() {
        let (path, block) = file();
        let g = Gguf::open(&path).unwrap();
        assert!(matches!(&g.metadata["general.architecture"], Value::String(s) if s == "kimi-k3"));
        assert!(matches!(g.metadata["kimi-k3.block_count"], Value::U32(8)));
        assert!(matches!(g.metadata["kimi-k3.kda.gate_lower_bound"], Value::F32(x) if x == -5.0));
        match &g.metadata["kimi-k3.attention.head_count_kv"] {
            Value::Array(a) => assert_eq!(a.len(), 3),
            other => panic!("{other:?}"),
        }
        let (dims, w) = g.f32_tensor("w").unwrap();
        assert_eq!(dims, vec![3, 2]);
        assert_eq!(w, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        let (dims, e) = g.f32_tensor("e").unwrap();
        assert_eq!(dims, vec![32]);
        assert_eq!(e, decode_ggml(&block, 32).unwrap());
        assert!(matches!(
            g.f32_tensor("nope"),
            Err(VerifyError::MissingTensor(_))
        ));
        std::fs::remove_file(&path).unwrap();
        // Not GGUF at all: an error naming the file, not a panic.
        let bad = std::env::temp_dir().join(format!("specgate-notgguf-{}", std::process::id()));
        std::fs::write(&bad, b"GGUX\x03\x00\x00\x00").unwrap();
        let err = Gguf::open(&bad).err().unwrap().to_string();
        assert!(err.contains("specgate-notgguf"), "{err}");
        std::fs::remove_file(&bad).unwrap();
    }
}
