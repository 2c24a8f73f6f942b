//! Token trees over Kimi K3's recurrent state (issue 39 item 1), on the
//! tiny generated checkpoints: the GGUF (f32 latent cache) and the bf16
//! directory (bf16 latent cache).
//!
//! Proven here: every node's logits equal a chain forward of its path in a
//! fresh pool; a chain-shaped tree is the plain forward bit for bit (its
//! per-row states too); after `compact_rows(kept)` and
//! `keep_rows(slot, last + 1)` the slot holds exactly the state of feeding
//! the accepted path and the next decode equals a pool fed it as a chain,
//! while committing a sibling's state, or a sibling's rows, does not; a
//! tree beside plain rows in one batch; TP 2 (threads) equals TP 1.
//!
//! Tolerance: the tree and the chain run the same row-wise, batch-invariant
//! kernels on the same values in the same order (K3's MoE included:
//! `mod.rs`), so the difference is expected to be 0; the checks allow
//! `TOL` (absolute, on logits of magnitude ~10) for a kernel that tiles
//! rows differently by batch size, and print what they measured. TP 2
//! against TP 1: `TP_TOL`, 10x the 1.8e-5 `tests.rs` measures for K3
//! (only the collectives' summation order differs).

use super::super::tests::{fixture, load_f32_cache, max_diff};
use crate::model::{load_model, load_model_tp, LogitsWanted, Model, SeqInput};
use crate::tree_accept::TokenTree;
use crate::{CacheDtype, KvPool};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BS: usize = 16;
const TOL: f32 = 1e-4;
const TP_TOL: f32 = 2e-4;

/// The two tiny checkpoints with the latent cache each loads with.
fn models() -> Vec<(&'static str, Model)> {
    let hf = load_model(&fixture("tiny-hf")).unwrap();
    assert_eq!(hf.latent_cache(), Some(CacheDtype::Bf16));
    vec![
        ("tiny-k3.gguf", load_f32_cache(&fixture("tiny-k3.gguf"))),
        ("tiny-hf (bf16 cache)", hf),
    ]
}

/// A pool with room for `tokens` slots, its table in reversed block ids,
/// and `prefix` fed in state slot 0.
fn primed(model: &Model, prefix: &[u32], tokens: usize) -> (KvPool, Vec<u32>) {
    let blocks = tokens.div_ceil(BS) + 1;
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let mut pool = KvPool::for_model(model, blocks, BS).unwrap();
    if !prefix.is_empty() {
        model
            .forward_one(&mut pool, prefix, 0, &table, LogitsWanted::None)
            .unwrap();
    }
    (pool, table)
}

fn tree_tokens(last: u32, tree: &TokenTree) -> Vec<u32> {
    std::iter::once(last)
        .chain((0..tree.len()).map(|i| tree.token(i)))
        .collect()
}

/// Every row's logits of `tree` verified after `prompt` (whose last token
/// is the root), the pool and its table after it.
fn tree_forward(
    model: &Model,
    prompt: &[u32],
    tree: &TokenTree,
) -> (Vec<Vec<f32>>, KvPool, Vec<u32>) {
    let start = prompt.len() - 1;
    let (mut pool, table) = primed(model, &prompt[..start], prompt.len() + tree.len() + 1);
    let toks = tree_tokens(prompt[start], tree);
    let seq = SeqInput {
        tokens: &toks,
        start_pos: start,
        block_table: &table,
        logits: LogitsWanted::All,
        state_slot: 0,
    };
    let rows = model.forward_tree(&mut pool, &seq, tree).unwrap();
    assert_eq!(rows.len(), tree.len() + 1);
    (rows, pool, table)
}

