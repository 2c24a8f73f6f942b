//! A property-based fuzzer against a live tiny server (in this process, as
//! the other integration tests start it), run by `cargo test`, so CI runs
//! it on every submission. Five generators, each a bounded number of cases
//! (about a minute in all on two cores; past [`TIME_BUDGET`] the remaining
//! cases are skipped, never failed):
//! - request bodies: a valid chat, completion, Messages or Responses request with fields set to
//!   arbitrary JSON (extreme and subnormal numbers, odd Unicode, nesting),
//!   removed, or added;
//! - JSON schemas: random schemas (objects, arrays, enums, patterns,
//!   formats, bounds, `anyOf`/`allOf`, `$ref`s, definitions merged in
//!   place beside `minProperties`) through `response_format`
//!   and through forced tools;
//! - headers: arbitrary names and values (`Authorization`, `X-Request-Id`,
//!   `Content-Type`, `Origin`, preflight headers, bytes past ASCII);
//! - request lines: methods and paths of arbitrary bytes;
//! - stored conversations: Responses turns that continue stored responses
//!   (by their ids, percent-encoded, mangled or made up), with reasoning,
//!   calls answered or not and long text, read and deleted between turns.
//!
//! Every case must get a whole answer (no reset, no hang) that is not a
//! 5xx, and a 200 stream must end without an error event; after each
//! generator the server must still serve normally, and at the end every KV
//! block is free. proptest shrinks a failure to a small input and prints it.

mod common;

use common::*;
use proptest::collection::{btree_map, vec};
use proptest::option;
use proptest::prelude::*;
use proptest::test_runner::{Config as RunConfig, TestCaseError, TestRunner};
use serde_json::{json, Map, Number, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const KEY: &str = "sk-fuzz";
/// Past this, remaining cases are skipped (a bound on CI time, not a check).
const TIME_BUDGET: Duration = Duration::from_secs(90);
/// Past this, a case counts as a hang.
const ANSWER_BOUND: Duration = Duration::from_secs(30);

/// What the server did with one request.
#[derive(Debug)]
enum Outcome {
    Answer {
        status: u16,
        body: String,
    },
    /// Closed without a whole response (acceptable only for requests that
    /// are malformed as HTTP).
    Closed(String),
    Hung,
}

fn exchange(addr: SocketAddr, raw: &[u8]) -> Outcome {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return Outcome::Closed("connect failed".into());
    };
    s.set_read_timeout(Some(ANSWER_BOUND)).unwrap();
    s.set_write_timeout(Some(ANSWER_BOUND)).unwrap();
    // The server may answer and close before it has read everything.
    let _ = s.write_all(raw);
    let mut got = Vec::new();
    let read = s.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got).into_owned();
    let parsed = text.split_once("\r\n\r\n").and_then(|(head, body)| {
        let status = head.split(' ').nth(1)?.parse().ok()?;
        let chunked = head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked");
        let body = if chunked {
            dechunk_lossy(body)?
        } else {
            body.to_owned()
        };
        Some((status, body))
    });
    match (parsed, read) {
        (Some((status, body)), _) => Outcome::Answer { status, body },
        (None, Err(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Outcome::Hung
        }
        (None, _) => Outcome::Closed(text.chars().take(200).collect()),
    }
}

/// A chunked body de-chunked; `None` when it is cut short.
fn dechunk_lossy(mut s: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (len, rest) = s.split_once("\r\n")?;
        let n = usize::from_str_radix(len.trim(), 16).ok()?;
        if n == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..n)?);
        s = rest.get(n + 2..)?;
    }
}

