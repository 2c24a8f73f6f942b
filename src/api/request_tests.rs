//! Unit tests of request parsing: every validation error names its field,
//! accepted shapes normalize as documented.

use serde_json::{json, Value};

use super::*;
use crate::tokenizer::ChatMessage;

fn chat(v: Value) -> Result<ValidRequest, ApiError> {
    parse_chat(v.to_string().as_bytes())
}

fn completion(v: Value) -> Result<ValidRequest, ApiError> {
    parse_completion(v.to_string().as_bytes())
}

/// A minimal valid chat body with `extra` merged in at the top level.
fn chat_with(extra: Value) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn completion_with(extra: Value) -> Value {
    let mut body = json!({"model": "m", "prompt": "hi"});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// Asserts the body is refused with 400 and `param == Some(param)`.
#[track_caller]
fn assert_rejects(r: Result<ValidRequest, ApiError>, param: &str) -> ApiError {
    let e = r.expect_err("should be rejected");
    assert_eq!(e.status(), 400, "{e:?}");
    assert_eq!(e.param.as_deref(), Some(param), "{e:?}");
    assert!(
        e.message.contains(param),
        "message should name {param}: {e:?}"
    );
    e
}

/// Field `name` set to `value` is refused naming `param`, by both endpoints.
#[track_caller]
fn rejects_both(name: &str, value: Value, param: &str) {
    assert_rejects(chat(chat_with(json!({ name: value.clone() }))), param);
    assert_rejects(completion(completion_with(json!({ name: value }))), param);
}

#[test]
fn minimal_chat_defaults() {
    let r = chat(chat_with(json!({}))).unwrap();
    assert_eq!(r.model, "m");
    assert_eq!(r.input, Input::Chat(vec![ChatMessage::new("user", "hi")]));
    assert_eq!(r.max_tokens, None);
    assert_eq!(r.sampling.temperature, DEFAULT_TEMPERATURE);
    assert_eq!(r.sampling.top_p, 1.0);
    assert_eq!(r.sampling.top_k, 0);
    assert_eq!(r.sampling.seed, None);
    assert!(r.stop.is_empty());
    assert!(!r.stream && !r.include_usage);
    assert_eq!(r.meta, RequestMeta::default());
    assert_eq!(r.controls, specgate_verify::Controls::default());
    assert_eq!((r.logprobs, r.echo), (None, false));
    assert_eq!(r.response_format, ResponseFormat::Text);
    assert_eq!(
        r.tools,
        ToolSetup {
            parallel: true,
            ..ToolSetup::default()
        }
    );
    assert!(r.stop_token_ids.is_empty());
    assert_eq!(r.speculative, None);
}

#[test]
fn minimal_completion_defaults() {
    let r = completion(completion_with(json!({}))).unwrap();
    assert_eq!(r.input, Input::Prompt("hi".into()));
    assert_eq!(r.max_tokens, None);
    assert_eq!(r.max_new_tokens(1000), COMPLETION_DEFAULT_MAX_TOKENS);
    assert_eq!(r.max_new_tokens(3), 3, "a default never exceeds the room");
}

#[test]
fn all_fields_accepted() {
    let r = chat(chat_with(json!({
        "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 42,
        "stop": ["a", "b"], "stream": true, "stream_options": {"include_usage": true},
        "n": 1, "logprobs": false, "user": "alice",
        "speculative": {"method": "draft", "num_tokens": 4}
    })))
    .unwrap();
    assert_eq!(r.max_tokens, Some(7));
    assert_eq!(r.sampling.temperature, 0.5);
    assert_eq!(r.sampling.top_p, 0.9);
    assert_eq!(r.sampling.top_k, 40);
    assert_eq!(r.sampling.seed, Some(42));
    assert_eq!(r.stop, vec!["a", "b"]);
    assert!(r.stream && r.include_usage);
    assert_eq!(r.meta.user.as_deref(), Some("alice"));
    assert_eq!(
        r.speculative,
        Some(SpecOverride {
            method: Some(SpecMethod::Draft),
            num_tokens: Some(4)
        })
    );
}

#[test]
fn nulls_are_absent() {
    let r = chat(chat_with(json!({
        "max_tokens": null, "temperature": null, "top_p": null, "top_k": null,
        "seed": null, "stop": null, "stream": null, "stream_options": null, "n": null,
        "logprobs": null, "top_logprobs": null, "user": null, "speculative": null
    })))
    .unwrap();
    assert_eq!(r, chat(chat_with(json!({}))).unwrap());
    // Every optional field the endpoint reads, null at once.
    let mut body = chat_with(json!({}));
    for f in KNOWN_CHAT_FIELDS
        .iter()
        .filter(|f| !["model", "messages"].contains(f))
    {
        body[*f] = Value::Null;
    }
    assert_eq!(chat(body).unwrap(), chat(chat_with(json!({}))).unwrap());
    let mut body = completion_with(json!({}));
    for f in KNOWN_COMPLETION_FIELDS
        .iter()
        .filter(|f| !["model", "prompt"].contains(f))
    {
        body[*f] = Value::Null;
    }
    assert_eq!(
        completion(body).unwrap(),
        completion(completion_with(json!({}))).unwrap()
    );
}

#[test]
fn unknown_fields_rejected_naming_them() {
    for (body, name) in [
        (
            chat_with(json!({"frobnicate": {"x": [1, 2]}})),
            "frobnicate",
        ),
        (chat_with(json!({"echo": true})), "echo"),
        (chat_with(json!({"best_of": 1})), "best_of"),
    ] {
        let e = assert_rejects(chat(body), name);
        assert_eq!(
            e.message,
            format!("Unrecognized request argument supplied: {name}")
        );
    }
    for name in ["tools", "tool_choice", "messages", "top_logprobs", "foo"] {
        assert_rejects(completion(completion_with(json!({ name: 1 }))), name);
    }
    // A null unknown field is still a field the server does not know.
    assert_rejects(chat(chat_with(json!({"foo": null}))), "foo");
    // Unknown keys inside a message are refused too.
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x", "mood": "ok"}]});
    assert_rejects(chat(body), "messages[0].mood");
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x", "name": "bob"}]});
    let r = chat(body).unwrap();
    let Input::Chat(m) = r.input else { panic!() };
    assert_eq!(m[0].name.as_deref(), Some("bob"));
}

#[test]
fn body_not_json_or_not_object() {
    for body in [
        &b"{not json"[..],
        b"",
        b"\xff\xfe",
        b"[1,2]",
        b"\"str\"",
        b"null",
    ] {
        for r in [parse_chat(body), parse_completion(body)] {
            let e = r.unwrap_err();
            assert_eq!(e.status(), 400);
            assert_eq!(e.kind, ErrorKind::InvalidRequest);
            assert_eq!(e.param, None);
        }
    }
}

#[test]
fn model_required_and_string() {
    assert_rejects(
        chat(json!({"messages": [{"role": "user", "content": "x"}]})),
        "model",
    );
    assert_rejects(completion(json!({"prompt": "x"})), "model");
    rejects_both("model", json!(3), "model");
    rejects_both("model", json!(["m"]), "model");
}

#[test]
fn messages_shape() {
    assert_rejects(chat(json!({"model": "m"})), "messages");
    assert_rejects(chat(json!({"model": "m", "messages": []})), "messages");
    assert_rejects(chat(json!({"model": "m", "messages": "hi"})), "messages");
    assert_rejects(
        chat(json!({"model": "m", "messages": ["hi"]})),
        "messages[0]",
    );
    let two = |second: Value| json!({"model": "m", "messages": [{"role": "user", "content": "a"}, second]});
    assert_rejects(chat(two(json!({"content": "x"}))), "messages[1].role");
    assert_rejects(
        chat(two(json!({"role": 1, "content": "x"}))),
        "messages[1].role",
    );
    assert_rejects(
        chat(two(json!({"role": "wizard", "content": "x"}))),
        "messages[1].role",
    );
    assert_rejects(chat(two(json!({"role": "user"}))), "messages[1].content");
    assert_rejects(
        chat(two(json!({"role": "user", "content": 5}))),
        "messages[1].content",
    );
    assert_rejects(
        chat(two(json!({"role": "user", "content": {"text": "x"}}))),
        "messages[1].content",
    );
}

#[test]
fn roles_and_assistant_without_content() {
    let body = json!({"model": "m", "messages": [
        {"role": "developer", "content": "d"},
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": null},
    ]});
    let r = chat(body).unwrap();
    assert_eq!(
        r.input,
        Input::Chat(vec![
            ChatMessage::new("system", "d"),
            ChatMessage::new("system", "s"),
            ChatMessage::new("user", "u"),
            ChatMessage::new("assistant", ""),
        ])
    );
}

#[test]
fn content_text_parts() {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}, {"type": "text", "text": "world"}
    ]}]});
    let r = chat(body).unwrap();
    assert_eq!(
        r.input,
        Input::Chat(vec![ChatMessage::new("user", "hello\nworld")])
    );

    let with_parts = |parts: Value| {
        json!({"model": "m", "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": parts}
        ]})
    };
    let e = assert_rejects(
        chat(with_parts(
            json!([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]),
        )),
        "messages[1].content",
    );
    assert!(e.message.contains("image_url"), "{e:?}");
    for bad in [
        json!(["plain"]),
        json!([{"text": "no type"}]),
        json!([{"type": 1, "text": "x"}]),
        json!([{"type": "text"}]),
        json!([{"type": "text", "text": 3}]),
    ] {
        assert_rejects(chat(with_parts(bad)), "messages[1].content");
    }
}

