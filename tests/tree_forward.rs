//! Token-tree verification in one forward ([`Model::forward_tree`]) and the
//! compaction of the accepted path ([`KvPool::compact_rows`]), on the tiny
//! generated llama and on the real Qwen2.5-Coder 0.5B.
//!
//! Proven here: every tree node's logits equal the last row of a plain
//! chain forward of the prompt, the last token and the path to that node;
//! a chain-shaped tree gives the plain forward's bits; a sibling's token
//! never reaches a node (and the model is sensitive to it where it is
//! visible, so that check can fail); after compaction a decode continues
//! exactly as from a pool fed the accepted chain, and compacting a
//! sibling's path instead does not; TP 2 gives TP 1's logits; other
//! families (Kimi K3 verifies trees: verify/src/model/kimi_k3/tree_tests.rs)
//! and malformed inputs are refused with a typed error.
//!
//! Tolerance, relative to a row's largest |logit|: 1e-4 against chain
//! forwards. Both sides run the same kernels on rows whose inputs and
//! attended K/V are the same values read in the same order; only the other
//! rows of the batch differ, which the row-wise matmuls do not mix, so the
//! difference is expected to be 0 (each test prints what it measured) and
//! 1e-4 leaves room for a kernel that tiles rows differently by batch
//! size. TP 2 against TP 1: 2e-2, the bound of verify/tests/tp.rs for
//! quantized weights (the residual stream's summation order differs).

mod common;

use common::{real_model, tiny_model, tiny_model_tp};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use specgate_verify::accept::Verdict;
use specgate_verify::model::{load_gguf, load_model};
use specgate_verify::tiny::TinySpec;
use specgate_verify::{KvPool, LogitsWanted, Model, SeqInput, TokenTree, TreeVerdict, VerifyError};
use std::path::Path;

const BS: usize = 16;
const TOL: f32 = 1e-4;
const TP_TOL: f32 = 2e-2;

fn spec() -> TinySpec {
    TinySpec::llama(29)
}

/// The largest |a - b| over a row, relative to the row's largest |b|.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

/// A pool with room for `tokens` slots, its table in reversed block ids
/// (the shards must share one numbering), and `prefix` already fed.
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

/// `tree`'s rows: the last committed token, then every node's token.
fn tree_tokens(last: u32, tree: &TokenTree) -> Vec<u32> {
    std::iter::once(last)
        .chain((0..tree.len()).map(|i| tree.token(i)))
        .collect()
}

/// Logits of every row of `tree` verified after `prompt` (whose last token
/// is the tree's root) in one forward; the pool and its table after it.
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

/// The last row of a plain forward of `prompt` then `path` (the prompt's
/// last token and the path fed as one chain, as a verify pass would).
fn chain_last(model: &Model, prompt: &[u32], path: &[u32]) -> Vec<f32> {
    let start = prompt.len() - 1;
    let (mut pool, table) = primed(model, &prompt[..start], prompt.len() + path.len() + 1);
    let toks: Vec<u32> = std::iter::once(prompt[start])
        .chain(path.iter().copied())
        .collect();
    let mut rows = model
        .forward_one(&mut pool, &toks, start, &table, LogitsWanted::Last)
        .unwrap();
    rows.pop().unwrap()
}

/// A random tree of depth <= `depth` and width <= `width`: the root gets
/// 1..=width children, every other node 0..=width.
fn random_tree(rng: &mut StdRng, depth: usize, width: usize, vocab: u32) -> TokenTree {
    let mut tree = TokenTree::new();
    let mut level: Vec<Option<usize>> = vec![None];
    for _ in 0..depth {
        let mut next = Vec::new();
        for &parent in &level {
            let lo = usize::from(parent.is_none());
            for _ in 0..rng.random_range(lo..=width) {
                let node = tree.push(rng.random_range(0..vocab), parent).unwrap();
                next.push(Some(node));
            }
        }
        level = next;
    }
    tree
}

fn random_prompt(rng: &mut StdRng, n: usize, vocab: u32) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..vocab)).collect()
}

/// Checks every row of `tree` against its path's chain forward; returns
/// the largest relative difference.
fn check_against_chains(model: &Model, prompt: &[u32], tree: &TokenTree, tol: f32) -> f32 {
    let (rows, _, _) = tree_forward(model, prompt, tree);
    let mut worst = rel_diff(&rows[0], &chain_last(model, prompt, &[]));
    for i in 0..tree.len() {
        let want = chain_last(model, prompt, &tree.path_tokens(i));
        let d = rel_diff(&rows[1 + i], &want);
        assert!(
            d <= tol,
            "node {i} (path {:?}): relative diff {d}",
            tree.path(i)
        );
        worst = worst.max(d);
    }
    assert!(worst <= tol, "row 0: relative diff {worst}");
    worst
}

