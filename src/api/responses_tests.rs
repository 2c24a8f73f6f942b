//! Unit tests of the Responses request parser (`responses.rs`).

use super::*;
use crate::api::Input;

fn parse(v: Value) -> Result<ResponsesRequest, ApiError> {
    parse_responses_request(v.to_string().as_bytes())
}

fn param(v: Value) -> String {
    parse(v).unwrap_err().param.unwrap_or_default()
}

#[test]
fn items_become_chat_turns() {
    let r = parse(json!({"model": "m", "instructions": "be brief", "input": [
        {"role": "user", "content": "add 1 and 2"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "use add"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ok?"}]},
    ], "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
       "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
       "reasoning": {"effort": "low", "summary": "auto"}, "max_output_tokens": 20}))
    .unwrap();
    let Input::Chat(new) = r.valid.input.clone() else {
        panic!()
    };
    let m = assemble(r.instructions.as_deref(), &[], new).unwrap();
    let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
    assert_eq!(m[2].reasoning_content.as_deref(), Some("use add"));
    assert_eq!(m[2].tool_calls[0].id, "c1");
    assert_eq!(r.valid.tools.choice, ToolChoice::Auto);
    assert_eq!(r.valid.max_tokens, Some(20));
    assert!(matches!(
        r.valid.response_format,
        ResponseFormat::JsonSchema { .. }
    ));
    assert_eq!(r.valid.knobs.reasoning_effort.as_deref(), Some("low"));
    assert!(r.store);
}

#[test]
fn bad_input_is_refused_naming_the_field() {
    assert_eq!(param(json!({"model": "m"})), "input");
    assert_eq!(
        param(json!({"model": "m", "input": [{"type": "item_reference", "id": "x"}]})),
        "input[0].type"
    );
    assert_eq!(
        param(
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})
        ),
        "input[0].content[0].type"
    );
    assert_eq!(
        param(json!({"model": "m", "input": "x", "background": true})),
        "background"
    );
    assert_eq!(
        param(json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]})),
        "tools[0].type"
    );
    assert_eq!(
        param(json!({"model": "m", "input": "x", "seed": 1})),
        "seed"
    );
    // An output without its call.
    let r = parse(json!({"model": "m", "input": [
        {"type": "function_call_output", "call_id": "zz", "output": "3"}]}))
    .unwrap();
    let Input::Chat(new) = r.valid.input else {
        panic!()
    };
    assert_eq!(
        assemble(None, &[], new).unwrap_err().param.as_deref(),
        Some("input")
    );
}
