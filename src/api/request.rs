//! Parsing and validation of `POST /v1/chat/completions` and
//! `POST /v1/completions` bodies into a [`ValidRequest`].
//!
//! The body is read into a `serde_json::Value` and each known field is
//! extracted by hand, so every wrong type or out-of-range value is refused
//! with an [`ApiError`] whose `param` names the field. JSON `null` is the same
//! as an absent field. Every field is honoured or refused: a top-level field
//! neither endpoint knows is a 400 `Unrecognized request argument supplied:
//! <name>` with `param` naming it (OpenAI's own answer); OpenAI fields this
//! server cannot honour are 400s that say why ([`KNOWN_CHAT_FIELDS`] and
//! [`KNOWN_COMPLETION_FIELDS`] list what each endpoint reads).
//!
//! Sampling and logits controls live in `sampling.rs`, messages in
//! `messages.rs`, tools / `tool_choice` / `response_format` in `tools.rs`.

use serde::Serialize;
use specgate_verify::SamplingParams;

use super::error::ApiError;
use super::json::{
    as_bool, as_int, as_str, below_min, get, kind_of, missing, parse_object, reject_unknown,
    type_err,
};
use super::json::{Json, Obj};
use super::messages::parse_messages;
use super::prompt::parse_prompt;
pub use super::prompt::Input;
use super::sampling::{parse_controls, parse_logprobs, parse_sampling, parse_stop_token_ids};
pub use super::sampling::{DEFAULT_TEMPERATURE, MAX_TEMPERATURE, MAX_TOP_LOGPROBS};
use super::tools::{parse_response_format, parse_tools, ResponseFormat, ToolSetup};
use crate::tokenizer::ChatMessage;
use specgate_verify::Controls;

/// A proposer as the wire names it: `"off"`, `"ngram"` or `"draft"` (the
/// request's `speculative.method`, a model card's `speculative.method`).
/// A wire type of its own: the http layer maps it onto the engine's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SpecMethod {
    /// No drafting: plain decoding.
    Off,
    /// Prompt lookup (n-gram) drafting.
    Ngram,
    /// A small draft model.
    Draft,
}

impl SpecMethod {
    /// Every method, in the order error messages and schemas list them.
    pub const ALL: [SpecMethod; 3] = [SpecMethod::Draft, SpecMethod::Ngram, SpecMethod::Off];

    /// The wire name (`"draft"`, `"ngram"`, `"off"`).
    pub fn as_str(self) -> &'static str {
        match self {
            SpecMethod::Off => "off",
            SpecMethod::Ngram => "ngram",
            SpecMethod::Draft => "draft",
        }
    }

    /// The method a wire name stands for; `None` for any other text.
    pub fn from_wire(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == name)
    }
}

/// Largest `speculative.num_tokens` a request may ask for. The engine has
/// the same cap; the http layer checks at compile time that they agree.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// Most stop sequences a request may give (OpenAI's limit).
pub const MAX_STOP_SEQUENCES: usize = 4;
/// Longest stop sequence in bytes. Each generated piece of text is matched
/// against every suffix of the held-back text, so the cost per token grows
/// with the square of this bound.
pub const MAX_STOP_BYTES: usize = 256;
/// `max_tokens` of a `/v1/completions` request that gives none (OpenAI's
/// and vLLM's default for that endpoint).
pub const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

/// The `speculative` request extension:
/// `{"method": "draft"|"ngram"|"off", "num_tokens": K}`, both keys optional.
///
/// Invariants (normalized by the parser): `num_tokens <= MAX_SPECULATIVE_TOKENS`;
/// `num_tokens == Some(0)` is stored as `method: Some(Off), num_tokens: Some(0)`;
/// `method == Some(Off)` never carries a non-zero `num_tokens`.
/// `method: None` means "the server's configured proposer"; whether a named
/// method is available is for the server to decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecOverride {
    pub method: Option<SpecMethod>,
    /// Draft length per step; `None` keeps the server's policy.
    pub num_tokens: Option<usize>,
}

impl SpecOverride {
    /// Whether the request turned speculation off.
    pub fn is_off(&self) -> bool {
        self.method == Some(SpecMethod::Off)
    }

