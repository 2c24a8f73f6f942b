//! The HTTP gateway end to end on a tiny generated model (with an in-code
//! ChatML tokenizer): every route, both response shapes, every error status,
//! SSE framing, stop strings across tokens, include_usage, the per-request
//! speculation override, auth, 429, cancellation, graceful drain, and
//! /metrics in Prometheus text format. Live reload is in tests/reload.rs.

mod common;

use common::*;
use serde_json::{json, Value};
use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

#[test]
fn routes_shapes_and_sse_framing() {
    let s = Server::start(config(|_| {}), None);
    let a = s.addr;
    let h = request(a, "GET", "/health", &[], "");
    assert_eq!((h.status, h.body.as_str()), (200, r#"{"status":"ok"}"#));
    let m: Value = serde_json::from_str(&request(a, "GET", "/v1/models", &[], "").body).unwrap();
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(
        error_of(&request(a, "GET", "/nowhere", &[], ""))
            .get("type")
            .unwrap(),
        "not_found_error"
    );
    let r = request(a, "GET", "/v1/chat/completions", &[], "");
    assert_eq!(r.status, 405);
    error_of(&r);

    // Whole chat response.
    let r = post(a, "/v1/chat/completions", chat(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let whole = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let u = &v["usage"];
    assert_eq!(
        u["total_tokens"],
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    assert!(["stop", "length"].contains(&v["choices"][0]["finish_reason"].as_str().unwrap()));

    // The same greedy request streamed: role first, same text, finish, usage, [DONE].
    let r = post(
        a,
        "/v1/chat/completions",
        chat(json!({"stream": true, "stream_options": {"include_usage": true}})),
    );
    assert!(r.headers.to_ascii_lowercase().contains("text/event-stream"));
    let (evs, done) = events(&r.body);
    assert!(done);
    assert_eq!(evs[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = evs
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, whole, "streamed text differs from the whole response");
    let fin = &evs[evs.len() - 2];
    assert_eq!(
        fin["choices"][0]["finish_reason"],
        v["choices"][0]["finish_reason"]
    );
    let last = evs.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], v["usage"]);
    for e in &evs[..evs.len() - 2] {
        assert!(e["choices"][0]["finish_reason"].is_null());
    }

    // Completions, both shapes; no usage chunk without include_usage.
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 10, "temperature": 0});
    let r = post(a, "/v1/completions", body.clone());
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["object"], "text_completion");
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let (evs, done) = events(&post(a, "/v1/completions", sb).body);
    assert!(
        done && evs
            .iter()
            .all(|e| e.get("usage").is_none() || e["usage"].is_null())
    );
    let text: String = evs
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, v["choices"][0]["text"].as_str().unwrap());
    s.wait_idle();
}

#[test]
fn stop_strings_that_span_tokens_end_the_output_before_them() {
    let s = Server::start(config(|_| {}), None);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        chat(json!({"max_tokens": 40, "stop": ["\u{0}never"]})),
    );
    let full: Value = serde_json::from_str(&r.body).unwrap();
    let full = full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(
        chars.len() > 8,
        "need some output to pick a stop string from: {full:?}"
    );
    let stop: String = chars[4..7].iter().collect();
    let expect = &full[..full.find(&stop).unwrap()];
    for stream in [false, true] {
        let r = post(
            s.addr,
            "/v1/chat/completions",
            chat(json!({"max_tokens": 40, "stop": stop, "stream": stream})),
        );
        let (text, reason) = if stream {
            let (evs, _) = events(&r.body);
            let t: String = evs
                .iter()
                .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
                .collect();
            (
                t,
                evs.last().unwrap()["choices"][0]["finish_reason"].clone(),
            )
        } else {
            let v: Value = serde_json::from_str(&r.body).unwrap();
            (
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string(),
                v["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(text, expect, "stream={stream}");
        assert_eq!(reason, "stop");
    }
    s.wait_idle();
}

#[test]
fn errors_have_the_right_status_and_name_the_field() {
    let s = Server::start(config(|c| c.server.max_body_bytes = 4096), None);
    let a = s.addr;
    let r = post(
        a,
        "/v1/chat/completions",
        chat(json!({"temperature": "hot"})),
    );
    assert_eq!(r.status, 400);
    assert_eq!(error_of(&r)["param"], "temperature");
    let r = post(a, "/v1/chat/completions", chat(json!({"max_tokens": 5000})));
    assert_eq!(r.status, 400);
    let msg = error_of(&r)["message"].as_str().unwrap().to_string();
    assert!(msg.contains("5000") && msg.contains("1024"), "{msg}");
    let r = post(a, "/v1/chat/completions", chat(json!({"model": "gpt-9"})));
    assert_eq!(r.status, 404);
    let r = post(
        a,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "x".repeat(5000)}),
    );
    assert_eq!(r.status, 413);
    error_of(&r);
    let r = request(a, "POST", "/v1/chat/completions", &[], "{not json");
    assert_eq!(r.status, 400);
    let r = post(
        a,
        "/v1/chat/completions",
        chat(json!({"speculative": {"method": "draft"}})),
    );
    assert_eq!(
        r.status, 400,
        "the ngram server has no draft model: {}",
        r.body
    );
}

