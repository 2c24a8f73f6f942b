//! A request that runs to the end of the model's context, drafting with
//! token trees, beside others decoding in the same steps (issue 49, item 1).
//! Near the end a tree's nodes (one cache slot each) used to be sized
//! against the KV pool, not the context, so the step's batch reached past
//! the last position and the forward refused it whole: on the hybrid Kimi
//! K3 (whose recurrent states a failed batch may have advanced) every
//! sequence of the step ended with an error; on the Qwen pair the batch ran
//! again piece by piece and the request at the end still errored. Now each
//! step's drafts are bounded by the context before any forward: the
//! request finishes with `length`, holding exactly the context, and its
//! neighbours finish as they would have.
//!
//! The tiny K3 (tests/fixtures/kimi_k3, random weights, with its tiny
//! draft) runs from a copy whose config says a short context; the real
//! Qwen2.5-Coder pair has its context narrowed with
//! `Model::limit_context`, so the end is reached in a few dozen tokens.

mod common;

use common::{real_model, scratch_dir, wait_idle};
use specgate::engine::scheduler::SchedulerConfig;
use specgate::engine::{
    spawn, EngineConfig, EngineHandle, Event, Fault, FinishReason, GenRequest, KvSize, ProposerKind,
};
use specgate_draft::DraftPolicy;
use specgate_verify::model::{load_gguf, load_model};
use specgate_verify::{Model, SamplingParams};
use std::path::{Path, PathBuf};
use tokio::sync::mpsc::UnboundedReceiver;

/// How a request's stream ended: its tokens and finish reason, or the
/// error event it got.
fn outcome(mut rx: UnboundedReceiver<Event>) -> Result<(Vec<u32>, FinishReason), String> {
    let mut ids = Vec::new();
    loop {
        match rx.blocking_recv() {
            Some(Event::Tokens { ids: i, .. }) => ids.extend(i),
            Some(Event::PromptLogprobs(_)) => {}
            Some(Event::Finished { reason, .. }) => return Ok((ids, reason)),
            Some(Event::Error(e)) => return Err(e),
            None => return Err("the stream ended without a finish".into()),
        }
    }
}

fn request(prompt: Vec<u32>, max_new_tokens: usize) -> GenRequest {
    GenRequest {
        prompt,
        max_new_tokens,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        ..Default::default()
    }
}

fn engine_config(blocks: usize) -> EngineConfig {
    EngineConfig {
        kv: KvSize::Blocks(blocks),
        block_size: 16,
        scheduler: SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 256,
        },
        policy: DraftPolicy::Fixed { k: 3 },
        suffix: None,
        tree_branches: 4,
        prefix: Default::default(),
        row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
    }
}

/// Runs `end` (a request whose prompt + max_new_tokens is the whole
/// context) beside `others`, all submitted together, and checks that the
/// end request finishes with `length` holding exactly `context` tokens,
/// that every neighbour finishes whole, and that speculation did verify
/// trees; then that everything is given back.
fn run_to_the_end(h: &EngineHandle, context: usize, end: GenRequest, others: Vec<GenRequest>) {
    assert_eq!(end.prompt.len() + end.max_new_tokens, context);
    let end_prompt = end.prompt.len();
    let rx = h.submit(end).unwrap();
    let lens: Vec<usize> = others.iter().map(|r| r.max_new_tokens).collect();
    let rxs: Vec<_> = others.into_iter().map(|r| h.submit(r).unwrap()).collect();
    let got = outcome(rx);
    let neighbours: Vec<_> = rxs.into_iter().map(outcome).collect();
    let (ids, reason) = got.expect("the request at the context's end errored");
    assert_eq!(reason, FinishReason::Length);
    assert_eq!(end_prompt + ids.len(), context, "it fills the context");
    for (i, (n, want)) in neighbours.into_iter().zip(lens).enumerate() {
        let (ids, reason) = n.unwrap_or_else(|e| panic!("neighbour {i} errored: {e}"));
        assert_eq!((ids.len(), reason), (want, FinishReason::Length), "{i}");
    }
    let s = wait_idle(h);
    assert_eq!(s.failed, 0);
    assert!(s.spec.tree_rounds > 0, "no step verified a tree");
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kimi_k3")
        .join(name)
}

