//! Sampling controls, grammar constraints and logprobs stay exact under
//! speculation, through the engine on tiny generated models:
//!
//! The tiny models' logits span tens (top-1 to top-2 gaps of ~25), so the
//! penalties and temperatures here are far larger than OpenAI's ranges:
//! what matters is that they change the output.
//!
//! - for every control (presence, frequency and repetition penalties,
//!   logit_bias, min_p, top_k, min_tokens, stop_token_ids) and a toy
//!   grammar, speculation off, n-gram and the draft model at k = 1..8 emit
//!   the same tokens, and the control really changes the output;
//! - a grammar-constrained request only ever emits allowed tokens, and its
//!   constraint's committed state sees exactly the emitted tokens;
//! - logprobs with speculation equal logprobs without (same tokens);
//! - prompt logprobs are the target's raw log-softmax, whether the prompt
//!   is chunked or its prefix is cached.

mod common;

use candle_core::quantized::GgmlDType;
use common::{mask_at, tiny_model, valid_prefix_at};
use specgate::engine::scheduler::SchedulerConfig;
use specgate::engine::{
    spawn, EngineConfig, EngineHandle, Event, FinishReason, GenRequest, KvSize, ProposerKind,
    SpecMethod,
};
use specgate_draft::DraftPolicy;
use specgate_verify::tiny::TinySpec;
use specgate_verify::{
    ConstraintError, ConstraintSource, Controls, KvPool, LogitsWanted, Model, SamplingParams,
    TokenConstraint, TokenLogprob, TokenMask,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const VOCAB: usize = 384;

fn spec() -> TinySpec {
    TinySpec {
        dtype: GgmlDType::Q6K,
        ..TinySpec::qwen2(31)
    }
}

fn target() -> Model {
    tiny_model(&spec(), "target.gguf")
}

/// One engine with the draft model loaded; each request picks its method
/// (n-gram is always available) and its k.
fn engine(tokens: usize) -> EngineHandle {
    engine_sized(256, 64, tokens)
}

fn engine_sized(blocks: usize, max_num_seqs: usize, tokens: usize) -> EngineHandle {
    let draft = tiny_model(
        &TinySpec {
            dtype: GgmlDType::Q4K,
            ..TinySpec::qwen2(31)
        },
        "draft.gguf",
    );
    let cfg = EngineConfig {
        kv: KvSize::Blocks(blocks),
        block_size: 16,
        scheduler: SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: tokens,
        },
        policy: DraftPolicy::Fixed { k: 3 },
        suffix: None,
        tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
        prefix: Default::default(),
        row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
    };
    spawn(target(), ProposerKind::Draft(draft), None, cfg)
        .unwrap()
        .0
}

fn prompt() -> Vec<u32> {
    // Repetitive, so n-gram lookup finds matches.
    vec![5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 40, 41, 42, 5, 6]
}

