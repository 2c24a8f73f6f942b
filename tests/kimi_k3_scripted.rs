//! Kimi K3's markup parsed through the whole server on exact markup: the
//! scripted model (`specgate_scripted`, verify's `model/scripted.rs`)
//! replays a token script written in K3's tags, with the tiny K3's real
//! tokenizer and template, through the engine and the HTTP stack. Random
//! weights never write the markup; here every turn is known to the token.
//!
//! Each case is asked whole and streamed. The engine streams one token per
//! step, so the stream is split at every token boundary: no delta may hold
//! a marker or a piece of a tag, and the deltas put together must equal
//! the whole answer (reasoning, content, calls, finish reason).

mod common;

use common::*;
use serde_json::{json, Value};
use specgate::config::{Config, SpeculativeMethod};
use specgate::tokenizer::TextTokenizer;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

const NAME: &str = "k3-scripted";
/// K3's markers in the tiny vocabulary (fixture README).
const OPEN: u32 = 515;
const CLOSE: u32 = 516;
const SEP: u32 = 517;

fn tiny_k3() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kimi_k3/tiny-hf")
}

fn tokenizer() -> &'static TextTokenizer {
    static TOK: OnceLock<TextTokenizer> = OnceLock::new();
    TOK.get_or_init(|| TextTokenizer::from_hf_dir(&tiny_k3()).unwrap())
}

/// The ids of K3 markup text: each marker its one special id, the rest
/// as the tiny tokenizer encodes it.
fn script(markup: &str) -> Vec<u32> {
    let ids = tokenizer().encode(markup, false).unwrap();
    for (marker, id) in [("<|open|>", OPEN), ("<|close|>", CLOSE), ("<|sep|>", SEP)] {
        assert_eq!(
            ids.iter().filter(|&&t| t == id).count(),
            markup.matches(marker).count(),
            "{marker} in {markup}"
        );
    }
    assert_eq!(tokenizer().decode(&ids, false).unwrap(), markup);
    ids
}

/// A server of the scripted model replaying `markup` after any prompt,
/// with the tiny K3's tokenizer files; n-gram speculation when `spec`.
fn server(markup: &str, spec: bool) -> Server {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = scratch_dir("k3-scripted").join(N.fetch_add(1, Ordering::Relaxed).to_string());
    std::fs::create_dir_all(&dir).unwrap();
    for f in [
        "tiktoken.model",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(tiny_k3().join(f), dir.join(f)).unwrap();
    }
    let config = json!({"model_type": "specgate_scripted", "vocab_size": 768,
                        "bos_token_id": 512, "eos_token_id": 514, "pad_token_id": 767,
                        "scripts": [script(markup)]});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut cfg = Config::default();
    cfg.server.port = 0;
    cfg.server.served_model_name = Some(NAME.into());
    cfg.model.path = dir;
    cfg.draft.path = None;
    cfg.speculative.method = if spec {
        SpeculativeMethod::Ngram
    } else {
        SpeculativeMethod::Off
    };
    cfg.kv.num_blocks = 512;
    cfg.validate().unwrap();
    Server::start(cfg, None)
}

fn tools() -> Value {
    let tool = |name: &str, props: Value| {
        json!({"type": "function", "function": {"name": name, "description": name,
               "parameters": {"type": "object", "properties": props}}})
    };
    json!([
        tool(
            "get_weather",
            json!({"city": {"type": "string"}, "days": {"type": "number"}})
        ),
        tool("get_time", json!({"city": {"type": "string"}})),
        tool("echo", json!({})),
    ])
}

/// What a turn came to: reasoning, content, calls as (id, name,
/// arguments), finish reason; `None` for an absent or empty text field.
#[derive(Debug, PartialEq)]
struct Turn {
    reasoning: Option<String>,
    content: Option<String>,
    calls: Vec<(String, String, String)>,
    finish: String,
}

fn text(v: &Value) -> Option<String> {
    v.as_str().filter(|s| !s.is_empty()).map(str::to_owned)
}

fn call_of(c: &Value) -> (String, String, String) {
    assert_eq!(c["type"], "function", "{c}");
    let s = |v: &Value| v.as_str().unwrap_or_else(|| panic!("{c}")).to_owned();
    (
        s(&c["id"]),
        s(&c["function"]["name"]),
        s(&c["function"]["arguments"]),
    )
}

