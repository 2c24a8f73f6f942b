//! The HTTP server on the shipped tiny Kimi K3 config
//! (configs/kimi-k3-tiny.toml: the hybrid target at tensor-parallel size 2
//! with a tiny hybrid draft): both response shapes agree, completions and
//! the speculation override work, identical requests give identical text
//! (the second one resuming from a recurrent-state checkpoint, which
//! /metrics counts), a conversation fed back turn by turn gives the same
//! text with prefix caching on and off, and clients hanging up mid-stream
//! leave neither blocks nor state slots behind.

mod common;

use common::*;
use serde_json::{json, Value};
use specgate::config::Config;
use std::io::BufReader;
use std::path::Path;

const K3: &str = "kimi-k3-tiny";

fn k3_chat(extra: Value) -> Value {
    let mut b = json!({"model": K3, "messages": [{"role": "user", "content": "write a haiku"}],
                       "max_tokens": 20, "temperature": 0, "ignore_eos": true});
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

fn tiny_k3_config() -> Config {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cfg = Config::load(&root.join("configs/kimi-k3-tiny.toml")).unwrap();
    cfg.server.port = 0;
    // The config's paths are relative to the repository root.
    cfg.model.path = root.join(&cfg.model.path);
    cfg.draft.path = cfg.draft.path.map(|p| root.join(p));
    cfg
}

/// A conversation of four turns, each answer fed back as the assistant's
/// message, streamed (as chat clients do): the answers. `salted`: each
/// request in a cache scope of its own (`cache_salt`), so none can hit
/// what another cached: prefix caching off, as far as it can tell.
fn conversation(a: std::net::SocketAddr, salted: bool) -> Vec<String> {
    let mut messages = vec![json!({"role": "system", "content":
        "You are a careful assistant. Answer in one short line, and keep to the facts \
         that the user gives you; say so when you do not know."})];
    let mut answers = Vec::new();
    for t in 0..4 {
        messages.push(json!({"role": "user", "content": format!("question {t}: name a colour")}));
        let mut body = json!({"messages": messages, "stream": true, "max_tokens": 12});
        if salted {
            body["cache_salt"] = json!(format!("turn {t}"));
        }
        let r = post(a, "/v1/chat/completions", k3_chat(body));
        let (evs, done) = events(&r.body);
        assert!(done, "{}", r.body);
        let text = delta_text(&evs, "content");
        messages.push(json!({"role": "assistant", "content": text}));
        answers.push(text);
    }
    answers
}

#[test]
fn a_conversation_resumes_from_checkpoints_with_the_same_text() {
    let s = Server::start(tiny_k3_config(), None);
    let salted = conversation(s.addr, true);
    s.wait_idle();
    let before = s.engine().stats().checkpoints;
    assert_eq!(before.hits, 0, "{before:?}");
    assert_eq!(conversation(s.addr, false), salted);
    s.wait_idle();
    let st = s.engine().stats();
    assert!(st.checkpoints.hits >= 3, "{:?}", st.checkpoints);
    let metrics = request(s.addr, "GET", "/metrics", &[], "").body;
    assert!(metric(&metrics, "specgate_state_checkpoint_hits_total") >= 3.0);
    assert!(metric(&metrics, "specgate_state_checkpoint_saves_total") >= 3.0);
    assert!(metric(&metrics, "specgate_state_checkpoint_budget_bytes") > 0.0);
}

#[test]
fn the_tiny_k3_config_serves_over_http() {
    let s = Server::start(tiny_k3_config(), None);
    let a = s.addr;
    let m: Value = serde_json::from_str(&request(a, "GET", "/v1/models", &[], "").body).unwrap();
    assert_eq!(m["data"][0]["id"], K3);

    // Whole and streamed greedy answers agree; a second identical request
    // (resuming from the first's checkpoint) gives the same text.
    let whole = turn_text(&post(a, "/v1/chat/completions", k3_chat(json!({}))));
    assert!(!whole.is_empty());
    let r = post(a, "/v1/chat/completions", k3_chat(json!({"stream": true})));
    let (evs, done) = events(&r.body);
    assert!(done);
    let delta = |k: &str| delta_text(&evs, k);
    assert_eq!(delta("reasoning_content") + &delta("content"), whole);
    assert_eq!(
        turn_text(&post(a, "/v1/chat/completions", k3_chat(json!({})))),
        whole
    );
    // Speculation off and n-gram for one request: the same greedy text.
    for spec in [
        json!({"method": "off"}),
        json!({"method": "ngram", "num_tokens": 5}),
    ] {
        let r = post(
            a,
            "/v1/chat/completions",
            k3_chat(json!({"speculative": spec})),
        );
        assert_eq!(turn_text(&r), whole, "{spec}");
    }
    let r = post(
        a,
        "/v1/completions",
        json!({"model": K3, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Hang-ups mid-stream, several at once.
    let mut readers = Vec::new();
    for i in 0..6 {
        let body = k3_chat(json!({"max_tokens": 200, "stream": true,
                                   "messages": [{"role": "user", "content": format!("story {i}")}]}))
        .to_string();
        let conn = send(
            a,
            "POST",
            "/v1/chat/completions",
            &[("Content-Type", "application/json")],
            &body,
        );
        let mut reader = BufReader::new(conn);
        read_events(&mut reader, 2);
        readers.push(reader);
    }
    drop(readers);
    s.wait_idle();
    let st = s.engine().stats();
    assert_eq!(st.state_slots_used, 0, "{st:?}");
    assert_eq!(st.state_slots, 16);
    assert!(st.prefix_caching);
    assert!(st.checkpoints.hits > 0, "{:?}", st.checkpoints);
    assert!(st.spec.draft_tokens > 0, "the draft never proposed");
    let metrics = request(a, "GET", "/metrics", &[], "").body;
    assert_eq!(metric(&metrics, "specgate_prefix_cache_enabled"), 1.0);
    assert_eq!(metric(&metrics, "specgate_state_slots "), 16.0);
    assert!(metric(&metrics, "specgate_prefix_cache_hits_total") > 0.0);
}

/// Echoed prompts scored for logprobs keep no per-row recurrent state
/// (issue 49, item 3: a prompt's rows never roll back; each used to keep a
/// whole state, +77 MB RSS for 16 such requests on this tiny model): 16
/// concurrent completions of a long prompt with `echo` and `logprobs`,
/// speculation off, leave the pool's per-row state peak at zero while
/// every prompt token gets its logprob.
#[test]
fn echoed_prompt_logprobs_keep_no_per_row_state() {
    let s = Server::start(tiny_k3_config(), None);
    let prompt: Vec<String> = (0..60).map(|i| format!("w{i}")).collect();
    let body = json!({"model": K3, "prompt": prompt.join(" "), "max_tokens": 4,
                      "temperature": 0, "echo": true, "logprobs": 2,
                      "speculative": {"method": "off"}});
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let (a, b) = (s.addr, body.clone());
            std::thread::spawn(move || post(a, "/v1/completions", b))
        })
        .collect();
    for c in clients {
        let r = c.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let v: Value = serde_json::from_str(&r.body).unwrap();
        let scored = v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len();
        assert!(scored > 100, "{scored} tokens scored: {}", r.body);
    }
    s.wait_idle();
    let st = s.engine().stats();
    assert!(st.row_state_rows > 0, "a hybrid target's bound: {st:?}");
    assert_eq!(st.row_state_peak_bytes, 0, "{st:?}");
}

/// K3's reasoning through the agent APIs: a Responses `reasoning` item
/// (whole and as `response.reasoning_text.delta` events) and a Messages
/// `thinking` block hold exactly chat's `reasoning_content`, the Responses
/// usage counts its tokens, and each API's switch turns thinking off.
#[test]
fn k3_reasoning_comes_as_reasoning_items_and_thinking_blocks() {
    let s = Server::start(tiny_k3_config(), None);
    let ask = json!([{"role": "user", "content": "write a haiku"}]);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        json!({"model": K3, "messages": ask, "max_tokens": 20, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let chat: Value = serde_json::from_str(&r.body).unwrap();
    let m = &chat["choices"][0]["message"];
    let reasoning = m["reasoning_content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let content = m["content"].as_str().unwrap_or_default().to_owned();
    assert!(!reasoning.is_empty(), "{chat}");

    let body =
        json!({"model": K3, "input": "write a haiku", "max_output_tokens": 20, "temperature": 0});
    let r = post(s.addr, "/v1/responses", body.clone());
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let out = v["output"].as_array().unwrap();
    assert_eq!(out[0]["type"], "reasoning", "{v}");
    assert_eq!(out[0]["content"][0]["text"], reasoning.as_str());
    let text: String = out
        .iter()
        .filter(|i| i["type"] == "message")
        .map(|i| i["content"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, content);
    let rt = v["usage"]["output_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .unwrap();
    let total = v["usage"]["output_tokens"].as_u64().unwrap();
    assert!(rt > 0 && rt <= total, "{}", v["usage"]);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = post(s.addr, "/v1/responses", streamed);
    let deltas: String = r
        .body
        .split("\n\n")
        .filter_map(|e| e.split_once("\ndata: "))
        .filter(|(name, _)| *name == "event: response.reasoning_text.delta")
        .map(|(_, d)| {
            serde_json::from_str::<Value>(d).unwrap()["delta"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(deltas, reasoning);
    let mut off = body;
    off["reasoning"] = json!({"effort": "none"});
    let r = post(s.addr, "/v1/responses", off);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert!(
        v["output"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["type"] != "reasoning"),
        "{v}"
    );

    let body = json!({"model": K3, "messages": ask, "max_tokens": 20, "temperature": 0});
    let r = post(s.addr, "/v1/messages", body.clone());
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["content"][0]["type"], "thinking", "{v}");
    assert_eq!(v["content"][0]["thinking"], reasoning.as_str());
    let mut off = body;
    off["thinking"] = json!({"type": "disabled"});
    let r = post(s.addr, "/v1/messages", off);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert!(
        v["content"]
            .as_array()
            .unwrap()
            .iter()
            .all(|b| b["type"] != "thinking"),
        "{v}"
    );
    s.wait_idle();
}
