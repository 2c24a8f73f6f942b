//! The wire formats: OpenAI's (chat completions, completions, and the
//! Responses API in [`responses`]) and Anthropic's Messages API
//! ([`anthropic`]), each parsed and validated into the one
//! [`ValidRequest`]; response bodies and error bodies (both APIs' shapes). Serde and plain data only; nothing here knows about HTTP
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
//! - [`tool_calls`]: tool calls parsed out of generated text (whole and
//!   streaming).
//! - [`parse_tokenize`] / [`parse_detokenize`] and their responses: vLLM's
//!   `POST /tokenize` and `POST /detokenize`.
//!
//! The wire types here are the API's own: no engine type appears in them
//! (the `http` module maps between the two).

pub mod anthropic;
#[cfg(test)]
mod corpus_tests;
mod error;
mod json;
mod knobs;
mod messages;
mod prompt;
mod request;
#[cfg(test)]
mod request_tests;
mod response;
#[cfg(test)]
mod response_tests;
pub mod responses;
mod responses_input;
mod sampling;
mod tokenize;
pub mod tool_calls;
mod tools;
#[cfg(test)]
mod tools_tests;

pub use error::{ApiError, ErrorKind};
pub use json::RawJson;
pub use knobs::{ChatKnobs, REASONING_EFFORTS, RESERVED_TEMPLATE_VARS};
pub use request::{
    parse_chat, parse_completion, Input, RequestMeta, SpecMethod, SpecOverride, ValidRequest,
    COMPLETION_DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, KNOWN_CHAT_FIELDS, KNOWN_COMPLETION_FIELDS,
    MAX_CACHE_SALT, MAX_SPECULATIVE_TOKENS, MAX_STOP_BYTES, MAX_STOP_SEQUENCES, MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
};
pub use response::{
    unix_now, AssistantMessage, BuildInfo, ChatChoice, ChatCompletion, ChatCompletionChunk,
    ChatLogprobs, ChatTokenLogprob, ChunkChoice, Completion, CompletionChoice, CompletionChunk,
    CompletionLogprobs, Delta, FinishReason, FunctionCall, FunctionDelta, ModelCard, ModelList,
    ModelSpeculative, ToolCall, ToolCallDelta, TopLogprob, TopMap, Usage, VersionInfo,
};
pub use sampling::{
    GREEDY_TEMPERATURE, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_PENALTY,
    MAX_REPETITION_PENALTY, MAX_STOP_TOKEN_IDS, MIN_REPETITION_PENALTY,
};
pub use tokenize::{
    parse_detokenize, parse_tokenize, DetokenizeRequest, DetokenizeResponse, TokenizeInput,
    TokenizeRequest, TokenizeResponse,
};
pub use tools::{ResponseFormat, Tool, ToolChoice, ToolSetup, MAX_TOOLS};
