//! Token-tree speculation through the engine's round (`spec::verify_round`):
//! proposals that branch are verified in one forward, the accepted path is
//! compacted in the pool, and the output is exactly the target's.
//!
//! - Greedy: with trees whose branches win (an oracle that puts a wrong
//!   token on the chain and the right one on a branch, with the rest of
//!   the right continuation below it), and with trees whose branches are
//!   noise beside n-gram and draft-model chains, the output equals plain
//!   decoding, on tiny models and on the real Qwen2.5-Coder pair. The
//!   oracle's trees only pass when the kept path's cache entries are the
//!   ones later rows read: a round that kept a sibling's slot decodes
//!   from a wrong cache.
//! - Under a grammar (a toy one that forces some positions): trees whose
//!   chains the grammar cuts and extends, with branches it admits or
//!   refuses, give exactly the constrained plain output (greedy), and the
//!   constrained joint law (sampled).
//! - Sampled at temperature 1 with penalties on: the first two tokens
//!   drawn through branching proposals (a draft's q-drawn chain with
//!   deterministic siblings; a deterministic tree) follow the processed
//!   target's joint distribution (chi-square at significance 1e-6).

mod common;

use candle_core::quantized::GgmlDType;
use common::{
    chi_square, exact_two_token_joint, mask_at, real_model, spec_decode, spec_decode_tree,
    strong_controls, tiny_model, valid_prefix_at,
};
use specgate::spec::SpecStats;
use specgate::tokenizer::{ChatMessage, TextTokenizer};
use specgate_draft::{DraftError, ModelDraft, NgramProposer, Proposal, ProposeRequest, Proposer};
use specgate_verify::model::load_gguf;
use specgate_verify::process::LogitsProcessor;
use specgate_verify::tiny::TinySpec;
use specgate_verify::{
    ConstraintError, Controls, Model, Sampler, SamplingParams, TokenConstraint, TokenMask,
};
use std::sync::Arc;

const BS: usize = 16;

/// Proposes from the target's own greedy continuation `truth` (absolute
/// positions): the chain is the truth with one token made wrong (a
/// position that moves every round), and the branches hold the right
/// token there and the truth below it, then a decoy leaf at the root.
struct Oracle {
    truth: Vec<u32>,
    vocab: u32,
}

impl Proposer for Oracle {
    fn propose(&mut self, batch: &mut [ProposeRequest]) -> Result<Vec<Proposal>, DraftError> {
        Ok(batch
            .iter()
            .map(|r| {
                let at = r.context.len();
                let right: Vec<u32> = self.truth[at.min(self.truth.len())..]
                    .iter()
                    .take(r.k)
                    .copied()
                    .collect();
                if right.is_empty() {
                    return Proposal::default();
                }
                let wrong_at = at % right.len();
                let mut chain = right.clone();
                chain[wrong_at] = (chain[wrong_at] + 1) % self.vocab;
                let mut p = Proposal::chain(chain, None);
                let mut parent = wrong_at.checked_sub(1);
                for &t in &right[wrong_at..] {
                    if p.branches.len() == r.branches {
                        break;
                    }
                    p.branches.push((t, parent));
                    parent = Some(p.tokens.len() + p.branches.len() - 1);
                }
                let decoy = (right[0] + 2) % self.vocab;
                let taken = [p.tokens[0], right[0]];
                if p.branches.len() < r.branches && !taken.contains(&decoy) {
                    p.branches.push((decoy, None));
                }
                p
            })
            .collect())
    }
}

/// Another proposer's chain with deterministic siblings added: at every
/// even chain position the `width` tokens after the chain's (mod vocab;
/// odd positions keep one child, so a draft's q still applies there),
/// then a two-token path under the root, within the branch budget.
/// Siblings never repeat a token.
struct Widen<P> {
    inner: P,
    vocab: u32,
    width: u32,
}

