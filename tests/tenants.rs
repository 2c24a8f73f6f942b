//! Clients and tenants kept apart, on the tiny in-process server: one
//! client address cannot hold every connection (so `/health` still
//! answers), one API key or address cannot hold every admission,
//! `/tokenize` is admitted like generation, `/metrics` can require a key,
//! and the prefix cache is scoped per API key and per `cache_salt`, so its
//! counters (and time to first token) tell no tenant about another's
//! prompts. Refusals before admission carry the mark a router retries on.

mod common;

use common::*;
use serde_json::{json, Value};
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A connection to `addr` from the loopback address `from` (127.0.0.x):
/// another client, as the server sees it.
fn connect_from(s: &Server, from: &str, addr: SocketAddr) -> TcpStream {
    let from: SocketAddr = format!("{from}:0").parse().unwrap();
    let stream = s.rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(from).unwrap();
        sock.connect(addr).await.unwrap()
    });
    let stream = stream.into_std().unwrap();
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    stream
}

/// Sends one `Connection: close` request on `stream` and reads the answer.
fn request_on(mut stream: TcpStream, method: &str, path: &str, key: &str, body: &str) -> Resp {
    let auth = if key.is_empty() {
        String::new()
    } else {
        format!("Authorization: Bearer {key}\r\n")
    };
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).unwrap();
    read_response(stream)
}

/// A generation request whose body never arrives whole: it holds one
/// admission (taken before the body is read) until `stream` is dropped or
/// the body deadline passes.
fn held_admission(mut stream: TcpStream, key: &str) -> TcpStream {
    let auth = if key.is_empty() {
        String::new()
    } else {
        format!("Authorization: Bearer {key}\r\n")
    };
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"model\""
    );
    stream.write_all(req.as_bytes()).unwrap();
    // The head is admitted as soon as it is read.
    std::thread::sleep(Duration::from_millis(300));
    stream
}

/// Keep-alive sockets from one client take at most its share of the
/// connection slots: a second client's `/health` is answered at once,
/// not left in the backlog behind them. (Before: 8 idle sockets held all
/// 8 slots until their header timeout.)
#[test]
fn one_client_cannot_hold_every_connection() {
    let s = Server::start(
        config(|c| {
            c.server.max_connections = 8;
            c.server.max_connections_per_client = 4;
            c.server.header_read_timeout_secs = 60;
        }),
        None,
    );
    let squatters: Vec<TcpStream> = (0..8)
        .map(|_| connect_from(&s, "127.0.0.1", s.addr))
        .collect();
    // Give the accept loop time to take (or refuse) each of them.
    std::thread::sleep(Duration::from_millis(300));
    let probe = connect_from(&s, "127.0.0.2", s.addr);
    probe
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let h = request_on(probe, "GET", "/health", "", "");
    assert_eq!(h.status, 200, "{}", h.body);
    // The squatter's sockets over its limit were closed by the server.
    let closed = squatters
        .into_iter()
        .filter_map(|mut sq| {
            sq.set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            closed_by_server(&mut sq).then_some(())
        })
        .count();
    assert_eq!(closed, 4, "the client's sockets over its limit stay open");
}

