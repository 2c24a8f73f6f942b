//! Speculative sampling is lossless: at temperature 0.8 with top-p 0.9, the
//! first two tokens drawn with a deliberately unlike draft follow exactly
//! the target's own warped joint distribution.
//!
//! The exact target distribution p(x1) p(x2 | x1) is computed from the tiny
//! model (vocabulary 12, so 144 joint outcomes); the speculative samples
//! are compared with it by a chi-square goodness-of-fit test at
//! significance 1e-6 (cells with expected count < 5 pooled). With a fixed
//! seed the test is deterministic; over seeds, a correct implementation
//! fails it with probability 1e-6. A broken acceptance rule (always accept,
//! or resample from p instead of max(0, p - q)) must fail it, and does.

mod common;

use candle_core::quantized::GgmlDType;
use common::tiny_model;
use specgate_draft::{ModelDraft, ProposeRequest, Proposer};
use specgate_verify::accept::{accept_sampled, Verdict};
use specgate_verify::tiny::TinySpec;
use specgate_verify::{KvPool, LogitsWanted, Model, Sampler, SamplingParams, SeqInput};
use std::sync::Arc;

const V: usize = 12;
const K: usize = 3;
/// Samples for the correct rule; broken rules fail with far fewer.
const N: usize = 12_000;
const N_BROKEN: usize = 4_000;

fn params(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_k: 0,
        top_p: 0.9,
        seed: Some(seed),
    }
}

fn tiny(seed: u64, name: &str) -> Model {
    let spec = TinySpec {
        vocab_size: V,
        dtype: GgmlDType::F32,
        // Flat enough that draft and target overlap: where they do not, a
        // wrong residual cannot show (every draft is rejected either way).
        logit_scale: 0.7,
        ..TinySpec::llama(seed)
    };
    tiny_model(&spec, name)
}

type Rule = fn(&[Vec<f32>], &[u32], Option<&[Vec<f32>]>, &mut Sampler) -> Verdict;

/// Wrong on purpose: keeps every draft.
fn always_accept(
    rows: &[Vec<f32>],
    draft: &[u32],
    _q: Option<&[Vec<f32>]>,
    s: &mut Sampler,
) -> Verdict {
    let mut tokens = draft.to_vec();
    let p = s.params().warp(&rows[draft.len()]);
    tokens.push(s.draw(&p));
    Verdict {
        accepted: draft.len(),
        tokens,
    }
}

/// Wrong on purpose: the right acceptance test, but resamples from p.
fn resample_from_p(
    rows: &[Vec<f32>],
    draft: &[u32],
    q: Option<&[Vec<f32>]>,
    s: &mut Sampler,
) -> Verdict {
    let q = q.unwrap();
    let mut tokens = Vec::new();
    for (i, &d) in draft.iter().enumerate() {
        let p = s.params().warp(&rows[i]);
        if s.uniform() < (p[d as usize] / q[i][d as usize]).min(1.0) {
            tokens.push(d);
        } else {
            tokens.push(s.draw(&p));
            return Verdict {
                accepted: i,
                tokens,
            };
        }
    }
    let p = s.params().warp(&rows[draft.len()]);
    tokens.push(s.draw(&p));
    Verdict {
        accepted: draft.len(),
        tokens,
    }
}

struct Setup {
    target: Model,
    draft: ModelDraft,
    pool: KvPool,
    prompt: Vec<u32>,
    table: Vec<u32>,
}

impl Setup {
    fn new() -> Self {
        let target = tiny(21, "target.gguf");
        let draft = ModelDraft::new(Arc::new(tiny(22, "draft.gguf")), 2, 16).unwrap();
        let mut pool = KvPool::new(target.config(), 2, 16).unwrap();
        let prompt = vec![1u32, 5, 9, 2, 7];
        let table = vec![0u32, 1];
        // Target cache holds all but the last prompt token; rounds only
        // write later positions, so every sample starts from this state.
        target
            .forward_one(
                &mut pool,
                &prompt[..prompt.len() - 1],
                0,
                &table,
                LogitsWanted::None,
            )
            .unwrap();
        Setup {
            target,
            draft,
            pool,
            prompt,
            table,
        }
    }

    /// Exact warped p(x1, x2) of the target.
    fn exact(&mut self) -> Vec<f64> {
        let w = params(0);
        let mut pool = KvPool::new(self.target.config(), 2, 16).unwrap();
        let first = self
            .target
            .forward_one(&mut pool, &self.prompt, 0, &self.table, LogitsWanted::Last)
            .unwrap();
        let p1 = w.warp(&first[0]);
        let mut joint = vec![0f64; V * V];
        for x1 in 0..V {
            if p1[x1] == 0.0 {
                continue;
            }
            let next = self
                .target
                .forward_one(
                    &mut pool,
                    &[x1 as u32],
                    self.prompt.len(),
                    &self.table,
                    LogitsWanted::Last,
                )
                .unwrap();
            let p2 = w.warp(&next[0]);
            for x2 in 0..V {
                joint[x1 * V + x2] = p1[x1] as f64 * p2[x2] as f64;
            }
        }
        joint
    }

