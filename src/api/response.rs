//! Response bodies, serialized byte-compatibly with OpenAI: field order as
//! OpenAI sends it, `logprobs` `null` unless asked for (then OpenAI's chat
//! shape [`ChatLogprobs`] or the completions shape [`CompletionLogprobs`]),
//! assistant `tool_calls` only when the turn made calls, a chunk's `finish_reason`
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
    /// The turn ended after making tool calls.
    ToolCalls,
}

impl FinishReason {
    /// The wire name (`"stop"`, `"length"`, `"tool_calls"`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// A function call the model made: `{"id": "call_..", "type": "function",
/// "function": {"name", "arguments": "<JSON text>"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolCall {
    pub id: String,
    /// Always `"function"`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

impl ToolCall {
    /// A function call with this id, name and arguments (JSON text).
    pub fn function(id: String, name: String, arguments: String) -> Self {
        Self {
            id,
            kind: "function",
            function: FunctionCall { name, arguments },
        }
    }
}

/// The function of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text, as OpenAI sends it (a string, not an object).
    pub arguments: String,
}

/// One streamed piece of a tool call (`delta.tool_calls[]`): the first
/// delta of a call carries `id`, `type` and `function.name`; `arguments`
/// text may come in one or more deltas, to be concatenated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolCallDelta {
    /// The call's position in the turn (0-based).
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

/// The function part of a [`ToolCallDelta`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// A chat choice's `logprobs`: `{"content": [..], "refusal": null}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    /// Always `null`: this server never refuses.
    pub refusal: (),
}

impl ChatLogprobs {
    pub fn new(content: Vec<ChatTokenLogprob>) -> Self {
        Self {
            content,
            refusal: (),
        }
    }
}

/// One output token in a chat choice's `logprobs.content`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    /// The token's text (lossy UTF-8 of `bytes`).
    pub token: String,
    /// Finite (the log-softmax of the processed logits).
    pub logprob: f32,
    /// The token's exact bytes.
    pub bytes: Option<Vec<u8>>,
    /// The most likely tokens at this position, most likely first
    /// (`top_logprobs` of them).
    pub top_logprobs: Vec<TopLogprob>,
}

/// An alternative in [`ChatTokenLogprob::top_logprobs`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Option<Vec<u8>>,
}

/// A completion choice's `logprobs` (the legacy shape): parallel arrays,
/// one entry per token. With `echo` the prompt's tokens come first and
/// the very first token's `token_logprobs` / `top_logprobs` entries are
/// `null` (nothing predicts it).
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    /// `{token text: logprob}` of the most likely tokens, most likely first.
    pub top_logprobs: Vec<Option<TopMap>>,
    /// Character offset of each token in the choice's `text` (prompt
    /// included with `echo`), counted over the tokens' texts.
    pub text_offset: Vec<usize>,
}

/// A `{token: logprob}` object that keeps its order (most likely first).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TopMap(pub Vec<(String, f32)>);

impl Serialize for TopMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
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

/// The assistant turn of a non-streaming chat choice. `content` is `null`
/// only for a turn that made tool calls and wrote no text around them;
/// `tool_calls` is omitted when there are none.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AssistantMessage {
    /// Always `"assistant"`.
    pub role: &'static str,
    pub content: Option<String>,
    /// The turn's thinking, for a family that writes it apart (Kimi K3);
    /// omitted when there is none (Moonshot's, DeepSeek's field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// One choice of a [`ChatCompletion`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    /// `null` unless the request asked for `logprobs`.
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: FinishReason,
}

/// The body of a non-streaming `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
                    content: Some(content),
                    reasoning_content: None,
                    tool_calls: Vec::new(),
                },
                logprobs: None,
                finish_reason,
            }],
            usage,
        }
    }

    /// Sets the choice's `message.content` and `message.tool_calls`.
    pub fn with_tool_calls(mut self, content: Option<String>, calls: Vec<ToolCall>) -> Self {
        self.choices[0].message.content = content;
        self.choices[0].message.tool_calls = calls;
        self
    }

    /// Sets the choice's `logprobs`.
    pub fn with_logprobs(mut self, logprobs: Option<ChatLogprobs>) -> Self {
        self.choices[0].logprobs = logprobs;
        self
    }

    /// Sets the choice's `message.reasoning_content`.
    pub fn with_reasoning(mut self, reasoning: Option<String>) -> Self {
        self.choices[0].message.reasoning_content = reasoning;
        self
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// One choice of a [`ChatCompletionChunk`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    /// `null` unless the request asked for `logprobs`: then the tokens
    /// whose text (or tool-call text) this chunk releases.
    pub logprobs: Option<ChatLogprobs>,
    /// `null` until the chunk that ends the choice.
    pub finish_reason: Option<FinishReason>,
}

