//! A Hugging Face model directory as the served model: a tiny llama written as
//! config.json + sharded safetensors, with tokenizer.json, a tokenizer_config.json
//! whose chat template marks every turn, and a generation_config.json whose
//! `eos_token_id` list names a token the model really produces. The server (target and
//! draft both the directory) must build the chat prompt with THAT template (the prompt
//! token count in `usage` tells) and stop at that generation_config id.

mod common;

use common::*;
use serde_json::{json, Value};
use specgate::config::SpeculativeMethod;
use specgate::tokenizer::testing::tiny_chatml_metadata;
use specgate::tokenizer::{ChatMessage, TextTokenizer};
use specgate_verify::model::load_model;
use specgate_verify::tiny::TinySpec;
use specgate_verify::{KvPool, LogitsWanted};
use std::path::Path;

/// The template: ChatML with a marker before every message's text, so its prompts have
/// more tokens than the vocabulary's own ChatML template gives.
const TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n[hf-dir] {{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn tokenizer() -> TextTokenizer {
    TextTokenizer::from_gguf_metadata(&tiny_chatml_metadata(384).into_iter().collect())
        .expect("tiny tokenizer")
}

/// The first `n` tokens plain greedy decoding gives after `prompt`.
fn greedy(dir: &Path, prompt: &[u32], n: usize) -> Vec<u32> {
    let m = load_model(dir).unwrap();
    let mut pool = KvPool::for_model(&m, 4, 16).unwrap();
    let table = [0, 1, 2, 3];
    let argmax = |row: &[f32]| {
        (0..row.len())
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap() as u32
    };
    let mut out = Vec::new();
    let mut logits = m
        .forward_one(&mut pool, prompt, 0, &table, LogitsWanted::Last)
        .unwrap();
    while out.len() < n {
        let t = argmax(logits.last().unwrap());
        out.push(t);
        let pos = prompt.len() + out.len() - 1;
        logits = m
            .forward_one(&mut pool, &[t], pos, &table, LogitsWanted::Last)
            .unwrap();
    }
    out
}

#[test]
fn hf_directory_serves_chat_with_its_template_and_generation_eos() {
    let dir = scratch_dir("hf-dir").join("model");
    let _ = std::fs::remove_dir_all(&dir);
    TinySpec::llama(41)
        .write_safetensors_sharded(&dir, 2)
        .unwrap();
    let tok = tokenizer();
    tok.save_tokenizer_json(&dir.join("tokenizer.json"))
        .unwrap();
    let tok_config = json!({
        "chat_template": TEMPLATE,
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": true},
        "eos_token": "<|im_end|>",
        "add_bos_token": false,
        "model_max_length": 1024,
    });
    std::fs::write(dir.join("tokenizer_config.json"), tok_config.to_string()).unwrap();

    let text = "hello world";
    let rendered = format!("<|im_start|>user\n[hf-dir] {text}<|im_end|>\n<|im_start|>assistant\n");
    let prompt = tok.encode(&rendered, false).unwrap();
    let chatml = tok
        .encode_chat(&[ChatMessage::new("user", text)], true)
        .unwrap();
    assert!(prompt.len() > chatml.len(), "the marker adds tokens");

    // Stop at the third greedy token: generation_config.json says so, nothing else does.
    let g = greedy(&dir, &prompt, 3);
    assert!(
        g.iter().all(|t| !tok.is_eos(*t)),
        "the vocabulary's own EOS ids would stop this early: {g:?}"
    );
    let stop = g.iter().position(|&t| t == g[2]).unwrap();
    let gen = json!({"eos_token_id": [tok.eos_token_id().unwrap(), g[2]]});
    std::fs::write(dir.join("generation_config.json"), gen.to_string()).unwrap();

    let cfg = config(|c| {
        c.model.path = dir.clone();
        c.draft.path = Some(dir.clone());
        c.speculative.method = SpeculativeMethod::Draft;
    });
    let server = Server::start(cfg, None);
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
    });
    let r = post(server.addr, "/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64(),
        Some(prompt.len() as u64),
        "the prompt was not built with tokenizer_config.json's template: {v}"
    );
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{v}");
    assert_eq!(
        choice["message"]["content"].as_str().unwrap(),
        tok.decode(&g[..stop], true).unwrap(),
        "{v}"
    );
    drop(server);
    std::fs::remove_dir_all(&dir).ok();
}

/// A Kimi K3 directory (tests/fixtures/kimi_k3/tiny-hf: `tiktoken.model`, no
/// tokenizer.json) gets its tokenizer through the same loader the server and
/// `specgate generate` use, with the K3 template and config.json's turn-end EOS.
#[test]
fn kimi_k3_directory_tokenizer_loads_through_the_model_loader() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kimi_k3/tiny-hf");
    assert!(!dir.join("tokenizer.json").exists());
    let tok = specgate::generate::load_tokenizer(&dir).expect("Kimi K3 tokenizer loads");
    assert_eq!(tok.vocab_size(), 768);
    assert_eq!(tok.eos_token_id(), tok.token_to_id("<|end_of_msg|>"));
    let prompt = tok
        .encode_chat(&[ChatMessage::new("user", "hi")], true)
        .unwrap();
    let text = tok.decode(&prompt, false).unwrap();
    assert!(
        text.contains("<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|>"),
        "{text}"
    );
}
