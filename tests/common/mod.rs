//! Helpers shared by the HTTP integration tests: a tiny generated model with
//! an in-code ChatML tokenizer, a server started in-process on 127.0.0.1:0,
//! and a minimal HTTP/1.1 client over a TcpStream.
#![allow(dead_code)]

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

pub const MODEL: &str = "tiny";

/// The tiny target and draft files, written once per test process (tests
/// run in parallel and must never read a half-written or stale file; a
/// leftover directory of an earlier process with the same pid is rewritten).
pub fn model_files() -> (PathBuf, PathBuf) {
    static FILES: std::sync::OnceLock<(PathBuf, PathBuf)> = std::sync::OnceLock::new();
    FILES
        .get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("specgate-http-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let (t, d) = (dir.join("target.gguf"), dir.join("draft.gguf"));
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
            (t, d)
        })
        .clone()
}

pub fn config(edit: impl FnOnce(&mut Config)) -> Config {
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

pub struct Server {
    pub rt: tokio::runtime::Runtime,
    pub running: Option<Running>,
    pub addr: SocketAddr,
}

impl Server {
    pub fn start(cfg: Config, path: Option<PathBuf>) -> Server {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        // The tests' configs are the files as loaded (no flag overrides).
        let file = path.map(|path| specgate::server::ConfigFile {
            path,
            as_loaded: cfg.clone(),
        });
        let running = rt.block_on(start(cfg, file)).unwrap();
        let addr = running.addr;
        Server {
            rt,
            running: Some(running),
            addr,
        }
    }

    pub fn engine(&self) -> &specgate::engine::EngineHandle {
        &self.running.as_ref().unwrap().engine
    }

    pub fn wait_idle(&self) {
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
pub struct Resp {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

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

pub fn request(
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

pub fn post(addr: SocketAddr, path: &str, body: Value) -> Resp {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        &body.to_string(),
    )
}

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

pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