    /// The engine's `GenRequest::num_speculative_tokens`: `Some(0)` when
    /// off, else the requested draft length (`None`: server policy).
    pub fn num_speculative_tokens(&self) -> Option<usize> {
        if self.is_off() {
            Some(0)
        } else {
            self.num_tokens
        }
    }
}

/// Top-level fields of `POST /v1/chat/completions` this server reads: each
/// is honoured or refused with a reason. Any other field is refused as
/// unrecognized.
pub const KNOWN_CHAT_FIELDS: &[&str] = &[
    // OpenAI's chat-completions request, every field.
    "messages",
    "model",
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "metadata",
    "modalities",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "verbosity",
    "web_search_options",
    // Extensions (vLLM's names, and specgate's `speculative`).
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "speculative",
    "cache_salt",
    "chat_template_kwargs",
];

/// Top-level fields of `POST /v1/completions` this server reads (OpenAI's
/// legacy completions request, `max_completion_tokens` and
/// `response_format` as vLLM accepts them, and the same extensions as chat).
pub const KNOWN_COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "speculative",
    "cache_salt",
];

/// Who sent a request, for the log only (never sent to the model):
/// `user`, `safety_identifier` and `metadata` (at most 16 string pairs).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestMeta {
    pub user: Option<String>,
    pub safety_identifier: Option<String>,
    pub metadata: Vec<(String, String)>,
}

/// A request that passed every wire-level check. Model-dependent checks
/// (served model name, context length, token ids within the vocabulary)
/// are the caller's.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    /// The `model` field as given (not checked against the served models).
    pub model: String,
    pub input: Input,
    /// Generation limit the client gave: `max_completion_tokens` if given,
    /// else `max_tokens`, else `None` (see [`ValidRequest::max_new_tokens`]
    /// for the default). Always >= 1.
    pub max_tokens: Option<usize>,
    /// Temperature (default [`DEFAULT_TEMPERATURE`]), top-p (default 1),
    /// top-k (`top_k` 0 or -1 -> 0 = off), min-p (0 = off) and seed; meets
    /// `SamplingParams`' invariants.
    pub sampling: SamplingParams,
    /// `presence_penalty`, `frequency_penalty` (each in `-2..=2`),
    /// `repetition_penalty` (> 0; 0 = unset), `logit_bias` (ids as given,
    /// biases in `-100..=100`) and `min_tokens` (<= `max_tokens` when that
    /// is known). `min_tokens_ban` is empty (the engine fills it).
    pub controls: Controls,
    /// Up to [`MAX_STOP_SEQUENCES`] non-empty strings.
    pub stop: Vec<String>,
    /// vLLM's `stop_token_ids`: ids that end the output (not checked
    /// against the vocabulary here).
    pub stop_token_ids: Vec<u32>,
    pub stream: bool,
    /// `stream_options.include_usage`; only ever true when `stream` is.
    pub include_usage: bool,
    /// vLLM's `ignore_eos` extension: generate past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Log-probabilities asked for: `Some(n)` = each output token's and its
    /// `n` most likely alternatives (`n <= MAX_TOP_LOGPROBS`). Chat:
    /// `logprobs: true` with `top_logprobs`; completions: `logprobs: n`.
    pub logprobs: Option<usize>,
    /// Completions' `echo`: the prompt is prepended to the text (and, with
    /// `logprobs`, its tokens' log-probabilities to the output's).
    pub echo: bool,
    /// `response_format` (text when absent).
    pub response_format: ResponseFormat,
    /// `tools`, `tool_choice` and `parallel_tool_calls` (chat only).
    pub tools: ToolSetup,
    /// `user`, `safety_identifier`, `metadata`: for the log only.
    pub meta: RequestMeta,
    pub speculative: Option<SpecOverride>,
    /// vLLM's `cache_salt`: requests share prefix-cache blocks only with
    /// requests of the same salt (1..=[`MAX_CACHE_SALT`] bytes).
    pub cache_salt: Option<String>,
    /// Chat only: `chat_template_kwargs` and `reasoning_effort` (whether
    /// the model has a reasoning knob is the http layer's check).
    pub knobs: super::knobs::ChatKnobs,
}

/// Longest `cache_salt` accepted, in bytes.
pub const MAX_CACHE_SALT: usize = 1024;