fn chat_request(extra: Value) -> Value {
    merge(
        json!({"model": NAME, "messages": [{"role": "user", "content": "weather in Paris?"}],
               "max_tokens": 400, "temperature": 0}),
        extra,
    )
}

/// The turn asked whole.
fn whole(s: &Server, extra: Value) -> Turn {
    let r = post(s.addr, "/v1/chat/completions", chat_request(extra));
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let c = &v["choices"][0];
    let m = &c["message"];
    Turn {
        reasoning: text(&m["reasoning_content"]),
        content: text(&m["content"]),
        calls: m["tool_calls"]
            .as_array()
            .map(|a| a.iter().map(call_of).collect())
            .unwrap_or_default(),
        finish: c["finish_reason"].as_str().unwrap().to_owned(),
    }
}

/// The turn streamed, put back together; panics on a delta holding a
/// marker or a piece of a tag, or on a call sent in parts.
fn streamed(s: &Server, extra: Value) -> (Turn, usize) {
    let r = post(
        s.addr,
        "/v1/chat/completions",
        chat_request(merge(extra, json!({"stream": true}))),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let (evs, done) = events(&r.body);
    assert!(done, "no [DONE]");
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
    let (mut finish, mut text_deltas) = (None, 0);
    for e in &evs {
        let Some(c) = e["choices"].get(0) else {
            continue;
        };
        let d = &c["delta"];
        for (field, acc) in [
            ("reasoning_content", &mut reasoning),
            ("content", &mut content),
        ] {
            if let Some(t) = d[field].as_str() {
                for frag in [
                    "<|", "|>", "think", "response", "tool=\"", "argument", "call ",
                ] {
                    assert!(!t.contains(frag), "{frag:?} in delta {d}");
                }
                text_deltas += usize::from(!t.is_empty());
                acc.push_str(t);
            }
        }
        for (i, call) in d["tool_calls"].as_array().into_iter().flatten().enumerate() {
            // Each call whole in one delta, indexes counting from 0.
            assert_eq!(call["index"], calls.len(), "call {i} of {d}");
            calls.push(call_of(call));
        }
        if let Some(f) = c["finish_reason"].as_str() {
            assert!(finish.is_none(), "two finish reasons");
            finish = Some(f.to_owned());
        }
    }
    let turn = Turn {
        reasoning: Some(reasoning).filter(|s| !s.is_empty()),
        content: Some(content).filter(|s| !s.is_empty()),
        calls,
        finish: finish.expect("no finish_reason"),
    };
    (turn, text_deltas)
}

/// Asks whole and streamed; checks that they agree and returns the turn.
fn ask(s: &Server, extra: Value) -> Turn {
    let w = whole(s, extra.clone());
    let (st, text_deltas) = streamed(s, extra);
    assert_eq!(st, w, "streamed vs whole");
    // Streamed token by token: text of several tokens came in many deltas.
    let words = [&w.reasoning, &w.content]
        .iter()
        .filter_map(|t| t.as_deref())
        .map(|t| t.split(' ').count())
        .sum::<usize>();
    assert!(text_deltas >= words, "{text_deltas} deltas for {w:?}");
    w
}

fn some(s: &str) -> Option<String> {
    Some(s.to_owned())
}

const REASONING: &str = "The user asks about Paris, so I answer.";

#[test]
fn reasoning_and_response_are_apart() {
    let s = server(
        &format!(
            "{REASONING}<|close|>think<|sep|><|open|>response<|sep|>It is sunny in Paris today.\
             <|close|>response<|sep|><|close|>message<|sep|>"
        ),
        false,
    );
    let t = ask(&s, json!({}));
    assert_eq!(
        t,
        Turn {
            reasoning: some(REASONING),
            content: some("It is sunny in Paris today."),
            calls: vec![],
            finish: "stop".into(),
        }
    );
    // Sampling follows the script too (the scripted logit dominates).
    let sampled = whole(&s, json!({"temperature": 1.0, "seed": 7}));
    assert_eq!(sampled, t);
}

const ONE_CALL: &str = "I need the weather.<|close|>think<|sep|><|open|>response<|sep|>\
     <|close|>response<|sep|><|open|>tools<|sep|>\
     <|open|>call tool=\"get_weather\" index=\"0\"<|sep|>\
     <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>\
     <|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>\
     <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";

#[test]
fn a_call_with_string_and_number_arguments() {
    let s = server(ONE_CALL, false);
    let t = ask(&s, json!({"tools": tools()}));
    assert_eq!(t.reasoning, some("I need the weather."));
    assert_eq!(t.content, None);
    assert_eq!(t.finish, "tool_calls");
    assert_eq!(t.calls.len(), 1, "{t:?}");
    let (id, name, args) = &t.calls[0];
    assert_eq!(
        (id.as_str(), name.as_str()),
        ("functions.get_weather:0", "get_weather")
    );
    let args: Value = serde_json::from_str(args).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 3}));
    // Ids count the calls already in the conversation (Moonshot's form).
    let history = json!({"tools": tools(), "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.get_time:0",
            "type": "function", "function": {"name": "get_time", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "noon"},
        {"role": "user", "content": "and the weather in Paris?"}]});
    let later = ask(&s, history);
    assert_eq!(later.calls[0].0, "functions.get_weather:1", "{later:?}");
}

