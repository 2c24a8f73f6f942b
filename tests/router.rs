//! Router mode end to end: three `specgate serve` processes (tiny generated
//! model) on loopback behind an in-process router. Load spreads over all
//! three, a repeated long prompt stays on one replica (only its prefix-cache
//! hits move), a replica killed mid-traffic is taken out with no failed
//! request but those it was running (a 502, never replayed), and when
//! restarted on its port it is taken back and serves again.
//!
//! Then faulty replicas, each a fake written here: a black-holing one gets
//! the client a 504 (not a hang), a stream that stalls or dies mid-way ends
//! with an SSE error event and `[DONE]`, a plain body that stalls closes the
//! connection, only refusals a replica marks as before admission are
//! retried (nothing a replica ran is replayed: its 500, 504, unmarked 503
//! or a connection cut after sending, counted by the fakes' hits), a body
//! that never arrives is a 408, and health changes only after consecutive
//! polls (a poll-by-poll scripted fake).

mod common;

use common::*;
use serde_json::{json, Value};
use specgate::router::{self, RouterConfig, RunningRouter};
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

/// One `specgate serve` process.
struct Engine {
    child: Child,
    addr: SocketAddr,
}

impl Engine {
    /// Starts `specgate serve` with `config` on `port` (0: any) and waits
    /// until /health answers 200.
    fn start(config: &Path, port: u16) -> Engine {
        let mut child = Command::new(env!("CARGO_BIN_EXE_specgate"))
            .args(["serve", "--config"])
            .arg(config)
            .args(["--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning specgate serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        // Reads the log to the end so the pipe never fills; reports the
        // bound address from "... specgate bound to http://ADDR ..." (a log line).
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split_once("specgate bound to http://").map(|(_, r)| r) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                    let _ = tx.send(addr);
                }
            }
        });
        let addr: SocketAddr = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("specgate serve never reported its address")
            .parse()
            .unwrap();
        let t = Instant::now();
        while request(addr, "GET", "/health", &[], "").status != 200 {
            assert!(t.elapsed() < Duration::from_secs(60), "replica never ready");
            thread::sleep(Duration::from_millis(50));
        }
        Engine { child, addr }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn metric(&self, name: &str) -> f64 {
        metric(&request(self.addr, "GET", "/metrics", &[], "").body, name)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
    }
}

fn engine_config() -> PathBuf {
    let path = scratch_dir("router").join("engine.toml");
    let (t, _) = model_files();
    std::fs::write(
        &path,
        format!(
            "[server]\nserved_model_name = \"{MODEL}\"\n[model]\npath = {:?}\n[kv]\nnum_blocks = 256\n[speculative]\nmethod = \"ngram\"\npolicy = \"fixed\"\nnum_tokens = 2\n",
            t.display().to_string()
        ),
    )
    .unwrap();
    path
}

struct Router {
    rt: tokio::runtime::Runtime,
    running: Option<RunningRouter>,
    addr: SocketAddr,
}

impl Router {
    fn start(replicas: Vec<String>) -> Router {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let cfg = RouterConfig {
            port: 0,
            replicas,
            health_interval_ms: 100,
            connect_timeout_ms: 500,
            prefix_chunk_bytes: 64,
            affinity_slack: 2.0,
            ..Default::default()
        };
        let running = rt.block_on(router::start(cfg)).unwrap();
        let addr = running.addr;
        Router {
            rt,
            running: Some(running),
            addr,
        }
    }

    fn healthy(&self) -> usize {
        self.running.as_ref().unwrap().pool.healthy()
    }

    fn wait_healthy(&self, n: usize) {
        let t = Instant::now();
        while self.healthy() != n {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "router never saw {n} healthy replicas (sees {})",
                self.healthy()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        stop(&self.rt, self.running.take());
    }
}

/// Shuts a started router down, waiting a bounded time for its drain.
fn stop(rt: &tokio::runtime::Runtime, running: Option<RunningRouter>) {
    if let Some(r) = running {
        let _ = r.shutdown.send(());
        rt.block_on(async {
            let _ = tokio::time::timeout(Duration::from_secs(5), r.done).await;
        });
    }
}

/// How one request through the router ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    Complete,
    /// The answer had begun (a 200 head arrived) and was then cut (for a
    /// stream: it ended with the router's error event).
    CutAfterStart,
    /// Failed before anything of the answer arrived: what the router must
    /// prevent while a healthy replica is left.
    Failed(String),
}

fn chat_body(content: &str, stream: bool, max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}],
           "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": stream})
}