fn http(method: &str, path: &[u8], headers: &[(String, Vec<u8>)], body: &[u8]) -> Vec<u8> {
    let mut r = Vec::new();
    r.extend_from_slice(method.as_bytes());
    r.push(b' ');
    r.extend_from_slice(path);
    r.extend_from_slice(b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for (k, v) in headers {
        r.extend_from_slice(k.as_bytes());
        r.extend_from_slice(b": ");
        r.extend_from_slice(v);
        r.extend_from_slice(b"\r\n");
    }
    r.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
    r.extend_from_slice(body);
    r
}

fn authorized_post(path: &str, body: &[u8]) -> Vec<u8> {
    let headers = [
        (
            "Authorization".to_owned(),
            format!("Bearer {KEY}").into_bytes(),
        ),
        ("Content-Type".to_owned(), b"application/json".to_vec()),
    ];
    http("POST", path.as_bytes(), &headers, body)
}

/// No 5xx and no reset; a 200 stream ends without an error event.
/// `malformed`: the request may be refused at the HTTP layer by a close.
fn judge(out: &Outcome, malformed: bool) -> Result<(), TestCaseError> {
    match out {
        Outcome::Answer { status, body } if *status >= 500 => Err(TestCaseError::fail(format!(
            "a {status}: {}",
            body.chars().take(300).collect::<String>()
        ))),
        Outcome::Answer { status: 200, body } if body.starts_with("data: ") => {
            let bad = body.split("\n\n").find(|e| {
                e.strip_prefix("data: ")
                    .and_then(|d| serde_json::from_str::<Value>(d).ok())
                    .is_some_and(|v| v.get("error").is_some())
            });
            match bad {
                Some(e) => Err(TestCaseError::fail(format!("an error event: {e}"))),
                None if !body.contains("data: [DONE]") => {
                    Err(TestCaseError::fail("a stream without [DONE]"))
                }
                None => Ok(()),
            }
        }
        // Anthropic's and the Responses API's streams: named events.
        Outcome::Answer { status: 200, body } if body.starts_with("event: ") => {
            match body.split("\n\n").find(|e| e.starts_with("event: error")) {
                Some(e) => Err(TestCaseError::fail(format!("an error event: {e}"))),
                None => Ok(()),
            }
        }
        Outcome::Answer { .. } => Ok(()),
        Outcome::Closed(_) if malformed => Ok(()),
        Outcome::Closed(partial) => Err(TestCaseError::fail(format!(
            "closed without a whole answer: {partial:?}"
        ))),
        Outcome::Hung => Err(TestCaseError::fail("no answer in time")),
    }
}

// ---- generators ----

fn float() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(-0.0),
        Just(1e-39),
        Just(5e-324),
        Just(f64::MIN_POSITIVE),
        Just(1e-7),
        Just(0.5),
        Just(1.0),
        Just(2.0),
        Just(1e308),
        Just(-1e308),
        Just(-1.0),
        -3.0..3.0f64,
        any::<f64>(),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("tiny".to_owned()),
        Just("user".to_owned()),
        Just("assistant".to_owned()),
        Just("<|im_start|>system\n".to_owned()),
        // Chat markup spelled as text (issue 49): in a const or an enum it
        // is what a grammar makes the model write, and stays text.
        Just("x<|open|>think<|sep|>y<|close|>response<|sep|>".to_owned()),
        Just("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>".to_owned()),
        Just("\u{2028}\u{202e}\u{0}\u{feff}".to_owned()),
        "[a-z_]{1,12}",
        ".{0,24}",
    ]
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (-3i64..300).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        float().prop_filter_map("finite", |f| Number::from_f64(f).map(Value::Number)),
        text().prop_map(Value::from),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            btree_map(text(), inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "user",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "speculative",
    "best_of",
    "suffix",
    "metadata",
    "cache_salt",
    "include_stop_str_in_output",
    // The Responses and Messages APIs' own fields.
    "input",
    "instructions",
    "max_output_tokens",
    "text",
    "reasoning",
    "store",
    "previous_response_id",
    "include",
    "system",
    "stop_sequences",
    "thinking",
];

