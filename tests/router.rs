//! Router mode end to end: three `specgate serve` processes (tiny generated
//! model) on loopback behind an in-process router. Load spreads over all
//! three, a repeated long prompt stays on one replica (only its prefix-cache
//! hits move), a replica killed mid-traffic is taken out with no failed
//! request that had not begun streaming, and when restarted on its port it
//! is taken back and serves again.

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
        // bound address from "specgate bound to http://ADDR ...".
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("specgate bound to http://") {
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
    let dir = std::env::temp_dir().join(format!("specgate-router-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("engine.toml");
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
        if let Some(r) = self.running.take() {
            let _ = r.shutdown.send(());
            self.rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(5), r.done).await;
            });
        }
    }
}

/// How one request through the router ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    Complete,
    /// The answer had begun (a 200 head arrived) and was then cut.
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
    let complete = whole && (body["stream"] != true || rest.contains("data: [DONE]"));
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
    // answers already under way on it may be cut.
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
        .map(|(_, o)| o)
        .filter(|o| matches!(o, Outcome::Failed(_)))
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
        "requests failed before streaming: {failed:?}"
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
