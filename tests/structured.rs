//! Structured output on real weights: JSON-schema-constrained requests at
//! temperature 1 through the engine, with speculation off, n-gram and a
//! draft model. Every output must parse and validate against its schema
//! (checked with the `jsonschema` crate, independent of the grammar engine),
//! whatever the proposer drafted: the grammar mask is applied to every
//! verified row and to the draft's q, drafts are cut at their first token
//! the grammar forbids, and the grammar state only advances on accepted
//! tokens.
//!
//! Samples per mode: `SPECGATE_STRUCTURED_SAMPLES` (default 200, spread over
//! five schemas). The target is Qwen2.5-Coder-0.5B; the draft mode drafts
//! with the same 0.5B file, which makes long accepted runs (and so many
//! jump-forward and rejection boundaries) likely.

mod common;

use common::real_model;
use common::schemas::schemas;
use serde_json::Value;
use specgate::engine::scheduler::SchedulerConfig;
use specgate::engine::{
    spawn, EngineConfig, Event, FinishReason, GenRequest, KvSize, ProposerKind,
};
use specgate::grammar::{GrammarSpec, Grammars};
use specgate::tokenizer::{ChatMessage, TextTokenizer};
use specgate_draft::DraftPolicy;
use specgate_verify::model::load_gguf;
use specgate_verify::SamplingParams;
use std::sync::Arc;

const TARGET: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

fn samples() -> usize {
    std::env::var("SPECGATE_STRUCTURED_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    Off,
    Ngram,
    Draft,
}

/// Runs every sample of one mode concurrently; returns (outputs with their
/// schema index, drafted, accepted).
fn run(
    mode: Mode,
    tok: &Arc<TextTokenizer>,
    grammars: &Grammars,
    n: usize,
) -> (Vec<(usize, String, FinishReason)>, u64, u64) {
    let path = real_model(TARGET).unwrap();
    let proposer = match mode {
        Mode::Off => ProposerKind::None,
        Mode::Ngram => ProposerKind::Ngram { min_n: 1, max_n: 3 },
        Mode::Draft => ProposerKind::Draft(load_gguf(&path).unwrap()),
    };
    let cfg = EngineConfig {
        kv: KvSize::Blocks(512),
        block_size: 16,
        scheduler: SchedulerConfig {
            max_num_seqs: 16,
            max_num_batched_tokens: 512,
        },
        policy: DraftPolicy::Fixed { k: 4 },
        suffix: None,
        tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
        prefix: Default::default(),
        row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
    };
    let (h, _) = spawn(load_gguf(&path).unwrap(), proposer, Some(tok.clone()), cfg).unwrap();
    let schemas = schemas();
    let compiled: Vec<_> = schemas
        .iter()
        .map(|(_, s)| {
            grammars
                .compile(&GrammarSpec::JsonSchema(s.clone()))
                .unwrap()
        })
        .collect();
    let rxs: Vec<_> = (0..n)
        .map(|i| {
            let which = i % schemas.len();
            let (task, _) = &schemas[which];
            let msgs = [
                // The grammar holds the output to the schema; the prompt
                // stays short so prefill does not dominate the test's time.
                ChatMessage::new("system", "Reply with one JSON object."),
                ChatMessage::new("user", *task),
            ];
            let chat = tok.apply_chat_template(&msgs, true).unwrap();
            let req = GenRequest {
                prompt: tok.encode(&chat, false).unwrap(),
                max_new_tokens: 160,
                sampling: SamplingParams {
                    temperature: 1.0,
                    seed: Some(1000 + i as u64),
                    ..Default::default()
                },
                grammar: Some(compiled[which].clone()),
                ..Default::default()
            };
            (which, h.submit(req).unwrap())
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    let (mut drafted, mut accepted) = (0, 0);
    for (which, mut rx) in rxs {
        let mut text = String::new();
        loop {
            match rx.blocking_recv().expect("stream ended without a finish") {
                Event::Tokens { text: t, .. } => text.push_str(&t),
                Event::PromptLogprobs(_) => {}
                Event::Finished {
                    reason,
                    drafted: d,
                    accepted: a,
                    ..
                } => {
                    drafted += d;
                    accepted += a;
                    out.push((which, text, reason));
                    break;
                }
                Event::Error(e) => panic!("{mode:?}: engine error: {e}"),
            }
        }
    }
    h.shutdown();
    (out, drafted, accepted)
}

#[test]
fn json_schema_outputs_validate_with_speculation_off_ngram_and_draft() {
    let Some(path) = real_model(TARGET) else {
        return;
    };
    let tok = Arc::new(TextTokenizer::from_gguf_file(&path).unwrap());
    let vocab = load_gguf(&path).unwrap().config().vocab_size;
    let grammars = Grammars::new(&tok, vocab).unwrap();
    let validators: Vec<_> = schemas()
        .iter()
        .map(|(_, s)| jsonschema::validator_for(s).unwrap())
        .collect();
    let n = samples();
    for mode in [Mode::Off, Mode::Ngram, Mode::Draft] {
        let (outs, drafted, accepted) = run(mode, &tok, &grammars, n);
        assert_eq!(outs.len(), n);
        for (which, text, reason) in &outs {
            assert_eq!(
                *reason,
                FinishReason::Stop,
                "{mode:?}: schema {which} hit the token limit: {text}"
            );
            let v: Value = serde_json::from_str(text)
                .unwrap_or_else(|e| panic!("{mode:?}: schema {which}: not JSON ({e}): {text}"));
            let errors: Vec<String> = validators[*which]
                .iter_errors(&v)
                .map(|e| e.to_string())
                .collect();
            assert!(
                errors.is_empty(),
                "{mode:?}: schema {which}: {text} fails its schema: {errors:?}"
            );
        }
        let rate = if drafted == 0 {
            0.0
        } else {
            accepted as f64 / drafted as f64
        };
        eprintln!(
            "{mode:?}: {n} samples valid; drafted {drafted}, accepted {accepted} ({rate:.3})"
        );
        if !matches!(mode, Mode::Off) {
            assert!(drafted > 0, "{mode:?} drafted nothing");
        }
    }
}
