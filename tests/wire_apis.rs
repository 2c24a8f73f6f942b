//! Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`)
//! and OpenAI's Responses API (`/v1/responses`, `GET`/`DELETE
//! /v1/responses/{id}`) on the tiny generated model: each gives exactly
//! the tokens chat completions gives for the same conversation (greedy,
//! speculation on), whole and streamed in the API's own events; tool
//! calls round-trip; bad input gets each API's own 4xx body naming the
//! field; stored responses continue a conversation, are bounded and never
//! cross API keys.

mod common;

use common::*;
use serde_json::{json, Value};

const JSON: (&str, &str) = ("Content-Type", "application/json");

fn json_of(r: &Resp) -> Value {
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

fn server() -> Server {
    Server::start(config(|_| {}), None)
}

/// `event:` / `data:` pairs of an SSE body (Anthropic's and Responses'
/// framing); keep-alive comments skipped.
fn named_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.is_empty() && !e.starts_with(':'))
        .map(|e| {
            let (name, data) = e
                .split_once('\n')
                .unwrap_or_else(|| panic!("bad event {e:?}"));
            let name = name.strip_prefix("event: ").expect("event line");
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name, "{e}");
            (name.to_owned(), data)
        })
        .collect()
}

fn chat_text(addr: std::net::SocketAddr, max_tokens: usize) -> (String, Value) {
    let v = json_of(&post(
        addr,
        "/v1/chat/completions",
        chat(json!({"max_tokens": max_tokens})),
    ));
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned(),
        v["usage"].clone(),
    )
}

fn messages(extra: Value) -> Value {
    merge(
        json!({"model": MODEL, "max_tokens": 24, "temperature": 0,
               "messages": [{"role": "user", "content": "hello world"}]}),
        extra,
    )
}

fn responses(extra: Value) -> Value {
    merge(
        json!({"model": MODEL, "max_output_tokens": 24, "temperature": 0, "input": "hello world"}),
        extra,
    )
}

/// The text of a Messages body's text blocks.
fn message_text(v: &Value) -> String {
    v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().unwrap())
        .collect()
}

/// The text of a Responses body's message items.
fn output_text(v: &Value) -> String {
    let mut s = String::new();
    for item in v["output"].as_array().unwrap() {
        if item["type"] == "message" {
            for part in item["content"].as_array().unwrap() {
                s.push_str(part["text"].as_str().unwrap());
            }
        }
    }
    s
}

#[test]
fn messages_give_the_tokens_chat_gives_whole_and_streamed() {
    let s = server();
    let (want, usage) = chat_text(s.addr, 24);
    let v = json_of(&post(s.addr, "/v1/messages", messages(json!({}))));
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(message_text(&v), want);
    assert_eq!(v["usage"]["input_tokens"], usage["prompt_tokens"]);
    assert_eq!(v["usage"]["output_tokens"], usage["completion_tokens"]);
    let reason = if usage["completion_tokens"] == 24 {
        "max_tokens"
    } else {
        "end_turn"
    };
    assert_eq!(v["stop_reason"], reason);

    let r = post(s.addr, "/v1/messages", messages(json!({"stream": true})));
    assert_eq!(r.status, 200);
    let evs = named_events(&r.body);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
    let starts = names
        .iter()
        .filter(|n| **n == "content_block_start")
        .count();
    let stops = names.iter().filter(|n| **n == "content_block_stop").count();
    assert_eq!(starts, stops);
    let text: String = evs
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, want);
    let delta = &evs[evs.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], reason);
    assert_eq!(delta["usage"]["output_tokens"], usage["completion_tokens"]);
    assert_eq!(
        evs[0].1["message"]["usage"]["input_tokens"],
        usage["prompt_tokens"]
    );

    // count_tokens counts the prompt the request would send.
    let c = json_of(&post(
        s.addr,
        "/v1/messages/count_tokens",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hello world"}]}),
    ));
    assert_eq!(c["input_tokens"], usage["prompt_tokens"]);
    s.wait_idle();
}