/// One API key cannot hold every admission, nor can one address; another
/// key from another address still gets in. Refusals before admission
/// carry `x-specgate-not-admitted`.
#[test]
fn one_key_or_address_cannot_hold_every_admission() {
    let s = Server::start(
        config(|c| {
            c.server.api_keys = vec!["ka".into(), "kb".into()];
            c.server.max_concurrent_requests = 8;
            c.server.max_requests_per_client = 1;
        }),
        None,
    );
    let hold = held_admission(connect_from(&s, "127.0.0.1", s.addr), "ka");
    let body = chat(json!({"max_tokens": 2})).to_string();
    // The same key from another address: over the key's limit.
    let r = request_on(
        connect_from(&s, "127.0.0.2", s.addr),
        "POST",
        "/v1/chat/completions",
        "ka",
        &body,
    );
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(header(&r, "x-specgate-not-admitted").as_deref(), Some("1"));
    // Another key from the same address: over the address's limit.
    let r = request_on(
        connect_from(&s, "127.0.0.1", s.addr),
        "POST",
        "/v1/chat/completions",
        "kb",
        &body,
    );
    assert_eq!(r.status, 429, "{}", r.body);
    // Another key from another address: admitted.
    let r = request_on(
        connect_from(&s, "127.0.0.3", s.addr),
        "POST",
        "/v1/chat/completions",
        "kb",
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    drop(hold);
    s.wait_idle();
}

/// `/tokenize` and `/detokenize` take an admission as generation does:
/// with the one slot held by a stream they are 429s, and 200s after.
#[test]
fn tokenize_and_detokenize_are_admitted() {
    let s = Server::start(
        config(|c| {
            c.server.max_concurrent_requests = 1;
        }),
        None,
    );
    let tok = json!({"model": MODEL, "prompt": "hello world"});
    let detok = json!({"model": MODEL, "tokens": [1, 2, 3]});
    let hold = held_admission(connect(s.addr), "");
    for (path, body) in [("/tokenize", &tok), ("/detokenize", &detok)] {
        let r = post(s.addr, path, body.clone());
        assert_eq!(r.status, 429, "{path} was not admitted: {}", r.body);
    }
    drop(hold);
    for (path, body) in [("/tokenize", &tok), ("/detokenize", &detok)] {
        let t = std::time::Instant::now();
        loop {
            let r = post(s.addr, path, body.clone());
            if r.status == 200 {
                break;
            }
            // The stream's admission goes when its task sees the close.
            assert!(t.elapsed() < Duration::from_secs(10), "{path}: {}", r.body);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn metrics_auth_requires_a_key_on_metrics() {
    let s = Server::start(
        config(|c| {
            c.server.api_keys = vec!["ka".into()];
            c.server.metrics_auth = true;
        }),
        None,
    );
    let r = request(s.addr, "GET", "/metrics", &[], "");
    assert_eq!(r.status, 401, "{}", r.body);
    // The recorder renders only series that something has recorded, and
    // the request counters are written as a response ends: poll until the
    // 401 above (or the engine's gauges) shows up, for at most 10 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let r = loop {
        let r = request(
            s.addr,
            "GET",
            "/metrics",
            &[("Authorization", "Bearer ka")],
            "",
        );
        assert_eq!(r.status, 200, "{}", r.body);
        if r.body.contains("specgate_") || std::time::Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(r.body.contains("specgate_"), "{}", r.body);
    // /health stays open to probes.
    assert_eq!(request(s.addr, "GET", "/health", &[], "").status, 200);
    drop(s);
    // Off (the default): /metrics is public even with keys.
    let s = Server::start(config(|c| c.server.api_keys = vec!["ka".into()]), None);
    assert_eq!(request(s.addr, "GET", "/metrics", &[], "").status, 200);
}

/// Prompt tokens served from the prefix cache so far.
fn hits(s: &Server) -> u64 {
    s.engine().stats().prefix.hits
}

/// Sends the shared long prompt with `key` (and `extra` fields) and
/// returns how many of its tokens the prefix cache served.
fn cached_tokens(s: &Server, key: &str, extra: Value) -> u64 {
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(3);
    let mut body = chat(json!({
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
    }));
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let before = hits(s);
    let auth = format!("Bearer {key}");
    let r = request(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("Authorization", auth.as_str()),
            ("Content-Type", "application/json"),
        ],
        &body.to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    s.wait_idle();
    hits(s) - before
}

/// With API keys the prefix cache is per key: the same prompt from
/// another key finds nothing cached, from the same key it does; a
/// `cache_salt` separates requests of one key; `share_prefix_cache`
/// shares across keys again.
#[test]
fn the_prefix_cache_is_scoped_per_key_and_per_salt() {
    let keys = vec!["ka".to_string(), "kb".to_string()];
    let s = Server::start(config(|c| c.server.api_keys = keys.clone()), None);
    assert_eq!(cached_tokens(&s, "ka", json!({})), 0, "first sight");
    assert_eq!(cached_tokens(&s, "kb", json!({})), 0, "crossed keys");
    let same = cached_tokens(&s, "ka", json!({}));
    assert!(same > 0, "the same key found nothing cached");
    // A salt is a scope of its own, shared by requests that send it.
    assert_eq!(cached_tokens(&s, "ka", json!({"cache_salt": "s1"})), 0);
    assert_eq!(cached_tokens(&s, "ka", json!({"cache_salt": "s2"})), 0);
    assert_eq!(cached_tokens(&s, "ka", json!({"cache_salt": "s1"})), same);
    // The same salt under another key is still another scope.
    assert_eq!(cached_tokens(&s, "kb", json!({"cache_salt": "s1"})), 0);
    drop(s);

    let s = Server::start(
        config(|c| {
            c.server.api_keys = keys.clone();
            c.server.share_prefix_cache = true;
        }),
        None,
    );
    assert_eq!(cached_tokens(&s, "ka", json!({})), 0);
    assert!(cached_tokens(&s, "kb", json!({})) > 0, "shared, yet no hit");
}

#[test]
fn a_bad_cache_salt_is_a_400_naming_it() {
    let s = Server::start(config(|_| {}), None);
    for salt in [json!(""), json!(7), json!("x".repeat(2000))] {
        let r = post(
            s.addr,
            "/v1/chat/completions",
            chat(json!({"cache_salt": salt})),
        );
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(error_of(&r)["param"], "cache_salt", "{}", r.body);
    }
    let r = post(
        s.addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "hi", "max_tokens": 2, "cache_salt": "abc"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}
