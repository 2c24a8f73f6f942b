//! The agent-facing API end to end on the tiny generated model (in-code
//! ChatML tokenizer): log-probabilities in both endpoints' shapes, whole
//! and streamed, carried through stop strings and `echo`; structured
//! output (`response_format`, forced tool calls) and tool-calling
//! conversations; and every top-level field of OpenAI's chat request
//! either honoured or refused with a 400 naming it.

mod common;

use common::*;
use serde_json::{json, Value};

fn json_of(r: &Resp) -> Value {
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

fn completion(extra: Value) -> Value {
    merge(
        json!({"model": MODEL, "prompt": "hello world", "max_tokens": 12, "temperature": 0}),
        extra,
    )
}

/// The chat `logprobs.content` entries of every chunk of a stream, in order,
/// and the streamed text.
fn streamed_chat(body: &str) -> (Vec<Value>, String, Vec<String>) {
    let (evs, done) = events(body);
    assert!(done);
    let mut entries = Vec::new();
    let mut text = String::new();
    let mut reasons = Vec::new();
    for ev in &evs {
        for ch in ev["choices"].as_array().unwrap() {
            if let Some(c) = ch["delta"]["content"].as_str() {
                text.push_str(c);
            }
            if let Some(lp) = ch["logprobs"]["content"].as_array() {
                entries.extend(lp.iter().cloned());
            }
            if let Some(r) = ch["finish_reason"].as_str() {
                reasons.push(r.to_owned());
            }
        }
    }
    (entries, text, reasons)
}

/// Checks one chat logprobs entry's shape: token, finite logprob <= 0,
/// bytes, `top` alternatives sorted most likely first.
fn check_entry(e: &Value, top: usize) -> Vec<u8> {
    let token = e["token"].as_str().expect("token");
    let lp = e["logprob"].as_f64().expect("logprob");
    assert!(lp.is_finite() && lp <= 0.0, "{e}");
    let bytes: Vec<u8> = e["bytes"]
        .as_array()
        .expect("bytes")
        .iter()
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    assert_eq!(String::from_utf8_lossy(&bytes), token);
    let alts = e["top_logprobs"].as_array().expect("top_logprobs");
    assert_eq!(alts.len(), top, "{e}");
    for w in alts.windows(2) {
        assert!(w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64(), "{e}");
    }
    for a in alts {
        assert!(a["token"].is_string() && a["bytes"].is_array(), "{a}");
    }
    bytes
}

#[test]
fn chat_logprobs_whole_and_streamed_agree() {
    let s = Server::start(config(|_| {}), None);
    let body = chat(json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 10}));
    let v = json_of(&post(s.addr, "/v1/chat/completions", body.clone()));
    let choice = &v["choices"][0];
    let entries = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(choice["logprobs"]["refusal"], Value::Null);
    let n = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert_eq!(entries.len(), n, "one entry per generated token");
    let mut bytes = Vec::new();
    for e in entries {
        bytes.extend(check_entry(e, 3));
        // Greedy: the chosen token is the most likely one.
        assert_eq!(e["logprob"], e["top_logprobs"][0]["logprob"], "{e}");
    }
    let content = choice["message"]["content"].as_str().unwrap();
    // The text is the tokens' bytes decoded (the tiny random model writes
    // invalid UTF-8 too: replacement characters on both sides).
    if choice["finish_reason"] == "length" {
        assert_eq!(String::from_utf8_lossy(&bytes), content);
    }
    // Not asked: null.
    let v = json_of(&post(s.addr, "/v1/chat/completions", chat(json!({}))));
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);

    let r = post(
        s.addr,
        "/v1/chat/completions",
        merge(body, json!({"stream": true})),
    );
    let (streamed, text, reasons) = streamed_chat(&r.body);
    assert_eq!(text, content);
    assert_eq!(&streamed, entries, "the stream carries the same entries");
    assert_eq!(reasons.len(), 1);
    s.wait_idle();
}

#[test]
fn logprobs_ride_through_stop_strings() {
    let s = Server::start(config(|_| {}), None);
    let body = chat(json!({"logprobs": true, "max_tokens": 16}));
    let v = json_of(&post(s.addr, "/v1/chat/completions", body.clone()));
    let full = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    // A stop string from the middle of the greedy answer.
    let chars: Vec<char> = full.chars().collect();
    if chars.len() < 4 {
        return; // nothing to cut (the model ended at once)
    }
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    for stream in [false, true] {
        let r = post(
            s.addr,
            "/v1/chat/completions",
            merge(
                body.clone(),
                json!({"stop": [stop.clone()], "stream": stream}),
            ),
        );
        let (entries, text) = if stream {
            let (e, t, _) = streamed_chat(&r.body);
            (e, t)
        } else {
            let v = json_of(&r);
            (
                v["choices"][0]["logprobs"]["content"]
                    .as_array()
                    .unwrap()
                    .clone(),
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            )
        };
        assert!(!text.contains(&stop) && full.starts_with(&text), "{text:?}");
        // Only tokens whose text was released: their bytes are a prefix of
        // the text, and no token past the cut is reported.
        let bytes: Vec<u8> = entries.iter().flat_map(|e| check_entry(e, 0)).collect();
        let released = String::from_utf8_lossy(&bytes);
        assert!(text.starts_with(released.as_ref()), "{text:?} {entries:?}");
    }
    s.wait_idle();
}