/// A copy of the tiny K3 checkpoint whose config gives it a context of
/// `context` positions.
fn tiny_k3_with_context(context: usize) -> Model {
    let dir = scratch_dir(&format!("k3-context-{context}"));
    let src = fixture("tiny-hf");
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    let cfg_path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["text_config"]["max_position_embeddings"] = context.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let m = load_model(&dir).unwrap();
    assert_eq!(m.config().max_position, context);
    m
}

fn text(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|j| ((j * 31 + salt * 97 + j * j) % 500) as u32 + 3)
        .collect()
}

/// The hybrid K3 target (recurrent states) with its tiny draft drafting
/// trees: the request at the end and three neighbours decoding beside it.
#[test]
fn tiny_k3_request_at_the_context_end_finishes_with_length_beside_others() {
    const CONTEXT: usize = 160;
    let target = tiny_k3_with_context(CONTEXT);
    let draft = load_model(&fixture("tiny-draft-hf")).unwrap();
    let (h, _) = spawn(target, ProposerKind::Draft(draft), None, engine_config(64)).unwrap();
    // The pool holds far more than the context: it is not what bounds
    // the end request's drafts.
    assert!(h.kv_slots() > 4 * CONTEXT);
    let others = (1..4).map(|i| request(text(24, i), 80)).collect();
    run_to_the_end(&h, CONTEXT, request(text(100, 0), 60), others);
}

/// The check of each piece before the forward: request 1 planned as
/// before the fix ([`Fault::PoolBoundedDrafts`]) reaches past the context
/// near its end; that piece is refused and ends its request alone, while
/// its neighbours in the same steps (a recurrent target, which could not
/// run a failed batch again) finish whole.
#[test]
fn tiny_k3_piece_past_the_context_ends_alone() {
    const CONTEXT: usize = 160;
    let (h, _) = spawn(
        tiny_k3_with_context(CONTEXT),
        ProposerKind::Draft(load_model(&fixture("tiny-draft-hf")).unwrap()),
        None,
        engine_config(64),
    )
    .unwrap();
    h.inject_fault(Fault::PoolBoundedDrafts(1)).unwrap();
    let end = h.submit(request(text(100, 0), 60)).unwrap();
    let others: Vec<_> = (1..4)
        .map(|i| h.submit(request(text(24, i), 80)).unwrap())
        .collect();
    let e = outcome(end).expect_err("a piece past the context ran");
    assert!(e.contains("internal error"), "{e}");
    for (i, rx) in others.into_iter().enumerate() {
        let (ids, reason) = outcome(rx).unwrap_or_else(|e| panic!("neighbour {i} errored: {e}"));
        assert_eq!((ids.len(), reason), (80, FinishReason::Length), "{i}");
    }
    let s = wait_idle(&h);
    assert_eq!(s.failed, 1);
}

/// The same on the real Qwen2.5-Coder 1.5B target with its 0.5B draft
/// (trees), the context narrowed to 128 positions.
#[test]
fn real_pair_request_at_the_context_end_finishes_with_length_beside_others() {
    let (Some(tp), Some(dp)) = (
        real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        real_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    ) else {
        return;
    };
    const CONTEXT: usize = 128;
    let tok = std::sync::Arc::new(specgate::tokenizer::TextTokenizer::from_gguf_file(&tp).unwrap());
    let mut target = load_gguf(&tp).unwrap();
    target.limit_context(CONTEXT).unwrap();
    let (h, _) = spawn(
        target,
        ProposerKind::Draft(load_gguf(&dp).unwrap()),
        Some(tok.clone()),
        engine_config(64),
    )
    .unwrap();
    assert_eq!(h.max_position(), CONTEXT);
    let prompt = |t: &str| {
        let chat = tok
            .apply_chat_template(&[specgate::tokenizer::ChatMessage::new("user", t)], true)
            .unwrap();
        tok.encode(&chat, false).unwrap()
    };
    let end = prompt("Write a Python function that reverses a list, with comments.");
    let max_new = CONTEXT - end.len();
    let others = [
        "What is 17 * 23?",
        "Name three sorting algorithms.",
        "Explain TCP in one sentence.",
    ]
    .iter()
    .map(|t| request(prompt(t), 40))
    .collect();
    // Sampled hot, the draft is unsure at most positions and branches
    // there, up to the last steps (greedy code it is sure of).
    let mut end = request(end, max_new);
    end.sampling = SamplingParams {
        temperature: 1.5,
        seed: Some(7),
        ..SamplingParams::default()
    };
    run_to_the_end(&h, CONTEXT, end, others);
}
