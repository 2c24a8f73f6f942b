//! Kimi K3 conversations with prefix caching: a hit resumes the recurrent
//! state from a checkpoint saved at exactly its block boundary. Proven
//! here on the tiny generated K3 (tests/fixtures/kimi_k3): conversations
//! that grow turn by turn (each answer fed back, then a new user turn) give
//! bit-identical tokens and logprobs with prefix caching on and off, at TP
//! 1 and 2, without speculation, with n-gram and draft-model speculation,
//! with and without token trees, greedy and seeded sampling, across chunk
//! and block sizes; the hits are real (checkpoints restored, prompt rows
//! skipped); corrupting restored checkpoints on purpose breaks the
//! equality; a budget of one checkpoint evicts and recomputes, still
//! exact; and two cache scopes never share a state.

mod common;

use common::wait_idle;
use specgate::engine::scheduler::SchedulerConfig;
use specgate::engine::{
    spawn, EngineConfig, EngineHandle, EngineStats, Event, Fault, GenRequest, KvSize,
    PrefixCaching, ProposerKind,
};
use specgate_draft::DraftPolicy;
use specgate_verify::model::{load_model, load_model_tp};
use specgate_verify::{Model, SamplingParams, TokenLogprob};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kimi_k3")
        .join(name)
}

fn target(world: usize) -> Model {
    load_model_tp(&fixture("tiny-k3.gguf"), world).unwrap()
}

fn tiny_draft() -> Model {
    load_model(&fixture("tiny-draft-hf")).unwrap()
}

/// How an engine is built for one run.
#[derive(Clone, Copy, Debug)]
struct Setup {
    world: usize,
    /// 0: none, 1: n-gram, 2: the tiny K3 draft.
    proposer: u8,
    trees: bool,
    block_size: usize,
    /// Rows per step (prompt chunks are cut to fit).
    rows: usize,
    checkpoint_bytes: usize,
}

const BASE: Setup = Setup {
    world: 1,
    proposer: 0,
    trees: true,
    block_size: 16,
    rows: 48,
    checkpoint_bytes: 64 << 20,
};

fn engine(s: Setup, caching: bool) -> EngineHandle {
    let proposer = match s.proposer {
        0 => ProposerKind::None,
        1 => ProposerKind::Ngram { min_n: 1, max_n: 3 },
        _ => ProposerKind::Draft(tiny_draft()),
    };
    let cfg = EngineConfig {
        kv: KvSize::Blocks(96),
        block_size: s.block_size,
        scheduler: SchedulerConfig {
            max_num_seqs: 4,
            max_num_batched_tokens: s.rows,
        },
        policy: DraftPolicy::Fixed { k: 3 },
        suffix: None,
        tree_branches: if s.trees { 4 } else { 0 },
        prefix: PrefixCaching {
            enabled: caching,
            checkpoint_bytes: s.checkpoint_bytes,
        },
        row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
    };
    spawn(target(s.world), proposer, None, cfg).unwrap().0
}

/// A deterministic user turn (or system prompt) of `n` tokens.
fn text(turn: usize, n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|j| ((turn * 97 + j * 31 + salt * 13 + j * j) % 700) as u32 + 3)
        .collect()
}

/// One turn's output: ids and their logprobs as bits (bit-identical
/// logits give bit-identical logprobs).
type Turn = (Vec<u32>, Vec<Vec<u32>>);

fn bits(lps: &[TokenLogprob]) -> Vec<Vec<u32>> {
    lps.iter()
        .map(|l| {
            let mut v = vec![l.token, l.logprob.to_bits()];
            v.extend(l.top.iter().flat_map(|&(id, lp)| [id, lp.to_bits()]));
            v
        })
        .collect()
}