#[test]
fn api_keys_are_required_when_configured() {
    let s = Server::start(
        config(|c| c.server.api_keys = vec!["sk-right".into()]),
        None,
    );
    let body = chat(json!({"max_tokens": 2})).to_string();
    let ct = ("Content-Type", "application/json");
    let r = request(s.addr, "POST", "/v1/chat/completions", &[ct], &body);
    assert_eq!(
        (r.status, error_of(&r)["type"].clone()),
        (401, json!("authentication_error"))
    );
    let r = request(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[ct, ("Authorization", "Bearer sk-wrong")],
        &body,
    );
    assert_eq!(r.status, 401);
    let r = request(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[ct, ("Authorization", "Bearer sk-right")],
        &body,
    );
    assert_eq!(r.status, 200);
    assert_eq!(request(s.addr, "GET", "/health", &[], "").status, 200);
}

#[test]
fn full_queue_429_and_disconnect_cancels() {
    let s = Server::start(config(|c| c.server.max_concurrent_requests = 1), None);
    let body = chat(json!({"max_tokens": 900, "stream": true, "ignore_eos": true})).to_string();
    let conn = send(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        &body,
    );
    let mut reader = BufReader::new(conn);
    read_events(&mut reader, 2);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        chat(json!({"max_tokens": 2})),
    );
    assert_eq!(r.status, 429);
    assert_eq!(error_of(&r)["type"], "rate_limit_error");
    let before = s.engine().stats().cancelled;
    drop(reader);
    s.wait_idle();
    assert_eq!(s.engine().stats().cancelled, before + 1);
    // The permit came back with the cancelled request.
    assert_eq!(
        post(
            s.addr,
            "/v1/chat/completions",
            chat(json!({"max_tokens": 2}))
        )
        .status,
        200
    );
}

#[test]
fn speculation_override_and_metrics_parse() {
    let s = Server::start(config(|c| c.speculative.num_tokens = 3), None);
    let a = s.addr;
    let scrape = || request(a, "GET", "/metrics", &[], "").body;
    // Repetitive prompt: n-gram lookup finds something to propose.
    let rep = json!({"messages": [{"role": "user", "content": "hello hello hello hello hello hello"}], "max_tokens": 30});
    // The engine's own counters (the Prometheus registry is shared by every
    // server in this test process).
    let drafted = || s.engine().stats().spec.draft_tokens;
    let before = drafted();
    let mut off = chat(rep.clone());
    off["speculative"] = json!({"method": "off"});
    assert_eq!(post(a, "/v1/chat/completions", off).status, 200);
    s.wait_idle();
    assert_eq!(drafted(), before);
    let mut on = chat(rep);
    on["speculative"] = json!({"method": "ngram", "num_tokens": 5});
    assert_eq!(post(a, "/v1/chat/completions", on).status, 200);
    s.wait_idle();
    assert!(drafted() > before);
    let text = scrape();
    assert!(
        metric(&text, "specgate_spec_decode_num_draft_tokens_total") >= (drafted() - before) as f64
    );
    let parsed = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    let names: Vec<&str> = parsed.samples.iter().map(|s| s.metric.as_str()).collect();
    for want in [
        "specgate_time_to_first_token_seconds_count",
        "specgate_e2e_request_latency_seconds_count",
        "specgate_request_success_total",
        "specgate_num_requests_running",
        "specgate_kv_cache_usage_ratio",
        "specgate_prompt_tokens_total",
    ] {
        assert!(names.contains(&want), "{want} missing from /metrics");
    }
}

#[test]
fn graceful_drain_finishes_in_flight_requests() {
    let mut s = Server::start(config(|_| {}), None);
    let body = chat(json!({"max_tokens": 200, "stream": true, "temperature": 1.0})).to_string();
    let conn = send(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        &body,
    );
    let mut reader = BufReader::new(conn);
    read_events(&mut reader, 2);
    let running = s.running.take().unwrap();
    let _ = running.shutdown.send(());
    // New connections are refused or answered 503 while draining.
    std::thread::sleep(Duration::from_millis(100));
    if let Ok(mut c) = TcpStream::connect(s.addr) {
        let _ = c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let mut buf = String::new();
        let _ = c.read_to_string(&mut buf);
        assert!(buf.is_empty() || buf.contains(" 503 "), "{buf}");
    }
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    assert!(
        rest.contains("data: [DONE]"),
        "the in-flight stream was cut: {rest}"
    );
    s.rt.block_on(running.done).unwrap();
    running.engine.shutdown();
}

#[test]
fn an_error_after_streaming_began_is_an_sse_error_event_then_done() {
    let s = Server::start(config(|_| {}), None);
    // ignore_eos (vLLM's extension): the stream runs its full 900 tokens, so
    // it is still generating when the engine goes away.
    let body = chat(json!({"max_tokens": 900, "stream": true, "ignore_eos": true})).to_string();
    let conn = send(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        &body,
    );
    let mut reader = BufReader::new(conn);
    read_events(&mut reader, 1);
    s.engine().shutdown();
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    let rest = dechunk_lenient(&rest);
    let err = rest.find("data: {\"error\"").expect("no SSE error event");
    let done = rest
        .find("data: [DONE]")
        .expect("no [DONE] after the error");
    assert!(err < done, "{rest}");
}
