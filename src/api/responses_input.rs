//! The `input` of a Responses request (`responses.rs`): a string or a
//! list of items, turned into chat turns. `message` items (roles `user`,
//! `system`, `developer`, `assistant`; `input_text` / `output_text` /
//! `refusal` parts) are one turn each; `function_call` items join the
//! assistant turn before them (or start one); `function_call_output` items
//! become `tool` turns; a `reasoning` item becomes the `reasoning_content`
//! of the assistant turn after it. Every other item or part is refused
//! with a 400 naming it (`input[2].content[0].type`), and so is a
//! `reasoning` item that nothing of its own assistant turn follows (a user
//! or tool turn next, or the end), as OpenAI refuses it: there is no turn
//! it could be rendered with, and dropping it would be silent.

use serde_json::Value;

use super::error::ApiError;
use super::json::Json;
use super::json::{as_str, as_text, get, missing, type_err};
use crate::tokenizer::ChatMessage;

/// Where the items come from, which decides one case: a `reasoning` item
/// that ends the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Items {
    /// A client's `input`: such an item is refused.
    Input,
    /// A response's own `output` read back for the store: a response cut
    /// while it was still reasoning ends so; its reasoning is left out, as
    /// no assistant turn carries it.
    OwnOutput,
}

/// `input`: a string (one user turn) or a list of items.
pub(super) fn parse_input(v: &Json, from: Items) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match v {
        Json::String(s) => return Ok(vec![ChatMessage::new("user", s.to_string())]),
        Json::Array(items) => items.items(),
        other => return Err(type_err("input", "a string or an array of items", other)),
    };
    if items.is_empty() {
        return Err(ApiError::invalid("input", "Invalid 'input': empty array."));
    }
    let mut out: Vec<ChatMessage> = Vec::new();
    // A reasoning item waits for the assistant turn it belongs to; the
    // index of the first one waiting names it if none comes.
    let mut reasoning: Option<String> = None;
    let mut reasoning_at: Option<usize> = None;
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let obj = item
            .as_object()
            .ok_or_else(|| type_err(&at, "an object", item))?;
        let t = match get(&obj, "type") {
            Some(t) => as_str(t, &format!("{at}.type"))?,
            None if obj.contains_key("role") => "message",
            None => return Err(missing(&format!("{at}.type"))),
        };
        let allow = |keys: &[&str]| -> Result<(), ApiError> {
            match obj.keys().find(|k| !keys.contains(k)) {
                None => Ok(()),
                Some(k) => {
                    let p = format!("{at}.{k}");
                    Err(ApiError::invalid(
                        &p,
                        format!("Unrecognized argument supplied: '{p}'."),
                    ))
                }
            }
        };
        let text = |k: &str| -> Result<&str, ApiError> {
            let p = format!("{at}.{k}");
            as_str(get(&obj, k).ok_or_else(|| missing(&p))?, &p)
        };
        match t {
            "message" => {
                allow(&["type", "role", "content", "id", "status"])?;
                let role_p = format!("{at}.role");
                let role = match text("role")? {
                    r @ ("user" | "system" | "assistant") => r,
                    "developer" => "system",
                    other => {
                        return Err(ApiError::invalid(
                            &role_p,
                            format!("Invalid value '{other}' for '{role_p}': expected 'user', 'assistant', 'system' or 'developer'."),
                        ))
                    }
                };
                let content_p = format!("{at}.content");
                let content = match get(&obj, "content").ok_or_else(|| missing(&content_p))? {
                    Json::String(s) => s.to_string(),
                    Json::Array(parts) => content_parts(&content_p, &parts.items())?,
                    other => {
                        return Err(type_err(&content_p, "a string or an array of parts", other))
                    }
                };
                let mut m = ChatMessage::new(role, content);
                if role == "assistant" {
                    m.reasoning_content = reasoning.take();
                    reasoning_at = None;
                } else if let Some(r) = reasoning_at {
                    return Err(unfollowed(&items, r, &format!("a '{role}' message")));
                }
                out.push(m);
            }
            "function_call" => {
                allow(&["type", "call_id", "name", "arguments", "id", "status"])?;
                let call_id = text("call_id")?;
                let name = text("name")?;
                let args_p = format!("{at}.arguments");
                let args: Value = serde_json::from_str(text("arguments")?).map_err(|e| {
                    ApiError::invalid(
                        &args_p,
                        format!(
                            "Invalid '{args_p}': expected a JSON text, but it does not parse: {e}."
                        ),
                    )
                })?;
                // Calls join the assistant turn right before them (a turn
                // that wrote text, then called); else they start one.
                let joins =
                    out.last().is_some_and(|m| m.role == "assistant") && reasoning.is_none();
                if !joins {
                    let mut m = ChatMessage::new("assistant", "");
                    m.reasoning_content = reasoning.take();
                    reasoning_at = None;
                    out.push(m);
                }
                out.last_mut()
                    .expect("pushed")
                    .push_tool_call(call_id, name, args);
            }
            "function_call_output" => {
                allow(&["type", "call_id", "output", "id", "status"])?;
                if let Some(r) = reasoning_at {
                    return Err(unfollowed(&items, r, "a 'function_call_output'"));
                }
                let call_id = text("call_id")?;
                let out_p = format!("{at}.output");
                let output = match get(&obj, "output").ok_or_else(|| missing(&out_p))? {
                    Json::String(s) => s.to_string(),
                    Json::Array(parts) => content_parts(&out_p, &parts.items())?,
                    other => return Err(type_err(&out_p, "a string or an array of parts", other)),
                };
                let mut m = ChatMessage::new("tool", output);
                m.tool_call_id = Some(call_id.to_owned());
                out.push(m);
            }
            "reasoning" => {
                allow(&[
                    "type",
                    "id",
                    "summary",
                    "content",
                    "encrypted_content",
                    "status",
                ])?;
                if get(&obj, "encrypted_content").is_some() {
                    let p = format!("{at}.encrypted_content");
                    return Err(ApiError::unsupported(
                        &p,
                        format!("'{p}' cannot be read: this server never encrypts reasoning."),
                    ));
                }
                let mut texts: Vec<String> = Vec::new();
                for key in ["content", "summary"] {
                    let Some(parts) = get(&obj, key) else {
                        continue;
                    };
                    let p = format!("{at}.{key}");
                    let parts = parts
                        .as_array()
                        .ok_or_else(|| type_err(&p, "an array", parts))?;
                    for (j, part) in parts.iter().enumerate() {
                        let pp = format!("{p}[{j}]");
                        let po = part
                            .as_object()
                            .ok_or_else(|| type_err(&pp, "an object", part))?;
                        let want = if key == "content" {
                            "reasoning_text"
                        } else {
                            "summary_text"
                        };
                        match get(&po, "type").and_then(Json::as_str) {
                            Some(t) if t == want => {}
                            _ => {
                                return Err(ApiError::invalid(
                                    format!("{pp}.type"),
                                    format!("Invalid '{pp}.type': expected '{want}'."),
                                ))
                            }
                        }
                        let tp = format!("{pp}.text");
                        texts.push(
                            as_str(get(&po, "text").ok_or_else(|| missing(&tp))?, &tp)?.to_owned(),
                        );
                    }
                    // The full reasoning text when given; the summary only
                    // stands in for it when there is none.
                    if key == "content" && !texts.is_empty() {
                        break;
                    }
                }
                let joined = texts.join("\n");
                reasoning_at.get_or_insert(i);
                reasoning = Some(match reasoning.take() {
                    Some(r) => format!("{r}\n{joined}"),
                    None => joined,
                });
            }
            other => {
                let p = format!("{at}.type");
                return Err(ApiError::invalid(
                    &p,
                    format!("Invalid value '{other}' for '{p}': supported input items are 'message', 'function_call', 'function_call_output' and 'reasoning'."),
                ));
            }
        }
    }
    match reasoning_at {
        Some(r) if from == Items::Input => Err(unfollowed(&items, r, "nothing")),
        _ => Ok(out),
    }
}

