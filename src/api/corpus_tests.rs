//! The parsers' answers to a generated corpus of request bodies, compared
//! with a recorded fixture: every wire format's body, each of its fields
//! (at every depth) replaced by a value of each JSON kind, removed, or
//! joined by an unknown field, and a set of malformed bodies. A change to
//! how bodies are parsed must leave every error byte for byte as it was
//! (`status` and the whole error body) and every accepted request equal.
//!
//! `SPECGATE_RECORD_CORPUS=1 cargo test --lib corpus` rewrites the fixture.

use serde_json::{json, Value};

use super::anthropic::{parse_count_tokens, parse_messages_request};
use super::responses::parse_responses_request;
use super::{parse_chat, parse_completion, parse_detokenize, parse_tokenize, ValidRequest};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/api-corpus.txt");

/// One line per accepted request's content, stable across runs (FNV-1a).
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A request as the corpus compares it: every field's `Debug`, with the
/// tools as templates see them (their schema's type is the parser's own).
fn summary(v: &ValidRequest) -> String {
    let mut bare = v.clone();
    let tools: Vec<Value> = bare
        .tools
        .tools
        .iter()
        .map(|t| t.template_value())
        .collect();
    let forced: Vec<(String, Value)> = v.tools.forced_tools();
    bare.tools.tools.clear();
    let bare = match &bare.response_format {
        super::ResponseFormat::JsonSchema { .. } => format!("{bare:?}|{:?}", v.response_format),
        _ => format!("{bare:?}"),
    };
    format!("{bare}|{}|{forced:?}", Value::Array(tools))
}

fn answer<T>(r: Result<T, super::ApiError>, ok: impl Fn(&T) -> String) -> String {
    match r {
        Ok(t) => format!("ok {:016x}", fnv(&ok(&t))),
        Err(e) => format!("{} {}", e.status(), e.to_json()),
    }
}

type Parser = fn(&[u8]) -> String;

fn chat(b: &[u8]) -> String {
    answer(parse_chat(b), summary)
}
fn completion(b: &[u8]) -> String {
    answer(parse_completion(b), summary)
}
fn messages(b: &[u8]) -> String {
    answer(parse_messages_request(b, 64), |m| summary(&m.valid))
}
fn count_tokens(b: &[u8]) -> String {
    answer(parse_count_tokens(b, 64), summary)
}
fn responses(b: &[u8]) -> String {
    answer(parse_responses_request(b), |r| {
        format!(
            "{}|{:?}|{}|{:?}|{}",
            summary(&r.valid),
            r.instructions,
            r.store,
            r.previous_response_id,
            serde_json::to_string(&r.echo).unwrap_or_default()
        )
    })
}
fn tokenize(b: &[u8]) -> String {
    answer(parse_tokenize(b), |t| format!("{t:?}"))
}
fn detokenize(b: &[u8]) -> String {
    answer(parse_detokenize(b), |t| format!("{t:?}"))
}

fn tool_schema() -> Value {
    json!({"type": "object", "properties": {"city": {"type": "string", "description": "a\u{e9}\n"}},
           "required": ["city"]})
}