fn parse_cache_salt(map: &Obj) -> Result<Option<String>, ApiError> {
    let Some(v) = get(map, "cache_salt") else {
        return Ok(None);
    };
    let salt = as_str(v, "cache_salt")?;
    if salt.is_empty() || salt.len() > MAX_CACHE_SALT {
        return Err(ApiError::invalid(
            "cache_salt",
            format!("Invalid 'cache_salt': must be 1 to {MAX_CACHE_SALT} bytes."),
        ));
    }
    Ok(Some(salt.to_owned()))
}

impl ValidRequest {
    /// A chat request over `messages` with every other field at its
    /// default (OpenAI's): the start the other wire formats (Anthropic
    /// Messages, OpenAI Responses) fill in from their own fields.
    pub(crate) fn chat_defaults(model: String, messages: Vec<ChatMessage>) -> Self {
        Self {
            model,
            input: Input::Chat(messages),
            max_tokens: None,
            sampling: SamplingParams {
                temperature: DEFAULT_TEMPERATURE,
                ..SamplingParams::default()
            },
            controls: Controls::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            stream: false,
            include_usage: false,
            ignore_eos: false,
            logprobs: None,
            echo: false,
            response_format: ResponseFormat::Text,
            tools: ToolSetup::default(),
            meta: RequestMeta::default(),
            speculative: None,
            cache_salt: None,
            knobs: super::knobs::ChatKnobs::default(),
        }
    }

    /// How many tokens to generate when `room` fit after the prompt (in the
    /// context and in the KV pool): the client's limit when it gave one
    /// (which may exceed `room`; the caller refuses that), else all of
    /// `room` for chat and [`COMPLETION_DEFAULT_MAX_TOKENS`] (at most
    /// `room`) for completions. A missing limit never makes a request fail.
    pub fn max_new_tokens(&self, room: usize) -> usize {
        match (self.max_tokens, &self.input) {
            (Some(n), _) => n,
            (None, Input::Chat(_)) => room,
            (None, _) => COMPLETION_DEFAULT_MAX_TOKENS.min(room),
        }
    }
}

/// Parses a `POST /v1/chat/completions` body.
///
/// Errors (all 400, `param` naming the field): body not JSON or not an
/// object; a field not in [`KNOWN_CHAT_FIELDS`]; `model` missing or not a
/// string; `messages` missing, empty, or with a bad role, content or tool
/// call; `logprobs` not a boolean, `top_logprobs` outside `0..=20` or
/// without `logprobs: true`; a bad `tools` / `tool_choice` /
/// `response_format`; an OpenAI field this server cannot honour (`audio`,
/// `modalities` other than `["text"]`, `functions`, `function_call`,
/// `prediction`, `verbosity`, `web_search_options`,
/// `store: true`, a `service_tier` other than `auto`/`default`); plus every
/// check of the shared fields (see [`ValidRequest`]).
pub fn parse_chat(body: &[u8]) -> Result<ValidRequest, ApiError> {
    let map = parse_object(body)?;
    reject_unknown(&map, KNOWN_CHAT_FIELDS)?;
    let model = parse_model(&map)?;
    let messages = parse_messages(&map)?;
    reject_unsupported_chat_fields(&map)?;
    let logprobs = match get(&map, "logprobs") {
        Some(v) => as_bool(v, "logprobs")?,
        None => false,
    };
    let top = match get(&map, "top_logprobs") {
        None => None,
        Some(v) => {
            let n = as_int(v, "top_logprobs")?;
            if !(0..=MAX_TOP_LOGPROBS as i128).contains(&n) {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("Invalid 'top_logprobs': expected a value between 0 and {MAX_TOP_LOGPROBS}, but got {n} instead."),
                ));
            }
            if !logprobs {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "'top_logprobs' requires 'logprobs' to be true.",
                ));
            }
            Some(n as usize)
        }
    };
    let tools = parse_tools(&map)?;
    let mut v = parse_common(&map, model, Input::Chat(messages))?;
    v.logprobs = logprobs.then(|| top.unwrap_or(0));
    if v.response_format != ResponseFormat::Text && tools.forces_a_call() {
        return Err(ApiError::invalid(
            "response_format",
            "'response_format' cannot be combined with a 'tool_choice' that forces a tool call.",
        ));
    }
    v.tools = tools;
    v.knobs = super::knobs::parse_knobs(&map)?;
    Ok(v)
}

