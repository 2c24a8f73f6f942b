//! Live tuning, in its own test process so that the Prometheus registry
//! (process-wide) holds only this server's draft-length gauge: editing the
//! config file's [speculative] section changes the draft length in force,
//! visible in /metrics, and an invalid edit is refused.

mod common;

use common::*;
use serde_json::json;
use specgate::config::Config;
use std::time::{Duration, Instant};

#[test]
fn live_reload_changes_the_draft_length_and_refuses_bad_edits() {
    let path = scratch_dir("reload").join("c.toml");
    let (t, _) = model_files();
    let write = |k: &str| {
        std::fs::write(
            &path,
            format!(
                "[server]\nport = 0\nserved_model_name = \"{MODEL}\"\n[model]\npath = {:?}\n[kv]\nnum_blocks = 64\n[speculative]\nmethod = \"ngram\"\npolicy = \"fixed\"\nnum_tokens = {k}\n",
                t.display().to_string()
            ),
        )
        .unwrap()
    };
    write("2");
    let s = Server::start(Config::load(&path).unwrap(), Some(path.clone()));
    let gauge = || {
        metric(
            &request(s.addr, "GET", "/metrics", &[], "").body,
            "specgate_spec_decode_draft_length",
        )
    };
    // The gauge is published after an engine step.
    post(
        s.addr,
        "/v1/chat/completions",
        chat(json!({"max_tokens": 2})),
    );
    assert_eq!(gauge(), 2.0);
    std::thread::sleep(Duration::from_millis(1100)); // a new modification time
    write("6");
    let t0 = Instant::now();
    while gauge() != 6.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the reload never took effect"
        );
        post(
            s.addr,
            "/v1/chat/completions",
            chat(json!({"max_tokens": 2})),
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // An invalid edit is refused and the old value stays.
    std::thread::sleep(Duration::from_millis(1100));
    write("99");
    std::thread::sleep(Duration::from_secs(5));
    post(
        s.addr,
        "/v1/chat/completions",
        chat(json!({"max_tokens": 2})),
    );
    assert_eq!(gauge(), 6.0);
}
