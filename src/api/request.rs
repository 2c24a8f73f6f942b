//! Parsing and validation of `POST /v1/chat/completions` and
//! `POST /v1/completions` bodies into a [`ValidRequest`].
//!
//! The body is read into a `serde_json::Value` and each known field is
//! extracted by hand, so every wrong type or out-of-range value is refused
//! with an [`ApiError`] whose `param` names the field. JSON `null` is the same
//! as an absent field. Unknown top-level fields are ignored (as vLLM does).

use serde::Serialize;
use serde_json::{Map, Value};
use specgate_verify::SamplingParams;

use super::error::ApiError;
use crate::tokenizer::ChatMessage;

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
/// Largest `temperature` (OpenAI's range is `0..=2`).
pub const MAX_TEMPERATURE: f32 = 2.0;
/// `temperature` when the request gives none (OpenAI's default).
pub const DEFAULT_TEMPERATURE: f32 = 1.0;
/// `max_tokens` of a `/v1/completions` request that gives none (OpenAI's
/// and vLLM's default for that endpoint).
pub const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

/// What the model is asked to continue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// Chat turns, to be rendered with the model's chat template.
    /// Invariant: non-empty; roles are `system`, `user` or `assistant`.
    Chat(Vec<ChatMessage>),
    /// Raw prompt text (`/v1/completions`), used as is.
    Prompt(String),
}

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

/// A request that passed every wire-level check. Model-dependent checks
/// (served model name, context length) are the caller's.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    /// The `model` field as given (not checked against the served models).
    pub model: String,
    pub input: Input,
    /// Generation limit: `max_completion_tokens` if given, else
    /// `max_tokens`, else `None` for chat (up to the context) and
    /// [`COMPLETION_DEFAULT_MAX_TOKENS`] for completions. Always >= 1.
    pub max_tokens: Option<usize>,
    /// Temperature (default [`DEFAULT_TEMPERATURE`]), top-p (default 1),
    /// top-k (`top_k` 0 or -1 -> 0 = off) and seed; meets
    /// `SamplingParams`' invariants.
    pub sampling: SamplingParams,
    /// Up to [`MAX_STOP_SEQUENCES`] non-empty strings.
    pub stop: Vec<String>,
    pub stream: bool,
    /// `stream_options.include_usage`; only ever true when `stream` is.
    pub include_usage: bool,
    /// vLLM's `ignore_eos` extension: generate past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// The `user` field, kept for logging only.
    pub user: Option<String>,
    pub speculative: Option<SpecOverride>,
}

/// Parses a `POST /v1/chat/completions` body.
///
/// Errors (all 400, `param` naming the field): body not JSON or not an
/// object; `model` missing or not a string; `messages` missing, empty, or
/// with a bad role or content (content is a string or an array of
/// `{"type":"text","text":..}` parts, joined with `\n`); `logprobs: true` or
/// any `top_logprobs`; plus every check of the shared fields (see
/// [`ValidRequest`]).
pub fn parse_chat(body: &[u8]) -> Result<ValidRequest, ApiError> {
    let map = parse_object(body)?;
    let model = parse_model(&map)?;
    let messages = parse_messages(&map)?;
    if let Some(v) = get(&map, "logprobs") {
        if as_bool(v, "logprobs")? {
            return Err(ApiError::unsupported(
                "logprobs",
                "logprobs is not supported by this server.",
            ));
        }
    }
    if get(&map, "top_logprobs").is_some() {
        return Err(ApiError::unsupported(
            "top_logprobs",
            "top_logprobs is not supported by this server.",
        ));
    }
    parse_common(&map, model, Input::Chat(messages), None)
}

/// Parses a `POST /v1/completions` body.
///
/// Errors (all 400, `param` naming the field): body not JSON or not an
/// object; `model` missing or not a string; `prompt` missing or not a string
/// or a list of exactly one string; `logprobs` set (an integer or `true`);
/// `echo: true`; `best_of` > 1; a non-empty `suffix`; plus every check of
/// the shared fields (see [`ValidRequest`]).
pub fn parse_completion(body: &[u8]) -> Result<ValidRequest, ApiError> {
    let map = parse_object(body)?;
    let model = parse_model(&map)?;
    let prompt = parse_prompt(&map)?;
    match get(&map, "logprobs") {
        None | Some(Value::Bool(false)) => {}
        Some(v) => {
            if !v.is_boolean() {
                as_int(v, "logprobs")?;
            }
            return Err(ApiError::unsupported(
                "logprobs",
                "logprobs is not supported by this server.",
            ));
        }
    }
    if let Some(v) = get(&map, "echo") {
        if as_bool(v, "echo")? {
            return Err(ApiError::unsupported(
                "echo",
                "echo is not supported by this server.",
            ));
        }
    }
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
    parse_common(
        &map,
        model,
        Input::Prompt(prompt),
        Some(COMPLETION_DEFAULT_MAX_TOKENS),
    )
}