#[test]
fn every_node_matches_the_chain_forward_of_its_path() {
    let model = tiny_model(&spec(), "tree.gguf");
    let vocab = model.config().vocab_size as u32;
    let mut worst = 0f32;
    let mut nodes = 0;
    for seed in 0..6 {
        let mut rng = StdRng::seed_from_u64(seed);
        let prompt = random_prompt(&mut rng, 5 + 4 * seed as usize, vocab);
        let tree = random_tree(&mut rng, 4, 3, vocab);
        nodes += tree.len();
        worst = worst.max(check_against_chains(&model, &prompt, &tree, TOL));
    }
    eprintln!("{nodes} nodes, largest relative difference {worst:e}");
    assert!(nodes > 30, "the random trees branch");
}

#[test]
fn a_chain_tree_gives_the_plain_forwards_bits() {
    let model = tiny_model(&spec(), "chain.gguf");
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
    assert_eq!(rows, plain, "the same code path, the same bits");
    // And the pools hold the same entries: the next decode agrees too.
    let next = start + toks.len();
    let a = model
        .forward_one(&mut tpool, &[9], next, &table, LogitsWanted::Last)
        .unwrap();
    let b = model
        .forward_one(&mut pool, &[9], next, &ptable, LogitsWanted::Last)
        .unwrap();
    assert_eq!(a, b);
}

#[test]
fn a_sibling_is_never_seen() {
    let model = tiny_model(&spec(), "sibling.gguf");
    let prompt = [11u32, 200, 37, 5, 140, 90];
    // root -> a(0), b(1); b -> c(2) -> d(3). Two trees differing only in
    // the sibling a.
    let tree =
        |a| TokenTree::from_nodes([(a, None), (60, None), (71, Some(1)), (82, Some(2))]).unwrap();
    let (one, _, _) = tree_forward(&model, &prompt, &tree(20));
    let (two, _, _) = tree_forward(&model, &prompt, &tree(333));
    assert_ne!(one[1], two[1], "a's own row follows a's token");
    for r in [0, 2, 3, 4] {
        assert_eq!(one[r], two[r], "row {r} saw the sibling's token");
    }
    // Where a IS visible (an ancestor), its token changes what follows:
    // so the equality above is the mask's doing, not the model's
    // indifference.
    let seen = |a| chain_last(&model, &prompt, &[a, 60, 71, 82]);
    let d = rel_diff(&seen(20), &seen(333));
    assert!(d > 100.0 * TOL, "the model barely reads that token: {d}");
    // And the tree's row is the chain of its own path.
    let d = rel_diff(&one[4], &chain_last(&model, &prompt, &[60, 71, 82]));
    assert!(d <= TOL, "{d}");
}

/// The kept rows of accepting `path` of `tree` with `bonus` after it.
fn kept(tree: &TokenTree, path: &[usize], bonus: u32) -> Vec<usize> {
    let mut tokens: Vec<u32> = path.iter().map(|&i| tree.token(i)).collect();
    tokens.push(bonus);
    TreeVerdict {
        path: path.to_vec(),
        verdict: Verdict {
            accepted: path.len(),
            tokens,
            logprobs: Vec::new(),
        },
    }
    .rows_to_keep(tree)
    .unwrap()
}

/// The decode of `bonus` after verifying `tree` and compacting the rows
/// `keep` (None: no compaction), as its logits.
fn decode_after(
    model: &Model,
    prompt: &[u32],
    tree: &TokenTree,
    keep: Option<&[usize]>,
    depth: usize,
    bonus: u32,
) -> Vec<f32> {
    let (_, mut pool, table) = tree_forward(model, prompt, tree);
    let start = prompt.len() - 1;
    if let Some(keep) = keep {
        pool.compact_rows(&table, start, keep).unwrap();
    }
    let mut rows = model
        .forward_one(
            &mut pool,
            &[bonus],
            start + 1 + depth,
            &table,
            LogitsWanted::Last,
        )
        .unwrap();
    rows.pop().unwrap()
}