fn send_through(addr: SocketAddr, body: &Value) -> Outcome {
    let mut s = send(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        &body.to_string(),
    );
    let mut raw = Vec::new();
    // An error after some bytes leaves them in `raw`.
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw);
    let Some((head, rest)) = raw.split_once("\r\n\r\n") else {
        return Outcome::Failed(format!("no response head: {raw:?}"));
    };
    let status = head.split(' ').nth(1).unwrap_or("");
    if status != "200" {
        return Outcome::Failed(format!("status {status}: {rest}"));
    }
    let length = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse::<usize>().ok())?
    });
    let whole = match length {
        Some(n) => rest.len() == n,
        None => rest.ends_with("0\r\n\r\n"),
    };
    // A stream cut by the replica's death ends with an error event.
    let complete = whole
        && (body["stream"] != true
            || (rest.contains("data: [DONE]") && !rest.contains(r#"data: {"error""#)));
    if complete {
        Outcome::Complete
    } else {
        Outcome::CutAfterStart
    }
}

/// Sends `n` requests from each of `threads` client threads at once.
fn burst(addr: SocketAddr, threads: usize, n: usize, tag: &str) -> Vec<Outcome> {
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let tag = tag.to_string();
            thread::spawn(move || {
                (0..n)
                    .map(|i| send_through(addr, &chat_body(&format!("{tag} {t}.{i}"), false, 16)))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect()
}

const SUCCESS: &str = "specgate_request_success_total";
const PREFIX_HITS: &str = "specgate_prefix_cache_hits_total";

#[test]
fn router_spreads_load_keeps_affinity_and_survives_a_replica_loss() {
    let cfg = engine_config();
    let mut engines: Vec<Engine> = (0..3).map(|_| Engine::start(&cfg, 0)).collect();
    let r = Router::start(engines.iter().map(Engine::url).collect());
    assert_eq!(r.healthy(), 3);
    let h = request(r.addr, "GET", "/health", &[], "");
    assert_eq!(h.status, 200, "{}", h.body);
    let m: Value =
        serde_json::from_str(&request(r.addr, "GET", "/v1/models", &[], "").body).unwrap();
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(request(r.addr, "GET", "/nowhere", &[], "").status, 404);

    // 1. Load spreads: every replica serves some of 18 concurrent requests.
    let before: Vec<f64> = engines.iter().map(|e| e.metric(SUCCESS)).collect();
    let out = burst(r.addr, 6, 3, "short question");
    assert!(out.iter().all(|o| *o == Outcome::Complete), "{out:?}");
    let served: Vec<f64> = engines
        .iter()
        .zip(&before)
        .map(|(e, b)| e.metric(SUCCESS) - b)
        .collect();
    eprintln!("requests served per replica: {served:?}");
    assert_eq!(served.iter().sum::<f64>(), 18.0, "{served:?}");
    assert!(
        served.iter().all(|&n| n >= 1.0),
        "load did not spread: {served:?}"
    );

    // A streamed answer passes through as SSE, ending with [DONE].
    let s = post(
        r.addr,
        "/v1/chat/completions",
        chat_body("stream me", true, 8),
    );
    assert!(s.headers.to_ascii_lowercase().contains("text/event-stream"));
    let (evs, done) = events(&s.body);
    assert!(done && !evs.is_empty());

    // 2. Prefix affinity: a long shared prompt goes to one replica, whose
    // prefix-cache hits move; the others' do not.
    let system: String = (0..40)
        .map(|i| format!("rule {i} of the house. "))
        .collect();
    let hits0: Vec<f64> = engines.iter().map(|e| e.metric(PREFIX_HITS)).collect();
    for i in 0..5 {
        let body = json!({"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("q{i}")}]});
        let resp = post(r.addr, "/v1/chat/completions", body);
        assert_eq!(resp.status, 200, "{}", resp.body);
    }
    let moved: Vec<f64> = engines
        .iter()
        .zip(&hits0)
        .map(|(e, b)| e.metric(PREFIX_HITS) - b)
        .collect();
    eprintln!("prefix-cache hits per replica for the repeated prompt: {moved:?}");
    assert_eq!(
        moved.iter().filter(|&&d| d > 0.0).count(),
        1,
        "prefix hits moved on more or fewer than one replica: {moved:?}"
    );
    let rm = request(r.addr, "GET", "/metrics", &[], "").body;
    assert!(
        metric(&rm, "specgate_router_affinity_routed_total") >= 4.0,
        "{rm}"
    );

    // 3. A replica killed under traffic: requests keep succeeding; only
    // answers already under way on it may be cut, or, not yet begun, fail
    // with a 502: a request a replica was running is never replayed (it
    // may be what killed it).
    let stop = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|t| {
            let (stop, killed) = (stop.clone(), killed.clone());
            let addr = r.addr;
            thread::spawn(move || {
                let mut out = Vec::new();
                let mut after_kill = 0;
                let mut i = 0;
                // Each client goes on until it has sent 2 requests that
                // started after the kill, however slow the machine is.
                while !(stop.load(Ordering::Relaxed) && after_kill >= 2) {
                    let after = killed.load(Ordering::Relaxed);
                    let body = chat_body(&format!("traffic {t}.{i}"), i % 2 == 0, 24);
                    out.push((after, send_through(addr, &body)));
                    after_kill += after as usize;
                    i += 1;
                }
                out
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(800));
    let port = engines[2].addr.port();
    engines[2].kill();
    killed.store(true, Ordering::Relaxed);
    r.wait_healthy(2);
    stop.store(true, Ordering::Relaxed);
    let out: Vec<(bool, Outcome)> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    let failed: Vec<&Outcome> = out
        .iter()
        .filter(|(after, o)| match o {
            Outcome::Failed(why) => *after || !why.starts_with("status 502"),
            _ => false,
        })
        .map(|(_, o)| o)
        .collect();
    let cut = out
        .iter()
        .filter(|(_, o)| *o == Outcome::CutAfterStart)
        .count();
    eprintln!(
        "during the loss: {} requests, {cut} cut after they began, {} failed before",
        out.len(),
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "requests failed other than by the replica dying under them: {failed:?}"
    );
    // Requests begun after the kill never reached the dead replica's
    // answer: all complete (retried elsewhere when routed to it).
    let late: Vec<&Outcome> = out.iter().filter(|(a, _)| *a).map(|(_, o)| o).collect();
    assert!(late.len() >= 8, "{out:?}");
    assert!(late.iter().all(|o| **o == Outcome::Complete), "{out:?}");
    // With one replica down the others serve everything.
    let out = burst(r.addr, 3, 2, "after the loss");
    assert!(out.iter().all(|o| *o == Outcome::Complete), "{out:?}");

    // 4. Restarted on its port, it is taken back and serves again.
    engines[2] = Engine::start(&cfg, port);
    r.wait_healthy(3);
    let out = burst(r.addr, 6, 2, "after the return");
    assert!(out.iter().all(|o| *o == Outcome::Complete), "{out:?}");
    assert!(
        engines[2].metric(SUCCESS) >= 1.0,
        "the restarted replica served nothing"
    );

    // 5. No replica healthy: 503 in the OpenAI error shape.
    for e in engines.iter_mut() {
        e.kill();
    }
    r.wait_healthy(0);
    let resp = post(
        r.addr,
        "/v1/chat/completions",
        chat_body("anyone?", false, 4),
    );
    assert_eq!(resp.status, 503);
    assert_eq!(error_of(&resp)["type"], "server_error");
    assert_eq!(request(r.addr, "GET", "/health", &[], "").status, 503);
}

// ---------------------------------------------------------------------------
// Faulty replicas. Each is a small hyper server in the test whose /health and
// /metrics answer like a replica's, while its generation routes misbehave in
// one way. Timeouts in the router's config are small so these stay fast; no
// assertion is on wall time beyond "finishes before the client's generous
// read timeout".

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming};
use hyper::{Request, Response};
use std::pin::Pin;
use std::sync::atomic::AtomicUsize;
use std::task::{Context, Poll};

/// How a fake replica answers `/v1/*`.
#[derive(Clone)]
enum Fake {
    /// Reads the request and never answers.
    BlackHole,
    /// Answers this status with an OpenAI error body (after running the
    /// request, as a replica's timeout or drain cut does).
    Status(u16),
    /// Answers this status marked as a refusal before admission.
    Refused(u16),
    /// A whole JSON chat completion.
    Ok,
    /// Closes the connection without a response.
    Reset,
    /// 200 `text/event-stream`: `items`, `gap` apart, then `end`.
    Stream {
        items: Vec<&'static str>,
        gap: Duration,
        end: End,
    },
    /// 200 JSON with `content-length: 100`, 10 bytes of it, then silence.
    PlainStall,
}

/// What a fake stream does after its items.
#[derive(Clone, Copy)]
enum End {
    /// Keeps the connection open and sends nothing more.
    Stall,
    /// Fails the body: the connection is cut mid-stream.
    Die,
    /// Ends the chunked body cleanly (whether `[DONE]` was sent or not).
    Close,
}

/// A fake's body: frames from a channel; an `Err` fails it.
struct ChanBody(tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>);

impl Body for ChanBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.0.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data)))
    }
}

/// `/health` answers scripted by the test, one per poll: the fake reports
/// each poll's arrival on `arrived` and waits for its answer (200 when
/// `true`, 503 when `false`).
struct HealthScript {
    answers: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<bool>>,
    arrived: std::sync::Mutex<mpsc::Sender<()>>,
}

struct FakeReplica {
    url: String,
    /// `/v1/*` requests received.
    hits: Arc<AtomicUsize>,
}

type FakeResult = Result<Response<ChanBody>, std::io::Error>;

fn reply(
    status: u16,
    headers: &[(&'static str, &str)],
    frames: Vec<Result<Bytes, std::io::Error>>,
    gap: Duration,
    then_stall: bool,
) -> Response<ChanBody> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        for f in frames {
            if tx.send(f).await.is_err() {
                return;
            }
            tokio::time::sleep(gap).await;
        }
        if then_stall {
            // Holding the sender keeps the body open.
            tx.closed().await;
        }
    });
    let mut r = Response::new(ChanBody(rx));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
    for (k, v) in headers {
        r.headers_mut()
            .insert(*k, hyper::header::HeaderValue::from_str(v).unwrap());
    }
    r
}

async fn fake_answer(
    mode: Fake,
    hits: Arc<AtomicUsize>,
    health: Option<Arc<HealthScript>>,
    req: Request<Incoming>,
) -> FakeResult {
    let json = [("content-type", "application/json")];
    let path = req.uri().path().to_string();
    if path == "/health" {
        let ok = match &health {
            None => true,
            Some(h) => {
                let _ = h.arrived.lock().unwrap().send(());
                h.answers.lock().await.recv().await.unwrap_or(true)
            }
        };
        let status = if ok { 200 } else { 503 };
        let body = Bytes::from_static(br#"{"status":"?"}"#);
        return Ok(reply(status, &json, vec![Ok(body)], Duration::ZERO, false));
    }
    if path == "/metrics" {
        let text = Bytes::from_static(b"specgate_num_requests_running 0\n");
        return Ok(reply(200, &[], vec![Ok(text)], Duration::ZERO, false));
    }
    hits.fetch_add(1, Ordering::SeqCst);
    let error = |status: u16| {
        let body = format!(
            r#"{{"error":{{"message":"fake {status}","type":"server_error","param":null,"code":null}}}}"#
        );
        Ok(reply(
            status,
            &json,
            vec![Ok(body.into())],
            Duration::ZERO,
            false,
        ))
    };
    match mode {
        Fake::BlackHole => std::future::pending().await,
        Fake::Status(s) => error(s),
        Fake::Refused(s) => {
            let mut r = error(s)?;
            r.headers_mut().insert(
                specgate::http::NOT_ADMITTED_HEADER,
                hyper::header::HeaderValue::from_static("1"),
            );
            Ok(r)
        }
        Fake::Ok => {
            let body = Bytes::from_static(br#"{"object":"chat.completion","choices":[]}"#);
            Ok(reply(200, &json, vec![Ok(body)], Duration::ZERO, false))
        }
        Fake::Reset => Err(std::io::Error::other("fake reset")),
        Fake::Stream { items, gap, end } => {
            let mut frames: Vec<_> = items.iter().map(|s| Ok(Bytes::from(*s))).collect();
            if let End::Die = end {
                frames.push(Err(std::io::Error::other("fake death")));
            }
            let sse = [("content-type", "text/event-stream")];
            Ok(reply(200, &sse, frames, gap, matches!(end, End::Stall)))
        }
        Fake::PlainStall => {
            let part = Bytes::from_static(br#"{"object":"#);
            let h = [
                ("content-type", "application/json"),
                ("content-length", "100"),
            ];
            Ok(reply(200, &h, vec![Ok(part)], Duration::ZERO, true))
        }
    }
}

/// A runtime holding fake replicas and one router in front of them.
struct Harness {
    rt: tokio::runtime::Runtime,
    router: Option<RunningRouter>,
}

impl Harness {
    fn new() -> Harness {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        Harness { rt, router: None }
    }

    fn fake(&self, mode: Fake, health: Option<Arc<HealthScript>>) -> FakeReplica {
        let listener = self
            .rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        self.rt.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (mode, hits, health) = (mode.clone(), h.clone(), health.clone());
                let svc = hyper::service::service_fn(move |req| {
                    fake_answer(mode.clone(), hits.clone(), health.clone(), req)
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        FakeReplica { url, hits }
    }

    /// Starts the router in front of `replicas`; `edit` tunes its config.
    fn route(
        &mut self,
        replicas: &[&FakeReplica],
        edit: impl FnOnce(&mut RouterConfig),
    ) -> SocketAddr {
        let mut cfg = RouterConfig {
            port: 0,
            replicas: replicas.iter().map(|r| r.url.clone()).collect(),
            health_interval_ms: 50,
            connect_timeout_ms: 200,
            ..Default::default()
        };
        edit(&mut cfg);
        let running = self.rt.block_on(router::start(cfg)).unwrap();
        let addr = running.addr;
        self.router = Some(running);
        addr
    }

    fn healthy(&self) -> usize {
        self.router.as_ref().unwrap().pool.healthy()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        stop(&self.rt, self.router.take());
    }
}

/// A raw answer read to the connection's end (or to a read error).
struct Raw {
    status: u16,
    head: String,
    /// The body, de-chunked as far as it is whole.
    body: String,
    /// The body's framing ended properly (chunked terminator, or all of
    /// `content-length`).
    whole: bool,
}

/// Sends a chat request and reads the answer. A client read that waits
/// longer than a generous bound means the router hung: that panics.
fn fetch(addr: SocketAddr, stream: bool) -> Raw {
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4, "stream": stream});
    fetch_from(addr, "/v1/chat/completions", &body)
}

/// [`fetch`] of `body` posted to `path`.
fn fetch_from(addr: SocketAddr, path: &str, body: &Value) -> Raw {
    let mut s = send(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        &body.to_string(),
    );
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut raw = Vec::new();
    if let Err(e) = s.read_to_end(&mut raw) {
        assert!(
            !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "the router hung: nothing for 10 s after {:?}",
            String::from_utf8_lossy(&raw)
        );
    }
    let raw = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head: {raw:?}"));
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let lower = head.to_ascii_lowercase();
    let (body, whole) = if lower.contains("transfer-encoding: chunked") {
        dechunk_partial(rest)
    } else {
        let length = lower.lines().find_map(|l| {
            l.strip_prefix("content-length:")
                .and_then(|v| v.trim().parse::<usize>().ok())
        });
        (rest.to_string(), length.is_none_or(|n| n == rest.len()))
    };
    Raw {
        status,
        head: head.to_string(),
        body,
        whole,
    }
}

#[test]
fn a_black_holing_replica_gets_a_504_not_a_hang() {
    let mut h = Harness::new();
    let hole = h.fake(Fake::BlackHole, None);
    let addr = h.route(&[&hole], |c| {
        c.head_timeout_ms = 1000;
        c.stream_head_timeout_ms = 1000;
    });
    for stream in [false, true] {
        let r = fetch(addr, stream);
        assert_eq!(r.status, 504, "stream {stream}: {}", r.body);
        let e: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(e["error"]["type"], "server_error", "{}", r.body);
        assert_eq!(e["error"]["code"], "upstream_timeout", "{}", r.body);
    }
    assert_eq!(
        hole.hits.load(Ordering::SeqCst),
        2,
        "a timed-out head is not retried"
    );
    assert_eq!(h.healthy(), 1, "a slow answer is not a failed health check");
}

#[test]
fn a_stream_that_stalls_after_its_head_ends_with_an_error_event() {
    let mut h = Harness::new();
    let stall = h.fake(
        Fake::Stream {
            items: vec!["data: {\"n\":1}\n\n", "data: {\"n\":2}\n\n"],
            gap: Duration::ZERO,
            end: End::Stall,
        },
        None,
    );
    let addr = h.route(&[&stall], |c| c.body_idle_timeout_ms = 1000);
    let r = fetch(addr, true);
    assert_eq!(r.status, 200);
    assert!(r.whole, "the stream was cut: {:?}", r.body);
    let (evs, done) = events(&r.body);
    assert!(done, "no [DONE]: {:?}", r.body);
    assert_eq!(evs.len(), 3, "{:?}", r.body);
    assert_eq!(evs[1]["n"], 2);
    assert_eq!(evs[2]["error"]["type"], "server_error", "{:?}", r.body);
}

#[test]
fn a_slow_stream_with_keep_alives_is_not_cut() {
    let mut h = Harness::new();
    // 8 gaps of 300 ms: longer in all than the idle limit, never idle that
    // long.
    let mut items = vec![": keep-alive\n\n"; 8];
    items.push("data: {\"n\":1}\n\ndata: [DONE]\n\n");
    let slow = h.fake(
        Fake::Stream {
            items,
            gap: Duration::from_millis(300),
            end: End::Close,
        },
        None,
    );
    let addr = h.route(&[&slow], |c| c.body_idle_timeout_ms = 1500);
    let r = fetch(addr, true);
    assert_eq!(r.status, 200);
    assert!(r.whole);
    let (evs, done) = events(&r.body);
    assert!(done && evs.len() == 1 && evs[0]["n"] == 1, "{:?}", r.body);
}

#[test]
fn a_replica_dying_mid_stream_gives_an_error_event_not_a_truncated_stream() {
    let mut h = Harness::new();
    // Dies in the middle of an event, and (second replica) ends the body
    // cleanly without [DONE]: both must read as a failure to the client.
    let items = vec!["data: {\"n\":1}\n\n", "data: {\"n\":2}\n\ndata: {\"half"];
    let dies = h.fake(
        Fake::Stream {
            items: items.clone(),
            gap: Duration::ZERO,
            end: End::Die,
        },
        None,
    );
    let closes = h.fake(
        Fake::Stream {
            items,
            gap: Duration::ZERO,
            end: End::Close,
        },
        None,
    );
    let addr = h.route(&[&dies, &closes], |_| {});
    for _ in 0..4 {
        let r = fetch(addr, true);
        assert_eq!(r.status, 200);
        assert!(r.whole, "the stream was cut: {:?}", r.body);
        // events() panics on a broken event: the half one never arrives.
        let (evs, done) = events(&r.body);
        assert!(done, "no [DONE]: {:?}", r.body);
        assert_eq!(evs.len(), 3, "{:?}", r.body);
        assert_eq!(evs[2]["error"]["type"], "server_error", "{:?}", r.body);
    }
    assert!(dies.hits.load(Ordering::SeqCst) >= 1);
    assert!(closes.hits.load(Ordering::SeqCst) >= 1);
}

#[test]
fn a_plain_body_that_stalls_closes_the_connection() {
    let mut h = Harness::new();
    let stall = h.fake(Fake::PlainStall, None);
    let addr = h.route(&[&stall], |c| c.body_idle_timeout_ms = 1000);
    let r = fetch(addr, false);
    assert_eq!(r.status, 200, "{}", r.head);
    assert!(!r.whole, "a cut body must not look complete: {:?}", r.body);
}

/// Nothing is replayed after a replica ran a request: its 500, 504, an
/// unmarked 503 (a request timeout, a grammar failure, a drain cut) and a
/// connection cut after the request was sent (a replica dying under it)
/// all reach the client from the one replica that got it, counted by the
/// fakes' hits. Only refusals the replica marks as before admission (503
/// loading or draining, 429 over a limit) go to another replica.
#[test]
fn the_router_replays_nothing_after_a_replica_ran_a_request() {
    let mut h = Harness::new();
    for (mode, want) in [
        (Fake::Status(500), 500u16),
        (Fake::Status(504), 504),
        (Fake::Status(503), 503),
        (Fake::Reset, 502),
    ] {
        let a = h.fake(mode.clone(), None);
        let b = h.fake(mode, None);
        let addr = h.route(&[&a, &b], |_| {});
        for i in 0..3 {
            let r = fetch(addr, false);
            assert_eq!(r.status, want, "{}", r.body);
            let hits = a.hits.load(Ordering::SeqCst) + b.hits.load(Ordering::SeqCst);
            assert_eq!(hits, i + 1, "a {want} was replayed on another replica");
        }
        drop(h);
        h = Harness::new();
    }
    // Refusals before admission go to another replica.
    for mode in [Fake::Refused(503), Fake::Refused(429)] {
        let bad = h.fake(mode, None);
        let good = h.fake(Fake::Ok, None);
        let addr = h.route(&[&bad, &good], |_| {});
        for _ in 0..4 {
            let r = fetch(addr, false);
            assert_eq!(r.status, 200, "{}", r.body);
        }
        assert!(
            bad.hits.load(Ordering::SeqCst) >= 1,
            "the refusing replica was never tried"
        );
        assert_eq!(good.hits.load(Ordering::SeqCst), 4);
        drop(h);
        h = Harness::new();
    }
    // The last replica's refusal is passed through.
    let only = h.fake(Fake::Refused(503), None);
    let addr = h.route(&[&only], |_| {});
    assert_eq!(fetch(addr, false).status, 503);
    assert_eq!(only.hits.load(Ordering::SeqCst), 1);
}

/// A client whose body trickles (or never comes whole) gets a 408 at the
/// router's body deadline; no replica sees anything.
#[test]
fn a_body_that_never_arrives_gets_a_408() {
    let mut h = Harness::new();
    let r = h.fake(Fake::Ok, None);
    use std::io::Write as _;
    let addr = h.route(&[&r], |c| c.body_read_timeout_ms = 500);
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"model\"",
    )
    .unwrap();
    // The head comes in the first read (the connection may stay open).
    let mut raw = [0u8; 4096];
    let n = s.read(&mut raw).unwrap();
    let raw = String::from_utf8_lossy(&raw[..n]);
    assert!(raw.starts_with("HTTP/1.1 408"), "{raw}");
    assert_eq!(r.hits.load(Ordering::SeqCst), 0);
}

#[test]
fn health_changes_only_after_consecutive_polls() {
    let mut h = Harness::new();
    let (answer, answers) = tokio::sync::mpsc::unbounded_channel();
    let (arrived_tx, arrived) = mpsc::channel();
    let script = Arc::new(HealthScript {
        answers: tokio::sync::Mutex::new(answers),
        arrived: std::sync::Mutex::new(arrived_tx),
    });
    let flappy = h.fake(Fake::Ok, Some(script));
    // The router's first poll (in start) finds it healthy.
    answer.send(true).unwrap();
    let addr = h.route(&[&flappy], |c| {
        c.health_interval_ms = 10;
        // The fake waits for the test: a poll is never lost to the clock.
        c.health_timeout_ms = 60_000;
        c.health_failure_threshold = 3;
        c.health_success_threshold = 2;
    });
    let wait_poll = || {
        arrived
            .recv_timeout(Duration::from_secs(10))
            .expect("the router stopped polling")
    };
    wait_poll(); // poll 1 (answered above)
    wait_poll(); // poll 2 waits for its answer
    assert_eq!(h.healthy(), 1);
    // Answers the waiting poll; once the next one arrives, this one has
    // been recorded.
    let step = |ok: bool| {
        answer.send(ok).unwrap();
        wait_poll();
        h.healthy() == 1
    };
    for ok in [false, true, false, false, true, false, false] {
        assert!(step(ok), "taken out without 3 failures in a row");
    }
    assert_eq!(fetch(addr, false).status, 200);
    assert!(!step(false), "3 failures in a row must take it out");
    assert!(!step(true), "one good poll must not bring it back");
    assert!(!step(false));
    assert!(!step(true));
    assert!(step(true), "2 good polls in a row bring it back");
    assert_eq!(fetch(addr, false).status, 200);
}

// ---------------------------------------------------------------------------
// The routes and request ids a replica has, through the router: one
// in-process `specgate serve` (tiny model) behind a router. The router's
// log lines are captured by a global subscriber (it logs from its runtime's
// threads) that keeps only the router's request target.

use specgate::logging::Captured;

/// The router's request lines of this test binary (installed once).
fn router_log() -> &'static Captured {
    captured_log("specgate::router::request=info")
}

/// The router's request line for `id`, waiting a bounded time for it (it
/// is written when the response body has been handed over, just after the
/// client read it). Panics when there is more than one.
fn router_line_of(id: &str) -> Value {
    line_of(router_log(), "specgate::router::request", id)
}

/// One in-process replica and a router in front of it.
fn replica_and_router() -> (Server, Router) {
    let replica = Server::start(config(|_| {}), None);
    let router = Router::start(vec![format!("http://{}", replica.addr)]);
    router.wait_healthy(1);
    (replica, router)
}

#[test]
fn the_router_answers_every_route_a_replica_answers() {
    let mut server: Vec<(&str, String)> = specgate::http::ROUTES
        .iter()
        .map(|(p, m)| (*p, m.to_string()))
        .collect();
    let mut routed: Vec<(&str, String)> = router::ROUTES
        .iter()
        .map(|(p, m, _)| (*p, m.to_string()))
        .collect();
    server.sort();
    routed.sort();
    assert_eq!(routed, server);
    let stored = |r: &[(&'static str, hyper::Method)]| -> Vec<(&'static str, String)> {
        r.iter().map(|(p, m)| (*p, m.to_string())).collect()
    };
    let routed_stored: Vec<(&str, hyper::Method)> = router::STORED_RESPONSE_ROUTES
        .iter()
        .map(|(p, m, _)| (*p, m.clone()))
        .collect();
    assert_eq!(
        stored(&routed_stored),
        stored(&specgate::http::STORED_RESPONSE_ROUTES)
    );
    // Only the router's own health and metrics are answered locally.
    for (path, _, how) in router::ROUTES {
        let local = matches!(how, router::Handling::Health | router::Handling::Metrics);
        assert_eq!(local, ["/health", "/metrics"].contains(&path), "{path}");
    }
}

#[test]
fn tokenize_version_and_openapi_through_the_router_equal_the_replicas() {
    let (replica, r) = replica_and_router();
    let both = |method: &str, path: &str, body: &str| {
        let json = [("Content-Type", "application/json")];
        let direct = request(replica.addr, method, path, &json, body);
        let routed = request(r.addr, method, path, &json, body);
        assert_eq!(direct.status, 200, "{path}: {}", direct.body);
        assert_eq!(routed.status, 200, "{path}: {}", routed.body);
        let d: Value = serde_json::from_str(&direct.body).unwrap();
        let t: Value = serde_json::from_str(&routed.body).unwrap();
        assert_eq!(t, d, "{path}");
        t
    };
    let tok = both(
        "POST",
        "/tokenize",
        &json!({"model": MODEL, "prompt": "hello world", "add_special_tokens": false}).to_string(),
    );
    assert!(tok["count"].as_u64().unwrap() > 0, "{tok}");
    let detok = both(
        "POST",
        "/detokenize",
        &json!({"model": MODEL, "tokens": tok["tokens"]}).to_string(),
    );
    assert_eq!(detok["prompt"], "hello world");
    both("GET", "/version", "");
    let doc = both("GET", "/openapi.json", "");
    assert!(doc["paths"]["/tokenize"].is_object(), "{doc}");
    // A route's other method is refused by the router itself, naming the
    // one it serves.
    let wrong = request(r.addr, "GET", "/tokenize", &[], "");
    assert_eq!(wrong.status, 405, "{}", wrong.body);
    assert_eq!(header(&wrong, "allow").as_deref(), Some("POST"));
}

#[test]
fn forwarded_routes_without_a_healthy_replica_are_503s() {
    // A port that was just free: the replica is down from the start.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let r = Router::start(vec![url]);
    assert_eq!(r.healthy(), 0);
    for (method, path) in [("GET", "/version"), ("POST", "/tokenize")] {
        let resp = request(r.addr, method, path, &[], "{}");
        assert_eq!(resp.status, 503, "{path}: {}", resp.body);
        let e = error_of(&resp);
        assert_eq!(e["type"], "server_error", "{path}: {e}");
        assert!(header(&resp, "x-request-id").is_some(), "{path}");
    }
    // The router's own errors on Anthropic's routes are in Anthropic's
    // shape, as a replica's are.
    for path in ["/v1/messages", "/v1/messages/count_tokens"] {
        let resp = request(r.addr, "POST", path, &[], "{}");
        assert_eq!(resp.status, 503, "{path}: {}", resp.body);
        let v: Value = serde_json::from_str(&resp.body).unwrap();
        assert_eq!(v["type"], "error", "{path}: {v}");
        assert_eq!(v["error"]["type"], "overloaded_error", "{path}: {v}");
        let wrong = request(r.addr, "GET", path, &[], "");
        assert_eq!(wrong.status, 405, "{path}: {}", wrong.body);
        let v: Value = serde_json::from_str(&wrong.body).unwrap();
        assert_eq!(v["type"], "error", "{path}: {v}");
    }
}

#[test]
fn request_ids_go_through_the_router() {
    // Installed before the first request, whose line would be lost.
    router_log();
    let (replica, r) = replica_and_router();
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 3, "temperature": 0})
    .to_string();
    let chat = |id: Option<&str>| {
        let mut h = vec![("Content-Type", "application/json")];
        h.extend(id.map(|id| ("X-Request-Id", id)));
        let resp = request(r.addr, "POST", "/v1/chat/completions", &h, &body);
        assert_eq!(resp.status, 200, "{}", resp.body);
        let v: Value = serde_json::from_str(&resp.body).unwrap();
        let echoed = header(&resp, "x-request-id").expect("no x-request-id");
        (echoed, v["id"].as_str().unwrap().to_string())
    };

    // The client's id comes back and names the replica's answer: the
    // replica was sent the same id.
    let (echoed, answer) = chat(Some("client-id-7"));
    assert_eq!(echoed, "client-id-7");
    assert_eq!(answer, "chatcmpl-client-id-7");
    let line = router_line_of("client-id-7");
    assert_eq!(line["route"], "/v1/chat/completions");
    assert_eq!(line["http_method"], "POST");
    assert_eq!(line["status"], 200);
    assert_eq!(line["replica"], format!("http://{}", replica.addr));
    assert_eq!(line["attempts"], 1);
    assert!(line["total_ms"].is_f64(), "{line}");

    // None sent, or one the server would not accept: the router makes one,
    // the replica uses it, and each request gets its own.
    let mut seen = Vec::new();
    for id in [None, Some("two words"), None] {
        let (echoed, answer) = chat(id);
        assert_eq!(echoed.len(), 16, "{echoed}");
        assert!(echoed.bytes().all(|b| b.is_ascii_hexdigit()), "{echoed}");
        assert_eq!(answer, format!("chatcmpl-{echoed}"));
        assert_eq!(router_line_of(&echoed)["status"], 200);
        seen.push(echoed);
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 3, "{seen:?}");

    // The router's own answers carry an id and are logged too.
    let missing = request(r.addr, "GET", "/nowhere", &[("X-Request-Id", "lost-1")], "");
    assert_eq!(missing.status, 404);
    assert_eq!(header(&missing, "x-request-id").as_deref(), Some("lost-1"));
    let line = router_line_of("lost-1");
    assert_eq!(line["status"], 404);
    assert!(line.get("replica").is_none(), "{line}");
    let health = request(r.addr, "GET", "/health", &[], "");
    assert!(header(&health, "x-request-id").is_some());
}

#[test]
fn a_cut_stream_is_logged_once_with_its_error() {
    router_log();
    let mut h = Harness::new();
    let dies = h.fake(
        Fake::Stream {
            items: vec!["data: {\"n\":1}\n\n"],
            gap: Duration::ZERO,
            end: End::Die,
        },
        None,
    );
    let addr = h.route(&[&dies], |_| {});
    let r = fetch(addr, true);
    assert_eq!(r.status, 200);
    // The fake sends no id: the router's own is on the relayed answer.
    let id = r
        .head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("x-request-id:")
                .map(|v| v.trim().to_string())
        })
        .expect("no x-request-id on a relayed answer");
    let line = router_line_of(&id);
    assert_eq!(line["status"], 200);
    assert_eq!(line["replica"], dies.url);
    let error = line["error"].as_str().unwrap_or_default();
    assert!(error.contains(&dies.url), "{line}");
}

