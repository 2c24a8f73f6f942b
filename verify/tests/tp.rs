//! Tensor parallelism end to end: a model sharded over 2, 3 and 4 ranks
//! (threads) gives the unsharded model's logits at every step up to float
//! summation order, and the same greedy tokens; a split that cannot be made
//! fails at load naming the tensor and the sizes that work.
//!
//! Tolerances, relative to the largest |logit| of a row:
//! - weights dequantized to f32 (CANDLE_DEQUANTIZE_ALL): 1e-4. Only the
//!   order of float additions differs (each rank sums its slice of a
//!   row-parallel matmul, the all-reduce adds the slices in rank order).
//! - weights quantized: candle quantizes each activation row to 8 bits per
//!   block before a quantized matmul. Our cuts fall on block boundaries, so
//!   a rank quantizes exactly the blocks the unsharded matmul would; but a
//!   one-ulp difference in the residual stream can still flip one 8-bit
//!   rounding in the next layer, which then propagates. On these tiny models
//!   the measured difference is printed by each test; the bound is 2e-2.

use candle_core::quantized::GgmlDType;
use specgate_verify::model::{load_gguf_tp, load_model_tp, load_safetensors_tp};
use specgate_verify::sample::argmax;
use specgate_verify::tiny::TinySpec;
use specgate_verify::{KvPool, LogitsWanted, Model, VerifyError};
mod common;

use common::real_model;
use std::path::{Path, PathBuf};

fn tmp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specgate-tp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Each test writes its own file: tests run in parallel threads.
fn gguf(spec: &TinySpec, name: &str) -> PathBuf {
    let path = tmp_dir().join(name);
    spec.write_gguf(&path, &[]).unwrap();
    path
}

/// A llama whose every split is uneven somewhere: 8 heads over 4 KV heads
/// (head_dim 32), intermediate 544 = 17 blocks of 32 (Q4_1), vocabulary 390.
fn llama_spec() -> TinySpec {
    TinySpec {
        vocab_size: 390,
        hidden_size: 256,
        intermediate_size: 544,
        num_heads: 8,
        num_kv_heads: 4,
        ..TinySpec::llama(11)
    }
}

/// A qwen2 in k-quants (256-value blocks): 4 heads of 256, 4 KV heads,
/// intermediate 1280 = 5 blocks (3 + 2 over two ranks, 2 + 1 + 1 + 1 over
/// four), tied embeddings cut by vocabulary rows.
fn qwen2_spec() -> TinySpec {
    TinySpec {
        vocab_size: 390,
        hidden_size: 1024,
        intermediate_size: 1280,
        num_heads: 4,
        num_kv_heads: 4,
        dtype: GgmlDType::Q4K,
        ..TinySpec::qwen2(12)
    }
}

/// Logits of a whole-prompt prefill (every row) and of `gen` decode steps,
/// and the tokens fed: step i feeds `pick(i, last row of logits)`.
fn decode(
    model: &Model,
    prompt: &[u32],
    gen: usize,
    mut pick: impl FnMut(usize, &[f32]) -> u32,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let total = prompt.len() + gen;
    let blocks = total.div_ceil(16) + 1;
    // Reversed block ids: the shards must share one block numbering.
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let mut pool = KvPool::for_model(model, blocks, 16).unwrap();
    let mut rows = model
        .forward_one(&mut pool, prompt, 0, &table, LogitsWanted::All)
        .unwrap();
    let mut tokens = Vec::new();
    for (i, pos) in (prompt.len()..total).enumerate() {
        let next = pick(i, rows.last().unwrap());
        tokens.push(next);
        let step = model
            .forward_one(&mut pool, &[next], pos, &table, LogitsWanted::Last)
            .unwrap();
        rows.extend(step);
    }
    (rows, tokens)
}

/// [`decode`] greedily: the logits and the greedy tokens.
fn run(model: &Model, prompt: &[u32], gen: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    decode(model, prompt, gen, |_, row| argmax(row))
}

