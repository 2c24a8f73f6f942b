//! Tiny generated models (specgate_verify::tiny::TinySpec) written as GGUF
//! for the tests: one writer, giving every call a file of its own, so tests
//! running in parallel never read another test's half-written or stale file.

use candle_core::quantized::gguf_file;
use specgate_verify::model::{load_gguf, load_gguf_tp};
use specgate_verify::tiny::TinySpec;
use specgate_verify::Model;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `specgate-<tag>-<pid>` in the system temp directory, created if missing:
/// scratch space private to this test process (a leftover directory of an
/// earlier process with the same pid is reused; writers overwrite).
pub fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specgate-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes `spec` as a GGUF file with the extra metadata `md` (a tokenizer,
/// say) and returns its path: `<n>/<name>` in this process's scratch
/// directory, `n` unique per call (the file keeps `name`, so a server's
/// default model name, the file stem, is `name`'s). Panics when the file
/// cannot be written.
pub fn tiny_gguf(spec: &TinySpec, name: &str, md: &[(&str, gguf_file::Value)]) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let dir = scratch_dir("tiny").join(n.to_string());
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    spec.write_gguf(&p, md).unwrap();
    p
}

/// `spec` written (no extra metadata) and loaded unsharded.
pub fn tiny_model(spec: &TinySpec, name: &str) -> Model {
    load_gguf(&tiny_gguf(spec, name, &[])).unwrap()
}

/// `spec` written (no extra metadata) and loaded sharded over `world`
/// tensor-parallel ranks; panics when it cannot be split `world` ways.
pub fn tiny_model_tp(spec: &TinySpec, name: &str, world: usize) -> Model {
    load_gguf_tp(&tiny_gguf(spec, name, &[]), world).unwrap()
}