#[test]
fn completion_logprobs_and_echo() {
    let s = Server::start(config(|_| {}), None);
    let v = json_of(&post(
        s.addr,
        "/v1/completions",
        completion(json!({"logprobs": 2})),
    ));
    let lp = &v["choices"][0]["logprobs"];
    let n = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[k].as_array().unwrap().len(), n, "{k}: {lp}");
    }
    for top in lp["top_logprobs"].as_array().unwrap() {
        assert_eq!(top.as_object().unwrap().len(), 2, "{top}");
    }
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();

    // echo: the prompt comes first, its first token has no logprob.
    let e = json_of(&post(
        s.addr,
        "/v1/completions",
        completion(json!({"logprobs": 2, "echo": true})),
    ));
    let prompt_tokens = e["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(
        e["choices"][0]["text"].as_str().unwrap(),
        format!("hello world{text}")
    );
    let elp = &e["choices"][0]["logprobs"];
    assert_eq!(elp["tokens"].as_array().unwrap().len(), prompt_tokens + n);
    assert_eq!(elp["token_logprobs"][0], Value::Null);
    assert_eq!(elp["top_logprobs"][0], Value::Null);
    assert!(elp["token_logprobs"][1].as_f64().unwrap() <= 0.0);
    assert_eq!(
        elp["tokens"].as_array().unwrap()[prompt_tokens..],
        lp["tokens"].as_array().unwrap()[..]
    );
    // echo alone: text only.
    let e = json_of(&post(
        s.addr,
        "/v1/completions",
        completion(json!({"echo": true})),
    ));
    assert_eq!(
        e["choices"][0]["text"].as_str().unwrap(),
        format!("hello world{text}")
    );
    assert_eq!(e["choices"][0]["logprobs"], Value::Null);

    // Streamed with echo: the same text and entries, chunk by chunk.
    let r = post(
        s.addr,
        "/v1/completions",
        completion(json!({"logprobs": 2, "echo": true, "stream": true})),
    );
    let (evs, done) = events(&r.body);
    assert!(done);
    let mut streamed_text = String::new();
    let mut tokens = Vec::new();
    for ev in &evs {
        let ch = &ev["choices"][0];
        streamed_text.push_str(ch["text"].as_str().unwrap());
        if let Some(t) = ch["logprobs"]["tokens"].as_array() {
            tokens.extend(t.iter().cloned());
        }
    }
    assert_eq!(streamed_text, format!("hello world{text}"));
    assert_eq!(&tokens, elp["tokens"].as_array().unwrap());
    s.wait_idle();
}

#[test]
fn json_object_output_parses() {
    let s = Server::start(config(|_| {}), None);
    for stream in [false, true] {
        let body = chat(json!({
            "response_format": {"type": "json_object"},
            "max_tokens": 120,
            "stream": stream,
        }));
        let r = post(s.addr, "/v1/chat/completions", body);
        let (text, reason) = if stream {
            let (_, t, reasons) = streamed_chat(&r.body);
            (t, reasons[0].clone())
        } else {
            let v = json_of(&r);
            (
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            )
        };
        // Greedy and deterministic: the grammar lets it end, and it does.
        assert_eq!(reason, "stop", "{text:?}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(v.is_object(), "{text}");
    }
    // A schema the grammar engine cannot use is the request's fault.
    let r = post(
        s.addr,
        "/v1/chat/completions",
        chat(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "required": ["a"], "properties": {"a": {"type": "not-a-type"}}}}}})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(error_of(&r)["param"], "response_format");
    s.wait_idle();
}

fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"], "additionalProperties": false}
    }}])
}

#[test]
fn forced_tool_calls_come_back_as_calls() {
    let s = Server::start(config(|_| {}), None);
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        for stream in [false, true] {
            let body = chat(json!({"tools": tools(), "tool_choice": choice,
                "parallel_tool_calls": false, "max_tokens": 150, "stream": stream}));
            let r = post(s.addr, "/v1/chat/completions", body);
            let (calls, reason) = if stream {
                let (evs, done) = events(&r.body);
                assert!(done);
                let mut calls = Vec::new();
                let mut reason = String::new();
                for ev in &evs {
                    let ch = &ev["choices"][0];
                    if let Some(tc) = ch["delta"]["tool_calls"].as_array() {
                        calls.extend(tc.iter().cloned());
                    }
                    if let Some(f) = ch["finish_reason"].as_str() {
                        reason = f.to_owned();
                    }
                }
                (calls, reason)
            } else {
                let v = json_of(&r);
                let m = &v["choices"][0]["message"];
                let calls = m["tool_calls"].as_array().cloned().unwrap_or_default();
                if !calls.is_empty() {
                    assert_eq!(m["content"], Value::Null, "{v}");
                }
                (
                    calls,
                    v["choices"][0]["finish_reason"]
                        .as_str()
                        .unwrap()
                        .to_owned(),
                )
            };
            assert_eq!(reason, "tool_calls", "{}", r.body);
            assert_eq!(calls.len(), 1, "{}", r.body);
            let c = &calls[0];
            assert_eq!(c["index"].as_u64().unwrap_or(0), 0);
            assert!(c["id"].as_str().unwrap().starts_with("call_"));
            assert_eq!(c["type"], "function");
            assert_eq!(c["function"]["name"], "get_weather");
            let args: Value =
                serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
            assert!(args["city"].is_string(), "{args}");
        }
    }
    s.wait_idle();
}

