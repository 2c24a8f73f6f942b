//! `specgate-bench` end to end against an in-process specgate server on a
//! tiny generated model: the requests and output tokens it reports equal
//! what the server itself counted on /metrics, in closed- and open-loop
//! runs; failures are counted by reason; `report` combines labelled
//! results files into a table and SVG charts.

// The root package's test support (tiny model, in-process server, HTTP
// helpers): one copy for every crate that starts a specgate server.
#[path = "../../tests/common/mod.rs"]
mod common;

use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The server's metrics are process-wide counters: the tests that compare
/// them before and after a run take turns.
static METRICS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    METRICS.lock().unwrap_or_else(|e| e.into_inner())
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("specgate-bench-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn bench(args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_specgate-bench"))
        .args(args)
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "specgate-bench {args:?} failed:\n{se}\n{so}"
    );
    (so, se)
}

fn counts(s: &Server) -> (f64, f64) {
    let m = request(s.addr, "GET", "/metrics", &[], "").body;
    (
        metric(&m, "specgate_request_success_total"),
        metric(&m, "specgate_generation_tokens_total"),
    )
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

const WORKLOAD: &str = r#"# two chats and a completion
{"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 6}
{"prompt": "def f(x):", "max_tokens": 9}
{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c a b c"}]}
"#;

#[test]
fn reported_counts_match_the_servers_metrics() {
    let _serial = serial();
    let s = Server::start(config(|_| {}), None);
    let dir = scratch("counts");
    let wl = dir.join("w.jsonl");
    std::fs::write(&wl, WORKLOAD).unwrap();
    let url = format!("http://{}/v1", s.addr);
    let (wl, url) = (wl.to_str().unwrap(), url.as_str());

    for (label, load) in [
        ("closed", &["--concurrency", "1,3", "--ignore-eos"][..]),
        ("open", &["--rate", "40,80", "--temperature", "1"][..]),
    ] {
        let json = dir.join(format!("{label}.json"));
        let before = counts(&s);
        // The third line has no max_tokens: --max-tokens sets every line's.
        // With ignore_eos every request makes exactly 7 tokens; without it
        // (sampling at temperature 1) a random model may stop early, and
        // the count is checked against the server only.
        let json_path = json.to_str().unwrap();
        let mut args = vec![
            "run",
            "--base-url",
            url,
            "--workload",
            wl,
            "--num-requests",
            "5",
            "--warmup",
            "2",
            "--max-tokens",
            "7",
            "--label",
            label,
            "--json",
            json_path,
            "--quiet",
        ];
        args.extend_from_slice(load);
        let (table, _) = bench(&args);
        s.wait_idle();
        let after = counts(&s);
        let v = read_json(&json);
        assert!(table.contains("req/s") && table.contains(label), "{table}");
        assert_eq!(v["label"], label);
        assert_eq!(v["model"], MODEL);
        let runs = v["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 2);
        let (mut done, mut toks) = (
            v["warmup"]["completed"].as_f64().unwrap(),
            v["warmup"]["output_tokens"].as_f64().unwrap(),
        );
        assert_eq!(done, 2.0);
        for r in runs {
            assert_eq!(
                (
                    r["requests"].as_u64(),
                    r["completed"].as_u64(),
                    r["failed"].as_u64()
                ),
                (Some(5), Some(5), Some(0)),
                "{r}"
            );
            assert_eq!(r["exact_token_counts"], true);
            let out = r["output_tokens"].as_f64().unwrap();
            if label == "closed" {
                assert_eq!(out, 35.0, "{r}");
            } else {
                assert!(out <= 35.0, "{r}");
            }
            // The tool's own before/after reading of /metrics per run.
            assert_eq!(r["server"]["requests_succeeded"].as_f64(), Some(5.0), "{r}");
            assert_eq!(r["server"]["generated_tokens"].as_f64(), Some(out), "{r}");
            let acc = &r["server"]["acceptance_rate"];
            assert!(
                acc.is_null() || (0.0..=1.0).contains(&acc.as_f64().unwrap()),
                "{r}"
            );
            // Every request has an end to end time. Only a request that
            // streamed text has a first-token time: sampling a random model
            // at temperature 1 may stop a request at its first token (an
            // end-of-sequence with no text), so the open runs may count fewer.
            assert_eq!(r["e2e"]["count"], 5, "{r}");
            let with_text = r["ttft"]["count"].as_u64().unwrap();
            if label == "closed" {
                assert_eq!(with_text, 5, "{r}");
            } else {
                assert!((1..=5).contains(&with_text), "{r}");
            }
            for k in ["ttft", "e2e"] {
                let (p50, p99) = (r[k]["p50"].as_f64().unwrap(), r[k]["p99"].as_f64().unwrap());
                assert!(0.0 < p50 && p50 <= p99, "{k}: {r}");
            }
            assert!(r["request_throughput"].as_f64().unwrap() > 0.0);
            done += 5.0;
            toks += out;
        }
        assert_eq!(
            after.0 - before.0,
            done,
            "{label}: requests the server counted"
        );
        assert_eq!(
            after.1 - before.1,
            toks,
            "{label}: tokens the server counted"
        );
    }

    // Every request refused: counted as failures by reason, nothing succeeded.
    let json = dir.join("bad.json");
    let before = counts(&s);
    let (_, err) = bench(&[
        "run",
        "--base-url",
        url,
        "--workload",
        wl,
        "--model",
        "nope",
        "--num-requests",
        "3",
        "--json",
        json.to_str().unwrap(),
        "--quiet",
    ]);
    let r = &read_json(&json)["runs"][0];
    assert_eq!(
        (r["completed"].as_u64(), r["failed"].as_u64()),
        (Some(0), Some(3)),
        "{r}"
    );
    assert_eq!(r["failures"]["http 404"]["count"], 3, "{r}");
    assert!(err.contains("http 404"), "{err}");
    assert_eq!(counts(&s).0, before.0);

    // Several configurations into one table and one set of charts.
    let svg = dir.join("svg");
    let (md, _) = bench(&[
        "report",
        "--markdown",
        "--svg-dir",
        svg.to_str().unwrap(),
        dir.join("closed.json").to_str().unwrap(),
        dir.join("open.json").to_str().unwrap(),
    ]);
    assert_eq!(md.lines().count(), 2 + 4, "{md}");
    for name in [
        "throughput.svg",
        "requests.svg",
        "ttft.svg",
        "itl.svg",
        "e2e.svg",
    ] {
        let text = std::fs::read_to_string(svg.join(name)).unwrap();
        assert!(
            text.starts_with("<svg") && text.contains(">closed") && text.contains(">open"),
            "{name}"
        );
    }
    s.wait_idle();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn conversation_turns_grow_the_prompt() {
    let _serial = serial();
    let s = Server::start(config(|_| {}), None);
    let dir = scratch("conversation");
    let json = dir.join("conv.json");
    let url = format!("http://{}", s.addr);
    let before = counts(&s);
    let (table, _) = bench(&[
        "conversation",
        "--url",
        &url,
        "--turns",
        "3",
        "--conversations",
        "2",
        "--system-words",
        "20",
        "--turn-words",
        "6",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--seed",
        "3",
        "--label",
        "conv",
        "--out",
        json.to_str().unwrap(),
    ]);
    s.wait_idle();
    let after = counts(&s);
    assert!(
        table.starts_with("turn") && table.lines().count() == 4,
        "{table}"
    );
    let v = read_json(&json);
    assert_eq!(
        (v["label"].as_str(), v["model"].as_str()),
        (Some("conv"), Some(MODEL))
    );
    // Every turn of both conversations ran; each answer is 5 tokens.
    let records = v["records"].as_array().unwrap();
    assert_eq!(records.len(), 6, "{v}");
    for c in 0..2 {
        let mine: Vec<&Value> = records.iter().filter(|r| r["conversation"] == c).collect();
        let prompts: Vec<u64> = mine
            .iter()
            .map(|r| r["prompt_tokens"].as_u64().unwrap())
            .collect();
        // Each prompt holds the previous one, its answer and a new turn.
        assert!(prompts.windows(2).all(|w| w[1] > w[0] + 5), "{prompts:?}");
        for r in mine {
            assert!(r["error"].is_null(), "{r}");
            assert_eq!(r["output_tokens"], 5, "{r}");
            let (ttft, total) = (
                r["ttft_s"].as_f64().unwrap(),
                r["total_s"].as_f64().unwrap(),
            );
            assert!(0.0 < ttft && ttft <= total, "{r}");
        }
    }
    for (i, t) in v["per_turn"].as_array().unwrap().iter().enumerate() {
        assert_eq!(
            (t["turn"].as_u64(), t["completed"].as_u64()),
            (Some(i as u64 + 1), Some(2)),
            "{t}"
        );
        assert_eq!(t["ttft"]["count"], 2, "{t}");
    }
    // The server counted exactly the six requests and their 30 tokens.
    assert_eq!((after.0 - before.0, after.1 - before.1), (6.0, 30.0));
    let _ = std::fs::remove_dir_all(&dir);
}