fn base() -> GenRequest {
    GenRequest {
        prompt: prompt(),
        max_new_tokens: 32,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Everything a stream carried.
#[derive(Debug, Default)]
struct Output {
    ids: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    prompt_logprobs: Option<Vec<TokenLogprob>>,
    reason: Option<FinishReason>,
    error: Option<String>,
}

fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Output {
    let mut out = Output::default();
    loop {
        match rx
            .blocking_recv()
            .expect("stream ended without an end event")
        {
            Event::Tokens { ids, logprobs, .. } => {
                assert!(
                    logprobs.is_empty() || logprobs.len() == ids.len(),
                    "one logprob per token or none"
                );
                out.ids.extend(ids);
                out.logprobs.extend(logprobs);
            }
            Event::PromptLogprobs(lps) => {
                assert!(out.ids.is_empty(), "prompt logprobs come before tokens");
                assert!(out.prompt_logprobs.replace(lps).is_none(), "sent once");
            }
            Event::Finished { reason, .. } => {
                out.reason = Some(reason);
                return out;
            }
            Event::Error(e) => {
                out.error = Some(e);
                return out;
            }
        }
    }
}

/// The request run with speculation off, then with n-gram and the draft
/// at k = 1..8 (all submitted together, so they are batched too); returns
/// the reference output after checking every other equals it.
fn same_everywhere(h: &EngineHandle, req: &GenRequest, what: &str) -> Output {
    let mut variants = vec![(SpecMethod::Off, 0)];
    for k in 1..=8 {
        variants.push((SpecMethod::Ngram, k));
        variants.push((SpecMethod::Draft, k));
    }
    let rxs: Vec<_> = variants
        .iter()
        .map(|&(m, k)| {
            h.submit(GenRequest {
                method: Some(m),
                num_speculative_tokens: Some(k),
                ..req.clone()
            })
            .unwrap()
        })
        .collect();
    let mut outs: Vec<Output> = rxs.into_iter().map(collect).collect();
    let reference = outs.remove(0);
    assert!(reference.error.is_none(), "{what}: {:?}", reference.error);
    for ((m, k), o) in variants[1..].iter().zip(&outs) {
        assert_eq!(o.error, None, "{what}: {m:?} k={k}");
        assert_eq!(o.ids, reference.ids, "{what}: {m:?} k={k}");
        assert_eq!(o.reason, reference.reason, "{what}: {m:?} k={k}");
    }
    reference
}

fn with_controls(c: Controls) -> GenRequest {
    GenRequest {
        controls: c,
        ..base()
    }
}

#[test]
fn every_control_is_exact_under_speculation_and_changes_the_output() {
    let h = engine(256);
    let plain = same_everywhere(&h, &base(), "no controls").ids;
    assert_eq!(plain.len(), 32);
    let most_common = {
        let mut c = [0usize; VOCAB];
        plain.iter().for_each(|&t| c[t as usize] += 1);
        (0..VOCAB).max_by_key(|&t| c[t]).unwrap() as u32
    };
    let penalties = [
        (
            "presence",
            Controls {
                presence_penalty: 30.0,
                ..Controls::default()
            },
        ),
        (
            "frequency",
            Controls {
                frequency_penalty: 15.0,
                ..Controls::default()
            },
        ),
        (
            "repetition",
            Controls {
                repetition_penalty: 5.0,
                ..Controls::default()
            },
        ),
        (
            "logit_bias",
            Controls {
                logit_bias: vec![(most_common, -100.0), (plain[0], -100.0), (3, 2.0)],
                ..Controls::default()
            },
        ),
        (
            "all penalties",
            Controls {
                presence_penalty: 10.0,
                frequency_penalty: 5.0,
                repetition_penalty: 2.0,
                logit_bias: vec![(most_common, -30.0)],
                ..Controls::default()
            },
        ),
    ];
    for (what, c) in penalties {
        let got = same_everywhere(&h, &with_controls(c), what).ids;
        eprintln!("{what}: {got:?}");
        assert_ne!(got, plain, "{what} should change the output");
    }

    // top_k 1 and min_p 1 make sampling greedy even at temperature 20
    // (the tiny model's logits span tens): every method emits the plain
    // greedy output, unlike plain sampling.
    let hot = |top_k, min_p| GenRequest {
        sampling: SamplingParams {
            temperature: 20.0,
            top_k,
            min_p,
            seed: Some(9),
            ..SamplingParams::default()
        },
        ..base()
    };
    let sampled = collect(h.submit(hot(0, 0.0)).unwrap()).ids;
    assert_ne!(sampled, plain, "sampling at temperature 20 should differ");
    assert_eq!(same_everywhere(&h, &hot(1, 0.0), "top_k").ids, plain);
    assert_eq!(same_everywhere(&h, &hot(0, 1.0), "min_p").ids, plain);

    // A stop id that greedy decoding reaches early ends it there; with
    // min_tokens it is masked until then.
    let stop = plain[3];
    let first = plain.iter().position(|&t| t == stop).unwrap();
    let stopped = GenRequest {
        stop_token_ids: vec![stop],
        ..base()
    };
    let out = same_everywhere(&h, &stopped, "stop_token_ids");
    assert_eq!(out.ids, plain[..first]);
    assert_eq!(out.reason, Some(FinishReason::Stop));
    let min_tokens = GenRequest {
        controls: Controls {
            min_tokens: 20,
            ..Controls::default()
        },
        ..stopped
    };
    let out = same_everywhere(&h, &min_tokens, "min_tokens");
    assert!(
        out.ids.len() >= 19,
        "stopped before min_tokens: {:?}",
        out.ids
    );
    assert!(!out.ids[..19].contains(&stop));
    assert_ne!(out.ids, plain);
}

/// A toy regular language over the tiny vocabulary: LEN tokens, where the
/// token at position i is FORCED when i % 5 == 4 and otherwise any id
/// t != EOS with t % 3 == i % 3; then EOS. Every commit is recorded.
#[derive(Debug, Clone, Default)]
struct Toy {
    commits: Arc<Mutex<Vec<u32>>>,
}

const LEN: usize = 14;
const FORCED: u32 = 7;
const EOS: u32 = 0;

fn toy_ok(pos: usize, t: u32) -> bool {
    if pos >= LEN {
        t == EOS
    } else if pos % 5 == 4 {
        t == FORCED
    } else {
        t != EOS && (t as usize) % 3 == pos % 3
    }
}

struct ToyState {
    committed: usize,
    done: bool,
    log: Arc<Mutex<Vec<u32>>>,
}

impl TokenConstraint for ToyState {
    fn allowed(&mut self, pending: &[u32]) -> Result<TokenMask, ConstraintError> {
        Ok(mask_at(VOCAB, self.committed + pending.len(), toy_ok))
    }

    fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        valid_prefix_at(self.committed, tokens, toy_ok)
    }

    fn forced(&mut self, pending: &[u32]) -> Vec<u32> {
        let mut pos = self.committed + pending.len();
        let mut out = Vec::new();
        while pos < LEN && pos % 5 == 4 {
            out.push(FORCED);
            pos += 1;
        }
        if pos >= LEN {
            out.push(EOS);
        }
        out
    }

    fn commit(&mut self, tokens: &[u32]) -> Result<(), ConstraintError> {
        for &t in tokens {
            if self.done || !toy_ok(self.committed, t) {
                return Err(ConstraintError(format!(
                    "token {t} at {} is not allowed",
                    self.committed
                )));
            }
            self.done = t == EOS;
            self.committed += 1;
            self.log.lock().unwrap().push(t);
        }
        Ok(())
    }
}

impl ConstraintSource for Toy {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, ConstraintError> {
        Ok(Box::new(ToyState {
            committed: 0,
            done: false,
            log: self.commits.clone(),
        }))
    }
}

/// Never starts.
#[derive(Debug)]
struct Broken;

impl ConstraintSource for Broken {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, ConstraintError> {
        Err(ConstraintError("cannot compile".into()))
    }
}

fn grammar_request(
    toy: &Toy,
    method: SpecMethod,
    k: usize,
    sampling: SamplingParams,
) -> GenRequest {
    GenRequest {
        grammar: Some(Arc::new(toy.clone())),
        stop_token_ids: vec![EOS],
        method: Some(method),
        num_speculative_tokens: Some(k),
        sampling,
        ..base()
    }
}

#[test]
fn a_grammar_only_emits_allowed_tokens_and_commits_exactly_the_output() {
    let h = engine(256);
    let plain = collect(h.submit(base()).unwrap()).ids;
    let greedy = SamplingParams::default();
    let hot = SamplingParams {
        temperature: 1.0,
        seed: Some(4),
        ..SamplingParams::default()
    };
    let mut reference: Option<Vec<u32>> = None;
    for sampling in [greedy, hot] {
        for (method, k) in [
            (SpecMethod::Off, 0),
            (SpecMethod::Ngram, 3),
            (SpecMethod::Ngram, 8),
            (SpecMethod::Draft, 2),
            (SpecMethod::Draft, 6),
        ] {
            let toy = Toy::default();
            let out = collect(
                h.submit(grammar_request(&toy, method, k, sampling))
                    .unwrap(),
            );
            let what = format!("{method:?} k={k} t={}", sampling.temperature);
            assert_eq!(out.error, None, "{what}");
            assert_eq!(out.reason, Some(FinishReason::Stop), "{what}");
            assert_eq!(out.ids.len(), LEN, "{what}: {:?}", out.ids);
            for (i, &t) in out.ids.iter().enumerate() {
                assert!(toy_ok(i, t), "{what}: token {t} at {i} is not allowed");
            }
            // The constraint saw the output and the EOS that ended it,
            // never a rejected draft.
            let mut expect = out.ids.clone();
            expect.push(EOS);
            assert_eq!(*toy.commits.lock().unwrap(), expect, "{what}");
            if sampling == greedy {
                match &reference {
                    None => reference = Some(out.ids.clone()),
                    Some(r) => assert_eq!(&out.ids, r, "{what}"),
                }
            }
        }
    }
    assert_ne!(
        reference.unwrap(),
        plain[..LEN],
        "the grammar changed nothing"
    );
    // The greedy grammar output is the same at every k.
    same_everywhere(
        &h,
        &grammar_request(&Toy::default(), SpecMethod::Off, 0, greedy),
        "grammar",
    );
    // Forced tokens were proposed for free and counted.
    let s = h.stats().spec;
    assert!(s.grammar_forced_tokens > 0, "{s:?}");
    assert!(s.grammar_draft_tokens >= s.grammar_forced_tokens);
    assert!(s.grammar_accepted_tokens > 0, "{s:?}");

    // A grammar that cannot start is refused at submit.
    let err = h
        .submit(GenRequest {
            grammar: Some(Arc::new(Broken)),
            ..base()
        })
        .unwrap_err();
    assert!(
        matches!(
            err,
            specgate::engine::EngineError::Rejected {
                part: specgate::engine::RequestPart::Grammar,
                ..
            }
        ),
        "{err:?}"
    );
}

/// A constraint that fails at its third commit: the request ends with an
/// error event, never with an unconstrained token.
#[derive(Debug)]
struct FailsLater;

struct FailsLaterState(usize);

impl TokenConstraint for FailsLaterState {
    fn allowed(&mut self, pending: &[u32]) -> Result<TokenMask, ConstraintError> {
        if self.0 + pending.len() >= 3 {
            return Err(ConstraintError("the grammar broke".into()));
        }
        Ok(TokenMask::all(VOCAB))
    }
    fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        tokens.len()
    }
    fn forced(&mut self, _pending: &[u32]) -> Vec<u32> {
        Vec::new()
    }
    fn commit(&mut self, tokens: &[u32]) -> Result<(), ConstraintError> {
        self.0 += tokens.len();
        Ok(())
    }
}

