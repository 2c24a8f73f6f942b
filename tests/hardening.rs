//! Hostile and faulty clients against the HTTP front, one test per hole a
//! review found (issue "Hardening"): sizes that wrap, connections that never
//! finish their head or body, idle sockets past the connection cap, load
//! that arrives faster than admission, a dying engine, a
//! panicking forward, a drain that runs out of time, and SIGHUP during load.
//! Every wait is bounded, so a hang fails the test instead of stalling it.

mod common;

use common::{chat, closed_by_server, connect, error_of, post, request, Server, MODEL};
use serde_json::json;
use specgate::engine::Fault;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// A server whose connection deadlines are short enough to test.
fn quick_server(edit: impl FnOnce(&mut specgate::config::Config)) -> Server {
    Server::start(
        common::config(|c| {
            c.server.header_read_timeout_secs = 1;
            c.server.body_read_timeout_secs = 1;
            c.server.stream_write_timeout_secs = 1;
            edit(c);
        }),
        None,
    )
}

#[test]
fn max_tokens_near_2_pow_64_is_a_400_not_an_endless_request() {
    let server = Server::start(common::config(|_| {}), None);
    for path in ["/v1/chat/completions", "/v1/completions"] {
        for n in [u64::MAX, u64::MAX - 1, 1u64 << 63] {
            let body = if path.ends_with("chat/completions") {
                chat(json!({"max_tokens": n, "ignore_eos": true}))
            } else {
                json!({"model": MODEL, "prompt": "hello", "max_tokens": n, "ignore_eos": true})
            };
            let r = post(server.addr, path, body);
            assert_eq!(r.status, 400, "{path} {n}: {}", r.body);
            assert_eq!(error_of(&r)["param"], "max_tokens");
        }
    }
    server.wait_idle();
}

