//! Response bodies, serialized byte-compatibly with OpenAI: field order as
//! OpenAI sends it, `logprobs` always `null`, a chunk's `finish_reason`
//! `null` until the last content chunk, `usage` present only where OpenAI
//! sends it (and skipped, not `null`, on chunks that carry none).

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use super::request::SpecMethod;

/// Why a choice ended, as OpenAI spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token or a stop sequence.
    Stop,
    /// The `max_tokens` limit.
    Length,
}

/// Token counts. Invariant: `total_tokens == prompt_tokens + completion_tokens`
/// (kept by [`Usage::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// Seconds since the Unix epoch, for `created`.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The assistant turn of a non-streaming chat choice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AssistantMessage {
    /// Always `"assistant"`.
    pub role: &'static str,
    pub content: String,
}

/// One choice of a [`ChatCompletion`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    /// Always `null`: logprobs are not supported.
    pub logprobs: (),
    pub finish_reason: FinishReason,
}

/// The body of a non-streaming `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    /// Always `"chat.completion"`.
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

impl ChatCompletion {
    /// A completion with one choice holding `content`.
    pub fn new(
        id: &str,
        created: u64,
        model: &str,
        content: String,
        finish_reason: FinishReason,
        usage: Usage,
    ) -> Self {
        Self {
            id: id.to_owned(),
            object: "chat.completion",
            created,
            model: model.to_owned(),
            choices: vec![ChatChoice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant",
                    content,
                },
                logprobs: (),
                finish_reason,
            }],
            usage,
        }
    }
}

/// What a streaming chat chunk adds; absent keys are omitted (`{}` on the
/// finish chunk).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a [`ChatCompletionChunk`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    /// Always `null`.
    pub logprobs: (),
    /// `null` until the chunk that ends the choice.
    pub finish_reason: Option<FinishReason>,
}

/// One `data:` event of a streaming `POST /v1/chat/completions`.
///
/// A stream is: [`role`](Self::role), any number of
/// [`content`](Self::content), one [`finish`](Self::finish), then, with
/// `stream_options.include_usage`, one [`usage`](Self::usage) chunk (empty
/// `choices`). All chunks of a stream share `id`, `created` and `model`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    /// Always `"chat.completion.chunk"`.
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    /// Only on the final usage chunk; omitted elsewhere.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

impl ChatCompletionChunk {
    fn with(
        id: &str,
        created: u64,
        model: &str,
        choices: Vec<ChunkChoice>,
        usage: Option<Usage>,
    ) -> Self {
        Self {
            id: id.to_owned(),
            object: "chat.completion.chunk",
            created,
            model: model.to_owned(),
            choices,
            usage,
        }
    }

    fn one(id: &str, created: u64, model: &str, delta: Delta, fr: Option<FinishReason>) -> Self {
        let choice = ChunkChoice {
            index: 0,
            delta,
            logprobs: (),
            finish_reason: fr,
        };
        Self::with(id, created, model, vec![choice], None)
    }

    /// The first chunk: `delta: {"role":"assistant","content":""}`.
    pub fn role(id: &str, created: u64, model: &str) -> Self {
        let delta = Delta {
            role: Some("assistant"),
            content: Some(String::new()),
        };
        Self::one(id, created, model, delta, None)
    }

    /// A text delta: `delta: {"content": text}`.
    pub fn content(id: &str, created: u64, model: &str, text: String) -> Self {
        let delta = Delta {
            role: None,
            content: Some(text),
        };
        Self::one(id, created, model, delta, None)
    }

    /// The chunk that ends the choice: `delta: {}`, `finish_reason` set.
    pub fn finish(id: &str, created: u64, model: &str, reason: FinishReason) -> Self {
        Self::one(id, created, model, Delta::default(), Some(reason))
    }

    /// The usage chunk: `choices: []`, `usage` set.
    pub fn usage(id: &str, created: u64, model: &str, usage: Usage) -> Self {
        Self::with(id, created, model, Vec::new(), Some(usage))
    }
}

/// One choice of a [`Completion`] or [`CompletionChunk`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    /// Always `null`.
    pub logprobs: (),
    /// Always set in a [`Completion`]; `null` in chunks until the last.
    pub finish_reason: Option<FinishReason>,
}

/// The body of a non-streaming `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Completion {
    pub id: String,
    /// Always `"text_completion"`.
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
}

