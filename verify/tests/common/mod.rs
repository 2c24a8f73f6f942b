//! Helpers shared by the verify crate's integration tests.

use std::path::{Path, PathBuf};

/// A real GGUF file from the models directory (`SPECGATE_MODELS_DIR`, else
/// the workspace's `models/`), or `None` with a note when
/// scripts/fetch-models.sh has not fetched it.
pub fn real_model(name: &str) -> Option<PathBuf> {
    let dir = std::env::var("SPECGATE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let p = dir.join(name);
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
