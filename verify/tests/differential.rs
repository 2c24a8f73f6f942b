//! Differential tests of the paged forward against candle-transformers' own
//! quantized_llama / quantized_qwen2 on the same GGUF file: logits at every
//! position within a tolerance, and 64 greedy tokens identical. Tiny
//! generated models always; the real models when `models/` holds them.

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::{quantized_llama, quantized_qwen2};
use specgate_verify::model::load_gguf;
use specgate_verify::sample::argmax;
use specgate_verify::tiny::TinySpec;
use specgate_verify::{Arch, KvPool, LogitsWanted, Model};
mod common;

use common::real_model;
use std::path::{Path, PathBuf};

/// candle-transformers' reference model for one GGUF file.
enum Reference {
    Llama(quantized_llama::ModelWeights),
    Qwen2(quantized_qwen2::ModelWeights),
}

impl Reference {
    fn load(path: &Path, arch: Arch) -> Reference {
        let mut f = std::fs::File::open(path).unwrap();
        let ct = gguf_file::Content::read(&mut f).unwrap();
        match arch {
            Arch::Llama => Reference::Llama(
                quantized_llama::ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap(),
            ),
            Arch::Qwen2 => Reference::Qwen2(
                quantized_qwen2::ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap(),
            ),
            // Checked against transformers instead (tests/deepseek.rs).
            Arch::DeepseekV3 => unreachable!("no GGUF reference for DeepSeek-V3"),
            // Checked against llama.cpp's logits (model::kimi_k3 tests).
            Arch::KimiK3 => unreachable!("no candle reference for Kimi K3"),
            Arch::Scripted => unreachable!("the scripted model has no reference"),
        }
    }