fn run(rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Turn {
    let mut rx = rx;
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    loop {
        match rx.blocking_recv().expect("stream ended without Finished") {
            Event::Tokens {
                ids: i,
                logprobs: l,
                ..
            } => {
                ids.extend(i);
                lps.extend(bits(&l));
            }
            Event::PromptLogprobs(_) => {}
            Event::Finished { .. } => return (ids, lps),
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
}

/// `convs` conversations of `turns` turns, run side by side (each turn of
/// every conversation submitted together, so hits happen under batching):
/// a system prompt, then per turn a user text; each answer is fed back.
fn conversations(
    h: &EngineHandle,
    convs: usize,
    turns: usize,
    sampled: bool,
    scope: impl Fn(usize) -> u64,
) -> Vec<Vec<Turn>> {
    let mut hist: Vec<Vec<u32>> = (0..convs).map(|c| text(c, 37 + 11 * c, 1)).collect();
    let mut out = vec![Vec::new(); convs];
    for t in 0..turns {
        let rxs: Vec<_> = (0..convs)
            .map(|c| {
                hist[c].push(1);
                hist[c].extend(text(t, 9 + (t * 5 + c) % 13, c + 2));
                let sampling = if sampled {
                    SamplingParams {
                        temperature: 0.9,
                        top_k: 40,
                        seed: Some((c * 100 + t) as u64),
                        ..SamplingParams::default()
                    }
                } else {
                    SamplingParams::default()
                };
                h.submit(GenRequest {
                    prompt: hist[c].clone(),
                    max_new_tokens: 10 + (t + c) % 9,
                    sampling,
                    ignore_eos: true,
                    logprobs: Some(2),
                    cache_scope: scope(c),
                    ..Default::default()
                })
                .unwrap()
            })
            .collect();
        for (c, rx) in rxs.into_iter().enumerate() {
            let turn = run(rx);
            hist[c].extend(&turn.0);
            out[c].push(turn);
        }
    }
    out
}

/// The conversations with caching on and off: equal outputs; the stats of
/// the cached run and of the uncached one.
fn on_and_off(s: Setup, sampled: bool) -> (EngineStats, EngineStats) {
    let (on, off) = (engine(s, true), engine(s, false));
    let a = conversations(&on, 3, 4, sampled, |_| 0);
    let b = conversations(&off, 3, 4, sampled, |_| 0);
    for (c, (x, y)) in a.iter().zip(&b).enumerate() {
        for (t, (x, y)) in x.iter().zip(y).enumerate() {
            assert_eq!(
                x.0, y.0,
                "{s:?} sampled {sampled}: conversation {c} turn {t} tokens"
            );
            assert_eq!(
                x.1, y.1,
                "{s:?} sampled {sampled}: conversation {c} turn {t} logprobs"
            );
        }
    }
    let (son, soff) = (wait_idle(&on), wait_idle(&off));
    assert!(son.prefix_caching && !soff.prefix_caching);
    assert_eq!(soff.checkpoints.hits, 0);
    (son, soff)
}

/// The hits are real: every conversation's later turns restore a
/// checkpoint and skip most of their history's prefill.
fn assert_hits(s: Setup, on: &EngineStats, off: &EngineStats) {
    // 3 conversations x 3 later turns.
    assert!(on.checkpoints.hits >= 9, "{s:?}: {:?}", on.checkpoints);
    assert!(on.checkpoints.saves >= 9, "{s:?}: {:?}", on.checkpoints);
    assert!(
        on.prefill_tokens * 2 < off.prefill_tokens,
        "{s:?}: prefilled {} with caching, {} without",
        on.prefill_tokens,
        off.prefill_tokens
    );
    assert_eq!(
        on.prefix.hits, on.checkpoints.restored_tokens,
        "a block hit without its state"
    );
}

#[test]
fn conversations_are_exact_with_caching_on_and_off_without_speculation() {
    for s in [
        BASE,
        Setup {
            block_size: 8,
            rows: 20,
            ..BASE
        },
        Setup { world: 2, ..BASE },
    ] {
        let (on, off) = on_and_off(s, false);
        assert_hits(s, &on, &off);
    }
}

#[test]
fn conversations_are_exact_with_caching_under_speculation() {
    let mut trees = 0;
    for s in [
        Setup {
            proposer: 1,
            ..BASE
        },
        Setup {
            proposer: 1,
            trees: false,
            block_size: 8,
            ..BASE
        },
        Setup {
            proposer: 2,
            ..BASE
        },
        Setup {
            proposer: 2,
            world: 2,
            rows: 24,
            ..BASE
        },
    ] {
        let (on, off) = on_and_off(s, false);
        assert_hits(s, &on, &off);
        assert!(on.spec.accepted_tokens > 0, "{s:?}: nothing accepted");
        trees += on.spec.tree_rounds;
    }
    assert!(trees > 0, "no token tree was verified");
}

#[test]
fn seeded_sampling_is_exact_with_caching() {
    for s in [
        BASE,
        Setup {
            proposer: 2,
            ..BASE
        },
        Setup {
            proposer: 1,
            block_size: 8,
            ..BASE
        },
    ] {
        let (on, off) = on_and_off(s, true);
        assert_hits(s, &on, &off);
    }
}

#[test]
fn corrupted_checkpoints_are_caught() {
    let on = engine(BASE, true);
    on.inject_fault(Fault::CorruptCheckpoints).unwrap();
    let off = engine(BASE, false);
    let a = conversations(&on, 3, 3, false, |_| 0);
    let b = conversations(&off, 3, 3, false, |_| 0);
    assert!(wait_idle(&on).checkpoints.hits > 0);
    // The first turns match (nothing restored); a later one must not.
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x[0], y[0]);
    }
    assert_ne!(a, b, "zeroed checkpoints went unnoticed");
}

#[test]
fn a_small_budget_evicts_and_recomputes_exactly() {
    // One checkpoint of the tiny K3 (its state is about 32 KiB).
    let s = Setup {
        checkpoint_bytes: 40 << 10,
        ..BASE
    };
    let (on, _) = on_and_off(s, false);
    let c = on.checkpoints;
    assert_eq!(on.checkpoint_slots, 1);
    assert!(c.evictions > 0 && c.misses > 0, "{c:?}");
    // Nothing at all: never a hit, still exact.
    let s = Setup {
        checkpoint_bytes: 0,
        ..BASE
    };
    let (on, _) = on_and_off(s, false);
    assert_eq!((on.checkpoint_slots, on.checkpoints.hits), (0, 0));
    assert_eq!(on.prefix.hits, 0);
}

#[test]
fn two_scopes_never_share_a_state() {
    let h = engine(BASE, true);
    // Two conversations with the same text in different scopes: the
    // second never hits what the first saved, and neither hits at turn 0.
    let same = |_c: usize| 0;
    let a = conversations(&h, 1, 1, false, same);
    let before = wait_idle(&h).checkpoints;
    let b = conversations(&h, 1, 1, false, |_| 42);
    let after = wait_idle(&h).checkpoints;
    assert_eq!(a, b);
    assert_eq!(after.hits, before.hits, "scope 42 hit scope 0's checkpoint");
    // In its own scope it hits.
    conversations(&h, 1, 1, false, |_| 42);
    assert!(wait_idle(&h).checkpoints.hits > after.hits);
}

#[test]
fn the_next_turn_resumes_where_the_answer_ended() {
    for proposer in [0, 2] {
        let h = engine(Setup { proposer, ..BASE }, true);
        // 48 prompt tokens: the prompt's own checkpoint is at 32.
        let mut hist = text(0, 48, 5);
        let req = |prompt: Vec<u32>, n| GenRequest {
            prompt,
            max_new_tokens: n,
            ignore_eos: true,
            ..Default::default()
        };
        let out = run(h.submit(req(hist.clone(), 20)).unwrap()).0;
        hist.extend(out);
        assert_eq!(wait_idle(&h).checkpoints.restored_tokens, 0);
        // 68 tokens fed back: the state its answer passed at 64 was kept.
        hist.push(1);
        hist.extend(text(1, 7, 5));
        run(h.submit(req(hist, 4)).unwrap());
        let s = wait_idle(&h);
        assert_eq!(
            (s.checkpoints.hits, s.checkpoints.restored_tokens),
            (1, 64),
            "proposer {proposer}: {:?}",
            s.checkpoints
        );
    }
}
