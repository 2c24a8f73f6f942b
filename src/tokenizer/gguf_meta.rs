//! A GGUF metadata reader for the tokenizer: owns reading a GGUF file's header and
//! key/value section (as candle's [`Value`]s) and nothing after it.
//!
//! candle's `gguf_file::Content::read` also parses the tensor directory and rejects a
//! file as soon as one tensor has a type id it does not know (MXFP4, id 39, which
//! llama.cpp writes for Kimi K3's routed experts), although the tokenizer needs none of
//! it. Supports GGUF versions 2 and 3 (little-endian, 64-bit lengths), as llama.cpp
//! writes them.

use std::io::Read;

use candle_core::quantized::gguf_file::Value;

use super::GgufMetadata;

/// The file magic, `GGUF` read as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// Longest string or array accepted (guards against garbage lengths).
const MAX_LEN: u64 = 1 << 30;
/// Deepest array nesting accepted.
const MAX_DEPTH: usize = 4;

struct Reader<R> {
    r: R,
}

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut b = [0u8; N];
        self.r
            .read_exact(&mut b)
            .map_err(|e| format!("truncated metadata: {e}"))?;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.bytes().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.bytes().map(u64::from_le_bytes)
    }

    fn len(&mut self, what: &str) -> Result<usize, String> {
        let n = self.u64()?;
        if n > MAX_LEN {
            return Err(format!("{what} of length {n} is implausible"));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.len("string")?;
        let mut b = Vec::new();
        (&mut self.r)
            .take(n as u64)
            .read_to_end(&mut b)
            .map_err(|e| format!("truncated metadata: {e}"))?;
        if b.len() != n {
            return Err("truncated metadata string".into());
        }
        String::from_utf8(b).map_err(|_| "a metadata string is not UTF-8".into())
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value, String> {
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
            9 => {
                if depth >= MAX_DEPTH {
                    return Err("metadata arrays nest too deeply".into());
                }
                let elem = self.u32()?;
                let n = self.len("array")?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => return Err(format!("unknown metadata value type {other}")),
        })
    }
}

/// Reads the header and metadata of a GGUF stream positioned at its start.
///
/// Errors: the reason (bad magic, unsupported version, truncation, an unknown value
/// type, implausible lengths), for the caller to name the file with.
pub(crate) fn read_metadata(r: impl Read) -> Result<GgufMetadata, String> {
    let mut r = Reader { r };
    let magic = r.u32()?;
    if magic != MAGIC {
        return Err(format!("not a GGUF file (magic 0x{magic:08x})"));
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(format!("unsupported GGUF version {version}"));
    }
    let _tensor_count = r.u64()?;
    let kv_count = r.u64()?;
    if kv_count > MAX_LEN {
        return Err(format!("{kv_count} metadata entries is implausible"));
    }
    let mut md = GgufMetadata::new();
    for _ in 0..kv_count {
        let key = r.string()?;
        let ty = r.u32()?;
        let value = r.value(ty, 0)?;
        md.insert(key, value);
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv_string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    #[test]
    fn reads_scalars_strings_and_arrays_and_stops_before_tensors() {
        let mut f = Vec::new();
        f.extend(MAGIC.to_le_bytes());
        f.extend(3u32.to_le_bytes());
        f.extend(1u64.to_le_bytes()); // one tensor, whose info is garbage below
        f.extend(3u64.to_le_bytes());
        kv_string(&mut f, "a.u32");
        f.extend(4u32.to_le_bytes());
        f.extend(7u32.to_le_bytes());
        kv_string(&mut f, "a.str");
        f.extend(8u32.to_le_bytes());
        kv_string(&mut f, "héllo");
        kv_string(&mut f, "a.arr");
        f.extend(9u32.to_le_bytes());
        f.extend(8u32.to_le_bytes());
        f.extend(2u64.to_le_bytes());
        kv_string(&mut f, "x");
        kv_string(&mut f, "y z");
        f.extend([0xff; 16]);
        let md = read_metadata(f.as_slice()).unwrap();
        assert!(matches!(md["a.u32"], Value::U32(7)));
        assert!(matches!(&md["a.str"], Value::String(s) if s == "héllo"));
        match &md["a.arr"] {
            Value::Array(v) => assert_eq!(v.len(), 2),
            other => panic!("{other:?}"),
        }
        for cut in [3, 10, 30, f.len() - 20] {
            assert!(read_metadata(&f[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = f.clone();
        bad[0] = b'X';
        assert!(read_metadata(bad.as_slice()).unwrap_err().contains("magic"));
    }
}