/// One `data:` event of a streaming `POST /v1/chat/completions`.
///
/// A stream is: [`role`](Self::role), any number of
/// [`content`](Self::content), one [`finish`](Self::finish), then, with
/// `stream_options.include_usage`, one [`usage`](Self::usage) chunk (empty
/// `choices`). All chunks of a stream share `id`, `created` and `model`.
/// A turn that calls tools streams [`tool_call`](Self::tool_call) chunks
/// among the content ones.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
            logprobs: None,
            finish_reason: fr,
        };
        Self::with(id, created, model, vec![choice], None)
    }

    /// The first chunk: `delta: {"role":"assistant","content":""}`.
    pub fn role(id: &str, created: u64, model: &str) -> Self {
        let delta = Delta {
            role: Some("assistant"),
            content: Some(String::new()),
            reasoning_content: None,
            tool_calls: None,
        };
        Self::one(id, created, model, delta, None)
    }

    /// A text delta: `delta: {"content": text}`.
    pub fn content(id: &str, created: u64, model: &str, text: String) -> Self {
        let delta = Delta {
            content: Some(text),
            ..Delta::default()
        };
        Self::one(id, created, model, delta, None)
    }

    /// A reasoning delta: `delta: {"reasoning_content": text}`.
    pub fn reasoning(id: &str, created: u64, model: &str, text: String) -> Self {
        let delta = Delta {
            reasoning_content: Some(text),
            ..Delta::default()
        };
        Self::one(id, created, model, delta, None)
    }

    /// A whole tool call as one delta: `delta: {"tool_calls": [{"index",
    /// "id", "type": "function", "function": {"name", "arguments"}}]}`.
    pub fn tool_call(id: &str, created: u64, model: &str, index: u32, call: ToolCall) -> Self {
        let delta = Delta {
            tool_calls: Some(vec![ToolCallDelta {
                index,
                id: Some(call.id),
                kind: Some(call.kind),
                function: FunctionDelta {
                    name: Some(call.function.name),
                    arguments: Some(call.function.arguments),
                },
            }]),
            ..Delta::default()
        };
        Self::one(id, created, model, delta, None)
    }

    /// Sets the (one) choice's `logprobs`.
    pub fn with_logprobs(mut self, logprobs: Option<ChatLogprobs>) -> Self {
        if let Some(c) = self.choices.first_mut() {
            c.logprobs = logprobs;
        }
        self
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
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    /// `null` unless the request asked for `logprobs`.
    pub logprobs: Option<CompletionLogprobs>,
    /// Always set in a [`Completion`]; `null` in chunks until the last.
    pub finish_reason: Option<FinishReason>,
}

/// The body of a non-streaming `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
                logprobs: None,
                finish_reason: Some(finish_reason),
            }],
            usage,
        }
    }

    /// Sets the choice's `logprobs`.
    pub fn with_logprobs(mut self, logprobs: Option<CompletionLogprobs>) -> Self {
        self.choices[0].logprobs = logprobs;
        self
    }
}

/// One `data:` event of a streaming `POST /v1/completions` (OpenAI uses
/// `object: "text_completion"` for chunks too).
///
/// A stream is: any number of [`text`](Self::text), one
/// [`finish`](Self::finish) (empty text), then, with
/// `stream_options.include_usage`, one [`usage`](Self::usage) chunk (empty
/// `choices`).
#[derive(Debug, Clone, PartialEq, Serialize)]
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
            logprobs: None,
            finish_reason: fr,
        };
        Self::with(id, created, model, vec![choice], None)
    }

    /// A text delta, `finish_reason: null`.
    pub fn text(id: &str, created: u64, model: &str, text: String) -> Self {
        Self::one(id, created, model, text, None)
    }

    /// Sets the (one) choice's `logprobs`.
    pub fn with_logprobs(mut self, logprobs: Option<CompletionLogprobs>) -> Self {
        if let Some(c) = self.choices.first_mut() {
            c.logprobs = logprobs;
        }
        self
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
