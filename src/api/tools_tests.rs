//! Unit tests of `tools`, `tool_choice`, `response_format`, tool-role and
//! tool-calling messages, and the request-schema table: every top-level
//! field of OpenAI's chat-completions request is honoured (reaching the
//! [`ValidRequest`]) or refused with a 400 naming it.

use serde_json::{json, Value};

use super::*;

fn chat(v: Value) -> Result<ValidRequest, ApiError> {
    parse_chat(v.to_string().as_bytes())
}

fn chat_with(extra: Value) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[track_caller]
fn rejects(r: Result<ValidRequest, ApiError>, param: &str) -> ApiError {
    let e = r.expect_err("should be rejected");
    assert_eq!(e.status(), 400, "{e:?}");
    assert_eq!(e.param.as_deref(), Some(param), "{e:?}");
    e
}

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": true
    }})
}

fn add() -> Value {
    json!({"type": "function", "function": {"name": "add"}})
}

#[test]
fn tools_parse_and_default_choice() {
    let r = chat(chat_with(json!({"tools": [weather(), add()]}))).unwrap();
    assert_eq!(r.tools.choice, ToolChoice::Auto);
    assert!(r.tools.parallel && r.tools.active() && !r.tools.forces_a_call());
    assert_eq!(r.tools.names(), vec!["get_weather", "add"]);
    let w = &r.tools.tools[0];
    assert_eq!(w.description.as_deref(), Some("Weather in a city"));
    assert!(w.strict);
    // The template sees OpenAI's shape; a tool without parameters has none.
    assert_eq!(w.template_value(), {
        let mut v = weather();
        v["function"].as_object_mut().unwrap().remove("strict");
        v
    });
    assert_eq!(r.tools.tools[1].template_value(), add());
    assert_eq!(
        r.tools.tools[1].arguments_schema(),
        json!({"type": "object"})
    );
    // No tools: nothing active, whatever tool_choice says.
    for choice in [json!("none"), json!("auto")] {
        let r = chat(chat_with(json!({"tool_choice": choice}))).unwrap();
        assert!(!r.tools.active());
    }
    let r = chat(chat_with(json!({"tools": []}))).unwrap();
    assert!(!r.tools.active());
}

#[test]
fn tool_choice_forms() {
    let with = |choice: Value| {
        chat(chat_with(
            json!({"tools": [weather(), add()], "tool_choice": choice}),
        ))
    };
    assert_eq!(with(json!("none")).unwrap().tools.choice, ToolChoice::None);
    assert!(!with(json!("none")).unwrap().tools.active());
    assert_eq!(with(json!("auto")).unwrap().tools.choice, ToolChoice::Auto);
    let r = with(json!("required")).unwrap();
    assert_eq!(r.tools.choice, ToolChoice::Required);
    assert_eq!(r.tools.forced_tools().len(), 2);
    let r = with(json!({"type": "function", "function": {"name": "add"}})).unwrap();
    assert_eq!(r.tools.choice, ToolChoice::Function("add".into()));
    assert_eq!(
        r.tools.forced_tools(),
        vec![("add".to_owned(), json!({"type": "object"}))]
    );
    rejects(with(json!("sometimes")), "tool_choice");
    rejects(with(json!(1)), "tool_choice");
    rejects(
        with(json!({"type": "function", "function": {"name": "nope"}})),
        "tool_choice.function.name",
    );
    rejects(
        with(json!({"type": "tool", "function": {"name": "add"}})),
        "tool_choice.type",
    );
    rejects(with(json!({"type": "function"})), "tool_choice.function");
    rejects(
        with(json!({"type": "function", "function": {"name": "add", "x": 1}})),
        "tool_choice.function.x",
    );
    // Forcing a call needs tools.
    rejects(
        chat(chat_with(json!({"tool_choice": "required"}))),
        "tool_choice",
    );
    rejects(
        chat(chat_with(
            json!({"tool_choice": {"type": "function", "function": {"name": "add"}}}),
        )),
        "tool_choice",
    );
    let r = chat(chat_with(
        json!({"tools": [add()], "parallel_tool_calls": false}),
    ))
    .unwrap();
    assert!(!r.tools.parallel);
    rejects(
        chat(chat_with(
            json!({"tools": [add()], "parallel_tool_calls": "no"}),
        )),
        "parallel_tool_calls",
    );
}

