//! Router mode on loopback: requests/s and output tokens/s through the
//! router with 1, 2 and 3 `specgate serve` replicas (SmolLM2-135M when
//! models/ has it, else the tiny generated model; speculation off), and the
//! router's overhead per request (the same requests sent directly to a
//! replica and through the router, interleaved).
//!
//! `cargo bench --bench router [-- CLIENTS REQUESTS_PER_CLIENT MAX_TOKENS]`
//! (`SPECGATE_BENCH_TINY=1`: the tiny model even when SmolLM2 is there).

#[path = "../tests/common/mod.rs"]
mod common;

use common::request;
use serde_json::{json, Value};
use specgate::router::{self, RouterConfig};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

struct Replica {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_replica(config: &Path) -> Replica {
    let mut child = Command::new(env!("CARGO_BIN_EXE_specgate"))
        .args(["serve", "--port", "0", "--config"])
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning specgate serve");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.split_once("specgate bound to http://").map(|(_, r)| r) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
            }
        }
    });
    let addr: SocketAddr = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("no address reported")
        .parse()
        .unwrap();
    let t = Instant::now();
    while request(addr, "GET", "/health", &[], "").status != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "replica never ready"
        );
        thread::sleep(Duration::from_millis(100));
    }
    Replica { child, addr }
}

/// The model and its config file; `true` when it is the real SmolLM2.
fn model_config() -> (PathBuf, String, bool) {
    let smol = common::models_dir().join("smollm2-135m-instruct-q4_1.gguf");
    let tiny = std::env::var_os("SPECGATE_BENCH_TINY").is_some();
    let (path, real) = if smol.exists() && !tiny {
        (smol, true)
    } else {
        (common::model_files().0, false)
    };
    let cfg = common::scratch_dir("bench-router").join("engine.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nserved_model_name = \"m\"\n[model]\npath = {:?}\n[kv]\nnum_blocks = 512\n[speculative]\nmethod = \"off\"\n",
            path.display().to_string()
        ),
    )
    .unwrap();
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    (cfg, name, real)
}

/// POST without the test helpers' 30 s read limit: a loaded machine may
/// take longer under many clients.
fn post(addr: SocketAddr, path: &str, body: Value) -> common::Resp {
    let s = common::send(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        &body.to_string(),
    );
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    common::read_response(s)
}

fn body(i: usize, max_tokens: usize) -> Value {
    json!({"model": "m", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
           "messages": [{"role": "user", "content": format!("Request {i}: list some prime numbers.")}]})
}

/// `clients` threads each send `per_client` requests back to back; returns
/// (requests/s, output tokens/s).
fn load(addr: SocketAddr, clients: usize, per_client: usize, max_tokens: usize) -> (f64, f64) {
    let t = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            thread::spawn(move || {
                let mut tokens = 0u64;
                for i in 0..per_client {
                    let r = post(addr, "/v1/chat/completions", body(c * 1000 + i, max_tokens));
                    assert_eq!(r.status, 200, "{}", r.body);
                    let v: Value = serde_json::from_str(&r.body).unwrap();
                    tokens += v["usage"]["completion_tokens"].as_u64().unwrap();
                }
                tokens
            })
        })
        .collect();
    let tokens: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    let s = t.elapsed().as_secs_f64();
    ((clients * per_client) as f64 / s, tokens as f64 / s)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let clients = args.first().copied().unwrap_or(8);
    let per_client = args.get(1).copied().unwrap_or(3);
    let max_tokens = args.get(2).copied().unwrap_or(16);
    let (cfg, model, real) = model_config();
    let replicas: Vec<Replica> = (0..3).map(|_| start_replica(&cfg)).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cores = thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!(
        "model {model}{}, speculation off, {clients} clients x {per_client} requests x {max_tokens} tokens, {cores} cores",
        if real { "" } else { " (generated tiny model)" }
    );
    println!("| replicas | requests | req/s | output tok/s | vs 1 replica |");
    println!("|---|---|---|---|---|");
    let mut base = 0.0;
    for n in 1..=3 {
        let urls = replicas[..n]
            .iter()
            .map(|r| format!("http://{}", r.addr))
            .collect();
        let running = rt
            .block_on(router::start(RouterConfig {
                port: 0,
                replicas: urls,
                health_interval_ms: 200,
                ..Default::default()
            }))
            .unwrap();
        load(running.addr, n, 1, 4); // warm every replica once
        let (rps, tps) = load(running.addr, clients, per_client, max_tokens);
        if n == 1 {
            base = tps;
        }
        println!(
            "| {n} | {} | {rps:.2} | {tps:.1} | {:.2}x |",
            clients * per_client,
            tps / base
        );
        let _ = running.shutdown.send(());
        rt.block_on(async {
            let _ = tokio::time::timeout(Duration::from_secs(5), running.done).await;
        });
    }

    // Overhead: one replica, sequential, direct and routed interleaved.
    let direct = replicas[0].addr;
    let running = rt
        .block_on(router::start(RouterConfig {
            port: 0,
            replicas: vec![format!("http://{direct}")],
            ..Default::default()
        }))
        .unwrap();
    let routed = running.addr;
    let rounds = 30;
    println!();
    println!("| request | path | p50 (ms) | p90 (ms) | mean (ms) |");
    println!("|---|---|---|---|---|");
    for (what, gen) in [("GET /v1/models", false), ("chat, max_tokens 1", true)] {
        let mut times = [Vec::new(), Vec::new()];
        for i in 0..rounds {
            for (k, addr) in [direct, routed].into_iter().enumerate() {
                let t = Instant::now();
                let status = if gen {
                    post(addr, "/v1/chat/completions", body(2 * i + k, 1)).status
                } else {
                    request(addr, "GET", "/v1/models", &[], "").status
                };
                assert_eq!(status, 200);
                times[k].push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        for (k, path) in ["direct", "router"].into_iter().enumerate() {
            let mean = times[k].iter().sum::<f64>() / rounds as f64;
            let p50 = pct(&mut times[k], 0.5);
            let p90 = pct(&mut times[k], 0.9);
            println!("| {what} | {path} | {p50:.2} | {p90:.2} | {mean:.2} |");
        }
    }
    let _ = running.shutdown.send(());
}
