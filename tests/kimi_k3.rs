//! Kimi K3 end to end on the tiny generated checkpoint
//! (tests/fixtures/kimi_k3, whose logits the model-level tests check
//! against llama.cpp): `specgate generate` runs the Hugging Face directory
//! and the llama.cpp GGUF alike, and what is not built yet for a model with
//! recurrent layers (speculation, the batching engine) is refused with a
//! clear error rather than run wrong.

use specgate::engine::scheduler::SchedulerConfig;
use specgate::engine::{spawn, EngineConfig, KvSize, ProposerKind};
use specgate_draft::DraftPolicy;
use specgate_verify::model::load_model;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kimi_k3")
        .join(name)
}

fn generate(model: &Path, extra: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_specgate"))
        .args(["generate", "--model"])
        .arg(model)
        .args(["--prompt", "def add(a, b):", "--max-tokens", "24"])
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn generate_runs_the_directory_and_the_gguf_alike() {
    let (ok_dir, dir, err) = generate(&fixture("tiny-hf"), &[]);
    assert!(ok_dir, "{err}");
    assert!(err.contains("decode tokens="), "{err}");
    let (ok_gguf, gguf, err) = generate(&fixture("tiny-k3.gguf"), &[]);
    assert!(ok_gguf, "{err}");
    assert!(!dir.is_empty());
    // Same weights, same tokenizer, greedy: the same text.
    assert_eq!(dir, gguf);
    // The chat template (K3's, shipped in tokenizer_config.json and the
    // GGUF) renders and the two agree there too.
    let (ok, chat_dir, err) = generate(&fixture("tiny-hf"), &["--chat"]);
    assert!(ok, "{err}");
    let (ok, chat_gguf, err) = generate(&fixture("tiny-k3.gguf"), &["--chat"]);
    assert!(ok, "{err}");
    assert_eq!(chat_dir, chat_gguf);
    // Sharded over 2 and 4 ranks: still the same greedy text.
    for tp in ["2", "4"] {
        let (ok, text, err) = generate(&fixture("tiny-hf"), &["--tensor-parallel-size", tp]);
        assert!(ok, "{err}");
        assert_eq!(text, dir, "tensor-parallel {tp}");
    }
}

#[test]
fn speculation_over_recurrent_state_is_refused_not_run_wrong() {
    let (ok, _, err) = generate(&fixture("tiny-hf"), &["--ngram"]);
    assert!(!ok);
    assert!(err.contains("recurrent layers"), "{err}");
    let cfg = EngineConfig {
        kv: KvSize::Blocks(16),
        block_size: 16,
        scheduler: SchedulerConfig {
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
        },
        policy: DraftPolicy::Fixed { k: 3 },
    };
    let target = load_model(&fixture("tiny-k3.gguf")).unwrap();
    let err = match spawn(target, ProposerKind::None, None, cfg) {
        Ok(_) => panic!("the engine accepted a model with recurrent layers"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("recurrent layers"), "{err}");
}
