//! Tree acceptance: shape checks, greedy as the longest matching path, the
//! chain case bit for bit against `accept`, the sampled output's law
//! (chi-square) with penalties and branching proposers, and that a
//! verdict can only keep the accepted path's rows.

use super::*;
use crate::accept::{accept_greedy, accept_sampled};
use crate::process::{Controls, LogitsProcessor};
use crate::sample::SamplingParams;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A deterministic "model": logits in [-scale, scale] for the position
/// after `ctx`, from a hash of (seed, ctx).
fn model(seed: u64, ctx: &[u32], vocab: usize, scale: f32) -> Vec<f32> {
    let mut h = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for &t in ctx {
        h = splitmix(h ^ u64::from(t).wrapping_add(0x1234_5678));
    }
    (0..vocab)
        .map(|_| {
            h = splitmix(h);
            ((h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The target's rows for every position of `tree` under model `seed`.
fn tree_rows(tree: &TokenTree, seed: u64, vocab: usize, scale: f32) -> Vec<Vec<f32>> {
    std::iter::once(model(seed, &[], vocab, scale))
        .chain((0..tree.len()).map(|i| model(seed, &tree.path_tokens(i), vocab, scale)))
        .collect()
}

fn penalties() -> Controls {
    Controls {
        presence_penalty: 0.7,
        frequency_penalty: 0.4,
        repetition_penalty: 1.4,
        ..Controls::default()
    }
}

const PROMPT: [u32; 2] = [0, 3];

fn sampler(params: SamplingParams) -> Sampler {
    Sampler::new(params).with_processor(LogitsProcessor::new(penalties(), &PROMPT, None))
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: Some(seed),
        min_p: 0.0,
    }
}

/// A random tree of up to `max_nodes` nodes, depth <= 4; siblings distinct
/// when `distinct`.
fn random_tree(rng: &mut StdRng, vocab: u32, max_nodes: usize, distinct: bool) -> TokenTree {
    let mut t = TokenTree::new();
    let n = rng.random_range(0..=max_nodes);
    for _ in 0..n {
        let parent = match rng.random_range(0..=t.len()) {
            0 => None,
            p => Some(p - 1),
        };
        if parent.is_some_and(|p| t.depth(p) >= 4) {
            continue;
        }
        let taken: Vec<u32> = t.children(parent).iter().map(|&c| t.token(c)).collect();
        let free: Vec<u32> = (0..vocab)
            .filter(|x| !distinct || !taken.contains(x))
            .collect();
        if let Some(&tok) = free.get(rng.random_range(0..free.len().max(1))) {
            t.push(tok, parent).unwrap();
        }
    }
    t
}

#[test]
fn trees_are_validated_and_walkable() {
    assert_eq!(
        TokenTree::from_nodes([(5, None), (6, Some(1))]),
        Err(TreeError::ParentOutOfOrder { node: 1, parent: 1 })
    );
    assert_eq!(
        TokenTree::from_nodes([(5, Some(0))]),
        Err(TreeError::ParentOutOfOrder { node: 0, parent: 0 })
    );
    let mut t = TokenTree::from_nodes([(5, None), (6, None), (7, Some(1)), (8, Some(2))]).unwrap();
    assert_eq!(
        t.push(9, Some(9)),
        Err(TreeError::ParentOutOfOrder { node: 4, parent: 9 })
    );
    assert_eq!(t.len(), 4, "a refused push leaves the tree as it was");
    assert_eq!(t.push(9, Some(1)), Ok(4));
    assert_eq!(t.children(None), &[0, 1]);
    assert_eq!(t.children(Some(1)), &[2, 4]);
    assert!(t.children(Some(3)).is_empty());
    assert_eq!((t.depth(0), t.depth(3), t.max_depth()), (1, 3, 3));
    assert_eq!(t.path(3), vec![1, 2, 3]);
    assert_eq!(t.path_tokens(3), vec![6, 7, 8]);
    assert_eq!(t.parent(4), Some(1));
    assert!(!t.is_chain());
    let c = TokenTree::chain(&[4, 4, 2]);
    assert!(c.is_chain() && c.path(2) == vec![0, 1, 2] && c.max_depth() == 3);
    assert_eq!(TokenTree::new(), TokenTree::default());
    assert!(TokenTree::new().is_empty() && TokenTree::new().max_depth() == 0);
}

#[test]
fn greedy_keeps_the_longest_matching_path() {
    let vocab = 5;
    let mut rng = StdRng::seed_from_u64(11);
    let mut s = sampler(SamplingParams::default()).with_logprobs(Some(2));
    let mut longer_than_one = 0;
    for trial in 0..3000u64 {
        let tree = random_tree(&mut rng, vocab as u32, 10, true);
        let rows = tree_rows(&tree, trial, vocab, 2.0);
        // The reference: a node matches when its parent does and its token
        // is the argmax of its parent's row processed with the parent's path.
        let argmax_at = |s: &mut Sampler, at: Option<usize>| {
            let mut row = rows[position(at)].clone();
            let pending = at.map_or(Vec::new(), |i| tree.path_tokens(i));
            s.process(&mut row, &pending).unwrap();
            (argmax(&row), row)
        };
        let mut matches = vec![false; tree.len()];
        for i in 0..tree.len() {
            let parent = tree.parent(i);
            let parent_ok = parent.is_none_or(|p| matches[p]);
            matches[i] = parent_ok && argmax_at(&mut s, parent).0 == tree.token(i);
        }
        let deepest = (0..tree.len())
            .filter(|&i| matches[i])
            .max_by_key(|&i| tree.depth(i));
        let (last, row) = argmax_at(&mut s, deepest);
        let path = deepest.map_or(Vec::new(), |i| tree.path(i));
        let mut tokens: Vec<u32> = path.iter().map(|&i| tree.token(i)).collect();
        tokens.push(last);
        longer_than_one += usize::from(path.len() > 1);

        let v = accept_tree(&mut rows.clone(), &tree, None, &mut s).unwrap();
        assert_eq!(
            (&v.path, &v.verdict.tokens),
            (&path, &tokens),
            "trial {trial}"
        );
        assert_eq!(v.verdict.accepted, path.len());
        assert_eq!(v.verdict.logprobs.len(), tokens.len());
        assert_eq!(
            v.verdict.logprobs.last().unwrap(),
            &token_logprob(&row, last, 2)
        );
    }
    assert!(
        longer_than_one > 100,
        "paths of 2+ nodes: {longer_than_one}"
    );
}

#[test]
fn each_node_is_processed_with_its_own_path() {
    // Root children 1 and 2; row 0 prefers 2, so node 1 (token 2) is kept.
    // Under a presence penalty its row, which prefers 2, must see 2 as
    // pending (and not its sibling's 1): 2 drops below 0.
    let tree = TokenTree::from_nodes([(1, None), (2, None), (0, Some(0)), (0, Some(1))]).unwrap();
    let hot = |t: usize| {
        (0..4)
            .map(|i| if i == t { 5.0 } else { 0.0 })
            .collect::<Vec<f32>>()
    };
    let rows = vec![hot(2), hot(1), hot(2), hot(3), hot(3)];
    let c = Controls {
        presence_penalty: 10.0,
        ..Controls::default()
    };
    let mut s = Sampler::new(SamplingParams::default())
        .with_processor(LogitsProcessor::new(c, &[], None))
        .with_logprobs(Some(2));
    let mut processed = rows.clone();
    let v = accept_tree(&mut processed, &tree, None, &mut s).unwrap();
    assert_eq!(
        (v.path.clone(), v.verdict.tokens.clone()),
        (vec![1, 3], vec![2, 0, 3])
    );
    assert_eq!(
        processed[2],
        vec![0.0, 0.0, -5.0, 0.0],
        "row after node 1, pending [2]"
    );
    assert_eq!(
        processed[1], rows[1],
        "the sibling's row is never processed"
    );
    assert_eq!(v.verdict.logprobs[1].top[0].0, 0);
    assert_eq!(s.processor().generated(), 3);
}

/// A grammar that forbids repeating the previous token and records the
/// pending histories it is asked about, and what is committed.
struct NoRepeat(std::sync::Arc<std::sync::Mutex<GrammarLog>>);

/// The pending histories asked about, and the committed tokens.
type GrammarLog = (Vec<Vec<u32>>, Vec<u32>);

impl crate::constraint::TokenConstraint for NoRepeat {
    fn allowed(&mut self, pending: &[u32]) -> Result<crate::TokenMask, ConstraintError> {
        self.0.lock().unwrap().0.push(pending.to_vec());
        let mut m = crate::TokenMask::all(4);
        if let Some(&last) = pending.last() {
            m = crate::TokenMask::none(4);
            (0..4).filter(|&t| t != last).for_each(|t| m.allow(t));
        }
        Ok(m)
    }
    fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        tokens.len()
    }
    fn forced(&mut self, _pending: &[u32]) -> Vec<u32> {
        Vec::new()
    }
    fn commit(&mut self, tokens: &[u32]) -> Result<(), ConstraintError> {
        self.0.lock().unwrap().1.extend_from_slice(tokens);
        Ok(())
    }
}

#[test]
fn the_grammar_is_asked_along_the_accepted_path_only() {
    // Root children 1 and 2 (row 0 prefers 2); under node 1 (token 2) the
    // row prefers 2 again, which the grammar forbids after 2: 0 wins, and
    // node 3 (token 0) is kept; the sibling's subtree is never asked about.
    let tree = TokenTree::from_nodes([(1, None), (2, None), (0, Some(0)), (0, Some(1))]).unwrap();
    let hot = |t: usize| {
        (0..4)
            .map(|i| if i == t { 5.0 } else { 0.0 })
            .collect::<Vec<f32>>()
    };
    let rows = vec![hot(2), hot(1), hot(2), hot(3), hot(0)];
    let log = std::sync::Arc::default();
    let g = NoRepeat(std::sync::Arc::clone(&log));
    let mut s = Sampler::new(SamplingParams::default()).with_processor(LogitsProcessor::new(
        Controls::default(),
        &[],
        Some(Box::new(g)),
    ));
    let v = accept_tree(&mut rows.clone(), &tree, None, &mut s).unwrap();
    // After [2, 0] the row prefers 0, forbidden after 0: 1 is the argmax.
    assert_eq!((v.path, v.verdict.tokens), (vec![1, 3], vec![2, 0, 1]));
    let (asked, committed) = log.lock().unwrap().clone();
    assert_eq!(asked, vec![vec![], vec![2], vec![2, 0]]);
    assert_eq!(committed, vec![2, 0, 1]);
}

#[test]
fn a_chain_is_decided_bit_for_bit_as_by_the_chain_functions() {
    let vocab = 8;
    let mut rng = StdRng::seed_from_u64(5);
    let warped = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        ..sampled(9)
    };
    let greedy = SamplingParams {
        seed: Some(9),
        ..SamplingParams::default()
    };
    for (name, params) in [("greedy", greedy), ("sampled", warped)] {
        for with_q in [false, true] {
            let mut a = sampler(params).with_logprobs(Some(3));
            let mut b = sampler(params).with_logprobs(Some(3));
            let mut kept = 0;
            for trial in 0..3000u64 {
                let k = rng.random_range(0..=5usize);
                // Drafts mostly from a second model's argmax, so some
                // chains survive several positions.
                let mut draft = Vec::new();
                for _ in 0..k {
                    let d = if rng.random_bool(0.7) {
                        argmax(&model(trial, &draft, vocab, 2.0))
                    } else {
                        rng.random_range(0..vocab as u32)
                    };
                    draft.push(d);
                }
                let tree = TokenTree::chain(&draft);
                let rows = tree_rows(&tree, trial, vocab, 2.0);
                let q: Vec<Vec<f32>> = (0..k)
                    .map(|i| {
                        let mut qi = warped.warp(&model(trial + 7, &draft[..i], vocab, 1.0));
                        qi[draft[i] as usize] += 0.2;
                        let sum: f32 = qi.iter().sum();
                        qi.iter().map(|x| x / sum).collect()
                    })
                    .collect();
                let q = with_q.then_some(q.as_slice());
                let (mut ra, mut rb) = (rows.clone(), rows.clone());
                let (va, vb) = if name == "greedy" {
                    let vb = if trial % 2 == 0 {
                        accept_tree_greedy(&mut rb, &tree, &mut b)
                    } else {
                        accept_tree(&mut rb, &tree, q, &mut b)
                    };
                    (accept_greedy(&mut ra, &draft, &mut a), vb)
                } else {
                    let va = accept_sampled(&mut ra, &draft, q, &mut a);
                    (va, accept_tree(&mut rb, &tree, q, &mut b))
                };
                let (va, vb) = (va.unwrap(), vb.unwrap());
                assert_eq!(vb.path, (0..va.accepted).collect::<Vec<_>>());
                assert_eq!(va, Verdict::from(vb), "{name} q {with_q} trial {trial}");
                assert_eq!(ra, rb, "the same rows processed the same way");
                kept += va.accepted;
            }
            assert!(kept > 500, "{name}: {kept} drafts kept");
            assert_eq!(a.uniform(), b.uniform(), "{name}: the same draws consumed");
            assert_eq!(a.processor().generated(), b.processor().generated());
        }
    }
}

// The workspace's one chi-square helper, shared with the integration tests.
#[path = "../../../tests/common/stats.rs"]
mod stats;
use stats::chi_square;

const V: usize = 6;
const TARGET: u64 = 101;
const DRAFT: u64 = 202;

/// The processed, warped distribution after `ctx` (all of it pending over
/// a fresh sequence) under model `seed`: what the sequence would sample
/// there had it emitted `ctx`.
fn law(s: &mut Sampler, seed: u64, ctx: &[u32], scale: f32) -> Vec<f32> {
    let mut row = model(seed, ctx, V, scale);
    s.process(&mut row, ctx).unwrap();
    s.params().warp(&row)
}

fn fresh(s: &mut Sampler) {
    *s.processor_mut() = LogitsProcessor::new(penalties(), &PROMPT, None);
}

/// Draws `n` sequences' first two tokens through [`accept_tree`] on trees
/// from `propose` (a second, plain step when the verdict emits one token)
/// and checks both laws against the exact target law by chi-square.
fn check_law(
    name: &str,
    n: usize,
    mut propose: impl FnMut(&mut Sampler) -> (TokenTree, Option<Vec<Vec<f32>>>),
) {
    let mut s = sampler(sampled(77));
    let p1 = law(&mut s, TARGET, &[], 2.0);
    let mut exact1 = vec![0f64; V];
    let mut exact2 = vec![0f64; V * V];
    for x in 0..V {
        exact1[x] = f64::from(p1[x]);
        let p2 = law(&mut s, TARGET, &[x as u32], 2.0);
        for y in 0..V {
            exact2[x * V + y] = f64::from(p1[x]) * f64::from(p2[y]);
        }
    }
    let (mut c1, mut c2, mut accepted, mut rejected_root) = (vec![0; V], vec![0; V * V], 0, 0);
    for _ in 0..n {
        fresh(&mut s);
        let (tree, q) = propose(&mut s);
        let mut rows = tree_rows(&tree, TARGET, V, 2.0);
        let v = accept_tree(&mut rows, &tree, q.as_deref(), &mut s).unwrap();
        v.rows_to_keep(&tree).unwrap();
        let t = &v.verdict.tokens;
        let second = match t.get(1) {
            Some(&y) => y,
            None => {
                let mut next = vec![model(TARGET, &t[..1], V, 2.0)];
                accept_tree(&mut next, &TokenTree::new(), None, &mut s)
                    .unwrap()
                    .verdict
                    .tokens[0]
            }
        };
        accepted += v.path.len();
        rejected_root += usize::from(v.path.is_empty() && !tree.is_empty());
        c1[t[0] as usize] += 1;
        c2[t[0] as usize * V + second as usize] += 1;
    }
    // The proposals must exercise both outcomes, or the test proves little.
    assert!(
        accepted > n / 4 && rejected_root > n / 20,
        "{name}: {accepted} {rejected_root}"
    );
    for (what, exact, counts) in [("first", &exact1, &c1), ("first two", &exact2, &c2)] {
        let (stat, crit) = chi_square(exact, counts, n);
        eprintln!("{name}, {what}: chi2 {stat:.1} (critical {crit:.1}); {accepted} kept, {rejected_root} none");
        assert!(
            stat < crit,
            "{name}, {what} token(s): chi2 {stat:.1} >= {crit:.1}"
        );
    }
}

/// `m` i.i.d. draws from `q`.
fn iid(rng: &mut StdRng, q: &[f32], m: usize) -> Vec<u32> {
    (0..m)
        .map(|_| {
            let mut u = rng.random::<f32>();
            q.iter()
                .position(|&p| {
                    u -= p;
                    u < 0.0
                })
                .unwrap_or(V - 1) as u32
        })
        .collect()
}

/// The `m` most likely ids of `q`, distinct, most likely first.
fn top(q: &[f32], m: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..q.len() as u32).collect();
    ids.sort_by(|&a, &b| q[b as usize].total_cmp(&q[a as usize]).then(a.cmp(&b)));
    ids.truncate(m);
    ids
}

#[test]
fn sampled_tree_with_iid_candidates_follows_the_target_law() {
    let mut rng = StdRng::seed_from_u64(3);
    check_law("q given", 200_000, |s| {
        // The draft's law at the root: three i.i.d. candidates (repeats
        // kept as separate nodes), each with two i.i.d. children of its own.
        let q_root = law(s, DRAFT, &[], 1.5);
        let mut tree = TokenTree::new();
        let mut q = vec![q_root.clone()];
        for x in iid(&mut rng, &q_root, 3) {
            tree.push(x, None).unwrap();
            q.push(Vec::new());
        }
        for c in 0..3 {
            let qc = law(s, DRAFT, &[tree.token(c)], 1.5);
            for y in iid(&mut rng, &qc, 2) {
                tree.push(y, Some(c)).unwrap();
                q.push(Vec::new());
            }
            q[c + 1] = qc;
        }
        (tree, Some(q))
    });
}

#[test]
fn sampled_tree_with_deterministic_candidates_follows_the_target_law() {
    // The draft's top 3 at the root; its top 2 under the second of them.
    check_law("q none", 200_000, |s| {
        let roots = top(&law(s, DRAFT, &[], 1.5), 3);
        let mut tree = TokenTree::new();
        for &x in &roots {
            tree.push(x, None).unwrap();
        }
        for y in top(&law(s, DRAFT, &[roots[1]], 1.5), 2) {
            tree.push(y, Some(1)).unwrap();
        }
        (tree, None)
    });
}

#[test]
fn sampled_tree_mixing_both_rules_follows_the_target_law() {
    // Three i.i.d. draws at the root (the q rule there); under the first
    // of them the draft's top 2 plus a fixed "n-gram" token, tried without
    // replacement (an empty q row: the deterministic rule there).
    let mut rng = StdRng::seed_from_u64(4);
    check_law("mixed", 200_000, |s| {
        let q_root = law(s, DRAFT, &[], 1.5);
        let mut tree = TokenTree::new();
        for x in iid(&mut rng, &q_root, 3) {
            tree.push(x, None).unwrap();
        }
        let mut under = top(&law(s, DRAFT, &[tree.token(0)], 1.5), 2);
        if !under.contains(&5) {
            under.push(5);
        }
        for y in under {
            tree.push(y, Some(0)).unwrap();
        }
        let mut q = vec![Vec::new(); tree.len() + 1];
        q[0] = q_root;
        (tree, Some(q))
    });
}

#[test]
fn only_the_accepted_path_keeps_its_rows() {
    let vocab = 4;
    let mut rng = StdRng::seed_from_u64(8);
    let mut s = sampler(sampled(4));
    let mut tried_sibling = 0;
    for trial in 0..3000u64 {
        let tree = random_tree(&mut rng, vocab as u32, 12, true);
        let mut rows = tree_rows(&tree, trial, vocab, 1.0);
        let v = accept_tree(&mut rows, &tree, None, &mut s).unwrap();
        let kept = v.rows_to_keep(&tree).unwrap();
        // Row 0, then one row per depth, each the child of the one before:
        // no two kept rows are siblings, none is off the path.
        assert_eq!(kept.len(), v.path.len() + 1);
        assert_eq!(kept[0], 0);
        for (d, pair) in kept.windows(2).enumerate() {
            let (prev, node) = (pair[0].checked_sub(1), pair[1] - 1);
            assert_eq!(tree.parent(node), prev);
            assert_eq!(tree.depth(node), d + 1);
        }
        // Swap each accepted node for each of its siblings: refused.
        for step in 0..v.path.len() {
            let node = v.path[step];
            for &sib in tree.children(tree.parent(node)) {
                if sib == node {
                    continue;
                }
                let mut bad = v.clone();
                bad.path[step] = sib;
                tried_sibling += 1;
                let err = bad.rows_to_keep(&tree).unwrap_err();
                let want = if step + 1 < v.path.len() {
                    // The next node is not the sibling's child either.
                    matches!(
                        err,
                        TreeError::TokenMismatch { .. } | TreeError::NotAChild { .. }
                    )
                } else {
                    err == TreeError::TokenMismatch {
                        step,
                        node: sib,
                        node_token: tree.token(sib),
                        emitted: v.verdict.tokens[step],
                    }
                };
                assert!(want, "trial {trial}: {err}");
            }
        }
    }
    assert!(tried_sibling > 300, "{tried_sibling} sibling swaps");

    // Hand-made: a node of another branch, a node past the tree, a count off.
    let tree = TokenTree::from_nodes([(1, None), (2, None), (3, Some(0)), (3, Some(1))]).unwrap();
    let good = TreeVerdict {
        path: vec![1, 3],
        verdict: Verdict {
            accepted: 2,
            tokens: vec![2, 3, 0],
            logprobs: Vec::new(),
        },
    };
    assert_eq!(good.rows_to_keep(&tree), Ok(vec![0, 2, 4]));
    let with = |path: Vec<usize>| TreeVerdict {
        path,
        ..good.clone()
    };
    // Node 2 holds the same token 3, but under node 0: not node 1's child.
    assert_eq!(
        with(vec![1, 2]).rows_to_keep(&tree),
        Err(TreeError::NotAChild {
            step: 1,
            node: 2,
            expected: Some(1)
        })
    );
    assert_eq!(
        with(vec![1, 7]).rows_to_keep(&tree),
        Err(TreeError::NodeOutOfRange {
            step: 1,
            node: 7,
            len: 4
        })
    );
    assert_eq!(
        with(vec![1]).rows_to_keep(&tree),
        Err(TreeError::LengthMismatch { path: 1, tokens: 3 })
    );
}
