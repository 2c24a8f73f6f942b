//! The continuous-batching engine on tiny generated models: concurrent
//! requests emit exactly what each emits alone (speculation on and off),
//! preemption and prefix caching leave outputs unchanged, a dropped
//! receiver frees its blocks within a step, and the pool always returns to
//! its idle block count.

mod common;

use candle_core::quantized::GgmlDType;
use common::{real_model, tiny_model, tiny_model_tp};
use specgate::engine::scheduler::SchedulerConfig;
use specgate::engine::{
    spawn, EngineConfig, EngineHandle, EngineStats, Event, Fault, FinishReason, GenRequest, KvSize,
    ProposerKind,
};
use specgate_draft::DraftPolicy;
use specgate_verify::model::load_gguf;
use specgate_verify::tiny::TinySpec;
use specgate_verify::{Model, SamplingParams};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

fn target() -> Model {
    tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q6K,
            ..TinySpec::qwen2(31)
        },
        "target.gguf",
    )
}

#[derive(Clone, Copy, PartialEq)]
enum Spec {
    Off,
    Ngram,
    Draft,
}

fn engine(spec: Spec, num_blocks: usize, max_num_seqs: usize, tokens: usize) -> EngineHandle {
    engine_with(target(), spec, num_blocks, max_num_seqs, tokens)
}

fn engine_with(
    target: Model,
    spec: Spec,
    num_blocks: usize,
    max_num_seqs: usize,
    tokens: usize,
) -> EngineHandle {
    let proposer = match spec {
        Spec::Off => ProposerKind::None,
        Spec::Ngram => ProposerKind::Ngram { min_n: 1, max_n: 3 },
        Spec::Draft => ProposerKind::Draft(tiny_model(
            &TinySpec {
                dtype: GgmlDType::Q4K,
                ..TinySpec::qwen2(31)
            },
            "draft.gguf",
        )),
    };
    let cfg = EngineConfig {
        kv: KvSize::Blocks(num_blocks),
        block_size: 16,
        scheduler: SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: tokens,
        },
        policy: DraftPolicy::Fixed { k: 3 },
        suffix: None,
        tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
        prefix: Default::default(),
        row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
    };
    spawn(target, proposer, None, cfg).unwrap().0
}

fn request(i: usize) -> GenRequest {
    // Mixed prompt and output lengths; some repetitive for n-gram lookup.
    let len = 3 + (i * 7) % 40;
    let prompt: Vec<u32> = (0..len)
        .map(|j| ((i * 31 + j * (1 + i % 3)) % 50) as u32)
        .collect();
    GenRequest {
        prompt,
        max_new_tokens: 5 + (i * 11) % 30,
        sampling: SamplingParams::default(),
        stop_token_ids: vec![],
        ignore_eos: true,
        method: None,
        num_speculative_tokens: None,
        ..Default::default()
    }
}