const TWO_CALLS: &str = "Two tools.<|close|>think<|sep|><|open|>response<|sep|>Checking both.\
     <|close|>response<|sep|><|open|>tools<|sep|>\
     <|open|>call tool=\"get_weather\" index=\"0\"<|sep|>\
     <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>\
     <|close|>call<|sep|>\
     <|open|>call tool=\"get_time\" index=\"1\"<|sep|>\
     <|open|>argument key=\"city\" type=\"string\"<|sep|>Oslo<|close|>argument<|sep|>\
     <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";

#[test]
fn two_calls_get_indexes_0_and_1_and_distinct_ids_with_or_without_speculation() {
    let expected = Turn {
        reasoning: some("Two tools."),
        content: some("Checking both."),
        calls: vec![
            (
                "functions.get_weather:0".into(),
                "get_weather".into(),
                r#"{"city":"Paris"}"#.into(),
            ),
            (
                "functions.get_time:1".into(),
                "get_time".into(),
                r#"{"city":"Oslo"}"#.into(),
            ),
        ],
        finish: "tool_calls".into(),
    };
    // The script repeats its tags, so n-gram drafts are proposed, partly
    // rejected and rolled back in the pool: the turn is the same.
    for spec in [false, true] {
        let s = server(TWO_CALLS, spec);
        let mut t = ask(&s, json!({"tools": tools()}));
        for c in &mut t.calls {
            // Compare arguments as JSON (spacing is the server's).
            let v: Value = serde_json::from_str(&c.2).unwrap();
            c.2 = v.to_string();
        }
        assert_eq!(t, expected, "speculation {spec}");
        if spec {
            // Drafts were proposed, and some rejected (rolled back).
            let m = request(s.addr, "GET", "/metrics", &[], "").body;
            let drafted = metric(&m, "specgate_spec_decode_num_draft_tokens_total");
            let accepted = metric(&m, "specgate_spec_decode_num_accepted_tokens_total");
            assert!(
                0.0 < accepted && accepted < drafted,
                "{accepted} of {drafted}"
            );
        }
    }
}

#[test]
fn escaped_attributes_and_raw_strings_with_quotes_and_braces() {
    let s = server(
        "Echo it.<|close|>think<|sep|><|open|>response<|sep|>Say \"{x}\" & go.\
         <|close|>response<|sep|><|open|>tools<|sep|>\
         <|open|>call tool=\"echo\" index=\"0\"<|sep|>\
         <|open|>argument key=\"a&quot;b&amp;c\" type=\"string\"<|sep|>{\"k\": \"v\"} and \"q\"\
         <|close|>argument<|sep|>\
         <|open|>argument key=\"n\" type=\"object\"<|sep|>{\"x\": [1, \"}\"]}<|close|>argument<|sep|>\
         <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>",
        false,
    );
    let t = ask(&s, json!({"tools": tools()}));
    assert_eq!(t.content, some("Say \"{x}\" & go."));
    assert_eq!(t.finish, "tool_calls");
    assert_eq!(t.calls.len(), 1, "{t:?}");
    assert_eq!(t.calls[0].0, "functions.echo:0");
    let args: Value = serde_json::from_str(&t.calls[0].2).unwrap();
    assert_eq!(
        args,
        json!({"a\"b&c": "{\"k\": \"v\"} and \"q\"", "n": {"x": [1, "}"]}})
    );
}

