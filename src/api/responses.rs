//! OpenAI's Responses API on the wire: a `POST /v1/responses` body parsed
//! into the one [`ValidRequest`] (chat turns, sampling, tools, the output
//! format, the reasoning switch), so it runs on exactly the pipeline chat
//! completions run on, plus what only this API has: `instructions`,
//! `store` and `previous_response_id` (resolved by the http layer's
//! response store), and the request fields a response echoes back.
//!
//! Input items become chat turns (`responses_input.rs`).
//! Every other item, part or field is refused with a 400 naming it.

use serde_json::{json, Value};

use super::error::ApiError;
use super::json::{
    as_bool, as_int, as_str, get, kind_of, missing, parse_object, reject_unknown, type_err,
};
use super::json::{read_value, Json, Obj, RawJson};
use super::request::{
    parse_speculative, RequestMeta, ValidRequest, MAX_METADATA_KEY, MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
};
use super::responses_input::{parse_input, Items};
use super::sampling::parse_sampling;
use super::tools::{valid_name, ResponseFormat, Tool, ToolChoice, ToolSetup, MAX_TOOLS};
use super::REASONING_EFFORTS;
use crate::tokenizer::ChatMessage;

/// Top-level fields of `POST /v1/responses` this server reads: each is
/// honoured or refused with a reason.
pub const KNOWN_RESPONSES_FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "metadata",
    "user",
    "safety_identifier",
    "stream",
    "stream_options",
    "store",
    "previous_response_id",
    "truncation",
    "include",
    "background",
    "max_tool_calls",
    "prompt",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "top_logprobs",
    "conversation",
    // specgate's extension.
    "speculative",
];

/// A parsed Responses request.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesRequest {
    /// The chat request it runs as; its turns are the new `input` only
    /// ([`assemble`] adds `instructions` and the stored conversation).
    pub valid: ValidRequest,
    pub instructions: Option<String>,
    /// `store` (default true, as OpenAI's).
    pub store: bool,
    pub previous_response_id: Option<String>,
    /// The request fields a response object repeats (`tools`,
    /// `tool_choice`, `text`, `reasoning`, `metadata`, `temperature`, ...),
    /// as the response shows them.
    pub echo: Echo,
}

/// The request fields a response object repeats, each kept as the JSON
/// text the request gave (a `tools` list can be most of a body: kept as
/// text it costs its size, not a tree's 30x), in the order they are read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Echo(Vec<(&'static str, RawJson)>);

impl Echo {
    /// The field's value, decoded.
    pub fn get(&self, key: &str) -> Option<Value> {
        self.0
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_value())
    }

    /// The fields and their JSON text, in order.
    pub fn fields(&self) -> impl Iterator<Item = (&'static str, &RawJson)> + '_ {
        self.0.iter().map(|(k, v)| (*k, v))
    }
}

impl serde::Serialize for Echo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, &v.to_value())?;
        }
        m.end()
    }
}