/// Logits of `prompt` followed by `tokens` fed one at a time (teacher
/// forcing): two models compare position by position even where their
/// greedy choices would part at a near-tie.
fn run_forced(model: &Model, prompt: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    decode(model, prompt, tokens.len(), |i, _| tokens[i]).0
}

/// Gap between a row's two largest logits.
fn top2_margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            (a, b) = (v, a);
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// Largest difference of two runs' logits relative to each row's largest |logit|.
fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            let scale = x.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
            x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale
        })
        .fold(0.0, f32::max)
}

const PROMPT: [u32; 11] = [1, 17, 300, 42, 42, 5, 99, 250, 7, 383, 0];

/// World sizes `worlds` against world size 1 on one file: logits within
/// `tol` and `gen` greedy tokens identical.
fn check_worlds(path: &Path, worlds: &[usize], gen: usize, tol: f32) {
    let base = load_model_tp(path, 1).unwrap();
    let (want, want_tokens) = run(&base, &PROMPT, gen);
    for &w in worlds {
        let model = load_model_tp(path, w).unwrap();
        assert_eq!(model.world_size(), w);
        assert_eq!(
            model.kv_heads_per_rank().iter().sum::<usize>(),
            base.config().num_kv_heads
        );
        assert_eq!(model.config(), base.config());
        let (got, tokens) = run(&model, &PROMPT, gen);
        let d = max_rel_diff(&want, &got);
        eprintln!(
            "{}: world {w} vs 1: max relative logit diff {d:.2e}",
            path.display()
        );
        assert!(d <= tol, "world {w}: logits differ by {d} (> {tol})");
        assert_eq!(tokens, want_tokens, "world {w}: greedy tokens differ");
    }
}

/// candle reads CANDLE_DEQUANTIZE_ALL once per thread, from the process
/// environment: while one test sets it, another test thread loading its
/// first model would silently load dequantized. So the tests of this file
/// run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` in a fresh thread with CANDLE_DEQUANTIZE_ALL set (the caller
/// holds [`serial`]).
fn dequantized<F: FnOnce() + Send + 'static>(f: F) {
    std::thread::spawn(move || {
        std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
        f();
        std::env::remove_var("CANDLE_DEQUANTIZE_ALL");
    })
    .join()
    .unwrap();
}

#[test]
fn tiny_llama_tp_2_3_4_match_world_1() {
    let _serial = serial();
    let path = gguf(&llama_spec(), "llama.gguf");
    check_worlds(&path, &[2, 3, 4], 32, 2e-2);
    let p = path.clone();
    dequantized(move || check_worlds(&p, &[2, 4], 8, 1e-4));
}

#[test]
fn tiny_qwen2_k_quant_tp_2_4_match_world_1() {
    let _serial = serial();
    let path = gguf(&qwen2_spec(), "qwen2.gguf");
    check_worlds(&path, &[2, 4], 32, 2e-2);
    let p = path.clone();
    dequantized(move || check_worlds(&p, &[2, 4], 8, 1e-4));
}

#[test]
fn tiny_safetensors_tp_3_splits_heads_unevenly() {
    let _serial = serial();
    let dir = tmp_dir().join("st-llama");
    llama_spec().write_safetensors(&dir).unwrap();
    let m = load_safetensors_tp(&dir, 3).unwrap();
    // 4 KV heads over 3 ranks: 2 + 1 + 1.
    assert_eq!(m.kv_heads_per_rank(), vec![2, 1, 1]);
    check_worlds(&dir, &[3], 16, 1e-4);
}

#[test]
fn pool_of_another_world_size_is_an_error_not_a_hang() {
    let _serial = serial();
    let path = gguf(&llama_spec(), "llama-pool.gguf");
    let m = load_gguf_tp(&path, 2).unwrap();
    let mut unsharded = KvPool::new(m.config(), 2, 16).unwrap();
    let e = m
        .forward_one(&mut unsharded, &[1, 2], 0, &[0], LogitsWanted::Last)
        .unwrap_err()
        .to_string();
    assert!(e.contains("KvPool::for_model"), "{e}");
    let pool = KvPool::for_model(&m, 2, 16).unwrap();
    assert_eq!(pool.world_size(), 2);
    assert_eq!(pool.bytes_per_token(), m.config().kv_bytes_per_token());
}