#[test]
fn prompt_forms() {
    let r = completion(json!({"model": "m", "prompt": ["only one"]})).unwrap();
    assert_eq!(r.input, Input::Prompt("only one".into()));
    assert_rejects(completion(json!({"model": "m"})), "prompt");
    assert_rejects(
        completion(json!({"model": "m", "prompt": ["a", "b"]})),
        "prompt",
    );
    assert_rejects(completion(json!({"model": "m", "prompt": []})), "prompt");
    // Token ids, as OpenAI and vLLM take them: `[int]` or `[[int]]` of one.
    for ids in [json!([1, 2, 3]), json!([[1, 2, 3]])] {
        let r = completion(json!({"model": "m", "prompt": ids})).unwrap();
        assert_eq!(r.input, Input::Tokens(vec![1, 2, 3]));
    }
    for bad in [
        json!([-1]),
        json!([4_294_967_296u64]),
        json!([1, "a"]),
        json!([[]]),
        json!([[1], [2]]),
        json!([[1], "a"]),
    ] {
        assert_rejects(completion(json!({"model": "m", "prompt": bad})), "prompt");
    }
    assert_rejects(completion(json!({"model": "m", "prompt": 5})), "prompt");
    assert_rejects(
        completion(json!({"model": "m", "prompt": {"a": 1}})),
        "prompt",
    );
}

