//! Anthropic's Messages API on the wire: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens` bodies parsed into the one
//! [`ValidRequest`] (chat turns, sampling, tools, the thinking switch), so
//! they run on exactly the pipeline chat completions run on.
//!
//! Every field is honoured or refused with a 400 naming it (Anthropic's
//! dotted paths, `messages.1.content.0.tool_use_id`); the error body is
//! Anthropic's (`ApiError::to_anthropic_json`). How blocks become chat
//! turns: `system` -> one system turn; a user message's `tool_result`
//! blocks -> one `tool` turn each (in order, between the user text around
//! them); an assistant message's `thinking` -> its `reasoning_content`,
//! `tool_use` -> its `tool_calls`. A `tool_result` must answer a
//! `tool_use` earlier in the conversation. Images, documents and server
//! tools are refused by name.

use super::error::ApiError;
use super::json::{as_bool, as_int, as_str, get, missing, parse_object, reject_unknown, type_err};
use super::json::{Json, Obj};
use super::request::{parse_speculative, RequestMeta, ValidRequest, MAX_STOP_BYTES};
use super::sampling::parse_sampling;
use super::tools::{valid_name, Tool, ToolChoice, ToolSetup, MAX_TOOLS};
use crate::tokenizer::{name_tool_results, ChatMessage};
use std::collections::HashSet;

/// Top-level fields of `POST /v1/messages` this server reads (Anthropic's
/// request, and specgate's `speculative`).
pub const KNOWN_MESSAGES_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "service_tier",
    "container",
    "mcp_servers",
    "context_management",
    "speculative",
];

/// Fields of `POST /v1/messages/count_tokens`.
pub const KNOWN_COUNT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "mcp_servers",
    "context_management",
];

/// Most `stop_sequences` (the server's bound on stop strings).
pub const MAX_STOP_SEQUENCES: usize = super::request::MAX_STOP_SEQUENCES;

/// Smallest `thinking.budget_tokens` (Anthropic's).
pub const MIN_THINKING_BUDGET: usize = 1024;

/// A parsed Messages request.
#[derive(Debug, Clone, PartialEq)]
pub struct MessagesRequest {
    /// The chat request it runs as (`max_tokens` always set).
    pub valid: ValidRequest,
}

/// Parses a `POST /v1/messages` body.
///
/// Errors (400, `param` naming the field in Anthropic's dotted form):
/// body not a JSON object; a field not in [`KNOWN_MESSAGES_FIELDS`];
/// `model`, `max_tokens` or `messages` missing; a bad message, block,
/// tool, `tool_choice` or `thinking`; `temperature` outside `0..=1`;
/// `container`, `mcp_servers`, `context_management` (not available here);
/// a `tool_result` without its `tool_use`; more than `max_messages` turns
/// (`system` and the `messages`, counted before any of them is read, so a
/// huge conversation costs no per-message work).
pub fn parse_messages_request(
    body: &[u8],
    max_messages: usize,
) -> Result<MessagesRequest, ApiError> {
    let map = parse_object(body)?;
    reject_unknown(&map, KNOWN_MESSAGES_FIELDS)?;
    let mut v = parse_conversation(&map, max_messages)?;
    let max = get(&map, "max_tokens").ok_or_else(|| missing("max_tokens"))?;
    let n = as_int(max, "max_tokens")?;
    if n < 1 {
        return Err(ApiError::invalid(
            "max_tokens",
            format!("max_tokens: must be at least 1, but got {n}."),
        ));
    }
    v.max_tokens = Some(usize::try_from(n).unwrap_or(usize::MAX));
    if let Some(budget) = thinking_budget(&map)? {
        if budget >= v.max_tokens.unwrap_or(usize::MAX) {
            return Err(ApiError::invalid(
                "thinking.budget_tokens",
                "thinking.budget_tokens: must be less than max_tokens.",
            ));
        }
    }
    v.stream = match get(&map, "stream") {
        Some(s) => as_bool(s, "stream")?,
        None => false,
    };
    v.sampling = parse_sampling(&map)?;
    if v.sampling.temperature > 1.0 {
        return Err(ApiError::invalid(
            "temperature",
            format!(
                "temperature: must be between 0 and 1, but got {}.",
                v.sampling.temperature
            ),
        ));
    }
    v.stop = parse_stop_sequences(&map)?;
    v.meta = parse_metadata(&map)?;
    v.speculative = parse_speculative(&map)?;
    if let Some(t) = get(&map, "service_tier") {
        match as_str(t, "service_tier")? {
            "auto" | "standard_only" => {}
            other => {
                return Err(ApiError::invalid(
                    "service_tier",
                    format!("service_tier: expected 'auto' or 'standard_only', but got '{other}'."),
                ))
            }
        }
    }
    if get(&map, "container").is_some() {
        return Err(ApiError::unsupported(
            "container",
            "container: code-execution containers are not available on this server.",
        ));
    }
    Ok(MessagesRequest { valid: v })
}

