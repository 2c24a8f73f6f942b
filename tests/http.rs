//! The HTTP gateway end to end on a tiny generated model (with an in-code
//! ChatML tokenizer): every route, both response shapes, every error status,
//! SSE framing, stop strings across tokens, include_usage, the per-request
//! speculation override, auth, 429, cancellation, graceful drain, live
//! reload of the draft length, and /metrics in Prometheus text format.

use candle_core::quantized::GgmlDType;
use serde_json::{json, Value};
use specgate::config::Config;
use specgate::server::{start, Running};
use specgate::tokenizer::testing::tiny_chatml_metadata;
use specgate_verify::tiny::TinySpec;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const MODEL: &str = "tiny";

fn model_files() -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("specgate-http-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (t, d) = (dir.join("target.gguf"), dir.join("draft.gguf"));
    if !t.exists() {
        let md = tiny_chatml_metadata(384);
        let md: Vec<(&str, _)> = md.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let spec = TinySpec {
            logit_scale: 1.5,
            ..TinySpec::llama(41)
        };
        spec.write_gguf(&t, &md).unwrap();
        TinySpec {
            dtype: GgmlDType::Q8_0,
            ..spec
        }
        .write_gguf(&d, &md)
        .unwrap();
    }
    (t, d)
}

fn config(edit: impl FnOnce(&mut Config)) -> Config {
    let (t, d) = model_files();
    let mut c = Config::default();
    c.server.port = 0;
    c.server.served_model_name = Some(MODEL.into());
    c.model.path = t;
    c.draft.path = Some(d);
    c.speculative.method = "ngram".into();
    c.speculative.policy = "fixed".into();
    c.kv.num_blocks = 64;
    edit(&mut c);
    c.validate().unwrap();
    c
}

struct Server {
    rt: tokio::runtime::Runtime,
    running: Option<Running>,
    addr: SocketAddr,
}

impl Server {
    fn start(cfg: Config, path: Option<PathBuf>) -> Server {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let running = rt.block_on(start(cfg, path)).unwrap();
        let addr = running.addr;
        Server {
            rt,
            running: Some(running),
            addr,
        }
    }

    fn engine(&self) -> &specgate::engine::EngineHandle {
        &self.running.as_ref().unwrap().engine
    }

    fn wait_idle(&self) {
        let t = Instant::now();
        loop {
            let s = self.engine().stats();
            if s.running == 0 && s.waiting == 0 && s.free_blocks == s.num_blocks {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "never idle: {s:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            let _ = r.shutdown.send(());
            let _ = self.rt.block_on(r.done);
            r.engine.shutdown();
        }
    }
}

/// A response read to the end of the connection.
struct Resp {
    status: u16,
    headers: String,
    body: String,
}

fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    s
}

fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Resp {
    let mut s = send(addr, method, path, headers, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).expect("responses are UTF-8");
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    Resp {
        status,
        headers: head.to_string(),
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    loop {
        let (len, rest) = s.split_once("\r\n").unwrap();
        let n = usize::from_str_radix(len.trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
}

fn post(addr: SocketAddr, path: &str, body: Value) -> Resp {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        &body.to_string(),
    )
}

fn chat(extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 24, "temperature": 0});
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

/// SSE events of a stream body: the JSON of every `data:` line, then
/// whether it ended with `[DONE]`.
fn events(body: &str) -> (Vec<Value>, bool) {
    let mut out = Vec::new();
    let mut done = false;
    for ev in body.split("\n\n").filter(|e| !e.is_empty()) {
        if ev.starts_with(':') {
            continue; // keep-alive comment
        }
        let data = ev
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("bad SSE event {ev:?}"));
        assert!(!done, "data after [DONE]");
        if data == "[DONE]" {
            done = true;
        } else {
            out.push(serde_json::from_str(data).unwrap());
        }
    }
    (out, done)
}

fn error_of(r: &Resp) -> Value {
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let e = v["error"].clone();
    for k in ["message", "type", "param", "code"] {
        assert!(e.get(k).is_some(), "error body lacks {k}: {}", r.body);
    }
    e
}

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

/// Reads SSE events from a live stream until `n` data events arrived.
fn read_events(reader: &mut BufReader<TcpStream>, n: usize) {
    let mut seen = 0;
    let mut line = String::new();
    while seen < n {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "stream closed early"
        );
        if line.contains("data: ") {
            seen += 1;
        }
    }
}

#[test]
fn full_queue_429_and_disconnect_cancels() {
    let s = Server::start(config(|c| c.server.max_concurrent_requests = 1), None);
    let body = chat(json!({"max_tokens": 900, "stream": true, "temperature": 1.0})).to_string();
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

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
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
fn live_reload_changes_the_draft_length_and_refuses_bad_edits() {
    let dir = std::env::temp_dir().join(format!("specgate-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.toml");
    let (t, _) = model_files();
    let write = |k: &str| {
        std::fs::write(
            &path,
            format!(
                "[server]\nport = 0\nserved_model_name = \"{MODEL}\"\n[model]\npath = {:?}\n[kv]\nnum_blocks = 64\n[speculative]\nmethod = \"ngram\"\npolicy = \"fixed\"\nnum_tokens = {k}\n",
                t.display().to_string()
            ),
        )
        .unwrap()
    };
    write("2");
    let s = Server::start(Config::load(&path).unwrap(), Some(path.clone()));
    let gauge = || {
        metric(
            &request(s.addr, "GET", "/metrics", &[], "").body,
            "specgate_spec_decode_draft_length",
        )
    };
    // The gauge is published after an engine step.
    post(
        s.addr,
        "/v1/chat/completions",
        chat(json!({"max_tokens": 2})),
    );
    assert_eq!(gauge(), 2.0);
    std::thread::sleep(Duration::from_millis(1100)); // a new modification time
    write("6");
    let t0 = Instant::now();
    while gauge() != 6.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the reload never took effect"
        );
        post(
            s.addr,
            "/v1/chat/completions",
            chat(json!({"max_tokens": 2})),
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // An invalid edit is refused and the old value stays.
    std::thread::sleep(Duration::from_millis(1100));
    write("99");
    std::thread::sleep(Duration::from_secs(5));
    post(
        s.addr,
        "/v1/chat/completions",
        chat(json!({"max_tokens": 2})),
    );
    assert_eq!(gauge(), 6.0);
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
    let body = chat(json!({"max_tokens": 900, "stream": true, "temperature": 1.0})).to_string();
    let conn = send(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        &body,
    );
    let mut reader = BufReader::new(conn);
    read_events(&mut reader, 2);
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

/// The body bytes of a chunked stream read mid-way (chunk sizes dropped).
fn dechunk_lenient(s: &str) -> String {
    s.split("\r\n")
        .filter(|l| usize::from_str_radix(l.trim(), 16).is_err() || l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("")
}
