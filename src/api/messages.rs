//! The `messages` of a chat request: roles `system` (and `developer`, its
//! newer name), `user`, `assistant` (text and/or `tool_calls`) and `tool`
//! (`tool_call_id` + the result), parsed into [`ChatMessage`]s for the chat
//! template. Every error names the exact field (`messages[2].tool_calls[0]
//! .function.arguments`).
//!
//! Keys a message may carry: `role`, `content`, `name`, `tool_calls`
//! (assistant), `tool_call_id` (tool), and the keys of OpenAI's own
//! assistant message that clients echo back: `refusal` (a string, the
//! model's earlier refusal text, not shown to the model again),
//! `annotations` (an array, ignored) and `audio` / `function_call` (only
//! `null`). Any other key is a 400 naming it.

use serde_json::Value;

use super::error::ApiError;
use super::json::{as_str, get, kind_of, missing, type_err};
use super::json::{Json, Obj};
use crate::tokenizer::ChatMessage;

/// Keys a message object may hold (see the module doc).
const MESSAGE_KEYS: &[&str] = &[
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "refusal",
    "annotations",
    "audio",
    "function_call",
    "reasoning_content",
    "reasoning",
];

/// Most tool calls one assistant message may carry.
const MAX_TOOL_CALLS_PER_MESSAGE: usize = 128;

/// The request's `messages`: a non-empty array of messages.
///
/// Errors (400, `param` naming the field): missing, not an array, empty,
/// or any message refused by the rules in the module doc.
pub(super) fn parse_messages(map: &Obj) -> Result<Vec<ChatMessage>, ApiError> {
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

fn parse_message(i: usize, v: &Json) -> Result<ChatMessage, ApiError> {
    let here = format!("messages[{i}]");
    let m = v
        .as_object()
        .ok_or_else(|| type_err(&here, "an object", v))?;
    if let Some(k) = m.keys().find(|k| !MESSAGE_KEYS.contains(k)) {
        let param = format!("{here}.{k}");
        return Err(ApiError::invalid(
            &param,
            format!("Unrecognized message argument supplied: '{param}'."),
        ));
    }
    let role_param = format!("{here}.role");
    let role = get(&m, "role").ok_or_else(|| missing(&role_param))?;
    let role = match as_str(role, &role_param)? {
        r @ ("system" | "user" | "assistant" | "tool") => r,
        // OpenAI's newer name for the system turn.
        "developer" => "system",
        other => {
            return Err(ApiError::invalid(
                role_param,
                format!(
                    "Invalid value '{other}' for '{here}.role': supported roles are \
                     'system', 'developer', 'user', 'assistant' and 'tool'."
                ),
            ))
        }
    };
    for k in ["audio", "function_call"] {
        if get(&m, k).is_some() {
            let param = format!("{here}.{k}");
            return Err(ApiError::invalid(
                &param,
                format!("'{param}' is not supported: only text and 'tool_calls' are."),
            ));
        }
    }
    if let Some(r) = get(&m, "refusal") {
        as_str(r, &format!("{here}.refusal"))?;
    }
    if let Some(a) = get(&m, "annotations") {
        if !a.is_array() {
            return Err(type_err(&format!("{here}.annotations"), "an array", a));
        }
    }
    let tool_calls = match get(&m, "tool_calls") {
        Some(v) if role == "assistant" => Some(v),
        Some(_) => {
            let param = format!("{here}.tool_calls");
            return Err(ApiError::invalid(
                &param,
                format!("'{param}' is only allowed on assistant messages."),
            ));
        }
        None => None,
    };
    let content_param = format!("{here}.content");
    let content = match get(&m, "content") {
        Some(Json::String(s)) => s.to_string(),
        Some(Json::Array(parts)) => text_parts(&content_param, &parts.items())?,
        Some(other) => {
            return Err(type_err(
                &content_param,
                "a string or an array of text parts",
                other,
            ))
        }
        // An assistant turn may come without content (OpenAI allows it,
        // and a turn that only calls tools has none).
        None if role == "assistant" => String::new(),
        None => return Err(missing(&content_param)),
    };
    let mut msg = ChatMessage::new(role, content);
    if let Some(n) = get(&m, "name") {
        msg.name = Some(as_str(n, &format!("{here}.name"))?.to_owned());
    }
    let id_param = format!("{here}.tool_call_id");
    match (role, get(&m, "tool_call_id")) {
        ("tool", Some(id)) => msg.tool_call_id = Some(as_str(id, &id_param)?.to_owned()),
        ("tool", None) => return Err(missing(&id_param)),
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                &id_param,
                format!("'{id_param}' is only allowed on tool messages."),
            ))
        }
        (_, None) => {}
    }
    if let Some(calls) = tool_calls {
        parse_tool_calls(&here, calls, &mut msg)?;
    }
    // An assistant turn's earlier reasoning, replayed by templates that
    // render it (`reasoning` is the same field under vLLM's newer name).
    for k in ["reasoning_content", "reasoning"] {
        let Some(r) = get(&m, k) else { continue };
        let param = format!("{here}.{k}");
        if role != "assistant" {
            return Err(ApiError::invalid(
                &param,
                format!("'{param}' is only allowed on assistant messages."),
            ));
        }
        let r = as_str(r, &param)?;
        msg.reasoning_content.get_or_insert_with(|| r.to_owned());
    }
    Ok(msg)
}