/// Parses a `POST /v1/messages/count_tokens` body into the request whose
/// prompt is counted (`max_tokens` unset: nothing is generated).
///
/// Errors: as [`parse_messages_request`] for the fields it shares, the
/// `max_messages` bound included: counting takes the limits of the request
/// it counts.
pub fn parse_count_tokens(body: &[u8], max_messages: usize) -> Result<ValidRequest, ApiError> {
    let map = parse_object(body)?;
    reject_unknown(&map, KNOWN_COUNT_FIELDS)?;
    let v = parse_conversation(&map, max_messages)?;
    thinking_budget(&map)?;
    Ok(v)
}

/// `model`, `system`, `messages`, `tools`, `tool_choice`, `thinking`, and
/// the refusals both routes share.
fn parse_conversation(map: &Obj, max_messages: usize) -> Result<ValidRequest, ApiError> {
    let model = as_str(get(map, "model").ok_or_else(|| missing("model"))?, "model")?.to_owned();
    for (k, why) in [
        (
            "mcp_servers",
            "MCP servers are not reached from this server",
        ),
        (
            "context_management",
            "context management (clearing earlier tool results) is not available on this server",
        ),
    ] {
        if get(map, k).is_some() {
            return Err(ApiError::unsupported(k, format!("{k}: {why}.")));
        }
    }
    let mut messages = Vec::new();
    if let Some(s) = get(map, "system") {
        let text = match s {
            Json::String(t) => t.to_string(),
            Json::Array(blocks) => text_blocks("system", &blocks.items())?,
            other => {
                return Err(type_err(
                    "system",
                    "a string or an array of text blocks",
                    other,
                ))
            }
        };
        messages.push(ChatMessage::new("system", text));
    }
    parse_turns(map, &mut messages, max_messages)?;
    name_tool_results(&mut messages);
    let mut v = ValidRequest::chat_defaults(model, messages);
    v.tools = parse_tools(map)?;
    if let Some(effort) = thinking_effort(map)? {
        v.knobs.reasoning_effort = Some(effort.to_owned());
        v.knobs.effort_param = Some("thinking");
    }
    Ok(v)
}

/// The `messages` as chat turns, appended to `out` (which holds the
/// `system` turn, if any).
///
/// Errors: those of each message; first, more turns than `max_messages`
/// (each message is at least one turn, so the bound is checked before
/// any message is read, with the words generation uses).
fn parse_turns(map: &Obj, out: &mut Vec<ChatMessage>, max_messages: usize) -> Result<(), ApiError> {
    let v = get(map, "messages").ok_or_else(|| missing("messages"))?;
    let items = v
        .as_array()
        .ok_or_else(|| type_err("messages", "an array", v))?;
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "messages: at least one message is required.",
        ));
    }
    let turns = out.len() + items.len();
    if turns > max_messages {
        return Err(ApiError::too_many_messages(turns, max_messages));
    }
    // The `tool_use` ids so far: a set, so matching each result is O(1).
    let mut call_ids: HashSet<String> = HashSet::new();
    for (i, m) in items.iter().enumerate() {
        let here = format!("messages.{i}");
        let obj = m
            .as_object()
            .ok_or_else(|| type_err(&here, "an object", m))?;
        if let Some(k) = obj.keys().find(|k| *k != "role" && *k != "content") {
            let p = format!("{here}.{k}");
            return Err(ApiError::invalid(
                &p,
                format!("{p}: Extra inputs are not permitted."),
            ));
        }
        let role_p = format!("{here}.role");
        let role = as_str(get(&obj, "role").ok_or_else(|| missing(&role_p))?, &role_p)?;
        if role != "user" && role != "assistant" {
            return Err(ApiError::invalid(
                &role_p,
                format!("{role_p}: expected 'user' or 'assistant', but got '{role}'."),
            ));
        }
        let content_p = format!("{here}.content");
        match get(&obj, "content").ok_or_else(|| missing(&content_p))? {
            Json::String(s) => out.push(ChatMessage::new(role, s.to_string())),
            Json::Array(blocks) if role == "user" => {
                user_blocks(&content_p, &blocks.items(), &call_ids, out)?
            }
            Json::Array(blocks) => {
                let blocks = blocks.items();
                out.push(assistant_blocks(&content_p, &blocks, &mut call_ids)?)
            }
            other => {
                return Err(type_err(
                    &content_p,
                    "a string or an array of content blocks",
                    other,
                ))
            }
        }
    }
    Ok(())
}

