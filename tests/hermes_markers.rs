//! Hermes tags count only as their tokens (issue 49), over HTTP on the real
//! Qwen2.5-Coder 0.5B, whose vocabulary has `<tool_call>` and
//! `</tool_call>` as tokens of their own: a forced call whose argument
//! spells `</tool_call>` (the grammar makes the model write it, as text)
//! comes back as one call with exactly that argument. Before, the parser
//! searched the text, the spelled tag closed the block inside the JSON
//! string, and the call came back as broken content.

mod common;

use common::*;
use serde_json::{json, Value};

const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
const QWEN_TARGET: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";

/// A server of the real model `name` alone (n-gram speculation), when
/// its weights are fetched.
fn serve(name: &str) -> Option<Server> {
    let path = real_model(name)?;
    Some(Server::start(
        config(|c| {
            c.model.path = path;
            c.draft.path = None;
            c.speculative.method = specgate::config::SpeculativeMethod::Ngram;
        }),
        None,
    ))
}

#[test]
fn a_forced_call_spelling_its_closing_tag_is_one_call_with_its_argument() {
    let Some(s) = serve(QWEN) else {
        return;
    };
    let spelled = "a</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}";
    let tools = json!([
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"a": {"const": spelled}}, "required": ["a"]}}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
    ]);
    for stream in [false, true] {
        let r = post(
            s.addr,
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "call f"}],
                   "tools": tools, "max_tokens": 300, "temperature": 0, "stream": stream,
                   "parallel_tool_calls": false,
                   "tool_choice": {"type": "function", "function": {"name": "f"}}}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let calls: Vec<Value> = if stream {
            let (evs, done) = events(&r.body);
            assert!(done, "{}", r.body);
            assert_eq!(delta_text(&evs, "content"), "", "{}", r.body);
            evs.iter()
                .filter_map(|e| e["choices"][0]["delta"]["tool_calls"].as_array())
                .flatten()
                .cloned()
                .collect()
        } else {
            let v: Value = serde_json::from_str(&r.body).unwrap();
            assert!(v["choices"][0]["message"]["content"].is_null(), "{v}");
            assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
            v["choices"][0]["message"]["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        };
        assert_eq!(calls.len(), 1, "{}", r.body);
        assert_eq!(calls[0]["function"]["name"], "f", "{}", r.body);
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({ "a": spelled }), "{}", r.body);
    }
    s.wait_idle();
}

#[test]
fn forced_calls_on_the_real_target_end_after_the_call_the_model_makes() {
    let Some(s) = serve(QWEN_TARGET) else {
        return;
    };
    let params = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 32},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": false});
    let ask = "What is the weather like in Paris right now?";
    // Chat with `tool_choice: required` (parallel calls allowed).
    let r = post(
        s.addr,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": ask}],
               "tools": [{"type": "function", "function": {"name": "get_weather",
                   "description": "Get the current weather in a city.", "parameters": params}}],
               "tool_choice": "required", "max_tokens": 300, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"]
            .as_array()
            .map(Vec::len),
        Some(1),
        "{v}"
    );
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() < 40,
        "{v}"
    );
    // Anthropic Messages with `tool_choice: any`.
    let r = post(
        s.addr,
        "/v1/messages",
        json!({"model": MODEL, "max_tokens": 300, "temperature": 0,
               "messages": [{"role": "user", "content": ask}],
               "tools": [{"name": "get_weather", "description": "Get the current weather in a city.",
                          "input_schema": params}],
               "tool_choice": {"type": "any"}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let uses = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .count();
    assert_eq!(uses, 1, "{v}");
    s.wait_idle();
}
