//! The goodput policy and the cross-request proposer inside the engine, on
//! tiny generated models: outputs stay exactly what plain decoding emits
//! (greedy), sampling still follows the target's distribution (chi-square,
//! with proposals from the pool of earlier requests), and the pool never
//! proposes one tenant's text to another.

mod common;

use candle_core::quantized::GgmlDType;
use common::{chi_square, collect_tokens, exact_two_token_joint, tiny_model, wait_idle};
use specgate::engine::scheduler::SchedulerConfig;
use specgate::engine::{
    spawn, EngineConfig, EngineHandle, Event, Fault, GenRequest, KvSize, ProposerKind,
    SuffixOptions,
};
use specgate_draft::{DraftPolicy, SuffixConfig};
use specgate_verify::tiny::TinySpec;
use specgate_verify::{Model, Sampler, SamplingParams};

fn target() -> Model {
    tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q6K,
            ..TinySpec::qwen2(31)
        },
        "target.gguf",
    )
}

fn draft() -> Model {
    tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q4K,
            ..TinySpec::qwen2(31)
        },
        "draft.gguf",
    )
}

fn goodput() -> DraftPolicy {
    DraftPolicy::Goodput {
        max_k: 6,
        alpha: 0.3,
        initial_acceptance: 0.9,
        probe_every: 4,
    }
}

/// [`goodput`] probing a sequence left at k = 0 every step. A probe is
/// only made where a draft accepted as often as `initial_acceptance` says
/// would pay: at 1 every lookup with room passes, so whether the tiny
/// models' step timings make drafting pay does not decide whether the
/// proposers are exercised.
fn probing() -> DraftPolicy {
    let mut p = goodput();
    if let DraftPolicy::Goodput {
        probe_every,
        initial_acceptance,
        ..
    } = &mut p
    {
        *probe_every = 1;
        *initial_acceptance = 1.0;
    }
    p
}

fn pool(global: bool) -> Option<SuffixOptions> {
    Some(SuffixOptions {
        pool: SuffixConfig::default(),
        global,
    })
}

fn engine(
    target: Model,
    proposer: ProposerKind,
    policy: DraftPolicy,
    suffix: Option<SuffixOptions>,
) -> EngineHandle {
    let cfg = EngineConfig {
        kv: KvSize::Blocks(256),
        block_size: 16,
        scheduler: SchedulerConfig {
            max_num_seqs: 32,
            max_num_batched_tokens: 128,
        },
        policy,
        suffix,
        tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
        prefix: Default::default(),
        row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
    };
    spawn(target, proposer, None, cfg).unwrap().0
}

/// Prompts with repeats (own-context lookups find them) and without
/// (only the pool or the draft can guess).
fn request(i: usize) -> GenRequest {
    let len = 4 + (i * 7) % 30;
    let prompt: Vec<u32> = if i.is_multiple_of(2) {
        (0..len)
            .map(|j| ((i * 31 + j * (1 + i % 3)) % 50) as u32)
            .collect()
    } else {
        (0..len).map(|j| (i * 53 + j * 11) as u32 % 384).collect()
    };
    GenRequest {
        prompt,
        max_new_tokens: 8 + (i * 11) % 24,
        ignore_eos: true,
        ..Default::default()
    }
}

fn run_all(h: &EngineHandle, reqs: Vec<GenRequest>) -> Vec<Vec<u32>> {
    let rxs: Vec<_> = reqs.into_iter().map(|r| h.submit(r).unwrap()).collect();
    rxs.into_iter().map(collect_tokens).collect()
}