/// Valid bodies touching every field each parser reads.
fn bases() -> Vec<(&'static str, Parser, Value)> {
    vec![
        (
            "chat",
            chat as Parser,
            json!({
                "model": "m", "messages": [
                    {"role": "system", "content": "sys"},
                    {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "u"},
                    {"role": "assistant", "content": null, "reasoning_content": "r",
                     "tool_calls": [{"id": "c1", "type": "function",
                                     "function": {"name": "get", "arguments": "{\"city\":\"x\"}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
                "tools": [{"type": "function", "function": {"name": "get", "description": "d",
                           "parameters": tool_schema(), "strict": false}}],
                "tool_choice": {"type": "function", "function": {"name": "get"}},
                "parallel_tool_calls": false,
                "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7,
                "max_tokens": 10, "max_completion_tokens": 12, "n": 1, "stream": true,
                "stream_options": {"include_usage": true}, "stop": ["a", "b"], "stop_token_ids": [1, 2],
                "logprobs": true, "top_logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                "repetition_penalty": 1.1, "logit_bias": {"5": 1.5}, "min_tokens": 2, "ignore_eos": false,
                "user": "u", "safety_identifier": "s", "metadata": {"k": "v"},
                "speculative": {"method": "ngram", "num_tokens": 3}, "cache_salt": "salt",
                "chat_template_kwargs": {"enable_thinking": false}, "reasoning_effort": "low",
                "service_tier": "auto", "store": false, "prompt_cache_key": "k", "modalities": ["text"]
            }),
        ),
        (
            "chat-format",
            chat as Parser,
            json!({
                "model": "m", "messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": tool_schema(), "strict": true}},
                "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"
            }),
        ),
        (
            "completion",
            completion as Parser,
            json!({
                "model": "m", "prompt": "hello", "echo": true, "logprobs": 2, "best_of": 1, "suffix": "",
                "max_tokens": 5, "temperature": 0, "stop": "x", "response_format": {"type": "json_object"},
                "speculative": {"method": "off"}, "stream": false, "user": "u", "logit_bias": {"3": -100}
            }),
        ),
        (
            "completion-ids",
            completion as Parser,
            json!({"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 1}),
        ),
        (
            "messages",
            messages as Parser,
            json!({
                "model": "m", "max_tokens": 2000,
                "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "t", "signature": "s"},
                        {"type": "text", "text": "x"},
                        {"type": "tool_use", "id": "tu1", "name": "get", "input": {"city": "x"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "tu1", "content": [{"type": "text", "text": "ok"}], "is_error": false}]}],
                "tools": [{"name": "get", "description": "d", "input_schema": tool_schema()}],
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": true},
                "temperature": 0.5, "top_p": 0.9, "top_k": 4, "stop_sequences": ["z"], "stream": true,
                "metadata": {"user_id": "u"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
                "service_tier": "auto"
            }),
        ),
        (
            "count_tokens",
            count_tokens as Parser,
            json!({
                "model": "m", "system": "s", "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "get", "input_schema": tool_schema()}], "tool_choice": {"type": "any"},
                "thinking": {"type": "disabled"}
            }),
        ),
        (
            "responses",
            responses as Parser,
            json!({
                "model": "m", "instructions": "be brief",
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "r"}]},
                    {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "done"},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                    {"role": "user", "content": "more"}],
                "tools": [{"type": "function", "name": "get", "description": "d", "parameters": tool_schema(), "strict": true}],
                "tool_choice": "auto", "parallel_tool_calls": true, "store": true,
                "text": {"format": {"type": "text"}}, "reasoning": {"effort": "low"},
                "temperature": 0.7, "top_p": 0.9, "max_output_tokens": 30, "metadata": {"a": "b"},
                "stream": false, "user": "u", "truncation": "disabled", "include": [], "top_logprobs": 0,
                "previous_response_id": "resp_x"
            }),
        ),
        (
            "responses-text",
            responses as Parser,
            json!({
                "model": "m", "input": "hello",
                "text": {"format": {"type": "json_schema", "name": "n", "schema": tool_schema(), "strict": true}}
            }),
        ),
        (
            "tokenize",
            tokenize as Parser,
            json!({
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true,
                "add_special_tokens": false, "return_token_strs": true
            }),
        ),
        (
            "tokenize-prompt",
            tokenize as Parser,
            json!({"prompt": "hi", "add_special_tokens": true}),
        ),
        (
            "detokenize",
            detokenize as Parser,
            json!({"model": "m", "tokens": [1, 2, 3]}),
        ),
    ]
}

/// Values of every JSON kind a field is replaced by.
fn replacements() -> Vec<Value> {
    vec![
        Value::Null,
        json!(true),
        json!(-1),
        json!(0),
        json!(3),
        json!(1.5),
        json!(""),
        json!("x"),
        json!("auto"),
        json!([]),
        json!(["x"]),
        json!({}),
        json!({"type": "text"}),
    ]
}

/// Every (path, value) in `v`, depth first, the root excluded.
fn paths(v: &Value, at: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                at.push(Step::Key(k.clone()));
                out.push(at.clone());
                paths(c, at, out);
                at.pop();
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                at.push(Step::Index(i));
                out.push(at.clone());
                paths(c, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

fn at_mut<'a>(v: &'a mut Value, path: &[Step]) -> &'a mut Value {
    path.iter().fold(v, |v, s| match s {
        Step::Key(k) => &mut v[k.as_str()],
        Step::Index(i) => &mut v[*i],
    })
}

fn name(path: &[Step]) -> String {
    path.iter()
        .map(|s| match s {
            Step::Key(k) => format!(".{k}"),
            Step::Index(i) => format!("[{i}]"),
        })
        .collect()
}

