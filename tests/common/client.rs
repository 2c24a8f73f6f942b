//! The tests' HTTP/1.1 client: plain blocking requests over a TcpStream,
//! so a test sees the bytes the server sent (framing, chunk sizes, SSE
//! events, a connection closed early) rather than what a client library
//! makes of them. Helpers that read answers which never end, or judge
//! hostile traffic, stay with the test that needs them.

use super::MODEL;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A response read to the end of the connection.
pub struct Resp {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

/// Sends one `Connection: close` request on a fresh connection (30 s read
/// timeout) and returns the stream unread, for tests that read the answer
/// their own way (mid-stream, partially, never).
pub fn send(
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

/// Sends `raw` (a whole request) and reads the answer to the end of the
/// connection (60 s read timeout): the status, the head and the body
/// (de-chunked when chunked), or why there was none. For tests that must
/// tell a refused or cut connection from an answer instead of panicking.
pub fn exchange(addr: SocketAddr, raw: &[u8]) -> Result<(u16, String, String), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(raw).map_err(|e| format!("write: {e}"))?;
    let mut got = Vec::new();
    s.read_to_end(&mut got)
        .map_err(|e| format!("read: {e} after {} bytes", got.len()))?;
    let text = String::from_utf8_lossy(&got).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no whole response: {text:?}"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status: {head:?}"))?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Ok((status, head.to_owned(), body))
}

/// Sends one request and reads the whole answer (de-chunked when chunked).
/// Panics on a connection error or a non-UTF-8 answer.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Resp {
    read_response(send(addr, method, path, headers, body))
}

/// Reads the answer on `s` to the end of the connection, under the
/// stream's own read timeout. Panics on a read error (a timeout included)
/// or a non-UTF-8 answer.
pub fn read_response(mut s: TcpStream) -> Resp {
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

/// The body of a whole chunked message; panics when it is cut short.
pub fn dechunk(mut s: &str) -> String {
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

/// A JSON POST of `body`, read to the end.
pub fn post(addr: SocketAddr, path: &str, body: Value) -> Resp {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        &body.to_string(),
    )
}

/// A greedy chat body (24 tokens, "hello world") with `extra`'s keys set.
pub fn chat(extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 24, "temperature": 0});
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

/// SSE events of a stream body: the JSON of every `data:` line, then
/// whether it ended with `[DONE]`.
pub fn events(body: &str) -> (Vec<Value>, bool) {
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

/// The text of every event's first-choice `delta[key]` (`content`,
/// `reasoning_content`), joined.
pub fn delta_text(events: &[Value], key: &str) -> String {
    events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"][key].as_str())
        .collect()
}

/// A whole chat turn's text: its reasoning (a K3 model thinks by default,
/// so a random one's text is mostly reasoning) then its content. Panics
/// unless the response is a 200.
pub fn turn_text(r: &Resp) -> String {
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let m = &v["choices"][0]["message"];
    format!(
        "{}{}",
        m["reasoning_content"].as_str().unwrap_or_default(),
        m["content"].as_str().unwrap_or_default()
    )
}

/// The `error` object of an OpenAI error body; panics unless it has all of
/// message, type, param and code.
pub fn error_of(r: &Resp) -> Value {
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let e = v["error"].clone();
    for k in ["message", "type", "param", "code"] {
        assert!(e.get(k).is_some(), "error body lacks {k}: {}", r.body);
    }
    e
}

/// Reads SSE events from a live stream until `n` data events arrived.
pub fn read_events(reader: &mut BufReader<TcpStream>, n: usize) {
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

/// The sum of every sample of `name` in Prometheus text (all label sets).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A connection to `addr` whose reads give up after 15 s, for tests that
/// wait on the server to close or answer.
pub fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    s
}

/// Whether the server closed `s` (EOF or reset) within the read timeout;
/// a read timeout means it still holds the connection.
pub fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut buf = Vec::new();
    match s.read_to_end(&mut buf) {
        Ok(_) => true,
        Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
    }
}

/// De-chunks as much of `s` as is whole; `true` when the terminator came.
/// For answers that may be cut short (a replica dying mid-stream).
pub fn dechunk_partial(mut s: &str) -> (String, bool) {
    let mut out = String::new();
    loop {
        let Some((len, rest)) = s.split_once("\r\n") else {
            return (out, false);
        };
        let Ok(n) = usize::from_str_radix(len.trim(), 16) else {
            return (out, false);
        };
        if n == 0 {
            return (out, true);
        }
        if rest.len() < n + 2 {
            return (out, false);
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
}

/// The body bytes of a chunked stream read from somewhere in its middle
/// (so the first chunk-size line may be missing): every line that parses
/// as a hex chunk size is dropped, the rest joined.
pub fn dechunk_lenient(s: &str) -> String {
    s.split("\r\n")
        .filter(|l| usize::from_str_radix(l.trim(), 16).is_err() || l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("")
}

/// `base` (a JSON object) with every key of `extra` set, except that a
/// `null` in `extra` removes the key (to test a missing field).
pub fn merge(mut base: Value, extra: Value) -> Value {
    let m = base.as_object_mut().unwrap();
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            m.remove(k);
        } else {
            m.insert(k.clone(), v.clone());
        }
    }
    base
}

/// The value of response header `name` (case-insensitive), if present.
pub fn header(r: &Resp, name: &str) -> Option<String> {
    r.headers.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_string())
    })
}