impl<P: Proposer> Proposer for Widen<P> {
    fn propose(&mut self, batch: &mut [ProposeRequest]) -> Result<Vec<Proposal>, DraftError> {
        let mut out = self.inner.propose(batch)?;
        for (p, r) in out.iter_mut().zip(batch.iter()) {
            let add = |p: &mut Proposal, t: u32, parent: Option<usize>| {
                let taken = |p: &Proposal| {
                    let chain_child = match parent {
                        None => p.tokens.first(),
                        Some(i) if i + 1 < p.tokens.len() => p.tokens.get(i + 1),
                        _ => None,
                    };
                    chain_child == Some(&t) || p.branches.contains(&(t, parent))
                };
                if p.branches.len() < r.branches && !taken(p) {
                    p.branches.push((t, parent));
                    Some(p.tokens.len() + p.branches.len() - 1)
                } else {
                    None
                }
            };
            for i in (0..p.tokens.len()).step_by(2) {
                for w in 1..=self.width {
                    let t = (p.tokens[i] + w) % self.vocab;
                    add(p, t, i.checked_sub(1));
                }
            }
            let last = r.context[r.context.len() - 1];
            if let Some(n) = add(p, (last + 3) % self.vocab, None) {
                add(p, (last + 5) % self.vocab, Some(n));
            }
        }
        Ok(out)
    }

    fn release(&mut self, seq_id: u64) {
        self.inner.release(seq_id);
    }
}

fn greedy() -> Sampler {
    Sampler::new(SamplingParams::default())
}

fn decode_tree(
    target: &Model,
    proposer: &mut dyn Proposer,
    prompt: &[u32],
    max_new: usize,
    shape: (usize, usize),
    stats: &mut SpecStats,
) -> Vec<u32> {
    spec_decode_tree(
        target,
        Some(proposer),
        prompt,
        max_new,
        shape,
        greedy(),
        stats,
    )
}

fn plain(target: &Model, prompt: &[u32], max_new: usize) -> Vec<u32> {
    spec_decode(
        target,
        None,
        prompt,
        max_new,
        0,
        SamplingParams::default(),
        &mut SpecStats::default(),
    )
}

#[test]
fn tiny_greedy_tree_speculation_equals_plain_decoding() {
    let spec = TinySpec {
        dtype: GgmlDType::Q6K,
        ..TinySpec::qwen2(11)
    };
    let target = tiny_model(&spec, "t.gguf");
    let vocab = target.config().vocab_size as u32;
    let close = Arc::new(tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q4K,
            ..TinySpec::qwen2(11)
        },
        "d.gguf",
    ));
    let prompts: [Vec<u32>; 3] = [
        vec![5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
        (0..30).map(|i| (i * 13 % 384) as u32).collect(),
        vec![100, 101, 102, 103, 104, 100, 101, 102],
    ];
    let max_new = 40;
    let (mut oracle_stats, mut noise_stats) = (SpecStats::default(), SpecStats::default());
    for prompt in &prompts {
        let want = plain(&target, prompt, max_new);
        let mut truth = prompt.clone();
        truth.extend_from_slice(&want);
        for (k, branches) in [(1, 1), (3, 4), (5, 8), (8, 16)] {
            let mut oracle = Oracle {
                truth: truth.clone(),
                vocab,
            };
            let shape = (k, branches);
            let got = decode_tree(
                &target,
                &mut oracle,
                prompt,
                max_new,
                shape,
                &mut oracle_stats,
            );
            assert_eq!(got, want, "oracle tree k={k} branches={branches}");
            let mut ngram = Widen {
                inner: NgramProposer::new(1, 3).unwrap(),
                vocab,
                width: 2,
            };
            let got = decode_tree(
                &target,
                &mut ngram,
                prompt,
                max_new,
                shape,
                &mut noise_stats,
            );
            assert_eq!(got, want, "n-gram tree k={k} branches={branches}");
            let mut draft = Widen {
                inner: ModelDraft::new(close.clone(), 8, BS).unwrap(),
                vocab,
                width: 1,
            };
            let got = decode_tree(
                &target,
                &mut draft,
                prompt,
                max_new,
                shape,
                &mut noise_stats,
            );
            assert_eq!(got, want, "draft tree k={k} branches={branches}");
        }
    }
    eprintln!(
        "oracle trees: {} tree rounds, {} won by a branch, {:.2} tokens per pass; \
         noise trees: {} tree rounds, {:.2} tokens per pass",
        oracle_stats.tree_rounds,
        oracle_stats.branch_wins,
        oracle_stats.mean_accepted_length(),
        noise_stats.tree_rounds,
        noise_stats.mean_accepted_length()
    );
    // Every oracle round with a branch is won by it: the right token was
    // only ever on a branch.
    assert!(oracle_stats.tree_rounds > 50 && noise_stats.tree_rounds > 50);
    assert_eq!(oracle_stats.branch_wins, oracle_stats.tree_rounds);
    assert!(oracle_stats.mean_accepted_length() > 2.0);
}