#[test]
fn headers_that_never_end_and_slowloris_are_cut() {
    let server = quick_server(|_| {});
    // Headers that stop half-way.
    let mut s = connect(server.addr);
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    assert!(
        closed_by_server(&mut s),
        "an unfinished head held its socket"
    );
    // One header byte every 100 ms: each byte is progress, but the head as
    // a whole never arrives in time.
    let mut s = connect(server.addr);
    let mut w = s.try_clone().unwrap();
    let trickle = std::thread::spawn(move || {
        let head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ".to_vec();
        let bytes = head.into_iter().chain(std::iter::repeat(b'a'));
        let t = Instant::now();
        for b in bytes {
            if w.write_all(&[b]).is_err() || t.elapsed() > Duration::from_secs(20) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    assert!(closed_by_server(&mut s), "slowloris held its socket");
    trickle.join().unwrap();
    // And a normal client is served.
    assert_eq!(request(server.addr, "GET", "/health", &[], "").status, 200);
}

#[test]
fn idle_sockets_are_closed_and_connections_are_capped() {
    let server = quick_server(|c| c.server.max_connections = 2);
    let mut idle: Vec<TcpStream> = (0..2).map(|_| connect(server.addr)).collect();
    // The cap is full: this client waits until an idle socket is closed.
    let r = request(server.addr, "GET", "/health", &[], "");
    assert_eq!(r.status, 200);
    for s in &mut idle {
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
    }
    let closed = idle.iter_mut().map(closed_by_server).filter(|&c| c).count();
    assert!(
        closed >= 1,
        "a third connection was served while both idle ones were still open"
    );
}

#[test]
fn a_body_shorter_than_its_content_length_gets_408() {
    let server = quick_server(|_| {});
    let mut s = connect(server.addr);
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":",
    )
    .unwrap();
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    assert!(raw.starts_with("HTTP/1.1 408"), "got {raw:?}");
    assert!(raw.contains("\"error\""), "no OpenAI error body: {raw:?}");
}

#[test]
fn admission_is_checked_before_the_body_is_read() {
    let server = quick_server(|c| {
        c.server.max_concurrent_requests = 1;
        c.server.body_read_timeout_secs = 5;
    });
    // A client that never finishes its body holds the only slot...
    let start_slow = || {
        let mut s = connect(server.addr);
        s.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{",
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        s
    };
    let mut slow = start_slow();
    // ...so the next request is shed at once, before its body is parsed.
    let t = Instant::now();
    loop {
        let r = post(server.addr, "/v1/chat/completions", chat(json!({})));
        if r.status == 429 {
            break;
        }
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "a request was admitted while a body read held the only slot"
        );
        // The slow request may have arrived while this one held the slot
        // (and got the 429 itself): then start it over.
        slow.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let answered = slow.peek(&mut [0u8; 1]).is_ok_and(|n| n > 0);
        slow.set_read_timeout(Some(Duration::from_secs(15)))
            .unwrap();
        if answered {
            slow = start_slow();
        }
    }
    // The slow one times out (408) and frees the slot.
    let mut raw = String::new();
    let _ = slow.read_to_string(&mut raw);
    assert!(raw.starts_with("HTTP/1.1 408"), "got {raw:?}");
    let r = post(server.addr, "/v1/chat/completions", chat(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    server.wait_idle();
}

#[test]
fn stop_strings_have_a_length_bound() {
    let server = Server::start(common::config(|_| {}), None);
    let long = "x".repeat(specgate::api::MAX_STOP_BYTES + 1);
    for stop in [json!(long), json!(["ok", long])] {
        let r = post(
            server.addr,
            "/v1/chat/completions",
            chat(json!({ "stop": stop })),
        );
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(error_of(&r)["param"], "stop");
    }
    let fits = "y".repeat(specgate::api::MAX_STOP_BYTES);
    let r = post(
        server.addr,
        "/v1/chat/completions",
        chat(json!({ "stop": fits })),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn a_dead_engine_turns_health_503_and_the_server_exits_with_an_error() {
    let cfg = common::config(|_| {});
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let running = rt.block_on(specgate::server::start(cfg, None)).unwrap();
    let addr = running.addr;
    assert_eq!(request(addr, "GET", "/health", &[], "").status, 200);
    running.engine.inject_fault(Fault::EnginePanic).unwrap();
    let t = Instant::now();
    while request(addr, "GET", "/health", &[], "").status != 503 {
        assert!(t.elapsed() < Duration::from_secs(20), "/health stayed 200");
        std::thread::sleep(Duration::from_millis(50));
    }
    let exit = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(30),
            specgate::server::serve_until_exit(running, std::future::pending()),
        )
        .await
    });
    let exit = exit.expect("the server did not stop after its engine died");
    assert!(exit.is_err(), "a dead engine must end the process non-zero");
}

#[test]
fn a_panicking_forward_fails_its_request_and_the_server_goes_on() {
    let server = Server::start(common::config(|_| {}), None);
    let want = post(server.addr, "/v1/chat/completions", chat(json!({})));
    assert_eq!(want.status, 200);
    // The next request submitted is the engine's second.
    server
        .engine()
        .inject_fault(Fault::ForwardPanic(2))
        .unwrap();
    let r = post(server.addr, "/v1/chat/completions", chat(json!({})));
    assert!(r.status >= 500, "{}", r.body);
    let e = error_of(&r);
    assert!(
        !e["message"].as_str().unwrap().contains("panic"),
        "internal detail reached the client: {e}"
    );
    assert_eq!(request(server.addr, "GET", "/health", &[], "").status, 200);
    let again = post(server.addr, "/v1/chat/completions", chat(json!({})));
    assert_eq!(again.status, 200);
    let text = |r: &common::Resp| {
        serde_json::from_str::<serde_json::Value>(&r.body).unwrap()["choices"][0]["message"]
            ["content"]
            .clone()
    };
    assert_eq!(text(&again), text(&want));
    server.wait_idle();
}

#[test]
fn streams_still_open_at_the_drain_timeout_end_with_an_error_event_and_done() {
    let mut server = Server::start(common::config(|c| c.server.drain_timeout_secs = 1), None);
    // Slow steps: this stream cannot finish within the drain timeout.
    server.engine().inject_fault(Fault::SlowSteps(100)).unwrap();
    let mut s = connect(server.addr);
    let body = chat(json!({"stream": true, "max_tokens": 200, "ignore_eos": true})).to_string();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(s);
    common::read_events(&mut reader, 2);
    let reading = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = reader.read_to_string(&mut rest);
        rest
    });
    let running = server.running.take().unwrap();
    running.shutdown.send(()).unwrap();
    server.rt.block_on(running.done).unwrap();
    running.engine.shutdown();
    let rest = reading.join().unwrap();
    // The body bytes, chunk-size lines dropped.
    let body: String = rest
        .split("\r\n")
        .filter(|l| usize::from_str_radix(l.trim(), 16).is_err() || l.trim().is_empty())
        .collect();
    let err = body
        .find("data: {\"error\"")
        .unwrap_or_else(|| panic!("no SSE error event at the drain timeout: {rest:?}"));
    let done = body
        .find("data: [DONE]")
        .unwrap_or_else(|| panic!("the stream was cut without [DONE]: {rest:?}"));
    assert!(err < done, "{body}");
}

/// SIGHUP re-reads the config; sent while the model is still loading (or
/// with no config file at all) it must not kill the process, whose default
/// action for SIGHUP is to terminate.
#[cfg(unix)]
#[test]
fn sighup_during_and_after_load_does_not_kill_the_server() {
    use std::process::{Command, Stdio};
    let (target, _) = common::model_files();
    let mut child = Command::new(env!("CARGO_BIN_EXE_specgate"))
        .args(["serve", "--port", "0", "--speculative-method", "off"])
        .arg("--model")
        .arg(&target)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let hup = |pid: u32| {
        let ok = Command::new("kill")
            .args(["-HUP", &pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -HUP failed");
    };
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut addr = None;
    let t = Instant::now();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            if addr.is_none() {
                // Bound, still loading: hang up now.
                hup(child.id());
                addr = rest.split_whitespace().next().map(str::to_string);
            }
            if line.contains("listening") {
                break;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "server never started"
        );
    }
    let addr: SocketAddr = addr.expect("no address printed").parse().unwrap();
    hup(child.id());
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "SIGHUP killed the server"
    );
    assert_eq!(request(addr, "GET", "/health", &[], "").status, 200);
    // Drain stderr so the child never blocks on a full pipe, then stop it.
    std::thread::spawn(move || lines.for_each(drop));
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}
