//! specgate: an OpenAI-compatible LLM serving gateway built around speculative decoding.

pub mod engine;
pub mod generate;
pub mod kv;
pub mod spec;
pub mod tokenizer;