#[test]
fn a_tool_conversation_is_accepted_and_ids_are_checked() {
    let s = Server::start(config(|_| {}), None);
    let body = json!({"model": MODEL, "max_tokens": 4, "temperature": 0, "tools": tools(), "messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_a", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    ]});
    let v = json_of(&post(s.addr, "/v1/chat/completions", body));
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    for (extra, param) in [
        (json!({"logit_bias": {"384": 1}}), "logit_bias"),
        (json!({"stop_token_ids": [1, 99999]}), "stop_token_ids"),
        (json!({"min_tokens": 5000}), "min_tokens"),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"frobnicate": true}), "frobnicate"),
    ] {
        let r = post(s.addr, "/v1/chat/completions", chat(extra.clone()));
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        assert_eq!(error_of(&r)["param"], param, "{extra}");
    }
    s.wait_idle();
}

/// One HTTP pass over every top-level field of OpenAI's chat request:
/// each is answered 200 (honoured or accepted) or 400 naming it.
#[test]
fn every_openai_chat_field_over_http() {
    let s = Server::start(config(|_| {}), None);
    let tool = json!([{"type": "function", "function": {"name": "f"}}]);
    let table: Vec<(&str, Value, Value, u16)> = vec![
        (
            "messages",
            json!([{"role": "user", "content": "hi"}]),
            json!({}),
            200,
        ),
        ("model", json!(MODEL), json!({}), 200),
        (
            "audio",
            json!({"voice": "alloy", "format": "mp3"}),
            json!({}),
            400,
        ),
        ("frequency_penalty", json!(0.5), json!({}), 200),
        ("function_call", json!("auto"), json!({}), 400),
        ("functions", json!([{"name": "f"}]), json!({}), 400),
        ("logit_bias", json!({"42": -100}), json!({}), 200),
        ("logprobs", json!(true), json!({}), 200),
        ("max_completion_tokens", json!(3), json!({}), 200),
        ("max_tokens", json!(3), json!({}), 200),
        ("metadata", json!({"k": "v"}), json!({}), 200),
        ("modalities", json!(["text", "audio"]), json!({}), 400),
        ("n", json!(2), json!({}), 400),
        ("parallel_tool_calls", json!(false), json!({}), 200),
        (
            "prediction",
            json!({"type": "content", "content": "x"}),
            json!({}),
            400,
        ),
        ("presence_penalty", json!(0.5), json!({}), 200),
        ("prompt_cache_key", json!("k"), json!({}), 200),
        ("reasoning_effort", json!("low"), json!({}), 400),
        ("response_format", json!({"type": "text"}), json!({}), 200),
        ("safety_identifier", json!("s"), json!({}), 200),
        ("seed", json!(1), json!({}), 200),
        ("service_tier", json!("scale"), json!({}), 400),
        ("stop", json!("zz"), json!({}), 200),
        ("store", json!(true), json!({}), 400),
        ("stream", json!(true), json!({}), 200),
        (
            "stream_options",
            json!({"include_usage": true}),
            json!({"stream": true}),
            200,
        ),
        ("temperature", json!(0.5), json!({}), 200),
        ("tool_choice", json!("auto"), json!({"tools": tool}), 200),
        ("tools", tool.clone(), json!({}), 200),
        ("top_logprobs", json!(2), json!({"logprobs": true}), 200),
        ("top_p", json!(0.9), json!({}), 200),
        ("user", json!("u"), json!({}), 200),
        ("verbosity", json!("low"), json!({}), 400),
        ("web_search_options", json!({}), json!({}), 400),
    ];
    let mut names: Vec<&str> = table.iter().map(|t| t.0).collect();
    names.sort_unstable();
    let mut known: Vec<&str> = specgate::api::KNOWN_CHAT_FIELDS
        .iter()
        .copied()
        .take_while(|f| *f != "top_k")
        .collect();
    known.sort_unstable();
    assert_eq!(names, known, "the table must list every OpenAI field");
    for (name, value, extra, status) in table {
        let mut body = merge(chat(json!({"max_tokens": 3})), extra);
        body[name] = value;
        let r = post(s.addr, "/v1/chat/completions", body);
        assert_eq!(r.status, status, "{name}: {}", r.body);
        if status == 400 {
            assert_eq!(error_of(&r)["param"], name, "{name}");
        }
    }
    s.wait_idle();
}