impl ConstraintSource for FailsLater {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, ConstraintError> {
        Ok(Box::new(FailsLaterState(0)))
    }
}

#[test]
fn a_failing_grammar_ends_its_request_alone_with_an_error() {
    let h = engine(256);
    for (method, k) in [(SpecMethod::Off, 0), (SpecMethod::Draft, 4)] {
        let bad = h
            .submit(GenRequest {
                grammar: Some(Arc::new(FailsLater)),
                method: Some(method),
                num_speculative_tokens: Some(k),
                ..base()
            })
            .unwrap();
        let good = h.submit(base()).unwrap();
        let out = collect(bad);
        assert!(out.ids.len() <= 3, "{:?}", out.ids);
        assert!(out.error.unwrap().contains("the grammar broke"));
        assert_eq!(collect(good).ids.len(), 32);
    }
    wait_idle(&h);
}

fn wait_idle(h: &EngineHandle) {
    let t = Instant::now();
    loop {
        let s = h.stats();
        if s.running == 0 && s.waiting == 0 && s.free_blocks == s.num_blocks {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "never idle: {s:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn assert_logprobs_close(a: &[TokenLogprob], b: &[TokenLogprob], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.token, y.token, "{what} #{i}");
        assert!(
            (x.logprob - y.logprob).abs() < 1e-4,
            "{what} #{i}: {x:?} {y:?}"
        );
        assert_eq!(x.top.len(), y.top.len(), "{what} #{i}");
        for (p, q) in x.top.iter().zip(&y.top) {
            assert!((p.1 - q.1).abs() < 1e-4, "{what} #{i}: {x:?} {y:?}");
        }
        // Ids may swap only between near-equal alternatives.
        let ids = |t: &TokenLogprob| t.top.iter().map(|p| p.0).collect::<Vec<_>>();
        if ids(x) != ids(y) {
            let gaps = x.top.windows(2).any(|w| (w[0].1 - w[1].1).abs() < 1e-4);
            assert!(gaps, "{what} #{i}: {x:?} {y:?}");
        }
    }
}

#[test]
fn logprobs_with_speculation_equal_logprobs_without() {
    let h = engine(256);
    let req = GenRequest {
        logprobs: Some(5),
        controls: Controls {
            presence_penalty: 10.0,
            repetition_penalty: 1.5,
            logit_bias: vec![(3, 5.0)],
            ..Controls::default()
        },
        ..base()
    };
    let reference = same_everywhere(&h, &req, "logprobs");
    assert_eq!(reference.logprobs.len(), reference.ids.len());
    for (lp, &id) in reference.logprobs.iter().zip(&reference.ids) {
        assert_eq!(lp.token, id);
        assert_eq!(lp.top.len(), 5);
        // Greedy: the chosen token is the most likely processed one.
        assert_eq!(lp.top[0].0, id);
        assert!(lp.logprob.is_finite() && lp.logprob <= 0.0);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }
    for (method, k) in [
        (SpecMethod::Ngram, 4),
        (SpecMethod::Draft, 3),
        (SpecMethod::Draft, 7),
    ] {
        let out = collect(
            h.submit(GenRequest {
                method: Some(method),
                num_speculative_tokens: Some(k),
                ..req.clone()
            })
            .unwrap(),
        );
        assert_eq!(out.ids, reference.ids);
        assert_logprobs_close(
            &out.logprobs,
            &reference.logprobs,
            &format!("{method:?} k={k}"),
        );
    }
    // Under a grammar, tokens it forbids are at the finite floor.
    let out = collect(
        h.submit(GenRequest {
            logprobs: Some(20),
            ..grammar_request(
                &Toy::default(),
                SpecMethod::Draft,
                3,
                SamplingParams::default(),
            )
        })
        .unwrap(),
    );
    assert_eq!(out.logprobs.len(), LEN);
    // Position 4 is forced: one token has all the mass.
    assert!(out.logprobs[4].logprob.abs() < 1e-6);
    assert_eq!(out.logprobs[4].top[1].1, -9999.0);
    assert!(out
        .logprobs
        .iter()
        .flat_map(|l| l.top.iter().map(|p| p.1))
        .all(f32::is_finite));
}

/// log-softmax of the target's raw logits at each prompt position, for
/// the next prompt token.
fn expected_prompt_logprobs(prompt: &[u32]) -> Vec<(u32, f32)> {
    let model = target();
    let mut pool = KvPool::for_model(&model, 4, 16).unwrap();
    let table = [0u32, 1, 2, 3];
    let rows = model
        .forward_one(&mut pool, prompt, 0, &table, LogitsWanted::All)
        .unwrap();
    rows[..prompt.len() - 1]
        .iter()
        .zip(&prompt[1..])
        .map(|(row, &t)| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max as f64
                + row
                    .iter()
                    .map(|&l| ((l - max) as f64).exp())
                    .sum::<f64>()
                    .ln();
            (t, (row[t as usize] as f64 - lse) as f32)
        })
        .collect()
}