#[test]
fn real_pair_greedy_tree_speculation_equals_plain_decoding() {
    let (Some(tp), Some(dp)) = (
        real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        real_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    ) else {
        return;
    };
    let target = load_gguf(&tp).unwrap();
    let vocab = target.config().vocab_size as u32;
    let draft = Arc::new(load_gguf(&dp).unwrap());
    let tok = TextTokenizer::from_gguf_file(&tp).unwrap();
    let max_new = 48;
    let mut stats = SpecStats::default();
    let texts = [
        "Write a Python function that returns the n-th prime number.",
        "Explain in three sentences what a mutex is.",
    ];
    for (i, text) in texts.iter().enumerate() {
        let chat = tok
            .apply_chat_template(&[ChatMessage::new("user", *text)], true)
            .unwrap();
        let prompt = tok.encode(&chat, false).unwrap();
        let want = plain(&target, &prompt, max_new);
        let mut truth = prompt.clone();
        truth.extend_from_slice(&want);
        let mut oracle = Oracle { truth, vocab };
        let got = decode_tree(&target, &mut oracle, &prompt, max_new, (4, 6), &mut stats);
        assert_eq!(got, want, "oracle tree, prompt {i}");
        let blocks = (prompt.len() + max_new + 16).div_ceil(BS);
        let mut d = Widen {
            inner: ModelDraft::new(draft.clone(), blocks, BS).unwrap(),
            vocab,
            width: 1,
        };
        let got = decode_tree(&target, &mut d, &prompt, max_new, (4, 6), &mut stats);
        assert_eq!(got, want, "draft tree, prompt {i}");
        let mut ngram = Widen {
            inner: NgramProposer::new(1, 4).unwrap(),
            vocab,
            width: 2,
        };
        let got = decode_tree(&target, &mut ngram, &prompt, max_new, (4, 6), &mut stats);
        assert_eq!(got, want, "n-gram tree, prompt {i}");
    }
    eprintln!(
        "real pair trees: {} tree rounds, {} won by a branch, {:.2} tokens per pass",
        stats.tree_rounds,
        stats.branch_wins,
        stats.mean_accepted_length()
    );
    assert!(stats.branch_wins > 0);
}

/// Kimi K3 (KDA recurrent state + MLA latent cache): the tree's accepted
/// leaf's state is the one committed, so trees whose branches win still
/// decode exactly as plain decoding does.
#[test]
fn tiny_k3_greedy_tree_speculation_equals_plain_decoding() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kimi_k3");
    let target = specgate_verify::model::load_model(&fixtures.join("tiny-k3.gguf")).unwrap();
    assert!(target.supports_trees() && target.has_recurrent_state());
    let vocab = target.config().vocab_size as u32;
    let draft =
        Arc::new(specgate_verify::model::load_model(&fixtures.join("tiny-draft-hf")).unwrap());
    let prompts: [Vec<u32>; 2] = [
        vec![305, 375, 100, 280, 305, 375, 100, 280, 305, 375],
        (0..20).map(|i| (i * 37 % 500) as u32 + 3).collect(),
    ];
    let max_new = 24;
    let mut stats = SpecStats::default();
    for prompt in &prompts {
        let want = plain(&target, prompt, max_new);
        let mut truth = prompt.clone();
        truth.extend_from_slice(&want);
        for shape in [(1, 1), (3, 4), (6, 9)] {
            let mut oracle = Oracle {
                truth: truth.clone(),
                vocab,
            };
            let got = decode_tree(&target, &mut oracle, prompt, max_new, shape, &mut stats);
            assert_eq!(got, want, "oracle tree {shape:?}");
            let mut ngram = Widen {
                inner: NgramProposer::new(1, 3).unwrap(),
                vocab,
                width: 2,
            };
            let got = decode_tree(&target, &mut ngram, prompt, max_new, shape, &mut stats);
            assert_eq!(got, want, "n-gram tree {shape:?}");
            let mut d = Widen {
                inner: ModelDraft::new(draft.clone(), 8, BS).unwrap(),
                vocab,
                width: 1,
            };
            let got = decode_tree(&target, &mut d, prompt, max_new, shape, &mut stats);
            assert_eq!(got, want, "draft tree {shape:?}");
        }
    }
    eprintln!(
        "tiny K3 trees: {} tree rounds, {} won by a branch, {:.2} tokens per pass",
        stats.tree_rounds,
        stats.branch_wins,
        stats.mean_accepted_length()
    );
    assert!(stats.branch_wins > 20);
}