#[test]
fn impossible_splits_name_the_tensor_and_the_sizes_that_work() {
    let _serial = serial();
    // 2 KV heads cannot cover 4 ranks.
    let spec = TinySpec {
        num_kv_heads: 2,
        ..llama_spec()
    };
    let path = gguf(&spec, "two-kv.gguf");
    match load_gguf_tp(&path, 4) {
        Err(e @ VerifyError::ImpossibleSplit { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("blk.0.attn_k.weight"), "{msg}");
            assert!(msg.contains("[1, 2]"), "{msg}");
        }
        other => panic!("expected an impossible split, got {:?}", other.err()),
    }
    // Q4_K o_proj of 4 heads x 128 over 4 ranks: cuts at column 128 of a
    // 256-value block.
    let spec = TinySpec {
        hidden_size: 512,
        ..qwen2_spec()
    };
    let path = gguf(&spec, "q4k-narrow-heads.gguf");
    let msg = load_gguf_tp(&path, 4).err().unwrap().to_string();
    assert!(msg.contains("blk.0.attn_output.weight"), "{msg}");
    assert!(msg.contains("[1, 2]"), "{msg}");
    // One 256-value block of intermediate columns cannot be split.
    let spec = TinySpec {
        intermediate_size: 256,
        ..qwen2_spec()
    };
    let path = gguf(&spec, "one-block-ffn.gguf");
    let msg = load_gguf_tp(&path, 2).err().unwrap().to_string();
    assert!(msg.contains("blk.0.ffn_down.weight"), "{msg}");
    assert!(msg.contains("[1]"), "{msg}");
    assert!(load_gguf_tp(&path, 0).is_err());
}

// ---- the real Qwen2.5-Coder-1.5B, when scripts/fetch-models.sh has run ----

/// "def fibonacci(n):\n    return n if n < 2 else fibonacci(n-1) + fibonacci(n-2)\n"
const QWEN_PROMPT: [u32; 24] = [
    750, 75698, 1445, 982, 262, 470, 308, 421, 308, 366, 220, 17, 770, 75698, 1445, 12, 16, 8, 488,
    75698, 1445, 12, 17, 340,
];

/// Qwen2.5-1.5B at world size 2: 12 heads / 2 KV heads give 6 / 1 per rank,
/// intermediate 8960 = 35 Q4_K/Q6_K blocks gives 18 + 17. Prompt logits and
/// 16 greedy steps against world size 1.
#[test]
fn real_qwen_coder_1_5b_tp2_matches_world_1() {
    let _serial = serial();
    let Some(p) = real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf") else {
        return;
    };
    let gen = 16;
    let (want, want_tokens) = run(&load_gguf_tp(&p, 1).unwrap(), &QWEN_PROMPT, gen);
    let m2 = load_gguf_tp(&p, 2).unwrap();
    assert_eq!(m2.kv_heads_per_rank(), vec![1, 1]);
    // Both on world 1's greedy tokens: 8-bit activations round partial sums
    // differently per rank, so free-running greedy paths may part at a
    // near-tie, after which logits are not comparable.
    let got = run_forced(&m2, &QWEN_PROMPT, &want_tokens);
    let d = max_rel_diff(&want, &got);
    eprintln!("qwen2.5-coder-1.5b world 2 vs 1: max relative logit diff {d:.2e}");
    assert!(d <= 5e-2, "logits differ by {d}");
    // World 2 picks world 1's greedy token at every step, except where
    // world 1's top two are closer than the two runs' difference there.
    let steps = &want[QWEN_PROMPT.len() - 1..want.len() - 1];
    for (i, (w, g)) in steps.iter().zip(&got[QWEN_PROMPT.len() - 1..]).enumerate() {
        let diff = w.iter().zip(g).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        if top2_margin(w) > 2.0 * diff {
            assert_eq!(argmax(g), want_tokens[i], "greedy step {i} differs");
        }
    }
    assert!(matches!(
        load_gguf_tp(&p, 4),
        Err(VerifyError::ImpossibleSplit { .. })
    ));
}