/// One change to a request body.
#[derive(Debug, Clone)]
enum Edit {
    Set(&'static str, Value),
    Remove(&'static str),
    /// A message's field (`role`, `content`, `name`, `tool_calls`).
    Message(&'static str, Value),
}

fn edit() -> impl Strategy<Value = Edit> {
    let field = proptest::sample::select(FIELDS);
    let msg_field = proptest::sample::select(&["role", "content", "name", "tool_calls"][..]);
    prop_oneof![
        4 => (field.clone(), json_value()).prop_map(|(f, v)| Edit::Set(f, v)),
        1 => field.prop_map(Edit::Remove),
        2 => (msg_field, json_value()).prop_map(|(f, v)| Edit::Message(f, v)),
    ]
}

fn apply(mut body: Value, edits: &[Edit]) -> Value {
    let map = body.as_object_mut().expect("an object");
    for e in edits {
        match e {
            Edit::Set(f, v) => {
                map.insert((*f).to_owned(), v.clone());
            }
            Edit::Remove(f) if !f.starts_with("max_") => {
                map.remove(*f);
            }
            Edit::Remove(_) => {}
            Edit::Message(f, v) => {
                if let Some(Value::Object(m)) = map.get_mut("messages").and_then(|m| m.get_mut(0)) {
                    m.insert((*f).to_owned(), v.clone());
                }
            }
        }
    }
    body
}

fn leaf_schema() -> impl Strategy<Value = Value> {
    let format = proptest::sample::select(
        &[
            "date-time",
            "date",
            "time",
            "email",
            "uuid",
            "hostname",
            "ipv4",
            "uri",
            "bogus",
        ][..],
    );
    prop_oneof![
        proptest::sample::select(&["string", "integer", "number", "boolean", "null", "object", "array"][..])
            .prop_map(|t| json!({ "type": t })),
        Just(json!({})),
        Just(json!(true)),
        Just(json!(false)),
        (0u64..40, 0u64..40).prop_map(|(a, b)| json!({"type": "string", "minLength": a, "maxLength": b})),
        "[a-z0-9\\[\\]()*+?|.^$\\\\{},-]{0,16}".prop_map(|p| json!({"type": "string", "pattern": p})),
        vec(scalar(), 0..6).prop_map(|v| json!({ "enum": v })),
        scalar().prop_map(|v| json!({ "const": v })),
        (float(), float()).prop_filter_map("finite", |(a, b)| {
            Some(json!({"type": "number", "minimum": Number::from_f64(a)?, "maximum": Number::from_f64(b)?}))
        }),
        (any::<i64>(), 1u64..1000).prop_map(|(a, m)| json!({"type": "integer", "minimum": a, "multipleOf": m})),
        format.prop_map(|f| json!({"type": "string", "format": f})),
        json_value(),
    ]
}

fn schema() -> impl Strategy<Value = Value> {
    leaf_schema().prop_recursive(4, 40, 6, |inner| {
        prop_oneof![
            (
                btree_map("[a-z]{1,6}", inner.clone(), 0..6),
                vec("[a-z]{1,6}", 0..3),
                option::of(any::<bool>()),
                option::of(0u64..4),
                option::of(0u64..4),
            )
                .prop_map(|(props, required, additional, min, max)| {
                    let mut o = Map::new();
                    o.insert("type".into(), json!("object"));
                    o.insert(
                        "properties".into(),
                        Value::Object(props.into_iter().collect()),
                    );
                    o.insert("required".into(), json!(required));
                    if let Some(a) = additional {
                        o.insert("additionalProperties".into(), json!(a));
                    }
                    if let Some(m) = min {
                        o.insert("minProperties".into(), json!(m));
                    }
                    if let Some(m) = max {
                        o.insert("maxProperties".into(), json!(m));
                    }
                    Value::Object(o)
                }),
            (inner.clone(), option::of(0u64..6), option::of(0u64..6)).prop_map(
                |(items, min, max)| {
                    json!({"type": "array", "items": items, "minItems": min, "maxItems": max})
                }
            ),
            (
                proptest::sample::select(&["anyOf", "oneOf", "allOf"][..]),
                vec(inner.clone(), 1..4)
            )
                .prop_map(|(k, v)| json!({ k: v })),
            inner
                .clone()
                .prop_map(|d| json!({"$defs": {"d": d}, "$ref": "#/$defs/d"})),
            // A definition merged in place: a `$ref` beside `minProperties`
            // (llguidance builds a new object at each such place), and an
            // `allOf` of the `$ref` and `maxProperties`.
            (inner.clone(), 0u64..3, any::<bool>()).prop_map(|(d, n, by_allof)| {
                if by_allof {
                    json!({"$defs": {"d": d}, "properties": {
                        "a": {"allOf": [{"$ref": "#/$defs/d"}, {"maxProperties": n}]},
                        "b": {"allOf": [{"$ref": "#/$defs/d"}, {"maxProperties": n}]}}})
                } else {
                    json!({"$defs": {"d": d}, "properties": {
                        "a": {"$ref": "#/$defs/d", "minProperties": n},
                        "b": {"$ref": "#/$defs/d", "minProperties": n}}})
                }
            }),
            inner.prop_map(|p| json!({"$defs": {"n": {"type": "object",
                "properties": {"v": p, "next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"})),
        ]
    })
}

fn header_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(format!("Bearer {KEY}").into_bytes()),
        Just(format!("bearer   {KEY}").into_bytes()),
        Just(b"Basic Zm9vOmJhcg==".to_vec()),
        Just(b"application/json; charset=utf-8".to_vec()),
        Just(b"x-stainless-os, x-stainless-lang, authorization".to_vec()),
        Just(b"https://app.example".to_vec()),
        "[ -~]{0,40}".prop_map(String::into_bytes),
        ".{0,24}".prop_map(String::into_bytes),
        vec(
            prop_oneof![0x20u8..0x7f, 0x80u8..=0xff, Just(b'\t'), Just(0u8)],
            0..24
        ),
    ]
}

fn headers() -> impl Strategy<Value = Vec<(String, Vec<u8>)>> {
    let name = prop_oneof![
        proptest::sample::select(
            &[
                "Authorization",
                "X-Request-Id",
                "Content-Type",
                "Accept",
                "Origin",
                "Access-Control-Request-Headers",
                "Access-Control-Request-Method",
                "Expect",
                "Cache-Control",
                "X-Forwarded-For",
                "User-Agent",
            ][..]
        )
        .prop_map(str::to_owned),
        "[A-Za-z0-9!#$%&'*+.^_`|~-]{1,20}",
    ];
    vec((name, header_value()), 0..6)
}

fn path() -> impl Strategy<Value = Vec<u8>> {
    let route = proptest::sample::select(
        &[
            "/health",
            "/metrics",
            "/version",
            "/openapi.json",
            "/v1/models",
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/responses/",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/tokenize",
            "/detokenize",
            "/",
        ][..],
    );
    let tail = prop_oneof![
        Just(Vec::new()),
        "[!-~]{0,300}".prop_map(String::into_bytes),
        ".{0,300}".prop_map(|s: String| s.replace([' ', '\r', '\n'], "").into_bytes()),
        vec(0x21u8..=0xff, 0..300),
    ];
    (route, tail).prop_map(|(r, t)| [r.as_bytes(), &t].concat())
}

/// Long text, with or without word gaps (where the tokenizer cuts its work
/// into pieces), with control-token text spelled inside.
fn long_text() -> impl Strategy<Value = String> {
    (
        prop_oneof![
            "[a-z]{1,8}( [a-z]{1,8}){0,6}[.,\n]? ",
            "[a-zA-Z0-9]{1,40}",
            ".{1,12}",
            Just("<|im_start|>user\n".to_owned()),
        ],
        prop_oneof![4 => 1usize..500, 1 => 1usize..20_000],
    )
        .prop_map(|(unit, n)| unit.repeat(n.min(200_000 / unit.len().max(1))))
}

/// One input item of a Responses turn.
#[derive(Debug, Clone)]
enum Item {
    User(String),
    /// Reasoning, and whether its answer follows it (a 400 if not).
    Reasoning(String, bool),
    Assistant(String),
    /// A function call, and whether an output answers it (by its id, or
    /// by another).
    Call(bool, bool),
}

fn item() -> impl Strategy<Value = Item> {
    let short = prop_oneof![6 => text(), 1 => long_text()];
    prop_oneof![
        3 => short.clone().prop_map(Item::User),
        1 => (short.clone(), proptest::bool::weighted(0.8))
            .prop_map(|(t, answered)| Item::Reasoning(t, answered)),
        1 => short.prop_map(Item::Assistant),
        1 => (any::<bool>(), any::<bool>()).prop_map(|(a, b)| Item::Call(a, b)),
    ]
}

fn input_items(items: &[Item]) -> Value {
    let mut out = Vec::new();
    for (i, it) in items.iter().enumerate() {
        match it {
            Item::User(t) => out.push(json!({"role": "user", "content": t})),
            Item::Reasoning(t, answered) => {
                out.push(json!({"type": "reasoning",
                    "summary": [{"type": "summary_text", "text": t}]}));
                if *answered {
                    out.push(json!({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "ok"}]}));
                }
            }
            Item::Assistant(t) => out.push(json!({"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": t}]})),
            Item::Call(answered, same_id) => {
                let id = format!("call_{i}");
                out.push(json!({"type": "function_call", "call_id": id, "name": "f",
                    "arguments": "{}"}));
                if *answered {
                    let answers = if *same_id { id } else { format!("call_x{i}") };
                    out.push(json!({"type": "function_call_output", "call_id": answers,
                        "output": "42"}));
                }
            }
        }
    }
    Value::Array(out)
}