#[test]
fn max_tokens_validation_and_precedence() {
    for name in ["max_tokens", "max_completion_tokens"] {
        rejects_both(name, json!(0), name);
        rejects_both(name, json!(-5), name);
        rejects_both(name, json!(1.5), name);
        rejects_both(name, json!(2.0), name);
        rejects_both(name, json!("10"), name);
        rejects_both(name, json!(true), name);
    }
    let both = json!({"max_tokens": 10, "max_completion_tokens": 20});
    assert_eq!(chat(chat_with(both.clone())).unwrap().max_tokens, Some(20));
    assert_eq!(
        completion(completion_with(both)).unwrap().max_tokens,
        Some(20)
    );
    let only_old = json!({"max_tokens": 10});
    assert_eq!(
        chat(chat_with(only_old.clone())).unwrap().max_tokens,
        Some(10)
    );
    assert_eq!(
        completion(completion_with(only_old)).unwrap().max_tokens,
        Some(10)
    );
    let only_new = json!({"max_completion_tokens": 3});
    assert_eq!(chat(chat_with(only_new)).unwrap().max_tokens, Some(3));
}

#[test]
fn temperature_range_and_type() {
    for ok in [
        json!(0),
        json!(0.0),
        json!(1),
        json!(2),
        json!(2.0),
        json!(0.7),
    ] {
        let r = chat(chat_with(json!({"temperature": ok.clone()}))).unwrap();
        assert_eq!(r.sampling.temperature, ok.as_f64().unwrap() as f32);
    }
    for bad in [
        json!(-0.1),
        json!(2.01),
        json!(100),
        json!("1"),
        json!(true),
        json!([1]),
    ] {
        rejects_both("temperature", bad, "temperature");
    }
}

