//! The HTTP server on the shipped tiny Kimi K3 config
//! (configs/kimi-k3-tiny.toml: the hybrid target at tensor-parallel size 2
//! with a tiny hybrid draft): both response shapes agree, completions and
//! the speculation override work, identical requests give identical text
//! (prefix caching is off for a recurrent target, and /metrics says so),
//! and clients hanging up mid-stream leave neither blocks nor state slots
//! behind.

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

#[test]
fn the_tiny_k3_config_serves_over_http() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cfg = Config::load(&root.join("configs/kimi-k3-tiny.toml")).unwrap();
    cfg.server.port = 0;
    // The config's paths are relative to the repository root.
    cfg.model.path = root.join(&cfg.model.path);
    cfg.draft.path = cfg.draft.path.map(|p| root.join(p));
    let s = Server::start(cfg, None);
    let a = s.addr;
    let m: Value = serde_json::from_str(&request(a, "GET", "/v1/models", &[], "").body).unwrap();
    assert_eq!(m["data"][0]["id"], K3);

    // Whole and streamed greedy answers agree; a second identical request
    // (no prefix cache to hit) gives the same text.
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
    assert!(!st.prefix_caching);
    assert!(st.spec.draft_tokens > 0, "the draft never proposed");
    let metrics = request(a, "GET", "/metrics", &[], "").body;
    assert_eq!(metric(&metrics, "specgate_prefix_cache_enabled"), 0.0);
    assert_eq!(metric(&metrics, "specgate_state_slots "), 16.0);
    assert_eq!(metric(&metrics, "specgate_prefix_cache_hits_total"), 0.0);
}