/// A fresh pool fed `prompt` then `path` (the prompt's last token and the
/// path as one chain, as a verify pass would): its last row's logits and
/// the pool.
fn chain(model: &Model, prompt: &[u32], path: &[u32]) -> (Vec<f32>, KvPool) {
    let start = prompt.len() - 1;
    let (mut pool, table) = primed(model, &prompt[..start], prompt.len() + path.len() + 1);
    let toks: Vec<u32> = std::iter::once(prompt[start])
        .chain(path.iter().copied())
        .collect();
    let mut rows = model
        .forward_one(&mut pool, &toks, start, &table, LogitsWanted::Last)
        .unwrap();
    (rows.pop().unwrap(), pool)
}

/// The root gets 1..=width children, every other node 0..=width.
fn random_tree(rng: &mut StdRng, depth: usize, width: usize, vocab: u32) -> TokenTree {
    let mut tree = TokenTree::new();
    let mut level: Vec<Option<usize>> = vec![None];
    for _ in 0..depth {
        let mut next = Vec::new();
        for &parent in &level {
            let lo = usize::from(parent.is_none());
            for _ in 0..rng.random_range(lo..=width) {
                next.push(Some(tree.push(rng.random_range(0..vocab), parent).unwrap()));
            }
        }
        level = next;
    }
    tree
}

/// root -> x(0), y(1); x -> x1(2); y -> y1(3); x1 -> x2(4); y1 -> y2(5);
/// y -> z(6). Path y, y1, y2 sits at rows 2, 4, 6, interleaved with its
/// sibling branch x, x1, x2 at rows 1, 3, 5.
fn two_branches() -> TokenTree {
    TokenTree::from_nodes([
        (40, None),
        (41, None),
        (50, Some(0)),
        (51, Some(1)),
        (60, Some(2)),
        (61, Some(3)),
        (70, Some(1)),
    ])
    .unwrap()
}

/// Rows kept when `path` is accepted: row 0 and each node's row.
fn kept(path: &[usize]) -> Vec<usize> {
    std::iter::once(0)
        .chain(path.iter().map(|i| i + 1))
        .collect()
}

/// Verifies `tree` after `prompt`, commits rows `rows` (compacted to
/// consecutive slots) and state row `state_row` (`keep_rows(0, state_row
/// + 1)`), then decodes `bonus`: its logits and the slot's state before it.
fn decode_after(
    model: &Model,
    prompt: &[u32],
    tree: &TokenTree,
    rows: &[usize],
    state_row: usize,
    bonus: u32,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (_, mut pool, table) = tree_forward(model, prompt, tree);
    let start = prompt.len() - 1;
    pool.compact_rows(&table, start, rows).unwrap();
    pool.keep_rows(0, state_row + 1).unwrap();
    let state = pool.read_state(0).unwrap();
    let next = start + rows.len();
    let mut out = model
        .forward_one(&mut pool, &[bonus], next, &table, LogitsWanted::Last)
        .unwrap();
    (out.pop().unwrap(), state)
}

#[test]
fn every_tree_node_equals_the_chain_forward_of_its_path() {
    for (name, model) in models() {
        let vocab = model.config().vocab_size as u32;
        let (mut worst, mut nodes) = (0f32, 0);
        for seed in 0..4u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let prompt: Vec<u32> = (0..5 + 5 * seed as usize)
                .map(|_| rng.random_range(0..vocab))
                .collect();
            let tree = random_tree(&mut rng, 4, 3, vocab);
            nodes += tree.len();
            let (rows, _, _) = tree_forward(&model, &prompt, &tree);
            let mut d = max_diff(&rows[..1], &[chain(&model, &prompt, &[]).0]);
            for i in 0..tree.len() {
                let want = chain(&model, &prompt, &tree.path_tokens(i)).0;
                let di = max_diff(&rows[1 + i..2 + i], &[want]);
                assert!(di <= TOL, "{name}: node {i} {:?}: {di}", tree.path(i));
                d = d.max(di);
            }
            worst = worst.max(d);
        }
        eprintln!("{name}: {nodes} nodes, max |tree - chain of its path| = {worst:e}");
        assert!(nodes > 30, "the random trees branch");
    }
}