#[test]
fn top_p_range_and_type() {
    assert_eq!(
        chat(chat_with(json!({"top_p": 1}))).unwrap().sampling.top_p,
        1.0
    );
    assert_eq!(
        chat(chat_with(json!({"top_p": 0.01})))
            .unwrap()
            .sampling
            .top_p,
        0.01
    );
    for bad in [
        json!(0),
        json!(0.0),
        json!(-0.5),
        json!(1.0001),
        json!("0.5"),
        json!(false),
    ] {
        rejects_both("top_p", bad, "top_p");
    }
}

#[test]
fn top_k_off_values_and_range() {
    for (v, k) in [
        (json!(-1), 0),
        (json!(0), 0),
        (json!(1), 1),
        (json!(50), 50),
    ] {
        assert_eq!(
            chat(chat_with(json!({"top_k": v}))).unwrap().sampling.top_k,
            k
        );
    }
    for bad in [json!(-2), json!(-100), json!(1.5), json!("5"), json!(false)] {
        rejects_both("top_k", bad, "top_k");
    }
}

#[test]
fn seed_u64() {
    let r = chat(chat_with(json!({"seed": u64::MAX}))).unwrap();
    assert_eq!(r.sampling.seed, Some(u64::MAX));
    assert_eq!(
        chat(chat_with(json!({"seed": 0}))).unwrap().sampling.seed,
        Some(0)
    );
    for bad in [json!(-1), json!(1.5), json!("42"), json!(true)] {
        rejects_both("seed", bad, "seed");
    }
}

#[test]
fn stop_forms() {
    assert_eq!(
        chat(chat_with(json!({"stop": "x"}))).unwrap().stop,
        vec!["x"]
    );
    assert_eq!(
        chat(chat_with(json!({"stop": []}))).unwrap().stop,
        Vec::<String>::new()
    );
    let four = json!({"stop": ["a", "b", "c", "d"]});
    assert_eq!(completion(completion_with(four)).unwrap().stop.len(), 4);
    for bad in [
        json!(["a", "b", "c", "d", "e"]),
        json!(""),
        json!(["a", ""]),
        json!(["a", 1]),
        json!(5),
        json!({"s": "x"}),
    ] {
        rejects_both("stop", bad, "stop");
    }
}

#[test]
fn stream_and_stream_options() {
    rejects_both("stream", json!("true"), "stream");
    rejects_both("stream", json!(1), "stream");
    let r = chat(chat_with(json!({"stream": true, "stream_options": {}}))).unwrap();
    assert!(r.stream && !r.include_usage);
    let r = completion(completion_with(
        json!({"stream": true, "stream_options": {"include_usage": false}}),
    ));
    assert!(!r.unwrap().include_usage);
    let r = completion(completion_with(
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    ));
    assert!(r.unwrap().include_usage);
    // Unknown keys inside stream_options are ignored.
    let r = chat(chat_with(
        json!({"stream": true, "stream_options": {"continuous_usage_stats": true}}),
    ));
    assert!(r.is_ok());
    let bad_opts = |v: Value| chat(chat_with(json!({"stream": true, "stream_options": v})));
    assert_rejects(bad_opts(json!(true)), "stream_options");
    assert_rejects(
        bad_opts(json!({"include_usage": "yes"})),
        "stream_options.include_usage",
    );
    assert_rejects(
        bad_opts(json!({"include_usage": 1})),
        "stream_options.include_usage",
    );
    // Only allowed with streaming (as OpenAI and vLLM do).
    let no_stream = json!({"stream_options": {"include_usage": true}});
    assert_rejects(chat(chat_with(no_stream.clone())), "stream_options");
    assert_rejects(completion(completion_with(no_stream)), "stream_options");
}

#[test]
fn n_only_one() {
    assert!(chat(chat_with(json!({"n": 1}))).is_ok());
    let e = assert_rejects(chat(chat_with(json!({"n": 2}))), "n");
    assert!(e.message.contains("n>1 is not supported"), "{e:?}");
    let e = assert_rejects(completion(completion_with(json!({"n": 5}))), "n");
    assert!(e.message.contains("n>1 is not supported"), "{e:?}");
    for bad in [json!(0), json!(-1), json!(1.0), json!("1")] {
        rejects_both("n", bad, "n");
    }
}