#[test]
fn goodput_with_lookups_and_the_pool_emits_what_plain_decoding_emits() {
    let n = 16;
    let reqs = || (0..n).map(request).collect::<Vec<_>>();
    let plain = engine(
        target(),
        ProposerKind::None,
        DraftPolicy::Fixed { k: 0 },
        None,
    );
    let reference = run_all(&plain, reqs());
    let ngram = || ProposerKind::Ngram { min_n: 1, max_n: 3 };
    let draft = || ProposerKind::Draft(draft());
    let proposers: [(&str, &dyn Fn() -> ProposerKind); 2] = [("ngram", &ngram), ("draft", &draft)];
    for (name, proposer) in proposers {
        // Goodput decides from measured step times whether a lookup pays,
        // so whether the pool gets a turn there differs between runs; the
        // fixed policy drafts wherever something was found, so there the
        // pool's turn follows from the text alone and must come.
        for (policy_name, policy) in [
            ("goodput", probing()),
            ("fixed", DraftPolicy::Fixed { k: 4 }),
        ] {
            let h = engine(target(), proposer(), policy, pool(false));
            // The second wave repeats the first: the pool now holds its text.
            for wave in 0..2 {
                let got = run_all(&h, reqs());
                for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
                    assert_eq!(g, r, "{name}, {policy_name}, wave {wave}, request {i}");
                }
            }
            let s = wait_idle(&h);
            eprintln!(
                "{name}, {policy_name}: drafted {} (context {}, pool {} of which {} accepted), accepted {}",
                s.spec.draft_tokens,
                s.context_draft_tokens,
                s.pool_draft_tokens,
                s.pool_accepted_tokens,
                s.spec.accepted_tokens
            );
            assert!(
                s.spec.draft_tokens > 0,
                "{name}, {policy_name}: nothing drafted"
            );
            assert!(
                s.spec.accepted_tokens > 0,
                "{name}, {policy_name}: nothing accepted"
            );
            if policy_name == "fixed" {
                assert!(s.pool_draft_tokens > 0, "{name}: the pool never proposed");
                assert!(
                    s.pool_accepted_tokens > 0,
                    "{name}: nothing the pool proposed was accepted"
                );
            }
        }
    }
}

#[test]
fn the_pool_never_proposes_another_tenants_text() {
    // No token repeats in the prompt, so only the pool can guess.
    let req = |tenant| GenRequest {
        prompt: (0..24).map(|j| (j * 13 + 5) % 384).collect(),
        max_new_tokens: 24,
        ignore_eos: true,
        tenant,
        ..Default::default()
    };
    let fixed = DraftPolicy::Fixed { k: 4 };
    for global in [false, true] {
        let h = engine(
            target(),
            ProposerKind::Ngram { min_n: 3, max_n: 3 },
            fixed.clone(),
            pool(global),
        );
        let first = run_all(&h, vec![req(7)]);
        let before = wait_idle(&h).pool_draft_tokens;
        let other = run_all(&h, vec![req(8)]);
        let after_other = wait_idle(&h).pool_draft_tokens;
        let again = run_all(&h, vec![req(7)]);
        let after_same = wait_idle(&h).pool_draft_tokens;
        assert_eq!(first, other);
        assert_eq!(first, again);
        assert!(after_same > after_other, "the owner's pool never proposed");
        if global {
            // One pool for all: the other tenant is proposed the text
            // (which is why the default scopes by API key).
            assert!(after_other > before);
        } else {
            assert_eq!(after_other, before, "tenant 8 was proposed tenant 7's text");
        }
    }
}

const V: usize = 12;

fn tiny12(seed: u64, name: &str) -> Model {
    tiny_model(
        &TinySpec {
            vocab_size: V,
            dtype: GgmlDType::F32,
            logit_scale: 0.7,
            ..TinySpec::llama(seed)
        },
        name,
    )
}