/// Parses a `POST /v1/responses` body.
///
/// Errors (400, `param` naming the field, `input[2].content[0].type`):
/// body not a JSON object; a field not in [`KNOWN_RESPONSES_FIELDS`];
/// `model` or `input` missing; an unknown item or part type (images,
/// files, hosted tools' items, `item_reference`); a bad tool,
/// `tool_choice`, `text.format` or `reasoning`; fields this server cannot
/// honour (`background`, `prompt`, `conversation`, `max_tool_calls`,
/// `truncation: auto`, `include` values, `top_logprobs` > 0).
pub fn parse_responses_request(body: &[u8]) -> Result<ResponsesRequest, ApiError> {
    let map = parse_object(body)?;
    reject_unknown(&map, KNOWN_RESPONSES_FIELDS)?;
    let model = as_str(get(&map, "model").ok_or_else(|| missing("model"))?, "model")?.to_owned();
    refuse_unsupported(&map)?;
    let input = get(&map, "input").ok_or_else(|| missing("input"))?;
    let messages = parse_input(input, Items::Input)?;
    let mut v = ValidRequest::chat_defaults(model, messages);
    if let Some(m) = get(&map, "max_output_tokens") {
        let n = as_int(m, "max_output_tokens")?;
        if n < 1 {
            return Err(ApiError::invalid(
                "max_output_tokens",
                format!("Invalid 'max_output_tokens': expected a value >= 1, but got {n}."),
            ));
        }
        v.max_tokens = Some(usize::try_from(n).unwrap_or(usize::MAX));
    }
    v.sampling = parse_sampling(&map)?;
    v.stream = match get(&map, "stream") {
        Some(s) => as_bool(s, "stream")?,
        None => false,
    };
    if let Some(o) = get(&map, "stream_options") {
        let obj = o
            .as_object()
            .ok_or_else(|| type_err("stream_options", "an object", o))?;
        if !v.stream {
            return Err(ApiError::invalid(
                "stream_options",
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            ));
        }
        if let Some(k) = obj.keys().find(|k| *k != "include_obfuscation") {
            let p = format!("stream_options.{k}");
            return Err(ApiError::invalid(
                &p,
                format!("Unrecognized argument supplied: '{p}'."),
            ));
        }
        if let Some(b) = get(&obj, "include_obfuscation") {
            if as_bool(b, "stream_options.include_obfuscation")? {
                return Err(ApiError::unsupported(
                    "stream_options.include_obfuscation",
                    "Stream obfuscation is not available on this server; set it to false.",
                ));
            }
        }
    }
    v.tools = parse_tools(&map)?;
    v.response_format = parse_text(&map)?;
    if let Some(effort) = parse_reasoning(&map)? {
        v.knobs.reasoning_effort = Some(effort);
        v.knobs.effort_param = Some("reasoning.effort");
    }
    v.meta = parse_meta(&map)?;
    v.speculative = parse_speculative(&map)?;
    let instructions = get(&map, "instructions")
        .map(|i| as_str(i, "instructions").map(str::to_owned))
        .transpose()?;
    let store = match get(&map, "store") {
        Some(s) => as_bool(s, "store")?,
        None => true,
    };
    let previous_response_id = get(&map, "previous_response_id")
        .map(|p| as_str(p, "previous_response_id").map(str::to_owned))
        .transpose()?;
    let mut echo = Echo::default();
    for k in [
        "instructions",
        "max_output_tokens",
        "metadata",
        "parallel_tool_calls",
        "previous_response_id",
        "reasoning",
        "temperature",
        "text",
        "tool_choice",
        "tools",
        "top_p",
        "user",
    ] {
        if let Some(val) = get(&map, k) {
            echo.0.push((k, val.raw()));
        }
    }
    Ok(ResponsesRequest {
        valid: v,
        instructions,
        store,
        previous_response_id,
        echo,
    })
}

/// The new turns of a response, checked against the conversation they
/// continue (`prior`, the stored turns of `previous_response_id`): each
/// `function_call_output` must answer a call made earlier, and each `tool`
/// turn without a name is named after the call it answers (the stored
/// turns already are). Linear: the calls so far are a map from id to name.
///
/// Errors: a 400 naming `input` when a `function_call_output` answers no
/// call of the conversation.
pub fn continue_turns(
    prior: &[&ChatMessage],
    mut new: Vec<ChatMessage>,
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut calls: std::collections::HashMap<&str, String> = prior
        .iter()
        .flat_map(|m| m.tool_calls.iter())
        .map(|c| (c.id.as_str(), c.function.name.clone()))
        .collect();
    let mut named: Vec<(usize, String)> = Vec::new();
    for (i, m) in new.iter().enumerate() {
        calls.extend(
            m.tool_calls
                .iter()
                .map(|c| (c.id.as_str(), c.function.name.clone())),
        );
        if let Some(id) = m.tool_call_id.as_deref() {
            let Some(name) = calls.get(id) else {
                return Err(ApiError::invalid(
                    "input",
                    format!(
                        "No tool output found for function call {id}: a 'function_call_output' \
                         must answer a 'function_call' earlier in the conversation."
                    ),
                ));
            };
            if m.role == "tool" && m.name.is_none() {
                named.push((i, name.clone()));
            }
        }
    }
    for (i, name) in named {
        new[i].name = Some(name);
    }
    Ok(new)
}

