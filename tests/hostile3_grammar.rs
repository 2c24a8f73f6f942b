//! Hostile requests of the third round against grammars and templates,
//! on the tiny server (issue 49, items 4 to 6):
//! - 40 concurrent chats with a 128-property `minProperties: 1` schema
//!   held every blocking place while they waited for the 2 compile slots,
//!   so `/tokenize` waited 5.5 s: grammars now wait in a queue of their
//!   own, and a full queue is a 503 with `Retry-After`;
//! - the n x n table bound counted `properties` and `minProperties` only
//!   in one object, so 64 places that each add `minProperties` to one
//!   128-property definition through `$ref` reached llguidance: now
//!   refused at once with the bound named;
//! - 10,000 alternating tool/user messages took seconds of template time:
//!   a chat's messages are bounded (`server.max_messages`) and a template
//!   renders under a fuel limit, each a 400 that names its cause.

mod common;

use common::*;
use serde_json::{json, Map, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEY: &str = "sk-third-round";

fn props(n: usize) -> Map<String, Value> {
    (0..n)
        .map(|i| (format!("prop_{i:05}"), json!({})))
        .collect()
}

/// Posts `body` to `path` and reads the answer to the end: the status, the
/// head (lower case) and the body, or why there was none.
fn post(addr: SocketAddr, path: &str, body: &Value) -> Result<(u16, String, String), String> {
    let body = body.to_string();
    let raw = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (status, head, body) = exchange(addr, raw.as_bytes())?;
    Ok((status, head.to_ascii_lowercase(), body))
}

fn server() -> Server {
    Server::start(config(|c| c.server.api_keys = vec![KEY.into()]), None)
}

/// A chat asking for JSON valid against `schema`.
fn schema_chat(schema: &Value) -> Value {
    chat(
        json!({"max_tokens": 2, "response_format": {"type": "json_schema",
        "json_schema": {"name": "s", "schema": schema}}}),
    )
}

/// The bound: `/tokenize` answers within 0.5 s while 40 chats
/// with a 128-property `minProperties: 1` schema compile. Each chat gets
/// its grammar (a 200), or a 503 with `Retry-After` and an OpenAI error
/// body (the compile queue, 16 places for one API key, was full: some
/// must be), or on a machine too loaded to compile it within the budget a
/// 400 saying so; nothing else.
#[test]
fn tokenize_answers_within_half_a_second_during_40_schema_compiles() {
    let s = server();
    let addr = s.addr;
    let schema = json!({"type": "object", "properties": props(128),
        "minProperties": 1, "additionalProperties": false});
    let answered = Arc::new(AtomicUsize::new(0));
    let chats: Vec<_> = (0..40)
        .map(|_| {
            let (body, answered) = (schema_chat(&schema), answered.clone());
            std::thread::spawn(move || {
                let got = post(addr, "/v1/chat/completions", &body);
                answered.fetch_add(1, Ordering::SeqCst);
                got
            })
        })
        .collect();
    // Let the chats arrive and take what they take.
    std::thread::sleep(Duration::from_millis(200));
    let tokenize = json!({"model": MODEL, "prompt": "hello there"});
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let t = Instant::now();
        let got = post(addr, "/tokenize", &tokenize);
        slowest = slowest.max(t.elapsed());
        assert!(matches!(got, Ok((200, ..))), "{got:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The tokenizing happened while compiles were still waiting or
    // running (else the test proved nothing).
    let done = answered.load(Ordering::SeqCst);
    assert!(done < 40, "every chat had its answer before /tokenize ran");
    assert!(
        slowest <= Duration::from_millis(500),
        "/tokenize took {slowest:?} during the compiles"
    );
    let (mut ok, mut busy, mut slow) = (0, 0, 0);
    for c in chats {
        match c.join().unwrap() {
            Ok((200, ..)) => ok += 1,
            Ok((400, _, body)) if body.contains("took longer than") => slow += 1,
            Ok((503, head, body)) => {
                busy += 1;
                let v: Value = serde_json::from_str(&body).unwrap_or_default();
                assert!(head.contains("\r\nretry-after: "), "{head}");
                assert_eq!(v["error"]["type"], "server_error", "{body}");
                assert_eq!(v["error"]["code"], "server_busy", "{body}");
                assert!(
                    v["error"]["message"].as_str().unwrap().contains("compiler"),
                    "{body}"
                );
            }
            other => panic!("a chat got {other:?}"),
        }
    }
    assert!(
        busy > 0,
        "the queue was never full ({ok} compiled, {slow} over the budget)"
    );
    s.wait_idle();
}

/// `places` objects that each add `minProperties` through a `$ref` to one
/// definition of `n` properties.
fn tables_through_ref(places: usize, n: usize) -> Value {
    let place = json!({"$ref": "#/$defs/t", "minProperties": 1});
    json!({"$defs": {"t": {"type": "object", "properties": props(n),
        "additionalProperties": false}},
        "type": "object",
        "properties": (0..places).map(|i| (format!("a{i}"), place.clone()))
            .collect::<Map<_, _>>()})
}

/// The issue's `$ref` schema (64 tables of 128 properties) is refused
/// before any compile, by `response_format` and by a forced tool, with a
/// 400 that names the table bound; one such table through `$ref` still
/// compiles.
#[test]
fn n_x_n_tables_through_ref_are_refused_at_once_naming_the_bound() {
    let s = server();
    let schema = tables_through_ref(64, 128);
    let by_tool = chat(
        json!({"max_tokens": 2, "tool_choice": "required", "tools": [{"type": "function",
        "function": {"name": "f", "parameters": schema}}]}),
    );
    for (body, param) in [
        (schema_chat(&schema), "response_format"),
        (by_tool, "tools"),
    ] {
        let got = post(s.addr, "/v1/chat/completions", &body).unwrap();
        assert_eq!(got.0, 400, "{param}: {got:?}");
        let v: Value = serde_json::from_str(&got.2).unwrap();
        assert_eq!(v["error"]["param"], param, "{}", got.2);
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("too large to compile")
                && msg.contains("cells of minProperties/maxProperties tables"),
            "{msg}"
        );
    }
    let one = post(
        s.addr,
        "/v1/chat/completions",
        &schema_chat(&tables_through_ref(1, 128)),
    )
    .unwrap();
    assert_eq!(one.0, 200, "{one:?}");
    s.wait_idle();
}

/// A chat (or `/tokenize` of messages) of more messages than
/// `server.max_messages` (default 2048) is a 400 naming `messages` and the
/// bound, before any template runs.
#[test]
fn more_messages_than_the_bound_are_a_400_naming_it() {
    let s = server();
    let max = specgate::config::ServerConfig::default().max_messages;
    let messages: Vec<Value> = (0..=max)
        .map(|i| json!({"role": if i % 2 == 0 {"user"} else {"assistant"}, "content": "x"}))
        .collect();
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 1, "messages": messages}),
        ),
        ("/tokenize", json!({"model": MODEL, "messages": messages})),
    ] {
        let got = post(s.addr, path, &body).unwrap();
        assert_eq!(got.0, 400, "{path}: {got:?}");
        let v: Value = serde_json::from_str(&got.2).unwrap();
        assert_eq!(v["error"]["param"], "messages", "{}", got.2);
        assert_eq!(v["error"]["code"], "too_many_messages", "{}", got.2);
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("server.max_messages"),
            "{}",
            got.2
        );
    }
    let ok = post(
        s.addr,
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 2})),
    )
    .unwrap();
    assert_eq!(ok.0, 200, "{ok:?}");
}

