//! Request ids and the per-request log line, end to end on the tiny model:
//! an incoming `X-Request-Id` is echoed and names the response and the log
//! line; otherwise a unique id is made; every response (404, 405, /health)
//! carries one; a stream logs its line when it ends, a disconnected one as
//! `cancelled`. The log is captured as JSON lines by a global subscriber
//! writing into a buffer (the server logs from several runtime threads, so
//! a thread-local subscriber would miss lines).

mod common;

use common::*;
use serde_json::{json, Value};
use specgate::logging::{Captured, REQUEST_TARGET};
use std::io::BufReader;

/// The log of this test binary (installed once, shared by its tests).
fn log() -> &'static Captured {
    captured_log("info")
}

/// The request line of `id` (waiting for it a bounded time).
fn line_of(id: &str) -> Value {
    common::line_of(log(), REQUEST_TARGET, id)
}

fn post_with_id(s: &Server, path: &str, id: &str, body: &Value) -> Resp {
    request(
        s.addr,
        "POST",
        path,
        &[("Content-Type", "application/json"), ("X-Request-Id", id)],
        &body.to_string(),
    )
}

fn is_generated(id: &str) -> bool {
    id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

#[test]
fn an_incoming_id_names_the_response_and_its_log_line() {
    log();
    let s = Server::start(config(|_| {}), None);
    let r = post_with_id(
        &s,
        "/v1/chat/completions",
        "client-abc.123",
        &chat(json!({})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        header(&r, "x-request-id").as_deref(),
        Some("client-abc.123")
    );
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["id"], "chatcmpl-client-abc.123");

    let l = line_of("client-abc.123");
    assert_eq!(l["level"], "INFO");
    assert_eq!(l["route"], "/v1/chat/completions");
    assert_eq!(l["http_method"], "POST");
    assert_eq!(l["status"], 200);
    assert_eq!(l["model"], MODEL);
    assert_eq!(l["prompt_tokens"], v["usage"]["prompt_tokens"]);
    assert_eq!(l["completion_tokens"], v["usage"]["completion_tokens"]);
    assert_eq!(l["finish"], v["choices"][0]["finish_reason"]);
    // The server drafts with n-gram lookup (tests/common's config).
    assert_eq!(l["spec_method"], "ngram");
    let (drafted, accepted) = (
        l["drafted_tokens"].as_u64().unwrap(),
        l["accepted_tokens"].as_u64().unwrap(),
    );
    assert!(accepted <= drafted, "{l}");
    for k in ["queue_ms", "ttft_ms", "total_ms"] {
        assert!(l[k].as_f64().is_some_and(|x| x >= 0.0), "{k} in {l}");
    }
    assert!(l["ttft_ms"].as_f64() <= l["total_ms"].as_f64(), "{l}");

    // A per-request method is what the line reports.
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0,
        "speculative": {"method": "off"}});
    let r = post_with_id(&s, "/v1/completions", "client-2", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["id"], "cmpl-client-2");
    let l = line_of("client-2");
    assert_eq!(l["spec_method"], "off");
    assert_eq!(l["drafted_tokens"], 0);
}

#[test]
fn otherwise_every_response_gets_a_fresh_unique_id() {
    log();
    let s = Server::start(config(|_| {}), None);
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0});
    let mut seen = std::collections::HashSet::new();
    for _ in 0..3 {
        let r = post(s.addr, "/v1/completions", body.clone());
        assert_eq!(r.status, 200, "{}", r.body);
        let id = header(&r, "x-request-id").expect("x-request-id on a generation");
        assert!(is_generated(&id), "{id}");
        let v: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["id"], format!("cmpl-{id}"));
        assert!(seen.insert(id.clone()), "{id} repeated");
        assert_eq!(line_of(&id)["status"], 200);
    }

    // Errors, probes and unknown routes carry one too, and log it.
    for (method, path, status) in [
        ("GET", "/nowhere", 404),
        ("GET", "/v1/chat/completions", 405),
        ("GET", "/health", 200),
        ("GET", "/v1/models", 200),
    ] {
        let r = request(s.addr, method, path, &[], "");
        assert_eq!(r.status, status, "{path}");
        let id = header(&r, "x-request-id").unwrap_or_else(|| panic!("none on {path}"));
        assert!(is_generated(&id) && seen.insert(id.clone()), "{path}: {id}");
        if path != "/health" {
            // A healthy probe logs at debug, below this binary's filter.
            let l = line_of(&id);
            assert_eq!(
                (l["route"].as_str(), l["status"].as_u64()),
                (Some(path), Some(u64::from(status)))
            );
        }
    }
    let bad = chat(json!({"max_tokens": 0}));
    let r = post(s.addr, "/v1/chat/completions", bad);
    assert_eq!(r.status, 400);
    let id = header(&r, "x-request-id").unwrap();
    let l = line_of(&id);
    assert_eq!(l["status"], 400);
    assert!(l.get("finish").is_none(), "{l}");

    // An id that is not a sane token is replaced, not echoed.
    let r = post_with_id(&s, "/v1/completions", "two words", &body);
    let id = header(&r, "x-request-id").unwrap();
    assert!(is_generated(&id), "{id}");
}

#[test]
fn a_stream_logs_at_its_end_and_a_disconnect_as_cancelled() {
    log();
    let s = Server::start(config(|_| {}), None);
    let body = chat(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let r = post_with_id(&s, "/v1/chat/completions", "stream-1", &body);
    assert_eq!(header(&r, "x-request-id").as_deref(), Some("stream-1"));
    let (evs, done) = events(&r.body);
    assert!(done);
    assert!(evs.iter().all(|e| e["id"] == "chatcmpl-stream-1"));
    let usage = &evs.last().unwrap()["usage"];
    let l = line_of("stream-1");
    assert_eq!(l["status"], 200);
    assert_eq!(l["completion_tokens"], usage["completion_tokens"]);
    assert_eq!(
        l["finish"],
        evs[evs.len() - 2]["choices"][0]["finish_reason"]
    );

    // A client that leaves mid-stream still gets its line.
    let body = chat(json!({"max_tokens": 900, "stream": true, "ignore_eos": true})).to_string();
    let conn = send(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("Content-Type", "application/json"),
            ("X-Request-Id", "gone-1"),
        ],
        &body,
    );
    let mut reader = BufReader::new(conn);
    read_events(&mut reader, 2);
    drop(reader);
    s.wait_idle();
    let l = line_of("gone-1");
    assert_eq!(l["finish"], "cancelled", "{l}");
    assert_eq!(l["status"], 200);
    assert!(l["ttft_ms"].is_f64(), "{l}");
}
