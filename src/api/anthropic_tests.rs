//! Unit tests of the Anthropic Messages request parser (`anthropic.rs`).

use super::*;
use crate::api::Input;
use serde_json::json;
use serde_json::Value;

fn parse(v: Value) -> Result<MessagesRequest, ApiError> {
    parse_messages_request(v.to_string().as_bytes(), usize::MAX)
}

fn base(extra: Value) -> Value {
    let mut b = json!({"model": "m", "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn param(r: Result<MessagesRequest, ApiError>) -> String {
    r.unwrap_err().param.unwrap_or_default()
}

#[test]
fn a_tool_round_trip_becomes_chat_turns() {
    let r = parse(base(json!({
        "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "add 1 and 2"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use add", "signature": ""},
                {"type": "text", "text": "Calling."},
                {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "b": 2}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "3"},
                {"type": "text", "text": "thanks"}]}],
        "tools": [{"name": "add", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "stop_sequences": ["END"], "temperature": 0, "top_k": 5,
    })))
    .unwrap()
    .valid;
    let Input::Chat(m) = &r.input else { panic!() };
    let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
    assert_eq!(m[0].content, "be brief");
    assert_eq!(m[2].reasoning_content.as_deref(), Some("use add"));
    assert_eq!(
        m[2].tool_calls[0].function.arguments,
        json!({"a": 1, "b": 2})
    );
    assert_eq!(m[3].tool_call_id.as_deref(), Some("t1"));
    assert_eq!(r.tools.choice, ToolChoice::Required);
    assert!(!r.tools.parallel);
    assert_eq!(r.stop, ["END"]);
    assert_eq!(r.max_tokens, Some(16));
    assert_eq!(r.sampling.top_k, 5);
}

#[test]
fn bad_input_is_refused_naming_the_field() {
    let no_max = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(param(parse(no_max)), "max_tokens");
    let orphan = base(json!({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "3"}]}]}));
    assert_eq!(param(parse(orphan)), "messages.0.content.0.tool_use_id");
    let image = base(json!({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}));
    assert_eq!(param(parse(image)), "messages.0.content.0.type");
    assert_eq!(
        param(parse(base(json!({"temperature": 1.5})))),
        "temperature"
    );
    assert_eq!(
        param(parse(base(json!({"top_logprobs": 1})))),
        "top_logprobs"
    );
    assert_eq!(
        param(parse(base(
            json!({"thinking": {"type": "enabled", "budget_tokens": 10}})
        ))),
        "thinking.budget_tokens"
    );
    assert_eq!(
        param(parse(base(json!({"mcp_servers": []})))),
        "mcp_servers"
    );
    assert_eq!(
        param(parse(base(
            json!({"tools": [{"type": "web_search_20250305", "name": "w"}]})
        ))),
        "tools.0.type"
    );
}

#[test]
fn thinking_maps_onto_the_reasoning_switch() {
    let on = parse(base(json!({"max_tokens": 9000,
        "thinking": {"type": "enabled", "budget_tokens": 2048}})))
    .unwrap()
    .valid;
    assert_eq!(on.knobs.reasoning_effort.as_deref(), Some("low"));
    assert_eq!(on.knobs.effort_param, Some("thinking"));
    let off = parse(base(json!({"thinking": {"type": "disabled"}})))
        .unwrap()
        .valid;
    assert_eq!(off.knobs.reasoning_effort.as_deref(), Some("none"));
    let absent = parse(base(json!({}))).unwrap().valid;
    assert_eq!(absent.knobs.reasoning_effort, None);
}
