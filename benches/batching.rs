//! The continuous-batching engine on the real Qwen2.5-Coder-1.5B target:
//! generated tokens/s, requests/s, time to first token and inter-token
//! latency (median, p99) at concurrency 1, 4, 16 and 32, with speculation
//! off, n-gram lookup and the 0.5B draft model. Closed loop: each of c
//! clients sends 2 requests one after the other.
//!
//! Run: `cargo bench --bench batching` (models from scripts/fetch-models.sh).
//! `SPECGATE_BENCH_CONC=1,16` picks concurrencies,
//! `SPECGATE_BENCH_MODES=off,ngram,draft,draft-table,goodput` the settings
//! (draft-table: the draft model with k = 3, 2, 1 at batch 1, 2, <= 4 and no
//! drafting above; goodput: the draft model under the default policy,
//! `[speculative]`'s defaults, without the cross-request pool, which these
//! repeated prompts would feed).

// The workspace's one models-directory lookup (SPECGATE_MODELS_DIR, else
// models/ in the workspace root), shared with the tests.
#[path = "../tests/common/models.rs"]
mod models;

use models::models_dir;
use specgate::engine::scheduler::SchedulerConfig;
use specgate::engine::{spawn, EngineConfig, Event, GenRequest, KvSize, ProposerKind};
use specgate::generate::load_tokenizer;
use specgate::tokenizer::ChatMessage;
use specgate_draft::DraftPolicy;
use specgate_verify::model::load_gguf;
use specgate_verify::SamplingParams;
use std::time::Instant;

const PROMPTS: [&str; 8] = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Implement binary search in Rust.",
    "Explain what a mutex is in two sentences.",
    "Write a SQL query that lists the ten customers with the highest total order value.",
    "Write a bash one-liner that counts lines in all .rs files under the current directory.",
    "Rename the variable `x` to `count` and return the whole code:\n\ndef tally(items):\n    x = 0\n    for item in items:\n        if item:\n            x += 1\n    return x\n",
    "Write a JavaScript function that debounces another function.",
    "Write a C function that reverses a string in place.",
];
const MAX_NEW: usize = 64;
const PER_CLIENT: usize = 2;

#[derive(Default)]
struct Sample {
    ttft: f64,
    itl: Vec<f64>,
    tokens: usize,
}

fn pct(xs: &mut [f64], p: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let i = ((xs.len() - 1) as f64 * p).round() as usize;
    xs[i]
}

fn main() {
    let dir = models_dir();
    let (tp, dp) = (
        dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    );
    if !tp.exists() || !dp.exists() {
        println!(
            "the Qwen2.5-Coder pair is not in {}: run scripts/fetch-models.sh",
            dir.display()
        );
        return;
    }
    let list = |var: &str, default: &str| -> Vec<String> {
        std::env::var(var)
            .unwrap_or_else(|_| default.into())
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    };
    let concs: Vec<usize> = list("SPECGATE_BENCH_CONC", "1,4,16,32")
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    let modes = list(
        "SPECGATE_BENCH_MODES",
        "off,ngram,draft,draft-table,goodput",
    );
    let tok = load_tokenizer(&tp).unwrap();
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|t| {
            let chat = tok
                .apply_chat_template(&[ChatMessage::new("user", *t)], true)
                .unwrap();
            tok.encode(&chat, false).unwrap()
        })
        .collect();

    println!("| speculation | concurrency | requests | output tok/s | req/s | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) | acceptance |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for mode in &modes {
        let target = load_gguf(&tp).unwrap();
        target.warm_up().unwrap();
        // "-table": the per-batch-size policy that stops drafting under load.
        let table = DraftPolicy::BatchTable(vec![(1, 3), (2, 2), (4, 1)]);
        let draft = || {
            let d = load_gguf(&dp).unwrap();
            d.warm_up().unwrap();
            ProposerKind::Draft(d)
        };
        let (proposer, policy) = match mode.as_str() {
            "off" => (ProposerKind::None, DraftPolicy::Fixed { k: 0 }),
            "ngram" => (
                ProposerKind::Ngram { min_n: 1, max_n: 4 },
                DraftPolicy::Fixed { k: 2 },
            ),
            "draft" => (draft(), DraftPolicy::Fixed { k: 3 }),
            "draft-table" => (draft(), table),
            "goodput" => (
                draft(),
                specgate::config::SpeculativeConfig::default()
                    .policy()
                    .unwrap(),
            ),
            other => panic!("unknown mode {other}"),
        };
        let cfg = EngineConfig {
            kv: KvSize::Blocks(640),
            block_size: 16,
            scheduler: SchedulerConfig {
                max_num_seqs: 32,
                max_num_batched_tokens: 512,
            },
            policy,
            suffix: None,
            tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
            prefix: Default::default(),
            row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
        };
        let (h, _join) = spawn(target, proposer, None, cfg).unwrap();
        for &c in &concs {
            let before = h.stats();
            let t0 = Instant::now();
            let samples: Vec<Sample> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..c)
                    .map(|client| {
                        let h = h.clone();
                        let prompts = &prompts;
                        s.spawn(move || {
                            (0..PER_CLIENT)
                                .map(|r| {
                                    let req = GenRequest {
                                        prompt: prompts[(client + r) % prompts.len()].clone(),
                                        max_new_tokens: MAX_NEW,
                                        sampling: SamplingParams::default(),
                                        stop_token_ids: vec![],
                                        ignore_eos: true,
                                        method: None,
                                        num_speculative_tokens: None,
                                        ..Default::default()
                                    };
                                    let start = Instant::now();
                                    let mut rx = h.submit(req).unwrap();
                                    let mut sample = Sample::default();
                                    let mut last = start;
                                    while let Some(ev) = rx.blocking_recv() {
                                        match ev {
                                            Event::Tokens { ids, .. } => {
                                                let now = Instant::now();
                                                if sample.tokens == 0 {
                                                    sample.ttft = (now - start).as_secs_f64();
                                                } else {
                                                    // Tokens of one step arrive together: spread the gap.
                                                    let gap = (now - last).as_secs_f64()
                                                        / ids.len() as f64;
                                                    sample.itl.extend(std::iter::repeat_n(
                                                        gap,
                                                        ids.len(),
                                                    ));
                                                }
                                                sample.tokens += ids.len();
                                                last = now;
                                            }
                                            Event::PromptLogprobs(_) => {}
                                            Event::Finished { .. } => break,
                                            Event::Error(e) => panic!("{e}"),
                                        }
                                    }
                                    sample
                                })
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|j| j.join().unwrap())
                    .collect()
            });
            let wall = t0.elapsed().as_secs_f64();
            let after = h.stats();
            let tokens: usize = samples.iter().map(|s| s.tokens).sum();
            let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft).collect();
            let mut itl: Vec<f64> = samples.iter().flat_map(|s| s.itl.iter().copied()).collect();
            let drafted = after.spec.draft_tokens - before.spec.draft_tokens;
            let accepted = after.spec.accepted_tokens - before.spec.accepted_tokens;
            println!(
                "| {mode} | {c} | {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} | {} |",
                samples.len(),
                tokens as f64 / wall,
                samples.len() as f64 / wall,
                pct(&mut ttft, 0.5),
                pct(&mut ttft, 0.99),
                1e3 * pct(&mut itl, 0.5),
                1e3 * pct(&mut itl, 0.99),
                if drafted > 0 {
                    format!("{:.0}%", 100.0 * accepted as f64 / drafted as f64)
                } else {
                    "-".into()
                }
            );
        }
        h.shutdown();
    }
}
