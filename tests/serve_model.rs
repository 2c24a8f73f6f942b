//! `specgate serve --model X` with nothing else, as a new user starts it,
//! for every family: the built-in draft (Qwen2.5-Coder 0.5B) is used only
//! for a target whose tokenizer it shares; any other target (the tiny Kimi
//! K3 as a directory and as GGUF, the tiny Kimi K2, SmolLM2) starts,
//! answers a chat request and speculates by n-gram lookup, which its
//! start-up log (with the reason) and /v1/models say. A draft that was
//! asked for (a flag or the config) and does not fit fails the start, and
//! the message names the fixes. The arguments go through `ServeArgs`
//! exactly as the binary resolves them; the misfit flag runs the binary
//! itself, to see its exit status.

mod common;

use clap::Parser;
use common::*;
use serde_json::{json, Value};
use specgate::cli::ServeArgs;
use specgate::config::SpeculativeMethod;
use specgate::tokenizer::testing::{tiny_chatml_metadata, CHATML};
use specgate::tokenizer::TextTokenizer;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

const QWEN_TARGET: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";
const QWEN_DRAFT: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
const SMOLLM2: &str = "smollm2-135m-instruct-q4_1.gguf";

/// The start-up log of this binary (one subscriber for all its tests).
fn log() -> &'static specgate::logging::Captured {
    captured_log("specgate::server=info")
}

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// `specgate serve --port 0 ARGS`, resolved as the binary resolves its
/// arguments (no config file) and started in this process.
fn serve(args: &[&OsStr]) -> Server {
    log();
    let argv = ["serve", "--port", "0"]
        .map(OsStr::new)
        .into_iter()
        .chain(args.iter().copied());
    let (cfg, file) = ServeArgs::try_parse_from(argv).unwrap().resolve().unwrap();
    assert!(file.is_none());
    Server::start(cfg, None)
}

/// `serve --model MODEL`: the method in force on /v1/models and in the
/// start-up log's line for `model` (with its reason, which is returned),
/// and one chat request answered with text.
fn serve_model_alone(model: &Path) -> (String, String) {
    let s = serve(&["--model".as_ref(), model.as_ref()]);
    let r = request(s.addr, "GET", "/v1/models", &[], "");
    assert_eq!(r.status, 200, "{}", r.body);
    let card: Value = serde_json::from_str(&r.body).unwrap();
    let card = &card["data"][0];
    let method = card["speculative"]["method"].as_str().unwrap().to_owned();
    let r = post(
        s.addr,
        "/v1/chat/completions",
        chat(json!({"model": card["id"], "max_tokens": 8, "ignore_eos": true})),
    );
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 8, "{}", r.body);
    assert!(!turn_text(&r).is_empty(), "{}", r.body);
    s.wait_idle();
    let line = lines_of_target(log(), "specgate::server")
        .into_iter()
        .find(|l| {
            l["model"] == model.display().to_string()
                && l["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("speculative method in force"))
        })
        .unwrap_or_else(|| {
            panic!(
                "no method line for {}:\n{}",
                model.display(),
                log().contents()
            )
        });
    assert_eq!(line["method"], method, "the log and /v1/models agree");
    (method, line["reason"].as_str().unwrap().to_owned())
}

/// Without a draft of their tokenizer, each family speculates by n-gram
/// lookup; where the built-in draft is in models/, the reason says it does
/// not fit.
fn assert_ngram_because_the_builtin_draft_does_not_fit(model: &Path) {
    let (method, reason) = serve_model_alone(model);
    assert_eq!(method, "ngram", "{}: {reason}", model.display());
    assert!(reason.contains("n-gram prompt lookup"), "{reason}");
    if models_dir().join(QWEN_DRAFT).exists() {
        assert!(
            reason.contains(QWEN_DRAFT) && reason.contains("does not fit"),
            "{reason}"
        );
    }
}

#[test]
fn tiny_k3_directory_alone_speculates_by_ngram() {
    assert_ngram_because_the_builtin_draft_does_not_fit(&fixture("kimi_k3/tiny-hf"));
}

#[test]
fn tiny_k3_gguf_alone_speculates_by_ngram() {
    assert_ngram_because_the_builtin_draft_does_not_fit(&fixture("kimi_k3/tiny-k3.gguf"));
}

