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
//!
//! The same holds with logits processing on (presence, frequency and
//! repetition penalties, logit_bias, min-p): the samples follow the
//! PROCESSED target joint distribution, where token 2's row is processed
//! with token 1 in its history. Broken variants fail it: a draft q that
//! leaves the penalties out (the tokens drawn from the processed q), and a
//! verified row processed without the draft before it in its history.

mod common;

use candle_core::quantized::GgmlDType;
use common::{chi_square, exact_two_token_joint, strong_controls, tiny_model};
use specgate_draft::{ModelDraft, ProposeRequest, Proposer};
use specgate_verify::accept::{accept_sampled, Verdict};
use specgate_verify::process::LogitsProcessor;
use specgate_verify::tiny::TinySpec;
use specgate_verify::{
    ConstraintError, Controls, KvPool, LogitsWanted, Model, Sampler, SamplingParams, SeqInput,
};
use std::sync::Arc;

const V: usize = 12;
const K: usize = 3;
/// Samples for the correct rule; broken rules fail with far fewer.
const N: usize = 12_000;
const N_BROKEN: usize = 4_000;
/// With processing on: the broken variants miss by far (chi2 in the
/// thousands, or outcomes min-p makes impossible), so fewer samples do;
/// the correct rule still gets enough for expected counts >= 5 in most
/// cells.
const N_PROCESSED: usize = 6_000;
const N_PROCESSED_BROKEN: usize = 1_500;

fn params(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_k: 0,
        top_p: 0.9,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

fn processed_params(seed: u64) -> SamplingParams {
    SamplingParams {
        top_p: 1.0,
        min_p: 0.05,
        ..params(seed)
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

type Rule = fn(
    &mut [Vec<f32>],
    &[u32],
    Option<&[Vec<f32>]>,
    &mut Sampler,
) -> Result<Verdict, ConstraintError>;

fn verdict(s: &mut Sampler, accepted: usize, tokens: Vec<u32>) -> Result<Verdict, ConstraintError> {
    s.commit(&tokens)?;
    Ok(Verdict {
        accepted,
        tokens,
        logprobs: Vec::new(),
    })
}

/// Wrong on purpose: keeps every draft.
fn always_accept(
    rows: &mut [Vec<f32>],
    draft: &[u32],
    _q: Option<&[Vec<f32>]>,
    s: &mut Sampler,
) -> Result<Verdict, ConstraintError> {
    let mut tokens = draft.to_vec();
    s.process(&mut rows[draft.len()], draft)?;
    let p = s.params().warp(&rows[draft.len()]);
    tokens.push(s.draw(&p));
    verdict(s, draft.len(), tokens)
}

/// The acceptance rule with row i processed with `history(draft, i)` as
/// its pending tokens (right: `draft[..i]`), resampling from the residual
/// or (wrong) from p.
fn accept_with(
    rows: &mut [Vec<f32>],
    draft: &[u32],
    q: &[Vec<f32>],
    s: &mut Sampler,
    history: fn(&[u32], usize) -> &[u32],
    residual: bool,
) -> Result<Verdict, ConstraintError> {
    let mut tokens = Vec::new();
    for (i, &d) in draft.iter().enumerate() {
        s.process(&mut rows[i], history(draft, i))?;
        let p = s.params().warp(&rows[i]);
        if s.uniform() < (p[d as usize] / q[i][d as usize]).min(1.0) {
            tokens.push(d);
            continue;
        }
        let r: Vec<f32> = if residual {
            p.iter().zip(&q[i]).map(|(a, b)| (a - b).max(0.0)).collect()
        } else {
            p
        };
        tokens.push(s.draw(&r));
        return verdict(s, i, tokens);
    }
    let n = draft.len();
    s.process(&mut rows[n], history(draft, n))?;
    let p = s.params().warp(&rows[n]);
    tokens.push(s.draw(&p));
    verdict(s, n, tokens)
}

/// Wrong on purpose: the right acceptance test, but resamples from p.
fn resample_from_p(
    rows: &mut [Vec<f32>],
    draft: &[u32],
    q: Option<&[Vec<f32>]>,
    s: &mut Sampler,
) -> Result<Verdict, ConstraintError> {
    accept_with(rows, draft, q.unwrap(), s, |d, i| &d[..i], false)
}

/// Wrong on purpose: verified rows after the first are processed as if
/// draft 0 had not been emitted.
fn history_without_draft_0(
    rows: &mut [Vec<f32>],
    draft: &[u32],
    q: Option<&[Vec<f32>]>,
    s: &mut Sampler,
) -> Result<Verdict, ConstraintError> {
    accept_with(rows, draft, q.unwrap(), s, |d, i| &d[i.min(1)..i], true)
}

struct Setup {
    target: Model,
    draft: ModelDraft,
    /// The draft's model again, to compute its unprocessed q.
    draft_model: Arc<Model>,
    pool: KvPool,
    prompt: Vec<u32>,
    table: Vec<u32>,
    /// Processing on (and its params) or off (`params`).
    controls: Option<Controls>,
    /// Wrong on purpose: hand acceptance the draft's q without processing
    /// (the drafts themselves drawn from the processed q).
    strip_q: bool,
}

impl Setup {
    fn new(controls: Option<Controls>) -> Self {
        let target = tiny(21, "target.gguf");
        let draft_model = Arc::new(tiny(22, "draft.gguf"));
        let draft = ModelDraft::new(draft_model.clone(), 2, 16).unwrap();
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
            draft_model,
            pool,
            prompt,
            table,
            controls,
            strip_q: false,
        }
    }

    fn params(&self, seed: u64) -> SamplingParams {
        match self.controls {
            Some(_) => processed_params(seed),
            None => params(seed),
        }
    }

    fn sampler(&self, seed: u64) -> Sampler {
        let s = Sampler::new(self.params(seed));
        match &self.controls {
            Some(c) => s.with_processor(LogitsProcessor::new(c.clone(), &self.prompt, None)),
            None => s,
        }
    }

    /// Exact processed, warped p(x1, x2) of the target: row 2 is processed
    /// with x1 in its history.
    fn exact(&mut self) -> Vec<f64> {
        exact_two_token_joint(&self.target, &self.prompt, &mut self.sampler(0))
    }

    /// One speculative sample of the first two tokens with `rule`.
    fn sample(&mut self, rule: Rule, seq_id: u64) -> (usize, usize) {
        let mut sampler = self.sampler(1000 + seq_id);
        let mut tokens = self.prompt.clone();
        while tokens.len() < self.prompt.len() + 2 {
            let proposal = self
                .draft
                .propose(&mut [ProposeRequest {
                    seq_id,
                    context: &tokens,
                    block_table: &self.table,
                    k: K,
                    branches: 0,
                    sampler: &mut sampler,
                }])
                .unwrap()
                .remove(0);
            let mut q = proposal.q.clone();
            if self.strip_q {
                q = Some(self.unprocessed_q(&tokens, &proposal.tokens, &sampler));
            }
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
                        state_slot: 0,
                    }],
                )
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let mut rows = rows;
            let v = rule(&mut rows, &proposal.tokens, q.as_deref(), &mut sampler).unwrap();
            tokens.extend_from_slice(&v.tokens);
        }
        self.draft.release(seq_id);
        let n = self.prompt.len();
        (tokens[n] as usize, tokens[n + 1] as usize)
    }

    /// The draft's warped q for each of `drafts` after `context`, from its
    /// raw logits (no penalties, no bias).
    fn unprocessed_q(&self, context: &[u32], drafts: &[u32], s: &Sampler) -> Vec<Vec<f32>> {
        let mut pool = KvPool::new(self.draft_model.config(), 2, 16).unwrap();
        let mut all = context.to_vec();
        all.extend_from_slice(&drafts[..drafts.len().saturating_sub(1)]);
        let rows = self
            .draft_model
            .forward_one(&mut pool, &all, 0, &self.table, LogitsWanted::All)
            .unwrap();
        rows[context.len() - 1..]
            .iter()
            .take(drafts.len())
            .map(|r| s.params().warp(r))
            .collect()
    }
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
    let mut setup = Setup::new(None);
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

