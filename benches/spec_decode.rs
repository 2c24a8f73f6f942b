//! Speculative decoding on the real Qwen2.5-Coder 0.5B -> 1.5B pair:
//! decode tokens/s without speculation vs n-gram lookup vs the draft model,
//! for k = 1..8, at temperature 0 and 0.7, on a code-completion and a
//! code-editing prompt set, with acceptance rate and mean accepted length;
//! plus the measured cost of one draft step and of a verify pass of k + 1
//! rows, which explain which k wins.
//!
//! Run: `cargo bench --bench spec_decode` (models from scripts/fetch-models.sh).
//! `SPECGATE_BENCH_KS=1,2,4` limits the fixed k values (empty: adaptive
//! only), `SPECGATE_BENCH_TOKENS` sets tokens per prompt (default 64).

// The workspace's one models-directory lookup (SPECGATE_MODELS_DIR, else
// models/ in the workspace root), shared with the tests.
#[path = "../tests/common/models.rs"]
mod models;

use models::models_dir;
use specgate::generate::{blocks_needed, generate, load_tokenizer, GenerateArgs};
use specgate::tokenizer::ChatMessage;
use specgate_draft::{ModelDraft, NgramProposer, Proposer};
use specgate_verify::kv_pool::DEFAULT_BLOCK_SIZE;
use specgate_verify::model::load_gguf;
use specgate_verify::{KvPool, LogitsWanted, Model, SamplingParams};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

const COMPLETION: [&str; 3] = [
    "Complete this Python module:\n\nimport heapq\n\ndef dijkstra(graph, source):\n    \"\"\"Shortest distances from source in a weighted graph given as {node: [(neighbor, weight)]}.\"\"\"\n",
    "Write a Rust function `fn parse_kv(line: &str) -> Option<(String, String)>` that splits `key=value`, trimming whitespace, and unit tests for it.",
    "Write a C function that reverses a singly linked list in place, with the struct definition.",
];

const EDITING: [&str; 3] = [
    "Rename the function `calc` to `compute_total` everywhere and return the whole file unchanged otherwise:\n\n```python\ndef calc(items, tax):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * item.quantity\n    return subtotal * (1 + tax)\n\n\ndef report(orders, tax):\n    lines = []\n    for order in orders:\n        lines.append(f\"{order.id}: {calc(order.items, tax):.2f}\")\n    return \"\\n\".join(lines)\n```",
    "Add a docstring to each function and return the whole code:\n\n```python\ndef mean(xs):\n    return sum(xs) / len(xs)\n\n\ndef variance(xs):\n    m = mean(xs)\n    return sum((x - m) ** 2 for x in xs) / len(xs)\n\n\ndef stddev(xs):\n    return variance(xs) ** 0.5\n```",
    "Convert this JavaScript to TypeScript with explicit types and return the whole code:\n\n```js\nfunction groupBy(items, key) {\n  const out = {};\n  for (const item of items) {\n    const k = item[key];\n    if (!out[k]) out[k] = [];\n    out[k].push(item);\n  }\n  return out;\n}\n```",
];

struct Run {
    tok_s: f64,
    acceptance: f64,
    mean_len: f64,
}

/// One speculation setting: which proposer, how many drafts.
struct Setting<'a> {
    draft: Option<&'a Arc<Model>>,
    ngram: bool,
    k: usize,
    adaptive: bool,
}

fn run_set(
    target: &Model,
    set: &Setting,
    temperature: f32,
    prompts: &[Vec<u32>],
    tokens: usize,
) -> Run {
    let Setting {
        draft,
        ngram,
        k,
        adaptive,
    } = *set;
    let (mut n, mut secs, mut acc, mut drafted, mut emitted, mut rounds) = (0, 0.0, 0, 0, 0, 0);
    for (i, prompt) in prompts.iter().enumerate() {
        let args = GenerateArgs {
            model: PathBuf::new(),
            prompt: String::new(),
            chat: true,
            max_tokens: tokens,
            temperature,
            top_p: 1.0,
            top_k: 0,
            seed: Some(i as u64),
            ignore_eos: true,
            draft: None,
            draft_head_tokens: None,
            ngram,
            ngram_min: 1,
            ngram_max: 4,
            num_speculative_tokens: k,
            adaptive,
            tensor_parallel_size: 1,
            kv_latent_dtype: specgate::config::LatentDtype::Auto,
        };
        let sampling = SamplingParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            seed: Some(i as u64),
            ..SamplingParams::default()
        };
        let tok = TOK.with(|t| t.clone());
        let mut proposer: Option<Box<dyn Proposer>> = match (draft, ngram) {
            (Some(d), _) if k > 0 => Some(Box::new(
                ModelDraft::new(
                    d.clone(),
                    blocks_needed(prompt.len(), &args),
                    DEFAULT_BLOCK_SIZE,
                )
                .unwrap(),
            )),
            (None, true) if k > 0 => Some(Box::new(NgramProposer::new(1, 4).unwrap())),
            _ => None,
        };
        let stats = generate(
            target,
            proposer.as_deref_mut(),
            &tok,
            prompt,
            &args,
            sampling,
            &mut |_| Ok(()),
        )
        .unwrap();
        n += stats.decode_tokens;
        secs += stats.decode_secs;
        acc += stats.spec.accepted_tokens;
        drafted += stats.spec.draft_tokens;
        emitted += stats.spec.emitted_tokens;
        rounds += stats.spec.rounds;
    }
    Run {
        tok_s: n as f64 / secs,
        acceptance: if drafted > 0 {
            acc as f64 / drafted as f64
        } else {
            0.0
        },
        mean_len: emitted as f64 / rounds.max(1) as f64,
    }
}

