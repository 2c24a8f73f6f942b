//! Hostile requests of the second round, on the tiny server with the
//! default 1 MiB body limit. First those that used to end the process or
//! reset their connection: a `json_schema` of 40,000 empty properties
//! (llguidance recursed once per property and overflowed its thread's
//! stack: the process aborted), the variant under `minProperties` (an
//! n x n table of ~9.6 GB), both through `response_format` and through
//! forced tools; and a URI path with a UTF-8 character across byte 256
//! (the request line's route was cut inside the character: a panic, a
//! reset connection). Each must be a clean 4xx, the server must serve
//! normally afterwards, and the process must not grow. Then clients that
//! were refused for no good reason: a lower-case `bearer` scheme, and a
//! CORS preflight asking for an SDK's own headers.

mod common;

use common::*;
use serde_json::{json, Map, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const KEY: &str = "sk-no-abort";

/// The named kB field of /proc/self/status (Linux), e.g. `VmRSS`.
fn status_kb(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .trim()
        .trim_end_matches(" kB")
        .parse()
        .ok()
}

fn props(n: usize) -> Map<String, Value> {
    (0..n)
        .map(|i| (format!("prop_{i:05}"), json!({})))
        .collect()
}

fn post_chat(addr: SocketAddr, body: &Value) -> Result<(u16, String, String), String> {
    let body = body.to_string();
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    exchange(addr, raw.as_bytes())
}

fn server() -> Server {
    Server::start(config(|c| c.server.api_keys = vec![KEY.into()]), None)
}

#[test]
fn huge_schemas_are_400s_naming_the_field_and_the_server_lives() {
    let s = server();
    let ok = post_chat(s.addr, &chat(json!({"max_tokens": 2}))).unwrap();
    assert_eq!(ok.0, 200, "{ok:?}");
    let rss_before = status_kb("VmRSS");

    let wide = json!({"type": "object", "properties": props(40_000)});
    let square = json!({"type": "object", "properties": props(20_000),
        "minProperties": 1, "additionalProperties": false});
    let by_format = |schema: &Value| {
        chat(
            json!({"max_tokens": 4, "response_format": {"type": "json_schema",
            "json_schema": {"name": "big", "schema": schema}}}),
        )
    };
    let by_tools = |schema: &Value| {
        chat(
            json!({"max_tokens": 4, "tool_choice": "required", "tools": [{"type": "function",
            "function": {"name": "big", "parameters": schema}}]}),
        )
    };
    let cases = [
        (
            "40,000 properties by response_format",
            by_format(&wide),
            "response_format",
        ),
        (
            "n x n by response_format",
            by_format(&square),
            "response_format",
        ),
        (
            "40,000 properties by forced tools",
            by_tools(&wide),
            "tools",
        ),
        ("n x n by forced tools", by_tools(&square), "tools"),
    ];
    let mut failures = Vec::new();
    for (name, body, param) in &cases {
        let bytes = body.to_string().len();
        assert!(
            bytes < 1 << 20,
            "{name}: {bytes} bytes is over the body limit"
        );
        let t = Instant::now();
        let got = post_chat(s.addr, body);
        let took = t.elapsed();
        match got {
            Ok((400, _, b)) => {
                let v: Value = serde_json::from_str(&b).unwrap_or_default();
                let msg = v["error"]["message"].as_str().unwrap_or_default();
                if v["error"]["param"] != *param || !msg.contains("too large") {
                    failures.push(format!("{name}: a 400 but {b}"));
                }
            }
            other => failures.push(format!("{name}: {other:?}")),
        }
        // The issue's own bound: refused before any compile starts.
        if took > Duration::from_secs(2) {
            failures.push(format!("{name}: answered after {took:?}"));
        }
        let after = post_chat(s.addr, &chat(json!({"max_tokens": 2})));
        if !matches!(after, Ok((200, ..))) {
            failures.push(format!("after {name}: {after:?}"));
        }
    }
    grew_under_200_mb(rss_before, &mut failures);
    assert!(failures.is_empty(), "{failures:#?}");
    s.wait_idle();
}

/// A body asking for `schema` by `response_format` (`tools` false) or as
/// the parameters of a forced tool.
fn schema_request(schema: &Value, tools: bool) -> Value {
    if tools {
        chat(
            json!({"max_tokens": 4, "tool_choice": "required", "tools": [{"type": "function",
            "function": {"name": "big", "parameters": schema}}]}),
        )
    } else {
        chat(
            json!({"max_tokens": 4, "response_format": {"type": "json_schema",
            "json_schema": {"name": "big", "schema": schema}}}),
        )
    }
}

/// An object of `n` properties; `counted`: under `minProperties` with no
/// other properties allowed (one alternative per property, each naming
/// every property: n x n).
fn object(n: usize, counted: bool) -> Value {
    let mut o = json!({"type": "object", "properties": props(n)});
    if counted {
        o["minProperties"] = json!(1);
        o["additionalProperties"] = json!(false);
    }
    o
}

/// `leaf` under `levels` arrays.
fn nested(levels: usize, leaf: Value) -> Value {
    (0..levels).fold(leaf, |inner, _| json!({"type": "array", "items": inner}))
}

/// The worst schemas we know, each at the largest size the bounds of
/// `specgate::grammar::limits` admit and just past it, each by
/// `response_format` and by a forced tool: past a bound it is a 400 naming
/// the field; at the bound it compiles (a 200) or llguidance's own limits
/// refuse it (a 400 naming the field). Never anything else, the server
/// serves on, and the process grows by less than 200 MB (in this process:
/// the server runs in it).
#[test]
fn the_worst_schemas_at_and_past_the_bounds_are_answered_within_200_mb() {
    use specgate::grammar::limits::*;
    let s = server();
    let ok = post_chat(s.addr, &chat(json!({"max_tokens": 2}))).unwrap();
    assert_eq!(ok.0, 200, "{ok:?}");
    let rss_before = status_kb("VmRSS");

    // Counted objects as large as allowed, as many as the property bound
    // admits (each one's table is n x n): past the bound on their cells.
    let squares: Map<String, Value> = (0..MAX_PROPERTIES / MAX_COUNTED_PROPERTIES - 1)
        .map(|i| (format!("s{i}"), object(MAX_COUNTED_PROPERTIES, true)))
        .collect();
    // Two counted objects whose cells together just fit.
    let side = (MAX_COUNTED_CELLS / 2).isqrt();
    let pair = json!({"type": "object", "properties": {
        "a": object(side, true), "b": object(side, true)}});
    // `n` branches of two alternatives under one allOf: 2^n once
    // intersected.
    let allof = |n: usize| {
        json!({"type": "object", "allOf": (0..n).map(|i| json!({"anyOf": [
            {"properties": {format!("a{i}"): {"type": "integer"}}},
            {"properties": {format!("b{i}"): {"type": "string"}}}]})).collect::<Vec<_>>()})
    };
    let fits = MAX_ALLOF_PRODUCT.ilog2() as usize;
    let long_enum = json!({"enum": (0..MAX_ENUM_VALUES)
        .map(|i| format!("value {i} {}", "x".repeat(40)))
        .collect::<Vec<_>>()});
    // Repeats of repeats: a small pattern whose automaton is not.
    let mut repeats = String::from("^");
    while repeats.len() + 40 < MAX_PATTERN_BYTES {
        repeats.push_str("((a|b){1,999}c{2,999}[\\p{L}\\p{N}]{1,99}){1,999}");
    }
    repeats.push('$');
    let at_bounds = [
        ("n x n at the bound", object(MAX_COUNTED_PROPERTIES, true)),
        ("two n x n objects within the cells bound", pair),
        ("allOf over alternatives at the bound", allof(fits)),
        ("properties at the bound", object(MAX_PROPERTIES, false)),
        (
            "nesting at the bound",
            nested(MAX_DEPTH - 2, json!({"type": "integer"})),
        ),
        ("enum at the bound", long_enum),
        (
            "pattern at the bound",
            json!({"type": "string", "pattern": repeats}),
        ),
        (
            "counts past any table",
            json!({"type": "array", "minItems": 1_000_000_000u64,
            "items": {"type": "string", "minLength": 1_000_000_000u64}}),
        ),
    ];
    let past_bounds = [
        (
            "n x n past the bound",
            object(MAX_COUNTED_PROPERTIES + 1, true),
        ),
        (
            "n x n objects past the cells bound",
            json!({"type": "object", "properties": squares}),
        ),
        ("allOf over alternatives past the bound", allof(fits + 2)),
        (
            "properties past the bound",
            object(MAX_PROPERTIES + 1, false),
        ),
        (
            "nesting past the bound",
            nested(MAX_DEPTH + 1, json!({"type": "integer"})),
        ),
        (
            "enum past the bound",
            json!({"enum": vec![json!("x"); MAX_ENUM_VALUES + 1]}),
        ),
        (
            "pattern past the bound",
            json!({"type": "string",
            "pattern": "a".repeat(MAX_PATTERN_BYTES + 1)}),
        ),
        (
            "alternatives past the bound",
            json!({"anyOf": vec![json!({"type": "integer"});
            MAX_ALTERNATIVES + 1]}),
        ),
    ];
    let mut failures = Vec::new();
    let cases = at_bounds
        .iter()
        .map(|c| (c, true))
        .chain(past_bounds.iter().map(|c| (c, false)));
    for ((name, schema), admitted) in cases {
        for tools in [false, true] {
            let param = if tools { "tools" } else { "response_format" };
            let name = format!("{name} by {param}");
            match post_chat(s.addr, &schema_request(schema, tools)) {
                Ok((200, ..)) if admitted => {}
                Ok((400, _, b)) => {
                    let v: Value = serde_json::from_str(&b).unwrap_or_default();
                    let msg = v["error"]["message"].as_str().unwrap_or_default();
                    if v["error"]["param"] != param || (!admitted && !msg.contains("too large")) {
                        failures.push(format!("{name}: a 400 but {b}"));
                    }
                }
                other => failures.push(format!("{name}: {other:?}")),
            }
            let after = post_chat(s.addr, &chat(json!({"max_tokens": 2})));
            if !matches!(after, Ok((200, ..))) {
                failures.push(format!("after {name}: {after:?}"));
            }
        }
    }
    grew_under_200_mb(rss_before, &mut failures);
    assert!(failures.is_empty(), "{failures:#?}");
    s.wait_idle();
}

#[test]
fn a_utf8_character_across_the_route_cut_is_a_404_with_a_request_id() {
    let s = server();
    // The character starts at each byte around the 256-byte cut.
    for pad in 250..=258 {
        let mut raw = format!("GET /{}", "a".repeat(pad)).into_bytes();
        raw.extend_from_slice("\u{e9}\u{2028}".as_bytes());
        raw.extend_from_slice(b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        match exchange(s.addr, &raw) {
            Ok((404, head, body)) => {
                let head = head.to_ascii_lowercase();
                assert!(head.contains("\r\nx-request-id: "), "pad {pad}: {head}");
                let v: Value = serde_json::from_str(&body).unwrap();
                assert!(v["error"]["message"].is_string(), "pad {pad}: {body}");
            }
            other => panic!("pad {pad}: {other:?}"),
        }
    }
    let ok = post_chat(s.addr, &chat(json!({"max_tokens": 2}))).unwrap();
    assert_eq!(ok.0, 200, "{ok:?}");
}

/// `Authorization: bearer KEY` (any case of the scheme, RFC 9110) is the
/// same key as `Bearer KEY`; a wrong key or another scheme is still a 401.
#[test]
fn the_bearer_scheme_matches_without_case() {
    let s = server();
    let body = chat(json!({"max_tokens": 2})).to_string();
    let with_auth = |auth: &str| {
        let raw = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
             Authorization: {auth}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        exchange(s.addr, raw.as_bytes()).unwrap().0
    };
    for ok in [
        format!("bearer {KEY}"),
        format!("BEARER {KEY}"),
        format!("BeArEr  {KEY}"),
    ] {
        assert_eq!(with_auth(&ok), 200, "{ok}");
    }
    for bad in [
        format!("Basic {KEY}"),
        format!("bearer{KEY}"),
        "bearer sk-wrong".to_owned(),
        "bearer".to_owned(),
    ] {
        assert_eq!(with_auth(&bad), 401, "{bad}");
    }
}

/// The OpenAI JS SDK's preflight from a page asks for its `x-stainless-*`
/// headers; each must be allowed, or the browser never sends the request.
#[test]
fn a_cors_preflight_allows_the_headers_the_sdk_asks_for() {
    let s = Server::start(
        config(|c| {
            c.server.api_keys = vec![KEY.into()];
            c.server.cors_allow_origins = vec!["https://app.example".into()];
        }),
        None,
    );
    let asked = "authorization,content-type,x-stainless-arch,x-stainless-lang,\
                 x-stainless-os,x-stainless-package-version,x-stainless-retry-count,\
                 x-stainless-runtime,x-stainless-runtime-version,x-stainless-timeout";
    let raw = format!(
        "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Origin: https://app.example\r\nAccess-Control-Request-Method: POST\r\n\
         Access-Control-Request-Headers: {asked}\r\n\r\n"
    );
    let (status, head, _) = exchange(s.addr, raw.as_bytes()).unwrap();
    assert_eq!(status, 204, "{head}");
    let head = head.to_ascii_lowercase();
    let allowed = head
        .lines()
        .find_map(|l| l.strip_prefix("access-control-allow-headers:"))
        .unwrap_or_else(|| panic!("no allow-headers: {head}"));
    let allowed: Vec<&str> = allowed.split(',').map(str::trim).collect();
    for want in asked.split(',') {
        assert!(allowed.contains(&want), "{want} not in {allowed:?}");
    }
    assert!(
        head.contains("access-control-allow-origin: https://app.example"),
        "{head}"
    );
}

/// Growth past the RSS `before` (KB), up to the peak reached since (an
/// upper bound on what the requests held at once): a failure at 200 MB.
fn grew_under_200_mb(before: Option<u64>, failures: &mut Vec<String>) {
    if let (Some(before), Some(peak)) = (before, status_kb("VmHWM")) {
        let grew_mb = peak.saturating_sub(before) / 1024;
        if grew_mb >= 200 {
            failures.push(format!("the process grew by {grew_mb} MB"));
        }
    }
}