#[test]
fn bad_tools_name_the_field() {
    let with = |tools: Value| chat(chat_with(json!({ "tools": tools })));
    rejects(with(json!({})), "tools");
    rejects(with(json!([1])), "tools[0]");
    rejects(
        with(json!([{"type": "retrieval", "function": {"name": "a"}}])),
        "tools[0].type",
    );
    rejects(with(json!([{"function": {"name": "a"}}])), "tools[0].type");
    rejects(with(json!([{"type": "function"}])), "tools[0].function");
    rejects(
        with(json!([{"type": "function", "function": {}}])),
        "tools[0].function.name",
    );
    for bad in ["", "has space", "dot.name", &"x".repeat(65), "ünï"] {
        rejects(
            with(json!([{"type": "function", "function": {"name": bad}}])),
            "tools[0].function.name",
        );
    }
    assert!(with(json!([{"type": "function", "function": {"name": "A-b_9"}}])).is_ok());
    rejects(with(json!([add(), add()])), "tools[1].function.name");
    rejects(
        with(json!([{"type": "function", "function": {"name": "a", "parameters": "x"}}])),
        "tools[0].function.parameters",
    );
    rejects(
        with(json!([{"type": "function", "function": {"name": "a", "description": 1}}])),
        "tools[0].function.description",
    );
    rejects(
        with(json!([{"type": "function", "function": {"name": "a", "strict": "yes"}}])),
        "tools[0].function.strict",
    );
    rejects(
        with(json!([{"type": "function", "function": {"name": "a", "extra": 1}}])),
        "tools[0].function.extra",
    );
    rejects(
        with(json!([{"type": "function", "function": {"name": "a"}, "x": 1}])),
        "tools[0].x",
    );
    let many: Vec<Value> = (0..129)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
        .collect();
    rejects(with(Value::Array(many)), "tools");
}

#[test]
fn response_format_forms() {
    let rf = |v: Value| chat(chat_with(json!({ "response_format": v })));
    assert_eq!(
        rf(json!({"type": "text"})).unwrap().response_format,
        ResponseFormat::Text
    );
    assert_eq!(
        rf(json!({"type": "json_object"})).unwrap().response_format,
        ResponseFormat::JsonObject
    );
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let r = rf(json!({"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": true, "description": "d"
    }}))
    .unwrap();
    assert_eq!(
        r.response_format,
        ResponseFormat::JsonSchema {
            name: "thing".into(),
            schema,
            strict: true
        }
    );
    let r = rf(json!({"type": "json_schema", "json_schema": {"name": "n"}})).unwrap();
    assert!(
        matches!(r.response_format, ResponseFormat::JsonSchema { ref schema, strict: false, .. } if *schema == json!({}))
    );
    // Completions accept it too (as vLLM does).
    let r = parse_completion(
        json!({"model": "m", "prompt": "p", "response_format": {"type": "json_object"}})
            .to_string()
            .as_bytes(),
    )
    .unwrap();
    assert_eq!(r.response_format, ResponseFormat::JsonObject);
    rejects(rf(json!("json")), "response_format");
    rejects(rf(json!({})), "response_format.type");
    rejects(rf(json!({"type": "xml"})), "response_format.type");
    rejects(
        rf(json!({"type": "json_object", "schema": {}})),
        "response_format.schema",
    );
    rejects(
        rf(json!({"type": "json_schema"})),
        "response_format.json_schema",
    );
    rejects(
        rf(json!({"type": "json_schema", "json_schema": {}})),
        "response_format.json_schema.name",
    );
    rejects(
        rf(json!({"type": "json_schema", "json_schema": {"name": "a b"}})),
        "response_format.json_schema.name",
    );
    rejects(
        rf(json!({"type": "json_schema", "json_schema": {"name": "a", "schema": []}})),
        "response_format.json_schema.schema",
    );
    rejects(
        rf(json!({"type": "json_schema", "json_schema": {"name": "a", "strict": 1}})),
        "response_format.json_schema.strict",
    );
    rejects(
        rf(json!({"type": "json_schema", "json_schema": {"name": "a", "x": 1}})),
        "response_format.json_schema.x",
    );
    // A JSON format and a forced call cannot both hold.
    rejects(
        chat(chat_with(
            json!({"response_format": {"type": "json_object"},
            "tools": [add()], "tool_choice": "required"}),
        )),
        "response_format",
    );
    assert!(chat(chat_with(
        json!({"response_format": {"type": "json_object"}, "tools": [add()]})
    ))
    .is_ok());
}

