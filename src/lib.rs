//! specgate: an OpenAI-compatible LLM serving gateway built around speculative decoding.

pub mod api;
pub mod chat_format;
pub mod cli;
pub mod config;
pub mod distributed;
pub mod engine;
pub mod generate;
pub mod grammar;
pub mod http;
pub mod kv;
pub mod logging;
pub mod metrics;
pub mod router;
pub mod server;
pub mod spec;
pub mod tokenizer;