/// A complete Responses stream (a real one, by its event names).
const RESPONSES_STREAM: [&str; 4] = [
    "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_a\",\"object\":\"response\",\"created_at\":5,\"status\":\"in_progress\",\"model\":\"tiny\",\"output\":[]},\"sequence_number\":0}\n\n",
    "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\",\"sequence_number\":1}\n\n",
    ": keep-alive\n\n",
    "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_a\",\"status\":\"completed\"},\"sequence_number\":2}\n\n",
];

/// A complete Messages stream.
const MESSAGES_STREAM: [&str; 4] = [
    "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_a\"}}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n",
    "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"}}\n\n",
    "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
];

/// The router's count of upstream errors of `url`, from its own /metrics.
fn upstream_errors(router: SocketAddr, url: &str) -> f64 {
    let text = request(router, "GET", "/metrics", &[], "").body;
    metric(
        &text,
        &format!("specgate_router_upstream_errors_total{{replica=\"{url}\"}}"),
    )
}

/// The `x-request-id` of a relayed answer.
fn id_of(r: &Raw) -> String {
    r.head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("x-request-id:")
                .map(|v| v.trim().to_string())
        })
        .expect("no x-request-id on a relayed answer")
}

/// Responses and Messages streams end with their own last events, not
/// `[DONE]`: through the router they come byte for byte as the replica
/// sent them (split across frames mid-event too), with nothing appended,
/// no error on the request's line and no upstream error counted.
#[test]
fn complete_responses_and_messages_streams_pass_through_untouched() {
    router_log();
    let mut h = Harness::new();
    for (path, items) in [
        ("/v1/responses", RESPONSES_STREAM),
        ("/v1/messages", MESSAGES_STREAM),
    ] {
        // Whole events, then the same bytes cut at odd places.
        let sent: &'static str = Box::leak(items.concat().into_boxed_str());
        let (a, b) = sent.split_at(37);
        let (b, c) = b.split_at(b.len() - 9);
        for frames in [items.to_vec(), vec![a, b, c]] {
            let fake = h.fake(
                Fake::Stream {
                    items: frames,
                    gap: Duration::from_millis(5),
                    end: End::Close,
                },
                None,
            );
            let addr = h.route(&[&fake], |_| {});
            let r = fetch_from(addr, path, &json!({"model": MODEL, "stream": true}));
            assert_eq!(r.status, 200, "{path}");
            assert!(r.whole, "{path}: {:?}", r.body);
            assert_eq!(r.body, sent, "{path}: the relay changed the stream");
            let line = router_line_of(&id_of(&r));
            assert!(line.get("error").is_none(), "{path}: {line}");
            assert_eq!(upstream_errors(addr, &fake.url), 0.0, "{path}");
            stop(&h.rt, h.router.take());
        }
    }
}

