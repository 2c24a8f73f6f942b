//! One sequence decoded through speculative rounds, for the speculation
//! tests: a fresh pool with reversed block ids (nothing may depend on
//! contiguous blocks) and state slot 1 of 2 (a slot mix-up shows on models
//! with recurrent layers; others ignore it).

use specgate::spec::{spec_round, RoundInput, SpecSeq, SpecStats};
use specgate_draft::{DraftPolicy, PolicyState, Proposer};
use specgate_verify::{Controls, KvPool, LogitsWanted, Model, Sampler, SamplingParams, SeqInput};

/// Block size of the pools [`spec_decode`] makes.
pub const SPEC_BS: usize = 16;

/// Decodes `max_new` tokens after `prompt` with fixed k (0 = plain), the
/// prompt but its last token prefilled first; returns the new tokens.
pub fn spec_decode(
    target: &Model,
    proposer: Option<&mut dyn Proposer>,
    prompt: &[u32],
    max_new: usize,
    k: usize,
    sampling: SamplingParams,
    stats: &mut SpecStats,
) -> Vec<u32> {
    let sampler = Sampler::new(sampling);
    spec_decode_tree(target, proposer, prompt, max_new, (k, 0), sampler, stats)
}

/// [`spec_decode`] letting the proposer add up to `branches` nodes beside
/// its chain of `k` (token trees) every round, sampling with `sampler`
/// (its processing included).
pub fn spec_decode_tree(
    target: &Model,
    mut proposer: Option<&mut dyn Proposer>,
    prompt: &[u32],
    max_new: usize,
    (k, branches): (usize, usize),
    sampler: Sampler,
    stats: &mut SpecStats,
) -> Vec<u32> {
    const SLOT: u32 = 1;
    let blocks = (prompt.len() + max_new + k + branches + 1).div_ceil(SPEC_BS);
    let mut pool = KvPool::for_model_with_state_slots(target, blocks, SPEC_BS, 2).unwrap();
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    target
        .forward_rows(
            &mut pool,
            &[SeqInput {
                tokens: &prompt[..prompt.len() - 1],
                start_pos: 0,
                block_table: &table,
                logits: LogitsWanted::None,
                state_slot: SLOT,
            }],
        )
        .unwrap();
    let mut seq = SpecSeq {
        id: 7,
        tokens: prompt.to_vec(),
        sampler,
        policy_state: PolicyState::default(),
    };
    let policy = DraftPolicy::Fixed { k };
    while seq.tokens.len() - prompt.len() < max_new {
        let left = max_new - (seq.tokens.len() - prompt.len());
        spec_round(
            target,
            &mut pool,
            proposer.as_deref_mut(),
            &policy,
            &mut [RoundInput {
                seq: &mut seq,
                block_table: &table,
                k: k.min(left - 1),
                branches,
                state_slot: SLOT,
                snapshot: None,
            }],
            &[],
            stats,
        )
        .unwrap();
    }
    if let Some(p) = proposer {
        p.release(7);
    }
    seq.tokens[prompt.len()..].to_vec()
}

/// Penalties and a logit bias strong enough that a verified row processed
/// with a wrong history, or a draft q without them, is far from the right
/// distribution: what the sampling tests process with.
pub fn strong_controls() -> Controls {
    Controls {
        presence_penalty: 0.8,
        frequency_penalty: 0.6,
        repetition_penalty: 1.6,
        logit_bias: vec![(3, 1.5), (4, -1.0), (10, 0.8)],
        ..Controls::default()
    }
}

/// The exact law of `target`'s first two tokens after `prompt` under
/// `sampler` (its processing, then its params' warp), row-major
/// `[x1 * vocab + x2]`: the second row is processed with x1 in its
/// history. For tiny vocabularies (one forward per first token).
pub fn exact_two_token_joint(target: &Model, prompt: &[u32], sampler: &mut Sampler) -> Vec<f64> {
    let w = *sampler.params();
    let table = [0u32, 1];
    let mut pool = KvPool::new(target.config(), 2, 16).unwrap();
    let first = target
        .forward_one(&mut pool, prompt, 0, &table, LogitsWanted::Last)
        .unwrap();
    let mut row = first[0].clone();
    sampler.process(&mut row, &[]).unwrap();
    let p1 = w.warp(&row);
    let v = p1.len();
    let mut joint = vec![0f64; v * v];
    for x1 in 0..v {
        if p1[x1] == 0.0 {
            continue;
        }
        let next = target
            .forward_one(
                &mut pool,
                &[x1 as u32],
                prompt.len(),
                &table,
                LogitsWanted::Last,
            )
            .unwrap();
        let mut row = next[0].clone();
        sampler.process(&mut row, &[x1 as u32]).unwrap();
        let p2 = w.warp(&row);
        for x2 in 0..v {
            joint[x1 * v + x2] = p1[x1] as f64 * p2[x2] as f64;
        }
    }
    joint
}
