//! ModelDraft's branches on a tiny random-weight llama built in code: leaves
//! appear only where the chain token's probability is below the threshold
//! (at greedy params the draft's top probability),
//! are the tokens it ranks next, and never change the chain, its q or the
//! sampler's random stream.

use super::*;
use specgate_verify::tiny::TinySpec;
use specgate_verify::{Sampler, SamplingParams};

const VOCAB: usize = 64;
const BLOCK: usize = 16;
const TABLE: [u32; 4] = [0, 1, 2, 3];

/// A tiny llama, flat enough (small logit scale) that some draft positions
/// are unsure, written as GGUF in this process's scratch space and loaded.
fn tiny_model(seed: u64) -> Arc<Model> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("specgate-draft-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    let spec = TinySpec {
        vocab_size: VOCAB,
        logit_scale: 1.5,
        ..TinySpec::llama(seed)
    };
    spec.write_gguf(&path, &[]).unwrap();
    let model = specgate_verify::model::load_gguf(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    Arc::new(model)
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// One proposal of `k` tokens with `branches` allowed, from a fresh draft
/// (so each call starts from the same state), and the sampler after it.
fn propose(
    model: &Arc<Model>,
    unsure_below: f32,
    context: &[u32],
    k: usize,
    branches: usize,
    params: SamplingParams,
) -> (Proposal, Sampler) {
    let mut draft = ModelDraft::new(model.clone(), TABLE.len(), BLOCK).unwrap();
    draft.set_unsure_below(unsure_below);
    let mut sampler = Sampler::new(params);
    let p = draft
        .propose(&mut [ProposeRequest {
            seq_id: 1,
            context,
            block_table: &TABLE,
            k,
            branches,
            sampler: &mut sampler,
        }])
        .unwrap()
        .remove(0);
    (p, sampler)
}

/// The draft's raw logits after `tokens`, from a forward of its own.
fn logits_after(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut pool = KvPool::for_model(model, TABLE.len(), BLOCK).unwrap();
    model
        .forward_one(&mut pool, tokens, 0, &TABLE, LogitsWanted::Last)
        .unwrap()
        .remove(0)
}

/// Token ids by softmax probability (temperature 1), highest first, ties
/// by id, with the probabilities.
fn ranking(logits: &[f32]) -> Vec<(u32, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let mut r: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, (f64::from(l - max).exp() / z) as f32))
        .collect();
    r.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    r
}

/// Leaves grouped by chain position (a leaf under node p - 1 sits at
/// position p), in the order given.
fn leaves_at(p: &Proposal) -> Vec<Vec<u32>> {
    let mut at = vec![Vec::new(); p.tokens.len()];
    for &(t, parent) in &p.branches {
        let pos = parent.map_or(0, |n| n + 1);
        assert!(pos < p.tokens.len(), "a leaf hangs under a leaf: {p:?}");
        at[pos].push(t);
    }
    at
}

const CONTEXTS: [&[u32]; 3] = [&[1, 5, 9, 2, 7], &[3, 3, 40, 12], &[60, 0, 17, 33, 8, 21]];
const K: usize = 6;

#[test]
fn greedy_leaves_are_the_next_ranked_tokens_where_the_draft_is_unsure() {
    let model = tiny_model(11);
    let (mut unsure, mut sure) = (0, 0);
    for ctx in CONTEXTS {
        let (chain, _) = propose(&model, 0.8, ctx, K, 0, greedy());
        assert!(chain.branches.is_empty());
        assert_eq!(chain.tokens.len(), K);
        // Reference rankings from independent forwards.
        let ranks: Vec<Vec<(u32, f32)>> = (0..K)
            .map(|p| {
                let mut h = ctx.to_vec();
                h.extend_from_slice(&chain.tokens[..p]);
                ranking(&logits_after(&model, &h))
            })
            .collect();
        for (p, r) in ranks.iter().enumerate() {
            assert_eq!(chain.tokens[p], r[0].0, "the chain is the draft's argmax");
        }
        // A threshold between the observed top probabilities, so that this
        // context has sure and unsure positions where it can.
        let mut tops: Vec<f32> = ranks.iter().map(|r| r[0].1).collect();
        tops.sort_by(f32::total_cmp);
        let threshold = (tops[K / 2 - 1] + tops[K / 2]) / 2.0;
        for budget in [1, 3, 40] {
            let (t, _) = propose(&model, threshold, ctx, K, budget, greedy());
            assert_eq!((&t.tokens, &t.q), (&chain.tokens, &chain.q));
            assert!(t.branches.len() <= budget);
            t.tree().unwrap();
            let at = leaves_at(&t);
            for (p, r) in ranks.iter().enumerate() {
                if r[0].1 >= threshold {
                    assert!(at[p].is_empty(), "leaves at sure position {p}");
                    sure += 1;
                    continue;
                }
                unsure += 1;
                // The next-ranked tokens, in rank order, while the offered
                // mass is below the threshold.
                let want: Vec<u32> = r[1..1 + at[p].len()].iter().map(|x| x.0).collect();
                assert_eq!(at[p], want, "position {p}");
                let offered: f32 = r[..at[p].len()].iter().map(|x| x.1).sum();
                assert!(offered < threshold + 1e-6, "one leaf too many at {p}");
                if budget == 40 {
                    assert!(!at[p].is_empty(), "unsure position {p} got no leaf");
                    let with_all: f32 = r[..=at[p].len()].iter().map(|x| x.1).sum();
                    assert!(with_all >= threshold - 1e-6, "stopped early at {p}");
                }
            }
            if budget == 1 && !t.branches.is_empty() {
                // The one leaf goes to the least sure position.
                let least = (0..K)
                    .min_by(|&a, &b| ranks[a][0].1.total_cmp(&ranks[b][0].1))
                    .unwrap();
                assert_eq!(t.branches, vec![(ranks[least][1].0, least.checked_sub(1))]);
            }
        }
    }
    assert!(sure > 0 && unsure > 0, "sure {sure}, unsure {unsure}");
}