#[test]
fn a_stop_sequence_is_reported_by_name() {
    let s = server();
    let (want, _) = chat_text(s.addr, 24);
    let chars: Vec<char> = want.chars().collect();
    assert!(chars.len() >= 6, "{want:?}");
    let stop: String = chars[3..5].iter().collect();
    let v = json_of(&post(
        s.addr,
        "/v1/messages",
        messages(json!({"stop_sequences": [stop]})),
    ));
    assert_eq!(v["stop_reason"], "stop_sequence", "{v}");
    assert_eq!(v["stop_sequence"], stop.as_str());
    assert!(want.starts_with(&message_text(&v)));
    assert!(!message_text(&v).contains(&stop));
}

#[test]
fn messages_tool_use_round_trips() {
    let s = server();
    let tools = json!([{"name": "add", "description": "adds",
        "input_schema": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}},
            "required": ["a"], "additionalProperties": false}}]);
    let v = json_of(&post(
        s.addr,
        "/v1/messages",
        messages(json!({"tools": tools, "max_tokens": 150,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true}})),
    ));
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let call = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "tool_use")
        .unwrap()
        .clone();
    assert_eq!(call["name"], "add");
    assert!(call["input"]["a"].is_string(), "{call}");
    let id = call["id"].as_str().unwrap();
    // Streamed: the call comes as a tool_use block and its input JSON.
    let r = post(
        s.addr,
        "/v1/messages",
        messages(json!({"tools": tools, "max_tokens": 150, "stream": true,
            "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": true}})),
    );
    let evs = named_events(&r.body);
    let start = evs
        .iter()
        .find(|(n, d)| n == "content_block_start" && d["content_block"]["type"] == "tool_use")
        .unwrap_or_else(|| panic!("no tool_use block: {}", r.body));
    let idx = &start.1["index"];
    let json_text: String = evs
        .iter()
        .filter(|(n, d)| n == "content_block_delta" && &d["index"] == idx)
        .map(|(_, d)| d["delta"]["partial_json"].as_str().unwrap())
        .collect();
    let input: Value = serde_json::from_str(&json_text).unwrap();
    assert!(input["a"].is_string());
    // The result goes back as a tool_result answering the call.
    let back = messages(json!({"tools": tools, "messages": [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": "3"}]},
    ]}));
    json_of(&post(s.addr, "/v1/messages", back));
    s.wait_idle();
}

/// An Anthropic error body naming the field, with the status.
fn anthropic_error(r: &Resp, status: u16, field: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["type"], "error", "{}", r.body);
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(field), "{field} not named: {msg}");
    assert!(v["error"]["type"].is_string());
}