pub(super) fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "We could not parse the JSON body of your request: {e}."
        ))
    })?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::bad_request(format!(
            "The request body must be a JSON object, but got {} instead.",
            kind_of(&other)
        ))),
    }
}

/// The fields both endpoints share.
fn parse_common(
    map: &Map<String, Value>,
    model: String,
    input: Input,
    default_max_tokens: Option<usize>,
) -> Result<ValidRequest, ApiError> {
    let max_tokens = opt_positive(map, "max_tokens")?;
    let max_completion_tokens = opt_positive(map, "max_completion_tokens")?;
    let max_tokens = max_completion_tokens.or(max_tokens).or(default_max_tokens);

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

    let user = match get(map, "user") {
        Some(v) => Some(as_str(v, "user")?.to_owned()),
        None => None,
    };

    Ok(ValidRequest {
        model,
        input,
        max_tokens,
        sampling: parse_sampling(map)?,
        stop: parse_stop(map)?,
        stream,
        include_usage,
        ignore_eos,
        user,
        speculative: parse_speculative(map)?,
    })
}

fn parse_model(map: &Map<String, Value>) -> Result<String, ApiError> {
    match get(map, "model") {
        Some(v) => Ok(as_str(v, "model")?.to_owned()),
        None => Err(missing("model")),
    }
}

pub(super) fn parse_messages(map: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let v = get(map, "messages").ok_or_else(|| missing("messages"))?;
    let items = v
        .as_array()
        .ok_or_else(|| type_err("messages", "an array", v))?;
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect()
}

fn parse_message(i: usize, v: &Value) -> Result<ChatMessage, ApiError> {
    let here = format!("messages[{i}]");
    let m = v
        .as_object()
        .ok_or_else(|| type_err(&here, "an object", v))?;
    let role_param = format!("{here}.role");
    let role = get(m, "role").ok_or_else(|| missing(&role_param))?;
    let role = match as_str(role, &role_param)? {
        r @ ("system" | "user" | "assistant") => r,
        // OpenAI's newer name for the system turn.
        "developer" => "system",
        other => {
            return Err(ApiError::invalid(
                role_param,
                format!(
                    "Invalid value '{other}' for '{here}.role': supported roles are \
                     'system', 'user' and 'assistant'."
                ),
            ))
        }
    };
    let content_param = format!("{here}.content");
    let content = match get(m, "content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_parts(&content_param, parts)?,
        Some(other) => {
            return Err(type_err(
                &content_param,
                "a string or an array of text parts",
                other,
            ))
        }
        // An assistant turn may come without content (OpenAI allows it).
        None if role == "assistant" => String::new(),
        None => return Err(missing(&content_param)),
    };
    Ok(ChatMessage::new(role, content))
}

/// Joins `[{"type":"text","text":..}, ..]` with `\n` (as vLLM does); any
/// other part is an error naming `param` (`messages[i].content`).
fn text_parts(param: &str, parts: &[Value]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let bad = |what: String| {
            ApiError::invalid(
                param,
                format!("Invalid content part {j} of '{param}': {what}."),
            )
        };
        let obj = part
            .as_object()
            .ok_or_else(|| bad(format!("expected an object, but got {}", kind_of(part))))?;
        match get(obj, "type") {
            Some(Value::String(t)) if t == "text" => {}
            Some(Value::String(t)) => {
                return Err(bad(format!(
                    "content part type '{t}' is not supported; only 'text' parts are"
                )))
            }
            Some(t) => {
                return Err(bad(format!(
                    "'type' must be a string, but got {}",
                    kind_of(t)
                )))
            }
            None => return Err(bad("missing 'type'".into())),
        }
        match get(obj, "text") {
            Some(Value::String(s)) => texts.push(s.as_str()),
            Some(t) => {
                return Err(bad(format!(
                    "'text' must be a string, but got {}",
                    kind_of(t)
                )))
            }
            None => return Err(bad("missing 'text'".into())),
        }
    }
    Ok(texts.join("\n"))
}

fn parse_prompt(map: &Map<String, Value>) -> Result<String, ApiError> {
    match get(map, "prompt") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => Ok(s.clone()),
            [other] => Err(ApiError::invalid(
                "prompt",
                format!(
                    "Invalid 'prompt': a list prompt must hold one string, but got {} instead.",
                    kind_of(other)
                ),
            )),
            _ => Err(ApiError::invalid(
                "prompt",
                format!(
                    "Invalid 'prompt': a list of exactly one string is supported, but got {} items.",
                    items.len()
                ),
            )),
        },
        Some(other) => Err(type_err("prompt", "a string", other)),
        None => Err(missing("prompt")),
    }
}