    /// Logits after feeding `token` at `pos` (one token at a time, so every
    /// position's logits are observable).
    fn step(&mut self, token: u32, pos: usize) -> Vec<f32> {
        let x = Tensor::new(&[[token]], &Device::Cpu).unwrap();
        let out = match self {
            Reference::Llama(m) => m.forward(&x, pos),
            Reference::Qwen2(m) => m.forward(&x, pos),
        }
        .unwrap();
        out.flatten_all().unwrap().to_vec1().unwrap()
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn linear_table(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}

/// Checks every prompt position's logits and `gen` greedy tokens against the
/// reference, which consumes one token per call.
///
/// Tolerances are relative to the largest |logit| at that position:
/// - `tol_step`: our forward fed one token at a time, as the reference is.
///   Same kernels on the same rows, so only float reordering differs.
/// - `tol_batch`: our whole-prompt prefill (all rows in one forward). candle
///   quantizes activations to 8 bits per row, and its single-row Q6K kernel
///   rounds differently (~1e-6) from its multi-row one; a flip of one 8-bit
///   rounding then propagates through the layers. On the real models this
///   measures up to ~4% of the largest logit, the same size as each path's
///   own distance from an f32-dequantized model, so `tol_batch` is 8% there.
fn compare(path: &Path, prompt: &[u32], gen: usize, tol_step: f32, tol_batch: f32, greedy: bool) {
    let model = load_gguf(path).unwrap();
    let arch = model.config().arch;
    let mut reference = Reference::load(path, arch);
    let total = prompt.len() + gen;
    let blocks = total.div_ceil(16) + 1;
    // Reverse order of blocks: paging must not depend on contiguity.
    let table: Vec<u32> = linear_table(blocks).into_iter().rev().collect();

    let mut batch_pool = KvPool::new(model.config(), blocks, 16).unwrap();
    let batched = model
        .forward_one(&mut batch_pool, prompt, 0, &table, LogitsWanted::All)
        .unwrap();
    let mut pool = KvPool::new(model.config(), blocks, 16).unwrap();
    let (mut worst_step, mut worst_batch) = (0f32, 0f32);
    let mut ours_last = Vec::new();
    let mut theirs_last = Vec::new();
    for (pos, &tok) in prompt.iter().enumerate() {
        let theirs = reference.step(tok, pos);
        let ours = model
            .forward_one(&mut pool, &[tok], pos, &table, LogitsWanted::Last)
            .unwrap()
            .remove(0);
        let scale = theirs.iter().fold(1f32, |m, x| m.max(x.abs()));
        let d_step = max_abs_diff(&ours, &theirs) / scale;
        let d_batch = max_abs_diff(&batched[pos], &theirs) / scale;
        worst_step = worst_step.max(d_step);
        worst_batch = worst_batch.max(d_batch);
        let name = path.display();
        assert!(
            d_step <= tol_step,
            "{name}: position {pos}: stepwise diff {d_step} > {tol_step}"
        );
        assert!(
            d_batch <= tol_batch,
            "{name}: position {pos}: batched diff {d_batch} > {tol_batch}"
        );
        ours_last = ours;
        theirs_last = theirs;
    }
    eprintln!(
        "{}: worst relative logit diff: stepwise {worst_step:e}, batched prefill {worst_batch:e}",
        path.display()
    );

    // Greedy: each side continues from its own logits.
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..gen {
        let (ta, tb) = (argmax(&ours_last), argmax(&theirs_last));
        a.push(ta);
        b.push(tb);
        let pos = prompt.len() + i;
        ours_last = model
            .forward_one(&mut pool, &[ta], pos, &table, LogitsWanted::Last)
            .unwrap()
            .remove(0);
        theirs_last = reference.step(tb, pos);
    }
    if greedy {
        assert_eq!(a, b, "{}: greedy tokens differ", path.display());
    }
}

fn tiny_file(spec: &TinySpec, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specgate-diff-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    spec.write_gguf(&path, &[]).unwrap();
    path
}

const TINY_PROMPT: [u32; 11] = [1, 17, 300, 42, 42, 5, 99, 250, 7, 383, 0];

/// The tiny-model check, as [`compare_real`] does it: to float rounding
/// with weights dequantized on both sides (64 greedy tokens equal), loosely
/// with them quantized (our kernels and candle's round activations
/// differently: Q4_1 here). Holds the `REAL` lock because
/// CANDLE_DEQUANTIZE_ALL is process-wide: a test running beside a
/// dequantized one would otherwise see either mode by chance.
fn compare_tiny(spec: &TinySpec, name: &str) {
    let path = tiny_file(spec, name);
    let _guard = REAL.lock().unwrap_or_else(|e| e.into_inner());
    let p2 = path.clone();
    dequantized(move || compare(&p2, &TINY_PROMPT, 64, 1e-4, 2e-3, true));
    compare(&path, &TINY_PROMPT, 0, 1e-1, 1e-1, false);
}

#[test]
fn tiny_llama_matches_candle_reference() {
    compare_tiny(&TinySpec::llama(1), "llama.gguf");
}

#[test]
fn tiny_qwen2_matches_candle_reference() {
    compare_tiny(&TinySpec::qwen2(2), "qwen2.gguf");
}

#[test]
fn tiny_safetensors_equals_f32_gguf_of_same_weights() {
    for spec in [TinySpec::llama(3), TinySpec::qwen2(4)] {
        let spec = TinySpec {
            dtype: candle_core::quantized::GgmlDType::F32,
            ..spec
        };
        let dir =
            std::env::temp_dir().join(format!("specgate-st-{}-{}", std::process::id(), spec.seed));
        spec.write_safetensors(&dir).unwrap();
        let gguf = dir.join("m.gguf");
        spec.write_gguf(&gguf, &[]).unwrap();
        let st = specgate_verify::model::load_safetensors(&dir).unwrap();
        let gg = load_gguf(&gguf).unwrap();
        assert_eq!(st.config().arch, gg.config().arch);
        let run = |m: &Model| {
            let mut pool = KvPool::new(m.config(), 2, 16).unwrap();
            m.forward_one(&mut pool, &TINY_PROMPT, 0, &[0, 1], LogitsWanted::All)
                .unwrap()
        };
        let (a, b) = (run(&st), run(&gg));
        for (x, y) in a.iter().zip(&b) {
            assert!(max_abs_diff(x, y) < 1e-3, "safetensors vs gguf differ");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn mixed_batch_equals_each_sequence_alone() {
    let path = tiny_file(&TinySpec::qwen2(5), "batch.gguf");
    let model = load_gguf(&path).unwrap();
    // Three sequences: a fresh prefill, a decode at a later position, and a
    // 4-row verification-style chunk, each with its own scattered blocks.
    let prompts: [&[u32]; 3] = [
        &[3, 4, 5, 6, 7, 8, 9],
        &[
            10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28,
        ],
        &[30, 31, 32, 33, 34],
    ];
    let tables: [Vec<u32>; 3] = [vec![7, 2], vec![0, 5, 9], vec![4, 1]];
    let news: [&[u32]; 3] = [&[40, 41], &[50], &[60, 61, 62, 63]];

    // Alone: each sequence in its own pool.
    let mut alone = Vec::new();
    for i in 0..3 {
        let mut pool = KvPool::new(model.config(), 10, 16).unwrap();
        model
            .forward_one(&mut pool, prompts[i], 0, &tables[i], LogitsWanted::None)
            .unwrap();
        alone.push(
            model
                .forward_one(
                    &mut pool,
                    news[i],
                    prompts[i].len(),
                    &tables[i],
                    LogitsWanted::All,
                )
                .unwrap(),
        );
    }

    // Together: prompts as one batch of prefills, then all new rows at once.
    let mut pool = KvPool::new(model.config(), 10, 16).unwrap();
    let seqs: Vec<_> = (0..3)
        .map(|i| specgate_verify::SeqInput {
            tokens: prompts[i],
            start_pos: 0,
            block_table: &tables[i],
            logits: LogitsWanted::None,
            state_slot: 0,
        })
        .collect();
    assert_eq!(model.forward(&mut pool, &seqs).unwrap().dims(), &[0, 384]);
    let seqs: Vec<_> = (0..3)
        .map(|i| specgate_verify::SeqInput {
            tokens: news[i],
            start_pos: prompts[i].len(),
            block_table: &tables[i],
            logits: LogitsWanted::All,
            state_slot: 0,
        })
        .collect();
    let together = model
        .forward(&mut pool, &seqs)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let alone: Vec<Vec<f32>> = alone.into_iter().flatten().collect();
    assert_eq!(together.len(), alone.len());
    for (a, b) in together.iter().zip(&alone) {
        assert!(
            max_abs_diff(a, b) < 1e-4,
            "batched logits differ: {}",
            max_abs_diff(a, b)
        );
    }
}

#[test]
fn chunked_prefill_equals_whole_prefill() {
    let path = tiny_file(&TinySpec::llama(6), "chunk.gguf");
    let model = load_gguf(&path).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 384) as u32).collect();
    let table = [3u32, 0, 2];
    let mut pool = KvPool::new(model.config(), 4, 16).unwrap();
    let whole = model
        .forward_one(&mut pool, &prompt, 0, &table, LogitsWanted::Last)
        .unwrap();
    let mut pool = KvPool::new(model.config(), 4, 16).unwrap();
    model
        .forward_one(&mut pool, &prompt[..13], 0, &table, LogitsWanted::None)
        .unwrap();
    model
        .forward_one(&mut pool, &prompt[13..29], 13, &table, LogitsWanted::None)
        .unwrap();
    let chunked = model
        .forward_one(&mut pool, &prompt[29..], 29, &table, LogitsWanted::Last)
        .unwrap();
    assert!(max_abs_diff(&whole[0], &chunked[0]) < 1e-4);
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let path = tiny_file(&TinySpec::llama(8), "bad.gguf");
    let model = load_gguf(&path).unwrap();
    let mut pool = KvPool::new(model.config(), 2, 16).unwrap();
    let err = |r: Result<Vec<Vec<f32>>, specgate_verify::VerifyError>| r.unwrap_err().to_string();
    assert!(
        err(model.forward_one(&mut pool, &[999], 0, &[0], LogitsWanted::Last))
            .contains("vocabulary")
    );
    assert!(
        err(model.forward_one(&mut pool, &[1; 20], 0, &[0], LogitsWanted::Last))
            .contains("block table")
    );
    assert!(
        err(model.forward_one(&mut pool, &[1], 0, &[5], LogitsWanted::Last))
            .contains("outside a pool")
    );
    assert!(
        err(model.forward_one(&mut pool, &[], 0, &[0], LogitsWanted::Last)).contains("no tokens")
    );
    assert!(
        err(model.forward_one(&mut pool, &[1], 5000, &[0], LogitsWanted::Last)).contains("beyond")
    );
    let other = load_gguf(&tiny_file(
        &TinySpec {
            num_layers: 3,
            ..TinySpec::llama(9)
        },
        "other.gguf",
    ))
    .unwrap();
    let mut other_pool = KvPool::new(other.config(), 2, 16).unwrap();
    assert!(
        err(model.forward_one(&mut other_pool, &[1], 0, &[0], LogitsWanted::Last))
            .contains("different model")
    );
}

#[test]
fn unknown_architecture_and_missing_tensor_are_named() {
    use gguf_file::Value as V;
    let dir = std::env::temp_dir().join(format!("specgate-badload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("gpt.gguf");
    let mut f = std::fs::File::create(&p).unwrap();
    let arch = V::String("gptj".into());
    gguf_file::write(&mut f, &[("general.architecture", &arch)], &[]).unwrap();
    drop(f);
    let e = load_gguf(&p).err().unwrap().to_string();
    assert!(e.contains("gptj"), "{e}");

    // A safetensors model with one tensor dropped.
    let spec = TinySpec::llama(10);
    let st = dir.join("st");
    spec.write_safetensors(&st).unwrap();
    let mut tensors =
        candle_core::safetensors::load(st.join("model.safetensors"), &Device::Cpu).unwrap();
    tensors.remove("model.layers.1.mlp.up_proj.weight");
    candle_core::safetensors::save(&tensors, st.join("model.safetensors")).unwrap();
    let e = specgate_verify::model::load_safetensors(&st)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("model.layers.1.mlp.up_proj.weight"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

// ---- real weights, when scripts/fetch-models.sh has run ----

/// Real models load several GiB each (more when dequantized): one at a time.
static REAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `f` with candle's CANDLE_DEQUANTIZE_ALL set, in a fresh thread
/// (candle caches that variable per thread on first use).
fn dequantized<F: FnOnce() + Send + 'static>(f: F) {
    std::thread::spawn(move || {
        std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
        f();
        std::env::remove_var("CANDLE_DEQUANTIZE_ALL");
    })
    .join()
    .unwrap();
}

/// The real-model check. With weights dequantized to f32 on both sides the
/// forward must agree with the reference to float rounding at every
/// position (whole-prompt prefill and token by token) and emit the same 64
/// greedy tokens. With weights kept quantized, candle rounds activations to
/// 8 bits per row before each matmul; an ulp of difference in attention
/// (our paged loop vs the reference's dense matmul) flips some of those
/// roundings and the effect compounds over the layers: we measured up to
/// ~3.5% of the largest logit (about the distance of either side from the
/// f32 model), so there logits must agree within 10% and greedy paths may
/// part at a near-tie.
fn compare_real(name: &str, prompt: &'static [u32]) {
    let Some(p) = real_model(name) else { return };
    let _guard = REAL.lock().unwrap_or_else(|e| e.into_inner());
    let p2 = p.clone();
    dequantized(move || compare(&p2, prompt, 64, 1e-4, 1e-4, true));
    compare(&p, prompt, 0, 1e-1, 1e-1, false);
}

/// "def fibonacci(n):\n    return n if n < 2 else fibonacci(n-1) + fibonacci(n-2)\n"
const QWEN_PROMPT: [u32; 24] = [
    750, 75698, 1445, 982, 262, 470, 308, 421, 308, 366, 220, 17, 770, 75698, 1445, 12, 16, 8, 488,
    75698, 1445, 12, 17, 340,
];

/// SmolLM2 ids of "Hello, world!" and of the same fibonacci line.
const SMOL_PROMPT: [u32; 12] = [19556, 28, 905, 17, 216, 1116, 4541, 30, 94, 46, 2730, 198];

#[test]
fn real_qwen_coder_0_5b_matches_reference() {
    compare_real("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", &QWEN_PROMPT);
}

#[test]
fn real_qwen_coder_1_5b_matches_reference() {
    compare_real("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", &QWEN_PROMPT);
}

#[test]
fn real_smollm2_matches_reference() {
    compare_real("smollm2-135m-instruct-q4_1.gguf", &SMOL_PROMPT);
}

/// A restricted output head gives the kept tokens' logits (to float
/// rounding: a dense f32 head goes through candle's gemm, whose blocking
/// depends on the matrix size; quantized heads through our kernels are
/// exact) and -inf for every other token, for one row and for several.
#[test]
fn restricted_head_keeps_logits_of_kept_tokens_exactly() {
    for (spec, name) in [
        (TinySpec::llama(5), "head-llama.gguf"),
        (TinySpec::qwen2(6), "head-qwen2.gguf"),
    ] {
        let path = tiny_file(&spec, name);
        let full = load_gguf(&path).unwrap();
        let mut cut = load_gguf(&path).unwrap();
        let keep: Vec<u32> = (0..spec.vocab_size as u32).rev().step_by(3).collect();
        cut.restrict_head(&keep).unwrap();
        assert_eq!(cut.head_tokens(), Some(keep.as_slice()));
        assert!(cut.weight_bytes_per_step() < full.weight_bytes_per_step());
        let cfg = full.config().clone();
        let table = linear_table(4);
        for prompt in [&TINY_PROMPT[..1], &TINY_PROMPT[..6]] {
            let mut p1 = KvPool::new(&cfg, 4, 16).unwrap();
            let mut p2 = KvPool::new(&cfg, 4, 16).unwrap();
            let a = full
                .forward_one(&mut p1, prompt, 0, &table, LogitsWanted::All)
                .unwrap();
            let b = cut
                .forward_one(&mut p2, prompt, 0, &table, LogitsWanted::All)
                .unwrap();
            for (ra, rb) in a.iter().zip(&b) {
                let scale = ra.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (t, (&x, &y)) in ra.iter().zip(rb).enumerate() {
                    if keep.contains(&(t as u32)) {
                        assert!(
                            (x - y).abs() <= 1e-5 * scale,
                            "{name}: token {t}: {x} vs {y}"
                        );
                    } else {
                        assert_eq!(y, f32::NEG_INFINITY, "{name}: token {t}");
                    }
                }
            }
        }
        let mut bad = load_gguf(&path).unwrap();
        assert!(bad.restrict_head(&[1, 1]).is_err());
        assert!(bad.restrict_head(&[spec.vocab_size as u32]).is_err());
        assert!(bad.restrict_head(&[]).is_err());
        bad.restrict_head(&[3]).unwrap();
        assert!(bad.restrict_head(&[3]).is_err());
    }
}