/// An assistant turn's `tool_calls`: `[{"id", "type": "function",
/// "function": {"name", "arguments": "<JSON text>"}}]`; each `arguments`
/// must parse as JSON (the template receives the parsed value).
fn parse_tool_calls(here: &str, v: &Json, msg: &mut ChatMessage) -> Result<(), ApiError> {
    let param = format!("{here}.tool_calls");
    let calls = v
        .as_array()
        .ok_or_else(|| type_err(&param, "an array", v))?;
    if calls.len() > MAX_TOOL_CALLS_PER_MESSAGE {
        return Err(ApiError::invalid(
            &param,
            format!(
                "Invalid '{param}': at most {MAX_TOOL_CALLS_PER_MESSAGE} tool calls, but got {}.",
                calls.len()
            ),
        ));
    }
    for (j, call) in calls.iter().enumerate() {
        let at = format!("{param}[{j}]");
        let obj = call
            .as_object()
            .ok_or_else(|| type_err(&at, "an object", call))?;
        if let Some(k) = obj.keys().find(|k| !["id", "type", "function"].contains(k)) {
            let p = format!("{at}.{k}");
            return Err(ApiError::invalid(
                &p,
                format!("Unrecognized tool call argument supplied: '{p}'."),
            ));
        }
        let id_p = format!("{at}.id");
        let id = as_str(get(&obj, "id").ok_or_else(|| missing(&id_p))?, &id_p)?;
        let type_p = format!("{at}.type");
        match get(&obj, "type") {
            None => {}
            Some(t) if as_str(t, &type_p)? == "function" => {}
            Some(t) => {
                return Err(ApiError::invalid(
                    &type_p,
                    format!(
                        "Invalid value '{}' for '{type_p}': expected 'function'.",
                        t.as_str().unwrap_or_default()
                    ),
                ))
            }
        }
        let fn_p = format!("{at}.function");
        let f = get(&obj, "function").ok_or_else(|| missing(&fn_p))?;
        let f = f
            .as_object()
            .ok_or_else(|| type_err(&fn_p, "an object", f))?;
        let name_p = format!("{fn_p}.name");
        let name = as_str(get(&f, "name").ok_or_else(|| missing(&name_p))?, &name_p)?;
        let args_p = format!("{fn_p}.arguments");
        let args = as_str(
            get(&f, "arguments").ok_or_else(|| missing(&args_p))?,
            &args_p,
        )?;
        let parsed: Value = serde_json::from_str(args).map_err(|e| {
            ApiError::invalid(
                &args_p,
                format!("Invalid '{args_p}': expected a JSON text, but it does not parse: {e}."),
            )
        })?;
        msg.push_tool_call(id, name, parsed);
    }
    Ok(())
}

/// Joins `[{"type":"text","text":..}, ..]` with `\n` (as vLLM does); any
/// other part is an error naming `param` (`messages[i].content`).
fn text_parts(param: &str, parts: &[Json]) -> Result<String, ApiError> {
    let mut texts: Vec<std::borrow::Cow<str>> = Vec::with_capacity(parts.len());
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
        match get(&obj, "type") {
            Some(Json::String(t)) if t == "text" => {}
            Some(Json::String(t)) => {
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
        match get(&obj, "text") {
            Some(Json::String(s)) => texts.push(s.clone()),
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
