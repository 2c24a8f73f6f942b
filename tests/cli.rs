//! The `[model]` keys that `specgate serve --max-model-len` and
//! `--chat-template` set, end to end on the tiny in-process server: the
//! context cap is what requests are held to (and cannot exceed the model's),
//! and a template file replaces the model's chat template. (Each flag
//! against its key is checked in src/cli/tests.rs.)

mod common;

use common::*;
use serde_json::{json, Value};
use specgate::tokenizer::testing::tiny_metadata;
use specgate::tokenizer::{ChatMessage, TextTokenizer};

/// The tiny model's own context length (TinySpec's default).
const MODEL_CONTEXT: usize = 1024;

fn start_error(cfg: specgate::config::Config) -> String {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    match rt.block_on(specgate::server::start(cfg, None)) {
        Ok(_) => panic!("started"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn max_model_len_caps_the_context_requests_may_use() {
    let server = Server::start(config(|c| c.model.max_model_len = Some(64)), None);
    assert_eq!(server.engine().max_position(), 64);
    let r = post(
        server.addr,
        "/v1/chat/completions",
        chat(json!({"max_tokens": 100})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let e = error_of(&r);
    assert!(
        e["message"].as_str().unwrap().contains("64"),
        "names the cap: {e}"
    );
    let r = post(
        server.addr,
        "/v1/chat/completions",
        chat(json!({"max_tokens": 8})),
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Without the key the model's own length holds.
    let server = Server::start(config(|_| {}), None);
    assert_eq!(server.engine().max_position(), MODEL_CONTEXT);
}

#[test]
fn max_model_len_beyond_the_model_is_refused_at_start() {
    let e = start_error(config(|c| c.model.max_model_len = Some(MODEL_CONTEXT + 1)));
    assert!(
        e.contains("model.max_model_len") && e.contains(&format!("1..={MODEL_CONTEXT}")),
        "{e}"
    );
}

/// A template whose prompt differs from the model's ChatML.
const TEMPLATE: &str = "{% for m in messages %}<|im_start|>[{{ m.role | upper }}] {{ m.content }} {{ m.content }}<|im_end|>{% endfor %}<|im_start|>ASSISTANT:";

fn prompt_tokens(server: &Server) -> u64 {
    let r = post(
        server.addr,
        "/v1/chat/completions",
        chat(json!({"max_tokens": 2})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    v["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[test]
fn a_chat_template_file_replaces_the_models_template() {
    let file = scratch_dir("cli").join("chat.jinja");
    std::fs::write(&file, TEMPLATE).unwrap();
    let msgs = [ChatMessage::new("user", "hello world")];
    let count = |tok: &TextTokenizer| tok.encode_chat(&msgs, true).unwrap().len() as u64;
    let own = TextTokenizer::from_gguf_metadata(&tiny_metadata()).unwrap();
    let expected_own = count(&own);
    let expected = count(&own.with_chat_template(TEMPLATE.to_owned()).unwrap());
    assert_ne!(
        expected, expected_own,
        "the template must change the prompt"
    );

    let server = Server::start(config(|c| c.model.chat_template = Some(file.clone())), None);
    assert_eq!(prompt_tokens(&server), expected);
    let plain = Server::start(config(|_| {}), None);
    assert_eq!(prompt_tokens(&plain), expected_own);
}

#[test]
fn a_broken_or_missing_chat_template_fails_the_start() {
    let file = scratch_dir("cli").join("broken.jinja");
    std::fs::write(&file, "{% for m in messages %}").unwrap();
    let e = start_error(config(|c| c.model.chat_template = Some(file.clone())));
    assert!(
        e.contains("model.chat_template") && e.contains("chat template"),
        "{e}"
    );
    let missing = scratch_dir("cli").join("absent.jinja");
    let e = start_error(config(|c| c.model.chat_template = Some(missing)));
    assert!(
        e.contains("model.chat_template") && e.contains("absent.jinja"),
        "{e}"
    );
}
