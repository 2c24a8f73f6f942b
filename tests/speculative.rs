//! Speculative decoding emits exactly what plain decoding emits (greedy),
//! for both proposers and k = 1..8, on tiny generated models always and on
//! the real Qwen2.5-Coder 0.5B -> 1.5B pair when `models/` holds it.

mod common;

use candle_core::quantized::GgmlDType;
use common::{real_model, spec_decode, tiny_gguf, tiny_model};
use specgate::spec::SpecStats;
use specgate::tokenizer::{ChatMessage, TextTokenizer};
use specgate_draft::{ModelDraft, NgramProposer, Proposer};
use specgate_verify::model::{load_gguf, load_gguf_tp};
use specgate_verify::tiny::TinySpec;
use specgate_verify::{Model, SamplingParams};
use std::path::Path;
use std::sync::Arc;

const BS: usize = 16;

/// Greedy-decodes `max_new` tokens after `prompt` with fixed k (0 = plain).
fn decode<P: Proposer>(
    target: &Model,
    proposer: Option<&mut P>,
    prompt: &[u32],
    max_new: usize,
    k: usize,
    stats: &mut SpecStats,
) -> Vec<u32> {
    decode_with(
        target,
        proposer,
        prompt,
        max_new,
        k,
        SamplingParams::default(),
        stats,
    )
}

fn decode_with<P: Proposer>(
    target: &Model,
    proposer: Option<&mut P>,
    prompt: &[u32],
    max_new: usize,
    k: usize,
    sampling: SamplingParams,
    stats: &mut SpecStats,
) -> Vec<u32> {
    let proposer = proposer.map(|p| p as &mut dyn Proposer);
    spec_decode(target, proposer, prompt, max_new, k, sampling, stats)
}

/// A tensor-parallel target (2 ranks) speculates exactly as the unsharded
/// target decodes: with an n-gram proposer and with an unsharded draft.
#[test]
fn tp2_target_speculation_equals_unsharded_plain_decoding() {
    // Q8_0: 32-value blocks, so 2 of 4 heads (128 columns) cut cleanly.
    let spec = TinySpec {
        dtype: GgmlDType::Q8_0,
        ..TinySpec::qwen2(21)
    };
    let p = tiny_gguf(&spec, "tp-target.gguf", &[]);
    let unsharded = load_gguf(&p).unwrap();
    let sharded = load_gguf_tp(&p, 2).unwrap();
    assert_eq!(sharded.world_size(), 2);
    let draft = Arc::new(tiny_model(&TinySpec::qwen2(21), "tp-draft.gguf"));
    let prompt: Vec<u32> = vec![5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 40, 41];
    let max_new = 32;
    let plain = decode::<NgramProposer>(
        &unsharded,
        None,
        &prompt,
        max_new,
        0,
        &mut SpecStats::default(),
    );
    let tp_plain = decode::<NgramProposer>(
        &sharded,
        None,
        &prompt,
        max_new,
        0,
        &mut SpecStats::default(),
    );
    assert_eq!(tp_plain, plain, "TP=2 plain decoding");
    let mut accepted = 0;
    for k in [1, 3, 5] {
        let mut ngram = NgramProposer::new(1, 3).unwrap();
        let got = decode(
            &sharded,
            Some(&mut ngram),
            &prompt,
            max_new,
            k,
            &mut SpecStats::default(),
        );
        assert_eq!(got, plain, "TP=2 ngram k={k}");
        let mut d = ModelDraft::new(draft.clone(), 8, BS).unwrap();
        let mut s = SpecStats::default();
        let got = decode(&sharded, Some(&mut d), &prompt, max_new, k, &mut s);
        assert_eq!(got, plain, "TP=2 draft k={k}");
        accepted += s.accepted_tokens;
    }
    assert!(accepted > 0, "the draft never had a token accepted");
}

#[test]
fn tiny_greedy_speculation_equals_plain_decoding() {
    // Q6_K target: the format whose single-row kernel differs from its
    // multi-row one, so batch invariance is exercised.
    let target = tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q6K,
            ..TinySpec::qwen2(11)
        },
        "t.gguf",
    );
    // A close draft (same weights, coarser format) accepts often; an
    // unrelated one rarely. Both must leave the output unchanged.
    let close = Arc::new(tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q4K,
            ..TinySpec::qwen2(11)
        },
        "d1.gguf",
    ));
    let far = Arc::new(tiny_model(&TinySpec::qwen2(12), "d2.gguf"));
    // The close draft with its head restricted to two thirds of the
    // vocabulary: tokens outside are never proposed, output unchanged.
    let mut cut = tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q4K,
            ..TinySpec::qwen2(11)
        },
        "d3.gguf",
    );
    let keep: Vec<u32> = (0..384u32).filter(|t| t % 3 != 1).collect();
    cut.restrict_head(&keep).unwrap();
    let cut = Arc::new(cut);
    // Repetitive prompts so n-gram lookup finds matches.
    let prompts: [Vec<u32>; 3] = [
        vec![5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
        (0..30).map(|i| (i * 13 % 384) as u32).collect(),
        vec![100, 101, 102, 103, 104, 100, 101, 102],
    ];
    let max_new = 40;
    let mut accepted_any = 0;
    for prompt in &prompts {
        let plain =
            decode::<NgramProposer>(&target, None, prompt, max_new, 0, &mut SpecStats::default());
        for k in 1..=8 {
            let mut ngram = NgramProposer::new(1, 3).unwrap();
            let mut stats = SpecStats::default();
            let got = decode(&target, Some(&mut ngram), prompt, max_new, k, &mut stats);
            assert_eq!(got, plain, "ngram k={k} prompt {prompt:?}");
            for draft in [&close, &far, &cut] {
                let mut d = ModelDraft::new(draft.clone(), 8, BS).unwrap();
                let mut s = SpecStats::default();
                let got = decode(&target, Some(&mut d), prompt, max_new, k, &mut s);
                assert_eq!(got, plain, "draft k={k} prompt {prompt:?}");
                accepted_any += s.accepted_tokens;
                assert!(s.mean_accepted_length() >= 1.0);
            }
        }
    }
    assert!(
        accepted_any > 0,
        "the close draft never had a token accepted"
    );
}

