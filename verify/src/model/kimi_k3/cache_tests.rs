//! Kimi K3's bf16 latent cache (issue 35 item 4): which checkpoints load
//! with it, the pool memory it saves, and its accuracy effect against the
//! f32 cache on the same weights. Exactness with it (TP, rollback) is
//! tested where those are (`tests.rs` on the bf16 directory,
//! `format_tests.rs` on the bf16 and quantized GGUFs).

use super::tests::{fixture, ids, json, max_diff, run, worst_top_logprob};
use crate::model::{load_model, LogitsWanted, Model, SeqInput};
use crate::{CacheDtype, KvPool};
use std::path::PathBuf;

fn format(name: &str) -> PathBuf {
    fixture(&format!("formats/tiny-wc-k3-{name}.gguf"))
}

/// The whole-prompt logits of fixture prompt `p` with an f32 and then a
/// bf16 latent cache (the model is left on bf16), after checking that the
/// bf16 run chunked as the fixture says gives the same bits.
fn f32_and_bf16_cache(m: &mut Model, p: &serde_json::Value) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let prompt = ids(&p["prompt"]);
    m.set_latent_cache(CacheDtype::F32).unwrap();
    let f32_cache = run(m, &prompt, &[prompt.len()]);
    m.set_latent_cache(CacheDtype::Bf16).unwrap();
    let bf16_cache = run(m, &prompt, &[prompt.len()]);
    let chunks: Vec<usize> = ids(&p["chunks"]).into_iter().map(|c| c as usize).collect();
    assert_eq!(bf16_cache, run(m, &prompt, &chunks));
    (f32_cache, bf16_cache)
}

/// f32 weights keep an f32 cache; bf16 and quantized ones load with bf16,
/// whose pool holds each token in half the bytes (so twice the blocks in
/// the same memory), and the model's own byte count, which the engine
/// sizes its pool by, says so. A pool of the other dtype is refused.
#[test]
fn latent_cache_follows_the_weights_and_halves_the_pool() {
    use CacheDtype::{Bf16, F32};
    for (path, want) in [
        (fixture("tiny-k3.gguf"), F32),
        (fixture("tiny-hf"), Bf16),
        (format("bf16"), Bf16),
        (format("q8_0"), Bf16),
        (format("Q4_K_M"), Bf16),
    ] {
        let mut m = load_model(&path).unwrap();
        assert_eq!(m.latent_cache(), Some(want), "{}", path.display());
        let mut bytes = [0; 2];
        let mut pools = Vec::new();
        for (i, d) in [F32, Bf16].into_iter().enumerate() {
            m.set_latent_cache(d).unwrap();
            let pool = KvPool::for_model(&m, 4, 16).unwrap();
            assert_eq!(pool.bytes_per_token(), m.kv_bytes_per_token());
            bytes[i] = pool.bytes_per_token();
            pools.push(pool);
        }
        // Two MLA layers of 32 + 8 values.
        assert_eq!(bytes, [2 * 40 * 4, 2 * 40 * 2], "{}", path.display());
        let err = m
            .forward_rows(
                &mut pools[0],
                &[SeqInput {
                    tokens: &[1, 2],
                    start_pos: 0,
                    block_table: &[0],
                    logits: LogitsWanted::Last,
                    state_slot: 0,
                }],
            )
            .err();
        assert!(err.is_some(), "a bf16 model ran over an f32 pool");
    }
}