/// root -> x(0), y(1); x -> x1(2); y -> y1(3); x1 -> x2(4); y1 -> y2(5);
/// y -> z(6). The accepted path y, y1, y2 sits at rows 2, 4, 6, away
/// from slots 1..=3 where it belongs.
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

#[test]
fn compaction_leaves_the_pool_as_if_the_path_was_fed() {
    let model = tiny_model(&spec(), "compact.gguf");
    check_compaction(&model, &[7u32, 150, 22, 300, 64, 9, 181]);
}

fn check_compaction(model: &Model, prompt: &[u32]) {
    let tree = two_branches();
    let bonus = 123;
    let path = [1, 3, 5];
    let keep = kept(&tree, &path, bonus);
    assert_eq!(keep, [0, 2, 4, 6]);
    let got = decode_after(model, prompt, &tree, Some(&keep), path.len(), bonus);
    // A pool fed the accepted chain directly.
    let want = chain_last(model, prompt, &[41, 51, 61, bonus]);
    let d = rel_diff(&got, &want);
    eprintln!("compacted vs fed: relative diff {d:e}");
    assert!(d <= TOL, "compacted pool: relative diff {d}");
    // Committing the sibling branch's rows (x, x1, x2) instead, or not
    // compacting at all, leaves a pool that is not the accepted chain's.
    let sibling = kept(&tree, &[0, 2, 4], bonus);
    let wrong = decode_after(model, prompt, &tree, Some(&sibling), path.len(), bonus);
    let d = rel_diff(&wrong, &want);
    assert!(d > 100.0 * TOL, "a sibling's rows went unnoticed: {d}");
    let stale = decode_after(model, prompt, &tree, None, path.len(), bonus);
    let d = rel_diff(&stale, &want);
    assert!(d > 100.0 * TOL, "the uncompacted rows went unnoticed: {d}");
}

#[test]
fn tp2_tree_forward_and_compaction_equal_tp1() {
    let one = tiny_model(&spec(), "tp1.gguf");
    let two = tiny_model_tp(&spec(), "tp2.gguf", 2);
    assert_eq!(two.world_size(), 2);
    let vocab = one.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(77);
    let prompt = random_prompt(&mut rng, 9, vocab);
    let tree = random_tree(&mut rng, 4, 3, vocab);
    let (a, _, _) = tree_forward(&one, &prompt, &tree);
    let (b, _, _) = tree_forward(&two, &prompt, &tree);
    let mut worst = 0f32;
    for (r, (x, y)) in b.iter().zip(&a).enumerate() {
        let d = rel_diff(x, y);
        assert!(d <= TP_TOL, "row {r}: relative diff {d}");
        worst = worst.max(d);
    }
    eprintln!(
        "{} rows, TP 2 vs TP 1: largest relative diff {worst:e}",
        a.len()
    );
    // Both shards compact: the decode after it agrees across world sizes,
    // and at TP 2 equals TP 2's own fed chain.
    let t = two_branches();
    let keep = kept(&t, &[1, 3, 5], 9);
    let x = decode_after(&one, &prompt, &t, Some(&keep), 3, 9);
    let y = decode_after(&two, &prompt, &t, Some(&keep), 3, 9);
    let d = rel_diff(&y, &x);
    assert!(d <= TP_TOL, "compacted, TP 2 vs TP 1: {d}");
    check_compaction(&two, &prompt);
}

#[test]
fn a_batch_mixes_trees_with_plain_rows() {
    // As a verify pass will run it: a prompt chunk, a chain of drafts and
    // a tree, three sequences in one forward over one pool, each row as
    // its sequence alone gives it.
    let model = tiny_model(&spec(), "batch.gguf");
    let (pa, pb) = ([5u32, 6, 7, 8, 9], [100u32, 101, 102, 103]);
    let chunk = [30u32, 31, 32];
    let chain = [9u32, 14, 15];
    let tree = two_branches();
    let tree_toks = tree_tokens(103, &tree);
    let mut pool = KvPool::for_model(&model, 8, BS).unwrap();
    let tables: [&[u32]; 3] = [&[0, 1], &[2, 3], &[4, 5]];
    model
        .forward_one(&mut pool, &pa[..4], 0, tables[0], LogitsWanted::None)
        .unwrap();
    model
        .forward_one(&mut pool, &pb[..3], 0, tables[1], LogitsWanted::None)
        .unwrap();
    let seq = |tokens, start_pos, block_table, logits| SeqInput {
        tokens,
        start_pos,
        block_table,
        logits,
        state_slot: 0,
    };
    let all = LogitsWanted::All;
    let seqs = [
        seq(&chunk, 0, tables[2], LogitsWanted::Last),
        seq(&chain, 4, tables[0], all),
        seq(&tree_toks, 3, tables[1], all),
    ];
    let rows = model
        .forward_trees(&mut pool, &seqs, &[None, None, Some(&tree)])
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(rows.len(), 1 + chain.len() + tree_toks.len());
    let alone_chunk = chain_last(&model, &[30, 31, 32], &[]);
    let mut want = vec![alone_chunk];
    for i in 0..chain.len() {
        want.push(chain_last(&model, &pa, &chain[1..=i]));
    }
    want.extend(tree_forward(&model, &pb, &tree).0);
    for (r, (got, want)) in rows.iter().zip(&want).enumerate() {
        let d = rel_diff(got, want);
        assert!(d <= TOL, "row {r}: relative diff {d}");
    }
}

