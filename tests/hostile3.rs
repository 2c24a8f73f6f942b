//! Hostile requests of the third round (issue 49) over HTTP, on the shipped
//! tiny Kimi K3 config (configs/kimi-k3-tiny.toml, with a pool of 512
//! blocks as the barrage used), its checkpoint copied with a short
//! context so the end is near: a streamed completion with `max_tokens` up
//! to the context and `ignore_eos`, beside three streamed chats. Near the
//! end the draft's token trees used to be sized against the pool, the
//! step's batch reached past the context, and the forward's refusal ended
//! every request of the step with an internal error. Now the request ends
//! with `finish_reason: "length"` and its neighbours end cleanly.
//!
//! (Markup spelled as text, the other hostile case of that round, is
//! proven over HTTP in tests/kimi_k3_protocol.rs and in the chat-format
//! unit tests; the fuzzer's schemas spell markup too.)

mod common;

use common::*;
use serde_json::{json, Value};
use specgate::config::Config;
use std::path::Path;

const K3: &str = "kimi-k3-tiny";
const CONTEXT: usize = 192;

/// The tiny K3 config served from a copy of its checkpoint whose config
/// says a context of [`CONTEXT`] positions.
fn short_context_k3() -> Config {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cfg = Config::load(&root.join("configs/kimi-k3-tiny.toml")).unwrap();
    let dir = scratch_dir("hostile3-k3");
    let src = root.join(&cfg.model.path);
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    let cfg_path = dir.join("config.json");
    let mut hf: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    hf["text_config"]["max_position_embeddings"] = CONTEXT.into();
    std::fs::write(&cfg_path, hf.to_string()).unwrap();
    cfg.server.port = 0;
    cfg.model.path = dir;
    cfg.draft.path = cfg.draft.path.map(|p| root.join(p));
    cfg.kv.num_blocks = 512;
    cfg
}

/// The `finish_reason`s and error events of a stream, and whether it
/// ended with `[DONE]`.
fn ending(r: &Resp) -> (Vec<String>, Vec<Value>, bool) {
    let (evs, done) = events(&r.body);
    let reasons = evs
        .iter()
        .filter_map(|e| e["choices"][0]["finish_reason"].as_str().map(str::to_owned))
        .collect();
    let errors = evs
        .iter()
        .filter(|e| e.get("error").is_some())
        .cloned()
        .collect();
    (reasons, errors, done)
}

#[test]
fn a_request_at_the_context_end_finishes_with_length_and_its_neighbours_cleanly() {
    let s = Server::start(short_context_k3(), None);
    let a = s.addr;
    assert_eq!(s.engine().max_position(), CONTEXT);
    let prompt: Vec<u32> = (0..120)
        .map(|j| ((j * 37 + j * j) % 500) as u32 + 3)
        .collect();
    let end = json!({"model": K3, "prompt": prompt, "max_tokens": CONTEXT - prompt.len(),
                     "ignore_eos": true, "stream": true, "temperature": 0});
    let runs: Vec<std::thread::JoinHandle<Resp>> = std::iter::once(("/v1/completions", end))
        .chain((0..3).map(|i| {
            let chat = json!({"model": K3, "stream": true, "ignore_eos": true, "max_tokens": 40,
                "messages": [{"role": "user", "content": format!("neighbour {i}: count on")}],
                "chat_template_kwargs": {"thinking": false}});
            ("/v1/chat/completions", chat)
        }))
        .map(|(path, body)| std::thread::spawn(move || post(a, path, body)))
        .collect();
    let answers: Vec<Resp> = runs.into_iter().map(|t| t.join().unwrap()).collect();
    for (i, r) in answers.iter().enumerate() {
        assert_eq!(r.status, 200, "{i}: {}", r.body);
        let (reasons, errors, done) = ending(r);
        assert!(errors.is_empty() && done, "{i}: {}", r.body);
        assert_eq!(reasons, ["length"], "{i}: {}", r.body);
    }
    s.wait_idle();
    let stats = s.engine().stats();
    assert_eq!(stats.failed, 0);
    assert!(stats.spec.tree_rounds > 0, "no step verified a tree");
}