#[test]
fn chat_logprobs_and_top_logprobs() {
    let lp = |extra: Value| chat(chat_with(extra));
    assert_eq!(lp(json!({"logprobs": true})).unwrap().logprobs, Some(0));
    assert_eq!(lp(json!({"logprobs": false})).unwrap().logprobs, None);
    assert_eq!(
        lp(json!({"logprobs": true, "top_logprobs": 20}))
            .unwrap()
            .logprobs,
        Some(20)
    );
    assert_eq!(
        lp(json!({"logprobs": true, "top_logprobs": 0}))
            .unwrap()
            .logprobs,
        Some(0)
    );
    assert_rejects(lp(json!({"logprobs": "yes"})), "logprobs");
    assert_rejects(lp(json!({"logprobs": 1})), "logprobs");
    for bad in [json!(21), json!(-1), json!(1.5), json!("3")] {
        assert_rejects(
            lp(json!({"logprobs": true, "top_logprobs": bad})),
            "top_logprobs",
        );
    }
    let e = assert_rejects(lp(json!({"top_logprobs": 3})), "top_logprobs");
    assert!(e.message.contains("requires 'logprobs'"), "{e:?}");
    assert_rejects(
        lp(json!({"logprobs": false, "top_logprobs": 0})),
        "top_logprobs",
    );
}

#[test]
fn completion_logprobs_and_echo() {
    let r = |extra: Value| completion(completion_with(extra));
    assert_eq!(r(json!({"logprobs": false})).unwrap().logprobs, None);
    for n in [0, 5, 20] {
        assert_eq!(r(json!({ "logprobs": n })).unwrap().logprobs, Some(n));
    }
    for bad in [
        json!(21),
        json!(-1),
        json!(true),
        json!("5"),
        json!(18446744073709551615u64),
    ] {
        assert_rejects(r(json!({ "logprobs": bad })), "logprobs");
    }
    let v = r(json!({"echo": true, "logprobs": 2})).unwrap();
    assert!(v.echo);
    assert_eq!(v.logprobs, Some(2));
    assert!(!r(json!({"echo": false})).unwrap().echo);
    assert_rejects(r(json!({"echo": "no"})), "echo");
}

#[test]
fn penalties_ranges() {
    for name in ["presence_penalty", "frequency_penalty"] {
        for ok in [-2.0, 0.0, 0.5, 2.0] {
            let r = chat(chat_with(json!({ name: ok }))).unwrap();
            let got = if name == "presence_penalty" {
                r.controls.presence_penalty
            } else {
                r.controls.frequency_penalty
            };
            assert_eq!(got, ok as f32);
        }
        for bad in [json!(2.5), json!(-2.01), json!("1"), json!(true)] {
            rejects_both(name, bad, name);
        }
    }
    let r = completion(completion_with(json!({"repetition_penalty": 1.3}))).unwrap();
    assert_eq!(r.controls.repetition_penalty, 1.3);
    for bad in [json!(0), json!(-1.0), json!(1e300), json!("x")] {
        rejects_both("repetition_penalty", bad, "repetition_penalty");
    }
}

#[test]
fn logit_bias_shapes() {
    let r = chat(chat_with(
        json!({"logit_bias": {"5": -100, "17": 2.5, "0": 100}}),
    ))
    .unwrap();
    let mut b = r.controls.logit_bias.clone();
    b.sort_by_key(|(id, _)| *id);
    assert_eq!(b, vec![(0, 100.0), (5, -100.0), (17, 2.5)]);
    for bad in [
        json!({"x": 1}),
        json!({"-1": 1}),
        json!({"+3": 1}),
        json!({"1.5": 1}),
        json!({"4294967296": 1}),
        json!({"3": 101}),
        json!({"3": -100.5}),
        json!({"3": "1"}),
        json!([1, 2]),
        json!("1:2"),
    ] {
        rejects_both("logit_bias", bad, "logit_bias");
    }
    let many: serde_json::Map<String, Value> =
        (0..301).map(|i| (i.to_string(), json!(1))).collect();
    rejects_both("logit_bias", Value::Object(many), "logit_bias");
}