/// The OpenAI chat fields this server reads but cannot honour: each is a
/// 400 that says why (`null` is absent, as everywhere).
fn reject_unsupported_chat_fields(map: &Obj) -> Result<(), ApiError> {
    let refuse = |name: &str, why: &str| {
        Err(
            ApiError::invalid(name, format!("'{name}' is not supported: {why}"))
                .with_code("unsupported_parameter"),
        )
    };
    if get(map, "audio").is_some() {
        return refuse("audio", "this server generates text only.");
    }
    if let Some(v) = get(map, "modalities") {
        let items = v
            .as_array()
            .ok_or_else(|| type_err("modalities", "an array of strings", v))?;
        for m in items {
            match m.as_str() {
                Some("text") => {}
                Some(other) => {
                    return refuse(
                        "modalities",
                        &format!("this server generates text only, but got '{other}'."),
                    )
                }
                None => return Err(type_err("modalities", "an array of strings", &m)),
            }
        }
    }
    for old in ["functions", "function_call"] {
        if get(map, old).is_some() {
            return refuse(
                old,
                "it is deprecated; use 'tools' and 'tool_choice' instead.",
            );
        }
    }
    if get(map, "prediction").is_some() {
        return refuse(
            "prediction",
            "predicted outputs are not available on this server.",
        );
    }
    if get(map, "verbosity").is_some() {
        return refuse("verbosity", "the served model has no verbosity control.");
    }
    if get(map, "web_search_options").is_some() {
        return refuse("web_search_options", "this server does not search the web.");
    }
    if let Some(v) = get(map, "store") {
        if as_bool(v, "store")? {
            return refuse("store", "this server never stores completions.");
        }
    }
    if let Some(v) = get(map, "service_tier") {
        match as_str(v, "service_tier")? {
            "auto" | "default" => {}
            other => {
                return refuse(
                    "service_tier",
                    &format!("this server has one tier ('auto' or 'default'), but got '{other}'."),
                )
            }
        }
    }
    // Prefix caching is automatic: a cache key is accepted and not needed.
    if let Some(v) = get(map, "prompt_cache_key") {
        as_str(v, "prompt_cache_key")?;
    }
    Ok(())
}

/// Parses a `POST /v1/completions` body.
///
/// Errors (all 400, `param` naming the field): body not JSON or not an
/// object; a field not in [`KNOWN_COMPLETION_FIELDS`]; `model` missing or
/// not a string; `prompt` missing, or not a string, a list of one string,
/// a non-empty list of token ids (integers in `0..2^32`) or a list of one
/// such list; `logprobs` not an integer in `0..=20` (`false` is absent);
/// `echo` not a boolean; `best_of` > 1; a non-empty `suffix`; plus every
/// check of the shared fields (see [`ValidRequest`]).
pub fn parse_completion(body: &[u8]) -> Result<ValidRequest, ApiError> {
    let map = parse_object(body)?;
    reject_unknown(&map, KNOWN_COMPLETION_FIELDS)?;
    let model = parse_model(&map)?;
    let prompt = parse_prompt(&map)?;
    let logprobs = parse_logprobs(&map)?;
    let echo = match get(&map, "echo") {
        Some(v) => as_bool(v, "echo")?,
        None => false,
    };
    if let Some(v) = get(&map, "best_of") {
        let b = as_int(v, "best_of")?;
        if b < 1 {
            return Err(below_min("best_of", 1, b));
        }
        if b > 1 {
            return Err(ApiError::invalid("best_of", "best_of>1 is not supported.")
                .with_code("unsupported_value"));
        }
    }
    if let Some(v) = get(&map, "suffix") {
        if !as_str(v, "suffix")?.is_empty() {
            return Err(ApiError::unsupported(
                "suffix",
                "suffix is not supported by this server.",
            ));
        }
    }
    let mut v = parse_common(&map, model, prompt)?;
    v.logprobs = logprobs;
    v.echo = echo;
    Ok(v)
}

