//! The OpenAI wire format: request parsing and validation, response bodies
//! and error bodies. Serde and plain data only; nothing here knows about HTTP
//! transport (the `http` module routes, reads bodies and writes responses).
//!
//! Owns:
//! - [`parse_chat`] / [`parse_completion`]: a raw `POST /v1/chat/completions`
//!   or `POST /v1/completions` body -> [`ValidRequest`], or an [`ApiError`]
//!   whose `param` names the offending field.
//! - [`ApiError`]: the one place an HTTP status code and an OpenAI error body
//!   (`{"error":{"message","type","param","code"}}`) are produced.
//! - Response types ([`ChatCompletion`], [`ChatCompletionChunk`],
//!   [`Completion`], [`CompletionChunk`], [`ModelList`]) that serialize
//!   byte-compatibly with OpenAI's, and [`VersionInfo`].
//! - [`parse_tokenize`] / [`parse_detokenize`] and their responses: vLLM's
//!   `POST /tokenize` and `POST /detokenize`.
//!
//! The wire types here are the API's own: no engine type appears in them
//! (the `http` module maps between the two).

mod error;
mod request;
#[cfg(test)]
mod request_tests;
mod response;
#[cfg(test)]
mod response_tests;
mod tokenize;

pub use error::{ApiError, ErrorKind};
pub use request::{
    parse_chat, parse_completion, Input, SpecMethod, SpecOverride, ValidRequest,
    COMPLETION_DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, MAX_SPECULATIVE_TOKENS, MAX_STOP_BYTES,
    MAX_STOP_SEQUENCES, MAX_TEMPERATURE,
};
pub use response::{
    unix_now, AssistantMessage, BuildInfo, ChatChoice, ChatCompletion, ChatCompletionChunk,
    ChunkChoice, Completion, CompletionChoice, CompletionChunk, Delta, FinishReason, ModelCard,
    ModelList, ModelSpeculative, Usage, VersionInfo,
};
pub use tokenize::{
    parse_detokenize, parse_tokenize, DetokenizeRequest, DetokenizeResponse, TokenizeInput,
    TokenizeRequest, TokenizeResponse,
};
