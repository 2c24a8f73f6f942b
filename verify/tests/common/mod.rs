//! Helpers shared by the verify crate's integration tests. The models
//! directory lookup is the workspace's one (`SPECGATE_MODELS_DIR`, else
//! `models/` in the workspace root), included from the root package's test
//! support so every crate skips or finds the same files.

#[path = "../../../tests/common/models.rs"]
mod models;

pub use models::real_model;
