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
    let new = continue_turns(&[], new).unwrap();
    let m = prompt_turns(r.instructions.as_deref(), &[], &new, |_, _| true);
    assert_eq!(m[3].name.as_deref(), Some("add"));
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
    // Reasoning is copied only where the template writes it: here after
    // the last user turn, which has none.
    let m = prompt_turns(None, &[], &new, |i, last| last.is_none_or(|u| i > u));
    assert!(m.iter().all(|m| m.reasoning_content.is_none()));
    // A continuation names its results after the stored calls.
    let stored: Vec<&ChatMessage> = m.iter().take(2).collect();
    let more = vec![ChatMessage {
        tool_call_id: Some("c1".into()),
        ..ChatMessage::new("tool", "4")
    }];
    assert_eq!(
        continue_turns(&stored, more).unwrap()[0].name.as_deref(),
        Some("add")
    );
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
        continue_turns(&[], new).unwrap_err().param.as_deref(),
        Some("input")
    );
}

/// A `reasoning` item must be followed by its own assistant turn's output:
/// a user, system or tool turn next, or the end, is a 400 naming the item
/// (the first of a run), never a silent drop. Followed by an assistant
/// message or a call it is kept, as before.
#[test]
fn reasoning_that_nothing_of_its_turn_follows_is_refused_naming_it() {
    let rs = |id: &str| {
        json!({"type": "reasoning", "id": id, "summary": [],
        "content": [{"type": "reasoning_text", "text": "think"}]})
    };
    let user = json!({"role": "user", "content": "next"});
    let out = json!({"type": "function_call_output", "call_id": "c1", "output": "3"});
    let call = json!({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"});
    let said = json!({"type": "message", "role": "assistant", "content": "said"});
    for (input, at) in [
        (json!([user, rs("rs_1"), user]), "input[1]"),
        (json!([user, rs("rs_1"), rs("rs_2"), user]), "input[1]"),
        (json!([user, rs("rs_1")]), "input[1]"),
        (json!([rs("rs_0")]), "input[0]"),
        (json!([user, call, rs("rs_1"), out]), "input[2]"),
        (
            json!([user, rs("rs_1"), {"role": "developer", "content": "x"}]),
            "input[1]",
        ),
    ] {
        let e = parse(json!({"model": "m", "input": input})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(at), "{input}: {}", e.message);
        assert_eq!(e.status(), 400);
        assert!(e.message.contains("'reasoning'"), "{}", e.message);
    }
    let rs1 = rs("rs_1");
    let e = parse(json!({"model": "m", "input": [user, rs1, user]})).unwrap_err();
    assert!(e.message.contains("rs_1"), "{}", e.message);
    for input in [
        json!([user, rs("rs_1"), said, user]),
        json!([user, rs("rs_1"), call]),
        json!([user, rs("rs_1"), rs("rs_2"), said]),
    ] {
        let r = parse(json!({"model": "m", "input": input.clone()})).unwrap();
        let Input::Chat(turns) = r.valid.input else {
            panic!()
        };
        let carried: Vec<_> = turns
            .iter()
            .filter_map(|m| m.reasoning_content.as_deref())
            .collect();
        assert_eq!(carried.len(), 1, "{input}");
        assert!(carried[0].starts_with("think"), "{input}");
    }
    // A response's own output cut while reasoning reads back as before:
    // no assistant turn, nothing logged as broken.
    assert!(output_turns(&json!([rs("rs_9")])).is_empty());
}