impl Completion {
    /// A completion with one choice holding `text`.
    pub fn new(
        id: &str,
        created: u64,
        model: &str,
        text: String,
        finish_reason: FinishReason,
        usage: Usage,
    ) -> Self {
        Self {
            id: id.to_owned(),
            object: "text_completion",
            created,
            model: model.to_owned(),
            choices: vec![CompletionChoice {
                index: 0,
                text,
                logprobs: (),
                finish_reason: Some(finish_reason),
            }],
            usage,
        }
    }
}

/// One `data:` event of a streaming `POST /v1/completions` (OpenAI uses
/// `object: "text_completion"` for chunks too).
///
/// A stream is: any number of [`text`](Self::text), one
/// [`finish`](Self::finish) (empty text), then, with
/// `stream_options.include_usage`, one [`usage`](Self::usage) chunk (empty
/// `choices`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CompletionChunk {
    pub id: String,
    /// Always `"text_completion"`.
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    /// Only on the final usage chunk; omitted elsewhere.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

impl CompletionChunk {
    fn with(
        id: &str,
        created: u64,
        model: &str,
        choices: Vec<CompletionChoice>,
        usage: Option<Usage>,
    ) -> Self {
        Self {
            id: id.to_owned(),
            object: "text_completion",
            created,
            model: model.to_owned(),
            choices,
            usage,
        }
    }

    fn one(id: &str, created: u64, model: &str, text: String, fr: Option<FinishReason>) -> Self {
        let choice = CompletionChoice {
            index: 0,
            text,
            logprobs: (),
            finish_reason: fr,
        };
        Self::with(id, created, model, vec![choice], None)
    }

    /// A text delta, `finish_reason: null`.
    pub fn text(id: &str, created: u64, model: &str, text: String) -> Self {
        Self::one(id, created, model, text, None)
    }

    /// The chunk that ends the choice: empty text, `finish_reason` set.
    pub fn finish(id: &str, created: u64, model: &str, reason: FinishReason) -> Self {
        Self::one(id, created, model, String::new(), Some(reason))
    }

    /// The usage chunk: `choices: []`, `usage` set.
    pub fn usage(id: &str, created: u64, model: &str, usage: Usage) -> Self {
        Self::with(id, created, model, Vec::new(), Some(usage))
    }
}

/// One entry of `GET /v1/models`: OpenAI's four fields, then (as vLLM
/// does) what a client needs to size its requests: the context length and
/// the server's speculative method. Those two are omitted while the model
/// is still loading.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelCard {
    pub id: String,
    /// Always `"model"`.
    pub object: &'static str,
    pub created: u64,
    pub owned_by: String,
    /// The most tokens a request may use, prompt and output together.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<usize>,
    /// How the server drafts when a request does not say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<ModelSpeculative>,
}

/// The `speculative` object of a [`ModelCard`] (the same shape as the
/// request extension of that name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ModelSpeculative {
    pub method: SpecMethod,
}

impl ModelCard {
    /// A card with OpenAI's fields only.
    pub fn new(id: &str, created: u64, owned_by: &str) -> Self {
        Self {
            id: id.to_owned(),
            object: "model",
            created,
            owned_by: owned_by.to_owned(),
            max_model_len: None,
            speculative: None,
        }
    }

    /// Adds what the loaded model serves: its context length and the
    /// server's speculative method.
    pub fn serving(mut self, max_model_len: usize, method: SpecMethod) -> Self {
        self.max_model_len = Some(max_model_len);
        self.speculative = Some(ModelSpeculative { method });
        self
    }
}

/// The body of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelList {
    /// Always `"list"`.
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

impl ModelList {
    pub fn new(data: Vec<ModelCard>) -> Self {
        Self {
            object: "list",
            data,
        }
    }
}

/// The body of `GET /version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VersionInfo {
    /// The crate version (`CARGO_PKG_VERSION`).
    pub version: &'static str,
    pub build: BuildInfo,
}

/// How the running binary was built; known at compile time, no git needed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BuildInfo {
    /// `"release"` or `"debug"` (whether debug assertions are on).
    pub profile: &'static str,
    /// The CPU architecture (`std::env::consts::ARCH`, e.g. `"x86_64"`).
    pub arch: &'static str,
    /// The operating system (`std::env::consts::OS`, e.g. `"linux"`).
    pub os: &'static str,
}

impl VersionInfo {
    /// This binary's version and build.
    pub fn current() -> Self {
        Self {
            version: env!("CARGO_PKG_VERSION"),
            build: BuildInfo {
                profile: if cfg!(debug_assertions) {
                    "debug"
                } else {
                    "release"
                },
                arch: std::env::consts::ARCH,
                os: std::env::consts::OS,
            },
        }
    }
}
