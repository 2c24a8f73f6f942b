//! The tiny Kimi-K2-architecture model (tests/fixtures/tiny-kimi: MLA with
//! a latent cache + MoE, checked against transformers in
//! verify/tests/deepseek.rs) as the verifier: greedy speculative decoding
//! with a tiny llama draft and with n-gram lookup emits exactly what plain
//! greedy decoding emits, and under continuous batching concurrent requests
//! emit what each emits alone.

mod common;

use common::{collect_tokens, spec_decode, tiny_model};
use specgate::engine::scheduler::SchedulerConfig;
use specgate::engine::{spawn, EngineConfig, GenRequest, KvSize, ProposerKind};
use specgate::spec::SpecStats;
use specgate_draft::{DraftPolicy, ModelDraft, NgramProposer, Proposer};
use specgate_verify::model::load_safetensors_tp;
use specgate_verify::tiny::TinySpec;
use specgate_verify::{Model, SamplingParams};
use std::path::Path;
use std::sync::Arc;

const BS: usize = 16;

fn kimi() -> Model {
    kimi_tp(1)
}

/// The fixture sharded over `world` tensor-parallel ranks in one Model.
fn kimi_tp(world: usize) -> Model {
    load_safetensors_tp(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-kimi"),
        world,
    )
    .unwrap()
}

/// A tiny llama with the Kimi fixture's vocabulary (384), as GGUF.
fn llama_draft(name: &str) -> Model {
    tiny_model(&TinySpec::llama(21), name)
}

/// Greedy-decodes `max_new` tokens after `prompt` with fixed k (0 = plain).
fn decode(
    target: &Model,
    proposer: Option<&mut dyn Proposer>,
    prompt: &[u32],
    max_new: usize,
    k: usize,
    stats: &mut SpecStats,
) -> Vec<u32> {
    spec_decode(
        target,
        proposer,
        prompt,
        max_new,
        k,
        SamplingParams::default(),
        stats,
    )
}

#[test]
fn kimi_verifier_greedy_speculation_equals_plain_decoding() {
    let target = kimi();
    let draft = Arc::new(llama_draft("draft.gguf"));
    let prompts: [Vec<u32>; 2] = [
        vec![5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
        (0..20).map(|i| (i * 37 % 384) as u32).collect(),
    ];
    let max_new = 24;
    let mut proposed = 0;
    for prompt in &prompts {
        let plain = decode(&target, None, prompt, max_new, 0, &mut SpecStats::default());
        for k in [1, 3, 5] {
            let mut ngram = NgramProposer::new(1, 3).unwrap();
            let mut s = SpecStats::default();
            let got = decode(&target, Some(&mut ngram), prompt, max_new, k, &mut s);
            assert_eq!(got, plain, "ngram k={k} prompt {prompt:?}");
            let mut d = ModelDraft::new(draft.clone(), 8, BS).unwrap();
            let mut s = SpecStats::default();
            let got = decode(&target, Some(&mut d), prompt, max_new, k, &mut s);
            assert_eq!(got, plain, "llama draft k={k} prompt {prompt:?}");
            proposed += s.draft_tokens;
        }
    }
    assert!(proposed > 0, "the draft never proposed");
}

fn request(i: usize) -> GenRequest {
    let len = 3 + (i * 7) % 30;
    GenRequest {
        prompt: (0..len)
            .map(|j| ((i * 31 + j * (1 + i % 3)) % 60) as u32)
            .collect(),
        max_new_tokens: 4 + (i * 5) % 16,
        sampling: SamplingParams::default(),
        stop_token_ids: vec![],
        ignore_eos: true,
        method: None,
        num_speculative_tokens: None,
        ..Default::default()
    }
}

#[test]
fn kimi_under_continuous_batching_emits_what_each_request_emits_alone() {
    let engine = |target, proposer, seqs, tokens| {
        let cfg = EngineConfig {
            kv: KvSize::Blocks(96),
            block_size: BS,
            scheduler: SchedulerConfig {
                max_num_seqs: seqs,
                max_num_batched_tokens: tokens,
            },
            policy: DraftPolicy::Fixed { k: 3 },
            suffix: None,
            tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
            prefix: Default::default(),
            row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
        };
        spawn(target, proposer, None, cfg).unwrap().0
    };
    let n = 12;
    let h = engine(kimi(), ProposerKind::None, 1, 64);
    let alone: Vec<Vec<u32>> = (0..n)
        .map(|i| collect_tokens(h.submit(request(i)).unwrap()))
        .collect();
    for proposer in [
        ProposerKind::None,
        ProposerKind::Ngram { min_n: 1, max_n: 3 },
        ProposerKind::Draft(llama_draft("engine-draft.gguf")),
    ] {
        // A small token budget chunks prompts and mixes them with decodes.
        let h = engine(kimi(), proposer, 12, 40);
        let rxs: Vec<_> = (0..n).map(|i| h.submit(request(i)).unwrap()).collect();
        let together: Vec<Vec<u32>> = rxs.into_iter().map(collect_tokens).collect();
        assert_eq!(together, alone);
    }
    // The target sharded over 2 ranks (heads split, experts distributed,
    // each rank its own latent cache), batched, with the draft: the same
    // tokens (its logits differ from world 1's by float rounding only).
    let h = engine(
        kimi_tp(2),
        ProposerKind::Draft(llama_draft("engine-draft-tp.gguf")),
        12,
        40,
    );
    let rxs: Vec<_> = (0..n).map(|i| h.submit(request(i)).unwrap()).collect();
    let together: Vec<Vec<u32>> = rxs.into_iter().map(collect_tokens).collect();
    assert_eq!(together, alone);
}