#[test]
fn seeded_sampling_with_speculation_is_reproducible() {
    let target = tiny_model(
        &TinySpec {
            logit_scale: 1.0,
            ..TinySpec::llama(13)
        },
        "rt.gguf",
    );
    let draft = Arc::new(tiny_model(
        &TinySpec {
            logit_scale: 1.0,
            ..TinySpec::llama(14)
        },
        "rd.gguf",
    ));
    let prompt: Vec<u32> = vec![9, 8, 7, 9, 8, 7, 9];
    let sampling = |seed| SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.95,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let run = |seed: u64, use_draft: bool| {
        let mut s = SpecStats::default();
        if use_draft {
            let mut d = ModelDraft::new(draft.clone(), 8, BS).unwrap();
            decode_with(
                &target,
                Some(&mut d),
                &prompt,
                30,
                3,
                sampling(seed),
                &mut s,
            )
        } else {
            let mut n = NgramProposer::new(1, 3).unwrap();
            decode_with(
                &target,
                Some(&mut n),
                &prompt,
                30,
                3,
                sampling(seed),
                &mut s,
            )
        }
    };
    for use_draft in [true, false] {
        assert_eq!(
            run(5, use_draft),
            run(5, use_draft),
            "same seed, same output"
        );
        assert_ne!(
            run(5, use_draft),
            run(6, use_draft),
            "another seed, another output"
        );
    }
}

// ---- the real pair ----

const PROMPTS: [&str; 8] = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Implement binary search in Rust.",
    "Explain what a mutex is in two sentences.",
    "Write a SQL query that lists the ten customers with the highest total order value.",
    "Write a bash one-liner that counts lines in all .rs files under the current directory.",
    "Rename the variable `x` to `count` in this code and return the whole code:\n\ndef tally(items):\n    x = 0\n    for item in items:\n        if item:\n            x += 1\n    return x\n\nprint(tally([1, 0, 2, 0, 3]))\n",
    "Add type hints to this function and return the whole code:\n\ndef merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Write a JavaScript function that debounces another function.",
];

#[test]
fn real_pair_greedy_speculation_equals_plain_decoding() {
    let (Some(tp), Some(dp)) = (
        real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        real_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    ) else {
        return;
    };
    let target = load_gguf(&tp).unwrap();
    let draft = Arc::new(load_gguf(&dp).unwrap());
    // The draft with the shipped reduced head (configs/), on one prompt.
    let head_list = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/draft-head-qwen2.5.txt");
    let mut cut = load_gguf(&dp).unwrap();
    cut.restrict_head(&specgate_verify::model::read_token_list(&head_list).unwrap())
        .unwrap();
    let cut = Arc::new(cut);
    let tok = TextTokenizer::from_gguf_file(&tp).unwrap();
    let max_new = 128;
    let (mut ng_stats, mut d_stats) = (SpecStats::default(), SpecStats::default());
    for (i, text) in PROMPTS.iter().enumerate() {
        let chat = tok
            .apply_chat_template(&[ChatMessage::new("user", *text)], true)
            .unwrap();
        let prompt = tok.encode(&chat, false).unwrap();
        let plain = decode::<NgramProposer>(
            &target,
            None,
            &prompt,
            max_new,
            0,
            &mut SpecStats::default(),
        );
        // Spread k over 1..8 across prompts to bound the test's time.
        let (k_ng, k_d) = (1 + i % 8, 8 - i % 8);
        let mut ngram = NgramProposer::new(1, 4).unwrap();
        let got = decode(
            &target,
            Some(&mut ngram),
            &prompt,
            max_new,
            k_ng,
            &mut ng_stats,
        );
        assert_eq!(got, plain, "ngram k={k_ng}, prompt {i}");
        let blocks = (prompt.len() + max_new + 9).div_ceil(BS);
        let mut d = ModelDraft::new(draft.clone(), blocks, BS).unwrap();
        d.check_compatible(target.config()).unwrap();
        let got = decode(&target, Some(&mut d), &prompt, max_new, k_d, &mut d_stats);
        assert_eq!(got, plain, "draft k={k_d}, prompt {i}");
        if i == 0 {
            let mut d = ModelDraft::new(cut.clone(), blocks, BS).unwrap();
            let got = decode(&target, Some(&mut d), &prompt, max_new, 4, &mut d_stats);
            assert_eq!(got, plain, "reduced-head draft, prompt {i}");
        }
    }
    eprintln!(
        "real pair: ngram acceptance {:.2}, mean length {:.2}; draft acceptance {:.2}, mean length {:.2}",
        ng_stats.acceptance_rate(),
        ng_stats.mean_accepted_length(),
        d_stats.acceptance_rate(),
        d_stats.mean_accepted_length()
    );
    assert!(
        d_stats.acceptance_rate() > 0.3,
        "the 0.5B draft should mostly agree with the 1.5B"
    );
}