/// The turns a response's prompt is rendered from: `instructions` as the
/// system turn (they never carry over from a previous response, as in
/// OpenAI's API), the stored conversation, then the new turns. Reasoning
/// is copied only into the turns `keeps` names (by index in the result and
/// the index of its last `user` turn): what the template does not write
/// is not copied for it.
pub fn prompt_turns(
    instructions: Option<&str>,
    prior: &[&ChatMessage],
    new: &[ChatMessage],
    keeps: impl Fn(usize, Option<usize>) -> bool,
) -> Vec<ChatMessage> {
    let first = usize::from(instructions.is_some());
    let all = || prior.iter().copied().chain(new.iter());
    let is_user = |m: &ChatMessage| m.role == "user";
    let last_user = new
        .iter()
        .rposition(is_user)
        .map(|i| i + prior.len())
        .or_else(|| prior.iter().rposition(|m| is_user(m)))
        .map(|i| i + first);
    let mut out = Vec::with_capacity(first + prior.len() + new.len());
    if let Some(i) = instructions {
        out.push(ChatMessage::new("system", i));
    }
    for (i, m) in all().enumerate() {
        let keep = keeps(i + first, last_user);
        out.push(ChatMessage {
            role: m.role.clone(),
            content: m.content.clone(),
            tool_calls: m.tool_calls.clone(),
            tool_call_id: m.tool_call_id.clone(),
            name: m.name.clone(),
            reasoning_content: m.reasoning_content.clone().filter(|_| keep),
        });
    }
    out
}

/// The turns a response's `output` items read back as: the conversion
/// `input` items go through, so the stored conversation of a response
/// equals the one a client builds by resending its output. No turns for
/// an empty output (nothing was written).
pub fn output_turns(output: &Value) -> Vec<ChatMessage> {
    match output {
        Value::Array(items) if !items.is_empty() => {
            // Our own items always parse; a failure would be a bug, and
            // the response is still answered.
            read_value(output, |output| parse_input(output, Items::OwnOutput)).unwrap_or_else(|e| {
                tracing::error!(error = %e.message, "a response's own output did not read back");
                Vec::new()
            })
        }
        _ => Vec::new(),
    }
}

fn refuse_unsupported(map: &Obj) -> Result<(), ApiError> {
    let refuse = |p: &str, why: &str| {
        Err(ApiError::unsupported(
            p,
            format!("'{p}' is not supported: {why}"),
        ))
    };
    if let Some(b) = get(map, "background") {
        if as_bool(b, "background")? {
            return refuse(
                "background",
                "responses run in the foreground on this server.",
            );
        }
    }
    for (k, why) in [
        ("prompt", "this server stores no prompt templates."),
        (
            "conversation",
            "this server keeps no conversation objects; use 'previous_response_id'.",
        ),
        (
            "max_tool_calls",
            "the model's calls are not capped by count on this server.",
        ),
    ] {
        if get(map, k).is_some() {
            return refuse(k, why);
        }
    }
    if let Some(t) = get(map, "truncation") {
        match as_str(t, "truncation")? {
            "disabled" => {}
            "auto" => {
                return refuse(
                    "truncation",
                    "this server never drops input to fit; a prompt over the context is a 400.",
                )
            }
            other => {
                return Err(ApiError::invalid(
                    "truncation",
                    format!(
                        "Invalid value '{other}' for 'truncation': expected 'auto' or 'disabled'."
                    ),
                ))
            }
        }
    }
    if let Some(inc) = get(map, "include") {
        let items = inc
            .as_array()
            .ok_or_else(|| type_err("include", "an array", inc))?;
        if let Some(first) = items.first() {
            let name = as_str(first, "include[0]")?;
            return Err(ApiError::unsupported(
                "include",
                format!("'include' value '{name}' is not supported: responses carry no extra data here."),
            ));
        }
    }
    if let Some(n) = get(map, "top_logprobs") {
        if as_int(n, "top_logprobs")? != 0 {
            return refuse(
                "top_logprobs",
                "log-probabilities are served by /v1/chat/completions.",
            );
        }
    }
    if let Some(t) = get(map, "service_tier") {
        match as_str(t, "service_tier")? {
            "auto" | "default" => {}
            other => {
                return refuse(
                    "service_tier",
                    &format!("this server has one tier ('auto' or 'default'), but got '{other}'."),
                )
            }
        }
    }
    for k in ["prompt_cache_key", "prompt_cache_retention"] {
        // Prefix caching is automatic: a key is accepted and not needed.
        if let Some(v) = get(map, k) {
            as_str(v, k)?;
        }
    }
    Ok(())
}