#[test]
fn min_p_min_tokens_stop_token_ids() {
    let r = chat(chat_with(
        json!({"min_p": 0.05, "min_tokens": 3, "max_tokens": 5, "stop_token_ids": [7, 0]}),
    ))
    .unwrap();
    assert_eq!(r.sampling.min_p, 0.05);
    assert_eq!(r.controls.min_tokens, 3);
    assert_eq!(r.stop_token_ids, vec![7, 0]);
    // Without max_tokens the limit is checked against the context later.
    assert_eq!(
        chat(chat_with(json!({"min_tokens": 1000})))
            .unwrap()
            .controls
            .min_tokens,
        1000
    );
    for bad in [json!(-0.1), json!(1.5), json!("0.1")] {
        rejects_both("min_p", bad, "min_p");
    }
    for bad in [json!(-1), json!(1.5), json!("1")] {
        rejects_both("min_tokens", bad, "min_tokens");
    }
    // Above the completions default (16): checked once the room is known,
    // like chat's.
    let r = completion(completion_with(json!({"min_tokens": 17}))).unwrap();
    assert!(r.max_new_tokens(1000) < r.controls.min_tokens);
    assert_rejects(
        chat(chat_with(
            json!({"min_tokens": 6, "max_completion_tokens": 5}),
        )),
        "min_tokens",
    );
    for bad in [
        json!(-1),
        json!([1, "2"]),
        json!([4294967296u64]),
        json!(3),
        json!([1.0]),
    ] {
        rejects_both("stop_token_ids", bad, "stop_token_ids");
    }
}

#[test]
fn openai_fields_we_cannot_honour_are_refused_with_a_reason() {
    for (name, value) in [
        ("audio", json!({"voice": "alloy", "format": "wav"})),
        ("modalities", json!(["text", "audio"])),
        ("functions", json!([{"name": "f"}])),
        ("function_call", json!("auto")),
        ("prediction", json!({"type": "content", "content": "x"})),
        ("verbosity", json!("low")),
        ("web_search_options", json!({})),
        ("store", json!(true)),
        ("service_tier", json!("flex")),
    ] {
        let e = assert_rejects(chat(chat_with(json!({ name: value }))), name);
        assert!(e.message.contains("not supported"), "{e:?}");
    }
    let e = assert_rejects(chat(chat_with(json!({"functions": []}))), "functions");
    assert!(e.message.contains("'tools'"), "{e:?}");
    for (name, value) in [
        ("modalities", json!(["text"])),
        ("store", json!(false)),
        ("service_tier", json!("auto")),
        ("service_tier", json!("default")),
        ("prompt_cache_key", json!("k")),
        ("safety_identifier", json!("h")),
        ("metadata", json!({"k": "v"})),
    ] {
        assert!(chat(chat_with(json!({ name: value }))).is_ok(), "{name}");
    }
    for (name, bad) in [
        ("modalities", json!("text")),
        ("store", json!("no")),
        ("service_tier", json!(1)),
        ("prompt_cache_key", json!(1)),
        ("safety_identifier", json!([])),
        ("metadata", json!("x")),
        ("metadata", json!({"k": 1})),
    ] {
        assert_rejects(chat(chat_with(json!({ name: bad }))), name);
    }
    let pairs: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    assert_rejects(
        chat(chat_with(json!({"metadata": Value::Object(pairs)}))),
        "metadata",
    );
    assert_rejects(
        chat(chat_with(json!({"metadata": {"k": "v".repeat(513)}}))),
        "metadata",
    );
    let r = chat(chat_with(
        json!({"metadata": {"a": "1"}, "user": "u", "safety_identifier": "s"}),
    ))
    .unwrap();
    assert_eq!(
        r.meta,
        RequestMeta {
            user: Some("u".into()),
            safety_identifier: Some("s".into()),
            metadata: vec![("a".into(), "1".into())],
        }
    );
}

#[test]
fn completion_only_fields() {
    assert!(completion(completion_with(
        json!({"echo": false, "best_of": 1, "suffix": ""})
    ))
    .is_ok());
    assert_rejects(completion(completion_with(json!({"echo": "no"}))), "echo");
    assert_rejects(
        completion(completion_with(json!({"best_of": 2}))),
        "best_of",
    );
    assert_rejects(
        completion(completion_with(json!({"best_of": 0}))),
        "best_of",
    );
    assert_rejects(
        completion(completion_with(json!({"suffix": "end"}))),
        "suffix",
    );
    assert_rejects(completion(completion_with(json!({"suffix": 1}))), "suffix");
}

