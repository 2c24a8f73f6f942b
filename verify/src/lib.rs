//! specgate-verify: the model runtime that scores tokens.
//!
//! Owns weight loading (GGUF and safetensors), the ONE forward pass per
//! architecture family over a paged KV pool, and logits -> probabilities
//! sampling. It knows nothing of HTTP, JSON requests or the config file.

pub mod accept;
pub mod constraint;
pub mod error;
pub mod gguf;
pub mod kernels;
pub mod kv_pool;
pub mod model;
pub mod process;
pub mod sample;
pub mod team;
pub mod tiny;
pub mod tp;
pub mod tree_accept;

pub use constraint::{ConstraintError, ConstraintSource, TokenConstraint, TokenMask};
pub use error::VerifyError;
pub use kv_pool::{CacheDtype, KvLayout, KvPool, TokenRow};
pub use model::{Arch, LogitsWanted, Model, ModelConfig, RopeStyle, SeqInput};
pub use process::{Controls, TokenLogprob};
pub use sample::{Sampler, SamplingParams};
pub use tp::{CommStats, Communicator, LocalComm, ThreadComm};
pub use tree_accept::{accept_tree, accept_tree_greedy, TokenTree, TreeError, TreeVerdict};