/// `tools` (function tools: `name`, `description`, `parameters`,
/// `strict`), `tool_choice` and `parallel_tool_calls`.
fn parse_tools(map: &Obj) -> Result<ToolSetup, ApiError> {
    let mut setup = ToolSetup {
        parallel: true,
        ..ToolSetup::default()
    };
    if let Some(v) = get(map, "tools") {
        let items = v
            .as_array()
            .ok_or_else(|| type_err("tools", "an array", v))?;
        if items.len() > MAX_TOOLS {
            return Err(ApiError::invalid(
                "tools",
                format!(
                    "Invalid 'tools': at most {MAX_TOOLS} tools, but got {}.",
                    items.len()
                ),
            ));
        }
        for (i, item) in items.iter().enumerate() {
            let at = format!("tools[{i}]");
            let obj = item
                .as_object()
                .ok_or_else(|| type_err(&at, "an object", item))?;
            let tp = format!("{at}.type");
            let t = as_str(get(&obj, "type").ok_or_else(|| missing(&tp))?, &tp)?;
            if t != "function" {
                return Err(ApiError::unsupported(
                    &tp,
                    format!("Invalid value '{t}' for '{tp}': only 'function' tools are supported on this server."),
                ));
            }
            if let Some(k) = obj
                .keys()
                .find(|k| !["type", "name", "description", "parameters", "strict"].contains(k))
            {
                let p = format!("{at}.{k}");
                return Err(ApiError::invalid(
                    &p,
                    format!("Unrecognized argument supplied: '{p}'."),
                ));
            }
            let np = format!("{at}.name");
            let name = as_str(get(&obj, "name").ok_or_else(|| missing(&np))?, &np)?;
            if !valid_name(name) {
                return Err(ApiError::invalid(
                    &np,
                    format!("Invalid '{np}': '{name}' does not match '^[a-zA-Z0-9_-]{{1,64}}$'."),
                ));
            }
            if setup.tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    &np,
                    format!("Invalid '{np}': the tool name '{name}' is declared twice."),
                ));
            }
            let description = get(&obj, "description")
                .map(|d| as_str(d, &format!("{at}.description")).map(str::to_owned))
                .transpose()?;
            let parameters = match get(&obj, "parameters") {
                None => None,
                Some(p) if p.is_object() => Some(p.raw()),
                Some(p) => return Err(type_err(&format!("{at}.parameters"), "an object", p)),
            };
            let strict = match get(&obj, "strict") {
                Some(s) => as_bool(s, &format!("{at}.strict"))?,
                None => false,
            };
            setup.tools.push(Tool {
                name: name.to_owned(),
                description,
                parameters,
                strict,
            });
        }
    }
    if let Some(p) = get(map, "parallel_tool_calls") {
        setup.parallel = as_bool(p, "parallel_tool_calls")?;
    }
    const P: &str = "tool_choice";
    let needs_tools = |what: &str| {
        ApiError::invalid(
            P,
            format!("Invalid '{P}': {what} requires 'tools' to declare at least one tool."),
        )
    };
    setup.choice = match get(map, P) {
        None | Some(Json::String(_)) if setup.tools.is_empty() => match get(map, P) {
            Some(Json::String(s)) if s == "required" => return Err(needs_tools("'required'")),
            Some(Json::String(s)) if s != "none" && s != "auto" => {
                return Err(ApiError::invalid(P, format!("Invalid value '{s}' for '{P}': expected 'none', 'auto', 'required' or a function object.")))
            }
            _ => ToolChoice::None,
        },
        None => ToolChoice::Auto,
        Some(Json::String(s)) => match s.as_ref() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(P, format!("Invalid value '{other}' for '{P}': expected 'none', 'auto', 'required' or a function object.")))
            }
        },
        Some(Json::Object(obj)) => {
            let obj = obj.entries();
            match get(&obj, "type").and_then(Json::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(ApiError::unsupported(
                        "tool_choice.type",
                        format!("Invalid value '{other}' for 'tool_choice.type': only 'function' is supported on this server."),
                    ))
                }
                None => return Err(missing("tool_choice.type")),
            }
            if let Some(k) = obj.keys().find(|k| *k != "type" && *k != "name") {
                let p = format!("{P}.{k}");
                return Err(ApiError::invalid(&p, format!("Unrecognized argument supplied: '{p}'.")));
            }
            let name = as_str(get(&obj, "name").ok_or_else(|| missing("tool_choice.name"))?, "tool_choice.name")?;
            if setup.tools.is_empty() {
                return Err(needs_tools("a function choice"));
            }
            if !setup.tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice.name",
                    format!("Invalid 'tool_choice.name': no tool named '{name}' is declared in 'tools'."),
                ));
            }
            ToolChoice::Function(name.to_owned())
        }
        Some(other) => return Err(type_err(P, "a string or an object", other)),
    };
    Ok(setup)
}