/// How a step names the stored response it reads, continues or deletes.
#[derive(Debug, Clone)]
enum IdForm {
    Last,
    /// The last id with its characters percent-encoded.
    Encoded,
    /// The last id changed: cut, extended, or another shape altogether.
    Mangled(String),
}

/// One step of a client's life with the store.
#[derive(Debug, Clone)]
enum Step {
    Turn {
        continues: Option<IdForm>,
        items: Vec<Item>,
        store: bool,
        stream: bool,
    },
    Get(IdForm),
    Delete(IdForm),
}

fn id_form() -> impl Strategy<Value = IdForm> {
    prop_oneof![
        4 => Just(IdForm::Last),
        1 => Just(IdForm::Encoded),
        1 => prop_oneof![
            Just(String::new()),
            Just("../v1/models".to_owned()),
            Just("%2e%2e%2f".to_owned()),
            "[!-~]{0,40}",
        ]
        .prop_map(IdForm::Mangled),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (option::of(id_form()), vec(item(), 1..4), any::<bool>(), any::<bool>()).prop_map(
            |(continues, items, store, stream)| Step::Turn { continues, items, store, stream }
        ),
        1 => id_form().prop_map(Step::Get),
        1 => id_form().prop_map(Step::Delete),
    ]
}

/// The id `form` names, given the last one stored (or a made-up one).
fn id_of(form: &IdForm, last: &str) -> String {
    match form {
        IdForm::Last => last.to_owned(),
        IdForm::Encoded => last.bytes().map(|b| format!("%{b:02X}")).collect(),
        IdForm::Mangled(s) => format!("{}{s}", &last[..last.len().min(8)]),
    }
}