/// Reads a stream to its end: the tokens and how it finished.
fn collect(mut rx: UnboundedReceiver<Event>) -> (Vec<u32>, FinishReason) {
    let mut out = Vec::new();
    loop {
        match rx.blocking_recv().expect("stream ended without Finished") {
            Event::Tokens { ids, .. } => out.extend(ids),
            Event::PromptLogprobs(_) => {}
            Event::Finished { reason, usage, .. } => {
                // The stop token counts as generated but is not output.
                let stop = usize::from(reason == FinishReason::Stop);
                assert_eq!(usage.completion_tokens, out.len() + stop);
                return (out, reason);
            }
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
}

fn wait_idle(h: &EngineHandle) -> EngineStats {
    let t = Instant::now();
    loop {
        let s = h.stats();
        if s.running == 0 && s.waiting == 0 && s.free_blocks == s.num_blocks {
            return s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "engine never went idle: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn alone(n: usize) -> Vec<Vec<u32>> {
    let h = engine(Spec::Off, 64, 1, 64);
    (0..n)
        .map(|i| collect(h.submit(request(i)).unwrap()).0)
        .collect()
}

fn together(h: &EngineHandle, n: usize) -> Vec<Vec<u32>> {
    let rxs: Vec<_> = (0..n).map(|i| h.submit(request(i)).unwrap()).collect();
    rxs.into_iter().map(|rx| collect(rx).0).collect()
}

/// A target sharded over 2 ranks, batched with a draft, emits what the
/// unsharded target emits for each request alone.
#[test]
fn tp2_target_batched_with_draft_matches_unsharded_alone() {
    // Q8_0 (32-value blocks): 2 of the 4 heads' o_proj columns cut cleanly.
    let spec = || TinySpec {
        dtype: GgmlDType::Q8_0,
        ..TinySpec::qwen2(31)
    };
    let n = 8;
    let h = engine_with(tiny_model_tp(&spec(), "tp1.gguf", 1), Spec::Off, 64, 1, 64);
    let reference: Vec<Vec<u32>> = (0..n)
        .map(|i| collect(h.submit(request(i)).unwrap()).0)
        .collect();
    let h = engine_with(
        tiny_model_tp(&spec(), "tp2.gguf", 2),
        Spec::Draft,
        64,
        4,
        64,
    );
    assert_eq!(together(&h, n), reference);
    wait_idle(&h);
}

#[test]
fn concurrent_requests_emit_what_each_emits_alone() {
    let reference = alone(32);
    for spec in [Spec::Off, Spec::Ngram, Spec::Draft] {
        for n in [8, 32] {
            let h = engine(spec, 256, 32, 96);
            let got = together(&h, n);
            for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
                assert_eq!(g, r, "request {i} of {n}, speculation {}", spec as u8);
            }
            let s = wait_idle(&h);
            assert_eq!(s.finished, n as u64);
            if spec == Spec::Draft {
                assert!(s.spec.accepted_tokens > 0);
            }
        }
    }
}

#[test]
fn preemption_keeps_outputs_and_returns_the_pool() {
    let long = |i| GenRequest {
        max_new_tokens: 60,
        ..request(i)
    };
    let h = engine(Spec::Off, 64, 1, 64);
    let reference: Vec<_> = (0..12)
        .map(|i| collect(h.submit(long(i)).unwrap()).0)
        .collect();
    for spec in [Spec::Off, Spec::Draft] {
        // Admitted at 1-3 blocks each, every sequence grows to 5-7 blocks:
        // 12 blocks of 16 cannot hold the sequences admitted together.
        let h = engine(spec, 12, 12, 64);
        let rxs: Vec<_> = (0..12).map(|i| h.submit(long(i)).unwrap()).collect();
        let got: Vec<_> = rxs.into_iter().map(|rx| collect(rx).0).collect();
        assert_eq!(got, reference);
        let s = wait_idle(&h);
        assert!(s.preemptions > 0, "the pool was meant to be too small");
    }
}

#[test]
fn shared_system_prompt_hits_the_prefix_cache() {
    let system: Vec<u32> = (0..70).map(|i| (i * 5 % 300) as u32).collect();
    let req = |tail: &[u32]| GenRequest {
        prompt: system.iter().chain(tail).copied().collect(),
        max_new_tokens: 12,
        sampling: SamplingParams::default(),
        stop_token_ids: vec![],
        ignore_eos: true,
        method: None,
        num_speculative_tokens: None,
        ..Default::default()
    };
    let cold = engine(Spec::Off, 64, 4, 64);
    let expect_b = collect(cold.submit(req(&[9, 8, 7])).unwrap()).0;

    let h = engine(Spec::Off, 64, 4, 64);
    collect(h.submit(req(&[1, 2, 3])).unwrap());
    let before = wait_idle(&h);
    let b = collect(h.submit(req(&[9, 8, 7])).unwrap()).0;
    let after = wait_idle(&h);
    assert_eq!(b, expect_b, "a cached prefix changed the output");
    // 70 shared tokens = 4 full blocks of 16 reused.
    assert_eq!(after.prefix.hits - before.prefix.hits, 64);
    assert_eq!(after.prefill_tokens - before.prefill_tokens, 72 - 64);
}

#[test]
fn dropped_receiver_frees_blocks_within_a_step() {
    let h = engine(Spec::Ngram, 64, 4, 64);
    let mut req = request(3);
    req.max_new_tokens = 400;
    let mut rx = h.submit(req).unwrap();
    assert!(matches!(rx.blocking_recv(), Some(Event::Tokens { .. })));
    let steps = h.stats().steps;
    drop(rx);
    let s = wait_idle(&h);
    assert!(
        s.steps <= steps + 2,
        "blocks freed {} steps after the drop",
        s.steps - steps
    );
    assert_eq!(s.cancelled, 1);
}

#[test]
fn stop_tokens_and_limits_end_sequences() {
    let h = engine(Spec::Ngram, 64, 4, 64);
    let (full, reason) = collect(h.submit(request(5)).unwrap());
    assert_eq!(reason, FinishReason::Length);
    assert_eq!(full.len(), request(5).max_new_tokens);
    // Stopping on the third output token: output ends before it.
    let mut req = request(5);
    req.stop_token_ids = vec![full[2]];
    let first = full.iter().position(|&t| t == full[2]).unwrap();
    let (got, reason) = collect(h.submit(req).unwrap());
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(got, full[..first].to_vec());
    wait_idle(&h);
}

#[test]
fn bad_requests_are_refused_with_reasons() {
    let h = engine(Spec::Off, 8, 4, 64);
    let mut r = request(1);
    r.prompt.clear();
    assert!(h.submit(r).unwrap_err().to_string().contains("empty"));
    let mut r = request(1);
    r.prompt.push(10_000);
    assert!(h.submit(r).unwrap_err().to_string().contains("vocabulary"));
    let mut r = request(1);
    r.max_new_tokens = 2000;
    assert!(h
        .submit(r)
        .unwrap_err()
        .to_string()
        .contains("context length"));
    let mut r = request(1);
    r.max_new_tokens = 200;
    assert!(h.submit(r).unwrap_err().to_string().contains("KV cache"));
}

/// A client number near 2^64 must not wrap the context check (a wrapped
/// sum passes it and the sequence never ends).
#[test]
fn huge_max_new_tokens_is_refused_not_wrapped() {
    let h = engine(Spec::Off, 8, 4, 64);
    for n in [usize::MAX, usize::MAX - 2, usize::MAX / 2 + 1] {
        let mut r = request(1);
        r.max_new_tokens = n;
        let e = h.submit(r).unwrap_err().to_string();
        assert!(e.contains("context length"), "{n}: {e}");
    }
}

/// Outputs of `n` requests submitted together after `fault`; `None` for a
/// request that ended with an error event.
fn together_with_fault(h: &EngineHandle, fault: Fault, n: usize) -> Vec<Option<Vec<u32>>> {
    h.inject_fault(fault).unwrap();
    let rxs: Vec<_> = (0..n).map(|i| h.submit(request(i)).unwrap()).collect();
    rxs.into_iter()
        .map(|mut rx| {
            let mut out = Vec::new();
            loop {
                match rx.blocking_recv().expect("stream ended without a finish") {
                    Event::Tokens { ids, .. } => out.extend(ids),
                    Event::PromptLogprobs(_) => {}
                    Event::Finished { .. } => return Some(out),
                    Event::Error(e) => {
                        assert!(e.contains("internal error"), "{e}");
                        assert!(!e.contains("injected"), "internal detail leaked: {e}");
                        return None;
                    }
                }
            }
        })
        .collect()
}

/// A forward that fails (an error, or a panic as a kernel bug would
/// cause) for one sequence ends that sequence only: every other request of
/// the batch emits what it emits alone, and the pool comes back whole.
#[test]
fn a_faulty_sequence_fails_alone_and_the_batch_goes_on() {
    let want = alone(6);
    for (fault, spec) in [
        (Fault::ForwardError(3), Spec::Ngram),
        (Fault::ForwardPanic(5), Spec::Draft),
    ] {
        let h = engine(spec, 64, 8, 64);
        let got = together_with_fault(&h, fault, 6);
        let bad = match fault {
            Fault::ForwardError(n) | Fault::ForwardPanic(n) => n as usize - 1,
            _ => unreachable!(),
        };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if i == bad {
                assert!(g.is_none(), "{fault:?}: request {i} should have failed");
            } else {
                assert_eq!(g.as_ref(), Some(w), "{fault:?}: request {i}");
            }
        }
        let s = wait_idle(&h);
        assert_eq!(s.failed, 1, "{fault:?}");
        assert!(h.is_alive());
        // The engine still serves.
        assert_eq!(collect(h.submit(request(2)).unwrap()).0, want[2]);
    }
}

/// A draft with a shorter context than the target's fails on a long
/// sequence: that sequence goes on without drafts (still exact), and the
/// short ones beside it keep drafting.
#[test]
fn a_draft_with_a_shorter_context_does_not_fail_the_batch() {
    let short_draft = tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q4K,
            max_position: 48,
            ..TinySpec::qwen2(31)
        },
        "short-draft.gguf",
    );
    let cfg = EngineConfig {
        kv: KvSize::Blocks(64),
        block_size: 16,
        scheduler: SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
        },
        policy: DraftPolicy::Fixed { k: 3 },
        suffix: None,
        tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
        prefix: Default::default(),
        row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
    };
    let h = spawn(target(), ProposerKind::Draft(short_draft), None, cfg)
        .unwrap()
        .0;
    let plain = engine(Spec::Off, 64, 1, 64);
    let reqs: Vec<GenRequest> = (0..4)
        .map(|i| {
            let mut r = request(i);
            // Request 0 outgrows the draft's 48 positions; the rest do not.
            r.max_new_tokens = if i == 0 { 60 } else { 8 };
            r
        })
        .collect();
    let want: Vec<_> = reqs
        .iter()
        .map(|r| collect(plain.submit(r.clone()).unwrap()).0)
        .collect();
    let rxs: Vec<_> = reqs.iter().map(|r| h.submit(r.clone()).unwrap()).collect();
    let got: Vec<_> = rxs.into_iter().map(|rx| collect(rx).0).collect();
    assert_eq!(got, want);
    let s = wait_idle(&h);
    assert_eq!(s.failed, 0);
}