#[test]
fn prompt_logprobs_come_first_chunked_or_cached() {
    // 40-token prompt (2 full blocks + 8), chunks of at most 16 rows.
    let long: Vec<u32> = (0..40).map(|i| (i * 17 % 300) as u32 + 1).collect();
    let expect = expected_prompt_logprobs(&long);
    let h = engine(16);
    let req = GenRequest {
        prompt: long.clone(),
        prompt_logprobs: Some(3),
        max_new_tokens: 4,
        ..base()
    };
    // The first fills the prefix cache; the later ones would hit it, and
    // must still get every position's logprobs.
    let plain = collect(
        h.submit(GenRequest {
            prompt_logprobs: None,
            ..req.clone()
        })
        .unwrap(),
    );
    assert!(plain.prompt_logprobs.is_none());
    for method in [SpecMethod::Off, SpecMethod::Draft] {
        let out = collect(
            h.submit(GenRequest {
                method: Some(method),
                ..req.clone()
            })
            .unwrap(),
        );
        assert_eq!(out.ids, plain.ids);
        let got = out.prompt_logprobs.expect("prompt logprobs were asked for");
        assert_eq!(got.len(), long.len() - 1);
        for (i, (g, &(t, lp))) in got.iter().zip(&expect).enumerate() {
            assert_eq!(g.token, t, "position {i}");
            assert!(
                (g.logprob - lp).abs() < 1e-4,
                "position {i}: {} vs {lp}",
                g.logprob
            );
            assert_eq!(g.top.len(), 3);
        }
    }
    // A one-token prompt has no logprobs to give, and says so first.
    let out = collect(
        h.submit(GenRequest {
            prompt: vec![9],
            ..req
        })
        .unwrap(),
    );
    assert_eq!(out.prompt_logprobs, Some(vec![]));
    wait_idle(&h);
}