/// Bodies that are not valid JSON objects, or are at JSON's edges.
fn raw_cases() -> Vec<(String, Vec<u8>)> {
    let deep = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
    let mut v: Vec<(String, Vec<u8>)> = vec![
        ("empty".into(), b"".to_vec()),
        ("space".into(), b"  ".to_vec()),
        ("open".into(), b"{".to_vec()),
        ("array".into(), b"[]".to_vec()),
        ("number".into(), b"1".to_vec()),
        ("string".into(), b"\"x\"".to_vec()),
        ("null".into(), b"null".to_vec()),
        ("missing value".into(), b"{\"model\":}".to_vec()),
        ("trailing".into(), b"{\"model\":\"m\"}}".to_vec()),
        ("trailing space".into(), b"{\"model\":\"m\"} \n".to_vec()),
        ("bad utf8".into(), b"{\"model\":\"m\xff\"}".to_vec()),
        ("bad utf8 key".into(), b"{\"mo\xffdel\":\"m\"}".to_vec()),
        ("lone surrogate".into(), b"{\"model\":\"\\ud800\"}".to_vec()),
        ("bad escape".into(), b"{\"model\":\"\\q\"}".to_vec()),
        ("control char".into(), b"{\"model\":\"a\x01b\"}".to_vec()),
        ("escaped key".into(), b"{\"mod\\u0065l\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\\u00e9\\n\"}]}".to_vec()),
        ("duplicate".into(), b"{\"model\":\"a\",\"messages\":[],\"model\":1}".to_vec()),
        ("duplicate ok".into(), b"{\"model\":1,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"model\":\"m\"}".to_vec()),
        ("duplicate unknown".into(), b"{\"zz\":1,\"model\":\"m\",\"zz\":2,\"yy\":3}".to_vec()),
        ("huge number".into(), b"{\"model\":\"m\",\"temperature\":1e400}".to_vec()),
        ("huge int".into(), b"{\"model\":\"m\",\"max_tokens\":18446744073709551616}".to_vec()),
        ("big int".into(), b"{\"model\":\"m\",\"max_tokens\":18446744073709551615}".to_vec()),
        ("neg zero".into(), b"{\"model\":\"m\",\"max_tokens\":-0}".to_vec()),
        ("int as float".into(), b"{\"model\":\"m\",\"max_tokens\":2.0}".to_vec()),
        ("exp int".into(), b"{\"model\":\"m\",\"max_tokens\":1e2}".to_vec()),
        ("nested deep 100".into(), format!("{{\"model\":\"m\",\"metadata\":{}}}", deep(100)).into_bytes()),
        ("nested deep 200".into(), format!("{{\"model\":\"m\",\"metadata\":{}}}", deep(200)).into_bytes()),
        ("nested deep msg".into(), format!("{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":{}}}]}}", deep(140)).into_bytes()),
        ("multi line".into(), b"{\n\"model\": \"m\",\n\"messages\": [\n{\"role\": \"user\", \"content\": tru}]}".to_vec()),
        ("bad in field".into(), b"{\"model\":\"m\",\"stop\":[\"a\",]}".to_vec()),
        ("bom".into(), b"\xef\xbb\xbf{\"model\":\"m\"}".to_vec()),
    ];
    // A string with escapes at every depth a parser borrows strings.
    v.push((
        "escapes".into(),
        br#"{"model":"m\"x","messages":[{"role":"user","content":"a\"b\\c\/d\u0041"}],"stop":["\n"],"metadata":{"k\u0041":"v\t"}}"#.to_vec(),
    ));
    v
}

fn corpus() -> Vec<String> {
    let mut lines = Vec::new();
    let parsers: [(&str, Parser); 7] = [
        ("chat", chat),
        ("completion", completion),
        ("messages", messages),
        ("count_tokens", count_tokens),
        ("responses", responses),
        ("tokenize", tokenize),
        ("detokenize", detokenize),
    ];
    for (case, body) in raw_cases() {
        for (p, parse) in parsers {
            lines.push(format!("{p} raw:{case} => {}", parse(&body)));
        }
    }
    for (base_name, parse, base) in bases() {
        let text = serde_json::to_vec(&base).unwrap();
        lines.push(format!("{base_name} base => {}", parse(&text)));
        let mut all = Vec::new();
        paths(&base, &mut Vec::new(), &mut all);
        for path in &all {
            let here = name(path);
            for (i, r) in replacements().into_iter().enumerate() {
                let mut b = base.clone();
                *at_mut(&mut b, path) = r;
                let body = serde_json::to_vec(&b).unwrap();
                lines.push(format!("{base_name} {here}={i} => {}", parse(&body)));
            }
            // Removed, and an unknown field beside it.
            let (last, parent) = path.split_last().unwrap();
            let mut b = base.clone();
            match (at_mut(&mut b, parent), last) {
                (Value::Object(m), Step::Key(k)) => {
                    m.shift_remove(k);
                }
                (Value::Array(a), Step::Index(i)) => {
                    a.remove(*i);
                }
                _ => unreachable!(),
            }
            lines.push(format!(
                "{base_name} {here}=del => {}",
                parse(&serde_json::to_vec(&b).unwrap())
            ));
            if let Value::Object(_) = at_mut(&mut base.clone(), parent) {
                let mut b = base.clone();
                if let Value::Object(m) = at_mut(&mut b, parent) {
                    m.insert("zz_unknown".into(), json!(1));
                }
                lines.push(format!(
                    "{base_name} {here}+unknown => {}",
                    parse(&serde_json::to_vec(&b).unwrap())
                ));
            }
        }
    }
    lines.dedup();
    lines
}

#[test]
fn the_corpus_answers_as_recorded() {
    let got = corpus().join("\n") + "\n";
    if std::env::var_os("SPECGATE_RECORD_CORPUS").is_some() {
        std::fs::write(FIXTURE, &got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(FIXTURE)
        .expect("the recorded corpus (tests/fixtures/api-corpus.txt)");
    let mut diffs = Vec::new();
    for (i, (g, w)) in got.lines().zip(want.lines()).enumerate() {
        if g != w {
            diffs.push(format!("line {}:\n  want {w}\n  got  {g}", i + 1));
        }
    }
    assert_eq!(
        got.lines().count(),
        want.lines().count(),
        "the corpus changed size"
    );
    assert!(
        diffs.is_empty(),
        "{} answers changed:\n{}",
        diffs.len(),
        diffs[..diffs.len().min(20)].join("\n")
    );
}