/// A chat template whose loops run past the render fuel (here one nested
/// three deep over the messages: 27 million iterations for 300 messages)
/// is stopped: a 400 naming `messages` that says why, and the server
/// serves on.
#[test]
fn a_template_past_its_fuel_is_a_400() {
    let dir = scratch_dir("hostile3-fuel");
    let path = dir.join("cubic.jinja");
    std::fs::write(
        &path,
        "{% for a in messages %}{% for b in messages %}{% for c in messages %}\
         {% endfor %}{% endfor %}{% endfor %}{{ messages[-1].content }}",
    )
    .unwrap();
    let s = Server::start(
        config(|c| {
            c.server.api_keys = vec![KEY.into()];
            c.model.chat_template = Some(path);
        }),
        None,
    );
    let messages: Vec<Value> = (0..300)
        .map(|_| json!({"role": "user", "content": "x"}))
        .collect();
    let got = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 1, "messages": messages}),
    )
    .unwrap();
    assert_eq!(got.0, 400, "{got:?}");
    let v: Value = serde_json::from_str(&got.2).unwrap();
    assert_eq!(v["error"]["param"], "messages", "{}", got.2);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("template instructions"),
        "{}",
        got.2
    );
    let ok = post(
        s.addr,
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 2})),
    )
    .unwrap();
    assert_eq!(ok.0, 200, "{ok:?}");
}
