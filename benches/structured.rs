//! Speculation under a grammar on the real Qwen2.5-Coder pair: JSON-schema
//! requests (the five schemas of tests/common/schemas.rs) through the
//! engine at temperature 0 and 1, with speculation off, n-gram (k = 4) and
//! the 0.5B draft (k = 4), each with jump-forward on and off. Reports output
//! tokens/s over the whole run (prefill included), the acceptance rate of
//! drafted tokens under the grammar, and how many drafts the grammar forced
//! (jump-forward).
//!
//! Run: `cargo bench --bench structured` (models from
//! scripts/fetch-models.sh). `SPECGATE_BENCH_SAMPLES` sets requests per
//! configuration (default 20, spread over the schemas), submitted together;
//! `SPECGATE_BENCH_CONCURRENCY` the engine's max_num_seqs (default 4).

#[path = "../tests/common/models.rs"]
mod models;
#[path = "../tests/common/schemas.rs"]
mod schemas;

use models::models_dir;
use specgate::engine::scheduler::SchedulerConfig;
use specgate::engine::{spawn, EngineConfig, Event, GenRequest, KvSize, ProposerKind};
use specgate::grammar::{GrammarSpec, Grammars};
use specgate::tokenizer::{ChatMessage, TextTokenizer};
use specgate_draft::DraftPolicy;
use specgate_verify::model::load_gguf;
use specgate_verify::SamplingParams;
use std::sync::Arc;
use std::time::Instant;

const TARGET: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";
const DRAFT: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    Off,
    Ngram,
    Draft,
}

struct Outcome {
    tokens: usize,
    secs: f64,
    drafted: u64,
    accepted: u64,
    forced: u64,
}

fn run(
    mode: Mode,
    temperature: f32,
    grammars: &Grammars,
    tok: &Arc<TextTokenizer>,
    n: usize,
    conc: usize,
) -> Outcome {
    let dir = models_dir();
    let proposer = match mode {
        Mode::Off => ProposerKind::None,
        Mode::Ngram => ProposerKind::Ngram { min_n: 1, max_n: 4 },
        Mode::Draft => ProposerKind::Draft(load_gguf(&dir.join(DRAFT)).unwrap()),
    };
    let cfg = EngineConfig {
        kv: KvSize::Blocks(1024),
        block_size: 16,
        scheduler: SchedulerConfig {
            max_num_seqs: conc,
            max_num_batched_tokens: 512,
        },
        policy: DraftPolicy::Fixed { k: 4 },
        suffix: None,
        tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
        prefix: Default::default(),
        row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
    };
    let target = load_gguf(&dir.join(TARGET)).unwrap();
    let (h, _) = spawn(target, proposer, Some(tok.clone()), cfg).unwrap();
    let schemas = schemas::schemas();
    let compiled: Vec<_> = schemas
        .iter()
        .map(|(_, s)| {
            grammars
                .compile(&GrammarSpec::JsonSchema(s.clone()))
                .unwrap()
        })
        .collect();
    let start = Instant::now();
    let rxs: Vec<_> = (0..n)
        .map(|i| {
            let which = i % schemas.len();
            let msgs = [
                ChatMessage::new("system", "Reply with one JSON object."),
                ChatMessage::new("user", schemas[which].0),
            ];
            let chat = tok.apply_chat_template(&msgs, true).unwrap();
            h.submit(GenRequest {
                prompt: tok.encode(&chat, false).unwrap(),
                max_new_tokens: 160,
                sampling: SamplingParams {
                    temperature,
                    seed: Some(i as u64),
                    ..Default::default()
                },
                grammar: Some(compiled[which].clone()),
                ..Default::default()
            })
            .unwrap()
        })
        .collect();
    let mut tokens = 0;
    for mut rx in rxs {
        loop {
            match rx.blocking_recv().expect("stream ended without a finish") {
                Event::Tokens { ids, .. } => tokens += ids.len(),
                Event::PromptLogprobs(_) => {}
                Event::Finished { .. } => break,
                Event::Error(e) => panic!("{mode:?}: {e}"),
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let s = h.stats().spec;
    h.shutdown();
    Outcome {
        tokens,
        secs,
        drafted: s.grammar_draft_tokens,
        accepted: s.grammar_accepted_tokens,
        forced: s.grammar_forced_tokens,
    }
}

fn main() {
    let dir = models_dir();
    if !dir.join(TARGET).exists() || !dir.join(DRAFT).exists() {
        eprintln!("skipping: models not present (run scripts/fetch-models.sh)");
        return;
    }
    let n = env("SPECGATE_BENCH_SAMPLES", 20);
    let conc = env("SPECGATE_BENCH_CONCURRENCY", 4);
    let tok = Arc::new(TextTokenizer::from_gguf_file(&dir.join(TARGET)).unwrap());
    let vocab = load_gguf(&dir.join(TARGET)).unwrap().config().vocab_size;
    let base = Grammars::from_shared(tok.clone(), vocab).unwrap();
    println!("{n} JSON-schema requests per row, max_num_seqs {conc}, k = 4");
    println!(
        "| temperature | proposer | jump-forward | output tok/s | vs off | drafted | accepted | acceptance | forced |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for temperature in [0.0f32, 1.0] {
        let off = run(Mode::Off, temperature, &base, &tok, n, conc);
        let off_tps = off.tokens as f64 / off.secs;
        println!("| {temperature} | off | - | {off_tps:.1} | 1.00x | - | - | - | - |");
        for mode in [Mode::Ngram, Mode::Draft] {
            for jf in [false, true] {
                let g = base.clone().with_jump_forward(jf);
                let o = run(mode, temperature, &g, &tok, n, conc);
                let tps = o.tokens as f64 / o.secs;
                let rate = if o.drafted == 0 {
                    0.0
                } else {
                    o.accepted as f64 / o.drafted as f64
                };
                println!(
                    "| {temperature} | {mode:?} | {} | {tps:.1} | {:.2}x | {} | {} | {rate:.3} | {} |",
                    if jf { "on" } else { "off" },
                    tps / off_tps,
                    o.drafted,
                    o.accepted,
                    o.forced
                );
            }
        }
    }
}
