//! AMX tiles on and off give the same greedy tokens, end to end: the
//! real Qwen2.5-Coder 0.5B (Q4_K_M: Q4_K, Q6_K, Q8_0 weights) and the tiny
//! Kimi K3 in its int8 GGUF formats and with MXFP4 experts, with
//! speculation (verify passes of several rows) and a prompt long enough
//! for prefill to take tiles. `specgate generate` runs once with
//! `SPECGATE_KERNEL_ISA=avx512` and once with `amx` and every product on
//! tiles (`SPECGATE_AMX_MIN_ROWS=1`). On a host without AMX the test says
//! why and checks only that asking for AMX falls back to the best ISA
//! there and logs the reason.

mod common;

use common::models::real_model;
use specgate_verify::kernels::Isa;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kimi_k3")
        .join(name)
}

/// A prompt of a few hundred tokens (many prefill rows).
fn prompt() -> String {
    let mut p = String::from("# Utilities for a small inventory service.\n");
    for i in 0..24 {
        p.push_str(&format!(
            "def item_{i}(stock, price):\n    \"\"\"Value of item {i}.\"\"\"\n    return stock * price + {i}\n\n"
        ));
    }
    p.push_str("def total(items):\n");
    p
}

/// `specgate generate` on `model` with `isa`: (success, stdout, stderr).
fn generate(model: &Path, isa: &str, extra: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_specgate"))
        .args(["generate", "--model"])
        .arg(model)
        .args(["--prompt", &prompt(), "--max-tokens", "24"])
        .args(extra)
        .env("SPECGATE_KERNEL_ISA", isa)
        .env("SPECGATE_AMX_MIN_ROWS", "1")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn greedy_tokens_are_the_same_with_amx_on_and_off() {
    let tiny = fixture("formats/tiny-wc-k3-q8_0.gguf");
    if !Isa::Amx.available() {
        let why = Isa::amx_refusal().unwrap_or("?");
        println!("AMX on/off comparison skipped on this host: {why}");
        let (ok, text, err) = generate(&tiny, "amx", &[]);
        assert!(ok && !text.is_empty(), "{err}");
        assert!(
            err.contains(&format!("kernels_isa=\"{}\"", Isa::detect().name()))
                || err.contains(&format!("kernels_isa={}", Isa::detect().name())),
            "{err}"
        );
        assert!(err.contains(why), "the log names why AMX is off: {err}");
        return;
    }
    let mut models = vec![
        fixture("formats/tiny-wc-k3-q8_0.gguf"),
        fixture("formats/tiny-wc-k3-Q4_K_M.gguf"),
        fixture("tiny-hf"),
    ];
    // The real pair's draft: the 1.5B's architecture and formats (Q4_K,
    // Q6_K, Q8_0) at a third of its run time.
    models.extend(real_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"));
    for model in &models {
        for extra in [&[][..], &["--ngram", "--num-speculative-tokens", "6"]] {
            let (ok, off, err) = generate(model, "avx512", extra);
            assert!(ok && !off.is_empty(), "{}: {err}", model.display());
            let (ok, on, err) = generate(model, "amx", extra);
            assert!(ok, "{}: {err}", model.display());
            assert!(err.contains("amx=on"), "{}: {err}", model.display());
            assert_eq!(on, off, "{} {extra:?}", model.display());
        }
    }
}