/// Steps one client takes against the store: turns that continue stored
/// responses (or ids made up or mangled), reads and deletes.
fn conversation(s: &Server, steps: Vec<Step>) -> Result<(), TestCaseError> {
    let mut last = "resp_AAAAAAAAAAAAAAAAAAAAAAAA".to_owned();
    let first = Step::Turn {
        continues: None,
        items: vec![Item::User("hello".into())],
        store: true,
        stream: false,
    };
    for st in std::iter::once(first).chain(steps) {
        let out = match &st {
            Step::Turn {
                continues,
                items,
                store,
                stream,
            } => {
                let mut body = json!({"model": MODEL, "max_output_tokens": 4, "store": store,
                    "stream": stream, "input": input_items(items)});
                if let Some(form) = continues {
                    body["previous_response_id"] = json!(id_of(form, &last));
                }
                let out = exchange(
                    s.addr,
                    &authorized_post("/v1/responses", body.to_string().as_bytes()),
                );
                // The id, whole or streamed (its first event carries it).
                if let (Outcome::Answer { status: 200, body }, true) = (&out, *store) {
                    let id = body
                        .split_once("\"id\":\"resp_")
                        .and_then(|(_, rest)| rest.split_once('"'))
                        .map(|(id, _)| format!("resp_{id}"));
                    last = id.unwrap_or(last);
                }
                out
            }
            Step::Get(form) | Step::Delete(form) => {
                let method = if matches!(st, Step::Get(_)) {
                    "GET"
                } else {
                    "DELETE"
                };
                let path = format!("/v1/responses/{}", id_of(form, &last));
                let headers = [(
                    "Authorization".to_owned(),
                    format!("Bearer {KEY}").into_bytes(),
                )];
                exchange(s.addr, &http(method, path.as_bytes(), &headers, b""))
            }
        };
        // A path with bytes HTTP forbids may be refused by a close.
        let malformed = matches!(&st, Step::Get(IdForm::Mangled(m)) | Step::Delete(IdForm::Mangled(m))
            if m.bytes().any(|b| !b.is_ascii_graphic()));
        judge(&out, malformed)?;
    }
    Ok(())
}

// ---- the run ----

struct Fuzz {
    server: Server,
    started: Instant,
    ran: std::cell::Cell<usize>,
}