#[test]
fn bad_messages_get_anthropics_error_shape() {
    let s = server();
    let no_max = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    anthropic_error(&post(s.addr, "/v1/messages", no_max), 400, "max_tokens");
    let orphan = messages(json!({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "3"}]}]}));
    anthropic_error(&post(s.addr, "/v1/messages", orphan), 400, "tool_use_id");
    let image = messages(json!({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}));
    anthropic_error(
        &post(s.addr, "/v1/messages", image),
        400,
        "messages.0.content.0.type",
    );
    anthropic_error(
        &post(s.addr, "/v1/messages", messages(json!({"top_logprobs": 2}))),
        400,
        "top_logprobs",
    );
    let r = post(s.addr, "/v1/messages", messages(json!({"model": "nope"})));
    anthropic_error(&r, 404, "nope");
    let r = request(s.addr, "POST", "/v1/messages", &[JSON], "{not json");
    assert_eq!(r.status, 400);
    assert_eq!(
        serde_json::from_str::<Value>(&r.body).unwrap()["type"],
        "error"
    );
    // The model has no thinking channel: enabling it is refused by name.
    let think = messages(json!({"max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024}}));
    anthropic_error(&post(s.addr, "/v1/messages", think), 400, "thinking");
    // Disabling it is what the model does anyway.
    json_of(&post(
        s.addr,
        "/v1/messages",
        messages(json!({"thinking": {"type": "disabled"}})),
    ));
}

#[test]
fn x_api_key_authenticates_with_the_same_keys() {
    let s = Server::start(config(|c| c.server.api_keys = vec!["k1".into()]), None);
    let body = messages(json!({"max_tokens": 4})).to_string();
    let r = request(s.addr, "POST", "/v1/messages", &[JSON], &body);
    anthropic_error(&r, 401, "x-api-key");
    let r = request(
        s.addr,
        "POST",
        "/v1/messages",
        &[JSON, ("x-api-key", "k2")],
        &body,
    );
    assert_eq!(r.status, 401);
    let r = request(
        s.addr,
        "POST",
        "/v1/messages",
        &[JSON, ("x-api-key", "k1")],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = request(
        s.addr,
        "POST",
        "/v1/messages",
        &[JSON, ("Authorization", "Bearer k1")],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn responses_give_the_tokens_chat_gives_whole_and_streamed() {
    let s = server();
    let (want, usage) = chat_text(s.addr, 24);
    let v = json_of(&post(s.addr, "/v1/responses", responses(json!({}))));
    assert_eq!(v["object"], "response");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(output_text(&v), want);
    assert_eq!(v["usage"]["input_tokens"], usage["prompt_tokens"]);
    assert_eq!(v["usage"]["output_tokens"], usage["completion_tokens"]);
    assert_eq!(v["usage"]["output_tokens_details"]["reasoning_tokens"], 0);
    if usage["completion_tokens"] == 24 {
        assert_eq!(v["status"], "incomplete");
        assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    } else {
        assert_eq!(v["status"], "completed");
    }
    let r = post(s.addr, "/v1/responses", responses(json!({"stream": true})));
    assert_eq!(r.status, 200);
    let evs = named_events(&r.body);
    for (i, (_, d)) in evs.iter().enumerate() {
        assert_eq!(d["sequence_number"], i as u64, "{d}");
    }
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        &names[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert!(matches!(
        *names.last().unwrap(),
        "response.completed" | "response.incomplete"
    ));
    let text: String = evs
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, want);
    let done = &evs.last().unwrap().1["response"];
    assert_eq!(output_text(done), want);
    s.wait_idle();
}

#[test]
fn responses_call_functions_and_take_their_output_back() {
    let s = server();
    let tools = json!([{"type": "function", "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}},
            "required": ["a"], "additionalProperties": false}}]);
    let v = json_of(&post(
        s.addr,
        "/v1/responses",
        responses(
            json!({"tools": tools, "tool_choice": "required", "max_output_tokens": 150,
            "parallel_tool_calls": false}),
        ),
    ));
    let call = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap_or_else(|| panic!("no call: {v}"))
        .clone();
    assert_eq!(call["name"], "add");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["a"].is_string());
    let call_id = call["call_id"].as_str().unwrap();
    let back = responses(json!({"tools": tools, "input": [
        {"role": "user", "content": "hello world"},
        call,
        {"type": "function_call_output", "call_id": call_id, "output": "3"},
    ]}));
    json_of(&post(s.addr, "/v1/responses", back));
    // The same through the store: only the output is sent.
    let back = responses(
        json!({"tools": tools, "previous_response_id": v["id"], "input": [
        {"type": "function_call_output", "call_id": call_id, "output": "3"}]}),
    );
    json_of(&post(s.addr, "/v1/responses", back));
    // An output answering no call.
    let orphan = responses(json!({"input": [
        {"type": "function_call_output", "call_id": "call_nope", "output": "3"}]}));
    let r = post(s.addr, "/v1/responses", orphan);
    assert_eq!(r.status, 400);
    assert_eq!(error_of(&r)["param"], "input");
    // Streamed: the call as its own item, arguments in one delta.
    let r = post(
        s.addr,
        "/v1/responses",
        responses(
            json!({"tools": tools, "tool_choice": {"type": "function", "name": "add"},
            "max_output_tokens": 150, "parallel_tool_calls": false, "stream": true}),
        ),
    );
    let evs = named_events(&r.body);
    let done = evs
        .iter()
        .find(|(n, _)| n == "response.function_call_arguments.done")
        .unwrap_or_else(|| panic!("no arguments: {}", r.body));
    let args: Value = serde_json::from_str(done.1["arguments"].as_str().unwrap()).unwrap();
    assert!(args["a"].is_string());
    s.wait_idle();
}

#[test]
fn responses_follow_a_json_schema() {
    let s = server();
    let schema = json!({"type": "object", "properties": {"n": {"type": "string", "maxLength": 8}},
        "required": ["n"], "additionalProperties": false});
    let v = json_of(&post(
        s.addr,
        "/v1/responses",
        responses(json!({"max_output_tokens": 150,
            "text": {"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": true}}})),
    ));
    let parsed: Value = serde_json::from_str(&output_text(&v)).unwrap();
    assert!(parsed["n"].is_string(), "{parsed}");
    assert_eq!(v["text"]["format"]["name"], "num");
}

#[test]
fn stored_responses_continue_read_back_delete_and_stay_per_key() {
    let s = Server::start(
        config(|c| {
            c.server.api_keys = vec!["a".into(), "b".into()];
            c.server.stored_responses_per_key = 2;
        }),
        None,
    );
    let post_as = |key: &str, body: Value| {
        request(
            s.addr,
            "POST",
            "/v1/responses",
            &[JSON, ("Authorization", &format!("Bearer {key}"))],
            &body.to_string(),
        )
    };
    let get_as = |key: &str, method: &str, id: &str| {
        request(
            s.addr,
            method,
            &format!("/v1/responses/{id}"),
            &[("Authorization", &format!("Bearer {key}"))],
            "",
        )
    };
    let first = json_of(&post_as("a", responses(json!({"max_output_tokens": 6}))));
    let id = first["id"].as_str().unwrap();
    // Continued by id: the same tokens as resending the conversation.
    let cont = json_of(&post_as(
        "a",
        responses(
            json!({"previous_response_id": id, "input": "and again", "max_output_tokens": 6}),
        ),
    ));
    assert_eq!(cont["previous_response_id"], id);
    let resent = json_of(&post_as(
        "a",
        responses(json!({"max_output_tokens": 6, "store": false, "input": [
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": output_text(&first)},
            {"role": "user", "content": "and again"}]})),
    ));
    assert_eq!(output_text(&cont), output_text(&resent));
    assert_eq!(
        cont["usage"]["input_tokens"],
        resent["usage"]["input_tokens"]
    );
    // Read back, as stored.
    let got = json_of(&get_as("a", "GET", id));
    assert_eq!(got, first);
    // Another key sees nothing, and cannot continue or delete it.
    assert_eq!(get_as("b", "GET", id).status, 404);
    assert_eq!(get_as("b", "DELETE", id).status, 404);
    let r = post_as("b", responses(json!({"previous_response_id": id})));
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(error_of(&r)["param"], "previous_response_id");
    // `store: false` keeps nothing.
    let unstored = json_of(&post_as(
        "a",
        responses(json!({"store": false, "max_output_tokens": 2})),
    ));
    assert_eq!(
        get_as("a", "GET", unstored["id"].as_str().unwrap()).status,
        404
    );
    // The store holds two per key: a third evicts the oldest.
    json_of(&post_as("a", responses(json!({"max_output_tokens": 2}))));
    assert_eq!(
        get_as("a", "GET", id).status,
        404,
        "the oldest was not evicted"
    );
    let r = post_as("a", responses(json!({"previous_response_id": id})));
    assert_eq!(r.status, 404);
    // Delete.
    let cid = cont["id"].as_str().unwrap();
    let d = json_of(&get_as("a", "DELETE", cid));
    assert_eq!(d["deleted"], true);
    assert_eq!(get_as("a", "GET", cid).status, 404);
    assert_eq!(get_as("a", "PUT", cid).status, 405);
    assert_eq!(get_as("zzz", "GET", cid).status, 401);
}

#[test]
fn bad_responses_requests_name_the_field() {
    let s = server();
    for (body, param) in [
        (json!({"model": MODEL}), "input"),
        (
            responses(json!({"input": [{"type": "item_reference", "id": "x"}]})),
            "input[0].type",
        ),
        (
            responses(
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            ),
            "input[0].content[0].type",
        ),
        (
            responses(json!({"tools": [{"type": "web_search"}]})),
            "tools[0].type",
        ),
        (
            responses(json!({"reasoning": {"effort": "high"}})),
            "reasoning.effort",
        ),
        (
            responses(json!({"frequency_penalty": 1})),
            "frequency_penalty",
        ),
    ] {
        let r = post(s.addr, "/v1/responses", body);
        assert_eq!(r.status, 400, "{param}: {}", r.body);
        assert_eq!(error_of(&r)["param"], param, "{}", r.body);
    }
    let r = post(
        s.addr,
        "/v1/responses",
        responses(json!({"previous_response_id": "resp_nope"})),
    );
    assert_eq!(r.status, 404);
    assert_eq!(error_of(&r)["param"], "previous_response_id");
}