thread_local! {
    static TOK: std::rc::Rc<specgate::tokenizer::TextTokenizer> = {
        let dir = models_dir();
        std::rc::Rc::new(load_tokenizer(&dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")).unwrap())
    };
}

/// Median seconds of `f` over `reps` calls.
fn time_median(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut xs: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    xs.sort_by(f64::total_cmp);
    xs[reps / 2]
}

/// Cost of one forward of `rows` new tokens at a 300-token context.
fn forward_cost(model: &Model, rows: usize) -> f64 {
    let ctx = 300;
    let blocks = (ctx + rows).div_ceil(16);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut pool = KvPool::new(model.config(), blocks, 16).unwrap();
    let prompt: Vec<u32> = (0..ctx as u32).map(|i| (i * 31 + 7) % 20_000).collect();
    model
        .forward_one(&mut pool, &prompt, 0, &table, LogitsWanted::None)
        .unwrap();
    let new: Vec<u32> = (0..rows as u32).map(|i| 100 + i).collect();
    time_median(7, || {
        model
            .forward_one(&mut pool, &new, ctx, &table, LogitsWanted::All)
            .unwrap();
    })
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
    let ks: Vec<usize> = std::env::var("SPECGATE_BENCH_KS")
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|_| (1..=8).collect());
    let tokens: usize = std::env::var("SPECGATE_BENCH_TOKENS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    let target = load_gguf(&tp).unwrap();
    let draft = Arc::new(load_gguf(&dp).unwrap());
    target.warm_up().unwrap();
    draft.warm_up().unwrap();

    println!("## Measured costs (median of 7, 300-token context)\n");
    println!("| rows in one forward | 1.5B target (ms) | 0.5B draft (ms) |");
    println!("|---|---|---|");
    for rows in [1, 2, 3, 5, 9] {
        println!(
            "| {rows} | {:.1} | {:.1} |",
            1e3 * forward_cost(&target, rows),
            1e3 * forward_cost(&draft, rows)
        );
    }

    let encode = |texts: &[&str]| -> Vec<Vec<u32>> {
        TOK.with(|tok| {
            texts
                .iter()
                .map(|t| {
                    let chat = tok
                        .apply_chat_template(&[ChatMessage::new("user", *t)], true)
                        .unwrap();
                    tok.encode(&chat, false).unwrap()
                })
                .collect()
        })
    };
    for (set, texts) in [("code completion", &COMPLETION), ("code editing", &EDITING)] {
        let prompts = encode(texts);
        for temperature in [0.0f32, 0.7] {
            println!(
                "\n## {set}, temperature {temperature} ({} prompts x {tokens} tokens)\n",
                prompts.len()
            );
            println!(
                "| method | k | decode tok/s | vs plain | acceptance | mean accepted length |"
            );
            println!("|---|---|---|---|---|---|");
            let off = Setting {
                draft: None,
                ngram: false,
                k: 0,
                adaptive: false,
            };
            let plain = run_set(&target, &off, temperature, &prompts, tokens);
            println!("| plain | 0 | {:.2} | 1.00x | - | 1.00 |", plain.tok_s);
            for (name, d, ng) in [("n-gram", None, true), ("draft 0.5B", Some(&draft), false)] {
                let fixed = ks.iter().map(|&k| (k, false, k.to_string()));
                let adaptive = std::iter::once((8, true, "adaptive <= 8".to_string()));
                for (k, adaptive, label) in fixed.chain(adaptive) {
                    let set = Setting {
                        draft: d,
                        ngram: ng,
                        k,
                        adaptive,
                    };
                    let r = run_set(&target, &set, temperature, &prompts, tokens);
                    println!(
                        "| {name} | {label} | {:.2} | {:.2}x | {:.1}% | {:.2} |",
                        r.tok_s,
                        r.tok_s / plain.tok_s,
                        100.0 * r.acceptance,
                        r.mean_len
                    );
                }
            }
        }
    }
}