impl Fuzz {
    fn run<S: Strategy>(
        &self,
        name: &str,
        cases: u32,
        strategy: S,
        test: impl Fn(&Server, S::Value) -> Result<(), TestCaseError>,
    ) where
        S::Value: std::fmt::Debug,
    {
        let config = RunConfig {
            cases,
            failure_persistence: None,
            max_shrink_iters: 256,
            ..RunConfig::default()
        };
        let mut runner = TestRunner::new(config);
        let result = runner.run(&strategy, |v| {
            if self.started.elapsed() > TIME_BUDGET {
                return Ok(());
            }
            self.ran.set(self.ran.get() + 1);
            test(&self.server, v)
        });
        if let Err(e) = result {
            panic!("{name}: {e}");
        }
        serves_normally(&self.server).unwrap_or_else(|e| panic!("after {name}: {e}"));
    }
}

fn serves_normally(s: &Server) -> Result<(), String> {
    match exchange(s.addr, &http("GET", b"/health", &[], b"")) {
        Outcome::Answer { status: 200, .. } => {}
        other => return Err(format!("/health: {other:?}")),
    }
    let body = chat(json!({"max_tokens": 3})).to_string();
    match exchange(
        s.addr,
        &authorized_post("/v1/chat/completions", body.as_bytes()),
    ) {
        Outcome::Answer { status: 200, .. } => Ok(()),
        other => Err(format!("a normal chat request: {other:?}")),
    }
}

#[test]
fn fuzzed_requests_get_no_5xx_and_the_server_lives() {
    let server = Server::start(
        config(|c| {
            let s = &mut c.server;
            s.api_keys = vec![KEY.into()];
            s.cors_allow_origins = vec!["*".into()];
            s.header_read_timeout_secs = 2;
            s.body_read_timeout_secs = 2;
            s.stream_write_timeout_secs = 2;
        }),
        None,
    );
    let f = Fuzz {
        server,
        started: Instant::now(),
        ran: Default::default(),
    };
    let short_chat = || chat(json!({"max_tokens": 4}));
    let short_completion = || json!({"model": MODEL, "prompt": "hello world", "max_tokens": 4});

    let short_messages = || {
        json!({"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello world"}]})
    };
    let short_response = || json!({"model": MODEL, "input": "hello world", "max_output_tokens": 4});
    f.run(
        "request bodies",
        2000,
        (0..4u8, vec(edit(), 1..4)),
        |s, (api, edits)| {
            let (route, base) = match api {
                0 => ("/v1/chat/completions", short_chat()),
                1 => ("/v1/completions", short_completion()),
                2 => ("/v1/messages", short_messages()),
                _ => ("/v1/responses", short_response()),
            };
            let body = apply(base, &edits).to_string();
            judge(
                &exchange(s.addr, &authorized_post(route, body.as_bytes())),
                false,
            )
        },
    );
    f.run(
        "schemas",
        1500,
        (schema(), any::<bool>(), any::<bool>()),
        |s, (schema, by_tools, stream)| {
            let body = if by_tools {
                merge(short_chat(), json!({"tool_choice": "required", "stream": stream,
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}))
            } else {
                merge(short_chat(), json!({"stream": stream, "response_format": {"type": "json_schema",
                    "json_schema": {"name": "s", "schema": schema}}}))
            };
            let raw = authorized_post("/v1/chat/completions", body.to_string().as_bytes());
            judge(&exchange(s.addr, &raw), false)
        },
    );
    f.run(
        "headers",
        800,
        (headers(), any::<bool>()),
        |s, (headers, post)| {
            let body = short_chat().to_string();
            let raw = if post {
                http("POST", b"/v1/chat/completions", &headers, body.as_bytes())
            } else {
                http("OPTIONS", b"/v1/chat/completions", &headers, b"")
            };
            // Bytes a header value may not hold make it malformed HTTP.
            let malformed = headers
                .iter()
                .any(|(_, v)| v.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f));
            judge(&exchange(s.addr, &raw), malformed)
        },
    );
    f.run(
        "request lines",
        800,
        (
            proptest::sample::select(
                &[
                    "GET", "POST", "OPTIONS", "PUT", "DELETE", "HEAD", "PATCH", "BREW",
                ][..],
            ),
            path(),
        ),
        |s, (method, path)| {
            let headers = [(
                "Authorization".to_owned(),
                format!("Bearer {KEY}").into_bytes(),
            )];
            judge(&exchange(s.addr, &http(method, &path, &headers, b"")), true)
        },
    );
    f.run("stored conversations", 120, vec(step(), 1..6), conversation);
    eprintln!("fuzz: {} cases in {:?}", f.ran.get(), f.started.elapsed());
    f.server.wait_idle();
}
