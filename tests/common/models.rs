//! Where the real weights are: the one models-directory lookup of the
//! workspace's tests and benches (scripts/fetch-models.sh fills it). The
//! root package's tests reach it through `mod common`; benches/*.rs and
//! verify/tests include this file by `#[path]`, so it depends on std only.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The models directory: `$SPECGATE_MODELS_DIR` when set, else `models/`
/// in the workspace root, whichever crate of the workspace asks (a member's
/// own directory has no `models/`). The directory need not exist.
pub fn models_dir() -> PathBuf {
    match std::env::var_os("SPECGATE_MODELS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => workspace_root().join("models"),
    }
}

/// The nearest ancestor of the compiling crate's manifest directory whose
/// Cargo.toml declares `[workspace]` (the crate's own directory when none
/// does, as for a crate built outside this workspace).
fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|dir| {
            std::fs::read_to_string(dir.join("Cargo.toml"))
                .is_ok_and(|text| text.lines().any(|l| l.trim() == "[workspace]"))
        })
        .unwrap_or(manifest)
        .to_path_buf()
}

/// `name` in the models directory, or `None` with a note on stderr when it
/// is not there: tests and benches on real weights skip rather than fail
/// on a machine without them.
pub fn real_model(name: &str) -> Option<PathBuf> {
    let p = models_dir().join(name);
    if p.exists() {
        Some(p)
    } else {
        eprintln!(
            "skipping: {} not present (run scripts/fetch-models.sh)",
            p.display()
        );
        None
    }
}