#[test]
fn other_families_and_malformed_inputs_are_refused() {
    let tree = TokenTree::from_nodes([(5, None), (6, None), (7, Some(0))]).unwrap();
    let toks = [4u32, 5, 6, 7];
    let refuse = |model: &Model, toks: &[u32], table: &[u32], want: &str| {
        let mut pool = KvPool::for_model(model, 4, BS).unwrap();
        let seq = SeqInput {
            tokens: toks,
            start_pos: 10,
            block_table: table,
            logits: LogitsWanted::All,
            state_slot: 0,
        };
        match model.forward_tree(&mut pool, &seq, &tree) {
            Err(VerifyError::BadBatch(m)) => assert!(m.contains(want), "{m} lacks {want}"),
            other => panic!("{want}: got {other:?}"),
        }
    };
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    // Kimi K3 verifies trees (verify/src/model/kimi_k3/tree_tests.rs);
    // only its ranks run as processes refuse them (tests/mpi.rs territory).
    let k3 = load_model(&fixtures.join("kimi_k3/tiny-k3.gguf")).unwrap();
    assert!(k3.supports_trees());
    refuse(&k3, &toks[..3], &[0], "3 tokens for a tree of 3 nodes");
    let ds = load_model(&fixtures.join("tiny-kimi")).unwrap();
    refuse(
        &ds,
        &toks,
        &[0],
        "tree verification is not supported for the DeepSeek-V3 family yet",
    );
    let llama = tiny_model(&spec(), "refuse.gguf");
    refuse(&llama, &toks[..3], &[0], "3 tokens for a tree of 3 nodes");
    refuse(
        &llama,
        &[4, 5, 9, 7],
        &[0],
        "row 2 holds token 9, tree node 1 is 6",
    );
    // Slots 10..14 fit one block of 16; from 14 on they need a second.
    let late = SeqInput {
        tokens: &toks,
        start_pos: 13,
        block_table: &[0],
        logits: LogitsWanted::All,
        state_slot: 0,
    };
    let mut pool = KvPool::for_model(&llama, 4, BS).unwrap();
    let e = llama.forward_tree(&mut pool, &late, &tree).unwrap_err();
    assert!(e.to_string().contains("block table has 1 blocks"), "{e}");
    let fits = SeqInput {
        start_pos: 10,
        ..late
    };
    let e = llama
        .forward_trees(&mut pool, &[fits, fits], &[Some(&tree)])
        .unwrap_err();
    assert!(e.to_string().contains("1 trees for a batch of 2"), "{e}");
}

#[cfg_attr(
    debug_assertions,
    ignore = "real weights: run with --release (a debug build takes minutes)"
)]
#[test]
fn real_qwen_tree_matches_chains_and_compacts() {
    let Some(path) = real_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") else {
        return;
    };
    let model = load_gguf(&path).unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    // Token ids of ordinary text are in the low range of the vocabulary.
    let prompt = random_prompt(&mut rng, 24, 30_000);
    // A branching tree of at least 8 nodes (the first the seed gives).
    let tree = std::iter::repeat_with(|| random_tree(&mut rng, 4, 3, 30_000))
        .find(|t| t.len() >= 8 && !t.is_chain())
        .unwrap();
    let worst = check_against_chains(&model, &prompt, &tree, TOL);
    eprintln!(
        "{} nodes, largest relative difference {worst:e}",
        tree.len()
    );
    check_compaction(&model, &prompt);
}