#[test]
fn tool_round_trip_messages() {
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
        {"role": "assistant", "content": "21 degrees.", "refusal": null, "annotations": []},
    ]});
    let Input::Chat(m) = chat(body).unwrap().input else {
        panic!()
    };
    assert_eq!(m[1].role, "assistant");
    assert_eq!(m[1].content, "");
    assert_eq!(m[1].tool_calls.len(), 1);
    assert_eq!(m[1].tool_calls[0].id, "call_1");
    assert_eq!(m[1].tool_calls[0].function.name, "get_weather");
    // Parsed, as templates receive it.
    assert_eq!(
        m[1].tool_calls[0].function.arguments,
        json!({"city": "Paris"})
    );
    assert_eq!(m[2].role, "tool");
    assert_eq!(m[2].tool_call_id.as_deref(), Some("call_1"));
    assert_eq!(m[2].content, "{\"temp\": 21}");
    assert_eq!(m[3].content, "21 degrees.");
}

#[test]
fn bad_tool_messages_name_the_field() {
    let one = |m: Value| chat(json!({"model": "m", "messages": [m]}));
    rejects(
        one(json!({"role": "tool", "content": "x"})),
        "messages[0].tool_call_id",
    );
    rejects(
        one(json!({"role": "tool", "tool_call_id": "c"})),
        "messages[0].content",
    );
    rejects(
        one(json!({"role": "tool", "tool_call_id": 1, "content": "x"})),
        "messages[0].tool_call_id",
    );
    rejects(
        one(json!({"role": "user", "tool_call_id": "c", "content": "x"})),
        "messages[0].tool_call_id",
    );
    rejects(
        one(json!({"role": "user", "content": "x", "tool_calls": []})),
        "messages[0].tool_calls",
    );
    let call = |c: Value| one(json!({"role": "assistant", "tool_calls": [c]}));
    rejects(
        call(json!({"type": "function", "function": {"name": "f", "arguments": "{}"}})),
        "messages[0].tool_calls[0].id",
    );
    rejects(
        call(json!({"id": "c", "type": "tool", "function": {"name": "f", "arguments": "{}"}})),
        "messages[0].tool_calls[0].type",
    );
    rejects(
        call(json!({"id": "c", "type": "function"})),
        "messages[0].tool_calls[0].function",
    );
    rejects(
        call(json!({"id": "c", "function": {"arguments": "{}"}})),
        "messages[0].tool_calls[0].function.name",
    );
    rejects(
        call(json!({"id": "c", "function": {"name": "f"}})),
        "messages[0].tool_calls[0].function.arguments",
    );
    rejects(
        call(json!({"id": "c", "function": {"name": "f", "arguments": {"a": 1}}})),
        "messages[0].tool_calls[0].function.arguments",
    );
    let e = rejects(
        call(json!({"id": "c", "function": {"name": "f", "arguments": "{not json"}})),
        "messages[0].tool_calls[0].function.arguments",
    );
    assert!(e.message.contains("JSON"), "{e:?}");
    rejects(
        call(json!({"id": "c", "function": {"name": "f", "arguments": "{}"}, "x": 1})),
        "messages[0].tool_calls[0].x",
    );
    rejects(
        one(json!({"role": "assistant", "content": "x", "function_call": {"name": "f"}})),
        "messages[0].function_call",
    );
    rejects(
        one(json!({"role": "assistant", "content": "x", "refusal": 1})),
        "messages[0].refusal",
    );
    rejects(
        one(json!({"role": "assistant", "content": "x", "annotations": {}})),
        "messages[0].annotations",
    );
    rejects(
        one(json!({"role": "user", "content": "x", "name": 3})),
        "messages[0].name",
    );
}

/// How the request-schema table expects a field to fare.
enum Fate {
    /// Accepted, and `check` sees its effect on the parsed request.
    Honoured(fn(&ValidRequest) -> bool),
    /// Accepted with no effect on generation (documented: kept for the
    /// log, or a no-op such as `store: false`).
    Accepted,
    /// Refused with a 400 naming the field.
    Refused,
}