/// The fields both endpoints share.
fn parse_common(map: &Obj, model: String, input: Input) -> Result<ValidRequest, ApiError> {
    let max_tokens = opt_positive(map, "max_tokens")?;
    let max_completion_tokens = opt_positive(map, "max_completion_tokens")?;
    let max_tokens = max_completion_tokens.or(max_tokens);

    if let Some(v) = get(map, "n") {
        let n = as_int(v, "n")?;
        if n < 1 {
            return Err(below_min("n", 1, n));
        }
        if n > 1 {
            return Err(ApiError::invalid(
                "n",
                format!(
                    "n>1 is not supported: this server returns exactly one choice, but got n={n}."
                ),
            )
            .with_code("unsupported_value"));
        }
    }

    let stream = match get(map, "stream") {
        Some(v) => as_bool(v, "stream")?,
        None => false,
    };
    let include_usage = parse_stream_options(map, stream)?;
    // vLLM's extension: keep generating past end-of-sequence tokens.
    let ignore_eos = match get(map, "ignore_eos") {
        Some(v) => as_bool(v, "ignore_eos")?,
        None => false,
    };

    let controls = parse_controls(map, max_tokens)?;
    let sampling = parse_sampling(map)?;
    Ok(ValidRequest {
        model,
        input,
        max_tokens,
        sampling,
        controls,
        stop: parse_stop(map)?,
        stop_token_ids: parse_stop_token_ids(map)?,
        stream,
        include_usage,
        ignore_eos,
        logprobs: None,
        echo: false,
        response_format: parse_response_format(map)?,
        tools: ToolSetup::default(),
        meta: parse_meta(map)?,
        speculative: parse_speculative(map)?,
        cache_salt: parse_cache_salt(map)?,
        knobs: super::knobs::ChatKnobs::default(),
    })
}

/// Most `metadata` pairs, and their key and value lengths (OpenAI's limits).
pub(super) const MAX_METADATA_PAIRS: usize = 16;
pub(super) const MAX_METADATA_KEY: usize = 64;
pub(super) const MAX_METADATA_VALUE: usize = 512;

fn parse_meta(map: &Obj) -> Result<RequestMeta, ApiError> {
    let text = |name: &str| -> Result<Option<String>, ApiError> {
        get(map, name)
            .map(|v| as_str(v, name).map(str::to_owned))
            .transpose()
    };
    let mut meta = RequestMeta {
        user: text("user")?,
        safety_identifier: text("safety_identifier")?,
        metadata: Vec::new(),
    };
    if let Some(v) = get(map, "metadata") {
        let obj = v
            .as_object()
            .ok_or_else(|| type_err("metadata", "an object of strings", v))?;
        if obj.len() > MAX_METADATA_PAIRS {
            return Err(ApiError::invalid(
                "metadata",
                format!("Invalid 'metadata': at most {MAX_METADATA_PAIRS} pairs are allowed, but got {}.", obj.len()),
            ));
        }
        for (k, val) in obj.iter() {
            let val = val
                .as_str()
                .ok_or_else(|| type_err(&format!("metadata.{k}"), "a string", val))
                .map_err(|e| e.with_param("metadata"))?;
            if k.chars().count() > MAX_METADATA_KEY || val.chars().count() > MAX_METADATA_VALUE {
                return Err(ApiError::invalid(
                    "metadata",
                    format!("Invalid 'metadata': keys may be at most {MAX_METADATA_KEY} characters and values at most {MAX_METADATA_VALUE}."),
                ));
            }
            meta.metadata.push((k.to_owned(), val.to_owned()));
        }
    }
    Ok(meta)
}

fn parse_model(map: &Obj) -> Result<String, ApiError> {
    match get(map, "model") {
        Some(v) => Ok(as_str(v, "model")?.to_owned()),
        None => Err(missing("model")),
    }
}