/// A Responses or Messages stream cut by its replica (dying mid-event, or
/// closing before its last event) ends with an error in its own API's
/// shape: a `response.failed` event numbered after the last one relayed,
/// naming the response; Anthropic's `event: error`. The cut is counted.
#[test]
fn a_cut_responses_or_messages_stream_ends_with_its_own_apis_error() {
    let mut h = Harness::new();
    for end in [End::Die, End::Close] {
        for (path, items) in [
            ("/v1/responses", RESPONSES_STREAM),
            ("/v1/messages", MESSAGES_STREAM),
        ] {
            let mut frames = items[..2].to_vec();
            frames.push("event: message_delta\ndata: {\"ha");
            let fake = h.fake(
                Fake::Stream {
                    items: frames,
                    gap: Duration::ZERO,
                    end,
                },
                None,
            );
            let addr = h.route(&[&fake], |_| {});
            let r = fetch_from(addr, path, &json!({"model": MODEL, "stream": true}));
            assert_eq!(r.status, 200);
            assert!(r.whole, "{path}: {:?}", r.body);
            let kept: String = items[..2].concat();
            let added = r
                .body
                .strip_prefix(&kept)
                .unwrap_or_else(|| panic!("{path}: {:?}", r.body));
            assert!(!added.contains("[DONE]"), "{path}: {added:?}");
            let (name, data) = added
                .strip_suffix("\n\n")
                .and_then(|e| e.split_once('\n'))
                .unwrap_or_else(|| panic!("{path}: not one event: {added:?}"));
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            if path == "/v1/responses" {
                assert_eq!(name, "event: response.failed", "{added}");
                assert_eq!(data["type"], "response.failed");
                assert_eq!(data["sequence_number"], 2, "{data}");
                assert_eq!(data["response"]["id"], "resp_a");
                assert_eq!(data["response"]["status"], "failed");
                assert_eq!(data["response"]["error"]["code"], "server_error");
                assert!(data["response"]["error"]["message"].is_string());
            } else {
                assert_eq!(name, "event: error", "{added}");
                assert_eq!(data["type"], "error");
                assert!(data["error"]["type"].is_string(), "{data}");
                assert!(data["error"]["message"].is_string(), "{data}");
            }
            assert_eq!(upstream_errors(addr, &fake.url), 1.0, "{path}");
            stop(&h.rt, h.router.take());
        }
    }
}