/// `text`: `{"format": {"type": "text" | "json_object" | "json_schema",
/// "name", "schema", "strict", "description"}, "verbosity"}`.
fn parse_text(map: &Obj) -> Result<ResponseFormat, ApiError> {
    let Some(v) = get(map, "text") else {
        return Ok(ResponseFormat::Text);
    };
    let obj = v
        .as_object()
        .ok_or_else(|| type_err("text", "an object", v))?;
    if let Some(k) = obj.keys().find(|k| *k != "format" && *k != "verbosity") {
        let p = format!("text.{k}");
        return Err(ApiError::invalid(
            &p,
            format!("Unrecognized argument supplied: '{p}'."),
        ));
    }
    if let Some(verb) = get(&obj, "verbosity") {
        if as_str(verb, "text.verbosity")? != "medium" {
            return Err(ApiError::unsupported(
                "text.verbosity",
                "'text.verbosity' is not supported: the served model has no verbosity control.",
            ));
        }
    }
    let Some(f) = get(&obj, "format") else {
        return Ok(ResponseFormat::Text);
    };
    const F: &str = "text.format";
    let f = f.as_object().ok_or_else(|| type_err(F, "an object", f))?;
    let t = as_str(
        get(&f, "type").ok_or_else(|| missing("text.format.type"))?,
        "text.format.type",
    )?;
    let keys: &[&str] = match t {
        "json_schema" => &["type", "name", "schema", "strict", "description"],
        "text" | "json_object" => &["type"],
        other => {
            return Err(ApiError::invalid(
                "text.format.type",
                format!("Invalid value '{other}' for 'text.format.type': expected 'text', 'json_object' or 'json_schema'."),
            ))
        }
    };
    if let Some(k) = f.keys().find(|k| !keys.contains(k)) {
        let p = format!("{F}.{k}");
        return Err(ApiError::invalid(
            &p,
            format!("Unrecognized argument supplied: '{p}'."),
        ));
    }
    match t {
        "text" => Ok(ResponseFormat::Text),
        "json_object" => Ok(ResponseFormat::JsonObject),
        _ => {
            let np = "text.format.name";
            let name = as_str(get(&f, "name").ok_or_else(|| missing(np))?, np)?;
            if !valid_name(name) {
                return Err(ApiError::invalid(
                    np,
                    format!("Invalid '{np}': '{name}' does not match '^[a-zA-Z0-9_-]{{1,64}}$'."),
                ));
            }
            let schema = match get(&f, "schema") {
                Some(s) if s.is_object() => s.to_value(),
                Some(s) => return Err(type_err("text.format.schema", "an object", s)),
                None => return Err(missing("text.format.schema")),
            };
            let strict = match get(&f, "strict") {
                Some(s) => as_bool(s, "text.format.strict")?,
                None => false,
            };
            if let Some(d) = get(&f, "description") {
                as_str(d, "text.format.description")?;
            }
            Ok(ResponseFormat::JsonSchema {
                name: name.to_owned(),
                schema,
                strict,
            })
        }
    }
}