fn parse_sampling(map: &Map<String, Value>) -> Result<SamplingParams, ApiError> {
    let mut s = SamplingParams {
        temperature: DEFAULT_TEMPERATURE,
        ..SamplingParams::default()
    };
    if let Some(v) = get(map, "temperature") {
        let t = as_number(v, "temperature")?;
        if !(0.0..=MAX_TEMPERATURE as f64).contains(&t) {
            return Err(ApiError::invalid(
                "temperature",
                format!(
                    "Invalid 'temperature': expected a value between 0 and 2, but got {t} instead."
                ),
            ));
        }
        s.temperature = t as f32;
    }
    if let Some(v) = get(map, "top_p") {
        let p = as_number(v, "top_p")?;
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("Invalid 'top_p': expected a value in (0, 1], but got {p} instead."),
            ));
        }
        s.top_p = p as f32;
    }
    if let Some(v) = get(map, "top_k") {
        let k = as_int(v, "top_k")?;
        s.top_k = match k {
            -1 | 0 => 0,
            k if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            k => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("Invalid 'top_k': expected a value >= 0 (0 or -1 turn it off), but got {k} instead."),
                ))
            }
        };
    }
    if let Some(v) = get(map, "seed") {
        let seed = as_int(v, "seed")?;
        s.seed = Some(u64::try_from(seed).map_err(|_| {
            ApiError::invalid(
                "seed",
                format!("Invalid 'seed': expected a value between 0 and 2^64-1, but got {seed} instead."),
            )
        })?);
    }
    Ok(s)
}

fn parse_stop(map: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
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
        Some(Value::String(s)) if s.is_empty() => Err(empty()),
        Some(Value::String(s)) if s.len() > MAX_STOP_BYTES => Err(long(s)),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => {
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
                    Value::String(s) if s.is_empty() => Err(empty()),
                    Value::String(s) if s.len() > MAX_STOP_BYTES => Err(long(s)),
                    Value::String(s) => Ok(s.clone()),
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

fn parse_stream_options(map: &Map<String, Value>, stream: bool) -> Result<bool, ApiError> {
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
    match get(opts, "include_usage") {
        Some(v) => as_bool(v, "stream_options.include_usage"),
        None => Ok(false),
    }
}

fn parse_speculative(map: &Map<String, Value>) -> Result<Option<SpecOverride>, ApiError> {
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
    let method = match get(obj, "method") {
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
    let num_tokens = match get(obj, "num_tokens") {
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

// ---- field helpers: every error names `param` ----

/// The field's value; `null` counts as absent.
pub(super) fn get<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

pub(super) fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a decimal number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(super) fn type_err(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "Invalid type for '{param}': expected {expected}, but got {} instead.",
            kind_of(got)
        ),
    )
}

pub(super) fn missing(param: &str) -> ApiError {
    ApiError::invalid(param, format!("Missing required parameter: '{param}'."))
}

fn below_min(param: &str, min: i128, got: i128) -> ApiError {
    ApiError::invalid(
        param,
        format!("Invalid '{param}': integer below minimum value. Expected a value >= {min}, but got {got} instead."),
    )
}

pub(super) fn as_bool(v: &Value, param: &str) -> Result<bool, ApiError> {
    v.as_bool().ok_or_else(|| type_err(param, "a boolean", v))
}

pub(super) fn as_str<'a>(v: &'a Value, param: &str) -> Result<&'a str, ApiError> {
    v.as_str().ok_or_else(|| type_err(param, "a string", v))
}

fn as_number(v: &Value, param: &str) -> Result<f64, ApiError> {
    v.as_f64()
        .filter(|_| v.is_number())
        .ok_or_else(|| type_err(param, "a number", v))
}

/// An integer (a decimal such as `1.5` or `2.0` is refused).
pub(super) fn as_int(v: &Value, param: &str) -> Result<i128, ApiError> {
    v.as_i64()
        .map(i128::from)
        .or_else(|| v.as_u64().map(i128::from))
        .ok_or_else(|| type_err(param, "an integer", v))
}

/// An optional integer >= 1, as a `usize`.
fn opt_positive(map: &Map<String, Value>, param: &str) -> Result<Option<usize>, ApiError> {
    let Some(v) = get(map, param) else {
        return Ok(None);
    };
    let n = as_int(v, param)?;
    if n < 1 {
        return Err(below_min(param, 1, n));
    }
    Ok(Some(usize::try_from(n).unwrap_or(usize::MAX)))
}