const V: usize = 12;
const N: usize = 6_000;

fn tiny(seed: u64, name: &str) -> Model {
    let spec = TinySpec {
        vocab_size: V,
        dtype: GgmlDType::F32,
        // Flat enough that draft and target overlap, and branches win.
        logit_scale: 0.7,
        ..TinySpec::llama(seed)
    };
    tiny_model(&spec, name)
}

/// Temperature 1 with every penalty on.
fn params(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

fn sampler(prompt: &[u32], seed: u64) -> Sampler {
    Sampler::new(params(seed)).with_processor(LogitsProcessor::new(strong_controls(), prompt, None))
}

/// How the first two tokens sampled through a proposer's trees fit the
/// exact law.
struct Fit {
    /// Chi-square of the joint law and its critical value.
    stat: f64,
    crit: f64,
    /// The same for the first token alone (a bias there is diluted over V
    /// cells of the joint, not here).
    first: f64,
    first_crit: f64,
    /// How often each `(x1, x2)` was drawn, `[x1 * V + x2]`.
    counts: Vec<usize>,
    stats: SpecStats,
}

impl Fit {
    /// Asserts that both the joint law and the first token's fit.
    fn assert_fits(&self, what: &str) {
        let Self {
            stat,
            crit,
            first,
            first_crit,
            ..
        } = self;
        eprintln!(
            "{what}: chi2 {stat:.1} (critical {crit:.1}), first token {first:.1} ({first_crit:.1}), {} branch wins",
            self.stats.branch_wins
        );
        assert!(
            stat < crit && first < first_crit,
            "{what}: samples deviate: chi2 {stat} >= {crit} or {first} >= {first_crit}"
        );
    }
}

/// Samples the first two tokens through `proposer`'s trees N times
/// (decoding `max_new` tokens: the first round drafts a chain of up to
/// `max_new - 1`), each with `sampler(seed)`, against the exact law under
/// `sampler(0)`'s processing.
fn sampled_fit(
    target: &Model,
    proposer: &mut dyn Proposer,
    prompt: &[u32],
    max_new: usize,
    sampler: impl Fn(u64) -> Sampler,
) -> Fit {
    let exact = exact_two_token_joint(target, prompt, &mut sampler(0));
    assert!((exact.iter().sum::<f64>() - 1.0).abs() < 1e-4);
    let mut counts = vec![0usize; V * V];
    let mut stats = SpecStats::default();
    for i in 0..N {
        let got = spec_decode_tree(
            target,
            Some(&mut *proposer),
            prompt,
            max_new,
            (3, 5),
            sampler(1000 + i as u64),
            &mut stats,
        );
        counts[got[0] as usize * V + got[1] as usize] += 1;
    }
    let (stat, crit) = chi_square(&exact, &counts, N);
    let marginal = |v: &[f64]| -> Vec<f64> { v.chunks(V).map(|r| r.iter().sum()).collect() };
    let first_counts: Vec<usize> = counts.chunks(V).map(|r| r.iter().sum()).collect();
    let (first, first_crit) = chi_square(&marginal(&exact), &first_counts, N);
    eprintln!(
        "tree rounds {}, branch nodes {}",
        stats.tree_rounds, stats.branch_tokens
    );
    Fit {
        stat,
        crit,
        first,
        first_crit,
        counts,
        stats,
    }
}

#[test]
fn sampled_tree_speculation_with_penalties_matches_processed_target() {
    let target = tiny(21, "target.gguf");
    let prompt = vec![1u32, 5, 9, 2, 7];
    // A draft's q-drawn chain with deterministic siblings: positions
    // with one child take the q rule, the branched ones the
    // without-replacement rule.
    let mut draft = Widen {
        inner: ModelDraft::new(Arc::new(tiny(22, "draft.gguf")), 2, 16).unwrap(),
        vocab: V as u32,
        width: 1,
    };
    let fit = sampled_fit(&target, &mut draft, &prompt, 2, |s| sampler(&prompt, s));
    fit.assert_fits("draft tree");
    assert!(
        fit.stats.branch_wins > 100,
        "branches should win often on a flat target"
    );
    // A deterministic tree (no q anywhere).
    let mut ngram = Widen {
        inner: NgramProposer::new(1, 3).unwrap(),
        vocab: V as u32,
        width: 2,
    };
    let fit = sampled_fit(&target, &mut ngram, &prompt, 2, |s| sampler(&prompt, s));
    fit.assert_fits("deterministic tree");
    assert!(fit.stats.branch_wins > 100);
}

/// The draft model's own trees at temperature 1 (no added siblings): its
/// threshold is set just below its top probability at the first position,
/// so that position is sure (a chain, verified by the q rule) while later
/// ones are sometimes unsure (trees). A draft that branched wherever its
/// DRAWN token was unlikely would branch at the first position exactly
/// when it did not draw its top token, and the q rule would then see a
/// biased draw: the first token's law would be off by about
/// r(a) (1 - q(a)) for the draft's top token a.
#[test]
fn sampled_draft_trees_branch_on_q_alone_and_stay_exact() {
    let target = tiny(21, "target.gguf");
    let prompt = vec![1u32, 5, 9, 2, 7];
    let mut draft = ModelDraft::new(Arc::new(tiny(22, "draft.gguf")), 2, 16).unwrap();
    // The draft's q at the first position (a chain proposal's first row).
    let table = [0u32, 1];
    let mut s = sampler(&prompt, 0);
    let p = draft
        .propose(&mut [ProposeRequest {
            seq_id: 99,
            context: &prompt,
            block_table: &table,
            k: 1,
            branches: 0,
            sampler: &mut s,
        }])
        .unwrap();
    draft.release(99);
    let q0 = &p[0].q.as_ref().expect("a sampled draft gives q")[0];
    let top = q0.iter().copied().fold(0f32, f32::max);
    assert!(top > 0.2 && top < 0.95, "q0 top {top}");
    draft.set_unsure_below(top - 1e-4);
    // Three tokens: the first round's chain has two positions, the second
    // sometimes unsure.
    let fit = sampled_fit(&target, &mut draft, &prompt, 3, |s| sampler(&prompt, s));
    fit.assert_fits(&format!("draft's own tree (q0 top {top:.3})"));
    let wins = fit.stats.branch_wins;
    assert!(wins > 50, "the draft's trees must win sometimes: {wins}");
}

/// A toy grammar over any vocabulary: output position i takes only
/// `FORCED` when i % 5 == 3, else any token of i's parity. Endless.
struct Parity {
    vocab: usize,
    committed: usize,
}

const FORCED: u32 = 6;

fn parity_ok(pos: usize, t: u32) -> bool {
    if pos % 5 == 3 {
        t == FORCED
    } else {
        t as usize % 2 == pos % 2
    }
}

impl TokenConstraint for Parity {
    fn allowed(&mut self, pending: &[u32]) -> Result<TokenMask, ConstraintError> {
        Ok(mask_at(
            self.vocab,
            self.committed + pending.len(),
            parity_ok,
        ))
    }

    fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        valid_prefix_at(self.committed, tokens, parity_ok)
    }

    fn forced(&mut self, pending: &[u32]) -> Vec<u32> {
        let pos = self.committed + pending.len();
        if pos % 5 == 3 {
            vec![FORCED]
        } else {
            Vec::new()
        }
    }

    fn commit(&mut self, tokens: &[u32]) -> Result<(), ConstraintError> {
        for &t in tokens {
            if !parity_ok(self.committed, t) {
                return Err(ConstraintError(format!("{t} at {}", self.committed)));
            }
            self.committed += 1;
        }
        Ok(())
    }
}