/// The real thing: streamed Responses and Messages requests through the
/// router end with their API's last event and carry no error event and no
/// `[DONE]`, as straight from the replica.
#[test]
fn real_responses_and_messages_streams_end_their_own_way_through_the_router() {
    router_log();
    let (replica, r) = replica_and_router();
    let url = format!("http://{}", replica.addr);
    let cases = [
        (
            "/v1/responses",
            json!({"model": MODEL, "input": "hello world", "max_output_tokens": 6,
                   "temperature": 0, "stream": true}),
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": true,
                   "messages": [{"role": "user", "content": "hello world"}]}),
        ),
    ];
    for (path, body) in cases {
        let got = fetch_from(r.addr, path, &body);
        assert_eq!(got.status, 200, "{path}: {}", got.body);
        assert!(got.whole, "{path}");
        assert!(!got.body.contains("[DONE]"), "{path}: {}", got.body);
        let names: Vec<&str> = got
            .body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("event: "))
            .map(|e| e.split('\n').next().unwrap())
            .collect();
        assert!(!names.contains(&"error"), "{path}: {names:?}");
        let last = *names.last().unwrap();
        if path == "/v1/responses" {
            assert!(
                ["response.completed", "response.incomplete"].contains(&last),
                "{names:?}"
            );
        } else {
            assert_eq!(last, "message_stop", "{names:?}");
        }
        assert!(got.body.ends_with("\n\n"), "{path}");
        let line = router_line_of(&id_of(&got));
        assert!(line.get("error").is_none(), "{path}: {line}");
    }
    assert_eq!(upstream_errors(r.addr, &url), 0.0);
}