#[test]
fn a_chain_shaped_tree_is_the_plain_forward_bit_for_bit() {
    for (name, model) in models() {
        let prompt = [3u32, 99, 250, 17, 8, 301, 44];
        let drafts = [5u32, 66, 77, 300, 12];
        let tree = TokenTree::chain(&drafts);
        let (rows, mut tpool, table) = tree_forward(&model, &prompt, &tree);
        let start = prompt.len() - 1;
        let (mut pool, ptable) = primed(&model, &prompt[..start], prompt.len() + drafts.len() + 1);
        let toks = tree_tokens(prompt[start], &tree);
        let plain = model
            .forward_one(&mut pool, &toks, start, &ptable, LogitsWanted::All)
            .unwrap();
        assert_eq!(rows, plain, "{name}: a chain tree's logits");
        // The same per-row states: rolling back to any row agrees.
        tpool.keep_rows(0, 3).unwrap();
        pool.keep_rows(0, 3).unwrap();
        assert_eq!(tpool.read_state(0).unwrap(), pool.read_state(0).unwrap());
        let a = model
            .forward_one(&mut tpool, &[9], start + 3, &table, LogitsWanted::Last)
            .unwrap();
        let b = model
            .forward_one(&mut pool, &[9], start + 3, &ptable, LogitsWanted::Last)
            .unwrap();
        assert_eq!(a, b, "{name}: the decode after a rollback");
    }
}

/// Commits `path` of [`two_branches`] and checks the slot's state and the
/// next decode against a pool fed the path; then that a sibling's state or
/// a sibling's rows do not pass for it. Returns the largest difference.
fn check_commit(model: &Model, name: &str, prompt: &[u32], path: &[usize]) -> f32 {
    let tree = two_branches();
    let bonus = 123;
    let keep = kept(path);
    let last = *keep.last().unwrap();
    let toks: Vec<u32> = path.iter().map(|&i| tree.token(i)).collect();
    let (_, fed) = chain(model, prompt, &toks);
    let want_state = fed.read_state(0).unwrap();
    let mut with_bonus = toks.clone();
    with_bonus.push(bonus);
    let want = chain(model, prompt, &with_bonus).0;
    let (got, state) = decode_after(model, prompt, &tree, &keep, last, bonus);
    assert_eq!(state, want_state, "{name} {path:?}: committed state");
    let d = max_diff(&[got], std::slice::from_ref(&want));
    assert!(d <= TOL, "{name} {path:?}: decode after commit: {d}");
    // The wrong commits: each must show, so the test can fail.
    let n = tree.len();
    for wrong in (0..=n).filter(|&r| r != last) {
        // The right rows, another row's state (a sibling's, a cousin's,
        // an ancestor's).
        let (bad, bad_state) = decode_after(model, prompt, &tree, &keep, wrong, bonus);
        assert_ne!(bad_state, want_state, "{name}: row {wrong}'s state");
        let e = max_diff(&[bad], std::slice::from_ref(&want));
        assert!(
            e > 100.0 * TOL,
            "{name}: state of row {wrong} unnoticed: {e}"
        );
    }
    d
}

#[test]
fn committing_the_accepted_leaf_equals_feeding_its_path_and_a_sibling_does_not() {
    for (name, model) in models() {
        let prompt = [7u32, 150, 22, 300, 64, 9, 181];
        let mut worst = 0f32;
        // The deep branch (its leaf is not the last row: the state comes
        // from the per-row buffer), the branch ending at the last row (the
        // slot's live state), nothing accepted, and the sibling branch.
        for path in [&[1, 3, 5][..], &[1, 6], &[], &[0, 2, 4]] {
            worst = worst.max(check_commit(&model, name, &prompt, path));
        }
        eprintln!("{name}: max |committed - fed| = {worst:e}");
        // The sibling branch's rows with the accepted leaf's state: the
        // MLA layers' latent rows are checked too.
        let tree = two_branches();
        let mut fed = vec![tree.token(1), tree.token(3), tree.token(5)];
        fed.push(123);
        let want = chain(&model, &prompt, &fed).0;
        let (bad, _) = decode_after(&model, &prompt, &tree, &kept(&[0, 2, 4]), 6, 123);
        let e = max_diff(&[bad], &[want]);
        assert!(e > 100.0 * TOL, "{name}: a sibling's rows unnoticed: {e}");
    }
}

