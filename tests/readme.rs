//! The README's first request, as written, on the config it serves
//! (configs/default.toml, the real Qwen2.5-Coder pair): its curl body is
//! POSTed unchanged (no `max_tokens`, streamed) and must get a 200 whose
//! stream carries text; then the README's Python example (the official
//! `openai` client, tests/readme_example.py) on the same server, when a
//! Python with `openai` is at hand (scripts/test-openai.sh always runs it).
//! Skipped when the weights are absent.

mod common;

use common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// The JSON body of the README's first `curl ... -d '...'`, verbatim.
fn readme_curl_body() -> String {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let at = readme
        .find("curl -N ")
        .expect("the README has a curl example");
    let rest = &readme[at..];
    let start = rest.find("-d '").expect("the curl example sends a body") + 4;
    let len = rest[start..].find('\'').expect("the body is quoted");
    rest[start..start + len].to_owned()
}

#[test]
fn the_readme_curl_streams_text_on_the_default_config() {
    let body = readme_curl_body();
    let parsed: Value = serde_json::from_str(&body).expect("the README's body is JSON");
    assert!(parsed.get("max_tokens").is_none(), "the example sends none");
    if real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf").is_none()
        || real_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf").is_none()
    {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cfg = specgate::config::Config::load(&root.join("configs/default.toml")).unwrap();
    cfg.server.port = 0;
    // The config names the weights relative to the repository root.
    cfg.model.path = root.join(&cfg.model.path);
    cfg.draft.path = cfg.draft.path.map(|p| root.join(p));
    let s = Server::start(cfg, None);
    let stream = send(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        &body,
    );
    let mut reader = BufReader::new(stream);
    let mut status = String::new();
    reader.read_line(&mut status).unwrap();
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    // Read events until one carries text; the rest of the answer (up to
    // the room the pool leaves) is cancelled by hanging up.
    let mut text = String::new();
    let mut line = String::new();
    while text.is_empty() {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "stream ended early"
        );
        let Some(data) = line.trim_end().strip_prefix("data: ") else {
            continue;
        };
        assert_ne!(data, "[DONE]", "the stream ended without text");
        let ev: Value = serde_json::from_str(data).unwrap();
        if let Some(c) = ev["choices"][0]["delta"]["content"].as_str() {
            text.push_str(c);
        }
    }
    drop(reader);
    s.wait_idle();
    readme_python(&format!("http://{}/v1", s.addr));
    s.wait_idle();
}

/// Runs the README's Python example (tests/readme_example.py) against
/// `url` when a Python with the `openai` package is at hand (`$SPECGATE_PYTHON`,
/// else the venv scripts/test-openai.sh installs); otherwise says so and
/// leaves it to that script, which always runs it.
fn readme_python(url: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var_os("SPECGATE_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("target/openai-venv/bin/python"));
    let has_openai = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_openai {
        eprintln!(
            "skipping the README's Python example here: no `openai` in {} \
             (scripts/test-openai.sh runs it)",
            python.display()
        );
        return;
    }
    let out = std::process::Command::new(&python)
        .arg(root.join("tests/readme_example.py"))
        .env("SPECGATE_URL", url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the README's Python example failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