fn parse_stop(map: &Obj) -> Result<Vec<String>, ApiError> {
    let empty = || ApiError::invalid("stop", "Invalid 'stop': stop sequences must not be empty.");
    let long = |s: &str| {
        ApiError::invalid(
            "stop",
            format!(
                "Invalid 'stop': a stop sequence may be at most {MAX_STOP_BYTES} bytes long, but one is {}.",
                s.len()
            ),
        )
    };
    match get(map, "stop") {
        None => Ok(Vec::new()),
        Some(Json::String(s)) if s.is_empty() => Err(empty()),
        Some(Json::String(s)) if s.len() > MAX_STOP_BYTES => Err(long(s.as_ref())),
        Some(Json::String(s)) => Ok(vec![s.to_string()]),
        Some(Json::Array(items)) => {
            let items = items.items();
            if items.len() > MAX_STOP_SEQUENCES {
                return Err(ApiError::invalid(
                    "stop",
                    format!(
                        "Invalid 'stop': at most {MAX_STOP_SEQUENCES} stop sequences are allowed, but got {}.",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Json::String(s) if s.is_empty() => Err(empty()),
                    Json::String(s) if s.len() > MAX_STOP_BYTES => Err(long(s.as_ref())),
                    Json::String(s) => Ok(s.to_string()),
                    other => Err(ApiError::invalid(
                        "stop",
                        format!(
                            "Invalid type for 'stop[{i}]': expected a string, but got {} instead.",
                            kind_of(other)
                        ),
                    )),
                })
                .collect()
        }
        Some(other) => Err(type_err("stop", "a string or an array of strings", other)),
    }
}

fn parse_stream_options(map: &Obj, stream: bool) -> Result<bool, ApiError> {
    let Some(v) = get(map, "stream_options") else {
        return Ok(false);
    };
    let opts = v
        .as_object()
        .ok_or_else(|| type_err("stream_options", "an object", v))?;
    if !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        ));
    }
    match get(&opts, "include_usage") {
        Some(v) => as_bool(v, "stream_options.include_usage"),
        None => Ok(false),
    }
}

pub(super) fn parse_speculative(map: &Obj) -> Result<Option<SpecOverride>, ApiError> {
    let Some(v) = get(map, "speculative") else {
        return Ok(None);
    };
    let obj = v
        .as_object()
        .ok_or_else(|| type_err("speculative", "an object", v))?;
    // Our own extension: a misspelt key is an error, not silently ignored.
    if let Some(k) = obj.keys().find(|k| *k != "method" && *k != "num_tokens") {
        return Err(ApiError::invalid(
            format!("speculative.{k}"),
            format!("Unknown field 'speculative.{k}': expected 'method' and/or 'num_tokens'."),
        ));
    }
    let method = match get(&obj, "method") {
        None => None,
        Some(v) => {
            let name = as_str(v, "speculative.method")?;
            Some(SpecMethod::from_wire(name).ok_or_else(|| {
                ApiError::invalid(
                    "speculative.method",
                    format!("Invalid value '{name}' for 'speculative.method': expected 'draft', 'ngram' or 'off'."),
                )
            })?)
        }
    };
    let num_tokens = match get(&obj, "num_tokens") {
        None => None,
        Some(v) => {
            let k = as_int(v, "speculative.num_tokens")?;
            if !(0..=MAX_SPECULATIVE_TOKENS as i128).contains(&k) {
                return Err(ApiError::invalid(
                    "speculative.num_tokens",
                    format!("Invalid 'speculative.num_tokens': expected a value between 0 and {MAX_SPECULATIVE_TOKENS}, but got {k} instead."),
                ));
            }
            Some(k as usize)
        }
    };
    match (method, num_tokens) {
        (None, None) => Ok(None),
        (Some(SpecMethod::Off), Some(k)) if k > 0 => Err(ApiError::invalid(
            "speculative.num_tokens",
            format!("'speculative.num_tokens' must be 0 or absent when 'speculative.method' is 'off', but got {k}."),
        )),
        (_, Some(0)) | (Some(SpecMethod::Off), _) => Ok(Some(SpecOverride {
            method: Some(SpecMethod::Off),
            num_tokens: Some(0),
        })),
        (method, num_tokens) => Ok(Some(SpecOverride { method, num_tokens })),
    }
}

/// An optional integer >= 1, as a `usize`.
fn opt_positive(map: &Obj, param: &str) -> Result<Option<usize>, ApiError> {
    let Some(v) = get(map, param) else {
        return Ok(None);
    };
    let n = as_int(v, param)?;
    if n < 1 {
        return Err(below_min(param, 1, n));
    }
    Ok(Some(usize::try_from(n).unwrap_or(usize::MAX)))
}