/// `reasoning`: `{"effort", "summary"}`; the effort (one of
/// [`REASONING_EFFORTS`]) when given. `summary` may be `auto` (this
/// server writes no summaries: the reasoning comes whole, as
/// `reasoning_text`); `concise` and `detailed` are refused.
fn parse_reasoning(map: &Obj) -> Result<Option<String>, ApiError> {
    let Some(v) = get(map, "reasoning") else {
        return Ok(None);
    };
    let obj = v
        .as_object()
        .ok_or_else(|| type_err("reasoning", "an object", v))?;
    if let Some(k) = obj
        .keys()
        .find(|k| !["effort", "summary", "generate_summary"].contains(k))
    {
        let p = format!("reasoning.{k}");
        return Err(ApiError::invalid(
            &p,
            format!("Unrecognized argument supplied: '{p}'."),
        ));
    }
    for k in ["summary", "generate_summary"] {
        if let Some(s) = get(&obj, k) {
            let p = format!("reasoning.{k}");
            if as_str(s, &p)? != "auto" {
                return Err(ApiError::unsupported(
                    &p,
                    format!("'{p}' may only be 'auto': this server returns the reasoning text itself, not a summary."),
                ));
            }
        }
    }
    let Some(e) = get(&obj, "effort") else {
        return Ok(None);
    };
    let e = as_str(e, "reasoning.effort")?;
    if !REASONING_EFFORTS.contains(&e) {
        return Err(ApiError::invalid(
            "reasoning.effort",
            format!(
                "Invalid value '{e}' for 'reasoning.effort': expected one of {}.",
                REASONING_EFFORTS.join(", ")
            ),
        ));
    }
    Ok(Some(e.to_owned()))
}

/// `user`, `safety_identifier`, `metadata` (at most 16 string pairs).
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
                format!("Invalid 'metadata': at most {MAX_METADATA_PAIRS} pairs are allowed."),
            ));
        }
        for (k, val) in obj.iter() {
            let val = val.as_str().ok_or_else(|| {
                ApiError::invalid(
                    "metadata",
                    format!(
                        "Invalid 'metadata.{k}': expected a string, but got {}.",
                        kind_of(val)
                    ),
                )
            })?;
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

/// The request fields a response object repeats, with OpenAI's defaults
/// for the ones the request left out, in the order the object shows them.
pub fn echoed_fields(r: &ResponsesRequest) -> Echo {
    let e = &r.echo;
    let given = |k: &'static str, d: Value| -> (&'static str, RawJson) {
        match e.0.iter().find(|(key, _)| *key == k) {
            Some((_, v)) => (k, v.clone()),
            None => (k, RawJson::from(&d)),
        }
    };
    Echo(vec![
        given("instructions", Value::Null),
        given("max_output_tokens", Value::Null),
        given("metadata", json!({})),
        given("parallel_tool_calls", json!(true)),
        given("previous_response_id", Value::Null),
        given("reasoning", json!({"effort": null, "summary": null})),
        ("store", RawJson::from(&json!(r.store))),
        given("temperature", json!(1.0)),
        given("text", json!({"format": {"type": "text"}})),
        given("tool_choice", json!("auto")),
        given("tools", json!([])),
        given("top_p", json!(1.0)),
        ("truncation", RawJson::from(&json!("disabled"))),
        given("user", Value::Null),
    ])
}

#[cfg(test)]
#[path = "responses_tests.rs"]
mod tests;