#[test]
fn processed_speculative_sampling_matches_processed_target_and_broken_variants_fail() {
    let mut setup = Setup::new(Some(strong_controls()));
    let exact = setup.exact();
    assert!((exact.iter().sum::<f64>() - 1.0).abs() < 1e-4);
    // The processing must matter, or this test proves nothing.
    let unprocessed = Setup::new(None).exact();
    let tv: f64 = exact
        .iter()
        .zip(&unprocessed)
        .map(|(a, b)| (a - b).abs())
        .sum::<f64>()
        / 2.0;
    eprintln!("processing moves the joint distribution by {tv:.3} (total variation)");
    assert!(
        tv > 0.2,
        "the controls barely change the distribution ({tv})"
    );
    let support = exact.iter().filter(|&&p| p > 0.0).count();
    assert!(support > 4, "degenerate distribution ({support} outcomes)");

    let (stat, crit) = run(&mut setup, accept_sampled, &exact, N_PROCESSED);
    eprintln!("processed, correct rule: chi2 {stat:.1} (critical {crit:.1})");
    assert!(
        stat < crit,
        "speculative samples deviate from the processed target: chi2 {stat} >= {crit}"
    );

    let (stat, crit) = run(
        &mut setup,
        history_without_draft_0,
        &exact,
        N_PROCESSED_BROKEN,
    );
    eprintln!("row 1 without draft 0 in its history: chi2 {stat:.1} (critical {crit:.1})");
    assert!(
        stat >= crit,
        "a row missing a draft in its history went undetected"
    );

    setup.strip_q = true;
    let (stat, crit) = run(&mut setup, accept_sampled, &exact, N_PROCESSED_BROKEN);
    eprintln!("q without processing: chi2 {stat:.1} (critical {crit:.1})");
    assert!(stat >= crit, "a q without the penalties went undetected");
}