/// The 400 for the `reasoning` item `items[at]` that `next` follows
/// instead of its assistant output (OpenAI's words, naming the item).
fn unfollowed(items: &[Json], at: usize, next: &str) -> ApiError {
    let p = format!("input[{at}]");
    let obj = items[at].as_object().unwrap_or_default();
    let named = match obj.get("id").and_then(Json::as_str) {
        Some(id) => format!("Item '{id}' ({p})"),
        None => format!("Item '{p}'"),
    };
    ApiError::invalid(
        &p,
        format!(
            "{named} of type 'reasoning' was provided without its required following item: \
             a reasoning item must be followed by the assistant 'message' or 'function_call' \
             of its turn, but {next} follows it."
        ),
    )
}

/// A message's content parts (`input_text`, `output_text`, `refusal`),
/// joined with `\n`.
fn content_parts(at: &str, parts: &[Json]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let pp = format!("{at}[{j}]");
        let obj = part
            .as_object()
            .ok_or_else(|| type_err(&pp, "an object", part))?;
        let tp = format!("{pp}.type");
        let t = as_str(get(&obj, "type").ok_or_else(|| missing(&tp))?, &tp)?;
        let (key, keys): (&str, &[&str]) = match t {
            "input_text" => ("text", &["type", "text"]),
            "output_text" => ("text", &["type", "text", "annotations", "logprobs"]),
            "refusal" => ("refusal", &["type", "refusal"]),
            other => {
                return Err(ApiError::invalid(
                    &tp,
                    format!("Invalid value '{other}' for '{tp}': this server reads text parts only ('input_text', 'output_text', 'refusal')."),
                ))
            }
        };
        if let Some(k) = obj.keys().find(|k| !keys.contains(k)) {
            let p = format!("{pp}.{k}");
            return Err(ApiError::invalid(
                &p,
                format!("Unrecognized argument supplied: '{p}'."),
            ));
        }
        let kp = format!("{pp}.{key}");
        texts.push(as_text(get(&obj, key).ok_or_else(|| missing(&kp))?, &kp)?);
    }
    Ok(texts.join("\n"))
}