/// The type of block `b` at `at`, checked against the keys it may hold.
fn block_type(at: &str, b: &Json, role: &str) -> Result<String, ApiError> {
    let obj = b.as_object().ok_or_else(|| type_err(at, "an object", b))?;
    let type_p = format!("{at}.type");
    let t = as_str(get(&obj, "type").ok_or_else(|| missing(&type_p))?, &type_p)?;
    let keys: &[&str] = match t {
        "text" => &["type", "text", "cache_control", "citations"],
        "tool_use" if role == "assistant" => &["type", "id", "name", "input", "cache_control"],
        "tool_result" if role == "user" => &[
            "type",
            "tool_use_id",
            "content",
            "is_error",
            "cache_control",
        ],
        "thinking" if role == "assistant" => &["type", "thinking", "signature"],
        "image" | "document" | "search_result" | "container_upload" => {
            return Err(ApiError::unsupported(
                &type_p,
                format!("{type_p}: '{t}' blocks are not supported; this server reads text only."),
            ))
        }
        "redacted_thinking" => {
            return Err(ApiError::unsupported(
                &type_p,
                format!("{type_p}: 'redacted_thinking' blocks cannot be read by this server."),
            ))
        }
        "tool_use" | "tool_result" | "thinking" => {
            return Err(ApiError::invalid(
                &type_p,
                format!("{type_p}: '{t}' blocks are not allowed in a '{role}' message."),
            ))
        }
        other => {
            return Err(ApiError::invalid(
                &type_p,
                format!("{type_p}: unknown or unsupported content block type '{other}'."),
            ))
        }
    };
    if let Some(k) = obj.keys().find(|k| !keys.contains(k)) {
        let p = format!("{at}.{k}");
        return Err(ApiError::invalid(
            &p,
            format!("{p}: Extra inputs are not permitted."),
        ));
    }
    if let Some(c) = get(&obj, "cache_control") {
        cache_control(&format!("{at}.cache_control"), c)?;
    }
    if let Some(c) = get(&obj, "citations") {
        if c.as_array().is_some_and(|a| !a.is_empty()) {
            let p = format!("{at}.citations");
            return Err(ApiError::unsupported(
                &p,
                format!("{p}: citations are not supported."),
            ));
        }
    }
    Ok(t.to_owned())
}

/// `cache_control` (`{"type": "ephemeral", "ttl"?}`): accepted, as prefix
/// caching here is automatic for every prompt.
fn cache_control(at: &str, v: &Json) -> Result<(), ApiError> {
    let obj = v.as_object().ok_or_else(|| type_err(at, "an object", v))?;
    match get(&obj, "type") {
        Some(Json::String(t)) if t == "ephemeral" => Ok(()),
        _ => Err(ApiError::invalid(
            format!("{at}.type"),
            format!("{at}.type: expected 'ephemeral'."),
        )),
    }
}

/// The `text` of a text block at `at`.
fn block_text(at: &str, b: &Json) -> Result<String, ApiError> {
    let p = format!("{at}.text");
    let obj = b.as_object().unwrap_or_default();
    as_str(get(&obj, "text").ok_or_else(|| missing(&p))?, &p).map(str::to_owned)
}