#[test]
fn a_tree_beside_plain_rows_in_other_state_slots() {
    let model = load_f32_cache(&fixture("tiny-k3.gguf"));
    let (pa, pb) = ([5u32, 6, 7, 8, 9], [100u32, 101, 102, 103]);
    let chunk = [30u32, 31, 32];
    let drafts = [9u32, 14, 15];
    let tree = two_branches();
    let tree_toks = tree_tokens(103, &tree);
    let mut pool = KvPool::for_model(&model, 8, BS).unwrap();
    let tables: [&[u32]; 3] = [&[0, 1], &[2, 3], &[4, 5]];
    let seq = |tokens, start_pos, block_table, logits, state_slot| SeqInput {
        tokens,
        start_pos,
        block_table,
        logits,
        state_slot,
    };
    let none = LogitsWanted::None;
    model
        .forward_rows(&mut pool, &[seq(&pa[..4], 0, tables[0], none, 3)])
        .unwrap();
    model
        .forward_rows(&mut pool, &[seq(&pb[..3], 0, tables[1], none, 1)])
        .unwrap();
    let all = LogitsWanted::All;
    let seqs = [
        seq(&chunk, 0, tables[2], LogitsWanted::Last, 2),
        seq(&drafts, 4, tables[0], all, 3),
        seq(&tree_toks, 3, tables[1], all, 1),
    ];
    let rows = model
        .forward_trees(&mut pool, &seqs, &[None, None, Some(&tree)])
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let mut want = vec![chain(&model, &chunk, &[]).0];
    for i in 0..drafts.len() {
        want.push(chain(&model, &pa, &drafts[1..=i]).0);
    }
    want.extend(tree_forward(&model, &pb, &tree).0);
    let d = max_diff(&rows, &want);
    eprintln!("batch vs alone: {d:e}");
    assert!(d <= TOL, "batch vs alone: {d}");
    // The tree's sequence commits its leaf in its own slot.
    pool.compact_rows(tables[1], 3, &kept(&[1, 3])).unwrap();
    pool.keep_rows(1, 4 + 1).unwrap();
    let (_, fed) = chain(&model, &pb, &[41, 51]);
    assert_eq!(pool.read_state(1).unwrap(), fed.read_state(0).unwrap());
}

#[test]
fn tp2_as_threads_equals_tp1_over_a_tree_and_its_commit() {
    let path = fixture("tiny-k3.gguf");
    let one = load_model_tp(&path, 1).unwrap();
    let two = load_model_tp(&path, 2).unwrap();
    assert_eq!(two.world_size(), 2);
    assert!(two.supports_trees());
    let vocab = one.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(77);
    let prompt: Vec<u32> = (0..9).map(|_| rng.random_range(0..vocab)).collect();
    let tree = random_tree(&mut rng, 4, 3, vocab);
    let (a, _, _) = tree_forward(&one, &prompt, &tree);
    let (b, _, _) = tree_forward(&two, &prompt, &tree);
    let d = max_diff(&a, &b);
    eprintln!("{} rows, TP 2 vs TP 1: {d:e}", a.len());
    assert!(d <= TP_TOL, "TP 2 vs TP 1: {d}");
    let t = two_branches();
    let keep = kept(&[1, 3, 5]);
    let (x, _) = decode_after(&one, &prompt, &t, &keep, 6, 9);
    let (y, _) = decode_after(&two, &prompt, &t, &keep, 6, 9);
    let d = max_diff(&[x], &[y]);
    assert!(d <= TP_TOL, "committed, TP 2 vs TP 1: {d}");
    // And TP 2 against its own fed chain, the wrong commits included.
    check_commit(&two, "TP 2", &prompt, &[1, 3, 5]);
}