#[test]
fn sampled_leaves_rank_by_q_and_leave_chain_q_and_draws_alone() {
    let model = tiny_model(12);
    let mut leaves_seen = 0;
    for (n, ctx) in CONTEXTS.iter().enumerate() {
        for seed in 0..4u64 {
            let params = sampled(seed * 10 + n as u64);
            let (chain, mut s0) = propose(&model, 0.8, ctx, K, 0, params);
            let (t, mut s1) = propose(&model, 0.8, ctx, K, 8, params);
            assert!(chain.branches.is_empty());
            // Bit for bit the same chain and q, and the same random stream
            // position afterwards.
            assert_eq!((&t.tokens, &t.q), (&chain.tokens, &chain.q));
            assert_eq!(s0.uniform().to_bits(), s1.uniform().to_bits());
            let q = t.q.as_ref().unwrap();
            let at = leaves_at(&t);
            for (p, qp) in q.iter().enumerate() {
                let mut r: Vec<(u32, f32)> = qp
                    .iter()
                    .enumerate()
                    .filter(|x| *x.1 > 0.0)
                    .map(|(i, &x)| (i as u32, x))
                    .collect();
                r.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                // Unsure: the draft's most likely token has less than 0.8
                // of q (whichever token was drawn).
                if r[0].1 >= 0.8 {
                    assert!(at[p].is_empty(), "leaves at sure position {p}");
                    continue;
                }
                let others: Vec<u32> = r
                    .iter()
                    .map(|x| x.0)
                    .filter(|&x| x != t.tokens[p])
                    .take(at[p].len())
                    .collect();
                assert_eq!(at[p], others, "position {p}: {qp:?}");
                // A budget of 8 reaches every one of the 6 positions in the
                // first round.
                assert_eq!(at[p].is_empty(), r.len() == 1, "position {p}");
                leaves_seen += at[p].len();
            }
        }
    }
    assert!(leaves_seen > 0, "the test must exercise leaves");
}

#[test]
fn branch_leaves_do_not_disturb_the_cache_between_proposals() {
    // Two rounds on one draft with branches, the second after the target
    // accepted two drafts: the same chain as a draft that never branched.
    let model = tiny_model(13);
    let ctx = CONTEXTS[0];
    let mut drafts = [
        ModelDraft::new(model.clone(), TABLE.len(), BLOCK).unwrap(),
        ModelDraft::new(model.clone(), TABLE.len(), BLOCK).unwrap(),
    ];
    drafts[1].set_unsure_below(2.0);
    let mut got: Vec<Vec<Proposal>> = vec![Vec::new(), Vec::new()];
    for (d, (draft, out)) in drafts.iter_mut().zip(&mut got).enumerate() {
        let mut h = ctx.to_vec();
        for _ in 0..2 {
            let mut s = Sampler::new(greedy());
            let p = draft
                .propose(&mut [ProposeRequest {
                    seq_id: 7,
                    context: &h,
                    block_table: &TABLE,
                    k: 4,
                    branches: 4 * d,
                    sampler: &mut s,
                }])
                .unwrap()
                .remove(0);
            // Two drafts accepted, then a correction (the same for both).
            h.extend_from_slice(&p.tokens[..2]);
            h.push(63);
            out.push(p);
        }
    }
    assert!(got[0].iter().all(|p| p.branches.is_empty()));
    assert!(got[1].iter().all(|p| p.branches.len() == 4));
    for (a, b) in got[0].iter().zip(&got[1]) {
        assert_eq!(a.tokens, b.tokens);
    }
}