/// Text blocks joined with `\n` (`system`, a `tool_result`'s content).
fn text_blocks(at: &str, blocks: &[Json]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(blocks.len());
    for (j, b) in blocks.iter().enumerate() {
        let here = format!("{at}.{j}");
        match block_type(&here, b, "system")?.as_str() {
            "text" => texts.push(block_text(&here, b)?),
            t => {
                return Err(ApiError::invalid(
                    format!("{here}.type"),
                    format!("{here}.type: only 'text' blocks are allowed here, but got '{t}'."),
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

/// A user message's blocks: text runs become user turns, each
/// `tool_result` a tool turn, in order.
fn user_blocks(
    at: &str,
    blocks: &[Json],
    call_ids: &HashSet<String>,
    out: &mut Vec<ChatMessage>,
) -> Result<(), ApiError> {
    let mut text: Vec<String> = Vec::new();
    let flush = |text: &mut Vec<String>, out: &mut Vec<ChatMessage>| {
        if !text.is_empty() {
            out.push(ChatMessage::new("user", text.join("\n")));
            text.clear();
        }
    };
    if blocks.is_empty() {
        out.push(ChatMessage::new("user", ""));
    }
    for (j, b) in blocks.iter().enumerate() {
        let here = format!("{at}.{j}");
        match block_type(&here, b, "user")?.as_str() {
            "text" => text.push(block_text(&here, b)?),
            _ => {
                flush(&mut text, out);
                let obj = b.as_object().unwrap_or_default();
                let id_p = format!("{here}.tool_use_id");
                let id = as_str(
                    get(&obj, "tool_use_id").ok_or_else(|| missing(&id_p))?,
                    &id_p,
                )?;
                if !call_ids.contains(id) {
                    return Err(ApiError::invalid(
                        &id_p,
                        format!(
                            "{id_p}: no tool_use block with id '{id}' comes before this tool_result."
                        ),
                    ));
                }
                let content_p = format!("{here}.content");
                let mut content = match get(&obj, "content") {
                    None => String::new(),
                    Some(Json::String(s)) => s.to_string(),
                    Some(Json::Array(parts)) => text_blocks(&content_p, &parts.items())?,
                    Some(other) => {
                        return Err(type_err(
                            &content_p,
                            "a string or an array of text blocks",
                            other,
                        ))
                    }
                };
                // The model is told the tool failed the only way a chat
                // template can carry it: in the result's text.
                if let Some(e) = get(&obj, "is_error") {
                    if as_bool(e, &format!("{here}.is_error"))? {
                        content.insert_str(0, "Error: ");
                    }
                }
                let mut m = ChatMessage::new("tool", content);
                m.tool_call_id = Some(id.to_owned());
                out.push(m);
            }
        }
    }
    flush(&mut text, out);
    Ok(())
}

/// An assistant message's blocks as one assistant turn.
fn assistant_blocks(
    at: &str,
    blocks: &[Json],
    call_ids: &mut HashSet<String>,
) -> Result<ChatMessage, ApiError> {
    let mut text: Vec<String> = Vec::new();
    let mut msg = ChatMessage::new("assistant", "");
    for (j, b) in blocks.iter().enumerate() {
        let here = format!("{at}.{j}");
        let kind = block_type(&here, b, "assistant")?;
        let obj = b.as_object().unwrap_or_default();
        match kind.as_str() {
            "text" => text.push(block_text(&here, b)?),
            "thinking" => {
                let p = format!("{here}.thinking");
                let t = as_str(get(&obj, "thinking").ok_or_else(|| missing(&p))?, &p)?;
                match &mut msg.reasoning_content {
                    Some(r) => {
                        r.push('\n');
                        r.push_str(t);
                    }
                    None => msg.reasoning_content = Some(t.to_owned()),
                }
            }
            _ => {
                let field = |k: &str| -> Result<&str, ApiError> {
                    let p = format!("{here}.{k}");
                    as_str(get(&obj, k).ok_or_else(|| missing(&p))?, &p)
                };
                let id = field("id")?;
                let name = field("name")?;
                let input_p = format!("{here}.input");
                let input = get(&obj, "input").ok_or_else(|| missing(&input_p))?;
                if !input.is_object() {
                    return Err(type_err(&input_p, "an object", input));
                }
                msg.push_tool_call(id, name, input.to_value());
                call_ids.insert(id.to_owned());
            }
        }
    }
    msg.content = text.join("\n");
    Ok(msg)
}

/// `stop_sequences`: at most [`MAX_STOP_SEQUENCES`] non-empty strings.
fn parse_stop_sequences(map: &Obj) -> Result<Vec<String>, ApiError> {
    const P: &str = "stop_sequences";
    let Some(v) = get(map, P) else {
        return Ok(Vec::new());
    };
    let items = v
        .as_array()
        .ok_or_else(|| type_err(P, "an array of strings", v))?;
    if items.len() > MAX_STOP_SEQUENCES {
        return Err(ApiError::invalid(
            P,
            format!(
                "{P}: this server takes at most {MAX_STOP_SEQUENCES} stop sequences, but got {}.",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let p = format!("{P}.{i}");
            let s = as_str(s, &p)?;
            if s.is_empty() || s.len() > MAX_STOP_BYTES {
                return Err(ApiError::invalid(
                    &p,
                    format!("{p}: must be 1 to {MAX_STOP_BYTES} bytes long."),
                ));
            }
            Ok(s.to_owned())
        })
        .collect()
}

/// `metadata`: `{"user_id": string}` (for the log only).
fn parse_metadata(map: &Obj) -> Result<RequestMeta, ApiError> {
    let mut meta = RequestMeta::default();
    let Some(v) = get(map, "metadata") else {
        return Ok(meta);
    };
    let obj = v
        .as_object()
        .ok_or_else(|| type_err("metadata", "an object", v))?;
    if let Some(k) = obj.keys().find(|k| *k != "user_id") {
        let p = format!("metadata.{k}");
        return Err(ApiError::invalid(
            &p,
            format!("{p}: Extra inputs are not permitted."),
        ));
    }
    if let Some(u) = get(&obj, "user_id") {
        let u = as_str(u, "metadata.user_id")?;
        if u.len() > 256 {
            return Err(ApiError::invalid(
                "metadata.user_id",
                "metadata.user_id: at most 256 characters.",
            ));
        }
        meta.user = Some(u.to_owned());
    }
    Ok(meta)
}

/// `thinking`: `{"type": "enabled", "budget_tokens": n}` (n >= 1024) or
/// `{"type": "disabled"}`; the budget when enabled.
fn thinking_budget(map: &Obj) -> Result<Option<usize>, ApiError> {
    const P: &str = "thinking";
    let Some(v) = get(map, P) else {
        return Ok(None);
    };
    let obj = v.as_object().ok_or_else(|| type_err(P, "an object", v))?;
    let t = as_str(
        get(&obj, "type").ok_or_else(|| missing("thinking.type"))?,
        "thinking.type",
    )?;
    let keys: &[&str] = match t {
        "enabled" => &["type", "budget_tokens"],
        "disabled" => &["type"],
        other => {
            return Err(ApiError::invalid(
                "thinking.type",
                format!("thinking.type: expected 'enabled' or 'disabled', but got '{other}'."),
            ))
        }
    };
    if let Some(k) = obj.keys().find(|k| !keys.contains(k)) {
        let p = format!("thinking.{k}");
        return Err(ApiError::invalid(
            &p,
            format!("{p}: Extra inputs are not permitted."),
        ));
    }
    if t == "disabled" {
        return Ok(None);
    }
    const B: &str = "thinking.budget_tokens";
    let b = as_int(get(&obj, "budget_tokens").ok_or_else(|| missing(B))?, B)?;
    if b < MIN_THINKING_BUDGET as i128 {
        return Err(ApiError::invalid(
            B,
            format!("{B}: must be at least {MIN_THINKING_BUDGET}, but got {b}."),
        ));
    }
    Ok(Some(usize::try_from(b).unwrap_or(usize::MAX)))
}

/// The `reasoning_effort` the `thinking` switch stands for: `none` when
/// disabled; when enabled, the budget's tier (up to 4096 tokens `low`, up
/// to 16384 `high`, more `max`), which the family maps onto its own knob
/// (K3's `thinking_effort`). `None` when absent: the model's default.
fn thinking_effort(map: &Obj) -> Result<Option<&'static str>, ApiError> {
    if get(map, "thinking").is_none() {
        return Ok(None);
    }
    Ok(Some(match thinking_budget(map)? {
        None => "none",
        Some(b) if b <= 4096 => "low",
        Some(b) if b <= 16384 => "high",
        Some(_) => "max",
    }))
}

/// `tools` (custom tools: `name`, `description`, `input_schema`) and
/// `tool_choice` (`auto`, `any`, `tool` with `name`, `none`, each with
/// `disable_parallel_tool_use`).
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
                format!("tools: at most {MAX_TOOLS} tools, but got {}.", items.len()),
            ));
        }
        for (i, item) in items.iter().enumerate() {
            let at = format!("tools.{i}");
            let obj = item
                .as_object()
                .ok_or_else(|| type_err(&at, "an object", item))?;
            if let Some(t) = get(&obj, "type") {
                let t = as_str(t, &format!("{at}.type"))?;
                if t != "custom" {
                    let p = format!("{at}.type");
                    return Err(ApiError::unsupported(
                        &p,
                        format!("{p}: server tool '{t}' is not available; only custom tools (name, description, input_schema) are."),
                    ));
                }
            }
            if let Some(k) = obj.keys().find(|k| {
                ![
                    "type",
                    "name",
                    "description",
                    "input_schema",
                    "cache_control",
                ]
                .contains(k)
            }) {
                let p = format!("{at}.{k}");
                return Err(ApiError::invalid(
                    &p,
                    format!("{p}: Extra inputs are not permitted."),
                ));
            }
            if let Some(c) = get(&obj, "cache_control") {
                cache_control(&format!("{at}.cache_control"), c)?;
            }
            let name_p = format!("{at}.name");
            let name = as_str(get(&obj, "name").ok_or_else(|| missing(&name_p))?, &name_p)?;
            if !valid_name(name) {
                return Err(ApiError::invalid(
                    &name_p,
                    format!("{name_p}: '{name}' does not match '^[a-zA-Z0-9_-]{{1,64}}$'."),
                ));
            }
            if setup.tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    &name_p,
                    format!("{name_p}: the tool name '{name}' is declared twice."),
                ));
            }
            let description = get(&obj, "description")
                .map(|d| as_str(d, &format!("{at}.description")).map(str::to_owned))
                .transpose()?;
            let schema_p = format!("{at}.input_schema");
            let schema = get(&obj, "input_schema").ok_or_else(|| missing(&schema_p))?;
            if !schema.is_object() {
                return Err(type_err(&schema_p, "an object (a JSON schema)", schema));
            }
            setup.tools.push(Tool {
                name: name.to_owned(),
                description,
                parameters: Some(schema.raw()),
                strict: false,
            });
        }
    }
    setup.choice = if setup.tools.is_empty() {
        ToolChoice::None
    } else {
        ToolChoice::Auto
    };
    let Some(v) = get(map, "tool_choice") else {
        return Ok(setup);
    };
    const P: &str = "tool_choice";
    let obj = v.as_object().ok_or_else(|| type_err(P, "an object", v))?;
    let t = as_str(
        get(&obj, "type").ok_or_else(|| missing("tool_choice.type"))?,
        "tool_choice.type",
    )?;
    let keys: &[&str] = match t {
        "tool" => &["type", "name", "disable_parallel_tool_use"],
        "none" => &["type"],
        _ => &["type", "disable_parallel_tool_use"],
    };
    if let Some(k) = obj.keys().find(|k| !keys.contains(k)) {
        let p = format!("{P}.{k}");
        return Err(ApiError::invalid(
            &p,
            format!("{p}: Extra inputs are not permitted."),
        ));
    }
    if let Some(d) = get(&obj, "disable_parallel_tool_use") {
        setup.parallel = !as_bool(d, "tool_choice.disable_parallel_tool_use")?;
    }
    let needs_tools = || {
        ApiError::invalid(
            "tool_choice",
            format!("tool_choice: '{t}' requires 'tools' to declare at least one tool."),
        )
    };
    setup.choice = match t {
        "auto" if setup.tools.is_empty() => ToolChoice::None,
        "auto" => ToolChoice::Auto,
        "none" => ToolChoice::None,
        "any" if setup.tools.is_empty() => return Err(needs_tools()),
        "any" => ToolChoice::Required,
        "tool" => {
            let name = as_str(
                get(&obj, "name").ok_or_else(|| missing("tool_choice.name"))?,
                "tool_choice.name",
            )?;
            if !setup.tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice.name",
                    format!("tool_choice.name: no tool named '{name}' is declared in 'tools'."),
                ));
            }
            ToolChoice::Function(name.to_owned())
        }
        other => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                format!(
                    "tool_choice.type: expected 'auto', 'any', 'tool' or 'none', but got '{other}'."
                ),
            ))
        }
    };
    Ok(setup)
}

#[cfg(test)]
#[path = "anthropic_tests.rs"]
mod tests;