/// The accuracy effect of the bf16 cache: the same weights with an f32
/// and a bf16 latent cache, both llama.cpp fixture prompts, whole. The
/// bf16 run is still exact in its own terms (chunked and token by token
/// equal whole bit for bit). Measured on the well-conditioned files:
/// max |diff| 0.061 (bf16 weights), 0.197 (q8_0), 0.130 (Q4_K_M); top-token
/// logprob within 0.006, 0.042, 0.029 nat. For comparison, llama.cpp's
/// bf16-activation rounding moves the bf16 file by 0.03 and q8_0's by
/// 0.16-0.35 (`format_tests.rs`). Bounds 0.3 and 0.1 nat. On the chaotic
/// default tiny model (`tiny-hf`) any rounding moves logits by nats
/// (measured 6.6, 3.4 nat; llama.cpp's bf16-activation run of it is 6.9
/// from its f32 run), so there it is held only to that.
#[test]
fn bf16_latent_cache_changes_logits_within_a_measured_bound() {
    let fx = json("llamacpp-logits.json");
    let cases: [(PathBuf, f32, f64); 4] = [
        (fixture("tiny-hf"), 7.0, 7.0),
        (format("bf16"), 0.3, 0.1),
        (format("q8_0"), 0.3, 0.1),
        (format("Q4_K_M"), 0.3, 0.1),
    ];
    let mut failed = Vec::new();
    for (path, tol, tol_lp) in cases {
        let mut m = load_model(&path).unwrap();
        let (mut worst, mut worst_lp) = (0f32, 0f64);
        for p in fx["prompts"].as_array().unwrap() {
            let (f32_cache, bf16_cache) = f32_and_bf16_cache(&mut m, p);
            let prompt = ids(&p["prompt"]);
            assert_eq!(bf16_cache, run(&m, &prompt, &vec![1; prompt.len()]));
            worst = worst.max(max_diff(&bf16_cache, &f32_cache));
            worst_lp = worst_lp.max(worst_top_logprob(&bf16_cache, &f32_cache));
        }
        eprintln!(
            "{}: bf16 vs f32 latent cache: max |logit diff| {worst}, worst top-token logprob change {worst_lp:.5} nat",
            path.display()
        );
        // The rounding is in effect (a cache that kept f32 would show 0)
        // and stays within the stated bound.
        if !(worst > 0.0 && worst < tol && worst_lp < tol_lp) {
            failed.push(format!("{}: {worst} ({worst_lp} nat)", path.display()));
        }
    }
    assert!(
        failed.is_empty(),
        "bf16 cache effect out of bounds: {failed:?}"
    );
}

/// The bf16 cache's effect on a bigger GGUF (the hidden-2048
/// slice; `scripts/k3-slice.sh` makes it), over the fixture prompts (the
/// slices use the tiny tokenizer):
/// `K3_SLICE_GGUF=slice.gguf cargo test --release -p specgate-verify
///  slice_bf16 -- --ignored --nocapture`. Reports; asserts only that
/// the chunked bf16 run equals the whole one.
#[test]
#[ignore = "needs a K3 slice GGUF (scripts/k3-slice.sh)"]
fn slice_bf16_latent_cache_effect() {
    let path = PathBuf::from(std::env::var("K3_SLICE_GGUF").expect("K3_SLICE_GGUF"));
    let fx = json("llamacpp-logits.json");
    let mut m = load_model(&path).unwrap();
    eprintln!("{} loads with {:?}", path.display(), m.latent_cache());
    for p in fx["prompts"].as_array().unwrap() {
        let (f32_cache, bf16_cache) = f32_and_bf16_cache(&mut m, p);
        eprintln!(
            "{} prompt of {}: bf16 vs f32 latent cache: max |logit diff| {}, worst top-token logprob change {:.5} nat",
            path.display(),
            ids(&p["prompt"]).len(),
            max_diff(&bf16_cache, &f32_cache),
            worst_top_logprob(&bf16_cache, &f32_cache)
        );
    }
}

/// Prompt rows scored for `echo` + `logprobs` (`LogitsWanted::Scored`) get
/// every row's logits, the same as a verification's, but keep no per-row
/// state: nothing of theirs can be rolled back, so nothing is held. A
/// verification's rows are held only until its verdict is committed.
#[test]
fn scored_prompt_rows_keep_no_row_states() {
    let m = load_model(&fixture("tiny-k3.gguf")).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 500).collect();
    let mut logits = Vec::new();
    for wanted in [LogitsWanted::All, LogitsWanted::Scored] {
        let mut pool = KvPool::for_model(&m, 8, 16).unwrap();
        let seq = SeqInput {
            tokens: &prompt,
            start_pos: 0,
            block_table: &[0, 1, 2],
            logits: wanted,
            state_slot: 0,
        };
        logits.push(m.forward_rows(&mut pool, &[seq]).unwrap());
        let held = pool.row_state_bytes();
        if wanted == LogitsWanted::All {
            assert!(held > 0);
            pool.keep_rows(0, 40).unwrap();
        } else {
            assert_eq!(held, 0, "scored rows kept states");
            assert!(pool.keep_rows(0, 40).is_err());
        }
    }
    assert_eq!(logits[0], logits[1]);
}
