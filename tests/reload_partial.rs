//! Live reload of a config file written in two parts, in its own test
//! process (the Prometheus registry holds only this server's draft-length
//! gauge): the watcher reads the first part, refuses it as cut short, and
//! must read the file again when the rest lands, even when the file
//! system's clock gave both writes the same modification time (two writes
//! within one tick, as an editor or `cat >>` makes them).

mod common;

use common::*;
use serde_json::json;
use specgate::config::Config;
use std::fs::OpenOptions;
use std::io::Write;
use std::time::{Duration, Instant};

#[test]
fn an_edit_refused_as_partial_is_read_again_when_the_rest_lands() {
    let path = scratch_dir("reload-partial").join("c.toml");
    let (t, _) = model_files();
    let head = format!(
        "[server]\nport = 0\nserved_model_name = \"{MODEL}\"\n[model]\npath = {:?}\n[kv]\nnum_blocks = 64\n[speculative]\nmethod = \"ngram\"\npolicy = \"fixed\"\n",
        t.display().to_string()
    );
    std::fs::write(&path, format!("{head}num_tokens = 2\n")).unwrap();
    let s = Server::start(Config::load(&path).unwrap(), Some(path.clone()));
    let step = || {
        post(
            s.addr,
            "/v1/chat/completions",
            chat(json!({"max_tokens": 2})),
        )
    };
    let gauge = || {
        metric(
            &request(s.addr, "GET", "/metrics", &[], "").body,
            "specgate_spec_decode_draft_length",
        )
    };
    // The gauge is published after an engine step.
    step();
    assert_eq!(gauge(), 2.0);
    std::thread::sleep(Duration::from_millis(1100)); // a new modification time

    // Part one: `num_tokens` not written yet, so it would fall back to its
    // default; the watcher (every 2 s) reads this and refuses it.
    std::fs::write(&path, &head).unwrap();
    let first = std::fs::metadata(&path).unwrap().modified().unwrap();
    std::thread::sleep(Duration::from_millis(4500));
    step();
    assert_eq!(gauge(), 2.0, "a partial file was applied");

    // Part two lands within the same clock tick as part one.
    let mut f = OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(b"num_tokens = 6\n").unwrap();
    f.set_modified(first).unwrap();
    drop(f);
    let t0 = Instant::now();
    while gauge() != 6.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the completed file was never read again"
        );
        step();
        std::thread::sleep(Duration::from_millis(200));
    }
}