/// The tiny Kimi K2 checkpoint (tests/fixtures/tiny-kimi has no tokenizer)
/// as a model directory: its weights with the tiny ChatML tokenizer of its
/// 384-token vocabulary.
fn tiny_k2_dir() -> PathBuf {
    let dir = scratch_dir("serve-model").join("tiny-k2");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("tiny-kimi").join(f), dir.join(f)).unwrap();
    }
    let tok = TextTokenizer::from_gguf_metadata(&tiny_chatml_metadata(384).into_iter().collect())
        .unwrap();
    tok.save_tokenizer_json(&dir.join("tokenizer.json"))
        .unwrap();
    let tc = json!({"chat_template": CHATML, "eos_token": "<|im_end|>", "add_bos_token": false});
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    dir
}

#[test]
fn tiny_k2_directory_alone_speculates_by_ngram() {
    assert_ngram_because_the_builtin_draft_does_not_fit(&tiny_k2_dir());
}

#[test]
fn smollm2_alone_speculates_by_ngram() {
    let Some(model) = real_model(SMOLLM2) else {
        return;
    };
    assert_ngram_because_the_builtin_draft_does_not_fit(&model);
}

/// The pair the defaults were made for keeps its draft. (The built-in
/// draft path is relative, as the tests' working directory is the
/// repository root.)
#[test]
fn qwen_coder_alone_keeps_the_builtin_draft() {
    let (Some(model), Some(_)) = (real_model(QWEN_TARGET), real_model(QWEN_DRAFT)) else {
        return;
    };
    let (method, reason) = serve_model_alone(&model);
    assert_eq!(method, "draft", "{reason}");
    assert!(
        reason.contains(QWEN_DRAFT) && reason.contains("has the target's tokenizer"),
        "{reason}"
    );
}

/// Auto takes a draft that fits: the tiny K3 with its tiny K3 draft (the
/// same tokenizer files). The target is a copy, so that its start-up line
/// is not taken for the line of the test serving the fixture alone.
#[test]
fn auto_with_a_fitting_draft_uses_it() {
    let model = scratch_dir("serve-model").join("tiny-k3-with-draft");
    std::fs::create_dir_all(&model).unwrap();
    for f in std::fs::read_dir(fixture("kimi_k3/tiny-hf")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, model.join(f.file_name().unwrap())).unwrap();
    }
    let draft = fixture("kimi_k3/tiny-draft-hf");
    let s = serve(&[
        "--model".as_ref(),
        model.as_ref(),
        "--draft".as_ref(),
        draft.as_ref(),
        "--speculative-method".as_ref(),
        "auto".as_ref(),
    ]);
    assert_eq!(
        s.engine().speculative_method(),
        specgate::engine::SpecMethod::Draft
    );
}

fn assert_names_the_fixes(e: &str) {
    for fix in [
        "does not fit the target",
        "the target's tokenizer",
        "--speculative-method ngram",
        "--speculative-method off",
    ] {
        assert!(e.contains(fix), "lacks {fix:?}: {e}");
    }
}

/// `--draft` that does not fit: the binary exits non-zero, naming the
/// fixes (the tiny llama's 384-token ChatML vocabulary is not the tiny
/// K3's 768-token one).
#[test]
fn a_named_draft_that_does_not_fit_exits_naming_the_fixes() {
    let (misfit, _) = model_files();
    let out = Command::new(env!("CARGO_BIN_EXE_specgate"))
        .args(["serve", "--port", "0", "--model"])
        .arg(fixture("kimi_k3/tiny-hf"))
        .arg("--draft")
        .arg(&misfit)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started: {stderr}");
    assert_names_the_fixes(&stderr);
    assert!(stderr.contains("768 tokens against 384"), "{stderr}");
}

/// The same draft named by a config file (method `draft`, the file's
/// default) fails the start the same way.
#[test]
fn a_configured_draft_that_does_not_fit_fails_the_start() {
    let cfg = config(|c| {
        c.model.path = fixture("kimi_k3/tiny-hf");
        c.speculative.method = SpeculativeMethod::Draft;
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Err(e) = rt.block_on(specgate::server::start(cfg, None)) else {
        panic!("started with a draft that does not fit");
    };
    assert_names_the_fixes(&format!("{e:#}"));
}