#[test]
fn bad_controls_are_refused_naming_their_part() {
    use specgate::engine::{EngineError, RequestPart, MAX_TOP_LOGPROBS};
    let h = engine(64);
    let part = |r: GenRequest| match h.submit(r) {
        Err(EngineError::Rejected { part, .. }) => part,
        other => panic!("not rejected: {:?}", other.map(|_| ())),
    };
    let bias = GenRequest {
        controls: Controls {
            logit_bias: vec![(VOCAB as u32, 1.0)],
            ..Controls::default()
        },
        ..base()
    };
    assert_eq!(part(bias), RequestPart::LogitBias);
    let lp = GenRequest {
        logprobs: Some(MAX_TOP_LOGPROBS + 1),
        ..base()
    };
    assert_eq!(part(lp), RequestPart::Logprobs);
    let plp = GenRequest {
        prompt_logprobs: Some(MAX_TOP_LOGPROBS + 1),
        ..base()
    };
    assert_eq!(part(plp), RequestPart::PromptLogprobs);
    assert!(h
        .submit(GenRequest {
            logprobs: Some(MAX_TOP_LOGPROBS),
            ..base()
        })
        .is_ok());
}

/// Preemption (recompute) keeps the processing state, the logprobs and the
/// prompt logprobs (each prompt token once) as they are without it.
#[test]
fn preemption_keeps_controls_logprobs_and_prompt_logprobs() {
    let req = |i: usize| {
        let len = 3 + (i * 7) % 40;
        GenRequest {
            prompt: (0..len)
                .map(|j| ((i * 31 + j * 5) % 300) as u32 + 1)
                .collect(),
            max_new_tokens: 60,
            logprobs: Some(2),
            prompt_logprobs: Some(2),
            controls: Controls {
                presence_penalty: 10.0,
                frequency_penalty: 2.0,
                ..Controls::default()
            },
            ..base()
        }
    };
    let alone = engine(64);
    let reference: Vec<Output> = (0..12)
        .map(|i| collect(alone.submit(req(i)).unwrap()))
        .collect();
    // 12 blocks of 16 cannot hold the 12 sequences as they grow.
    let h = engine_sized(12, 12, 64);
    let rxs: Vec<_> = (0..12)
        .map(|i| {
            h.submit(GenRequest {
                method: Some(if i % 2 == 0 {
                    SpecMethod::Draft
                } else {
                    SpecMethod::Ngram
                }),
                ..req(i)
            })
            .unwrap()
        })
        .collect();
    for (i, (rx, r)) in rxs.into_iter().zip(&reference).enumerate() {
        let out = collect(rx);
        let what = format!("request {i}");
        assert_eq!(out.error, None, "{what}");
        assert_eq!(out.ids, r.ids, "{what}");
        assert_logprobs_close(&out.logprobs, &r.logprobs, &what);
        let (got, want) = (
            out.prompt_logprobs.unwrap(),
            r.prompt_logprobs.clone().unwrap(),
        );
        assert_eq!(got.len(), req(i).prompt.len() - 1, "{what}");
        assert_logprobs_close(&got, &want, &what);
    }
    wait_idle(&h);
    assert!(
        h.stats().preemptions > 0,
        "the pool was meant to be too small"
    );
}