#[test]
fn a_cut_inside_the_think_channel_is_all_reasoning() {
    let markup = "one two three four five six seven eight nine ten eleven twelve\
                  <|close|>think<|sep|><|open|>response<|sep|>done<|close|>response<|sep|>\
                  <|close|>message<|sep|>";
    let ids = script(markup);
    let s = server(markup, false);
    let t = ask(&s, json!({"max_tokens": 6}));
    let cut = tokenizer().decode(&ids[..6], false).unwrap();
    assert!(cut.len() > 10 && !cut.contains("<|"), "{cut}");
    assert_eq!(
        t,
        Turn {
            reasoning: Some(cut),
            content: None,
            calls: vec![],
            finish: "length".into(),
        }
    );
}

#[test]
fn tool_choice_none_parses_no_calls() {
    let s = server(ONE_CALL, false);
    let t = ask(&s, json!({"tools": tools(), "tool_choice": "none"}));
    assert_eq!(t.reasoning, some("I need the weather."));
    assert!(t.calls.is_empty(), "{t:?}");
    assert_eq!(t.finish, "stop");
    // The call's markup is not content either.
    assert_eq!(t.content, None, "{t:?}");
    // The same turn with tools active is a call.
    let parsed = ask(&s, json!({"tools": tools()}));
    assert_eq!(parsed.finish, "tool_calls");
    assert_eq!(parsed.calls.len(), 1);
}

/// Text after the calls: a second response channel.
const CALL_THEN_TEXT: &str = "Look it up.<|close|>think<|sep|><|open|>response<|sep|>Checking.\
     <|close|>response<|sep|><|open|>tools<|sep|>\
     <|open|>call tool=\"get_weather\" index=\"0\"<|sep|>\
     <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>\
     <|close|>call<|sep|><|close|>tools<|sep|>\
     <|open|>response<|sep|>Done.<|close|>response<|sep|><|close|>message<|sep|>";

/// A Responses continuation by `previous_response_id` runs on the same
/// conversation as the output items resent whole, however the output is
/// split into items (here text, a call, then text again: the store once
/// kept that as one assistant turn, the items read back as two).
#[test]
fn a_continuation_by_id_equals_the_output_resent_whole() {
    for markup in [CALL_THEN_TEXT, TWO_CALLS] {
        let s = server(markup, false);
        let tools: Vec<Value> = tools()
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let f = &t["function"];
                json!({"type": "function", "name": f["name"], "parameters": f["parameters"]})
            })
            .collect();
        let ask = "weather in Paris?";
        let r = post(
            s.addr,
            "/v1/responses",
            json!({"model": NAME, "input": ask, "tools": tools, "max_output_tokens": 400,
                   "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let first: Value = serde_json::from_str(&r.body).unwrap();
        let output = first["output"].as_array().unwrap().clone();
        let call = output
            .iter()
            .find(|i| i["type"] == "function_call")
            .unwrap_or_else(|| panic!("{first}"));
        let answer = json!({"type": "function_call_output", "call_id": call["call_id"],
                            "output": "sunny"});
        let mut resent = vec![json!({"role": "user", "content": ask})];
        resent.extend(output.iter().cloned());
        resent.push(answer.clone());
        let whole = post(
            s.addr,
            "/v1/responses",
            json!({"model": NAME, "input": resent, "tools": tools, "max_output_tokens": 4,
                   "temperature": 0, "store": false}),
        );
        let by_id = post(
            s.addr,
            "/v1/responses",
            json!({"model": NAME, "previous_response_id": first["id"], "input": [answer],
                   "tools": tools, "max_output_tokens": 4, "temperature": 0}),
        );
        assert_eq!(whole.status, 200, "{}", whole.body);
        assert_eq!(by_id.status, 200, "{}", by_id.body);
        let tokens = |b: &str| {
            let v: Value = serde_json::from_str(b).unwrap();
            v["usage"]["input_tokens"].as_u64().unwrap()
        };
        assert_eq!(
            tokens(&by_id.body),
            tokens(&whole.body),
            "output {output:?}"
        );
        s.wait_idle();
    }
}