/// A panic of the engine thread itself is reported: in-flight requests
/// get an error event, `is_alive` turns false and `died` resolves (the
/// server turns /health to 503 and exits non-zero on it).
#[test]
fn an_engine_panic_is_reported_not_silent() {
    let h = engine(Spec::Off, 64, 4, 64);
    let mut r = request(1);
    r.max_new_tokens = 30;
    let mut rx = h.submit(r).unwrap();
    h.inject_fault(Fault::EnginePanic).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(30), h.died())
            .await
            .expect("died() never resolved");
    });
    assert!(!h.is_alive());
    let mut last = None;
    while let Some(ev) = rx.blocking_recv() {
        last = Some(ev);
    }
    assert!(matches!(
        last,
        Some(Event::Error(_)) | Some(Event::Finished { .. })
    ));
    assert!(h.submit(request(2)).is_err());
}

/// The real 1.5B target with the real 0.5B draft: 8 concurrent chat
/// requests emit what each emits alone without speculation.
#[test]
fn real_target_concurrent_requests_match_alone() {
    let (Some(tp), Some(dp)) = (
        real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        real_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    ) else {
        return;
    };
    let tok = std::sync::Arc::new(specgate::tokenizer::TextTokenizer::from_gguf_file(&tp).unwrap());
    let texts = [
        "Write a haiku about Rust.",
        "What is 17 * 23?",
        "Write a Python function that reverses a list.",
        "Name three sorting algorithms.",
        "Explain TCP in one sentence.",
        "Rename `a` to `total` and return the code:\n\na = 0\nfor x in range(10):\n    a += x\nprint(a)\n",
        "Write a Go function that sums a slice of ints.",
        "What does HTTP 404 mean?",
    ];
    let reqs: Vec<GenRequest> = texts
        .iter()
        .map(|t| {
            let chat = tok
                .apply_chat_template(&[specgate::tokenizer::ChatMessage::new("user", *t)], true)
                .unwrap();
            GenRequest {
                prompt: tok.encode(&chat, false).unwrap(),
                max_new_tokens: 24,
                sampling: SamplingParams::default(),
                stop_token_ids: vec![],
                ignore_eos: false,
                method: None,
                num_speculative_tokens: None,
                ..Default::default()
            }
        })
        .collect();
    let cfg = |k| EngineConfig {
        kv: KvSize::Blocks(128),
        block_size: 16,
        scheduler: SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 256,
        },
        policy: DraftPolicy::Fixed { k },
        suffix: None,
        tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
        prefix: Default::default(),
        row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
    };
    let solo = spawn(
        load_gguf(&tp).unwrap(),
        ProposerKind::None,
        Some(tok.clone()),
        cfg(0),
    )
    .unwrap()
    .0;
    let alone: Vec<_> = reqs
        .iter()
        .map(|r| collect(solo.submit(r.clone()).unwrap()).0)
        .collect();
    solo.shutdown();
    let (h, _) = spawn(
        load_gguf(&tp).unwrap(),
        ProposerKind::Draft(load_gguf(&dp).unwrap()),
        Some(tok.clone()),
        cfg(3),
    )
    .unwrap();
    let rxs: Vec<_> = reqs.iter().map(|r| h.submit(r.clone()).unwrap()).collect();
    let together: Vec<_> = rxs.into_iter().map(|rx| collect(rx).0).collect();
    assert_eq!(together, alone);
    let s = wait_idle(&h);
    assert!(s.spec.accepted_tokens > 0);
    assert!(s.spec.tree_rounds > 0, "the draft never branched");
}

#[test]
fn memory_budget_sets_the_block_count_for_draft_and_target() {
    let t = target();
    let per_token = t.config().kv_bytes_per_token();
    let d = tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q4K,
            ..TinySpec::qwen2(31)
        },
        "budget-draft.gguf",
    );
    let d_per_token = d.config().kv_bytes_per_token();
    let cfg = |kv| EngineConfig {
        kv,
        block_size: 16,
        scheduler: SchedulerConfig {
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
        },
        policy: DraftPolicy::Fixed { k: 2 },
        suffix: None,
        tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
        prefix: Default::default(),
        row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
    };
    let bytes = 10 * 16 * (per_token + d_per_token) + 5;
    let (h, _) = spawn(
        t,
        ProposerKind::Draft(d),
        None,
        cfg(KvSize::MemoryBytes(bytes)),
    )
    .unwrap();
    assert_eq!(h.stats().num_blocks, 10);
    let err = spawn(
        target(),
        ProposerKind::None,
        None,
        cfg(KvSize::MemoryBytes(100)),
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("no block"), "{err}");
}