/// Every top-level field of OpenAI's chat-completions request (API
/// reference), each with a sample value: honoured or refused naming it,
/// never silently ignored. The list must cover [`KNOWN_CHAT_FIELDS`]'
/// OpenAI part exactly.
#[test]
fn every_openai_chat_field_is_honoured_or_refused() {
    use Fate::*;
    let table: Vec<(&str, Value, Fate)> = vec![
        (
            "messages",
            json!([{"role": "user", "content": "hello"}]),
            Honoured(|r| matches!(&r.input, Input::Chat(m) if m[0].content == "hello")),
        ),
        ("model", json!("m2"), Honoured(|r| r.model == "m2")),
        ("audio", json!({"voice": "alloy", "format": "mp3"}), Refused),
        (
            "frequency_penalty",
            json!(0.5),
            Honoured(|r| r.controls.frequency_penalty == 0.5),
        ),
        ("function_call", json!("auto"), Refused),
        (
            "functions",
            json!([{"name": "f", "parameters": {}}]),
            Refused,
        ),
        (
            "logit_bias",
            json!({"42": -100}),
            Honoured(|r| r.controls.logit_bias == vec![(42, -100.0)]),
        ),
        ("logprobs", json!(true), Honoured(|r| r.logprobs == Some(0))),
        (
            "max_completion_tokens",
            json!(9),
            Honoured(|r| r.max_tokens == Some(9)),
        ),
        (
            "max_tokens",
            json!(8),
            Honoured(|r| r.max_tokens == Some(8)),
        ),
        (
            "metadata",
            json!({"team": "a"}),
            Honoured(|r| r.meta.metadata == vec![("team".to_owned(), "a".to_owned())]),
        ),
        ("modalities", json!(["audio"]), Refused),
        ("n", json!(2), Refused),
        (
            "parallel_tool_calls",
            json!(false),
            Honoured(|r| !r.tools.parallel),
        ),
        (
            "prediction",
            json!({"type": "content", "content": "x"}),
            Refused,
        ),
        (
            "presence_penalty",
            json!(-0.5),
            Honoured(|r| r.controls.presence_penalty == -0.5),
        ),
        ("prompt_cache_key", json!("user-7"), Accepted),
        (
            "reasoning_effort",
            json!("high"),
            Honoured(|r| r.knobs.reasoning_effort.as_deref() == Some("high")),
        ),
        (
            "response_format",
            json!({"type": "json_object"}),
            Honoured(|r| r.response_format == ResponseFormat::JsonObject),
        ),
        (
            "safety_identifier",
            json!("h1"),
            Honoured(|r| r.meta.safety_identifier.as_deref() == Some("h1")),
        ),
        ("seed", json!(7), Honoured(|r| r.sampling.seed == Some(7))),
        ("service_tier", json!("priority"), Refused),
        ("stop", json!(["x"]), Honoured(|r| r.stop == vec!["x"])),
        ("store", json!(true), Refused),
        ("stream", json!(true), Honoured(|r| r.stream)),
        (
            "stream_options",
            json!({"include_usage": true}),
            Honoured(|r| r.include_usage),
        ),
        (
            "temperature",
            json!(0.25),
            Honoured(|r| r.sampling.temperature == 0.25),
        ),
        (
            "tool_choice",
            json!("required"),
            Honoured(|r| r.tools.choice == ToolChoice::Required),
        ),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f"}}]),
            Honoured(|r| r.tools.names() == vec!["f"]),
        ),
        (
            "top_logprobs",
            json!(3),
            Honoured(|r| r.logprobs == Some(3)),
        ),
        ("top_p", json!(0.5), Honoured(|r| r.sampling.top_p == 0.5)),
        (
            "user",
            json!("alice"),
            Honoured(|r| r.meta.user.as_deref() == Some("alice")),
        ),
        ("verbosity", json!("low"), Refused),
        (
            "web_search_options",
            json!({"search_context_size": "low"}),
            Refused,
        ),
    ];
    // Fields some others need to be meaningful.
    let companions = |name: &str| -> Value {
        match name {
            "stream_options" => json!({"stream": true}),
            "top_logprobs" => json!({"logprobs": true}),
            "tool_choice" => json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            _ => json!({}),
        }
    };
    let openai_part: Vec<&str> = KNOWN_CHAT_FIELDS
        .iter()
        .copied()
        .take_while(|f| *f != "top_k")
        .collect();
    let mut listed: Vec<&str> = table.iter().map(|(n, _, _)| *n).collect();
    listed.sort_unstable();
    let mut known = openai_part.clone();
    known.sort_unstable();
    assert_eq!(listed, known, "the table and KNOWN_CHAT_FIELDS disagree");
    for (name, value, fate) in table {
        let mut body = chat_with(companions(name));
        body[name] = value;
        let r = chat(body);
        match fate {
            Honoured(check) => {
                let v = r.unwrap_or_else(|e| panic!("{name} refused: {e:?}"));
                assert!(check(&v), "{name} did not reach the request: {v:?}");
            }
            Accepted => assert!(r.is_ok(), "{name}: {r:?}"),
            Refused => {
                let e = r.expect_err(name);
                assert_eq!(e.status(), 400, "{name}");
                assert_eq!(e.param.as_deref(), Some(name), "{e:?}");
            }
        }
    }
}