#[test]
fn user_is_a_string() {
    assert!(completion(completion_with(json!({"user": "u"}))).is_ok());
    rejects_both("user", json!(7), "user");
}

#[test]
fn speculative_override() {
    let spec = |v: Value| chat(chat_with(json!({"speculative": v})));
    let ov = |method, num_tokens| Some(SpecOverride { method, num_tokens });
    let off = ov(Some(SpecMethod::Off), Some(0));
    assert_eq!(
        spec(json!({"method": "ngram"})).unwrap().speculative,
        ov(Some(SpecMethod::Ngram), None)
    );
    assert_eq!(
        spec(json!({"method": "draft", "num_tokens": 16}))
            .unwrap()
            .speculative,
        ov(Some(SpecMethod::Draft), Some(16))
    );
    assert_eq!(
        spec(json!({"num_tokens": 3})).unwrap().speculative,
        ov(None, Some(3))
    );
    assert_eq!(spec(json!({"method": "off"})).unwrap().speculative, off);
    assert_eq!(
        spec(json!({"method": "off", "num_tokens": 0}))
            .unwrap()
            .speculative,
        off
    );
    assert_eq!(
        spec(json!({"method": "draft", "num_tokens": 0}))
            .unwrap()
            .speculative,
        off
    );
    assert_eq!(spec(json!({"num_tokens": 0})).unwrap().speculative, off);
    assert_eq!(spec(json!({})).unwrap().speculative, None);
    assert_eq!(spec(json!({"method": null})).unwrap().speculative, None);

    let s = spec(json!({"method": "ngram", "num_tokens": 5}))
        .unwrap()
        .speculative
        .unwrap();
    assert!(!s.is_off());
    assert_eq!(s.num_speculative_tokens(), Some(5));
    assert_eq!(off.unwrap().num_speculative_tokens(), Some(0));
    assert_eq!(
        ov(Some(SpecMethod::Draft), None)
            .unwrap()
            .num_speculative_tokens(),
        None
    );

    assert_rejects(spec(json!("draft")), "speculative");
    assert_rejects(spec(json!(true)), "speculative");
    assert_rejects(spec(json!({"method": "eagle"})), "speculative.method");
    assert_rejects(spec(json!({"method": 1})), "speculative.method");
    assert_rejects(spec(json!({"num_tokens": 17})), "speculative.num_tokens");
    assert_rejects(spec(json!({"num_tokens": -1})), "speculative.num_tokens");
    assert_rejects(spec(json!({"num_tokens": 2.5})), "speculative.num_tokens");
    assert_rejects(spec(json!({"num_tokens": "4"})), "speculative.num_tokens");
    assert_rejects(
        spec(json!({"method": "off", "num_tokens": 4})),
        "speculative.num_tokens",
    );
    assert_rejects(spec(json!({"num_token": 4})), "speculative.num_token");
    // The completions endpoint shares the parser.
    let r = completion(completion_with(
        json!({"speculative": {"method": "ngram", "num_tokens": 2}}),
    ));
    assert_eq!(r.unwrap().speculative, ov(Some(SpecMethod::Ngram), Some(2)));
}

/// `chat_template_kwargs` is an object of template variables (the
/// server's own ones excepted); `reasoning_effort` one of the known
/// efforts. Whether the model has a knob for it is the http layer's.
#[test]
fn template_knobs_are_parsed_and_bounded() {
    let v = chat(chat_with(json!({
        "chat_template_kwargs": {"thinking": false, "x": [1]},
        "reasoning_effort": "low",
    })))
    .unwrap();
    assert_eq!(v.knobs.template_vars.get("thinking"), Some(&json!(false)));
    assert_eq!(v.knobs.reasoning_effort.as_deref(), Some("low"));
    assert_rejects(
        chat(chat_with(json!({"chat_template_kwargs": [1]}))),
        "chat_template_kwargs",
    );
    assert_rejects(
        chat(chat_with(json!({"chat_template_kwargs": {"messages": []}}))),
        "chat_template_kwargs.messages",
    );
    assert_rejects(
        chat(chat_with(json!({"reasoning_effort": "huge"}))),
        "reasoning_effort",
    );
    assert_rejects(
        chat(chat_with(json!({"reasoning_effort": 1}))),
        "reasoning_effort",
    );
}