fn sampling(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// Exact warped p(x1, x2) of `target` after `prompt`.
fn exact(target: &Model, prompt: &[u32]) -> Vec<f64> {
    exact_two_token_joint(target, prompt, &mut Sampler::new(sampling(0)))
}

/// Sampling through the engine with the pool of earlier requests
/// proposing (each proposal the previous samples' text: deterministic,
/// unlike the target) follows the target's joint distribution of the
/// first two tokens: under the goodput policy (which drafts while the
/// pool's guesses pay and stops when they do not) and with a draft every
/// round.
#[test]
fn sampling_with_pool_proposals_follows_the_target_distribution() {
    let n = 6000;
    let prompt = vec![1u32, 5, 9, 2, 7];
    let target = || tiny12(21, "target12.gguf");
    let exact = exact(&target(), &prompt);
    // Under goodput most pool guesses here are refused (about one in six
    // is accepted at this temperature, so they do not pay) and its drafts
    // are mostly probes: probing every step keeps them coming (each
    // request lives two steps, too short to reach `probe_every` = 4). A
    // probe is at most one per engine step, and how many requests share a
    // step follows how fast the engine runs beside this binary's other
    // tests (15 pool drafts in one loaded run, over 50 alone): so goodput
    // need only have drafted, and the fixed run (a draft every round) is
    // the one whose drafts are both accepted and refused.
    for (name, policy, least) in [
        ("goodput", probing(), 1),
        ("fixed k = 1", DraftPolicy::Fixed { k: 1 }, n / 2),
    ] {
        let h = engine(
            target(),
            ProposerKind::Ngram { min_n: 3, max_n: 3 },
            policy,
            pool(false),
        );
        let mut counts = vec![0usize; V * V];
        for wave in 0..n / 50 {
            let reqs = (0..50)
                .map(|i| GenRequest {
                    prompt: prompt.clone(),
                    max_new_tokens: 2,
                    sampling: sampling(1000 + (wave * 50 + i) as u64),
                    ignore_eos: true,
                    ..Default::default()
                })
                .collect();
            for out in run_all(&h, reqs) {
                assert_eq!(out.len(), 2);
                counts[out[0] as usize * V + out[1] as usize] += 1;
            }
        }
        let s = wait_idle(&h);
        let impossible: usize = counts
            .iter()
            .zip(&exact)
            .filter(|(_, &p)| p == 0.0)
            .map(|(c, _)| c)
            .sum();
        let (stat, crit) = chi_square(&exact, &counts, n);
        eprintln!(
            "{name}: chi2 {stat:.1} (critical {crit:.1}); pool drafted {}, accepted {}",
            s.pool_draft_tokens, s.pool_accepted_tokens
        );
        assert_eq!(impossible, 0, "{name}: a token outside top-p was emitted");
        assert!(stat < crit, "{name}: chi2 {stat} >= {crit}");
        // The pool really proposed, and (drafting every round) was
        // sometimes right and sometimes not.
        assert!(s.pool_draft_tokens as usize >= least, "{name}: {s:?}");
        if least > 1 {
            assert!(s.pool_accepted_tokens > 0 && s.pool_accepted_tokens < s.pool_draft_tokens);
        }
    }
}

/// The reduced draft head is on by default where a shipped list was made
/// for the draft's vocabulary, off where none was, and a named list made
/// for another vocabulary is refused.
#[test]
fn draft_head_lists_are_matched_by_vocabulary() {
    use specgate::server::draft_head;
    use specgate_verify::model::vocab_fingerprint;
    use std::path::Path;
    let (_, tiny_draft) = common::model_files();
    let tiny_vocab = vocab_fingerprint(&tiny_draft).unwrap().unwrap();
    assert!(tiny_vocab.ends_with(":384"), "{tiny_vocab}");
    // No list under configs/ is for the tiny vocabulary: full head.
    assert!(draft_head(Some(Path::new("auto")), &tiny_draft)
        .unwrap()
        .is_none());
    assert!(draft_head(Some(Path::new("off")), &tiny_draft)
        .unwrap()
        .is_none());
    assert!(draft_head(None, &tiny_draft).unwrap().is_none());
    // The shipped Qwen list names the Qwen vocabulary: refused here.
    let qwen_list = Path::new("configs/draft-head-qwen2.5.txt");
    let e = draft_head(Some(qwen_list), &tiny_draft)
        .unwrap_err()
        .to_string();
    assert!(e.contains("made for the vocabulary"), "{e}");
    // A list made for the tiny vocabulary is taken.
    let dir = common::scratch_dir("head-lists");
    std::fs::create_dir_all(&dir).unwrap();
    let mine = dir.join("draft-head-tiny.txt");
    std::fs::write(&mine, format!("# vocabulary: {tiny_vocab}\n3\n1\n2\n")).unwrap();
    let (path, ids) = draft_head(Some(&mine), &tiny_draft).unwrap().unwrap();
    assert_eq!((path, ids), (mine, vec![3, 1, 2]));
    // On the real 0.5B draft, "auto" finds the shipped list.
    let real = Path::new("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    if real.exists() {
        let (path, ids) = draft_head(Some(Path::new("auto")), real).unwrap().unwrap();
        assert_eq!(path, Path::new("configs/draft-head-qwen2.5.txt"));
        assert_eq!(ids.len(), 32768);
    }
}

/// The draft model is switched off at a batch size where it is measured
/// losing (each of its steps made 40 ms dearer than the cost model measured
/// at start), whatever the acceptance; outputs stay plain decoding's.
#[test]
fn a_draft_model_measured_losing_is_switched_off() {
    let req = |i: usize| GenRequest {
        prompt: (0..12).map(|j| ((j * 7 + i * 3) % 384) as u32).collect(),
        max_new_tokens: 40,
        ignore_eos: true,
        ..Default::default()
    };
    let plain = engine(
        target(),
        ProposerKind::None,
        DraftPolicy::Fixed { k: 0 },
        None,
    );
    // Requests that ask for 2 drafts a step, so the model runs (asked-for
    // lengths are kept) and every step of it is scored: with a draft as
    // large as the target, the planner alone may not draft at all, or stop
    // by price, and never let the guard see the loss.
    let asking = |i: usize| GenRequest {
        num_speculative_tokens: Some(2),
        ..req(i)
    };
    let h = engine(target(), ProposerKind::Draft(draft()), goodput(), None);
    let fast = run_all(&h, vec![asking(0)]);
    let start = wait_idle(&h);
    eprintln!(
        "without the fault: {} of {} steps ran the draft model",
        start.model_steps, start.steps
    );
    assert!(start.model_steps > 0, "the draft model never ran");
    h.inject_fault(Fault::SlowDraft(40)).unwrap();
    assert_eq!(fast, run_all(&plain, vec![req(0)]));
    // One request at a time: every step has one decoding sequence.
    for i in 1..4 {
        assert_eq!(run_all(&h, vec![asking(i)]), run_all(&plain, vec![req(i)]));
    }
    let mid = wait_idle(&h);
    assert!(mid.model_vetoes >= 1, "never switched off: {mid:?}");
    for i in 4..8 {
        assert_eq!(run_all(&h, vec![req(i)]), run_all(&plain, vec![req(i)]));
    }
    let end = wait_idle(&h);
    let (steps, model) = (end.steps - mid.steps, end.model_steps - mid.model_steps);
    eprintln!("after the switch: {model} of {steps} steps ran the draft model");
    // Only the re-checks (one step in 32) may still run it.
    assert!(
        model * 8 <= steps,
        "{model} of {steps} steps ran the draft model"
    );
}

/// A sequence whose prompt sits in blocks an earlier sequence's draft
/// filled (the target's prefix cache hands it the same blocks) catches up
/// only on the rest, and drafts exactly what a draft starting over would.
#[test]
fn the_draft_reuses_its_cache_in_shared_blocks() {
    use specgate_draft::{ModelDraft, ProposeRequest, Proposer};
    use specgate_verify::Sampler;
    use std::sync::Arc;
    let prompt: Vec<u32> = (0..40).map(|i| (i * 41 % 300) as u32 + 3).collect();
    let other: Vec<u32> = prompt.iter().map(|t| t + 1).collect();
    let model = Arc::new(draft());
    // Proposes 4 tokens for `seq` and returns them with the rows of the
    // proposal's first forward (its catch-up).
    let propose = |d: &mut ModelDraft, seq: u64, ctx: &[u32], table: &[u32]| {
        let mut sampler = Sampler::new(SamplingParams::default());
        let tokens = d
            .propose(&mut [ProposeRequest {
                seq_id: seq,
                context: ctx,
                block_table: table,
                k: 4,
                branches: 0,
                sampler: &mut sampler,
            }])
            .unwrap()
            .remove(0)
            .tokens;
        (tokens, d.take_timings()[0].0)
    };
    let mut d = ModelDraft::new(model.clone(), 64, 16).unwrap();
    let (first, rows) = propose(&mut d, 1, &prompt, &[3, 5, 9, 11]);
    assert_eq!(rows, 40);
    d.release(1);
    // Blocks 3 and 5 hold the first 32 tokens' draft K/V: 8 rows left.
    let (again, rows) = propose(&mut d, 2, &prompt, &[3, 5, 12, 13]);
    assert_eq!((&again, rows), (&first, 8));
    // Other blocks, or other tokens in the same blocks: from the start.
    assert_eq!(propose(&mut d, 3, &prompt, &[20, 21, 22, 23]).1, 40);
    assert_eq!(propose(&mut d, 4, &other, &[3, 5, 24, 25]).1, 40);
    // Sequence 4 overwrote blocks 3 and 5 with its own tokens.
    assert_eq!(propose(&mut d, 5, &prompt, &[3, 5, 26, 27]).1, 40);
    assert_eq!(propose(&mut d, 6, &prompt, &[20, 21, 28, 29]), (first, 8));
}

/// A prompt runs through the draft only where the plan drafts with the
/// model: while sequences decode, if it drafts with the model for anyone
/// this step; while nothing decodes (a burst of prompts), if it would for
/// the batch they make. A policy that never drafts with the model (max_k
/// 0) prefills nothing, whether the prompt arrives alone or beside a
/// decoding sequence; a request asking for drafts (`num_speculative_tokens`)
/// gets its prompt prefilled.
#[test]
fn prompts_skip_the_draft_where_the_plan_drafts_for_no_one() {
    let never = DraftPolicy::Goodput {
        max_k: 0,
        alpha: 0.3,
        initial_acceptance: 0.9,
        probe_every: 4,
    };
    let h = engine(target(), ProposerKind::Draft(draft()), never, None);
    let a = GenRequest {
        prompt: (0..20).map(|j| j + 5).collect(),
        max_new_tokens: 200,
        ignore_eos: true,
        ..Default::default()
    };
    let mut rx = h.submit(a).unwrap();
    // A decodes once its first tokens are out.
    loop {
        match rx.blocking_recv() {
            Some(Event::Tokens { .. }) => break,
            Some(Event::PromptLogprobs(_)) => {}
            _ => panic!("request A ended before its first tokens"),
        }
    }
    let b = GenRequest {
        prompt: (0..30).map(|j| j + 100).collect(),
        max_new_tokens: 4,
        ignore_eos: true,
        ..Default::default()
    };
    collect_tokens(h.submit(b).unwrap());
    collect_tokens(rx);
    let s = wait_idle(&h);
    assert_eq!(
        s.draft_prefill_tokens, 0,
        "neither A's prompt (alone) nor B's (beside A) may run through the draft"
    );
    // Alone, asking for 3 drafts a step: its 24 prompt rows run through
    // the draft before its first decode step.
    let c = GenRequest {
        prompt: (0..24).map(|j| j + 200).collect(),
        max_new_tokens: 8,
        ignore_eos: true,
        num_speculative_tokens: Some(3),
        ..Default::default()
    };
    collect_tokens(h.submit(c).unwrap());
    let s = wait_idle(&h);
    assert!(
        s.draft_prefill_tokens >= 23,
        "C's prompt did not run through the draft: {} rows",
        s.draft_prefill_tokens
    );
    assert!(s.spec.draft_tokens > 0, "C never drafted");
}