    /// One speculative sample of the first two tokens with `rule`.
    fn sample(&mut self, rule: Rule, seq_id: u64) -> (usize, usize) {
        let mut sampler = Sampler::new(params(1000 + seq_id));
        let mut tokens = self.prompt.clone();
        while tokens.len() < self.prompt.len() + 2 {
            let proposal = self
                .draft
                .propose(&mut [ProposeRequest {
                    seq_id,
                    context: &tokens,
                    block_table: &self.table,
                    k: K,
                    sampler: &mut sampler,
                }])
                .unwrap()
                .remove(0);
            let mut rows_in = vec![*tokens.last().unwrap()];
            rows_in.extend_from_slice(&proposal.tokens);
            let rows = self
                .target
                .forward(
                    &mut self.pool,
                    &[SeqInput {
                        tokens: &rows_in,
                        start_pos: tokens.len() - 1,
                        block_table: &self.table,
                        logits: LogitsWanted::All,
                    }],
                )
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let v = rule(&rows, &proposal.tokens, proposal.q.as_deref(), &mut sampler);
            tokens.extend_from_slice(&v.tokens);
        }
        self.draft.release(seq_id);
        let n = self.prompt.len();
        (tokens[n] as usize, tokens[n + 1] as usize)
    }
}

/// Chi-square statistic and its critical value at significance 1e-6.
fn chi_square(exact: &[f64], counts: &[usize], n: usize) -> (f64, f64) {
    let (mut stat, mut pooled_e, mut pooled_o, mut cells) = (0.0, 0.0, 0.0, 0usize);
    for (&p, &c) in exact.iter().zip(counts) {
        let e = p * n as f64;
        if e >= 5.0 {
            stat += (c as f64 - e).powi(2) / e;
            cells += 1;
        } else {
            pooled_e += e;
            pooled_o += c as f64;
        }
    }
    if pooled_e > 0.0 {
        stat += (pooled_o - pooled_e).powi(2) / pooled_e.max(1e-9);
        cells += 1;
    }
    let df = (cells - 1) as f64;
    // Wilson-Hilferty: chi2 quantile from the normal one (z = 4.753 at 1e-6).
    let z = 4.753;
    let a = 2.0 / (9.0 * df);
    (stat, df * (1.0 - a + z * a.sqrt()).powi(3))
}

fn run(setup: &mut Setup, rule: Rule, exact: &[f64], n: usize) -> (f64, f64) {
    let mut counts = vec![0usize; V * V];
    for i in 0..n {
        let (a, b) = setup.sample(rule, i as u64);
        counts[a * V + b] += 1;
    }
    let impossible: usize = counts
        .iter()
        .zip(exact)
        .filter(|(_, &p)| p == 0.0)
        .map(|(c, _)| c)
        .sum();
    let (stat, crit) = chi_square(exact, &counts, n);
    // A token outside top-p is impossible: count it as a certain failure.
    (if impossible > 0 { f64::INFINITY } else { stat }, crit)
}

#[test]
fn speculative_sampling_matches_target_distribution_and_broken_rules_fail() {
    let mut setup = Setup::new();
    let exact = setup.exact();
    assert!((exact.iter().sum::<f64>() - 1.0).abs() < 1e-4);
    let support = exact.iter().filter(|&&p| p > 0.0).count();
    eprintln!("target joint distribution: {support} outcomes of {}", V * V);
    assert!(
        support > 4,
        "the warped distribution should not be degenerate ({support} outcomes)"
    );

    let (stat, crit) = run(&mut setup, accept_sampled, &exact, N);
    eprintln!("correct rule: chi2 {stat:.1} (critical {crit:.1})");
    assert!(
        stat < crit,
        "speculative samples deviate from the target: chi2 {stat} >= {crit}"
    );

    let (stat, crit) = run(&mut setup, always_accept, &exact, N_BROKEN);
    eprintln!("always accept: chi2 {stat:.1} (critical {crit:.1})");
    assert!(stat >= crit, "an always-accept rule went undetected");

    let (stat, crit) = run(&mut setup, resample_from_p, &exact, N_BROKEN);
    eprintln!("resample from p: chi2 {stat:.1} (critical {crit:.1})");
    assert!(stat >= crit, "resampling from p went undetected");
}