/// Responses are stored on the replica that made them: through the
/// router, reading one back, continuing from it and deleting it reach that
/// replica, whichever the router would pick first (each is asked in turn;
/// one that does not hold the id answers a marked 404 and ran nothing),
/// four replicas, past the router's three attempts.
#[test]
fn stored_responses_are_found_through_the_router_on_any_replica() {
    let replicas: Vec<Server> = (0..4)
        .map(|_| Server::start(config(|_| {}), None))
        .collect();
    let r = Router::start(
        replicas
            .iter()
            .map(|s| format!("http://{}", s.addr))
            .collect(),
    );
    r.wait_healthy(4);
    let json = [("Content-Type", "application/json")];
    let mut ids = Vec::new();
    for i in 0..4 {
        let body = json!({"model": MODEL, "input": format!("story {i}"), "max_output_tokens": 4});
        let made = request(r.addr, "POST", "/v1/responses", &json, &body.to_string());
        assert_eq!(made.status, 200, "{}", made.body);
        let v: Value = serde_json::from_str(&made.body).unwrap();
        ids.push(v["id"].as_str().unwrap().to_owned());
    }
    // Each id is held by exactly one replica.
    for id in &ids {
        let holders = replicas
            .iter()
            .filter(|s| {
                request(s.addr, "GET", &format!("/v1/responses/{id}"), &[], "").status == 200
            })
            .count();
        assert_eq!(holders, 1, "{id}");
    }
    for id in &ids {
        let path = format!("/v1/responses/{id}");
        for _ in 0..3 {
            let got = request(r.addr, "GET", &path, &[], "");
            assert_eq!(got.status, 200, "{}", got.body);
            let v: Value = serde_json::from_str(&got.body).unwrap();
            assert_eq!(v["id"], *id);
        }
        let body = json!({"model": MODEL, "previous_response_id": id, "input": "and then?",
                          "max_output_tokens": 4});
        for _ in 0..3 {
            let next = request(r.addr, "POST", "/v1/responses", &json, &body.to_string());
            assert_eq!(next.status, 200, "{}", next.body);
        }
        let deleted = request(r.addr, "DELETE", &path, &[], "");
        assert_eq!(deleted.status, 200, "{}", deleted.body);
        // Gone everywhere: the last replica's 404, in OpenAI's shape.
        let gone = request(r.addr, "GET", &path, &[], "");
        assert_eq!(gone.status, 404, "{}", gone.body);
        assert_eq!(error_of(&gone)["code"], "response_not_found");
        let cont = request(r.addr, "POST", "/v1/responses", &json, &body.to_string());
        assert_eq!(cont.status, 404, "{}", cont.body);
        assert_eq!(error_of(&cont)["param"], "previous_response_id");
    }
    // Other methods on a stored response are a 405 naming the allowed ones.
    let put = request(r.addr, "PUT", &format!("/v1/responses/{}", ids[0]), &[], "");
    assert_eq!(put.status, 405, "{}", put.body);
    assert_eq!(header(&put, "allow").as_deref(), Some("GET, DELETE"));
    for s in &replicas {
        s.wait_idle();
    }
}