fn parity_sampler(
    params: SamplingParams,
    controls: Controls,
    prompt: &[u32],
    vocab: usize,
) -> Sampler {
    Sampler::new(params).with_processor(LogitsProcessor::new(
        controls,
        prompt,
        Some(Box::new(Parity {
            vocab,
            committed: 0,
        })),
    ))
}

#[test]
fn greedy_trees_under_a_grammar_equal_constrained_plain_decoding() {
    let target = tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q6K,
            ..TinySpec::qwen2(11)
        },
        "t.gguf",
    );
    let vocab = target.config().vocab_size;
    let close = Arc::new(tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q4K,
            ..TinySpec::qwen2(11)
        },
        "d.gguf",
    ));
    let grammar = |prompt: &[u32]| {
        parity_sampler(
            SamplingParams::default(),
            Controls::default(),
            prompt,
            vocab,
        )
    };
    let prompts: [Vec<u32>; 2] = [
        vec![5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
        (0..30).map(|i| (i * 13 % 384) as u32).collect(),
    ];
    let max_new = 30;
    let (mut oracle_stats, mut noise_stats) = (SpecStats::default(), SpecStats::default());
    for prompt in &prompts {
        let mut none = SpecStats::default();
        let want = spec_decode_tree(
            &target,
            None,
            prompt,
            max_new,
            (0, 0),
            grammar(prompt),
            &mut none,
        );
        for (i, &t) in want.iter().enumerate() {
            assert!(parity_ok(i, t), "plain output breaks the grammar at {i}");
        }
        assert_ne!(
            want,
            plain(&target, prompt, max_new),
            "the grammar changed nothing"
        );
        let mut truth = prompt.clone();
        truth.extend_from_slice(&want);
        for shape in [(1, 1), (3, 4), (5, 8), (8, 16)] {
            // The oracle's wrong chain token breaks the grammar (parity
            // flips, or a forced position): the chain is cut there and
            // the right token waits on a branch.
            let mut oracle = Oracle {
                truth: truth.clone(),
                vocab: vocab as u32,
            };
            let got = spec_decode_tree(
                &target,
                Some(&mut oracle),
                prompt,
                max_new,
                shape,
                grammar(prompt),
                &mut oracle_stats,
            );
            assert_eq!(got, want, "oracle tree {shape:?}");
            // Siblings t+1 (refused: wrong parity) and t+2 (admitted,
            // but for forced positions).
            let mut draft = Widen {
                inner: ModelDraft::new(close.clone(), 8, BS).unwrap(),
                vocab: vocab as u32,
                width: 2,
            };
            let got = spec_decode_tree(
                &target,
                Some(&mut draft),
                prompt,
                max_new,
                shape,
                grammar(prompt),
                &mut noise_stats,
            );
            assert_eq!(got, want, "draft tree {shape:?}");
        }
    }
    eprintln!(
        "under a grammar: oracle {} tree rounds, {} won by a branch, {} forced; noise {} tree rounds, {:.2} tokens per pass",
        oracle_stats.tree_rounds,
        oracle_stats.branch_wins,
        oracle_stats.grammar_forced_tokens,
        noise_stats.tree_rounds,
        noise_stats.mean_accepted_length()
    );
    assert!(oracle_stats.tree_rounds > 20 && oracle_stats.branch_wins > 20);
    assert!(noise_stats.tree_rounds > 20);
    assert!(oracle_stats.grammar_forced_tokens > 0);
}

#[test]
fn sampled_trees_under_a_grammar_match_the_constrained_target() {
    let target = tiny(21, "target.gguf");
    let prompt = vec![1u32, 5, 9, 2, 7];
    let mut draft = Widen {
        inner: ModelDraft::new(Arc::new(tiny(22, "draft.gguf")), 2, 16).unwrap(),
        vocab: V as u32,
        width: 2,
    };
    let fit = sampled_fit(&target, &mut draft, &prompt, 3, |seed| {
        parity_sampler(params(seed), strong_controls(), &prompt, V)
    });
    for (cell, &n) in fit.counts.iter().enumerate() {
        let (x1, x2) = ((cell / V) as u32, (cell % V) as u32);
        assert!(n == 0 || (parity_ok(0, x1) && parity_ok(1, x2)));
    }
    let (stat, crit, stats) = (fit.stat, fit.crit, &fit.stats);
    eprintln!(
        "under a grammar: chi2 {stat:.1} (critical {crit:.1}), {} tree rounds, {} branch wins",
        stats.tree_rounds, stats.branch_wins
    );
    assert!(
        stat < crit,
        "constrained tree samples deviate: chi2 {stat} >= {crit}"
    );
    assert!(stats.branch_wins > 100, "{stats:?}");
}
